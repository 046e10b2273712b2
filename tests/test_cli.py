"""The command line: the overhead benchmark writes its keys; bad input is refused clearly."""

import json
import subprocess
import sys

import pytest

from gacbench.bench.overhead import QWEN3_1_7B, run_overhead, shape_for_params
from gacbench.cli import main


def test_public_imports():
    proc = subprocess.run([sys.executable, "-c", "from gacbench import StalenessSimulator, AlignmentMonitor, GAC"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_overhead_writes_the_documented_keys(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert main(["overhead", "--params", "300000", "--repeats", "2", "--kernels", "eager", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    for key in ("params", "device", "adamw_step_s", "gac_s", "gac_over_adamw"):
        assert key in record
    assert record["gac_over_adamw"] == pytest.approx(record["gac_s"] / record["adamw_step_s"])
    assert record["gac_case"] == "shrink" and record["gac_keep_case"] == "keep"  # each timed branch is the one named
    assert abs(record["params"] - 300000) / 300000 < 0.5
    assert "gac_over_adamw" in capsys.readouterr().out


def test_overhead_bf16_buffer_runs():
    record = run_overhead(params=200000, repeats=1, buffer_dtype="bfloat16")
    assert record["buffer_dtype"] == "bfloat16" and record["gac_s"] > 0


def test_shapes():
    assert abs(QWEN3_1_7B.numel() - 1.72e9) / 1.72e9 < 0.02  # Qwen3-1.7B has ~1.72B parameters (tied embeddings)
    assert abs(shape_for_params(20_000_000).numel() - 20_000_000) < 200_000
    with pytest.raises(ValueError, match="must be positive"):
        shape_for_params(0)


def test_bad_arguments_exit_with_a_message(capsys):
    with pytest.raises(SystemExit):
        main(["overhead", "--repeats", "0"])
    assert "positive integer" in capsys.readouterr().err
    assert main(["demo", "--staleness", "0"]) == 2  # a user error: one line, exit status 2
    assert capsys.readouterr().err == ("gacbench demo: error: --staleness 0 must be >= 1 (the stale runs need a "
                                       "delay)\n")


def test_bench_help_lists_every_shipped_suite(capsys):
    from gacbench.bench.runner import SUITES_DIR

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse may wrap at a hyphen
    suites = sorted(p.stem for p in SUITES_DIR.glob("*.yaml"))
    assert "llm-headline" in suites
    for name in suites:
        assert name in text


def test_overhead_prints_each_path_as_it_is_measured_and_never_stays_silent():
    """Each path's figures come as one block right after its rounds (the eager ones before the compiled path
    starts), and while something runs without output the progress thread prints a line."""
    import io
    import time

    from gacbench.bench.overhead import Progress

    stream = io.StringIO()
    with Progress(stream, quiet_s=0.05) as progress:
        progress.doing("sleeping")
        time.sleep(0.4)
        progress.doing(None)
        run_overhead(params=100_000, repeats=1, kernels=("eager",), progress=progress)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("  overhead: still sleeping (")
    order = [next(i for i, line in enumerate(lines) if key in line)
             for key in ("params=", "AdamW step", "floor (eager", "gac_over_adamw", "gac_keep_over_adamw",
                         "eager: first round")]
    assert order == sorted(order)


@pytest.mark.parametrize("argv, cause", [
    (["--params", "0"], "--params 0 must be positive"),
    (["--params", "-3"], "--params -3 must be positive"),
    (["--device", "nonsense"], "--device 'nonsense' is not a torch device"),
])
def test_overhead_bad_arguments_end_in_one_line_and_exit_2(argv, cause, capsys):
    assert main(["overhead", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and cause in err and "Traceback" not in err


def test_overhead_cuda_without_cuda_is_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["overhead", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sees no CUDA device" in err
