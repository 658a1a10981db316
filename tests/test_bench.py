"""bench/: the instruments (bench.py, bench_scorer.py, gpu_check.py, graphed_decode.py) and the studies
(heads.py, allocation.py), on fake clocks and tiny shapes, each pinned to a known answer."""

import json
import math
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import datafiles
import distill
import dof
import door
import evaluate
import forks
import model
import tasks
from conftest import EVAL, N_POS, ROOT, Calib, cli, distill_args, load_script, script_env
from model import GPT, LinearAttention, repeat_kv

# ==================================================================================================================
# bench.py, graphed_decode.py and gpu_check.py: the speed instruments on fake clocks and tiny shapes

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("device,linear", [("cpu", False), ("cpu", True), pytest.param("cuda", False, marks=CUDA),
                                           pytest.param("cuda", True, marks=CUDA)])
def test_graphed_decoder_equals_decoding_through_models_cache(device, linear, compiled):
    """bench/graphed_decode.py: after a prefill, tokens through the fixed buffers (position a tensor, a KV cache
    of fixed capacity or the linear state copied back) give model.Cache's logits at every step, with the buffers'
    addresses unchanged; on the CPU its step runs eagerly, on CUDA as one captured graph replayed; compiled, the same
    (torch.compile'd, fullgraph) step. GPT-2 is refused."""
    import graphed_decode
    torch.manual_seed(0)
    cfg = model.GPTConfig(family="llama", vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, head_dim=16,
                          block_size=256, rotary_dim=16, tie_embeddings=False, mlp_hidden=128, bias=False)
    gpt = GPT(cfg).eval()
    gpt = (gpt.linearize([8, 24], chunk_size=16) if linear else gpt).to(device)
    idx = torch.randint(0, 300, (2, 30), device=device)
    ours, ref = model.Cache(cfg.n_layer), model.Cache(cfg.n_layer)
    with torch.no_grad():
        gpt(idx[:, :21], cache=ours), gpt(idx[:, :21], cache=ref)
        expected = [gpt(idx[:, t:t + 1], cache=ref) for t in range(21, 30)]
    decoder = graphed_decode.GraphedDecoder(gpt, ours, idx[:, 20:21], steps=9, graph=device == "cuda",
                                            compile=compiled)
    assert (decoder.forward is gpt) != compiled
    assert (decoder.graph is not None) == (device == "cuda")
    addresses = [{name: x.data_ptr() for name, x in layer.items()} for layer in ours]
    for t, want in zip(range(21, 30), expected):
        got = decoder(idx[:, t:t + 1])
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (t, (got - want).abs().max())
    assert ours.pos.item() == ref.pos == 30 and sorted(ours[0]) == (["S", "pos", "s"] if linear else ["k", "pos", "v"])
    assert [{name: x.data_ptr() for name, x in layer.items()} for layer in ours] == addresses
    gpt2 = GPT(model.GPTConfig(family="gpt2", vocab_size=300, n_layer=1, n_head=2, n_embd=16, head_dim=8,
                               block_size=64))
    with pytest.raises(door.ModelError, match="^GPT-2's learned positions .* decode GPT-2 with model.generate$"):
        graphed_decode.GraphedDecoder(gpt2, model.Cache(1), idx[:, :1].cpu(), graph=False)


def test_bench_heads_table_times_both_layouts_at_the_same_total(tmp_path, capsys):
    """bench.py --heads on a two-layer, six-head run: one row per layout with the same features summed over heads,
    per-head rows in more groups, a ratio row, the products line; a per-layer table and a zero query block refused."""
    import bench  # bench/bench.py
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"args": {"budget": 4, "dof": [[1.0, 2.0, 9.0, 2.0, 1.0, 3.0], [5.0] * 6]}}))
    bench.main(["--T", "--decode-ctx", "--heads", str(run), "--heads-T", "40", "--query-block", "16",
                "--repeats", "1", "--threads", "1"])
    out = capsys.readouterr().out
    rows = [r.split(" | ") for r in out.splitlines() if r.startswith("| 40 |")]
    assert [r[1] for r in rows] == ["per layer", "per head", "per head / per layer"]
    assert rows[0][2] == rows[1][2] == str(4 * 12) and float(rows[0][3]) < float(rows[1][3])
    assert "one head's loss products per block of 16 queries (B=1, T=40): M=3: " in out
    run.write_text(json.dumps({"args": {"budget": 4, "dof": [3.0, 5.0]}}))
    with pytest.raises(door.ModelError, match="run.json holds no per-head table of finite DoF"):     # per-layer DoF
        bench.main(["--T", "--decode-ctx", "--heads", str(run)])
    with pytest.raises(door.ModelError, match="--query-block must be a number of at least 1, got 0"):
        bench.main(["--T", "--heads", str(run), "--query-block", "0"])
    run.write_text(json.dumps({"args": {"budget": 4, "dof": [[1.0, 2.0, 9.0, 2.0]] * 2}}))   # 4 heads: no GQA
    bench.main(["--T", "--decode-ctx", "--heads", str(run), "--heads-T", "16", "--repeats", "1", "--threads", "1"])
    assert "| 16 | per head / per layer |" in capsys.readouterr().out


def test_bench_tables_larger_than_memory_are_refused_before_any_work(tmp_path, capsys):
    """A per-head or decoding table too large for the free memory is one sentence before anything is allocated or
    printed (they had died in DefaultCPUAllocator, after the table's header)."""
    import bench
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"args": {"budget": 4, "dof": [[1.0, 2.0, 9.0, 2.0, 1.0, 3.0], [5.0] * 6]}}))
    with pytest.raises(door.ModelError, match=r"^the per-head table at --B 100000000 and --heads-T 16 \(budget 4\) needs "
                                         r"about [\d,.]+ GiB, more than the [\d.]+ GiB free on cpu; lower --B or "
                                         r"--heads-T$"):
        bench.main(["--T", "--decode-ctx", "--heads", str(run), "--heads-T", "16", "--B", "100000000",
                    "--threads", "1"])
    with pytest.raises(door.ModelError, match=r"^the decoding table at --M 100000000, --decode-ctx 16 and --decode-batch 1 "
                                         r"needs about [\d,.]+ GiB, more than the [\d.]+ GiB free on cpu; lower --M, "
                                         r"--decode-ctx or --decode-batch$"):
        bench.main(["--T", "--decode-ctx", "16", "--M", "100000000", "--threads", "1"])
    with pytest.raises(door.ModelError, match=r"--decode-batch 10000000 needs about"):
        bench.main(["--T", "--decode-ctx", "1024", "--decode-batch", "10000000", "--threads", "1"])
    assert capsys.readouterr().out == ""


def test_bench_measurement_that_fails_is_one_sentence(monkeypatch):
    """A scan measurement's process failing (out of memory, say) ends bench.py with its last line, not its traceback."""
    import bench
    died = subprocess.CompletedProcess([], 1, "", "Traceback (most recent call last):\n  ...\nRuntimeError: out of mem")
    monkeypatch.setattr(bench.subprocess, "run", lambda *args, **kwargs: died)
    with pytest.raises(door.ModelError, match=r"the sdpa measurement at T=64 failed \(RuntimeError: out of mem\); lower"):
        bench.measure(door.parse_config(bench.BenchConfig, []), "sdpa", 64, 16)


def test_bench_refuses_more_threads_than_cpus():
    """--threads above the machine's CPUs is one sentence (libgomp had crashed creating them: a segfault)."""
    import bench
    n = os.cpu_count()
    assert door.parse_config(bench.BenchConfig, ["--threads", str(n)]).threads == n
    with pytest.raises(door.ModelError, match=f"^--threads 100000 is more than the {n} CPUs of this machine; pass at most "
                                         f"{n}$"):
        door.parse_config(bench.BenchConfig, ["--threads", "100000"])


def test_bench_refuses_step_tokens_beyond_the_gpt2_positions():
    """--step-tokens beyond GPT-2's 1024 learned positions is refused with the config, not after the step table's
    header has printed."""
    import bench
    assert door.parse_config(bench.BenchConfig, ["--step", "softmax", "--step-tokens", "1024"]).step_tokens == 1024
    with pytest.raises(door.ModelError, match="^--step-tokens 5000 is more than the 1024 positions of the step table's "
                                         "GPT-2 shape; pass at most 1024$"):
        door.parse_config(bench.BenchConfig, ["--step", "softmax", "--step-tokens", "5000"])


class FakeClock:
    """A stand-in for the `time` module of bench.py and gpu_check.py: perf_counter() reads `now`; given durations,
    every second call (a timed call's end) first moves it on by the next one (then by `default`)."""
    def __init__(self, durations=None, default=0.001):
        self.now, self.default, self.calls = 0.0, default, 0
        self.durations = None if durations is None else list(durations)

    def perf_counter(self):
        if self.durations is not None and self.calls % 2:
            self.now += self.durations.pop(0) if self.durations else self.default
        self.calls += 1
        return self.now

    def process_time(self):
        return 0.0


def test_bench_worker_reports_the_median_the_peak_in_mib_and_the_flops_written_out(monkeypatch, capsys):
    """bench.py's worker on a fake clock and memory meter: the median of the timed calls (1, 1, 10 s: 1,000 ms, not
    the mean), a peak of 3,072 KiB as 3.0 MiB, and the FLOPs counted term by term: for the scan at B 1, H 2, T 100,
    D 8, M 4, chunk 64 (padded to 128), the feature maps over T, the states and the full chunk blocks over the
    padded length; for SDPA 2 T^2 D H."""
    import bench  # bench/bench.py
    monkeypatch.setattr(bench, "peak_meter", lambda device: lambda: 3072.0)

    def run(method, T, C, durations):
        monkeypatch.setattr(bench, "time", FakeClock(durations))
        bench.worker(door.parse_config(bench.BenchConfig, ["--worker", method, str(T), str(C), "--repeats", "3",
                                        "--B", "1", "--H", "2", "--D", "8", "--M", "4", "--threads", "1"]))
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    r = run("linear", 100, 64, [1.0, 1.0, 10.0])
    features, states = 2 * 2 * 100 * 8 * 4, 2 * 2 * 128 * 4 * (8 + 1)
    blocks = 2 * 128 * 64 * 4 + 2 * 128 * 64 * (8 + 1)                   # scores, then their product with [v | 1]
    assert r["ms"] == 1000.0 and r["peak_mib"] == 3.0 and r["flops"] == 2 * (features + states + blocks), r
    r = run("sdpa", 100, 0, [2.0, 5.0, 3.0])
    assert r["ms"] == 3000.0 and r["flops"] == 2 * 100 ** 2 * 8 * 2, r


def test_bench_scan_table_and_its_verdicts_read_sdpa_over_linear(monkeypatch, capsys):
    """bench.py's scan rows from given measurements: the speed-up is SDPA's ms over linear's, KiB/token 1024 x the
    peak MiB over T, GFLOP/s the flops over the ms; the verdicts: no slower at 2 ms each (1.0x), 6x faster at 6 ms
    against 1, and a per-token peak that doubles is not linear."""
    import bench  # bench/bench.py
    bench.speed_and_memory_lines([(4096, {"ms": 2.0, "peak_mib": 1.0}, {"ms": 2.0}),
                                  (16384, {"ms": 1.0, "peak_mib": 8.0}, {"ms": 6.0})])
    out = capsys.readouterr().out
    assert "T=4096: linear no slower than SDPA: yes (1.0x)" in out and "0.2 KiB -> 0.5 KiB (NOT linear in T)" in out
    assert "T=16384: linear at least 6x faster than SDPA: yes (6.0x)" in out, out
    res = {"sdpa": {"ms": 9.0, "peak_mib": 50.0, "flops": 9e6}, "linear": {"ms": 3.0, "peak_mib": 2.0, "flops": 6e6}}
    monkeypatch.setattr(bench, "measure", lambda cfg, method, T, chunk: dict(res[method]))
    monkeypatch.setattr(bench, "matmul_gflops", lambda device, n=4096: 100.0)
    bench.scan_table(door.parse_config(bench.BenchConfig, ["--T", "1024", "--chunks", "--decode-ctx", "--threads",
                                                            "1"]), "cpu")
    row = next(r for r in capsys.readouterr().out.splitlines() if r.startswith("| 1024 |")).split(" | ")
    assert (row[3], row[6], row[7], row[8]) == ("3.0x", "2.0", "2.0", "1.0"), row


def test_bench_decode_compile_adds_a_compiled_column_per_decoder(monkeypatch, capsys):
    """bench.py --decode-compile on a tiny shape with given times: each row gains the compiled step's ms for the KV
    cache and the linear state, after the eager ones, and the largest logit difference is printed under the table."""
    import bench  # bench/bench.py
    from model import GPTConfig
    tiny = dict(vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32, head_dim=16, mlp_hidden=64)
    monkeypatch.setattr(bench, "GPTConfig", lambda **kw: GPTConfig(**{**kw, **tiny}))
    monkeypatch.setattr(bench, "decode_ms", lambda gpt, ctx, steps, device, batch: float(ctx * batch))
    calls = []

    def graphed_ms(gpt, ctx, steps, device, compile=False, batch=1):    # the linear state 1 ms faster
        calls.append((ctx, compile, batch))
        return ctx / 2 + (not isinstance(gpt.h[0].attn.core, LinearAttention)), 1e-3 * len(calls)
    monkeypatch.setattr(bench, "graphed_ms", graphed_ms)
    bench.main(["--T", "--decode-ctx", "8", "16", "--decode-compile", "--decode-batch", "2", "--M", "4", "--threads",
                "1"])
    out = capsys.readouterr().out
    assert "| context | softmax + KV cache | linear (M=4 state) | softmax + KV cache, step compiled | linear (M=4 " \
           "state), step compiled |" in out, out
    assert "batch 2," in out and "| 8 | 16.0 | 16.0 | 5.0 | 4.0 |" in out and "| 16 | 32.0 | 32.0 | 9.0 | 8.0 |" in out
    assert calls == [(8, True, 2)] * 2 + [(16, True, 2)] * 2
    assert "differ from the eager step's by at most 4.0e-03 of the largest" in out, out
    bench.main(["--T", "--decode-ctx", "8", "--M", "4", "--threads", "1"])
    assert "compiled" not in capsys.readouterr().out and len(calls) == 4


def test_bench_decoding_heads_and_step_times_leave_out_the_warm_up(tmp_path, monkeypatch, capsys):
    """bench.py on a fake clock: decode_ms is ms per decoded token after an untimed prefill (1 s a token: 1,000 ms);
    the heads table times rounds after the first (100 s a cell), per layer 1 and 2 s, per head 3 and 4 s, ratio
    3.00x and 2.00x; step_row's ms is the median step (1, 9, 2 s: 2,000 ms) and its ops count every op."""
    import bench  # bench/bench.py
    clock = FakeClock()

    class Model:
        config = types.SimpleNamespace(n_layer=2, vocab_size=10)

        def hidden(self, idx, cache):
            clock.now += 100.0

        def __call__(self, tok, cache=None):
            clock.now += 1.0
    monkeypatch.setattr(bench, "time", clock)
    assert bench.decode_ms(Model(), 8, 4, "cpu") == 1000.0
    monkeypatch.setattr(bench, "time", FakeClock([100.0] * 4 + [1.0, 2.0, 3.0, 4.0]))
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"args": {"budget": 4, "dof": [[1.0, 2.0, 9.0, 2.0, 1.0, 3.0], [5.0] * 6]}}))
    bench.main(["--T", "--decode-ctx", "--heads", str(run), "--heads-T", "16", "--query-block", "8", "--repeats", "1",
                "--threads", "1"])
    rows = [r.split(" | ")[-2:] for r in capsys.readouterr().out.splitlines() if r.startswith("| 16 |")]
    assert rows == [["1000", "2000 |"], ["3000", "4000 |"], ["3.00x", "2.00x |"]], rows
    monkeypatch.setattr(bench, "time", FakeClock([1.0, 9.0, 2.0]))
    cfg = model.GPTConfig(n_layer=1, n_head=2, n_kv_head=2, n_embd=16, vocab_size=64, block_size=32)
    r = bench.step_row(distill, "softmax", T=16, budget=4, repeats=3, device="cpu", config=cfg)
    assert r["ms"] == 2000.0 and r["ops"] >= sum(n for _, n in r["top"]) > len(r["top"]), r


def test_bench_decode_ops_count_one_token_after_the_prefill_and_a_warm_up_token():
    """decode_ops: the aten ops of one decoded token, counted here after a prefill of 8 tokens and one token (the
    first token after a prefill also grows the KV cache)."""
    import bench  # bench/bench.py
    torch.manual_seed(0)
    gpt = GPT(model.GPTConfig(family="neox", n_layer=2, n_head=2, n_kv_head=2, n_embd=16, head_dim=8, rotary_dim=4,
                              vocab_size=64, block_size=32, mlp_hidden=32)).eval()
    for m in (gpt, gpt.linearize([4, 4])):
        cache, tok = model.Cache(2), torch.zeros(1, 1, dtype=torch.long)
        with torch.no_grad():
            m.hidden(torch.zeros(1, 8, dtype=torch.long), cache)
            m(tok, cache=cache)
            with bench.OpCount() as count:
                m(tok, cache=cache)
        assert bench.decode_ops(m, "cpu") == sum(count.ops.values()) > 20


def test_gpu_check_reads_the_logs_times_and_targets_it_reports(tmp_path, monkeypatch):
    """gpu_check.py's arithmetic: a distillation's ms/step is the median of the logged intervals after the first
    (10.5, 12.5, 11.5 after 500: 11.5), per 1,024-token sample 11.5 x 1024 / (2 x 64) = 92, its peak 3 MiB; time_ms
    the median after an untimed call; scan_cell SDPA over ours; decode_cell the KV cache also without cuDNN's SDPA
    and both as one CUDA graph where measured; the targets met or MISSED as their sentences say."""
    import gpu_check  # bench/gpu_check.py
    log = "".join(f"step {s}/30 | loss 1.234 | lr_z 0.01 | {ms} ms/step | 9,999 tok/s\n" for s, ms in
                  ((5, "500.0"), (10, "10.5"), (15, "12.5"), (20, "11.5"))) + "PEAK_BYTES 3145728\n"

    class Proc:                                                       # the forkserver's process: writes the log
        exitcode, join, terminate, kill, is_alive = 0, lambda *a: None, lambda s: None, lambda s: None, lambda s: False

        def __init__(self, target, args):
            self.log = args[2]

        def start(self):
            Path(self.log).write_text(log)
    monkeypatch.setattr(gpu_check, "start_forkserver", lambda preload: types.SimpleNamespace(Process=Proc))
    cfg = door.parse_config(gpu_check.CheckConfig, ["--out", str(tmp_path / "c.json"), "--block-size", "64"])
    rec = gpu_check.distill_run(cfg, tmp_path, "gpt2", "softmax", 2, "cpu", 100.0)
    assert (rec["status"], rec["ms_per_step"], rec["ms_per_sample"], rec["peak_mib"]) == ("ok", 11.5, 92.0, 3.0), rec
    monkeypatch.setattr(gpu_check, "time", clock := FakeClock())
    for seconds, repeats, ms in (([100.0, 1.0, 3.0], 2, 2000.0), ([100.0, 1.0, 1.0, 7.0], 3, 1000.0)):
        assert gpu_check.time_ms(lambda: setattr(clock, "now", clock.now + seconds.pop(0)), "cpu", repeats) == ms
    r = {"status": "ok", "sdpa_fwd_ms": 4.0, "linear_fwd_ms": 2.0, "sdpa_fwd_bwd_ms": 9.0, "linear_fwd_bwd_ms": 3.0}
    assert gpu_check.scan_cell(r) == ("fwd: SDPA 4.00 ms, linear 2.00 ms (2x); "
                                      "fwd_bwd: SDPA 9.00 ms, linear 3.00 ms (3x)")
    assert gpu_check.scan_cell({**r, "fla_fwd_ms": 1.0, "fla_fwd_bwd_ms": 3.0, "fla_rel_err": 0.00123}) == (
        "fwd: SDPA 4.00 ms, linear 2.00 ms (2x), fla 1.00 ms (4x); fwd_bwd: SDPA 9.00 ms, linear 3.00 ms (3x), "
        "fla 3.00 ms (3x); FLA against ours: relative error 1.2e-03")
    r = {"status": "ok", "kv_cache_ms": 40.0, "linear_state_ms": 10.0}
    assert gpu_check.decode_cell(r) == "KV cache 40.00 ms/token, linear state 10.00 ms/token"
    assert gpu_check.decode_cell({**r, "kv_no_cudnn_ms": 5.0}) == \
        "KV cache 40.00 ms/token (5.00 ms without cuDNN's SDPA), linear state 10.00 ms/token"
    graphed = {"graphed": True, "kv_cache_graph_ms": 2.0, "kv_cache_graph_err": 0.0042, "linear_state_graph_ms": 1.5,
               "linear_state_graph_err": 0.0}
    assert gpu_check.decode_cell({**r, **graphed}) == (
        "KV cache 40.00 ms/token, linear state 10.00 ms/token; one graph a token: KV cache 2.00 ms/token "
        "(logits within 4e-03), linear state 1.50 ms/token (logits within 0e+00)")
    assert gpu_check.decode_cell({**r, "graphed": True, "graph_error": "RuntimeError: capture failed"}) == \
        "KV cache 40.00 ms/token, linear state 10.00 ms/token; one graph a token: error (RuntimeError: capture failed)"
    compiled = {"kv_cache_compiled_ms": 1.25, "kv_cache_compiled_err": 0.0031, "linear_state_compiled_ms": 0.5,
                "linear_state_compiled_err": 1e-6}
    assert gpu_check.decode_cell({**r, **graphed, **compiled, "graphed": False}) == (
        "KV cache 40.00 ms/token, linear state 10.00 ms/token; the graph's step run eagerly: KV cache 2.00 ms/token "
        "(logits within 4e-03), linear state 1.50 ms/token (logits within 0e+00); the compiled step run eagerly: "
        "KV cache 1.25 ms/token (logits within 3e-03), linear state 0.50 ms/token (logits within 1e-06)")
    assert gpu_check.decode_cell({**r, **graphed, "compiled_error": "BackendCompilerFailed: no Triton"}).endswith(
        "linear state 1.50 ms/token (logits within 0e+00); one compiled graph a token: error (BackendCompilerFailed: "
        "no Triton)")

    def targets(scan, graphed=None):                    # softmax 3 against direct 4; decoding at worst 4 ms/token
        return "\n".join(gpu_check.targets({
            "distill": [{"model": "gpt2", "loss": "softmax", "ms_per_sample": 3.0},
                        {"model": "gpt2", "loss": "direct", "ms_per_sample": 4.0}],
            "decode": [{"status": "ok", "ctx": c, "kv_cache_ms": a, "linear_state_ms": b, **(graphed or {})}
                       for c, a, b in ((1, 1.0, 4.0), (2, 2.0, 2.0))],
            "scan": [dict(status="ok", T=T, sdpa_fwd_ms=s, linear_fwd_ms=l, **({"fla_fwd_ms": f} if f else {}))
                     for T, s, l, f in scan]}))
    t = targets([(4096, 2.0, 5.0, 1.0), (8192, 2.0, 1.0, None)])                # FLA's scan is the faster at 4k
    assert "target softmax no slower than direct: met (3.0 against 4.0 ms/sample)" in t, t
    assert "target decoding <= 3 ms/token at ctx 1..2: MISSED (worst 4.00)" in t, t
    assert "as one graph" not in t, t                                         # not measured: no line
    t = targets([(4096, 2.0, 5.0, 1.0)], graphed)
    assert "target decoding as one graph a token <= 3 ms/token at ctx 1..2: met (worst 2.00)" in t, t
    assert "compiled" not in t, t
    t = targets([(4096, 2.0, 5.0, 1.0)], {**graphed, **compiled, "kv_cache_compiled_ms": 3.5})
    assert "target decoding as one compiled graph a token <= 3 ms/token at ctx 1..2: MISSED (worst 3.50)" in t, t
    assert "faster than flash SDPA from 4k tokens (forward): met" in t, t
    t = targets([(4096, 2.0, 3.0, None), (8192, 2.0, 1.0, None)])              # ours slower at 4,096 itself
    assert "faster than flash SDPA from 4k tokens (forward): MISSED" in t, t


def test_gpu_check_rows_run_while_four_times_the_last_fits_the_first_not_counted(monkeypatch):
    """rows_until on a fake clock, 200 s left at the start: rows of 60 s (the first: kernels compiled and models
    built once, not counted), 10 s and 30 s (one raising) run; the fourth is skipped, as 4 x 30 s > the 100 s left."""
    import gpu_check  # bench/gpu_check.py
    monkeypatch.setattr(gpu_check, "time", clock := FakeClock([60.0, 10.0, 30.0, 1.0, 1.0]))

    def measure(v):
        if v == 3:
            raise ValueError("no kernel\nfor this")
        return {"ms": v}
    rows = gpu_check.rows_until(lambda: 200.0 - clock.now, [1, 2, 3, 4, 5], measure, "T")
    assert rows == [{"T": 1, "status": "ok", "ms": 1}, {"T": 2, "status": "ok", "ms": 2},
                    {"T": 3, "status": "error", "reason": "ValueError: no kernel"},
                    {"T": 4, "status": "skipped", "reason": "100 s left of --budget-seconds"},
                    {"T": 5, "status": "skipped", "reason": "100 s left of --budget-seconds"}], rows


# ==================================================================================================================
# heads.py and bench_scorer.py

def test_heads_measures_every_map_at_every_M_and_reports_at_the_M_nearest_the_budget(setup, tmp_path, capsys):
    """bench/heads.py on two layers of the tiny GPT-2 with --Ms 4 8: every map's held-out KL per head at each
    M, each head at M = its rounded DoF, dims in proportion to the DoF summing to budget x heads, and the table and
    figure at M = 4, the M of --Ms nearest --budget 5 (they had looked up M = 32 whatever --Ms held); the trained maps
    from each init, draw by draw at that M, draw 0 being the table's."""
    d, ckpt, data = setup
    heads = load_script("bench/heads.py")
    heads.main(["--model", str(ckpt), "--data", str(data), "--layers", "0", "2", "--block-size", "64", "--J", "256",
                "--Ms", "4", "8", "--budget", "5", "--steps", "2", "--seeds", "2", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "smollm2.json").read_text())
    for kind in ("trained", "trained-leverage"):      # draw 0 of the paired draws is the table's trained row at M = 4
        assert np.array(res["trained_draws"][kind]).shape == (2, 2)
        assert res["trained_draws"][kind][0] == pytest.approx([np.mean(r["kl"][kind]["4"]) for r in res["layers"]])
    assert [r["layer"] for r in res["layers"]] == [0, 2]
    for r in res["layers"]:
        kl = np.array([r["kl"][kind][m] for kind in heads.METHODS for m in ("4", "8")])     # (maps x Ms, heads)
        assert kl.shape == (10, 4) and np.isfinite(kl).all() and (kl > 0).all()
        assert r["at_dof"]["M"] == [max(1, round(n)) for n in r["dof"]] and len(r["at_dof"]["leverage"]) == 4
    prop = np.array(res["equal"]["proportional_M"])
    assert prop.shape == (2, 4) and prop.sum() == 5 * 8 and prop.min() >= 1
    assert heads.budget_M(res["settings"]) == 4
    out = capsys.readouterr().out
    assert "- gaussian, M = 4: Spearman" in out and "- trained, M = 4: Spearman" in out and "wrote" in out
    assert "minus trained from the Gaussian one, M = 4, paired draw by draw over draws 0–1: " in out
    heads.figure(res, tmp_path / "fig.png")
    assert (tmp_path / "fig.png").read_bytes()[:4] == b"\x89PNG"


def test_heads_refuses_data_of_another_tokenizer_and_reports_one_draw_without_an_error(setup, tmp_path, capsys):
    """bench/heads.py checks --data's meta.json against the teacher's tokenizer, as distill.py does (it had
    measured a GPT-2 teacher on SmolLM2's token ids); with --seeds 1 the paired difference of the trained maps is one
    draw, printed without the standard error (it had printed "± nan")."""
    d, ckpt, data = setup
    heads = load_script("bench/heads.py")
    other = tmp_path / "other"
    shutil.copytree(data, other)
    (other / "meta.json").write_text(json.dumps({"tokenizer": {"model": "smollm2-135m", "n_vocab": 49152}}))
    flags = ["--model", str(ckpt), "--layers", "0", "--block-size", "64", "--J", "128", "--Ms", "2", "--budget", "2",
             "--steps", "1", "--seeds", "1", "--out", str(tmp_path / "out")]
    with pytest.raises(door.ModelError, match=r"^.*other was tokenized with the tokenizer of smollm2-135m \(49152 tokens\)"):
        heads.main(flags + ["--data", str(other)])
    assert not (tmp_path / "out").exists()
    heads.main(flags + ["--data", str(data)])
    out = capsys.readouterr().out
    assert "paired draw by draw over draws 0–0: " in out and " (one draw: no error; the draws " in out
    assert "nan" not in out


def test_bench_scorer_times_both_rates_and_runs_as_a_script(tiny_gpt, enc, ckpt, student, tmp_path, capsys):
    """bench/bench_scorer.py: harness tokens (a window's worth for a truncated request) over the fast scorer's
    time against the plain forward rate; run as a script it finds the core from bench/; a bad option is one
    sentence and exit code 2."""
    import door
    bs = load_script("bench/bench_scorer.py")
    torch.manual_seed(0)
    rows = bs.bench(tiny_gpt, enc, {"arc_easy": tasks.load_task("arc_easy", evaluate.arc, EVAL, 4)}, batch_size=4)
    assert rows["arc_easy"]["harness_tok_per_s"] > 0 and rows["arc_easy"]["plain_forward_tok_per_s"] > 0
    assert rows["all"]["harness_tokens"] == rows["arc_easy"]["harness_tokens"]
    assert "plain fwd tok/s" in capsys.readouterr().out
    ctx, cont = evaluate.encode_pair(enc, " ".join(f"word{i}" for i in range(200)), " the end of it")
    assert bs.harness_tokens([[(ctx, cont)]], N_POS) == N_POS and bs.harness_tokens([[([1, 2], [3])]], N_POS) == 2
    r = cli("bench/bench_scorer.py", "--model", ckpt, "--tasks", "piqa", "--data-dir", EVAL, "--limit", 2,
            "--device", "cpu", "--output", tmp_path / "bench.json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "harness tok/s" in r.stdout and json.loads((tmp_path / "bench.json").read_text())["teacher"]["piqa"]
    bs.main(["--model", str(ckpt), "--ckpt", str(student), "--tasks", "piqa", "--data-dir", str(EVAL), "--limit", "2",
             "--device", "cpu"])                                       # the student too (had been an AttributeError)
    assert "student (" in capsys.readouterr().out
    shutil.copytree(EVAL, eval_dir := tmp_path / "eval")
    with pytest.raises(door.ModelError, match=r"--output \S+piqa.jsonl would replace a file this run reads"):
        bs.main(["--model", str(ckpt), "--data-dir", str(eval_dir), "--output", str(eval_dir / "piqa.jsonl")])
    with pytest.raises(SystemExit) as e:
        door.run_main(lambda: bs.main(["--model", str(ckpt), "--rounds", "0", "--device", "cpu"]))
    assert e.value.code == 2 and capsys.readouterr().err == "error: --rounds must be a number of at least 1, got 0\n"
    with pytest.raises(SystemExit) as e:
        bs.main(["--help"])
    assert e.value.code == 0 and "--rounds" in capsys.readouterr().out


def test_bench_scorer_plain_rate_is_no_wider_than_the_tokens_it_covers(tiny_gpt, monkeypatch):
    """The plain forward rate runs batches of at most ceil(tokens / length) rows, and counts the tokens it ran (a
    --batch-size of 10^9 had allocated 10^9 rows, 10^5 had run for minutes, to time 20 tokens)."""
    bs = load_script("bench/bench_scorer.py")
    shapes, clock = [], iter([0.0, 2.0])

    class Counted:
        config = types.SimpleNamespace(vocab_size=10)

        def __call__(self, x):
            shapes.append(tuple(x.shape))
    monkeypatch.setattr(bs, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    assert bs.plain_forward_rate(Counted(), 25, 10, 16) == 3 * 10 / 2.0           # one batch of 3 rows, in 2 s
    assert shapes == [(1, 8), (3, 10)]
    monkeypatch.undo()
    assert bs.plain_forward_rate(tiny_gpt, 20, 10, 10 ** 9) > 0


# ==================================================================================================================
# gpu_check.py

def test_gpu_check_tiny_on_cpu_measures_every_section_and_skips_past_the_deadline(tmp_path):
    import gpu_check  # bench/gpu_check.py
    out = tmp_path / "check.json"
    run = subprocess.run([sys.executable, "bench/gpu_check.py", "--device", "cpu", "--tiny", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=script_env())
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| section | case | measurement |" in run.stdout
    res = json.loads(out.read_text())
    number = lambda x: isinstance(x, float) and math.isfinite(x) and x > 0
    assert [(r["model"], r["loss"]) for r in res["distill"]] == [("gpt2", "softmax"), ("gpt2", "l2"), ("gpt2", "direct"),
                                                                  ("gpt2-per-head", "softmax"), ("pythia", "softmax")]
    assert [(r["model"], r["loss"]) for r in res["ops"]] == [("gpt2", "softmax"), ("gpt2", "l2"), ("gpt2", "direct"),
                                                              ("gpt2-per-head", "softmax")]
    assert all(r["ops"] > 0 and number(r["ms"]) for r in res["ops"])
    for r in res["distill"]:
        assert r["status"] == "ok" and all(number(r[k]) for k in ("ms_per_step", "ms_per_sample", "peak_mib")), r
        assert r["command"].count(" <work>/") == 3 and "/tmp" not in r["command"]       # no machine's paths
    assert [r["T"] for r in res["scan"]] == gpu_check.TINY["scan_T"]
    assert all(number(r[f"{a}_{m}_ms"]) for r in res["scan"] for a in ("linear", "sdpa") for m in ("fwd", "fwd_bwd"))
    assert [r["ctx"] for r in res["decode"]] == gpu_check.TINY["decode_ctx"]
    assert all(number(r[f"{m}{s}"]) for r in res["decode"] for m in ("kv_cache", "linear_state")
               for s in ("_ms", "_graph_ms", "_compiled_ms"))
    assert all(r["graphed"] is False and all(r[f"{m}_{kind}_err"] < 1e-2 for m in ("kv_cache", "linear_state")
                                             for kind in ("graph", "compiled"))
               for r in res["decode"])                                    # no CUDA: the graph's step run eagerly
    assert res["dof"]["status"] == "ok" and number(res["dof"]["ms"]) and 0 < res["dof"]["mean_dof"] <= 64
    gpu_check.main(["--device", "cpu", "--tiny", "--budget-seconds", "0.001", "--out", str(out)])   # nothing fits
    res = json.loads(out.read_text())
    assert {r["status"] for k in ("distill", "scan", "decode") for r in res[k]} | {res["dof"]["status"]} == {"skipped"}
    assert len(res["distill"]) == 5 and len(res["scan"]) == 2 and len(res["decode"]) == 2 and res["ops"] == []


def test_gpu_check_work_dir_of_another_shape_is_built_again(tmp_path, monkeypatch):
    """--work-dir of an earlier run of other shapes (--tiny's, then a full run's): its checkpoint and tokens are built
    again for this run (its tables labelled gpt2 had measured the earlier run's 2-layer checkpoint)."""
    import gpu_check
    monkeypatch.setattr(gpu_check, "distill_run", lambda cfg, work, kind, *args: {   # what the run would train
        "config": json.loads((work / f"{kind}-checkpoint" / "config.json").read_text()),
        "tokens": json.loads((work / f"{kind}-tokens" / "meta.json").read_text())["tokens"]["val"]})
    args = ["--out", str(tmp_path / "check.json"), "--block-size"]
    small, other, built = gpu_check.TINY_SHAPES, {"gpt2": dict(gpu_check.TINY_SHAPES["gpt2"], n_layer=3)}, []
    for shapes, block in ((small, 64), (small, 64), (other, 64), (other, 32)):
        cfg = door.parse_config(gpu_check.CheckConfig, args + [str(block)])
        (r,) = gpu_check.distill_section(cfg, shapes, tmp_path, "cpu", lambda: 100.0, [("gpt2", "softmax")])
        assert r == {"config": shapes["gpt2"], "tokens": 8 * block + 2}, r
        built.append((tmp_path / "gpt2-checkpoint" / "model.safetensors").stat().st_mtime_ns)
    assert built[0] == built[1] != built[2]                     # one of this shape is reused


def test_gpu_check_forkserver_ignores_a_ctrl_c_while_it_starts(tmp_path):
    """A Ctrl-C in the first seconds reaches the forkserver too, importing torch: it had printed a KeyboardInterrupt
    traceback of its own (and the check's process creation failed). Here the SIGINT goes to the server alone, and the
    distill.py run, with no checkpoint to read, fails as such."""
    code = """if True:
        import os, signal, sys, threading, time
        from multiprocessing import forkserver
        from pathlib import Path
        sys.path.insert(0, "bench")
        import door
        import gpu_check

        def interrupt():
            while not forkserver._forkserver._forkserver_pid:
                time.sleep(0.01)
            time.sleep(0.5)                                     # into its imports
            os.kill(forkserver._forkserver._forkserver_pid, signal.SIGINT)
        threading.Thread(target=interrupt, daemon=True).start()
        cfg = door.parse_config(gpu_check.CheckConfig, ["--out", sys.argv[1] + "/check.json"])
        print(gpu_check.distill_run(cfg, Path(sys.argv[1]), "gpt2", "softmax", 1, "cpu", 60.0)["status"])"""
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=script_env())
    assert run.returncode == 0 and run.stdout == "error\n" and "KeyboardInterrupt" not in run.stderr, run.stderr[-2000:]
    assert "gpt2-checkpoint does not exist" in (tmp_path / "distill.log").read_text()


def test_gpu_check_stopped_while_a_distillation_runs_kills_it(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM while gpu_check.py waits for its distill.py process: the process is killed and joined, not
    left to run on (the stopped check had waited for it over a minute). Forked here, and sleeping, for speed."""
    import gpu_check
    started, fork = [], multiprocessing.get_context("fork")

    class Fork:                                       # the forkserver's context, as a plain fork
        def set_forkserver_preload(self, names):
            pass

        def Process(self, **kwargs):
            started.append(fork.Process(**kwargs))
            return started[-1]

    def stop(signum, frame):
        raise KeyboardInterrupt("SIGTERM")
    monkeypatch.setattr(gpu_check, "start_forkserver", lambda preload: Fork())
    monkeypatch.setattr(gpu_check, "distill_child", lambda *args: time.sleep(60))
    cfg = door.parse_config(gpu_check.CheckConfig, ["--out", str(tmp_path / "check.json")])
    old = signal.signal(signal.SIGALRM, stop)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        t0 = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            gpu_check.distill_run(cfg, tmp_path, "gpt2", "softmax", 1, "cpu", 100.0)
        assert time.perf_counter() - t0 < 10 and not started[0].is_alive() and started[0].exitcode is not None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        for p in started:                             # before the fix: still running
            p.kill()
            p.join()


# ==================================================================================================================
# allocation.py: its rank correlation, its fork of distill.py, its curves

def test_spearman_gives_tied_values_their_mean_rank():
    """bench/allocation.py's rank correlation: ties (dims of 32 recur) share a rank, so the order in which tied
    layers come plays no part."""
    import allocation
    assert allocation.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == allocation.spearman([1, 2, 2, 3], [1, 3, 2, 4])
    assert allocation.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(
        np.corrcoef([0, 1.5, 1.5, 3], [0, 1, 2, 3])[0, 1])


def test_allocation_fork_trains_resumes_and_predicts_with_a_rule_beyond_the_core(setup, tmp_path):
    """bench/allocation.py --rule dof-raw: dims allocated from the uncentred kernel's DoF although the keys are
    centred (the checkpoint records the rule as its alloc, and no fork: it is the core's student), resumed with the
    same flags, not by distill.py (which lacks --rule); --predict writes the predictors and trains nothing."""
    import allocation
    d, ckpt, data = setup
    flags = ["--rule", "dof-raw", "--center-keys", "--budget", "8", "--decay-steps", "4"]
    allocation.main(distill_args(ckpt, data, tmp_path / "raw", *flags, "--max-steps", "2"))
    teacher = GPT.from_pretrained(ckpt)
    calib = datafiles.calibration_batches(datafiles.read_tokens(data / "train.bin"), Calib(2, 4, 64, 0), "cpu")
    settings = distill.DistillConfig(budget=8, J=256, out_dir="x")
    want, raw, _ = dof.choose_dims(teacher, calib, settings)                        # no key means: uncentred
    cfg = json.loads((tmp_path / "raw" / "config.json").read_text())
    assert cfg["dims"] == want and cfg["alloc"] == "dof-raw" and cfg["dof"] == pytest.approx(raw)
    # the core's student; no leak
    assert cfg["fork"] is None and distill.DistillConfig is not allocation.AllocationConfig
    with pytest.raises(door.ModelError, match=r"raw was started with --\S+ '?\w+'?, which this script lacks; resume it "
                                         r"with the script that started it"):
        distill.main(distill_args(ckpt, data, tmp_path / "raw", "--center-keys", "--budget", "8", "--decay-steps",
                                  "4", "--max-steps", "4", "--resume"))                # distill.py lacks --rule
    assert want != dof.choose_dims(teacher, calib, settings, dof.key_means(teacher, calib))[0]
    with pytest.raises(door.ModelError, match=r"raw was started with --rule 'dof-raw', not 'entropy'; resume it with"):
        allocation.main(distill_args(ckpt, data, tmp_path / "raw", *flags[2:], "--rule", "entropy", "--max-steps", "4",
                                     "--resume"))
    allocation.main(distill_args(ckpt, data, tmp_path / "raw", *flags, "--max-steps", "4", "--resume"))
    assert json.loads((tmp_path / "raw" / "config.json").read_text())["step"] == 4
    with pytest.raises(door.ModelError, match=r"--predict \S+meta.json would replace a file this run reads"):
        allocation.main(distill_args(ckpt, data, tmp_path / "none", "--predict", data / "meta.json"))
    with pytest.raises(SystemExit) as e:                                               # stops before training
        allocation.main(distill_args(ckpt, data, tmp_path / "none", "--predict", tmp_path / "p.json"))
    assert e.value.code == 0
    P = json.loads((tmp_path / "p.json").read_text())["predictors"]
    assert "entropy" in P and all(len(v) == 4 for v in P.values()) and not (tmp_path / "none").exists()
    (tmp_path / "busy").mkdir()                          # an out-dir --predict never writes is not refused, nor locked
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as e:
        allocation.main(distill_args(ckpt, data, tmp_path / "busy", "--predict", tmp_path / "q.json"))
    assert e.value.code == 0 and json.loads((tmp_path / "q.json").read_text())["predictors"] == P
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("busy")) == ["busy"]
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["notes.txt"]


def test_allocation_curves_damaged_or_not_positive_are_one_sentence(tmp_path):
    """bench/allocation.py --rule measured reads the curve runs through the checked reader."""
    import allocation
    (tmp_path / "fix-m4-s0.json").write_text('{"args": {"budget": 4')
    with pytest.raises(door.ModelError, match=r"fix-m4-s0.json is damaged or truncated"):
        allocation.load_curves(tmp_path)
    for m, kl in ((4, [0.0, 0.1]), (8, [0.1, 0.1])):
        (tmp_path / f"fix-m{m}-s0.json").write_text(json.dumps({"args": {"budget": m}, "val": [{"attn_kl": kl}]}))
    with pytest.raises(door.ModelError, match=r"or a KL that is not a list of finite positive numbers"):   # log KL: no 0
        allocation.load_curves(tmp_path)
    for kl8, kl4 in ((0.5, 0.5), (0.5, [0.2, 0.1]), ([0.1, 0.1], [float("inf"), 0.1])):   # an IndexError; dims of inf
        for m, kl in ((8, kl8), (4, kl4)):
            (tmp_path / f"fix-m{m}-s0.json").write_text(json.dumps({"args": {"budget": m}, "val": [{"attn_kl": kl}]}))
        with pytest.raises(door.ModelError, match=r"lacks its budget or held-out KL \(ValueError\)|or a KL that is not a "
                                             r"list of finite positive numbers"):
            allocation.load_curves(tmp_path)
    (tmp_path / "fix-m4-s0.json").write_text(json.dumps({"args": {"budget": 4}, "val": [{"attn_kl": [0.2, 0.1]}]}))
    assert allocation.load_curves(tmp_path)[0].tolist() == [4, 8]
    (tmp_path / "fix-m4-s1.json").write_text(json.dumps({"args": {"budget": 4}, "val": [{"attn_kl": [0.2, 0.1]}]}))
    with pytest.raises(door.ModelError, match=r"fewer than two fix-m\*.json curve runs of distinct finite budgets"):   # 0 / 0
        allocation.load_curves(tmp_path)
    (tmp_path / "fix-m4-s1.json").write_text(json.dumps({"args": {"budget": float("inf")}, "val": [{"attn_kl": [
        0.1, 0.05]}]}))
    with pytest.raises(door.ModelError, match=r"fewer than two fix-m\*.json curve runs of distinct finite budgets"):
        allocation.load_curves(tmp_path)                                             # it had given dims of 208, 16 ...
    (tmp_path / "fix-m4-s1.json").unlink()
    with pytest.raises(door.ModelError, match=r"^--curves \S+nowhere is not a folder; pass the --curves of docs/exp"):
        allocation.load_curves(tmp_path / "nowhere")
    (tmp_path / "fix-m4-s0.json").write_text(json.dumps({"val": []}))
    with pytest.raises(door.ModelError, match=r"lacks its budget or held-out KL \(KeyError\)"):
        allocation.load_curves(tmp_path)


# ==================================================================================================================
# allocation.py's predictors and heads.py's per-head measurements, each pinned to a known answer

def test_allocation_predictors_are_the_teachers_entropy_and_the_centred_untrained_students_kl(setup):
    """bench/allocation.py's predictors on the tiny GPT-2, written out: with q~ = q / d^(1/4) and k~ its centred
    keys alike, entropy is the teacher's causal attention entropy (mean over sequences, heads and queries, then
    batches), qk-norm mean |q~| times mean |k~|, prf-var the mean of sum_j p_ij |q~_i + k~_j|^2; dof-max above dof-mean
    layer by layer; untrained-kl is the layerwise softmax loss of a student of M = budget drawn from --seed with its
    keys centred by the key means."""
    import allocation
    d, ckpt, data = setup
    teacher = GPT.from_pretrained(ckpt)
    L, H = teacher.config.n_layer, teacher.config.n_head
    calib = datafiles.calibration_batches(datafiles.read_tokens(data / "train.bin"), Calib(2, 2, 64, 0), "cpu")
    with forks.replaced(allocation.REPLACE):
        cfg = door.parse_config(distill.DistillConfig, ["--model", ckpt, "--data", data, "--budget", "4", "--J", "64"])
    assert type(cfg) is allocation.AllocationConfig and distill.DistillConfig is not allocation.AllocationConfig
    P = allocation.predictors(cfg, teacher, calib)
    mask, mu = torch.ones(64, 64, dtype=torch.bool).tril(), dof.key_means(teacher, calib)
    ent, qk, var = np.zeros((3, L))
    for idx in calib:
        for l, (q, k) in enumerate(dof.teacher_qk(teacher, idx)):
            q, k = q.double() / 2, (repeat_kv(k, H).double() - mu[l][:, None].double()) / 2     # / d^(1/4), d = 16
            p = torch.softmax((q @ k.mT).masked_fill(~mask, -math.inf), -1)           # centring leaves the rows alone
            ent[l] += -(p * p.clamp_min(1e-300).log()).sum(-1).mean().item() / len(calib)
            qk[l] += (q.norm(dim=-1).mean() * k.norm(dim=-1).mean()).item() / len(calib)
            s2 = (q[..., :, None, :] + k[..., None, :, :]).square().sum(-1)           # |q~_i + k~_j|^2 (B, H, T, T)
            var[l] += (p * s2).sum(-1).mean().item() / len(calib)
    assert P["entropy"] == pytest.approx(ent, rel=1e-4)
    assert P["qk-norm"] == pytest.approx(qk, rel=1e-4) and P["prf-var"] == pytest.approx(var, rel=1e-4)
    assert all(a > b for a, b in zip(P["dof-max"], P["dof-mean"]))
    torch.manual_seed(cfg.seed)
    fresh = teacher.linearize([4] * L, "prf", cfg.chunk_size)
    for c, m in zip(fresh.cores(), dof.key_means(teacher, calib)):
        c.key_mean.copy_(m)
    kl = np.mean([distill.layer_losses(fresh.cores(), dof.teacher_qk(teacher, idx), "softmax").numpy()
                  for idx in calib], 0)
    assert P["untrained-kl"] == pytest.approx(kl, rel=1e-4)


def test_heads_per_head_kl_is_a_mean_over_sequences_and_untrained_maps_over_draws():
    """bench/heads.py's pieces on random GQA queries and keys (4 heads, 2 KV heads): calibration_points' mu is
    each head's mean key and its points pool queries with centred keys (so they sum to the queries' sum when J takes
    them all); make_core centres each group by its own heads' mu; head_kl of two sequences is the mean of each one's;
    an untrained map's KL is the mean over --seeds draws s = 0, 1, 2 of make_core's draw s."""
    heads = load_script("bench/heads.py")
    B, H, Hkv, T, D = 2, 4, 2, 24, 8
    g = torch.Generator().manual_seed(0)
    qc, kc, qh, kh = (torch.randn(B, h, T, D, generator=g) + 0.5 for h in (H, Hkv, H, Hkv))
    mu, x = heads.calibration_points(qc, kc, H, 2 * B * T)
    assert torch.allclose(mu, repeat_kv(kc.mean((0, 2))[None, :, None], H)[0, :, 0])
    assert torch.allclose(x.sum(1), qc.sum((0, 2)), atol=1e-4)
    cfg, dims = types.SimpleNamespace(lam=1e-3, seeds=3), [3, 5, 3, 2]
    mc = types.SimpleNamespace(n_head=H, n_kv_head=Hkv, head_dim=D)
    core = heads.make_core(cfg, mc, dims, "gaussian", mu, x, 0)
    assert all(torch.equal(c.key_mean, mu[hs]) for c, hs in zip(core.groups, core.heads))
    assert torch.allclose(heads.head_kl(core, qh, kh), (heads.head_kl(core, qh[:1], kh[:1]) +
                                                        heads.head_kl(core, qh[1:], kh[1:])) / 2)
    draws = torch.stack([heads.head_kl(heads.make_core(cfg, mc, dims, "gaussian", mu, x, s), qh, kh) for s in range(3)])
    assert not torch.equal(draws[0], draws[1])
    assert torch.allclose(heads.map_kl(cfg, mc, dims, "gaussian", mu, x, (qc, kc), (qh, kh)), draws.mean(0))


def test_heads_proportional_dims_are_one_pool_of_every_measured_head(setup, monkeypatch):
    """bench/heads.py's equal-error comparison: M ~ N_lam over the heads of every measured layer together (mean
    M = --budget over all of them), not layer by layer; here layer 2's heads, of little DoF, get fewer than 4."""
    d, ckpt, data = setup
    heads = load_script("bench/heads.py")
    N = iter([torch.tensor([1.0, 3.0, 0.5, 4.0], dtype=torch.float64), torch.full((4,), 0.5, dtype=torch.float64)])
    monkeypatch.setattr(dof, "degrees_of_freedom", lambda *a, **k: next(N))
    cfg = door.parse_config(heads.HeadsConfig, [str(a) for a in ["--model", ckpt, "--data", data, "--layers", 0, 2,
                              "--block-size", 32, "--J", 64, "--Ms", 4, "--budget", 4, "--steps", 0, "--seeds", 1,
                              "--calib-seqs", 1, "--eval-seqs", 1, "--out", d / "heads-pool"]])
    res = heads.measure(cfg)
    assert res["equal"]["proportional_M"] == np.reshape(dof.allocate([1, 3, 0.5, 4, 0.5, 0.5, 0.5, 0.5], 4),
                                                        (2, 4)).tolist() == [[3, 9, 2, 12], [2, 2, 1, 1]]


def test_synthetic_kernel_error_is_that_of_the_plain_prf_estimate():
    """bench/heads.py's synthetic check, Gaussian draws: x = s N(0, I) from seed 0, M = round(N_lam), z from
    seed draw, K^ = phi phi^T / M with phi = exp(z.x~ - |x~|^2 / 2) (E K^ = K = exp(x x^T / sqrt d)); the error is
    |K^ - K|_F / |K|_F, written out."""
    heads = load_script("bench/heads.py")
    res = heads.synthetic(types.SimpleNamespace(lam=1e-3), J=16, d=4, draws=2)
    for row in res["rows"]:
        x = row["scale"] * torch.randn(16, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        K, xt = (x @ x.T / 2).exp(), x / 4 ** 0.25
        assert row["M"] == max(1, round(float(dof.degrees_of_freedom(x[None], 1e-3, relative=True)[0])))
        for draw, got in enumerate(row["gaussian"]["errors"]):
            z = torch.randn(row["M"], 4, generator=torch.Generator().manual_seed(draw), dtype=torch.float64)
            phi = (xt @ z.T - xt.square().sum(-1, keepdim=True) / 2).exp()
            assert got == pytest.approx(float((phi @ phi.T / row["M"] - K).norm() / K.norm()), rel=1e-9)


def test_synthetic_table_counts_only_draws_where_leverage_is_strictly_lower():
    """bench/heads.py's synthetic table: "leverage lower" counts the draws where leverage's error is below the
    Gaussian one's; a tie is not a win."""
    heads = load_script("bench/heads.py")
    m = lambda errors: {"kernel_error": float(np.mean(errors)), "kernel_error_median": float(np.median(errors)),
                        "kl": 0.5, "errors": errors, "kls": [0.5, 0.5, 0.5]}
    res = {"rows": [{"scale": 1.0, "dof": 2.0, "M": 2, "gaussian": m([1.0, 2.0, 3.0]), "leverage": m([1.0, 1.0, 4.0])}],
           "settings": {"J": 8, "d": 2, "draws": 3, "lam": 1e-3, "pool": 16}}
    row = heads.synthetic_table(res).splitlines()[2]
    assert row.split(" | ")[4] == "1 of 3" and row.endswith("| 0 of 3 |"), row


def test_window_cost_measures_mass_decoding_and_forward_and_tabulates_them(setup, tmp_path, capsys):
    """bench/window_cost.py on the tiny GPT-2: the teacher's mass in the last 16 and 40 keys (rising with W, at most
    1) and on the first token; decoding through each model's cache, whose bytes per sequence are the KV cache's 2 L
    Hkv (ctx + steps) D floats, the state's L H M (D + 1), the linear one's L H M (D + 1) and, beside the state, the
    ring buffer's 2 L Hkv W D; the forward table at each T."""
    d, ckpt, data = setup
    cost = load_script("bench/window_cost.py")
    out = tmp_path / "cost.json"
    cost.main(["--model", str(ckpt), "--data", str(data), "--W", "16", "40", "--block-size", "96", "--windows", "2",
               "--budget", "4", "--batch", "2", "--ctx", "32", "64", "--steps", "2", "--T", "64", "100",
               "--repeats", "1", "--out", str(out)])
    res = json.loads(out.read_text())
    for row in res["mass"]:
        assert 0 < row["W=16"] < row["W=40"] <= 1 + 1e-6 and 0 < row["first"] < 1
    L, H, D = 4, 4, 16                                     # make_gpt2's shape
    mib = {name: [r["mib_per_sequence"] * 2 ** 20 for r in rows] for name, rows in res["decode"].items()}
    assert mib["teacher"] == [2 * L * H * (ctx + 2) * D * 4 for ctx in (32, 64)]
    assert mib["linear"] == [L * H * 4 * (D + 1) * 4] * 2
    assert mib["hybrid"] == [L * H * 4 * (D + 1) * 4 + 2 * L * H * 40 * D * 4] * 2
    assert [r["T"] for r in res["forward"]["hybrid"]] == [64, 100]
    tables = cost.tables(res)
    assert list(tables) == ["mass", "decode", "forward"] and "| 64 |" in tables["decode"]
    assert "wrote" in capsys.readouterr().out


def test_the_instruments_refuse_an_output_that_is_the_users_before_any_work(setup, tmp_path):
    """long_context.py's and window_cost.py's --out is checked before the work: a folder, the token file they read
    (each had been replaced at the end: val.bin by JSON); the committed numbers of window_cost.py, heads.py and
    allocation.py --predict are replaced only by a run of the settings they record (another model's or --lam's had
    replaced them); gpu_check.py's --work-dir that holds files it did not write (it had deleted the user's folders
    of the names it uses)."""
    import allocation  # bench/allocation.py
    import gpu_check
    import heads
    import long_context
    d, ckpt, data = setup
    cost = load_script("bench/window_cost.py")
    (tmp_path / "folder").mkdir()
    (tmp_path / "work" / "gpt2-softmax").mkdir(parents=True)
    (tmp_path / "work" / "gpt2-softmax" / "notes.txt").write_text("mine")
    committed, kl = ROOT / cost.COMMITTED, ROOT / "docs" / "results" / "heads-kl"
    predictors = ROOT / "docs" / "results" / "allocation" / "predictors-s0.json"
    disk = {p: p.read_bytes() for p in (data / "val.bin", committed, predictors, *kl.iterdir())}
    long_flags = ["--model", ckpt, "--data", data / "val.bin", "--tokens", 300, "--contexts", "32", "--out"]
    cost_flags = ["--model", ckpt, "--data", data, "--what", "mass", "--W", "16", "--windows", "1", "--out"]
    cases = [(long_context.main, [*long_flags, data / "val.bin"], r"--out \S+ would replace a file this run reads"),
             (long_context.main, [*long_flags, tmp_path / "folder"], r"cannot write \S+folder: it is a directory"),
             (cost.main, [*cost_flags, data / "val.bin"], r"--out \S+ is the val.bin this run reads"),
             (cost.main, [*cost_flags, committed], rf"--out \S+ holds the committed numbers of a run with --model "
                                                   rf"smollm2-135m, not {ckpt}; pass another --out$"),
             (heads.main, ["--synthetic", "--lam", "0.5", "--out", kl],
              r"--out \S+ holds the committed numbers of a run with --lam 0.001, not 0.5; pass another --out$"),
             (allocation.main, distill_args(ckpt, data, tmp_path / "run", "--predict", predictors),
              rf"--predict \S+ holds the committed predictors of a run with --model smollm2-135m, not {ckpt}; "),
             (gpu_check.main, ["--tiny", "--device", "cpu", "--out", tmp_path / "c.json", "--work-dir",
                               tmp_path / "work"], r"--work-dir \S+ holds files that gpu_check.py did not write")]
    for main, flags, sentence in cases:
        with pytest.raises(door.ModelError, match=sentence):
            main([str(a) for a in flags])
    assert {p: p.read_bytes() for p in disk} == disk
    for config, out in ((heads.HeadsConfig, kl), (cost.CostConfig, committed)):     # the defaults: the committed run's
        assert door.parse_config(config, ["--out", str(out)]).out == str(out)
    assert (tmp_path / "work" / "gpt2-softmax" / "notes.txt").read_text() == "mine"
    (tmp_path / "work" / gpu_check.WORK_MARK).touch()                        # a folder an earlier check wrote
    assert door.parse_config(gpu_check.CheckConfig, ["--work-dir", str(tmp_path / "work")]).work_dir


def test_long_context_scores_the_teacher_a_window_and_a_student_and_tabulates_them(setup, tmp_path):
    """bench/long_context.py: the teacher's loss at each window length, the untrained window's beside it (its cache
    bytes, (S + W) tokens a layer), a window.py student opened through the fork its config.json names (its loss the
    in-process student's); the table a row a model, the gaps the differences."""
    import long_context
    import window
    d, ckpt, data = setup
    out = tmp_path / "win"
    r = cli("experiments/window.py", "--window", 8, "--sinks", 2, "--model", ckpt, "--data", data, "--budget", 6,
            "--max-steps", 2, "--out-dir", out, "--device", "cpu", "--eval-iters", 1, "--calib-batches", 1,
            "--J", 64, "--batch-size", 2, "--block-size", 64)
    assert r.returncode == 0, r.stderr[-3000:]
    flags = ["--model", ckpt, "--data", data / "val.bin", "--tokens", 300, "--contexts", "32,64", "--passkey", 80,
             "--passkey-trials", 2]
    records = []
    for what in ("teacher", "window:8:2", out):
        long_context.main([str(a) for a in [*flags, "--what", what, "--out", tmp_path / "r.json"]])
        records.append(json.loads((tmp_path / "r.json").read_text()))
    teacher, baseline, student = records
    c = model.GPT.from_pretrained(ckpt).config
    assert baseline["cache_bytes"] == c.n_layer * 10 * 2 * c.n_kv_head * c.head_dim * 4 and teacher["cache_bytes"] is None
    assert student["window"] == 8 and student["sinks"] == 2 and set(student["passkey"]) == {"80"}
    tokens = np.fromfile(data / "val.bin", dtype=np.uint16)[:300].astype(np.int64)
    with forks.replaced({**window.REPLACE, (forks, "FORK"): "experiments/window.py"}):
        net = tasks.load_student(out)[0]
    assert student["loss"]["64"] == pytest.approx(evaluate.perplexity(net, tokens, 64)["loss"], rel=1e-6)
    table = long_context.tables(records)["gap"].splitlines()
    assert len(table) == 2 + 3 + 2 and f"{student['loss']['32'] - teacher['loss']['32']:+.3f}" in table[-3]
    twin = {**student, "seed": 1, "loss": {T: v + 0.01 for T, v in student["loss"].items()}}   # a second seed
    row = long_context.tables(records + [twin])["gap"].splitlines()[-3]
    gaps = [student["loss"]["32"] - teacher["loss"]["32"] + x for x in (0, 0.01)]
    assert f"| {np.mean(gaps):+.3f} ± {np.std(gaps, ddof=1):.3f} |" in row and f"| {student['seed']}, 1 |" in row
