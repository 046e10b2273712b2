"""DriftMonitor: how far training has moved the parameters, and how long each applied step was.

After every optimizer step it logs ``param/drift`` = ||theta_k - theta_0|| (theta_0: the parameters at the start
of fit, theta_k: after k steps) and ``param/step_norm`` = ||theta_k - theta_{k-1}||, both over every parameter of
the optimizer, at the logger step k (the number of steps taken). The parameters are read in
``on_train_batch_end``: after the optimizer's step and every edit made after it (``GAC(target="step")`` projects
or skips the step in an optimizer hook), and after StalenessSimulator has put the current parameters back. So
the step norm is the step actually applied, and the drift is the distance the run has actually travelled: the
measure that tells a rule that shortens the path (a smaller effective learning rate) from one that only turns it.

Memory: two parameter-sized float32 buffers (theta_0 and the previous parameters), both checkpointed, so a
resumed run logs the values an uninterrupted one does.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from gacbench.callbacks._common import (
    agree,
    check_no_replicated_shards,
    check_strategy,
    is_sharded,
    load_tensor,
    local,
    log_metrics,
    optimizer_params,
    save_tensor,
)
from gacbench.functional.buffer import LazyFlatBuffer


class DriftMonitor(Callback):
    """Logs ``param/drift`` and ``param/step_norm`` after every optimizer step (see the module docstring)."""

    def __init__(self) -> None:
        self._start = LazyFlatBuffer(torch.float32)
        self._prev = LazyFlatBuffer(torch.float32)
        self._seen = -1  # the global step whose parameters _prev holds; -1: not started
        self._restored = False

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            check_strategy(trainer, "DriftMonitor", allow_sharded=True)

    def _params(self, trainer: "pl.Trainer") -> list[torch.Tensor]:
        return [local(p.detach()) for p in optimizer_params(trainer, "DriftMonitor")]

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        check_no_replicated_shards(optimizer_params(trainer, "DriftMonitor"), "DriftMonitor")  # once per fit
        params = self._params(trainer)
        start, prev = self._start.get(params), self._prev.get(params)
        if not self._restored:  # a fresh fit: theta_0 is the parameters now
            start.copy_from(params)
            prev.copy_from(params)
            self._seen = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._seen:  # no optimizer step this batch (accumulation, a skipped step)
            return
        params = self._params(trainer)
        start, prev = self._start.get(params), self._prev.get(params)
        scalars = torch.zeros(2, dtype=torch.float64)
        for p, s, q in zip(params, start.views, prev.views):
            x = p.float()
            scalars[0] += torch.sum(torch.square(x - s), dtype=torch.float64)
            scalars[1] += torch.sum(torch.square(x - q), dtype=torch.float64)
        drift_sq, step_sq = (float(v) for v in agree(trainer, scalars, is_sharded(trainer)))
        log_metrics(trainer, {"param/drift": math.sqrt(drift_sq), "param/step_norm": math.sqrt(step_sq)})
        prev.copy_from(params)
        self._seen = trainer.global_step

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"seen": self._seen}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._seen = int(state_dict["seen"])

    @override
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        save_tensor(checkpoint, self.state_key + "/start", self._start.state())
        save_tensor(checkpoint, self.state_key + "/prev", self._prev.state())

    @override
    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        start = load_tensor(checkpoint, self.state_key + "/start", trainer, "DriftMonitor")
        prev = load_tensor(checkpoint, self.state_key + "/prev", trainer, "DriftMonitor")
        if start is not None and prev is not None:
            self._start.load(start)
            self._prev.load(prev)
            self._restored = True
