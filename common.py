"""
Plumbing every entry script shares, written once: the one-sentence error, the command line built from a config
dataclass, the device/dtype choice, the process group of a torchrun launch, the atomic write and the token-file
reader. A learner may skip this file.
"""

import argparse
import inspect
import json
import os
import shutil
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import MISSING, field, fields
from pathlib import Path
from types import UnionType
from typing import Union, get_args, get_origin, get_type_hints

import numpy as np
import torch
import torch.distributed as dist


class ModelError(Exception):
    """Bad input a user can fix: the message is one sentence saying what is wrong and what to do."""


def run_main(main):
    """Run an entry script's main(); a ModelError ends it with one sentence on stderr (under torchrun rank 0's: every
    process meets the same checks) and exit code 2. Either way the process leaves its process group, if it joined."""
    try:
        main()
    except ModelError as e:
        if is_main():
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        cleanup()


# ----------------------------------------------------------------------------------------------------------------
# Command lines: a config dataclass whose fields carry their own help

REQUIRED = MISSING     # opt(REQUIRED, help): a field without a default, which the command line must give


def opt(default, help, choices=None):
    """A config field with its help text (and allowed values): written once, read by parse_config. A list default
    is copied for each config (dataclasses refuse a shared mutable default)."""
    meta = {"help": help, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def parse_config(cls, argv=None, description=None):
    """argparse for a config dataclass: one --flag per field (underscores become dashes), its help, its default.
    Booleans are switches; fields typed `X | None` take an X and default to None (not shown in the help); `list[X]`
    take zero or more X. A REQUIRED field is a required --flag, or for a list the positional arguments (one or
    more). The description (the dataclass's docstring unless given) is printed as written."""
    p = argparse.ArgumentParser(description=description or inspect.cleandoc(cls.__doc__ or ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = get_type_hints(cls)
    for f in fields(cls):
        flag, meta, hint = "--" + f.name.replace("_", "-"), f.metadata, hints[f.name]
        required = f.default is MISSING and f.default_factory is MISSING
        default = None if required else f.default if f.default is not MISSING else f.default_factory()
        shown = default is not None and hint is not bool                                # switches: no default shown
        text = (meta["help"] + (f" (default: {default})" if shown else "")).replace("%", "%%")  # argparse %-formats
        if hint is bool:
            p.add_argument(flag, action="store_true", help=text)
            continue
        if get_origin(hint) in (Union, UnionType):
            hint = next(t for t in get_args(hint) if t is not type(None))
        many = get_origin(hint) is list
        if required and many:
            p.add_argument(f.name, type=get_args(hint)[0], nargs="+", help=text)
            continue
        p.add_argument(flag, type=get_args(hint)[0] if many else hint, nargs="*" if many else None, default=default,
                       required=required, choices=meta.get("choices"), help=text)
    return cls(**vars(p.parse_args(argv)))


def check_positive(cfg, names):
    """A ModelError naming the first of the config's integer fields `names` below 1 (its --flag and value)."""
    for name in names:
        if getattr(cfg, name) < 1:
            raise ModelError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")


# ----------------------------------------------------------------------------------------------------------------
# Device and dtype

def pick_device(device="auto", dtype="auto"):
    """--device/--dtype -> (device, autocast context). auto: cuda with bf16 autocast if there is a GPU, else cpu in
    fp32. TF32 matmuls are turned on only together with bf16 autocast (an fp32 run stays fp32)."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"--device {device} asked for but no CUDA device is available; use --device cpu")
    kind = torch.device(device).type
    bf16 = dtype == "bfloat16" or (dtype == "auto" and kind == "cuda")
    if bf16 and kind == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return device, (torch.autocast(kind, dtype=torch.bfloat16) if bf16 else nullcontext())


def sync(device):
    """Wait for the device's queued work (for timing): a no-op on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------------------------
# Several processes: `torchrun --nproc_per_node N script.py ...` starts N copies of a script, told apart by their
# rank; they meet in one process group. A plain `python script.py` has no group: rank 0 of a world of 1.

def init_distributed(device):
    """Under torchrun (WORLD_SIZE > 1): join the process group, NCCL for CUDA devices and gloo on the CPU, and
    return this process's device (cuda:LOCAL_RANK for a CUDA device); rank 0 prints for all (the others' stdout
    goes to os.devnull, their errors still reach stderr). Otherwise return the device as given."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return device
    if torch.device(device).type == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if dist.get_rank() > 0:
        sys.stdout = open(os.devnull, "w")
    return device


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    """Rank 0: the process that prints, validates and writes files."""
    return get_rank() == 0


def shard(items):
    """This process's share of a list: items rank, rank + N, rank + 2N, ... of N processes (all, in one)."""
    return items[get_rank()::get_world_size()]


def all_gather(obj) -> list:
    """Every process's (picklable) obj, in rank order: [obj] in one process."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj):
    """Rank 0's (picklable) obj, on every process."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_tensors(tensors):
    """Rank 0's values copied into every process's tensors, in place."""
    if dist.is_initialized():
        for t in tensors:
            dist.broadcast(t, src=0)


def all_mean(tensors):
    """Each tensor replaced by its mean over the processes, in place, in one all-reduce (one dtype and device)."""
    if not dist.is_initialized() or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    flat /= get_world_size()
    for t, mean in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(mean.view_as(t))


def barrier():
    if dist.is_initialized():
        dist.barrier()


def cleanup():
    """Leave the process group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
# Files

@contextmanager
def atomic_path(path):
    """Yield <path>.tmp to write a file or a directory into; on success it replaces `path` (a directory by two
    renames, so a complete one is on disk at every instant: <path>, or <path>.old between the renames), on failure
    it is removed. Nothing half-written is ever left at `path`."""
    path = Path(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    remove(tmp)
    try:
        yield tmp
    except BaseException:
        remove(tmp)
        raise
    if tmp.is_dir() and path.exists():
        remove(old)
        os.replace(path, old)
        os.replace(tmp, path)
        remove(old)
    else:
        os.replace(tmp, path)


def remove(path):
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def write_text_atomic(path, text):
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def read_json(path, todo):
    """A JSON file's content; a missing, unreadable or damaged file is one ModelError naming it and `todo`."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelError(f"{path} does not exist; {todo}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path} is damaged or not JSON ({e}); {todo}") from None


def read_safetensors(path, todo):
    """A safetensors file's tensors; a missing or damaged file is one ModelError naming it and `todo`."""
    from safetensors.torch import load_file
    if not Path(path).is_file():
        raise ModelError(f"{path} does not exist; {todo}")
    try:
        return load_file(str(path))
    except Exception as e:                                   # safetensors raises its own error types
        raise ModelError(f"{path} is truncated or not a safetensors file ({e}); {todo}") from None


def read_tokens(path, enc=None, max_tokens=None, special=False):
    """A uint16 token file (memory-mapped) or, given a tokenizer, a UTF-8 text file -> token ids (at most
    max_tokens). This is the one reader of data/*/prepare.py's train.bin and val.bin. special: a special token's
    text in the text file becomes that special token (as a Hugging Face tokenizer does), not ordinary text."""
    p = Path(path)
    if not p.is_file():
        raise ModelError(f"{p} does not exist; pass a uint16 token file (data/*/prepare.py) or a text file")
    if p.suffix == ".bin":
        if p.stat().st_size % 2:
            raise ModelError(f"{p} has an odd number of bytes, so it is not a uint16 token file")
        tokens = np.memmap(p, dtype=np.uint16, mode="r")
    elif enc is None:
        raise ModelError(f"{p} is not a .bin token file; tokenize it with data/text/prepare.py")
    else:
        try:
            with p.open(encoding="utf-8") as f:
                text = f.read(-1 if max_tokens is None else 16 * max_tokens)      # 16 characters per token: plenty
        except UnicodeDecodeError:
            raise ModelError(f"{p} is neither a .bin token file nor UTF-8 text") from None
        ids = enc.encode(text, allowed_special="all") if special else enc.encode_ordinary(text)
        tokens = np.array(ids, dtype=np.int64)
    return tokens[:max_tokens] if max_tokens else tokens
