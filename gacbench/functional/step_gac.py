"""GAC on the optimizer's step, as a stateful transformation of the parameters (no Lightning).

The step reading of docs/design.md: after the optimizer has moved the parameters from theta_t to
theta_{t+1}, the step Delta_t = theta_{t+1} - theta_t is compared with the previous *applied* step
r = Delta~_{t-1}, c^Delta_t = cos(Delta_t, r), and the rule of the gradient reading
(:func:`gacbench.functional.alignment.gac_decision`) is applied to Delta_t with r as reference:

- keep (c <= c_low): theta_{t+1} stays;
- shrink (c_low < c < c_high) or project (c >= c_high, ``high_mode="project"``): Delta~ = Delta - alpha r
  with alpha = coef <Delta, r> / ||r||^2, and theta_{t+1} = theta_t + Delta~;
- skip (c >= c_high, ``high_mode="skip"``): theta_{t+1} = theta_t exactly (restored from the stored copy).

The reference is the step actually applied: Delta~ after a keep, shrink or projection; a skip applies no
step and leaves the reference where it was. A step that moved nothing (every gradient None, e.g. a step
skipped by a gradient-side callback) is not a step: nothing is measured and the reference stays.

The optimizer's state is not touched: a shrunk, projected or skipped step keeps the moments the optimizer
computed for it (AdamW's m and v have taken in this step's gradient), as they describe the gradients seen,
not the step applied; restoring them would need a snapshot of the whole optimizer state every step.

Memory: two parameter-sized buffers held between steps (theta after the last step, and the previous
applied step), plus one transient for Delta_t while :meth:`StepGAC.step` runs. theta is taken after each
step (and by :meth:`StepGAC.start` before the first), not before it, so that callbacks that swap the
parameters during the forward pass (StalenessSimulator) need no particular order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gacbench.functional.alignment import (
    HIGH_MODES,
    KEEP,
    SHRINK_MODES,
    SKIP,
    GACDecision,
    alignment_scalars,
    cosine_from_scalars,
    gac_decision,
    validate_thresholds,
)
from gacbench.functional.buffer import FlatBuffer
from gacbench.functional.gac import check_choice, local


def _identity(x: Tensor) -> Tensor:
    return x


@dataclass(frozen=True)
class StepOutcome:
    """One call of :meth:`StepGAC.step`: the decision (``cos`` NaN on the first step), ||Delta_t||^2, and
    ``bad`` for a non-finite step (the parameters are then restored to theta_t)."""

    decision: GACDecision
    step_sq: float
    bad: bool = False

    @property
    def cos(self) -> float:
        return self.decision.cos


class StepGAC:
    """GAC on the optimizer's step over a fixed list of parameters (see the module docstring).

    Args: ``c_low``, ``c_high``, ``high_mode``, ``shrink`` as for :class:`gacbench.GAC`. ``apply=False``
    measures c^Delta_t only (the reference is then the raw previous step; nothing is edited): what
    AlignmentMonitor logs as ``align/step_cos``.

    Use: :meth:`start` once before the first optimizer step (after a checkpoint restore), then :meth:`step`
    right after every optimizer step. ``reduce`` maps the local ``tensor([<Delta, r>, ||Delta||^2, ||r||^2])``
    to the global one (an all-reduce under sharding, a broadcast under DDP), once per step.
    """

    def __init__(self, c_low: float = 0.05, c_high: float = 0.3, high_mode: str = "project",
                 shrink: str = "component", apply: bool = True) -> None:
        validate_thresholds(c_low, c_high)
        check_choice("GAC", "high_mode", high_mode, HIGH_MODES)
        check_choice("GAC", "shrink", shrink, SHRINK_MODES)
        self.c_low, self.c_high, self.high_mode, self.shrink = float(c_low), float(c_high), high_mode, shrink
        self.apply = apply
        self.theta: FlatBuffer | None = None  # theta after the last step
        self.prev: list[Tensor] | None = None  # the previous applied step, parameter-shaped (local shards)
        self.has_prev = False
        self._saved: Tensor | None = None  # a restored reference waiting for the parameters

    @staticmethod
    def _tensors(params: Sequence[Tensor]) -> list[Tensor]:
        return [local(p.detach()) for p in params]

    def start(self, params: Sequence[Tensor]) -> None:
        """Store theta (the parameters before the first step to come)."""
        tensors = self._tensors(params)
        if self.theta is None:
            self.theta = FlatBuffer.like(tensors)
        self.theta.copy_from(tensors)
        if self.prev is None:
            self.prev = [torch.zeros_like(t) for t in tensors]
            if self._saved is not None:
                self._load_flat(self._saved)
                self._saved = None

    def step(self, params: Sequence[Tensor], reduce: Callable[[Tensor], Tensor] = _identity) -> StepOutcome | None:
        """After the optimizer's step: measure, apply the rule to the parameters in place (``apply``), move the
        reference and theta. None when the step moved nothing."""
        if self.theta is None:
            raise RuntimeError("StepGAC.step before start(): call start(params) before the first optimizer step")
        now = self._tensors(params)
        before = self.theta.views
        delta = torch._foreach_sub(now, before)  # Delta_t = theta_{t+1} - theta_t
        scalars = reduce(alignment_scalars(delta, self.prev).clone())
        d_dot_r, d_sq, r_sq = (float(v) for v in scalars.tolist())
        if d_sq == 0.0:
            return None
        if not math.isfinite(d_sq):
            if self.apply:
                self.theta.copy_to(now)  # theta_{t+1} = theta_t: a non-finite step never reaches the parameters
            return StepOutcome(GACDecision(KEEP, 0.0, float("nan")), d_sq, bad=True)
        c = cosine_from_scalars(scalars) if self.has_prev else float("nan")
        if not self.apply:
            self.prev, self.has_prev = delta, True
            self.theta.copy_from(now)
            return StepOutcome(GACDecision(KEEP, 0.0, c), d_sq)
        decision = gac_decision(c, self.c_low, self.c_high, self.high_mode, self.shrink)
        if decision.action == SKIP:
            self.theta.copy_to(now)  # theta_{t+1} = theta_t; the reference stays the last applied step
            return StepOutcome(decision, d_sq)
        if decision.coef:
            alpha = decision.coef * d_dot_r / r_sq
            torch._foreach_add_(delta, self.prev, alpha=-alpha)  # Delta~ = Delta - alpha r
            with torch.no_grad():
                torch._foreach_copy_(now, before)
                torch._foreach_add_(now, delta)  # theta_{t+1} = theta_t + Delta~
        self.prev, self.has_prev = delta, True
        self.theta.copy_from(now)
        return StepOutcome(decision, d_sq)

    # -- checkpointing --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"has_prev": bool, "prev": flat tensor (numel,) or None}`` (copied). theta is not saved: it is the
        parameters themselves, taken again by :meth:`start` after a restore."""
        if self.prev is not None:
            flat = torch.cat([t.detach().reshape(-1) for t in self.prev])
        else:
            flat = None if self._saved is None else self._saved.clone()
        return {"has_prev": self.has_prev, "prev": flat}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or set(state) != {"has_prev", "prev"}:
            found = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError("GAC(target='step'): expected the dict StepGAC.state_dict() returns, with keys "
                             f"'has_prev' and 'prev'; got {found}. Resume from a checkpoint of a run with the same "
                             "GAC settings.")
        flat, self.has_prev = state["prev"], bool(state["has_prev"])
        if self.has_prev and flat is None:
            raise ValueError("GAC(target='step'): the saved state has has_prev=True but no step tensor; the "
                             "checkpoint is damaged")
        if flat is None:
            return
        if self.prev is None:
            self._saved = flat
        else:
            self._load_flat(flat)

    def _load_flat(self, flat: Tensor) -> None:
        numel = sum(t.numel() for t in self.prev)
        if flat.numel() != numel:
            raise ValueError(f"GAC(target='step'): the saved step has {flat.numel()} elements but the model has "
                             f"{numel}; the checkpoint was written for a different model or parameter set")
        offset = 0
        for t in self.prev:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()
