"""A Lightning logger that keeps every logged scalar in memory (tests, the demo, quick studies)."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only


class MemoryLogger(Logger):
    """``series[name]`` is the list of (step, value) pairs logged under ``name``."""

    def __init__(self) -> None:
        super().__init__()
        self.series: dict[str, list[tuple[int, float]]] = defaultdict(list)

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        return self.series

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            self.series[key].append((-1 if step is None else int(step), float(value)))

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def values(self, name: str) -> list[float]:
        return [v for _, v in self.series.get(name, [])]

    def last(self, name: str, default: float = math.nan) -> float:
        vals = self.values(name)
        return vals[-1] if vals else default
