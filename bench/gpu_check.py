"""
One prepared GPU check, in one run of about seven minutes on one GPU with no network:

    python bench/gpu_check.py --out gpu_check.json                           # one H200: the paper's shapes
    python bench/gpu_check.py --device cpu --tiny --out /tmp/gpu_check.json  # tiny shapes: a CPU smoke test

Every model is built here with random weights (config.json + model.safetensors in the checkpoint's own key names,
the tokenizer files of tests/data beside them) and every token is random, so nothing is downloaded. Sections:

  distill  `distill.py --alloc fix --budget 64 --loss L` on a GPT-2-124M shape, L = softmax, l2, direct, and the
           per-head fork (experiments/per_head.py), for --steps steps at --batch-size x --block-size in bf16, each in
           a fresh process (its own peak memory and timeout, forked from a server that has imported torch once);
           then softmax at budget 128 on a Pythia-1B shape at --pythia-batch-size, if time is left. ms/step: the
           median of distill.py's log intervals after the first (the warm-up); ms/sample: per 1024-token sample;
           peak: torch.cuda.max_memory_allocated (on the CPU: max RSS).
  ops      aten ops and ms of one training step per loss at the GPT-2 shape, 1 x --block-size tokens, and of the
           per-head fork's (bench/bench.py's step_row).
  scan     PRF features + model.causal_linear_attention, and FLA's chunk kernel on CUDA when flash-linear-attention
           is installed, against F.scaled_dot_product_attention(is_causal=True) (the flash kernel on CUDA); B = 1,
           H = 12, D = M = 64, bf16 inputs, forward and forward+backward, the median of --repeats calls ("oom" where
           memory runs out). The linear path computes in fp32 from the bf16 inputs, as the model does. FLA's output
           is also compared with ours (relative error).
  decode   ms per generated token after a prefill of ctx tokens, Pythia-160M shape in bf16: the KV cache (softmax)
           against the fixed linear state (M = 64), as bench.py's decode table; then each replayed as one CUDA
           graph a token (bench/graphed_decode.py; on the CPU its step runs eagerly), and again with the step
           torch.compile'd first (the first row compiles), each with the largest logit difference from
           model.Cache's decoding of the same tokens over the largest logit.
  dof      dof.degrees_of_freedom on a random (12, 12, J, 64) input on --device (and one layer on the CPU).

Sections run in order of importance; each checks the --budget-seconds deadline first. distill, scan, decode and dof
record "skipped" where a row would overrun and "error" with its message for a crash on the device; ops stops there,
and its crash is raised. The results print as one markdown table, with the targets under it unless --tiny
(targets()), and go to --out as JSON.
"""

import importlib
import importlib.util
import json
import multiprocessing
import multiprocessing.forkserver
import os
import re
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "experiments")]   # the core, and its forks (fla_scan, per_head)
import devices  # noqa: E402
import dof  # noqa: E402
import door  # noqa: E402
import files  # noqa: E402
import forks  # noqa: E402
from bench import decode_ms, graphed_ms  # noqa: E402
from checkpoint import checkpoint_sources, config_from_hf  # noqa: E402
from fla_scan import fla_linear_attention  # noqa: E402
from model import GPT, PRF, GPTConfig, causal_linear_attention  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

TOKENIZERS = ROOT / "tests" / "data"
WORK_MARK = "gpu_check.work"    # in a --work-dir: what is there is this script's


@dataclass
class CheckConfig(door.Config):
    """Distillation speed and memory, the scan against flash attention, decoding and the DoF profile on one GPU,
    on random-weight models of the paper's shapes."""
    out: str = door.opt("gpu_check.json", "where to write the results (JSON)")
    device: str = door.opt("cuda", "cuda, cuda:N or cpu")
    tiny: bool = door.opt(False, "tiny shapes and sizes (a smoke test on the CPU); overrides the size flags below")
    budget_seconds: float = door.opt(420.0, "deadline of the whole check; what would overrun it is skipped", above=0)
    work_dir: str = door.opt("", "where the random checkpoints and tokens go (default: a temporary directory, removed)")
    steps: int = door.opt(30, "optimizer steps per distillation run", min=1)
    batch_size: int = door.opt(8, "samples per distillation step on the GPT-2 shape", min=1)
    block_size: int = door.opt(1024, "tokens per distillation sample", min=1)
    pythia_batch_size: int = door.opt(4, "samples per distillation step on the Pythia-1B shape", min=1)
    distill_timeout: float = door.opt(100.0, "seconds one distillation run may take", above=0)
    scan_T: list[int] = door.opt([1024, 2048, 4096, 8192, 16384, 32768, 65536], "sequence lengths of the scan rows")
    decode_ctx: list[int] = door.opt([1024, 4096, 16384, 32768], "context lengths of the decoding rows")
    decode_steps: int = door.opt(32, "tokens decoded per context length (the mean is reported)", min=1)
    J: int = door.opt(2048, "points per head of the DoF profile", min=1)
    repeats: int = door.opt(5, "timed calls per scan measurement (the median is reported)", min=1)

    def __post_init__(self):
        super().__post_init__()
        if self.block_size > GPT2_124M["n_positions"]:             # the GPT-2 rows: its learned positions
            raise door.ModelError(f"--block-size {self.block_size} is more than GPT-2's {GPT2_124M['n_positions']} learned "
                             "positions, which its distillation and ops rows use; pass at most that")
        if any(v < 1 for v in self.scan_T + self.decode_ctx):
            raise door.ModelError(f"--scan-T and --decode-ctx must list numbers of at least 1, got {self.scan_T} and "
                             f"{self.decode_ctx}")
        files.check_out(self.out, file=True)                            # before the run, not after it
        if self.work_dir:
            files.check_out(self.work_dir, flag="--work-dir")
            work = Path(self.work_dir)
            if work.is_dir() and any(work.iterdir()) and not (work / WORK_MARK).is_file():
                raise door.ModelError(f"--work-dir {self.work_dir} holds files that gpu_check.py did not "
                                      "write, and it deletes its own there; pass an empty or new folder")


TINY = dict(steps=4, batch_size=2, block_size=64, pythia_batch_size=1, scan_T=[64, 256], decode_ctx=[16, 64],
            decode_steps=4, J=64, repeats=2)

# The models, as the config.json a Hugging Face checkpoint carries; --tiny keeps their kind and vocabulary.
GPT2_124M = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
             "n_head": 12}
PYTHIA_1B = {"model_type": "gpt_neox", "vocab_size": 50304, "hidden_size": 2048, "num_hidden_layers": 16,
             "num_attention_heads": 8, "intermediate_size": 8192, "max_position_embeddings": 2048,
             "rotary_pct": 0.25, "rotary_emb_base": 10000, "use_parallel_residual": True, "layer_norm_eps": 1e-5,
             "tie_word_embeddings": False}
PYTHIA_160M = dict(PYTHIA_1B, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
SHAPES = {"gpt2": GPT2_124M, "pythia": PYTHIA_1B, "decode": PYTHIA_160M}
TINY_SHAPES = {"gpt2": dict(GPT2_124M, n_embd=32, n_layer=2, n_head=2),
               "pythia": dict(PYTHIA_1B, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=256),
               "decode": dict(PYTHIA_1B, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=128)}
# tokenizer files copied into each checkpoint (source in tests/data -> name load_tokenizer looks for)
TOKENIZER_FILES = {"gpt2": {"gpt2-tokenizer/encoder.json": "encoder.json", "gpt2-tokenizer/vocab.bpe": "vocab.bpe"},
                   "pythia": {"gpt-neox-20b-tokenizer/20B_tokenizer.json": "tokenizer.json"}}
BUDGET = {"gpt2": 64, "pythia": 128}   # the paper's feature budgets C; the scan and decoding use 64
PROBE = "Random tokens for gpu_check.py: 1, 2, 3."


# ----------------------------------------------------------------------------------------------------------------
# Random checkpoints and tokens

def random_checkpoint(path, hf_config, tokenizer_files, device, seed=0):
    """A checkpoint directory of random weights that GPT.from_pretrained and load_tokenizer read: config.json,
    model.safetensors (fp16; matrices N(0, 0.02), norm weights 1, biases 0) under the names
    checkpoint.checkpoint_sources reads, and the tokenizer files. Drawn on `device`, which is fast for 1B weights."""
    path.mkdir(parents=True)
    cfg = GPTConfig(**config_from_hf(hf_config))
    with torch.device("meta"):
        ours = GPT(cfg).state_dict()
    gen = torch.Generator(device).manual_seed(seed)
    sd = {}
    for key, (src, join) in checkpoint_sources(cfg).items():
        (name,) = src                                                    # one source tensor per key (gpt2, neox)
        shape = ours[key].shape
        if name in sd:                                                   # a tied lm_head
            continue
        if join(torch.empty(shape, device="meta")).shape != shape:       # GPT-2's Conv1D stores (in, out)
            shape = shape[::-1]
        if len(shape) == 2:
            w = torch.randn(shape, generator=gen, device=device) * 0.02
        else:
            w = torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
        sd[name] = w.to(torch.float16).cpu().contiguous()
    save_file(sd, str(path / "model.safetensors"))
    for src, dst in tokenizer_files.items():
        if not (TOKENIZERS / src).is_file():
            raise door.ModelError(f"{TOKENIZERS / src} is missing; the check needs the tokenizer files in tests/data")
        shutil.copy(TOKENIZERS / src, path / dst)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")      # last: the checkpoint is whole
    return path


def random_tokens(path, ckpt, block_size, seed=0):
    """A token directory as data/text/prepare.py writes it (train.bin, val.bin: uint16; meta.json with the
    tokenizer's probe, which distill.py checks against the teacher's tokenizer), holding random tokens."""
    path.mkdir(parents=True)
    enc = load_tokenizer(ckpt)
    rng = np.random.default_rng(seed)
    sizes = token_sizes(block_size)
    for split, n in sizes.items():
        rng.integers(0, enc.n_vocab, n).astype(np.uint16).tofile(path / f"{split}.bin")
    meta = {"tokenizer": {"model": str(ckpt), "name": enc.name, "n_vocab": enc.n_vocab, "probe": PROBE,
                          "probe_ids": enc.encode_ordinary(PROBE)},
            "dtype": "uint16", "tokens": sizes, "source": "random tokens (gpu_check.py)"}
    (path / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")             # last: the tokens are whole
    return path


def token_sizes(block_size):
    return {"train": 256 * block_size + 2, "val": 8 * block_size + 2}


def built(ckpt, tokens, hf_config, block_size):
    """Whether `ckpt` and `tokens` are whole and of this shape and block size: a --work-dir may hold another run's
    (--tiny, say), or a build that was stopped."""
    try:
        meta = json.loads((tokens / "meta.json").read_text())
        return json.loads((ckpt / "config.json").read_text()) == hf_config and meta["tokens"] == token_sizes(block_size)
    except (OSError, ValueError, KeyError, TypeError):
        return False


# ----------------------------------------------------------------------------------------------------------------
# Distillation: distill.py in a fresh process

def distill_child(flags, device, log, script="distill"):
    """One distillation process, forked from a server that has imported distill.py already: distill.main(flags),
    or a fork's (its REPLACE set, as `python experiments/<script>.py flags` runs), with its output in the file `log`,
    then its peak memory (torch.cuda.max_memory_allocated; on the CPU, max RSS)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)
    script = importlib.import_module(script)                    # distill, or the per_head fork of it
    if hasattr(script, "REPLACE"):
        forks.fork(script.__file__, script.REPLACE, flags)
    else:
        door.run_main(lambda: script.main(flags))
    print("PEAK_BYTES", torch.cuda.max_memory_allocated(device) if device.startswith("cuda") else
          resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def start_forkserver(preload):
    """The forkserver context (a fresh process each run, without re-importing torch), its server started once with
    SIGINT ignored, as it keeps it: a Ctrl-C while it imports `preload` is no traceback of its own. Its children take
    Ctrl-C again through run_main."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, old)
    return ctx


def distill_run(cfg, work, kind, loss, batch, device, left):
    """One `distill.py` run -> its record: ms/step (the median of the log intervals after the first), ms per
    1024-token sample, peak memory in MiB, wall seconds; "timeout" keeps the intervals logged before it."""
    name, is_per_head = kind.split("-")[0], kind.endswith("per-head")            # gpt2-per-head: the fork
    ckpt, data, out = work / f"{name}-checkpoint", work / f"{name}-tokens", work / f"{kind}-{loss}"
    shutil.rmtree(out, ignore_errors=True)
    flags = ["--model", str(ckpt), "--data", str(data), "--out-dir", str(out), "--alloc",
             "dof" if is_per_head else "fix", "--J", str(cfg.J), "--budget", str(BUDGET[name]), "--loss", loss,
             "--batch-size", str(batch),
             "--block-size", str(cfg.block_size), "--max-steps", str(cfg.steps),
             "--log-interval", str(max(1, cfg.steps // 6)), "--eval-iters", "1", "--calib-batches", "1",
             "--device", device, "--dtype", "bfloat16"]
    rec = {"model": kind, "loss": loss, "batch": batch, "block": cfg.block_size, "steps": cfg.steps,
           "command": f"python {'experiments/per_head.py' if is_per_head else 'distill.py'} " +
                      " ".join(flags).replace(str(work), "<work>")}          # the check's scratch folder
    ctx = start_forkserver(["distill", "torch._dynamo"])   # GPT() on the meta device imports torch._dynamo
    t0 = time.perf_counter()
    p = ctx.Process(target=distill_child, args=(flags, device, work / "distill.log",
                                                  "per_head" if is_per_head else "distill"))
    p.start()
    try:
        p.join(min(cfg.distill_timeout, left - 5))
        rec["status"] = "timeout" if p.is_alive() else "error" if p.exitcode else "ok"
    finally:                                             # Ctrl-C or SIGTERM here too: no run left behind
        p.terminate()                                    # its run_main stops it, releasing its semaphores (tqdm's)
        p.join(3)
        p.kill()
        p.join()
    log = (work / "distill.log").read_text(errors="replace")
    if rec["status"] == "error":
        rec["error"] = ([l for l in log.splitlines() if l.strip()] or ["(no message)"])[-1]
    rec["wall_s"] = time.perf_counter() - t0
    ms = [float(m) for m in re.findall(r"step \d+/\d+ \|[^\r\n]*\| ([\d.]+) ms/step", log)]
    if ms:
        rec["ms_per_step"] = statistics.median(ms[1:] or ms)
        rec["ms_per_sample"] = rec["ms_per_step"] * 1024 / (batch * cfg.block_size)
    peak = re.search(r"PEAK_BYTES (\d+)", log)
    if peak:
        rec["peak_mib"] = int(peak.group(1)) / 2 ** 20
    return rec


def distill_section(cfg, shapes, work, device, left, runs):
    """The (kind, loss) runs in order, each building its checkpoint and tokens when first needed; a run starts
    only with 20 s left (60 s for Pythia-1B, which builds 1B weights first)."""
    out = []
    for kind, loss in runs:
        name = kind.split("-")[0]
        batch = cfg.batch_size if name == "gpt2" else cfg.pythia_batch_size
        ckpt, tokens = work / f"{name}-checkpoint", work / f"{name}-tokens"
        have = built(ckpt, tokens, shapes[name], cfg.block_size)
        need = 60 if name == "pythia" and not have else 20
        if left() < need:
            out.append({"model": kind, "loss": loss, "batch": batch, "status": "skipped",
                        "reason": f"{left():.0f} s left of --budget-seconds"})
            continue
        try:
            if not have:                                        # built again, not another shape's reused
                shutil.rmtree(ckpt, ignore_errors=True)
                shutil.rmtree(tokens, ignore_errors=True)
                random_checkpoint(ckpt, shapes[name], TOKENIZER_FILES[name], device)
                random_tokens(tokens, ckpt, cfg.block_size)
            out.append(distill_run(cfg, work, kind, loss, batch, device, left()))
        except (door.ModelError, RuntimeError, OSError) as e:
            out.append({"model": kind, "loss": loss, "batch": batch, "status": "error", "error": str(e)})
    return out


# ----------------------------------------------------------------------------------------------------------------
# The scan against flash attention, decoding, the DoF profile

def time_ms(fn, device, repeats):
    """Median wall ms of `repeats` calls of fn after one warm-up call, the device synchronised around each."""
    fn()
    devices.sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        devices.sync(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def scan_row(T, H, D, M, device, repeats):
    """ms of linear attention (PRF features + chunked scan) and of causal SDPA at length T, forward and
    forward+backward (gradients of q, k, v); bf16 inputs (B = 1, H, T, D). "oom" where memory runs out."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, T, D, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    fm = PRF(H, D, M).to(device)
    fns = {"linear": lambda: causal_linear_attention(fm(q, True), fm(k, False), v, chunk_size=64),
           "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    if torch.device(device).type == "cuda" and importlib.util.find_spec("fla"):       # carried: see the docstring
        fns["fla"] = lambda: fla_linear_attention(fm(q, True), fm(k, False), v)
    flash = torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION) \
        if torch.device(device).type == "cuda" else nullcontext()  # the CPU: whichever kernel torch picks
    row = {"T": T}
    with flash:
        for name, fn in fns.items():
            backward = lambda: torch.autograd.grad(fn().sum(), (q, k, v))
            for mode, call in (("fwd", fn), ("fwd_bwd", backward)):
                try:
                    with torch.set_grad_enabled(mode == "fwd_bwd"):
                        row[f"{name}_{mode}_ms"] = time_ms(call, device, repeats)
                except torch.cuda.OutOfMemoryError:
                    row[f"{name}_{mode}_ms"] = "oom"
                    torch.cuda.empty_cache()
                except RuntimeError as e:                            # e.g. no flash kernel for this GPU
                    row[f"{name}_{mode}_ms"] = f"error: {str(e).splitlines()[0]}"
    if "fla" in fns:                                  # FLA's output against ours (its fp32 products may be TF32)
        try:
            with torch.no_grad():
                ours = fns["linear"]().double()
                row["fla_rel_err"] = ((fns["fla"]().double() - ours).norm() / ours.norm()).item()
        except RuntimeError as e:
            row["fla_rel_err"] = f"error: {str(e).splitlines()[0]}"
    return row


def dof_profile(shape, J, device):
    """dof.degrees_of_freedom on a random (L, H, J, D) input on `device` (lambda 2^-4): ms, mean and max DoF;
    off the CPU also one layer on the CPU, times L, for comparison. An error is recorded, not raised."""
    L, H, D = shape["n_layer"], shape["n_head"], shape["n_embd"] // shape["n_head"]
    x = torch.randn(L, H, J, D, generator=torch.Generator().manual_seed(0))     # (L, H, J, D)
    rec = {"shape": [L, H, J, D], "lam": 2 ** -4}
    try:
        xd = x.to(device)
        devices.sync(device)
        t0 = time.perf_counter()
        N = dof.degrees_of_freedom(xd, 2 ** -4)                       # (L, H)
        devices.sync(device)
        rec.update(status="ok", ms=1e3 * (time.perf_counter() - t0), mean_dof=N.mean().item(), max_dof=N.max().item())
    except Exception as e:                                           # a crash on the device is a finding
        rec.update(status="error", error=crash(e))
    if torch.device(device).type != "cpu":
        t0 = time.perf_counter()
        dof.degrees_of_freedom(x[0], 2 ** -4)
        rec["cpu_ms"] = 1e3 * (time.perf_counter() - t0) * L
    return rec


def ops_section(cfg, shapes, device, left):
    """Aten ops and ms of one training step per loss at the GPT-2 shape (bench.step_row), and of the per-head
    fork's softmax step; stops, recording nothing more, with under 60 s left."""
    import distill
    import per_head
    from bench import step_row
    config = GPTConfig(**config_from_hf(shapes["gpt2"]))
    out = []
    for loss, variant in (("softmax", None), ("l2", None), ("direct", None), ("softmax", per_head)):
        if left() < 60:
            break
        row = step_row(distill, loss, cfg.block_size, BUDGET["gpt2"], cfg.repeats, device, config, variant)
        out.append({"model": "gpt2-per-head" if variant else "gpt2", **row})
    return out


def crash(e):
    """What a row records of an exception raised on the device: its type and the first line of its message."""
    return f"{type(e).__name__}: {e}".splitlines()[0]


def rows_until(deadline_left, values, measure, key):
    """measure(v) for each v in order while the time left exceeds 4x the last row's time (the next row may be
    4x longer: T doubles, SDPA is quadratic), the first row's not counted (it compiles kernels and builds models
    once); later rows are recorded as skipped, a row that raises as error."""
    out, last = [], 0.0
    for i, v in enumerate(values):
        if deadline_left() < max(5.0, 4 * last):
            out.append({key: v, "status": "skipped", "reason": f"{deadline_left():.0f} s left of --budget-seconds"})
            continue
        t0 = time.perf_counter()
        try:
            out.append({key: v, "status": "ok", **measure(v)})
        except Exception as e:                                       # a crash on the device is a finding: go on
            out.append({key: v, "status": "error", "reason": crash(e)})
        elapsed = time.perf_counter() - t0
        last = elapsed if i else 0.0                                 # the first row's one-time work: no estimate
    return out


# how decode rows name GraphedDecoder's two forms: (on CUDA, on the CPU where its step runs eagerly)
GRAPHED = {"graph": ("one graph a token", "the graph's step run eagerly"),
           "compiled": ("one compiled graph a token", "the compiled step run eagerly")}


def decode_section(cfg, shape, device, left):
    """Per-token decoding of one random model in bf16, softmax and linearised (M = 64), built for the first row."""
    models = []

    def measure(ctx):
        if not models:
            torch.manual_seed(0)
            softmax = GPT(GPTConfig(**config_from_hf(shape))).to(device=device, dtype=torch.bfloat16).eval()
            models.extend([softmax, softmax.linearize([BUDGET["gpt2"]] * softmax.config.n_layer)])
        row = {"kv_cache_ms": decode_ms(models[0], ctx, cfg.decode_steps, device),
               "linear_state_ms": decode_ms(models[1], ctx, cfg.decode_steps, device)}
        for kind in GRAPHED:                                       # a graph that fails keeps the row's other times
            try:
                for name, gpt in zip(("kv_cache", "linear_state"), models):
                    row[f"{name}_{kind}_ms"], row[f"{name}_{kind}_err"] = graphed_ms(gpt, ctx, cfg.decode_steps,
                                                                                   device, kind == "compiled")
            except Exception as e:
                row = {k: v for k, v in row.items() if f"_{kind}_" not in k}
                row[f"{kind}_error"] = crash(e)
        return {**row, "graphed": device.startswith("cuda")}
    return rows_until(left, cfg.decode_ctx, measure, "ctx")


# ----------------------------------------------------------------------------------------------------------------
# Report

def fmt(x, unit=" ms"):
    return f"{x:.2f}{unit}" if isinstance(x, float) else str(x)


def distill_cell(r):
    got = ", ".join(fmt(r[k], u) for k, u in (("ms_per_step", " ms/step"), ("ms_per_sample", " ms/sample"),
                                              ("peak_mib", " MiB peak")) if k in r)
    return got if r["status"] == "ok" else f"{r['status']}: {r.get('error', r.get('reason'))}" + \
        (f" ({got})" if got else "")


def scan_cell(r):
    if r["status"] != "ok":
        return f"{r['status']} ({r['reason']})"
    cells = []
    for m in ("fwd", "fwd_bwd"):
        sdpa, cell = r[f"sdpa_{m}_ms"], []
        for name in ("linear", "fla"):
            t = r.get(f"{name}_{m}_ms")
            speed = f" ({sdpa / t:.3g}x)" if isinstance(t, float) and isinstance(sdpa, float) else ""
            cell += [f"{name} {fmt(t)}{speed}"] if t is not None else []
        cells.append(f"{m}: SDPA {fmt(sdpa)}, " + ", ".join(cell))
    if "fla_rel_err" in r:
        err = r["fla_rel_err"]
        cells.append(f"FLA against ours: relative error {err:.1e}" if isinstance(err, float) else f"FLA: {err}")
    return "; ".join(cells)


def decode_cell(r):
    if r["status"] != "ok":
        return f"{r['status']} ({r['reason']})"
    no_cudnn = f" ({fmt(r['kv_no_cudnn_ms'])} without cuDNN's SDPA)" if "kv_no_cudnn_ms" in r else ""  # h200-cudnn.json
    cell = f"KV cache {fmt(r['kv_cache_ms'])}/token{no_cudnn}, linear state {fmt(r['linear_state_ms'])}/token"
    for kind, (graphed, eager) in GRAPHED.items():
        if f"{kind}_error" in r:
            cell += f"; {graphed}: error ({r[f'{kind}_error']})"
        elif f"linear_state_{kind}_ms" in r:
            cell += f"; {graphed if r['graphed'] else eager}: " + ", ".join(
                f"{name} {fmt(r[f'{key}_{kind}_ms'])}/token (logits within {r[f'{key}_{kind}_err']:.0e})"
                for name, key in (("KV cache", "kv_cache"), ("linear state", "linear_state")))
    return cell


def dof_cell(d):
    got = f"{fmt(d['ms'])} (mean DoF {d['mean_dof']:.1f}, max {d['max_dof']:.1f})" if d["status"] == "ok" else \
        f"{d['status']}: {d.get('error', d.get('reason'))}"
    return got + (f"; CPU {fmt(d['cpu_ms'])} (one layer timed, times L)" if "cpu_ms" in d else "")


def table(res):
    """One markdown table: section | case | measurement."""
    T, d = res["settings"]["block_size"], res["dof"]
    rows = [("ops", f"{r['model']} {r['loss']} step, 1x{T}", f"{r['ops']} aten ops, {fmt(r['ms'])}/step")
            for r in res.get("ops", [])]
    rows += [("distill", f"{r['model']} {r['loss']}, {r['batch']}x{T} bf16", distill_cell(r)) for r in res["distill"]]
    rows += [("scan", f"T={r['T']}", scan_cell(r)) for r in res["scan"]]
    rows += [("decode", f"ctx={r['ctx']}", decode_cell(r)) for r in res["decode"]]
    rows += [("dof", f"{d['shape'][0]}x{d['shape'][1]} heads, J={d['shape'][2]}", dof_cell(d))]
    lines = ["| section | case | measurement |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def targets(res):
    """The numbers to reach: softmax distillation of the GPT-2 shape <= 5 ms per 1024-token sample and no slower than
    the direct loss; decoding <= 3 ms per token from 1k to 32k of context; the scan (ours or FLA's) faster than flash
    SDPA from 4k tokens on, forward; a softmax step in no more aten ops than a direct one."""
    out, met = [], lambda ok: "met" if ok else "MISSED"
    run = {(r["model"], r["loss"]): r for r in res["distill"]}
    soft, direct = run.get(("gpt2", "softmax"), {}), run.get(("gpt2", "direct"), {})
    if "ms_per_sample" in soft:
        out.append(f"target softmax distillation <= 5 ms/sample: {met(soft['ms_per_sample'] <= 5)} "
                   f"({soft['ms_per_sample']:.1f})")
    if "ms_per_sample" in soft and "ms_per_sample" in direct:
        out.append(f"target softmax no slower than direct: {met(soft['ms_per_sample'] <= direct['ms_per_sample'])} "
                   f"({soft['ms_per_sample']:.1f} against {direct['ms_per_sample']:.1f} ms/sample)")
    dec = [r for r in res["decode"] if r["status"] == "ok"]
    if dec:
        graphed = [(f" as {how}", f"_{kind}_ms") for kind, (how, _) in GRAPHED.items()
                   if all(f"linear_state_{kind}_ms" in r for r in dec)]
        for how, suffix in [("", "_ms")] + graphed:
            worst = max(max(r["kv_cache" + suffix], r["linear_state" + suffix]) for r in dec)
            out.append(f"target decoding{how} <= 3 ms/token at ctx {dec[0]['ctx']}..{dec[-1]['ctx']}: "
                       f"{met(worst <= 3)} (worst {worst:.2f})")
    long = [r for r in res["scan"] if r["status"] == "ok" and r["T"] >= 4096 and isinstance(r["sdpa_fwd_ms"], float)]
    if long:
        ok = all(min(t for t in (r["linear_fwd_ms"], r.get("fla_fwd_ms")) if isinstance(t, float)) < r["sdpa_fwd_ms"]
                 for r in long)
        out.append(f"target scan (ours or FLA's) faster than flash SDPA from 4k tokens (forward): {met(ok)}")
    ops = {r["loss"]: r["ops"] for r in res.get("ops", []) if r["model"] == "gpt2"}
    if "softmax" in ops and "direct" in ops:
        out.append(f"target softmax step in no more aten ops than direct: {met(ops['softmax'] <= ops['direct'])} "
                   f"({ops['softmax']} against {ops['direct']})")
    return out


def main(argv=None):
    cfg = door.parse_config(CheckConfig, argv)
    cfg = replace(cfg, **TINY) if cfg.tiny else cfg
    shapes = TINY_SHAPES if cfg.tiny else SHAPES
    device, _ = devices.pick_device(cfg.device, "bfloat16")
    end = time.monotonic() + cfg.budget_seconds
    left = lambda: end - time.monotonic()
    g = shapes["gpt2"]
    H, D = g["n_head"], g["n_embd"] // g["n_head"]
    res = {"settings": {**asdict(cfg), "device": device, "torch": torch.__version__,
                        "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else None}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(cfg.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        (work / WORK_MARK).touch()                  # its folders: a later check may replace them
        # in order of importance: what the numbers to reach need first, Pythia-1B if time is left
        res["distill"] = distill_section(cfg, shapes, work, device, left, [("gpt2", "softmax")])
        scan = lambda T: scan_row(T, H, D, BUDGET["gpt2"], device, cfg.repeats)
        res["scan"] = rows_until(left, cfg.scan_T, scan, "T")
        res["decode"] = decode_section(cfg, shapes["decode"], device, left)
        res["dof"] = dof_profile(g, cfg.J, device) if left() > 30 else \
            {"shape": [g["n_layer"], H, cfg.J, D], "status": "skipped", "reason": f"{left():.0f} s left"}
        res["distill"] += distill_section(cfg, shapes, work, device, left, [("gpt2", "l2"), ("gpt2", "direct"),
                                          ("gpt2-per-head", "softmax"), ("pythia", "softmax")])
        res["ops"] = ops_section(cfg, shapes, device, left)
    res["seconds"] = cfg.budget_seconds - left()
    print(table(res))
    if not cfg.tiny:
        print("\n".join(targets(res)))
    files.write_text_atomic(cfg.out, json.dumps(res, indent=1) + "\n")
    print(f"wrote {cfg.out} ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    door.run_main(main)
