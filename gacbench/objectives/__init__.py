"""Synthetic objectives as LightningModules with known constants, found by name.

Objectives are looked up in a registry (:mod:`gacbench.objectives.registry`): the synthetic ones
(quadratic, logistic, mlp, bandit, sequence) register here; other packages register theirs
(``gacbench.llm`` registers ``grpo``). Each registers by its ``"module:Class"`` path and the classes
are attributes of this package imported on first access, so that importing the package (or the
registry) does not import torch and Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gacbench.lazy import lazy_attributes
from gacbench.objectives.registry import is_registered, objective_class, register_objective, registered_objectives

#: each class this package exports, and its module
_CLASSES = {
    "Objective": "gacbench.objectives.base",
    "NoisyQuadratic": "gacbench.objectives.quadratic",
    "LogisticRegression": "gacbench.objectives.logistic",
    "MLPClassifier": "gacbench.objectives.mlp",
    "SoftmaxBandit": "gacbench.objectives.bandit",
    "SequencePolicy": "gacbench.objectives.sequence",
}

#: the synthetic objectives' names and classes
SYNTHETIC = {"quadratic": "NoisyQuadratic", "logistic": "LogisticRegression", "mlp": "MLPClassifier",
             "bandit": "SoftmaxBandit", "sequence": "SequencePolicy"}

for _name, _cls in SYNTHETIC.items():
    register_objective(_name, f"{_CLASSES[_cls]}:{_cls}")

if TYPE_CHECKING:
    from gacbench.objectives.bandit import SoftmaxBandit
    from gacbench.objectives.base import Objective
    from gacbench.objectives.logistic import LogisticRegression
    from gacbench.objectives.mlp import MLPClassifier
    from gacbench.objectives.quadratic import NoisyQuadratic
    from gacbench.objectives.sequence import SequencePolicy


__getattr__, __dir__ = lazy_attributes("gacbench.objectives", _CLASSES, globals())


def make_objective(name: str, **params) -> Objective:
    return objective_class(name)(**params)


__all__ = ["LogisticRegression", "MLPClassifier", "NoisyQuadratic", "Objective", "SequencePolicy", "SoftmaxBandit",
           "is_registered", "make_objective", "objective_class", "register_objective", "registered_objectives"]
