"""
Beyond the paper: decoding one token as one CUDA graph replay. A decoded token at batch 1 is hundreds of tiny
kernels, so its time is the launches', not the arithmetic's (docs/results.md); a graph launches them all at once.
Used by bench/gpu_check.py's decode rows:

    decoder = GraphedDecoder(gpt, cache, tok)      # after a prefill through model.Cache, as model.generate does
    logits = decoder(tok)                          # (B, 1) -> (B, 1, V), the cache advanced by one token
    GraphedDecoder(gpt, cache, tok, compile=True)     # the step torch.compile'd first: fewer, fused kernels

How it forks the core: a graph replays fixed addresses, so the cache's position becomes a device tensor (GPT.hidden
adds it to its positions), the linear state (S, s) is copied back into the buffers the graph reads, and softmax
cores become StaticKV, a KV cache of fixed capacity (as gpt-fast's) in place of model.py's growing one.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import door  # noqa: E402
from model import SoftmaxAttention  # noqa: E402


class StaticKV(SoftmaxAttention):
    """Softmax attention over a KV cache of fixed capacity: token i of the step is written to slot pos + i and sees
    the slots j <= pos + i, pos the cache's position (a tensor), so every step has the same shapes and addresses.
    cuDNN's SDPA first: its plan, built per shape (model.py's cache skips it), is built once here, and it reads a
    long cache fastest (docs/results.md); flash attention takes no mask."""
    backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]   # in this order

    def forward(self, q, k, v, cache=None):
        if cache is None or "pos" not in cache:                    # the prefill, or no graph: model.py's
            return super().forward(q, k, v, cache)
        at = cache["pos"] + torch.arange(k.size(2), device=k.device)                      # (T,) slots written
        cache["k"].index_copy_(2, at, k)
        cache["v"].index_copy_(2, at, v)
        mask = torch.arange(cache["k"].size(2), device=k.device) <= at[:, None]           # (T, capacity)
        with sdpa_kernel(self.backends, set_priority=True):
            return F.scaled_dot_product_attention(q, cache["k"], cache["v"], attn_mask=mask,
                                                  enable_gqa=k.size(1) != q.size(1))


class GraphedDecoder:
    """gpt(tok, cache) for one token (B, 1), captured once as a CUDA graph and replayed per call; without CUDA
    (graph=False) the same step runs eagerly. `steps` more tokens must fit the KV caches' new capacity. compile: the
    step is torch.compile'd (inductor fuses the feature maps' and the state update's elementwise ops), with the
    capacity a dynamic size, so one compile serves every context length."""
    def __init__(self, gpt, cache, tok, steps=4096, graph=True, compile=False):
        if gpt.config.family == "gpt2":
            raise door.ModelError("GPT-2's learned positions are checked on the host at every step, which a graph cannot "
                             "replay; decode GPT-2 with model.generate")
        self.cache, self.tok, n = cache, tok.clone(), cache.pos
        capacity = -(-(n + steps) // 64) * 64                      # n + steps, rounded up to a multiple of 64
        for block, layer in zip(gpt.h, cache):
            if isinstance(block.attn.core, SoftmaxAttention):      # the growing cache copied into a fixed one
                block.attn.core, _ = StaticKV(), layer.pop("n")
                for name in ("k", "v"):
                    kept = layer[name]
                    layer[name] = kept.new_zeros(*kept.shape[:2], capacity, kept.size(3))
                    layer[name][:, :, :n] = kept[:, :, :n]
                    if compile:
                        torch._dynamo.mark_dynamic(layer[name], 2)
        cache.pos = torch.tensor(n, device=tok.device)
        for layer in cache:
            layer["pos"] = cache.pos
        self.buffers = [dict(layer) for layer in cache]            # what the graph reads: fixed from here on
        self.forward = torch.compile(gpt, fullgraph=True) if compile else gpt
        self.graph = None
        if graph:
            self.graph, self.logits = self.capture()

    @torch.no_grad()
    def step(self):
        """One token through the model; the state it returns copied into the buffers the next step reads."""
        logits = self.forward(self.tok, cache=self.cache)
        for layer, buffers in zip(self.cache, self.buffers):
            for name, x in buffers.items():
                if layer[name] is not x:                           # the linear state, returned anew
                    x.copy_(layer[name])
                    layer[name] = x
        return logits

    def capture(self):
        """Warm-up steps on a side stream (as torch.cuda.graphs asks), undone, then one step captured."""
        saved = [{name: x.clone() for name, x in layer.items()} for layer in self.buffers]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        for layer, kept in zip(self.buffers, saved):
            for name, x in layer.items():
                x.copy_(kept[name])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self.step()
        return graph, logits

    def __call__(self, tok):
        self.tok.copy_(tok)
        if self.graph is None:
            return self.step()
        self.graph.replay()
        return self.logits
