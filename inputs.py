"""distill.py's inputs checked at the door, which a learner may skip: the token files of --data
(prepared on first use, then checked against the teacher's tokenizer), the memory a step needs."""

import functools
import importlib.util
from pathlib import Path

import numpy as np

import common
import dof


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
    common.check_out(d, script.FILES, "--data")
    source = ", ".join(p.name for p in texts) or f"{cfg.wiki_tokens:,} Wikipedia tokens"
    print(f"preparing {d} from {source}")
    if texts:
        prepare = script.TextConfig(texts, cfg.model, cfg.data, cfg.val_fraction)
    else:
        prepare = script.WikipediaConfig(cfg.model, cfg.data, fraction=1.0,
                                         max_tokens=cfg.wiki_tokens,
                                         val_fraction=cfg.val_fraction, seed=cfg.seed)
    script.prepare(prepare, enc)


def open_data(cfg, enc, vocab_size):
    """--data's token files {"train", "val"} and meta.json, checked against the teacher's
    tokenizer; prepared first by rank 0 if it has none (meta.json is written last: it marks a
    whole folder)."""
    d, again = Path(cfg.data), "delete its train.bin, val.bin and meta.json to prepare them again"
    if common.is_main() and not (d / "meta.json").is_file():
        if d.exists() and not d.is_dir():
            raise common.ModelError(f"--data {cfg.data} is a file; pass a directory")
        if any((d / f).exists() for f in ("train.bin", "val.bin")):
            raise common.ModelError(f"{cfg.data} holds token files but no meta.json, which "
                                    f"prepare.py writes last; {again}")
        prepare_data(cfg, enc)
    # the others wait while rank 0 prepares
    common.barrier()
    meta = common.check_tokenizer(d, enc, f"the teacher {cfg.model}", again, need=True)
    data = {s: common.read_tokens(d / f"{s}.bin", vocab_size=vocab_size,
                                  min_tokens=cfg.block_size + 1) for s in ("train", "val")}
    return data, meta


def check_memory(cfg, mc, device, dims=None, direct=False):
    """Refuse a step that cannot fit, before anything large is allocated (floats, roughly);
    direct: the next-token loss, whose backward pass runs through the whole student."""
    B, T, H, L, C = cfg.batch_size, cfg.block_size, mc.n_head, mc.n_layer, mc.n_embd
    if dims is None and cfg.dims:
        dims = dof.parse_dims(cfg.dims, L)
    M = int(np.max(dims or 4 * cfg.budget))                               # DoF dims reach 4 C
    # the attention rows of a layer_losses block
    rows = H * min(cfg.query_block or 128, T)
    if device.startswith("cuda") and cfg.stack != "no":
        rows = min(L * H * T, 2 ** 26 // (B * T))
    # every layer's q and k, the rows, the features, the activations
    floats = B * T * (L * (H + mc.n_kv_head) * mc.head_dim + 6 * rows + 4 * H * M + 8 * C)
    if direct:
        floats += 16 * L * B * T * C + 2 * B * T * mc.vocab_size
    # the batches of int64 tokens
    floats += 2 * (cfg.calib_batches + cfg.eval_iters) * B * (T + 1)
    what = (f"a step of --batch-size {B} x --block-size {T} with up to {M:,} features a head (and "
            f"{cfg.calib_batches} calibration and {cfg.eval_iters} validation batches)")
    todo = ("lower --batch-size (--grad-accum keeps the batch), --block-size, the dims or those "
            "batches")
    common.check_free_memory(4 * floats, device, what, todo)
