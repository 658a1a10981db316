"""
Plumbing every entry script shares, written once: the one-sentence error and a clean stop, the command line built
from a config dataclass, the device, the process group of a torchrun launch, and the project's files (written whole
or not at all; one reader per kind, naming a damaged file; the out-dir's lock; token windows). A learner may skip it.
"""

import argparse
import fcntl
import inspect
import json
import math
import os
import shutil
import signal
import sys
import tempfile
from contextlib import contextmanager, nullcontext
from dataclasses import MISSING, field, fields
from datetime import timedelta
from pathlib import Path
from types import UnionType
from typing import Union, get_args, get_origin, get_type_hints

import numpy as np
import torch
import torch.distributed as dist


class ModelError(Exception):
    """Bad input a user can fix: the message is one sentence saying what is wrong and what to do."""


class Stopped(BaseException):
    """SIGTERM, raised in the main thread so that a run stops the way Ctrl-C stops it."""


def stop(signum, frame):
    raise Stopped()


def run_main(main):
    """Run an entry script's main(): a ModelError ends it with one sentence on stderr (rank 0's under torchrun) and
    exit code 2; Ctrl-C or SIGTERM with one line naming the last checkpoint, which is whole (atomic_path), exit code
    130 or 143."""
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)     # also where a shell started us with it ignored
    code = 0
    try:
        main()
    except ModelError as e:
        code = 2
        if get_rank() == 0:
            print(f"error: {e}", file=sys.stderr)
    except (KeyboardInterrupt, Stopped) as e:
        code = 143 if isinstance(e, Stopped) else 130
        where = f"; the last checkpoint in {CLAIMED[0]} is whole: add --resume to continue it" if CLAIMED else ""
        print(f"\nstopped by {'SIGTERM' if code == 143 else 'Ctrl-C'}{where}", file=sys.stderr)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if code:
        sys.exit(code)


# ----------------------------------------------------------------------------------------------------------------
# Command lines: a config dataclass whose fields carry their own help; options are checked where declared

REQUIRED = MISSING     # opt(REQUIRED, help): a field the command line must give


def opt(default, help, choices=None):
    """A config field with its help text (and allowed values), read by parse_config."""
    meta = {"help": help, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def parse_config(cls, argv=None, description=None):
    """argparse for a config dataclass: one --flag per field (underscores become dashes) with its help and default.
    Booleans are switches; `X | None` fields take an X; `list[X]` take zero or more (a REQUIRED list: positional).
    The dataclass's own checks (__post_init__) run on the result."""
    p = argparse.ArgumentParser(description=description or inspect.cleandoc(cls.__doc__ or ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = get_type_hints(cls)
    for f in fields(cls):
        flag, hint, required = "--" + f.name.replace("_", "-"), hints[f.name], f.default is MISSING is f.default_factory
        default = None if required else f.default if f.default is not MISSING else f.default_factory()
        text = (f.metadata["help"] + (f" (default: {default})" if default is not None and hint is not bool else "")
                ).replace("%", "%%")                                                  # argparse %-formats help
        if hint is bool:
            p.add_argument(flag, action="store_true", help=text)
            continue
        if get_origin(hint) in (Union, UnionType):
            hint = next(t for t in get_args(hint) if t is not type(None))
        many, typ = get_origin(hint) is list, (get_args(hint) or [hint])[0]
        if required and many:
            p.add_argument(f.name, type=typ, nargs="+", help=text)
        else:
            p.add_argument(flag, type=typ, nargs="*" if many else None, default=default, required=required,
                           choices=f.metadata["choices"], help=text)
    return cls(**vars(p.parse_args(argv)))


def check_positive(cfg, names, minimum=1, above=False):
    """A ModelError naming the first of the config's numeric fields `names` below `minimum` (or, above=True, not
    above it) or not finite; None passes."""
    for name in names:
        v = getattr(cfg, name)
        if v is not None and not (math.isfinite(v) and (v > minimum if above else v >= minimum)):
            raise ModelError(f"--{name.replace('_', '-')} must be a number {'above' if above else 'of at least'} "
                             f"{minimum}, got {v}")


# ----------------------------------------------------------------------------------------------------------------
# Device, and several processes: `torchrun --nproc_per_node N script.py ...` starts N copies of a script, told apart
# by their rank, that meet in one process group; a plain `python script.py` is rank 0 of a world of 1.

def pick_device(device="auto", dtype="auto"):
    """--device/--dtype -> (device, autocast context). auto: cuda with bf16 autocast if there is a GPU, else cpu in
    fp32. TF32 matmuls are turned on only together with bf16 autocast (an fp32 run stays fp32)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = ["cpu"] + [f"cuda:{i}" for i in range(n)] + (["mps"] if torch.backends.mps.is_available() else [])
    device = ("cuda" if n else "cpu") if device == "auto" else device
    if (device + ":0" if device == "cuda" else device) not in devices:
        raise ModelError(f"--device {device} is not a device of this machine; use one of auto, {', '.join(devices)}")
    bf16 = dtype == "bfloat16" or (dtype == "auto" and device.startswith("cuda"))
    if bf16 and device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return device, (torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if bf16 else nullcontext())


def sync(device):
    """Wait for the device's queued work (for timing): a no-op on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def init_distributed(device):
    """Under torchrun (WORLD_SIZE > 1): join the process group (NCCL on cuda:LOCAL_RANK, gloo on the CPU), its
    timeout long enough for rank 0 to prepare the data while the others wait; the other ranks' stdout goes to
    os.devnull. -> this process's device."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return device
    cuda = device.startswith("cuda")
    if cuda:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(hours=6),
                                device_id=torch.device(device) if cuda else None)
    if dist.get_rank() > 0:
        sys.stdout = open(os.devnull, "w")
    return device


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    """Rank 0: the process that prints and writes files."""
    return get_rank() == 0


def shard(items):
    """This process's share of a list: items rank, rank + N, ... of N processes."""
    return items[get_rank()::get_world_size()]


def all_gather(obj) -> list:
    """Every process's (picklable) obj, in rank order: [obj] in one process."""
    out = [obj] * get_world_size()
    if dist.is_initialized():
        dist.all_gather_object(out, obj)
    return out


def broadcast(obj, tensors=()):
    """Rank 0's (picklable) obj, on every process; rank 0's `tensors` copied into every process's, in place."""
    box = [obj]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
        for t in tensors:
            dist.broadcast(t, src=0)
    return box[0]


def all_mean(tensors):
    """Each tensor replaced by its mean over the processes, in place, in one all-reduce (one dtype and device)."""
    if dist.is_initialized() and tensors:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat)
        for t, mean in zip(tensors, (flat / get_world_size()).split([t.numel() for t in tensors])):
            t.copy_(mean.view_as(t))


def barrier():
    if dist.is_initialized():
        dist.barrier()


# ----------------------------------------------------------------------------------------------------------------
# Files: written whole or not at all; read with one sentence for a missing or damaged file

@contextmanager
def atomic_path(path, directory=False):
    """Yield <path>.tmp (an empty directory if asked) to write into; on success it replaces `path` (a directory by
    two renames: a complete one is on disk at every instant, <path> or <path>.old between them); on failure or
    interruption it is removed, and whatever was at `path` stays."""
    path = Path(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    remove(tmp)
    try:
        if directory:
            tmp.mkdir(parents=True)
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
    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def write_text_atomic(path, text):
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def check_writable(path):
    """A ModelError, before any work, when a file cannot be written at `path` (`path` a directory, or its folder
    missing or read-only: a real write, as root passes os.access anywhere)."""
    p = Path(path)
    try:
        why = "is a directory" if p.is_dir() else f"is in {p.parent}, which does not exist" if not p.parent.is_dir() \
            else tempfile.TemporaryFile(dir=p.parent).close()                         # None: writable
    except OSError as e:
        why = f"is in {p.parent}, which is not writable ({e.strerror})"
    if why:
        raise ModelError(f"cannot write {path}: it {why}; pass a file path in a writable folder")


CLAIMED = []           # the out-dir this process writes checkpoints to (named when a run is stopped)


@contextmanager
def claim_out_dir(out_dir, resume=False, overwrite=False):
    """Check --out-dir before any work and hold it for the run inside: refuse a file, a directory that is not an
    empty or a distill.py one (unless --resume or --overwrite fits it), an unwritable place, and a directory another
    run holds (fcntl.flock on <out_dir>.lock beside it, which the OS releases when a process ends, even by a crash)."""
    out = Path(out_dir)
    ckpt = (out / "config.json").is_file() and (out / "features.safetensors").is_file()
    if out.exists() and not out.is_dir():
        raise ModelError(f"--out-dir {out_dir} is a file; pass a directory")
    if not out.exists() and (out.with_name(out.name + ".old") / "config.json").is_file():
        raise ModelError(f"a save into {out_dir} was interrupted and the last checkpoint is in {out.name}.old; "
                         f"rename it to {out.name} and pass --resume")
    if resume and not ckpt:
        raise ModelError(f"{out_dir} holds no checkpoint to resume (no config.json and features.safetensors); "
                         "drop --resume")
    if out.is_dir() and any(out.iterdir()) and not resume and not (overwrite and ckpt):
        raise ModelError(f"{out_dir} is not a distill.py checkpoint, so --overwrite will not replace it; pass another "
                         "--out-dir" if overwrite else f"{out_dir} already exists and is not empty; pass --resume to "
                         "continue it, --overwrite to replace it, or another --out-dir")
    if os.environ.get("RANK", "0") != "0":                       # under torchrun rank 0 writes, and holds the lock
        yield
        return
    lock = out.with_name(out.name + ".lock")
    try:                                                          # a real write: root passes os.access anywhere
        out.parent.mkdir(parents=True, exist_ok=True)
        fd = open(lock, "w")
    except OSError as e:
        raise ModelError(f"cannot write beside --out-dir {out_dir} ({e.strerror}); pass another --out-dir") from None
    with fd:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ModelError(f"another run is writing {out_dir} (it holds {lock}); wait for it or pass another "
                             "--out-dir") from None
        CLAIMED[:] = [out_dir]
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)


def read_file(path, todo, reader):
    """reader(path), the content of one of the project's files; a missing or damaged file is one ModelError naming
    it and `todo` (what to do)."""
    if not Path(path).is_file():
        raise ModelError(f"{path} does not exist; {todo}")
    try:
        return reader(path)
    except Exception as e:                                   # every reader fails in its own way on a damaged file
        raise ModelError(f"{path} is damaged or truncated ({type(e).__name__}: {str(e)[:80]}); {todo}") from None


def read_json(path, todo, kind=None):
    """A JSON file's content (of type `kind`, when given: a config must be a dict)."""
    d = read_file(path, todo, lambda p: json.loads(Path(p).read_text(encoding="utf-8")))
    if kind is not None and not isinstance(d, kind):
        raise ModelError(f"{path} holds a JSON {type(d).__name__}, not an {'object' if kind is dict else kind.__name__}"
                         f"; {todo}")
    return d


def read_safetensors(path, todo):
    from safetensors.torch import load_file
    return read_file(path, todo, lambda p: load_file(str(p)))


def torch_load(path, todo):
    """A torch.save file (the optimizer state), onto the CPU."""
    return read_file(path, todo, lambda p: torch.load(p, map_location="cpu", weights_only=False))


def read_tokens(path, enc=None, max_tokens=None, special=False, vocab_size=None, min_tokens=1):
    """A uint16 token file (memory-mapped) or, given a tokenizer, a UTF-8 text file -> token ids (at most
    max_tokens): the one reader of data/*/prepare.py's train.bin and val.bin, refusing too few tokens and ids
    beyond vocab_size. special: a special token's text in the text becomes that token (as an HF tokenizer does)."""
    p = Path(path)
    if not p.is_file():
        raise ModelError(f"{p} {'is a directory' if p.is_dir() else 'does not exist'}; pass a uint16 token file "
                         "(data/*/prepare.py) or a text file")
    if p.suffix == ".bin":
        if p.stat().st_size % 2:
            raise ModelError(f"{p} has an odd number of bytes, so it is not a uint16 token file; prepare it again")
        tokens = np.memmap(p, dtype=np.uint16, mode="r") if p.stat().st_size else np.zeros(0, np.uint16)
    elif enc is None:
        raise ModelError(f"{p} is not a .bin token file; tokenize it with data/text/prepare.py")
    else:
        try:
            text = p.read_text(encoding="utf-8")[:None if max_tokens is None else 16 * max_tokens]
        except UnicodeDecodeError:
            raise ModelError(f"{p} is neither a .bin token file nor UTF-8 text") from None
        tokens = np.array(enc.encode(text, allowed_special="all") if special else enc.encode_ordinary(text), np.int64)
    tokens = tokens[:max_tokens] if max_tokens else tokens
    if len(tokens) < min_tokens:
        raise ModelError(f"{p} holds {len(tokens)} tokens, fewer than the {min_tokens} needed; give it more text "
                         "(or a shorter --block-size)")
    if vocab_size is not None and len(tokens) and int(tokens.max()) >= vocab_size:
        raise ModelError(f"{p} holds token id {int(tokens.max())}, but the model has {vocab_size} embeddings; "
                         "tokenize the text with this model's tokenizer")
    return tokens


def get_batch(data, B, T, gen, device, share=(0, 1)):
    """B random windows of T + 1 tokens (starts 0 .. len - T - 1) -> (x, y) (B, T), y shifted by one. share = (r,
    N): process r of N draws the N*B windows of one process's batch and keeps windows r, r+N, ..., so N processes
    see the batches of one process N times as large. On CUDA the copy runs from pinned memory, not blocking."""
    r, N = share
    ix = torch.randint(len(data) - T, (N * B,), generator=gen)[r::N].tolist()
    xy = torch.from_numpy(np.stack([data[i:i + T + 1].astype(np.int64) for i in ix]))
    if torch.device(device).type == "cuda":
        xy = xy.pin_memory()
    xy = xy.to(device, non_blocking=True)
    return xy[:, :-1], xy[:, 1:]
