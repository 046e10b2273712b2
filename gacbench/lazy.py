"""Module attributes imported on first access (PEP 562), so that importing a package does not import torch or
Lightning before a name that needs them is used."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_attributes(package: str, where: dict[str, str],
                    namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the module ``package`` whose globals are ``namespace``: a name of ``where``
    (name -> the module that defines it) is imported from its module on first access and kept in the namespace;
    any other name raises AttributeError as a module does."""

    def getattr_(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *where})

    return getattr_, dir_
