"""
Beyond the paper: which allocation of a fixed feature budget helps, and how much could any allocation gain?

    python bench/allocation.py --rule dof-raw <distill.py flags>      # distil with another rule's dims
    python bench/allocation.py --rule measured --curves docs/results/curves <distill.py flags>
    python bench/allocation.py --predict docs/results/allocation/predictors-s0.json <distill.py flags>

Under teacher forcing the layers are independent problems, so one Fix run at M trains every layer at M: Fix runs
at M = 4 ... 128 give each layer's held-out error curve KL_l(M) (docs/results/curves/). The measured allocation
minimises sum_l KL_l(M_l) subject to sum_l M_l = C L and M_l >= 1, greedily, one feature at a time to the layer
whose interpolated curve (piecewise linear in log M, log KL) falls most: a yardstick, as it needs the training
runs. The rules (--rule, or distill.py's --alloc for the core's):
  dof-raw    the DoF of the uncentred kernel K(q, k), though with --center-keys the student learns the centred one
  measured   the measured allocation of --curves at this budget
  <name>     dims in proportion to one of the cheap per-layer predictors below (M_l = C P_l / mean P)
--predict computes the predictors on the run's calibration windows and writes them, instead of training.
How it forks the core: REPLACE sets distill.DistillConfig to one with --rule (recorded as the checkpoint's alloc)
and distill.make_student to this file's, which chooses the dims by the rule and hands them to the core's
make_student as --dims. Its checkpoints are the core's students (a dimension per layer), so it records no fork:
distill.py --init-from and evaluate.py read them; distill.py does not resume them (it lacks --rule).
"""

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import distill  # noqa: E402
import dof  # noqa: E402
import door  # noqa: E402
import files  # noqa: E402
import forks  # noqa: E402
import tasks  # noqa: E402
from committed import check_committed  # noqa: E402

# ----------------------------------------------------------------------------------------------------------------
# Error curves and the measured allocation

def load_curves(curves, prefix="fix"):
    """docs/results/curves/<prefix>-m<M>-s*.json -> (Ms (n,), KL (n, L)): each layer's final held-out KL at M."""
    todo = "pass the --curves of docs/experiments.py --run curves"
    if not Path(curves).is_dir():
        raise door.ModelError(f"--curves {curves} is not a folder; {todo} (docs/results/curves, from the repository root)")
    runs = [files.read_json(p, todo) for p in sorted(Path(curves).glob(f"{prefix}-m*.json"))]
    try:
        runs = sorted(((r["args"]["budget"], r["val"][-1]["attn_kl"]) for r in runs), key=lambda r: r[0])
        Ms, KL = np.array([m for m, _ in runs], float), np.array([kl for _, kl in runs], float)   # (n,), (n, L)
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise door.ModelError(f"a curve run in {curves} lacks its budget or held-out KL ({type(e).__name__}); {todo}") \
            from None
    if len(runs) < 2 or len(set(Ms)) < len(Ms) or Ms[0] < 1 or not np.isfinite(Ms[-1]) or KL.ndim != 2 or not (
            np.isfinite(KL) & (KL > 0)).all():
        raise door.ModelError(f"{curves} holds fewer than two {prefix}-m*.json curve runs of distinct finite budgets of at "
                         f"least 1, or a KL that is not a list of finite positive numbers; {todo}")
    return Ms, KL


def interpolate(Ms, kl, M):
    """KL at feature counts M (any, >= 1) from the measured points: linear in (log M, log KL), the end segments
    extended beyond the grid."""
    x, y, t = np.log(Ms), np.log(kl), np.log(np.asarray(M, float))
    i = np.clip(np.searchsorted(x, t) - 1, 0, len(x) - 2)
    return np.exp(y[i] + (y[i + 1] - y[i]) * (t - x[i]) / (x[i + 1] - x[i]))


def measured_dims(Ms, KL, budget):
    """argmin sum_l KL_l(M_l) over whole M_l >= 1 with sum M_l = budget x L, greedily: each next feature goes to
    the layer whose interpolated KL falls most by it (optimal when every curve is convex in M)."""
    L = KL.shape[1]
    dims = np.ones(L, int)
    gain = lambda l: interpolate(Ms, KL[:, l], dims[l]) - interpolate(Ms, KL[:, l], dims[l] + 1)
    gains = np.array([gain(l) for l in range(L)])
    for _ in range(budget * L - L):
        l = int(gains.argmax())
        dims[l] += 1
        gains[l] = gain(l)
    return dims.tolist()


def expected_kl(Ms, KL, dims):
    """sum_l KL_l(M_l) / L from the interpolated curves: the mean held-out KL the curves predict for these dims."""
    return float(np.mean([interpolate(Ms, KL[:, l], m) for l, m in enumerate(dims)]))


# ----------------------------------------------------------------------------------------------------------------
# Cheap per-layer predictors, from the teacher's queries and keys on the calibration windows

@torch.no_grad()
def predictors(cfg, teacher, calib):
    """name -> (L,) per-layer values: the DoF of the centred and of the uncentred kernel (max and mean over heads),
    the teacher's attention entropy, the mean |q~| times the mean |k~ - mu|, the mean of |q~ + k~|^2 under the
    teacher's attention (the log of PRF's variance factor for the pairs that matter), and the KL of untrained Gaussian
    PRF features at M = budget on the same windows (one forward pass, no training)."""
    mu = dof.key_means(teacher, calib)                                              # (L, H, D)
    out = {}
    for name, m in (("dof", mu), ("dof-raw", None)):
        N = dof.degrees_of_freedom(dof.collect_qk(teacher, calib, cfg.J, cfg.seed, m), cfg.lam, cfg.lam_relative)
        out[f"{name}-max"], out[f"{name}-mean"] = N.amax(-1).tolist(), N.mean(-1).tolist()
    torch.manual_seed(cfg.seed)
    fresh = teacher.linearize([cfg.budget] * teacher.config.n_layer, "prf", cfg.chunk_size)
    acc = {k: np.zeros(teacher.config.n_layer) for k in ("entropy", "qk-norm", "prf-var", "untrained-kl")}
    for idx in calib:
        for l, ((q, k), core) in enumerate(zip(dof.teacher_qk(teacher, idx), fresh.cores())):
            core.key_mean.copy_(mu[l])
            qi, ki = core.inputs(q, k)                                             # fp32, keys centred
            logp, _ = distill.attention_rows(qi, ki, *core.features(qi, ki))
            p, d4 = logp.exp(), q.size(-1) ** 0.25
            acc["entropy"][l] += -(p * logp.clamp_min(-1e30)).sum(-1).mean().item()
            acc["qk-norm"][l] += ((qi.norm(dim=-1) / d4).mean() * (ki.norm(dim=-1) / d4).mean()).item()
            s2 = (qi.square().sum(-1)[..., None] + ki.square().sum(-1)[..., None, :] + 2 * qi @ ki.mT) / d4 ** 2
            acc["prf-var"][l] += (p * s2).sum(-1).mean().item()
            acc["untrained-kl"][l] += distill.softmax_loss(qi, ki, *core.features(qi, ki)).mean().item()
    return {**out, **{k: (v / len(calib)).tolist() for k, v in acc.items()}}


def spearman(a, b):
    """Spearman's rank correlation, tied values sharing their mean rank."""
    def rank(x):
        x = np.asarray(x, float)
        r = np.argsort(np.argsort(x)).astype(float)
        return np.array([r[x == v].mean() for v in x])
    return float(np.corrcoef(rank(a), rank(b))[0, 1])


def slopes(Ms, KL):
    """Each layer's slope of log KL against log M over the grid (least squares): the marginal gain of features."""
    x = np.log(Ms) - np.log(Ms).mean()
    return (x[:, None] * (np.log(KL) - np.log(KL).mean(0))).sum(0) / (x ** 2).sum()


# ----------------------------------------------------------------------------------------------------------------
# The fork of distill.py

# what the predictors depend on: a committed file of them is replaced only by a run of these settings
PREDICTOR_SETTINGS = ("model", "data", "val_fraction", "block_size", "calib_batches", "J", "seed", "lam",
                      "lam_relative", "budget", "chunk_size")


@dataclass
class AllocationConfig(distill.DistillConfig):
    """distill.py with the dims of an allocation rule beyond the core's (bench/allocation.py)."""
    rule: str = door.opt("dof-raw", "dof-raw (DoF of the uncentred kernel), measured (from --curves), or a predictor's "
                    "name (dims in proportion to it, see --predict)")
    curves: str = door.opt("docs/results/curves", "directory of the Fix curve runs (for --rule measured)")
    curve_prefix: str = door.opt("fix", "which curve runs: fix (240 steps) or probe (60 steps)")
    predict: str = door.opt("", "compute the per-layer predictors on the calibration windows, write them to this JSON "
                       "file and stop (no training; --out-dir stays empty)")

    RESUMED = distill.DistillConfig.RESUMED + ("rule",)

    def __post_init__(self):
        super().__post_init__()
        if self.dims or self.alloc != "dof":                       # both had been overwritten without a word
            raise door.ModelError("--rule chooses the dims here; drop --dims and --alloc, or run distill.py with them")
        # config.json records the rule as the checkpoint's alloc
        self.alloc = self.rule
        if self.predict and (self.resume or self.init_from):
            raise door.ModelError("--predict computes the predictors of a fresh run; drop --resume and --init-from")
        if self.predict:
            tasks.check_output(self.predict, self.model, None, [self.data], flag="--predict")
            ours = {k: getattr(self, k) for k in PREDICTOR_SETTINGS}    # other settings had replaced them
            check_committed(self.predict, ours, "settings", "--predict", what="predictors", keys=PREDICTOR_SETTINGS)


def rule_dims(cfg, teacher, calib):
    """-> (dims, the per-layer values they are in proportion to, or None) for --rule."""
    if cfg.rule == "measured":
        Ms, KL = load_curves(cfg.curves, cfg.curve_prefix)
        if KL.shape[1] != teacher.config.n_layer:
            raise door.ModelError(f"the curves in {cfg.curves} are of a model of {KL.shape[1]} layers, and {cfg.model} has "
                             f"{teacher.config.n_layer}; pass --curves of runs on this model")
        return measured_dims(Ms, KL, cfg.budget), None
    values = predictors(cfg, teacher, calib) if cfg.rule != "dof-raw" else {"dof-raw-max": dof.choose_dims(
        teacher, calib, cfg.updated(alloc="dof"))[1]}
    name = "dof-raw-max" if cfg.rule == "dof-raw" else cfg.rule
    if name not in values:
        raise door.ModelError(f"--rule {cfg.rule} is none of dof-raw, measured, {', '.join(sorted(values))}")
    return dof.allocate(values[name], cfg.budget), values[name]


core_make_student = distill.make_student


def make_student(cfg, teacher, calib, prev=None):
    """The core's make_student with --dims from the rule (a fresh run); --predict writes the predictors and stops."""
    if prev:
        return core_make_student(cfg, teacher, calib, prev)
    if cfg.predict:
        res = {"settings": {k: v for k, v in asdict(cfg).items() if k not in ("predict", "out_dir")},   # not written
               "predictors": predictors(cfg, teacher, calib)}
        files.write_text_atomic(cfg.predict, json.dumps(res, indent=1) + "\n")
        print(f"wrote {cfg.predict}")
        raise SystemExit(0)
    dims, values = rule_dims(cfg, teacher, calib)
    student, dims, _ = core_make_student(cfg.updated(dims=",".join(map(str, dims))), teacher, calib)
    return student, dims, values


REPLACE = {(distill, "DistillConfig"): AllocationConfig, (distill, "make_student"): make_student}


def main(argv=None):
    """distill.py's command line with this file's names set; --predict writes the predictors alone: --out-dir is
    neither checked nor locked (distill.distil, not distill.main)."""
    with forks.replaced(REPLACE):
        cfg = door.parse_config(distill.DistillConfig, argv)
        if cfg.predict:
            distill.distil(cfg)
        else:
            distill.main(cfg)


if __name__ == "__main__":
    door.run_main(main)
