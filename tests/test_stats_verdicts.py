"""Intervals that keep their coverage at a few seeds (Fieller's for the recovered share, the paired t for a gap),
the exact sign-flip p, the minimum detectable share and ``gacbench power``, the multiplicity families, the reward
indexed by policy version, and the findings paragraph."""

import itertools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from conftest import report_cell
from scipy import stats

from gacbench.bench.power import main as power_main
from gacbench.bench.power import power_rows
from gacbench.bench.records import by_version
from gacbench.bench.report import group_records, markdown, recovered_shares
from gacbench.bench.stats import (
    aligned_shares,
    aligned_values,
    apply_families,
    detectable_multiplier,
    fieller_interval,
    in_fieller,
    min_detectable_share,
    paired_difference,
    paired_t_power,
    resolve_families,
    seeds_needed,
    sign_flip_p,
)
from gacbench.bench.validate import check_families, load_suite
from gacbench.jsonio import json_safe
from gacbench.usage import UsageError


def _simulate(n, reps, rng, share=0.5, gap=1.0, noise=0.6):
    """Per-seed sync, stale and method values with a seed effect shared by the three runs of a seed and independent
    normal noise per run: true gap stale - sync = -gap (higher is better), true share ``share``."""
    seed_effect = rng.normal(0.0, noise, (reps, n, 1))
    eps = rng.normal(0.0, noise, (reps, n, 3))
    sync = 1.0 + seed_effect[..., 0] + eps[..., 0]
    stale = 1.0 - gap + seed_effect[..., 0] + eps[..., 1]
    method = 1.0 - gap + share * gap + seed_effect[..., 0] + eps[..., 2]
    return sync, stale, method


@pytest.mark.parametrize("n", [3, 5])
def test_fieller_share_and_t_gap_intervals_cover_at_few_seeds(n):
    rng = np.random.default_rng(n)
    reps = 2000
    sync, stale, method = _simulate(n, reps, rng)
    share_hits = gap_hits = 0
    for i in range(reps):
        low, high, kind = fieller_interval(stale[i] - method[i], stale[i] - sync[i])
        share_hits += in_fieller(0.5, low, high, kind)
        d = paired_difference(stale[i], sync[i])
        gap_hits += d["ci_low"] <= -1.0 <= d["ci_high"]
    print(f"\nn = {n}: simulated coverage of the 95% intervals over {reps} replications: Fieller share "
          f"{share_hits / reps:.3f}, paired-t gap {gap_hits / reps:.3f}")
    assert share_hits / reps >= 0.93 and gap_hits / reps >= 0.93


def test_fieller_is_the_set_of_ratios_the_paired_t_test_keeps():
    # property: r is in the interval exactly when the one-sample t-test of num - r den does not reject at 0.05
    rng = np.random.default_rng(7)
    for _ in range(40):
        n = int(rng.integers(3, 8))
        den = rng.normal(rng.choice([0.05, 1.0]), 0.5, n)
        num = rng.normal(0.5, 0.5, n)
        low, high, kind = fieller_interval(num, den)
        assert kind in ("bounded", "exclusive", "unbounded")
        for r in np.linspace(-6, 6, 61):
            keep = stats.ttest_1samp(num - r * den, 0.0).pvalue >= 0.05
            if abs(stats.ttest_1samp(num - r * den, 0.0).pvalue - 0.05) > 1e-6:
                assert in_fieller(r, low, high, kind) == keep


def test_fieller_kinds_by_hand():
    # no noise in the denominator: the t-interval of the per-seed ratios
    low, high, kind = fieller_interval(np.array([0.4, 0.5, 0.6]), np.ones(3))
    half = stats.t.ppf(0.975, 2) * 0.1 / math.sqrt(3)
    assert kind == "bounded" and (low, high) == pytest.approx((0.5 - half, 0.5 + half))
    # a denominator that straddles 0 and a numerator that does too: nothing is ruled out
    assert fieller_interval(np.array([1.0, -1.0, 0.5]), np.array([1.0, -1.0, 0.2]))[2] == "unbounded"
    # a numerator clearly away from 0 over a denominator that is not: two rays
    low, high, kind = fieller_interval(np.array([1.0, 1.1, 0.9]), np.array([1.0, -1.0, 0.3]))
    assert kind == "exclusive" and low < high and not in_fieller((low + high) / 2, low, high, kind)
    assert fieller_interval(np.ones(1), np.ones(1))[2] == "none"


def test_sign_flip_p_enumerates_every_assignment():
    d = np.array([0.3, -0.1, 0.5, 0.2])
    means = [abs(np.mean(np.array(s) * d)) for s in itertools.product((1, -1), repeat=4)]
    expected = sum(m >= abs(d.mean()) - 1e-12 for m in means) / 16
    assert sign_flip_p(d) == pytest.approx(expected)
    assert sign_flip_p(np.array([1.0, 2.0, 3.0])) == pytest.approx(0.25)  # the smallest p three seeds can give
    assert math.isnan(sign_flip_p(np.zeros(3))) and math.isnan(sign_flip_p(np.ones(1)))
    assert math.isnan(sign_flip_p(np.array([1.0, math.nan, 2.0])))  # as the t-test's p: no p with a missing pair
    assert math.isnan(paired_difference(np.array([1.0, math.nan, 2.0]), np.zeros(3))["p_signflip"])
    assert paired_difference(np.array([1.0, 2.0, 3.0]), np.zeros(3))["p_signflip"] == pytest.approx(0.25)


def test_sign_flip_p_samples_above_the_enumeration_limit():
    """Past SIGN_FLIP_EXACT_MAX pairs the p is a seeded Monte Carlo estimate: it stays within its sampling error
    of the exact p, repeats exactly, and 42 pairs (2^42 assignments, which enumeration cannot hold in memory)
    give an answer in bounded memory."""
    from gacbench.bench.stats import SIGN_FLIP_EXACT_MAX

    rng = np.random.default_rng(3)
    d = np.linspace(-1.0, 1.6, SIGN_FLIP_EXACT_MAX + 1)  # mean 0.3, exact p about 0.1
    exact = stats.permutation_test((d, np.zeros_like(d)), lambda x, y, axis=-1: np.mean(x - y, axis=axis),
                                   permutation_type="samples", vectorized=True, n_resamples=math.inf).pvalue
    estimate = sign_flip_p(d)
    assert 0.05 < exact < 0.95 and abs(estimate - exact) < 0.01  # sd of the estimate about 0.0016
    assert sign_flip_p(d) == estimate
    many = rng.normal(0.5, 1.0, 42)
    p = sign_flip_p(many)
    assert 0 < p < 0.05 and p == sign_flip_p(many)
    assert paired_difference(many, np.zeros(42))["p_signflip"] == p


def test_min_detectable_share_and_seeds_needed_by_hand():
    # at the multiplier the paired t-test rejects with the stated power: counted over simulated seeds
    rng = np.random.default_rng(3)
    for n in (3, 5):
        d = rng.normal(detectable_multiplier(n), 1.0, size=(40_000, n))
        t = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(n))
        rejected = np.mean(np.abs(t) > stats.t.ppf(0.975, n - 1))
        assert abs(rejected - 0.8) < 0.01  # sd of the count about 0.002
        # the sizing with t quantiles, (t_{0.975} + t_{0.8}) / sqrt(n), falls short at these n
        usual = (stats.t.ppf(0.975, n - 1) + stats.t.ppf(0.8, n - 1)) / math.sqrt(n)
        d = rng.normal(usual, 1.0, size=(40_000, n))
        t = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(n))
        assert np.mean(np.abs(t) > stats.t.ppf(0.975, n - 1)) < 0.795
    assert paired_t_power(detectable_multiplier(6, 0.9), 6) == pytest.approx(0.9, abs=1e-9)
    assert detectable_multiplier(4, power=0.05) == 0.0
    assert min_detectable_share(1.0, -1.0, 3) == pytest.approx(detectable_multiplier(3))
    assert min_detectable_share(0.2, 0.5, 5) == pytest.approx(detectable_multiplier(5) * 0.2 / 0.5)
    # target 0.5 with sd 0.1 and gap 0.5: the multiplier must be <= 2.5; n = 3 gives 3.26, n = 4 2.13
    assert detectable_multiplier(3) > 2.5 >= detectable_multiplier(4)
    assert seeds_needed(0.1, 0.5, 0.5) == 4
    for sd, target in ((0.3, 0.2), (1.0, 0.2), (0.05, 0.9)):  # bisection = the first n from a scan
        scan = next(n for n in range(2, 1001) if min_detectable_share(sd, 0.5, n) <= target)
        assert seeds_needed(sd, 0.5, target) == scan
    assert seeds_needed(0.1, 0.0, 0.5) is None and seeds_needed(10.0, 1e-6, 0.01) is None
    assert math.isnan(min_detectable_share(0.1, 0.5, 1))
    assert min_detectable_share(0.01, 1.0, 2) <= 0.5 and seeds_needed(0.01, 1.0, 0.5) == 2  # two seeds suffice


def _pilot_summary():
    row = {"task": "t", "method": "gac", "staleness": 16, "share": 0.3, "no_gap": False, "gap": -0.5,
           "sd_diff": 0.1, "vs_stale_n": 3, "vs_stale_p": 0.2, "vs_stale_p_adj": 0.2}
    return {"recovered": [], "recovered_reward": [row]}


def test_power_command_on_a_pilot_summary(tmp_path, capsys):
    (tmp_path / "summary.json").write_text(json.dumps(_pilot_summary()))
    (row,) = power_rows(_pilot_summary(), 0.5)
    assert row["seeds_needed"] == 4 and row["min_detectable_share"] == pytest.approx(
        min_detectable_share(0.1, -0.5, 3))
    args = SimpleNamespace(runs=str(tmp_path), target_share=0.5, power=0.8, alpha=0.05, json=False)
    assert power_main(args) == 0
    out = capsys.readouterr().out
    assert "every entry detectable at 0.5: 4 seeds" in out
    with pytest.raises(UsageError, match="summary.json does not exist"):
        power_main(SimpleNamespace(**{**vars(args), "runs": str(tmp_path / "none")}))
    with pytest.raises(UsageError, match="--power"):
        power_main(SimpleNamespace(**{**vars(args), "power": 1.5}))
    good = (tmp_path / "summary.json").read_text()
    for damaged, words in (("", "cannot be read as a summary"), (good[:40], "cannot be read as a summary"),
                           ("[1, 2]", "holds a JSON list, not a summary")):
        (tmp_path / "summary.json").write_text(damaged)
        with pytest.raises(UsageError, match=f"{words}.*gacbench report"):
            power_main(args)
    (tmp_path / "summary.json").write_text(good)
    # a method identical to stale on every seed (no spread) and a beyond-the-on-policy-effect entry, whose gap
    # is stored as sync - stale: strict JSON, one orientation of the gap, and no "> 1000" for an entry that no
    # number of seeds would test
    summary = _pilot_summary()
    summary["recovered_reward"].append({**summary["recovered_reward"][0], "method": "same", "sd_diff": 0.0})
    summary["beyond_on_policy_reward"] = [{"task": "t", "method": "gac", "staleness": 16, "share": 0.3, "n": 3,
                                           "measure": "reward_last",
                                           "gap": 0.5, "sd_diff": 0.1, "no_gap": False, "beyond_p": 0.2}]
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert power_main(SimpleNamespace(**{**vars(args), "json": True})) == 0
    rows = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    assert {r["gap"] for r in rows} == {0.5} and rows[1]["min_detectable_share"] is None
    assert power_main(args) == 0
    out = capsys.readouterr().out
    assert "— (sd 0)" in out and "> 1000" not in out
    assert "2 of the 3 entries detectable at 0.5: 4 seeds (1 entries have no seed-to-seed spread" in out


def test_the_no_gap_difference_follows_the_asked_power_and_reads_a_dash_without_spread(tmp_path, capsys):
    """A comparison with no stale - sync gap is sized as a difference at the power asked for (0.9 here), and an entry
    without seed-to-seed spread prints a dash, not nan."""
    entry = {"task": "t", "method": "gac", "staleness": 4, "measure": "final", "no_gap": True, "gap": 0.0,
             "sd_diff": 0.1, "vs_stale_n": 4, "share": math.nan, "n": 4}
    (row,) = power_rows({"recovered": [entry]}, 0.5, power=0.9)
    assert row["min_detectable_difference"] == pytest.approx(detectable_multiplier(4, 0.9) * 0.1)
    assert detectable_multiplier(4, 0.9) != pytest.approx(detectable_multiplier(4, 0.8))
    (tmp_path / "summary.json").write_text(json.dumps(json_safe({"recovered": [{**entry, "sd_diff": 0.0}]})))
    assert power_main(SimpleNamespace(runs=str(tmp_path), target_share=0.5, power=0.8, alpha=0.05, json=False)) == 0
    out = capsys.readouterr().out
    assert "nan" not in out.split("no stale − sync gap")[-1] and "—" in out.split("no stale − sync gap")[-1]


def test_each_comparison_gets_one_adjusted_p_within_its_family():
    rows8 = [{"task": "t", "method": m, "staleness": 8, "vs_stale_p": p} for m, p in (("a", 0.01), ("b", 0.04))]
    rows16 = [{"task": "t", "method": m, "staleness": 16, "vs_stale_p": p} for m, p in (("a", 0.01), ("b", 0.04))]
    on_policy = [{"task": "t", "method": "a", "staleness": 0, "vs_sync_p": 0.02}]
    fams = apply_families([("vs_stale", "reward_last", rows8 + rows16), ("vs_sync", "reward_last", on_policy)], None)
    # the default family of the vs-stale tests is split by s: {a, b} at s = 8 and {a, b} at s = 16, each m = 2
    assert [r["vs_stale_p_adj"] for r in rows8] == pytest.approx([0.02, 0.04])
    assert [r["vs_stale_p_adj"] for r in rows16] == pytest.approx([0.02, 0.04])
    assert on_policy[0]["vs_sync_p_adj"] == pytest.approx(0.02) and on_policy[0]["family"] == "on-policy effect"
    assert sorted((f["name"], f["m"]) for f in fams) == [("on-policy effect", 1), ("recovers the gap at s", 2),
                                                        ("recovers the gap at s", 2)]
    # a suite's family over every s: one family of four tests
    apply_families([("vs_stale", "reward_last", rows8 + rows16)], {"all against stale": {"test": "vs_stale",
                                                                                        "per": ["task"]}})
    assert [r["vs_stale_p_adj"] for r in rows8 + rows16] == pytest.approx([0.04, 0.08, 0.04, 0.08])
    assert {r["family"] for r in rows8 + rows16} == {"all against stale"}
    assert set(resolve_families({"x": {"test": "vs_stale", "per": []}})) == {
        "x", "on-policy effect", "staleness cost", "recovers beyond the on-policy effect at s", "threshold ablation"}


@pytest.mark.parametrize("families, message", [
    ([1], "must map family names"),
    ({"f": {"per": ["task"]}}, "must be a mapping with test"),
    ({"f": {"test": "vs_foo"}}, "test 'vs_foo' is not one of"),
    ({"f": {"test": "vs_stale"}, "g": {"test": "vs_stale", "per": ["staleness"]}}, "already in family 'f'"),
    ({"f": {"test": "vs_stale", "per": ["seed"]}}, "per: \\['seed'\\] must be a list of distinct keys"),
    ({"f": {"test": "vs_stale", "by": ["task"]}}, "unknown key 'by'"),
])
def test_bad_families_are_refused_with_the_fix(families, message):
    with pytest.raises(UsageError, match=message):
        check_families("suite x", families)


def test_a_suite_declares_its_families(tmp_path):
    suite = yaml.safe_load((Path(__file__).parents[1] / "tasks/suites/synthetic-smoke.yaml").read_text())
    suite["families"] = {"recovers the gap": {"test": "vs_stale", "per": ["task", "staleness"]}}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(suite))
    assert load_suite(str(path))["families"] == {"recovers the gap": {"test": "vs_stale",
                                                                      "per": ["task", "staleness"]}}
    suite["families"] = {"f": {"test": "nope"}}
    path.write_text(yaml.safe_dump(suite))
    with pytest.raises(UsageError, match="families: 'f': test 'nope'"):
        load_suite(str(path))


def test_the_training_reward_is_filed_under_the_policy_version_that_earned_it():
    # s = 2: lag min(t, 2); steps 0, 1, 2 sample theta_0 and step t >= 2 samples theta_{t-2}
    series = {"reward/mean": [(t, float(t)) for t in range(6)], "stale/lag": [(t, float(min(t, 2))) for t in range(6)]}
    assert by_version(series) == {"reward/mean": {0: 1.0, 1: 3.0, 2: 4.0, 3: 5.0}}
    sync = {"reward/mean": [(t, float(t)) for t in range(3)], "eval/policy_reward": [(0, 0.5), (2, 0.7)]}
    assert by_version(sync) == {"reward/mean": {0: 0.0, 1: 1.0, 2: 2.0}, "eval/policy_reward": {0: 0.5, 2: 0.7}}

    # asynchronous batches that mix versions 3 and 4 (mean lag 0.5, 1.5, 2.5 at steps 4, 5, 6): each version's
    # reward under its own version, never the mixed mean under a rounded lag
    mixed = {"reward/mean": [(4, 0.3), (5, 0.3), (6, 0.3)], "stale/lag": [(4, 0.5), (5, 1.5), (6, 2.5)],
             "reward/lag/0": [(4, 0.4)], "reward/lag/1": [(4, 0.2), (5, 0.4)], "reward/lag/2": [(5, 0.2), (6, 0.4)],
             "reward/lag/3": [(6, 0.2)]}
    assert by_version(mixed) == {"reward/mean": {3: pytest.approx(0.2), 4: pytest.approx(0.4)}}


def _versioned(method, s, seed, rewards, lag):
    rec = report_cell("t", method, s, seed, 0.0, reward=float(np.mean(rewards[-2:])))
    rec["_by_version"] = by_version({"reward/mean": list(enumerate(rewards)),
                                     "stale/lag": [(t, float(min(t, lag))) for t in range(len(rewards))]})
    return rec


def test_the_version_aligned_share_compares_the_same_policy_versions():
    # 10 steps; sync's reward at version v is v / 10; stale (s = 2) earns 0.8 of it, gac 0.9, at the version
    # that sampled it. The window: 20% of sync's 10 versions = 2, ending at the last version every run has (7)
    cells, noise = [], [0.0, 0.01, -0.01]
    for k in range(3):
        cells.append(_versioned("sync", 0, k, [v / 10 + noise[k] for v in range(10)], 0))
        for m, f in (("stale", 0.8), ("gac", 0.9)):
            cells.append(_versioned(m, 2, k, [f * max(t - 2, 0) / 10 + noise[k] for t in range(10)], 2))
    al = aligned_values(cells, "t", 2)
    assert al["measure"] == "reward/mean" and al["versions"] == [6, 7]
    assert al["seeds"][("t", "sync", 0)][1] == pytest.approx(0.65 + 0.01)
    assert al["seeds"][("t", "stale", 2)][1] == pytest.approx(0.8 * 0.65 + 0.01)
    (row,) = aligned_shares(group_records(cells), cells)
    # share = (stale - gac) / (stale - sync) = (0.8 - 0.9) / (0.8 - 1) = 0.5 on every seed
    assert row["share"] == pytest.approx(0.5) and row["lag_removed"] == 2 and row["source"] == "reward/mean"
    assert row["share_ci_low"] == pytest.approx(0.5) and row["share_ci_high"] == pytest.approx(0.5)
    # the training reward of the last 2 steps compares sync's versions 8-9 with stale's 6-7: a wider gap
    last = {m: np.mean([c["reward_last"] for c in cells if c["method"] == m]) for m in ("sync", "stale")}
    assert last["sync"] - last["stale"] > row["sync"] - row["stale"] + 0.1
    # eval/policy_reward is the measure where every run of the comparison logs it
    for c in cells:
        c["_by_version"]["eval/policy_reward"] = {v: 1.0 for v in range(10)}
    assert aligned_values(cells, "t", 2)["measure"] == "eval/policy_reward"


def test_findings_single_seeds_and_the_difference_to_stale_in_table_1():
    diffs = {"gac": [0.5, 0.55, 0.6], "tis": [0.05, -0.05, 0.01]}
    cells = ([report_cell("t", "sync", 0, k, 1.0 + 0.01 * k) for k in range(3)]
             + [report_cell("t", "stale", 16, k, 0.2 + 0.01 * k) for k in range(3)]
             + [report_cell("t", m, 16, k, 0.2 + 0.01 * k + d[k]) for m, d in diffs.items() for k in range(3)]
             + [report_cell("t", "m2po", 16, 0, 0.3)])
    groups = group_records(cells)
    shares = recovered_shares(groups, cells=cells)
    md = markdown(cells, groups, shares, Path("x"))
    top = md[md.index("## Findings"):md.index("## t: final")]
    assert "beat stale: gac at s = 16" in top and "not distinguishable from stale: " in top
    tis = next(r for r in shares if r["method"] == "tis")
    assert f"tis at s = 16 (share {tis['share']:.2f}, min. detectable share {tis['min_detectable_share']:.2g})" in top
    assert "| m2po |  | 0.3 (n = 1) |" in md  # one seed: no ± 0
    table1 = md[md.index("### t: final reward"):].splitlines()
    assert table1[2].endswith("− stale | Δ | seeds |")
    assert next(x for x in table1 if x.startswith("| tis |")).endswith(f"| {0.01 / 3:+.3g} | – | 3 |")
    assert next(x for x in table1 if x.startswith("| m2po |")).split(" | ")[-3] == f"{0.3 - 0.21:+.3g}"


def _final_cell(method, s, seed, final):
    return {"task": "bandit", "method": method, "staleness": s, "seed": seed, "status": "done", "ablation": False,
            "metric": "reward", "higher_is_better": True, "initial": 0.0, "final": final, "diverged": False,
            "cos_median": 0, "cos_abs_q90": 0, "cos_abs_le_005": 0}


@pytest.mark.parametrize("shift,seeds,wording", [
    (0.25, 5, "gac at s = 16 (the same difference, +0.25, on every seed)"),
    (0.0, 5, "gac at s = 16 (identical to stale on every seed)"),
    (0.25, 1, "gac at s = 16 (one seed)"),
])
def test_a_method_without_a_paired_test_is_named_as_untested_not_as_indistinguishable(shift, seeds, wording):
    """A t-test needs two seeds whose differences vary: without one (one seed, or the same difference on every seed)
    the findings say so, and no detectable share is claimed (it would be 0 from a standard deviation of 0)."""
    from gacbench.bench.stats import apply_families
    from gacbench.bench.tables import findings

    sync, stale = [0.90, 0.93, 0.88, 0.91, 0.95][:seeds], [0.50, 0.61, 0.55, 0.47, 0.58][:seeds]
    cells = ([_final_cell("sync", 0, k, v) for k, v in enumerate(sync)]
             + [_final_cell("stale", 16, k, v) for k, v in enumerate(stale)]
             + [_final_cell("gac", 16, k, v + shift) for k, v in enumerate(stale)])  # 0.25: exact in binary
    rows = recovered_shares(group_records(cells), cells=cells)
    apply_families([("vs_stale", "final", rows)], None)
    assert math.isnan(rows[0]["vs_stale_p"]) and not rows[0]["min_detectable_share"] == 0
    text = "\n".join(findings(rows, [], []))
    assert "No paired test: " + wording in text and "not distinguishable" not in text
    assert math.isnan(min_detectable_share(0.0, 0.5, 5)) and seeds_needed(0.0, 0.5, 0.5) is None


def test_an_adjusted_p_near_alpha_is_printed_on_its_side_of_it():
    from gacbench.bench.tables import fmt_p

    assert (fmt_p(0.0496), fmt_p(0.0504), fmt_p(0.012345), fmt_p(0.31), fmt_p(None)) == (
        "0.0496", "0.0504", "0.012", "0.31", "—")


def test_a_report_rebuilt_without_its_suite_adjusts_the_families_that_built_it(tmp_path, capsys):
    from conftest import bench, quadratic_suite

    from gacbench.cli import main

    declared = {"one family for everything": {"test": "vs_stale", "per": []}}
    suite = quadratic_suite(tmp_path, staleness=[0, 2, 4], seeds=[0, 1], families=declared)
    out = tmp_path / "out"
    assert bench(suite, out) == 0
    first = json.loads((out / "summary.json").read_text())
    assert first["declared_families"] == declared
    names = {f["name"] for f in first["families"] if f["test"] == "vs_stale"}
    assert names == {"one family for everything"}
    assert main(["report", str(out)]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["families"] == first["families"] and again["recovered"] == first["recovered"]
    # an older summary that records none: the defaults, said on standard error; --suite still picks a suite's
    again.pop("declared_families")
    (out / "summary.json").write_text(json.dumps(again))
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    assert "records no multiplicity families; adjusting with the default families" in capsys.readouterr().err
    rebuilt = json.loads((out / "summary.json").read_text())
    assert {f["name"] for f in rebuilt["families"]} != names and "declared_families" not in rebuilt
    assert main(["report", str(out)]) == 0  # still unknown: said again, not recorded as the defaults
    assert "records no multiplicity families" in capsys.readouterr().err
    (out / "summary.json").unlink()  # a new clone of a grid store (summaries are not tracked): the same note
    assert main(["report", str(out)]) == 0
    assert "summary.json cannot be read; adjusting with the default families" in capsys.readouterr().err
    assert main(["report", str(out), "--suite", str(suite)]) == 0
    assert json.loads((out / "summary.json").read_text())["families"] == first["families"]


def test_findings_read_a_noise_gap_as_a_difference_and_size_a_negative_at_its_familys_level():
    """Where the stale - sync gap is within seed noise, the findings give the difference to stale and the smallest
    difference the seeds detect, not a share (a ratio of noise); a negative result's detectable share is also given
    at its family's level alpha / m; a share that rounds to zero prints as 0.00."""
    from gacbench.bench.stats import ALPHA, apply_families
    from gacbench.bench.tables import findings

    # task "q": sync and stale overlap (gap 0.033 with a standard error of about 0.2); gac beats stale clearly
    noisy = ([_final_cell("sync", 0, k, v) for k, v in enumerate([1.0, 0.2, 0.6])]
             + [_final_cell("stale", 16, k, v) for k, v in enumerate([0.55, 0.65, 0.5])]
             + [_final_cell("gac", 16, k, v) for k, v in enumerate([0.85, 0.96, 0.79])])
    for c in noisy:
        c["task"] = "q"
    # task "t": a clear gap of 0.4; tis is noise around stale (share about 0), gspo too
    clear = ([_final_cell("sync", 0, k, v) for k, v in enumerate([0.90, 0.93, 0.88, 0.91])]
             + [_final_cell("stale", 16, k, v) for k, v in enumerate([0.50, 0.53, 0.48, 0.51])]
             + [_final_cell("tis", 16, k, v) for k, v in enumerate([0.52, 0.50, 0.49, 0.51])]
             + [_final_cell("gspo", 16, k, v) for k, v in enumerate([0.56, 0.47, 0.50, 0.49])])
    for c in clear:
        c["task"] = "t"
    cells = noisy + clear
    rows = recovered_shares(group_records(cells), cells=cells)
    apply_families([("vs_stale", "final", rows)], {"all": {"test": "vs_stale", "per": ["task"]}})
    by = {(r["task"], r["method"]): r for r in rows}
    gac, tis = by[("q", "gac")], by[("t", "tis")]
    assert gac["gap_within_noise"] and gac["vs_stale_p_adj"] < 0.05
    text = "\n".join(findings(rows, [], []))
    assert (f"beat stale: gac at s = 16 (gap within noise: difference to stale {gac['vs_stale_diff']:+.3g} "
            f"[{gac['vs_stale_ci_low']:.3g}, {gac['vs_stale_ci_high']:.3g}], p adj.") in text
    assert "gac at s = 16 (share" not in text
    # the family of task t holds two tests: its level is alpha / 2
    want = min_detectable_share(tis["sd_diff"], tis["gap"], 4, alpha=ALPHA / 2)
    assert tis["min_detectable_share_family"] == pytest.approx(want) and want > tis["min_detectable_share"]
    assert f"{tis['share']:.2f}" == "-0.00"  # printed as 0.00
    assert (f"tis at s = 16 (share 0.00, min. detectable share {tis['min_detectable_share']:.2g} "
            f"[{want:.2g} at its family's level])") in text
    assert "share -0.00" not in text


def test_a_missing_reward_and_a_constant_difference_make_no_verdict_they_cannot_support():
    """A seed whose training reward is not finite is left out of its group's mean, as the paired statistics leave
    it out (not read as 'stale no worse than sync'); equal differences to stale give no detectable share."""
    from gacbench.bench.report import group_records as groups_of

    cells = ([report_cell("t", "sync", 0, k, 0.0, reward=r) for k, r in enumerate([1.0, 1.1, math.nan])]
             + [report_cell("t", "stale", 8, k, 0.0, reward=r) for k, r in enumerate([0.5, 0.6, math.nan])]
             + [report_cell("t", "gac", 8, k, 0.0, reward=r) for k, r in enumerate([0.8, 0.85, math.nan])])
    groups = groups_of(cells)
    stale = next(g for g in groups if g["method"] == "stale")
    assert stale["reward_last_mean"] == pytest.approx(0.55)
    (row,) = recovered_shares(groups, "reward_last", cells=cells)
    assert not row["no_gap"] and row["gap"] == pytest.approx(-0.5) and row["share"] == pytest.approx(0.55)
    # the gap's standard error over the two finite seeds of each: sqrt(0.05^2 / 1 + 0.05^2 / 1)
    assert stale["reward_last_n"] == 2 and row["gap_se"] == pytest.approx(math.sqrt(2 * 0.05**2))
    constant = ([_final_cell("sync", 0, k, v) for k, v in enumerate([0.9, 0.95, 0.85])]
                + [_final_cell("stale", 16, k, v) for k, v in enumerate([0.5, 0.6, 0.55])]
                + [_final_cell("gac", 16, k, v + 0.1) for k, v in enumerate([0.5, 0.6, 0.55])])
    (row,) = recovered_shares(group_records(constant), cells=constant)
    assert row["min_detectable_share"] is None or math.isnan(row["min_detectable_share"])


def test_a_share_over_fewer_seeds_than_its_test_says_both_counts():
    from gacbench.bench.tables import findings

    cells = ([_final_cell("sync", 0, k, v) for k, v in enumerate([0.9, 0.95])]
             + [_final_cell("stale", 16, k, 0.5 + 0.01 * k) for k in range(5)]
             + [_final_cell("gac", 16, k, 0.7 + 0.013 * k) for k in range(5)])
    (row,) = recovered_shares(group_records(cells), cells=cells)
    assert (row["n"], row["vs_stale_n"]) == (2, 5) and row["vs_stale_p_adj"] < 0.05
    assert "over the 2 seeds sync also ran; the test pairs 5" in "\n".join(findings([row], [], []))


def test_equal_differences_beyond_the_on_policy_effect_give_no_detectable_share():
    from gacbench.bench.beyond import _beyond_row

    sync, stale = np.array([0.9, 0.95, 0.85]), np.array([0.5, 0.6, 0.55])
    row = _beyond_row("t", "gac", 16, "final", "gac at s = 0", stale + 0.1, stale, sync, sync)
    assert math.isnan(row["beyond_p"]) and row["sd_diff"] == 0.0
    assert row["min_detectable_share"] is None or math.isnan(row["min_detectable_share"])


def test_the_controls_and_beyond_tables_star_the_adjusted_p_only():
    """Both captions say '*' where p_adj < 0.05: a row with raw p 0.01 but p_adj 0.20 has none, one with p_adj
    0.012 has it."""
    from gacbench.bench.tables import _beyond_section, _on_policy_table

    base = dict(task="t", method="tis", sync=0.5, value=0.6, vs_sync_diff=0.1, vs_sync_ci_low=0.02,
                vs_sync_ci_high=0.18, n=5)
    rows = [dict(base, vs_sync_p=0.01, vs_sync_p_adj=0.20),
            dict(base, method="gspo", vs_sync_p=0.004, vs_sync_p_adj=0.012)]
    lines = [line for line in _on_policy_table("training reward", rows) if line.startswith("| t |")]
    assert ["*" in line.split("|")[5] for line in lines] == [False, True]
    b = dict(task="t", staleness=2, method="gac", control="sync", no_gap=False, beyond_ci_kind="bounded",
             beyond_ci_low=0.1, beyond_ci_high=0.9, beyond_on_policy_share=0.5, raw_share=0.5, on_policy_effect=0.0,
             gap=0.1, min_detectable_share=0.4, n=5)
    rows = [dict(b, beyond_p=0.01, beyond_p_adj=0.2), dict(b, method="gspo", beyond_p=0.004, beyond_p_adj=0.012)]
    lines = [line for line in _beyond_section({"reward_last": rows}, []) if line.startswith("| t |")]
    assert ["*" in line.split("|")[5] for line in lines] == [False, True]


def _bandit_cell(method, s, seed, final):
    """A done bandit cell record with its final reward (what group_records and recovered_shares read)."""
    return {"task": "bandit", "method": method, "staleness": s, "seed": seed, "status": "done", "ablation": False,
            "metric": "reward", "higher_is_better": True, "initial": 0.0, "final": final, "diverged": False,
            "cos_median": 0, "cos_abs_q90": 0, "cos_abs_le_005": 0}


def test_a_comparison_without_a_gap_is_named_once_and_left_out_of_the_share_table():
    """Stale at s = 4 no worse than sync (sync 0.50/0.52/0.49, stale 0.60/0.63/0.58): gac there has no gap to
    recover. The findings say so once, not also 'not distinguishable from stale'; the across-s table leaves the
    entry empty."""
    from gacbench.bench.tables import _share_cell, findings

    cells = ([_bandit_cell("sync", 0, k, v) for k, v in enumerate([0.50, 0.52, 0.49])]
             + [_bandit_cell("stale", 4, k, v) for k, v in enumerate([0.60, 0.63, 0.58])]
             + [_bandit_cell("gac", 4, k, v) for k, v in enumerate([0.61, 0.60, 0.59])])
    rows = recovered_shares(group_records(cells), cells=cells)
    assert rows[0]["no_gap"]
    text = "\n".join(findings(rows, [], []))
    assert "no gap to recover there (gac)" in text and "not distinguishable" not in text
    assert _share_cell(rows[0]) == ""


def test_stale_ahead_of_sync_within_noise_gives_the_difference_to_stale_and_what_the_seeds_detect(tmp_path, capsys):
    """Stale at s = 4 ahead of sync by less than the seed noise (sync 0.50/0.60/0.40, stale 0.52/0.62/0.45): no
    share, but the findings give gac's difference to stale with its interval and the smallest difference its seeds
    detect, as for any gap within noise; `gacbench power` lists the entry with that difference, apart from the
    entries it sizes, instead of leaving it out."""
    from gacbench.bench.tables import findings

    cells = ([_bandit_cell("sync", 0, k, v) for k, v in enumerate([0.50, 0.60, 0.40])]
             + [_bandit_cell("stale", 4, k, v) for k, v in enumerate([0.52, 0.62, 0.45])]
             + [_bandit_cell("gac", 4, k, v) for k, v in enumerate([0.53, 0.60, 0.47])])
    (row,) = recovered_shares(group_records(cells), cells=cells)
    assert row["no_gap"] and row["gap_within_noise"]
    text = "\n".join(findings([row], [], []))
    want = detectable_multiplier(3) * row["sd_diff"]
    assert ("stale is no worse than sync at s = 4 within the seed noise of the seeds each comparison pairs; not "
            "distinguishable from stale: gac at s = 4 "
            f"(difference to stale {row['vs_stale_diff']:+.3g} [{row['vs_stale_ci_low']:.3g}, "
            f"{row['vs_stale_ci_high']:.3g}], min. detectable difference {want:.2g})") in text
    assert "no gap to recover" not in text
    (entry,) = power_rows({"recovered": [row], "recovered_reward": []}, 0.5)
    assert entry["no_gap"] and entry["seeds_needed"] is None and math.isnan(entry["min_detectable_share"])
    assert entry["min_detectable_difference"] == pytest.approx(want)
    (tmp_path / "summary.json").write_text(json.dumps(json_safe({"recovered": [row], "recovered_reward": []})))
    assert power_main(SimpleNamespace(runs=str(tmp_path), target_share=0.5, power=0.8, alpha=0.05, json=False)) == 0
    out = capsys.readouterr().out
    assert "1 entries have no stale − sync gap" in out and f"{want:.3g}" in out and "detectable at 0.5" not in out


def test_a_share_of_noise_is_given_as_the_difference_with_the_detectable_one_of_the_paired_seeds():
    """A Fieller interval of two rays ('exclusive': the gap is not distinguishable from 0 at the t level, though
    above 2 standard errors at 3 seeds) is reported as the difference to stale, not as a share; the detectable
    difference of a gap within noise is that of the paired test against stale, on its 6 seeds (not the 2 of n)."""
    from gacbench.bench.tables import _detectable_text, _share_text

    row = {"share": 0.42, "no_gap": False, "gap_within_noise": False, "share_ci_kind": "exclusive",
           "share_ci_excluded": [-0.3, 1.9], "vs_stale_diff": 0.05, "vs_stale_ci_low": -0.01,
           "vs_stale_ci_high": 0.11, "n": 3, "vs_stale_n": 3}
    # above 2 standard errors, so not "within noise": the seeds did not resolve it at the t level
    assert _share_text(row).startswith("gap not resolved by these seeds (the share's 95% interval is not bounded): "
                                       "difference to stale +0.05 [-0.01, 0.11]")
    assert _share_text({**row, "gap_within_noise": True}).startswith("gap within noise: difference to stale +0.05")
    text = _detectable_text({"gap_within_noise": True, "sd_diff": 0.1, "n": 2, "vs_stale_n": 6})
    assert f"{detectable_multiplier(6) * 0.1:.2g}" in text and f"{detectable_multiplier(2) * 0.1:.2g}" not in text


def test_a_sync_run_whose_reward_stayed_flat_is_not_healthy():
    """Healthy sync training is one whose reward rose from its first to its last 20% of steps: flat at 0 on both
    seeds (it never learned) is not."""
    from gacbench.bench.regime import regime_points

    def cell(task, method, s, seed):
        return {"task": task, "method": method, "staleness": s, "seed": seed, "status": "done", "ablation": False,
                "metric": "reward", "higher_is_better": True, "initial": 0.0, "final": 0.0, "diverged": False,
                "cos_median": 0.0, "cos_abs_q90": 0.1, "cos_abs_le_005": 0.5, "cos_max_abs": 0.2,
                "reward_first": 0.0, "reward_last": 0.0, "reward_drop": 0.0, "degraded": False}

    specs = [{"task": f"t-{lr}", "objective": "grpo", "params": {"lr": lr}} for lr in (1e-4, 1e-3)]
    cells = [cell(sp["task"], m, s, k) for sp in specs for m, s in (("sync", 0), ("stale", 8)) for k in (0, 1)]
    points = regime_points(cells, specs)
    assert len(points) == 2 and all(p["sync_healthy"] is False for p in points)


def test_a_share_that_rounds_to_zero_prints_as_zero_in_every_table():
    """A share of -0.001 is 0.00 in the by-version table, the recovered-share table and the across-s table, never
    -0.00."""
    from gacbench.bench.tables import _aligned_section, _share_cell, _share_table

    row = {"task": "t", "staleness": 4, "method": "gac", "source": "eval/policy_reward", "versions": [9, 10],
           "sync": 0.25, "stale": 0.2, "value": 0.2, "share": -0.001, "share_ci_kind": "unbounded", "no_gap": False,
           "gap_within_noise": True, "vs_stale_p_adj": None, "min_detectable_share": None, "n": 2}
    text = "\n".join(_aligned_section([row]) + _share_table("Recovered", [row]) + [_share_cell(row)])
    assert "| 0.00 (−∞, ∞) |" in text and "| 0.00 (gap < 2 s.e." in text and _share_cell(row).startswith("0.00 ")
    assert "-0.00" not in text


def test_the_detectable_shares_are_sized_on_the_seeds_of_the_test_against_stale():
    """stale and gac share 6 seeds, sync only 3: the share's means pair 3 seeds, the test against stale 6, and
    its minimum detectable share (and that at its family's level) is sized on the 6; a family's m counts the
    tests that have a p-value."""
    from gacbench.bench.stats import _with_ci

    seeds = {("t", "sync", 0): {0: 0.9, 1: 0.8, 2: 0.85}, ("t", "stale", 2): {i: 0.5 + 0.01 * i for i in range(6)},
             ("t", "gac", 2): {i: 0.6 + 0.013 * i * (-1) ** i for i in range(6)}}
    row = _with_ci({"task": "t", "method": "gac", "staleness": 2, "no_gap": False, "gap": -0.35}, seeds, "final", True)
    assert row["n"] == 3 and row["vs_stale_n"] == 6
    assert row["min_detectable_share"] == pytest.approx(min_detectable_share(row["sd_diff"], row["gap"], 6))
    base = {"task": "t", "staleness": 2, "min_detectable_share": 0.5, "sd_diff": 0.1, "gap": 0.2, "n": 2,
            "vs_stale_n": 6}
    rows = [{**base, "method": "gac", "vs_stale_p": 0.01}, {**base, "method": "m2po", "vs_stale_p": 0.2},
            {**base, "method": "tis", "vs_stale_p": None}]
    (family,) = apply_families([("vs_stale", "final", rows)], None)
    assert family["m"] == 2  # tis has no test
    assert rows[0]["min_detectable_share_family"] == pytest.approx(min_detectable_share(0.1, 0.2, 6, alpha=0.05 / 2))


def test_a_fractional_lag_files_a_reward_under_the_nearest_version():
    """A step's reward is filed under step - lag, the lag (a mean over a batch's samples) rounded to the nearest
    version: step 5 with lag 1.6 is version 3, with lag 1.4 version 4."""
    assert by_version({"reward/mean": [(5, 0.3)], "stale/lag": [(5, 1.6)]})["reward/mean"] == {3: 0.3}
    assert by_version({"reward/mean": [(5, 0.3)], "stale/lag": [(5, 1.4)]})["reward/mean"] == {4: 0.3}
