"""The trainer builder, the objective registry, and the runner's worker reuse, cell identity and timing."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import alive, child_pids

from gacbench.bench import cell as cell_mod
from gacbench.bench.cell import CellMismatchError, cell_dir, identity_diff, run_cell, show_change
from gacbench.bench.runner import (
    check_params,
    expand_cells,
    load_suite,
    merge_params,
    order_cells,
    parse_params,
    run_grid,
    timing_record,
)
from gacbench.objectives import NoisyQuadratic, objective_class, register_objective, registered_objectives, registry
from gacbench.trainer import build_trainer, pick_accelerator


def tiny_suite(tmp_path: Path, **over) -> Path:
    suite = {
        "name": "tiny", "steps": 30, "warmup": 5,
        "tasks": {"quadratic": {"objective": "quadratic",
                                "params": {"optimizer": "sgd", "lr": 0.1, "sigma2": 10.0, "kappa": 10.0}}},
        "methods": ["sync", "stale"], "staleness": [0, 4], "seeds": [0],
    }
    suite.update(over)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(suite))
    return path


# -- the trainer builder ---------------------------------------------------------------------------
def test_pick_accelerator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_accelerator("auto") == "gpu" and pick_accelerator("cuda") == "gpu" and pick_accelerator("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_accelerator("auto") == "cpu" and pick_accelerator("cpu") == "cpu"
    with pytest.raises(ValueError, match="torch.cuda.is_available.*use accelerator 'auto' or 'cpu'"):
        pick_accelerator("gpu")


def test_build_trainer_defaults_and_overrides():
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary

    t = build_trainer(7, [], False, accelerator="cpu")
    assert t.max_steps == 7 and t.log_every_n_steps == 1 and t.num_sanity_val_steps == 0
    assert isinstance(t.accelerator, CPUAccelerator) and t.num_devices == 1
    assert t.checkpoint_callback is None and t.progress_bar_callback is None
    assert not any(isinstance(c, ModelSummary) for c in t.callbacks)
    t = build_trainer(7, [], False, accelerator="cpu", log_every_n_steps=5, enable_checkpointing=True)
    assert t.log_every_n_steps == 5 and t.checkpoint_callback is not None
    ckpt = ModelCheckpoint(dirpath="unused")
    assert build_trainer(7, [ckpt], False, accelerator="cpu").checkpoint_callback is ckpt  # asked for by a callback


def test_a_cell_builds_its_trainer_with_the_objectives_accelerator(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")

    class GPUQuadratic(NoisyQuadratic):
        accelerator = "gpu"

    monkeypatch.setattr(registry, "_TARGETS", dict(registry._TARGETS))
    monkeypatch.setattr(registry, "_RESOLVED", dict(registry._RESOLVED))
    register_objective("quadratic-gpu", GPUQuadratic)
    cell = {"task": "q", "objective": "quadratic-gpu", "params": {}, "steps": 5, "method": "sync", "staleness": 0,
            "seed": 0}
    status = run_cell(cell, tmp_path)
    assert status["status"] == "failed" and "asks for a GPU" in status["error"]
    assert NoisyQuadratic.accelerator == "cpu"


# -- the objective registry ------------------------------------------------------------------------
@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.setattr(registry, "_TARGETS", dict(registry._TARGETS))
    monkeypatch.setattr(registry, "_RESOLVED", dict(registry._RESOLVED))


def test_registry_resolves_strings_on_first_use_and_lists_known_names(clean_registry):
    register_objective("lazy-missing", "gacbench_no_such_module:Thing")  # registering imports nothing
    assert "lazy-missing" in registered_objectives()
    with pytest.raises(ImportError, match="lazy-missing.*gacbench_no_such_module"):
        objective_class("lazy-missing")
    register_objective("quad-by-path", "gacbench.objectives.quadratic:NoisyQuadratic")
    assert objective_class("quad-by-path") is NoisyQuadratic
    with pytest.raises(ValueError, match="unknown objective 'nope'; known objectives: .*bandit.*quadratic"):
        objective_class("nope")


def test_registry_refuses_conflicts_and_non_objectives(clean_registry):
    register_objective("quadratic", NoisyQuadratic)  # the same target again: a no-op
    with pytest.raises(ValueError, match="already registered.*replace=True"):
        register_objective("quadratic", "gacbench.objectives.mlp:MLPClassifier")
    with pytest.raises(ValueError, match="package.module:ClassName"):
        register_objective("bad", "gacbench.objectives.mlp")
    with pytest.raises(TypeError, match="not a subclass"):
        register_objective("bad", dict)
    register_objective("not-objective", "gacbench.trainer:TRAINER_DEFAULTS")
    with pytest.raises(TypeError, match="not a subclass"):
        objective_class("not-objective")


def test_the_llm_package_registers_grpo_without_importing_it():
    code = ("import sys, gacbench.llm\n"
            "from gacbench.objectives import registered_objectives\n"
            "assert 'grpo' in registered_objectives(), registered_objectives()\n"
            "assert 'gacbench.llm.grpo' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


# -- parameters and sections ----------------------------------------------------------------------
@dataclasses.dataclass
class EngineSection:
    name: str = "hf"
    dtype: str = "float32"


class SectionedQuadratic(NoisyQuadratic):
    def __init__(self, engine: EngineSection | dict | None = None, **kw) -> None:
        super().__init__(**kw)


def test_dotted_params_set_a_section_field_and_are_checked(clean_registry):
    assert parse_params(["engine.name=vllm", "lr=3e-4", "engine.dtype=bfloat16"]) == {
        "engine": {"name": "vllm", "dtype": "bfloat16"}, "lr": 3e-4}
    base = {"lr": 0.1, "engine": {"name": "hf", "dtype": "float32"}, "kappa": 10.0}
    assert merge_params(base, parse_params(["engine.name=vllm"])) == {
        "lr": 0.1, "engine": {"name": "vllm", "dtype": "float32"}, "kappa": 10.0}
    with pytest.raises(ValueError, match="expected KEY=VALUE or SECTION.KEY=VALUE"):
        parse_params(["engine.=vllm"])
    register_objective("sectioned", SectionedQuadratic)

    def cell(params):
        return [{"task": "t", "objective": "sectioned", "params": params}]

    check_params(cell(merge_params(base, parse_params(["engine.name=vllm"]))))
    with pytest.raises(ValueError, match="unknown engine setting.*engine.nmae; the engine section takes dtype, name"):
        check_params(cell(merge_params(base, parse_params(["engine.nmae=vllm"]))))
    with pytest.raises(ValueError, match="'engine' is a section.*--param engine.FIELD=VALUE"):
        check_params(cell(merge_params(base, parse_params(["engine=vllm"]))))


def test_identity_names_the_changed_field_of_a_section():
    stored = {"objective": "grpo", "params": {"engine": {"name": "vllm"}, "rollout": {"prompts": 8}}, "steps": 4}
    diff = identity_diff(stored, {**stored, "params": {"engine": {"name": "hf"}, "rollout": {"prompts": 8}}})
    assert {k: v for k, v in diff.items()} == {"params.engine.name": ("vllm", "hf")}


# -- status.json, timing ---------------------------------------------------------------------------
def test_a_cell_records_step_and_eval_time_worker_and_memory(tmp_path):
    cell = {"task": "q", "objective": "quadratic", "params": {}, "steps": 25, "method": "stale", "staleness": 2,
            "seed": 0}
    status = run_cell(cell, tmp_path)
    assert status["status"] == "done" and status["worker_pid"] == os.getpid() and status["rss_mb"] > 10
    assert 0 < status["step_s"] < status["seconds"] and 0 < status["eval_s"] < status["seconds"]
    assert json.loads((cell_dir(tmp_path, cell) / "status.json").read_text())["step_s"] == status["step_s"]


def test_rss_falls_back_to_getrusage_without_proc(monkeypatch):
    def no_proc(*args, **kwargs):
        raise OSError("no /proc")

    monkeypatch.setattr(cell_mod, "open", no_proc, raising=False)
    assert cell_mod.rss_mb() > 10


def test_timing_record_arithmetic():
    results = [{"status": "done", "step_s": 3.0, "eval_s": 0.5, "worker_pid": 11, "rss_mb": 100.0},
               {"status": "done", "step_s": 2.0, "eval_s": 0.5, "worker_pid": 12, "rss_mb": 90.0},
               {"status": "failed", "worker_pid": 11, "rss_mb": 120.0},
               {"status": "done", "step_s": 1.0, "eval_s": float("nan"), "worker_pid": 11, "rss_mb": 110.0}]
    t = timing_record(results, wall=5.0, workers=2)
    assert t["step_s"] == 6.0 and t["eval_s"] == 1.0 and t["step_share"] == pytest.approx(6.0 / 10.0)
    assert t["cells_per_min"] == pytest.approx(48.0)
    w = {x["pid"]: x for x in t["per_worker"]}
    assert w[11]["rss_mb"] == [100.0, 120.0, 110.0] and w[11]["cells"] == 3
    assert (w[11]["rss_mb_first"], w[11]["rss_mb_last"], w[11]["rss_mb_max"]) == (100.0, 110.0, 120.0)
    assert timing_record([], wall=1.0, workers=0)["step_share"] is None


def test_cells_sharing_objective_and_params_run_back_to_back():
    def c(obj, lr, seed):
        return {"objective": obj, "params": {"lr": lr}, "seed": seed}

    cells = [c("a", 1, 0), c("b", 1, 0), c("a", 2, 0), c("a", 1, 1), c("b", 1, 1), c("a", 2, 1)]
    assert [(x["objective"], x["params"]["lr"], x["seed"]) for x in order_cells(cells)] == [
        ("a", 1, 0), ("a", 1, 1), ("b", 1, 0), ("b", 1, 1), ("a", 2, 0), ("a", 2, 1)]


# -- a cell's parameters are part of its identity --------------------------------------------------
def _bench(suite: Path, out: Path, *extra: str) -> int:
    from gacbench.cli import main

    return main(["bench", "--suite", str(suite), "--out", str(out), "--workers", "1", *extra])


def test_a_rerun_with_other_params_is_refused_and_identical_params_reuse_the_cells(tmp_path, capsys):
    suite, out = tiny_suite(tmp_path), tmp_path / "out"
    assert _bench(suite, out, "--param", "lr=0.05") == 0
    statuses = sorted(out.glob("cells/**/status.json"))
    assert len(statuses) == 2
    mtimes = {p: p.stat().st_mtime_ns for p in statuses}
    capsys.readouterr()
    assert _bench(suite, out, "--param", "lr=0.2") == 2  # a usage error: one line, exit 2
    message = capsys.readouterr().err
    assert message.count("\n") == 1 and message.startswith("gacbench bench: error: ")
    assert "params.lr: 0.05 (stored) -> 0.2 (now), in 2 cell(s)" in message
    assert "use another --out" in message and f"rm -r {out / 'cells' / 'quadratic'}" in message
    assert mtimes == {p: p.stat().st_mtime_ns for p in statuses}  # nothing ran
    (tmp_path / "longer").mkdir()
    assert _bench(tiny_suite(tmp_path / "longer", steps=40), out, "--param", "lr=0.05") == 2
    assert "steps: 30 (stored) -> 40 (now)" in capsys.readouterr().err
    assert _bench(suite, out, "--param", "lr=0.05") == 0  # the same settings: every cell reused
    assert "ran 0 cells (2 already done" in " ".join(capsys.readouterr().out.split())
    assert mtimes == {p: p.stat().st_mtime_ns for p in statuses}


def test_a_failed_or_unfinished_cell_is_rerun_with_the_new_params(tmp_path):
    cells = expand_cells(load_suite(str(tiny_suite(tmp_path))))
    for c in cells:
        c["params"] = {**c["params"], "lr": -1.0}
    out = tmp_path / "out"
    assert run_grid(cells, out)["failed"] == len(cells)
    unfinished = {**cells[0], "params": {**cells[0]["params"], "lr": 0.3}}
    (cell_dir(out, cells[0]) / "status.json").unlink()  # as if its worker died
    (cell_dir(out, cells[0]) / "config.json").write_text(json.dumps(unfinished))
    for c in cells:
        c["params"]["lr"] = 0.1
    result = run_grid(cells, out)
    assert result["ran"] == len(cells) and result["failed"] == 0
    for c in cells:
        assert json.loads((cell_dir(out, c) / "config.json").read_text())["params"]["lr"] == 0.1


def test_identity_diff_names_each_changed_key():
    stored = {"task": "t", "objective": "q", "params": {"lr": 0.1, "engine": "hf"}, "steps": 30, "method": "gac",
              "seed": 0}
    asked = {**stored, "params": {"lr": 0.1, "kl_coef": 0}, "warmup": 9}
    diff = identity_diff(stored, asked)
    assert set(diff) == {"params.engine", "params.kl_coef"}
    assert show_change("params.engine", *diff["params.engine"]) == 'params.engine: "hf" (stored) -> unset (now)'
    assert set(identity_diff(stored, {**stored, "steps": 31, "method": "stale"})) == {"steps", "method"}
    assert identity_diff(stored, {**stored, "params": {"engine": "hf", "lr": 0.1}}) == {}


def test_run_cell_refuses_a_done_cell_with_other_settings(tmp_path):
    cell = {"task": "q", "objective": "quadratic", "params": {"lr": 0.1}, "steps": 5, "method": "sync", "staleness": 0,
            "seed": 0}

    assert run_cell(cell, tmp_path)["status"] == "done"
    assert run_cell(dict(cell), tmp_path)["status"] == "done"
    with pytest.raises(CellMismatchError, match=r"params.lr: 0.1 \(stored\) -> 0.2 \(now\)"):
        run_cell({**cell, "params": {"lr": 0.2}}, tmp_path)


# -- workers die with the runner -------------------------------------------------------------------




@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_pool_workers_die_when_the_runner_is_killed(tmp_path):
    suite = tiny_suite(tmp_path, steps=200_000, methods=["stale"], seeds=[0, 1])
    out = tmp_path / "out"
    code = ("import sys\nfrom gacbench.bench.runner import expand_cells, load_suite, run_grid\n"
            "run_grid(expand_cells(load_suite(sys.argv[1])), sys.argv[2], workers=2)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(suite), str(out)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and len(list(out.glob("cells/**/config.json"))) < 2:
            time.sleep(0.2)
        assert len(list(out.glob("cells/**/config.json"))) == 2, "the workers did not start their cells"
        def cmdline(pid: int) -> str:
            return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")

        # spawned workers are the runner's children; forked ones the children of its fork server
        children = child_pids(proc.pid)
        workers = [p for p in children if "spawn_main" in cmdline(p)]
        workers += [w for f in children if "multiprocessing.forkserver" in cmdline(f) for w in child_pids(f)]
        assert len(workers) >= 2
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # the runner only, not its process group
        proc.wait()
    deadline = time.time() + 30
    while time.time() < deadline and any(alive(p) for p in workers):
        time.sleep(0.2)
    assert not any(alive(p) for p in workers)
