"""experiments/window.py, a window of exact softmax beside the features: its plain form against the equation, the
chunked form and the recurrent step against the plain form (values and gradients), W = 0 against the core bit for
bit, the loss's blockwise form against its plain form, and the fork end to end."""

import json
import math
import re

import numpy as np
import pytest
import torch

import distill
import door
import evaluate
import forks
import model
import tasks
import window
from conftest import EVAL, FAST, ROOT, cli, distill_args, features
from test_dof import qkv, rel
from test_experiments import forked, refusal

CHUNK = 16


def window_core(W, H=4, Hkv=2, D=16, M_=8, seed=0, dtype=torch.float64, S=0):
    torch.manual_seed(seed)
    core = window.WindowAttention(H, Hkv, D, M_, chunk_size=CHUNK).to(dtype)
    with torch.no_grad():
        core.feature_map.log_alpha.normal_(0, 0.3)
        core.key_mean.normal_(0, 0.2)
    core.window, core.sinks = W, S
    return core


def parts(core, q, k):
    """The fp32 or fp64 queries, centred keys, features and log F(q) the core computes from."""
    q, kc = core.inputs(q, k)
    return (q, kc, *core.features(q, kc), window.query_log_factor(core.feature_map, q))


def reference(core, q, k, v):
    """The plain T x T form on the core's own inputs and features."""
    q, kc, phi_q, phi_k, log_f = parts(core, q, k)
    return window.hybrid_reference(q, kc, model.repeat_kv(v, q.size(1)), phi_q, phi_k, log_f, core.window, core.sinks)


@pytest.mark.parametrize("W,S", [(0, 0), (1, 0), (5, 0), (40, 0), (5, 3), (1, 1), (40, 4)])
def test_plain_form_is_the_equation_with_one_normaliser(W, S):
    """With the true features Phi (their plain log formula) and e^(q.k / sqrt d) on the window and the sinks, no factor
    and no shift: y_i = (sum_exact e^(q.k) v + sum_between Phi(q).Phi(k) v) / (the same without v), in fp64."""
    core = window_core(W, S=S)
    q, k, v = [x.double() for x in qkv(2, 4, 2, 33, 16, scale=0.7, seed=W)]
    q_, kc = core.inputs(q, k)
    lq, lk = core.feature_map.log_features(q_), core.feature_map.log_features(kc)
    features = torch.logsumexp(lq[..., :, None, :] + lk[..., None, :, :], -1).exp()   # Phi(q_i).Phi(k_j)
    exact = (q_ @ kc.mT / 4).exp()
    i, j = torch.arange(33)[:, None], torch.arange(33)
    exact_keys = (j <= i) & ((j > i - W) | (j < S))
    a = torch.where(exact_keys, exact, 0.0) + torch.where((j <= i) & ~exact_keys, features, 0.0)
    want = a @ model.repeat_kv(v, 4) / a.sum(-1, keepdim=True)
    assert rel(reference(core, q, k, v), want) < 1e-12


@pytest.mark.parametrize("T", [1, 37, 64])
@pytest.mark.parametrize("W,S", [(0, 0), (1, 0), (CHUNK, 0), (70, 0), (1, 4), (CHUNK, 4), (5, 20), (3, 70)])
def test_chunked_form_equals_the_plain_form_forward_and_backward(W, S, T):
    """W = 0, 1, the chunk size and more than T; S sinks, more than a chunk and more than T; T not a multiple of the
    chunk; the gradients of q, k, v, z and alpha (the exact logits carry q's and k's)."""
    core = window_core(W, seed=T, S=S)
    q, k, v = [x.double().requires_grad_() for x in qkv(2, 4, 2, T, 16, seed=T)]
    g = torch.randn(2, 4, T, 16, dtype=torch.float64)
    y = core(q, k, v)
    fast = torch.autograd.grad((y * g).sum(), [q, k, v, *core.parameters()])
    ref = reference(core, q, k, v)
    slow = torch.autograd.grad((ref * g).sum(), [q, k, v, *core.parameters()])
    assert rel(y, ref) < 1e-12
    for a, b in zip(fast, slow):      # against |dv|: at T = 1 or W > T the features' gradients are exactly zero
        assert (a - b).norm() < 1e-10 * fast[2].norm()


def test_window_zero_is_the_cores_linear_attention_bit_for_bit():
    """The chunked form at W = 0 (the scan on undelayed keys, no window) and the fork's core at W = 0, forward and
    decoding, against the core's, in fp32."""
    core = window_core(0, dtype=torch.float32)
    plain = model.LinearAttention(4, 2, 16, 8, chunk_size=CHUNK)
    plain.load_state_dict(core.state_dict())
    q, k, v = qkv(2, 4, 2, 50, 16, seed=1)
    q_, kc, phi_q, phi_k, log_f = parts(core, q, k)
    y, _ = window.hybrid_attention(q_, kc, model.repeat_kv(v, 4), phi_q, phi_k, log_f, 0, CHUNK)
    assert torch.equal(y, model.causal_linear_attention(phi_q, phi_k, model.repeat_kv(v, 4), CHUNK))
    assert torch.equal(core(q, k, v), plain(q, k, v))
    a, b = {}, {}
    for t in (slice(0, 20), slice(20, 21), slice(21, 22)):
        assert torch.equal(core(q[:, :, t], k[:, :, t], v[:, :, t], a), plain(q[:, :, t], k[:, :, t], v[:, :, t], b))


def test_a_window_wider_than_the_sequence_is_softmax_attention():
    core = window_core(64, dtype=torch.float32)
    q, k, v = qkv(2, 4, 2, 64, 16, scale=2.0, seed=2)
    assert rel(core(q, k, v), model.SoftmaxAttention()(q, k, v)) < 1e-5


@pytest.mark.parametrize("W,S", [(1, 0), (5, 0), (CHUNK, 0), (60, 0), (1, 4), (5, 4), (5, 15), (CHUNK, 2)])
def test_decoding_token_by_token_equals_the_full_forward(W, S):
    """A prefill of 11 tokens, then one token at a time (the ring buffer: key n - W enters the state as token n
    takes its slot, unless it is a sink), then 7 tokens at once from the cache (as the fast scorer continues a shared
    prefix); 15 sinks: more than the prefill, the rest kept as they come."""
    core = window_core(W, seed=W, S=S)
    q, k, v = [x.double() for x in qkv(2, 4, 2, 50, 16, seed=W)]
    full = core(q, k, v)
    cache, ys = {}, []
    for s, e in [(0, 11)] + [(t, t + 1) for t in range(11, 43)] + [(43, 50)]:
        ys.append(core(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], cache))
    assert rel(torch.cat(ys, 2), full) < 1e-12
    assert cache["n"] == 50 and cache["k"].shape == (2, 2, W, 16)          # keys and values kept at Hkv heads
    assert cache["sk"].shape == (2, 2, S, 16) and torch.equal(cache["sv"], v[:, :, :S])


@pytest.mark.parametrize("W,S", [(0, 0), (1, 0), (20, 0), (40, 0), (1, 4), (20, 4)])
@pytest.mark.parametrize("block", [7, 128])
def test_loss_blockwise_equals_its_plain_form_forward_and_backward(W, S, block):
    """The KL of the hybrid's rows, blockwise with the gradient written out, against the plain T x T form under
    autograd; at W = 0, the core's softmax loss, bit for bit."""
    core = window_core(W, seed=3, S=S)
    q, k, _ = [x.double() for x in qkv(2, 4, 2, 33, 16, scale=1.5, seed=3)]
    q, kc, fq, fk, log_f = parts(core, q, k)
    pq, pk = fq.detach().requires_grad_(), fk.detach().requires_grad_()
    plain = window.softmax_loss(q, kc, pq, pk, log_f, W, S)                  # (B, H, T)
    plain.sum().backward()
    want = (pq.grad, pk.grad)
    pq.grad, pk.grad = torch.zeros_like(pq), torch.zeros_like(pk)
    sums = window.softmax_loss_blockwise(q / 4, kc, pq, pk, log_f, W, block, 1.0, S)
    assert plain.min() > -1e-12 and (W + S < 33) == (plain.max() > 1e-3)   # W > T: the teacher's rows exactly
    for a, b in ((sums, plain.sum((0, 2))), (pq.grad, want[0]), (pk.grad, want[1])):
        assert (a - b).norm() < 1e-10 * max(b.norm(), 1e-3)
    if W == 0:
        grads = pq.grad, pk.grad
        pq.grad, pk.grad = torch.zeros_like(pq), torch.zeros_like(pk)
        core_sums = distill.softmax_loss_blockwise(q / 4, kc, pq, pk, block, 1.0)
        assert torch.equal(sums, core_sums)
        assert torch.equal(pq.grad, grads[0]) and torch.equal(pk.grad, grads[1])


def test_the_window_lowers_the_loss_of_an_untrained_student_on_every_row_it_covers():
    """Rows whose keys all lie in the window are the teacher's exactly: their KL is zero."""
    core = window_core(8, seed=4)
    q, k, _ = [x.double() for x in qkv(1, 4, 2, 20, 16, seed=4)]
    q, kc, fq, fk, log_f = parts(core, q, k)
    kl = window.softmax_loss(q, kc, fq, fk, log_f, 8)
    assert kl[..., :8].abs().max() < 1e-12 and kl[..., 8:].min() > 1e-6


def test_window_fork_trains_resumes_and_scores_and_the_core_refuses_its_checkpoint(setup, tmp_path):
    """`window.py --window 8`: config.json records the window and the fork; `window.py evaluate` scores the student
    with its window (the perplexity of the hybrid, not of W = 0); evaluate.py refuses the checkpoint; --resume with
    another --window, a negative one and a feature map whose products are not e^(q.k / sqrt d) are one sentence."""
    d, ckpt, data = setup
    out = tmp_path / "win"
    r = cli("experiments/window.py", "--window", 8, "--sinks", 2, "--model", ckpt, "--data", data, "--budget", 6, "--max-steps", 4,
            "--decay-steps", 6, "--out-dir", out, *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["args"]["window"] == 8 and cfg["args"]["sinks"] == 2 and cfg["fork"] == "experiments/window.py"
    kl = json.loads((out / "metrics.json").read_text())["val"][-1]["attn_kl"]
    with forked("window", window.REPLACE):
        student, _ = tasks.load_student(out)
        assert [(c.window, c.sinks) for c in student.cores()] == [(8, 2)] * 4
        x = torch.from_numpy(np.fromfile(data / "val.bin", dtype=np.uint16)[:64].astype(np.int64))[None]
        cfg = door.parse_config(distill.DistillConfig, distill_args(ckpt, data, out, "--window", 8))
        trainer = distill.Trainer(cfg, model.GPT.from_pretrained(ckpt), student, None, None, None, "cpu",
                                  torch.autocast("cpu", enabled=False))
        again = distill.student_losses(trainer, x, "softmax")
    assert all(map(math.isfinite, kl)) and again.min() > 0
    student, saved = forks.open_student(ROOT / "experiments" / "window.py", out, teacher=ckpt)   # in one call
    assert saved["fork"] == "experiments/window.py" and [c.window for c in student.cores()] == [8] * 4
    assert forks.FORK is None and model.LinearAttention is not window.WindowAttention        # the core's names back
    with pytest.raises(door.ModelError, match="^" + re.escape(refusal(out, "window", ckpt)) + "$"):
        evaluate.main([str(a) for a in ["--model", ckpt, "--ckpt", out, "--ppl", data / "val.bin", "--device", "cpu"]])
    r = cli("experiments/window.py", "--window", 4, "--model", ckpt, "--data", data, "--budget", 6,
            "--max-steps", 6, "--decay-steps", 6, "--out-dir", out, "--resume", *FAST)
    assert r.returncode == 2 and r.stderr == f"error: {out} was started with --window 8, not 4; resume it with the " \
                                             "flags it was started with\n", r.stderr[-3000:]
    r = cli("experiments/window.py", "evaluate", "--model", ckpt, "--ckpt", out, "--ppl", data / "val.bin",
            "--ppl-max-tokens", 300, "--device", "cpu", "--output", tmp_path / "ppl.json")
    assert r.returncode == 0, r.stderr[-3000:]
    ppl = json.loads((tmp_path / "ppl.json").read_text())["ppl"]
    tokens = np.fromfile(data / "val.bin", dtype=np.uint16)[:300].astype(np.int64)
    with forked("window", window.REPLACE):
        student = tasks.load_student(out)[0]
        assert ppl["student"] == pytest.approx(evaluate.perplexity(student, tokens), rel=1e-6)
        window.set_window(student, 0)
        assert ppl["student"]["loss"] != pytest.approx(evaluate.perplexity(student, tokens)["loss"], rel=1e-6)
    distill.main(distill_args(ckpt, data, tmp_path / "plain", "--budget", "6", "--max-steps", "0"))
    r = cli("experiments/window.py", "--window", 8, "--model", ckpt, "--data", data, "--init-from",
            tmp_path / "plain", "--loss", "direct", "--max-steps", 2, "--out-dir", tmp_path / "direct", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]                        # a core checkpoint, trained on with a window
    cfg = json.loads((tmp_path / "direct" / "config.json").read_text())
    assert cfg["args"]["window"] == 8 and cfg["init_from"] == str(tmp_path / "plain")
    assert not torch.equal(features(tmp_path / "direct")["h.0.attn.core.feature_map.z"],
                           features(tmp_path / "plain")["h.0.attn.core.feature_map.z"])
    for flags, said in (([-1], "--window must be a number of at least 0, got -1"),
                        ([64], "--window 64 holds every key of a --block-size 64 window, so the features would "
                         "never train; pass a --window below 64"),
                        ([8, "--sinks", -1], "--sinks must be a number of at least 0, got -1"),
                        ([60, "--sinks", 4], "--window 60 and --sinks 4 hold every key of a --block-size 64 window, "
                         "so the features would never train; pass a --window below 60"),
                        ([0, "--sinks", 4], "--sinks needs a window of at least one key; pass --window 1 or more"),
                        ([8, "--feature-map", "dijiang"], "--window needs features whose products estimate "
                         "e^(q.k / sqrt d), as prf and performer do, not dijiang; pass --feature-map prf or --window 0")):
        r = cli("experiments/window.py", "--window", *flags, "--model", ckpt, "--data", data,
                "--out-dir", tmp_path / "bad", *FAST)
        assert r.returncode == 2 and r.stderr == f"error: {said}\n" and not (tmp_path / "bad").exists(), r.stderr


def test_positions_fork_refuses_positions_beyond_the_teachers_context_before_any_work(setup, tmp_path):
    """experiments/positions.py --positions beyond the teacher's context (here GPT-2's 128 learned positions) is
    refused once the teacher is read, before any work (it had stopped with an IndexError in wpe after its first
    checkpoint)."""
    import positions
    d, ckpt, data = setup
    with pytest.raises(door.ModelError, match=r"^--positions 1000 is more than the model's context of 128 tokens; "
                                              r"pass at most --positions 128$"), forked("positions", positions.REPLACE):
        distill.main(distill_args(ckpt, data, tmp_path / "run", "--window", 4, "--positions", 1000))
    assert list(tmp_path.iterdir()) == []


def test_window_fork_scores_tasks_from_a_cache_as_the_plain_scorer_does(setup, tmp_path):
    """`window.py evaluate` on tasks: the default scorer (a shared prefix prefilled, each row continued from a copy of
    the ring buffer and state) writes the log-likelihoods of --plain (one full forward pass per request), and --speed
    decodes through the cache."""
    d, ckpt, data = setup
    out = tmp_path / "win"
    r = cli("experiments/window.py", "--window", 5, "--model", ckpt, "--data", data, "--budget", 6, "--max-steps", 2,
            "--out-dir", out, *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    args = ["evaluate", "--model", ckpt, "--ckpt", out, "--tasks", "arc_easy,piqa", "--data-dir", EVAL,
            "--limit", 4, "--batch-size", 4, "--device", "cpu"]
    r = cli("experiments/window.py", *args, "--speed", "--speed-tokens", 40, "--output", tmp_path / "fast.json")
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli("experiments/window.py", *args, "--plain", "--output", tmp_path / "plain.json")
    assert r.returncode == 0, r.stderr[-3000:]
    fast, plain = (json.loads((tmp_path / f).read_text()) for f in ("fast.json", "plain.json"))
    for task in ("arc_easy", "piqa"):
        pairs = zip(plain["student"]["samples"][task], fast["student"]["samples"][task], strict=True)
        for p, f in pairs:
            assert f["loglikelihoods"] == pytest.approx(p["loglikelihoods"], abs=1e-4)
        teacher = [s["loglikelihoods"] for s in fast["samples"][task]]
        assert teacher != [s["loglikelihoods"] for s in fast["student"]["samples"][task]]
    assert fast["speed"]["student"]["tokens"] == 40
