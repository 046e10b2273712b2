"""The stabilizer API (docs/design.md).

A stabilizer is a ``lightning.Callback`` of one of two kinds:

- gradient side (``kind = "gradient"``, e.g. GAC): transforms gradients in ``on_before_optimizer_step``;
- loss side (``kind = "loss"``, e.g. M2PO, BAPO, TIS, decoupled PPO): subclasses :class:`LossStabilizer`
  and implements ``policy_loss(batch) -> (loss, metrics)`` on a :class:`PolicyBatch`; an RL module
  (the bandit, the GRPO module) finds the run's loss-side stabilizer once, in its ``setup`` hook
  (``resolve_loss_stabilizer``), and gets its loss from ``policy_loss(stabilizer, batch, ...)``, which uses
  that stabilizer and otherwise the clipped surrogate.

Callbacks are told apart by what they declare, not by their class: a loss-side stabilizer is any callback
with ``kind = "loss"`` and a ``policy_loss`` method.

At most one loss-side stabilizer per run (a clear error otherwise); a gradient-side one composes with
any loss-side one.
"""

from __future__ import annotations

from dataclasses import dataclass
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass
class PolicyBatch:
    """Per-token tensors of one policy update, all of shape (B, T) (sequences x tokens).

    ``logp``: current policy log-probs (requires grad); ``logp_behav``: the behaviour policy's (the
    version that generated the data); ``adv``: advantages; ``mask``: True on response tokens;
    ``logp_prox``: the proximal policy's (decoupled PPO; default: the current policy, detached).
    """

    logp: Tensor
    logp_behav: Tensor
    adv: Tensor
    mask: Tensor
    logp_prox: Tensor | None = None

    def __post_init__(self) -> None:
        shapes = {k: tuple(getattr(self, k).shape) for k in ("logp", "logp_behav", "adv", "mask")}
        if len(set(shapes.values())) != 1:
            raise ValueError(f"PolicyBatch: tensors must share one (B, T) shape, got {shapes}")
        self.mask = self.mask.bool()
        if self.logp_prox is None:
            self.logp_prox = self.logp.detach()


def global_sum(x: Tensor) -> Tensor:
    """Sum over data-parallel ranks (identity without torch.distributed); returns a new tensor."""
    x = x.detach().clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def agg_loss(per_token: Tensor, mask: Tensor, mode: str = "token-mean") -> Tensor:
    """Aggregate a (B, T) per-token loss over the mask.

    ``token-mean``: mean over all response tokens of the batch; ``seq-mean-token-mean``: mean over
    sequences of each sequence's token mean; ``seq-mean-token-sum``: mean over sequences of the token sum.
    """
    m = mask.to(per_token.dtype)
    if mode == "token-mean":
        return (per_token * m).sum() / m.sum().clamp_min(1.0)
    if mode == "seq-mean-token-mean":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp_min(1.0)).mean()
    if mode == "seq-mean-token-sum":
        return (per_token * m).sum(-1).mean()
    raise ValueError(f"loss aggregation {mode!r} is not one of {', '.join(AGG_MODES)}")


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1.0)


def ratio_metrics(ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    r = ratio.detach()
    return {"is/ratio_mean": masked_mean(r, mask), "is/ratio_max": r.masked_fill(~mask, float("-inf")).max()}


def clipped_surrogate(batch: PolicyBatch, clip_low: float = 0.2, clip_high: float = 0.2,
                      agg: str = "token-mean", ratio_low: float | None = None,
                      ratio_high: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The PPO/GRPO clipped surrogate against the behaviour policy:
    -agg(min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)), r = exp(logp - logp_behav), shapes (B, T).
    ``ratio_low``/``ratio_high`` give the clip range as ratio values instead (BAPO's bounds)."""
    lo = 1.0 - clip_low if ratio_low is None else ratio_low
    hi = 1.0 + clip_high if ratio_high is None else ratio_high
    ratio = torch.exp(batch.logp - batch.logp_behav)
    pg_loss1 = -batch.adv * ratio
    pg_loss2 = -batch.adv * ratio.clamp(lo, hi)
    loss = agg_loss(torch.maximum(pg_loss1, pg_loss2), batch.mask, agg)
    metrics = {"pg/clipfrac": masked_mean((pg_loss2 > pg_loss1).float(), batch.mask), **ratio_metrics(ratio, batch.mask)}
    return loss, metrics


class Stabilizer(Callback):
    """Base of every stabilizer: ``kind`` is "gradient" or "loss"."""

    kind = "gradient"


class LossStabilizer(Stabilizer):
    """A loss-side stabilizer: ``policy_loss(batch)`` returns the policy loss and its metrics."""

    kind = "loss"

    def __init__(self, agg: str = "token-mean") -> None:
        if agg not in AGG_MODES:
            raise ValueError(f"{type(self).__name__}: agg={agg!r} is not one of {', '.join(AGG_MODES)}")
        self.agg = agg

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


def find_loss_stabilizer(trainer: "pl.Trainer") -> LossStabilizer | None:
    """The run's loss-side stabilizer (a callback declaring ``kind = "loss"``), or None; two of them is an error."""
    found = [cb for cb in trainer.callbacks if getattr(cb, "kind", None) == "loss" and hasattr(cb, "policy_loss")]
    if len(found) > 1:
        names = ", ".join(type(cb).__name__ for cb in found)
        raise ValueError(f"at most one loss-side stabilizer per run, got {names}; a gradient-side one (GAC) "
                         "composes with one loss-side stabilizer, e.g. method 'gac+m2po'")
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


def policy_loss(stabilizer: LossStabilizer | None, batch: PolicyBatch, clip_low: float = 0.2, clip_high: float = 0.2,
                agg: str = "token-mean") -> tuple[Tensor, dict[str, Tensor]]:
    """What an RL module calls for its loss: ``stabilizer.policy_loss(batch)`` when the run has a loss-side
    stabilizer (``resolve_loss_stabilizer``), else the clipped surrogate with these bounds."""
    if stabilizer is not None:
        return stabilizer.policy_loss(batch)
    return clipped_surrogate(batch, clip_low, clip_high, agg)



