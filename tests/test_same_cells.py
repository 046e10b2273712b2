"""paper/same_cells.py: a short rerun of a stored cell on the same arithmetic matches it value for value, a run
that differs anywhere (another seed, a value's last digit) is caught, and wall times are not compared."""

import csv
import importlib.util
from pathlib import Path

from gacbench.bench.cell import cell_dir, run_cell

REPO = Path(__file__).resolve().parents[1]
CELL = {"task": "q", "objective": "quadratic", "params": {"lr": 0.1}, "steps": 12, "method": "stale",
        "staleness": 2, "seed": 0}


def _same_cells():
    spec = importlib.util.spec_from_file_location("same_cells", REPO / "paper" / "same_cells.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rewrite(path: Path, edit) -> None:
    """Rewrite ``metrics.csv`` through ``edit(row)`` on each of its rows."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        fields, rows = reader.fieldnames, list(reader)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(edit(dict(r)) for r in rows)


def test_short_rerun_matches_its_stored_cell_and_other_arithmetic_does_not(tmp_path, capsys):
    grid, scratch, other = tmp_path / "grid", tmp_path / "scratch", tmp_path / "other"
    run_cell(CELL, grid)
    run_cell({**CELL, "steps": 8}, scratch)
    mod = _same_cells()
    (entry,) = mod.compare(scratch, grid)
    assert entry["stored"] and entry["differ"] == 0 and entry["only_one"] == 0 and entry["equal"] > 5
    assert mod.main([str(scratch), str(grid)]) == 0
    assert "1 cells compared" in capsys.readouterr().out
    # the same cell (task, method, staleness, seed) computed otherwise: a slightly different step size
    run_cell({**CELL, "steps": 8, "params": {"lr": 0.1001}}, other)
    (entry,) = mod.compare(other, grid)
    assert entry["differ"] > 0 and entry["first"] is not None
    assert mod.main([str(other), str(grid)]) == 1


def test_last_digit_counts_and_wall_times_do_not(tmp_path):
    grid, scratch = tmp_path / "grid", tmp_path / "scratch"
    run_cell(CELL, grid)
    run_cell({**CELL, "steps": 8}, scratch)
    path = cell_dir(scratch, CELL) / "metrics.csv"
    mod = _same_cells()
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    with open(path, "w", newline="") as f:  # a wall time that only the short run logged
        writer = csv.DictWriter(f, fieldnames=[*rows[0], "time/generate_s"])
        writer.writeheader()
        writer.writerows({**r, "time/generate_s": "0.25"} for r in rows)
    (entry,) = mod.compare(scratch, grid)
    assert entry["differ"] == 0 and entry["only_one"] == 0 and entry["equal"] > 5

    def nudge(row):  # the last digit of the gradient norm logged at step 0
        if row.get("step") == "0" and row.get("grad/norm"):
            row["grad/norm"] = row["grad/norm"][:-1] + str((int(row["grad/norm"][-1]) + 1) % 10)
        return row

    _rewrite(path, nudge)
    (entry,) = mod.compare(scratch, grid)
    assert entry["differ"] == 1 and entry["first"][:2] == (0, "grad/norm")


def test_nothing_stored_to_compare_is_not_a_match(tmp_path, capsys):
    grid, scratch = tmp_path / "grid", tmp_path / "scratch"
    run_cell({**CELL, "seed": 3}, grid)
    run_cell({**CELL, "steps": 8}, scratch)
    mod = _same_cells()
    assert mod.main([str(scratch), str(grid)]) == 1
    assert "not stored" in capsys.readouterr().out
