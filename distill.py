"""Distil a pretrained transformer's softmax attention into linear attention (the paper's GPT-2
setting by default):

    python distill.py --budget 64 --loss softmax
    python distill.py --model smollm2-135m --data data/wikitext2 --preset cpu   # offline, on a CPU
    torchrun --nproc_per_node 4 distill.py --budget 64 --loss softmax              # data-parallel

teacher -> token files -> calibration windows -> dims (dof.choose_dims) -> student
(teacher.linearize: only the feature maps are new) -> training -> checkpoint. The layerwise losses
train each layer on the teacher's own queries and keys from one frozen pass (independent problems:
each layer's gradient alone is that of their sum).
"""

import contextlib
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

import checkpoint
import datafiles
import devices
import dof
import door
import files
import model
import report
import resume
import tokenizer


@dataclass
class DistillConfig(door.Config):
    """Distil softmax attention into linear attention with DoF-chosen feature dimensions (defaults:
    the paper's GPT-2 setting)."""
    # the paper's knobs
    model: str = door.opt("gpt2", "teacher: hub id (gpt2, EleutherAI/pythia-160m), directory, "
                          ".gguf file or smollm2-135m", absolute="existing")
    budget: int = door.opt(64, "mean feature dimension C over the layers (the cost)", min=1)
    alloc: str = door.opt("dof", "dims: dof (M_l ~ the layer's DoF), fix (C everywhere), clip (dof "
                          "capped at the head size), reverse (dof's dims in reverse DoF order)",
                          dof.RULES)
    lam: float = door.opt(2 ** -4, "lambda of the DoF (paper: 2^-4 GPT-2, 2^-8 Pythia)", above=0)
    loss: str = door.opt("softmax", "softmax, l2 (layerwise) or direct (next-token)",
                         ("softmax", "l2", "direct"))
    feature_map: str = door.opt("prf", "prf (learned), performer (FAVOR+), dijiang (DCT) or a "
                                "fork's", choices=lambda: model.FEATURE_MAPS)
    lr_z: float = door.opt(0.02, "peak Adam learning rate of the feature directions z", min=0)
    lr_alpha: float = door.opt(0.2, "peak Adam learning rate of the feature weights alpha", min=0)
    block_size: int = door.opt(1024, "tokens per training window (at most the teacher's context)",
                               min=1, context=True, check=datafiles.check_block_size)
    # dims and student
    lam_relative: bool = door.opt(False, "lambda times tr(G / J): invariant to K's scale")
    J: int = door.opt(2048, "queries+keys drawn per head to estimate the DoF", min=1)
    calib_batches: int = door.opt(4, "calibration batches for the DoF and the key means", min=1)
    dims: str = door.opt("", "comma-separated feature dims, one per layer, instead of --alloc")
    center_keys: bool = door.opt(False, "keys minus their calibration mean, for features and DoF")
    chunk_size: int = door.opt(64, "chunk length of the causal linear-attention scan", min=1)
    # data and output
    data: str = door.opt("data/wikipedia", "folder of token files, made on first use from its "
                         "*.txt, *.raw or Wikipedia", absolute=True)
    val_fraction: float = door.opt(0.05, "when --data is prepared: the share held out as val.bin",
                                   check=datafiles.check_val_fraction)
    wiki_tokens: int = door.opt(20_000_000, "Wikipedia tokens for a --data without text", min=1)
    out_dir: str = door.opt("out-distill", "checkpoint directory")
    init_from: str = door.opt("", "start from this checkpoint's features, dims and key means; "
                              "train with this run's loss", absolute=True)
    resume: bool = door.opt(False, "continue the checkpoint in --out-dir to --max-steps, with the "
                            "flags it was started with", excludes="overwrite")
    overwrite: bool = door.opt(False, "replace an existing checkpoint in --out-dir")
    preset: str = door.opt("", "cpu: settings for a CPU (printed); flags given win", ("", "cpu"))
    # training
    batch_size: int = door.opt(8, "windows per micro-batch", min=1)
    grad_accum: int = door.opt(1, "micro-batches accumulated per optimizer step", min=1)
    max_steps: int = door.opt(2000, "optimizer steps to train to", min=0)
    decay_steps: int = door.opt(0, "length of the cosine schedule (0: --max-steps)", min=0)
    warmup_steps: int = door.opt(100, "warm-up steps (at most a tenth of the schedule)", min=0)
    min_lr_frac: float = door.opt(0.1, "final fraction of the peak rates", min=0, max=1)
    query_block: int = door.opt(0, "queries per block of the layerwise losses (0: 128, or with "
                                "--stack up to 2^26 floats)", min=0)
    stack: str = door.opt("auto", "the layerwise losses of layers of one M as one: auto (on a GPU)",
                          ("auto", "yes", "no"))
    # bookkeeping
    eval_interval: int = door.opt(250, "validate and save every this many steps", min=1)
    eval_iters: int = door.opt(4, "validation batches from val.bin", min=1)
    log_interval: int = door.opt(10, "one log line every this many steps", min=1)
    prompt: str = door.opt("The history of the city", "prompt of the greedy continuations printed "
                           "at the end ('': none)", empty_ok=True)
    seed: int = door.opt(0, "seed of the windows and of the initial features", min=0)
    device: str = door.opt("auto", "auto, cpu, cuda or cuda:N")
    dtype: str = door.opt("auto", "auto (bf16 autocast on cuda), float32 or bfloat16",
                          ("auto", "float32", "bfloat16"))

    # --query-block 0: queries a block of one layer; floats (256 MiB) a block of stacked layers
    QUERY_BLOCK = 128
    STACK_FLOATS = 2 ** 26
    # --resume refuses other values of these
    RESUMED = ("loss", "lr_z", "lr_alpha", "block_size", "data", "init_from", "batch_size",
               "grad_accum", "warmup_steps", "min_lr_frac", "eval_iters", "seed")
    # --preset cpu: SmolLM2-135M on WikiText-2 in minutes on one CPU thread (docs/results.md's)
    PRESETS = {"cpu": "--block-size 256 --batch-size 1 --max-steps 450 --warmup-steps 45 "
                      "--eval-interval 150 --eval-iters 8 --budget 32 --lam 1e-3 --lam-relative "
                      "--J 1024 --center-keys --val-fraction 0.1"}


# Layerwise losses: the plain T x T form, then the blockwise forms that training runs

def attention_rows(q, k, phi_q, phi_k):
    """log p and log p^ (B, H, T, T): the teacher's causal rows and the student's,
        p_i(j) = softmax_{j<=i}(q_i.k_j / sqrt d),  p^_i(j) = a_ij / sum_{j'<=i} a_ij',
    a = phi_q phi_k^T; q, k (B, H, T, D), phi_q, phi_k (B, H, T, M)."""
    T = q.size(2)
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()     # (T, T): key j <= query i
    tiny = torch.finfo(phi_q.dtype).tiny                                   # finite logs of 0
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
    tiny, heads = torch.finfo(a.dtype).tiny, (0, 2, 3)                  # sum all but the heads
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
    K reaches e^30 and more, and the largest rows would swamp the rest) -> (H,) float64:
        sum_i sum_{j<=i} (K_ij - K^_ij)^2 / m_i^2,  K_ij = exp(q_i.k_j / sqrt d),
        K^_ij = sum_m exp(lq_im + lk_jm),  K^/m = c_i (Fq Fk^T)_ij,
    Fq = exp(lq + w - u), Fk = exp(lk - w) in (0, 1], c = e^u / m capped at e^30 (a wild early
    student: a large loss, not inf). grad_scale:
        G = -2 (K - K^) / m,  dL/dlq_im = c_i Fq_im (G Fk)_im,
        dL/dlk_jm = Fk_jm (G^T (c Fq))_jm."""
    total = torch.zeros(q.size(1), dtype=torch.float64, device=q.device)
    for s, e, logits, diag in causal_blocks(q, k, block):
        m = logits.amax(-1, keepdim=True)                                 # (B, H, b, 1) log m_i
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


def layer_losses(cores, qk, kind, query_block=0, scale=None, stack=None):
    """(L,) float64: each layer's mean softmax or l2 loss on its teacher (q, k), keys centred; with
    scale, scale * each loss backpropagated into its core. stack (default: on a GPU): layers of one
    map type and M, whose map has a stacked form, run as one, in blocks of up to
    DistillConfig.STACK_FLOATS; else each layer alone in blocks of QUERY_BLOCK queries."""
    dev = qk[0][0].device
    stack = qk[0][0].is_cuda if stack is None else stack
    groups = {}
    for l, c in enumerate(cores):
        key = (type(c.feature_map), c.M) if stack and hasattr(c.feature_map, "stacked") else l
        groups.setdefault(key, []).append(l)
    blockwise = softmax_loss_blockwise if kind == "softmax" else l2_loss_blockwise
    grad = scale is not None
    out = torch.zeros(len(cores), dtype=torch.float64, device=dev)
    for ls in groups.values():                                            # G = len(ls) layers
        B, H, T, D = qk[ls[0]][0].shape
        with torch.autocast(dev.type, enabled=False), torch.set_grad_enabled(grad):
            seen = [cores[l].inputs(*qk[l]) for l in ls]                  # fp32, keys centred
            q, kc = (torch.cat(x, 1) if len(ls) > 1 else x[0] for x in zip(*seen))  # (B, G H, T, D)
            maps = [cores[l].feature_map for l in ls]
            if len(ls) == 1:
                fq, fk = cores[ls[0]].features(q, kc, log=kind == "l2")
            else:
                fq, fk = type(maps[0]).stacked(maps, q, kc, log=kind == "l2")  # as one map
            # pq, pk: the features (log features for l2) cut from their graph; the blockwise loss
            # adds its gradient into their .grad, and one backward pass carries it on to z, alpha
            pq, pk = fq.detach().requires_grad_(grad), fk.detach().requires_grad_(grad)
            if grad:
                pq.grad, pk.grad = torch.zeros_like(pq), torch.zeros_like(pk)
            block = DistillConfig.QUERY_BLOCK
            if stack:
                block = max(1, min(T, DistillConfig.STACK_FLOATS // (B * q.size(1) * T)))
            row_scale = scale / (B * H * T) if grad else None
            sums = blockwise(q * D ** -0.5, kc, pq, pk, query_block or block, row_scale)  # (G H,)
            out[ls] = sums.view(len(ls), H).sum(1) / (B * H * T)
            if grad and fq.requires_grad:
                torch.autograd.backward([fq, fk], [pq.grad, pk.grad])
    return out


# The student: dims (dof.py) and features, fresh or from a checkpoint

def make_student(cfg, teacher, calib, prev=None):
    """-> (student, dims, layer DoF or None): the teacher linearised with --dims or rank 0's
    dof.choose_dims, features from --seed, keys centred with --center-keys; or Checkpoint prev's."""
    if prev:
        return resume.student_from(prev, teacher, cfg)
    mu = dof.key_means(teacher, calib) if cfg.center_keys else None          # (L, H, D)
    if cfg.dims:
        dims, layer_dof = [int(m) for m in cfg.dims.split(",")], None
    else:
        dims, layer_dof = devices.from_main(lambda: dof.choose_dims(teacher, calib, cfg, mu)[:2])
    torch.manual_seed(cfg.seed)
    student = teacher.linearize(dims, cfg.feature_map, cfg.chunk_size)
    for c, m in zip(student.cores(), [] if mu is None else mu):
        c.key_mean.copy_(m)
    # every process starts from rank 0's features
    devices.broadcast(None, list(checkpoint.feature_state(student).values()))
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


# Training: the state, the learning rate, a step, validation, the loop

@dataclass
class Trainer:
    """What the loop works on (optim None: nothing trains; record: config.json's, but the step)."""
    cfg: DistillConfig
    teacher: model.GPT
    student: model.GPT
    optim: torch.optim.Optimizer | None
    gen: torch.Generator
    tokens: np.ndarray
    device: str
    amp: contextlib.AbstractContextManager = contextlib.nullcontext()
    val: list = None
    metrics: dict = None
    record: dict = None

    def next_batch(self):
        """--batch-size random training windows x, y (B, T) (under torchrun, this process's)."""
        return datafiles.train_batch(self.tokens, self.cfg, self.gen, self.device)


def lr_factor(step, cfg):
    """Linear warm-up then cosine decay to min_lr_frac, over decay_steps (default max_steps)."""
    total = cfg.decay_steps or cfg.max_steps
    warm = min(cfg.warmup_steps, total // 10)
    if step < warm:
        return (step + 1) / warm
    t = min(1.0, (step - warm) / max(1, total - warm))
    return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t))


def student_losses(t, x, kind, scale=None):
    """One teacher pass over x, then layer_losses on its queries and keys -> (L,) float64."""
    with t.amp:
        qk = dof.teacher_qk(t.teacher, x)
    stack = {"auto": None, "yes": True, "no": False}[t.cfg.stack]
    return layer_losses(t.student.cores(), qk, kind, t.cfg.query_block, scale, stack)


def step_loss(cfg, step):
    """The loss that optimizer step step + 1 trains: --loss (a fork's hook:
    experiments/direct_finetune.py ends with the direct loss)."""
    return cfg.loss


def train_step(t, step):
    """Optimizer step step + 1 (`step` steps are done), over --grad-accum micro-batches -> its
    float64 losses, (L,) per layer or (1,) next-token, left on the device (read at log lines)."""
    cfg, optim = t.cfg, t.optim
    for g in optim.param_groups:
        g["lr"] = g["peak"] * lr_factor(step, cfg)
    losses, kind = 0.0, step_loss(cfg, step)
    for _ in range(cfg.grad_accum):
        x, y = t.next_batch()
        if kind == "direct":
            with t.amp:
                loss = t.student.nll(x, y).sum() / y.numel()
            (loss / cfg.grad_accum).backward()
            loss = loss.detach().double()[None]
        else:
            # the layerwise losses run their backward pass themselves
            loss = student_losses(t, x, kind, 1 / cfg.grad_accum)
        losses = losses + loss / cfg.grad_accum
    devices.mean_grads(optim)  # under torchrun, every process's mean
    optim.step()
    optim.zero_grad(set_to_none=True)
    return losses


@torch.no_grad()
def lm_loss(gpt, batches, amp):
    """Mean next-token loss of gpt over the batches (under torchrun, every process's share)."""
    with amp:
        tot = sum(gpt.nll(x, y).sum().double() / y.numel() for x, y in batches)
    devices.all_mean([tot])
    return tot.item() / len(batches)


def validate(t, step):
    """The held-out numbers at `step`: the student's next-token loss and each layer's attention
    KL (every process's mean)."""
    with torch.no_grad():
        kl = sum(student_losses(t, x, "softmax") for x, _ in t.val)
    devices.all_mean([kl])
    return {"step": step, "teacher_loss": t.metrics["teacher_loss"],
            "student_loss": lm_loss(t.student, t.val, t.amp), "attn_kl": (kl / len(t.val)).tolist()}


def train(t, step):
    """The loop from `step` to --max-steps, as nanoGPT's; a fresh run validates and saves at once
    (ms/step: t0 restarts after each validation and log line)."""
    cfg = t.cfg
    start = step
    end = cfg.max_steps if t.optim else step                        # nothing trains: validate once
    n, t0 = 0, time.perf_counter()
    bar = tqdm(initial=step, total=end, desc="distill", unit="step", disable=not devices.is_main())
    while True:
        fresh = not t.metrics["val"]                                # validated at once
        if fresh or (step > start and (step % cfg.eval_interval == 0 or step == end)):
            v = validate(t, step)
            report.val_line(t, v)                           # checked, kept in t.metrics, printed
            record = {**t.record, "step": step}
            resume.save_checkpoint(cfg, t.student, t.optim, t.gen, record, t.metrics)  # rank 0's
            t0 = time.perf_counter()
        if step == end:
            break
        losses = train_step(t, step)
        n, step = n + 1, step + 1
        bar.update()
        if step % cfg.log_interval == 0 or step % cfg.eval_interval == 0 or step == end:
            report.log_step(t, losses, step, n, t0, step_loss(cfg, step - 1))  # the step just run
            n, t0 = 0, time.perf_counter()
    bar.close()
    return step


# The run: the door's checks, then the flow of the module docstring

def main(argv=None):
    """distill.py's command line (argv, or a config already parsed)."""
    cfg = argv if isinstance(argv, DistillConfig) else door.parse_config(DistillConfig, argv)
    with files.claim_out_dir(cfg.out_dir, cfg.resume, cfg.overwrite), datafiles.offline_hint():
        distil(cfg)


def distil(cfg):
    """teacher -> token files -> calibration windows -> dims -> student -> training -> checkpoint,
    every input checked before the work that needs it."""
    device, amp = devices.pick_device(cfg.device, cfg.dtype)
    device = devices.init_distributed(device)  # torchrun: a process per device, rank 0 prints
    teacher = model.GPT.from_pretrained(cfg.model, device=device).requires_grad_(False)
    door.validate(cfg, context=teacher.config.block_size)
    cfg, prev = resume.starting_point(cfg)
    dims = prev.config["dims"] if prev else None
    datafiles.check_memory(cfg, teacher.config, device, dims, step_loss(cfg, cfg.max_steps - 1))
    enc = tokenizer.load_tokenizer(cfg.model)
    data, meta = datafiles.open_data(cfg, enc, teacher.config.vocab_size)
    resume.check_same_tokens(cfg, prev, meta)
    calib = datafiles.calibration_batches(data["train"], cfg, device)
    val = datafiles.val_batches(data["val"], cfg, device)
    student, dims, layer_dof = make_student(cfg, teacher, calib, prev)
    optim, gen = make_optimizer(student, cfg), torch.Generator().manual_seed(cfg.seed)
    step, metrics = resume.restore(cfg, optim, gen)
    metrics["teacher_loss"] = lm_loss(teacher, val, amp)  # on this run's device
    report.print_start(cfg, teacher, data, dims, device, optim is not None)
    record = resume.run_record(cfg, dims, layer_dof, meta, step)
    t = Trainer(cfg, teacher, student, optim, gen, data["train"], device, amp, val, metrics, record)
    step = train(t, step)
    report.print_summary(t, step, enc)


if __name__ == "__main__":
    door.run_main(main)
