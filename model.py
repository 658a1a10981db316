"""
The model: GPT-2, GPT-NeoX (Pythia) and Llama-family (SmolLM2) transformers in one small file, loaded from
Hugging Face checkpoints (safetensors) or llama.cpp GGUF files, their tokenizers as tiktoken encodings, softmax
attention, and the linear-attention block that replaces it (feature maps, chunked causal scan, recurrent state).

    idx (B, T) -> wte (+ wpe) -> n_layer x Block -> ln_f -> lm_head -> logits (B, T, V)
    Block:  x + attn(ln_1(x)) + mlp(ln_2(x))        (parallel residual, Pythia)
            x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))  (sequential: GPT-2, Llama, some NeoX)
    attn:   qkv projection -> rotary (NeoX, Llama) -> core(q, k, v) -> proj
    core:   SoftmaxAttention (the teacher) or LinearAttention (the student), swapped by GPT.linearize(dims)

Every layer's attention core receives (q, k, v) after rotary as its inputs, so a forward hook on
`model.h[l].attn.core` sees a layer's queries and keys: that is how dof.py and distill.py read them.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from checkpoint import config_from_hf, convert_state_dict, read_checkpoint
from common import ModelError


# ----------------------------------------------------------------------------------------------------------------
# Configuration

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
# Layers

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
        # q (B, H, T, D); k, v (B, Hkv, T, D)
        mask, causal = None, True
        if cache is not None:
            if "k" in cache:
                P, T = cache["k"].size(2), q.size(2)
                k, v = torch.cat((cache["k"], k), 2), torch.cat((cache["v"], v), 2)
                mask = torch.arange(T, device=q.device)[:, None] + P >= torch.arange(P + T, device=q.device)
                causal = False
            cache["k"], cache["v"] = k, v
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              enable_gqa=k.size(1) != q.size(1))


# ----------------------------------------------------------------------------------------------------------------
# Linear attention: feature maps, a chunked causal scan, and constant-memory decoding.
# Softmax attention y_i = sum_{j<=i} K(q_i, k_j) v_j / sum_{j<=i} K(q_i, k_j), K(q, k) = exp(q.k / sqrt(d)), becomes
# linear in T once K(q, k) ~ phi(q).phi(k) for non-negative features phi (B, H, T, d) -> (B, H, T, M):
#     y_i = phi(q_i) S_i / phi(q_i) s_i,   S_i = sum_{j<=i} phi(k_j) v_j^T  (M x D),   s_i = sum_{j<=i} phi(k_j)  (M).

KEY_SHIFT = 32.0  # beta: PRF key features are exp(beta - |k~ - z|^2 / 2) <= e^32 ~ 8e13, far below fp32's 3e38


class PRF(nn.Module):
    """Learned positive random features (the paper's). Per head, with x~ = x / d^(1/4) and m = 1..M:

        Phi(x)_m = sqrt(alpha_m / M) exp(z_m.x~ - |x~|^2 / 2),   z_m ~ N(0, I_d), alpha_m = exp(log_alpha_m) = 1 at init,

    so that E_z[Phi(q).Phi(k)] = exp(q.k / sqrt(d)). `log_features(x)` is log Phi(x), exactly as written.

    `forward(x, is_query)` gives fp32 features rescaled so that nothing overflows, while the normalised attention
    (the only thing the scan computes) is exactly unchanged and no token's features depend on another token:

        keys:     phi_k,m = exp(beta - |k~ - z_m|^2 / 2)                                  in (0, e^beta]
        queries:  phi_q,m = exp(a_m - max_m' a_m'),  a_m = log alpha_m + z_m.q~ + |z_m|^2 / 2   in (0, 1], max 1

    Expanding |k~ - z_m|^2 gives phi_q,m phi_k,m = M Phi(q)_m Phi(k)_m * exp(|q~|^2/2 + beta - max a), so
    phi(q).phi(k) = K^(q, k) * c(q): a factor of the query alone (the per-query max, and the per-feature key
    bound exp(|z_m|^2/2) moved onto the query side, where the max absorbs it). c(q) cancels between numerator and
    denominator; a shift of each key by its own amount would not (it reweights key j), so keys get only the
    token-independent per-feature bound and the constant beta. Limit: a key far from every z_m
    (|k~ - z_m|^2 / 2 > beta + 87 for all m) underflows to zero features and drops out; if all of a query's keys
    do, its output is 0 (see `eps` in causal_linear_attention), never NaN.
    """

    def __init__(self, n_head, head_dim, M):
        super().__init__()
        self.head_dim, self.M = head_dim, M
        self.z = nn.Parameter(torch.randn(n_head, M, head_dim))  # (H, M, d)
        self.log_alpha = nn.Parameter(torch.zeros(n_head, M))    # (H, M)

    def _project(self, x):
        """x (B, H, T, d) -> z_m.x~ (B, H, T, M), |x~|^2 / 2 (B, H, T, 1), z (H, M, d); fp32 for bf16 inputs."""
        dt = torch.promote_types(x.dtype, torch.float32)
        x, z, r = x.to(dt), self.z.to(dt), self.head_dim ** -0.25                     # x~ = r x
        return x @ (r * z).mT, 0.5 * (r * x.norm(dim=-1, keepdim=True)).square(), z

    def log_features(self, x):
        zx, half_x2, _ = self._project(x)
        log_w = 0.5 * (self.log_alpha.to(zx.dtype) - math.log(self.M))               # (H, M)
        return zx - half_x2 + log_w[:, None]                                           # (B, H, T, M)

    def forward(self, x, is_query):
        zx, half_x2, z = self._project(x)
        half_z2 = 0.5 * z.square().sum(-1)[:, None]                                    # (H, 1, M)
        # in place (_): these are the big (B, H, T, M) tensors, and each pass over them costs as much as the matmul
        if is_query:
            a = zx.add_(half_z2 + self.log_alpha.to(zx.dtype)[:, None])                # (B, H, T, M)
            return a.sub_(a.detach().amax(-1, keepdim=True)).exp_()  # the max cancels: no gradient through it
        return zx.add_(KEY_SHIFT - half_z2).sub_(half_x2).exp_()                       # exp(beta - |k~ - z|^2/2)


def orthogonal_gaussian(n_head, M, d):
    """(H, M, d) Performer features: blocks of d orthogonal rows (QR of a Gaussian matrix, Haar-distributed), each
    row rescaled to an independent chi(d) norm (the norm of a Gaussian vector), so every row is N(0, I_d)."""
    q, r = torch.linalg.qr(torch.randn(n_head, -(-M // d), d, d))                   # (H, nb, d, d)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[..., None, :]             # sign fix: exactly Haar
    rows = q.mT.reshape(n_head, -1, d)[:, :M]                                           # (H, M, d) unit rows
    return rows * torch.randn(n_head, M, d).norm(dim=-1, keepdim=True)


class Performer(PRF):
    """FAVOR+ (Choromanski et al. 2021): the PRF map above with fixed orthogonal random z (a buffer, not trained)
    and equal weights 1/M (alpha = 1); same stabilisation."""

    def __init__(self, n_head, head_dim, M):
        nn.Module.__init__(self)
        self.head_dim, self.M = head_dim, M
        self.register_buffer("z", orthogonal_gaussian(n_head, M, head_dim))       # (H, M, d)
        self.register_buffer("log_alpha", torch.zeros(n_head, M))                  # (H, M)


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
    sequence, as the paper has it (the authors' code draws u with torch.rand). No 1/sqrt(d) scaling, as there.
    P is fixed (a buffer). The authors' P is d x d; for M != d we concatenate ceil(M/d) blocks C diag(Phi^-1(u_b)),
    each with fresh points u_b, and keep the first M columns. Features sum to 1 per token. DiJiang's decay
    masks (D1, D2) and output gate (W_G, GroupNorm) change the architecture, not the feature map: left out here.
    """

    def __init__(self, n_head, head_dim, M):
        super().__init__()
        nb = -(-M // head_dim)
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
    """The plain masked T x T form: y_i = sum_{j<=i} (phi_q,i . phi_k,j) v_j / sum_{j<=i} phi_q,i . phi_k,j."""
    dt = torch.promote_types(v.dtype, torch.float32)
    A = (phi_q.to(dt) @ phi_k.to(dt).mT).tril()                                         # (B, H, T, T)
    return (A @ v.to(dt)) / A.sum(-1, keepdim=True)                                     # (B, H, T, D)


def linear_attention_step(phi_q, phi_k, v, S, s, eps=1e-30):
    """One token of the recurrence: S += phi_k v^T, s += phi_k, y = phi_q S / phi_q.s.
    phi_q, phi_k (B, H, M); v (B, H, D); S (B, H, M, D); s (B, H, M) -> y (B, H, D), S, s."""
    dt = torch.promote_types(v.dtype, torch.float32)
    phi_q, phi_k, v = phi_q.to(dt), phi_k.to(dt), v.to(dt)
    S = S + phi_k[..., :, None] * v[..., None, :]                                       # (B, H, M, D)
    s = s + phi_k                                                                       # (B, H, M)
    num = (phi_q[..., :, None] * S).sum(-2)  # a tiny product: elementwise beats a threaded bmm on CPU
    y = num / (phi_q * s).sum(-1, keepdim=True).clamp_min(eps)
    return y, S, s


def causal_linear_attention(phi_q, phi_k, v, chunk_size=64, eps=1e-30, state=None, return_state=False):
    """Chunked causal linear attention, y_i = sum_{j<=i} (phi_q,i . phi_k,j) v_j / sum_{j<=i} phi_q,i . phi_k,j.
    phi_q, phi_k (B, H, T, M), v (B, H, T, D) -> y (B, H, T, D); any T (padded to a multiple of chunk_size).

    v gets a column of ones, so numerator and denominator come out of the same products. In chunk c:
    y = phi_q (S_0 + sum_{c' < c} phi_k,c'^T v_c') + tril(phi_q phi_k^T) v_c: the masked quadratic form inside
    the chunk, the per-chunk states summed over earlier chunks by one cumsum (no loop over tokens or chunks).
    Accumulates in fp32 (fp64 stays fp64). `state` = (S (B, H, M, D), s (B, H, M)) continues from earlier tokens;
    return_state=True returns (y, S, s) after the last token. A denominator below eps (all keys underflowed) gives 0.
    """
    B, H, T, M = phi_q.shape
    D, C = v.size(-1), chunk_size
    N = -(-T // C)
    dt = torch.promote_types(v.dtype, torch.float32)
    pad = lambda x: F.pad(x.to(dt), (0, 0, 0, N * C - T)) if N * C > T else x.to(dt)
    q, k = pad(phi_q).view(B, H, N, C, M), pad(phi_k).view(B, H, N, C, M)
    v1 = pad(torch.cat((v, v.new_ones(B, H, T, 1)), -1)).view(B, H, N, C, D + 1)     # [v | 1]
    U = k.mT @ v1                                                                      # (B, H, N, M, D+1)
    P = torch.cat((torch.zeros_like(U[:, :, :1]), U[:, :, :-1]), 2).cumsum_(2)        # sum over earlier chunks
    if state is not None:
        P = P + torch.cat((state[0], state[1][..., None]), -1).to(dt)[:, :, None]     # (B, H, 1, M, D+1)
    out = (q @ P).add_((q @ k.mT).tril_() @ v1)                                       # (B, H, N, C, D+1)
    out = out.view(B, H, N * C, D + 1)[:, :, :T]
    y = out[..., :D] / out[..., D:].clamp_min(eps)                                     # (B, H, T, D)
    if not return_state:
        return y
    last = P[:, :, -1] + U[:, :, -1]                                                   # (B, H, M, D+1)
    return y, last[..., :D], last[..., D]


def repeat_kv(x, H):
    """Grouped-query attention: (B, Hkv, T, D) -> (B, H, T, D), each KV head repeated for its H // Hkv query heads
    (as Hugging Face's repeat_kv)."""
    return x if x.size(1) == H else x.repeat_interleave(H // x.size(1), dim=1)


class LinearAttention(nn.Module):
    """The student's core: y = causal linear attention with M features per head, replacing softmax attention.
    forward(q (B, H, T, D), k, v (B, Hkv, T, D), cache=None) -> (B, H, T, D); q and k are after rotary.
    k and v are repeated to H heads (GQA, as HF's repeat_kv) and keys are centred by the buffer key_mean (H, D),
    zero unless distillation sets it (q.(k - mu) shifts every logit of a query equally: softmax unchanged).
    With a cache dict, decoding keeps only the state S (B, H, M, D), s (B, H, M) there: fixed size, no KV cache.
    """

    def __init__(self, n_head, n_kv_head, head_dim, M, feature_map="prf", chunk_size=64):
        super().__init__()
        if feature_map not in FEATURE_MAPS:
            raise ModelError(f"unknown feature map {feature_map!r}; choose one of {', '.join(FEATURE_MAPS)}")
        self.n_head, self.n_kv_head, self.M, self.chunk_size = n_head, n_kv_head, M, chunk_size
        self.feature_map = FEATURE_MAPS[feature_map](n_head, head_dim, M)
        self.register_buffer("key_mean", torch.zeros(n_head, head_dim))                # (H, D)

    def features(self, q, k):
        """(phi_q, phi_k), each (B, H, T, M) fp32, for queries q (B, H, T, D) and keys k (B, Hkv, T, D)."""
        k = repeat_kv(k, self.n_head) - self.key_mean[:, None].to(k.dtype)
        return self.feature_map(q, is_query=True), self.feature_map(k, is_query=False)

    def scores(self, q, k):
        """The student's normalised causal attention matrix (B, H, T, T): row i = phi_q,i . phi_k,j / sum_j<=i."""
        phi_q, phi_k = self.features(q, k)
        A = (phi_q @ phi_k.mT).tril()
        return A / A.sum(-1, keepdim=True)

    def forward(self, q, k, v, cache=None):
        phi_q, phi_k = self.features(q, k)                                               # (B, H, T, M)
        v = repeat_kv(v, self.n_head)                                                    # (B, H, T, D)
        if cache is None:
            return causal_linear_attention(phi_q, phi_k, v, self.chunk_size).to(q.dtype)
        if "S" not in cache:
            B, H, _, D = v.shape
            cache["S"] = phi_q.new_zeros(B, H, self.M, D)
            cache["s"] = phi_q.new_zeros(B, H, self.M)
        if q.size(2) == 1:
            y, cache["S"], cache["s"] = linear_attention_step(phi_q[:, :, 0], phi_k[:, :, 0], v[:, :, 0],
                                                              cache["S"], cache["s"])
            y = y[:, :, None]
        else:
            y, cache["S"], cache["s"] = causal_linear_attention(phi_q, phi_k, v, self.chunk_size,
                                                                state=(cache["S"], cache["s"]), return_state=True)
        return y.to(q.dtype)


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
        k = k.view(B, T, c.n_kv_head, c.head_dim).transpose(1, 2)           # (B, Hkv, T, D)
        v = v.view(B, T, c.n_kv_head, c.head_dim).transpose(1, 2)
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
        T = idx.size(1)
        p0 = cache.pos if cache is not None else 0
        if self.config.family == "gpt2" and p0 + T > self.config.block_size:
            raise ModelError(f"{p0 + T} positions exceed GPT-2's learned {self.config.block_size}; use a shorter input")
        pos = torch.arange(p0, p0 + T, device=idx.device)
        x = self.wte(idx)
        if self.config.family == "gpt2":
            x = x + self.wpe(pos)
        for i, block in enumerate(self.h):
            x = block(x, pos, cache[i] if cache is not None else None)
        if cache is not None:
            cache.pos += T
        return self.ln_f(x)

    def forward(self, idx, targets=None, cache=None):
        """idx (B, T) -> (logits (B, T, V), mean next-token cross-entropy against targets or None; -1 ignored)."""
        logits = self.lm_head(self.hidden(idx, cache))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
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
            if top_k == 1:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1)
            idx = torch.cat((idx, nxt), dim=1)
            logits, _ = self(nxt, cache=cache)
        return idx

    def linearize(self, dims, feature_map="prf", chunk_size=64):
        """Replace every layer's softmax core by LinearAttention with dims[l] features (shared by the layer's heads).
        Projections, rotary and everything else stay the checkpoint's; only the new feature maps can train."""
        c = self.config
        if len(dims) != c.n_layer or min(dims) < 1:
            raise ModelError(f"linearize needs {c.n_layer} feature dimensions of at least 1, got {list(dims)}")
        for block, m in zip(self.h, dims):
            block.attn.core = LinearAttention(c.n_head, c.n_kv_head, c.head_dim, int(m), feature_map, chunk_size)
        return self.to(self.wte.weight.device)

    @classmethod
    def from_pretrained(cls, name_or_path, device="cpu", dtype=torch.float32):
        """Load a checkpoint: a local directory (config.json + model.safetensors or a sharded index), a .gguf file
        of llama architecture, the alias "smollm2-135m", or a Hugging Face hub id (gpt2, EleutherAI/pythia-160m, ...)."""
        hf_cfg, sd = read_checkpoint(str(name_or_path))
        cfg = GPTConfig(**config_from_hf(hf_cfg, str(name_or_path)))
        with torch.device("meta"):
            model = cls(cfg)
        sd = convert_state_dict(cfg, sd, str(name_or_path))
        if cfg.tie_embeddings:
            sd["lm_head.weight"] = sd["wte.weight"]
        model.load_state_dict(sd, assign=True)
        if cfg.tie_embeddings:
            model.lm_head.weight = model.wte.weight
        return model.to(device=device, dtype=dtype).eval()
