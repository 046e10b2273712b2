"""``gacbench bench``: a grid of (task, method, staleness, seed) cells, each a stored run.

Cells run in a local process pool (default) or on a Ray cluster. A cell whose directory records
it as done is never rerun, so an interrupted grid resumes where it stopped; a failed cell is
recorded with its error and the grid goes on. Summary tables and figures are then built from
the stored runs alone (:mod:`gacbench.bench.report`).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from gacbench.bench.cell import cell_dir, read_json, run_cell
from gacbench.methods import parse_method, split_top_level
from gacbench.objectives import LAZY, OBJECTIVES

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
    raise ValueError(f"unknown suite {name!r}; known suites: {', '.join(known) or 'none (run from a clone of the repository)'}, "
                     "or give the path of a suite YAML file")


def load_suite(name: str) -> dict[str, Any]:
    suite = yaml.safe_load(suite_path(name).read_text())
    for key in ("tasks", "methods", "staleness", "seeds", "steps"):
        if key not in suite:
            raise ValueError(f"suite {name!r} has no {key!r}")
    for task, spec in suite["tasks"].items():
        if spec.get("objective") not in OBJECTIVES and spec.get("objective") not in LAZY:
            raise ValueError(f"suite {name!r}, task {task!r}: objective {spec.get('objective')!r} is not one of "
                             f"{', '.join(list(OBJECTIVES) + list(LAZY))}")
    return suite


def expand_cells(suite: dict, methods: list[str] | None = None, staleness: list[int] | None = None,
                 seeds: list[int] | None = None, tasks: list[str] | None = None) -> list[dict]:
    """The grid as a list of cell dicts. ``sync`` runs once at s = 0; stale methods run at each s > 0."""
    explicit = methods is not None
    methods = methods or suite["methods"]
    staleness = suite["staleness"] if staleness is None else staleness
    seeds = suite["seeds"] if seeds is None else seeds
    tasks = tasks or list(suite["tasks"])
    for s in staleness:
        if not isinstance(s, int) or s < 0:
            raise ValueError(f"staleness {s!r} must be a non-negative integer")
    for t in tasks:
        if t not in suite["tasks"]:
            raise ValueError(f"task {t!r} is not in the suite; its tasks: {', '.join(suite['tasks'])}")
    def base(task: str) -> dict:
        spec = suite["tasks"][task]
        return {"task": task, "objective": spec["objective"], "params": spec.get("params", {}),
                "steps": spec.get("steps", suite["steps"]), "warmup": suite.get("warmup", 0)}

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
    if ablation and methods == suite["methods"]:
        for task in tasks:
            for lo in ablation["c_low"]:
                for hi in ablation["c_high"]:
                    if lo >= hi:
                        continue
                    for seed in seeds:
                        cells.append({**base(task), "method": f"{ablation.get('method', 'gac')}(c_low={lo},c_high={hi})",
                                      "staleness": ablation["staleness"], "seed": seed, "ablation": True})
    return cells


def is_done(root: Path, cell: dict) -> bool:
    status = cell_dir(root, cell) / "status.json"
    return status.exists() and read_json(status).get("status") == "done"


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


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
    """Run every cell not yet done; returns timing figures."""
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    console = console or Console()
    pending = [c for c in cells if not is_done(root, c)]
    done_before = len(cells) - len(pending)
    if workers < 1:
        raise ValueError(f"--workers {workers} must be >= 1")
    threads = max(1, (os.cpu_count() or 1) // workers)
    display = _Display(len(cells), done_before, console)
    t0 = time.perf_counter()
    results: list[dict] = []
    with display.progress:
        if not pending:
            pass
        elif executor == "ray":
            results = _run_ray(pending, root, workers, threads, display)
        elif executor == "local" and workers == 1:
            for cell in pending:
                display.update(running=1)
                results.append(run_cell(cell, root, threads))
                display.update(running=0, finished=results[-1])
        elif executor == "local":
            results = _run_pool(pending, root, workers, threads, display)
        else:
            raise ValueError(f"--executor {executor!r} is not 'local' or 'ray'")
    wall = time.perf_counter() - t0
    failed = [r for r in results if r.get("status") != "done"]
    return {"cells": len(cells), "ran": len(results), "skipped_done": done_before, "failed": len(failed),
            "wall_s": wall, "cells_per_min": 60.0 * len(results) / wall if results and wall > 0 else 0.0}


def _needs_fresh_process(cells: list[dict]) -> bool:
    """Objectives that hold an in-process engine (GRPO with vLLM) do not give all its memory back when a
    cell ends; a worker that ran many such cells grew until the kernel killed it. Those grids run every
    cell in a fresh worker process (a few seconds of start-up per cell)."""
    from gacbench.objectives import objective_class

    return any(getattr(objective_class(o), "fresh_process", False) for o in {c["objective"] for c in cells})


def _run_pool(pending: list[dict], root: Path, workers: int, threads: int, display: _Display) -> list[dict]:
    results = []
    fresh = {"max_tasks_per_child": 1} if _needs_fresh_process(pending) else {}
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"),
                             initializer=_init_worker, initargs=(threads,), **fresh) as pool:
        futures = {pool.submit(run_cell, c, str(root), threads) for c in pending}
        display.update(running=min(workers, len(futures)))
        while futures:
            finished, futures = wait(futures, return_when=FIRST_COMPLETED)
            for f in finished:
                results.append(f.result())
                display.update(running=min(workers, len(futures)), finished=results[-1])
    return results


def _run_ray(pending: list[dict], root: Path, workers: int, threads: int, display: _Display) -> list[dict]:
    try:
        import ray
    except ImportError:
        raise RuntimeError("--executor ray needs Ray: pip install -e '.[ray]'") from None
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 **({} if address else {"num_cpus": workers}))
    remote = ray.remote(num_cpus=1, max_calls=1 if _needs_fresh_process(pending) else 0)(run_cell)
    refs = [remote.remote(c, str(root.resolve()), threads) for c in pending]
    results = []
    display.update(running=min(workers, len(refs)))
    while refs:
        ready, refs = ray.wait(refs, num_returns=1)
        results.append(ray.get(ready[0]))
        display.update(running=min(workers, len(refs)), finished=results[-1])
    return results


def parse_params(items: list[str]) -> dict[str, Any]:
    """``["engine=hf", "lr=1e-3"]`` -> ``{"engine": "hf", "lr": 0.001}`` (values read as YAML scalars)."""
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--param {item!r}: expected KEY=VALUE, e.g. --param engine=hf")
        if key in RESERVED_PARAMS:
            raise ValueError(f"--param {key}: set by the grid itself; use --seeds / --staleness, or the suite's 'steps'")
        try:
            parsed = yaml.safe_load(value) if value.strip() else value
        except yaml.YAMLError:
            parsed = value
        if isinstance(parsed, (dict, list)):  # e.g. a template "{problem}": keep the text
            parsed = value
        out[key] = float(parsed) if isinstance(parsed, str) and _is_number(parsed) else parsed
    return out


RESERVED_PARAMS = ("seed", "steps", "staleness")


def check_params(cells: list[dict]) -> None:
    """Every cell's params must be arguments of its objective: a typo fails here, not in every cell."""
    import inspect

    from gacbench.objectives import objective_class

    for c in cells:
        accepted = inspect.signature(objective_class(c["objective"]).__init__).parameters
        unknown = sorted(set(c["params"]) - set(accepted))
        if unknown:
            raise ValueError(f"task {c['task']!r} ({c['objective']}): unknown parameter(s) {', '.join(unknown)}; "
                             f"accepted: {', '.join(k for k in accepted if k != 'self')}")


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
    cells = expand_cells(
        suite,
        methods=split_top_level(args.methods, ",") if args.methods else None,
        staleness=[int(x) for x in args.staleness.split(",")] if args.staleness else None,
        seeds=[int(x) for x in args.seeds.split(",")] if args.seeds else None,
        tasks=args.tasks.split(",") if args.tasks else None,
    )
    overrides = parse_params(getattr(args, "param", None) or [])
    for c in cells:
        c["params"] = {**c["params"], **overrides}
    if overrides:
        check_params(cells)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console.print(f"suite [bold]{suite.get('name', args.suite)}[/]: {len(cells)} cells -> {out}  (workers={args.workers}, executor={args.executor})")
    if not any(c["method"] == "sync" for c in cells):
        console.print("[yellow]note[/]: no sync cell in this grid (sync needs staleness 0): the recovered shares cannot be computed")
    timing = run_grid(cells, out, args.workers, args.executor, console)
    report = build_report(out, cells=cells)
    console.print(
        f"ran {timing['ran']} cells ({timing['skipped_done']} already done, {timing['failed']} failed) in "
        f"{timing['wall_s']:.1f} s: {timing['cells_per_min']:.1f} cells/min; median framework share of step time "
        f"{report['overhead_share_median']:.0%}"
    )
    console.print(f"wrote {out / 'summary.json'}, {out / 'summary.md'} and {len(report['figures'])} figures")
    return 1 if timing["failed"] else 0
