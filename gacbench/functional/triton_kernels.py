"""GAC's memory passes as Triton kernels over the whole parameter list (``GAC(kernels="triton")``).

The eager path launches one or more kernels per tensor: at the Qwen3-1.7B shape (310 tensors) two dot products
per tensor for the scalars, then one ``g - alpha r`` per tensor. Here each pass is one launch over every
tensor of the list, whatever their sizes and addresses:

- :func:`scalars`: ``[<g, r>, ||g||^2]`` (and ``||r||^2`` when the caller has no cached one) in one read of g
  and r;
- :func:`project`: ``r <- g - alpha r`` in place, one read of g and r and one write of r (the swapping
  projection of :class:`~gacbench.functional.gac.GACTransform`: r's storage then becomes ``p.grad`` and the raw
  gradient the reference, so a kept step writes nothing);
- :func:`apply`: ``g <- g - alpha r`` in place and ``r <- g`` (the raw gradient, rounded once to r's dtype), one
  read of g and r and one write of each: the reference ``"grad"`` where storage cannot be swapped (a reference
  in a lower precision, ``buffer_dtype="bfloat16"``; gradients that are views of DDP's buckets). A kept step
  reads g and writes r.

How one launch covers a list: each program takes a chunk of up to :data:`CHUNK` elements of one tensor. The
table of programs (each program's tensor, start and end) depends only on the tensors' sizes and dtypes and is
built once per list; the tensors' addresses (``data_ptr()``) are copied to the device at every call, because
autograd allocates new gradients at every step. Tensors of different (g, r) dtypes go to separate launches (the
element type is a compile-time constant). Every address 16-byte aligned (as torch's allocator gives) lets the
compiler vectorise the loads (checked in the PTX for sm_90, ``tests/test_gac_triton.py``).

Numerics: each program reduces its chunk's products in float32 (per-lane sums over the chunk, then a tree sum
of the block), and the per-program partials are added in float64 on the device, so results match the eager path
to float32 rounding, not bit for bit. A sum that is not finite (a float32 overflow, or a real inf/NaN in g) is
recomputed by the eager path, which tells the two apart. The update computes ``g - alpha r`` in float32 and
rounds once to the stored dtype; :func:`apply` stores the raw gradient itself as the next reference (the eager
path recovers it as ``g~ + alpha r``, within float32 rounding of it).

Devices: CUDA tensors (Triton's GPU compiler; each kernel compiles once per dtype pair and flag, about a second,
cached on disk by Triton). CPU tensors run only under Triton's interpreter, ``TRITON_INTERPRET=1`` in the
environment before the first GAC step that uses these kernels (Triton reads it when the kernels are defined): the
interpreter runs each program in numpy, to check the kernels on a machine without a GPU; it is far slower than
the eager path. Anything these kernels do not take (see :func:`unusable`) runs the eager path.
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

#: elements per program (a multiple of :data:`BLOCK`): 1.72B parameters make about 105,000 programs
CHUNK = 1 << 14
#: elements per iteration of a program's loop
BLOCK = 1024
#: the element types the kernels read and write (a float64 list runs the eager path)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: launch options: fused multiply-adds in the sums and in g - alpha r (one rounding), whatever Triton's default
_OPTIONS = {"enable_fp_fusion": True}

_STATE: dict[str, object] = {}  # "jit": the kernels' module, "error": why they could not be loaded
_WARNED: set[str] = set()
_PLANS: dict[tuple, "_Plan"] = {}
_MAX_PLANS = 8


def _jit() -> ModuleType | None:
    """The kernels' module (imported on first use, so that ``TRITON_INTERPRET`` set before then applies), or
    None where Triton cannot be imported (the reason in ``_STATE["error"]``)."""
    if "jit" not in _STATE and "error" not in _STATE:
        try:
            _STATE["jit"] = importlib.import_module("gacbench.functional._triton_jit")
        except Exception as exc:  # noqa: BLE001  (ImportError, or a Triton that fails to initialise)
            _STATE["error"] = f"Triton cannot be imported ({type(exc).__name__}: {str(exc)[:200]})"
    return _STATE.get("jit")  # type: ignore[return-value]


def interpreted() -> bool:
    """Whether the kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` when they were defined)."""
    jit = _jit()
    if jit is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(jit.scalars_kernel, InterpretedFunction)


def device_problem(device_type: str) -> str | None:
    """Why the kernels cannot run on tensors of ``device_type`` here, in one phrase; None when they can."""
    if _jit() is None:
        return str(_STATE["error"])
    if "failed" in _STATE:
        return f"a Triton kernel failed earlier in this process ({_STATE['failed']})"
    if device_type == "cuda":
        return ("TRITON_INTERPRET=1 runs Triton on the CPU, not on CUDA tensors: unset it" if interpreted()
                else None)
    if device_type == "cpu":
        return None if interpreted() else ("on the CPU they run only under Triton's interpreter (TRITON_INTERPRET=1 "
                                           "before the first step; for checking, far slower than the eager path)")
    return f"they run on CUDA tensors, not {device_type}"


def unusable(g: list[Tensor], r: list[Tensor]) -> str | None:
    """Why :func:`scalars` and the updates cannot take these lists (the eager path runs instead), or None: the
    lists must be non-empty, of equal lengths and element counts, plain dense contiguous tensors of
    :data:`DTYPES` on one device the kernels run on (:func:`device_problem`)."""
    if not g or len(g) != len(r):
        return "the gradient and reference lists are empty or of different lengths"
    device = g[0].device
    for gi, ri in zip(g, r):
        if type(gi) is not torch.Tensor or type(ri) is not torch.Tensor:
            return "a tensor is a subclass (DTensor, ...), not a plain tensor"
        if gi.dtype not in DTYPES or ri.dtype not in DTYPES:
            return f"a tensor is {gi.dtype if gi.dtype not in DTYPES else ri.dtype}, not float32/bfloat16/float16"
        if gi.device != device or ri.device != device:
            return "the tensors are not all on one device"
        if gi.numel() != ri.numel() or not (gi.is_contiguous() and ri.is_contiguous()):
            return "a gradient and its reference differ in size, or one is not contiguous"
    return device_problem(device.type)


def warn_once(reason: str) -> None:
    """One RuntimeWarning per reason and process: ``GAC(kernels='triton')`` runs the eager path because ..."""
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"GAC(kernels='triton'): {reason}; running the eager path", RuntimeWarning, stacklevel=4)


@dataclass
class _Group:
    """The tensors of one (g dtype, r dtype) pair, and their programs: ``owner`` (int32, each program's tensor
    within the group), ``starts`` and ``ends`` (int64, its chunk), on the device."""

    index: list[int]
    g_dtype: torch.dtype
    r_dtype: torch.dtype
    owner: Tensor
    starts: Tensor
    ends: Tensor
    first: int  # the group's first row in the plan's partials

    @property
    def programs(self) -> int:
        return int(self.owner.numel())


@dataclass
class _Plan:
    groups: list[_Group]
    partials: Tensor  # (programs, 3) float32: each program's <g, r>, ||g||^2, ||r||^2


def _plan(g: list[Tensor], r: list[Tensor]) -> _Plan:
    """The programs for lists of these sizes and dtypes (built once per signature, kept for the next calls)."""
    device = g[0].device
    key = (device, tuple((gi.numel(), gi.dtype, ri.dtype) for gi, ri in zip(g, r)))
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    by_dtypes: dict[tuple, list[int]] = {}
    for i, (gi, ri) in enumerate(zip(g, r)):
        if gi.numel():
            by_dtypes.setdefault((gi.dtype, ri.dtype), []).append(i)
    groups, first = [], 0
    for (gd, rd), index in by_dtypes.items():
        owner, starts, ends = [], [], []
        for k, i in enumerate(index):
            n = g[i].numel()
            for s in range(0, n, CHUNK):
                owner.append(k)
                starts.append(s)
                ends.append(min(s + CHUNK, n))
        groups.append(_Group(index, gd, rd, torch.tensor(owner, dtype=torch.int32, device=device),
                             torch.tensor(starts, dtype=torch.int64, device=device),
                             torch.tensor(ends, dtype=torch.int64, device=device), first))
        first += len(owner)
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    plan = _PLANS[key] = _Plan(groups, torch.zeros(max(first, 1), 3, dtype=torch.float32, device=device))
    return plan


_TL_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _launches(g: list[Tensor], r: list[Tensor]):
    """For each group of the plan: (group, g addresses, r addresses, the element types, ALIGNED)."""
    import triton.language as tl

    plan = _plan(g, r)
    out = []
    for grp in plan.groups:
        gs, rs = [g[i] for i in grp.index], [r[i] for i in grp.index]
        ptrs = [t.data_ptr() for t in gs] + [t.data_ptr() for t in rs]
        addr = torch.tensor(ptrs, dtype=torch.int64).to(gs[0].device)
        aligned = all(p % 16 == 0 for p in ptrs)
        out.append((grp, addr[: len(gs)], addr[len(gs):], getattr(tl, _TL_NAMES[grp.g_dtype]),
                    getattr(tl, _TL_NAMES[grp.r_dtype]), aligned))
    return plan, out


def _failed(exc: Exception) -> None:
    _STATE["failed"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    warn_once(f"a Triton kernel failed ({_STATE['failed']})")


def scalars(g: list[Tensor], r: list[Tensor], ref_sq: bool) -> Tensor | None:
    """``tensor([<g, r>, ||g||^2])``, or with ``ref_sq`` ``tensor([<g, r>, ||g||^2, ||r||^2])`` (float64, on the
    tensors' device), in one read of g and r; None if a kernel failed (warned once; use the eager path). The
    caller checked :func:`unusable`."""
    jit = _jit()
    try:
        plan, launches = _launches(g, r)
        for grp, ga, ra, gt, rt, aligned in launches:
            part = plan.partials[grp.first: grp.first + grp.programs]
            jit.scalars_kernel[(grp.programs,)](grp.owner, grp.starts, grp.ends, ga, ra, part, G=gt, R=rt,
                                               REF_SQ=ref_sq, ALIGNED=aligned, BLOCK=BLOCK, **_OPTIONS)
    except Exception as exc:  # noqa: BLE001  (a compile or launch error: the eager path runs)
        _failed(exc)
        return None
    programs = sum(grp.programs for grp in plan.groups)
    sums = plan.partials[:programs].sum(dim=0, dtype=torch.float64)  # the float32 partials, added in float64
    return sums if ref_sq else sums[:2]


def _update(name: str, g: list[Tensor], r: list[Tensor], alpha: float, **flags) -> bool:
    kernel = getattr(_jit(), name)
    done = 0
    try:
        _, launches = _launches(g, r)
        for grp, ga, ra, gt, rt, aligned in launches:
            kernel[(grp.programs,)](grp.owner, grp.starts, grp.ends, ga, ra, float(alpha), G=gt, R=rt,
                                    ALIGNED=aligned, BLOCK=BLOCK, **_OPTIONS, **flags)
            done += 1
    except Exception as exc:  # noqa: BLE001
        _failed(exc)
        if done:  # some tensors are updated and others not: the eager path cannot take over from here
            raise RuntimeError(f"GAC(kernels='triton'): a kernel failed after {done} of {len(launches)} dtype "
                               f"groups were updated ({_STATE['failed']})") from exc
        return False
    return True


def project(g: list[Tensor], r: list[Tensor], alpha: float) -> bool:
    """``r <- g - alpha r`` for every pair, in one pass per dtype pair; False if the kernel failed before anything
    was written (warned once; the caller runs the eager path). The caller checked :func:`unusable`."""
    return _update("project_kernel", g, r, alpha)


def apply(g: list[Tensor], r: list[Tensor], alpha: float) -> bool:
    """``g <- g - alpha r`` (unless ``alpha`` is 0) and ``r <- g`` (the raw gradient, rounded once to r's dtype),
    in one pass per dtype pair; False if the kernel failed before anything was written (warned once; the caller
    runs the eager path). The caller checked :func:`unusable`."""
    return _update("apply_kernel", g, r, alpha, PROJECT=bool(alpha))
