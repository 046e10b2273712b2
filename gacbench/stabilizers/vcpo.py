"""VCPO (Huang et al., arXiv 2602.17616; code mit-han-lab/vcpo): variance-controlled off-policy policy gradient.

Two parts, both implemented:

- ESS-scaled step: sequence importance weights w_i = exp(sum_t log(pi_prox / pi_behav)) (the current policy
  against the generating version, per sequence), rho_ess = (sum w)^2 / (B sum w^2) over the update's batch
  (summed over data-parallel ranks), and the optimizer's learning rate for this step multiplied by
  sqrt(min(1, rho_ess / rho_base)) (restored after the step).
- Off-policy optimal baseline (OPOB): per prompt group, b = sum_i W_i R_i / sum_i W_i with
  W_i = w_i^2 ||grad log pi_theta(tau_i)||^2, and advantages (R_i - b) / sigma_group. With the module's
  group-normalised advantages A_i = (R_i - mean) / sigma this is A_i - sum_j lambda_j A_j,
  lambda_j = W_j / sum W, computed without the raw rewards. The per-sequence gradient norms take one
  forward and backward pass per sequence when the batch offers ``row_logp`` (as the authors' code does, one
  trajectory per micro-batch), else one backward pass through the batch's graph per sequence
  (``torch.autograd.grad`` of the sequence's summed log-probs with respect to the module's trainable
  parameters). They are not taken for a group whose advantages are all zero (a group of tied rewards): its
  baseline-corrected advantages are zero whatever the weights, so the result is the same as taking every norm.

Loss (the authors' scripts: PPO clipping disabled, sequence-level truncated IS at 8): -agg(min(w_i, C) r A'),
r = pi_theta / pi_prox, with the module's aggregation. The module's clip bounds are not used.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from torch import Tensor

from gacbench.stabilizers.base import (
    LOG_RATIO_CLAMP,
    LossStabilizer,
    PolicyBatch,
    StepLRScale,
    agg_loss,
    check_positive,
    global_sum,
    masked_mean,
    safe_log_ratio,
    sanitize,
)


def sequence_log_weights(batch: PolicyBatch) -> Tensor:
    """(B,) log w_i = sum_t log(pi_prox / pi_behav) over each sequence's response tokens, clamped."""
    log_w = safe_log_ratio(batch.logp_prox, batch.logp_behav, batch.mask).sum(-1)
    return log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).detach()


def ess_ratio(weights: Tensor) -> float:
    """rho_ess = (sum w)^2 / (B sum w^2) for weights of shape (B,), summed over data-parallel ranks."""
    w = weights.detach().double()
    s = global_sum(torch.stack([w.sum(), (w**2).sum(), torch.tensor(float(w.numel()), dtype=w.dtype, device=w.device)]))
    return float(s[0] ** 2 / s[1] / s[2]) if s[2] > 0 and s[1] > 0 else 0.0


def ess_lr_scale(rho_ess: float, rho_base: float = 1.0) -> float:
    """The learning-rate multiplier sqrt(min(1, rho_ess / rho_base))."""
    return math.sqrt(min(1.0, rho_ess / rho_base))


def group_index(group: Tensor) -> tuple[Tensor, int]:
    """(gid, n): each sequence's group as an index in 0..n-1, and the number of groups n."""
    _, gid = torch.unique(group, return_inverse=True)
    return gid, int(gid.max()) + 1 if gid.numel() else 0


def opob_advantages(adv: Tensor, group: Tensor, weight: Tensor) -> Tensor:
    """Per-sequence advantages with the off-policy optimal baseline, shapes (B,): A_i - sum_{j in g(i)} lambda_j A_j,
    lambda_j = weight_j / sum_{k in g(j)} weight_k. A group whose weights are all zero takes the equal-weight
    baseline, its mean advantage (0 for GRPO's group-normalised advantages, which such a group then keeps)."""
    adv, weight = adv.detach().double(), weight.detach().double()
    gid, n = group_index(group)
    wsum = torch.zeros(n, dtype=adv.dtype, device=adv.device).index_add_(0, gid, weight)
    wa = torch.zeros(n, dtype=adv.dtype, device=adv.device).index_add_(0, gid, weight * adv)
    cnt = torch.zeros(n, dtype=adv.dtype, device=adv.device).index_add_(0, gid, torch.ones_like(adv))
    asum = torch.zeros(n, dtype=adv.dtype, device=adv.device).index_add_(0, gid, adv)
    base = torch.where(wsum > 0, wa / wsum.clamp_min(1e-300), asum / cnt)
    return adv - base[gid]


def _sq_norm(grads) -> float:
    return sum(float(g.detach().double().pow(2).sum()) for g in grads if g is not None)


def per_sequence_grad_sq_norms(seq_logp: Tensor, params: list[Tensor], rows: Tensor | None = None) -> Tensor:
    """(B,) ||grad_params seq_logp_i||^2 for the sequences i in ``rows`` (default: all; 0 elsewhere), one backward
    pass through the batch's graph per sequence (the graph is kept)."""
    out = torch.zeros(seq_logp.numel(), dtype=torch.float64, device=seq_logp.device)
    for i in range(seq_logp.numel()) if rows is None else rows.tolist():
        out[i] = _sq_norm(torch.autograd.grad(seq_logp[i], params, retain_graph=True, allow_unused=True))
    return out


def recomputed_grad_sq_norms(row_logp, mask: Tensor, params: list[Tensor], rows: Tensor) -> Tensor:
    """(B,) ||grad_params sum_t logp_{i,t}||^2 for the sequences i in ``rows`` (0 elsewhere), each from a forward
    and backward pass of that sequence alone: ``row_logp`` (PolicyBatch.row_logp) recomputes its log-probs."""
    out = torch.zeros(mask.shape[0], dtype=torch.float64, device=mask.device)
    for i in rows.tolist():
        index = torch.tensor([i], device=mask.device)
        seq = sanitize(row_logp(index), mask[index]).sum()
        out[i] = _sq_norm(torch.autograd.grad(seq, params, allow_unused=True))
    return out


def rows_needing_norms(adv_seq: Tensor, group: Tensor) -> Tensor:
    """Indices of the sequences whose gradient norm can change an off-policy optimal baseline advantage: those in
    a group with a non-zero advantage."""
    gid, n = group_index(group)
    live = torch.zeros(n, dtype=torch.bool, device=adv_seq.device)
    live[gid[adv_seq != 0]] = True
    return torch.nonzero(live[gid]).flatten()


class VCPO(StepLRScale, LossStabilizer):
    """VCPO: ESS-scaled learning rate sqrt(min(1, rho_ess / rho_base)) and the off-policy optimal baseline, with the
    sequence-level truncated IS loss of the authors' scripts (``is_cap`` = 8). ``baseline=False`` keeps the
    module's advantages (no per-sequence backward passes); the baseline needs PolicyBatch.group. The advantages
    are the module's: GRPO's default estimator divides by the unbiased group std, the authors' code by the
    population std, a factor sqrt((G - 1) / G) (0.935 at G = 8); ``rollout.advantage: grpo-population`` gives
    theirs."""

    def __init__(self, rho_base: float = 1.0, is_cap: float = 8.0, baseline: bool = True) -> None:
        check_positive("VCPO", rho_base=rho_base, is_cap=is_cap)
        if not isinstance(baseline, bool):
            raise ValueError(f"VCPO: baseline={baseline!r} must be True or False")
        self.rho_base, self.is_cap, self.baseline = float(rho_base), float(is_cap), baseline
        # at ratio 1 (w = 1, rho_ess = 1) only the baseline moves the update: with it off, weight min(1, is_cap) = 1
        # and lr scale sqrt(min(1, 1 / rho_base)) = 1 leave the module's gradient and step
        self.on_policy_identity = not baseline and self.rho_base <= 1.0 and self.is_cap >= 1.0
        self._params: list[Tensor] = []
        self._lr_scale = 1.0  # this step's learning-rate multiplier, set by policy_loss

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._params = [p for p in pl_module.parameters() if p.requires_grad]

    def policy_loss(self, batch: PolicyBatch):
        m = batch.mask
        log_w = sequence_log_weights(batch)
        w = torch.exp(log_w)
        rho = ess_ratio(w)
        self._lr_scale = ess_lr_scale(rho, self.rho_base)
        adv_seq = sanitize(batch.adv, m).sum(-1) / m.sum(-1).clamp_min(1)
        metrics: dict = {"vcpo/ess_ratio": rho, "vcpo/lr_scale": self._lr_scale,
                         "is/weight_mean": w.mean() if w.numel() else 1.0}
        if self.baseline:
            if batch.group is None:
                raise ValueError("VCPO: the off-policy optimal baseline needs the prompt group of each sequence; pass "
                                 "PolicyBatch(..., group=...) (shape (B,)), or use vcpo(baseline=False)")
            if not self._params:
                raise RuntimeError("VCPO: no trainable parameters recorded; the callback's setup hook did not run")
            rows = rows_needing_norms(adv_seq.detach(), batch.group)
            if batch.row_logp is not None:
                gsq = recomputed_grad_sq_norms(batch.row_logp, m, self._params, rows)
            else:
                gsq = per_sequence_grad_sq_norms(sanitize(batch.logp, m).sum(-1), self._params, rows)
            adv_seq = opob_advantages(adv_seq, batch.group, w.double() ** 2 * gsq).to(batch.logp.dtype)
            metrics["vcpo/grad_sq_mean"] = gsq[rows].mean() if rows.numel() else 0.0
            metrics["vcpo/grad_rows_frac"] = rows.numel() / max(m.shape[0], 1)
        r = torch.exp(safe_log_ratio(batch.logp, batch.logp_prox, m))
        weight = w.clamp(max=self.is_cap).unsqueeze(-1)
        loss = agg_loss(-weight * r * adv_seq.unsqueeze(-1), m, batch.agg)
        metrics["is/truncated_frac"] = (w > self.is_cap).double().mean() if w.numel() else 0.0
        metrics["vcpo/adv_abs_mean"] = masked_mean(adv_seq.detach().abs().unsqueeze(-1).expand_as(r), m)
        return loss, metrics

    def step_lr_scale(self) -> float:
        return self._lr_scale
