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
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import yaml
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
from gacbench.bench.timing import timing_lines, timing_record  # noqa: F401  (timing_record re-exported)
from gacbench.functional.calibration import calibration_record
from gacbench.methods import (
    method_callbacks,
    parse_method,
    reference_cell,
    reference_rule,
    split_top_level,
    sync_cell,
)
from gacbench.objectives import is_registered, objective_class, registered_objectives
from gacbench.usage import UsageError, check_output_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
SUITES_DIR = REPO_ROOT / "tasks" / "suites"


def suite_path(name: str) -> Path:
    """A suite by name (tasks/suites/NAME.yaml) or by path."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    candidate = SUITES_DIR / f"{name}.yaml"
    if candidate.exists():
        return candidate
    known = sorted(x.stem for x in SUITES_DIR.glob("*.yaml")) if SUITES_DIR.exists() else []
    raise UsageError(f"--suite: unknown suite {name!r}; known suites: "
                     f"{', '.join(known) or 'none (run from a clone of the repository)'}, "
                     "or give the path of a suite YAML file")


SEED_MAX = 2**32 - 1  # the seeds numpy (hence Lightning's seed_everything) accepts: 0..2**32 - 1
EXAMPLES = {"--methods": "sync,stale,gac", "--staleness": "0,8,16", "--seeds": "0,1,2", "--tasks": "quadratic,bandit"}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_list(where: str, key: str, value: Any, lo: int, hi: int | None = None) -> list[int]:
    """A suite's list of integers in [lo, hi] without repeats, else a UsageError naming the key."""
    example = "[0, 8, 16]" if key == "staleness" else "[0, 1, 2]"
    if not isinstance(value, list) or not value:
        raise UsageError(f"{where}: {key}: {value!r} must be a non-empty list, e.g. {key}: {example}")
    for x in value:
        if not _is_int(x) or x < lo or (hi is not None and x > hi):
            bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise UsageError(f"{where}: {key}: {x!r} is not an integer {bound}")
    _no_repeats(f"{where}: {key}:", value)
    return value


def _no_repeats(where: str, values: list) -> None:
    seen: set = set()
    for x in values:
        if x in seen:
            note = " (a repeated seed would count the same run twice)" if "seeds" in where else ""
            raise UsageError(f"{where} lists {x} twice; give each value once{note}")
        seen.add(x)


ABLATION = "ablation"  # the --methods keyword that selects a suite's threshold-ablation cells


def _check_methods(where: str, methods: Any) -> list[str]:
    if not isinstance(methods, list) or not methods or not all(isinstance(m, str) and m.strip() for m in methods):
        raise UsageError(f"{where}: {methods!r} must be a non-empty list of method names, e.g. [sync, stale, gac]")
    _no_repeats(where, [m.strip() for m in methods])
    for m in methods:
        try:
            method_callbacks(m)  # an unknown name or setting fails here, not in every cell
        except ValueError as exc:
            raise UsageError(f"{where} {exc}") from None
    return methods


def has_loss_on(objective: str) -> bool:
    """Whether the objective defines its own side-effect-free ``loss_on`` (what AssumptionMonitor needs)."""
    from gacbench.objectives.base import Objective

    return getattr(objective_class(objective), "loss_on", Objective.loss_on) is not Objective.loss_on


def load_suite(name: str) -> dict[str, Any]:
    """A suite YAML file, checked: a malformed or empty file, a missing key, or a value of the wrong kind
    raises a UsageError that names the file and the key."""
    path = suite_path(name)
    where = f"suite {path}"
    try:
        suite = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or type(exc).__name__
        line = f" (line {mark.line + 1})" if mark else ""
        raise UsageError(f"{where} is not valid YAML{line}: {problem}; fix the file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{where} cannot be read ({exc})") from None
    if suite is None:
        raise UsageError(f"{where} is empty; a suite sets tasks, methods, staleness, seeds and steps "
                         f"(see {SUITES_DIR / 'synthetic-smoke.yaml'})")
    if not isinstance(suite, dict):
        raise UsageError(f"{where} must be a mapping with the keys tasks, methods, staleness, seeds and steps; "
                         f"it holds a {type(suite).__name__}")
    for key in ("tasks", "methods", "staleness", "seeds", "steps"):
        if key not in suite:
            raise UsageError(f"{where} has no {key!r}; a suite sets tasks, methods, staleness, seeds and steps")
    if not _is_int(suite["steps"]) or suite["steps"] < 1:
        raise UsageError(f"{where}: steps: {suite['steps']!r} is not a positive integer (e.g. steps: 300)")
    if not _is_int(suite.get("warmup", 0)) or suite.get("warmup", 0) < 0:
        raise UsageError(f"{where}: warmup: {suite['warmup']!r} is not a non-negative integer")
    if "assumptions" in suite and (not _is_int(suite["assumptions"]) or suite["assumptions"] < 2):
        raise UsageError(f"{where}: assumptions: {suite['assumptions']!r} is not an integer >= 2 (AssumptionMonitor's "
                         "every: estimate L and eta_max(s) every this many steps)")
    _int_list(where, "staleness", suite["staleness"], 0)
    _int_list(where, "seeds", suite["seeds"], 0, SEED_MAX)
    _check_methods(f"{where}: methods:", suite["methods"])
    if not isinstance(suite["tasks"], dict) or not suite["tasks"]:
        raise UsageError(f"{where}: tasks: must map task names to {{objective: NAME, params: {{...}}}}")
    for task, spec in suite["tasks"].items():
        at = f"{where}, task {task!r}"
        if not isinstance(spec, dict):
            raise UsageError(f"{at}: must be a mapping such as {{objective: quadratic, params: {{lr: 0.1}}}}")
        if not is_registered(spec.get("objective")):
            raise UsageError(f"{at}: objective {spec.get('objective')!r} is not one of "
                             f"{', '.join(registered_objectives())}")
        if spec.get("params") is None:
            spec["params"] = {}
        if not isinstance(spec["params"], dict):
            raise UsageError(f"{at}: params: {spec['params']!r} must be a mapping of parameter names to values")
        if "steps" in spec and (not _is_int(spec["steps"]) or spec["steps"] < 1):
            raise UsageError(f"{at}: steps: {spec['steps']!r} is not a positive integer")
        if suite.get("assumptions") and not has_loss_on(spec["objective"]):
            raise UsageError(f"{at}: assumptions: objective {spec['objective']!r} has no side-effect-free loss_on, "
                             "which AssumptionMonitor needs; drop assumptions: from the suite, or use an objective "
                             "that defines loss_on (quadratic, logistic, mlp, grpo)")
        if "extra_methods" in spec:
            _check_methods(f"{at}: extra_methods:", spec["extra_methods"])
    ablation = suite.get("ablation")
    if ablation is not None:
        if not isinstance(ablation, dict) or not all(k in ablation for k in ("staleness", "c_low", "c_high")):
            raise UsageError(f"{where}: ablation: must be a mapping with staleness, c_low and c_high "
                             "(and optionally method)")
        if not _is_int(ablation["staleness"]) or ablation["staleness"] < 1:
            raise UsageError(f"{where}: ablation: staleness: {ablation['staleness']!r} is not a positive integer")
        for key in ("c_low", "c_high"):
            values = ablation[key]
            numbers = isinstance(values, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                       for x in values)
            if not values or not numbers:
                raise UsageError(f"{where}: ablation: {key}: {values!r} must be a non-empty list of numbers")
        _check_methods(f"{where}: ablation: method:", [ablation.get("method", "gac")])
    return suite


def parse_list(option: str, text: str | None, split=None) -> list[str] | None:
    """A comma-separated option value as a list; None (the suite's default) when the option is not given.
    An empty value, an empty item (``0,``) or a repeated item is refused, naming the option."""
    if text is None:
        return None
    example = f"e.g. {option} {EXAMPLES.get(option, 'a,b')}"
    if not text.strip():
        raise UsageError(f"{option} is empty; give comma-separated values ({example}), or leave {option} out for "
                         "the suite's own")
    items = [x.strip() for x in (split(text) if split else text.split(","))]
    if "" in items:
        raise UsageError(f"{option} {text!r} has an empty item (a stray comma?); {example}")
    _no_repeats(f"{option} {text!r}", items)
    return items


def parse_int_list(option: str, text: str | None, lo: int, hi: int | None = None) -> list[int] | None:
    """:func:`parse_list` of integers in [lo, hi]: ``2.5``, ``x`` or ``-1`` is refused, naming the option."""
    items = parse_list(option, text)
    if items is None:
        return None
    values = []
    for x in items:
        try:
            v = int(x)
        except ValueError:
            raise UsageError(f"{option} {text!r}: {x!r} is not an integer; e.g. {option} {EXAMPLES[option]}") from None
        if v < lo or (hi is not None and v > hi):
            bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise UsageError(f"{option} {text!r}: {v} is not {bound}")
        values.append(v)
    _no_repeats(f"{option} {text!r}", values)
    return values


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


def _exit_without_teardown() -> None:
    """A worker's last act (registered with atexit): its results are sent and its files written by then, so
    it skips the interpreter's teardown, which after an LLM cell takes seconds per worker (closing the vLLM
    engine, freeing every module's objects) while the runner waits for the workers to end."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


def _init_worker(threads: int, parent_pid: int | None = None) -> None:
    import atexit

    import torch

    torch.set_num_threads(threads)
    _die_with_parent(parent_pid)
    atexit.register(_exit_without_teardown)  # runs before the handlers registered earlier (atexit is LIFO)


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
    t0, grid_started_at = time.perf_counter(), time.time()
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
              "executor": executor, **timing_record(results, wall, used if results else 0, grid_started_at)}
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


def parse_params(items: list[str]) -> dict[str, Any]:
    """``["engine.name=hf", "lr=1e-3"]`` -> ``{"engine": {"name": "hf"}, "lr": 0.001}``: values read as YAML
    scalars; a dotted key sets a field of a parameter that is a section (a dict)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        path = key.split(".")
        if not sep or not key or not all(path):
            raise UsageError(f"--param {item!r}: expected KEY=VALUE or SECTION.KEY=VALUE, e.g. --param lr=3e-4 "
                             "or --param engine.name=hf")
        if path[0] in RESERVED_PARAMS:
            raise UsageError(f"--param {key}: set by the grid itself; use --seeds / --staleness, "
                             "or the suite's 'steps'")
        try:
            parsed = yaml.safe_load(value) if value.strip() else value
        except yaml.YAMLError:
            parsed = value
        if isinstance(parsed, (dict, list)):  # e.g. a template "{problem}": keep the text
            parsed = value
        parsed = float(parsed) if isinstance(parsed, str) and _is_number(parsed) else parsed
        out = merge_params(out, _nest(path, parsed))
    return out


def _nest(path: list[str], value: Any) -> dict[str, Any]:
    for key in reversed(path):
        value = {key: value}
    return value


def merge_params(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` applied: a dict merges into a dict key by key, anything else replaces."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_params(out[key], value)
        else:
            out[key] = value
    return out


RESERVED_PARAMS = ("seed", "steps", "staleness")


def _hints(target: Any) -> dict[str, Any]:
    import typing

    try:
        return typing.get_type_hints(target)
    except Exception:  # unresolvable annotations: no type check
        return {}


def _section_type(cls: type, name: str) -> type | None:
    """The dataclass of parameter ``name`` of ``cls.__init__`` when its type is one (a section), else None."""
    import dataclasses
    import typing

    hint = _hints(cls.__init__).get(name)
    for arg in typing.get_args(hint) or (hint,):
        if isinstance(arg, type) and dataclasses.is_dataclass(arg):
            return arg
    return None


def _section_fields(cls: type, name: str) -> set[str] | None:
    """The fields of parameter ``name`` of ``cls.__init__`` when its type is a dataclass (a section), else None."""
    import dataclasses

    section = _section_type(cls, name)
    return None if section is None else {f.name for f in dataclasses.fields(section)}


def type_ok(value: Any, hint: Any) -> bool | None:
    """Whether ``value`` (read from YAML) fits the annotation ``hint``: True, False, or None when the
    annotation is not one this check knows (then the objective itself decides)."""
    import dataclasses
    import types
    import typing

    if hint is None or hint is typing.Any:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        results = [type_ok(value, arm) for arm in typing.get_args(hint)]
        return True if True in results else (None if None in results else False)
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return _is_int(value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint in (list, tuple) or origin in (list, tuple):
        return isinstance(value, (list, tuple))
    if hint is dict or origin is dict or (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
        return isinstance(value, dict)
    return None


def describe_type(hint: Any) -> str:
    """``float | None`` -> ``a number or null``."""
    import dataclasses
    import types
    import typing

    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(describe_type(a) for a in typing.get_args(hint)))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    names = {bool: "true or false", int: "an integer", float: "a number", str: "text", type(None): "null",
             dict: "a section", list: "a list", tuple: "a list"}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return "a section"
    return names.get(origin or hint, getattr(hint, "__name__", str(hint)))


def _describe_value(value: Any) -> str:
    if isinstance(value, str):
        note = " (YAML reads 1e-3 as text: write 1.0e-3)" if _is_number(value) else ""
        return f"the text {value!r}{note}"
    return f"{json.dumps(value, default=str)} ({'true or false' if isinstance(value, bool) else type(value).__name__})"


def _flat_keys(params: dict, prefix: str = "") -> set[str]:
    out: set[str] = set()
    for key, value in params.items():
        out |= _flat_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}"}
    return out


def check_params(cells: list[dict], overrides: dict[str, Any] | None = None) -> None:
    """Every cell's params must be arguments of its objective, of the annotated type, and a section's keys
    fields of that section, of their types: a typo or a wrong type fails here, not in every cell. A bad
    value that came from ``overrides`` (``--param``) is named as ``--param KEY``."""
    import inspect

    from_cli = _flat_keys(overrides or {})
    checked: set[tuple[str, str]] = set()
    for c in cells:
        key = engine_key(c)
        if key in checked:
            continue
        checked.add(key)
        cls = objective_class(c["objective"])
        where = f"task {c['task']!r} ({c['objective']})"
        accepted = inspect.signature(cls.__init__).parameters
        any_name = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        unknown = [] if any_name else sorted(set(c["params"]) - set(accepted))
        if unknown:
            raise UsageError(f"{where}: unknown parameter(s) {', '.join(unknown)}; "
                             f"accepted: {', '.join(k for k in accepted if k != 'self')}")
        hints = _hints(cls.__init__)

        def refuse(name: str, value: Any, hint: Any) -> None:
            origin = f"--param {name}" if name in from_cli else f"{where}: parameter {name} (suite)"
            raise UsageError(f"{origin}: {name} takes {describe_type(hint)}, got {_describe_value(value)}")

        for name, value in c["params"].items():
            section = _section_type(cls, name)
            if section is None:
                if type_ok(value, hints.get(name)) is False:
                    refuse(name, value, hints[name])
                continue
            if value is None:
                continue
            fields = _section_fields(cls, name)
            if not isinstance(value, dict):
                raise UsageError(f"{where}: parameter {name!r} is a section with the "
                                 f"fields {', '.join(sorted(fields))}; set a field: --param {name}.FIELD=VALUE")
            bad = sorted(set(value) - fields)
            if bad:
                raise UsageError(f"{where}: unknown {name} setting(s) "
                                 f"{', '.join(f'{name}.{k}' for k in bad)}; the {name} section takes "
                                 f"{', '.join(sorted(fields))}")
            field_hints = _hints(section)
            for field, v in value.items():
                if type_ok(v, field_hints.get(field)) is False:
                    refuse(f"{name}.{field}", v, field_hints[field])


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def main(args) -> int:
    from gacbench.bench.report import build_report

    console = Console()
    suite = load_suite(args.suite)
    methods = parse_list("--methods", args.methods, lambda t: split_top_level(t, ","))
    if methods is not None and ABLATION in methods and not suite.get("ablation"):
        raise UsageError(f"--methods: {ABLATION!r} selects the suite's threshold-ablation cells, and suite "
                         f"{suite.get('name', args.suite)!r} has no ablation: section")
    if methods is not None and [m for m in methods if m != ABLATION]:
        _check_methods("--methods:", [m for m in methods if m != ABLATION])
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
    for line in timing_lines(timing, verbose=getattr(args, "verbose", False)):
        console.print(line, highlight=False)
    console.print(f"wrote {out / 'summary.json'}, {out / 'summary.md'} and {len(report['figures'])} figures "
                  f"({len(report['summary']['cells'])} stored cells)")
    return 1 if timing["failed"] else 0
