"""The share of the gap a method removes beyond its on-policy effect, and the regime checks, against hand
computations on synthetic cells, through the report on a stored grid, and on the pilot grid's own cells."""

import csv
import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest
from conftest import report_cell
from scipy import stats

from gacbench.bench.beyond import IDENTITY_CONTROL, beyond_on_policy, headline_beyond, regime_checks
from gacbench.bench.cell import cell_dir
from gacbench.bench.figures import Canvas, beyond_figure
from gacbench.bench.groups import group_records
from gacbench.bench.power import power_rows
from gacbench.bench.records import cell_record, discover_cells
from gacbench.bench.report import build_report
from gacbench.bench.stats import apply_families, detectable_multiplier, holm_adjust, recovered_shares
from gacbench.bench.tables import markdown
from gacbench.bench.validate import load_suite
from gacbench.jsonio import write_json

REPO = Path(__file__).resolve().parents[1]
# per seed 0, 1, 2; stale = sync - 0.5 on every seed, so the gap g = 0.5 has no noise and Fieller's interval of
# mean(d) / 0.5 is the t-interval of d over 0.5
VALUES = {("sync", 0): [1.0, 1.1, 0.9], ("stale", 16): [0.5, 0.6, 0.4],
          ("gac", 16): [0.8, 0.85, 0.75], ("gac", 0): [1.1, 1.15, 1.0],  # gain [.3 .25 .35], on-policy [.1 .05 .1]
          ("m2po", 16): [0.7, 0.85, 0.6],  # an identity at s = 0: gain [.2 .25 .2]
          ("gspo", 16): [0.6, 0.7, 0.5]}  # no s = 0 cells and no identity: no row
IDENTITY = {"m2po"}.__contains__


def _cells(sign: float = 1.0, hib: bool = True, policy: bool = False) -> list[dict]:
    """The cells of VALUES (times ``sign``), with the policy reward at versions 5 and 9 (the value at 9) when
    ``policy``."""
    out = []
    for (m, s), xs in VALUES.items():
        for seed, x in enumerate(xs):
            rec = report_cell("t", m, s, seed, sign * x, reward=sign * x, hib=hib)
            if policy:
                rec["_by_version"] = {"reward/mean": {v: 0.0 for v in range(10)},
                                      "eval/policy_reward": {5: 0.0, 9: sign * x}}
            out.append(rec)
    return out


def _by_hand() -> dict:
    a = np.array(VALUES[("gac", 16)]) - np.array(VALUES[("stale", 16)])
    b = np.array(VALUES[("gac", 0)]) - np.array(VALUES[("sync", 0)])
    d = a - b
    half = stats.t.ppf(0.975, 2) * d.std(ddof=1) / math.sqrt(3)
    return {"share": d.mean() / 0.5, "low": (d.mean() - half) / 0.5, "high": (d.mean() + half) / 0.5,
            "raw": a.mean() / 0.5, "effect": b.mean(), "p": stats.ttest_1samp(d, 0.0).pvalue,
            "mds": detectable_multiplier(3) * d.std(ddof=1) / 0.5}


@pytest.mark.parametrize("sign, hib", [(1.0, True), (-1.0, False)])
def test_the_share_beyond_the_on_policy_effect_by_hand(sign, hib):
    # a lower-is-better metric holding the negated values is the same comparison: the same shares and effects
    cells = _cells(sign, hib)
    rows, uncontrolled = beyond_on_policy(group_records(cells), cells, "final", IDENTITY)
    by = {r["method"]: r for r in rows}
    assert set(by) == {"gac", "m2po"} and all(r["staleness"] == 16 and r["n"] == 3 for r in rows)
    assert uncontrolled == [{"task": "t", "method": "gspo", "staleness": [16]}]
    h, gac = _by_hand(), by["gac"]
    assert gac["control"] == "gac at s = 0" and gac["gap"] == pytest.approx(0.5)
    assert gac["beyond_on_policy_share"] == pytest.approx(h["share"]) and gac["raw_share"] == pytest.approx(h["raw"])
    assert gac["on_policy_effect"] == pytest.approx(h["effect"])
    assert gac["beyond_ci_kind"] == "bounded"
    assert (gac["beyond_ci_low"], gac["beyond_ci_high"]) == pytest.approx((h["low"], h["high"]))
    assert gac["beyond_p"] == pytest.approx(h["p"]) and gac["min_detectable_share"] == pytest.approx(h["mds"])
    # the share beyond is the raw share less the on-policy effect over the gap
    assert gac["beyond_on_policy_share"] == pytest.approx(gac["raw_share"] - gac["on_policy_effect"] / gac["gap"])
    # an identity's control is sync: no on-policy effect, its share beyond is its recovered share
    m2po = by["m2po"]
    recovered = next(r for r in recovered_shares(group_records(cells), cells=cells) if r["method"] == "m2po")
    assert m2po["control"] == IDENTITY_CONTROL and m2po["on_policy_effect"] == 0.0
    assert m2po["beyond_on_policy_share"] == pytest.approx(recovered["share"]) == pytest.approx(m2po["raw_share"])
    assert m2po["beyond_p"] == pytest.approx(recovered["vs_stale_p"])
    assert [r["beyond_p_adj"] for r in rows] == holm_adjust([r["beyond_p"] for r in rows])


def test_no_identity_no_control_and_no_controlled_task_give_no_row():
    cells = _cells()
    rows, uncontrolled = beyond_on_policy(group_records(cells), cells, "final")
    assert [r["method"] for r in rows] == ["gac"]
    assert sorted(u["method"] for u in uncontrolled) == ["gspo", "m2po"]
    # a task without any method at s = 0 asks no on-policy question, identity or not
    plain = [c for c in cells if not (c["method"] == "gac" and c["staleness"] == 0)]
    assert beyond_on_policy(group_records(plain), plain, "final", IDENTITY) == ([], [])


def test_a_gap_that_is_not_there_gives_no_share():
    cells = [c for c in _cells() if c["method"] in ("sync", "stale", "gac")]
    for c in cells:
        if c["method"] == "stale":
            c["final"] += 1.0  # stale better than sync
    (row,), _ = beyond_on_policy(group_records(cells), cells, "final")
    assert row["no_gap"] and math.isnan(row["beyond_on_policy_share"]) and row["beyond_ci_kind"] is None
    d = (np.array(VALUES[("gac", 16)]) - np.array(VALUES[("stale", 16)]) - 1.0
         - (np.array(VALUES[("gac", 0)]) - np.array(VALUES[("sync", 0)])))
    assert row["min_detectable_share"] is None and row["beyond_p"] == pytest.approx(stats.ttest_1samp(d, 0.0).pvalue)


def test_the_version_aligned_share_reads_the_policy_reward_with_the_on_policy_controls():
    cells = _cells(policy=True)
    for c in cells:
        c["reward_last"] = 0.0  # the training reward says nothing here: the version-aligned measure must be read
    rows, _ = beyond_on_policy(group_records(cells), cells, "by_version", IDENTITY)
    gac = next(r for r in rows if r["method"] == "gac")
    assert gac["measure"] == "by_version" and gac["source"] == "eval/policy_reward"
    assert gac["beyond_on_policy_share"] == pytest.approx(_by_hand()["share"])
    assert headline_beyond({"final": [{"task": "t"}], "by_version": rows}) == rows


def test_the_beyond_tests_are_one_family_per_task_measure_and_s():
    cells = _cells()
    rows, _ = beyond_on_policy(group_records(cells), cells, "final", IDENTITY)
    fams = apply_families([("beyond", "final", rows)], None)
    assert [(f["name"], f["m"], f["of"]) for f in fams] == [
        ("recovers beyond the on-policy effect at s", 2, {"task": "t", "measure": "final", "staleness": 16})]
    assert [r["beyond_p_adj"] for r in rows] == holm_adjust([r["beyond_p"] for r in rows])
    from gacbench.bench.stats import ALPHA, min_detectable_share

    for r in rows:  # the detectable share at the family's level, alpha / 2
        if r.get("min_detectable_share") is not None:
            assert r["min_detectable_share_family"] == pytest.approx(
                min_detectable_share(r["sd_diff"], r["gap"], r["n"], alpha=ALPHA / 2))
            assert r["min_detectable_share_family"] > r["min_detectable_share"]
    suite = load_suite(str(REPO / "tasks/suites/llm-headline-healthy.yaml"))
    assert {f["test"]: f["per"] for f in suite["families"].values()}["beyond"] == ["task", "measure", "staleness"]


def test_the_table_puts_the_share_beyond_first_and_names_the_methods_without_a_control(tmp_path):
    cells = _cells()
    groups = group_records(cells)
    rows, uncontrolled = beyond_on_policy(groups, cells, "final", IDENTITY)
    md = markdown(cells, groups, recovered_shares(groups, cells=cells), Path("x"), beyond={"final": rows},
                  uncontrolled=uncontrolled)
    h = _by_hand()
    section = md[md.index("## Recovered share beyond the on-policy effect, final metric"):]
    line = next(x for x in section.splitlines() if x.startswith("| t | 16 | gac |"))
    assert line.split(" | ")[3] == "gac at s = 0"
    assert line.split(" | ")[4].startswith(f"{h['share']:.2f} [{h['low']:.2g}, {h['high']:.2g}]")
    assert line.split(" | ")[7] == f"{h['raw']:.2g}"
    assert f"| t | 16 | m2po | {IDENTITY_CONTROL} |" in md
    assert "No share beyond the on-policy effect" in md and "gspo (t, s = 16)" in md
    cv = Canvas(tmp_path, cells, {})
    beyond_figure(cv, rows)
    assert [p.name for p in cv.out] == ["fig_beyond.png"] and (tmp_path / "fig_beyond.png").stat().st_size > 0


def test_power_sizes_the_shares_beyond_too():
    cells = _cells()
    rows, _ = beyond_on_policy(group_records(cells), cells, "final", IDENTITY)
    out = power_rows({"recovered": [], "recovered_reward": [], "beyond_on_policy": rows}, 0.5)
    gac = next(r for r in out if r["method"] == "gac")
    assert gac["share"] == "beyond" and gac["n"] == 3
    assert gac["min_detectable_share"] == pytest.approx(_by_hand()["mds"])


def test_regime_checks_by_hand():
    first, last = [0.20, 0.25, 0.22], [0.30, 0.31, 0.35]
    stale16, stale32 = [0.24, 0.27, 0.29], [0.30, 0.26, 0.34]
    cells = []
    for seed in range(3):
        for m, s, pr in (("sync", 0, {40: first[seed], 80: 0.0, 160: last[seed]}),
                         ("stale", 16, {40: 0.0, 160: stale16[seed]}), ("stale", 32, {40: 0.0, 160: stale32[seed]})):
            rec = report_cell("t", m, s, seed, 0.0, reward=0.0)
            rec["_by_version"] = {"reward/mean": {v: 0.0 for v in range(161)}, "eval/policy_reward": pr}
            cells.append(rec)
    (check,) = regime_checks(cells)
    rises = [b - a for a, b in zip(first, last)]
    se = statistics.stdev(rises) / math.sqrt(3)
    assert check["sync"]["first_version"] == 40 and check["sync"]["last_version"] == 160
    assert check["sync"]["rise"] == pytest.approx(statistics.mean(rises))
    assert check["sync"]["rise_se"] == pytest.approx(se)
    assert check["sync"]["rise_in_se"] == pytest.approx(statistics.mean(rises) / se)
    assert check["sync"]["learns"] is (statistics.mean(rises) / se >= 3)
    for entry, stale in zip(check["stale"], (stale16, stale32)):
        gaps = [a - b for a, b in zip(last, stale)]
        gse = statistics.stdev(gaps) / math.sqrt(3)
        assert entry["gap"] == pytest.approx(statistics.mean(gaps)) and entry["gap_se"] == pytest.approx(gse)
        assert entry["loses"] is (statistics.mean(gaps) / gse >= 3) and entry["versions"] == [129, 160]
    assert [e["loses"] for e in check["stale"]] == [True, False] and check["sync"]["learns"] is True
    assert check["met"] is False
    # another method's cells at s, without the policy reward, neither drop nor move a stale criterion
    others = []
    for seed in range(3):
        rec = report_cell("t", "gac", 16, seed, 0.0, reward=0.0)
        rec["_by_version"] = {"reward/mean": {v: 0.0 for v in range(161)}}
        others.append(rec)
    (again,) = regime_checks(cells + others)
    assert [e["gap"] for e in again["stale"]] == [e["gap"] for e in check["stale"]] and again["met"] is False
    # a task of sync alone gets its first criterion, which decides `met`
    (alone,) = regime_checks([c for c in cells if c["method"] == "sync"])
    assert alone["sync"] == check["sync"] and alone["stale"] == [] and alone["met"] is True
    # a grid that does not log its policy's reward has no checks
    for c in cells:
        del c["_by_version"]["eval/policy_reward"]
    assert regime_checks(cells) == []


def test_regime_checks_on_the_pilot_grid_match_its_metrics_files():
    root = REPO / "grids/llm-healthy-pilot"
    if not (root / "cells").is_dir():
        pytest.skip("the pilot grid's cells are not in this checkout")
    (check,) = regime_checks([cell_record(root, c) for c in discover_cells(root)])

    def policy_reward(method: str, s: int, seed: int) -> dict[int, float]:
        with open(root / f"cells/arithmetic/{method}/s{s}/seed{seed}/metrics.csv") as f:
            return {int(r["step"]): float(r["eval/policy_reward"]) for r in csv.DictReader(f)
                    if r["eval/policy_reward"]}

    sync = [policy_reward("sync", 0, k) for k in range(3)]
    rises = [x[160] - x[40] for x in sync]
    assert check["sync"]["rise"] == pytest.approx(statistics.mean(rises))
    assert check["sync"]["rise_in_se"] == pytest.approx(statistics.mean(rises) / (statistics.stdev(rises) / 3 ** 0.5))
    for entry in check["stale"]:
        gaps = [x[160] - policy_reward("stale", entry["staleness"], k)[160] for k, x in enumerate(sync)]
        assert entry["gap"] == pytest.approx(statistics.mean(gaps))
        assert entry["gap_in_se"] == pytest.approx(statistics.mean(gaps) / (statistics.stdev(gaps) / 3 ** 0.5))


def _store(root: Path, method: str, s: int, seed: int, final: float) -> None:
    """A done quadratic cell (lower is better) written by hand."""
    cell = {"task": "quadratic", "objective": "quadratic", "params": {"lr": 0.1}, "steps": 3, "warmup": 0,
            "method": method, "staleness": s, "seed": seed}
    d = cell_dir(root, cell)
    d.mkdir(parents=True)
    write_json(d / "config.json", cell)
    (d / "metrics.csv").write_text("step,eval/gap,align/cos\n" + "".join(f"{t},{final},0.1\n" for t in range(3)))
    write_json(d / "status.json", {"status": "done", "initial": 10.0, "final": final, "diverged": False,
                                   "metric": "gap", "higher_is_better": False, "steps_run": 3, "cell": cell})


def test_a_stored_grid_with_on_policy_controls_reports_the_share_beyond(tmp_path):
    for (m, s), xs in VALUES.items():
        for seed, x in enumerate(xs):
            _store(tmp_path, m, s, seed, 2.0 - x)  # a gap: lower is better
    rep = build_report(tmp_path)
    summary = rep["summary"]
    by = {r["method"]: r for r in summary["beyond_on_policy"]}
    assert by["gac"]["beyond_on_policy_share"] == pytest.approx(_by_hand()["share"])
    assert by["m2po"]["control"] == IDENTITY_CONTROL  # m2po's declaration, read by name
    assert by["gac"]["family"] == "recovers beyond the on-policy effect at s" and by["gac"]["beyond_p_adj"] is not None
    assert summary["beyond_on_policy_uncontrolled"] == [{"task": "quadratic", "method": "gspo", "staleness": [16]}]
    assert "beyond_on_policy_reward" not in summary and "regime_checks" not in summary
    md = (tmp_path / "summary.md").read_text()
    assert "## Recovered share beyond the on-policy effect, final metric" in md
    assert "fig_beyond.png" in {p.name for p in rep["figures"]}
    stored = json.loads((tmp_path / "summary.json").read_text())
    assert stored["beyond_on_policy"][0]["beyond_ci_kind"] == "bounded"


def test_a_stored_grid_without_on_policy_controls_has_no_share_beyond(tmp_path):
    for (m, s), xs in VALUES.items():
        for seed, x in enumerate(xs):
            if s > 0 or m == "sync":
                _store(tmp_path, m, s, seed, 2.0 - x)
    rep = build_report(tmp_path)
    assert not [k for k in rep["summary"] if k.startswith("beyond")]
    assert {f["name"] for f in rep["summary"]["families"]} == {"recovers the gap at s"}
    assert "beyond" not in (tmp_path / "summary.md").read_text()
    assert "fig_beyond.png" not in {p.name for p in rep["figures"]}


def test_the_reward_measures_are_read_higher_is_better_on_a_lower_is_better_task():
    """A task whose final metric is lower-is-better (a loss) still earns reward: on reward_last the gap is
    sync - stale > 0 where stale earns less, and the share beyond the on-policy effect is defined."""
    rew = {("sync", 0): [0.9, 0.8, 0.85], ("stale", 2): [0.5, 0.45, 0.55], ("gac", 2): [0.8, 0.7, 0.72],
           ("gac", 0): [0.9, 0.82, 0.85]}
    cells = [{"status": "done", "task": "t", "method": m, "staleness": s, "seed": i, "reward_last": v}
             for (m, s), vs in rew.items() for i, v in enumerate(vs)]
    groups = [{"task": "t", "method": m, "staleness": s, "ablation": None, "higher_is_better": False} for m, s in rew]
    (row,), _ = beyond_on_policy(groups, cells, "reward_last")
    assert row["gap"] == pytest.approx(0.85 - 0.5) and not row["no_gap"]
    assert math.isfinite(row["beyond_on_policy_share"]) and row["beyond_on_policy_share"] > 0


# regime_checks' verdicts
def _sync_cell(seed, first, last):
    return {"status": "done", "task": "t", "method": "sync", "staleness": 0, "seed": seed, "ablation": False,
            "_by_version": {"eval/policy_reward": {0: first, 10: last}}}


def test_regime_learns_at_exactly_three_standard_errors():
    """rises 2 and 1: mean 1.5, sd sqrt(0.5), se 0.5, 3.0 standard errors: 'at least REGIME_SE' holds."""
    from gacbench.bench.beyond import regime_checks

    (entry,) = regime_checks([_sync_cell(0, 0.0, 2.0), _sync_cell(1, 0.0, 1.0)])
    assert entry["sync"]["rise_in_se"] == 3.0 and entry["sync"]["learns"] is True and entry["met"] is True


def test_regime_met_is_null_without_a_verdict():
    """One seed: no standard error, so learns is None, and met (no verdict false, one missing) is None, not True."""
    from gacbench.bench.beyond import regime_checks

    (entry,) = regime_checks([_sync_cell(0, 0.0, 2.0)])
    assert entry["sync"]["learns"] is None and entry["met"] is None


# an ablation's s = 0 group is not an on-policy control
def test_an_ablation_at_s0_does_not_make_a_task_controlled():
    from gacbench.bench.beyond import beyond_on_policy, controlled_tasks

    base = {"task": "t", "higher_is_better": True}
    groups = [{**base, "method": "sync", "staleness": 0, "ablation": False},
              {**base, "method": "stale", "staleness": 4, "ablation": False},
              {**base, "method": "gac", "staleness": 4, "ablation": False},
              {**base, "method": "gac-c0.1", "staleness": 0, "ablation": True}]
    assert controlled_tasks(groups) == set()
    assert beyond_on_policy(groups, [], "final") == ([], [])


# the regime threshold is 3 standard errors
def test_regime_two_standard_errors_is_not_enough():
    """rises 3 and 1: mean 2, se 1: 2 standard errors < REGIME_SE = 3."""
    from gacbench.bench.beyond import regime_checks

    (entry,) = regime_checks([_sync_cell(0, 0.0, 3.0), _sync_cell(1, 0.0, 1.0)])
    assert entry["sync"]["rise_in_se"] == pytest.approx(2.0) and entry["sync"]["learns"] is False
    assert entry["met"] is False
