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


def _grpo():
    from gacbench.llm.grpo import GRPOModule  # needs transformers: imported only when asked for

    return GRPOModule


LAZY = {"grpo": _grpo}


def objective_class(name: str) -> type[Objective]:
    if name in OBJECTIVES:
        return OBJECTIVES[name]
    if name in LAZY:
        return LAZY[name]()
    raise ValueError(f"unknown objective {name!r}; choose from {', '.join(list(OBJECTIVES) + list(LAZY))}")


def make_objective(name: str, **params) -> Objective:
    return objective_class(name)(**params)


__all__ = ["LAZY", "objective_class", "OBJECTIVES", "LogisticRegression", "MLPClassifier", "NoisyQuadratic", "Objective", "SoftmaxBandit", "make_objective"]
