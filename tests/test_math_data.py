"""Local math datasets: \\boxed{} extraction, loading and validation, splits, and the math-verify reward."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from gacbench.llm.datasets import MathDataset, extract_boxed, math_verify_reward
from gacbench.llm.task import _is_eval, exact_reward
from gacbench.llm.tasks import reward_fn

EXAMPLE = Path(__file__).resolve().parents[1] / "tasks" / "math" / "example.jsonl"


def _write(tmp_path: Path, lines: list[str], name: str = "d.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("text, want", [
    (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"\boxed{1} then \boxed{ 2 }", "2"),
    (r"\fbox{x^{2}}", "x^{2}"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"\boxed {a{b{c}}d}", "a{b{c}}d"),
    ("no box here", None),
    (r"\boxed{\frac{1}{2}", None),
    (r"\boxed{3} and \boxed{", None),
])
def test_extract_boxed(text, want):
    assert extract_boxed(text) == want


def test_example_dataset_loads():
    d = MathDataset(EXAMPLE)
    rows = [json.loads(line) for line in EXAMPLE.read_text().splitlines() if line.strip()]
    assert len(d) == len(rows) == sum(d.sizes.values()) and min(d.sizes.values()) >= 1
    train = {p.prompt for p in d.batch("train", 0, d.sizes["train"])}
    evals = {p.prompt for p in d.batch("eval", 0, d.sizes["eval"])}
    assert len(train) == d.sizes["train"] and len(evals) == d.sizes["eval"] and not train & evals
    assert all(_is_eval(p, 0.1) for p in evals) and not any(_is_eval(p, 0.1) for p in train)
    assert all(p.answer for s in ("train", "eval") for p in d.batch(s, 0, d.sizes[s]))
    again = MathDataset(EXAMPLE)
    assert d.batch("train", 0, 60) == again.batch("train", 0, 60)  # deterministic, cycling past the end
    assert d.problem("train", 3) == d.problem("train", 3 + d.sizes["train"])
    other = MathDataset(EXAMPLE, seed=1)
    assert (other.sizes == d.sizes
            and set(other.batch("train", 0, d.sizes["train"])) == set(d.batch("train", 0, d.sizes["train"])))
    assert other.batch("train", 0, d.sizes["train"]) != d.batch("train", 0, d.sizes["train"])  # seed shuffles
    with pytest.raises(ValueError, match="split='test'"):
        d.problem("test", 0)


def test_fields_template_and_answers(tmp_path):
    path = _write(tmp_path, [
        json.dumps({"question": "Q1?", "answer": 7}),
        "",
        json.dumps({"problem": "Q2?", "answer": r"so \boxed{\frac{1}{3}}"}),
        json.dumps({"prompt": "Q3?", "solution": r"first \boxed{1}, finally \boxed{x^{2}}"}),
        json.dumps({"q": "Q4?", "gold": "4"}),
    ])
    with pytest.raises(ValueError, match=r"line 5: no prompt field"):
        MathDataset(path, eval_fraction=0.5)
    path = _write(tmp_path, path.read_text().splitlines()[:4])
    d = MathDataset(path, eval_fraction=0.5, template="Solve: {problem} Answer in \\boxed{{}}.")
    got = {p.prompt: p.answer for s in ("train", "eval") for p in d.batch(s, 0, d.sizes[s])}
    assert got == {"Solve: Q1? Answer in \\boxed{}.": "7", "Solve: Q2? Answer in \\boxed{}.": r"\frac{1}{3}",
                   "Solve: Q3? Answer in \\boxed{}.": "x^{2}"}
    keyed = _write(tmp_path, [json.dumps({"q": f"Q{i}?", "gold": str(i)}) for i in range(20)], "k.jsonl")
    d = MathDataset(keyed, prompt_key="q", answer_key="gold", eval_fraction=0.3)
    assert len(d) == 20 and {p.answer for p in d.batch("train", 0, d.sizes["train"])} < {str(i) for i in range(20)}
    with pytest.raises(ValueError, match="template"):
        MathDataset(keyed, prompt_key="q", answer_key="gold", template="{problem} \\boxed{}")


def test_parquet_matches_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [json.loads(line) for line in EXAMPLE.read_text().splitlines() if line.strip()]
    cols = {k: [r.get(k) for r in rows] for k in ("problem", "answer", "solution")}
    cols["answer"] = [None if a is None else str(a) for a in cols["answer"]]
    pq.write_table(pa.table(cols), tmp_path / "example.parquet")
    a, b = MathDataset(EXAMPLE), MathDataset(tmp_path / "example.parquet")
    assert a.sizes == b.sizes
    assert all(a.batch(s, 0, a.sizes[s]) == b.batch(s, 0, b.sizes[s]) for s in ("train", "eval"))
    pq.write_table(pa.table({"problem": ["A?", "B?"], "solution": [r"\boxed{1}", "no box"]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad.parquet: row 2: no \\boxed"):
        MathDataset(tmp_path / "bad.parquet")
    # a decimal column (pyarrow reads it as decimal.Decimal) holds finite numbers: read as their text
    from decimal import Decimal

    answers = pa.array([Decimal(i) / 2 for i in range(40)], pa.decimal128(10, 1))
    pq.write_table(pa.table({"problem": [f"What is {i}/2?" for i in range(40)], "answer": answers}),
                   tmp_path / "decimal.parquet")
    d = MathDataset(tmp_path / "decimal.parquet", eval_fraction=0.3)
    got = d.batch("train", 0, d.sizes["train"]) + d.batch("eval", 0, d.sizes["eval"])
    assert sorted(p.answer for p in got) == sorted(f"{i / 2:.1f}" for i in range(40))  # the column's scale


GOOD = json.dumps({"problem": "What is 1+1?", "answer": "2"})


@pytest.mark.parametrize("bad, match", [
    ('{"problem": "What is 2+2?", "answer": "4"', r"line 3: invalid JSON"),
    ('["What is 2+2?", "4"]', r"line 3: expected a JSON object, got list"),
    (json.dumps({"text": "What is 2+2?", "answer": "4"}),
     r"line 3: no prompt field .*'prompt', 'problem' or 'question'"),

    (json.dumps({"problem": "What is 2+2?"}), r"line 3: no answer .*add an 'answer' field"),
    (json.dumps({"problem": "What is 2+2?", "answer": None}), r"line 3: no answer \('answer' is null; fields"),
    (json.dumps({"problem": "What is 2+2?", "solution": 4}),
     r"line 3: the 'solution' field is int, not text; give it as a string ending with \\boxed"),
    (json.dumps({"problem": "What is 2+2?", "solution": "It is 4."}),
     r"line 3: no \\boxed\{\.\.\.\} .*add an 'answer' field or end the solution with \\boxed"),
    (json.dumps({"problem": "What is 2+2?", "answer": "  "}), r"line 3: the answer is empty"),
    (json.dumps({"problem": "", "answer": "4"}), r"line 3: prompt field 'problem' must be a non-empty string"),
    (json.dumps({"problem": "What is 2+2?", "answer": True}), r"line 3: answer field 'answer' is True \(bool\)"),
    (json.dumps({"problem": "What is 2+2?", "answer": [1, 2]}), r"line 3: answer field 'answer' is \[1, 2\]"),
    (json.dumps({"problem": "What is 2+2?", "answer": {"x": 1}}), r"line 3: answer field 'answer' is \{'x': 1\}"),
    ('{"problem": "What is 2+2?", "answer": NaN}', r"line 3: answer field 'answer' is nan \(float\)"),
])
def test_malformed_rows(tmp_path, bad, match):
    path = _write(tmp_path, [GOOD, "", bad, GOOD])
    with pytest.raises(ValueError, match=match) as err:
        MathDataset(path)
    assert str(path) in str(err.value)


def test_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file: .*; give task.path an existing .jsonl or .parquet"):
        MathDataset(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError, match="is a folder; give the dataset's .jsonl or .parquet file"):
        MathDataset(tmp_path)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe" + GOOD.encode())
    with pytest.raises(ValueError, match=r"binary\.jsonl: not UTF-8 text \(byte 0: invalid start byte\)"):
        MathDataset(binary)
    with pytest.raises(ValueError, match=r"unknown extension '\.csv'"):
        MathDataset(_write(tmp_path, ["problem,answer"], "d.csv"))
    with pytest.raises(ValueError, match="holds no rows"):
        MathDataset(_write(tmp_path, ["", " "]))
    with pytest.raises(ValueError, match="eval split is empty"):
        MathDataset(_write(tmp_path, [GOOD]), eval_fraction=0.01)
    with pytest.raises(ValueError, match="must be in"):
        MathDataset(EXAMPLE, eval_fraction=0.0)


def test_rows_with_line_separators_inside_strings_load_and_numeric_golds_are_read(tmp_path):
    # json.dumps(ensure_ascii=False) writes U+2028, U+2029 and U+0085 unescaped: one row is one line still
    rows = [{"problem": f"What is {i}+{i}?\u2028Reply\u0085now\u2029.", "answer": 2 * i} for i in range(40)]
    path = tmp_path / "sep.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    d = MathDataset(path, eval_fraction=0.3)
    got = d.batch("train", 0, d.sizes["train"]) + d.batch("eval", 0, d.sizes["eval"])
    assert sorted((p.prompt, p.answer) for p in got) == sorted((r["problem"], str(r["answer"])) for r in rows)


def test_numbers_with_a_fraction_are_read_as_written_in_positional_notation(tmp_path):
    """A float's text (1e-05) is, to math-verify, an expression in Euler's number e: the gold would never verify."""
    written = ["1e-05", "0.5", "2.50", "1E+2", "-0.125"]
    want = {"1e-05": "0.00001", "0.5": "0.5", "2.50": "2.50", "1E+2": "100", "-0.125": "-0.125"}
    lines = [f'{{"problem": "Q{i} {w}?", "answer": {w}}}' for i in range(8) for w in written]
    path = _write(tmp_path, lines)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())  # a byte-order mark before line 1
    d = MathDataset(path, eval_fraction=0.3)
    got = {p.prompt: p.answer for s in ("train", "eval") for p in d.batch(s, 0, d.sizes[s])}
    assert len(got) == 40 and all(answer == want[prompt.split()[1][:-1]] for prompt, answer in got.items())
    assert math_verify_reward(r"\boxed{0.00001}", want["1e-05"]) == 1.0
    assert math_verify_reward(r"\boxed{10^{-5}}", want["1e-05"]) == 1.0
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"problem": [f"Q{i}?" for i in range(40)], "answer": [1e-05 * (i + 1) for i in range(40)]}),
                   tmp_path / "double.parquet")
    d = MathDataset(tmp_path / "double.parquet", eval_fraction=0.3)
    answers = {p.answer for s in ("train", "eval") for p in d.batch(s, 0, d.sizes[s])}
    assert "0.00001" in answers and not any("e" in a.lower() for a in answers)


def test_a_template_that_reads_beyond_the_problem_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"template '\{problem.text\}' must use only \{problem\}"):
        MathDataset(EXAMPLE, template="{problem.text}")
    for template in ("{problem[0]}", "Q: {problem.strip}", "{problem} {0}"):  # {problem.strip} formats, into text
        with pytest.raises(ValueError, match="must use only"):  # of str's, that differs from process to process
            MathDataset(EXAMPLE, template=template)
    formatted = MathDataset(EXAMPLE, template="Q: {problem!s:>3} \\boxed{{}}").batch("train", 0, 1)[0]
    assert formatted.prompt.startswith("Q: ") and formatted.prompt.endswith("\\boxed{}")


def test_copies_of_a_problem_that_differ_in_spacing_fall_in_one_split(tmp_path):
    texts = [f"What is {i} + {i}?" for i in range(40)]
    lines = [json.dumps({"problem": t, "answer": "1"}) for t in texts]
    lines += [json.dumps({"problem": f"  {t.replace(' ', '  ')}\n", "answer": "1"}) for t in texts]
    d = MathDataset(_write(tmp_path, lines), eval_fraction=0.3)
    held = {" ".join(p.prompt.split()) for p in d.batch("eval", 0, d.sizes["eval"])}
    trained = {" ".join(p.prompt.split()) for p in d.batch("train", 0, d.sizes["train"])}
    assert held and trained and not held & trained


def test_reward_registry():
    assert reward_fn("exact") is exact_reward and reward_fn("math-verify") is math_verify_reward
    with pytest.raises(ValueError, match="registered rewards: exact, final-line, math-verify"):
        reward_fn("f1")


@pytest.mark.parametrize("completion, answer, want", [
    (r"The answer is \boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{3}", "3", 1.0),
    (r"We get x = 3, so \boxed{3}.", "3", 1.0),
    (r"Thus \boxed{\frac{2}{4}}", "0.5", 1.0),
    (r"so it is $2\sqrt{2}$", r"\sqrt{8}", 1.0),
    (r"The answer is \boxed{4}", "3", 0.0),
    (r"}}{{\boxed{\frac{ $$ \\", "3", 0.0),
    ("", "3", 0.0),
    (r"\boxed{9^{9^{9^{9}}}}", "1", 0.0),  # would run for minutes unguarded
    (r"The answer is \boxed{3}. Wait, no: \boxed{5}", "5", 1.0),  # the last \boxed{} is the answer
    (r"The answer is \boxed{3}. Wait, no: \boxed{5}", "3", 0.0),
    (r"\boxed{3} Let me recheck. \boxed{4}", "4", 1.0),
])
def test_math_verify_reward(completion, answer, want):
    pytest.importorskip("math_verify")
    assert math_verify_reward(completion, answer) == want


def test_math_verify_reward_in_thread():
    pytest.importorskip("math_verify")
    cases = [(r"so \boxed{0.5}", r"\frac{1}{2}", 1.0), (r"\boxed{4}", "3", 0.0), (r"\boxed{9^{9^{9^{9}}}}", "1", 0.0)]
    out: list[object] = []

    def work() -> None:
        try:
            out.extend(math_verify_reward(c, a) for c, a, _ in cases)
        except BaseException as e:  # surfaced below
            out.append(e)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive() and out == [w for _, _, w in cases]


def test_example_golds_verify():
    pytest.importorskip("math_verify")
    d = MathDataset(EXAMPLE)
    for s in ("train", "eval"):
        for p in d.batch(s, 0, d.sizes[s]):
            assert math_verify_reward(f"Working it out, the answer is \\boxed{{{p.answer}}}.", p.answer) == 1.0, p


def test_missing_optional_packages(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` raise ImportError
    with pytest.raises(ImportError, match=r"pip install -e '\.\[llm\]'"):
        math_verify_reward(r"\boxed{1}", "1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "d.parquet").write_bytes(b"")
    with pytest.raises(ImportError, match="pip install pyarrow"):
        MathDataset(tmp_path / "d.parquet")
