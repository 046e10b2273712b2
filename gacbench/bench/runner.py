"""``gacbench bench``: a grid of (task, method, staleness, seed) cells, each a stored run.

This module expands a suite into cells, orders them and runs the grid (:func:`run_grid`, :func:`main`);
the executors that run the pending cells (in this process, a local process pool, or Ray actors; the
dependency tracking of reference cells; the progress display) are in :mod:`gacbench.bench.executors`.
Workers live for the whole grid and run cell after cell, so a worker's imports, and the rollout engine
an LLM objective keeps per process, are paid once per worker rather than once per cell; pending cells
are ordered so that cells sharing an objective and parameters (hence an engine configuration) run back
to back. Local workers exit when the runner's process does.

A cell whose directory records it as done (with complete files: :func:`gacbench.bench.cell.done_problem`)
is never rerun, so an interrupted grid resumes where it stopped; a done cell computed with other
settings (objective, parameters, steps, method), or a done cell of the same task stored with another
objective, parameters or steps, is refused up front rather than reused or mixed in. A failed or
incomplete cell is recomputed, and a failed cell is recorded with its error and the grid goes on.
Each cell is claimed before it runs (:func:`gacbench.bench.cell.claim`), so several runners can share one
output directory: a cell another runner holds is waited for at the end and reused, and the summary is
written by one process at a time. Done cells stored by another environment
(:func:`gacbench.provenance.environment_key`) are counted in a note and reused, or recomputed with
``--rerun-other-versions``. SIGINT or SIGTERM stops the workers at once, writes the summary of the cells
stored and exits 130 or 143; a full disk ends the run with one line naming the file.
The suite, the command-line lists and the parameters are checked before anything runs; bad input
raises :class:`gacbench.cli.UsageError` naming the option or file. Summary tables and figures are
then built from the stored runs alone (:mod:`gacbench.bench.report`), over every cell in the output
directory (a run of a subset of a grid does not shrink the summary). A cell whose method needs a
reference cell (``gac-calibrated``: the synchronous cell of its task and seed) waits until that cell
is done, then runs with the calibration computed from it (:func:`reference_calibration`,
stored in its ``config.json``); the reference must be in the grid or already done in the output
directory, and a failed reference fails its dependents without running them. Each
run that executes cells writes ``timing.json``: the wall time, cells per minute, the step share
(optimizer-step seconds of the cells run / (wall time x workers)) and each worker's resident memory
after each of its cells; :func:`main` writes it again once the summary and figures are written, with the
run seen from outside the process: its wall time from the process's start and the step share of it
(:mod:`gacbench.bench.timing`).
"""

from __future__ import annotations

import errno
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console

import gacbench.llm  # noqa: F401  (registers the LLM objectives, e.g. grpo)
from gacbench.bench.cell import (
    CLAIMED,
    TASK_IDENTITY_KEYS,
    CellMismatchError,
    cell_dir,
    cell_provenance,
    engine_key,
    identity_diff,
    show_change,
    stored_diff,
    stored_done,
    stored_done_files,
    stored_environment,
    stored_outside,
    stored_state,
    summary_lock,
    write_json,
)
from gacbench.bench.executors import (  # noqa: F401  (reference_calibration re-exported)
    Dependencies,
    Display,
    GridInterrupted,
    WorkerDied,
    check_stop,
    reference_calibration,
    report_failed,
    request_stop,
    run_local,
    run_pool,
    run_ray,
    stop_requested,
    wait_for_claims,
)
from gacbench.bench.theta0 import check_theta0
from gacbench.bench.timing import (  # noqa: F401  (timing_record re-exported)
    outside_fields,
    process_start,
    startup_fields,
    timing_lines,
    timing_record,
)
from gacbench.bench.validate import (  # noqa: F401  (SUITES_DIR, load_suite, check_params: importable from here)
    ABLATION,
    SEED_MAX,
    SUITES_DIR,
    _is_int,
    _no_repeats,
    check_params,
    load_suite,
    merge_params,
    parse_int_list,
    parse_list,
    parse_methods,
    parse_params,
)
from gacbench.jsonio import disk_full, disk_full_message, remove_stray_temporaries
from gacbench.methods import (
    parse_method,
    reference_cell,
    sync_cell,
)
from gacbench.provenance import environment_key
from gacbench.usage import UsageError, check_output_dir, defer_during_import

_IMPORTED_AT = time.time()  # the start-up clock of a caller that did not read its process's start


def expand_cells(suite: dict, methods: list[str] | None = None, staleness: list[int] | None = None,
                 seeds: list[int] | None = None, tasks: list[str] | None = None) -> list[dict]:
    """The grid as a list of cell dicts. ``sync`` runs once at s = 0; stale methods run at each s > 0. The suite's
    threshold-ablation cells come with the suite's own method list, or alone with the keyword ``ablation`` in
    ``methods``. A task may narrow the grid for itself: ``methods`` (its methods instead of the suite's, and no
    ablation cells),
    ``staleness`` (its staleness values, within the grid's) and ``extra_staleness`` (the staleness values of its
    ``extra_methods``, within its own); and ``on_policy`` lists stale methods that also run at s = 0 (synchronous
    rollouts with the method's callbacks: the on-policy control of a stabilizer), when the grid has s = 0 and,
    with an explicit ``methods``, only those it names."""
    explicit = methods is not None
    methods = methods or suite["methods"]
    with_ablation = methods == suite["methods"] or ABLATION in methods
    methods = [m for m in methods if m != ABLATION]
    staleness = suite["staleness"] if staleness is None else staleness
    seeds = suite["seeds"] if seeds is None else seeds
    tasks = tasks or list(suite["tasks"])
    for s in staleness:
        if not _is_int(s) or s < 0:
            raise UsageError(f"staleness {s!r} must be a non-negative integer")
    for t in tasks:
        if t not in suite["tasks"]:
            raise UsageError(f"--tasks: task {t!r} is not in the suite; its tasks: {', '.join(suite['tasks'])}")
    _no_repeats("--tasks", list(tasks))
    _no_repeats("--seeds", list(seeds))
    _no_repeats("--staleness", list(staleness))
    _no_repeats("--methods", list(methods))
    def base(task: str) -> dict:
        spec = suite["tasks"][task]
        return {"task": task, "objective": spec["objective"], "params": spec.get("params", {}),
                "steps": spec.get("steps", suite["steps"]), "warmup": suite.get("warmup", 0),
                **({"assumptions": suite["assumptions"]} if suite.get("assumptions") else {})}

    def restrict(values: list, own: list | None) -> list:
        # a task's own list (methods, staleness, extra_staleness) narrows the grid's; None keeps the grid's
        return list(values) if own is None else [x for x in values if x in own]

    cells = []
    for task in tasks:
        spec = suite["tasks"][task]
        task_methods = list(spec.get("methods", suite["methods"]))
        extra_all = [x for x in spec.get("extra_methods", []) if x not in task_methods]
        if explicit:  # a selection within the task's grid: an extra method keeps its own staleness values
            own = [m for m in methods if (m in task_methods if "methods" in spec else m not in extra_all)]
            extra = [m for m in methods if m in extra_all]
        else:
            own = task_methods if "methods" in spec else list(methods)
            extra = extra_all
        task_s = restrict(staleness, spec.get("staleness"))
        extra_s = restrict(task_s, spec.get("extra_staleness"))
        for m in list(own) + extra:
            method, _ = parse_method(m)
            grid_s = extra_s if m in extra else task_s
            for s in ([0] if not method.stale else [x for x in grid_s if x > 0]):
                if not method.stale and 0 not in grid_s:
                    continue
                for seed in seeds:
                    cells.append({**base(task), "method": m, "staleness": s, "seed": seed})
        if 0 in task_s:
            for m in spec.get("on_policy", []):
                if not explicit or m in methods:
                    cells += [{**base(task), "method": m, "staleness": 0, "seed": seed} for seed in seeds]
    ablation = suite.get("ablation")
    if ablation and with_ablation:
        for task in [t for t in tasks if "methods" not in suite["tasks"][t]]:  # own methods: those cells only
            for lo in ablation["c_low"]:
                for hi in ablation["c_high"]:
                    if lo >= hi:
                        continue
                    method = f"{ablation.get('method', 'gac')}(c_low={lo},c_high={hi})"
                    clash = [c for c in cells if c["task"] == task and c["method"] == method
                             and c["staleness"] == ablation["staleness"]]
                    if clash:
                        raise UsageError(f"method {method!r} at staleness {ablation['staleness']} is also a cell of "
                                         "the suite's threshold ablation (its c_low x c_high grid); leave it out of "
                                         "the methods: the ablation runs it")
                    for seed in seeds:
                        cells.append({**base(task), "method": method, "staleness": ablation["staleness"],
                                      "seed": seed, "ablation": True})
    check_lag(cells)
    return cells


def left_out(suite: dict, methods: list[str] | None, cells: list[dict]) -> list[str]:
    """One line per method of the grid (``methods``, else the suite's) that has no cell in ``cells``, saying why:
    ``sync`` runs only at staleness 0 and the stale methods only at a staleness > 0, so a ``--staleness`` list
    without 0 leaves sync out and one of 0 alone leaves the stale methods out; a task's own method list may
    leave a method out too."""
    asked = [m for m in (methods or suite["methods"]) if m != ABLATION]
    present = {c["method"] for c in cells}
    grid_s = sorted({int(c["staleness"]) for c in cells})
    lines = []
    for m in asked:
        if m in present:
            continue
        stale = parse_method(m)[0].stale
        if not stale and 0 not in grid_s:
            why = "it runs only at staleness 0, which the staleness list leaves out (add 0 to --staleness to run it)"
        elif stale and not any(s > 0 for s in grid_s):
            why = "it runs only at a staleness > 0, and the staleness list has none"
        else:
            why = "no task of the grid runs it (a task's own methods: list leaves it out)"
        lines.append(f"method {m} is left out of this grid: {why}")
    return lines


def check_lag(cells: list[dict]) -> None:
    """Refuse a staleness that no step of its cell would reach: the lag at step t is min(t, s), and t < steps,
    so a cell with s >= steps would be labelled s while its gradients are never more than steps - 1 old."""
    for c in cells:
        if parse_method(c["method"])[0].stale and c["staleness"] >= c["steps"]:
            raise UsageError(f"--staleness: staleness {c['staleness']} of task {c['task']!r} is not below its "
                             f"{c['steps']} steps: the lag at step t is at most t, so no step would be "
                             f"{c['staleness']} steps stale; use staleness values below {c['steps']}, or more steps "
                             "in the suite")


def is_done(root: Path, cell: dict) -> bool:
    return stored_done(root, cell) is not None


def order_cells(cells: list[dict]) -> list[dict]:
    """``cells`` with those of equal :func:`engine_key` back to back, groups in order of first appearance, and
    within a group the longest first, so that the workers finish together (longest processing time first):
    more steps first, then stale cells (s > 0: a stale step also recomputes the behaviour log-probs, or swaps
    in a stale iterate) before synchronous ones. A cell that another cell of the group needs as its reference
    (:func:`gacbench.methods.reference_cell`) goes before all of them, so that its dependents are released
    early. Cells of equal rank keep their order."""
    def key(c: dict) -> tuple:
        return c.get("task"), c.get("method"), c.get("staleness"), c.get("seed")

    refs = {key(r) for r in (reference_cell(c) for c in cells if "method" in c) if r is not None}

    def rank(c: dict) -> tuple[bool, int, bool]:
        return key(c) not in refs, -int(c.get("steps", 0)), not int(c.get("staleness", 0)) > 0

    groups: dict[tuple[str, str], list[dict]] = {}
    for c in cells:
        groups.setdefault(engine_key(c), []).append(c)
    return [c for group in groups.values() for c in sorted(group, key=rank)]


def check_stored(cells: list[dict], root: Path, stored: dict[Path, tuple[dict, Any]] | None = None) -> None:
    """Refuse a grid whose done cells in ``root`` were computed with other settings (see cell.identity_diff),
    and a grid whose task's objective, parameters or steps differ from a done cell of the same task stored in
    ``root`` under another method, staleness or seed: one directory holds one setting per task. ``stored``: the
    grid's done cells as :func:`stored_done_files` read them, else they are read here."""
    mismatched: list[tuple[Path, str, dict]] = []
    grid_dirs = {cell_dir(root, c): c for c in cells}
    stored = stored_done_files(root, cells) if stored is None else stored
    for c in cells:
        found = stored.get(cell_dir(root, c))
        if found is not None:
            diff = stored_diff(root, c, *found)
            if diff:
                mismatched.append((cell_dir(root, c), c["task"], diff))
    others = 0
    first = {}
    for c in cells:
        first.setdefault(c["task"], c)
    dirs = set(grid_dirs)
    for task, c in first.items():
        for d, other in stored_outside(root, task, dirs, stored):
            diff = identity_diff(other, c, TASK_IDENTITY_KEYS)
            if diff:
                mismatched.append((d, task, diff))
                others += 1
    if not mismatched:
        return
    changes: dict[str, int] = {}
    for _, _, diff in mismatched:
        for key, (old, new) in diff.items():
            change = show_change(key, old, new)
            changes[change] = changes.get(change, 0) + 1
    lines = [f"{root} holds {len(mismatched)} finished cell(s) computed with other settings than this run asks for: "
             + "; ".join(f"{change}, in {n} cell(s)" for change, n in changes.items()) + "."]
    dirs = [str(d) for d, _, _ in mismatched]
    lines.append("Cells: " + ", ".join(dirs[:3]) + (f" and {len(dirs) - 3} more." if len(dirs) > 3 else "."))
    tasks = sorted({task for _, task, _ in mismatched})
    if others:
        lines.append(f"{others} of them are cells of task(s) {', '.join(tasks)} outside this grid (another method, "
                     "staleness or seed): the cells of one task in one directory share its objective, parameters and "
                     "steps, since the summary averages them over seeds and compares them across methods.")
    lines.append("A finished cell is reused only for the same task, objective, parameters, steps, warm-up, method, "
                 "staleness and seed. Fix: use "
                 "another --out, or delete the stored cells to recompute them with these settings ("
                 + "; ".join(f"rm -r {root / 'cells' / t}" for t in tasks) + " removes every cell of a task).")
    raise CellMismatchError(" ".join(lines))  # one line: gacbench prints it and exits 2


def check_references(cells: list[dict], root: Path) -> None:
    """Refuse a grid with a cell whose reference cell (``gac-calibrated``: sync, s = 0, same task and seed) is
    neither in the grid nor done in ``root``."""
    grid = {cell_dir(root, c) for c in cells}
    for c in cells:
        ref = reference_cell(c)
        if ref is not None and cell_dir(root, ref) not in grid and not is_done(root, ref):
            raise UsageError(f"method {c['method']!r} (task {c['task']!r}, seed {c['seed']}) calibrates from the "
                             f"synchronous cell of the same task and seed, which is neither in this grid nor done in "
                             f"{root}: include sync in --methods and 0 in --staleness (or run it into --out first)")


def worker_threads(workers: int, threads: int | None = None) -> int:
    """The torch thread count of each worker of a grid run with ``workers`` workers: ``threads`` when given,
    else the machine's cores shared out (``cpu_count // workers``, at least 1). It is part of a cell's
    environment (:mod:`gacbench.provenance`): the numbers of a cell depend on it."""
    if threads is not None:
        if threads < 1:
            raise UsageError(f"--threads {threads} must be >= 1")
        return threads
    return max(1, (os.cpu_count() or 1) // workers)


def other_environments(cells: list[dict], root: Path, threads: int,
                       stored: dict[Path, tuple[dict, Any]] | None = None) -> dict[str, list[dict]]:
    """The done cells of ``cells`` stored in ``root`` by another environment than this run's (this process's
    :func:`gacbench.bench.cell.cell_provenance` with the workers' ``threads``), by their environment key
    (``unrecorded`` for a cell stored without provenance). ``stored`` as :func:`check_stored`."""
    here: dict[str, str] = {}  # method -> this run's key for its cells (a plug-in's code hashed once per method)
    stored = stored_done_files(root, cells) if stored is None else stored
    out: dict[str, list[dict]] = {}
    for c in cells:
        found = stored.get(cell_dir(root, c))
        if found is not None:
            key = stored_environment(root, c, found[1])
            if c["method"] not in here:
                here[c["method"]] = environment_key({**cell_provenance(c), "threads": threads})
            if key != here[c["method"]]:
                out.setdefault(key, []).append(c)
    return out


def run_grid(cells: list[dict], out: str | os.PathLike, workers: int = 1, executor: str = "local",
             console: Console | None = None, rerun_other_versions: bool = False,
             threads: int | None = None, started: dict[str, Any] | None = None,
             stored: dict[Path, tuple[dict, Any]] | None = None) -> dict[str, Any]:
    """Run every cell not yet done, each worker with :func:`worker_threads` torch threads; returns timing
    figures (also written to ``out/timing.json`` when a cell ran). Raises CellMismatchError, before running
    anything, if a done cell in ``out`` was computed with other settings than its cell in ``cells`` (or, for
    another cell of the same task, with another objective, parameters or steps).

    ``started`` (:func:`gacbench.bench.timing.process_start`) adds the start-up figures to the timing
    (:func:`gacbench.bench.timing.startup_fields`). ``stored``: the grid's done cells in ``out`` as
    :func:`stored_done_files` read them (``gacbench bench`` reads them once, before :func:`check_theta0`), else
    they are read here, once for the checks before the grid runs.

    Done cells stored by another environment are counted in a notice and reused, or recomputed with
    ``rerun_other_versions``. A cell that another runner on ``out`` holds is left to it, waited for at the
    end and then reused (counted in ``skipped_done``), or run here if its holder ended without storing it."""
    if workers < 1:
        raise UsageError(f"--workers {workers} must be >= 1")
    if executor not in ("local", "ray"):
        raise UsageError(f"--executor {executor!r} is not 'local' or 'ray'")
    root = check_output_dir("--out", out)
    stored = stored_done_files(root, cells) if stored is None else stored
    check_stored(cells, root, stored)
    check_references(cells, root)
    console = console or Console()
    threads = worker_threads(workers, threads)
    other = other_environments(cells, root, threads, stored)
    if other:
        n = sum(len(v) for v in other.values())
        kinds = ", ".join(f"{len(v)} {'unrecorded' if k == 'unrecorded' else 'from ' + k}" for k, v in other.items())
        console.print(f"[yellow]note[/]: {n} stored done cell(s) of this grid come from another environment "
                      f"({kinds}); " + ("they are recomputed (--rerun-other-versions)" if rerun_other_versions else
                                        "they are reused (--rerun-other-versions recomputes them)"), highlight=False)
    rerun = {cell_dir(root, c) for v in other.values() for c in v} if rerun_other_versions else set()
    pending = [c for c in cells if cell_dir(root, c) in rerun or cell_dir(root, c) not in stored]
    pending = order_cells(pending)  # reference cells first within their engine group, then the longest
    for c in pending:  # a cell whose stored files claim a finished run they do not hold: say why it runs again
        _, problem = stored_state(root, c)
        if problem is not None:
            console.print(f"[yellow]recomputing[/] {cell_dir(root, c)}: {problem}", highlight=False, soft_wrap=True)
    done_before = len(cells) - len(pending)
    deps = Dependencies(pending, root)
    used = 1 if executor == "local" and workers == 1 else min(workers, len(pending))
    display = Display(len(cells), done_before, console)
    t0, grid_started_at = time.perf_counter(), time.time()
    results: list[dict] = []
    with display.progress:
        results += report_failed(deps, display)
        while deps.ready:
            if executor == "ray":
                results += run_ray(deps, root, used, threads, display, rerun_other_versions)
            elif workers == 1:
                results += run_local(deps, root, threads, display, rerun_other_versions)
            else:
                results += run_pool(deps, root, used, threads, display, rerun_other_versions)
            claimed = deps.take_claimed()
            if claimed:  # held by another runner on this --out: wait for it, then reuse what it stored
                results += wait_for_claims(root, claimed, deps, display)
    wall = time.perf_counter() - t0
    ran = [r for r in results if r.get("status") != CLAIMED and not r.get("reused")]
    reused = [r for r in results if r.get("reused")]
    failed = [r for r in ran + reused if r.get("status") != "done"]
    for line in failure_lines(failed):
        console.print(f"[red]failed cell[/]: {line}", highlight=False)
    skipped = done_before + len([r for r in reused if r.get("status") == "done"])
    timing = {"cells": len(cells), "ran": len(ran), "skipped_done": skipped, "failed": len(failed),
              "executor": executor, **timing_record(ran, wall, used if ran else 0, grid_started_at)}
    if started is not None:
        timing.update(startup_fields(ran, started))
    if ran:
        write_json(root / "timing.json", timing)
    return timing


def main(args, started: dict[str, Any] | None = None) -> int:
    """``gacbench bench``. ``started``: when the process started (:func:`gacbench.bench.timing.process_start`;
    default: read from /proc, else this module's import). ``timing.json`` is written twice: by the grid with
    the start-up figures, which the report copies into ``summary.json``, and after the report with the figures
    from the process's start to the written report (:func:`gacbench.bench.timing.outside_fields`).

    SIGINT and SIGTERM end it with one line and exit status 128 + the signal in every phase: while the cells
    run (the summary of the stored cells is written, :func:`_run`), and before them or while the summary is
    written (the line says where it stopped and what to run)."""
    restore = _stop_on_signals()
    phase = ["before any cell ran"]
    try:
        return _run(args, started, phase)
    except GridInterrupted as stop:
        name = signal.Signals(stop.signum).name
        print(f"gacbench bench: stopped by {name} {phase[0]}; {phase[1] if len(phase) > 1 else 'nothing was run'}",
              flush=True)
        return 128 + stop.signum
    finally:
        restore()


def _run(args, started: dict[str, Any] | None, phase: list[str]) -> int:
    """The body of :func:`main`; ``phase`` holds where a signal outside the grid stops it, and what to run."""
    started = started or process_start(_IMPORTED_AT, "runner-import")
    console = Console()
    suite = load_suite(args.suite)
    methods = parse_methods(args.methods, suite, args.suite)
    cells = expand_cells(
        suite,
        methods=methods,
        staleness=parse_int_list("--staleness", args.staleness, 0),
        seeds=parse_int_list("--seeds", args.seeds, 0, SEED_MAX),
        tasks=parse_list("--tasks", args.tasks),
    )
    if not cells:
        raise UsageError("the grid has no cells: sync runs only at staleness 0 and the other methods only at a "
                         "staleness > 0; check --methods and --staleness")
    for line in left_out(suite, methods, cells):
        console.print(f"[yellow]note[/]: {line}", highlight=False)
    overrides = parse_params(getattr(args, "param", None) or [])
    for c in cells:
        c["params"] = merge_params(c["params"], overrides)
    check_params(cells, overrides)
    out = check_output_dir("--out", args.out)
    stored = stored_done_files(out, cells)  # read once for check_theta0 and run_grid's checks
    check_theta0(suite, cells, out, stored)
    remove_stray_temporaries(out)
    threads = worker_threads(args.workers, getattr(args, "threads", None))
    console.print(f"suite [bold]{suite.get('name', args.suite)}[/]: {len(cells)} cells -> {out}  "
                  f"(workers={args.workers}, threads={threads} each, executor={args.executor})")
    if not any(c["method"] == "sync" for c in cells) and not any(is_done(out, sync_cell(c)) for c in cells):
        console.print("[yellow]note[/]: no sync cell in this grid (sync needs staleness 0) or done in --out: the "
                      "recovered shares cannot be computed")
    writing_summary = ["while writing the summary", f"the cells are stored: `gacbench report {out}` writes it"]
    try:
        timing = run_grid(cells, out, args.workers, args.executor, console,
                          rerun_other_versions=getattr(args, "rerun_other_versions", False), threads=threads,
                          started=started, stored=stored)
        check_stop()  # a stop whose raise was lost in the grid's last cell
    except GridInterrupted as stop:
        done = sum(is_done(out, c) for c in cells)
        by = signal.Signals(stop.signum).name + (f" sent to {stop.where}" if stop.where else "")
        print(f"gacbench bench: stopped by {by}: {done} of {len(cells)} cells done and "
              f"stored, the cells in flight will be recomputed; resume with: {resume_command(args)}", flush=True)
        phase[:] = writing_summary
        _write_summary(out, cells, suite.get("families"))
        return 128 + stop.signum
    except WorkerDied as exc:  # killed (most often by the out-of-memory killer): the stored cells stay
        print(f"gacbench bench: {exc}", flush=True)
        phase[:] = writing_summary
        _write_summary(out, cells, suite.get("families"))
        return 1
    except Exception as exc:
        _raise_if_disk_full(exc)
        raise
    phase[:] = writing_summary
    report = _write_summary(out, cells, suite.get("families"))
    if timing["ran"]:  # the run from its process's start to here: after summary.json, so only in timing.json
        timing = outside_fields(timing, time.time())
        try:
            write_json(out / "timing.json", timing)
        except OSError as exc:
            _raise_if_unwritable(exc)
            raise
    for line in report["incomplete"]:
        console.print(f"[yellow]incomplete cell[/]: {line}", highlight=False)
    console.print(
        f"ran {timing['ran']} cells ({timing['skipped_done']} already done, {timing['failed']} failed) in "
        f"{timing['wall_s']:.1f} s: {timing['cells_per_min']:.1f} cells/min; median framework share of step time "
        f"{report['overhead_share_median']:.0%}"
    )
    for line in timing_lines(timing, verbose=getattr(args, "verbose", False)):
        console.print(line, highlight=False)
    console.print(f"wrote {out / 'summary.json'}, {out / 'summary.md'} and {len(report['figures'])} figures "
                  f"({len(report['summary']['cells'])} stored cells)")
    return 1 if timing["failed"] else 0


def failure_lines(failed: list[dict], most: int = 10) -> list[str]:
    """One line per failed cell of a run (its place in the grid and the error's first line, as status.json
    records it), at most ``most`` and then a count of the rest."""
    lines = []
    for status in failed[:most]:
        c = status.get("cell") or {}
        where = f"{c.get('task')}/{c.get('method')}/s{c.get('staleness')}/seed{c.get('seed')}"
        error = (status.get("error") or status.get("status") or "no error recorded").strip().splitlines()
        lines.append(f"{where}: {error[0][:400] if error else ''}")
    if len(failed) > most:
        lines.append(f"... and {len(failed) - most} more (each cell's status.json holds its error and traceback)")
    return lines


DISK_FULL_FIX = "free space (or raise the quota) and rerun the same command: the finished cells are kept"


def _raise_if_disk_full(exc: BaseException, fix: str = DISK_FULL_FIX) -> None:
    """A full disk or quota behind ``exc`` becomes a UsageError naming the path that could not be written and
    ``fix``."""
    full = disk_full(exc)
    if full is not None:
        raise UsageError(disk_full_message(full, fix)) from None


#: the errors of a folder or file this process may not write: permissions, a read-only file system
UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def _raise_if_unwritable(exc: BaseException, fix: str = DISK_FULL_FIX) -> None:
    """A full disk (:func:`_raise_if_disk_full`, its fix ``fix``), a read-only folder or a denied permission
    behind ``exc`` becomes a one-line UsageError naming the path and the cause."""
    _raise_if_disk_full(exc, fix)
    if isinstance(exc, OSError) and exc.errno in UNWRITABLE:
        raise UsageError(disk_full_message(exc, "make the folder writable, or copy the bench directory to a "
                                                "writable place and run there")) from None


def _write_summary(out: Path, cells: list[dict] | None, families: dict | None = None) -> dict[str, Any]:
    """:func:`gacbench.bench.report.build_report` of ``out`` with the suite's multiplicity ``families``, one process
    at a time per directory; a full disk is a UsageError."""
    from gacbench.bench.report import build_report

    try:
        with summary_lock(out):
            return build_report(out, cells=cells, families=families)  # every cell in --out, not only this grid's
    except OSError as exc:
        _raise_if_unwritable(exc)
        raise


def report_command(args) -> int:
    """``gacbench report DIR``: :func:`gacbench.bench.report.main` with the stray temporaries of dead processes
    removed first, one summary writer at a time per directory, and a full disk, a read-only folder or a denied
    permission as a one-line UsageError naming the path."""
    from gacbench.bench.report import main as report_main

    root = Path(args.dir)
    if not (root / "cells").is_dir():
        return report_main(args)  # refused there, naming the folder
    try:
        remove_stray_temporaries(root)
        with summary_lock(root):
            return report_main(args)
    except OSError as exc:
        _raise_if_unwritable(exc, "free space (or raise the quota) and rerun gacbench report: the cells are intact")
        raise


def resume_command(args) -> str:
    """The ``gacbench bench`` command line that reruns this grid into the same --out."""
    parts = ["gacbench", "bench", "--suite", args.suite, "--out", str(args.out)]
    for option in ("methods", "staleness", "seeds", "tasks"):
        if getattr(args, option, None) is not None:
            parts += [f"--{option}", getattr(args, option)]
    for item in getattr(args, "param", None) or []:
        parts += ["--param", item]
    parts += ["--workers", str(args.workers)]
    if getattr(args, "threads", None) is not None:
        parts += ["--threads", str(args.threads)]
    parts += ["--executor", args.executor]
    if getattr(args, "rerun_other_versions", False):
        parts.append("--rerun-other-versions")
    return shlex.join(parts)


def _stop_on_signals():
    """Make SIGINT and SIGTERM stop the grid from this (main) thread, once: the handler records the signal
    (:func:`request_stop`) and raises :class:`GridInterrupted`; a second signal while the grid stops and its
    summary is written is ignored. Python drops an exception raised while the main thread runs a ``__del__``
    (it goes to ``sys.unraisablehook``): a dropped GridInterrupted is raised again once the process has run
    1 ms of CPU time on (SIGVTALRM, which nothing else here uses), and the executors check the record between
    cells (:func:`check_stop`). Returns the function that puts the handlers and the hook back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    signums = (signal.SIGINT, signal.SIGTERM)

    def stop(signum, frame):
        if stop_requested() is not None or defer_during_import(signum, frame):
            return  # a second signal while the grid stops; a signal during an import comes again after it
        request_stop(signum)
        raise GridInterrupted(signum)

    def again(signum, frame):  # SIGVTALRM, armed only by ``unraisable`` after a recorded stop
        check_stop()

    previous_hook = sys.unraisablehook

    timer = hasattr(signal, "SIGVTALRM")  # not on Windows: there the executors' checks alone stop the grid

    def unraisable(info) -> None:
        if isinstance(info.exc_value, GridInterrupted):
            if timer:
                signal.setitimer(signal.ITIMER_VIRTUAL, 0.001)  # a raise from here would be dropped too
        else:
            previous_hook(info)

    previous = {s: signal.signal(s, stop) for s in signums}
    if timer:
        previous[signal.SIGVTALRM] = signal.signal(signal.SIGVTALRM, again)
    sys.unraisablehook = unraisable

    def restore() -> None:
        if timer:
            signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        for s, handler in previous.items():
            signal.signal(s, handler)
        sys.unraisablehook = previous_hook
        request_stop(None)

    return restore
