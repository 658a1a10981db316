"""
Beyond the paper: experiments/window.py's hybrid trained at later positions. The teacher's attention
rows are the same at any position offset (rotary is relative), but the features see the rotated
queries and keys of the positions they are trained on: trained on windows at positions 0..T-1, they
meet queries and keys rotated by angles never seen at positions past T. Here each training window
(of --block-size T tokens) takes positions o, o + 1, ..., o + T - 1, with the offset o drawn from
the window's tokens in [0, --positions - T] (a resumed run draws the same); validation stays at 0.

    python experiments/positions.py --positions 2048 --window 64 --sinks 4 --model smollm2-135m \
        --data data/wikitext2 --preset cpu --out-dir out-positions
    python experiments/positions.py evaluate --model smollm2-135m --ckpt out-positions \
        --ppl data/wikitext2/val.bin --ppl-context 2048

How it forks the core: window.py's REPLACE, with distill.student_losses run on the teacher's queries
and keys at the offset, distill.DistillConfig one with --positions, and window.py's checkpoints
opened too (forks.EXTENDS): --init-from one trains it on at later positions and longer windows.
"""

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import distill  # noqa: E402
import door  # noqa: E402
import forks  # noqa: E402
import model  # noqa: E402
import window  # noqa: E402

core_student_losses = distill.student_losses


def student_losses(t, x, kind, scale=None):
    """The core's, a training step's windows x (B, T) (scale given) at positions from an offset
    drawn from their tokens in [0, --positions - T]."""
    span = t.cfg.positions - x.size(1)
    if scale is None or span <= 0:
        return core_student_losses(t, x, kind, scale)
    start = model.Cache(t.teacher.config.n_layer)
    start.pos = int(x.sum()) * 7919 % (span + 1)
    # the teacher's pass (dof.teacher_qk) from a cache that starts at the offset
    t.teacher.hidden = lambda idx: model.GPT.hidden(t.teacher, idx, start)
    try:
        return core_student_losses(t, x, kind, scale)
    finally:
        del t.teacher.hidden


@dataclass
class PositionsConfig(window.WindowConfig):
    """experiments/window.py trained at later positions."""
    positions: int = door.opt(0, "train on windows whose rotary positions start at an offset below "
                              "N - --block-size (0: from 0, as distill.py)", min=0, context=True)

    RESUMED = window.WindowConfig.RESUMED + ("positions",)


REPLACE = {**window.REPLACE,
           (distill, "student_losses"): student_losses,
           (distill, "DistillConfig"): PositionsConfig,
           (forks, "EXTENDS"): ("experiments/window.py",)}  # --init-from a window.py checkpoint

if __name__ == "__main__":
    forks.fork(__file__, REPLACE)
