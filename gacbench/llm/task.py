"""Procedural arithmetic tasks with exact-answer rewards and held-out evaluation sets.

``ArithmeticTask``: the answer alone. ``ScratchpadTask``: the same expressions with a written scratchpad of
intermediate results before the answer, so that a correct completion is several times longer.

A problem is an expression of 1 to ``max_ops`` operations on integers in [0, ``max_operand``]
(``+``, ``-``, ``*``, usual precedence), written without spaces and followed by ``=``; the answer
is the integer value in decimal. Problem i of a split is a pure function of (seed, split, i), so a
run is reproducible and a resumed run sees the same stream. The evaluation split is disjoint from
the training split by construction: a problem belongs to the evaluation split exactly when a hash of
its text falls in the evaluation bucket.
"""

from __future__ import annotations

import functools
import hashlib
import random
from dataclasses import dataclass
from typing import ClassVar

from gacbench.usage import UsageError

OPS = "+-*"


@dataclass(frozen=True)
class Problem:
    prompt: str  # e.g. "3+14*2="
    answer: str  # e.g. "31"
    solution: str = ""  # the full text a warm-start teaches before its end of line; "" = the answer alone

    @property
    def target(self) -> str:
        return self.solution or self.answer


def _is_eval(text: str, eval_fraction: float) -> bool:
    h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
    return (h % 10_000) < eval_fraction * 10_000


def _max_draws(eval_fraction: float) -> int:
    """Draws a task makes for one problem before it concludes that its split holds none: 200 / (the smaller
    split's share), at least 10,000. A split that holds a share p of the draws is missed that many times in a row
    with probability about exp(-200) when p is its nominal share."""
    return max(10_000, int(200 / min(eval_fraction, 1.0 - eval_fraction)))


@functools.lru_cache(maxsize=1 << 16)
def _drawn(task, split: str, i: int) -> Problem:
    """``task._problem(split, i)``, a pure function of the (frozen, hashable) task's settings, split and i; a
    problem costs about ten rejection draws."""
    return task._problem(split, i)


def _check_splits(task) -> None:
    """Refuse (a UsageError naming the settings) a task whose train or eval split holds no problem: a small problem
    space (few operations on small operands) can leave a split's hash bucket empty, and drawing from it would not
    end."""
    for split in ("eval", "train"):
        task.problem(split, 0)


@dataclass(frozen=True)
class ArithmeticTask:
    """Args: max_ops (operations per problem, at least 1), max_operand, eval_fraction (share of the
    problem space held out), seed."""

    max_ops: int = 2
    max_operand: int = 9
    eval_fraction: float = 0.1
    seed: int = 0
    default_reward: ClassVar[str] = "exact"
    tiny_tokenizer: ClassVar[bool] = True  # prompts use only digits and +-*=

    def __post_init__(self) -> None:
        if self.max_ops < 1 or self.max_operand < 1:
            raise ValueError(f"ArithmeticTask: need max_ops >= 1 and max_operand >= 1, got {self.max_ops}, "
                             f"{self.max_operand}")

        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"ArithmeticTask: eval_fraction={self.eval_fraction} must be in (0, 1)")
        _check_splits(self)

    def _draw(self, rng: random.Random) -> Problem:
        n = rng.randint(1, self.max_ops)
        terms = [str(rng.randint(0, self.max_operand)) for _ in range(n + 1)]
        ops = [rng.choice(OPS) for _ in range(n)]
        expr = terms[0] + "".join(o + t for o, t in zip(ops, terms[1:]))
        return Problem(expr + "=", str(eval(expr, {"__builtins__": {}})))  # digits and +-* only

    def problem(self, split: str, i: int) -> Problem:
        """Problem ``i`` of ``split`` ("train" or "eval"): deterministic, and in its split's bucket (drawn once per
        process: a run reads its evaluation problems again at every evaluation)."""
        return _drawn(self, split, i)

    def _problem(self, split: str, i: int) -> Problem:
        if split not in ("train", "eval"):
            raise ValueError(f"{type(self).__name__}: split={split!r} is not 'train' or 'eval'")
        rng = random.Random(f"{self.seed}/{split}/{i}")
        draws = _max_draws(self.eval_fraction)
        for _ in range(draws):
            p = self._draw(rng)
            if _is_eval(p.prompt, self.eval_fraction) == (split == "eval"):
                return p
        settings = ", ".join(f"{k}={v}" for k, v in vars(self).items() if k != "seed")
        raise UsageError(f"{type(self).__name__}({settings}): its {split} split holds no problem ({draws} "
                         "draws found none in its hash bucket): the problem space is too small for this "
                         "eval_fraction; raise task.max_operand or task.max_ops, or move task.eval_fraction")

    def batch(self, split: str, start: int, size: int) -> list[Problem]:
        return [self.problem(split, start + k) for k in range(size)]


def scratchpad_lines(terms: list[int], ops: list[str]) -> tuple[list[str], int]:
    """The scratchpad of ``terms[0] ops[0] terms[1] ...``: one line ``a<op>b=c`` per operation, every ``*``
    first (leftmost first), then ``+`` and ``-`` from the left; and the value."""
    terms, ops, lines = list(terms), list(ops), []
    while "*" in ops:
        i = ops.index("*")
        a, b = terms[i], terms[i + 1]
        lines.append(f"{a}*{b}={a * b}")
        terms[i : i + 2] = [a * b]
        del ops[i]
    while ops:
        a, b, op = terms[0], terms[1], ops.pop(0)
        c = a + b if op == "+" else a - b
        lines.append(f"{a}{op}{b}={c}")
        terms[0:2] = [c]
    return lines, terms[0]


@dataclass(frozen=True)
class ScratchpadTask:
    """Arithmetic with a written scratchpad: an expression of ``min_ops`` to ``max_ops`` operations on integers in
    [0, ``max_operand``] (``+``, ``-``, ``*``, usual precedence), answered by one line per operation
    (:func:`scratchpad_lines`: ``a<op>b=c``, multiplications first) and a last line with the value, lines
    separated by newlines: ``2+3*4-5=`` -> ``3*4=12`` / ``2+12=14`` / ``14-5=9`` / ``9``. A warm-start
    teaches that text, a newline and ``<eos>``; with the defaults (3 operations on 0..9) such a completion is
    25.4 tokens on average (21 to 33; prompts are 8 tokens). The reward (:func:`final_line_reward`) checks only
    the final line. Problem i of a split is a pure function of (seed, split, i); the evaluation split is disjoint
    from the training split as in :class:`ArithmeticTask`."""

    min_ops: int = 3
    max_ops: int = 3
    max_operand: int = 9
    eval_fraction: float = 0.1
    seed: int = 0
    default_reward: ClassVar[str] = "final-line"
    tiny_tokenizer: ClassVar[bool] = True  # digits, +-*=, newline
    warm_on_task: ClassVar[bool] = True  # the warm-start trains on this task's solutions, not on ArithmeticTask

    def __post_init__(self) -> None:
        if not 1 <= self.min_ops <= self.max_ops or self.max_operand < 1:
            raise UsageError(f"ScratchpadTask: need 1 <= min_ops <= max_ops and max_operand >= 1, got min_ops="
                             f"{self.min_ops}, max_ops={self.max_ops}, max_operand={self.max_operand}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise UsageError(f"ScratchpadTask: eval_fraction={self.eval_fraction} must be in (0, 1)")
        _check_splits(self)

    def _draw(self, rng: random.Random) -> Problem:
        n = rng.randint(self.min_ops, self.max_ops)
        terms = [rng.randint(0, self.max_operand) for _ in range(n + 1)]
        ops = [rng.choice(OPS) for _ in range(n)]
        lines, value = scratchpad_lines(terms, ops)
        prompt = str(terms[0]) + "".join(o + str(t) for o, t in zip(ops, terms[1:])) + "="
        return Problem(prompt, str(value), "\n".join([*lines, str(value)]))

    problem = ArithmeticTask.problem
    _problem = ArithmeticTask._problem
    batch = ArithmeticTask.batch


def exact_reward(completion: str, answer: str) -> float:
    """1.0 when the completion, up to its first newline or end, is exactly the answer (spaces ignored in both)."""
    return float(completion.split("\n", 1)[0].replace(" ", "") == answer.replace(" ", ""))


def final_line_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's final line is exactly the answer (spaces ignored in both). The final line is the last
    one after trailing newlines are dropped, so ``...\n14-5=9\n9\n`` ends in ``9``; the lines before it (the
    scratchpad) are not checked, and a completion cut off by ``max_tokens`` ends in whatever line it reached."""
    return float(completion.rstrip("\n").rsplit("\n", 1)[-1].replace(" ", "") == answer.replace(" ", ""))
