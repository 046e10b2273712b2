"""Synthetic objectives as LightningModules with known constants, found by name.

Objectives are looked up in a registry (:mod:`gacbench.objectives.registry`): the synthetic ones
(quadratic, logistic, mlp, bandit, sequence) register here; other packages register theirs
(``gacbench.llm`` registers ``grpo``).
"""

from gacbench.objectives.bandit import SoftmaxBandit
from gacbench.objectives.base import Objective
from gacbench.objectives.logistic import LogisticRegression
from gacbench.objectives.mlp import MLPClassifier
from gacbench.objectives.quadratic import NoisyQuadratic
from gacbench.objectives.registry import is_registered, objective_class, register_objective, registered_objectives
from gacbench.objectives.sequence import SequencePolicy

register_objective("quadratic", NoisyQuadratic)
register_objective("logistic", LogisticRegression)
register_objective("mlp", MLPClassifier)
register_objective("bandit", SoftmaxBandit)
register_objective("sequence", SequencePolicy)


def make_objective(name: str, **params) -> Objective:
    return objective_class(name)(**params)


__all__ = ["LogisticRegression", "MLPClassifier", "NoisyQuadratic", "Objective", "SequencePolicy", "SoftmaxBandit",
           "is_registered", "make_objective", "objective_class", "register_objective", "registered_objectives"]
