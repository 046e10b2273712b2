"""The bench runner, the cell store and the command-line plumbing fed hostile input: copied cell directories,
grid flags that leave methods out, task names that are not one path component, unwritable summaries, a full
disk, clashing stabilizer plug-ins, and the suites a wheel install must find."""

import errno
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import bench, quadratic_suite

from gacbench.bench.cell import cell_dir
from gacbench.bench.validate import SUITES_DIR, suites_dir
from gacbench.cli import main
from gacbench.jsonio import write_text
from gacbench.usage import UsageError

REPO = Path(__file__).resolve().parents[1]


def _copy_cell(out: Path, src: dict, dst: dict) -> None:
    shutil.copytree(cell_dir(out, src), cell_dir(out, dst))


# -- a copied cell stands only for the cell it was computed for -----------------------------------------------
def test_a_cell_copied_to_another_seed_or_staleness_is_refused_naming_the_key(tmp_path, capsys):
    suite, out = quadratic_suite(tmp_path, methods=["sync", "stale"]), tmp_path / "out"
    assert bench(suite, out) == 0
    base = {"task": "quadratic", "method": "stale", "staleness": 4, "seed": 0}
    _copy_cell(out, base, {**base, "seed": 1})
    capsys.readouterr()
    assert bench(suite, out, "--seeds", "0,1") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "seed: 0 (stored) -> 1 (now)" in err
    shutil.rmtree(cell_dir(out, {**base, "seed": 1}))
    _copy_cell(out, base, {**base, "staleness": 8})
    assert bench(suite, out, "--staleness", "0,4,8") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "staleness: 4 (stored) -> 8 (now)" in err
    shutil.rmtree(cell_dir(out, {**base, "staleness": 8}))
    assert bench(suite, out) == 0  # the originals are still reused


def test_a_copied_cell_outside_the_grid_is_reported_incomplete_and_never_counted(tmp_path, capsys):
    suite, out = quadratic_suite(tmp_path, methods=["sync", "stale"]), tmp_path / "out"
    assert bench(suite, out) == 0
    before = json.loads((out / "summary.json").read_text())
    base = {"task": "quadratic", "method": "stale", "staleness": 4, "seed": 0}
    copy = {**base, "seed": 7}  # a seed the grid does not run: only the summary reads it
    _copy_cell(out, base, copy)
    for command in (["report", str(out)], ["bench", "--suite", str(suite), "--out", str(out), "--workers", "1"]):
        capsys.readouterr()
        assert main(command) == 0
        printed = capsys.readouterr()
        said = "".join((printed.out + printed.err).split())  # rich folds a long path anywhere
        assert "".join(f"incomplete cell: {cell_dir(out, copy)}: its config.json records the cell "
                       f"cells/quadratic/stale/s4/seed0 (a copied directory?): the cell is not counted".split()) in said
        summary = json.loads((out / "summary.json").read_text())
        assert [c["status"] for c in summary["cells"] if c["seed"] == 7] == ["incomplete"]
        assert [g["n"] for g in summary["groups"]] == [g["n"] for g in before["groups"]]


def test_a_copied_cell_whose_config_json_alone_differs_is_refused(tmp_path, capsys):
    suite, out = quadratic_suite(tmp_path, methods=["sync", "stale"]), tmp_path / "out"
    assert bench(suite, out) == 0
    base = {"task": "quadratic", "method": "stale", "staleness": 4, "seed": 0}
    copy = {**base, "seed": 1}
    _copy_cell(out, base, copy)
    status_path = cell_dir(out, copy) / "status.json"
    status = json.loads(status_path.read_text())
    status["cell"]["seed"] = 1  # the status's copy edited to match; config.json still says seed 0
    status_path.write_text(json.dumps(status))
    capsys.readouterr()
    assert bench(suite, out, "--seeds", "0,1") == 2
    assert "seed: 0 (stored) -> 1 (now)" in capsys.readouterr().err


def test_a_cell_computed_with_another_warmup_is_refused(tmp_path, capsys):
    suite, out = quadratic_suite(tmp_path, methods=["sync", "stale"]), tmp_path / "out"
    assert bench(suite, out) == 0
    (tmp_path / "w").mkdir()
    capsys.readouterr()
    assert bench(quadratic_suite(tmp_path / "w", methods=["sync", "stale"], warmup=9), out) == 2
    assert "warmup: 5 (stored) -> 9 (now)" in capsys.readouterr().err


# -- a task name is one path component ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../escape", "a/b", "..", "/abs"])
def test_a_task_name_that_is_not_one_path_component_is_refused(tmp_path, capsys, name):
    suite = quadratic_suite(tmp_path, methods=["sync"], staleness=[0],
                            tasks={name: {"objective": "quadratic", "params": {"lr": 0.1}}})
    out = tmp_path / "deep" / "out"
    capsys.readouterr()
    assert bench(suite, out) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "one path component" in err and repr(name) in err
    assert not list(tmp_path.rglob("status.json")) and not list(tmp_path.rglob("config.json"))
    with pytest.raises(UsageError, match="not one path component"):  # the store itself refuses too
        cell_dir(out, {"task": name, "method": "sync", "staleness": 0, "seed": 0})


# -- the suites ship in the wheel -----------------------------------------------------------------------------
def test_the_suite_lookup_uses_the_checkout_else_the_packed_copy(tmp_path):
    packed = tmp_path / "site" / "gacbench" / "_tasks"
    (packed / "suites").mkdir(parents=True)
    shutil.copy(REPO / "tasks" / "suites" / "synthetic-smoke.yaml", packed / "suites")
    assert suites_dir(tmp_path / "site", packed) == packed / "suites"  # a wheel install: no tasks/ beside it
    assert suites_dir(REPO, packed) == REPO / "tasks" / "suites"  # a checkout wins
    assert SUITES_DIR == REPO / "tasks" / "suites"


def test_the_wheel_carries_every_suite_and_llm_config(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "gacbench", src / "gacbench", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "tasks", src / "tasks")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("gacbench-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        smoke = z.read("gacbench/_tasks/suites/synthetic-smoke.yaml")
    assert smoke == (REPO / "tasks" / "suites" / "synthetic-smoke.yaml").read_bytes()
    for pattern in ("suites/*.yaml", "llm/*.yaml"):
        for f in (REPO / "tasks").glob(pattern):
            assert f"gacbench/_tasks/{f.relative_to(REPO / 'tasks')}" in names
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    found = subprocess.run([sys.executable, "-c", "from gacbench.cli import _suite_names; print(_suite_names())"],
                           cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True,
                           check=True).stdout
    assert "synthetic-smoke" in found and "llm-smoke" in found


# -- a grid never drops a method silently ---------------------------------------------------------------------
def test_a_staleness_list_without_zero_names_sync_as_left_out(tmp_path, capsys):
    suite, out = quadratic_suite(tmp_path, methods=["sync", "stale"]), tmp_path / "out"
    capsys.readouterr()
    assert bench(suite, out, "--staleness", "4") == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "method sync is left out of this grid: it runs only at staleness 0" in text
    assert "method stale is left out" not in text
    assert not (out / "cells" / "quadratic" / "sync").exists() and (out / "cells" / "quadratic" / "stale").exists()
    assert bench(suite, tmp_path / "zero", "--staleness", "0") == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "method stale is left out of this grid: it runs only at a staleness > 0" in text
    assert "method sync is left out" not in text
    assert bench(suite, tmp_path / "all") == 0  # the suite's own grid leaves nothing out
    assert "left out" not in capsys.readouterr().out


# -- an unwritable summary: one line naming the cause and the path; never a half-written file ------------------
def _fail_writes_of(monkeypatch, name: str, err: int) -> None:
    """Make every write of a file whose (temporary) name holds ``name`` raise OSError(err) with no file name, as
    a failed write() does."""
    real = Path.write_text

    def write_text(self, *args, **kwargs):
        if name in self.name:
            raise OSError(err, os.strerror(err))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)


@pytest.mark.parametrize("name", ["summary.json", "summary.md"])
def test_a_full_disk_while_writing_a_summary_is_one_line_naming_it_and_leaves_the_old_file_whole(
        tmp_path, capsys, monkeypatch, name):
    suite, out = quadratic_suite(tmp_path, methods=["sync", "stale"]), tmp_path / "out"
    assert bench(suite, out) == 0
    before = (out / name).read_bytes()
    _fail_writes_of(monkeypatch, name, errno.ENOSPC)
    capsys.readouterr()
    assert main(["report", str(out)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("gacbench report: error: ") and f"cannot write {out / name}" in line
    assert "No space left on device (ENOSPC)" in line
    assert (out / name).read_bytes() == before and not list(out.glob(".*.tmp"))


def test_write_text_replaces_atomically_and_a_failed_write_names_the_file(tmp_path, monkeypatch):
    target = tmp_path / "timing.json"
    write_text(target, "old")
    _fail_writes_of(monkeypatch, "timing.json", errno.ENOSPC)
    with pytest.raises(OSError) as exc:
        write_text(target, "new")
    assert exc.value.errno == errno.ENOSPC and exc.value.filename == str(target)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["timing.json"]


def test_report_on_a_read_only_directory_is_one_line_naming_the_path(tmp_path, capsys, monkeypatch):
    suite, out = quadratic_suite(tmp_path, methods=["sync", "stale"]), tmp_path / "out"
    assert bench(suite, out) == 0
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):  # a read-only mount: creating or writing under out is refused
        if str(path).startswith(str(out)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    capsys.readouterr()
    assert main(["report", str(out)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("gacbench report: error: cannot write ") and str(out) in line
    assert "Read-only file system (EROFS)" in line and "Traceback" not in line


# -- refusals are usage errors: one line, exit 2 ---------------------------------------------------------------
def test_an_unknown_theory_check_is_one_line_and_exit_2(capsys):
    assert main(["theory", "--checks", "no-such-check"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("gacbench theory: error: --checks: unknown check(s) no-such-check; the checks are: ")
    from gacbench.theory.checks import CHECKS

    one = next(iter(CHECKS))
    for checks in ("", f"{one},{one}", f"{one},"):  # '' had run every check, a repeat ran one twice
        assert main(["theory", "--checks", checks]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert "give each check once, comma-separated, without empty items" in line


# -- a diverged run counts at its starting value ---------------------------------------------------------------
def test_a_diverged_cell_counts_at_its_starting_value_in_the_group_and_per_seed():
    from gacbench.bench.groups import group_records, per_seed

    common = {"task": "t", "method": "stale", "staleness": 8, "status": "done", "metric": "loss",
              "higher_is_better": False, "ablation": False, "initial": 10.0, "cos_median": 0.1, "cos_abs_q90": 0.5,
              "cos_abs_le_005": 0.2}
    cells = [{**common, "seed": 0, "final": 1e6, "diverged": True},  # finite, but diverged (10x worse than start)
             {**common, "seed": 1, "final": float("nan"), "diverged": False},  # non-finite: also its start
             {**common, "seed": 2, "final": 4.0, "diverged": False}]
    (g,) = group_records(cells)
    assert g["final_mean"] == pytest.approx((10 + 10 + 4) / 3)
    assert g["final_std"] == pytest.approx(8 ** 0.5)  # population std of (10, 10, 4): sqrt((4 + 4 + 16) / 3)
    assert g["diverged_frac"] == pytest.approx(1 / 3) and g["n"] == 3
    assert per_seed(cells, "final") == {("t", "stale", 8): {0: 10.0, 1: 10.0, 2: 4.0}}


# -- steps: 0 is refused where the suite is read ---------------------------------------------------------------
@pytest.mark.parametrize("where", ["suite", "task"])
@pytest.mark.parametrize("steps", [0, -3])
def test_a_suite_or_task_with_no_steps_is_refused_before_anything_runs(tmp_path, capsys, where, steps):
    task = {"objective": "quadratic", "params": {"lr": 0.1}, **({"steps": steps} if where == "task" else {})}
    suite = quadratic_suite(tmp_path, methods=["sync", "stale"], tasks={"quadratic": task},
                            **({"steps": steps} if where == "suite" else {}))
    capsys.readouterr()
    assert bench(suite, tmp_path / "out") == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert f"steps: {steps} is not a positive integer" in line and str(suite) in line
    assert not (tmp_path / "out" / "cells").exists()


# -- a cell another runner stored as failed is taken as failed, not rerun --------------------------------------
def test_a_cell_another_runner_marked_failed_is_reported_not_rerun(tmp_path):
    from rich.console import Console

    from gacbench.bench.executors import Dependencies, Display, wait_for_claims
    from gacbench.jsonio import write_json

    out = tmp_path / "out"
    failed = {"task": "q", "objective": "quadratic", "params": {"lr": 0.1}, "steps": 5, "method": "stale",
              "staleness": 2, "seed": 0}
    killed = {**failed, "seed": 1}  # its holder died before storing anything
    cell_dir(out, failed).mkdir(parents=True)
    cell_dir(out, killed).mkdir(parents=True)
    write_json(cell_dir(out, failed) / "status.json",
               {"status": "failed", "error": "RuntimeError: boom", "cell": failed})
    deps = Dependencies([], out)
    results = wait_for_claims(out, [failed, killed], deps, Display(2, 0, Console(quiet=True)), poll_s=0.01)
    assert [(r["status"], r["error"], r["reused"]) for r in results] == [("failed", "RuntimeError: boom", True)]
    assert deps.ready == [killed]  # only the cell nobody stored goes back to be run


def test_a_cell_another_runner_stored_with_other_settings_is_refused_or_rerun(tmp_path):
    from rich.console import Console

    from gacbench.bench.cell import CellMismatchError, run_cell
    from gacbench.bench.executors import Dependencies, Display, wait_for_claims
    from gacbench.jsonio import write_json

    out = tmp_path / "out"
    done = {"task": "q", "objective": "quadratic", "params": {"lr": 0.1}, "steps": 5, "method": "stale",
            "staleness": 2, "seed": 0}
    failed = {**done, "seed": 1}
    # the other runner ran them with --param lr=0.05: one finished, one failed
    assert run_cell({**done, "params": {"lr": 0.05}}, str(out))["status"] == "done"
    cell_dir(out, failed).mkdir(parents=True)
    theirs = {**failed, "params": {"lr": 0.05}}
    write_json(cell_dir(out, failed) / "config.json", theirs)
    write_json(cell_dir(out, failed) / "status.json", {"status": "failed", "error": "RuntimeError: boom",
                                                       "cell": theirs})
    deps = Dependencies([], out)
    display = Display(2, 0, Console(quiet=True))
    assert wait_for_claims(out, [failed], deps, display, poll_s=0.01) == [] and deps.ready == [failed]  # rerun
    with pytest.raises(CellMismatchError, match=r"holds a finished run with other settings \(params.lr: 0.05 "
                                                r"\(stored\) -> 0.1 \(now\)\), stored by the runner that held it"):
        wait_for_claims(out, [done], deps, display, poll_s=0.01)


# -- VCPO's importance cap -------------------------------------------------------------------------------------
@pytest.mark.parametrize("cap", [8.0, 2.0])
def test_vcpo_truncates_a_sequence_weight_above_its_cap(cap):
    import math

    import torch

    from gacbench.stabilizers import VCPO, PolicyBatch

    d = torch.float64
    # sequence weights w = exp(sum_t log(pi_prox / pi_behav)) = [1, 20]; r = 1 (prox = current)
    logp = torch.tensor([[0.0, 0.0], [math.log(20.0), 0.0]], dtype=d, requires_grad=True)
    batch = PolicyBatch(logp, torch.zeros(2, 2, dtype=d), torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=d),
                        torch.ones(2, 2, dtype=torch.bool))
    loss, m = VCPO(baseline=False, is_cap=cap).policy_loss(batch)
    assert loss.item() == pytest.approx(-(1 * 1 + min(20.0, cap) * -1) / 2)  # -agg(min(w, C) r A)
    assert float(m["is/truncated_frac"]) == pytest.approx(0.5)
    loss.backward()  # the weight is a constant: d/dlogp = -min(w, C) A r / (tokens in the batch)
    assert logp.grad.reshape(-1).tolist() == pytest.approx([-1 / 4, -1 / 4, cap / 4, cap / 4])
