"""paper/async/make.py: the async-bench table, with the ideal speed-up beside the measured one, into --out."""

import importlib.util
import json
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def _make():
    spec = importlib.util.spec_from_file_location("async_make", REPO / "paper" / "async" / "make.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _record(sync_s, async_s, generate_s, train_s):
    return {"engine": "vllm", "steps": 60, "max_staleness": 4, "sync_s": sync_s, "async_s": async_s,
            "speedup": sync_s / async_s, "ideal_speedup": (generate_s + train_s) / max(generate_s, train_s),
            "generate_share": generate_s / (generate_s + train_s), "lag_mean": 1.5, "lag_max": 3, "dropped": 0,
            "sync_reward_final": 0.1, "async_reward_final": 0.12, "load_avg_1min": 0.4, "settings": {"prompts": 8}}


def test_the_bench_table_has_the_ideal_speedup_and_the_median_goes_to_out(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "out"
    runs.mkdir()
    published = REPO / "paper" / "async" / "summary.md"
    before = published.stat().st_mtime_ns
    for k, (a, g) in enumerate([(80.0, 20.0), (90.0, 30.0), (100.0, 25.0)], start=1):
        (runs / f"bench-long-{k}.json").write_text(json.dumps(_record(120.0, a, g, 120.0 - g)))
    assert _make().main(["--runs", str(runs), "--out", str(out)]) == 0
    text = (out / "summary.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| bench-long-2.json"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[6:9] == ["1.33", "1.33", "0.25"]  # 120 / 90; (30 + 90) / 90; 30 / 120
    assert "Median speedup of the bench-long-* records (vllm, 8 prompts, 60 steps, s_max 4): **1.33** over 3" in text
    assert f"`python paper/async/make.py --runs {runs} --out {out}`" in text  # the command that regenerates it
    assert published.stat().st_mtime_ns == before  # --out, not the published folder


def _study_record(seed, lag):
    rng = np.random.default_rng(seed)
    return {"steps": 20, "lag": [lag] * 20, "lag_max_per_step": [lag] * 20, "cos": list(rng.uniform(-0.2, 0.3, 19)),
            "reward": list(rng.uniform(0, 0.2, 20)), "eval_acc": 0.1,
            "settings": {"rollout": {"prompts": 8}, "lr": 1e-4, "engine": {"name": "vllm"}}}


def test_a_study_section_names_the_folder_it_was_read_from(tmp_path):
    runs, out = tmp_path / "grids" / "async-long", tmp_path / "out"
    for seed in (0, 1):
        for way in ("async", "fixed", "uniform"):
            d = runs / "study-long" / f"seed{seed}" / way
            d.mkdir(parents=True)
            (d / "record.json").write_text(json.dumps(_study_record(seed, 4)))
    (runs / "study-empty").mkdir()
    assert _make().main(["--runs", str(runs), "--out", str(out)]) == 0
    text = (out / "summary.md").read_text()
    assert f"## Is the simulator faithful? {runs}/study-long/ (2 seed(s), 20 steps each)" in text
    empty = runs / "study-empty"
    assert f"No complete seed under {empty}/ (run `python paper/async/run.py --root {empty}`)" in text
    assert "runs/async/" not in text  # no folder other than the one read
    assert (out / "fig_study_long.png").is_file()
