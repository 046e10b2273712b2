"""Corrections for the gap between the rollout engine and the trainer: TIS on the engine, MIS, IcePop.

The importance weight here is the train/infer ratio of the generating version,
k = pi_train(y; theta_old) / pi_infer(y; theta_old) = exp(logp_behav - logp_engine), per token (B, T): the
trainer's recomputed behaviour log-probs against the engine's log-probs for the same tokens (verl's
pi_old / pi_rollout in its "decoupled" mode, IcePop's pi_train(theta_old) / pi_infer(theta_old)). It is
detached and multiplies the module's clipped surrogate against the behaviour policy,
min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) with r = pi_theta / pi_behav, so staleness is still
handled by the module's trust region and only the engine gap is corrected. A module without a separate
engine passes its behaviour log-probs as ``logp_engine`` (k = 1: each of these reduces to the module's
surrogate); a batch without ``logp_engine`` is refused with a clear error.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from gacbench.stabilizers.base import (
    LOG_RATIO_CLAMP,
    LossStabilizer,
    PolicyBatch,
    check_positive,
    clipped_surrogate,
    masked_mean,
    safe_log_ratio,
    sanitize,
)


def engine_log_ratio(batch: PolicyBatch, who: str) -> Tensor:
    """log k = logp_behav - logp_engine, (B, T), 0 at masked-out positions, clamped; detached."""
    return safe_log_ratio(batch.logp_behav, batch.engine_logp(who), batch.mask).detach()


def tis_engine_loss(batch: PolicyBatch, cap: float = 2.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level truncated IS (verl rollout correction ``rollout_is="token"``, threshold C = 2):
    -agg(min(k, C) * min(r A, clip(r) A)), shapes (B, T)."""
    k = torch.exp(engine_log_ratio(batch, "tis-engine"))
    loss, metrics = clipped_surrogate(batch, weight=k.clamp(max=cap))
    metrics.update({"is/engine_weight_mean": masked_mean(k.clamp(max=cap), batch.mask),
                    "is/engine_truncated_frac": masked_mean((k > cap).float(), batch.mask)})
    return loss, metrics


def mis_weights(log_k: Tensor, mask: Tensor, threshold: float = 2.0, level: str = "sequence",
                lower: float | None = None) -> tuple[Tensor, Tensor]:
    """Masked importance sampling: (weight, keep), both (B, T).

    ``level="token"``: rho_t = k_t per token; ``"sequence"``: rho = exp(sum_t log k_t) over the sequence's
    response tokens (clamped in log space), broadcast to its tokens. keep = rho <= threshold (and
    rho >= lower when given); weight = rho where kept, 0 elsewhere."""
    if level not in ("token", "sequence"):
        raise ValueError(f"mis_weights: level={level!r} is not 'token' or 'sequence'")
    mask = mask.bool()
    log_k = sanitize(log_k, mask)
    if level == "sequence":
        log_k = log_k.sum(-1, keepdim=True).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).expand_as(log_k)
    rho = torch.exp(log_k)
    keep = mask & (rho <= threshold)
    if lower is not None:
        keep = keep & (rho >= lower)
    return torch.where(keep, rho, 0.0), keep


def mis_loss(batch: PolicyBatch, threshold: float = 2.0, level: str = "sequence",
             lower: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """-agg(rho * min(r A, clip(r) A)) over the kept tokens (rejected tokens leave the mask, as verl's rejection
    sampling does), shapes (B, T); see :func:`mis_weights`."""
    weight, keep = mis_weights(engine_log_ratio(batch, "mis"), batch.mask, threshold, level, lower)
    loss, metrics = clipped_surrogate(dataclasses.replace(batch, mask=keep), weight=weight)
    metrics.update({"is/engine_weight_mean": masked_mean(weight, keep),
                    "mis/masked_frac": 1.0 - keep.sum() / batch.mask.sum().clamp_min(1)})
    return loss, metrics


def icepop_weights(log_k: Tensor, mask: Tensor, alpha: float = 0.5, beta: float = 5.0) -> Tensor:
    """IcePop's M(k; alpha, beta) = k for alpha <= k <= beta, else 0; (B, T), 0 at masked-out positions."""
    k = torch.exp(sanitize(log_k, mask.bool()))
    return torch.where(mask.bool() & (k >= alpha) & (k <= beta), k, 0.0)


def icepop_loss(batch: PolicyBatch, alpha: float = 0.5, beta: float = 5.0) -> tuple[Tensor, dict[str, Tensor]]:
    """-agg(M(k) * min(r A, clip(r) A)), shapes (B, T): tokens whose train/infer ratio leaves [alpha, beta] carry
    no gradient; the others are weighted by k. Dropped tokens stay in the aggregation's denominator."""
    log_k = engine_log_ratio(batch, "icepop")
    weight = icepop_weights(log_k, batch.mask, alpha, beta)
    loss, metrics = clipped_surrogate(batch, weight=weight)
    in_band = batch.mask & (weight > 0)
    metrics.update({"icepop/masked_frac": 1.0 - in_band.sum() / batch.mask.sum().clamp_min(1),
                    "is/engine_weight_mean": masked_mean(torch.exp(log_k), batch.mask)})
    return loss, metrics


class TISEngine(LossStabilizer):
    """Truncated IS on the engine/trainer gap (verl's rollout correction, token level): weight min(k, C),
    k = pi_train(theta_old) / pi_infer(theta_old), times the module's clipped surrogate."""

    def __init__(self, cap: float = 2.0) -> None:
        check_positive("TISEngine", cap=cap)
        self.cap = float(cap)

    def policy_loss(self, batch: PolicyBatch):
        return tis_engine_loss(batch, self.cap)


class MIS(LossStabilizer):
    """Masked importance sampling on the engine/trainer gap: tokens (``level="token"``) or whole sequences
    (``level="sequence"``, default) whose weight exceeds ``threshold`` are dropped, the others weighted."""

    def __init__(self, threshold: float = 2.0, level: str = "sequence", lower: float | None = None) -> None:
        check_positive("MIS", threshold=threshold)
        if lower is not None:
            check_positive("MIS", lower=lower)
            if lower >= threshold:
                raise ValueError(f"MIS: lower={lower} must be below threshold={threshold}")
        if level not in ("token", "sequence"):
            raise ValueError(f"MIS: level={level!r} is not 'token' or 'sequence'")
        self.threshold, self.level, self.lower = float(threshold), level, lower

    def policy_loss(self, batch: PolicyBatch):
        return mis_loss(batch, self.threshold, self.level, self.lower)


class IcePop(LossStabilizer):
    """IcePop (Ring-1T): tokens whose train/infer ratio leaves [alpha, beta] (default [0.5, 5]) carry no gradient,
    the others are weighted by the ratio, times the module's clipped surrogate."""

    def __init__(self, alpha: float = 0.5, beta: float = 5.0) -> None:
        check_positive("IcePop", alpha=alpha, beta=beta)
        if not alpha <= 1.0 <= beta:
            raise ValueError(f"IcePop: need alpha <= 1 <= beta (the band must contain the on-policy ratio 1), got "
                             f"alpha={alpha}, beta={beta}")
        self.alpha, self.beta = float(alpha), float(beta)

    def policy_loss(self, batch: PolicyBatch):
        return icepop_loss(batch, self.alpha, self.beta)
