"""
evaluate.py: zero-shot multiple-choice accuracy scored exactly as lm-evaluation-harness 0.4 scores it, next-token
loss / perplexity on a token or text file, and prefill / decoding speed; for teachers and distilled students alike.

    python evaluate.py --model gpt2 --tasks piqa,arc_easy --data-dir tests/data/eval --output results.json
    python evaluate.py --model gpt2 --tasks piqa --data-dir tests/data/eval --plain  # one request at a time
    python evaluate.py --model gpt2 --ckpt out/gpt2 --data-dir tests/data/eval      # teacher | student table
    python evaluate.py --model gpt2 --ppl data/wikitext2/wiki.test.raw
    python evaluate.py --model gpt2 --ckpt out/gpt2 --speed
    python evaluate.py --model gpt2 --data-dir tests/data/eval --limit 50 --bench
    torchrun --nproc_per_node 4 evaluate.py --model gpt2 --data-dir tests/data/eval --output results.json

Under torchrun each process scores a share of every task's documents (and of the --ppl windows), the shares are
gathered, and rank 0 writes the results.json one process writes, plus world_size; --bench and --speed run on rank 0.

How the harness scores one multiple-choice document, and so how this file does (the harness files are
lm_eval/tasks/<task>/*.yaml, lm_eval/api/task.py, lm_eval/api/model.py, lm_eval/models/huggingface.py,
lm_eval/api/metrics.py):
 1. prompt: the task's doc_to_text / doc_to_choice / doc_to_target; here one short function per task.
 2. requests: one (context, continuation) pair per choice, continuation = " " + choice (target_delimiter " ").
    Winogrande and WSC273 are "multiple input" tasks: each choice goes into the context, and the continuation,
    the rest of the sentence, is the same for both.
 3. tokens (_encode_pair): trailing whitespace of the context is moved onto the continuation, then
    continuation tokens = tokens(context + continuation)[len(tokens(context)):]. No BOS token.
 4. window (_loglikelihood_tokens): the model is fed (context + continuation)[-(L+1):][:-1], i.e. left-truncated to
    the context length L with the last token dropped; the last len(continuation) positions predict the
    continuation, and the log-likelihood is the sum of their log-probabilities.
 5. metrics (process_results, mean_stderr): acc = [argmax of the log-likelihoods == gold] (np.argmax: ties go to
    the first); acc_norm = the same after dividing each log-likelihood by len(choice) in characters (the choice
    text, without the " " delimiter); both averaged over documents, stderr = sample stdev (n - 1) / sqrt(n).
    MMLU is a group of 57 subject tasks: acc is pooled over all questions (weight_by_size) and its stderr is the
    harness's pooled_sample_stderr of the per-subject stderrs.
Steps 3-5 for one document are the section "One document, the harness way": one full forward pass per request,
which --plain runs. By default fast_scorer.py computes the same log-likelihoods with less work (shared prefixes,
batched rows, the LM head only where a token is scored).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from common import (ModelError, all_gather, get_rank, get_world_size, init_distributed, is_main, opt, parse_config,
                    pick_device, read_tokens, run_main, shard, sync, write_text_atomic)
from fast_scorer import score_windows
from model import GPT, load_student
from tokenizer import load_tokenizer

ALL_TASKS = ("piqa", "arc_easy", "arc_challenge", "logiqa", "mmlu", "winogrande", "wsc273")


@dataclass
class EvalConfig:
    # what to evaluate
    model: str = opt("gpt2", "teacher model: a hub id or a local checkpoint directory (GPT.from_pretrained)")
    ckpt: str | None = opt(None, "distill.py checkpoint directory; its student is evaluated next to the teacher")
    tasks: str | None = opt(None, "comma-separated tasks, or 'all'; if not given, all seven unless --ppl or --speed "
                                  "is: " + ",".join(ALL_TASKS))
    limit: int | None = opt(None, "score only the first N documents of each task (for MMLU the first N questions of "
                                  "the file; the harness's --limit takes N per subject)")
    data_dir: str | None = opt(None, "folder holding <task>.jsonl in the Hugging Face schema "
                                     "(e.g. tests/data/eval); default: load the harness's datasets from the hub")
    output: str | None = opt(None, "write results and per-document samples to this JSON file")
    # how
    batch_size: int = opt(16, "sequences per forward pass")
    device: str = opt("auto", "torch device: auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    dtype: str = opt("float32", "model dtype (log-softmax is always float32)",
                     choices=["float32", "bfloat16", "float16"])
    plain: bool = opt(False, "score every request the plain harness way, one full forward pass each (slow); the "
                             "default shared-prefix scorer (fast_scorer.py) gives the same numbers")
    # other measurements
    ppl: str | None = opt(None, "next-token loss and perplexity on a uint16 .bin token file or a text file")
    ppl_context: int | None = opt(None, "window length for --ppl; if not given, the model's context length")
    ppl_max_tokens: int | None = opt(None, "score only the first N tokens of the --ppl file")
    speed: bool = opt(False, "time prefill and token-by-token generation of one sequence (teacher vs student)")
    speed_tokens: int = opt(1000, "sequence length for --speed")
    bench: bool = opt(False, "time the fast scorer against the model's plain forward pass on the same tokens")
    bench_rounds: int = opt(1, "--bench keeps the fastest of this many alternating rounds (for noisy timings)")


# --------------------------------------------------------------------------------------------------------------
# Tasks: one prompt function each, returning the harness's requests for one document.

@dataclass
class Prompt:
    requests: list[tuple[str, str]]  # (context, continuation), one per choice
    gold: int                        # index of the right request
    choices: list[str] | None        # choice texts whose lengths normalise acc_norm; None: the task has no acc_norm
    group: str | None = None         # MMLU subject (the harness's group stderr pools per-subject stderrs)


class BadDoc(ValueError):
    """A document that does not fit its task's schema (the loader adds the file and line)."""


def _index(options, value, what: str) -> int:
    options = list(options)
    if value not in options:
        raise BadDoc(f"{what} {value!r} is not one of its choices {options}")
    return options.index(value)


def piqa(doc) -> Prompt:  # lm_eval/tasks/piqa/piqa.yaml
    context = f"Question: {doc['goal']}\nAnswer:"
    choices = [doc["sol1"], doc["sol2"]]
    return Prompt([(context, " " + c) for c in choices], _index(range(2), doc["label"], "label"), choices)


def arc(doc) -> Prompt:  # lm_eval/tasks/arc/arc_easy.yaml (arc_challenge includes it)
    choices, labels = list(doc["choices"]["text"]), list(doc["choices"]["label"])
    if len(choices) != len(labels):
        raise BadDoc(f"choices has {len(choices)} texts but {len(labels)} labels")
    context = f"Question: {doc['question']}\nAnswer:"
    return Prompt([(context, " " + c) for c in choices], _index(labels, doc["answerKey"], "answerKey"), choices)


def logiqa(doc) -> Prompt:  # lm_eval/tasks/logiqa/utils_logiqa.py
    choices = list(doc["options"])
    context = "Passage: " + doc["context"] + "\n" + "Question: " + doc["question"] + "\nChoices:\n"
    for letter, option in zip("ABCD", choices):
        context += f"{letter}. {option}\n"
    context += "Answer:"
    gold = _index(["a", "b", "c", "d"][:len(choices)], doc["label"].strip(), "label")
    return Prompt([(context, " " + c) for c in choices], gold, choices)


def mmlu(doc) -> Prompt:  # lm_eval/tasks/mmlu/default/_default_template_yaml + mmlu_<subject>.yaml's description
    c = list(doc["choices"])
    if len(c) != 4:
        raise BadDoc(f"choices has {len(c)} entries, MMLU's prompt needs 4")
    subject = doc["subject"]
    context = (f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
               f"{doc['question'].strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:")
    return Prompt([(context, " " + letter) for letter in "ABCD"], _index(range(4), doc["answer"], "answer"),
                  None, group=subject)


def winogrande(doc) -> Prompt:  # lm_eval/tasks/winogrande/preprocess_winogrande.py
    sentence = doc["sentence"]
    if "_" not in sentence:
        raise BadDoc("sentence has no '_' blank")
    i = sentence.index("_")
    continuation = " " + sentence[i + 1:].strip()
    requests = [(sentence[:i] + option, continuation) for option in (doc["option1"], doc["option2"])]
    return Prompt(requests, _index(["1", "2"], doc["answer"], "answer"), None)


_UPPER_PRONOUNS = ["A", "An", "The", "She", "He", "It", "They", "My", "His", "Her", "Their"]


def wsc273(doc) -> Prompt:  # lm_eval/tasks/wsc273/default.yaml + utils.py
    text = doc["text"].replace("  ", " ")  # process_doc; pronoun_loc is left as it was, as the harness does
    loc, pronoun = doc["pronoun_loc"], doc["pronoun"]
    if len(doc["options"]) != 2:
        raise BadDoc(f"options has {len(doc['options'])} entries, WSC273 needs 2")

    def normalize(option):  # utils.__normalize_option
        if pronoun.lower() in ["my", "his", "her", "our", "their"]:
            option += "'s"
        first = option.split()[0]
        if text[loc - 2] != "." and first in _UPPER_PRONOUNS:  # not at the start of a sentence: lowercase
            return option.replace(first, first.lower())
        return option

    continuation = " " + text[loc + len(pronoun):]  # the target is not stripped: it keeps its own leading space
    requests = [(text[:loc] + normalize(o), continuation) for o in doc["options"]]
    return Prompt(requests, _index(range(2), doc["label"], "label"), None)


@dataclass(frozen=True)
class Task:
    prompt: Callable[[dict], Prompt]
    fields: tuple[str, ...]           # fields every document must have
    hub: tuple[str, str | None, str]  # datasets.load_dataset(path, name, split=split), as lm-eval 0.4 loads it


TASKS = {
    "piqa": Task(piqa, ("goal", "sol1", "sol2", "label"), ("baber/piqa", None, "validation")),
    "arc_easy": Task(arc, ("question", "choices", "answerKey"), ("allenai/ai2_arc", "ARC-Easy", "test")),
    "arc_challenge": Task(arc, ("question", "choices", "answerKey"), ("allenai/ai2_arc", "ARC-Challenge", "test")),
    "logiqa": Task(logiqa, ("label", "context", "question", "options"), ("EleutherAI/logiqa", "logiqa", "test")),
    # the harness loads the 57 subject configs one by one; "all" holds the same questions in one split
    "mmlu": Task(mmlu, ("question", "subject", "choices", "answer"), ("cais/mmlu", "all", "test")),
    "winogrande": Task(winogrande, ("sentence", "option1", "option2", "answer"),
                       ("allenai/winogrande", "winogrande_xl", "validation")),
    "wsc273": Task(wsc273, ("text", "pronoun", "pronoun_loc", "options", "label"),
                   ("lighteval/winograd_wsc", "wsc273", "test")),
}


def parse_tasks(spec: str | None) -> list[str]:
    if spec is None or spec.strip() == "all":
        return list(ALL_TASKS)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    for name in names:
        if name not in TASKS:
            raise ModelError(f"unknown task '{name}'; known tasks: {', '.join(ALL_TASKS)} (or 'all')")
    if not names:
        raise ModelError(f"--tasks is empty; known tasks: {', '.join(ALL_TASKS)} (or 'all')")
    return names


def _read_docs(name: str, data_dir: str | None) -> tuple[list[tuple[str, dict]], str]:
    """The task's raw documents in file order, each with where it is ('line 7'), and the source's name."""
    if data_dir is not None:
        path = Path(data_dir) / f"{name}.jsonl"
        if not path.is_file():
            raise ModelError(f"{path} does not exist: --data-dir must hold a {name}.jsonl "
                             f"(tests/data/eval has one per task)")
        docs = []
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    docs.append((f"line {line_no}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ModelError(f"{path} line {line_no} is not valid JSON ({e.msg})") from None
        return docs, str(path)
    path, config, split = TASKS[name].hub
    try:
        import datasets
        ds = datasets.load_dataset(path, config, split=split)
        rows = [(f"row {i}", dict(doc)) for i, doc in enumerate(ds)]
    except Exception as e:  # offline, or the hub changed
        raise ModelError(f"could not load {name} from the Hugging Face hub (datasets.load_dataset({path!r}, "
                         f"{config!r}, split={split!r}) failed with {type(e).__name__}); without internet pass "
                         f"--data-dir DIR holding {name}.jsonl (tests/data/eval has one)") from None
    if name == "logiqa" and rows and "context" not in rows[0][1] and "text" in rows[0][1]:
        rows = _logiqa_from_text(rows)
    return rows, f"{path} ({config}, {split})"


def _logiqa_from_text(rows):
    """Newer copies of EleutherAI/logiqa hold the raw release files; parse them as the harness's process_docs."""
    docs = []
    for _, row in rows:
        for record in row["text"].strip().split("\n\n"):
            lines = record.split("\n")
            fix = lambda s: s.replace(".", ". ").strip()  # noqa: E731
            docs.append({"label": lines[0].strip(), "context": fix(lines[1]), "question": fix(lines[2]),
                         "options": [fix(o[2:]) for o in lines[3:]]})
    return [(f"record {i}", d) for i, d in enumerate(docs)]


def load_task(name: str, data_dir: str | None = None, limit: int | None = None) -> list[Prompt]:
    """Every document of a task checked and turned into its prompt; the first `limit` of them returned."""
    task = TASKS[name]
    docs, source = _read_docs(name, data_dir)
    if not docs:
        raise ModelError(f"{source} holds no documents")
    prompts = []
    for where, doc in docs:
        if not isinstance(doc, dict):
            raise ModelError(f"{source} {where}: a document must be a JSON object, not {type(doc).__name__}")
        missing = [f for f in task.fields if f not in doc]
        if missing:
            raise ModelError(f"{source} {where}: document has no field {', '.join(map(repr, missing))} "
                             f"({name} needs {', '.join(task.fields)})")
        try:
            prompts.append(task.prompt(doc))
        except BadDoc as e:
            raise ModelError(f"{source} {where}: {e}") from None
        except (KeyError, TypeError, AttributeError, IndexError) as e:
            raise ModelError(f"{source} {where}: malformed {name} document ({type(e).__name__}: {e})") from None
    return prompts[:limit] if limit is not None else prompts



# --------------------------------------------------------------------------------------------------------------
# One document, the harness way (--plain): its task's prompt function above gives one (context, continuation)
# request per choice; each is tokenized (encode_pair), cut to the model's window (harness_window) and scored by one
# full forward pass (loglikelihood); doc_metrics turns the choices' log-likelihoods into acc and acc_norm.

def encode(enc, text: str) -> list[int]:
    """Like a Hugging Face tokenizer, a special token's text in the data becomes the special token."""
    return enc.encode(text, allowed_special="all")


def encode_pair(enc, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """TemplateLM._encode_pair: trailing whitespace moves from the context to the continuation, then the
    continuation's tokens are what the whole string has beyond the context's tokens."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole, context_tokens = encode(enc, context + continuation), encode(enc, context)
    return context_tokens, whole[len(context_tokens):]


def harness_window(context_tokens: list[int], continuation_tokens: list[int], max_len: int):
    """The tokens HFLM._loglikelihood_tokens feeds, (context + continuation)[-(max_len + 1):][:-1], and the
    scored positions with the token each predicts: the last len(continuation) positions of that input."""
    if not continuation_tokens:
        raise ModelError("a continuation encodes to no tokens")
    if len(continuation_tokens) > max_len:
        raise ModelError(f"a continuation of {len(continuation_tokens)} tokens does not fit the model's context "
                         f"length {max_len}")
    inp = (context_tokens + continuation_tokens)[-(max_len + 1):][:-1]
    first = len(inp) - len(continuation_tokens)
    return inp, [(first + j, t) for j, t in enumerate(continuation_tokens)]


@torch.inference_mode()
def loglikelihood(model, context_tokens, continuation_tokens, device="cpu") -> tuple[float, bool]:
    """One request: Σ_j log p(continuation_j | everything before it) from one full forward pass over the window,
    and whether every continuation token is the argmax (the harness's is_greedy)."""
    inp, targets = harness_window(context_tokens, continuation_tokens, model.config.block_size)
    logits = model(torch.tensor([inp], device=device))                        # (1, T, V)
    logp = F.log_softmax(logits[0].float(), dim=-1)                             # (T, V)
    pos, tok = (torch.tensor(ix, device=device) for ix in zip(*targets))
    return float(logp[pos, tok].sum()), bool((logp[pos].argmax(-1) == tok).all())


def doc_metrics(lls: list[float], gold: int, choices: list[str] | None) -> tuple[float, float | None]:
    """acc = [argmax of the log-likelihoods is gold]; acc_norm: the same after dividing each by len(choice) in
    characters (None where the task has no acc_norm). np.argmax: ties go to the first."""
    acc = 1.0 if int(np.argmax(lls)) == gold else 0.0
    if choices is None:
        return acc, None
    return acc, 1.0 if int(np.argmax(np.array(lls) / [float(len(c)) for c in choices])) == gold else 0.0


def score_requests(model, tokenized, batch_size=16, device="cpu", desc=None, plain=False):
    """(log-likelihood, is_greedy) of every request, one list per document; tokenized[d] lists document d's
    (context tokens, continuation tokens). plain: loglikelihood() one request at a time; otherwise the shared-prefix
    scorer of fast_scorer.py on the same windows, which gives the same numbers with less work. Under torchrun each
    process scores its share (documents d = rank mod N; the fast scorer's forward passes likewise) and every
    process gets every score, each computed exactly as one process computes it."""
    rank, world = get_rank(), get_world_size()
    if plain:
        mine = set(shard(range(len(tokenized))))
        scored = [[loglikelihood(model, c, t, device) for c, t in doc] if d in mine else [None] * len(doc)
                  for d, doc in enumerate(tqdm(tokenized, desc=desc, disable=desc is None, unit="doc", leave=False))]
    else:
        scored = score_windows(model, windows_of(model, tokenized), batch_size, device, desc, rank=rank,
                               world_size=world)
    return merge_shares(all_gather(scored))


def windows_of(model, tokenized):
    return [[harness_window(c, t, context_length(model)) for c, t in doc] for doc in tokenized]


def merge_shares(shares):
    """Each process's scores, None where another process scored the request -> every request's score."""
    return [[next(r for r in rs if r is not None) for rs in zip(*docs)] for docs in zip(*shares)]


# --------------------------------------------------------------------------------------------------------------
# A task: every document's requests tokenized and scored, metrics averaged as lm_eval/api/metrics.py does.

def context_length(model) -> int:
    return int(model.config.block_size)


def tokenize_prompts(enc, prompts: list[Prompt]) -> list[list[tuple[list[int], list[int]]]]:
    return [[encode_pair(enc, ctx, cont) for ctx, cont in p.requests] for p in prompts]


def harness_tokens(tokenized, max_len: int) -> int:
    """How many tokens the harness feeds the model for these requests (each choice's full context + continuation,
    truncated to the window, last token dropped)."""
    return sum(min(len(c) + len(t), max_len + 1) - 1 for doc in tokenized for c, t in doc)


def mean_stderr(xs) -> float | None:
    """metrics.mean_stderr (sample stdev with n - 1, over sqrt n); the harness reports N/A (here None) for n < 2."""
    return statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else None


def pooled_stderr(xs, groups) -> float | None:
    """metrics.pooled_sample_stderr over groups (MMLU subjects); None where a group has one document (harness N/A)."""
    by = defaultdict(list)
    for x, g in zip(xs, groups):
        by[g].append(x)
    sizes = [len(v) for v in by.values()]
    stderrs = [mean_stderr(v) for v in by.values()]
    if any(s is None for s in stderrs):
        return None
    var = sum((n - 1) * s ** 2 * n for n, s in zip(sizes, stderrs)) / (sum(sizes) - len(sizes))
    return math.sqrt(var / sum(sizes))


def aggregate(prompts: list[Prompt], scored) -> tuple[dict, list[dict]]:
    """A task's result (n, acc, acc_norm and their stderrs) and its per-document samples."""
    samples = []
    for i, (p, res) in enumerate(zip(prompts, scored)):
        lls = [ll for ll, _ in res]
        acc, acc_norm = doc_metrics(lls, p.gold, p.choices)
        samples.append({"doc_index": i, "requests": [list(r) for r in p.requests], "loglikelihoods": lls,
                        "is_greedy": [g for _, g in res], "gold": p.gold, "acc": acc, "acc_norm": acc_norm})
    accs = [s["acc"] for s in samples]
    result = {"n": len(samples), "acc": sum(accs) / len(accs), "acc_stderr": mean_stderr(accs),
              "acc_norm": None, "acc_norm_stderr": None}
    if prompts[0].group is not None:  # MMLU: the group's stderr, as the harness pools it over subjects
        pooled = pooled_stderr(accs, [p.group for p in prompts])
        if pooled is not None:
            result["acc_stderr"] = pooled
        result["acc_stderr_rule"] = ("pooled over subjects (harness group rule)" if pooled is not None else
                                     "over all questions (a subject has one document, where the harness says N/A)")
    if prompts[0].choices is not None:
        norms = [s["acc_norm"] for s in samples]
        result["acc_norm"], result["acc_norm_stderr"] = sum(norms) / len(norms), mean_stderr(norms)
    return result, samples


def evaluate_task(model, enc, prompts: list[Prompt], batch_size=16, device="cpu", desc=None,
                  plain=False) -> tuple[dict, list]:
    t0 = time.perf_counter()
    tokenized = tokenize_prompts(enc, prompts)
    scored = score_requests(model, tokenized, batch_size, device, desc, plain)
    seconds = time.perf_counter() - t0
    result, samples = aggregate(prompts, scored)
    result["harness_tokens"] = harness_tokens(tokenized, context_length(model))
    result["seconds"] = round(seconds, 3)
    return result, samples


# --------------------------------------------------------------------------------------------------------------
# Benchmark: harness tokens per second of the fast scorer against the model's plain forward pass.

@torch.inference_mode()
def plain_forward_rate(model, n_tokens: int, seq_len: int, batch_size: int, device="cpu") -> float:
    """Tokens per second of model(x) (full logits) on full (batch_size, seq_len) batches, no padding, covering
    n_tokens tokens: the model's plain forward speed at the eval's own sequence length."""
    n_batches = max(1, math.ceil(n_tokens / (batch_size * seq_len)))
    x = torch.randint(0, int(model.config.vocab_size), (batch_size, seq_len), device=device)
    model(x[:1, :8])  # warm-up
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n_batches):
        model(x)
    sync(device)
    return n_batches * batch_size * seq_len / (time.perf_counter() - t0)


def _bench_row(name, r, out):
    print(f"{name:<14} {r['harness_tokens']:>11} {r['seconds']:>8.2f} {r['harness_tok_per_s']:>13.0f} "
          f"{r['plain_forward_tok_per_s']:>15.0f} {r['ratio']:>6.2f}", file=out, flush=True)


def bench(model, enc, task_prompts: dict[str, list[Prompt]], batch_size=16, device="cpu", out=None,
          rounds: int = 1) -> dict:
    """For each task: harness tokens / wall time of the fast scorer, against plain forward tokens/s measured on as
    many tokens at the task's mean harness sequence length; the fastest of `rounds` alternating rounds of each
    (on a machine shared with other jobs, the minimum is the stable number). Prints a table, returns the numbers."""
    out = out or sys.stdout
    L = context_length(model)
    rows, totals = {}, [0, 0.0, 0.0]
    print(f"{'task':<14} {'harness tok':>11} {'seconds':>8} {'harness tok/s':>13} {'plain fwd tok/s':>15} "
          f"{'ratio':>6}", file=out, flush=True)
    model.hidden(torch.zeros((1, 8), dtype=torch.long, device=device))  # warm-up
    for name, prompts in task_prompts.items():
        tokenized = tokenize_prompts(enc, prompts)
        n_tok, n_req = harness_tokens(tokenized, L), sum(len(d) for d in tokenized)
        t_fast, plain = math.inf, 0.0
        for _ in range(rounds):
            sync(device)
            t0 = time.perf_counter()
            score_windows(model, windows_of(model, tokenized), batch_size, device)
            sync(device)
            t_fast = min(t_fast, time.perf_counter() - t0)
            plain = max(plain, plain_forward_rate(model, n_tok, max(1, round(n_tok / n_req)), batch_size, device))
        rows[name] = {"harness_tokens": n_tok, "seconds": t_fast, "harness_tok_per_s": n_tok / t_fast,
                      "plain_forward_tok_per_s": plain, "ratio": n_tok / t_fast / plain}
        _bench_row(name, rows[name], out)
        totals[0] += n_tok
        totals[1] += t_fast
        totals[2] += n_tok / plain
    rows["all"] = {"harness_tokens": totals[0], "seconds": totals[1], "harness_tok_per_s": totals[0] / totals[1],
                   "plain_forward_tok_per_s": totals[0] / totals[2], "ratio": totals[2] / totals[1]}
    _bench_row("all", rows["all"], out)
    return rows


# --------------------------------------------------------------------------------------------------------------
# Next-token loss on a file, and speed.

@torch.inference_mode()
def perplexity(model, tokens: np.ndarray, context: int | None = None, batch_size=8, device="cpu") -> dict:
    """Mean next-token loss over non-overlapping windows of `context` tokens (each window predicts its tokens
    1..context from 0..context-1, the last window is shorter) and its exp. Under torchrun each process runs its
    share of the batches and the window losses are added in window order, as one process adds them."""
    L = context or context_length(model)
    if L > context_length(model):
        raise ModelError(f"--ppl-context {L} exceeds the model's context length {context_length(model)}")
    if len(tokens) < 2:
        raise ModelError("the --ppl file holds fewer than 2 tokens")
    if int(tokens.max()) >= int(model.config.vocab_size):
        raise ModelError(f"the --ppl file holds token id {int(tokens.max())} but the model's vocabulary has "
                         f"{model.config.vocab_size}: was it prepared with another tokenizer?")
    n_pred = len(tokens) - 1                                   # every token but the first is predicted once
    starts = list(range(0, n_pred, L))
    full, last = [s for s in starts if s + L <= n_pred], [s for s in starts if s + L > n_pred]
    groups = [full[i:i + batch_size] for i in range(0, len(full), batch_size)] + ([last] if last else [])
    window_nll = {}                                            # group number -> summed loss of each of its windows
    for i in tqdm(shard(range(len(groups))), desc="ppl", unit="batch", leave=False, disable=not is_main()):
        T = min(L, n_pred - groups[i][0])
        x = torch.tensor(np.stack([tokens[s:s + T] for s in groups[i]]).astype(np.int64), device=device)
        y = torch.tensor(np.stack([tokens[s + 1:s + T + 1] for s in groups[i]]).astype(np.int64), device=device)
        h = model.hidden(x)                                    # (B, T, C)
        # LM head a row at a time: (T, V), not (B, T, V)
        window_nll[i] = [float(F.cross_entropy(model.lm_head(h[b]).float(), y[b], reduction="sum"))
                         for b in range(len(groups[i]))]
    window_nll = {i: v for share in all_gather(window_nll) for i, v in share.items()}  # every process's windows
    nll, count = 0.0, 0
    for i, group in enumerate(groups):                         # added in window order, whatever process ran them
        for v in window_nll[i]:
            nll += v
            count += min(L, n_pred - group[0])
    return {"tokens": count, "context": L, "loss": nll / count, "ppl": math.exp(nll / count)}


@torch.inference_mode()
def speed(model, n_tokens: int = 1000, device="cpu") -> dict:
    """Seconds for one n_tokens sequence: prefill (one forward pass, logits at the last position) and token-by-token
    greedy generation of n_tokens - 1 tokens after a one-token prompt (cache / recurrent state)."""
    n = min(n_tokens, context_length(model))
    x = torch.randint(0, int(model.config.vocab_size), (1, n), device=device)
    model.lm_head(model.hidden(x)[:, -1])  # warm-up: the same prefill once, untimed
    sync(device)
    t0 = time.perf_counter()
    model.lm_head(model.hidden(x)[:, -1])
    sync(device)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.generate(x[:, :1], max_new_tokens=n - 1, top_k=1)
    sync(device)
    return {"tokens": n, "prefill_s": prefill, "generate_s": time.perf_counter() - t0}


# --------------------------------------------------------------------------------------------------------------
# Command line.

def check_config(cfg: EvalConfig):
    if cfg.limit is not None and cfg.limit <= 0:
        raise ModelError(f"--limit must be a positive number of documents, not {cfg.limit}")
    if cfg.batch_size <= 0:
        raise ModelError(f"--batch-size must be positive, not {cfg.batch_size}")
    if cfg.bench_rounds <= 0:
        raise ModelError(f"--bench-rounds must be at least 1, not {cfg.bench_rounds}")


def _same_model(a: str, b: str) -> bool:
    if a == b:
        return True
    return os.path.exists(a) and os.path.exists(b) and os.path.realpath(a) == os.path.realpath(b)


def _checked_teacher(ckpt: str, teacher_id, model: str):
    if teacher_id is not None and not _same_model(str(teacher_id), model):
        raise ModelError(f"checkpoint {ckpt} was distilled from teacher '{teacher_id}' but --model is '{model}'; "
                         f"pass --model {teacher_id}")


def load_models(cfg: EvalConfig, device) -> tuple[dict, object]:
    """{"teacher": --model} (and "student": the student of --ckpt, whose teacher must be --model), the tokenizer."""
    dtype = getattr(torch, cfg.dtype)
    if cfg.ckpt is not None:
        cfg_path = Path(cfg.ckpt) / "config.json"
        if not Path(cfg.ckpt).is_dir():
            raise ModelError(f"checkpoint directory {cfg.ckpt} does not exist")
        if cfg_path.is_file():  # check the teacher before loading anything
            try:
                _checked_teacher(cfg.ckpt, json.loads(cfg_path.read_text()).get("teacher"), cfg.model)
            except json.JSONDecodeError:
                raise ModelError(f"{cfg_path} is not valid JSON") from None
    models = {"teacher": GPT.from_pretrained(cfg.model, device=device, dtype=dtype).eval()}
    enc = load_tokenizer(cfg.model)
    if cfg.ckpt is not None:
        models["student"], scfg = load_student(cfg.ckpt, device=device, dtype=dtype)
        _checked_teacher(cfg.ckpt, scfg.get("teacher"), cfg.model)
    return models, enc


def _fmt(x, digits=4):
    return "-" if x is None else f"{x:.{digits}f}"


def print_table(results: dict[str, dict[str, dict]], out=None):
    """results: {model label: {task: result}}; one column block per model."""
    out = out or sys.stdout
    labels = list(results)
    head = f"{'task':<14} {'n':>5}" + "".join(f" | {lab + ' acc':>14} {'acc_norm':>8} {'stderr':>7}" for lab in labels)
    print(head, file=out)
    print("-" * len(head), file=out)
    for task in results[labels[0]]:
        line = f"{task:<14} {results[labels[0]][task]['n']:>5}"
        for lab in labels:
            r = results[lab][task]
            line += f" | {_fmt(r['acc']):>14} {_fmt(r['acc_norm']):>8} {_fmt(r['acc_stderr']):>7}"
        print(line, file=out)


def run_tasks(cfg: EvalConfig, models: dict, enc, prompts: dict[str, list[Prompt]], device) -> dict:
    """Every task for every model, a printed table, and results.json's results and samples (the student's apart)."""
    results, samples = {}, {}
    for label, m in models.items():
        results[label], samples[label] = {}, {}
        for name, ps in prompts.items():
            desc = f"{label} {name}" if is_main() else None
            results[label][name], samples[label][name] = evaluate_task(m, enc, ps, cfg.batch_size, device, desc,
                                                                       cfg.plain)
    print_table(results)
    report = {"results": results["teacher"], "samples": samples["teacher"]}
    if "student" in models:
        report["student"] = {"results": results["student"], "samples": samples["student"]}
    return report


def run_bench(cfg: EvalConfig, models: dict, enc, prompts: dict[str, list[Prompt]], device) -> dict:
    report = {}
    for label, m in models.items():
        print(f"\nbench: {label} ({cfg.model if label == 'teacher' else cfg.ckpt}) on {device}")
        report[label] = bench(m, enc, prompts, cfg.batch_size, device, rounds=cfg.bench_rounds)
    return report


def run_ppl(cfg: EvalConfig, models: dict, enc, device) -> dict:
    tokens = read_tokens(cfg.ppl, enc, cfg.ppl_max_tokens, special=True)  # text is encoded as the tasks' text is
    report = {}
    for label, m in models.items():
        r = report[label] = perplexity(m, tokens, cfg.ppl_context, cfg.batch_size, device)
        print(f"ppl {label}: {r['tokens']} tokens in windows of {r['context']}: loss {r['loss']:.4f}, "
              f"perplexity {r['ppl']:.3f}")
    return report


def run_speed(cfg: EvalConfig, models: dict, device) -> dict:
    report = {}
    for label, m in models.items():
        r = report[label] = speed(m, cfg.speed_tokens, device)
        print(f"speed {label} on {device}: {r['tokens']}-token sequence: prefill {r['prefill_s']:.3f} s, "
              f"token-by-token generation {r['generate_s']:.3f} s")
    return report


def main(argv=None):
    cfg = parse_config(EvalConfig, argv, description=__doc__.strip().split("\n\n")[0])
    check_config(cfg)
    only_other = cfg.tasks is None and (cfg.ppl or cfg.speed)
    task_names = [] if only_other else parse_tasks(cfg.tasks)
    prompts = {name: load_task(name, cfg.data_dir, cfg.limit) for name in task_names}  # bad data fails here, fast
    device, _ = pick_device(cfg.device, "float32")  # the model itself is cast to --dtype: no autocast
    device = init_distributed(device)               # torchrun: each process scores a share, rank 0 reports
    models, enc = load_models(cfg, device)
    report = {}
    if prompts and not cfg.bench:
        report.update(run_tasks(cfg, models, enc, prompts, device))
    if cfg.ppl:
        report["ppl"] = run_ppl(cfg, models, enc, device)
    if not is_main():
        return
    if cfg.bench:                                   # timings: rank 0 alone
        report["bench"] = run_bench(cfg, models, enc, prompts, device)
    if cfg.speed:
        report["speed"] = run_speed(cfg, models, device)
    if cfg.output:
        report["config"], report["world_size"] = asdict(cfg), get_world_size()
        write_text_atomic(cfg.output, json.dumps(report, indent=1, ensure_ascii=False))
        print(f"wrote {cfg.output}")


if __name__ == "__main__":
    run_main(main)
