"""
Beyond the paper: distill.py with its blockwise layerwise losses compiled by torch.compile (minutes
to compile; for long GPU runs; not measured against the eager losses yet). The same command line:

    python experiments/compiled.py --budget 64 --loss softmax

How it forks the core: REPLACE sets distill.softmax_loss_blockwise and distill.l2_loss_blockwise,
which layer_losses calls by name, to their compiled forms.
"""

import sys
from pathlib import Path

import torch
from torch._dynamo.exc import BackendCompilerFailed

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import distill  # noqa: E402
import door  # noqa: E402
import forks  # noqa: E402


def compiled(fn):
    """fn torch.compile'd; the compiler failing at its first call (inductor without a working C++
    compiler, say) is a ModelError."""
    fast = torch.compile(fn, dynamic=True)

    def call(*args, **kwargs):
        try:
            return fast(*args, **kwargs)
        except BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", e)
            first = (str(inner).strip().splitlines() or [""])[0][:120]
            raise door.ModelError(f"torch.compile could not compile the losses "
                                 f"({type(inner).__name__}: {first}); it needs a working C++ "
                                 "compiler (or Triton on a GPU): install one (or point CXX at it), "
                                 "or run distill.py, the same losses uncompiled") from None
    return call


def replace():
    """The names this fork sets: the blockwise losses, compiled."""
    names = ("softmax_loss_blockwise", "l2_loss_blockwise")
    return {(distill, name): compiled(getattr(distill, name)) for name in names}


if __name__ == "__main__":
    forks.fork(__file__, replace())
