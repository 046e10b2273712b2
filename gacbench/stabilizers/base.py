"""The stabilizer API (docs/design.md, docs/add-a-stabilizer.md).

A stabilizer is a ``lightning.Callback`` of one of two kinds:

- gradient side (``kind = "gradient"``, e.g. GAC): transforms gradients in ``on_before_optimizer_step``;
- loss side (``kind = "loss"``, e.g. M2PO, BAPO, TIS): subclasses :class:`LossStabilizer` and implements
  ``policy_loss(batch) -> (loss, metrics)`` on a :class:`PolicyBatch`; an RL module (the bandit, the GRPO
  module) finds the run's loss-side stabilizer once, in its ``setup`` hook (``resolve_loss_stabilizer``), and
  gets its loss from ``policy_loss(stabilizer, batch)``, which uses that stabilizer and otherwise the clipped
  surrogate.

The module's loss settings (clip bounds, aggregation) travel in the :class:`PolicyBatch`, so every
loss-side stabilizer sees the same settings as the default surrogate; a stabilizer that chooses its own
bounds (BAPO, GSPO, M2PO's official variant) logs the bounds it used.

Numerical safety, shared by every loss: :func:`sanitize` replaces masked-out positions by zeros with
``torch.where`` before anything is computed (a NaN or inf in padding reaches neither the loss nor the
gradients), and log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before ``exp``.

Callbacks are told apart by what they declare, not by their class: a loss-side stabilizer is any callback
with ``kind = "loss"`` and a ``policy_loss`` method. At most one loss-side stabilizer per run (a clear error
otherwise); a gradient-side one composes with any loss-side one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 4.9e8: verl's safety bound for log-ratios


@dataclass
class PolicyBatch:
    """One policy update's tensors and the module's loss settings.

    Tensors of shape (B, T) (sequences x tokens):

    - ``logp``: current policy log-probs (requires grad);
    - ``logp_behav``: the behaviour policy's, recomputed by the trainer for the version that generated the
      data (the bandit: the sampler's own log-probs);
    - ``adv``: advantages (constant along a sequence for GRPO);
    - ``mask``: True on response tokens;
    - ``logp_prox``: the proximal policy's (decoupled PPO; default: the current policy, detached);
    - ``logp_engine``: the rollout engine's log-probs for the same tokens at the generating version, or
      None when the module has no separate engine. Stabilizers that correct the engine/trainer gap (TIS on
      the engine, MIS, IcePop) require it.

    ``group``: (B,) integer id of the prompt group of each sequence (GRPO's groups), or None; VCPO's
    baseline needs it.

    ``lag``: (B,) number of policy updates between the version that generated each sequence and the current
    parameters (the stale-rollout queue's lag), or None; A-3PO's proximal interpolation needs it.

    ``row_logp``: optional callable that takes a 1-D index tensor of rows and returns those rows' (n, T)
    log-probs at the current parameters from a fresh forward pass (with gradients), equal to ``logp[rows]``
    up to rounding. With it a stabilizer takes one sequence's parameter gradient at the cost of that
    sequence's forward and backward pass, not a backward pass through the whole batch (VCPO's baseline).

    Settings: ``clip_low``/``clip_high`` (ratio clipped to [1 - clip_low, 1 + clip_high]) and ``agg`` (one of
    ``AGG_MODES``), as the module's own surrogate uses them.
    """

    logp: Tensor
    logp_behav: Tensor
    adv: Tensor
    mask: Tensor
    logp_prox: Tensor | None = None
    clip_low: float = 0.2
    clip_high: float = 0.2
    agg: str = "token-mean"
    logp_engine: Tensor | None = None
    group: Tensor | None = None
    row_logp: Callable[[Tensor], Tensor] | None = None
    lag: Tensor | None = None

    def __post_init__(self) -> None:
        optional = [k for k in ("logp_prox", "logp_engine") if getattr(self, k) is not None]
        names = ["logp", "logp_behav", "adv", "mask"] + optional
        shapes = {k: tuple(getattr(self, k).shape) for k in names}
        if len(set(shapes.values())) != 1 or len(shapes["logp"]) != 2:
            raise ValueError(f"PolicyBatch: tensors must share one (B, T) shape, got {shapes}")
        if self.agg not in AGG_MODES:
            raise ValueError(f"PolicyBatch: agg={self.agg!r} is not one of {', '.join(AGG_MODES)}")
        if not (0.0 <= self.clip_low < 1.0 and self.clip_high >= 0.0):
            raise ValueError(f"PolicyBatch: need 0 <= clip_low < 1 and clip_high >= 0 (the ratio is clipped to "
                             f"[1 - clip_low, 1 + clip_high]), got clip_low={self.clip_low}, "
                             f"clip_high={self.clip_high}")
        if self.group is not None and tuple(self.group.shape) != shapes["logp"][:1]:
            raise ValueError(f"PolicyBatch: group must have shape (B,) = {shapes['logp'][:1]}, "
                             f"got {tuple(self.group.shape)}")
        if self.lag is not None and tuple(self.lag.shape) != shapes["logp"][:1]:
            raise ValueError(f"PolicyBatch: lag must have shape (B,) = {shapes['logp'][:1]}, "
                             f"got {tuple(self.lag.shape)}")
        self.mask = self.mask.bool()
        if self.logp_prox is None:
            self.logp_prox = self.logp.detach()

    def engine_logp(self, who: str) -> Tensor:
        """``logp_engine``, or a clear error naming the stabilizer that needs it."""
        if self.logp_engine is None:
            raise ValueError(f"{who} corrects the gap between the rollout engine's and the trainer's log-probs, "
                             "but this PolicyBatch has no logp_engine. Pass the engine's per-token log-probs as "
                             "PolicyBatch(..., logp_engine=...) (a module whose sampler is the trainer's own policy "
                             "passes its behaviour log-probs).")
        return self.logp_engine


def sanitize(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` with masked-out positions replaced by 0 (``torch.where``: no NaN or inf there reaches a result or a
    gradient; the gradient at those positions is exactly 0)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def safe_log_ratio(num: Tensor, den: Tensor, mask: Tensor) -> Tensor:
    """log(num/den) from log-probs, (B, T): 0 at masked-out positions, clamped to +-LOG_RATIO_CLAMP."""
    return (sanitize(num, mask) - sanitize(den, mask)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def global_sum(x: Tensor) -> Tensor:
    """Sum over data-parallel ranks (identity without torch.distributed); returns a new tensor."""
    x = x.detach().clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def agg_count(mask: Tensor, mode: str) -> Tensor:
    """What a mode divides by over ``mask`` (B, T): its tokens (``token-mean``) or its sequences holding at least
    one token (the seq-mean modes: a sequence whose tokens are all masked out, such as one rejected whole, is
    not counted, as in verl's ``agg_loss``)."""
    mask = mask.bool()
    if mode == "token-mean":
        return mask.sum()
    return mask.any(-1).sum() if mask.dim() > 1 else mask.any().to(torch.int64)  # a 1-D mask: one sequence


def agg_loss(per_token: Tensor, mask: Tensor, mode: str = "token-mean") -> Tensor:
    """Aggregate a (B, T) per-token loss over the mask (masked-out positions are dropped with ``torch.where``).

    ``token-mean``: mean over all response tokens of the batch; ``seq-mean-token-mean``: mean over
    sequences of each sequence's token mean; ``seq-mean-token-sum``: mean over sequences of the token sum. The
    seq-mean modes average over the sequences that hold at least one token of the mask. An empty batch (no
    sequences or no response tokens) aggregates to 0 in every mode.
    """
    mask = mask.bool()
    x = sanitize(per_token, mask)
    m = mask.to(x.dtype)
    if mode == "token-mean":
        return x.sum() / m.sum().clamp_min(1.0)
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum") and x.shape[0] == 0:
        return x.sum()  # no sequences: 0, with a (zero) gradient, where a mean over none would be nan
    rows = agg_count(mask, mode).to(x.dtype).clamp_min(1.0)
    if mode == "seq-mean-token-mean":
        return (x.sum(-1) / m.sum(-1).clamp_min(1.0)).sum() / rows
    if mode == "seq-mean-token-sum":
        return x.sum(-1).sum() / rows
    raise ValueError(f"loss aggregation {mode!r} is not one of {', '.join(AGG_MODES)}")


def across_ranks(loss: Tensor, used: Tensor, used_mode: str, mask: Tensor, mode: str) -> Tensor:
    """A loss aggregated with ``used_mode`` over ``used`` (a part of the batch's ``mask``, or all of it), made right
    across data-parallel ranks. The GRPO module scales each rank's loss by that rank's share of what the module's
    aggregation ``mode`` counts over ``mask`` (``gacbench.llm.data_parallel``); this multiplies it by
    (c_used / c_mask) on this rank times (C_mask / C_used) over all ranks (c, C: :func:`agg_count` under each
    mode), so that the ranks' averaged gradient is that of the loss over every rank's ``used`` tokens, as one
    process holding the whole batch computes it. One all-reduce of two numbers; ``loss`` unchanged on one
    process."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return loss
    local = torch.stack([agg_count(used, used_mode), agg_count(mask, mode)]).to(torch.float64)
    total = global_sum(local)
    if float(local[0]) == 0.0 or float(total[0]) == 0.0:
        return loss  # nothing kept on this rank: its loss is 0 already
    factor = (local[0] / local[1].clamp_min(1.0)) * (total[1] / total[0])
    return loss * factor.to(loss.dtype)


def over_kept_tokens(loss: Tensor, kept: Tensor, mask: Tensor, mode: str) -> Tensor:
    """A loss aggregated with the module's ``mode`` over ``kept``, the tokens a rejection leaves of ``mask``, made
    right across data-parallel ranks (:func:`across_ranks`)."""
    return across_ranks(loss, kept, mode, mask, mode)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    mask = mask.bool()
    return sanitize(x, mask).sum() / mask.to(x.dtype).sum().clamp_min(1.0)


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """The largest of ``x`` (detached) over the mask, for a non-negative ``x``: 0 where the mask or the batch is
    empty."""
    return torch.cat([sanitize(x.detach(), mask.bool()).flatten(), x.new_zeros(1)]).max()


def ratio_metrics(ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    r = ratio.detach()
    mask = mask.bool()
    # ratios are positive: filling masked-out positions with 0 leaves the max (0 for an empty mask or batch)
    return {"is/ratio_mean": masked_mean(r, mask), "is/ratio_max": masked_max(r, mask)}


def surrogate_terms(ratio: Tensor, adv: Tensor, lo: float, hi: float,
                    dual_clip: float | None = None) -> tuple[Tensor, Tensor]:
    """Per-token PPO loss -min(r A, clip(r, lo, hi) A) and the clipped-token indicator, shapes (B, T).

    ``dual_clip`` = c > 1 (dual-clip PPO, arXiv 1912.09729, verl's ``clip_ratio_c``): for A < 0 the loss is
    further capped at -c A, so a token whose ratio exceeds c carries no gradient."""
    pg1, pg2 = -adv * ratio, -adv * ratio.clamp(lo, hi)
    loss = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_clip), loss)
    return loss, clipped


def clipped_surrogate(batch: PolicyBatch, ratio_low: float | None = None, ratio_high: float | None = None,
                      dual_clip: float | None = None, weight: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The PPO/GRPO clipped surrogate against the behaviour policy, shapes (B, T):
    -agg(w * min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)), r = exp(logp - logp_behav), with the batch's
    clip bounds and aggregation. ``ratio_low``/``ratio_high`` give the clip range as ratio values instead (a
    stabilizer that chooses its own bounds); ``dual_clip`` caps negative-advantage tokens (see
    :func:`surrogate_terms`); ``weight`` (B, T) is a detached per-token weight (importance corrections)."""
    lo = 1.0 - batch.clip_low if ratio_low is None else ratio_low
    hi = 1.0 + batch.clip_high if ratio_high is None else ratio_high
    m = batch.mask
    ratio = torch.exp(safe_log_ratio(batch.logp, batch.logp_behav, m))
    per_token, clipped = surrogate_terms(ratio, sanitize(batch.adv, m), lo, hi, dual_clip)
    if weight is not None:
        per_token = per_token * sanitize(weight.detach(), m)
    loss = agg_loss(per_token, m, batch.agg)
    metrics = {"pg/clipfrac": masked_mean(clipped.float(), m), **ratio_metrics(ratio, m)}
    if dual_clip is not None:
        adv = sanitize(batch.adv, m)
        metrics["pg/clipfrac_dual"] = masked_mean(((adv < 0) & (ratio > dual_clip)).float(), m)
    return loss, metrics


class Stabilizer(Callback):
    """Base of every stabilizer: ``kind`` is "gradient" or "loss". ``on_policy_identity``: True where the
    stabilizer, with its default settings, leaves a synchronous GRPO run unchanged (one optimizer step per batch, so
    the behaviour policy is the current one and every token ratio is exactly 1): its loss gradient equals the
    module's clipped surrogate's, and a gradient-side one leaves the step as it is. An instance whose settings break
    the identity sets it False in ``__init__``. The report then takes sync's cells as the method's on-policy control
    (docs/bench.md); tests/test_on_policy_identity.py checks every stabilizer that declares it, and that every
    loss-side one that does not changes the gradient."""

    kind = "gradient"
    on_policy_identity = False


class StepLRScale:
    """Mixin for a stabilizer that rescales the learning rate of each optimizer step (list it before the stabilizer
    base): every parameter group's rate is multiplied by ``step_lr_scale()`` in ``on_before_optimizer_step`` and
    restored right after the step by a one-shot step hook (before any learning-rate scheduler reads it), or at the
    end of the batch for a step that did not run (a skipped non-finite step). At a scale of exactly 1.0 the optimizer
    is not touched. ``scales_lr`` declares it, so that two such callbacks can refuse to compound."""

    scales_lr = True
    keeps_gradients = True  # its on_before_optimizer_step changes the learning rates, never p.grad
    _pending = None  # (optimizer, base learning rates, step hook) while a step is scaled

    def step_lr_scale(self) -> float:
        raise NotImplementedError

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._restore()
        scale = self.step_lr_scale()
        if scale == 1.0:
            return
        base = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * scale
        self._pending = (optimizer, base, optimizer.register_step_post_hook(lambda opt, args, kwargs: self._restore()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._restore()

    def _restore(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            optimizer, base, handle = pending
            handle.remove()
            for g, lr in zip(optimizer.param_groups, base):
                g["lr"] = lr


class LossStabilizer(Stabilizer):
    """A loss-side stabilizer: ``policy_loss(batch)`` returns the policy loss and its metrics. The loss settings
    (``batch.clip_low``, ``batch.clip_high``, ``batch.agg``) come from the module, in the batch."""

    kind = "loss"

    def policy_loss(self, batch: PolicyBatch) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        find_loss_stabilizer(trainer)  # raises if there are two
        if not getattr(pl_module, "uses_loss_stabilizer", False):
            raise TypeError(
                f"{type(self).__name__} is a loss-side stabilizer: it applies to policy-gradient modules that build "
                f"their loss through resolve_loss_stabilizer (the bandit, the GRPO module); {type(pl_module).__name__} "
                "computes its own loss. Use a gradient-side stabilizer (GAC) there, or set uses_loss_stabilizer = True "
                "on a module that calls resolve_loss_stabilizer and policy_loss."
            )


def loss_stabilizers(callbacks: list) -> list[LossStabilizer]:
    """The loss-side stabilizers (callbacks declaring ``kind = "loss"``) among ``callbacks``; two of them is an
    error (a method combination is checked with this before it runs, a run when it starts)."""
    found = [cb for cb in callbacks if getattr(cb, "kind", None) == "loss" and hasattr(cb, "policy_loss")]
    if len(found) > 1:
        names = ", ".join(type(cb).__name__ for cb in found)
        raise ValueError(f"at most one loss-side stabilizer per run, got {names}; a gradient-side one (GAC) "
                         "composes with one loss-side stabilizer, e.g. method 'gac+m2po'")
    return found


def find_loss_stabilizer(trainer: "pl.Trainer") -> LossStabilizer | None:
    """The run's loss-side stabilizer (a callback declaring ``kind = "loss"``), or None; two of them is an error."""
    found = loss_stabilizers(trainer.callbacks)
    return found[0] if found else None


def resolve_loss_stabilizer(trainer: "pl.Trainer | None", pl_module: "pl.LightningModule") -> LossStabilizer | None:
    """Called once by an RL module in its ``setup`` hook: the run's loss-side stabilizer, or None (also without
    a trainer). The module must declare ``uses_loss_stabilizer = True``."""
    if trainer is None:
        return None
    if not getattr(pl_module, "uses_loss_stabilizer", False):
        raise TypeError(f"{type(pl_module).__name__} resolves a loss-side stabilizer but does not declare "
                        "uses_loss_stabilizer = True")
    return find_loss_stabilizer(trainer)


def policy_loss(stabilizer: LossStabilizer | None, batch: PolicyBatch, clip_low: float | None = None,
                clip_high: float | None = None, agg: str | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """What an RL module calls for its loss: ``stabilizer.policy_loss(batch)`` when the run has a loss-side
    stabilizer (``resolve_loss_stabilizer``), else the clipped surrogate. The settings travel in the batch;
    ``clip_low``/``clip_high``/``agg``, when given, replace the batch's for this call (and reach the stabilizer)."""
    given = {k: v for k, v in (("clip_low", clip_low), ("clip_high", clip_high), ("agg", agg)) if v is not None}
    if given:
        batch = dataclasses.replace(batch, **given)
    if stabilizer is not None:
        return stabilizer.policy_loss(batch)
    return clipped_surrogate(batch)


def check_positive(who: str, **values: float) -> None:
    """A clear error for a setting that must be a finite positive number."""
    for name, v in values.items():
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
            raise ValueError(f"{who}: {name}={v!r} must be a finite positive number")
