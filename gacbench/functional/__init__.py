"""The math of gacbench as pure functions of tensors (no Lightning)."""

from gacbench.functional.alignment import (
    GACDecision,
    alignment_scalars,
    cosine,
    cosine_from_scalars,
    dot,
    gac_decision,
    gac_project,
    project_,
    sq_norm,
    validate_thresholds,
)
from gacbench.functional.buffer import FlatBuffer
from gacbench.functional.stats import alignment_summary
from gacbench.functional.stepsize import eta_max

__all__ = [
    "FlatBuffer",
    "GACDecision",
    "alignment_scalars",
    "alignment_summary",
    "cosine",
    "cosine_from_scalars",
    "dot",
    "eta_max",
    "gac_decision",
    "gac_project",
    "project_",
    "sq_norm",
    "validate_thresholds",
]
