"""GAC's settings, their defaults and their validation, in one place.

The Lightning callback :class:`gacbench.GAC`, the optimizer hook :func:`gacbench.attach_gac` and the TRL callback
:class:`gacbench.integrations.trl.GACCallback` all build one :class:`GACSettings` from what they are given, so the
three take the same defaults and accept or refuse the same values with the same one-line message (the hook and the
TRL callback raise it as a :class:`gacbench.usage.UsageError`, which is a ``ValueError``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from gacbench.functional.alignment import HIGH_MODES, SHRINK_MODES, plain_number, validate_thresholds
from gacbench.functional.gac import KERNEL_CHOICES, REFERENCES, GACTransform, check_choice, parse_dtype

ON_BAD_GRAD = ("skip", "raise")
ON_ZERO_GRAD = ("pass",) + ON_BAD_GRAD


@dataclass(frozen=True)
class GACSettings:
    """The settings of GAC on the gradient (see :class:`gacbench.GAC` for what each does), checked when made:
    a bad value raises ``ValueError`` naming the setting, the value and what it may be. A number may be given as
    any real number (a numpy scalar, a 0-d tensor); it is stored as a Python float (``warmup``: int), so that
    ``as_dict()`` and every state saved from it hold Python values only."""

    c_low: float = 0.05
    c_high: float = 0.3
    high_mode: str = "project"
    reference: str = "grad"
    ema_decay: float = 0.9
    shrink: str = "component"
    buffer_dtype: str | torch.dtype | None = None
    on_bad_grad: str = "skip"
    on_zero_grad: str = "pass"
    warmup: int = 50
    tol: float = 0.05
    kernels: str = "auto"

    def __post_init__(self) -> None:
        c_low, c_high = validate_thresholds(self.c_low, self.c_high)
        check_choice("GAC", "high_mode", self.high_mode, HIGH_MODES)
        check_choice("GAC", "reference", self.reference, REFERENCES)
        ema_decay = _number(self.ema_decay)
        if not (ema_decay is not None and 0.0 <= ema_decay < 1.0):
            raise ValueError(f"GAC: ema_decay={self.ema_decay!r} must be in [0, 1)")
        check_choice("GAC", "shrink", self.shrink, SHRINK_MODES)
        parse_dtype("GAC", self.buffer_dtype)
        check_choice("GAC", "on_bad_grad", self.on_bad_grad, ON_BAD_GRAD)
        check_choice("GAC", "on_zero_grad", self.on_zero_grad, ON_ZERO_GRAD)
        warmup, tol = summary_settings("GAC", self.warmup, self.tol)
        check_choice("GAC", "kernels", self.kernels, KERNEL_CHOICES)
        for name, value in (("c_low", c_low), ("c_high", c_high), ("ema_decay", float(ema_decay)),
                            ("warmup", warmup), ("tol", float(tol))):
            object.__setattr__(self, name, value)  # the plain Python value (the dataclass is frozen)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def pick(cls, settings: dict[str, Any]) -> "GACSettings":
        """The settings among ``settings`` (other keys ignored), checked."""
        return cls(**{k: v for k, v in settings.items() if k in cls.names()})

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def transform(self) -> GACTransform:
        """The :class:`GACTransform` these settings describe."""
        return GACTransform(self.c_low, self.c_high, self.high_mode, self.reference, self.ema_decay, self.shrink,
                            self.buffer_dtype, self.kernels)


def summary_settings(who: str, warmup: Any, tol: Any) -> tuple[int, float]:
    """The alignment summary's ``warmup`` (a non-negative integer: steps excluded from the summary) and ``tol`` (in
    (0, 1)) as plain Python numbers, for every callback and hook that keeps a c_t trace; a ``ValueError`` naming
    ``who`` and the bad value otherwise. Either may be given as any real number (a numpy scalar, a 0-d tensor)."""
    plain = plain_number(warmup)
    if not isinstance(plain, int) or plain < 0:
        raise ValueError(f"{who}: warmup={warmup!r} must be a non-negative integer (steps excluded from the summary)")
    level = _number(tol)
    if not (level is not None and 0.0 < level < 1.0):
        raise ValueError(f"{who}: tol={tol!r} must be in (0, 1); the paper uses 0.05")
    return plain, float(level)


def _number(x: Any) -> int | float | None:
    """x as a plain finite Python number (:func:`plain_number`), else None."""
    value = plain_number(x)
    return value if value is not None and math.isfinite(value) else None


DEFAULTS = GACSettings()
