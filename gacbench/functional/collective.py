"""The one collective of an alignment step: the gradient scalars made identical on every rank."""

from __future__ import annotations

import atexit

import torch.distributed as dist
from torch import Tensor

_RELEASE_REGISTERED = False


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


def release_process_group_at_exit() -> None:
    """Destroy the default process group when the interpreter exits, if it is still there then.

    A gloo process group left to the interpreter's finalization can abort the process (SIGABRT, "terminate
    called without an active exception") after a run has finished and stored everything: its C++ worker
    threads still hold work objects whose tensors need the GIL, which is being torn down. An ``atexit``
    handler runs while the interpreter is whole. It is registered once per process, when a process group
    exists (a call without one does nothing), and does nothing at exit when the group was already destroyed
    (by the user or by Lightning). The gacbench callbacks, hooks and GRPO module call this when they set up,
    so a DDP script that uses them exits with its own status.
    """
    global _RELEASE_REGISTERED
    if not _RELEASE_REGISTERED and dist.is_available() and dist.is_initialized():
        atexit.register(_release)
        _RELEASE_REGISTERED = True


def _release() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
