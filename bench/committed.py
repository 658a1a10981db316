"""The results committed under docs/, which a learner may skip: a run replaces one only with the
settings it records, so that a table generated from it still says what was run."""

from pathlib import Path

import door
import files

ROOT = Path(__file__).resolve().parent.parent


def check_committed(given, settings, section, flag="--out", file=None, what="numbers", keys=None):
    """A ModelError, before any work, where `flag` `given` is (or `file` in it is) a committed result
    file whose `section` records another value of a setting of this run: of `keys`, or of every one
    of `settings` it records (a path is recorded relative to the repository)."""
    path = Path(given, file or "").resolve()
    if not (path.is_relative_to(ROOT / "docs") and path.is_file()):
        return
    theirs = files.read_json(path, "restore it with git checkout").get(section, {})
    for k in keys or [k for k in settings if k in theirs]:
        a, b = theirs.get(k), settings[k]
        if a == b or isinstance(a, str) and isinstance(b, str) and (ROOT / a).resolve() == Path(b).resolve():
            continue
        raise door.ModelError(f"{flag} {given} holds the committed {what} of a run with "
                              f"{door.flag(k)} {a}, not {b}; pass another {flag}")
