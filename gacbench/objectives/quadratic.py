"""A noisy quadratic with its constants known exactly.

f(theta) = 1/2 (theta - theta*)^T A (theta - theta*), A = diag(lambda_1..lambda_d), the
eigenvalues log-spaced from mu = L / kappa to L. A step's stochastic gradient is
grad f(theta) + xi with xi ~ N(0, (sigma^2 / d) I) drawn from the step's batch, so
E||g - grad f||^2 = sigma^2 exactly. The loss is written so that autograd produces that
gradient: loss = f(theta) + <xi, theta>.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch.utils.data import TensorDataset

from gacbench.objectives.base import Objective, SettingError, check_range, given_settings, step_loader


class NoisyQuadratic(Objective):
    """Args: dim d, L (largest curvature), kappa (condition number), sigma2 (gradient-noise
    variance), steps (batches in the training set), lr, optimizer ("sgd" | "adamw"), seed,
    init_scale (theta_0 = theta* + init_scale * N(0, I); 0 starts at the optimum)."""

    metric_name = "gap"
    higher_is_better = False

    def __init__(self, dim: int = 100, L: float = 1.0, kappa: float = 100.0, sigma2: float = 1e-2,
                 steps: int = 300, lr: float = 0.5, optimizer: str = "sgd", seed: int = 0, eval_every: int = 10,
                 init_scale: float = 3.0) -> None:
        NoisyQuadratic.check_settings(given_settings(locals()))
        super().__init__(eval_every)
        self.save_hyperparameters()
        gen = torch.Generator().manual_seed(seed)
        self.register_buffer("eigs", torch.logspace(torch.log10(torch.tensor(L / kappa)),
                                                    torch.log10(torch.tensor(L)), dim))


        self.register_buffer("theta_star", torch.randn(dim, generator=gen))
        self.theta = torch.nn.Parameter(self.theta_star + torch.randn(dim, generator=gen) * init_scale)
        self.noise = torch.randn(steps, dim, generator=gen) * (sigma2 / dim) ** 0.5
        self.L, self.mu, self.sigma2 = L, L / kappa, sigma2

    @classmethod
    def check_settings(cls, params: Mapping[str, Any]) -> None:
        """dim >= 1, L > 0, kappa >= 1 (1 at dim = 1), sigma2 >= 0, init_scale >= 0, and the checks of every
        objective."""
        super().check_settings(params)
        owner = cls.__name__
        for key, lo, lo_open, integer in (("dim", 1, False, True), ("L", 0, True, False), ("kappa", 1, False, False),
                                          ("sigma2", 0, False, False)):
            if key in params:
                check_range(owner, key, params[key], lo, lo_open=lo_open, integer=integer)
        if "init_scale" in params:
            check_range(owner, "init_scale", params["init_scale"], 0,
                        why="theta_0 = theta* + init_scale N(0, I); 0 starts at the optimum")
        if params.get("dim") == 1 and params.get("kappa", 100.0) != 1:
            key = "kappa" if "kappa" in params else "dim"
            raise SettingError(f"{owner}: dim=1 has one curvature, L, so its condition number is 1, not kappa="
                               f"{params.get('kappa', 100.0)}; set kappa=1, or dim >= 2", key, params[key])

    def gap(self, theta: torch.Tensor | None = None) -> torch.Tensor:
        """f(theta) - f* (f* = 0)."""
        delta = (self.theta if theta is None else theta) - self.theta_star
        return 0.5 * (self.eigs * delta * delta).sum()

    @torch.no_grad()
    def diverged(self, initial: float, final: float) -> bool:
        """As every objective's, with the start's gap taken at least sigma2: a run started at or near the optimum
        (``init_scale`` ~ 0) settles at SGD's noise floor, a gap of order lr sigma2, which is not a divergence."""
        return super().diverged(max(initial, self.sigma2), final)

    def metric(self) -> float:
        return float(self.gap().detach())

    def loss_on(self, batch) -> torch.Tensor:
        """The step's loss as a pure function of the batch (no side effects): f(theta) + <xi, theta>."""
        (xi,) = batch
        return self.gap() + (xi.reshape(-1) * self.theta).sum()

    def grad_f(self) -> torch.Tensor:
        """The exact gradient A (theta - theta*)."""
        return self.eigs * (self.theta.detach() - self.theta_star)

    def train_dataloader(self):
        return step_loader(TensorDataset(self.noise.unsqueeze(1)))
