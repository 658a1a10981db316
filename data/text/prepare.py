"""
Tokenize local text files into nanoGPT-style token files for distill.py (offline use, tests):

    python data/text/prepare.py --model gpt2 --out data/wikitext data/wikitext2/wiki.test.raw

writes DIR/train.bin and DIR/val.bin (uint16 token ids: np.memmap(path, dtype=np.uint16, mode="r"))
and DIR/meta.json (the tokenizer, token counts, sources). The files are joined in the order given,
with the tokenizer's end-of-text token after each one; the last --val-fraction of the tokens is the
validation split. A DIR that holds token files already is refused unless --overwrite is given.

The writer below (token_files) is shared with data/wikipedia/prepare.py: the token files are written
to <name>.tmp and renamed into place, and meta.json is written last, so a directory with a meta.json
is complete.
"""

import json
import os
import re
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# the repo root, for common.py and tokenizer.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import datafiles  # noqa: E402
import door  # noqa: E402
import files  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

# A fixed text whose ids identify a tokenizer: distill.py encodes it with the teacher's, compares.
PROBE = "Hello world! The 2 quick brown foxes jump over 13 lazy dogs.\n\n  Zürich, naïve café, 東京 — ok?"
# what token_files writes into a directory, meta.json last
FILES = ("train.bin", "val.bin", "meta.json")


def tokenizer_meta(enc, ckpt):
    """What meta.json records about the tokenizer (checked by distill.py against the teacher's)."""
    if enc.n_vocab > 65536:
        raise door.ModelError(f"the tokenizer of {ckpt} has {enc.n_vocab} tokens, more than uint16 "
                         "token files hold")
    return {"model": str(ckpt), "name": enc.name, "n_vocab": enc.n_vocab, "eot": eot_id(enc),
            "probe": PROBE, "probe_ids": enc.encode_ordinary(PROBE)}


def eot_id(enc):
    """The end-of-text id that separates documents."""
    try:
        return enc.eot_token
    except (KeyError, AttributeError):
        raise door.ModelError(f"tokenizer {enc.name} has no <|endoftext|> token to separate "
                         "documents") from None


class TokenFile:
    """An append-only uint16 token file that counts its tokens."""

    def __init__(self, path):
        self.f = open(path, "wb")
        self.n = 0

    def write(self, ids):
        a = np.asarray(ids, dtype=np.int64)
        if a.size and (a.min() < 0 or a.max() > 65535):
            raise door.ModelError(f"token id {int(a.max())} does not fit in uint16; this tokenizer "
                             "needs wider token files")
        a.astype(np.uint16).tofile(self.f)
        self.n += a.size

    def close(self):
        self.f.close()


@contextmanager
def token_files(out_dir, meta):
    """Yield {"train": TokenFile, "val": TokenFile} writing into out_dir. On success they replace
    train.bin and val.bin (an existing dataset stays intact until then) and meta.json, with the
    token counts, is written last; meta.json is removed before the renames, so a directory caught
    between them reads as incomplete. On failure, or when a split is empty, nothing is left behind;
    a second run writing into out_dir meanwhile is refused."""
    out = Path(out_dir)
    # the folders made here go again on failure
    made = [a for a in (out, *out.parents) if not a.exists()]
    out.mkdir(parents=True, exist_ok=True)
    # one writer at a time
    with files.exclusive(out / "prepare.lock", f"token files into {out_dir}", "--out"):
        try:
            with _write_splits(out, meta) as splits:
                yield splits
        except BaseException as e:
            if made:
                shutil.rmtree(made[-1], ignore_errors=True)
            # a full disk
            if isinstance(e, OSError):
                raise door.ModelError(f"writing the token files into {out_dir} failed ({e}); make room "
                                 "or pass another --out") from None
            raise


@contextmanager
def _write_splits(out, meta):
    """token_files' work: yield the TokenFiles, then rename them into place, meta.json last."""
    with files.atomic_path(out / "train.bin") as train, files.atomic_path(out / "val.bin") as val:
        splits = {"train": TokenFile(train), "val": TokenFile(val)}
        try:
            yield splits
        finally:
            for f in splits.values():
                f.close()
        empty = [s for s, f in splits.items() if f.n == 0]
        if empty:
            raise door.ModelError(f"the {' and '.join(empty)} split came out empty; give more text or "
                             "change --val-fraction")
        (out / "meta.json").unlink(missing_ok=True)
    meta.update(dtype="uint16", tokens={s: f.n for s, f in splits.items()})
    files.write_text_atomic(out / "meta.json", json.dumps(meta, indent=2) + "\n")


def check_out_dir(out, overwrite):
    """--out before any work: a folder a run can write into, holding (but with --overwrite) no token
    files of an earlier run, which a checkpoint may have been trained on."""
    files.check_out(out, FILES)
    held = [f for f in FILES if (Path(out) / f).exists()]
    if held and not overwrite:
        raise door.ModelError(f"{out} already holds token files ({', '.join(held)}); pass --overwrite "
                         "to replace them, or another --out")


def tokenize_text(enc, text, num_threads):
    """Text -> token ids, in parallel over ~1 MB pieces cut after a newline between two non-space
    characters (where the tokenizers' pre-tokenizing regexes always break, so the ids equal one
    encode_ordinary call; a piece that ended in a whitespace run would end in one token, by the
    regexes' end-of-text branch, not in several)."""
    pieces, cur, size = [], [], 0
    for part in re.split(r"(?<=\S\n)(?=\S)", text):
        cur.append(part)
        size += len(part)
        if size >= 1 << 20:
            pieces.append("".join(cur))
            cur = []
            size = 0
    pieces.append("".join(cur))
    batches = enc.encode_ordinary_batch(pieces, num_threads=num_threads)
    return [t for ids in batches for t in ids]


def read_text(fn):
    """A UTF-8 text file as it is: \r\n stays \r\n."""
    path = Path(fn)
    if not path.is_file():
        raise door.ModelError(f"{fn} is not a file; pass UTF-8 text files")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise door.ModelError(f"{fn} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to "
                         "UTF-8") from None


@dataclass
class TextConfig(door.Config):
    """Tokenize local text files into train.bin / val.bin / meta.json."""
    files: list[str] = door.opt(door.REQUIRED, "UTF-8 text files, joined in this order, each followed by an "
                           "end-of-text token")
    model: str = door.opt(door.REQUIRED, "checkpoint (hub id or directory) whose tokenizer to use, e.g. gpt2")
    out: str = door.opt(door.REQUIRED, "output directory for train.bin, val.bin and meta.json")
    val_fraction: float = door.opt(0.05, "fraction of tokens (the last ones) kept for validation",
                                   check=datafiles.check_val_fraction)
    num_threads: int = door.opt(os.cpu_count() or 1, "tokenizer threads", min=1)
    overwrite: bool = door.opt(False, "replace the token files an earlier run wrote into --out")

    def __post_init__(self):
        super().__post_init__()
        seen = set()
        # a file twice would put a copy of training text into val.bin
        for f in self.files:
            if Path(f).resolve() in seen:
                raise door.ModelError(f"{f} is listed twice; list each file once")
            seen.add(Path(f).resolve())
        check_out_dir(self.out, self.overwrite)


def prepare(cfg, enc):
    """cfg.files, tokenized with enc, -> cfg.out/train.bin, val.bin and meta.json; returns
    meta.json's content."""
    meta = {"source": "text", "files": [], "tokenizer": tokenizer_meta(enc, cfg.model),
            "val_fraction": cfg.val_fraction}
    ids = []
    for fn in cfg.files:
        ids += tokenize_text(enc, read_text(fn), cfg.num_threads) + [eot_id(enc)]
        meta["files"].append(str(Path(fn).resolve()))
    n_val = int(round(len(ids) * cfg.val_fraction))
    with token_files(cfg.out, meta) as splits:
        splits["train"].write(ids[:len(ids) - n_val])
        splits["val"].write(ids[len(ids) - n_val:])
    tokens = meta["tokens"]
    print(f"wrote {cfg.out}: {tokens['train']:,} train and {tokens['val']:,} val tokens "
          f"({enc.name}, {len(cfg.files)} file(s))")
    return meta


def main(argv=None):
    cfg = door.parse_config(TextConfig, argv)
    prepare(cfg, load_tokenizer(cfg.model))


if __name__ == "__main__":
    door.run_main(main)
