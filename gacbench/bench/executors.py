"""The executors of a benchmark grid: how the pending cells of :func:`gacbench.bench.runner.run_grid` are run.

- :func:`run_local`: cell after cell in the runner's own process (``--workers 1``);
- :func:`run_pool`: a pool of worker processes (forked from a fork server on Linux, else spawned:
  :mod:`gacbench.bench.workers`), kept for the whole grid, each running cell after cell (``--executor
  local``); a worker ignores SIGINT (the runner stops it) and ends when the runner ends, even by SIGKILL
  (:func:`die_with_parent`);
- :func:`run_ray`: Ray actors that do the same (``--executor ray``).

Each takes the cells that can run from :class:`Dependencies` (a cell whose reference cell, e.g. the sync cell
of ``gac-calibrated``, is pending waits for it and is handed its calibration when it ends) and reports each
finished cell on the :class:`Display`. A cell that another runner has claimed comes back as ``claimed``: it is
kept in :class:`Dependencies` until :func:`wait_for_claims` sees its claim released. When the grid is stopped
(:class:`GridInterrupted`, a full disk, any error), the pool's processes are killed at once and the Ray actors
ended: the cells in flight stay unfinished and the next run recomputes them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.exceptions import SIGTERMException
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from gacbench.bench.cell import (
    CLAIMED,
    CellMismatchError,
    cell_dir,
    claim_released,
    engine_key,
    run_cell,
    show_change,
    stored_diff,
    stored_state,
    write_json,
)
from gacbench.bench.workers import pool_context, runner_pid, start_fork_server
from gacbench.functional.calibration import calibration_record
from gacbench.methods import reference_cell, reference_rule, reference_trace
from gacbench.objectives import objective_class
from gacbench.usage import UsageError


class WorkerDied(RuntimeError):
    """A worker process ended without a result (killed, most often by the out-of-memory killer)."""


class GridInterrupted(BaseException):
    """SIGINT or SIGTERM reached the runner, or one of its worker processes (``where`` names which; a
    BaseException, so that no cell records it as its own failure)."""

    def __init__(self, signum: int, where: str = "") -> None:
        super().__init__(signal.Signals(signum).name + (f" ({where})" if where else ""))
        self.signum, self.where = signum, where


_stop_requested: int | None = None  # the signal that stopped the grid, set by the runner's handler


def request_stop(signum: int | None) -> None:
    """Record that ``signum`` stopped the grid (None: clear it). The handler's own raise can be lost (Python
    ignores an exception raised while the main thread runs a ``__del__``), so the record outlives it."""
    global _stop_requested
    _stop_requested = signum


def stop_requested() -> int | None:
    return _stop_requested


def check_stop() -> None:
    """Raise :class:`GridInterrupted` if a signal stopped the grid: each executor calls it between cells and
    while it waits, so a stop whose raise was lost still ends the grid before its next cell."""
    if _stop_requested is not None:
        raise GridInterrupted(_stop_requested)


@contextlib.contextmanager
def signals_through_ray():
    """Around Ray's calls that block (``ray.wait``, ``ray.get``): the runner's signal handler raises
    :class:`GridInterrupted` in the main thread, and a Cython call of Ray running there turns that into a
    ``SystemError`` ("returned a result with an exception set"). The handler has recorded the stop first
    (:func:`request_stop`), so the stop is raised as itself."""
    try:
        yield
    except SystemError:
        check_stop()
        raise


def reference_calibration(root: Path, cell: dict) -> dict:
    """The calibration record of ``cell`` (a method with a reference, ``gac-calibrated``) from its reference
    cell's stored trace under ``root``: the metric the method names (``align/cos``; ``align/step_cos`` for
    ``gac-step-calibrated``) after the cell's warm-up, by the rule settings of the cell's method spec
    (``gac-calibrated(quantile=0.95)``), plus ``warmup``, ``trace`` (the metric) and ``reference`` (the reference
    cell's directory, relative to ``root``). Raises ValueError when the trace cannot be calibrated from."""
    from gacbench.bench.report import read_metrics

    ref = reference_cell(cell)
    if ref is None:
        raise ValueError(f"method {cell['method']!r} has no reference cell")
    d = cell_dir(Path(root), ref)
    key = reference_trace(cell["method"])
    cos = [v for _, v in sorted(read_metrics(d / "metrics.csv").get(key, []))]
    if not cos and key != "align/cos":
        raise ValueError(f"the reference cell {d} has no {key} trace in its metrics.csv (it ran before its "
                         f"AlignmentMonitor logged {key}); delete that cell's directory so that the runner runs it "
                         "again, then rerun")
    warmup = int(cell.get("warmup", 0))
    rec = calibration_record(cos[warmup:], 0, **reference_rule(cell["method"]))
    extra = {"trace": key} if key != "align/cos" else {}  # gac-calibrated's record stays as it was
    return {**rec, "warmup": warmup, **extra, "reference": str(d.relative_to(Path(root)))}


def _fail_without_running(root: Path, cell: dict, error: str) -> dict:
    status = {"status": "failed", "error": error, "cell": cell}
    out = cell_dir(root, cell)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "status.json", status)  # atomic: replaces an earlier status
    return status


class Dependencies:
    """The pending cells split into those that can run now (``ready``) and those waiting for their reference
    cell; :meth:`finished` releases the waiting ones when their reference ends, with their calibration. A cell
    whose reference failed, or whose reference trace cannot be calibrated from, is recorded as failed without
    running (its statuses are collected by :meth:`take_failed`). A cell that came back ``claimed`` (another
    runner holds it) is kept for :meth:`take_claimed`, and its dependents keep waiting."""

    def __init__(self, pending: list[dict], root: Path) -> None:
        self.root = root
        self.waiting: dict[Path, list[dict]] = {}
        self._failed: list[dict] = []
        self._claimed: list[dict] = []
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

    def take_ready(self) -> list[dict]:
        ready, self.ready = self.ready, []
        return ready

    def finished(self, cell: dict, status: dict) -> list[dict]:
        """The cells that ``cell`` (just finished with ``status``) was the reference of, now ready."""
        if status.get("status") == CLAIMED:
            self._claimed.append(cell)
            return []
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

    def take_claimed(self) -> list[dict]:
        claimed, self._claimed = self._claimed, []
        return claimed


def wait_for_claims(root: Path, claimed: list[dict], deps: Dependencies, display: Display,
                    poll_s: float = 0.2) -> list[dict]:
    """Wait until the other runners holding ``claimed`` cells release them; then a cell whose holder stored a
    status (done or failed) with this grid's settings is taken as it is (returned with ``"reused": True``, its
    dependents released into ``deps.ready``), a done cell stored with other settings is refused as
    :func:`gacbench.bench.cell.run_cell` refuses it (:class:`CellMismatchError`), and a cell without a status (its
    holder was killed) or failed with other settings goes back into ``deps.ready`` to be run."""
    left = list(claimed)
    results: list[dict] = []
    while left:
        check_stop()
        released = [c for c in left if claim_released(cell_dir(root, c))]
        if not released:
            time.sleep(poll_s)
            continue
        for c in released:
            left.remove(c)
            status, problem = stored_state(root, c)
            stored = status is not None and problem is None and status.get("status") in ("done", "failed")
            diff = stored_diff(root, c, status) if stored else {}
            if diff and status.get("status") == "done":
                changes = "; ".join(show_change(k, a, b) for k, (a, b) in diff.items())
                raise CellMismatchError(f"{cell_dir(root, c)} holds a finished run with other settings ({changes}), "
                                        "stored by the runner that held it; use another output directory, or delete "
                                        "that cell directory to recompute it")
            if stored and not diff:
                results.append({**status, "reused": True})
                display.update(running=0, finished=results[-1])
                deps.ready += deps.finished(c, status)
            else:
                deps.ready.append(c)
    return results + report_failed(deps, display)


def die_with_parent(parent_pid: int | None) -> None:
    """End this worker when the process that started it ends, even by SIGKILL: on Linux the kernel
    delivers SIGKILL (PR_SET_PDEATHSIG, which fires when the worker's parent ends: for a spawned worker the
    runner's thread that started it, the one that submits the cells, which outlives the pool; for a forked
    worker the fork server, which ends when the runner does); everywhere a daemon thread waits on the
    runner's sentinel. ``parent_pid``: the runner's process id when it is the worker's parent (a
    spawned worker), to notice a runner that ended before the signal was armed; None for a forked worker,
    whose sentinel notices it."""
    import multiprocessing
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


def init_worker(threads: int, parent_pid: int | None = None) -> None:
    """Set up a pool worker: its torch thread count; SIGINT ignored (a Ctrl-C reaches the whole process group,
    and the runner stops its workers itself); it ends with the runner."""
    import torch

    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent_pid)
    atexit.register(exit_without_teardown)  # runs before the handlers registered earlier (atexit is LIFO)


def exit_without_teardown() -> None:
    """A pool worker's last act (registered with atexit): its results are sent and its files written by then,
    so it skips the interpreter's teardown, which after an LLM cell takes seconds per worker (closing the vLLM
    engine, freeing every module's objects) while the runner waits for the workers to end."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


class Display:
    def __init__(self, total: int, done: int, console: Console) -> None:
        self.progress = Progress(
            TextColumn("[bold]cells"), BarColumn(), MofNCompleteColumn(), TextColumn("running {task.fields[running]}"),
            TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=console, transient=False,
        )
        self.task = self.progress.add_task("grid", total=total, completed=done, running=0, failed=0)
        self.failed = 0

    def update(self, running: int, finished: dict | None = None) -> None:
        if finished is not None and finished.get("status") == CLAIMED:
            finished = None  # another runner's cell: counted when it ends
        if finished is not None and finished.get("status") != "done":
            self.failed += 1
        self.progress.update(self.task, advance=1 if finished is not None else 0, running=running, failed=self.failed)


def report_failed(deps: Dependencies, display: Display) -> list[dict]:
    failed = deps.take_failed()
    for status in failed:
        display.update(running=0, finished=status)
    return failed


def run_local(deps: Dependencies, root: Path, threads: int, display: Display, rerun_other_versions: bool) -> list[dict]:
    """The ready cells one after another in this process."""
    results: list[dict] = []
    queue = deps.take_ready()
    while queue:
        check_stop()
        cell = queue.pop(0)
        display.update(running=1)
        results.append(run_cell(cell, root, threads, rerun_other_versions))
        display.update(running=0, finished=results[-1])
        queue += deps.finished(cell, results[-1])
        results += report_failed(deps, display)
    return results


def run_pool(deps: Dependencies, root: Path, workers: int, threads: int, display: Display,
             rerun_other_versions: bool) -> list[dict]:
    """``workers`` processes (:mod:`gacbench.bench.workers`) that each run cells until the queue is empty (in
    ``deps.ready``'s order; a cell waiting for its reference is submitted when the reference ends). On any
    exception or interruption the worker processes are killed before it propagates."""
    results = []
    start_fork_server()  # a no-op when the command line started it, or where the pool spawns
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=pool_context(), initializer=init_worker,
                               initargs=(threads, runner_pid()))
    try:
        args = (str(root), threads, rerun_other_versions)
        futures = {pool.submit(run_cell, c, *args): c for c in deps.take_ready()}
        display.update(running=min(workers, len(futures)))
        processes: dict = {}  # every worker process the pool started: their exit codes say why a pool broke
        while futures:
            check_stop()
            processes.update(getattr(pool, "_processes", None) or {})
            finished, _ = wait(futures, timeout=0.5, return_when=FIRST_COMPLETED)
            for f in finished:
                cell = futures.pop(f)
                try:
                    results.append(f.result())
                except BrokenProcessPool as exc:
                    codes = {p.exitcode for p in processes.values()}
                    if -signal.SIGTERM in codes and -signal.SIGKILL not in codes:  # the pool ends the rest with it
                        raise GridInterrupted(signal.SIGTERM, "a worker process") from None
                    raise WorkerDied(
                        f"a worker process died while running cells ({exc}); most often the system ran out of memory "
                        "and killed it. The cells finished so far are stored: rerun the same command to resume, with "
                        "fewer --workers if memory is short") from None
                except Exception:
                    raise
                except BaseException as exc:  # a SystemExit in the worker's cell, e.g. Lightning's on SIGTERM
                    where = f"the worker process running {cell['task']}/{cell['method']}/s{cell['staleness']}/" \
                            f"seed{cell['seed']}"
                    if isinstance(exc, SIGTERMException):  # Lightning's handler, inside the cell's fit
                        raise GridInterrupted(signal.SIGTERM, where) from None
                    raise RuntimeError(f"{where} ended with {type(exc).__name__}({exc}); the cells finished so far "
                                       "are stored: rerun the same command to resume") from None
                display.update(running=min(workers, len(futures)), finished=results[-1])
                for c in deps.finished(cell, results[-1]):
                    futures[pool.submit(run_cell, c, *args)] = c
                results += report_failed(deps, display)
        pool.shutdown(wait=True)
    except BaseException:
        _kill_pool(pool)
        raise
    return results


def _kill_pool(pool: ProcessPoolExecutor) -> None:
    """Kill the pool's worker processes at once (their cells in flight stay unfinished) and wait until they are gone."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for p in processes:
        try:
            p.kill()
        except (OSError, ValueError):
            pass
    pool.shutdown(wait=False, cancel_futures=True)
    for p in processes:
        try:
            p.join(timeout=10)
        except (OSError, ValueError, AssertionError):
            pass


class CellWorker:
    """A Ray actor that runs cells one after another in one process."""

    def __init__(self, threads: int) -> None:
        init_worker(threads)

    def run(self, cell: dict, root: str, threads: int, rerun_other_versions: bool = False) -> dict:
        return run_cell(cell, root, threads, rerun_other_versions)


def run_ray(deps: Dependencies, root: Path, workers: int, threads: int, display: Display,
            rerun_other_versions: bool) -> list[dict]:
    """``workers`` Ray actors, each handed its next cell when it finishes one: a cell with the same
    engine key as its last one if any is left, else the next in ``deps.ready``'s order (a cell waiting for
    its reference joins the queue when the reference ends). A cell whose actor dies is recorded as failed
    and the actor replaced. The actors are ended when it returns or raises."""
    queue = deps.take_ready()
    pending = queue + [c for waiting in deps.waiting.values() for c in waiting]
    try:
        import ray
    except ImportError:
        raise UsageError("--executor ray needs Ray: pip install -e '.[ray]'") from None
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 **({} if address else {"num_cpus": workers}))
        if threading.current_thread() is threading.main_thread():  # ray.init installs its own (SIGTERM: sys.exit)
            for s, handler in handlers.items():  # the runner's handlers stop the grid and write its summary
                signal.signal(s, handler)
    options: dict[str, Any] = {"num_cpus": 1}
    gpus = ray.cluster_resources().get("GPU", 0)
    if gpus and any(objective_class(o).accelerator != "cpu" for o in {c["objective"] for c in pending}):
        options["num_gpus"] = min(1.0, gpus / workers)
    actor_cls = ray.remote(**options)(CellWorker)
    root_s = str(root.resolve())
    actors = [actor_cls.remote(threads) for _ in range(workers)]
    last: dict[int, tuple[str, str]] = {}
    inflight: dict[Any, tuple[int, dict]] = {}

    def dispatch(i: int) -> None:
        j = next((k for k, c in enumerate(queue) if engine_key(c) == last.get(i)), 0)
        cell = queue.pop(j)
        last[i] = engine_key(cell)
        inflight[actors[i].run.remote(cell, root_s, threads, rerun_other_versions)] = (i, cell)

    results = []
    idle = set(range(workers))
    try:
        for i in range(workers):
            if queue:
                dispatch(i)
                idle.discard(i)
        display.update(running=len(inflight))
        while inflight:
            check_stop()
            with signals_through_ray():
                ready, _ = ray.wait(list(inflight), num_returns=1, timeout=0.5)  # a timeout lets a signal through
            if not ready:
                continue
            i, cell = inflight.pop(ready[0])
            try:
                with signals_through_ray():
                    results.append(ray.get(ready[0]))
            except ray.exceptions.RayActorError as exc:
                results.append(_fail_without_running(root, cell, f"the Ray actor running this cell died: {exc}"))
                actors[i] = actor_cls.remote(threads)
                last.pop(i, None)
            queue += deps.finished(cell, results[-1])
            idle.add(i)
            for j in sorted(idle):
                if queue:
                    dispatch(j)
                    idle.discard(j)
            display.update(running=len(inflight), finished=results[-1])
            results += report_failed(deps, display)
    finally:
        for actor in actors:
            ray.kill(actor)
    return results
