"""The one collective of an alignment step: the gradient scalars made identical on every rank."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor


def agree_scalars(scalars: Tensor, sharded: bool) -> Tensor:
    """``scalars`` (⟨g, r⟩, ‖g‖², ‖r‖²) agreed across the ranks of the default process group, with one collective.

    Sharded gradients (FSDP, DTensor shards): each rank holds a disjoint shard, so the partial sums are added
    (all-reduce SUM). Replicated gradients (DDP): every rank already holds the full all-reduced gradient; rank
    0's scalars are broadcast so that control-flow decisions cannot differ by a rounding error. The caller's
    tensor is left as it was (the collective works on a copy). The caller decides whether to agree at all.
    """
    scalars = scalars.clone()
    if sharded:
        dist.all_reduce(scalars, op=dist.ReduceOp.SUM)
    else:
        dist.broadcast(scalars, src=0)
    return scalars
