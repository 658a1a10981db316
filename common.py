"""Plumbing the entry scripts share: one-sentence errors, command lines, devices, torchrun,
whole-or-nothing files."""

import argparse
import fcntl
import functools
import importlib
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
# (the out-dir this process writes checkpoints to, since when a checkpoint there is this run's)
CLAIMED = []


class ModelError(Exception):
    """Bad input a user can fix: the message is one sentence saying what is wrong and what to do."""


def run_main(main):
    """Run main(): a ModelError, or an OSError of a path no check foresaw (a name too long), is one
    line on stderr (rank 0's), exit 2; Ctrl-C or SIGTERM one line, exit 130/143."""
    def stop(signum, frame):
        raise KeyboardInterrupt("SIGTERM")
    # SIGTERM stops a run as Ctrl-C does, and Ctrl-C works even where a shell started us ignoring it
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        main()
        # no process tears gloo down while another works
        barrier()
    except (ModelError, OSError) as e:
        # an OSError of no path is a fault to see whole
        if isinstance(e, OSError) and not e.filename:
            raise
        sentence = str(e)
        if isinstance(e, OSError):
            sentence = f"{e.filename}: {e.strerror}; pass another path"
        # a progress bar ends its line first: the error is last
        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()
        if get_rank() == 0:
            print(f"error: {sentence}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:
        _exit_stopped(str(e) or "Ctrl-C")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_stopped(by):
    """One line for Ctrl-C or SIGTERM, naming a checkpoint this run can resume; exit 130 or 143."""
    # a second signal while stopping changes nothing
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    where = ""
    if CLAIMED:
        out, since = CLAIMED[0]
        # with --overwrite, only a checkpoint this run saved counts
        if is_checkpoint(out) and (Path(out) / "config.json").stat().st_mtime >= since:
            where = f"; the last checkpoint in {out} is whole: add --resume to continue it"
    print(f"\nstopped by {by}{where}", file=sys.stderr)
    sys.exit(143 if by == "SIGTERM" else 130)


# Forks. A fork is a script (experiments/*.py) that replaces names in the core's modules and runs a
# core command with them: REPLACE = {(model, "FEATURE_MAPS"): {...}, (distill, "make_student"): f}.
# FORK names the running fork; distill.py records it in its checkpoints, and the readers refuse a
# fork's checkpoint in any other script.
FORK = None


def fork(script, replace, argv=None):
    """Run a core command as the fork `script` (its __file__) with the names in `replace` set:
    distill.py's, or evaluate.py's or dof.py's when argv starts with `evaluate` or `dof`."""
    name = os.path.relpath(Path(script).resolve(), Path(__file__).resolve().parent)
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    command = "distill"
    if argv[:1] in (["evaluate"], ["dof"]):
        command = argv.pop(0)
    main = importlib.import_module(command).main
    with replaced({**replace, (sys.modules[__name__], "FORK"): name}):
        run_main(lambda: main(argv))


@contextmanager
def replaced(replace):
    """A fork's REPLACE set while inside, the core's names back after (for tests and instruments)."""
    old = {key: getattr(*key) for key in replace}
    for (module, name), value in replace.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for (module, name), value in old.items():
            setattr(module, name, value)


def check_fork(made_by, what):
    """A checkpoint made by the fork `made_by` (its config.json's "fork") opens only in that fork."""
    if made_by is None or made_by == FORK:
        return
    raise ModelError(f"{what} was made by the fork {made_by}; open it with that script, e.g. "
                     f"`python {made_by} evaluate --ckpt {what}`, or `python {made_by} --resume`")


def opt(default, help, choices=None, empty_ok=False):
    """A config field with its help text (and allowed values), read by parse_config. Its flag
    refuses an empty value unless its default is empty or empty_ok (it says what '' means)."""
    metadata = {"help": help, "choices": choices, "empty_ok": empty_ok}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def parse_config(cls, argv=None, description=None):
    """A config dataclass from argv: a --flag per field (bool: a switch; list: 0 or more, a REQUIRED
    one positional). An empty value for a flag that refuses one (see opt) is a ModelError."""
    description = description or inspect.cleandoc(cls.__doc__ or "")
    formatter = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(description=description, formatter_class=formatter)
    hints = get_type_hints(cls)
    for f in fields(cls):
        _add_flag(p, f, hints[f.name])
    args = vars(p.parse_args(argv))
    for f in fields(cls):
        _check_not_empty(f, args[f.name])
    return cls(**args)


def _add_flag(p, f, hint):
    """The argparse argument of the config field f, of type hint."""
    required = f.default is MISSING and f.default_factory is MISSING
    default = f.default if f.default_factory is MISSING else f.default_factory()
    if required:
        default = None
    text = f.metadata["help"]
    if default is not None and hint is not bool:
        text += f" (default: {default})"
    # argparse %-formats help
    text = text.replace("%", "%%")
    # X | None: an X
    if type(None) in get_args(hint):
        hint = next(t for t in get_args(hint) if t is not type(None))
    many = get_origin(hint) is list
    typ = (get_args(hint) or [hint])[0]
    flag = "--" + f.name.replace("_", "-")
    if hint is bool:
        p.add_argument(flag, action="store_true", help=text)
    elif required and many:
        p.add_argument(f.name, type=typ, nargs="+", help=text)
    else:
        typ = int64 if typ is int else typ
        nargs = "*" if many else None
        p.add_argument(flag, type=typ, nargs=nargs, default=default, required=required,
                       choices=f.metadata["choices"], help=text)


def _check_not_empty(f, value):
    """A ModelError for "" given to the field f, unless its default is "" or it is empty_ok: an
    empty path would name the working directory."""
    if value != "" or f.default == "" or f.metadata["empty_ok"]:
        return
    flag = "--" + f.name.replace("_", "-")
    if f.default is MISSING:
        todo = "pass a value"
    elif f.default is None:
        todo = "pass a value, or drop the flag"
    else:
        todo = f"pass a value, or drop the flag to use its default, {f.default}"
    raise ModelError(f"{flag} is empty; {todo}")


def int64(text):
    """argparse's int, refused (as argparse refuses "x") beyond the 64 bits of torch's seeds."""
    value = int(text)
    if abs(value) >= 2 ** 63:
        raise ValueError(text)
    return value


def check_positive(cfg, names, minimum=1, above=False):
    """A ModelError naming the first of `names` below `minimum` (above: not above it), or not finite."""
    for name in names:
        v = getattr(cfg, name)
        if v is None:
            continue
        within = v > minimum if above else v >= minimum
        if math.isfinite(v) and within:
            continue
        bound = f"above {minimum}" if above else f"of at least {minimum}"
        raise ModelError(f"--{name.replace('_', '-')} must be a number {bound}, got {v}")


def check_free_memory(nbytes, device, what, todo):
    """A ModelError, before any large allocation, where `what` needs more than the free memory."""
    if torch.device(device).type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        meminfo = Path("/proc/meminfo")
        text = meminfo.read_text() if meminfo.is_file() else ""
        found = re.findall(r"MemAvailable:\s+(\d+)", text)
        # no /proc/meminfo (not Linux): no limit, a PiB
        free = 1024 * int(found[0]) if found else 2 ** 50
    if nbytes > free:
        raise ModelError(f"{what} needs about {nbytes / 2 ** 30:,.1f} GiB, more than the "
                         f"{free / 2 ** 30:.1f} GiB free on {device}; {todo}")


def pick_device(device="auto", dtype="auto"):
    """--device/--dtype -> (device, autocast); auto: cuda in bf16 autocast with TF32, else cpu fp32."""
    n = torch.cuda.device_count()
    devices = ["cpu"] + [f"cuda:{i}" for i in range(n)]
    if torch.backends.mps.is_available():
        devices.append("mps")
    if device == "auto":
        device = "cuda" if n else "cpu"
    # "cuda" is cuda:0
    if ("cuda:0" if device == "cuda" else device) not in devices:
        raise ModelError(f"--device {device} is not a device of this machine; use one of auto, "
                         f"{', '.join(devices)}")
    bf16 = dtype == "bfloat16" or (dtype == "auto" and device.startswith("cuda"))
    if not bf16:
        return device, nullcontext()
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return device, torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def sync(device):
    """Wait for the device's queued work (for timing): a no-op on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    # (torch.accelerator would need torch 2.6)
    elif torch.device(device).type == "mps":
        torch.mps.synchronize()


def launch():
    """(RANK, WORLD_SIZE) of torchrun, (0, 1) under python; a ModelError for values it never sets."""
    rank = os.environ.get("RANK", "0")
    world = os.environ.get("WORLD_SIZE", "1")
    numbers = rank.isdecimal() and world.isdecimal() and int(rank) < int(world)
    rendezvous = {"RANK", "MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys()
    if not numbers or int(world) > 1 and not rendezvous:
        was = ", ".join(f"{k}={os.environ.get(k, 'unset')}" for k in ("RANK", "WORLD_SIZE"))
        raise ModelError(f"{was} are not a process of a torchrun launch (0 <= RANK < WORLD_SIZE, "
                         "with MASTER_ADDR and MASTER_PORT); start it with torchrun, or unset them")
    return int(rank), int(world)


def init_distributed(device):
    """Under torchrun, join the group (NCCL on cuda:LOCAL_RANK, else gloo), mute ranks > 0 -> device."""
    if launch()[1] == 1:
        return device
    cuda = device.startswith("cuda")
    if cuda:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        device_id = torch.device(device) if cuda else None
        dist.init_process_group(backend, timeout=timedelta(hours=6), device_id=device_id)
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
    """Rank 0's (picklable) obj on every process; rank 0's `tensors` copied into each's, in place."""
    if dist.is_initialized():
        for t in tensors:
            dist.broadcast(t, src=0)
    return all_gather(obj)[0]


def all_mean(tensors):
    """Each tensor replaced in place by its mean over the processes: one all-reduce, one dtype."""
    if not dist.is_initialized() or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    means = (flat / get_world_size()).split([t.numel() for t in tensors])
    for t, mean in zip(tensors, means):
        t.copy_(mean.view_as(t))


def barrier():
    if dist.is_initialized():
        dist.barrier()


@contextmanager
def atomic_path(path, directory=False):
    """Yield <path>.tmp (a directory if asked) to write: on success it replaces `path`, else it goes."""
    # a link stays, and its target is replaced
    path = Path(path).resolve()
    tmp = path.with_name(path.name + ".tmp")
    old = path.with_name(path.name + ".old")
    remove(tmp)
    try:
        if directory:
            tmp.mkdir(parents=True)
        yield tmp
    except BaseException:
        remove(tmp)
        raise
    # a directory takes two renames: at each moment <path> or <path>.old is whole
    swap = tmp.is_dir() and path.exists()
    if swap:
        remove(old)
        os.replace(path, old)
    os.replace(tmp, path)
    if swap:
        remove(old)


def remove(path):
    """Remove a file, a link or a folder with its content; nothing where there is none."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def write_text_atomic(path, text):
    """text -> path, whole or not at all; a lone surrogate ("\\ud800") is written as that escape."""
    try:
        with atomic_path(path) as tmp:
            tmp.write_text(text, encoding="utf-8", errors="backslashreplace")
    except OSError as e:
        # a full disk, a folder gone since check_out
        raise ModelError(f"cannot write {path} ({e.strerror}); make room or pass another path") \
            from None


def check_out(out, files=(), flag="--out", file=False):
    """A ModelError, before any work, unless `out` (a directory for `files`, or a file) is writable."""
    # a link: where its target is written
    p = Path(out).resolve()
    base = p.parent if file else p
    # the nearest folder that exists: the directory, or one above it; a file's parent must exist
    folder = next(a for a in (base, *base.parents) if a.exists())
    if folder.is_dir() and file and folder != base:
        raise ModelError(f"{flag} {out} is in {base}, which does not exist; pass a file path")
    if not folder.is_dir():
        where = "a file" if folder == p else f"inside the file {folder}"
        raise ModelError(f"{flag} {out} is {where}; pass a {'file path' if file else 'directory'}")
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise ModelError(f"cannot write {flag} {out}: {folder} is not writable ({e.strerror}); "
                         f"pass another {flag}") from None
    if file:
        targets = [p]
    elif folder == p:
        targets = [p / f for f in files]
    else:
        targets = []
    for t in targets:
        # a file is written whole by a rename: not into a folder or a fifo
        if t.is_dir():
            why = "is a directory"
        elif t.exists() and not t.is_file():
            why = "is not a regular file"
        elif file and str(out).endswith("/"):
            why = "ends in /, as a directory does"
        else:
            continue
        raise ModelError(f"cannot write {out if file else t}: it {why}; pass another {flag}")


def is_checkpoint(folder):
    """Whether `folder` holds a distill.py checkpoint: its config.json and features.safetensors."""
    folder = Path(folder)
    return (folder / "config.json").is_file() and (folder / "features.safetensors").is_file()


@contextmanager
def claim_out_dir(out_dir, resume=False, overwrite=False):
    """Check --out-dir before any work (with --resume, --overwrite); hold <out_dir>.lock for the run."""
    out = Path(out_dir).resolve()
    _check_out_dir(out_dir, out, resume, overwrite)
    # under torchrun rank 0 writes, and holds the lock
    if launch()[0] != 0:
        CLAIMED.clear()
        yield
        return
    with exclusive(out.with_name(out.name + ".lock"), out_dir, "--out-dir"):
        CLAIMED[:] = [(out_dir, time.time() if overwrite else 0.0)]
        yield


def _check_out_dir(out_dir, out, resume, overwrite):
    """claim_out_dir's checks of --out-dir (resolved: out)."""
    # "." and its parents: every save would rename the working directory
    if out in (Path.cwd(), *Path.cwd().parents) or os.path.ismount(out):
        what = "a mount point" if os.path.ismount(out) else "the working directory or holds it"
        inside = Path(out_dir) / "out"
        raise ModelError(f"--out-dir {str(out_dir)!r} is {what}, and every save replaces the "
                         f"out-dir by renaming it; pass a folder inside it, e.g. --out-dir "
                         f"{inside}")
    check_out(out_dir, flag="--out-dir")
    ckpt = is_checkpoint(out)
    full = out.is_dir() and any(out.iterdir())
    if full and not resume and overwrite and not ckpt:
        raise ModelError(f"{out_dir} is not a distill.py checkpoint, so --overwrite will not "
                         "replace it; pass another --out-dir")
    if full and not resume and not overwrite:
        raise ModelError(f"{out_dir} already exists and is not empty; pass --resume to continue "
                         "it, --overwrite to replace it, or another --out-dir")
    if not out.exists() and (out.with_name(out.name + ".old") / "config.json").is_file():
        raise ModelError(f"a save into {out_dir} was interrupted and the last checkpoint is in "
                         f"{out.name}.old; rename it to {out.name} and pass --resume")
    if resume and not ckpt:
        files = ("config.json", "features.safetensors")
        lacks = " and ".join(f for f in files if not (out / f).is_file())
        todo = "pass --overwrite to start again, or another --out-dir" if full else "drop --resume"
        raise ModelError(f"{out_dir} holds no checkpoint to resume (it lacks {lacks}); {todo}")


@contextmanager
def exclusive(lock, what, flag):
    """Hold an flock on the file `lock` (freed even on a crash), or a ModelError naming `flag`."""
    try:
        Path(lock).parent.mkdir(parents=True, exist_ok=True)
        # O_NONBLOCK: a fifo is ENXIO, not a hang
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK)
    except OSError as e:
        raise ModelError(f"cannot write {lock} ({e.strerror}); pass another {flag}") from None
    with open(fd, "w"):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # opened as a finishing run unlinked it: that lock is no one's
            if not os.path.samestat(os.fstat(fd), os.stat(lock)):
                raise BlockingIOError
        except (BlockingIOError, FileNotFoundError):
            raise ModelError(f"another run is writing {what} (it holds {lock}); wait for it or "
                             f"pass another {flag}") from None
        try:
            yield
        finally:
            Path(lock).unlink(missing_ok=True)


def read_file(path, todo, reader):
    """reader(path); a file missing, not a file, unreadable or damaged is one ModelError naming it,
    the cause and `todo` (what to do)."""
    if not Path(path).exists():
        raise ModelError(f"{path} does not exist; {todo}")
    if not Path(path).is_file():
        raise ModelError(f"{path} is not a file; {todo}")
    try:
        return reader(str(path))
    except PermissionError:
        raise ModelError(f"{path} is not readable (permission denied); give this user read "
                         f"access to it, or {todo}") from None
    except Exception as e:
        # every reader fails in its own way on a damaged file
        why = f"{type(e).__name__}: {str(e)[:80]}"
        raise ModelError(f"{path} is damaged or truncated ({why}); {todo}") from None


def read_json(path, todo, kind=dict):
    """A JSON file's content, which must be of type `kind` (a config: an object)."""
    d = read_file(path, todo, lambda p: json.loads(Path(p).read_text(encoding="utf-8")))
    if not isinstance(d, kind):
        want = "object" if kind is dict else kind.__name__
        raise ModelError(f"{path} holds a JSON {type(d).__name__}, not an {want}; {todo}")
    return d


def torch_load(path, todo):
    """A torch.save file (the optimizer state), onto the CPU."""
    return read_file(path, todo, lambda p: torch.load(p, map_location="cpu", weights_only=False))


def read_tokens(path, enc=None, max_tokens=None, special=False, vocab_size=None, min_tokens=1):
    """A prepare.py .bin (memory-mapped) or, with enc, text -> min..max_tokens ids below vocab_size."""
    p = Path(path)
    if not p.is_file() or p.suffix != ".bin" and enc is None:
        if p.is_file():
            why = "is not a .bin token file"
        elif p.is_dir():
            why = "is a directory"
        else:
            why = "does not exist"
        todo = "make it with data/*/prepare.py, whose --out is the folder to pass"
        if enc:
            todo += ", or pass a text file"
        raise ModelError(f"{p} {why}; {todo}")
    if p.suffix == ".bin" and p.stat().st_size % 2:
        raise ModelError(f"{p} has an odd number of bytes, so it is not a uint16 token file; "
                         "prepare it again")
    if p.suffix == ".bin" and p.stat().st_size == 0:
        tokens = np.zeros(0, np.uint16)
    elif p.suffix == ".bin":
        tokens = np.memmap(p, dtype=np.uint16, mode="r")
    else:
        tokens = _encode_text_file(p, enc, max_tokens, special)
    tokens = tokens[:max_tokens or None]
    if len(tokens) < min_tokens:
        raise ModelError(f"{p} holds {len(tokens)} tokens, fewer than the {min_tokens} needed; "
                         "give it more text (or a shorter --block-size)")
    if vocab_size is not None and len(tokens) and int(tokens.max()) >= vocab_size:
        raise ModelError(f"{p} holds token id {int(tokens.max())}, but the model has {vocab_size} "
                         "embeddings; tokenize the text with this model's tokenizer")
    return tokens


def _encode_text_file(p, enc, max_tokens, special):
    """The ids of a UTF-8 text file (with max_tokens: of a prefix holding the first max_tokens)."""
    try:
        # as it is: \r\n stays \r\n
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ModelError(f"{p} is neither a .bin token file nor UTF-8 text; convert it to UTF-8 "
                         "(iconv -t utf-8) or pass a .bin of data/*/prepare.py") from None
    if special:
        encode = functools.partial(enc.encode, allowed_special="all")
    else:
        encode = enc.encode_ordinary
    # double the prefix until it holds 64 ids more than max_tokens (only its last word's can change)
    n = 16 * max_tokens if max_tokens else len(text)
    ids = encode(text[:n])
    while len(ids) <= (max_tokens or 0) + 64 and n < len(text):
        n *= 2
        ids = encode(text[:n])
    return np.array(ids, np.int64)


def check_tokenizer(path, enc, model,
                    todo="prepare them with this model's tokenizer (data/*/prepare.py)", need=False):
    """meta.json of prepare.py's token files `path` (their folder, or a .bin beside it) -> its dict,
    or None where there is none (need=False); a ModelError unless it records enc as the tokenizer
    (its size, and a probe's ids). enc: an Encoding, or a function making one (a model that needs
    none for its work, as dof.py's, may lack it)."""
    p = Path(path)
    if p.is_dir() or need:
        file = p / "meta.json"
    else:
        file = p.with_name("meta.json")
    # a text file, or a .bin without meta.json: encoded with enc, or unchecked
    if not need and not (file.is_file() and (p.is_dir() or p.suffix == ".bin")):
        return None
    meta = read_json(file, todo, dict)
    if callable(enc):
        enc = enc()
    tok = meta.get("tokenizer")
    if not isinstance(tok, dict):
        tok = {}
    same_size = tok.get("n_vocab") == enc.n_vocab
    if not same_size or enc.encode_ordinary(tok.get("probe", "")) != tok.get("probe_ids"):
        raise ModelError(f"{path} was tokenized with the tokenizer of {tok.get('model', '?')} "
                         f"({tok.get('n_vocab')} tokens), not {model}'s ({enc.n_vocab}); {todo}")
    return meta


def get_batch(data, B, T, gen, device, share=(0, 1)):
    """B random windows -> x, y (B, T), y shifted by one; share (r, N): draws r, r+N, ... of N*B."""
    r, N = share
    ix = torch.randint(len(data) - T, (N * B,), generator=gen)[r::N].tolist()
    xy = torch.from_numpy(np.stack([data[i:i + T + 1].astype(np.int64) for i in ix]))
    if torch.device(device).type == "cuda":
        xy = xy.pin_memory()
    xy = xy.to(device, non_blocking=True)
    return xy[:, :-1], xy[:, 1:]
