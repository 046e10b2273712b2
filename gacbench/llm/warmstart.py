"""Warm-start: a short supervised run on the task so that GRPO starts with signal, cached on disk.

The model learns ``prompt -> target + newline + <eos>`` with the loss on the target tokens only; the target is
the problem's solution (the scratchpad task's lines) or else its answer (measured on the arithmetic task:
the default tiny model reaches 17-20% greedy accuracy on the first 256 held-out problems of seeds 0-2 after
400 steps of 64 problems, about 10 s per 100 steps on one core); the
result is saved next to the freshly built model under a directory keyed by (architecture, task,
steps, seed), so every run with the same settings reuses it.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import torch

from gacbench.llm.model import (
    cached_model_dir,
    completion_text,
    config_key,
    default_cache_dir,
    install_dir,
    load,
    tiny_config,
)
from gacbench.llm.task import ArithmeticTask, Problem, exact_reward
from gacbench.llm.tasks import TaskConfig, build_task, score, task_factory


def sft_batch(tok, problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), right-padded; labels are -100 except on the target (solution, else answer), newline
    and eos."""
    rows, labels = [], []
    for p in problems:
        prompt = tok.encode(p.prompt, add_special_tokens=False)
        target = tok.encode(p.target + "\n", add_special_tokens=False) + [tok.eos_token_id]
        rows.append(prompt + target)
        labels.append([-100] * len(prompt) + target)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    lab = torch.full((len(rows), width), -100)
    for i, (r, lb) in enumerate(zip(rows, labels)):
        ids[i, : len(r)] = torch.tensor(r)
        lab[i, : len(lb)] = torch.tensor(lb)
    return ids, lab


@torch.no_grad()
def greedy_accuracy(model, tok, problems: list[Problem], max_tokens: int = 8, batch_size: int = 64,
                    reward=exact_reward) -> float:
    """pass@1 with greedy decoding: the share of problems whose completion earns reward 1 (batched,
    prompts left-padded so that every row's completion starts at the same column). A completion ends where a
    rollout engine's does, at the tokenizer's end token or any end token of the checkpoint's generation config,
    and the checkpoint's sampling settings (``repetition_penalty``, ...) are not applied, as the engines apply
    none (:class:`~gacbench.rollout.engines.HFEngine`)."""
    from gacbench.rollout.engines import end_token_ids, plain_generation_config

    model.eval()
    ends = end_token_ids(model, tok.eos_token_id)
    config = plain_generation_config(model, ends, tok.pad_token_id)
    correct = 0.0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        rows = [tok.encode(p.prompt, add_special_tokens=False) for p in chunk]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), tok.pad_token_id, device=model.device)
        attention = torch.zeros(len(rows), width, dtype=torch.long, device=model.device)
        for i, r in enumerate(rows):
            ids[i, width - len(r):] = torch.tensor(r)
            attention[i, width - len(r):] = 1
        kept, model.generation_config = model.generation_config, config  # generate fills unset fields from it
        try:
            out = model.generate(ids, attention_mask=attention, do_sample=False, max_new_tokens=max_tokens)
        finally:
            model.generation_config = kept
        for p, row in zip(chunk, out[:, width:].tolist()):
            end = next((k for k, t in enumerate(row) if t in ends), len(row))
            correct += score(reward, completion_text(tok, row[: end + 1]), p.answer)
    return correct / max(1, len(problems))


def warm_start(model, tok, task: ArithmeticTask, steps: int, batch_size: int = 64, lr: float = 3e-3,
               seed: int = 0) -> list[float]:
    """Supervised steps on the training split, in place; returns the losses."""
    torch.manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        ids, lab = sft_batch(tok, task.batch("train", step * batch_size, batch_size))
        loss = model(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long(), labels=lab).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


def warm_task(cfg: TaskConfig, task) -> ArithmeticTask:
    """The task a built-in model's warm-start trains on for a run on ``task`` (built from ``cfg``): the run's own
    task at seed 0 when it sets ``warm_on_task`` (the scratchpad task), else the arithmetic task of ``cfg``'s
    max_ops, max_operand and eval_fraction (so that the warm start trains on the run's training split only, never
    on a problem the run evaluates on). Seed 0 either way, so every seed of a grid starts from the same
    checkpoint. ``cfg`` is not checked again: its settings were checked
    (:func:`gacbench.llm.tasks.check_task_settings`) before ``task`` was built from it."""
    if getattr(task, "warm_on_task", False):
        return task_factory(cfg.name)(cfg, 0)
    return ArithmeticTask(max_ops=cfg.max_ops, max_operand=cfg.max_operand, eval_fraction=cfg.eval_fraction)


def built_in_start(size: str, cfg: TaskConfig, task=None) -> tuple[object, ArithmeticTask]:
    """``(config, warm task)`` of the built-in model of ``size`` for a run on the task of ``cfg`` (``task``: that
    task, built at seed 0 when not given): :func:`warm_task`'s task. The one choice behind both
    :func:`built_in_model_dir` (the directory a run loads) and :func:`start_point` (what a suite's ``theta0``
    pins)."""
    from gacbench.llm.model import sized_config

    return sized_config(size), warm_task(cfg, task if task is not None else build_task(cfg, 0))


def built_in_model_dir(size: str, warm_steps: int, cfg: TaskConfig, task=None) -> Path:
    """The built-in model of ``size`` warm-started for ``warm_steps`` steps for a run on the task of ``cfg``
    (``task``: that task, built at seed 0 when not given): :func:`built_in_start`'s, cached."""
    config, task = built_in_start(size, cfg, task)
    return warm_started_dir(config, task=task, steps=warm_steps)


def warm_key(config=None, task: ArithmeticTask | None = None, steps: int = 400, seed: int = 0) -> str:
    """The name of the warm-started checkpoint for these settings (its cache directory, and its shipped one when
    it is pinned: :mod:`gacbench.llm.pinned`): ``warm-`` + the task kind (for a task other than arithmetic), a hash
    of the architecture, the task's fields, the steps and the seed."""
    config = config or tiny_config()
    task = task or ArithmeticTask()
    kind = "" if isinstance(task, ArithmeticTask) else f"{type(task).__name__}-"
    fields = "-".join(f"{k}{v}" for k, v in asdict(task).items())
    return f"warm-{kind}{config_key(config)}-{fields}-sft{steps}-seed{seed}"


def build_warm_start(path: Path, config=None, task: ArithmeticTask | None = None, steps: int = 400,
                     cache_dir=None, seed: int = 0) -> Path:
    """Build the warm start into ``path`` (atomically: a temporary sibling, then a rename, :func:`install_dir`: a
    directory another process finished meanwhile is kept, an incomplete one replaced)."""
    model, tok = load(cached_model_dir(config or tiny_config(), cache_dir, seed))
    warm_start(model, tok, task or ArithmeticTask(), steps, seed=seed)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    install_dir(tmp, path)
    return path


def warm_started_dir(config=None, task: ArithmeticTask | None = None, steps: int = 400, cache_dir=None,
                     seed: int = 0) -> Path:
    """The warm-started checkpoint for these settings. A pinned one (:mod:`gacbench.llm.pinned`) is the shipped
    directory, or, where that is absent, the one built here if it hashes to the pin (else a UsageError); any other
    is built once and cached. ``task`` is an :class:`ArithmeticTask` (the default) or another dataclass task (its
    class name joins the key)."""
    from gacbench.llm import pinned

    name = warm_key(config, task, steps, seed)
    path = Path(cache_dir or default_cache_dir()) / name

    def build() -> Path:
        if (path / "config.json").exists():
            return path
        return build_warm_start(path, config, task, steps, cache_dir, seed)

    return pinned.resolve(name, build)


def start_point(params: dict) -> tuple[str, object, ArithmeticTask, int] | None:
    """The built-in start point of a GRPO run with these parameters (a suite task's ``params``): (name, config,
    warm task, steps) of :func:`built_in_start`, or None when ``model.path`` names a checkpoint of the user's."""
    model = params.get("model") or {}
    if model.get("path"):
        return None
    cfg = TaskConfig(**(params.get("task") or {}))
    (config, task), steps = built_in_start(model.get("size", "tiny"), cfg), int(model.get("warm_steps", 400))
    return warm_key(config, task, steps), config, task, steps

