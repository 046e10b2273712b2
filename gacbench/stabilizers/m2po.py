"""M2PO (Zheng et al., arXiv 2510.01161): second-moment trust region on the log importance ratio.

Two variants, one option:

- ``variant="mask"`` (the paper's statement, as the issue and AReaL's implementation read it):
  M2 = mean((log r)^2) over the batch's response tokens; if M2 > tau, mask the tokens with the largest
  (log r)^2 until the M2 of the remaining tokens is at most tau. The loss is -agg(r A) over the kept
  tokens, with no epsilon-clipping.
- ``variant="official"`` (the authors' verl code): the budget is measured only on the *harmful*
  tokens (A > 0 with r > 1, A < 0 with r < 1), nothing is masked; instead one threshold t is found by
  water-filling (capping the harmful (log r)^2 at t^2 brings their mean to at most tau) and turned into
  PPO clip bounds [exp(-t), exp(t)] applied to every token.

The mask variant drops whole tokens (no gradient) and never clips; the official one keeps every token
and clips symmetrically in log-space, so harmless tokens outside the bounds lose their gradient too.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from gacbench.stabilizers.base import LossStabilizer, PolicyBatch, agg_loss, clipped_surrogate, masked_mean, ratio_metrics


def _gather(values: Tensor) -> Tensor:
    """All ranks' 1-D values, concatenated (identity without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return values
    n = torch.tensor([values.numel()], device=values.device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    width = int(max(s.item() for s in sizes))
    padded = torch.full((width,), float("nan"), device=values.device, dtype=values.dtype)
    padded[: values.numel()] = values
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)])


def m2po_mask(log_ratio: Tensor, mask: Tensor, tau: float = 0.04) -> Tensor:
    """Keep-mask (bool, same shape as ``log_ratio``): drop the response tokens with the largest (log r)^2
    until the mean (log r)^2 of the kept ones is at most ``tau``. Ties at the cut are dropped together
    (the rule is a threshold on (log r)^2). Under DDP the threshold is global (values all-gathered)."""
    if tau <= 0:
        raise ValueError(f"m2po_mask: tau={tau!r} must be positive")
    mask = mask.bool()
    v = (log_ratio.detach().float() ** 2)
    vals = _gather(v[mask])
    if vals.numel() == 0 or float(vals.mean()) <= tau:
        return mask.clone()
    desc = torch.sort(vals, descending=True).values
    suffix_sum = desc.flip(0).cumsum(0).flip(0)  # sum of desc[k:]
    remaining = torch.arange(desc.numel(), 0, -1, device=desc.device, dtype=desc.dtype)  # n - k
    ok = (suffix_sum / remaining) <= tau
    k = int(torch.nonzero(ok)[0]) if bool(ok.any()) else desc.numel()  # tokens to drop
    if k == desc.numel():
        return torch.zeros_like(mask)
    # drop every token whose value reaches the last dropped one: ties at the cut go together, and
    # removing more of the largest values can only lower the kept mean further
    return mask & (v < desc[k - 1])


def m2po_official_bounds(log_ratio: Tensor, adv: Tensor, mask: Tensor, budget: float = 0.04) -> tuple[float, float, float]:
    """The official code's variant: (ratio_low, ratio_high, M2 of the harmful tokens).

    Harmful tokens: A > 0 with r > 1, or A < 0 with r < 1. If their mean (log r)^2 exceeds ``budget``,
    find t with mean(min((log r)^2, t^2)) <= budget (water-filling at a breakpoint, conservative) and
    return (exp(-t), exp(t)); otherwise no clipping (0, inf)."""
    if budget <= 0:
        raise ValueError(f"m2po_official_bounds: budget={budget!r} must be positive")
    lr = log_ratio.detach().float()
    harmful = mask.bool() & (((adv > 0) & (lr > 0)) | ((adv < 0) & (lr < 0)))
    v = _gather((lr**2)[harmful])
    if v.numel() == 0:
        return 0.0, math.inf, 0.0
    m2 = float(v.mean())
    if m2 <= budget:
        return 0.0, math.inf, m2
    asc = torch.sort(v).values
    n = asc.numel()
    cums = asc.cumsum(0)
    # capping at asc[k]: mean = (cums[k-1] + asc[k] * (n - k)) / n, increasing in k
    capped = (torch.cat([torch.zeros(1, device=asc.device), cums[:-1]]) + asc * torch.arange(n, 0, -1, device=asc.device)) / n
    over = torch.nonzero(capped > budget)
    k = int(over[0]) if over.numel() else n
    t2 = float(asc[k - 1]) if k > 0 else 0.0
    t = math.sqrt(max(t2, 0.0))
    return math.exp(-t), math.exp(t), m2


class M2PO(LossStabilizer):
    """M2PO as a loss-side stabilizer. ``tau``: the second-moment budget (paper: 0.04);
    ``variant``: "mask" (default, the paper) or "official" (the authors' code); see the module docstring."""

    def __init__(self, tau: float = 0.04, variant: str = "mask", agg: str = "token-mean") -> None:
        super().__init__(agg)
        if not (isinstance(tau, (int, float)) and tau > 0 and math.isfinite(tau)):
            raise ValueError(f"M2PO: tau={tau!r} must be a positive number (the paper uses 0.04)")
        if variant not in ("mask", "official"):
            raise ValueError(f"M2PO: variant={variant!r} is not 'mask' or 'official'")
        self.tau, self.variant = float(tau), variant

    def policy_loss(self, batch: PolicyBatch):
        log_ratio = batch.logp - batch.logp_behav
        m2 = masked_mean(log_ratio.detach() ** 2, batch.mask)
        if self.variant == "official":
            lo, hi, m2_harmful = m2po_official_bounds(log_ratio, batch.adv, batch.mask, self.tau)
            loss, metrics = clipped_surrogate(batch, agg=self.agg, ratio_low=lo, ratio_high=min(hi, 1e30))
            metrics.update({"m2po/m2": m2, "m2po/m2_harmful": m2_harmful, "m2po/ratio_low": lo,
                            "m2po/ratio_high": hi if math.isfinite(hi) else -1.0, "m2po/masked_frac": 0.0})
            return loss, metrics
        keep = m2po_mask(log_ratio, batch.mask, self.tau)
        ratio = torch.exp(log_ratio)
        # -agg(r A) over kept tokens, normalised by all response tokens (a dropped token counts as zero)
        loss = agg_loss(-batch.adv * ratio * keep.to(ratio.dtype), batch.mask, self.agg)
        metrics = {"m2po/m2": m2, "m2po/m2_kept": masked_mean(log_ratio.detach() ** 2, keep),
                   "m2po/masked_frac": 1.0 - keep.sum() / batch.mask.sum().clamp_min(1), "pg/clipfrac": 0.0,
                   **ratio_metrics(ratio, batch.mask)}
        return loss, metrics
