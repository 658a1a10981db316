"""
The baseline a user would pick instead of a trained student: StreamingLLM's window (Xiao et al.
2023, "Efficient Streaming Language Models with Attention Sinks"). The teacher, untrained,
attends by its own exact softmax to each query's first S tokens (the sinks) and last W keys only:

    y_i = sum_{j in E_i} softmax_j(q_i.k_j / sqrt d) v_j,   E_i = {j <= i: j > i - W or j < S}.

Decoding keeps the S sink keys and a ring buffer of the last W keys and values: S + W tokens of KV
cache a layer, whatever the context. This fork's evaluate command (and experiments/window.py's)
scores it beside the teacher, and beside a --ckpt's student if given, on every evaluate.py flag:

    python experiments/streaming.py evaluate --model smollm2-135m --window 64 --sinks 4 \\
        --ppl data/wikitext2/val.bin --ppl-context 256

How it forks the core: REPLACE sets evaluate.EvalConfig to one with --window and --sinks, and
tasks.load_models to the core's with the untrained window added as the model "window".
"""

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import door  # noqa: E402
import evaluate  # noqa: E402
import forks  # noqa: E402
import tasks  # noqa: E402

core_load_models = tasks.load_models


def exact_keys(i, j, W, S):
    """Query positions i (n, 1) against key positions j (m,) -> (n, m): j <= i in the window or a
    sink."""
    return (j <= i) & ((j > i - W) | (j < S))


class SinkWindowAttention(nn.Module):
    """The teacher's core restricted to the sinks and the window: q (B, H, T, D), k, v
    (B, Hkv, T, D) -> y (B, H, T, D). Decoding: cache["sk"], cache["sv"] (B, Hkv, <= S, D) the
    sinks, cache["k"], cache["v"] (B, Hkv, W, D) the ring (token n in slot n % W), cache["n"]."""

    def __init__(self, W, S):
        super().__init__()
        self.window, self.sinks = W, S

    def forward(self, q, k, v, cache=None):
        if cache is None:
            return self.attend(q, k, v, torch.arange(q.size(2), device=q.device))
        if not cache:
            return self.prefill(q, k, v, cache)
        ys = [self.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache)
              for t in range(q.size(2))]
        return torch.cat(ys, 2)

    def attend(self, q, k, v, pos, block=128):
        """Queries at positions pos (T,) against keys 0..n-1, masked to each query's exact keys: a
        block of queries at a time over the sinks before its first window and the keys from there
        (O(T (block + W + S)) work, not O(T^2))."""
        gqa = k.size(1) != q.size(1)
        ys = []
        for s in range(0, q.size(2), block):
            e = min(q.size(2), s + block)
            lo = max(0, int(pos[s]) - self.window + 1)
            hi = int(pos[e - 1]) + 1
            j = torch.cat((torch.arange(min(self.sinks, lo)), torch.arange(lo, hi))).to(q.device)
            mask = exact_keys(pos[s:e, None], j, self.window, self.sinks)  # (b, n)
            ys.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, j], v[:, :, j],
                                                     attn_mask=mask, enable_gqa=gqa))
        return torch.cat(ys, 2)

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
        """One token (B, H or Hkv, 1, D): into its slot (and the sinks, while fewer than S), then
        attention over the sinks before the window and the window."""
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


def sink_window(teacher, W, S):
    """The teacher with every core a SinkWindowAttention: its weights shared, nothing trained."""
    shared = {id(t): t for t in (*teacher.parameters(), *teacher.buffers())}
    baseline = copy.deepcopy(teacher, shared)
    for block in baseline.h:
        block.attn.core = SinkWindowAttention(W, S)
    return baseline


def cache_bytes(config, W, S, dtype=torch.float32):
    """Bytes of the decoding cache of one sequence: keys and values of S + W tokens a layer."""
    per_token = 2 * config.n_kv_head * config.head_dim * torch.finfo(dtype).bits // 8
    return config.n_layer * (W + S) * per_token


@dataclass
class StreamingEvalConfig(evaluate.EvalConfig):
    """evaluate.py with the teacher's untrained window of exact softmax beside it."""
    window: int = door.opt(0, "also score the teacher restricted to each query's last W keys and "
                           "--sinks first tokens, untrained (StreamingLLM; 0: not)", min=0)
    sinks: int = door.opt(0, "sink tokens of the untrained window", min=0, needs="window")


def load_models(cfg, device):
    """The core's models, and with --window the untrained window "window" on the teacher."""
    models = core_load_models(cfg, device)
    if cfg.window:
        W, S, teacher = cfg.window, cfg.sinks, models["teacher"]
        models["window"] = sink_window(teacher, W, S)
        kib = cache_bytes(teacher.config, W, S, getattr(torch, cfg.dtype)) / 1024
        print(f"window: the teacher's exact softmax on the first {S} and last {W} keys of each "
              f"query, untrained; its decoding cache holds {S + W} tokens a layer, {kib:,.0f} KiB "
              f"a sequence")
    core = models["student"].cores()[0] if "student" in models else None
    band = getattr(core, "window", 0) + getattr(core, "sinks", 0)
    T = cfg.ppl_context or models["teacher"].config.block_size
    if cfg.ppl and band >= T:
        print(f"note: the student's {band} exact keys (window and sinks) hold every key of a "
              f"--ppl-context {T} window: its perplexity is its teacher's")
    return models


REPLACE = {(evaluate, "EvalConfig"): StreamingEvalConfig,
           (tasks, "load_models"): load_models}

if __name__ == "__main__":
    forks.fork(__file__, REPLACE)
