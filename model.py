"""GPT-2, GPT-NeoX (Pythia) and Llama (SmolLM2) with softmax attention, and the linear attention
that replaces it.

    idx (B, T) -> wte (+ wpe) -> n_layer x Block -> ln_f -> lm_head -> logits (B, T, V)
    Block: x + attn(ln_1(x)) + mlp(ln_2(x))                 (parallel residual: Pythia)
           or x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))
    attn:  qkv -> rotary (NeoX, Llama) -> core -> proj
    core:  SoftmaxAttention (the teacher) or LinearAttention (the student)
"""

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import checkpoint


@dataclass
class GPTConfig:
    family: str = "gpt2"          # "gpt2" | "neox" | "llama": embeddings, norms, MLP and residual
    vocab_size: int = 50257       # rows of the embedding (Pythia pads to 50304)
    n_layer: int = 12
    n_head: int = 12              # query heads
    n_kv_head: int = 12           # key/value heads (< n_head: grouped-query attention)
    n_embd: int = 768
    head_dim: int = 64
    block_size: int = 1024        # context length the checkpoint was trained for
    rotary_dim: int = 0           # dims of each head that get rotary (0: learned positions, GPT-2)
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    parallel_residual: bool = False
    tie_embeddings: bool = True   # lm_head shares wte's weight
    mlp_hidden: int = 3072
    bias: bool = True             # biases in the linear layers (GPT-2, NeoX: yes; Llama: no)


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps): the norm in fp32, then w in x's dtype (as HF Llama)."""
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def norm(cfg):
    if cfg.family == "llama":
        return RMSNorm(cfg.n_embd, cfg.norm_eps)
    return nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)


def rotary(x, cos, sin):
    """Rotary on the first r dims of x (B, H, T, D), dim j paired with j + r/2 (rotate-half):
        (x_j, x_{j+r/2}) -> (x_j cos - x_{j+r/2} sin, x_{j+r/2} cos + x_j sin),
    cos and sin (T, r) of the angles pos_t / base^(2i / r)."""
    r = cos.size(-1)
    x1, x2 = x[..., :r].chunk(2, dim=-1)
    xr = x[..., :r] * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)
    return torch.cat((xr, x[..., r:]), dim=-1)


class SoftmaxAttention(nn.Module):
    """The teacher's core: y_i = sum_{j<=i} softmax_j(q_i.k_j / sqrt d) v_j.
    q (B, H, T, D), k, v (B, Hkv, T, D) -> y (B, H, T, D). Decoding keeps a KV cache:
    cache["k"], cache["v"] (B, Hkv, capacity, D) hold cache["n"] tokens."""
    def forward(self, q, k, v, cache=None):
        gqa = k.size(1) != q.size(1)
        if cache is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        B, Hkv, T, D = k.shape
        P = cache.get("n", 0)
        for name, x in (("k", k), ("v", v)):
            kept = cache.get(name, x[:, :, :0])
            # preallocated and written in place (as in gpt-fast); a full one doubles
            if kept.size(2) < P + T:
                room = x.new_empty(B, Hkv, max(T, P), D)
                kept = cache[name] = torch.cat((kept[:, :, :P], room), 2)
            kept[:, :, P:P + T] = x
        cache["n"] = P + T
        k, v = cache["k"][:, :, :P + T], cache["v"][:, :, :P + T]
        # query i, at position P + i, sees keys j <= P + i
        mask = None if T == 1 else torch.ones(T, P + T, dtype=torch.bool, device=q.device).tril(P)
        # not cuDNN: its plans are keyed on shapes, new every token (decoding took 6-8x as long)
        backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


# Linear attention, K(q, k) ~ phi(q).phi(k): the maps phi; y plain (T x T), chunked, recurrent

KEY_SHIFT = 32.0  # beta of overflow_safe_prf: keys at most e^32, far below fp32's 3e38
DEN_EPS = 1e-30   # y's denominator's floor: a query no key reaches gets y = 0, a finite gradient


class PRF(nn.Module):
    """Learned positive random features (the paper's). Per head, with x~ = x / d^(1/4), m = 1..M:
        Phi(x)_m = sqrt(alpha_m / M) exp(z_m.x~ - |x~|^2 / 2),   alpha_m = exp(log_alpha_m),
    z_m ~ N(0, I_d), so that E_z[Phi(q).Phi(k)] = exp(q.k / sqrt d) at alpha = 1 (the init):
    E[e^(z.u)] = e^(|u|^2/2) at u = q~ + k~, and |q~ + k~|^2/2 - |q~|^2/2 - |k~|^2/2 = q~.k~.
    Given z (Performer): z and alpha are fixed buffers."""
    def __init__(self, n_head, head_dim, M, z=None):
        super().__init__()
        self.M = M
        log_alpha = torch.zeros(n_head, M)  # (H, M)
        if z is None:
            self.z = nn.Parameter(torch.randn(n_head, M, head_dim))  # (H, M, d)
            self.log_alpha = nn.Parameter(log_alpha)
        else:
            self.register_buffer("z", z)
            self.register_buffer("log_alpha", log_alpha)

    def log_features(self, x):
        """log Phi(x), the plain formula (the l2 loss's scale)."""
        return prf_log_features(x, self.z, self.log_alpha)

    def forward(self, x, is_query):
        """Phi(x) times factors that cancel in attention (overflow_safe_prf)."""
        dt = torch.promote_types(x.dtype, torch.float32)
        return overflow_safe_prf(x.to(dt), self.z.to(dt), self.log_alpha.to(dt), is_query)

    @staticmethod
    def stacked(maps, q, k, log=False):
        """Features (log: log Phi) of G maps of one M as one, for heads side by side in fp32 q, k
        (B, G H, T, D): z, alpha concatenated. A map with `stacked` stacks in layer_losses."""
        z, la = (torch.cat([getattr(f, n) for f in maps]) for n in ("z", "log_alpha"))
        if log:
            return prf_log_features(q, z, la), prf_log_features(k, z, la)
        return overflow_safe_prf(q, z, la, True), overflow_safe_prf(k, z, la, False)


def prf_log_features(x, z, log_alpha):
    """The plain formula in log: log Phi(x)_m = log sqrt(alpha_m / M) + z_m.x~ - |x~|^2 / 2.
    x (B, H, T, d), z (H, M, d), log_alpha (H, M) -> (B, H, T, M), in fp32 for bf16 inputs."""
    dt = torch.promote_types(x.dtype, torch.float32)
    x = x.to(dt) * x.size(-1) ** -0.25  # x~ (B, H, T, d)
    log_w = 0.5 * (log_alpha.to(dt) - math.log(z.size(1)))  # log sqrt(alpha / M) (H, M)
    return x @ z.to(dt).mT - 0.5 * x.square().sum(-1, keepdim=True) + log_w[:, None]


def overflow_safe_prf(x, z, log_alpha, is_query, beta=KEY_SHIFT):
    """Phi(x) times factors that cancel in normalised attention, computed in place. Needed because
    Phi(x)_m = sqrt(alpha_m / M) e^(|z_m|^2/2 - |x~ - z_m|^2/2) leaves fp32's range: 0/0 for a query
    far from every z_m, overflow for a long z_m. Here
        keys:    phi_m = exp(beta - |k~ - z_m|^2/2) = Phi(k)_m sqrt(M/alpha_m) e^(beta - |z_m|^2/2)
        queries: phi_m = exp(a_m - max a),  a_m = log alpha_m + z_m.q~ + |z_m|^2 / 2
                       = Phi(q)_m sqrt(M alpha_m) e^(|z_m|^2/2) c(q),  c(q) = e^(|q~|^2/2 - max a)
    so phi(q).phi(k) = M e^beta c(q) Phi(q).Phi(k), a factor of the query alone.
    Keys lie in (0, e^beta], queries in (0, 1]."""
    r = x.size(-1) ** -0.25  # x~ = r x
    zx = x @ (r * z).mT  # z_m.x~ (B, H, T, M)
    half_z2 = 0.5 * z.square().sum(-1)[:, None]  # (H, 1, M)
    if is_query:
        a = zx.add_(half_z2 + log_alpha[:, None])  # (B, H, T, M)
        # the max cancels: no gradient through it
        return a.sub_(a.detach().amax(-1, keepdim=True)).exp_()
    half_x2 = 0.5 * (r * x.norm(dim=-1, keepdim=True)).square()  # (B, H, T, 1)
    return zx.add_(beta - half_z2).sub_(half_x2).exp_()


class Performer(PRF):
    """FAVOR+ (Choromanski et al. 2021): PRF with z fixed, blocks of d Haar-orthogonal rows with
    chi(d) norms, so that each row is N(0, I_d)."""
    def __init__(self, n_head, head_dim, M):
        blocks = -(-M // head_dim)
        q, r = torch.linalg.qr(torch.randn(n_head, blocks, head_dim, head_dim))  # (H, nb, d, d)
        q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[..., None, :]  # exactly Haar
        rows = q.mT.reshape(n_head, -1, head_dim)[:, :M]  # (H, M, d) unit rows
        norms = torch.randn(n_head, M, head_dim).norm(dim=-1, keepdim=True)  # (H, M, 1) chi(d)
        super().__init__(n_head, head_dim, M, z=rows * norms)


class DiJiang(nn.Module):
    """DiJiang's map (Chen et al. 2024, arXiv 2403.19928; decay masks and output gate left out):
        phi(x) = softmax(x P),   P = [C diag(Phi^-1(u_1)) | C diag(Phi^-1(u_2)) | ...][:, :M] fixed,
    C the orthonormal DCT-II, Phi^-1 the normal quantile, u Sobol points."""
    def __init__(self, n_head, head_dim, M):
        super().__init__()
        self.M = M
        nb = -(-M // head_dim)
        n = torch.arange(head_dim, dtype=torch.float64)
        # C[k, n], the orthonormal DCT-II (scipy's 'ortho')
        C = torch.cos(math.pi * n[:, None] * (2 * n + 1) / (2 * head_dim)) * math.sqrt(2 / head_dim)
        C[0] /= math.sqrt(2)
        seed = int(torch.randint(2 ** 31, ()))  # Sobol's scramble, from torch's seeded generator
        sobol = torch.quasirandom.SobolEngine(1, scramble=True, seed=seed)
        u = sobol.draw(nb * head_dim, dtype=torch.float64).view(nb, 1, head_dim)
        w = torch.special.ndtri(u.clamp(1e-7, 1 - 1e-7))  # (nb, 1, d); off 0 and 1: finite
        P = (C * w).transpose(0, 1).reshape(head_dim, nb * head_dim)  # [C diag(w_1) | ...]
        self.register_buffer("proj", P[:, :M].float().contiguous())  # (d, M)

    def log_features(self, x):
        dt = torch.promote_types(x.dtype, torch.float32)
        return F.log_softmax(x.to(dt) @ self.proj.to(dt), dim=-1)  # (B, H, T, M)

    def forward(self, x, is_query=True):
        return self.log_features(x).exp()  # shift-stable already: queries and keys alike


FEATURE_MAPS = {"prf": PRF, "performer": Performer, "dijiang": DiJiang}


def linear_attention_reference(phi_q, phi_k, v):
    """The plain form, a masked T x T matrix, O(T^2) memory:
        y_i = sum_{j<=i} (phi_q,i . phi_k,j) v_j / sum_{j<=i} phi_q,i . phi_k,j.
    phi_q, phi_k (B, H, T, M), v (B, H, T, D) -> y (B, H, T, D), in fp32 (fp64 stays fp64)."""
    dt = torch.promote_types(v.dtype, torch.float32)
    A = (phi_q.to(dt) @ phi_k.to(dt).mT).tril()  # (B, H, T, T)
    return (A @ v.to(dt)) / A.sum(-1, keepdim=True)  # (B, H, T, D)


def causal_linear_attention(phi_q, phi_k, v, chunk_size=64, state=None, return_state=False):
    """The reference's y in O(T) memory, in fp32: causal_linear_sums's numerator over its
    denominator, held at DEN_EPS. state = (S, s) continues earlier tokens; return_state=True
    returns (y, S, s)."""
    B, H, T, D = v.shape
    v1 = torch.cat((v, v.new_ones(B, H, T, 1)), -1)  # [v | 1] (B, H, T, D+1)
    if state is not None:
        state = torch.cat((state[0], state[1][..., None]), -1)  # (B, H, M, D+1)
    out, last = causal_linear_sums(phi_q, phi_k, v1, chunk_size, state)
    y = out[..., :D] / out[..., D:].clamp_min(DEN_EPS)  # (B, H, T, D)
    if not return_state:
        return y
    return y, last[..., :D], last[..., D]


def causal_linear_sums(phi_q, phi_k, v1, chunk_size=64, state=None):
    """sum_{j<=i} (phi_q,i . phi_k,j) v1_j for every i, by chunks, in fp32: v1 = [v | 1] gives the
    numerator and the denominator at once. With T padded to N chunks of C tokens, chunk n's
        out_n = phi_q,n P_n + tril(phi_q,n phi_k,n^T) v1_n,
        P_n = sum_{n' < n} phi_k,n'^T v1_n'   (a cumsum over chunks).
    phi_q, phi_k (B, H, T, M), v1 (B, H, T, D+1), state (B, H, M, D+1) from earlier tokens
    -> (out (B, H, T, D+1), the state after the last token (B, H, M, D+1))."""
    B, H, T, M = phi_q.shape
    C = min(chunk_size, T)
    N = -(-T // chunk_size)  # chunks
    dt = torch.promote_types(v1.dtype, torch.float32)
    pad = (0, 0, 0, N * C - T)  # zero-padded to N chunks of C: (B, H, N, C, M or D+1)
    q, k, v1 = (F.pad(x.to(dt), pad) if N * C > T else x.to(dt) for x in (phi_q, phi_k, v1))
    q, k, v1 = (x.view(B, H, N, C, -1) for x in (q, k, v1))
    U = k.mT @ v1  # (B, H, N, M, D+1): each chunk's sum of phi_k v1
    P = torch.cat((torch.zeros_like(U[:, :, :1]), U[:, :, :-1]), 2).cumsum_(2)
    if state is not None:
        P = P + state.to(dt)[:, :, None]  # the tokens before these
    out = (q @ P).add_((q @ k.mT).tril_() @ v1)  # (B, H, N, C, D+1)
    out = out.view(B, H, N * C, -1)[:, :, :T]  # (B, H, T, D+1)
    return out, P[:, :, -1] + U[:, :, -1]


def linear_attention_step(phi_q, phi_k, v, S, s):
    """One token of decoding, the recurrent form:
        S <- S + phi_k v^T,   s <- s + phi_k,   y = phi_q S / phi_q.s
    phi_q, phi_k (B, H, M), v (B, H, D), S (B, H, M, D), s (B, H, M) -> (y (B, H, D), S, s)."""
    S = S + phi_k[..., :, None] * v[..., None, :]  # (B, H, M, D)
    s = s + phi_k  # (B, H, M)
    # a tiny product: elementwise beats a threaded bmm on the CPU
    num = (phi_q[..., :, None] * S).sum(-2)
    return num / (phi_q * s).sum(-1, keepdim=True).clamp_min(DEN_EPS), S, s


def repeat_kv(x, H):
    """(B, Hkv, T, D) -> (B, H, T, D): query head h reads KV head h // (H / Hkv), as HF's."""
    return x if x.size(1) == H else x.repeat_interleave(H // x.size(1), dim=1)


class LinearAttention(nn.Module):
    """The student's core: softmax attention with K(q, k) replaced by phi(q).phi(k - mu), in fp32:
        y_i = phi(q_i) S_i / phi(q_i) s_i,
        S_i = sum_{j<=i} phi(k_j - mu) v_j^T,   s_i = sum_{j<=i} phi(k_j - mu).
    q (B, H, T, D), k, v (B, Hkv, T, D) -> y (B, H, T, D); M features a head; key_mean mu (H, D)
    (softmax ignores it: q.mu is one constant a row). Decoding keeps S (B, H, M, D), s (B, H, M)."""
    def __init__(self, n_head, n_kv_head, head_dim, M, feature_map="prf", chunk_size=64):
        super().__init__()
        self.n_head = n_head
        self.M = M
        self.chunk_size = chunk_size
        self.feature_map = FEATURE_MAPS[feature_map](n_head, head_dim, M)
        self.register_buffer("key_mean", torch.zeros(n_head, head_dim))  # (H, D)

    def inputs(self, q, k):
        """The fp32 queries and centred keys k - mu (B, H, T, D) that the feature map sees."""
        dt = torch.promote_types(q.dtype, torch.float32)
        return q.to(dt), repeat_kv(k, self.n_head).to(dt) - self.key_mean[:, None].to(dt)

    def features(self, q, k, log=False):
        """(phi_q, phi_k) (B, H, T, M) of `inputs`, autocast off; log=True: log Phi (plain form)."""
        f = self.feature_map
        if log:
            return f.log_features(q), f.log_features(k)
        return f(q, is_query=True), f(k, is_query=False)

    def forward(self, q, k, v, cache=None):
        with torch.autocast(q.device.type, enabled=False):
            phi_q, phi_k = self.features(*self.inputs(q, k))  # (B, H, T, M)
            v = repeat_kv(v, self.n_head)  # (B, H, T, D)
            if cache is None:
                return causal_linear_attention(phi_q, phi_k, v, self.chunk_size).to(q.dtype)
            # decoding: the recurrent step for one token, the scan for more
            state = (cache["S"], cache["s"]) if "S" in cache else None
            if state is not None and v.size(2) == 1:
                y, S, s = linear_attention_step(phi_q[:, :, 0], phi_k[:, :, 0], v[:, :, 0], *state)
                y = y[:, :, None]
            else:
                y, S, s = causal_linear_attention(phi_q, phi_k, v, self.chunk_size, state, True)
            cache["S"], cache["s"] = S, s
            return y.to(q.dtype)


class Attention(nn.Module):
    """Projections and rotary around an attention core: x (B, T, C) -> (B, T, C)."""
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.core = SoftmaxAttention()
        n_qkv = (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim
        self.qkv = nn.Linear(cfg.n_embd, n_qkv, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=cfg.bias)

    def forward(self, x, rope, cache=None):
        B, T, _ = x.shape
        H, Hkv, D = self.cfg.n_head, self.cfg.n_kv_head, self.cfg.head_dim
        qkv = self.qkv(x).split([H * D, Hkv * D, Hkv * D], -1)
        q, k, v = (t.view(B, T, -1, D).transpose(1, 2) for t in qkv)  # (B, H or Hkv, T, D)
        if rope is not None:
            q, k = rotary(q, *rope), rotary(k, *rope)
        y = self.core(q, k, v, cache)  # (B, H, T, D)
        return self.proj(y.transpose(1, 2).reshape(B, T, H * D))


class MLP(nn.Module):
    """GPT-2: proj(gelu_tanh(fc(x))), NeoX: proj(gelu(fc(x))), Llama: proj(silu(gate(x)) fc(x))."""
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
        approximate = "tanh" if self.family == "gpt2" else "none"
        return self.proj(F.gelu(self.fc(x), approximate=approximate))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.parallel = cfg.parallel_residual
        self.ln_1 = norm(cfg)
        self.attn = Attention(cfg)
        self.ln_2 = norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, cache=None):
        if self.parallel:
            return x + self.attn(self.ln_1(x), rope, cache) + self.mlp(self.ln_2(x))
        x = x + self.attn(self.ln_1(x), rope, cache)
        return x + self.mlp(self.ln_2(x))


class Cache(list):
    """Decoding state: a dict per layer, kept by its attention core, and the tokens seen (pos)."""
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

    def cores(self):
        """Each layer's attention core; a forward pre-hook on one sees its layer's q, k."""
        return [block.attn.core for block in self.h]

    def hidden(self, idx, cache=None):
        """idx (B, T) -> final-normed hidden states (B, T, C); when decoding, cache.pos += T."""
        c, T = self.config, idx.size(1)
        p0 = cache.pos if cache is not None else 0  # an int (a tensor in bench/graphed_decode.py)
        pos = p0 + torch.arange(T, device=idx.device)  # (T,)
        x = self.wte(idx) + (self.wpe(pos) if c.family == "gpt2" else 0)  # learned positions: GPT-2
        # rotary, for all layers: angles pos_t / base^(2i / r), each i twice (T, r)
        two_i = torch.arange(0, c.rotary_dim, 2, device=idx.device, dtype=torch.float32)
        inv_freq = 1.0 / c.rope_base ** (two_i / max(1, c.rotary_dim))
        angles = (pos.float()[:, None] * inv_freq).repeat(1, 2)
        rope = (angles.cos(), angles.sin()) if c.rotary_dim else None
        for i, block in enumerate(self.h):
            x = block(x, rope, cache[i] if cache is not None else None)
        if cache is not None:
            cache.pos += T
        return self.ln_f(x)

    def forward(self, idx, cache=None):
        """idx (B, T) -> logits (B, T, V)."""
        return self.lm_head(self.hidden(idx, cache))

    def nll(self, idx, targets):
        """The one loss, (B,): summed fp32 cross-entropy on targets (B, T), -1 ignored; a sequence's
        logits (T, V) at a time, never (B, T, V)."""
        losses = [F.cross_entropy(self.lm_head(h).float(), y, ignore_index=-1, reduction="sum")
                  for h, y in zip(self.hidden(idx), targets)]
        return torch.stack(losses)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens):
        """Greedy decoding of max_new_tokens after idx (B, T), a forward pass a token (a Cache)."""
        cache = Cache(self.config.n_layer)
        x = idx
        for _ in range(max_new_tokens):
            x = self.lm_head(self.hidden(x, cache)[:, -1]).argmax(-1, keepdim=True)  # (B, 1)
            idx = torch.cat((idx, x), dim=1)
        return idx

    def linearize(self, dims, feature_map="prf", chunk_size=64):
        """The student: the teacher, layer l's core a LinearAttention of dims[l] features a head."""
        c = self.config
        # deepcopy's memo: every parameter and buffer stays the teacher's; only the cores are new
        shared = {id(t): t for t in (*self.parameters(), *self.buffers())}
        student = copy.deepcopy(self, shared)
        for block, m in zip(student.h, dims):
            core = LinearAttention(c.n_head, c.n_kv_head, c.head_dim, m, feature_map, chunk_size)
            block.attn.core = core
        return student.to(self.wte.weight.device)

    @classmethod
    def from_pretrained(cls, name_or_path, device="cpu", dtype=torch.float32):
        """A directory (config.json + safetensors, maybe sharded), a llama .gguf, "smollm2-135m"
        or a hub id, read, checked and converted to our names by checkpoint.py."""
        name = str(name_or_path)
        hf_config, sd = checkpoint.read_checkpoint(name)  # config.json's dict, the tensors
        with torch.device("meta"):
            gpt = cls(GPTConfig(**checkpoint.config_from_hf(hf_config, name)))  # no memory yet
        checkpoint.load_weights(gpt, sd, name)
        return gpt.to(device=device, dtype=dtype).eval()
