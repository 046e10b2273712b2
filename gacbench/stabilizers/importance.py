"""TIS (truncated importance sampling) and decoupled PPO (AReaL), as pure functions plus thin callbacks.

Both separate the behaviour policy (the stale version that generated the data) from a proximal
policy pi_prox (by default the current policy at the time the batch is consumed, detached):
the behaviour correction w = pi_prox / pi_behav is a constant weight, and the trust region is
taken against pi_prox. With one update per batch (this suite) pi_prox = pi_theta in value, so the
clipped ratio r = pi_theta / pi_prox is 1 and only its gradient (grad log pi_theta) remains.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gacbench.stabilizers.base import LossStabilizer, PolicyBatch, agg_loss, masked_mean, ratio_metrics


def decoupled_ppo_loss(batch: PolicyBatch, clip_low: float = 0.2, clip_high: float = 0.2,
                       weight_cap: float | None = None, agg: str = "token-mean") -> tuple[Tensor, dict[str, Tensor]]:
    """-agg(w * min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)), shapes (B, T);
    w = pi_prox / pi_behav (detached, truncated at ``weight_cap`` if given), r = pi_theta / pi_prox."""
    w = torch.exp(batch.logp_prox - batch.logp_behav).detach()
    if weight_cap is not None:
        w = w.clamp(max=weight_cap)
    r = torch.exp(batch.logp - batch.logp_prox)
    pg1, pg2 = -batch.adv * r, -batch.adv * r.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = agg_loss(w * torch.maximum(pg1, pg2), batch.mask, agg)
    metrics = {
        "pg/clipfrac": masked_mean((pg2 > pg1).float(), batch.mask),
        **ratio_metrics(torch.exp(batch.logp.detach() - batch.logp_behav), batch.mask),
        "is/weight_mean": masked_mean(w, batch.mask),
    }
    if weight_cap is not None:
        metrics["is/truncated_frac"] = masked_mean((torch.exp(batch.logp_prox - batch.logp_behav) > weight_cap).float(), batch.mask)
    return loss, metrics


class DecoupledPPO(LossStabilizer):
    """AReaL's decoupled PPO objective: behaviour weight pi_prox/pi_behav times the clipped ratio to pi_prox."""

    def __init__(self, clip_low: float = 0.2, clip_high: float = 0.2, weight_cap: float | None = None, agg: str = "token-mean") -> None:
        super().__init__(agg)
        _check_clip("DecoupledPPO", clip_low, clip_high)
        if weight_cap is not None and not weight_cap > 0:
            raise ValueError(f"DecoupledPPO: weight_cap={weight_cap!r} must be positive (or None for no cap)")
        self.clip_low, self.clip_high, self.weight_cap = clip_low, clip_high, weight_cap

    def policy_loss(self, batch: PolicyBatch):
        return decoupled_ppo_loss(batch, self.clip_low, self.clip_high, self.weight_cap, self.agg)


class TIS(LossStabilizer):
    """Truncated importance sampling: the decoupled objective with the behaviour weight truncated at C,
    min(pi_prox / pi_behav, C)."""

    def __init__(self, cap: float = 2.0, clip_low: float = 0.2, clip_high: float = 0.2, agg: str = "token-mean") -> None:
        super().__init__(agg)
        _check_clip("TIS", clip_low, clip_high)
        if not (isinstance(cap, (int, float)) and cap > 0 and math.isfinite(cap)):
            raise ValueError(f"TIS: cap={cap!r} must be a positive number (the truncation C of min(w, C))")
        self.cap, self.clip_low, self.clip_high = float(cap), clip_low, clip_high

    def policy_loss(self, batch: PolicyBatch):
        return decoupled_ppo_loss(batch, self.clip_low, self.clip_high, self.cap, self.agg)


def _check_clip(who: str, clip_low: float, clip_high: float) -> None:
    if not (0.0 <= clip_low < 1.0) or not clip_high >= 0.0:
        raise ValueError(f"{who}: need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}")
