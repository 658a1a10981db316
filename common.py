"""Plumbing the entry scripts share: one-sentence errors, command lines, devices, torchrun, whole-or-nothing files."""

import argparse
import fcntl
import inspect
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from dataclasses import MISSING, field, fields
from datetime import timedelta
from pathlib import Path
from typing import get_args, get_origin, get_type_hints

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

REQUIRED = MISSING     # opt(REQUIRED, help): a field the command line must give
CLAIMED = []           # (out-dir this process writes checkpoints to, since when its checkpoint is this run's)


class ModelError(Exception):
    """Bad input a user can fix: the message is one sentence saying what is wrong and what to do."""


def run_main(main):
    """Run main(): a ModelError, or an OSError of a path no check foresaw (a name too long), is one line on stderr
    (rank 0's), exit 2; Ctrl-C or SIGTERM one line, exit 130/143."""
    def stop(signum, frame):                                     # SIGTERM stops a run the way Ctrl-C does
        raise KeyboardInterrupt("SIGTERM")
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)     # also where a shell started us with it ignored
    try:
        main()
        barrier()                                                # no process tears gloo down while another works
    except (ModelError, OSError) as e:
        if isinstance(e, OSError) and not e.filename:            # not a path's: a fault to see whole
            raise
        for bar in list(getattr(tqdm, "_instances", ())):       # a progress bar ends its line first: the error is last
            bar.close()
        if get_rank() == 0:
            print(f"error: {e if isinstance(e, ModelError) else f'{e.filename}: {e.strerror}; pass another path'}",
                  file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:
        for sig in (signal.SIGINT, signal.SIGTERM):             # a second signal while stopping: the same line
            signal.signal(sig, signal.SIG_IGN)
        out, since = CLAIMED[0] if CLAIMED else ("", 0.0)           # --overwrite: one this run saved
        where = f"; the last checkpoint in {out} is whole: add --resume to continue it" if out and is_checkpoint(out) \
            and (Path(out) / "config.json").stat().st_mtime >= since else ""
        print(f"\nstopped by {str(e) or 'Ctrl-C'}{where}", file=sys.stderr)
        sys.exit(143 if str(e) == "SIGTERM" else 130)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def opt(default, help, choices=None):
    """A config field with its help text (and allowed values), read by parse_config."""
    kind = {"default_factory": lambda: list(default)} if isinstance(default, list) else {"default": default}
    return field(**kind, metadata={"help": help, "choices": choices})


def parse_config(cls, argv=None, description=None):
    """A config dataclass from argv: a --flag per field (bool: a switch; list: 0 or more, a REQUIRED one positional)."""
    p = argparse.ArgumentParser(description=description or inspect.cleandoc(cls.__doc__ or ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(cls):
        hint, required = get_type_hints(cls)[f.name], f.default is MISSING is f.default_factory
        default = None if required else f.default if f.default is not MISSING else f.default_factory()
        text = (f.metadata["help"] + (f" (default: {default})" if default is not None and hint is not bool else "")
                ).replace("%", "%%")                                                  # argparse %-formats help
        hint = next((t for t in get_args(hint) if t is not type(None)), hint) if type(None) in get_args(hint) else hint
        many, typ, flag = get_origin(hint) is list, (get_args(hint) or [hint])[0], "--" + f.name.replace("_", "-")
        if hint is bool:
            p.add_argument(flag, action="store_true", help=text)
        elif required and many:
            p.add_argument(f.name, type=typ, nargs="+", help=text)
        else:
            p.add_argument(flag, type=int64 if typ is int else typ, nargs="*" if many else None, default=default,
                           required=required, choices=f.metadata["choices"], help=text)
    return cls(**vars(p.parse_args(argv)))


def int64(text):
    """argparse's int, refused (as argparse refuses "x") beyond the 64 bits of torch's seeds and sizes."""
    if abs(value := int(text)) < 2 ** 63:
        return value
    raise ValueError(text)


def check_positive(cfg, names, minimum=1, above=False):
    """A ModelError naming the first field of `names` below `minimum` (above=True: not above it) or not finite."""
    for name in names:
        v = getattr(cfg, name)
        if v is not None and not (math.isfinite(v) and (v > minimum if above else v >= minimum)):
            raise ModelError(f"--{name.replace('_', '-')} must be a number {'above' if above else 'of at least'} "
                             f"{minimum}, got {v}")


def check_free_memory(nbytes, device, what, todo):
    """A ModelError, before anything large is allocated, where `what` needs more than the device's free memory."""
    info = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").is_file() else ""
    free = torch.cuda.mem_get_info(device)[0] if torch.device(device).type == "cuda" else \
        1024 * int((re.findall(r"MemAvailable:\s+(\d+)", info) or [2 ** 40])[0])
    if nbytes > free:
        raise ModelError(f"{what} needs about {nbytes / 2 ** 30:,.1f} GiB, more than the {free / 2 ** 30:.1f} GiB free "
                         f"on {device}; {todo}")


def pick_device(device="auto", dtype="auto"):
    """--device/--dtype -> (device, autocast context); auto: cuda under bf16 autocast and TF32, else cpu in fp32."""
    n = torch.cuda.device_count()
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
    elif torch.device(device).type == "mps":                     # torch.accelerator would need torch 2.6
        torch.mps.synchronize()


def launch():
    """(RANK, WORLD_SIZE) that torchrun sets, (0, 1) under python; a ModelError for values torchrun never sets."""
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    if not (rank.isdecimal() and world.isdecimal() and int(rank) < int(world)) or int(world) > 1 and not (
            {"RANK", "MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys()):
        was = ", ".join(f"{k}={os.environ.get(k, 'unset')}" for k in ("RANK", "WORLD_SIZE"))
        raise ModelError(f"{was} are not a process of a torchrun launch (0 <= RANK < WORLD_SIZE, with MASTER_ADDR "
                         "and MASTER_PORT); start it with torchrun, or unset them")
    return int(rank), int(world)


def init_distributed(device):
    """Under torchrun, join the process group (NCCL on cuda:LOCAL_RANK, else gloo), mute ranks > 0 -> the device."""
    if launch()[1] == 1:
        return device
    if cuda := device.startswith("cuda"):
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
    for t in tensors if dist.is_initialized() else ():
        dist.broadcast(t, src=0)
    return all_gather(obj)[0]


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


@contextmanager
def atomic_path(path, directory=False):
    """Yield <path>.tmp (a directory if asked) to write: it replaces `path` on success, else it goes, `path` stays."""
    path = Path(path).resolve()                                  # a link stays, and its target is replaced
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    remove(tmp)
    try:
        if directory:
            tmp.mkdir(parents=True)
        yield tmp
    except BaseException:
        remove(tmp)
        raise
    if swap := tmp.is_dir() and path.exists():                  # two renames: <path> or <path>.old is whole
        remove(old)
        os.replace(path, old)
    os.replace(tmp, path)
    if swap:
        remove(old)


def remove(path):
    path = Path(path)
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)


def write_text_atomic(path, text):
    """text -> path, whole or not at all; a lone surrogate (a JSON input's "\\ud800") is written as that escape."""
    try:
        with atomic_path(path) as tmp:
            tmp.write_text(text, encoding="utf-8", errors="backslashreplace")
    except OSError as e:                                         # a full disk, a folder gone since check_out
        raise ModelError(f"cannot write {path} ({e.strerror}); make room or pass another path") from None


def check_out(out, files=(), flag="--out", file=False):
    """A ModelError, before any work, unless a write into `out` (a directory for `files`; file=True: a file) works."""
    if not str(out):
        raise ModelError(f"{flag} is empty; pass a {'file' if file else 'directory'}")
    p = Path(out).resolve()                                              # a link: where its target is written
    base = p.parent if file else p
    folder = next(a for a in (base, *base.parents) if a.exists())        # the nearest folder that exists
    if not folder.is_dir() or file and folder != base:
        where = f"in {base}, which does not exist" if folder.is_dir() else "a file" if folder == p else \
            f"inside the file {folder}"
        raise ModelError(f"{flag} {out} is {where}; pass a {'file path' if file else 'directory'}")
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise ModelError(f"cannot write {flag} {out}: {folder} is not writable ({e.strerror}); pass another {flag}") \
            from None
    for t in [p] if file else [p / f for f in files] if folder == p else []:       # written whole: no fifo
        why = "is a directory" if t.is_dir() else "is not a regular file" if t.exists() and not t.is_file() else \
            "ends in /, as a directory does" if file and str(out).endswith("/") else None
        if why:
            raise ModelError(f"cannot write {out if file else t}: it {why}; pass another {flag}")


def is_checkpoint(folder):
    """Whether `folder` holds a distill.py checkpoint: its config.json and features.safetensors."""
    return (Path(folder) / "config.json").is_file() and (Path(folder) / "features.safetensors").is_file()


@contextmanager
def claim_out_dir(out_dir, resume=False, overwrite=False):
    """Check --out-dir before any work (against --resume and --overwrite) and hold <out_dir>.lock for the run."""
    out = Path(out_dir).resolve()                                # "" and "." are the working directory
    if out in (Path.cwd(), *Path.cwd().parents) or os.path.ismount(out):
        what = "a mount point" if os.path.ismount(out) else "the working directory or holds it"
        raise ModelError(f"--out-dir {str(out_dir)!r} is {what}, and every save replaces the out-dir by renaming it; "
                         f"pass a folder inside it, e.g. --out-dir {Path(out_dir) / 'out'}")
    check_out(out_dir, flag="--out-dir")                         # not a file, and writable
    ckpt, full = is_checkpoint(out), out.is_dir() and any(out.iterdir())
    if full and not resume and not (overwrite and ckpt):
        raise ModelError(f"{out_dir} is not a distill.py checkpoint, so --overwrite will not replace it; pass another "
                         "--out-dir" if overwrite else f"{out_dir} already exists and is not empty; pass --resume to "
                         "continue it, --overwrite to replace it, or another --out-dir")
    if not out.exists() and (out.with_name(out.name + ".old") / "config.json").is_file():
        raise ModelError(f"a save into {out_dir} was interrupted and the last checkpoint is in {out.name}.old; "
                         f"rename it to {out.name} and pass --resume")
    if resume and not ckpt:
        lacks = " and ".join(f for f in ("config.json", "features.safetensors") if not (out / f).is_file())
        raise ModelError(f"{out_dir} holds no checkpoint to resume (it lacks {lacks}); " + (
            "pass --overwrite to start again, or another --out-dir" if full else "drop --resume"))
    main = launch()[0] == 0                                      # under torchrun rank 0 writes, and holds the lock
    with exclusive(out.with_name(out.name + ".lock"), out_dir, "--out-dir") if main else nullcontext():
        CLAIMED[:] = [(out_dir, time.time() if overwrite else 0.0)] * main
        yield


@contextmanager
def exclusive(lock, what, flag):
    """Hold an flock on the file `lock` (freed by the OS even on a crash), or a ModelError naming `flag`."""
    try:
        Path(lock).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK)             # a fifo: ENXIO, no hang
    except OSError as e:
        raise ModelError(f"cannot write {lock} ({e.strerror}); pass another {flag}") from None
    with open(fd, "w"):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not os.path.samestat(os.fstat(fd), os.stat(lock)):      # opened as a finishing run unlinked it
                raise BlockingIOError
        except (BlockingIOError, FileNotFoundError):
            raise ModelError(f"another run is writing {what} (it holds {lock}); wait for it or pass another {flag}") \
                from None
        try:
            yield
        finally:
            Path(lock).unlink(missing_ok=True)


def read_file(path, todo, reader):
    """reader(path); a missing or damaged file is one ModelError naming it and `todo` (what to do)."""
    if not Path(path).is_file():
        raise ModelError(f"{path} {'is not a file' if Path(path).exists() else 'does not exist'}; {todo}")
    try:
        return reader(str(path))
    except Exception as e:                                   # every reader fails in its own way on a damaged file
        raise ModelError(f"{path} is damaged or truncated ({type(e).__name__}: {str(e)[:80]}); {todo}") from None


def read_json(path, todo, kind=dict):
    """A JSON file's content, which must be of type `kind` (a config: an object)."""
    d = read_file(path, todo, lambda p: json.loads(Path(p).read_text(encoding="utf-8")))
    if not isinstance(d, kind):
        raise ModelError(f"{path} holds a JSON {type(d).__name__}, not an {'object' if kind is dict else kind.__name__}"
                         f"; {todo}")
    return d


def torch_load(path, todo):
    """A torch.save file (the optimizer state), onto the CPU."""
    return read_file(path, todo, lambda p: torch.load(p, map_location="cpu", weights_only=False))


def read_tokens(path, enc=None, max_tokens=None, special=False, vocab_size=None, min_tokens=1):
    """A prepare.py uint16 .bin (memory-mapped) or, with enc, UTF-8 text -> min_tokens..max_tokens ids < vocab_size."""
    p = Path(path)
    if not p.is_file() or p.suffix != ".bin" and enc is None:
        why = "is not a .bin token file" if p.is_file() else "is a directory" if p.is_dir() else "does not exist"
        raise ModelError(f"{p} {why}; make it with data/*/prepare.py, whose --out is the folder to pass" +
                         (", or pass a text file" if enc else ""))
    if p.suffix == ".bin":
        if p.stat().st_size % 2:
            raise ModelError(f"{p} has an odd number of bytes, so it is not a uint16 token file; prepare it again")
        tokens = np.memmap(p, dtype=np.uint16, mode="r") if p.stat().st_size else np.zeros(0, np.uint16)
    else:
        try:
            text = p.read_bytes().decode("utf-8")                   # as it is: \r\n stays \r\n
        except UnicodeDecodeError:
            raise ModelError(f"{p} is neither a .bin token file nor UTF-8 text; convert it to UTF-8 (iconv -t utf-8) "
                             "or pass a .bin of data/*/prepare.py") from None
        encode = (lambda t: enc.encode(t, allowed_special="all")) if special else enc.encode_ordinary
        n = 16 * max_tokens if max_tokens else len(text)
        while len(ids := encode(text[:n])) <= (max_tokens or 0) + 64 and n < len(text):   # a prefix holding the
            n *= 2                                         # first max_tokens whole (only its last word's can change)
        tokens = np.array(ids, np.int64)
    tokens = tokens[:max_tokens or None]
    if len(tokens) < min_tokens:
        raise ModelError(f"{p} holds {len(tokens)} tokens, fewer than the {min_tokens} needed; give it more text "
                         "(or a shorter --block-size)")
    if vocab_size is not None and len(tokens) and int(tokens.max()) >= vocab_size:
        raise ModelError(f"{p} holds token id {int(tokens.max())}, but the model has {vocab_size} embeddings; "
                         "tokenize the text with this model's tokenizer")
    return tokens


def check_tokenizer(path, enc, model, todo="prepare them with this model's tokenizer (data/*/prepare.py)", need=False):
    """meta.json of prepare.py's token files `path` (their folder, or a .bin beside it) -> its dict, or None where
    there is none (need=False); a ModelError unless it records enc as the tokenizer (its size, and a probe's ids).
    enc: an Encoding, or a function making one (a model that needs none for its work, as dof.py's, may lack it)."""
    p = Path(path)
    file = p / "meta.json" if p.is_dir() or need else p.with_name("meta.json")
    if not need and not (file.is_file() and (p.is_dir() or p.suffix == ".bin")):     # text: encoded with enc
        return None
    meta, enc = read_json(file, todo, dict), enc() if callable(enc) else enc
    tok = meta.get("tokenizer") if isinstance(meta.get("tokenizer"), dict) else {}
    if tok.get("n_vocab") != enc.n_vocab or enc.encode_ordinary(tok.get("probe", "")) != tok.get("probe_ids"):
        raise ModelError(f"{path} was tokenized with the tokenizer of {tok.get('model', '?')} ({tok.get('n_vocab')} "
                         f"tokens), not {model}'s ({enc.n_vocab}); {todo}")
    return meta


def get_batch(data, B, T, gen, device, share=(0, 1)):
    """B random windows -> (x, y) (B, T), y shifted by one; share (r, N): windows r, r+N, ... of N*B draws."""
    r, N = share
    ix = torch.randint(len(data) - T, (N * B,), generator=gen)[r::N].tolist()
    xy = torch.from_numpy(np.stack([data[i:i + T + 1].astype(np.int64) for i in ix]))
    xy = (xy.pin_memory() if torch.device(device).type == "cuda" else xy).to(device, non_blocking=True)
    return xy[:, :-1], xy[:, 1:]
