"""Synthetic objectives as LightningModules with known constants."""

from gacbench.objectives.quadratic import NoisyQuadratic

__all__ = ["NoisyQuadratic"]
