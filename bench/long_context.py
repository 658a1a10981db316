"""
Long context and recall, for one model a run: its next-token loss on held-out text at several
window lengths (evaluate.perplexity), its passkey retrieval (passkey.py) at several prompt lengths,
and the bytes its decoding cache holds a sequence. A model is the teacher, the teacher's untrained
window with sinks (experiments/streaming.py) or a student of distill.py or experiments/window.py:

    python bench/long_context.py --model smollm2-135m --what teacher --out long/teacher.json
    python bench/long_context.py --what window:64:4 ...          # W = 64 keys, S = 4 sinks
    python bench/long_context.py --what out-experiments/sinks/dof-w64-sink4-s0 ...   # a checkpoint

With --offsets, the loss on 256-token windows whose positions start at each offset instead (the
teacher's attention is the same at any offset, rotary being relative; a student's features see
rotated queries and keys it may never have been trained on).
"""

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "experiments")]
import datafiles  # noqa: E402
import door  # noqa: E402
import evaluate  # noqa: E402
import files  # noqa: E402
import forks  # noqa: E402
import model  # noqa: E402
import passkey  # noqa: E402
import streaming  # noqa: E402
import tokenizer  # noqa: E402


def ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


@dataclass
class LongConfig(door.Config):
    """Loss at several window lengths, passkey recall and cache bytes of one model."""
    model: str = door.opt("smollm2-135m", "the teacher")
    what: str = door.opt("teacher", "teacher, window:W:S (the untrained window) or a checkpoint")
    data: str = door.opt("data/wikitext2/val.bin", "held-out token file")
    tokens: int = door.opt(8192, "first tokens of --data scored", min=2)
    contexts: str = door.opt("256,1024,2048", "window lengths of the loss")
    passkey: str = door.opt("", "passkey prompt lengths ('': none)",
                            check=lambda cfg: passkey.check_lengths(cfg.passkey))
    passkey_trials: int = door.opt(20, "passkey trials a length", min=1)
    offsets: str = door.opt("", "position offsets of 256-token windows ('': none)")
    seed: int = door.opt(0, "seed of the passkey trials")
    batch_size: int = door.opt(1, "passkey prompts of one length decoded at once", min=1)
    out: str = door.opt("long.json", "the JSON to write")

    def __post_init__(self):
        super().__post_init__()
        out = Path(self.out)
        files.check_out(out.parent, [out.name])                     # before the work, not after it
        reads = [self.data, self.model, *(Path(self.what, f) for f in files.CHECKPOINT_FILES)]
        if out.resolve() in {Path(r).resolve() for r in reads}:     # --data had been replaced
            raise door.ModelError(f"--out {self.out} would replace a file this run reads; pass "
                                  "another --out")


def load(cfg):
    """-> (the model, its decoding cache bytes a sequence (None: the teacher's grows with the
    context), what it is)."""
    teacher = model.GPT.from_pretrained(cfg.model)
    c = teacher.config
    if cfg.what == "teacher":
        return teacher, None, {"kind": "teacher"}
    if cfg.what.startswith("window:"):
        W, S = ints(cfg.what.split(":", 1)[1].replace(":", ","))
        net = streaming.sink_window(teacher, W, S)
        return net, streaming.cache_bytes(c, W, S), {"kind": "untrained", "window": W, "sinks": S}
    made_by = files.read_json(Path(cfg.what) / "config.json", "pass a checkpoint").get("fork")
    net, ckpt = forks.open_student(ROOT / (made_by or "experiments/window.py"), cfg.what, teacher=teacher)
    W, S = (ckpt.get("args", {}).get(k, 0) for k in ("window", "sinks"))
    dims = ckpt["dims"]
    state = sum(c.n_head * m * (c.head_dim + 1) * 4 for m in dims)          # S, s in fp32
    info = {"kind": "student", "window": W, "sinks": S, "dims": dims, "seed": ckpt["seed"],
            "run": Path(cfg.what).name, "step": ckpt["step"], "block_size": ckpt["block_size"],
            "positions": ckpt.get("args", {}).get("positions", 0)}
    return net, state + streaming.cache_bytes(c, W, S), info


@torch.inference_mode()
def offset_loss(net, tokens, offset, T=256):
    """Mean next-token loss of windows of T tokens whose positions start at `offset`."""
    total, n = 0.0, 0
    for s in range(0, len(tokens) - T - 1, T):
        x = torch.tensor(tokens[s:s + T + 1].astype(np.int64))[None]
        cache = model.Cache(net.config.n_layer)
        cache.pos = offset
        logits = net.lm_head(net.hidden(x[:, :-1], cache)).float()
        total += torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
        n += T
    return total / n


def main(argv=None):
    cfg = door.parse_config(LongConfig, argv)
    torch.manual_seed(0)
    net, nbytes, info = load(cfg)
    enc = tokenizer.load_tokenizer(cfg.model)
    trials = passkey.make_trials(enc, passkey.lengths(cfg.passkey), cfg, net.config.block_size)
    tokens = datafiles.read_tokens(cfg.data)[:cfg.tokens]
    out = {**info, "what": cfg.what, "cache_bytes": nbytes, "tokens": len(tokens), "loss": {}}
    t0 = time.time()
    for T in ints(cfg.contexts):
        out["loss"][str(T)] = evaluate.perplexity(net, tokens, T)["loss"]
        print(f"{cfg.what}: loss {out['loss'][str(T)]:.4f} at {T} tokens", flush=True)
    if cfg.offsets:
        out["offset_loss"] = {str(o): offset_loss(net, tokens, o) for o in ints(cfg.offsets)}
        print(f"{cfg.what}: loss at position offsets {out['offset_loss']}", flush=True)
    if trials:
        out["passkey"] = passkey.run({cfg.what: net}, enc, trials, cfg, "cpu")[cfg.what]
        for r in out["passkey"].values():
            del r["trials"]
    out["seconds"] = round(time.time() - t0, 1)
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    files.write_text_atomic(cfg.out, json.dumps(out, indent=1) + "\n")
    print(f"wrote {cfg.out}")


def label(r):
    """A row's name: the teacher, the untrained window or a student's configuration."""
    if r["kind"] == "teacher":
        return "teacher"
    band = f"W={r['window']}, S={r['sinks']}"
    if r["kind"] == "untrained":
        return f"untrained window, {band}"
    if r.get("positions"):
        band += f", then {r['block_size']}-token windows at positions < {r['positions']}"
    return "student (core), W=0" if r["window"] == 0 else f"trained hybrid, {band}"


def mean_sd(xs, fmt):
    """'m ± sd' over seeds (the sd unsigned), or the one value."""
    if len(xs) == 1:
        return fmt.format(xs[0])
    return f"{fmt.format(np.mean(xs))} ± {fmt.replace('+', '').format(np.std(xs, ddof=1))}"


def groups(records):
    """label -> its records (seeds), teacher first, then by cache bytes."""
    out = {}
    for r in sorted(records, key=lambda r: (r["kind"] != "teacher", r["cache_bytes"] or 0)):
        out.setdefault(label(r), []).append(r)
    return out


def tables(records):
    """{"gap": a markdown table, a row per model (mean ± sd over seeds): the gap to the teacher's
    loss at each window length, and passkey accuracy at each prompt length}."""
    teacher = next(r for r in records if r["kind"] == "teacher")
    contexts, lengths = list(teacher["loss"]), list(teacher.get("passkey", {}))
    rows = ["| model | seeds | cache KiB a sequence |" + "".join(f" gap, {T} |" for T in contexts)
            + "".join(f" recall, {n} |" for n in lengths),
            "|---|---:|---:|" + "---:|" * (len(contexts) + len(lengths))]
    for name, rs in groups(records).items():
        kib = "grows" if rs[0]["cache_bytes"] is None else f"{rs[0]['cache_bytes'] / 1024:,.0f}"
        seeds = ", ".join(str(r.get("seed", "-")) for r in rs)
        if name == "teacher":
            cells = [f"{teacher['loss'][T]:.3f} (loss)" for T in contexts]
        else:
            cells = [mean_sd([r["loss"][T] - teacher["loss"][T] for r in rs], "{:+.3f}")
                     for T in contexts]
        for n in lengths:
            have = all(n in r.get("passkey", {}) for r in rs)
            accs = [r["passkey"][n]["accuracy"] for r in rs] if have else []
            cells.append(mean_sd(accs, "{:.2f}") if have else "–")
        rows.append(f"| {name} | {seeds} | {kib} | " + " | ".join(cells) + " |")
    k = teacher["passkey"][lengths[0]]["n"] if lengths else 0
    rows.append(f"\nNext-token loss minus the teacher's on the first {teacher['tokens']:,} held-out "
                f"tokens, cut into windows of each length; passkey accuracy over {k} trials a "
                "prompt length (5-digit keys at depths spread evenly); mean ± sd (n − 1) over seeds.")
    return {"gap": "\n".join(rows)}


def figure(records, path):
    """The gap to the teacher against window length, and recall against prompt length: a colour a
    model in both panels, trained students solid, untrained windows dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    teacher = next(r for r in records if r["kind"] == "teacher")
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    colours = plt.get_cmap("tab20").colors
    for i, (name, rs) in enumerate(groups(records).items()):
        style = {"color": colours[i % 20], "marker": "o", "label": name,
                 "linestyle": "--" if rs[0]["kind"] == "untrained" else "-"}
        T = [int(x) for x in teacher["loss"]]
        gaps = [np.mean([r["loss"][str(x)] - teacher["loss"][str(x)] for r in rs]) for x in T]
        a.plot(T, gaps, **style)
        if all("passkey" in r for r in rs):
            n = [int(x) for x in rs[0]["passkey"]]
            b.plot(n, [np.mean([r["passkey"][str(x)]["accuracy"] for r in rs]) for x in n], **style)
    a.set(xscale="log", xlabel="window length (tokens)", ylabel="loss − teacher's (nats)",
          title="gap to the teacher")
    b.set(xscale="log", xlabel="prompt length (tokens)", ylabel="passkey accuracy",
          title="recall", ylim=(-0.05, 1.05))
    fig.legend(*a.get_legend_handles_labels(), loc="center left", bbox_to_anchor=(0.99, 0.5),
               fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    door.run_main(main)
