"""The reward-by-policy-version figure (fig_versions_TASK.png): its seed-mean curves and bands against hand
computations, the method families of its panels, and the figure a report draws from a stored rollout grid."""

import math
import statistics

import numpy as np
import pytest
from conftest import report_cell

from gacbench.bench import figures as figs
from gacbench.bench.cell import cell_dir
from gacbench.bench.figures import Canvas, family_panels
from gacbench.bench.groups import version_curve, version_measure
from gacbench.bench.report import build_report
from gacbench.jsonio import write_json
from gacbench.methods import FAMILIES, method_family


def _versioned(seed: int, training: dict, policy: dict | None = None) -> dict:
    rec = report_cell("t", "stale", 4, seed, 0.0, reward=0.0)
    rec["_by_version"] = {"reward/mean": training, **({"eval/policy_reward": policy} if policy is not None else {})}
    return rec


def test_training_reward_curve_is_the_seed_mean_of_moving_means_with_the_range_of_two_seeds():
    # seed 0: moving means of 2 versions, 1.5, 2.5 and 4.0 at versions 0.5, 1.5 and 2.5; seed 1 (its non-finite value
    # left out): finite versions 0, 2, 3, 4, means 2.0, 4.0 and 7.0 at 1.0, 2.5 and 3.5; both seeds have 2.5 alone
    a = _versioned(0, {0: 1.0, 1: 2.0, 2: 3.0, 3: 5.0})
    b = _versioned(1, {0: 1.0, 1: math.nan, 2: 3.0, 3: 5.0, 4: 9.0})
    curve = version_curve([a, b], "reward/mean", smooth=2)
    assert curve["versions"] == [2.5] and curve["mean"] == pytest.approx([4.0])
    assert curve["n"] == 2 and curve["band"] == "range"
    # two seeds that share their versions: the mean and the range over seeds at each
    c = _versioned(1, {0: 3.0, 1: 3.0, 2: 3.0, 3: 1.0})
    curve = version_curve([a, c], "reward/mean", smooth=2)
    assert curve["versions"] == [0.5, 1.5, 2.5]
    assert curve["mean"] == pytest.approx([(1.5 + 3.0) / 2, (2.5 + 3.0) / 2, (4.0 + 2.0) / 2])
    assert curve["low"] == pytest.approx([1.5, 2.5, 2.0]) and curve["high"] == pytest.approx([3.0, 3.0, 4.0])
    # the default window (10 versions) is longer than a's 4 versions: one point at their mean version, their mean;
    # one seed: its range is the point itself
    curve = version_curve([a], "reward/mean")
    assert curve["versions"] == [1.5] and curve["mean"] == pytest.approx([11.0 / 4])
    assert curve["low"] == curve["high"] == curve["mean"] and curve["n"] == 1


def test_policy_reward_curve_is_not_smoothed_and_has_a_standard_error_band_beyond_three_seeds():
    policy = [{4: 0.20, 8: 0.30, 11: 0.35}, {4: 0.22, 8: 0.26, 11: 0.41},
              {4: 0.18, 8: 0.31, 11: 0.33}, {4: 0.25, 8: 0.29, 11: 0.30, 12: 0.9}]  # 12: one seed only, left out
    cells = [_versioned(k, {v: 0.0 for v in range(12)}, p) for k, p in enumerate(policy)]
    curve = version_curve(cells, "eval/policy_reward")
    assert curve["versions"] == [4.0, 8.0, 11.0] and curve["n"] == 4 and curve["band"] == "se"
    for i, v in enumerate((4, 8, 11)):
        xs = [p[v] for p in policy]
        se = statistics.stdev(xs) / math.sqrt(4)
        assert curve["mean"][i] == pytest.approx(statistics.mean(xs))
        assert curve["low"][i] == pytest.approx(statistics.mean(xs) - se)
        assert curve["high"][i] == pytest.approx(statistics.mean(xs) + se)
    # three seeds: the range
    curve = version_curve(cells[:3], "eval/policy_reward")
    assert curve["band"] == "range" and curve["low"][2] == pytest.approx(0.33) and curve["high"][2] == 0.41
    assert version_curve([_versioned(0, {0: 1.0})], "eval/policy_reward") is None  # no policy reward: no curve


def test_the_measure_is_the_policy_reward_where_every_cell_logs_it():
    with_policy = [_versioned(k, {0: 1.0}, {0: 0.5}) for k in range(2)]
    assert version_measure(with_policy) == "eval/policy_reward"
    assert version_measure(with_policy + [_versioned(2, {0: 1.0})]) == "reward/mean"
    assert version_measure(with_policy + [report_cell("t", "sync", 0, 0, 1.0)]) is None  # not a rollout cell
    assert version_measure([]) is None


def test_method_families_and_their_panels():
    assert [method_family(m) for m in ("gac", "gac-step", "gac-calibrated", "gac(c_low=0.02)", "m2po", "tis",
                                       "gac+m2po", "lr-scaled", "no-such-method")] == \
        [FAMILIES[0]] * 4 + [FAMILIES[1]] * 2 + [FAMILIES[2], FAMILIES[3], FAMILIES[3]]
    loss = ["m2po", "bapo", "tis", "gspo", "cispo", "mis", "icepop"]
    panels = family_panels(["sync", "stale", "lr-scaled", *loss, "gac", "gac-ema", "stale"])
    assert panels == [("GAC readings", ["gac", "gac-ema"]), ("loss-side corrections (1/2)", loss[:5]),
                      ("loss-side corrections (2/2)", loss[5:]), ("other methods", ["lr-scaled"])]
    assert family_panels(["sync", "stale"]) == [("", [])]
    assert figs.PANEL_METHODS == 5


# -- a stored rollout grid ---------------------------------------------------------------------------------------
STEPS = 12
EVAL = (4, 8, 11)


def _store(root, method, s, seed, *, policy=True):
    """A done rollout cell of STEPS steps: training reward 0.1 t + 0.01 seed (+ 0.05 for a method other than sync
    and stale) at step t with lag min(t, s), and the policy reward _policy(method, s, seed, v) at the EVAL steps."""
    cell = {"task": "toy", "objective": "bandit", "params": {}, "steps": STEPS, "warmup": 0, "method": method,
            "staleness": s, "seed": seed}
    d = cell_dir(root, cell)
    d.mkdir(parents=True)
    write_json(d / "config.json", cell)
    bonus = 0.0 if method in ("sync", "stale") else 0.05
    rows = "".join(f"{t},{0.1 * t + 0.01 * seed + bonus},{min(t, s)},{t / STEPS},\n" for t in range(STEPS))
    if policy:
        rows += "".join(f"{v},,,,{_policy(method, s, seed, v)}\n" for v in EVAL)
    (d / "metrics.csv").write_text("step,reward/mean,stale/lag,eval/reward,eval/policy_reward\n" + rows)
    write_json(d / "status.json", {"status": "done", "initial": 0.0, "final": 1.0, "diverged": False,
                                   "metric": "reward", "higher_is_better": True, "steps_run": STEPS, "cell": cell})


def _policy(method: str, s: int, seed: int, v: int) -> float:
    return 0.02 * v - 0.001 * s * (method == "stale") + 0.01 * seed ** 2 + 0.003 * len(method)


#: (method, s): seeds; sync and stale run four seeds (a standard-error band), the others two (a range)
GRID = {("sync", 0): 4, ("stale", 4): 4, ("stale", 8): 4, ("gac", 4): 2, ("gac", 8): 2, ("m2po", 4): 2,
        ("lr-scaled", 8): 2}


def _grid(root, policy=lambda method, s, seed: True):
    for (m, s), n in GRID.items():
        for seed in range(n):
            _store(root, m, s, seed, policy=policy(m, s, seed))


def _capture(monkeypatch):
    """The figures written, by file name: under ``panels`` each panel's title, y label, lines (label, x, y, marker)
    and whether it has its own legend; under ``legends`` the texts of each of the figure's own legends."""
    seen = {}
    save = Canvas.save

    def keep(self, fig, name, *args, **kwargs):
        panels = {ax.get_title(): {"ylabel": ax.get_ylabel(), "legend": ax.get_legend() is not None,
                                   "lines": {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata()),
                                                              ln.get_marker()) for ln in ax.get_lines()}}
                  for ax in fig.axes}
        seen[name] = {"panels": panels, "legends": [[x.get_text() for x in lg.get_texts()] for lg in fig.legends]}
        save(self, fig, name, *args, **kwargs)
    monkeypatch.setattr(Canvas, "save", keep)
    return seen


def test_a_report_draws_the_policy_reward_by_version_in_a_row_per_s_and_a_panel_per_family(tmp_path, monkeypatch):
    seen = _capture(monkeypatch)
    _grid(tmp_path)
    rep = build_report(tmp_path)
    assert "fig_versions_toy.png" in {p.name for p in rep["figures"]}
    assert (tmp_path / "fig_versions_toy.png").stat().st_size > 0
    panels = seen["fig_versions_toy.png"]["panels"]
    assert list(panels) == [f"toy, s={s}: {f}" for s in (4, 8)
                            for f in ("GAC readings", "loss-side corrections", "other methods")]
    for s in (4, 8):
        for family, methods in (("GAC readings", {"gac"}), ("loss-side corrections", {"m2po"} if s == 4 else set()),
                                ("other methods", {"lr-scaled"} if s == 8 else set())):
            # the methods run on 2 seeds against sync's 4 say so
            assert set(panels[f"toy, s={s}: {family}"]["lines"]) == {"sync (s=0)", "stale",
                                                                     *(f"{m} (2 seeds)" for m in methods)}
        assert panels[f"toy, s={s}: GAC readings"]["ylabel"].startswith("policy reward of θ_v")
    # one legend names every method, also those run at one s only; no panel has its own
    assert seen["fig_versions_toy.png"]["legends"] == [["sync (s=0)", "stale", "gac (2 seeds)", "m2po (2 seeds)",
                                                        "lr-scaled (2 seeds)"]]
    assert not any(panel["legend"] for panel in panels.values())
    # each line is the mean over its seeds at the eval points, by hand, with markers there
    for (m, s), label in ((("stale", 8), "stale"), (("sync", 0), "sync (s=0)"), (("gac", 8), "gac (2 seeds)")):
        x, y, marker = panels["toy, s=8: GAC readings"]["lines"][label]
        assert x == list(EVAL) and marker == "o"
        assert y == pytest.approx([np.mean([_policy(m, s, k, v) for k in range(GRID[(m, s)])]) for v in EVAL])


def test_on_policy_controls_get_a_first_row_beside_sync(tmp_path, monkeypatch):
    """A method also run at s = 0 (its on-policy control) is drawn there, in a first row beside sync, at its mean
    over its seeds; without such runs the figure has no s = 0 row (the test above)."""
    seen = _capture(monkeypatch)
    _grid(tmp_path)
    for seed in range(4):
        _store(tmp_path, "gac", 0, seed)
    build_report(tmp_path)
    panels = seen["fig_versions_toy.png"]["panels"]
    assert list(panels)[:3] == [f"toy, s=0 (on-policy controls)\n{f}"
                                for f in ("GAC readings", "loss-side corrections", "other methods")]
    lines = panels["toy, s=0 (on-policy controls)\nGAC readings"]["lines"]
    assert set(lines) == {"sync (s=0)", "gac"}  # as many seeds as sync: no count in the label
    x, y, _ = lines["gac"]
    assert x == list(EVAL)
    assert y == pytest.approx([np.mean([_policy("gac", 0, k, v) for k in range(4)]) for v in EVAL])
    assert set(panels["toy, s=0 (on-policy controls)\nother methods"]["lines"]) == {"sync (s=0)"}


def test_without_the_policy_reward_in_every_cell_the_figure_reads_the_training_reward(tmp_path, monkeypatch):
    seen = _capture(monkeypatch)
    _grid(tmp_path, policy=lambda method, s, seed: method != "lr-scaled")
    build_report(tmp_path)
    panel = seen["fig_versions_toy.png"]["panels"]["toy, s=4: GAC readings"]
    assert panel["ylabel"].startswith("training reward by version")
    # stale at s = 4: steps 0..4 sampled theta_0 (their mean, 0.2 + 0.01 seed), step t > 4 theta_{t-4}: versions
    # 0..7, fewer than the 10-version window, so one point at version 3.5, the mean of the eight, no marker
    x, y, marker = panel["lines"]["stale"]
    versions = [0.2] + [0.1 * (v + 4) for v in range(1, 8)]
    assert x == [3.5] and marker in ("None", "", None)
    assert y == pytest.approx([np.mean(versions) + np.mean([0.01 * k for k in range(4)])])


def test_no_figure_without_stale_runs_or_rewards_by_version(tmp_path):
    for seed in range(2):
        _store(tmp_path / "on-policy", "sync", 0, seed)
        _store(tmp_path / "on-policy", "gac", 0, seed)
    rep = build_report(tmp_path / "on-policy")
    assert not (tmp_path / "on-policy" / "fig_versions_toy.png").exists()
    assert "fig_versions_toy.png" not in {p.name for p in rep["figures"]}
    # a grid whose cells log no training reward (not a rollout objective) has none either
    root = tmp_path / "quadratic"
    for m, s in (("sync", 0), ("stale", 4)):
        cell = {"task": "quadratic", "objective": "quadratic", "params": {}, "steps": 3, "warmup": 0, "method": m,
                "staleness": s, "seed": 0}
        d = cell_dir(root, cell)
        d.mkdir(parents=True)
        write_json(d / "config.json", cell)
        (d / "metrics.csv").write_text("step,eval/gap,align/cos\n" + "".join(f"{t},1.0,0.1\n" for t in range(3)))
        write_json(d / "status.json", {"status": "done", "initial": 10.0, "final": 1.0, "diverged": False,
                                       "metric": "gap", "higher_is_better": False, "steps_run": 3, "cell": cell})
    assert not any(p.name.startswith("fig_versions") for p in build_report(root)["figures"])
