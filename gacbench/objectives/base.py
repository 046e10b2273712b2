"""The small contract every synthetic objective meets, so that the bench runner can treat them alike."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch


class Objective(pl.LightningModule):
    """A LightningModule with a scalar quality metric.

    Subclasses set ``metric_name`` and ``higher_is_better`` and implement ``metric()`` (the metric
    at the current parameters, computed exactly or on a held-out set). ``rollout_staleness`` is
    True for objectives that produce their own stale data (stale-rollout mode: the bandit); the
    runner then passes the staleness to the module instead of attaching a StalenessSimulator.
    The metric is logged as ``eval/<metric_name>`` every ``eval_every`` optimizer steps.
    """

    metric_name = "metric"
    higher_is_better = False
    rollout_staleness = False
    accelerator = "cpu"  # a bench cell's Trainer accelerator: "cpu", "auto", "gpu" (gacbench.trainer.pick_accelerator)

    def __init__(self, eval_every: int = 10) -> None:
        super().__init__()
        if eval_every < 1:
            raise ValueError(f"{type(self).__name__}: eval_every={eval_every} must be >= 1")
        self.eval_every = eval_every

    @torch.no_grad()
    def metric(self) -> float:
        raise NotImplementedError

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        step = self.trainer.global_step
        if step % self.eval_every == 0 or step == self.trainer.max_steps:
            self.log_scalars({f"eval/{self.metric_name}": self.metric()})

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """A rollout objective's stale-rollout queue (``self.queue``) goes into the checkpoint with the run."""
        queue = getattr(self, "queue", None)
        if queue is not None:
            checkpoint["rollout_queue"] = queue.state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        queue = getattr(self, "queue", None)
        if queue is not None:
            queue.load_state_dict(checkpoint["rollout_queue"])

    def log_scalars(self, metrics: dict) -> None:
        """Scalars to ``trainer.callback_metrics`` and the loggers (gacbench.callbacks._common.log_metrics says how)."""
        from gacbench.callbacks._common import log_metrics

        log_metrics(self.trainer, metrics)

    # Defaults for objectives whose data are pre-drawn batches (``self.batches``), whose loss is the
    # side-effect-free ``loss_on(batch)``, and whose hyperparameters name ``optimizer`` and ``lr``.
    def loss_on(self, batch) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no side-effect-free loss_on(batch) (its training_step "
                                  "moves state), so AssumptionMonitor cannot estimate on it")

    def training_step(self, batch, batch_idx):
        return self.loss_on(batch)

    def train_dataloader(self):
        return step_loader(self.batches)

    def configure_optimizers(self):
        return make_optimizer(self.parameters(), self.hparams.optimizer, self.hparams.lr)

    def diverged(self, initial: float, final: float) -> bool:
        """Non-finite parameters or metric; for loss-like metrics also a metric 10x worse than at the start."""
        if not math.isfinite(final) or not all(torch.isfinite(p).all() for p in self.parameters()):
            return True
        return (not self.higher_is_better) and final > 10.0 * max(initial, 1e-12)


def make_optimizer(params, name: str, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer={name!r} is not 'sgd' or 'adamw'")


class StepBatches(torch.utils.data.Dataset):
    """Batch i is a pre-drawn tensor slice: no collation or sampling cost per step."""

    def __init__(self, *tensors: torch.Tensor, batch_size: int, steps: int, generator: torch.Generator) -> None:
        n = tensors[0].shape[0]
        self.tensors = tensors
        self.index = torch.randint(0, n, (steps, batch_size), generator=generator)

    def __len__(self) -> int:
        return self.index.shape[0]

    def __getitem__(self, i: int):
        idx = self.index[i]
        return tuple(t[idx] for t in self.tensors)


def step_loader(dataset: torch.utils.data.Dataset) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset, batch_size=None, shuffle=False)
