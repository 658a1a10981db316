"""
Algorithm 1 of the paper: how many features does each layer's linear attention need?

    python dof.py --model gpt2 --lam 0.0625 --J 2048 --budget 64 --data data/wikipedia

For every layer and head: pool the head's queries and keys (after rotary) on calibration text and draw J of them,
x_1..x_J; form the Gram matrix G_ij = K(x_i, x_j) = exp(x_i.x_j / sqrt d) and the empirical operator S = G / J.
The head's degrees of freedom are

    N_lam = sum_i mu_i / (mu_i + lam) = tr(S (S + lam I)^-1),   mu_i the eigenvalues of S.

A layer's DoF is the maximum over its heads (they share one feature dimension), and the layer gets a feature
dimension proportional to it, scaled so that the mean over layers is the budget C (same average cost as Fix: C
everywhere). DoF+Clip caps each layer at the head size.
"""

import json
from contextlib import contextmanager
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import model as M
from common import ModelError, config_parser
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
def collect_qk(model, batches, J, seed=0):
    """Run token batches (B, T) through the frozen model; -> (n_layer, n_head, J, head_dim) float32 on the CPU.
    Each query head pools its queries with its KV head's keys; every point gets an i.i.d. uniform random key and
    the J points with the largest keys are kept as the batches stream by (a reservoir: uniform without replacement)."""
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
# 2. Degrees of freedom, from the logits x_i.x_j / sqrt d without ever forming exp(logits)

def tril_inverse(L, leaf=128):
    """Inverse of lower-triangular L (..., n, n) by halves: [[A, 0], [B, C]]^-1 = [[A^-1, 0], [-C^-1 B A^-1, C^-1]].
    All matmuls: ~4x faster on CPU than torch.linalg.solve_triangular(L, I), which does not know I is triangular."""
    n = L.size(-1)
    if n <= leaf:
        return torch.linalg.solve_triangular(L, torch.eye(n, dtype=L.dtype, device=L.device).expand_as(L), upper=False)
    h = n // 2
    Ai, Ci = tril_inverse(L[..., :h, :h], leaf), tril_inverse(L[..., h:, h:], leaf)
    top = torch.cat((Ai, torch.zeros_like(L[..., :h, h:])), -1)
    return torch.cat((top, torch.cat((-(Ci @ (L[..., h:, :h] @ Ai)), Ci), -1)), -2)


def dof_from_logits(S, lam, relative=False, keep=None):
    """S (..., J, J) float64 logits S_ij = x_i.x_j / sqrt d -> N_lam (...) of S~ = exp(S) / J.
    With G = exp(S) and c = J lam: N = tr(G (G + cI)^-1) = J - c tr((G + cI)^-1). Write G + cI = D^1/2 A D^1/2 with
    D = diag(G_ii + c), a_i = G_ii / (G_ii + c):  A_ij = exp(S_ij - (S_ii + S_jj) / 2) sqrt(a_i a_j), A_ii = 1, all
    entries in [0, 1] whatever the kernel's scale (Cauchy-Schwarz), so logits in the thousands cannot overflow and
    Cholesky stays accurate on such graded matrices. Then N = J - sum_i (1 - a_i) (A^-1)_ii.
    relative=True: lam := lam * tr(S~), which makes N invariant to K -> cK (S -> S + log c).
    keep (..., J) bool: points to leave out (False: an exact duplicate already counted in S through its copy's
    multiplicity; it adds an identity row to A and nothing to N)."""
    J = S.size(-1)
    s = S.diagonal(dim1=-2, dim2=-1)                                      # log G_ii = |x_i|^2 / sqrt d
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    log_c = (math.log(lam) + torch.logsumexp(s, -1, keepdim=True)) if relative else math.log(J * lam)
    w = torch.sigmoid(log_c - s)                                          # c / (G_ii + c) = 1 - a_i
    u = (F.logsigmoid(s - log_c) - s) / 2                                 # log(a_i) / 2 - S_ii / 2
    if keep is not None:
        u = u.masked_fill(~keep, -math.inf)                               # -> rows and columns of zeros
    A = (S + u[..., :, None]).add_(u[..., None, :]).exp_()
    A.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    C, info = torch.linalg.cholesky_ex(A)
    N = J - (w * tril_inverse(C).square().sum(-2)).sum(-1)                # (A^-1)_ii = sum_k (C^-1)_ki^2
    bad = info != 0             # numerically singular even so (near-duplicates far above lam): eigenvalues
    if bad.any():
        N[bad] = dof_reference(S[bad], lam, relative, None if keep is None else keep[bad])
    return N.clamp(0, J)


def dof_reference(S, lam, relative=False, keep=None):
    """The plain definition, for tests: eigenvalues mu of S~ = exp(S - m) / J (scaled by the largest logit m, so
    lam scales to lam e^-m), N = sum mu / (mu + lam) = sum sigmoid(log mu + m - log lam). O(J^3) eigvalsh: slow,
    and blind to eigenvalues below 1e-16 of the largest (see the tests)."""
    J = S.size(-1)
    if keep is not None:
        S = S.masked_fill(~(keep[..., :, None] & keep[..., None, :]), -math.inf)
    m = S.amax((-2, -1), keepdim=True)
    mu = torch.linalg.eigvalsh(torch.exp(S - m) / J).clamp(min=0)
    log_lam = math.log(lam) + (torch.logsumexp(S.diagonal(dim1=-2, dim2=-1), -1) - math.log(J) if relative else 0)
    return torch.sigmoid(mu.log() + m[..., 0] - torch.as_tensor(log_lam, dtype=S.dtype)[..., None]).sum(-1)


def multiplicities(x):
    """x (B, J, d) -> (log m (B, J), keep (B, J)): each distinct row's first copy carries its multiplicity m, later
    copies are dropped. Exact duplicates are common (position 0 depends only on its token; sink keys are huge)."""
    log_m, keep = torch.zeros(x.shape[:2], dtype=x.dtype), torch.zeros(x.shape[:2], dtype=torch.bool)
    for b in range(x.size(0)):
        _, inv, counts = torch.unique(x[b], dim=0, return_inverse=True, return_counts=True)
        first = torch.full_like(counts, x.size(1)).scatter_reduce_(0, inv, torch.arange(x.size(1)), "amin")
        keep[b, first], log_m[b, first] = True, counts.to(x.dtype).log()
    return log_m.to(x.device), keep.to(x.device)


def degrees_of_freedom(x, lam, relative=False):
    """x (..., J, d) queries+keys per head -> DoF (...) float64 of K(x, y) = exp(x.y / sqrt d) at ridge lam
    (relative=True: lam times tr(S~)). float64, a head or a few at a time (~6 J x J buffers each); on the CPU one
    head per thread, each single-threaded, which beats multithreaded LAPACK on a few (possibly shared) cores."""
    if not lam > 0:
        raise ModelError(f"lambda must be positive, got {lam}")
    if not torch.isfinite(x).all():
        raise ModelError("the queries/keys contain inf or nan; check the model's weights and dtype")
    *batch, J, d = x.shape
    chunks = x.reshape(-1, J, d).double().split(max(1, 2 ** 22 // (J * J)))

    def one(xc):
        log_m, keep = multiplicities(xc.cpu())
        S = xc @ xc.transpose(-1, -2) / math.sqrt(d) + (log_m[..., :, None] + log_m[..., None, :]) / 2
        return dof_from_logits(S, lam, relative, None if keep.all() else keep)

    threads = min(torch.get_num_threads(), len(chunks), 8)
    if x.device.type != "cpu" or threads == 1:
        return torch.cat([one(xc) for xc in chunks]).reshape(batch)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(threads) as pool:
            return torch.cat(list(pool.map(one, chunks))).reshape(batch)
    finally:
        torch.set_num_threads(saved)


# ----------------------------------------------------------------------------------------------------------------
# 3. Feature dimensions for a budget

def allocate(dof, budget, clip=None, order="dof"):
    """Per-layer DoF (n_layer,) -> feature dims (list of int), proportional to the DoF with mean exactly `budget`
    (largest-remainder rounding; a layer whose share is below 1 gets 1 and the others share the rest).
    clip: cap at the head size (DoF+Clip; nothing is redistributed, so the mean can fall below the budget).
    order: "dof"; "reverse" (the same dims, largest DoF getting the smallest); "fix" (budget everywhere)."""
    dof = np.asarray(torch.as_tensor(dof, dtype=torch.float64).cpu()).reshape(-1)
    if int(budget) != budget or budget < 1:
        raise ModelError(f"the budget must be a whole number of at least 1 feature per layer, got {budget}")
    if order not in ("dof", "reverse", "fix"):
        raise ModelError(f"order must be dof, reverse or fix, got {order!r}")
    if dof.size == 0 or not np.isfinite(dof).all() or (dof < 0).any():
        raise ModelError(f"allocate needs one finite non-negative DoF per layer, got {dof.tolist()}")
    n, budget = dof.size, int(budget)
    dims = np.full(n, budget)
    if order != "fix":
        w = dof if dof.sum() > 0 else np.ones(n)
        free = np.ones(n, bool)                                  # layers not pinned at 1
        while True:
            raw = (budget * n - (~free).sum()) * w / w[free].sum()
            low = free & (raw < 1)
            if not low.any():
                break
            free &= ~low
        dims = np.where(free, np.floor(raw), 1).astype(int)
        extra = budget * n - dims.sum()                           # < number of free layers
        rem = np.where(free, raw - np.floor(raw), -1.0)
        dims[np.argsort(-rem, kind="stable")[:extra]] += 1
        if order == "reverse":
            rev = np.empty_like(dims)
            rev[np.argsort(-dof, kind="stable")] = np.sort(dims)  # k-th largest DoF gets the k-th smallest dim
            dims = rev
    if clip is not None:
        dims = np.minimum(dims, int(clip))
    return [int(v) for v in dims]


# ----------------------------------------------------------------------------------------------------------------
# 4. The command: a model's DoF profile

@dataclass
class DofConfig:
    model: str = "gpt2"          # checkpoint: hub id, local HF directory, .gguf file or "smollm2-135m"
    data: str = "data/wikipedia"  # calibration text: uint16 token file, directory with train.bin, or a text file
    J: int = 2048                # queries+keys drawn per head (the Gram matrix is J x J; the paper does not say)
    lam: float = 2 ** -4         # lambda (paper: 2^-4 for GPT-2, 2^-8 for Pythia-1B)
    lam_relative: bool = False   # lambda := lam * tr(S~): invariant to the kernel's scale (ours; SmolLM2 needs it)
    budget: int = 64             # C: mean feature dimension over the layers (paper, GPT-2: 64)
    tokens: int = 8192           # calibration tokens read from --data (2 * tokens points per head)
    batch_size: int = 4          # sequences per forward pass
    block_size: int = 1024       # tokens per sequence, capped at the model's context length
    device: str = "auto"         # auto (cuda if available) | cpu | cuda | cuda:N
    seed: int = 0                # seeds the sample of J queries+keys
    out: str = "out-dof"         # directory for dof.json and dof.png (dof.txt without matplotlib)


HELP = {
    "model": "checkpoint: hub id (gpt2, EleutherAI/pythia-160m), local directory, .gguf file or smollm2-135m",
    "data": "calibration text: a uint16 token file (train.bin/val.bin), a directory holding train.bin, or a text file",
    "J": "queries+keys drawn per head; the DoF is estimated from a J x J Gram matrix",
    "lam": "lambda of N = tr(S (S + lambda I)^-1); with --lam-relative a fraction of tr(S)",
    "lam_relative": "take --lam as a fraction of tr(S), invariant to the kernel's scale (for large q/k norms)",
    "budget": "mean feature dimension C over the layers",
    "tokens": "calibration tokens read from --data (each gives one query and one key per head)",
    "batch_size": "sequences per forward pass",
    "block_size": "tokens per sequence (capped at the model's context length)",
    "device": "auto, cpu, cuda or cuda:N",
    "seed": "seed of the random sample of queries+keys",
    "out": "output directory for dof.json and the heatmap (dof.png, or dof.txt without matplotlib)",
}


def parse_args(argv=None):
    p = config_parser(DofConfig, HELP, "Degrees of freedom of every head's attention kernel and the feature "
                        "dimensions they give each layer (the paper's Algorithm 1).")
    return DofConfig(**vars(p.parse_args(argv)))


def calibration_tokens(cfg, vocab_size):
    """--data -> up to cfg.tokens token ids (np.int64)."""
    p = Path(cfg.data)
    if p.is_dir():
        p = p / "train.bin"
    if not p.is_file():
        raise ModelError(f"{p} does not exist; pass a uint16 token file, a directory holding train.bin, or a text file")
    if p.suffix == ".bin":
        if p.stat().st_size % 2:
            raise ModelError(f"{p} has an odd number of bytes, so it is not a uint16 token file")
        tokens = np.array(np.memmap(p, dtype=np.uint16, mode="r")[:cfg.tokens], dtype=np.int64)
    else:
        try:
            with open(p, encoding="utf-8") as fh:
                text = fh.read(16 * cfg.tokens)                   # plenty for cfg.tokens tokens
        except UnicodeDecodeError:
            raise ModelError(f"{p} is neither a .bin token file nor UTF-8 text") from None
        tokens = np.array(load_tokenizer(cfg.model).encode_ordinary(text)[:cfg.tokens], dtype=np.int64)
    if len(tokens) and tokens.max() >= vocab_size:
        raise ModelError(f"{p} holds token id {tokens.max()} but the model has {vocab_size} embeddings; "
                         "tokenize the data with this model's tokenizer")
    return tokens


def batches_of(tokens, B, T):
    """Consecutive sequences of T tokens, B per batch; the tail (< T tokens) is a last batch of its own."""
    n = len(tokens) // T
    seqs = torch.from_numpy(tokens[:n * T]).view(n, T)
    out = list(seqs.split(B))
    if len(tokens) > n * T:
        out.append(torch.from_numpy(tokens[n * T:])[None])
    return out


def write_atomic(path, write):
    tmp = f"{path}.tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


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
    write_atomic(path_png, lambda t: fig.savefig(t, format="png", dpi=120))
    plt.close(fig)
    return True


def text_heatmap(per_head):
    ramp, top = " .:-=+*#%@", max(float(per_head.max()), 1e-12)
    rows = ["".join(ramp[min(9, int(10 * v / top))] for v in row) for row in per_head]
    return f"DoF per head (rows: layers, columns: heads; '@' = {top:.1f})\n" + \
        "\n".join(f"{l:3d} |{r}|" for l, r in enumerate(rows)) + "\n"


def main(argv=None):
    cfg = parse_args(argv)
    for name in ("J", "tokens", "batch_size", "block_size"):
        if getattr(cfg, name) < 1:
            raise ModelError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if not cfg.lam > 0:
        raise ModelError(f"--lam must be positive, got {cfg.lam}")
    if cfg.budget < 1:
        raise ModelError(f"--budget must be at least 1 feature per layer, got {cfg.budget}")
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"--device {device} asked for but no CUDA device is available; use --device cpu")
    model = M.GPT.from_pretrained(cfg.model, device=device)
    attention_cores(model)
    mc = model.config
    tokens = calibration_tokens(cfg, mc.vocab_size)
    if cfg.J > 2 * len(tokens):
        raise ModelError(f"--J {cfg.J} is larger than the {2 * len(tokens)} queries+keys per head in {len(tokens)} "
                         f"calibration tokens; lower --J or give more text (--tokens, --data)")

    t0 = time.time()
    batches = batches_of(tokens, cfg.batch_size, min(cfg.block_size, mc.block_size))
    x = collect_qk(model, tqdm(batches, desc="queries/keys", unit="batch"), cfg.J, cfg.seed)   # (L, H, J, D)
    t1 = time.time()
    per_head = torch.stack([degrees_of_freedom(x[l].to(device), cfg.lam, cfg.lam_relative).cpu()
                            for l in tqdm(range(mc.n_layer), desc="DoF", unit="layer")]).numpy()  # (L, H)
    t2 = time.time()
    layer = per_head.max(1)
    sat = layer / cfg.J
    dims = {"DoF": allocate(layer, cfg.budget), "DoF+Clip": allocate(layer, cfg.budget, clip=mc.head_dim),
            "Fix": allocate(layer, cfg.budget, order="fix"), "Reverse": allocate(layer, cfg.budget, order="reverse")}

    lam_txt = f"{cfg.lam:g} x tr(S)" if cfg.lam_relative else f"{cfg.lam:g}"
    print(f"{cfg.model}: {mc.n_layer} layers x {mc.n_head} heads, head size {mc.head_dim}; J={cfg.J} of "
          f"{2 * len(tokens)} queries+keys per head, lambda={lam_txt}, budget {cfg.budget}")
    print(f"{'layer':>5} {'DoF max':>9} {'DoF mean':>9} {'max/J':>6} {'DoF':>5} {'DoF+Clip':>8} {'Fix':>5}")
    for l in range(mc.n_layer):
        print(f"{l:5d} {layer[l]:9.2f} {per_head[l].mean():9.2f} {sat[l]:6.3f} {dims['DoF'][l]:5d} "
              f"{dims['DoF+Clip'][l]:8d} {dims['Fix'][l]:5d}")
    print(f"{'mean':>5} {layer.mean():9.2f} {per_head.mean():9.2f} {sat.mean():6.3f} {np.mean(dims['DoF']):5.1f} "
          f"{np.mean(dims['DoF+Clip']):8.1f} {np.mean(dims['Fix']):5.1f}")
    print(f"queries/keys {t1 - t0:.1f}s, DoF {t2 - t1:.1f}s")
    hot = [l for l in range(mc.n_layer) if sat[l] > 0.9]
    if hot:
        which = "every layer has" if len(hot) == mc.n_layer else \
            f"layer{'s' if len(hot) > 1 else ''} {', '.join(map(str, hot))} {'have' if len(hot) > 1 else 'has'}"
        print(f"warning: {which} DoF/J > 0.9, so the estimate is saturated (lambda is too small for this model's "
              "query/key scale and the dims tend to Fix); raise --lam or use --lam-relative (e.g. --lam-relative "
              "--lam 1e-3)", file=sys.stderr)

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"settings": {**asdict(cfg), "device": device, "n_layer": mc.n_layer, "n_head": mc.n_head,
                           "head_dim": mc.head_dim, "calibration_tokens": len(tokens)},
              "per_head_dof": per_head.tolist(), "layer_dof": layer.tolist(), "saturation": sat.tolist(),
              "dims": dims, "seconds": {"collect": t1 - t0, "dof": t2 - t1}}
    write_atomic(out / "dof.json", lambda t: Path(t).write_text(json.dumps(result, indent=1)))
    if plot(out / "dof.png", per_head, dims, f"{cfg.model}: J={cfg.J}, lambda={lam_txt}, budget {cfg.budget}"):
        print(f"wrote {out / 'dof.json'} and {out / 'dof.png'}")
    else:
        write_atomic(out / "dof.txt", lambda t: Path(t).write_text(text_heatmap(per_head)))
        print(text_heatmap(per_head), end="")
        print(f"wrote {out / 'dof.json'} and {out / 'dof.txt'} (pip install matplotlib for dof.png)")


if __name__ == "__main__":
    try:
        main()
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
