"""A pipeline model of asynchronous GRPO: how long each optimizer step takes when rollout workers generate while
the trainer trains, within a staleness bound s.

The model has four numbers and one rule:

- ``gen_s`` (G): seconds to generate one step's rollout batch on one rollout worker;
- ``train_s`` (T): seconds of one optimizer step on the trainer, the weight sync included;
- ``workers`` (n): rollout workers;
- ``chunks`` (c, default n): a step's batch is split in c equal jobs of G / c seconds each;
- the rule, for a staleness bound s >= 0: the jobs of step t may start once the policy version t - s exists
  (version v is published when optimizer step v - 1 ends; version 0 at time 0); each job starts on the first
  free worker (the lowest-numbered on a tie), jobs are handed out in step order; optimizer step t starts when
  step t - 1 has ended and every job of step t has ended.

This is the ``wait`` admission of :mod:`gacbench.rollout.async_producer`. At s = 0 it is synchronous GRPO:
step t's generation cannot start before step t - 1's update, and a step costs L + T, L = ceil(c / n) G / c the
time to generate one batch on free workers (G / n when the batch splits evenly over the workers, G when it is
one job). For s >= 1 generation and training overlap. The schedule is a max-plus recurrence whose steady-state
step time is the largest cycle mean of three circuits: the trainer (T per step), the workers (G / n per step:
n workers share G of work per step) and the loop admission -> generation -> training -> next admission (L + T
per s + 1 steps):

    P(s) = max(T, G / n, (L + T) / (s + 1))        (:func:`steady_step_s`)

It holds where every step's jobs meet the same free workers (c a multiple of n, or n a multiple of c); for
other (n, c) :func:`simulate` gives the schedule and :func:`mean_step_s` its steady step time. P is
non-increasing in s and in n; it reaches the throughput bound max(T, G / n) once s >= (L + T) / max(T, G / n) -
1 (:func:`hiding_staleness`), and P(0) / P(large s) = (L + T) / max(T, G / n) is what any overlap can gain.

Timing does not depend on which weights a job uses, only on when it may start: the same schedule serves a run
whose batch t is generated with version t - s exactly (the stale FIFO of ``rollout.mode: sync``, what the
benchmark grids' stale runs did) and one that loads the newest version at the job's start (a real
bounded-staleness system, whose lag is then <= s: :class:`Schedule` records that lag).

Left out: weight-sync stalls beyond T, batches or responses of unequal length, dropped or regenerated batches
(``drop`` admission, worker restarts), contention for cores between generation and training, and start-up.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    """The simulated times of ``steps`` optimizer steps (lists indexed by step t, seconds from time 0).

    ``gen_start[t]`` / ``gen_end[t]``: the first job of step t starts / the last one ends; ``train_start[t]`` /
    ``train_end[t]``: optimizer step t; ``lag[t]``: the mean over step t's jobs of t - v, v the newest version
    published when the job starts (the lag of a system that loads the newest weights; <= s)."""

    gen_start: list[float]
    gen_end: list[float]
    train_start: list[float]
    train_end: list[float]
    lag: list[float]

    @property
    def makespan(self) -> float:
        """The end of the last optimizer step (0 for no step)."""
        return self.train_end[-1] if self.train_end else 0.0

    def version_time(self, version: float) -> float:
        """When policy version ``version`` exists: 0 for version 0, the end of optimizer step v - 1 for v >= 1,
        linear between two versions for a fractional one. ``version`` must lie in 0..steps."""
        if not 0 <= version <= len(self.train_end):
            raise ValueError(f"version {version} is outside 0..{len(self.train_end)} (the schedule's steps)")
        lo = math.floor(version)
        at = lambda v: 0.0 if v == 0 else self.train_end[v - 1]  # noqa: E731
        if lo == version:
            return at(lo)
        return at(lo) + (version - lo) * (at(lo + 1) - at(lo))


def check_setting(gen_s: float, train_s: float, workers: int, chunks: int | None = None) -> int:
    """Refuse a setting the model cannot take (ValueError naming the value and the fix); returns the chunks (n
    where None)."""
    for name, value in (("gen_s (G)", gen_s), ("train_s (T)", train_s)):
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} = {value!r} must be a finite number of seconds >= 0")
    if gen_s + train_s <= 0:
        raise ValueError("G and T are both 0: give at least one positive time")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers (n) = {workers!r} must be an integer >= 1 (one rollout worker at least)")
    chunks = workers if chunks is None else chunks
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks (c) = {chunks!r} must be an integer >= 1 (jobs per step's batch)")
    return chunks


def _check_staleness(staleness: int) -> None:
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise ValueError(f"staleness s = {staleness!r} must be an integer >= 0 (0: synchronous)")


def simulate(gen_s: float, train_s: float, workers: int, staleness: int, steps: int,
             chunks: int | None = None) -> Schedule:
    """The exact schedule of ``steps`` optimizer steps under the model's rule (module docstring): jobs in step
    order, each on the first free worker once its step is admitted; deterministic."""
    c = check_setting(gen_s, train_s, workers, chunks)
    _check_staleness(staleness)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps = {steps!r} must be an integer >= 0")
    job = gen_s / c
    free = [(0.0, w) for w in range(workers)]  # a heap of (free at, worker): the first free, the lowest on a tie
    g0, g1, t0, t1, lags = [], [], [], [], []
    for t in range(steps):
        needed = t - staleness  # the oldest version step t's rollouts may come from
        admit = 0.0 if needed <= 0 else t1[needed - 1]
        starts, ends, lag = [], [], 0.0
        for _ in range(c):
            free_at, w = free[0]
            start = max(admit, free_at)
            heapq.heapreplace(free, (start + job, w))
            starts.append(start)
            ends.append(start + job)
            lag += t - bisect.bisect_right(t1, start)  # versions published by the job's start: steps ended by then
        begin = max(max(ends), t1[-1] if t1 else 0.0)
        g0.append(min(starts))
        g1.append(max(ends))
        t0.append(begin)
        t1.append(begin + train_s)
        lags.append(lag / c)
    return Schedule(g0, g1, t0, t1, lags)


def batch_latency(gen_s: float, workers: int, chunks: int | None = None) -> float:
    """L: the time to generate one step's batch on free workers, ceil(c / n) x G / c (c = n where None; the
    arguments as checked by :func:`check_setting`)."""
    c = workers if chunks is None else chunks
    return math.ceil(c / workers) * gen_s / c


def steady_step_s(gen_s: float, train_s: float, workers: int, staleness: int,
                  chunks: int | None = None) -> float | None:
    """The steady-state step time max(T, G / n, (L + T) / (s + 1)) where it holds (c a multiple of n or n a
    multiple of c); None otherwise (use :func:`mean_step_s`)."""
    c = check_setting(gen_s, train_s, workers, chunks)
    _check_staleness(staleness)
    if c % workers and workers % c:
        return None
    latency = batch_latency(gen_s, workers, c)
    return float(max(train_s, gen_s / workers, (latency + train_s) / (staleness + 1)))


@functools.lru_cache(maxsize=256, typed=True)  # typed: True is not taken for 1
def mean_step_s(gen_s: float, train_s: float, workers: int, staleness: int, chunks: int | None = None,
                cycles: int = 50) -> float:
    """The simulated steady step time: the mean step over a window of ``cycles`` x m steps after as many steps
    of run-in, m = (s + 1) n c (a multiple of every circuit's length, so that a periodic schedule averages
    exactly). Remembered per setting: a report asks it for every method at one staleness."""
    c = check_setting(gen_s, train_s, workers, chunks)
    m = (staleness + 1) * workers * c
    window = cycles * m
    sched = simulate(gen_s, train_s, workers, staleness, 2 * window, c)
    return (sched.train_end[-1] - sched.train_end[window - 1]) / window


def hiding_staleness(gen_s: float, train_s: float, workers: int, chunks: int | None = None) -> int | None:
    """The smallest s at which :func:`steady_step_s` reaches max(T, G / n), ceil((L + T) / max(T, G / n)) - 1
    (None where the closed form does not hold)."""
    c = check_setting(gen_s, train_s, workers, chunks)
    if c % workers and workers % c:
        return None
    bound = max(train_s, gen_s / workers)
    ratio = (batch_latency(gen_s, workers, c) + train_s) / bound
    return max(0, math.ceil(ratio - 1e-12) - 1)
