"""DriftMonitor (``param/drift``, ``param/step_norm``) against the parameters a probe reads after each step, with
GAC on the step editing them and StalenessSimulator swapping them; its checkpoint-resume exactness; a suite task's
``on_policy`` methods (a stabilizer at s = 0) in the grid, their checks, and their comparison to sync by hand."""

import math
import os
import sys

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from conftest import UserRegressor, flat_params, make_trainer  # noqa: E402

from gacbench import GAC, StalenessSimulator  # noqa: E402
from gacbench.callbacks import DriftMonitor  # noqa: E402
from gacbench.objectives import NoisyQuadratic  # noqa: E402


class Probe(pl.Callback):
    """After DriftMonitor in the callback list: the parameters and the logged values after every step."""

    def __init__(self):
        self.params, self.logged = [], []

    def on_train_start(self, trainer, pl_module):
        self.params.append(flat_params(pl_module).double())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.params.append(flat_params(pl_module).double())
        m = trainer.callback_metrics
        self.logged.append((float(m["param/drift"]), float(m["param/step_norm"])))


@pytest.mark.parametrize("with_step_gac", [False, True])
def test_drift_and_step_norm_equal_the_parameters_read_after_every_edit(with_step_gac):
    """||theta_k - theta_0|| and ||theta_k - theta_{k-1}|| of the parameters as they are after the whole step: with
    GAC on the step projecting or skipping it in an optimizer hook, and StalenessSimulator swapping the stale
    iterate in for the forward pass."""
    gac = GAC(c_low=0.4, c_high=0.85, target="step", warmup=0)
    probe = Probe()
    cbs = [StalenessSimulator(2), *([gac] if with_step_gac else []), DriftMonitor(), probe]
    trainer = make_trainer(cbs, max_steps=12)
    trainer.fit(UserRegressor(n=64, optimizer="adamw"))
    if with_step_gac:
        assert gac.changed > 0  # the edit the monitor must see
    theta = probe.params
    assert len(probe.logged) == 12
    for k, (drift, step) in enumerate(probe.logged, start=1):
        assert drift == pytest.approx(float((theta[k] - theta[0]).norm()), rel=1e-5, abs=1e-7)
        assert step == pytest.approx(float((theta[k] - theta[k - 1]).norm()), rel=1e-5, abs=1e-7)
    assert trainer.logger.values("param/drift") == [d for d, _ in probe.logged]


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_drift_resumes_exactly(tmp_path):
    """A run resumed from a checkpoint logs the drift from the first run's theta_0, as an uninterrupted run does
    (the resumed model starts from other weights, which the checkpoint replaces)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    total, cut = 12, 8
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=cut, save_top_k=-1)
    full = make_trainer([DriftMonitor(), ckpt_cb], max_steps=total, enable_checkpointing=True)
    full.fit(UserRegressor(n=32, optimizer="adamw"))
    second = make_trainer([DriftMonitor()], max_steps=total)
    model_b = UserRegressor(n=32, optimizer="adamw")
    with torch.no_grad():
        for p in model_b.parameters():
            p.add_(1.0)
    second.fit(model_b, ckpt_path=next(tmp_path.glob(f"*step={cut}.ckpt")))
    for key in ("param/drift", "param/step_norm"):
        assert second.logger.values(key) == full.logger.values(key)[-(total - cut):]


# -- on_policy: a stabilizer at s = 0 -----------------------------------------------------------------------------
def _suite(**task):
    return {"name": "x", "steps": 40, "methods": ["sync", "stale", "gac-step"], "staleness": [0, 16], "seeds": [0, 1],
            "tasks": {"a": {"objective": "quadratic", **task}}}


def test_on_policy_methods_also_run_at_s0_and_follow_the_selection():
    from gacbench.bench.runner import expand_cells

    suite = _suite(on_policy=["gac-step", "gac"])
    got = sorted({(c["method"], c["staleness"]) for c in expand_cells(suite)})
    assert got == [("gac", 0), ("gac-step", 0), ("gac-step", 16), ("stale", 16), ("sync", 0)]
    assert len(expand_cells(suite)) == 10
    assert sorted({(c["method"], c["staleness"]) for c in expand_cells(suite, staleness=[16])}) == [
        ("gac-step", 16), ("stale", 16)]  # no s = 0 in the selection: no on-policy cell
    assert sorted({(c["method"], c["staleness"]) for c in expand_cells(suite, methods=["sync", "gac-step"])}) == [
        ("gac-step", 0), ("gac-step", 16), ("sync", 0)]  # explicit methods: only the on-policy ones it names


@pytest.mark.parametrize("task, message", [
    ({"on_policy": ["sync"]}, r"task 'a': on_policy: 'sync' runs at s = 0 already"),
    ({"on_policy": ["gac-step"], "staleness": [16]}, r"task 'a': on_policy: runs its methods at s = 0, and the task's "
                                                     r"staleness has no 0"),
    ({"on_policy": ["nosuch"]}, r"task 'a': on_policy:.*unknown method 'nosuch'"),
])
def test_on_policy_is_checked_when_the_suite_is_read(tmp_path, task, message):
    import yaml

    from gacbench.bench.validate import load_suite
    from gacbench.usage import UsageError

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(_suite(**task)))
    with pytest.raises(UsageError, match=message):
        load_suite(str(path))


def test_a_stale_method_at_s0_runs_the_synchronous_objective():
    """The cell of a stale method at s = 0 builds its objective with staleness 0, exactly as sync's cell does."""
    from gacbench.bench.validate import objective_args

    cell = {"objective": "grpo", "params": {"lr": 1e-3}, "steps": 10, "seed": 3, "staleness": 0, "method": "gac-step"}
    assert objective_args(cell, stale=True) == objective_args({**cell, "method": "sync"}, stale=False)
    assert objective_args(cell)["staleness"] == 0


def test_on_policy_controls_equal_a_hand_computation():
    """The paired difference method - sync, its t-interval, the paired t-test and Holm's adjustment, by hand."""
    from scipy import stats

    from gacbench.bench.groups import group_records
    from gacbench.bench.stats import on_policy_controls

    sync = [0.30, 0.28, 0.29, 0.31]
    meth = {"gac-step": [0.35, 0.33, 0.36, 0.34], "gac-cosine": [0.31, 0.27, 0.30, 0.30]}
    cells = []
    for name, values in [("sync", sync), *meth.items()]:
        for seed, v in enumerate(values):
            cells.append({"task": "a", "method": name, "staleness": 0, "seed": seed, "status": "done", "final": v,
                          "initial": 0.2, "diverged": False, "metric": "acc", "higher_is_better": True,
                          "ablation": False, "reward_last": v - 0.1, "reward_first": 0.1, "cos_median": 0.0,
                          "cos_abs_q90": 0.1, "cos_abs_le_005": 0.5})
    cells.append({**cells[0], "method": "stale", "staleness": 16})  # a stale group: not an on-policy control
    rows = on_policy_controls(group_records(cells), cells)
    assert [r["method"] for r in rows] == ["gac-cosine", "gac-step"]
    ps = []
    for r in rows:
        d = np.array(meth[r["method"]]) - np.array(sync)
        half = stats.t.ppf(0.975, 3) * d.std(ddof=1) / 2.0
        assert r["vs_sync_diff"] == pytest.approx(d.mean())
        assert (r["vs_sync_ci_low"], r["vs_sync_ci_high"]) == pytest.approx((d.mean() - half, d.mean() + half))
        p = stats.ttest_rel(meth[r["method"]], sync).pvalue
        assert r["vs_sync_p"] == pytest.approx(p) and r["n"] == 4 and r["sync"] == pytest.approx(np.mean(sync))
        ps.append(p)
    lo, hi = sorted(ps)
    adj = {min(ps): min(1.0, 2 * lo), max(ps): max(min(1.0, 2 * lo), hi)}
    assert [r["vs_sync_p_adj"] for r in rows] == pytest.approx([adj[p] for p in ps])
    reward = on_policy_controls(group_records(cells), cells, "reward_last")
    assert reward[1]["vs_sync_diff"] == pytest.approx(np.mean(np.array(meth["gac-step"]) - np.array(sync)))
    assert not math.isnan(reward[1]["vs_sync_p"])


def test_a_grid_with_on_policy_cells_reports_them_and_the_drift(tmp_path):
    """A quadratic grid with an on-policy GAC: its s = 0 cells run, carry the drift, and the report compares them
    with sync (summary.json's on_policy and summary.md's table)."""
    import json

    from gacbench.bench.report import build_report
    from gacbench.bench.runner import expand_cells, run_grid

    suite = {"name": "x", "steps": 30, "methods": ["sync", "stale", "gac"], "staleness": [0, 4], "seeds": [0, 1],
             "tasks": {"q": {"objective": "quadratic", "params": {"lr": 0.05}, "on_policy": ["gac"]}}}
    cells = expand_cells(suite)
    out = tmp_path / "out"
    assert run_grid(cells, out)["failed"] == 0
    build_report(out, cells)
    summary = json.loads((out / "summary.json").read_text())
    assert [(r["method"], r["n"]) for r in summary["on_policy"]] == [("gac", 2)]
    assert [(r["method"], r["staleness"], r["n"]) for r in summary["staleness_cost"]] == [("gac", 4, 2)]
    groups = {(g["method"], g["staleness"]): g for g in summary["groups"]}
    assert set(groups) == {("sync", 0), ("gac", 0), ("stale", 4), ("gac", 4)}
    assert all(g["drift_mean"] > 0 and g["step_norm_mean"] > 0 and -1 <= g["step_cos_mean"] <= 1
               for g in groups.values())
    md = (out / "summary.md").read_text()
    assert "## On-policy controls: stabilizers at s = 0 against sync, final metric" in md
    assert "drift ‖θ_T − θ_0‖" in md
    assert all(r["staleness"] != 0 for r in summary["recovered"])  # an on-policy cell is not a recovered share


def test_staleness_costs_equal_a_hand_computation():
    """A method's cost of staleness against its own on-policy run (m at 0 minus m at s), beside sync minus stale,
    paired over the seeds each pair shares; a method without an s = 0 run gets no row."""
    from gacbench.bench.groups import group_records
    from gacbench.bench.stats import staleness_costs

    values = {("sync", 0): [0.30, 0.28, 0.29], ("stale", 16): [0.20, 0.21, 0.17],
              ("gac-step", 0): [0.40, 0.38, 0.41], ("gac-step", 16): [0.34, 0.35, 0.33, 0.30],
              ("gac", 16): [0.2, 0.2, 0.2]}
    cells = [{"task": "a", "method": m, "staleness": s, "seed": seed, "status": "done", "final": v, "initial": 0.2,
              "diverged": False, "metric": "acc", "higher_is_better": True, "ablation": False, "cos_median": 0.0,
              "cos_abs_q90": 0.1, "cos_abs_le_005": 0.5}
             for (m, s), vs in values.items() for seed, v in enumerate(vs)]
    rows = staleness_costs(group_records(cells), cells)
    assert [(r["method"], r["staleness"]) for r in rows] == [("gac-step", 16)]
    r = rows[0]
    own = np.array(values[("gac-step", 0)]) - np.array(values[("gac-step", 16)][:3])  # seed 3 has no s = 0 run
    ref = np.array(values[("sync", 0)]) - np.array(values[("stale", 16)])
    assert r["n"] == 3 and r["cost"] == pytest.approx(own.mean()) and r["stale_cost"] == pytest.approx(ref.mean())
    from scipy import stats
    half = stats.t.ppf(0.975, 2) * own.std(ddof=1) / math.sqrt(3)
    assert (r["cost_ci_low"], r["cost_ci_high"]) == pytest.approx((own.mean() - half, own.mean() + half))
    assert r["cost_p"] == pytest.approx(stats.ttest_rel(values[("gac-step", 0)], values[("gac-step", 16)][:3]).pvalue)


def test_the_curve_figures_get_an_on_policy_column_and_a_drift_figure(tmp_path):
    """With an on-policy method, the per-method figures draw an s = 0 column beside the stale ones, and cells
    that log param/drift get fig_drift."""
    from gacbench.bench.figures import on_policy_panel
    from gacbench.bench.report import build_report
    from gacbench.bench.runner import expand_cells, run_grid

    suite = {"name": "x", "steps": 30, "methods": ["sync", "stale", "gac"], "staleness": [0, 4], "seeds": [0],
             "tasks": {"q": {"objective": "quadratic", "params": {"lr": 0.05}, "on_policy": ["gac"]}}}
    cells = expand_cells(suite)
    run_grid(cells, tmp_path / "out")
    rep = build_report(tmp_path / "out", cells)
    names = {os.path.basename(str(f)) for f in rep["figures"]}
    assert {"fig_drift_q.png", "fig_cos_methods_q.png"} <= names
    assert on_policy_panel(cells) and not on_policy_panel([c for c in cells if c["staleness"] > 0 or
                                                           c["method"] == "sync"])


def test_the_cost_table_on_the_training_reward_says_that_it_holds_the_lag():
    """A run at s logs the reward of theta_{t-s}: on the training reward a stabilizer that removes staleness's harm
    still has a cost (s versions of its own curve), which the table says; on the final metric it does not apply."""
    from gacbench.bench.tables import _cost_table

    row = {"task": "a", "method": "gac", "staleness": 16, "cost": 0.1, "cost_ci_low": 0.0, "cost_ci_high": 0.2,
           "cost_p": 0.04, "cost_p_adj": 0.04, "n": 3, "stale_cost": 0.2, "stale_cost_ci_low": 0.1,
           "stale_cost_ci_high": 0.3, "stale_n": 3}
    reward = "\n".join(_cost_table("training reward (last 20% of steps)", [row]))
    final = "\n".join(_cost_table("final metric", [row]))
    assert "s policy versions of measurement lag" in reward and "(0 only where the reward has stopped rising)" in reward
    assert "measurement lag" not in final and "has cost 0 while sync − stale stays." in final


# DriftMonitor logs once per optimizer step, not per micro-batch
def test_drift_logs_once_per_optimizer_step_under_accumulation():
    """4 optimizer steps of 2 micro-batches: 4 step norms, each a real step (> 0), and the last drift is
    ||theta_4 - theta_0||."""
    from gacbench.callbacks import DriftMonitor

    model = NoisyQuadratic(dim=10, steps=8, lr=0.1, seed=0)
    theta0 = model.theta.detach().clone()
    trainer = make_trainer([DriftMonitor()], max_steps=4, accumulate_grad_batches=2)
    trainer.fit(model)
    norms = trainer.logger.values("param/step_norm")
    assert len(norms) == 4 and min(norms) > 0
    assert trainer.callback_metrics["param/step_norm"] > 0  # the last value is not a micro-batch's 0
    assert trainer.logger.last("param/drift") == pytest.approx(float((model.theta.detach() - theta0).norm()), rel=1e-5)
