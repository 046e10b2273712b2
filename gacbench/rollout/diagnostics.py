"""Off-policy diagnostics of a rollout batch at the update, as pure functions of log importance ratios.

With w = pi_theta / pi_behav (the current policy over the policy that generated the tokens):

- ``ess_fraction(log_w)`` = (sum w)^2 / (N sum w^2), the effective sample size over N: 1 when every weight is
  equal (on-policy), 1/N when one weight carries everything;
- ``chi2(log_w)`` = mean(w^2) - 1, the chi-square divergence chi^2(pi_theta || pi_behav) estimated on the
  samples (0 on-policy; it is the variance of w when mean(w) = 1).

``importance_diagnostics(log_ratio, mask)`` takes both at two levels: over response tokens (w_t = exp of each
token's log-ratio) and over sequences, where a sequence's importance weight is the product of its token
ratios, w_seq = exp(sum_t log-ratio_t) (not the length-normalised geometric mean).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _moments(log_w: Tensor) -> tuple[Tensor, Tensor, Tensor, int] | None:
    """(m, sum w', sum w'^2, N) with w' = exp(log_w - m), m = max(log_w), in float64; None for N = 0."""
    log_w = log_w.detach().reshape(-1)
    if log_w.numel() == 0:
        return None
    m = log_w.max().double()
    w = torch.exp(log_w.double() - m)
    return m, w.sum(), (w * w).sum(), log_w.numel()


def _nan() -> Tensor:
    return torch.tensor(float("nan"), dtype=torch.float64)


def _ess(mo) -> Tensor:
    m, s1, s2, n = mo
    return s1 * s1 / (n * s2)


def _chi2(mo) -> Tensor:
    m, s1, s2, n = mo
    return torch.exp(2.0 * m + torch.log(s2 / n)) - 1.0  # mean(w^2) = e^(2m) mean(w'^2), taken in log space


def ess_fraction(log_w: Tensor) -> Tensor:
    """(sum w)^2 / (N sum w^2) for weights w = exp(log_w) of shape (N,), as a 0-d float64 tensor; NaN for N = 0.

    Computed from log_w - max(log_w) (the fraction does not change when every weight is scaled), so that
    large log-weights do not overflow."""
    mo = _moments(log_w)
    return _nan() if mo is None else _ess(mo)


def chi2(log_w: Tensor) -> Tensor:
    """mean(w^2) - 1 for weights w = exp(log_w) of shape (N,), as a 0-d float64 tensor (inf when mean(w^2)
    overflows float64: a log-weight above about 355); NaN for N = 0."""
    mo = _moments(log_w)
    return _nan() if mo is None else _chi2(mo)


def importance_diagnostics(log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """``is/ess_frac``, ``is/chi2`` over the response tokens, and ``is/ess_frac_seq``, ``is/chi2_seq`` over the
    sequences that have at least one response token.

    log_ratio: (B, T) log pi_theta - log pi_behav per token; mask: (B, T), 1 on response tokens. Padding
    positions are ignored whatever they hold. Sums are taken in float64."""
    if log_ratio.shape != mask.shape:
        raise ValueError(f"importance_diagnostics: log_ratio {tuple(log_ratio.shape)} and mask {tuple(mask.shape)} "
                         "must have the same shape")
    m = mask.detach().bool()
    lr = log_ratio.detach()
    seq = torch.where(m, lr, torch.zeros((), dtype=lr.dtype, device=lr.device)).sum(-1, dtype=torch.float64)
    out = {}
    for suffix, log_w in (("", lr[m]), ("_seq", seq[m.any(-1)])):
        mo = _moments(log_w)
        out[f"is/ess_frac{suffix}"] = _nan() if mo is None else _ess(mo)
        out[f"is/chi2{suffix}"] = _nan() if mo is None else _chi2(mo)
    return out


def diagnostics_by_lag(log_ratio: Tensor, mask: Tensor, lag: Tensor) -> dict[str, Tensor]:
    """The batch split by each sample's realised lag k (asynchronous rollouts): ``is/behav_current_kl/lag{k}`` =
    E[-log_ratio] = E[log pi_behav - log pi_theta] and ``is/ess_frac/lag{k}`` over the response tokens of the
    samples of lag k, for each k present in the batch.

    log_ratio, mask: (B, T) as in :func:`importance_diagnostics`; lag: (B,) integer lags."""
    if lag.shape != log_ratio.shape[:1]:
        raise ValueError(f"diagnostics_by_lag: lag {tuple(lag.shape)} must hold one lag per row of log_ratio "
                         f"{tuple(log_ratio.shape)}")
    m = mask.detach().bool()
    lr = log_ratio.detach()
    out = {}
    for k in sorted(set(lag.tolist())):
        log_w = lr[m & (lag == k).unsqueeze(-1)]
        if log_w.numel() == 0:
            continue
        out[f"is/behav_current_kl/lag{k}"] = -log_w.double().mean()
        out[f"is/ess_frac/lag{k}"] = ess_fraction(log_w)
    return out
