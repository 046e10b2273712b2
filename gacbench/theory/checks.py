"""``gacbench theory``: every result's symbolic and numeric check, as one table.

Each check returns a :class:`CheckResult`; the numeric parts run the real callbacks
(StalenessSimulator, GAC, AlignmentMonitor) on the synthetic objectives, so a regression in the
callbacks shows up here as well as in the tests.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import asdict, dataclass, field
from typing import Callable

import lightning.pytorch as pl
import numpy as np
import sympy as sp
import torch

from gacbench.callbacks import GAC, AlignmentMonitor, StalenessSimulator
from gacbench.functional import gac_project
from gacbench.jsonio import save_figure
from gacbench.objectives import NoisyQuadratic
from gacbench.theory import bounds
from gacbench.theory import delayed_quadratic as dq
from gacbench.usage import UsageError


@dataclass
class CheckResult:
    name: str
    statement: str
    symbolic_ok: bool
    numeric_ok: bool
    max_ratio: float  # largest measured / bound (or |error| / tolerance); <= 1 passes
    violations: int
    details: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.symbolic_ok and self.numeric_ok and self.violations == 0


def _quiet() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    warnings.filterwarnings("ignore", ".*does not have many workers.*")


class _GradRecorder(pl.Callback):
    """||grad f(theta_t)||^2 at the parameters the update is applied to (listed before the simulator)."""

    def __init__(self) -> None:
        self.sq: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.sq.append(float((pl_module.grad_f() ** 2).sum()))


class _Removed(pl.Callback):
    """max_t ||g_t - g~_t|| / ||g_t|| around GAC: one instance before it, one after."""

    keeps_gradients = True  # reads p.grad only

    def __init__(self) -> None:
        self.grads: list[torch.Tensor | None] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        p = pl_module.theta
        self.grads.append(None if p.grad is None else p.grad.detach().clone())


def _fit(model: pl.LightningModule, callbacks: list, steps: int) -> None:
    _quiet()
    pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, callbacks=callbacks,
               enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False).fit(model)


# -- result 1 -----------------------------------------------------------------------------------
# The simulations above a*(s) run until the spectral radius r there would grow the recursion by e^30,
# ceil(30 / log r) steps (at most about 28 000 for the true a*(s), s <= 32, at 1.05 a*). An a*(s) below the
# true limit leaves r <= 1 (nothing to grow) or so close to 1 that the growth would take more than
# GROWTH_STEPS_MAX steps; either counts as a violation.
GROWTH_STEPS_MAX = 100_000


def _growth_steps(radius: float) -> int | None:
    """Steps for a recursion of spectral radius ``radius`` to grow by e^30; None when it cannot within
    GROWTH_STEPS_MAX (radius <= 1, or too close to 1)."""
    if not radius > 1.0:
        return None
    steps = math.ceil(30 / math.log(radius))
    return steps if steps <= GROWTH_STEPS_MAX else None


def check_delayed_quadratic(svals: range = range(0, 33)) -> CheckResult:
    # a_star (the float every numeric part reads) is the a_star_expr the sympy checks test
    symbolic = (dq.symbolic_boundary_root() and dq.symbolic_small_s()
                and dq.a_star_matches_expr(sorted(set(range(0, 33)) | set(svals))))
    worst, violations, details = 0.0, 0, {}
    no_growth = {}  # s -> spectral radius at the a meant to be above the limit, where it cannot show growth
    for s in svals:
        a = dq.a_star(s)
        err = abs(dq.crossing(s) - a) / a
        below, above = dq.spectral_radius(a * (1 - 1e-3), s), dq.spectral_radius(a * (1 + 1e-3), s)
        r_up = dq.spectral_radius(a * 1.05, s)
        steps = _growth_steps(r_up)
        if steps is None:
            no_growth[f"s{s}_at_1.05a*"] = r_up
            grows = decays = False
        else:
            grows = dq.simulate(a * 1.05, s, steps) > 1e3
            decays = dq.simulate(a * 0.95, s, steps) < 1.0
        ok = err < 1e-8 and below < 1 < above and grows and decays
        violations += not ok
        worst = max(worst, err / 1e-8)
    # the same boundary through the StalenessSimulator on the noiseless quadratic (L = 1, kappa = 1)
    for s in (1, 4, 8):
        a = dq.a_star(s)
        r_up = dq.spectral_radius(a * 1.1, s)
        steps = _growth_steps(r_up)
        if steps is None:
            no_growth[f"s{s}_at_1.1a*"] = r_up
            violations += 1
            continue
        gaps = {}
        for factor in (0.9, 1.1):
            model = NoisyQuadratic(dim=4, L=1.0, kappa=1.0, sigma2=0.0, steps=steps, lr=a * factor, seed=s)
            start = model.metric()
            _fit(model, [StalenessSimulator(s)], steps)
            gaps[factor] = model.metric() / start
        ok = gaps[0.9] < 1.0 and not gaps[1.1] <= 1e3  # above a*: a gap that grew past 1e3 or to inf/nan
        details[f"lightning_s{s}"] = {"gap_ratio_at_0.9a*": gaps[0.9], "gap_ratio_at_1.1a*": gaps[1.1]}
        violations += not ok
    if no_growth:
        details["radius_without_growth"] = no_growth
    details["a_star"] = {s: dq.a_star(s) for s in (0, 1, 2, 8, 16, 32)}
    statement = "x_{t+1} = x_t - a x_{t-s} is stable iff a < 2 sin(pi/(2(2s+1))), s = 0..32"
    return CheckResult("delayed-quadratic-stability", statement, symbolic, violations == 0, worst, violations, details)


# -- result 2 -----------------------------------------------------------------------------------
# GAC's theorem needs |g - g~| <= delta |g| at every step. Below c_high the removed fraction is
# c - c_low <= c_high - c_low (shrink="component", the default these runs use), which sets the step
# size (eta = (1 - delta) / (2 L (s + 1))); the bound is then evaluated with the measured maximum
# fraction. The runs start near the optimum (noise-dominated, as on-policy RL); a run whose measured
# fraction is too large for its step size is reported as outside the theorem's assumption, not counted
# as a violation.
GAC_C_LOW, GAC_C_HIGH = 0.05, 0.5
GAC_DELTA = GAC_C_HIGH - GAC_C_LOW


def _bound_runs(claim: Callable[[dict], float], svals, seeds, steps, gac: bool) -> tuple[float, int, dict]:
    worst, violations, rows = 0.0, 0, []
    for s in svals:
        for seed in seeds:
            delta = GAC_DELTA if gac else 0.0
            eta = (1 - delta) / (2 * 1.0 * (s + 1))  # satisfies L eta + L^2 eta^2 s^2 <= 1 - delta
            model = NoisyQuadratic(dim=100, L=1.0, kappa=10.0, sigma2=10.0, steps=steps, lr=eta, seed=seed,
                                   init_scale=0.5 if gac else 3.0)
            Delta = model.metric()
            rec = _GradRecorder()
            callbacks: list = [rec, StalenessSimulator(s)]
            before, after = _Removed(), _Removed()
            if gac:
                callbacks += [before, GAC(c_low=GAC_C_LOW, c_high=GAC_C_HIGH, warmup=0), after]
            _fit(model, callbacks, steps)
            measured = float(np.mean(rec.sq))
            row = {"s": s, "seed": seed, "eta": eta, "measured": measured}
            if gac:
                removed = [float((b - a).norm() / b.norm()) for b, a in zip(before.grads, after.grads)
                           if b is not None and a is not None]
                # The assumption |g - g~| <= delta |g| holds with delta = the measured maximum; the
                # theorem then applies if the step size still meets L eta + L^2 eta^2 s^2 <= 1 - delta.
                delta = row["delta_hat"] = max(removed) if removed else 0.0
                if eta + eta**2 * s**2 > 1 - delta:
                    row["applicable"] = False
                    rows.append(row)
                    continue
            bound = claim({"L": 1.0, "eta": eta, "s": s, "T": steps, "Delta": Delta, "sigma2": 10.0, "delta": delta})
            row.update(bound=bound, ratio=measured / bound)
            held = math.isfinite(row["ratio"]) and row["ratio"] <= 1.0  # a run gone to nan or inf is a violation
            worst = max(worst, row["ratio"] if math.isfinite(row["ratio"]) else math.inf)
            violations += not held
            rows.append(row)
    return worst, violations, {"runs": rows}


def _evaluate(expr_fn: Callable[[], sp.Expr]) -> Callable[[dict], float]:
    expr = expr_fn()
    syms = {"L": bounds.L, "eta": bounds.eta, "s": bounds.s, "T": bounds.T, "Delta": bounds.Delta,
            "sigma2": bounds.sigma2, "delta": bounds.delta}
    fn = sp.lambdify([syms[k] for k in syms], expr, "math")
    return lambda v: float(fn(*[v[k] for k in syms]))


def check_sgd_bound(
    claim: Callable[[], sp.Expr] = bounds.sgd_bound_claim, seeds=(0, 1, 2), steps: int = 300
) -> CheckResult:
    symbolic = all([bounds.check_polarization(), bounds.check_cauchy_schwarz(), bounds.check_per_step(sp.Integer(0)),
                    bounds.check_staleness_sum(), bounds.check_claim(claim, sp.Integer(0)),
                    bounds.check_step_size_condition(), bounds.check_eta_max(), bounds.check_rate()])
    worst, violations, details = _bound_runs(_evaluate(claim), (0, 8, 16, 32), seeds, steps, gac=False)
    statement = ("min_t E|grad f|^2 <= 2 Delta/(eta T) + (L eta + L^2 eta^2 s^2) sigma^2 "
                 "if L eta + L^2 eta^2 s^2 <= 1")
    return CheckResult("delayed-sgd-bound", statement, symbolic, violations == 0, worst, violations, details)


# -- result 3 -----------------------------------------------------------------------------------
def check_gac(
    claim: Callable[[], sp.Expr] = bounds.gac_bound_claim, seeds=(0, 1, 2), steps: int = 300, samples: int = 2000
) -> CheckResult:
    geometry = bounds.check_gac_geometry()
    reduces_to_sgd = sp.simplify(bounds.gac_bound_claim().subs(bounds.delta, 0) - bounds.sgd_bound_claim()) == 0
    symbolic = (all(geometry.values()) and bounds.check_per_step(bounds.delta)
                and bounds.check_claim(claim, bounds.delta) and reduces_to_sgd)
    # per-step guarantees on random pairs (float64), every regime
    rng = np.random.default_rng(0)
    geo_violations = 0
    for _ in range(samples):
        r = torch.tensor(rng.standard_normal(16))
        c = float(rng.uniform(-0.99, 0.99))
        u = r / r.norm()
        w = torch.tensor(rng.standard_normal(16))
        w = w - (w @ u) * u
        g = 2.0 * (c * u + math.sqrt(1 - c * c) * w / w.norm())
        out, d = gac_project([g], [r], 0.05, 0.3)
        gt = out[0]
        ok = float(gt.norm()) <= float(g.norm()) * (1 + 1e-6)
        if d.cos < 0.3:
            ok &= float(gt @ g) >= (1 - 0.3**2) * float(g @ g) * (1 - 1e-6)
        else:
            ok &= abs(float(gt @ r)) <= 1e-5 * float(g.norm() * r.norm())
        geo_violations += not ok
    worst, violations, details = _bound_runs(_evaluate(claim), (0, 8, 16, 32), seeds, steps, gac=True)
    details["geometry"] = geometry
    details["geometry_violations"] = geo_violations
    applicable = [r for r in details["runs"] if r.get("applicable", True)]
    details["applicable_runs"] = f"{len(applicable)}/{len(details['runs'])}"
    numeric = violations == 0 and geo_violations == 0 and 2 * len(applicable) >= len(details["runs"])
    return CheckResult("gac-guarantees-and-bound",
                       "<g~,g> >= (1-c_high^2)|g|^2 below c_high, |g~| <= |g|; with |g-g~| <= delta|g|: "
                       "G <= [2 Delta/(eta T) + (delta + L eta + L^2 eta^2 s^2) sigma^2]/(1-delta)",
                       symbolic, numeric, worst, violations + geo_violations, details)


# -- result 4 -----------------------------------------------------------------------------------
def measure_alignment(
    s: int, eta: float = 0.09, dim: int = 200, sigma2: float = 1.0, seed: int = 0
) -> tuple[float, float]:
    """Mean c_t measured by AlignmentMonitor after a burn-in, and the stationary prediction."""
    r = dq.spectral_radius(eta, s)
    burn = int(min(2500, max(200, 5 / (1 - r))))
    measure = 2500
    model = NoisyQuadratic(dim=dim, L=1.0, kappa=1.0, sigma2=sigma2, steps=burn + measure, lr=eta, seed=seed,
                           init_scale=0.0)
    mon = AlignmentMonitor(warmup=burn)
    callbacks = ([StalenessSimulator(s)] if s else []) + [mon]
    _fit(model, callbacks, burn + measure)
    measured = float(np.mean(mon.trace.values[burn:]))
    return measured, dq.predicted_cosine(eta, np.ones(1), sigma2 / dim, s)


def check_alignment(svals=(0, 2, 4, 8, 16), tol: float = 0.03) -> CheckResult:
    # symbolic: the boundary mode rotates by pi/(2s+1) per step, so its consecutive cosine is cos(pi/(2s+1)) -> 1
    sv = sp.symbols("s", positive=True)
    symbolic = dq.symbolic_boundary_root() and sp.limit(sp.cos(sp.pi / (2 * sv + 1)), sv, sp.oo) == 1
    rows, worst, violations = [], 0.0, 0
    for s in svals:
        measured, predicted = measure_alignment(s)
        err = abs(measured - predicted)
        rows.append({"s": s, "measured": measured, "predicted": predicted})
        worst = max(worst, err / tol if math.isfinite(err) else math.inf)
        violations += not (math.isfinite(err) and err <= tol)  # a measurement gone to nan is a violation
    increasing = all(b["predicted"] > a["predicted"] for a, b in zip(rows, rows[1:]))
    statement = ("stationary E<g_t,g_{t-1}>/E|g_t|^2 of delayed noisy GD (Lyapunov solution) "
                 "matches AlignmentMonitor's c_t")
    return CheckResult("staleness-aligns-gradients", statement, symbolic and increasing, violations == 0, worst,
                       violations, {"runs": rows, "tol": tol})


CHECKS: dict[str, Callable[[], CheckResult]] = {
    "delayed-quadratic-stability": check_delayed_quadratic,
    "delayed-sgd-bound": check_sgd_bound,
    "gac-guarantees-and-bound": check_gac,
    "staleness-aligns-gradients": check_alignment,
}


def run_checks(names: list[str] | None = None) -> list[CheckResult]:
    unknown = [n for n in names or [] if n not in CHECKS]
    if unknown:
        raise UsageError(f"--checks: unknown check(s) {', '.join(unknown)}; the checks are: {', '.join(CHECKS)}")
    return [CHECKS[n]() for n in (names or list(CHECKS))]


ALIGN_ETA, ALIGN_DIM, ALIGN_SIGMA2 = 0.09, 200, 1.0


def alignment_figure(path: str, rows: list[dict] | None = None) -> None:
    """theory/fig_alignment.png: predicted stationary c_t against s, with AlignmentMonitor's measurements
    (``rows`` from the alignment check, or measured here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eta, per_dim = ALIGN_ETA, ALIGN_SIGMA2 / ALIGN_DIM
    s_pred = [s for s in range(0, 33) if eta < dq.a_star(s)]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    predicted = [dq.predicted_cosine(eta, np.ones(1), per_dim, s) for s in s_pred]
    axes[0].plot(s_pred, predicted, label="stationary prediction")
    rows = rows or [{"s": s, "measured": measure_alignment(s)[0]} for s in (0, 2, 4, 8, 16)]
    axes[0].plot([r["s"] for r in rows], [r["measured"] for r in rows], "o", label="AlignmentMonitor (mean c_t)")
    axes[0].set(xlabel="staleness s", ylabel="consecutive-gradient cosine",
                title=f"noisy quadratic, eta*lambda = {eta}")
    axes[0].legend(fontsize=8)
    ss = np.arange(0, 33)
    for rho in (0.5, 0.9, 0.98):
        near_limit = [dq.predicted_cosine(rho * dq.a_star(s), np.ones(1), per_dim, s) for s in ss]
        axes[1].plot(ss, near_limit, label=f"eta*lambda = {rho} a*(s)")
    axes[1].plot(ss, np.cos(np.pi / (2 * ss + 1)), "k--", label="boundary mode cos(pi/(2s+1))")
    axes[1].set(xlabel="staleness s", title="closer to the stability limit, more aligned")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    import json
    import time

    from rich.console import Console
    from rich.table import Table

    t0 = time.perf_counter()
    names = None if args.checks is None else args.checks.split(",")
    if names is not None and (not all(n.strip() for n in names) or len(set(names)) < len(names)):
        raise UsageError(f"--checks {args.checks!r}: give each check once, comma-separated, without empty items "
                         f"(leave --checks out for all of them: {', '.join(CHECKS)})")
    results = run_checks(names)
    table = Table(title=f"gacbench theory ({time.perf_counter() - t0:.0f} s)")
    for col in ("check", "statement", "symbolic", "numeric", "max ratio", "violations"):
        table.add_column(col, overflow="fold")
    for r in results:
        table.add_row(r.name, r.statement, "ok" if r.symbolic_ok else "FAIL", "ok" if r.numeric_ok else "FAIL",
                      f"{r.max_ratio:.3g}", str(r.violations))
    Console(width=160).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"checks": [asdict(r) for r in results]}, f, indent=2, default=str)
        print(f"wrote {args.json}")
    if args.figure:
        done = next((r for r in results if r.name == "staleness-aligns-gradients"), None)
        alignment_figure(args.figure, done.details["runs"] if done else None)
        print(f"wrote {args.figure}")
    return 0 if all(r.ok for r in results) else 1
