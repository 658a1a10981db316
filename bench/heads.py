"""
Per-head measurement on a real model: the error of untrained and trained feature maps against the feature count
M, per head, and whether features in proportion to each head's DoF even out the error across heads.

    python bench/heads.py                # SmolLM2-135M layers 0, 15, 29 and the synthetic check; ~10 minutes
    python bench/heads.py --synthetic    # the synthetic Gaussian-kernel check alone; seconds
    python docs/experiments.py --report  # their tables in docs/results.md, docs/fig-heads.png

Error: held-out KL(p || p^) of each head's normalised causal attention rows (the softmax loss of distill.py),
averaged over queries, on --eval-seqs sequences of val.bin; features drawn or trained on --calib-seqs sequences of
train.bin, keys centred by their calibration mean (as distill.py --center-keys). Feature maps, for each M:
  gaussian     PRF with z ~ N(0, I), alpha = 1 (the paper's init)
  orthogonal   Performer's orthogonal random features
  leverage     PRF drawn from each head's ridge leverage density (experiments/leverage.py)
  trained      PRF from the gaussian init, --steps Adam steps of the softmax loss on the calibration sequences
  trained-leverage   the same from the leverage init (experiments/leverage.py)
Untrained maps are the mean over --seeds draws. Then per head at M = N_lam (rounded) for gaussian and leverage,
and the spread of the error across heads at mean M = --budget (gaussian, leverage, trained): the same M for every
head against M ~ N_lam.

The synthetic check has the kernel itself to compare with: J = 128 points x ~ N(0, s^2 I_8), K = exp(x x^T / sqrt 8)
exactly, M = N_lam of those points; the relative error |K^ - K|_F / |K|_F (what the leverage density is optimal
for) and the mean KL of K's normalised rows (what attention uses), over 100 draws of each map.
"""

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "experiments")]   # the core, and its forks (leverage, per_head)
import datafiles  # noqa: E402
import devices  # noqa: E402
import distill  # noqa: E402
import dof  # noqa: E402
import door  # noqa: E402
import files  # noqa: E402
import model  # noqa: E402
from committed import check_committed  # noqa: E402
from leverage import init_leverage, leverage_features, prf_log  # noqa: E402
from per_head import GroupedLinearAttention, layer_losses  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

METHODS = ("gaussian", "orthogonal", "leverage", "trained", "trained-leverage")
EQUAL = ("gaussian", "leverage", "trained")


@dataclass
class HeadsConfig(door.Config):
    """Per-head error of linear attention against M for untrained and trained feature maps."""
    model: str = door.opt("smollm2-135m", "teacher checkpoint")
    data: str = door.opt("data/wikitext-smollm2", "directory of train.bin / val.bin in the teacher's tokens")
    layers: list[int] = door.opt([0, 15, 29], "layers to measure (all their heads)")
    Ms: list[int] = door.opt([8, 16, 32, 64, 128], "feature counts")
    block_size: int = door.opt(256, "tokens per sequence", min=1)
    calib_seqs: int = door.opt(4, "calibration sequences (DoF, key means, leverage, training)", min=1)
    eval_seqs: int = door.opt(4, "held-out sequences the error is measured on", min=1)
    J: int = door.opt(1024, "points per head for the DoF and the leverage scores", min=1)
    lam: float = door.opt(1e-3, "lambda, relative to tr(G / J) (as the SmolLM2 experiments)", above=0)
    budget: int = door.opt(32, "mean M of the equal-error comparison", min=1)
    steps: int = door.opt(100, "Adam steps of the trained maps", min=0)
    seeds: int = door.opt(3, "draws averaged for the untrained maps", min=1)
    synthetic: bool = door.opt(False, "only the synthetic Gaussian-kernel check (seconds)")
    out: str = door.opt("docs/results/heads-kl", "directory of the results: smollm2.json, synthetic.json")

    def __post_init__(self):
        super().__post_init__()
        if not self.Ms or min(self.Ms) < 1 or not self.layers or min(self.layers) < 0:
            raise door.ModelError(f"--Ms must be one or more feature counts of at least 1, got {self.Ms}" if not self.Ms
                             or min(self.Ms) < 1 else f"--layers must be one or more layers from 0, got {self.layers}")
        if self.J > 2 * self.calib_seqs * self.block_size:
            raise door.ModelError(f"--J {self.J} is more than the {2 * self.calib_seqs * self.block_size} queries and keys "
                             "a head has in --calib-seqs x --block-size; lower --J or raise --calib-seqs")
        files.check_out(self.out, ("smollm2.json", "synthetic.json"))
        committed = ROOT / "docs" / "results" / "heads-kl"                      # SmolLM2-135M's numbers, in git
        if self.model != "smollm2-135m" and not self.synthetic and Path(self.out).resolve() == committed:
            raise door.ModelError(f"--out {self.out} holds SmolLM2-135M's committed numbers (smollm2.json); pass another "
                             f"--out for {self.model}'s")
        ours = {k: v for k, v in asdict(self).items() if k not in ("out", "synthetic")}
        check_committed(self.out, ours, "settings", file="smollm2.json")   # other settings had replaced them


def sequences(path, n, T, seed, vocab_size):
    tokens = datafiles.read_tokens(path, vocab_size=vocab_size, min_tokens=T + 1)
    g = np.random.default_rng(seed)
    return torch.from_numpy(np.stack([tokens[i:i + T].astype(np.int64) for i in g.integers(0, len(tokens) - T, n)]))


@torch.no_grad()
def head_kl(core, q, k):
    """(H,) held-out KL(p || p^) per head of a GroupedLinearAttention (distill.softmax_loss), mean over sequences
    and queries; q (B, H, T, D), k (B, Hkv, T, D)."""
    kl = torch.empty(core.n_head)
    for c, hs, (qg, kg, _) in zip(core.groups, core.heads, core.split(q, k)):
        qi, ki = c.inputs(qg, kg)
        kl[hs] = distill.softmax_loss(qi, ki, *c.features(qi, ki)).mean((0, 2))
    return kl


def make_core(cfg, mc, dims, kind, mu, x, seed):
    """A per-head core of one feature map kind (METHODS' untrained ones) with dims (one M, or one per head)."""
    torch.manual_seed(seed)
    dims = [dims] * mc.n_head if isinstance(dims, int) else dims
    core = GroupedLinearAttention(mc.n_head, mc.n_kv_head, mc.head_dim, dims,
                                  "performer" if kind == "orthogonal" else "prf")
    gen = torch.Generator().manual_seed(seed)
    for c, hs in zip(core.groups, core.heads):
        c.key_mean.copy_(mu[hs])
        if kind == "leverage":
            init_leverage(c, x[hs], cfg.lam, True, 16, gen)
    return core


def train(core, q, k, steps):
    fm = [c.feature_map for c in core.groups]
    opt_ = torch.optim.Adam([{"params": [f.z for f in fm], "lr": 0.02},
                             {"params": [f.log_alpha for f in fm], "lr": 0.2}])
    for _ in range(steps):
        layer_losses([core], [(q, k)], "softmax", q.size(2), scale=1.0)
        opt_.step()
        opt_.zero_grad()
    return core


def calibration_points(qc, kc, H, J):
    """Each head's mean calibration key mu (H, D) and J of its calibration queries and centred keys (H, J, D)."""
    mu = model.repeat_kv(kc.mean((0, 2))[None, :, None], H)[0, :, 0]                               # (H, D)
    x = torch.cat((qc, model.repeat_kv(kc, H) - mu[:, None]), 2).transpose(0, 1).flatten(1, 2)    # (H, 2BT, D)
    return mu, x[:, torch.randperm(x.size(1), generator=torch.Generator().manual_seed(0))[:J]]


def map_kl(cfg, mc, dims, kind, mu, x, calib, held):
    """(H,) held-out KL of one feature map (METHODS): an untrained one the mean over --seeds draws, a trained one
    --steps Adam steps on the calibration (q, k) from draw 0 of its init. held: the held-out (q, k)."""
    if kind.startswith("trained"):
        init = "leverage" if kind == "trained-leverage" else "gaussian"
        return head_kl(train(make_core(cfg, mc, dims, init, mu, x, 0), *calib, cfg.steps), *held)
    return torch.stack([head_kl(make_core(cfg, mc, dims, kind, mu, x, s), *held) for s in range(cfg.seeds)]).mean(0)


def measure(cfg):
    teacher = model.GPT.from_pretrained(cfg.model)
    mc = teacher.config
    if max(cfg.layers) >= mc.n_layer:
        raise door.ModelError(f"{cfg.model} has layers 0-{mc.n_layer - 1}; pass --layers among them (got {cfg.layers})")
    if cfg.block_size > mc.block_size:
        raise door.ModelError(f"{cfg.model} has a context of {mc.block_size} tokens; pass a --block-size within it (got "
                         f"{cfg.block_size})")
    n, T, H = cfg.calib_seqs + cfg.eval_seqs, cfg.block_size, mc.n_head
    m = max(cfg.Ms + [cfg.budget * len(cfg.layers) * H])             # a head's M ~ N_lam is at most the whole budget
    devices.check_free_memory(4 * n * T * (mc.n_layer * (H + mc.n_kv_head) * mc.head_dim + 2 * mc.mlp_hidden + 6 * H * (T + m))
                      + 8 * 16 * m * (mc.head_dim + 3 * cfg.J), "cpu", f"{n} sequences (--calib-seqs + --eval-seqs) of "
                      f"{T} tokens with up to {m:,} features a head", "lower them, --Ms or --budget")
    datafiles.check_tokenizer(cfg.data, lambda: load_tokenizer(cfg.model), cfg.model)          # as distill.py checks it
    calib = sequences(Path(cfg.data) / "train.bin", cfg.calib_seqs, cfg.block_size, 0, mc.vocab_size)
    held = sequences(Path(cfg.data) / "val.bin", cfg.eval_seqs, cfg.block_size, 1, mc.vocab_size)
    qk_c, qk_h = dof.teacher_qk(teacher, calib), dof.teacher_qk(teacher, held)
    points = {l: calibration_points(*qk_c[l], mc.n_head, cfg.J) for l in cfg.layers}
    res = {"settings": asdict(cfg), "layers": []}
    for l in cfg.layers:
        mu, x = points[l]
        N = dof.degrees_of_freedom(x, cfg.lam, relative=True)                                # (H,)
        row = {"layer": l, "dof": N.tolist(), "kl": {}}
        for kind in METHODS:
            row["kl"][kind] = {}
            for m in cfg.Ms:
                kl = map_kl(cfg, mc, m, kind, mu, x, qk_c[l], qk_h[l])
                row["kl"][kind][str(m)] = kl.tolist()
                print(f"layer {l} {kind:10s} M={m:4d}: KL mean over heads {kl.mean():.3f}", flush=True)
        at_n = [max(1, round(n)) for n in N.tolist()]
        row["at_dof"] = {"M": at_n, **{kind: map_kl(cfg, mc, at_n, kind, mu, x, qk_c[l], qk_h[l]).tolist()
                                       for kind in ("gaussian", "leverage")}}
        res["layers"].append(row)
    m = budget_M(res["settings"])            # trained from each init, draw by draw: draw 0 is the table's trained rows
    res["trained_draws"] = {kind: [[float(np.mean(r["kl"][kind][str(m)])) for r in res["layers"]]] + [
        [head_kl(train(make_core(cfg, mc, m, init, *points[l], s), *qk_c[l], cfg.steps), *qk_h[l]).mean().item()
         for l in cfg.layers] for s in range(1, cfg.seeds)]
        for kind, init in (("trained", "gaussian"), ("trained-leverage", "leverage"))}
    # equal error? mean M = budget over the measured heads: the same M everywhere against M ~ N_lam
    N = np.array([r["dof"] for r in res["layers"]])                                                 # (layers, H)
    prop = np.array(dof.allocate(N.ravel(), cfg.budget)).reshape(N.shape).tolist()
    res["equal"] = {"proportional_M": prop}
    for kind in EQUAL:
        same, propk = [], []
        for l, dims in zip(cfg.layers, prop):
            same.append(map_kl(cfg, mc, cfg.budget, kind, *points[l], qk_c[l], qk_h[l]).tolist())
            propk.append(map_kl(cfg, mc, dims, kind, *points[l], qk_c[l], qk_h[l]).tolist())
        res["equal"][kind] = {"same_M": same, "proportional": propk}
    return res


SCALES = (0.5, 0.7, 1.0, 1.2, 1.6)


def synthetic(cfg, J=128, d=8, draws=100):
    """Gaussian PRF against leverage-sampled PRF at M = N_lam on x ~ N(0, s^2 I_d), K = exp(x x^T / sqrt d)."""
    rows = []
    for s in SCALES:
        x = s * torch.randn(J, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        logK = x @ x.T / d ** 0.5
        logp = torch.log_softmax(logK, -1)
        N = float(dof.degrees_of_freedom(x[None], cfg.lam, relative=True)[0])
        m = max(1, round(N))
        row = {"scale": s, "dof": N, "M": m}
        for kind in ("gaussian", "leverage"):
            err, kl = [], []
            for seed in range(draws):
                g = torch.Generator().manual_seed(seed)
                if kind == "gaussian":
                    z = torch.randn(m, d, generator=g, dtype=torch.float64)
                    log_alpha = torch.zeros(m, dtype=torch.float64)
                else:
                    z, log_alpha = (t.double() for t in leverage_features(x, m, cfg.lam, True, 16, g))
                phi = (prf_log(x, z) + 0.5 * log_alpha).exp()                      # (J, M), alpha-weighted
                Khat = phi @ phi.T / m
                err.append(float((Khat - logK.exp()).norm() / logK.exp().norm()))
                logq = Khat.clamp_min(1e-300).log() - Khat.sum(-1, keepdim=True).log()
                kl.append(float((logp.exp() * (logp - logq)).sum(-1).mean()))
            row[kind] = {"kernel_error": float(np.mean(err)), "kernel_error_median": float(np.median(err)),
                         "kl": float(np.mean(kl)), "errors": err, "kls": kl}
        rows.append(row)
        print(f"scale {s}: N_lam {N:.1f}, kernel error gaussian {row['gaussian']['kernel_error']:.3f} leverage "
              f"{row['leverage']['kernel_error']:.3f}; KL {row['gaussian']['kl']:.3f} {row['leverage']['kl']:.3f}")
    return {"settings": {"J": J, "d": d, "draws": draws, "lam": cfg.lam, "pool": 16}, "rows": rows}


def synthetic_table(res):
    """Markdown: the synthetic check, one row per scale of the points."""
    rows = ["| scale s of x | N_lam = M | kernel error, mean (median): gaussian | leverage | leverage lower, "
            "draws | row KL: gaussian | leverage | leverage lower, draws |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        g, l = r["gaussian"], r["leverage"]
        wins = lambda key: f"{sum(a < b for a, b in zip(l[key], g[key]))} of {len(g[key])}"
        rows.append(f"| {r['scale']} | {r['M']} | {g['kernel_error']:.3g} ({g['kernel_error_median']:.3g}) "
                    f"| {l['kernel_error']:.3g} ({l['kernel_error_median']:.3g}) | {wins('errors')} | {g['kl']:.3f} "
                    f"| {l['kl']:.3f} | {wins('kls')} |")
    st = res["settings"]
    rows += ["", f"J = {st['J']} points in d = {st['d']} (seed 0), relative lambda {st['lam']:g}; {st['draws']} "
             f"draws of each map (seeds 0–{st['draws'] - 1}; draw s of both maps from seed s), leverage from a pool "
             f"of {st['pool']}·M. The kernel error is heavy-tailed: a few Gaussian draws are off by far more than "
             f"the kernel itself, so its mean and median differ."]
    return "\n".join(rows)


def budget_M(settings):
    """The M of --Ms nearest --budget: the per-head error's M in the tables and the figure (32)."""
    return min(settings["Ms"], key=lambda m: abs(m - settings["budget"]))


def cv(a):
    a = np.asarray(a, float).ravel()
    return a.std() / a.mean()


def table(res):
    """Markdown: mean KL over the measured heads per feature map and M; then M = N_lam and the spread."""
    Ms = res["settings"]["Ms"]
    kl = lambda kind, m: np.mean([r["kl"][kind][str(m)] for r in res["layers"]])
    rows = ["| feature map | " + " | ".join(f"M = {m}" for m in Ms) + " |", "|---|" + "---:|" * len(Ms)]
    rows += [f"| {kind} | " + " | ".join(f"{kl(kind, m):.3f}" for m in Ms) + " |" for kind in METHODS]
    st, n = res["settings"], sum(len(r["dof"]) for r in res["layers"])
    rows += ["", f"Mean held-out KL over the {n} heads of layers {', '.join(map(str, st['layers']))}; untrained maps "
             f"averaged over draws (seeds) 0–{st['seeds'] - 1}, trained maps one run from draw 0, {st['steps']} steps."]
    if "trained_draws" in res:                                   # (draws, layers) -> a mean over the heads per draw
        d = np.mean(res["trained_draws"]["trained-leverage"], 1) - np.mean(res["trained_draws"]["trained"], 1)
        se = f" ± {d.std(ddof=1) / np.sqrt(len(d)):.3f} (standard error;" if len(d) > 1 else " (one draw: no error;"
        rows += ["", f"Trained from the leverage init minus trained from the Gaussian one, M = {budget_M(st)}, paired "
                 f"draw by draw over draws 0–{len(d) - 1}: {d.mean():+.3f}{se} the draws "
                 f"{', '.join(f'{v:+.3f}' for v in d)})."]
    at = {k: np.concatenate([r["at_dof"][k] for r in res["layers"]]) for k in ("gaussian", "leverage")}
    wins = int((at["leverage"] < at["gaussian"]).sum())
    rows += ["", f"At M = N_lam (each head its own, rounded; {len(at['gaussian'])} heads): mean KL gaussian "
             f"{at['gaussian'].mean():.3f}, leverage {at['leverage'].mean():.3f}; leverage lower on {wins} heads.", ""]
    N = np.concatenate([r["dof"] for r in res["layers"]])
    rank, m = lambda a: np.argsort(np.argsort(a)), budget_M(st)
    mean = lambda a: f"{a.mean():.2f}" if a.size else "–"                            # –: no such heads
    for kind in ("gaussian", "trained"):
        e = np.concatenate([r["kl"][kind][str(m)] for r in res["layers"]])
        rows.append(f"- {kind}, M = {m}: Spearman correlation of a head's N_lam with its KL "
                    f"{np.corrcoef(rank(N), rank(e))[0, 1]:+.2f}; mean KL {mean(e[N < 3])} over the "
                    f"{(N < 3).sum()} heads with N_lam < 3, {mean(e[N >= 10])} over the {(N >= 10).sum()} with "
                    f"N_lam >= 10.")
    rows += ["", "| feature map | KL, M = budget for every head: mean (CV across heads) | KL, M ~ N_lam: mean (CV) |",
             "|---|---:|---:|"]
    for kind in EQUAL:
        e = res["equal"][kind]
        rows.append(f"| {kind} | {np.mean(e['same_M']):.3f} ({cv(e['same_M']):.2f}) | "
                    f"{np.mean(e['proportional']):.3f} ({cv(e['proportional']):.2f}) |")
    return "\n".join(rows)


def figure(res, path):
    """Mean KL against M per method, and each head's KL against its DoF; a note, not a figure, without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed, so {path} was not drawn; pip install matplotlib")
        return False
    Ms = res["settings"]["Ms"]
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 4))
    for kind in METHODS:
        a0.loglog(Ms, [np.mean([r["kl"][kind][str(m)] for r in res["layers"]]) for m in Ms], "o-", label=kind)
    a0.set(xlabel="features per head M", ylabel="held-out attention KL (mean over heads)",
           title=f"{res['settings']['model']}, layers {', '.join(map(str, res['settings']['layers']))}")
    a0.legend()
    N, m = np.concatenate([r["dof"] for r in res["layers"]]), budget_M(res["settings"])
    for kind, c in (("gaussian", "C0"), ("leverage", "C2")):
        a1.loglog(N, np.concatenate([r["kl"][kind][str(m)] for r in res["layers"]]), "o", color=c, alpha=0.7,
                  label=f"{kind}, M = {m}")
    a1.set(xlabel="head's DoF $N_\\lambda$", ylabel="held-out attention KL", title="per head: error against DoF")
    a1.legend()
    fig.tight_layout()
    with files.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return True


def main(argv=None):
    cfg = door.parse_config(HeadsConfig, argv)
    torch.set_grad_enabled(True)
    out = Path(cfg.out)
    parts = {"synthetic": (synthetic, synthetic_table)}
    if not cfg.synthetic:
        parts = {"smollm2": (measure, table), **parts}
    for name, (run, show) in parts.items():
        res = run(cfg)
        out.mkdir(parents=True, exist_ok=True)                  # after the checks and the work
        files.write_text_atomic(out / f"{name}.json", json.dumps(res, indent=1) + "\n")
        print(show(res))
        print(f"wrote {out / name}.json")


if __name__ == "__main__":
    door.run_main(main)
