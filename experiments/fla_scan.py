"""
Beyond the paper: evaluate.py with the student's scan without a cache (--ppl, --plain, prefill) run by
flash-linear-attention's CUDA chunk kernel; decoding and shared prefixes keep model.py's. The same command line:

    pip install flash-linear-attention
    python experiments/fla_scan.py --model gpt2 --ckpt out-distill --ppl data/wikipedia/val.bin

How it forks the core: evaluate.main takes a loader of students (load_student's signature); this one sets each
LinearAttention core's `scan`, the function its forward calls without a cache.
"""

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import evaluate  # noqa: E402
from common import ModelError, parse_config, run_main  # noqa: E402
from model import LinearAttention, load_student  # noqa: E402


def fla_linear_attention(phi_q, phi_k, v, chunk_size=None):
    """model.causal_linear_attention by FLA's chunk kernel, unnormalised on [v | 1] and divided as there: FLA's
    normalize=True adds 1e-10 to the denominator phi_q,i . sum_{j<=i} phi_k,j, which PRF features take far below
    it (4e-17 in a trained SmolLM2 student). FLA reads (B, T, H, .) and refuses T < H, so T is padded with zeros
    (later tokens change no earlier)."""
    from fla.ops.linear_attn import chunk_linear_attn
    (B, H, T, D), v1 = v.shape, torch.cat((v, v.new_ones(*v.shape[:-1], 1)), -1).to(phi_q.dtype)
    x = [F.pad(t, (0, 0, 0, max(0, H - T))).transpose(1, 2).contiguous() for t in (phi_q, phi_k, v1)]
    out = chunk_linear_attn(*x, scale=1.0, normalize=False)[0][:, :T].transpose(1, 2)
    return out[..., :D] / out[..., D:].clamp_min(1e-30)                               # (B, H, T, D)


def with_fla(load=load_student):
    """A loader like `load` (load_student's signature; per_head.load_student for per-head students) whose
    students' LinearAttention cores scan with fla_linear_attention."""
    def fla_load(*args, **kwargs):
        student, *rest = load(*args, **kwargs)
        for core in student.modules():                         # a fork's core may hold several
            if isinstance(core, LinearAttention):
                core.scan = fla_linear_attention
        return (student, *rest)
    return fla_load


def main(argv=None):
    cfg = parse_config(evaluate.EvalConfig, argv, description=__doc__.strip().split("\n\n")[0])
    if not (cfg.ckpt and cfg.device.startswith(("auto", "cuda")) and torch.cuda.is_available()
            and importlib.util.find_spec("fla")):
        raise ModelError("experiments/fla_scan.py runs a student's scan on CUDA: it needs --ckpt, a CUDA --device and "
                         "flash-linear-attention (pip install flash-linear-attention)")
    evaluate.main(argv, load=with_fla())


if __name__ == "__main__":
    run_main(main)
