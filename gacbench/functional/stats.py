"""Summary statistics of a c_t trace (paper Table 3) as a pure function."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def alignment_summary(cos: Sequence[float], warmup: int = 0, tol: float = 0.05) -> dict[str, float]:
    """On-policy alignment statistics of a trace of consecutive-gradient cosines.

    Over ``cos[warmup:]`` with missing values (None, NaN: a step whose gradient was zero or non-finite has no
    c_t) dropped: ``q90_abs`` = q_0.9(|c_t|), ``max_abs`` = max |c_t|, ``frac_le_tol`` = Pr(|c_t| <= tol),
    ``median`` = median c_t (signed), ``n`` (the values used) and ``skipped`` (the missing ones after the
    warm-up). Returns NaNs (and n = 0) when no value is left after the warm-up.
    """
    if warmup < 0:
        raise ValueError(f"alignment_summary: warmup={warmup} must be >= 0")
    kept = list(cos[warmup:])
    values = np.asarray([c for c in kept if c is not None and math.isfinite(c)], dtype=np.float64)
    skipped = len(kept) - int(values.size)
    if values.size == 0:
        nan = float("nan")
        return {"q90_abs": nan, "max_abs": nan, "frac_le_tol": nan, "median": nan, "n": 0, "skipped": skipped}
    a = np.abs(values)
    return {
        "q90_abs": float(np.quantile(a, 0.9)),
        "max_abs": float(a.max()),
        "frac_le_tol": float(np.mean(a <= tol)),
        "median": float(np.median(values)),
        "n": int(values.size),
        "skipped": skipped,
    }
