"""The command line: the overhead benchmark writes its keys; bad input is refused clearly."""

import json
import subprocess
import sys

import pytest
from conftest import assert_this_provenance

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
    assert_this_provenance(record)
    assert record["load_avg_1min"] is None or record["load_avg_1min"] >= 0


def test_overhead_bf16_buffer_runs():
    record = run_overhead(params=200000, repeats=1, buffer_dtype="bfloat16")
    assert record["buffer_dtype"] == "bfloat16" and record["gac_s"] > 0


def _storages() -> dict[int, int]:
    """Every live tensor storage of this process (gc-tracked tensors and the gradients of parameters), by address:
    its size in bytes."""
    import gc

    import torch

    found: dict[int, int] = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter):
            for t in (obj, obj.grad if isinstance(obj, torch.nn.Parameter) else None):
                if t is not None and t.device.type == "cpu":
                    found[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return found


def test_overhead_holds_at_most_eight_gradient_sized_copies(monkeypatch):
    """At 1.72B float32 parameters each gradient-sized copy is 6.9 GB: the command must fit an 80 GB GPU. Counted
    from the live storages after each GAC branch's setup and timed call: parameters, gradients, AdamW's two
    moments, GAC's two references (a branch each), the gradient being stepped and one scratch buffer for the
    floors, nothing more (float32 units)."""
    import gacbench.bench.overhead as overhead

    before = set(_storages())
    held: list[int] = []

    def counted(f):
        def call():
            out = f()
            held.append(sum(n for ptr, n in _storages().items() if ptr not in before))
            return out
        return call

    real = overhead._interleaved
    monkeypatch.setattr(overhead, "_interleaved", lambda cases, *a, **k: real(
        {name: (counted(fn), counted(setup)) if name.startswith("gac") else (fn, setup)
         for name, (fn, setup) in cases.items()}, *a, **k))
    record = run_overhead(params=1_000_000, repeats=1, kernels=("eager",))
    assert record["gac_case"] == "shrink" and record["gac_keep_case"] == "keep"
    assert len(held) == 8 and max(held) / (4 * record["params"]) <= overhead.GRADIENT_COPIES + 0.01


def test_overhead_refuses_a_device_without_room_before_building_anything(monkeypatch):
    """The Qwen3-1.7B shape needs nine float32 copies of 1.72B elements (62 GB): a GPU with 40 GB free is refused
    in one message that names the need, the free memory and a --params that fits."""
    import torch

    from gacbench.bench.overhead import check_memory
    from gacbench.usage import UsageError

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (40e9, 80e9))
    with pytest.raises(UsageError, match=r"need about 62 GB of GPU memory .* has 40 GB free of 80 GB; .*--params "
                                         r"1,00\d,\d{3},\d{3} without --shape"):
        check_memory(torch.device("cuda"), QWEN3_1_7B.numel())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (79e9, 80e9))
    check_memory(torch.device("cuda"), QWEN3_1_7B.numel())  # an 80 GB GPU, nearly empty: room
    # the CPU: the machine's available memory (it had failed in the allocator, or been killed for memory)
    from gacbench.bench import overhead

    free, total = overhead.available_memory()  # this Linux machine's /proc/meminfo
    assert 0 < free <= total
    monkeypatch.setattr(overhead, "available_memory", lambda: (20e9, 24e9))
    with pytest.raises(UsageError, match=r"need about 62 GB of memory .* cpu has 20 GB free of 24 GB; free memory"):
        check_memory(torch.device("cpu"), QWEN3_1_7B.numel())
    check_memory(torch.device("cpu"), 20_000_000)
    monkeypatch.setattr(overhead, "available_memory", lambda: (None, None))  # not Linux: not checked
    check_memory(torch.device("cpu"), QWEN3_1_7B.numel())


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


@pytest.mark.parametrize("argv,cause", [
    (["warm-start", "--size", "huge"], "model.size='huge' is not one of tiny, small, medium"),
    (["warm-start", "--task", "nosuch"], "unknown task 'nosuch'"),
    (["warm-start", "--suite", "synthetic-smoke"], "no GRPO task of this suite starts from a built-in model"),
    (["rollout-bench", "--engines", "nosuch"], "--engines 'nosuch': each must be a registered engine"),
    (["rollout-bench", "--grpo-steps", "-1"], "--grpo-steps -1 must be >= 0"),
    (["async-bench", "--steps", "3", "--max-staleness", "1", "--engine", "hf", "--prompts", "0"],
     "rollout.prompts=0 must be an integer >= 1"),
    (["async-bench", "--steps", "3", "--max-staleness", "1", "--engine", "hf", "--workers", "0"],
     "GRPOModule: rollout.workers=0 must be >= 1"),
    (["step-profile", "--engine", "hf", "--group", "1"], "rollout.group=1 must be an integer >= 2"),
    (["async-bench", "--steps", "0"], "--steps 0 must be >= 1"),
])
def test_llm_commands_refuse_bad_input_in_one_line(argv, cause, capsys):
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"gacbench {argv[0]}: error: ") and cause in err[0], err


def test_an_output_the_command_could_not_write_is_refused_before_the_work(tmp_path, capsys, monkeypatch):
    """A figure suffix matplotlib cannot write would fail after every check had run; an empty --out would be the
    current folder."""
    import gacbench.theory.checks as checks

    monkeypatch.setattr(checks, "run_checks", lambda names=None: pytest.fail("the checks ran"))
    for figure, words in (("fig.xyz", "its suffix .xyz is not a figure format"), ("fig", "it has no suffix")):
        assert main(["theory", "--figure", str(tmp_path / figure)]) == 2
        err = capsys.readouterr().err
        assert words in err and ".png" in err and len(err.strip().splitlines()) == 1
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--suite", "synthetic-smoke", "--out", ""]) == 2
    assert "--out is empty" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_warm_start_and_rollout_bench_refuse_a_file_or_an_empty_folder_in_one_line(tmp_path, capsys):
    afile, empty = tmp_path / "afile", tmp_path / "empty"
    afile.write_text("")
    empty.mkdir()
    assert main(["warm-start", "--out", str(afile)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert main(["rollout-bench", "--engines", "hf", "--model", str(empty)]) == 2
    assert "not a local Hugging Face checkpoint directory (no config.json)" in capsys.readouterr().err


def test_a_setting_an_objective_refuses_is_a_usage_error():
    from gacbench.objectives.base import SettingError
    from gacbench.usage import UsageError

    assert issubclass(SettingError, UsageError) and issubclass(SettingError, ValueError)


def test_the_quadratics_metric_reads_its_gap_without_a_warning():
    """``gacbench demo`` prints the noisy quadratic's metric; reading it raises no torch warning mid-output."""
    import warnings

    from gacbench.objectives.quadratic import NoisyQuadratic

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert NoisyQuadratic(dim=4, kappa=2.0).metric() > 0
