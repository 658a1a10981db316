"""
The baseline a user would pick instead of a trained student: StreamingLLM's window (Xiao et al. 2023,
"Efficient Streaming Language Models with Attention Sinks"). The teacher, untouched and untrained,
attends by its own exact softmax to each query's first S tokens (the sinks) and last W keys only:

    y_i = sum_{j in E_i} softmax_j(q_i.k_j / sqrt d) v_j,   E_i = {j <= i: j > i - W or j < S}.

Decoding keeps the S sink keys and a ring buffer of the last W keys and values: S + W tokens of KV
cache a layer, whatever the context. experiments/window.py scores it beside the teacher when its
evaluate command is given --window (and --sinks) without a checkpoint:

    python experiments/window.py evaluate --model smollm2-135m --window 64 --sinks 4 \\
        --ppl data/wikitext2/val.bin --ppl-context 256
"""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F


def exact_keys(i, j, W, S):
    """Query positions i (n, 1) against key positions j (m,) -> (n, m): j <= i in the window or a sink."""
    return (j <= i) & ((j > i - W) | (j < S))


class SinkWindowAttention(nn.Module):
    """The teacher's core restricted to the sinks and the window: q (B, H, T, D), k, v (B, Hkv, T, D)
    -> y (B, H, T, D). Decoding: cache["sk"], cache["sv"] (B, Hkv, <= S, D) the sinks,
    cache["k"], cache["v"] (B, Hkv, W, D) the ring (token n in slot n % W), cache["n"] the tokens."""

    def __init__(self, window, sinks):
        super().__init__()
        self.window, self.sinks = window, sinks

    def forward(self, q, k, v, cache=None):
        if cache is None:
            return self.attend(q, k, v, torch.arange(q.size(2), device=q.device))
        if not cache:
            return self.prefill(q, k, v, cache)
        ys = [self.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache)
              for t in range(q.size(2))]
        return torch.cat(ys, 2)

    def attend(self, q, k, v, pos):
        """Queries at positions pos (T,) against keys 0..n-1, masked to each query's exact keys."""
        j = torch.arange(k.size(2), device=q.device)
        mask = exact_keys(pos[:, None], j, self.window, self.sinks)  # (T, n)
        gqa = k.size(1) != q.size(1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    def prefill(self, q, k, v, cache):
        """The first tokens, then the cache of their sinks and last W tokens."""
        y = self.forward(q, k, v)
        B, Hkv, T, D = k.shape
        pos = torch.arange(max(0, T - self.window), T, device=k.device)
        for name, x in (("k", k), ("v", v)):
            cache[name] = x.new_zeros(B, Hkv, self.window, D)
            cache[name][:, :, pos % self.window] = x[:, :, pos]
            cache["s" + name] = x[:, :, :self.sinks]
        cache["n"] = T
        return y

    def step(self, q, k, v, cache):
        """One token (B, H or Hkv, 1, D): into its slot (and the sinks, while there are fewer than S),
        then attention over the sinks before the window and the window."""
        n, W, S = cache["n"], self.window, self.sinks
        cache["k"][:, :, n % W] = k[:, :, 0]
        cache["v"][:, :, n % W] = v[:, :, 0]
        if n < S:
            cache["sk"] = torch.cat((cache["sk"], k), 2)
            cache["sv"] = torch.cat((cache["sv"], v), 2)
        cache["n"] = n + 1
        sinks, kept = max(0, min(S, n + 1 - W)), min(n + 1, W)
        keys = torch.cat((cache["sk"][:, :, :sinks], cache["k"][:, :, :kept]), 2)
        values = torch.cat((cache["sv"][:, :, :sinks], cache["v"][:, :, :kept]), 2)
        gqa = k.size(1) != q.size(1)
        return F.scaled_dot_product_attention(q, keys, values, enable_gqa=gqa)


def sink_window(teacher, window, sinks):
    """The teacher with every core a SinkWindowAttention: its weights shared, nothing trained."""
    shared = {id(t): t for t in (*teacher.parameters(), *teacher.buffers())}
    baseline = copy.deepcopy(teacher, shared)
    for block in baseline.h:
        block.attn.core = SinkWindowAttention(window, sinks)
    return baseline


def cache_bytes(config, window, sinks, dtype=torch.float32):
    """Bytes of the decoding cache of one sequence: keys and values of S + W tokens a layer."""
    per_token = 2 * config.n_kv_head * config.head_dim * torch.finfo(dtype).bits // 8
    return config.n_layer * (window + sinks) * per_token
