"""Forks, which a learner may skip: a script (experiments/*.py) that runs a core command with the
names of its REPLACE = {(model, "FEATURE_MAPS"): {...}, (distill, "make_student"): f} set. FORK,
which distill.py records in its checkpoints, names it; other scripts refuse its checkpoints."""

import importlib
import importlib.util
import os
import shlex
import sys
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

import door

# the running fork's script, relative to the core (None: a core script)
FORK = None
# the forks whose checkpoints the running one opens too (a fork of a fork), for --init-from and
# evaluate; --resume stays with the script that wrote a checkpoint (resume.check_resume)
EXTENDS = ()
# the scripts a fork runs
CORE_SCRIPTS = ("distill", "evaluate", "dof")


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
        door.run_main(lambda: main(argv))


def open_student(script, ckpt_dir, device="cpu", teacher=None):
    """A fork's file (experiments/<name>.py) and checkpoint -> (the student, config.json's dict),
    built with the fork's names set. A fork whose names are looked up while the student runs
    (fla_scan.py) needs `with forks.replaced(fork.REPLACE):` around its use too."""
    path = Path(script).resolve()
    spec = importlib.util.spec_from_file_location(f"fork_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    name = os.path.relpath(path, Path(__file__).resolve().parent)
    tasks = importlib.import_module("tasks")  # which imports this module
    with replaced({**module.REPLACE, (sys.modules[__name__], "FORK"): name}):
        return tasks.load_student(ckpt_dir, device, teacher=teacher)


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


def check_fork(made_by, what, teacher):
    """A checkpoint made by the fork `made_by` (its config.json's "fork") opens only in that fork,
    or in one that EXTENDS it; the command suggested names its teacher (gpt2 may need the hub)."""
    if made_by is None or made_by == FORK or made_by in EXTENDS:
        return
    command = shlex.join(["python", str(made_by), "evaluate", "--model", str(teacher), "--ckpt",
                          str(what)])
    raise door.ModelError(f"{what} was made by the fork {made_by}; open it with that script, e.g. "
                          f"`{command}`, or resume it with that script and the flags it was "
                          "started with")


def own_flags(cfg):
    """The flags a fork's config adds to the core script's config, with their values."""
    core = next((c for c in type(cfg).__mro__ if c.__module__ in CORE_SCRIPTS), type(cfg))
    base = {f.name for f in fields(core)}
    own = [f"{door.flag(f.name)} {getattr(cfg, f.name)}" for f in fields(cfg) if f.name not in base]
    return " ".join(own) or "the core's flags"
