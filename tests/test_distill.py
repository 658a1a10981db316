"""The command lines of data/*/prepare.py, distill.py and dof.py: a run, resume, torchrun, the lock, signals and
every kind of bad input; and distill.py's training loop, each part pinned to a known answer."""

import contextlib
import copy
import dataclasses
import filecmp
import importlib.util
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
import typing
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import checkpoint
import datafiles
import devices
import distill
import dof
import door
import evaluate
import files
import forks
import report
import resume
import tasks
from conftest import (
    FAST,
    PROXY_VARIABLES,
    ROOT,
    TEXT,
    TOK,
    TOKENIZER,
    cli,
    distill_args,
    edit_json,
    features,
    load_script,
    needs_smollm2,
    script_env,
    snapshot,
    torchrun,
)
from model import GPT, LinearAttention
from test_dof import small_pair, tiny_gpt2  # the method's test helpers
from test_loading import nudge
from tokenizer import load_tokenizer

# ==================================================================================================================
# dof.py: the profile command

def run_dof(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "dof.py"), *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env=script_env())


def check_ok(out, stdout, n_layer=2, budget=8, head_dim=16):
    res = json.loads((out / "dof.json").read_text())
    assert np.array(res["per_head_dof"]).shape == (n_layer, 2)
    assert sum(res["dims"]["dof"]) == budget * n_layer and res["dims"]["fix"] == [budget] * n_layer
    assert sorted(res["dims"]["reverse"]) == sorted(res["dims"]["dof"])
    assert res["dims"]["clip"] == np.minimum(res["dims"]["dof"], head_dim).tolist()
    assert res["layer_dof"] == np.max(res["per_head_dof"], 1).tolist()
    assert not list(out.glob("*.tmp")) and "clip" in stdout and "layer" in stdout
    return res


def token_dir(path, n=3000, seed=0):
    path.mkdir(parents=True, exist_ok=True)
    np.random.default_rng(seed).integers(0, 50257, n).astype(np.uint16).tofile(path / "train.bin")
    return path


def test_command_on_token_files(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    tiny_gpt2(ckpt)
    data = token_dir(tmp_path / "data")
    flags = ["--model", ckpt, "--data", data, "--J", 256, "--budget", 8, "--calib-batches", 2, "--block-size", 100,
             "--batch-size", 2, "--device", "cpu"]
    r = run_dof(*flags, "--out", tmp_path / "made" / "o1")                # it makes the folders --out names
    assert r.returncode == 0 and "warning: DoF/J > 0.9: the estimate saturates at J" in r.stderr, r.stderr
    check_ok(tmp_path / "made" / "o1", r.stdout)
    dof.main([str(f) for f in flags] + ["--out", str(tmp_path / "o2"), "--lam", "1e-3", "--lam-relative",
                                        "--block-size", "128", "--budget", "16"])
    res = check_ok(tmp_path / "o2", capsys.readouterr().out, budget=16)
    assert max(res["layer_dof"]) < 0.9 * 256                       # relative lambda: far from saturated
    assert max(res["dims"]["dof"]) > 16                             # so clip's cap at the head size binds
    assert res["settings"]["block_size"] == 128                     # the model's context, as asked
    dof.main([str(f) for f in flags] + ["--out", str(tmp_path / "o3"), "--center-keys"])
    centred = check_ok(tmp_path / "o3", capsys.readouterr().out)
    assert centred["per_head_dof"] != json.loads((tmp_path / "made" / "o1" / "dof.json").read_text())[
        "per_head_dof"]


def test_table_warns_where_the_dof_nears_j_or_is_0_everywhere(capsys):
    """dof.py's warnings: DoF/J above 0.9 names J as a cause as well as lambda; a DoF of 0 in every layer (lambda that
    large) says that the rules fall back to the budget everywhere, as fix; neither warns otherwise."""
    cfg = types.SimpleNamespace(model="m", J=100, lam=1.0, lam_relative=False, center_keys=False, budget=4)
    for per_head, warning in ((np.full((2, 2), 95.0), "DoF/J > 0.9: the estimate saturates at J; raise --J, or "),
                              (np.zeros((2, 2)), "every DoF is 0 (lambda is that large), so dof, clip and reverse "),
                              (np.full((2, 2), 50.0), None)):
        dims = {rule: dof.allocate(per_head.max(1), 4, rule, 16) for rule in dof.RULES}
        report.print_table(cfg, per_head, dims)
        err = capsys.readouterr().err
        assert (warning in err and err.count("warning") == 1) if warning else err == "", err


def test_command_bad_input(tmp_path):
    ckpt = tmp_path / "ckpt"
    tiny_gpt2(ckpt)
    data = token_dir(tmp_path / "data", n=200)
    common = ["--model", str(ckpt), "--data", str(data), "--out", str(tmp_path / "o"), "--device", "cpu",
              "--block-size", "50", "--batch-size", "1", "--calib-batches", "2"]
    cases = [(["--lam", "0"], "--lam must be a number above 0"),
             (["--lam", "-1", "--lam-relative"], "--lam must be a number above 0"),
             (["--lam", "inf"], "--lam must be a number above 0"),
             (["--budget", "0"], "--budget must be a number of at least 1"),
             (["--J", "1000"], "J=1000 is more than the 200 queries+keys"),
             (["--J", "0"], "--J must be a number of at least 1"),
             (["--device", "tpu"], "--device tpu is not a device of this machine"),
             (["--data", str(tmp_path / "missing")], f"{tmp_path / 'missing' / 'train.bin'} does not exist")]
    for extra, msg in cases:
        with pytest.raises(door.ModelError) as e:
            dof.main(common + extra)
        assert str(e.value).startswith(msg) and "\n" not in str(e.value), (extra, str(e.value))
    for name in ("encoder.json", "vocab.bpe"):
        shutil.copy(TOKENIZER / name, ckpt / name)
    (data / "meta.json").write_text(json.dumps({"tokenizer": {"model": "smollm2-135m", "n_vocab": 49152}}))
    with pytest.raises(door.ModelError, match=r"was tokenized with the tokenizer of smollm2-135m \(49152 tokens\), not "):
        dof.main(common)                                    # prepare.py's record of another tokenizer
    (data / "meta.json").unlink()
    (data / "train.bin").write_bytes(b"abc")
    with pytest.raises(door.ModelError, match="odd number of bytes"):
        dof.main(common)
    np.array([60000] * 200, dtype=np.uint16).tofile(data / "train.bin")
    with pytest.raises(door.ModelError, match="token id 60000, but the model has 50257 embeddings"):
        dof.main(common)
    (data / "train.bin").write_bytes(b"")
    with pytest.raises(door.ModelError, match="holds 0 tokens"):
        dof.main(common)
    np.arange(100, dtype=np.uint16).tofile(data / "train.bin")
    with pytest.raises(door.ModelError, match="holds 100 tokens, fewer than the 129 needed"):   # windows of 128 + 1
        dof.main(common + ["--block-size", "128"])
    r = run_dof(*common, "--lam", "0")                      # the command: one sentence, exit code 2
    assert r.returncode == 2 and r.stderr == "error: --lam must be a number above 0, got 0.0\n"
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "model_type": "bert"}))
    r = run_dof(*common)                                    # not a model with attention of a known kind
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "'bert'" in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "o").exists()                    # nothing half-written


# ==================================================================================================================
# data/ and distill.py: the distillation command, resume, bad input

@pytest.fixture(scope="module")
def trained(setup):
    """The main command line (shortened context): 50 softmax-loss steps at budget 16, DoF allocation."""
    d, ckpt, data = setup
    out = d / "run-softmax"
    r = cli("distill.py", "--model", ckpt, "--data", data, "--budget", 16, "--loss", "softmax", "--max-steps", 50,
            "--out-dir", out, *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


def test_prepare_text_keeps_the_files_line_endings(setup, tmp_path):
    """\r\n and a lone \r reach the tokenizer as they are in the file, not as Python's universal newlines."""
    from tokenizer import load_tokenizer
    d, ckpt, _ = setup
    raw = b"line one\r\nline two\r\nprogress 10%\rprogress 20%\r\n" * 40
    (tmp_path / "crlf.txt").write_bytes(raw)
    r = cli("data/text/prepare.py", "--model", ckpt, "--out", tmp_path / "out", "--val-fraction", "0.1",
            tmp_path / "crlf.txt")
    assert r.returncode == 0, r.stderr[-2000:]
    enc = load_tokenizer(ckpt)
    ids = np.concatenate([np.fromfile(tmp_path / "out" / f"{s}.bin", dtype=np.uint16) for s in ("train", "val")])
    assert ids.tolist() == enc.encode_ordinary(raw.decode()) + [enc.eot_token]
    assert datafiles.read_tokens(tmp_path / "crlf.txt", enc).tolist() == enc.encode_ordinary(raw.decode())
    (tmp_path / "second.txt").write_text("Second file, one line. " * 30)     # two files: an end-of-text after each
    r = cli("data/text/prepare.py", "--model", ckpt, "--out", tmp_path / "two", "--val-fraction", "0.1",
            tmp_path / "crlf.txt", tmp_path / "second.txt")
    ids = np.concatenate([np.fromfile(tmp_path / "two" / f"{s}.bin", dtype=np.uint16) for s in ("train", "val")])
    assert r.returncode == 0 and ids.tolist() == enc.encode_ordinary(raw.decode()) + [enc.eot_token] + \
        enc.encode_ordinary("Second file, one line. " * 30) + [enc.eot_token]
    (tmp_path / "latin.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(door.ModelError, match=r"latin.txt is neither a .bin token file nor UTF-8 text; convert it to UTF-8 "
                                         r"\(iconv -t utf-8\) or pass a .bin of data/\*/prepare.py$"):
        datafiles.read_tokens(tmp_path / "latin.txt", enc)


def test_prepare_refuses_a_second_writer_of_one_directory(setup, tmp_path):
    """Two runs preparing one directory at once (two distill.py runs on a fresh --data): the second is one sentence
    and writes nothing, where it would have renamed the first run's half-written files into place."""
    import fcntl
    d, ckpt, _ = setup
    (tmp_path / "out").mkdir()
    with open(tmp_path / "out" / "prepare.lock", "w") as lock:        # the first run, still writing
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(door.ModelError, match=r"another run is writing token files into .*out \(it holds .*lock\)"):
            datafiles.data_script("text").main(["--model", str(ckpt), "--out", str(tmp_path / "out"), str(TEXT)])
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["prepare.lock"]


def test_prepare_text_writes_uint16_tokens_and_meta(setup):
    from tokenizer import load_tokenizer
    d, ckpt, data = setup
    meta = json.loads((data / "meta.json").read_text())
    train = np.memmap(data / "train.bin", dtype=np.uint16, mode="r")
    val = np.memmap(data / "val.bin", dtype=np.uint16, mode="r")
    enc = load_tokenizer(ckpt)
    ids = enc.encode_ordinary(TEXT.read_text(encoding="utf-8")) + [enc.eot_token]   # one file, then end-of-text
    assert meta["tokens"] == {"train": len(train), "val": len(val)}
    assert np.array_equal(np.concatenate([train, val]), np.array(ids, dtype=np.uint16))
    assert len(val) == round(0.05 * len(ids))
    assert meta["tokenizer"]["n_vocab"] == 50257 and meta["tokenizer"]["eot"] == 50256
    assert not list(data.glob("*.tmp"))


class OrdEncoder:
    """A stand-in tokenizer whose ids are the characters' code points: every count below is known by hand."""
    name, n_vocab, eot_token = "ord", 65536, 65535

    def encode_ordinary(self, text):
        return [ord(c) for c in text]

    def encode_ordinary_batch(self, texts, num_threads=1):
        return [self.encode_ordinary(t) for t in texts]


def text_prepare():
    spec = importlib.util.spec_from_file_location("text_prepare", ROOT / "data" / "text" / "prepare.py")
    spec.loader.exec_module(prep := importlib.util.module_from_spec(spec))
    return prep


def test_prepare_text_holds_out_the_rounded_share_and_a_failed_rename_leaves_no_meta(tmp_path, monkeypatch):
    """14 characters and end-of-text are 15 ids: --val-fraction 0.1 holds out the last round(1.5) = 2. When the
    renames fail midway, meta.json is gone (it was removed before them), so the folder reads as incomplete."""
    prep, enc = text_prepare(), OrdEncoder()
    (tmp_path / "a.txt").write_text("abcdefghijklmn")
    cfg = prep.TextConfig(files=[str(tmp_path / "a.txt")], model="ord", out=str(tmp_path / "out"), val_fraction=0.1)
    meta = prep.prepare(cfg, enc)
    ids = enc.encode_ordinary("abcdefghijklmn") + [65535]
    assert meta["tokens"] == {"train": 13, "val": 2}
    assert np.fromfile(tmp_path / "out" / "train.bin", np.uint16).tolist() == ids[:13]
    assert np.fromfile(tmp_path / "out" / "val.bin", np.uint16).tolist() == ids[13:]
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: replace(a, b) if Path(b).name != "train.bin" else
                        (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(door.ModelError, match=r"writing the token files into .*out failed .*; make room or pass another"):
        prep.prepare(cfg, enc)
    assert not (tmp_path / "out" / "meta.json").exists()


def test_read_tokens_refuses_an_id_the_model_has_no_embedding_for(tmp_path):
    np.array([1, 50257, 3], np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(door.ModelError, match=r"t.bin holds token id 50257, but the model has 50257 embeddings; tokenize"):
        datafiles.read_tokens(tmp_path / "t.bin", vocab_size=50257)
    assert datafiles.read_tokens(tmp_path / "t.bin", vocab_size=50258).tolist() == [1, 50257, 3]


def test_read_tokens_refuses_a_path_that_is_no_token_file_saying_how_to_make_one(tmp_path, enc):
    (tmp_path / "t.txt").write_text("text")
    todo = "make it with data/\\*/prepare.py, whose --out is the folder to pass"
    with pytest.raises(door.ModelError, match=rf"^\S+t.txt is not a .bin token file; {todo}$"):
        datafiles.read_tokens(tmp_path / "t.txt")                     # text needs a tokenizer
    with pytest.raises(door.ModelError, match=rf"^\S+ is a directory; {todo}$"):
        datafiles.read_tokens(tmp_path)
    with pytest.raises(door.ModelError, match=rf"^\S+gone.txt does not exist; {todo}, or pass a text file$"):
        datafiles.read_tokens(tmp_path / "gone.txt", enc)
    assert datafiles.read_tokens(tmp_path / "t.txt", enc).tolist() == enc.encode_ordinary("text")


def test_atomic_path_leaves_the_old_file_and_no_tmp_when_the_writer_fails(tmp_path):
    path = tmp_path / "out"
    path.write_text("whole")
    with pytest.raises(KeyboardInterrupt):
        with files.atomic_path(path) as tmp:
            tmp.write_text("half")
            raise KeyboardInterrupt
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and path.read_text() == "whole"


@pytest.mark.parametrize("tokenizer_name", ["gpt2-tokenizer", pytest.param("smollm2-135m", marks=needs_smollm2)])
def test_prepare_text_pieces_give_the_ids_of_the_whole_text(tokenizer_name):
    """tokenize_text's ~1 MB pieces equal one encode_ordinary call on text whose paragraphs end in blank lines and
    trailing spaces (a cut after "a\\n\\n" had made its "\\n\\n" one token)."""
    from tokenizer import load_tokenizer
    prep = text_prepare()
    enc = load_tokenizer(TOK if tokenizer_name == "gpt2-tokenizer" else tokenizer_name)
    words = TEXT.read_text(encoding="utf-8").split()[:4000]
    ends = ("\n\n", "  \n", "\n", ".\n\n\n", "\n \n")
    text = "".join(" ".join(words[i:i + 40]) + ends[i // 40 % 5] for i in range(0, 4000, 40))
    text = text * (1 + (1 << 21) // len(text))                          # > 2 MB: three pieces
    assert prep.tokenize_text(enc, text, 2) == enc.encode_ordinary(text)


def test_wikipedia_max_tokens_count_end_of_text_and_stop_after_the_article_that_reaches_them():
    """write_articles: ten kept articles of 4 characters (code-point ids, 5 tokens with end-of-text), --max-tokens 10,
    one batch of 16: exactly 2 articles are written, the cap checked after each, not at the batch's end, and 2 seen
    (the batch's other 8 are not)."""
    wiki = load_script("data/wikipedia/prepare.py")
    enc = types.SimpleNamespace(name="ord", n_vocab=65536, eot_token=65535, encode_ordinary_batch=lambda texts,
                                num_threads=1: [[ord(c) for c in t] for t in texts])
    split_files = {k: types.SimpleNamespace(ids=(ids := []), write=ids.extend) for k in ("train", "val")}
    bar = types.SimpleNamespace(n=0, update=lambda k: None, set_postfix=lambda **k: None)
    cfg = types.SimpleNamespace(seed=0, fraction=1.0, batch_docs=16, val_fraction=0.0, max_tokens=10, num_threads=1)
    assert wiki.write_articles(cfg, enc, iter(["abcd"] * 10), split_files, bar) == (2, 2)
    assert split_files["train"].ids == [97, 98, 99, 100, 65535] * 2 and split_files["val"].ids == []


def test_prepare_wikipedia_stream_selection_and_cap(setup, tmp_path, monkeypatch):
    """The Wikipedia script's loop on a stand-in stream (no internet here): a seeded random fraction of the
    articles, each followed by end-of-text, split between train and val (alike for any --batch-docs), stopped by
    --max-tokens; a stream that breaks midway is one sentence and leaves the previous files as they were."""
    import importlib.util

    from tokenizer import load_tokenizer
    spec = importlib.util.spec_from_file_location("wiki_prepare", ROOT / "data" / "wikipedia" / "prepare.py")
    wiki = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wiki)
    d, ckpt, _ = setup
    paragraphs = [p for p in TEXT.read_text(encoding="utf-8").split("\n \n") if len(p) > 200][:300]
    stream_articles = wiki.stream_articles
    monkeypatch.setattr(wiki, "stream_articles", lambda name, config: (iter(paragraphs), len(paragraphs)))
    args = ["--model", str(ckpt), "--fraction", "0.5", "--val-fraction", "0.2", "--batch-docs", "16"]
    wiki.main(args + ["--out", str(tmp_path / "all")])
    meta = json.loads((tmp_path / "all" / "meta.json").read_text())
    enc = load_tokenizer(ckpt)
    train = np.fromfile(tmp_path / "all" / "train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "all" / "val.bin", dtype=np.uint16)
    assert 100 < meta["articles_kept"] < 200 and meta["articles_seen"] == len(paragraphs)
    assert wiki.WikipediaConfig().fraction == 0.1                              # the paper's 10% by default
    assert (train == enc.eot_token).sum() + (val == enc.eot_token).sum() == meta["articles_kept"]
    assert meta["tokens"] == {"train": len(train), "val": len(val)} and 0 < len(val) < len(train)
    assert train[-1] == enc.eot_token and enc.decode(train[:50].tolist()) in "\n \n".join(paragraphs)
    monkeypatch.setattr(wiki, "stream_articles", lambda name, config: (iter(paragraphs), len(paragraphs)))
    wiki.main(args[:-1] + ["5", "--out", str(tmp_path / "small-batches")])       # the same selection and split
    for split in ("train", "val"):
        assert filecmp.cmp(tmp_path / "all" / f"{split}.bin", tmp_path / "small-batches" / f"{split}.bin", False)

    class Broken:                                                    # datasets' stream, cut after 50 articles
        def __iter__(self):
            yield from ({"text": p} for p in paragraphs[:50])
            raise ConnectionError("Read timed out")
    import datasets
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: Broken())
    monkeypatch.setattr(wiki, "hub_reachable", lambda: True)
    monkeypatch.setattr(wiki, "stream_articles", stream_articles)
    with pytest.raises(door.ModelError, match=r"the stream of .* broke \(ConnectionError: Read timed out\); run it again"):
        wiki.main(args + ["--out", str(tmp_path / "all"), "--overwrite"])
    assert json.loads((tmp_path / "all" / "meta.json").read_text()) == meta       # the previous files as they were
    monkeypatch.setattr(wiki, "stream_articles", lambda name, config: (iter(paragraphs), len(paragraphs)))
    wiki.main(args + ["--out", str(tmp_path / "cap"), "--max-tokens", "5000"])
    capped = json.loads((tmp_path / "cap" / "meta.json").read_text())
    assert 5000 <= sum(capped["tokens"].values()) < 5000 + 2000 and capped["articles_kept"] < meta["articles_kept"]


def test_cli_run_learns_every_layer(trained, setup):
    out, r = trained
    m = json.loads((out / "metrics.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["step"] == 50 and cfg["loss"] == "softmax" and cfg["budget"] == 16 and cfg["alloc"] == "dof"
    assert len(cfg["dims"]) == 4 and sum(cfg["dims"]) == 4 * 16 and len(cfg["dof"]) == 4
    for l, (first, last) in enumerate(zip(m["history"][0]["loss"], m["history"][-1]["loss"])):
        assert last <= 0.7 * first, f"layer {l}: loss {first:.4f} -> {last:.4f}, less than a 30% fall"
    # the checkpoint holds the features only, no teacher weight
    keys = features(out).keys()
    assert keys and all(".attn.core." in k for k in keys)
    assert not list(out.parent.glob(out.name + ".tmp")) and "summary:" in r.stdout


def test_trained_student_beats_untrained_on_held_out_attention(trained, setup):
    """softmax loss: the held-out attention KL (val.bin) after training is below the untrained PRF student's at
    the same dims; and load_student rebuilds exactly the saved student."""
    out, _ = trained
    m = json.loads((out / "metrics.json").read_text())
    v0, v1 = m["val"][0], m["val"][-1]
    assert v0["step"] == 0 and v1["step"] == 50
    assert all(b < a for a, b in zip(v0["attn_kl"], v1["attn_kl"])), (v0["attn_kl"], v1["attn_kl"])
    student, cfg = tasks.load_student(out)
    sd = features(out)
    for l, blk in enumerate(student.h):
        for n, t in blk.attn.core.state_dict().items():
            assert torch.equal(t, sd[f"h.{l}.attn.core.{n}"])


def test_l2_loss_student_beats_untrained_on_held_out_attention(setup, tmp_path):
    """l2 loss: the held-out attention KL falls; metrics.json's validation numbers are those of the saved student."""
    d, ckpt, data = setup
    out = tmp_path / "run-l2"
    distill.main(["--model", str(ckpt), "--data", str(data), "--budget", "16", "--loss", "l2", "--max-steps", "30",
                  "--alloc", "fix", "--out-dir", str(out), *FAST, "--eval-iters", "2"])
    m = json.loads((out / "metrics.json").read_text())
    v0, v1 = m["val"][0], m["val"][-1]
    assert all(b < a for a, b in zip(v0["attn_kl"], v1["attn_kl"])), (v0["attn_kl"], v1["attn_kl"])
    assert all(last < first for first, last in zip(m["history"][0]["loss"], m["history"][-1]["loss"]))
    # the last validation, recomputed plainly from the saved student: val.bin's two windows of generator seed + 1,
    # their mean next-token loss and, per layer, the mean KL(p_i || p^_i) over the queries of both
    student, teacher = tasks.load_student(out)[0], GPT.from_pretrained(ckpt)
    gen, tokens = torch.Generator().manual_seed(1), datafiles.read_tokens(data / "val.bin")
    val = [datafiles.get_batch(tokens, 4, 64, gen, "cpu") for _ in range(2)]
    with torch.no_grad():
        loss = np.mean([F.cross_entropy(student(x).flatten(0, 1), y.flatten()).item() for x, y in val])
        kl = np.mean([[distill.softmax_loss(*(qk := c.inputs(q, k)), *c.features(*qk)).mean().item()
                       for c, (q, k) in zip(student.cores(), dof.teacher_qk(teacher, x))] for x, _ in val], 0)
    assert v1["student_loss"] == pytest.approx(loss, rel=1e-5) and v1["attn_kl"] == pytest.approx(kl, rel=1e-4)


def test_resume_equals_uninterrupted_run(setup, tmp_path):
    """Interrupted at step 6 and resumed to 12: the features, logged losses and last validation of the run that was
    not interrupted, bit for bit (the optimizer, data position and torch RNG come from the checkpoint)."""
    d, ckpt, data = setup
    base = ["--model", str(ckpt), "--data", str(data), "--budget", "8", "--alloc", "fix", "--center-keys",
            "--decay-steps", "12", "--eval-interval", "4", *FAST]
    distill.main(base + ["--max-steps", "12", "--out-dir", str(tmp_path / "full")])
    distill.main(base + ["--max-steps", "6", "--out-dir", str(tmp_path / "part")])           # "interrupted" at step 6
    distill.main(base + ["--max-steps", "12", "--out-dir", str(tmp_path / "part"), "--resume"])
    a, b = features(tmp_path / "full"), features(tmp_path / "part")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (k, (a[k] - b[k]).abs().max())
    assert any(k.endswith("key_mean") and a[k].abs().sum() > 0 for k in a)          # --center-keys stored them
    ma, mb = (json.loads((tmp_path / n / "metrics.json").read_text()) for n in ("full", "part"))
    la, lb = ({h["step"]: h["loss"] for h in m["history"]} for m in (ma, mb))   # logged at the same steps, and more
    assert la.keys() <= lb.keys() and all(la[s] == lb[s] for s in la) and ma["val"][-1] == mb["val"][-1]
    assert [v["step"] for v in mb["val"]] == [0, 4, 6, 8, 12]     # every 4 steps and at the stop: not again at 6


def test_process_shares_interleave_to_the_one_process_batch():
    """Process r of N keeps windows r, r+N, ... of the N*B windows one process draws for batch size N*B."""
    data = np.arange(1000, dtype=np.uint16)
    one = datafiles.get_batch(data, 6, 8, torch.Generator().manual_seed(3), "cpu")
    shares = [datafiles.get_batch(data, 2, 8, torch.Generator().manual_seed(3), "cpu", (r, 3)) for r in range(3)]
    for i in range(2):                                     # x, then y
        assert torch.equal(torch.stack([s[i] for s in shares], 1).flatten(0, 1), one[i])


def test_torchrun_two_processes_train_the_features_of_one_process_and_resume(setup, tmp_path):
    """torchrun --nproc_per_node 2 with --batch-size 2 sees the batches of one process with --batch-size 4 and
    averages the gradients: the same features (fp32 rounding apart), also after a --resume under torchrun. Rank 0
    alone prints and writes; config.json records world_size; resuming with another process count is one sentence."""
    d, ckpt, data = setup
    base = ["--model", ckpt, "--data", data, "--budget", "8", "--alloc", "fix", "--decay-steps", "8",
            "--eval-interval", "4", "--eval-iters", "2", "--prompt", "", *FAST[:2], *FAST[6:]]
    distill.main([*map(str, base), "--batch-size", "4", "--max-steps", "8", "--out-dir", str(tmp_path / "one")])
    r = torchrun("distill.py", *base, "--batch-size", 2, "--max-steps", 4, "--out-dir", tmp_path / "two")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "in each of 2 processes (global batch 4)" in r.stdout and r.stdout.count("val step 0:") == 1
    r = torchrun("distill.py", *base, "--batch-size", 2, "--max-steps", 8, "--out-dir", tmp_path / "two", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming" in r.stdout and json.loads((tmp_path / "two" / "config.json").read_text())["world_size"] == 2
    one, two = features(tmp_path / "one"), features(tmp_path / "two")
    assert one.keys() == two.keys()
    for k in one:
        assert torch.allclose(one[k], two[k], rtol=1e-5, atol=1e-6), k
    ma, mb = (json.loads((tmp_path / n / "metrics.json").read_text()) for n in ("one", "two"))
    assert np.mean(mb["val"][-1]["attn_kl"]) < 0.9 * np.mean(mb["val"][0]["attn_kl"])  # trained: not trivially equal
    assert np.allclose([h["loss"] for h in ma["history"]], [h["loss"] for h in mb["history"]], rtol=1e-5)
    assert np.allclose(ma["val"][-1]["attn_kl"], mb["val"][-1]["attn_kl"], rtol=1e-5)
    r = cli("distill.py", *base, "--batch-size", 2, "--max-steps", 12, "--out-dir", tmp_path / "two", "--resume")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'two'} was started with torchrun --nproc_per_node 2, not 1; resume it with the flags it "
        "was started with"]
    assert all(torch.equal(v, features(tmp_path / "two")[k]) for k, v in two.items())


def test_bad_choices_exit_nonzero_through_the_cli(setup, capsys):
    d, ckpt, data = setup
    never = d / f"never-{random.random()}"                   # a fresh name each run of the session
    r = cli("distill.py", "--model", ckpt, "--data", data, "--loss", "mse", "--out-dir", never)
    assert r.returncode == 2 and "argument --loss: invalid choice: 'mse'" in r.stderr
    with pytest.raises(SystemExit) as e:
        distill.main(["--model", str(ckpt), "--data", str(data), "--alloc", "random", "--out-dir", str(never)])
    assert e.value.code == 2 and "argument --alloc: invalid choice: 'random'" in capsys.readouterr().err
    r = cli("distill.py", "--model", ckpt, "--data", data, "--feature-map", "relu", "--out-dir", never)
    assert r.returncode == 2 and r.stderr.strip() == ("error: --feature-map must be one of prf, performer, "
                                                      "dijiang, got 'relu'")
    r = cli("distill.py", "--model", ckpt, "--data", data, "--budget", 0, "--out-dir", never)
    assert r.returncode == 2 and r.stderr.strip() == "error: --budget must be a number of at least 1, got 0"
    r = cli("distill.py", "--model", ckpt, "--data", data, "--seed", -1, "--out-dir", never)     # numpy's seeds
    assert r.returncode == 2 and r.stderr.strip() == "error: --seed must be a number of at least 0, got -1"
    assert not never.exists()


SCRIPTS = ["distill.py", "dof.py", "evaluate.py", "docs/experiments.py", "docs/figures.py", "bench/bench.py",
           "bench/gpu_check.py", "bench/heads.py", "experiments/per_head.py", "experiments/leverage.py",
           "bench/bench_scorer.py", "experiments/direct_finetune.py", "data/text/prepare.py",
           "data/wikipedia/prepare.py", "experiments/fla_scan.py", "experiments/hedgehog.py"]


def script_config(script):
    """An entry script, imported as its own module, and its config dataclass (the one it defines, or for a fork
    without one distill.py's); a fork's main runs it through common.fork, as its command line does."""
    mod = load_script(script)
    config = next((v for k, v in vars(mod).items() if k.endswith("Config") and v.__module__ == mod.__name__),
                  distill.DistillConfig)
    if hasattr(mod, "REPLACE"):                                         # fla_scan.py's config is evaluate.py's
        command = ["evaluate"] if issubclass(config, evaluate.EvalConfig) else []
        mod.main = lambda argv: forks.fork(mod.__file__, mod.REPLACE, command + argv)
    return mod, config


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_prints_its_help(script, capsys):
    """--help prints a description and every flag of the script's config and exits 0 (argparse %-formats help text:
    a stray % in one help string would make --help itself fail; a dataclass without a docstring has its signature)."""
    mod, config = script_config(script)
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage:") and f"{config.__name__}(" not in out
    for f in dataclasses.fields(config):
        assert f"--{f.name.replace('_', '-')}" in out or f" {f.name}" in out, f.name


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_refuses_an_integer_beyond_64_bits(script, capsys):
    """An integer option of 2^63 or more (torch's seeds overflow there) is argparse's one-line refusal, exit 2."""
    mod, config = script_config(script)
    hints = typing.get_type_hints(config)
    name = next(f.name for f in dataclasses.fields(config)
                if hints[f.name] is int and f.default is not dataclasses.MISSING)
    for value in (2 ** 63, -2 ** 63 - 1):
        with pytest.raises(SystemExit) as e:
            mod.main([f"--{name.replace('_', '-')}={value}"])
        assert e.value.code == 2 and f"invalid int64 value: '{value}'" in capsys.readouterr().err


def test_a_path_the_system_refuses_is_one_sentence(setup, tmp_path):
    """A name longer than the file system allows, as --out-dir or as --data: one sentence naming it (it had been
    OSError's traceback from Path.exists); an OSError of no path stays a traceback, a fault to see whole."""
    import door
    d, ckpt, data = setup
    long = tmp_path / ("a" * 300)
    for flags in (["--out-dir", long], ["--data", long, "--out-dir", tmp_path / "out"]):
        r = cli("distill.py", "--model", ckpt, "--block-size", 64, *flags)             # within its context
        assert r.returncode == 2 and re.fullmatch(rf"error: {long}(/meta.json)?: File name too long; pass another "
                                                  r"path\n", r.stderr), r.stderr
    assert not (tmp_path / "out").exists()

    def fault():
        raise OSError(5, "Input/output error")
    with pytest.raises(OSError, match="Input/output error"):
        door.run_main(fault)


def run_bad(argv, match):
    with pytest.raises(door.ModelError, match=match) as e:
        distill.main([str(a) for a in argv])
    assert "\n" not in str(e.value)
    return e


@pytest.mark.parametrize("env", [{"RANK": "1"}, {"WORLD_SIZE": "2"}, {"RANK": "0", "WORLD_SIZE": "abc"},
                                 {"RANK": "2", "WORLD_SIZE": "2"}, {"RANK": "0", "WORLD_SIZE": "0"},
                                 {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}], ids=str)
def test_torchrun_variables_set_by_hand_are_refused_before_any_work(setup, tmp_path, monkeypatch, env):
    """RANK=1 alone had skipped the out-dir lock (two runs wrote one out-dir); WORLD_SIZE alone or not a number was
    a traceback from int() or torch.distributed. torchrun's own values pass: RANK < WORLD_SIZE and its master."""
    d, ckpt, data = setup
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    run_bad(distill_args(ckpt, data, tmp_path / "out"), r"^RANK=\S+, WORLD_SIZE=\S+ are not a process of a torchrun "
            r"launch \(0 <= RANK < WORLD_SIZE, with MASTER_ADDR and MASTER_PORT\); start it with torchrun, or unset")
    assert not any(tmp_path.iterdir())
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert devices.launch() == (1, 2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE")
    assert devices.launch() == (0, 1)                                  # RANK=0 alone: one process, as before


def test_bad_data_directories(setup, tmp_path, monkeypatch):
    """No token files and no text, so a Wikipedia sample is due, but no hub: one sentence naming the offline command,
    nothing written. Token files of another tokenizer: refused."""
    from huggingface_hub import constants
    d, ckpt, data = setup
    args = ["--model", ckpt, "--out-dir", tmp_path / "out", "--max-steps", "1", *FAST]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    offline = (r"could not fetch wikimedia/wikipedia \(20231101.en\): the Hugging Face hub cannot be reached; .*"
               r"`python distill.py --model smollm2-135m --data data/wikitext2 --preset cpu`")
    run_bad(args + ["--data", tmp_path / "nowhere"], offline)
    (tmp_path / "empty").mkdir()
    run_bad(args + ["--data", tmp_path / "empty"], offline)
    assert not (tmp_path / "nowhere").exists() and not any((tmp_path / "empty").iterdir())
    (tmp_path / "a.txt").write_text("text")
    run_bad(args + ["--data", tmp_path / "a.txt"], r"--data .*a.txt is a file; pass a directory")
    other = tmp_path / "other-tokenizer"
    shutil.copytree(data, other)
    meta = json.loads((other / "meta.json").read_text())
    meta["tokenizer"].update(model="EleutherAI/pythia-160m", n_vocab=50277)
    (other / "meta.json").write_text(json.dumps(meta))
    run_bad(args + ["--data", other], r"tokenized with the tokenizer of EleutherAI/pythia-160m .*prepare them again")
    (ro := tmp_path / "read-only").mkdir()                             # text to prepare where nothing can be written
    (ro / "a.txt").write_text("text " * 500)
    temporary_file = tempfile.TemporaryFile

    def read_only(*a, dir=None, **kw):
        if Path(dir) == ro:
            raise OSError(30, "Read-only file system")
        return temporary_file(*a, dir=dir, **kw)
    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    run_bad(args + ["--data", ro], r"^cannot write --data \S+read-only: \S+read-only is not writable \(Read-only file "
            r"system\); pass another --data$")
    assert not (tmp_path / "out").exists()


def test_existing_out_dir_and_bad_resume_leave_the_checkpoint_alone(trained, setup, tmp_path):
    d, ckpt, data = setup
    out, _ = trained
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    args = ["--model", ckpt, "--data", data, "--budget", "16", "--max-steps", "50", "--out-dir", out, *FAST]
    run_bad(args, r"already exists and is not empty; pass --resume to continue it, --overwrite to replace it")
    run_bad(args + ["--resume", "--dims", "8,8,24,24"], r"was trained with dims .*, not --dims 8,8,24,24; drop --dims")
    other = shutil.copytree(ckpt, tmp_path / "other-teacher")                 # a copy with one value changed
    nudge(other / "model.safetensors")
    run_bad(["--model", other] + args[2:] + ["--resume"],
            r"^--resume \S+ was distilled from the teacher \S+gpt2-tiny, and --model \S+other-teacher is another model "
            r"\(its config or weights differ\); pass --model \S+gpt2-tiny or a copy of it$")
    run_bad(args + ["--resume", "--overwrite"], r"contradict")
    run_bad(args + ["--resume", "--batch-size", "2"],
            r"was started with --batch-size 4, not 2; resume it with the flags it was started with")
    run_bad(args + ["--resume", "--loss", "l2"], r"was started with --loss 'softmax', not 'l2'")
    run_bad(args + ["--resume", "--seed", "1"], r"was started with --seed 0, not 1; resume it with the flags")
    for flag, value in (("--lr-z", "1e-3"), ("--lr-alpha", "1e-3"), ("--block-size", "32"), ("--grad-accum", "2"),
                        ("--warmup-steps", "3"), ("--min-lr-frac", "0.5"), ("--eval-iters", "2")):   # the rest
        run_bad(args + ["--resume", flag, value], rf"was started with {flag} \S+, not \S+; resume it with the flags")
    run_bad(args + ["--resume", "--max-steps", "60"],                 # --max-steps alone: the schedule's length
            r"was started with --decay-steps 50, not 60; pass --decay-steps 50 to keep its schedule's length$")
    run_bad(args + ["--resume", "--max-steps", "10", "--decay-steps", "50"],
            r"is at step 50, past --max-steps 10; pass --max-steps 50 or more")
    run_bad(["--model", ckpt, "--data", data, "--out-dir", tmp_path / "none", "--resume", *FAST], r"no checkpoint to resume")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    run_bad(["--model", ckpt, "--data", data, "--out-dir", tmp_path / "notes", "--overwrite", *FAST],
            r"is not a distill.py checkpoint, so --overwrite will not replace it")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
    distill.main([*map(str, args), "--resume"])                   # at its --max-steps already: trains nothing
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_resume_from_another_directory_checks_the_data_it_names(setup, tmp_path, monkeypatch):
    """config.json records --data by its absolute path: a relative --data resumed from another working directory
    names other token files, and is refused (it had trained on them without a word), as is the same directory
    prepared again from other text: by the files' record, or for a checkpoint without one by their counts."""
    d, ckpt, data = setup
    for where in ("a", "b"):
        shutil.copytree(data, tmp_path / where / "tok")
    run = distill_args(ckpt, "tok", tmp_path / "out", "--alloc", "fix", "--budget", "4", "--decay-steps", "2")
    monkeypatch.chdir(tmp_path / "a")
    distill.main(run + ["--max-steps", "1"])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["data"]["dir"] == str(tmp_path / "a" / "tok")
    monkeypatch.chdir(tmp_path / "b")
    with pytest.raises(door.ModelError, match=rf"was started with --data '{tmp_path / 'a' / 'tok'}', not '{tmp_path / 'b'}"):
        distill.main(run + ["--max-steps", "2", "--resume"])
    monkeypatch.chdir(tmp_path / "a")
    distill.main(run + ["--max-steps", "2", "--resume"])
    was = json.loads((tmp_path / "out" / "config.json").read_text())["data"]["tokens"]
    shutil.rmtree(tmp_path / "a" / "tok")                             # prepared again from less text, in its place
    (tmp_path / "half.txt").write_text(TEXT.read_text(encoding="utf-8")[:60000], encoding="utf-8")
    assert cli("data/text/prepare.py", "--model", ckpt, "--out", tmp_path / "a" / "tok", tmp_path / "half.txt"
               ).returncode == 0
    with pytest.raises(door.ModelError, match=r"tok/train.bin is not the token file that \S+out was trained on \(it "
                                         r"holds [\d,]+ bytes, not [\d,]+\); put back the token files"):
        distill.main(run + ["--max-steps", "3", "--resume"])
    edit_json(tmp_path / "out" / "config.json", data={"dir": str(tmp_path / "a" / "tok"), "tokens": was})
    with pytest.raises(door.ModelError, match=r"tok now holds other token files than \S+out was trained on \({'train': "
                                         r"\d+, 'val': \d+}, not {'train': \d+, 'val': \d+}\); resume it on the data"):
        distill.main(run + ["--max-steps", "3", "--resume"])                  # a checkpoint without their record


def test_nan_loss_stops_naming_the_layer(setup, tmp_path, monkeypatch):
    """One sentence, the last line of stderr: the progress bar ends its line first (the error had been printed
    inside the bar's line, and the bar drawn again after it). A student's held-out loss that is not finite stops
    the run too, before its checkpoint."""
    d, ckpt, data = setup
    out = tmp_path / "nan"
    r = cli("distill.py", "--model", ckpt, "--data", data, "--alloc", "fix", "--budget", "4", "--max-steps", "5",
            "--lr-z", "1e30", "--lr-alpha", "1e30", "--warmup-steps", "0", "--out-dir", out, *FAST)
    assert r.returncode == 2 and "distill: " in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert re.fullmatch(r"error: layer \d+'s softmax loss became (nan|inf) at step \d+; the checkpoint in \S+nan "
                        r"was not updated; lower --lr-z/--lr-alpha or use --dtype float32", r.stderr.split("\n")[-2])
    assert r.stderr.endswith("\n") and r.stderr.count("error: ") == 1
    assert json.loads((out / "config.json").read_text())["step"] == 0          # the first checkpoint, whole
    with pytest.raises(door.ModelError, match=r"^layer 1's softmax loss became inf at step 7; the checkpoint in x was"):
        door.check_finite(distill.DistillConfig(out_dir="x"), 7, [0.5, math.inf, math.nan],
                             lambda l: f"layer {l}'s softmax loss")         # the first that is not finite
    real = distill.lm_loss
    monkeypatch.setattr(distill, "lm_loss", lambda m, *a: math.nan if isinstance(m.cores()[0], LinearAttention) else
                        real(m, *a))                                   # the student's alone
    run_bad(distill_args(ckpt, data, tmp_path / "nan2", "--alloc", "fix", "--max-steps", "2"),
            r"^the student's held-out loss became nan at step 0; the checkpoint in \S+nan2 was not updated")
    assert not (tmp_path / "nan2" / "config.json").exists()


def test_features_that_underflow_score_a_large_kl_and_a_negative_one_stops_the_run(setup, tmp_path):
    """--lr-z 20 drives every key's features to 0: the held-out attention KL is large (had been -H(p), negative, and
    saved as a success); a loss below 0 (here a fork's wrong softmax_loss_blockwise) stops the run, one sentence,
    before its first checkpoint."""
    d, ckpt, data = setup
    out = tmp_path / "under"
    distill.main(distill_args(ckpt, data, out, "--alloc", "fix", "--budget", "4", "--lr-z", "20", "--max-steps", "20",
                              "--warmup-steps", "0"))
    kl = json.loads((out / "metrics.json").read_text())["val"][-1]["attn_kl"]
    assert min(kl) > 10, kl
    wrong = lambda q, *a, **k: -torch.ones(q.size(1), dtype=torch.float64)         # noqa: E731
    with forks.replaced({(distill, "softmax_loss_blockwise"): wrong}):
        run_bad(distill_args(ckpt, data, tmp_path / "neg", "--alloc", "fix", "--budget", "4", "--max-steps", "2"),
                r"^layer 0's held-out attention KL became -[\d.]+ at step 0; the checkpoint in \S+neg was not "
                r"updated; no loss here can be negative, so the code that computed it is wrong$")
    assert not (tmp_path / "neg").exists()


def paragraphs():
    return [p for p in TEXT.read_text(encoding="utf-8").split("\n \n") if len(p) > 200][:300]


def test_data_prepared_from_the_text_files_in_the_data_directory(setup, tmp_path):
    """--data holding text but no token files: its *.txt / *.raw files are tokenized there with the teacher's
    tokenizer (data/text/prepare.py's code), the last --val-fraction of the tokens held out; other files ignored."""
    d, ckpt, _ = setup
    texts = tmp_path / "texts"
    texts.mkdir()
    text = TEXT.read_text(encoding="utf-8")[:200_000]
    (texts / "a.txt").write_text(text, encoding="utf-8")
    (texts / "notes.md").write_text("not text to train on")
    distill.main([str(a) for a in ["--model", ckpt, "--data", texts, "--val-fraction", "0.1", "--alloc", "fix",
                                   "--budget", "4", "--max-steps", "2", "--prompt", "", "--out-dir", tmp_path / "out",
                                   *FAST]])
    enc = load_tokenizer(ckpt)
    ids = enc.encode_ordinary(text) + [enc.eot_token]
    train, val = (np.fromfile(texts / f"{s}.bin", dtype=np.uint16) for s in ("train", "val"))
    meta = json.loads((texts / "meta.json").read_text())
    assert np.array_equal(np.concatenate([train, val]), ids) and len(val) == round(0.1 * len(ids))
    assert meta["source"] == "text" and meta["files"] == [str((texts / "a.txt").resolve())]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["data"]["tokens"] == meta["tokens"]


def test_wikipedia_sample_streamed_into_a_data_directory_without_text(setup, tmp_path, monkeypatch):
    """--data that does not exist: the first --wiki-tokens tokens of Wikipedia articles, streamed by
    data/wikipedia/prepare.py (its stream replaced by local paragraphs), a --val-fraction share of them held out."""
    d, ckpt, _ = setup
    arts = paragraphs()
    monkeypatch.setattr(datafiles.data_script("wikipedia"), "stream_articles", lambda name, config: (iter(arts), None))
    out = tmp_path / "wiki"
    distill.main([str(a) for a in ["--model", ckpt, "--data", out, "--wiki-tokens", 20000, "--val-fraction", 0.2,
                                   "--alloc", "fix", "--budget", "4", "--max-steps", "2", "--prompt", "",
                                   "--out-dir", tmp_path / "out", *FAST]])
    meta = json.loads((out / "meta.json").read_text())
    enc = load_tokenizer(ckpt)
    tokens = sum(meta["tokens"].values())
    assert meta["source"] == "wikipedia" and meta["fraction"] == 1.0 and meta["val_fraction"] == 0.2
    assert 20000 <= tokens < 20000 + max(len(enc.encode_ordinary(a)) + 1 for a in arts)
    assert meta["articles_kept"] < len(arts) and 0 < meta["tokens"]["val"] < 0.5 * tokens


def test_main_command_without_the_hub_fails_at_once_naming_the_offline_command(tmp_path):
    """The paper's command with no hub (HF_HUB_OFFLINE=1, an empty cache): exit code 2 within seconds (Python and
    torch start-up included; the hub client's retries would take minutes), one sentence naming the offline command,
    nothing written."""
    import time
    env = script_env(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    t0 = time.time()
    r = subprocess.run([sys.executable, str(ROOT / "distill.py"), "--budget", "64", "--loss", "softmax",
                        "--out-dir", str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=60)
    elapsed = time.time() - t0
    assert r.returncode == 2 and elapsed < 15, (r.returncode, elapsed, r.stderr[-2000:])   # no client retries
    assert r.stderr.startswith("error: could not fetch 'gpt2': the Hugging Face hub cannot be reached;")
    assert r.stderr.count("\n") == 1 and "`python distill.py --model smollm2-135m --data data/wikitext2" in r.stderr
    assert not (tmp_path / "out").exists()


def test_hub_reachable_is_one_quick_connection_test(monkeypatch):
    """A listening port: reachable; a closed one: not; HF_HUB_OFFLINE=1: not, without trying; behind a proxy: yes,
    without trying. The caller's HF_* and proxy variables play no part (huggingface_hub reads them at import)."""
    import socket

    from huggingface_hub import constants

    from checkpoint import hub_reachable
    for v in PROXY_VARIABLES:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    server = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
    assert hub_reachable(timeout=1.0)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert not hub_reachable(timeout=1.0)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    server.close()
    assert not hub_reachable(timeout=1.0)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    assert hub_reachable(timeout=1.0)


def test_teacher_and_tokenizer_from_the_hub_cache_without_the_hub(setup, tmp_path, monkeypatch):
    """A hub id whose files are in the local cache runs with no hub: the download and the tokenizer fetch fall back
    to the cache at once."""
    from huggingface_hub import constants
    d, ckpt, data = setup
    repo = tmp_path / "models--tiny--gpt2"
    shutil.copytree(ckpt, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    distill.main([str(a) for a in ["--model", "tiny/gpt2", "--data", data, "--alloc", "fix", "--budget", "4",
                                   "--max-steps", "0", "--prompt", "", "--out-dir", tmp_path / "out", *FAST]])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["teacher"] == "tiny/gpt2"


def test_init_from_takes_the_student_settings_of_the_checkpoint(tmp_path):
    """--init-from: the checkpoint's feature map, chunk size, key centring, budget, ... (FROM_CHECKPOINT) replace the
    flags' defaults, so that config.json records the student it trains."""
    from safetensors.torch import save_file
    (src := tmp_path / "made").mkdir()
    save_file({"x": torch.zeros(1)}, str(src / "features.safetensors"))
    (src / "config.json").write_text(json.dumps({"teacher": "gpt2", "dims": [6, 6], "feature_map": "performer",
                                                 "chunk_size": 32, "center_keys": True, "budget": 6}))
    cfg = door.parse_config(distill.DistillConfig, ["--data", "d", "--init-from", src, "--out-dir", tmp_path / "out"])
    cfg = resume.starting_point(cfg)[0]
    assert (cfg.feature_map, cfg.chunk_size, cfg.center_keys, cfg.budget) == ("performer", 32, True, 6)


def test_init_from_starts_at_the_checkpoint_then_trains_and_resumes(trained, setup, tmp_path):
    """--init-from DIR: step 0 is DIR's student (features, key means, validation numbers), dims and feature settings
    come from DIR whatever --alloc says, this run's loss trains on, --resume continues it exactly; a checkpoint of
    another teacher is refused."""
    d, ckpt, data = setup
    src, _ = trained
    base = [str(a) for a in ["--model", ckpt, "--data", data, "--init-from", src, "--loss", "direct", "--alloc", "fix",
                             "--lr-z", "2e-3", "--lr-alpha", "2e-2", "--decay-steps", 4, "--eval-interval", 2,
                             "--prompt", "", *FAST]]
    distill.main(base + ["--max-steps", "0", "--out-dir", str(tmp_path / "start")])
    a, b = features(src), features(tmp_path / "start")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    v_src = json.loads((src / "metrics.json").read_text())["val"][-1]
    v0 = json.loads((tmp_path / "start" / "metrics.json").read_text())["val"][0]
    assert v0["student_loss"] == pytest.approx(v_src["student_loss"], rel=1e-6)
    assert v0["attn_kl"] == pytest.approx(v_src["attn_kl"], rel=1e-5)
    distill.main(base + ["--max-steps", "4", "--out-dir", str(tmp_path / "full")])
    cfg, src_cfg = (json.loads((p / "config.json").read_text()) for p in (tmp_path / "full", src))
    assert cfg["init_from"] == str(src) and cfg["loss"] == "direct" and cfg["step"] == 4
    assert (cfg["dims"], cfg["alloc"], cfg["budget"]) == (src_cfg["dims"], "dof", 16)
    full = features(tmp_path / "full")
    assert any(not torch.equal(full[k], a[k]) for k in a if k.endswith(".z"))
    distill.main(base + ["--max-steps", "2", "--out-dir", str(tmp_path / "part")])
    distill.main(base + ["--max-steps", "4", "--out-dir", str(tmp_path / "part"), "--resume"])
    part = features(tmp_path / "part")
    assert all(torch.allclose(full[k], part[k], rtol=0, atol=1e-6) for k in full)
    other = shutil.copytree(ckpt, tmp_path / "other-teacher")                 # a copy with one value changed
    nudge(other / "model.safetensors")
    run_bad(["--model", other] + base[2:] + ["--out-dir", tmp_path / "never"],
            r"^--init-from \S+ was distilled from the teacher \S+gpt2-tiny, and --model \S+other-teacher is another")
    assert not (tmp_path / "never").exists()


def test_a_moved_teacher_resumes_and_starts_its_students(setup, tmp_path):
    """config.json records a local teacher's fingerprint: after the teacher's folder moves, --resume and --init-from
    with --model at its new place go on (they had asked for the old path), the resumed run ends as the uninterrupted
    one and its checkpoint names the new place; a checkpoint without a fingerprint (older) is compared by path."""
    d, ckpt, data = setup
    old, moved = tmp_path / "teacher", tmp_path / "moved"
    shutil.copytree(ckpt, old)
    flags = ["--budget", "16", "--decay-steps", "4", "--eval-interval", "2"]
    distill.main(distill_args(old, data, tmp_path / "full", "--max-steps", "4", *flags))
    distill.main(distill_args(old, data, tmp_path / "part", "--max-steps", "2", *flags))
    old.rename(moved)
    distill.main(distill_args(moved, data, tmp_path / "part", "--max-steps", "4", "--resume", *flags))
    full, part = (json.loads((tmp_path / p / "config.json").read_text()) for p in ("full", "part"))
    assert full["teacher"] == str(old) and part["teacher"] == str(moved) and part["step"] == 4
    assert part["teacher_fingerprint"] == full["teacher_fingerprint"] == checkpoint.fingerprint(ckpt)
    a, b = features(tmp_path / "full"), features(tmp_path / "part")
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)
    distill.main(distill_args(moved, data, tmp_path / "start", "--init-from", tmp_path / "full", "--max-steps", "0"))
    c = features(tmp_path / "start")
    assert all(torch.equal(a[k], c[k]) for k in a)
    edit_json(tmp_path / "full" / "config.json", teacher_fingerprint=None)
    run_bad(distill_args(moved, data, tmp_path / "never", "--init-from", tmp_path / "full"),
            r"^--init-from \S+full was distilled from teacher '\S+teacher' but --model is '\S+moved'; pass --model "
            r"\S+teacher$")
    assert not (tmp_path / "never").exists()


def test_run_ends_with_greedy_continuations_of_teacher_and_student(trained, setup):
    d, ckpt, _ = setup
    out, r = trained
    enc = load_tokenizer(ckpt)
    idx = torch.tensor([enc.encode_ordinary("The history of the city")])
    lines = r.stdout.splitlines()
    at = lines.index("greedy continuations of 'The history of the city':")
    with torch.no_grad():
        for line, name, gpt in zip(lines[at + 1:at + 3], ("teacher", "student"),
                                   (GPT.from_pretrained(ckpt), tasks.load_student(out)[0])):
            ids = idx
            for _ in range(30):                  # greedy by the whole forward pass at every step: no decoding cache
                ids = torch.cat((ids, gpt(ids)[:, -1:].argmax(-1)), 1)
            assert line == f"  {name}: {enc.decode(ids[0, idx.size(1):].tolist())!r}"


def test_step_times_leave_out_validation_and_checkpoints(setup, tmp_path, monkeypatch, capsys):
    """ms/step (the log line, metrics.json's history) and train_seconds time the training steps alone: with a clock
    that a step advances by 1 s and a validation by 100 s, every logged step took 1,000 ms, over however many steps
    since the last log line; the log line keeps a tenth of a ms (gpu_check.py's medians are read from it)."""
    d, ckpt, data = setup
    clock = [0.0]

    def slower(f, seconds):
        def run(*args, **kwargs):
            clock[0] += seconds
            return f(*args, **kwargs)
        return run
    fake = type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])})
    monkeypatch.setattr(distill, "time", fake)
    monkeypatch.setattr(report, "time", fake)
    monkeypatch.setattr(distill, "train_step", slower(distill.train_step, 1.0))
    monkeypatch.setattr(distill, "lm_loss", slower(distill.lm_loss, 100.0))
    distill.main(distill_args(ckpt, data, tmp_path / "run", "--budget", "4", "--alloc", "fix", "--max-steps", "6",
                              "--log-interval", "3", "--eval-interval", "2", "--warmup-steps", "0"))
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert len(m["val"]) == 4 and clock[0] == 506.0                 # the teacher's loss, then steps 0, 2, 4, 6
    assert [h["step"] for h in m["history"]] == [2, 3, 4, 6]       # logged over 2, 1, 1 and 2 steps
    assert [h["ms"] for h in m["history"]] == [1000.0] * 4 and m["train_seconds"] == 6.0, m["history"]
    assert capsys.readouterr().out.count("| 1000.0 ms/step |") == 4
    cfg = distill.DistillConfig(max_steps=6, warmup_steps=0, out_dir="x")      # lr_z: the directions' (0.02)
    assert [h["lr_z"] for h in m["history"]] == pytest.approx([0.02 * distill.lr_factor(h["step"] - 1, cfg)
                                                                for h in m["history"]])      # of the step just taken


def test_log_line_labels_the_next_token_loss_by_the_step_not_by_the_count():
    """A one-layer teacher's layerwise loss is one number too: only a direct step's is labelled next-token."""
    assert report.fmt([0.5]) == "L0-0 0.5000" and report.fmt([2.0], True) == "2.0000 (next-token)"
    assert report.fmt([1.0, 2.0, 3.0, 4.0]) == "L0-1 1.5000 L2-3 3.5000"
    assert report.fmt([1.0, 2.0, 3.0, 4.0, 5.0]) == "L0-1 1.5000 L2-3 3.5000 L4-4 5.0000"   # a last group of one


def test_summary_says_when_the_prompt_was_cut_to_the_context(setup, capsys):
    d, ckpt, _ = setup
    teacher, v = GPT.from_pretrained(ckpt), {"attn_kl": [0.1] * 4, "student_loss": 1.0}
    cfg = distill.DistillConfig(prompt="word " * 500, out_dir="x")
    trainer = distill.Trainer(cfg, teacher, teacher, None, None, None, "cpu",
                              metrics={"val": [v], "teacher_loss": 1.0})
    report.print_summary(trainer, 0, load_tokenizer(ckpt))
    assert f"(its last {teacher.config.block_size - 30} tokens):" in capsys.readouterr().out


def test_preset_prints_its_flags_and_flags_given_win(capsys, monkeypatch):
    cfg = door.parse_config(distill.DistillConfig, ["--preset", "cpu", "--max-steps", "7"])
    assert (cfg.block_size, cfg.batch_size, cfg.budget, cfg.max_steps, cfg.center_keys) == (256, 1, 32, 7, True)
    preset = distill.DistillConfig.PRESETS["cpu"]
    assert f"--preset cpu: {preset} (flags given win)\n" == capsys.readouterr().out   # --max-steps 7
    for k, v in (("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(k, v)                                      # torchrun's other processes: not again
    assert door.parse_config(distill.DistillConfig, ["--preset", "cpu"]).budget == 32
    assert capsys.readouterr().out == ""


def test_dims_and_the_calibration_sample_are_checked_at_the_door():
    """--dims: one positive whole number per layer, or one sentence; dof.py's J: at most the queries+keys a head
    that its calibration windows hold (2 per token)."""
    for bad in ("0,8", "8", "8,8,8", "8,x"):
        with pytest.raises(door.ModelError, match=r"--dims needs 2 comma-separated positive integers, one per layer"):
            datafiles.parse_dims(bad, 2)
    assert datafiles.parse_dims("1,30", 2) == [1, 30]
    with pytest.raises(door.ModelError, match="J=100 is more than the 40 queries"):
        datafiles.check_sample(100, 1, 20)
    assert datafiles.check_sample(40, 1, 20) is None


def test_distill_bad_input_is_one_sentence_and_leaves_the_disk_as_it_was(setup, tmp_path, monkeypatch):
    """A case for each root cause: the project's own files damaged (checkpoint, optimizer state, meta.json), empty
    token files, token ids beyond the vocabulary with an intact meta.json, writes that cannot happen, values nobody
    checked, and messages that misled. Each ends in one sentence and leaves every file as it was."""
    d, ckpt, data = setup
    base, cut = tmp_path / "base", lambda p: p.read_bytes()[:len(p.read_bytes()) // 2]
    distill.main(distill_args(ckpt, data, base, "--budget", "4", "--alloc", "fix", "--max-steps", "2"))

    def copy(src, name, edit, content=None):                    # a copy of src with one file cut, replaced or gone
        c = tmp_path / f"{src.name}-{len(list(tmp_path.iterdir()))}-{name.replace('.', '_')}-{edit}"
        shutil.copytree(src, c)
        {"cut": lambda p: p.write_bytes(cut(p)), "gone": lambda p: p.unlink(),
         "set": lambda p: p.write_bytes(content)}[edit](c / name)
        return c
    other = torch.load(base / "optim.pt", weights_only=False)             # the optimizer of other dims
    moments = next(iter(other["optimizer"]["state"].values()))
    moments["exp_avg"] = moments["exp_avg"][..., :1].clone()
    torch.save(other, tmp_path / "other-optim.pt")
    torch.save(torch.load(base / "optim.pt", weights_only=False) | {"step": 100}, tmp_path / "step-optim.pt")
    from safetensors.torch import load_file, save_file
    feats = load_file(base / "features.safetensors")
    k = next(iter(feats))
    save_file(feats | {k: feats[k] * float("nan")}, tmp_path / "nan.safetensors")
    save_file(feats | {k: feats[k][..., :1].contiguous()}, tmp_path / "shape.safetensors")
    no_args = {k: v for k, v in json.loads((base / "config.json").read_text()).items() if k != "args"}
    metrics_dir = copy(base, "metrics.json", "gone")
    (metrics_dir / "metrics.json").mkdir()
    big = np.fromfile(data / "train.bin", dtype=np.uint16)
    big[7] = 60000
    x, again = tmp_path / "never", ("--max-steps", "2", "--resume")
    cases = [  # (argv, sentence); --resume continues the damaged copy, the rest write to `never`
        (distill_args(ckpt, data, copy(base, "config.json", "cut"), *again), r"config.json is damaged or truncated"),
        (distill_args(ckpt, data, copy(base, "features.safetensors", "cut"), *again),
         r"features.safetensors is damaged or truncated"),
        (distill_args(ckpt, data, copy(base, "optim.pt", "cut"), *again), r"optim.pt is damaged or truncated"),
        (distill_args(ckpt, data, copy(base, "optim.pt", "gone"), *again), r"optim.pt does not exist"),
        (distill_args(ckpt, data, copy(base, "metrics.json", "set", b"[1, 2"), *again), r"metrics.json is damaged"),
        (distill_args(ckpt, data, copy(base, "optim.pt", "set", (tmp_path / "other-optim.pt").read_bytes()), *again),
         r"optim.pt or metrics.json does not fit it \(ValueError: its Adam moments are of other dims\)"),
        (distill_args(ckpt, data, copy(base, "metrics.json", "set", b"{}"), *again),
         r"optim.pt or metrics.json does not fit it \(KeyError: 'val'\); the checkpoint is damaged"),
        (distill_args(ckpt, data, copy(base, "optim.pt", "set", (tmp_path / "step-optim.pt").read_bytes()), *again),
         r"does not fit it \(ValueError: its step 100 is not its last validation's\)"),         # had trained on
        (distill_args(ckpt, data, copy(base, "config.json", "set", json.dumps(no_args).encode()), *again),
         r"config.json records no args, the flags to resume it with; pass --init-from"),     # had skipped the checks
        (distill_args(ckpt, data, copy(base, "features.safetensors", "gone"), *again), r"holds no checkpoint to "
         r"resume \(it lacks features.safetensors\); pass --overwrite to start again, or another --out-dir"),
        (distill_args(ckpt, data, copy(base, "features.safetensors", "set", (tmp_path / "nan.safetensors")
                                       .read_bytes()), *again), r"log_alpha in \S+ holds inf or nan: the checkpoint is "
         r"damaged"),
        (distill_args(ckpt, data, copy(base, "features.safetensors", "set", (tmp_path / "shape.safetensors")
                                       .read_bytes()), *again), r"of another shape: \['.* \[.*1\], not \[.*\]'\]"),
        (distill_args(ckpt, data, metrics_dir, *again), r"metrics.json is not a file; the checkpoint is damaged"),
        *[(distill_args(ckpt, data, copy(base, "config.json", "set", json.dumps(
            json.loads((base / "config.json").read_text()) | edit).encode()), *again), r"config.json lacks the "
           r"teacher, dims \(whole numbers of at least 1: one per layer, or a list per layer\), feature map or chunk "
           r"size \(such a number\)") for edit in ({"dims": "abc"}, {"dims": [0, 4, 4, 4]}, {"dims": [4.5, 4, 4, 4]},
                                                  {"dims": [[4], 4, 4, 4]}, {"dims": [[4] * 4, [4] * 3]},
                                                  {"chunk_size": 0}, {"chunk_size": True}, {"teacher": None})],
        (distill_args(base, data, x), r"is a distill.py checkpoint, not a teacher; pass its teacher as --model"),
        (distill_args(ckpt, data, x, "--init-from", copy(base, "features.safetensors", "cut")), r"is damaged or truncated"),
        (distill_args(ckpt, data, x, "--init-from", copy(base, "config.json", "set", b"[]")), r"holds a JSON list"),
        (distill_args(ckpt, copy(data, "meta.json", "cut"), x), r"meta.json is damaged or truncated.*prepare them again"),
        (distill_args(ckpt, copy(data, "val.bin", "set", b""), x), r"val.bin holds 0 tokens, fewer than the 65 needed"),
        (distill_args(ckpt, copy(data, "train.bin", "set", big.tobytes()), x), r"token id 60000, but the model has 50257"),
        (distill_args(ckpt, copy(data, "meta.json", "gone"), x), r"holds token files but no meta.json"),
        (distill_args(ckpt, data, "/proc/no/out"), r"cannot write --out-dir /proc/no/out: /proc is not "),
        (distill_args(ckpt, data, data / "meta.json"), r"--out-dir .*meta.json is a file; pass a directory"),
        (distill_args(ckpt, data, ""), r"^--out-dir is empty; pass a value, or drop the flag"),
        (distill_args(ckpt, data, x, "--min-lr-frac", "-1"), r"--min-lr-frac must be a number of at least 0, got -1"),
        (distill_args(ckpt, data, x, "--min-lr-frac", "2"), r"^--min-lr-frac must be at most 1, got 2.0$"),
        (distill_args(ckpt, data, x, "--grad-accum", "0"), r"^--grad-accum must be a number of at least 1, got 0$"),
        (distill_args(ckpt, data, x, "--val-fraction", "1"), r"^--val-fraction must lie between 0 and 1, got 1.0$"),
        (distill_args(ckpt, data, x, "--lam", "inf"), r"--lam must be a number above 0, got inf"),
        (distill_args(ckpt, data, x, "--lr-z", "nan"), r"--lr-z must be a number of at least 0, got nan"),
        (distill_args(ckpt, data, x, "--budget", "100000000"), r"needs about [\d,.]+ GiB, more than the [\d.]+ GiB free"),
        (distill_args(ckpt, data, x, "--dims", "100000000,4,4,4"), r"needs about [\d,.]+ GiB, more than the"),
        (distill_args(ckpt, data, x, "--init-from", copy(base, "config.json", "set", json.dumps(  # its dims count
            json.loads((base / "config.json").read_text()) | {"dims": [100000000, 4, 4, 4]}).encode())),
         r"needs about [\d,.]+ GiB, more than the"),
        (distill_args(ckpt, data, x, "--batch-size", "100000000"), r"--batch-size 100000000 x --block-size 64 .* needs"),
        (distill_args(ckpt, data, x, "--eval-iters", "100000000"), r"and 2 calibration and 100000000 validation "
         r"batches\) needs about [\d,.]+ GiB"),                                           # they had hung being drawn
        (distill_args(ckpt, data, x, "--device", "tpu"), r"--device tpu is not a device of this machine; use one of"),
        (distill_args(ckpt, data, x, "--max-steps", "-1"), r"--max-steps must be a number of at least 0"),
        (distill_args(ckpt, data, x, "--data", ""), r"^--data is empty; pass a value, or drop the flag"),
        (distill_args(ckpt, data, x, "--block-size", "1"), r"^--block-size must be at least 2: in a window of one "
         r"token each query would see only itself, and nothing would train$"),                # had trained nothing
        (distill_args(ckpt, data, x, "--block-size", "129"), r"^--block-size 129 is more than the model's context "
         r"of 128 tokens; pass at most --block-size 128$"),                                    # had been cut to 128
        (distill_args(ckpt, data, copy(base, "metrics.json", "set", (base / "metrics.json").read_bytes()), *again,
                      "--preset", "cpu"), r"was started without --preset cpu, so its --warmup-steps was 100, not 45; "
         r"resume it without --preset cpu$"),                           # had blamed --warmup-steps, never typed
    ]
    for argv, match in cases:
        before = snapshot(tmp_path)
        with pytest.raises(door.ModelError, match=match) as e:
            distill.main(argv)
        assert "\n" not in str(e.value) and snapshot(tmp_path) == before, (argv, str(e.value))
    assert not x.exists()
    locked = copy(base, "metrics.json", "set", (base / "metrics.json").read_bytes())
    read_text = Path.read_text                                         # its config.json: permission denied

    def refused(p, *a, **k):
        if Path(p) == locked / "config.json":
            raise PermissionError(13, "Permission denied")
        return read_text(p, *a, **k)
    monkeypatch.setattr(Path, "read_text", refused)
    before = snapshot(tmp_path)
    with pytest.raises(door.ModelError, match=r"^\S+config.json is not readable \(permission denied\); give this user read "
                                         r"access to it, or "):                    # had been "damaged or truncated"
        distill.main(distill_args(ckpt, data, x, "--init-from", locked))
    assert snapshot(tmp_path) == before and not x.exists()
    monkeypatch.undo()
    r = cli("distill.py", *cases[3][0])                              # the command: that sentence alone, exit 2
    assert r.returncode == 2 and re.fullmatch(r"error: \S+optim.pt does not exist; [^\n]+\n", r.stderr), r.stderr


def test_tools_and_data_scripts_check_their_options_before_any_work(setup, tmp_path):
    """The other entry scripts' bad input: one sentence, exit 2, nothing written."""
    d, ckpt, data = setup
    (tmp_path / "bad.json").write_text('{"args": {"dof": [[1,')
    (tmp_path / "ragged.json").write_text('{"args": {"dof": [[1, 2], [3]]}}')
    (tmp_path / "empty.json").write_text('{"args": {"dof": [[]], "budget": 8}}')      # had been an IndexError
    (tmp_path / "nan.json").write_text('{"args": {"dof": [[NaN, 1]], "budget": 8}}')
    (tmp_path / "a.txt").write_text("short text")
    (tmp_path / "file").write_text("")
    (tmp_path / "short").mkdir()
    (tmp_path / "taken" / "dof.json").mkdir(parents=True)                  # a folder where a file is written
    (tmp_path / "taken" / "val.bin").mkdir()
    for split in ("train", "val"):
        np.arange(50, dtype=np.uint16).tofile(tmp_path / "short" / f"{split}.bin")
    shutil.copytree(data, tmp_path / "prepared")                          # tokens a checkpoint was trained on
    cases = [("bench/bench.py", ["--T", "0"], r"--T must list numbers of at least 1, got \[0\]"),
             ("bench/bench.py", ["--T", "--decode-ctx", "--heads", tmp_path / "bad.json"],
              r"bad.json is damaged or truncated .*; pass the JSON of an experiments/per_head.py run"),
             ("bench/bench.py", ["--threads", "0"], r"--threads must be a number of at least 1, got 0"),
             ("bench/bench.py", ["--T", "16", "--chunks", "--decode-ctx", "--heads", tmp_path / "short"],
              r"short is not a file; pass the JSON of an experiments/per_head.py run"),   # before the scan table
             ("bench/bench.py", ["--step", "mse"], r"--step mse: the losses are softmax, l2 and direct"),
             ("bench/bench.py", ["--T", "--decode-ctx", "--heads", tmp_path / "ragged.json"],
              r"ragged.json lacks a per-head DoF table or its budget \(ValueError\)"),
             *[("bench/bench.py", ["--T", "--decode-ctx", "--heads", tmp_path / f"{name}.json"], rf"{name}.json "
                r"holds no per-head table of finite DoF of at least 0 \(one row a layer\) and whole budget of at") for
               name in ("empty", "nan")],
             ("bench/allocation.py", ["--model", ckpt, "--predict", tmp_path / "no" / "p.json"],
              r"--predict .*p.json is in .*no, which does not exist; pass a file path"),
             ("bench/allocation.py", ["--rule", "entropy", "--dims", "4,1,1,1"], r"--rule chooses the dims here; "
              r"drop --dims and --alloc, or run distill.py with them"),
             ("bench/allocation.py", ["--rule", "entropy", "--alloc", "clip"], r"--rule chooses the dims here"),
             ("bench/allocation.py", ["--predict", tmp_path / "p.json", "--resume"],
              r"--predict computes the predictors of a fresh run; drop --resume and --init-from"),
             ("bench/allocation.py", ["--model", ckpt, "--data", data, "--rule", "measured", "--out-dir",
                                            tmp_path / "al", *FAST], r"curves in docs/results/curves are of a model "
              r"of 30 layers, and .* has 4; pass --curves of runs on this model"),
             ("experiments/leverage.py", ["--model", ckpt, "--data", data, "--pool", 10 ** 8, "--out-dir",
                                          tmp_path / "out", *FAST], r"--pool 100000000 candidates for each of up to "
              r"\d+ features a head needs about [\d,.]+ GiB, more than the [\d.]+ GiB free on cpu; lower --pool"),
             ("bench/gpu_check.py", ["--budget-seconds", "-5"], r"--budget-seconds must be a number above 0"),
             ("bench/gpu_check.py", ["--block-size", "2048", "--out", tmp_path / "c.json"], r"--block-size 2048 "
              r"is more than GPT-2's 1024 learned positions, which its distillation and ops rows use; pass at most"),
             ("bench/gpu_check.py", ["--scan-T", "0", "--out", tmp_path / "c.json"], r"--scan-T and --decode-ctx "
              r"must list numbers of at least 1, got \[0\]"),
             ("bench/gpu_check.py", ["--out", tmp_path / "no" / "such" / "c.json"], r"--out .*c.json is in "
              r".*such, which does not exist"),
             ("data/text/prepare.py", ["--model", ckpt, "--out", tmp_path / "out", "--num-threads", "0", tmp_path / "a.txt"],
              r"--num-threads must be a number of at least 1, got 0"),
             ("data/text/prepare.py", ["--model", ckpt, "--out", tmp_path / "out" / "made" / "here", "--val-fraction",
                                       "0.001", tmp_path / "a.txt"], r"the val split came out empty"),   # all 3 go
             ("data/text/prepare.py", ["--model", ckpt, "--out", tmp_path / "file", tmp_path / "a.txt"],
              r"--out .*file is a file; pass a directory"),
             ("data/text/prepare.py", ["--model", ckpt, "--out", "", tmp_path / "a.txt"], r"--out is empty; pass a "),
             ("data/text/prepare.py", ["--model", ckpt, "--out", tmp_path / "file" / "sub", tmp_path / "a.txt"],
              r"--out .*sub is inside the file .*file; pass a directory"),
             ("data/text/prepare.py", ["--model", ckpt, "--out", "/proc/no/out", tmp_path / "a.txt"],
              r"cannot write --out /proc/no/out: /proc is not writable"),
             ("data/text/prepare.py", ["--model", ckpt, "--out", tmp_path / "out", tmp_path / "a.txt",
                                       tmp_path / ".." / tmp_path.name / "a.txt"], r"a.txt is listed twice"),
             ("data/wikipedia/prepare.py", ["--num-threads", "0"], r"--num-threads must be a number of at least 1"),
             ("data/wikipedia/prepare.py", ["--seed", "-1"], r"--seed must be a number of at least 0, got -1"),
             ("data/wikipedia/prepare.py", ["--max-tokens", "-1"], r"--max-tokens must be a number of at least 0"),
             ("data/text/prepare.py", ["--model", ckpt, "--out", tmp_path / "out", "--val-fraction", "1",
                                       tmp_path / "a.txt"], r"--val-fraction must lie between 0 and 1, got 1.0"),
             ("data/wikipedia/prepare.py", ["--dataset", ""], r"--dataset is empty; pass a value"),
             ("data/wikipedia/prepare.py", ["--out", tmp_path / "file"], r"--out .*file is a file; pass a directory"),
             ("dof.py", ["--model", ckpt, "--out", tmp_path / "file"], r"--out .*file is a file; pass a directory"),
             ("dof.py", ["--seed", "-1"], r"--seed must be a number of at least 0, got -1"),   # distill.py's refusal
             ("dof.py", ["--model", ckpt, "--out", tmp_path / "taken"], r"cannot write .*dof.json: it is a directory"),
             ("dof.py", ["--model", ckpt, "--data", tmp_path / "a.txt", "--block-size", 128, "--out", tmp_path / "out"],
              r"a.txt/train.bin "
              r"does not exist; make it with data/\*/prepare.py, whose --out is the folder to pass"),
             ("data/text/prepare.py", ["--model", ckpt, "--out", tmp_path / "taken", tmp_path / "a.txt"],
              r"cannot write .*taken/val.bin: it is a directory"),
             ("dof.py", ["--model", ckpt, "--data", data, "--batch-size", 10 ** 8, "--block-size", 128, "--out",
                        tmp_path / "out"], r"the "
              r"calibration pass at --batch-size 100000000 x --block-size 128 needs about [\d,.]+ GiB, more than the"),
             ("bench/heads.py", ["--model", ckpt, "--data", data, "--layers", "9", "--out", tmp_path / "out"],
              r"has layers 0-3; pass --layers among them \(got \[9\]\)$"),
             ("bench/heads.py", ["--model", ckpt, "--data", data, "--layers", "0", "--block-size", "256", "--out",
                                       tmp_path / "out"], r"has a context of 128 tokens; pass a --block-size within "
              r"it \(got 256\)$"),                                               # had blamed --layers too
             ("bench/heads.py", ["--model", ckpt, "--data", tmp_path / "short", "--layers", "0", "--block-size",
                                       "100", "--J", "64", "--out", tmp_path / "out"], r"holds 50 tokens, fewer than"),
             ("bench/heads.py", ["--seeds", "0"], r"--seeds must be a number of at least 1, got 0"),
             ("bench/heads.py", ["--out", tmp_path / "file"], r"--out .*file is a file; pass a directory"),
             ("bench/heads.py", ["--out", tmp_path / "file" / "sub"], r"--out .*sub is inside the file .*file"),
             ("bench/heads.py", ["--model", ckpt, "--data", data], r"--out docs/results/heads-kl holds "
              r"SmolLM2-135M's committed numbers \(smollm2.json\); pass another --out for "),   # had replaced them
             ("bench/gpu_check.py", ["--work-dir", tmp_path / "file", "--out", tmp_path / "c.json"],
              r"--work-dir .*file is a file; pass a directory"),                     # these three came after the work
             ("bench/heads.py", ["--J", "2000", "--calib-seqs", "2", "--block-size", "64"], r"--J 2000 is more "
              r"than the 256 queries and keys a head has in --calib-seqs x --block-size; lower --J or raise"),
             ("bench/heads.py", ["--model", ckpt, "--data", data, "--layers", "0", "--block-size", "64",
                                       "--calib-seqs", 10 ** 8, "--out", tmp_path / "out"], r"100000004 sequences "
              r"\(--calib-seqs \+ --eval-seqs\) of 64 tokens with up to 128 features a head needs about [\d,.]+ GiB"),
             ("docs/experiments.py", ["--run", "claim", "--jobs", "0"], r"--jobs must be a number of at least 1"),
             ("docs/experiments.py", ["--run", "claim", "--match", "nothing"], r"no run of grid claim has a name "
              r"containing 'nothing'; its runs are b32-fix-s0, b32-fix-s1, "),         # had run none and exited 0
             ("bench/heads.py", ["--Ms", "--out", tmp_path / "out"], r"--Ms must be one or more feature counts"),
             ("bench/heads.py", ["--layers", "-1"], r"--layers must be one or more layers from 0, got \[-1\]"),
             ("dof.py", ["--model", ckpt, "--data", data, "--block-size", "129", "--out", tmp_path / "out"],
              r"--block-size 129 is more than the model's context of 128 tokens; pass at most --block-size 128$"),
             ("data/text/prepare.py", ["--model", "", "--out", tmp_path / "out", tmp_path / "a.txt"],
              r"--model is empty; pass a value$"),
             ("data/text/prepare.py", ["--model", ckpt, "--out", "", tmp_path / "a.txt"], r"--out is empty; pass a value$"),
             ("data/wikipedia/prepare.py", ["--out", ""],
              r"--out is empty; pass a value, or drop the flag to use its default, \S+/data/wikipedia$"),
             ("dof.py", ["--model", "", "--out", tmp_path / "out"],
              r"--model is empty; pass a value, or drop the flag to use its default, gpt2$"),
             ("dof.py", ["--model", ckpt, "--data", "", "--out", tmp_path / "out"],
              r"--data is empty; pass a value, or drop the flag to use its default, data/wikipedia$"),
             ("dof.py", ["--model", ckpt, "--out", ""], r"--out is empty; pass a value, or drop the flag to use its "
              r"default, out-dof$"),
             ("distill.py", ["--model", "", "--out-dir", tmp_path / "out"], r"--model is empty; pass a value, or drop "
              r"the flag"),                                         # had read the working directory as a checkpoint
             ("distill.py", ["--model", ckpt, "--data", "", "--out-dir", tmp_path / "out"],
              r"--data is empty; pass a value, or drop the flag"),
             ("data/text/prepare.py", ["--model", ckpt, "--out", tmp_path / "prepared", "--val-fraction", "0.5",
                                       tmp_path / "a.txt"], r"\S+prepared already holds token files \(train.bin, "
              r"val.bin, meta.json\); pass --overwrite to replace them, or another --out$"),    # had replaced them
             ("data/wikipedia/prepare.py", ["--model", ckpt, "--out", tmp_path / "prepared"], r"\S+prepared already "
              r"holds token files \(train.bin, val.bin, meta.json\); pass --overwrite")]     # before any hub access
    for script, args, match in cases:
        before = snapshot(tmp_path)
        r = cli(script, *args)
        assert r.returncode == 2 and re.fullmatch(f"error: [^\n]*{match}[^\n]*\n", r.stderr), (script, r.stderr[-800:])
        assert snapshot(tmp_path) == before and not (tmp_path / "out").exists(), script


def test_init_from_a_checkpoint_holding_only_what_load_student_needs(setup, tmp_path):
    """A hand-made checkpoint (teacher, dims, feature map, chunk size, features): --init-from trains on from it."""
    d, ckpt, data = setup
    student = GPT.from_pretrained(ckpt).linearize([6] * 4, "prf", 16)
    src = tmp_path / "made"
    src.mkdir()
    from safetensors.torch import save_file
    save_file(checkpoint.feature_state(student), str(src / "features.safetensors"))
    (src / "config.json").write_text(json.dumps({"teacher": str(ckpt), "dims": [6] * 4, "feature_map": "prf",
                                                 "chunk_size": 16}))
    distill.main(distill_args(ckpt, data, tmp_path / "run", "--init-from", src, "--max-steps", "2"))
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["step"] == 2 and cfg["dims"] == [6] * 4 and cfg["init_from"] == str(src)


def test_one_run_per_out_dir_and_a_crashed_runs_lock_is_not_stuck(setup, tmp_path):
    d, ckpt, data = setup
    out = tmp_path / "run"
    with files.claim_out_dir(out):                                  # another run holds it
        with pytest.raises(door.ModelError, match=r"another run is writing .*run \(it holds .*run.lock\); wait for it"):
            distill.main(distill_args(ckpt, data, out, "--alloc", "fix", "--budget", "4", "--max-steps", "1"))
    (tmp_path / "run.lock").write_text("")                           # left by a crashed run: not locked
    distill.main(distill_args(ckpt, data, out, "--alloc", "fix", "--budget", "4", "--max-steps", "1"))
    assert json.loads((out / "config.json").read_text())["step"] == 1 and not (tmp_path / "run.lock").exists()


def test_a_lock_file_unlinked_while_it_was_being_taken_is_refused(tmp_path, monkeypatch):
    """Run B opens <out>.lock, run A ends (unlinks it, frees it), B locks the unlinked file: B is refused, since a
    run C would create and lock a new <out>.lock and write beside it."""
    lock = tmp_path / "run.lock"
    with files.exclusive(lock, "run", "--out-dir"):
        stale = os.open(lock, os.O_WRONLY)                               # B has opened it; A still holds it
    monkeypatch.setattr(files.os, "open", lambda *args: stale)         # B goes on with the file it opened
    with pytest.raises(door.ModelError, match=r"another run is writing run \(it holds .*run.lock\)"):
        with files.exclusive(lock, "run", "--out-dir"):
            pass
    monkeypatch.undo()
    with files.exclusive(lock, "run", "--out-dir"):                      # C: a new file, locked
        assert lock.exists()


def test_out_dir_that_is_a_link_and_a_full_disk(setup, tmp_path, monkeypatch):
    """A link to a directory as --out-dir stays a link to it, save after save; a save that fails (a full disk) is
    one sentence, and the checkpoint before it stays whole; a first save that fails leaves no folder."""
    d, ckpt, data = setup
    (real := tmp_path / "real").mkdir()
    (link := tmp_path / "link").symlink_to(real)
    run = distill_args(ckpt, data, link, "--alloc", "fix", "--budget", "4", "--decay-steps", "4")
    distill.main(run + ["--max-steps", "1"])
    distill.main([a + "/" if a == str(data) else a for a in run] + ["--max-steps", "2", "--resume"])  # data/ is data
    assert link.is_symlink() and json.loads((real / "config.json").read_text())["step"] == 2
    before = snapshot(real)

    def full_disk(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file")
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(door.ModelError, match=r"saving into .*link failed \(\[enforce fail.*\); the checkpoint saved "
                                         r"before is whole: make room, then add --resume"):
        distill.main(run + ["--max-steps", "3", "--resume"])
    assert snapshot(real) == before and sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]

    def full_disk_safetensors(*args, **kwargs):                        # safetensors' own exception, at the first save
        from safetensors import SafetensorError
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr("safetensors.torch.save", full_disk_safetensors)
    with pytest.raises(door.ModelError, match=r"saving into .*fresh failed \(Error while serializing: I/O error: No space "
                                         r"left on device \(os error 28\)\); make room, then run it again$"):
        distill.main(distill_args(ckpt, data, tmp_path / "fresh", "--alloc", "fix", "--budget", "4",
                                  "--max-steps", "1"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
    prepare = datafiles.data_script("text")
    with pytest.raises(door.ModelError, match=r"writing the token files into .*b failed \(\[Errno 28\] No space left"):
        with prepare.token_files(tmp_path / "a" / "b", {}):
            raise OSError(28, "No space left on device")
    assert not (tmp_path / "a").exists()


def test_the_temp_files_of_a_save_cut_short_do_not_block_a_run_and_a_link_among_them_keeps_its_target(setup,
                                                                                                          tmp_path):
    """--out-dir holding only the temp files of a first save cut short is no folder of the user's: a run starts
    there; a stale temp file that links to a folder is unlinked, the folder kept."""
    d, ckpt, data = setup
    (keep := tmp_path / "keep").mkdir()
    (keep / "mine.txt").write_text("mine")
    (out := tmp_path / "run").mkdir()
    (out / "features.safetensors.tmp").write_text("half")
    (out / "config.json.tmp").symlink_to(keep)
    distill.main(distill_args(ckpt, data, out, "--alloc", "fix", "--budget", "4", "--max-steps", "1"))
    assert files.is_checkpoint(out) and sorted(p.name for p in out.iterdir()) == sorted(files.CHECKPOINT_FILES)
    assert [p.name for p in keep.iterdir()] == ["mine.txt"]


def test_a_short_context_teacher_and_a_fixed_feature_map(setup, tmp_path, capsys):
    """A teacher of 16 positions (windows of --block-size 16: more is refused) ends with continuations that fit its
    context (8 tokens), not a crash; a fixed feature map (performer) has nothing to train, and says so."""
    d, ckpt, data = setup
    from transformers import GPT2Config, GPT2LMHeadModel
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=16)).save_pretrained(tmp_path / "t16")
    for name, to in (("encoder.json", "vocab.json"), ("vocab.bpe", "merges.txt")):
        shutil.copy(TOKENIZER / name, tmp_path / "t16" / to)
    distill.main(distill_args(tmp_path / "t16", data, tmp_path / "run", "--max-steps", "1", "--J", "16", "--prompt",
                              "one two three four five six seven eight nine ten", "--block-size", "16"))  # last wins
    out = capsys.readouterr().out
    assert "(its last 8 tokens):" in out and out.count("  teacher: ") == out.count("  student: ") == 1, out[-800:]
    distill.main(distill_args(ckpt, data, tmp_path / "perf", "--feature-map", "performer", "--max-steps", "2"))
    assert "performer features are fixed, so nothing trains" in capsys.readouterr().out
    assert json.loads((tmp_path / "perf" / "config.json").read_text())["step"] == 0


def test_output_through_a_link_replaces_its_target_and_a_pipe_is_refused(tmp_path):
    """--output (check_out, then write_text_atomic) through a symlink writes its target and keeps the link;
    a pipe or device is no file to write whole, and is refused."""
    (target := tmp_path / "target.json").write_text("old")
    (link := tmp_path / "link.json").symlink_to(target)
    files.check_out(link, file=True)
    files.write_text_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(door.ModelError, match=r"cannot write .*fifo: it is not a regular file"):
        files.check_out(tmp_path / "fifo", file=True)
    (tmp_path / "dangling.json").symlink_to(tmp_path / "no" / "such.json")          # its target's folder: none
    with pytest.raises(door.ModelError, match=r"--out .*dangling.json is in .*no, which does not exist"):
        files.check_out(tmp_path / "dangling.json", file=True)
    files.write_text_atomic(target, json.dumps({"goal": "\ud800"}, ensure_ascii=False))   # a lone surrogate
    assert json.loads(target.read_text()) == {"goal": "\ud800"}
    with pytest.raises(door.ModelError, match=r"cannot write .*dangling.json \(No such file or directory\); make room or"):
        files.write_text_atomic(tmp_path / "dangling.json", "x")                 # after the check, not a traceback
    (tmp_path / "locked").mkdir()
    os.mkfifo(tmp_path / "locked" / "prepare.lock")                               # had hung opening it
    with pytest.raises(door.ModelError, match=r"cannot write .*locked/prepare.lock \(No such device or address\); pass "):
        with files.exclusive(tmp_path / "locked" / "prepare.lock", "token files", "--out"):
            pass


def test_a_folder_where_a_write_puts_its_temp_file_is_refused_before_any_work_and_kept(tmp_path):
    """A write goes to <name>.tmp first; a folder of that name is the user's, not a temp file left by a save cut
    short: --output and --out-dir refuse it before any work, and a write that meets one anyway leaves it whole."""
    for folder in (tmp_path / "out.json.tmp", tmp_path / "run" / "config.json.tmp"):
        folder.mkdir(parents=True)
        (folder / "mine.txt").write_text("mine")
    with pytest.raises(door.ModelError, match=r"cannot write .*out.json: its temporary file out.json.tmp would "
                                              r"replace a folder; move that folder or pass another --out$"):
        files.check_out(tmp_path / "out.json", file=True)
    with pytest.raises(door.ModelError, match=r"cannot write .*run/config.json: its temporary file config.json.tmp "
                                              r"would replace a folder; move that folder or pass another --out-dir$"):
        with files.claim_out_dir(tmp_path / "run"):
            pass
    with pytest.raises(door.ModelError, match=r"cannot write .*out.json \(Is a directory\)"):
        files.write_text_atomic(tmp_path / "out.json", "x")
    assert (tmp_path / "out.json.tmp" / "mine.txt").read_text() == "mine"
    assert (tmp_path / "run" / "config.json.tmp" / "mine.txt").read_text() == "mine"
    assert not (tmp_path / "out.json").exists()


def test_a_file_of_the_users_where_a_run_puts_its_lock_is_refused_and_kept(tmp_path):
    """<out-dir>.lock is a run's empty lock file, unlinked when the run ends; one that holds data is the user's: the
    run refuses it before any work and leaves it as it was (it had been deleted at the end of the run)."""
    (tmp_path / "run.lock").write_text("mine")
    with pytest.raises(door.ModelError, match=r"^\S+run.lock holds data, so it is no run's lock; move it or pass "
                                              r"another --out-dir$"):
        with files.claim_out_dir(tmp_path / "run"):
            pass
    assert (tmp_path / "run.lock").read_text() == "mine" and not (tmp_path / "run").exists()


def test_a_run_refused_after_its_claim_leaves_no_folder_its_lock_made(tmp_path):
    """The folders made for <out-dir>.lock go with it where the run left them empty (a run refused once its teacher
    was read had left them), and stay where it wrote its checkpoint."""
    with pytest.raises(door.ModelError):
        with files.claim_out_dir(tmp_path / "a" / "b" / "run"):
            raise door.ModelError("refused")
    assert list(tmp_path.iterdir()) == []
    with files.claim_out_dir(tmp_path / "a" / "b" / "run"):
        (tmp_path / "a" / "b" / "run").mkdir()
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == ["run"]


def test_a_run_stopped_before_its_first_checkpoint_names_none(tmp_path, capsys):
    """Ctrl-C before the first save: exit 130 and no claim of a checkpoint that is not there; a second signal while
    it stops is ignored (a second Ctrl-C had printed a traceback from threading's shutdown after the line)."""
    def main():
        with files.claim_out_dir(tmp_path / "run"):
            raise KeyboardInterrupt
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as e:
            door.run_main(main)
        assert signal.getsignal(signal.SIGINT) == signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
    assert e.value.code == 130 and capsys.readouterr().err == "\nstopped by Ctrl-C\n"


def test_ctrl_c_of_an_overwrite_run_names_only_a_checkpoint_it_saved(tmp_path, capsys):
    """--overwrite over a checkpoint, stopped before its first save: no claim that the old run's checkpoint is this
    run's to --resume (resuming it had continued the old run, its settings taken from it); after a save: the claim."""
    (out := tmp_path / "run").mkdir()
    for name in ("config.json", "features.safetensors"):
        (out / name).write_text("{}")
        os.utime(out / name, (1, 1))                                     # an earlier run's

    def main(save):
        with files.claim_out_dir(out, overwrite=True):
            if save:
                (out / "config.json").write_text("{}")
            raise KeyboardInterrupt
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        for save, where in ((False, ""), (True, f"; the last checkpoint in {out} is whole: add --resume to continue it")):
            with pytest.raises(SystemExit):
                door.run_main(lambda: main(save))
            assert capsys.readouterr().err == f"\nstopped by Ctrl-C{where}\n"
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])


@pytest.mark.parametrize("sig, code, name", [(signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM")])
def test_ctrl_c_and_sigterm_stop_with_one_line_and_the_run_resumes(setup, tmp_path, sig, code, name):
    """A signal during training: exit 130 / 143, one line naming the last checkpoint (whole) and --resume; resumed
    from it, the run ends as an uninterrupted one would, at the same features. The run starts with SIGINT ignored,
    as a script's background job does (and as this test's caller may have it), and must still stop on it."""
    d, ckpt, data = setup
    out = tmp_path / "run"
    args = distill_args(ckpt, data, out, "--alloc", "fix", "--budget", "4", "--eval-interval", "2", "--device", "cpu",
                        "--decay-steps", "100000")
    p = subprocess.Popen([sys.executable, str(ROOT / "distill.py"), *args, "--max-steps", "100000"], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=script_env(),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    for _ in range(600):                                             # until a checkpoint past step 0 is on disk
        if (out / "config.json").is_file() and json.loads((out / "config.json").read_text())["step"] >= 2:
            break
        time.sleep(0.1)
    p.send_signal(sig)
    err = p.communicate(timeout=60)[1]
    lines = [line for line in err.splitlines() if line.strip() and "distill:" not in line]
    assert p.returncode == code and lines[-1] == f"stopped by {name}; the last checkpoint in {out} is whole: add " \
        "--resume to continue it" and "Traceback" not in err, err[-2000:]
    step = json.loads((out / "config.json").read_text())["step"]
    distill.main(args + ["--max-steps", str(step + 2), "--resume"])
    assert json.loads((out / "config.json").read_text())["step"] == step + 2


def test_learning_rate_warms_up_then_falls_by_a_cosine_to_its_floor():
    """Written out: step s of a 100-step schedule with 10 warm-up steps and a floor of 0.1."""
    cfg = distill.DistillConfig(max_steps=100, warmup_steps=10, min_lr_frac=0.1)
    f = [distill.lr_factor(s, cfg) for s in range(101)]
    assert f[0] == pytest.approx(0.1) and f[4] == pytest.approx(0.5) and f[9] == pytest.approx(1.0)
    assert f[10] == pytest.approx(1.0) and f[55] == pytest.approx(0.1 + 0.9 * 0.5) and f[100] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[9:], f[10:]))                   # falling after the warm-up, never below 0.1
    capped = distill.DistillConfig(max_steps=100, warmup_steps=50, min_lr_frac=0.1)    # warm-up: at most a tenth
    assert distill.lr_factor(9, capped) == pytest.approx(1.0) and distill.lr_factor(4, capped) == pytest.approx(0.5)
    flat = distill.DistillConfig(max_steps=10, warmup_steps=0, min_lr_frac=1.0)        # a floor of 1: constant
    assert [distill.lr_factor(s, flat) for s in range(11)] == [1.0] * 11


def test_center_keys_dims_are_the_centred_kernels_and_dof_py_gives_the_same(setup, tmp_path, capsys):
    """With --center-keys the DoF is that of the kernel the student learns, K(q, k - mu): distill.py's dims and DoF
    equal dof.py --center-keys on the same flags (the same calibration windows), and differ from the uncentred."""
    d, ckpt, data = setup
    flags = ["--model", ckpt, "--data", data, "--budget", 8, "--lam", 1e-3, "--lam-relative", "--seed", 3,
             "--J", 256, "--calib-batches", 2, "--block-size", 64, "--batch-size", 4, "--device", "cpu"]
    flags = [str(f) for f in flags]
    distill.main(flags + ["--center-keys", "--max-steps", "0", "--prompt", "", "--out-dir", str(tmp_path / "run")])
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    for centre, out in ((["--center-keys"], "c"), ([], "raw")):
        dof.main(flags + centre + ["--out", str(tmp_path / out)])
    centred, raw = (json.loads((tmp_path / o / "dof.json").read_text()) for o in ("c", "raw"))
    assert cfg["dims"] == centred["dims"]["dof"] and np.allclose(cfg["dof"], centred["layer_dof"])
    assert not np.allclose(centred["layer_dof"], raw["layer_dof"], rtol=1e-3)


def test_resume_takes_dims_key_means_and_features_from_the_checkpoint(setup, tmp_path, monkeypatch, capsys):
    """--resume runs no DoF pass and computes no key means: they come from the checkpoint, even when this run's
    flags would choose other dims."""
    d, ckpt, data = setup
    args = [str(a) for a in ["--model", ckpt, "--data", data, "--budget", 8, "--center-keys", "--prompt", "",
                             "--decay-steps", 4, "--out-dir", tmp_path / "run", *FAST]]
    distill.main(args + ["--max-steps", "2"])
    dims, layer_dof = (json.loads((tmp_path / "run" / "config.json").read_text())[k] for k in ("dims", "dof"))
    for name in ("choose_dims", "key_means", "collect_qk"):
        monkeypatch.setattr(dof, name, lambda *a, **k: pytest.fail("resume recomputed what the checkpoint holds"))
    distill.main(args + ["--max-steps", "4", "--resume", "--budget", "12"])
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["step"] == 4 and cfg["dims"] == dims and cfg["budget"] == 8 and "come from" in capsys.readouterr().out
    assert layer_dof is not None and cfg["dof"] == layer_dof                    # the layers' DoF, kept


def test_pick_device_autocasts_to_bf16_on_the_cpu_only_when_asked():
    """--dtype auto: bf16 autocast on cuda alone; on the CPU a matmul stays fp32 unless --dtype bfloat16 asks."""
    for dtype, want in (("auto", torch.float32), ("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        device, amp = devices.pick_device("cpu", dtype)
        with amp:
            assert device == "cpu" and (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == want, dtype


def test_get_batch_draws_every_window_the_tokens_hold():
    """Windows of T + 1 tokens start at 0 .. len - T - 1: with T + 3 tokens, all three starts are drawn."""
    data, gen = np.arange(11, dtype=np.uint16), torch.Generator().manual_seed(0)
    starts = {int(x[0, 0]) for x, _ in (datafiles.get_batch(data, 1, 8, gen, "cpu") for _ in range(200))}
    assert starts == {0, 1, 2}


# ==================================================================================================================
# distill.py's loop and resume: each pinned to a known answer

class RecordingOptim:
    """train_step's optimizer, stood in: records the gradient the step would take, changes nothing."""
    def __init__(self, params):
        self.param_groups, self.grads = [{"params": params, "peak": 1.0}], None

    def step(self):
        self.grads = [p.grad.clone() for p in self.param_groups[0]["params"]]

    def zero_grad(self, set_to_none=True):
        for p in self.param_groups[0]["params"]:
            p.grad = None


def test_train_step_weighs_each_of_grad_accum_micro_batches_by_one_over_grad_accum():
    """--grad-accum 3 of one batch repeated gives the logged losses and the gradient of --grad-accum 1 on that batch
    (each micro-batch weighs 1/3), for the softmax, l2 and direct losses; the direct loss is the mean next-token
    cross-entropy per token, written out here from the student's full logits."""
    teacher, student = small_pair()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 50, (2, 16), generator=gen), torch.randint(0, 50, (2, 16), generator=gen)
    with torch.no_grad():
        per_token = F.cross_entropy(student(x).flatten(0, 1), y.flatten()).item()
    for kind in ("softmax", "l2", "direct"):
        out = {}
        for accum in (1, 3):
            cfg = distill.DistillConfig(loss=kind, grad_accum=accum, query_block=8, out_dir="x")
            optim = RecordingOptim([p for p in student.parameters() if p.requires_grad])
            trainer = distill.Trainer(cfg, teacher, student, optim, None, None, "cpu")
            trainer.next_batch = lambda: (x, y)
            losses = distill.train_step(trainer, 0)
            out[accum] = losses, optim.grads
        assert out[1][0].shape == ((1,) if kind == "direct" else (2,))
        assert torch.allclose(out[1][0], out[3][0], rtol=1e-6), (kind, out[1][0], out[3][0])
        assert len(out[1][1]) == 4 and all(g.abs().sum() > 0 for g in out[1][1])
        for a, b in zip(out[1][1], out[3][1]):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-8), (kind, (a - b).abs().max())
    assert out[1][0].item() == pytest.approx(per_token, rel=1e-5)


def test_lm_loss_is_the_mean_per_token_loss_over_the_batches():
    """distill.lm_loss (the held-out next-token loss): the mean over 3 batches of each batch's mean per-token
    cross-entropy, written out here from the full logits."""
    teacher, _ = small_pair()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 50, (2, 12), generator=gen), torch.randint(0, 50, (2, 12), generator=gen))
               for _ in range(3)]
    with torch.no_grad():
        want = np.mean([F.cross_entropy(teacher(x).flatten(0, 1), y.flatten()).item() for x, y in batches])
    assert distill.lm_loss(teacher, batches, contextlib.nullcontext()) == pytest.approx(want, rel=1e-5)


def test_make_optimizer_is_torchs_adam_with_lr_z_for_the_directions_and_lr_alpha_for_the_weights():
    """make_optimizer: Adam at torch's defaults (betas 0.9, 0.999, eps 1e-8), peak lr_z for each layer's directions z
    and lr_alpha for its weights log_alpha: three steps on random gradients move the features as torch.optim.Adam,
    built here with those two learning rates, does."""
    _, student = small_pair()
    ref = copy.deepcopy(student)
    optim = distill.make_optimizer(student, distill.DistillConfig(lr_z=0.01, lr_alpha=0.3, out_dir="x"))
    for g in optim.param_groups:
        g["lr"] = g["peak"]                                                 # as train_step sets it
    mine, theirs = ({n: p for n, p in m.named_parameters() if p.requires_grad} for m in (student, ref))
    assert sorted(mine) == [f"h.{l}.attn.core.feature_map.{n}" for l in (0, 1) for n in ("log_alpha", "z")]
    adam = torch.optim.Adam([{"params": [p for n, p in theirs.items() if n.endswith(".z")], "lr": 0.01},
                             {"params": [p for n, p in theirs.items() if n.endswith("log_alpha")], "lr": 0.3}])
    before, gen = {n: p.detach().clone() for n, p in mine.items()}, torch.Generator().manual_seed(0)
    for _ in range(3):
        for n, p in mine.items():
            p.grad = torch.randn(p.shape, generator=gen)
            theirs[n].grad = p.grad.clone()
        optim.step()
        adam.step()
    for n, p in mine.items():
        assert not torch.allclose(p, before[n], atol=1e-3) and torch.allclose(p, theirs[n], rtol=1e-5, atol=1e-6), n


def test_make_student_draws_the_initial_features_from_seed():
    """make_student with --dims: the features of teacher.linearize drawn right after torch.manual_seed(--seed),
    whatever the global generator held before; --seed 0 and 1 give other directions."""
    teacher, _ = small_pair()
    made = {}
    for seed in (0, 1):
        torch.manual_seed(123)                                              # whatever the global RNG holds
        student, dims, layer_dof = distill.make_student(distill.DistillConfig(dims="4,4", seed=seed, out_dir="x"),
                                                        teacher, None)
        torch.manual_seed(seed)
        want = checkpoint.feature_state(teacher.linearize([4, 4]))
        made[seed] = checkpoint.feature_state(student)
        assert dims == [4, 4] and layer_dof is None and made[seed].keys() == want.keys()
        assert all(torch.equal(made[seed][k], want[k]) for k in want)
    assert not torch.equal(made[0]["h.0.attn.core.feature_map.z"], made[1]["h.0.attn.core.feature_map.z"])


def test_seed_draws_the_training_windows_and_seed_plus_one_the_held_out_ones(setup, tmp_path, monkeypatch):
    """--seed s: training windows from a generator seeded s, validation windows from s + 1 (and the calibration
    windows from s + 2, datafiles.calibration_batches), so that runs of other seeds train on other windows."""
    d, ckpt, data = setup
    drawn, real = [], datafiles.get_batch
    monkeypatch.setattr(datafiles, "get_batch", lambda tokens, B, T, gen, *a: drawn.append(
        (len(tokens), gen.initial_seed())) or real(tokens, B, T, gen, *a))
    distill.main([str(a) for a in ["--model", ckpt, "--data", data, "--budget", 4, "--alloc", "fix", "--seed", 7,
                                   "--max-steps", 2, "--prompt", "", "--out-dir", tmp_path / "run", *FAST]])
    n_train, n_val = (len(datafiles.read_tokens(data / f"{s}.bin")) for s in ("train", "val"))
    assert drawn == [(n_train, 9)] * 2 + [(n_val, 8), (n_train, 7), (n_train, 7)]      # --calib-batches 2 first


def test_restore_brings_back_the_torch_rng_and_the_data_position(tmp_path):
    """restore (--resume): after a checkpoint saved at step 3, torch's global generator and the training windows'
    generator draw what they drew right after the save, whatever they were set to since."""
    _, student = small_pair()
    cfg = distill.DistillConfig(out_dir=str(tmp_path / "ck"), max_steps=10, resume=True)
    optim, gen = distill.make_optimizer(student, cfg), torch.Generator().manual_seed(5)
    resume.save_checkpoint(cfg, student, optim, gen, {"step": 3}, {"val": [{"step": 3}], "history": []})
    after = torch.rand(4), torch.randint(100, (4,), generator=gen)
    torch.manual_seed(99)
    gen2 = torch.Generator().manual_seed(6)
    step, metrics = resume.restore(cfg, distill.make_optimizer(student, cfg), gen2)
    assert step == 3 and metrics["val"] == [{"step": 3}]
    assert torch.equal(torch.rand(4), after[0]) and torch.equal(torch.randint(100, (4,), generator=gen2), after[1])


def test_the_losses_a_training_step_returns_carry_no_graph():
    """train_step's losses (kept on the device until a log line) hold no autograd graph, for the layerwise losses
    and the direct one: a graph kept alive would hold every step's activations until the next log line."""
    teacher, student = small_pair()
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 50, (2, 16), generator=gen), torch.randint(0, 50, (2, 16), generator=gen)
    for kind in ("softmax", "l2", "direct"):
        cfg = distill.DistillConfig(loss=kind, query_block=8, out_dir="x")
        optim = RecordingOptim([p for p in student.parameters() if p.requires_grad])
        trainer = distill.Trainer(cfg, teacher, student, optim, None, None, "cpu")
        trainer.next_batch = lambda: (x, y)
        losses = distill.train_step(trainer, 0)
        assert not losses.requires_grad and losses.grad_fn is None, kind


STEP_MEMORY = """if True:
    import json, re, sys
    import torch
    import datafiles, devices, distill, model
    kind = sys.argv[1]
    torch.manual_seed(0)
    shape = model.GPTConfig(n_layer=12, n_head=12, n_kv_head=12, n_embd=768, head_dim=64, block_size=512,
                            mlp_hidden=3072, vocab_size=8192)
    teacher = model.GPT(shape).eval().requires_grad_(False)
    student = teacher.linearize([32] * 12)
    cfg = distill.DistillConfig(loss=kind, batch_size=2, block_size=512, budget=32, out_dir="x")
    said = {}
    devices.check_free_memory = lambda nbytes, *a: said.setdefault("bytes", nbytes)
    datafiles.check_memory(cfg, shape, "cpu", [32] * 12, kind)
    t = distill.Trainer(cfg, teacher, student, distill.make_optimizer(student, cfg), None, None, "cpu")
    batch = torch.randint(0, 8192, (2, 512)), torch.randint(0, 8192, (2, 512))
    t.next_batch = lambda: batch
    status = lambda key: 1024 * int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
    open("/proc/self/clear_refs", "w").write("5")                # the peak resident size starts again here
    before = status("VmRSS")
    distill.train_step(t, 0)
    print(json.dumps({"estimate": said["bytes"], "step": status("VmHWM") - before}))"""


@pytest.mark.parametrize("kind", ["softmax", "direct"])
def test_the_memory_estimate_covers_a_real_step_at_gpt2s_shape(kind):
    """datafiles.check_memory's estimate against the peak memory a training step really takes (the peak resident
    size over one step, reset before it, less the resident size before it, in a fresh process whose large blocks go
    back to the system when freed) at GPT-2-124M's shape, 2 windows of 512 tokens: at least the step's, and within
    2.5 times of it."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("the peak resident size is reset through Linux's /proc/self/clear_refs")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    r = subprocess.run([sys.executable, "-c", STEP_MEMORY, kind], cwd=ROOT, capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    assert got["step"] <= got["estimate"] <= 2.5 * got["step"], got
