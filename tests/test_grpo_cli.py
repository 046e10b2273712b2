"""`gacbench grpo` (LightningCLI), the shipped configs, `gacbench rollout-bench`, and GRPO on a local
text math dataset through a real (non-arithmetic) tokenizer."""

import contextlib
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("jsonargparse")

from conftest import TINY_TASK, assert_this_provenance  # noqa: E402

from gacbench.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _small(model_dir: str, out: Path) -> list[str]:
    return ["--config", str(ROOT / "tasks/llm/tiny.yaml"), "--model.model.path", model_dir, "--model.engine.name", "hf",
            "--model.rollout.prompts", "4", "--model.rollout.group", "4", "--model.rollout.max_tokens", "4",
            "--model.eval_size", "8", "--model.eval_every", "2", "--model.task.max_ops", str(TINY_TASK["max_ops"]),
            "--model.task.max_operand", str(TINY_TASK["max_operand"]), "--trainer.logger.init_args.save_dir", str(out)]


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "tasks/llm").glob("*.yaml")))
def test_shipped_configs_parse(config, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["grpo", "--config", str(ROOT / "tasks/llm" / config), "--print_config"])
    assert exit_.value.code == 0
    assert "model:" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore:.*ckpt_path.*", "ignore:You're resuming from a checkpoint")
def test_grpo_command_runs_checkpoints_and_resumes(tiny_llm_dir, tmp_path, capsys):
    cfg = tmp_path / "ckpt.yaml"
    cfg.write_text("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
                   "      init_args: {every_n_train_steps: 2, save_top_k: -1}\n")
    args = _small(tiny_llm_dir, tmp_path) + ["--config", str(cfg), "--method", "gac+m2po", "--model.staleness", "2",
                                             "--alignment_warmup", "1", "--model.policy_eval.prompts", "2"]
    assert main(["grpo", *args, "--trainer.max_steps", "4"]) == 0
    run_dir = tmp_path / "tiny" / "gac+m2po-s2-seed0"  # the config's logger name; version METHOD-sS-seedSEED
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["method"] == "gac+m2po" and summary["engine"] == "hf"
    assert 0.0 <= summary["eval_acc_final"] <= 1.0 and 0.0 < summary["generate_share"] < 1.0
    # c_t's statistics come from GAC's trace (the AlignmentMonitor stays passive beside it), read with the monitor's
    # warm-up as every method's are: steps 1-3 have a c_t (step 0 has no earlier gradient), the first is left out
    assert summary["alignment"]["n"] == 2
    header = (run_dir / "metrics.csv").read_text().splitlines()[0]
    assert all(k in header for k in ("align/cos", "m2po/m2", "stale/lag", "eval/acc", "time/generate_s"))
    assert (run_dir / "config.yaml").exists()  # LightningCLI's saved config
    assert main(["grpo", *args, "--trainer.max_steps", "6", "--ckpt_path", "last"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["resumed_from"].endswith("step=4.ckpt")
    import csv

    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))  # the steps before the resume are kept
    assert sorted({int(r["step"]) for r in rows if r.get("stale/lag")}) == list(range(6))
    assert [float(r["stale/lag"]) for r in rows if r.get("stale/lag")] == [0, 1, 2, 2, 2, 2]
    # the evaluations closing step 4 ran before the checkpoint of step 4 and are not repeated after the resume:
    # both stay, the policy evaluation's row with its time
    steps = {key: sorted(int(r["step"]) for r in rows if r.get(key)) for key in ("eval/acc", "eval/policy_reward")}
    assert steps == {"eval/acc": [2, 4, 6], "eval/policy_reward": [0, 2, 4, 6]}, steps


def test_a_fresh_run_does_not_warn_that_its_files_will_be_deleted(tiny_llm_dir, tmp_path):
    """The run directory holds the run's claim and config when CSVLogger starts: its warning that the directory's
    files will be deleted is not shown (an earlier run there is refused before, a resume keeps its rows)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["grpo", *_small(tiny_llm_dir, tmp_path), "--trainer.max_steps", "1"]) == 0
    assert (tmp_path / "tiny" / "sync-s0-seed0" / "summary.json").exists()
    assert not [w for w in caught if "exists and is not empty" in str(w.message)]


def test_grpo_command_refuses_bad_settings(tiny_llm_dir, tmp_path, capsys):
    def refused(*args: str) -> str:  # one line on stderr, exit status 2, no traceback
        assert main(["grpo", *_small(tiny_llm_dir, tmp_path), *args]) == 2
        err = capsys.readouterr().err  # (model loading may print progress above)
        errors = [line for line in err.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and errors[0].startswith("gacbench grpo: error: ") and "Traceback" not in err, err
        return errors[0]

    assert "synchronous but model.staleness=3" in refused("--method", "sync", "--model.staleness", "3")
    assert "unknown method" in refused("--method", "nope")
    assert "no checkpoint in" in refused("--ckpt_path", "last", "--trainer.max_steps", "1")
    missing = str(tmp_path / "missing.ckpt")
    assert "no such checkpoint file" in refused("--ckpt_path", missing, "--trainer.max_steps", "1")
    assert "--model.staleness 8 is not below --trainer.max_steps 8" in refused("--method", "stale", "--model.staleness",
                                                                               "8", "--trainer.max_steps", "8")
    assert "engine.name='nope' is not a registered engine" in refused("--model.engine.name", "nope")


RESUME_WARNINGS = pytest.mark.filterwarnings("ignore:.*ckpt_path.*", "ignore:You're resuming from a checkpoint",
                                           "ignore:.*exists and is not empty")


def _ckpt_run(tiny_llm_dir, tmp_path) -> tuple[list[str], Path]:
    """Arguments of a stale GRPO run that checkpoints every 2 steps, and its run directory."""
    cfg = tmp_path / "ckpt.yaml"
    cfg.write_text("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
                   "      init_args: {every_n_train_steps: 2, save_top_k: -1}\n")
    args = _small(tiny_llm_dir, tmp_path) + ["--config", str(cfg), "--method", "stale", "--model.staleness", "2"]
    return args, tmp_path / "tiny" / "stale-s2-seed0"


def _logged_steps(run_dir: Path) -> list[int]:
    """The steps of metrics.csv's training rows (one per step), in file order."""
    import csv

    return [int(r["step"]) for r in csv.DictReader((run_dir / "metrics.csv").open()) if r.get("stale/lag")]


def _strict_json(path: Path):
    return json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in {path}"))


def _fail_at(monkeypatch, step: int) -> None:
    from gacbench.llm.grpo import GRPOModule

    original = GRPOModule.training_step

    def training_step(self, batch, batch_idx):
        if self.global_step == step:
            raise RuntimeError(f"injected failure at step {step}")
        return original(self, batch, batch_idx)

    monkeypatch.setattr(GRPOModule, "training_step", training_step)


@RESUME_WARNINGS
def test_a_resume_that_fails_keeps_the_earlier_metrics_and_config(tiny_llm_dir, tmp_path, monkeypatch):
    args, run_dir = _ckpt_run(tiny_llm_dir, tmp_path)
    assert main(["grpo", *args, "--trainer.max_steps", "4"]) == 0
    config = (run_dir / "config.yaml").read_text()
    _fail_at(monkeypatch, 6)  # after the checkpoint of step 6
    with pytest.raises(RuntimeError, match="injected failure at step 6"):
        main(["grpo", *args, "--trainer.max_steps", "8", "--ckpt_path", "last"])
    assert _logged_steps(run_dir) == [0, 1, 2, 3, 4, 5]  # the first session's steps survive the failed one
    assert not (run_dir / "metrics.earlier.csv").exists()
    assert (run_dir / "config.yaml").read_text() == config  # the first session's config is kept
    assert "max_steps: 8" in (run_dir / "config.resume-1.yaml").read_text()
    monkeypatch.undo()
    assert main(["grpo", *args, "--trainer.max_steps", "8", "--ckpt_path", "last"]) == 0
    assert _logged_steps(run_dir) == list(range(8))  # each step once: 0-3, 4-5 of the failed session, 6-7
    summary = _strict_json(run_dir / "summary.json")
    assert summary["steps"] == 8 and summary["resumed_from"].endswith("step=6.ckpt")
    assert (run_dir / "config.resume-2.yaml").exists() and (run_dir / "config.yaml").read_text() == config


@RESUME_WARNINGS
def test_a_killed_resume_is_merged_by_the_next_resume(tiny_llm_dir, tmp_path, monkeypatch):
    from gacbench.llm.cli import MetricsKeeper

    args, run_dir = _ckpt_run(tiny_llm_dir, tmp_path)
    assert main(["grpo", *args, "--trainer.max_steps", "4"]) == 0
    monkeypatch.setattr(MetricsKeeper, "after_resume", lambda self, start, every=1: [])  # killed: no clean-up ran
    _fail_at(monkeypatch, 5)
    with pytest.raises(RuntimeError, match="injected failure"):
        main(["grpo", *args, "--trainer.max_steps", "8", "--ckpt_path", "last"])
    assert _logged_steps(run_dir) == [4] and (run_dir / "metrics.earlier.csv").exists()  # the earlier rows wait aside
    monkeypatch.undo()
    assert main(["grpo", *args, "--trainer.max_steps", "6", "--ckpt_path", "last"]) == 0
    assert _logged_steps(run_dir) == list(range(6)) and not (run_dir / "metrics.earlier.csv").exists()
    summary = _strict_json(run_dir / "summary.json")  # 2 steps < the alignment warm-up: null statistics, not NaN
    assert summary["alignment"]["median"] is None


_KILLED_IN_EVALUATION = """
import os, sys
from gacbench.llm.grpo import GRPOModule
original = GRPOModule.metric
def metric(self):  # the process dies as under SIGKILL: no logger or trainer teardown runs
    if self.global_step == int(os.environ["KILL_AT"]):
        os._exit(9)
    return original(self)
GRPOModule.metric = metric
from gacbench.cli import main
sys.exit(main(["grpo", *sys.argv[1:]]))
"""


def _rows(path: Path) -> list[dict]:
    """metrics.csv's rows less their time/ columns and the end-of-fit c_t summary rows (one per session, of that
    session's steps: docs/llm.md)."""
    import csv

    rows = [{k: v for k, v in r.items() if v and not k.startswith("time/")} for r in csv.DictReader(path.open())]
    return [r for r in rows if "align/median" not in r]


@pytest.mark.slow  # three or four short runs, one in a new process
@RESUME_WARNINGS
@pytest.mark.parametrize("kill_at,first,resumed,every", [(4, 6, 6, 2), (6, 6, 6, 2), (4, 4, 6, 3)])
def test_a_run_killed_after_a_checkpoint_resumes_to_every_row_of_an_uninterrupted_run(tiny_llm_dir, tmp_path,
                                                                                      kill_at, first, resumed, every):
    """Killed in the evaluation that follows its checkpoint at step ``kill_at`` (Lightning logs it after the
    checkpoint) of a run to ``first`` steps, then resumed to ``resumed`` steps: metrics.csv has every row of a run
    to ``first`` steps continued to ``resumed``, with the same values. The rows before the checkpoint were written
    at the checkpoint (CSVLogger buffers 100 steps); the evaluation the killed process did not write runs again:
    at the resumed step (4), after a fit with no step left (6 of 6), and where it was due only as the killed
    session's last step (4, resumed to 6, with evaluations every 3 steps)."""
    import os
    import subprocess
    import sys

    (tmp_path / "ref").mkdir()
    (tmp_path / "killed").mkdir()
    ref_args, ref_dir = _ckpt_run(tiny_llm_dir, tmp_path / "ref")
    ref_args += ["--model.eval_every", str(every)]
    assert main(["grpo", *ref_args, "--trainer.max_steps", str(first)]) == 0
    if resumed != first:
        assert main(["grpo", *ref_args, "--trainer.max_steps", str(resumed), "--ckpt_path", "last"]) == 0
    args, run_dir = _ckpt_run(tiny_llm_dir, tmp_path / "killed")
    args += ["--model.eval_every", str(every)]
    done = subprocess.run([sys.executable, "-c", _KILLED_IN_EVALUATION, *args, "--trainer.max_steps", str(first)],
                          env={**os.environ, "KILL_AT": str(kill_at), "PYTHONWARNINGS": "ignore"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 9, done.stderr[-2000:]
    assert main(["grpo", *args, "--trainer.max_steps", str(resumed), "--ckpt_path", "last"]) == 0
    assert _rows(run_dir / "metrics.csv") == _rows(ref_dir / "metrics.csv")
    assert "metrics_lost_steps" not in _strict_json(run_dir / "summary.json")


@pytest.mark.slow  # three runs of two processes each
@pytest.mark.distributed
def test_a_ddp_run_resumed_by_the_command_has_the_rows_and_one_summary_of_an_uninterrupted_run(tiny_llm_dir, tmp_path):
    """`gacbench grpo` under DDP (2 processes, gloo): every rank runs the command, rank 0 alone writes the run's
    files. A 4-step run continued to 6 has the uninterrupted 6-step run's rows (no row twice: the other rank keeps
    its hands off metrics.csv), one summary printed, and both runs log the same whole-batch scalars."""
    import os
    import subprocess
    import sys

    command = Path(sys.executable).with_name("gacbench")
    if not command.exists():
        pytest.skip("the gacbench command is not installed beside this interpreter")
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]

    def grpo(args: list[str], steps: int, *more: str) -> str:
        done = subprocess.run([str(command), "grpo", *args, *ddp, "--trainer.max_steps", str(steps), *more],
                              env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True, text=True,
                              timeout=400, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    (tmp_path / "ref").mkdir()
    (tmp_path / "resumed").mkdir()
    ref_args, ref_dir = _ckpt_run(tiny_llm_dir, tmp_path / "ref")
    grpo(ref_args, 6)
    args, run_dir = _ckpt_run(tiny_llm_dir, tmp_path / "resumed")
    grpo(args, 4)
    out = grpo(args, 6, "--ckpt_path", "last")
    assert out.count("wrote ") == 1  # one rank wrote the summary
    summary = _strict_json(run_dir / "summary.json")
    assert summary["steps"] == 6 and summary["processes"] == 2 and summary["resumed_from"].endswith("step=4.ckpt")
    assert _logged_steps(run_dir) == list(range(6)) and not (run_dir / "metrics.earlier.csv").exists()
    assert _rows(run_dir / "metrics.csv") == _rows(ref_dir / "metrics.csv")


@RESUME_WARNINGS
def test_a_run_interrupted_before_its_first_checkpoint_is_told_to_start_again(tiny_llm_dir, tmp_path, monkeypatch,
                                                                              capsys):
    """Ctrl-C at step 1 of a run that checkpoints every 2 steps: nothing to resume, so the message says to start
    again with --overwrite (not --ckpt_path last), and --ckpt_path last names --overwrite too."""
    import signal

    from gacbench.llm.grpo import GRPOModule
    from gacbench.usage import Interrupted

    args, run_dir = _ckpt_run(tiny_llm_dir, tmp_path)
    original = GRPOModule.training_step

    def training_step(self, batch, batch_idx):
        if self.global_step == 1:
            raise Interrupted(signal.SIGINT)
        return original(self, batch, batch_idx)

    monkeypatch.setattr(GRPOModule, "training_step", training_step)
    assert main(["grpo", *args, "--trainer.max_steps", "4"]) == 130
    err = capsys.readouterr().err
    assert "interrupted (SIGINT) after 1 of 4 steps; no checkpoint was written" in err and "--overwrite" in err
    assert "--ckpt_path last" not in err
    monkeypatch.undo()
    assert main(["grpo", *args, "--trainer.max_steps", "4", "--ckpt_path", "last"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint in" in err and "with --overwrite" in err
    assert main(["grpo", *args, "--trainer.max_steps", "4", "--overwrite"]) == 0
    assert _strict_json(run_dir / "summary.json")["status"] == "finished"


def test_a_resume_names_the_steps_whose_rows_an_earlier_session_lost(tmp_path):
    """Rows logged every 2 steps (log_every_n_steps 2: the steps that are multiples of 2, as log_metrics writes
    them), the earlier sessions' rows holding steps 0 and 6 of the 10 before the checkpoint: 2, 4 and 8 are named
    lost; every step counts at log_every_n_steps 1."""
    from gacbench.llm.cli import MetricsKeeper, _spans, write_rows

    write_rows(tmp_path / "metrics.csv", [{"step": 0, "loss": 0.5}, {"step": 6, "loss": 0.4},
                                          {"step": 10, "eval/acc": 0.25}])
    keeper = MetricsKeeper(tmp_path)
    keeper.before_resume()
    assert keeper.logged_at(10) == {"eval/acc"} and keeper.logged_at(6) == frozenset()
    assert keeper.after_resume(10, every=2) == [2, 4, 8]
    assert keeper.after_resume(10, every=1) == [1, 2, 3, 4, 5, 7, 8, 9]
    assert _spans([1, 2, 3, 4, 5, 7, 8, 9]) == "1-5, 7-9" and _spans([3]) == "3"


def test_only_a_csv_loggers_metrics_file_is_kept_across_a_resume(tmp_path):
    """The rows kept, and the evaluations a resume repeats, are those of a CSVLogger's metrics.csv in the run's
    directory: another logger (TensorBoard, a user's own) keeps its own records, so nothing is read or named lost."""
    from types import SimpleNamespace

    from lightning.pytorch.loggers import CSVLogger, Logger

    from gacbench.llm.cli import _writes_metrics_csv

    csv_logger = CSVLogger(str(tmp_path), name="run", version="v")

    class Other(Logger):
        name, version, log_dir = "other", "v", csv_logger.log_dir

        def log_metrics(self, metrics, step=None):
            pass

        def log_hyperparams(self, params):
            pass

    assert _writes_metrics_csv(SimpleNamespace(loggers=[Other(), csv_logger]), csv_logger.log_dir)
    assert not _writes_metrics_csv(SimpleNamespace(loggers=[Other()]), csv_logger.log_dir)
    assert not _writes_metrics_csv(SimpleNamespace(loggers=[csv_logger]), str(tmp_path / "elsewhere"))


@RESUME_WARNINGS
def test_a_finished_run_without_a_checkpoint_is_not_told_to_overwrite_itself(tiny_llm_dir, tmp_path, capsys):
    """tiny.yaml checkpoints every 20 steps: a 2-step run finishes without one. --ckpt_path last says the finished
    run cannot be continued and names both ways on (another directory, or replacing it)."""
    args = _small(tiny_llm_dir, tmp_path) + ["--trainer.max_steps", "2"]
    assert main(["grpo", *args]) == 0
    capsys.readouterr()
    assert main(["grpo", *args[:-1], "4", "--ckpt_path", "last"]) == 2
    err = capsys.readouterr().err
    assert "finished without writing a checkpoint" in err and "cannot be continued" in err
    assert "--trainer.logger.init_args.version" in err and "--overwrite" in err


@RESUME_WARNINGS
def test_a_corrupt_checkpoint_is_refused_before_the_run_is_touched(tiny_llm_dir, tmp_path, capsys):
    args, run_dir = _ckpt_run(tiny_llm_dir, tmp_path)
    assert main(["grpo", *args, "--trainer.max_steps", "4"]) == 0
    ckpts = run_dir / "checkpoints"
    newest, good = ckpts / "epoch=0-step=4.ckpt", ckpts / "epoch=0-step=2.ckpt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, e.g. by a full disk
    metrics, config = (run_dir / "metrics.csv").read_bytes(), (run_dir / "config.yaml").read_bytes()

    def refused(*extra: str) -> str:
        capsys.readouterr()
        assert main(["grpo", *args, "--trainer.max_steps", "6", *extra]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and errors[0].startswith("gacbench grpo: error: "), errors
        assert (run_dir / "metrics.csv").read_bytes() == metrics and (run_dir / "config.yaml").read_bytes() == config
        return errors[0]

    line = refused("--ckpt_path", "last")
    assert f"the newest checkpoint {newest} cannot be read" in line
    assert f"the previous good one is {good} (step 2): resume from it with --ckpt_path {good}" in line
    assert f"--ckpt_path {newest} cannot be read as a checkpoint" in refused("--ckpt_path", str(newest))
    assert not list(run_dir.glob("config.resume-*.yaml"))
    assert main(["grpo", *args, "--trainer.max_steps", "6", "--ckpt_path", str(good)]) == 0
    assert _logged_steps(run_dir) == list(range(6))


def test_ckpt_path_last_takes_the_highest_step_recorded_inside(tmp_path):
    import os
    import time
    from types import SimpleNamespace

    import torch

    from gacbench.cli import UsageError
    from gacbench.llm.cli import resolve_ckpt

    d = tmp_path / "checkpoints"
    d.mkdir()
    for name, step in (("a.ckpt", 60), ("b.ckpt", 3), ("epoch=0-step=30.ckpt", 30)):
        torch.save({"global_step": step}, d / name)
    later = time.time() + 100
    os.utime(d / "b.ckpt", (later, later))  # the newest file holds the lowest step, as in a copied run directory
    trainer = SimpleNamespace(checkpoint_callback=SimpleNamespace(dirpath=str(d)), loggers=[])
    assert resolve_ckpt(trainer, "last") == (str(d / "a.ckpt"), 60)
    torch.save({"global_step": 60}, d / "last.ckpt")  # the same step: the named file first
    assert resolve_ckpt(trainer, "last") == (str(d / "a.ckpt"), 60)
    (d / "epoch=0-step=90.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(UsageError, match=r"newest checkpoint .*step=90.ckpt cannot be read.*previous good one is "
                                         r".*a.ckpt \(step 60\)"):
        resolve_ckpt(trainer, "last")
    (d / "epoch=0-step=90.ckpt").rename(d / "epoch=0-step=10.ckpt")  # an older unreadable one is skipped
    with pytest.warns(UserWarning, match="skipping the unreadable older checkpoint"):
        assert resolve_ckpt(trainer, "last") == (str(d / "a.ckpt"), 60)
    assert resolve_ckpt(trainer, None) == (None, None)


def test_rollout_bench_writes_engines_side_by_side(tiny_llm_dir, tmp_path, capsys):
    out = tmp_path / "rb.json"
    assert main(["rollout-bench", "--engines", "hf", "--model", tiny_llm_dir, "--prompts", "4", "--group", "2",
                 "--max-tokens", "4", "--repeats", "2", "--grpo-steps", "2", "--grpo-prompts", "2",
                 "--json", str(out)]) == 0

    rec = json.loads(out.read_text())
    hf = rec["engines"]["hf"]
    assert len(hf["tokens_per_s_all"]) == 2 and hf["tokens_per_s_median"] > 0
    assert 0.0 < hf["grpo"]["generate_share"] < 1.0
    assert_this_provenance(rec)


def _byte_bpe_checkpoint(path: Path, texts: list[str]) -> str:
    """A tiny Qwen3 with a byte-level BPE tokenizer trained on ``texts``: a stand-in for a real checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

    from gacbench.llm.model import tiny_config

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<bos>", "<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    Qwen3ForCausalLM(tiny_config(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=128, max_len=256,
                                 vocab=fast.vocab_size)).save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)


def test_grpo_on_a_local_math_dataset_with_a_real_tokenizer(tmp_path):
    pytest.importorskip("math_verify")
    from conftest import make_trainer

    from gacbench.llm.grpo import GRPOModule

    data = ROOT / "tasks/math/example.jsonl"
    texts = [line for line in data.read_text().splitlines() if line.strip()]
    model_dir = _byte_bpe_checkpoint(tmp_path / "bpe", texts)
    task = {"name": "math", "path": str(data), "eval_fraction": 0.25, "template": "Problem: {problem}\nAnswer: "}
    m = GRPOModule(model={"path": model_dir}, task=task, rollout={"prompts": 2, "group": 3, "max_tokens": 6}, steps=2,
                   eval_size=4)
    assert m.reward.__name__ == "math_verify_reward"
    trainer = make_trainer([], max_steps=2)
    trainer.fit(m)
    assert trainer.logger.values("stale/lag") == [0.0, 0.0] and len(trainer.logger.values("reward/mean")) == 2
    with pytest.raises(ValueError, match="Set model.path to a local checkpoint"):
        GRPOModule(task=task)
    with pytest.raises(ValueError, match="exceeds the model's context of 256"):  # checked for every row up front
        GRPOModule(model={"path": model_dir}, task=task, rollout={"max_tokens": 250})
    with pytest.raises(ValueError, match="task 'math' needs task.path"):
        GRPOModule(model={"path": model_dir}, task={"name": "math"})


def test_run_directory_names_carry_the_rollout_mode_and_bound():
    from gacbench.llm.cli import run_method, run_version

    assert run_version("sync", 0, 0) == "sync-s0-seed0"  # the synchronous and stale names stay as they were
    assert run_version("gac+m2po", 2, 1, {"mode": "sync"}) == "gac+m2po-s2-seed1"
    assert run_version("sync", 0, 0, {"mode": "async", "max_staleness": 3}) == "async-k3-seed0"
    assert run_version("stale", 3, 0, {"mode": "async"}) == "async-k3-seed0"  # the bound from the staleness
    drop = {"mode": "async", "max_staleness": 4, "admission": "drop"}
    assert run_version("gac", 0, 2, drop) == "gac-async-k4-drop-seed2"
    assert run_version("sync", 0, 0, {"mode": "uniform", "max_staleness": 3, "min_staleness": 1}) == \
        "uniform-k1-3-seed0"
    assert run_method("sync", "async") == "async" and run_method("gac", "async") == "gac"
    assert run_method("sync", "sync") == "sync" and run_method("stale", "uniform") == "uniform"


def _refused_line(capsys) -> str:
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("gacbench grpo: error: ") and "Traceback" not in err, err
    return errors[0]


def test_an_earlier_run_in_the_directory_is_refused_or_deleted_with_overwrite(tmp_path):
    from types import SimpleNamespace

    from gacbench.cli import UsageError
    from gacbench.llm.cli import guard_earlier_run

    run_dir, elsewhere = tmp_path / "tiny" / "sync-s0-seed0", tmp_path / "shared-ckpts"
    logger = SimpleNamespace(log_dir=str(run_dir))
    trainer = SimpleNamespace(log_dir=str(run_dir), loggers=[logger], checkpoint_callback=SimpleNamespace(dirpath=None))
    guard_earlier_run(trainer, overwrite=False)  # nothing there yet: a fresh run starts
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "epoch=0-step=2.ckpt").write_bytes(b"x")
    with pytest.raises(UsageError, match=r"sync-s0-seed0 already holds a run \(checkpoints/\); .*--overwrite"):
        guard_earlier_run(trainer, overwrite=False)
    for name in ("summary.json", "metrics.csv", "config.yaml", "config.resume-1.yaml", "notes.txt"):
        (run_dir / name).write_text("{}")
    with pytest.raises(UsageError, match=r"\(checkpoints/, config.resume-1.yaml, config.yaml, metrics.csv, "
                                         r"summary.json\)"):
        guard_earlier_run(trainer, overwrite=False)
    assert len(list(run_dir.rglob("*.*"))) == 6  # refused: nothing deleted
    guard_earlier_run(trainer, overwrite=True)
    assert sorted(p.name for p in run_dir.rglob("*.*")) == ["notes.txt"]  # the run's files only
    elsewhere.mkdir()
    (elsewhere / "other-run.ckpt").write_bytes(b"x")  # a checkpoint directory outside the run's: never deleted
    trainer.checkpoint_callback.dirpath = str(elsewhere)
    (run_dir / "metrics.csv").write_text("step\n")
    guard_earlier_run(trainer, overwrite=True)
    assert (elsewhere / "other-run.ckpt").exists() and not (run_dir / "metrics.csv").exists()


@pytest.mark.slow
@RESUME_WARNINGS
def test_a_finished_run_is_never_replaced_without_overwrite(tiny_llm_dir, tmp_path, capsys):
    args, run_dir = _ckpt_run(tiny_llm_dir, tmp_path)
    assert main(["grpo", *args, "--trainer.max_steps", "4"]) == 0
    files = {name: (run_dir / name).read_bytes() for name in ("metrics.csv", "summary.json", "config.yaml")}
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt"))
    capsys.readouterr()
    assert main(["grpo", *args, "--trainer.max_steps", "3"]) == 2
    line = _refused_line(capsys)
    assert f"{run_dir} already holds a run (checkpoints/, config.yaml, hparams.yaml, metrics.csv, summary.json)" in line
    assert "--trainer.logger.init_args.version" in line and "--ckpt_path last" in line and "--overwrite" in line
    assert {name: (run_dir / name).read_bytes() for name in files} == files  # nothing touched
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt")) == ckpts
    assert main(["grpo", *args, "--trainer.max_steps", "3", "--trainer.logger.init_args.version", "other"]) == 0
    assert _strict_json(tmp_path / "tiny" / "other" / "summary.json")["steps"] == 3
    assert main(["grpo", *args, "--trainer.max_steps", "3", "--overwrite"]) == 0  # replaced: files and checkpoints
    summary = _strict_json(run_dir / "summary.json")
    assert summary["steps"] == 3 and summary["status"] == "finished" and summary["resumed_from"] is None
    assert _logged_steps(run_dir) == [0, 1, 2]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt")) == ["epoch=0-step=2.ckpt"]
    assert main(["grpo", *args, "--trainer.max_steps", "4", "--ckpt_path", "last"]) == 0  # a resume needs no flag
    assert _logged_steps(run_dir) == [0, 1, 2, 3]


@pytest.mark.slow
def test_an_async_run_has_its_own_directory_and_its_summary_says_async(tiny_llm_dir, tmp_path):
    pytest.importorskip("ray")
    import csv

    base = _small(tiny_llm_dir, tmp_path)
    assert main(["grpo", *base, "--trainer.max_steps", "4"]) == 0
    sync_dir = tmp_path / "tiny" / "sync-s0-seed0"
    files = {name: (sync_dir / name).read_bytes() for name in ("metrics.csv", "summary.json", "config.yaml")}
    sync = _strict_json(sync_dir / "summary.json")
    assert sync["method"] == "sync" and sync["staleness"] == 0 and "rollout" not in sync
    assert main(["grpo", *base, "--trainer.max_steps", "4", "--model.rollout.mode", "async",
                 "--model.rollout.max_staleness", "3"]) == 0
    assert {name: (sync_dir / name).read_bytes() for name in files} == files  # the synchronous run is untouched
    run_dir = tmp_path / "tiny" / "async-k3-seed0"
    summary = _strict_json(run_dir / "summary.json")
    assert summary["method"] == "async" and summary["staleness"] == 3 and summary["status"] == "finished"
    rollout = summary["rollout"]
    assert rollout["mode"] == "async" and rollout["max_staleness"] == 3 and rollout["admission"] == "wait"
    rows = [r for r in csv.DictReader((run_dir / "metrics.csv").open()) if r.get("stale/lag")]
    lags, lag_max = [float(r["stale/lag"]) for r in rows], [float(r["stale/lag_max"]) for r in rows]
    hist = rollout["lag_hist"]  # samples per lag 0..3: 4 steps x 4 prompts x 4 samples
    assert len(hist) == 4 and sum(hist) == 4 * 16
    for k, n in enumerate(hist):
        assert n == sum(float(r[f"stale/lag_hist/{k}"]) for r in rows)
    assert rollout["lag_mean"] == pytest.approx(sum(k * n for k, n in enumerate(hist)) / 64)
    assert rollout["lag_mean"] == pytest.approx(sum(lags) / len(lags))  # every step has 16 samples
    assert rollout["lag_max"] == max(lag_max) <= 3 and rollout["dropped"] == 0
    for r in rows:  # each version's reward in the batch: their sample-weighted mean is the batch's reward/mean
        parts = [(float(r[f"stale/lag_hist/{k}"]), float(r[f"reward/lag/{k}"])) for k in range(4)
                 if float(r[f"stale/lag_hist/{k}"] or 0) > 0]
        assert sum(n * v for n, v in parts) / sum(n for n, _ in parts) == pytest.approx(float(r["reward/mean"]))


@pytest.mark.slow
@RESUME_WARNINGS
def test_sigterm_ends_a_run_as_interrupted_with_exit_143_and_it_resumes(tiny_llm_dir, tmp_path):
    import signal

    from conftest import signal_grpo_mid_fit

    args, run_dir = _ckpt_run(tiny_llm_dir, tmp_path)
    returncode, err = signal_grpo_mid_fit([*args, "--trainer.max_steps", "1000"], run_dir, tmp_path, signal.SIGTERM)
    assert returncode == 143, err[-3000:]
    assert "terminated (SIGTERM) after" in err and "resume with --ckpt_path last" in err
    summary = _strict_json(run_dir / "summary.json")
    steps = summary["steps"]
    assert summary["status"] == "interrupted" and 2 <= steps < 1000 and summary["max_steps"] == 1000
    assert summary["eval_acc_final"] is None and summary["eval_acc_initial"] is not None
    assert _logged_steps(run_dir) == list(range(steps))  # the rows of every step it finished
    last = max(int(p.stem.split("step=")[1]) for p in (run_dir / "checkpoints").glob("*.ckpt"))
    assert main(["grpo", *args, "--trainer.max_steps", str(steps + 1), "--ckpt_path", "last"]) == 0
    summary = _strict_json(run_dir / "summary.json")
    assert summary["status"] == "finished" and summary["steps"] == steps + 1
    assert summary["resumed_from"].endswith(f"step={last}.ckpt")
    assert _logged_steps(run_dir) == list(range(steps + 1))


def test_a_resume_after_a_killed_resume_merges_each_step_once(tmp_path):
    """metrics.earlier.csv holds the first session's steps 0-10; a second session resumed from step 6 and was
    killed after writing steps 6-12: the merged rows are the first session's before 6 and the second's from 6."""
    from gacbench.llm.cli import MetricsKeeper, write_rows

    write_rows(tmp_path / "metrics.earlier.csv", [{"step": t, "loss": 1.0} for t in range(11)])
    write_rows(tmp_path / "metrics.csv", [{"step": t, "loss": 2.0} for t in range(6, 13)])
    keeper = MetricsKeeper(tmp_path)
    keeper.before_resume()
    assert [(int(r["step"]), float(r["loss"])) for r in keeper.earlier] == [
        (t, 1.0 if t < 6 else 2.0) for t in range(13)]


def test_the_run_identity_hash_ignores_key_order_and_a_setting_added_since_is_named():
    """Two identities with the same settings in another key order (a YAML section and the command line) hash the
    same and accept each other's checkpoint; a setting absent from the checkpoint's identity is named, also where
    this run has it null; at most four settings are named, then how many more."""
    from gacbench.llm.cli import differing_settings, identity_hash, refuse_other_run

    a = {"method": "gac", "seed_everything": 0, "model": {"task": {"name": "arithmetic", "max_ops": 3}, "lr": 1e-5}}
    b = {"model": {"lr": 1e-5, "task": {"max_ops": 3, "name": "arithmetic"}}, "seed_everything": 0, "method": "gac"}
    assert identity_hash(a) == identity_hash(b)
    refuse_other_run("x.ckpt", {"config_hash": identity_hash(a), "identity": a}, identity_hash(b), b)
    said = differing_settings({"model": {"lr": 1e-4}}, {"model": {"lr": 1e-4, "context": None}})
    assert "--model.context" in said and "unset" in said
    four = differing_settings({"model": dict.fromkeys("abcd", 1)}, {"model": dict.fromkeys("abcd", 2)})
    assert all(f"--model.{k}" in four for k in "abcd") and "more" not in four
    five = differing_settings({"model": dict.fromkeys("abcde", 1)}, {"model": dict.fromkeys("abcde", 2)})
    assert five.endswith("and 1 more")


def test_a_summary_that_is_not_a_json_object_has_no_status(tmp_path):
    from gacbench.llm.cli import _summary_status, finished_run

    (tmp_path / "summary.json").write_text("[1, 2]")
    assert _summary_status(str(tmp_path)) is None and not finished_run(str(tmp_path), 10, 10)


def test_ckpt_path_last_skips_an_unreadable_checkpoint_of_the_same_step(tmp_path):
    """last.ckpt at step 60 beside an unreadable file named step=60: not newer, so the resume takes last.ckpt
    (with a warning naming the unreadable file)."""
    from types import SimpleNamespace

    import torch

    from gacbench.llm.cli import resolve_ckpt

    d = tmp_path / "checkpoints"
    d.mkdir()
    torch.save({"global_step": 60}, d / "last.ckpt")
    (d / "epoch=0-step=60.ckpt").write_bytes(b"not a checkpoint")
    trainer = SimpleNamespace(checkpoint_callback=SimpleNamespace(dirpath=str(d)), loggers=[])
    with pytest.warns(UserWarning, match="epoch=0-step=60.ckpt"):
        path, step = resolve_ckpt(trainer, "last")
    assert Path(path).name == "last.ckpt" and step == 60


@RESUME_WARNINGS
def test_a_resume_names_lost_only_the_steps_a_row_was_logged_at(tiny_llm_dir, tmp_path):
    """Rows logged every 2 steps and the earlier session's rows of step 2 gone from metrics.csv: the resumed run
    names step 2 lost, not the odd steps, at which no row is ever logged."""
    import csv

    args, run_dir = _ckpt_run(tiny_llm_dir, tmp_path)
    args += ["--trainer.log_every_n_steps", "2"]
    assert main(["grpo", *args, "--trainer.max_steps", "4"]) == 0
    path = run_dir / "metrics.csv"
    with path.open() as f:
        reader = csv.DictReader(f)
        fields, rows = reader.fieldnames, [r for r in reader if r["step"] != "2"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    assert main(["grpo", *args, "--trainer.max_steps", "6", "--ckpt_path", "last"]) == 0
    assert _strict_json(run_dir / "summary.json")["metrics_lost_steps"] == [2]


def test_what_several_processes_cannot_do_is_refused_before_the_run(tmp_path):
    """Under DDP: prompts that do not split over the ranks, a rollout mode other than sync, and a checkpoint whose
    rollout queues another number of processes wrote are refused in one line before anything runs."""
    from types import SimpleNamespace

    import torch

    from gacbench.llm.cli import check_processes
    from gacbench.usage import UsageError

    def setup(prompts=32, mode="sync", world=2):
        return (SimpleNamespace(rollout_cfg=SimpleNamespace(prompts=prompts, mode=mode)),
                SimpleNamespace(world_size=world))

    with pytest.raises(UsageError, match="rollout.prompts 31 is not a multiple of the 2 processes"):
        check_processes(*setup(prompts=31), None)
    with pytest.raises(UsageError, match="rollout.mode async runs on one trainer process"):
        check_processes(*setup(mode="async"), None)
    check_processes(*setup(prompts=31, mode="uniform", world=1), None)  # one process: anything goes
    two = tmp_path / "two.ckpt"
    torch.save({"global_step": 3, "rollout_queue": {"by_rank": [{"items": []}, {"items": []}]}}, two)
    with pytest.raises(UsageError, match="rollout queues are those of 2 processes, this run has 1.*2 devices"):
        check_processes(*setup(world=1), str(two))
    check_processes(*setup(world=2), str(two))
    one = tmp_path / "one.ckpt"
    torch.save({"global_step": 3, "rollout_queue": {"items": [(1, {})]}}, one)
    with pytest.raises(UsageError, match="queue is one process's, this run has 2.*1 device"):
        check_processes(*setup(world=2), str(one))
    check_processes(*setup(world=1), str(one))


def _rank_process(parent: int, rank: int) -> int:
    """The pid of the child of ``parent`` that runs DDP rank ``rank`` (its environment's ``LOCAL_RANK``)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != parent:
                continue
            env = (stat.parent / "environ").read_bytes().split(b"\0")
            if f"LOCAL_RANK={rank}".encode() in env:
                return int(stat.parent.name)
    raise AssertionError(f"no child of {parent} runs rank {rank}")


@pytest.mark.slow  # three runs of two processes each
@pytest.mark.distributed
@pytest.mark.parametrize("signum,target", [("SIGINT", "rank0"), ("SIGTERM", "group"), ("SIGINT", "rank1"),
                                           ("SIGINT", "rank1-start")])
def test_a_ddp_run_signalled_mid_step_ends_on_every_rank_with_one_summary(tiny_llm_dir, tmp_path, signum, target):
    """SIGINT to rank 0 alone (rank 1 then waits in the step's collectives: rank 0 ends it), SIGTERM to every
    rank, as a scheduler sends it, and SIGINT to rank 1 alone (each rank's flag is combined at the end of the step,
    so all stop after the same step), also while rank 1 starts, before its fit (it stops after the first step): the
    run ends within seconds, interrupted, with one summary naming the signal, and no process left."""
    import os
    import signal
    import subprocess
    import sys
    import time

    command = Path(sys.executable).with_name("gacbench")
    if not command.exists():
        pytest.skip("the gacbench command is not installed beside this interpreter")
    args, run_dir = _ckpt_run(tiny_llm_dir, tmp_path)
    proc = subprocess.Popen([str(command), "grpo", *args, "--trainer.strategy", "ddp", "--trainer.devices", "2",
                             "--trainer.accelerator", "cpu", "--trainer.max_steps", "1000"], cwd=tmp_path,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        started = None  # rank 1's process, signalled once it is in the command (it loads torch), before its fit
        while target == "rank1-start" and started is None:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            with contextlib.suppress(AssertionError, OSError):
                pid = _rank_process(proc.pid, 1)
                if "libtorch" in Path(f"/proc/{pid}/maps").read_text():
                    started = pid
            time.sleep(0.05)
        while started is None and not (run_dir / "checkpoints" / "epoch=0-step=2.ckpt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.1)
        sig = getattr(signal, signum)
        if started is not None:
            os.kill(started, sig)
        elif target == "group":
            os.killpg(proc.pid, sig)
        elif target == "rank1":  # the process Lightning's launcher started for rank 1
            os.kill(_rank_process(proc.pid, 1), sig)
        else:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + getattr(signal, signum), err[-3000:]
    assert out.count("wrote ") == 1
    assert f"({signum})" in err and "Traceback" not in err, err[-3000:]
    summary = _strict_json(run_dir / "summary.json")
    first = 1 if target == "rank1-start" else 2
    assert summary["status"] == "interrupted" and summary["processes"] == 2 and first <= summary["steps"] < 1000
    time.sleep(1)
    from conftest import alive

    def group() -> list[int]:  # the processes of the run's session (a zombie no init reaped does not count)
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError):
                if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == proc.pid:
                    pids.append(int(stat.parent.name))
        return [p for p in pids if alive(p)]

    assert group() == [], "a rank of the run is still alive"
