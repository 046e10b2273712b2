"""Confidence intervals, Tables 1 and 3, the degradation indicator and the regime map of the report."""

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import report_cell
from scipy import stats

from gacbench.bench.cell import cell_dir
from gacbench.bench.report import (
    BOOT_RESAMPLES,
    build_report,
    degrade_threshold,
    group_records,
    markdown,
    mean_t_interval,
    paired_difference,
    recovered_shares,
    regime_points,
    running_max_drop,
    share_bootstrap_ci,
    window_noise,
)
from gacbench.bench.runner import expand_cells, load_suite, run_grid
from gacbench.usage import UsageError


def test_equal_seeds_give_a_zero_width_interval():
    sync, stale, method = np.full(4, 1.0), np.full(4, 5.0), np.full(4, 2.0)
    assert share_bootstrap_ci(sync, stale, method) == pytest.approx((0.75, 0.75))
    assert mean_t_interval(np.full(3, 0.2)) == pytest.approx((0.2, 0.2))


def test_the_interval_of_a_mean_is_the_t_interval_by_hand():
    # 1, 2, 3: mean 2, sd 1, t_{0.975, 2} = 4.302653 -> 2 +- 4.302653 / sqrt(3)
    low, high = mean_t_interval(np.array([1.0, 2.0, 3.0]))
    assert (low, high) == pytest.approx((2.0 - 2.484138, 2.0 + 2.484138), abs=1e-6)
    # two seeds: t_{0.975, 1} = 12.7062 times sd / sqrt(2), far wider than the range [0.1, 0.2] a percentile
    # bootstrap of two seeds gives (which covers about half the time)
    assert mean_t_interval(np.array([0.1, 0.2])) == pytest.approx((0.15 - 0.635310, 0.15 + 0.635310), abs=1e-6)
    assert all(math.isnan(v) for v in mean_t_interval(np.array([0.3])))
    assert mean_t_interval(np.array([1.0, math.nan, 2.0, 3.0])) == pytest.approx((low, high))  # NaN left out
    d = np.random.default_rng(0).normal(0.0, 1.0, 7)
    t = paired_difference(d, np.zeros(7))
    assert mean_t_interval(d) == pytest.approx((t["ci_low"], t["ci_high"]))


def test_the_interval_of_a_mean_covers_at_its_level_on_few_seeds():
    rng = np.random.default_rng(1)
    for n in (2, 3, 5):
        hits = sum(lo <= 0.0 <= hi for lo, hi in (mean_t_interval(rng.normal(0.0, 1.0, n)) for _ in range(4000)))
        assert 0.935 <= hits / 4000 <= 0.965, (n, hits)


def test_share_interval_on_a_hand_checkable_case():
    # the gap is 1 on every seed, so the share of a resample is 1 - mean(method): over the 27 equally likely
    # resamples of three seeds, mean(method) = 0 and = 1 each have probability 1/27 > 2.5%, so the 2.5% and 97.5%
    # percentiles are exactly the extremes 0 and 1
    sync, stale, method = np.zeros(3), np.ones(3), np.array([1.0, 0.5, 0.0])
    assert share_bootstrap_ci(sync, stale, method) == pytest.approx((0.0, 1.0))


def test_share_interval_matches_scipy_paired_bootstrap():
    rng = np.random.default_rng(3)
    sync = rng.normal(0.0, 0.1, 6)
    stale = rng.normal(1.0, 0.1, 6)
    method = rng.normal(0.4, 0.2, 6)

    def share(a, b, c, axis=-1):
        return (b.mean(axis) - c.mean(axis)) / (b.mean(axis) - a.mean(axis))

    ref = stats.bootstrap((sync, stale, method), share, paired=True, vectorized=True, method="percentile",
                          n_resamples=BOOT_RESAMPLES, random_state=np.random.default_rng(1)).confidence_interval
    low, high = share_bootstrap_ci(sync, stale, method)
    assert low == pytest.approx(ref.low, abs=0.03) and high == pytest.approx(ref.high, abs=0.03)
    assert low < share(sync, stale, method) < high


def test_zero_gap_resamples_are_unbounded_not_dropped():
    sync, stale, method = np.array([0.0, 1.0]), np.array([1.0, 1.0]), np.array([0.5, 0.5])
    low, high = share_bootstrap_ci(sync, stale, method)  # a quarter of the resamples have gap 0 and numerator 0.5
    assert high == math.inf and low == pytest.approx(0.5)


def test_paired_difference_against_a_direct_computation():
    a, b = np.array([3.0, 5.0, 7.0]), np.array([1.0, 2.0, 3.0])  # differences 2, 3, 4: mean 3, sd 1
    d = paired_difference(a, b)
    t975 = 4.302652729911275  # t quantile 0.975 with 2 degrees of freedom
    assert d["diff"] == pytest.approx(3.0)
    assert (d["ci_low"], d["ci_high"]) == pytest.approx((3 - t975 / math.sqrt(3), 3 + t975 / math.sqrt(3)))
    assert d["p"] == pytest.approx(2 * stats.t.sf(3 / (1 / math.sqrt(3)), 2))
    one = paired_difference(np.array([1.0]), np.array([0.0]))
    assert one["diff"] == 1.0 and math.isnan(one["ci_low"]) and math.isnan(one["p"])


def test_n_counts_distinct_shared_seeds_and_missing_groups_give_null():
    cells = ([report_cell("t", "sync", 0, k, 1.0 + 0.1 * k) for k in (0, 1, 2)]
             + [report_cell("t", "stale", 8, k, 0.5 - 0.1 * k) for k in (0, 1, 2)]
             + [report_cell("t", "gac", 8, k, 0.8) for k in (0, 1)]  # two seeds only
             + [report_cell("t", "gac", 16, k, 0.8) for k in (0, 1)])  # no stale cells at s = 16
    rows = {r["staleness"]: r for r in recovered_shares(group_records(cells), cells=cells)}
    r8 = rows[8]
    assert r8["n"] == 2 and r8["vs_stale_n"] == 2
    # on seeds 0, 1: sync 1.0, 1.1; stale 0.5, 0.4; gac 0.8, 0.8
    assert r8["vs_stale_diff"] == pytest.approx(0.35)
    assert r8["share_ci_low"] <= r8["share_ci_high"]
    r16 = rows[16]
    assert r16["missing"] == ["stale"] and r16["n"] == 0
    assert math.isnan(r16["share"]) and r16["share_ci_low"] is None and r16["vs_stale_diff"] is None
    assert all("n" not in r for r in recovered_shares(group_records(cells)))  # without cells: as before, no CIs


def test_unequal_seeds_take_the_share_on_the_seeds_its_interval_pairs():
    # sync and stale ran seeds 0-4, gac seeds 0-2; seeds 3 and 4 widen the gap (stale 0.0 there), so the share
    # over all seeds' means, (0.24 - 0.73) / (0.24 - 1.0) = 0.64, lies outside the interval of seeds 0-2
    stale = [0.4, 0.4, 0.4, 0.0, 0.0]
    cells = ([report_cell("t", "sync", 0, k, 1.0) for k in range(5)]
             + [report_cell("t", "stale", 8, k, stale[k]) for k in range(5)]
             + [report_cell("t", "gac", 8, k, 0.7 + 0.03 * k) for k in range(3)])
    groups = group_records(cells)
    (row,) = recovered_shares(groups, cells=cells)
    assert row["n"] == 3 and row["paired_seeds"] == 3
    # on seeds 0-2: sync 1.0, stale 0.4, gac 0.73: share (0.4 - 0.73) / (0.4 - 1.0) = 0.55
    assert (row["sync"], row["stale"], row["value"]) == pytest.approx((1.0, 0.4, 0.73))
    assert row["share"] == pytest.approx(0.55)
    assert row["share_ci_low"] <= row["share"] <= row["share_ci_high"]
    assert row["gap"] == pytest.approx(-0.6) and row["gap_se"] == pytest.approx(0.0)
    md = markdown(cells, groups, recovered_shares(groups, cells=cells), Path("x"))
    assert "0.55 (means over the 3 seeds all three ran)" in md
    # without the cells there is nothing to pair: the group means, as the groups table gives them
    (bare,) = recovered_shares(groups)
    assert bare["share"] == pytest.approx((0.24 - 0.73) / (0.24 - 1.0)) and "paired_seeds" not in bare
    # the gap is 0.6 on each of seeds 0-2, so Fieller's interval is the t-interval of the per-seed shares 0.5,
    # 0.55, 0.6: 0.55 +- t_{0.975,2} 0.05 / sqrt(3)
    half = stats.t.ppf(0.975, 2) * 0.05 / math.sqrt(3)
    assert (row["share_ci_low"], row["share_ci_high"]) == pytest.approx((0.55 - half, 0.55 + half))
    assert row["share_ci_kind"] == "bounded"
    # equal seed sets: the group means, and no mark
    same = [c for c in cells if c["seed"] < 3]
    (eq,) = recovered_shares(group_records(same), cells=same)
    assert eq["share"] == pytest.approx(0.55) and "paired_seeds" not in eq


def test_share_table_across_s_by_hand():
    # sync 1.0; stale 0.4 at s = 8 and 0.2 at s = 16 on every seed; gac at s = 8 only
    stale = {8: 0.4, 16: 0.2}
    cells = ([report_cell("t", "sync", 0, k, 1.0) for k in (0, 1, 2)]
             + [report_cell("t", "stale", s, k, stale[s]) for s in (8, 16) for k in (0, 1, 2)]
             + [report_cell("t", "gac", 8, k, 0.7 + 0.03 * k) for k in (0, 1, 2)]
             + [report_cell("t", "m2po", s, k, stale[s] + (0.02 if k == 1 else -0.01))
                for s in (8, 16) for k in (0, 1, 2)])
    groups = group_records(cells)
    md = markdown(cells, groups, recovered_shares(groups, cells=cells), Path("x"))
    table = md[md.index("### t: recovered share across s, final metric"):].split("\n\n")[1].splitlines()
    assert table[0] == "| method | s=8 | s=16 |"
    rows = {line.split(" | ")[0][2:]: line for line in table[2:]}
    assert set(rows) == {"gac", "m2po"}
    # gac at s = 8: shares 0.50, 0.55, 0.60 over a gap of 0.6 on every seed, so Fieller's interval is the
    # t-interval 0.55 +- t_{0.975,2} 0.05 / sqrt(3) = [0.43, 0.67]; every paired difference to stale > 0 (p < 0.05):
    # *; no s = 16 cells: an empty entry
    assert rows["gac"] == "| gac | 0.55 [0.43, 0.67] * |  |"
    # m2po: 0.0 on average against stale, not significant: no star, and an entry at both s
    assert rows["m2po"].startswith("| m2po | 0.00 [") and rows["m2po"].count("[") == 2 and "*" not in rows["m2po"]


def test_lower_is_better_difference_is_signed_so_positive_means_better():
    cells = ([report_cell("q", "sync", 0, k, 1.0, hib=False) for k in (0, 1)]
             + [report_cell("q", "stale", 4, k, 5.0 + k, hib=False) for k in (0, 1)]
             + [report_cell("q", "gac", 4, k, 2.0 + k, hib=False) for k in (0, 1)])
    (row,) = recovered_shares(group_records(cells), cells=cells)
    assert row["vs_stale_diff"] == pytest.approx(3.0) and row["share"] == pytest.approx((5.5 - 2.5) / (5.5 - 1.0))


def test_ablation_shares_against_a_hand_computation():
    cells = ([report_cell("t", "sync", 0, k, 1.0, reward=0.3 + 0.01 * k) for k in (0, 1, 2)]
             + [report_cell("t", "stale", 16, k, 0.5, reward=0.1 + 0.01 * k) for k in (0, 1, 2)]
             + [report_cell("t", "gac", 16, k, 0.5, reward=0.12 + 0.01 * k) for k in (0, 1, 2)])
    abl = [dict(report_cell("t", "gac(c_low=0.05,c_high=0.3)", 16, k, 0.5, reward=0.15 + 0.01 * k), ablation=True)
           for k in (0, 1, 2)]
    groups = group_records(cells + abl)
    (row,) = recovered_shares(groups, "reward_last", cells=cells + abl, ablation=True)
    # gap 0.2 on every seed and the ablation point 0.05 above stale on every seed: share 0.25, a zero-width interval
    assert row["method"] == "gac(c_low=0.05,c_high=0.3)" and row["n"] == 3
    assert row["share"] == pytest.approx(0.25)
    assert (row["share_ci_low"], row["share_ci_high"]) == pytest.approx((0.25, 0.25))
    assert row["vs_stale_diff"] == pytest.approx(0.05)
    # the main rows do not list the ablation point, and the ablation rows do not list the main methods
    assert [r["method"] for r in recovered_shares(groups, "reward_last", cells=cells + abl)] == ["gac"]
    md = markdown(cells + abl, groups, recovered_shares(groups, cells=cells + abl), Path("x"),
                  recovered_shares(groups, "reward_last", cells=cells + abl))
    table = md[md.index("## Threshold ablation"):]
    assert "in the training reward" in table and "| 0.25 [0.25, 0.25] | +0.05 " in table
    assert "| 0.16 ± 0.0082 |" in table  # the ablation point's training reward, mean ± sd over its three seeds
    one = [a for a in abl if a["seed"] == 0]  # a single seed of the ablation point: its mean, no "± 0"
    groups = group_records(cells + one)
    md = markdown(cells + one, groups, recovered_shares(groups, cells=cells + one), Path("x"),
                  recovered_shares(groups, "reward_last", cells=cells + one))
    table = md[md.index("## Threshold ablation"):]
    assert "| 0.15 (n = 1) |" in table and "± 0 " not in table


def test_a_stored_ablation_grid_gets_shares_and_figure_5(tmp_path):
    suite = {"name": "abl", "steps": 30, "warmup": 5,
             "tasks": {"bandit": {"objective": "bandit", "params": {"lr": 0.05}}},
             "methods": ["sync", "stale"], "staleness": [0, 4], "seeds": [0, 1],
             "ablation": {"method": "gac", "staleness": 4, "c_low": [0.02, 0.05], "c_high": [0.3]}}
    path = tmp_path / "abl.yaml"
    path.write_text(yaml.safe_dump(suite))
    out = tmp_path / "out"
    run_grid(expand_cells(load_suite(str(path))), out)
    build_report(out)
    summary = json.loads((out / "summary.json").read_text())
    rows = summary["ablation_recovered_reward"]
    assert sorted(r["method"] for r in rows) == ["gac(c_low=0.02,c_high=0.3)", "gac(c_low=0.05,c_high=0.3)"]
    assert all(r["n"] == 2 and {"share_ci_low", "share_ci_high", "vs_stale_p"} <= set(r) for r in rows)
    assert len(summary["ablation_recovered"]) == 2 and summary["recovered_reward"] == []
    assert (out / "fig_thresholds.png").is_file()
    assert "`gac(c_low=0.02,c_high=0.3)` | 4 |" in (out / "summary.md").read_text()


def test_running_max_drop_by_hand():
    values = [0.0] * 10 + [1.0] * 10 + [0.5] * 10  # 10-step means peak at 1.0 and end at 0.5
    assert running_max_drop(values) == pytest.approx(0.5)
    assert running_max_drop(list(range(30))) == 0.0  # a rising curve ends at its best
    assert math.isnan(running_max_drop([1.0] * 5))


def test_regime_points_by_hand():
    specs = [{"task": f"{m}-{lr}", "objective": "grpo", "params": {"lr": lr, "model": {"size": m}}}
             for m in ("tiny", "small") for lr in (1e-4, 1e-3)]
    cells = []
    for spec in specs:
        t = spec["task"]
        cells += [report_cell(t, "sync", 0, k, 0.5, reward=0.4 + 0.01 * k) for k in (0, 1)]
        cells += [report_cell(t, "stale", 8, k, 0.4, reward=0.3 + 0.02 * k) for k in (0, 1)]
    cells[-1]["degraded"] = True
    points = {(p["model"], p["lr"], p["staleness"]): p for p in regime_points(cells, specs)}
    assert len(points) == 4
    p = points[("small", 1e-3, 8)]
    assert p["gap"] == pytest.approx(((0.3 - 0.4) + (0.32 - 0.41)) / 2)
    assert p["n"] == 2 and p["stale_degraded_frac"] == 0.5 and p["sync_healthy"] is True
    # differences -0.1 and -0.09: mean -0.095 +- t_{0.975, 1} * sd / sqrt(2) = 12.7062 * 0.0070711 / 1.41421
    assert p["gap_ci_low"] == pytest.approx(-0.095 - 0.063531, abs=1e-6)
    assert p["gap_ci_high"] == pytest.approx(-0.095 + 0.063531, abs=1e-6)
    # one learning rate only: not a regime map
    assert regime_points(cells, [dict(s, params={"lr": 1e-4}) for s in specs]) == []


def test_report_of_a_stored_grid_has_the_new_keys_and_sections(tmp_path):
    suite = {"name": "ci", "steps": 30, "warmup": 5,
             "tasks": {"bandit": {"objective": "bandit", "params": {"lr": 0.05}}},
             "methods": ["sync", "stale", "gac"], "staleness": [0, 4], "seeds": [0, 1]}
    path = tmp_path / "ci.yaml"
    path.write_text(yaml.safe_dump(suite))
    out = tmp_path / "out"
    cells = expand_cells(load_suite(str(path)))
    run_grid(cells, out)
    build_report(out)
    summary = json.loads((out / "summary.json").read_text())
    (row,) = summary["recovered_reward"]
    assert {"share_ci_low", "share_ci_high", "n", "vs_stale_diff", "vs_stale_p"} <= set(row) and row["n"] == 2
    assert all("reward_drop" in c for c in summary["cells"])
    md = (out / "summary.md").read_text()
    assert "## Confidence intervals (95%) over seeds" in md and "## Table 1: final metric under staleness s = 4" in md
    assert "## Table 3: on-policy (s = 0)" in md
    assert md.index("## Timing") < md.index("## Confidence intervals")  # appended after the existing sections
    for name in ("fig_staleness_bandit.png", "fig_cos_methods_bandit.png", "fig_reward_bandit.png"):
        assert (out / name).is_file()
    # the update diagnostics, read back from a cell's metrics.csv independently of read_metrics
    gac = next(c for c in summary["cells"] if c["method"] == "gac" and c["seed"] == 1)
    with (cell_dir(out, {**cells[0], "method": "gac", "staleness": 4, "seed": 1}) / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    norms = [float(r["grad/norm"]) for r in rows if r["grad/norm"] and int(r["step"]) >= 5]
    changed = [float(r["align/proj_frac"]) for r in rows if r["align/proj_frac"]]
    assert len(norms) == 25 and gac["grad_norm"] == pytest.approx(np.mean(norms))
    assert gac["gac_changed"] == pytest.approx(changed[-1])
    assert not any("gac_changed" in c for c in summary["cells"] if c["method"] != "gac")
    group = next(g for g in summary["groups"] if g["method"] == "gac")
    assert group["gac_changed_mean"] == pytest.approx(np.mean([c["gac_changed"] for c in summary["cells"]
                                                                if c["method"] == "gac"]))
    assert "## Update diagnostics, after the warm-up" in md and "| GAC: steps changed |" in md


def test_regime_map_of_a_stored_grid(tmp_path):
    suite = {"name": "regime", "steps": 30, "warmup": 5,
             "tasks": {f"bandit-lr{lr}": {"objective": "bandit", "params": {"lr": lr}} for lr in (0.02, 0.2)},
             "methods": ["sync", "stale"], "staleness": [0, 4, 8], "seeds": [0, 1]}
    path = tmp_path / "regime.yaml"
    path.write_text(yaml.safe_dump(suite))
    out = tmp_path / "out"
    run_grid(expand_cells(load_suite(str(path))), out)
    build_report(out)
    summary = json.loads((out / "summary.json").read_text())
    points = summary["regime"]
    assert [(p["lr"], p["staleness"]) for p in points] == [(0.02, 4), (0.02, 8), (0.2, 4), (0.2, 8)]
    cells = {(c["task"], c["method"], c["staleness"], c["seed"]): c for c in summary["cells"]}
    p = points[-1]
    reward = {k: cells[k]["reward_last"] for k in cells}
    gap = np.mean([reward[("bandit-lr0.2", "stale", 8, k)] - reward[("bandit-lr0.2", "sync", 0, k)] for k in (0, 1)])
    assert p["gap"] == pytest.approx(gap) and p["n"] == 2 and p["model"] == "bandit"
    assert p["gap_ci_low"] <= p["gap"] <= p["gap_ci_high"]
    assert "## Regime map" in (out / "summary.md").read_text() and (out / "fig_regime.png").is_file()


def test_suites_of_the_headline_and_the_regime_map():
    from gacbench.stabilizers import registry

    headline = load_suite("llm-headline")
    # the stored headline grid predates these; they run in llm-smoke and the synthetic suites (docs/baselines.md)
    # until the next headline grid lists them
    outside = {"m2po-threshold", "lr-scaled", "opsm", "geo-seq-mask", "vespo", "a3po"}
    expected = {"sync", "stale", "gac", "gac-calibrated"} | (set(registry._builtins()) - outside)  # not a plug-in's
    assert expected <= set(headline["methods"])
    assert {s for s in headline["staleness"] if s > 0} == {8, 16, 32} and len(headline["seeds"]) >= 5
    regime = load_suite("llm-regime")
    lrs = {t["params"]["lr"] for t in regime["tasks"].values()}
    sizes = {t["params"]["model"]["size"] for t in regime["tasks"].values()}
    assert len(lrs) >= 4 and max(lrs) / min(lrs) >= 10 and sizes == {"tiny", "small"}
    assert regime["staleness"] == [0, 8, 16, 32] and regime["methods"] == ["sync", "stale"]
    assert regime["assumptions"] >= 2  # the map checks the step-size condition on GRPO


def test_regime_map_checks_the_step_size_condition_when_the_suite_monitors_assumptions(tmp_path):
    suite = {"name": "regime", "steps": 30, "warmup": 5, "assumptions": 5,
             "tasks": {f"q-lr{lr}": {"objective": "quadratic", "params": {"lr": lr}} for lr in (0.02, 0.2)},
             "methods": ["sync", "stale"], "staleness": [0, 8], "seeds": [0, 1]}
    path = tmp_path / "regime.yaml"
    path.write_text(yaml.safe_dump(suite))
    out = tmp_path / "out"
    cells = expand_cells(load_suite(str(path)))
    assert all(c["assumptions"] == 5 for c in cells)
    run_grid(cells, out)
    build_report(out)
    summary = json.loads((out / "summary.json").read_text())
    stale = [c for c in summary["cells"] if c["method"] == "stale"]
    assert all(c["assume_L"] > 0 and c["assume_eta_max"] > 0 for c in stale)
    for p in summary["regime"]:
        etas = [c["assume_eta_max"] for c in stale if c["task"] == p["task"]]
        assert p["stale_eta_max"] == pytest.approx(float(np.median(etas)))
        assert p["lr_within_eta_max"] == (p["lr"] <= p["stale_eta_max"])
        effs = [c["assume_eta_eff"] for c in stale if c["task"] == p["task"]]
        assert p["stale_eta_eff"] == pytest.approx(float(np.mean(effs)))
        assert p["eff_within_eta_max"] == (p["stale_eta_eff"] <= p["stale_eta_max"])
    md = (out / "summary.md").read_text()
    assert "### The step-size condition on this workload" in md and "lr > eta_max(s) matches the observation at" in md
    # the monitor is part of a cell's identity: the same grid without it is refused, not reused
    suite.pop("assumptions")
    path.write_text(yaml.safe_dump(suite))
    with pytest.raises(Exception, match="assumptions"):
        run_grid(expand_cells(load_suite(str(path))), out)


def test_suite_assumptions_must_be_an_integer_of_at_least_two(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"steps": 10, "assumptions": 1, "tasks": {"q": {"objective": "quadratic"}},
                                    "methods": ["sync"], "staleness": [0], "seeds": [0]}))
    with pytest.raises(UsageError, match="assumptions: 1 is not an integer >= 2"):
        load_suite(str(path))
    path.write_text(yaml.safe_dump({"steps": 10, "assumptions": 5, "tasks": {"b": {"objective": "bandit"}},
                                    "methods": ["sync"], "staleness": [0], "seeds": [0]}))
    with pytest.raises(UsageError, match="objective 'bandit' has no side-effect-free loss_on"):
        load_suite(str(path))


def test_degradation_needs_a_drop_beyond_the_curve_s_own_noise():
    rng = np.random.default_rng(0)
    noisy_flat = list(0.3 + 0.15 * rng.standard_normal(100))  # a 10-step mean has sd ~0.047
    noise = window_noise(noisy_flat)
    diffs = np.diff(noisy_flat)
    assert noise == pytest.approx(np.std(diffs, ddof=1) / math.sqrt(2) / math.sqrt(10))
    assert noise == pytest.approx(0.15 / math.sqrt(10), rel=0.25)
    assert degrade_threshold(noise) == pytest.approx(5 * noise)  # above the fixed 0.05 margin
    assert running_max_drop(noisy_flat) < degrade_threshold(noise)  # noise alone is not degradation
    collapse = [0.3] * 50 + [0.0] * 50  # a noiseless collapse: the fixed margin applies
    assert window_noise(collapse) < 0.01 and degrade_threshold(window_noise(collapse)) == 0.05
    assert running_max_drop(collapse) == pytest.approx(0.3)
    assert running_max_drop(collapse) > degrade_threshold(window_noise(collapse))
    assert degrade_threshold(math.nan) == 0.05


def test_the_legend_names_methods_that_appear_in_one_panel_only():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gacbench.bench.report import figure_legend_entries

    fig, (a, b) = plt.subplots(1, 2)
    a.plot([0, 1], label="stale")
    a.plot([0, 1], label="dual-clip")  # run at s = 16 only
    b.plot([0, 1], label="stale")
    b.plot([0, 1], label="gac")
    handles, labels = figure_legend_entries(fig)
    assert labels == ["stale", "dual-clip", "gac"]
    assert len(handles) == 3
    plt.close(fig)


def test_the_regime_gap_of_a_lower_is_better_metric_is_oriented_so_that_below_zero_is_stale_worse():
    """On a final loss (the quadratic's f - f*), a stale run that ends at a larger loss is worse: its gap is < 0,
    and stale_worse holds, as for a reward."""
    from gacbench.bench.regime import regime_points

    cells, specs = [], []
    for task, lr in (("quad-lr0.05", 0.05), ("quad-lr0.2", 0.2)):
        for seed in range(3):
            for method, s, final in (("sync", 0, 1.0 + 0.01 * seed), ("stale", 16, 5.0 + 0.02 * seed)):
                specs.append({"task": task, "objective": "quadratic", "params": {"lr": lr}, "method": method,
                              "staleness": s, "seed": seed})
                cells.append({"task": task, "method": method, "staleness": s, "seed": seed, "status": "done",
                              "ablation": False, "metric": "gap", "higher_is_better": False, "initial": 10.0,
                              "final": final, "diverged": False, "cos_median": 0.0, "cos_abs_q90": 0.1,
                              "assume_eta_max": 0.01, "assume_L": 1.0, "assume_eta_eff": 0.5})
    points = regime_points(cells, specs)
    assert len(points) == 2
    for p in points:
        assert p["stale"] > p["sync"]  # the raw final losses
        assert p["gap"] == pytest.approx(-(4.0 + 0.01)) and p["gap_ci_high"] < 0 and p["stale_worse"] is True


def test_one_methods_short_run_leaves_the_version_window_of_every_comparison_and_counts_at_its_start():
    """The version-aligned window comes from the sync and stale runs: a method's seed that stopped early (a
    non-finite loss ends a run) neither moves the window of the other methods nor drops out; it counts at its
    first version's reward, as final_mean counts a diverged run at its starting value."""
    from gacbench.bench.stats import aligned_values

    steps, s = 100, 16

    def cell(method, seed, last=steps):
        lag = 0 if method == "sync" else s
        slope = {"sync": 0.3, "stale": 0.15}.get(method, 0.25)
        rewards = {v: 0.3 + slope * v / steps + 0.001 * seed for v in range(0, last - lag)}
        return {"task": "arith", "method": method, "staleness": 0 if method == "sync" else s, "seed": seed,
                "status": "done", "_by_version": {"reward/mean": rewards}}

    full = [cell(m, k) for m in ("sync", "stale", "gac", "m2po") for k in range(3)]
    short = full[:-1] + [cell("m2po", 2, last=30)]
    a, b = aligned_values(full, "arith", s), aligned_values(short, "arith", s)
    assert a["versions"] == b["versions"] == [64, 83]
    for key in (("arith", "sync", 0), ("arith", "stale", s), ("arith", "gac", s)):
        assert a["seeds"][key] == b["seeds"][key]
    assert b["seeds"][("arith", "m2po", s)][2] == pytest.approx(0.3 + 0.002)  # its version 0
    assert b["seeds"][("arith", "m2po", s)][0] == a["seeds"][("arith", "m2po", s)][0]


def test_stale_worse_needs_the_gaps_t_interval_below_zero_not_only_every_seed():
    """Three seeds all below sync (the range a percentile bootstrap of three seeds gives lies below 0) whose
    t-interval still crosses 0: not 'stale worse'; a consistent gap is."""
    from gacbench.bench.regime import regime_points

    cells, specs = [], []
    for task, lr, gaps in (("q-lr0.05", 0.05, (-0.1, -0.01, -0.001)), ("q-lr0.2", 0.2, (-0.1, -0.11, -0.12))):
        for seed in range(3):
            for method, s, reward in (("sync", 0, 0.5), ("stale", 16, 0.5 + gaps[seed])):
                specs.append({"task": task, "objective": "quadratic", "params": {"lr": lr}, "method": method,
                              "staleness": s, "seed": seed})
                cells.append({"task": task, "method": method, "staleness": s, "seed": seed, "status": "done",
                              "ablation": False, "metric": "reward", "higher_is_better": True, "initial": 0.0,
                              "final": reward, "diverged": False, "cos_median": 0.0, "cos_abs_q90": 0.1,
                              "reward_first": 0.0, "reward_last": reward, "assume_eta_max": 0.01,
                              "assume_L": 1.0, "assume_eta_eff": 0.5})
    points = {p["lr"]: p for p in regime_points(cells, specs)}
    assert points[0.05]["gap_ci_low"] < 0 < points[0.05]["gap_ci_high"] and points[0.05]["stale_worse"] is False
    assert points[0.2]["gap_ci_high"] < 0 and points[0.2]["stale_worse"] is True
