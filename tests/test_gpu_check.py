"""``gacbench gpu-check --device cpu``: the table's rows, each check run at its cheapest."""

import json
import signal
import subprocess
import sys
import time

import pytest
from conftest import assert_this_provenance

from gacbench.bench.gpu_check import _gradients, check_gac_equivalence
from gacbench.cli import main


def test_the_equivalence_gradients_take_every_branch_and_a_wrong_path_fails():
    """The check's four steps are keep, keep, shrink, project; a path that differs from the eager one fails it."""
    row = check_gac_equivalence("eager", __import__("torch").device("cpu"))
    assert row["ok"] and row["actions"] == ["keep", "keep", "shrink", "project"]
    assert row["cos_err"] == 0.0 and row["param_err"] == 0.0  # the same path on the same device: bit for bit
    assert len(_gradients(0)) == 4


def test_a_path_that_computes_something_else_is_a_failed_row(monkeypatch):
    from gacbench.functional import gac as gac_module

    real = gac_module.GACTransform.step

    def off_by_a_little(self, params, *a, **k):  # a path that perturbs the gradient it is given
        out = real(self, params, *a, **k)
        if self.kernels == "compiled":
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(1.001)
        return out

    monkeypatch.setattr(gac_module.GACTransform, "step", off_by_a_little)
    monkeypatch.setattr(gac_module, "compiled_available", lambda: False)  # no compile: the eager kernels run
    row = check_gac_equivalence("compiled", __import__("torch").device("cpu"))
    assert not row["ok"] and row["param_err"] > 1e-5


@pytest.mark.slow
def test_gpu_check_on_the_cpu_ends_in_the_table(tmp_path, capsys):
    out = tmp_path / "check.json"
    rc = main(["gpu-check", "--device", "cpu", "--kernels", "eager", "--engines", "hf", "--grpo-steps", "2",
               "--params", "200000", "--repeats", "1", "--step-profile", "--skip-tests", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    table = text[text.index("gacbench gpu-check: "):]
    checks = [line.split("  ")[0].strip() for line in table.splitlines()[2:] if line.strip() and
              not line.startswith("wrote")]
    assert checks == ["gac eager", "overhead eager", "grpo sync (hf)", "grpo gac (hf)", "step-profile tiny-random",
                      "tests"]
    record = json.loads(out.read_text())
    assert record["ok"] and record["complete"] and record["environment"]["device"] == "cpu"
    assert_this_provenance(record)
    rows = {r["check"]: r for r in record["rows"]}
    assert rows["gac eager"]["actions"] == ["keep", "keep", "shrink", "project"]
    assert rows["grpo gac (hf)"]["steps"] == 2 and "s = 8" in rows["grpo gac (hf)"]["detail"]
    assert rows["grpo sync (hf)"]["detail"].startswith("s = 0")
    for name in ("grpo sync (hf)", "grpo gac (hf)"):  # the median step leaves out the engine's start in the fit
        r = rows[name]
        assert 0 < r["step_s"] <= r["fit_s"] / r["steps"] and f"median step {r['step_s']:.2f} s" in r["detail"]
    assert rows["tests"]["ok"] is None
    assert record["overhead_record"]["overhead eager"]["gac_case"] == "shrink"
    # the step-profile row: gacbench step-profile's record at the tiny random shape, with the GPU command's memory
    # settings, its phases in the row
    prof = record["step_profile_record"]
    assert prof["shape"] == "tiny-random" and prof["gradient_checkpointing"] and prof["logit_rows"] == 2
    assert prof["prompts"] * prof["group"] == 4 and len(prof["all_s"]["generate"]) == 2
    assert f"stale step {prof['stale_step_s']:.2f} s" in rows["step-profile tiny-random"]["detail"]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_gpu_check_ended_by_a_time_limit_keeps_its_finished_rows(tmp_path):
    """The JSON is rewritten after every row (complete: false), and a SIGTERM (a time limit such as timeout's)
    keeps the finished rows and their records beside the marker."""
    out = tmp_path / "check.json"
    cmd = [sys.executable, "-m", "gacbench.cli", "gpu-check", "--device", "cpu", "--kernels", "eager", "--engines",
           "hf", "--grpo-steps", "200", "--params", "200000", "--repeats", "1", "--skip-tests", "--json", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    seen = {}
    while time.time() < deadline and proc.poll() is None:
        try:
            seen = json.loads(out.read_text())
        except (OSError, ValueError):
            seen = {}
        if len(seen.get("rows", [])) >= 2:  # the equivalence and overhead rows; the GRPO runs are under way
            break
        time.sleep(0.2)
    assert proc.poll() is None and seen["complete"] is False, seen
    assert_this_provenance(seen)  # the record after each row names its code and machine, as the final one does
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, stdout[-2000:]
    record = json.loads(out.read_text())
    assert record["complete"] is False and record["signal"] == "SIGTERM" and record["command"] == "gpu-check"
    assert_this_provenance(record)
    assert [r["check"] for r in record["rows"]][:2] == ["gac eager", "overhead eager"]
    assert record["overhead_record"]["overhead eager"]["gac_case"] == "shrink"


def test_gpu_check_bad_arguments_are_one_line(capsys):
    assert main(["gpu-check", "--device", "cpu", "--kernels", "fast"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert main(["gpu-check", "--device", "cpu", "--params", "0"]) == 2
    capsys.readouterr()
    for bad in (["--kernels", "eager,eager"], ["--engines", ""], ["--engines", "hf,hf"], ["--tests-timeout", "-5"]):
        assert main(["gpu-check", "--device", "cpu", *bad]) == 2  # refused before any check runs, not a FAIL row
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("gacbench gpu-check: error: --"), err


@pytest.mark.parametrize("device,tests,want", [("cpu", None, "core"), ("cuda", None, "fast"), ("cpu", "fast", "fast")])
def test_the_tests_row_runs_the_set_of_its_device(monkeypatch, device, tests, want):
    """The CPU runs the core files by default, a GPU every fast test; --tests chooses; the row names the set."""
    import subprocess
    import types

    from gacbench.bench import gpu_check

    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return types.SimpleNamespace(returncode=0, stdout="3 passed in 1.00s\n", stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    from gacbench.bench import overhead

    monkeypatch.setattr(overhead, "_device", lambda d: types.SimpleNamespace(type=device))
    monkeypatch.setattr(gpu_check, "environment", lambda dev: {"device": device})
    result = gpu_check.run_gpu_check(device, kernels=(), grpo_steps=0, skip_overhead=True, tests=tests)
    row = result["rows"][-1]
    assert row["check"] == "tests" and row["ok"] and row["detail"].startswith(f"{want}: 3 passed")
    (cmd,) = seen
    files = cmd[cmd.index("no:cacheprovider") + 1:]
    assert files == (list(gpu_check.CORE_TESTS) if want == "core" else ["tests"])
    assert all((gpu_check.Path(gpu_check.__file__).resolve().parents[2] / f).exists() for f in files)


def test_gpu_check_refuses_an_unknown_test_set(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["gpu-check", "--device", "cpu", "--tests", "all"])
    assert exit_.value.code == 2 and "--tests" in capsys.readouterr().err
    from gacbench.bench.gpu_check import check_tests
    from gacbench.usage import UsageError

    with pytest.raises(UsageError, match="fast, core"):
        check_tests(1.0, "all")


def test_a_path_that_fell_back_to_eager_fails_its_row_and_the_other_paths_are_still_timed(monkeypatch):
    """A compile that failed earlier in the process leaves the eager path running under the compiled name: its
    equivalence row fails naming that, it is not timed, and the eager path's overhead row still comes."""
    from gacbench.bench.gpu_check import run_gpu_check
    from gacbench.functional import kernels

    monkeypatch.setattr(kernels, "_FAILED", ["RuntimeError: a compile that failed"])
    result = run_gpu_check("cpu", ("eager", "compiled"), ("hf",), grpo_steps=0, repeats=1, skip_tests=True,
                           params=200_000)
    rows = {r["check"]: r for r in result["rows"]}
    assert rows["gac eager"]["ok"] and not rows["gac compiled"]["ok"]
    assert "torch.compile failed in this process" in rows["gac compiled"]["detail"]
    assert not rows["overhead compiled"]["ok"] and rows["overhead compiled"]["detail"].startswith("not timed")
    assert rows["overhead eager"]["ok"] and not result["ok"]


def test_fused_adamw_passes_only_where_gac_took_the_changed_steps_itself(monkeypatch):
    """fused-adamw's row passes where GAC took every shrunk or projected AdamW step; where the optimizer took them
    (the fused pass refused the optimizer) the figures are another path's, and the row fails naming that."""
    import torch

    from gacbench.functional import gac as gac_module
    from gacbench.functional import kernels

    monkeypatch.setattr(kernels, "_FAILED", [])  # whatever an earlier test of this process compiled
    row = check_gac_equivalence("fused-adamw", torch.device("cpu"))
    assert row["ok"], row["detail"]
    monkeypatch.setattr(gac_module, "adamw_group_fusable", lambda optimizer, params: False)
    row = check_gac_equivalence("fused-adamw", torch.device("cpu"))
    assert not row["ok"] and "the fused AdamW step was not taken" in row["detail"]
