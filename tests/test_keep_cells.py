"""paper/keep_cells.py: the finished cells of a grid store, and only they, are staged in git, ignore rules
notwithstanding, so that a grid resumes from a new clone and reuses exactly those cells."""

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from gacbench.bench.cell import cell_dir, run_cell, stored_done
from gacbench.jsonio import write_json

REPO = Path(__file__).resolve().parents[1]
CELL = {"task": "q", "objective": "quadratic", "params": {"lr": 0.1}, "steps": 6, "method": "sync", "staleness": 0,
        "seed": 0}


def _keep_cells():
    spec = importlib.util.spec_from_file_location("keep_cells", REPO / "paper" / "keep_cells.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _store(root: Path) -> dict[str, Path]:
    """A store with one finished cell, one in flight (config.json and a partial metrics.csv, no status), one
    failed and one whose status says done over a truncated metrics.csv."""
    store = root / "grids" / "suite"
    done = CELL
    run_cell(done, store)
    flight = {**CELL, "seed": 1}
    d = cell_dir(store, flight)
    d.mkdir(parents=True)
    write_json(d / "config.json", flight)
    (d / "metrics.csv").write_text("step,loss\n0,1.0\n")
    failed = {**CELL, "seed": 2}
    d = cell_dir(store, failed)
    d.mkdir(parents=True)
    write_json(d / "config.json", failed)
    write_json(d / "status.json", {"status": "failed", "error": "ValueError: x", "cell": failed})
    cut = {**CELL, "seed": 3}
    run_cell(cut, store)
    path = cell_dir(store, cut) / "metrics.csv"
    path.write_text(path.read_text()[:-20])
    return {"store": store, "done": cell_dir(store, done)}


def test_only_finished_cells_are_found(tmp_path):
    made = _store(tmp_path)
    assert _keep_cells().finished_cells(made["store"]) == [made["done"]]


def test_list_prints_the_three_files_of_each_finished_cell(tmp_path, capsys):
    made = _store(tmp_path)
    assert _keep_cells().main(["--list", str(made["store"])]) == 0
    assert capsys.readouterr().out.split() == [str(made["done"] / n) for n in ("config.json", "status.json",
                                                                                "metrics.csv")]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_staged_cells_resume_in_a_clone_even_where_the_store_is_ignored(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    made = _store(repo)
    (repo / ".gitignore").write_text("/grids/*\n")

    def git(*args, cwd=repo):
        return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "root")
    monkeypatch.chdir(repo)
    assert _keep_cells().main(["grids/suite"]) == 0
    staged = sorted(git("diff", "--cached", "--name-only").split())
    rel = made["done"].relative_to(repo).as_posix()
    assert staged == sorted(f"{rel}/{n}" for n in ("config.json", "metrics.csv", "status.json"))
    # the store's timing.json (the last run that executed cells), which the summary's timing section reads
    write_json(made["store"] / "timing.json", {"ran": 2, "wall_s": 3.0})
    assert _keep_cells().main(["grids/suite"]) == 0
    assert "grids/suite/timing.json" in git("diff", "--cached", "--name-only").split()
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "cells")
    clone = tmp_path / "clone"
    git("clone", "-q", str(repo), str(clone), cwd=tmp_path)
    store = clone / "grids" / "suite"
    reused = stored_done(store, CELL)
    assert reused is not None and reused == json.loads((made["done"] / "status.json").read_text())
    assert run_cell(CELL, store)["reused"] is True  # the clone's grid runs only the cells still missing
    assert stored_done(store, {**CELL, "seed": 3}) is None


def test_a_directory_without_cells_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _keep_cells().main([str(tmp_path)])
    assert "holds no cells/ directory" in capsys.readouterr().err
