"""Synthetic objectives as LightningModules with known constants, found by name."""

from gacbench.objectives.bandit import SoftmaxBandit
from gacbench.objectives.base import Objective
from gacbench.objectives.logistic import LogisticRegression
from gacbench.objectives.mlp import MLPClassifier
from gacbench.objectives.quadratic import NoisyQuadratic

OBJECTIVES: dict[str, type[Objective]] = {
    "quadratic": NoisyQuadratic,
    "logistic": LogisticRegression,
    "mlp": MLPClassifier,
    "bandit": SoftmaxBandit,
}


def make_objective(name: str, **params) -> Objective:
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; choose from {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name](**params)


__all__ = ["OBJECTIVES", "LogisticRegression", "MLPClassifier", "NoisyQuadratic", "Objective", "SoftmaxBandit", "make_objective"]
