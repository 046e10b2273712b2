"""The small contract every synthetic objective meets, so that the bench runner can treat them alike."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import lightning.pytorch as pl
import torch

from gacbench.usage import UsageError

OPTIMIZERS = ("sgd", "adamw")
SEED_MAX = 2**32 - 1  # the seeds numpy (hence Lightning's seed_everything) accepts: 0..2**32 - 1
GENERATOR_SEEDS = 2**64  # torch.Generator.manual_seed takes 0..2**64 - 1


def rollout_seed(seed: int, version: int, salt: int = 0) -> int:
    """The generator seed of a rollout objective's rollout drawn by policy ``version`` (``salt`` tells a step's
    rollouts apart): seed * 1_000_003 + version * 101 + salt, modulo 2**64 so that torch's generator takes it
    for any version. Below 2**64 (every seed up to :data:`SEED_MAX` with any version below about 10**17) the
    modulo leaves the number as it is."""
    return (seed * 1_000_003 + version * 101 + salt) % GENERATOR_SEEDS


class SettingError(UsageError):
    """A setting an objective refuses: the message names ``key`` (``lr``, ``loss.clip_low``), ``value`` and what
    is accepted; ``key`` lets the bench runner say where the value came from (``--param KEY`` or the suite). A
    :class:`~gacbench.usage.UsageError` (and so a ValueError): a command that builds an objective from its options
    prints it as one line and exits 2."""

    def __init__(self, message: str, key: str, value: Any) -> None:
        super().__init__(message)
        self.key, self.value = key, value


def queue_world_problem(state: Mapping[str, Any], world: int) -> str | None:
    """Why a checkpoint's rollout queue state (``checkpoint["rollout_queue"]``) cannot be restored on ``world``
    processes, or None: a DDP checkpoint holds one queue per rank (``by_rank``) and needs as many processes; one
    process's queue holding rollouts cannot be shared out among several."""
    if "by_rank" in state:
        if len(state["by_rank"]) != world:
            return (f"the checkpoint's rollout queues are those of {len(state['by_rank'])} processes, this run has "
                    f"{world}: each rank's queue holds its own rollouts; resume with {len(state['by_rank'])} devices")
        return None
    if world > 1 and state.get("items"):
        return (f"the checkpoint's rollout queue is one process's, this run has {world}: its rollouts cannot be "
                "shared out among the ranks; resume with 1 device")
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_range(owner: str, key: str, value: Any, lo: float | None = None, hi: float | None = None, *,
                lo_open: bool = False, hi_open: bool = False, integer: bool = False, why: str = "") -> None:
    """Raise :class:`SettingError` unless ``value`` is a finite number (an integer when ``integer``) in the range
    [lo, hi] (an end excluded when ``lo_open`` / ``hi_open``; None: unbounded); ``why`` is added to the message."""
    ok = _is_number(value) and math.isfinite(value) and (not integer or isinstance(value, int))
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if ok:
        return
    kind = "an integer" if integer else "a finite number"
    show = lambda v: str(v) if isinstance(v, int) else f"{v:g}"  # noqa: E731  (an integer bound in full)
    if lo is not None and hi is not None:
        bound = f" in {'(' if lo_open else '['}{show(lo)}, {show(hi)}{')' if hi_open else ']'}"
    elif lo is not None:
        bound = f" {'>' if lo_open else '>='} {show(lo)}"
    elif hi is not None:
        bound = f" {'<' if hi_open else '<='} {show(hi)}"
    else:
        bound = ""
    raise SettingError(f"{owner}: {key}={value!r} must be {kind}{bound}{f' ({why})' if why else ''}", key, value)


def check_bool(owner: str, key: str, value: Any) -> None:
    """Raise :class:`SettingError` unless ``value`` is True or False (a switch given as a string, "no" or "0", would
    otherwise read as true or fail deep inside torch)."""
    if not isinstance(value, bool):
        raise SettingError(f"{owner}: {key}={value!r} must be true or false", key, value)


def check_name(owner: str, key: str, value: Any, names: Any, what: str) -> None:
    """Raise :class:`SettingError` unless ``value`` is one of ``names`` (a registry's keys); ``what`` names them."""
    if value not in names:
        raise SettingError(f"{owner}: {key}={value!r} is not {what} ({', '.join(sorted(names))})", key, value)


def check_lookup(owner: str, key: str, value: Any, lookup: Callable[[Any], Any]) -> None:
    """Raise :class:`SettingError` when ``lookup(value)`` (a registry's lookup, which names what it knows) raises
    ValueError."""
    try:
        lookup(value)
    except ValueError as exc:
        raise SettingError(f"{owner}: {key}={value!r}: {exc}", key, value) from None


def check_finite(owner: str, params: Mapping[str, Any], prefix: str = "") -> None:
    """Raise :class:`SettingError` for the first number in ``params`` (sections included: a dict or a dataclass,
    its keys named ``SECTION.KEY``) that is NaN or infinite."""
    for key, value in params.items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        if isinstance(value, Mapping):
            check_finite(owner, value, f"{prefix}{key}.")
        elif _is_number(value) and not math.isfinite(value):
            raise SettingError(f"{owner}: {prefix}{key}={value!r} must be a finite number", f"{prefix}{key}", value)


def check_policy_settings(owner: str, params: Mapping[str, Any]) -> None:
    """The settings the rollout objectives (the bandit, the sequence policy) share: ``staleness`` >= 0, ``group`` >= 2,
    ``prompts`` and ``contexts`` >= 1, ``advantage`` a registered estimator, ``clip_low`` in [0, 1) and ``clip_high``
    >= 0 (the policy loss's clip range)."""
    from gacbench.rollout.advantages import advantage_fn

    if "staleness" in params:
        check_range(owner, "staleness", params["staleness"], 0, integer=True)
    if "group" in params:
        check_range(owner, "group", params["group"], 2, integer=True, why="advantages are normalised within a group")
    for key in ("prompts", "contexts"):
        if key in params:
            check_range(owner, key, params[key], 1, integer=True)
    if "advantage" in params:
        check_lookup(owner, "advantage", params["advantage"], advantage_fn)
    if "clip_low" in params:  # the clip range PolicyBatch takes: [1 - clip_low, 1 + clip_high]
        check_range(owner, "clip_low", params["clip_low"], 0, 1, hi_open=True)
    if "clip_high" in params:
        check_range(owner, "clip_high", params["clip_high"], 0)


def given_settings(local: Mapping[str, Any]) -> dict[str, Any]:
    """A constructor's arguments from its ``locals()`` taken on its first line (without ``self``)."""
    return {k: v for k, v in local.items() if k not in ("self", "__class__")}


class Objective(pl.LightningModule):
    """A LightningModule with a scalar quality metric.

    Subclasses set ``metric_name`` and ``higher_is_better`` and implement ``metric()`` (the metric
    at the current parameters, computed exactly or on a held-out set). ``rollout_staleness`` is
    True for objectives that produce their own stale data (stale-rollout mode: the bandit); the
    runner then passes the staleness to the module instead of attaching a StalenessSimulator.
    The metric is logged as ``eval/<metric_name>`` every ``eval_every`` optimizer steps.
    """

    metric_name = "metric"
    higher_is_better = False
    rollout_staleness = False
    accelerator = "cpu"  # a bench cell's Trainer accelerator: "cpu", "auto", "gpu" (gacbench.trainer.pick_accelerator)
    #: the methods that evaluate rather than train: a bench cell counts their seconds as its ``eval`` part
    timed_evals: tuple[str, ...] = ("metric",)

    def __init__(self, eval_every: int = 10) -> None:
        super().__init__()
        check_range(type(self).__name__, "eval_every", eval_every, 1, integer=True)
        self.eval_every = eval_every

    @classmethod
    def check_settings(cls, params: Mapping[str, Any]) -> None:
        """Raise ValueError (:class:`SettingError` where one key is at fault), naming the key, the value and what is
        accepted, for any of the constructor arguments ``params`` that the constructor would refuse; keys this
        objective does not know are left to the caller. Cheap (no data, model or engine is built): the bench runner
        calls it for every task before running any cell, and each constructor calls its own class's, so the two
        cannot disagree. Here: every number finite, ``seed`` an integer in [0, :data:`SEED_MAX`], ``lr`` > 0,
        ``steps`` and ``eval_every`` >= 1, ``optimizer`` one of :data:`OPTIMIZERS`; subclasses add their own checks
        after ``super().check_settings(params)``."""
        owner = cls.__name__
        check_finite(owner, params)
        if "seed" in params:
            check_range(owner, "seed", params["seed"], 0, SEED_MAX, integer=True,
                        why="it seeds torch's generator, and a bench cell's seed_everything, which takes 0..2**32 - 1")
        for key in ("steps", "eval_every"):
            if key in params:
                check_range(owner, key, params[key], 1, integer=True)
        if "lr" in params:
            check_range(owner, "lr", params["lr"], 0, lo_open=True, why="the learning rate")
        if "optimizer" in params:
            check_name(owner, "optimizer", params["optimizer"], OPTIMIZERS, "an optimizer of the objectives")

    def on_train_start(self) -> None:
        """A rollout objective (``rollout_staleness``) refuses gradient accumulation: its stale-rollout queue
        advances once per batch while the policy version advances once per optimizer step, so k batches a step
        would train at about s / k staleness, each batch of a step on the same rollouts. A subclass that defines
        its own ``on_train_start`` calls this one first."""
        k = self.trainer.accumulate_grad_batches
        if self.rollout_staleness and k != 1:
            raise ValueError(f"{type(self).__name__}: accumulate_grad_batches={k} must be 1 (the stale-rollout queue "
                             "advances once per batch and the policy version once per optimizer step); make each "
                             "step's batch larger instead")

    @classmethod
    def check_inputs(cls, params: Mapping[str, Any]) -> None:
        """Read the inputs that the settings ``params`` name (a dataset file) and raise ValueError naming the
        first one that the constructor could not use. Called by the bench runner once per distinct input, after
        :meth:`check_settings` and before any cell runs, so that a malformed file stops the grid, not each of its
        cells. Nothing to read here; an objective that reads files overrides it."""

    @torch.no_grad()
    def metric(self) -> float:
        raise NotImplementedError

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.evaluate_metric()

    def evaluate_metric(self, last: int | None = None) -> None:
        """``eval/<metric_name>`` when due at the trainer's step: every ``eval_every`` steps and at the last
        (``last``, default the trainer's ``max_steps``)."""
        step = self.trainer.global_step
        if step % self.eval_every == 0 or step == (self.trainer.max_steps if last is None else last):
            value = self.metric()
            self._last_eval = ((step, self._parameters_state()), value)
            self.log_scalars({f"eval/{self.metric_name}": value})

    def final_metric(self) -> float:
        """:meth:`metric` of the parameters as they are now: the fit's last evaluation when it was made at the
        trainer's current step and no parameter or buffer has been replaced or changed in place since (the run's
        last step is evaluated in the fit; a run stopped early was not), else a new one. The step comes first: a
        fused optimizer may write the parameters without advancing their version counters."""
        last = getattr(self, "_last_eval", None)
        if last is not None and self._trainer is not None and last[0] == (self.trainer.global_step,
                                                                           self._parameters_state()):
            return last[1]
        return self.metric()

    def _parameters_state(self) -> tuple:
        """Each parameter's and buffer's storage and in-place version counter: equal only while none was replaced
        or written in place (a BatchNorm's running statistics are buffers)."""
        return tuple((t.data_ptr(), t._version) for t in (*self.parameters(), *self.buffers()))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """A rollout objective's stale-rollout queue (``self.queue``) goes into the checkpoint with the run. Across
        processes (DDP) each rank's queue holds its own rollouts, while Lightning writes the checkpoint from rank 0:
        every rank's queue is gathered into it (one collective; every rank runs this hook) and each rank takes its
        own back on resume."""
        queue = getattr(self, "queue", None)
        if queue is None:
            return
        state = queue.state_dict()
        world = self.trainer.world_size
        if world > 1:
            from lightning.fabric.utilities.apply_func import move_data_to_device

            states: list[Any] = [None] * world
            torch.distributed.all_gather_object(states, move_data_to_device(state, "cpu"))
            state = {"by_rank": states}
        checkpoint["rollout_queue"] = state

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        queue = getattr(self, "queue", None)
        if queue is None:
            return
        state = checkpoint["rollout_queue"]
        if self._trainer is None:  # load_from_checkpoint: no run to resume
            if "by_rank" in state:
                warnings.warn(f"{type(self).__name__}: the checkpoint's rollout queues are those of "
                              f"{len(state['by_rank'])} processes and this module has no trainer: the queue is left "
                              "empty; trainer.fit(..., ckpt_path=...) on as many devices restores each rank's")
                return
            queue.load_state_dict(state)
            return
        world, rank = self.trainer.world_size, self.trainer.global_rank
        problem = queue_world_problem(state, world)
        if problem is not None:
            raise ValueError(problem)
        if "by_rank" in state:
            from lightning.fabric.utilities.apply_func import move_data_to_device

            state = move_data_to_device(state["by_rank"][rank], self.device)
        queue.load_state_dict(state)

    def log_scalars(self, metrics: dict) -> None:
        """Scalars to ``trainer.callback_metrics`` and the loggers (gacbench.callbacks._common.log_metrics says how)."""
        from gacbench.callbacks._common import log_metrics

        log_metrics(self.trainer, metrics)

    # Defaults for objectives whose data are pre-drawn batches (``self.batches``), whose loss is the
    # side-effect-free ``loss_on(batch)``, and whose hyperparameters name ``optimizer`` and ``lr``.
    def loss_on(self, batch) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no side-effect-free loss_on(batch) (its training_step "
                                  "moves state), so AssumptionMonitor cannot estimate on it")

    def training_step(self, batch, batch_idx):
        return self.loss_on(batch)

    def train_dataloader(self):
        return step_loader(self.batches)

    def configure_optimizers(self):
        return make_optimizer(self.parameters(), self.hparams.optimizer, self.hparams.lr)

    def diverged(self, initial: float, final: float) -> bool:
        """Non-finite parameters or metric; for loss-like metrics also a metric 10x worse than at the start."""
        if not math.isfinite(final) or not all(torch.isfinite(p).all() for p in self.parameters()):
            return True
        return (not self.higher_is_better) and final > 10.0 * max(initial, 1e-12)


def make_optimizer(params, name: str, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """``name`` (one of :data:`OPTIMIZERS`) over ``params``."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer={name!r} is not 'sgd' or 'adamw'")


class StepBatches(torch.utils.data.Dataset):
    """Batch i is a pre-drawn tensor slice: no collation or sampling cost per step."""

    def __init__(self, *tensors: torch.Tensor, batch_size: int, steps: int, generator: torch.Generator) -> None:
        n = tensors[0].shape[0]
        self.tensors = tensors
        self.index = torch.randint(0, n, (steps, batch_size), generator=generator)

    def __len__(self) -> int:
        return self.index.shape[0]

    def __getitem__(self, i: int):
        idx = self.index[i]
        return tuple(t[idx] for t in self.tensors)


def step_loader(dataset: torch.utils.data.Dataset) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset, batch_size=None, shuffle=False)
