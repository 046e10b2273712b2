"""A-3PO (Li, Wu and Shen, arXiv 2512.06547; AReaL ``prox_logp_method: loglinear``): decoupled PPO whose proximal
policy is interpolated from the behaviour and current log-probabilities instead of recomputed by a forward pass.

AReaL's rule (``compute_prox_logp_approximations`` in ``areal/trainer/ppo/actor.py``): with v_theta the current
version, v_behav the version that generated the token and v_prox = v_theta - 1 (the last broadcast),
alpha = (v_prox - v_behav) / (v_theta - v_behav), clamped to [0, 1] and 0 where v_theta = v_behav, and
log pi_prox = log pi_behav + alpha (log pi_theta - log pi_behav), with pi_theta detached. In terms of the lag
s = v_theta - v_behav of a sequence: alpha = (s - 1) / s for s >= 1, 0 for s = 0 (so pi_prox = pi_behav at lag 0
and 1). The loss is the decoupled objective of :func:`decoupled_ppo_loss` with this pi_prox: behaviour weight
pi_prox / pi_behav = (pi_theta / pi_behav)^alpha (detached) times the module's clipped surrogate in
r = pi_theta / pi_prox = (pi_theta / pi_behav)^(1 - alpha).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from gacbench.stabilizers.base import PolicyBatch, masked_mean, sanitize
from gacbench.stabilizers.importance import DecoupledPPO, decoupled_ppo_loss


def a3po_alpha(lag: Tensor) -> Tensor:
    """(B,) interpolation weight alpha = (s - 1) / s for a lag s >= 1, 0 for s <= 0; clamped to [0, 1]."""
    s = lag.detach().to(torch.float64)
    return torch.where(s > 0, (s - 1.0) / s.clamp_min(1e-12), torch.zeros_like(s)).clamp(0.0, 1.0)


def a3po_prox_logp(logp: Tensor, logp_behav: Tensor, lag: Tensor, mask: Tensor) -> Tensor:
    """(B, T) approximated proximal log-probs log pi_behav + alpha (log pi_theta - log pi_behav), detached; 0 at
    masked-out positions."""
    mask = mask.bool()
    behav, cur = sanitize(logp_behav.detach(), mask), sanitize(logp.detach(), mask)
    alpha = a3po_alpha(lag).to(cur.dtype).unsqueeze(-1)
    return behav + alpha * (cur - behav)


def a3po_loss(batch: PolicyBatch, weight_cap: float | None = None,
              cap_mode: str = "truncate") -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO with A-3PO's interpolated proximal policy, shapes (B, T); needs ``batch.lag``. ``weight_cap``
    and ``cap_mode``: as :func:`decoupled_ppo_loss`."""
    if batch.lag is None:
        raise ValueError("a3po interpolates the proximal policy from each sequence's lag (policy versions between its "
                         "generating version and the current parameters), but this PolicyBatch has no lag. Pass "
                         "PolicyBatch(..., lag=...) with the lag of every sequence, shape (B,).")
    prox = a3po_prox_logp(batch.logp, batch.logp_behav, batch.lag, batch.mask)
    loss, metrics = decoupled_ppo_loss(dataclasses.replace(batch, logp_prox=prox), weight_cap, cap_mode)
    alpha = a3po_alpha(batch.lag)
    metrics.update({"a3po/alpha_mean": alpha.mean() if alpha.numel() else 0.0,
                    "a3po/prox_gap": masked_mean((sanitize(batch.logp.detach(), batch.mask) - prox).abs(), batch.mask)})
    return loss, metrics


class A3PO(DecoupledPPO):
    """A-3PO (arXiv 2512.06547; AReaL's ``prox_logp_method: loglinear``): decoupled PPO with the proximal policy
    interpolated as log pi_behav + alpha (log pi_theta - log pi_behav), alpha = (s - 1) / s at lag s, instead of
    recomputed; ``weight_cap``/``cap_mode`` as ``decoupled-ppo``."""

    on_policy_identity = True  # lag 0: alpha = 0, pi_prox = pi_behav = pi_theta, decoupled PPO with weight 1

    def policy_loss(self, batch: PolicyBatch):
        return a3po_loss(batch, self.weight_cap, self.cap_mode)
