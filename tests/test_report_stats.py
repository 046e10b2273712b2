"""Multiple-comparison correction of the tests against stale, the forest plot of recovered shares, the method
groups of the curve figures, the robustness figure's measure and the staleness x learning-rate law."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import report_cell
from scipy import stats

from gacbench.bench import figures as figs
from gacbench.bench.cell import cell_dir
from gacbench.bench.figures import Canvas, law_figure, method_panels
from gacbench.bench.regime import law_points
from gacbench.bench.report import build_report, group_records, holm_adjust, markdown, recovered_shares
from gacbench.bench.stats import detectable_multiplier
from gacbench.jsonio import write_json


def test_holm_adjusted_p_values_by_hand():
    # m = 4 finite p-values; sorted 0.005, 0.01, 0.03, 0.04 -> 4 * 0.005 = 0.02, 3 * 0.01 = 0.03, 2 * 0.03 = 0.06,
    # 1 * 0.04 = 0.04, which the running maximum raises to 0.06; None and NaN are no test and do not count in m
    assert holm_adjust([0.01, 0.04, 0.03, 0.005, None, math.nan]) == pytest.approx([0.03, 0.06, 0.06, 0.02, None,
                                                                                    None])
    assert holm_adjust([0.5, 0.6]) == [1.0, 1.0]  # 2 * 0.5 capped at 1, and 0.6 raised to it
    assert holm_adjust([0.2]) == [0.2] and holm_adjust([]) == []


# three methods against stale at s = 8 on three seeds (higher is better): the paired differences method - stale
DIFFS = {"a": [0.30, 0.33, 0.36], "b": [0.6, 1.0, 1.4], "c": [-0.1, 0.0, 0.2]}
STALE, SYNC = [0.0, 0.1, 0.05], [1.0, 1.05, 0.95]


def _family_cells(methods=tuple(DIFFS)):
    return ([report_cell("t", "sync", 0, k, SYNC[k]) for k in range(3)]
            + [report_cell("t", "stale", 8, k, STALE[k]) for k in range(3)]
            + [report_cell("t", m, 8, k, STALE[k] + DIFFS[m][k]) for m in methods for k in range(3)])


def test_the_gap_of_methods_run_on_unequal_seeds_is_read_on_their_common_seeds_with_sample_deviations():
    """sync {1, 3, 5} and stale {2, 4, 6} on seeds 0-2, the method on seeds 0-3: the three means over the common
    seeds 0-2 and the gap's standard error sqrt((4 + 4) / 3) from the sample (ddof = 1) variances."""
    from gacbench.bench.stats import _unequal_seed_means

    seeds = {("t", "sync", 0): {0: 1.0, 1: 3.0, 2: 5.0}, ("t", "stale", 2): {0: 2.0, 1: 4.0, 2: 6.0},
             ("t", "m", 2): {0: 1.5, 1: 3.5, 2: 5.5, 3: 9.0}}
    n, sync, stale, method, se = _unequal_seed_means(seeds, "t", "m", 2)
    assert (n, sync, stale, method) == (3, 3.0, 4.0, 3.5)
    assert se == pytest.approx(math.sqrt(8 / 3))
    seeds[("t", "m", 2)].pop(3)
    assert _unequal_seed_means(seeds, "t", "m", 2) is None  # the same seeds: the paired path


def test_the_table_marks_only_the_entries_significant_after_adjustment():
    cells = _family_cells()
    groups = group_records(cells)
    rows = {r["method"]: r for r in recovered_shares(groups, cells=cells)}
    raw = {m: stats.ttest_rel(np.array(STALE) + DIFFS[m], STALE).pvalue for m in DIFFS}
    assert raw["a"] < raw["b"] < 0.05 < raw["c"]  # b is significant before the adjustment only
    assert {m: r["vs_stale_p"] for m, r in rows.items()} == pytest.approx(raw)
    adj_a, adj_b = 3 * raw["a"], max(3 * raw["a"], 2 * raw["b"])
    assert rows["a"]["vs_stale_p_adj"] == pytest.approx(adj_a) and adj_a < 0.05
    assert rows["b"]["vs_stale_p_adj"] == pytest.approx(adj_b) and adj_b > 0.05
    assert rows["c"]["vs_stale_p_adj"] == pytest.approx(max(adj_b, raw["c"]))
    md = markdown(cells, groups, list(rows.values()), Path("x"))
    table = md[md.index("### t: recovered share across s, final metric"):].split("\n\n")[1].splitlines()
    marked = {line.split(" | ")[0][2:] for line in table[2:] if line.endswith(" * |")}
    assert marked == {"a"}
    # the detail table shows the adjusted p beside the raw one
    detail = md[md.index("| task | s | method | share | share 95% CI"):].splitlines()
    assert detail[0].endswith("| p | p adj. | sign-flip p | min. det. | seeds |")
    line_b = next(x for x in detail if x.startswith("| t | 8 | b |"))
    # b's differences 0.6, 1.0, 1.4 are all > 0: the sign-flip p is 2 / 2^3; the min. detectable share is
    # (t_{0.975,2} + t_{0.8,2}) sd / sqrt(3) / |gap| with sd 0.4 and gap 0.05 - 1.0
    mds = detectable_multiplier(3) * 0.4 / 0.95
    assert line_b.endswith(f"| {raw['b']:.2g} | {adj_b:.2g} | 0.25 | {mds:.2g} | 3 |")


def test_each_table_is_its_own_family():
    cells = _family_cells(("a",))  # a alone: a family of one test, nothing to adjust
    (row,) = recovered_shares(group_records(cells), cells=cells)
    assert row["vs_stale_p_adj"] == pytest.approx(row["vs_stale_p"])
    assert "vs_stale_p_adj" not in recovered_shares(group_records(cells))[0]  # no tests without the cells


def _store(root, method, s, seed, rewards, *, task="bandit", lr=0.1, cos=0.1):
    """A done bandit-like cell written by hand: config.json, status.json and a metrics.csv logging the training
    reward ``rewards`` per step, an eval every step and c_t."""
    cell = {"task": task, "objective": "bandit", "params": {"lr": lr}, "steps": len(rewards), "warmup": 0,
            "method": method, "staleness": s, "seed": seed}
    d = cell_dir(root, cell)
    d.mkdir(parents=True)
    write_json(d / "config.json", cell)
    rows = "".join(f"{t},{r},{r},{cos}\n" for t, r in enumerate(rewards))
    (d / "metrics.csv").write_text("step,eval/reward,reward/mean,align/cos\n" + rows)
    write_json(d / "status.json", {"status": "done", "initial": rewards[0], "final": rewards[-1], "diverged": False,
                                   "metric": "reward", "higher_is_better": True, "steps_run": len(rewards),
                                   "cell": cell})


def _grid(root, methods):
    """sync rising to 1, stale to 0.5 at s = 4; each method m to ``methods[m]`` (+ 0.01 seed), three seeds."""
    ramp = np.linspace(0.0, 1.0, 20)
    for k in range(3):
        _store(root, "sync", 0, k, list(ramp + 0.01 * k))
        _store(root, "stale", 4, k, list(0.5 * ramp + 0.02 * k))
        for m, top in methods.items():
            _store(root, m, 4, k, list(top * ramp + 0.02 * k + 0.001 * k * k))


def _capture(monkeypatch):
    """The figures written, by file name, before they are saved and closed."""
    seen = {}
    save = Canvas.save

    def keep(self, fig, name, *args, **kwargs):
        seen[name] = {"axes": fig.axes, "titles": [ax.get_title() for ax in fig.axes]}
        seen[name]["lines"] = [[(ln.get_label(), ln.get_xdata(), ln.get_ydata(), ln.get_markerfacecolor())
                                for ln in ax.get_lines()] for ax in fig.axes]
        seen[name]["dots"] = [[(float(ln.get_xdata()[0]), float(ln.get_ydata()[0]), ln.get_markerfacecolor())
                               for ln in ax.get_lines() if ln.get_marker() == "o"] for ax in fig.axes]
        save(self, fig, name, *args, **kwargs)
    monkeypatch.setattr(Canvas, "save", keep)
    return seen


def test_stored_grid_gets_adjusted_p_values_and_a_forest_plot(tmp_path, monkeypatch):
    seen = _capture(monkeypatch)
    _grid(tmp_path, {"gac": 0.52, "tis": 0.9, "m2po": 0.5})
    build_report(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = summary["recovered_reward"]
    assert rows and all("vs_stale_p_adj" in r for r in rows + summary["recovered"])
    assert (tmp_path / "fig_shares.png").is_file()
    # one panel, the rows sorted by share from the bottom; a filled marker exactly where the adjusted p < 0.05
    (dots,) = seen["fig_shares.png"]["dots"]
    labels = [t.get_text() for t in seen["fig_shares.png"]["axes"][0].get_yticklabels()]
    by_method = {r["method"]: r for r in rows}
    assert labels == [f"{m}, s=4" for m in sorted(by_method, key=lambda m: by_method[m]["share"])]
    markers = {int(y): face for _, y, face in dots}
    assert sorted(markers) == list(range(len(labels)))
    for y, label in enumerate(labels):
        row = by_method[label.split(",")[0]]
        significant = row["vs_stale_p_adj"] is not None and row["vs_stale_p_adj"] < 0.05
        assert (not (isinstance(markers[y], str) and markers[y] == "white")) == significant, label
    assert any(r["vs_stale_p_adj"] < 0.05 for r in rows) and any(r["vs_stale_p_adj"] >= 0.05 for r in rows)
    md = (tmp_path / "summary.md").read_text()
    assert "Holm" in md


def test_no_forest_plot_without_intervals(tmp_path):
    for method, s, top in (("sync", 0, 1.0), ("stale", 4, 0.5), ("gac", 4, 0.7)):
        _store(tmp_path, method, s, 0, list(top * np.linspace(0.0, 1.0, 20)))
    rep = build_report(tmp_path)
    assert math.isnan(rep["summary"]["recovered_reward"][0]["share_ci_low"])  # one seed: no interval
    assert not (tmp_path / "fig_shares.png").exists()


def test_method_panels_split_many_methods_into_groups():
    few = ["gac", "stale", "sync", "tis"]
    assert method_panels(few, set()) == [("", ["gac", "tis"])]
    many = ["dual-clip", "gac", "gac-ema", "m2po", "stale", "sync", "tis", "tis-seq", "x1", "x2", "x3", "x4"]
    rows = method_panels(many, {"tis", "m2po", "gac"})
    assert rows == [("GAC readings", ["gac", "gac-ema"]), ("corrections that recover", ["m2po", "tis"]),
                    ("other methods (1/2)", ["dual-clip", "tis-seq", "x1", "x2", "x3"]),
                    ("other methods (2/2)", ["x4"])]
    assert figs.PANEL_METHODS == 5


def test_curve_figures_of_many_methods_have_one_row_per_group_each_with_sync_and_stale(tmp_path, monkeypatch):
    seen = _capture(monkeypatch)
    methods = {"gac": 0.52, "gac-ema": 0.5, "tis": 0.9, "m2po": 0.51, "x1": 0.5, "x2": 0.5}
    _grid(tmp_path, methods)
    rep = build_report(tmp_path)
    recover = {r["method"] for r in rep["summary"]["recovered_reward"]
               if r["share"] > 0 and r["vs_stale_p_adj"] is not None and r["vs_stale_p_adj"] < 0.05}
    assert "tis" in recover and "x1" not in recover
    expect = method_panels(list(methods), recover)
    assert len(expect) > 1
    for name in ("fig_reward_bandit.png", "fig_curves_bandit.png", "fig_cos_methods_bandit.png"):
        got = seen[name]
        assert len(got["lines"]) == len(expect)  # one staleness: one panel per group
        for (title, members), lines, panel_title in zip(expect, got["lines"], got["titles"]):
            labels = {label for label, *_ in lines}
            assert panel_title.endswith(f"s=4: {title}")
            assert {"stale", *members} <= labels and labels & {"sync", "sync (s=0)"}
            assert not labels & (set(methods) - set(members))
        assert got["axes"][0].get_legend() is not None  # beside the panel: anchored right of the axes
        assert got["axes"][0].get_legend().get_bbox_to_anchor().x0 > got["axes"][0].get_window_extent().x1


def test_robustness_figure_reads_the_training_reward_of_rollout_objectives(tmp_path, monkeypatch):
    seen = _capture(monkeypatch)
    _grid(tmp_path, {"gac": 0.6})
    rep = build_report(tmp_path)
    groups = {g["method"]: g for g in rep["summary"]["groups"]}
    (ax,) = seen["fig_robustness.png"]["axes"]
    assert ax.get_ylabel().startswith("training reward")
    lines = {label: (x, y) for label, x, y, _ in seen["fig_robustness.png"]["lines"][0]}
    assert lines["sync"][1][0] == pytest.approx(groups["sync"]["reward_last_mean"])
    # the eval metric here ends at the last step's reward, which differs from the last-20% mean
    assert groups["stale"]["final_mean"] != pytest.approx(groups["stale"]["reward_last_mean"])
    errorbars = [c for c in ax.containers]
    ys = sorted(float(c.lines[0].get_ydata()[0]) for c in errorbars)
    assert ys == pytest.approx(sorted(groups[m]["reward_last_mean"] for m in ("gac", "stale")))


def _point(model, lr, s, gap, healthy=True, measure="reward_last"):
    return {"model": model, "lr": lr, "staleness": s, "gap": gap, "gap_ci_low": gap - 0.01, "gap_ci_high": gap + 0.01,
            "n": 2, "sync_healthy": healthy, "measure": measure, "sync": 0.5, "stale": 0.5 + gap,
            "sync_cos_median": 0.0, "stale_cos_median": 0.1, "sync_cos_abs_q90": 0.2, "stale_cos_abs_q90": 0.3,
            "stale_degraded_frac": 0.0, "stale_reward_drop": 0.0}


def test_law_points_by_hand():
    # s * lr: 0.2, 0.4, 0.6, 1.2 for (lr, s) = (0.1, 2), (0.1, 4), (0.3, 2), (0.3, 4)
    grid = [(0.1, 2), (0.1, 4), (0.3, 2), (0.3, 4)]
    mono = [_point("tiny", lr, s, g) for (lr, s), g in zip(grid, (-0.01, -0.02, -0.05, -0.2))]
    # y ranks 2, 1, 4, 3 against x ranks 1, 2, 3, 4: rho = 1 - 6 * 4 / (4 * 15) = 0.6; sync unhealthy at lr 0.3
    mixed = [_point("small", lr, s, g, healthy=lr < 0.2) for (lr, s), g in zip(grid, (-0.02, -0.03, 0.01, -0.01))]
    law = {e["model"]: e for e in law_points(mixed[::-1] + mono)}
    assert [p["s_lr"] for p in law["tiny"]["points"]] == pytest.approx([0.2, 0.4, 0.6, 1.2])
    assert law["tiny"]["spearman_rho"] == pytest.approx(-1.0) and law["tiny"]["sync_unhealthy_lrs"] == []
    assert law["tiny"]["spearman_rho_healthy"] == pytest.approx(-1.0) and law["tiny"]["healthy_lr_max"] == 0.3
    assert law["small"]["spearman_rho"] == pytest.approx(0.6) and law["small"]["sync_unhealthy_lrs"] == [0.3]
    assert math.isnan(law["small"]["spearman_rho_healthy"])  # two healthy points
    assert law["small"]["measure"] == "reward_last" and law["small"]["healthy_lr_max"] == 0.1
    # one curve below the healthy-sync limit, broken beyond it: s * lr 0.2, 0.4, 0.8 healthy (gaps falling), 0.6
    # and 1.2 not (lr 0.3); over all five, x ranks 1..5 meet y ranks 3, 2, 5, 1, 4: rho = 1 - 6 * 18 / 120 = 0.1
    cut = [_point("mid", lr, s, g, healthy=lr < 0.25) for (lr, s), g in
           zip([(0.1, 2), (0.1, 4), (0.3, 2), (0.2, 4), (0.3, 4)], (-0.01, -0.02, 0.05, -0.04, 0.0))]
    (mid,) = law_points(cut)
    assert mid["spearman_rho_healthy"] == pytest.approx(-1.0) and mid["spearman_rho"] == pytest.approx(0.1)
    assert mid["healthy_lr_max"] == 0.2 and mid["sync_unhealthy_lrs"] == [0.3]
    # one s * lr value over the map: no law
    assert law_points([_point("tiny", 0.1, 4, -0.1), _point("tiny", 0.2, 2, -0.2)]) == []
    # two points: a law to plot, too few for a rank correlation
    two = law_points([_point("tiny", 0.1, 2, -0.1), _point("tiny", 0.2, 2, -0.2)])
    assert len(two) == 1 and math.isnan(two[0]["spearman_rho"])


def test_law_section_and_figure(tmp_path, monkeypatch):
    grid = [(0.1, 2), (0.1, 4), (0.3, 2), (0.3, 4)]
    points = [_point("small", lr, s, g, healthy=lr < 0.2) for (lr, s), g in zip(grid, (-0.02, -0.03, 0.01, -0.01))]
    cells = [report_cell("t", "sync", 0, 0, 1.0), report_cell("t", "stale", 2, 0, 0.5)]
    groups = group_records(cells)
    md = markdown(cells, groups, recovered_shares(groups, cells=cells), Path("x"), regime=points)
    section = md[md.index("### Staleness × learning rate"):]
    assert ("**small**: Spearman ρ(gap, s · lr) where sync is healthy = — (2 points: needs three with a gap, at two "
            "s · lr or more); over every point = +0.60 (p = ") in section
    assert "sync unhealthy at lr = 0.3 (healthy up to lr = 0.1)" in section
    table = section[section.index("| s · lr |"):].split("\n\n")[0].splitlines()[2:]
    assert table == ["| 0.2 | 0.1 | 2 | -0.02 | [-0.03, -0.01] | yes | 2 |",
                     "| 0.4 | 0.1 | 4 | -0.03 | [-0.04, -0.02] | yes | 2 |",
                     "| 0.6 | 0.3 | 2 | 0.01 | [0, 0.02] | no | 2 |",
                     "| 1.2 | 0.3 | 4 | -0.01 | [-0.02, 0] | no | 2 |"]
    seen = _capture(monkeypatch)
    cv = Canvas(tmp_path, [], {})
    law_figure(cv, law_points(points))
    assert (tmp_path / "fig_law.png").is_file()
    (ax,) = seen["fig_law.png"]["axes"]
    assert ax.get_xscale() == "log"
    (dots,) = seen["fig_law.png"]["dots"]
    assert sorted(x for x, _, _ in dots) == pytest.approx([0.2, 0.4, 0.6, 1.2])
    open_x = sorted(x for x, _, face in dots if isinstance(face, str) and face == "white")
    assert open_x == pytest.approx([0.6, 1.2])  # the points whose sync run at lr 0.3 is not healthy


def test_forest_plot_cuts_an_unbounded_interval_at_the_axis_edge(tmp_path, monkeypatch):
    seen = _capture(monkeypatch)
    row = {"task": "t", "method": "gac", "staleness": 8, "share": 0.5, "no_gap": False, "share_ci_low": -math.inf,
           "share_ci_high": 40.0, "vs_stale_p_adj": 0.01}
    nan_row = {**row, "method": "tis", "share_ci_low": math.nan, "share_ci_high": math.nan, "vs_stale_p_adj": None}
    figs.shares_figure(Canvas(tmp_path, [], {}), [{**row, "measure": "final"}, {**nan_row, "measure": "final"}])
    (ax,) = seen["fig_shares.png"]["axes"]
    low, high = ax.get_xlim()
    # the finite ends set the range (at least [-0.1, 1.1]; 40 is cut to SHARE_AXIS's 2.5), the infinite end does not
    assert -0.5 < low < -0.1 and figs.SHARE_AXIS[1] < high < figs.SHARE_AXIS[1] + 0.5
    cut = [ln for ln in ax.get_lines() if ln.get_marker() in ("<", ">")]
    assert sorted(ln.get_marker() for ln in cut) == ["<", ">"]
    assert all(low <= ln.get_xdata()[0] <= high for ln in cut)
    assert len([ln for ln in ax.get_lines() if ln.get_marker() == "o"]) == 2  # tis: a share without an interval


def test_forest_plot_leaves_out_shares_whose_gap_is_within_noise_and_says_so(tmp_path, monkeypatch):
    seen = _capture(monkeypatch)
    row = {"task": "t", "method": "gac", "staleness": 16, "share": 0.5, "no_gap": False, "share_ci_low": 0.1,
           "share_ci_high": 0.9, "vs_stale_p_adj": 0.2, "gap_within_noise": False, "measure": "reward_last"}
    noisy = [{**row, "staleness": 8, "share": -4.0, "share_ci_low": -20.0, "share_ci_high": 20.0,
              "gap_within_noise": True}, {**row, "method": "tis", "staleness": 8, "gap_within_noise": True}]
    figs.shares_figure(Canvas(tmp_path, [], {}), [row, *noisy])
    (ax,) = seen["fig_shares.png"]["axes"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["gac, s=16"]
    assert "left out: 2 shares" in ax.get_xlabel() and "t s = 8" in ax.get_xlabel()
    assert ax.get_xlim()[0] > -1.0  # the noisy shares' wide intervals no longer set the range


def test_an_exclusive_share_set_is_drawn_as_its_two_rays_and_the_title_names_the_measure(tmp_path, monkeypatch):
    """A Fieller set that excludes the band (0.5, 4.5) (every share but those) is drawn as the ray up to 0.5 and a
    cut arrow for the ray from 4.5, beyond the axis; no line crosses sync's 1. The title names the measure."""
    seen = _capture(monkeypatch)
    row = {"task": "t", "method": "gac", "staleness": 16, "share": 0.2, "no_gap": False, "share_ci_low": -math.inf,
           "share_ci_high": math.inf, "share_ci_kind": "exclusive", "share_ci_excluded": [0.5, 4.5],
           "vs_stale_p_adj": 0.9, "gap_within_noise": False, "measure": "by_version", "source": "eval/policy_reward"}
    figs.shares_figure(Canvas(tmp_path, [], {}), [row])
    (ax,) = seen["fig_shares.png"]["axes"]
    low, high = ax.get_xlim()
    segments = [ln.get_xdata() for ln in ax.get_lines() if ln.get_marker() in ("None", "") and len(ln.get_xdata()) == 2
                and ln.get_linestyle() == "-"]
    assert len(segments) == 1 and segments[0][1] == pytest.approx(0.5) and segments[0][0] < 0
    arrows = sorted(ln.get_marker() for ln in ax.get_lines() if ln.get_marker() in ("<", ">"))
    assert arrows == ["<", ">"]
    assert "held-out reward of the policy θ_v" in ax.get_title()
    figs.shares_figure(Canvas(tmp_path, [], {}), [{**row, "source": "reward/mean"}])
    assert "training reward by the version that sampled it" in seen["fig_shares.png"]["axes"][0].get_title()


def test_models_at_the_same_s_lr_are_set_apart_and_coloured_as_in_the_size_figure(tmp_path, monkeypatch):
    seen = _capture(monkeypatch)
    cv = Canvas(tmp_path, [], {})
    law_figure(cv, law_points([_point(m, 0.1, s, -0.02 * s) for m in ("tiny", "medium") for s in (2, 4)]))
    (dots,) = seen["fig_law.png"]["dots"]
    at = sorted(x for x, _, _ in dots)
    assert len(set(at)) == 4 and at[1] / at[0] == pytest.approx(10 ** 0.03)  # medium left of tiny at each s * lr
    import matplotlib.pyplot as plt

    colors = cv.model_color(["small", "tiny"])  # as fig_size asks for its models after fig_law
    assert list(colors) == ["medium", "tiny", "small"]  # the first figure's names keep their colours
    assert [colors[m] for m in ("medium", "tiny", "small")] == list(plt.cm.tab10.colors[:3])
    medium = [ln for ln in seen["fig_law.png"]["axes"][0].get_lines() if ln.get_label().startswith("medium")]
    assert medium and medium[0].get_color() == colors["medium"]


def test_the_regime_map_shares_one_colour_scale_per_column_across_models(tmp_path, monkeypatch):
    seen = _capture(monkeypatch)
    figs.regime_figure(Canvas(tmp_path, [], {}), [_point("tiny", 0.1, 8, -0.08), _point("small", 0.1, 8, -0.004)])
    maps = [ax for ax in seen["fig_regime.png"]["axes"] if ax.images]  # rows small, tiny; columns gap, c_t
    assert [ax.get_title().split(":")[0] for ax in maps] == ["small", "small", "tiny", "tiny"]
    gap, cos = [maps[i].images[0].get_clim() for i in (0, 2)], [maps[i].images[0].get_clim() for i in (1, 3)]
    assert gap == [pytest.approx((-0.08, 0.08))] * 2  # small's -0.004 on tiny's scale, not at its own end
    assert cos == [pytest.approx((-0.1, 0.1))] * 2


def test_moving_means_are_drawn_at_the_last_step_of_their_window():
    """The value drawn at step t is the mean of the 10 steps up to t: a jump at step 10 first shows at step 10."""
    curve = [(t, 0.0) for t in range(10)] + [(t, 10.0) for t in range(10, 15)]
    steps, mean, sd = figs._smooth_mean([curve, [(t, v + 1.0) for t, v in curve]])
    assert steps == list(range(9, 15))
    assert mean.tolist() == pytest.approx([0.5, 1.5, 2.5, 3.5, 4.5, 5.5]) and sd.tolist() == pytest.approx([0.5] * 6)


def _threshold_grid(calibrated: tuple[float, float]):
    """Ablation groups at (c_low, c_high) in {0.02, 0.05} x {0.3, 0.5}, s = 4, and the cells of gac-calibrated
    (thresholds ``calibrated`` on both seeds) and gac-step-calibrated (0.7, 0.95: step-cosine thresholds)."""
    groups = [{"task": "t", "method": f"gac(c_low={lo},c_high={hi})", "staleness": 4, "ablation": True,
               "reward_last_mean": 0.2 + lo + hi, "higher_is_better": True, "metric": "acc"}
              for lo in (0.02, 0.05) for hi in (0.3, 0.5)]
    groups += [{"task": "t", "method": m, "staleness": s, "ablation": False, "reward_last_mean": v}
               for m, s, v in (("sync", 0, 0.6), ("stale", 4, 0.2))]
    cells = [{"task": "t", "method": m, "staleness": 4, "seed": k, "status": "done", "ablation": False,
              "c_low": lo, "c_high": hi}
             for k in range(2)
             for m, (lo, hi) in (("gac-calibrated", calibrated), ("gac-step-calibrated", (0.7, 0.95)))]
    return groups, cells


def test_the_threshold_map_marks_gac_calibrated_thresholds_alone_and_names_them_off_the_grid(tmp_path, monkeypatch):
    seen = _capture(monkeypatch)
    groups, cells = _threshold_grid((0.035, 0.4))
    figs.thresholds_figure(Canvas(tmp_path, cells, {}), groups, [])
    (ax, _) = seen["fig_thresholds.png"]["axes"]  # the map and its colour bar
    (mark,) = [ln for ln in ax.get_lines() if ln.get_marker() == "x"]
    # halfway between the grid's rows (0.02, 0.05) and columns (0.3, 0.5): gac-step-calibrated's (0.7, 0.95) is
    # not averaged in
    assert (float(mark.get_xdata()[0]), float(mark.get_ydata()[0])) == pytest.approx((0.5, 0.5))
    assert "(0.035, 0.4), mean over 2 seeds" in mark.get_label()
    groups, cells = _threshold_grid((0.2, 0.45))  # c_low above the grid's 0.05: named, not drawn at its edge
    figs.thresholds_figure(Canvas(tmp_path, cells, {}), groups, [])
    (ax, _) = seen["fig_thresholds.png"]["axes"]
    (mark,) = [ln for ln in ax.get_lines() if ln.get_marker() == "x"]
    assert len(mark.get_xdata()) == 0 and mark.get_label().endswith("outside the grid")


def test_the_c_t_figure_names_its_seed_and_fits_its_axis(tmp_path, monkeypatch):
    seen = _capture(monkeypatch)
    cells = [{"task": "t", "method": m, "staleness": s, "seed": k, "status": "done", "ablation": False}
             for m, s in (("sync", 0), ("stale", 8)) for k in (1, 2)]
    cv = Canvas(tmp_path, cells, {})
    cv.series = lambda rec, key: [(t, 0.1 * rec["seed"] + (0.2 if rec["method"] == "stale" else 0.0))
                                  for t in range(20)]
    figs.cos_figure(cv)
    ax = seen["fig_cos.png"]["axes"][0]
    assert ax.get_title() == "t: c_t (10-step mean), seed 1"
    assert {ln.get_label() for ln in ax.get_lines() if ln.get_label()[0] != "_"} == {"sync (s=0)", "stale (s=8)"}
    low, high = ax.get_ylim()
    assert -0.1 < low <= 0.0 and 0.3 <= high < 0.4  # fitted to 0 and the curves' 0.1 and 0.3, not [-1.05, 1.05]


def test_the_c_t_figure_of_a_crowded_task_draws_sync_stale_and_gac_and_names_the_full_figure(tmp_path, monkeypatch):
    seen = _capture(monkeypatch)
    many = ("stale", "gac", "m2po", "bapo", "tis", "gspo")  # with sync: 7 methods
    cells = [{"task": t, "method": m, "staleness": 0 if m == "sync" else 16, "seed": 0, "status": "done",
              "ablation": False} for t, ms in (("crowded", ("sync", *many)), ("few", ("sync", "stale", "m2po", "tis")))
             for m in ms]
    cv = Canvas(tmp_path, cells, {})
    cv.series = lambda rec, key: [(t, 0.1) for t in range(20)]
    figs.cos_figure(cv)
    crowded, few = seen["fig_cos.png"]["axes"][:2]
    labels = [{ln.get_label() for ln in ax.get_lines() if ln.get_label()[0] != "_"} for ax in (crowded, few)]
    assert labels[0] == {"sync (s=0)", "stale (s=16)", "gac (s=16)"}
    assert crowded.get_title() == "crowded: c_t (10-step mean), seed 0\nevery method: fig_cos_methods_crowded.png"
    assert labels[1] == {"sync (s=0)", "stale (s=16)", "m2po (s=16)", "tis (s=16)"}  # 4 methods: all drawn
    assert few.get_title() == "few: c_t (10-step mean), seed 0"
    # the edge: five methods are all drawn, six are not; a crowded task without stale or gac draws every method
    edge = (("five", ("sync", *many[:4])), ("six", ("sync", *many[:5])),
            ("plugins", ("sync", "m2po", "bapo", "tis", "gspo", "cispo", "vcpo")))
    cells = [{"task": t, "method": m, "staleness": 0 if m == "sync" else 16, "seed": 0, "status": "done",
              "ablation": False} for t, ms in edge for m in ms]
    cv = Canvas(tmp_path, cells, {})
    cv.series = lambda rec, key: [(t, 0.1) for t in range(20)]
    figs.cos_figure(cv)
    drawn = {ax.get_title().split(":")[0]: len([ln for ln in ax.get_lines() if ln.get_label()[0] != "_"])
             for ax in seen["fig_cos.png"]["axes"][:3]}
    assert drawn == {"five": 5, "six": 3, "plugins": 7}


def test_a_method_on_fewer_seeds_than_sync_says_so_in_the_legend(tmp_path, monkeypatch):
    seen = _capture(monkeypatch)
    groups = [{"task": "t", "method": m, "staleness": s, "ablation": False, "reward_last_mean": 0.5,
               "reward_last_std": 0.1, "n": n, "metric": "acc", "higher_is_better": True}
              for m, s, n in (("sync", 0, 5), ("stale", 16, 5), ("gac", 16, 3), ("gac", 32, 3))]
    cells = [{"task": "t", "method": g["method"], "staleness": g["staleness"], "seed": 0, "status": "done",
              "ablation": False} for g in groups]
    figs.robustness_figure(Canvas(tmp_path, cells, {}), groups)
    (ax,) = seen["fig_robustness.png"]["axes"]
    assert ax.get_legend_handles_labels()[1] == ["sync", "stale", "gac (3 seeds)"]
    assert "mean ± sd over seeds (ddof 0)" in ax.get_title()
    assert figs._seeds_label("gac", {3, 4}, 5) == "gac (3/4 seeds)" and figs._seeds_label("gac", 5, 5) == "gac"


def test_an_exclusive_band_inside_the_axis_sets_the_range_and_is_left_empty(tmp_path, monkeypatch):
    """The band (1.2, 2.0) excluded by a Fieller set lies inside the axis's cap: the axis reaches past it and the
    two rays end at its edges, so the figure does not draw it like an unbounded interval."""
    seen = _capture(monkeypatch)
    row = {"task": "t", "method": "gac", "staleness": 16, "share": 0.3, "no_gap": False, "share_ci_low": -math.inf,
           "share_ci_high": math.inf, "share_ci_kind": "exclusive", "share_ci_excluded": [1.2, 2.0],
           "vs_stale_p_adj": 0.9, "gap_within_noise": False, "measure": "final"}
    figs.shares_figure(Canvas(tmp_path, [], {}), [row])
    (ax,) = seen["fig_shares.png"]["axes"]
    assert ax.get_xlim()[1] > 2.0
    segments = sorted(tuple(ln.get_xdata()) for ln in ax.get_lines() if ln.get_linestyle() == "-"
                      and ln.get_marker() in ("None", "") and len(ln.get_xdata()) == 2)
    assert [round(a[1], 6) for a in segments[:1]] == [1.2] and round(segments[1][0], 6) == 2.0
