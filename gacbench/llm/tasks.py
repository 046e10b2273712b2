"""Tasks and rewards of the GRPO module, found by name.

A task is an object with ``batch(split, start, size) -> list[Problem]`` for the splits "train" and
"eval" (a ``Problem`` has ``prompt`` and ``answer``), a ``default_reward`` name, and optionally
``sizes`` (problems per split, for a finite dataset) and ``tiny_tokenizer`` (True when the tiny model's
character tokenizer can write its prompts). A task factory builds one from the run's
:class:`TaskConfig` and seed::

    @register_task("my-task")
    def _my_task(cfg: TaskConfig, seed: int):
        return MyTask(path=cfg.path, **cfg.options, seed=seed)

Rewards map ``(completion text, gold answer) -> float`` and are registered with ``register_reward``.
Built in: tasks ``arithmetic`` (procedural, :class:`~gacbench.llm.task.ArithmeticTask`), ``scratchpad`` (the same
expressions answered with a written scratchpad, :class:`~gacbench.llm.task.ScratchpadTask`) and ``math`` (a local
JSONL/Parquet file, :class:`~gacbench.llm.datasets.MathDataset`); rewards ``exact``, ``final-line`` and
``math-verify``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from gacbench.llm.datasets import MathDataset, math_verify_reward
from gacbench.llm.task import ArithmeticTask, ScratchpadTask, exact_reward, final_line_reward
from gacbench.usage import UsageError


@dataclass
class TaskConfig:
    """name: a registered task (``arithmetic``, ``scratchpad``, ``math``, ...). reward: a registered reward; None =
    the task's default. max_ops, max_operand: the arithmetic task's size; the scratchpad task takes them from
    ``options`` (``min_ops``, ``max_ops``, ``max_operand``; default 3, 3, 9), since its defaults differ. path,
    template: the ``math`` task's file (JSONL or Parquet) and prompt template (``str.format`` with ``problem=``).
    eval_fraction: the held-out share of the ``math`` and ``scratchpad`` tasks. options: further keyword
    arguments for a third-party task's factory."""

    name: str = "arithmetic"
    reward: str | None = None
    max_ops: int = 2
    max_operand: int = 9
    path: str | None = None
    template: str = "{problem}"
    eval_fraction: float = 0.1
    options: dict[str, Any] = field(default_factory=dict)


TaskFactory = Callable[[TaskConfig, int], Any]
TASKS: dict[str, TaskFactory] = {}
REWARDS: dict[str, Callable[[str, str], float]] = {}


def register_task(name: str) -> Callable[[TaskFactory], TaskFactory]:
    def deco(factory: TaskFactory) -> TaskFactory:
        if name in TASKS:
            raise ValueError(f"task {name!r} is already registered")
        TASKS[name] = factory
        return factory

    return deco


def register_reward(name: str, fn: Callable[[str, str], float]) -> None:
    if name in REWARDS:
        raise ValueError(f"reward {name!r} is already registered")
    REWARDS[name] = fn


def task_factory(name: str) -> TaskFactory:
    """The factory registered as task ``name``."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; registered tasks: {', '.join(sorted(TASKS))} "
                         "(add one with gacbench.llm.tasks.register_task)")
    return TASKS[name]


def build_task(cfg: TaskConfig, seed: int) -> Any:
    return task_factory(cfg.name)(cfg, seed)


def reward_fn(name: str) -> Callable[[str, str], float]:
    """The reward ``(completion, answer) -> float`` registered as ``name``."""
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; registered rewards: {', '.join(sorted(REWARDS))} "
                         "(add one with gacbench.llm.tasks.register_reward)")
    return REWARDS[name]


@register_task("arithmetic")
def _arithmetic(cfg: TaskConfig, seed: int) -> ArithmeticTask:
    return ArithmeticTask(max_ops=cfg.max_ops, max_operand=cfg.max_operand, seed=seed)


@register_task("scratchpad")
def _scratchpad(cfg: TaskConfig, seed: int) -> ScratchpadTask:
    unknown = sorted(set(cfg.options) - {"min_ops", "max_ops", "max_operand"})
    if unknown:
        raise UsageError(f"task 'scratchpad': unknown task.options {', '.join(unknown)}; it takes min_ops, max_ops "
                         "and max_operand")
    return ScratchpadTask(**cfg.options, eval_fraction=cfg.eval_fraction, seed=seed)


@register_task("math")
def _math(cfg: TaskConfig, seed: int) -> MathDataset:
    if cfg.path is None:
        raise ValueError("task 'math' needs task.path: a local .jsonl or .parquet file of problems with answers "
                         "(e.g. tasks/math/example.jsonl)")
    return MathDataset(cfg.path, eval_fraction=cfg.eval_fraction, seed=seed, template=cfg.template, **cfg.options)


register_reward("exact", exact_reward)
register_reward("final-line", final_line_reward)
register_reward("math-verify", math_verify_reward)
