"""A flat buffer: one contiguous allocation viewed as a list of parameter-shaped tensors.

GAC's reference direction and the staleness simulator's parameter snapshots are stored
this way: one allocation per dtype (cheap to copy, save and move), by default each tensor in its
parameter's own dtype, or all in one lower precision (``dtype=torch.bfloat16`` halves the memory
of the reference).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch
from torch import Tensor

from gacbench.usage import UsageError


def exact_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """The narrowest dtype that holds every value of every dtype in ``dtypes`` exactly (float16 and bfloat16
    both fit in float32; float32 in float64): the dtype of a flat copy of tensors of mixed precisions."""
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


class FlatBuffer:
    """``numel = sum(shape.numel())`` elements, with ``views[i]`` shaped like ``shapes[i]``.

    ``dtype`` is one dtype for every view, or one per view (``FlatBuffer.like`` without a dtype gives each
    view its tensor's dtype). Views of one dtype share one contiguous allocation (one per distinct dtype),
    so a model of bfloat16 and float32 parameters is stored in each parameter's own precision, and
    copying in and back out is exact.
    """

    def __init__(self, shapes: Sequence[torch.Size], dtype: torch.dtype | Sequence[torch.dtype],
                 device: torch.device | str) -> None:
        self.shapes = [torch.Size(s) for s in shapes]
        self.numel = sum(s.numel() for s in self.shapes)
        dtypes = [dtype] * len(self.shapes) if isinstance(dtype, torch.dtype) else list(dtype)
        if len(dtypes) != len(self.shapes):
            raise ValueError(f"FlatBuffer: {len(dtypes)} dtypes for {len(self.shapes)} shapes")
        self.dtypes = dtypes
        sizes: dict[torch.dtype, int] = {}
        for shape, d in zip(self.shapes, dtypes):
            sizes[d] = sizes.get(d, 0) + shape.numel()
        self.chunks = {d: torch.zeros(n, dtype=d, device=device) for d, n in sizes.items()}
        views, offsets = [], dict.fromkeys(sizes, 0)
        for shape, d in zip(self.shapes, dtypes):
            n = shape.numel()
            views.append(self.chunks[d][offsets[d] : offsets[d] + n].view(shape))
            offsets[d] += n
        self.views = views

    @classmethod
    def like(cls, tensors: Sequence[Tensor], dtype: torch.dtype | None = None) -> "FlatBuffer":
        """An all-zero buffer shaped like ``tensors``: in ``dtype``, or, without one, each view in its tensor's
        own dtype."""
        if not tensors:
            raise ValueError("FlatBuffer.like: no tensors given")
        return cls([t.shape for t in tensors], dtype or [t.dtype for t in tensors], tensors[0].device)

    @property
    def uniform(self) -> bool:
        """Every view has the same dtype (the buffer is one allocation)."""
        return len(self.chunks) == 1

    def flat(self) -> Tensor:
        """A flat copy of the contents in view order, shape (numel,), in :func:`exact_dtype` of the views'
        dtypes, so that ``load_`` of it restores every value bit for bit (a checkpoint's form)."""
        if self.uniform:
            return next(iter(self.chunks.values())).detach().clone()
        wide = exact_dtype(list(self.chunks))
        return torch.cat([v.detach().reshape(-1).to(wide) for v in self.views])

    def copy_from(self, tensors: Sequence[Tensor | None]) -> None:
        """views[i] <- tensors[i] (converting dtype); a None entry stores zeros."""
        present = [(v, t) for v, t in zip(self.views, tensors) if t is not None]
        if len(present) == len(self.views):
            torch._foreach_copy_(self.views, list(tensors))  # type: ignore[arg-type]
            return
        for v, t in zip(self.views, tensors):
            if t is None:
                v.zero_()
            else:
                v.copy_(t)

    def copy_to(self, tensors: Sequence[Tensor]) -> None:
        """tensors[i] <- views[i] (converting dtype); parameters are written outside autograd."""
        with torch.no_grad():
            torch._foreach_copy_(list(tensors), self.views)

    def load_(self, data: Tensor) -> None:
        """Replace the contents with a saved flat tensor of the same length (dtype and device converted)."""
        if data.numel() != self.numel:
            raise ValueError(
                f"FlatBuffer: the saved buffer has {data.numel()} elements but the model needs {self.numel}; "
                "the checkpoint was written for a different model or parameter set"
            )
        data = data.reshape(-1)
        if self.uniform:
            next(iter(self.chunks.values())).copy_(data)
            return
        offset = 0
        for v in self.views:
            v.copy_(data[offset : offset + v.numel()].view(v.shape))
            offset += v.numel()


class LazyFlatBuffer:
    """A :class:`FlatBuffer` shaped on first use, when the parameters are known.

    ``load`` may come before the first use (resuming from a checkpoint): the saved tensor is
    kept and copied in when the buffer is created.
    """

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype
        self.buffer: FlatBuffer | None = None
        self._pending: Tensor | None = None

    def get(self, like: Sequence[Tensor]) -> FlatBuffer:
        if self.buffer is None:
            self.buffer = FlatBuffer.like(like, self.dtype)
            if self._pending is not None:
                self.buffer.load_(self._pending)
                self._pending = None
        return self.buffer

    def state(self) -> Tensor | None:
        """A copy of the contents (None before first use), for a checkpoint."""
        if self.buffer is not None:
            return self.buffer.flat()
        return None if self._pending is None else self._pending.clone()

    def load(self, saved: Tensor | None) -> None:
        if saved is None:
            return
        if self.buffer is not None:
            self.buffer.load_(saved)
        else:
            self._pending = saved


def keep_reference(buffer: FlatBuffer, tensors: Sequence[Tensor | None], who: str) -> bool:
    """Copy a finite gradient into a reference buffer (None entries as zeros); False when a value does not fit
    the buffer's dtype (a float16 buffer of a gradient above 65504 holds inf): the buffer then holds no usable
    reference, and the caller must not measure against it. The check runs only where the buffer's range is
    narrower than a gradient's."""
    buffer.copy_from(tensors)
    narrow = any(t is not None and torch.finfo(v.dtype).max < torch.finfo(t.dtype).max
                 for v, t in zip(buffer.views, tensors))
    if not narrow or bool(torch.stack([torch.isfinite(c).all() for c in buffer.chunks.values()]).all()):
        return True
    dtypes = ", ".join(sorted({str(d).replace("torch.", "") for d in buffer.chunks}))
    warnings.warn(f"{who}: a gradient value overflows the reference buffer's {dtypes}; that gradient is not kept as "
                  "a reference (the next c_t is missing). Use buffer_dtype='bfloat16' (float32's range) or None.",
                  RuntimeWarning, stacklevel=3)
    return False


def _describe(i: int, t: Tensor, names: Sequence[str] | None) -> str:
    which = f"'{names[i]}'" if names and i < len(names) and names[i] else f"{i} of the optimizer's (counting from 0)"
    return f"parameter {which} (shape {tuple(t.shape)})"


def check_parameters(params: Sequence[Tensor], who: str, names: Sequence[str] | None = None,
                     complex_ok: bool = False) -> None:
    """Refuse, in one line naming the parameter and the fix, a sparse parameter (a buffer of it cannot be one flat
    dense vector) and, unless ``complex_ok``, a complex one (the cosine and the rule are defined for real vectors).
    ``names``: the parameters' names, where known (a LightningModule's ``named_parameters``)."""
    for i, p in enumerate(params):
        if p.layout != torch.strided:
            raise UsageError(f"{who}: {_describe(i, p, names)} is a sparse tensor ({p.layout}); {who} copies and reads "
                             "parameters as dense vectors. Make it dense (a strided nn.Parameter) or leave it out of "
                             "the optimizer")
        if p.is_complex() and not complex_ok:
            raise UsageError(f"{who}: {_describe(i, p, names)} is complex ({p.dtype}); the cosine of {who} is defined "
                             "for real vectors. Hold it as a real parameter (torch.view_as_real) or leave it out of "
                             "the optimizer")


def listed_entries(optimizer: torch.optim.Optimizer) -> int:
    """How many parameter entries the optimizer's param groups list: a cheap per-step check that none was added
    since the parameters were taken (the hooks, and the callbacks' step guard)."""
    return sum(len(group["params"]) for group in optimizer.param_groups)


def check_dense_gradients(params: Sequence[Tensor], who: str, names: Sequence[str] | None = None) -> None:
    """Refuse, in one line naming the parameter and the fix, a sparse gradient (``nn.Embedding(sparse=True)``)."""
    for i, p in enumerate(params):
        g = p.grad
        if g is not None and g.layout != torch.strided:
            raise UsageError(f"{who}: {_describe(i, p, names)} has a sparse gradient ({g.layout}), as "
                             f"nn.Embedding(sparse=True) gives; {who} needs dense gradients. Build the layer with "
                             "sparse=False, or leave the parameter out of the optimizer")
