"""``gacbench bench``: a grid of (task, method, staleness, seed) cells, each a stored run.

Cells run in a local process pool (default) or on Ray actors. Workers live for the whole grid
and run cell after cell, so a worker's imports, and the rollout engine an LLM objective keeps per
process, are paid once per worker rather than once per cell; pending cells are ordered so that
cells sharing an objective and parameters (hence an engine configuration) run back to back. Local
workers exit when the runner's process does.

A cell whose directory records it as done (with complete files: :func:`gacbench.bench.cell.done_problem`)
is never rerun, so an interrupted grid resumes where it stopped; a done cell computed with other
settings (objective, parameters, steps, method) is refused up front rather than reused. A failed or
incomplete cell is recomputed, and a failed cell is recorded with its error and the grid goes on.
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
after each of its cells.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

import gacbench.llm  # noqa: F401  (registers the LLM objectives, e.g. grpo)
from gacbench.bench.cell import (
    CellMismatchError,
    cell_dir,
    identity_diff,
    run_cell,
    show_change,
    stored_config,
    stored_done,
    write_json,
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
from gacbench.functional.calibration import calibration_record
from gacbench.methods import (
    parse_method,
    reference_cell,
    reference_rule,
    sync_cell,
)
from gacbench.objectives import objective_class
from gacbench.usage import UsageError, check_output_dir


def expand_cells(suite: dict, methods: list[str] | None = None, staleness: list[int] | None = None,
                 seeds: list[int] | None = None, tasks: list[str] | None = None) -> list[dict]:
    """The grid as a list of cell dicts. ``sync`` runs once at s = 0; stale methods run at each s > 0. The suite's
    threshold-ablation cells come with the suite's own method list, or alone with the keyword ``ablation`` in
    ``methods``."""
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

    cells = []
    for task in tasks:
        spec = suite["tasks"][task]
        extra = [] if explicit else [x for x in spec.get("extra_methods", []) if x not in methods]
        for m in list(methods) + extra:
            method, _ = parse_method(m)
            for s in ([0] if not method.stale else [x for x in staleness if x > 0]):
                if not method.stale and 0 not in staleness:
                    continue
                for seed in seeds:
                    cells.append({**base(task), "method": m, "staleness": s, "seed": seed})
    ablation = suite.get("ablation")
    if ablation and with_ablation:
        for task in tasks:
            for lo in ablation["c_low"]:
                for hi in ablation["c_high"]:
                    if lo >= hi:
                        continue
                    for seed in seeds:
                        cells.append({**base(task),
                                      "method": f"{ablation.get('method', 'gac')}(c_low={lo},c_high={hi})",
                                      "staleness": ablation["staleness"], "seed": seed, "ablation": True})
    check_lag(cells)
    return cells


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


def engine_key(cell: dict) -> tuple[str, str]:
    """Cells with the same key share an objective and its parameters, hence an engine configuration."""
    return cell["objective"], json.dumps(cell.get("params", {}), sort_keys=True, default=str)


def order_cells(cells: list[dict]) -> list[dict]:
    """``cells`` with those of equal :func:`engine_key` back to back; groups in order of first appearance,
    the order within a group kept."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for c in cells:
        groups.setdefault(engine_key(c), []).append(c)
    return [c for group in groups.values() for c in group]


def check_stored(cells: list[dict], root: Path) -> None:
    """Refuse a grid whose done cells in ``root`` were computed with other settings (see cell.identity_diff)."""
    mismatched: list[tuple[dict, dict]] = []
    for c in cells:
        done = stored_done(root, c)
        if done is not None:
            diff = identity_diff(stored_config(root, c, done), c)
            if diff:
                mismatched.append((c, diff))
    if not mismatched:
        return
    changes: dict[str, int] = {}
    for _, diff in mismatched:
        for key, (old, new) in diff.items():
            change = show_change(key, old, new)
            changes[change] = changes.get(change, 0) + 1
    lines = [f"{root} holds {len(mismatched)} finished cell(s) computed with other settings than this run asks for:"]
    lines += [f"  {change}, in {n} cell(s)" for change, n in changes.items()]
    dirs = [str(cell_dir(root, c)) for c, _ in mismatched]
    lines.append("  cells: " + ", ".join(dirs[:3]) + (f" and {len(dirs) - 3} more" if len(dirs) > 3 else ""))
    tasks = sorted({c["task"] for c, _ in mismatched})
    lines.append("A finished cell is reused only for the same objective, parameters, steps and method. Fix: use "
                 "another --out, or delete the stored cells to recompute them with these settings ("
                 + "; ".join(f"rm -r {root / 'cells' / t}" for t in tasks) + " removes every cell of a task).")
    raise CellMismatchError("\n".join(lines))


def reference_calibration(root: Path, cell: dict) -> dict:
    """The calibration record of ``cell`` (a method with a reference, ``gac-calibrated``) from its reference
    cell's stored c_t trace under ``root``: ``align/cos`` after the cell's warm-up, by the rule settings of the
    cell's method spec (``gac-calibrated(quantile=0.95)``), plus ``warmup`` and ``reference`` (the reference
    cell's directory, relative to ``root``). Raises ValueError when the trace cannot be calibrated from."""
    from gacbench.bench.report import read_metrics

    ref = reference_cell(cell)
    if ref is None:
        raise ValueError(f"method {cell['method']!r} has no reference cell")
    d = cell_dir(Path(root), ref)
    cos = [v for _, v in sorted(read_metrics(d / "metrics.csv").get("align/cos", []))]
    warmup = int(cell.get("warmup", 0))
    rec = calibration_record(cos[warmup:], 0, **reference_rule(cell["method"]))
    return {**rec, "warmup": warmup, "reference": str(d.relative_to(Path(root)))}


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


def _fail_without_running(root: Path, cell: dict, error: str) -> dict:
    status = {"status": "failed", "error": error, "cell": cell}
    out = cell_dir(root, cell)
    out.mkdir(parents=True, exist_ok=True)
    (out / "status.json").unlink(missing_ok=True)
    write_json(out / "status.json", status)
    return status


class _Dependencies:
    """The pending cells split into those that can run now (``ready``) and those waiting for their reference
    cell; :meth:`finished` releases the waiting ones when their reference ends, with their calibration. A cell
    whose reference failed, or whose reference trace cannot be calibrated from, is recorded as failed without
    running (its statuses are collected by :meth:`take_failed`)."""

    def __init__(self, pending: list[dict], root: Path) -> None:
        self.root = root
        self.waiting: dict[Path, list[dict]] = {}
        self._failed: list[dict] = []
        self.ready: list[dict] = []
        pending_dirs = {cell_dir(root, c) for c in pending}
        for c in pending:
            ref = reference_cell(c)
            if ref is None:
                self.ready.append(c)
            elif cell_dir(root, ref) in pending_dirs:
                self.waiting.setdefault(cell_dir(root, ref), []).append(c)
            else:  # done in root (check_references)
                self.ready += self._prepare(c)

    def _prepare(self, cell: dict) -> list[dict]:
        try:
            return [{**cell, "calibration": reference_calibration(self.root, cell)}]
        except (OSError, ValueError) as exc:
            self._failed.append(_fail_without_running(self.root, cell, f"calibration from the reference cell failed: "
                                                                        f"{exc}"))
            return []

    def finished(self, cell: dict, status: dict) -> list[dict]:
        """The cells that ``cell`` (just finished with ``status``) was the reference of, now ready."""
        out: list[dict] = []
        for c in self.waiting.pop(cell_dir(self.root, cell), []):
            if status.get("status") == "done":
                out += self._prepare(c)
            else:
                self._failed.append(_fail_without_running(
                    self.root, c, f"its reference cell {cell_dir(self.root, cell)} failed ({status.get('error')}); "
                                  "rerun the grid once it succeeds"))
        return out

    def take_failed(self) -> list[dict]:
        failed, self._failed = self._failed, []
        return failed


def _die_with_parent(parent_pid: int | None) -> None:
    """End this worker when the process that started it ends, even by SIGKILL: on Linux the kernel
    delivers SIGKILL (PR_SET_PDEATHSIG, which fires when the parent's thread that started the worker
    ends: the pool starts its workers from the thread that submits the cells, which outlives the
    pool); everywhere a daemon thread waits on the parent's sentinel."""
    import multiprocessing
    import signal
    import threading

    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if parent_pid is not None and os.getppid() != parent_pid:  # the parent ended before the line above
        os._exit(1)
    parent = multiprocessing.parent_process()
    if parent is not None:
        from multiprocessing.connection import wait as wait_ready

        def watch() -> None:
            wait_ready([parent.sentinel])
            os._exit(1)

        threading.Thread(target=watch, name="gacbench-parent-watch", daemon=True).start()


def _init_worker(threads: int, parent_pid: int | None = None) -> None:
    import torch

    torch.set_num_threads(threads)
    _die_with_parent(parent_pid)


class _Display:
    def __init__(self, total: int, done: int, console: Console) -> None:
        self.progress = Progress(
            TextColumn("[bold]cells"), BarColumn(), MofNCompleteColumn(), TextColumn("running {task.fields[running]}"),
            TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=console, transient=False,
        )
        self.task = self.progress.add_task("grid", total=total, completed=done, running=0, failed=0)
        self.failed = 0

    def update(self, running: int, finished: dict | None = None) -> None:
        if finished is not None and finished.get("status") != "done":
            self.failed += 1
        self.progress.update(self.task, advance=1 if finished is not None else 0, running=running, failed=self.failed)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def timing_record(results: list[dict], wall: float, workers: int) -> dict[str, Any]:
    """Step share, cell rate and per-worker memory of the cells run in one invocation (``results`` in
    completion order, so each worker's list of resident memory is in the order it ran its cells)."""
    step_s = sum(r["step_s"] for r in results if _finite(r.get("step_s")))
    eval_s = sum(r["eval_s"] for r in results if _finite(r.get("eval_s")))
    per: dict[int, list[float]] = {}
    for r in results:
        if r.get("worker_pid") is not None:
            per.setdefault(int(r["worker_pid"]), []).append(r.get("rss_mb"))
    per_worker = []
    for pid, rss in per.items():
        known = [x for x in rss if _finite(x)]
        per_worker.append({"pid": pid, "cells": len(rss), "rss_mb": rss,
                           "rss_mb_first": known[0] if known else None, "rss_mb_last": known[-1] if known else None,
                           "rss_mb_max": max(known) if known else None})
    return {
        "wall_s": wall, "workers": workers,
        "cells_per_min": 60.0 * len(results) / wall if results and wall > 0 else 0.0,
        "step_s": step_s, "eval_s": eval_s,
        "step_share": step_s / (wall * workers) if results and wall > 0 and workers > 0 else None,
        "per_worker": per_worker,
    }


def run_grid(cells: list[dict], out: str | os.PathLike, workers: int = 1, executor: str = "local",
             console: Console | None = None) -> dict[str, Any]:
    """Run every cell not yet done; returns timing figures (also written to ``out/timing.json`` when a
    cell ran). Raises CellMismatchError, before running anything, if a done cell in ``out`` was
    computed with other settings than its cell in ``cells``."""
    if workers < 1:
        raise UsageError(f"--workers {workers} must be >= 1")
    if executor not in ("local", "ray"):
        raise UsageError(f"--executor {executor!r} is not 'local' or 'ray'")
    root = check_output_dir("--out", out)
    check_stored(cells, root)
    check_references(cells, root)
    console = console or Console()
    pending = [c for c in cells if not is_done(root, c)]
    refs = {cell_dir(root, r) for r in (reference_cell(c) for c in pending) if r is not None}
    if refs:  # reference cells first within their engine group, so that their dependents are released early
        pending = sorted(pending, key=lambda c: cell_dir(root, c) not in refs)
    pending = order_cells(pending)
    done_before = len(cells) - len(pending)
    deps = _Dependencies(pending, root)
    used = 1 if executor == "local" and workers == 1 else min(workers, len(pending))
    threads = max(1, (os.cpu_count() or 1) // workers)
    display = _Display(len(cells), done_before, console)
    t0 = time.perf_counter()
    results: list[dict] = []
    with display.progress:
        results += _report_failed(deps, display)
        if not pending:
            pass
        elif executor == "ray":
            results += _run_ray(deps, root, used, threads, display)
        elif workers == 1:
            queue = list(deps.ready)
            while queue:
                cell = queue.pop(0)
                display.update(running=1)
                results.append(run_cell(cell, root, threads))
                display.update(running=0, finished=results[-1])
                queue += deps.finished(cell, results[-1])
                results += _report_failed(deps, display)
        else:
            results += _run_pool(deps, root, used, threads, display)
    wall = time.perf_counter() - t0
    failed = [r for r in results if r.get("status") != "done"]
    timing = {"cells": len(cells), "ran": len(results), "skipped_done": done_before, "failed": len(failed),
              "executor": executor, **timing_record(results, wall, used if results else 0)}
    if results:
        write_json(root / "timing.json", timing)
    return timing


def _report_failed(deps: _Dependencies, display: _Display) -> list[dict]:
    failed = deps.take_failed()
    for status in failed:
        display.update(running=0, finished=status)
    return failed


def _run_pool(deps: _Dependencies, root: Path, workers: int, threads: int, display: _Display) -> list[dict]:
    """``workers`` spawned processes that each run cells until the queue is empty (in ``deps.ready``'s order;
    a cell waiting for its reference is submitted when the reference ends)."""
    results = []
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"),
                             initializer=_init_worker, initargs=(threads, os.getpid())) as pool:
        futures = {pool.submit(run_cell, c, str(root), threads): c for c in deps.ready}
        display.update(running=min(workers, len(futures)))
        while futures:
            finished, _ = wait(futures, return_when=FIRST_COMPLETED)
            for f in finished:
                cell = futures.pop(f)
                try:
                    results.append(f.result())
                except BrokenProcessPool as exc:
                    raise RuntimeError(
                        f"a worker process died while running cells ({exc}); most often the system ran out of memory "
                        "and killed it. The cells finished so far are stored: rerun the same command to resume, with "
                        "fewer --workers if memory is short") from exc
                display.update(running=min(workers, len(futures)), finished=results[-1])
                for c in deps.finished(cell, results[-1]):
                    futures[pool.submit(run_cell, c, str(root), threads)] = c
                results += _report_failed(deps, display)
    return results


class _CellWorker:
    """A Ray actor that runs cells one after another in one process."""

    def __init__(self, threads: int) -> None:
        _init_worker(threads)

    def run(self, cell: dict, root: str, threads: int) -> dict:
        return run_cell(cell, root, threads)


def _run_ray(deps: _Dependencies, root: Path, workers: int, threads: int, display: _Display) -> list[dict]:
    """``workers`` Ray actors, each handed its next cell when it finishes one: a cell with the same
    engine key as its last one if any is left, else the next in ``deps.ready``'s order (a cell waiting for
    its reference joins the queue when the reference ends). A cell whose actor dies is recorded as failed
    and the actor replaced."""
    pending = deps.ready + [c for waiting in deps.waiting.values() for c in waiting]
    try:
        import ray
    except ImportError:
        raise UsageError("--executor ray needs Ray: pip install -e '.[ray]'") from None
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 **({} if address else {"num_cpus": workers}))
    options: dict[str, Any] = {"num_cpus": 1}
    gpus = ray.cluster_resources().get("GPU", 0)
    if gpus and any(objective_class(o).accelerator != "cpu" for o in {c["objective"] for c in pending}):
        options["num_gpus"] = min(1.0, gpus / workers)
    actor_cls = ray.remote(**options)(_CellWorker)
    root_s = str(root.resolve())
    queue = list(deps.ready)
    actors = [actor_cls.remote(threads) for _ in range(workers)]
    last: dict[int, tuple[str, str]] = {}
    inflight: dict[Any, tuple[int, dict]] = {}

    def dispatch(i: int) -> None:
        j = next((k for k, c in enumerate(queue) if engine_key(c) == last.get(i)), 0)
        cell = queue.pop(j)
        last[i] = engine_key(cell)
        inflight[actors[i].run.remote(cell, root_s, threads)] = (i, cell)

    results = []
    idle = set(range(workers))
    try:
        for i in range(workers):
            if queue:
                dispatch(i)
                idle.discard(i)
        display.update(running=len(inflight))
        while inflight:
            ready, _ = ray.wait(list(inflight), num_returns=1)
            i, cell = inflight.pop(ready[0])
            try:
                results.append(ray.get(ready[0]))
            except ray.exceptions.RayActorError as exc:
                status = {"status": "failed", "error": f"the Ray actor running this cell died: {exc}", "cell": cell}
                out = cell_dir(root, cell)
                out.mkdir(parents=True, exist_ok=True)
                write_json(out / "status.json", status)
                results.append(status)
                actors[i] = actor_cls.remote(threads)
                last.pop(i, None)
            queue += deps.finished(cell, results[-1])
            idle.add(i)
            for j in sorted(idle):
                if queue:
                    dispatch(j)
                    idle.discard(j)
            display.update(running=len(inflight), finished=results[-1])
            results += _report_failed(deps, display)
    finally:
        for actor in actors:
            ray.kill(actor)
    return results




























def main(args) -> int:
    from gacbench.bench.report import build_report

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
    overrides = parse_params(getattr(args, "param", None) or [])
    for c in cells:
        c["params"] = merge_params(c["params"], overrides)
    check_params(cells, overrides)
    out = check_output_dir("--out", args.out)
    console.print(f"suite [bold]{suite.get('name', args.suite)}[/]: {len(cells)} cells -> {out}  "
                  f"(workers={args.workers}, executor={args.executor})")
    if not any(c["method"] == "sync" for c in cells) and not any(is_done(out, sync_cell(c)) for c in cells):
        console.print("[yellow]note[/]: no sync cell in this grid (sync needs staleness 0) or done in --out: the "
                      "recovered shares cannot be computed")
    try:
        timing = run_grid(cells, out, args.workers, args.executor, console)
    except CellMismatchError as exc:
        raise SystemExit(f"gacbench bench: {exc}") from None
    report = build_report(out, cells=cells)  # every cell stored in --out, not only this grid's
    for line in report["incomplete"]:
        console.print(f"[yellow]incomplete cell[/]: {line}", highlight=False)
    console.print(
        f"ran {timing['ran']} cells ({timing['skipped_done']} already done, {timing['failed']} failed) in "
        f"{timing['wall_s']:.1f} s: {timing['cells_per_min']:.1f} cells/min; median framework share of step time "
        f"{report['overhead_share_median']:.0%}"
    )
    for line in timing_lines(timing):
        console.print(line, highlight=False)
    console.print(f"wrote {out / 'summary.json'}, {out / 'summary.md'} and {len(report['figures'])} figures "
                  f"({len(report['summary']['cells'])} stored cells)")
    return 1 if timing["failed"] else 0


def timing_lines(timing: dict[str, Any]) -> list[str]:
    """The step share and each worker's resident memory, as printed at the end of a run."""
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

    return lines
