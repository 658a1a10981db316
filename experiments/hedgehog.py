"""
A fork of the core, the README's worked example: Hedgehog's feature map (Zhang et al. 2024, "The
Hedgehog & the Porcupine", the features LoLCATs trains) in place of positive random features. Per
head, with a learned projection W (d x M/2):

    Phi(x) = [softmax(x W), softmax(-x W)] / sqrt(2)        (M non-negative features)

    python experiments/hedgehog.py --feature-map hedgehog --model smollm2-135m --data data/wikitext2 \
        --preset cpu --out-dir out-hedgehog
    python experiments/hedgehog.py evaluate --model smollm2-135m --ckpt out-hedgehog \
        --ppl data/wikitext2/val.bin

How it forks the core: REPLACE adds Hedgehog to model.FEATURE_MAPS, so --feature-map accepts it, and
forks.fork runs distill.py (or evaluate.py, after `evaluate`) with it. Its parameter `proj` trains at
--lr-z (only parameters whose names end in "alpha" take --lr-alpha); it has no stacked form (as
PRF.stacked), so the GPU's stacked loss runs each layer alone.
"""

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import forks  # noqa: E402
import model  # noqa: E402


class Hedgehog(nn.Module):
    """M features a head from ceil(M / 2) learned directions: x (B, H, T, d) -> (B, H, T, M)."""

    def __init__(self, n_head, head_dim, M):
        super().__init__()
        self.M = M
        w = torch.randn(n_head, head_dim, (M + 1) // 2) * head_dim ** -0.5
        self.proj = nn.Parameter(w)  # (H, d, ceil(M / 2))

    def log_features(self, x):
        """log Phi(x), the l2 loss's scale."""
        xw = x.float() @ self.proj  # (B, H, T, ceil(M / 2))
        both = torch.cat((F.log_softmax(xw, -1), F.log_softmax(-xw, -1)), -1)
        return both[..., :self.M] - 0.5 * torch.log(torch.tensor(2.0))  # (B, H, T, M)

    def forward(self, x, is_query):
        """Phi(x); softmax is shift-safe already, so queries and keys alike."""
        return self.log_features(x).exp()


REPLACE = {(model, "FEATURE_MAPS"): {**model.FEATURE_MAPS, "hedgehog": Hedgehog}}

if __name__ == "__main__":
    forks.fork(__file__, REPLACE)
