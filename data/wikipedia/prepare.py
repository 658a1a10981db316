"""
The paper's distillation corpus: English Wikipedia, streamed from the Hugging Face hub with
`datasets`, a random fraction of its articles (the paper used 10%) tokenized with the teacher's
tokenizer:

    python data/wikipedia/prepare.py --model gpt2 --fraction 0.1        # ~0.5B tokens, ~1 GB, hours
    python data/wikipedia/prepare.py --model gpt2 --max-tokens 20000000 # a quick 20M-token sample

writes train.bin / val.bin (uint16 token ids) and meta.json next to this script (or --out; one that
holds token files already only with --overwrite). Articles are kept with probability --fraction
(seeded, so the selection is reproducible), each followed by the end-of-text token; a kept article
goes to val.bin with probability --val-fraction. Tokenization runs in --num-threads threads
(tiktoken releases the GIL), a batch of articles at a time. Needs internet; offline, use
data/text/prepare.py.
"""

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

# the repo root, for common.py, tokenizer.py and data/
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import datafiles  # noqa: E402
import door  # noqa: E402
from checkpoint import HubUnreachable, hub_reachable  # noqa: E402

# FILES: what this script writes, as distill.py reads it from either prepare.py
from data.text.prepare import FILES, check_out_dir, eot_id, token_files, tokenizer_meta  # noqa: E402,F401
from tokenizer import load_tokenizer  # noqa: E402

OFFLINE_HINT = "run it on a machine with internet access, or tokenize local text with " \
               "data/text/prepare.py"


def stream_articles(name, config):
    """The dataset's train split as a stream of article texts, or a one-sentence error when it
    cannot be reached."""
    what = f"{name} ({config})"
    # fail at once, not after datasets' minute of retries
    if not hub_reachable():
        raise HubUnreachable(what, OFFLINE_HINT)
    import datasets
    try:
        ds = datasets.load_dataset(name, config, split="train", streaming=True)
        it = iter(ds)
        first = next(it)
    except Exception as e:
        why = f"{type(e).__name__}: {str(e)[:80]}"
        raise door.ModelError(f"could not stream {what} from the Hugging Face hub ({why}); "
                         f"{OFFLINE_HINT}") from None
    if "text" not in first:
        raise door.ModelError(f"{what} has no 'text' column (columns: {', '.join(first)}); pass a "
                         "Wikipedia-style dataset")
    total = None
    try:
        total = ds.info.splits["train"].num_examples
    except Exception:
        pass

    def texts():
        yield first["text"]
        try:
            for row in it:
                yield row["text"]
        # the connection broke mid-stream
        except Exception as e:
            why = f"{type(e).__name__}: {str(e)[:80]}"
            raise door.ModelError(f"the stream of {what} broke ({why}); run it again, the previous "
                             "token files are as they were") from None
    return texts(), total


def kept_batches(texts, rng, fraction, batch_docs):
    """Keep each article with probability `fraction` (one draw per article, kept or not: a
    reproducible selection); yields (up to batch_docs kept articles, the articles seen up to each of
    them, articles seen so far)."""
    batch = []
    upto = []
    seen = 0
    for text in texts:
        seen += 1
        if rng.random() < fraction:
            batch.append(text)
            upto.append(seen)
        if len(batch) == batch_docs:
            yield batch, upto, seen
            batch = []
            upto = []
    yield batch, upto, seen


def write_articles(cfg, enc, texts, splits, bar):
    """Tokenize the kept articles, each followed by end-of-text, into files["train"] or, with
    probability cfg.val_fraction, files["val"]; stop once cfg.max_tokens are written. The bar counts
    tokens towards cfg.max_tokens, or articles without it. -> (articles seen, articles kept)."""
    # two streams: alike whatever --batch-docs is
    keep_rng, val_rng = np.random.default_rng(cfg.seed).spawn(2)
    eot = eot_id(enc)
    n_seen = 0
    n_kept = 0
    n_tok = 0
    for batch, upto, n_seen in kept_batches(texts, keep_rng, cfg.fraction, cfg.batch_docs):
        to_val = val_rng.random(len(batch)) < cfg.val_fraction
        encoded = enc.encode_ordinary_batch(batch, num_threads=cfg.num_threads)
        for ids, v, seen in zip(encoded, to_val, upto):
            splits["val" if v else "train"].write(ids + [eot])
            n_tok += len(ids) + 1
            n_kept += 1
            if cfg.max_tokens and n_tok >= cfg.max_tokens:
                # the articles seen up to this one, not the rest of the batch
                n_seen = seen
                break
        bar.update((n_tok if cfg.max_tokens else n_seen) - bar.n)
        bar.set_postfix(kept=n_kept, tokens=f"{n_tok / 1e6:.1f}M")
        if cfg.max_tokens and n_tok >= cfg.max_tokens:
            break
    return n_seen, n_kept


@dataclass
class WikipediaConfig(door.Config):
    """Stream English Wikipedia, tokenize a random fraction of it into train.bin / val.bin /
    meta.json."""
    model: str = door.opt("gpt2", "checkpoint (hub id or directory) whose tokenizer to use")
    out: str = door.opt(str(Path(__file__).resolve().parent), "output directory for train.bin, val.bin "
                   "and meta.json")
    dataset: str = door.opt("wikimedia/wikipedia", "hub dataset with a 'text' column")
    config: str = door.opt("20231101.en", "dataset configuration (the dump date and language)")
    fraction: float = door.opt(0.1, "keep each article with this probability (paper: 0.1)")
    max_tokens: int = door.opt(0, "stop after this many tokens in all (0: no cap)", min=0)
    val_fraction: float = door.opt(0.005, "probability that a kept article goes to val.bin",
                                   check=datafiles.check_val_fraction)
    seed: int = door.opt(0, "seed of the article selection and the train/val split", min=0)
    num_threads: int = door.opt(os.cpu_count() or 1, "tokenizer threads", min=1)
    batch_docs: int = door.opt(512, "articles tokenized per batch", min=1)
    overwrite: bool = door.opt(False, "replace the token files an earlier run wrote into --out")

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.fraction <= 1:
            raise door.ModelError(f"--fraction must be in (0, 1], got {self.fraction}")
        if not self.dataset.strip() or not self.config.strip():
            raise door.ModelError("--dataset and --config must name a hub dataset and its "
                             "configuration, e.g. wikimedia/wikipedia and 20231101.en")
        check_out_dir(self.out, self.overwrite)


def prepare(cfg, enc):
    """The articles cfg selects, tokenized with enc, -> cfg.out/train.bin, val.bin and meta.json;
    returns meta.json's content."""
    texts, total = stream_articles(cfg.dataset, cfg.config)
    meta = {"source": "wikipedia", "dataset": cfg.dataset, "config": cfg.config,
            "fraction": cfg.fraction, "max_tokens": cfg.max_tokens,
            "val_fraction": cfg.val_fraction, "seed": cfg.seed,
            "tokenizer": tokenizer_meta(enc, cfg.model)}
    # towards --max-tokens, or over the articles
    unit = "token" if cfg.max_tokens else "doc"
    bar = tqdm(total=cfg.max_tokens or total, unit=unit, desc="wikipedia", smoothing=0.05)
    with token_files(cfg.out, meta) as splits, bar:
        n_seen, n_kept = write_articles(cfg, enc, texts, splits, bar)
        meta.update(articles_seen=n_seen, articles_kept=n_kept)
    tokens = meta["tokens"]
    print(f"wrote {cfg.out}: {tokens['train']:,} train and {tokens['val']:,} val tokens from "
          f"{n_kept:,} of {n_seen:,} articles ({enc.name})")
    return meta


def main(argv=None):
    cfg = door.parse_config(WikipediaConfig, argv)
    prepare(cfg, load_tokenizer(cfg.model))


if __name__ == "__main__":
    door.run_main(main)
