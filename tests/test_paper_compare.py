"""paper/compare.py: which shares and gaps of a republished grid moved beyond their intervals, on hand cases: every
kind of Fieller interval the report writes (bounded, exclusive, unbounded, none, and the older summaries' bounded
intervals without a kind), and two summaries with no entry in common refused."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _compare():
    spec = importlib.util.spec_from_file_location("compare", REPO / "paper" / "compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _entry(method, share, lo, hi, gap=-0.1, se=0.01, p=0.5, s=16, adj=True):
    e = {"task": "t", "method": method, "staleness": s, "share": share, "share_ci_low": lo, "share_ci_high": hi,
         "gap": gap, "gap_se": se, "vs_stale_p": p / 2}
    if adj:
        e["vs_stale_p_adj"] = p
    return e


def test_moves_are_beyond_both_intervals_only_when_each_share_is_outside_the_other_interval():
    old = {"recovered_reward": [_entry("a", 0.0, -0.1, 0.1), _entry("b", 0.0, -0.1, 0.1),
                                _entry("c", 0.0, -0.5, 0.5, p=0.01), _entry("only-old", 0.0, -1, 1)]}
    new = {"recovered_reward": [_entry("a", 0.5, 0.3, 0.7),   # each outside the other's interval
                                _entry("b", 0.2, -0.2, 0.6),  # new outside old's, old inside new's
                                _entry("c", 0.1, -0.4, 0.6, p=0.2, gap=-0.2)]}
    rows = {r["method"]: r for r in _compare().share_rows(old, new)}
    assert set(rows) == {"a", "b", "c"}
    assert rows["a"]["beyond_both"] and rows["a"]["diff"] == 0.5
    assert not rows["b"]["beyond_both"] and rows["b"]["beyond_one"]
    assert not rows["c"]["beyond_both"] and rows["c"]["verdict_changed"]  # adjusted p 0.01 -> 0.2
    assert not rows["a"]["verdict_changed"]


def test_the_raw_p_stands_in_where_a_summary_has_no_adjusted_one_and_gaps_use_their_se():
    old = {"recovered_reward": [_entry("a", 0.0, -0.1, 0.1, p=0.08, adj=False)]}  # raw p 0.04
    new = {"recovered_reward": [_entry("a", 0.0, -0.1, 0.1, p=0.2, gap=-0.2, se=0.02)]}
    mod = _compare()
    (row,) = mod.share_rows(old, new)
    # the old summary has no adjusted p, so both sides are read raw: 0.04 -> 0.1, and the new adjusted 0.2 is shown
    assert row["old_p"] == 0.04 and row["new_p"] == 0.1 and not row["p_adjusted"] and row["verdict_changed"]
    assert row["new_p_adj"] == 0.2 and not row["within_noise"]
    (gap,) = mod.gap_rows(old, new)
    assert gap["beyond_both"]  # -0.2 outside -0.1 +- 0.0196 and -0.1 outside -0.2 +- 0.039
    text = mod.markdown(old, new, "old", "new")
    assert "1 of 1 gaps" in text and "(verdict changed)" in text and "raw 0.040 → 0.100" in text


def test_a_raw_p_below_005_is_not_a_changed_verdict_when_only_the_new_summary_adjusts_it():
    old = {"recovered_reward": [_entry("a", 1.0, 0.8, 1.2, p=0.02, adj=False)]}  # raw 0.01
    new = {"recovered_reward": [_entry("a", 1.0, 0.8, 1.2, p=0.4, gap=-0.1)]}  # adjusted 0.4; raw set below
    new["recovered_reward"][0]["vs_stale_p"] = 0.01
    new["recovered_reward"][0]["gap_within_noise"] = True
    (row,) = _compare().share_rows(old, new)
    assert not row["verdict_changed"] and row["new_p_adj"] == 0.4 and row["within_noise"]
    assert "(gap within noise)" in _compare().markdown(old, new, "o", "n")


def _fieller_entry(method, share, kind, low=None, high=None, excluded=None, p=0.5):
    e = {"task": "t", "method": method, "staleness": 8, "share": share, "share_ci_kind": kind,
         "share_ci_low": low, "share_ci_high": high, "gap": -0.2, "gap_se": 0.01, "vs_stale_p": p}
    if excluded:
        e["share_ci_excluded"] = excluded
    return e


def test_every_kind_of_share_interval_is_compared_and_a_missing_share_is_named(tmp_path, capsys):
    tool = _compare()
    old = {"recovered_reward": [_fieller_entry("a", 0.5, "bounded", 0.4, 0.6), _fieller_entry("b", -4.3, "exclusive",
                                                                             excluded=[1.0, 1.3]),
                                _fieller_entry("c", 0.2, "unbounded"), _fieller_entry("d", None, None),
                                {**_fieller_entry("e", None, None), "task": "u", "gap": None, "missing": ["sync"]}]}
    new = {"recovered_reward": [_fieller_entry("a", 0.9, "bounded", 0.8, 1.0), _fieller_entry("b", 1.1, "exclusive",
                                                                             excluded=[-5.0, -4.0]),
                                _fieller_entry("c", 5.0, "unbounded"), _fieller_entry("d", 0.1, "bounded", 0.0, 0.2)]}
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
    (tmp_path / "other.json").write_text(json.dumps({"recovered_reward": [{**_fieller_entry("a", 0.5, "bounded", 0, 1),
                                                                          "task": "u"}]}))
    with pytest.raises(SystemExit, match="share no \\(task, method, staleness\\) entry"):
        tool.main([str(tmp_path / "old.json"), str(tmp_path / "other.json")])


def test_the_published_headline_summary_compares_with_itself_without_a_move(capsys):
    summary = REPO / "paper" / "llm-headline" / "summary.json"
    assert _compare().main([str(summary), str(summary)]) == 0
    assert "0 paired tests against stale changed their verdict" in capsys.readouterr().out
