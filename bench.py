"""Speed and memory of causal linear attention against softmax attention on CPU, side by side in one run.

    python bench.py                          # T = 1024, 4096, 16384; B = 1, H = 12, M = D = 64; chunk sweep 32..256
    python bench.py --T 1024 4096 --chunks 64 --repeats 5

Linear: the PRF feature map of queries and keys plus the chunked causal scan, forward only (torch.no_grad).
Softmax: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True) on the same inputs.
Every (method, T, chunk size) runs in a fresh subprocess, so its peak memory is its own:
  ms        median wall time of --repeats calls, after one warm-up call.
  peak MiB  the rise of the process's peak resident set size (VmHWM, reset through /proc/self/clear_refs once the
            inputs exist) during the warm-up call: output, intermediates and any allocator slack the call touched;
            not the inputs, not the Python/torch runtime. (ru_maxrss is used where clear_refs is unavailable.)
  GFLOP/s   counted operations / time. Linear counts what it executes: the feature matmuls, per-chunk states,
            inter-chunk products and the full C x C intra-chunk blocks (their masked half included). Softmax is
            credited with the causal work 2 T^2 D H (the lower half of QK^T and of PV), whatever its kernel runs.
  matmul    the machine's dense fp32 rate: best of 5 timings of a 4096 x 4096 by 4096 x 4096 matmul.
The table is markdown; the lines under it check the issue's targets (no slower at 4k, >= 6x at 16k, memory linear).
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from model import GPT, GPTConfig, PRF, Cache, causal_linear_attention


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=int, nargs="*", default=[1024, 4096, 16384],
                   help="sequence lengths of the scan table; none to skip it")
    p.add_argument("--B", type=int, default=1, help="batch size")
    p.add_argument("--H", type=int, default=12, help="number of heads")
    p.add_argument("--D", type=int, default=64, help="head size (queries, keys and values)")
    p.add_argument("--M", type=int, default=64, help="number of features of the linear attention")
    p.add_argument("--chunk", type=int, default=64, help="chunk size of the scan in the main table")
    p.add_argument("--chunks", type=int, nargs="*", default=[32, 64, 128, 256],
                   help="chunk sizes of the tuning sweep (second table); none to skip it")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (the median is reported)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    p.add_argument("--decode-ctx", type=int, nargs="*", default=[256, 512, 1024, 2048],
                   help="context lengths for the decoding table (Pythia-160M shape, random weights); none to skip")
    p.add_argument("--decode-steps", type=int, default=32, help="tokens decoded per context length (mean ms reported)")
    p.add_argument("--worker", nargs=3, metavar=("METHOD", "T", "CHUNK"),
                   help="internal: measure one case ('linear' or 'sdpa') in this process and print it as JSON")
    return p.parse_args(argv)


def rss_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def worker(args):
    """One measurement in a fresh process: {"ms", "peak_mib", "flops"}."""
    method, T, C = args.worker[0], int(args.worker[1]), int(args.worker[2])
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, H, D, M = args.B, args.H, args.D, args.M
    q, k, v = torch.randn(3, B, H, T, D).unbind(0)
    if method == "linear":
        fm = PRF(H, D, M)
        N = -(-T // C) * C  # padded length
        flops = B * H * (2 * 2 * T * D * M + 2 * 2 * N * M * (D + 1) + 2 * N * C * M + 2 * N * C * (D + 1))
        run = lambda: causal_linear_attention(fm(q, True), fm(k, False), v, chunk_size=C)
    else:
        flops = B * H * 2 * T * T * D
        run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with torch.no_grad():
        try:  # reset the high-water mark to the current resident size
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            base, read = rss_kib("VmRSS"), lambda: rss_kib("VmHWM")
        except OSError:
            base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            read = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        y = run()
        peak = read() - base
        del y
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    print(json.dumps({"ms": 1e3 * statistics.median(times), "peak_mib": peak / 1024, "flops": flops}))


def measure(args, method, T, chunk):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", method, str(T), str(chunk)]
    for name in ("B", "H", "D", "M", "repeats", "threads"):
        cmd += [f"--{name}", str(getattr(args, name))]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"error: the {method} measurement at T={T} failed:\n{out.stderr.strip()}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def matmul_gflops(n=4096):
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def decode_ms(model, ctx, steps):
    """Mean ms per generated token after a prefill of ctx tokens: KV cache (softmax) or fixed state (linear)."""
    cache = Cache(model.config.n_layer)
    idx = torch.randint(0, model.config.vocab_size, (1, ctx))
    with torch.no_grad():
        model(idx, cache=cache)
        tok = idx[:, -1:]
        model(tok, cache=cache)                                   # warm-up step
        t0 = time.perf_counter()
        for _ in range(steps):
            model(tok, cache=cache)
    return 1e3 * (time.perf_counter() - t0) / steps


def decode_table(args):
    """Per-token decode time of a Pythia-160M-shape model, softmax (KV cache) against linearised (M = 64 state)."""
    torch.manual_seed(0)
    cfg = GPTConfig(family="neox", vocab_size=50304, n_layer=12, n_head=12, n_kv_head=12, n_embd=768, head_dim=64,
                    block_size=2048, rotary_dim=16, parallel_residual=True, tie_embeddings=False, mlp_hidden=3072)
    softmax = GPT(cfg).eval()
    linear = GPT(cfg).eval()
    linear.load_state_dict(softmax.state_dict())
    linear.linearize([args.M] * cfg.n_layer)
    print(f"\ndecoding, Pythia-160M shape (random weights), batch 1, ms per token (mean of {args.decode_steps}):\n")
    print("| context | softmax + KV cache | linear (M=%d state) |" % args.M)
    print("|---:|---:|---:|")
    res = []
    for ctx in args.decode_ctx:
        res.append((ctx, decode_ms(softmax, ctx, args.decode_steps), decode_ms(linear, ctx, args.decode_steps)))
        print(f"| {ctx} | {res[-1][1]:.1f} | {res[-1][2]:.1f} |")
    lin = [r[2] for r in res]
    print(f"linear decode from {res[0][0]} to {res[-1][0]} tokens: {lin[-1] / lin[0]:.2f}x "
          f"({'flat, within 20%' if max(lin) <= 1.2 * min(lin) else 'NOT flat'}); "
          f"softmax: {res[-1][1] / res[0][1]:.2f}x")


def main(args):
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    mm = matmul_gflops()
    print(f"# causal attention, B={args.B} H={args.H} D={args.D} M={args.M}, fp32, forward only, "
          f"{args.threads} threads, torch {torch.__version__}; 1-min load average {load0:.1f} at start")
    print(f"machine: {os.cpu_count()} CPUs, dense fp32 matmul {mm:.0f} GFLOP/s\n")
    rows, sweep = [], {}
    for T in args.T:
        s = measure(args, "sdpa", T, 0)
        lin = measure(args, "linear", T, args.chunk)
        rows.append((T, lin, s))
        for C in args.chunks:
            sweep[T, C] = lin if C == args.chunk else measure(args, "linear", T, C)
        print(f"  T={T}: linear {lin['ms']:.1f} ms, sdpa {s['ms']:.1f} ms", file=sys.stderr)
    print(f"| T | linear ms (C={args.chunk}) | SDPA ms | speed-up | linear peak MiB | SDPA peak MiB "
          f"| linear KiB/token | linear GFLOP/s | SDPA GFLOP/s | matmul GFLOP/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for T, lin, s in rows:
        print(f"| {T} | {lin['ms']:.1f} | {s['ms']:.1f} | {s['ms'] / lin['ms']:.1f}x | {lin['peak_mib']:.1f} "
              f"| {s['peak_mib']:.1f} | {1024 * lin['peak_mib'] / T:.1f} | {lin['flops'] / lin['ms'] / 1e6:.1f} "
              f"| {s['flops'] / s['ms'] / 1e6:.1f} | {mm:.0f} |")
    if args.chunks:
        print("\nchunk-size sweep, linear ms (peak MiB):\n")
        print("| T | " + " | ".join(f"C={C}" for C in args.chunks) + " |")
        print("|---:|" + "---:|" * len(args.chunks))
        for T in args.T:
            print(f"| {T} | " + " | ".join(f"{sweep[T, C]['ms']:.1f} ({sweep[T, C]['peak_mib']:.0f})"
                                          for C in args.chunks) + " |")
    print(f"\n1-min load average at end {os.getloadavg()[0]:.1f} (timings are only comparable on an idle machine)")
    speed = {T: s["ms"] / lin["ms"] for T, lin, s in rows}
    if 4096 in speed:
        print(f"target T=4096 no slower than SDPA: {'met' if speed[4096] >= 1 else 'MISSED'} ({speed[4096]:.1f}x)")
    if 16384 in speed:
        print(f"target T=16384 at least 6x faster: {'met' if speed[16384] >= 6 else 'MISSED'} ({speed[16384]:.1f}x)")
    if len(rows) > 1:
        per_token = [lin["peak_mib"] / T for T, lin, _ in rows]
        print(f"linear peak memory per token from T={rows[0][0]} to T={rows[-1][0]}: "
              + " -> ".join(f"{1024 * x:.1f} KiB" for x in per_token)
              + (" (linear in T)" if per_token[-1] <= 1.25 * min(per_token) else " (NOT linear in T)"))


if __name__ == "__main__":
    a = parse_args()
    if a.worker:
        worker(a)
    else:
        torch.set_num_threads(a.threads)
        if a.T:
            main(a)
        if a.decode_ctx:
            decode_table(a)
