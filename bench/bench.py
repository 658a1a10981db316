"""Speed and memory of causal linear attention against softmax attention, side by side in one run.

    python bench/bench.py              # T = 1024, 4096, 16384; B = 1, H = 12, M = D = 64; chunk sweep 32..256
    python bench/bench.py --T 1024 4096 --chunks 64 --repeats 5
    python bench/bench.py --T --decode-steps 32                      # the decoding table alone
    python bench/bench.py --T --decode-compile                       # ... and with the step torch.compile'd
    python bench/bench.py --T --decode-batch 16 --decode-ctx 2048      # 16 sequences decoded at once
    python bench/bench.py --T --decode-ctx --heads docs/results/heads/b32-dof-head-s0.json   # per-head dims
    python bench/bench.py --T --decode-ctx --step softmax l2 direct     # aten ops and ms of a step per loss

Linear: the PRF feature map of queries and keys plus the chunked causal scan, forward only (torch.no_grad).
Softmax: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True) on the same inputs.
Every (method, T, chunk size) runs in a fresh subprocess, so its peak memory is its own:
  ms        median wall time of --repeats calls, after one warm-up call.
  peak MiB  the rise of the process's peak resident set size (VmHWM, reset through /proc/self/clear_refs once the
            inputs exist) during the warm-up call: output, intermediates and any allocator slack the call touched;
            not the inputs, not the Python/torch runtime. (ru_maxrss is used where clear_refs is unavailable; on a
            GPU, the rise of torch's peak allocated memory.)
  GFLOP/s   counted operations / time. Linear counts what it executes: the feature matmuls, per-chunk states,
            inter-chunk products and the full C x C intra-chunk blocks (their masked half included). Softmax is
            credited with the causal work 2 T^2 D H (the lower half of QK^T and of PV), whatever its kernel runs.
  matmul    the machine's dense fp32 rate: best of 5 timings of a 4096 x 4096 by 4096 x 4096 matmul.
The tables are markdown; the lines under the first say whether linear is no slower than SDPA at T = 4096 and at
least 6x faster at T = 16384, and whether its peak memory grows linearly in T. The decoding table times one token
of a Pythia-160M-shape model with random weights (a token for each of --decode-batch sequences): softmax with a KV
cache against the linear state (with --decode-compile, each also through bench/graphed_decode.py with its step
torch.compile'd: one CUDA graph a token on a GPU, the compiled step run eagerly on the CPU).
The per-head table (--heads) times every layer's student core at SmolLM2-135M's shape (9 query heads, 3 key heads,
D = 64) on random inputs, with the run's per-head DoF turned into dims two ways at the same total: per layer
(M_l from each layer's largest head DoF, shared by its heads) and per head (M_lh from each head's DoF). Per step:
distill.layer_losses with its backward (softmax loss, as a distillation step pays on top of the teacher's forward),
and the forward scan; the two layouts alternate, the median of --repeats rounds is reported. A last line times one
head's three loss products per query block against M. The step table (--step) counts the aten ops of one
distill.py training step (distill.train_step) at the GPT-2-124M shape, random weights, budget 64 in every layer,
1024 tokens, as they reach the dispatcher (one kernel launch each on a GPU), and times it (median of --repeats).
"""
import collections
import contextlib
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "experiments")]   # the core, and its forks (per_head)
import devices  # noqa: E402
import door  # noqa: E402
import files  # noqa: E402
import forks  # noqa: E402
from graphed_decode import GraphedDecoder  # noqa: E402
from model import GPT, PRF, Cache, GPTConfig, causal_linear_attention  # noqa: E402


@dataclass
class BenchConfig(door.Config):
    T: list[int] = door.opt([1024, 4096, 16384], "sequence lengths of the scan table; none to skip it")
    B: int = door.opt(1, "batch size", min=1)
    H: int = door.opt(12, "number of heads", min=1)
    D: int = door.opt(64, "head size (queries, keys and values)", min=1)
    M: int = door.opt(64, "number of features of the linear attention", min=1)
    chunk: int = door.opt(64, "chunk size of the scan in the main table", min=1)
    chunks: list[int] = door.opt([32, 64, 128, 256], "chunk sizes of the tuning sweep (second table); none to skip it")
    repeats: int = door.opt(3, "timed calls per measurement (the median is reported)", min=1)
    threads: int = door.opt(min(torch.get_num_threads(), os.cpu_count() or 1), "torch intra-op threads", min=1)
    device: str = door.opt("cpu", "torch device: cpu, cuda, cuda:1, ... or auto (cuda if there is one)")
    decode_ctx: list[int] = door.opt([256, 512, 1024, 2048], "context lengths for the decoding table (Pythia-160M shape, "
                                "random weights); none to skip it")
    decode_steps: int = door.opt(32, "tokens decoded per context length (mean ms reported)", min=1)
    decode_batch: int = door.opt(1, "sequences decoded at once in the decoding table (its KV cache grows with them)", min=1)
    decode_compile: bool = door.opt(False, "also time each decoder with its step torch.compile'd (bench/"
                               "graphed_decode.py: one CUDA graph a token on a GPU, eager on the CPU)")
    heads: str = door.opt("", "an experiments/per_head.py run's JSON (its per-head DoF, docs/results/heads/*.json): "
                     "time per-head against per-layer dims at the same total; empty to skip")
    heads_T: list[int] = door.opt([256, 1024], "tokens per sequence of the per-head table (distill.py's --block-size)")
    query_block: int = door.opt(128, "queries per block of the per-head table's loss (distill.py's --query-block)", min=1)
    step: list[str] = door.opt([], "losses whose distill.py step to count and time (softmax, l2, direct); none to skip")
    step_tokens: int = door.opt(1024, "tokens of the step table's batch (one sequence)", min=1)
    worker: list[str] | None = door.opt(None, "internal: METHOD T CHUNK measures one case ('linear' or 'sdpa') in this "
                                   "process and prints it as JSON")

    def __post_init__(self):
        super().__post_init__()
        if self.threads > (cpus := os.cpu_count() or 1):           # libgomp crashes creating that many
            raise door.ModelError(f"--threads {self.threads} is more than the {cpus} CPUs of this machine; pass at most "
                             f"{cpus}")
        if self.step_tokens > (n := GPTConfig().block_size):        # step_row's GPT-2 shape: learned positions
            raise door.ModelError(f"--step-tokens {self.step_tokens} is more than the {n} positions of the step table's "
                             f"GPT-2 shape; pass at most {n}")
        if bad := sorted(set(self.step) - {"softmax", "l2", "direct"}):
            raise door.ModelError(f"--step {' '.join(bad)}: the losses are softmax, l2 and direct")
        for name in ("T", "chunks", "decode_ctx", "heads_T"):
            if any(v < 1 for v in getattr(self, name)):
                raise door.ModelError(f"--{name.replace('_', '-')} must list numbers of at least 1, got "
                                 f"{getattr(self, name)}")


# ----------------------------------------------------------------------------------------------------------------
# One measurement, in a fresh process

def rss_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_meter(device):
    """-> read(): KiB the process's peak memory rose since this call (see the module docstring)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        return lambda: (torch.cuda.max_memory_allocated(device) - base) / 1024
    try:  # reset the high-water mark to the current resident size
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = rss_kib("VmRSS")
        return lambda: rss_kib("VmHWM") - base
    except OSError:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base


def worker(cfg):
    """One measurement: prints {"ms", "peak_mib", "flops"} as JSON."""
    if len(cfg.worker) != 3:
        raise door.ModelError("--worker takes three values: METHOD ('linear' or 'sdpa'), T and CHUNK")
    method, T, C = cfg.worker[0], int(cfg.worker[1]), int(cfg.worker[2])
    device, _ = devices.pick_device(cfg.device, "float32")
    torch.manual_seed(0)
    B, H, D, M = cfg.B, cfg.H, cfg.D, cfg.M
    q, k, v = torch.randn(3, B, H, T, D, device=device).unbind(0)
    if method == "linear":
        fm = PRF(H, D, M).to(device)
        N = -(-T // C) * C  # padded length
        flops = B * H * (2 * 2 * T * D * M + 2 * 2 * N * M * (D + 1) + 2 * N * C * M + 2 * N * C * (D + 1))
        run = lambda: causal_linear_attention(fm(q, True), fm(k, False), v, chunk_size=C)
    else:
        flops = B * H * 2 * T * T * D
        run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with torch.no_grad():
        read_peak = peak_meter(device)
        y = run()
        devices.sync(device)
        peak = read_peak()
        del y
        times = []
        for _ in range(cfg.repeats):
            t0 = time.perf_counter()
            run()
            devices.sync(device)
            times.append(time.perf_counter() - t0)
    print(json.dumps({"ms": 1e3 * statistics.median(times), "peak_mib": peak / 1024, "flops": flops}))


def measure(cfg, method, T, chunk):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", method, str(T), str(chunk)]
    for name in ("B", "H", "D", "M", "repeats", "threads", "device"):
        cmd += [f"--{name}", str(getattr(cfg, name))]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:                                   # its last line says why (e.g. out of memory)
        why = (out.stderr.strip().splitlines() or ["no message"])[-1][:200]
        raise door.ModelError(f"the {method} measurement at T={T} failed ({why}); lower --B, --T, --H, --D or --M")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------------------------
# The tables

def matmul_gflops(device, n=4096):
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b
    best = float("inf")
    for _ in range(5):
        devices.sync(device)
        t0 = time.perf_counter()
        a @ b
        devices.sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def scan_table(cfg, device):
    """Linear attention against SDPA over cfg.T (first table) and the chunk-size sweep (second table)."""
    load0, mm = os.getloadavg()[0], matmul_gflops(device)
    print(f"# causal attention, B={cfg.B} H={cfg.H} D={cfg.D} M={cfg.M}, fp32, forward only, on {device}, "
          f"{cfg.threads} threads, torch {torch.__version__}; 1-min load average {load0:.1f} at start")
    print(f"machine: {os.cpu_count()} CPUs, dense fp32 matmul {mm:.0f} GFLOP/s\n")
    rows, sweep = [], {}
    for T in cfg.T:
        s, lin = measure(cfg, "sdpa", T, 0), measure(cfg, "linear", T, cfg.chunk)
        rows.append((T, lin, s))
        for C in cfg.chunks:
            sweep[T, C] = lin if C == cfg.chunk else measure(cfg, "linear", T, C)
        print(f"  T={T}: linear {lin['ms']:.1f} ms, sdpa {s['ms']:.1f} ms", file=sys.stderr)
    print(f"| T | linear ms (C={cfg.chunk}) | SDPA ms | speed-up | linear peak MiB | SDPA peak MiB "
          f"| linear KiB/token | linear GFLOP/s | SDPA GFLOP/s | matmul GFLOP/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for T, lin, s in rows:
        print(f"| {T} | {lin['ms']:.1f} | {s['ms']:.1f} | {s['ms'] / lin['ms']:.1f}x | {lin['peak_mib']:.1f} "
              f"| {s['peak_mib']:.1f} | {1024 * lin['peak_mib'] / T:.1f} | {lin['flops'] / lin['ms'] / 1e6:.1f} "
              f"| {s['flops'] / s['ms'] / 1e6:.1f} | {mm:.0f} |")
    if cfg.chunks:
        print("\nchunk-size sweep, linear ms (peak MiB):\n")
        print("| T | " + " | ".join(f"C={C}" for C in cfg.chunks) + " |")
        print("|---:|" + "---:|" * len(cfg.chunks))
        for T in cfg.T:
            print(f"| {T} | " + " | ".join(f"{sweep[T, C]['ms']:.1f} ({sweep[T, C]['peak_mib']:.0f})"
                                          for C in cfg.chunks) + " |")
    print(f"\n1-min load average at end {os.getloadavg()[0]:.1f} (timings are only comparable on an idle machine)")
    speed_and_memory_lines(rows)


def speed_and_memory_lines(rows):
    speed = {T: s["ms"] / lin["ms"] for T, lin, s in rows}
    for T, least, claim in ((4096, 1, "no slower than"), (16384, 6, "at least 6x faster than")):
        if T in speed:
            print(f"T={T}: linear {claim} SDPA: {'yes' if speed[T] >= least else 'NO'} ({speed[T]:.1f}x)")
    if len(rows) > 1:
        per_token = [lin["peak_mib"] / T for T, lin, _ in rows]
        print(f"linear peak memory per token from T={rows[0][0]} to T={rows[-1][0]}: "
              + " -> ".join(f"{1024 * x:.1f} KiB" for x in per_token)
              + (" (at most linear in T)" if per_token[-1] <= 1.25 * min(per_token) else " (NOT linear in T)"))


def prefilled(gpt, ctx, device, batch=1):
    """A decoding Cache after a prefill of batch x ctx random tokens and one decoded token a sequence (the warm-up),
    and those tokens (batch, 1)."""
    cache = Cache(gpt.config.n_layer)
    idx = torch.randint(0, gpt.config.vocab_size, (batch, ctx), device=device)
    gpt.hidden(idx, cache)                                           # prefill, without the (ctx, V) logits
    tok = idx[:, -1:]
    gpt(tok, cache=cache)                                            # warm-up step
    return cache, tok


def mean_ms(fn, calls, device):
    """Mean wall ms of `calls` calls of fn, the device synchronised before the first and after the last."""
    devices.sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    devices.sync(device)
    return 1e3 * (time.perf_counter() - t0) / calls


@torch.no_grad()
def decode_ms(gpt, ctx, steps, device, batch=1):
    """Mean ms per decoding step (a token for each of `batch` sequences) after a prefill of ctx tokens, through the
    decoding Cache: a KV cache for softmax attention, the fixed (M x D) state for linear attention."""
    cache, tok = prefilled(gpt, ctx, device, batch)
    return mean_ms(lambda: gpt(tok, cache=cache), steps, device)


@torch.no_grad()
def graphed_ms(gpt, ctx, steps, device, compile=False, check=4, batch=1):
    """Mean ms per step of GraphedDecoder (its step torch.compile'd if `compile`) after a prefill of batch x ctx tokens
    (as decode_ms), and the largest difference of its first `check` logits from model.Cache's for the same tokens,
    over the largest logit."""
    cache, tok = prefilled(gpt, ctx, device, batch)
    ref = copy.deepcopy(cache)
    want = torch.cat([gpt(tok, cache=ref).float() for _ in range(check)])
    decoder = GraphedDecoder(gpt, cache, tok, steps=check + steps, graph=device.startswith("cuda"), compile=compile)
    got = torch.cat([decoder(tok).float() for _ in range(check)])
    err = ((got - want).abs().max() / want.abs().max()).item()
    return mean_ms(lambda: decoder(tok), steps, device), err


@torch.no_grad()
def decode_ops(gpt, device):
    """Aten ops of one decoded token after a prefill of 8 tokens and one decoded token (about one kernel launch
    each on a GPU)."""
    cache, tok = prefilled(gpt, 8, device)
    with OpCount() as count:
        gpt(tok, cache=cache)
    return sum(count.ops.values())


def decode_table(cfg, device):
    """Per-token decode time of a Pythia-160M-shape model, softmax (KV cache) against linearised (M = cfg.M state)."""
    torch.manual_seed(0)
    mc = GPTConfig(family="neox", vocab_size=50304, n_layer=12, n_head=12, n_kv_head=12, n_embd=768, head_dim=64,
                   block_size=2048, rotary_dim=16, parallel_residual=True, tie_embeddings=False, mlp_hidden=3072)
    with torch.device("meta"):
        weights = sum(p.numel() for p in GPT(mc).parameters())
    ctx, L, H, D, M, B = max(cfg.decode_ctx), mc.n_layer, mc.n_head, mc.head_dim, cfg.M, cfg.decode_batch
    # rough fp32 count: both models, the feature maps and states, the longest prefill's KV caches (a second one for
    # the compiled step), activations, features and mask
    kv = 2 * L * H * D * (1 + cfg.decode_compile)
    devices.check_free_memory(4 * (2 * weights + 2 * L * H * M * D * B + B * ctx * (kv + 4 * mc.mlp_hidden + 4 * H * M + ctx)),
                      device, f"the decoding table at --M {M}, --decode-ctx {ctx} and --decode-batch {B}",
                      "lower --M, --decode-ctx or --decode-batch")
    softmax = GPT(mc).eval()
    linear = GPT(mc).eval()
    linear.load_state_dict(softmax.state_dict())
    linear = linear.linearize([cfg.M] * mc.n_layer)
    softmax, linear = softmax.to(device), linear.to(device)
    print(f"\ndecoding, Pythia-160M shape (random weights), batch {B}, on {device}, ms per step (a token for each "
          f"sequence; mean of {cfg.decode_steps}); aten ops per step: {decode_ops(softmax, device):,} through the KV "
          f"cache, {decode_ops(linear, device):,} through the linear state:\n")
    heads = ["softmax + KV cache", f"linear (M={cfg.M} state)"]
    how = "one compiled graph a token" if device.startswith("cuda") else "step compiled"
    heads += [f"{h}, {how}" for h in heads] if cfg.decode_compile else []
    print(f"| context | {' | '.join(heads)} |\n|---:|{'---:|' * len(heads)}")
    res, errs = [], []
    for ctx in cfg.decode_ctx:
        res.append((ctx, decode_ms(softmax, ctx, cfg.decode_steps, device, B),
                    decode_ms(linear, ctx, cfg.decode_steps, device, B)))
        for gpt in (softmax, linear) if cfg.decode_compile else ():       # the first row compiles, untimed
            ms, err = graphed_ms(gpt, ctx, cfg.decode_steps, device, compile=True, batch=B)
            res[-1], errs = res[-1] + (ms,), errs + [err]
        print(f"| {ctx} | {' | '.join(f'{ms:.1f}' for ms in res[-1][1:])} |")
    lin = [r[2] for r in res]
    print(f"linear decode from {res[0][0]} to {res[-1][0]} tokens: {lin[-1] / lin[0]:.2f}x "
          f"({'flat, within 20%' if max(lin) <= 1.2 * min(lin) else 'NOT flat'}); "
          f"softmax: {res[-1][1] / res[0][1]:.2f}x")
    if errs:
        print(f"compiled decoding's logits differ from the eager step's by at most {max(errs):.1e} of the largest")


def read_heads(path):
    """--heads' JSON -> (its per-head DoF (L, H), its budget), checked before any table is measured."""
    run = files.read_json(path, "pass the JSON of an experiments/per_head.py run (docs/results/heads/*.json)")
    try:
        N = torch.tensor(run["args"].get("dof") or [], dtype=torch.float64)           # (L, H) per-head DoF
        budget = run["args"]["budget"]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise door.ModelError(f"{path} lacks a per-head DoF table or its budget ({type(e).__name__}); pass the JSON "
                         "of an experiments/per_head.py run") from None
    if N.ndim != 2 or N.numel() == 0 or not (N.isfinite() & (N >= 0)).all() or type(budget) is not int or budget < 1:
        raise door.ModelError(f"{path} holds no per-head table of finite DoF of at least 0 (one row a layer) and whole "
                         "budget of at least 1; pass the JSON of an experiments/per_head.py run")
    return N, budget


def heads_table(cfg, device, N, budget):
    """Per-head against per-layer dims at the same total features: distillation loss + backward, and the scan."""
    import distill
    import dof
    import per_head
    from model import LinearAttention
    L, H = N.shape
    Hkv, D = 3 if H % 3 == 0 else H, 64                   # SmolLM2's 3 key/value heads (none shared otherwise)
    dims = {"per layer": dof.allocate(N.amax(-1), budget),
            "per head": torch.tensor(dof.allocate(N.flatten(), budget)).view(L, H).tolist()}
    T, M = max(cfg.heads_T), max(dims["per layer"] + [m for row in dims["per head"] for m in row])
    # rough fp32 count: both layouts' feature maps, every layer's q, k, v, one layer's features, scores and gradients
    devices.check_free_memory(4 * (D * (H * sum(dims["per layer"]) + sum(map(sum, dims["per head"])))
                           + cfg.B * T * (L * (H + 2 * Hkv) * D + 8 * H * (cfg.query_block + M))), device,
                      f"the per-head table at --B {cfg.B} and --heads-T {T} (budget {budget})",
                      "lower --B or --heads-T")
    torch.manual_seed(0)
    cores = {"per layer": [LinearAttention(H, Hkv, D, m).to(device) for m in dims["per layer"]],
             "per head": [per_head.GroupedLinearAttention(H, Hkv, D, m).to(device) for m in dims["per head"]]}
    loss = {"per layer": distill.layer_losses, "per head": per_head.layer_losses}
    print(f"\nper-head against per-layer dims, {L} layers x {H} heads (SmolLM2-135M shape), B={cfg.B}, budget "
          f"{budget} from {cfg.heads}, query block {cfg.query_block}, on {device}, {cfg.threads} threads; ms for all "
          f"layers, median of {cfg.repeats} rounds:\n")
    print("| T | dims | features summed over heads | groups per layer (mean) | loss + backward ms | forward scan ms |")
    print("|---:|---|---:|---:|---:|---:|")
    for T in cfg.heads_T:
        q, k, v = (torch.randn(L, cfg.B, h, T, D, device=device) for h in (H, Hkv, Hkv))

        def step(name, train):
            devices.sync(device)
            t0 = time.perf_counter()
            for l, core in enumerate(cores[name]):
                if train:
                    loss[name]([core], [(q[l], k[l])], "softmax", cfg.query_block, scale=1.0)
                else:
                    with torch.no_grad():
                        core(q[l], k[l], v[l])
            devices.sync(device)
            return 1e3 * (time.perf_counter() - t0)

        times = {(name, train): [] for name in cores for train in (True, False)}
        for _ in range(cfg.repeats + 1):                                           # the first round warms up
            for key in times:
                times[key].append(step(*key))
        ms = {}
        for name in cores:
            total = sum(sum(c.dims) if name == "per head" else c.M * H for c in cores[name])
            groups = sum(len(c.groups) if name == "per head" else 1 for c in cores[name]) / L
            ms[name] = [statistics.median(times[name, train][1:]) for train in (True, False)]
            print(f"| {T} | {name} | {total} | {groups:.1f} | {ms[name][0]:.0f} | {ms[name][1]:.0f} |")
        r = [ms["per head"][i] / ms["per layer"][i] for i in (0, 1)]
        print(f"| {T} | per head / per layer | | | {r[0]:.2f}x | {r[1]:.2f}x |")
    products_line(cfg, device)


def products_line(cfg, device):
    """One head's three products in a block of the loss (scores, and the gradient into each feature side) against
    M, at the last of cfg.heads_T: how much a head's cost falls with its feature count."""
    T, b, row = cfg.heads_T[-1], cfg.query_block, []
    for m in (3, 8, 16, 64, 256):
        pq, pk, g = (torch.rand(cfg.B, 1, n, w, device=device) for n, w in ((b, m), (T, m), (b, T)))
        prod = lambda: (pq @ pk.mT, g @ pk, g.mT @ pq)
        prod()
        row.append(f"M={m}: {mean_ms(prod, 10, device):.2f} ms")
    print(f"\none head's loss products per block of {b} queries (B={cfg.B}, T={T}): " + ", ".join(row))


class OpCount(TorchDispatchMode):
    """Counts the aten ops that reach the dispatcher, forward and backward: about one kernel launch each on a GPU."""
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def step_row(distill_module, loss, T=1024, budget=64, repeats=3, device="cpu", config=None, per_head_fork=None,
             stack="auto"):
    """One distill.train_step of `loss` at the GPT-2-124M shape (or `config`; random weights, `budget` features in
    every layer, one sequence of T tokens) -> {"ops": aten ops of the step, "top": the commonest, "ms": median of
    `repeats`}, after a warm-up step. Only the API of distill.py is used, so another version of it can be measured
    alike. per_head_fork: experiments/per_head.py, whose names (its grouped cores and their losses) are set for the
    measurement and whose cores get dims budget/2 and 3 budget/2 on alternate heads; stack: distill.py's --stack
    (yes: the layout a GPU runs, no: a CPU's), where that version has it."""
    with forks.replaced(per_head_fork.REPLACE) if per_head_fork else contextlib.nullcontext():
        return measure_step(distill_module, loss, T, budget, repeats, device, config, per_head_fork is not None,
                            stack)


def measure_step(distill_module, loss, T, budget, repeats, device, config, per_head_dims, stack):
    """step_row's measurement, the fork's names (if any) already set."""
    # the model.py beside that distill.py (older versions import GPT from it)
    mod = distill_module.model if hasattr(distill_module, "model") else sys.modules[distill_module.GPT.__module__]
    torch.manual_seed(0)
    teacher = mod.GPT(config or mod.GPTConfig()).to(device).eval().requires_grad_(False)
    L, H = teacher.config.n_layer, teacher.config.n_head
    if per_head_dims:
        student = teacher.linearize([[budget // 2 if h % 2 else budget * 3 // 2 for h in range(H)]] * L)
    else:
        student = teacher.linearize([budget] * L) or teacher    # older versions swapped the cores in place
    layout = {"stack": stack} if "stack" in distill_module.DistillConfig.__dataclass_fields__ else {}
    cfg = distill_module.DistillConfig(loss=loss, batch_size=1, block_size=T, max_steps=100, warmup_steps=0,
                                       device=device, **layout)
    optim, gen = distill_module.make_optimizer(student, cfg), torch.Generator().manual_seed(0)
    data = np.random.default_rng(0).integers(0, teacher.config.vocab_size, 50_000).astype(np.uint16)
    trainer = distill_module.Trainer(cfg, teacher, student, optim, gen, data, device)
    step = lambda: distill_module.train_step(trainer, 10)
    step()
    with OpCount() as count:
        step()
    times, cpu = [], []                                     # wall and process CPU time (steadier on a shared CPU)
    for _ in range(repeats):
        devices.sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        devices.sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
        cpu.append(1e3 * (time.process_time() - c0))
    return {"loss": loss, "ops": sum(count.ops.values()), "top": count.ops.most_common(6),
            "ms": statistics.median(times), "cpu_ms": statistics.median(cpu)}


def step_table(cfg, device):
    import distill
    print(f"\none distill.py step at the GPT-2-124M shape, {cfg.step_tokens} tokens, budget 64, on {device}, "
          f"{cfg.threads} threads:\n\n| loss | aten ops | ms (median of {cfg.repeats}) | commonest ops |\n"
          "|---|---:|---:|---|")
    for loss in cfg.step:
        for stack in (("yes", "no") if loss != "direct" else ("no",)):
            r = step_row(distill, loss, cfg.step_tokens, 64, cfg.repeats, device, stack=stack)
            name = f"{loss}, layers {'stacked (a GPU' if stack == 'yes' else 'one by one (a CPU'}'s layout)"
            print(f"| {name if loss != 'direct' else loss} | {r['ops']} | {r['ms']:.0f} | "
                  f"{', '.join(f'{k} {n}' for k, n in r['top'])} |")


def main(argv=None):
    cfg = door.parse_config(BenchConfig, argv, description=__doc__)
    torch.set_num_threads(cfg.threads)
    if cfg.worker:
        return worker(cfg)
    device, _ = devices.pick_device(cfg.device, "float32")
    heads = read_heads(cfg.heads) if cfg.heads else None                  # a bad file: refused before the tables
    if cfg.T:
        scan_table(cfg, device)
    if cfg.decode_ctx:
        decode_table(cfg, device)
    if heads:
        heads_table(cfg, device, *heads)
    if cfg.step:
        step_table(cfg, device)


if __name__ == "__main__":
    door.run_main(main)
