"""The door of every entry script, which a learner may skip: one-sentence errors, exit codes,
Ctrl-C and SIGTERM, and command lines from config dataclasses whose fields declare their checks."""

import argparse
import copy
import inspect
import math
import re
import signal
import sys
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import get_args, get_origin, get_type_hints

import torch.distributed as dist
from tqdm import tqdm

import devices
import files
import forks

REQUIRED = MISSING     # opt(REQUIRED, help): a field the command line must give


class ModelError(Exception):
    """Bad input a user can fix: the message is one sentence saying what is wrong and what to do."""


def run_main(main):
    """Run main(): a ModelError, or an OSError of a path no check foresaw (a name too long), is one
    line on stderr (rank 0's), exit 2; Ctrl-C or SIGTERM one line, naming a checkpoint this run
    can resume, exit 130/143."""
    def stop(signum, frame):
        raise KeyboardInterrupt("SIGTERM")
    # SIGTERM stops a run as Ctrl-C does, and Ctrl-C works even where a shell started us ignoring it
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        main()
        # no process tears gloo down while another works
        devices.barrier()
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
        if devices.get_rank() == 0:
            print(f"error: {sentence}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:
        by = str(e) or "Ctrl-C"
        # a second signal while stopping changes nothing
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        where = ""
        if files.CLAIMED:
            out, since = files.CLAIMED[0]
            # with --overwrite, only a checkpoint this run saved counts
            if files.is_checkpoint(out) and (Path(out) / "config.json").stat().st_mtime >= since:
                where = f"; the last checkpoint in {out} is whole: add --resume to continue it"
        print(f"\nstopped by {by}{where}", file=sys.stderr)
        sys.exit(143 if by == "SIGTERM" else 130)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def opt(default, help, choices=None, empty_ok=False, min=None, above=None, max=None,
        excludes=None, needs=None, context=False, absolute=False, check=None):
    """A config field with its help text and the constraints validate enforces: choices (a list,
    or a function of the names allowed when the run starts), min <= value, above < value,
    value <= max, excludes / needs (a field that may not / must be set with this one), context (at
    most the model's context once it is known; the name of a switch: where that switch is on),
    absolute (a path made absolute; "existing": where it exists), check (cfg -> a sentence saying
    what is wrong, or None; or it raises the ModelError itself). An empty value is refused unless
    the default is empty or empty_ok (it says what '' means)."""
    metadata = {"help": help, "choices": choices, "empty_ok": empty_ok, "min": min,
                "above": above, "max": max, "excludes": excludes, "needs": needs,
                "context": context, "absolute": absolute, "check": check}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class Config:
    """The base of every entry script's configuration: validate runs when one is made."""

    def __post_init__(self):
        validate(self)

    def updated(self, **values):
        """A copy with these values, computed from the flags (whose checks are not run again)."""
        new = copy.copy(self)
        vars(new).update(values)
        return new


def flag(name):
    """A field's command-line flag: block_size -> --block-size."""
    return "--" + name.replace("_", "-")


def validate(cfg, context=None):
    """Every field's declared constraints (opt) -> a ModelError naming the first broken one; with
    context (the model's, once it is loaded) the fields declared context=True too. Paths declared
    absolute are made absolute (config.json records them so)."""
    for f in fields(cfg):
        v, rule = getattr(cfg, f.name), f.metadata
        if not rule or v is None:
            continue
        when = rule["context"]
        if when and context is not None and v > context and (when is True or getattr(cfg, when)):
            raise ModelError(f"{flag(f.name)} {v} is more than the model's context of {context} "
                             f"tokens; pass at most {flag(f.name)} {context}")
        if context is not None:
            continue
        if why := broken(cfg, f.name, v, rule):
            raise ModelError(why)
        # "existing": a path where one exists (a model may be a hub id)
        if rule["absolute"] and v and (rule["absolute"] is True or Path(v).exists()):
            setattr(cfg, f.name, str(Path(v).resolve()))


def broken(cfg, name, v, rule):
    """What is wrong with field `name`'s value v under its declared rule, or None."""
    choices = rule["choices"]
    if callable(choices):
        choices = list(choices())
    if choices is not None and v not in choices:
        return f"{flag(name)} must be one of {', '.join(map(str, choices))}, got {v!r}"
    for bound, ok, words in ((rule["min"], lambda b: v >= b, "a number of at least"),
                             (rule["above"], lambda b: v > b, "a number above"),
                             (rule["max"], lambda b: v <= b, "at most")):
        if bound is not None and not (math.isfinite(v) and ok(bound)):
            return f"{flag(name)} must be {words} {bound}, got {v}"
    other = rule["excludes"]
    if other and v and getattr(cfg, other):
        return f"{flag(name)} and {flag(other)} contradict each other; pass one of them"
    other = rule["needs"]
    if other and v and not getattr(cfg, other):
        return f"{flag(name)} needs {flag(other)}; pass {flag(other)} too, or drop {flag(name)}"
    return rule["check"] and rule["check"](cfg)


def parse_config(cls, argv=None, description=None):
    """A config dataclass from argv: a --flag per field (bool: a switch; list: 0 or more, a REQUIRED
    one positional). An empty value for a flag that refuses one (see opt) is a ModelError. A config
    with PRESETS ({name: flags}) takes --preset NAME as those flags written first (flags given win).
    A fork's name and flags, and the preset's, are said first (under torchrun, by rank 0)."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    cfg = _parse(cls, argv, description)
    preset = getattr(cfg, "preset", "")
    said = [f"{forks.FORK} ({forks.own_flags(cfg)})"] if forks.FORK else []
    if preset in getattr(cls, "PRESETS", {}):
        said.append(f"--preset {preset}: {cls.PRESETS[preset]} (flags given win)")
        cfg = _parse(cls, cls.PRESETS[preset].split() + argv, description)
    if said and devices.launch()[0] == 0:
        print("; ".join(said))
    return cfg


def _parse(cls, argv, description):
    """parse_config's parse of argv, presets aside."""
    description = description or inspect.cleandoc(cls.__doc__ or "")
    formatter = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(description=description, formatter_class=formatter)
    hints = get_type_hints(cls)
    actions = [_add_flag(p, f, hints[f.name]) for f in fields(cls)]
    one_value = {a.option_strings[0] for a in actions if a.option_strings and a.nargs is None}
    args = vars(p.parse_args(_negatives_joined(argv, one_value)))
    for f in fields(cls):
        # an empty path would name the working directory
        if args[f.name] != "" or f.default == "" or f.metadata["empty_ok"]:
            continue
        if f.default is MISSING:
            todo = "pass a value"
        elif f.default is None:
            todo = "pass a value, or drop the flag"
        else:
            todo = f"pass a value, or drop the flag to use its default, {f.default}"
        raise ModelError(f"{flag(f.name)} is empty; {todo}")
    return cls(**args)


def _negatives_joined(argv, one_value):
    """argv with `--flag -1e-5` written `--flag=-1e-5` for the flags that take one value: argparse
    (before Python 3.13) takes a value that starts with '-' for a flag unless it is a plain decimal,
    and stops with "expected one argument"; joined, the value reaches the flag's own check."""
    joined = []
    for a in argv:
        if joined and joined[-1] in one_value and re.match(r"-[\d.]", a):
            joined[-1] = f"{joined[-1]}={a}"
        else:
            joined.append(a)
    return joined


def _add_flag(p, f, hint):
    """The argparse argument (returned) of the config field f, of type hint."""
    required = f.default is MISSING and f.default_factory is MISSING
    default = f.default if f.default_factory is MISSING else f.default_factory()
    text = f.metadata["help"]
    if not required and default is not None and hint is not bool:
        text += f" (default: {default})"
    # argparse %-formats help
    text = text.replace("%", "%%")
    if type(None) in get_args(hint):
        hint = next(t for t in get_args(hint) if t is not type(None))
    many = get_origin(hint) is list
    typ = (get_args(hint) or [hint])[0]
    if hint is bool:
        return p.add_argument(flag(f.name), action="store_true", help=text)
    if required and many:
        return p.add_argument(f.name, type=typ, nargs="+", help=text)
    typ = int64 if typ is int else typ
    nargs = "*" if many else None
    choices = f.metadata["choices"]
    return p.add_argument(flag(f.name), type=typ, nargs=nargs, default=default, required=required,
                          choices=None if callable(choices) else choices, help=text)


def int64(text):
    """argparse's int, refused (as argparse refuses "x") beyond the 64 bits of torch's seeds."""
    value = int(text)
    if abs(value) >= 2 ** 63:
        raise ValueError(text)
    return value


def check_finite(cfg, step, values, name):
    """distill.py's numerical guard: a ModelError naming (name(i)) the first value that is not
    finite, or is below 0 beyond rounding (each is a KL, an l2 distance or a cross-entropy)."""
    for i, v in enumerate(values):
        todo = "lower --lr-z/--lr-alpha or use --dtype float32"
        if v < -1e-4:
            todo = "no loss here can be negative, so the code that computed it is wrong"
        if v < -1e-4 or not math.isfinite(v):
            raise ModelError(f"{name(i)} became {v} at step {step}; the checkpoint in "
                             f"{cfg.out_dir} was not updated; {todo}")
