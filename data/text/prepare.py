"""
Tokenize local text files into nanoGPT-style token files for distill.py (offline use, tests):

    python data/text/prepare.py --model gpt2 --out data/wikitext ../shared/data/text/wikitext-2-raw/wiki.test.raw

writes DIR/train.bin and DIR/val.bin (uint16 token ids, read them with np.memmap(path, dtype=np.uint16, mode="r"))
and DIR/meta.json (the tokenizer, token counts, sources). The files are joined in the order given, with the
tokenizer's end-of-text token after each one; the last --val-fraction of the tokens is the validation split.

The small writer below (TokenFile, finish) is shared with data/wikipedia/prepare.py: token files are written to
<name>.tmp and renamed into place, and meta.json is written last, so a directory with a meta.json is complete.
"""

import argparse
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root, for model.py
from common import ModelError, run_main  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

# A fixed text whose ids identify a tokenizer: distill.py re-encodes it with the teacher's tokenizer and compares.
PROBE = "Hello world! The 2 quick brown foxes jump over 13 lazy dogs.\n\n  Zürich, naïve café, 東京 — ok?"


def tokenizer_meta(enc, model):
    """What meta.json records about the tokenizer (checked by distill.py against the teacher's)."""
    if enc.n_vocab > 65536:
        raise ModelError(f"the tokenizer of {model} has {enc.n_vocab} tokens, more than uint16 token files hold")
    return {"model": str(model), "name": enc.name, "n_vocab": enc.n_vocab, "eot": eot_id(enc),
            "probe": PROBE, "probe_ids": enc.encode_ordinary(PROBE)}


def eot_id(enc):
    """The end-of-text id that separates documents."""
    try:
        return enc.eot_token
    except (KeyError, AttributeError):
        raise ModelError(f"tokenizer {enc.name} has no <|endoftext|> token to separate documents") from None


class TokenFile:
    """An append-only uint16 token file: written to <path>.tmp, moved to <path> by commit(), removed by discard()."""

    def __init__(self, path):
        self.path, self.tmp = Path(path), Path(str(path) + ".tmp")
        self.f = open(self.tmp, "wb")
        self.n = 0

    def write(self, ids):
        a = np.asarray(ids, dtype=np.int64)
        if a.size and (a.min() < 0 or a.max() > 65535):
            raise ModelError(f"token id {int(a.max())} does not fit in uint16; this tokenizer needs wider token files")
        a.astype(np.uint16).tofile(self.f)
        self.n += a.size

    def commit(self):
        self.f.close()
        os.replace(self.tmp, self.path)

    def discard(self):
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def open_dataset(out_dir, splits=("train", "val")):
    """Start writing a token dataset in out_dir -> {split: TokenFile}; an existing dataset there stays intact
    until finish() replaces it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return {s: TokenFile(out / f"{s}.bin") for s in splits}


def finish(out_dir, files, meta, ok=True):
    """Commit (ok) or discard the token files, then write meta.json atomically, last, with the token counts
    (meta.json is removed first, so a directory caught between the renames reads as incomplete)."""
    if not ok:
        for f in files.values():
            f.discard()
        return None
    empty = [s for s, f in files.items() if f.n == 0]
    if empty:
        for f in files.values():
            f.discard()
        raise ModelError(f"the {' and '.join(empty)} split came out empty; give more text or change --val-fraction")
    (Path(out_dir) / "meta.json").unlink(missing_ok=True)
    for f in files.values():
        f.commit()
    meta = dict(meta, dtype="uint16", tokens={s: f.n for s, f in files.items()})
    tmp = Path(out_dir) / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, Path(out_dir) / "meta.json")
    return meta


def tokenize_text(enc, text, num_threads):
    """Text -> token ids, in parallel over ~1 MB pieces cut after a newline that precedes a non-space character
    (where the tokenizers' pre-tokenizing regexes always break, so the ids equal one encode_ordinary call)."""
    pieces, cur, size = [], [], 0
    for part in re.split(r"(?<=\n)(?=\S)", text):
        cur.append(part)
        size += len(part)
        if size >= 1 << 20:
            pieces.append("".join(cur))
            cur, size = [], 0
    pieces.append("".join(cur))
    return [t for ids in enc.encode_ordinary_batch(pieces, num_threads=num_threads) for t in ids]


def main(argv=None):
    p = argparse.ArgumentParser(description="Tokenize local text files into train.bin / val.bin / meta.json.")
    p.add_argument("files", nargs="+", help="UTF-8 text files, joined in this order with an end-of-text token after each")
    p.add_argument("--model", required=True, help="checkpoint (hub id or directory) whose tokenizer to use, e.g. gpt2")
    p.add_argument("--out", required=True, help="output directory for train.bin, val.bin and meta.json")
    p.add_argument("--val-fraction", type=float, default=0.05, help="fraction of tokens (the last ones) kept for validation")
    p.add_argument("--num-threads", type=int, default=os.cpu_count() or 1, help="tokenizer threads")
    a = p.parse_args(argv)
    if not 0 < a.val_fraction < 1:
        raise ModelError(f"--val-fraction must be between 0 and 1, got {a.val_fraction}")
    enc = load_tokenizer(a.model)
    meta = {"source": "text", "files": [], "tokenizer": tokenizer_meta(enc, a.model), "val_fraction": a.val_fraction}
    ids = []
    for fn in a.files:
        path = Path(fn)
        if not path.is_file():
            raise ModelError(f"{fn} is not a file; pass UTF-8 text files")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ModelError(f"{fn} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8") from None
        ids += tokenize_text(enc, text, a.num_threads) + [eot_id(enc)]
        meta["files"].append(str(path.resolve()))
    n_val = int(round(len(ids) * a.val_fraction))
    files = open_dataset(a.out)
    try:
        files["train"].write(ids[:len(ids) - n_val])
        files["val"].write(ids[len(ids) - n_val:])
    except BaseException:
        finish(a.out, files, meta, ok=False)
        raise
    meta = finish(a.out, files, meta)
    print(f"wrote {a.out}: {meta['tokens']['train']:,} train and {meta['tokens']['val']:,} val tokens "
          f"({enc.name}, {len(a.files)} file(s))")


if __name__ == "__main__":
    run_main(main)
