"""Objectives by name: each package registers its own, the bench runner looks them up.

``register_objective(name, target)`` takes a class or a ``"module:attr"`` string. A string is
imported on the first :func:`objective_class` call for that name, so registering an objective whose
module needs heavy dependencies (the GRPO module needs transformers) costs no import. The synthetic
objectives register in :mod:`gacbench.objectives`; the LLM side registers ``grpo`` in
:mod:`gacbench.llm` (importing ``gacbench.llm`` is enough).
"""

from __future__ import annotations

import importlib
from typing import Union

Target = Union[type, str]

_TARGETS: dict[str, Target] = {}
_RESOLVED: dict[str, type] = {}


def _describe(target: Target) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def register_objective(name: str, target: Target, *, replace: bool = False) -> None:
    """Make ``target`` (an ``Objective`` subclass, or ``"package.module:ClassName"``) available as ``name``.

    Registering the same target twice is a no-op; registering another target under a taken name is
    refused unless ``replace=True``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"objective name {name!r} must be a non-empty string")
    if isinstance(target, str):
        module, sep, attr = target.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"objective {name!r}: target {target!r} is not of the form 'package.module:ClassName'")
    elif not isinstance(target, type):
        raise TypeError(f"objective {name!r}: target must be a class or a 'package.module:ClassName' string, "
                        f"not {type(target).__name__}")
    old = _TARGETS.get(name)
    if old is not None and not replace and _describe(old) != _describe(target):
        raise ValueError(f"objective {name!r} is already registered as {_describe(old)}; pick another name, or pass "
                         "replace=True to register_objective to replace it")
    _TARGETS[name] = target
    _RESOLVED.pop(name, None)
    if isinstance(target, type):
        _RESOLVED[name] = _checked(name, target)


def registered_objectives() -> list[str]:
    """The registered names, sorted (resolves nothing)."""
    return sorted(_TARGETS)


def is_registered(name: str) -> bool:
    return name in _TARGETS


def objective_class(name: str) -> type:
    """The class registered as ``name``, importing its module on first use."""
    if name in _RESOLVED:
        return _RESOLVED[name]
    if name not in _TARGETS:
        known = ", ".join(registered_objectives()) or "none"
        hint = "" if "grpo" in _TARGETS else " (the LLM objective 'grpo' registers when gacbench.llm is imported)"
        raise ValueError(f"unknown objective {name!r}; known objectives: {known}{hint}")
    target = _TARGETS[name]
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"objective {name!r} is registered as {target!r}, whose module could not be imported: "
                          f"{exc}") from exc
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ImportError(f"objective {name!r} is registered as {target!r}, but {module_name} has no attribute "
                          f"{attr!r}") from None
    _RESOLVED[name] = _checked(name, obj)
    return _RESOLVED[name]


def _checked(name: str, cls: object) -> type:
    from gacbench.objectives.base import Objective

    if not (isinstance(cls, type) and issubclass(cls, Objective)):
        raise TypeError(f"objective {name!r}: {cls!r} is not a subclass of gacbench.objectives.base.Objective")
    return cls


__all__ = ["is_registered", "objective_class", "register_objective", "registered_objectives"]
