"""
evaluate.py: zero-shot multiple-choice accuracy scored exactly as lm-evaluation-harness 0.4 scores it, next-token
loss / perplexity on a token or text file, and prefill / decoding speed; for teachers and distilled students alike.

    python evaluate.py --model gpt2 --ckpt out/gpt2 --data-dir tests/data/eval      # teacher | student table
    python evaluate.py --model gpt2 --ckpt out/gpt2 --ppl data/wikitext2/wiki.test.raw --speed
    torchrun --nproc_per_node 4 evaluate.py --model gpt2 --data-dir tests/data/eval --output results.json

Each step of lm-eval (tasks/<task>, api/{task,metrics,model}.py, models/huggingface.py) is a function: the prompts
piqa ... wsc273, encode_pair, harness_window, loglikelihood (one pass a request, --plain; by default fast_scorer.py),
doc_metrics, stderr. Under torchrun each process scores a share; rank 0 writes the one-process results.json.
"""
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from checkpoint import hub_reachable
from common import (ModelError, all_gather, check_out, check_positive, check_tokenizer, get_rank, get_world_size,
                    init_distributed, is_main, opt, parse_config, pick_device, read_json, read_tokens, run_main, shard,
                    sync, write_text_atomic)
from fast_scorer import score_windows
from model import GPT, load_student
from tokenizer import load_tokenizer


@dataclass
class EvalConfig:
    # what to evaluate
    model: str = opt("gpt2", "teacher: hub id, checkpoint directory, .gguf file or smollm2-135m (GPT.from_pretrained)")
    ckpt: str | None = opt(None, "distill.py checkpoint directory; its student is evaluated next to the teacher")
    tasks: str | None = opt(None, "comma-separated tasks, or all (the default unless --ppl or --speed is given)")
    limit: int | None = opt(None, "score the first N documents of each task (MMLU: of the file, not per subject)")
    data_dir: str | None = opt(None, "folder of <task>.jsonl (e.g. tests/data/eval); default: the hub's datasets")
    output: str | None = opt(None, "write results and per-document samples to this JSON file")
    # how
    batch_size: int = opt(16, "sequences per forward pass")
    device: str = opt("auto", "torch device: auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    dtype: str = opt("float32", "model dtype (log-softmax is float32)", choices=["float32", "bfloat16", "float16"])
    plain: bool = opt(False, "one full forward pass per request, the plain harness way (slow; the same numbers in "
                      "float32, within rounding in bf16)")
    # other measurements
    ppl: str | None = opt(None, "next-token loss and perplexity on a uint16 .bin token file or a text file")
    ppl_context: int | None = opt(None, "window length for --ppl; if not given, the model's context length")
    ppl_max_tokens: int | None = opt(None, "score only the first N tokens of the --ppl file")
    speed: bool = opt(False, "time prefill and token-by-token generation of one sequence")
    speed_tokens: int = opt(1000, "sequence length for --speed")

    def __post_init__(self):
        check_positive(self, ("limit", "batch_size", "ppl_context"), 1)           # checked before any work
        check_positive(self, ("ppl_max_tokens", "speed_tokens"), 2)
        pick_device(self.device, "float32")
        if self.output:
            check_output(self.output, self.model, self.ckpt, self.data_dir, self.ppl)
        p = Path(self.ppl or ".")
        why = "is a directory" if p.is_dir() else "does not exist" if not p.exists() else "is empty"
        if self.ppl and (p.is_dir() or not p.exists() or p.stat().st_size == 0):
            raise ModelError(f"--ppl {p} {why}; pass a uint16 token file (data/*/prepare.py) or a text file")


# --------------------------------------------------------------------------------------------------------------
# Tasks: one prompt function each, the harness's requests for one document.

@dataclass
class Prompt:
    requests: list[tuple[str, str]]  # (context, continuation), one per choice
    gold: int                        # index of the right request
    choices: list[str] | None        # choice texts whose lengths normalise acc_norm; None: the task has no acc_norm
    group: str | None = None         # MMLU subject (the harness's group stderr pools per-subject stderrs)


def _index(options, value, what: str) -> int:
    if isinstance(value, bool) or value not in list(options):  # a ValueError: load_task names the file and line
        raise ValueError(f"{what} {value!r} is not one of its choices {list(options)}")
    return list(options).index(value)


def piqa(doc) -> Prompt:  # lm_eval/tasks/piqa/piqa.yaml
    context, choices = f"Question: {doc['goal']}\nAnswer:", [doc["sol1"], doc["sol2"]]
    return Prompt([(context, " " + c) for c in choices], _index(range(2), doc["label"], "label"), choices)


def arc(doc) -> Prompt:  # lm_eval/tasks/arc/arc_easy.yaml (arc_challenge includes it)
    choices, labels = list(doc["choices"]["text"]), list(doc["choices"]["label"])
    if len(choices) != len(labels):
        raise ValueError(f"choices has {len(choices)} texts but {len(labels)} labels")
    context = f"Question: {doc['question']}\nAnswer:"
    return Prompt([(context, " " + c) for c in choices], _index(labels, doc["answerKey"], "answerKey"), choices)


def logiqa(doc) -> Prompt:  # lm_eval/tasks/logiqa/utils_logiqa.py
    choices = list(doc["options"])
    context = "Passage: " + doc["context"] + "\n" + "Question: " + doc["question"] + "\nChoices:\n"
    context += "".join(f"{letter}. {option}\n" for letter, option in zip("ABCD", choices)) + "Answer:"
    gold = _index(["a", "b", "c", "d"][:len(choices)], doc["label"].strip(), "label")
    return Prompt([(context, " " + c) for c in choices], gold, choices)


def mmlu(doc) -> Prompt:  # lm_eval/tasks/mmlu/default/_default_template_yaml + mmlu_<subject>.yaml's description
    c, subject = list(doc["choices"]), doc["subject"]
    if len(c) != 4:
        raise ValueError(f"choices has {len(c)} entries, MMLU's prompt needs 4")
    context = (f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
               f"{doc['question'].strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:")
    return Prompt([(context, " " + x) for x in "ABCD"], _index(range(4), doc["answer"], "answer"), None, subject)


def winogrande(doc) -> Prompt:  # lm_eval/tasks/winogrande/preprocess_winogrande.py
    sentence = doc["sentence"]
    if "_" not in sentence:
        raise ValueError("sentence has no '_' blank")
    i = sentence.index("_")
    requests = [(sentence[:i] + o, " " + sentence[i + 1:].strip()) for o in (doc["option1"], doc["option2"])]
    return Prompt(requests, _index(["1", "2"], doc["answer"], "answer"), None)


def wsc273(doc) -> Prompt:  # lm_eval/tasks/wsc273/default.yaml + utils.py
    text = doc["text"].replace("  ", " ")  # process_doc; pronoun_loc is left as it was, as the harness does
    loc, pronoun = doc["pronoun_loc"], doc["pronoun"]
    if len(doc["options"]) != 2:
        raise ValueError(f"options has {len(doc['options'])} entries, WSC273 needs 2")

    def normalize(option):  # utils.__normalize_option: possessive 's; lowercased when not starting a sentence
        option += "'s" if pronoun.lower() in ["my", "his", "her", "our", "their"] else ""
        first = option.split()[0]
        upper = ["A", "An", "The", "She", "He", "It", "They", "My", "His", "Her", "Their"]
        return option.replace(first, first.lower()) if text[loc - 2] != "." and first in upper else option
    continuation = " " + text[loc + len(pronoun):]  # the target is not stripped: it keeps its own leading space
    return Prompt([(text[:loc] + normalize(o), continuation) for o in doc["options"]],
                  _index(range(2), doc["label"], "label"), None)


TASKS = {  # name: (prompt, datasets.load_dataset(path, name, split=split) as lm-eval 0.4 loads it)
    "piqa": (piqa, ("baber/piqa", None, "validation")),
    "arc_easy": (arc, ("allenai/ai2_arc", "ARC-Easy", "test")),
    "arc_challenge": (arc, ("allenai/ai2_arc", "ARC-Challenge", "test")),
    "logiqa": (logiqa, ("EleutherAI/logiqa", "logiqa", "test")),
    "mmlu": (mmlu, ("cais/mmlu", "all", "test")),  # the harness loads the 57 subjects one by one; "all" holds them
    "winogrande": (winogrande, ("allenai/winogrande", "winogrande_xl", "validation")),
    "wsc273": (wsc273, ("lighteval/winograd_wsc", "wsc273", "test")),
}
ALL_TASKS = tuple(TASKS)


def parse_tasks(spec: str | None) -> list[str]:
    names = ALL_TASKS if spec is None or spec.strip() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    bad = "--tasks is empty" if not names else next((f"unknown task {n!r}" for n in names if n not in TASKS), None)
    if bad:
        raise ModelError(f"{bad}; known tasks: {', '.join(ALL_TASKS)} (or 'all')")
    return list(names)


def load_task(name: str, data_dir: str | None = None, limit: int | None = None) -> list[Prompt]:
    """A task's documents (<data_dir>/<name>.jsonl, else the harness's dataset from the hub) turned into prompts, so
    that bad data fails at once, naming its file and line; the first `limit` of them."""
    path, config, split = TASKS[name][1]
    if data_dir is None:
        try:
            import datasets
            if not datasets.config.HF_HUB_OFFLINE and not hub_reachable():   # the cache at once, not a minute of
                datasets.config.HF_HUB_OFFLINE = True                        # retries; not probed again once it fails
            docs = [(f"row {i}", dict(d)) for i, d in enumerate(datasets.load_dataset(path, config, split=split))]
            source = f"{path} ({config}, {split})"
        except Exception as e:  # offline, or the hub changed
            raise ModelError(f"could not load {name} from the hub ({type(e).__name__} in datasets.load_dataset"
                             f"{path, config, split}); pass --data-dir DIR holding {name}.jsonl") from None
    else:
        source, docs = Path(data_dir) / f"{name}.jsonl", []
        if not source.is_file():
            raise ModelError(f"{source} does not exist: --data-dir must hold a {name}.jsonl (tests/data/eval has one)")
        for i, line in enumerate(source.read_bytes().split(b"\n"), 1):
            try:
                docs += [(f"line {i}", json.loads(line))] if line.strip() else []
            except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested past Python's stack
                raise ModelError(f"{source} line {i} is not valid JSON ({getattr(e, 'msg', e)}); fix it") from None
    if not docs:
        raise ModelError(f"{source} holds no documents")
    prompts = []
    for where, doc in docs:
        try:
            prompts.append(TASKS[name][0](doc))
        except KeyError as e:
            raise ModelError(f"{source} {where}: document has no field {e}; see tests/data/eval/{name}.jsonl") from None
        except (ValueError, TypeError, AttributeError, IndexError) as e:  # TypeError: not a JSON object, ...
            raise ModelError(f"{source} {where}: malformed {name} document ({e})") from None
    return prompts[:limit]


# --------------------------------------------------------------------------------------------------------------
# One document, the harness way (--plain), and a task's metrics as lm_eval/api/metrics.py averages them.

def encode_pair(enc, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """TemplateLM._encode_pair: trailing whitespace moves from the context to the continuation, whose tokens are
    what the whole string has beyond the context's. A special token's text becomes the special token, as in HF."""
    context, continuation = context.rstrip(), context[len(context.rstrip()):] + continuation
    whole, ctx = (enc.encode(s, allowed_special="all") for s in (context + continuation, context))
    return ctx, whole[len(ctx):]


def harness_window(context_tokens: list[int], continuation_tokens: list[int], max_len: int):
    """HFLM._loglikelihood_tokens: the input (context + continuation)[-(max_len + 1):][:-1], and its last
    len(continuation) positions with the token each predicts."""
    if not 0 < len(continuation_tokens) <= max_len:
        raise ModelError(f"a continuation of {len(continuation_tokens)} tokens cannot be scored: it needs 1 to "
                         f"{max_len}, the model's context length")
    if not context_tokens:                                  # the harness puts its prefix token there; fix the data
        raise ModelError("a request with an empty context cannot be scored as the harness scores it; fix its document")
    inp = (context_tokens + continuation_tokens)[-(max_len + 1):][:-1]
    return inp, [(len(inp) - len(continuation_tokens) + j, t) for j, t in enumerate(continuation_tokens)]


@torch.inference_mode()
def loglikelihood(model, context_tokens, continuation_tokens, device="cpu") -> tuple[float, bool]:
    """One request: Σ_j log p(continuation_j | all before it) from one full forward pass over its window, and
    whether every continuation token is the argmax (the harness's is_greedy)."""
    inp, targets = harness_window(context_tokens, continuation_tokens, model.config.block_size)
    logits = model(torch.tensor([inp], device=device))                        # (1, T, V)
    logp = F.log_softmax(logits[0].float(), dim=-1)                             # (T, V)
    pos, tok = (torch.tensor(ix, device=device) for ix in zip(*targets))
    return float(logp[pos, tok].sum()), bool((logp[pos].argmax(-1) == tok).all())


def doc_metrics(lls: list[float], gold: int, choices: list[str] | None) -> tuple[float, float | None]:
    """acc = [argmax of the log-likelihoods is gold]; acc_norm the same after dividing each by len(choice) in
    characters (None: the task has none). np.argmax: ties go to the first."""
    acc = float(int(np.argmax(lls)) == gold)
    return acc, None if choices is None else float(int(np.argmax(np.array(lls) / [len(c) for c in choices])) == gold)


def score_requests(model, tokenized, batch_size=16, device="cpu", desc=None, plain=False):
    """(log-likelihood, is_greedy) of every request of every document (lists of (context, continuation) tokens), by
    loglikelihood() or fast_scorer.py; under torchrun each scores a share (None elsewhere) and all get every score."""
    # every process checks every request (one raised by one process alone would stop without its sentence)
    windows = [[harness_window(c, t, model.config.block_size) for c, t in doc] for doc in tokenized]
    if plain:
        mine = set(shard(range(len(tokenized))))
        scored = [[loglikelihood(model, c, t, device) for c, t in doc] if d in mine else [None] * len(doc)
                  for d, doc in enumerate(tqdm(tokenized, desc=desc, disable=desc is None, unit="doc", leave=False))]
    else:
        scored = score_windows(model, windows, batch_size, device, desc, rank=get_rank(), world_size=get_world_size())
    return [[next(r for r in rs if r is not None) for rs in zip(*docs)] for docs in zip(*all_gather(scored))]


def stderr(xs, groups=None) -> float | None:
    """metrics.mean_stderr, sample stdev (n - 1) over sqrt n; None (the harness's N/A) for n < 2. With groups (MMLU's
    subjects) pooled_sample_stderr of the groups' stderrs (the harness pools them into four categories first: the 3rd
    digit moves); where a group has one value, for which the harness prints N/A, the stderr over all values."""
    by = [[x for x, h in zip(xs, groups) if h == g] for g in dict.fromkeys(groups)] if groups else [xs]
    if min(len(v) for v in by) < 2:
        return stderr(xs) if groups else None
    n, se = [len(v) for v in by], [statistics.stdev(v) / math.sqrt(len(v)) for v in by]
    return math.sqrt(sum((k - 1) * s ** 2 * k for k, s in zip(n, se)) / (sum(n) - len(n)) / sum(n))


def evaluate_task(model, enc, prompts: list[Prompt], batch_size=16, device="cpu", desc=None, plain=False):
    """A task's result (n, acc, acc_norm, their stderrs, seconds) and its per-document samples."""
    t0, tokenized, samples = time.perf_counter(), [[encode_pair(enc, *r) for r in p.requests] for p in prompts], []
    for i, (p, res) in enumerate(zip(prompts, score_requests(model, tokenized, batch_size, device, desc, plain))):
        lls = [ll for ll, _ in res]
        acc, acc_norm = doc_metrics(lls, p.gold, p.choices)
        samples.append({"doc_index": i, "requests": [list(r) for r in p.requests], "loglikelihoods": lls,
                        "is_greedy": [g for _, g in res], "gold": p.gold, "acc": acc, "acc_norm": acc_norm})
    result, groups = {"n": len(samples)}, [p.group for p in prompts] if prompts[0].group else None
    for key in ("acc", "acc_norm"):
        xs = [s[key] for s in samples]
        result[key], result[key + "_stderr"] = ((None, None) if xs[0] is None else
                                                (sum(xs) / len(xs), stderr(xs, groups if key == "acc" else None)))
    return {**result, "seconds": round(time.perf_counter() - t0, 3)}, samples


# --------------------------------------------------------------------------------------------------------------
# Next-token loss on a file, speed, and the command line.

@torch.inference_mode()
def perplexity(model, tokens: np.ndarray, context: int | None = None, device="cpu", batch_size=8) -> dict:
    """Mean next-token loss over windows of `context` tokens (each predicts its tokens 1..T from 0..T-1; the last
    may be shorter) and its exp, batch_size windows per forward pass (GPT.nll). Under torchrun each process runs a
    share of the batches; the losses are added in window order, as one process adds them."""
    L = context or model.config.block_size
    if L > model.config.block_size:
        raise ModelError(f"--ppl-context {L} exceeds the model's context length {model.config.block_size}")
    if len(tokens) < 2 or int(tokens.max()) >= int(model.config.vocab_size):
        raise ModelError("the --ppl file holds fewer than 2 tokens; give it more text" if len(tokens) < 2 else "the "
                         f"--ppl file holds token id {int(tokens.max())}, beyond the model's vocabulary of "
                         f"{model.config.vocab_size}: was it prepared with another tokenizer?")
    n_pred, nll = len(tokens) - 1, {}                              # nll: batch number -> its windows' summed losses
    starts = list(range(0, n_pred, L))
    groups = [starts[:-1][i:i + batch_size] for i in range(0, len(starts) - 1, batch_size)] + [starts[-1:]]
    for i in tqdm(shard(range(len(groups))), desc="ppl", unit="batch", leave=False, disable=not is_main()):
        T = min(L, n_pred - groups[i][0])                          # the last window alone: it may be shorter
        x, y = (torch.tensor(np.stack([tokens[s + o:s + o + T] for s in groups[i]]).astype(np.int64), device=device)
                for o in (0, 1))
        nll[i] = model.nll(x, y).tolist()
    nll = {i: v for share in all_gather(nll) for i, v in share.items()}   # every process's batches
    nll = sum(v for i in range(len(groups)) for v in nll[i])             # in window order, whoever ran them
    return {"tokens": n_pred, "context": min(L, n_pred), "loss": nll / n_pred, "ppl": float(np.exp(nll / n_pred))}


@torch.inference_mode()
def speed(model, n_tokens: int = 1000, device="cpu") -> dict:
    """Seconds for one min(n_tokens, context)-token sequence: prefill (after a warm-up), greedy decoding of the rest."""
    n = min(n_tokens, model.config.block_size)
    x = torch.randint(0, int(model.config.vocab_size), (1, n), device=device)
    seconds = []
    for run in ("prefill", "prefill", "generate"):
        sync(device)
        t0 = time.perf_counter()
        model.lm_head(model.hidden(x)[:, -1]) if run == "prefill" else model.generate(x[:, :1], n - 1)
        sync(device)
        seconds.append(time.perf_counter() - t0)
    return {"tokens": n, "prefill_s": seconds[1], "generate_s": seconds[2]}


def check_output(output, model, ckpt, data_dir, ppl=None, flag="--output"):
    """A ModelError, before any work, where `output` cannot be written or would replace a file the run reads."""
    check_out(output, flag=flag, file=True)
    out = Path(output).resolve()
    reads = {Path(p).resolve() for p in (ppl, model) if p} | {
        Path(ckpt, f).resolve() for f in ("config.json", "features.safetensors") if ckpt}
    if out.is_file() and (out in reads or out.parent in {Path(d).resolve() for d in (model, data_dir) if d}):
        raise ModelError(f"{flag} {output} would replace a file this run reads (the checkpoint's, the teacher's, its "
                         "data or tasks); pass another path")


def load_models(cfg: EvalConfig, device, load=load_student) -> dict:
    """{"teacher": --model, "student": load(--ckpt)'s student}; --ckpt's teacher is checked before any model loads."""
    if cfg.ckpt is not None:
        t = read_json(Path(cfg.ckpt) / "config.json", "pass a complete distill.py checkpoint as --ckpt", dict).get(
            "teacher")
        if t is not None and Path(str(t)).resolve() != Path(cfg.model).resolve():
            raise ModelError(f"checkpoint {cfg.ckpt} was distilled from teacher '{t}' but --model is '{cfg.model}'; "
                             f"pass --model {t}")
    models = {"teacher": GPT.from_pretrained(cfg.model, device=device, dtype=getattr(torch, cfg.dtype))}
    if cfg.ckpt is not None:
        models["student"] = load(cfg.ckpt, device=device, dtype=getattr(torch, cfg.dtype))[0]
    return models


def run_tasks(cfg: EvalConfig, models: dict, enc, prompts: dict[str, list[Prompt]], device) -> dict:
    """Every task for every model: a printed table, results.json's results and samples (the student's apart)."""
    report = {}
    for label, m in models.items():
        part = report if label == "teacher" else report.setdefault(label, {})
        for name, ps in prompts.items():
            part.setdefault("results", {})[name], part.setdefault("samples", {})[name] = evaluate_task(
                m, enc, ps, cfg.batch_size, device, f"{label} {name}" if is_main() else None, cfg.plain)
    fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    print(f"{'task':<14} {'n':>5}" + "".join(f" | {k + ' acc':>14} {'acc_norm':>8} {'stderr':>7}" for k in models))
    for name in prompts:
        rs = [report["results"][name]] + ([report["student"]["results"][name]] if "student" in report else [])
        print(f"{name:<14} {rs[0]['n']:>5}" + "".join(
            f" | {fmt(r['acc']):>14} {fmt(r['acc_norm']):>8} {fmt(r['acc_stderr']):>7}" for r in rs))
    return report


def main(argv=None, load=load_student):
    """evaluate.py; a fork passes its own load (load_student's signature) for its students: per_head.py."""
    cfg = parse_config(EvalConfig, argv, description=__doc__.strip().split("\n\n")[0])  # every option checked
    names = [] if cfg.tasks is None and (cfg.ppl or cfg.speed) else parse_tasks(cfg.tasks)
    prompts = {name: load_task(name, cfg.data_dir, cfg.limit) for name in names}  # bad data fails here, fast
    device = init_distributed(pick_device(cfg.device, "float32")[0])  # the model is cast to --dtype: no autocast
    models, enc = load_models(cfg, device, load), load_tokenizer(cfg.model)
    report = {}
    if cfg.ppl:                                        # first: a bad token file fails before the tasks' work
        check_tokenizer(cfg.ppl, enc, cfg.model, "pass a file made with this model's tokenizer (data/*/prepare.py)")
        tokens = read_tokens(cfg.ppl, enc, cfg.ppl_max_tokens, special=True)  # text encoded as the tasks' text is
        report["ppl"] = {k: perplexity(m, tokens, cfg.ppl_context, device, cfg.batch_size) for k, m in models.items()}
        for k, r in report["ppl"].items():
            print(f"ppl {k}: loss {r['loss']:.4f}, perplexity {r['ppl']:.3f} ({r['tokens']} tokens, T {r['context']})")
    report.update(run_tasks(cfg, models, enc, prompts, device) if prompts else {})
    if is_main() and cfg.speed:                        # timings: rank 0 alone
        report["speed"] = {k: speed(m, cfg.speed_tokens, device) for k, m in models.items()}
        for k, r in report["speed"].items():
            print(f"speed {k}: {r['tokens']} tokens: prefill {r['prefill_s']:.3f} s, decoding {r['generate_s']:.3f} s")
    if is_main() and cfg.output:                       # the other processes' shares are in rank 0's report
        write_text_atomic(cfg.output, json.dumps({**report, "config": asdict(cfg), "world_size": get_world_size()},
                                                 indent=1, ensure_ascii=False))
        print(f"wrote {cfg.output}")


if __name__ == "__main__":
    run_main(main)
