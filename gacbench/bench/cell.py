"""One cell of a benchmark grid: (task, method, staleness, seed) -> a run directory.

A cell directory holds ``config.json`` (what was run), ``metrics.csv`` (every logged scalar, per
step, through Lightning's CSVLogger) and ``status.json`` (done or failed, the final metric, timing).
Every file is written atomically, so a killed worker leaves either no status or a complete one.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger

from gacbench.callbacks import AlignmentMonitor, StalenessSimulator
from gacbench.methods import method_callbacks, parse_method
from gacbench.objectives import objective_class


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


class StepTimer(pl.Callback):
    """Splits each optimizer step into the objective's own forward + backward and everything else."""

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


class DivergenceStop(pl.Callback):
    """Stops a run whose loss is no longer finite: later steps cannot change the verdict."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None and not torch.isfinite(loss).all():
            trainer.should_stop = True


def cell_dir(root: Path, cell: dict) -> Path:
    method = "".join(ch if ch.isalnum() or ch in "-_+.=" else "_" for ch in cell["method"])
    return root / "cells" / cell["task"] / method / f"s{cell['staleness']}" / f"seed{cell['seed']}"


def run_cell(cell: dict, root: str | os.PathLike, threads: int | None = None) -> dict:
    """Run one cell unless its directory already records it as done; returns its status."""
    out = cell_dir(Path(root), cell)
    status_path = out / "status.json"
    if status_path.exists():
        status = read_json(status_path)
        if status.get("status") == "done":
            return status
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", cell)
    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        status = _run(cell, out)
    except Exception as exc:  # a failed cell is recorded and never stops the grid
        status = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    status.update({"cell": cell, "seconds": time.perf_counter() - t0})
    write_json(status_path, status)
    return status


def _run(cell: dict, out: Path) -> dict:
    import logging
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*exists and is not empty.*")
    warnings.filterwarnings("ignore", "GAC: skipping step")  # counted per step in gac/bad_grad
    pl.seed_everything(cell["seed"], verbose=False)
    method, _ = parse_method(cell["method"])
    s = int(cell["staleness"]) if method.stale else 0
    params = dict(cell.get("params", {}))
    cls = objective_class(cell["objective"])
    model = cls(**params, seed=cell["seed"], steps=cell["steps"], **({"staleness": s} if cls.rollout_staleness else {}))
    callbacks: list[pl.Callback] = []
    if s > 0 and not model.rollout_staleness:
        callbacks.append(StalenessSimulator(s))
    callbacks.append(AlignmentMonitor(warmup=cell.get("warmup", 0)))
    callbacks += method_callbacks(cell["method"])
    timer = StepTimer()
    callbacks += [timer, DivergenceStop()]
    initial = model.metric()
    trainer = pl.Trainer(
        max_steps=cell["steps"], accelerator="cpu", devices=1, callbacks=callbacks, log_every_n_steps=1,
        logger=CSVLogger(save_dir=str(out), name="", version=""), enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
    )
    trainer.fit(model)
    final = model.metric()
    return {
        "status": "done", "initial": initial, "final": final, "diverged": model.diverged(initial, final),
        "metric": model.metric_name, "higher_is_better": model.higher_is_better,
        "steps_run": trainer.global_step, "overhead_share": timer.overhead_share(),
        "step_ms": 1e3 * statistics.median(timer.total) if timer.total else math.nan,
    }
