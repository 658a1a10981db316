"""
Bit-identity of training against the code before it: the same distill.py runs with both versions (SmolLM2-135M, the
claim grid's flags at budget 8: 20 steps of Fix; 10 steps of --loss l2 --alloc dof), then every feature tensor
compared with torch.equal, and the dims and held-out numbers compared exactly.

    python docs/results/budget/identity.py --before ../before --after . --out docs/results/budget/identity.json

--before and --after are checkouts of the two versions (each with data/wikitext-smollm2 prepared).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

SMOL = ("--model smollm2-135m --data data/wikitext-smollm2 --loss softmax --center-keys --block-size 256 "
        "--batch-size 1 --eval-iters 2 --J 1024 --lam 1e-3 --lam-relative --log-interval 5 --prompt= "
        "--budget 8").split()
RUNS = {"fix": "--alloc fix --max-steps 20 --warmup-steps 2 --eval-interval 10".split(),
        "l2-dof": "--alloc dof --loss l2 --max-steps 10 --warmup-steps 1 --eval-interval 5".split()}


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--before", required=True)
    p.add_argument("--after", required=True)
    p.add_argument("--out", default="identity.json")
    a = p.parse_args()
    env, res, work = {**os.environ, "OMP_NUM_THREADS": "1"}, {}, Path(tempfile.mkdtemp())
    for name, flags in RUNS.items():
        for tag in ("before", "after"):
            r = subprocess.run([sys.executable, "distill.py", *SMOL, *flags, "--out-dir", str(work / tag / name)],
                               cwd=Path(getattr(a, tag)).resolve(), env=env, capture_output=True, text=True)
            if r.returncode:
                raise SystemExit(f"{tag} {name} failed: {r.stderr[-1500:]}")
        fa, fb = (load_file(work / t / name / "features.safetensors") for t in ("before", "after"))
        (ca, ma), (cb, mb) = ([json.loads((work / t / name / f).read_text()) for f in ("config.json", "metrics.json")]
                              for t in ("before", "after"))
        res[name] = {"flags": " ".join(SMOL + flags), "tensors": len(fa), "dims": cb["dims"],
                     "bit_identical": fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa),
                     "dims_equal": ca["dims"] == cb["dims"], "validation_equal": ma["val"] == mb["val"]}
        print(name, res[name], flush=True)
    res["command"] = "python docs/results/budget/identity.py " + " ".join(sys.argv[1:])
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
