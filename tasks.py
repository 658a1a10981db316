"""evaluate.py's tasks and door, which a learner may skip: the tasks' documents read and checked,
their fine-tuning settings, evaluate.py's checks, its models (load_student: a checkpoint's
student) and its report. The prompt functions are evaluate.py's, passed in as parameters."""

import json
import math
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

import torch

import checkpoint
import datafiles
import devices
import door
import files
import model

# each task's documents as lm-eval 0.4 loads them (datasets.load_dataset(path, name, split)), and
# the hub's training and validation splits: validation None where it is the scored split or absent
HUB = {
    "piqa": ("baber/piqa", None, "validation", "train", None),
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy", "test", "train", "validation"),
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "test", "train", "validation"),
    "logiqa": ("EleutherAI/logiqa", "logiqa", "test", "train", "validation"),
    # the harness loads the 57 subjects one by one
    "mmlu": ("cais/mmlu", "all", "test", "auxiliary_train", "validation"),
    "winogrande": ("allenai/winogrande", "winogrande_xl", "validation", "train", None),
    # WSC273 has only its test split: scored zero-shot
    "wsc273": ("lighteval/winograd_wsc", "wsc273", "test", None, None),
}
ALL_TASKS = tuple(HUB)

# the paper's Tables 8 and 9: fine-tuning (learning rate, documents a step), GPT-2 and Pythia-1B
PAPER_FINETUNE = {
    "gpt2": {"piqa": (1e-4, 128), "logiqa": (5e-5, 64), "arc_easy": (1e-4, 64),
             "arc_challenge": (1e-5, 64), "winogrande": (5e-4, 128), "mmlu": (1e-6, 64),
             "wsc273": (1e-6, 128)},
    "neox": {"piqa": (1e-5, 64), "logiqa": (5e-5, 32), "arc_easy": (5e-5, 32),
             "arc_challenge": (5e-5, 32), "winogrande": (5e-5, 64), "mmlu": (5e-6, 32),
             "wsc273": (5e-5, 64)},
}
# other families: the paper is silent
OUR_FINETUNE = (1e-5, 32)

# the field that holds a document's answer, and the values it may take (the choices' order)
ANSWERS = {
    "piqa": ("label", lambda doc: [0, 1]),
    "arc_easy": ("answerKey", lambda doc: list(doc["choices"]["label"])),
    "arc_challenge": ("answerKey", lambda doc: list(doc["choices"]["label"])),
    "logiqa": ("label", lambda doc: ["a", "b", "c", "d"][:len(doc["options"])]),
    "mmlu": ("answer", lambda doc: [0, 1, 2, 3]),
    "winogrande": ("answer", lambda doc: ["1", "2"]),
    "wsc273": ("label", lambda doc: [0, 1]),
}


def check_document(name: str, doc):
    """What task `name`'s prompt function takes for granted: a KeyError names a missing field, a
    ValueError what else is wrong (load_task adds the file and line)."""
    if name.startswith("arc") and len(doc["choices"]["text"]) != len(doc["choices"]["label"]):
        raise ValueError(f"choices has {len(doc['choices']['text'])} texts but "
                         f"{len(doc['choices']['label'])} labels")
    if name == "mmlu" and len(doc["choices"]) != 4:
        raise ValueError(f"choices has {len(doc['choices'])} entries, MMLU's prompt needs 4")
    if name == "winogrande" and "_" not in doc["sentence"]:
        raise ValueError("sentence has no '_' blank")
    if name == "wsc273" and len(doc["options"]) != 2:
        raise ValueError(f"options has {len(doc['options'])} entries, WSC273 needs 2")
    field, options = ANSWERS[name]
    # logiqa's stripped, as the harness reads it
    value = doc[field].strip() if name == "logiqa" else doc[field]
    if isinstance(value, bool) or value not in options(doc):
        raise ValueError(f"{field} {value!r} is not one of its choices {options(doc)}")


def parse_tasks(spec: str | None) -> list[str]:
    """--tasks's names; every task for None or "all"."""
    known = f"known tasks: {', '.join(ALL_TASKS)} (or 'all')"
    if spec is None or spec.strip() == "all":
        return list(ALL_TASKS)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise door.ModelError(f"--tasks is empty; {known}")
    for name in names:
        if name not in HUB:
            raise door.ModelError(f"unknown task {name!r}; {known}")
    return names


def load_tasks(cfg, prompt_of: dict) -> dict:
    """{task: prompts} of --tasks; none where --ppl or --speed is given without it."""
    if cfg.tasks is None and (cfg.ppl or cfg.speed):
        return {}
    names = parse_tasks(cfg.tasks)
    return {name: load_task(name, prompt_of[name], cfg.data_dir, cfg.limit) for name in names}


def hub_documents(name: str, split: str | None = None) -> tuple[str, list]:
    """A task's harness dataset (or `split`) from the hub or its cache, as (where, doc) pairs."""
    path, config, harness_split = HUB[name][:3]
    split = split or harness_split
    try:
        import datasets
        # offline: the cache at once, not a minute of retries; not probed again once it fails
        if not datasets.config.HF_HUB_OFFLINE and not checkpoint.hub_reachable():
            datasets.config.HF_HUB_OFFLINE = True
        rows = datasets.load_dataset(path, config, split=split)
    # offline, or the hub changed
    except Exception as e:
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
        # not JSON or UTF-8, or nested too deep
        except (ValueError, RecursionError) as e:
            why = getattr(e, "msg", e)
            raise door.ModelError(f"{source} line {i} is not valid JSON ({why}); fix it") from None
    return docs


def load_task(name: str, prompt, data_dir=None, limit=None, split=None) -> list:
    """The first `limit` prompts of a task's documents (<data_dir>/<name>.jsonl, with a split
    <name>_<split>.jsonl, else the hub's), each checked, then made its prompt by `prompt`."""
    if data_dir is None:
        source, docs = hub_documents(name, split)
    else:
        source = Path(data_dir) / (f"{name}_{split}.jsonl" if split else f"{name}.jsonl")
        docs = read_jsonl(source, name)
    if not docs:
        raise door.ModelError(f"{source} holds no documents")
    prompts = []
    for where, doc in docs:
        try:
            check_document(name, doc)
            prompts.append(prompt(doc))
        except KeyError as e:
            raise door.ModelError(f"{source} {where}: document has no field {e}; "
                                  f"see tests/data/eval/{name}.jsonl") from None
        # TypeError: a list where an object belongs, ...
        except (ValueError, TypeError, AttributeError, IndexError) as e:
            raise door.ModelError(f"{source} {where}: malformed {name} document ({e})") from None
    return prompts[:limit]


def load_training(cfg, prompts: dict, prompt_of: dict) -> dict:
    """{task: {"train": prompts, "validation": prompts (where there is a validation split), "eval":
    the scored prompts}} of every task that has a training split, checked as the scored ones are."""
    splits = {}
    for name in prompts if cfg.finetune_epochs else []:
        train, validation = HUB[name][3:]
        if train is None:
            print(f"{name} has no training split: it is scored zero-shot")
            continue
        if cfg.train_dir:
            if not (Path(cfg.train_dir) / f"{name}_train.jsonl").is_file():
                raise door.ModelError(f"--train-dir {cfg.train_dir} holds no {name}_train.jsonl, "
                                      f"the training split of {name}; add it or drop {name}")
            train = "train"
            has = (Path(cfg.train_dir) / f"{name}_validation.jsonl").is_file()
            validation = "validation" if has else None
        prompt, folder = prompt_of[name], cfg.train_dir
        splits[name] = {"train": load_task(name, prompt, folder, cfg.finetune_limit, train),
                        "eval": prompts[name]}
        if validation:
            splits[name]["validation"] = load_task(name, prompt, folder, cfg.limit, validation)
    return splits


def finetune_settings(cfg, family: str, name: str) -> tuple[list[float], int, int]:
    """A task's learning rates, epochs and documents a step: the flags', else the paper's Tables 8
    and 9's (MMLU: one epoch, as the paper's)."""
    lr, docs_per_step = PAPER_FINETUNE.get(family, {}).get(name, OUR_FINETUNE)
    epochs = 1 if name == "mmlu" else cfg.finetune_epochs
    return parse_lrs(cfg.finetune_lr) or [lr], epochs, cfg.finetune_batch_size or docs_per_step


def check_grid(name: str, lrs: list[float], done: list):
    """A ModelError where no rate of the grid finished on the teacher (done: the rates that did)."""
    if not done:
        tried = ", ".join(f"{lr:g}" for lr in lrs)
        raise door.ModelError(f"{name}: every learning rate tried ({tried}) made the teacher's "
                              "loss non-finite; pass lower rates with --finetune-lr")


def check_requests(tokenized, max_len: int):
    """The door to harness_window, before any request is scored: every request has a context and
    1 to max_len continuation tokens."""
    for doc in tokenized:
        for context, continuation in doc:
            if not 0 < len(continuation) <= max_len:
                raise door.ModelError(f"a continuation of {len(continuation)} tokens cannot be "
                                      f"scored: it needs 1 to {max_len}, the model's context length")
            # the harness puts its prefix token there
            if not context:
                raise door.ModelError("a request with an empty context cannot be scored as the "
                                      "harness scores it; fix its document")


# --------------------------------------------------------------------------------------------------
# evaluate.py's flags and files, checked before any work.

def check_ppl_file(ppl: str) -> str | None:
    """What is wrong with the --ppl path, or None."""
    p = Path(ppl)
    if p.is_dir():
        why = "is a directory"
    elif not p.exists():
        why = "does not exist"
    elif p.stat().st_size == 0:
        why = "is empty"
    else:
        return None
    return f"--ppl {p} {why}; pass a uint16 token file (data/*/prepare.py) or a text file"


def read_ppl(cfg, enc, vocab_size: int):
    """The --ppl file's tokens (text encoded as the tasks' text is), checked against the model; a
    .bin without prepare.py's meta.json beside it is read unchecked, with one warning line."""
    todo = "pass a file made with this model's tokenizer (data/*/prepare.py)"
    meta = datafiles.check_tokenizer(cfg.ppl, enc, cfg.model, todo)
    tokens = datafiles.read_tokens(cfg.ppl, enc, cfg.ppl_max_tokens, special=True)
    if len(tokens) < 2:
        raise door.ModelError("the --ppl file holds fewer than 2 tokens; give it more text")
    if int(tokens.max()) >= int(vocab_size):
        raise door.ModelError(f"the --ppl file holds token id {int(tokens.max())}, beyond the "
                              f"model's vocabulary of {vocab_size}: was it prepared with another "
                              "tokenizer?")
    if meta is None and Path(cfg.ppl).suffix == ".bin" and devices.is_main():
        print(f"warning: {cfg.ppl} has no meta.json beside it: its tokens are read as ids of "
              f"{cfg.model}'s tokenizer, unchecked (data/*/prepare.py writes one)", file=sys.stderr)
    return tokens


def check_lrs(cfg) -> str | None:
    """What is wrong with --finetune-lr (a rate not a positive number, or named twice), or None."""
    spec = cfg.finetune_lr
    try:
        lrs = parse_lrs(spec)
    except ValueError:
        lrs = [math.nan]
    if not all(math.isfinite(lr) and lr > 0 for lr in lrs):
        return f"--finetune-lr must be positive numbers separated by commas, got {spec!r}"
    if len(set(lrs)) < len(lrs):
        return f"--finetune-lr names a rate twice, got {spec!r}; pass each rate once"
    return None


def parse_lrs(spec: str) -> list[float]:
    """--finetune-lr's values (check_lrs checks them first); [] where empty: each task's default."""
    return [float(x) for x in spec.split(",") if x.strip()]


def check_finetune(cfg) -> str | None:
    """What is wrong with the flags given with --finetune-epochs, or None."""
    if cfg.finetune_epochs and cfg.dtype != "float32":
        return "fine-tuning trains float32 weights (under bf16 autocast on CUDA); drop --dtype"
    return None


def check_train_dir(cfg) -> str | None:
    """What is wrong with --train-dir, or None."""
    if not Path(cfg.train_dir).is_dir():
        return (f"--train-dir {cfg.train_dir} is not a folder; pass the folder of "
                "<task>_train.jsonl files")
    return None


def check_output(output, teacher, ckpt, folders=(), ppl=None, flag="--output"):
    """A ModelError where `output` cannot be written or would replace a file this run reads or a
    file of the checkpoint; every file in the teacher's and `folders` counts as read."""
    files.check_out(output, flag=flag, file=True)
    out = Path(output).resolve()
    reads = {Path(p).resolve() for p in (ppl, teacher) if p}
    if ppl:
        reads.add(Path(ppl).resolve().with_name("meta.json"))
    if ckpt:
        reads |= {Path(ckpt, f).resolve() for f in files.CHECKPOINT_FILES}
    folders = {Path(d).resolve() for d in (teacher, *folders) if d}
    if out.is_file() and (out in reads or out.parent in folders):
        raise door.ModelError(f"{flag} {output} would replace a file this run reads (the "
                              "checkpoint's, the teacher's, its data or tasks); pass another path")


def load_student(ckpt_dir, device="cpu", dtype=torch.float32, teacher=None):
    """A distill.py checkpoint -> (the student, config.json's dict): teacher (a GPT, a name or path;
    by default config.json's) linearised with the saved dims and features. Forks replace this name
    (experiments/per_head.py, window.py): its callers look it up when called."""
    cfg, sd = checkpoint.read_student(ckpt_dir)
    if not isinstance(teacher, model.GPT):
        teacher = model.GPT.from_pretrained(teacher or cfg["teacher"], device, dtype)
    checkpoint.check_student(cfg, teacher.config.n_layer, model.FEATURE_MAPS)
    student = teacher.linearize(cfg["dims"], cfg["feature_map"], cfg["chunk_size"])
    checkpoint.load_features(student, sd, ckpt_dir)
    return student.eval(), cfg


def load_models(cfg, device) -> dict:
    """{"teacher": --model, "student": load_student(--ckpt)}; --ckpt's teacher checked first."""
    dtype = getattr(torch, cfg.dtype)
    if cfg.ckpt is not None:
        todo = "pass a complete distill.py checkpoint as --ckpt"
        prev = files.read_json(Path(cfg.ckpt) / "config.json", todo)
        if prev.get("teacher") is not None:
            checkpoint.check_teacher(prev, cfg.model, f"checkpoint {cfg.ckpt}")
    models = {"teacher": model.GPT.from_pretrained(cfg.model, device=device, dtype=dtype)}
    if cfg.ckpt is not None:
        models["student"] = load_student(cfg.ckpt, device, dtype, teacher=models["teacher"])[0]
    return models


# --------------------------------------------------------------------------------------------------
# evaluate.py's report: its tables, and the JSON file of --output.

def command_line(argv=None) -> str:
    """The command that ran, as the report records it."""
    return shlex.join(["python", "evaluate.py", *(sys.argv[1:] if argv is None else argv)])


def write_report(cfg, results: dict):
    """--output, written by rank 0: the report (every process's share), config and world size."""
    if devices.is_main() and cfg.output:
        everything = {**results, "config": asdict(cfg), "world_size": devices.get_world_size()}
        files.write_text_atomic(cfg.output, json.dumps(everything, indent=1, ensure_ascii=False))
        print(f"wrote {cfg.output}")


def sample(i: int, prompt, scores: list, acc: float, acc_norm: float | None) -> dict:
    """Document i's record in the report: its requests, their scores, gold, acc and acc_norm."""
    return {"doc_index": i, "requests": [list(r) for r in prompt.requests],
            "loglikelihoods": [ll for ll, _ in scores], "is_greedy": [g for _, g in scores],
            "gold": prompt.gold, "acc": acc, "acc_norm": acc_norm}


def add_result(results: dict, label: str, name: str, result: dict, samples: list):
    """A model's result and samples on a task: the teacher's at the top, another's under label."""
    part = results if label == "teacher" else results.setdefault(label, {})
    part.setdefault("results", {})[name] = result
    part.setdefault("samples", {})[name] = samples


def add_zero_shot(task: dict, zero_shot: dict, name: str):
    """Each model's zero-shot result on task `name` (add_result's) beside its fine-tuned ones."""
    for label, result in task.items():
        part = zero_shot if label == "teacher" else zero_shot[label]
        result["zero_shot"] = part["results"][name]


def print_ppl(cfg, results: dict):
    """Each model's next-token loss and perplexity; a ModelError if the teacher's is not finite."""
    r = results["teacher"]
    if not math.isfinite(r["ppl"]):
        raise door.ModelError(f"the teacher {cfg.model} has a perplexity of {r['ppl']} on "
                              f"--ppl {cfg.ppl} (mean loss {r['loss']}): its weights or "
                              "config are broken; check them, or pass another --model")
    for label, r in results.items():
        print(f"ppl {label}: loss {r['loss']:.4f}, perplexity {r['ppl']:.3f} "
              f"({r['tokens']} tokens, T {r['context']})")


def print_speed(speeds: dict):
    """Each model's prefill and decoding seconds."""
    for label, r in speeds.items():
        print(f"speed {label}: {r['tokens']} tokens: prefill {r['prefill_s']:.3f} s, "
              f"decoding {r['generate_s']:.3f} s")


def print_results(results: dict, labels: list):
    """Each task's n and each model's acc, acc_norm and acc's stderr (as add_result put them)."""
    fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    parts = {label: results if label == "teacher" else results[label] for label in labels}
    head = [f" | {label + ' acc':>14} {'acc_norm':>8} {'stderr':>7}" for label in parts]
    print(f"{'task':<14} {'n':>5}" + "".join(head))
    for name in results["results"]:
        rs = [part["results"][name] for part in parts.values()]
        cells = [f" | {fmt(r['acc']):>14} {fmt(r['acc_norm']):>8} {fmt(r['acc_stderr']):>7}"
                 for r in rs]
        print(f"{name:<14} {rs[0]['n']:>5}" + "".join(cells))


def print_finetune(results: dict):
    """Each task and model: zero-shot acc, the lr, acc after each epoch, both rules' acc."""
    fmt = lambda r: "-" if r is None else f"{r['acc']:.4f}"  # noqa: E731
    head = f"{'task':<14} {'model':<8} {'zero-shot':>9} {'lr':>8}"
    print(head + "  acc after each epoch -> paper's rule | validation's rule")
    for name, task in results.items():
        for label, r in task.items():
            if label == "seconds":
                continue
            accs = " ".join(fmt(e["eval"]) for e in r["epochs"])
            paper, honest = r["rules"].get("paper"), r["rules"].get("validation")
            print(f"{name:<14} {label:<8} {fmt(r['zero_shot']):>9} {r['lr']:>8.1e}  {accs} -> "
                  f"{fmt(paper)} | {fmt(honest)}")
