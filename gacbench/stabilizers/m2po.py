"""M2PO (Zheng, Zhao and Chen, arXiv 2510.01161): a second-moment trust region on the log importance ratio.

r = pi_theta / pi_behav per token (the trainer's behaviour log-probs of the generating version). Three
variants, one option (docs/baselines.md says where each was read):

- ``variant="paper"`` (default; Algorithm 1 of the paper, "M2PO Masking", as the authors' repository shows it):
  the trust-region tokens are those PPO's clipping could act on, A > 0 with r > 1 or A < 0 with r < 1.
  M2 = mean((log r)^2) over the trust-region tokens of the whole update's batch; while it exceeds tau, the
  trust-region token with the largest (log r)^2 is masked (one argmax per iteration: of tokens tied at the cut,
  the first in batch order) until the remaining trust-region tokens' M2 <= tau (a batch with M2 exactly tau is
  not masked). Other tokens are never masked. Loss: -agg(M r A) over all response tokens (a masked token counts
  as 0 and stays in the denominator's token count), no epsilon-clipping. ``m2po-threshold`` (:class:`M2POThreshold`)
  is the same rule with the tokens tied at the cut masked together.
- ``variant="areal"`` (AReaL's ``_apply_m2po_masking``): M2 over all response tokens, computed from the
  proximal and behaviour log-probs, (log pi_prox - log pi_behav)^2; the largest are masked in sort order
  until the remaining mean is strictly below tau (at least one token is kept); the loss is AReaL's decoupled
  PPO (behaviour weight pi_prox/pi_behav, the module's epsilon-clipping against pi_prox) over the kept
  tokens, with the kept tokens as the denominator.
- ``variant="official"`` (the authors' verl code, ``compute_m2po_policy_loss``): M2 over the trust-region
  tokens, nothing masked; a threshold t found by water-filling (capping the trust-region (log r)^2 at t^2
  brings their mean within tau, at a breakpoint, conservatively) becomes the clip range [exp(-t), exp(t)]
  of the PPO surrogate for every token.

Statistics are global: the values are all-gathered over data-parallel ranks (the authors' code and AReaL
compute them per micro-batch on each rank).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch import Tensor

from gacbench.stabilizers.base import (
    LossStabilizer,
    PolicyBatch,
    agg_loss,
    check_positive,
    clipped_surrogate,
    masked_mean,
    over_kept_tokens,
    ratio_metrics,
    safe_log_ratio,
    sanitize,
)
from gacbench.stabilizers.importance import decoupled_ppo_loss

VARIANTS = ("paper", "areal", "official")
TIES = ("split", "together")


def _gather(values: Tensor) -> tuple[Tensor, int]:
    """All ranks' 1-D values, concatenated in rank order, and how many of them the ranks before this one contribute
    (``values`` and 0 without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return values, 0
    n = torch.tensor([values.numel()], device=values.device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    width = int(max(s.item() for s in sizes))
    padded = torch.full((width,), float("nan"), device=values.device, dtype=values.dtype)
    padded[: values.numel()] = values
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded)
    offset = int(sum(int(s.item()) for s in sizes[: dist.get_rank()]))
    return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)]), offset


def _suffix_means(desc: Tensor) -> Tensor:
    """mean(desc[k:]) for every k, shape (n,)."""
    counts = torch.arange(desc.numel(), 0, -1, device=desc.device, dtype=desc.dtype)
    return desc.flip(0).cumsum(0).flip(0) / counts


def trust_region_tokens(log_ratio: Tensor, adv: Tensor, mask: Tensor) -> Tensor:
    """(B, T) bool: response tokens with A > 0 and r > 1, or A < 0 and r < 1."""
    return mask.bool() & (((adv > 0) & (log_ratio > 0)) | ((adv < 0) & (log_ratio < 0)))


def m2po_mask(log_ratio: Tensor, adv: Tensor, mask: Tensor, tau: float = 0.04, tokens: str = "trust-region",
              ties: str = "split") -> Tensor:
    """Keep-mask (bool, (B, T)) of Algorithm 1: among the candidate tokens (``"trust-region"``, default, or
    ``"all"`` response tokens) drop the one with the largest (log r)^2 while the candidates' remaining mean
    (log r)^2 exceeds ``tau``; non-candidate response tokens are always kept. ``ties="split"`` (default, Algorithm 1's
    one argmax per iteration): exactly as many tokens go as the loop removes, and of tokens tied at the cut the
    first in batch order (row-major; rank order under DDP) go first, as an argmax that returns the first maximal
    index does. ``ties="together"``: every candidate whose value reaches the last dropped one goes (a threshold on
    (log r)^2, independent of token order). Under DDP the values are all-gathered."""
    if tokens not in ("trust-region", "all"):
        raise ValueError(f"m2po_mask: tokens={tokens!r} is not 'trust-region' or 'all'")
    if ties not in TIES:
        raise ValueError(f"m2po_mask: ties={ties!r} is not one of {', '.join(TIES)}")
    check_positive("m2po_mask", tau=tau)
    mask = mask.bool()
    lr = sanitize(log_ratio.detach().float(), mask)
    cand = trust_region_tokens(lr, adv, mask) if tokens == "trust-region" else mask
    v = lr**2
    vals, offset = _gather(v[cand])  # offset: this rank's first value in vals
    if vals.numel() == 0 or float(vals.mean()) <= tau:
        return mask.clone()
    desc = torch.sort(vals, descending=True).values
    suffix_mean = _suffix_means(desc)
    ok = suffix_mean <= tau
    k = int(torch.nonzero(ok)[0]) if bool(ok.any()) else desc.numel()  # candidates to drop
    if k == 0:  # the mean above and the suffix mean of all values rounded to opposite sides of tau: none goes
        return mask.clone()
    cut = desc[k - 1]
    if ties == "together":
        # every candidate whose value reaches the last dropped one goes: removing more of the largest values can
        # only lower the remaining mean further
        return mask & ~(cand & (v >= cut))
    # exactly k go: those above the cut, then the first (k - n_above) tied at the cut in (global) batch order
    at_cut_local = cand & (v == cut)
    tied_global = vals == cut
    n_take = k - int((desc > cut).sum())
    tied_before = int(tied_global[:offset].sum())  # cut is one of vals: >= 1 tie
    order = torch.cumsum(at_cut_local.flatten().long(), 0).reshape(v.shape) + tied_before  # 1-based rank among ties
    drop = (cand & (v > cut)) | (at_cut_local & (order <= n_take))
    return mask & ~drop


def m2po_mask_areal(log_sq: Tensor, mask: Tensor, tau: float = 0.04) -> Tensor:
    """AReaL's mask, (B, T) bool: sort the response tokens' values ``log_sq`` in descending order, drop the first k
    for the smallest k whose remaining mean is strictly below ``tau`` (ties split by sort order, stable); if no
    k qualifies, keep only the smallest value. Under DDP the values are all-gathered (in rank order, so the stable
    sort splits ties as one process holding the whole batch would)."""
    check_positive("m2po_mask_areal", tau=tau)
    mask = mask.bool()
    local = sanitize(log_sq.detach().float(), mask)[mask]
    vals, offset = _gather(local)
    if vals.numel() == 0:
        return mask.clone()
    desc, order = torch.sort(vals, descending=True, stable=True)
    suffix_mean = _suffix_means(desc)
    below = torch.nonzero(suffix_mean < tau)
    k = int(below[0]) if below.numel() else desc.numel() - 1
    keep_sorted = torch.ones_like(desc, dtype=torch.bool)
    keep_sorted[:k] = False
    keep_flat = torch.empty_like(keep_sorted)
    keep_flat[order] = keep_sorted
    out = torch.zeros_like(mask)
    out[mask] = keep_flat[offset: offset + local.numel()]
    return out


def m2po_official_bounds(log_ratio: Tensor, adv: Tensor, mask: Tensor, budget: float = 0.04,
                         min_clip_low: float | None = None,
                         min_clip_high: float | None = None) -> tuple[float, float, float]:
    """The authors' code: (ratio_low, ratio_high, M2 of the trust-region tokens).

    If the trust-region tokens' mean (log r)^2 exceeds ``budget``: sort their values ascending, v_0 <= ... ;
    the capped mean at v_k is (sum_{j<=k} v_j + v_k (n - k - 1)) / n; the first k whose capped mean reaches
    the budget (>=) fixes t^2 = v_{k-1} (t = 0 when k = 0), and the bounds are (exp(-t), exp(t)); otherwise no
    clipping, (0, inf). ``min_clip_low``/``min_clip_high`` (the code's ``miniclip_low/high``, unset in its
    scripts) keep the range at least [1 - min_clip_low, 1 + min_clip_high]."""
    check_positive("m2po_official_bounds", budget=budget)
    mask = mask.bool()
    lr = sanitize(log_ratio.detach().float(), mask)
    v, _ = _gather((lr**2)[trust_region_tokens(lr, adv, mask)])
    if v.numel() == 0:
        return 0.0, math.inf, 0.0
    m2 = float(v.mean())
    if m2 <= budget:
        return 0.0, math.inf, m2
    asc = torch.sort(v).values
    n = asc.numel()
    capped = (asc.cumsum(0) + asc * torch.arange(n - 1, -1, -1, device=asc.device, dtype=asc.dtype)) / n
    reach = torch.nonzero(capped >= budget)
    k = int(reach[0]) if reach.numel() else n
    t = math.sqrt(max(float(asc[k - 1]), 0.0)) if k > 0 else 0.0
    lo, hi = math.exp(-t), math.exp(t)
    if min_clip_low is not None:
        lo = min(lo, 1.0 - min_clip_low)
    if min_clip_high is not None:
        hi = max(hi, 1.0 + min_clip_high)
    return lo, hi, m2


class M2PO(LossStabilizer):
    """M2PO as a loss-side stabilizer. ``tau``: the second-moment budget (paper: 0.04); ``variant``: "paper"
    (default, Algorithm 1), "areal" (AReaL's reading) or "official" (the authors' code); see the module
    docstring. ``weight_cap`` (areal variant only): AReaL's rejection of tokens with pi_prox/pi_behav above it."""

    ties = "split"  # Algorithm 1: one argmax per iteration
    # at ratio 1 every log-ratio is 0: no trust-region token, nothing masked, no clip range narrower than [0, inf)
    on_policy_identity = True

    def __init__(self, tau: float = 0.04, variant: str = "paper", weight_cap: float | None = None) -> None:
        check_positive("M2PO (tau, the paper uses 0.04)", tau=tau)
        if variant not in VARIANTS:
            raise ValueError(f"M2PO: variant={variant!r} is not one of {', '.join(VARIANTS)}")
        if weight_cap is not None:
            if variant != "areal":
                raise ValueError("M2PO: weight_cap applies to variant='areal' only")
            check_positive("M2PO", weight_cap=weight_cap)
        self.tau, self.variant, self.weight_cap = float(tau), variant, weight_cap
        # areal's rejection drops a token whose weight pi_prox / pi_behav = 1 exceeds a cap below 1
        self.on_policy_identity = weight_cap is None or weight_cap >= 1.0

    def policy_loss(self, batch: PolicyBatch):
        m = batch.mask
        log_ratio = safe_log_ratio(batch.logp, batch.logp_behav, m)
        adv = sanitize(batch.adv, m)
        m2 = masked_mean(log_ratio.detach() ** 2, m)
        tr = trust_region_tokens(log_ratio.detach(), adv, m)
        if self.variant == "official":
            lo, hi, m2_tr = m2po_official_bounds(log_ratio, adv, m, self.tau)
            loss, metrics = clipped_surrogate(batch, ratio_low=lo, ratio_high=min(hi, 1e30))
            metrics.update({"m2po/m2": m2, "m2po/m2_trust_region": m2_tr, "m2po/ratio_low": lo,
                            "m2po/ratio_high": hi if math.isfinite(hi) else -1.0, "m2po/masked_frac": 0.0})
            return loss, metrics
        if self.variant == "areal":
            log_sq = safe_log_ratio(batch.logp_prox, batch.logp_behav, m) ** 2
            keep = m2po_mask_areal(log_sq, m, self.tau)
            loss, metrics = decoupled_ppo_loss(dataclasses.replace(batch, mask=keep), self.weight_cap, "mask")
            loss = over_kept_tokens(loss, keep, m, batch.agg)
        else:
            keep = m2po_mask(log_ratio, adv, m, self.tau, ties=self.ties)
            ratio = torch.exp(log_ratio)
            loss = agg_loss(torch.where(keep, -adv * ratio, 0.0), m, batch.agg)
            metrics = {"pg/clipfrac": 0.0, **ratio_metrics(ratio, m)}
        kept_scope = keep if self.variant == "areal" else keep & tr
        metrics.update({"m2po/m2": m2, "m2po/m2_trust_region": masked_mean(log_ratio.detach() ** 2, tr),
                        "m2po/m2_kept": masked_mean(log_ratio.detach() ** 2, kept_scope),
                        "m2po/masked_frac": 1.0 - keep.sum() / m.sum().clamp_min(1)})
        return loss, metrics


class M2POThreshold(M2PO):
    """M2PO's Algorithm 1 with the tokens tied at the cut masked together: every trust-region token whose (log r)^2
    reaches the last one the loop drops is masked (a threshold on (log r)^2, independent of token order). ``tau``:
    the second-moment budget (0.04)."""

    ties = "together"

    def __init__(self, tau: float = 0.04) -> None:
        super().__init__(tau=tau, variant="paper")
