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

Memory: two parameter-sized buffers (theta after the last step, and the previous applied step), each
parameter in its own dtype, one flat allocation per dtype, plus one scratch block per precision, at least
float32 (on the CPU 128K elements per thread; elsewhere the size of the largest parameter); Delta_t is
formed block by block and never held whole. theta is taken after each step (and by :meth:`StepGAC.start`
before the first), not before it, so that callbacks that swap the parameters during the forward pass
(StalenessSimulator) need no particular order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gacbench.functional.alignment import (
    _CPU_BLOCK_PER_THREAD,
    HIGH_MODES,
    KEEP,
    SHRINK_MODES,
    SKIP,
    GACDecision,
    alignment_scalars,
    gac_decision,
    reference_cosine,
    validate_thresholds,
)
from gacbench.functional.buffer import FlatBuffer
from gacbench.functional.gac import StepReading, check_choice, local


def _identity(x: Tensor) -> Tensor:
    return x


@dataclass(frozen=True)
class StepOutcome(StepReading):
    """One call of :meth:`StepGAC.step`: the decision (``cos`` NaN on the first step, and against a zero
    reference: ``zero_ref``, no c^Delta_t, counted as skipped, the step kept), ||Delta_t||^2, and ``bad`` for a
    non-finite step (the parameters are then restored to theta_t)."""

    decision: GACDecision
    step_sq: float
    bad: bool = False
    zero_ref: bool = False


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
        c_low, c_high = validate_thresholds(c_low, c_high)
        check_choice("GAC", "high_mode", high_mode, HIGH_MODES)
        check_choice("GAC", "shrink", shrink, SHRINK_MODES)
        self.c_low, self.c_high, self.high_mode, self.shrink = c_low, c_high, high_mode, shrink
        self.apply = apply
        self.theta: FlatBuffer | None = None  # theta after the last step
        self.prev: FlatBuffer | None = None  # the previous applied step (local shards)
        self.has_prev = False
        self._saved: Tensor | None = None  # a restored reference waiting for the parameters
        self._scratch: dict[torch.dtype, Tensor] = {}  # Delta_t of one tensor (block) at a time, per precision

    @staticmethod
    def _tensors(params: Sequence[Tensor]) -> list[Tensor]:
        return [local(p.detach()) for p in params]

    def start(self, params: Sequence[Tensor]) -> None:
        """Store theta (the parameters before the first step to come)."""
        tensors = self._tensors(params)
        if self.theta is None:
            self.theta = FlatBuffer.like(tensors)
            self.prev = FlatBuffer.like(tensors)
            # Delta_t of a parameter is formed in its precision, at least float32 (a bfloat16 difference of two
            # bfloat16 iterates would round it): one scratch block per such precision
            self._scratch = {}
            for t in tensors:
                d = torch.promote_types(t.dtype, torch.float32)
                size = t.numel() if t.device.type != "cpu" or not t.is_contiguous() else min(
                    t.numel(), _CPU_BLOCK_PER_THREAD * torch.get_num_threads())
                if d not in self._scratch or self._scratch[d].numel() < size:
                    self._scratch[d] = torch.empty(size, dtype=d, device=t.device)
            if self._saved is not None:
                self.prev.load_(self._saved)
                self._saved = None
        self.theta.copy_from(tensors)

    def _delta(self, now: Tensor, before: Tensor) -> Tensor:
        """now - before into the scratch buffer (valid until the next call)."""
        out = self._scratch[torch.promote_types(now.dtype, torch.float32)][: now.numel()].view_as(now)
        # widened first: torch.sub(now, before, out=out) would subtract in now's dtype and only then cast
        return out.copy_(now).sub_(before)

    def _blocks(self, now: list[Tensor]) -> list[tuple[Tensor, Tensor, Tensor]]:
        """(theta_{t+1}, theta, r) as matching flat blocks: on the CPU of the size alignment_scalars works in, so
        that a block's Delta stays in cache between its products; elsewhere, and for a parameter whose elements are
        not laid out in order (channels_last, a transposed view), one block per tensor in the parameter's shape."""
        out = []
        for n, b, r in zip(now, self.theta.views, self.prev.views):
            if not n.is_contiguous():
                out.append((n, b, r))
                continue
            n, b, r = n.view(-1), b.view(-1), r.view(-1)
            size = _CPU_BLOCK_PER_THREAD * torch.get_num_threads() if n.device.type == "cpu" else n.numel()
            out += list(zip(n.split(size), b.split(size), r.split(size)))
        return out

    def step(self, params: Sequence[Tensor], reduce: Callable[[Tensor], Tensor] = _identity) -> StepOutcome | None:
        """After the optimizer's step: measure, apply the rule to the parameters in place (``apply``), move the
        reference and theta. None when the step moved nothing.

        Two passes over the parameters, block by block (:meth:`_blocks`), with one scratch block: the first forms
        Delta_t and its scalars with the reference, the second (after the decision) forms Delta_t again, bit for
        bit, and writes the applied step, the parameters (when changed) and theta."""
        if self.theta is None:
            raise RuntimeError("StepGAC.step before start(): call start(params) before the first optimizer step")
        now = self._tensors(params)
        blocks = self._blocks(now)
        scalars = torch.zeros(3, dtype=torch.float64)
        for n, b, r in blocks:
            scalars += alignment_scalars([self._delta(n, b)], [r]).to(scalars.device)
        scalars = reduce(scalars)
        d_dot_r, d_sq, r_sq = (float(v) for v in scalars.tolist())
        if d_sq == 0.0:
            return None
        if not math.isfinite(d_sq):
            # a non-finite step is never a reference; applying, it never reaches the parameters (theta_t restored)
            (self.theta.copy_to if self.apply else self.theta.copy_from)(now)
            return StepOutcome(GACDecision(KEEP, 0.0, float("nan")), d_sq, bad=True)
        c = reference_cosine(d_dot_r, d_sq, r_sq) if self.has_prev else float("nan")  # NaN: a zero reference
        decision = (gac_decision(c, self.c_low, self.c_high, self.high_mode, self.shrink) if self.apply
                    else GACDecision(KEEP, 0.0, c))
        if decision.action == SKIP:
            self.theta.copy_to(now)  # theta_{t+1} = theta_t; the reference stays the last applied step
            return StepOutcome(decision, d_sq)
        alpha = decision.coef * d_dot_r / r_sq if decision.coef else 0.0
        with torch.no_grad():
            for n, b, r in blocks:
                if alpha:
                    d = self._delta(n, b)
                    d.add_(r, alpha=-alpha)  # Delta~ = Delta - alpha r
                    torch.add(b, d, out=n)  # theta_{t+1} = theta_t + Delta~
                    r.copy_(d)
                else:
                    torch.sub(n, b, out=r)
                b.copy_(n)
        zero_ref = self.has_prev and r_sq == 0.0
        self.has_prev = True
        return StepOutcome(decision, d_sq, zero_ref=zero_ref)

    # -- checkpointing --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"has_prev": bool, "prev": flat tensor (numel,) or None}`` (copied). theta is not saved: it is the
        parameters themselves, taken again by :meth:`start` after a restore."""
        if self.prev is not None:
            flat = self.prev.flat()
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
            self.prev.load_(flat)
