"""gacbench: a benchmark suite for asynchronous (stale-rollout) RL training and its stabilizers,
centred on Gradient Alignment Control (GAC).

The public names below are imported on first use (:func:`gacbench.lazy.lazy_attributes`), so that
importing a light part of the package (the command line, ``gacbench.usage``) does not import torch and Lightning."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gacbench.lazy import lazy_attributes

__version__ = "0.1.0"

#: each public name and the module that defines it
_EXPORTS = {
    "GAC": "gacbench.callbacks", "AlignmentMonitor": "gacbench.callbacks", "AssumptionMonitor": "gacbench.callbacks",
    "DriftMonitor": "gacbench.callbacks", "StalenessSimulator": "gacbench.callbacks",
    "attach_alignment_monitor": "gacbench.hooks", "attach_gac": "gacbench.hooks",
}
__all__ = ["GAC", "AlignmentMonitor", "AssumptionMonitor", "DriftMonitor", "StalenessSimulator",
           "attach_alignment_monitor", "attach_gac", "__version__"]

if TYPE_CHECKING:
    from gacbench.callbacks import GAC, AlignmentMonitor, AssumptionMonitor, DriftMonitor, StalenessSimulator
    from gacbench.hooks import attach_alignment_monitor, attach_gac


__getattr__, __dir__ = lazy_attributes("gacbench", _EXPORTS, globals())
