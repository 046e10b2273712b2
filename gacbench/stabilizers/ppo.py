"""Objectives that change the PPO surrogate itself: dual-clip PPO, GSPO and CISPO, as pure functions plus
thin callbacks. The ratio is r = pi_theta / pi_behav (the trainer's behaviour log-probs of the generating
version), as in the module's own surrogate."""

from __future__ import annotations

import torch
from torch import Tensor

from gacbench.stabilizers.base import (
    LossStabilizer,
    PolicyBatch,
    across_ranks,
    agg_loss,
    check_positive,
    clipped_surrogate,
    masked_mean,
    ratio_metrics,
    safe_log_ratio,
    sanitize,
    surrogate_terms,
)


def dual_clip_loss(batch: PolicyBatch, clip_c: float = 3.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Dual-clip PPO (Ye et al., arXiv 1912.09729; verl's ``compute_policy_loss_vanilla``), shapes (B, T): the
    module's clipped surrogate, with the per-token loss of negative-advantage tokens capped at -c A (no gradient
    once r > c)."""
    return clipped_surrogate(batch, dual_clip=clip_c)


def gspo_loss(batch: PolicyBatch, clip_low: float = 3e-4, clip_high: float = 4e-4) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al., arXiv 2507.18071, Eqs. 5-7), shapes (B, T): sequence ratio
    s_i = exp(mean_t log r_{i,t}) over the sequence's response tokens, loss
    -(1/B) sum_i mean_t min(s_{i,t} A_{i,t}, clip(s_{i,t}, 1 - clip_low, 1 + clip_high) A_{i,t}) with
    s_{i,t} = sg[s_i] pi_theta(y_t) / sg[pi_theta(y_t)] (GSPO-token: equal to s_i in value and, for a constant
    advantage along the sequence, in gradient). The aggregation is the method's: seq-mean-token-mean."""
    m = batch.mask
    log_r = safe_log_ratio(batch.logp, batch.logp_behav, m)
    log_s = log_r.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)
    logp = sanitize(batch.logp, m)
    s_tok = torch.exp(log_s.detach() + logp - logp.detach())
    per_token, clipped = surrogate_terms(s_tok, sanitize(batch.adv, m), 1.0 - clip_low, 1.0 + clip_high)
    loss = agg_loss(per_token, m, "seq-mean-token-mean")
    loss = across_ranks(loss, m, "seq-mean-token-mean", m, batch.agg)  # under DDP: the method's own aggregation
    s = torch.exp(log_s.detach()).expand_as(log_r)
    metrics = {"pg/clipfrac": masked_mean(clipped.float(), m), "gspo/seq_ratio_mean": masked_mean(s, m),
               "gspo/clip_low": clip_low, "gspo/clip_high": clip_high, **ratio_metrics(torch.exp(log_r), m)}
    return loss, metrics


def cispo_loss(batch: PolicyBatch, lower: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, Sec. 3.1), shapes (B, T): -agg(sg(clip(r, lo, 1 + clip_high)) A logp),
    with the module's clip_high and aggregation. ``lower=False`` (the paper's setting: epsilon_low large, no lower
    bound) uses lo = 0; ``lower=True`` uses lo = 1 - clip_low (verl's ``cispo`` loss)."""
    m = batch.mask
    ratio = torch.exp(safe_log_ratio(batch.logp, batch.logp_behav, m)).detach()
    lo, hi = (1.0 - batch.clip_low if lower else 0.0), 1.0 + batch.clip_high
    weight = ratio.clamp(lo, hi)
    loss = agg_loss(-weight * sanitize(batch.adv, m) * sanitize(batch.logp, m), m, batch.agg)
    metrics = {"pg/clipfrac": masked_mean((weight != ratio).float(), m), "cispo/ratio_high": hi,
               "cispo/ratio_low": lo, **ratio_metrics(ratio, m)}
    return loss, metrics


class DualClipPPO(LossStabilizer):
    """Dual-clip PPO: the module's clipped surrogate with negative-advantage tokens capped at -c A (c = 3, verl's
    default ``clip_ratio_c``)."""

    on_policy_identity = True  # at r = 1 the loss |A| of an A < 0 token lies below the cap c |A| (c > 1)

    def __init__(self, clip_c: float = 3.0) -> None:
        check_positive("DualClipPPO", clip_c=clip_c)
        if clip_c <= 1.0:
            raise ValueError(f"DualClipPPO: clip_c={clip_c} must be > 1 (the cap -c A lies beyond the clip range)")
        self.clip_c = float(clip_c)

    def policy_loss(self, batch: PolicyBatch):
        return dual_clip_loss(batch, self.clip_c)


class GSPO(LossStabilizer):
    """GSPO: sequence-level ratio exp(mean log r), clipped at 1 - 3e-4 / 1 + 4e-4 (the paper's ranges; GSPO chooses
    its own bounds and aggregation, and logs the bounds as gspo/clip_low, gspo/clip_high)."""

    def __init__(self, clip_low: float = 3e-4, clip_high: float = 4e-4) -> None:
        check_positive("GSPO", clip_low=clip_low, clip_high=clip_high)
        if clip_low >= 1.0:
            raise ValueError(f"GSPO: clip_low={clip_low} must be below 1")
        self.clip_low, self.clip_high = float(clip_low), float(clip_high)

    def policy_loss(self, batch: PolicyBatch):
        return gspo_loss(batch, self.clip_low, self.clip_high)


class CISPO(LossStabilizer):
    """CISPO: REINFORCE with a stop-gradient, clipped importance weight, sg(min(r, 1 + clip_high)) A log pi."""

    on_policy_identity = True  # weight clip(1) = 1: -A grad log pi, the surrogate's gradient at r = 1

    def __init__(self, lower: bool = False) -> None:
        if not isinstance(lower, bool):
            raise ValueError(f"CISPO: lower={lower!r} must be True or False")
        self.lower = lower

    def policy_loss(self, batch: PolicyBatch):
        return cispo_loss(batch, self.lower)
