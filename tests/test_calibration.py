"""GAC thresholds anchored to a synchronous run: the rule on hand-made traces, and gac-calibrated in a grid."""

import json
import math

import numpy as np
import pytest
import yaml

from gacbench.bench.cell import cell_dir
from gacbench.bench.report import read_metrics
from gacbench.bench.runner import expand_cells, load_suite, run_grid
from gacbench.cli import UsageError
from gacbench.functional.alignment import gac_decision
from gacbench.functional.calibration import calibrate_thresholds, calibration_record
from gacbench.functional.stats import alignment_summary
from gacbench.methods import CalibratedGAC, method_callbacks, parse_method


def test_rule_on_a_hand_made_trace():
    # |c| = 0.00, 0.01, ..., 0.09 after a warm-up of two large values: q0.9 by linear interpolation is
    # 0.081 (position 8.1 of 0..9), max 0.09; c_high = max(0.081 + 0.25, 0.09) = 0.331
    trace = [0.9, -0.8] + [(-1) ** k * k / 100 for k in range(10)]
    low, high = calibrate_thresholds(trace, warmup=2)
    assert low == pytest.approx(0.081) and high == pytest.approx(0.331)
    # the warm-up matters: with it the transient would set the range
    low2, high2 = calibrate_thresholds(trace, warmup=0, min_steps=5)
    assert low2 > 0.5 and high2 == pytest.approx(0.95)


def test_c_high_is_never_below_a_synchronous_step():
    trace = [0.02] * 30 + [0.6]  # one large synchronous |c_t|: c_high = max(0.27, 0.6)
    low, high = calibrate_thresholds(trace)
    assert low == pytest.approx(0.02) and high == pytest.approx(0.6)


def test_caps_keep_a_shrink_band_below_one():
    rec = calibration_record([0.99] * 20)
    assert (rec["c_low"], rec["c_high"]) == (pytest.approx(0.7), pytest.approx(0.95)) and rec["clipped"]
    assert not calibration_record([0.01] * 20)["clipped"]


@pytest.mark.parametrize("q,top,expected", [(0.0471, 0.0924, (0.0471, 0.2971)), (0.0687, 0.1276, (0.0687, 0.3187)),
                                            (0.0296, 0.0645, (0.0296, 0.2796)), (0.0317, 0.0625, (0.0317, 0.2817))])
def test_paper_table3_maps_to_the_paper_defaults(q, top, expected):
    low, high = calibrate_thresholds({"q90_abs": q, "max_abs": top})
    assert (low, high) == pytest.approx(expected)
    assert abs(low - 0.05) <= 0.021 and abs(high - 0.3) <= 0.021


def test_trace_and_its_summary_agree_and_nans_are_dropped():
    rng = np.random.default_rng(0)
    trace = list(rng.normal(0, 0.05, 200)) + [math.nan]
    s = alignment_summary(trace, warmup=20)
    assert calibrate_thresholds(trace, warmup=20) == pytest.approx(calibrate_thresholds(s))


def test_too_short_or_bad_input_is_refused():
    with pytest.raises(ValueError, match="at least 10"):
        calibrate_thresholds([0.1] * 15, warmup=10)
    with pytest.raises(ValueError, match="q90_abs"):
        calibrate_thresholds({"max_abs": 0.1})
    with pytest.raises(ValueError, match="quantile"):
        calibrate_thresholds({"q90_abs": 0.05, "max_abs": 0.1}, quantile=0.8)
    with pytest.raises(ValueError, match="gap"):
        calibrate_thresholds([0.1] * 20, gap=0.99)


def test_calibrated_gac_from_a_trace_and_refusals():
    cb = CalibratedGAC(reference=[0.9] * 5 + [0.01 * k for k in range(11)], reference_warmup=5)
    assert (cb.transform.c_low, cb.transform.c_high) == pytest.approx((0.09, 0.34))
    with pytest.raises(ValueError, match="computed from the synchronous"):
        method_callbacks("gac-calibrated(c_low=0.1)")
    assert parse_method("gac-calibrated+m2po")[0].reference == "sync"
    with pytest.raises(ValueError, match="at most one"):
        parse_method("gac-calibrated+gac-calibrated")


def _suite(tmp_path, **over):
    suite = {"name": "cal", "steps": 60, "warmup": 10,
             "tasks": {"quadratic": {"objective": "quadratic",
                                     # started at the optimum: synchronous c_t is noise from the first step
                                     "params": {"optimizer": "sgd", "lr": 0.1, "sigma2": 10.0, "kappa": 10.0,
                                                "init_scale": 0.0}}},
             "methods": ["gac-calibrated", "sync"], "staleness": [0, 8], "seeds": [0, 1]}
    suite.update(over)
    path = tmp_path / "cal.yaml"
    path.write_text(yaml.safe_dump(suite))
    return load_suite(str(path))


@pytest.mark.parametrize("workers", [1, 2])
def test_calibrated_cell_uses_thresholds_from_its_sync_cell(tmp_path, workers):
    out = tmp_path / "out"
    cells = expand_cells(_suite(tmp_path))  # gac-calibrated listed before sync: the runner still runs sync first
    assert run_grid(cells, out, workers=workers)["failed"] == 0
    for seed in (0, 1):
        sync = next(c for c in cells if c["method"] == "sync" and c["seed"] == seed)
        cal = next(c for c in cells if c["method"] == "gac-calibrated" and c["seed"] == seed)
        sync_cos = [v for _, v in sorted(read_metrics(cell_dir(out, sync) / "metrics.csv")["align/cos"])]
        expected = calibrate_thresholds(sync_cos, warmup=10)
        stored = json.loads((cell_dir(out, cal) / "config.json").read_text())["calibration"]
        assert (stored["c_low"], stored["c_high"]) == pytest.approx(expected)
        assert stored["reference"] == f"cells/quadratic/sync/s0/seed{seed}" and stored["n"] == len(sync_cos) - 10
        series = read_metrics(cell_dir(out, cal) / "metrics.csv")
        assert series["gac/c_low"][0][1] == pytest.approx(expected.c_low)
        # every logged step's GAC coefficient is the rule's at the calibrated thresholds, not at the defaults
        cos, coef = dict(series["align/cos"]), dict(series["gac/coef"])
        steps = sorted(set(cos) & set(coef))
        assert len(steps) > 40
        assert all(coef[t] == pytest.approx(gac_decision(cos[t], *expected).coef) for t in steps)
        assert any(gac_decision(cos[t]).coef != pytest.approx(coef[t]) for t in steps)
    seeds_differ = [json.loads((cell_dir(out, c) / "config.json").read_text())["calibration"]["c_low"]
                    for c in cells if c["method"] == "gac-calibrated"]
    assert seeds_differ[0] != seeds_differ[1]  # each seed's own sync cell


def test_calibrated_cell_without_its_sync_cell_is_refused_then_uses_a_stored_one(tmp_path):
    out = tmp_path / "out"
    suite = _suite(tmp_path, seeds=[0])
    with pytest.raises(UsageError, match="neither in this grid nor done"):
        run_grid(expand_cells(suite, methods=["gac-calibrated"]), out)
    assert run_grid(expand_cells(suite, methods=["sync"]), out)["ran"] == 1
    result = run_grid(expand_cells(suite, methods=["gac-calibrated"]), out)  # the stored sync cell is the reference
    assert result["ran"] == 1 and result["failed"] == 0


def test_a_failed_reference_fails_its_dependents_without_running_them(tmp_path):
    out = tmp_path / "out"
    suite = _suite(tmp_path, seeds=[0])
    suite["tasks"]["quadratic"]["params"]["optimizer"] = "nope"  # every cell fails to build its optimizer
    result = run_grid(expand_cells(suite), out)
    assert result["failed"] == 2
    status = json.loads((out / "cells/quadratic/gac-calibrated/s8/seed0/status.json").read_text())
    assert "reference cell" in status["error"] and "failed" in status["error"]


# calibration_record's clipped flag when only c_high is capped
def test_clipped_says_when_the_cap_lowers_c_high_alone():
    """|c_t| = 18 x 0, 0.1, 0.99: q_0.9 = 0.1 x (0.9 x 19 - 17) = 0.01 (linear interpolation), c_low = 0.01 (no cap),
    c_high = min(max(0.26, 0.99), 0.95) = 0.95 < 0.99: the cap acted."""
    from gacbench.functional.calibration import calibration_record

    rec = calibration_record([0.0] * 18 + [0.1, 0.99])
    assert rec["q_abs"] == pytest.approx(0.01) and rec["c_low"] == pytest.approx(0.01)
    assert rec["c_high"] == pytest.approx(0.95) and rec["clipped"] is True


# quantile = 1 (the maximum) is allowed
def test_quantile_one_reads_the_maximum():
    from gacbench.functional.calibration import calibrate_thresholds

    assert calibrate_thresholds([0.01 * i for i in range(20)], quantile=1.0) == (pytest.approx(0.19),
                                                                                  pytest.approx(0.44))
