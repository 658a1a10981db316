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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import distill  # noqa: E402
from common import run_main  # noqa: E402


def compile_losses():
    """distill's softmax_loss_blockwise and l2_loss_blockwise replaced by their torch.compile'd forms."""
    for name in ("softmax_loss_blockwise", "l2_loss_blockwise"):
        setattr(distill, name, torch.compile(getattr(distill, name), dynamic=True))


if __name__ == "__main__":
    compile_losses()
    run_main(distill.main)
