"""Decoupled PPO (AReaL) and TIS on the staleness gap, as pure functions plus thin callbacks.

Both separate the behaviour policy (the stale version that generated the data, ``logp_behav``) from a
proximal policy pi_prox (``logp_prox``; by default the current policy at the time the batch is consumed,
detached): the behaviour correction w = pi_prox / pi_behav is a constant (detached) weight, and the trust
region is the module's clip range taken against pi_prox. With one update per batch (this suite)
pi_prox = pi_theta in value, so the clipped ratio r = pi_theta / pi_prox is 1 and only its gradient
(grad log pi_theta) remains: the objective is an importance-weighted policy gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gacbench.stabilizers.base import (
    LossStabilizer,
    PolicyBatch,
    agg_loss,
    check_positive,
    masked_mean,
    ratio_metrics,
    safe_log_ratio,
    sanitize,
    surrogate_terms,
)


def decoupled_ppo_loss(batch: PolicyBatch, weight_cap: float | None = None,
                       cap_mode: str = "truncate") -> tuple[Tensor, dict[str, Tensor]]:
    """-agg(w * min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)), shapes (B, T), with the batch's clip bounds and
    aggregation; w = pi_prox / pi_behav (detached), r = pi_theta / pi_prox.

    ``weight_cap`` C: ``cap_mode="truncate"`` uses min(w, C) (TIS); ``"mask"`` drops tokens with w > C (AReaL's
    rejection of over-weighted tokens)."""
    if cap_mode not in ("truncate", "mask"):
        raise ValueError(f"decoupled_ppo_loss: cap_mode={cap_mode!r} is not 'truncate' or 'mask'")
    m = batch.mask
    w_raw = torch.exp(safe_log_ratio(batch.logp_prox, batch.logp_behav, m)).detach()
    w = w_raw
    if weight_cap is not None:
        w = w_raw.clamp(max=weight_cap) if cap_mode == "truncate" else torch.where(w_raw > weight_cap, 0.0, w_raw)
    r = torch.exp(safe_log_ratio(batch.logp, batch.logp_prox, m))
    per_token, clipped = surrogate_terms(r, sanitize(batch.adv, m), 1.0 - batch.clip_low, 1.0 + batch.clip_high)
    loss = agg_loss(w * per_token, m, batch.agg)
    metrics = {
        "pg/clipfrac": masked_mean(clipped.float(), m),
        **ratio_metrics(torch.exp(safe_log_ratio(batch.logp.detach(), batch.logp_behav, m)), m),
        "is/weight_mean": masked_mean(w, m),
    }
    if weight_cap is not None:
        key = "is/truncated_frac" if cap_mode == "truncate" else "is/masked_frac"
        metrics[key] = masked_mean((w_raw > weight_cap).float(), m)
    return loss, metrics


class DecoupledPPO(LossStabilizer):
    """AReaL's decoupled PPO objective: behaviour weight pi_prox/pi_behav times the clipped ratio to pi_prox
    (the module's clip range and aggregation). ``weight_cap`` with ``cap_mode``: see decoupled_ppo_loss."""

    on_policy_identity = True  # pi_prox = pi_behav = pi_theta: weight 1, the module's surrogate in r = 1

    def __init__(self, weight_cap: float | None = None, cap_mode: str = "truncate") -> None:
        name = type(self).__name__  # a subclass (A3PO) is named in its own errors
        if weight_cap is not None:
            check_positive(name, weight_cap=weight_cap)
        if cap_mode not in ("truncate", "mask"):
            raise ValueError(f"{name}: cap_mode={cap_mode!r} is not 'truncate' or 'mask'")
        self.weight_cap, self.cap_mode = weight_cap, cap_mode
        self.on_policy_identity = weight_cap is None or weight_cap >= 1.0  # a cap below 1 scales or drops weight 1

    def policy_loss(self, batch: PolicyBatch):
        return decoupled_ppo_loss(batch, self.weight_cap, self.cap_mode)


class TIS(LossStabilizer):
    """Truncated importance sampling on the staleness gap: the decoupled objective with the behaviour weight
    truncated at C, min(pi_prox / pi_behav, C) (verl's token-TIS with the stale behaviour as the rollout policy)."""

    on_policy_identity = True  # weight min(1, C) = 1 for C >= 1

    def __init__(self, cap: float = 2.0) -> None:
        check_positive("TIS (cap, the truncation C of min(w, C))", cap=cap)
        self.cap = float(cap)
        self.on_policy_identity = self.cap >= 1.0

    def policy_loss(self, batch: PolicyBatch):
        return decoupled_ppo_loss(batch, self.cap, "truncate")
