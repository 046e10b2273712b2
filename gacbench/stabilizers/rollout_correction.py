"""Corrections for the gap between the rollout engine and the trainer: TIS on the engine, MIS, IcePop.

The importance weight here is the train/infer ratio of the generating version,
k = pi_train(y; theta_old) / pi_infer(y; theta_old) = exp(logp_behav - logp_engine), per token (B, T): the
trainer's recomputed behaviour log-probs against the engine's log-probs for the same tokens (verl's
pi_old / pi_rollout in its "decoupled" mode, IcePop's pi_train(theta_old) / pi_infer(theta_old)). It is
detached and multiplies the module's clipped surrogate against the behaviour policy,
min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) with r = pi_theta / pi_behav, so staleness is still
handled by the module's trust region and only the engine gap is corrected. A module without a separate
engine passes its behaviour log-probs as ``logp_engine`` (k = 1: each of these reduces to the module's
surrogate); a batch without ``logp_engine`` is refused with a clear error. The GRPO module's asynchronous and
uniform-lag modes (``rollout.mode: async``, ``uniform``) take their behaviour log-probs from the engine, so there
too k = 1 on every token and each correction is the module's surrogate.

Dual clip: none by default. verl's rollout correction sits on its PPO loss, which always caps the loss of a
negative-advantage token at -c A (c = ``clip_ratio_c`` = 3); here r = pi_theta / pi_behav also carries the
staleness (pi_behav is the generating version), so without the cap a token with A < 0 and r > c keeps its
gradient -A r. ``dual_clip=c`` (c > 1) applies verl's cap; the default (None) leaves it off, which is what the
published cells ran.
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
    over_kept_tokens,
    safe_log_ratio,
    sanitize,
)


def engine_log_ratio(batch: PolicyBatch, who: str) -> Tensor:
    """log k = logp_behav - logp_engine, (B, T), 0 at masked-out positions, clamped; detached."""
    return safe_log_ratio(batch.logp_behav, batch.engine_logp(who), batch.mask).detach()


def check_dual_clip(who: str, dual_clip: float | None) -> None:
    """A clear error for a dual clip that is neither None (off) nor a number c > 1."""
    if dual_clip is None:
        return
    check_positive(who, dual_clip=dual_clip)
    if dual_clip <= 1.0:
        raise ValueError(f"{who}: dual_clip={dual_clip} must be > 1 (the cap -c A lies beyond the clip range), or None "
                         "for no dual clip")


def tis_engine_loss(batch: PolicyBatch, cap: float = 2.0,
                    dual_clip: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level truncated IS (verl rollout correction ``rollout_is="token"``, threshold C = 2):
    -agg(min(k, C) * min(r A, clip(r) A)), shapes (B, T); ``dual_clip`` = c caps the A < 0 tokens' surrogate at
    -c A (see the module doc)."""
    k = torch.exp(engine_log_ratio(batch, "tis-engine"))
    loss, metrics = clipped_surrogate(batch, weight=k.clamp(max=cap), dual_clip=dual_clip)
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


def mis_loss(batch: PolicyBatch, threshold: float = 2.0, level: str = "sequence", lower: float | None = None,
             dual_clip: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """-agg(rho * min(r A, clip(r) A)) over the kept tokens (rejected tokens leave the mask, as verl's rejection
    sampling does), shapes (B, T); see :func:`mis_weights`. ``dual_clip``: see the module doc."""
    weight, keep = mis_weights(engine_log_ratio(batch, "mis"), batch.mask, threshold, level, lower)
    loss, metrics = clipped_surrogate(dataclasses.replace(batch, mask=keep), weight=weight, dual_clip=dual_clip)
    loss = over_kept_tokens(loss, keep, batch.mask, batch.agg)
    metrics.update({"is/engine_weight_mean": masked_mean(weight, keep),
                    "mis/masked_frac": 1.0 - keep.sum() / batch.mask.sum().clamp_min(1)})
    return loss, metrics


def icepop_weights(log_k: Tensor, mask: Tensor, alpha: float = 0.5, beta: float = 5.0) -> Tensor:
    """IcePop's M(k; alpha, beta) = k for alpha <= k <= beta, else 0; (B, T), 0 at masked-out positions."""
    k = torch.exp(sanitize(log_k, mask.bool()))
    return torch.where(mask.bool() & (k >= alpha) & (k <= beta), k, 0.0)


def icepop_loss(batch: PolicyBatch, alpha: float = 0.5, beta: float = 5.0,
                dual_clip: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """-agg(M(k) * min(r A, clip(r) A)), shapes (B, T): tokens whose train/infer ratio leaves [alpha, beta] carry
    no gradient; the others are weighted by k. Dropped tokens stay in the aggregation's denominator.
    ``dual_clip``: see the module doc."""
    log_k = engine_log_ratio(batch, "icepop")
    weight = icepop_weights(log_k, batch.mask, alpha, beta)
    loss, metrics = clipped_surrogate(batch, weight=weight, dual_clip=dual_clip)
    in_band = batch.mask & (weight > 0)
    metrics.update({"icepop/masked_frac": 1.0 - in_band.sum() / batch.mask.sum().clamp_min(1),
                    "is/engine_weight_mean": masked_mean(torch.exp(log_k), batch.mask)})
    return loss, metrics


class TISEngine(LossStabilizer):
    """Truncated IS on the engine/trainer gap (verl's rollout correction, token level): weight min(k, C),
    k = pi_train(theta_old) / pi_infer(theta_old), times the module's clipped surrogate. No dual clip unless
    ``dual_clip`` = c > 1 (verl's PPO loss always caps A < 0 tokens at -3 A; here r = pi_theta / pi_behav carries
    the staleness, so an A < 0 token with r > 3 keeps its gradient by default)."""

    def __init__(self, cap: float = 2.0, dual_clip: float | None = None) -> None:
        check_positive("TISEngine", cap=cap)
        check_dual_clip("TISEngine", dual_clip)
        self.cap = float(cap)
        self.dual_clip = None if dual_clip is None else float(dual_clip)

    def policy_loss(self, batch: PolicyBatch):
        return tis_engine_loss(batch, self.cap, self.dual_clip)


class MIS(LossStabilizer):
    """Masked importance sampling on the engine/trainer gap: tokens (``level="token"``) or whole sequences
    (``level="sequence"``, default) whose weight exceeds ``threshold`` are dropped, the others weighted. No dual
    clip unless ``dual_clip`` = c > 1 (as :class:`TISEngine`)."""

    def __init__(self, threshold: float = 2.0, level: str = "sequence", lower: float | None = None,
                 dual_clip: float | None = None) -> None:
        check_positive("MIS", threshold=threshold)
        check_dual_clip("MIS", dual_clip)
        if lower is not None:
            check_positive("MIS", lower=lower)
            if lower >= threshold:
                raise ValueError(f"MIS: lower={lower} must be below threshold={threshold}")
        if level not in ("token", "sequence"):
            raise ValueError(f"MIS: level={level!r} is not 'token' or 'sequence'")
        self.threshold, self.level, self.lower = float(threshold), level, lower
        self.dual_clip = None if dual_clip is None else float(dual_clip)

    def policy_loss(self, batch: PolicyBatch):
        return mis_loss(batch, self.threshold, self.level, self.lower, self.dual_clip)


class IcePop(LossStabilizer):
    """IcePop (Ring-1T): tokens whose train/infer ratio leaves [alpha, beta] (default [0.5, 5]) carry no gradient,
    the others are weighted by the ratio, times the module's clipped surrogate. No dual clip unless ``dual_clip``
    = c > 1 (as :class:`TISEngine`)."""

    def __init__(self, alpha: float = 0.5, beta: float = 5.0, dual_clip: float | None = None) -> None:
        check_positive("IcePop", alpha=alpha, beta=beta)
        check_dual_clip("IcePop", dual_clip)
        if not alpha <= 1.0 <= beta:
            raise ValueError(f"IcePop: need alpha <= 1 <= beta (the band must contain the on-policy ratio 1), got "
                             f"alpha={alpha}, beta={beta}")
        self.alpha, self.beta = float(alpha), float(beta)
        self.dual_clip = None if dual_clip is None else float(dual_clip)

    def policy_loss(self, batch: PolicyBatch):
        return icepop_loss(batch, self.alpha, self.beta, self.dual_clip)
