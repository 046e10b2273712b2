"""Where a grid's wall time goes: the step share, per-worker memory, and the breakdown of wall x workers.

A cell's ``status.json`` holds ``started_at`` and ``ended_at`` (Unix time) and ``time``: the seconds of
its span split into :data:`CELL_PARTS` (they add up to ``ended_at - started_at``). :func:`timing_record`
lays each worker's cells on the grid's own span (``grid_started_at`` .. ``grid_started_at + wall``): the
time before a worker's first cell (``start``: process start and imports), its cells' parts, the gaps
between its cells, the time from its last cell to the last cell of the grid (``idle``: waiting for the
other workers) and from there to the end (``shutdown``: the workers exit, the pool closes). Every worker's
line adds up to the wall time, so the parts together add up to wall x workers; :data:`PARTS` names them in
the order printed, with what each one holds.
"""

from __future__ import annotations

import math
from typing import Any

#: The parts of one cell's span, in status.json's ``time``.
CELL_PARTS = ("setup", "model", "engine", "eval", "steps", "trainer", "write", "other")

#: Every part of wall x workers, with what it holds.
PARTS: dict[str, str] = {
    "start": "process start and imports",
    "setup": "objective, callbacks, Trainer (no model load)",
    "model": "model load (and any warm-start build)",
    "engine": "rollout engine start-up",
    "eval": "metric evaluations",
    "steps": "optimizer steps",
    "trainer": "fit outside steps, evals, engine start",
    "write": "the cells' config.json",
    "other": "the rest of the cells",
    "gaps": "between a worker's cells",
    "idle": "done, waiting for the other workers",
    "shutdown": "after the last cell: workers exit",
}


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def cell_parts(seconds: dict[str, float], span: float) -> dict[str, float]:
    """``seconds`` (measured parts of a cell, keys of :data:`CELL_PARTS` but ``other``) completed to its span:
    ``other`` is what the measured parts leave of ``span``, so the parts add up to ``span``."""
    parts = {k: float(seconds.get(k, 0.0)) for k in CELL_PARTS if k != "other"}
    parts["other"] = span - sum(parts.values())
    return parts


def breakdown(results: list[dict], grid_started_at: float, wall: float, workers: int) -> dict[str, Any]:
    """``{"parts": {part: seconds}, "per_worker": {pid: {part: seconds}}}`` over the cells of ``results`` that a
    worker ran in this grid (``started_at`` at or after ``grid_started_at``). Per worker the parts add up to
    ``wall``; ``workers`` minus the workers seen are idle throughout."""
    end = grid_started_at + wall
    runs: dict[int, list[dict]] = {}
    for r in results:
        if r.get("worker_pid") is None or not _finite(r.get("started_at")) or not _finite(r.get("ended_at")):
            continue
        if r["started_at"] < grid_started_at:  # a stored result of an earlier run
            continue
        runs.setdefault(int(r["worker_pid"]), []).append(r)
    per_worker: dict[int, dict[str, float]] = {}
    for pid, cells in runs.items():
        cells.sort(key=lambda r: r["started_at"])
        parts = dict.fromkeys(PARTS, 0.0)
        parts["start"] = cells[0]["started_at"] - grid_started_at
        for prev, cur in zip(cells, cells[1:]):
            parts["gaps"] += cur["started_at"] - prev["ended_at"]
        for r in cells:
            span = r["ended_at"] - r["started_at"]
            measured = r.get("time") if isinstance(r.get("time"), dict) else {"other": span}
            for k, v in cell_parts({k: v for k, v in measured.items() if k != "other" and _finite(v)}, span).items():
                parts[k] += v
        per_worker[pid] = parts
    last = max((cells[-1]["ended_at"] for cells in runs.values()), default=end)
    for pid, parts in per_worker.items():
        parts["idle"] = last - runs[pid][-1]["ended_at"]
        parts["shutdown"] = end - last
    total = dict.fromkeys(PARTS, 0.0)
    for parts in per_worker.values():
        for k, v in parts.items():
            total[k] += v
    total["idle"] += max(0, workers - len(per_worker)) * wall
    return {"parts": total, "per_worker": per_worker}


def timing_record(results: list[dict], wall: float, workers: int,
                  grid_started_at: float | None = None) -> dict[str, Any]:
    """Step share, cell rate, per-worker memory and (given the grid's start, Unix time) the breakdown of
    wall x workers of the cells run in one invocation (``results`` in completion order, so each worker's
    list of resident memory is in the order it ran its cells)."""
    step_s = sum(r["step_s"] for r in results if _finite(r.get("step_s")))
    eval_s = sum(r["eval_s"] for r in results if _finite(r.get("eval_s")))
    per: dict[int, list[float]] = {}
    for r in results:
        if r.get("worker_pid") is not None:
            per.setdefault(int(r["worker_pid"]), []).append(r.get("rss_mb"))
    split = breakdown(results, grid_started_at, wall, workers) if grid_started_at is not None else None
    per_worker = []
    for pid, rss in per.items():
        known = [x for x in rss if _finite(x)]
        w = {"pid": pid, "cells": len(rss), "rss_mb": rss,
             "rss_mb_first": known[0] if known else None, "rss_mb_last": known[-1] if known else None,
             "rss_mb_max": max(known) if known else None}
        if split is not None and pid in split["per_worker"]:
            w["parts"] = split["per_worker"][pid]
        per_worker.append(w)
    record = {
        "wall_s": wall, "workers": workers,
        "cells_per_min": 60.0 * len(results) / wall if results and wall > 0 else 0.0,
        "step_s": step_s, "eval_s": eval_s,
        "step_share": step_s / (wall * workers) if results and wall > 0 and workers > 0 else None,
        "per_worker": per_worker,
    }
    if split is not None and results and wall > 0 and workers > 0:
        record["parts"] = split["parts"]
        record["parts_share"] = {k: v / (wall * workers) for k, v in split["parts"].items()}
    return record


def timing_lines(timing: dict[str, Any], verbose: bool = False) -> list[str]:
    """The step share and each worker's resident memory, as printed at the end of a run; with ``verbose``
    also the breakdown of wall x workers, one line per part (seconds and share), and each worker's line."""
    if not timing.get("ran") or timing.get("step_share") is None:
        return []

    def mb(x: float | None) -> str:
        return "?" if x is None else f"{x:.0f}"

    lines = [f"step share {timing['step_share']:.0%}: {timing['step_s']:.1f} s of optimizer steps over "
             f"{timing['workers']} worker(s) x {timing['wall_s']:.1f} s wall (eval {timing['eval_s']:.1f} s)"]
    for w in timing["per_worker"]:
        lines.append(f"  worker pid {w['pid']}: {w['cells']} cells, resident memory after its first cell "
                     f"{mb(w['rss_mb_first'])} MB, after its last {mb(w['rss_mb_last'])} MB, "
                     f"max {mb(w['rss_mb_max'])} MB")
    if verbose and timing.get("parts"):
        lines += breakdown_lines(timing)
    return lines


def breakdown_lines(timing: dict[str, Any]) -> list[str]:
    """The breakdown of a timing record: a header, one line per part (seconds, share of wall x workers, what
    it holds), and per worker its parts in seconds."""
    total = timing["wall_s"] * timing["workers"]
    lines = [f"where the time went ({timing['workers']} worker(s) x {timing['wall_s']:.1f} s wall = {total:.1f} s):"]
    for name, what in PARTS.items():
        seconds = timing["parts"].get(name, 0.0)
        lines.append(f"  {name:<8} {seconds:7.1f} s {timing['parts_share'].get(name, 0.0):6.1%}  {what}")
    for w in timing["per_worker"]:
        if "parts" in w:
            lines.append(f"  worker pid {w['pid']}: " + ", ".join(f"{k} {v:.1f}" for k, v in w["parts"].items()
                                                                  if abs(v) >= 0.05) + " (s)")
    return lines
