"""BAPO (Xi et al., arXiv 2510.18927): per update, adapt the ratio clip bounds (c_low, c_high) so that the
positive-advantage tokens' share of the objective reaches rho0.

Share (Eq. 8). Every response token counts, a clipped token at its bound value: a token with A > 0
contributes A min(r, c_high) (the paper's min(r A, clip(r, 0, c_high) A)), a token with A < 0 contributes
|A| max(r, c_low) (the magnitude of min(r A, clip(r, c_low, c_high) A)); share = positive contributions /
all contributions. Eq. 8 writes each sum under pi_rollout(y_t), the expectation over the rollout policy;
with tokens sampled from it the estimate is the plain sum over the batch's tokens (as the authors' code
computes it). A batch without any contribution (all advantages zero) needs no rebalancing (share = 1).
r = pi_theta / pi_behav (the trainer's behaviour log-probs of the generating version).

Search, ``variant="paper"`` (Algorithm 1, default): start at (a_low, a_high); while share < rho0 and
c_low + delta2 <= b_low: raise c_high by delta1 if c_high + delta1 <= b_high, otherwise raise c_low by delta2.
Bounds are compared with a tolerance of 1e-9 (0.88 + 0.02 exceeds 0.9 in floating point) and computed as
a + k delta from step counts. A share exactly rho0 stops the search. Under this accounting raising c_low
only adds to the negative side, so once c_high is at b_high the c_low phase runs to its end.

``variant="official"`` (the authors' ``recipe/bapo/policy_loss.py``): the same accounting, compared as
pos / (neg + 1e-8) >= rho0 / (1 - rho0) (infinite when neg = 0); c_low is raised first,
c_low <- min(c_low + delta2, b_low) while c_low < b_low, then c_high <- min(c_high + delta1, b_high) while
c_high < b_high; the loss adds verl's dual clip (c = 3) for negative advantages.

Both search over the whole update's batch with one all-reduce (the authors' code searches per
micro-batch, all-reducing the sums over data-parallel ranks).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gacbench.stabilizers.base import (
    LossStabilizer,
    PolicyBatch,
    check_positive,
    clipped_surrogate,
    global_sum,
    safe_log_ratio,
    sanitize,
)

TOL = 1e-9
VARIANTS = ("paper", "official")


def _steps(start: float, stop: float, step: float) -> list[float]:
    """start + k step for k = 1, 2, ... while <= stop (with tolerance)."""
    out, k = [], 1
    while start + k * step <= stop + TOL:
        out.append(start + k * step)
        k += 1
    return out


def bapo_path(a_low: float, b_low: float, a_high: float, b_high: float, delta1: float, delta2: float,
              variant: str = "paper") -> list[tuple[float, float]]:
    """Every (c_low, c_high) the search can visit, in order; the search stops at the first whose share reaches
    rho0 (else at the last)."""
    path = [(a_low, a_high)]
    if variant == "paper":
        if a_low + delta2 <= b_low + TOL:  # Algorithm 1's loop condition holds throughout the c_high phase
            highs = _steps(a_high, b_high, delta1)
            path += [(a_low, h) for h in highs]
            path += [(lo, highs[-1] if highs else a_high) for lo in _steps(a_low, b_low, delta2)]
        return path
    lo, hi = a_low, a_high
    while lo < b_low:
        lo = min(lo + delta2, b_low)
        path.append((lo, hi))
    while hi < b_high:
        hi = min(hi + delta1, b_high)
        path.append((lo, hi))
    return path


def bapo_contributions(ratio: Tensor, adv: Tensor, mask: Tensor, path: list[tuple[float, float]]) -> Tensor:
    """(K, 2): the positive and negative contributions (Eq. 8) at every candidate, summed over data-parallel ranks
    (one collective)."""
    mask = mask.bool()
    r = sanitize(ratio.detach().double(), mask)[mask].view(1, -1)
    a = sanitize(adv.detach().double(), mask)[mask].view(1, -1)
    lows = torch.tensor([p[0] for p in path], dtype=r.dtype, device=r.device).view(-1, 1)
    highs = torch.tensor([p[1] for p in path], dtype=r.dtype, device=r.device).view(-1, 1)
    pos = torch.where(a > 0, a * torch.minimum(r, highs), 0.0).sum(-1)
    neg = torch.where(a < 0, -a * torch.maximum(r, lows), 0.0).sum(-1)
    return global_sum(torch.stack([pos, neg], -1))


def bapo_search(ratio: Tensor, adv: Tensor, mask: Tensor, rho0: float = 0.4, a_low: float = 0.6, b_low: float = 0.9,
                a_high: float = 1.2, b_high: float = 3.0, delta1: float = 0.05, delta2: float = 0.02,
                variant: str = "paper") -> tuple[float, float, float]:
    """(c_low, c_high, positive share at them); inputs of shape (B, T); see the module docstring."""
    path = bapo_path(a_low, b_low, a_high, b_high, delta1, delta2, variant)
    sums = bapo_contributions(ratio, adv, mask, path)
    pos, neg = sums[:, 0], sums[:, 1]
    total = pos + neg
    share = torch.where(total > 0, pos / total.clamp_min(1e-300), torch.ones_like(pos))
    if variant == "paper":
        met = share >= rho0
    else:
        pos_neg = torch.where(neg > 0, pos / (neg + 1e-8), torch.full_like(pos, float("inf")))
        met = pos_neg >= rho0 / (1.0 - rho0)
    hit = torch.nonzero(met)
    k = int(hit[0]) if hit.numel() else len(path) - 1
    return path[k][0], path[k][1], float(share[k])


def bapo_bounds(ratio: Tensor, adv: Tensor, mask: Tensor, **kwargs) -> tuple[float, float]:
    """(c_low, c_high) chosen by the search; keyword settings as :func:`bapo_search`."""
    c_low, c_high, _ = bapo_search(ratio, adv, mask, **kwargs)
    return c_low, c_high


class BAPO(LossStabilizer):
    """BAPO's adaptive clipping (paper defaults rho0 = 0.4, [a-, b-] = [0.6, 0.9], [a+, b+] = [1.2, 3.0],
    delta1 = 0.05, delta2 = 0.02). BAPO chooses its own clip bounds (the module's clip_low/clip_high are not
    used) and logs them as bapo/c_low, bapo/c_high."""

    # every bound it can choose has c_low <= 1 <= c_high, so a ratio of 1 is never clipped (the official variant's
    # dual clip 3 caps only a loss above 3 |A|)
    on_policy_identity = True

    def __init__(self, rho0: float = 0.4, a_low: float = 0.6, b_low: float = 0.9, a_high: float = 1.2,
                 b_high: float = 3.0, delta1: float = 0.05, delta2: float = 0.02, variant: str = "paper") -> None:
        if not (isinstance(rho0, (int, float)) and 0.0 < rho0 < 1.0):
            raise ValueError(f"BAPO: rho0={rho0!r} must be in (0, 1) (a share of the objective; the paper uses 0.4)")
        if not (0.0 < a_low <= b_low <= 1.0 <= a_high <= b_high):
            raise ValueError(f"BAPO: need 0 < a_low <= b_low <= 1 <= a_high <= b_high, got a_low={a_low}, "
                             f"b_low={b_low}, a_high={a_high}, b_high={b_high}")
        check_positive("BAPO (step sizes)", delta1=delta1, delta2=delta2)
        if variant not in VARIANTS:
            raise ValueError(f"BAPO: variant={variant!r} is not one of {', '.join(VARIANTS)}")
        self.kw = dict(rho0=rho0, a_low=a_low, b_low=b_low, a_high=a_high, b_high=b_high, delta1=delta1, delta2=delta2,
                       variant=variant)

    def policy_loss(self, batch: PolicyBatch):
        ratio = torch.exp(safe_log_ratio(batch.logp, batch.logp_behav, batch.mask))
        c_low, c_high, share = bapo_search(ratio, batch.adv, batch.mask, **self.kw)
        dual = 3.0 if self.kw["variant"] == "official" else None
        loss, metrics = clipped_surrogate(batch, ratio_low=c_low, ratio_high=c_high, dual_clip=dual)
        metrics.update({"bapo/c_low": c_low, "bapo/c_high": c_high, "bapo/pos_share": share})
        return loss, metrics
