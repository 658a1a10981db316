"""
bench/bench_scorer.py: how much faster evaluate.py's default scorer (fast_scorer.py) is than scoring every
request the harness's way. For each task: the tokens the harness would feed the model (every request's window), over
the fast scorer's wall time, against the model's plain forward rate (full logits, no padding) on as many tokens at
the task's mean harness sequence length. A ratio above 1 is the speed-up the shared prefixes and batching bring.

    python bench/bench_scorer.py --model gpt2 --data-dir tests/data/eval --limit 50
    python bench/bench_scorer.py --model gpt2 --ckpt out/gpt2 --data-dir tests/data/eval --rounds 3
"""
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import devices  # noqa: E402
import door  # noqa: E402
import evaluate  # noqa: E402
import files  # noqa: E402
import tasks  # noqa: E402
from fast_scorer import score_windows  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402


@dataclass
class BenchConfig(door.Config):
    model: str = door.opt("gpt2", "teacher model: a hub id or a local checkpoint directory (GPT.from_pretrained)")
    ckpt: str | None = door.opt(None, "distill.py checkpoint directory; its student is timed after the teacher")
    tasks: str | None = door.opt(None, "comma-separated tasks, or all (the default)")
    data_dir: str | None = door.opt(None, "folder of <task>.jsonl (e.g. tests/data/eval); default: the hub's datasets")
    limit: int | None = door.opt(None, "time the first N documents of each task", min=1)
    batch_size: int = door.opt(16, "sequences per forward pass", min=1)
    device: str = door.opt("auto", "torch device: auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    dtype: str = door.opt("float32", "model dtype", choices=["float32", "bfloat16", "float16"])
    rounds: int = door.opt(1, "keep the fastest of this many alternating rounds (the stable number on a busy machine)", min=1)
    output: str | None = door.opt(None, "write the table's numbers to this JSON file")

    def __post_init__(self):
        super().__post_init__()
        devices.pick_device(self.device, "float32")
        if self.output:
            tasks.check_output(self.output, self.model, self.ckpt, [self.data_dir])


def harness_tokens(tokenized, max_len: int) -> int:
    """The tokens the harness feeds the model: every request's window, (context + continuation)[-(L+1):][:-1]."""
    return sum(min(len(c) + len(t), max_len + 1) - 1 for doc in tokenized for c, t in doc)


@torch.inference_mode()
def plain_forward_rate(gpt, n_tokens: int, seq_len: int, batch_size: int, device="cpu") -> float:
    """Tokens per second of gpt(x) (full logits) on full (rows, seq_len) batches covering n_tokens tokens: rows is
    batch_size, or fewer where fewer cover them (no batch wider than the tokens it stands for)."""
    rows = max(1, min(batch_size, math.ceil(n_tokens / seq_len)))
    n_batches = max(1, math.ceil(n_tokens / (rows * seq_len)))
    x = torch.randint(0, int(gpt.config.vocab_size), (rows, seq_len), device=device)
    gpt(x[:1, :8])  # warm-up
    devices.sync(device)
    t0 = time.perf_counter()
    for _ in range(n_batches):
        gpt(x)
    devices.sync(device)
    return n_batches * rows * seq_len / (time.perf_counter() - t0)


def bench(gpt, enc, task_prompts: dict, batch_size=16, device="cpu", rounds: int = 1, out=None) -> dict:
    """The table's rows ({task: numbers} and "all"), printed as they come; each task's fastest of `rounds`."""
    L, rows, out = gpt.config.block_size, {}, out or sys.stdout
    row = "{:<14} {:>11} {:>8.2f} {:>13.0f} {:>15.0f} {:>6.2f}"
    print(f"{'task':<14} {'harness tok':>11} {'seconds':>8} {'harness tok/s':>13} {'plain fwd tok/s':>15} {'ratio':>6}",
          file=out, flush=True)
    gpt.hidden(torch.zeros((1, 8), dtype=torch.long, device=device))  # warm-up
    for name, prompts in task_prompts.items():
        tokenized = [[evaluate.encode_pair(enc, *r) for r in p.requests] for p in prompts]
        windows = [[evaluate.harness_window(c, t, L) for c, t in doc] for doc in tokenized]
        n_tok, n_req = harness_tokens(tokenized, L), sum(len(d) for d in tokenized)
        fast, plain = math.inf, 0.0
        for _ in range(rounds):
            devices.sync(device)
            t0 = time.perf_counter()
            score_windows(gpt, windows, batch_size, device)
            devices.sync(device)
            fast = min(fast, time.perf_counter() - t0)
            plain = max(plain, plain_forward_rate(gpt, n_tok, max(1, round(n_tok / n_req)), batch_size, device))
        rows[name] = {"harness_tokens": n_tok, "seconds": fast, "harness_tok_per_s": n_tok / fast,
                      "plain_forward_tok_per_s": plain, "ratio": n_tok / fast / plain}
        print(row.format(name, *rows[name].values()), file=out, flush=True)
    n_tok, fast = (sum(r[k] for r in rows.values()) for k in ("harness_tokens", "seconds"))
    plain_s = sum(r["harness_tokens"] / r["plain_forward_tok_per_s"] for r in rows.values())
    rows["all"] = {"harness_tokens": n_tok, "seconds": fast, "harness_tok_per_s": n_tok / fast,
                   "plain_forward_tok_per_s": n_tok / plain_s, "ratio": plain_s / fast}
    print(row.format("all", *rows["all"].values()), file=out, flush=True)
    return rows


def main(argv=None):
    cfg = door.parse_config(BenchConfig, argv, description=__doc__.strip().split("\n\n")[0])
    prompts = {name: tasks.load_task(name, evaluate.TASKS[name], cfg.data_dir, cfg.limit)
               for name in tasks.parse_tasks(cfg.tasks)}
    device = devices.pick_device(cfg.device, "float32")[0]
    models, enc = tasks.load_models(cfg, device), load_tokenizer(cfg.model)
    results = {}
    for label, m in models.items():
        print(f"\n{label} ({cfg.model if label == 'teacher' else cfg.ckpt}) on {device}")
        results[label] = bench(m, enc, prompts, cfg.batch_size, device, cfg.rounds)
    if cfg.output:
        files.write_text_atomic(cfg.output, json.dumps({**results, "config": asdict(cfg)}, indent=1))
        print(f"wrote {cfg.output}")


if __name__ == "__main__":
    door.run_main(main)
