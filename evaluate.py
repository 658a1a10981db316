"""
evaluate.py: zero-shot multiple-choice accuracy scored exactly as lm-evaluation-harness 0.4 scores
it, next-token loss / perplexity on a token or text file, and prefill / decoding speed; for teachers
and distilled students alike.

    python evaluate.py --model gpt2 --ckpt out/gpt2 --data-dir tests/data/eval  # teacher | student
    python evaluate.py --model gpt2 --ckpt out/gpt2 --ppl data/wikitext2/wiki.test.raw --speed
    torchrun --nproc_per_node 4 evaluate.py --model gpt2 --data-dir tests/data/eval --output r.json
    python evaluate.py --model gpt2 --ckpt out/gpt2 --tasks arc_easy --finetune-epochs 3  # Table 3

Each step of lm-eval (tasks/<task>, api/{task,metrics,model}.py, models/huggingface.py) is a
function: the prompts, encode_pair, harness_window, loglikelihood (--plain), doc_metrics, stderr.
fast_scorer.py computes the same numbers in batches that share each document's prefix (the default).
"""
import copy
import json
import math
import shlex
import sys
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import checkpoint
import datafiles
import devices
import door
import files
import passkey
import tokenizer
from fast_scorer import score_windows
from model import GPT, load_student


@dataclass
class EvalConfig:
    # what to evaluate
    model: str = door.opt("gpt2", "teacher: hub id, checkpoint directory, .gguf file or smollm2-135m")
    ckpt: str | None = door.opt(None, "distill.py checkpoint directory; its student is evaluated too")
    tasks: str | None = door.opt(None, "comma-separated tasks, or all (default without --ppl, --speed)")
    limit: int | None = door.opt(None, "score the first N documents of each task (MMLU: of the file)")
    data_dir: str | None = door.opt(None, "folder of <task>.jsonl (tests/data/eval); default: the hub's")
    output: str | None = door.opt(None, "write results and per-document samples to this JSON file")
    # how
    batch_size: int = door.opt(16, "sequences per forward pass")
    device: str = door.opt("auto", "torch device: auto (cuda if there is one, else cpu), cpu, cuda:1")
    dtype: str = door.opt("float32", "model dtype (log-softmax is float32)",
                     choices=["float32", "bfloat16", "float16"])
    plain: bool = door.opt(False, "one full forward pass per request, the plain harness way (slow; the "
                             "same numbers in float32, within rounding in bf16)")
    # other measurements
    ppl: str | None = door.opt(None, "next-token loss and perplexity on a uint16 .bin or a text file")
    ppl_context: int | None = door.opt(None, "window length for --ppl; default: the model's context")
    ppl_max_tokens: int | None = door.opt(None, "score only the first N tokens of the --ppl file")
    speed: bool = door.opt(False, "time prefill and token-by-token generation of one sequence")
    speed_tokens: int = door.opt(1000, "sequence length for --speed (at most the model's context)")
    # fine-tuning on each task before it is scored: the paper's protocol (its Table 3)
    finetune_epochs: int = door.opt(0, "fine-tune each model on each task for N epochs, scoring after "
                                  "each (0: zero-shot; paper: 3; MMLU is always 1, the last)")
    finetune_lr: str = door.opt("", "Adam learning rate, or a comma list: a grid searched on the "
                                "teacher, its best reused for the student (default: the paper's "
                                "Table 8 for GPT-2 and Pythia, else 1e-5, ours)")
    finetune_batch_size: int | None = door.opt(None, "documents per step (default: the paper's Table 9 "
                                                "for GPT-2 and Pythia, else 32, ours)")
    train_dir: str | None = door.opt(None, "folder of <task>_train.jsonl and optionally "
                                      "<task>_validation.jsonl in --data-dir's schema; default: "
                                      "the hub's splits")
    finetune_limit: int | None = door.opt(None, "train on the first N documents of each training split")
    seed: int = door.opt(0, "seed of the order in which the training documents are drawn")
    # recall: the passkey retrieval test (passkey.py)
    passkey: str | None = door.opt(None, "comma-separated prompt lengths in tokens of the passkey "
                                   "retrieval test, e.g. 256,512,1024,2048 (--seed draws keys)")
    passkey_trials: int = door.opt(20, "passkey trials a length, depths spread evenly", min=1)

    def __post_init__(self):
        """The flags, checked before any work."""
        door.check_positive(self, ("limit", "batch_size", "ppl_context"), 1)
        door.check_positive(self, ("ppl_max_tokens", "speed_tokens"), 2)
        devices.pick_device(self.device, "float32")
        if self.output:
            check_output(self.output, self.model, self.ckpt, self.data_dir, self.ppl)
        if self.ppl:
            check_ppl_file(Path(self.ppl))
        check_finetune(self)

    def check(self, model_config):
        """The flags that the model's config bounds, checked once it is known, before any work."""
        block_size = model_config.block_size
        if self.ppl_context and self.ppl_context > block_size:
            raise door.ModelError(f"--ppl-context {self.ppl_context} exceeds the model's context "
                                 f"length {block_size}")
        if self.speed and self.speed_tokens > block_size:
            raise door.ModelError(f"--speed-tokens {self.speed_tokens} is more than the model's "
                                 f"context of {block_size} tokens; pass at most --speed-tokens "
                                 f"{block_size}")


def check_ppl_file(p: Path):
    if p.is_dir():
        why = "is a directory"
    elif not p.exists():
        why = "does not exist"
    elif p.stat().st_size == 0:
        why = "is empty"
    else:
        return
    raise door.ModelError(f"--ppl {p} {why}; pass a uint16 token file (data/*/prepare.py) or a "
                         "text file")


def parse_lrs(spec: str) -> list[float]:
    """--finetune-lr's values; [] where it is empty (each task's default)."""
    try:
        lrs = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        lrs = [math.nan]
    if not all(math.isfinite(lr) and lr > 0 for lr in lrs):
        raise door.ModelError(f"--finetune-lr must be positive numbers separated by commas, got "
                             f"{spec!r}")
    return lrs


def check_finetune(cfg):
    """The fine-tuning flags, checked before any work."""
    door.check_positive(cfg, ("finetune_epochs",), 0)
    door.check_positive(cfg, ("finetune_batch_size", "finetune_limit"), 1)
    parse_lrs(cfg.finetune_lr)
    if cfg.finetune_epochs and cfg.dtype != "float32":
        raise door.ModelError("fine-tuning trains float32 weights (under bf16 autocast on CUDA); "
                             "drop --dtype")
    if cfg.train_dir and not Path(cfg.train_dir).is_dir():
        raise door.ModelError(f"--train-dir {cfg.train_dir} is not a folder; pass the folder of "
                             "<task>_train.jsonl files")


# --------------------------------------------------------------------------------------------------
# Tasks: one prompt function each, the harness's requests for one document.

@dataclass
class Prompt:
    requests: list[tuple[str, str]]  # (context, continuation), one per choice
    gold: int                        # index of the right request
    choices: list[str] | None        # texts whose lengths normalise acc_norm; None: no acc_norm
    group: str | None = None         # MMLU's subject (the harness pools the subjects' stderrs)


def piqa(doc) -> Prompt:  # lm_eval/tasks/piqa/piqa.yaml
    context = f"Question: {doc['goal']}\nAnswer:"
    choices = [doc["sol1"], doc["sol2"]]
    return Prompt([(context, " " + c) for c in choices], doc["label"], choices)


def arc(doc) -> Prompt:  # lm_eval/tasks/arc/arc_easy.yaml (arc_challenge includes it)
    context = f"Question: {doc['question']}\nAnswer:"
    choices = list(doc["choices"]["text"])
    gold = list(doc["choices"]["label"]).index(doc["answerKey"])
    return Prompt([(context, " " + c) for c in choices], gold, choices)


def logiqa(doc) -> Prompt:  # lm_eval/tasks/logiqa/utils_logiqa.py
    choices = list(doc["options"])
    context = "Passage: " + doc["context"] + "\n" + "Question: " + doc["question"] + "\nChoices:\n"
    context += "".join(f"{letter}. {option}\n" for letter, option in zip("ABCD", choices))
    context += "Answer:"
    gold = ["a", "b", "c", "d"].index(doc["label"].strip())
    return Prompt([(context, " " + c) for c in choices], gold, choices)


def mmlu(doc) -> Prompt:  # lm_eval/tasks/mmlu/default/_default_template_yaml, mmlu_<subject>.yaml
    c, subject = doc["choices"], doc["subject"]
    context = (f"The following are multiple choice questions (with answers) about "
               f"{subject.replace('_', ' ')}.\n\n"
               f"{doc['question'].strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:")
    return Prompt([(context, " " + x) for x in "ABCD"], doc["answer"], None, subject)


def winogrande(doc) -> Prompt:  # lm_eval/tasks/winogrande/preprocess_winogrande.py
    sentence = doc["sentence"]
    i = sentence.index("_")
    target = " " + sentence[i + 1:].strip()
    requests = [(sentence[:i] + option, target) for option in (doc["option1"], doc["option2"])]
    return Prompt(requests, {"1": 0, "2": 1}[doc["answer"]], None)


def wsc273(doc) -> Prompt:  # lm_eval/tasks/wsc273/default.yaml + utils.py
    # process_doc; pronoun_loc is left as it was, as the harness does
    text = doc["text"].replace("  ", " ")
    loc, pronoun = doc["pronoun_loc"], doc["pronoun"]

    def normalize(option):  # utils.__normalize_option: possessive 's, lowercased mid-sentence
        if pronoun.lower() in ["my", "his", "her", "our", "their"]:
            option += "'s"
        first = option.split()[0]
        upper = ["A", "An", "The", "She", "He", "It", "They", "My", "His", "Her", "Their"]
        if text[loc - 2] != "." and first in upper:
            return option.replace(first, first.lower())
        return option
    # the target is not stripped: it keeps its own leading space
    continuation = " " + text[loc + len(pronoun):]
    requests = [(text[:loc] + normalize(option), continuation) for option in doc["options"]]
    return Prompt(requests, doc["label"], None)


TASKS = {  # name: (prompt, datasets.load_dataset(path, name, split) as lm-eval 0.4 loads it)
    "piqa": (piqa, ("baber/piqa", None, "validation")),
    "arc_easy": (arc, ("allenai/ai2_arc", "ARC-Easy", "test")),
    "arc_challenge": (arc, ("allenai/ai2_arc", "ARC-Challenge", "test")),
    "logiqa": (logiqa, ("EleutherAI/logiqa", "logiqa", "test")),
    "mmlu": (mmlu, ("cais/mmlu", "all", "test")),  # the harness loads the 57 subjects one by one
    "winogrande": (winogrande, ("allenai/winogrande", "winogrande_xl", "validation")),
    "wsc273": (wsc273, ("lighteval/winograd_wsc", "wsc273", "test")),
}
ALL_TASKS = tuple(TASKS)

# prompt: the field that holds a document's answer, and the values it may take (the choices' order)
ANSWERS = {
    piqa: ("label", lambda doc: [0, 1]),
    arc: ("answerKey", lambda doc: list(doc["choices"]["label"])),
    logiqa: ("label", lambda doc: ["a", "b", "c", "d"][:len(doc["options"])]),
    mmlu: ("answer", lambda doc: [0, 1, 2, 3]),
    winogrande: ("answer", lambda doc: ["1", "2"]),
    wsc273: ("label", lambda doc: [0, 1]),
}


def check_document(prompt, doc):
    """What a prompt function takes for granted, checked as its task file is read: a KeyError names
    a missing field, a ValueError what else is wrong (load_task adds the file and line)."""
    if prompt is arc and len(doc["choices"]["text"]) != len(doc["choices"]["label"]):
        raise ValueError(f"choices has {len(doc['choices']['text'])} texts but "
                         f"{len(doc['choices']['label'])} labels")
    if prompt is mmlu and len(doc["choices"]) != 4:
        raise ValueError(f"choices has {len(doc['choices'])} entries, MMLU's prompt needs 4")
    if prompt is winogrande and "_" not in doc["sentence"]:
        raise ValueError("sentence has no '_' blank")
    if prompt is wsc273 and len(doc["options"]) != 2:
        raise ValueError(f"options has {len(doc['options'])} entries, WSC273 needs 2")
    field, options = ANSWERS[prompt]
    value = doc[field]
    if prompt is logiqa:
        value = value.strip()  # as the harness reads it
    if isinstance(value, bool) or value not in options(doc):
        raise ValueError(f"{field} {value!r} is not one of its choices {options(doc)}")


def parse_tasks(spec: str | None) -> list[str]:
    known = f"known tasks: {', '.join(ALL_TASKS)} (or 'all')"
    if spec is None or spec.strip() == "all":
        return list(ALL_TASKS)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise door.ModelError(f"--tasks is empty; {known}")
    for name in names:
        if name not in TASKS:
            raise door.ModelError(f"unknown task {name!r}; {known}")
    return names


def hub_documents(name: str, split: str | None = None) -> tuple[str, list]:
    """The harness's dataset of a task (or its `split`), from the hub or its cache, as (where,
    document) pairs."""
    path, config, harness_split = TASKS[name][1]
    split = split or harness_split
    try:
        import datasets
        # offline: the cache at once, not a minute of retries; not probed again once it fails
        if not datasets.config.HF_HUB_OFFLINE and not checkpoint.hub_reachable():
            datasets.config.HF_HUB_OFFLINE = True
        rows = datasets.load_dataset(path, config, split=split)
    except Exception as e:  # offline, or the hub changed
        todo = f"pass --data-dir DIR holding {name}.jsonl"
        if split != harness_split:
            todo = f"pass --train-dir DIR holding {name}_{split}.jsonl"
        raise door.ModelError(f"could not load {name} from the hub ({type(e).__name__} in "
                             f"datasets.load_dataset{path, config, split}); {todo}") from None
    return f"{path} ({config}, {split})", [(f"row {i}", dict(d)) for i, d in enumerate(rows)]


def read_jsonl(source: Path, name: str) -> list:
    """The documents of a task file, one JSON object a line, as (where, document) pairs."""
    if not source.is_file():
        raise door.ModelError(f"{source} does not exist: --data-dir must hold a {name}.jsonl "
                             "(tests/data/eval has one)")
    docs = []
    for i, line in enumerate(source.read_bytes().split(b"\n"), 1):
        try:
            if line.strip():
                docs.append((f"line {i}", json.loads(line)))
        except (ValueError, RecursionError) as e:  # not JSON or UTF-8, or nested too deep
            why = getattr(e, "msg", e)
            raise door.ModelError(f"{source} line {i} is not valid JSON ({why}); fix it") from None
    return docs


def load_task(name: str, data_dir: str | None = None, limit: int | None = None,
              split: str | None = None) -> list[Prompt]:
    """A task's documents (<data_dir>/<name>.jsonl, else the harness's dataset from the hub; with a
    split, <data_dir>/<name>_<split>.jsonl or that split), each checked and made its prompt (bad
    data fails at once, naming its file and line); the first `limit` of them."""
    if data_dir is None:
        source, docs = hub_documents(name, split)
    elif split:
        source = Path(data_dir) / f"{name}_{split}.jsonl"
        docs = read_jsonl(source, name)
    else:
        source = Path(data_dir) / f"{name}.jsonl"
        docs = read_jsonl(source, name)
    if not docs:
        raise door.ModelError(f"{source} holds no documents")
    prompt, prompts = TASKS[name][0], []
    for where, doc in docs:
        try:
            check_document(prompt, doc)
            prompts.append(prompt(doc))
        except KeyError as e:
            raise door.ModelError(f"{source} {where}: document has no field {e}; "
                                 f"see tests/data/eval/{name}.jsonl") from None
        except (ValueError, TypeError, AttributeError, IndexError) as e:  # TypeError: a list, ...
            raise door.ModelError(f"{source} {where}: malformed {name} document ({e})") from None
    return prompts[:limit]


# --------------------------------------------------------------------------------------------------
# One document scored as the harness scores it; a task's metrics as lm_eval/api/metrics.py has them.

def encode_pair(enc, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """TemplateLM._encode_pair: trailing whitespace moves from the context to the continuation,
    whose tokens are what the whole string has beyond the context's. A special token's text
    becomes the special token, as in HF."""
    context, continuation = context.rstrip(), context[len(context.rstrip()):] + continuation
    whole = enc.encode(context + continuation, allowed_special="all")
    ctx = enc.encode(context, allowed_special="all")
    return ctx, whole[len(ctx):]


def tokenize(enc, prompts: list[Prompt]) -> list[list[tuple[list[int], list[int]]]]:
    """Every request of every document as (context tokens, continuation tokens)."""
    return [[encode_pair(enc, *r) for r in p.requests] for p in prompts]


def check_requests(tokenized, max_len: int):
    """The door to harness_window: every request has a context and 1 to max_len continuation
    tokens (checked by every process under torchrun, before any request is scored)."""
    for doc in tokenized:
        for context, continuation in doc:
            if not 0 < len(continuation) <= max_len:
                raise door.ModelError(f"a continuation of {len(continuation)} tokens cannot be "
                                     f"scored: it needs 1 to {max_len}, the model's context length")
            if not context:  # the harness puts its prefix token there
                raise door.ModelError("a request with an empty context cannot be scored as the "
                                     "harness scores it; fix its document")


def harness_window(context_tokens: list[int], continuation_tokens: list[int], max_len: int):
    """HFLM._loglikelihood_tokens: the input (context + continuation)[-(max_len + 1):][:-1], and
    its last len(continuation) positions with the token each predicts."""
    inp = (context_tokens + continuation_tokens)[-(max_len + 1):][:-1]
    first = len(inp) - len(continuation_tokens)
    return inp, [(first + j, t) for j, t in enumerate(continuation_tokens)]


@torch.inference_mode()
def loglikelihood(model, context_tokens, continuation_tokens, device="cpu") -> tuple[float, bool]:
    """One request: Σ_j log p(continuation_j | all before it) from one full forward pass over its
    window, and whether every continuation token is the argmax (the harness's is_greedy)."""
    inp, targets = harness_window(context_tokens, continuation_tokens, model.config.block_size)
    logits = model(torch.tensor([inp], device=device))                          # (1, T, V)
    logp = F.log_softmax(logits[0].float(), dim=-1)                              # (T, V)
    pos = torch.tensor([p for p, _ in targets], device=device)
    tok = torch.tensor([t for _, t in targets], device=device)
    return float(logp[pos, tok].sum()), bool((logp[pos].argmax(-1) == tok).all())


def doc_metrics(lls: list[float], gold: int, choices: list[str] | None):
    """(acc, acc_norm): acc = [argmax of the log-likelihoods is gold]; acc_norm the same after
    dividing each by len(choice) in characters (None: the task has none). Ties go to the first."""
    acc = float(int(np.argmax(lls)) == gold)
    if choices is None:
        return acc, None
    return acc, float(int(np.argmax(np.array(lls) / [len(c) for c in choices])) == gold)


def stderr(xs, groups=None) -> float | None:
    """metrics.mean_stderr: sample stdev (n - 1) over sqrt n; None (the harness's N/A) for n < 2.
    With groups (MMLU's subjects) pooled_sample_stderr of the groups' stderrs (the harness pools
    them into four categories first: the 3rd digit moves); where a group has one value (N/A in the
    harness) the stderr over all values."""
    if groups is None:
        return statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else None
    by = [[x for x, g in zip(xs, groups) if g == group] for group in dict.fromkeys(groups)]
    if min(len(v) for v in by) < 2:
        return stderr(xs)
    n, se = [len(v) for v in by], [stderr(v) for v in by]
    return math.sqrt(sum((k - 1) * s ** 2 * k for k, s in zip(n, se)) / (sum(n) - len(n)) / sum(n))


# --------------------------------------------------------------------------------------------------
# A task's documents: one request at a time (--plain), or batched with shared prefixes.

def score_plain(model, tokenized, device="cpu", desc=None) -> list:
    """loglikelihood() of every request of this process's share of the documents, None elsewhere."""
    mine = set(devices.shard(range(len(tokenized))))
    scored = []
    bar = tqdm(tokenized, desc=desc, disable=desc is None, unit="doc", leave=False)
    for d, doc in enumerate(bar):
        if d in mine:
            scored.append([loglikelihood(model, c, t, device) for c, t in doc])
        else:
            scored.append([None] * len(doc))
    return scored


def score_requests(model, tokenized, batch_size=16, device="cpu", desc=None, plain=False):
    """(log-likelihood, is_greedy) of every request of every document (lists of (context,
    continuation) tokens), by loglikelihood() or by fast_scorer.py; under torchrun each process
    scores a share and all get every score."""
    if plain:
        scored = score_plain(model, tokenized, device, desc)
    else:
        L = model.config.block_size
        windows = [[harness_window(c, t, L) for c, t in doc] for doc in tokenized]
        scored = score_windows(model, windows, batch_size, device, desc,
                               rank=devices.get_rank(), world_size=devices.get_world_size())
    shares = devices.all_gather(scored)
    # each request's score from the process that scored it
    return [[next(r for r in rs if r is not None) for rs in zip(*docs)] for docs in zip(*shares)]


def evaluate_task(model, enc, prompts, batch_size=16, device="cpu", desc=None, plain=False):
    """A task's result (n, acc, acc_norm, their stderrs, seconds) and its per-document samples."""
    t0 = time.perf_counter()
    tokenized = tokenize(enc, prompts)
    scores = score_requests(model, tokenized, batch_size, device, desc, plain)
    samples = []
    for i, (p, res) in enumerate(zip(prompts, scores)):
        lls = [ll for ll, _ in res]
        acc, acc_norm = doc_metrics(lls, p.gold, p.choices)
        samples.append({"doc_index": i, "requests": [list(r) for r in p.requests],
                        "loglikelihoods": lls, "is_greedy": [g for _, g in res], "gold": p.gold,
                        "acc": acc, "acc_norm": acc_norm})
    groups = [p.group for p in prompts] if prompts[0].group else None
    result = {"n": len(samples)}
    for key in ("acc", "acc_norm"):
        xs = [s[key] for s in samples]
        if xs[0] is None:  # the task has no acc_norm
            result[key], result[key + "_stderr"] = None, None
        else:
            result[key] = sum(xs) / len(xs)
            result[key + "_stderr"] = stderr(xs, groups if key == "acc" else None)
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return result, samples


# --------------------------------------------------------------------------------------------------
# Next-token loss on a file, and speed.

def read_ppl(cfg: EvalConfig, enc, vocab_size: int) -> np.ndarray:
    """The --ppl file's tokens (text encoded as the tasks' text is), checked against the model."""
    todo = "pass a file made with this model's tokenizer (data/*/prepare.py)"
    datafiles.check_tokenizer(cfg.ppl, enc, cfg.model, todo)
    tokens = datafiles.read_tokens(cfg.ppl, enc, cfg.ppl_max_tokens, special=True)
    if len(tokens) < 2:
        raise door.ModelError("the --ppl file holds fewer than 2 tokens; give it more text")
    if int(tokens.max()) >= int(vocab_size):
        raise door.ModelError(f"the --ppl file holds token id {int(tokens.max())}, beyond the "
                             f"model's vocabulary of {vocab_size}: was it prepared with another "
                             "tokenizer?")
    return tokens


@torch.inference_mode()
def perplexity(model, tokens: np.ndarray, context=None, device="cpu", batch_size=8) -> dict:
    """Mean next-token loss over windows of `context` tokens (each predicts its tokens 1..T from
    0..T-1; the last may be shorter) and its exp, batch_size windows a forward pass (GPT.nll).
    Under torchrun each process runs a share of the batches; the losses are added in window order,
    as one process adds them."""
    L = context or model.config.block_size
    n_pred = len(tokens) - 1
    starts = list(range(0, n_pred, L))
    # batches of whole windows, then the last window alone: it may be shorter
    groups = [starts[:-1][i:i + batch_size] for i in range(0, len(starts) - 1, batch_size)]
    groups.append(starts[-1:])
    nll = {}  # batch number -> its windows' summed losses
    mine = devices.shard(range(len(groups)))
    for i in tqdm(mine, desc="ppl", unit="batch", leave=False, disable=not devices.is_main()):
        T = min(L, n_pred - groups[i][0])
        x = np.stack([tokens[s:s + T] for s in groups[i]]).astype(np.int64)
        y = np.stack([tokens[s + 1:s + 1 + T] for s in groups[i]]).astype(np.int64)
        nll[i] = model.nll(torch.tensor(x, device=device), torch.tensor(y, device=device)).tolist()
    # every process's batches, added in window order
    nll = {i: v for share in devices.all_gather(nll) for i, v in share.items()}
    total = sum(v for i in range(len(groups)) for v in nll[i])
    return {"tokens": n_pred, "context": min(L, n_pred), "loss": total / n_pred,
            "ppl": float(np.exp(total / n_pred))}


def timed(device, fn, *args) -> float:
    """Seconds that fn(*args) takes, the device's queued work done before and after."""
    devices.sync(device)
    t0 = time.perf_counter()
    fn(*args)
    devices.sync(device)
    return time.perf_counter() - t0


@torch.inference_mode()
def speed(model, n_tokens: int = 1000, device="cpu") -> dict:
    """Seconds for one n-token sequence: prefill (after a warm-up), and greedy decoding of all but
    its first token."""
    x = torch.randint(0, int(model.config.vocab_size), (1, n_tokens), device=device)
    prefill = lambda: model.lm_head(model.hidden(x)[:, -1])  # noqa: E731
    timed(device, prefill)  # a warm-up
    prefill_s = timed(device, prefill)
    generate_s = timed(device, model.generate, x[:, :1], n_tokens - 1)
    return {"tokens": n_tokens, "prefill_s": prefill_s, "generate_s": generate_s}


# --------------------------------------------------------------------------------------------------
# Fine-tuning on each task first, the paper's protocol (Sec. 4.2, App. C): every weight trained on
# the multiple-choice cross-entropy of the scores acc ranks; accuracy after each epoch.

# Tables 8 and 9: each task's learning rate and batch size (documents a step), GPT-2 and Pythia-1B
PAPER_FINETUNE = {
    "gpt2": {"piqa": (1e-4, 128), "logiqa": (5e-5, 64), "arc_easy": (1e-4, 64),
             "arc_challenge": (1e-5, 64), "winogrande": (5e-4, 128), "mmlu": (1e-6, 64),
             "wsc273": (1e-6, 128)},
    "neox": {"piqa": (1e-5, 64), "logiqa": (5e-5, 32), "arc_easy": (5e-5, 32),
             "arc_challenge": (5e-5, 32), "winogrande": (5e-5, 64), "mmlu": (5e-6, 32),
             "wsc273": (5e-5, 64)},
}
OUR_FINETUNE = (1e-5, 32)  # other families: the paper is silent

# the hub's (training, validation) splits; validation None where it is the scored split or absent
TRAIN_SPLITS = {
    "piqa": ("train", None),
    "arc_easy": ("train", "validation"),
    "arc_challenge": ("train", "validation"),
    "logiqa": ("train", "validation"),
    "mmlu": ("auxiliary_train", "validation"),
    "winogrande": ("train", None),
    "wsc273": None,  # WSC273 has only its test split: scored zero-shot
}


def load_training(cfg: EvalConfig, prompts: dict) -> dict:
    """{task: {"train": prompts, "validation": prompts (where there is a validation split), "eval":
    the scored prompts}} of every task that has a training split, checked as the scored ones are."""
    splits = {}
    for name in prompts if cfg.finetune_epochs else []:
        if TRAIN_SPLITS[name] is None:
            print(f"{name} has no training split: it is scored zero-shot")
            continue
        train, validation = TRAIN_SPLITS[name]
        if cfg.train_dir:
            if not (Path(cfg.train_dir) / f"{name}_train.jsonl").is_file():
                raise door.ModelError(f"--train-dir {cfg.train_dir} holds no {name}_train.jsonl, "
                                     f"the training split of {name}; add it or drop {name}")
            train = "train"
            has = (Path(cfg.train_dir) / f"{name}_validation.jsonl").is_file()
            validation = "validation" if has else None
        splits[name] = {"train": load_task(name, cfg.train_dir, cfg.finetune_limit, train),
                        "eval": prompts[name]}
        if validation:
            splits[name]["validation"] = load_task(name, cfg.train_dir, cfg.limit, validation)
    return splits


def request_tensors(docs, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request of `docs` (tokenized) as its harness window, right-padded: inputs (N, T) and
    targets (N, T), -1 where nothing is scored. Padding on the right changes no score: the model
    is causal."""
    windows = [harness_window(c, t, max_len) for doc in docs for c, t in doc]
    T = max(len(inp) for inp, _ in windows)
    x = torch.zeros(len(windows), T, dtype=torch.long)
    y = torch.full((len(windows), T), -1, dtype=torch.long)
    for i, (inp, targets) in enumerate(windows):
        x[i, :len(inp)] = torch.tensor(inp)
        for pos, token in targets:
            y[i, pos] = token
    return x, y


def document_loss(model, doc, gold: int, device="cpu") -> torch.Tensor:
    """One document's loss: the cross-entropy of its choices' scores against the gold choice, each
    score the summed continuation log-likelihood that acc ranks, as loglikelihood() computes it."""
    scores = []
    for context_tokens, continuation_tokens in doc:
        L = model.config.block_size
        inp, targets = harness_window(context_tokens, continuation_tokens, L)
        logits = model(torch.tensor([inp], device=device))                      # (1, T, V)
        logp = F.log_softmax(logits[0].float(), dim=-1)                          # (T, V)
        pos = torch.tensor([p for p, _ in targets], device=device)
        tok = torch.tensor([t for _, t in targets], device=device)
        scores.append(logp[pos, tok].sum())
    return F.cross_entropy(torch.stack(scores), torch.tensor(gold, device=device))


def batch_loss(model, docs, golds, device="cpu") -> torch.Tensor:
    """The summed document_loss of `docs`, all their requests in one forward pass (GPT.nll: a
    sequence's logits at a time, not a batch's)."""
    x, y = request_tensors(docs, model.config.block_size)
    scores = -model.nll(x.to(device), y.to(device))                             # (N,)
    per_doc = scores.split([len(doc) for doc in docs])
    losses = [F.cross_entropy(s, torch.tensor(g, device=device)) for s, g in zip(per_doc, golds)]
    return torch.stack(losses).sum()


def chunks(docs: list, max_requests: int) -> list[list[int]]:
    """Indices of docs in runs of at most max_requests requests (at least one document each)."""
    runs = [[]]
    for i, doc in enumerate(docs):
        if runs[-1] and sum(len(docs[j]) for j in runs[-1]) + len(doc) > max_requests:
            runs.append([])
        runs[-1].append(i)
    return [r for r in runs if r]


def train_step(model, optim, docs, golds, cfg, device) -> float:
    """One Adam step on the mean loss of a batch of documents; under torchrun each process takes a
    share and the gradients are averaged. Returns the batch's mean loss (every process's)."""
    mine = devices.shard(list(range(len(docs))))
    # all_mean divides the processes' summed gradients by their number: scale up to the batch mean
    scale = devices.get_world_size() / len(docs)
    total = torch.zeros((), device=device)
    cuda = torch.device(device).type == "cuda"
    optim.zero_grad(set_to_none=False)
    for part in chunks([docs[i] for i in mine], cfg.batch_size):
        ids = [mine[i] for i in part]
        with torch.autocast(torch.device(device).type, torch.bfloat16, enabled=cuda):
            loss = batch_loss(model, [docs[i] for i in ids], [golds[i] for i in ids], device)
        (loss * scale).backward()
        total += loss.detach() * scale
    devices.all_mean([p.grad for p in model.parameters()])
    devices.all_mean([total])
    optim.step()
    return float(total)


def finetune(model, enc, splits, lr: float, epochs: int, B: int, cfg, device, desc=None) -> dict:
    """A copy of the model, every weight its own (a student's teacher weights too), fine-tuned on
    splits["train"] for `epochs` epochs of Adam at lr (constant, no weight decay: the paper is
    silent), B documents a step; after each epoch its result on the scored split ("eval") and on
    "validation"."""
    model = copy.deepcopy(model).float().train().requires_grad_(True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # a process without documents in a step adds zeros
    optim = torch.optim.Adam(model.parameters(), lr=lr)
    tokenized, golds = tokenize(enc, splits["train"]), [p.gold for p in splits["train"]]
    steps = math.ceil(len(golds) / B)
    out = {"lr": lr, "epochs": [], "stopped": None}
    bar = tqdm(total=epochs * steps, desc=desc, disable=desc is None, unit="step", leave=False)
    for epoch in range(1, epochs + 1):
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(cfg.seed + epoch)
        order = torch.randperm(len(golds), generator=gen).tolist()
        losses = []
        for i in range(0, len(order), B):
            batch = order[i:i + B]
            losses.append(train_step(model, optim, [tokenized[j] for j in batch],
                                     [golds[j] for j in batch], cfg, device))
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if not math.isfinite(losses[-1]):
                out["stopped"] = f"lr {lr:g}: the loss is {losses[-1]} in epoch {epoch}; stopped"
                print(out["stopped"])
                return out
        seconds = time.perf_counter() - t0
        out["epochs"].append(score_epoch(model, enc, splits, epoch, losses, seconds, cfg, device))
        bar.set_postfix(loss=f"{losses[-1]:.4f}", acc=f"{out['epochs'][-1]['eval']['acc']:.4f}")
    return out


def score_epoch(model, enc, splits, epoch, losses, seconds, cfg, device) -> dict:
    """One epoch's record: its mean loss and training seconds, and the model's result on each
    scored split."""
    model.eval()
    record = {"epoch": epoch, "loss": sum(losses) / len(losses), "train_seconds": seconds}
    for split in ("eval", "validation"):
        if split in splits:
            record[split] = evaluate_task(model, enc, splits[split], cfg.batch_size, device,
                                          None, cfg.plain)[0]
    model.train()
    return record


def best_epoch(epochs: list[dict], split: str) -> int:
    """The index of the epoch whose acc on `split` is highest (the first of ties)."""
    accs = [e[split]["acc"] for e in epochs]
    return accs.index(max(accs))


def rules(epochs: list[dict]) -> dict:
    """The paper's rule (the best epoch on the scored split; with one epoch, MMLU's, the last) and,
    where a validation split was scored, the honest one (the epoch best on validation, its
    result on the scored split)."""
    out = {}
    if not epochs:
        return out
    i = best_epoch(epochs, "eval")
    out["paper"] = {"epoch": epochs[i]["epoch"], **epochs[i]["eval"]}
    if "validation" in epochs[0]:
        i = best_epoch(epochs, "validation")
        out["validation"] = {"epoch": epochs[i]["epoch"], **epochs[i]["eval"]}
    return out


def finetune_task(cfg, models: dict, enc, name: str, splits: dict, device) -> dict:
    """Every model fine-tuned on one task: the learning-rate grid on the teacher, the lr of its best
    result (by the paper's rule) reused for the student."""
    family = models["teacher"].config.family
    lr, B = PAPER_FINETUNE.get(family, {}).get(name, OUR_FINETUNE)
    lrs = parse_lrs(cfg.finetune_lr) or [lr]
    B = cfg.finetune_batch_size or B
    epochs = 1 if name == "mmlu" else cfg.finetune_epochs
    desc = f"fine-tune teacher {name}" if devices.is_main() else None
    grid = [finetune(models["teacher"], enc, splits, lr, epochs, B, cfg, device, desc)
            for lr in lrs]
    for point in grid:
        point["rules"] = rules(point["epochs"])
    done = [point for point in grid if point["stopped"] is None]
    if not done:
        print(f"{name}: no learning rate of the grid kept the teacher's loss finite; the task is "
              "not fine-tuned")
        return {"teacher": {"grid": grid, "lr": None}}
    best = max(done, key=lambda point: point["rules"]["paper"]["acc"])
    out = {"teacher": {**best, "batch_size": B, "grid": grid}}
    for label in [k for k in models if k != "teacher"]:
        desc = f"fine-tune {label} {name}" if devices.is_main() else None
        result = finetune(models[label], enc, splits, best["lr"], epochs, B, cfg, device, desc)
        out[label] = {**result, "rules": rules(result["epochs"]), "batch_size": B}
    return out


def finetune_tasks(cfg, models, enc, training, device, zero_shot, argv) -> dict:
    """finetune_task of every task with a training split, each model's zero-shot result beside its
    fine-tuned ones, the command, and a table of them."""
    argv = sys.argv[1:] if argv is None else argv
    out = {"command": shlex.join(["python", "evaluate.py", *argv]), "tasks": {}}
    for name, splits in training.items():
        t0 = time.perf_counter()
        task = finetune_task(cfg, models, enc, name, splits, device)
        for label, result in task.items():
            part = zero_shot if label == "teacher" else zero_shot[label]
            result["zero_shot"] = part["results"][name]
        task["seconds"] = round(time.perf_counter() - t0, 3)
        out["tasks"][name] = task
    print_finetune(out["tasks"])
    return out


def print_finetune(tasks: dict):
    """Each task and model: zero-shot acc, the lr, acc after each epoch, both rules' acc."""
    fmt = lambda r: "-" if r is None else f"{r['acc']:.4f}"  # noqa: E731
    head = f"{'task':<14} {'model':<8} {'zero-shot':>9} {'lr':>8}"
    print(head + "  acc after each epoch -> paper's rule | validation's rule")
    for name, task in tasks.items():
        for label, r in task.items():
            if label == "seconds" or r.get("lr") is None:
                continue
            accs = " ".join(fmt(e["eval"]) for e in r["epochs"])
            paper, honest = r["rules"].get("paper"), r["rules"].get("validation")
            print(f"{name:<14} {label:<8} {fmt(r['zero_shot']):>9} {r['lr']:>8.1e}  {accs} -> "
                  f"{fmt(paper)} | {fmt(honest)}")


# --------------------------------------------------------------------------------------------------
# The command line.

def check_output(output, model, ckpt, data_dir, ppl=None, flag="--output"):
    """A ModelError, before any work, where `output` cannot be written or would replace a file
    that the run reads."""
    files.check_out(output, flag=flag, file=True)
    out = Path(output).resolve()
    reads = {Path(p).resolve() for p in (ppl, model) if p}
    if ckpt:
        reads |= {Path(ckpt, f).resolve() for f in ("config.json", "features.safetensors")}
    folders = {Path(d).resolve() for d in (model, data_dir) if d}
    if out.is_file() and (out in reads or out.parent in folders):
        raise door.ModelError(f"{flag} {output} would replace a file this run reads (the "
                             "checkpoint's, the teacher's, its data or tasks); pass another path")


def load_models(cfg: EvalConfig, device) -> dict:
    """{"teacher": --model, "student": load_student(--ckpt) on it}; --ckpt's teacher checked
    first (checkpoint.check_teacher)."""
    dtype = getattr(torch, cfg.dtype)
    if cfg.ckpt is not None:
        todo = "pass a complete distill.py checkpoint as --ckpt"
        prev = files.read_json(Path(cfg.ckpt) / "config.json", todo)
        if prev.get("teacher") is not None:
            checkpoint.check_teacher(prev, cfg.model, f"checkpoint {cfg.ckpt}")
    models = {"teacher": GPT.from_pretrained(cfg.model, device=device, dtype=dtype)}
    if cfg.ckpt is not None:
        models["student"] = load_student(cfg.ckpt, device, dtype, teacher=models["teacher"])[0]
    return models


def run_tasks(cfg: EvalConfig, models: dict, enc, prompts: dict, device) -> dict:
    """Every task for every model: results.json's results and samples (the student's apart), and
    a table of them."""
    report = {}
    for label, m in models.items():
        part = report if label == "teacher" else report.setdefault(label, {})
        for name, ps in prompts.items():
            desc = f"{label} {name}" if devices.is_main() else None
            result, samples = evaluate_task(m, enc, ps, cfg.batch_size, device, desc, cfg.plain)
            part.setdefault("results", {})[name] = result
            part.setdefault("samples", {})[name] = samples
    fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    head = [f" | {k + ' acc':>14} {'acc_norm':>8} {'stderr':>7}" for k in models]
    print(f"{'task':<14} {'n':>5}" + "".join(head))
    for name in prompts:
        rs = [part["results"][name] for part in (report, report.get("student")) if part]
        cells = [f" | {fmt(r['acc']):>14} {fmt(r['acc_norm']):>8} {fmt(r['acc_stderr']):>7}"
                 for r in rs]
        print(f"{name:<14} {rs[0]['n']:>5}" + "".join(cells))
    return report


def main(argv=None):
    """Flags, tasks, models and what the model's config bounds, all checked first; then each
    model's next-token loss, tasks (zero-shot, then fine-tuned on each) and speed, printed and
    written to --output."""
    cfg = door.parse_config(EvalConfig, argv, description=__doc__.strip().split("\n\n")[0])
    lengths = passkey.check_flags(cfg)
    names = [] if cfg.tasks is None and (cfg.ppl or cfg.speed or lengths) else parse_tasks(cfg.tasks)
    prompts = {name: load_task(name, cfg.data_dir, cfg.limit) for name in names}
    training = load_training(cfg, prompts)
    # the model is cast to --dtype: no autocast
    device = devices.init_distributed(devices.pick_device(cfg.device, "float32")[0])
    models = load_models(cfg, device)
    enc, config = tokenizer.load_tokenizer(cfg.model), models["teacher"].config
    cfg.check(config)
    trials = passkey.make_trials(enc, lengths, cfg, config.block_size)
    for ps in [*prompts.values(), *[ps for s in training.values() for ps in s.values()]]:
        check_requests(tokenize(enc, ps), config.block_size)
    tokens = read_ppl(cfg, enc, config.vocab_size) if cfg.ppl else None
    report = {}
    if cfg.ppl:
        report["ppl"] = {}
        for k, m in models.items():
            r = perplexity(m, tokens, cfg.ppl_context, device, cfg.batch_size)
            print(f"ppl {k}: loss {r['loss']:.4f}, perplexity {r['ppl']:.3f} "
                  f"({r['tokens']} tokens, T {r['context']})")
            report["ppl"][k] = r
    if prompts:
        report.update(run_tasks(cfg, models, enc, prompts, device))
    if training:
        report["finetune"] = finetune_tasks(cfg, models, enc, training, device, report, argv)
    if devices.is_main() and cfg.speed:  # timings: rank 0 alone
        report["speed"] = {k: speed(m, cfg.speed_tokens, device) for k, m in models.items()}
        for k, r in report["speed"].items():
            print(f"speed {k}: {r['tokens']} tokens: prefill {r['prefill_s']:.3f} s, "
                  f"decoding {r['generate_s']:.3f} s")
    if trials:
        report["passkey"] = passkey.run(models, enc, trials, cfg, device)
    if devices.is_main() and cfg.output:  # the other processes' shares are in rank 0's report
        everything = {**report, "config": asdict(cfg), "world_size": devices.get_world_size()}
        files.write_text_atomic(cfg.output, json.dumps(everything, indent=1, ensure_ascii=False))
        print(f"wrote {cfg.output}")


if __name__ == "__main__":
    door.run_main(main)
