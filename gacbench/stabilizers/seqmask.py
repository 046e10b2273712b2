"""Sequence masks on the module's clipped surrogate: off-policy sequence masking (DeepSeek-V3.2) and geometric
sequence masking (SkyRL), as pure functions plus thin callbacks.

Both decide per whole response from a length-normalised log-ratio between the sampling policy mu and the policy
being trained, and multiply the module's clipped surrogate (ratio r = pi_theta / pi_behav, the module's clip range
and aggregation) by the 0/1 decision: a dropped response carries no gradient and stays in the aggregation's
denominator (as in TRL, slime and SkyRL, which multiply the per-token loss and keep the original token count).

The sampling policy mu: ``sampling="behav"`` (default) is pi_behav, the trainer's log-probs of the version that
generated the data, so the masks see the staleness gap, as every staleness correction of this suite does;
``sampling="engine"`` is the rollout engine's log-probs of that version (TRL's ``sampling_per_token_logps`` with
vLLM, SkyRL's ``rollout_logprobs``), which carry the engine/trainer gap as well. The policy being trained enters
detached: pi_theta for the masking KL, pi_prox (the current policy at the time the batch is consumed) for the
geometric ratio; with one update per batch the two are equal in value.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gacbench.stabilizers.base import (
    LOG_RATIO_CLAMP,
    LossStabilizer,
    PolicyBatch,
    check_positive,
    clipped_surrogate,
    safe_log_ratio,
    sanitize,
)

SAMPLING = ("behav", "engine")


def sampling_logp(batch: PolicyBatch, sampling: str, who: str) -> Tensor:
    """The sampling policy's log-probs: ``"behav"`` -> ``logp_behav``, ``"engine"`` -> ``logp_engine`` (required)."""
    if sampling not in SAMPLING:
        raise ValueError(f"{who}: sampling={sampling!r} is not one of {', '.join(SAMPLING)}")
    return batch.logp_behav if sampling == "behav" else batch.engine_logp(who)


def sequence_mean(x: Tensor, mask: Tensor) -> Tensor:
    """(B,) mean of ``x`` (B, T) over each sequence's response tokens (0 for a sequence without any); padding,
    NaN included, never reaches the result."""
    mask = mask.bool()
    return sanitize(x, mask).sum(-1) / mask.sum(-1).clamp_min(1).to(x.dtype)


def opsm_kl(logp: Tensor, logp_sampling: Tensor, mask: Tensor) -> Tensor:
    """(B,) KL_i = mean_t (log mu(y_t) - log pi_theta(y_t)) over each response's tokens, both detached."""
    return sequence_mean(safe_log_ratio(logp_sampling.detach(), logp.detach(), mask), mask)


def opsm_keep(logp: Tensor, logp_sampling: Tensor, adv: Tensor, mask: Tensor, delta: float = 1e-4,
              kl: Tensor | None = None) -> Tensor:
    """Off-policy sequence masking, (B,) bool keep-decision per response (``kl``: :func:`opsm_kl`, if computed).

    KL_i = mean_t (log mu(y_t) - log pi_theta(y_t)) over the response's tokens (the k1 estimate of
    KL(mu || pi_theta) on tokens sampled from mu), A_i = mean_t A_t over the same tokens; the response is dropped
    when A_i < 0 and KL_i > delta (both strict), kept otherwise."""
    mask = mask.bool()
    kl = opsm_kl(logp, logp_sampling, mask) if kl is None else kl
    seq_adv = sequence_mean(adv.detach(), mask)
    return ~((seq_adv < 0) & (kl > delta))


def opsm_loss(batch: PolicyBatch, delta: float = 1e-4, sampling: str = "behav") -> tuple[Tensor, dict[str, Tensor]]:
    """The module's clipped surrogate times the OPSM keep-decision of each response (:func:`opsm_keep`), shapes
    (B, T); dropped responses stay in the denominator."""
    m = batch.mask
    mu = sampling_logp(batch, sampling, "opsm")
    kl = opsm_kl(batch.logp, mu, m.bool())
    keep = opsm_keep(batch.logp, mu, batch.adv, m, delta, kl=kl)
    weight = keep.unsqueeze(-1).expand_as(m).to(batch.logp.dtype)
    loss, metrics = clipped_surrogate(batch, weight=weight)
    has_tokens = m.any(-1)
    metrics.update({"opsm/masked_frac": (~keep & has_tokens).sum() / has_tokens.sum().clamp_min(1),
                    "opsm/seq_kl_mean": kl[has_tokens].mean() if has_tokens.any() else 0.0,
                    "opsm/delta": delta})
    return loss, metrics


def geo_mean_ratio(logp: Tensor, logp_sampling: Tensor, mask: Tensor) -> Tensor:
    """(B,) geometric mean of the token ratios pi / mu over each response, exp(mean_t log(pi(y_t) / mu(y_t))),
    with the mean clamped to +-LOG_RATIO_CLAMP before exp; 1 for a sequence without response tokens."""
    mask = mask.bool()
    diff = sanitize(logp.detach(), mask) - sanitize(logp_sampling.detach(), mask)
    return torch.exp(sequence_mean(diff, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def geo_seq_mask_loss(batch: PolicyBatch, low: float = 0.99, high: float = 1.01,
                      sampling: str = "behav") -> tuple[Tensor, dict[str, Tensor]]:
    """Geometric sequence masking, shapes (B, T): g_i = exp(mean_t log(pi_prox / mu)); a response with g_i < low or
    g_i > high is dropped (bounds inclusive), the module's clipped surrogate over the others; dropped responses stay
    in the denominator."""
    m = batch.mask
    g = geo_mean_ratio(batch.logp_prox, sampling_logp(batch, sampling, "geo-seq-mask"), m)
    over, under = g > high, g < low
    keep = ~(over | under)
    weight = keep.unsqueeze(-1).expand_as(m).to(batch.logp.dtype)
    loss, metrics = clipped_surrogate(batch, weight=weight)
    has_tokens = m.any(-1)
    n = has_tokens.sum().clamp_min(1)
    metrics.update({"geo/masked_frac": (~keep & has_tokens).sum() / n,
                    "geo/over_high_frac": (over & has_tokens).sum() / n,
                    "geo/under_low_frac": (under & has_tokens).sum() / n,
                    "geo/ratio_mean": g[has_tokens].mean() if has_tokens.any() else 1.0})
    return loss, metrics


class OPSM(LossStabilizer):
    """Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556, Section 3.1, Equation 9 as TRL's
    ``off_policy_mask_threshold`` and slime's ``compute_opsm_mask`` implement it): a response with negative
    advantage whose mean log(mu / pi_theta) exceeds delta (slime's default 1e-4) is dropped from the module's
    clipped surrogate."""

    on_policy_identity = True  # sampling="behav": KL_i = 0 <= delta, no response dropped

    def __init__(self, delta: float = 1e-4, sampling: str = "behav") -> None:
        check_positive("OPSM (delta, the sequence-KL threshold; slime's default 1e-4)", delta=delta)
        if sampling not in SAMPLING:
            raise ValueError(f"OPSM: sampling={sampling!r} is not one of {', '.join(SAMPLING)}")
        self.delta, self.sampling = float(delta), sampling
        self.on_policy_identity = sampling == "behav"  # the engine's log-probs differ from the trainer's

    def policy_loss(self, batch: PolicyBatch):
        return opsm_loss(batch, self.delta, self.sampling)


class GeoSeqMask(LossStabilizer):
    """Geometric sequence masking (SkyRL ``off_policy_correction_utils.compute_sequence_mask``,
    ``sequence_mask_metric="geometric"``, bounds [0.99, 1.01]): a response whose
    geometric-mean ratio exp(mean_t log(pi / mu)) leaves [low, high] is dropped from the module's clipped
    surrogate."""

    on_policy_identity = True  # sampling="behav": g_i = 1 lies in [low, high], no response dropped

    def __init__(self, low: float = 0.99, high: float = 1.01, sampling: str = "behav") -> None:
        check_positive("GeoSeqMask", low=low, high=high)
        if not low <= 1.0 <= high:
            raise ValueError(f"GeoSeqMask: need low <= 1 <= high (the band must contain the on-policy ratio 1), got "
                             f"low={low}, high={high}")
        if sampling not in SAMPLING:
            raise ValueError(f"GeoSeqMask: sampling={sampling!r} is not one of {', '.join(SAMPLING)}")
        self.low, self.high, self.sampling = float(low), float(high), sampling
        self.on_policy_identity = sampling == "behav"

    def policy_loss(self, batch: PolicyBatch):
        return geo_seq_mask_loss(batch, self.low, self.high, self.sampling)
