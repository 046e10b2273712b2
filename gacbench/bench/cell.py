"""One cell of a benchmark grid: (task, method, staleness, seed) -> a run directory.

A cell directory holds ``config.json`` (what was run), ``metrics.csv`` (every logged scalar, per
step, through Lightning's CSVLogger) and ``status.json`` (done or failed, the final metric, timing,
the worker process and its resident memory after the cell). Every file is written atomically, so a
killed worker leaves either no status or a complete one. A cell counts as done only when its status
says so *and* its stored files are complete (:func:`done_problem`): a status.json or config.json that
is not valid JSON, or a metrics.csv that is empty, truncated or stops before the last step, makes the
cell unfinished, so the next run recomputes it and the summary never reads it as finished.

The directory encodes the task, method, staleness and seed; the objective, its parameters and the
step count are checked against the stored ``config.json`` instead (:func:`identity_diff`): a done
cell is reused only for the same settings. ``config.json`` also records the environment the cell ran in
(``provenance``: :func:`gacbench.provenance.provenance`).

A cell is claimed before it runs (:func:`claim`): an exclusive ``flock`` on the cell directory's ``.claim``
file, held for the whole run, with the holder's pid and host written in it. Another process (another runner on
the same output directory) finds the claim taken and leaves the cell to its holder; the kernel releases the
lock when the holder ends, also when it is killed, so a claim never outlives its process.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger

import gacbench.llm  # noqa: F401  (registers the LLM objectives, e.g. grpo, in a worker process too)
from gacbench.bench.timing import cell_parts
from gacbench.callbacks import AlignmentMonitor, AssumptionMonitor, DriftMonitor, StalenessSimulator
from gacbench.jsonio import (  # noqa: F401  (json_safe, CLAIM_FILE, hold and flat_params re-exported)
    CLAIM_FILE,
    DISK_FULL,
    claim_dir,
    flat_params,
    hold,
    json_safe,
    read_json,
    write_json,
)
from gacbench.methods import method_callbacks, parse_method, plugin_provenance
from gacbench.objectives import objective_class
from gacbench.provenance import environment_key, provenance, source_changed
from gacbench.trainer import build_trainer
from gacbench.usage import UsageError

#: The keys compared between a stored done cell and the cell asked for: every setting its results depend on.
#: The directory encodes the task, method, staleness and seed, but a cell directory copied from elsewhere
#: (another seed's, another staleness's) carries the config of the cell it was computed for: those keys are
#: compared too, so a copy is reused only where it stands for the same cell.
IDENTITY_KEYS = ("task", "objective", "params", "steps", "warmup", "method", "staleness", "seed", "assumptions")
#: identity keys a cell may leave unset (unset and absent from a stored config compare equal)
OPTIONAL_IDENTITY_KEYS = ("assumptions",)
#: the identity keys every cell of one task in one output directory shares (not the method, staleness or seed)
TASK_IDENTITY_KEYS = tuple(k for k in IDENTITY_KEYS if k not in ("task", "method", "staleness", "seed"))


class StepTimer(pl.Callback):
    """Splits each optimizer step into the objective's own forward + backward and everything else.

    A step is timed from the callbacks' ``on_train_batch_start`` to their ``on_train_batch_end``;
    the objective's own ``on_train_batch_end`` (its periodic eval) runs after that and is not counted.
    """

    def __init__(self) -> None:
        self.total: list[float] = []
        self.model: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t0 = time.perf_counter()

    def on_after_backward(self, trainer, pl_module) -> None:
        self._t2 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        end = time.perf_counter()
        self.total.append(end - self._t0)
        self.model.append(self._t2 - self._t0)  # training_step (forward) + backward

    def overhead_share(self) -> float:
        if not self.total:
            return math.nan
        return 1.0 - statistics.median(self.model) / statistics.median(self.total)

    def step_s(self) -> float:
        """Seconds of all timed optimizer steps together."""
        return float(sum(self.total))


class EvalTimer:
    """Wraps the objective's evaluation methods (``timed_evals``: ``metric()``, and e.g. GRPO's policy reward) on the
    instance and adds up the seconds spent in them."""

    def __init__(self, model: pl.LightningModule) -> None:
        self.seconds = 0.0
        for name in getattr(model, "timed_evals", ("metric",)):
            setattr(model, name, self._timed(getattr(model, name)))

    def _timed(self, inner):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def rss_mb() -> float:
    """This process's resident memory in MiB: VmRSS from /proc/self/status, else the peak from getrusage."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**20 if sys.platform == "darwin" else 1024.0)


class DivergenceStop(pl.Callback):
    """Stops a run whose loss is no longer finite: later steps cannot change the verdict."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None and not torch.isfinite(loss).all():
            trainer.should_stop = True


def engine_key(cell: dict) -> tuple[str, str]:
    """Cells with the same key share an objective and its parameters, hence an engine configuration."""
    return cell["objective"], json.dumps(cell.get("params", {}), sort_keys=True, default=str)


def is_path_component(name: Any) -> bool:
    """Whether ``name`` is a non-empty string naming one folder: no ``/``, ``\\`` or NUL, not ``.`` or ``..``."""
    return isinstance(name, str) and bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")


def cell_dir(root: Path, cell: dict) -> Path:
    task = cell["task"]
    if not is_path_component(task):
        raise UsageError(f"task name {task!r} is not one path component: its cells would be stored outside "
                         f"{Path(root) / 'cells'}; rename the task (no '/', '\\' or NUL, not '.' or '..')")
    method = "".join(ch if ch.isalnum() or ch in "-_+.=" else "_" for ch in cell["method"])
    return root / "cells" / cell["task"] / method / f"s{cell['staleness']}" / f"seed{cell['seed']}"


#: The keys of a done cell's status.json that the summary reads (``steps_run``: also how complete metrics.csv must be).
DONE_KEYS = ("initial", "final", "diverged", "metric", "higher_is_better", "steps_run")


def read_status(d: Path) -> tuple[dict | None, str | None]:
    """``(status, problem)`` of the cell directory ``d``: ``(None, None)`` without a status.json, ``(None,
    why)`` when it is not a JSON object."""
    path = d / "status.json"
    if not path.exists():
        return None, None
    try:
        status = read_json(path)
    except (OSError, ValueError) as exc:
        return None, f"{path} is not valid JSON ({_short(exc)})"
    if not isinstance(status, dict):
        return None, f"{path} holds a {type(status).__name__}, not a JSON object"
    return status, None


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__


#: DriftMonitor's column: logged after every optimizer step, at the number of steps taken
DRIFT = "param/drift"


def metrics_problem(path: Path, steps_run: Any) -> str | None:
    """Why ``path`` (a finished cell's metrics.csv) is incomplete, or None: it must exist, end with a
    newline, have a header with a ``step`` column, rows with as many fields as the header, numbers
    only, a row for the last step the run took (``steps_run - 1``: every step is logged; the rows
    logged after training, at step ``steps_run``, do not count for it) and, where the file has a
    ``param/drift`` column, DriftMonitor's update after that step, logged at step ``steps_run``: the
    summaries read the drift as its last value, so without that row they would quietly report the drift
    one step earlier."""
    import csv

    if not path.is_file():
        return f"{path} is missing"
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        return f"{path} cannot be read ({_short(exc)})"
    if not text.strip():
        return f"{path} is empty"
    if not text.endswith("\n"):
        return f"{path} is truncated (its last line is cut off)"
    try:
        rows = list(csv.reader(text.splitlines()))
    except csv.Error as exc:  # a field past the csv module's limit (a block of NULs), a stray quote
        return f"{path} is corrupt ({_short(exc)})"
    header, body = rows[0], [r for r in rows[1:] if r]
    if "step" not in header:
        return f"{path} has no 'step' column in its header"
    at = header.index("step")
    last = -1
    steps: set[int] = set()
    drift = header.index(DRIFT) if DRIFT in header else None
    drift_steps: set[int] = set()
    for i, row in enumerate(body, start=2):
        if len(row) != len(header):
            return f"{path} is truncated (line {i} has {len(row)} of {len(header)} fields)"
        try:
            for value in row:
                if value != "":
                    float(value)
            step = int(float(row[at]))
        except ValueError:
            return f"{path} is corrupt (line {i} holds a value that is not a number)"
        last = max(last, step)
        steps.add(step)
        if drift is not None and row[drift] != "":
            drift_steps.add(step)
    need = int(steps_run) - 1 if isinstance(steps_run, (int, float)) and not isinstance(steps_run, bool) else 0
    if last < need:
        return (f"{path} is truncated (its last row is step {last}, the run took {int(steps_run)} steps)" if body
                else f"{path} has a header but no rows")
    if need >= 0 and need not in steps:  # rows logged after the last step (the final eval) do not stand in for it
        return f"{path} has no row for step {need}, the last of the {int(steps_run)} steps the run took"
    if drift is not None and need >= 0 and need + 1 not in drift_steps:
        return (f"{path} has no {DRIFT} at step {need + 1} (DriftMonitor's update after the last of the "
                f"{int(steps_run)} steps the run took)")
    return None


def done_problem(d: Path, status: dict) -> str | None:
    """Why the cell directory ``d``, whose status says done, is not a finished cell (the first bad file,
    named, and what is wrong with it), or None when config.json, status.json and metrics.csv are complete."""
    missing = [k for k in DONE_KEYS if k not in status]
    if missing:
        return f"{d / 'status.json'} says done but lacks {', '.join(missing)}"
    steps_run = status["steps_run"]
    if isinstance(steps_run, bool) or not isinstance(steps_run, int) or steps_run < 0:
        return f"{d / 'status.json'} says done but its steps_run={steps_run!r} is not a number of steps"
    path = d / "config.json"
    try:
        config = read_json(path)
    except FileNotFoundError:
        return f"{path} is missing"
    except (OSError, ValueError) as exc:
        return f"{path} is not valid JSON ({_short(exc)})"
    if not isinstance(config, dict):
        return f"{path} holds a {type(config).__name__}, not a JSON object"
    return metrics_problem(d / "metrics.csv", steps_run)


def stored_state(root: Path, cell: dict) -> tuple[dict | None, str | None]:
    """``(status, problem)`` of ``cell``'s directory: ``status`` is the stored status.json when it parses;
    ``problem`` names the bad file when the directory claims (or may claim) a finished run that its files
    do not hold: then the cell is not done."""
    d = cell_dir(root, cell)
    status, problem = read_status(d)
    if status is not None and status.get("status") == "done":
        problem = done_problem(d, status)
    return status, problem


def stored_done(root: Path, cell: dict) -> dict | None:
    """The stored status of ``cell``'s directory if it records a finished run whose files are complete, else None."""
    status, problem = stored_state(root, cell)
    if problem is not None or status is None or status.get("status") != "done":
        return None
    return status


def stored_done_cells(root: Path, task: str, skip: Collection[Path] = ()) -> list[tuple[Path, dict]]:
    """``(directory, stored cell)`` of every done cell of ``task`` stored under ``root`` (any method,
    staleness and seed), its cell read from the status's copy, else from ``config.json``. The directories in
    ``skip`` (a grid's own cells, which the caller checks otherwise) are left out unread."""
    out = []
    for d in sorted(p for p in (Path(root) / "cells" / task).glob("*/s*/seed*") if p.is_dir()):
        if d in skip:
            continue
        status, problem = read_status(d)
        if status is None or status.get("status") != "done" or done_problem(d, status) is not None:
            continue
        stored = status.get("cell")
        if not isinstance(stored, dict):
            try:
                stored = read_json(d / "config.json")
            except (OSError, ValueError):
                continue
        if isinstance(stored, dict):
            out.append((d, stored))
    return out


def read_config(d: Path) -> Any:
    """The config.json of the cell directory ``d`` as stored, or None when it cannot be read."""
    try:
        return read_json(d / "config.json")
    except (OSError, ValueError):
        return None


class StoredCells(dict):
    """:func:`stored_done_files`' result: the grid's done cells, directory -> ``(status, config)``; and, read on
    first use and kept, the done cells of each of its tasks stored outside the grid (:meth:`outside`), which both
    checks made before a grid runs (its settings, its pinned θ₀) compare with it."""

    def __init__(self, root: Path, grid_dirs: set[Path]) -> None:
        super().__init__()
        self.root, self.grid_dirs = root, grid_dirs
        self._outside: dict[str, list[tuple[Path, dict]]] = {}

    def outside(self, task: str) -> list[tuple[Path, dict]]:
        """:func:`stored_done_cells` of ``task`` without the grid's own directories, read once."""
        if task not in self._outside:
            self._outside[task] = stored_done_cells(self.root, task, skip=self.grid_dirs)
        return self._outside[task]


def stored_outside(root: Path, task: str, grid_dirs: set[Path], stored: Any = None) -> list[tuple[Path, dict]]:
    """The done cells of ``task`` stored in ``root`` outside ``grid_dirs``: from ``stored`` where it is a
    :class:`StoredCells` of ``root`` whose grid has the same directories of ``task``, else read here."""
    here = Path(root) / "cells" / task

    def of_task(dirs: set[Path]) -> set[Path]:
        return {d for d in dirs if d.parent.parent.parent == here}

    if isinstance(stored, StoredCells) and stored.root == root and of_task(stored.grid_dirs) == of_task(grid_dirs):
        return stored.outside(task)
    return stored_done_cells(root, task, skip=grid_dirs)


def stored_done_files(root: Path, cells: list[dict]) -> StoredCells:
    """The done cells among ``cells`` stored in ``root``, read once for the checks made before a grid runs: each
    one's directory -> ``(status, config)``, the status as :func:`stored_done` returns it and its config.json as
    :func:`read_config` does."""
    out = StoredCells(root, {cell_dir(root, c) for c in cells})
    for c in cells:
        d = cell_dir(root, c)
        if d not in out:
            status = stored_done(root, c)
            if status is not None:
                out[d] = (status, read_config(d))
    return out


def stored_diff(root: Path, cell: dict, status: dict | None = None, config: Any = None) -> dict[str, tuple[Any, Any]]:
    """:func:`identity_diff` of ``cell`` against what its directory stores: the status's copy of its cell and
    ``config.json`` each (a copied or edited directory may disagree in either); ``config``: the config.json
    already read (:func:`stored_done_files`), else it is read here."""
    diff: dict[str, tuple[Any, Any]] = {}
    if config is None:
        config = read_config(cell_dir(root, cell))
    for stored in (status.get("cell") if status is not None else None, config):
        if isinstance(stored, dict):
            for key, change in identity_diff(stored, cell).items():
                diff.setdefault(key, change)
    return diff


def _canonical(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))  # as stored in config.json


UNSET = object()  # a parameter one side of a comparison does not set


def identity_diff(stored: dict, cell: dict, keys: tuple[str, ...] = IDENTITY_KEYS) -> dict[str, tuple[Any, Any]]:
    """``{key: (stored, new)}`` for each of ``keys`` (identity keys) that differs (``params.NAME`` per
    parameter, ``params.SECTION.NAME`` inside a section); a parameter set on one side only has the value
    ``UNSET`` on the other."""
    diff: dict[str, tuple[Any, Any]] = {}
    new = _canonical(cell)
    for key in keys:
        if key == "params":
            old_p, new_p = flat_params(stored.get("params") or {}), flat_params(new.get("params") or {})
            for name in sorted(set(old_p) | set(new_p)):
                a, b = old_p.get(name, UNSET), new_p.get(name, UNSET)
                if a != b:
                    diff[f"params.{name}"] = (a, b)
        elif (key in stored or key in OPTIONAL_IDENTITY_KEYS) and stored.get(key) != new.get(key):
            diff[key] = (stored.get(key), new.get(key))
    return diff


def show_change(key: str, old: Any, new: Any) -> str:
    """``params.lr: 0.05 (stored) -> 0.2 (now)``."""
    def show(v: Any) -> str:
        return "unset" if v is UNSET else json.dumps(v, default=str)

    return f"{key}: {show(old)} (stored) -> {show(new)} (now)"


class CellMismatchError(UsageError):
    """A finished cell in the output directory was computed with other settings than the one asked for (a usage
    error: ``gacbench bench`` prints it as one line and exits 2)."""


@contextlib.contextmanager
def claim(d: Path) -> Iterator[dict | None]:
    """Claim the cell directory ``d`` for the ``with`` block (:func:`gacbench.jsonio.claim_dir`): yields None when
    this process holds the claim (its pid, host and start time are then written in ``d/.claim``), else the record
    of the process that holds it (``{"pid", "host", "since"}``, or ``{}`` while the holder has not written it yet)."""
    with claim_dir(d) as (held, record):
        yield None if held else record


def claim_released(d: Path) -> bool:
    """Whether no process holds the claim on the cell directory ``d`` (tested without taking it for long)."""
    if not (d / CLAIM_FILE).exists():
        return True
    with hold(d / CLAIM_FILE, wait=False) as held:
        return held


@contextlib.contextmanager
def summary_lock(root: Path) -> Iterator[None]:
    """Serialise the writing of ``root``'s summary across processes (``root/.report.lock``)."""
    with hold(Path(root) / ".report.lock", wait=True):
        yield


#: the status :func:`run_cell` returns, without writing it, for a cell that another process holds
CLAIMED = "claimed"


def stored_provenance(root: Path, cell: dict, config: Any = None) -> dict | None:
    """The ``provenance`` of the run stored in ``cell``'s directory (its config.json), else the cell's own, else
    None (a cell stored without it, or whose config.json cannot be read: ``unrecorded``). ``config``: the
    config.json already read (:func:`stored_done_files`), else it is read here."""
    if config is None:
        config = read_config(cell_dir(Path(root), cell))
    prov = config.get("provenance") if isinstance(config, dict) else None
    if prov is None:
        prov = cell.get("provenance")
    return prov if isinstance(prov, dict) else None


def cell_provenance(cell: dict) -> dict[str, Any]:
    """What ``cell`` records as its provenance when it runs in this process: :func:`gacbench.provenance.provenance`
    and, where its method uses stabilizer plug-ins, ``plugins`` (:func:`gacbench.methods.plugin_provenance`)."""
    prov = provenance()
    plugins = plugin_provenance(cell["method"]) if cell.get("method") else {}
    return {**prov, "plugins": plugins} if plugins else prov


def stored_environment(root: Path, cell: dict, config: Any = None) -> str:
    """The :func:`gacbench.provenance.environment_key` of the run stored in ``cell``'s directory
    (``unrecorded`` when its config.json holds no provenance); ``config`` as :func:`stored_provenance`."""
    return environment_key(stored_provenance(root, cell, config), weights=False)


def run_cell(cell: dict, root: str | os.PathLike, threads: int | None = None,
             rerun_other_versions: bool = False) -> dict:
    """Run one cell unless its directory already records it as done; returns its status.

    The cell is claimed first (:func:`claim`): a cell another process holds is left to it, and the status
    returned is ``{"status": "claimed", "holder": {...}, "cell": cell}`` (nothing is written). A done cell is
    returned as stored, with ``"reused": True``; with ``rerun_other_versions`` a done cell stored by another
    environment (:func:`stored_environment` differs from this process's, with ``threads`` set) is recomputed.
    A done cell computed with other settings (:func:`identity_diff`) raises CellMismatchError. A full disk
    (``ENOSPC``, ``EDQUOT``) raises its OSError rather than recording the cell as failed.
    """
    out = cell_dir(Path(root), cell)
    with claim(out) as holder:
        if holder is not None:
            return {"status": CLAIMED, "holder": holder, "cell": cell}
        return _run_claimed(cell, Path(root), out, threads, rerun_other_versions)


def _run_claimed(cell: dict, root: Path, out: Path, threads: int | None, rerun_other_versions: bool) -> dict:
    started_at, t_start = time.time(), time.perf_counter()
    status_path = out / "status.json"
    if threads:
        torch.set_num_threads(threads)
    done = stored_done(root, cell)
    if done is not None:
        diff = stored_diff(root, cell, done)
        if diff:
            changes = "; ".join(show_change(k, a, b) for k, (a, b) in diff.items())
            raise CellMismatchError(f"{out} holds a finished run with other settings ({changes}); use another output "
                                    "directory, or delete that cell directory to recompute it")
        if not (rerun_other_versions and stored_environment(root, cell) != environment_key(cell_provenance(cell))):
            return {**done, "reused": True}
    status_path.unlink(missing_ok=True)  # a failed or incomplete earlier run: unfinished until this one ends
    t_write = time.perf_counter()
    prov = cell_provenance(cell)
    write_json(out / "config.json", {**cell, "provenance": prov})
    parts = {"write": time.perf_counter() - t_write}
    t0 = time.perf_counter()
    try:
        status = _run(cell, out)
        parts.update(status.pop("time"))
        weights = status.pop("initial_weights", None)
        known = {"initial_weights": weights} if weights else {}  # once the objective loaded its model
        changed = source_changed(prov["source_sha256"])
        if changed:  # the library's files changed while the cell ran: its key names both hashes
            known["source_sha256_end"] = changed
        if known:
            write_json(out / "config.json", {**cell, "provenance": {**prov, **known}})
    except Exception as exc:  # a failed cell is recorded and never stops the grid
        if isinstance(exc, OSError) and exc.errno in DISK_FULL:
            raise
        status = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    ended_at = started_at + (time.perf_counter() - t_start)
    status.update({"cell": cell, "seconds": time.perf_counter() - t0, "worker_pid": os.getpid(), "rss_mb": rss_mb(),
                   "started_at": started_at, "ended_at": ended_at, "time": cell_parts(parts, ended_at - started_at)})
    write_json(status_path, json_safe(status))  # strict JSON: a diverged run's non-finite final is null
    return status


def _run(cell: dict, out: Path) -> dict:
    import logging
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*exists and is not empty.*")
    warnings.filterwarnings("ignore", "GAC: skipping step")  # counted per step in gac/bad_grad
    t_begin = time.perf_counter()
    pl.seed_everything(cell["seed"], verbose=False)
    method, _ = parse_method(cell["method"])
    s = int(cell["staleness"]) if method.stale else 0
    params = dict(cell.get("params", {}))
    cls = objective_class(cell["objective"])
    model = cls(**params, seed=cell["seed"], steps=cell["steps"], **({"staleness": s} if cls.rollout_staleness else {}))
    callbacks: list[pl.Callback] = []
    if cell.get("assumptions"):  # before the simulator, which swaps in the stale iterate
        callbacks.append(AssumptionMonitor(every=int(cell["assumptions"])))
    if s > 0 and not model.rollout_staleness:
        callbacks.append(StalenessSimulator(s))
    # align/step_cos too: the trace the step reading (gac-step-calibrated) calibrates from
    callbacks.append(AlignmentMonitor(warmup=cell.get("warmup", 0), step_cos=True))
    callbacks += method_callbacks(cell["method"], cell)  # a method with a reference reads cell["calibration"]
    callbacks.append(DriftMonitor())  # param/drift, param/step_norm: the parameters after every edit of the step
    timer = StepTimer()
    callbacks += [timer, DivergenceStop()]
    evals = EvalTimer(model)
    t_setup = time.perf_counter()
    initial = model.metric()
    t_trainer = time.perf_counter()
    trainer = build_trainer(cell["steps"], callbacks, CSVLogger(save_dir=str(out), name="", version=""),
                            accelerator=getattr(cls, "accelerator", "cpu"))
    t_fit = time.perf_counter()
    eval_before_fit = evals.seconds
    trainer.fit(model)
    fit_s = time.perf_counter() - t_fit
    eval_in_fit = evals.seconds - eval_before_fit
    final = model.final_metric()
    costs = getattr(model, "cost_s", {})  # an objective's own one-off costs: model load, engine start-up
    model_s, engine_s = costs.get("model", 0.0), costs.get("engine", 0.0)
    setup_s = (t_setup - t_begin) + (t_fit - t_trainer) - model_s
    time_parts = {"setup": setup_s, "model": model_s, "engine": engine_s, "eval": evals.seconds,
                  "steps": timer.step_s(), "trainer": fit_s - timer.step_s() - eval_in_fit - engine_s}
    return {
        "status": "done", "initial": initial, "final": final, "diverged": model.diverged(initial, final),
        "metric": model.metric_name, "higher_is_better": model.higher_is_better,
        "steps_run": trainer.global_step, "overhead_share": timer.overhead_share(),
        "step_ms": 1e3 * statistics.median(timer.total) if timer.total else math.nan,
        "step_s": timer.step_s(), "eval_s": evals.seconds, "time": time_parts,
        "initial_weights": getattr(model, "initial_weights", None),
    }
