"""GAC as a stateful gradient transformation over a list of parameters (no Lightning).

``GACTransform.step(params)`` reads ``p.grad`` of every parameter, measures the cosine
with the reference direction, applies the rule of docs/design.md in place, and moves the
reference to the current step. The Lightning callback :class:`gacbench.GAC` and the
``gacbench overhead`` benchmark both run exactly this code.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gacbench.functional import triton_kernels
from gacbench.functional.alignment import (
    _CPU_BLOCK_PER_THREAD,
    HIGH_MODES,
    KEEP,
    SHRINK_MODES,
    SKIP,
    GACDecision,
    alignment_scalars,
    gac_decision,
    plain_number,
    project_,
    reference_cosine,
    validate_thresholds,
)
from gacbench.functional.buffer import check_dense_gradients, check_parameters, exact_dtype
from gacbench.functional.kernels import (
    adamw_group_fusable,
    choose_kernels,
    compiled_adamw_projected,
    compiled_available,
    compiled_project,
    compiled_scalars,
    compiled_scalars_lowp,
)

REFERENCES = ("grad", "applied", "update", "ema")
KERNELS = ("eager", "compiled", "fused-adamw", "triton")  # the kernel paths
COMPILED = ("compiled", "fused-adamw")  # the paths of torch.compile kernels (gacbench.functional.kernels)
KERNEL_CHOICES = ("auto",) + KERNELS  # what GAC(kernels=...) takes: "auto" picks a path when fit starts
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_choice(who: str, name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{who}: {name}={value!r} is not one of {', '.join(map(repr, choices))}")


def parse_dtype(who: str, dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A ``buffer_dtype`` setting as a torch dtype (None stays None); ``ValueError`` naming ``who``, the value and
    what is accepted unless it is one of the names or a floating-point torch.dtype."""
    if isinstance(dtype, str):
        check_choice(who, "buffer_dtype", dtype, tuple(_DTYPES))
        return _DTYPES[dtype]
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point and not dtype.is_complex):
        return dtype
    raise ValueError(f"{who}: buffer_dtype={dtype!r} must be None, one of {', '.join(map(repr, _DTYPES))}, or a "
                     "floating-point torch.dtype")


def local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (FSDP2 / ModelParallelStrategy); the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def _identity(x: Tensor) -> Tensor:
    return x


def _combine_rounding_once(r: list[Tensor], g: list[Tensor], a: float, b: float) -> None:
    """r <- a r + b g for a reference ``r`` of lower precision than ``g``: computed in g's precision and
    rounded to r's once. On the CPU block by block through one reusable buffer (no temporary the size of a
    parameter); elsewhere tensor by tensor.

    r's block is first copied into the buffer (an exact widening), so every operation that follows has operands
    of g's precision only: the result does not depend on how a torch version evaluates an operation with a
    bfloat16 operand (``add_(bf16, alpha=a)`` may form ``a * r`` in bfloat16 and round twice), nor on the
    block size (the thread count): each element is computed on its own by the same element-wise operations in
    g's precision, within a few of its ulps (2^-24 relative for float32) of the exact a r + b g, and the
    final ``copy_`` rounds that once to r's precision (within half an ulp of r's dtype, up to those 2^-24)."""
    scratch = None
    for ri, gi in zip(r, g):
        rf, gf = ri.view(-1), gi.reshape(-1)
        block = _CPU_BLOCK_PER_THREAD * torch.get_num_threads() if rf.device.type == "cpu" else rf.numel()
        if scratch is None or scratch.numel() < min(block, rf.numel()) or scratch.dtype != gf.dtype:
            scratch = torch.empty(min(block, rf.numel()), dtype=gf.dtype, device=gf.device)
        for rb, gb in zip(rf.split(block), gf.split(block)):
            out = scratch[: rb.numel()]
            out.copy_(rb)  # exact: r's values are representable in g's precision
            if b == 1.0:
                torch.add(gb, out, alpha=a, out=out)  # g + a r in one operation, as the fused AdamW kernel forms it
            else:
                out.mul_(a).add_(gb, alpha=b)  # a r + b g in g's precision
            rb.copy_(out)  # the one rounding


def _project_keeping_raw(g: list[Tensor], r: list[Tensor], alpha: float) -> None:
    """g <- g - alpha r and r <- the raw g, tensor by tensor (one tensor-sized copy at a time): the same
    element-wise operation as :func:`~gacbench.functional.alignment.project_` (and the swapping path), and the
    raw gradient stored exactly (rounded once where ``r`` has a lower precision)."""
    for gi, ri in zip(g, r):
        raw = gi.clone()
        rv = ri.view_as(gi)
        if gi.dtype == ri.dtype:
            torch._foreach_add_([gi], [rv], alpha=-alpha)
        else:
            gi.add_(rv, alpha=-alpha)  # r is upcast element by element
        rv.copy_(raw)


class StepReading:
    """What a GAC step's outcome reads from its ``decision`` and ``zero_ref`` (:class:`GACStep`, and
    :class:`~gacbench.functional.step_gac.StepOutcome` of the step target)."""

    decision: GACDecision
    zero_ref: bool

    @property
    def cos(self) -> float:
        return self.decision.cos

    @property
    def measured(self) -> bool:
        """Whether the step goes into the c_t trace: a c_t, or NaN against a zero reference (counted as skipped);
        not the first step, which has no reference."""
        return not math.isnan(self.decision.cos) or self.zero_ref


@dataclass(frozen=True)
class GACStep(StepReading):
    """What one call of ``GACTransform.step`` saw and did.

    ``cos`` is NaN on the first step (no reference yet) and where the reference is zero (``zero_ref``: the
    step has no c_t, like a step with a zero gradient, and keeps its gradient); ``bad`` marks a zero or
    non-finite gradient (``zero`` tells which), which the transform leaves untouched, without moving its
    reference, for the caller to handle.
    """

    decision: GACDecision
    grad_sq: float
    bad: bool = False
    zero: bool = False
    stepped: bool = False  # kernels="fused-adamw": the optimizer step was taken by GAC
    zero_ref: bool = False  # a reference of norm 0: no c_t (NaN, counted as skipped), the gradient kept


@dataclass
class GACState:
    """Everything a :class:`GACTransform` carries from one step to the next.

    ``ref``: the reference direction r as parameter-shaped tensors (local shards), allocated when
    the parameters are first seen (None before); all zeros until ``has_ref``.
    ``has_ref``: r holds a direction (False until the first finite, non-zero gradient).
    ``ref_sq``: the local ||r||^2 (0-d float64) when it is known without a pass over r, else None.
    ``saved``: a flat reference restored before the parameters were known (shape (numel,));
    it is copied into ``ref`` when ``ref`` is allocated.
    ``held``: ``reference="update"`` only: ``ref`` holds the update theta_{t-1} - theta_t itself, kept across a
    step that was skipped (its gradient skipped by the rule, or zero or non-finite), instead of the parameters
    theta_{t-1} it is otherwise taken from.
    """

    ref: list[Tensor] | None = None
    has_ref: bool = False
    ref_sq: Tensor | None = None
    saved: Tensor | None = None
    held: bool = False

    def clone(self) -> "GACState":
        """A deep copy (tensors cloned), e.g. to restore the same state before every timed run."""
        return GACState(
            ref=None if self.ref is None else [t.clone() for t in self.ref],
            has_ref=self.has_ref,
            ref_sq=None if self.ref_sq is None else self.ref_sq.clone(),
            saved=None if self.saved is None else self.saved.clone(),
            held=self.held,
        )


class GACTransform:
    """Gradient Alignment Control over ``p.grad`` of a fixed list of parameters.

    Args: see :class:`gacbench.GAC`. ``reduce`` (given to ``step``) maps the local
    ``tensor([<g,r>, ||g||^2, ||r||^2])`` to the global one (an all-reduce under sharding).

    State: ``self.state``, one :class:`GACState` (the reference, whether it is set, its cached
    norm); ``state_dict`` / ``load_state_dict`` save and restore it as a unit.

    Memory traffic per step, in units of one gradient-sized read or write, for the default
    reference with ``swap=True``: the alignment scalars read g and r once (2; ||r||^2 is cached,
    and on the CPU ||g||^2 is taken block by block from the cache, see
    :func:`~gacbench.functional.alignment.alignment_scalars`); keep adds nothing with
    ``keep_alias`` (the reference *is* ``p.grad``) and a copy (2) without; shrink/project adds one
    fused ``g - alpha r`` written into the old reference's storage (3), which then becomes
    ``p.grad`` while the raw gradient becomes the reference: no copy. ``swap`` needs plain, owned
    gradient tensors (not DDP bucket views, not DTensor shards) of the reference's dtype; the
    callback turns it off otherwise.
    """

    def __init__(
        self,
        c_low: float = 0.05,
        c_high: float = 0.3,
        high_mode: str = "project",
        reference: str = "grad",
        ema_decay: float = 0.9,
        shrink: str = "component",
        buffer_dtype: str | torch.dtype | None = None,
        kernels: str = "eager",
    ) -> None:
        c_low, c_high = validate_thresholds(c_low, c_high)
        check_choice("GAC", "kernels", kernels, KERNEL_CHOICES)
        check_choice("GAC", "high_mode", high_mode, HIGH_MODES)
        check_choice("GAC", "reference", reference, REFERENCES)
        check_choice("GAC", "shrink", shrink, SHRINK_MODES)
        decay = plain_number(ema_decay)
        if not (decay is not None and 0.0 <= decay < 1.0):
            raise ValueError(f"GAC: ema_decay={ema_decay!r} must be in [0, 1)")
        self.c_low, self.c_high, self.high_mode, self.shrink = c_low, c_high, high_mode, shrink
        self.reference, self.ema_decay = reference, float(decay)
        self.buffer_dtype = parse_dtype("GAC", buffer_dtype)
        self.requested_kernels = kernels
        self.kernels = "eager" if kernels == "auto" else kernels  # the path step() runs; see choose_kernels_for
        self.state = GACState()
        self.names: list[str] | None = None  # the parameters' names, where the caller knows them (error messages)

    def choose_kernels_for(self, n_params: int, steps: float, device: torch.device | str) -> str:
        """With ``kernels="auto"``, set the path ``step`` runs from the run's size and length and the parameters'
        device (its type, and a GPU's name: :func:`~gacbench.functional.kernels.choose_kernels`); until then "auto"
        runs the eager path. Returns the path; any other ``kernels`` stays as given."""
        if self.requested_kernels == "auto":
            device = torch.device(device)
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
            self.kernels = choose_kernels(n_params, steps, device.type, name)
        return self.kernels

    # -- the step -------------------------------------------------------------------------
    def step(
        self,
        params: Sequence[Tensor],
        reduce: Callable[[Tensor], Tensor] = _identity,
        swap: bool = False,
        keep_alias: bool = False,
        optimizer: torch.optim.Optimizer | None = None,
        zero_passes: bool = True,
    ) -> GACStep | None:
        """Apply the rule to the gradients of ``params`` in place; None when no parameter has a gradient.

        ``swap``: exchange gradient and reference storage instead of copying (see the class docstring).
        ``keep_alias``: with ``swap``, on a kept step the reference *is* ``p.grad`` (no copy at all);
        only valid if nothing edits ``p.grad`` in place before the optimizer step (no gradient
        clipping) and ``release`` is called before ``zero_grad``.
        ``optimizer``: with ``kernels="fused-adamw"``, ``swap`` and ``keep_alias``, the AdamW optimizer about to
        step: a shrunk or projected step is then taken here, by that AdamW's update with g - alpha r formed in
        its pass, and every ``p.grad`` is set to None so that the optimizer's own step does nothing
        (``GACStep.stepped``); the raw gradient stays the reference, untouched. With a lower-precision
        reference buffer every step that is not skipped is taken here, and the same pass stores g, rounded, as
        the next reference. An optimizer this cannot take (see
        :func:`~gacbench.functional.kernels.adamw_group_fusable`) gets the compiled projection (float32
        reference) or the eager path.
        ``zero_passes``: whether the caller lets an all-zero gradient through to the optimizer
        (``on_zero_grad="pass"``), which can still move the parameters (momentum, weight decay); with
        ``reference="update"`` that step's update becomes the next reference, while a gradient the caller skips
        leaves the parameters, and the reference, where they are.

        A parameter without a gradient (a branch the forward pass did not take) has g = 0 in the rule: it adds
        nothing to <g, r> and ||g||^2 and its part of the reference counts in ||r||^2, so the cosine, the
        decision and alpha are those of the full vectors, on every reference and kernel path. It is left
        without a gradient. The full-vector g - alpha r would be -alpha r there: nothing of this step's
        gradient, only a push against the reference on a parameter the step did not use, which the optimizer
        would also take as a step for it (AdamW's moments and weight decay would move a parameter it otherwise
        leaves alone). The applied gradient is g - alpha r on the parameters that have a gradient; it keeps
        <g~, g> = ||g||^2 - alpha <g, r> and ||g~|| <= ||g|| as for the full vector (g is zero elsewhere), and
        gives up only <g~, r> = 0 after a projection: alpha ||r_rest||^2 remains, the part of the aligned
        component that lies on the parameters without a gradient, which no edit of this step's gradient can
        remove. The reference treats the missing gradient as zero too (``"grad"``: zero there; ``"ema"``:
        decayed; ``"applied"``: zero, nothing was applied).
        """
        # What stays inline is what every step runs once, in order: picking g, r and the path flags, reducing the
        # scalars and the decision. The flags and lists are computed once here and handed down, and the steps
        # that end early (a bad gradient, a step the fused kernel takes) return from here; moving this part into
        # helpers would only pass the same values back and forth or evaluate a flag twice. Each path is a method:
        # the scalars (_local_scalars), the fused AdamW step (_take_fused_step), the edit of g and r (_apply).
        live = [i for i, p in enumerate(params) if p.grad is not None]
        if not live:
            return None
        check_dense_gradients(params, "GAC", self.names)
        st = self.state
        ref = self._buffer(params)
        if self.reference == "update" and st.has_ref and not st.held:
            torch._foreach_sub_(ref, [local(p.detach()) for p in params])  # r = theta_{t-1} - theta_t
            st.ref_sq = None
        # The rule reads the full vectors: a parameter without a gradient this step (a branch not taken) has
        # g = 0, so it adds nothing to <g, r> and ||g||^2, and its part of r counts in ||r||^2 (the cached
        # ref_sq is that full norm). g and r below are the parameters with a gradient, ``rest`` r elsewhere.
        everyone = len(live) == len(params)
        g = [local(params[i].grad) for i in live]
        r = ref if everyone else [ref[i] for i in live]
        rest = () if everyone else [ref[i] for i in sorted(set(range(len(params))) - set(live))]
        swap = swap and self.reference == "grad" and everyone and self._swappable(g, r)
        # the compiled scalars reduce each tensor in its own dtype: float32 gradients only (a bfloat16 sum would round)
        compiled = (self.kernels in COMPILED and swap and st.ref_sq is not None and compiled_available()
                    and all(gi.dtype == torch.float32 for gi in g))
        # the Triton kernels upcast in registers: any float32/bfloat16/float16 list, every parameter with a gradient
        fast = self.kernels == "triton" and everyone and self._triton_takes(g, r)
        # fused-adamw with a lower-precision reference: GAC takes every (unskipped) AdamW step and stores g,
        # rounded, as the next reference in the same pass; not for DTensor parameters (its update is compiled
        # for plain tensors)
        lowp = (self.kernels == "fused-adamw" and self.reference == "grad" and keep_alias and optimizer is not None
                and everyone and compiled_available() and not any(hasattr(p, "to_local") for p in params)
                and all(type(gi) is torch.Tensor and gi.dtype == torch.float32
                        and ri.dtype in (torch.bfloat16, torch.float16) for gi, ri in zip(g, r)))
        local_scalars = self._local_scalars(g, r, rest, compiled, lowp, fast)
        scalars = reduce(local_scalars.clone())  # a collective may work in place
        g_dot_r, g_sq, r_sq = (float(v) for v in scalars.tolist())
        if not (math.isfinite(g_sq) and g_sq > 0.0):
            if self.reference == "update":
                # a skipped step leaves the parameters where they are, so the update r stays the reference (as
                # the other references stay); a zero gradient passed on may still move them (momentum, decay),
                # and that move is the next reference
                st.held = st.has_ref and not (g_sq == 0.0 and zero_passes)
                if not st.held:
                    self._store_params(params)
            return GACStep(GACDecision(KEEP, 0.0, float("nan")), g_sq, bad=True, zero=g_sq == 0.0)

        c = reference_cosine(g_dot_r, g_sq, r_sq) if st.has_ref else float("nan")  # NaN for a zero reference
        decision = gac_decision(c, self.c_low, self.c_high, self.high_mode, self.shrink)
        alpha = decision.coef * g_dot_r / r_sq if decision.coef else 0.0  # g_tilde = g - alpha * r
        skipped = decision.action == SKIP
        zero_ref = st.has_ref and r_sq == 0.0
        if (self.kernels == "fused-adamw" and optimizer is not None and keep_alias and (compiled or lowp)
                and self._take_fused_step(params, optimizer, g, r, alpha, skipped, compiled, local_scalars)):
            return GACStep(decision, g_sq, stepped=True, zero_ref=zero_ref)
        self._apply(params, live, g, r, decision, g_dot_r, r_sq, alpha, swap, keep_alias, compiled, local_scalars,
                    fast)
        if skipped:
            self.skip(params)
        st.has_ref = self._reference_fits(g)
        return GACStep(decision, g_sq, zero_ref=zero_ref)

    def _reference_fits(self, g: list[Tensor]) -> bool:
        """Whether the reference just stored is finite. Only a ``buffer_dtype`` of narrower range than a gradient
        (float16 for float32 or bfloat16 gradients) can overflow, so only then is it checked (one pass over the
        buffer); an overflowed reference is dropped (the next step has none, and keeps its gradient)."""
        dt = self.buffer_dtype
        if dt is None or not any(torch.finfo(dt).max < torch.finfo(gi.dtype).max for gi in g):
            return True
        if bool(torch.stack([torch.isfinite(ri).all() for ri in self.state.ref]).all()):
            return True
        warnings.warn(f"GAC: a gradient value overflows buffer_dtype={dt}; the reference is dropped and the next "
                      "step measured without one. Use buffer_dtype='bfloat16' (float32's range) or None.",
                      RuntimeWarning, stacklevel=3)
        self.state.ref_sq = None
        return False

    @staticmethod
    def _triton_takes(g: list[Tensor], r: list[Tensor]) -> bool:
        """Whether the Triton kernels take these lists; where they cannot, one warning per reason and process
        (:func:`~gacbench.functional.triton_kernels.unusable`), and the eager path runs."""
        why = triton_kernels.unusable(g, r)
        if why is not None:
            triton_kernels.warn_once(why)
        return why is None

    def _local_scalars(self, g: list[Tensor], r: list[Tensor], rest: Sequence[Tensor], compiled: bool,
                       lowp: bool, fast: bool = False) -> Tensor:
        """This rank's ``tensor([<g, r>, ||g||^2, ||r||^2])``: one compiled pass where ``compiled`` (the cached
        ||r||^2 appended) or ``lowp`` (all three), one Triton pass where ``fast`` (||r||^2 in the same pass when
        it is not cached), else the eager one; a compiled or Triton sum that is not finite is left to the eager
        path, which tells a float32 overflow from a real inf/NaN."""
        ref_sq = self.state.ref_sq
        if fast:
            sums = triton_kernels.scalars(g, r, ref_sq is None)
            if sums is not None and bool(torch.isfinite(sums).all()):
                return sums if ref_sq is None else torch.cat(
                    [sums, ref_sq.to(device=sums.device, dtype=torch.float64).reshape(1)])
        elif compiled:
            two = compiled_scalars(g, r)
            if two is not None and bool(torch.isfinite(two).all()):
                return torch.cat([two, ref_sq.to(device=two.device, dtype=torch.float64).reshape(1)])
        elif lowp:
            three = compiled_scalars_lowp(g, r)
            if three is not None and bool(torch.isfinite(three).all()):
                return three
        return alignment_scalars(g, r, ref_sq, rest)

    def _take_fused_step(self, params, optimizer, g: list[Tensor], r: list[Tensor], alpha: float, skipped: bool,
                         compiled: bool, local_scalars: Tensor) -> bool:
        """``kernels="fused-adamw"``: take the optimizer's AdamW step here, on g - alpha r, when the optimizer
        allows it (:func:`~gacbench.functional.kernels.adamw_group_fusable`): a changed step with a float32
        reference (``compiled``), every unskipped step with a lower-precision one (then the same pass stores g,
        rounded, as the next reference). Every ``p.grad`` is then None, so the optimizer's own step does
        nothing. False, with nothing changed, where the step is left to the optimizer."""
        st = self.state
        if compiled:
            if not (alpha and adamw_group_fusable(optimizer, list(params))
                    and compiled_adamw_projected(optimizer, g, r, alpha)):
                return False
            st.ref, st.ref_sq = list(g), local_scalars[1]  # the raw gradient is the reference, as with swap
        else:
            if skipped or not (adamw_group_fusable(optimizer, list(params))
                               and compiled_adamw_projected(optimizer, g, r, alpha, write_ref=True)):
                return False
            st.ref_sq = None  # r now holds g, rounded: its norm is taken with the next products
        st.has_ref = True
        self.skip(params)  # the step is taken: the optimizer's own step must not move anything
        return True

    def _apply(self, params, live: list[int], g: list[Tensor], r: list[Tensor], decision: GACDecision,
               g_dot_r: float, r_sq: float, alpha: float, swap: bool, keep_alias: bool, compiled: bool,
               local_scalars: Tensor, fast: bool = False) -> None:
        """Turn ``p.grad`` into g - alpha r and move the reference to this step, by swapping storage (``swap``)
        or in place. A parameter without a gradient keeps none: see :meth:`step`. ``fast``: the Triton kernels
        take the lists (one pass for the swapping projection; without swapping, for the reference ``"grad"``, one
        pass that writes g - alpha r into g and the raw g, rounded once, into r)."""
        st = self.state
        if swap:
            self._step_swapping(params, g, r, alpha, decision.action == SKIP, keep_alias, compiled, fast)
            st.ref_sq = local_scalars[1]  # the reference is now exactly the raw gradient
            return
        if fast and self.reference == "grad" and triton_kernels.apply(g, r, alpha):
            # r holds the raw gradient: its norm is ||g||^2 unless it was rounded to a lower precision
            st.ref_sq = local_scalars[1] if all(gi.dtype == ri.dtype for gi, ri in zip(g, r)) else None
            return
        skipped = decision.action == SKIP
        if alpha and self.reference == "grad":
            # the raw gradient becomes the reference as it is: recovered afterwards as g~ + alpha r it would be
            # rounded twice in the gradient's precision (a bfloat16 gradient: c_t off by ~1e-3)
            _project_keeping_raw(g, r, alpha)
            self._update_reference(params, live, g, r, 0.0, skipped, stored=True)
        else:
            if alpha:
                project_(g, r, decision.coef, g_dot_r, r_sq)
            self._update_reference(params, live, g, r, alpha, skipped)
        # r is an exact copy of the raw g (zero where a parameter has no gradient), its norm ||g||^2: the reference
        # "grad" after any step, "applied" after a kept one
        copied = self.reference == "grad" or (self.reference == "applied" and not skipped and not alpha)
        if copied and all(gi.dtype == ri.dtype for gi, ri in zip(g, r)):
            st.ref_sq = local_scalars[1]

    def _step_swapping(
        self, params, g: list[Tensor], r: list[Tensor], alpha: float, skipped: bool, keep_alias: bool,
        compiled: bool = False, fast: bool = False,
    ) -> None:
        """Reference 'grad' without copying the raw gradient twice: see the class docstring."""
        if alpha:
            if not (compiled and compiled_project(g, r, alpha)) and not (fast and triton_kernels.project(g, r, alpha)):
                for gi, ri in zip(g, r):
                    torch.add(gi, ri, alpha=-alpha, out=ri)  # ri <- g_tilde
            for p, ri in zip(params, r):
                p.grad = ri
        elif not skipped and keep_alias:
            pass  # the optimizer and the reference share the raw gradient tensors
        elif not skipped:
            torch._foreach_copy_(r, g)  # ri <- g; the optimizer gets r's storage, we keep g's
            for p, ri in zip(params, r):
                p.grad = ri
        self.state.ref = list(g)  # the raw gradient tensors

    def release(self, params: Sequence[Tensor]) -> None:
        """Before ``zero_grad``: drop ``p.grad`` where it is the reference, so that a
        ``zero_grad(set_to_none=False)`` cannot zero the reference in place."""
        if self.state.ref is None:
            return
        ids = {id(t) for t in self.state.ref}
        for p in params:
            if p.grad is not None and id(p.grad) in ids:
                p.grad = None

    @staticmethod
    def _swappable(g: list[Tensor], r: list[Tensor]) -> bool:
        return all(gi.dtype == ri.dtype and gi._base is None and type(gi) is torch.Tensor for gi, ri in zip(g, r))

    @staticmethod
    def skip(params: Sequence[Tensor]) -> None:
        """Skip the step: optimizers leave parameters without a gradient untouched (no momentum, no decay)."""
        for p in params:
            p.grad = None

    # -- the reference --------------------------------------------------------------------
    def _buffer(self, params: Sequence[Tensor]) -> list[Tensor]:
        st = self.state
        if st.ref is None:
            check_parameters(params, "GAC", self.names)
            tensors = [local(p.detach()) for p in params]
            if self.reference == "update" and self.buffer_dtype is not None:
                low = [t.dtype for t in tensors if torch.finfo(self.buffer_dtype).bits < torch.finfo(t.dtype).bits]
                if low:
                    raise ValueError(
                        f"GAC: reference='update' stores parameters, so buffer_dtype={self.buffer_dtype} "
                        f"must not be below the parameters' {low[0]}; drop buffer_dtype."
                    )
            # each parameter's reference in its own dtype (or all in buffer_dtype): a float32 parameter's part is
            # never rounded to a bfloat16 neighbour's precision
            # (another dtype than the parameter's, the reference is only ever combined with a flat copy of the
            # gradient, so it is laid out contiguously whatever the parameter's strides: channels_last included)
            st.ref = [torch.zeros_like(t, dtype=self.buffer_dtype, memory_format=torch.contiguous_format)
                      if self.buffer_dtype is not None and self.buffer_dtype != t.dtype
                      else torch.zeros_like(t) for t in tensors]
            if st.saved is not None:
                self._copy_saved(st.saved)
        return st.ref

    def _store_params(self, params: Sequence[Tensor]) -> None:
        # theta_t, before the optimizer moves it
        torch._foreach_copy_(self.state.ref, [local(p.detach()) for p in params])
        self.state.ref_sq = None

    def _update_reference(self, params, live, g, r, alpha: float, skipped: bool, stored: bool = False) -> None:
        """Move the reference to step t. ``g`` already holds g_tilde = g_raw - alpha * r, so the raw
        gradient is recovered as g_tilde + alpha * r without keeping a second copy of it. ``stored``: ``r`` (the
        parameters with a gradient) already holds the raw gradient (reference ``"grad"``); only the part of the
        parameters without one is set (zero)."""
        st = self.state
        st.ref_sq = None
        if self.reference == "update":
            # a skipped step leaves the parameters where they are: theta_{t+1} - theta_t would be zero, so the
            # update r stays the reference, as "applied" keeps its reference across a skip
            st.held = skipped and st.has_ref
            if not st.held:
                self._store_params(params)
            return
        if self.reference == "applied":
            if skipped and st.has_ref:
                return  # nothing was applied: the previous applied gradient stays the reference
            alpha = 0.0  # the reference is g_tilde itself
        # new r = a * r + b * g_raw = (a + b * alpha) * r + b * g_tilde, on the parameters with a gradient
        a, b = (self.ema_decay, 1.0 - self.ema_decay) if self.reference == "ema" and st.has_ref else (0.0, 1.0)
        if len(live) != len(st.ref):  # parameters without a gradient: g_raw = 0 there
            dead = set(range(len(st.ref))) - set(live)
            dead_ref = [st.ref[i] for i in sorted(dead)]
            if a:
                torch._foreach_mul_(dead_ref, a)
            else:
                torch._foreach_zero_(dead_ref)  # not a multiplication by 0: an overflowed (inf) part would stay NaN
        if stored:
            return
        coef = a + b * alpha
        if coef == 0.0:  # then b == 1: the reference is exactly the gradient
            torch._foreach_copy_(r, g)
        elif all(ri.dtype == gi.dtype for ri, gi in zip(r, g)):
            torch._foreach_mul_(r, coef)
            torch._foreach_add_(r, g, alpha=b)
        else:  # a lower-precision buffer: combine in the gradient's precision and round once per step
            _combine_rounding_once(r, g, coef, b)

    # -- checkpointing --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The state as ``{"has_ref": bool, "ref": flat tensor (numel,) or None, "ref_sq": 0-d float64 tensor or
        None, "held": bool}`` (tensors copied; ``held``: see :class:`GACState`).

        ``ref`` is None before the parameters are first seen (unless a restored one is waiting). ``ref_sq`` is
        the cached ||r||^2 when there is one: a resumed step then reads the same value (and takes the same kernel
        path) as the uninterrupted run's, instead of a sum over r that rounds differently.
        """
        st = self.state
        if st.ref is not None:
            wide = exact_dtype([t.dtype for t in st.ref])  # holds every part's values exactly
            flat = torch.cat([t.detach().reshape(-1).to(wide) for t in st.ref])
        else:
            flat = None if st.saved is None else st.saved.clone()
        ref_sq = None if st.ref_sq is None else st.ref_sq.detach().to("cpu", torch.float64).clone()
        return {"has_ref": st.has_ref, "ref": flat, "ref_sq": ref_sq, "held": st.held}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``; before the parameters are known the reference waits in ``state.saved``."""
        if not isinstance(state, Mapping) or not {"has_ref", "ref"} <= set(state) <= {"has_ref", "ref", "ref_sq",
                                                                                   "held"}:
            found = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(
                "GAC: expected the dict GACTransform.state_dict() returns, with keys 'has_ref' and 'ref' (and "
                f"'ref_sq', 'held'); got {found}. The checkpoint was written by a different version of gacbench: "
                "resume from one written by this version."
            )
        flat, has_ref = state["ref"], bool(state["has_ref"])
        if has_ref and flat is None:
            raise ValueError("GAC: the saved state has has_ref=True but no reference tensor; the checkpoint is damaged")
        st = self.state
        ref_sq = state.get("ref_sq")  # optional: without it ||r||^2 is summed again at the next step
        st.has_ref, st.ref_sq = has_ref, None if ref_sq is None else torch.as_tensor(ref_sq, dtype=torch.float64)
        st.held = bool(state.get("held", False))  # absent: False
        if flat is None:
            return
        if st.ref is None:
            st.saved = flat
        else:
            self._copy_saved(flat)

    def _copy_saved(self, flat: Tensor) -> None:
        st = self.state
        numel = sum(t.numel() for t in st.ref)
        if flat.numel() != numel:
            raise ValueError(
                f"GAC: the saved reference has {flat.numel()} elements but the model has {numel}; "
                "the checkpoint was written for a different model or parameter set"
            )
        offset = 0
        for t in st.ref:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        st.saved = None
