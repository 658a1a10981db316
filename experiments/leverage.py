"""
Beyond the paper: PRF features drawn from each head's ridge leverage density, the density under which random-feature
theory gives M ~ N_lam log N_lam features (Bach 2017), instead of the paper's z ~ N(0, I):

    q_lam(z) ~ l(z) N(z; 0, I),   l(z) = <phi_z, (Sigma + lam I)^-1 phi_z>,   E_z~N(0,I)[l(z)] = N_lam,

with importance weights that keep the kernel estimate unbiased. A fork of distill.py, the same command line:

    python experiments/leverage.py --model smollm2-135m --data data/wikitext-smollm2 --center-keys ... --pool 16

How it forks the core: REPLACE sets distill.make_student to this file's, which builds the core's student and
then redraws each head's z and alpha from J of its calibration queries and keys (centred as the student sees
them), and distill.DistillConfig to one with --pool.
Measured on SmolLM2's heads (docs/results.md): better than Gaussian features untrained from M = 16 on, 5-7% worse
after 100 steps of training.
"""

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import checkpoint  # noqa: E402
import devices  # noqa: E402
import distill  # noqa: E402
import dof  # noqa: E402
import door  # noqa: E402
import forks  # noqa: E402


def prf_log(x, z):
    """log phi_z(x) = z.x~ - |x~|^2 / 2, x~ = x / d^(1/4): the PRF feature of direction z with alpha = 1 and
    without the 1/sqrt(M), so that E_z[phi_z(x) phi_z(y)] = K(x, y). x (n, d), z (P, d) -> (n, P)."""
    xt = x * x.size(-1) ** -0.25
    return xt @ z.mT - 0.5 * xt.square().sum(-1, keepdim=True)


def leverage_reference(x, z, lam, relative=False):
    """The plain form: the ridge leverage of each feature direction z_p (P, d) on the points x (J, d),

        l(z) = <phi_z, (Sigma + lam I)^-1 phi_z> in L2 of the points = phi_z^T (G + J lam I)^-1 phi_z,

    phi_z = (phi_z(x_1), ..., phi_z(x_J)), G = exp(x x^T / sqrt d) (relative: lam := lam tr(G / J)). Its mean
    over z ~ N(0, I) is the DoF N_lam. -> (P,) float64; overflows for large logits (see leverage_log)."""
    x, z = x.double(), z.double()
    G = (x @ x.T / math.sqrt(x.size(-1))).exp()                              # (J, J)
    c = lam * (G.trace() if relative else x.size(0))
    phi = prf_log(x, z).exp()                                                # (J, P)
    return (phi * torch.linalg.solve(G + c * torch.eye(len(G), dtype=G.dtype), phi)).sum(0)


def leverage_log(x, z, lam, relative=False):
    """log l(z) of leverage_reference without forming G or phi: with G + cI = D^1/2 C C^T D^1/2
    (dof.regularised_cholesky), l(z) = |C^-1 D^-1/2 phi_z|^2, and D^-1/2 phi_z is formed from its logs shifted by
    their largest value (one factor for all z, added back to the logs). x (J, d), z (P, d) -> (P,) float64."""
    x, z = x.double(), z.double()
    C, u, _ = dof.regularised_cholesky(x @ x.T / math.sqrt(x.size(-1)), lam, relative, x.size(0))
    b = prf_log(x, z) + u[:, None]                                           # log of D^-1/2 phi_z (J, P)
    top = b.max()
    y = torch.linalg.solve_triangular(C, (b - top).exp(), upper=False)       # C^-1 D^-1/2 phi_z e^-top
    return 2 * top + y.square().sum(0).log()


def inclusion(pi, M):
    """Probabilities w_p = min(1, c pi_p) of taking candidate p, summing to M: a candidate with c pi_p >= 1 is
    always taken, and c is scaled again over the rest until none is. pi (P,) summing to 1 -> (P,)."""
    sure = torch.zeros_like(pi, dtype=torch.bool)
    while True:
        w = torch.where(sure, 1.0, (M - sure.sum()) * pi / pi[~sure].sum())
        if not (w[~sure] >= 1).any():
            return w
        sure |= w >= 1


def leverage_features(x, M, lam, relative=False, pool=16, generator=None):
    """M PRF features of one head from its ridge leverage density q(z) ~ l(z) N(z; 0, I), on its points x (J, d):
    a pool of P = pool x M candidates z_p ~ N(0, I), M distinct ones taken by systematic sampling, candidate p with
    probability w_p = min(1, c pi_p), pi_p = l(z_p) / sum l (inclusion: sum w = M), and importance weights
    alpha_m = M / (P w_p(m)) (PRF's sqrt(alpha_m / M)). Then, for any q, k,

        E[sum_m alpha_m phi_zm(q) phi_zm(k) / M] = E[sum_p w_p phi_zp(q) phi_zp(k) / (P w_p)]
                                                 = E[sum_p phi_zp(q) phi_zp(k) / P] = K(q, k):

    unbiased, as plain Gaussian PRF. Distinct: resampling with replacement takes a likely candidate several times,
    and its copies, with equal gradients, would train as one feature. -> z (M, d), log_alpha (M,), float32."""
    P = pool * M
    z = torch.randn(P, x.size(-1), generator=generator, dtype=torch.float64)
    w = inclusion(torch.softmax(leverage_log(x, z, lam, relative), 0), M)  # (P,), each at most 1: one hit each
    u = torch.rand((), generator=generator, dtype=torch.float64) + torch.arange(M, dtype=torch.float64)
    take = torch.searchsorted(w.cumsum(0), u).clamp_max(P - 1)               # systematic sampling (M,)
    return z[take].float(), (math.log(M) - (P * w[take]).log()).float()


@torch.no_grad()
def init_leverage(core, x, lam, relative=False, pool=16, generator=None):
    """Every head's PRF directions and weights of a LinearAttention `core` from leverage_features on that head's
    points x (H, J, d)."""
    f = core.feature_map
    for h in range(core.n_head):
        f.z[h], f.log_alpha[h] = leverage_features(x[h].double(), f.M, lam, relative, pool, generator)


core_make_student = distill.make_student


def make_student(cfg, teacher, calib, prev=None):
    """The core's make_student, then (for a fresh student) every layer's features redrawn by
    init_leverage (rank 0's, for every process)."""
    student, dims, N = core_make_student(cfg, teacher, calib, prev)
    if prev is None:
        # a head's pool of candidates, their features and leverage
        what = f"--pool {cfg.pool} candidates for each of up to {max(dims):,} features a head"
        nbytes = 8 * cfg.pool * max(dims) * (teacher.config.head_dim + 3 * cfg.J)
        devices.check_free_memory(nbytes, "cpu", what, "lower --pool")
        mu = torch.stack([c.key_mean for c in student.cores()])  # (L, H, D): as the student
        x = dof.collect_qk(teacher, calib, cfg.J, cfg.seed, mu)  # (L, H, J, D)
        gen = torch.Generator().manual_seed(cfg.seed)
        for core, xl in zip(student.cores(), x.cpu()):
            init_leverage(core, xl, cfg.lam, cfg.lam_relative, cfg.pool, gen)
        devices.broadcast(None, list(checkpoint.feature_state(student).values()))
    return student, dims, N


@dataclass
class LeverageConfig(distill.DistillConfig):
    """distill.py with PRF features drawn from each head's ridge leverage density."""
    pool: int = door.opt(16, "candidate directions drawn per feature", min=1)

    def __post_init__(self):
        super().__post_init__()
        if self.init_from:
            raise door.ModelError("leverage features are PRF directions drawn afresh: drop "
                                 "--init-from, whose checkpoint sets the starting features")
        if self.feature_map != "prf":
            raise door.ModelError("leverage features are PRF directions drawn afresh: pass "
                                 f"--feature-map prf, not {self.feature_map}")


REPLACE = {(distill, "make_student"): make_student, (distill, "DistillConfig"): LeverageConfig}

if __name__ == "__main__":
    forks.fork(__file__, REPLACE)
