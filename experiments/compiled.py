"""
Beyond the paper: distill.py with its blockwise layerwise losses compiled by torch.compile (minutes to compile; for
long GPU runs; not measured against the eager losses yet). The same command line:

    python experiments/compiled.py --budget 64 --loss softmax

How it forks the core: layer_losses looks the blockwise losses up by name in distill's module, so this file replaces
them with their compiled forms and runs distill.main.
"""

import sys
from pathlib import Path

import torch
from torch._dynamo.exc import BackendCompilerFailed

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import distill  # noqa: E402
from common import ModelError, run_main  # noqa: E402


def compile_losses():
    """distill's softmax_loss_blockwise and l2_loss_blockwise replaced by their torch.compile'd forms."""
    for name in ("softmax_loss_blockwise", "l2_loss_blockwise"):
        setattr(distill, name, compiler_failure_is_one_sentence(torch.compile(getattr(distill, name), dynamic=True)))


def compiler_failure_is_one_sentence(fn):
    """fn, a torch.compile'd function, whose compiler failing at its first call (inductor without a working C++
    compiler, say) is a ModelError."""
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", e)
            why = f"{type(inner).__name__}: {(str(inner).strip().splitlines() or [''])[0][:120]}"
            raise ModelError(f"torch.compile could not compile the losses ({why}); it needs a working C++ compiler "
                             "(or Triton on a GPU): install one (or point CXX at it), or run distill.py, the same "
                             "losses uncompiled") from None
    return call


if __name__ == "__main__":
    compile_losses()
    run_main(distill.main)
