"""AssumptionMonitor: estimates, during a run, the quantities the bounded-staleness theorems assume.

Every ``every`` optimizer steps, at the current parameters theta_t and before the step's forward:

- sigma^2 (gradient-noise variance of one batch): 1/2 ||grad L(theta_t; B_t) - grad L(theta_t; B')||^2
  with B' the previous step's batch; unbiased for E||g - grad f||^2 when batches are independent.
- L (local smoothness): the secant ||grad L(theta_t; B_t) - grad L(theta_{t-1}; B_t)|| / ||theta_t - theta_{t-1}||
  on the *same* batch, so the batch noise cancels where it does not depend on theta; the running
  maximum is logged. For a quadratic the secant lies in [mu, L] exactly.
- the realised staleness (the StalenessSimulator's lag, or a module attribute ``lag``), its running maximum s,
  and eta_max, the largest step with L eta + L^2 eta^2 s^2 <= 1 - delta (theory/README.md, results 2-3);
  ``assume/ok`` is 1 when the optimizer's largest learning rate is at most eta_max.

It costs three extra forward/backward passes every ``every`` steps and needs a side-effect-free loss:
the module's ``loss_on(batch)`` (the synthetic objectives have one) or ``loss_fn(module, batch)``.
The previous batch and iterate are not checkpointed: after a resume the first estimate is skipped.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from gacbench.callbacks._common import log_metrics, optimizer_params
from gacbench.callbacks.staleness import StalenessSimulator
from gacbench.functional.alignment import sq_norm
from gacbench.theory.bounds import eta_max


class AssumptionMonitor(Callback):
    """Logs ``assume/L``, ``assume/sigma2``, ``assume/staleness``, ``assume/eta_max``, ``assume/ok``.

    Args:
        every: estimate every this many optimizer steps (>= 1).
        loss_fn: ``loss_fn(module, batch) -> scalar`` without side effects; default ``module.loss_on``.
        delta: GAC's removed fraction bound for the step-size condition (0 without GAC).
    List it before ``StalenessSimulator``, so that it sees theta_t and not the stale iterate.
    """

    def __init__(self, every: int = 10, loss_fn: Callable[[pl.LightningModule, Any], torch.Tensor] | None = None,
                 delta: float = 0.0) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"AssumptionMonitor: every={every!r} must be a positive integer")
        if not 0.0 <= delta < 1.0:
            raise ValueError(f"AssumptionMonitor: delta={delta!r} must be in [0, 1)")
        self.every, self.loss_fn, self.delta = every, loss_fn, delta
        self.L_hat = 0.0
        self.sigma2_samples: list[float] = []
        self.s_max = 0
        self._prev_batch: Any = None
        self._prev_theta: list[torch.Tensor] | None = None

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        if self.loss_fn is None and not callable(getattr(pl_module, "loss_on", None)):
            raise TypeError(
                "AssumptionMonitor needs a side-effect-free loss: define loss_on(self, batch) -> loss on your "
                "LightningModule, or pass AssumptionMonitor(loss_fn=lambda module, batch: ...)."
            )
        position = {id(cb): i for i, cb in enumerate(trainer.callbacks)}
        sims = [position[id(cb)] for cb in trainer.callbacks if isinstance(cb, StalenessSimulator)]
        if sims and min(sims) < position[id(self)]:
            raise ValueError("AssumptionMonitor must be listed before StalenessSimulator (it estimates at theta_t, "
                             "before the simulator swaps in the stale iterate)")

    @property
    def sigma2_hat(self) -> float:
        return sum(self.sigma2_samples) / len(self.sigma2_samples) if self.sigma2_samples else math.nan

    def _grad(self, pl_module, params, batch) -> list[torch.Tensor]:
        with torch.enable_grad():
            loss = self.loss_fn(pl_module, batch) if self.loss_fn else pl_module.loss_on(batch)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]

    def on_train_start(self, trainer, pl_module) -> None:
        self._params = optimizer_params(trainer, "AssumptionMonitor")

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
        self._prev_batch = batch
        metrics["assume/staleness"] = float(self.s_max)
        if self.L_hat > 0:
            bound = eta_max(self.L_hat, self.s_max, self.delta)
            lr = max(group["lr"] for group in trainer.optimizers[0].param_groups)
            metrics.update({"assume/eta_max": bound, "assume/ok": float(lr <= bound)})
        log_metrics(trainer, metrics)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # the realised lag of this step: the simulator (or a stale-rollout module) has set it by now
        lag = next((cb.lag for cb in trainer.callbacks if isinstance(cb, StalenessSimulator)), getattr(pl_module, "lag", 0))
        self.s_max = max(self.s_max, int(lag))

    def state_dict(self) -> dict[str, Any]:
        return {"L_hat": self.L_hat, "sigma2_samples": list(self.sigma2_samples), "s_max": self.s_max}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.L_hat, self.sigma2_samples, self.s_max = state["L_hat"], list(state["sigma2_samples"]), state["s_max"]
