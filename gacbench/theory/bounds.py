"""Results 2 and 3: the bounded-staleness SGD bound (non-convex, L-smooth, bounded variance) and the
GAC guarantees, as sympy statements whose algebra is re-derived from the proof's steps.

Notation: Delta = f(theta_0) - f*, T steps, step eta, staleness s_t <= s, noise variance sigma^2,
G = (1/T) sum_t E||grad f(theta_t)||^2 (which bounds min_t E||grad f(theta_t)||^2).

Theorem (result 2, delayed SGD). If L eta + L^2 eta^2 s^2 <= 1, then
    G <= 2 Delta / (eta T) + (L eta + L^2 eta^2 s^2) sigma^2.
Theorem (result 3, GAC). If every applied gradient satisfies ||g_t - g~_t|| <= delta ||g_t|| with
delta < 1 (GAC with shrink="component": delta = c_high - c_low while no step reaches c_high; with
shrink="cosine" the removed fraction is larger, up to c_high - c_low sqrt((1 - c_high^2) / (1 - c_low^2)); in
general delta = max_t (1 - k_t) c_t, with k_t the kept fraction of step t's aligned component (gac_kept_fraction;
k_t = 1 when keeping, 0 when projecting))
and ||g~_t|| <= ||g_t|| (GAC only removes a component: the proof's step 4 keeps its form), and
L eta + L^2 eta^2 s^2 <= 1 - delta, then
    G <= [2 Delta / (eta T) + (delta + L eta + L^2 eta^2 s^2) sigma^2] / (1 - delta).
"""

from __future__ import annotations

import math
from typing import Callable

import sympy as sp

from gacbench.functional.stepsize import eta_max as eta_max  # the numeric step-size condition, beside its claim

L, eta, s, T, Delta, sigma2, delta = sp.symbols("L eta s T Delta sigma2 delta", positive=True)
SG, SD = sp.symbols("S_G S_D", nonnegative=True)  # sum_t E||grad f(theta_t)||^2, sum_t E||grad f(theta_{t-tau_t})||^2


def sgd_bound_claim() -> sp.Expr:
    """The claimed right-hand side of result 2."""
    return 2 * Delta / (eta * T) + (L * eta + L**2 * eta**2 * s**2) * sigma2


def gac_bound_claim() -> sp.Expr:
    """The claimed right-hand side of result 3."""
    return (2 * Delta / (eta * T) + (delta + L * eta + L**2 * eta**2 * s**2) * sigma2) / (1 - delta)


def telescoped(d: sp.Expr = sp.Integer(0)) -> sp.Expr:
    """The proof's summed inequality, written as (right side) - (left side) >= 0 in S_G:
    (eta/2)(1-d) S_G <= Delta - (eta/2)(1 - d - L eta - L^2 eta^2 s^2) S_D
                        + T (eta/2)(d + L eta + L^2 eta^2 s^2) sigma2.
    d = 0 is plain delayed SGD; d = delta adds GAC's removed component."""
    return (Delta - eta / 2 * (1 - d - L * eta - L**2 * eta**2 * s**2) * SD
            + T * eta / 2 * (d + L * eta + L**2 * eta**2 * s**2) * sigma2) - eta / 2 * (1 - d) * SG


def per_step_terms(d: sp.Expr) -> tuple[sp.Expr, tuple[sp.Symbol, sp.Symbol, sp.Symbol]]:
    """One step of the proof, with G_t, D_t, E_t (staleness error) symbols: the bound on E f_{t+1} - E f_t.
    From L-smoothness, <a,b> = (|a|^2 + |b|^2 - |a-b|^2)/2, E|g|^2 = D + sigma2, and
    |grad_t| |e_t| <= d/2 (|grad_t|^2 + |g_t|^2)."""
    G, D, E = sp.symbols("G_t D_t E_t", nonnegative=True)
    inner = (G + D - E) / 2  # E<grad_t, grad at the stale point>
    return -eta * inner + eta * d / 2 * (G + D + sigma2) + L * eta**2 / 2 * (D + sigma2), (G, D, E)


def check_per_step(d: sp.Expr) -> bool:
    """The per-step bound regroups into
    -(eta/2)(1-d) G - (eta/2)(1-d-L eta) D + (eta/2) E + (eta/2)(d + L eta) sigma2."""
    expr, (G, D, E) = per_step_terms(d)
    target = -eta / 2 * (1 - d) * G - eta / 2 * (1 - d - L * eta) * D + eta / 2 * E + eta / 2 * (d + L * eta) * sigma2
    return sp.simplify(expr - target) == 0


def check_staleness_sum() -> bool:
    """Summing E_t <= L^2 eta^2 s sum_{j in window(t)} (D_j + sigma2) over t counts each j at most s times:
    sum_t E_t <= L^2 eta^2 s^2 (S_D + T sigma2); adding it to the summed per-step terms gives ``telescoped``.
    Checked by adding the pieces symbolically."""
    d = sp.symbols("d", nonnegative=True)
    summed = (-eta / 2 * (1 - d) * SG - eta / 2 * (1 - d - L * eta) * SD
              + eta / 2 * L**2 * eta**2 * s**2 * (SD + T * sigma2) + T * eta / 2 * (d + L * eta) * sigma2)
    return sp.simplify((Delta + summed) - telescoped(d)) == 0


def check_cauchy_schwarz(max_terms: int = 6) -> bool:
    """|sum_{j<=k} v_j|^2 <= k sum_j |v_j|^2: k sum v^2 - (sum v)^2 = 1/2 sum_{i,j} (v_i - v_j)^2 (coordinate-wise)."""
    for k in range(1, max_terms + 1):
        v = sp.symbols(f"v0:{k}")
        lhs = k * sum(x**2 for x in v) - sum(v) ** 2
        rhs = sp.Rational(1, 2) * sum((a - b) ** 2 for a in v for b in v)
        if sp.expand(lhs - rhs) != 0:
            return False
    return True


def check_polarization() -> bool:
    a = sp.symbols("a0:3")
    b = sp.symbols("b0:3")
    inner = sum(x * y for x, y in zip(a, b))
    sq = lambda v: sum(x**2 for x in v)  # noqa: E731
    return sp.expand(inner - (sq(a) + sq(b) - sq([x - y for x, y in zip(a, b)])) / 2) == 0


def derived_bound(d: sp.Expr) -> sp.Expr:
    """Solve ``telescoped`` for S_G/T, dropping the S_D term (non-positive under the step-size condition)."""
    solved = sp.solve(sp.Eq(telescoped(d).subs(SD, 0), 0), SG)[0]
    return sp.simplify(solved / T)


def check_claim(claim: Callable[[], sp.Expr], d: sp.Expr) -> bool:
    """The claimed bound equals the one derived from the proof's steps."""
    return sp.simplify(derived_bound(d) - claim()) == 0


def check_step_size_condition() -> bool:
    """eta <= 1/(2 L (s+1)) implies L eta + L^2 eta^2 s^2 <= 3/4 <= 1: at the largest allowed eta,
    3/4 - (L eta + L^2 eta^2 s^2) = (2 s^2 + 4 s + 1) / (4 (s+1)^2) > 0, and the left side grows with eta."""
    e = 1 / (2 * L * (s + 1))
    slack = sp.Rational(3, 4) - (L * e + L**2 * e**2 * s**2)
    return sp.simplify(slack - (2 * s**2 + 4 * s + 1) / (4 * (s + 1) ** 2)) == 0


def check_rate() -> bool:
    """With eta = sqrt(2 Delta / (L T sigma^2)) (when it satisfies the condition) the bound is
    2 sqrt(2 L Delta sigma^2 / T) + 2 L Delta s^2 / T: staleness only enters the O(1/T) term."""
    e = sp.sqrt(2 * Delta / (L * T * sigma2))
    val = sgd_bound_claim().subs(eta, e)
    return sp.simplify(val - (2 * sp.sqrt(2 * L * Delta * sigma2 / T) + 2 * L * Delta * s**2 / T)) == 0


def eta_max_claim() -> sp.Expr:
    """The largest eta with L eta + L^2 eta^2 s^2 <= 1 - delta (s > 0): the positive root of the quadratic."""
    return (-1 + sp.sqrt(1 + 4 * s**2 * (1 - delta))) / (2 * L * s**2)


ETA_MAX_POINTS = ((1.0, 1, 0.0), (2.0, 8, 0.0), (0.5, 32, 0.45))  # (L, s, delta)


def check_eta_max(points: tuple[tuple[float, float, float], ...] = ETA_MAX_POINTS) -> bool:
    """The claimed root meets the condition with equality, and ``eta_max`` (the number a run uses,
    :mod:`gacbench.functional.stepsize`) evaluates it at ``points`` of (L, s, delta)."""
    e = eta_max_claim()
    on_boundary = sp.simplify(L * e + L**2 * e**2 * s**2 - (1 - delta)) == 0
    numeric = all(
        math.isclose(eta_max(Lv, sv, dv), float(e.subs({L: Lv, s: sv, delta: dv})), rel_tol=1e-12)
        for Lv, sv, dv in points
    )
    return on_boundary and numeric


# -- GAC's per-step guarantees (sympy, in the plane of u and g's orthogonal part) ------------------
def gac_kept_fraction(c, c_low, shrink: str = "component"):
    """The rule's kept fraction of the aligned component in the shrink regime (c_low < c < c_high), symbolic:
    ``component`` keeps c_low / c, ``cosine`` keeps (c_low / c) sqrt((1 - c^2) / (1 - c_low^2))
    (docs/design.md; :func:`gacbench.functional.alignment.gac_decision` is its numeric form)."""
    if shrink == "cosine":
        return (c_low / c) * sp.sqrt((1 - c**2) / (1 - c_low**2))
    return c_low / c


def check_gac_geometry(kept: Callable = gac_kept_fraction) -> dict[str, bool]:
    """GAC's per-step guarantees, derived from the rule. In the orthonormal basis (u, w^) of the plane of r and g,
    g = (c n, sqrt(1 - c^2) n) with c = cos(g, r), n = ||g||; the rule gives g~ = g - (1 - k) <g, u> u with k
    ``kept(c, c_low, shrink)`` when shrinking and k = 0 when projecting. Each guarantee is an identity in c,
    c_low, n (the shrink regime substituted as c = c_low + eps, eps > 0, where a root needs its sign); a rule
    other than the one stated (``kept``) fails them. ``rule_is_the_code``: the numeric rule
    (:func:`gac_decision`) removes 1 - k at points of the shrink regime and all of it when projecting."""
    from gacbench.functional.alignment import gac_decision

    c, cl, n, eps = sp.symbols("c c_low n eps", positive=True)
    u = sp.Matrix([1, 0])
    g = sp.Matrix([c * n, sp.sqrt(1 - c**2) * n])

    def applied(k):
        return g - (1 - k) * g.dot(u) * u

    def zero(expr, shrinking: bool = True) -> bool:
        expr = expr.subs(c, cl + eps) if shrinking else expr
        return sp.simplify(expr) == 0

    shrunk, projected = applied(kept(c, cl, "component")), applied(0)
    norm = lambda v: sp.sqrt(v.dot(v))  # noqa: E731
    # shrink ("component"): <g~, g> = n^2 (1 - c^2 + c_low c) > 0, ||g||^2 - ||g~||^2 = n^2 (c^2 - c_low^2) > 0
    ok_descent = zero(shrunk.dot(g) - n**2 * (1 - c**2 + cl * c))
    ok_norm = zero(n**2 - shrunk.dot(shrunk) - n**2 * (c - cl) * (c + cl))
    ok_component = zero(shrunk.dot(u) - cl * n)
    # shrink ("cosine"): cos(g~, u) = c_low exactly
    cosine = applied(kept(c, cl, "cosine"))
    ok_cosine = zero(cosine.dot(u) / norm(cosine) - cl)
    # projection: <g~, u> = 0 and <g~, g> = ||g~||^2 = (1 - c^2) n^2
    ok_project = (zero(projected.dot(u), False) and zero(projected.dot(g) - projected.dot(projected), False)
                  and zero(projected.dot(projected) - (1 - c**2) * n**2, False))
    # removed part: ||g - g~|| = (c - c_low) n when shrinking, c n when projecting
    ok_removed = zero(norm(g - shrunk) - (c - cl) * n) and zero(norm(g - projected) - c * n, False)
    # the numeric rule is this one: the fraction it removes at points of the shrink regime, and under projection
    points = [(0.1, 0.05, 0.3), (0.29, 0.05, 0.3), (0.4, 0.1, 0.6)]
    ok_code = all(
        math.isclose(gac_decision(cv, lo, hi, shrink=mode).coef,
                     1.0 - float(kept(sp.Float(cv), sp.Float(lo), mode)), rel_tol=1e-12)
        for cv, lo, hi in points for mode in ("component", "cosine"))
    ok_code = ok_code and gac_decision(0.5, 0.05, 0.3).coef == 1.0
    return {"descent_shrink": ok_descent, "norm_shrink": ok_norm, "component_is_c_low": ok_component,
            "cosine_is_c_low": ok_cosine, "projection": ok_project, "removed_fraction": ok_removed,
            "rule_is_the_code": ok_code}
