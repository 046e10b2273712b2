"""Lightning callbacks: the staleness simulator, the alignment monitor and GAC."""

from gacbench.callbacks.alignment import AlignmentMonitor
from gacbench.callbacks.gac import GAC
from gacbench.callbacks.staleness import StalenessSimulator

__all__ = ["AlignmentMonitor", "GAC", "StalenessSimulator"]
