"""The project's files, which a learner may skip: written whole or not at all, read with one
sentence for a damaged one, and the run directory (--out-dir) claimed under a lock."""

import fcntl
import json
import os
import signal
import tempfile
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import devices
import door

# (the out-dir this process writes checkpoints to, since when a checkpoint there is this run's)
CLAIMED = []

# a checkpoint's files in the order a save replaces them: config.json, which names the step, last
CHECKPOINT_FILES = ("features.safetensors", "metrics.json", "optim.pt", "config.json")


@contextmanager
def atomic_path(path):
    """Yield <path>.tmp to write: on success it replaces `path`, else it goes."""
    with atomic_files([path]) as (tmp,):
        yield tmp


@contextmanager
def atomic_files(paths):
    """Yield [<path>.tmp for each of paths] to write: once all are written, each replaces its path
    in the order given, Ctrl-C and SIGTERM held until the last; if one fails, they all go."""
    # a link stays, and its target is replaced
    paths = [Path(p).resolve() for p in paths]
    tmps = [p.with_name(p.name + ".tmp") for p in paths]
    for tmp in tmps:
        remove(tmp)
    try:
        yield tmps
    except BaseException:
        for tmp in tmps:
            remove(tmp)
        raise
    # Ctrl-C and SIGTERM wait for the renames, then act (only the main thread may set a handler)
    caught, held = [], []
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            held.append((s, signal.signal(s, lambda signum, frame: caught.append(signum))))
    try:
        for tmp, path in zip(tmps, paths):
            os.replace(tmp, path)
    finally:
        for s, handler in held:
            signal.signal(s, handler)
    if caught:
        signal.raise_signal(caught[0])


def remove(path):
    """Remove a temp file or a link; a folder stays (check_out refuses one where a temp file goes)."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)


def write_text_atomic(path, text):
    """text -> path, whole or not at all; a lone surrogate ("\\ud800") is written as that escape."""
    try:
        with atomic_path(path) as tmp:
            tmp.write_text(text, encoding="utf-8", errors="backslashreplace")
    except OSError as e:
        # a full disk, a folder gone since check_out
        raise door.ModelError(f"cannot write {path} ({e.strerror}); make room or pass another path") \
            from None


def check_out(out, names=(), flag="--out", file=False):
    """A ModelError, before any work, unless `out` (a directory for `names`, or a file) is writable."""
    # a link: where its target is written
    p = Path(out).resolve()
    base = p.parent if file else p
    # the nearest folder that exists: the directory, or one above it; a file's parent must exist
    folder = next(a for a in (base, *base.parents) if a.exists())
    if folder.is_dir() and file and folder != base:
        raise door.ModelError(f"{flag} {out} is in {base}, which does not exist; pass a file path")
    if not folder.is_dir():
        where = "a file" if folder == p else f"inside the file {folder}"
        raise door.ModelError(f"{flag} {out} is {where}; pass a {'file path' if file else 'directory'}")
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise door.ModelError(f"cannot write {flag} {out}: {folder} is not writable ({e.strerror}); "
                         f"pass another {flag}") from None
    # where the directory does not exist yet, neither do the files
    targets = [p] if file else [p / name for name in names]
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
        raise door.ModelError(f"cannot write {out if file else t}: it {why}; pass another {flag}")
    check_temp_files(targets, flag)


def check_temp_files(paths, flag):
    """A ModelError where the temp file <path>.tmp that a write of path goes to first is a folder: the
    user's, not a temp file that a save cut short left."""
    for path in paths:
        tmp = path.with_name(path.name + ".tmp")
        if tmp.is_dir() and not tmp.is_symlink():
            raise door.ModelError(f"cannot write {path}: its temporary file {tmp.name} would replace a "
                                  f"folder; move that folder or pass another {flag}")


def is_checkpoint(folder):
    """Whether `folder` holds a distill.py checkpoint: its config.json and features.safetensors."""
    folder = Path(folder)
    return (folder / "config.json").is_file() and (folder / "features.safetensors").is_file()


@contextmanager
def claim_out_dir(out_dir, resuming=False, overwrite=False):
    """Check --out-dir before any work (with --resume, --overwrite); hold <out_dir>.lock for the run."""
    out = Path(out_dir).resolve()
    check_out(out_dir, flag="--out-dir")
    check_temp_files([out / name for name in CHECKPOINT_FILES], "--out-dir")
    ckpt = is_checkpoint(out)
    # a save cut short leaves only its temp files
    stale = {name + ".tmp" for name in CHECKPOINT_FILES}
    full = out.is_dir() and any(p.name not in stale for p in out.iterdir())
    if full and not resuming and overwrite and not ckpt:
        raise door.ModelError(f"{out_dir} is not a distill.py checkpoint, so --overwrite will not "
                              "replace it; pass another --out-dir")
    if full and not resuming and not overwrite:
        raise door.ModelError(f"{out_dir} already exists and is not empty; pass --resume to continue "
                              "it, --overwrite to replace its checkpoint, or another --out-dir")
    if resuming and not ckpt:
        names = ("config.json", "features.safetensors")
        lacks = " and ".join(f for f in names if not (out / f).is_file())
        todo = "pass --overwrite to start again, or another --out-dir" if full else "drop --resume"
        raise door.ModelError(f"{out_dir} holds no checkpoint to resume (it lacks {lacks}); {todo}")
    # under torchrun rank 0 writes, and holds the lock
    if devices.launch()[0] != 0:
        CLAIMED.clear()
        yield
        return
    with exclusive(out.with_name(out.name + ".lock"), out_dir, "--out-dir"):
        CLAIMED[:] = [(out_dir, time.time() if overwrite else 0.0)]
        yield


@contextmanager
def exclusive(lock, what, flag):
    """Hold an flock on the file `lock` (freed even on a crash), or a ModelError naming `flag`; the
    folders made for it go with it where the run left them empty."""
    made = [folder for folder in Path(lock).parents if not folder.exists()]
    try:
        Path(lock).parent.mkdir(parents=True, exist_ok=True)
        # O_NONBLOCK: a fifo is ENXIO, not a hang
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, 0o666)
    except OSError as e:
        raise door.ModelError(f"cannot write {lock} ({e.strerror}); pass another {flag}") from None
    with open(fd, "w"):
        # a lock holds no data: a file that does is the user's, which the unlink at the end would delete
        if os.fstat(fd).st_size:
            raise door.ModelError(f"{lock} holds data, so it is no run's lock; move it or pass another "
                                  f"{flag}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # opened as a finishing run unlinked it: that lock is no one's
            if not os.path.samestat(os.fstat(fd), os.stat(lock)):
                raise BlockingIOError
        except (BlockingIOError, FileNotFoundError):
            raise door.ModelError(f"another run is writing {what} (it holds {lock}); wait for it or "
                             f"pass another {flag}") from None
        try:
            yield
        finally:
            Path(lock).unlink(missing_ok=True)
            for folder in made:
                with suppress(OSError):
                    folder.rmdir()


def read_file(path, todo, reader):
    """reader(path); a file missing, not a file, unreadable or damaged is one ModelError naming it,
    the cause and `todo` (what to do)."""
    if not Path(path).exists():
        raise door.ModelError(f"{path} does not exist; {todo}")
    if not Path(path).is_file():
        raise door.ModelError(f"{path} is not a file; {todo}")
    try:
        return reader(str(path))
    except PermissionError:
        raise door.ModelError(f"{path} is not readable (permission denied); give this user read "
                         f"access to it, or {todo}") from None
    except Exception as e:
        # every reader fails in its own way on a damaged file
        why = f"{type(e).__name__}: {str(e)[:80]}"
        raise door.ModelError(f"{path} is damaged or truncated ({why}); {todo}") from None


def read_json(path, todo):
    """A JSON file's content, which must be an object."""
    d = read_file(path, todo, lambda p: json.loads(Path(p).read_text(encoding="utf-8")))
    if not isinstance(d, dict):
        raise door.ModelError(f"{path} holds a JSON {type(d).__name__}, not an object; {todo}")
    return d
