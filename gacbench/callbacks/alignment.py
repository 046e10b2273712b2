"""AlignmentMonitor: logs c_t (``align/cos``) and ``grad/norm`` at every optimizer step, and
the on-policy alignment statistics of paper Table 3 at the end of fit."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from gacbench.callbacks._common import (
    CosineTrace,
    agree,
    check_automatic_optimization,
    check_strategy,
    is_sharded,
    local,
    load_tensor,
    log_metrics,
    optimizer_params,
    save_tensor,
)
from gacbench.functional.alignment import alignment_scalars, cosine_from_scalars
from gacbench.functional.buffer import LazyFlatBuffer


class AlignmentMonitor(Callback):
    """c_t = cos(g_t, g_{t-1}) between the gradients of consecutive optimizer steps.

    The gradient is read in ``on_before_optimizer_step`` as this callback finds it: list it
    *before* gradient-side stabilizers to measure the raw gradient. A ``GAC(reference="grad")``
    in the same trainer already computes exactly this c_t and logs it; the monitor then stays
    passive rather than keep a second copy of the previous gradient.

    Args:
        warmup: steps excluded from the end-of-fit summary (paper Table 3 uses 50).
        tol: the |c_t| tolerance of the summary's ``frac_le`` statistic (paper: 0.05).
        buffer_dtype: dtype of the stored previous gradient (default: the parameters').

    After fit, ``summary`` holds ``q90_abs``, ``max_abs``, ``frac_le_tol``, ``median`` and ``n``.
    """

    def __init__(self, warmup: int = 50, tol: float = 0.05, buffer_dtype: torch.dtype | None = None) -> None:
        self.trace = CosineTrace(warmup, tol)
        self.buffer_dtype = buffer_dtype
        self.has_prev = False
        self.passive = False
        self.summary: dict[str, float] = {}
        self._prev = LazyFlatBuffer(buffer_dtype)

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        check_automatic_optimization(pl_module, "AlignmentMonitor")
        check_strategy(trainer, "AlignmentMonitor", allow_sharded=True)
        from gacbench.callbacks.gac import GAC

        self.passive = any(isinstance(cb, GAC) and cb.reference == "grad" for cb in trainer.callbacks)
        if self.passive:
            rank_zero_info("AlignmentMonitor: GAC(reference='grad') already logs align/cos and grad/norm; the monitor stays passive.")

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._params = optimizer_params(trainer, "AlignmentMonitor")

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer) -> None:
        if self.passive:
            return
        params = self._params
        grads = [local(p.grad) if p.grad is not None else None for p in params]
        if all(g is None for g in grads):
            return
        prev = self._prev.get([local(p.detach()) for p in params])
        pairs = [(g, v) for g, v in zip(grads, prev.views) if g is not None]
        scalars = agree(trainer, alignment_scalars([g for g, _ in pairs], [v for _, v in pairs]), is_sharded(trainer))
        g_sq = float(scalars[1])
        c = cosine_from_scalars(scalars) if self.has_prev else float("nan")
        metrics = {"grad/norm": math.sqrt(g_sq) if g_sq >= 0 else float("nan")}
        if self.has_prev:
            metrics["align/cos"] = c
            self.trace.append(c)
        log_metrics(trainer, metrics)
        if math.isfinite(g_sq):  # a non-finite gradient (an fp16 overflow step) is not a reference
            prev.copy_from(grads)
            self.has_prev = True

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not self.passive:
            self.summary = self.trace.log_summary(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {"has_prev": self.has_prev, "trace": self.trace.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.has_prev = state["has_prev"]
        self.trace.load_state_dict(state["trace"])

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        save_tensor(checkpoint, self.state_key, self._prev.state())

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        self._prev.load(load_tensor(checkpoint, self.state_key))
