"""StalenessSimulator: bounded staleness injected into any LightningModule (delayed-gradient mode).

The update applied at optimizer step t uses the gradient evaluated at theta_{t - s_t} on
the batch drawn at step t, with 0 <= s_t <= min(s, t): the bounded-staleness model of the
asynchronous SGD literature. Mechanically, the callback keeps the last s + 1 parameter
iterates; before the first micro-batch of a step it copies theta_{t - s_t} into the
parameters, lets the forward and backward passes run there (all micro-batches of an
accumulation window), and in ``on_before_optimizer_step`` copies theta_t back, so the
optimizer applies the stale gradient to the current parameters. Module buffers (e.g.
BatchNorm statistics) are not delayed.
"""

from __future__ import annotations

import numbers
from collections import deque
from typing import Any, Sequence

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from gacbench.callbacks._common import (
    StepGuard,
    check_automatic_optimization,
    check_strategy,
    load_tensor,
    log_metrics,
    optimizer_params,
    parameter_names,
    save_tensor,
)
from gacbench.functional.buffer import FlatBuffer, check_parameters

SCHEDULES = ("fixed", "uniform", "trace")


def staleness_schedule(schedule: str, s: int, t: int, rng: np.random.Generator, trace: Sequence[int] = ()) -> int:
    """s_t for optimizer step t (0-based) under a schedule, always in 0..min(s, t).

    ``fixed``: s_t = min(s, t). ``uniform``: s_t uniform on 0..min(s, t) from ``rng``.
    ``trace``: s_t = min(trace[t mod len(trace)], t), a lag sequence recorded from a real system.
    """
    cap = min(s, t)
    if schedule == "fixed":
        return cap
    if schedule == "uniform":
        return int(rng.integers(0, cap + 1))
    return min(int(trace[t % len(trace)]), t)


class StalenessSimulator(Callback):
    """Delay every gradient by s_t optimizer steps (docs/design.md, delayed-gradient mode).

    Args:
        staleness: the bound s >= 0; 0 makes the callback the identity (it logs s_t = 0).
        schedule: ``"fixed"`` (s_t = min(s, t)), ``"uniform"`` (s_t uniform on 0..min(s, t),
            seeded), or ``"trace"`` (replay ``trace``, a list of lags each in 0..s).
        seed: seed of the ``"uniform"`` schedule; the same on every rank, and s_t is also
            broadcast from rank 0, so all DDP ranks use the same delay.
        trace: the lag sequence of ``schedule="trace"``: integers (Python or numpy), each in 0..s.

    Memory: s + 1 copies of the optimized parameters (on their device), each parameter in its own
    dtype (a model of bfloat16 and float32 parameters is restored bit for bit). List this callback
    first, before callbacks that read the parameters in ``on_before_optimizer_step``.

    Each fit starts at t = 0 (its ``setup``; a resume then loads the checkpoint's state), and a fit that ends
    inside an accumulation window leaves the model at theta_t.

    Logs ``stale/lag`` (s_t) every optimizer step into ``trainer.callback_metrics`` (and to the loggers every
    ``log_every_n_steps``). Declares ``swaps_parameters`` (True when s > 0): between
    ``on_train_batch_start`` and ``on_before_optimizer_step`` the parameters hold a stale iterate.
    """

    keeps_gradients = True  # its on_before_optimizer_step moves the parameters, never p.grad

    def __init__(
        self, staleness: int, schedule: str = "fixed", seed: int = 0, trace: Sequence[int] | None = None
    ) -> None:
        if isinstance(staleness, bool) or not isinstance(staleness, (int, np.integer)):
            raise TypeError(f"StalenessSimulator: staleness={staleness!r} must be an integer number of optimizer steps")
        if staleness < 0:
            raise ValueError(f"StalenessSimulator: staleness={staleness} must be >= 0 (0 is synchronous training)")
        if schedule not in SCHEDULES:
            choices = ", ".join(map(repr, SCHEDULES))
            raise ValueError(f"StalenessSimulator: schedule={schedule!r} is not one of {choices}")
        trace = [] if trace is None else list(trace)
        if schedule == "trace":
            if not trace:
                raise ValueError("StalenessSimulator: schedule='trace' needs trace=[s_0, s_1, ...]")
            for i, v in enumerate(trace):  # numpy's integers are Integral; bool (and numpy's bool) are refused
                if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                    raise TypeError(f"StalenessSimulator: trace[{i}]={v!r} must be an integer number of optimizer "
                                    f"steps in 0..staleness={staleness}")
            trace = [int(v) for v in trace]
            bad = [v for v in trace if not 0 <= v <= staleness]
            if bad:
                raise ValueError(f"StalenessSimulator: trace values {bad[:5]} are outside 0..staleness={staleness}")
        elif trace:
            raise ValueError(f"StalenessSimulator: trace is only used with schedule='trace', not {schedule!r}")
        self.staleness, self.schedule, self.seed, self.trace = int(staleness), schedule, int(seed), trace
        self.step = 0  # optimizer steps taken under this callback (t)
        self.lag = 0  # s_t of the current step
        self._rng = np.random.default_rng(seed)
        self._history: deque[FlatBuffer] = deque(maxlen=self.staleness + 1)  # theta_{t-k}, newest last
        self._params: list[torch.nn.Parameter] = []
        self._swapped = False
        self._was_swapped = False
        self._in_window = False  # s_t has been drawn for the current optimizer step
        self._newest = -1  # the step t whose iterate is the newest in the history
        self._pending: list[torch.Tensor] | None = None
        self._guard = StepGuard("StalenessSimulator")

    @property
    @override
    def state_key(self) -> str:
        return type(self).__qualname__  # one simulator per trainer; a changed staleness is caught on load

    @property
    def swaps_parameters(self) -> bool:
        """The capability callbacks that must see theta_t look for (AssumptionMonitor): s_t > 0 is possible."""
        return self.staleness > 0

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        self._reset()  # a new fit starts at t = 0; a resume's state is loaded after setup
        if self.staleness == 0:
            return
        check_automatic_optimization(pl_module, "StalenessSimulator")
        check_strategy(trainer, "StalenessSimulator", allow_sharded=False)

    def _reset(self) -> None:
        """The state of a fit that has not started: t = 0, no iterates kept, the schedule's generator reseeded."""
        self.step, self.lag = 0, 0
        self._rng = np.random.default_rng(self.seed)
        self._history.clear()
        self._swapped = self._was_swapped = self._in_window = False
        self._newest = -1
        self._pending = None

    # A fit can end inside an accumulation window (trainer.should_stop set by a callback such as Lightning's
    # Timer, or an exception): the model is left at theta_t, not at the stale iterate.
    @override
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._end_window()

    @override
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._end_window()

    def _end_window(self) -> None:
        self._restore()
        self._in_window = False

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        if self.staleness:
            self._params = optimizer_params(trainer, "StalenessSimulator")  # fixed for the fit
            self._guard.start(trainer)
            check_parameters(self._params, "StalenessSimulator", parameter_names(pl_module, self._params),
                             complex_ok=True)

    @override
    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        if self._in_window:
            return  # later micro-batches of a window reuse the first one's s_t and iterate
        self._in_window = True
        if self.staleness == 0:  # the identity: s_t = 0
            log_metrics(trainer, {"stale/lag": 0.0})
            return
        self._record_current()
        lag = staleness_schedule(self.schedule, self.staleness, self.step, self._rng, self.trace)
        lag = min(self._broadcast(trainer, lag), len(self._history) - 1)
        self.lag = lag
        if lag > 0:
            self._history[-1 - lag].copy_to(self._params)
            self._swapped = True
        log_metrics(trainer, {"stale/lag": float(lag)})

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._in_window = False
        if self.staleness == 0:
            return
        self._guard.check(trainer, optimizer)
        self._restore()
        self.step += 1

    # Validation or a checkpoint can fall inside an accumulation window: both see theta_t.
    @override
    def on_validation_start(self, trainer, pl_module) -> None:
        self._was_swapped = self._swapped
        self._restore()

    @override
    def on_validation_end(self, trainer, pl_module) -> None:
        if self._was_swapped:
            self._history[-1 - self.lag].copy_to(self._params)
            self._swapped = True

    def _restore(self) -> None:
        if self._swapped:
            self._history[-1].copy_to(self._params)
            self._swapped = False

    def _record_current(self) -> None:
        """Append theta_t to the history (once per optimizer step), reusing the oldest buffer."""
        tensors = [p.detach() for p in self._params]
        if self._pending is not None:  # resuming: the saved iterates, oldest first
            for saved in self._pending:
                buf = FlatBuffer.like(tensors)
                buf.load_(saved)
                self._history.append(buf)
            self._pending = None
        if self._newest == self.step:
            return
        if len(self._history) == self._history.maxlen:
            buf = self._history.popleft()
        else:
            buf = FlatBuffer.like(tensors)
        buf.copy_from(tensors)
        self._history.append(buf)
        self._newest = self.step

    @staticmethod
    def _broadcast(trainer: "pl.Trainer", lag: int) -> int:
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            t = torch.tensor([lag], dtype=torch.int64, device=trainer.strategy.root_device)
            dist.broadcast(t, src=0)
            return int(t.item())
        return lag

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "newest": self._newest, "rng": self._rng.bit_generator.state,
                **self._settings()}

    def _settings(self) -> dict[str, Any]:
        """What decides the lags, which a resume must share: the seed under ``uniform`` (the saved random state
        replaces it) and the trace under ``trace``."""
        out: dict[str, Any] = {"staleness": self.staleness, "schedule": self.schedule}
        if self.schedule == "uniform":
            out["seed"] = self.seed
        if self.schedule == "trace":
            out["trace"] = [int(v) for v in self.trace]
        return out

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, mine in self._settings().items():
            if key in state_dict and state_dict[key] != mine:  # a key the state lacks is not checked
                saved = state_dict[key]
                raise ValueError(f"StalenessSimulator: the checkpoint was written with {key}={saved!r}, not "
                                 f"{mine!r}; resume with StalenessSimulator({key}={saved!r}) and the checkpoint's "
                                 "other settings, or start a new run")
        self.step, self._newest = state_dict["step"], state_dict["newest"]
        self._rng.bit_generator.state = state_dict["rng"]

    @override
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        if self._swapped:  # mid-window: the model weights in the checkpoint must be theta_t
            raise RuntimeError(
                "StalenessSimulator: a checkpoint was requested inside an accumulation window; "
                "save checkpoints at optimizer-step boundaries (ModelCheckpoint(every_n_train_steps=...))."
            )
        if self._history:
            save_tensor(checkpoint, self.state_key, [b.flat() for b in self._history])

    @override
    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        saved = load_tensor(checkpoint, self.state_key)
        self._history.clear()
        self._pending = list(saved) if saved else None
