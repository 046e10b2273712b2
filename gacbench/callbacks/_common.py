"""Shared plumbing of the callbacks: finding the gradients, agreeing across ranks, publishing
metrics to ``trainer.callback_metrics`` and the loggers, and storing large tensors in the
Lightning checkpoint."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)
from torch import Tensor

from gacbench.functional.buffer import listed_entries
from gacbench.functional.collective import agree_scalars, release_process_group_at_exit
from gacbench.functional.gac import local  # noqa: F401  (re-exported for the callbacks)
from gacbench.functional.settings import summary_settings
from gacbench.functional.stats import alignment_summary

# Large tensors (reference buffers, parameter snapshots) go into the checkpoint under this
# key, one entry per callback ``state_key``, instead of through ``state_dict()``, which
# Lightning deep-copies on load.
CKPT_TENSORS_KEY = "gacbench_tensors"


def optimizer_params(trainer: "pl.Trainer", who: str) -> list[torch.nn.Parameter]:
    """The parameters of the (single) optimizer, across all its param groups, in order, deduplicated."""
    if len(trainer.optimizers) != 1:
        raise RuntimeError(
            f"{who}: expected exactly one optimizer, found {len(trainer.optimizers)}. "
            "Return a single optimizer (with as many param groups as you like) from configure_optimizers."
        )
    seen: set[int] = set()
    params: list[torch.nn.Parameter] = []
    for group in trainer.optimizers[0].param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


class StepGuard:
    """For a callback that collects the optimizer's parameters once per fit (``on_train_start``) and acts once per
    optimizer step in ``on_before_optimizer_step``: refuses a parameter group added during the fit (its
    parameters would be neither delayed nor measured) and, with ``once=True``, a second call of the hook in one
    optimizer step (an optimizer that evaluates its closure several times per step, such as LBFGS: Lightning
    runs ``on_before_optimizer_step`` after every evaluation). ``start`` at ``on_train_start``, ``check`` at the
    top of ``on_before_optimizer_step``."""

    def __init__(self, who: str, once: bool = True) -> None:
        self.who, self.once = who, once
        self._listed: int | None = None
        self._last_step: int | None = None

    def start(self, trainer: "pl.Trainer") -> None:
        self._listed = listed_entries(trainer.optimizers[0]) if len(trainer.optimizers) == 1 else None
        self._last_step = None

    def check(self, trainer: "pl.Trainer", optimizer: torch.optim.Optimizer) -> None:
        step = trainer.global_step
        if self._listed is not None and listed_entries(optimizer) != self._listed:
            raise RuntimeError(
                f"{self.who}: the optimizer's parameter groups changed during the fit (add_param_group at step "
                f"{step}, e.g. BaseFinetuning.unfreeze_and_add_param_group): {self.who} takes the parameters once, "
                "when the fit starts, so the added ones would be left out. Create the optimizer with every "
                "parameter group in configure_optimizers (a group can be held still with lr 0 until it is "
                "unfrozen), or start a new fit after adding the group.")
        if self.once and step == self._last_step:
            raise RuntimeError(
                f"{self.who}: on_before_optimizer_step ran twice in optimizer step {step}: the optimizer "
                f"({type(optimizer).__name__}) evaluates its closure more than once per step (LBFGS, a line search), "
                f"and {self.who} acts once per step, on one gradient. Use an optimizer that evaluates the closure "
                "once per step (SGD, Adam, AdamW).")
        self._last_step = step


def check_no_replicated_shards(params: list[torch.Tensor], who: str) -> None:
    """Refuse a DTensor parameter that is replicated over a mesh dimension of more than one rank (tensor
    parallelism's replicated weights and biases, HSDP's replica groups): under sharding the callbacks sum each
    rank's local sums, which counts such a tensor once per replica (a wrong cosine, and wrong decisions). Once per
    fit, from the callbacks' ``on_train_start``."""
    try:
        from torch.distributed.tensor import DTensor, Replicate
    except ImportError:  # a torch without DTensor has no replicated shards either
        return
    for p in params:
        if isinstance(p, DTensor):
            for dim, placement in enumerate(p.placements):
                if isinstance(placement, Replicate) and p.device_mesh.size(dim) > 1:
                    raise RuntimeError(
                        f"{who}: a parameter of shape {tuple(p.shape)} is replicated over {p.device_mesh.size(dim)} "
                        f"ranks of its device mesh (placements {p.placements}): tensor parallelism and HSDP's "
                        "replica groups are not supported, since the callback sums every rank's share and would "
                        "count a replicated tensor once per replica. Shard every parameter over one mesh dimension "
                        "(fully_shard with a 1-D mesh, or ModelParallelStrategy(tensor_parallel_size=1)), or use "
                        "strategy='ddp'.")


def check_sharded_resume(trainer: "pl.Trainer", who: str) -> None:
    """Refuse to restore a callback's tensor state under a sharded strategy with several ranks: each rank holds
    its own shard of that state, but Lightning writes a callback's part of the checkpoint from rank 0 alone, so
    every rank would restore rank 0's shard (a wrong reference, or a size mismatch)."""
    if is_sharded(trainer) and trainer.world_size > 1:
        raise RuntimeError(
            f"{who}: cannot resume its state under {type(trainer.strategy).__name__} with {trainer.world_size} "
            "ranks: the checkpoint holds rank 0's shard of it only (Lightning saves a callback's state from rank "
            "0), so the other ranks' shards are lost. Start the fit again, or train with strategy='ddp', whose "
            "ranks hold the same state, to resume.")


def parameter_names(pl_module: "pl.LightningModule", params: list[torch.nn.Parameter]) -> list[str]:
    """The module's name of each parameter ('' for one the module does not name), for error messages."""
    names = {id(p): n for n, p in pl_module.named_parameters()}
    return [names.get(id(p), "") for p in params]


def is_sharded(trainer: "pl.Trainer") -> bool:
    return isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy))


def check_strategy(trainer: "pl.Trainer", who: str, allow_sharded: bool) -> None:
    """Refuse strategies on which the callback would silently compute the wrong thing."""
    strategy = trainer.strategy
    if isinstance(strategy, DeepSpeedStrategy):
        raise RuntimeError(
            f"{who} does not support DeepSpeed: DeepSpeed keeps gradients in its own partitioned buffers "
            "that Lightning's on_before_optimizer_step does not see. Use strategy='ddp' or 'fsdp'."
        )
    allowed: tuple[type, ...] = (SingleDeviceStrategy, DDPStrategy)
    if allow_sharded:
        allowed += (FSDPStrategy, ModelParallelStrategy)
    if not isinstance(strategy, allowed):
        names = ", ".join(cls.__name__ for cls in allowed)
        raise RuntimeError(f"{who} supports the strategies {names}; got {type(strategy).__name__}. Train with "
                           "one of them (strategy='ddp' on several devices).")
    release_process_group_at_exit()


def check_automatic_optimization(pl_module: "pl.LightningModule", who: str) -> None:
    if not pl_module.automatic_optimization:
        raise RuntimeError(
            f"{who} needs automatic optimization: with manual optimization Lightning does not call "
            "on_before_optimizer_step at a point where the callback can act consistently. "
            "Set self.automatic_optimization = True, or call gacbench.functional directly in your training_step."
        )


def agree(trainer: "pl.Trainer", scalars: Tensor, sharded: bool) -> Tensor:
    """Make the gradient scalars identical on every rank, with one collective.

    Sharded gradients: each rank holds a disjoint shard, so the partial sums are added
    (all-reduce SUM). Replicated gradients (DDP): every rank already holds the full
    all-reduced gradient; rank 0's scalars are broadcast so that control-flow decisions
    cannot differ by a rounding error.
    """
    if trainer.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return scalars
    return agree_scalars(scalars, sharded)


# The per-step metrics shown in the progress bar (every gacbench metric is in ``callback_metrics``).
PROGRESS_BAR_METRICS = frozenset({"align/cos"})


def log_metrics(trainer: "pl.Trainer", metrics: Mapping[str, float | Tensor]) -> None:
    """Publish per-step scalars the way ``LightningModule.log`` does, at a fraction of its cost.

    Every step, on every rank, each value goes into ``trainer.callback_metrics`` as a 0-d float64
    CPU tensor (what ``EarlyStopping`` and ``ModelCheckpoint`` monitor), and the keys of
    ``PROGRESS_BAR_METRICS`` into ``trainer.progress_bar_metrics``. Every ``log_every_n_steps``
    steps rank 0 also writes them to every logger at ``trainer.global_step`` (and to
    ``trainer.logged_metrics``). The values must already agree across ranks.

    ``LightningModule.log`` costs about a millisecond per call (it moves its whole result
    collection each time), which dominated the step time of small problems; these scalars need
    none of its reduction machinery, so they go into the logger connector's metric dicts with one
    dict update per step.
    """
    write = trainer.global_step % max(1, trainer.log_every_n_steps) == 0
    _publish(trainer, metrics, write)


def _publish(trainer: "pl.Trainer", metrics: Mapping[str, float | Tensor], write: bool) -> None:
    if not metrics:
        return
    values = {k: float(v) for k, v in metrics.items()}
    tensors = {k: torch.scalar_tensor(v, dtype=torch.float64) for k, v in values.items()}
    # The dicts that trainer.callback_metrics / progress_bar_metrics / logged_metrics return (Lightning 2.4-2.6).
    # Their public getters first merge the module's result collection, a pass that would cost more than this
    # whole function; Lightning itself only adds to these dicts between resets, so a direct update is kept.
    connector = trainer._logger_connector
    connector._callback_metrics.update(tensors)
    if not PROGRESS_BAR_METRICS.isdisjoint(values):
        connector._progress_bar_metrics.update({k: v for k, v in values.items() if k in PROGRESS_BAR_METRICS})
    if write and trainer.loggers and trainer.is_global_zero:
        connector._logged_metrics.update(tensors)
        for logger in trainer.loggers:
            logger.log_metrics(values, step=trainer.global_step)


class CosineTrace:
    """The c_t trace a callback records, and its end-of-fit summary (paper Table 3)."""

    def __init__(self, warmup: int, tol: float, who: str = "CosineTrace") -> None:
        self.warmup, self.tol = summary_settings(who, warmup, tol)
        self.values: list[float] = []

    def append(self, c: float) -> None:
        """One step's c_t; NaN for a step without one (a zero or non-finite gradient), counted as ``skipped``."""
        self.values.append(c)

    def summary(self) -> dict[str, float]:
        return alignment_summary(self.values, self.warmup, self.tol)

    def log_summary(self, trainer: "pl.Trainer", prefix: str = "align") -> dict[str, float]:
        s = self.summary()
        metrics = {
            f"{prefix}/q90_abs": s["q90_abs"],
            f"{prefix}/max_abs": s["max_abs"],
            f"{prefix}/frac_le_{self.tol:g}": s["frac_le_tol"],
            f"{prefix}/median": s["median"],
            f"{prefix}/skipped": s["skipped"],
        }
        _publish(trainer, metrics, write=True)  # once per fit: written whatever log_every_n_steps is
        return s

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values = [float(v) for v in state["values"]]


def save_tensor(checkpoint: dict[str, Any], key: str, value: Any) -> None:
    """Store a callback's large tensor state in the checkpoint under ``CKPT_TENSORS_KEY``."""
    if value is not None:
        checkpoint.setdefault(CKPT_TENSORS_KEY, {})[key] = value


def load_tensor(checkpoint: dict[str, Any], key: str, trainer: "pl.Trainer | None" = None, who: str = "") -> Any:
    """The tensor state stored under ``key`` (None when there is none). With ``trainer``, state that a sharded
    strategy's ranks would each need their own shard of is refused (:func:`check_sharded_resume`)."""
    value = checkpoint.get(CKPT_TENSORS_KEY, {}).get(key)
    if value is not None and trainer is not None:
        check_sharded_resume(trainer, who)
    return value
