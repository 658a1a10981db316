"""
A fork of the core: the student's scan without a cache (evaluate.py's --ppl, --plain and prefill;
distill.py's direct loss) by flash-linear-attention's CUDA chunk kernel; decoding and shared
prefixes keep model.py's scan from a state.

    pip install flash-linear-attention
    python experiments/fla_scan.py evaluate --model gpt2 --ckpt out-distill --ppl data/wikipedia/val.bin

How it forks the core: REPLACE sets model.causal_linear_attention, the scan LinearAttention calls,
and the configs of evaluate.py and distill.py, whose checks now also ask for CUDA and FLA.
"""

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import distill  # noqa: E402
import door  # noqa: E402
import evaluate  # noqa: E402
import forks  # noqa: E402
import model  # noqa: E402

core_scan = model.causal_linear_attention


def fla_linear_attention(phi_q, phi_k, v, chunk_size=None):
    """model.causal_linear_attention by FLA's chunk kernel, unnormalised on [v | 1] and divided as
    there: FLA's normalize=True adds 1e-10 to the denominator phi_q,i . sum_{j<=i} phi_k,j, which
    PRF features take far below it (4e-17 in a trained SmolLM2 student). FLA reads (B, T, H, .)
    and refuses T < H, so T is padded with zeros (later tokens change no earlier)."""
    from fla.ops.linear_attn import chunk_linear_attn
    B, H, T, D = v.shape
    v1 = torch.cat((v, v.new_ones(B, H, T, 1)), -1).to(phi_q.dtype)  # (B, H, T, D + 1)
    pad = max(0, H - T)
    x = [F.pad(t, (0, 0, 0, pad)).transpose(1, 2).contiguous() for t in (phi_q, phi_k, v1)]
    out = chunk_linear_attn(*x, scale=1.0, normalize=False)[0][:, :T].transpose(1, 2)
    return out[..., :D] / out[..., D:].clamp_min(1e-30)  # (B, H, T, D)


def scan(phi_q, phi_k, v, chunk_size=64, state=None, return_state=False):
    """model.causal_linear_attention's signature: FLA's kernel without a state, the core's with."""
    if state is None and not return_state:
        return fla_linear_attention(phi_q, phi_k, v)
    return core_scan(phi_q, phi_k, v, chunk_size, state, return_state)


def cuda_fla(device):
    """Whether --device is a CUDA device and flash-linear-attention is installed."""
    cuda = device.startswith(("auto", "cuda")) and torch.cuda.is_available()
    return cuda and importlib.util.find_spec("fla") is not None


@dataclass
class FlaEvalConfig(evaluate.EvalConfig):
    def __post_init__(self):
        super().__post_init__()
        if not (self.ckpt and cuda_fla(self.device)):
            raise door.ModelError("experiments/fla_scan.py runs a student's scan on CUDA: it needs "
                                  "--ckpt, a CUDA --device and flash-linear-attention "
                                  "(pip install flash-linear-attention)")


@dataclass
class FlaDistillConfig(distill.DistillConfig):
    def __post_init__(self):
        super().__post_init__()
        # the first validation runs the student's scan (had been a ModuleNotFoundError there)
        if not cuda_fla(self.device):
            raise door.ModelError("experiments/fla_scan.py runs the student's scan on CUDA: it needs "
                                  "a CUDA --device and flash-linear-attention "
                                  "(pip install flash-linear-attention)")


REPLACE = {(model, "causal_linear_attention"): scan, (evaluate, "EvalConfig"): FlaEvalConfig,
           (distill, "DistillConfig"): FlaDistillConfig}

if __name__ == "__main__":
    forks.fork(__file__, REPLACE)
