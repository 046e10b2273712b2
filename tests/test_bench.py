"""The bench runner: stored cells, resume, failures, summary keys, report from stored runs, Ray."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from gacbench.bench.cell import cell_dir, run_cell
from gacbench.bench.report import build_report, recovered_shares
from gacbench.bench.runner import expand_cells, load_suite, run_grid
from gacbench.methods import parse_method

CELL_KEYS = {"task", "method", "staleness", "seed", "status", "metric", "higher_is_better", "final", "diverged",
             "cos_median", "cos_abs_q90", "cos_abs_le_005"}
GROUP_KEYS = {"final_mean", "final_std", "diverged_frac", "cos_median", "cos_abs_le_005", "n"}


def tiny_suite(tmp_path: Path, **over) -> Path:
    suite = {
        "name": "tiny", "steps": 30, "warmup": 5,
        "tasks": {"quadratic": {"objective": "quadratic",
                                "params": {"optimizer": "sgd", "lr": 0.1, "sigma2": 10.0, "kappa": 10.0}},
                  "bandit": {"objective": "bandit", "params": {"lr": 0.05}}},
        "methods": ["sync", "stale", "gac"], "staleness": [0, 4], "seeds": [0, 1],
    }
    suite.update(over)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(suite))
    return path


def test_grid_expansion_runs_sync_once_and_stale_methods_at_positive_staleness(tmp_path):
    cells = expand_cells(load_suite(str(tiny_suite(tmp_path))))
    keys = {(c["task"], c["method"], c["staleness"], c["seed"]) for c in cells}
    assert len(cells) == len(keys) == 2 * (1 + 2) * 2
    assert all(c["staleness"] == 0 for c in cells if c["method"] == "sync")
    assert all(c["staleness"] == 4 for c in cells if c["method"] != "sync")


def test_ablation_cells_skip_invalid_thresholds(tmp_path):
    suite = load_suite(str(tiny_suite(tmp_path, ablation={"method": "gac", "staleness": 4, "c_low": [0.05, 0.3],
                                                          "c_high": [0.3, 0.5]})))
    abl = [c for c in expand_cells(suite) if c.get("ablation")]
    specs = {c["method"] for c in abl}
    assert specs == {"gac(c_low=0.05,c_high=0.3)", "gac(c_low=0.05,c_high=0.5)", "gac(c_low=0.3,c_high=0.5)"}


def test_the_ablation_keyword_selects_the_same_ablation_cells_as_the_full_grid(tmp_path):
    suite = load_suite(str(tiny_suite(tmp_path, ablation={"method": "gac", "staleness": 4, "c_low": [0.05],
                                                          "c_high": [0.3, 0.5]})))
    full = expand_cells(suite)
    abl = [c for c in full if c.get("ablation")]
    assert len(abl) == 2 * 2 * 2  # 2 tasks x 2 threshold pairs x 2 seeds
    assert expand_cells(suite, methods=["ablation"]) == abl
    assert expand_cells(suite, methods=["gac", "ablation"]) == [c for c in full if c["method"] == "gac"] + abl
    # an explicit subset without the keyword has no ablation cells; the suite's own list has them
    assert not any(c.get("ablation") for c in expand_cells(suite, methods=["sync", "gac"]))
    assert expand_cells(suite, methods=list(suite["methods"])) == full


def test_grid_writes_summary_and_never_reruns_a_finished_cell(tmp_path):
    out = tmp_path / "out"
    cells = expand_cells(load_suite(str(tiny_suite(tmp_path))))
    first = run_grid(cells, out, workers=2)
    assert first["ran"] == len(cells) and first["failed"] == 0
    report = build_report(out, cells)
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["cells"]) == len(cells)
    for c in summary["cells"]:
        assert CELL_KEYS <= set(c) and c["status"] == "done"
    for g in summary["groups"]:
        assert GROUP_KEYS <= set(g)
    assert (out / "summary.md").read_text().count("Recovered share of the stale–sync gap: (") == 1
    assert {p.name for p in report["figures"]} >= {"fig_cos.png", "fig_robustness.png", "fig_curves_quadratic.png"}
    # two persistent workers ran all the cells (no process per cell), each recording its memory per cell
    statuses = [json.loads(p.read_text()) for p in out.glob("cells/**/status.json")]
    pids = {st["worker_pid"] for st in statuses}
    assert len(pids) <= 2 and os.getpid() not in pids
    timing = json.loads((out / "timing.json").read_text())
    assert timing["workers"] == 2 and timing["ran"] == len(cells)
    assert {w["pid"] for w in timing["per_worker"]} == pids
    assert sum(w["cells"] for w in timing["per_worker"]) == len(cells)
    for w in timing["per_worker"]:
        assert len(w["rss_mb"]) == w["cells"] and w["rss_mb_max"] == max(w["rss_mb"]) > 0
    assert timing["step_s"] == pytest.approx(sum(st["step_s"] for st in statuses))
    assert timing["step_share"] == pytest.approx(timing["step_s"] / (2 * timing["wall_s"]))
    assert 0 < timing["step_share"] < 1
    assert summary["timing"] == timing
    assert "Last run: step share" in (out / "summary.md").read_text()
    mtimes = {p: p.stat().st_mtime_ns for p in out.glob("cells/**/status.json")}
    second = run_grid(cells, out, workers=2)
    assert second["ran"] == 0 and second["skipped_done"] == len(cells)
    assert mtimes == {p: p.stat().st_mtime_ns for p in out.glob("cells/**/status.json")}
    assert json.loads((out / "timing.json").read_text()) == timing  # a run that executes no cell keeps the last timing


def test_report_is_rebuilt_from_stored_runs_alone(tmp_path):
    out = tmp_path / "out"
    cells = expand_cells(load_suite(str(tiny_suite(tmp_path))), tasks=["quadratic"], seeds=[0])
    run_grid(cells, out)
    build_report(out, cells)
    before = json.loads((out / "summary.json").read_text())
    (out / "summary.json").unlink()
    (out / "summary.md").unlink()
    build_report(out)  # discovers the cells from disk
    assert json.loads((out / "summary.json").read_text()) == before


def test_failed_cell_is_recorded_and_the_grid_goes_on(tmp_path):
    suite = load_suite(str(tiny_suite(tmp_path)))
    suite["tasks"]["broken"] = {"objective": "quadratic", "params": {"lr": -1.0}}
    cells = expand_cells(suite, seeds=[0])
    console = Console(record=True, width=400)
    result = run_grid(cells, tmp_path / "out", console=console)
    assert result["failed"] == 3 and result["ran"] == len(cells)
    # the console names each failed cell and its error: the cause is not left in status.json alone
    printed = [line for line in console.export_text().splitlines() if line.startswith("failed cell: broken/")]
    assert len(printed) == 3 and all("lr=-1.0 must be a finite number > 0" in line for line in printed)
    status = json.loads((cell_dir(tmp_path / "out", [c for c in cells if c["task"] == "broken"][0])
                         / "status.json").read_text())
    assert status["status"] == "failed" and "lr=-1.0 must be a finite number > 0" in status["error"]
    build_report(tmp_path / "out", cells)
    assert "## Failed cells" in (tmp_path / "out" / "summary.md").read_text()
    again = run_grid(cells, tmp_path / "out")  # a failed cell is retried; done ones are not
    assert again["ran"] == 3


def test_an_unfinished_cell_is_rerun(tmp_path):
    cell = {"task": "q", "objective": "quadratic", "params": {}, "steps": 10, "method": "stale", "staleness": 2,
            "seed": 0}

    d = cell_dir(tmp_path, cell)
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cell))  # a worker died before writing its status
    assert run_cell(cell, tmp_path)["status"] == "done"


def test_killed_grid_resumes_only_the_missing_cells(tmp_path):
    suite = tiny_suite(tmp_path, steps=150, seeds=[0, 1, 2])
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "gacbench.cli", "bench", "--suite", str(suite), "--out", str(out), "--workers", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(out.glob("cells/**/status.json"))) < 3:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = {p: p.stat().st_mtime_ns for p in out.glob("cells/**/status.json")}
    total = len(expand_cells(load_suite(str(suite))))
    assert 3 <= len(done_before) < total
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"ran {total - len(done_before)} cells ({len(done_before)} already done" in " ".join(rerun.stdout.split())
    for p, t in done_before.items():
        assert p.stat().st_mtime_ns == t


@pytest.mark.parametrize("objective,method", [("mlp", "gac"), ("bandit", "stale")])
def test_a_seeded_cell_is_reproducible(tmp_path, objective, method):
    cell = {"task": "t", "objective": objective, "params": {}, "steps": 25, "method": method, "staleness": 3, "seed": 4}
    a, b = run_cell(cell, tmp_path / "a"), run_cell(cell, tmp_path / "b")
    assert a["final"] == b["final"]
    cols = lambda root: [r.split(",") for r in (cell_dir(root, cell) / "metrics.csv").read_text().splitlines()]  # noqa: E731
    assert cols(tmp_path / "a") == cols(tmp_path / "b")


@pytest.mark.parametrize("objective,method", [("quadratic", "gac"), ("bandit", "stale")])
def test_a_cells_final_metric_is_the_fits_evaluation_of_its_last_step_until_something_changes(
        tmp_path, objective, method, monkeypatch):
    """The fit's last step is evaluated in the fit, and the cell reuses that value; a fit stopped between
    evaluations, or parameters written since, are evaluated again."""
    import csv

    import lightning.pytorch as pl
    import torch

    from gacbench.objectives import objective_class

    calls = []
    cls = objective_class(objective)
    metric = cls.metric
    monkeypatch.setattr(cls, "metric", lambda self: calls.append(self._trainer and self.trainer.global_step)
                        or metric(self))
    cell = {"task": "t", "objective": objective, "params": {"eval_every": 10}, "steps": 25, "method": method,
            "staleness": 3, "seed": 4}
    out = run_cell(cell, tmp_path)
    assert calls == [None, 10, 20, 25]  # θ₀ before the fit, then in the fit; none after it
    with open(cell_dir(tmp_path, cell) / "metrics.csv") as f:
        logged = [r[f"eval/{out['metric']}"] for r in csv.DictReader(f) if r.get(f"eval/{out['metric']}")]
    assert out["final"] == float(logged[-1])
    class StopAt13(pl.Callback):  # as DivergenceStop ends a cell: between two evaluations
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            trainer.should_stop = trainer.global_step == 13 or trainer.should_stop

    model = cls(**cell["params"], seed=4, steps=25, **({"staleness": 3} if cls.rollout_staleness else {}))
    # fused AdamW (GRPO's optimizer) writes the parameters without advancing their version counters
    model.configure_optimizers = lambda: torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    trainer = pl.Trainer(max_steps=25, callbacks=[StopAt13()], accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    del calls[:]
    assert trainer.global_step == 13 and model.final_metric() == metric(model) and calls == [13]
    model._last_eval = ((13, model._parameters_state()), 0.125)
    assert model.final_metric() == 0.125
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # written in place since that evaluation: evaluated again
    assert model.final_metric() == metric(model) != 0.125


def test_recovered_share_arithmetic():
    common = {"final_std": 0.1, "n": 4, "ablation": False}
    groups = [
        {"task": "t", "method": "sync", "staleness": 0, "final_mean": 1.0, "higher_is_better": False, **common},
        {"task": "t", "method": "stale", "staleness": 8, "final_mean": 5.0, "higher_is_better": False, **common},
        {"task": "t", "method": "gac", "staleness": 8, "final_mean": 2.0, "higher_is_better": False, **common},
        {"task": "u", "method": "sync", "staleness": 0, "final_mean": 0.9, "higher_is_better": True, **common},
        {"task": "u", "method": "stale", "staleness": 8, "final_mean": 0.5, "higher_is_better": True, **common},
        {"task": "u", "method": "gac", "staleness": 8, "final_mean": 0.4, "higher_is_better": True, **common},
    ]
    rows = {r["task"]: r for r in recovered_shares(groups)}
    assert rows["t"]["share"] == pytest.approx(0.75)
    assert rows["u"]["share"] == pytest.approx(-0.25)
    assert rows["t"]["gap_se"] == pytest.approx((2 * 0.1**2 * 4 / 3 / 4) ** 0.5)  # sample std (ddof=1) over 4 seeds
    assert rows["t"]["gap_within_noise"] is False  # gap 4 vs s.e. 0.082
    groups[3]["final_std"] = groups[4]["final_std"] = 0.3  # s.e. 0.245: a gap of 0.4 is within 2 s.e.
    assert next(r for r in recovered_shares(groups) if r["task"] == "u")["gap_within_noise"] is True
    groups[3]["n"] = 1  # one seed: the noise is unknown, not zero
    assert next(r for r in recovered_shares(groups) if r["task"] == "u")["gap_within_noise"] is None
    groups[1]["final_mean"] = 0.5  # stale better than sync: no gap to recover
    assert math.isnan(next(r for r in recovered_shares(groups) if r["task"] == "t")["share"])


@pytest.mark.parametrize("spec,match", [("nope", "unknown method"), ("gac(0.1)", "key=literal"),
                                        ("gac(c_low=x)", "key=literal")])
def test_bad_method_specs_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_method(spec)


def test_method_specs_with_commas_inside_parentheses(tmp_path):
    from gacbench.methods import split_top_level

    specs = split_top_level("sync,gac(c_low=0.02,c_high=0.2),gac+m2po(tau=0.1)", ",")
    assert specs == ["sync", "gac(c_low=0.02,c_high=0.2)", "gac+m2po(tau=0.1)"]
    cells = expand_cells(load_suite(str(tiny_suite(tmp_path))), methods=specs, tasks=["bandit"], seeds=[0])
    assert {c["method"] for c in cells} == set(specs)


def test_bad_suite_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown suite"):
        load_suite("no-such-suite")
    bad = tiny_suite(tmp_path, tasks={"x": {"objective": "nope"}})
    with pytest.raises(ValueError, match="objective 'nope'"):
        load_suite(str(bad))
    with pytest.raises(ValueError, match="non-negative"):
        expand_cells(load_suite(str(tiny_suite(tmp_path))), staleness=[-1])
    with pytest.raises(ValueError, match="task 'bandit'.*warmup: 30 leaves none of its 30 steps"):
        load_suite(str(tiny_suite(tmp_path, warmup=30)))
    with pytest.raises(ValueError, match="task 'quadratic'.*warmup: 5 leaves none of its 5 steps"):
        load_suite(str(tiny_suite(tmp_path, tasks={"quadratic": {"objective": "quadratic", "steps": 5}})))
    # a key written twice (a task block copied without renaming it): the safe loader would keep the last
    text = tiny_suite(tmp_path).read_text()
    copied = tmp_path / "copied.yaml"
    copied.write_text(text + "steps: 60\n")
    with pytest.raises(ValueError, match=r"not valid YAML \(line \d+\): the key 'steps' appears twice"):
        load_suite(str(copied))
    anchored = tmp_path / "anchored.yaml"  # a merge key's entries may be overridden: not a repeated key
    anchored.write_text("steps: 30\nmethods: [sync, stale]\nstaleness: [0, 4]\nseeds: [0]\ntasks:\n"
                        "  a: {objective: bandit, params: &base {lr: 0.1, group: 4}}\n"
                        "  b: {objective: bandit, params: {<<: *base, lr: 0.05}}\n")
    assert load_suite(str(anchored))["tasks"]["b"]["params"] == {"lr": 0.05, "group": 4}
    chained = tmp_path / "chained.yaml"  # an overriding merge, itself merged deeper down: still no repeat
    chained.write_text("steps: 30\nmethods: [sync, stale]\nstaleness: [0, 4]\nseeds: [0]\ntasks:\n"
                       "  b: {objective: bandit, params: {<<: *mid}}\n"
                       "  a: {objective: bandit, params: &mid {<<: &base {lr: 0.1, group: 4}, lr: 0.05}}\n"
                       .replace("  b: {objective: bandit, params: {<<: *mid}}\n", "") +
                       "  b: {objective: bandit, params: {<<: *mid, group: 8}}\n")
    assert load_suite(str(chained))["tasks"]["b"]["params"] == {"lr": 0.05, "group": 8}
    listed = tmp_path / "listed.yaml"
    listed.write_text(text + "? [a, b]\n: 1\n")
    with pytest.raises(ValueError, match="suite .*listed.yaml"):
        load_suite(str(listed))


def test_ray_executor_on_a_local_instance(tmp_path):
    ray = pytest.importorskip("ray")
    cells = expand_cells(load_suite(str(tiny_suite(tmp_path))), tasks=["quadratic"], seeds=[0])
    try:
        result = run_grid(cells, tmp_path / "out", workers=2, executor="ray")
    finally:
        ray.shutdown()
    assert result["ran"] == len(cells) and result["failed"] == 0
    statuses = [json.loads((cell_dir(tmp_path / "out", c) / "status.json").read_text()) for c in cells]
    assert all(st["status"] == "done" for st in statuses)
    assert len({st["worker_pid"] for st in statuses}) <= 2 < len(cells)  # two actors ran every cell


def test_param_overrides_are_parsed_and_checked():
    from gacbench.bench.runner import check_params, parse_params

    assert parse_params(["engine=hf", "lr=3e-4", "template={problem} =", "kl_coef=0"]) == {
        "engine": "hf", "lr": 3e-4, "template": "{problem} =", "kl_coef": 0}
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_params(["engine"])
    with pytest.raises(ValueError, match="set by the grid itself"):
        parse_params(["seed=3"])
    with pytest.raises(ValueError, match="unknown parameter.*lrr"):
        check_params([{"task": "q", "objective": "quadratic", "params": {"lrr": 0.1}}])
