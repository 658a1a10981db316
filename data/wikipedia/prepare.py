"""
The paper's distillation corpus: English Wikipedia, streamed from the Hugging Face hub with `datasets`, a random
fraction of its articles (the paper used 10%) tokenized with the teacher's tokenizer:

    python data/wikipedia/prepare.py --model gpt2 --fraction 0.1           # ~0.5B tokens, ~1 GB, hours
    python data/wikipedia/prepare.py --model gpt2 --max-tokens 20000000    # a quick 20M-token sample

writes train.bin / val.bin (uint16 token ids) and meta.json next to this script (or --out). Articles are kept
with probability --fraction (seeded, so the selection is reproducible), each followed by the end-of-text token;
a kept article goes to val.bin with probability --val-fraction. Tokenization runs in --num-threads threads
(tiktoken releases the GIL) while the next batch streams in. Needs internet; offline, use data/text/prepare.py.
"""

import argparse
import os
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root, for model.py and data/
from common import ModelError, run_main  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402
from data.text.prepare import eot_id, finish, open_dataset, tokenizer_meta  # noqa: E402

OFFLINE_HINT = "run it on a machine with internet access, or tokenize local text with data/text/prepare.py"


def hub_reachable():
    """Fail in a second instead of after datasets' minute of retries when the hub's host name does not resolve."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True                                  # behind a proxy DNS says nothing; let datasets try
    try:
        from huggingface_hub import constants
        host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
        socket.getaddrinfo(host, 443)
        return True
    except OSError:
        return False


def stream_articles(name, config):
    """The dataset's train split as a stream of article texts, or a one-sentence error when it cannot be reached."""
    import datasets
    what = f"{name} ({config})"
    if not hub_reachable():
        raise ModelError(f"cannot reach the Hugging Face hub to stream {what}; {OFFLINE_HINT}")
    try:
        ds = datasets.load_dataset(name, config, split="train", streaming=True)
        it = iter(ds)
        first = next(it)
    except Exception as e:
        raise ModelError(f"could not stream {what} from the Hugging Face hub ({type(e).__name__}); {OFFLINE_HINT}") from None
    if "text" not in first:
        raise ModelError(f"{what} has no 'text' column (columns: {', '.join(first)}); pass a Wikipedia-style dataset")
    total = None
    try:
        total = ds.info.splits["train"].num_examples
    except Exception:
        pass

    def texts():
        yield first["text"]
        for row in it:
            yield row["text"]
    return texts(), total


def main(argv=None):
    p = argparse.ArgumentParser(description="Stream English Wikipedia, tokenize a random fraction of it into "
                                            "train.bin / val.bin / meta.json.")
    p.add_argument("--model", default="gpt2", help="checkpoint (hub id or directory) whose tokenizer to use")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent), help="output directory (default: this folder)")
    p.add_argument("--dataset", default="wikimedia/wikipedia", help="hub dataset with a 'text' column")
    p.add_argument("--config", default="20231101.en", help="dataset configuration (the dump date and language)")
    p.add_argument("--fraction", type=float, default=0.1, help="keep each article with this probability (paper: 0.1)")
    p.add_argument("--max-tokens", type=int, default=0, help="stop after this many tokens in all (0: no cap)")
    p.add_argument("--val-fraction", type=float, default=0.005, help="probability that a kept article goes to val.bin")
    p.add_argument("--seed", type=int, default=0, help="seed of the article selection and the train/val split")
    p.add_argument("--num-threads", type=int, default=os.cpu_count() or 1, help="tokenizer threads")
    p.add_argument("--batch-docs", type=int, default=512, help="articles tokenized per batch")
    a = p.parse_args(argv)
    if not 0 < a.fraction <= 1:
        raise ModelError(f"--fraction must be in (0, 1], got {a.fraction}")
    if not 0 < a.val_fraction < 1:
        raise ModelError(f"--val-fraction must be between 0 and 1, got {a.val_fraction}")
    if a.max_tokens < 0:
        raise ModelError(f"--max-tokens must be 0 (no cap) or positive, got {a.max_tokens}")
    from tqdm import tqdm

    enc = load_tokenizer(a.model)
    eot = eot_id(enc)
    texts, total = stream_articles(a.dataset, a.config)
    rng = np.random.default_rng(a.seed)
    meta = {"source": "wikipedia", "dataset": a.dataset, "config": a.config, "fraction": a.fraction,
            "max_tokens": a.max_tokens, "val_fraction": a.val_fraction, "seed": a.seed,
            "tokenizer": tokenizer_meta(enc, a.model)}
    files = open_dataset(a.out)
    n_docs = n_kept = n_tok = 0
    bar = tqdm(total=total, unit="doc", desc="wikipedia", smoothing=0.05)
    try:
        done = False
        while not done:
            batch = []
            for text in texts:
                n_docs += 1
                if rng.random() < a.fraction:       # one draw per article, kept or not: reproducible selection
                    batch.append(text)
                if len(batch) == a.batch_docs:
                    break
            else:
                done = True
            bar.update(n_docs - bar.n)
            to_val = rng.random(len(batch)) < a.val_fraction
            for ids, v in zip(enc.encode_ordinary_batch(batch, num_threads=a.num_threads), to_val):
                files["val" if v else "train"].write(ids + [eot])
                n_tok += len(ids) + 1
                n_kept += 1
                if a.max_tokens and n_tok >= a.max_tokens:
                    done = True
                    break
            bar.set_postfix(kept=n_kept, tokens=f"{n_tok / 1e6:.1f}M")
    except BaseException:
        bar.close()
        finish(a.out, files, meta, ok=False)
        raise
    bar.close()
    meta = finish(a.out, files, dict(meta, articles_seen=n_docs, articles_kept=n_kept))
    print(f"wrote {a.out}: {meta['tokens']['train']:,} train and {meta['tokens']['val']:,} val tokens from "
          f"{n_kept:,} of {n_docs:,} articles ({enc.name})")


if __name__ == "__main__":
    run_main(main)
