"""bench/passkey.py: prompts of a length in tokens, the key at its depth, seeds, scoring, the JSON layout of
`bench/long_context.py --passkey`, and its refusals."""

import json
import re
import shutil
import types

import numpy as np
import pytest
import torch

import devices
import door
import evaluate
import long_context
import passkey
from conftest import DATA, N_POS, edit_json, needs_smollm2, snapshot
from tokenizer import load_tokenizer

TOKENIZERS = ["gpt2-tokenizer", "gpt-neox-20b-tokenizer/20B_tokenizer.json",
              pytest.param("smollm2-135m", marks=needs_smollm2)]


def settings(trials=20, seed=0):
    """What make_trials reads of EvalConfig."""
    return types.SimpleNamespace(passkey_trials=trials, seed=seed)


def filler_count(text):
    """The filler sentences in a prompt's text, before and after the needle."""
    before, after = re.split(r"The pass key is [0-9]+\. Remember it\. [0-9]+ is the pass key\.", text)
    count = lambda part: sum(part.count(s) for s in passkey.FILLER)  # noqa: E731
    return count(before), count(after)


@pytest.fixture(scope="module")
def encodings():
    return {}


def encoding(encodings, name):
    if name not in encodings:
        encodings[name] = load_tokenizer(name if name == "smollm2-135m" else DATA / name)
    return encodings[name]


@pytest.mark.parametrize("name", TOKENIZERS)
def test_prompts_fill_their_length_to_the_last_sentence_with_the_key_once_at_its_depth(name, encodings):
    """Every prompt is at most its length in tokens, and one more filler sentence would pass it; the needle is in
    it once, floor(depth * n) of its n sentences before it; the key has 5 digits and trial t's depth lies in
    bucket t % 5."""
    enc = encoding(encodings, name)
    lengths = [passkey.shortest(enc), 100, 257, 1000]
    trials = passkey.make_trials(enc, lengths, settings(10), 4096)
    assert list(trials) == lengths
    for length, ts in trials.items():
        for t, trial in enumerate(ts):
            text, key, depth = enc.decode(trial["tokens"]), trial["key"], trial["depth"]
            before, after = filler_count(text)
            n = before + after
            assert text == passkey.prompt_text(key, depth, n)
            assert len(trial["tokens"]) <= length < len(enc.encode(passkey.prompt_text(key, depth, n + 1)))
            assert text.count(passkey.NEEDLE.format(key=key)) == 1 and text.count(str(key)) == 2
            assert 10000 <= key <= 99999
            assert t % 5 <= depth * 5 < t % 5 + 1
            assert before == int(depth * n)
        if length > lengths[0]:
            assert min(len(trial["tokens"]) for trial in ts) >= length - 8                # a sentence at most
            assert all(filler_count(enc.decode(t["tokens"]))[0] > 0 for t in ts[1:5])     # depth above 0.2


def test_the_same_seed_gives_the_same_prompts(enc):
    """Keys, depths and tokens are a function of (--seed, length, trial) alone: the same in a second call, and in a
    call with other lengths; another seed draws other keys."""
    a = passkey.make_trials(enc, [80, 120], settings(6), N_POS)
    assert a == passkey.make_trials(enc, [80, 120], settings(6), N_POS)
    assert a[120] == passkey.make_trials(enc, [120], settings(6), N_POS)[120]
    assert [t["key"] for t in a[80]] != [t["key"] for t in a[120]]
    other = passkey.make_trials(enc, [80, 120], settings(6, seed=1), N_POS)
    assert [t["key"] for t in other[80]] != [t["key"] for t in a[80]]


class Answering:
    """A model whose greedy tokens after a prompt are `answer(key)` for the prompt's key; it keeps its batches'
    shapes."""

    def __init__(self, enc, answer):
        self.enc, self.answer, self.batches = enc, answer, []

    def generate(self, idx, max_new_tokens):
        self.batches.append(idx.shape)
        rows = []
        for row in idx.tolist():
            key = int(re.search(r"pass key is ([0-9]+)", self.enc.decode(row)).group(1))
            new = self.enc.encode(self.answer(key))[:max_new_tokens]
            rows.append(row + new + [self.enc.encode(" ")[0]] * (max_new_tokens - len(new)))
        return torch.tensor(rows)


@pytest.mark.parametrize("answer, accuracy", [
    (lambda key: f" {key}. Remember", 1.0),
    (lambda key: f"{key}", 1.0),
    (lambda key: f" is {key - 1}", 0.0),                # other digits
    (lambda key: f" {key}7", 0.0),                      # the key and more: not the key
    (lambda key: " unknown", 0.0),                      # no digits at all
])
def test_scoring_is_an_exact_match_of_the_first_number(enc, answer, accuracy):
    ts = passkey.make_trials(enc, [90], settings(10), N_POS)[90]
    found = passkey.answers(Answering(enc, answer), enc, [t["tokens"] for t in ts], 4, "cpu")
    r = passkey.result(ts, found)
    assert r["accuracy"] == accuracy and r["n"] == 10 and r["stderr"] == 0.0
    assert [t["correct"] for t in r["trials"]] == [bool(accuracy)] * 10
    assert [t["answer"] for t in r["trials"]] == [passkey.first_number(answer(t["key"])) for t in ts]


def test_accuracy_stderr_and_depth_buckets_by_hand(enc):
    """Correct in trials 0, 1, 5: accuracy 3/10, stderr the sample stdev over sqrt(10); bucket 0.0 (trials 0, 5) 1,
    0.2 (1, 6) 1/2, the others 0."""
    ts = passkey.make_trials(enc, [90], settings(10), N_POS)[90]
    found = [str(t["key"]) if i in (0, 1, 5) else "" for i, t in enumerate(ts)]
    r = passkey.result(ts, found)
    assert r["accuracy"] == pytest.approx(0.3)
    assert r["stderr"] == pytest.approx((0.3 * 0.7 * 10 / 9) ** 0.5 / 10 ** 0.5)
    assert r["by_depth"] == {"0.0": {"accuracy": 1.0, "n": 2}, "0.2": {"accuracy": 0.5, "n": 2},
                             "0.4": {"accuracy": 0.0, "n": 2}, "0.6": {"accuracy": 0.0, "n": 2},
                             "0.8": {"accuracy": 0.0, "n": 2}}
    assert passkey.result(ts[:1], found[:1])["stderr"] is None


def test_batches_hold_prompts_of_one_length_and_shares_merge(enc, monkeypatch):
    """Prompts are batched only with prompts of their own length (no padding), at most batch_size a batch; two
    simulated processes each decode a share, and their shares put together are the one-process answers."""
    ts = passkey.make_trials(enc, [100], settings(12), N_POS)[100]
    prompts = [t["tokens"] for t in ts]
    assert len({len(p) for p in prompts}) > 1                         # lengths differ by a token or two
    fake = Answering(enc, lambda key: f" {key}")
    one = passkey.answers(fake, enc, prompts, 3, "cpu")
    assert sum(shape[0] for shape in fake.batches) == 12 and max(shape[0] for shape in fake.batches) <= 3
    sizes = {}
    for shape in fake.batches:
        sizes[shape[1]] = sizes.get(shape[1], 0) + shape[0]
    assert sizes == {T: sum(len(p) == T for p in prompts) for T in sizes}
    assert one == [str(t["key"]) for t in ts]
    shares = []
    monkeypatch.setattr(devices, "get_world_size", lambda: 2)
    monkeypatch.setattr(devices, "all_gather", raise_share)
    for rank in (0, 1):
        monkeypatch.setattr(devices, "get_rank", lambda: rank)
        with pytest.raises(Gathered) as e:
            passkey.answers(fake, enc, prompts, 3, "cpu")
        shares.append(e.value.args[0])
    assert sorted(shares[0]) == list(range(0, 12, 2)) and sorted(shares[1]) == list(range(1, 12, 2))
    monkeypatch.setattr(devices, "all_gather", lambda share: shares)
    assert passkey.answers(fake, enc, prompts, 3, "cpu") == one


class Gathered(Exception):
    """What a process hands all_gather: its share."""


def raise_share(share):
    raise Gathered(share)


@pytest.fixture(scope="module")
def held_out(enc, tmp_path_factory):
    """A token file for bench/long_context.py, which scores its loss before the passkey."""
    path = tmp_path_factory.mktemp("held-out") / "val.bin"
    np.array(enc.encode_ordinary(" ".join(passkey.FILLER * 10)), dtype=np.uint16).tofile(path)
    return path


def passkey_cli(*args):
    """bench/long_context.py with its loss on one short window, then the passkey of `args`."""
    return long_context.main([str(a) for a in ["--tokens", 40, "--contexts", 32, *args]])


def test_cli_json_layout_teacher_and_student(ckpt, student, held_out, tmp_path, capsys, monkeypatch):
    """long_context.py --passkey, a run with --what teacher and a run with a distill.py checkpoint: a table a model;
    record["passkey"][str(length)] with accuracy, stderr, n and by_depth (the per-trial rows dropped); the prompts
    decoded are make_trials's for --seed (its keys at its depths)."""
    run = tmp_path / "run"   # the student with the run record distill.py writes beside it, which long_context reads
    shutil.copytree(student, run)
    edit_json(run / "config.json", seed=0, step=0, block_size=N_POS)
    expected = passkey.make_trials(load_tokenizer(ckpt), [80, 120], settings(5, seed=3), N_POS)
    decoded, answers = [], passkey.answers

    def recorded(lm, enc, prompts, *args):
        decoded.append(prompts)
        return answers(lm, enc, prompts, *args)
    monkeypatch.setattr(passkey, "answers", recorded)
    for what, kind in (("teacher", "teacher"), (run, "student")):
        out = tmp_path / f"{kind}.json"
        passkey_cli("--model", ckpt, "--data", held_out, "--what", what, "--passkey", "80,120", "--passkey-trials", 5,
                    "--seed", 3, "--out", out)
        assert f"passkey {what}:" in capsys.readouterr().out
        r = json.loads(out.read_text())
        assert r["kind"] == kind and list(r["passkey"]) == ["80", "120"]
        for length in (80, 120):
            res = r["passkey"][str(length)]
            assert set(res) == {"accuracy", "stderr", "n", "by_depth"} and res["n"] == 5
            assert res["by_depth"] == {b: {"accuracy": res["by_depth"][b]["accuracy"], "n": 1}
                                       for b in ("0.0", "0.2", "0.4", "0.6", "0.8")}
            assert res["accuracy"] == pytest.approx(sum(d["accuracy"] for d in res["by_depth"].values()) / 5)
        assert decoded == [[t["tokens"] for t in expected[length]] for length in (80, 120)]
        decoded.clear()


def test_a_student_answers_as_its_model_decodes(ckpt, student, enc):
    """answers() is the greedy continuation of GPT.generate for a linear student too (one prompt, from scratch)."""
    from tasks import load_student
    linear = load_student(student)[0]
    ts = passkey.make_trials(enc, [90], settings(2), N_POS)[90]
    found = passkey.answers(linear, enc, [t["tokens"] for t in ts], 2, "cpu")
    for t, a in zip(ts, found):
        x = torch.tensor([t["tokens"]])
        new = linear.generate(x, passkey.NEW_TOKENS)[0, x.size(1):].tolist()
        assert a == passkey.first_number(enc.decode(new))


def passkey_exit(capsys, *args):
    with pytest.raises(SystemExit) as e:
        door.run_main(lambda: passkey_cli(*args))
    return e.value.code, capsys.readouterr().err


BAD_FLAGS = [  # flags after --model, --data and --out, the sentence on stderr, whether the model is loaded first
    (["--passkey", "256,abc"], r"--passkey must be prompt lengths in tokens, positive whole numbers separated by "
                               r"commas \(e.g. 256,512,1024\), got '256,abc'", False),
    (["--passkey", "0"], r"--passkey must be prompt lengths in tokens, .*, got '0'", False),
    (["--passkey", "-64"], r"--passkey must be prompt lengths in tokens, .*, got '-64'", False),
    (["--passkey", "64.5"], r"--passkey must be prompt lengths in tokens, .*, got '64.5'", False),
    (["--passkey", " , "], r"--passkey must be prompt lengths in tokens, .*, got ' , '", False),
    (["--passkey", "64", "--passkey-trials", "0"], r"--passkey-trials must be a number of at least 1, got 0", False),
    (["--passkey", "80,121"], rf"--passkey 121 is more than the model's context of {N_POS} tokens holds with the 8 "
                              r"tokens decoded after the prompt; pass lengths of at most 120", True),
]


@pytest.mark.parametrize("flags, sentence, loaded", BAD_FLAGS, ids=[" ".join(f) for f, _, _ in BAD_FLAGS])
def test_bad_passkey_flags_are_one_sentence_before_any_work(flags, sentence, loaded, ckpt, held_out, tmp_path,
                                                            capsys, monkeypatch):
    """Lengths that are not positive whole numbers are refused before the model is loaded; a length the model's
    context cannot hold once it is; nothing scored or decoded, nothing written."""
    if not loaded:
        monkeypatch.setattr(long_context, "load", lambda *a: pytest.fail("a model was loaded"))
    monkeypatch.setattr(evaluate, "perplexity", lambda *a: pytest.fail("a window was scored"))
    monkeypatch.setattr(passkey, "answers", lambda *a: pytest.fail("a prompt was decoded"))
    before = snapshot(tmp_path)
    code, err = passkey_exit(capsys, "--model", ckpt, "--data", held_out, "--out", tmp_path / "r.json", *flags)
    assert code == 2 and re.fullmatch("error: " + sentence + "\n", err), err
    assert snapshot(tmp_path) == before


def test_a_length_too_short_for_the_prompt_says_the_shortest_that_works(ckpt, enc, held_out, tmp_path, capsys,
                                                                         monkeypatch):
    """A length below the prompt without filler: the sentence names the shortest length that holds every key, and
    that length is accepted for any seed."""
    monkeypatch.setattr(passkey, "answers", lambda *a: pytest.fail("a prompt was decoded"))
    least = passkey.shortest(enc)
    before = snapshot(tmp_path)
    code, err = passkey_exit(capsys, "--model", ckpt, "--data", held_out, "--out", tmp_path / "r.json", "--passkey",
                             f"100,{least - 10}")
    assert code == 2 and err == (f"error: --passkey {least - 10} is too short to hold the task, the key and the "
                                 f"question; pass lengths of at least {least}\n")
    assert snapshot(tmp_path) == before
    for seed in range(3):
        trials = passkey.make_trials(enc, [least], settings(20, seed), N_POS)[least]
        assert max(len(t["tokens"]) for t in trials) <= least
    assert passkey.fit(enc, 99999, 0.5, least - 8) is None                 # and it is not far above it
