"""Staleness-scaled learning rate (Song, Xu et al., "Staleness-Learning Rate Scaling Laws for Asynchronous RLHF",
arXiv 2607.01083): stale rollouts add a surrogate-gradient bias of order S eta (S the maximum rollout lag, eta the
learning rate), and stability needs eta << min{R_batch / (S G_upd), R_crit / (T G_upd)} (the abstract's
two-constraint rule). The second term does not depend on S: the learning rate tuned for synchronous training stands
for it here, and the first term becomes a cap proportional to 1/S.

``form="min"`` (default, the two-constraint rule): eta_S = eta min(1, S0 / S). S0 = R_batch / (eta G_upd) is the
lag from which the stale-rollout constraint binds; the paper's constants are not known for a task, so S0 is a
setting (``s0``, default 1: eta_S = eta / S, the pure 1/S law). ``form="smooth"``: eta_S = eta / (1 + S / S0).

S is the configured staleness bound (the paper's maximum rollout lag), not the realised lag s_t of each step: the
run's rollout-staleness module (``staleness`` of the bandit, the sequence policy, GRPO) or its
:class:`~gacbench.callbacks.StalenessSimulator` (the synthetic objectives). At S = 0 the rate is untouched (the
run is the base method, bit for bit). Every parameter group's rate is multiplied for each optimizer step and
restored right after it (a one-shot step hook, before any learning-rate scheduler reads it), so it composes with
schedules and with every optimizer (SGD, AdamW: the decoupled weight decay, which AdamW multiplies by the rate,
shrinks with it).
"""

from __future__ import annotations

import lightning.pytorch as pl

from gacbench.callbacks._common import log_metrics
from gacbench.stabilizers.base import Stabilizer, StepLRScale, check_positive

FORMS = ("min", "smooth")


def staleness_lr_scale(staleness: int, s0: float = 1.0, form: str = "min") -> float:
    """The learning-rate multiplier at staleness bound S: min(1, S0 / S) (``"min"``) or 1 / (1 + S / S0)
    (``"smooth"``); exactly 1.0 at S = 0."""
    if form not in FORMS:
        raise ValueError(f"lr-scaled: form={form!r} is not one of {', '.join(FORMS)}")
    check_positive("lr-scaled", s0=s0)
    if staleness < 0:
        raise ValueError(f"lr-scaled: staleness {staleness} must be >= 0")
    if staleness == 0:
        return 1.0
    return min(1.0, s0 / staleness) if form == "min" else 1.0 / (1.0 + staleness / s0)


def staleness_bound(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> int:
    """The run's configured staleness bound S: the rollout-staleness module's ``staleness`` (attribute or
    hyper-parameter), else that of a staleness simulator among the callbacks (one that declares
    ``swaps_parameters``), else 0 (synchronous)."""
    if getattr(pl_module, "rollout_staleness", False):
        s = getattr(pl_module, "staleness", None)
        if s is None:
            s = dict(getattr(pl_module, "hparams", {}) or {}).get("staleness")
        if s is None:
            raise ValueError(f"lr-scaled: {type(pl_module).__name__} declares rollout_staleness but has no staleness "
                             "attribute or hyper-parameter; set one (the bound S of its rollout queue)")
        return int(s)
    sims = [cb for cb in trainer.callbacks if hasattr(cb, "swaps_parameters") and hasattr(cb, "staleness")]
    return int(sims[0].staleness) if sims else 0


class StalenessLR(StepLRScale, Stabilizer):
    """Staleness-scaled learning rate (arXiv 2607.01083): eta min(1, s0 / S) at staleness bound S, s0 = 1 by default,
    or eta / (1 + S / s0) with form='smooth'. The base rate at S = 0. Composes with GAC and with one loss-side
    stabilizer; not with another callback that rescales the rate (VCPO)."""

    kind = "gradient"
    on_policy_identity = True  # the multiplier at S = 0 is exactly 1.0: the optimizer is not touched

    def __init__(self, s0: float = 1.0, form: str = "min") -> None:
        staleness_lr_scale(1, s0, form)  # validates both settings
        self.s0, self.form = float(s0), form
        self.staleness = 0
        self.scale = 1.0

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        others = [type(cb).__name__ for cb in trainer.callbacks if cb is not self and getattr(cb, "scales_lr", False)]
        if others:
            raise ValueError(f"lr-scaled rescales the learning rate of each step, and so does {', '.join(others)}; "
                             "each restores the rate it saw after the step, so together they would compound. Run them "
                             "separately.")
        self.staleness = staleness_bound(trainer, pl_module)
        self.scale = staleness_lr_scale(self.staleness, self.s0, self.form)

    def on_train_start(self, trainer, pl_module) -> None:
        log_metrics(trainer, {"lr/staleness_bound": float(self.staleness), "lr/staleness_scale": self.scale})

    def step_lr_scale(self) -> float:
        return self.scale
