"""
Distil a pretrained transformer's softmax attention into linear attention (the paper's GPT-2 setting by default):

    python data/wikipedia/prepare.py --model gpt2 --fraction 0.1
    python distill.py --model gpt2 --data data/wikipedia --budget 64 --loss softmax

teacher -> feature dims (dof.py, Algorithm 1, on calibration batches of train.bin) -> student (the teacher with
every attention core replaced by LinearAttention of its layer's dim; the two share every teacher weight, only the
feature maps train) -> training -> checkpoint -> summary.

Losses
  softmax  layerwise, teacher-forced: one frozen teacher forward pass (hooks on every layer's attention core) gives
           each layer's queries and keys; layer l's features are trained to make the student's normalised rows
           p^_i(j) = phi(q_i).phi(k_j) / sum_{j'<=i} phi(q_i).phi(k_j') match the teacher's causal softmax rows p_i
           in cross-entropy, averaged over heads and query positions. We report it as KL(p || p^) = CE - H(p)
           (same gradient; 0 means exact). The T x T rows are built block by block over --query-block queries and
           each block's gradient goes into the features' gradients at once, so memory is O(query_block * T), not T^2.
  l2       layerwise, teacher-forced: squared error between the kernel K(q_i, k_j) = exp(q_i.k_j / sqrt d) and the
           student's estimate K^ = Phi(q_i).Phi(k_j) over causal pairs. Real models have q.k / sqrt d of 30 and
           more, so each query row is divided by its largest teacher kernel value max_j K(q_i, k_j); the squared
           error is summed over keys and averaged over query rows (see l2_block).
  direct   next-token cross-entropy of the whole linearised model, end to end; only the feature maps train.

Layers are independent under the layerwise losses (each layer's features see only its own teacher queries and
keys), so one teacher pass serves all of them, and backpropagating each layer's loss on its own gives exactly the
gradients of their sum: they do not mix.

The checkpoint directory (written atomically: a temp directory renamed into place) holds features.safetensors (the
linear-attention cores' parameters and buffers, no teacher weight), config.json (teacher, dims, feature map, loss,
lambda, budget, step, data), optim.pt (optimizer, RNG states, step) and metrics.json (per-layer losses, validation).
`load_student(dir)` rebuilds the student from GPT.from_pretrained(teacher) and that directory.
"""

import json
import math
import os
import shutil
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from common import ModelError, config_parser, run_main
import dof
from model import GPT, repeat_kv
from tokenizer import load_tokenizer


# ----------------------------------------------------------------------------------------------------------------
# Configuration: the paper's GPT-2 setting. "(ours)" marks values we chose rather than took from the paper.

@dataclass
class DistillConfig:
    # teacher, data, output
    model: str = "gpt2"                # teacher: hub id, checkpoint directory or .gguf file
    data: str = "data/wikipedia"       # directory from data/*/prepare.py: train.bin, val.bin, meta.json
    out_dir: str = "out-distill"       # checkpoint directory
    # feature dimensions (dof.py, Algorithm 1)
    budget: int = 64                   # C: mean feature dimension over the layers (paper, GPT-2: 64)
    alloc: str = "dof"                 # dof | fix (M = C everywhere) | clip (DoF capped at head size) | reverse
    lam: float = 2 ** -4               # lambda of the degrees of freedom (paper, GPT-2: 2^-4; Pythia-1B: 2^-8)
    lam_relative: bool = False         # lambda as a fraction of tr(Sigma~): invariant to the kernel's scale (ours)
    J: int = 2048                      # queries+keys drawn per head for the DoF (ours: the paper does not say)
    calib_batches: int = 4             # calibration batches (batch_size x block_size tokens) from train.bin (ours)
    dims: str = ""                     # explicit comma-separated per-layer dims, overriding --alloc (ablations)
    # student
    feature_map: str = "prf"           # prf (learned positive random features, the paper's) | performer | dijiang
    chunk_size: int = 64               # chunk length of the causal linear-attention scan
    center_keys: bool = False          # subtract each head's mean calibration key before the feature map (ours)
    # training
    loss: str = "softmax"              # softmax | l2 (layerwise, teacher-forced) | direct (end-to-end next token)
    block_size: int = 1024             # tokens per training sample (paper, GPT-2: 1024); capped at the model's
    batch_size: int = 8                # samples per micro-batch (ours)
    grad_accum: int = 1                # micro-batches per optimizer step
    max_steps: int = 2000              # optimizer steps (ours)
    decay_steps: int = 0               # length of the cosine schedule, 0: max_steps (stop early + --resume later)
    warmup_steps: int = 100            # linear warm-up steps, at most a tenth of the schedule (ours)
    lr_z: float = 0.02                 # Adam learning rate of the feature directions z (paper)
    lr_alpha: float = 0.2              # Adam learning rate of the feature weights alpha (paper)
    min_lr_frac: float = 0.1           # the cosine schedule decays to this fraction of the peak (ours)
    query_block: int = 128             # queries per block of attention rows: memory O(query_block * T)
    # bookkeeping
    eval_interval: int = 250           # validate and checkpoint every this many steps (and at the start and end)
    eval_iters: int = 4                # validation batches (fixed, from val.bin; evaluate.py for more)
    log_interval: int = 10             # one log line every this many steps
    seed: int = 0                      # seeds calibration, feature init and batch sampling
    device: str = "auto"               # auto (cuda if available) | cpu | cuda | cuda:N
    dtype: str = "auto"                # auto (bf16 autocast on cuda, fp32 on cpu) | float32 | bfloat16
    resume: bool = False               # continue the checkpoint in out_dir
    overwrite: bool = False            # replace the checkpoint in out_dir (at the first save, not before)


CHOICES = {"alloc": ("dof", "fix", "clip", "reverse"), "feature_map": ("prf", "performer", "dijiang"),
           "loss": ("softmax", "l2", "direct"), "dtype": ("auto", "float32", "bfloat16")}
HELP = {
    "model": "teacher checkpoint: hub id (gpt2, EleutherAI/pythia-160m), local directory or .gguf file",
    "data": "token directory written by data/text/prepare.py or data/wikipedia/prepare.py",
    "out_dir": "checkpoint directory",
    "budget": "mean feature dimension C over the layers (the inference cost)",
    "alloc": "feature dims: dof (proportional to each layer's DoF), fix (C everywhere), clip (DoF capped at the "
             "head size), reverse (the DoF dims in reverse DoF order)",
    "lam": "lambda of the degrees of freedom N = tr(S (S + lambda I)^-1)",
    "lam_relative": "take lambda as a fraction of tr(S), which makes the DoF invariant to the kernel's scale",
    "J": "queries+keys drawn per head to estimate the DoF",
    "calib_batches": "calibration batches of train.bin for the DoF and the key means",
    "dims": "comma-separated feature dims, one per layer, instead of --alloc",
    "feature_map": "student feature map: prf (learned, the paper's), performer (fixed FAVOR+), dijiang (fixed DCT)",
    "chunk_size": "chunk length of the causal linear-attention scan",
    "center_keys": "subtract each head's mean key (from the calibration batches) before the feature map",
    "loss": "softmax/l2: layerwise teacher-forced attention losses; direct: next-token loss of the whole student",
    "block_size": "tokens per training sample (capped at the teacher's context length)",
    "batch_size": "samples per micro-batch",
    "grad_accum": "micro-batches accumulated per optimizer step",
    "max_steps": "optimizer steps to train to",
    "decay_steps": "length of the cosine learning-rate schedule (0: --max-steps); keep it fixed across --resume",
    "warmup_steps": "linear warm-up steps (at most a tenth of the schedule)",
    "lr_z": "peak Adam learning rate of the feature directions z",
    "lr_alpha": "peak Adam learning rate of the feature weights alpha",
    "min_lr_frac": "the cosine schedule ends at this fraction of the peak learning rates",
    "query_block": "queries per block when building attention rows (memory grows with query_block x context)",
    "eval_interval": "validate and save a checkpoint every this many steps",
    "eval_iters": "validation batches from val.bin",
    "log_interval": "print one log line every this many steps",
    "seed": "seed of calibration sampling, feature initialisation and training batches",
    "device": "auto, cpu, cuda or cuda:N",
    "dtype": "auto (bf16 autocast on cuda, fp32 on cpu), float32 or bfloat16 (autocast)",
    "resume": "continue the checkpoint in --out-dir to --max-steps",
    "overwrite": "replace an existing checkpoint in --out-dir",
}


def parse_args(argv=None):
    p = config_parser(DistillConfig, HELP, "Distil softmax attention into linear attention with DoF-chosen "
                      "feature dimensions (defaults: the paper's GPT-2 setting).", CHOICES)
    return DistillConfig(**vars(p.parse_args(argv)))


def check_config(cfg):
    if cfg.budget < 1:
        raise ModelError(f"--budget must be at least 1 feature per layer, got {cfg.budget}")
    for name in ("block_size", "batch_size", "grad_accum", "query_block", "chunk_size", "eval_interval",
                 "eval_iters", "log_interval", "J", "calib_batches"):
        if getattr(cfg, name) < 1:
            raise ModelError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if cfg.max_steps < 0 or cfg.decay_steps < 0 or cfg.warmup_steps < 0:
        raise ModelError("--max-steps, --decay-steps and --warmup-steps must not be negative")
    if cfg.lam <= 0:
        raise ModelError(f"--lam must be positive, got {cfg.lam}")
    if cfg.resume and cfg.overwrite:
        raise ModelError("--resume and --overwrite contradict each other; pass one of them")


# ----------------------------------------------------------------------------------------------------------------
# Data: uint16 token files, batches drawn from a seeded generator (its state is the data position)

def open_data(cfg, enc, vocab_size):
    d = Path(cfg.data)
    how = (f"make it with `python data/text/prepare.py --model {cfg.model} --out {cfg.data} FILE...` or "
           f"`python data/wikipedia/prepare.py --model {cfg.model} --out {cfg.data}`")
    if not d.is_dir():
        raise ModelError(f"data directory {cfg.data} does not exist; {how}")
    missing = [n for n in ("train.bin", "val.bin", "meta.json") if not (d / n).is_file()]
    if missing:
        raise ModelError(f"data directory {cfg.data} lacks {', '.join(missing)} (empty or unfinished); {how}")
    meta = json.loads((d / "meta.json").read_text())
    tok = meta.get("tokenizer", {})
    if tok.get("n_vocab") != enc.n_vocab or enc.encode_ordinary(tok.get("probe", "")) != tok.get("probe_ids"):
        raise ModelError(f"{cfg.data} was tokenized with the tokenizer of {tok.get('model', '?')} "
                         f"({tok.get('n_vocab', '?')} tokens), not the teacher's ({cfg.model}, {enc.n_vocab} "
                         f"tokens); prepare it again with --model {cfg.model}")
    if enc.n_vocab > vocab_size:
        raise ModelError(f"the tokenizer of {cfg.model} has {enc.n_vocab} tokens but the model only {vocab_size} "
                         "embeddings; pass a checkpoint directory holding its own tokenizer")
    data = {s: np.memmap(d / f"{s}.bin", dtype=np.uint16, mode="r") for s in ("train", "val")}
    for s, a in data.items():
        if len(a) < cfg.block_size + 2:
            raise ModelError(f"{d / (s + '.bin')} holds {len(a)} tokens, fewer than one sample of --block-size "
                             f"{cfg.block_size}; prepare more text or lower --block-size")
    return data, meta


def get_batch(data, B, T, gen, device):
    """B random windows of T+1 tokens -> (x, y) of shape (B, T), y shifted by one."""
    ix = torch.randint(len(data) - T - 1, (B,), generator=gen).tolist()
    xy = torch.from_numpy(np.stack([data[i:i + T + 1].astype(np.int64) for i in ix]))
    return xy[:, :-1].to(device), xy[:, 1:].to(device)


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
# Layerwise losses, block by block over the queries

def causal_mask(s, e, device):
    """Rows s..e-1, columns 0..e-1: True where key j <= query i."""
    return torch.arange(s, e, device=device)[:, None] >= torch.arange(e, device=device)[None, :]


def softmax_block(q, k, pq, pk, s, grad_scale=None):
    """Rows s..e-1 of the softmax loss: -> (sum over the rows i of KL(p_i || p^_i), dloss/da * grad_scale or None).
    q (B,H,b,D) teacher queries already divided by sqrt(d), k (B,H,e,D) teacher keys (e = s + b); pq (B,H,b,M),
    pk (B,H,e,M) student features; a_ij = phi(q_i).phi(k_j), S_i = sum_{j<=i} a_ij, p^_ij = a_ij / S_i, and as
    rows of p sum to 1:

        KL_i = sum_j p_ij log p_ij - sum_j p_ij log a_ij + log S_i,     dKL_i/da_ij = 1/S_i - p_ij / a_ij.

    The gradient is written out (no autograd graph over the (B,H,b,e) block: half the passes over it, which is
    where the time goes); softmax_loss_reference is the plain autograd form the tests hold this to. The teacher
    side is a log-softmax; a and S are clamped at the smallest normal float before their logs (zero gradient
    where clamped, as autograd would give), so an underflowed pair costs a large finite loss, never inf."""
    mask = causal_mask(s, k.size(2), q.device)
    tiny = torch.finfo(pq.dtype).tiny
    with torch.no_grad():
        p = torch.log_softmax((q @ k.transpose(-1, -2)).masked_fill_(~mask, float("-inf")), -1).exp_()  # teacher
        a = (pq @ pk.transpose(-1, -2)).masked_fill_(~mask, 0.0)                # (B, H, b, e), >= 0
        S = a.sum(-1, keepdim=True)                                             # (B, H, b, 1)
        under = a < tiny if grad_scale is not None else None
        a.clamp_min_(tiny)
        loss = torch.xlogy(p, p).sum() - (p * a.log()).sum() + S.clamp_min(tiny).log().sum()
        if grad_scale is None:
            return loss.item(), None
        inv_s = torch.where(S >= tiny, 1.0 / S.clamp_min(tiny), 0.0)
        g = p.div_(a).masked_fill_(under, 0.0).neg_().add_(inv_s).masked_fill_(~mask, 0.0).mul_(grad_scale)
    return loss.item(), g


def softmax_loss_reference(q, k, phi_q, phi_k):
    """The softmax loss the plain way, for tests: mean over (batch, heads, queries) of KL(p_i || p^_i) with the
    whole T x T matrices and autograd. q (B,H,T,D), k (B,H,T,D) teacher; phi_q, phi_k (B,H,T,M) student."""
    T = q.size(2)
    mask = causal_mask(0, T, q.device)
    logp = torch.log_softmax((q @ k.mT / math.sqrt(q.size(-1))).masked_fill(~mask, float("-inf")), -1)
    a = (phi_q @ phi_k.mT).masked_fill(~mask, 0.0)
    logq = a.clamp_min(torch.finfo(a.dtype).tiny).log() - a.sum(-1, keepdim=True).log()
    return (logp.exp() * (logp - logq)).masked_fill(~mask, 0.0).sum(-1).mean()


def l2_block(q, k, lq, lk, s):
    """Rows s..e-1 of the l2 loss: sum over the rows i of sum_{j<=i} (K_ij - K^_ij)^2 / m_i^2, with
    K_ij = exp(q_i.k_j / sqrt d), K^_ij = Phi(q_i).Phi(k_j) = sum_m exp(lq_im + lk_jm) from the log-features (the
    estimate on the kernel's own scale: the stabilised features of LinearAttention.features are off by a per-query
    factor), and m_i = max_{j<=i} K_ij. That is the paper's L2 kernel loss with each query row divided by its
    largest teacher kernel value: real models reach q.k / sqrt d of 30 and more, where exp overflows and the
    largest rows would swamp all others. K^/m is computed as exp(u_i - m_i) (Fq Fk^T)_ij with Fq, Fk in (0, 1]
    (shifts per query and per feature, exact), its exponent capped at 30 so that a wild early student gives a
    large loss, not inf. q (B,H,b,D) divided by sqrt(d), k (B,H,e,D) teacher; lq (B,H,b,M), lk (B,H,e,M)."""
    mask = causal_mask(s, k.size(2), q.device)
    with torch.no_grad():
        logits = (q @ k.transpose(-1, -2)).masked_fill_(~mask, float("-inf"))
        m = logits.amax(-1, keepdim=True)                                       # (B, H, b, 1) log row max
        kern = logits.sub_(m).exp_()                                            # K / m in [0, 1]
        w = lk.amax(2, keepdim=True)                                            # (B, H, 1, M) per-feature shift
        u = (lq + w).amax(-1, keepdim=True)                                     # (B, H, b, 1) per-query shift
    khat = ((lq + w - u).exp() @ (lk - w).exp().transpose(-1, -2)) * (u - m).clamp_max(30.0).exp()
    return ((kern - khat) ** 2).masked_fill(~mask, 0.0).sum()


def student_features(core, q, k, kind):
    """The student's features of one layer for the loss: (phi_q, phi_k) (B, H, T, M) as the model uses them
    (softmax loss), or their logs on the kernel's absolute scale (l2 loss; keys centred and repeated as in
    LinearAttention.features)."""
    if kind == "softmax":
        return core.features(q, k)
    kc = repeat_kv(k, q.size(1)) - core.key_mean[:, None].to(k.dtype)
    return core.feature_map.log_features(q), core.feature_map.log_features(kc)


def layer_loss(core, q, k, kind, query_block, scale=None):
    """Mean over (batch, heads, queries) of the layer's row losses, as a float. With scale, also backpropagates
    scale * loss into the core's feature parameters: block by block over the queries into the features' gradients
    (memory O(query_block * T)), then once through the feature map."""
    B, H, T, D = q.shape
    grad = scale is not None
    with torch.autocast(q.device.type, enabled=False), torch.set_grad_enabled(grad):
        fq, fk = student_features(core, q, k, kind)                              # (B, H, T, M) each
        fk = repeat_kv(fk, H)
        # keys centred as the student sees them: the teacher's softmax rows do not change (a per-query shift of
        # the logits), and the l2 loss compares K(q, k - mu) with its estimate, on the same scale
        qs, kr = q * D ** -0.5, repeat_kv(k, H) - core.key_mean[:, None].to(k.dtype)
        pq, pk = fq.detach().requires_grad_(grad), fk.detach().requires_grad_(grad)
        if grad:
            pq.grad, pk.grad = torch.zeros_like(pq), torch.zeros_like(pk)
        total, n = 0.0, B * H * T
        for s in range(0, T, query_block):
            e = min(T, s + query_block)
            if kind == "softmax":
                lb, g = softmax_block(qs[:, :, s:e], kr[:, :, :e], pq[:, :, s:e], pk[:, :, :e], s,
                                      scale / n if grad else None)
                if grad:                                                         # a = pq pk^T
                    pq.grad[:, :, s:e] += g @ pk[:, :, :e].detach()
                    pk.grad[:, :, :e] += g.transpose(-1, -2) @ pq[:, :, s:e].detach()
            else:
                lb = l2_block(qs[:, :, s:e], kr[:, :, :e], pq[:, :, s:e], pk[:, :, :e], s)
                if grad:
                    (lb * (scale / n)).backward()
                lb = lb.item()
            total += lb
        if grad and fq.requires_grad:
            torch.autograd.backward([fq, fk], [pq.grad, pk.grad])
    return total / n


# ----------------------------------------------------------------------------------------------------------------
# Feature dims (dof.py) and key means from the calibration batches

def choose_dims(cfg, model, calib):
    """-> (dims, per-layer DoF or None)."""
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
    clip = model.config.head_dim if cfg.alloc == "clip" else None
    order = "reverse" if cfg.alloc == "reverse" else "dof"
    dims = dof.allocate(layer_dof, cfg.budget, clip=clip, order=order)
    return [int(d) for d in dims], [float(v) for v in layer_dof]


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


# ----------------------------------------------------------------------------------------------------------------
# Student: build, save, load

def build_student_cores(model, dims, cfg_feature_map, chunk_size):
    """The linear-attention cores of model.linearize(dims), leaving model with its softmax cores."""
    teacher_cores = dof.attention_cores(model)
    cores = dof.attention_cores(model.linearize(dims, feature_map=cfg_feature_map, chunk_size=chunk_size))
    for blk, c in zip(model.h, teacher_cores):
        blk.attn.core = c
    return cores


def feature_state(cores):
    return {f"h.{l}.attn.core.{n}": t.detach().contiguous().clone()
            for l, c in enumerate(cores) for n, t in c.state_dict().items()}


def load_feature_state(cores, sd, where):
    mine = feature_state(cores)
    if set(mine) != set(sd) or any(mine[k].shape != sd[k].shape for k in mine):
        missing, extra = sorted(set(mine) - set(sd)), sorted(set(sd) - set(mine))
        raise ModelError(f"{where} does not fit this student (missing: {missing[:4] or 'none'}, unexpected: "
                         f"{extra[:4] or 'none'}); it was made with another teacher, dims or feature map")
    for l, c in enumerate(cores):
        pre = f"h.{l}.attn.core."
        c.load_state_dict({k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)})


def load_student(ckpt_dir, device="cpu", dtype=torch.float32):
    """A distill.py checkpoint -> (student GPT with trained linear-attention cores, its config.json dict)."""
    from safetensors.torch import load_file
    d = Path(ckpt_dir)
    if not (d / "config.json").is_file() or not (d / "features.safetensors").is_file():
        raise ModelError(f"{ckpt_dir} is not a distill.py checkpoint (no config.json / features.safetensors)")
    cfg = json.loads((d / "config.json").read_text())
    model = GPT.from_pretrained(cfg["teacher"], device=device, dtype=dtype)
    student = model.linearize(cfg["dims"], feature_map=cfg["feature_map"], chunk_size=cfg["chunk_size"])
    load_feature_state(dof.attention_cores(student), load_file(str(d / "features.safetensors")), ckpt_dir)
    return student.to(device=device, dtype=dtype).eval(), cfg


def save_checkpoint(out_dir, cores, config, optim_state, metrics):
    """Write the whole checkpoint to <out>.tmp, then swap it in by two renames: whenever the process dies, a
    complete checkpoint is on disk (<out>, or <out>.old for the instant between the renames)."""
    from safetensors.torch import save_file
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = out.with_name(out.name + ".tmp"), out.with_name(out.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(feature_state(cores), str(tmp / "features.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / "metrics.json").write_text(json.dumps(metrics) + "\n")
    torch.save(optim_state, tmp / "optim.pt")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------------
# Training

def lr_factor(step, cfg):
    """Linear warm-up then cosine decay to min_lr_frac, over decay_steps (default max_steps)."""
    total = cfg.decay_steps or cfg.max_steps
    warm = min(cfg.warmup_steps, total // 10)
    if step < warm:
        return (step + 1) / warm
    t = min(1.0, (step - warm) / max(1, total - warm))
    return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t))


def param_groups(cores, cfg):
    """Adam groups: the PRF weights alpha (lr_alpha) and everything else trainable, e.g. the directions z (lr_z)."""
    alpha, other = [], []
    for c in cores:
        for n, p in c.named_parameters():
            if p.requires_grad:
                (alpha if "alpha" in n.split(".")[-1] else other).append(p)
    groups = [g for g in ({"params": other, "lr": cfg.lr_z, "peak": cfg.lr_z},
                          {"params": alpha, "lr": cfg.lr_alpha, "peak": cfg.lr_alpha}) if g["params"]]
    return groups


def layer_groups(L):
    """Up to three groups of consecutive layers for the log line: e.g. 0-3, 4-7, 8-11."""
    g = max(1, math.ceil(L / 3))
    return [(s, min(L, s + g)) for s in range(0, L, g)]


def fmt_groups(losses):
    if len(losses) == 1:
        return f"{losses[0]:.4f} (next-token)"
    return " ".join(f"L{s}-{e - 1} {np.mean(losses[s:e]):.4f}" for s, e in layer_groups(len(losses)))


@torch.no_grad()
def evaluate(model, t_cores, s_cores, batches, amp, attn_kind, query_block, teacher_loss=None):
    """Validation: next-token loss of teacher (once) and student, and the per-layer held-out attention loss."""
    def lm_loss(cores):
        tot = 0.0
        with using(model, cores):
            for x, y in batches:
                with amp:
                    tot += model(x, y)[1].item()
        return tot / len(batches)

    if teacher_loss is None:
        teacher_loss = lm_loss(t_cores)
    student_loss = lm_loss(s_cores)
    attn = np.zeros(len(s_cores))
    for x, _ in batches:
        for l, (q, k) in enumerate(teacher_qk(model, x, t_cores, amp)):
            attn[l] += layer_loss(s_cores[l], q, k, attn_kind, query_block)
    return teacher_loss, student_loss, (attn / len(batches)).tolist()


def main(argv=None):
    cfg = parse_args(argv)
    check_config(cfg)
    t_start = time.time()
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

    # device, precision
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"--device {device} asked for but no CUDA device is available; use --device cpu")
    dev_type = torch.device(device).type
    bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and dev_type == "cuda")
    amp = torch.autocast(dev_type, dtype=torch.bfloat16) if bf16 else nullcontext()
    if dev_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    # teacher, data
    model = GPT.from_pretrained(cfg.model, device=device)
    model.requires_grad_(False)
    mc = model.config
    if cfg.block_size > mc.block_size:
        print(f"note: --block-size {cfg.block_size} exceeds the teacher's context {mc.block_size}; using {mc.block_size}")
        cfg.block_size = mc.block_size
    enc = load_tokenizer(cfg.model)
    data, meta = open_data(cfg, enc, mc.vocab_size)
    B, T = cfg.batch_size, cfg.block_size
    calib_gen = torch.Generator().manual_seed(cfg.seed + 2)
    calib = [get_batch(data["train"], B, T, calib_gen, device)[0] for _ in range(cfg.calib_batches)]
    val_gen = torch.Generator().manual_seed(cfg.seed + 1)
    val_batches = [get_batch(data["val"], B, T, val_gen, device) for _ in range(cfg.eval_iters)]

    # feature dims and the student
    t_cores = dof.attention_cores(model)
    t0 = time.time()
    dims, layer_dof = choose_dims(cfg, model, calib)
    t_dims = time.time() - t0
    teacher = str(Path(cfg.model).resolve()) if Path(cfg.model).exists() else cfg.model   # as load_student needs it
    prev = json.loads((out / "config.json").read_text()) if cfg.resume else None
    if prev is not None:
        if prev["teacher"] != teacher:
            raise ModelError(f"{cfg.out_dir} distils {prev['teacher']}, not {teacher}; pass --model "
                             f"{prev['teacher']} to resume it, or a new --out-dir")
        if prev["dims"] != dims:
            raise ModelError(f"{cfg.out_dir} was trained with dims {prev['dims']}, but this run chose {dims}; "
                             "resume with the same --budget/--alloc/--lam/--J/--dims/--seed/--data, or a new --out-dir")
        if (prev["feature_map"], prev["center_keys"]) != (cfg.feature_map, cfg.center_keys):
            raise ModelError(f"{cfg.out_dir} was trained with --feature-map {prev['feature_map']}"
                             f"{' --center-keys' if prev['center_keys'] else ''}; resume with the same flags")
    torch.manual_seed(cfg.seed)
    s_cores = build_student_cores(model, dims, cfg.feature_map, cfg.chunk_size)
    for c in s_cores:
        c.to(device)
    if cfg.center_keys:
        for c, mu in zip(s_cores, key_means(model, calib, t_cores, amp)):          # (Hkv, D) -> (H, D)
            c.key_mean.copy_(repeat_kv(mu[None, :, None], c.key_mean.size(0))[0, :, 0])
    groups = param_groups(s_cores, cfg)
    trainable = sum(p.numel() for g in groups for p in g["params"])
    optim = torch.optim.Adam(groups, betas=(0.9, 0.999), eps=1e-8) if groups else None
    train_gen = torch.Generator().manual_seed(cfg.seed)
    L = mc.n_layer
    attn_kind = "softmax"                       # held-out attention quality is always the softmax loss (KL)
    metrics = {"dims": dims, "dof": layer_dof, "loss": cfg.loss, "history": [], "val": [],
               "first": None, "last": None}
    step = 0
    if prev is not None:
        from safetensors.torch import load_file
        load_feature_state(s_cores, load_file(str(out / "features.safetensors")), cfg.out_dir)
        st = torch.load(out / "optim.pt", weights_only=False)
        if optim is not None:
            optim.load_state_dict(st["optimizer"])
        train_gen.set_state(st["train_rng"])
        torch.set_rng_state(st["torch_rng"])
        step = st["step"]
        metrics = json.loads((out / "metrics.json").read_text())
        print(f"resuming {cfg.out_dir} at step {step}")

    n_feat = sum(d * mc.n_head for d in dims)
    print(f"teacher {cfg.model}: {L} layers, {mc.n_head} heads of {mc.head_dim}; data {cfg.data} "
          f"({meta['tokens']['train']:,} train tokens)")
    print(f"dims ({'--dims' if cfg.dims else f'{cfg.alloc}, budget {cfg.budget}'}, mean {np.mean(dims):.2f}): {dims}"
          + (f"  [DoF in {t_dims:.1f}s: {', '.join(f'{v:.1f}' for v in layer_dof)}]" if layer_dof else ""))
    print(f"student: {cfg.feature_map} features ({n_feat} per token over all heads), {trainable:,} trainable "
          f"parameters; loss {cfg.loss}; {B}x{T} tokens x {cfg.grad_accum} per step; device {device}"
          f"{' bf16' if bf16 else ' fp32'}")
    if optim is None and cfg.max_steps > step:
        print(f"note: the {cfg.feature_map} feature map has no trainable parameters; nothing to train")

    def snapshot():
        config = {"teacher": teacher, "dims": dims, "feature_map": cfg.feature_map, "chunk_size": cfg.chunk_size,
                  "center_keys": cfg.center_keys, "loss": cfg.loss, "lam": cfg.lam, "lam_relative": cfg.lam_relative,
                  "budget": cfg.budget, "alloc": "dims" if cfg.dims else cfg.alloc, "J": cfg.J, "dof": layer_dof,
                  "step": step, "seed": cfg.seed, "block_size": T,
                  "data": {"dir": str(Path(cfg.data).resolve()), "tokens": meta.get("tokens"),
                           "source": meta.get("source"), "tokenizer": meta["tokenizer"].get("model")},
                  "args": asdict(cfg)}
        state = {"optimizer": optim.state_dict() if optim else None, "step": step,
                 "train_rng": train_gen.get_state(), "torch_rng": torch.get_rng_state()}
        save_checkpoint(cfg.out_dir, s_cores, config, state, metrics)

    def validate():
        nonlocal teacher_val
        tl, sl, attn = evaluate(model, t_cores, s_cores, val_batches, amp, attn_kind, cfg.query_block, teacher_val)
        teacher_val = tl
        metrics["val"].append({"step": step, "teacher_loss": tl, "student_loss": sl, "attn_kl": attn})
        for name, v in [("student next-token loss", sl)] + [(f"layer {l} held-out attention KL", a)
                                                              for l, a in enumerate(attn)]:
            if not math.isfinite(v):
                raise ModelError(f"the {name} is {v} at step {step}; the checkpoint in {cfg.out_dir} was not "
                                 "updated; lower --lr-z/--lr-alpha or use --dtype float32")
        tqdm.write(f"val step {step}: teacher loss {tl:.4f} | student loss {sl:.4f} | attention KL "
                   f"{fmt_groups(attn)}")

    teacher_val = None
    if step == 0 or not metrics["val"]:
        validate()
    steps_to_run = cfg.max_steps - step if optim is not None else 0
    bar = tqdm(total=max(0, steps_to_run), desc="distill", unit="step", dynamic_ncols=True)
    tokens_per_step = B * T * cfg.grad_accum
    t_train, t_log, steps_since = 0.0, time.time(), 0
    try:
        while optim is not None and step < cfg.max_steps:
            t0 = time.time()
            f = lr_factor(step, cfg)
            for g in optim.param_groups:
                g["lr"] = g["peak"] * f
            losses = np.zeros(L)
            for _ in range(cfg.grad_accum):
                x, y = get_batch(data["train"], B, T, train_gen, device)
                if cfg.loss == "direct":
                    with using(model, s_cores), amp:
                        loss = model(x, y)[1]
                    (loss / cfg.grad_accum).backward()
                    losses += loss.item() / cfg.grad_accum
                else:
                    for l, (q, k) in enumerate(teacher_qk(model, x, t_cores, amp)):
                        losses[l] += layer_loss(s_cores[l], q, k, cfg.loss, cfg.query_block,
                                                scale=1.0 / cfg.grad_accum) / cfg.grad_accum
            bad = [l for l in range(L) if not math.isfinite(losses[l])]
            if bad:
                what = "next-token loss" if cfg.loss == "direct" else f"layer {bad[0]}'s {cfg.loss} loss"
                raise ModelError(f"the {what} became {losses[bad[0]]} at step {step + 1}; the checkpoint in "
                                 f"{cfg.out_dir} was not updated; lower --lr-z/--lr-alpha or use --dtype float32")
            optim.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            dt = time.time() - t0
            t_train += dt
            steps_since += 1
            ls = losses.tolist() if cfg.loss != "direct" else [float(losses[0])]
            metrics["history"].append({"step": step, "loss": ls, "lr": optim.param_groups[0]["lr"], "ms": dt * 1e3})
            metrics["first"] = metrics["first"] or ls
            metrics["last"] = ls
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(ls):.4f}")
            if step % cfg.log_interval == 0 or step == cfg.max_steps:
                el = (time.time() - t_log) / steps_since
                tqdm.write(f"step {step}/{cfg.max_steps} | loss {fmt_groups(ls)} | lr {optim.param_groups[0]['lr']:.4g} | "
                           f"{el * 1e3:.0f} ms/step | {tokens_per_step / el:,.0f} tok/s")
                t_log, steps_since = time.time(), 0
            if step % cfg.eval_interval == 0 and step < cfg.max_steps:
                validate()
                snapshot()
    finally:
        bar.close()
    if not metrics["val"] or metrics["val"][-1]["step"] != step:
        validate()
    if metrics["history"]:
        h = metrics["history"]
        metrics["last_mean5"] = np.mean([r["loss"] for r in h[-5:]], axis=0).tolist()
    metrics["train_seconds"] = metrics.get("train_seconds", 0.0) + t_train
    snapshot()

    # summary
    v0, v1 = metrics["val"][0], metrics["val"][-1]
    print(f"\nsummary: {cfg.out_dir} at step {step} ({time.time() - t_start:.1f}s in all, "
          f"{metrics['train_seconds']:.1f}s training)")
    print(f"{'layer':>5} {'dim':>5} {'DoF':>8} {'loss first':>11} {'loss last':>10} {'val KL start':>13} {'val KL end':>11}")
    per_layer = metrics["first"] is not None and len(metrics["first"]) == L
    for l in range(L):
        first = f"{metrics['first'][l]:11.4f}" if per_layer else f"{'-':>11}"
        last = f"{metrics['last'][l]:10.4f}" if per_layer else f"{'-':>10}"
        dofv = f"{layer_dof[l]:8.2f}" if layer_dof else f"{'-':>8}"
        print(f"{l:>5} {dims[l]:>5} {dofv} {first} {last} {v0['attn_kl'][l]:>13.4f} {v1['attn_kl'][l]:>11.4f}")
    print(f"validation next-token loss: teacher {v1['teacher_loss']:.4f}, student {v0['student_loss']:.4f} "
          f"(untrained) -> {v1['student_loss']:.4f}")


if __name__ == "__main__":
    run_main(main)
