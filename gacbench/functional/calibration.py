"""GAC thresholds anchored to the on-policy range of a synchronous reference run, as a pure function.

The paper motivates (c_low, c_high) = (0.05, 0.3) by the on-policy statistics of its Table 3: over the
updates after a warm-up of synchronous (s = 0) training, q_0.9(|c_t|) is 0.03-0.07 and max |c_t| is
0.06-0.13, so c_low sits at the top of the on-policy range and c_high well above it. The defaults are
those numbers for the paper's models; another model, task or learning rate has another on-policy range
(the LLM grids of this suite have synchronous q_0.9(|c_t|) near 0.3). :func:`calibrate_thresholds`
turns a synchronous run's c_t trace into thresholds by the same reading:

- ``c_low = q_quantile(|c_t|)`` (``quantile`` = 0.9): the top of the on-policy range. GAC leaves a step
  untouched when c_t <= c_low, so this keeps 90% of synchronous steps as they are.
- ``c_high = max(c_low + gap, max |c_t|)`` (``gap`` = 0.25 = 0.3 - 0.05, the defaults' distance):
  well above the on-policy range, and never below a synchronous step's |c_t|, so that no step of the
  reference run would have had its aligned component removed entirely.
- both capped: ``c_low <= cap - gap`` and ``c_high <= cap`` (``cap`` = 0.95), so that a reference run
  whose own gradients are aligned (a deterministic, not noise-dominated, regime) still yields a shrink
  band and a projection threshold below 1; ``clipped`` in :func:`calibration_record` says when a cap
  acted.

With the paper's Table 3 values the rule returns the paper's defaults to within 0.02: Qwen3-1.7B
(q_0.9 0.0471, max 0.0924) -> (0.047, 0.297); Llama-3.2-3B-Instruct (0.0687, 0.1276) -> (0.069, 0.319);
Qwen3-4B (0.0296, 0.0645) -> (0.030, 0.280); Qwen3-8B (0.0317, 0.0625) -> (0.032, 0.282).

The reference is the *synchronous* run of the same task and seed, not the stale run's own first steps:
under a staleness schedule s_t = min(s, t) (and the stale-rollout pipeline, which starts full of
version-0 batches) every step after the first is already stale, so a run's own early c_t would anchor
the thresholds to the stale range GAC is meant to detect.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

import numpy as np

#: The defaults of the rule (see the module docstring).
QUANTILE, GAP, CAP, MIN_STEPS = 0.9, 0.25, 0.95, 10


class Thresholds(NamedTuple):
    c_low: float
    c_high: float


def _check_rule(quantile: float, gap: float, cap: float) -> None:
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"calibrate_thresholds: quantile={quantile!r} must be in (0, 1]")
    if not 0.0 < gap < cap <= 1.0:
        raise ValueError(f"calibrate_thresholds: need 0 < gap < cap <= 1, got gap={gap!r}, cap={cap!r}")


def calibration_record(source: Sequence[float] | Mapping[str, float], warmup: int = 0, quantile: float = QUANTILE,
                       gap: float = GAP, cap: float = CAP, min_steps: int = MIN_STEPS) -> dict:
    """The thresholds of :func:`calibrate_thresholds` with what they were computed from: ``c_low``,
    ``c_high``, ``q_abs`` (the quantile of |c_t|), ``max_abs``, ``n`` (steps used), ``quantile``, ``gap``,
    ``cap`` and ``clipped`` (True when a cap lowered a threshold)."""
    _check_rule(quantile, gap, cap)
    if isinstance(source, Mapping):  # an alignment summary (gacbench.functional.stats.alignment_summary)
        if quantile != 0.9:
            raise ValueError("calibrate_thresholds: an alignment summary holds q_0.9(|c_t|) only; pass the c_t trace "
                             f"for quantile={quantile}")
        missing = [k for k in ("q90_abs", "max_abs") if k not in source]
        if missing:
            raise ValueError(f"calibrate_thresholds: the summary lacks {', '.join(missing)} (expected the keys of "
                             "alignment_summary or AlignmentMonitor.summary)")
        q, top, n = float(source["q90_abs"]), float(source["max_abs"]), source.get("n")
        n = None if n is None else int(n)
        if warmup:
            raise ValueError("calibrate_thresholds: a summary is already computed after its own warm-up; pass warmup=0")
    else:
        if not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"calibrate_thresholds: warmup={warmup!r} must be a non-negative integer")
        values = np.abs(np.asarray([c for c in list(source)[warmup:] if c is not None and math.isfinite(c)],
                                   dtype=np.float64))
        n = int(values.size)
        if n == 0:
            q = top = math.nan
        else:
            q, top = float(np.quantile(values, quantile)), float(values.max())
    if n is not None and n < min_steps:
        raise ValueError(f"calibrate_thresholds: the reference trace has {n} finite c_t values after the warm-up "
                         f"of {warmup} steps; at least {min_steps} are needed to read its on-policy range (run the "
                         "reference longer, or lower the warm-up)")
    if not (math.isfinite(q) and math.isfinite(top)):
        raise ValueError(f"calibrate_thresholds: the reference statistics are not finite (q={q}, max={top})")
    c_low = min(q, cap - gap)
    c_high = min(max(c_low + gap, top), cap)
    return {"c_low": c_low, "c_high": c_high, "q_abs": q, "max_abs": top, "n": n, "quantile": quantile, "gap": gap,
            "cap": cap, "clipped": bool(c_low < q or c_high < max(c_low + gap, top))}


def calibrate_thresholds(source: Sequence[float] | Mapping[str, float], warmup: int = 0, quantile: float = QUANTILE,
                         gap: float = GAP, cap: float = CAP, min_steps: int = MIN_STEPS) -> Thresholds:
    """(c_low, c_high) anchored to the on-policy range of a synchronous reference run.

    Args:
        source: the reference run's c_t trace (a sequence of floats, one per step; NaNs are dropped), or
            its alignment summary (a mapping with ``q90_abs`` and ``max_abs``, e.g. ``AlignmentMonitor.summary``;
            then ``quantile`` must be 0.9 and ``warmup`` 0, the summary having dropped its own warm-up).
        warmup: leading steps of the trace left out (the transient; paper Table 3 uses 50).
        quantile, gap, cap: the rule's constants (module docstring).
        min_steps: the fewest finite c_t values after the warm-up to calibrate from (else ValueError).

    Returns ``Thresholds(c_low, c_high)`` with ``c_low = min(q_quantile(|c_t|), cap - gap)`` and
    ``c_high = min(max(c_low + gap, max |c_t|), cap)``, so that ``0 <= c_low < c_high <= cap``.
    """
    rec = calibration_record(source, warmup, quantile, gap, cap, min_steps)
    return Thresholds(rec["c_low"], rec["c_high"])


__all__ = ["CAP", "GAP", "MIN_STEPS", "QUANTILE", "Thresholds", "calibrate_thresholds", "calibration_record"]
