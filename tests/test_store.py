"""The cell store and the grid runner under stress: concurrent runners, provenance, signals, a full disk,
settings mixed in one directory, and the done check."""

import csv
import errno
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import alive, bench, child_pids, quadratic_suite, squash

from gacbench.bench import cell as cell_mod
from gacbench.bench.cell import (
    CLAIM_FILE,
    CellMismatchError,
    cell_dir,
    claim,
    metrics_problem,
    run_cell,
    stored_done,
)
from gacbench.bench.runner import expand_cells, load_suite, order_cells, run_grid
from gacbench.cli import main
from gacbench.jsonio import remove_stray_temporaries, write_json
from gacbench.provenance import environment_key, provenance

REPO = Path(__file__).resolve().parents[1]
CELL = {"task": "q", "objective": "quadratic", "params": {"lr": 0.1}, "steps": 6, "method": "sync", "staleness": 0,
        "seed": 0}






def tiny_suite(tmp_path: Path, name: str = "tiny.yaml", **over) -> Path:
    return quadratic_suite(tmp_path, name, **{"methods": ["sync", "stale"], **over})


def steps_of(metrics: Path) -> list[int]:
    rows = metrics.read_text().splitlines()
    at = rows[0].split(",").index("step")
    return [int(float(r.split(",")[at])) for r in rows[1:] if r]


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "400", **extra}






def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# -- claims: a cell runs in one process at a time --------------------------------------------------------
def test_a_cell_another_process_holds_is_left_to_it_and_run_once_released(tmp_path):
    d = cell_dir(tmp_path, CELL)
    with claim(d) as holder:
        assert holder is None  # this block holds it: another open of the lock file is another holder
        got = run_cell(CELL, tmp_path)
        assert got["status"] == "claimed" and got["holder"]["pid"] == os.getpid()
        assert not (d / "status.json").exists() and not (d / "config.json").exists()
    assert run_cell(CELL, tmp_path)["status"] == "done"
    again = run_cell(CELL, tmp_path)
    assert again["status"] == "done" and again["reused"] is True


def test_a_claim_left_by_a_killed_process_is_taken_over(tmp_path):
    d = cell_dir(tmp_path, CELL)
    d.mkdir(parents=True)
    (d / CLAIM_FILE).write_text(json.dumps({"pid": dead_pid(), "host": "here", "since": 0}))
    status = run_cell(CELL, tmp_path)
    assert status["status"] == "done" and status["worker_pid"] == os.getpid()
    assert json.loads((d / CLAIM_FILE).read_text())["pid"] == os.getpid()


def test_the_grid_waits_for_a_cell_another_runner_holds_and_reuses_what_it_stored(tmp_path):
    cells = expand_cells(load_suite(str(tiny_suite(tmp_path))))
    elsewhere = tmp_path / "elsewhere"
    stored = run_cell(cells[0], elsewhere)  # what the other runner will store
    out = tmp_path / "out"
    held, release = threading.Event(), threading.Event()

    def other_runner() -> None:
        d = cell_dir(out, cells[0])
        with claim(d):
            held.set()
            release.wait(60)
            for name in ("config.json", "metrics.csv", "status.json"):
                (d / name).write_bytes((cell_dir(elsewhere, cells[0]) / name).read_bytes())

    t = threading.Thread(target=other_runner)
    t.start()
    assert held.wait(30)
    threading.Timer(1.0, release.set).start()
    t0 = time.perf_counter()
    timing = run_grid(cells, out)
    t.join()
    assert time.perf_counter() - t0 >= 1.0  # it waited for the holder
    assert (timing["ran"], timing["skipped_done"], timing["failed"]) == (len(cells) - 1, 1, 0)
    assert json.loads((cell_dir(out, cells[0]) / "status.json").read_text())["final"] == stored["final"]


def test_a_held_cell_whose_holder_ends_without_storing_it_is_run_by_the_waiting_runner(tmp_path):
    cells = expand_cells(load_suite(str(tiny_suite(tmp_path))))
    out = tmp_path / "out"
    held = threading.Event()

    def killed_runner() -> None:
        with claim(cell_dir(out, cells[0])):
            held.set()
            time.sleep(1.0)

    t = threading.Thread(target=killed_runner)
    t.start()
    assert held.wait(30)
    timing = run_grid(cells, out)
    t.join()
    assert (timing["ran"], timing["skipped_done"], timing["failed"]) == (len(cells), 0, 0)
    assert stored_done(out, cells[0]) is not None


@pytest.mark.slow
def test_three_concurrent_runners_on_one_out_run_every_cell_exactly_once(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "gacbench.cli", "bench", "--suite", "synthetic-smoke", "--out", str(out),
           "--tasks", "quadratic", "--methods", "sync,stale,gac", "--staleness", "0,16", "--seeds", "0,1",
           "--workers", "1"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
             for _ in range(3)]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (stdout, stderr) in zip(procs, outputs):
        assert p.returncode == 0, stderr[-3000:]
    ran = {p.pid: int(re.search(r"ran (\d+) cells", squash(o)).group(1)) for p, (o, _) in zip(procs, outputs)}
    statuses = sorted(out.glob("cells/**/status.json"))
    assert len(statuses) == 6 and sum(ran.values()) == 6  # each cell run by exactly one runner
    by_pid: dict[int, int] = {}
    for path in statuses:
        status = json.loads(path.read_text())
        assert status["status"] == "done"
        by_pid[status["worker_pid"]] = by_pid.get(status["worker_pid"], 0) + 1
        rows = (path.parent / "metrics.csv").read_text().splitlines()
        assert len(rows) == len(set(rows))  # a second run interleaved would repeat the seeded run's rows
        assert set(steps_of(path.parent / "metrics.csv")) == set(range(301))  # 300 steps, then the final eval
    assert by_pid == {pid: n for pid, n in ran.items() if n}
    summary = json.loads((out / "summary.json").read_text())
    keys = [(c["task"], c["method"], c["staleness"], c["seed"]) for c in summary["cells"]]
    assert len(keys) == len(set(keys)) == 6 and all(c["status"] == "done" for c in summary["cells"])
    assert not list(out.rglob("*.tmp"))


# -- provenance -----------------------------------------------------------------------------------------
def test_a_cell_records_its_provenance_with_the_thread_count_it_ran_with(tmp_path):
    """In a fresh process (a process that has loaded vLLM may keep its own thread count), a cell run with one
    thread records one thread, and otherwise this process's provenance."""
    script = ("import json, sys; from gacbench.bench.cell import run_cell; from gacbench.provenance import provenance; "
              "run_cell(json.loads(sys.argv[1]), sys.argv[2], threads=1); print(json.dumps(provenance()))")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    res = subprocess.run([sys.executable, "-c", script, json.dumps(CELL), str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    config = json.loads((cell_dir(tmp_path, CELL) / "config.json").read_text())
    assert config["provenance"] == json.loads(res.stdout.splitlines()[-1]) and config["provenance"]["threads"] == 1
    assert config["provenance"]["source_sha256"] == provenance()["source_sha256"]
    assert {k: config[k] for k in CELL} == CELL
    assert "provenance" not in cell_mod.IDENTITY_KEYS


def test_a_cell_whose_library_files_changed_while_it_ran_records_both_hashes(tmp_path, monkeypatch):
    """A process hashes the library once, and imports some modules only when a cell first needs them: a cell that
    ends with the files changed (a checkout edited while a grid runs) records the new hash beside the old, and
    its environment key names both, so it is counted as neither version."""
    import shutil

    import gacbench.provenance as prov_mod
    from gacbench.provenance import environment_key

    before = prov_mod.source_sha256()  # this process's hash, taken before the edit
    copy = tmp_path / "lib"
    shutil.copytree(prov_mod.PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "objectives" / "logistic.py").write_text((copy / "objectives" / "logistic.py").read_text() + "\n# edit\n")
    monkeypatch.setattr(prov_mod, "PACKAGE_DIR", copy)  # the files on disk as they are after the edit
    run_cell(CELL, tmp_path / "out")
    recorded = json.loads((cell_dir(tmp_path / "out", CELL) / "config.json").read_text())["provenance"]
    after = prov_mod.source_sha256.__wrapped__()
    assert recorded["source_sha256"] == before and recorded["source_sha256_end"] == after != before
    assert f"src {before[:12]} changed to {after[:12]} " in environment_key(recorded)
    monkeypatch.setattr(prov_mod, "PACKAGE_DIR", prov_mod.Path(prov_mod.__file__).resolve().parent)
    run_cell({**CELL, "seed": 1}, tmp_path / "out")  # unchanged files: nothing more recorded
    again = json.loads((cell_dir(tmp_path / "out", {**CELL, "seed": 1}) / "config.json").read_text())["provenance"]
    assert "source_sha256_end" not in again and " changed to " not in environment_key(again)
    gone = tmp_path / "gone"  # a file removed while the library is listed (a checkout switching branches)
    gone.mkdir()
    (gone / "removed.py").symlink_to(gone / "nowhere.py")
    monkeypatch.setattr(prov_mod, "PACKAGE_DIR", gone)
    assert prov_mod.source_changed(before) == "unreadable"


def test_weights_sha256_reads_every_weight_file_and_names_a_directory_without_one(tmp_path):
    import hashlib

    from gacbench.provenance import weights_sha256

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no weight files .*save_pretrained"):
        weights_sha256(tmp_path)
    (tmp_path / "model-00002.safetensors").write_bytes(b"bb")
    (tmp_path / "model-00001.safetensors").write_bytes(b"a")
    expected = hashlib.sha256(b"model-00001.safetensors\0a\0model-00002.safetensors\0bb\0").hexdigest()
    assert weights_sha256(tmp_path) == expected
    (tmp_path / "config.json").write_text('{"x": 1}')  # not a weight file
    assert weights_sha256(tmp_path) == expected
    (tmp_path / "model-00002.safetensors").write_bytes(b"bc")  # one byte of the weights
    assert weights_sha256(tmp_path) != expected


def test_the_instruction_set_is_recorded_and_tells_two_machines_apart():
    prov = provenance()
    assert prov["isa"] == torch.backends.cpu.get_cpu_capability()
    assert prov["cpu_flags"] is None or all(f.startswith(("avx", "fma", "f16c", "amx")) for f in prov["cpu_flags"])
    intel = {**prov, "isa": "AVX2", "cpu_vendor": "GenuineIntel"}
    amd, avx512 = {**intel, "cpu_vendor": "AuthenticAMD"}, {**intel, "isa": "AVX512"}
    assert environment_key(intel).endswith("isa AVX2 GenuineIntel")
    assert environment_key(amd).endswith("isa AVX2 AuthenticAMD")
    assert len({environment_key(intel), environment_key(amd), environment_key(avx512)}) == 3
    unnamed = {**intel, "cpu_vendor": None}  # stored before the vendor was recorded: its key is unchanged
    assert environment_key(unnamed).endswith("isa AVX2")
    legacy = {k: v for k, v in prov.items() if k not in ("isa", "cpu_vendor", "cpu_model", "cpu_flags")}
    assert " isa " not in environment_key(legacy)  # a run stored before it was recorded keeps its key


def test_the_cpu_vendor_is_read_from_cpuinfo(monkeypatch):
    import gacbench.provenance as prov_mod

    text = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma sse\n\n" \
           "processor\t: 1\nvendor_id\t: GenuineIntel\n"
    real = prov_mod.Path.read_text
    monkeypatch.setattr(prov_mod.Path, "read_text",
                        lambda self, *a, **k: text if str(self) == "/proc/cpuinfo" else real(self, *a, **k))
    prov_mod.cpu_description.cache_clear()
    try:
        cpu = prov_mod.cpu_description()
    finally:
        prov_mod.cpu_description.cache_clear()
    assert (cpu["cpu_vendor"], cpu["cpu_model"], cpu["cpu_flags"]) == ("AuthenticAMD", "AMD EPYC", ["avx2", "fma"])


def test_cells_from_another_environment_are_counted_kept_and_recomputed_on_request(tmp_path, capsys):
    suite, out = tiny_suite(tmp_path, seeds=[0, 1]), tmp_path / "out"
    before = torch.get_num_threads()
    try:
        assert bench(suite, out) == 0
        cells = expand_cells(load_suite(str(suite)))
        other, unrecorded = cell_dir(out, cells[0]), cell_dir(out, cells[1])
        config = json.loads((other / "config.json").read_text())
        config["provenance"]["packages"]["torch"] = "0.0.1"
        (other / "config.json").write_text(json.dumps(config))
        config = json.loads((unrecorded / "config.json").read_text())
        del config["provenance"]
        (unrecorded / "config.json").write_text(json.dumps(config))
        mtimes = {p: p.stat().st_mtime_ns for p in out.glob("cells/**/status.json")}
        capsys.readouterr()
        assert bench(suite, out) == 0
        said = squash(capsys.readouterr().out)
        assert "2 stored done cell(s) of this grid come from another environment (1 from src" in said
        assert "torch 0.0.1" in said and "1 unrecorded" in said and "--rerun-other-versions recomputes them" in said
        assert "ran 0 cells (4 already done" in said
        assert mtimes == {p: p.stat().st_mtime_ns for p in out.glob("cells/**/status.json")}
        assert bench(suite, out, "--rerun-other-versions") == 0
        assert "ran 2 cells (2 already done" in squash(capsys.readouterr().out)
        here = environment_key({**provenance(), "threads": max(1, (os.cpu_count() or 1))})
        for d in (other, unrecorded):
            assert environment_key(json.loads((d / "config.json").read_text())["provenance"]) == here
            assert (d / "status.json").stat().st_mtime_ns != mtimes[d / "status.json"]
        for p, t in mtimes.items():
            if p.parent not in (other, unrecorded):
                assert p.stat().st_mtime_ns == t
    finally:
        torch.set_num_threads(before)


def test_threads_sets_each_workers_thread_count_which_the_cells_record_and_a_rerun_compares(tmp_path):
    """--threads overrides cores // --workers: the header line names the count, every cell records it, and a
    rerun with another count counts the stored cells as another environment. Fresh processes: a process that
    has loaded vLLM may keep its own thread count."""
    suite, out = tiny_suite(tmp_path), tmp_path / "out"

    def run(threads: int) -> str:
        res = subprocess.run([sys.executable, "-m", "gacbench.cli", "bench", "--suite", str(suite), "--out", str(out),
                              "--workers", "1", "--threads", str(threads)], capture_output=True, text=True, env=env(),
                             timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        return squash(res.stdout)

    said = run(1)
    assert "(workers=1, threads=1 each" in said and "ran 2 cells" in said
    configs = [json.loads(p.read_text()) for p in out.glob("cells/**/config.json")]
    assert len(configs) == 2 and {c["provenance"]["threads"] for c in configs} == {1}
    said = run(2)
    assert "(workers=1, threads=2 each" in said
    assert "2 stored done cell(s) of this grid come from another environment" in said
    assert "threads 1" in said and "ran 0 cells (2 already done" in said
    said = run(1)
    assert "another environment" not in said and "ran 0 cells (2 already done" in said


def test_default_threads_resume_command_and_bad_thread_counts(tmp_path, capsys, monkeypatch):
    from gacbench.bench.runner import resume_command, worker_threads
    from gacbench.cli import build_parser
    from gacbench.usage import UsageError

    args = build_parser().parse_args(
        ["bench", "--suite", "llm-smoke", "--out", "o", "--workers", "1", "--threads", "1"])
    assert "--workers 1 --threads 1" in resume_command(args)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert [worker_threads(1), worker_threads(2), worker_threads(8), worker_threads(2, 3)] == [4, 2, 1, 3]
    with pytest.raises(UsageError, match="--threads 0 must be >= 1"):
        worker_threads(1, 0)
    with pytest.raises(SystemExit):
        main(["bench", "--suite", "llm-smoke", "--out", str(tmp_path), "--threads", "0"])
    assert "--threads" in capsys.readouterr().err


# -- SIGINT / SIGTERM -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("signum,workers,executor", [(signal.SIGINT, "2", "local"), (signal.SIGTERM, "1", "local"),
                                                     (signal.SIGINT, "2", "ray"), (signal.SIGTERM, "2", "ray")])
def test_a_signal_stops_the_grid_promptly_writes_the_summary_and_the_rerun_resumes(tmp_path, signum, workers,
                                                                                   executor):
    if executor == "ray":
        pytest.importorskip("ray")
    suite = tiny_suite(tmp_path, steps=300 if executor == "local" else 3000, seeds=[0, 1, 2])
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "gacbench.cli", "bench", "--suite", str(suite), "--out", str(out),
           "--workers", workers, "--executor", executor]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env())
    deadline = time.time() + 180
    if executor == "local":
        while time.time() < deadline and not list(out.glob("cells/**/status.json")):
            time.sleep(0.1)
        assert list(out.glob("cells/**/status.json")), "no cell finished"
    while time.time() < deadline and len(list(out.glob("cells/**/config.json"))) <= \
            len(list(out.glob("cells/**/status.json"))):
        time.sleep(0.05)  # a cell in flight
    if executor == "ray":
        time.sleep(1.0)  # the runner waits in ray.wait, where Ray's Cython code receives the handler's raise
    workers_before = child_pids(proc.pid)
    t0 = time.time()
    proc.send_signal(signum)
    stdout, _ = proc.communicate(timeout=60)
    took = time.time() - t0
    assert proc.returncode == 128 + signum, stdout[-3000:]
    assert took < 15, f"stopping took {took:.1f} s"
    total = len(expand_cells(load_suite(str(suite))))
    done = len(list(out.glob("cells/**/status.json")))
    assert done < total
    said = squash(stdout)
    assert f"stopped by {signal.Signals(signum).name}: {done} of {total} cells done" in said
    assert f"resume with: gacbench bench --suite {suite} --out {out}" in said and "Traceback" not in stdout
    assert len(json.loads((out / "summary.json").read_text())["cells"]) >= done
    time.sleep(0.5)
    assert not [p for p in workers_before if alive(p)]
    kept = {p: p.stat().st_mtime_ns for p in out.glob("cells/**/status.json")}
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env())
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"ran {total - done} cells ({done} already done" in squash(rerun.stdout)
    assert kept == {p: p.stat().st_mtime_ns for p in kept}


def grid_with_a_cell_in_flight(tmp_path: Path, timeout: float = 180) -> tuple[subprocess.Popen, Path, int]:
    """A grid of 8 long cells on 2 pool workers, started in a child process: (the runner, --out, the pid of a
    worker running a cell, read from the cell's claim)."""
    suite = tiny_suite(tmp_path, steps=4000, seeds=[0, 1, 2, 3])
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "gacbench.cli", "bench", "--suite", str(suite), "--out", str(out), "--workers", "2",
           "--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env())
    deadline = time.time() + timeout
    while time.time() < deadline:
        for record in out.glob("cells/*/*/*/*/.claim"):
            if not (record.parent / "status.json").exists() and record.read_text().strip():
                return proc, out, json.loads(record.read_text())["pid"]
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("no cell in flight")


@pytest.mark.slow
def test_sigterm_to_one_pool_worker_stops_the_grid_naming_its_cell_and_writes_the_summary(tmp_path):
    # the worker's fit turns SIGTERM into Lightning's SIGTERMException (a SystemExit): not the cell's failure, and
    # not a silent exit 0 of the runner
    proc, out, worker = grid_with_a_cell_in_flight(tmp_path)
    time.sleep(1.0)  # most likely inside the cell's fit by now (a cell of 4000 steps runs for several seconds)
    os.kill(worker, signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, stdout[-3000:]
    said = squash(stdout)
    # inside the fit the cell is named; a signal before the fit (the default action ends the process and breaks
    # the pool) names the worker only
    assert ("stopped by SIGTERM sent to the worker process running quadratic/" in said
            or "stopped by SIGTERM sent to a worker process:" in said) and "Traceback" not in stdout
    done = len(list(out.glob("cells/**/status.json")))
    assert f"{done} of 8 cells done and stored" in said
    assert len(json.loads((out / "summary.json").read_text())["cells"]) == done
    assert all(json.loads(p.read_text())["status"] == "done" for p in out.glob("cells/**/status.json"))


@pytest.mark.slow
def test_a_worker_killed_by_sigkill_ends_the_grid_in_one_line_with_the_summary(tmp_path):
    """The out-of-memory killer's SIGKILL leaves no result: one line naming the likely cause and the fix, exit 1,
    the summary of the stored cells, no traceback."""
    proc, out, worker = grid_with_a_cell_in_flight(tmp_path)
    os.kill(worker, signal.SIGKILL)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, stdout[-3000:]
    said = squash(stdout)
    assert "gacbench bench: a worker process died while running cells" in said and "rerun the same command" in said
    assert "Traceback" not in stdout
    done = len(list(out.glob("cells/**/status.json")))
    assert len(json.loads((out / "summary.json").read_text())["cells"]) == done


def test_a_signal_while_the_summary_is_written_ends_in_one_line_naming_gacbench_report(tmp_path, monkeypatch, capsys):
    from gacbench.bench import executors, runner

    suite = tiny_suite(tmp_path, steps=5, warmup=2, seeds=[0])
    out = tmp_path / "out"
    assert main(["bench", "--suite", str(suite), "--out", str(out), "--workers", "1"]) == 0
    capsys.readouterr()

    def interrupted(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(runner, "_write_summary", interrupted)
    monkeypatch.setattr(executors, "_stop_requested", None)
    assert main(["bench", "--suite", str(suite), "--out", str(out), "--workers", "1"]) == 130
    said = squash(capsys.readouterr().out)
    assert f"stopped by SIGINT while writing the summary; the cells are stored: `gacbench report {out}`" in said
    monkeypatch.setattr(executors, "_stop_requested", None)


def test_a_stop_whose_raise_python_drops_in_a_finalizer_is_raised_again_and_the_grid_checks_it(tmp_path):
    """The signal handler's GridInterrupted, raised while the main thread runs a ``__del__`` (a profiler's, a
    tensor's), is dropped by Python; the grid must stop all the same: at once, and before its next cell."""
    from gacbench.bench import executors, runner

    class Finalizer:
        def __del__(self):
            signal.raise_signal(signal.SIGTERM)  # the handler runs here, and its exception is dropped

    restore = runner._stop_on_signals()
    try:
        with pytest.raises(executors.GridInterrupted) as stopped:
            item = Finalizer()
            del item
            deadline = time.time() + 10
            while time.time() < deadline:  # raised again after 1 ms of CPU time
                sum(range(10_000))
        assert stopped.value.signum == signal.SIGTERM and executors.stop_requested() == signal.SIGTERM
        signal.raise_signal(signal.SIGINT)  # a second signal while the grid stops is ignored
        out = tmp_path / "out"
        cells = expand_cells(load_suite(str(tiny_suite(tmp_path))))
        with pytest.raises(executors.GridInterrupted):
            run_grid(cells, out, 1, "local")
        assert not list(out.glob("cells/**/config.json"))  # no cell started
    finally:
        restore()
    assert executors.stop_requested() is None and signal.getitimer(signal.ITIMER_VIRTUAL) == (0.0, 0.0)


# -- a full disk ----------------------------------------------------------------------------------------
def _fill_disk_on(monkeypatch, name: str) -> None:
    """Writes of ``name``'s temporary file put part of the text down, then fail as on a full disk."""
    real = pathlib.Path.write_text

    def write_text(self, data, *args, **kwargs):
        if self.name.startswith(f".{name}.") and self.name.endswith(".tmp"):
            real(self, data[: len(data) // 2], *args, **kwargs)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, data, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", write_text)


def test_write_json_on_a_full_disk_removes_its_temporary_and_names_the_file(tmp_path, monkeypatch):
    _fill_disk_on(monkeypatch, "x.json")
    with pytest.raises(OSError) as exc:
        write_json(tmp_path / "x.json", {"a": 1})
    assert exc.value.errno == errno.ENOSPC and exc.value.filename == str(tmp_path / "x.json")
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_ends_bench_and_report_with_one_line_and_no_temporaries(tmp_path, monkeypatch, capsys):
    suite, out = tiny_suite(tmp_path), tmp_path / "out"
    with monkeypatch.context() as m:
        _fill_disk_on(m, "status.json")
        assert bench(suite, out) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    first = cell_dir(out, order_cells(expand_cells(load_suite(str(suite))))[0])  # the first cell the runner runs
    assert err == [f"gacbench bench: error: cannot write {first / 'status.json'}: No space left on device (ENOSPC); "
                   "free space (or raise the quota) and rerun the same command: the finished cells are kept"]
    assert not list(out.rglob("*.tmp")) and not (first / "status.json").exists()
    assert bench(suite, out) == 0
    capsys.readouterr()
    with monkeypatch.context() as m:
        _fill_disk_on(m, "summary.json")
        assert main(["report", str(out)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"gacbench report: error: cannot write {out / 'summary.json'}: No "
                                               "space left on device (ENOSPC)")
    assert not list(out.rglob("*.tmp"))


def test_a_full_disk_inside_a_run_is_raised_not_recorded_as_the_cells_failure(tmp_path, monkeypatch):
    def full(cell, out):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(out / "metrics.csv"))

    monkeypatch.setattr(cell_mod, "_run", full)
    with pytest.raises(OSError) as exc:
        run_cell(CELL, tmp_path)
    assert exc.value.errno == errno.EDQUOT and not (cell_dir(tmp_path, CELL) / "status.json").exists()
    monkeypatch.setattr(cell_mod, "_run", lambda cell, out: 1 / 0)
    assert run_cell(CELL, tmp_path)["error"] == "ZeroDivisionError: division by zero"  # other errors: recorded


def test_stray_temporaries_of_dead_processes_are_removed_by_the_next_report(tmp_path, capsys):
    out = tmp_path / "out"
    run_cell(CELL, out)
    d = cell_dir(out, CELL)
    old = time.time() - 3600
    dead, young, live = (d / f".status.json.{dead_pid()}.tmp", d / f".config.json.{dead_pid()}.tmp",
                         d / f".status.json.{os.getppid()}.tmp")
    for path in (dead, young, live):
        path.write_text("{")
    os.utime(dead, (old, old))
    os.utime(live, (old, old))
    assert main(["report", str(out)]) == 0
    assert not dead.exists() and young.exists() and live.exists()
    assert remove_stray_temporaries(out, min_age_s=0) == [young]


# -- one setting per task in one directory --------------------------------------------------------------
def test_another_suites_settings_for_a_stored_task_are_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "out"
    assert bench(tiny_suite(tmp_path), out) == 0
    stored = sorted(out.glob("cells/**/status.json"))
    (tmp_path / "b").mkdir()
    other = tiny_suite(tmp_path / "b", steps=40, seeds=[1],
                       tasks={"quadratic": {"objective": "quadratic",
                                            "params": {"optimizer": "sgd", "lr": 0.05, "sigma2": 10.0,
                                                       "kappa": 10.0}}})
    capsys.readouterr()
    assert bench(other, out) == 2  # a usage error: one line, exit 2
    message = capsys.readouterr().err
    assert message.count("\n") == 1
    assert "params.lr: 0.1 (stored) -> 0.05 (now), in 2 cell(s)" in message
    assert "steps: 30 (stored) -> 40 (now), in 2 cell(s)" in message
    assert "cells of task(s) quadratic outside this grid" in message and "use another --out" in message
    assert sorted(out.glob("cells/**/status.json")) == stored and not list(out.glob("cells/**/seed1"))
    with pytest.raises(CellMismatchError, match="outside this grid"):  # the same refusal from the Python API
        run_grid(expand_cells(load_suite(str(other))), out)
    assert bench(tiny_suite(tmp_path / "b", seeds=[1]), out) == 0  # the same settings, other seeds: added


def test_the_checks_before_a_grid_read_each_done_cell_once(tmp_path, monkeypatch):
    from gacbench.bench import runner

    cells = expand_cells(load_suite(str(tiny_suite(tmp_path))))
    out = tmp_path / "out"
    assert run_grid(cells, out)["failed"] == 0
    reads = []

    def counted(root, c):
        reads.append(cell_dir(root, c))
        return stored_done(root, c)

    monkeypatch.setattr(cell_mod, "stored_done", counted)
    monkeypatch.setattr(runner, "stored_done", counted)
    assert run_grid(cells, out)["ran"] == 0
    # once, for the checks (settings against the stored cells, their environments) and the cells left to run
    assert sorted(reads) == sorted(cell_dir(out, c) for c in cells)


def test_a_resumed_grid_checks_each_stored_cell_once_before_it_runs_and_parses_each_metrics_file_once(
        tmp_path, monkeypatch, capsys):
    from gacbench.bench import figures as figures_mod
    from gacbench.bench import records as records_mod

    suite, out = tiny_suite(tmp_path, seeds=[0, 1]), tmp_path / "out"
    assert main(["bench", "--suite", str(suite), "--out", str(out)]) == 0
    checked: Counter = Counter()
    parsed: Counter = Counter()
    done_problem, read_metrics = cell_mod.done_problem, records_mod.read_metrics

    def counted_check(d, status):
        checked[d] += 1
        return done_problem(d, status)

    def counted_parse(path):
        parsed[path] += 1
        return read_metrics(path)

    monkeypatch.setattr(cell_mod, "done_problem", counted_check)
    monkeypatch.setattr(records_mod, "read_metrics", counted_parse)
    monkeypatch.setattr(figures_mod, "read_metrics", counted_parse)
    capsys.readouterr()
    # seed 0 is the grid; the seed-1 cells of its task are checked against it and join its summary
    assert main(["bench", "--suite", str(suite), "--out", str(out), "--seeds", "0"]) == 0
    ran = " ".join(capsys.readouterr().out.split())
    dirs = {p.parent for p in out.glob("cells/*/*/*/seed*/status.json")}
    assert len(dirs) == 2 * len(expand_cells(load_suite(str(suite)), seeds=[0]))
    assert f"({len(dirs) // 2} already done" in ran
    # once before the grid runs (its own cells by stored_done_files, the others by check_stored), once by the
    # report
    assert checked == {d: 2 for d in dirs}
    assert parsed == {d / "metrics.csv": 1 for d in dirs}
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(c["seed"] for c in summary["cells"]) == [0] * (len(dirs) // 2) + [1] * (len(dirs) // 2)


# -- the done check -------------------------------------------------------------------------------------
def test_a_metrics_csv_without_exactly_its_last_steps_row_is_not_done(tmp_path):
    status = run_cell(CELL, tmp_path)
    d = cell_dir(tmp_path, CELL)
    path = d / "metrics.csv"
    assert stored_done(tmp_path, CELL) is not None and metrics_problem(path, status["steps_run"]) is None
    lines = path.read_text().splitlines(keepends=True)
    at = lines[0].rstrip("\n").split(",").index("step")
    last = status["steps_run"] - 1
    kept = [line for line in lines[1:] if int(float(line.split(",")[at])) != last]
    # the last step's rows dropped (one per logging call at that step: the gradient's, then align/step_cos
    # after the optimizer's step, and DriftMonitor's param/* of the step before, logged at the number of steps
    # taken); rows after training (step 6) remain
    assert len(lines) - 1 - len(kept) == 3
    path.write_text(lines[0] + "".join(kept))
    assert metrics_problem(path, status["steps_run"]) == (f"{path} has no row for step {last}, the last of the "
                                                          f"{status['steps_run']} steps the run took")
    assert stored_done(tmp_path, CELL) is None
    assert run_cell(CELL, tmp_path).get("reused") is None  # recomputed
    assert last in steps_of(path)


def test_a_metrics_csv_without_the_drift_after_the_last_step_is_not_done(tmp_path):
    status = run_cell(CELL, tmp_path)
    path = cell_dir(tmp_path, CELL) / "metrics.csv"
    n = status["steps_run"]
    rows = list(csv.DictReader(path.open()))
    drift_at = [int(float(r["step"])) for r in rows if r["param/drift"] != ""]
    assert max(drift_at) == n  # DriftMonitor's update after the last step is logged at the number of steps taken
    lines = path.read_text().splitlines(keepends=True)
    header = lines[0].rstrip("\n").split(",")
    at, col = header.index("step"), header.index("param/drift")
    # that update's row dropped; the final evaluation's rows at step n stay, so step n still has rows
    kept = [line for line in lines[1:] if not (int(float(line.split(",")[at])) == n and line.split(",")[col] != "")]
    assert len(kept) == len(lines) - 2 and n in {int(float(line.split(",")[at])) for line in kept}
    path.write_text(lines[0] + "".join(kept))
    assert metrics_problem(path, n) == (f"{path} has no param/drift at step {n} (DriftMonitor's update after the "
                                        f"last of the {n} steps the run took)")
    assert stored_done(tmp_path, CELL) is None
    assert run_cell(CELL, tmp_path).get("reused") is None  # recomputed
    assert n in {int(float(r["step"])) for r in csv.DictReader(path.open()) if r["param/drift"] != ""}


def test_a_done_status_beside_incomplete_files_is_not_a_stored_done_cell(tmp_path):
    """stored_done_cells, which the one-setting-per-task and θ₀ checks read, leaves out a cell whose status says
    done but whose metrics.csv lacks rows of the steps it ran (a copy cut short): it is rerun, not compared."""
    from gacbench.bench.cell import stored_done_cells

    c = expand_cells(load_suite("llm-smoke"), methods=["sync"], seeds=[0])[0]
    d = cell_dir(tmp_path, c)
    d.mkdir(parents=True)
    write_json(d / "status.json", {"status": "done", "initial": 0.1, "final": 0.2, "diverged": False,
                                   "metric": "reward", "higher_is_better": True, "steps_run": 3, "cell": c})
    write_json(d / "config.json", c)
    (d / "metrics.csv").write_text("reward/mean,step\n0.1,0\n")  # 3 steps run, one row
    assert stored_done_cells(tmp_path, c["task"]) == []
    (d / "metrics.csv").write_text("reward/mean,step\n0.1,0\n0.2,1\n0.3,2\n")
    assert stored_done_cells(tmp_path, c["task"]) == [(d, c)]
