"""AssumptionMonitor: estimates, during a run, the quantities the bounded-staleness theorems assume.

Every ``every`` optimizer steps, at the current parameters theta_t and before the step's forward:

- sigma^2 (gradient-noise variance of one batch): 1/2 ||grad L(theta_t; B_t) - grad L(theta_t; B')||^2
  with B' the previous step's batch; unbiased for E||g - grad f||^2 when batches are independent.
- L (local smoothness): the secant ||grad L(theta_t; B_t) - grad L(theta_{t-1}; B_t)|| / ||theta_t - theta_{t-1}||
  on the *same* batch, so the batch noise cancels where it does not depend on theta; the running
  maximum is logged. For a quadratic the secant lies in [mu, L] exactly.
- eta_eff, the step actually taken as an SGD step size: ||theta_t - theta_{t-1}|| / ||g_{t-1}||, g_{t-1} the
  gradient the optimizer applied at step t - 1 (``p.grad`` right after that step: the delayed gradient under
  StalenessSimulator, after clipping and any gradient-side callback). It equals the learning rate for SGD, noisy,
  stale or clipped; for Adam it is the preconditioned step's scale, the number to set against eta_max (an SGD
  step size) when the optimizer is not SGD; a step whose gradient was taken by the optimizer's fused path
  (``GAC(kernels="fused-adamw")`` sets ``p.grad`` to None) has none;
- the realised staleness (the logged ``stale/lag`` in ``trainer.callback_metrics``: StalenessSimulator
  logs it, and so does a stale-rollout module in its training_step; 0 when nothing logs it), its
  running maximum s, and eta_max, the largest step with L eta + L^2 eta^2 s^2 <= 1 - delta
  (theory/README.md, results 2-3);
  ``assume/ok`` is 1 when the optimizer's largest learning rate is at most eta_max.

It costs three extra forward/backward passes every ``every`` steps and needs a side-effect-free loss:
the module's ``loss_on(batch)`` (the synthetic objectives have one) or ``loss_fn(module, batch)``.
The previous batch and iterate are not checkpointed: after a resume the first estimate is skipped.

Under DDP each estimate uses the gradient of the global batch, the ranks' gradients of their own batches
averaged as DDP averages them (one all-reduce per estimated gradient), so every rank logs the same values;
a sharded strategy (FSDP, ModelParallelStrategy) is refused.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from gacbench.callbacks._common import StepGuard, check_strategy, log_metrics, optimizer_params
from gacbench.functional.alignment import plain_number, sq_norm
from gacbench.functional.stepsize import eta_max


class AssumptionMonitor(Callback):
    """Logs ``assume/L``, ``assume/sigma2``, ``assume/eta_eff``, ``assume/staleness``, ``assume/eta_max``,
    ``assume/ok`` (the optimizer's learning rate <= eta_max).

    Args:
        every: estimate every this many optimizer steps (>= 1).
        loss_fn: ``loss_fn(module, batch) -> scalar`` without side effects; default ``module.loss_on``.
        delta: GAC's removed fraction bound for the step-size condition (0 without GAC).
    List it before ``StalenessSimulator`` (and any callback that declares ``swaps_parameters = True``),
    so that it sees theta_t and not the stale iterate.
    """

    keeps_gradients = True  # never writes p.grad (its gradients come from torch.autograd.grad)

    def __init__(self, every: int = 10, loss_fn: Callable[[pl.LightningModule, Any], torch.Tensor] | None = None,
                 delta: float = 0.0) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"AssumptionMonitor: every={every!r} must be a positive integer")
        plain = plain_number(delta)
        if plain is None or not 0.0 <= plain < 1.0:
            raise ValueError(f"AssumptionMonitor: delta={delta!r} must be a number in [0, 1) (GAC's bound on the "
                             "removed fraction; 0 without GAC)")
        self.every, self.loss_fn, self.delta = every, loss_fn, float(plain)
        self.L_hat = 0.0
        self.sigma2_samples: list[float] = []
        self.s_max = 0
        self._prev_batch: Any = None
        self._prev_theta: list[torch.Tensor] | None = None
        self._applied_norm: float | None = None  # ||g|| the optimizer applied at the step before a measurement
        self._applied_at = -1  # the global step after which it was read
        self._guard = StepGuard("AssumptionMonitor", once=False)
        self._world = 1

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        check_strategy(trainer, "AssumptionMonitor", allow_sharded=False)
        if self.loss_fn is None and not callable(getattr(pl_module, "loss_on", None)):
            raise TypeError(
                "AssumptionMonitor needs a side-effect-free loss: define loss_on(self, batch) -> loss on your "
                "LightningModule, or pass AssumptionMonitor(loss_fn=lambda module, batch: ...)."
            )
        for cb in trainer.callbacks:
            if cb is self:
                break
            if getattr(cb, "swaps_parameters", False):
                raise ValueError(f"AssumptionMonitor must be listed before {type(cb).__name__} (it estimates "
                                 "at theta_t, before that callback swaps in another iterate); "
                                 "move it up in callbacks=[...]")

    @property
    def sigma2_hat(self) -> float:
        return sum(self.sigma2_samples) / len(self.sigma2_samples) if self.sigma2_samples else math.nan

    def _grad(self, pl_module, params, batch) -> list[torch.Tensor]:
        with torch.enable_grad():
            loss = self.loss_fn(pl_module, batch) if self.loss_fn else pl_module.loss_on(batch)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        if self._world > 1:  # the global batch's gradient, as DDP averages it: one all-reduce of the flat vector
            flat = torch.cat([g.reshape(-1) for g in grads])
            torch.distributed.all_reduce(flat)
            flat.div_(self._world)
            grads = [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads)]
        return grads

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        self._params = optimizer_params(trainer, "AssumptionMonitor")
        self._world = trainer.world_size
        self._guard.start(trainer)

    @override
    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        t = trainer.global_step
        params = self._params
        if (t + 1) % self.every == 0:  # keep theta for the next step's secant
            self._prev_theta = [p.detach().clone() for p in params]
        if t % self.every != 0:
            self._prev_batch = batch
            return
        g = self._grad(pl_module, params, batch)
        metrics: dict[str, float] = {}
        if self._prev_batch is not None:
            g_other = self._grad(pl_module, params, self._prev_batch)
            self.sigma2_samples.append(0.5 * float(sq_norm(torch._foreach_sub(g, g_other))))
            metrics["assume/sigma2"] = self.sigma2_hat
        if self._prev_theta is not None:
            step = math.sqrt(float(sq_norm(torch._foreach_sub([p.detach() for p in params], self._prev_theta))))
            if step > 0:
                current = [p.detach().clone() for p in params]
                with torch.no_grad():
                    torch._foreach_copy_(params, self._prev_theta)
                g_then = self._grad(pl_module, params, batch)
                with torch.no_grad():
                    torch._foreach_copy_(params, current)
                secant = math.sqrt(float(sq_norm(torch._foreach_sub(g, g_then)))) / step
                self.L_hat = max(self.L_hat, secant)
                metrics["assume/L"] = self.L_hat
                if self._applied_norm:  # the SGD step size that makes this step from the gradient it was made with
                    metrics["assume/eta_eff"] = step / self._applied_norm
        self._prev_batch = batch
        metrics["assume/staleness"] = float(self.s_max)
        if self.L_hat > 0:
            bound = eta_max(self.L_hat, self.s_max, self.delta)
            lr = max(group["lr"] for group in trainer.optimizers[0].param_groups)
            metrics.update({"assume/eta_max": bound, "assume/ok": float(lr <= bound)})
        log_metrics(trainer, metrics)

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._guard.check(trainer, optimizer)
        # the realised lag of this step: StalenessSimulator logs it in on_train_batch_start, a stale-rollout
        # module in training_step, both before this hook
        lag = trainer.callback_metrics.get("stale/lag")
        if lag is not None:
            self.s_max = max(self.s_max, int(lag))

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch: Any, batch_idx: int) -> None:
        # the step before a measurement has just been taken: p.grad holds the gradient the optimizer applied
        # (after clipping and every gradient-side callback; the next batch's backward has not run), eta_eff's
        # denominator. Under accumulation only the micro-batch that stepped counts.
        t = trainer.global_step
        if t % self.every == 0 and t != self._applied_at:
            self._applied_at = t
            grads = [p.grad for p in self._params if p.grad is not None]
            self._applied_norm = math.sqrt(float(sq_norm(grads))) if grads else None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"L_hat": self.L_hat, "sigma2_samples": list(self.sigma2_samples), "s_max": self.s_max}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.L_hat, self.s_max = state_dict["L_hat"], state_dict["s_max"]
        self.sigma2_samples = list(state_dict["sigma2_samples"])
