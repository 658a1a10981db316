"""Algorithm 1 of the paper: how many features does each layer's linear attention need?

    python dof.py --model gpt2 --lam 0.0625 --J 2048 --budget 64 --data data/wikipedia

For every layer and head: pool the head's queries and keys (after rotary) on calibration windows, draw J of them
(collect_qk), form the Gram matrix G_ij = K(x_i, x_j) = exp(x_i.x_j / sqrt d); the head's degrees of freedom are

    N_lam = sum_i mu_i / (mu_i + lam) = tr(G (G + J lam I)^-1),   mu_i the eigenvalues of G / J   (degrees_of_freedom).

A layer's DoF is the maximum over its heads (they share one feature dimension); layer l gets M_l = C N_l / mean(N)
features (allocate), so the mean is the budget C (the cost of Fix: C everywhere). DoF+Clip caps M_l at the head
size; Reverse hands the same dims out in the opposite order (a control). With key centring it is the DoF of the
student's kernel, K(q, k - mu). choose_dims does all of it for distill.py; main spells it out."""

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from common import (ModelError, check_free_memory, check_out, check_positive, check_tokenizer, get_batch, opt,
                    parse_config, pick_device, read_tokens, run_main, write_text_atomic)
from model import GPT, repeat_kv
from tokenizer import load_tokenizer

RULES = ("dof", "fix", "clip", "reverse")  # Fix: C everywhere; DoF+Clip: capped at the head size; Reverse: a control


@torch.no_grad()
def teacher_qk(model, idx):
    """idx (B, T) -> per layer, in fp32, the q (B, H, T, D) and k (B, Hkv, T, D) its core sees (after rotary)."""
    seen = []
    hooks = [c.register_forward_pre_hook(lambda mod, args: seen.append(args[:2])) for c in model.cores()]
    try:
        model.hidden(idx)                                              # hidden states: skip the unused lm_head
    finally:
        for h in hooks:
            h.remove()
    return [(q.float(), k.float()) for q, k in seen]


def key_means(model, batches):
    """Each layer's mean key over the batches, repeated to the query heads -> (L, H, D), LinearAttention.key_mean."""
    sums = sum(torch.stack([k.sum(dim=(0, 2)) for _, k in teacher_qk(model, idx)]) for idx in batches)   # (L, Hkv, D)
    n = sum(idx.numel() for idx in batches)                                  # tokens
    return repeat_kv((sums / n)[:, :, None], model.config.n_head)[:, :, 0]   # (L, H, D)


@torch.no_grad()
def collect_qk(model, batches, J, seed=0, key_means=None):
    """Token batches (B, T) -> (L, H, J, D) fp32: each query head's queries pooled with its KV head's keys (minus
    key_means (L, H, D) if given), the J of highest i.i.d. uniform priority: uniform sampling without replacement."""
    gen, kept, prio = torch.Generator().manual_seed(seed), None, None
    for idx in batches:
        x = []
        for l, (q, k) in enumerate(teacher_qk(model, idx)):                   # (B, H, T, D), (B, Hkv, T, D)
            k = repeat_kv(k, q.size(1)) - (0 if key_means is None else key_means[l][:, None].to(k))
            x.append(torch.cat((q, k), 2).transpose(0, 1).flatten(1, 2))       # (H, 2BT, D)
        x = torch.stack(x)                                                     # (L, H, 2BT, D)
        r = torch.rand(x.shape[:3], generator=gen).to(x.device)               # the points' priorities
        x, r = (x, r) if kept is None else (torch.cat((kept, x), 2), torch.cat((prio, r), 2))
        top = r.topk(min(J, r.size(2)), dim=2).indices                        # (L, H, <=J)
        kept, prio = x.gather(2, top[..., None].expand(-1, -1, -1, x.size(-1))), r.gather(2, top)
    if kept is None or kept.size(2) < J:
        raise ModelError(f"J={J} is more than the {0 if kept is None else kept.size(2)} queries+keys per head in "
                         "the calibration data; lower J or give more calibration tokens")
    return kept


def dof_reference(S, lam, relative=False):
    """Logits S (..., J, J), S_ij = x_i.x_j / sqrt d -> N_lam (...) = sum_i mu_i / (mu_i + lam), mu the eigenvalues
    of G / J, G = exp(S). relative=True: lam := lam * tr(G / J), which makes N invariant to K -> cK."""
    J = S.size(-1)
    G = S.exp()                                                             # (..., J, J)
    mu = torch.linalg.eigvalsh(G / J).clamp(min=0)                          # (..., J)
    if relative:
        lam = lam * G.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True) / J
    return (mu / (mu + lam)).sum(-1)


def dof_from_logits(S, lam, relative=False, J=None):
    """The same N_lam from the logits S (..., n, n) without exp(S), which overflows past 709 and past ~40 puts the
    eigenvalues near lam below float64's resolution. With c = J lam (relative: lam tr(G)), a_i = G_ii / (G_ii + c):
        G + cI = D^1/2 A D^1/2,   D = diag(G_ii + c),   A = D^-1/2 G D^-1/2 + c D^-1,
    A_ij = exp(S_ij - (S_ii + S_jj) / 2) sqrt(a_i a_j) (i != j), A_ii = 1: all in [0, 1] whatever S (Cauchy-Schwarz).
    Then N = tr(G (G + cI)^-1) = n - c tr((G + cI)^-1) = n - sum_i (1 - a_i) (A^-1)_ii, A^-1 from A's Cholesky factor.
    J (default n): the number of points when S's n rows stand for several copies each (see degrees_of_freedom)."""
    n, J = S.size(-1), S.size(-1) if J is None else J
    C, _, w = regularised_cholesky(S, lam, relative, J)
    return (n - (w * torch.cholesky_inverse(C).diagonal(dim1=-2, dim2=-1)).sum(-1)).clamp(0, J)   # (A^-1)_ii


def regularised_cholesky(S, lam, relative, J):
    """dof_from_logits' factorisation: logits S (..., n, n) -> (C, u, w): C the Cholesky factor of A, u_i =
    log D_ii^-1/2 = -log(G_ii + c) / 2 and w_i = 1 - a_i = c / (G_ii + c), so that G + cI = D^1/2 C C^T D^1/2."""
    s = S.diagonal(dim1=-2, dim2=-1)                                        # (..., n) log G_ii = |x_i|^2 / sqrt d
    log_c = math.log(lam) + (torch.logsumexp(s, -1, keepdim=True) if relative else math.log(J))
    u = (F.logsigmoid(s - log_c) - s) / 2                                   # (log a_i - S_ii) / 2
    w = torch.sigmoid(log_c - s)                                            # 1 - a_i = c / (G_ii + c)
    A = (S + u[..., :, None] + u[..., None, :]).exp()                       # D^-1/2 G D^-1/2
    A.diagonal(dim1=-2, dim2=-1).add_(w)                                    # + c D^-1
    C, info = torch.linalg.cholesky_ex(A)
    if info.any():
        raise ModelError("the kernel matrix is numerically singular (near-duplicate queries/keys with logits far "
                         "above log(J lambda)); raise --lam or use --lam-relative, which keeps it well conditioned")
    return C, u, w


def degrees_of_freedom(x, lam, relative=False):
    """x (..., J, d) queries+keys per head -> N_lam (...) of K(x, y) = exp(x.y / sqrt d), a head at a time in float64
    (relative=True: lam times tr(G / J)). Exact duplicates (position 0 depends only on the token) make G singular, so
    a point with m copies enters once, with logits S_ij + (log m_i + log m_j) / 2: G / J's nonzero eigenvalues stay."""
    if not (lam > 0 and math.isfinite(lam) and torch.isfinite(x).all()):
        raise ModelError(f"the DoF needs a positive lambda (got {lam}) and queries/keys without inf or nan; check "
                         "--lam, and the model's weights and dtype")
    *batch, J, d = x.shape
    N = []
    for xh in x.reshape(-1, J, d):
        xu, m = torch.unique(xh.double(), dim=0, return_counts=True)         # (n, d) distinct points, (n,) copies
        half_log_m = m.double().log() / 2
        S = xu @ xu.T / math.sqrt(d) + half_log_m[:, None] + half_log_m[None, :]   # (n, n)
        N.append(dof_from_logits(S, lam, relative, J))
    return torch.stack(N).reshape(batch)


def allocate(dof, budget, rule="dof", head_dim=None):
    """DoF (n,) -> whole feature dims (list of int) by a rule of RULES: "dof" in proportion to the DoF with mean
    exactly `budget`, "clip" those capped at head_dim (DoF+Clip), "reverse" them largest DoF smallest, "fix" the
    budget everywhere."""
    N = np.asarray(torch.as_tensor(dof, dtype=torch.float64).cpu()).reshape(-1)
    if int(budget) != budget or budget < 1:
        raise ModelError(f"the budget must be a whole number of at least 1 feature per layer, got {budget}")
    if rule not in RULES:
        raise ModelError(f"the rule must be one of {', '.join(RULES)}, got {rule!r}")
    if N.size == 0 or not np.isfinite(N).all() or (N < 0).any():
        raise ModelError(f"allocate needs finite non-negative DoF, one per layer, got {N.tolist()}")
    C, N = int(budget), N if N.sum() > 0 else np.ones(N.size)                 # no DoF anywhere: uniform
    dims = np.full(N.size, C) if rule == "fix" else whole_dims(C * N / N.mean())    # M_l = C N_l / mean(N)
    if rule == "reverse":
        dims[np.argsort(-N, kind="stable")] = np.sort(dims)                 # k-th largest DoF, k-th smallest dim
    return np.minimum(dims, head_dim if rule == "clip" else dims.max()).astype(int).tolist()


def whole_dims(M):
    """Real dims M (n,) -> whole dims >= 1 with the same sum: a layer whose share is below 1 gets 1 and the others
    share the rest in proportion to M (repeated until none is below 1), then largest-remainder rounding."""
    total, one = round(M.sum()), np.zeros(M.size, bool)                     # one: layers pinned at 1
    share = total * M / M.sum()
    while (share[~one] < 1).any():
        one |= share < 1
        share = (total - one.sum()) * M / M[~one].sum()
    dims = np.where(one, 1, np.floor(share)).astype(int)
    remainder = np.where(one, -1.0, share - np.floor(share))
    dims[np.argsort(-remainder, kind="stable")[:total - dims.sum()]] += 1
    return dims


def parse_dims(text, n_layer):
    """--dims "8,16,..." -> n_layer whole dims >= 1, or a ModelError."""
    try:
        dims = [int(x) for x in text.split(",")]
    except ValueError:
        dims = []
    if len(dims) != n_layer or min(dims, default=0) < 1:
        raise ModelError(f"--dims needs {n_layer} comma-separated positive integers, one per layer, got {text!r}")
    return dims


def choose_dims(model, batches, budget, alloc="dof", lam=2 ** -4, relative=False, J=2048, seed=0, key_means=None):
    """Algorithm 1 -> (dims per layer, the layer DoF or None for Fix): J queries+keys per head from the batches
    (keys minus key_means: the kernel the student learns), N_lam per head, its maximum per layer, allocate."""
    if alloc == "fix":
        return [int(budget)] * model.config.n_layer, None
    layer = degrees_of_freedom(collect_qk(model, batches, J, seed, key_means), lam, relative).amax(-1).cpu()
    return allocate(layer, budget, alloc, model.config.head_dim), layer.tolist()


def calibration_batches(tokens, n, B, T, seed, device):
    """n batches (B, T) of random training windows, by a generator of seed + 2: alike in dof.py and distill.py."""
    gen = torch.Generator().manual_seed(seed + 2)
    return [get_batch(tokens, B, T, gen, device)[0] for _ in range(n)]


@dataclass
class DofConfig:
    """Every head's DoF and each layer's dims (Algorithm 1), on the windows distill.py draws with the same flags."""
    model: str = opt("gpt2", "checkpoint: hub id, local directory, .gguf file or smollm2-135m")
    data: str = opt("data/wikipedia", "directory of train.bin (data/*/prepare.py, or made by distill.py)")
    budget: int = opt(64, "mean feature dimension C over the layers (paper, GPT-2: 64)")
    lam: float = opt(2 ** -4, "lambda (paper: 2^-4 for GPT-2, 2^-8 for Pythia-1B); --lam-relative: times tr(G / J)")
    lam_relative: bool = opt(False, "take --lam as a fraction of tr(G / J), the mean K(x, x): invariant to K's scale")
    J: int = opt(2048, "queries+keys drawn per head: the DoF comes from a J x J Gram matrix")
    center_keys: bool = opt(False, "the DoF of the centred kernel K(q, k - mu) that distill.py --center-keys trains")
    calib_batches: int = opt(4, "calibration batches (as distill.py)")
    batch_size: int = opt(8, "windows per calibration batch (as distill.py)")
    block_size: int = opt(1024, "tokens per window, at most the model's context (as distill.py)")
    seed: int = opt(0, "seed of the calibration windows and of the sample of queries+keys (as distill.py)")
    device: str = opt("auto", "auto (cuda if available), cpu, cuda or cuda:N")
    out: str = opt("out-dof", "output directory for dof.json")

    def __post_init__(self):
        check_positive(self, ("J", "budget", "calib_batches", "batch_size", "block_size"))
        check_positive(self, ("lam",), 0, above=True)
        check_positive(self, ("seed",), 0)                                  # as distill.py: windows it can draw too
        check_out(self.out, ("dof.json",))


def main(argv=None):
    cfg = parse_config(DofConfig, argv)
    device, _ = pick_device(cfg.device, "float32")                           # queries and keys in float32
    model = GPT.from_pretrained(cfg.model, device=device)
    mc = model.config
    cfg.block_size = T = min(cfg.block_size, mc.block_size)                 # dof.json records the length used
    B, H = cfg.batch_size, mc.n_head       # a batch's activations and attention, its q and k twice; all the tokens
    check_free_memory(4 * B * T * (mc.n_layer * (3 * H + mc.n_kv_head) * mc.head_dim + 2 * mc.mlp_hidden + H * T) + 8 *
                      cfg.calib_batches * B * T, device, f"the calibration pass at --batch-size {B} x --block-size {T}",
                      "lower --batch-size, --block-size or --calib-batches")
    check_tokenizer(cfg.data, lambda: load_tokenizer(cfg.model), cfg.model)          # as distill.py checks it
    tokens = read_tokens(Path(cfg.data) / "train.bin", vocab_size=mc.vocab_size, min_tokens=T + 1)
    t0 = time.time()
    batches = calibration_batches(tokens, cfg.calib_batches, cfg.batch_size, T, cfg.seed, device)
    x = collect_qk(model, batches, cfg.J, cfg.seed, key_means(model, batches) if cfg.center_keys else None)
    per_head = torch.stack([degrees_of_freedom(x[l], cfg.lam, cfg.lam_relative).cpu()
                            for l in tqdm(range(mc.n_layer), desc="DoF", unit="layer")]).numpy()   # (L, H)
    layer = per_head.max(1)
    dims = {a: allocate(layer, cfg.budget, a, mc.head_dim) for a in RULES}
    print(f"{cfg.model}: J={cfg.J} queries+keys per head{' (keys centred)' if cfg.center_keys else ''}, lambda="
          f"{cfg.lam:g}{' x tr(G / J)' if cfg.lam_relative else ''}, budget {cfg.budget}\n{'layer':>5} {'DoF max':>8} "
          f"{'mean':>8} {'max/J':>6}" + "".join(f" {a:>7}" for a in dims))
    for l, (top, mean) in enumerate(zip(layer, per_head.mean(1))):
        print(f"{l:5d} {top:8.2f} {mean:8.2f} {top / cfg.J:6.3f}" + "".join(f" {d[l]:7d}" for d in dims.values()))
    if layer.max() > 0.9 * cfg.J:
        print("warning: DoF/J > 0.9: the estimate saturates at J; raise --lam or use --lam-relative", file=sys.stderr)
    result = {"settings": asdict(cfg), "per_head_dof": per_head.tolist(), "layer_dof": layer.tolist(), "dims": dims,
              "seconds": time.time() - t0}
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    write_text_atomic(Path(cfg.out) / "dof.json", json.dumps(result, indent=1))
    print(f"wrote {Path(cfg.out) / 'dof.json'} ({result['seconds']:.1f}s)")


if __name__ == "__main__":
    run_main(main)
