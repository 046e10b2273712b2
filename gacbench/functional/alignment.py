"""Gradient alignment and the GAC projection as pure functions over lists of tensors.

A "vector" here is a list of tensors (one per parameter) read as one flattened vector,
the way an optimizer sees the model's gradient. Nothing in this module knows about
Lightning; the callbacks in :mod:`gacbench.callbacks` are thin adapters over it.

Notation (docs/design.md): g is the current gradient, r the reference direction (by default
the previous gradient g_{t-1}), u = r / ||r||, g_par = <g, u> u, c = <g, r> / (||g|| ||r||).
"""

from __future__ import annotations

import math
import numbers
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


def _flat(x: Tensor) -> Tensor:
    return x if x.dim() == 1 else x.reshape(-1)


def _flat_pairs(xs: TensorList, ys: TensorList) -> list[tuple[Tensor, Tensor]]:
    if len(xs) != len(ys):
        raise ValueError(f"dot: the two lists have {len(xs)} and {len(ys)} tensors; they must match")
    pairs = [(_flat(x), _flat(y)) for x, y in zip(xs, ys)]
    for x, y in pairs:
        if x.numel() != y.numel():
            raise ValueError(f"dot: paired tensors have {x.numel()} and {y.numel()} elements; they must match")
    return pairs


def _wide(x: Tensor, y: Tensor, scratch: dict[torch.dtype, list[Tensor]]) -> tuple[Tensor, Tensor]:
    """x and y in the precision their products are reduced in: float64 when both are float64, else float32.

    A lower precision is upcast here, one tensor or block at a time, into ``scratch``: two reusable buffers
    per precision, grown to the largest piece seen, so that blocks are not allocated one by one."""
    wide = torch.float64 if x.dtype == y.dtype == torch.float64 else torch.float32
    out = []
    for i, t in enumerate((x, y)):
        if t.dtype == wide:
            out.append(t)
            continue
        bufs = scratch.setdefault(wide, [torch.empty(0, dtype=wide, device=t.device) for _ in range(2)])
        if bufs[i].numel() < t.numel():
            bufs[i] = torch.empty(t.numel(), dtype=wide, device=t.device)
        out.append(bufs[i][: t.numel()].copy_(t))
    return out[0], out[1]


# On the CPU the products of one (x, y) pair are taken block by block: after <x_b, y_b> has brought the
# block into the cores' L2 caches, <x_b, x_b> (and <y_b, y_b>) read it from there instead of from memory,
# so the pass over g and r costs about one read of each. A block holds this many elements per thread
# (each thread's share of x_b and y_b, 2 x 512 KiB, fits a 2 MiB L2). A GPU takes each tensor whole (its
# L2 holds most tensors; more blocks would mean more kernel launches).
_CPU_BLOCK_PER_THREAD = 1 << 17

# The float64 recomputation of an overflowing sum works on slices of this many elements,
# so that its temporary memory stays small whatever the size of the parameter.
_F64_SLICE = 1 << 20


def _dot64(x: Tensor, y: Tensor) -> Tensor:
    """<x, y> of two flat tensors with products and sums in float64 (a 0-d float64 tensor).

    Used only for a sum that is not finite from float32 products: it tells a float32 overflow (a finite
    gradient of norm above ~1.8e19) from a real inf/NaN, which stays non-finite here.
    """
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for start in range(0, x.numel(), _F64_SLICE):
        total += torch.dot(x[start : start + _F64_SLICE].double(), y[start : start + _F64_SLICE].double())
    return total


def _sums(pairs: list[tuple[Tensor, Tensor]], products: tuple[str, ...], rest: Sequence[Tensor] = ()) -> Tensor:
    """For each product in ``products`` ("xy", "xx", "yy"), its sum over the (x, y) pairs: a float64 tensor
    of shape (len(products),), computed in one pass over the pairs. ``rest``: more y tensors whose x is zero,
    which add to the "yy" sum only (their partials join its column, so the sum is still exactly rounded and
    equals the one over the (x, y) pairs with those x written out as zeros).

    Each product of a tensor (of a block, on the CPU) is reduced in float32 (float64 for float64 tensors),
    with no float64 copy of the data; the partials are added exactly (``math.fsum``, one transfer to the
    host), so a sum does not depend on how the tensors are split into blocks. A sum that is not finite (a
    float32 overflow of finite values, or a real inf/NaN) is recomputed in float64, so the result is finite
    exactly when the data are finite (for float32, bfloat16 and float16 tensors of any finite value; float64
    tensors overflow above ~1e154 in norm).
    """
    rest = [_flat(y) for y in rest] if "yy" in products else []
    device = pairs[0][0].device if pairs else rest[0].device if rest else torch.device("cpu")
    if not pairs and not rest:
        return torch.zeros(len(products), dtype=torch.float64, device=device)
    block = _CPU_BLOCK_PER_THREAD * torch.get_num_threads() if device.type == "cpu" and len(products) > 1 else None
    f32 = torch.float32
    parts: list[Tensor] = []
    scratch: dict[torch.dtype, list[Tensor]] = {}
    for x, y in pairs:
        if block is not None and x.numel() > block:
            pieces = zip(x.split(block), y.split(block))
        else:
            pieces = ((x, y),)
        for xb, yb in pieces:
            if xb.dtype is not f32 or yb.dtype is not f32:
                xb, yb = _wide(xb, yb, scratch)
            for product in products:
                if product == "xy":
                    parts.append(torch.dot(xb, yb))
                elif product == "xx":
                    parts.append(torch.dot(xb, xb))
                else:
                    parts.append(torch.dot(yb, yb))
    n_pairs = len(parts)
    for y in rest:  # the same blocks as a pair would have: the partials of the sum are the same
        for yb in y.split(block) if block is not None and y.numel() > block else (y,):
            if yb.dtype is not f32:
                yb = _wide(yb, yb, scratch)[1]
            parts.append(torch.dot(yb, yb))
    flat = torch.stack(parts).tolist()  # one transfer; float32 partials are exact as Python floats
    m, values = len(products), []
    for j, product in enumerate(products):
        column = flat[j:n_pairs:m] + (flat[n_pairs:] if product == "yy" else [])
        if all(math.isfinite(v) for v in column):
            values.append(math.fsum(column))  # exactly rounded: independent of how the partials are grouped
        else:
            which = {"xy": lambda x, y: (x, y), "xx": lambda x, y: (x, x), "yy": lambda x, y: (y, y)}[product]
            extra = [(y, y) for y in rest] if product == "yy" else []
            values.append(math.fsum(float(_dot64(*which(x, y))) for x, y in pairs + extra))
    return torch.tensor(values, dtype=torch.float64, device=device)


def dot(xs: TensorList, ys: TensorList) -> Tensor:
    """<x, y> of two lists of tensors read as flat vectors (a 0-d float64 tensor).

    Shapes: ``xs[i]`` and ``ys[i]`` have the same number of elements; the result is on the
    device of ``xs[0]``. Each tensor's dot product is computed in float32 (lower precisions are
    upcast one tensor at a time, so the temporary memory is one parameter, not the model) and the
    per-tensor results are added exactly in float64. A float32 overflow is detected and the product
    recomputed in float64, so a finite vector always gives a finite result.
    """
    return _sums(_flat_pairs(xs, ys), ("xy",))[0]


def sq_norm(xs: TensorList) -> Tensor:
    """||x||^2 of a list of tensors read as one flat vector (0-d float64 tensor)."""
    return _sums([(x, x) for x, _ in _flat_pairs(xs, xs)], ("xx",))[0]


def alignment_scalars(
    grads: TensorList, ref: TensorList, ref_sq: Tensor | None = None, ref_rest: TensorList = ()
) -> Tensor:
    """The three scalars the rule needs: ``tensor([<g, r>, ||g||^2, ||r||^2])`` (float64, shape (3,)).

    The vectors are the full ones: ``ref_rest`` holds the reference's tensors of the parameters that have no
    gradient this step (a branch the forward pass did not take). Their gradient is zero, so they add nothing
    to <g, r> and ||g||^2, and their part of r counts in ||r||^2 (``ref_sq``, when given, must be that full
    norm). ``ref_rest`` is read only when ``ref_sq`` is None.

    One pass over g and r: per tensor (per block of 128K elements per thread on the CPU, so that the
    second and third products find the block in cache) the products are reduced in float32 and added exactly in
    float64, with a float64 recomputation of a sum that overflows float32; a finite gradient of any size gives
    finite scalars, and a gradient holding inf or NaN gives a non-finite ||g||^2. ``ref_sq``, when the
    caller already knows ||r||^2 (GAC caches it), saves that product. Under sharded training each rank
    calls this on its shard and the three sums are all-reduced once; the cosine is then computed from
    the reduced scalars.
    """
    pairs = _flat_pairs(grads, ref)
    if ref_sq is None:
        return _sums(pairs, ("xy", "xx", "yy"), ref_rest)
    sums = _sums(pairs, ("xy", "xx"))
    return torch.cat([sums, ref_sq.to(device=sums.device, dtype=torch.float64).reshape(1)])


def full_vector_scalars(grads: list[Tensor | None], ref: TensorList) -> Tensor:
    """:func:`alignment_scalars` of the full vectors, where ``grads[i]`` is None for a parameter without a
    gradient this step (its gradient is zero; its part of ``ref`` counts in ||r||^2)."""
    live = [(g, r) for g, r in zip(grads, ref) if g is not None]
    rest = [r for g, r in zip(grads, ref) if g is None]
    return alignment_scalars([g for g, _ in live], [r for _, r in live], ref_rest=rest)


def cosine_from_scalars(scalars: Tensor) -> float:
    """c = <g, r> / (||g|| ||r||) from ``alignment_scalars``; 0.0 when either norm is zero, however small the
    other: a gradient of norm 1e-16 has a direction like any other."""
    return cosine_of(*(float(v) for v in scalars.tolist()))


def cosine_of(g_r: float, gg: float, rr: float) -> float:
    """:func:`cosine_from_scalars` of the three scalars already read to the host."""
    if not (math.isfinite(gg) and math.isfinite(rr) and math.isfinite(g_r)):
        return float("nan")
    if gg == 0.0 or rr == 0.0:
        return 0.0
    denom = math.sqrt(gg) * math.sqrt(rr)
    return g_r / denom if denom > 0.0 else g_r / math.sqrt(gg) / math.sqrt(rr)  # the product can underflow


def reference_cosine(g_r: float, gg: float, rr: float) -> float:
    """c_t = cos(g, r) from the three scalars of ``alignment_scalars`` read to the host, where r is a reference to
    measure against: NaN (no c_t) when ||r|| = 0. A zero reference (``reference="update"`` after a step that did
    not move the parameters; a reference rounded to zero in a narrow ``buffer_dtype``) has no direction: the step
    is treated as one with a zero gradient (no c_t, counted as ``skipped`` in the summary), not as an orthogonal
    one (c = 0) that is always kept. Otherwise :func:`cosine_of`."""
    return float("nan") if rr == 0.0 else cosine_of(g_r, gg, rr)


def cosine(xs: TensorList, ys: TensorList) -> float:
    """Cosine similarity of two lists of tensors read as flat vectors."""
    return cosine_from_scalars(alignment_scalars(xs, ys))


def plain_number(value: object) -> int | float | None:
    """``value`` as a Python int or float when it is a real number: an int or float, any ``numbers.Real`` (numpy's
    scalars), or a 0-d tensor or array of a real dtype (read with ``.item()``); None otherwise (a bool, text, a
    complex number, a tensor with elements). Integers stay int; any other real becomes float. Settings are
    stored as these, so that a checkpoint holding them loads with ``torch.load(weights_only=True)``."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item") and not isinstance(value, numbers.Number):
        value = value.item()  # a 0-d tensor or array: its Python scalar
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def validate_thresholds(c_low: object, c_high: object) -> tuple[float, float]:
    """Raise ``ValueError`` naming the bad value unless c_low and c_high are real numbers (see
    :func:`plain_number`) with 0 <= c_low < c_high <= 1; return them as Python floats."""
    given = {"c_low": c_low, "c_high": c_high}
    plain = {}
    for name, value in given.items():
        x = plain_number(value)
        if x is None or not math.isfinite(x):
            raise ValueError(f"GAC: {name}={value!r} must be a finite number in [0, 1] (a real number: int, float, "
                             "a numpy scalar or a 0-d tensor)")
        plain[name] = float(x)
    c_low, c_high = plain["c_low"], plain["c_high"]
    if not 0.0 <= c_low < c_high <= 1.0:
        raise ValueError(
            f"GAC: thresholds must satisfy 0 <= c_low < c_high <= 1, got c_low={c_low}, c_high={c_high}. "
            "The paper's defaults are c_low=0.05 (the on-policy range of |c_t|) and c_high=0.3."
        )
    return c_low, c_high


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
            g.add_(r.view_as(g), alpha=alpha)  # r is upcast element by element: no copy of it


def gac_project(
    grads: TensorList,
    ref: TensorList,
    c_low: float = 0.05,
    c_high: float = 0.3,
    high_mode: str = "project",
    shrink: str = "component",
) -> tuple[list[Tensor] | None, GACDecision]:
    """Out-of-place GAC on one gradient: returns (g_tilde, decision); g_tilde is None for a skip.

    For KEEP the returned tensors are the inputs themselves (bit-for-bit unchanged). A zero reference has no
    direction: c is NaN and the gradient is kept (:func:`reference_cosine`), as in the callback and the step.
    """
    c_low, c_high = validate_thresholds(c_low, c_high)
    g_r, gg, rr = (float(v) for v in alignment_scalars(grads, ref).tolist())
    c = reference_cosine(g_r, gg, rr)
    decision = gac_decision(c, c_low, c_high, high_mode, shrink)
    if decision.action == KEEP:
        return list(grads), decision
    if decision.action == SKIP:
        return None, decision
    out = [g.clone() for g in grads]
    project_(out, ref, decision.coef, g_r, rr)
    return out, decision
