"""The passkey retrieval test (Mohtashami and Jaggi 2023, "Landmark Attention"; LongLoRA's prompt),
which a learner may skip: a random key hidden at a random depth in filler text and asked for at the
end, recalled when the first number the model decodes greedily is the key.

    accuracy = (1/n) Σ_t [first number decoded after prompt t = key t],  stderr = stdev / √n
"""

import bisect
import math
import random
import re
import statistics

import torch
from tqdm import tqdm

import devices
import door

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
        "them. I will quiz you about the important information there.")
FILLER = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again."]
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
DIGITS = 5       # keys 10000..99999
NEW_TOKENS = 8   # tokens decoded greedily after the prompt: the key's and a margin
BUCKETS = 5      # trial t's depth lies in bucket t % 5 of [0, 1)


def prompt_text(key: int, depth: float, n: int) -> str:
    """The prompt with n filler sentences, floor(depth · n) of them before the needle; each side
    of the needle starts the filler anew, as LongLoRA's does."""
    before = math.floor(depth * n)
    filler = [FILLER[i % len(FILLER)] for i in range(n)]
    return "\n".join([TASK, " ".join(filler[:before]), NEEDLE.format(key=key),
                      " ".join(filler[:n - before]), QUESTION])


def fit(enc, key: int, depth: float, length: int) -> list[int] | None:
    """The tokens of the prompt with the most filler sentences that is at most `length` tokens
    long; None where even the prompt without filler is longer."""
    count = lambda n: len(enc.encode_ordinary(prompt_text(key, depth, n)))  # noqa: E731
    # the first n whose prompt is too long (the count rises with n), less one
    n = bisect.bisect_right(range(length + 1), length, key=count) - 1
    return enc.encode_ordinary(prompt_text(key, depth, n)) if n >= 0 else None


def shortest(enc) -> int:
    """The tokens of the prompt without filler whose key takes the most tokens: the shortest
    length that holds every key."""
    keys = range(10 ** (DIGITS - 1), 10 ** DIGITS)
    worst = max(keys, key=lambda k: len(enc.encode_ordinary(NEEDLE.format(key=k))))
    return len(enc.encode_ordinary(prompt_text(worst, 0.0, 0)))


def check_lengths(text: str | None) -> str | None:
    """What is wrong with --passkey's lengths, or None: comma-separated positive whole numbers."""
    parts = [s.strip() for s in (text or "1").split(",")]
    if not all(re.fullmatch(r"[0-9]+", s) and int(s) > 0 for s in parts):
        return (f"--passkey must be prompt lengths in tokens, positive whole numbers separated by "
                f"commas (e.g. 256,512,1024), got {text!r}")
    return None


def lengths(text: str | None) -> list[int]:
    """--passkey's lengths, repeats dropped; [] without --passkey."""
    return list(dict.fromkeys(int(s) for s in text.split(","))) if text else []


def make_trials(enc, lengths: list[int], cfg, block_size: int) -> dict:
    """{length: [{"depth", "key", "tokens"}, ...]}: --passkey-trials trials a length, each key and
    depth drawn from its own seed (--seed, length, trial). A ModelError, before any work, where a
    length plus the decoded tokens exceeds the context, or cannot hold the prompt without filler."""
    largest = block_size - NEW_TOKENS
    for length in lengths:
        if length > largest:
            raise door.ModelError(f"--passkey {length} is more than the model's context of "
                                  f"{block_size} tokens holds with the {NEW_TOKENS} tokens "
                                  f"decoded after the prompt; pass lengths of at most {largest}")
    trials = {length: [] for length in lengths}
    for length in lengths:
        for t in range(cfg.passkey_trials):
            rng = random.Random(f"{cfg.seed} {length} {t}")
            key = rng.randint(10 ** (DIGITS - 1), 10 ** DIGITS - 1)
            depth = (t % BUCKETS + rng.random()) / BUCKETS
            tokens = fit(enc, key, depth, length)
            if tokens is None:
                least = shortest(enc)
                raise door.ModelError(f"--passkey {length} is too short to hold the task, the key "
                                      f"and the question; pass lengths of at least {least}")
            trials[length].append({"depth": depth, "key": key, "tokens": tokens})
    return trials


def first_number(text: str) -> str:
    """The first run of digits in text ("" where there is none)."""
    m = re.search(r"[0-9]+", text)
    return m.group() if m else ""


@torch.inference_mode()
def answers(lm, enc, prompts: list, batch_size: int, device, desc=None) -> list[str]:
    """The first number in the NEW_TOKENS tokens that greedy decoding writes after each prompt (a
    list of tokens), prompts batched only with prompts of their own length (no padding); under
    torchrun each process decodes a share and all get every answer."""
    by_length = {}
    for i in devices.shard(list(range(len(prompts)))):
        by_length.setdefault(len(prompts[i]), []).append(i)
    batches = [group[s:s + batch_size] for group in by_length.values()
               for s in range(0, len(group), batch_size)]
    decoded = {}
    for batch in tqdm(batches, desc=desc, disable=desc is None, unit="batch", leave=False):
        x = torch.tensor([prompts[i] for i in batch], device=device)          # (B, T)
        new = lm.generate(x, NEW_TOKENS)[:, x.size(1):]                       # (B, NEW_TOKENS)
        for i, row in zip(batch, new.tolist()):
            decoded[i] = enc.decode(row)
    decoded = {i: text for share in devices.all_gather(decoded) for i, text in share.items()}
    return [first_number(decoded[i]) for i in range(len(prompts))]


def result(trials: list[dict], found: list[str]) -> dict:
    """One length's accuracy, its stderr (sample stdev over √n; None for n < 2), the accuracy in
    each depth bucket, and each trial."""
    rows = [{"depth": t["depth"], "key": t["key"], "answer": a, "correct": a == str(t["key"])}
            for t, a in zip(trials, found)]
    xs = [float(r["correct"]) for r in rows]
    by_depth = {}
    for b in range(BUCKETS):
        ys = [x for x, r in zip(xs, rows) if math.floor(r["depth"] * BUCKETS) == b]
        if ys:
            by_depth[f"{b / BUCKETS:.1f}"] = {"accuracy": sum(ys) / len(ys), "n": len(ys)}
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else None
    return {"accuracy": sum(xs) / len(xs), "stderr": se, "n": len(xs), "by_depth": by_depth,
            "trials": rows}


def print_table(label: str, results: dict):
    """A model's accuracy and stderr by length, and its accuracy by depth bucket."""
    buckets = [f"{b / BUCKETS:.1f}" for b in range(BUCKETS)]
    print(f"passkey {label}: accuracy by prompt length, and by the key's depth")
    head = f"{'length':>7} {'n':>4} {'accuracy':>8} {'stderr':>6} |"
    print(head + "".join(f" {b:>4}" for b in buckets))
    for length, r in results.items():
        se = "-" if r["stderr"] is None else f"{r['stderr']:.3f}"
        cells = [r["by_depth"].get(b) for b in buckets]
        depths = "".join(" " + ("   -" if c is None else f"{c['accuracy']:.2f}") for c in cells)
        print(f"{length:>7} {r['n']:>4} {r['accuracy']:>8.3f} {se:>6} |{depths}")


def run(models: dict, enc, trials: dict, cfg, device) -> dict:
    """Every model's results, {label: {str(length): result}}, and the settings; a table a model."""
    out = {"settings": {"trials": cfg.passkey_trials, "digits": DIGITS, "seed": cfg.seed,
                        "new_tokens": NEW_TOKENS, "depth_buckets": BUCKETS}}
    for label, m in models.items():
        out[label] = {}
        for length, ts in trials.items():
            desc = f"{label} passkey {length}" if devices.is_main() else None
            found = answers(m, enc, [t["tokens"] for t in ts], cfg.batch_size, device, desc)
            out[label][str(length)] = result(ts, found)
        if devices.is_main():
            print_table(label, out[label])
    return out
