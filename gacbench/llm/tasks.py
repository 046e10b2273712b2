"""Tasks and rewards of the GRPO module, found by name.

A task is an object with ``batch(split, start, size) -> list[Problem]`` for the splits "train" and
"eval" (a ``Problem`` has ``prompt`` and ``answer``), a ``default_reward`` name, and optionally
``sizes`` (problems per split, for a finite dataset) and ``tiny_tokenizer`` (True when the tiny model's
character tokenizer can write its prompts). A task factory builds one from the run's
:class:`TaskConfig` and seed::

    @register_task("my-task", settings=("path",), options=("size",))
    def _my_task(cfg: TaskConfig, seed: int):
        return MyTask(path=cfg.path, **cfg.options, seed=seed)

``settings`` names the fields of :class:`TaskConfig` the factory reads besides ``name`` and ``reward``, and
``options`` the keys of ``task.options`` it takes. :func:`check_task_settings` refuses, before any model is loaded,
a field set to other than its default that the task does not read, an unknown option, and a value out of its
range (``eval_fraction`` in (0, 1), ``max_ops`` and ``max_operand`` integers >= 1). A task registered without
``settings`` (None) is checked for the ranges only.

Rewards map ``(completion text, gold answer) -> float`` and are registered with ``register_reward``.
Built in: tasks ``arithmetic`` (procedural, :class:`~gacbench.llm.task.ArithmeticTask`), ``scratchpad`` (the same
expressions answered with a written scratchpad, :class:`~gacbench.llm.task.ScratchpadTask`) and ``math`` (a local
JSONL/Parquet file, :class:`~gacbench.llm.datasets.MathDataset`); rewards ``exact``, ``final-line`` and
``math-verify``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from gacbench.llm.datasets import MathDataset, math_verify_reward
from gacbench.llm.task import ArithmeticTask, ScratchpadTask, exact_reward, final_line_reward


@dataclass
class TaskConfig:
    """name: a registered task (``arithmetic``, ``scratchpad``, ``math``, ...). reward: a registered reward; None =
    the task's default. max_ops, max_operand: the arithmetic task's size; the scratchpad task takes them from
    ``options`` (``min_ops``, ``max_ops``, ``max_operand``; default 3, 3, 9), since its defaults differ. path,
    template: the ``math`` task's file (JSONL or Parquet) and prompt template (``str.format`` with ``problem=``).
    eval_fraction: the held-out share of the problems, in (0, 1). options: further keyword
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
TASK_SETTINGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]] | None] = {}  # name -> (settings, options)
REWARDS: dict[str, Callable[[str, str], float]] = {}
ALWAYS = ("name", "reward")  # the fields every task takes


def register_task(name: str, settings: tuple[str, ...] | None = None,
                  options: tuple[str, ...] = ()) -> Callable[[TaskFactory], TaskFactory]:
    def deco(factory: TaskFactory) -> TaskFactory:
        if name in TASKS:
            raise ValueError(f"task {name!r} is already registered")
        TASKS[name] = factory
        TASK_SETTINGS[name] = None if settings is None else (tuple(settings), tuple(options))
        return factory

    return deco


def check_task_settings(cfg: TaskConfig, owner: str = "GRPOModule") -> None:
    """Refuse a task setting the task ``cfg.name`` does not read (a field of :class:`TaskConfig` other than its
    default, an unknown key of ``task.options``), naming the task's settings, and a value out of range; raises
    :class:`~gacbench.objectives.base.SettingError` (a ValueError) naming the key and the range. Reads no file
    and loads no model."""
    import dataclasses

    from gacbench.objectives.base import SettingError, check_range

    task_factory(cfg.name)
    declared = TASK_SETTINGS.get(cfg.name)
    if declared is not None:
        settings, options = declared
        takes = ", ".join(f"task.{k}" for k in (*ALWAYS, *settings))
        takes += f", task.options {{{', '.join(options)}}}" if options else " (no task.options)"
        for f in dataclasses.fields(TaskConfig):
            if f.name in ALWAYS or f.name in settings or f.name == "options":
                continue
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            value = getattr(cfg, f.name)
            if value != default:
                raise SettingError(f"{owner}: task.{f.name}={value!r} is not a setting of task {cfg.name!r}, which "
                                   f"takes {takes}; remove it", f"task.{f.name}", value)
        if not isinstance(cfg.options, dict):
            raise SettingError(f"{owner}: task.options={cfg.options!r} must be a mapping of option names to values",
                               "task.options", cfg.options)
        unknown = sorted(set(cfg.options) - set(options))
        if unknown:
            raise SettingError(f"{owner}: task.options {', '.join(map(repr, unknown))}: not an option of task "
                               f"{cfg.name!r}, which takes {takes}; remove it", "task.options", cfg.options)
        used = set(settings)
    else:
        used = {f.name for f in dataclasses.fields(TaskConfig)}
    if "eval_fraction" in used:
        check_range(owner, "task.eval_fraction", cfg.eval_fraction, 0, 1, lo_open=True, hi_open=True,
                    why="the share of problems held out for evaluation")
    for key in ("max_ops", "max_operand"):
        if key in used:
            check_range(owner, f"task.{key}", getattr(cfg, key), 1, integer=True)
    opts = cfg.options if isinstance(cfg.options, dict) else {}
    for key in ("min_ops", "max_ops", "max_operand"):
        if declared is not None and key in declared[1] and key in opts:
            check_range(owner, f"task.options.{key}", opts[key], 1, integer=True)
    if declared is not None and {"min_ops", "max_ops"} <= set(declared[1]):
        lo, hi = opts.get("min_ops", ScratchpadTask.min_ops), opts.get("max_ops", ScratchpadTask.max_ops)
        if lo > hi:
            raise SettingError(f"{owner}: task.options min_ops={lo} > max_ops={hi}; need 1 <= min_ops <= max_ops",
                               "task.options.min_ops", lo)
    if "path" in used and declared is not None and cfg.path is None:
        raise SettingError(f"{owner}: task {cfg.name!r} needs task.path: a local .jsonl or .parquet file of "
                           "problems with answers (e.g. tasks/math/example.jsonl)", "task.path", None)


def check_task_data(cfg: TaskConfig, owner: str = "GRPOModule") -> None:
    """Build the task ``cfg`` once (seed 0) if it reads a file (``task.path`` among its settings), so that a missing
    file or a malformed row raises :class:`~gacbench.objectives.base.SettingError` on ``task.path``, with the
    reader's own message (the file, the row and the fix), before a run or a grid starts. A procedural task is not
    built: it reads nothing."""
    from gacbench.objectives.base import SettingError

    declared = TASK_SETTINGS.get(cfg.name)
    if declared is None or "path" not in declared[0] or cfg.path is None:
        return
    try:
        task_factory(cfg.name)(cfg, 0)
    except (ValueError, OSError) as exc:
        raise SettingError(f"{owner}: task {cfg.name!r}, task.path={str(cfg.path)!r}: {exc}", "task.path",
                           cfg.path) from None


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
    check_task_settings(cfg)
    return task_factory(cfg.name)(cfg, seed)


def score(reward: Callable[[str, str], Any], completion: str, answer: str) -> float:
    """``reward(completion, answer)`` as a float (an int or a bool is a number too), or a ValueError naming the
    reward, the completion, the answer and the fix when it is not a finite number: a NaN would reach the
    advantages, the loss and then the weights, and the run would stop a step later blaming the rollout engine."""
    value = reward(completion, answer)
    try:
        out = float(value)
    except (TypeError, ValueError):
        out = None
    if out is None or not math.isfinite(out):
        name = next((k for k, fn in REWARDS.items() if fn is reward), getattr(reward, "__name__", repr(reward)))
        raise ValueError(f"reward {name!r} returned {value!r} for the completion {completion!r} (answer {answer!r}); "
                         "a reward must return a finite number (e.g. 0.0 for a completion it cannot score)")
    return out


def reward_fn(name: str) -> Callable[[str, str], float]:
    """The reward ``(completion, answer) -> float`` registered as ``name``."""
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; registered rewards: {', '.join(sorted(REWARDS))} "
                         "(add one with gacbench.llm.tasks.register_reward)")
    return REWARDS[name]


@register_task("arithmetic", settings=("max_ops", "max_operand", "eval_fraction"))
def _arithmetic(cfg: TaskConfig, seed: int) -> ArithmeticTask:
    return ArithmeticTask(max_ops=cfg.max_ops, max_operand=cfg.max_operand, eval_fraction=cfg.eval_fraction,
                          seed=seed)


@register_task("scratchpad", settings=("eval_fraction",), options=("min_ops", "max_ops", "max_operand"))
def _scratchpad(cfg: TaskConfig, seed: int) -> ScratchpadTask:
    return ScratchpadTask(**cfg.options, eval_fraction=cfg.eval_fraction, seed=seed)


@register_task("math", settings=("path", "template", "eval_fraction"), options=("prompt_key", "answer_key"))
def _math(cfg: TaskConfig, seed: int) -> MathDataset:
    return MathDataset(cfg.path, eval_fraction=cfg.eval_fraction, seed=seed, template=cfg.template, **cfg.options)


register_reward("exact", exact_reward)
register_reward("final-line", final_line_reward)
register_reward("math-verify", math_verify_reward)
