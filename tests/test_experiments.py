"""experiments/: the forks of the core (per-head feature dims, features drawn from the kernel's ridge leverage
scores, a direct-loss finetune, torch.compile'd losses, FLA's scan, Hedgehog's feature map), each against the core or
a reference. In-process a fork's names are set by common.replaced(fork.REPLACE) (and common.FORK by `forked`), as
`python experiments/<fork>.py` sets them; after each test the core's names are the core's."""

import importlib.util
import json
import math
import re
import shutil
import sys
import types
from contextlib import contextmanager

import numpy as np
import pytest
import torch

import checkpoint
import compiled
import datafiles
import devices
import direct_finetune
import distill
import dof
import door
import evaluate
import fla_scan
import forks
import hedgehog
import leverage
import model
import per_head
import tasks
from conftest import FAST, Calib, cli, distill_args, edit_json, features
from model import LinearAttention, causal_linear_attention, linear_attention_reference, repeat_kv
from test_dof import qkv, rel  # the method's test helpers
from test_loading import nudge


def distill_config(argv):
    """distill.py's config from argv, of the DistillConfig set now (a fork's, inside forked)."""
    return door.parse_config(distill.DistillConfig, argv)


# every name a fork may set (forks.FORK apart)
CORE_NAMES = [(model, "FEATURE_MAPS"), (model, "LinearAttention"), (model, "causal_linear_attention"),
              (distill, "DistillConfig"), (distill, "make_student"), (distill, "layer_losses"),
              (distill, "step_loss"), (distill, "softmax_loss_blockwise"), (distill, "l2_loss_blockwise"),
              (evaluate, "EvalConfig"), (tasks, "load_student"), (tasks, "load_models")]


@pytest.fixture(autouse=True)
def forks_do_not_leak():
    """Each test leaves the core's names (and FEATURE_MAPS' entries) as it found them, and no fork running."""
    before = {key: getattr(*key) for key in CORE_NAMES}
    maps = dict(model.FEATURE_MAPS)
    yield
    assert {key: getattr(*key) for key in CORE_NAMES} == before and model.FEATURE_MAPS == maps
    assert forks.FORK is None


@contextmanager
def forked(name, replace):
    """In-process what `python experiments/<name>.py` sets: common.FORK and the fork's names, undone after."""
    was = forks.FORK
    forks.FORK = f"experiments/{name}.py"
    try:
        with forks.replaced(replace):
            yield
    finally:
        forks.FORK = was


def refusal(what, fork, teacher):
    """forks.check_fork's sentence: checkpoint `what` (of `teacher`) of the fork experiments/<fork>.py in another
    script; the command it suggests names the teacher (without it, evaluate.py's default gpt2 needs the hub)."""
    script = f"experiments/{fork}.py"
    return (f"{what} was made by the fork {script}; open it with that script, e.g. `python {script} evaluate "
            f"--model {teacher} --ckpt {what}`, or resume it with that script and the flags it was started with")


def test_replaced_sets_a_forks_names_inside_and_the_cores_after():
    """common.replaced: per_head's classes and functions inside, the core's after, also when the block raises."""
    with forks.replaced(per_head.REPLACE):
        assert model.LinearAttention is per_head.GroupedLinearAttention
        assert distill.make_student is per_head.make_student
        assert distill.DistillConfig is per_head.PerHeadConfig and tasks.load_student is per_head.load_student
    with pytest.raises(ZeroDivisionError), forks.replaced(hedgehog.REPLACE):
        assert "hedgehog" in model.FEATURE_MAPS
        raise ZeroDivisionError
    assert model.LinearAttention is per_head.CoreLinearAttention and "hedgehog" not in model.FEATURE_MAPS


# ==================================================================================================================
# experiments/compiled.py and experiments/fla_scan.py against the core's losses and scan

def test_compiled_layerwise_loss_equals_the_eager_one():
    """experiments/compiled.py: its replace(), torch.compile of both blockwise losses, gives the eager values and
    gradients through distill.layer_losses."""
    torch.manual_seed(22)
    cores = [LinearAttention(2, 2, 8, 4) for _ in range(2)]
    qk = [(torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)) for _ in cores]
    eager = distill.softmax_loss_blockwise, distill.l2_loss_blockwise
    replace = compiled.replace()
    assert set(replace) == {(distill, "softmax_loss_blockwise"), (distill, "l2_loss_blockwise")}
    runs = []
    for fork in ({}, replace):
        with forks.replaced(fork):
            assert (distill.softmax_loss_blockwise is eager[0]) == (not fork)
            for kind in ("softmax", "l2"):
                value = distill.layer_losses(cores, qk, kind, 8, 1.0)
                runs.append((value, [p.grad.clone() for c in cores for p in c.parameters()]))
                for c in cores:
                    c.zero_grad()
    for (v0, g0), (v1, g1) in zip(runs[:2], runs[2:]):
        assert torch.allclose(v0, v1, rtol=1e-5) and all(torch.allclose(a, b, rtol=1e-4, atol=1e-7)
                                                          for a, b in zip(g0, g1))


def test_compiled_losses_without_a_cxx_compiler_are_one_sentence(monkeypatch):
    """experiments/compiled.py where inductor finds no working C++ compiler (it compiles at the first call): one
    sentence saying what it needs, or to run distill.py (it had been an InductorError traceback). The compiler's
    failure is raised here as inductor raises it, without compiling."""
    from torch._inductor.exc import InductorError, InvalidCxxCompiler

    def no_compiler(fn, **kwargs):
        def call(*args):
            raise InductorError(InvalidCxxCompiler(), None)
        return call
    monkeypatch.setattr(compiled.torch, "compile", no_compiler)
    cores = [LinearAttention(2, 2, 8, 4)]
    qk = [(torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8))]
    with pytest.raises(door.ModelError, match=r"^torch.compile could not compile the losses \(InvalidCxxCompiler: No "
                                         r"working C\+\+ compiler found in .*\); it needs a working C\+\+ compiler "
                                         r"\(or Triton on a GPU\): install one \(or point CXX at it\), or run "
                                         r"distill.py, the same losses uncompiled$"), forks.replaced(compiled.replace()):
        distill.layer_losses(cores, qk, "softmax", 8, 1.0)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                    reason="FLA's kernel needs a CUDA device and flash-linear-attention (pip install "
                           "flash-linear-attention); without them the chunked scan runs")
@pytest.mark.parametrize("T, scale", [(3, 1.0), (63, 1.0), (500, 1.0), (1000, 1.0), (500, 1e-7)])
def test_fla_scan_equals_the_chunked_scan_forward_and_backward(T, scale):
    """T = 3 < H (FLA refuses that shape: padded); scale 1e-7: denominators near 1e-13, as PRF features give. The
    bound is TF32's rounding (unit roundoff 2^-11 = 4.9e-4), the size of the errors measured (docs/results.md: output
    4.2-4.6e-4, dq 1.0-1.3e-3), as Triton's fp32 dot products default to TF32. A wrong scale, layout or normaliser
    gives errors near 1."""
    g = torch.Generator(device="cuda").manual_seed(T)
    phi_q, phi_k = (scale * torch.rand(1, 4, T, 64, device="cuda", generator=g) for _ in range(2))
    v = torch.randn(1, 4, T, 64, device="cuda", generator=g)
    ours, theirs = ([x.clone().requires_grad_() for x in (phi_q, phi_k, v)] for _ in range(2))
    y, y_fla = causal_linear_attention(*ours, 64), fla_scan.fla_linear_attention(*theirs)
    dy = torch.randn_like(y)
    (y * dy).sum().backward()
    (y_fla * dy).sum().backward()
    errors = [rel(y_fla, y)] + [rel(a.grad, b.grad) for a, b in zip(theirs, ours)]      # output, dq, dk, dv
    assert max(errors) < 4e-3, errors


def test_fla_scan_wraps_flas_contract_into_the_chunked_scans(monkeypatch):
    """experiments/fla_scan.py on the CPU, FLA's chunk_linear_attn replaced by its contract written out: inputs
    (B, T, H, .), o_i = scale sum_{j<=i} (q_i.k_j) v_j (normalize=False), T < H refused. It equals the chunked scan at
    T < H and with denominators near 1e-13 (FLA's normalize=True adds 1e-10 to them), and so do its gradients."""
    def chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True,
                          cu_seqlens=None):                                          # fla-core 0.5 and 0.6
        assert not normalize and q.size(1) >= q.size(2), "FLA refuses T < H"
        A = (torch.einsum("bihd,bjhd->bhij", q, k) * scale).tril()                    # (B, H, T, T)
        return torch.einsum("bhij,bjhd->bihd", A, v), None
    ops = types.ModuleType("fla.ops.linear_attn")
    ops.chunk_linear_attn = chunk_linear_attn
    monkeypatch.setitem(sys.modules, "fla.ops.linear_attn", ops)
    for T, scale in ((3, 1.0), (37, 1e-7)):
        g = torch.Generator().manual_seed(T)
        phi_q, phi_k = (scale * torch.rand(2, 5, T, 8, generator=g, dtype=torch.float64) for _ in range(2))
        v = torch.randn(2, 5, T, 6, generator=g, dtype=torch.float64)
        y = fla_scan.fla_linear_attention(phi_q, phi_k, v)
        assert y.shape == v.shape and torch.allclose(y, causal_linear_attention(phi_q, phi_k, v, 16), rtol=1e-10)
        ours, theirs = ([t.clone().requires_grad_() for t in (phi_q / scale, phi_k / scale, v)] for _ in range(2))
        dy = torch.randn(v.shape, generator=g, dtype=torch.float64)
        (causal_linear_attention(*ours, 16) * dy).sum().backward()
        (fla_scan.fla_linear_attention(*theirs) * dy).sum().backward()
        assert all(torch.allclose(a.grad, b.grad, rtol=1e-9, atol=1e-12) for a, b in zip(theirs, ours))


def test_fla_scan_is_the_scan_linear_attention_runs_under_its_replace(monkeypatch):
    """Under common.replaced(fla_scan.REPLACE) LinearAttention's scan without a cache (a forward, the direct loss,
    --ppl) is FLA's, here a recording stand-in, also in each group of per_head's cores; decoding from a cache keeps
    the core's scan and step. Outside it, FLA's is not called."""
    calls = []

    def fla(phi_q, phi_k, v, chunk_size=None):
        calls.append(tuple(phi_q.shape))
        return causal_linear_attention(phi_q, phi_k, v, 16)
    monkeypatch.setattr(fla_scan, "fla_linear_attention", fla)
    torch.manual_seed(0)
    core = LinearAttention(4, 2, 8, 6, chunk_size=16)
    q, k, v = qkv(1, 4, 2, 20, 8, seed=0)
    y = core(q, k, v)
    assert calls == []
    with forks.replaced(fla_scan.REPLACE):
        assert torch.equal(core(q, k, v), y) and calls == [(1, 4, 20, 6)]
        cache = {}
        parts = [core(q[:, :, :12], k[:, :, :12], v[:, :, :12], cache)]
        parts += [core(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache) for t in range(12, 20)]
        assert calls == [(1, 4, 20, 6)] and rel(torch.cat(parts, 2), y) < 1e-5      # prefill and steps: the core's
        grouped = per_head.GroupedLinearAttention(4, 2, 8, [3, 5, 3, 5], chunk_size=16)
        grouped(q, k, v)
    assert calls[1:] == [(1, 2, 20, 3), (1, 2, 20, 5)]                  # each group's core, not the grouped wrapper


# ==================================================================================================================
# experiments/: per-head feature dims and features drawn from the kernel's ridge leverage scores, forks of the core

HEAD_DIMS = [5, 3, 5, 8, 3, 1]                                       # 4 groups; heads of a group not adjacent


def per_head_reference(core, q, k, v):
    """GroupedLinearAttention's output computed one head at a time from the PRF formula and the plain T x T form."""
    B, H, T, D = q.shape
    k, v = repeat_kv(k, H), repeat_kv(v, H)
    ys = [None] * H
    for c, hs in zip(core.groups, core.heads):
        for i, h in enumerate(hs):
            z, log_alpha, m = c.feature_map.z[i], c.feature_map.log_alpha[i], core.dims[h]      # (M, D), (M,)
            phi = lambda x: torch.exp(x * D ** -0.25 @ z.T - (x * D ** -0.25).square().sum(-1, keepdim=True) / 2
                                      + (log_alpha - math.log(m)) / 2)          # Phi(x) (B, T, M) as PRF's docstring
            kc = k[:, h] - c.key_mean[i]
            ys[h] = linear_attention_reference(phi(q[:, h])[:, None], phi(kc)[:, None], v[:, h, None])
    return torch.cat(ys, 1)                                                    # (B, H, T, D)


def per_head_core(seed=0, D=16, dtype=torch.float64):
    torch.manual_seed(seed)
    core = per_head.GroupedLinearAttention(6, 2, D, HEAD_DIMS, "prf", chunk_size=16).to(dtype)
    with torch.no_grad():
        for c in core.groups:
            c.key_mean.normal_(0, 0.3)
            c.feature_map.log_alpha.normal_(0, 0.5)
    return core


def test_per_head_dims_group_heads_by_dim_and_cost_the_sum():
    core = per_head_core()
    assert [c.M for c in core.groups] == [1, 3, 5, 8] and core.heads == [[5], [1, 4], [0, 2], [3]]
    assert [tuple(c.feature_map.z.shape) for c in core.groups] == [(1, 1, 16), (2, 3, 16), (2, 5, 16), (1, 8, 16)]
    assert sum(c.feature_map.z.shape[0] * c.M for c in core.groups) == sum(HEAD_DIMS)     # no padding to max M
    assert [[p.shape for p in c.parameters()] for c in core.groups] == [[(n, m, 16), (n, m)] for n, m in (
        (1, 1), (2, 3), (2, 5), (1, 8))]                                 # z and alpha of each group's heads alone


@pytest.mark.parametrize("T", [1, 37, 70])
def test_per_head_dims_match_a_head_by_head_reference_forward_and_backward(T):
    core = per_head_core(seed=T)
    q, k, v = [x.double().requires_grad_() for x in qkv(2, 6, 2, T, 16, seed=T)]
    g = torch.randn(2, 6, T, 16, dtype=torch.float64)
    y = core(q, k, v)
    fast = torch.autograd.grad((y * g).sum(), [q, k, v, *core.parameters()])
    ref = per_head_reference(core, q, k, v)
    slow = torch.autograd.grad((ref * g).sum(), [q, k, v, *core.parameters()])
    assert rel(y, ref) < 1e-10
    for a, b in zip(fast, slow):          # against |dv|: some are exactly zero (alpha of a one-feature head; T = 1)
        assert (a - b).norm() < 1e-12 * fast[2].norm()


def test_per_head_dims_decode_with_one_state_per_group():
    core = per_head_core(seed=3)
    q, k, v = [x.double() for x in qkv(2, 6, 2, 50, 16, seed=3)]
    cache = {}
    parts = [core(q[:, :, :21], k[:, :, :21], v[:, :, :21], cache)]           # prefill, then one token at a time
    parts += [core(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache) for t in range(21, 50)]
    assert rel(torch.cat(parts, 2), core(q, k, v)) < 1e-10
    assert [tuple(cache[g]["S"].shape) for g in range(4)] == [(2, n, m, 16) for n, m in zip([1, 2, 2, 1], [1, 3, 5, 8])]


@pytest.mark.parametrize("query_block", [16, 40])
def test_per_head_loss_is_the_mean_over_heads_of_the_kl_written_out(query_block):
    """The fork's softmax loss equals, in value and gradients, the mean over heads h of KL(p_h || p^_h) computed
    here from the formulas: p_h the causal softmax of q.(k - mu) / sqrt d, p^_h the rows of Phi(q).Phi(k - mu) with
    Phi from each head's z and alpha (PRF's docstring); T = 40: the plain (40) and the blockwise (16) forms."""
    core = per_head_core(seed=5, dtype=torch.float64)
    q, k = 1.5 * torch.randn(2, 6, 40, 16, dtype=torch.float64), 1.5 * torch.randn(2, 2, 40, 16, dtype=torch.float64)
    with forks.replaced(per_head.REPLACE):                                # the losses distill.py trains by
        value = distill.layer_losses([core], [(q, k)], "softmax", query_block, scale=1.0)[0]
    fast = [p.grad.clone() for p in core.parameters()]
    core.zero_grad()
    kc, mask, ref = repeat_kv(k, 6), torch.ones(40, 40, dtype=torch.bool).tril(), 0.0
    for c, hs in zip(core.groups, core.heads):
        for i, h in enumerate(hs):
            z, log_alpha, kh = c.feature_map.z[i], c.feature_map.log_alpha[i], kc[:, h] - c.key_mean[i]
            phi = lambda x: torch.exp(x / 2 @ z.T - x.square().sum(-1, keepdim=True) / 8 + (log_alpha - math.log(c.M)) / 2)
            p = torch.softmax((q[:, h] @ kh.mT / 4).masked_fill(~mask, -math.inf), -1)       # d = 16
            a = (phi(q[:, h]) @ phi(kh).mT) * mask
            ref = ref + (p * (p.clamp_min(1e-300).log() - (a / a.sum(-1, keepdim=True)).clamp_min(1e-300).log())
                         ).sum(-1).mean() / 6
    ref.backward()
    assert abs(value.item() - ref.item()) < 1e-6 * ref.item()
    for a, b in zip(fast, [p.grad for p in core.parameters()]):      # a one-feature head's alpha: exactly 0
        assert (a - b).norm() <= 1e-4 * b.norm() + 1e-12


def test_per_head_dims_are_one_pool_of_every_head():
    assert dof.allocate([1, 3, 0, 4], 8) == [4, 12, 1, 15]                   # worked by hand: 32 = 4+12+1+15


def test_leverage_scores_stable_form_equals_the_plain_form_and_averages_to_the_dof():
    g = torch.Generator().manual_seed(0)
    x = 0.8 * torch.randn(150, 8, generator=g, dtype=torch.float64)
    z = torch.randn(20000, 8, generator=g, dtype=torch.float64)
    for lam, relative in ((0.05, False), (1e-2, True)):
        plain = leverage.leverage_reference(x, z[:200], lam, relative)
        assert rel(leverage.leverage_log(x, z[:200], lam, relative).exp(), plain) < 1e-10
        l = leverage.leverage_log(x, z, lam, relative).exp()     # E_z[l(z)] = tr(Sigma (Sigma + lam)^-1) = N_lam
        N = dof.degrees_of_freedom(x, lam, relative).item()
        assert abs(l.mean().item() - N) < 4 * l.std().item() / math.sqrt(len(l)), (l.mean().item(), N)
    big = 6.0 * torch.randn(100, 8, generator=g, dtype=torch.float64)   # logits past exp's range
    assert torch.isfinite(leverage.leverage_log(big, z[:100], 1e-3, True)).all()


def test_leverage_features_give_an_unbiased_kernel_estimate():
    """The mean over draws of sum_m alpha_m phi_zm(q) phi_zm(k) / M is exp(q.k / sqrt d); without the importance
    weights (alpha = 1) the same draws are biased."""
    g = torch.Generator().manual_seed(1)
    x = 1.2 * torch.randn(96, 4, generator=g, dtype=torch.float64)
    q, k = x[:5], x[5:10]
    K = ((q * k).sum(-1) / 2).exp()                                                    # sqrt(d) = 2
    weighted, plain = [], []
    for _ in range(3000):
        z, log_alpha = leverage.leverage_features(x, 8, 1e-2, True, pool=16, generator=g)
        pk = (leverage.prf_log(q, z.double()) + leverage.prf_log(k, z.double())).exp()   # (5, M)
        weighted.append((pk * log_alpha.double().exp()).mean(-1))
        plain.append(pk.mean(-1))
    for est, unbiased in ((torch.stack(weighted), True), (torch.stack(plain), False)):
        z_score = (est.mean(0) - K).abs() / (est.std(0) / math.sqrt(len(est)))
        assert (z_score.max() < 4.5) if unbiased else (z_score.max() > 10), z_score


def test_leverage_features_are_distinct_where_the_leverage_sits_on_few_candidates():
    """x ~ 2 N(0, I) in d = 16: M = 18 directions are 18 distinct candidates (resampling with replacement took one
    candidate 18 times here: copies train as one feature); each candidate taken with probability min(1, c pi_p)."""
    g = torch.Generator().manual_seed(0)
    x = 2 * torch.randn(256, 16, generator=g, dtype=torch.float64)
    z, _ = leverage.leverage_features(x, 18, 1e-3, True, 16, torch.Generator().manual_seed(1))
    assert len(torch.unique(z, dim=0)) == 18
    pi = torch.softmax(4 * torch.randn(288, generator=g, dtype=torch.float64), 0)
    w = leverage.inclusion(pi, 18)
    sure = w == 1
    assert 0 < sure.sum() < 18 and w.sum().item() == pytest.approx(18) and (w[~sure] < 1).all()
    assert torch.allclose(w[~sure] / pi[~sure], (w[~sure] / pi[~sure])[0]) and pi[sure].min() >= pi[~sure].max()


def test_leverage_features_weights_come_from_the_ridge_leverage_itself():
    """Each taken candidate's log alpha is log M - log(P w_p), w = inclusion(pi, M) of pi the ridge leverage of the
    pool (the plain form) normalised: the density is the leverage, not a power of it."""
    x = 0.8 * torch.randn(40, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    pool = torch.randn(48, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)   # P = 8 x M, M = 6
    lev = leverage.leverage_reference(x, pool, 1e-2, relative=True)
    w = leverage.inclusion(lev / lev.sum(), 6)
    z, log_alpha = leverage.leverage_features(x, 6, 1e-2, True, 8, torch.Generator().manual_seed(0))
    take = [int((pool.float() == zm).all(1).nonzero()) for zm in z]                  # the same draws of the pool
    assert log_alpha.double() == pytest.approx(math.log(6) - (48 * w[take]).log(), abs=1e-5)


def test_leverage_features_beat_gaussian_draws_on_a_known_kernel_at_m_equal_dof():
    """The theory's claim at M = N_lam on a Gaussian kernel known exactly: leverage-sampled features estimate
    K = exp(x x^T / sqrt d) with a smaller relative Frobenius error than plain Gaussian draws (20 draws each; the
    error is heavy-tailed, so its mean and its median)."""
    g = torch.Generator().manual_seed(0)
    x = 0.7 * torch.randn(128, 8, generator=g, dtype=torch.float64)
    K = (x @ x.T / 8 ** 0.5).exp()
    m = round(dof.degrees_of_freedom(x[None], 1e-3, relative=True).item())
    err = {"gaussian": [], "leverage": []}
    for _ in range(20):
        z, log_alpha = torch.randn(m, 8, generator=g, dtype=torch.float64), torch.zeros(m, dtype=torch.float64)
        for kind in err:
            if kind == "leverage":
                z, log_alpha = (t.double() for t in leverage.leverage_features(x, m, 1e-3, True, 16, g))
            phi = (leverage.prf_log(x, z) + 0.5 * log_alpha).exp()
            err[kind].append(((phi @ phi.T / m - K).norm() / K.norm()).item())
    mean, median = {k: np.mean(e) for k, e in err.items()}, {k: np.median(e) for k, e in err.items()}
    assert mean["leverage"] < 0.8 * mean["gaussian"] and median["leverage"] < median["gaussian"], (mean, median)


def test_core_and_forks_start_every_process_from_rank_0s_dims_and_features(setup, monkeypatch):
    """Under torchrun distill.py, per_head.py and leverage.py take rank 0's dims and features (each process's own DoF
    pass and draws may differ across devices): here a process other than rank 0 (common.is_main false), handed rank
    0's dims by common.broadcast, and every feature tensor of its student handed to it to be filled with rank 0's."""
    d, ckpt, data = setup
    teacher = model.GPT.from_pretrained(ckpt)
    calib = datafiles.calibration_batches(np.memmap(data / "train.bin", dtype=np.uint16, mode="r"), Calib(2, 2, 64, 0), "cpu")
    L, H = teacher.config.n_layer, teacher.config.n_head
    heads = ([[3] + [5] * (H - 1)] * L, [[1.0] * H] * L)                            # per-head dims and DoF
    layers = ([3] + [5] * (L - 1), [1.0] * L)
    monkeypatch.setattr(devices, "is_main", lambda: False)
    for replace, alloc, rank0 in ((per_head.REPLACE, "dof", heads), (leverage.REPLACE, "fix", ([4] * L, None)),
                                  ({}, "dof", layers)):                      # the core's; leverage's calls it too
        filled = []

        def other_rank(obj, tensors=()):
            filled.extend(t.data_ptr() for t in tensors)
            return rank0 if obj is None else obj
        monkeypatch.setattr(devices, "broadcast", other_rank)
        with forks.replaced(replace):
            cfg = distill_config(["--model", ckpt, "--data", data, "--budget", "4", "--alloc", alloc, "--J", "64"])
            student, dims, N = distill.make_student(cfg, teacher, calib)
        assert {t.data_ptr() for t in checkpoint.feature_state(student).values()} <= set(filled)
        assert (dims, N) == rank0


def test_per_head_fork_trains_resumes_and_scores_and_the_core_refuses_its_checkpoint(setup, tmp_path):
    """experiments/per_head.py: distill.py's command line with dims per head (total budget x heads x layers),
    recorded in config.json with the fork, read back under its names, resumed, scored by `per_head.py evaluate`;
    evaluate.py and distill.py --init-from / --resume refuse its checkpoint (common.check_fork); the fork refuses a
    checkpoint of one dimension per layer and damaged per-head dims, and its resume makes the core's checks."""
    d, ckpt, data = setup
    out = tmp_path / "heads"
    r = cli("experiments/per_head.py", "--model", ckpt, "--data", data, "--budget", 6, "--max-steps", 4,
            "--decay-steps", 6, "--out-dir", out, *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = json.loads((out / "config.json").read_text())
    dims = np.array(cfg["dims"])
    assert dims.shape == (4, 4) and dims.sum() == 6 * 4 * 4 and dims.min() >= 1 and len(set(dims.ravel())) > 1
    assert np.array(cfg["dof"]).shape == (4, 4) and cfg["fork"] == "experiments/per_head.py"
    with forked("per_head", per_head.REPLACE):
        student, _ = tasks.load_student(out)
    assert [c.dims for c in student.cores()] == cfg["dims"]
    assert sum(g.feature_map.z.shape[0] * g.M for c in student.cores() for g in c.groups) == 6 * 4 * 4
    with pytest.raises(door.ModelError, match="^" + re.escape(refusal(out, "per_head", ckpt)) + "$"):
        tasks.load_student(out)
    with pytest.raises(door.ModelError, match="^" + re.escape(refusal(out, "per_head", ckpt)) + "$"):
        evaluate.main([str(a) for a in ["--model", ckpt, "--ckpt", out, "--ppl", data / "val.bin", "--device", "cpu"]])
    with pytest.raises(door.ModelError, match="^" + re.escape(refusal(out, "per_head", ckpt)) + "$"):
        distill.main(distill_args(ckpt, data, tmp_path / "plain", "--init-from", out))
    with pytest.raises(door.ModelError, match="^" + re.escape(refusal(out, "per_head", ckpt)) + "$"):
        distill.main(distill_args(ckpt, data, out, "--budget", 6, "--max-steps", 6, "--decay-steps", 6, "--resume"))
    r = cli("experiments/per_head.py", "--model", ckpt, "--data", data, "--budget", 6, "--max-steps", 6,
            "--decay-steps", 6, "--out-dir", out, "--resume", *FAST)
    assert r.returncode == 0 and "resuming" in r.stdout, r.stderr[-3000:]
    args = ["--model", ckpt, "--ckpt", out, "--ppl", data / "val.bin", "--ppl-max-tokens", 300, "--device", "cpu",
            "--output", tmp_path / "ppl.json"]                        # `per_head.py evaluate`: evaluate.py's flags
    r = cli("experiments/per_head.py", "evaluate", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    ppl = json.loads((tmp_path / "ppl.json").read_text())["ppl"]
    tokens = np.fromfile(data / "val.bin", dtype=np.uint16)[:300].astype(np.int64)
    with forked("per_head", per_head.REPLACE):
        assert ppl["student"] == pytest.approx(evaluate.perplexity(tasks.load_student(out)[0], tokens), rel=1e-6)
    assert ppl["student"]["loss"] != ppl["teacher"]["loss"]
    distill.main(distill_args(ckpt, data, tmp_path / "plain", "--budget", "6", "--max-steps", "0"))
    plain = str(tmp_path / "plain")
    r = cli("experiments/per_head.py", "--model", ckpt, "--data", data, "--out-dir", tmp_path / "ph", "--init-from",
            plain, *FAST)
    assert r.returncode == 2 and r.stderr.endswith(f"error: {plain} has one dimension per layer: train, resume or "
                                                   "evaluate it with distill.py and evaluate.py\n"), r.stderr[-3000:]
    r = cli("experiments/per_head.py", "evaluate", "--model", ckpt, "--ckpt", plain, "--ppl", data / "val.bin",
            "--device", "cpu")
    assert r.returncode == 2 and r.stderr == (f"error: {plain} has one dimension per layer: train, resume or "
                                              "evaluate it with distill.py and evaluate.py\n"), r.stderr[-3000:]
    shutil.copytree(out, short := tmp_path / "short-heads")           # 3 dims a layer for 4 heads: damaged
    edit_json(short / "config.json", dims=[[1, 2, 3]] * 4)
    with pytest.raises(door.ModelError, match=r"^per-head dims need 4 whole numbers of at least 1 a layer for 4 layers, "
                                         r"got 4 of \[1, 2, 3\]; pass the --out-dir of a per_head.py run$"), \
            forked("per_head", per_head.REPLACE):
        tasks.load_student(short)
    shutil.copytree(ckpt, tmp_path / "other")                         # the fork's resume makes the core's checks
    nudge(tmp_path / "other" / "model.safetensors")                    # another model, by one value
    r = cli("experiments/per_head.py", "--model", tmp_path / "other", "--data", data, "--budget", 6, "--max-steps", 6,
            "--decay-steps", 6, "--out-dir", out, "--resume", *FAST)
    assert r.returncode == 2 and "is another model" in r.stderr and "pass --model" in r.stderr, r.stderr[-3000:]


def test_leverage_fork_starts_from_leverage_features_and_checks_its_flags(setup, tmp_path):
    """experiments/leverage.py: a run that starts from leverage features (importance weights, not alpha = 1); its
    flags are checked at the door, each naming its flag."""
    d, ckpt, data = setup
    r = cli("experiments/leverage.py", "--model", ckpt, "--data", data, "--budget", 6, "--max-steps", 0,
            "--center-keys", "--out-dir", tmp_path / "lev", *FAST)            # untrained: the initial features
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "lev" / "config.json").read_text())["fork"] == "experiments/leverage.py"
    alpha = torch.cat([t.flatten() for k, t in features(tmp_path / "lev").items() if k.endswith("log_alpha")])
    assert alpha.std() > 0.1                                          # importance weights, not the plain alpha = 1
    r = cli("experiments/leverage.py", "--model", ckpt, "--data", data, "--feature-map", "performer",
            "--out-dir", tmp_path / "x")
    assert r.returncode == 2 and r.stderr.endswith("drawn afresh: pass --feature-map prf, not performer\n")
    for flags, sentence in ((["--pool", 0], "--pool must be a number of at least 1, got 0"),   # each names its flag
                            (["--init-from", tmp_path / "lev"], "drop --init-from, whose checkpoint sets the")):
        with pytest.raises(door.ModelError, match=sentence), forks.replaced(leverage.REPLACE):
            distill_config(["--model", ckpt, *flags])
    assert not (tmp_path / "x").exists()


def test_direct_finetune_fork_trains_the_direct_loss_in_the_last_steps(setup, tmp_path, capsys):
    """experiments/direct_finetune.py --direct-steps 2 of --max-steps 5: steps 1-3 train the layerwise loss (one loss
    per layer logged), steps 4-5 the whole student's next-token loss (one loss), also in a run stopped at step 3 of
    its 5-step schedule and resumed (it had trained steps 2-3 direct as well); --resume keeps --direct-steps;
    distill.py does not resume such a run (forks.check_fork), nor the fork a plain run (it had named the --direct-steps
    0 that the run never had)."""
    d, ckpt, data = setup
    run = distill_args(ckpt, data, tmp_path / "run", "--budget", "4", "--alloc", "fix", "--max-steps", "5",
                       "--log-interval", "1", "--warmup-steps", "0")
    fork = lambda: forked("direct_finetune", direct_finetune.REPLACE)   # noqa: E731
    with fork():
        distill.main(run + ["--direct-steps", "2"])
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [len(h["loss"]) for h in m["history"]] == [4, 4, 4, 1, 1]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["fork"] == "experiments/direct_finetune.py"
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("step ")]   # labelled as trained
    assert ["(next-token)" in l for l in lines] == [False, False, False, True, True], lines
    stop = [tmp_path / "stop" if a == str(tmp_path / "run") else a for a in run] + ["--direct-steps", "2"]
    with fork():
        distill.main(stop + ["--max-steps", "3", "--decay-steps", "5"])             # stopped at step 3 of 5
        distill.main(stop + ["--decay-steps", "5", "--resume"])
    assert [h["loss"] for h in json.loads((tmp_path / "stop" / "metrics.json").read_text())["history"]] == [
        h["loss"] for h in m["history"]]
    assert features(tmp_path / "stop").keys() == features(tmp_path / "run").keys() and all(
        torch.equal(v, features(tmp_path / "run")[k]) for k, v in features(tmp_path / "stop").items())
    with pytest.raises(door.ModelError, match=r"--direct-steps 9 is more than the schedule's 5 steps \(--decay-steps, or"), \
            fork():
        distill.main(distill_args(ckpt, data, tmp_path / "x", "--max-steps", "5", "--direct-steps", "9"))
    with pytest.raises(door.ModelError, match="was started with --direct-steps 2, not 1; resume it with the flags"), fork():
        distill.main(run + ["--direct-steps", "1", "--resume"])
    sentence = refusal(tmp_path / "run", "direct_finetune", ckpt)
    with pytest.raises(door.ModelError, match="^" + re.escape(sentence) + "$"):
        distill.main(run + ["--resume"])                                    # the core would drop its direct tail
    plain = distill_args(ckpt, data, tmp_path / "plain", "--budget", "4", "--alloc", "fix", "--max-steps", "2")
    distill.main(plain)
    with pytest.raises(door.ModelError, match=f"^{re.escape(str(tmp_path / 'plain'))} was written by distill.py, not "
                                         "experiments/direct_finetune.py; resume it with distill.py, or pass "), fork():
        distill.main(plain + ["--max-steps", "4", "--direct-steps", "1", "--resume"])   # a tail it never had


def test_fla_scan_needs_a_student_on_cuda(ckpt, tmp_path, monkeypatch):
    """experiments/fla_scan.py refuses, before any work (its EvalConfig's checks), a run whose student scan FLA's
    CUDA kernel cannot take; so does its command line, with one sentence; and its distill.py on the CPU (it had
    stopped with a traceback at its first validation)."""
    with pytest.raises(door.ModelError, match=r"^experiments/fla_scan.py runs the student's scan on CUDA: it needs a "
                                              r"CUDA --device and flash-linear-attention"), \
            forks.replaced(fla_scan.REPLACE):
        distill.main(["--model", str(ckpt), "--device", "cpu", "--out-dir", str(tmp_path / "run")])
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(tasks, "load_models", lambda *a, **k: pytest.fail("a model was loaded"))
    for flags in (["--ckpt", "some-run", "--device", "cpu"], ["--device", "auto"]):     # the CPU; no student
        with pytest.raises(door.ModelError, match=r"^experiments/fla_scan.py runs a student's scan on CUDA: it needs"), \
                forks.replaced(fla_scan.REPLACE):
            evaluate.main(["--model", str(ckpt), "--tasks", "piqa", *flags])
    r = cli("experiments/fla_scan.py", "evaluate", "--model", ckpt, "--ckpt", "some-run", "--device", "cpu")
    assert r.returncode == 2 and r.stderr == ("error: experiments/fla_scan.py runs a student's scan on CUDA: it needs "
                                              "--ckpt, a CUDA --device and flash-linear-attention (pip install "
                                              "flash-linear-attention)\n"), r.stderr


def test_per_head_dims_pool_every_head_of_every_layer_and_clip_caps_at_the_head_size(monkeypatch):
    """per_head.per_head_dims on a known per-head DoF (L = 2, H = 4): M_lh = C N_lh / mean(N) over all 8 heads (one
    pool: layer 1's flat DoF gets less than C a head), and --alloc clip caps each at the teacher's head size (16)."""
    N = torch.tensor([[1.0, 3.0, 0.0, 4.0], [0.5, 0.5, 0.5, 0.5]], dtype=torch.float64)      # (L, H)
    monkeypatch.setattr(dof, "collect_qk", lambda *a, **k: None)
    monkeypatch.setattr(dof, "degrees_of_freedom", lambda *a, **k: N)
    teacher = types.SimpleNamespace(config=types.SimpleNamespace(head_dim=16))
    got = {}
    for alloc in ("dof", "clip"):
        cfg = types.SimpleNamespace(J=8, seed=0, lam=1e-3, lam_relative=True, alloc=alloc, budget=8)
        got[alloc], dofs = per_head.per_head_dims(cfg, teacher, None, None)
        assert dofs == N.tolist()
    assert got["dof"] == [[7, 19, 1, 25], [3, 3, 3, 3]]            # 6.4 N, the 0 pinned at 1, 64 in all
    assert got["clip"] == [[7, 16, 1, 16], [3, 3, 3, 3]]


def test_fork_students_centre_each_head_by_its_own_key_mean_and_draw_leverage_features_from_its_points(setup,
                                                                                                    monkeypatch):
    """per_head.make_student --center-keys: each group's key_mean holds the key means of its own heads (not the
    first len(heads) of the layer); leverage.make_student: head h of layer l draws its features by leverage_features
    from that head's J calibration points, keys centred as the student centres them, from --seed's generator, layer
    by layer and head by head."""
    d, ckpt, data = setup
    teacher = model.GPT.from_pretrained(ckpt)
    calib = datafiles.calibration_batches(np.memmap(data / "train.bin", dtype=np.uint16, mode="r"), Calib(2, 2, 64, 0), "cpu")
    mu = dof.key_means(teacher, calib)                                                    # (L, H, D)
    monkeypatch.setattr(per_head, "per_head_dims", lambda *a: ([[5, 3, 5, 3]] * 4, [[1.0] * 4] * 4))   # heads 1, 3
    with forks.replaced(per_head.REPLACE):
        cfg = distill_config(["--model", ckpt, "--data", data, "--budget", "4", "--center-keys", "--J", "64"])
        student, _, _ = distill.make_student(cfg, teacher, calib)
    assert [core.heads for core in student.cores()] == [[[1, 3], [0, 2]]] * 4
    for core, m in zip(student.cores(), mu):
        for c, hs in zip(core.groups, core.heads):
            assert torch.equal(c.key_mean, m[hs])
    with forks.replaced(leverage.REPLACE):
        cfg = distill_config(["--model", ckpt, "--data", data, "--budget", "4", "--alloc", "fix", "--center-keys",
                                  "--J", "64", "--seed", "3", "--pool", "4"])
        student, _, _ = distill.make_student(cfg, teacher, calib)
    x, gen = dof.collect_qk(teacher, calib, 64, 3, mu), torch.Generator().manual_seed(3)          # (L, H, J, D)
    for core, xl in zip(student.cores(), x):
        for h in range(core.n_head):
            z, log_alpha = leverage.leverage_features(xl[h].double(), 4, cfg.lam, cfg.lam_relative, 4, gen)
            assert torch.equal(core.feature_map.z[h], z) and torch.equal(core.feature_map.log_alpha[h], log_alpha)


def test_per_head_refuses_dims_and_direct_finetune_takes_a_schedule_all_direct(setup, tmp_path):
    """per_head.py --dims (one dimension per layer) is refused, not silently replaced by the per-head DoF dims;
    direct_finetune.py --direct-steps equal to the schedule's steps is allowed: every step trains the direct loss;
    steps past a --decay-steps schedule's end train it too, as its help says."""
    d, ckpt, data = setup
    with pytest.raises(door.ModelError, match="^--dims sets one dimension per layer; per-head dims come from the DoF"), \
            forked("per_head", per_head.REPLACE):
        distill.main(distill_args(ckpt, data, tmp_path / "x", "--dims", "4,4,4,4", "--max-steps", "0"))
    assert not (tmp_path / "x").exists()
    with forks.replaced(direct_finetune.REPLACE):
        cfg = distill_config(distill_args(ckpt, data, tmp_path / "y", "--max-steps", "5", "--direct-steps", "5"))
        assert [distill.step_loss(cfg, s) for s in range(5)] == ["direct"] * 5
        cfg = distill_config(distill_args(ckpt, data, tmp_path / "y", "--max-steps", "6", "--decay-steps", "4",
                                              "--direct-steps", "1"))
    assert [direct_finetune.step_loss(cfg, s) for s in range(6)] == ["softmax"] * 3 + ["direct"] * 3   # and past it
    assert [distill.step_loss(cfg, s) for s in range(6)] == ["softmax"] * 6                # the core's: --loss


# ==================================================================================================================
# experiments/hedgehog.py: the README's worked example of a new feature map

@pytest.mark.parametrize("m", [5, 8])
def test_hedgehog_features_are_non_negative_of_m_a_head(m):
    """Hedgehog's Phi(x) = [softmax(x W), softmax(-x W)] / sqrt 2, its first M of 2 ceil(M / 2): (B, H, T, M),
    non-negative, the exp of log_features; for even M its rows sum to sqrt 2 (two softmaxes). Under its REPLACE a
    LinearAttention takes --feature-map hedgehog."""
    torch.manual_seed(m)
    f = hedgehog.Hedgehog(3, 8, m)
    x = 3 * torch.randn(2, 3, 7, 8)
    phi = f(x, is_query=True)
    assert phi.shape == (2, 3, 7, m) and (phi >= 0).all() and torch.equal(phi, f(x, is_query=False))
    assert torch.allclose(phi, f.log_features(x).exp())
    xw = x @ f.proj
    want = torch.cat((torch.softmax(xw, -1), torch.softmax(-xw, -1)), -1)[..., :m] / math.sqrt(2)
    assert torch.allclose(phi, want, rtol=1e-5, atol=1e-7)
    if m % 2 == 0:
        assert torch.allclose(phi.sum(-1), torch.full((2, 3, 7), math.sqrt(2)))
    with pytest.raises(KeyError):
        LinearAttention(3, 3, 8, m, "hedgehog")
    with forks.replaced(hedgehog.REPLACE):
        core = LinearAttention(3, 3, 8, m, "hedgehog")
    assert isinstance(core.feature_map, hedgehog.Hedgehog)
    assert core.features(x, x)[0].shape == (2, 3, 7, m)


def test_hedgehog_projection_trains_at_lr_z(ckpt):
    """make_optimizer's groups: Hedgehog's `proj` (no name ending in alpha) gets --lr-z, and there is no --lr-alpha
    group."""
    teacher = model.GPT.from_pretrained(ckpt).requires_grad_(False)                  # as distill.py's
    with forks.replaced(hedgehog.REPLACE):
        student = teacher.linearize([4] * teacher.config.n_layer, "hedgehog")
        cfg = distill.DistillConfig(model=str(ckpt), feature_map="hedgehog", lr_z=0.03, lr_alpha=0.5)
    optim = distill.make_optimizer(student, cfg)
    projs = [p for n, p in student.named_parameters() if n.endswith("proj")]
    assert len(projs) == teacher.config.n_layer and [g["peak"] for g in optim.param_groups] == [0.03]
    assert {id(p) for p in optim.param_groups[0]["params"]} == {id(p) for p in projs}


def test_hedgehog_fork_trains_and_scores_a_student_that_the_core_refuses(setup, tmp_path):
    """`python experiments/hedgehog.py --feature-map hedgehog` trains a student (config.json records the fork);
    evaluate.py refuses it with common.check_fork's sentence; `hedgehog.py evaluate` scores it; distill.py alone
    does not know the map: one sentence listing the known maps, before any work."""
    d, ckpt, data = setup
    out = tmp_path / "hh"
    r = cli("experiments/hedgehog.py", *distill_args(ckpt, data, out, "--feature-map", "hedgehog", "--budget", 4,
                                                     "--alloc", "fix", "--max-steps", 2))
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["fork"] == "experiments/hedgehog.py" and cfg["feature_map"] == "hedgehog"
    assert sorted(k.split(".")[-1] for k in features(out)) == ["key_mean"] * 4 + ["proj"] * 4 and all(
        t.shape == (4, 16, 2) for k, t in features(out).items() if k.endswith("proj"))
    ppl = ["--ppl", data / "val.bin", "--ppl-max-tokens", 300, "--device", "cpu"]
    r = cli("evaluate.py", "--model", ckpt, "--ckpt", out, *ppl)
    assert r.returncode == 2 and r.stderr == f"error: {refusal(out, 'hedgehog', ckpt)}\n", r.stderr[-3000:]
    r = cli("experiments/hedgehog.py", "evaluate", "--model", ckpt, "--ckpt", out, *ppl, "--output",
            tmp_path / "ppl.json")
    assert r.returncode == 0, r.stderr[-3000:]
    scores = json.loads((tmp_path / "ppl.json").read_text())["ppl"]
    assert math.isfinite(scores["student"]["loss"]) and scores["student"]["loss"] != scores["teacher"]["loss"]
    assert scores["student"]["tokens"] == scores["teacher"]["tokens"] > 0
    r = cli("distill.py", *distill_args(ckpt, data, tmp_path / "core", "--feature-map", "hedgehog"))
    assert r.returncode == 2 and r.stderr == ("error: --feature-map must be one of prf, performer, dijiang, got "
                                              "'hedgehog'\n"), r.stderr[-3000:]
    assert not (tmp_path / "core").exists()
