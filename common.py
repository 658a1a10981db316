"""
Plumbing every entry script shares, written once: the one-sentence error, the command line built from a config
dataclass, the device/dtype choice, the atomic write and the token-file reader. A learner may skip this file.
"""

import argparse
import os
import shutil
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import MISSING, field, fields
from pathlib import Path
from typing import get_type_hints

import numpy as np
import torch


class ModelError(Exception):
    """Bad input a user can fix: the message is one sentence saying what is wrong and what to do."""


def run_main(main):
    """Run an entry script's main(); a ModelError ends it with one sentence on stderr and exit code 2."""
    try:
        main()
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


# ----------------------------------------------------------------------------------------------------------------
# Command lines: a config dataclass whose fields carry their own help

def opt(default, help, choices=None):
    """A config field with its help text (and allowed values): written once, read by parse_config."""
    return field(default=default, metadata={"help": help, "choices": choices})


def parse_config(cls, argv=None, description=None):
    """argparse for a config dataclass: one --flag per field (underscores become dashes), its help, its default.
    Booleans are switches; fields typed `X | None` take an X and default to None."""
    p = argparse.ArgumentParser(description=description or (cls.__doc__ or "").strip())
    hints = get_type_hints(cls)
    for f in fields(cls):
        flag, meta = "--" + f.name.replace("_", "-"), f.metadata
        default = f.default if f.default is not MISSING else f.default_factory()
        if hints[f.name] is bool:
            p.add_argument(flag, action="store_true", help=meta["help"])
            continue
        typ = next(t for t in getattr(hints[f.name], "__args__", (hints[f.name],)) if t is not type(None))
        p.add_argument(flag, type=typ, default=default, choices=meta.get("choices"),
                       help=f"{meta['help']} (default: {default})")
    return cls(**vars(p.parse_args(argv)))


# ----------------------------------------------------------------------------------------------------------------
# Device and dtype

def config_parser(cls, help, description, choices=None):
    """TRANSITIONAL (old style, being replaced by opt/parse_config): argparse from a dataclass and a HELP dict."""
    p = argparse.ArgumentParser(description=description)
    for f in fields(cls):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            p.add_argument(flag, action="store_true", help=help[f.name])
        else:
            p.add_argument(flag, type=type(f.default), default=f.default, choices=(choices or {}).get(f.name),
                           help=f"{help[f.name]} (default: {f.default})")
    return p


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
        tmp.write_text(text)


def read_tokens(path, enc=None, max_tokens=None):
    """A uint16 token file (memory-mapped) or, given a tokenizer, a UTF-8 text file -> token ids (at most
    max_tokens). This is the one reader of data/*/prepare.py's train.bin and val.bin."""
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
            text = p.read_text(encoding="utf-8") if max_tokens is None else p.open(encoding="utf-8").read(16 * max_tokens)
        except UnicodeDecodeError:
            raise ModelError(f"{p} is neither a .bin token file nor UTF-8 text") from None
        tokens = np.array(enc.encode_ordinary(text), dtype=np.int64)
    return tokens[:max_tokens] if max_tokens else tokens
