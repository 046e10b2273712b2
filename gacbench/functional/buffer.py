"""A flat buffer: one contiguous allocation viewed as a list of parameter-shaped tensors.

GAC's reference direction and the staleness simulator's parameter snapshots are stored
this way: one allocation (cheap to copy, save and move), optionally in a lower precision
than the parameters (``dtype=torch.bfloat16`` halves the memory of the reference).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


class FlatBuffer:
    """``numel = sum(shape.numel())`` elements in one tensor, with ``views[i]`` shaped like ``shapes[i]``."""

    def __init__(self, shapes: Sequence[torch.Size], dtype: torch.dtype, device: torch.device | str) -> None:
        self.shapes = [torch.Size(s) for s in shapes]
        self.numel = sum(s.numel() for s in self.shapes)
        self.data = torch.zeros(self.numel, dtype=dtype, device=device)
        self.views = self._make_views(self.data)

    @classmethod
    def like(cls, tensors: Sequence[Tensor], dtype: torch.dtype | None = None) -> "FlatBuffer":
        """An all-zero buffer shaped like ``tensors`` (dtype defaults to the first tensor's)."""
        if not tensors:
            raise ValueError("FlatBuffer.like: no tensors given")
        return cls([t.shape for t in tensors], dtype or tensors[0].dtype, tensors[0].device)

    def _make_views(self, data: Tensor) -> list[Tensor]:
        views, offset = [], 0
        for shape in self.shapes:
            n = shape.numel()
            views.append(data[offset : offset + n].view(shape))
            offset += n
        return views

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
        self.data.copy_(data.reshape(-1))


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
            return self.buffer.data.detach().clone()
        return None if self._pending is None else self._pending.clone()

    def load(self, saved: Tensor | None) -> None:
        if saved is None:
            return
        if self.buffer is not None:
            self.buffer.load_(saved)
        else:
            self._pending = saved
