"""experiments/streaming.py, the untrained window with sinks: against a plain masked softmax on the teacher's scores,
decoding against the full forward, and a window that holds every key against the teacher."""

import json
import math

import numpy as np
import pytest
import torch

import evaluate
import model
import streaming
from conftest import cli
from test_dof import qkv, rel


def masked_softmax(q, k, v, W, S):
    """The plain form: the teacher's scores q.k / sqrt d, -inf outside each query's first S and last W keys."""
    T = q.size(2)
    k, v = model.repeat_kv(k, q.size(1)), model.repeat_kv(v, q.size(1))
    i, j = torch.arange(T)[:, None], torch.arange(T)
    keep = (j <= i) & ((j > i - W) | (j < S))
    scores = (q @ k.mT / math.sqrt(q.size(-1))).masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("W,S", [(1, 0), (5, 0), (5, 3), (1, 4), (16, 2), (60, 0), (3, 60)])
def test_sink_window_is_masked_softmax_on_the_teachers_scores(W, S):
    q, k, v = [x.double() for x in qkv(2, 4, 2, 37, 16, scale=1.5, seed=W + S)]
    core = streaming.SinkWindowAttention(W, S)
    want = masked_softmax(q, k, v, W, S)
    assert rel(core(q, k, v), want) < 1e-12
    assert rel(core.attend(q, k, v, torch.arange(37), block=7), want) < 1e-12     # blocks of queries


def test_a_window_that_holds_every_key_is_the_teacher():
    q, k, v = qkv(2, 4, 2, 37, 16, seed=1)
    assert rel(streaming.SinkWindowAttention(37, 0)(q, k, v), model.SoftmaxAttention()(q, k, v)) < 1e-6


@pytest.mark.parametrize("W,S", [(1, 0), (5, 4), (5, 15), (16, 2)])
def test_decoding_keeps_the_sinks_and_a_ring_and_equals_the_full_forward(W, S):
    """A prefill of 11 tokens, one token at a time, then 7 at once from the cache; 15 sinks: more than the prefill."""
    core = streaming.SinkWindowAttention(W, S)
    q, k, v = [x.double() for x in qkv(2, 4, 2, 50, 16, seed=W)]
    cache, ys = {}, []
    for s, e in [(0, 11)] + [(t, t + 1) for t in range(11, 43)] + [(43, 50)]:
        ys.append(core(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], cache))
    assert rel(torch.cat(ys, 2), core(q, k, v)) < 1e-12
    assert cache["k"].shape == (2, 2, W, 16) and torch.equal(cache["sv"], v[:, :, :S])


def test_the_baseline_shares_the_teachers_weights_and_generates_as_its_forward(ckpt):
    teacher = model.GPT.from_pretrained(ckpt)
    baseline = streaming.sink_window(teacher, 6, 2)
    assert baseline.wte.weight is teacher.wte.weight
    idx = torch.randint(0, 100, (2, 9))
    out = baseline.generate(idx, 12)
    greedy = idx
    for _ in range(12):       # each token from a full forward pass over all before it
        greedy = torch.cat((greedy, baseline(greedy)[:, -1].argmax(-1, keepdim=True)), 1)
    assert torch.equal(out, greedy)
    c = teacher.config
    assert streaming.cache_bytes(c, 6, 2) == c.n_layer * 8 * 2 * c.n_kv_head * c.head_dim * 4


def test_the_fork_scores_the_untrained_window_beside_the_teacher_and_refuses_sinks_without_a_window(setup, tmp_path):
    """`streaming.py evaluate --window 8 --sinks 2`: perplexity of the model "window" beside the teacher,
    the perplexity the in-process baseline gives; a window holding every key scores as the teacher; --sinks alone
    is one sentence."""
    d, ckpt, data = setup
    out = tmp_path / "r.json"
    r = cli("experiments/streaming.py", "evaluate", "--model", ckpt, "--window", 8, "--sinks", 2, "--ppl",
            data / "val.bin", "--ppl-max-tokens", 300, "--ppl-context", 64, "--device", "cpu", "--output", out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "its decoding cache holds 10 tokens a layer" in r.stdout
    results = json.loads(out.read_text())
    tokens = np.fromfile(data / "val.bin", dtype=np.uint16)[:300].astype(np.int64)
    baseline = streaming.sink_window(model.GPT.from_pretrained(ckpt), 8, 2)
    want = evaluate.perplexity(baseline, tokens, 64)["loss"]
    assert results["ppl"]["window"]["loss"] == pytest.approx(want, rel=1e-6)
    assert results["ppl"]["window"]["loss"] != pytest.approx(results["ppl"]["teacher"]["loss"], rel=1e-4)
    r = cli("experiments/streaming.py", "evaluate", "--model", ckpt, "--window", 64, "--ppl", data / "val.bin",
            "--ppl-max-tokens", 300, "--ppl-context", 64, "--device", "cpu", "--output", out)
    ppl = json.loads(out.read_text())["ppl"]
    assert r.returncode == 0 and ppl["window"]["loss"] == pytest.approx(ppl["teacher"]["loss"], rel=1e-6)
    r = cli("experiments/streaming.py", "evaluate", "--model", ckpt, "--sinks", 4, "--ppl", data / "val.bin",
            "--device", "cpu")
    assert r.returncode == 2 and r.stderr == "error: --sinks needs --window; pass --window too, or drop --sinks\n"
