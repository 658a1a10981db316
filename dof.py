"""Algorithm 1 of the paper: how many features does each layer's linear attention need?

    python dof.py --model gpt2 --lam 0.0625 --J 2048 --budget 64 --data data/wikipedia

Per head: J of the queries and keys (after rotary) of calibration windows (collect_qk); with
G_ij = K(x_i, x_j) = exp(x_i.x_j / sqrt d), its degrees of freedom (dof_reference) are

    N_lam = sum_i mu_i / (mu_i + lam) = tr(G (G + J lam I)^-1),   mu_i the eigenvalues of G / J.

A layer's DoF is its heads' maximum (they share one feature dimension); layer l gets
M_l = C N_l / mean(N) features (allocate), a mean of C: the cost of Fix (C everywhere). DoF+Clip
caps M_l at the head size; Reverse hands the same dims out in reverse order (a control)."""

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

import datafiles
import devices
import door
import files
import report
from model import GPT, repeat_kv

RULES = ("dof", "fix", "clip", "reverse")


@torch.no_grad()
def teacher_qk(teacher, idx):
    """idx (B, T) -> per layer, in fp32, q (B, H, T, D) and k (B, Hkv, T, D) as its core sees."""
    seen = []
    cores = teacher.cores()
    hooks = [c.register_forward_pre_hook(lambda mod, args: seen.append(args[:2])) for c in cores]
    try:
        teacher.hidden(idx)                                  # hidden states: no lm_head
    finally:
        for h in hooks:
            h.remove()
    return [(q.float(), k.float()) for q, k in seen]


def key_means(teacher, batches):
    """Each layer's mean key over the batches, repeated to the query heads -> (L, H, D)."""
    sums = sum(torch.stack([k.sum(dim=(0, 2)) for _, k in teacher_qk(teacher, i)]) for i in batches)
    n = sum(idx.numel() for idx in batches)                                # tokens
    mean = (sums / n)[:, :, None]                                          # (L, Hkv, 1, D)
    return repeat_kv(mean, teacher.config.n_head)[:, :, 0]                 # (L, H, D)


@torch.no_grad()
def collect_qk(teacher, batches, J, seed=0, key_means=None):
    """Token batches (B, T) -> (L, H, J, D) fp32: each query head's queries pooled with its KV
    head's keys (minus key_means (L, H, D) if given), the J of highest i.i.d. uniform priority: a
    uniform sample without replacement. The batches hold J points a head or more (datafiles'
    check_sample)."""
    gen = torch.Generator().manual_seed(seed)
    kept, prio = None, None                                  # the sample so far, its priorities
    for idx in batches:
        x = []
        for l, (q, k) in enumerate(teacher_qk(teacher, idx)):   # (B, H, T, D), (B, Hkv, T, D)
            k = repeat_kv(k, q.size(1))                          # (B, H, T, D)
            if key_means is not None:
                k = k - key_means[l][:, None].to(k)
            x.append(torch.cat((q, k), 2).transpose(0, 1).flatten(1, 2))     # (H, 2BT, D)
        x = torch.stack(x)                                                   # (L, H, 2BT, D)
        r = torch.rand(x.shape[:3], generator=gen).to(x.device)             # (L, H, 2BT)
        if kept is not None:
            x = torch.cat((kept, x), 2)
            r = torch.cat((prio, r), 2)
        top = r.topk(min(J, r.size(2)), dim=2).indices                      # (L, H, <=J)
        kept = x.gather(2, top[..., None].expand(-1, -1, -1, x.size(-1)))    # (L, H, <=J, D)
        prio = r.gather(2, top)
    return kept


def dof_reference(S, lam, relative=False):
    """Logits S (..., J, J), S_ij = x_i.x_j / sqrt d -> N_lam (...) = sum_i mu_i / (mu_i + lam),
    mu the eigenvalues of G / J, G = exp(S). relative=True: lam := lam tr(G / J), same N for cK."""
    J = S.size(-1)
    G = S.exp()                                                             # (..., J, J)
    mu = torch.linalg.eigvalsh(G / J).clamp(min=0)                          # (..., J)
    if relative:
        lam = lam * G.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True) / J
    return (mu / (mu + lam)).sum(-1)


def dof_from_logits(S, lam, relative=False, J=None):
    """dof_reference without exp(S), which overflows past 709 and past ~40 puts the eigenvalues
    near lam below float64's resolution. With c = J lam (relative: lam tr(G)), a_i = G_ii / (G_ii+c):
        G + cI = D^1/2 A D^1/2,   D = diag(G_ii + c),   A = D^-1/2 G D^-1/2 + c D^-1,
        A_ij = exp(S_ij - (S_ii + S_jj) / 2) sqrt(a_i a_j) (i != j), A_ii = 1,
    all in [0, 1] whatever S (Cauchy-Schwarz). Then, with A^-1 from A's Cholesky factor,
        N = tr(G (G + cI)^-1) = n - c tr((G + cI)^-1) = n - sum_i (1 - a_i) (A^-1)_ii.
    J (default n): the number of points, where S's n rows stand for several copies each."""
    n = S.size(-1)
    J = n if J is None else J
    C, _, w = regularised_cholesky(S, lam, relative, J)
    inv_diag = torch.cholesky_inverse(C).diagonal(dim1=-2, dim2=-1)         # (..., n) (A^-1)_ii
    return (n - (w * inv_diag).sum(-1)).clamp(0, J)


def regularised_cholesky(S, lam, relative, J):
    """dof_from_logits' factorisation: logits S (..., n, n) -> (C, u, w), C the Cholesky factor of
    A, u_i = log D_ii^-1/2 = -log(G_ii + c) / 2, w_i = 1 - a_i: G + cI = D^1/2 C C^T D^1/2."""
    s = S.diagonal(dim1=-2, dim2=-1)                        # (..., n) log G_ii = |x_i|^2 / sqrt d
    log_c = math.log(lam) + (torch.logsumexp(s, -1, keepdim=True) if relative else math.log(J))
    u = (F.logsigmoid(s - log_c) - s) / 2                   # (log a_i - S_ii) / 2
    w = torch.sigmoid(log_c - s)                            # 1 - a_i = c / (G_ii + c)
    A = (S + u[..., :, None] + u[..., None, :]).exp()       # D^-1/2 G D^-1/2
    A.diagonal(dim1=-2, dim2=-1).add_(w)                    # + c D^-1
    C, info = torch.linalg.cholesky_ex(A)
    if info.any():
        raise door.ModelError("the kernel matrix is numerically singular (near-duplicate "
                             "queries/keys with logits far above log(J lambda)); raise --lam or "
                             "use --lam-relative, which keeps it well conditioned")
    return C, u, w


def degrees_of_freedom(x, lam, relative=False):
    """x (..., J, d) queries+keys per head -> N_lam (...) of K(x, y) = exp(x.y / sqrt d), a head
    at a time in float64 (relative=True: lam times tr(G / J)). Exact duplicates (position 0 depends
    only on the token) make G singular, so a point with m copies enters once, with logits
    S_ij + (log m_i + log m_j) / 2: G / J's nonzero eigenvalues stay."""
    if not torch.isfinite(x).all():
        raise door.ModelError("the DoF needs queries/keys without inf or nan; check the model's "
                             "weights and dtype")
    *batch, J, d = x.shape
    N = []
    for xh in x.reshape(-1, J, d):
        xu, m = torch.unique(xh.double(), dim=0, return_counts=True)   # (n, d) points, (n,) copies
        half_log_m = m.double().log() / 2
        S = xu @ xu.T / math.sqrt(d) + half_log_m[:, None] + half_log_m[None, :]   # (n, n)
        N.append(dof_from_logits(S, lam, relative, J))
    return torch.stack(N).reshape(batch)


def allocate(layer_dof, budget, rule="dof", head_dim=None):
    """Layer DoF N (n,) -> whole dims (list of int) by a rule of RULES: "dof" M_l = C N_l / mean(N)
    with C = budget, in whole numbers of mean exactly C; "clip" those capped at head_dim; "reverse"
    those handed out largest DoF smallest; "fix" C everywhere (as "dof" is where N is all 0)."""
    N = np.asarray(torch.as_tensor(layer_dof, dtype=torch.float64).cpu()).reshape(-1)
    if N.sum() == 0:
        N = np.ones(N.size)
    if rule == "fix":
        return [int(budget)] * N.size
    dims = whole_dims(budget * N / N.mean())
    if rule == "reverse":
        dims[np.argsort(-N, kind="stable")] = np.sort(dims)    # k-th largest DoF: k-th smallest dim
    if rule == "clip":
        dims = np.minimum(dims, head_dim)
    return dims.tolist()


def whole_dims(M):
    """Real dims M (n,) -> whole dims >= 1 of the same sum: a share below 1 becomes 1, the others
    share the rest in proportion to M (until none is below 1); the largest remainders round up."""
    total = round(M.sum())
    one = np.zeros(M.size, bool)                            # layers pinned at 1
    share = total * M / M.sum()
    while (share[~one] < 1).any():
        one |= share < 1
        share = (total - one.sum()) * M / M[~one].sum()
    dims = np.where(one, 1, np.floor(share)).astype(int)
    remainder = np.where(one, -1.0, share - np.floor(share))
    dims[np.argsort(-remainder, kind="stable")[:total - dims.sum()]] += 1
    return dims


def choose_dims(teacher, batches, cfg, key_means=None):
    """Algorithm 1 with cfg's budget, alloc, lam, lam_relative, J, seed (keys minus key_means: the
    student's kernel) -> (dims per layer, layer DoF (L,), every head's (L, H); both None: Fix)."""
    if cfg.alloc == "fix":
        return [int(cfg.budget)] * teacher.config.n_layer, None, None
    x = collect_qk(teacher, batches, cfg.J, cfg.seed, key_means)              # (L, H, J, D)
    head = degrees_of_freedom(x, cfg.lam, cfg.lam_relative).cpu()            # (L, H)
    layer = head.amax(-1)                                                    # (L,)
    dims = allocate(layer, cfg.budget, cfg.alloc, teacher.config.head_dim)
    return dims, layer.tolist(), head


# The command

@dataclass
class DofConfig(door.Config):
    """Every head's DoF and each layer's dims (Algorithm 1), on the windows that distill.py
    draws with the same flags."""
    model: str = door.opt("gpt2", "checkpoint: hub id, local directory, .gguf file or smollm2-135m")
    data: str = door.opt("data/wikipedia", "folder of train.bin (data/*/prepare.py or distill.py)")
    budget: int = door.opt(64, "mean feature dimension C over the layers (paper, GPT-2: 64)", min=1)
    lam: float = door.opt(2 ** -4, "lambda (paper: 2^-4 for GPT-2, 2^-8 for Pythia-1B)", above=0)
    lam_relative: bool = door.opt(False, "--lam times tr(G / J), the mean K(x, x): scale-invariant")
    J: int = door.opt(2048, "queries+keys drawn per head: the DoF of a J x J Gram matrix", min=1)
    center_keys: bool = door.opt(False, "the kernel K(q, k - mu) of distill.py --center-keys")
    calib_batches: int = door.opt(4, "calibration batches (as distill.py)", min=1)
    batch_size: int = door.opt(8, "windows per calibration batch (as distill.py)", min=1)
    block_size: int = door.opt(1024, "tokens per window, at most the model's context", min=1,
                               context=True)
    seed: int = door.opt(0, "seed of the windows and of the sample of queries+keys (as distill.py)",
                         min=0)
    device: str = door.opt("auto", "auto (cuda if available), cpu, cuda or cuda:N")
    out: str = door.opt("out-dof", "output directory for dof.json",
                        check=lambda cfg: files.check_out(cfg.out, ("dof.json",)))

    # choose_dims's rule: dims in proportion to the DoF (the table shows every rule's)
    alloc = "dof"


def main(argv=None):
    """The flags and the data checked; then calibration windows, J queries+keys per head, N_lam per
    head and layer, each rule's dims: printed as a table and written to dof.json."""
    cfg = door.parse_config(DofConfig, argv)
    device, _ = devices.pick_device(cfg.device, "float32")            # queries and keys in float32
    teacher = GPT.from_pretrained(cfg.model, device=device)
    door.validate(cfg, context=teacher.config.block_size)
    tokens = datafiles.calibration_tokens(cfg, teacher.config, device)
    t0 = time.time()
    batches = datafiles.calibration_batches(tokens, cfg, device)
    mu = key_means(teacher, batches) if cfg.center_keys else None       # (L, H, D)
    _, layer, per_head = choose_dims(teacher, batches, cfg, mu)         # (L,), (L, H)
    dims = {rule: allocate(layer, cfg.budget, rule, teacher.config.head_dim) for rule in RULES}
    report.print_table(cfg, per_head.numpy(), dims)
    report.write_json(cfg, per_head, layer, dims, time.time() - t0)


if __name__ == "__main__":
    door.run_main(main)
