"""The step-size condition of the bounded-staleness bounds as a number (theory/README.md, results 2-3).

The symbolic statements and their checks live in :mod:`gacbench.theory.bounds`; this is the one
formula a running callback needs (``AssumptionMonitor``), kept here so that callbacks import only
from below them.
"""

from __future__ import annotations

import math


def eta_max(L: float, s: float, delta: float = 0.0) -> float:
    """The largest step eta with L eta + L^2 eta^2 s^2 <= 1 - delta (the positive root; 0 if delta >= 1).

    ``L`` > 0 is the smoothness constant, ``s`` >= 0 the staleness bound, ``delta`` GAC's bound on the
    removed fraction of each gradient (0 without GAC). With s = 0 the condition is L eta <= 1 - delta.
    """
    if not L > 0:
        raise ValueError(f"eta_max: L={L!r} must be positive (a smoothness constant)")
    if not s >= 0:
        raise ValueError(f"eta_max: s={s!r} must be >= 0 (a staleness bound)")
    budget = 1.0 - delta
    if budget <= 0:
        return 0.0
    if s == 0:
        return budget / L
    return (-1.0 + math.sqrt(1.0 + 4.0 * s**2 * budget)) / (2.0 * L * s**2)
