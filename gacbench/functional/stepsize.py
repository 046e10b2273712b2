"""The step-size condition of the bounded-staleness bounds as a number (theory/README.md, results 2-3).

The symbolic statements and their checks live in :mod:`gacbench.theory.bounds`; this is the one
formula a running callback needs (``AssumptionMonitor``), kept here so that callbacks import only
from below them.
"""

from __future__ import annotations

import math
from numbers import Real


def _check_number(name: str, value: object) -> None:
    """ValueError naming ``name`` unless ``value`` is a real number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"eta_max: {name}={value!r} must be a number")


def eta_max(L: float, s: float, delta: float = 0.0) -> float:
    """The largest step eta with L eta + L^2 eta^2 s^2 <= 1 - delta (the positive root).

    ``L`` > 0 is the smoothness constant (L = inf, an estimate gone to infinity, leaves no positive step: 0),
    ``s`` >= 0 the staleness bound, a finite number, ``delta`` in [0, 1) GAC's bound on the removed fraction of
    each gradient (0 without GAC; the theorem needs delta < 1). With s = 0 the condition is L eta <= 1 - delta.
    Anything else raises ValueError naming the argument.
    """
    for name, value in (("L", L), ("s", s), ("delta", delta)):
        _check_number(name, value)
    if not L > 0:
        raise ValueError(f"eta_max: L={L!r} must be positive (a smoothness constant)")
    if not (math.isfinite(s) and s >= 0):
        raise ValueError(f"eta_max: s={s!r} must be a finite number >= 0 (a staleness bound)")
    if not 0 <= delta < 1:
        raise ValueError(f"eta_max: delta={delta!r} must be in [0, 1) (the bound on GAC's removed fraction; "
                         "0 without GAC)")
    budget = 1.0 - delta
    if math.isinf(L):
        return 0.0
    if s == 0:
        return budget / L
    return (-1.0 + math.sqrt(1.0 + 4.0 * s**2 * budget)) / (2.0 * L * s**2)
