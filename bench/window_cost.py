"""What a window of exact softmax (experiments/window.py) sees and costs on SmolLM2-135M, side
by side in one run:

    python bench/window_cost.py            # all three, into docs/results/window-cost/smollm2.json
    python bench/window_cost.py --ctx 1024 2048 --T 1024 --steps 3 --out /tmp/cost.json

mass     the teacher's attention on its own held-out text (--windows windows of --block-size
         tokens of val.bin): per layer, the mean over heads and queries i >= 64 of the mass on
         the last W keys (i - W < j <= i, as the window holds them) for each --W, and on the
         first token (an attention sink, which the features must carry).
decode   ms per decoded token (a token for each of --batch sequences, mean of --steps) and the
         cache's bytes per sequence after a context of --ctx tokens: the teacher's KV cache, the
         linear student (--budget features in every layer) and the hybrid (the same, with a
         window of the last --W). The caches hold random values of the right shapes (a prefill
         would take minutes here); the weights are SmolLM2's.
forward  ms of one layer's attention core at SmolLM2's shape (9 query heads, 3 key heads,
         D = 64, M = --budget), forward only, median of --repeats after a warm-up, over --T
         tokens: the chunked scan and the chunked hybrid.
One torch thread unless --threads says otherwise.
"""

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "experiments")]
import datafiles  # noqa: E402
import dof  # noqa: E402
import door  # noqa: E402
import files  # noqa: E402
import forks  # noqa: E402
import model  # noqa: E402
import window  # noqa: E402
from committed import check_committed  # noqa: E402

COMMITTED = "docs/results/window-cost/smollm2.json"   # SmolLM2-135M's tables, in git


@dataclass
class CostConfig(door.Config):
    """Attention mass in a window; the decoding and forward cost of the hybrid and the scan."""
    model: str = door.opt("smollm2-135m", "teacher (a name, directory or .gguf file)")
    data: str = door.opt("data/wikitext2", "folder with val.bin (distill.py prepares it)")
    what: list[str] = door.opt(["mass", "decode", "forward"], "measurements: mass, decode, forward")
    W: list[int] = door.opt([16, 64], "window sizes of the mass table; the last is the hybrid's")
    block_size: int = door.opt(256, "tokens per window of the mass table", min=1)
    windows: int = door.opt(8, "val.bin windows of the mass table", min=1)
    budget: int = door.opt(32, "features a head in every layer of the students", min=1)
    batch: int = door.opt(8, "sequences decoded at once", min=1)
    ctx: list[int] = door.opt([1024, 2048, 4096, 8192], "contexts of the decoding table")
    steps: int = door.opt(10, "decoded tokens timed per context and model", min=1)
    T: list[int] = door.opt([1024, 2048, 4096, 8192, 16384], "sequence lengths of the forward table")
    repeats: int = door.opt(5, "timed calls per forward measurement", min=1)
    threads: int = door.opt(1, "torch threads", min=1)
    out: str = door.opt(COMMITTED, "result file")

    def __post_init__(self):
        super().__post_init__()
        if set(self.what) - {"mass", "decode", "forward"}:
            got = " ".join(self.what)
            raise door.ModelError(f"--what takes mass, decode and forward, got {got}")
        out = Path(self.out)
        files.check_out(out.parent, [out.name])                     # before the work, not after it
        if out.resolve() == (Path(self.data) / "val.bin").resolve():
            raise door.ModelError(f"--out {self.out} is the val.bin this run reads; pass another --out")
        ours = {k: v for k, v in vars(self).items() if k != "out"}
        check_committed(self.out, ours, "config")                   # other settings had replaced them


@torch.no_grad()
def attention_mass(teacher, tokens, cfg):
    """Per layer: {"W=16": mass on the last 16 keys, ..., "first": mass on token 0}, means over
    heads and queries i >= 64 of cfg.windows windows."""
    gen = torch.Generator().manual_seed(0)
    x, _ = datafiles.get_batch(tokens, cfg.windows, cfg.block_size, gen, "cpu")
    T = cfg.block_size
    i, j = torch.arange(T)[:, None], torch.arange(T)
    out = []
    for q, k in dof.teacher_qk(teacher, x):  # (B, H or Hkv, T, D) per layer
        k = model.repeat_kv(k, q.size(1))
        logits = (q @ k.mT / q.size(-1) ** 0.5).masked_fill(j > i, float("-inf"))
        p = torch.softmax(logits, -1)[:, :, 64:]  # (B, H, T - 64, T)
        row = {}
        for W in cfg.W:
            outside = ((j > i) | (j <= i - W))[64:]
            row[f"W={W}"] = p.masked_fill(outside, 0).sum(-1).mean().item()
        out.append(row | {"first": p[..., 0].mean().item()})
    return out


def synthetic_cache(student, ctx, cfg):
    """A Cache after ctx tokens, random contents: KV caches, linear states, or a state and a
    ring buffer."""
    c, B = student.config, cfg.batch
    cache = model.Cache(c.n_layer)
    cache.pos = ctx
    for layer, core in zip(cache, student.cores()):
        if isinstance(core, model.SoftmaxAttention):
            for name in ("k", "v"):
                layer[name] = torch.randn(B, c.n_kv_head, ctx + cfg.steps, c.head_dim)
            layer["n"] = ctx
        elif getattr(core, "window", 0):
            layer["P"] = torch.rand(B, c.n_head, core.M, c.head_dim + 1)
            for name in ("k", "v"):
                layer[name] = torch.randn(B, c.n_kv_head, core.window, c.head_dim)
                layer["s" + name] = torch.randn(B, c.n_kv_head, core.sinks, c.head_dim)
            layer["n"] = ctx
        else:
            layer["S"] = torch.randn(B, c.n_head, core.M, c.head_dim)
            layer["s"] = torch.rand(B, c.n_head, core.M)
    return cache


@torch.no_grad()
def decode_cost(models, cfg):
    """{model: [{"ctx", "ms", "mib_per_sequence"}]}: the same tokens through each model's cache,
    the models alternating."""
    res = {name: [] for name in models}
    tok = torch.randint(0, 1000, (cfg.batch, 1))
    for ctx in cfg.ctx:
        for name, m in models.items():
            cache = synthetic_cache(m, ctx, cfg)
            m(tok, cache=cache)  # warm-up
            t0 = time.perf_counter()
            for _ in range(cfg.steps - 1):
                m(tok, cache=cache)
            ms = 1e3 * (time.perf_counter() - t0) / max(1, cfg.steps - 1)
            held = sum(t.nbytes for layer in cache for t in layer.values() if torch.is_tensor(t))
            res[name].append({"ctx": ctx, "ms": ms, "mib_per_sequence": held / cfg.batch / 2 ** 20})
            print(f"  decode ctx {ctx} {name}: {ms:.1f} ms", file=sys.stderr)
    return res


@torch.no_grad()
def forward_cost(cfg):
    """{"scan": [...], "hybrid": [...]}: ms of one layer's core at SmolLM2's shape, over cfg.T."""
    torch.manual_seed(0)
    core = window.WindowAttention(9, 3, 64, cfg.budget)
    res = {"scan": [], "hybrid": []}
    for T in cfg.T:
        q, k, v = torch.randn(1, 9, T, 64), torch.randn(1, 3, T, 64), torch.randn(1, 3, T, 64)
        for name, W in (("scan", 0), ("hybrid", cfg.W[-1])):
            core.window = W
            core(q, k, v)
            times = []
            for _ in range(cfg.repeats):
                t0 = time.perf_counter()
                core(q, k, v)
                times.append(1e3 * (time.perf_counter() - t0))
            res[name].append({"T": T, "ms": statistics.median(times)})
        ms = [res[name][-1]["ms"] for name in ("scan", "hybrid")]
        print(f"  forward T {T}: scan {ms[0]:.1f} ms, hybrid {ms[1]:.1f} ms", file=sys.stderr)
    return res


def main(argv=None):
    cfg = door.parse_config(CostConfig, argv)
    torch.set_num_threads(cfg.threads)
    teacher = model.GPT.from_pretrained(cfg.model).requires_grad_(False)
    args = sys.argv[1:] if argv is None else argv
    out = {"config": vars(cfg).copy(), "torch": torch.__version__, "threads": cfg.threads,
           "command": " ".join(["python bench/window_cost.py", *args])}
    if "mass" in cfg.what:
        tokens = np.memmap(Path(cfg.data) / "val.bin", dtype=np.uint16, mode="r")
        out["mass"] = attention_mass(teacher, tokens, cfg)
    if "decode" in cfg.what:
        dims = [cfg.budget] * teacher.config.n_layer
        with forks.replaced(window.REPLACE):
            hybrid = window.set_window(teacher.linearize(dims), cfg.W[-1])
        models = {"teacher": teacher, "linear": teacher.linearize(dims), "hybrid": hybrid}
        out["decode"] = decode_cost(models, cfg)
    if "forward" in cfg.what:
        out["forward"] = forward_cost(cfg)
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    with files.atomic_path(cfg.out) as tmp:
        Path(tmp).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {cfg.out}")
    print("\n\n".join(tables(out).values()))


def tables(res):
    """A result file's markdown tables: {"mass", "decode", "forward"} -> table, those it holds."""
    parts = {}
    if "mass" in res:
        keys = list(res["mass"][0])
        names = [f"mass on {k}" if k == "first" else f"mass in {k}" for k in keys]
        rows = [f"| layers | {' | '.join(names)} |", "|---|" + "---:|" * len(keys)]
        mass = res["mass"]
        for s in range(0, len(mass), 10):
            chunk = mass[s:s + 10]
            rows.append(f"| {s}–{s + len(chunk) - 1} | "
                        + " | ".join(f"{np.mean([r[k] for r in chunk]):.2f}" for k in keys) + " |")
        means = [f"{np.mean([r[k] for r in mass]):.2f}" for k in keys]
        rows.append(f"| all | {' | '.join(means)} |")
        parts["mass"] = "\n".join(rows)
    if "decode" in res:
        d = res["decode"]
        rows = ["| context | teacher ms/token | linear | hybrid | teacher MiB/sequence | linear "
                "| hybrid |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for i, ctx in enumerate(r["ctx"] for r in d["teacher"]):
            ms = [d[n][i]["ms"] for n in ("teacher", "linear", "hybrid")]
            mib = [d[n][i]["mib_per_sequence"] for n in ("teacher", "linear", "hybrid")]
            rows.append(f"| {ctx} | " + " | ".join(f"{x:.0f}" for x in ms) + " | "
                        + " | ".join(f"{x:.2f}" for x in mib) + " |")
        parts["decode"] = "\n".join(rows)
    if "forward" in res:
        f = res["forward"]
        rows = ["| T | scan ms | hybrid ms | hybrid / scan |", "|---:|---:|---:|---:|"]
        for a, b in zip(f["scan"], f["hybrid"]):
            rows.append(f"| {a['T']} | {a['ms']:.1f} | {b['ms']:.1f} | {b['ms'] / a['ms']:.2f} |")
        parts["forward"] = "\n".join(rows)
    return parts


if __name__ == "__main__":
    door.run_main(main)
