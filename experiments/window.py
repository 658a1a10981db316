"""
Beyond the paper: a window of exact softmax beside the learned features (as LoLCATs, Liger and
LoLA keep), and S sink tokens (as StreamingLLM keeps). Query i weighs its last W keys and the
first S tokens exactly (the exact set E_i) and every other earlier key through the features,
under one normaliser:

    y_i = (sum_{j in E_i} e^(q_i.k_j / sqrt d) v_j + Phi(q_i) S_i)
          / (sum_{j in E_i} e^(q_i.k_j / sqrt d) + Phi(q_i) s_i),
    E_i = {j <= i: j > i - W or j < S},   S_i = sum_{S<=j<=i-W} Phi(k_j) v_j^T,   s_i likewise.

E[Phi(q).Phi(k)] = e^(q.k / sqrt d) (positive random features), so the two parts are on one
scale and need no mixing weight. W = 0 (and S = 0) is the core's linear attention.

    python experiments/window.py --window 64 --sinks 4 --model smollm2-135m --data data/wikitext2 \
        --preset cpu --out-dir out-window
    python experiments/window.py evaluate --model smollm2-135m --ckpt out-window --ppl FILE

How it forks the core: REPLACE sets model.LinearAttention to WindowAttention (its window set by
make_student from the flags, by tasks.load_student from config.json), distill.layer_losses to the
softmax loss on the hybrid's rows (each layer alone; the l2 loss stays the core's), DistillConfig
to one with --window and --sinks, and evaluate's names to experiments/streaming.py's.
"""

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import distill  # noqa: E402
import door  # noqa: E402
import forks  # noqa: E402
import model  # noqa: E402
import streaming  # noqa: E402
import tasks  # noqa: E402

CoreLinearAttention = model.LinearAttention
core_layer_losses = distill.layer_losses
core_make_student = distill.make_student
core_load_student = tasks.load_student


# The scale: the features run times a factor of the query (model.overflow_safe_prf), the exact part
# takes the same; then m_i = max(0, max_j l_ij) over its exact keys scales both parts by e^(-m_i).

@torch.no_grad()
def query_log_factor(feature_map, q):
    """log F(q) (B, H, T, 1), where overflow_safe_prf's phi(q).phi(k) = F(q) Phi(q).Phi(k):
        log F(q) = log M + beta + |q~|^2 / 2 - max_m a_m,  a_m = log alpha_m + z_m.q~ + |z_m|^2 / 2.
    A factor of the query alone cancels in y: no gradient."""
    z = feature_map.z.to(q.dtype)  # (H, M, d)
    x = q * q.size(-1) ** -0.25  # q~ (B, H, T, d)
    a = x @ z.mT + 0.5 * z.square().sum(-1)[:, None] + feature_map.log_alpha.to(q.dtype)[:, None]
    half_x2 = 0.5 * x.square().sum(-1, keepdim=True)
    return math.log(feature_map.M) + model.KEY_SHIFT + half_x2 - a.amax(-1, keepdim=True)


def window_masks(s, e, n_keys, W, device, S=0):
    """Queries s..e-1 against keys 0..n_keys-1 -> (near, far) (e - s, n_keys): the exact keys,
    j <= i in the window (i - W < j) or a sink (j < S), and the features' keys, S <= j <= i - W."""
    i = torch.arange(s, e, device=device)[:, None]
    j = torch.arange(n_keys, device=device)
    return streaming.exact_keys(i, j, W, S), (j <= i - W) & (j >= S)


def shifted(l):
    """The window's logits l (B, H, b, n), -inf outside it -> (e^(l - m), e^(-m) (B, H, b, 1)),
    m_i = max(0, max_j l_ij): the shift both parts of a row take."""
    m = l.detach().amax(-1, keepdim=True).clamp_min(0.0)
    return (l - m).exp(), (-m).exp()


def hybrid_weights(logits, log_f, phi_q, phi_k, near, far):
    """a_ij = e^(l_ij - m_i) in the window, e^(-m_i) phi_q,i.phi_k,j before it, 0 after i;
    l = logits + log F(q) (shifted). logits (B, H, b, n) are q.k / sqrt d, phi_q (B, H, b, M),
    phi_k (B, H, n, M) -> (a, e^(-m) (B, H, b, 1))."""
    exact, c = shifted((logits + log_f).masked_fill(~near, float("-inf")))
    a = (phi_q @ phi_k.mT * c).masked_fill(~far, 0.0)
    return a + exact, c


# The hybrid three ways: the plain T x T form, the chunked form, the recurrent step

def hybrid_reference(q, k, v, phi_q, phi_k, log_f, W, S=0):
    """The plain form, a masked T x T matrix: y_i = sum_j a_ij v_j / sum_j a_ij (hybrid_weights).
    q, k, v (B, H, T, D) (keys centred), phi_q, phi_k (B, H, T, M), log_f (B, H, T, 1) -> y, in
    fp32 (fp64 stays fp64)."""
    dt = torch.promote_types(v.dtype, torch.float32)
    q, k, v, phi_q, phi_k, log_f = (x.to(dt) for x in (q, k, v, phi_q, phi_k, log_f))
    near, far = window_masks(0, q.size(2), q.size(2), W, q.device, S)  # (T, T)
    logits = q @ k.mT / math.sqrt(q.size(-1))
    a, _ = hybrid_weights(logits, log_f, phi_q, phi_k, near, far)  # (B, H, T, T)
    return (a @ v) / a.sum(-1, keepdim=True)


def with_ones(v):
    """[v | 1] (B, H, T, D+1): the denominator beside the numerator."""
    return torch.cat((v, torch.ones_like(v[..., :1])), -1)


def delay(x, W):
    """x_{j-W} at position j (B, H, T, n): zeros for j < W."""
    return F.pad(x, (0, 0, W, 0))[:, :, :x.size(2)]


def hybrid_attention(q, k, v, phi_q, phi_k, log_f, W, chunk_size=64, eps=1e-30, S=0):
    """The reference's y in O(T (C + W + S)) memory -> (y, the state (B, H, M, D+1) after the last
    token). The features' sums are the core's scan on keys and values delayed by W tokens, the
    sinks' features zeroed (query i's state holds keys S <= j <= i - W); the exact part runs a block
    of C queries at a time over their last W keys and the sinks before them."""
    B, H, T, D = v.shape
    dt = torch.promote_types(v.dtype, torch.float32)
    v1 = with_ones(v).to(dt)  # (B, H, T, D+1)
    if S:
        phi_k = torch.cat((torch.zeros_like(phi_k[:, :, :S]), phi_k[:, :, S:]), 2)
    sums, state = model.causal_linear_sums(phi_q, delay(phi_k, W), delay(v1, W), chunk_size)
    out = []
    for s in range(0, T, chunk_size):
        e = min(T, s + chunk_size)
        lo = max(0, s - W + 1)  # the block's first key in a window
        near = window_masks(s, e, e, W, q.device, S)[0]  # (b, e)
        sink = min(S, lo)  # the block's keys: the sinks before its first window, then lo..e-1
        kb, vb = k[:, :, lo:e], v1[:, :, lo:e]
        if sink:
            kb, vb = torch.cat((k[:, :, :sink], kb), 2), torch.cat((v1[:, :, :sink], vb), 2)
        near = torch.cat((near[:, :sink], near[:, lo:]), 1)
        logits = q[:, :, s:e].to(dt) @ kb.to(dt).mT / math.sqrt(D)  # (B, H, b, n)
        exact, c = shifted((logits + log_f[:, :, s:e]).masked_fill(~near, float("-inf")))
        out.append(sums[:, :, s:e] * c + exact @ vb)
    out = torch.cat(out, 2)  # (B, H, T, D+1)
    return out[..., :D] / out[..., D:].clamp_min(eps), state


class WindowAttention(CoreLinearAttention):
    """The core's LinearAttention with exact softmax on each query's last `window` keys and first
    `sinks` tokens (0, 0: the core's). Decoding keeps the state P (B, H, M, D+1), a ring of the last
    W keys and values (B, Hkv, W, D) and the S sinks' (B, Hkv, S, D): token n goes to slot n % W,
    and the key it replaces, n - W, enters the state unless it is a sink."""
    window = sinks = 0

    def forward(self, q, k, v, cache=None):
        if self.window == 0 and self.sinks == 0:
            return super().forward(q, k, v, cache)
        with torch.autocast(q.device.type, enabled=False):
            if cache is None:
                return self.hybrid(q, k, v)[0].to(q.dtype)
            if not cache:
                return self.prefill(q, k, v, cache).to(q.dtype)
            ys = [self.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache)
                  for t in range(q.size(2))]
            return torch.cat(ys, 2).to(q.dtype)

    def hybrid(self, q, k, v):
        """(y, state) of hybrid_attention on q, k, v (B, H or Hkv, T, D)."""
        q, kc = self.inputs(q, k)  # fp32, keys centred
        phi_q, phi_k = self.features(q, kc)
        log_f = query_log_factor(self.feature_map, q)
        v = model.repeat_kv(v, self.n_head)
        return hybrid_attention(q, kc, v, phi_q, phi_k, log_f, self.window, self.chunk_size,
                                S=self.sinks)

    def prefill(self, q, k, v, cache):
        """The first tokens: the chunked form, then the cache of its state and last W tokens."""
        y, cache["P"] = self.hybrid(q, k, v)
        B, Hkv, T, D = k.shape
        pos = torch.arange(max(0, T - self.window), T, device=k.device)
        for name, x in (("k", k), ("v", v)):
            cache[name] = x.new_zeros(B, Hkv, self.window, D)
            cache[name][:, :, pos % self.window] = x[:, :, pos]
        cache["sk"], cache["sv"] = k[:, :, :self.sinks], v[:, :, :self.sinks]
        cache["n"] = T
        return y

    def step(self, q, k, v, cache, eps=1e-30):
        """One token (B, H or Hkv, 1, D) of decoding, the recurrent form."""
        n, W, S = cache["n"], self.window, self.sinks
        slot = n % W
        if n >= W + S:
            # key n - W leaves the window for the state
            k_out = self.inputs(q, cache["k"][:, :, slot:slot + 1])[1]  # (B, H, 1, D)
            phi_k = self.feature_map(k_out, is_query=False)  # (B, H, 1, M)
            v_out = model.repeat_kv(cache["v"][:, :, slot:slot + 1], self.n_head)
            cache["P"] = cache["P"] + phi_k.mT @ with_ones(v_out).to(phi_k.dtype)  # (B, H, M, D+1)
        cache["k"][:, :, slot] = k[:, :, 0]
        cache["v"][:, :, slot] = v[:, :, 0]
        if n < S:
            cache["sk"] = torch.cat((cache["sk"], k), 2)
            cache["sv"] = torch.cat((cache["sv"], v), 2)
        cache["n"] = n + 1
        kept = min(n + 1, W)  # slots 0..kept-1 hold the window
        sinks = max(0, min(S, n + 1 - W))  # the sinks before the window
        keys = torch.cat((cache["sk"][:, :, :sinks], cache["k"][:, :, :kept]), 2)
        values = torch.cat((cache["sv"][:, :, :sinks], cache["v"][:, :, :kept]), 2)
        qf, kc = self.inputs(q, keys)  # (B, H, 1 or sinks + kept, D)
        v1 = with_ones(model.repeat_kv(values, self.n_head)).to(qf.dtype)
        l = qf @ kc.mT / math.sqrt(q.size(-1)) + query_log_factor(self.feature_map, qf)
        exact, c = shifted(l)  # (B, H, 1, kept), (B, H, 1, 1)
        phi_q = self.feature_map(qf, is_query=True)  # (B, H, 1, M)
        out = (phi_q @ cache["P"]) * c + exact @ v1  # (B, H, 1, D+1)
        return out[..., :-1] / out[..., -1:].clamp_min(eps)


def set_window(student, W, S=0):
    """The student with a window of W keys and S sinks in every layer (0, 0: the core's)."""
    for core in student.cores():
        core.window, core.sinks = W, S
    return student


# Training: the softmax loss on the hybrid's rows

def softmax_loss(q, k, phi_q, phi_k, log_f, W, S=0):
    """KL(p_i || p^_i) of every query (B, H, T), the plain form: p the teacher's causal rows,
    p^_i(j) = a_ij / sum_j' a_ij' (hybrid_weights). q (B, H, T, D), k centred keys."""
    T = q.size(2)
    near, far = window_masks(0, T, T, W, q.device, S)
    logits = q @ k.mT / math.sqrt(q.size(-1))
    logp = torch.log_softmax(logits.masked_fill(~(near | far), float("-inf")), -1)
    a, _ = hybrid_weights(logits, log_f, phi_q, phi_k, near, far)
    tiny = torch.finfo(a.dtype).tiny
    log_phat = a.clamp_min(tiny).log() - distill.log_row_sum(a.sum(-1, keepdim=True), tiny)
    return (logp.exp() * (logp - log_phat)).masked_fill(logp == float("-inf"), 0.0).sum(-1)


@torch.no_grad()
def softmax_loss_blockwise(q, k, pq, pk, log_f, W, block, grad_scale=None, S=0):
    """softmax_loss summed over each head's rows, `block` at a time -> (H,) float64 (q over sqrt d).
    The exact a_ij are constants; the features' are c_i pq_i.pk_j, c_i = e^(-m_i). grad_scale adds
        dKL/dpq_i = sum_j g_ij c_i pk_j,  dKL/dpk_j = sum_i g_ij c_i pq_i
    into pq.grad, pk.grad, g_ij = dKL/da_ij (distill.row_kl's) over the features' keys."""
    total = torch.zeros(q.size(1), dtype=torch.float64, device=q.device)
    for s, e, logits, _ in distill.causal_blocks(q, k, block):
        p = torch.log_softmax(logits, -1).exp_()  # teacher (B, H, b, e)
        near, far = window_masks(s, e, e, W, q.device, S)
        a, c = hybrid_weights(logits, log_f[:, :, s:e], pq[:, :, s:e], pk[:, :, :e], near, far)
        kl, g = distill.row_kl(p, a, grad_scale is not None)
        total += kl.double()
        if grad_scale is not None:
            g = g.masked_fill_(~far, 0.0).mul_(c * grad_scale)
            pq.grad[:, :, s:e] += g @ pk[:, :, :e]  # (B, H, b, M)
            pk.grad[:, :, :e] += g.mT @ pq[:, :, s:e]  # (B, H, e, M)
    return total


def layer_losses(cores, qk, kind, query_block=0, scale=None, stack=None):
    """distill.layer_losses with the hybrid's rows -> (L,) float64: each layer's mean softmax loss,
    with scale backpropagated into its features. The l2 loss, and W = 0, are the core's."""
    if kind == "l2" or all(c.window == 0 and c.sinks == 0 for c in cores):
        return core_layer_losses(cores, qk, kind, query_block, scale, stack)
    out = []
    grad = scale is not None
    for core, (q, k) in zip(cores, qk):
        with torch.autocast(q.device.type, enabled=False), torch.set_grad_enabled(grad):
            q, kc = core.inputs(q, k)  # (B, H, T, D) fp32, keys centred
            fq, fk = core.features(q, kc)
            log_f = query_log_factor(core.feature_map, q)
            pq, pk = fq.detach().requires_grad_(grad), fk.detach().requires_grad_(grad)
            if grad:
                pq.grad, pk.grad = torch.zeros_like(pq), torch.zeros_like(pk)
            B, H, T, D = q.shape
            row_scale = scale / (B * H * T) if grad else None
            sums = softmax_loss_blockwise(q * D ** -0.5, kc, pq, pk, log_f, core.window,
                                          query_block or 128, row_scale, core.sinks)  # (H,)
            if grad:
                torch.autograd.backward([fq, fk], [pq.grad, pk.grad])
        out.append(sums.sum() / (B * H * T))
    return torch.stack(out)


# The student and the flag

def make_student(cfg, teacher, calib, prev=None):
    """The core's student (fresh, --init-from or --resume), with --window and --sinks."""
    student, dims, layer_dof = core_make_student(cfg, teacher, calib, prev)
    return set_window(student, cfg.window, cfg.sinks), dims, layer_dof


def load_student(ckpt_dir, device="cpu", dtype=torch.float32, teacher=None):
    """The core's load_student, with the window and sinks its run was given (a core run's: 0)."""
    student, cfg = core_load_student(ckpt_dir, device, dtype, teacher)
    args = cfg.get("args", {})
    return set_window(student, args.get("window", 0), args.get("sinks", 0)), cfg


def band_fits(cfg):
    """The exact keys leave some for the features to train on in a --block-size window."""
    held = f"--window {cfg.window}" + (f" and --sinks {cfg.sinks} hold" if cfg.sinks else " holds")
    if cfg.window + cfg.sinks >= cfg.block_size:
        return (f"{held} every key of a --block-size {cfg.block_size} window, so the features "
                f"would never train; pass a --window below {cfg.block_size - cfg.sinks}")
    if cfg.sinks and not cfg.window:
        return "--sinks needs a window of at least one key; pass --window 1 or more"
    if cfg.window and not issubclass(model.FEATURE_MAPS[cfg.feature_map], model.PRF):
        return (f"--window needs features whose products estimate e^(q.k / sqrt d), as prf and "
                f"performer do, not {cfg.feature_map}; pass --feature-map prf or --window 0")
    return None


@dataclass
class WindowConfig(distill.DistillConfig):
    """distill.py with a window of exact softmax beside the features, and sinks."""
    window: int = door.opt(64, "exact softmax on each query's last W keys, the features on the "
                           "keys before them (0: the core's linear attention)", min=0)
    sinks: int = door.opt(0, "exact softmax on the first S tokens too (StreamingLLM's sinks)",
                          min=0, check=band_fits)
    RESUMED = distill.DistillConfig.RESUMED + ("window", "sinks")


REPLACE = {(model, "LinearAttention"): WindowAttention,
           (distill, "layer_losses"): layer_losses,
           (distill, "make_student"): make_student,
           (distill, "DistillConfig"): WindowConfig,
           (tasks, "load_student"): load_student,
           **streaming.REPLACE}  # evaluate --window W --sinks S: the untrained window beside

if __name__ == "__main__":
    forks.fork(__file__, REPLACE)
