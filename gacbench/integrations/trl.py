"""GAC and the alignment monitor in a Hugging Face ``Trainer`` (TRL's ``GRPOTrainer`` included).

``GACCallback(**settings)`` is a ``transformers.TrainerCallback``: when training begins it attaches
:func:`gacbench.attach_gac` (and, unless GAC already measures c_t against the previous raw gradient,
:func:`gacbench.attach_alignment_monitor` before it) to the trainer's optimizer, and at every log it adds
``align/cos``, ``grad/norm`` and GAC's metrics of the last optimizer step to the logs, so that they appear in
``trainer.state.log_history`` and in the reporting integrations listed after it.

The Trainer calls ``optimizer.step()`` without a closure, after its gradient clipping (``max_grad_norm``)
and, under fp16, after the GradScaler's unscale: GAC sees the clipped, unscaled gradient, GAC(clip(g)), where
the Lightning callback acts before Lightning's clipping, clip(GAC(g)) (the same c_t under global-norm clipping
for the references "grad" and "applied"; docs/integrations.md).

At each checkpoint the callback writes the hooks' state (GAC's reference, counters and c_t trace) into the
checkpoint folder the Trainer has just written (``STATE_FILE``, one file per process when there are several);
a Trainer resumed from that checkpoint continues GAC where it stopped.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from gacbench.functional.alignment import ACTION_NAMES, plain_number
from gacbench.functional.settings import GACSettings
from gacbench.hooks import (
    AlignmentMonitorHook,
    GACHook,
    attach_alignment_monitor,
    attach_gac,
    attached_gac,
    check_gac_settings,
)
from gacbench.usage import UsageError

# ``gac/action`` is logged as a number: 0 keep, 1 shrink, 2 project, 3 skip
ACTION_CODES = {name: float(code) for code, name in ACTION_NAMES.items()}

#: the hooks' state in a checkpoint folder (``gacbench_gac_rank{i}.pt`` per process when there are several)
STATE_FILE = "gacbench_gac.pt"


def state_file(args: Any) -> str:
    """The name of this process's GAC state file in a checkpoint folder."""
    if getattr(args, "world_size", 1) > 1:
        return f"gacbench_gac_rank{args.process_index}.pt"
    return STATE_FILE


def checkpoint_folder(args: Any, step: int) -> str:
    """The folder the Trainer writes its checkpoint of ``step`` to (outside a hyperparameter search)."""
    return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")


def _plain_setting(name: str, value: Any) -> Any:
    """``steps`` and ``distributed`` (checked by attach_gac) as Python values."""
    if value is None:
        return None
    return bool(value) if name == "distributed" else plain_number(value)


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside the wrappers a Trainer puts around it (accelerate's AcceleratedOptimizer)."""
    while not type(optimizer).__module__.startswith("torch.") and isinstance(
            getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(f"GACCallback: the trainer's optimizer is a {type(optimizer).__name__}, not a "
                         "torch.optim.Optimizer (or a wrapper of one with an .optimizer attribute); GAC cannot "
                         "hook its step")
    return optimizer


class GACCallback(TrainerCallback):
    """Gradient Alignment Control for a ``transformers.Trainer`` / ``trl.GRPOTrainer``.

    Args: the settings of :class:`gacbench.GAC` (``c_low``, ``c_high``, ``high_mode``, ``reference``, ...),
    checked here. After training, ``summary`` holds the Table 3 statistics of the c_t trace; ``gac`` and
    ``monitor`` are the attached hooks (``monitor`` is None when ``reference="grad"``: GAC logs c_t itself).

    Each log adds the values of the last optimizer step (not an average over ``logging_steps``):
    ``align/cos`` (c_t), ``grad/norm``, ``align/ref_cos`` (other references), ``align/proj_frac``,
    ``align/skip``, ``gac/coef`` and ``gac/action`` (0 keep, 1 shrink, 2 project, 3 skip).

    Checkpoints: each save writes :data:`STATE_FILE` into ``output_dir/checkpoint-<step>``; a resumed
    ``train()`` reads it from ``args.resume_from_checkpoint`` when that names a folder, else from
    ``output_dir/checkpoint-<step>`` (where ``resume_from_checkpoint=True`` resumes), and warns when neither
    holds it (GAC then starts without a reference). A file written with other settings or at another step is
    refused.
    """

    def __init__(self, **settings: Any) -> None:
        check_gac_settings(settings)
        self.config = GACSettings.pick(settings)  # the defaults and checks of GAC and attach_gac
        # the settings as Python values (a numpy scalar or 0-d tensor as its float or int, as GACSettings stores
        # it): the state file each checkpoint holds them in must load with torch.load(weights_only=True)
        self.settings = {k: getattr(self.config, k) if k in GACSettings.names() else _plain_setting(k, v)
                         for k, v in settings.items()}
        self.gac: GACHook | None = None
        self.monitor: AlignmentMonitorHook | None = None
        self.summary: dict[str, float] = {}
        self._logged_step = -1

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs) -> None:
        if optimizer is None:
            raise UsageError("GACCallback: the trainer has no optimizer at on_train_begin; pass the callback to a "
                             "transformers Trainer (callbacks=[GACCallback(...)]) that creates its optimizer")
        opt = inner_optimizer(optimizer)
        self._detach()
        self._logged_step = -1
        first = attached_gac(opt)
        if first is not None:  # another GACCallback (or attach_gac) on this trainer's optimizer
            raise UsageError(f"GACCallback: the trainer's optimizer already has GAC, attached by {first}; two would "
                             "apply GAC twice per step. Pass one GACCallback in callbacks=[...]")
        if self.config.reference != "grad":  # the monitor first: it sees the raw gradient
            self.monitor = attach_alignment_monitor(opt, warmup=self.config.warmup, tol=self.config.tol)
        self.gac = attach_gac(opt, **self.settings)
        self.gac.origin = f"GACCallback({', '.join(f'{k}={v!r}' for k, v in self.settings.items())}) at {id(self):#x}"
        if state.global_step > 0:  # the Trainer resumed from a checkpoint
            self._resume(args, state.global_step)

    def on_save(self, args, state, control, **kwargs) -> None:
        if self.gac is None:
            return
        folder = checkpoint_folder(args, state.global_step)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, state_file(args))
        saved = {"global_step": state.global_step, "settings": dict(self.settings), "gac": self.gac.state_dict(),
                 "monitor": None if self.monitor is None else self.monitor.state_dict()}
        torch.save(saved, path + ".tmp")
        os.replace(path + ".tmp", path)  # a checkpoint holds the whole file or none

    def _resume(self, args, step: int) -> None:
        name = state_file(args)
        folders = [checkpoint_folder(args, step)]
        given = getattr(args, "resume_from_checkpoint", None)
        if isinstance(given, str) and os.path.isdir(given):
            folders.insert(0, given)
        path = next((os.path.join(f, name) for f in folders if os.path.isfile(os.path.join(f, name))), None)
        if path is None:
            warnings.warn(f"GACCallback: training resumes at step {step}, but {' or '.join(folders)} holds no {name} "
                          "(written by GACCallback at each checkpoint): GAC starts without a reference, so its first "
                          "step is kept and its c_t trace restarts. To continue GAC exactly, resume from a "
                          "checkpoint written with GACCallback, named in TrainingArguments(resume_from_checkpoint=...) "
                          "when it is outside output_dir", stacklevel=2)
            return
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved.get("global_step") != step:
            raise UsageError(f"GACCallback: {path} holds GAC's state at step {saved.get('global_step')}, but training "
                             f"resumes at step {step}; resume from the checkpoint that file belongs to")
        if not isinstance(saved.get("settings"), dict) or GACSettings.pick(saved["settings"]) != self.config:
            raise UsageError(f"GACCallback: {path} was written with the settings {saved.get('settings')}, and this "
                             f"callback has {self.settings}; resume with the same settings (or start a new run)")
        self.gac.load_state_dict(saved["gac"])
        if self.monitor is not None and saved.get("monitor") is not None:
            self.monitor.load_state_dict(saved["monitor"])

    def metrics(self) -> dict[str, float]:
        """The last optimizer step's values, as they are added to the logs."""
        out: dict[str, float] = {}
        if self.monitor is not None:
            out.update(self.monitor.metrics)
        if self.gac is not None:
            out.update(self.gac.metrics)
            if self.gac.action:
                out["gac/action"] = ACTION_CODES[self.gac.action]
        return out

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if logs is None or self.gac is None or state.global_step == self._logged_step:
            return  # an evaluation or end-of-training log at a step already logged: nothing new to add
        self._logged_step = state.global_step
        extra = self.metrics()
        logs.update(extra)
        # the Trainer appended a copy of these logs to log_history just before calling on_log
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)

    def on_train_end(self, args, state, control, **kwargs) -> None:
        source = self.monitor if self.monitor is not None else self.gac
        if source is not None:
            self.summary = source.summary()
        self._detach()

    def _detach(self) -> None:
        for hook in (self.monitor, self.gac):
            if hook is not None:
                hook.remove()
        # the hooks' metrics and state stay readable after training; a new train() attaches fresh ones
