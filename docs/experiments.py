"""
Experiment runner: a grid of distill.py runs, one process each (one torch thread, --jobs at a time), one JSON per
run under docs/results/<grid>/, and the tables and learning curves of docs/results.md built from those files only.

    python docs/experiments.py --run claim --jobs 2    # runs what has no JSON yet (interrupt and rerun to resume)
    python docs/experiments.py --report                # rebuilds docs/results.md's and README.md's blocks, figures

A run's JSON holds `args` (the config.json distill.py wrote, with every flag under args.args), `dims`, `val` (the
metrics.json list of {step, teacher_loss, student_loss, attn_kl}), `seconds` and the `command` that reproduces it.
"""

import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # the core, and bench/ (allocation, gpu_check, heads)
import door  # noqa: E402
import files  # noqa: E402

RESULTS = ROOT / "docs" / "results"
SCRATCH = ROOT / "out-experiments"           # checkpoints and logs of the runs (not committed)
CHILDREN = set()                             # the runs' processes running now: a stopped run_grid stops them
LOCK = threading.Lock()                      # held to start, drop or stop children: none starts after a stop
STOPPED = threading.Event()                  # set when run_grid stops: no other run starts


@dataclass
class Run:
    grid: str
    name: str                                # file name under docs/results/<grid>/
    group: str                               # the table row it belongs to (seeds of one configuration)
    seed: int
    flags: list = field(default_factory=list)
    allocation: str = ""                     # the rule that made the dims: fix, dof, dof-raw, measured, ...
    script: str = "distill.py"               # or a fork of it in experiments/

    def command(self, out_dir):
        return [sys.executable, self.script, *self.flags, "--seed", str(self.seed), "--out-dir", str(out_dir)]


# ----------------------------------------------------------------------------------------------------------------
# The grids. Every run of a grid sees the same tokens per step and steps; seed s draws the same training batches
# under every allocation (distill.py's batch generator depends on the seed alone), so differences are paired.

SMOL = ["--model", "smollm2-135m", "--data", "data/wikitext-smollm2", "--loss", "softmax", "--center-keys",
        "--block-size", "256", "--batch-size", "1", "--eval-iters", "8", "--J", "1024", "--lam", "1e-3",
        "--lam-relative", "--log-interval", "20"]
CLAIM_STEPS = ["--max-steps", "240", "--warmup-steps", "24", "--eval-interval", "60"]
ALLOCS = {"Fix": "fix", "DoF": "dof", "DoF+Clip": "clip", "Reverse": "reverse"}


def claim_grid(seeds=(0, 1, 2)):
    runs = []
    for budget, allocs in ((32, ("Fix", "DoF", "DoF+Clip", "Reverse")), (64, ("Fix", "DoF"))):
        for a in allocs:
            for s in seeds:
                runs.append(Run("claim", f"b{budget}-{ALLOCS[a]}-s{s}", f"{budget}/{a}", s,
                                SMOL + CLAIM_STEPS + ["--budget", str(budget), "--alloc", ALLOCS[a]]))
    return runs


def tiny_grid(ckpt, data, seeds=(0, 1)):
    """Two configurations x two seeds on a tiny model: what the tests run."""
    base = ["--model", ckpt, "--data", data, "--block-size", "32", "--batch-size", "2", "--max-steps", "4",
            "--warmup-steps", "0", "--eval-interval", "2", "--eval-iters", "1", "--J", "16", "--calib-batches", "1",
            "--budget", "4", "--query-block", "8", "--chunk-size", "8"]
    return [Run("tiny", f"{a}-s{s}", f"4/{name}", s, base + ["--alloc", a])
            for name, a in (("Fix", "fix"), ("DoF", "dof")) for s in seeds]


def recipe_grid(seeds=(0, 1, 2)):
    """Towards a student close to its teacher at budget 64: end-to-end (direct) fine-tuning of the claim grid's
    layerwise DoF students, a second layerwise stage of 240 steps from them, and layerwise training without key
    centring."""
    direct = [Run("recipe", f"b64-dof-direct-s{s}", "64/DoF + direct", s,
                  SMOL[:4] + ["--loss", "direct", "--block-size", "256", "--batch-size", "1", "--eval-iters", "8",
                  "--log-interval", "10", "--lr-z", "2e-3", "--lr-alpha", "2e-2", "--max-steps", "100",
                  "--warmup-steps", "10", "--eval-interval", "50", "--init-from", f"out-experiments/claim/b64-dof-s{s}"])
              for s in seeds]
    longer = [Run("recipe", f"b64-dof-longer-s{s}", "64/DoF, 240 more layerwise steps", s,
                  SMOL[:4] + ["--loss", "softmax", "--block-size", "256", "--batch-size", "1", "--eval-iters", "8",
                  "--log-interval", "20", "--init-from", f"out-experiments/claim/b64-dof-s{s}"] + CLAIM_STEPS)
              for s in seeds]
    plain = [Run("recipe", f"b64-dof-uncentred-s{s}", "64/DoF, keys not centred", s,
                 [f for f in SMOL if f != "--center-keys"] + CLAIM_STEPS + ["--budget", "64", "--alloc", "dof"])
             for s in seeds]
    return direct + longer + plain


def heads_grid(seeds=(0, 1, 2)):
    """Per-head dims against the claim grid's per-layer DoF at budget 32: the same flags, steps and seeds."""
    return [Run("heads", f"b32-dof-head-s{s}", "32/DoF per head", s,
                SMOL + CLAIM_STEPS + ["--budget", "32", "--alloc", "dof"], "dof-head", "experiments/per_head.py")
            for s in seeds]


CURVE_DIMS = (4, 8, 16, 32, 64, 128)


def curves_grid(seed=0):
    """Fix at every M of CURVE_DIMS: under teacher forcing the layers are independent problems, so one Fix run at M
    gives every layer's held-out KL at M. 240 steps (the claim grid's schedule), and 60-step probes of the same."""
    probe = ["--max-steps", "60", "--warmup-steps", "6", "--eval-interval", "60"]
    return [Run("curves", f"{name}-m{m}-s{seed}", f"{m}/Fix{suffix}", seed,
                SMOL + steps + ["--budget", str(m), "--alloc", "fix"], "fix")
            for name, suffix, steps in (("fix", "", CLAIM_STEPS), ("probe", " (60 steps)", probe))
            for m in CURVE_DIMS]


ALLOC_RULES = {  # group label -> (allocation field, script, flags): the allocation grid's rows
    "Fix": ("fix", "distill.py", ["--alloc", "fix"]),
    "DoF": ("dof", "distill.py", ["--alloc", "dof"]),
    "DoF (uncentred kernel)": ("dof-raw", "bench/allocation.py", ["--rule", "dof-raw"]),
    "Measured": ("measured", "bench/allocation.py", ["--rule", "measured", "--curves", "docs/results/curves"]),
    "Entropy": ("entropy", "bench/allocation.py", ["--rule", "entropy"]),   # best with the curves' gains
}


def allocation_grid(seeds=(1, 2, 3), rules=ALLOC_RULES):
    """Budget 32, one row per allocation rule, paired seeds other than the curves' seed."""
    return [Run("allocation", f"b32-{name}-s{s}", f"32/{label}", s, SMOL + CLAIM_STEPS + ["--budget", "32"] + flags,
                name, script) for label, (name, script, flags) in rules.items() for s in seeds]


CONVERGE_STEPS = ["--max-steps", "960", "--warmup-steps", "96", "--eval-interval", "240"]


def converge_grid(seeds=(1, 2)):
    """Closer to convergence: 4x the claim grid's steps (960) at budget 32, Fix against the measured allocation (the
    best rule by the curves), on the allocation grid's seeds."""
    return [Run("converge", f"b32-{name}-s{s}", f"32/{label}", s, SMOL + CONVERGE_STEPS + ["--budget", "32"] + flags,
                name, script) for label, (name, script, flags) in ALLOC_RULES.items() if name in ("fix", "measured")
            for s in seeds]


def best_grid(seeds=(1, 2)):
    """The best student: the converge grid's 960 layerwise steps, then 200 steps of the direct loss end to end at a
    tenth of the layerwise learning rates (the recipe grid's fine-tune, twice as long)."""
    direct = ["--loss", "direct", "--block-size", "256", "--batch-size", "1", "--eval-iters", "8", "--log-interval",
              "10", "--lr-z", "2e-3", "--lr-alpha", "2e-2", "--max-steps", "200", "--warmup-steps", "20",
              "--eval-interval", "100"]
    return [Run("best", f"b32-{name}-direct-s{s}", f"32/{label}, 960 layerwise + 200 direct steps", s, SMOL[:4] + direct
                + ["--init-from", f"out-experiments/converge/b32-{name}-s{s}"], name)
            for label, name in (("Fix", "fix"), ("Measured", "measured")) for s in seeds]


PRESET = ["--model", "smollm2-135m", "--data", "data/wikitext-smollm2", "--preset", "cpu"]
PRESET_VARIANTS = {"300 layerwise steps (the old preset)": ("layerwise300", ["--max-steps", "300", "--warmup-steps",
                                                                             "30", "--eval-interval", "100"]),
                   "450 layerwise steps": ("layerwise450", ["--max-steps", "450", "--warmup-steps", "45",
                                                            "--eval-interval", "150"]),
                   "360 steps, the last 60 direct": ("direct60", ["--max-steps", "360", "--direct-steps", "60",
                                                                  "--warmup-steps", "30", "--eval-interval", "120"],
                                                     "experiments/direct_finetune.py")}


def preset_grid(seeds=(0, 1, 2)):
    """Recipes for --preset cpu, each about 8 minutes on one thread: the old preset, longer layerwise training (the
    preset now), and layerwise training whose last steps fine-tune end to end (the direct loss at the schedule's low
    tail: experiments/direct_finetune.py). Each names its steps, so that it stays the same run whatever the preset
    says."""
    return [Run("preset", f"{name}-s{s}", f"32/{label}", s, PRESET + flags, name, *script)
            for label, (name, flags, *script) in PRESET_VARIANTS.items() for s in seeds]


WINDOW_PRESET = ["--model", "smollm2-135m", "--data", "data/wikitext2", "--preset", "cpu", "--max-steps", "450",
                 "--warmup-steps", "45", "--eval-interval", "150"]
# group label -> (name, flags): experiments/window.py at --preset cpu's recipe, most wanted first
WINDOW_RUNS = {"DoF, W=64": ("dof-w64", ["--window", "64"]),
               "Fix, W=64": ("fix-w64", ["--window", "64", "--alloc", "fix"]),
               "DoF, W=16": ("dof-w16", ["--window", "16"]),
               "Fix, W=0": ("fix-w0", ["--window", "0", "--alloc", "fix"]),
               "DoF, W=0": ("dof-w0", ["--window", "0"])}


def window_grid(seeds=(0, 1, 2)):
    """A window of exact softmax beside the features (experiments/window.py): W = 0, 16 and 64, and Fix against DoF
    at W = 0 and 64, each 9-14 minutes on one thread."""
    return [Run("window", f"{name}-s{s}", f"32/{label}", s, WINDOW_PRESET + flags, name, "experiments/window.py")
            for label, (name, flags) in WINDOW_RUNS.items() for s in seeds]


# group label -> (name, flags): the window with StreamingLLM's sinks, and the students its long-context table
# compares (each keeps its checkpoint in out-experiments/sinks/ for bench/long_context.py)
SINK_RUNS = {"DoF, W=64, S=4": ("dof-w64-sink4", ["--window", "64", "--sinks", "4"]),
             "DoF, W=64": ("dof-w64", ["--window", "64"]),
             "DoF, W=0": ("dof-w0", ["--window", "0"]),
             "DoF, W=16, S=4": ("dof-w16-sink4", ["--window", "16", "--sinks", "4"]),
             "DoF, W=16": ("dof-w16", ["--window", "16"])}


def sinks_grid(seeds=(0, 1, 2)):
    """The window with sinks against without, and the core student: --preset cpu's recipe, 10-40
    minutes a run on one thread beside other runs."""
    return [Run("sinks", f"{name}-s{s}", f"32/{label}", s, WINDOW_PRESET + flags, name, "experiments/window.py")
            for s in seeds for label, (name, flags) in SINK_RUNS.items()]


GRIDS = {"claim": claim_grid, "recipe": recipe_grid, "heads": heads_grid, "curves": curves_grid,
         "allocation": allocation_grid, "converge": converge_grid, "preset": preset_grid,
         "best": best_grid, "window": window_grid, "sinks": sinks_grid}


# ----------------------------------------------------------------------------------------------------------------
# Running

def result_path(run, results=RESULTS):
    return Path(results) / run.grid / f"{run.name}.json"


def execute(run, results=RESULTS, scratch=SCRATCH):
    """Run one configuration (unless its JSON exists) and write its JSON; a failed run writes nothing."""
    path = result_path(run, results)
    if path.is_file():
        return path
    out = Path(scratch) / run.grid / run.name
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = run.command(out) + (["--resume"] if (out / "config.json").is_file() else ["--overwrite"])
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    t0 = time.time()
    with open(out.with_suffix(".log"), "a") as log, LOCK:
        if STOPPED.is_set():
            raise door.ModelError(f"run {run.grid}/{run.name} not started: the runner was stopped")
        child = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        CHILDREN.add(child)
    try:
        rc = child.wait()
    finally:
        with LOCK:
            CHILDREN.discard(child)
    if rc != 0:
        raise door.ModelError(f"run {run.grid}/{run.name} failed (exit {rc}); its log is {out.with_suffix('.log')}")
    config = json.loads((out / "config.json").read_text())
    metrics = json.loads((out / "metrics.json").read_text())
    said = re.findall(r"greedy continuations of (.*):\n  teacher: (.*)\n  student: (.*)\n", out.with_suffix(".log").read_text())
    record = {"name": run.name, "group": run.group, "seed": run.seed, "allocation": run.allocation or None,
              "args": relative(config), "dims": config["dims"],
              "val": metrics["val"], "seconds": round(time.time() - t0, 1),
              "train_seconds": round(metrics.get("train_seconds", 0.0), 1),
              "command": f"python {run.script} " + " ".join(run.flags + ["--seed", str(run.seed)]),
              "continuations": dict(zip(("prompt", "teacher", "student"), said[-1])) if said else None}
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_text_atomic(path, json.dumps(record, indent=1) + "\n")
    return path


def relative(x, root=ROOT):
    """x with every path string under the repository written relative to it (a result file names no machine)."""
    if isinstance(x, dict):
        return {k: relative(v, root) for k, v in x.items()}
    if isinstance(x, list):
        return [relative(v, root) for v in x]
    if isinstance(x, str) and x.startswith(str(root) + os.sep):
        return os.path.relpath(x, root)
    return x


def run_grid(runs, jobs=2, results=RESULTS, scratch=SCRATCH):
    """Run the runs that have no JSON yet, `jobs` at a time. Stopped (Ctrl-C, or SIGTERM: run_main's
    KeyboardInterrupt) or at a failed run, it starts no other run, sends SIGTERM to each running one (which stops
    with its last checkpoint whole, for the next --run to resume) and waits for them to exit."""
    todo = [r for r in runs if not result_path(r, results).is_file()]
    for r in todo:                                              # a continuation starts from a checkpoint, not a JSON
        if "--init-from" in r.flags and not files.is_checkpoint(ROOT / (ckpt := r.flags[r.flags.index("--init-from") + 1])):
            raise door.ModelError(f"run {r.grid}/{r.name} continues the checkpoint {ckpt}, which is not here (result files "
                             f"are committed, checkpoints are not); make it first: move that run's JSON out of "
                             f"docs/results and run its grid with --match {Path(ckpt).name}")
    print(f"{len(runs) - len(todo)} of {len(runs)} runs done; running {len(todo)}, {jobs} at a time")
    STOPPED.clear()
    with ThreadPoolExecutor(jobs) as pool:
        try:
            for path in pool.map(lambda r: execute(r, results, scratch), todo):
                print(f"wrote {path.relative_to(results)}", flush=True)
        except BaseException:                    # stopped, or a run failed
            with LOCK:
                STOPPED.set()
                for child in CHILDREN:
                    child.terminate()                # SIGTERM
            raise                                    # once the pool's threads have seen their children exit


# ----------------------------------------------------------------------------------------------------------------
# Tables and figures, from the JSON files only

def read(path):
    """A result file's JSON object; a missing or damaged one is one sentence."""
    return files.read_json(path, "restore it (git checkout -- docs/results) or run its grid again")


def load(grid, results=RESULTS):
    """The run records of a grid (JSONs with a group; others, like the predictors, are not runs)."""
    return [r for r in map(read, sorted((Path(results) / grid).glob("*.json"))) if "group" in r]


def check_whole(grid, records, results=RESULTS):
    """A ModelError where one of the grid's runs is missing or stopped before its last step: a table would drop it
    from a mean without a word."""
    short = [r["name"] for r in records if r["val"][-1]["step"] != r["args"]["args"]["max_steps"]]
    if lost := sorted({run.name for run in GRIDS[grid]()} - {r["name"] for r in records}) + short:
        raise door.ModelError(f"{Path(results) / grid} lacks the whole runs {', '.join(lost)}; run them with `python "
                         f"docs/experiments.py --run {grid}` (it resumes unfinished runs), then --report")


def final(r):
    v = r["val"][-1]
    if not all(map(np.isfinite, [v["student_loss"], v["teacher_loss"], *v["attn_kl"]])):
        raise ValueError(f"run {r['name']} ended at a loss that is not finite")
    return v["student_loss"], float(np.mean(v["attn_kl"])), v["teacher_loss"]


def mean_std(xs):
    xs = np.asarray(xs, float)
    return xs.mean(), (xs.std(ddof=1) if len(xs) > 1 else float("nan"))


def groups(records):
    """Records by configuration ("budget/allocation"), budgets ascending, then Fix, DoF, DoF+Clip, Reverse, others."""
    out = {}
    for r in records:
        out.setdefault(r["group"], []).append(r)
    order = list(ALLOCS)
    key = lambda g: (int(g.split("/")[0]), order.index(g.split("/")[1]) if g.split("/")[1] in order else len(order), g)
    return {g: out[g] for g in sorted(out, key=key)}


def summary_table(records):
    """One row per configuration: held-out next-token loss and mean attention KL, mean ± std over seeds."""
    rows = ["| budget | allocation | seeds | dims: mean (min–max) | next-token loss | gap to teacher "
            "| attention KL (mean over layers) | wall minutes per run |", "|---:|---|---:|---|---|---|---|---:|"]
    for g, rs in groups(records).items():
        budget, alloc = g.split("/")
        loss, kl = mean_std([final(r)[0] for r in rs]), mean_std([final(r)[1] for r in rs])
        gap = mean_std([final(r)[0] - final(r)[2] for r in rs])
        dims = np.array([r["dims"] for r in rs])
        pm = lambda m, s: f"{m:.3f}" if np.isnan(s) else f"{m:.3f} ± {s:.3f}"      # one seed: no sd  # noqa: E731
        rows.append(f"| {budget} | {alloc} | {len(rs)} | {dims.mean():.1f} ({dims.min()}–{dims.max()}) | "
                    f"{pm(*loss)} | {pm(*gap)} | {pm(*kl)} | {np.mean([r['seconds'] for r in rs]) / 60:.1f} |")
    teacher = {r["seed"]: final(r)[2] for r in records}
    rows.append(f"\nMean ± sd (n − 1) over the seeds. The teacher's next-token loss on each seed's held-out windows: "
                f"{', '.join(f'seed {s} {t:.3f}' for s, t in sorted(teacher.items()))}; the gap is paired with it seed "
                "by seed.")
    return "\n".join(rows)


def paired_diffs(records, base="Fix"):
    """Each group's (next-token loss, attention KL) minus `base`'s at its budget, seed by seed: group -> (pairs, 2)."""
    by = {(r["group"], r["seed"]): r for r in records}
    out = {}
    for g in groups(records):
        budget, alloc = g.split("/")
        pairs = [(by[(g, s)], by[(f"{budget}/{base}", s)]) for (gg, s) in by if gg == g and (f"{budget}/{base}", s) in by]
        if alloc != base and pairs:
            out[g] = np.array([[final(a)[0] - final(b)[0], final(a)[1] - final(b)[1]] for a, b in pairs])
    return out


def standard_error(d):
    """Standard error of the mean of each column of d (pairs, k); nan for one pair."""
    return d.std(0, ddof=1) / np.sqrt(len(d)) if len(d) > 1 else np.full(d.shape[1:], np.nan)


def paired_table(records, base="Fix"):
    """Paired differences against `base` at each budget, seed by seed: mean ± standard error."""
    rows = [f"| budget | allocation − {base} | pairs | Δ next-token loss | Δ attention KL |", "|---:|---|---:|---|---|"]
    for g, d in paired_diffs(records, base).items():
        budget, alloc = g.split("/")
        se = standard_error(d)
        rows.append(f"| {budget} | {alloc} − {base} | {len(d)} | {d[:, 0].mean():+.3f} ± {se[0]:.3f} | "
                    f"{d[:, 1].mean():+.3f} ± {se[1]:.3f} |")
    return "\n".join(rows) + "\n\nMean ± standard error over the pairs."


def layer_table(records, budget="32", allocs=("Fix", "DoF"), per_row=15):
    """Where the dims went and what each layer's held-out KL did (mean over seeds), `per_row` layers a table."""
    g = groups(records)
    have = [a for a in allocs if f"{budget}/{a}" in g]
    L = len(g[f"{budget}/{have[0]}"][0]["dims"]) if have else 0
    tables = []
    for first in range(0, L, per_row):
        layers = range(first, min(first + per_row, L))
        rows = ["| layer | " + " | ".join(map(str, layers)) + " |", "|---|" + "---:|" * len(layers)]
        for a in have:
            rs = g[f"{budget}/{a}"]
            dims = [f"{np.mean([r['dims'][l] for r in rs]):.0f}" for l in layers]
            kl = [f"{np.mean([r['val'][-1]['attn_kl'][l] for r in rs]):.3f}" for l in layers]
            rows += [f"| {a} dim | " + " | ".join(dims) + " |", f"| {a} KL | " + " | ".join(kl) + " |"]
        tables.append("\n".join(rows))
    return "\n\n".join(tables)


def curves(records, path):
    """Held-out next-token loss against step, mean ± std over seeds, one line per configuration."""
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed, so {path} was not drawn; pip install matplotlib")
        return False
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    ended = {r["name"]: r["val"][-1]["step"] for r in records}       # a continuation starts where its --init-from ended
    for g, rs in groups(records).items():
        start = ended.get(Path(rs[0].get("args", {}).get("init_from") or "").name, 0)
        steps = [start + v["step"] for v in rs[0]["val"]]
        y = np.array([[v["student_loss"] for v in r["val"]] for r in rs if len(r["val"]) == len(steps)])
        m, s = y.mean(0), (y.std(0, ddof=1) if len(y) > 1 else 0 * y[0])
        ax.plot(steps, m, label=f"budget {g.replace('/', ', ')}")
        ax.fill_between(steps, m - s, m + s, alpha=0.2)
    ax.axhline(np.mean([final(r)[2] for r in records]), color="k", ls="--", lw=1, label="teacher (mean over seeds)")
    ax.set(xlabel="step", ylabel="held-out next-token loss", yscale="log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with files.atomic_path(path) as tmp:                                   # whole or not at all
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return True


def continuations(records):
    """The greedy continuations a run printed at its end (teacher and student, side by side)."""
    r = next((r for r in records if r.get("continuations")), None)
    if r is None:
        return "(no run printed continuations)"
    c = r["continuations"]
    return (f"Prompt {c['prompt']} ({r['name']}, 30 greedy tokens):\n\n| model | continuation |\n|---|---|\n"
            f"| teacher | {c['teacher']} |\n| student | {c['student']} |")


def zeroshot_table(results):
    """evaluate.py's results.json with --ckpt: accuracy per task, teacher and student, with standard errors."""
    rows = ["| task | n | teacher acc | student acc | teacher acc_norm | student acc_norm |", "|---|---:|---|---|---|---|"]
    t, st = results["results"], results["student"]["results"]
    f = lambda r, k: "–" if r[k] is None else f"{r[k]:.3f} ± {r[k + '_stderr']:.3f}"
    for task in t:
        rows.append(f"| {task} | {t[task]['n']} | {f(t[task], 'acc')} | {f(st[task], 'acc')} | "
                    f"{f(t[task], 'acc_norm')} | {f(st[task], 'acc_norm')} |")
    mean = lambda r: np.mean([v["acc"] for v in r.values()])
    rows.append(f"| mean | | {mean(t):.3f} | {mean(st):.3f} | | |")
    return "\n".join(rows)


def finetune_table(results):
    """evaluate.py's results.json with --finetune-epochs: per task and model the zero-shot accuracy, the
    accuracy after each epoch, both rules' picks, seconds an epoch; the teacher's grid; what the student keeps."""
    rows = ["| task | model | lr | zero-shot acc | acc after each epoch | validation acc after each epoch | "
            "paper's rule | validation rule | s/epoch |", "|---|---|---|---|---|---|---|---|---|"]
    acc = lambda r: "–" if r is None else f"{r['acc']:.3f} ± {r['acc_stderr']:.3f}"  # noqa: E731
    notes = []
    for task, models in results["finetune"]["tasks"].items():
        for label, r in models.items():
            if label == "seconds" or r.get("lr") is None:
                continue
            epochs, rules = r["epochs"], r["rules"]
            honest = rules.get("validation")
            pick = "–" if honest is None else f"{acc(honest)} (epoch {honest['epoch']})"
            seconds = np.mean([e["train_seconds"] for e in epochs])
            each = " / ".join(f"{e['eval']['acc']:.3f}" for e in epochs)
            on_validation = " / ".join(f"{e['validation']['acc']:.3f}" for e in epochs if "validation" in e)
            rows.append(f"| {task} | {label} | {r['lr']:g} | {acc(r['zero_shot'])} | {each} | "
                        f"{on_validation or '–'} | {acc(rules['paper'])} (epoch {rules['paper']['epoch']}) | "
                        f"{pick} | {seconds:.0f} |")
        notes += finetune_notes(task, models)
    return "\n".join(rows) + "\n\n" + "\n".join(f"- {n}" for n in notes)


def finetune_notes(task, models):
    """The teacher's learning-rate grid, and the share of the teacher's fine-tuned accuracy each student keeps."""
    teacher, points = models["teacher"], []
    for point in teacher["grid"]:
        if point["stopped"]:
            points.append(f"{point['lr']:g}: diverged")
        else:
            points.append(f"{point['lr']:g}: {point['rules']['paper']['acc']:.3f}")
    notes = [f"{task}: the teacher's grid (lr: its accuracy by the paper's rule) {', '.join(points)}."]
    if teacher.get("lr") is None:
        return notes
    for label in [k for k in models if k not in ("teacher", "seconds")]:
        kept = []
        for rule, name in (("paper", "the paper's rule"), ("validation", "the validation rule")):
            if rule in teacher["rules"]:
                share = models[label]["rules"][rule]["acc"] / teacher["rules"][rule]["acc"]
                kept.append(f"{share:.0%} by {name}")
        zero = models[label]["zero_shot"]["acc"] / teacher["zero_shot"]["acc"]
        notes.append(f"{task}: the {label} keeps {' and '.join(kept)} of the teacher's fine-tuned accuracy "
                     f"({zero:.0%} of its zero-shot accuracy).")
    return notes


def blocks(grid, records):
    """The generated markdown blocks of one grid: name -> text; the per-layer table where it has budget-32 DoF runs."""
    made = {f"{grid}:summary": summary_table(records), f"{grid}:paired": paired_table(records)}
    if "32/DoF" in groups(records):
        made[f"{grid}:layers"] = layer_table(records)
    return made


def window_table(records):
    """The window grid's paired differences, seed by seed (paired_diffs): each window against none
    (DoF dims), and DoF against Fix at each window."""
    rows = ["| comparison | pairs | Δ next-token loss | Δ attention KL |", "|---|---:|---|---|"]
    for a, b in (("DoF, W=16", "DoF, W=0"), ("DoF, W=64", "DoF, W=0"), ("DoF, W=0", "Fix, W=0"),
                 ("DoF, W=64", "Fix, W=64")):
        d = paired_diffs(records, b).get(f"32/{a}")
        if d is not None:
            se = standard_error(d)
            rows.append(f"| {a} − {b} | {len(d)} | {d[:, 0].mean():+.3f} ± {se[0]:.3f} | "
                        f"{d[:, 1].mean():+.3f} ± {se[1]:.3f} |")
    return "\n".join(rows) + "\n\nMean ± standard error over the pairs (budget 32)."


def splice(text, name, body):
    """Replace the text between <!-- begin NAME --> and <!-- end NAME --> (the markers stay)."""
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    if begin not in text or end not in text:
        return text
    head, rest = text.split(begin, 1)
    return head + begin + "\n" + body + "\n" + rest[rest.index(end):]


# grids whose tables also show the claim grid's runs of this configuration, paired seed by seed: the recipe
# continues the layerwise 64/DoF students; per-head dims compare with per-layer dims at budget 32
BASELINE = {"recipe": "64/DoF", "heads": "32/DoF"}
FROM_GRID = {"best": "converge"}             # grids shown after the grid their runs continue


# ----------------------------------------------------------------------------------------------------------------
# The allocation study: per-layer error curves, the measured allocation, cheap predictors, the grid

def layer_curves_figure(Ms, KL, path, named=(0, 10, 21, 27)):
    """KL_l(M) against M, log-log: every layer faint, a few named."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed, so {path} was not drawn; pip install matplotlib")
        return False
    fig, ax = plt.subplots(figsize=(6, 3.8), dpi=110)
    for l in range(KL.shape[1]):
        ax.loglog(Ms, KL[:, l], color="0.75", lw=0.8, zorder=1)
    for l, c in zip(named, ("C0", "C1", "C2", "C3")):
        ax.loglog(Ms, KL[:, l], "o-", color=c, ms=3, label=f"layer {l}", zorder=2)
    ax.loglog(Ms, KL.mean(1), "k--", lw=1.5, label="mean over layers", zorder=3)
    ax.set(xlabel="features per head M (every layer)", ylabel="held-out attention KL", xticks=Ms,
           xticklabels=[str(int(m)) for m in Ms], title="SmolLM2-135M: each layer's error against M (Fix runs)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    with files.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return True


def curve_blocks(results, figures):
    """The curves' tables: mean KL over layers against M (240 steps and 60-step probes), the measured allocation
    from each, and what the 240-step curves predict for the grid's rules."""
    import allocation
    Ms, KL = allocation.load_curves(Path(results) / "curves", "fix")
    Mp, KP = allocation.load_curves(Path(results) / "curves", "probe")
    rows = ["| M | " + " | ".join(str(int(m)) for m in Ms) + " |", "|---|" + "---:|" * len(Ms),
            "| mean KL, 240 steps | " + " | ".join(f"{v:.3f}" for v in KL.mean(1)) + " |",
            "| mean KL, 60-step probes | " + " | ".join(f"{v:.3f}" for v in KP.mean(1)) + " |",
            "| hardest layer (240) | " + " | ".join(f"{int(v)}" for v in KL.argmax(1)) + " |"]
    d240, d60 = allocation.measured_dims(Ms, KL, 32), allocation.measured_dims(Mp, KP, 32)
    fix = allocation.expected_kl(Ms, KL, [32] * KL.shape[1])
    lines = [f"- measured allocation at budget 32 (240-step curves): {d240}",
             f"- from the 60-step probes instead: {d60} (Spearman {allocation.spearman(d240, d60):+.2f} with the 240-step "
             f"dims, mean |difference| {np.mean(np.abs(np.subtract(d240, d60))):.1f} features; the layers' difficulty "
             f"at M = 32 ranks alike, Spearman {allocation.spearman(KL[list(Ms).index(32)], KP[list(Mp).index(32)]):+.2f})",
             f"- mean KL the 240-step curves predict: Fix {fix:.4f}, measured {allocation.expected_kl(Ms, KL, d240):.4f} "
             f"({allocation.expected_kl(Ms, KL, d240) - fix:+.4f}), measured from the probes "
             f"{allocation.expected_kl(Ms, KL, d60):.4f} ({allocation.expected_kl(Ms, KL, d60) - fix:+.4f})"]
    if figures:
        layer_curves_figure(Ms, KL, Path(figures) / "fig-layer-curves.png")
    return {"curves:table": "\n".join(rows), "curves:measured": "\n".join(lines)}


def predictor_table(results):
    """Spearman over the layers of each cheap predictor with difficulty (KL at M = 32) and with the marginal gain
    (minus the slope of log KL in log M), and the mean KL the curves predict for dims in proportion to it."""
    import allocation
    import dof
    Ms, KL = allocation.load_curves(Path(results) / "curves", "fix")
    P = read(Path(results) / "allocation" / "predictors-s0.json")["predictors"]
    diff, gain = KL[list(Ms).index(32)], -allocation.slopes(Ms, KL)
    rows = ["| predictor (per layer) | Spearman with difficulty | Spearman with gain | mean KL predicted for dims "
            "∝ it (Fix: %.4f) |" % allocation.expected_kl(Ms, KL, [32] * KL.shape[1]), "|---|---:|---:|---:|"]
    for name, v in P.items():
        rows.append(f"| {name} | {allocation.spearman(v, diff):+.2f} | {allocation.spearman(v, gain):+.2f} | "
                    f"{allocation.expected_kl(Ms, KL, dof.allocate(v, 32)):.4f} |")
    rows.append(f"| *measured allocation* | | | {allocation.expected_kl(Ms, KL, allocation.measured_dims(Ms, KL, 32)):.4f} |")
    return "\n".join(rows) + f"\n\nDifficulty and gain themselves: Spearman {allocation.spearman(diff, gain):+.2f}."


def allocation_table(records, base="Fix", best="Measured", curves_dir=None):
    """Paired differences of each rule against Fix, seed by seed (mean ± standard error), its share of the measured
    allocation's gain in held-out attention KL, and (given the curves' directory) the Δ KL the curves predict for
    each run's own dims, averaged over the runs."""
    diffs = {g.split("/")[1]: d for g, d in paired_diffs(records, base).items()}
    g = -diffs[best][:, 1] if best in diffs else np.full(2, np.nan)
    gain, gain_se = g.mean(), standard_error(g)
    clear = gain > 2 * gain_se                               # a share of a gain lost in its noise means nothing
    import allocation
    curves = allocation.load_curves(Path(curves_dir)) if curves_dir else None
    predict = lambda rs: np.mean([allocation.expected_kl(*curves, r["dims"]) for r in rs]) if curves else float("nan")
    fix = predict([r for r in records if r["group"].endswith("/" + base)])
    rows = [f"| rule (allocation field) | pairs | Δ next-token loss vs {base} | Δ attention KL vs {base} | share of the "
            f"measured gain in KL | Δ KL the curves predict for these dims |", "|---|---:|---|---|---:|---:|"]
    for alloc, d in diffs.items():
        se = standard_error(d)
        rs = [r for r in records if r["group"].endswith("/" + alloc)]
        rows.append(f"| {alloc} (`{rs[0]['allocation']}`) | {len(d)} | {d[:, 0].mean():+.3f} ± {se[0]:.3f} | "
                    f"{d[:, 1].mean():+.4f} ± {se[1]:.4f} | {f'{-d[:, 1].mean() / gain:+.0%}' if clear else '–'} | "
                    f"{predict(rs) - fix:+.4f} |")
    rows.append("\nMean ± standard error over the pairs.")
    if not clear:
        rows.append(f"\nThe measured allocation's gain in attention KL over {base}, {gain:+.4f} ± {gain_se:.4f}, is "
                    "within two standard errors of zero, so no share of it is given.")
    return "\n".join(rows)


def instrument_blocks(grid, results, figures):
    """The generated blocks of a folder written by an instrument (bench/, evaluate.py), not a grid of runs:
    name -> markdown (and its figures, drawn); None for a grid's folder."""
    made = {}
    if grid == "gpu":                            # gpu_check.py's JSON: its own table and targets
        import gpu_check
        for p in sorted((Path(results) / grid).glob("*.json")):
            res = read(p)
            table = gpu_check.table(res).splitlines()
            for section in ("ops", "distill", "scan", "decode", "dof"):      # each beside the question it answers
                rows = [row for row in table[2:] if row.startswith(f"| {section} |")]
                made[f"gpu:{p.stem}-{section}"] = "\n".join(table[:2] + rows)
            made[f"gpu:{p.stem}-targets"] = "\n".join(gpu_check.targets(res))
        return made
    if grid == "heads-kl":                       # bench/heads.py: per-head error against M, synthetic check
        import heads
        for p in sorted((Path(results) / grid).glob("*.json")):
            res = read(p)
            if p.stem == "synthetic":
                made[f"heads-kl:{p.stem}"] = heads.synthetic_table(res)
            else:
                made[f"heads-kl:{p.stem}"] = heads.table(res)
                heads.figure(res, Path(figures) / "fig-heads.png")
        return made
    if grid == "window-cost":                    # bench/window_cost.py: attention mass, decoding, forward
        import window_cost
        for p in sorted((Path(results) / grid).glob("*.json")):
            for name, table in window_cost.tables(read(p)).items():
                made[f"window-cost:{name}"] = table
        return made
    if grid == "long":                           # bench/long_context.py: loss by window length, recall, cache
        import long_context
        records = [read(p) for p in sorted((Path(results) / grid).glob("*.json"))]
        for name, table in long_context.tables(records).items():
            made[f"long:{name}"] = table
        long_context.figure(records, Path(figures) / "fig-long-context.png")
        return made
    if grid == "finetune":                       # evaluate.py's results.json with --finetune-epochs
        for p in sorted((Path(results) / grid).glob("*.json")):
            made[f"finetune:{p.stem}"] = finetune_table(read(p))
        return made
    if grid == "zeroshot":                       # evaluate.py's results.json, not distill.py runs
        for p in sorted((Path(results) / grid).glob("*.json")):
            made[f"zeroshot:{p.stem}"] = zeroshot_table(read(p))
        return made
    return None


def grid_blocks(grid, results, figures):
    """The generated blocks of one folder of docs/results: name -> markdown (and its figures, drawn)."""
    made = instrument_blocks(grid, results, figures)
    if made is not None:
        return made
    made = {}
    if grid in ("curves", "allocation"):         # both read every M of the curves: a missing one is named here
        check_whole("curves", load("curves", results), results)
    if grid == "curves":                         # the per-layer error curves: tables and figure, not a grid table
        return curve_blocks(results, figures)
    records = load(grid, results)
    if grid in GRIDS:
        check_whole(grid, records, results)
    if grid == "allocation":
        made["allocation:predictors"] = predictor_table(results)
        made["allocation:paired"] = allocation_table(records, curves_dir=Path(results) / "curves")
        made["allocation:summary"] = summary_table(records)
        curves(records, Path(figures) / f"curves-{grid}.png")
        return made
    if grid in FROM_GRID:                        # shown after the runs they continue, paired with their Fix
        made[f"{grid}:continuations"] = continuations(records)
        fix = next(g.split("/")[1] for g in groups(records) if g.split("/")[1].startswith("Fix"))   # continued
        own, records = paired_table(records, fix), load(FROM_GRID[grid], results) + records
        made[f"{grid}:summary"], made[f"{grid}:paired"] = summary_table(records), paired_table(records).rsplit(
            "\n\n", 1)[0] + "\n\n" + own                # against the Fix they continue, then against its continuation
    elif grid in BASELINE:                       # shown against the claim grid's per-layer DoF runs
        if grid == "recipe":
            made[f"{grid}:continuations"] = continuations(records)
        records = [r for r in load("claim", results) if r["group"] == BASELINE[grid]] + records
        made[f"{grid}:summary"], made[f"{grid}:paired"] = summary_table(records), paired_table(records, "DoF")
    elif grid == "window":                       # the window's size, and Fix against DoF with and without one
        made[f"{grid}:summary"], made[f"{grid}:paired"] = summary_table(records), window_table(records)
    elif grid == "sinks":                        # the window with sinks; its long-context table is "long"
        made[f"{grid}:summary"] = summary_table(records)
    elif grid == "preset":                       # recipes for --preset cpu against the old one
        old = next(iter(PRESET_VARIANTS))
        made[f"{grid}:summary"], made[f"{grid}:paired"] = summary_table(records), paired_table(records, old)
    elif records:
        made.update(blocks(grid, records))
    if records:
        curves(records, Path(figures) / f"curves-{grid}.png")
    return made


# the paired comparisons that answer the main questions: text, the grids whose runs are paired, group, its base
OVERVIEW = (("DoF dims against Fix, budget 32", ("allocation",), "32/DoF", "Fix"),
            ("DoF dims against Fix, budget 64", ("claim",), "64/DoF", "Fix"),
            ("the measured allocation against Fix, 960 steps", ("converge",), "32/Measured", "Fix"),
            ("100 direct steps after layerwise training, against none", ("claim", "recipe"), "64/DoF + direct", "DoF"),
            ("240 more layerwise steps, against none", ("claim", "recipe"), "64/DoF, 240 more layerwise steps", "DoF"),
            ("keys not centred, against centred", ("claim", "recipe"), "64/DoF, keys not centred", "DoF"),
            ("per-head DoF dims against per-layer DoF dims", ("claim", "heads"), "32/DoF per head", "DoF"),
            ("a window of 64 exact keys against none, 450 steps", ("window",), "32/DoF, W=64", "DoF, W=0"))


def overview(results):
    """One row per comparison of OVERVIEW: paired differences seed by seed, mean ± standard error."""
    rows = ["| comparison | grid | seeds | Δ next-token loss | Δ attention KL |", "|---|---|---|---|---|"]
    for text, grids, group, base in OVERVIEW:
        records = [r for g in grids for r in load(g, results)]
        d = paired_diffs(records, base)[group]
        se = standard_error(d)
        seeds = ", ".join(str(r["seed"]) for r in records if r["group"] == group)
        rows.append(f"| {text} | {grids[-1]} | {seeds} | {d[:, 0].mean():+.3f} ± {se[0]:.3f} | "
                    f"{d[:, 1].mean():+.3f} ± {se[1]:.3f} |")
    return "\n".join(rows) + "\n\nMean ± standard error over the seeds, each seed's runs on the same windows."


def rebuild_docs(docs=(ROOT / "docs" / "results.md", ROOT / "README.md"), results=RESULTS, figures=ROOT / "docs"):
    """Rebuild every generated block of `docs` (between their markers) and each grid's learning-curve figure;
    -> the blocks, name -> text."""
    made = {}
    first = {"curves", "claim", *FROM_GRID.values()}       # grids others read: a damaged file of theirs is named theirs
    grids = sorted(p.name for p in Path(results).iterdir() if p.is_dir())
    for grid in sorted(grids, key=lambda g: g not in first):      # stable: alphabetical within each part
        try:
            made.update(grid_blocks(grid, results, figures))
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:   # a file of another form
            raise door.ModelError(f"{Path(results) / grid} holds a result file its script did not write ({type(e).__name__}"
                             f": {str(e)[:80]}); restore it (git checkout -- docs/results) or run its grid again") \
                from None
    if all((Path(results) / g).is_dir() for o in OVERVIEW for g in o[1]):
        made["overview"] = overview(results)
    for doc in docs:
        text = Path(doc).read_text()
        for name, body in made.items():
            text = splice(text, name, body)
        files.write_text_atomic(doc, text)
        print(f"rebuilt {doc}")
    return made


@dataclass
class ExperimentConfig(door.Config):
    """Run a grid of distill.py configurations (one JSON per run under docs/results/<grid>/), or rebuild the tables
    and figures of docs/results.md from those files."""
    run: str = door.opt("", "grid to run (its missing configurations only)", choices=["", *sorted(GRIDS)])
    match: str = door.opt("", "run only the grid's runs whose name contains this")
    jobs: int = door.opt(2, "runs at a time, one torch thread each", min=1)
    report: bool = door.opt(False, "rebuild the generated blocks of docs/results.md and README.md, and the figures")


def main(argv=None):
    cfg = door.parse_config(ExperimentConfig, argv)
    if not cfg.run and not cfg.report:
        raise door.ModelError("nothing to do; pass --run GRID to run a grid or --report to rebuild docs/results.md")
    if cfg.run and not (runs := [r for r in GRIDS[cfg.run]() if cfg.match in r.name]):
        raise door.ModelError(f"no run of grid {cfg.run} has a name containing {cfg.match!r}; its runs are "
                         f"{', '.join(r.name for r in GRIDS[cfg.run]())}")
    if cfg.run:
        run_grid(runs, cfg.jobs)
    if cfg.report:
        rebuild_docs()


if __name__ == "__main__":
    door.run_main(main)
