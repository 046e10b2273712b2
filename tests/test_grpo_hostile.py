"""Hostile inputs to `gacbench grpo` and the long commands: task settings a task does not use or out of range, two
runs in one run directory, another run's checkpoint, a redundant resume of a finished run, and SIGINT / SIGTERM."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gacbench.cli import UsageError, main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tasks/llm/tiny.yaml")


def _refused(capsys, argv: list[str]) -> str:
    """The one error line of a command that must exit 2 without a traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


# -- task settings ------------------------------------------------------------------------------------------------
def test_a_task_setting_the_task_does_not_read_or_out_of_range_is_refused_naming_the_key():
    from gacbench.llm.grpo import GRPOModule
    from gacbench.objectives.base import SettingError

    cases = [  # (task section, key named, text of the message)
        ({"path": "/nonexistent/data.jsonl"}, "task.path", "not a setting of task 'arithmetic'"),
        ({"options": {"zzz": 1}}, "task.options", "'zzz': not an option of task 'arithmetic'"),
        ({"eval_fraction": 1.5}, "task.eval_fraction", "in (0, 1)"),
        ({"eval_fraction": 0.0}, "task.eval_fraction", "in (0, 1)"),
        ({"max_ops": 0}, "task.max_ops", ">= 1"),
        ({"name": "scratchpad", "max_ops": 4}, "task.max_ops", "not a setting of task 'scratchpad'"),
        ({"name": "scratchpad", "options": {"min_ops": 4}}, "task.options.min_ops", "min_ops=4 > max_ops=3"),
        ({"name": "scratchpad", "options": {"max_operand": 0}}, "task.options.max_operand", ">= 1"),
        ({"name": "math"}, "task.path", "needs task.path"),
        ({"name": "math", "path": "x.jsonl", "max_operand": 3}, "task.max_operand", "task 'math'"),
        ({"name": "math", "path": "x.jsonl", "options": {"ops": 1}}, "task.options", "prompt_key, answer_key"),
    ]
    for task, key, text in cases:
        with pytest.raises(SettingError, match=text.replace("(", r"\(").replace(")", r"\)")) as exc:
            GRPOModule.check_settings({"task": task})
        assert exc.value.key == key, (task, exc.value)
    # what a task reads is accepted; the arithmetic task's settings list is in the message of a refusal
    for task in ({}, {"max_ops": 3, "eval_fraction": 0.5}, {"name": "scratchpad", "options": {"min_ops": 1}},
                 {"name": "math", "path": "x.jsonl", "template": "Q: {problem}", "options": {"prompt_key": "q"}}):
        GRPOModule.check_settings({"task": task})
    with pytest.raises(SettingError) as exc:
        GRPOModule.check_settings({"task": {"template": "Q: {problem}"}})
    assert "takes task.name, task.reward, task.max_ops, task.max_operand, task.eval_fraction" in str(exc.value)


def test_settings_a_run_would_meet_only_at_its_engine_or_first_rollout_are_refused_up_front(tmp_path):
    """A grid of such cells ran and failed every cell (a bogus engine dtype, a KV cache of -1 GiB, a negative sync
    tolerance blaming the sync, max_tokens beyond the context) or ran from an untrained model (warm_steps -1)."""
    from gacbench.llm.grpo import GRPOModule
    from gacbench.objectives.base import SettingError

    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"problem": "What is {i} + {i}?", "answer": "{2 * i}"}}\n' for i in range(20)))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"max_position_embeddings": 32}')
    cases = [  # (settings, key named, text of the message)
        ({"engine": {"dtype": "fp32"}}, "engine.dtype", "engine.dtype='fp32' is not one of auto, float32"),
        ({"engine": {"kv_cache_gib": -1}}, "engine.kv_cache_gib", "engine.kv_cache_gib"),
        ({"engine": {"kv_cache_gib": 0}}, "engine.kv_cache_gib", "engine.kv_cache_gib"),
        ({"engine": {"sync_tol": -1}}, "engine.sync_tol", "engine.sync_tol"),
        ({"engine": {"sync_tol": float("nan")}}, "engine.sync_tol", "engine.sync_tol"),
        ({"model": {"warm_steps": -1}}, "model.warm_steps", "0 starts from the untrained model"),
        ({"rollout": {"max_tokens": 64}}, "rollout.max_tokens", "no room for a prompt in the model's context of 64"),
        ({"model": {"path": str(ckpt)}, "rollout": {"max_tokens": 40}}, "rollout.max_tokens", "context of 32"),
        ({"task": {"name": "math", "path": str(data)}}, "model.path", "task 'math' is text"),
    ]
    for settings, key, text in cases:
        with pytest.raises(SettingError, match=re.escape(text)) as exc:
            GRPOModule.check_settings(settings)
        assert exc.value.key == key, (settings, exc.value)
    for settings in ({"engine": {"kv_cache_gib": None, "sync_tol": 0, "dtype": "bfloat16"}},
                     {"model": {"warm_steps": 0}, "rollout": {"max_tokens": 48}},
                     {"model": {"path": str(ckpt)}, "task": {"name": "math", "path": str(data)},
                      "rollout": {"max_tokens": 16}}):
        GRPOModule.check_settings(settings)


def test_the_arithmetic_task_holds_out_its_eval_fraction():
    from gacbench.llm.task import _is_eval
    from gacbench.llm.tasks import TaskConfig, build_task

    task = build_task(TaskConfig(eval_fraction=0.5), seed=0)
    assert task.eval_fraction == 0.5
    assert all(_is_eval(p.prompt, 0.5) for p in task.batch("eval", 0, 50))
    assert not any(_is_eval(p.prompt, 0.5) for p in task.batch("train", 0, 50))
    assert build_task(TaskConfig(), 0).batch("train", 0, 20) == build_task(TaskConfig(), 0).batch("train", 0, 20)


def test_grpo_and_bench_refuse_unused_and_out_of_range_task_settings_before_loading_a_model(capsys, tmp_path,
                                                                                           monkeypatch):
    import gacbench.llm.grpo as grpo

    monkeypatch.setattr(grpo, "load", lambda *a: pytest.fail("a model was loaded"))
    line = _refused(capsys, ["grpo", "--config", TINY, "--model.task.path", "/nonexistent/data.jsonl"])
    assert "task.path='/nonexistent/data.jsonl' is not a setting of task 'arithmetic'" in line
    line = _refused(capsys, ["grpo", "--config", TINY, "--model.task.options", '{"zzz": 1}'])
    assert "'zzz': not an option of task 'arithmetic'" in line
    line = _refused(capsys, ["grpo", "--config", TINY, "--model.task.eval_fraction", "1.5"])
    assert "task.eval_fraction=1.5" in line and "(0, 1)" in line
    line = _refused(capsys, ["grpo", "--config", TINY, "--model.task.name", "scratchpad", "--model.task.options",
                             '{"max_operand": 0}'])
    assert "task.options.max_operand=0 must be an integer >= 1" in line
    line = _refused(capsys, ["grpo", "--config", TINY, "--model.task.name", "scratchpad", "--model.task.options",
                             '{"min_ops": 4}'])
    assert "min_ops=4 > max_ops=3" in line
    out = tmp_path / "grid"
    line = _refused(capsys, ["bench", "--suite", "llm-smoke", "--param", "task.eval_fraction=1.5", "--out", str(out)])
    assert line.startswith("gacbench bench: error: --param task.eval_fraction:") and "(0, 1)" in line
    assert not out.exists()


def test_a_grpo_module_checks_its_task_settings_once(monkeypatch, tmp_path):
    import gacbench.llm.grpo as grpo
    from gacbench.llm import tasks
    from gacbench.llm.warmstart import warm_task

    class Loading(Exception):
        pass

    def load(*args):
        raise Loading

    checked = []
    check = tasks.check_task_settings

    def counted(cfg, owner="GRPOModule"):
        checked.append(cfg.name)
        check(cfg, owner)

    monkeypatch.setattr(grpo, "load", load)
    monkeypatch.setattr(tasks, "check_task_settings", counted)
    (tmp_path / "config.json").write_text("{}")  # a checkpoint directory as check_settings sees it (a stat)
    with pytest.raises(Loading):  # the settings checked and the task built: the model comes next
        grpo.GRPOModule(model={"path": str(tmp_path)}, engine={"name": "hf"})
    assert checked == ["arithmetic"]
    cfg = tasks.TaskConfig(name="scratchpad")
    assert warm_task(cfg, tasks.build_task(cfg, 4)).seed == 0  # its own task again, at seed 0, not checked again
    assert checked == ["arithmetic", "scratchpad"]


# -- the run directory's claim ----------------------------------------------------------------------------------
HOLD = """import contextlib, sys, time
from pathlib import Path
from gacbench.llm.cli import claim_run_dir
with contextlib.ExitStack() as stack:
    claim_run_dir(Path(sys.argv[1]), stack)
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_run_directory_held_by_a_live_run_is_refused_naming_its_pid_and_a_dead_ones_is_taken_over(tmp_path,
                                                                                                   capsys):
    import contextlib

    from gacbench.llm.cli import claim_run_dir

    run_dir = tmp_path / "tiny" / "stale-s2-seed0"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(UsageError, match=f"{run_dir} is in use by another gacbench grpo run \\(pid {proc.pid}"):
            with contextlib.ExitStack() as stack:
                claim_run_dir(run_dir, stack)
        proc.kill()  # killed: the lock goes with it, its record stays
        proc.wait()
        with contextlib.ExitStack() as stack:
            claim_run_dir(run_dir, stack)
            assert json.loads((run_dir / ".claim").read_text())["pid"] == os.getpid()
        assert f"taking over {run_dir}: the run that claimed it (pid {proc.pid}) is no longer running" in \
            capsys.readouterr().err
        assert (run_dir / ".claim").read_text() == ""  # a clean end clears the record: the next claim is silent
        with contextlib.ExitStack() as stack:
            claim_run_dir(run_dir, stack)
        assert "taking over" not in capsys.readouterr().err
    finally:
        proc.kill()


# -- another run's checkpoint ---------------------------------------------------------------------------------------
def test_the_run_hash_leaves_out_steps_only_and_another_runs_checkpoint_is_refused_by_name(tmp_path):
    import torch
    from jsonargparse import Namespace

    from gacbench.llm.cli import check_checkpoint_run, differing_settings, resolve_ckpt, run_hash, run_identity

    def config(**changes):
        model = {"staleness": 2, "seed": 0, "steps": 4, "lr": 1e-4, "task": {"name": "arithmetic", "max_ops": 2}}
        base = {"method": "stale", "seed_everything": 0, **changes.pop("top", {})}
        return Namespace(**base, model=Namespace(**{**model, **changes}))

    h = run_hash(config())
    assert run_hash(config(steps=400)) == h  # more steps continue the same run
    others = [config(seed=1), config(staleness=3), config(lr=2e-4), config(task={"name": "arithmetic", "max_ops": 3}),
              config(top={"method": "gac"}), config(top={"seed_everything": 1})]
    assert len({h, *map(run_hash, others)}) == 1 + len(others)
    # engine.compile spelled out at its default (false) is the config without it; true is another run
    engine = {"name": "vllm", "dtype": "float32", "kv_cache_gib": 0.25, "sync_tol": 1e-3}
    plain = run_hash(config(engine=Namespace(**engine)))
    assert run_hash(config(engine=Namespace(**engine, compile=False))) == plain != h
    assert run_hash(config(engine=Namespace(**engine, compile=True))) not in (plain, h)

    d = tmp_path / "shared"
    d.mkdir()
    torch.save({"global_step": 4, "gacbench_run": {"config_hash": "0123456789abcdef"}}, d / "last.ckpt")
    check_checkpoint_run(d / "last.ckpt", "0123456789abcdef")
    check_checkpoint_run(d / "last.ckpt", None)
    message = f"{d / 'last.ckpt'} belongs to another run \\(its config hash 0123456789abcdef, this run's {h}"
    with pytest.raises(UsageError, match=message):
        check_checkpoint_run(d / "last.ckpt", h)
    trainer = SimpleNamespace(checkpoint_callback=SimpleNamespace(dirpath=str(d)), loggers=[])
    with pytest.raises(UsageError, match=message):
        resolve_ckpt(trainer, "last", h)
    with pytest.raises(UsageError, match=message):
        resolve_ckpt(trainer, str(d / "last.ckpt"), h)
    torch.save({"global_step": 2}, d / "old.ckpt")  # written without a record: accepted
    assert resolve_ckpt(trainer, str(d / "old.ckpt"), h) == (str(d / "old.ckpt"), 2)
    # a checkpoint that records its run's identity: the refusal names each setting that differs, as an option
    other = config(seed=1, lr=2e-4, top={"method": "gac"})
    assert run_hash(other) != h and run_identity(config()) == run_identity(config(steps=400))
    torch.save({"global_step": 4, "gacbench_run": {"config_hash": run_hash(other), "identity": run_identity(other)}},
               d / "last.ckpt")
    with pytest.raises(UsageError) as refused:
        resolve_ckpt(trainer, "last", h, run_identity(config()))
    assert (f"(its config hash {run_hash(other)}, this run's {h}: --method \"gac\" in the checkpoint, \"stale\" in "
            "this run; --model.lr 0.0002 in the checkpoint, 0.0001 in this run; --model.seed 1 in the checkpoint, 0 "
            "in this run); resume from") in str(refused.value)
    many = config(seed=1, lr=2e-4, staleness=5, task={"name": "arithmetic", "max_ops": 3}, top={"method": "gac"})
    assert differing_settings(run_identity(many), run_identity(config())).endswith(
        "--model.staleness 5 in the checkpoint, 2 in this run; and 1 more")  # at most four, the rest counted


def test_the_run_hash_holds_the_trainer_settings_that_change_the_update():
    """Gradient clipping, accumulation and precision change every step after a resume: set off Lightning's defaults
    they are part of the run (a resume that changes one is refused by name); at a default, spelt out or not, they
    leave the hash of a run recorded without them unchanged."""
    from jsonargparse import Namespace

    from gacbench.llm.cli import differing_settings, run_hash, run_identity

    def config(**trainer):
        return Namespace(method="stale", seed_everything=0, model=Namespace(staleness=2, seed=0, steps=4),
                         trainer=Namespace(**{"max_steps": 4, "devices": 1, **trainer}))

    h = run_hash(Namespace(method="stale", seed_everything=0, model=Namespace(staleness=2, seed=0, steps=4)))
    assert run_hash(config()) == h == run_hash(config(gradient_clip_val=None, gradient_clip_algorithm="norm",
                                                      accumulate_grad_batches=1, precision="32-true"))
    assert run_hash(config(precision=32, devices=2, max_steps=9)) == h
    changed = [config(gradient_clip_val=0.001), config(gradient_clip_val=0.001, gradient_clip_algorithm="value"),
               config(accumulate_grad_batches=2), config(precision="bf16-mixed")]
    assert len({h, *map(run_hash, changed)}) == 1 + len(changed)
    assert differing_settings(run_identity(config()), run_identity(changed[0])) == (
        '--trainer.gradient_clip_val "unset" in the checkpoint, 0.001 in this run')
    assert run_hash(config(gradient_clip_algorithm="value", gradient_clip_val=None)) == h  # no value: no clipping


def test_a_checkpoint_recorded_before_the_trainer_settings_joined_the_identity_resumes_on_the_rest(tmp_path):
    """A run record without a version (written before the trainer's clipping, accumulation and precision were part
    of a run's identity) is the same run when the rest agrees, whatever the trainer settings now; a record of this
    version that holds none of them is another run when they are set now."""
    from jsonargparse import Namespace

    from gacbench.llm.cli import RUN_RECORD_VERSION, identity_hash, refuse_other_run, run_hash, run_identity

    def config(**trainer):
        return Namespace(method="stale", seed_everything=0, model=Namespace(staleness=2, seed=0, steps=4),
                         trainer=Namespace(max_steps=4, **trainer))

    plain, clipped = config(), config(gradient_clip_val=1.0, precision="bf16-mixed")
    old_record = {"config_hash": identity_hash(run_identity(plain)), "identity": run_identity(plain)}
    refuse_other_run(tmp_path / "old.ckpt", old_record, run_hash(clipped), run_identity(clipped))  # accepted
    new_record = {**old_record, "version": RUN_RECORD_VERSION}
    with pytest.raises(UsageError, match=r"--trainer.gradient_clip_val \"unset\" in the checkpoint, 1.0 in this run"):
        refuse_other_run(tmp_path / "new.ckpt", new_record, run_hash(clipped), run_identity(clipped))
    other = config(gradient_clip_val=1.0)
    other.model.seed = 1
    with pytest.raises(UsageError, match="belongs to another run"):  # the rest differs: refused as before
        refuse_other_run(tmp_path / "old.ckpt", old_record, run_hash(other), run_identity(other))


@pytest.mark.filterwarnings("ignore:.*ckpt_path.*", "ignore:You're resuming from a checkpoint")
def test_a_shared_checkpoint_dir_and_a_redundant_resume_of_a_finished_run(tiny_llm_dir, tmp_path, capsys):
    from conftest import TINY_TASK

    shared = tmp_path / "shared-ckpts"
    cfg = tmp_path / "ckpt.yaml"
    cfg.write_text("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
                   f"      init_args: {{dirpath: {shared}, every_n_train_steps: 2}}\n")
    args = ["--config", TINY, "--config", str(cfg), "--model.model.path", tiny_llm_dir, "--model.engine.name", "hf",
            "--model.rollout.prompts", "2", "--model.rollout.group", "2", "--model.rollout.max_tokens", "4",
            "--model.eval_size", "4", "--model.eval_every", "2", "--model.task.max_ops", str(TINY_TASK["max_ops"]),
            "--model.task.max_operand", str(TINY_TASK["max_operand"]), "--trainer.logger.init_args.save_dir",
            str(tmp_path), "--method", "stale", "--model.staleness", "1", "--trainer.max_steps", "2"]
    assert main(["grpo", *args]) == 0
    run_dir = tmp_path / "tiny" / "stale-s1-seed0"
    files = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    ckpts = {p.name: p.read_bytes() for p in shared.glob("*.ckpt")}
    capsys.readouterr()
    assert main(["grpo", *args, "--ckpt_path", "last"]) == 0  # nothing left to do: left byte for byte
    err = capsys.readouterr().err
    assert f"{run_dir} is a finished run (2 of 2 steps): left unchanged" in err and "--refresh_summary" in err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == files
    assert {p.name: p.read_bytes() for p in shared.glob("*.ckpt")} == ckpts
    # another seed sharing the checkpoint directory does not adopt the first run's checkpoint
    line = _refused(capsys, ["grpo", *args, "--model.seed", "1", "--ckpt_path", "last"])
    assert f"{shared}" in line and "belongs to another run (its config hash" in line
    assert "--model.seed 0 in the checkpoint, 1 in this run); resume from" in line
    assert main(["grpo", *args, "--ckpt_path", "last", "--refresh_summary"]) == 0  # asked for: rewritten
    assert (run_dir / "summary.json").read_bytes() != files["summary.json"]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"


# -- signals --------------------------------------------------------------------------------------------------------
def _handles(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` installed (/proc's SigCgt mask)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (sig - 1) & 1)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
@pytest.mark.parametrize("command,sig", [(["theory"], signal.SIGTERM), (["theory"], signal.SIGINT),
                                         (["demo", "--steps", "100000"], signal.SIGTERM),
                                         (["rollout-bench", "--engines", "hf", "--repeats", "100000", "--grpo-steps",
                                           "0"], signal.SIGTERM)])
def test_a_signal_ends_a_long_command_with_one_line_an_incomplete_json_and_128_plus_the_signal(tmp_path, command,
                                                                                               sig):
    out = tmp_path / "out.json"
    code = "import sys; from gacbench.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, *command, "--json", str(out)], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _handles(proc.pid, signal.SIGTERM):  # the command's handlers are in place: it has started
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    name = signal.Signals(sig).name
    assert proc.returncode == 128 + sig, err
    assert err.strip().splitlines()[-1] == (f"gacbench {command[0]}: interrupted ({name}) before it finished; {out} "
                                            "marked incomplete") and "Traceback" not in err, err
    assert json.loads(out.read_text()) == {"complete": False, "command": command[0], "signal": name}


@pytest.mark.filterwarnings("ignore:.*ckpt_path.*", "ignore:You're resuming from a checkpoint")
@pytest.mark.parametrize("env", [{}, {"LOCAL_RANK": "1"}, {"LOCAL_RANK": "1", "WORLD_SIZE": "2"}],
                         ids=["plain", "local-rank-left-set", "ranks-left-set"])
def test_sigint_ends_a_grpo_run_at_once_as_interrupted_with_exit_130(tiny_llm_dir, tmp_path, env):
    """Also with a LOCAL_RANK other than 0 (and a WORLD_SIZE above 1) left in the environment of a run of one
    process: SIGINT there is not the flag of a DDP rank (which one process would never combine), it stops the run."""
    from conftest import TINY_TASK, signal_grpo_mid_fit

    cfg = tmp_path / "ckpt.yaml"
    cfg.write_text("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
                   "      init_args: {every_n_train_steps: 2, save_top_k: -1}\n")
    args = ["--config", TINY, "--config", str(cfg), "--model.model.path", tiny_llm_dir, "--model.engine.name", "hf",
            "--model.rollout.prompts", "2", "--model.rollout.group", "2", "--model.rollout.max_tokens", "4",
            "--model.eval_size", "4", "--model.eval_every", "2", "--model.task.max_ops", str(TINY_TASK["max_ops"]),
            "--model.task.max_operand", str(TINY_TASK["max_operand"]), "--trainer.logger.init_args.save_dir",
            str(tmp_path), "--trainer.max_steps", "1000"]
    run_dir = tmp_path / "tiny" / "sync-s0-seed0"
    returncode, err = signal_grpo_mid_fit(args, run_dir, tmp_path, signal.SIGINT, env)
    assert returncode == 130, err[-3000:]
    assert "interrupted (SIGINT) after" in err and "Traceback" not in err, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and 2 <= summary["steps"] < 1000 and summary["eval_acc_final"] is None


SIGNAL_IN_IMPORT = """import sys, time, traceback
from gacbench.usage import Interrupted, raise_on_signals

sys.path.insert(0, sys.argv[1])
try:
    with raise_on_signals():
        import signalling  # its top level signals this process twice and goes on
        time.sleep(30)
    print("not interrupted", flush=True)
except Interrupted as exc:
    frames = [f.filename for f in traceback.extract_tb(exc.__traceback__)]
    print("module ran to its end", getattr(sys.modules.get("signalling"), "done", False), flush=True)
    print("raised inside the import", any("signalling" in f or "importlib" in f for f in frames), flush=True)
    print("interrupted", exc.signum, flush=True)
time.sleep(0.3)  # a second signal raised now would meet the default handler and end the process
print("no second signal", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_an_import_is_raised_once_the_import_is_done(tmp_path, sig):
    """A handler that raised inside an import could raise through a C++ extension's initialisation (torch's
    ``torch.distributed``), which aborts the process; the signal is raised once after the import instead: the
    module ran to its end, no frame of the import is on the exception's traceback, and the second signal sent
    during the import is not raised again. (Where after the import it is raised is not fixed: the watcher looks
    every 10 ms.)"""
    (tmp_path / "signalling.py").write_text(
        f"import os, time\nos.kill(os.getpid(), {int(sig)})\ntime.sleep(0.2)\nos.kill(os.getpid(), {int(sig)})\n"
        "time.sleep(0.2)\ndone = True\n")
    out = subprocess.run([sys.executable, "-c", SIGNAL_IN_IMPORT, str(tmp_path)], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["module ran to its end True", "raised inside the import False",
                                       f"interrupted {int(sig)}", "no second signal"], out.stdout + out.stderr


# -- engine shutdown --------------------------------------------------------------------------------------------
CLOSING = """import atexit, gc, torch
from gacbench.rollout.engines import acquire_engine, register_engine

gc.disable()  # the garbage cycle below stays until a collection

class Closing:
    version = 0
    def close(self):
        print("engine closed, collected", gc.collect(), flush=True)

register_engine("test-closing", lambda spec, **kw: Closing())
atexit.register(print, "process group released")  # as GRPOModule.setup registers it before the engine
policy = torch.nn.Linear(2, 2)
first = acquire_engine("test-closing", model_path=".", policy=policy, eos_token_id=0, pad_token_id=0)
atexit.register(print, "a later handler")
assert acquire_engine("test-closing", model_path=".", policy=policy, eos_token_id=0, pad_token_id=0) is first
cycle = []
cycle.append(cycle)
del cycle
"""


def test_a_held_engine_is_closed_at_exit_before_the_handlers_registered_before_its_last_acquire(tmp_path):
    """At exit the engine is closed before the handlers registered before its last acquire, without the garbage
    collections that closing runs (a collection there would find the cycle the script leaves)."""
    out = subprocess.run([sys.executable, "-c", CLOSING], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["engine closed, collected 0", "a later handler", "process group released"], \
        out.stdout
