"""Where a grid's wall time goes: the step share, per-worker memory, and the breakdown of wall x workers.

A cell's ``status.json`` holds ``started_at`` and ``ended_at`` (Unix time) and ``time``: the seconds of
its span split into :data:`CELL_PARTS` (they add up to ``ended_at - started_at``). :func:`timing_record`
lays each worker's cells on the grid's own span (``grid_started_at`` .. ``grid_started_at + wall``): the
time before a worker's first cell (``start``: the worker's start and imports, or what is left of them when
a fork server imported them before the grid started), its cells' parts, the gaps between its cells, the
time from its last cell to the last cell of the grid (``idle``: waiting for the other workers) and from
there to the end (``shutdown``: the workers exit, the pool closes). A worker that replaced another (a pool that
lost one, or a second pool) continues its predecessor's line (:func:`worker_slots`). Every slot's line adds up
to the wall time, so the parts together add up to wall x workers; :data:`PARTS` names them in the order printed,
with what each one holds.

The grid's span starts after the runner's imports and planning and ends before its report: seen from
outside the process (``time gacbench bench ...``) the run is longer. :func:`process_start` reads when the
process started, :func:`startup_fields` adds the start-up (process start to the first cell) to a record and
:func:`outside_fields` the rest once the report is written: the process's wall time from its start and the
step share of it, always at most the grid's (:data:`OUTSIDE_KEYS`).
"""

from __future__ import annotations

import math
import os
import socket
import time
from typing import Any

#: The record's figures seen from outside the process, with what each one holds.
OUTSIDE_KEYS: dict[str, str] = {
    "process_started_at": "when the process started (Unix time)",
    "process_clock": "how that was read: 'proc' (Linux's /proc), else the import the caller names",
    "first_cell_started_at": "when the first cell of this run started (Unix time)",
    "last_cell_ended_at": "when the last cell of this run ended (Unix time)",
    "startup_s": "process start to the first cell's start: the runner's imports and planning, the workers' start",
    "report_s": "last cell to the written summary and figures: the workers' exit, the report",
    "outside_wall_s": "process start to the written summary and figures",
    "outside_step_share": "step_s / (outside_wall_s x workers)",
}

#: Where the outside figures are while they are not known yet (summary.json is written before its report ends).
OUTSIDE_PENDING = ("report_s, outside_wall_s and outside_step_share are measured after this summary's report is "
                   "written: see timing.json")

#: How far (s) a start read from /proc may lie after the caller's fallback moment (its clock ticks are 10 ms).
PROC_SLACK_S = 0.05

#: How far (s) a start read from /proc may lie before the command line's import (``gacbench.cli``): the
#: interpreter's start-up and the light imports before it take about 0.04 s. A start further back is another
#: program's: a shell that exec'd the command in place of itself (``bash -c 'cd DIR && gacbench bench ...'`` runs
#: its last command that way) keeps its process id and start, so /proc would count the shell's earlier commands.
EXEC_SLACK_S = 2.0

#: The parts of one cell's span, in status.json's ``time``.
CELL_PARTS = ("setup", "model", "engine", "eval", "steps", "trainer", "write", "other")

#: Every part of wall x workers, with what it holds.
PARTS: dict[str, str] = {
    "start": "worker start and imports (what is left of them)",
    "setup": "objective, callbacks, Trainer (no model load)",
    "model": "model load (and any warm-start build)",
    "engine": "rollout engine start-up",
    "eval": "evaluations (the objective's timed_evals: its metric, GRPO's policy reward)",
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


def proc_started_at() -> float | None:
    """This process's start (Unix time) on Linux: its start in clock ticks after boot (``/proc/self/stat``,
    field 22, ``SC_CLK_TCK`` ticks a second) against the seconds since boot now (``/proc/uptime``), both
    to 0.01 s (``/proc/stat``'s ``btime``, the boot's Unix time, is whole seconds); None where they cannot be
    read."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        now = time.time()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # fields after the command name start at field 3
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return now - (uptime - ticks / hz)


def process_start(fallback: float, fallback_clock: str, max_before_s: float | None = None) -> dict[str, Any]:
    """``{"process_started_at", "process_clock"}``: the start :func:`proc_started_at` reads (``"proc"``; at
    most ``fallback``, a moment the process reached after it started), or ``fallback`` itself, named
    ``fallback_clock``, where /proc cannot be read, reads a start more than :data:`PROC_SLACK_S` after it, or
    (given ``max_before_s``, for a fallback taken right after the interpreter's start: :data:`EXEC_SLACK_S`) one
    more than ``max_before_s`` before it, which belongs to a program that exec'd this one."""
    proc = proc_started_at()
    if (proc is None or proc > fallback + PROC_SLACK_S
            or (max_before_s is not None and proc < fallback - max_before_s)):
        return {"process_started_at": fallback, "process_clock": fallback_clock}
    return {"process_started_at": min(proc, fallback), "process_clock": "proc"}


def startup_fields(results: list[dict], started: dict[str, Any]) -> dict[str, Any]:
    """The outside figures of a run's timing record known before its report (:data:`OUTSIDE_KEYS`): ``started``
    (:func:`process_start`), the first cell's start and the last cell's end among ``results`` (the cells run,
    None if none started), ``startup_s``, and ``report_s``, ``outside_wall_s`` and ``outside_step_share`` as
    None with ``outside_pending`` saying where they are (:func:`outside_fields` fills them), and the process's
    ``pid`` and ``host`` (a record still pending whose process is gone was stopped before its report)."""
    starts = [r["started_at"] for r in results if _finite(r.get("started_at"))]
    ends = [r["ended_at"] for r in results if _finite(r.get("ended_at"))]
    first, last = (min(starts), max(ends)) if starts and ends else (None, None)
    return {**started, "pid": os.getpid(), "host": socket.gethostname(), "first_cell_started_at": first,
            "last_cell_ended_at": last,
            "startup_s": None if first is None else first - started["process_started_at"],
            "report_s": None, "outside_wall_s": None, "outside_step_share": None, "outside_pending": OUTSIDE_PENDING}


def stopped_before_report(timing: dict[str, Any]) -> bool:
    """Whether ``timing`` is a record still waiting for its outside figures whose process is no longer running on
    this host: a run stopped (killed, interrupted) before its report, which no later run completes. A record of
    another host (or without one) is not judged."""
    from gacbench.jsonio import pid_alive

    pid = timing.get("pid")
    return (bool(timing.get("outside_pending")) and isinstance(pid, int) and timing.get("host") == socket.gethostname()
            and pid != os.getpid() and not pid_alive(pid))


def outside_fields(timing: dict[str, Any], ended_at: float) -> dict[str, Any]:
    """``timing`` (a record with :func:`startup_fields`) completed at ``ended_at`` (Unix time, after the report):
    ``report_s`` (from the last cell), ``outside_wall_s`` (from the process's start) and ``outside_step_share``
    (``step_s`` over ``outside_wall_s`` x ``workers``), without ``outside_pending``."""
    out = {k: v for k, v in timing.items() if k != "outside_pending"}
    wall = ended_at - timing["process_started_at"]
    last = timing.get("last_cell_ended_at")
    out["report_s"] = None if last is None else ended_at - last
    out["outside_wall_s"] = wall
    workers = timing.get("workers") or 0
    out["outside_step_share"] = (timing["step_s"] / (wall * workers)
                                 if timing.get("step_share") is not None and wall > 0 and workers > 0 else None)
    return out


def cell_parts(seconds: dict[str, float], span: float) -> dict[str, float]:
    """``seconds`` (measured parts of a cell, keys of :data:`CELL_PARTS` but ``other``) completed to its span:
    ``other`` is what the measured parts leave of ``span``, so the parts add up to ``span``."""
    parts = {k: float(seconds.get(k, 0.0)) for k in CELL_PARTS if k != "other"}
    parts["other"] = span - sum(parts.values())
    return parts


def worker_slots(runs: dict[int, list[dict]]) -> list[list[int]]:
    """The pool's worker slots: lists of worker pids, each pid after the one it replaced. A grid whose pool lost a
    worker, or started a second pool, has more pids than workers; a pid whose first cell starts after another's
    last cell ended takes the slot that came free first, so that a slot's pids lie one after the other on the
    grid's span. ``runs``: each pid's cells, sorted by start."""
    slots: list[list[int]] = []
    for pid in sorted(runs, key=lambda p: runs[p][0]["started_at"]):
        first = runs[pid][0]["started_at"]
        free = [s for s in slots if runs[s[-1]][-1]["ended_at"] <= first]
        if free:
            min(free, key=lambda s: runs[s[-1]][-1]["ended_at"]).append(pid)
        else:
            slots.append([pid])
    return slots


def breakdown(results: list[dict], grid_started_at: float, wall: float, workers: int) -> dict[str, Any]:
    """``{"parts": {part: seconds}, "per_worker": {pid: {part: seconds}}}`` over the cells of ``results`` that a
    worker ran in this grid (``started_at`` at or after ``grid_started_at``). The pids are laid in worker slots
    (:func:`worker_slots`): a pid that replaced another counts as ``start`` the time from its predecessor's last
    finished cell to its own first (the replacement's start, and the cell its predecessor died in), and only a
    slot's last pid waits (``idle``) and shuts down. Per slot the parts add up to ``wall``; ``workers`` minus the
    slots seen are idle throughout."""
    end = grid_started_at + wall
    runs: dict[int, list[dict]] = {}
    for r in results:
        if r.get("worker_pid") is None or not _finite(r.get("started_at")) or not _finite(r.get("ended_at")):
            continue
        if r["started_at"] < grid_started_at:  # a stored result of an earlier run
            continue
        runs.setdefault(int(r["worker_pid"]), []).append(r)
    for cells in runs.values():
        cells.sort(key=lambda r: r["started_at"])
    slots = worker_slots(runs)
    before = {pid: (runs[slot[i - 1]][-1]["ended_at"] if i else grid_started_at)
              for slot in slots for i, pid in enumerate(slot)}
    per_worker: dict[int, dict[str, float]] = {}
    for pid, cells in runs.items():
        parts = dict.fromkeys(PARTS, 0.0)
        parts["start"] = cells[0]["started_at"] - before[pid]
        for prev, cur in zip(cells, cells[1:]):
            parts["gaps"] += cur["started_at"] - prev["ended_at"]
        for r in cells:
            span = r["ended_at"] - r["started_at"]
            measured = r.get("time") if isinstance(r.get("time"), dict) else {"other": span}
            for k, v in cell_parts({k: v for k, v in measured.items() if k != "other" and _finite(v)}, span).items():
                parts[k] += v
        per_worker[pid] = parts
    last = max((cells[-1]["ended_at"] for cells in runs.values()), default=end)
    for slot in slots:
        parts = per_worker[slot[-1]]
        parts["idle"] = last - runs[slot[-1]][-1]["ended_at"]
        parts["shutdown"] = end - last
    total = dict.fromkeys(PARTS, 0.0)
    for parts in per_worker.values():
        for k, v in parts.items():
            total[k] += v
    total["idle"] += max(0, workers - len(slots)) * wall
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
    if timing.get("outside_step_share") is not None:
        lines[0] = (f"step share {timing['step_share']:.0%} of the grid's wall, {timing['outside_step_share']:.0%} of "
                    f"the process's: {timing['step_s']:.1f} s of optimizer steps over {timing['workers']} worker(s) "
                    f"x {timing['wall_s']:.1f} s grid wall, {timing['outside_wall_s']:.1f} s from process start to "
                    f"the written report (start-up {_seconds(timing.get('startup_s'))}, report "
                    f"{_seconds(timing.get('report_s'))}; eval {timing['eval_s']:.1f} s)")
    for w in timing["per_worker"]:
        lines.append(f"  worker pid {w['pid']}: {w['cells']} cells, resident memory after its first cell "
                     f"{mb(w['rss_mb_first'])} MB, after its last {mb(w['rss_mb_last'])} MB, "
                     f"max {mb(w['rss_mb_max'])} MB")
    if verbose and timing.get("parts"):
        lines += breakdown_lines(timing)
    return lines


def _seconds(x: float | None) -> str:
    return "?" if x is None else f"{x:.1f} s"


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
    if timing.get("outside_wall_s") is not None:
        lines.append(f"outside the grid's span: {timing['outside_wall_s']:.1f} s from process start to the written "
                     f"report = start-up {_seconds(timing.get('startup_s'))} before the first cell + the cells' span "
                     f"+ report {_seconds(timing.get('report_s'))} after the last cell")
    return lines
