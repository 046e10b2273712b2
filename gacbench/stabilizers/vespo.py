"""VESPO (Shen et al., arXiv 2602.10693; code FloyedShen/VESPO, ``recipe/vespo/code/core_algos.py``): a REINFORCE
gradient weighted by a detached gamma-shaped function of the sequence importance ratio.

W_i = exp(sum_t log(pi_theta / pi_behav)) over the response's tokens (the product of the token ratios, not the
geometric mean: no length normalisation), each token's log-ratio clamped to +-20 and the sum clamped to
[log 1e-8, 20]. phi(W) = W^k exp(lambda (1 - W)) (normalised so that phi(1) = 1), computed in log space as
lambda + k log W - lambda W, with (k, lambda) = (k_pos, lambda_pos) for a response with A >= 0 and
(k_neg, lambda_neg) for A < 0. Loss -agg(sg(phi(W_i)) A log pi_theta) with the module's aggregation; the module's
clip range is not used (VESPO has no clipping). Defaults: the authors' code and scripts, k_pos = 2,
lambda_pos = 3, k_neg = 3, lambda_neg = 2.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gacbench.stabilizers.base import (
    LOG_RATIO_CLAMP,
    LossStabilizer,
    PolicyBatch,
    agg_loss,
    check_positive,
    masked_mean,
    ratio_metrics,
    safe_log_ratio,
    sanitize,
)

LOG_W_MIN = math.log(1e-8)  # the authors' code floors W at 1e-8 before its log


def vespo_log_weight(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """(B,) log W_i = sum_t log r_t over each response's tokens, clamped to [log 1e-8, 20]; ``log_ratio`` (B, T)."""
    return sanitize(log_ratio.detach(), mask.bool()).sum(-1).clamp(LOG_W_MIN, LOG_RATIO_CLAMP)


def vespo_phi(log_w: Tensor, seq_adv: Tensor, k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0,
              lambda_neg: float = 2.0) -> Tensor:
    """(B,) phi(W) = exp(lambda + k log W - lambda W), with (k, lambda) chosen by the sign of the sequence's
    advantage (A >= 0: the positive pair); a non-finite value is 0."""
    pos = seq_adv >= 0
    k = torch.where(pos, k_pos, k_neg).to(log_w.dtype)
    lam = torch.where(pos, lambda_pos, lambda_neg).to(log_w.dtype)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def vespo_loss(batch: PolicyBatch, k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0,
               lambda_neg: float = 2.0) -> tuple[Tensor, dict[str, Tensor]]:
    """-agg(sg(phi(W_i)) A log pi_theta), shapes (B, T); the sequence's advantage is its first response token's (the
    authors' ``advantages[:, 0]``: GRPO's advantage is constant along a sequence)."""
    m = batch.mask
    log_r = safe_log_ratio(batch.logp, batch.logp_behav, m)
    log_w = vespo_log_weight(log_r, m)
    adv = sanitize(batch.adv, m)
    first = m.float().argmax(-1, keepdim=True)  # the first response token (0 for a row without any)
    seq_adv = adv.detach().gather(-1, first).squeeze(-1)
    phi = vespo_phi(log_w, seq_adv, k_pos, lambda_pos, k_neg, lambda_neg).detach()
    per_token = -phi.unsqueeze(-1) * adv * sanitize(batch.logp, m)
    loss = agg_loss(per_token, m, batch.agg)
    has_tokens = m.any(-1)
    w = torch.exp(log_w)
    metrics = {"pg/clipfrac": 0.0, **ratio_metrics(torch.exp(log_r), m),
               "vespo/phi_mean": phi[has_tokens].mean() if has_tokens.any() else 1.0,
               "vespo/w_seq_mean": w[has_tokens].mean() if has_tokens.any() else 1.0,
               "vespo/phi_token_mean": masked_mean(phi.unsqueeze(-1).expand_as(log_r), m)}
    return loss, metrics


class VESPO(LossStabilizer):
    """VESPO (arXiv 2602.10693, the authors' code FloyedShen/VESPO): REINFORCE weighted by the detached gamma kernel
    phi(W) = W^k exp(lambda (1 - W)) of the sequence ratio W = prod_t pi_theta / pi_behav, k = 2, lambda = 3 for
    A >= 0 and k = 3, lambda = 2 for A < 0; no clipping."""

    on_policy_identity = True  # W = 1 and phi(1) = 1 for every (k, lambda): -A grad log pi

    def __init__(self, k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0,
                 lambda_neg: float = 2.0) -> None:
        check_positive("VESPO", k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg, lambda_neg=lambda_neg)
        self.kw = dict(k_pos=float(k_pos), lambda_pos=float(lambda_pos), k_neg=float(k_neg),
                       lambda_neg=float(lambda_neg))

    def policy_loss(self, batch: PolicyBatch):
        return vespo_loss(batch, **self.kw)
