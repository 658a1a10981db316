"""evaluate.py: multiple-choice accuracy scored exactly as lm-evaluation-harness 0.4 scores it,
zero-shot and after fine-tuning on each task (the paper's Table 3), next-token loss on a token or
text file and speed, for teachers and distilled students alike.

    python evaluate.py --model gpt2 --ckpt out/gpt2 --data-dir tests/data/eval  # teacher | student
    python evaluate.py --model gpt2 --ckpt out/gpt2 --ppl data/wikitext2/wiki.test.raw --speed
    torchrun --nproc_per_node 4 evaluate.py --model gpt2 --data-dir tests/data/eval --output r.json
    python evaluate.py --model gpt2 --ckpt out/gpt2 --tasks arc_easy --finetune-epochs 3  # Table 3

Each step of lm-eval is a function: the prompts, encode_pair, harness_window, loglikelihood
(--plain), doc_metrics, stderr; fast_scorer.py computes the same numbers faster (the default).
"""
import copy
import math
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import devices
import door
import fast_scorer
import tasks
import tokenizer


@dataclass
class EvalConfig(door.Config):
    # what to evaluate (checks call tasks.* in a lambda: in this class body `tasks` is --tasks)
    model: str = door.opt("gpt2", "teacher: hub id, checkpoint folder, .gguf file or smollm2-135m")
    ckpt: str | None = door.opt(None, "distill.py checkpoint folder; its student is evaluated too")
    tasks: str | None = door.opt(None, "comma-separated tasks, or all (the default without --ppl "
                                       "or --speed)")
    limit: int | None = door.opt(None, "score the first N documents of each task (MMLU: of the "
                                       "file)", min=1)
    data_dir: str | None = door.opt(None, "folder of <task>.jsonl (tests/data/eval); default: "
                                          "the hub's")
    output: str | None = door.opt(None, "write results and per-document samples to this JSON file",
                                  check=lambda cfg: tasks.check_output(
                                      cfg.output, cfg.model, cfg.ckpt,
                                      (cfg.data_dir, cfg.train_dir), cfg.ppl))
    # how
    batch_size: int = door.opt(16, "sequences per forward pass", min=1)
    device: str = door.opt("auto", "auto (cuda if there is one, else cpu), cpu, cuda:1",
                           check=lambda cfg: devices.pick_device(cfg.device, "float32") and None)
    dtype: str = door.opt("float32", "model dtype (log-softmax is float32)",
                          choices=["float32", "bfloat16", "float16"])
    plain: bool = door.opt(False, "one full forward pass per request, the plain harness way "
                                  "(slow; the same numbers in float32, within rounding in bf16)")
    # other measurements
    ppl: str | None = door.opt(None, "next-token loss and perplexity on a uint16 .bin or a text "
                                     "file", check=lambda cfg: tasks.check_ppl_file(cfg.ppl))
    ppl_context: int | None = door.opt(None, "window length for --ppl; default: the model's "
                                             "context", min=1, context=True)
    ppl_max_tokens: int | None = door.opt(None, "score only the first N tokens of the --ppl "
                                                "file", min=2)
    speed: bool = door.opt(False, "time prefill and token-by-token generation of one sequence")
    speed_tokens: int = door.opt(1000, "sequence length for --speed (at most the model's context)",
                                 min=2, context="speed")
    # fine-tuning on each task before it is scored: the paper's protocol (its Table 3)
    finetune_epochs: int = door.opt(0, "fine-tune each model on each task for N epochs, scoring "
                                       "after each (0: zero-shot; paper: 3; MMLU is always 1)",
                                    min=0, check=lambda cfg: tasks.check_finetune(cfg))
    finetune_lr: str = door.opt("", "Adam learning rate, or a comma list: a grid searched on the "
                                    "teacher, its best reused for the student (default: the "
                                    "paper's Table 8 for GPT-2 and Pythia, else 1e-5, ours)",
                                needs="finetune_epochs", check=lambda cfg: tasks.check_lrs(cfg))
    finetune_batch_size: int | None = door.opt(None, "documents per step (default: the paper's "
                                                     "Table 9 for GPT-2 and Pythia, else 32, "
                                                     "ours)", min=1, needs="finetune_epochs")
    train_dir: str | None = door.opt(None, "folder of <task>_train.jsonl and optionally "
                                           "<task>_validation.jsonl in --data-dir's schema; "
                                           "default: the hub's splits", needs="finetune_epochs",
                                     check=lambda cfg: tasks.check_train_dir(cfg))
    finetune_limit: int | None = door.opt(None, "train on the first N documents of each training "
                                                "split", min=1, needs="finetune_epochs")
    seed: int = door.opt(0, "seed of the order in which the training documents are drawn")


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


# each task's prompt function (tasks.HUB: its dataset)
TASKS = {"piqa": piqa, "arc_easy": arc, "arc_challenge": arc, "logiqa": logiqa, "mmlu": mmlu,
         "winogrande": winogrande, "wsc273": wsc273}


# One document scored as the harness scores it; a task's metrics as lm_eval/api/metrics.py has them.

def encode_pair(enc, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """TemplateLM._encode_pair: trailing whitespace moves from the context to the continuation,
    whose tokens are what the whole string has beyond the context's (special tokens allowed)."""
    context, continuation = context.rstrip(), context[len(context.rstrip()):] + continuation
    whole = enc.encode(context + continuation, allowed_special="all")
    ctx = enc.encode(context, allowed_special="all")
    return ctx, whole[len(ctx):]


def tokenize(enc, prompts: list[Prompt]) -> list[list[tuple[list[int], list[int]]]]:
    """Every request of every document as (context tokens, continuation tokens)."""
    return [[encode_pair(enc, *r) for r in p.requests] for p in prompts]


def harness_window(context_tokens: list[int], continuation_tokens: list[int], max_len: int):
    """HFLM._loglikelihood_tokens: the input (context + continuation)[-(max_len + 1):][:-1], and
    its last len(continuation) positions with the token each predicts."""
    inp = (context_tokens + continuation_tokens)[-(max_len + 1):][:-1]
    first = len(inp) - len(continuation_tokens)
    return inp, [(first + j, t) for j, t in enumerate(continuation_tokens)]


def continuation_logprobs(lm, context_tokens, continuation_tokens, device="cpu"):
    """One request's log p(continuation_j | all before it), (n,), from one full forward pass over
    its window, and whether each continuation token is the argmax there, (n,)."""
    inp, targets = harness_window(context_tokens, continuation_tokens, lm.config.block_size)
    logits = lm(torch.tensor([inp], device=device))                             # (1, T, V)
    logp = F.log_softmax(logits[0].float(), dim=-1)                              # (T, V)
    pos = torch.tensor([p for p, _ in targets], device=device)
    tok = torch.tensor([t for _, t in targets], device=device)
    return logp[pos, tok], logp[pos].argmax(-1) == tok


@torch.inference_mode()
def loglikelihood(lm, context_tokens, continuation_tokens, device="cpu") -> tuple[float, bool]:
    """One request: Σ_j log p(continuation_j | all before it), and the harness's is_greedy."""
    logp, greedy = continuation_logprobs(lm, context_tokens, continuation_tokens, device)
    return float(logp.sum()), bool(greedy.all())


def doc_metrics(lls: list[float], gold: int, choices: list[str] | None):
    """(acc, acc_norm): acc = [argmax of the log-likelihoods is gold]; acc_norm the same after
    dividing each by len(choice) in characters (None: the task has none). Ties go to the first."""
    acc = float(int(np.argmax(lls)) == gold)
    if choices is None:
        return acc, None
    return acc, float(int(np.argmax(np.array(lls) / [len(c) for c in choices])) == gold)


def stderr(xs, groups=None) -> float | None:
    """metrics.mean_stderr: sample stdev (n - 1) over sqrt n; None (N/A) for n < 2. With groups
    (MMLU's subjects) pooled_sample_stderr of the groups' stderrs (the harness pools four
    categories: the 3rd digit moves); where a group has one value, the stderr over all values."""
    if groups is None:
        return statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else None
    by = [[x for x, g in zip(xs, groups) if g == group] for group in dict.fromkeys(groups)]
    if min(len(v) for v in by) < 2:
        return stderr(xs)
    n, se = [len(v) for v in by], [stderr(v) for v in by]
    return math.sqrt(sum((k - 1) * s ** 2 * k for k, s in zip(n, se)) / (sum(n) - len(n)) / sum(n))


# A task's documents: one request at a time (--plain), or batched with shared prefixes.

def score_requests(lm, tokenized, batch_size=16, device="cpu", desc=None, plain=False):
    """(log-likelihood, is_greedy) of every request of every document, by fast_scorer.py or (plain)
    by loglikelihood(); under torchrun each process scores a share and all get every score."""
    if not plain:
        windows = [[harness_window(*r, lm.config.block_size) for r in doc] for doc in tokenized]
        return fast_scorer.score_windows(lm, windows, batch_size, device, desc)
    mine = set(devices.shard(range(len(tokenized))))
    bar = tqdm(tokenized, desc=desc, disable=desc is None, unit="doc", leave=False)
    scored = [[loglikelihood(lm, c, t, device) if d in mine else None for c, t in doc]
              for d, doc in enumerate(bar)]
    return fast_scorer.gather(scored)


def evaluate_task(lm, enc, prompts, cfg: EvalConfig, device="cpu", desc=None):
    """A task's result (n, acc, acc_norm, their stderrs, seconds) and its per-document samples."""
    t0 = time.perf_counter()
    scores = score_requests(lm, tokenize(enc, prompts), cfg.batch_size, device, desc, cfg.plain)
    samples = []
    for i, (p, res) in enumerate(zip(prompts, scores)):
        acc, acc_norm = doc_metrics([ll for ll, _ in res], p.gold, p.choices)
        samples.append(tasks.sample(i, p, res, acc, acc_norm))
    groups = [p.group for p in prompts] if prompts[0].group else None
    accs = [s["acc"] for s in samples]
    result = {"n": len(samples), "acc": sum(accs) / len(accs), "acc_stderr": stderr(accs, groups)}
    norms = [s["acc_norm"] for s in samples]
    result["acc_norm"] = None if norms[0] is None else sum(norms) / len(norms)
    result["acc_norm_stderr"] = None if norms[0] is None else stderr(norms)
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return result, samples


# Next-token loss on a file, and speed.

@torch.inference_mode()
def perplexity(lm, tokens: np.ndarray, context=None, device="cpu", batch_size=8) -> dict:
    """Mean next-token loss over windows of `context` tokens (each predicts its tokens 1..T from
    0..T-1; the last may be shorter) and its exp. Under torchrun each process runs a share of the
    batches; the losses are added in window order, as one process adds them."""
    L = context or lm.config.block_size
    n_pred = len(tokens) - 1
    starts = list(range(0, n_pred, L))
    # batches of whole windows, then the last window alone: it may be shorter
    groups = [starts[:-1][i:i + batch_size] for i in range(0, len(starts) - 1, batch_size)]
    groups.append(starts[-1:])
    nll = [[None] * len(group) for group in groups]  # each window's loss; None: another process's
    mine = devices.shard(range(len(groups)))
    for i in tqdm(mine, desc="ppl", unit="batch", leave=False, disable=not devices.is_main()):
        T = min(L, n_pred - groups[i][0])
        x = np.stack([tokens[s:s + T] for s in groups[i]]).astype(np.int64)
        y = np.stack([tokens[s + 1:s + 1 + T] for s in groups[i]]).astype(np.int64)
        nll[i] = lm.nll(torch.tensor(x, device=device), torch.tensor(y, device=device)).tolist()
    total = sum(v for losses in fast_scorer.gather(nll) for v in losses)
    return {"tokens": n_pred, "context": min(L, n_pred), "loss": total / n_pred,
            "ppl": float(np.exp(total / n_pred))}


@torch.inference_mode()
def speed(lm, n_tokens: int = 1000, device="cpu") -> dict:
    """Seconds to prefill n tokens (after a warm-up) and to decode all but the first greedily."""
    x = torch.randint(0, int(lm.config.vocab_size), (1, n_tokens), device=device)
    prefill = lambda: lm.lm_head(lm.hidden(x)[:, -1])  # noqa: E731
    devices.timed(device, prefill)  # a warm-up
    prefill_s = devices.timed(device, prefill)
    generate_s = devices.timed(device, lm.generate, x[:, :1], n_tokens - 1)
    return {"tokens": n_tokens, "prefill_s": prefill_s, "generate_s": generate_s}


# Fine-tuning on each task first, then scoring it: the paper's protocol (Sec. 4.2, App. C; Table 3).

@dataclass
class FineTune:
    """What every fine-tuning run on one task shares."""
    cfg: EvalConfig      # --batch-size (sequences a forward pass), --plain, --seed
    enc: object          # the tokenizer
    device: str
    splits: dict         # prompts: "train", "eval" (the scored split), maybe "validation"
    epochs: int
    docs_per_step: int   # Table 9's batch size (tasks.PAPER_FINETUNE)


def document_loss(lm, doc, gold: int, device="cpu") -> torch.Tensor:
    """A document's cross-entropy of its choices' scores (log-likelihoods, as acc ranks) vs gold."""
    scores = [continuation_logprobs(lm, c, t, device)[0].sum() for c, t in doc]
    return F.cross_entropy(torch.stack(scores), torch.tensor(gold, device=device))


def batch_loss(lm, docs, golds, device="cpu") -> torch.Tensor:
    """The summed document_loss of `docs`, all their requests right-padded in one forward pass."""
    windows = [harness_window(c, t, lm.config.block_size) for doc in docs for c, t in doc]
    # targets -1 but at each continuation's tokens: -nll is a request's log-likelihood
    x, y = fast_scorer.padded(windows)                                          # (N, T), (N, T)
    scores = -lm.nll(x.to(device), y.to(device))                                # (N,)
    per_doc = scores.split([len(doc) for doc in docs])
    losses = [F.cross_entropy(s, torch.tensor(g, device=device)) for s, g in zip(per_doc, golds)]
    return torch.stack(losses).sum()


def finetune_step(ft: FineTune, lm, optim, docs, golds) -> float:
    """One Adam step on the mean loss of a batch of documents, --batch-size requests a forward
    pass (under torchrun a share each, the gradients averaged); returns the mean loss."""
    mine = devices.shard(list(range(len(docs))))
    # all_mean divides the processes' summed gradients by their number: scale up to the batch mean
    scale = devices.get_world_size() / len(docs)
    total = torch.zeros((), device=ft.device)
    kind = torch.device(ft.device).type
    optim.zero_grad(set_to_none=False)
    for run in fast_scorer.runs([docs[i] for i in mine], ft.cfg.batch_size):
        ids = [mine[i] for i in run]
        with torch.autocast(kind, torch.bfloat16, enabled=kind == "cuda"):
            loss = batch_loss(lm, [docs[i] for i in ids], [golds[i] for i in ids], ft.device)
        (loss * scale).backward()
        total += loss.detach() * scale
    devices.all_mean([total, *(p.grad for p in lm.parameters())])
    optim.step()
    return float(total)


def finetune(ft: FineTune, lm, lr: float, desc=None) -> dict:
    """A copy of the model, every weight trained (a student's teacher weights too): ft.epochs
    epochs of Adam at lr (constant, no weight decay: the paper is silent), ft.docs_per_step
    documents a step in a new order each epoch, scored after each. A non-finite loss stops it."""
    lm = copy.deepcopy(lm).float().train().requires_grad_(True)
    for p in lm.parameters():
        p.grad = torch.zeros_like(p)  # a process without documents in a step adds zeros
    optim = torch.optim.Adam(lm.parameters(), lr=lr)
    tokenized = tokenize(ft.enc, ft.splits["train"])
    golds = [p.gold for p in ft.splits["train"]]
    B = ft.docs_per_step
    out = {"lr": lr, "epochs": [], "stopped": None}
    bar = tqdm(total=ft.epochs * math.ceil(len(golds) / B), desc=desc, disable=desc is None,
               unit="step", leave=False)
    for epoch in range(1, ft.epochs + 1):
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(ft.cfg.seed + epoch)
        order = torch.randperm(len(golds), generator=gen).tolist()
        losses = []
        for i in range(0, len(order), B):
            batch = order[i:i + B]
            losses.append(finetune_step(ft, lm, optim, [tokenized[j] for j in batch],
                                        [golds[j] for j in batch]))
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if not math.isfinite(losses[-1]):
                out["stopped"] = f"lr {lr:g}: the loss is {losses[-1]} in epoch {epoch}; stopped"
                print(out["stopped"])
                return out
        out["epochs"].append(score_epoch(ft, lm, epoch, losses, time.perf_counter() - t0))
        bar.set_postfix(loss=f"{losses[-1]:.4f}", acc=f"{out['epochs'][-1]['eval']['acc']:.4f}")
    return out


def score_epoch(ft: FineTune, lm, epoch: int, losses: list, seconds: float) -> dict:
    """One epoch's mean loss and training seconds, and the model's result on each scored split."""
    lm.eval()
    record = {"epoch": epoch, "loss": sum(losses) / len(losses), "train_seconds": seconds}
    for split in ("eval", "validation"):
        if split in ft.splits:
            record[split] = evaluate_task(lm, ft.enc, ft.splits[split], ft.cfg, ft.device)[0]
    lm.train()
    return record


def rules(epochs: list[dict]) -> dict:
    """The paper's rule (the epoch best on the scored split) and, where a validation split was
    scored, the honest one (the epoch best on validation, its result on the scored split)."""
    out = {}
    for rule, split in (("paper", "eval"), ("validation", "validation")):
        if epochs and split in epochs[0]:
            best = max(epochs, key=lambda e: e[split]["acc"])  # max: the first of ties
            out[rule] = {"epoch": best["epoch"], **best["eval"]}
    return out


def finetune_task(ft: FineTune, models: dict, name: str, lrs: list[float]) -> dict:
    """Every model fine-tuned on one task: the learning-rate grid on the teacher, the lr of its best
    result (the paper's rule) reused for the student. A grid all non-finite stops the run."""
    desc = f"fine-tune teacher {name}" if devices.is_main() else None
    grid = [finetune(ft, models["teacher"], lr, desc) for lr in lrs]
    for point in grid:
        point["rules"] = rules(point["epochs"])
    done = [point for point in grid if point["stopped"] is None]
    tasks.check_grid(name, lrs, done)
    best = max(done, key=lambda point: point["rules"]["paper"]["acc"])
    out = {"teacher": {**best, "batch_size": ft.docs_per_step, "grid": grid}}
    for label in [k for k in models if k != "teacher"]:
        desc = f"fine-tune {label} {name}" if devices.is_main() else None
        result = finetune(ft, models[label], best["lr"], desc)
        out[label] = {**result, "rules": rules(result["epochs"]), "batch_size": ft.docs_per_step}
    return out


def finetune_tasks(cfg: EvalConfig, models: dict, enc, training: dict, device, zero_shot) -> dict:
    """finetune_task of every task with a training split, beside the zero-shot results; a table."""
    out, family = {}, models["teacher"].config.family
    for name, splits in training.items():
        t0 = time.perf_counter()
        lrs, epochs, docs_per_step = tasks.finetune_settings(cfg, family, name)
        ft = FineTune(cfg, enc, device, splits, epochs, docs_per_step)
        task = finetune_task(ft, models, name, lrs)
        tasks.add_zero_shot(task, zero_shot, name)
        task["seconds"] = round(time.perf_counter() - t0, 3)
        out[name] = task
    tasks.print_finetune(out)
    return out


# The command line.

def run_tasks(cfg: EvalConfig, models: dict, enc, prompts: dict, device) -> dict:
    """Every task for every model: its results and samples (the student's apart), and a table."""
    results = {}
    for label, lm in models.items():
        for name, ps in prompts.items():
            desc = f"{label} {name}" if devices.is_main() else None
            result, samples = evaluate_task(lm, enc, ps, cfg, device, desc)
            tasks.add_result(results, label, name, result, samples)
    tasks.print_results(results, list(models))
    return results


def main(argv=None):
    """Flags, tasks and models checked first; then each model's next-token loss, tasks (zero-shot,
    then fine-tuned) and speed, printed and written to --output."""
    cfg = door.parse_config(EvalConfig, argv, description=__doc__.strip().split("\n\n")[0])
    prompts = tasks.load_tasks(cfg, TASKS)
    training = tasks.load_training(cfg, prompts, TASKS)
    # the model is cast to --dtype: no autocast
    device = devices.init_distributed(devices.pick_device(cfg.device, "float32")[0])
    models = tasks.load_models(cfg, device)
    enc, config = tokenizer.load_tokenizer(cfg.model), models["teacher"].config
    door.validate(cfg, context=config.block_size)
    for ps in [*prompts.values(), *[ps for s in training.values() for ps in s.values()]]:
        tasks.check_requests(tokenize(enc, ps), config.block_size)
    results = {}
    if cfg.ppl:
        tokens = tasks.read_ppl(cfg, enc, config.vocab_size)
        results["ppl"] = {label: perplexity(lm, tokens, cfg.ppl_context, device, cfg.batch_size)
                         for label, lm in models.items()}
        tasks.print_ppl(cfg, results["ppl"])
    if prompts:
        results.update(run_tasks(cfg, models, enc, prompts, device))
    if training:
        tuned = finetune_tasks(cfg, models, enc, training, device, results)
        results["finetune"] = {"command": tasks.command_line(argv), "tasks": tuned}
    if devices.is_main() and cfg.speed:  # timings: rank 0 alone
        results["speed"] = {k: speed(lm, cfg.speed_tokens, device) for k, lm in models.items()}
        tasks.print_speed(results["speed"])
    tasks.write_report(cfg, results)


if __name__ == "__main__":
    door.run_main(main)
