"""The ``lightning.Trainer`` every gacbench run uses, built in one place.

A benchmark cell (:mod:`gacbench.bench.cell`) and ``gacbench grpo`` build their Trainer with
:func:`build_trainer`, so they share the same defaults: one device, every step logged, no progress
bar, no model summary, no sanity validation, no checkpoints. Any Trainer argument passed to
:func:`build_trainer` overrides the default of the same name.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import lightning.pytorch as pl
import torch

#: The Trainer arguments of a gacbench run besides ``max_steps``, ``callbacks``, ``logger`` and ``accelerator``.
TRAINER_DEFAULTS = MappingProxyType({
    "devices": 1,
    "log_every_n_steps": 1,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "enable_checkpointing": False,
})

_GPU_NAMES = ("gpu", "cuda")


def pick_accelerator(preference: str = "auto") -> str:
    """The Lightning accelerator for a preference.

    ``"auto"``: ``"gpu"`` when ``torch.cuda.is_available()``, else ``"cpu"``. ``"gpu"`` / ``"cuda"``:
    ``"gpu"``, and a ValueError when no CUDA device is visible. Any other name (``"cpu"``, ``"mps"``,
    ...) is returned unchanged for Lightning to interpret.
    """
    if not isinstance(preference, str) or not preference:
        raise ValueError(f"accelerator {preference!r}: expected 'auto', 'cpu', 'gpu' or another Lightning "
                         "accelerator name")
    name = preference.lower()
    if name == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    if name in _GPU_NAMES:
        if not torch.cuda.is_available():
            raise ValueError(f"accelerator {preference!r} asks for a GPU but torch.cuda.is_available() is False "
                             "(no CUDA device visible, or a CPU-only torch build); use accelerator 'auto' or 'cpu'")
        return "gpu"
    return name


def trainer_kwargs(max_steps: int, callbacks: list, logger: Any, accelerator: str = "auto",
                   **overrides: Any) -> dict[str, Any]:
    """The keyword arguments :func:`build_trainer` passes to ``lightning.Trainer``.

    Checkpointing is on when asked for (``enable_checkpointing=True``) or when ``callbacks`` holds a
    ``ModelCheckpoint``; the progress bar likewise (``enable_progress_bar=True`` or a progress-bar
    callback). ``overrides`` win over every default.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar

    callbacks = list(callbacks or [])
    kwargs: dict[str, Any] = {**TRAINER_DEFAULTS, "max_steps": max_steps, "callbacks": callbacks, "logger": logger,
                              "accelerator": pick_accelerator(accelerator)}
    if any(isinstance(c, ModelCheckpoint) for c in callbacks):
        kwargs["enable_checkpointing"] = True
    if any(isinstance(c, ProgressBar) for c in callbacks):
        kwargs["enable_progress_bar"] = True
    kwargs.update(overrides)
    return kwargs


def build_trainer(max_steps: int, callbacks: list, logger: Any, accelerator: str = "auto",
                  **overrides: Any) -> pl.Trainer:
    """A ``lightning.Trainer`` with gacbench's defaults (:data:`TRAINER_DEFAULTS`).

    ``accelerator`` goes through :func:`pick_accelerator` (``"auto"``: the GPU when CUDA is available,
    else the CPU); ``logger`` is any Lightning logger, a list of them, or ``False``; ``overrides`` are
    further Trainer arguments and replace the defaults of the same name (e.g. ``devices=2``,
    ``enable_checkpointing=True``, ``precision="bf16-mixed"``).
    """
    return pl.Trainer(**trainer_kwargs(max_steps, callbacks, logger, accelerator, **overrides))


__all__ = ["TRAINER_DEFAULTS", "build_trainer", "pick_accelerator", "trainer_kwargs"]
