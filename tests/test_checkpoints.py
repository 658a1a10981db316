"""distill.py's checkpoints (resume.py, files.py, forks.py): saved file by file into --out-dir beside the user's
files, each whole and of the umask's mode, never taken for whole when a save was cut short; resumed only on the
token files it began with, by the script that wrote it, with settings of their own types."""

import json
import os
import re
import shutil
import signal
import stat
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import datafiles
import distill
import door
import files
import forks
import resume
import tasks
import window
from conftest import TEXT, distill_args, edit_json, snapshot
from test_experiments import forked, refusal


def tiny_run(ckpt, data, out, *extra):
    """distill_args of a 4-feature run with a 4-step schedule."""
    return distill_args(ckpt, data, out, "--alloc", "fix", "--budget", "4", "--decay-steps", "4", *extra)


def step_of(out):
    return json.loads((out / "config.json").read_text())["step"]


def test_saves_replace_only_the_checkpoints_files_each_of_the_umasks_mode(setup, tmp_path):
    """The user's files in --out-dir (notes, dof.py's dof.json, evaluate.py's --output) stay through a save, a
    --resume and an --overwrite (each save had renamed a fresh folder over --out-dir, deleting them); every file a
    run writes, the token files it prepares and its lock included, takes the umask's mode (features.safetensors had
    been 0600)."""
    d, ckpt, _ = setup
    (texts := tmp_path / "texts").mkdir()
    (texts / "a.txt").write_text(TEXT.read_text(encoding="utf-8")[:40_000], encoding="utf-8")
    out = tmp_path / "run"
    run = tiny_run(ckpt, texts, out)
    mine = {"notes.txt": "mine", "dof.json": "{}", "eval.json": "[]"}
    umask = os.umask(0o022)
    try:
        distill.main(run + ["--max-steps", "1"])
        for name, text in mine.items():
            (out / name).write_text(text)
        distill.main(run + ["--max-steps", "2", "--resume"])
        assert step_of(out) == 2
        distill.main(run + ["--max-steps", "1", "--overwrite"])
        with files.exclusive(tmp_path / "run.lock", "run", "--out-dir"):
            lock = stat.S_IMODE((tmp_path / "run.lock").stat().st_mode)
    finally:
        os.umask(umask)
    assert step_of(out) == 1 and {n: (out / n).read_text() for n in mine} == mine
    assert sorted(p.name for p in out.iterdir()) == sorted([*files.CHECKPOINT_FILES, *mine])
    written = [*(out / n for n in files.CHECKPOINT_FILES), *(texts / n for n in ("train.bin", "val.bin", "meta.json"))]
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in written} == {p.name: 0o644 for p in written}
    assert lock == 0o644


def test_a_save_cut_short_between_two_renames_is_never_taken_for_a_whole_checkpoint(setup, tmp_path, monkeypatch):
    """A save writes every file under a temp name, then renames them, config.json last: killed between two renames,
    the folder holds the new features beside the old config.json, which --resume, --init-from and load_student
    refuse in one sentence (the step each file records differs); renaming the .tmp files left finishes the save,
    and --resume continues it."""
    d, ckpt, data = setup
    out = tmp_path / "run"
    run = tiny_run(ckpt, data, out, "--eval-interval", "1")
    distill.main(run + ["--max-steps", "1"])
    replace = os.replace

    def killed_after_the_first(src, dst):
        replace(src, dst)
        raise SystemExit("killed")
    monkeypatch.setattr(os, "replace", killed_after_the_first)
    with pytest.raises(SystemExit):
        distill.main(run + ["--max-steps", "2", "--resume"])
    monkeypatch.undo()
    assert sorted(p.name for p in out.glob("*.tmp")) == ["config.json.tmp", "metrics.json.tmp", "optim.pt.tmp"]
    assert files.is_checkpoint(out) and step_of(out) == 1
    sentence = (f"^{re.escape(str(out))} holds parts of two saves \\(config.json of step 1, features.safetensors of "
                r"step 2\): a save was cut short; rename each of its .tmp files over the file of that name to finish "
                r"it, or distil it again$")
    before = snapshot(tmp_path)
    for argv in (run + ["--max-steps", "3", "--resume"],
                 distill_args(ckpt, data, tmp_path / "next", "--init-from", out, "--max-steps", "3")):
        with pytest.raises(door.ModelError, match=sentence):
            distill.main(argv)
    with pytest.raises(door.ModelError, match=sentence):
        tasks.load_student(out)
    assert snapshot(tmp_path) == before
    for tmp in out.glob("*.tmp"):
        tmp.rename(tmp.with_suffix(""))
    distill.main(run + ["--max-steps", "3", "--resume"])
    assert step_of(out) == 3


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_the_renames_of_a_save_acts_after_the_last(tmp_path, monkeypatch, sig):
    """Ctrl-C or SIGTERM between two renames (the one moment the files are of two saves) waits for the last: every
    file is the new one, no temp file is left, then the signal acts as it would have."""
    paths = [tmp_path / name for name in files.CHECKPOINT_FILES]
    for p in paths:
        p.write_text("old")
    replace, raised = os.replace, []

    def signalled(src, dst):
        replace(src, dst)
        if Path(dst).name == paths[0].name:
            os.kill(os.getpid(), sig)

    def stop(signum, frame):
        raised.append(signum)
        raise KeyboardInterrupt
    handler = signal.signal(sig, stop)
    monkeypatch.setattr(os, "replace", signalled)
    try:
        with pytest.raises(KeyboardInterrupt):
            with files.atomic_files(paths) as tmps:
                for tmp in tmps:
                    tmp.write_text("new")
    finally:
        assert signal.signal(sig, handler) is stop
    assert raised == [sig] and [p.read_text() for p in paths] == ["new"] * len(paths)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files.CHECKPOINT_FILES)


def test_resume_refuses_token_files_that_changed_since_the_run_began(setup, tmp_path, monkeypatch):
    """config.json records train.bin and val.bin by size and SHA-256: --resume on token files that grew, were cut
    short, were rewritten in place or are gone is one sentence naming the file, before the data is read or prepared
    again (they had been used silently); a checkpoint without the record resumes, checked by counts as before, and
    records them."""
    d, ckpt, _ = setup
    data = shutil.copytree(setup[2], tmp_path / "tok")
    out = tmp_path / "run"
    run = tiny_run(ckpt, data, out)
    distill.main(run + ["--max-steps", "1"])
    record = json.loads((out / "config.json").read_text())["data"]["files"]
    assert record == resume.token_files(data) and record["val.bin"]["bytes"] == (data / "val.bin").stat().st_size
    train, val = (data / "train.bin").read_bytes(), (data / "val.bin").read_bytes()
    changes = [   # (the file, its new bytes or None: gone, the reason named)
        ("train.bin", train + train[:2], f"it holds {len(train) + 2:,} bytes, not {len(train):,}"),
        ("val.bin", val[:-2], f"it holds {len(val) - 2:,} bytes, not {len(val):,}"),
        ("val.bin", bytes([val[0] ^ 1]) + val[1:], "its bytes differ"),
        ("train.bin", None, "it is gone"),
    ]
    monkeypatch.setattr(datafiles, "open_data", lambda *a, **k: pytest.fail("the token files were read"))
    for name, content, why in changes:
        (data / name).unlink()
        if content is not None:
            (data / name).write_bytes(content)
        before = snapshot(tmp_path)
        sentence = (f"{data / name} is not the token file that {out} was trained on ({why}); put back the token "
                    f"files it was started with, or pass --init-from {out} and another --out-dir to train on from its "
                    "features")
        with pytest.raises(door.ModelError, match=f"^{re.escape(sentence)}$"):
            distill.main(run + ["--max-steps", "2", "--resume"])
        assert snapshot(tmp_path) == before
        (data / name).write_bytes(train if name == "train.bin" else val)
    monkeypatch.undo()
    cfg = json.loads((out / "config.json").read_text())
    del cfg["data"]["files"]                                           # a checkpoint from before the record
    (out / "config.json").write_text(json.dumps(cfg))
    distill.main(run + ["--max-steps", "2", "--resume"])
    assert step_of(out) == 2 and json.loads((out / "config.json").read_text())["data"]["files"] == record


def test_a_checkpoint_resumes_only_in_the_script_that_wrote_it(setup, tmp_path):
    """distill.py's checkpoint ("fork": null) resumed by experiments/window.py had trained on as the window's model
    and been relabelled the window's; window.py's resumed by distill.py is refused by the fork check. A flag of this
    script that the checkpoint lacks is named as lacking (its default had been named as the value the run was
    started with). --init-from a core checkpoint into a fork starts a new run, and stays allowed."""
    d, ckpt, data = setup
    core, win = tmp_path / "core", tmp_path / "win"
    distill.main(tiny_run(ckpt, data, core, "--max-steps", "1"))
    with forked("window", window.REPLACE):
        distill.main(tiny_run(ckpt, data, win, "--window", "8", "--max-steps", "1"))
        sentence = (f"{core} was written by distill.py, not experiments/window.py; resume it with distill.py, or pass "
                    f"--init-from {core} and another --out-dir to train on from its features here")
        with pytest.raises(door.ModelError, match=f"^{re.escape(sentence)}$"):
            distill.main(tiny_run(ckpt, data, core, "--window", "8", "--max-steps", "2", "--resume"))
        distill.main(tiny_run(ckpt, data, tmp_path / "new", "--window", "8", "--init-from", core, "--max-steps", "1"))
    assert json.loads((tmp_path / "new" / "config.json").read_text())["fork"] == "experiments/window.py"
    with pytest.raises(door.ModelError, match=f"^{re.escape(refusal(win, 'window', ckpt))}$"):
        distill.main(tiny_run(ckpt, data, win, "--max-steps", "2", "--resume"))
    assert forks.FORK is None and step_of(core) == step_of(win) == 1
    cfg = json.loads((core / "config.json").read_text())
    del cfg["args"]["seed"]                                            # a script without --seed started it
    (core / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(door.ModelError, match=f"^{re.escape(str(core))} was started by a script without --seed; "
                                              "resume it with the script that started it$"):
        distill.main(tiny_run(ckpt, data, core, "--max-steps", "2", "--resume"))


def test_checkpoint_values_of_another_type_are_refused(setup, tmp_path, monkeypatch):
    """An edited config.json ("center_keys": "no" among the flags, or as the setting a student is built with) is
    one sentence for --resume and --init-from before the token files are read, and integer or float64 features one
    once the student is built; nothing is written (the string had been copied into the next run as a true value;
    the integers had loaded, cast, and changed the loss)."""
    d, ckpt, data = setup
    base = tmp_path / "base"
    distill.main(tiny_run(ckpt, data, base, "--max-steps", "1"))

    def edited(name, change):
        c = shutil.copytree(base, tmp_path / name)
        change(c)
        return c
    args = json.loads((base / "config.json").read_text())["args"]
    feats = load_file(base / "features.safetensors")
    k = next(iter(feats))
    cases = [   # (the checkpoint, the sentence, whether it comes before the token files are read)
        (edited("args", lambda c: edit_json(c / "config.json", args={**args, "center_keys": "no"})),
         r'config.json records center_keys as "no", not true or false: it was edited; put back the value the run '
         r"wrote$", True),
        (edited("top", lambda c: edit_json(c / "config.json", center_keys="no")), r'records center_keys as "no"', True),
        (edited("budget", lambda c: edit_json(c / "config.json", budget=4.0)), r"records budget as 4.0, not a whole",
         True),
        (edited("int", lambda c: save_file({**feats, k: feats[k].long()}, c / "features.safetensors")),
         rf"^{re.escape(k)} in \S+int holds torch.int64, not the student's torch.float32: the checkpoint was not "
         r"written by distill.py; pass one that was, or train it again$", False),
        (edited("double", lambda c: save_file({**feats, k: feats[k].double()}, c / "features.safetensors")),
         r"holds torch.float64, not the student's torch.float32", False),
    ]
    for c, sentence, early in cases:
        for argv in (tiny_run(ckpt, data, c, "--max-steps", "2", "--resume"),
                     tiny_run(ckpt, data, tmp_path / "x", "--init-from", c, "--max-steps", "2")):
            if c.name == "args" and "--init-from" in argv:                # --init-from takes none of its flags
                continue
            before = snapshot(tmp_path)
            with monkeypatch.context() as m:
                if early:
                    m.setattr(datafiles, "open_data", lambda *a, **k: pytest.fail("the token files were read"))
                with pytest.raises(door.ModelError, match=sentence):
                    distill.main(argv)
            assert snapshot(tmp_path) == before, (c.name, argv)
