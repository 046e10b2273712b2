"""paper/compare.py: two summaries of one grid compared share by share, on every kind of Fieller interval the
report writes (bounded, exclusive, unbounded, none), and refused when they share no entry."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("compare", REPO / "paper" / "compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _entry(method, share, kind, low=None, high=None, excluded=None, p=0.5):
    e = {"task": "t", "method": method, "staleness": 8, "share": share, "share_ci_kind": kind,
         "share_ci_low": low, "share_ci_high": high, "gap": -0.2, "gap_se": 0.01, "vs_stale_p": p}
    if excluded:
        e["share_ci_excluded"] = excluded
    return e


def test_every_kind_of_share_interval_is_compared_and_a_missing_share_is_named(tmp_path, capsys):
    tool = _tool()
    old = {"recovered_reward": [_entry("a", 0.5, "bounded", 0.4, 0.6), _entry("b", -4.3, "exclusive",
                                                                             excluded=[1.0, 1.3]),
                                _entry("c", 0.2, "unbounded"), _entry("d", None, None),
                                {**_entry("e", None, None), "task": "u", "gap": None, "missing": ["sync"]}]}
    new = {"recovered_reward": [_entry("a", 0.9, "bounded", 0.8, 1.0), _entry("b", 1.1, "exclusive",
                                                                             excluded=[-5.0, -4.0]),
                                _entry("c", 5.0, "unbounded"), _entry("d", 0.1, "bounded", 0.0, 0.2)]}
    rows = {r["method"]: r for r in tool.share_rows(old, new)}
    assert rows["a"]["beyond_both"] and rows["a"]["comparable"]  # each outside the other's bounded interval
    assert rows["b"]["beyond_both"]  # 1.1 in the old excluded band (1.0, 1.3), -4.3 in the new one
    assert not rows["c"]["beyond_one"]  # an unbounded interval holds every share
    assert not rows["d"]["comparable"] and rows["d"]["diff"] is None
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    assert tool.main([str(tmp_path / "old.json"), str(tmp_path / "new.json")]) == 0
    out = capsys.readouterr().out
    assert "(−∞, +1.00] ∪ [+1.30, ∞)" in out and "| — — | +0.10 [+0.00, +0.20] | — | no interval |" in out
    assert "2 of 4 shares moved beyond both intervals" in out and "1 rows lack a share or an interval" in out
    assert "0 of 1 gaps" in out  # an entry without its sync or stale group has no gap to compare
    (tmp_path / "other.json").write_text(json.dumps({"recovered_reward": [{**_entry("a", 0.5, "bounded", 0, 1),
                                                                          "task": "u"}]}))
    with pytest.raises(SystemExit, match="share no \\(task, method, staleness\\) entry"):
        tool.main([str(tmp_path / "old.json"), str(tmp_path / "other.json")])


def test_the_published_headline_summary_compares_with_itself_without_a_move(capsys):
    summary = REPO / "paper" / "llm-headline" / "summary.json"
    assert _tool().main([str(summary), str(summary)]) == 0
    assert "0 paired tests against stale changed their verdict" in capsys.readouterr().out
