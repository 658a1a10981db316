"""The tests: every fast path against its plain reference, every loader against transformers / tokenizers,
every evaluator against the lm-evaluation-harness rules, and every kind of bad input against its message."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import model as M

ROOT = Path(__file__).resolve().parent
SHARED = ROOT.parent / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is absent (a user's clone): "
                                  "real tokenizer files, text and eval examples live there")


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
    return GPT2LMHeadModel(GPT2Config(**kw))


def hf_neox(**kw):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    return GPTNeoXForCausalLM(GPTNeoXConfig(**kw))


def hf_llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**kw))


def assert_parity(hf, path, T=64, new_tokens=20):
    """fp32 logits within 1e-4 of transformers', and greedy generation identical."""
    torch.manual_seed(1)
    m = M.GPT.from_pretrained(path)
    idx = torch.randint(0, hf.config.vocab_size, (2, T))
    with torch.no_grad():
        ref, ours = hf(idx).logits, m(idx)[0]
    assert ref.abs().max() > 1e-2                       # a non-trivial comparison
    assert (ref - ours).abs().max().item() < 1e-4
    prompt = idx[:1, :8]
    ref_gen = hf.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    assert torch.equal(ref_gen, m.generate(prompt, new_tokens, top_k=1))
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


def test_hub_layout_without_transformer_prefix(tmp_path):
    """The hub's gpt2 model.safetensors has no "transformer." prefix and no lm_head.weight."""
    from safetensors.torch import load_file, save_file
    hf = save_hf(hf_gpt2(**SMALL), tmp_path)
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
    m = M.GPT.from_pretrained(tmp_path)
    idx = torch.randint(0, 500, (2, 40))
    cache = M.Cache(m.config.n_layer)
    with torch.no_grad():
        full = m(idx)[0]
        parts = torch.cat([m(idx[:, a:b], cache=cache)[0] for a, b in [(0, 17), (17, 18), (18, 40)]], dim=1)
    assert (full - parts).abs().max() < 1e-4


# ---- bad input: one sentence naming the path, no deep traceback

def load_error(path):
    with pytest.raises(M.ModelError) as e:
        M.GPT.from_pretrained(str(path))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_missing_directory(tmp_path):
    assert "does not exist" in load_error(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    assert "config.json" in load_error(tmp_path)


def test_unsupported_model_type(tmp_path):
    save_hf(hf_gpt2(**SMALL), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "bert"}))
    msg = load_error(tmp_path)
    assert "'bert'" in msg and "gpt2, gpt_neox, llama" in msg


def test_truncated_safetensors(tmp_path):
    save_hf(hf_gpt2(**SMALL), tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:5000])
    msg = load_error(tmp_path)
    assert str(f) in msg and "truncated" in msg


def test_missing_and_unexpected_keys(tmp_path):
    from safetensors.torch import load_file, save_file
    save_hf(hf_gpt2(**SMALL), tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd["transformer.h.0.extra.weight"] = sd.pop("transformer.h.1.mlp.c_fc.weight")
    save_file(sd, tmp_path / "model.safetensors")
    msg = load_error(tmp_path)
    assert "h.1.mlp.c_fc.weight" in msg and "h.0.extra.weight" in msg


def test_hub_id_without_internet(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", "import model; model.run_main(lambda: model.GPT.from_pretrained("
                        "'EleutherAI/pythia-70m'))"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.startswith("error: could not fetch 'EleutherAI/pythia-70m'") and "Traceback" not in r.stderr
