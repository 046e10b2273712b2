"""Stabilizers by name: the built-ins plus every class that an installed package declares in the
entry-point group ``gacbench.stabilizers`` (``name = "package.module:Class"`` in its pyproject).

A plug-in whose entry point cannot be loaded (its module raises on import, or lacks the class) is left
out with one warning naming it, its module and the error; the built-ins and the other plug-ins stay
available."""

from __future__ import annotations

import re
import sys
import warnings
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

from gacbench.usage import UsageError

ENTRY_POINT_GROUP = "gacbench.stabilizers"
KINDS = ("gradient", "loss")
NAME_PATTERN = "[A-Za-z0-9_-]+"  # what a method spec reads as one name (no "+", which joins two; gacbench.methods)

# entry point (name, value) -> the error it raised on load; each is warned about once per process
_BROKEN: dict[tuple[str, str], str] = {}
# (entry_points, sys.path) -> the registry read with them (available)
_READ: dict[tuple[Any, tuple[str, ...]], dict[str, dict[str, Any]]] = {}


def _builtins() -> dict[str, type]:
    from gacbench.callbacks.gac import GAC
    from gacbench.stabilizers.a3po import A3PO
    from gacbench.stabilizers.bapo import BAPO
    from gacbench.stabilizers.importance import TIS, DecoupledPPO
    from gacbench.stabilizers.lr_scaled import StalenessLR
    from gacbench.stabilizers.m2po import M2PO, M2POThreshold
    from gacbench.stabilizers.ppo import CISPO, GSPO, DualClipPPO
    from gacbench.stabilizers.rollout_correction import MIS, IcePop, TISEngine
    from gacbench.stabilizers.seqmask import OPSM, GeoSeqMask
    from gacbench.stabilizers.vcpo import VCPO
    from gacbench.stabilizers.vespo import VESPO

    return {"gac": GAC, "m2po": M2PO, "bapo": BAPO, "tis": TIS, "decoupled-ppo": DecoupledPPO, "dual-clip": DualClipPPO,
            "gspo": GSPO, "cispo": CISPO, "tis-engine": TISEngine, "mis": MIS, "icepop": IcePop, "vcpo": VCPO,
            "m2po-threshold": M2POThreshold, "lr-scaled": StalenessLR,
            "opsm": OPSM, "geo-seq-mask": GeoSeqMask, "vespo": VESPO, "a3po": A3PO}


def available() -> dict[str, dict[str, Any]]:
    """name -> {"cls", "kind", "source", "package", "help", "on_policy_identity"} (the class's declaration with its
    default settings, False where the class declares nothing: :class:`gacbench.stabilizers.base.Stabilizer`); a
    name declared twice (a plug-in with a built-in's
    name, or two plug-ins with one name) is a UsageError naming both packages.

    The installed packages' entry points are read once per process and module search path (a read costs
    milliseconds, and a grid parses its methods hundreds of times): a package installed into a running process
    is seen after ``sys.path`` changes, or in the next process. Each call returns its own dicts."""
    key = (entry_points, tuple(sys.path))  # entry_points too: a test may replace it
    if key not in _READ:
        _READ[key] = _read()
    return {name: dict(info) for name, info in _READ[key].items()}


def _read() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for name, cls in _builtins().items():
        found[name] = {"cls": cls, "source": "gacbench", "package": "gacbench (built in)"}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found:
            first = found[ep.name]
            raise UsageError(f"stabilizer {ep.name!r} is declared twice (entry point group {ENTRY_POINT_GROUP}): by "
                             f"{first['package']} ({first['source']}) and by {_package(ep)} ({ep.value}); uninstall "
                             "one of the two packages, or rename the entry point in one package's pyproject.toml")
        if not re.fullmatch(NAME_PATTERN, ep.name):
            _leave_out(ep, f"its entry-point name must match {NAME_PATTERN} to be a method name")
            continue
        cls = _load(ep)
        if cls is not None and getattr(cls, "kind", None) not in KINDS:  # as a plug-in that fails to load
            _leave_out(ep, f"its class needs kind = 'gradient' or 'loss', got {getattr(cls, 'kind', None)!r}")
            cls = None
        if cls is not None:
            dist = getattr(ep, "dist", None)
            found[ep.name] = {"cls": cls, "source": ep.value, "package": _package(ep), "dist": dist,
                              "distribution": getattr(dist, "name", None), "version": getattr(dist, "version", None)}
    for name, info in found.items():
        kind = getattr(info["cls"], "kind", None)
        if kind not in KINDS:
            raise TypeError(f"stabilizer {name!r} ({info['source']}): its class needs kind = 'gradient' or 'loss', "
                            f"got {kind!r}")
        info["kind"] = kind
        info["on_policy_identity"] = getattr(info["cls"], "on_policy_identity", False) is True
        doc = " ".join((info["cls"].__doc__ or "").split())
        info["help"] = doc.split(". ")[0].rstrip(".") + "." if doc else ""
    return found


def _package(ep: EntryPoint) -> str:
    """The distribution that declares ``ep`` (``package 'NAME'``), or its module when that is not known."""
    dist = getattr(getattr(ep, "dist", None), "name", None)
    return f"package {dist!r}" if dist else f"module {ep.module!r}"


def _load(ep: EntryPoint) -> type | None:
    """The class an entry point names, or None (warned once) when loading it raises."""
    try:
        return ep.load()
    except Exception as exc:  # noqa: BLE001  (whatever a third-party module raises on import)
        _leave_out(ep, f"{type(exc).__name__}: {exc}")
        return None


def _leave_out(ep: EntryPoint, error: str) -> None:
    """Record a plug-in that cannot be used (it failed to load, or its class declares no valid ``kind``) and warn
    once: it is left out, and every other method runs as usual."""
    key = (ep.name, ep.value)
    if key not in _BROKEN:
        _BROKEN[key] = error
        dist = getattr(getattr(ep, "dist", None), "name", None)
        package = f" of the package {dist!r}" if dist else ""
        warnings.warn(
            f"stabilizer plug-in {ep.name!r}{package} (entry point group {ENTRY_POINT_GROUP}: module "
            f"{ep.module!r}, {ep.value}) cannot be used and is left out: {error}. The built-in "
            "stabilizers and the other plug-ins are available; fix or uninstall that package to use it.",
            RuntimeWarning, stacklevel=4)


def plugin_record(info: dict[str, Any]) -> dict[str, Any]:
    """What a stored run records of a plug-in stabilizer (an :func:`available` entry not built in): its
    ``distribution`` and ``version`` (None when its entry point names no installed distribution) and ``sha256``
    over its code (:func:`gacbench.provenance.named_files_sha256`): the ``.py`` files of the top-level package that
    holds its class (every directory of a namespace package), else its module's file, and the ``.py`` files its
    distribution installed (its RECORD; an editable install records none of its sources, which the package's
    directory holds). A plug-in edited in place keeps its version; the hash tells the two codes apart."""
    from gacbench.provenance import named_files_sha256

    cls = info["cls"]
    top_name = cls.__module__.split(".")[0]
    top = sys.modules.get(top_name)
    files: dict[Path, str] = {}  # resolved path -> the name it is hashed under
    for portion in list(getattr(top, "__path__", None) or []):  # a package, regular or namespace
        root = Path(portion)
        for f in root.rglob("*.py"):
            files.setdefault(f.resolve(), f"{top_name}/{f.relative_to(root).as_posix()}")
    if not files:  # a module of its own
        module_file = getattr(sys.modules.get(cls.__module__), "__file__", None)
        if module_file:
            files[Path(module_file).resolve()] = Path(module_file).name
    for f in getattr(info.get("dist"), "files", None) or []:
        if f.suffix == ".py":
            path = Path(f.locate()).resolve()
            if path.is_file():
                files.setdefault(path, f.as_posix())
    pairs = sorted((name, path) for path, name in files.items())
    return {"distribution": info.get("distribution"), "version": info.get("version"),
            "sha256": named_files_sha256(pairs) if pairs else None}


def broken() -> dict[str, str]:
    """The plug-ins left out so far in this process: entry point name -> the error its load raised."""
    return {name: error for (name, _), error in _BROKEN.items()}
