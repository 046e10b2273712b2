"""L2-regularised logistic regression on generated data: convex, smooth, L known from the data.

f(w) = mean_i log(1 + exp(-y_i x_i^T w)) + (l2 / 2) ||w||^2 with y in {-1, +1};
L = lambda_max(X^T X / n) / 4 + l2, mu = l2. The metric is the full-batch objective f(w).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from gacbench.objectives.base import Objective, StepBatches, check_range, given_settings


class LogisticRegression(Objective):
    metric_name = "loss"
    higher_is_better = False

    def __init__(self, n: int = 1024, dim: int = 20, batch_size: int = 32, l2: float = 1e-3, scale: float = 3.0,
                 steps: int = 300, lr: float = 0.5, optimizer: str = "sgd", seed: int = 0,
                 eval_every: int = 10) -> None:
        LogisticRegression.check_settings(given_settings(locals()))
        super().__init__(eval_every)
        self.save_hyperparameters()
        gen = torch.Generator().manual_seed(seed)
        # features with a spread of scales, so the problem is ill-conditioned
        self.x = torch.randn(n, dim, generator=gen) * torch.logspace(0, -1, dim) * scale
        w_true = torch.randn(dim, generator=gen)
        p = torch.sigmoid(self.x @ w_true)
        self.y = torch.where(torch.rand(n, generator=gen) < p, 1.0, -1.0)
        self.w = torch.nn.Parameter(torch.zeros(dim))
        self.L = float(torch.linalg.eigvalsh(self.x.T @ self.x / n).max()) / 4 + l2
        self.mu = l2
        self.batches = StepBatches(self.x, self.y, batch_size=batch_size, steps=steps, generator=gen)

    @classmethod
    def check_settings(cls, params: Mapping[str, Any]) -> None:
        """n >= 2, dim and batch_size >= 1, l2 >= 0, scale > 0, and the checks of every objective."""
        super().check_settings(params)
        for key, lo, integer in (("n", 2, True), ("dim", 1, True), ("batch_size", 1, True), ("l2", 0, False)):
            if key in params:
                check_range(cls.__name__, key, params[key], lo, integer=integer)
        if "scale" in params:
            check_range(cls.__name__, "scale", params["scale"], 0, lo_open=True,
                        why="the features' scale; at 0 every feature is zero and the labels are coin flips")

    def objective(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.softplus(-y * (x @ self.w)).mean() + 0.5 * self.hparams.l2 * (self.w * self.w).sum()

    @torch.no_grad()
    def metric(self) -> float:
        return float(self.objective(self.x, self.y))

    def loss_on(self, batch) -> torch.Tensor:
        """The step's loss as a pure function of the batch (no side effects)."""
        x, y = batch
        return self.objective(x, y)
