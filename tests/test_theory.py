"""The theory checks: each passes, a broken bound fails, and the AssumptionMonitor's estimates land
within stated tolerances on objectives whose constants are known."""

import json
import math
import re

import lightning.pytorch as pl
import numpy as np
import pytest
import sympy as sp
import torch
from conftest import UserRegressor, make_trainer

from gacbench import AssumptionMonitor, StalenessSimulator
from gacbench.cli import main
from gacbench.functional import eta_max
from gacbench.objectives import LogisticRegression, NoisyQuadratic
from gacbench.theory import bounds
from gacbench.theory import delayed_quadratic as dq
from gacbench.theory.checks import check_delayed_quadratic, check_sgd_bound, measure_alignment


def test_stability_threshold_matches_the_classical_formula():
    for s in (0, 1, 3, 16, 32):
        assert dq.crossing(s) == pytest.approx(dq.a_star(s), rel=1e-9)
    assert dq.symbolic_boundary_root()


def test_stability_check_passes_on_a_subset():
    r = check_delayed_quadratic(svals=range(0, 5))
    assert r.ok, r.details


def test_the_symbolic_half_tests_the_a_star_the_code_uses(monkeypatch):
    true_a = dq.a_star
    assert dq.a_star_matches_expr()
    monkeypatch.setattr(dq, "a_star", lambda s: true_a(s) * (1.0 if s == 0 else 1.2))
    assert not dq.a_star_matches_expr()
    monkeypatch.undo()
    # the sympy checks read a*(s) from a_star_expr: a wrong expression fails them
    monkeypatch.setattr(dq, "a_star_expr", lambda s: 2 * sp.sin(sp.pi / (2 * (2 * sp.sympify(s) ** 2 + 2))))
    assert not dq.symbolic_small_s()
    assert not dq.symbolic_boundary_root()


def test_a_wrong_a_star_fails_the_stability_check_instead_of_crashing(monkeypatch):
    true_a = dq.a_star
    # below the true limit from s = 2 on (equal at s = 0, 1): at 1.05 a* the recursion is still stable
    monkeypatch.setattr(dq, "a_star", lambda s: 2.0 * math.sin(math.pi / (2.0 * (2 * s * s + 1))))
    r = check_delayed_quadratic(svals=range(0, 4))
    assert not r.symbolic_ok and not r.numeric_ok and not r.ok and r.violations >= 2
    assert set(r.details["radius_without_growth"]) >= {"s2_at_1.05a*", "s4_at_1.1a*", "s8_at_1.1a*"}
    assert all(v <= 1 for v in r.details["radius_without_growth"].values())
    # above the true limit: the symbolic half fails as well as the numeric one
    monkeypatch.setattr(dq, "a_star", lambda s: true_a(s) * (1.0 if s == 0 else 1.2))
    r = check_delayed_quadratic(svals=range(0, 3))
    assert not r.symbolic_ok and not r.numeric_ok and r.violations >= 1


def test_stationary_cosine_formula_against_a_direct_simulation():
    """The Lyapunov prediction is checked against AlignmentMonitor (slow path) in `gacbench theory`;
    here against a plain numpy simulation, fast."""
    import numpy as np

    rng = np.random.default_rng(1)
    eta, d, s = 0.09, 100, 8
    hist = [np.zeros(d) for _ in range(s + 1)]
    x, prev, cs = np.zeros(d), None, []
    for t in range(6000):
        g = hist[0] + rng.standard_normal(d) * (1 / d) ** 0.5
        x = x - eta * g
        hist.pop(0)
        hist.append(x.copy())
        if prev is not None and t > 500:
            cs.append(g @ prev / np.linalg.norm(g) / np.linalg.norm(prev))
        prev = g
    assert np.mean(cs) == pytest.approx(dq.predicted_cosine(eta, np.ones(1), 1 / d, s), abs=0.01)


def test_alignment_monitor_measures_the_predicted_cosine():
    measured, predicted = measure_alignment(2)
    assert measured == pytest.approx(predicted, abs=0.03)


def test_derived_bounds_match_their_claims():
    assert bounds.check_claim(bounds.sgd_bound_claim, sp.Integer(0))
    assert bounds.check_claim(bounds.gac_bound_claim, bounds.delta)
    assert all(bounds.check_gac_geometry().values())
    # derived from the rule: another kept fraction fails them (and is not the code's rule)
    half = bounds.check_gac_geometry(lambda c, c_low, shrink: sp.Rational(1, 2))
    assert not any(half[k] for k in ("descent_shrink", "norm_shrink", "component_is_c_low", "cosine_is_c_low",
                                      "removed_fraction", "rule_is_the_code"))


def test_a_broken_bound_fails_its_check():
    halved = lambda: bounds.sgd_bound_claim() / 2  # noqa: E731
    assert not bounds.check_claim(halved, sp.Integer(0))
    result = check_sgd_bound(claim=halved, seeds=(0,), steps=100)
    assert not result.symbolic_ok and not result.ok
    no_staleness = lambda: bounds.sgd_bound_claim().subs(bounds.s, 0)  # noqa: E731
    assert not bounds.check_claim(no_staleness, sp.Integer(0))


def test_the_numeric_half_rejects_a_bound_too_small_and_a_run_that_is_not_finite():
    # the runs sit at 0.38 of the bound or less, so a quarter of it is exceeded; a bound dropping the staleness
    # term is not (theory/README.md: the numeric runs test that the bound holds, the sympy check its constants)
    quarter = check_sgd_bound(claim=lambda: bounds.sgd_bound_claim() / 4, seeds=(0,), steps=300)
    assert not quarter.numeric_ok and quarter.max_ratio > 1 and quarter.violations >= 1
    not_finite = check_sgd_bound(claim=lambda: bounds.sgd_bound_claim() * sp.nan, seeds=(0,), steps=50)
    assert not not_finite.numeric_ok and not_finite.violations == 4 and not_finite.max_ratio == float("inf")


def test_bound_holds_on_measured_runs():
    result = check_sgd_bound(seeds=(0,), steps=150)
    assert result.ok and 0 < result.max_ratio <= 1


def test_eta_max_solves_the_step_size_condition():
    assert eta_max(2.0, 0, 0.5) == 0.25  # s = 0: L eta <= 1 - delta
    for L, s, d in [(1.0, 0, 0.0), (1.0, 0, 0.3), (2.0, 8, 0.0), (0.5, 32, 0.45)]:
        e = eta_max(L, s, d)
        assert L * e + L**2 * e**2 * s**2 == pytest.approx(1 - d)
        assert L * (e * 1.01) + L**2 * (e * 1.01) ** 2 * s**2 > 1 - d  # the largest such step
    assert eta_max(float("inf"), 4) == 0.0 and eta_max(float("inf"), 0) == 0.0  # an estimate of L gone to inf
    assert bounds.check_eta_max()  # the sympy root and the number a run uses agree


@pytest.mark.parametrize("args,named", [
    ((0, 4), "L=0"), ((-1.0, 4), "L=-1.0"), ((math.nan, 4), "L=nan"), (("1", 4), "L='1'"),
    ((1.0, -1), "s=-1"), ((1.0, math.inf), "s=inf"), ((1.0, math.nan), "s=nan"), ((1.0, True), "s=True"),
    ((1.0, 4, -0.5), "delta=-0.5"), ((1.0, 4, 1.0), "delta=1.0"), ((1.0, 4, 1.5), "delta=1.5"),
    ((1.0, 4, math.nan), "delta=nan"), ((1.0, 4, math.inf), "delta=inf"),
])
def test_eta_max_refuses_arguments_outside_the_condition(args, named):
    with pytest.raises(ValueError, match=re.escape(f"eta_max: {named} must be")):
        eta_max(*args)


@pytest.mark.slow
def test_theory_command_exits_zero_with_every_check(tmp_path):
    out = tmp_path / "theory.json"
    assert main(["theory", "--json", str(out)]) == 0
    checks = json.loads(out.read_text())["checks"]
    assert len(checks) >= 4
    for c in checks:
        assert c["symbolic_ok"] and c["numeric_ok"] and c["violations"] == 0
        assert {"name", "statement", "max_ratio"} <= set(c)


def _fit(model, callbacks, steps):
    make_trainer(callbacks, max_steps=steps).fit(model)


def test_assumption_monitor_estimates_known_constants():
    model = NoisyQuadratic(dim=100, L=1.0, kappa=10.0, sigma2=10.0, steps=400, lr=0.01, seed=3)
    am = AssumptionMonitor(every=10)
    trainer = make_trainer([am, StalenessSimulator(4)], max_steps=400)
    trainer.fit(model)
    assert model.mu <= am.L_hat <= model.L  # a secant of a quadratic is a Rayleigh quotient of A
    assert am.sigma2_hat == pytest.approx(10.0, rel=0.1)
    assert am.s_max == 4
    assert trainer.logger.last("assume/ok") == 1.0  # lr 0.01 is far below eta_max


@pytest.mark.parametrize("delta,verdict", [(torch.tensor(0.1), 0.1), (0.25, 0.25), (1.0, None), (-0.1, None),
                                           ("0.1", None), (True, None)])
def test_assumption_monitor_takes_delta_as_a_number_in_the_conditions_range(delta, verdict):
    """delta is read when the monitor is built, as the other settings are (a 0-d tensor is a number): a value the
    step-size condition cannot take is refused there, not by eta_max midway through the fit."""
    if verdict is None:
        with pytest.raises(ValueError, match=r"AssumptionMonitor: delta=.* must be a number in \[0, 1\)"):
            AssumptionMonitor(delta=delta)
        return
    am = AssumptionMonitor(every=2, delta=delta)
    assert am.delta == pytest.approx(verdict) and type(am.delta) is float
    model = NoisyQuadratic(dim=20, L=1.0, kappa=10.0, sigma2=1.0, steps=8, lr=0.01, seed=0)
    trainer = make_trainer([am], max_steps=8)
    trainer.fit(model)
    assert trainer.logger.last("assume/eta_max") > 0


def test_assumption_monitor_flags_a_step_size_too_large():
    model = NoisyQuadratic(dim=20, L=1.0, kappa=10.0, sigma2=1.0, steps=60, lr=0.5, seed=0)
    trainer = make_trainer([AssumptionMonitor(every=5), StalenessSimulator(16)], max_steps=60)
    trainer.fit(model)
    assert trainer.logger.last("assume/ok") == 0.0
    assert trainer.logger.last("assume/eta_max") < 0.5


def test_assumption_monitor_on_logistic_regression_stays_below_the_data_constant():
    model = LogisticRegression(steps=200, lr=0.5, batch_size=4)
    am = AssumptionMonitor(every=5)
    _fit(model, [am], 200)
    assert 0 < am.L_hat <= model.L * (1 + 1e-6)
    assert am.s_max == 0  # nothing logs stale/lag: a synchronous run


class LagLoggingQuadratic(NoisyQuadratic):
    """A module that reports its own data staleness with self.log, as a stale-rollout module would."""

    def training_step(self, batch, batch_idx):
        self.log("stale/lag", float(min(self.global_step, 5)), on_step=True, on_epoch=False)
        return super().training_step(batch, batch_idx)


def test_assumption_monitor_reads_the_logged_lag():
    am = AssumptionMonitor(every=5)
    trainer = make_trainer([am], max_steps=20)
    trainer.fit(LagLoggingQuadratic(steps=20, lr=0.01))
    assert am.s_max == 5
    assert trainer.logger.last("assume/staleness") == 5.0


class Swapper(pl.Callback):
    swaps_parameters = True  # a third-party callback that, like StalenessSimulator, swaps in other iterates


def test_assumption_monitor_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="every"):
        AssumptionMonitor(every=0)
    with pytest.raises(TypeError, match="loss_on"):
        _fit(UserRegressor(), [AssumptionMonitor()], 2)
    with pytest.raises(ValueError, match="before StalenessSimulator"):
        _fit(NoisyQuadratic(steps=5), [StalenessSimulator(2), AssumptionMonitor()], 2)
    with pytest.raises(ValueError, match="before Swapper"):
        _fit(NoisyQuadratic(steps=5), [Swapper(), AssumptionMonitor()], 2)
    _fit(NoisyQuadratic(steps=5), [StalenessSimulator(0), AssumptionMonitor()], 2)  # s = 0 swaps nothing
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    for strategy in (FSDPStrategy(), ModelParallelStrategy()):  # each rank would estimate from its own shard
        with pytest.raises(RuntimeError, match=f"got {type(strategy).__name__}.*strategy='ddp'"):
            AssumptionMonitor().setup(SimpleNamespace(strategy=strategy, callbacks=[]), NoisyQuadratic(), "fit")


def test_assumption_monitor_leaves_training_unchanged():
    a, b = NoisyQuadratic(steps=50, seed=1), NoisyQuadratic(steps=50, seed=1)
    _fit(a, [StalenessSimulator(3)], 50)
    _fit(b, [AssumptionMonitor(every=3), StalenessSimulator(3)], 50)
    assert torch.equal(a.theta, b.theta)


def test_assumption_monitor_effective_step_is_the_learning_rate_for_sgd_and_not_for_adamw():
    def run(optimizer, sigma2=0.0, staleness=0, clip=None):
        model = NoisyQuadratic(dim=20, L=1.0, kappa=10.0, sigma2=sigma2, steps=40, lr=0.01, optimizer=optimizer,
                               seed=0)
        trainer = make_trainer([AssumptionMonitor(every=5), StalenessSimulator(staleness)], max_steps=40,
                               gradient_clip_val=clip)
        trainer.fit(model)
        return trainer.logger.values("assume/eta_eff")

    # theta_t - theta_{t-1} = -lr g_{t-1}, with g_{t-1} the gradient the step was made with: noisy (a different batch
    # at every step), delayed and clipped (after the callbacks' hook) alike
    for sigma2, staleness, clip in ((0.0, 0, None), (10.0, 0, None), (10.0, 3, None), (10.0, 3, 0.05)):
        effs = run("sgd", sigma2, staleness, clip)
        # (float32 differences of theta: a clipped step of 5e-4 beside |theta| ~ 1 holds ~ 2e-4 relative rounding)
        assert len(effs) >= 6 and effs == pytest.approx([0.01] * len(effs), rel=1e-3)
    # AdamW moves every coordinate by about lr, a step of norm ~ lr sqrt(dim), whatever ||g|| is
    assert abs(run("adamw")[-1] / 0.01 - 1) > 0.2


# delayed_quadratic.stationary_moments, the s = 0 correction -eta lam sigma2
def test_stationary_cosine_without_staleness_is_minus_half_eta_lambda():
    """s = 0: x_{t+1} = (1 - a) x_t - eta xi_t, a = eta lam, so C0 = eta^2 s2 / (a (2 - a)); g_t = lam x_t + xi_t with
    E[x_t xi_{t-1}] = -eta s2 gives E[g_t g_{t-1}] = lam^2 (1 - a) C0 - eta lam s2 = -eta lam s2 / (2 - a) and
    E[g_t^2] = lam^2 C0 + s2 = 2 s2 / (2 - a): the stationary cosine is -a / 2, whatever s2."""
    for eta, lam, s2 in ((0.09, 1.0, 1 / 200), (0.09, 0.5, 1.0), (0.5, 2.0, 3.0)):
        cross, sq = dq.stationary_moments(eta, lam, s2, 0)
        a = eta * lam
        assert cross == pytest.approx(-eta * lam * s2 / (2 - a), rel=1e-9)
        assert sq == pytest.approx(2 * s2 / (2 - a), rel=1e-9)
    assert dq.predicted_cosine(0.09, np.ones(1), 1 / 200, 0) == pytest.approx(-0.045, rel=1e-9)


# bounds.per_step_terms, GAC's removed-component term
def test_the_per_step_bound_with_gacs_delta_regroups():
    """check_per_step(delta) is result 3's per-step algebra; only `gacbench theory` (slow) ran it."""
    assert bounds.check_per_step(bounds.delta)
    assert bounds.check_per_step(sp.Integer(0))


# checks.check_delayed_quadratic, the Lightning half
def test_a_staleness_simulator_that_does_not_delay_fails_the_stability_check(monkeypatch):
    """Without a delay, lr = 1.1 a*(s) < 2 is stable on the quadratic (L = 1): the gap shrinks, where the check
    demands growth past 1e3 above a*(s) for s = 1, 4, 8; so those three are violations."""
    import gacbench.theory.checks as checks

    monkeypatch.setattr(checks, "StalenessSimulator", lambda s: StalenessSimulator(0))
    r = checks.check_delayed_quadratic(svals=range(0, 1))
    assert r.symbolic_ok and not r.numeric_ok and r.violations == 3
    assert all(r.details[f"lightning_s{s}"]["gap_ratio_at_1.1a*"] < 1.0 for s in (1, 4, 8))


# checks._growth_steps, the GROWTH_STEPS_MAX cap
def test_growth_steps_are_capped():
    """ceil(30 / log r): r = 1.001 needs 30 015 steps; r = 1 + 1e-5 would need about 3 000 015 (> 100 000): None,
    so that an a*(s) just below the true limit is a violation and not a three-million-step simulation."""
    import gacbench.theory.checks as checks

    assert checks._growth_steps(1.001) == math.ceil(30 / math.log(1.001)) == 30015
    assert checks._growth_steps(1.0 + 1e-5) is None
    assert checks._growth_steps(1.0) is None


# check_gac's per-step guarantees on random pairs
def _reflect_in_shrink_band(real):
    def fake(grads, refs, c_low, c_high):
        out, d = real(grads, refs, c_low, c_high)
        if c_low < d.cos < c_high:  # a wrong rule in the shrink band: reflect the aligned component
            g, u = grads[0], refs[0] / refs[0].norm()
            out = [g - 2 * (g @ u) * u]
        return out, d
    return fake


def test_the_gac_check_counts_a_wrong_shrink_as_a_violation(monkeypatch):
    """Reflection keeps |g~| = |g| but <g~, g> = (1 - 2 c^2)|g|^2 < (1 - 0.3^2)|g|^2 for c > 0.3 / sqrt(2) (about
    0.212): c is uniform on (-0.99, 0.99), so about 2000 x (0.3 - 0.212) / 1.98 = 89 of the samples violate."""
    import gacbench.theory.checks as checks

    monkeypatch.setattr(checks, "_bound_runs", lambda *a, **k: (0.5, 0, {"runs": []}))  # the runs are not at issue
    ok = checks.check_gac()
    assert ok.details["geometry_violations"] == 0
    monkeypatch.setattr(checks, "gac_project", _reflect_in_shrink_band(checks.gac_project))
    bad = checks.check_gac()
    assert 40 < bad.details["geometry_violations"] < 150 and not bad.numeric_ok and not bad.ok


# check_alignment's monotonicity half
def test_the_alignment_check_wants_the_prediction_to_rise_with_s(monkeypatch):
    import gacbench.theory.checks as checks

    monkeypatch.setattr(checks, "measure_alignment", lambda s: (0.5 - 0.01 * s, 0.5 - 0.01 * s))
    r = checks.check_alignment()
    assert r.numeric_ok and not r.symbolic_ok and not r.ok


# check_gac_geometry's rule_is_the_code, the projection clause
def test_rule_is_the_code_fails_a_projection_that_removes_half(monkeypatch):
    """At c >= c_high the rule removes all of the aligned component (coef 1); a numeric rule that removes half there
    is not the rule the sympy guarantees (projection: <g~, u> = 0) were derived for."""
    from gacbench.functional import alignment

    real = alignment.gac_decision

    def half_projection(c, c_low=0.05, c_high=0.3, *a, **k):
        d = real(c, c_low, c_high, *a, **k)
        return alignment.GACDecision(d.action, 0.5, d.cos) if c >= c_high else d

    assert bounds.check_gac_geometry()["rule_is_the_code"]
    monkeypatch.setattr(alignment, "gac_decision", half_projection)
    assert not bounds.check_gac_geometry()["rule_is_the_code"]


# stationary_moments' lag-1 covariance for s >= 1
def test_stationary_cosine_at_staleness_one_by_yule_walker():
    """s = 1, lam = 1: x_{t+1} = x_t - a x_{t-1} - eta xi_t is AR(2); Yule-Walker gives C1 = C0 / (1 + a) and
    C0 = eta^2 s2 (1 + a) / (a (1 - a) (2 + a)). At eta = a = 0.5, s2 = 1: C0 = 0.6, C1 = 0.4; g_t = x_{t-1} + xi_t
    has E[g_t g_{t-1}] = C1 (xi_{t-1} enters x_t, not x_{t-1}) and E[g_t^2] = C0 + s2: cosine 0.4 / 1.6 = 0.25."""
    cross, sq = dq.stationary_moments(0.5, 1.0, 1.0, 1)
    assert (cross, sq) == (pytest.approx(0.4, rel=1e-9), pytest.approx(1.6, rel=1e-9))
    assert dq.predicted_cosine(0.5, np.ones(1), 1.0, 1) == pytest.approx(0.25, rel=1e-9)


# AssumptionMonitor's assume/L is the running maximum of the secants
def test_assume_L_is_a_running_maximum():
    trainer = make_trainer([am := AssumptionMonitor(every=2)], max_steps=60)
    trainer.fit(LogisticRegression(steps=60, lr=2.0, batch_size=4))
    logged = trainer.logger.values("assume/L")
    assert len(logged) >= 10
    assert all(b >= a for a, b in zip(logged, logged[1:]))
    assert am.L_hat == max(logged)


# s_max is the running maximum of the logged lag
class _LagAtThree(NoisyQuadratic):
    def training_step(self, batch, batch_idx):
        self.log("stale/lag", 5.0 if self.global_step == 3 else 0.0, on_step=True, on_epoch=False)
        return super().training_step(batch, batch_idx)


def test_assume_staleness_keeps_the_largest_lag_seen():
    trainer = make_trainer([am := AssumptionMonitor(every=5)], max_steps=20)
    trainer.fit(_LagAtThree(steps=20, lr=0.01))
    assert am.s_max == 5 and trainer.logger.last("assume/staleness") == 5.0


# eta_max is taken with the monitor's delta
def test_assume_eta_max_uses_delta():
    """No staleness logged: s = 0 and eta_max = (1 - delta) / L_hat (stepsize.eta_max at s = 0)."""
    trainer = make_trainer([AssumptionMonitor(every=2, delta=0.25)], max_steps=8)
    trainer.fit(NoisyQuadratic(dim=20, L=1.0, kappa=10.0, sigma2=1.0, steps=8, lr=0.01, seed=0))
    L_hat = trainer.logger.last("assume/L")
    assert trainer.logger.last("assume/eta_max") == pytest.approx(0.75 / L_hat, rel=1e-9)
