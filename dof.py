"""
Algorithm 1 of the paper: how many features does each layer's linear attention need?

    python dof.py --model gpt2 --lam 0.0625 --J 2048 --budget 64 --data data/wikipedia

For every layer and head: pool the head's queries and keys (after rotary) on calibration text and draw J of them,
x_1..x_J; form the Gram matrix G_ij = K(x_i, x_j) = exp(x_i.x_j / sqrt d) and the empirical operator G / J. The
head's degrees of freedom are

    N_lam = sum_i mu_i / (mu_i + lam) = tr(G (G + J lam I)^-1),   mu_i the eigenvalues of G / J.

A layer's DoF is the maximum over its heads (they share one feature dimension), and the layer gets a feature
dimension proportional to it, scaled so that the mean over layers is the budget C (same average cost as Fix: C
everywhere):

    M_l = C N_l / mean(N).

DoF+Clip caps each layer at the head size. Per head (distill.py --alloc dof-head), M_lh = C N_lh / mean(N) over
all heads instead.

The count M ~ N_lam log N_lam comes from features drawn from the kernel's ridge leverage density (Bach 2017),

    q_lam(z) ~ l(z) N(z; 0, I),   l(z) = <phi_z, (Sigma + lam I)^-1 phi_z>,   E_z~N(0,I)[l(z)] = N_lam,

with importance weights that keep the kernel estimate unbiased; `leverage_features` draws them (section 4).
"""

import json
import math
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import model as M
from common import (ModelError, atomic_path, check_positive, opt, parse_config, pick_device, read_tokens, run_main,
                    write_text_atomic)
from tokenizer import load_tokenizer


# ----------------------------------------------------------------------------------------------------------------
# 1. Queries and keys: a uniform random sample of J per head, memory bounded by J

def attention_cores(model):
    """model.h[l].attn.core for every layer, or a ModelError when the model has no attention of a known kind."""
    known = tuple(c for c in (getattr(M, "SoftmaxAttention", None), getattr(M, "LinearAttention", None)) if c)
    cores = [getattr(getattr(b, "attn", None), "core", None) for b in getattr(model, "h", None) or []]
    if not cores or not all(isinstance(c, known) for c in cores):
        raise ModelError(f"{type(model).__name__} has no attention layers of a known kind (model.h[l].attn.core: "
                         "SoftmaxAttention or LinearAttention); load the checkpoint with model.GPT.from_pretrained")
    return cores


@contextmanager
def capture_qk(model):
    """While inside, each forward pass of `model` appends every layer's (q (B, H, T, D), k (B, Hkv, T, D)): the
    inputs of model.h[l].attn.core, after rotary. Yields the list; the one q/k hook of dof.py and distill.py."""
    seen = []
    handles = [c.register_forward_pre_hook(lambda mod, args: seen.append((args[0], args[1])))
               for c in attention_cores(model)]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def collect_qk(model, batches, J, seed=0, key_means=None):
    """Run token batches (B, T) through the frozen model; -> (n_layer, n_head, J, head_dim) float32 on the CPU.
    Each query head pools its queries with its KV head's keys (minus key_means[l] (H, D), if given); every point
    gets an i.i.d. uniform random key and the J points with the largest keys are kept as the batches stream by (a
    reservoir: uniform without replacement)."""
    L = len(attention_cores(model))
    gen = torch.Generator().manual_seed(seed)
    kept, prio = [None] * L, [None] * L                               # per layer: (H, <=J, D) points, (H, <=J) keys
    device = next(model.parameters()).device
    for idx in batches:
        with capture_qk(model) as qk:
            model.hidden(idx.to(device))                               # hidden states: skip the unused lm_head
        for l, (q, k) in enumerate(qk):                               # (B, H, T, D), (B, Hkv, T, D)
            H, D = q.size(1), q.size(-1)
            k = M.repeat_kv(k, H)                                    # each query head sees its KV head's keys
            if key_means is not None:
                k = k - key_means[l][:, None].to(k)
            x = torch.cat((q, k), 2).transpose(0, 1).reshape(H, -1, D).float().cpu()   # (H, 2BT, D)
            r = torch.rand(x.shape[:2], generator=gen)
            if kept[l] is not None:
                x, r = torch.cat((kept[l], x), 1), torch.cat((prio[l], r), 1)
            top = r.topk(min(J, r.size(1)), dim=1).indices              # (H, <=J)
            kept[l], prio[l] = x.gather(1, top[..., None].expand(-1, -1, D)), r.gather(1, top)
    n = 0 if kept[0] is None else kept[0].size(1)
    if n < J:
        raise ModelError(f"J={J} is larger than the {n} queries+keys per head in the calibration data; "
                         "lower J or give more calibration tokens")
    return torch.stack(kept)


# ----------------------------------------------------------------------------------------------------------------
# 2. Degrees of freedom: N_lam = sum mu / (mu + lam) over the eigenvalues of G / J

def dof_reference(S, lam, relative=False):
    """Logits S (..., J, J), S_ij = x_i.x_j / sqrt d -> N_lam (...) = sum_i mu_i / (mu_i + lam), mu the eigenvalues
    of G / J, G = exp(S). relative=True: lam := lam * tr(G / J), which makes N invariant to K -> cK."""
    J = S.size(-1)
    G = S.exp()                                                             # (..., J, J)
    mu = torch.linalg.eigvalsh(G / J).clamp(min=0)                          # (..., J)
    if relative:
        lam = lam * G.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True) / J
    return (mu / (mu + lam)).sum(-1)


# Needed once the largest logit passes ~40: float64 eigvalsh resolves eigenvalues only down to ~1e-16 of the
# largest (~e^max S), so those near lam are lost, and past 709 exp(S) overflows (past 88 in float32).
def dof_from_logits(S, lam, relative=False, J=None):
    """The same N_lam from the logits S (..., n, n) without forming exp(S). With c = J lam (relative: lam tr(G)),
    a_i = G_ii / (G_ii + c) and D = diag(G_ii + c):

        G + cI = D^1/2 A D^1/2,   A = D^-1/2 G D^-1/2 + c D^-1,   A_ij = exp(S_ij - (S_ii + S_jj) / 2) sqrt(a_i a_j),

    A_ii = 1 and every entry of A lies in [0, 1] (Cauchy-Schwarz), whatever the logits. Then
    N = tr(G (G + cI)^-1) = n - c tr((G + cI)^-1) = n - sum_i (1 - a_i) (A^-1)_ii, A^-1 from A's Cholesky factor.
    J (default n): the number of points when S's n rows stand for several copies each (see degrees_of_freedom)."""
    n = S.size(-1)
    C, _, w = regularised_cholesky(S, lam, relative, n if J is None else J)
    A_inv_diag = torch.cholesky_inverse(C).diagonal(dim1=-2, dim2=-1)       # (..., n)
    return (n - (w * A_inv_diag).sum(-1)).clamp(0, n if J is None else J)


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
    """x (..., J, d) queries+keys per head -> N_lam (...) float64 of K(x, y) = exp(x.y / sqrt d), one head at a time
    in float64 on x's device (relative=True: lam times tr(G / J)). Exact duplicates (a position-0 query or key
    depends only on its token) make G singular; each distinct point enters once, its m copies folded into its
    logits, S_ij + (log m_i + log m_j) / 2, which leaves the nonzero eigenvalues of G / J unchanged."""
    if not lam > 0:
        raise ModelError(f"lambda must be positive, got {lam}")
    if not torch.isfinite(x).all():
        raise ModelError("the queries/keys contain inf or nan; check the model's weights and dtype")
    *batch, J, d = x.shape
    N = []
    for xh in x.reshape(-1, J, d):
        xu, m = torch.unique(xh.double(), dim=0, return_counts=True)         # (n, d) distinct points, (n,) copies
        half_log_m = m.double().log() / 2
        S = xu @ xu.T / math.sqrt(d) + half_log_m[:, None] + half_log_m[None, :]   # (n, n)
        N.append(dof_from_logits(S, lam, relative, J))
    return torch.stack(N).reshape(batch)


# ----------------------------------------------------------------------------------------------------------------
# 3. Feature dimensions for a budget: M_l = C N_l / mean(N), per layer or per head

def allocate(dof, budget, clip=None, order="dof"):
    """DoF per layer (n_layer,) or per head (n_layer, n_head) -> feature dims of the same shape (nested lists of
    int), proportional to the DoF with mean exactly `budget`, so the total is budget x entries.
    clip: cap at the head size (DoF+Clip; nothing is redistributed, so the mean can fall below the budget).
    order: "dof"; "reverse" (the same dims, largest DoF getting the smallest); "fix" (budget everywhere)."""
    N = np.asarray(torch.as_tensor(dof, dtype=torch.float64).cpu())
    shape, N = N.shape, N.reshape(-1)
    if int(budget) != budget or budget < 1:
        raise ModelError(f"the budget must be a whole number of at least 1 feature per layer, got {budget}")
    if order not in ("dof", "reverse", "fix"):
        raise ModelError(f"order must be dof, reverse or fix, got {order!r}")
    if N.size == 0 or not np.isfinite(N).all() or (N < 0).any():
        raise ModelError(f"allocate needs finite non-negative DoF, one per layer or head, got {N.tolist()}")
    C = int(budget)
    if order == "fix":
        dims = np.full(N.size, C)
    else:
        if N.sum() == 0:
            N = np.ones(N.size)                                             # no DoF anywhere: uniform
        dims = whole_dims(C * N / N.mean())                                 # M_l = C N_l / mean(N), then rounded
        if order == "reverse":
            rev = np.empty_like(dims)
            rev[np.argsort(-N, kind="stable")] = np.sort(dims)              # k-th largest DoF, k-th smallest dim
            dims = rev
    if clip is not None:
        dims = np.minimum(dims, int(clip))
    return dims.astype(int).reshape(shape).tolist()


def whole_dims(M):
    """Real dims M (n,) -> whole dims >= 1 with the same sum: a layer whose share is below 1 gets 1 and the others
    share the rest in proportion to M (repeated until none is below 1), then largest-remainder rounding."""
    total, one = round(M.sum()), np.zeros(M.size, bool)                     # one: layers pinned at 1
    while True:
        share = (total - one.sum()) * M / M[~one].sum()
        low = ~one & (share < 1)
        if not low.any():
            break
        one |= low
    dims = np.where(one, 1, np.floor(share)).astype(int)
    remainder = np.where(one, -1.0, share - np.floor(share))
    dims[np.argsort(-remainder, kind="stable")[:total - dims.sum()]] += 1
    return dims


# ----------------------------------------------------------------------------------------------------------------
# 4. Features drawn from the kernel's ridge leverage scores (Bach 2017), the density Algorithm 1's M ~ N_lam assumes

def prf_log(x, z):
    """log phi_z(x) = z.x~ - |x~|^2 / 2, x~ = x / d^(1/4): the PRF feature of direction z with alpha = 1 and
    without the 1/sqrt(M), so that E_z[phi_z(x) phi_z(y)] = K(x, y). x (n, d), z (P, d) -> (n, P)."""
    xt = x * x.size(-1) ** -0.25
    return xt @ z.mT - 0.5 * xt.square().sum(-1, keepdim=True)


def leverage_reference(x, z, lam, relative=False):
    """The plain form: the ridge leverage of each feature direction z_p (P, d) on the points x (J, d),

        l(z) = <phi_z, (Sigma + lam I)^-1 phi_z> in L2 of the points = phi_z^T (G + J lam I)^-1 phi_z,

    phi_z = (phi_z(x_1), ..., phi_z(x_J)), G = exp(x x^T / sqrt d) (relative: lam := lam tr(G / J)). Its mean
    over z ~ N(0, I) is the DoF N_lam. -> (P,) float64; overflows for large logits (see leverage_log)."""
    x, z = x.double(), z.double()
    G = (x @ x.T / math.sqrt(x.size(-1))).exp()                              # (J, J)
    c = lam * (G.trace() if relative else x.size(0))
    phi = prf_log(x, z).exp()                                                # (J, P)
    return (phi * torch.linalg.solve(G + c * torch.eye(len(G), dtype=G.dtype), phi)).sum(0)


def leverage_log(x, z, lam, relative=False):
    """log l(z) of leverage_reference without forming G or phi: with G + cI = D^1/2 C C^T D^1/2
    (regularised_cholesky), l(z) = |C^-1 D^-1/2 phi_z|^2, and D^-1/2 phi_z is formed from its logs shifted by
    their largest value (one factor for all z, added back to the logs). x (J, d), z (P, d) -> (P,) float64."""
    x, z = x.double(), z.double()
    C, u, _ = regularised_cholesky(x @ x.T / math.sqrt(x.size(-1)), lam, relative, x.size(0))
    b = prf_log(x, z) + u[:, None]                                           # log of D^-1/2 phi_z (J, P)
    top = b.max()
    y = torch.linalg.solve_triangular(C, (b - top).exp(), upper=False)       # C^-1 D^-1/2 phi_z e^-top
    return 2 * top + y.square().sum(0).log()


def leverage_features(x, M, lam, relative=False, pool=16, generator=None):
    """M PRF features of one head from its ridge leverage density q(z) ~ l(z) N(z; 0, I), on its points x (J, d):
    a pool of P = pool x M candidates z_p ~ N(0, I), M taken by systematic resampling with probabilities
    pi_p = l(z_p) / sum l (candidate p taken M pi_p times in expectation; a likely one can be taken twice), and
    importance weights alpha_m = 1 / (P pi_p(m)) (PRF's sqrt(alpha_m / M)). Then, for any q, k,

        E[sum_m alpha_m phi_zm(q) phi_zm(k) / M] = E[sum_p (M pi_p / M) phi_zp(q) phi_zp(k) / (P pi_p)]
                                                 = E[sum_p phi_zp(q) phi_zp(k) / P] = K(q, k):

    unbiased, as plain Gaussian PRF. -> z (M, d), log_alpha (M,), float32."""
    P = pool * M
    z = torch.randn(P, x.size(-1), generator=generator, dtype=torch.float64)
    log_l = leverage_log(x, z, lam, relative)                                # (P,)
    pi = torch.softmax(log_l, 0)                                             # l / sum l
    u = (torch.rand((), generator=generator, dtype=torch.float64) + torch.arange(M, dtype=torch.float64)) / M
    take = torch.searchsorted(pi.cumsum(0), u).clamp_max(P - 1)              # systematic resampling (M,)
    return z[take].float(), (-(P * pi[take]).log()).float()


@torch.no_grad()
def init_leverage(core, x, lam, relative=False, pool=16, generator=None):
    """Set every head's PRF directions and weights of a LinearAttention `core` by leverage_features on that head's
    points x (H, J, d), head by head in the order of its groups."""
    heads = core.split(torch.arange(core.n_head)[None])                        # head numbers of each group
    for f, hs in zip(core.feature_maps, heads):
        for i, h in enumerate(hs[0].tolist()):
            f.z[i], f.log_alpha[i] = leverage_features(x[h].double(), f.M, lam, relative, pool, generator)


# ----------------------------------------------------------------------------------------------------------------
# 5. The command: a model's DoF profile

@dataclass
class DofConfig:
    """Degrees of freedom of every head's attention kernel and the feature dimensions they give each layer (the
    paper's Algorithm 1)."""
    model: str = opt("gpt2", "checkpoint: hub id (gpt2, EleutherAI/pythia-160m), local directory, .gguf file or "
                     "smollm2-135m")
    data: str = opt("data/wikipedia", "calibration text: a uint16 token file (train.bin/val.bin), a directory "
                    "holding train.bin, or a text file")
    J: int = opt(2048, "queries+keys drawn per head; the DoF is estimated from a J x J Gram matrix (the paper does "
                 "not give its J)")
    lam: float = opt(2 ** -4, "lambda of N = tr(S (S + lambda I)^-1) (paper: 2^-4 for GPT-2, 2^-8 for Pythia-1B); "
                     "with --lam-relative a fraction of tr(S)")
    lam_relative: bool = opt(False, "take --lam as a fraction of tr(S), invariant to the kernel's scale (for large "
                             "q/k norms, e.g. SmolLM2)")
    budget: int = opt(64, "mean feature dimension C over the layers (paper, GPT-2: 64)")
    tokens: int = opt(8192, "calibration tokens read from --data (each gives one query and one key per head)")
    batch_size: int = opt(4, "sequences per forward pass")
    block_size: int = opt(1024, "tokens per sequence (capped at the model's context length)")
    device: str = opt("auto", "auto (cuda if available), cpu, cuda or cuda:N")
    seed: int = opt(0, "seed of the random sample of queries+keys")
    out: str = opt("out-dof", "output directory for dof.json and the heatmap (dof.png, or dof.txt without "
                   "matplotlib)")

    def __post_init__(self):
        check_positive(self, ("J", "tokens", "batch_size", "block_size"))
        if not self.lam > 0:
            raise ModelError(f"--lam must be positive, got {self.lam}")
        if self.budget < 1:
            raise ModelError(f"--budget must be at least 1 feature per layer, got {self.budget}")


def calibration_tokens(cfg, vocab_size):
    """--data (a token file, a directory holding train.bin, or a text file) -> up to cfg.tokens ids (np.int64)."""
    p = Path(cfg.data)
    p = p / "train.bin" if p.is_dir() else p
    enc = None if p.suffix == ".bin" or not p.is_file() else load_tokenizer(cfg.model)
    tokens = np.asarray(read_tokens(p, enc, cfg.tokens), dtype=np.int64)
    if len(tokens) and tokens.max() >= vocab_size:
        raise ModelError(f"{p} holds token id {tokens.max()} but the model has {vocab_size} embeddings; "
                         "tokenize the data with this model's tokenizer")
    if cfg.J > 2 * len(tokens):
        raise ModelError(f"--J {cfg.J} is larger than the {2 * len(tokens)} queries+keys per head in {len(tokens)} "
                         f"calibration tokens; lower --J or give more text (--tokens, --data)")
    return tokens


def batches_of(tokens, B, T):
    """Consecutive sequences of T tokens, B per batch; the tail (< T tokens) is a last batch of its own."""
    n = len(tokens) // T
    out = list(torch.from_numpy(tokens[:n * T]).view(n, T).split(B))
    if len(tokens) > n * T:
        out.append(torch.from_numpy(tokens[n * T:])[None])
    return out


def lam_text(cfg):
    return f"{cfg.lam:g} x tr(S)" if cfg.lam_relative else f"{cfg.lam:g}"


def print_table(cfg, mc, n_tokens, per_head, dims):
    layer = per_head.max(1)
    sat = layer / cfg.J
    print(f"{cfg.model}: {mc.n_layer} layers x {mc.n_head} heads, head size {mc.head_dim}; J={cfg.J} of "
          f"{2 * n_tokens} queries+keys per head, lambda={lam_text(cfg)}, budget {cfg.budget}")
    print(f"{'layer':>5} {'DoF max':>9} {'DoF mean':>9} {'max/J':>6} {'DoF':>5} {'DoF+Clip':>8} {'Fix':>5}")
    for l in range(mc.n_layer):
        print(f"{l:5d} {layer[l]:9.2f} {per_head[l].mean():9.2f} {sat[l]:6.3f} {dims['DoF'][l]:5d} "
              f"{dims['DoF+Clip'][l]:8d} {dims['Fix'][l]:5d}")
    print(f"{'mean':>5} {layer.mean():9.2f} {per_head.mean():9.2f} {sat.mean():6.3f} {np.mean(dims['DoF']):5.1f} "
          f"{np.mean(dims['DoF+Clip']):8.1f} {np.mean(dims['Fix']):5.1f}")


def warn_if_saturated(sat):
    """DoF/J > 0.9 in a layer: the estimate saturates at J and the dims tend to Fix."""
    hot = [l for l, s in enumerate(sat) if s > 0.9]
    if not hot:
        return
    which = "every layer has" if len(hot) == len(sat) else \
        f"layer{'s' if len(hot) > 1 else ''} {', '.join(map(str, hot))} {'have' if len(hot) > 1 else 'has'}"
    print(f"warning: {which} DoF/J > 0.9, so the estimate is saturated (lambda is too small for this model's "
          "query/key scale and the dims tend to Fix); raise --lam or use --lam-relative (e.g. --lam-relative "
          "--lam 1e-3)", file=sys.stderr)


def write_outputs(cfg, result, per_head, dims):
    """dof.json, and dof.png (or dof.txt, printed, without matplotlib) in cfg.out."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "dof.json", json.dumps(result, indent=1))
    if plot(out / "dof.png", per_head, dims, f"{cfg.model}: J={cfg.J}, lambda={lam_text(cfg)}, budget {cfg.budget}"):
        print(f"wrote {out / 'dof.json'} and {out / 'dof.png'}")
    else:
        write_text_atomic(out / "dof.txt", text_heatmap(per_head))
        print(text_heatmap(per_head), end="")
        print(f"wrote {out / 'dof.json'} and {out / 'dof.txt'} (pip install matplotlib for dof.png)")


def main(argv=None):
    cfg = parse_config(DofConfig, argv)
    device, _ = pick_device(cfg.device, "float32")                           # queries and keys in float32
    model = M.GPT.from_pretrained(cfg.model, device=device)
    attention_cores(model)                                                    # fail early on a model without
    mc = model.config                                                         # attention of a known kind
    tokens = calibration_tokens(cfg, mc.vocab_size)

    t0 = time.time()
    batches = batches_of(tokens, cfg.batch_size, min(cfg.block_size, mc.block_size))
    x = collect_qk(model, tqdm(batches, desc="queries/keys", unit="batch"), cfg.J, cfg.seed)   # (L, H, J, D)
    t1 = time.time()
    per_head = torch.stack([degrees_of_freedom(x[l].to(device), cfg.lam, cfg.lam_relative).cpu()
                            for l in tqdm(range(mc.n_layer), desc="DoF", unit="layer")]).numpy()  # (L, H)
    t2 = time.time()
    layer = per_head.max(1)                                                   # heads share the layer's dimension
    sat = layer / cfg.J                                                       # > 0.9: saturated at J
    dims = {"DoF": allocate(layer, cfg.budget), "DoF+Clip": allocate(layer, cfg.budget, clip=mc.head_dim),
            "Fix": allocate(layer, cfg.budget, order="fix"), "Reverse": allocate(layer, cfg.budget, order="reverse")}

    print_table(cfg, mc, len(tokens), per_head, dims)
    print(f"queries/keys {t1 - t0:.1f}s, DoF {t2 - t1:.1f}s")
    warn_if_saturated(sat)
    result = {"settings": {**asdict(cfg), "device": device, "n_layer": mc.n_layer, "n_head": mc.n_head,
                           "head_dim": mc.head_dim, "calibration_tokens": len(tokens)},
              "per_head_dof": per_head.tolist(), "layer_dof": layer.tolist(), "saturation": sat.tolist(),
              "dims": dims, "seconds": {"collect": t1 - t0, "dof": t2 - t1}}
    write_outputs(cfg, result, per_head, dims)


# ----------------------------------------------------------------------------------------------------------------
# 6. The figure

def plot(path_png, per_head, dims, title):
    """Per-head DoF heatmap and per-layer dims; False when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    L, H = per_head.shape
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, max(3, 0.3 * L + 1.5)))
    im = a0.imshow(per_head, aspect="auto", cmap="viridis")
    a0.set(xlabel="head", ylabel="layer", title="DoF per head")
    if H <= 32:
        a0.set_xticks(range(H))
    fig.colorbar(im, ax=a0, label="DoF")
    for i, (name, d) in enumerate(dims.items()):
        a1.barh(np.arange(L) + (i - 1.5) * 0.2, d, height=0.2, label=name)
    a1.invert_yaxis()
    a1.set(xlabel="feature dimension", ylabel="layer", title="dims per layer")
    a1.legend()
    fig.suptitle(title)
    fig.tight_layout()
    with atomic_path(path_png) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
    return True


def text_heatmap(per_head):
    ramp, top = " .:-=+*#%@", max(float(per_head.max()), 1e-12)
    rows = ["".join(ramp[min(9, int(10 * v / top))] for v in row) for row in per_head]
    return f"DoF per head (rows: layers, columns: heads; '@' = {top:.1f})\n" + \
        "\n".join(f"{l:3d} |{r}|" for l, r in enumerate(rows)) + "\n"


if __name__ == "__main__":
    run_main(main)
