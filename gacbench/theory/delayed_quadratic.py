"""Result 1 (stability of delayed gradient descent on a quadratic) and result 4 (why staleness
aligns consecutive gradients).

Along an eigen-direction of curvature lambda, gradient descent with step eta on gradients delayed by
s steps is the recursion x_{t+1} = x_t - a x_{t-s}, a = eta * lambda, with characteristic polynomial
p(z) = z^{s+1} - z^s + a. It is stable (every root strictly inside the unit circle) exactly when
0 < a < a*(s) = 2 sin(pi / (2 (2 s + 1))).
"""

from __future__ import annotations

import math

import numpy as np
import sympy as sp
from scipy.linalg import solve_discrete_lyapunov


def a_star_expr(s) -> sp.Expr:
    """a*(s) = 2 sin(pi / (2 (2 s + 1))) as a sympy expression (``s`` an integer or a sympy symbol): the form the
    symbolic checks test, and :func:`a_star` must equal (:func:`a_star_matches_expr`)."""
    return 2 * sp.sin(sp.pi / (2 * (2 * sp.sympify(s) + 1)))


def a_star(s: int) -> float:
    """a*(s) as a float, the number the numeric checks and the figures use."""
    return 2.0 * math.sin(math.pi / (2.0 * (2 * s + 1)))


def a_star_matches_expr(svals=range(0, 33), rel: float = 1e-12) -> bool:
    """The float :func:`a_star` equals the sympy :func:`a_star_expr` at every s in ``svals`` (to ``rel``, rounding)."""
    return all(math.isclose(a_star(s), float(a_star_expr(s)), rel_tol=rel) for s in svals)


def spectral_radius(a: float, s: int) -> float:
    """Largest root modulus of z^{s+1} - z^s + a."""
    coeffs = np.zeros(s + 2)
    coeffs[0], coeffs[1], coeffs[-1] = 1.0, -1.0, a
    if s == 0:
        coeffs = np.array([1.0, a - 1.0])
    return float(np.abs(np.roots(coeffs)).max())


def symbolic_boundary_root() -> bool:
    """sympy, for symbolic s: z = exp(i pi / (2s+1)) is a root of p at a = a*(s), so that a*(s) puts a root on the
    unit circle. That it is the first such a (the smallest, where stability is lost) is not shown here: the same
    identity holds at later crossings (theta = 5 pi / (2s+1)); :func:`crossing` finds the first numerically."""
    s = sp.symbols("s", positive=True, integer=True)
    z = sp.exp(sp.I * sp.pi / (2 * s + 1))
    a = a_star_expr(s)
    return sp.simplify((z**s * (z - 1) + a).rewrite(sp.exp)) == 0


def symbolic_small_s() -> bool:
    """sympy: the exact stability region for s = 0 (|1 - a| < 1) and s = 1 (Jury: a < 1) is (0, a*(s)), a*(s) read
    from :func:`a_star_expr`."""
    a = sp.symbols("a", positive=True)
    region0 = sp.solve_univariate_inequality(sp.Abs(1 - a) < 1, a, relational=False)
    ok0 = region0 == sp.Interval.open(0, sp.simplify(a_star_expr(0)))
    # s = 1: z^2 - z + a. Jury/Schur-Cohn for z^2 + b z + c: stable iff |c| < 1 and |b| < 1 + c; here b = -1, c = a.
    b, c = -1, a
    region = sp.solve_univariate_inequality(sp.Abs(c) < 1, a, relational=False).intersect(
        sp.solve_univariate_inequality(sp.Abs(b) < 1 + c, a, relational=False)
    ).intersect(sp.Interval.open(0, sp.oo))  # a = eta lambda > 0
    ok1 = region == sp.Interval.open(0, sp.simplify(a_star_expr(1)))
    return bool(ok0 and ok1)


def crossing(s: int, tol: float = 1e-12) -> float:
    """The a at which the spectral radius reaches 1, by bisection on (0, 2]."""
    lo, hi = 1e-9, 2.0
    while hi - lo > tol * hi:
        mid = 0.5 * (lo + hi)
        if spectral_radius(mid, s) < 1.0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def simulate(a: float, s: int, steps: int, seed: int = 0) -> float:
    """|x_T| / |x_0|-ish growth of the delayed recursion from a random start (history of s + 1 values)."""
    rng = np.random.default_rng(seed)
    hist = list(rng.standard_normal(s + 1))
    start = max(abs(v) for v in hist)
    for _ in range(steps):
        hist.append(hist[-1] - a * hist[-(s + 1)])
        hist.pop(0)
    return max(abs(v) for v in hist) / start


# -- result 4: the stationary consecutive-gradient cosine ---------------------------------------
def companion(a: float, s: int) -> np.ndarray:
    """State X_t = (x_t, x_{t-1}, ..., x_{t-s}); X_{t+1} = M X_t + e_1 * noise."""
    m = np.zeros((s + 1, s + 1))
    m[0, 0] += 1.0
    m[0, s] -= a
    for i in range(1, s + 1):
        m[i, i - 1] = 1.0
    return m


def stationary_moments(eta: float, lam: float, sigma2: float, s: int) -> tuple[float, float]:
    """For g_t = lam x_{t-s} + xi_t, xi_t ~ N(0, sigma2) fresh at each step, x_{t+1} = x_t - eta g_t,
    in the stationary regime: returns (E[g_t g_{t-1}], E[g_t^2]).

    With C(k) = E[x_j x_{j-k}]: E[g_t^2] = lam^2 C(0) + sigma2 and E[g_t g_{t-1}] = lam^2 C(1), minus
    eta lam sigma2 when s = 0 (then x_t already contains xi_{t-1}; for s >= 1, x_{t-s} does not).
    """
    m = companion(eta * lam, s)
    q = np.zeros((s + 1, s + 1))
    q[0, 0] = eta**2 * sigma2
    cov = solve_discrete_lyapunov(m, q)  # Cov(X) = M Cov(X) M^T + Q
    c0 = cov[0, 0]
    c1 = cov[0, 1] if s >= 1 else (1.0 - eta * lam) * c0
    cross = lam**2 * c1 - (eta * lam * sigma2 if s == 0 else 0.0)
    return float(cross), float(lam**2 * c0 + sigma2)


def predicted_cosine(eta: float, eigs: np.ndarray, sigma2_per_dim: float, s: int) -> float:
    """E<g_t, g_{t-1}> / E||g_t||^2 summed over eigen-directions: the stationary c_t (ratio of expectations)."""
    num = den = 0.0
    for lam in eigs:
        cross, sq = stationary_moments(eta, float(lam), sigma2_per_dim, s)
        num += cross
        den += sq
    return num / den
