"""Local math datasets (JSONL or Parquet) with ``\\boxed{}`` answers, and a math-verify reward.

A dataset file holds one problem per row: a prompt field ("prompt", "problem" or "question", or
``prompt_key``) and a gold answer, read from an "answer" field (or ``answer_key``) or else from the
last ``\\boxed{...}`` of a "solution" field. Every row is checked when the file is loaded, and a bad
row is reported with its 1-based line (JSONL) or row (Parquet) number. ``MathDataset`` has the
interface of ``ArithmeticTask`` (``problem(split, i)``, ``batch(split, start, size)``): the rows are
split into train and eval by a hash of the problem text (so the split depends neither on the seed
nor on the row order), and each split is visited in an order shuffled by the seed, cycling.
"""

from __future__ import annotations

import decimal
import functools
import json
import math
import random
import re
import string
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from gacbench.llm.task import Problem, _is_eval

PROMPT_KEYS = ("prompt", "problem", "question")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_TIMEOUT_S = 5  # math-verify's per-parse and per-comparison limit, main thread only (signal.alarm)
_MAX_ARG = 1e5  # a larger exponent or factorial argument in a completion's answer scores 0 unevaluated


def extract_boxed(text: str) -> str | None:
    """The stripped content of the last ``\\boxed{...}`` or ``\\fbox{...}`` in ``text``, with nested
    braces balanced and escaped ones (``\\{``, ``\\}``) skipped: ``"so \\boxed{\\frac{1}{2}}."`` gives
    ``"\\frac{1}{2}"``. None when there is none, or when the last one's braces do not close."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    start = j = matches[-1].end()
    depth = 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        depth += (c == "{") - (c == "}")
        if depth == 0:
            return text[start:j].strip()
        j += 1
    return None


def _read_rows(path: Path) -> tuple[str, list[tuple[int, Any]]]:
    """(unit, [(number, row)]): the rows of a .jsonl (numbered by line, blank lines skipped) or
    .parquet file (numbered by row), with ``unit`` "line" or "row" for error messages."""
    if path.is_dir():
        raise FileNotFoundError(f"MathDataset: {path} is a folder; give the dataset's .jsonl or .parquet file")
    if not path.is_file():
        raise FileNotFoundError(f"MathDataset: no such file: {path}; give task.path an existing .jsonl or .parquet "
                                "file (one problem per line or row)")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        try:
            text = path.read_text(encoding="utf-8-sig")  # a byte-order mark, if any, is not part of line 1
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); a .jsonl dataset is one JSON "
                             "object per line in UTF-8 (or give a .parquet file)") from None
        # lines end at "\n" only: str.splitlines() would also split inside a JSON string at U+2028, U+2029,
        # U+0085 and other separators that json.dumps(ensure_ascii=False) writes unescaped
        for n, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                # numbers with a fraction as written (1e-05 read as a float would become the text "1e-05",
                # which math-verify reads as an expression in Euler's number e)
                rows.append((n, json.loads(line, parse_float=decimal.Decimal)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {n}: invalid JSON ({e.msg} at column {e.colno}); "
                                 f"write one JSON object per line") from e
        return "line", rows
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError("MathDataset: reading .parquet needs pyarrow: pip install pyarrow") from e
        return "row", list(enumerate(pq.read_table(path).to_pylist(), 1))
    raise ValueError(f"MathDataset: {path}: unknown extension {path.suffix!r}; use .jsonl or .parquet")


@dataclass(frozen=True)
class MathDataset:
    """Args: path (.jsonl or .parquet), prompt_key (default: the first of "prompt", "problem",
    "question" present in the row), answer_key (default: "answer" if present, else the last
    ``\\boxed{}`` of "solution"), eval_fraction (share of the problem texts held out, in (0, 1)),
    seed (the visiting order within each split), template (the prompt, ``str.format``-ed with
    ``problem=``; write literal braces doubled, e.g. ``"{problem} Put the answer in \\\\boxed{{}}."``).

    Both splits must be non-empty, else the constructor raises (no silent fallback: a tiny file with
    no held-out row needs a larger eval_fraction or more rows)."""

    path: str | Path
    prompt_key: str | None = None
    answer_key: str | None = None
    eval_fraction: float = 0.1
    seed: int = 0
    template: str = "{problem}"
    default_reward: ClassVar[str] = "math-verify"
    _splits: dict[str, list[Problem]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        path = Path(self.path)
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"MathDataset: eval_fraction={self.eval_fraction} must be in (0, 1)")
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None]
            self.template.format(problem="")
            problem = ValueError(f"fields {fields}") if any(f != "problem" for f in fields) else None
        except (KeyError, IndexError, ValueError, AttributeError, TypeError) as e:
            problem = e
        if problem is not None:  # {problem.strip} or {problem[0]} would format, into text of str's
            raise ValueError(f"MathDataset: template {self.template!r} must use only {{problem}}; "
                             f"write literal braces doubled, e.g. \\boxed{{{{}}}} ({problem!r})") from None
        unit, rows = _read_rows(path)
        splits: dict[str, list[Problem]] = {"train": [], "eval": []}
        for n, row in rows:
            text, answer = self._parse_row(row, f"{path}: {unit} {n}")
            # the split hashes the text with its white space collapsed, so that two copies of a problem that
            # differ only in spacing land in the same split
            split = "eval" if _is_eval(" ".join(text.split()), self.eval_fraction) else "train"
            splits[split].append(Problem(self.template.format(problem=text), answer))
        if not rows:
            raise ValueError(f"MathDataset: {path} holds no rows")
        for split, probs in splits.items():
            if not probs:
                raise ValueError(f"MathDataset: {path}: the {split} split is empty ({len(rows)} rows, "
                                 f"eval_fraction={self.eval_fraction}); change eval_fraction or add rows")
            random.Random(f"{self.seed}/{split}").shuffle(probs)
        object.__setattr__(self, "_splits", splits)

    def _parse_row(self, row: Any, where: str) -> tuple[str, str]:
        """(problem text, gold answer) of one row, or a ValueError that says what is wrong and the fix."""
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}; "
                             f"write one object per line, e.g. {{\"problem\": ..., \"answer\": ...}}")
        keys = [self.prompt_key] if self.prompt_key else [k for k in PROMPT_KEYS if row.get(k) is not None][:1]
        if not keys or row.get(keys[0]) is None:
            want = repr(self.prompt_key) if self.prompt_key else "'prompt', 'problem' or 'question'"
            raise ValueError(f"{where}: no prompt field (looked for {want}; fields: {sorted(row)}); "
                             f"add one, or pass prompt_key=")
        text = row[keys[0]]
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: prompt field {keys[0]!r} must be a non-empty string; fix the row")
        akey = self.answer_key or ("answer" if row.get("answer") is not None else None)
        if akey is not None:
            if row.get(akey) is None:
                raise ValueError(f"{where}: no answer field {akey!r} (fields: {sorted(row)}); add it, "
                                 f"or pass answer_key=")
            raw = row[akey]  # a .parquet decimal column reads as decimal.Decimal
            if isinstance(raw, bool) or not isinstance(raw, (str, int, float, decimal.Decimal)) or (
                    isinstance(raw, float) and not math.isfinite(raw)) or (
                    isinstance(raw, decimal.Decimal) and not raw.is_finite()):
                raise ValueError(f"{where}: answer field {akey!r} is {raw!r} ({type(raw).__name__}); give the gold "
                                 "answer as a string (or a finite number)")
            if isinstance(raw, float):  # a .parquet double: its shortest decimal form
                raw = decimal.Decimal(repr(raw))
            # a number in positional notation (str would write 1E-7 or 1e-05, which math-verify reads with e)
            answer: str | None = (format(raw, "f") if isinstance(raw, decimal.Decimal) else str(raw)).strip()
            if "\\boxed" in answer or "\\fbox" in answer:
                answer = extract_boxed(answer)
                if answer is None:
                    raise ValueError(f"{where}: answer {row[akey]!r} has an unclosed \\boxed{{; balance its braces")
        elif isinstance(row.get("solution"), str):
            answer = extract_boxed(row["solution"])
            if answer is None:
                raise ValueError(f"{where}: no \\boxed{{...}} (or unbalanced braces) in the solution; add an "
                                 f"'answer' field or end the solution with \\boxed{{...}}")
        elif "solution" in row and row["solution"] is not None:
            raise ValueError(f"{where}: the 'solution' field is {type(row['solution']).__name__}, not text; give it "
                             "as a string ending with \\boxed{...}, or add an 'answer' field")
        else:
            held = [k for k in ("answer", "solution") if k in row]
            what = (f"{' and '.join(repr(k) for k in held)} {'is' if len(held) == 1 else 'are'} null" if held
                    else "neither an 'answer' nor a 'solution' field")
            raise ValueError(f"{where}: no answer ({what}; fields: {sorted(row)}); add an 'answer' field or a "
                             f"solution ending with \\boxed{{...}}")
        if not answer:
            raise ValueError(f"{where}: the answer is empty; give a non-empty answer")
        return text, answer

    @property
    def sizes(self) -> dict[str, int]:
        """{"train": rows in the train split, "eval": rows in the eval split}."""
        return {s: len(p) for s, p in self._splits.items()}

    def __len__(self) -> int:
        return sum(self.sizes.values())

    def problem(self, split: str, i: int) -> Problem:
        """Row ``i`` (modulo the split's size) of ``split`` ("train" or "eval") in its shuffled order."""
        if split not in self._splits:
            raise ValueError(f"MathDataset: split={split!r} is not 'train' or 'eval'")
        probs = self._splits[split]
        return probs[i % len(probs)]

    def batch(self, split: str, start: int, size: int) -> list[Problem]:
        return [self.problem(split, start + k) for k in range(size)]


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError as e:
        raise ImportError("the 'math-verify' reward needs math-verify: pip install -e '.[llm]'") from e
    return math_verify


@functools.lru_cache(maxsize=65536)
def _parse_gold(answer: str, timeout: int | None) -> tuple[Any, ...]:
    return tuple(_math_verify().parse("\\boxed{" + answer + "}", parsing_timeout=timeout))


def _too_big(expr: Any) -> bool:
    """Whether a parsed answer holds a power with an exponent, or a factorial with an argument, above
    _MAX_ARG in size (e.g. ``9^{9^{9^9}}``): sympy would evaluate it exactly, in C, for minutes, holding
    the GIL, which neither math-verify's alarm nor another thread can interrupt. Children are checked
    before their parents, so the exponent checked is itself small enough to evaluate."""
    import sympy

    if not isinstance(expr, sympy.Basic):
        return False
    for node in sympy.postorder_traversal(expr):
        arg = node.exp if isinstance(node, sympy.Pow) else node.args[0] if isinstance(node, sympy.factorial) else None
        try:
            if arg is not None and arg.is_number and abs(complex(arg.evalf(5))) > _MAX_ARG:
                return True
        except (TypeError, ValueError, ArithmeticError):
            continue
    return False


def math_verify_reward(completion: str, answer: str) -> float:
    """1.0 when math-verify judges the completion's final answer (the content of its last ``\\boxed{}``
    when it has one, else what math-verify's ``parse`` extracts from the whole text: its LaTeX and plain
    expressions, an "answer:" marker first) equal to the gold ``answer`` (read as ``\\boxed{answer}``),
    else 0.0; never raises on a garbled completion. math-verify bounds parsing and comparison with
    ``signal.alarm``, which only works in the main thread: there the limit is 5 s each, and in any
    other thread without one (the guard against huge powers and factorials, ``_too_big``, keeps the
    known runaway cases out of both)."""
    mv = _math_verify()
    timeout = _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        gold = _parse_gold(answer, timeout)
        boxed = extract_boxed(completion)
        pred = mv.parse(completion if boxed is None else "\\boxed{" + boxed + "}", parsing_timeout=timeout)
        if any(_too_big(p) for p in pred):
            return 0.0
        return float(bool(gold and pred and mv.verify(list(gold), pred, timeout_seconds=timeout)))
    except BaseException as e:  # math-verify's TimeoutException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return 0.0
