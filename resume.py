"""distill.py's checkpoints, which a learner may skip: the one to start from (--init-from,
--resume) checked at the door against this run's flags, and the run's own written whole and
resumed exactly (rank 0 writes each whole into <out_dir>.tmp, then renames it into place)."""

import json
from collections import namedtuple
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

import checkpoint
import devices
import door
import files
import forks
import dof
from model import feature_state


FROM_CHECKPOINT = ("budget", "alloc", "lam", "lam_relative", "J", "feature_map", "chunk_size",
                   "center_keys")
# from_checkpoint's: config.json's dict, the feature tensors
Checkpoint = namedtuple("Checkpoint", "path config features")


def from_checkpoint(cfg):
    """--resume / --init-from: that Checkpoint, refused before any work where it does not fit this
    run (a resumed run must end as the uninterrupted one would)."""
    path = cfg.out_dir if cfg.resume else cfg.init_from
    prev, sd = checkpoint.read_student(path)
    flag = "--resume" if cfg.resume else "--init-from"
    checkpoint.check_teacher(prev, cfg.model, f"{flag} {path}")
    if cfg.resume:
        check_resume(cfg, path, prev)
    if cfg.dims and dof.parse_dims(cfg.dims, len(prev["dims"])) != prev["dims"]:
        raise door.ModelError(f"{path} was trained with dims {prev['dims']}, "
                                f"not --dims {cfg.dims}; drop --dims")
    print(f"note: {', '.join(FROM_CHECKPOINT)} and the features come from {path}")
    return Checkpoint(path, prev, sd)


def with_checkpoint_settings(cfg, prev):
    """A copy of cfg with Checkpoint prev's FROM_CHECKPOINT settings (config.json records them)."""
    return cfg.updated(**{k: prev.config.get(k, getattr(cfg, k)) for k in FROM_CHECKPOINT})


def check_resume(cfg, path, prev):
    """--resume: RESUMED's flags as the checkpoint was started with, the schedule's length,
    torchrun's process count, and no flag of a fork's that this script lacks."""
    args = prev.get("args")
    if not isinstance(args, dict):
        raise door.ModelError(f"{path}'s config.json records no args, the flags to resume it "
                                f"with; pass --init-from {path} and another --out-dir to train on "
                                "from its features")
    # a fork's flag that the script which started it lacks: its default
    defaults = {name: getattr(type(cfg), name, None) for name in cfg.RESUMED}
    was = defaults | args | {"nproc_per_node": prev.get("world_size", 1),
                             "decay_steps": args.get("decay_steps") or args.get("max_steps")}
    now = asdict(cfg) | {"decay_steps": cfg.decay_steps or cfg.max_steps,
                         "nproc_per_node": devices.get_world_size()}
    if lost := sorted(k for k in was.keys() - now.keys() if was[k]):
        raise door.ModelError(f"{path} was started with --{lost[0].replace('_', '-')} "
                                f"{was[lost[0]]!r}, which this script lacks; resume it with the "
                                "script that started it (experiments/*.py)")
    for name in cfg.RESUMED + ("decay_steps", "nproc_per_node"):
        a, b = was.get(name), now[name]
        # one directory, however spelled
        if name in ("data", "init_from") and a and b:
            a, b = Path(a).resolve(), Path(b).resolve()
        if a is None or a == b:
            continue
        flag = "--" + name.replace("_", "-")
        todo = "resume it with the flags it was started with"
        if name == "nproc_per_node":
            flag = "torchrun --nproc_per_node"
        if name == "decay_steps":
            todo = f"pass --decay-steps {a} to keep its schedule's length"
        elif args.get("preset", "") != cfg.preset:
            check_preset(path, args.get("preset", ""), cfg.preset, flag, a, b)
        raise door.ModelError(f"{path} was started with {flag} {was[name]!r}, not {now[name]!r}; "
                                f"{todo}")


def check_preset(path, was, now, flag, a, b):
    """--resume: a flag that differs because --preset does, refused naming --preset (the flag was
    not typed)."""
    preset = f"--preset {was or now}"
    how = "with" if was else "without"
    raise door.ModelError(f"{path} was started {how} {preset}, so its {flag} was {a!r}, not "
                            f"{b!r}; resume it {how} {preset}")


def check_same_tokens(cfg, prev, meta):
    """--resume: --data holds the token files that the checkpoint was trained on."""
    was = prev.config.get("data", {}).get("tokens", meta.get("tokens"))
    if was != meta.get("tokens"):
        raise door.ModelError(f"{cfg.data} now holds other token files than {cfg.out_dir} "
                                f"was trained on ({meta.get('tokens')}, not {was}); resume it on "
                                "the data it was started with")


def save_checkpoint(cfg, student, optim, gen, config, metrics):
    """--out-dir whole or as it was: the features, config.json, metrics.json and optim.pt."""
    state = {"optimizer": optim.state_dict() if optim else None, "step": config["step"],
             "train_rng": gen.get_state(), "torch_rng": torch.get_rng_state()}
    try:
        with files.atomic_path(cfg.out_dir, directory=True) as tmp:
            save_file(feature_state(student), str(tmp / "features.safetensors"))
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            (tmp / "metrics.json").write_text(json.dumps(metrics) + "\n")
            torch.save(state, tmp / "optim.pt")
    # a full disk; torch.save's is a RuntimeError
    except (OSError, RuntimeError, SafetensorError) as e:
        todo = "make room, then run it again"
        if files.is_checkpoint(cfg.out_dir):
            todo = ("the checkpoint saved before is whole: make room, then add --resume to "
                    "continue from it")
        why = str(e).strip()[:80]
        raise door.ModelError(f"saving into {cfg.out_dir} failed ({why}); {todo}") from None


def restore(cfg, optim, gen):
    """--resume: the optimizer, data position and torch RNG of --out-dir's -> (step, metrics)."""
    out, todo = Path(cfg.out_dir), "the checkpoint is damaged; pass --overwrite to start again"
    state = files.torch_load(out / "optim.pt", todo)
    metrics = files.read_json(out / "metrics.json", todo, dict)
    # another run's files, or edited ones, raise one of the errors caught
    try:
        if optim is not None:
            optim.load_state_dict(state["optimizer"])
            if any(s["exp_avg"].shape != p.shape for p, s in optim.state.items()):
                raise ValueError("its Adam moments are of other dims")
        gen.set_state(state["train_rng"])
        torch.set_rng_state(state["torch_rng"])
        step = int(state["step"])
        metrics["val"] + metrics["history"]                                 # both lists, as saved
        # saved right after a validation
        if step != metrics["val"][-1]["step"]:
            raise ValueError(f"its step {step} is not its last validation's")
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        raise door.ModelError(f"{out}'s optim.pt or metrics.json does not fit it "
                                f"({type(e).__name__}: {str(e)[:60]}); {todo}") from None
    if step > cfg.max_steps:
        raise door.ModelError(f"{out} is at step {step}, past --max-steps {cfg.max_steps}; "
                                f"pass --max-steps {step} or more")
    print(f"resuming {cfg.out_dir} at step {step}")
    return step, metrics


def run_record(cfg, dims, layer_dof, meta, step):
    """config.json: the student that load_student reads (teacher, dims, settings), and its run."""
    data = {"dir": cfg.data, "tokens": meta.get("tokens"), "source": meta.get("source"),
            "tokenizer": meta["tokenizer"].get("model")}
    # a local teacher is known by its fingerprint, wherever it lies
    fingerprint = checkpoint.fingerprint(cfg.model) if checkpoint.is_local(cfg.model) else None
    return {"teacher": cfg.model, "teacher_fingerprint": fingerprint,
            "dims": dims, "dof": layer_dof,
            **{k: getattr(cfg, k) for k in FROM_CHECKPOINT + ("loss", "seed", "block_size")},
            "init_from": cfg.init_from or None, "world_size": devices.get_world_size(), "step": step,
            "fork": forks.FORK,
            "data": data, "args": asdict(cfg)}
