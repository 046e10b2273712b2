"""Lightning callbacks: the staleness simulator, the alignment, drift and assumption monitors, and GAC."""

from gacbench.callbacks.alignment import AlignmentMonitor
from gacbench.callbacks.assumptions import AssumptionMonitor
from gacbench.callbacks.drift import DriftMonitor
from gacbench.callbacks.gac import GAC
from gacbench.callbacks.staleness import StalenessSimulator

__all__ = ["AlignmentMonitor", "AssumptionMonitor", "DriftMonitor", "GAC", "StalenessSimulator"]
