"""
One distill.py step of each loss at the GPT-2-124M shape (1024 tokens, budget 64, one torch thread), counted at the
dispatcher and timed, for two versions of distill.py side by side in one run (alternating, --rounds times each), in
both layouts of the layerwise losses (--stack yes: a GPU's, no: a CPU's; the older version has one layout):

    python docs/results/fast-loss/step.py --before ../before-fast --after . --out docs/results/fast-loss/step.json

--before, --after: checkouts of the two versions; the measurement is bench/bench.py's step_row (of --after),
which uses only distill.py's API, applied to each version's distill.py.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROW = ("import json, sys; sys.path[:0] = [sys.argv[1]]; import distill; sys.path.insert(1, sys.argv[2]); "
       "import bench; print('RESULT', json.dumps([{**bench.step_row(distill, l, stack=s), 'stack': s} for l, s in "
       "(('softmax', 'yes'), ('softmax', 'no'), ('l2', 'yes'), ('l2', 'no'), ('direct', 'no'))]))")


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--before", required=True)
    p.add_argument("--after", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="step.json")
    a = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    bench_dir = str(Path(a.after).resolve() / "bench")
    res = {"before": [], "after": []}
    for r in range(a.rounds):
        for name in ("before", "after"):
            tree = str(Path(getattr(a, name)).resolve())
            out = subprocess.run([sys.executable, "-c", ROW, tree, bench_dir], cwd=tree, capture_output=True,
                                 text=True, env=env, timeout=3000)
            if out.returncode:
                raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
            res[name].append(json.loads(out.stdout.split("RESULT", 1)[1]))
            print(name, r, [(x["loss"], x["ops"], round(x["ms"]), round(x["cpu_ms"])) for x in res[name][-1]], flush=True)
    res["summary"] = {f"{x['loss']}, stack {x['stack']}": {k: {"ops": res[k][0][i]["ops"], **{t: statistics.median(
        rr[i][t] for rr in res[k]) for t in ("ms", "cpu_ms")}} for k in ("before", "after")}
        for i, x in enumerate(res["after"][0])}
    res["command"] = "python docs/results/fast-loss/step.py " + " ".join(sys.argv[1:])
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res["summary"], indent=1))


if __name__ == "__main__":
    main()
