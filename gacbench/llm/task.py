"""A procedural multi-step arithmetic task with an exact-answer reward and a held-out evaluation set.

A problem is an expression of 1 to ``max_ops`` operations on integers in [0, ``max_operand``]
(``+``, ``-``, ``*``, usual precedence), written without spaces and followed by ``=``; the answer
is the integer value in decimal. Problem i of a split is a pure function of (seed, split, i), so a
run is reproducible and a resumed run sees the same stream. The evaluation split is disjoint from
the training split by construction: a problem belongs to the evaluation split exactly when a hash of
its text falls in the evaluation bucket.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import ClassVar

OPS = "+-*"


@dataclass(frozen=True)
class Problem:
    prompt: str  # e.g. "3+14*2="
    answer: str  # e.g. "31"


def _is_eval(text: str, eval_fraction: float) -> bool:
    h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
    return (h % 10_000) < eval_fraction * 10_000


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

    def _draw(self, rng: random.Random) -> Problem:
        n = rng.randint(1, self.max_ops)
        terms = [str(rng.randint(0, self.max_operand)) for _ in range(n + 1)]
        ops = [rng.choice(OPS) for _ in range(n)]
        expr = terms[0] + "".join(o + t for o, t in zip(ops, terms[1:]))
        return Problem(expr + "=", str(eval(expr, {"__builtins__": {}})))  # digits and +-* only

    def problem(self, split: str, i: int) -> Problem:
        """Problem ``i`` of ``split`` ("train" or "eval"): deterministic, and in its split's bucket."""
        if split not in ("train", "eval"):
            raise ValueError(f"ArithmeticTask: split={split!r} is not 'train' or 'eval'")
        rng = random.Random(f"{self.seed}/{split}/{i}")
        while True:
            p = self._draw(rng)
            if _is_eval(p.prompt, self.eval_fraction) == (split == "eval"):
                return p

    def batch(self, split: str, start: int, size: int) -> list[Problem]:
        return [self.problem(split, start + k) for k in range(size)]


def exact_reward(completion: str, answer: str) -> float:
    """1.0 when the completion, up to its first newline or end, is exactly the answer (spaces ignored)."""
    return float(completion.split("\n", 1)[0].replace(" ", "") == answer)
