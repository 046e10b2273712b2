"""Bad input and damaged files: what the bench runner, the report and the command line do with them.

Each test reproduces one fault (docs/reliability.md lists them): user-fixable input ends as one line
``gacbench CMD: error: ...`` and exit status 2 before any work; a damaged cell is recomputed and never
counted as finished; the summary covers every stored cell."""

import json
import os
import time
from pathlib import Path

import pytest
import yaml
from conftest import bench, quadratic_suite

from gacbench.bench.cell import cell_dir
from gacbench.cli import UsageError, main


def tiny_suite(tmp_path: Path, name: str = "tiny.yaml", **over) -> Path:
    return quadratic_suite(tmp_path, name, **over)




def one_error_line(capsys, command: str) -> str:
    """The single error line a refused command printed (and no traceback)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"gacbench {command}: error: "), err
    return lines[0]


def statuses(out: Path) -> dict[str, str]:
    summary = json.loads((out / "summary.json").read_text())
    return {f"{c['method']}/s{c['staleness']}/seed{c['seed']}": c["status"] for c in summary["cells"]}


# -- the command line: user errors are one line and exit 2; bugs keep their traceback -------------------
@pytest.mark.parametrize("option,value,expected", [
    ("--seeds", "0,0", "--seeds '0,0' lists 0 twice"),
    ("--seeds", "", "--seeds is empty"),
    ("--seeds", "0,", "--seeds '0,' has an empty item"),
    ("--seeds", "-1", "--seeds '-1': -1 is not in 0..4294967295"),
    ("--staleness", "2.5", "--staleness '2.5': '2.5' is not an integer"),
    ("--staleness", "0,4,4", "--staleness '0,4,4' lists 4 twice"),
    ("--methods", "sync,stale,sync", "--methods 'sync,stale,sync' lists sync twice"),
    ("--methods", "gac(c_lo=0.1)", "gac has no setting 'c_lo'; did you mean 'c_low'?"),
    ("--methods", "stale,ablation", "'ablation' selects the suite's threshold-ablation cells, and suite 'tiny' has "
                                    "no ablation: section"),
    ("--tasks", "quadratic,quadratic", "--tasks 'quadratic,quadratic' lists quadratic twice"),
    ("--param", "lr=fast", "--param lr: lr takes a number, got the text 'fast'"),
    ("--param", "dim=1.5", "--param dim: dim takes an integer, got 1.5"),
])
def test_bad_grid_options_are_refused_in_one_line_before_anything_runs(tmp_path, capsys, option, value, expected):
    out = tmp_path / "out"
    assert bench(tiny_suite(tmp_path), out, f"{option}={value}") == 2
    assert expected in one_error_line(capsys, "bench")
    assert not out.exists()  # refused before the output directory was made


def test_a_staleness_the_run_cannot_reach_is_refused(tmp_path, capsys):
    assert bench(tiny_suite(tmp_path), tmp_path / "out", "--staleness", "0,30") == 2
    assert "staleness 30 of task 'quadratic' is not below its 30 steps" in one_error_line(capsys, "bench")
    assert bench(tiny_suite(tmp_path, staleness=[0, 4, 100]), tmp_path / "out") == 2  # from the suite too
    assert "staleness 100" in one_error_line(capsys, "bench")
    assert main(["demo", "--staleness", "400", "--steps", "300"]) == 2
    assert "--staleness 400 is not below --steps 300" in one_error_line(capsys, "demo")


@pytest.mark.parametrize("text,override,expected", [
    ("tasks: [\n", None, "is not valid YAML (line 2)"),
    ("", None, "is empty"),
    ("- a\n- b\n", None, "must be a mapping"),
    ("name: x\n", None, "has no 'tasks'"),
    (None, {"steps": "thirty"}, "steps: 'thirty' is not a positive integer"),
    (None, {"staleness": 16}, "staleness: 16 must be a non-empty list"),
    (None, {"seeds": [0, 0]}, "seeds: lists 0 twice"),
    (None, {"methods": ["sync", "nope"]}, "unknown method 'nope'"),
    (None, {"tasks": {"quadratic": {"objective": "quadratic", "params": {"lr": "1e-3"}}}},
     "lr takes a number, got the text '1e-3' (YAML reads 1e-3 as text: write 1.0e-3)"),
])
def test_a_bad_suite_file_is_named_with_the_fix(tmp_path, capsys, text, override, expected):
    suite = tmp_path / "bad.yaml"
    if override is None:
        suite.write_text(text)
    else:  # one key of a good suite replaced
        suite.write_text(yaml.safe_dump({**yaml.safe_load(tiny_suite(tmp_path).read_text()), **override}))
    assert bench(suite, tmp_path / "out") == 2
    line = one_error_line(capsys, "bench")
    assert expected in line and ("suite" in line)
    if "lr takes" not in expected:
        assert f"suite {suite}" in line


def test_an_out_that_is_a_file_or_not_writable_is_refused(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    assert bench(tiny_suite(tmp_path), afile) == 2
    assert f"--out {afile} is a file, not a folder" in one_error_line(capsys, "bench")
    assert afile.read_text() == "keep me"
    assert bench(tiny_suite(tmp_path), afile / "sub") == 2
    assert "cannot create or write this folder" in one_error_line(capsys, "bench")
    places = []
    if Path("/sys").is_dir():  # not writable, even for root
        places.append(Path("/sys/gacbench-test-out"))
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        places.append(ro / "out")
    for place in places:
        assert bench(tiny_suite(tmp_path), place) == 2
        assert f"--out {place}: cannot create or write this folder" in one_error_line(capsys, "bench")


def test_an_output_file_in_a_missing_folder_is_refused_before_the_work(tmp_path, capsys):
    missing = tmp_path / "no-such-folder" / "demo.json"
    t0 = time.perf_counter()
    assert main(["demo", "--steps", "20", "--staleness", "4", "--json", str(missing)]) == 2
    assert time.perf_counter() - t0 < 5  # before the three runs, not after
    line = one_error_line(capsys, "demo")
    assert f"--json {missing}: the folder {missing.parent} does not exist" in line
    assert main(["theory", "--json", str(tmp_path)]) == 2  # a folder where a file is expected
    assert f"--json {tmp_path} is a folder" in one_error_line(capsys, "theory")


def test_user_errors_exit_2_and_bugs_keep_their_traceback(tmp_path, capsys, monkeypatch):
    import gacbench.bench.runner as runner

    monkeypatch.setattr(runner, "load_suite", lambda name: (_ for _ in ()).throw(UsageError("--suite: bad\nsuite")))
    assert bench(tmp_path / "s.yaml", tmp_path / "out") == 2
    assert one_error_line(capsys, "bench") == "gacbench bench: error: --suite: bad suite"
    monkeypatch.setattr(runner, "load_suite", lambda name: (_ for _ in ()).throw(KeyError("a bug")))
    with pytest.raises(KeyError, match="a bug"):  # not a user error: the traceback is kept
        bench(tmp_path / "s.yaml", tmp_path / "out")
    with pytest.raises(SystemExit) as exit_:  # argparse's own type errors: exit status 2
        main(["bench", "--out", str(tmp_path), "--workers", "0"])
    assert exit_.value.code == 2
    assert "argument --workers: 0 must be a positive integer" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "holds no benchmark cells" in one_error_line(capsys, "report")


# -- stored cells -----------------------------------------------------------------------------------
def test_damaged_cell_files_are_never_counted_and_are_recomputed(tmp_path, capsys):
    suite, out = tiny_suite(tmp_path, seeds=[0, 1]), tmp_path / "out"
    assert bench(suite, out) == 0
    cells = {c: out / "cells" / "quadratic" / c for c in ("sync/s0/seed0", "stale/s4/seed0", "stale/s4/seed1",
                                                          "gac/s4/seed0", "gac/s4/seed1")}
    metrics = (cells["stale/s4/seed0"] / "metrics.csv").read_text()
    (cells["sync/s0/seed0"] / "metrics.csv").write_text("")  # empty
    (cells["stale/s4/seed0"] / "metrics.csv").write_text(metrics[: len(metrics) // 2])  # truncated mid-line
    (cells["stale/s4/seed1"] / "metrics.csv").write_text("\n".join(metrics.splitlines()[:5]) + "\n")  # rows lost
    (cells["gac/s4/seed0"] / "status.json").write_text('{"status": "do')  # corrupt status
    (cells["gac/s4/seed1"] / "config.json").write_text("{")  # corrupt config

    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    err = capsys.readouterr().err
    for c, bad in (("sync/s0/seed0", "metrics.csv is empty"), ("stale/s4/seed0", "metrics.csv is truncated"),
                   ("stale/s4/seed1", "metrics.csv is truncated (its last row is step 1, the run took 30 steps)"),
                   ("gac/s4/seed0", "status.json is not valid JSON"),
                   ("gac/s4/seed1", "config.json is not valid JSON")):
        assert f"{cells[c]}/{bad.split(' ')[0]}" in err and bad in err, (c, err)
    assert f"rerun the gacbench bench command of this grid with --out {out}" in err
    assert statuses(out) == {**{c: "incomplete" for c in cells}, "sync/s0/seed1": "done"}  # none read as finished
    summary = json.loads((out / "summary.json").read_text())
    assert [(g["method"], g["n"]) for g in summary["groups"]] == [("sync", 1)]
    assert "## Incomplete cells" in (out / "summary.md").read_text()

    capsys.readouterr()
    assert bench(suite, out) == 0  # the damaged cells do not block the grid: they are recomputed, each named
    said = " ".join(capsys.readouterr().out.split())
    assert "ran 5 cells (1 already done" in said
    assert f"recomputing {cells['sync/s0/seed0']}: {cells['sync/s0/seed0']}/metrics.csv is empty" in said
    assert f"recomputing {cells['gac/s4/seed1']}: {cells['gac/s4/seed1']}/config.json is not valid JSON" in said
    assert set(statuses(out).values()) == {"done"}
    assert bench(suite, out) == 0  # now complete: reused
    assert "ran 0 cells (6 already done" in " ".join(capsys.readouterr().out.split())


def test_a_metrics_file_the_csv_reader_refuses_is_a_damaged_cell_not_a_crash(tmp_path, capsys):
    """A block of NULs inside metrics.csv (a field past the csv module's size limit): report and bench name the
    file and go on."""
    suite, out = tiny_suite(tmp_path, seeds=[0]), tmp_path / "out"
    assert bench(suite, out) == 0
    path = out / "cells" / "quadratic" / "sync" / "s0" / "seed0" / "metrics.csv"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:3]) + "\0" * 200_000 + "\n" + "".join(lines[3:]))
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    assert f"{path} is corrupt (field larger than field limit" in capsys.readouterr().err
    assert bench(suite, out) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert f"recomputing {path.parent}: {path} is corrupt" in said and "ran 1 cells (2 already done" in said


def test_a_status_claiming_done_without_its_fields_is_not_done(tmp_path):
    from gacbench.bench.cell import run_cell, stored_done

    cell = {"task": "q", "objective": "quadratic", "params": {}, "steps": 10, "method": "stale", "staleness": 2,
            "seed": 0}
    assert run_cell(cell, tmp_path)["status"] == "done"
    (cell_dir(tmp_path, cell) / "status.json").write_text('{"status": "done"}')
    assert stored_done(tmp_path, cell) is None
    assert run_cell(cell, tmp_path)["final"] is not None  # recomputed


@pytest.mark.parametrize("steps_run", [None, "10", -1, True])
def test_a_done_status_without_a_readable_steps_run_is_not_done(tmp_path, steps_run):
    """steps_run says how complete metrics.csv must be: without it a metrics.csv cut after a few steps would pass
    as a finished run (and its c_t and drift be summarised from the cut file)."""
    from gacbench.bench.cell import done_problem, run_cell, stored_done
    from gacbench.jsonio import read_json, write_json

    cell = {"task": "q", "objective": "quadratic", "params": {}, "steps": 10, "method": "stale", "staleness": 2,
            "seed": 0}
    assert run_cell(cell, tmp_path)["status"] == "done"
    d = cell_dir(tmp_path, cell)
    status = read_json(d / "status.json")
    if steps_run is None:
        del status["steps_run"]
    else:
        status["steps_run"] = steps_run
    write_json(d / "status.json", status)
    lines = (d / "metrics.csv").read_text().splitlines(keepends=True)
    (d / "metrics.csv").write_text("".join(lines[:4]))  # cut after a few steps
    assert "steps_run" in done_problem(d, status) and stored_done(tmp_path, cell) is None


def test_a_quadratic_started_at_its_optimum_settles_at_the_noise_floor_without_diverging(tmp_path):
    """From theta* (init_scale 0) SGD settles at a gap of order lr sigma2 above a start of 0: not a divergence; an
    exploding run still is."""
    from gacbench.bench.cell import run_cell

    cell = {"task": "q", "objective": "quadratic", "params": {"init_scale": 0.0}, "steps": 100, "method": "stale",
            "staleness": 2, "seed": 0}
    ran = run_cell(cell, tmp_path)
    assert ran["status"] == "done" and ran["initial"] == 0.0 and ran["final"] > 0.0 and not ran["diverged"]
    exploding = {**cell, "params": {"init_scale": 0.0, "lr": 20.0}, "steps": 60}
    assert run_cell(exploding, tmp_path / "exploding")["diverged"]


def test_a_diverged_cell_s_status_is_strict_json_and_the_cell_is_reused_and_counted(tmp_path):
    import math

    from gacbench.bench.cell import run_cell, stored_done
    from gacbench.bench.groups import capped_final

    cell = {"task": "q", "objective": "quadratic", "params": {"lr": 20.0}, "steps": 60, "method": "stale",
            "staleness": 2, "seed": 0}
    ran = run_cell(cell, tmp_path)
    assert ran["status"] == "done" and ran["diverged"] and not math.isfinite(ran["final"])

    def refuse(name):
        raise ValueError(f"{name} in status.json")

    text = (cell_dir(tmp_path, cell) / "status.json").read_text()
    stored = json.loads(text, parse_constant=refuse)  # no NaN / Infinity
    assert stored["final"] is None and stored["diverged"]
    reused = stored_done(tmp_path, cell)
    assert reused is not None and capped_final(reused) == reused["initial"]  # counted at its start, as diverged


def test_a_subset_rerun_keeps_the_summary_of_the_whole_directory(tmp_path, capsys):
    suite, out = tiny_suite(tmp_path), tmp_path / "out"
    assert bench(suite, out) == 0
    full = statuses(out)
    assert len(full) == 3
    assert bench(suite, out, "--methods", "sync") == 0  # a subset into the same --out
    assert statuses(out) == full
    md = (out / "summary.md").read_text()
    assert "| gac |" in md and "| stale |" in md
    assert "3 stored cells" in " ".join(capsys.readouterr().out.split())


def test_the_missing_sync_note_looks_at_the_stored_cells_too(tmp_path, capsys):
    suite, out = tiny_suite(tmp_path), tmp_path / "out"
    assert bench(suite, tmp_path / "alone", "--methods", "stale") == 0
    assert "no sync cell in this grid" in " ".join(capsys.readouterr().out.split())
    assert bench(suite, out, "--methods", "sync") == 0
    capsys.readouterr()
    assert bench(suite, out, "--methods", "stale,gac") == 0  # sync is done in --out: the shares can be computed
    assert "no sync cell" not in " ".join(capsys.readouterr().out.split())
    assert "Recovered share" in (out / "summary.md").read_text()


def test_a_section_field_of_the_wrong_type_is_refused(monkeypatch):
    import dataclasses

    from gacbench.bench.runner import check_params, parse_params
    from gacbench.objectives import NoisyQuadratic, register_objective, registry

    @dataclasses.dataclass
    class Engine:
        name: str = "hf"
        kv_cache_gib: float = 0.25

    class Sectioned(NoisyQuadratic):
        def __init__(self, engine: Engine | dict | None = None, **kw) -> None:
            super().__init__(**kw)

    monkeypatch.setattr(registry, "_TARGETS", dict(registry._TARGETS))
    monkeypatch.setattr(registry, "_RESOLVED", dict(registry._RESOLVED))
    register_objective("sectioned-types", Sectioned)
    overrides = parse_params(["engine.kv_cache_gib=lots"])
    with pytest.raises(UsageError, match="--param engine.kv_cache_gib: engine.kv_cache_gib takes a number, "
                                         "got the text 'lots'"):
        check_params([{"task": "t", "objective": "sectioned-types", "params": overrides}], overrides)
    check_params([{"task": "t", "objective": "sectioned-types", "params": parse_params(["engine.kv_cache_gib=2"])}])


def test_the_reliability_table_counts_its_rows_and_names_tests_that_exist():
    import re

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs/reliability.md").read_text()
    rows = [line for line in text.split("\n| bad input or fault |", 1)[1].splitlines()[2:] if line.startswith("| ")]
    stated = re.search(r"The table lists (\d+) cases\.", text)
    assert stated and int(stated.group(1)) == len(rows)
    missing = []
    for row in rows:
        cited = row.rstrip(" |").rsplit(" | ", 1)[1]
        files = re.findall(r"`(tests/[\w/]+\.py)`", cited)
        names = re.findall(r"`(test_\w+)`", cited)
        assert files, f"a row cites no test file: {row[:80]!r}"
        sources = [(root / f).read_text() for f in files]
        missing += [f"{t} (in {', '.join(files)})" for t in names
                    if not any(re.search(rf"^(async )?def {t}\(", src, re.M) for src in sources)]
    assert not missing


def test_a_figure_stopped_while_it_is_written_leaves_the_earlier_one_whole(tmp_path):
    """save_figure writes beside the target and renames: a stop in the middle (here an exception from the writer
    after some bytes) leaves the earlier figure as it was and no temporary; a finished save replaces it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gacbench.jsonio import save_figure

    path = tmp_path / "fig.png"
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    save_figure(fig, path, dpi=50)
    earlier = path.read_bytes()
    assert earlier.startswith(b"\x89PNG")

    class Stopped(BaseException):
        pass

    def stopping_print(self, target, *args, **kwargs):
        if hasattr(target, "write"):
            target.write(b"\x89PNG partial")
        else:
            Path(target).write_bytes(b"\x89PNG partial")
        raise Stopped

    backend = type(fig.canvas)
    original = backend.print_png
    backend.print_png = stopping_print
    try:
        with pytest.raises(Stopped):
            save_figure(fig, path, dpi=80)
    finally:
        backend.print_png = original
    assert path.read_bytes() == earlier and sorted(p.name for p in tmp_path.iterdir()) == ["fig.png"]
    ax.plot([0, 1], [1, 0])
    save_figure(fig, path, dpi=80)
    assert path.read_bytes() != earlier and path.read_bytes().startswith(b"\x89PNG")
    save_figure(fig, tmp_path / "plain")  # no suffix: matplotlib's default format, its suffix added
    assert (tmp_path / "plain.png").read_bytes().startswith(b"\x89PNG")
    plt.close(fig)


def test_an_interrupted_command_puts_the_signal_handlers_back(tmp_path):
    """A command ended by a signal inside a longer process (a test, a notebook) leaves SIGINT and SIGTERM as they were
    before it, not ignored: the marker's SIG_IGN lasts only while the marker is written."""
    import signal
    from types import SimpleNamespace

    from gacbench.cli import run_interruptible
    from gacbench.usage import Interrupted

    def stopped(args):
        raise Interrupted(signal.SIGINT)

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    out = tmp_path / "r.json"
    assert run_interruptible("power", stopped, SimpleNamespace(json=str(out))) == 130
    assert {s: signal.getsignal(s) for s in before} == before
    assert out.is_file()
