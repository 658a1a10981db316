"""
evaluate.py: zero-shot multiple-choice accuracy scored exactly as lm-evaluation-harness 0.4 scores it, next-token
loss / perplexity on a token or text file, and prefill / decoding speed; for teachers and distilled students alike.

    python evaluate.py --model gpt2 --tasks piqa,arc_easy --data-dir ../shared/data/eval --output results.json
    python evaluate.py --model gpt2 --ckpt out/gpt2 --data-dir ../shared/data/eval      # teacher | student table
    python evaluate.py --model gpt2 --ppl ../shared/data/text/wikitext-2-raw/wiki.test.raw
    python evaluate.py --model gpt2 --ckpt out/gpt2 --speed
    python evaluate.py --model gpt2 --data-dir ../shared/data/eval --limit 50 --bench

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

The fast path (score_requests) computes exactly these numbers with less work than the harness:
 - requests that feed identical tokens share one row (MMLU's four one-token answers: one forward pass a question);
 - the tokens a document's rows begin with (the context, and for PIQA often much of both solutions) run once,
   with a cache, and each row continues from a copy of it (KV cache for softmax attention, the recurrent state for
   a linear-attention student); neighbouring documents' prefixes run together, cut to one length;
 - rows are sorted by length and batched with little right padding (the model is causal, so padding after a row
   changes nothing before it);
 - the LM head runs only at the positions whose next token is scored, once per distinct position.
The plain reference (loglikelihood_reference) does what the harness does, one request at a time; the tests hold
the fast path to it, and both to transformers.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from common import ModelError, run_main
from model import GPT, Cache
from tokenizer import load_tokenizer

ALL_TASKS = ("piqa", "arc_easy", "arc_challenge", "logiqa", "mmlu", "winogrande", "wsc273")


def _opt(default, help, type=str):
    return field(default=default, metadata={"help": help, "type": type})


@dataclass
class EvalConfig:
    # what to evaluate
    model: str = _opt("gpt2", "teacher model: a hub id or a local checkpoint directory (GPT.from_pretrained)")
    ckpt: str | None = _opt(None, "distill.py checkpoint directory; its student is evaluated next to the teacher")
    tasks: str | None = _opt(None, "comma-separated tasks, or 'all'; if not given, all seven unless --ppl or --speed "
                                   "is: " + ",".join(ALL_TASKS))
    limit: int | None = _opt(None, "score only the first N documents of each task (for MMLU the first N questions of "
                                   "the file; the harness's --limit takes N per subject)", int)
    data_dir: str | None = _opt(None, "folder holding <task>.jsonl in the Hugging Face schema "
                                      "(e.g. ../shared/data/eval); default: load the harness's datasets from the hub")
    output: str | None = _opt(None, "write results and per-document samples to this JSON file")
    # how
    batch_size: int = _opt(16, "sequences per forward pass", int)
    device: str = _opt("auto", "torch device: auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    dtype: str = _opt("float32", "model dtype: float32, bfloat16 or float16 (log-softmax is always float32)")
    # other measurements
    ppl: str | None = _opt(None, "next-token loss and perplexity on a uint16 .bin token file or a text file")
    ppl_context: int | None = _opt(None, "window length for --ppl; if not given, the model's context length", int)
    ppl_max_tokens: int | None = _opt(None, "score only the first N tokens of the --ppl file", int)
    speed: bool = _opt(False, "time prefill and token-by-token generation of one sequence (teacher vs student)", bool)
    speed_tokens: int = _opt(1000, "sequence length for --speed", int)
    bench: bool = _opt(False, "time the fast scorer against the model's plain forward pass on the same tokens", bool)
    bench_rounds: int = _opt(1, "--bench keeps the fastest of this many alternating rounds (for shared machines)", int)


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
                             f"(../shared/data/eval has one per task)")
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
                         f"--data-dir DIR holding {name}.jsonl (../shared/data/eval has one)") from None
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
# Requests → tokens → windows, as the harness builds them.

def encode(enc, text: str) -> list[int]:
    # like a Hugging Face tokenizer, a special token's text in the data becomes the special token
    return enc.encode(text, allowed_special="all")


def encode_pair(enc, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm_eval's TemplateLM._encode_pair: trailing whitespace moves from the context to the continuation, then the
    continuation's tokens are what the whole string has beyond the context's tokens."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = encode(enc, context + continuation)
    context_tokens = encode(enc, context)
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


def tokenize_prompts(enc, prompts: list[Prompt]) -> list[list[tuple[list[int], list[int]]]]:
    return [[encode_pair(enc, ctx, cont) for ctx, cont in p.requests] for p in prompts]


def harness_tokens(tokenized, max_len: int) -> int:
    """How many tokens the harness feeds the model for these requests (each choice's full context + continuation,
    truncated to the window, last token dropped)."""
    return sum(min(len(c) + len(t), max_len + 1) - 1 for doc in tokenized for c, t in doc)


# --------------------------------------------------------------------------------------------------------------
# Scoring: the plain reference and the fast path.

def context_length(model) -> int:
    return int(model.config.block_size)


@torch.inference_mode()
def loglikelihood_reference(model, context_tokens, continuation_tokens, device="cpu") -> tuple[float, bool]:
    """One request the plain way, as the harness does it: full forward, log-softmax over all positions, pick."""
    inp, targets = harness_window(context_tokens, continuation_tokens, context_length(model))
    logits, _ = model(torch.tensor([inp], device=device))
    logp = F.log_softmax(logits[0].float(), dim=-1)
    pos = torch.tensor([p for p, _ in targets], device=device)
    tok = torch.tensor([t for _, t in targets], device=device)
    return float(logp[pos, tok].sum()), bool((logp[pos].argmax(-1) == tok).all())


@dataclass
class Row:
    """One sequence fed to the model, and what is read from it."""
    tokens: list[int]
    targets: list[tuple[int, int, int]] = field(default_factory=list)  # (position, next token, request number)


def plan_rows(tokenized, max_len: int) -> list[list[Row]]:
    """Per document, its distinct rows: requests that feed identical tokens share one (MMLU's four answers)."""
    plans, k = [], 0
    for doc in tokenized:
        rows: dict[tuple[int, ...], Row] = {}
        for ctx, cont in doc:
            inp, targets = harness_window(ctx, cont, max_len)
            row = rows.setdefault(tuple(inp), Row(inp))
            row.targets += [(p, t, k) for p, t in targets]
            k += 1
        plans.append(list(rows.values()))
    return plans


class _Scores:
    """Per-request sums of log-probabilities and greedy flags, filled batch by batch."""

    def __init__(self, n):
        self.ll = np.zeros(n, dtype=np.float64)
        self.greedy = np.ones(n, dtype=bool)

    def add(self, model, h, targets):
        """h (B, T, C) hidden states; targets [(b, position, next token, request)]. The LM head runs once per
        distinct (b, position) and nowhere else."""
        where: dict[tuple[int, int], int] = {}
        for b, p, _, _ in targets:
            where.setdefault((b, p), len(where))
        bi, pi = (torch.tensor(ix, device=h.device) for ix in zip(*where))
        logp = F.log_softmax(model.lm_head(h[bi, pi]).float(), dim=-1)             # (N, V)
        at = torch.tensor([where[b, p] for b, p, _, _ in targets], device=h.device)
        tok = torch.tensor([t for _, _, t, _ in targets], device=h.device)
        req = np.array([k for _, _, _, k in targets])
        np.add.at(self.ll, req, logp[at, tok].double().cpu().numpy())
        np.logical_and.at(self.greedy, req, (logp.argmax(-1)[at] == tok).cpu().numpy())


def _forward_rows(model, rows: list[Row], scores: _Scores, device, cache=None):
    """One forward pass: rows right-padded into (B, T) (after the cache's prefix, if any), LM head at scored spots."""
    x = torch.zeros((len(rows), max(len(r.tokens) for r in rows)), dtype=torch.long)
    for b, row in enumerate(rows):
        x[b, :len(row.tokens)] = torch.tensor(row.tokens)
    h = model.hidden(x.to(device), cache)                                           # (B, T, C)
    scores.add(model, h, [(b, p, t, k) for b, row in enumerate(rows) for p, t, k in row.targets])


def _common_prefix(seqs) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs[1:]):
            return i
    return n


@dataclass
class Shared:
    """A document whose rows begin with the same tokens: up to `shareable` of them can run once for all rows."""
    rows: list[Row]
    shareable: int  # every row keeps at least one token of its own


def split_shared(plans: list[list[Row]]) -> tuple[list[Row], list[Shared]]:
    plain, shared = [], []
    for rows in plans:
        P = 0
        if len(rows) > 1:
            P = min(_common_prefix([r.tokens for r in rows]), min(len(r.tokens) for r in rows) - 1)
        if P == 0:
            plain += rows
        else:
            shared.append(Shared(rows, P))
    return plain, shared


def _take(x, idx):
    """Cache contents with their batch dimension (0) indexed by idx: one prefix's state copied to its rows."""
    if torch.is_tensor(x):
        return x.index_select(0, idx)
    if isinstance(x, dict):
        return {key: _take(v, idx) for key, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_take(v, idx) for v in x)
    return x


def _batches(items, length, batch_size: int, max_padding: float = 0.1, min_tokens: int = 256):
    """Items sorted longest first, cut into batches of at most batch_size items whose right padding stays under
    max_padding of their real tokens, except that a batch below min_tokens positions keeps growing: a forward pass
    reads every weight, so a tiny one costs about as much as a small one."""
    items = sorted(items, key=lambda it: -length(it))
    batch, real = [], 0
    for it in items:
        n = length(it)
        if batch:
            padded = (len(batch) + 1) * length(batch[0])
            if len(batch) == batch_size or (padded > min_tokens and padded > (1 + max_padding) * (real + n)):
                yield batch
                batch, real = [], 0
        batch.append(it)
        real += n
    if batch:
        yield batch


def _run_shared(model, docs: list[Shared], scores: _Scores, batch_size: int, device):
    """Documents whose rows share at least P tokens (P = the smallest `shareable`): those P tokens of every document
    in one forward pass that fills a cache, then all the rows' remainders in batches of similar length, each row
    continuing from a copy of its document's part of the cache."""
    P = min(s.shareable for s in docs)
    cache = Cache(model.config.n_layer)
    h = model.hidden(torch.tensor([s.rows[0].tokens[:P] for s in docs], device=device), cache)  # (docs, P, C)
    inside = [(d, p, t, k) for d, s in enumerate(docs) for r in s.rows for p, t, k in r.targets if p < P]
    if inside:  # positions scored inside the prefix (their hidden state is the same for all the document's rows)
        scores.add(model, h, inside)
    rows = [(d, Row(r.tokens[P:], [(p - P, t, k) for p, t, k in r.targets if p >= P]))
            for d, s in enumerate(docs) for r in s.rows]
    for batch in _batches(rows, lambda dr: len(dr[1].tokens), batch_size):
        which = torch.tensor([d for d, _ in batch], device=device)
        row_cache = Cache(model.config.n_layer)
        row_cache[:], row_cache.pos = [_take(layer, which) for layer in cache], P
        _forward_rows(model, [r for _, r in batch], scores, device, row_cache)


PREFIX_WINDOW = 4096  # prefix tokens whose cache is held at once (GPT-2 124M: 12 layers x 2 x 768 floats each)


def _windows(shared: list[Shared], batch_size: int, spread: float = 0.25):
    """Documents sorted by shareable length, in windows of up to 4 x batch_size rows; a window shares the smallest
    shareable length of its documents, so a document joins only if its own is at most `spread` longer."""
    shared = sorted(shared, key=lambda s: s.shareable)
    i = 0
    while i < len(shared):
        P, j, n_rows = shared[i].shareable, i + 1, len(shared[i].rows)
        while (j < len(shared) and n_rows + len(shared[j].rows) <= 4 * batch_size and (j - i + 1) * P <= PREFIX_WINDOW
               and shared[j].shareable <= P * (1 + spread)):
            n_rows += len(shared[j].rows)
            j += 1
        yield shared[i:j]
        i = j


@torch.inference_mode()
def score_requests(model, tokenized, batch_size: int = 16, device="cpu", desc: str | None = None,
                   share_prefix: bool = True):
    """Log-likelihood and is-greedy of every request, equal to the harness's; tokenized[d] lists document d's
    (context tokens, continuation tokens). Returns one list of (loglikelihood, is_greedy) per document."""
    plans = plan_rows(tokenized, context_length(model))
    if share_prefix:
        plain, shared = split_shared(plans)
    else:
        plain, shared = [row for rows in plans for row in rows], []
    n = sum(len(doc) for doc in tokenized)
    scores = _Scores(n)
    requests = lambda rows: len({k for r in rows for _, _, k in r.targets})  # noqa: E731
    with tqdm(total=n, desc=desc, disable=desc is None, unit="req", leave=False) as pbar:
        # rows that share nothing (and MMLU's one row per question)
        for batch in _batches(plain, lambda r: len(r.tokens), batch_size):
            _forward_rows(model, batch, scores, device)
            pbar.update(requests(batch))
        # documents with a shared prefix, in windows of neighbours by shareable length
        for docs in _windows(shared, batch_size):
            _run_shared(model, docs, scores, batch_size, device)
            pbar.update(requests([r for s in docs for r in s.rows]))
    out, k = [], 0
    for doc in tokenized:
        out.append([(float(scores.ll[k + j]), bool(scores.greedy[k + j])) for j in range(len(doc))])
        k += len(doc)
    return out


# --------------------------------------------------------------------------------------------------------------
# Metrics, as lm_eval/api/task.py process_results and lm_eval/api/metrics.py compute them.

def doc_metrics(lls: list[float], gold: int, choices: list[str] | None) -> tuple[float, float | None]:
    acc = 1.0 if int(np.argmax(lls)) == gold else 0.0  # np.argmax: ties go to the first
    if choices is None:
        return acc, None
    completion_len = np.array([float(len(c)) for c in choices])
    return acc, 1.0 if int(np.argmax(np.array(lls) / completion_len)) == gold else 0.0


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


def evaluate_task(model, enc, prompts: list[Prompt], batch_size=16, device="cpu", desc=None) -> tuple[dict, list]:
    t0 = time.perf_counter()
    tokenized = tokenize_prompts(enc, prompts)
    scored = score_requests(model, tokenized, batch_size, device, desc)
    seconds = time.perf_counter() - t0
    result, samples = aggregate(prompts, scored)
    result["harness_tokens"] = harness_tokens(tokenized, context_length(model))
    result["seconds"] = round(seconds, 3)
    return result, samples


# --------------------------------------------------------------------------------------------------------------
# Benchmark: harness tokens per second of the fast path against the model's plain forward pass.

def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def plain_forward_rate(model, n_tokens: int, seq_len: int, batch_size: int, device="cpu") -> float:
    """Tokens per second of model(x) (full logits) on full (batch_size, seq_len) batches, no padding, covering
    n_tokens tokens: the model's plain forward speed at the eval's own sequence length."""
    n_batches = max(1, math.ceil(n_tokens / (batch_size * seq_len)))
    x = torch.randint(0, int(model.config.vocab_size), (batch_size, seq_len), device=device)
    model(x[:1, :8])  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n_batches):
        model(x)
    _sync(device)
    return n_batches * batch_size * seq_len / (time.perf_counter() - t0)


def bench(model, enc, task_prompts: dict[str, list[Prompt]], batch_size=16, device="cpu", out=None,
          rounds: int = 1) -> dict:
    """For each task: harness tokens / wall time of score_requests, against plain forward tokens/s measured on as
    many tokens at the task's mean harness sequence length; the fastest of `rounds` alternating rounds of each
    (on a machine shared with other jobs, the minimum is the stable number). Prints a table, returns the numbers."""
    out = out or sys.stdout
    L = context_length(model)
    rows, totals = {}, [0, 0.0, 0.0]

    def show(name, r):
        print(f"{name:<14} {r['harness_tokens']:>11} {r['seconds']:>8.2f} {r['harness_tok_per_s']:>13.0f} "
              f"{r['plain_forward_tok_per_s']:>15.0f} {r['ratio']:>6.2f}", file=out, flush=True)

    print(f"{'task':<14} {'harness tok':>11} {'seconds':>8} {'harness tok/s':>13} {'plain fwd tok/s':>15} "
          f"{'ratio':>6}", file=out, flush=True)
    model.hidden(torch.zeros((1, 8), dtype=torch.long, device=device))  # warm-up
    for name, prompts in task_prompts.items():
        tokenized = tokenize_prompts(enc, prompts)
        n_tok, n_req = harness_tokens(tokenized, L), sum(len(d) for d in tokenized)
        t_fast, plain = math.inf, 0.0
        for _ in range(rounds):
            _sync(device)
            t0 = time.perf_counter()
            score_requests(model, tokenized, batch_size, device)
            _sync(device)
            t_fast = min(t_fast, time.perf_counter() - t0)
            plain = max(plain, plain_forward_rate(model, n_tok, max(1, round(n_tok / n_req)), batch_size, device))
        rows[name] = {"harness_tokens": n_tok, "seconds": t_fast, "harness_tok_per_s": n_tok / t_fast,
                      "plain_forward_tok_per_s": plain, "ratio": n_tok / t_fast / plain}
        show(name, rows[name])
        totals[0] += n_tok
        totals[1] += t_fast
        totals[2] += n_tok / plain
    rows["all"] = {"harness_tokens": totals[0], "seconds": totals[1], "harness_tok_per_s": totals[0] / totals[1],
                   "plain_forward_tok_per_s": totals[0] / totals[2], "ratio": totals[2] / totals[1]}
    show("all", rows["all"])
    return rows


# --------------------------------------------------------------------------------------------------------------
# Next-token loss on a file, and speed.

def read_tokens(path: str, enc, max_tokens: int | None = None) -> np.ndarray:
    p = Path(path)
    if not p.is_file():
        raise ModelError(f"{path} does not exist")
    if p.suffix == ".bin":
        if p.stat().st_size % 2:
            raise ModelError(f"{path} has an odd number of bytes, so it is not a uint16 token file")
        tokens = np.memmap(p, dtype=np.uint16, mode="r")
    else:
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ModelError(f"{path} is neither a .bin token file nor UTF-8 text") from None
        tokens = np.array(encode(enc, text), dtype=np.int64)
    return tokens[:max_tokens] if max_tokens else tokens


@torch.inference_mode()
def perplexity(model, tokens: np.ndarray, context: int | None = None, batch_size=8, device="cpu") -> dict:
    """Mean next-token loss over non-overlapping windows of `context` tokens (each window predicts its tokens
    1..context from 0..context-1, the last window is shorter) and its exp."""
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
    nll, count = 0.0, 0
    for group in tqdm(groups, desc="ppl", unit="batch", leave=False):
        T = min(L, n_pred - group[0])
        x = torch.tensor(np.stack([tokens[s:s + T] for s in group]).astype(np.int64), device=device)
        y = torch.tensor(np.stack([tokens[s + 1:s + T + 1] for s in group]).astype(np.int64), device=device)
        h = model.hidden(x)                                    # (B, T, C)
        for b in range(len(group)):                            # LM head a row at a time: (T, V), not (B, T, V)
            nll += float(F.cross_entropy(model.lm_head(h[b]).float(), y[b], reduction="sum"))
            count += T
    return {"tokens": count, "context": L, "loss": nll / count, "ppl": math.exp(nll / count)}


@torch.inference_mode()
def speed(model, n_tokens: int = 1000, device="cpu") -> dict:
    """Seconds for one n_tokens sequence: prefill (one forward pass, logits at the last position) and token-by-token
    greedy generation of n_tokens - 1 tokens after a one-token prompt (cache / recurrent state)."""
    n = min(n_tokens, context_length(model))
    x = torch.randint(0, int(model.config.vocab_size), (1, n), device=device)
    model.lm_head(model.hidden(x[:, :16])[:, -1])  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    model.lm_head(model.hidden(x)[:, -1])
    _sync(device)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.generate(x[:, :1], max_new_tokens=n - 1, top_k=1)
    _sync(device)
    return {"tokens": n, "prefill_s": prefill, "generate_s": time.perf_counter() - t0}


# --------------------------------------------------------------------------------------------------------------
# Command line.

def parse_args(argv=None) -> EvalConfig:
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    for f in fields(EvalConfig):
        flag, typ, help = "--" + f.name.replace("_", "-"), f.metadata["type"], f.metadata["help"]
        if f.default not in (None, False):
            help += f" (default: {f.default})"
        if typ is bool:
            p.add_argument(flag, action="store_true", help=help)
        else:
            p.add_argument(flag, type=typ, default=f.default, help=help)
    return EvalConfig(**vars(p.parse_args(argv)))


def _same_model(a: str, b: str) -> bool:
    if a == b:
        return True
    return os.path.exists(a) and os.path.exists(b) and os.path.realpath(a) == os.path.realpath(b)


def _checked_teacher(ckpt: str, teacher_id, model: str):
    if teacher_id is not None and not _same_model(str(teacher_id), model):
        raise ModelError(f"checkpoint {ckpt} was distilled from teacher '{teacher_id}' but --model is '{model}'; "
                         f"pass --model {teacher_id}")


def load_models(cfg: EvalConfig, device, dtype):
    """The teacher (and the student of --ckpt, whose teacher must be --model) and the tokenizer."""
    if cfg.ckpt is not None:
        cfg_path = Path(cfg.ckpt) / "config.json"
        if not Path(cfg.ckpt).is_dir():
            raise ModelError(f"checkpoint directory {cfg.ckpt} does not exist")
        if cfg_path.is_file():  # check the teacher before loading anything
            try:
                _checked_teacher(cfg.ckpt, json.loads(cfg_path.read_text()).get("teacher"), cfg.model)
            except json.JSONDecodeError:
                raise ModelError(f"{cfg_path} is not valid JSON") from None
    teacher = GPT.from_pretrained(cfg.model, device=device, dtype=dtype).eval()
    enc = load_tokenizer(cfg.model)
    student = None
    if cfg.ckpt is not None:
        from distill import load_student  # distill.py imports this project's model; only needed here
        student, scfg = load_student(cfg.ckpt, device=device, dtype=dtype)
        _checked_teacher(cfg.ckpt, scfg.get("teacher"), cfg.model)
    return teacher, student, enc


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


def _write_json(path: str, obj):
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False))
    os.replace(tmp, path)


def main(argv=None) -> int:
    cfg = parse_args(argv)
    if cfg.limit is not None and cfg.limit <= 0:
        raise ModelError(f"--limit must be a positive number of documents, not {cfg.limit}")
    if cfg.batch_size <= 0:
        raise ModelError(f"--batch-size must be positive, not {cfg.batch_size}")
    if cfg.dtype not in ("float32", "bfloat16", "float16"):
        raise ModelError(f"--dtype must be float32, bfloat16 or float16, not '{cfg.dtype}'")
    only_other = cfg.tasks is None and (cfg.ppl or cfg.speed)
    task_names = [] if only_other else parse_tasks(cfg.tasks)
    prompts = {name: load_task(name, cfg.data_dir, cfg.limit) for name in task_names}  # bad data fails here, fast
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    dtype = getattr(torch, cfg.dtype)
    teacher, student, enc = load_models(cfg, device, dtype)
    models = {"teacher": teacher} if student is None else {"teacher": teacher, "student": student}
    report: dict = {}

    if cfg.bench:
        for label, m in models.items():
            print(f"\nbench: {label} ({cfg.model if label == 'teacher' else cfg.ckpt}) on {device}")
            report.setdefault("bench", {})[label] = bench(m, enc, prompts, cfg.batch_size, device,
                                                          rounds=cfg.bench_rounds)
    elif prompts:
        results, samples = {}, {}
        for label, m in models.items():
            results[label], samples[label] = {}, {}
            for name, ps in prompts.items():
                results[label][name], samples[label][name] = evaluate_task(m, enc, ps, cfg.batch_size, device,
                                                                           desc=f"{label} {name}")
        print_table(results)
        report.update({"results": results["teacher"], "samples": samples["teacher"]})
        if student is not None:
            report["student"] = {"results": results["student"], "samples": samples["student"]}
    if cfg.ppl:
        tokens = read_tokens(cfg.ppl, enc, cfg.ppl_max_tokens)
        report["ppl"] = {}
        for label, m in models.items():
            r = report["ppl"][label] = perplexity(m, tokens, cfg.ppl_context, cfg.batch_size, device)
            print(f"ppl {label}: {r['tokens']} tokens in windows of {r['context']}: loss {r['loss']:.4f}, "
                  f"perplexity {r['ppl']:.3f}")
    if cfg.speed:
        report["speed"] = {}
        for label, m in models.items():
            r = report["speed"][label] = speed(m, cfg.speed_tokens, device)
            print(f"speed {label} on {device}: {r['tokens']}-token sequence: prefill {r['prefill_s']:.3f} s, "
                  f"token-by-token generation {r['generate_s']:.3f} s")
    if cfg.output:
        report["config"] = {f.name: getattr(cfg, f.name) for f in fields(EvalConfig)}
        _write_json(cfg.output, report)
        print(f"wrote {cfg.output}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
