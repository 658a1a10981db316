"""
The model: GPT-2, GPT-NeoX (Pythia) and Llama-family (SmolLM2) transformers in one small file, with softmax attention
and the linear attention that replaces it (feature maps, chunked causal scan, recurrent state).

    idx (B, T) -> wte (+ wpe) -> n_layer x Block -> ln_f -> lm_head -> logits (B, T, V)
    Block:  x + attn(ln_1(x)) + mlp(ln_2(x))        (parallel residual, Pythia)
            x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))  (sequential: GPT-2, Llama, some NeoX)
    attn:   qkv projection -> rotary (NeoX, Llama) -> core(q, k, v) -> proj
    core:   SoftmaxAttention (the teacher) or LinearAttention (the student), swapped by GPT.linearize(dims)

Every layer's attention core receives (q, k, v) after rotary as its inputs, so a hook on `model.h[l].attn.core`
sees a layer's queries and keys (dof.capture_qk). GPT.from_pretrained gets its weights from checkpoint.py.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from checkpoint import config_from_hf, convert_state_dict, read_checkpoint, read_student
from common import ModelError


@dataclass
class GPTConfig:
    family: str = "gpt2"          # "gpt2" | "neox" | "llama": selects embeddings, norms, MLP and residual form
    vocab_size: int = 50257       # rows of the embedding (Pythia pads to 50304)
    n_layer: int = 12
    n_head: int = 12              # query heads
    n_kv_head: int = 12           # key/value heads (< n_head: grouped-query attention)
    n_embd: int = 768
    head_dim: int = 64
    block_size: int = 1024        # context length the checkpoint was trained for
    rotary_dim: int = 0           # dims of each head that get rotary (0: learned absolute positions, GPT-2)
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    parallel_residual: bool = False
    tie_embeddings: bool = True   # lm_head shares wte's weight
    mlp_hidden: int = 3072
    bias: bool = True             # biases in the linear layers (GPT-2, NeoX: yes; Llama: no)
    name: str = ""                # the checkpoint it was loaded from (hub id or path)


# ----------------------------------------------------------------------------------------------------------------
# Layers: norms, rotary, softmax attention

class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in fp32 (Llama)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def norm(cfg):
    return RMSNorm(cfg.n_embd, cfg.norm_eps) if cfg.family == "llama" else nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)


def rotary(x, pos, rotary_dim, base):
    """Rotate-half rotary embedding on the first rotary_dim dims of each head; x (B, H, T, D), pos (T,)."""
    if rotary_dim == 0:
        return x
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, device=x.device, dtype=torch.float32) / rotary_dim)
    freqs = pos.float()[:, None] * inv_freq[None, :]                       # (T, rotary_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)                                  # (T, rotary_dim)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    xr, xp = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = xr.chunk(2, dim=-1)
    xr = xr * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((xr, xp), dim=-1)


class SoftmaxAttention(nn.Module):
    """The teacher's core: y_i = sum_{j<=i} softmax_j(q_i.k_j / sqrt(d)) v_j, with a KV cache when decoding."""

    def forward(self, q, k, v, cache=None):
        # q (B, H, T, D); k, v (B, Hkv, T, D); when decoding, the P cached tokens' k, v go in front
        mask = None
        if cache is not None and "k" in cache:
            P, T = cache["k"].size(2), q.size(2)
            k, v = torch.cat((cache["k"], k), 2), torch.cat((cache["v"], v), 2)
            mask = torch.arange(T, device=q.device)[:, None] + P >= torch.arange(P + T, device=q.device)  # (T, P+T)
        if cache is not None:
            cache["k"], cache["v"] = k, v
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=k.size(1) != q.size(1))


# ----------------------------------------------------------------------------------------------------------------
# Linear attention: feature maps, the plain quadratic form, a chunked causal scan, and the recurrent step.
# Softmax attention y_i = sum_{j<=i} K(q_i, k_j) v_j / sum_{j<=i} K(q_i, k_j), K(q, k) = exp(q.k / sqrt(d)), becomes
# linear in T once K(q, k) ~ phi(q).phi(k) for non-negative features phi (B, H, T, d) -> (B, H, T, M):
#     y_i = phi(q_i) S_i / phi(q_i) s_i,   S_i = sum_{j<=i} phi(k_j) v_j^T  (M x D),   s_i = sum_{j<=i} phi(k_j)  (M).
KEY_SHIFT = 32.0  # beta of overflow_safe_prf: key features are at most e^32 ~ 8e13, far below fp32's 3e38


class PRF(nn.Module):
    """Learned positive random features (the paper's). Per head, with x~ = x / d^(1/4) and m = 1..M:

        Phi(x)_m = sqrt(alpha_m / M) exp(z_m.x~ - |x~|^2 / 2),   z_m ~ N(0, I_d),   alpha_m = exp(log_alpha_m),

    so that E_z[Phi(q).Phi(k)] = exp(q.k / sqrt(d)) at alpha = 1 (the init). `log_features(x)` is log Phi(x) as
    written; `forward` gives the features the model runs: Phi(x) rescaled by `overflow_safe_prf`, which leaves the
    normalised attention unchanged. z and alpha are learned; a given z (H, M, d) makes both fixed buffers (Performer).
    """

    def __init__(self, n_head, head_dim, M, z=None):
        super().__init__()
        self.head_dim, self.M = head_dim, M
        if z is None:
            self.z = nn.Parameter(torch.randn(n_head, M, head_dim))                      # (H, M, d)
            self.log_alpha = nn.Parameter(torch.zeros(n_head, M))                        # (H, M)
        else:
            self.register_buffer("z", z)
            self.register_buffer("log_alpha", torch.zeros(n_head, M))

    def log_features(self, x):
        """log Phi(x): x (B, H, T, d) -> (B, H, T, M), in fp32 for bf16 inputs."""
        dt = torch.promote_types(x.dtype, torch.float32)
        x = x.to(dt) * self.head_dim ** -0.25                                             # x~ (B, H, T, d)
        log_w = 0.5 * (self.log_alpha.to(dt) - math.log(self.M))                         # log sqrt(alpha / M) (H, M)
        return x @ self.z.to(dt).mT - 0.5 * x.square().sum(-1, keepdim=True) + log_w[:, None]

    def forward(self, x, is_query):
        dt = torch.promote_types(x.dtype, torch.float32)
        return overflow_safe_prf(x.to(dt), self.z.to(dt), self.log_alpha.to(dt), is_query)


def overflow_safe_prf(x, z, log_alpha, is_query, beta=KEY_SHIFT):
    """Phi(x) times factors that cancel in the normalised attention, so that it stays in fp32's range. Phi itself,
    sqrt(alpha_m / M) e^(|z_m|^2/2 - |x~ - z_m|^2/2), does not: a query far from every z_m gets all-zero features
    (0/0 attention) and a long z_m overflows. x (B, H, T, d), z (H, M, d), log_alpha (H, M) -> (B, H, T, M):

        keys:     phi_m = exp(beta - |k~ - z_m|^2 / 2)           = Phi(k)_m sqrt(M / alpha_m) e^(beta - |z_m|^2/2)
        queries:  phi_m = exp(a_m - max a),  a_m = log alpha_m + z_m.q~ + |z_m|^2 / 2
                                                                = Phi(q)_m sqrt(M alpha_m) e^(|z_m|^2/2) c(q)

    Keys lie in (0, e^beta], queries in (0, 1]. The per-feature factors multiply to M e^beta, so phi(q).phi(k) =
    M e^beta c(q) Phi(q).Phi(k), c(q) = exp(|q~|^2/2 - max a): a factor of the query alone, which cancels between
    numerator and denominator (a factor per key would reweight key j). A key with |k~ - z_m|^2/2 > beta + 87 for all
    m underflows to zero and drops out; a query left with no keys gets 0 (`eps` in causal_linear_attention), not NaN.
    """
    r = x.size(-1) ** -0.25                                                              # x~ = r x
    zx = x @ (r * z).mT                                                                  # z_m.x~ (B, H, T, M)
    half_z2 = 0.5 * z.square().sum(-1)[:, None]                                          # (H, 1, M)
    # in place (_): these are the big (B, H, T, M) tensors, and each pass over them costs as much as the matmul
    if is_query:
        a = zx.add_(half_z2 + log_alpha[:, None])                                        # (B, H, T, M)
        return a.sub_(a.detach().amax(-1, keepdim=True)).exp_()  # the max cancels: no gradient through it
    half_x2 = 0.5 * (r * x.norm(dim=-1, keepdim=True)).square()                          # (B, H, T, 1)
    return zx.add_(beta - half_z2).sub_(half_x2).exp_()


def orthogonal_gaussian(n_head, M, d):
    """(H, M, d) Performer features: blocks of d orthogonal rows (QR of a Gaussian matrix, Haar-distributed), each
    row rescaled to an independent chi(d) norm (the norm of a Gaussian vector), so every row is N(0, I_d)."""
    q, r = torch.linalg.qr(torch.randn(n_head, -(-M // d), d, d))                   # (H, nb, d, d)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[..., None, :]             # sign fix: exactly Haar
    rows = q.mT.reshape(n_head, -1, d)[:, :M]                                           # (H, M, d) unit rows
    return rows * torch.randn(n_head, M, d).norm(dim=-1, keepdim=True)


class Performer(PRF):
    """FAVOR+ (Choromanski et al. 2021): the PRF map with fixed orthogonal random z (a buffer, not trained) and
    equal weights 1/M (alpha = 1); the same overflow-safe form."""

    def __init__(self, n_head, head_dim, M):
        super().__init__(n_head, head_dim, M, z=orthogonal_gaussian(n_head, M, head_dim))


def dct_matrix(d):
    """Orthonormal DCT-II matrix C (d, d), C[k, n] = s_k cos(pi k (2n + 1) / 2d); scipy's dct(eye(d), axis=0, 'ortho')."""
    k, n = torch.arange(d, dtype=torch.float64)[:, None], torch.arange(d, dtype=torch.float64)
    C = torch.cos(math.pi * k * (2 * n + 1) / (2 * d)) * math.sqrt(2 / d)
    C[0] /= math.sqrt(2)
    return C


class DiJiang(nn.Module):
    """DiJiang's feature map (Chen et al. 2024, arXiv 2403.19928), as in the authors' modeling_gpt_neox.py:

        phi(x) = softmax(x P),   P = C diag(Phi^-1(u))   (d x M),   the same for queries and keys,

    C the orthonormal DCT matrix, Phi^-1 the standard normal quantile, u a scrambled Sobol (quasi-Monte-Carlo)
    sequence as in the paper (the authors' code draws u with torch.rand); no 1/sqrt(d) scaling, as there. P is fixed
    (a buffer); for M != d it is the first M columns of [C diag(Phi^-1(u_1)) | C diag(Phi^-1(u_2)) | ...], fresh
    points per block. DiJiang's decay masks and output gate change the architecture, not the map: left out.
    """

    def __init__(self, n_head, head_dim, M):
        super().__init__()
        self.M, nb = M, -(-M // head_dim)
        sobol = torch.quasirandom.SobolEngine(1, scramble=True, seed=int(torch.randint(2 ** 31, ())))
        u = sobol.draw(nb * head_dim, dtype=torch.float64).view(nb, 1, head_dim)
        w = torch.special.ndtri(u.clamp(1e-7, 1 - 1e-7))                                # (nb, 1, d)
        P = (dct_matrix(head_dim) * w).transpose(0, 1).reshape(head_dim, nb * head_dim)  # [C diag(w_1) | ...]
        self.register_buffer("proj", P[:, :M].float().contiguous())                      # (d, M)

    def log_features(self, x):
        dt = torch.promote_types(x.dtype, torch.float32)
        return F.log_softmax(x.to(dt) @ self.proj.to(dt), dim=-1)                      # (B, H, T, M)

    def forward(self, x, is_query=True):
        return self.log_features(x).exp()  # softmax is already shift-stable; queries and keys alike


FEATURE_MAPS = {"prf": PRF, "performer": Performer, "dijiang": DiJiang}


def linear_attention_reference(phi_q, phi_k, v):
    """The plain form, a masked T x T matrix: y_i = sum_{j<=i} (phi_q,i . phi_k,j) v_j / sum_{j<=i} phi_q,i . phi_k,j.
    phi_q, phi_k (B, H, T, M), v (B, H, T, D) -> y (B, H, T, D), in fp32 (fp64 stays fp64); O(T^2) memory."""
    dt = torch.promote_types(v.dtype, torch.float32)
    A = (phi_q.to(dt) @ phi_k.to(dt).mT).tril()                                         # (B, H, T, T)
    return (A @ v.to(dt)) / A.sum(-1, keepdim=True)                                     # (B, H, T, D)


def causal_linear_attention(phi_q, phi_k, v, chunk_size=64, eps=1e-30, state=None, return_state=False):
    """The reference's y in O(T) memory, the sequence cut into chunks of C tokens. In chunk n:

        y_n = phi_q,n P_n + tril(phi_q,n phi_k,n^T) [v_n | 1],   P_n = sum_{n' < n} phi_k,n'^T [v_n' | 1]

    the state of all earlier chunks (one cumsum over per-chunk states: no loop over tokens or chunks) plus the plain
    masked form inside the chunk; the column of ones gives the denominator from the same products. phi_q, phi_k
    (B, H, T, M), v (B, H, T, D) -> y (B, H, T, D), any T (padded to a multiple of C), accumulated in fp32 (fp64
    stays fp64). `state` = (S (B, H, M, D), s (B, H, M)) continues from earlier tokens; return_state=True returns
    (y, S, s) after the last token. A denominator below eps (all keys underflowed) gives 0.
    """
    B, H, T, M = phi_q.shape
    D, C, N = v.size(-1), chunk_size, -(-T // chunk_size)                               # N chunks of C tokens
    dt = torch.promote_types(v.dtype, torch.float32)
    pad = lambda x: F.pad(x.to(dt), (0, 0, 0, N * C - T)) if N * C > T else x.to(dt)
    q, k = pad(phi_q).view(B, H, N, C, M), pad(phi_k).view(B, H, N, C, M)
    v1 = pad(torch.cat((v, v.new_ones(B, H, T, 1)), -1)).view(B, H, N, C, D + 1)     # [v | 1]
    U = k.mT @ v1                                                                      # (B, H, N, M, D+1) per chunk
    P = torch.cat((torch.zeros_like(U[:, :, :1]), U[:, :, :-1]), 2).cumsum_(2)        # (B, H, N, M, D+1) before n
    if state is not None:
        P = P + torch.cat((state[0], state[1][..., None]), -1).to(dt)[:, :, None]     # + (B, H, 1, M, D+1)
    out = (q @ P).add_((q @ k.mT).tril_() @ v1)                                       # (B, H, N, C, D+1)
    out = out.view(B, H, N * C, D + 1)[:, :, :T]
    y = out[..., :D] / out[..., D:].clamp_min(eps)                                     # (B, H, T, D)
    if not return_state:
        return y
    last = P[:, :, -1] + U[:, :, -1]                                                   # (B, H, M, D+1)
    return y, last[..., :D], last[..., D]


def linear_attention_step(phi_q, phi_k, v, S, s, eps=1e-30):
    """One token of the recurrence (decoding): S += phi_k v^T, s += phi_k, y = phi_q S / phi_q.s.
    phi_q, phi_k (B, H, M); v (B, H, D); S (B, H, M, D); s (B, H, M) -> y (B, H, D), S, s."""
    dt = torch.promote_types(v.dtype, torch.float32)
    phi_q, phi_k, v = phi_q.to(dt), phi_k.to(dt), v.to(dt)
    S = S + phi_k[..., :, None] * v[..., None, :]                                       # (B, H, M, D)
    s = s + phi_k                                                                       # (B, H, M)
    num = (phi_q[..., :, None] * S).sum(-2)  # a tiny product: elementwise beats a threaded bmm on CPU
    return num / (phi_q * s).sum(-1, keepdim=True).clamp_min(eps), S, s                # y (B, H, D)


def repeat_kv(x, H):
    """Grouped-query attention (as HF's repeat_kv): (B, Hkv, T, D) -> (B, H, T, D), KV head h // (H / Hkv) for h."""
    return x if x.size(1) == H else x.repeat_interleave(H // x.size(1), dim=1)


class LinearAttention(nn.Module):
    """The student's core: y = causal linear attention with M features per head, replacing softmax attention.
    forward(q (B, H, T, D), k, v (B, Hkv, T, D), cache=None) -> (B, H, T, D); q and k are after rotary.
    k and v are repeated to H heads (GQA, as HF's repeat_kv) and keys are centred by the buffer key_mean (H, D),
    zero unless distillation sets it (q.(k - mu) shifts every logit of a query equally: softmax unchanged).
    M is one feature dimension shared by the heads (the paper's) or one per head (n_head ints). Heads of equal M
    run together, one feature map each: feature_maps[g] serves the sizes[g] heads of the g-th smallest M, so a
    layer costs sum_h M_h features, not n_head * max M; `split` and `merge` reorder the heads into those groups.
    With a cache dict, decoding keeps only the state S (B, H_g, M_g, D), s (B, H_g, M_g) of each group there:
    fixed size, no KV cache. Features, scan and step run in fp32 with autocast off (bf16 autocast would run their
    matmuls and sums in bf16).
    """

    def __init__(self, n_head, n_kv_head, head_dim, M, feature_map="prf", chunk_size=64):
        super().__init__()
        if feature_map not in FEATURE_MAPS:
            raise ModelError(f"unknown feature map {feature_map!r}; choose one of {', '.join(FEATURE_MAPS)}")
        self.dims = [int(m) for m in M] if isinstance(M, (list, tuple)) else [int(M)] * n_head   # M_h per head
        if len(self.dims) != n_head or min(self.dims) < 1:
            raise ModelError(f"LinearAttention needs one feature dimension or one per head ({n_head}), each at "
                             f"least 1, got {M}")
        self.n_head, self.n_kv_head, self.chunk_size = n_head, n_kv_head, chunk_size
        order = sorted(range(n_head), key=self.dims.__getitem__)                        # heads by M, stable
        order = None if order == list(range(n_head)) else torch.tensor(order)          # None: already grouped
        self.register_buffer("order", order, persistent=False)                          # (H,) heads in group order
        self.register_buffer("inverse", None if order is None else order.argsort(), persistent=False)
        groups = sorted(set(self.dims))
        self.sizes = [self.dims.count(m) for m in groups]                               # heads per group
        self.feature_maps = nn.ModuleList(FEATURE_MAPS[feature_map](n, head_dim, m) for n, m in zip(self.sizes, groups))
        self.register_buffer("key_mean", torch.zeros(n_head, head_dim))                # (H, D)

    def group(self, x):
        """(B, H, ...) with its heads reordered into the groups (no copy when they already are)."""
        return x if self.order is None else x.index_select(1, self.order.to(x.device))   # x[:, order]

    def split(self, x):
        """(B, H, ...) -> one (B, H_g, ...) per group, its heads in head order."""
        return self.group(x).split(self.sizes, 1)

    def merge(self, ys):
        """split's inverse: one (B, H_g, ...) per group -> (B, H, ...)."""
        y = torch.cat(ys, 1)
        return y if self.order is None else y.index_select(1, self.inverse.to(y.device))

    def inputs(self, q, k):
        """The queries and centred keys the feature maps see: q (B, H, T, D), k (B, Hkv, T, D) -> (B, H, T, D)
        each, fp32, heads reordered into the groups."""
        dt = torch.promote_types(q.dtype, torch.float32)
        k = repeat_kv(k, self.n_head).to(dt) - self.key_mean[:, None].to(dt)
        return self.group(q.to(dt)), self.group(k)

    def features(self, q, k, log=False):
        """[(phi_q, phi_k)], each (B, H_g, T, M_g) fp32, one pair per group, for queries q (B, H, T, D) and keys
        k (B, Hkv, T, D); log=True: log Phi of queries and centred keys, on the kernel's own scale (the l2 loss)."""
        return self.grouped_features(*self.inputs(q, k), log=log)

    def grouped_features(self, q, k, log=False):
        """features, from `inputs`' grouped queries and centred keys (B, H, T, D)."""
        with torch.autocast(q.device.type, enabled=False):
            pairs = zip(self.feature_maps, q.split(self.sizes, 1), k.split(self.sizes, 1))
            if log:
                return [(f.log_features(qg), f.log_features(kg)) for f, qg, kg in pairs]
            return [(f(qg, is_query=True), f(kg, is_query=False)) for f, qg, kg in pairs]

    def scores(self, q, k):
        """The student's normalised causal attention matrix (B, H, T, T): row i = phi_q,i . phi_k,j / sum_j<=i."""
        with torch.autocast(q.device.type, enabled=False):
            A = self.merge([(phi_q @ phi_k.mT).tril() for phi_q, phi_k in self.features(q, k)])
            return A / A.sum(-1, keepdim=True)

    def forward(self, q, k, v, cache=None):
        with torch.autocast(q.device.type, enabled=False):
            feats, vs = self.features(q, k), self.split(repeat_kv(v, self.n_head))     # per group
            if cache is None:
                ys = [causal_linear_attention(pq, pk, vg, self.chunk_size) for (pq, pk), vg in zip(feats, vs)]
            else:
                ys = [self.decode(pq, pk, vg, cache, g) for g, ((pq, pk), vg) in enumerate(zip(feats, vs))]
            return self.merge(ys).to(q.dtype)

    def decode(self, phi_q, phi_k, v, cache, g):
        """Group g's tokens with its state in cache["S"][g], cache["s"][g] (made at the first call)."""
        if "S" not in cache:
            B, D = v.size(0), v.size(-1)
            cache["S"] = [v.new_zeros(B, n, f.M, D, dtype=phi_q.dtype) for n, f in zip(self.sizes, self.feature_maps)]
            cache["s"] = [v.new_zeros(B, n, f.M, dtype=phi_q.dtype) for n, f in zip(self.sizes, self.feature_maps)]
        S, s = cache["S"][g], cache["s"][g]
        if phi_q.size(2) == 1:                                                           # one token: the step
            y, S, s = linear_attention_step(phi_q[:, :, 0], phi_k[:, :, 0], v[:, :, 0], S, s)
            y = y[:, :, None]
        else:
            y, S, s = causal_linear_attention(phi_q, phi_k, v, self.chunk_size, state=(S, s), return_state=True)
        cache["S"][g], cache["s"][g] = S, s
        return y


# ----------------------------------------------------------------------------------------------------------------
# The transformer: Attention (projections and rotary around a core), MLP, Block, GPT

class Attention(nn.Module):
    """Projections and rotary around an attention core: x (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=cfg.bias)
        self.core = SoftmaxAttention()

    def forward(self, x, pos, cache=None):
        B, T, _ = x.shape
        c = self.cfg
        q, k, v = self.qkv(x).split([c.n_head * c.head_dim, c.n_kv_head * c.head_dim, c.n_kv_head * c.head_dim], -1)
        q = q.view(B, T, c.n_head, c.head_dim).transpose(1, 2)              # (B, H, T, D)
        k, v = (t.view(B, T, c.n_kv_head, c.head_dim).transpose(1, 2) for t in (k, v))  # (B, Hkv, T, D)
        q, k = rotary(q, pos, c.rotary_dim, c.rope_base), rotary(k, pos, c.rotary_dim, c.rope_base)
        y = self.core(q, k, v, cache)                                       # (B, H, T, D)
        return self.proj(y.transpose(1, 2).reshape(B, T, c.n_head * c.head_dim))


class MLP(nn.Module):
    """GPT-2: proj(gelu_tanh(fc(x))); NeoX: proj(gelu(fc(x))); Llama: proj(silu(gate(x)) * fc(x))."""

    def __init__(self, cfg):
        super().__init__()
        self.family = cfg.family
        self.fc = nn.Linear(cfg.n_embd, cfg.mlp_hidden, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_hidden, cfg.n_embd, bias=cfg.bias)
        if cfg.family == "llama":
            self.gate = nn.Linear(cfg.n_embd, cfg.mlp_hidden, bias=False)

    def forward(self, x):
        if self.family == "llama":
            return self.proj(F.silu(self.gate(x)) * self.fc(x))
        return self.proj(F.gelu(self.fc(x), approximate="tanh" if self.family == "gpt2" else "none"))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.parallel = cfg.parallel_residual
        self.ln_1, self.attn, self.ln_2, self.mlp = norm(cfg), Attention(cfg), norm(cfg), MLP(cfg)

    def forward(self, x, pos, cache=None):
        if self.parallel:
            return x + self.attn(self.ln_1(x), pos, cache) + self.mlp(self.ln_2(x))
        x = x + self.attn(self.ln_1(x), pos, cache)
        return x + self.mlp(self.ln_2(x))


class Cache(list):
    """Decoding state: one dict per layer, owned by that layer's attention core, and the tokens seen so far."""
    def __init__(self, n_layer):
        super().__init__({} for _ in range(n_layer))
        self.pos = 0


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        if cfg.family == "gpt2":
            self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = norm(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def hidden(self, idx, cache=None):
        """idx (B, T) -> final-normed hidden states (B, T, C); advances cache.pos by T when decoding."""
        T, p0 = idx.size(1), (cache.pos if cache is not None else 0)
        if self.config.family == "gpt2" and p0 + T > self.config.block_size:
            raise ModelError(f"{p0 + T} positions exceed GPT-2's learned {self.config.block_size}; use a shorter input")
        pos = torch.arange(p0, p0 + T, device=idx.device)
        x = self.wte(idx) + (self.wpe(pos) if self.config.family == "gpt2" else 0)   # learned positions: GPT-2
        for i, block in enumerate(self.h):
            x = block(x, pos, cache[i] if cache is not None else None)
        if cache is not None:
            cache.pos += T
        return self.ln_f(x)

    def forward(self, idx, targets=None, cache=None):
        """idx (B, T) -> (logits (B, T, V), mean next-token cross-entropy against targets or None; -1 ignored)."""
        logits = self.lm_head(self.hidden(idx, cache))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Sample max_new_tokens after idx (B, T) with a decoding cache (KV cache or linear state); top_k=1 is greedy."""
        cache = Cache(self.config.n_layer)
        logits, _ = self(idx, cache=cache)
        for _ in range(max_new_tokens):
            logits = logits[:, -1, :].float() / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, -float("inf"))
            nxt = logits.argmax(-1, keepdim=True) if top_k == 1 else torch.multinomial(F.softmax(logits, dim=-1), 1)
            idx = torch.cat((idx, nxt), dim=1)
            logits, _ = self(nxt, cache=cache)
        return idx

    def linearize(self, dims, feature_map="prf", chunk_size=64):
        """Replace every layer's softmax core by LinearAttention with dims[l] features: one int (shared by the
        layer's heads) or n_head ints (per head). Projections, rotary and everything else stay the checkpoint's; only
        the new feature maps can train."""
        c = self.config
        if len(dims) != c.n_layer:
            raise ModelError(f"linearize needs {c.n_layer} feature dimensions (one per layer), got {list(dims)}")
        for block, m in zip(self.h, dims):
            block.attn.core = LinearAttention(c.n_head, c.n_kv_head, c.head_dim, m, feature_map, chunk_size)
        return self.to(self.wte.weight.device)

    @classmethod
    def from_pretrained(cls, name_or_path, device="cpu", dtype=torch.float32):
        """Load a checkpoint: a local directory (config.json + model.safetensors or a sharded index), a .gguf file
        of llama architecture, the alias "smollm2-135m", or a Hugging Face hub id (gpt2, EleutherAI/pythia-160m, ...)."""
        name = str(name_or_path)
        hf_config, sd = read_checkpoint(name)                      # config.json's dict, tensors under their names
        cfg = GPTConfig(**config_from_hf(hf_config, name))
        with torch.device("meta"):
            model = cls(cfg)                                       # no memory until the weights are assigned
        model.load_state_dict(convert_state_dict(cfg, sd, name), assign=True)
        if cfg.tie_embeddings:
            model.lm_head.weight = model.wte.weight                # assign=True replaced the shared parameter
        return model.to(device=device, dtype=dtype).eval()


# ----------------------------------------------------------------------------------------------------------------
# A distill.py checkpoint: the linear-attention cores' tensors (features.safetensors) and config.json

def feature_state(cores):
    """The cores' parameters and buffers under the student's key names h.{l}.attn.core.*."""
    return {f"h.{l}.attn.core.{n}": t.detach().contiguous().clone()
            for l, c in enumerate(cores) for n, t in c.state_dict().items()}


def load_feature_state(cores, sd, where):
    """feature_state's inverse, after a set-equality check of the keys and shapes."""
    sd = {k.replace(".core.feature_map.", ".core.feature_maps.0."): v for k, v in sd.items()}
    mine = feature_state(cores)
    if set(mine) != set(sd) or any(mine[k].shape != sd[k].shape for k in mine):
        missing, extra = sorted(set(mine) - set(sd)), sorted(set(sd) - set(mine))
        raise ModelError(f"{where} does not fit this student (missing: {missing[:4] or 'none'}, unexpected: "
                         f"{extra[:4] or 'none'}); it was made with another teacher, dims or feature map")
    for l, c in enumerate(cores):
        pre = f"h.{l}.attn.core."
        c.load_state_dict({k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)})


def load_student(ckpt_dir, device="cpu", dtype=torch.float32):
    """A distill.py checkpoint directory -> (the student: its teacher with the trained linear-attention cores, the
    checkpoint's config.json dict)."""
    cfg, sd = read_student(ckpt_dir)
    student = GPT.from_pretrained(cfg["teacher"], device=device, dtype=dtype)
    student.linearize(cfg["dims"], feature_map=cfg["feature_map"], chunk_size=cfg["chunk_size"])
    load_feature_state([b.attn.core for b in student.h], sd, ckpt_dir)
    return student.to(device=device, dtype=dtype).eval(), cfg
