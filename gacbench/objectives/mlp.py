"""A small MLP classifier on data labelled by a random teacher network (non-convex).

The metric is accuracy on a held-out test set drawn from the same teacher.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from gacbench.objectives.base import Objective, StepBatches, check_range, given_settings


class MLPClassifier(Objective):
    metric_name = "acc"
    higher_is_better = True

    def __init__(self, n: int = 2048, n_test: int = 1024, dim: int = 16, hidden: int = 64, classes: int = 4,
                 batch_size: int = 64, steps: int = 300, lr: float = 0.01, optimizer: str = "adamw", seed: int = 0,
                 eval_every: int = 10) -> None:
        MLPClassifier.check_settings(given_settings(locals()))
        super().__init__(eval_every)
        self.save_hyperparameters()
        gen = torch.Generator().manual_seed(seed)
        teacher = [torch.randn(dim, 32, generator=gen) / dim**0.5, torch.randn(32, classes, generator=gen) / 32**0.5]
        x = torch.randn(n + n_test, dim, generator=gen)
        y = (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(-1)
        self.x, self.y, self.x_test, self.y_test = x[:n], y[:n], x[n:], y[n:]
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, classes))

        self.batches = StepBatches(self.x, self.y, batch_size=batch_size, steps=steps, generator=gen)

    @classmethod
    def check_settings(cls, params: Mapping[str, Any]) -> None:
        """n, n_test, dim, hidden, classes and batch_size >= 1, and the checks of every objective."""
        super().check_settings(params)
        for key in ("n", "n_test", "dim", "hidden", "batch_size", "classes"):
            if key in params:
                check_range(cls.__name__, key, params[key], 1, integer=True)

    @torch.no_grad()
    def metric(self) -> float:
        return float((self.net(self.x_test).argmax(-1) == self.y_test).float().mean())

    def loss_on(self, batch) -> torch.Tensor:
        """The step's loss as a pure function of the batch (no side effects)."""
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)
