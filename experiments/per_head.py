"""
Beyond the paper: a feature dimension per head, M_lh = C N_lh / mean(N) over all heads (the paper gives the heads
of a layer one dimension). A fork of distill.py: the same command line, with dims per head,

    python experiments/per_head.py --model smollm2-135m --data data/wikitext-smollm2 --budget 32 --center-keys ...
    python experiments/per_head.py ... --alloc clip           # capped at the head size
    python experiments/per_head.py evaluate --ckpt out-distill ...   # evaluate.py's command line, for such students

How it forks the core: GroupedLinearAttention is a layer's core made of the core's own LinearAttention, one per
group of heads with equal M (so a layer costs sum_h M_h features, no padding), with a layer_loss (the core's, group
by group) that distill.py uses for such cores; distill.main runs with this file's make_student (per-head DoF ->
dims -> grouped cores), evaluate.main with this file's load_student.
Measured at budget 32 on SmolLM2: worse than per-layer dims (docs/results.md).
"""

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import distill  # noqa: E402
import dof  # noqa: E402
import evaluate  # noqa: E402
from checkpoint import read_student  # noqa: E402
from common import ModelError, broadcast, is_main, opt, run_main  # noqa: E402
from model import GPT, LinearAttention, feature_state, load_feature_state, repeat_kv  # noqa: E402


class GroupedLinearAttention(nn.Module):
    """Linear attention with dims[h] features for head h: groups[g] is a LinearAttention over the heads heads[g]
    (those of the g-th smallest M, in head order), their keys and values repeated to query heads first (GQA)."""

    def __init__(self, n_head, n_kv_head, head_dim, dims, feature_map="prf", chunk_size=64):
        super().__init__()
        if not isinstance(dims, (list, tuple)) or len(dims) != n_head or min(dims) < 1:
            raise ModelError(f"per-head dims need {n_head} whole numbers of at least 1 a layer, got {dims}; " + (
                "pass the --out-dir of a per_head.py run" if isinstance(dims, (list, tuple)) else "a checkpoint with "
                "one dimension per layer: train, resume or evaluate it with distill.py and evaluate.py"))
        self.n_head, self.dims = n_head, [int(m) for m in dims]
        self.heads = [[h for h in range(n_head) if self.dims[h] == m] for m in sorted(set(self.dims))]
        self.groups = nn.ModuleList(LinearAttention(len(hs), len(hs), head_dim, self.dims[hs[0]], feature_map,
                                                    chunk_size) for hs in self.heads)

    def split(self, q, k, v=None):
        """Per group: (q, k, v) of its heads; k, v (B, Hkv, T, D) repeated to the query heads first."""
        k, v = repeat_kv(k, self.n_head), None if v is None else repeat_kv(v, self.n_head)
        return [(q[:, hs], k[:, hs], None if v is None else v[:, hs]) for hs in self.heads]

    def forward(self, q, k, v, cache=None):
        y = torch.empty_like(q)                                                    # (B, H, T, D)
        for g, (core, hs, (qg, kg, vg)) in enumerate(zip(self.groups, self.heads, self.split(q, k, v))):
            y[:, hs] = core(qg, kg, vg, None if cache is None else cache.setdefault(g, {}))
        return y

    def layer_loss(self, q, k, kind, query_block, scale=None):
        """The core's layer_loss, group by group (distill.py calls it for these cores): the mean over heads is the
        groups' means weighted by their heads."""
        w = [len(hs) / self.n_head for hs in self.heads]
        return sum(wg * distill.layer_loss(c, qg, kg, kind, query_block, None if scale is None else scale * wg)
                   for wg, c, (qg, kg, _) in zip(w, self.groups, self.split(q, k)))


def per_head_dims(cfg, teacher, calib, mu):
    """M_lh = C N_lh / mean(N) over every head of every layer (clip: capped at the head size) -> (dims, N)."""
    x = dof.collect_qk(teacher, calib, cfg.J, cfg.seed, mu)                         # (L, H, J, D)
    N = dof.degrees_of_freedom(x, cfg.lam, cfg.lam_relative).cpu()                  # (L, H)
    dims = torch.tensor(dof.allocate(N.flatten(), cfg.budget, cfg.alloc, teacher.config.head_dim)).view(N.shape)
    return dims.tolist(), N.tolist()


def make_student(cfg, teacher, calib, prev=None):
    """distill.make_student with per-head dims: fresh ones from the per-head DoF (rank 0's dims and features for
    every process, as the core's), or distill.from_checkpoint's."""
    if prev:
        return distill.make_student(cfg, teacher, calib, prev, GroupedLinearAttention)
    mu = dof.key_means(teacher, calib) if cfg.center_keys else None                # (L, H, D)
    dims, N = broadcast(per_head_dims(cfg, teacher, calib, mu) if is_main() else None)
    torch.manual_seed(cfg.seed)
    student = teacher.linearize(dims, cfg.feature_map, cfg.chunk_size, GroupedLinearAttention)
    for core, m in zip(student.cores(), [] if mu is None else mu):
        for c, hs in zip(core.groups, core.heads):
            c.key_mean.copy_(m[hs])
    broadcast(None, list(feature_state(student).values()))
    return student, dims, N


def load_student(ckpt_dir, device="cpu", dtype=torch.float32):
    """model.load_student for a checkpoint with per-head dims."""
    cfg, sd = read_student(ckpt_dir)
    teacher = GPT.from_pretrained(cfg["teacher"], device, dtype)
    student = teacher.linearize(cfg["dims"], cfg["feature_map"], cfg["chunk_size"], GroupedLinearAttention)
    load_feature_state(student, sd, ckpt_dir)
    return student.eval(), cfg


@dataclass
class PerHeadConfig(distill.DistillConfig):
    """distill.py with a feature dimension per head (experiments/per_head.py); `per_head.py evaluate` followed by
    evaluate.py's flags evaluates such a student."""
    alloc: str = opt("dof", "per-head dims: dof (M_lh in proportion to N_lh, total C x heads x layers) or clip "
                     "(the same, capped at the head size)", choices=("dof", "clip"))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if argv[:1] == ["evaluate"]:                                  # evaluate.py's command line, per-head students
        return evaluate.main(argv[1:], load=load_student)
    cfg = distill.parse_args(argv, PerHeadConfig)
    if cfg.dims:
        raise ModelError("--dims sets one dimension per layer; per-head dims come from the DoF here")
    distill.main(cfg, make=make_student)


if __name__ == "__main__":
    run_main(main)
