"""AlignmentMonitor: logs c_t (``align/cos``), ``grad/norm`` and the cosine of consecutive optimizer steps
(``align/step_cos``) at every optimizer step, and the on-policy alignment statistics of paper Table 3 at
the end of fit.

Capability: a callback that computes c_t of the raw gradient itself, and logs ``align/cos``,
``grad/norm`` and the end-of-fit summary under the same names, declares
``logs_raw_alignment = True`` (an attribute or property); beside one, the monitor stays passive.
Likewise a callback that logs ``align/step_cos`` itself declares ``logs_step_alignment = True``.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from gacbench.callbacks._common import (
    CosineTrace,
    StepGuard,
    agree,
    check_automatic_optimization,
    check_no_replicated_shards,
    check_strategy,
    is_sharded,
    load_tensor,
    local,
    log_metrics,
    optimizer_params,
    parameter_names,
    save_tensor,
)
from gacbench.functional.alignment import alignment_scalars, reference_cosine
from gacbench.functional.buffer import LazyFlatBuffer, check_dense_gradients, check_parameters, keep_reference
from gacbench.functional.gac import parse_dtype
from gacbench.functional.settings import summary_settings
from gacbench.functional.step_gac import StepGAC


class AlignmentMonitor(Callback):
    """c_t = cos(g_t, g_{t-1}) between the gradients of consecutive optimizer steps.

    The gradient is read in ``on_before_optimizer_step`` as this callback finds it: list it
    *before* gradient-side stabilizers to measure the raw gradient. When another callback of the
    trainer declares ``logs_raw_alignment = True`` (``GAC(reference="grad")`` does: it computes
    exactly this c_t), the monitor stays passive rather than keep a second copy of the previous
    gradient and write a second value of each metric.

    Args:
        warmup: steps excluded from the end-of-fit summary (paper Table 3 uses 50).
        tol: the |c_t| tolerance of the summary's ``frac_le`` statistic (paper: 0.05).
        buffer_dtype: dtype of the stored previous gradient (default: each parameter's own).
        step_cos: also log ``align/step_cos`` = cos(theta_{t+1} - theta_t, theta_t - theta_{t-1}), read right after
            each optimizer step (the trace ``gac-step-calibrated`` calibrates from). It holds two parameter-sized
            buffers (the parameters after the last step and that step) and one scratch block, so it is off
            by default; the bench runner's cells and ``gacbench grpo`` turn it on. Passive beside a callback
            that declares ``logs_step_alignment`` (``GAC(target="step")``).

    A step whose gradient is all zero (in RL: every group with equal rewards) or non-finite has no c_t: it logs
    ``align/cos`` = NaN, counts as ``skipped`` in the summary, and is never the next step's reference (the next
    c_t is measured against the last usable gradient).

    After fit, ``summary`` holds ``q90_abs``, ``max_abs``, ``frac_le_tol``, ``median``, ``n`` and ``skipped``.
    """

    keeps_gradients = True  # reads p.grad in on_before_optimizer_step, never writes it

    def __init__(self, warmup: int = 50, tol: float = 0.05, buffer_dtype: torch.dtype | None = None,
                 step_cos: bool = False) -> None:
        self.warmup, self.tol = summary_settings("AlignmentMonitor", warmup, tol)
        self.step_cos = step_cos
        self.step_passive = not step_cos
        self._hook = None
        self.buffer_dtype = parse_dtype("AlignmentMonitor", buffer_dtype)
        self.passive = False
        self._guard = StepGuard("AlignmentMonitor")
        self._reset()

    def _reset(self) -> None:
        """No previous gradient, trace or summary: each fit starts fresh (a resume loads its state after ``setup``)."""
        self.trace = CosineTrace(self.warmup, self.tol, "AlignmentMonitor")
        self._steps = StepGAC(apply=False)
        self.has_prev = False
        self.summary: dict[str, float] = {}
        self._prev = LazyFlatBuffer(self.buffer_dtype)

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        self._reset()  # an instance passed to a second fit carries nothing of the first into it
        check_automatic_optimization(pl_module, "AlignmentMonitor")
        check_strategy(trainer, "AlignmentMonitor", allow_sharded=True)
        providers = [cb for cb in trainer.callbacks if cb is not self and getattr(cb, "logs_raw_alignment", False)]
        self.passive = bool(providers)
        if self.passive:
            rank_zero_info(f"AlignmentMonitor: {type(providers[0]).__name__} already logs align/cos and grad/norm "
                           "(logs_raw_alignment); the monitor stays passive.")
        self.step_passive = not self.step_cos or any(
            cb is not self and getattr(cb, "logs_step_alignment", False) for cb in trainer.callbacks)

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._params = optimizer_params(trainer, "AlignmentMonitor")
        self._guard.start(trainer)
        check_no_replicated_shards(self._params, "AlignmentMonitor")
        self._names = parameter_names(pl_module, self._params)
        check_parameters(self._params, "AlignmentMonitor", self._names)
        if not self.step_passive:
            self._steps.start(self._params)
            self._hook = trainer.optimizers[0].register_step_post_hook(
                lambda optimizer, args, kwargs: self._after_step(trainer))

    def _after_step(self, trainer: "pl.Trainer") -> None:
        out = self._steps.step(self._params, lambda s: agree(trainer, s, is_sharded(trainer)))
        if out is not None and out.measured:
            log_metrics(trainer, {"align/step_cos": out.cos})

    @override
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer) -> None:
        self._guard.check(trainer, optimizer)
        if self.passive:
            return
        params = self._params
        check_dense_gradients(params, "AlignmentMonitor", self._names)
        grads = [local(p.grad) if p.grad is not None else None for p in params]
        if all(g is None for g in grads):
            return
        prev = self._prev.get([local(p.detach()) for p in params])
        # c_t of the full vectors: a parameter without a gradient has g = 0, and its part of g_{t-1} counts in
        # ||g_{t-1}||^2 (it is stored as zeros, below, when it has no gradient either)
        live = [(g, v) for g, v in zip(grads, prev.views) if g is not None]
        rest = [v for g, v in zip(grads, prev.views) if g is None]
        scalars = alignment_scalars([g for g, _ in live], [v for _, v in live], ref_rest=rest)
        scalars = agree(trainer, scalars, is_sharded(trainer))
        g_r, g_sq, r_sq = (float(v) for v in scalars.tolist())  # one read to the host
        metrics = {"grad/norm": math.sqrt(g_sq) if g_sq >= 0 else float("nan")}
        usable = math.isfinite(g_sq) and g_sq > 0.0
        if not usable:  # a zero or non-finite gradient: no c_t (NaN, counted as skipped), and never a reference
            metrics["align/cos"] = float("nan")
            self.trace.append(float("nan"))
        elif self.has_prev:
            metrics["align/cos"] = c = reference_cosine(g_r, g_sq, r_sq)  # NaN against a zero reference
            self.trace.append(c)
        log_metrics(trainer, metrics)
        if usable:
            self.has_prev = keep_reference(prev, grads, "AlignmentMonitor")

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._remove_hook()
        if not self.passive:
            self.summary = self.trace.log_summary(trainer)

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._remove_hook()  # also after a failed fit

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"has_prev": self.has_prev, "trace": self.trace.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.has_prev = state_dict["has_prev"]
        self.trace.load_state_dict(state_dict["trace"])

    @override
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        save_tensor(checkpoint, self.state_key, self._prev.state())
        if self.step_cos:
            save_tensor(checkpoint, self.state_key + "/step", self._steps.state_dict())

    @override
    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        self._prev.load(load_tensor(checkpoint, self.state_key, trainer, "AlignmentMonitor"))
        steps = load_tensor(checkpoint, self.state_key + "/step", trainer, "AlignmentMonitor")
        if steps is not None and self.step_cos:
            self._steps.load_state_dict(steps)
