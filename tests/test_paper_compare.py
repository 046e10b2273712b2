"""paper/compare.py: which shares and gaps of a republished grid moved beyond their intervals, on hand cases."""

import importlib.util
from pathlib import Path

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
