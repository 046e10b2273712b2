"""The model-size axis of a report: paper Table 3 by model size beside the paper's rows, the stale / sync c_t ratio,
the trend of the on-policy c_t spread against log10 parameters, and fig_size.png."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import report_cell
from scipy import stats

from gacbench.bench.cell import cell_dir
from gacbench.bench.figures import Canvas, size_figure
from gacbench.bench.regime import PAPER_TABLE3, size_points, size_trend
from gacbench.bench.report import build_report, group_records, markdown, recovered_shares
from gacbench.jsonio import write_json

SIZES = {"tiny": 1e6, "small": 1e7, "medium": 1e8}
LRS = {"tiny": 3e-4, "small": 1e-3, "medium": 3e-4}
NOISE = (0.01, -0.02, 0.01)  # per seed, added to the sync q0.9(|c_t|): the fit is not exact


def _q90(params, seed):
    return 0.3 - 0.05 * math.log10(params / 1e6) + NOISE[seed]


def _cells(sizes=SIZES):
    cells, specs = [], []
    for task, params in sizes.items():
        specs.append({"task": task, "params": {"lr": LRS.get(task, 1e-3)}})
        for k in range(3):
            sync = report_cell(task, "sync", 0, k, 0.5)
            sync.update({"params": int(params), "cos_abs_q90": _q90(params, k), "cos_median": 0.04 + 0.01 * k,
                         "cos_max_abs": 0.5 + 0.1 * k, "cos_abs_le_005": 0.2 * k})
            stale = report_cell(task, "stale", 16, k, 0.3)
            stale.update({"params": int(params), "cos_median": 0.075 + 0.015 * k})  # 1.5x sync's, seed by seed
            cells += [sync, stale]
    return cells, specs


def test_size_points_by_hand():
    cells, specs = _cells()
    rows = size_points(cells, specs)
    assert [r["task"] for r in rows] == ["tiny", "small", "medium"]  # by parameter count
    tiny = rows[0]
    assert tiny["params"] == 1_000_000 and tiny["lr"] == 3e-4 and tiny["n"] == 3
    assert tiny["sync_cos_abs_q90"] == pytest.approx(np.mean([_q90(1e6, k) for k in range(3)]))
    assert tiny["sync_cos_median"] == pytest.approx(0.05) and tiny["sync_cos_max_abs"] == pytest.approx(0.6)
    assert tiny["sync_cos_abs_le_005"] == pytest.approx(0.2)
    (entry,) = tiny["stale"]
    assert entry["staleness"] == 16 and entry["stale_cos_median"] == pytest.approx(0.09)
    assert entry["cos_median_ratio"] == pytest.approx(0.09 / 0.05) and entry["n"] == 3
    # one model size: no size axis
    assert size_points(*_cells({"small": 1e7})) == []


def test_size_trend_is_the_least_squares_slope_over_the_seeds():
    cells, specs = _cells()
    trend = size_trend(cells, size_points(cells, specs))
    x = [math.log10(SIZES[t]) for t in SIZES for _ in range(3)]
    y = [_q90(SIZES[t], k) for t in SIZES for k in range(3)]
    slope, intercept = np.polyfit(x, y, 1)
    assert trend["slope_per_decade"] == pytest.approx(slope) and trend["intercept"] == pytest.approx(intercept)
    assert trend["slope_per_decade"] == pytest.approx(-0.05)  # the seeds' noise repeats at every size
    half = trend["slope_per_decade"] - trend["slope_ci_low"]
    assert half == pytest.approx(trend["slope_ci_high"] - trend["slope_per_decade"]) and half >= 0
    assert half == pytest.approx(stats.t.ppf(0.975, 7) * stats.linregress(x, y).stderr)
    assert trend["n_cells"] == 9 and trend["sizes"] == [1_000_000, 10_000_000, 100_000_000]
    at = {a["model"]: a for a in trend["at_paper"]}
    assert at["Qwen3-1.7B"]["fit"] == pytest.approx(intercept + slope * math.log10(1.7e9))
    assert at["Qwen3-1.7B"]["paper"] == 0.0471
    # two sizes: too few for a trend; a size with two learning rates: the slope would mix lr and size
    two, _ = _cells({"tiny": 1e6, "small": 1e7})
    assert size_trend(two, size_points(two, _)) is None
    cells2, specs2 = _cells({**SIZES, "small-lr3e-3": 1e7})
    assert len(size_points(cells2, specs2)) == 4 and size_trend(cells2, size_points(cells2, specs2)) is None


def test_size_section_and_figure(tmp_path, monkeypatch):
    cells, specs = _cells()
    points = size_points(cells, specs)
    trend = size_trend(cells, points)
    groups = group_records(cells)
    md = markdown(cells, groups, recovered_shares(groups, cells=cells), Path("x"), sizes=points, size_trend=trend)
    section = md[md.index("## On-policy alignment across model sizes"):]
    table = section[section.index("| model |"):].split("\n\n")[0].splitlines()
    assert table[0].endswith("| stale / sync median c_t, s=16 | seeds |")
    assert table[2].startswith("| tiny | 1.00M | 0.0003 | 0.05 |") and table[2].endswith("| 1.8 | 3 |")
    assert table[5] == "| Qwen3-1.7B (paper) | 1.7B | 1e-06 | — | 0.0471 | 0.0924 | 0.91 | — | — |"
    assert len(table) == 2 + 3 + len(PAPER_TABLE3)
    assert f"changes by {trend['slope_per_decade']:+.3f} per tenfold parameters" in section

    seen = {}
    save = Canvas.save

    def keep(self, fig, name, *args, **kwargs):
        seen[name] = [[(ln.get_label(), list(ln.get_xdata()), list(ln.get_ydata()), ln.get_marker(), ln.get_linestyle())
                       for ln in ax.get_lines()] for ax in fig.axes]
        seen[name + ":scale"] = [ax.get_xscale() for ax in fig.axes]
        save(self, fig, name, *args, **kwargs)
    monkeypatch.setattr(Canvas, "save", keep)
    size_figure(Canvas(tmp_path, cells, {}), points, trend)
    assert (tmp_path / "fig_size.png").is_file() and seen["fig_size.png:scale"] == ["log", "log"]
    left, right = seen["fig_size.png"]
    stars = [ln for ln in left if ln[3] == "*"]
    assert len(stars) == 1 and stars[0][1] == [r["params"] for r in PAPER_TABLE3]
    means = {ln[0].split(" ")[0]: ln[2][0] for ln in left if ln[3] == "o" and len(ln[1]) == 1 and ln[0][0] != "_"}
    assert means == pytest.approx({p["task"]: p["sync_cos_abs_q90"] for p in points})
    dashed = [ln for ln in left if ln[4] == "--"]  # the trend extended to the paper's largest model
    assert len(dashed) == 1 and dashed[0][1][-1] == pytest.approx(8.0e9)
    (ratio,) = [ln for ln in right if ln[0] == "s = 16"]
    assert ratio[1] == [1e6, 1e7, 1e8] and ratio[2] == pytest.approx([1.8] * 3)
    # one model size: no figure
    size_figure(Canvas(tmp_path / "one", [], {}), [], None)
    assert not (tmp_path / "one" / "fig_size.png").exists()


def _store(root, task, method, s, seed, params, cos):
    """A done GRPO-like cell written by hand, logging the reward, c_t, the response length and the model size."""
    cell = {"task": task, "objective": "grpo", "params": {"lr": 1e-3, "model": {"size": task}}, "steps": 10,
            "warmup": 0, "method": method, "staleness": s, "seed": seed}
    d = cell_dir(root, cell)
    d.mkdir(parents=True)
    write_json(d / "config.json", cell)
    rows = "".join(f"{t},0.{t},0.{t},{cos[t % len(cos)]},4.0,{params}\n" for t in range(10))
    (d / "metrics.csv").write_text("step,eval/acc,reward/mean,align/cos,response/tokens_mean,model/params\n" + rows)
    write_json(d / "status.json", {"status": "done", "initial": 0.0, "final": 0.9, "diverged": False, "metric": "acc",
                                   "higher_is_better": True, "steps_run": 10, "cell": cell})


def test_stored_grid_of_three_sizes_gets_the_size_table(tmp_path):
    for task, params, spread in (("a", 800_000, 0.3), ("b", 4_700_000, 0.2), ("c", 17_000_000, 0.1)):
        for k in range(2):
            _store(tmp_path, task, "sync", 0, k, params, [spread, -spread, 0.01 * k])
            _store(tmp_path, task, "stale", 16, k, params, [spread, spread, 0.0])
    build_report(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["params"] for r in summary["size"]] == [800_000, 4_700_000, 17_000_000]
    assert summary["size_trend"]["slope_per_decade"] < 0 and summary["size_trend"]["n_cells"] == 6
    assert (tmp_path / "fig_size.png").is_file()
    assert "## On-policy alignment across model sizes" in (tmp_path / "summary.md").read_text()


# -- the table "toward the paper's regime" (paper/toward.py) ---------------------------------------------
REWARDS = {("sync", 0): (0.30, 0.32, 0.34), ("stale", 16): (0.20, 0.25, 0.24), ("gac", 16): (0.25, 0.27, 0.26),
           ("gspo", 16): (0.31, 0.30, 0.33)}


def _toward_summary():
    """A grid's summary.json as the report writes it, from three seeds of sync, stale, gac and gspo."""
    cells = []
    for (method, s), rewards in REWARDS.items():
        for k, r in enumerate(rewards):
            c = report_cell("small", method, s, k, 0.5, reward=r)
            c.update({"cos_median": 0.04 if method == "sync" else 0.06, "cos_abs_q90": 0.2 + 0.01 * k,
                      "response_tokens": 25.0 + k, "params": 4_700_000, "ratio_max": 10.0 * (k + 1)})
            cells.append(c)
    groups = group_records(cells)
    return {"cells": cells, "groups": groups,
            "recovered_reward": recovered_shares(groups, key="reward_last", cells=cells)}


def test_toward_row_by_hand():
    from gacbench.bench.regime import toward_row

    row = toward_row(_toward_summary(), "small", 16, "small, long", "x/summary.json")
    d = np.subtract(REWARDS[("sync", 0)], REWARDS[("stale", 16)])  # 0.10, 0.07, 0.10
    half = stats.t.ppf(0.975, 2) * d.std(ddof=1) / math.sqrt(3)
    assert row["gap"] == pytest.approx(0.09) and row["gap_seeds"] == 3
    assert (row["gap_ci_low"], row["gap_ci_high"]) == pytest.approx((0.09 - half, 0.09 + half))
    assert row["gap_p"] == pytest.approx(stats.ttest_rel(REWARDS[("sync", 0)], REWARDS[("stale", 16)]).pvalue)
    assert row["params"] == 4_700_000 and row["response_tokens"] == pytest.approx(26.0)
    assert row["sync_cos_abs_q90"] == pytest.approx(0.21) and row["cos_median_ratio"] == pytest.approx(1.5)
    assert row["ratio_max"] == pytest.approx(20.0) and (row["n_sync"], row["n_stale"]) == (3, 3)
    stale, sync = np.mean(REWARDS[("stale", 16)]), np.mean(REWARDS[("sync", 0)])
    assert row["gac"]["share"] == pytest.approx((np.mean(REWARDS[("gac", 16)]) - stale) / (sync - stale))
    assert row["gspo"]["share"] == pytest.approx((np.mean(REWARDS[("gspo", 16)]) - stale) / (sync - stale))
    assert row["gac"]["share_ci_low"] <= row["gac"]["share"] <= row["gac"]["share_ci_high"]
    assert row["gac-calibrated"] is None and row["gac-step"] is None  # not in this grid
    with pytest.raises(ValueError, match=r"x/summary.json: no group stale at s = 32 on task 'small' .*stale s=16"):
        toward_row(_toward_summary(), "small", 32, "small", "x/summary.json")


def test_toward_script_writes_the_table_beside_the_papers_rows(tmp_path):
    import subprocess
    import sys

    from gacbench.jsonio import json_safe

    write_json(tmp_path / "summary.json", json_safe(_toward_summary()))
    script = Path(__file__).resolve().parents[1] / "paper" / "toward.py"
    out = tmp_path / "toward"
    done = subprocess.run([sys.executable, str(script), "--point", f"small, long={tmp_path / 'summary.json'}:small:16",
                           "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "toward.md").read_text().splitlines()
    assert lines[0].count("share |") == 2 and "gac share" in lines[0] and "gspo share" in lines[0]  # present methods
    assert lines[2].startswith("| small, long | 4.70M | 26 | 16 | 0.21 | 1.5 | +0.090 [")
    assert lines[2].endswith("| 20 | 3, 3 |") and "(n = " not in lines[2]
    assert lines[3] == "| Qwen3-1.7B (paper, Table 3) | 1.7B | — | — | 0.0471 | — | — | — | — | — | — |"
    assert json.loads((tmp_path / "toward.json").read_text())["points"][0]["gap"] == pytest.approx(0.09)
    bad = subprocess.run([sys.executable, str(script), "--point", f"x={tmp_path / 'none.json'}:small:16"],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "none.json does not exist; publish that grid first" in bad.stderr


def test_toward_table_names_the_seeds_of_a_share_that_pairs_fewer_than_the_gap():
    from gacbench.bench.regime import toward_row
    from gacbench.bench.tables import toward_markdown

    summary = _toward_summary()
    extra = [report_cell("small", m, s, 3, 0.5, reward=r) for m, s, r in (("sync", 0, 0.33), ("stale", 16, 0.22))]
    cells = summary["cells"] + extra
    groups = group_records(cells)
    summary = {"cells": cells, "groups": groups,
               "recovered_reward": recovered_shares(groups, key="reward_last", cells=cells)}
    row = toward_row(summary, "small", 16, "small, long", "x/summary.json")
    assert row["gap_seeds"] == 4 and row["gac"]["n"] == 3
    # the share over the three seeds gac ran: the same as without seed 3
    assert row["gac"]["share"] == pytest.approx(toward_row(_toward_summary(), "small", 16, "s", "x")["gac"]["share"])
    line = toward_markdown([row])[2]
    assert line.count("(n = 3)") == 2  # gac and gspo
