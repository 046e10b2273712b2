"""GAC's two memory passes as ``torch.compile`` kernels (``GAC(kernels="compiled")``).

The eager path (:func:`~gacbench.functional.alignment.alignment_scalars`, then one ``torch.add`` per tensor)
launches one or more kernels per tensor and block. Compiled over the whole parameter list, with static shapes,
Inductor emits:

- ``scalars(g, r)``: ``[<g, r>, ||g||^2]`` in one read of g and r (both products in the same loop), each
  tensor reduced in float32 and the per-tensor sums added in float64;
- ``project(g, r, alpha)``: ``r <- g - alpha r`` in place, one read of g and r and one write of r (the
  swapping projection of :class:`~gacbench.functional.gac.GACTransform`: r's storage then becomes ``p.grad``).

``alpha`` travels as a 0-d tensor, so a new coefficient does not recompile. Each distinct parameter list
(number, shapes, dtypes of tensors) compiles once, about 20-30 s on 2 CPU cores for a 46-tensor model, and
needs a C++ compiler on the CPU (Inductor's); a compile failure is reported once and the eager path is used.

Numerics: each tensor's sums are float32 reductions (Inductor's order, not the eager path's blocks), so
results match the eager path to float32 rounding, not bit for bit. A sum that is not finite (a float32
overflow, or a real inf/NaN in g) is recomputed by the eager path, which tells the two apart.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import Tensor

_COMPILED: dict[str, Callable] = {}
_FAILED: list[str] = []


def _scalars(gl: list[Tensor], rl: list[Tensor]) -> Tensor:
    # this form lets Inductor reduce both products of a tensor in one loop (a `sum(dtype=...)` or a stack of
    # the per-tensor sums made it ~1.6x slower on the CPU)
    dot = sum((g * r).sum().double() for g, r in zip(gl, rl))
    sq = sum((g * g).sum().double() for g in gl)
    return torch.stack([dot, sq])


def _project(gl: list[Tensor], rl: list[Tensor], alpha: Tensor) -> None:
    torch._foreach_mul_(rl, -alpha)
    torch._foreach_add_(rl, gl)


def _get(name: str, fn: Callable) -> Callable | None:
    if _FAILED:
        return None
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=False, fullgraph=True)
    return _COMPILED[name]


def _run(name: str, fn: Callable, *args) -> tuple[bool, object]:
    """(True, the compiled ``fn(*args)``), or (False, None) after a compile failure (warned once; the caller
    goes eager)."""
    compiled = _get(name, fn)
    if compiled is None:
        return False, None
    try:
        return True, compiled(*args)
    except Exception as exc:  # noqa: BLE001  (Inductor raises many kinds; any of them means: go eager)
        _FAILED.append(f"{type(exc).__name__}: {exc}")
        warnings.warn(f"GAC(kernels='compiled'): torch.compile failed ({_FAILED[0][:300]}); using the eager "
                      "kernels for the rest of this process", RuntimeWarning, stacklevel=3)
        return False, None


def compiled_scalars(g: list[Tensor], r: list[Tensor]) -> Tensor | None:
    """``tensor([<g, r>, ||g||^2])`` (float64, shape (2,)) in one compiled pass, or None (use eager)."""
    return _run("scalars", _scalars, list(g), list(r))[1]


def compiled_project(g: list[Tensor], r: list[Tensor], alpha: float) -> bool:
    """``r <- g - alpha r`` for every pair, in one compiled pass; False if the compiled path is unavailable."""
    a = torch.tensor(alpha, dtype=r[0].dtype, device=r[0].device)
    return _run("project", _project, list(g), list(r), a)[0]


def compiled_available() -> bool:
    """False once a compile has failed in this process."""
    return not _FAILED
