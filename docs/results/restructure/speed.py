"""
Speed of the minimal core against the code before it, side by side in one run (alternating A B A B ...), one
torch thread: a distill.py step (the SmolLM2 claim grid's Fix flags, ms/step from the log), the chunked scan
(GPT-2 shape, T = 1024 and 4096) and greedy decoding (SmolLM2's shape, linear student, ms per token).

    python docs/results/restructure/speed.py --before ../before --after . --out docs/results/restructure/speed.json

--before and --after are checkouts of the two versions (each with data/wikitext-smollm2 prepared).
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

FLAGS = ("--model smollm2-135m --data data/wikitext-smollm2 --loss softmax --center-keys --block-size 256 "
         "--batch-size 1 --eval-iters 1 --J 1024 --lam 1e-3 --lam-relative --budget 32 --alloc fix --max-steps 25 "
         "--warmup-steps 2 --eval-interval 1000 --log-interval 5 --prompt=").split()

KERNELS = r"""
import statistics, sys, time, torch
sys.path.insert(0, ".")
import model as M
torch.manual_seed(0)
out = {}
for T in (1024, 4096):
    pq, pk, v = torch.rand(1, 12, T, 64), torch.rand(1, 12, T, 64), torch.randn(1, 12, T, 64)
    ts = []
    for _ in range(30):
        t0 = time.perf_counter(); M.causal_linear_attention(pq, pk, v, 64); ts.append(time.perf_counter() - t0)
    out[f"scan_T{T}_ms"] = 1e3 * min(ts)
cfg = M.GPTConfig(family="llama", vocab_size=49152, n_layer=30, n_head=9, n_kv_head=3, n_embd=576, head_dim=64,
                  block_size=2048, rotary_dim=64, rope_base=100000.0, tie_embeddings=True, mlp_hidden=1536, bias=False)
model = M.GPT(cfg).eval()
student = model.linearize([32] * 30)
student = model if student is None else student          # the older linearize swapped the cores in place
with torch.no_grad():
    idx = torch.randint(0, 49152, (1, 64))
    kw = {"top_k": 1} if "top_k" in M.GPT.generate.__code__.co_varnames else {}
    student.generate(idx, 4, **kw)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter(); student.generate(idx, 16, **kw); ts.append((time.perf_counter() - t0) / 16)
    out["decode_ms_per_token"] = 1e3 * min(ts)
print("RESULT", __import__("json").dumps(out))
"""


def run(tree, args, env):
    r = subprocess.run([sys.executable, *args], cwd=tree, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode:
        raise SystemExit(f"{tree}: {' '.join(args[:2])} failed: {r.stderr[-1500:]}")
    return r.stdout


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--before", required=True)
    p.add_argument("--after", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="speed.json")
    p.add_argument("--kernels-only", action="store_true", help="skip the distill.py step")
    a = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    res = {"before": [], "after": []}
    for r in range(a.rounds):
        for name in ("before", "after"):
            tree = Path(getattr(a, name)).resolve()
            out, step = Path(f"/tmp/speed-{name}-{r}"), {}
            if not a.kernels_only:
                shutil.rmtree(out, ignore_errors=True)
                log = run(tree, ["distill.py", *FLAGS, "--out-dir", str(out)], env)
                step = {"step_ms": statistics.median([float(m) for m in re.findall(r"\| ([\d.]+) ms/step", log)][1:])}
            kernels = json.loads(run(tree, ["-c", KERNELS], env).split("RESULT", 1)[1])
            res[name].append({**step, **kernels})
            print(name, r, res[name][-1], flush=True)
    keys = res["after"][0].keys()
    res["ratio_after_over_before"] = {k: statistics.median(x[k] for x in res["after"]) /
                                      statistics.median(x[k] for x in res["before"]) for k in keys}
    res["command"] = "python docs/results/restructure/speed.py " + " ".join(sys.argv[1:])
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res["ratio_after_over_before"], indent=1))


if __name__ == "__main__":
    main()
