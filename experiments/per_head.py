"""
Beyond the paper: a feature dimension per head, M_lh = C N_lh / mean(N) over all heads (the paper
gives the heads of a layer one dimension). distill.py's command line, with dims per head:

    python experiments/per_head.py --model smollm2-135m --data data/wikitext2 --budget 32 ...
    python experiments/per_head.py ... --alloc clip                   # capped at the head size
    python experiments/per_head.py evaluate --model smollm2-135m --ckpt out-distill ...

How it forks the core: REPLACE sets model.LinearAttention to GroupedLinearAttention, a layer's core
made of the core's own LinearAttention, one per group of heads with equal M (a layer costs
sum_h M_h features, no padding); distill.layer_losses to the core's, group by group;
distill.make_student to one with per-head DoF dims; distill.DistillConfig to one whose --alloc
takes dof or clip; tasks.load_student to one that checks a checkpoint's per-head dims against
the teacher (and refuses one of a dimension per layer, as make_student does). Measured at budget
32 on SmolLM2: worse than per-layer dims (docs/results.md).
"""

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import checkpoint  # noqa: E402
import devices  # noqa: E402
import distill  # noqa: E402
import dof  # noqa: E402
import door  # noqa: E402
import forks  # noqa: E402
import model  # noqa: E402
import tasks  # noqa: E402

# the core's, which this fork's wrap
CoreLinearAttention = model.LinearAttention
core_layer_losses = distill.layer_losses


class GroupedLinearAttention(nn.Module):
    """Linear attention with dims[h] features for head h: groups[g] is a LinearAttention over the
    heads heads[g] (those of the g-th smallest M, in head order), their keys and values repeated
    to query heads first (GQA)."""

    def __init__(self, n_head, n_kv_head, head_dim, dims, feature_map="prf", chunk_size=64):
        super().__init__()
        self.n_head = n_head
        self.dims = [int(m) for m in dims]
        self.heads = [[h for h in range(n_head) if self.dims[h] == m] for m in sorted(set(dims))]
        self.groups = nn.ModuleList(
            CoreLinearAttention(len(hs), len(hs), head_dim, self.dims[hs[0]], feature_map,
                                chunk_size)
            for hs in self.heads)

    def split(self, q, k, v=None):
        """Per group: (q, k, v) of its heads; k, v (B, Hkv, T, D) repeated to the query heads."""
        k = model.repeat_kv(k, self.n_head)
        v = None if v is None else model.repeat_kv(v, self.n_head)
        return [(q[:, hs], k[:, hs], None if v is None else v[:, hs]) for hs in self.heads]

    def forward(self, q, k, v, cache=None):
        y = torch.empty_like(q)  # (B, H, T, D)
        parts = zip(self.groups, self.heads, self.split(q, k, v))
        for g, (core, hs, (qg, kg, vg)) in enumerate(parts):
            y[:, hs] = core(qg, kg, vg, None if cache is None else cache.setdefault(g, {}))
        return y


def layer_losses(cores, qk, kind, query_block=0, scale=None, stack=None):
    """The core's layer_losses, group by group: a layer's mean over heads is its groups' means
    weighted by their heads -> (L,) float64."""
    out = []
    for core, (q, k) in zip(cores, qk):
        w = [len(hs) / core.n_head for hs in core.heads]
        parts = [(c, (qg, kg)) for c, (qg, kg, _) in zip(core.groups, core.split(q, k))]
        losses = [core_layer_losses([c], [x], kind, query_block,
                                    None if scale is None else scale * wg)[0]
                  for wg, (c, x) in zip(w, parts)]
        out.append(sum(wg * loss for wg, loss in zip(w, losses)))
    return torch.stack(out)


def per_head_dims(cfg, teacher, calib, mu):
    """M_lh = C N_lh / mean(N) over every head of every layer (clip: capped at the head size)
    -> (dims, N)."""
    x = dof.collect_qk(teacher, calib, cfg.J, cfg.seed, mu)  # (L, H, J, D)
    N = dof.degrees_of_freedom(x, cfg.lam, cfg.lam_relative).cpu()  # (L, H)
    dims = dof.allocate(N.flatten(), cfg.budget, cfg.alloc, teacher.config.head_dim)
    return torch.tensor(dims).view(N.shape).tolist(), N.tolist()


def check_per_head(config, path, n_layer, n_head):
    """A checkpoint's config.json dict: its dims a list of n_head per layer (not distill.py's, one
    number a layer)."""
    dims = config["dims"]
    if not any(isinstance(m, list) for m in dims):
        raise door.ModelError(f"{path} has one dimension per layer: train, resume or evaluate it "
                             "with distill.py and evaluate.py")
    if len(dims) != n_layer or any(len(m) != n_head for m in dims):
        raise door.ModelError(f"per-head dims need {n_head} whole numbers of at least 1 a layer for "
                             f"{n_layer} layers, got {len(dims)} of {dims[0]}; pass the --out-dir "
                             "of a per_head.py run")


core_make_student = distill.make_student


def make_student(cfg, teacher, calib, prev=None):
    """The core's make_student with per-head dims: fresh ones from the per-head DoF (rank 0's dims
    and features for every process, as the core's), or the checkpoint's."""
    if prev:
        check_per_head(prev.config, prev.path, teacher.config.n_layer, teacher.config.n_head)
        return core_make_student(cfg, teacher, calib, prev)
    mu = dof.key_means(teacher, calib) if cfg.center_keys else None  # (L, H, D)
    chosen = per_head_dims(cfg, teacher, calib, mu) if devices.is_main() else None
    dims, N = devices.broadcast(chosen)
    torch.manual_seed(cfg.seed)
    student = teacher.linearize(dims, cfg.feature_map, cfg.chunk_size)
    for core, m in zip(student.cores(), [] if mu is None else mu):
        for c, hs in zip(core.groups, core.heads):
            c.key_mean.copy_(m[hs])
    devices.broadcast(None, list(checkpoint.feature_state(student).values()))
    return student, dims, N


core_load_student = tasks.load_student


def load_student(ckpt_dir, device="cpu", dtype=torch.float32, teacher=None):
    """The core's load_student, its per-head dims checked against the teacher before the cores
    are built."""
    cfg, _ = checkpoint.read_student(ckpt_dir)
    if not isinstance(teacher, model.GPT):
        teacher = model.GPT.from_pretrained(teacher or cfg["teacher"], device, dtype)
    check_per_head(cfg, ckpt_dir, teacher.config.n_layer, teacher.config.n_head)
    return core_load_student(ckpt_dir, device, dtype, teacher)


@dataclass
class PerHeadConfig(distill.DistillConfig):
    """distill.py with a feature dimension per head."""
    alloc: str = door.opt("dof", "per-head dims: dof (M_lh in proportion to N_lh, total C x heads x "
                     "layers) or clip (the same, capped at the head size)", choices=("dof", "clip"))

    def __post_init__(self):
        super().__post_init__()
        if self.dims:
            raise door.ModelError("--dims sets one dimension per layer; per-head dims come from "
                                 "the DoF here")


REPLACE = {(model, "LinearAttention"): GroupedLinearAttention,
           (distill, "layer_losses"): layer_losses,
           (distill, "make_student"): make_student,
           (distill, "DistillConfig"): PerHeadConfig,
           (tasks, "load_student"): load_student}

if __name__ == "__main__":
    forks.fork(__file__, REPLACE)
