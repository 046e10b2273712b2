"""Stabilizers by name: the built-ins plus every class that an installed package declares in the
entry-point group ``gacbench.stabilizers`` (``name = "package.module:Class"`` in its pyproject)."""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

ENTRY_POINT_GROUP = "gacbench.stabilizers"
KINDS = ("gradient", "loss")


def _builtins() -> dict[str, type]:
    from gacbench.callbacks.gac import GAC
    from gacbench.stabilizers.bapo import BAPO
    from gacbench.stabilizers.importance import TIS, DecoupledPPO
    from gacbench.stabilizers.m2po import M2PO
    from gacbench.stabilizers.ppo import CISPO, GSPO, DualClipPPO
    from gacbench.stabilizers.rollout_correction import MIS, IcePop, TISEngine
    from gacbench.stabilizers.vcpo import VCPO

    return {"gac": GAC, "m2po": M2PO, "bapo": BAPO, "tis": TIS, "decoupled-ppo": DecoupledPPO, "dual-clip": DualClipPPO,
            "gspo": GSPO, "cispo": CISPO, "tis-engine": TISEngine, "mis": MIS, "icepop": IcePop, "vcpo": VCPO}


def available() -> dict[str, dict[str, Any]]:
    """name -> {"cls", "kind", "source", "help"}; a name declared twice is an error naming both sources."""
    found: dict[str, dict[str, Any]] = {}
    for name, cls in _builtins().items():
        found[name] = {"cls": cls, "source": "gacbench"}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found:
            raise ValueError(f"stabilizer {ep.name!r} is declared twice: by {found[ep.name]['source']} and by "
                             f"{ep.value} (entry point group {ENTRY_POINT_GROUP}); rename one of them")
        found[ep.name] = {"cls": ep.load(), "source": ep.value}
    for name, info in found.items():
        kind = getattr(info["cls"], "kind", None)
        if kind not in KINDS:
            raise TypeError(f"stabilizer {name!r} ({info['source']}): its class needs kind = 'gradient' or 'loss', "
                            f"got {kind!r}")
        info["kind"] = kind
        doc = " ".join((info["cls"].__doc__ or "").split())
        info["help"] = doc.split(". ")[0].rstrip(".") + "." if doc else ""
    return found
