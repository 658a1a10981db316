"""The method's tests: the feature maps, scan and step against their plain reference, N_lambda against theory,
the allocation, the blockwise losses against their plain form, and GPT-2 / GPT-NeoX / Llama against transformers.
The rest (loading, the command lines, evaluation, the forks, the instruments, docs/) is in tests/.

Run: python -m pytest -q    (every test, this file's and tests/; pytest.ini names them)"""

import copy
import json
import math
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from numpy.polynomial.hermite_e import hermegauss

import checkpoint
import distill
import dof
import door
import model
from model import (
    GPT,
    PRF,
    DiJiang,
    LinearAttention,
    Performer,
    causal_linear_attention,
    linear_attention_reference,
    linear_attention_step,
    repeat_kv,
)


# One thread, as in tests/: these tensors are tiny, so threads buy nothing, and on a loaded machine OpenMP's spinning
# threads slow every op down several times over.
@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ==================================================================================================================
# model.py: GPT-2 / GPT-NeoX / Llama against transformers

def randomize(hf):
    """Default init hides layout errors (LayerNorm weights 1, biases 0, pre-activations so small that tanh and erf
    GELU agree): randomise norms and biases too, and scale matrices to unit-variance outputs."""
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1)
            elif p.dim() == 1:
                p.uniform_(0.5, 1.5)
            elif "emb" not in n and "wte" not in n and "wpe" not in n:
                p.normal_(0, min(p.shape) ** -0.5)
    return hf.eval()


def save_hf(hf, path):
    randomize(hf).save_pretrained(path)
    return hf


def hf_gpt2(**kw):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**kw))


def hf_neox(**kw):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    torch.manual_seed(0)
    return GPTNeoXForCausalLM(GPTNeoXConfig(**kw))


def hf_llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**kw))


def assert_parity(hf, path, T=64, new_tokens=20):
    """fp32 logits within 1e-4 of transformers', and greedy generation identical."""
    torch.manual_seed(1)
    m = model.GPT.from_pretrained(path)
    idx = torch.randint(0, hf.config.vocab_size, (2, T))
    with torch.no_grad():
        ref, ours = hf(idx).logits, m(idx)
    assert ref.abs().max() > 1e-2                       # a non-trivial comparison
    assert (ref - ours).abs().max().item() < 1e-4
    prompt = idx[:1, :8]
    ref_gen = hf.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    assert torch.equal(ref_gen, m.generate(prompt, new_tokens))
    return m


SMALL = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=1000, n_positions=128)


SMALL_NEOX = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=256, vocab_size=1000,
                  max_position_embeddings=128, rotary_pct=0.25)


def test_gpt2_124m_shape_matches_transformers(tmp_path):
    hf = save_hf(hf_gpt2(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024), tmp_path)
    assert_parity(hf, tmp_path)


def test_pythia_160m_shape_matches_transformers(tmp_path):
    hf = save_hf(hf_neox(num_hidden_layers=12, num_attention_heads=12, hidden_size=768, intermediate_size=3072,
                         vocab_size=50304, max_position_embeddings=2048, rotary_pct=0.25,
                         use_parallel_residual=True, tie_word_embeddings=False), tmp_path)
    m = assert_parity(hf, tmp_path)
    assert m.config.rotary_dim == 16 and m.config.parallel_residual and not m.config.tie_embeddings


def test_neox_sequential_residual_matches_transformers(tmp_path):
    hf = save_hf(hf_neox(**{**SMALL_NEOX, "use_parallel_residual": False, "rotary_pct": 0.5}), tmp_path)
    assert not assert_parity(hf, tmp_path).config.parallel_residual


@pytest.mark.parametrize("tied", [True, False])
def test_llama_gqa_matches_transformers(tmp_path, tied):
    hf = save_hf(hf_llama(num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, hidden_size=96,
                          intermediate_size=160, vocab_size=1000, max_position_embeddings=256, rope_theta=1e5,
                          tie_word_embeddings=tied), tmp_path)
    m = assert_parity(hf, tmp_path)
    assert m.config.n_kv_head == 2 and (m.lm_head.weight is m.wte.weight) == tied


def test_llama_head_dim_other_than_hidden_over_heads_matches_transformers(tmp_path):
    """config.json's head_dim (Llama 3.2, Gemma) wins over hidden_size / heads, and rotary spans all of it."""
    hf = save_hf(hf_llama(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                          head_dim=32, intermediate_size=96, vocab_size=1000, max_position_embeddings=128), tmp_path)
    m = assert_parity(hf, tmp_path)
    assert (m.config.head_dim, m.config.rotary_dim) == (32, 32)


def test_hub_layout_without_transformer_prefix(tmp_path):
    """The hub's gpt2 model.safetensors has no "transformer." prefix and no lm_head.weight, and its config.json no
    tie_word_embeddings (GPT-2 ties its head whatever transformers' default)."""
    from safetensors.torch import load_file, save_file
    hf = save_hf(hf_gpt2(**SMALL), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("tie_word_embeddings", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    sd = load_file(tmp_path / "model.safetensors")
    save_file({k.removeprefix("transformer."): v.contiguous() for k, v in sd.items() if k != "lm_head.weight"},
              tmp_path / "model.safetensors")
    assert_parity(hf, tmp_path, new_tokens=5)


def test_sharded_checkpoint(tmp_path):
    hf = randomize(hf_neox(**SMALL_NEOX))
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert_parity(hf, tmp_path, new_tokens=5)


def test_kv_cache_prefill_in_pieces_equals_full_forward(tmp_path):
    save_hf(hf_llama(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                     intermediate_size=128, vocab_size=500, max_position_embeddings=128), tmp_path)
    m = model.GPT.from_pretrained(tmp_path)
    idx = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(0))
    cache = model.Cache(m.config.n_layer)
    with torch.no_grad():
        full = m(idx)
        parts = torch.cat([m(idx[:, a:b], cache=cache) for a, b in [(0, 17), (17, 18), (18, 40)]], dim=1)
    assert (full - parts).abs().max() < 1e-4


# ==================================================================================================================
# model.py: linear attention against its plain reference

MAPS = ["prf", "performer", "dijiang"]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def grad_close(a, b, T, gv):
    """Gradients agree to 1e-5 relative error. At T = 1 the output is v_0 whatever the features, so every gradient
    but v's (gv) is exactly zero: what is left must be rounding noise, under 1e-5 of |gv|."""
    return rel(a, b) < 1e-5 if T > 1 else (a.norm() / gv.norm()).item() < 1e-5


def qkv(B, H, Hkv, T, D, scale=1.0, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, h, T, D, generator=g) * scale).to(dtype) for h in (H, Hkv, Hkv)]


@pytest.mark.parametrize("T", [1, 63, 64, 500, 1000])
def test_scan_and_step_equal_reference(T):
    torch.manual_seed(T)
    B, H, D, M = 1, 3, 32, 48
    fm = PRF(H, D, M)
    q, k, v = qkv(B, H, H, T, D, seed=T)
    with torch.no_grad():
        phi_q, phi_k = fm(q, True), fm(k, False)
    leaves = [x.clone().requires_grad_() for x in (phi_q, phi_k, v)]
    refs = [x.double().detach().requires_grad_() for x in (phi_q, phi_k, v)]
    g = torch.randn(B, H, T, D)
    y = causal_linear_attention(*leaves, chunk_size=64)
    y_ref = linear_attention_reference(*refs)
    (y * g).sum().backward()
    (y_ref * g.double()).sum().backward()
    assert y.dtype == torch.float32 and rel(y, y_ref) < 1e-5
    assert rel(leaves[2].grad, refs[2].grad) < 1e-5
    if T > 1:  # at T = 1 the true feature gradients are 0 and phi_k / (phi_q.phi_k) amplifies rounding noise
        assert rel(leaves[0].grad, refs[0].grad) < 1e-5 and rel(leaves[1].grad, refs[1].grad) < 1e-5
    # the recurrent step, token by token, from a zero state
    S, s = torch.zeros(B, H, M, D), torch.zeros(B, H, M)
    ys = []
    for t in range(T):
        y_t, S, s = linear_attention_step(phi_q[:, :, t], phi_k[:, :, t], v[:, :, t], S, s)
        ys.append(y_t)
    assert rel(torch.stack(ys, 2), y_ref) < 1e-5


def test_scan_and_step_read_zero_from_a_state_of_zero_features():
    """Keys whose features are all 0 (as PRF features underflow to) leave the normaliser phi_q.s at 0: the scan and
    the recurrent step both give y = 0 there, not 0/0, and agree on every token."""
    torch.manual_seed(24)
    B, H, T, D, M = 1, 2, 6, 4, 3
    phi_q, phi_k, v = torch.rand(B, H, T, M), torch.rand(B, H, T, M), torch.randn(B, H, T, D)
    phi_k[:, :, :3] = 0.0                                                   # the first 3 keys add nothing
    y = causal_linear_attention(phi_q, phi_k, v, chunk_size=4)
    S, s, ys = torch.zeros(B, H, M, D), torch.zeros(B, H, M), []
    for t in range(T):
        y_t, S, s = linear_attention_step(phi_q[:, :, t], phi_k[:, :, t], v[:, :, t], S, s)
        ys.append(y_t)
    assert (y[:, :, :3] == 0).all() and torch.allclose(torch.stack(ys, 2), y, atol=1e-6)


@pytest.mark.parametrize("fmap", MAPS)
@pytest.mark.parametrize("T", [1, 63, 64, 500, 1000])
def test_full_path_gradients(fmap, T):
    """Feature map + scan in fp32 against the same module in fp64 with the reference form: outputs and gradients
    of q, k, v and of the feature parameters (z, alpha)."""
    torch.manual_seed(1)
    B, H, Hkv, D, M = 1, 4, 2, 64, 64
    m32 = LinearAttention(H, Hkv, D, M, fmap, chunk_size=64)
    m64 = copy.deepcopy(m32).double()
    q, k, v = qkv(B, H, Hkv, T, D, seed=T)
    x32 = [x.clone().requires_grad_() for x in (q, k, v)]
    x64 = [x.double().requires_grad_() for x in (q, k, v)]
    g = torch.randn(B, H, T, D)
    y32 = m32(*x32)
    phi_q, phi_k = m64.features(*m64.inputs(x64[0], x64[1]))
    y64 = linear_attention_reference(phi_q, phi_k, repeat_kv(x64[2], m64.n_head))
    (y32 * g).sum().backward()
    (y64 * g.double()).sum().backward()
    assert rel(y32, y64) < 1e-5
    gv = x64[2].grad
    assert rel(x32[2].grad, gv) < 1e-5
    assert grad_close(x32[0].grad, x64[0].grad, T, gv) and grad_close(x32[1].grad, x64[1].grad, T, gv)
    for (name, p32), p64 in zip(m32.named_parameters(), m64.parameters()):
        assert grad_close(p32.grad, p64.grad, T, gv), name


@pytest.mark.parametrize("chunk", [1, 7, 16, 100, 256, 1024, 2 ** 40])
def test_chunk_size_not_dividing_T(chunk):
    """Any chunk size, one longer than T too (it had padded T to 2^40 tokens: one chunk of T is the same sum)."""
    torch.manual_seed(2)
    fm = Performer(2, 16, 24)
    q, k, v = qkv(2, 2, 2, 250, 16, seed=2)
    phi_q, phi_k = fm(q, True), fm(k, False)
    y_ref = linear_attention_reference(phi_q.double(), phi_k.double(), v.double())
    assert rel(causal_linear_attention(phi_q, phi_k, v, chunk_size=chunk), y_ref) < 1e-5


def test_scan_with_initial_state_and_final_state():
    torch.manual_seed(3)
    B, H, T, M, D = 2, 2, 150, 20, 8
    phi_q, phi_k = torch.rand(B, H, T, M), torch.rand(B, H, T, M)
    v = torch.randn(B, H, T, D)
    y_ref = linear_attention_reference(phi_q, phi_k, v)
    y1, S, s = causal_linear_attention(phi_q[:, :, :70], phi_k[:, :, :70], v[:, :, :70], 32, return_state=True)
    y2, S, s = causal_linear_attention(phi_q[:, :, 70:], phi_k[:, :, 70:], v[:, :, 70:], 32, state=(S, s),
                                       return_state=True)
    assert rel(torch.cat((y1, y2), 2), y_ref) < 1e-5
    assert rel(S, phi_k.mT @ v) < 1e-5 and rel(s, phi_k.sum(2)) < 1e-5


@pytest.mark.parametrize("fmap", MAPS)
def test_bf16_inputs_finite_and_close_to_fp32(fmap):
    torch.manual_seed(4)
    m = LinearAttention(4, 4, 64, 64, fmap, chunk_size=32)
    q, k, v = qkv(1, 4, 4, 200, 64, dtype=torch.bfloat16, seed=4)
    y = m(q, k, v)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    y32 = m(q.float(), k.float(), v.float())  # the same (bf16-rounded) values in fp32
    assert rel(y, y32) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmap", MAPS)
def test_large_norms_stay_finite(fmap, dtype):
    """Norms up to 20 d^(1/4) (logits q.k / sqrt(d) up to 400): features and outputs finite, gradients too."""
    torch.manual_seed(5)
    B, H, T, D, M = 1, 2, 130, 64, 64
    m = LinearAttention(H, H, D, M, fmap, chunk_size=32)
    g = torch.Generator().manual_seed(5)
    unit = lambda: torch.nn.functional.normalize(torch.randn(B, H, T, D, generator=g), dim=-1)
    norms = torch.linspace(0.1, 20, T).view(1, 1, T, 1) * D ** 0.25
    q, k = (unit() * norms).to(dtype), (unit() * norms.flip(2)).to(dtype)
    v = torch.randn(B, H, T, D, generator=g).to(dtype)
    q.requires_grad_(), k.requires_grad_()
    phi_q, phi_k = m.features(*m.inputs(q, k))
    for phi in (phi_q, phi_k):
        assert torch.isfinite(phi).all() and (phi >= 0).all()
    y = m(q, k, v)
    assert torch.isfinite(y).all()
    y.float().sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    if fmap != "dijiang":  # every query has its max feature at exactly 1: the query side never underflows
        assert torch.allclose(phi_q.amax(-1), torch.ones(()))


@pytest.mark.parametrize("fmap", MAPS)
@pytest.mark.parametrize("scale", [1.0, 20.0])
def test_causal(fmap, scale):
    """The output at i must not change when tokens after i change, also when the later tokens are huge."""
    torch.manual_seed(6)
    T, i, D = 200, 77, 64
    m = LinearAttention(2, 1, D, 32, fmap, chunk_size=64)
    q, k, v = qkv(1, 2, 1, T, D, scale=scale * D ** 0.25 / math.sqrt(D), seed=6)
    y = m(q, k, v)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[:, :, i + 1:] *= 30
    k2[:, :, i + 1:] = torch.randn_like(k2[:, :, i + 1:]) * 40
    v2[:, :, i + 1:] = 1e4
    y2 = m(q2, k2, v2)
    assert torch.equal(y[:, :, :i + 1], y2[:, :, :i + 1])


def test_prf_unbiased_error_falls_like_inverse_sqrt_M():
    """Relative error of Phi(q).Phi(k) against exp(q.k / sqrt(d)), root-mean-squared over 64 heads (independent z)
    x 64 pairs, for M = 16 ... 4096: the log-log slope is -1/2 (M independent features: variance / M exactly)."""
    torch.manual_seed(7)
    H, P, d = 64, 64, 16
    q, k = torch.randn(1, H, P, d) * 0.4, torch.randn(1, H, P, d) * 0.4
    exact = torch.exp((q * k).sum(-1).double() / math.sqrt(d))
    Ms = [2 ** e for e in range(4, 13)]
    errs = []
    for m in Ms:
        fm = PRF(H, d, m)
        with torch.no_grad():
            est = torch.exp(fm.log_features(q).double() + fm.log_features(k).double()).sum(-1)
        errs.append(((est - exact) / exact).square().mean().sqrt().item())
    slope = torch.linalg.lstsq(torch.tensor([[math.log(m), 1.0] for m in Ms]),
                               torch.tensor(errs).log()[:, None]).solution[0].item()
    assert -0.6 <= slope <= -0.4, (slope, errs)


def student_rows(core, q, k):
    """The student's normalised causal attention (B, H, T, T): row i = phi_q,i . phi_k,j / sum_{j<=i}."""
    phi_q, phi_k = core.features(*core.inputs(q, k))
    A = (phi_q @ phi_k.mT).tril()
    return A / A.sum(-1, keepdim=True)


def test_stabilised_features_give_the_same_attention_as_raw_features():
    """forward's rescaled features and the raw Phi of log_features give the same normalised attention, and that
    attention times v is the core's output."""
    torch.manual_seed(8)
    m = LinearAttention(3, 3, 16, 40, "prf")
    with torch.no_grad():
        m.feature_map.log_alpha.normal_()
    q, k, v = qkv(2, 3, 3, 50, 16, seed=8)
    f = m.feature_map
    A = (f.log_features(q).exp() @ f.log_features(k).exp().mT).tril()
    assert rel(student_rows(m, q, k), A / A.sum(-1, keepdim=True)) < 1e-5
    assert rel(student_rows(m, q, k) @ v, m(q, k, v)) < 1e-5


def test_overflow_safe_features_are_raw_features_times_the_documented_factors():
    """overflow_safe_prf = Phi times sqrt(M / alpha_m) e^(beta - |z_m|^2/2) for keys, and times
    sqrt(M alpha_m) e^(|z_m|^2/2) c(q), c(q) = exp(|q~|^2/2 - max a), for queries (fp64, where Phi is finite)."""
    torch.manual_seed(16)
    H, d, n = 3, 16, 40
    fm = PRF(H, d, n).double()
    with torch.no_grad():
        fm.log_alpha.normal_()
    x = qkv(2, H, H, 50, d, seed=16)[0].double()
    log_phi = fm.log_features(x)                                                  # (B, H, T, M)
    log_alpha, half_z2 = fm.log_alpha[:, None], 0.5 * fm.z.square().sum(-1)[:, None]  # (H, 1, M)
    key = fm(x, is_query=False).log() - log_phi
    torch.testing.assert_close(key, (0.5 * (math.log(n) - log_alpha) + model.KEY_SHIFT - half_z2).expand_as(key))
    a = log_alpha + x @ fm.z.mT / d ** 0.25 + half_z2
    log_c = 0.5 * x.square().sum(-1, keepdim=True) / d ** 0.5 - a.amax(-1, keepdim=True)   # (B, H, T, 1)
    query = fm(x, is_query=True).log() - log_phi
    torch.testing.assert_close(query, (0.5 * (math.log(n) + log_alpha) + half_z2 + log_c).expand_as(query))


@pytest.mark.parametrize("fmap", MAPS)
def test_gradcheck_against_finite_differences(fmap):
    """The whole path (in-place feature code, detached max, chunked scan) against finite differences in fp64."""
    torch.manual_seed(15)
    m = LinearAttention(2, 1, 4, 5, fmap, chunk_size=3).double()
    names = [n for n, _ in m.named_parameters()]
    params = [(p + 0.1 * torch.randn_like(p)).detach().requires_grad_() for p in m.parameters()]  # alpha != 1
    q, k, v = [x.double().requires_grad_() for x in qkv(1, 2, 1, 7, 4, seed=15)]
    f = lambda q, k, v, *ps: torch.func.functional_call(m, dict(zip(names, ps)), (q, k, v))
    assert torch.autograd.gradcheck(f, (q, k, v, *params), eps=1e-6, atol=1e-6, fast_mode=True)


def test_performer_rows_orthogonal_within_a_block():
    torch.manual_seed(9)
    d, M = 16, 40
    z = Performer(2, d, M).z                                      # (H, M, d): blocks of 16, 16, 8 rows
    for start in range(0, M, d):
        blk = z[:, start:start + d]
        G = blk @ blk.mT
        off = G - torch.diag_embed(torch.diagonal(G, dim1=-2, dim2=-1))
        assert off.abs().max() < 1e-4 * G.abs().max()
    assert not any(p.requires_grad for p in Performer(2, d, M).parameters())


def test_performer_directions_are_haar_with_no_sign_preferred():
    """QR's Q alone prefers signs (its first column's first entry is never positive); with the sign fix every
    coordinate of every row direction averages 0 over 512 heads (each has sd 1/4 at d = 16: 0.011 for the mean)."""
    torch.manual_seed(23)
    z = Performer(512, 16, 32).z
    assert (z / z.norm(dim=-1, keepdim=True)).mean(0).abs().max() < 0.06          # (M, d) means over the heads


def test_performer_rows_are_gaussian_draws_not_unit_rows():
    """Each row of Performer's z has the norm of an N(0, I_d) draw (chi(d): mean sqrt(2) G((d+1)/2) / G(d/2), std
    ~0.70 at d = 16), not one fixed norm; rows of one block are orthogonal directions."""
    torch.manual_seed(17)
    norms = Performer(64, 16, 64).z.norm(dim=-1).flatten().double()           # 4096 rows
    mean = math.sqrt(2) * math.exp(math.lgamma(8.5) - math.lgamma(8))
    assert abs(norms.mean().item() - mean) < 0.05 and abs(norms.std().item() - math.sqrt(16 - mean ** 2)) < 0.05


def test_dijiang_projection_is_the_dct_of_the_papers_quantiles():
    """DiJiang's P = C diag(w) for M = d, C the DCT-II computed here by the FFT (an independent route): C^T P is
    diagonal, its diagonal Gaussian quantiles of a scrambled Sobol sequence (within (-5.3, 5.3), mean near 0)."""
    d = 32
    x = np.eye(d)
    v = np.concatenate([x, x[::-1]], axis=0)                             # the mirrored sequence of each basis vector
    X = np.fft.fft(v, axis=0)[:d] * np.exp(-1j * np.pi * np.arange(d) / (2 * d))[:, None]
    C = X.real / np.sqrt(2 * d)
    C[0] /= np.sqrt(2)                                                   # orthonormal DCT-II, column n = DCT of e_n
    torch.manual_seed(18)
    W = C.T @ DiJiang(1, d, d).proj.double().numpy()
    assert np.abs(W - np.diag(np.diag(W))).max() < 1e-5 and np.abs(np.diag(W)).max() < 5.3
    assert abs(np.diag(W).mean()) < 0.5 and len(set(np.round(np.diag(W), 4))) == d


def test_dijiang_features_sum_to_one():
    torch.manual_seed(10)
    for m in (16, 64, 100):
        fm = DiJiang(2, 64, m)
        phi = fm(torch.randn(1, 2, 30, 64) * 5, True)
        assert phi.shape == (1, 2, 30, m) and torch.allclose(phi.sum(-1), torch.ones(()), atol=1e-6)
        assert fm.proj.shape == (64, m) and "proj" in fm.state_dict()
        x = torch.randn(3, 64)
        assert torch.allclose(fm(x), torch.softmax(x @ fm.proj, -1), atol=1e-6)           # phi(x) = softmax(x P)


@pytest.mark.parametrize("fmap", MAPS)
def test_cache_prefill_then_steps_equal_full_forward(fmap):
    torch.manual_seed(11)
    B, H, Hkv, T, D = 2, 6, 2, 90, 32
    m = LinearAttention(H, Hkv, D, 24, fmap, chunk_size=16)
    q, k, v = qkv(B, H, Hkv, T, D, seed=11)
    y_full = m(q, k, v)
    cache = {}
    parts = [m(q[:, :, :37], k[:, :, :37], v[:, :, :37], cache)]            # prefill from nothing
    parts.append(m(q[:, :, 37:60], k[:, :, 37:60], v[:, :, 37:60], cache))  # prefill from a state
    for t in range(60, T):                                                  # one token at a time
        parts.append(m(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache))
    assert rel(torch.cat(parts, 2), y_full) < 1e-5
    assert set(cache) == {"S", "s"} and cache["S"].shape == (B, H, 24, D) and cache["s"].shape == (B, H, 24)


def test_gqa_repeat_matches_explicit_heads():
    """Query head h reads kv head h // (H / Hkv), as HF's repeat_kv."""
    torch.manual_seed(12)
    B, H, Hkv, T, D = 1, 6, 2, 40, 16
    m = LinearAttention(H, Hkv, D, 12, "prf", chunk_size=16)
    full = LinearAttention(H, H, D, 12, "prf", chunk_size=16)
    full.load_state_dict(m.state_dict())
    q, k, v = qkv(B, H, Hkv, T, D, seed=12)
    idx = torch.arange(H) // (H // Hkv)
    assert rel(m(q, k, v), full(q, k[:, idx], v[:, idx])) < 1e-6


def test_key_mean_buffer_centres_keys_and_is_saved():
    torch.manual_seed(13)
    m = LinearAttention(2, 1, 16, 12, "prf")
    assert "key_mean" in m.state_dict() and m.key_mean.shape == (2, 16) and not m.key_mean.any()
    q, k, v = qkv(1, 2, 1, 30, 16, seed=13)
    mu = torch.randn(1, 16)
    with torch.no_grad():
        m.key_mean.copy_(mu.expand(2, 16))
    plain = LinearAttention(2, 1, 16, 12, "prf")
    plain.load_state_dict({**m.state_dict(), "key_mean": torch.zeros(2, 16)})
    assert rel(m(q, k, v), plain(q, k - mu[:, None], v)) < 1e-6


def test_unknown_feature_map_is_a_clear_error():
    with pytest.raises(door.ModelError, match="unknown feature map 'cosformer'; choose one of prf, "):
        checkpoint.check_student({"dims": [8, 8], "feature_map": "cosformer"}, 2, model.FEATURE_MAPS)


@pytest.mark.parametrize("family", ["llama", "neox"])
def test_linearized_generation_equals_full_forward_greedy(family):
    """Token-by-token decoding with the fixed-size state gives exactly the tokens of greedy decoding that re-runs
    the whole sequence through the chunked scan at every step."""
    from model import GPT, Cache, GPTConfig
    torch.manual_seed(0)
    cfg = GPTConfig(family=family, vocab_size=300, n_layer=2, n_head=4, n_kv_head=2 if family == "llama" else 4,
                    n_embd=64, head_dim=16, block_size=256, rotary_dim=16 if family == "llama" else 8,
                    parallel_residual=family == "neox", tie_embeddings=False, mlp_hidden=128,
                    bias=family == "neox")
    student = GPT(cfg).eval().linearize([8, 24], chunk_size=16)
    prompt = torch.randint(0, 300, (1, 21))
    idx = prompt
    with torch.no_grad():
        for _ in range(40):                                  # crosses chunk boundaries at 32, 48
            idx = torch.cat((idx, student(idx)[:, -1:].argmax(-1)), dim=1)
    assert torch.equal(student.generate(prompt, 40), idx)
    cache = Cache(cfg.n_layer)                               # the decoding state: S and s per layer, no KV cache
    with torch.no_grad():
        student(idx, cache=cache)
    assert [sorted(c) for c in cache] == [["S", "s"]] * 2 and cache[0]["S"].shape == (1, 4, 8, 16)


@pytest.mark.parametrize("fmap", MAPS)
def test_bf16_autocast_runs_features_and_scan_in_fp32(fmap):
    """Under torch.autocast("cpu", bfloat16) every linear-attention core of a linearised model gets bf16 q, k, v
    and returns exactly its fp32 result on those inputs, rounded once to bf16: in the prefill (chunked scan) and in
    decoding (recurrent step). Autocast would otherwise run the feature projection and the scan's sums in bf16."""
    from model import GPT, Cache, GPTConfig
    torch.manual_seed(0)
    cfg = GPTConfig(family="llama", vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, n_embd=128, head_dim=32,
                    block_size=256, rotary_dim=32, tie_embeddings=False, mlp_hidden=256, bias=False)
    student = GPT(cfg).eval().linearize([32, 48], feature_map=fmap, chunk_size=16)
    for core in student.cores():  # trained-looking keys: centred by a non-zero key mean
        core.key_mean.normal_(0, 0.5)
    seen = []
    hooks = [core.register_forward_hook(lambda m, args, y: seen.append((m, args[:3], y)))
             for core in student.cores()]
    idx, cache = torch.randint(0, 300, (2, 100)), Cache(cfg.n_layer)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        student(idx[:, :99], cache=cache)                    # prefill: the chunked scan
        student(idx[:, 99:], cache=cache)                    # one token: the recurrent step
    for h in hooks:
        h.remove()
    assert len(seen) == 2 * cfg.n_layer
    with torch.no_grad():
        for (core, prefill, y), (_, step, y_step) in zip(seen[:cfg.n_layer], seen[cfg.n_layer:]):
            assert {x.dtype for x in (*prefill, y, *step, y_step)} == {torch.bfloat16}
            state = {}                                       # fp32, autocast off, on the same bf16 values
            assert torch.equal(y, core(*(x.float() for x in prefill), cache=state).to(torch.bfloat16))
            assert torch.equal(y_step, core(*(x.float() for x in step), cache=state).to(torch.bfloat16))


# ==================================================================================================================
# dof.py: degrees of freedom against theory, allocation, the teacher's queries and keys

def eigenvalues_1d(d, s, nodes=80):
    """Eigenvalues of f -> E_y[exp(x y / sqrt d) f(y)], y ~ N(0, s^2), by Gauss-Hermite Nystrom (W^1/2 K W^1/2)."""
    t, w = hermegauss(nodes)                      # weight exp(-t^2 / 2)
    p, y = w / math.sqrt(2 * math.pi), s * t
    K = np.sqrt(p)[:, None] * np.exp(np.outer(y, y) / math.sqrt(d)) * np.sqrt(p)[None, :]
    nu = np.sort(np.linalg.eigvalsh(K))[::-1]
    return nu[nu > 1e-18 * nu[0]]


def true_dof(d, s, lam):
    """N_lam = sum mu / (mu + lam) over the d-fold products mu of the 1-D eigenvalues."""
    nu, mu = eigenvalues_1d(d, s), np.ones(1)
    for _ in range(d):
        mu = np.multiply.outer(mu, nu).ravel()
        mu = mu[mu > 1e-16 * lam]                 # the rest add less than 1e-16 each
    return float((mu / (mu + lam)).sum())


def estimates(d, s, lam, J, seeds):
    out = []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        out.append(dof.degrees_of_freedom(torch.randn(J, d, generator=g, dtype=torch.float64) * s, lam).item())
    return np.array(out)


def test_nystrom_matches_closed_form_spectrum():
    """The 1-D spectrum is geometric: nu_k = (1 - r) / sqrt(1 - 2a) r^k with a = s^2 / sqrt d and
    r = (1 - sqrt(1 - 4a^2)) / 2a (a Mehler kernel), which checks the Nystrom computation."""
    for d, s in [(3, 0.5), (4, 0.8)]:
        a = s * s / math.sqrt(d)
        r = (1 - math.sqrt(1 - 4 * a * a)) / (2 * a)
        nu = eigenvalues_1d(d, s)[:8]
        assert np.allclose(nu, (1 - r) / math.sqrt(1 - 2 * a) * r ** np.arange(8), rtol=1e-9)


def test_dof_matches_theory_d3():
    truth = true_dof(3, 0.5, 2 ** -4)
    assert abs(truth - 5.31) < 0.01
    est = estimates(3, 0.5, 2 ** -4, 4000, range(5))
    print(f"\nd=3 s=0.5 lam=2^-4: true N = {truth:.4f}, estimates at J=4000 {np.round(est, 3).tolist()}, "
          f"mean {est.mean():.4f} ({100 * (est.mean() / truth - 1):+.2f}%)")
    assert abs(est.mean() / truth - 1) < 0.05


def test_dof_biased_low_and_error_shrinks_with_J_d4():
    truth = true_dof(4, 0.8, 0.02)
    assert abs(truth - 85.34) < 0.01
    errors = []
    print(f"\nd=4 s=0.8 lam=0.02: true N = {truth:.3f}")
    for J in (250, 1000, 4000):
        est = estimates(4, 0.8, 0.02, J, range(3))
        errors.append(est.mean() / truth - 1)
        print(f"  J={J:5d}: mean {est.mean():6.2f} over seeds {np.round(est, 2).tolist()}, "
              f"error {100 * errors[-1]:+.1f}%")
    assert all(e < 0 for e in errors)             # biased low
    assert errors[0] < errors[1] < errors[2]      # and the bias shrinks as J grows


def logits(x):
    return x @ x.mT / math.sqrt(x.size(-1))


def test_fast_path_equals_eigenvalue_reference():
    torch.manual_seed(0)
    for scale in (0.3, 1.0, 1.2):                                  # logits up to ~20: eigvalsh resolves these
        S = logits(torch.randn(3, 300, 8, dtype=torch.float64) * scale)
        for lam, rel in ((2 ** -4, False), (1e-4, False), (1e-3, True), (0.3, True)):
            fast, ref = dof.dof_from_logits(S, lam, rel), dof.dof_reference(S, lam, rel)
            assert torch.allclose(fast, ref, rtol=1e-8, atol=1e-8), (scale, lam, rel, fast, ref)


def test_bounds_monotone_in_lambda_and_permutation_invariant():
    torch.manual_seed(1)
    x = torch.randn(4, 200, 16) * torch.tensor([0.3, 1.0, 2.0, 4.0])[:, None, None]
    prev = torch.full((4,), 200.0, dtype=torch.float64)
    for lam in (1e-6, 1e-4, 1e-2, 1.0, 1e2, 1e4):
        N = dof.degrees_of_freedom(x, lam)
        assert N.shape == (4,) and (N >= 0).all() and (N <= 200).all()
        assert (N <= prev + 1e-9).all()
        assert (N < prev).any()
        prev = N
    perm = torch.randperm(200)
    for rel in (False, True):
        assert torch.allclose(dof.degrees_of_freedom(x, 0.01, rel), dof.degrees_of_freedom(x[:, perm], 0.01, rel),
                              rtol=1e-10)


def test_large_logits_match_high_precision_truth():
    """Logits in the hundreds: the logit-space Cholesky path matches 300-digit arithmetic; the plain eigenvalue
    route (float64 eigvalsh of exp(S) / J) cannot resolve the spectrum there."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 300
    torch.manual_seed(0)
    S = logits(torch.randn(40, 6, dtype=torch.float64) * 6)
    assert 100 < S.max() < 700                                    # exp(S) representable in float64
    G = mpmath.matrix([[mpmath.exp(mpmath.mpf(float(v))) / 40 for v in row] for row in S.tolist()])
    truth = float(sum(mu / (mu + mpmath.mpf(1) / 16) for mu in mpmath.eigsy(G, eigvals_only=True)))
    assert abs(dof.dof_from_logits(S, 1 / 16).item() - truth) < 1e-8
    mu = torch.linalg.eigvalsh(torch.exp(S) / 40).clamp(min=0)   # the unscaled float64 computation
    assert abs((mu / (mu + 1 / 16)).sum().item() - truth) > 1     # ... is far off: why dof.py does not use it


def test_large_logits_agree_with_unscaled_float64_where_it_is_accurate():
    """A tight cluster on the sphere |x|^2 / sqrt d = 300: logits 290-300, exp(S) ~ 1e130 is representable and
    its spectrum spans few enough decades for float64 eigvalsh."""
    torch.manual_seed(2)
    c = torch.nn.functional.normalize(torch.randn(64, dtype=torch.float64), dim=0)
    x = torch.nn.functional.normalize(c + 0.01 * torch.randn(100, 64, dtype=torch.float64), dim=-1) * math.sqrt(2400)
    S = logits(x)
    assert 299 < S.max() < 301 and S.min() > 290
    mu = torch.linalg.eigvalsh(torch.exp(S) / 100)
    for lam, rel in ((2 ** -4, False), (0.5, True), (0.02, True)):
        lam_abs = lam * mu.sum() if rel else lam
        plain = (mu / (mu + lam_abs)).sum()
        assert torch.isfinite(plain) and abs(dof.degrees_of_freedom(x, lam, rel) - plain) < 1e-8 * 100


def test_no_overflow_in_the_thousands_and_relative_invariant_to_kernel_scale():
    torch.manual_seed(3)
    x = torch.randn(2, 300, 64) * 30                              # |x|^2 / 8 ~ 7000
    for rel in (False, True):
        N = dof.degrees_of_freedom(x, 1e-3, rel)
        assert torch.isfinite(N).all() and (N >= 0).all() and (N <= 300).all()
    S = logits(torch.randn(2, 300, 16, dtype=torch.float64) * 2)
    for log_c in (-50.0, 3.0, 500.0):                             # K -> cK is S -> S + log c
        assert torch.allclose(dof.dof_from_logits(S + log_c, 1e-3, True), dof.dof_from_logits(S, 1e-3, True),
                              rtol=1e-9)
    assert not torch.allclose(dof.dof_from_logits(S + 3.0, 1e-3), dof.dof_from_logits(S, 1e-3))


def test_exact_duplicates():
    """Exact duplicates (position 0 depends only on its token) make G singular. At moderate norms the result equals
    the plain eigenvalue definition; at huge norms (|x|^2 / sqrt d = 80) each pair is one eigenvalue
    2 G_ii / J >> lambda, so N = J / 2, which needs the multiplicity weighting to come out right."""
    torch.manual_seed(4)
    y = torch.randn(60, 8, dtype=torch.float64)
    x = torch.cat((y, y[:25], y[:5]))[torch.randperm(90)]
    for rel in (False, True):
        assert torch.allclose(dof.degrees_of_freedom(x, 0.01, rel), dof.dof_reference(logits(x), 0.01, rel), rtol=1e-8)
    y = torch.nn.functional.normalize(torch.randn(50, 32, dtype=torch.float64), dim=-1) * math.sqrt(80 * math.sqrt(32))
    N = dof.degrees_of_freedom(torch.cat((y, y)), 2 ** -4)
    assert abs(N.item() - 50) < 1e-6


def test_near_duplicates_far_above_lambda():
    """Two points 1e-13 apart with logits of 80 make A singular in float64: one clear error. The relative lambda
    keeps every eigenvalue of A above lam / (1 + lam), and there the pair counts as the exact duplicate does."""
    torch.manual_seed(5)
    y = F.normalize(torch.randn(20, 32, dtype=torch.float64), dim=-1) * math.sqrt(80 * math.sqrt(32))
    near = torch.cat((y, y[:1] + 1e-13 * torch.randn(1, 32, dtype=torch.float64)))
    with pytest.raises(door.ModelError, match="numerically singular.*--lam-relative"):
        dof.degrees_of_freedom(near, 2 ** -4)
    N = dof.degrees_of_freedom(near, 1e-3, relative=True)
    assert 10 < N < 21 and abs(N - dof.degrees_of_freedom(torch.cat((y, y[:1])), 1e-3, relative=True)) < 1e-6


def test_queries_and_keys_with_nan_are_a_clear_error():
    with pytest.raises(door.ModelError, match="inf or nan"):
        dof.degrees_of_freedom(torch.full((10, 4), float("nan")), 0.1)


def test_allocate_examples():
    assert dof.allocate([10, 20, 30, 40], 64) == [26, 51, 77, 102]
    assert dof.allocate(torch.tensor([10.0, 20, 30, 40]), 64, "clip", 64) == [26, 51, 64, 64]
    assert dof.allocate([10, 20, 30, 40], 64, "reverse") == [102, 77, 51, 26]
    assert dof.allocate([10, 20, 30, 40], 64, "fix") == [64] * 4
    assert dof.allocate([12, 25, 47], 32) == [14, 28, 54]              # the README's worked example, by hand
    assert dof.allocate([0, 0, 100], 2) == [1, 1, 4]              # shares below 1 are lifted to 1, mean kept
    assert dof.allocate([0.0, 0.0], 5) == [5, 5]                  # no DoF anywhere: uniform
    assert dof.allocate([3.0], 7) == [7]


def test_allocate_random_profiles():
    rng = np.random.default_rng(0)
    for trial in range(2000):
        n = int(rng.integers(1, 40))
        budget = int(rng.choice([1, 2, 3, 8, 32, 64, 128]))
        dofv = rng.lognormal(0, rng.uniform(0, 4), n) * (rng.random(n) > 0.1)   # heavy spread, some zeros
        if trial % 7 == 0:
            dofv = np.round(dofv)                                                # ties
        dims = np.array(dof.allocate(dofv, budget))
        assert dims.sum() == budget * n and dims.min() >= 1
        order = np.argsort(-dofv, kind="stable")
        assert (np.diff(dims[order]) <= 0).all()                                  # more DoF, no fewer dims
        if dofv.sum() > 0:
            raw = budget * n * dofv / dofv.sum()
            if raw.min() >= 1:
                assert (np.abs(dims - raw) < 1).all()                             # proportional up to rounding
            assert (dims[dofv == 0] == 1).all()
        clip = int(rng.integers(1, 128))
        clipped = np.array(dof.allocate(dofv, budget, "clip", clip))
        assert (clipped == np.minimum(dims, clip)).all() and clipped.mean() <= budget
        rev = np.array(dof.allocate(dofv, budget, "reverse"))
        assert sorted(rev) == sorted(dims)
        assert (rev[order] == np.sort(dims)).all()                                # k-th largest DoF, k-th smallest dim


def test_choose_dims_rules_are_allocate_on_the_layer_maxima(tmp_path):
    """choose_dims for each --alloc: dof proportional to each layer's largest head DoF, clip the same dims capped at
    the head size, reverse the same dims in the opposite order, fix the budget everywhere (and no DoF); the paper's
    lambda is the default."""
    tiny_gpt2(tmp_path)
    m = GPT.from_pretrained(tmp_path)
    batches = [torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(0))]

    def choose(alloc):
        return dof.choose_dims(m, batches, types.SimpleNamespace(budget=16, alloc=alloc, lam=1e-3, lam_relative=True,
                                                                 J=200, seed=0))
    dims, layer, head = choose("dof")
    assert torch.equal(head, dof.degrees_of_freedom(dof.collect_qk(m, batches, 200, 0), 1e-3, True))
    assert layer == head.amax(-1).tolist() and head.shape == (2, m.config.n_head)
    assert dims == dof.allocate(layer, 16) and max(dims) > m.config.head_dim == 16      # the cap below binds
    assert choose("clip")[:2] == (np.minimum(dims, 16).tolist(), layer)
    reverse = choose("reverse")[:2]
    assert reverse == (dof.allocate(layer, 16, "reverse"), layer) and reverse[0] != dims
    assert choose("fix") == ([16, 16], None, None)
    assert dof.DofConfig().lam == distill.DistillConfig().lam == 2 ** -4                 # the paper's, for GPT-2


def tiny_gpt2(path, **kw):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = {**dict(n_layer=2, n_head=2, n_embd=32, vocab_size=50257, n_positions=128), **kw}
    hf = GPT2LMHeadModel(GPT2Config(**cfg))
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "c_attn" in n:
                p.normal_(0, 0.5)                  # queries/keys of a useful size
    hf.eval().save_pretrained(path)
    return hf


def match_all(pool, points, tol=1e-4):
    """Every row of points is (up to tol) a row of pool, and distinct rows match distinct rows."""
    d = torch.cdist(points.double(), pool.double())
    best = d.min(1)
    assert best.values.max() < tol
    assert best.indices.unique().numel() == points.size(0)


def test_collect_qk_gpt2_equals_transformers_queries_and_keys(tmp_path):
    hf = tiny_gpt2(tmp_path)
    m = model.GPT.from_pretrained(tmp_path)
    idx = torch.randint(0, 50257, (2, 24))
    with torch.no_grad():
        x0 = hf.transformer.wte(idx) + hf.transformer.wpe(torch.arange(24))
        q, k, _ = hf.transformer.h[0].attn.c_attn(hf.transformer.h[0].ln_1(x0)).split(32, dim=2)
    q = q.view(2, 24, 2, 16).transpose(1, 2)                       # (B, H, T, D)
    k = k.view(2, 24, 2, 16).transpose(1, 2)
    full = dof.collect_qk(m, [idx[:1], idx[1:]], J=2 * 2 * 24, seed=0)     # J = everything: the whole pool
    assert full.shape == (2, 2, 96, 16)
    for h in range(2):
        match_all(full[0, h], torch.cat((q[:, h].reshape(-1, 16), k[:, h].reshape(-1, 16))))
    part = dof.collect_qk(m, iter([idx]), J=30, seed=1)               # a sample: rows of the pool, no repeats
    assert part.shape == (2, 2, 30, 16)
    for h in range(2):
        match_all(torch.cat((q[:, h].reshape(-1, 16), k[:, h].reshape(-1, 16))), part[0, h])
    assert torch.equal(part, dof.collect_qk(m, [idx], J=30, seed=1))
    assert not torch.equal(part, dof.collect_qk(m, [idx], J=30, seed=2))


def test_collect_qk_llama_gqa_after_rotary(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      hidden_size=64, intermediate_size=96, vocab_size=300,
                                      max_position_embeddings=128)).eval()
    hf.save_pretrained(tmp_path)
    m = model.GPT.from_pretrained(tmp_path)
    idx = torch.randint(0, 300, (1, 20))
    full = dof.collect_qk(m, [idx], J=40)
    mu = dof.key_means(m, [idx])                                   # (L, H, D): KV head h // 2's mean key
    centred = dof.collect_qk(m, [idx], J=40, key_means=mu)         # keys centred, queries as they are
    with torch.no_grad():
        hidden = hf(idx, output_hidden_states=True).hidden_states  # hidden[l]: layer l's input
        cos, sin = hf.model.rotary_emb(hidden[0], torch.arange(20)[None])
        for l, layer in enumerate(hf.model.layers):
            x, at = layer.input_layernorm(hidden[l]), layer.self_attn
            q = at.q_proj(x).view(1, 20, 4, 16).transpose(1, 2)
            k = at.k_proj(x).view(1, 20, 2, 16).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            assert torch.allclose(mu[l], k[0].mean(1).repeat_interleave(2, 0), atol=1e-5)
            for h in range(4):                                     # query head h pools with KV head h // 2
                match_all(full[l, h], torch.cat((q[0, h], k[0, h // 2])))
                match_all(centred[l, h], torch.cat((q[0, h], k[0, h // 2] - mu[l, h])))


def test_collect_qk_sample_is_uniform_over_the_stream(tmp_path):
    """Queries and keys of early and late batches are equally likely to be kept."""
    tiny_gpt2(tmp_path)
    m = model.GPT.from_pretrained(tmp_path)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 50257, (1, 50), generator=g) for _ in range(20)]     # 2000 points per head
    first = dof.collect_qk(m, batches[:1], J=100)                 # the points of batch 0
    x = dof.collect_qk(m, (b for b in batches), J=500, seed=3)    # a generator: consumed once, never stored
    from_first = (torch.cdist(x[0, 0], first[0, 0]).min(1).values < 1e-6).sum().item()
    assert 5 <= from_first <= 50                                  # expected 500 / 20 = 25


def test_collect_qk_bad_input(tmp_path):
    tiny_gpt2(tmp_path)
    m = model.GPT.from_pretrained(tmp_path)
    with pytest.raises(IndexError):                               # a failing forward pass leaves no hooks behind
        dof.collect_qk(m, [torch.full((1, 4), 10 ** 6)], J=1)
    assert all(not b.attn.core._forward_pre_hooks for b in m.h)


# ==================================================================================================================
# distill.py's losses against their plain form; GPT.nll, dof.key_means and GPT.generate

def loss_case(seed=0, B=2, H=4, Hkv=2, T=50, D=16, M=8):
    from model import LinearAttention
    torch.manual_seed(seed)
    core = LinearAttention(H, Hkv, D, M, "prf")
    core.key_mean.normal_(0, 0.3)
    q, k = 1.5 * torch.randn(B, H, T, D), 1.5 * torch.randn(B, Hkv, T, D)
    return core, q, k


def grads(core):
    return [p.grad.clone() for p in core.parameters()]


def test_softmax_loss_blockwise_and_written_out_gradient_equal_the_plain_form():
    """layer_loss's blockwise form (T = 50 > query_block = 16: a last block of 2 rows) against softmax_loss, the
    plain T x T autograd form, in value and gradients; with query_block >= T (one block) too."""
    core, q, k = loss_case()
    value = distill.layer_losses([core], [(q, k)], "softmax", query_block=16, scale=1.0)[0]
    g_fast = grads(core)
    core.zero_grad()
    qg, kg = core.inputs(q, k)
    ref = distill.softmax_loss(qg, kg, *core.features(qg, kg)).mean()
    ref.backward()
    g_plain = grads(core)
    assert value.dtype == torch.float64 and value.dim() == 0
    assert abs(value.item() - ref.item()) < 1e-5 * max(1.0, abs(ref.item()))
    for a, b in zip(g_fast, g_plain):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (a - b).abs().max()
    core.zero_grad()
    plain = distill.layer_losses([core], [(q, k)], "softmax", query_block=50, scale=1.0)[0]
    assert plain.item() == pytest.approx(value.item(), rel=1e-5)
    for a, b in zip(grads(core), g_plain):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (a - b).abs().max()
    assert distill.layer_losses([core], [(q, k)], "softmax", query_block=16)[0].item() == value.item()   # no-grad path


def test_blockwise_losses_at_underflow_and_overflow_equal_the_plain_form_or_stay_finite():
    """Features at float's edges, where the written-out gradients clamp: a query whose features are all 0 (S_i = 0)
    and a key whose products with every query underflow (a_ij below float's tiny) get the plain form's gradients,
    not 1/tiny; every KL is at least 0, and a row without mass (S_i = 0, as when every key's features underflow)
    scores -H(p_i) - log tiny, large (the clamps had cancelled to -H(p_i) < 0); l2 log features of +60 (c = e^u / m
    past e^30) give a finite loss and finite gradients."""
    torch.manual_seed(23)
    B, H, T, D, M = 1, 2, 12, 8, 4
    q, k = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    pq, pk = torch.rand(B, H, T, M) + 0.1, torch.rand(B, H, T, M) + 0.1
    pq[:, :, 4], pk[:, :, 6] = 0.0, pk[:, :, 6] * 1e-40                   # S_4 = 0; a_i6 ~ 1e-40 < tiny (1.2e-38)
    leaves = [x.clone().requires_grad_() for x in (pq, pk)]
    distill.softmax_loss(q, k, *leaves).sum().backward()
    pq.grad, pk.grad = torch.zeros_like(pq), torch.zeros_like(pk)
    total = distill.softmax_loss_blockwise(q / D ** 0.5, k, pq, pk, block=5, grad_scale=1.0)
    assert torch.allclose(total, distill.softmax_loss(q, k, pq, pk).sum((0, 2)).double(), rtol=1e-5)
    for fast, plain in ((pq.grad, leaves[0].grad), (pk.grad, leaves[1].grad)):
        assert torch.allclose(fast, plain, rtol=1e-4, atol=1e-5), (fast - plain).abs().max()
    kl = distill.softmax_loss(q, k, pq, pk)                                   # (B, H, T)
    assert (kl >= 0).all() and (kl[:, :, 4] > 80).all() and (kl[:, :, :4] < 80).all(), kl
    none = torch.zeros_like(pk)                                               # every key's features underflow
    plain = distill.softmax_loss(q, k, pq, none)
    total = distill.softmax_loss_blockwise(q / D ** 0.5, k, pq, none, block=5)
    assert plain.isfinite().all() and (plain > 80).all()
    assert torch.allclose(total, plain.sum((0, 2)).double(), rtol=1e-5)
    lq, lk = torch.randn(B, H, T, M) + 60.0, torch.randn(B, H, T, M) + 60.0
    lq.grad, lk.grad = torch.zeros_like(lq), torch.zeros_like(lk)
    total = distill.l2_loss_blockwise(q / D ** 0.5, k, lq, lk, block=5, grad_scale=1.0)
    assert total.isfinite().all() and lq.grad.isfinite().all() and lk.grad.isfinite().all()


def plain_l2(core, q, k):
    """The l2 loss of one layer written out: mean over queries of sum_{j<=i} ((K - K^) / max_j K)^2, K = exp(q.(k -
    mu) / sqrt d), K^ = Phi(q).Phi(k - mu) from the map's log features."""
    qi, kc = core.inputs(q, k)
    mask = torch.ones(q.size(2), q.size(2), dtype=torch.bool).tril()
    logits = (qi @ kc.mT / q.size(-1) ** 0.5).masked_fill(~mask, -math.inf)
    lq, lk = core.features(qi, kc, log=True)
    khat = torch.exp(lq[..., :, None, :] + lk[..., None, :, :]).sum(-1)              # (B, H, T, T)
    m = logits.amax(-1, keepdim=True)
    return (((logits.exp() - khat) / m.exp()) ** 2).masked_fill(~mask, 0).sum(-1).mean()


@pytest.mark.parametrize("kind", ["softmax", "l2"])
@pytest.mark.parametrize("query_block", [0, 16, 50])
@pytest.mark.parametrize("stack", [True, False])
def test_layers_stacked_in_one_loss_equal_each_layer_alone(kind, query_block, stack):
    """layer_losses, with layers of one map type and M run as one over their stacked heads where the map has a
    stacked form (PRF.stacked; a GPU's layout: two learned PRF layers of M = 8, one of M = 12, a Performer and a
    DiJiang layer of M = 8 alone) or one by one (a CPU's): each layer's value and the gradients of every feature
    parameter equal that layer's plain T x T form (softmax_loss, the l2 loss written out) by autograd; T = 50 with
    blocks of 16 (not a divisor), 50 and auto."""
    torch.manual_seed(21)
    cores = [LinearAttention(4, 2, 16, m, f) for m, f in ((8, "prf"), (12, "prf"), (8, "prf"), (8, "performer"),
                                                          (8, "dijiang"))]
    for c in cores:
        c.key_mean.normal_(0, 0.3)
        c.feature_map.log_alpha.data.normal_(0, 0.3) if isinstance(c.feature_map, PRF) else None
    qk = [(1.5 * torch.randn(2, 4, 50, 16), 1.5 * torch.randn(2, 2, 50, 16)) for _ in cores]
    fast = distill.layer_losses(cores, qk, kind, query_block, scale=1.0, stack=stack)
    g_fast = [p.grad.clone() for c in cores for p in c.parameters()]
    for c in cores:
        c.zero_grad()
    plain = []
    for c, (q, k) in zip(cores, qk):
        qi, kc = c.inputs(q, k)
        plain.append(distill.softmax_loss(qi, kc, *c.features(qi, kc)).mean() if kind == "softmax" else
                     plain_l2(c, q, k))
    sum(plain).backward()
    assert fast.shape == (5,) and torch.allclose(fast, torch.stack(plain).double().detach(), rtol=1e-4)
    for a, b in zip(g_fast, [p.grad for c in cores for p in c.parameters()]):
        assert (a - b).norm() <= 1e-3 * b.norm() + 1e-9


def test_l2_loss_blocks_equal_the_plain_kernel_error():
    """The blockwise l2 loss against the paper's kernel error written out here: K = exp(q.(k - mu) / sqrt d) and
    K^ = Phi(q).Phi(k - mu), Phi(x)_m = sqrt(alpha_m / M) exp(z_m.x / d^(1/4) - |x|^2 / (2 sqrt d)) from z, alpha."""
    core, q, k = loss_case(seed=1)
    value = distill.layer_losses([core], [(q, k)], "l2", query_block=16, scale=1.0)[0]
    g_fast = grads(core)
    core.zero_grad()
    kc = model.repeat_kv(k, 4) - core.key_mean[:, None]
    kern = torch.exp(q @ kc.mT / 4.0)                       # exp(q.(k - mu) / sqrt(16)): the centred keys' kernel
    z, alpha, m_feat = core.feature_map.z, core.feature_map.log_alpha.exp(), core.feature_map.M
    phi = lambda x: (alpha / m_feat).sqrt()[:, None] * torch.exp(x @ z.mT / 2.0 - x.square().sum(-1, keepdim=True) / 8)
    khat = phi(q) @ phi(kc).mT
    mask = torch.ones(q.size(2), q.size(2), dtype=torch.bool).tril()
    m = kern.masked_fill(~mask, 0).amax(-1, keepdim=True)
    ref = (((kern - khat) / m) ** 2).masked_fill(~mask, 0).sum(-1).mean()
    ref.backward()
    assert abs(value.item() - ref.item()) < 1e-4 * ref.item()
    for a, b in zip(g_fast, grads(core)):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-6), (a - b).abs().max()


def test_nll_is_the_per_sequence_cross_entropy_in_fp32():
    """GPT.nll, the one next-token loss: each sequence's summed cross-entropy of log_softmax(logits), targets -1
    ignored, written out here from the full logits; under bf16 autocast it is fp32 and close to the fp32 value."""
    from model import GPTConfig
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=500, n_layer=1, n_head=2, n_kv_head=2, n_embd=32, head_dim=16,
                        block_size=64, mlp_hidden=64)).eval()
    x, y = torch.randint(0, 500, (3, 40)), torch.randint(0, 500, (3, 40))
    y[0, :5] = -1                                          # ignored targets stay ignored
    with torch.no_grad():
        logp = torch.log_softmax(gpt(x).double(), -1)
        ref = torch.stack([-sum(logp[b, t, y[b, t]] for t in range(40) if y[b, t] >= 0) for b in range(3)])
        nll = gpt.nll(x, y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = gpt.nll(x, y)
    assert nll.shape == (3,) and torch.allclose(nll.double(), ref, rtol=1e-5)
    assert low.dtype == torch.float32 and torch.allclose(low.double(), ref, rtol=2e-2)


def test_key_means_are_the_mean_of_the_teachers_keys_from_transformers(tmp_path):
    """dof.key_means over two batches: each layer's keys of GPT-2 computed by transformers, averaged over every
    token of both batches, per head."""
    hf = tiny_gpt2(tmp_path)
    m = model.GPT.from_pretrained(tmp_path)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 50257, (2, 24), generator=g), torch.randint(0, 50257, (3, 10), generator=g)]
    with torch.no_grad():
        out = [hf(b, output_hidden_states=True).hidden_states for b in batches]
        keys = [[hf.transformer.h[l].attn.c_attn(hf.transformer.h[l].ln_1(hs[l])).split(32, 2)[1].reshape(-1, 2, 16)
                 for hs in out] for l in range(2)]                       # (tokens, heads, 16) per batch
    ref = torch.stack([torch.cat(k).mean(0) for k in keys])              # (L, H, D): over all 78 tokens
    assert torch.allclose(dof.key_means(m, batches), ref, atol=1e-5)


def test_generate_runs_one_forward_pass_per_new_token_within_gpt2s_positions():
    """One forward pass for the prompt, then one per new token, up to GPT-2's last learned position."""
    cfg = model.GPTConfig(vocab_size=50, n_layer=1, n_head=2, n_kv_head=2, n_embd=16, head_dim=8, block_size=64)
    gpt, calls = GPT(cfg).eval(), []
    hidden = gpt.hidden
    gpt.hidden = lambda *a, **k: calls.append(a[0].size(1)) or hidden(*a, **k)
    out = gpt.generate(torch.zeros(1, 5, dtype=torch.long), 4)
    assert out.shape == (1, 9) and calls == [5, 1, 1, 1]                # the prompt, then one token each
    assert gpt.generate(out[:, :5], 60).shape == (1, 65)              # the last token needs no position: 64 of 64


# ==================================================================================================================
# decoding: the KV cache and the linear state's recurrent step, each pinned to a known answer

def small_pair(seed=0):
    """A random 2-layer GPT-2-family teacher (frozen, as distill.distil makes it) and its student of 4 PRF features."""
    torch.manual_seed(seed)
    cfg = model.GPTConfig(vocab_size=50, n_layer=2, n_head=2, n_kv_head=2, n_embd=16, head_dim=8, block_size=32,
                          mlp_hidden=32)
    teacher = GPT(cfg).eval().requires_grad_(False)
    return teacher, teacher.linearize([4, 4], chunk_size=8)


def test_kv_cache_is_preallocated_and_doubles_its_capacity_when_full():
    """A softmax teacher decoding 20 tokens one at a time after a 3-token prompt: its KV cache holds the prompt, then
    doubles when full (capacity 3, then 6 from the 4th token, 12 from the 7th, 24 from the 13th: a few allocations,
    not one a token), and the logits are those of one forward pass over the 23 tokens."""
    (teacher, _), idx, cache = small_pair(), torch.randint(0, 50, (1, 23)), model.Cache(2)
    with torch.no_grad():
        full, parts = teacher(idx), [teacher(idx[:, :3], cache)]
        caps = [{c["k"].size(2) for c in cache}]
        for t in range(3, 23):
            parts.append(teacher(idx[:, t:t + 1], cache))
            caps.append({c["k"].size(2) for c in cache} | {c["v"].size(2) for c in cache})
    assert caps == [{3}] + [{6}] * 3 + [{12}] * 6 + [{24}] * 11
    assert (torch.cat(parts, 1) - full).abs().max() < 1e-5


def test_kv_cache_attention_runs_without_cudnns_sdpa_and_the_full_pass_with_it(monkeypatch):
    """cuDNN's SDPA builds a plan for each new key length, which a KV cache changes every token: the cached calls
    (prefill and each decoded token) run with it disabled, the uncached pass with the caller's backends."""
    seen, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: seen.append(torch.backends.cuda.cudnn_sdp_enabled()) or sdpa(*a, **kw))
    (teacher, _), idx, cache = small_pair(), torch.randint(0, 50, (1, 6)), model.Cache(2)
    with torch.no_grad():
        full = teacher(idx)
        parts = [teacher(idx[:, :3], cache)] + [teacher(idx[:, t:t + 1], cache) for t in range(3, 6)]
    assert seen == [True] * 2 + [False] * 8 and torch.backends.cuda.cudnn_sdp_enabled()
    assert (torch.cat(parts, 1) - full).abs().max() < 1e-5


def test_linear_student_decodes_each_new_token_by_the_recurrent_step(monkeypatch):
    """GPT.generate on a linearised student: the prompt through the chunked scan once a layer, then each new token
    by linear_attention_step alone (O(1) a token, never the scan again): 2 layers, a 6-token prompt and 5 new tokens
    make 2 scans of 6 tokens and 2 x 4 steps (the last token is not fed back), and the tokens of greedy decoding by
    whole forward passes."""
    _, student = small_pair()
    prompt = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(2))
    idx = prompt
    with torch.no_grad():
        for _ in range(5):
            idx = torch.cat((idx, student(idx)[:, -1:].argmax(-1)), 1)
    scans, steps, scan, step = [], [], model.causal_linear_attention, model.linear_attention_step
    monkeypatch.setattr(model, "causal_linear_attention",
                        lambda q, *a, **k: scans.append(q.size(2)) or scan(q, *a, **k))
    monkeypatch.setattr(model, "linear_attention_step", lambda *a, **k: steps.append(1) or step(*a, **k))
    assert torch.equal(student.generate(prompt, 5), idx)
    assert scans == [6, 6] and len(steps) == 2 * 4
