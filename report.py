"""What distill.py and dof.py print, which a learner may skip: distill.py's first, log, validation
and summary lines (and the metrics the log records); dof.py's table and dof.json."""

import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import devices
import door
import files
import forks


def fmt(losses, next_token=False):
    """Up to three groups of consecutive layers: e.g. L0-3 0.5123 L4-7 0.6234 L8-11 0.7045."""
    if next_token:
        return f"{losses[0]:.4f} (next-token)"
    g = math.ceil(len(losses) / 3)
    return " ".join(f"L{s}-{min(len(losses), s + g) - 1} {np.mean(losses[s:s + g]):.4f}"
                    for s in range(0, len(losses), g))


def print_start(cfg, teacher, data, dims, device, trains=True):
    """distill.py's first line, after a note where nothing trains (fixed features)."""
    N = devices.get_world_size()
    batch = f"{cfg.batch_size}x{cfg.block_size} tokens x {cfg.grad_accum} per step"
    if N > 1:
        batch += f" in each of {N} processes (global batch {N * cfg.batch_size * cfg.grad_accum})"
    if not trains:
        print(f"note: {cfg.feature_map} features are fixed, so nothing trains: the checkpoint is "
              "the initial student")
    print(f"teacher {cfg.model}: {teacher.config.n_layer} layers; data {cfg.data} "
          f"({len(data['train']):,} train tokens); dims {dims} (mean {np.mean(dims):.2f}); "
          f"{cfg.feature_map} features, loss {cfg.loss}, {batch}, device {device}")


def log_step(t, losses, step, n, t0, loss):
    """distill.py's log line: the losses of the n steps up to `step` (every process's mean; the
    next-token loss where the last step's loss is "direct"), checked, kept in t.metrics with their
    time since t0 (taken once they reach the host), and printed with the learning rate, ms/step
    and tokens/s."""
    devices.all_mean([losses])
    losses = losses.tolist()
    direct = loss == "direct"
    seconds = time.perf_counter() - t0
    ms = seconds * 1e3 / n
    cfg = t.cfg
    door.check_finite(cfg, step, losses,
                      lambda l: "the next-token loss" if direct else f"layer {l}'s {cfg.loss} loss")
    lr = t.optim.param_groups[0]["lr"]
    t.metrics["history"].append({"step": step, "loss": losses, "lr_z": lr, "ms": ms})
    t.metrics["train_seconds"] = t.metrics.get("train_seconds", 0.0) + seconds
    tokens = cfg.batch_size * cfg.block_size * cfg.grad_accum * devices.get_world_size()
    tqdm.write(f"step {step}/{cfg.max_steps} | loss {fmt(losses, direct)} | lr_z {lr:.4g} | "
               f"{ms:.1f} ms/step | {tokens * 1e3 / ms:,.0f} tok/s")


def val_line(t, v):
    """distill.py's validation v: checked (before its checkpoint is saved), kept in t.metrics, and
    one line: the student's held-out loss and each layer group's attention KL."""
    door.check_finite(t.cfg, v["step"], [v["student_loss"]] + v["attn_kl"],
                      lambda i: f"layer {i - 1}'s held-out attention KL" if i else
                      "the student's held-out loss")
    t.metrics["val"].append(v)
    tqdm.write(f"val step {v['step']}: student loss {v['student_loss']:.4f} | "
               f"attention KL {fmt(v['attn_kl'])}")


def print_summary(t, step, enc):
    """Held-out attention KL and next-token loss, first and last, and greedy continuations of
    --prompt (its last tokens, so that prompt and continuation fit the teacher's context)."""
    cfg, teacher, metrics = t.cfg, t.teacher, t.metrics
    v0, v1 = metrics["val"][0], metrics["val"][-1]
    start = f"from {cfg.init_from}" if cfg.init_from else "untrained"
    fork = f" ({forks.FORK} {forks.own_flags(cfg)})" if forks.FORK else ""
    print(f"\nsummary: {cfg.out_dir} at step {step}{fork}\n"
          f"held-out attention KL: {fmt(v0['attn_kl'])} -> {fmt(v1['attn_kl'])}\n"
          f"held-out next-token loss: teacher {metrics['teacher_loss']:.4f}, "
          f"student {v0['student_loss']:.4f} ({start}) -> {v1['student_loss']:.4f}")
    if not cfg.prompt or not devices.is_main():
        return
    new = min(30, teacher.config.block_size // 2)
    ids, keep = enc.encode_ordinary(cfg.prompt), teacher.config.block_size - new
    cut = f" (its last {keep} tokens)" if len(ids) > keep else ""
    print(f"\ngreedy continuations of {cfg.prompt!r}{cut}:")
    x = torch.tensor([ids[-keep:]], device=t.device)
    for name, m in (("teacher", teacher), ("student", t.student)):
        print(f"  {name}: {enc.decode(m.generate(x, new)[0, x.size(1):].tolist())!r}")


def print_table(cfg, per_head, dims):
    """dof.py's table, a line per layer: top and mean head DoF, max/J, each rule's dims; a warning
    where the DoF nears J (J or lambda may cause it) or is 0 everywhere (lambda too large)."""
    layer = per_head.max(1)
    centred = " (keys centred)" if cfg.center_keys else ""
    relative = " x tr(G / J)" if cfg.lam_relative else ""
    print(f"{cfg.model}: J={cfg.J} queries+keys per head{centred}, lambda={cfg.lam:g}{relative}, "
          f"budget {cfg.budget}")
    names = "".join(f" {rule:>7}" for rule in dims)
    print(f"{'layer':>5} {'DoF max':>8} {'mean':>8} {'max/J':>6}{names}")
    for l, (top, mean) in enumerate(zip(layer, per_head.mean(1))):
        rules = "".join(f" {d[l]:7d}" for d in dims.values())
        print(f"{l:5d} {top:8.2f} {mean:8.2f} {top / cfg.J:6.3f}{rules}")
    if layer.max() > 0.9 * cfg.J:
        print("warning: DoF/J > 0.9: the estimate saturates at J; raise --J, or raise --lam or use "
              "--lam-relative", file=sys.stderr)
    if layer.max() == 0:
        print("warning: every DoF is 0 (lambda is that large), so dof, clip and reverse give every "
              "layer the budget, as fix does; lower --lam", file=sys.stderr)


def write_json(cfg, per_head, layer, dims, seconds):
    """dof.py's --out/dof.json (settings, every head's and layer's DoF, each rule's dims, seconds),
    written whole (its folder made), and a line naming it."""
    result = {"settings": asdict(cfg), "per_head_dof": per_head.tolist(),
              "layer_dof": layer, "dims": dims, "seconds": seconds}
    path = Path(cfg.out) / "dof.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_text_atomic(path, json.dumps(result, indent=1))
    print(f"wrote {path} ({result['seconds']:.1f}s)")
