"""BAPO (arXiv 2510.18927): per update, adapt the ratio clip bounds (c_low, c_high) so that the
positive-advantage tokens' share of the objective reaches rho0.

Share. Only tokens whose ratio lies inside the bounds carry a gradient through the clipped
objective; their contributions are |r A|. pos = sum over A > 0 tokens with r <= c_high, neg = sum over
A < 0 tokens with r >= c_low, share = pos / (pos + neg). Raising c_high admits more positive tokens,
raising c_low excludes more negative ones: both raise the share, which is what the paper's search
relies on. (``count_clipped=True`` reproduces the authors' code instead: every token counts, clipped
ones at the bound value, min(r, c_high) A for A >= 0 and max(r, c_low) A for A < 0; there raising c_low
*lowers* the share, so its c_low phase cannot help.)

Search. Start at (a_low, a_high); ``order="high-first"`` (default, the paper's text) raises c_high by
delta1 up to b_high, then c_low by delta2 up to b_low, stopping as soon as share >= rho0;
``order="low-first"`` is the authors' code order. If rho0 is never reached both bounds end at their
maxima. The default is high-first because it is what the paper describes and, under the share
definition above, admitting positive tokens first keeps more of the batch's gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gacbench.stabilizers.base import LossStabilizer, PolicyBatch, clipped_surrogate, global_sum

def bapo_candidates(a_low, b_low, a_high, b_high, delta1, delta2, order="high-first") -> list[tuple[float, float]]:
    """The search path: every (c_low, c_high) the search visits, in order."""
    def steps(start, stop, step):
        out, x = [], start
        while x < stop - 1e-12:
            x = min(x + step, stop)
            out.append(x)
        return out

    path = [(a_low, a_high)]
    if order == "high-first":
        path += [(a_low, h) for h in steps(a_high, b_high, delta1)]
        path += [(lo, b_high) for lo in steps(a_low, b_low, delta2)]
    else:
        path += [(lo, a_high) for lo in steps(a_low, b_low, delta2)]
        path += [(b_low, h) for h in steps(a_high, b_high, delta1)]
    return path


def bapo_shares(ratio: Tensor, adv: Tensor, mask: Tensor, path: list[tuple[float, float]], count_clipped: bool = False) -> Tensor:
    """Positive share at every candidate: tensor (K,). Sums are all-reduced under DDP (one collective)."""
    r, a, m = ratio.detach().float(), adv.detach().float(), mask.bool()
    lows = torch.tensor([p[0] for p in path], device=r.device).view(-1, 1)
    highs = torch.tensor([p[1] for p in path], device=r.device).view(-1, 1)
    r, a = r[m].view(1, -1), a[m].view(1, -1)
    pos_tok, neg_tok = a > 0, a < 0
    if count_clipped:
        eff = torch.where(a >= 0, torch.minimum(r, highs), torch.maximum(r, lows))
        contrib = eff * a
        pos = contrib.clamp(min=0).sum(-1)
        neg = (-contrib.clamp(max=0)).sum(-1)
    else:
        pos = ((r <= highs) & pos_tok).float().mul(r * a.abs()).sum(-1)
        neg = ((r >= lows) & neg_tok).float().mul(r * a.abs()).sum(-1)
    sums = global_sum(torch.stack([pos, neg], -1))  # (K, 2)
    return sums[:, 0] / (sums[:, 0] + sums[:, 1]).clamp_min(1e-12)


def bapo_bounds(ratio: Tensor, advantages: Tensor, mask: Tensor, rho0: float = 0.4, a_low: float = 0.6,
                b_low: float = 0.9, a_high: float = 1.2, b_high: float = 3.0, delta1: float = 0.05,
                delta2: float = 0.02, order: str = "high-first", count_clipped: bool = False) -> tuple[float, float]:
    """(c_low, c_high) chosen by the search (module docstring); shapes of the inputs (B, T)."""
    c_low, c_high, _ = _search(ratio, advantages, mask, rho0, a_low, b_low, a_high, b_high, delta1, delta2, order, count_clipped)
    return c_low, c_high


def _search(ratio, advantages, mask, rho0, a_low, b_low, a_high, b_high, delta1, delta2, order, count_clipped):
    path = bapo_candidates(a_low, b_low, a_high, b_high, delta1, delta2, order)
    shares = bapo_shares(ratio, advantages, mask, path, count_clipped)
    hit = torch.nonzero(shares >= rho0)
    k = int(hit[0]) if hit.numel() else len(path) - 1
    return path[k][0], path[k][1], float(shares[k])


class BAPO(LossStabilizer):
    """BAPO's adaptive clipping as a loss-side stabilizer (paper defaults; see the module docstring)."""

    def __init__(self, rho0: float = 0.4, a_low: float = 0.6, b_low: float = 0.9, a_high: float = 1.2, b_high: float = 3.0,
                 delta1: float = 0.05, delta2: float = 0.02, order: str = "high-first", count_clipped: bool = False,
                 agg: str = "token-mean") -> None:
        super().__init__(agg)
        if not 0.0 < rho0 < 1.0:
            raise ValueError(f"BAPO: rho0={rho0!r} must be in (0, 1) (a share of the objective; the paper uses 0.4)")
        if not (0.0 < a_low <= b_low <= 1.0 <= a_high <= b_high):
            raise ValueError(f"BAPO: need 0 < a_low <= b_low <= 1 <= a_high <= b_high, got a_low={a_low}, b_low={b_low}, "
                             f"a_high={a_high}, b_high={b_high}")
        if delta1 <= 0 or delta2 <= 0:
            raise ValueError(f"BAPO: step sizes must be positive, got delta1={delta1}, delta2={delta2}")
        if order not in ("high-first", "low-first"):
            raise ValueError(f"BAPO: order={order!r} is not 'high-first' or 'low-first'")
        self.kw = dict(rho0=rho0, a_low=a_low, b_low=b_low, a_high=a_high, b_high=b_high, delta1=delta1, delta2=delta2,
                       order=order, count_clipped=count_clipped)

    def policy_loss(self, batch: PolicyBatch):
        ratio = torch.exp(batch.logp - batch.logp_behav)
        c_low, c_high, share = _search(ratio, batch.adv, batch.mask, **self.kw)
        loss, metrics = clipped_surrogate(batch, agg=self.agg, ratio_low=c_low, ratio_high=c_high)
        metrics.update({"bapo/c_low": c_low, "bapo/c_high": c_high, "bapo/pos_share": share})
        return loss, metrics
