"""Gradient alignment and the GAC projection as pure functions over lists of tensors.

A "vector" here is a list of tensors (one per parameter) read as one flattened vector,
the way an optimizer sees the model's gradient. Nothing in this module knows about
Lightning; the callbacks in :mod:`gacbench.callbacks` are thin adapters over it.

Notation (docs/design.md): g is the current gradient, r the reference direction (by default
the previous gradient g_{t-1}), u = r / ||r||, g_par = <g, u> u, c = <g, r> / (||g|| ||r||).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
from torch import Tensor

TensorList = Sequence[Tensor]
HighMode = Literal["project", "skip"]
HIGH_MODES: tuple[str, ...] = ("project", "skip")

# Actions the GAC rule can take, in order of strength. Integers so that they can travel
# through a collective as part of a tensor.
KEEP, SHRINK, PROJECT, SKIP = 0, 1, 2, 3
ACTION_NAMES = {KEEP: "keep", SHRINK: "shrink", PROJECT: "project", SKIP: "skip"}


def dot(xs: TensorList, ys: TensorList) -> Tensor:
    """<x, y> of two lists of tensors read as flat vectors, accumulated in float32.

    Shapes: ``xs[i]`` and ``ys[i]`` have the same number of elements; the result is a
    0-d float32 tensor on the device of ``xs[0]``. Tensors of a lower precision are
    upcast one tensor at a time, so the temporary memory is one parameter, not the model.
    """
    if len(xs) != len(ys):
        raise ValueError(f"dot: the two lists have {len(xs)} and {len(ys)} tensors; they must match")
    if not xs:
        return torch.zeros((), dtype=torch.float32)
    parts = []
    for x, y in zip(xs, ys):
        x, y = x.reshape(-1), y.reshape(-1)
        if x.dtype != torch.float32 or y.dtype != torch.float32:
            x, y = x.float(), y.float()
        parts.append(torch.dot(x, y))
    return torch.stack(parts).sum()


def sq_norm(xs: TensorList) -> Tensor:
    """||x||^2 of a list of tensors read as one flat vector (0-d float32 tensor)."""
    return dot(xs, xs)


def alignment_scalars(grads: TensorList, ref: TensorList, ref_sq: Tensor | None = None) -> Tensor:
    """The three scalars the rule needs: ``tensor([<g, r>, ||g||^2, ||r||^2])`` (float32, shape (3,)).

    ``ref_sq``, when the caller already knows ||r||^2 (GAC caches it), saves a pass over r.
    Under sharded training each rank calls this on its shard and the three sums are
    all-reduced once; the cosine is then computed from the reduced scalars.
    """
    r_sq = sq_norm(ref) if ref_sq is None else ref_sq.to(torch.float32).reshape(())
    return torch.stack([dot(grads, ref), sq_norm(grads), r_sq.to(grads[0].device if grads else r_sq.device)])


def cosine_from_scalars(scalars: Tensor, eps: float = 1e-30) -> float:
    """c = <g, r> / (||g|| ||r||) from ``alignment_scalars``; 0.0 when either norm is zero."""
    g_r, gg, rr = (float(v) for v in scalars.tolist())
    denom = math.sqrt(gg) * math.sqrt(rr)
    if not math.isfinite(denom) or not math.isfinite(g_r):
        return float("nan")
    if denom <= eps:
        return 0.0
    return g_r / denom


def cosine(xs: TensorList, ys: TensorList) -> float:
    """Cosine similarity of two lists of tensors read as flat vectors."""
    return cosine_from_scalars(alignment_scalars(xs, ys))


def validate_thresholds(c_low: float, c_high: float) -> None:
    """Raise ``ValueError`` naming the bad value unless 0 <= c_low < c_high <= 1."""
    for name, value in (("c_low", c_low), ("c_high", c_high)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"GAC: {name}={value!r} must be a finite number in [0, 1]")
    if not 0.0 <= c_low < c_high <= 1.0:
        raise ValueError(
            f"GAC: thresholds must satisfy 0 <= c_low < c_high <= 1, got c_low={c_low}, c_high={c_high}. "
            "The paper's defaults are c_low=0.05 (the on-policy range of |c_t|) and c_high=0.3."
        )


@dataclass(frozen=True)
class GACDecision:
    """What the rule does to one gradient.

    ``action`` is one of KEEP, SHRINK, PROJECT, SKIP; ``coef`` is the fraction of the
    aligned component g_par that is removed (0 for KEEP; for SHRINK 1 - c_low/c with
    ``shrink="component"``, see :func:`gac_decision` for ``"cosine"``; 1 for PROJECT; 0 for SKIP).
    """

    action: int
    coef: float
    cos: float

    @property
    def changed(self) -> bool:
        return self.action != KEEP


SHRINK_MODES: tuple[str, ...] = ("component", "cosine")


def gac_decision(
    c: float,
    c_low: float = 0.05,
    c_high: float = 0.3,
    high_mode: str = "project",
    shrink: str = "component",
) -> GACDecision:
    """The GAC rule of docs/design.md as a function of the cosine c = cos(g, r).

    - c <= c_low: keep the gradient (the on-policy regime; negative c is never touched).
    - c_low < c < c_high: shrink the aligned component g_par.
      ``shrink="component"`` (docs/design.md's formula) removes the fraction 1 - c_low/c of
      g_par, so that <g_tilde, u> = c_low * ||g||: the aligned component is brought back to
      the size it has at c = c_low. ``shrink="cosine"`` removes the fraction
      1 - (c_low/c) * sqrt((1 - c^2) / (1 - c_low^2)), so that cos(g_tilde, r) = c_low exactly.
      The two differ by under 5% of the kept component for c < 0.3.
    - c >= c_high: remove g_par entirely (``high_mode="project"``), so g_tilde is orthogonal
      to r, or skip the step (``high_mode="skip"``).
    """
    if not c > c_low:  # also catches NaN: the caller decides what non-finite means
        return GACDecision(KEEP, 0.0, c)
    if c < c_high:
        if shrink == "cosine":
            keep = (c_low / c) * math.sqrt((1.0 - c * c) / (1.0 - c_low * c_low))
        else:
            keep = c_low / c
        return GACDecision(SHRINK, 1.0 - keep, c)
    if high_mode == "skip":
        return GACDecision(SKIP, 0.0, c)
    return GACDecision(PROJECT, 1.0, c)


def project_(grads: TensorList, ref: TensorList, coef: float, g_dot_r: float, r_sq: float) -> None:
    """In place: g <- g - coef * (<g, r> / ||r||^2) r, i.e. remove ``coef`` of g's component along r.

    ``ref`` may have a lower precision than ``grads`` (a bf16 reference buffer); the
    update is computed in the gradients' precision.
    """
    if coef == 0.0 or r_sq <= 0.0:
        return
    alpha = -coef * g_dot_r / r_sq
    same_dtype = all(g.dtype == r.dtype for g, r in zip(grads, ref))
    if same_dtype:
        torch._foreach_add_(list(grads), [r.view_as(g) for g, r in zip(grads, ref)], alpha=alpha)
    else:
        for g, r in zip(grads, ref):
            g.add_(r.view_as(g).to(g.dtype), alpha=alpha)


def gac_project(
    grads: TensorList,
    ref: TensorList,
    c_low: float = 0.05,
    c_high: float = 0.3,
    high_mode: str = "project",
    shrink: str = "component",
) -> tuple[list[Tensor] | None, GACDecision]:
    """Out-of-place GAC on one gradient: returns (g_tilde, decision); g_tilde is None for a skip.

    For KEEP the returned tensors are the inputs themselves (bit-for-bit unchanged).
    """
    validate_thresholds(c_low, c_high)
    scalars = alignment_scalars(grads, ref)
    c = cosine_from_scalars(scalars)
    decision = gac_decision(c, c_low, c_high, high_mode, shrink)
    if decision.action == KEEP:
        return list(grads), decision
    if decision.action == SKIP:
        return None, decision
    out = [g.clone() for g in grads]
    project_(out, ref, decision.coef, float(scalars[0]), float(scalars[2]))
    return out, decision
