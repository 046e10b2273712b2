"""Where a grid's wall time goes: a cell's time parts, their aggregation over workers, `bench --verbose`, the
command line's imports, the run seen from outside the process, and workers forked from the fork server."""

import json
from pathlib import Path

import pytest
import yaml

from gacbench.bench.cell import run_cell
from gacbench.bench.runner import order_cells
from gacbench.bench.timing import CELL_PARTS, PARTS, breakdown, cell_parts, timing_lines, timing_record
from gacbench.cli import main


def _cell(pid: int, start: float, end: float, **parts) -> dict:
    return {"status": "done", "worker_pid": pid, "started_at": start, "ended_at": end,
            "step_s": parts.get("steps", 0.0), "eval_s": parts.get("eval", 0.0), "rss_mb": 100.0,
            "time": cell_parts(parts, end - start)}


def test_cell_parts_put_what_the_measured_parts_leave_in_other():
    parts = cell_parts({"setup": 1.0, "steps": 5.0, "eval": 0.5}, span=7.0)
    assert set(parts) == set(CELL_PARTS)
    assert parts["other"] == pytest.approx(0.5) and parts["model"] == 0.0
    assert sum(parts.values()) == pytest.approx(7.0)


def test_breakdown_lays_each_worker_on_the_grid_span():
    # grid from t = 1000 for 20 s, 3 workers; worker 1 ran two cells, worker 2 one, worker 3 none
    t0 = 1000.0
    results = [_cell(1, t0 + 2.0, t0 + 8.0, setup=1.0, steps=4.0),            # start 2 s
               _cell(1, t0 + 8.5, t0 + 15.0, steps=5.0, eval=1.0),            # gap 0.5 s, idle 5 s after it
               _cell(2, t0 + 3.0, t0 + 19.0, model=2.0, engine=3.0, steps=10.0),  # start 3 s, idle 1 s
               {"status": "failed", "error": "reference failed", "cell": {}},  # never ran: no worker
               _cell(2, t0 - 50.0, t0 - 40.0, steps=9.0)]                      # an earlier run's stored result
    b = breakdown(results, t0, wall=20.0, workers=3)
    w1, w2 = b["per_worker"][1], b["per_worker"][2]
    assert set(w1) == set(PARTS)
    # the grid's last cell ends at 19 s: worker 1 waits 4 s for it, then both workers take 1 s to shut down
    assert (w1["start"], w1["gaps"], w1["idle"], w1["shutdown"]) == pytest.approx((2.0, 0.5, 4.0, 1.0))
    assert (w1["setup"], w1["steps"], w1["eval"], w1["other"]) == pytest.approx((1.0, 9.0, 1.0, 1.5))
    assert (w2["start"], w2["gaps"], w2["idle"], w2["shutdown"]) == pytest.approx((3.0, 0.0, 0.0, 1.0))
    assert (w2["model"], w2["engine"], w2["steps"], w2["other"]) == pytest.approx((2.0, 3.0, 10.0, 1.0))
    for w in (w1, w2):
        assert sum(w.values()) == pytest.approx(20.0)
    total = b["parts"]
    assert total["idle"] == pytest.approx(4.0 + 20.0)  # the third worker ran nothing
    assert total["shutdown"] == pytest.approx(2.0)
    assert total["steps"] == pytest.approx(19.0)
    assert sum(total.values()) == pytest.approx(60.0)


def test_a_worker_that_replaced_another_continues_its_line():
    """Two workers; worker 1 died after its cell ending at 6 s and worker 3 replaced it from 9 s: the breakdown
    still adds up to wall x 2, worker 3's start is the 3 s since worker 1's last cell, and only the slot's last
    worker waits and shuts down."""
    t0 = 0.0
    results = [_cell(1, 1.0, 6.0, steps=5.0),
               _cell(2, 1.5, 18.0, steps=16.5),
               _cell(3, 9.0, 17.0, steps=8.0)]
    b = breakdown(results, t0, wall=20.0, workers=2)
    w1, w2, w3 = (b["per_worker"][p] for p in (1, 2, 3))
    assert (w1["start"], w1["idle"], w1["shutdown"]) == pytest.approx((1.0, 0.0, 0.0))
    assert (w3["start"], w3["idle"], w3["shutdown"]) == pytest.approx((3.0, 1.0, 2.0))
    assert sum(w1.values()) + sum(w3.values()) == pytest.approx(20.0) == sum(w2.values())
    assert sum(b["parts"].values()) == pytest.approx(40.0) and b["parts"]["steps"] == pytest.approx(29.5)
    t = timing_record(results, wall=20.0, workers=2, grid_started_at=t0)
    assert sum(t["parts_share"].values()) == pytest.approx(1.0)
    # a second pool of two workers after the first (pids 4, 5 from 10 s): still wall x 2
    second = [_cell(1, 1.0, 8.0, steps=7.0), _cell(2, 1.0, 9.0, steps=8.0),
              _cell(4, 10.0, 19.0, steps=9.0), _cell(5, 11.0, 18.0, steps=7.0)]
    assert sum(breakdown(second, t0, wall=20.0, workers=2)["parts"].values()) == pytest.approx(40.0)


def test_timing_record_shares_add_up_to_one_and_match_the_step_share():
    t0 = 50.0
    results = [_cell(7, t0 + 1.0, t0 + 6.0, setup=0.5, steps=3.0, eval=1.0),
               _cell(8, t0 + 1.5, t0 + 9.0, steps=6.0)]
    t = timing_record(results, wall=10.0, workers=2, grid_started_at=t0)
    assert t["step_share"] == pytest.approx(9.0 / 20.0) == pytest.approx(t["parts_share"]["steps"])
    assert sum(t["parts_share"].values()) == pytest.approx(1.0)
    assert sum(t["parts"].values()) == pytest.approx(20.0)
    w = {x["pid"]: x for x in t["per_worker"]}
    assert (w[7]["parts"]["idle"], w[7]["parts"]["shutdown"]) == pytest.approx((3.0, 1.0))
    assert (w[8]["parts"]["start"], w[8]["parts"]["idle"]) == pytest.approx((1.5, 0.0))
    assert "parts" not in timing_record(results, wall=10.0, workers=2)  # without the grid's start: no breakdown


def test_verbose_lines_print_every_part_with_seconds_and_share():
    t0 = 0.0
    results = [_cell(7, 1.0, 6.0, setup=0.5, steps=3.0, eval=1.0), _cell(8, 1.5, 9.0, steps=6.0)]
    timing = {"ran": 2, **timing_record(results, wall=10.0, workers=2, grid_started_at=t0)}
    quiet, loud = timing_lines(timing), timing_lines(timing, verbose=True)
    assert loud[: len(quiet)] == quiet and len(quiet) == 3
    extra = loud[len(quiet):]
    assert extra[0] == "where the time went (2 worker(s) x 10.0 s wall = 20.0 s):"
    rows = {line.split()[0]: line for line in extra[1: 1 + len(PARTS)]}
    assert list(rows) == list(PARTS)
    assert rows["steps"].split()[1:3] == ["9.0", "s"] and rows["steps"].split()[3] == "45.0%"
    assert rows["idle"].split()[1:4] == ["3.0", "s", "15.0%"]  # worker 7 ends 3 s before worker 8
    assert rows["shutdown"].split()[1:4] == ["2.0", "s", "10.0%"]  # 1 s each after the last cell
    assert extra[1 + len(PARTS)] == ("  worker pid 7: start 1.0, setup 0.5, eval 1.0, steps 3.0, other 0.5, idle 3.0, "
                                     "shutdown 1.0 (s)")


def test_a_cell_records_its_time_parts_adding_up_to_its_span(tmp_path):
    cell = {"task": "q", "objective": "quadratic", "params": {"optimizer": "sgd", "lr": 0.1}, "steps": 20,
            "warmup": 2, "method": "stale", "staleness": 4, "seed": 0}
    status = run_cell(cell, tmp_path)
    assert status["status"] == "done"
    parts = status["time"]
    assert set(parts) == set(CELL_PARTS)
    assert sum(parts.values()) == pytest.approx(status["ended_at"] - status["started_at"])
    assert parts["steps"] == status["step_s"] and parts["eval"] == status["eval_s"]
    assert all(v >= 0 for v in parts.values()) and parts["setup"] > 0 and parts["trainer"] > 0
    assert (parts["model"], parts["engine"]) == (0.0, 0.0)  # a synthetic objective reports no such costs
    stored = json.loads((tmp_path / "cells/q/stale/s4/seed0/status.json").read_text())
    assert stored["time"] == parts


def test_bench_verbose_prints_the_breakdown_and_writes_it_to_timing_json(tmp_path, capsys):
    suite = {"name": "tiny", "steps": 15, "warmup": 2,
             "tasks": {"q": {"objective": "quadratic", "params": {"optimizer": "sgd", "lr": 0.1}}},
             "methods": ["sync", "stale"], "staleness": [0, 4], "seeds": [0]}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(suite))
    out = tmp_path / "out"
    assert main(["bench", "--suite", str(path), "--workers", "1", "--out", str(out), "--verbose"]) == 0
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "where the time went (1 worker(s) x" in printed
    for name in PARTS:
        assert f" {name} " in printed
    timing = json.loads(Path(out / "timing.json").read_text())
    # the parts are laid on Unix times (resolution about 2.4e-7 s today), the wall on the performance counter
    assert sum(timing["parts"].values()) == pytest.approx(timing["wall_s"] * timing["workers"], abs=1e-5)
    assert timing["parts"]["steps"] == pytest.approx(timing["step_s"], abs=1e-5)


def test_cells_run_longest_first_within_an_engine_group_with_reference_cells_before_all():
    def c(method, s, seed, steps=60, lr=1.0):
        return {"task": "t", "objective": "quadratic", "params": {"lr": lr}, "steps": steps, "method": method,
                "staleness": s, "seed": seed}

    cells = [c("sync", 0, 0), c("sync", 0, 1), c("stale", 16, 0), c("gac", 16, 0), c("sync", 0, 0, lr=2.0),
             c("stale", 16, 0, steps=90), c("stale", 16, 0, lr=2.0)]
    got = [(x["method"], x["staleness"], x["seed"], x["steps"], x["params"]["lr"]) for x in order_cells(cells)]
    assert got == [("stale", 16, 0, 90, 1.0), ("stale", 16, 0, 60, 1.0), ("gac", 16, 0, 60, 1.0),
                   ("sync", 0, 0, 60, 1.0), ("sync", 0, 1, 60, 1.0),  # lr=1 group: longest first, order of ties kept
                   ("stale", 16, 0, 60, 2.0), ("sync", 0, 0, 60, 2.0)]  # the lr=2 group after it
    calibrated = [c("sync", 0, 0), c("stale", 16, 0), c("gac-calibrated", 16, 0), c("sync", 0, 1)]
    got = [(x["method"], x["seed"]) for x in order_cells(calibrated)]
    assert got == [("sync", 0), ("stale", 0), ("gac-calibrated", 0), ("sync", 1)]  # seed 0's sync is a reference


def test_a_pool_worker_registers_an_exit_that_flushes_its_output_and_skips_the_teardown(monkeypatch):
    import atexit
    import io
    import sys

    from gacbench.bench import executors

    registered, exits = [], []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(executors, "die_with_parent", lambda parent_pid: None)
    monkeypatch.setattr(executors.signal, "signal", lambda signum, handler: None)  # keep this process's SIGINT
    import torch

    executors.init_worker(torch.get_num_threads())  # this process's thread count stays as it is
    assert registered == [executors.exit_without_teardown]
    out = io.StringIO()
    flushed = []
    out.flush = lambda: flushed.append(True)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(executors.os, "_exit", exits.append)
    executors.exit_without_teardown()
    assert flushed and exits == [0]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_engine_start_pauses_the_collector_and_restores_it_also_after_an_error(enabled):
    import gc

    from gacbench.rollout.engines import _collector_paused

    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        with _collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled
        with pytest.raises(RuntimeError), _collector_paused():
            raise RuntimeError("vLLM could not start")
        assert gc.isenabled() == enabled
    finally:
        gc.enable() if was else gc.disable()


# -- the command line's imports ---------------------------------------------------------------------


def test_the_command_line_imports_neither_torch_nor_lightning_before_a_command_runs():
    import subprocess
    import sys

    code = ("import sys\nimport gacbench, gacbench.cli, gacbench.bench.timing, gacbench.bench.workers, gacbench.llm\n"
            "gacbench.cli.build_parser()\n"
            "from gacbench.objectives import registered_objectives\n"
            "assert {'quadratic', 'bandit', 'grpo'} <= set(registered_objectives()), registered_objectives()\n"
            "heavy = sorted(m for m in ('torch', 'lightning', 'transformers', 'scipy') if m in sys.modules)\n"
            "assert not heavy, heavy\n"
            "from gacbench import GAC\n"
            "from gacbench.objectives import NoisyQuadratic, objective_class\n"
            "assert objective_class('quadratic') is NoisyQuadratic and GAC.__module__ == 'gacbench.callbacks.gac'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


# -- the run seen from outside the process ----------------------------------------------------------


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_the_process_start_is_read_from_proc_before_the_process_runs_any_code(tmp_path):
    import subprocess
    import sys
    import time

    # the child sleeps 1 s before it reads its start: a start taken from its own clock would be 1 s late
    code = ("import time; time.sleep(1.0)\n"
            "from gacbench.bench.timing import process_start\n"
            "r = process_start(time.time(), 'fallback'); print(r['process_started_at'], r['process_clock'])\n")
    before = time.time()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    started, clock = proc.stdout.split()
    assert clock == "proc"
    assert before - 0.05 <= float(started) <= before + 0.5  # the ticks are 10 ms; the child starts at once


def test_the_process_start_falls_back_where_proc_is_missing_or_reads_a_later_moment(monkeypatch):
    from gacbench.bench import timing

    monkeypatch.setattr(timing, "proc_started_at", lambda: None)
    assert timing.process_start(50.0, "cli-import") == {"process_started_at": 50.0, "process_clock": "cli-import"}
    monkeypatch.setattr(timing, "proc_started_at", lambda: 51.0)  # after a moment the process reached: wrong
    assert timing.process_start(50.0, "cli-import")["process_clock"] == "cli-import"
    monkeypatch.setattr(timing, "proc_started_at", lambda: 47.5)
    assert timing.process_start(50.0, "cli-import") == {"process_started_at": 47.5, "process_clock": "proc"}
    monkeypatch.setattr(timing, "proc_started_at", lambda: 50.01)  # within a clock tick: the fallback's moment
    assert timing.process_start(50.0, "cli-import") == {"process_started_at": 50.0, "process_clock": "proc"}
    # a fallback taken right after the interpreter's start bounds the start from below too
    monkeypatch.setattr(timing, "proc_started_at", lambda: 47.5)
    assert timing.process_start(50.0, "cli-import", max_before_s=2.0) == {"process_started_at": 50.0,
                                                                          "process_clock": "cli-import"}
    monkeypatch.setattr(timing, "proc_started_at", lambda: 48.5)
    assert timing.process_start(50.0, "cli-import", max_before_s=2.0) == {"process_started_at": 48.5,
                                                                          "process_clock": "proc"}


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("shell_first_s", [0.0, 3.0])
def test_the_command_lines_start_is_its_own_when_a_shell_execs_it(tmp_path, shell_first_s):
    """A shell that execs the command in place of itself (``bash -c 'cd DIR && gacbench bench ...'``) hands it its
    process id and start: the command line's start leaves out what the shell ran before, and is /proc's otherwise."""
    import shutil
    import subprocess
    import sys
    import time

    shell = shutil.which("sh")
    if shell is None:
        pytest.skip("no sh")
    code = "from gacbench import cli; r = cli.process_started(); print(r['process_started_at'], r['process_clock'])"
    before = time.time()
    proc = subprocess.run([shell, "-c", f'sleep {shell_first_s} && exec "$0" -c "$1"', sys.executable, code],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    started, clock = proc.stdout.split()
    assert clock == ("proc" if shell_first_s == 0 else "cli-import")
    assert before + shell_first_s - 0.05 <= float(started) <= time.time()


def test_the_outside_figures_add_up_from_process_start_to_the_written_report():
    from gacbench.bench.timing import outside_fields, startup_fields

    # the process starts at 100; the grid at 106 with two cells (110-150, 112-160); the report is written at 170
    results = [_cell(7, 110.0, 150.0, setup=2.0, steps=30.0), _cell(8, 112.0, 160.0, steps=36.0)]
    inside = {"ran": 2, **timing_record(results, wall=55.0, workers=2, grid_started_at=106.0)}
    early = {**inside, **startup_fields(results, {"process_started_at": 100.0, "process_clock": "proc"})}
    assert (early["startup_s"], early["first_cell_started_at"], early["last_cell_ended_at"]) == (10.0, 110.0, 160.0)
    assert early["outside_wall_s"] is None and early["outside_step_share"] is None and early["report_s"] is None
    assert "timing.json" in early["outside_pending"]
    done = outside_fields(early, ended_at=170.0)
    assert "outside_pending" not in done and "outside_pending" in early  # the record given is left as it was
    assert (done["outside_wall_s"], done["report_s"]) == (70.0, 10.0)
    assert done["outside_step_share"] == pytest.approx(66.0 / (70.0 * 2))
    assert done["startup_s"] + (done["last_cell_ended_at"] - done["first_cell_started_at"]) + done["report_s"] \
        == pytest.approx(done["outside_wall_s"])
    assert done["step_share"] == pytest.approx(66.0 / (55.0 * 2))
    assert done["step_share"] > done["outside_step_share"]
    line = timing_lines(done)[0]
    assert line.startswith("step share 60% of the grid's wall, 47% of the process's: 66.0 s of optimizer steps")
    assert "70.0 s from process start to the written report (start-up 10.0 s, report 10.0 s" in line
    assert timing_lines(early)[0].startswith("step share 60%: ")  # before the report: the grid's share alone
    nothing = startup_fields([], {"process_started_at": 100.0, "process_clock": "proc"})
    assert nothing["startup_s"] is None and nothing["first_cell_started_at"] is None


def test_a_record_whose_run_stopped_before_its_report_says_so_in_the_summary_note():
    """A timing.json still pending for the outside figures: while its process runs (this one) the note points to
    timing.json; once that process is gone (a run killed in its report, which no later run completes) it says that
    share was not measured."""
    import subprocess
    import sys

    from gacbench.bench.tables import _step_share_note
    from gacbench.bench.timing import startup_fields, stopped_before_report

    results = [_cell(7, 110.0, 150.0, steps=30.0)]
    record = {"ran": 1, **timing_record(results, wall=45.0, workers=1, grid_started_at=106.0),
              **startup_fields(results, {"process_started_at": 100.0, "process_clock": "proc"})}
    assert not stopped_before_report(record) and "in timing.json" in _step_share_note(record)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stopped = {**record, "pid": int(gone.stdout)}
    assert stopped_before_report(stopped)
    assert "10 s of start-up before its first cell; it stopped before its report, so its share from the process's " \
           "start was not measured" in _step_share_note(stopped)
    assert not stopped_before_report({**stopped, "outside_pending": None})  # completed: nothing pending
    assert not stopped_before_report({**stopped, "host": "another-host"})  # its pids are not this host's


def _tiny_suite(tmp_path: Path) -> Path:
    suite = {"name": "tiny", "steps": 15, "warmup": 2,
             "tasks": {"q": {"objective": "quadratic", "params": {"optimizer": "sgd", "lr": 0.1}},
                       "b": {"objective": "bandit", "params": {"optimizer": "adamw", "lr": 0.05}}},
             "methods": ["sync", "stale"], "staleness": [0, 4], "seeds": [0]}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(suite))
    return path


def test_bench_on_two_workers_records_the_run_from_process_start_in_timing_json(tmp_path, capsys):
    import os
    import signal

    out = tmp_path / "out"
    handler = signal.getsignal(signal.SIGINT)
    assert main(["bench", "--suite", str(_tiny_suite(tmp_path)), "--workers", "2", "--threads", "1",
                 "--out", str(out)]) == 0
    assert signal.getsignal(signal.SIGINT) is handler  # the fork server's start left this process's handler
    printed = " ".join(capsys.readouterr().out.split())
    timing = json.loads((out / "timing.json").read_text())
    statuses = [json.loads(p.read_text()) for p in out.glob("cells/**/status.json")]
    assert timing["ran"] == len(statuses) == 4 and os.getpid() not in {s["worker_pid"] for s in statuses}
    assert timing["process_clock"] in ("proc", "cli-import")
    assert timing["outside_wall_s"] >= timing["wall_s"] > 0
    assert timing["startup_s"] >= 0 and timing["report_s"] >= 0
    assert timing["process_started_at"] <= timing["first_cell_started_at"] <= timing["last_cell_ended_at"]
    assert timing["first_cell_started_at"] == min(s["started_at"] for s in statuses)
    assert timing["last_cell_ended_at"] == max(s["ended_at"] for s in statuses)
    assert 0 < timing["outside_step_share"] <= timing["step_share"]
    assert timing["outside_step_share"] == pytest.approx(timing["step_s"] / (timing["outside_wall_s"] * 2))
    assert timing["startup_s"] + timing["last_cell_ended_at"] - timing["first_cell_started_at"] + timing["report_s"] \
        == pytest.approx(timing["outside_wall_s"])
    assert "outside_pending" not in timing
    # summary.json was written before the report ended: it has the start-up and says where the rest is
    early = json.loads((out / "summary.json").read_text())["timing"]
    assert early["startup_s"] == timing["startup_s"] and early["step_share"] == timing["step_share"]
    assert early["outside_wall_s"] is None and early["outside_step_share"] is None
    assert "timing.json" in early["outside_pending"]
    assert f"{timing['outside_step_share']:.0%} of the process's" in printed
    assert f"step share {timing['step_share']:.0%} of the grid's wall" in printed


def test_workers_forked_from_the_fork_server_compute_what_spawned_workers_compute(tmp_path, monkeypatch):
    import csv

    from gacbench.bench import workers
    from gacbench.bench.runner import expand_cells, load_suite, run_grid

    if workers.START_METHOD != "forkserver":
        pytest.skip("the pool spawns on this platform")
    cells = expand_cells(load_suite(str(_tiny_suite(tmp_path))))
    assert run_grid(cells, tmp_path / "forked", workers=2, threads=1)["failed"] == 0
    monkeypatch.setattr(workers, "START_METHOD", "spawn")
    assert run_grid(cells, tmp_path / "spawned", workers=2, threads=1)["failed"] == 0
    compared = 0
    for forked in sorted((tmp_path / "forked").glob("cells/**/metrics.csv")):
        spawned = tmp_path / "spawned" / forked.relative_to(tmp_path / "forked")
        a, b = list(csv.DictReader(forked.open())), list(csv.DictReader(spawned.open()))
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):
            for key in x:
                if not key.startswith(("time/", "throughput/")):
                    assert x[key] == y[key], (forked, key)
                    compared += 1
    assert compared > 100
