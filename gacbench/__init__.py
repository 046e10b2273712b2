"""gacbench: a benchmark suite for asynchronous (stale-rollout) RL training and its stabilizers,
centred on Gradient Alignment Control (GAC)."""

from gacbench.callbacks import GAC, AlignmentMonitor, AssumptionMonitor, DriftMonitor, StalenessSimulator
from gacbench.hooks import attach_alignment_monitor, attach_gac

__version__ = "0.1.0"
__all__ = ["GAC", "AlignmentMonitor", "AssumptionMonitor", "DriftMonitor", "StalenessSimulator",
           "attach_alignment_monitor", "attach_gac", "__version__"]
