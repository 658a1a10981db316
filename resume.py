"""distill.py's checkpoints, which a learner may skip: the one to start from (--init-from, --resume)
checked against this run, and the run's own saved whole (config.json last) and resumed exactly."""

import hashlib
import json
from collections import namedtuple
from dataclasses import asdict
from pathlib import Path

import safetensors.torch
import torch
from safetensors import SafetensorError

import checkpoint
import datafiles
import devices
import door
import files
import forks

FROM_CHECKPOINT = ("budget", "alloc", "lam", "lam_relative", "J", "feature_map", "chunk_size",
                   "center_keys")
# starting_point's: config.json's dict, the feature tensors
Checkpoint = namedtuple("Checkpoint", "path config features")
# what config.json records of --data, by size and hash
TOKEN_FILES = ("train.bin", "val.bin")


def starting_point(cfg):
    """-> (cfg with the settings of the checkpoint to start from, that Checkpoint), or (cfg, None)
    without --resume or --init-from; refused before any work where it does not fit this run (a
    resumed run must end as the uninterrupted one would)."""
    if not (cfg.resume or cfg.init_from):
        return cfg, None
    path = cfg.out_dir if cfg.resume else cfg.init_from
    prev, sd = checkpoint.read_student(path)
    flag = "--resume" if cfg.resume else "--init-from"
    settings = {k: prev[k] for k in FROM_CHECKPOINT if k in prev}
    checkpoint.check_settings(settings, type(cfg), Path(path) / "config.json")
    checkpoint.check_teacher(prev, cfg.model, f"{flag} {path}")
    if cfg.resume:
        check_resume(cfg, path, prev)
    if cfg.dims and datafiles.parse_dims(cfg.dims, len(prev["dims"])) != prev["dims"]:
        raise door.ModelError(f"{path} was trained with dims {prev['dims']}, "
                              f"not --dims {cfg.dims}; drop --dims")
    print(f"note: {', '.join(FROM_CHECKPOINT)} and the features come from {path}")
    return cfg.updated(**settings), Checkpoint(path, prev, sd)


def student_from(prev, teacher, cfg):
    """make_student's student of Checkpoint prev (--init-from, --resume): the teacher linearised
    with its dims, its features loaded -> (student, dims, layer DoF or None)."""
    student = teacher.linearize(prev.config["dims"], cfg.feature_map, cfg.chunk_size)
    checkpoint.load_features(student, prev.features, prev.path)
    return student, prev.config["dims"], prev.config.get("dof")


def check_resume(cfg, path, prev):
    """--resume: the script and fork that wrote the checkpoint, RESUMED's flags as it was started
    with, the schedule's length, torchrun's process count and the token files it was trained on."""
    script, here = prev.get("fork") or "distill.py", forks.FORK or "distill.py"
    if script != here:
        raise door.ModelError(f"{path} was written by {script}, not {here}; resume it with "
                              f"{script}, or pass --init-from {path} and another --out-dir to "
                              "train on from its features here")
    args = prev.get("args")
    if not isinstance(args, dict):
        raise door.ModelError(f"{path}'s config.json records no args, the flags to resume it "
                              f"with; pass --init-from {path} and another --out-dir to train on "
                              "from its features")
    checkpoint.check_settings(args, type(cfg), Path(path) / "config.json")
    was = args | {"nproc_per_node": prev.get("world_size"),
                  "decay_steps": args.get("decay_steps") or args.get("max_steps")}
    now = asdict(cfg) | {"decay_steps": cfg.decay_steps or cfg.max_steps,
                         "nproc_per_node": devices.get_world_size()}
    if lost := sorted(k for k in was.keys() - now.keys() if was[k]):
        raise door.ModelError(f"{path} was started with {door.flag(lost[0])} {was[lost[0]]!r}, "
                              "which this script lacks; resume it with the script that started it "
                              "(experiments/*.py)")
    if new := [k for k in cfg.RESUMED if k not in args]:
        raise door.ModelError(f"{path} was started by a script without {door.flag(new[0])}; "
                              "resume it with the script that started it")
    preset = args.get("preset", "")
    for name in cfg.RESUMED + ("decay_steps", "nproc_per_node"):
        a, b = was.get(name), now[name]
        # one directory, however spelled
        if name in ("data", "init_from") and a and b:
            a, b = Path(a).resolve(), Path(b).resolve()
        if a is None or a == b:
            continue
        flag = "torchrun --nproc_per_node" if name == "nproc_per_node" else door.flag(name)
        todo = "resume it with the flags it was started with"
        if name == "decay_steps":
            todo = f"pass --decay-steps {a} to keep its schedule's length"
        elif preset != cfg.preset:
            # a flag that --preset set, not one typed: name --preset
            how = "with" if preset else "without"
            named = f"--preset {preset or cfg.preset}"
            raise door.ModelError(f"{path} was started {how} {named}, so its {flag} was {a!r}, "
                                  f"not {b!r}; resume it {how} {named}")
        raise door.ModelError(f"{path} was started with {flag} {was[name]!r}, not {now[name]!r}; "
                              f"{todo}")
    check_same_files(cfg, path, prev)


def check_same_tokens(cfg, prev, meta):
    """--resume: --data holds as many tokens as the checkpoint was trained on (check_same_files
    checks their bytes, where config.json records them); nothing to check without --resume."""
    if not cfg.resume:
        return
    data = prev.config.get("data")
    was = data.get("tokens", meta.get("tokens")) if isinstance(data, dict) else meta.get("tokens")
    if was != meta.get("tokens"):
        raise door.ModelError(f"{cfg.data} now holds other token files than {cfg.out_dir} "
                              f"was trained on ({meta.get('tokens')}, not {was}); resume it on "
                              "the data it was started with")


def token_files(data):
    """--data's train.bin and val.bin -> {name: {"bytes": its size, "sha256": its hash}, or None
    where it is not a file}: what config.json records of them."""
    found = dict.fromkeys(TOKEN_FILES)
    for name in TOKEN_FILES:
        path = Path(data) / name
        if path.is_file():
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
            found[name] = {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}
    return found


def check_same_files(cfg, path, prev):
    """--resume: --data's token files byte for byte those the checkpoint's run began with, where
    its config.json records them (an older one: check_same_tokens)."""
    data = prev.get("data")
    was = data.get("files") if isinstance(data, dict) else None
    if not isinstance(was, dict):
        return
    now = token_files(cfg.data)
    for name in TOKEN_FILES:
        if name not in was or was[name] == now[name]:
            continue
        a, b = was[name], now[name]
        why = "its bytes differ"
        if b is None:
            why = "it is gone"
        elif isinstance(a, dict) and type(a.get("bytes")) is int and a["bytes"] != b["bytes"]:
            why = f"it holds {b['bytes']:,} bytes, not {a['bytes']:,}"
        raise door.ModelError(f"{Path(cfg.data) / name} is not the token file that {path} was "
                              f"trained on ({why}); put back the token files it was started with, "
                              f"or pass --init-from {path} and another --out-dir to train on from "
                              "its features")


def save_checkpoint(cfg, student, optim, gen, config, metrics):
    """The checkpoint's files (files.CHECKPOINT_FILES) into --out-dir, each whole, config.json last:
    all of this save or all of the one before; each records the step (the features in metadata).
    Rank 0 saves; the other processes return at once."""
    if not devices.is_main():
        return
    state = {"optimizer": optim.state_dict() if optim else None, "step": config["step"],
             "train_rng": gen.get_state(), "torch_rng": torch.get_rng_state()}
    # a link stays, and its target is written
    out = Path(cfg.out_dir).resolve()
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        with files.atomic_files([out / name for name in files.CHECKPOINT_FILES]) as tmp:
            features = checkpoint.feature_state(student)
            metadata = {"step": str(config["step"])}
            tmp[0].write_bytes(safetensors.torch.save(features, metadata=metadata))
            tmp[1].write_text(json.dumps(metrics) + "\n")
            torch.save(state, tmp[2])
            tmp[3].write_text(json.dumps(config, indent=2) + "\n")
    # a full disk; torch.save's is a RuntimeError
    except (OSError, RuntimeError, SafetensorError) as e:
        # a folder this save made goes, empty (its files went)
        if made and out.exists():
            out.rmdir()
        todo = "make room, then run it again"
        if files.is_checkpoint(out):
            todo = ("the checkpoint saved before is whole: make room, then add --resume to "
                    "continue from it")
        why = str(e).strip()[:80]
        raise door.ModelError(f"saving into {cfg.out_dir} failed ({why}); {todo}") from None


def restore(cfg, optim, gen):
    """--resume: --out-dir's optimizer state, data position and torch RNG -> (step, metrics)."""
    if not cfg.resume:
        return 0, {"history": [], "val": []}
    out, todo = Path(cfg.out_dir), "the checkpoint is damaged; pass --overwrite to start again"
    state = files.read_file(out / "optim.pt", todo,
                            lambda p: torch.load(p, map_location="cpu", weights_only=False))
    metrics = files.read_json(out / "metrics.json", todo)
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
    """config.json: the student that load_student reads (teacher, dims, settings) and its run."""
    data = {"dir": cfg.data, "tokens": meta.get("tokens"), "files": token_files(cfg.data),
            "source": meta.get("source"), "tokenizer": meta["tokenizer"].get("model")}
    # a local teacher is known by its fingerprint, wherever it lies
    fingerprint = checkpoint.fingerprint(cfg.model) if checkpoint.is_local(cfg.model) else None
    return {"teacher": cfg.model, "teacher_fingerprint": fingerprint,
            "dims": dims, "dof": layer_dof,
            **{k: getattr(cfg, k) for k in FROM_CHECKPOINT + ("loss", "seed", "block_size")},
            "init_from": cfg.init_from or None, "world_size": devices.get_world_size(), "step": step,
            "fork": forks.FORK,
            "data": data, "args": asdict(cfg)}
