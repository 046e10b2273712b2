"""``gacbench grpo``: one GRPO run from a config file, with LightningCLI conventions.

    gacbench grpo --config tasks/llm/tiny.yaml [--config overlay.yaml] [--model.staleness=16]
                  [--method gac] [--trainer.max_steps=200] [--ckpt_path last] [--overwrite]

The config has LightningCLI's three sections: ``trainer`` (any ``lightning.Trainer`` argument, with
callbacks and loggers as ``class_path``/``init_args``), ``model`` (``GRPOModule``'s arguments:
``staleness``, ``lr``, ``seed``, ``eval_every``, ``eval_size`` and the sections ``model``, ``engine``,
``task``, ``rollout``, ``loss``, e.g. ``--model.engine.name hf``) and ``seed_everything``. Two keys are
gacbench's own: ``method`` (a method of ``gacbench methods``, a
stabilizer name, or a ``+`` combination such as ``gac+m2po``; its callbacks are added to the trainer,
next to an ``AlignmentMonitor`` so that c_t is logged in every run) and ``ckpt_path`` (resume; ``last``
takes the checkpoint of the run's checkpoint directory with the highest step recorded inside it).
``trainer.max_steps`` is linked to ``model.steps``. A logger whose ``version`` is null gets
``METHOD-sSTALENESS-seedSEED`` (``rollout.mode: sync``), ``METHOD-async-kK-seedSEED`` (``async``, K the
bound, ``-drop`` after it under ``admission: drop``) or ``METHOD-uniform-kLO-K-seedSEED`` (``uniform``), where
the plain methods sync and stale leave their name out in the two last (``async-k3-seed0``): runs of one config
with other methods, rollout modes, bounds or seeds do not overwrite each other (set the version yourself when
you vary anything else), and ``--ckpt_path last`` resumes into that directory.

A fresh run (no ``--ckpt_path``) whose directory already holds a run (its ``summary.json``, ``metrics.csv``,
``config.yaml``, ``hparams.yaml`` or checkpoints) is refused before anything runs, naming the directory and the
fixes: another version or save directory, ``--ckpt_path last``, or ``--overwrite``, which deletes those files
(and the ``*.ckpt`` of a checkpoint directory inside the run's) and starts afresh.

A run claims its directory (the logger's) for as long as it runs, as the bench runner claims a cell: an exclusive
``flock`` on ``.claim`` there, recording its pid. A second run on a directory held by a live run is refused in one
line naming the holder's pid; a claim left by a run that was killed is taken over, saying so on stderr.

Every checkpoint records the run's config hash (:func:`run_hash`: the method, ``seed_everything``, the ``model``
section less ``model.steps``, since a resume with a larger ``trainer.max_steps`` continues the same run, and the
trainer's gradient clipping, accumulation and precision where they are set; a record written before those joined it
is matched on the rest). A
checkpoint of another run (a ``ModelCheckpoint`` directory shared by two runs) is refused at ``--ckpt_path``,
naming it and both hashes. A resume of a finished run (its checkpoint at ``max_steps`` and its summary
``finished``) changes nothing: it says so in one line and exits 0; ``--refresh_summary`` evaluates it again and
rewrites its summary.json.

A resume keeps what the earlier sessions wrote to a CSVLogger's ``metrics.csv``. Lightning's CSVLogger deletes
``metrics.csv`` when fit starts, so the earlier rows are first copied to ``metrics.earlier.csv``; when the resumed
session ends, whether it finished or failed, ``metrics.csv`` is rewritten as the earlier rows before the checkpoint's
step followed by the new rows, and the copy removed. If the process is killed, the copy stays and the
next resume merges it. The loggers write their rows at every checkpoint and at the start of the step after it
(:class:`RunRecorder`), and a resumed session runs the evaluations due at its checkpoint's step (by the max_steps of
the session that wrote it) that the earlier rows lack, also when no step is left to run (Lightning logs them after
writing the checkpoint: a session killed in between had not written them); steps
still without rows before the checkpoint are named on stderr and in the summary's ``metrics_lost_steps``. A run
stopped before its first checkpoint is started again with ``--overwrite``; a finished run without a checkpoint cannot
be continued. A resumed session saves its config as
``config.resume-N.yaml`` beside the first session's ``config.yaml``. The summary's c_t statistics cover the
resumed segment only. At the end the run writes ``summary.json`` (``method``, ``status`` ``finished``, ``steps``
and ``max_steps``, initial and final
``eval/acc``, c_t statistics, time shares; non-finite numbers as null) into the logger's directory and prints
it. Under DDP every rank runs the command and rank 0 alone writes the run's files (the summary records
``processes``; its step times and tokens are rank 0's process's). The summary of an async or uniform run
records under ``rollout`` its mode, bound, admission, realised lags
(``lag_mean``, ``lag_min``, ``lag_max`` and ``lag_hist``, samples per lag 0..K, of this session) and the
counters of the whole run (``dropped``, ``regenerated``, ``worker_restarts``); a plain method (sync, stale)
there is recorded as the mode (``"method": "async"``).

SIGTERM (a scheduler's pre-emption, ``kill``) stops the fit at the end of the current step (Lightning's
signal handling), SIGINT (Ctrl-C) at once; the run then writes ``summary.json`` with ``"status": "interrupted"``,
the steps done and no final evaluation, prints one line on stderr, and exits 143 (128 + SIGTERM) or 130 (SIGINT).
SIGINT before the fit starts (while the model loads) ends the command with one line and exit 130. It resumes
with ``--ckpt_path last`` from its last checkpoint (``ModelCheckpoint``; none is written at the signal). Under DDP,
SIGTERM to any rank, and SIGINT to a rank other than 0, stop every rank after the same step (:class:`RunRecorder`),
and rank 0 stopped by SIGINT ends the other ranks (:func:`stop_other_ranks`); rank 0 alone evaluates, writes the
summary and gives the exit status.

A bad option, config value or checkpoint raises :class:`gacbench.cli.UsageError` (one line, exit 2
from ``gacbench``), naming the option and the fix.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import re
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from gacbench.llm.grpo import GRPOModule
from gacbench.usage import FLAGGED, Interrupted, UsageError, flag_signal, raise_interrupted, started_rank

EARLIER = "metrics.earlier.csv"  # the rows of earlier sessions while a resumed session runs


class GRPOCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--method", type=str, default="sync",
                            help="sync, stale, gac, gac-skip, m2po, bapo, tis, decoupled-ppo, gac+m2po, ... "
                                 "(`gacbench methods`, `gacbench stabilizers`); 'sync' requires model.staleness=0")
        parser.add_argument("--ckpt_path", type=str | None, default=None,
                            help="resume from this checkpoint; 'last' = the run's checkpoint with the highest step "
                                 "recorded inside it")
        parser.add_argument("--alignment_warmup", type=int, default=5,
                            help="steps the AlignmentMonitor leaves out of its statistics")
        parser.add_argument("--overwrite", action="store_true",
                            help="replace the run already in the logger's directory (its metrics, config, summary and "
                                 "checkpoints are deleted first); without it such a run is refused")

        parser.add_argument("--refresh_summary", action="store_true",
                            help="with --ckpt_path, let the resume of a finished run (its checkpoint at max_steps) "
                                 "evaluate it again and rewrite its summary.json; without it that run is left as is")

        parser.link_arguments("trainer.max_steps", "model.steps")

    def before_instantiate_classes(self) -> None:
        from gacbench.methods import method_callbacks, parse_method

        try:
            method, _ = parse_method(self.config.method)  # a clear error for an unknown name
            method_callbacks(self.config.method)  # and for an unknown setting
        except ValueError as exc:
            raise UsageError(f"--method: {exc}") from None
        staleness, max_steps = self.config.model.staleness, self.config.trainer.max_steps
        if not method.stale and staleness > 0:
            raise UsageError(f"--method {self.config.method} is synchronous but model.staleness={staleness}; "
                             "use --method stale (or gac, m2po, ...) for a stale run, or --model.staleness=0")
        if max_steps is None or max_steps < 1:
            raise UsageError("set trainer.max_steps (a GRPO run is measured in optimizer steps)")
        if staleness >= max_steps:
            raise UsageError(f"--model.staleness {staleness} is not below --trainer.max_steps {max_steps}: the lag "
                             f"at step t is at most t, so no step would be {staleness} steps stale; use a smaller "
                             "staleness or more steps")
        logger = self.config.trainer.get("logger")
        init = logger.get("init_args") if hasattr(logger, "get") else None
        if init is not None and "version" in init and init.get("version") is None:  # one directory per run
            init["version"] = run_version(self.config.method, self.config.model.staleness, self.config.model.seed,
                                          self.config.model.get("rollout"))

    def instantiate_classes(self) -> None:
        """Build the module and trainer; a ValueError or FileNotFoundError raised while building them from the
        config (a setting the module refuses, a missing model directory) is the config's fault: a UsageError."""
        try:
            super().instantiate_classes()
        except UsageError:
            raise
        except (ValueError, FileNotFoundError) as exc:
            raise UsageError(f"the config: {exc}") from exc

    def instantiate_trainer(self, **kwargs):
        from gacbench.callbacks import AlignmentMonitor
        from gacbench.methods import method_callbacks

        configured = list(self.config_init.trainer.get("callbacks") or [])
        monitor = AlignmentMonitor(warmup=self.config.alignment_warmup, step_cos=True)
        extra = [monitor, *method_callbacks(self.config.method)]
        return super().instantiate_trainer(callbacks=[*configured, *extra], **kwargs)


PLAIN_METHODS = ("sync", "stale")  # no callbacks: the rollout mode alone says what the run is


def _setting(section, key: str, default=None):
    """A field of a config section given as a namespace, a dict, a dataclass or None."""
    if section is None:
        return default
    if isinstance(section, dict):
        return section.get(key, default)
    return getattr(section, key, default)


def run_version(method: str, staleness: int, seed: int, rollout=None) -> str:
    """The logger version of a run whose version is null: everything that makes it another run of the same config.

    ``rollout.mode: sync``: ``METHOD-sS-seedSEED`` (S the staleness). ``async``: ``METHOD-async-kK-seedSEED``, K the
    bound (``rollout.max_staleness``, else the staleness), with ``-drop`` after K under ``rollout.admission: drop``.
    ``uniform``: ``METHOD-uniform-kLO-K-seedSEED`` (LO = ``rollout.min_staleness``). In the two other modes the
    plain methods (sync, stale) leave their name out: ``async-k3-seed0``."""
    name = "".join(ch if ch.isalnum() or ch in "-_+.=" else "_" for ch in method)
    mode = _setting(rollout, "mode", "sync") or "sync"
    if mode == "sync":
        return f"{name}-s{staleness}-seed{seed}"
    bound = _setting(rollout, "max_staleness")
    bound = staleness if bound is None else bound
    if mode == "uniform":
        part = f"uniform-k{_setting(rollout, 'min_staleness', 0)}-{bound}"
    else:
        drop = "-drop" if _setting(rollout, "admission", "wait") == "drop" else ""
        part = f"{mode}-k{bound}{drop}"
    return f"{part}-seed{seed}" if method in PLAIN_METHODS else f"{name}-{part}-seed{seed}"


def run_method(method: str, mode: str) -> str:
    """The method a run's summary records: the given one, except that a plain method (sync, stale) outside
    ``rollout.mode: sync`` is recorded as its mode (``async``, ``uniform``)."""
    return mode if mode != "sync" and method in PLAIN_METHODS else method


RUN_FILES = ("summary.json", "metrics.csv", EARLIER, "config.yaml", "hparams.yaml")


def _ckpt_dir(trainer) -> Path | None:
    """The run's checkpoint directory (ModelCheckpoint's ``dirpath``, else its default under the logger's
    directory), or None without checkpointing."""
    callback = trainer.checkpoint_callback
    ckpt_dir = callback.dirpath if callback else None
    if callback and ckpt_dir is None and trainer.loggers:  # ModelCheckpoint's own default, resolved only at fit time
        ckpt_dir = str(Path(trainer.loggers[0].log_dir) / "checkpoints")
    return Path(ckpt_dir) if ckpt_dir else None


def earlier_run_files(trainer) -> list[Path]:
    """The files of a run already in the trainer's log directory: metrics, configs, summary, and the checkpoints
    of a checkpoint directory inside it."""
    log_dir = Path(trainer.log_dir or ".")
    found = [log_dir / f for f in RUN_FILES if (log_dir / f).is_file()]
    found += sorted(log_dir.glob("config.resume-*.yaml"))
    ckpt_dir = _ckpt_dir(trainer)
    if ckpt_dir is not None and ckpt_dir.resolve().is_relative_to(log_dir.resolve()) and ckpt_dir.is_dir():
        found += sorted(ckpt_dir.glob("*.ckpt"))
    return found


def guard_earlier_run(trainer, overwrite: bool) -> None:
    """A fresh run (no ``--ckpt_path``) never replaces the files of a run already in its directory: refused in one
    line naming the directory and the fixes, unless ``overwrite``, which deletes them first."""
    found = earlier_run_files(trainer)
    if not found:
        return
    log_dir = Path(trainer.log_dir or ".")
    if not overwrite:
        names = sorted({p.name if p.parent == log_dir else str(p.relative_to(log_dir).parent) + "/" for p in found})
        raise UsageError(f"{log_dir} already holds a run ({', '.join(names)}); this run would replace its files. Give "
                         "it another directory (--trainer.logger.init_args.version NAME, or another "
                         "--trainer.logger.init_args.save_dir / --trainer.default_root_dir), resume that run with "
                         "--ckpt_path last, or replace it with --overwrite")
    for path in found:
        path.unlink()


class RunConfigSaver(SaveConfigCallback):
    """LightningCLI's config saver, except that a resumed session (``--ckpt_path``) writes its config to
    ``config.resume-N.yaml`` (the first free N) instead of overwriting the first session's ``config.yaml``."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not self.already_saved and self.config.get("ckpt_path") and trainer.log_dir:
            log_dir = Path(trainer.log_dir)
            if (log_dir / self.config_filename).exists():
                n = 1
                while (log_dir / f"config.resume-{n}.yaml").exists():
                    n += 1
                self.config_filename = f"config.resume-{n}.yaml"
        super().setup(trainer, pl_module, stage)


RUN_KEY = "gacbench_run"  # a checkpoint's record of the run it belongs to: {"config_hash": ..., "identity": {...}}
#: The run record's version: 2 holds the trainer settings that change the update in the identity (where set) and the
#: session's max_steps; a record without a version is older
RUN_RECORD_VERSION = 2
HASH_EXCLUDED = ("steps",)  # model settings a resume may change: more steps continue the same run
# (section, key): value at which a model setting is left out of the hash, so that a config without the key (which
# runs with that value) and one that spells it out have the same hash
HASH_AT_DEFAULT = {("engine", "compile"): False}


#: Trainer settings that change the update, with the values at which they change nothing (Lightning's defaults):
#: a run identity holds those set otherwise, so that a resume cannot clip, accumulate or round differently from the
#: steps before its checkpoint
UPDATE_TRAINER_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "gradient_clip_val": (None, 0, 0.0),
    "gradient_clip_algorithm": (None, "norm"),
    "accumulate_grad_batches": (1,),
    "precision": (None, 32, "32", "32-true"),
}


def run_identity(config) -> dict[str, Any]:
    """What identifies a run, as plain JSON values: its method, ``seed_everything`` and ``model`` section (every
    GRPOModule argument), less ``model.steps`` (``trainer.max_steps``: resuming with more steps continues the same
    run) and the settings of :data:`HASH_AT_DEFAULT` at their listed values, and under ``trainer`` the settings of
    :data:`UPDATE_TRAINER_DEFAULTS` set to change the update (gradient clipping, accumulation, precision). The
    trainer's other settings (devices, logging, checkpointing) are left out: a run may resume on another machine
    or with another logger."""
    model = config.model.as_dict() if hasattr(config.model, "as_dict") else dict(config.model)
    model = {k: v for k, v in model.items() if k not in HASH_EXCLUDED}
    for (section, key), value in HASH_AT_DEFAULT.items():
        part = model.get(section)
        if isinstance(part, dict) and key in part and part[key] == value:
            model[section] = {k: v for k, v in part.items() if k != key}
    ident = {"method": config.method, "seed_everything": config.get("seed_everything"), "model": model}
    trainer = config.get("trainer") or {}
    trainer = trainer.as_dict() if hasattr(trainer, "as_dict") else dict(trainer)
    update = {k: trainer[k] for k, unchanged in UPDATE_TRAINER_DEFAULTS.items()
              if k in trainer and trainer[k] not in unchanged}
    if "gradient_clip_val" not in update:  # Lightning clips only with a value: the algorithm alone changes nothing
        update.pop("gradient_clip_algorithm", None)
    if update:
        ident["trainer"] = update
    return json.loads(json.dumps(ident, default=str))


def run_hash(config) -> str:
    """The identity of a run (:func:`run_identity`) as a 16-digit hash, recorded in its checkpoints."""
    return identity_hash(run_identity(config))


def identity_hash(identity: dict[str, Any]) -> str:
    """A run identity's 16-digit hash (SHA-256 of its sorted JSON)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


class RunRecorder(Callback):
    """Writes the run's :func:`run_hash` and :func:`run_identity` into every checkpoint it saves
    (``checkpoint["gacbench_run"]``), so that a resume of another run is refused naming the settings that differ.

    It also writes the loggers' rows to disk at each checkpoint and again at the start of the next step (Lightning
    logs a step's row after the checkpoint taken at its end): a resume starts from the checkpoint, so rows held in
    a logger's buffer (CSVLogger writes every 100 steps) would otherwise be lost with a killed process, and never
    be logged again."""

    def __init__(self, config_hash: str, identity: dict[str, Any] | None = None) -> None:
        self.config_hash, self.identity = config_hash, identity
        self._saved = False  # a checkpoint was saved whose step's rows are not yet on disk
        self.stopped_by = 0  # under DDP: the signal that stopped every rank at the end of a step (SIGTERM wins)

    def on_train_start(self, trainer, pl_module) -> None:
        """Under DDP, SIGTERM only sets a flag (:func:`gacbench.usage.flag_signal`), which the ranks combine at the
        end of every step (:meth:`on_train_batch_end`), so that all of them stop after the same step. Lightning's
        own handler broadcasts inside the signal handler and signals the other ranks, which deadlocks when a
        scheduler signals every rank (two handlers' broadcasts on one rank meet another rank's collective of the
        step). SIGINT to a rank other than 0 sets the same flag (from the command's start: ``gacbench.cli``):
        raised there, it would end that rank and leave rank 0 waiting in the step's collectives, or ended by
        Lightning's launcher (SIGKILL) when the rank exits. Rank 0 stopped by SIGINT stops at once
        (:func:`stop_other_ranks`)."""
        if trainer.world_size > 1:
            signal.signal(signal.SIGTERM, flag_signal)  # Lightning puts its handlers back when the fit ends
            if not trainer.is_global_zero:
                signal.signal(signal.SIGINT, flag_signal)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.world_size > 1:
            import torch

            stop = torch.tensor([float(FLAGGED["signum"])], device=trainer.strategy.root_device)
            torch.distributed.all_reduce(stop, op=torch.distributed.ReduceOp.MAX)
            if stop.item() > 0:  # Lightning ends the fit on every rank at the end of this step
                self.stopped_by = int(stop.item())
                trainer._signal_connector.received_sigterm = True

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        record: dict[str, Any] = {"config_hash": self.config_hash, "version": RUN_RECORD_VERSION,
                                  "max_steps": trainer.max_steps}
        if self.identity is not None:
            record["identity"] = self.identity
        checkpoint[RUN_KEY] = record
        self._write_rows(trainer)
        self._saved = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._saved:
            self._write_rows(trainer)
            self._saved = False

    @staticmethod
    def _write_rows(trainer) -> None:
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.save()


def read_checkpoint(path: Path) -> tuple[int, dict[str, Any] | None]:
    """``(global_step, run record)`` of a Lightning checkpoint (its tensors memory-mapped, not read): the record
    :class:`RunRecorder` wrote (``config_hash``, and ``identity`` where recorded), None for a checkpoint written
    without one; raises for a file that cannot be read as one."""
    import torch

    ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    step = ckpt.get("global_step") if isinstance(ckpt, dict) else None
    if not isinstance(step, int):
        raise ValueError("it records no global_step (not a Lightning checkpoint)")
    record = ckpt.get(RUN_KEY)
    return step, record if isinstance(record, dict) else None


def check_checkpoint_run(path: str | Path, config_hash: str | None, identity: dict[str, Any] | None = None) -> None:
    """Refuse a checkpoint that records another run's hash than ``config_hash`` (a ModelCheckpoint directory
    shared by two runs), naming the checkpoint, both hashes and, where the checkpoint records its run's identity,
    the settings that differ from ``identity``."""
    if config_hash is not None:
        refuse_other_run(path, read_checkpoint(Path(path))[1], config_hash, identity)


def differing_settings(recorded: dict[str, Any], identity: dict[str, Any], most: int = 4) -> str:
    """The settings in which two run identities (:func:`run_identity`) differ, named as ``gacbench grpo``'s
    options: ``--KEY A in the checkpoint, B in this run`` (at most ``most`` of them, then how many more)."""
    from gacbench.jsonio import flat_params

    a, b = flat_params(recorded), flat_params(identity)
    keys = sorted(k for k in set(a) | set(b) if a.get(k, "unset") != b.get(k, "unset"))
    text = "; ".join(f"--{k} {json.dumps(a.get(k, 'unset'))} in the checkpoint, {json.dumps(b.get(k, 'unset'))} "
                     "in this run" for k in keys[:most])
    return text + (f"; and {len(keys) - most} more" if len(keys) > most else "")


def refuse_other_run(path: str | Path, recorded: dict[str, Any] | None, config_hash: str | None,
                     identity: dict[str, Any] | None = None) -> None:
    """:func:`check_checkpoint_run` given the run record ``recorded`` already read from the checkpoint at
    ``path``."""
    other = recorded.get("config_hash") if recorded else None
    if config_hash is None or other is None or other == config_hash:
        return
    kept = recorded.get("identity")
    if identity is not None and "trainer" in identity and recorded.get("version") is None:
        # a record written before the trainer settings were part of a run's identity (it has no version): the same
        # run if the rest agrees, since it cannot say how its steps were clipped, accumulated or rounded
        rest = {k: v for k, v in identity.items() if k != "trainer"}
        if other == identity_hash(rest):
            return
    differ = (differing_settings(kept, identity) if isinstance(kept, dict) and identity is not None else "")
    differ = differ or "another method, seed or model setting"
    raise UsageError(f"--ckpt_path: {path} belongs to another run (its config hash {other}, this run's "
                     f"{config_hash}: {differ}); resume from a checkpoint of this run, or give each run its own "
                     "ModelCheckpoint dirpath")


def claim_run_dir(log_dir: Path, stack: contextlib.ExitStack) -> None:
    """Claim the run directory ``log_dir`` for this process until ``stack`` closes (an exclusive ``flock`` on
    ``log_dir/.claim``, recording pid, host and start time: :func:`gacbench.jsonio.claim_dir`, as the bench runner
    claims a cell; the record is cleared when ``stack`` closes): a directory another live process holds is refused
    in one line naming its pid; a claim whose holder is gone is taken over, saying so on stderr."""
    from gacbench.jsonio import CLAIM_FILE, claim_dir, pid_alive

    held, holder = stack.enter_context(claim_dir(log_dir))  # held: this process's record is written
    if held:  # a clean end clears the record (before the lock is released), so a record found here is stale
        stack.callback((log_dir / CLAIM_FILE).write_text, "")
    if not held:
        pid = holder.get("pid", "unknown: it has not written its record yet")
        raise UsageError(f"{log_dir} is in use by another gacbench grpo run (pid {pid}"
                         f"{' on ' + str(holder['host']) if holder.get('host') else ''}); wait for it to end, or give "
                         "this run another directory (--trainer.logger.init_args.version NAME)")
    pid = holder.get("pid")
    if isinstance(pid, int) and pid != os.getpid():  # its holder ended without releasing it (killed, crashed)
        state = "no longer running" if not pid_alive(pid) else "no longer holding it"
        print(f"gacbench grpo: taking over {log_dir}: the run that claimed it (pid {pid}) is {state}",
              file=sys.stderr)


def _summary_status(log_dir: str | None) -> str | None:
    """The ``status`` of the run's summary.json in ``log_dir``, None where there is none or it cannot be read."""
    try:
        status = json.loads((Path(log_dir) / "summary.json").read_text()).get("status") if log_dir else None
    except (OSError, ValueError, AttributeError):
        return None
    return status if isinstance(status, str) else None


def finished_run(log_dir: str | None, ckpt_step: int | None, max_steps: int) -> bool:
    """Whether a resume (``ckpt_step`` not None) has nothing left to do: its checkpoint is at ``max_steps`` or
    beyond and the run's summary.json records ``"status": "finished"``."""
    if ckpt_step is None or log_dir is None or ckpt_step < max_steps:
        return False
    return _summary_status(log_dir) == "finished"


def _reason(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:200]


def _name_step(path: Path) -> int | None:
    m = re.search(r"step=(\d+)", path.name)
    return int(m.group(1)) if m else None


def resolve_ckpt(trainer, ckpt_path: str | None, config_hash: str | None = None,
                 identity: dict[str, Any] | None = None) -> tuple[str | None, int | None]:
    """``(path, step)`` of the checkpoint to resume from, or ``(None, None)`` for a fresh run.

    ``last``: of the run's checkpoint directory, the checkpoint with the highest ``global_step`` recorded
    inside it (not the newest file: a copied run directory has arbitrary modification times; at equal steps
    a ``step=N`` file before ``last.ckpt``). An unreadable checkpoint that may be newer than the best readable
    one (a higher ``step=N`` in its name, or, without one, a later modification time) is refused, naming it
    and the previous good one; older unreadable ones are skipped with a warning. With ``config_hash`` (the run's
    :func:`run_hash`), a checkpoint chosen that records another run's hash is refused
    (:func:`check_checkpoint_run`), naming the settings that differ from ``identity`` (:func:`run_identity`)."""
    if ckpt_path is None:
        return None, None
    if ckpt_path != "last":
        path = Path(ckpt_path)
        if not path.is_file():
            raise UsageError(f"--ckpt_path {ckpt_path}: no such checkpoint file "
                             "(--ckpt_path last takes the run's latest)")
        try:
            step, recorded = read_checkpoint(path)
        except Exception as exc:  # any failure to read the file: the file is the problem
            raise UsageError(f"--ckpt_path {path} cannot be read as a checkpoint ({_reason(exc)}); give another "
                             "checkpoint of the run, or --ckpt_path last") from None
        refuse_other_run(path, recorded, config_hash, identity)
        return str(path), step
    ckpt_dir = _ckpt_dir(trainer)
    found = sorted(ckpt_dir.glob("*.ckpt")) if ckpt_dir and ckpt_dir.is_dir() else []
    if not found:
        if _summary_status(trainer.log_dir) == "finished":
            raise UsageError(f"--ckpt_path last: the run in {trainer.log_dir} finished without writing a checkpoint "
                             f"(none in {ckpt_dir}: ModelCheckpoint's every_n_train_steps above its steps, or no "
                             "ModelCheckpoint), so it cannot be continued; run it again in another directory "
                             "(--trainer.logger.init_args.version NAME), or replace it with --overwrite")
        again = (" (with --overwrite: the files there are of a run stopped before its first checkpoint)"
                 if earlier_run_files(trainer) else "")
        raise UsageError(f"--ckpt_path last: no checkpoint in {ckpt_dir}; start the run without --ckpt_path{again}")
    good: list[tuple[int, Path, dict[str, Any] | None]] = []  # (step, path, the run record it holds)
    bad: list[tuple[Path, str]] = []
    for path in found:
        try:
            step, recorded = read_checkpoint(path)
        except Exception as exc:  # an unreadable checkpoint: reported below
            bad.append((path, _reason(exc)))
        else:
            good.append((step, path, recorded))
    best = max(good, key=lambda sp: (sp[0], sp[1].name != "last.ckpt", sp[1].stat().st_mtime), default=None)
    for path, reason in bad:
        if best is None:
            raise UsageError(f"--ckpt_path last: no readable checkpoint in {ckpt_dir} ({path} cannot be read: "
                             f"{reason}); start the run without --ckpt_path")
        step = _name_step(path)
        if step > best[0] if step is not None else path.stat().st_mtime >= best[1].stat().st_mtime:
            raise UsageError(f"--ckpt_path last: the newest checkpoint {path} cannot be read ({reason}); the "
                             f"previous good one is {best[1]} (step {best[0]}): resume from it with --ckpt_path "
                             f"{best[1]}, after moving {path} out of {ckpt_dir}")
        warnings.warn(f"--ckpt_path last: skipping the unreadable older checkpoint {path} ({reason})", stacklevel=2)
    refuse_other_run(best[1], best[2], config_hash, identity)
    return str(best[1]), best[0]


def _step(row: dict) -> int | None:
    try:
        return int(float(row.get("step") or ""))
    except (TypeError, ValueError):
        return None


def _spans(steps: list[int]) -> str:
    """Sorted integers as ranges: [0, 1, 2, 5] -> "0-2, 5"."""
    spans: list[list[int]] = []
    for t in steps:
        if spans and t == spans[-1][1] + 1:
            spans[-1][1] = t
        else:
            spans.append([t, t])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def read_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a metrics.csv with a readable step (a row cut off by a crash keeps what it has)."""
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        rows = [{k: v for k, v in r.items() if k is not None and v is not None} for r in csv.DictReader(f)]
    return [r for r in rows if _step(r) is not None]


def combine_rows(earlier: list[dict], later: list[dict], start: int) -> list[dict]:
    """The rows of ``earlier`` before step ``start`` (and its evaluation-only rows at ``start``: the greedy and
    policy evaluations that closed the step the checkpoint was taken after, which the resumed session does not
    repeat; a policy evaluation's row also holds its time), then the rows of ``later``."""
    def eval_only(row: dict) -> bool:
        return all(k in ("step", "time/policy_eval_s") or k.startswith("eval/")
                   for k, v in row.items() if v not in ("", None))

    kept = [r for r in earlier if _step(r) < start or (_step(r) == start and eval_only(r))]
    return kept + later


def write_rows(path: Path, rows: list[dict]) -> None:
    """Write ``rows`` as a CSV (columns sorted, as Lightning's CSVLogger writes them), atomically."""
    keys = sorted({k for r in rows for k in r})
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def _writes_metrics_csv(trainer, log_dir: str) -> bool:
    """Whether one of the trainer's loggers is a CSVLogger writing ``log_dir``/metrics.csv (the file
    :class:`MetricsKeeper` keeps; another logger's records are its own)."""
    from lightning.pytorch.loggers import CSVLogger

    return any(isinstance(lg, CSVLogger) and lg.log_dir == log_dir for lg in trainer.loggers)


class MetricsKeeper:
    """Keeps the earlier sessions' rows of a run's metrics.csv across a resumed session (see the module doc).
    ``writes``: False on the DDP ranks other than 0, which read the earlier rows (for :meth:`logged_at`) and write
    nothing: rank 0's logger writes metrics.csv, and rank 0 alone puts the earlier rows back."""

    def __init__(self, log_dir: str | os.PathLike, writes: bool = True) -> None:
        self.path = Path(log_dir) / "metrics.csv"
        self.earlier_path = Path(log_dir) / EARLIER
        self.earlier: list[dict] = []
        self.writes = writes

    def before_resume(self) -> None:
        """Copy the rows written so far (with those left by a killed session) to metrics.earlier.csv. The rows
        read are the same before and after rank 0's copy (its logger has not yet started), so every rank reads
        the same earlier rows."""
        saved, current = read_rows(self.earlier_path), read_rows(self.path)
        if current:
            saved = combine_rows(saved, current, min(_step(r) for r in current))
        self.earlier = saved
        if saved and self.writes:
            write_rows(self.earlier_path, saved)

    def logged_at(self, step: int) -> frozenset[str]:
        """The ``eval/`` keys of the earlier rows at ``step``."""
        return frozenset(k for r in self.earlier if _step(r) == step for k, v in r.items()
                         if k.startswith("eval/") and v not in ("", None))

    def after_resume(self, start: int, every: int = 1) -> list[int]:
        """metrics.csv := the earlier rows before step ``start``, then this session's; the copy removed. Returns
        the steps before ``start`` at which a row was logged (the multiples of ``every``, the trainer's
        ``log_every_n_steps``: gacbench.callbacks._common.log_metrics) and none is kept: rows an earlier session
        lost. Nothing on a rank that does not write (an empty list)."""
        if not self.writes:
            return []
        if self.earlier:
            write_rows(self.path, combine_rows(self.earlier, read_rows(self.path), start))
        self.earlier_path.unlink(missing_ok=True)
        kept = {_step(r) for r in self.earlier}
        return [t for t in range(start) if t % every == 0 and t not in kept]


ROLLOUT_RECORD = ("max_staleness", "min_staleness", "admission", "lag_mean", "lag_min", "lag_max", "lag_hist",
                  "dropped", "regenerated", "worker_restarts", "resume_regenerated", "workers")


def rollout_record(source_summary: dict) -> dict:
    """What summary.json keeps of a rollout source's summary (async, uniform): the bound, the realised lags (mean,
    min, max, the histogram of samples per lag 0..K of this session) and the counters over the whole run."""
    return {k: source_summary[k] for k in ROLLOUT_RECORD if k in source_summary}


def cli_trainer_defaults() -> dict:
    """The bench cells' Trainer defaults (gacbench.trainer), with the accelerator chosen from the machine (the GPU
    when one is present). Checkpointing stays Lightning's default: a config's ModelCheckpoint turns it on."""
    from gacbench.trainer import TRAINER_DEFAULTS, pick_accelerator

    defaults = {k: v for k, v in TRAINER_DEFAULTS.items() if k != "enable_checkpointing"}
    return {**defaults, "accelerator": pick_accelerator("auto")}


def run(argv: list[str]) -> int:
    """``gacbench grpo ARGV``. On a rank other than 0 (:func:`gacbench.usage.started_rank`) ``gacbench.cli`` has set
    SIGINT to the flag the ranks combine before anything is imported."""
    with warnings.catch_warnings():  # `gacbench grpo ...` hands LightningCLI its own part of sys.argv on purpose
        warnings.filterwarnings("ignore", "LightningCLI's args parameter is intended")
        cli = GRPOCLI(GRPOModule, run=False, args=argv, seed_everything_default=0, auto_configure_optimizers=False,
                      save_config_callback=RunConfigSaver, save_config_kwargs={"overwrite": True},
                      trainer_defaults=cli_trainer_defaults(),
                      parser_kwargs={"prog": "gacbench grpo", "description": __doc__.split("\n\n")[0]})
    model, trainer = cli.model, cli.trainer
    if started_rank() and trainer.world_size == 1:  # one process after all: SIGINT stops it at once
        signal.signal(signal.SIGINT, raise_interrupted)
        if FLAGGED["signum"] == signal.SIGINT:
            raise Interrupted(signal.SIGINT)
    config_hash, identity = run_hash(cli.config), run_identity(cli.config)
    trainer.callbacks.append(RunRecorder(config_hash, identity))
    ckpt, ckpt_step = resolve_ckpt(trainer, cli.config.ckpt_path, config_hash, identity)
    log_dir = trainer.logger.log_dir if trainer.logger is not None else None
    if finished_run(trainer.log_dir, ckpt_step, trainer.max_steps) and not cli.config.refresh_summary:
        print(f"gacbench grpo: {trainer.log_dir} is a finished run ({ckpt_step} of {trainer.max_steps} steps): left "
              "unchanged; raise --trainer.max_steps to continue it, or pass --refresh_summary to evaluate it again "
              "and rewrite its summary.json", file=sys.stderr)
        return 0
    recorded = check_processes(model, trainer, ckpt)
    with contextlib.ExitStack() as stack:
        if trainer.global_rank == 0:  # DDP: the other ranks start once rank 0 is in fit
            claim_run_dir(Path(trainer.log_dir or "."), stack)
            if ckpt is None:
                guard_earlier_run(trainer, cli.config.overwrite)
        # CSVLogger warns that the files of a directory that is not empty will be deleted: here the directory
        # holds the run's claim and saved config, an earlier run was refused above, and a resume keeps its rows
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")
        return _fit(cli, model, trainer, ckpt, ckpt_step, log_dir, recorded)


def stop_other_ranks(trainer) -> None:
    """Under DDP, after this rank stopped in the middle of a step (SIGINT): the other ranks wait in that step's
    collectives for it. Rank 0, which started them (Lightning's subprocess launcher), ends them, as Lightning does
    on a KeyboardInterrupt; nothing is lost, since rank 0 writes the checkpoints and the run's files."""
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    launcher = getattr(trainer.strategy, "launcher", None)
    if trainer.world_size > 1 and trainer.is_global_zero and isinstance(launcher, _SubprocessScriptLauncher):
        launcher.kill(signal.SIGKILL)


def check_processes(model, trainer, ckpt: str | None) -> dict[str, Any]:
    """Refuse, before anything runs, what several trainer processes (DDP) cannot do: prompts that do not split
    evenly over the ranks, an async or uniform rollout mode, and a checkpoint whose rollout queues were written by
    another number of processes (each rank's queue holds its own rollouts). Returns the checkpoint's run record
    (:class:`RunRecorder`; {} without a checkpoint or a record), read in the same load, for the resume."""
    from gacbench.llm.data_parallel import share_problem
    from gacbench.objectives.base import queue_world_problem

    world = trainer.world_size
    problem = share_problem(model.rollout_cfg.prompts, world)
    if problem is not None:
        raise UsageError(f"--model.{problem}")
    if world > 1 and model.rollout_cfg.mode != "sync":
        raise UsageError(f"--model.rollout.mode {model.rollout_cfg.mode} runs on one trainer process; this run has "
                         f"{world} (--trainer.devices x --trainer.num_nodes): use one device, or rollout.mode sync")
    if ckpt is None:
        return {}
    import torch

    loaded = torch.load(ckpt, map_location="cpu", weights_only=False, mmap=True)
    state = loaded.get("rollout_queue")
    problem = queue_world_problem(state, world) if isinstance(state, dict) else None
    if problem is not None:
        raise UsageError(f"--ckpt_path {ckpt}: {problem}")
    record = loaded.get(RUN_KEY)
    return record if isinstance(record, dict) else {}


def _fit(cli, model, trainer, ckpt: str | None, ckpt_step: int | None, log_dir: str | None,
         recorded: dict[str, Any]) -> int:
    out = Path(trainer.log_dir or ".")  # before the fit: afterwards, under DDP, a collective (a broadcast)
    keeper = (MetricsKeeper(log_dir, writes=trainer.is_global_zero)
              if ckpt and log_dir and _writes_metrics_csv(trainer, log_dir) else None)
    device = trainer.strategy.root_device
    model.policy.to(device)  # evaluate where training runs (Lightning moves the module only inside fit)
    lead = trainer.is_global_zero  # under DDP rank 0 alone evaluates and reports (the evaluation is its own)
    initial = model.metric() if lead else None
    if keeper is not None:
        keeper.before_resume()
        model.resume_logged = keeper.logged_at(ckpt_step)  # what a killed session left unwritten is evaluated again
        model.resume_max_steps = recorded.get("max_steps") if isinstance(recorded.get("max_steps"), int) else None
    t0 = time.perf_counter()
    terminated = 0  # the signal that ended the fit
    try:
        trainer.fit(model, ckpt_path=ckpt)
    except SIGTERMException:  # Lightning stops the fit at the end of the current step
        recorder = next((c for c in trainer.callbacks if isinstance(c, RunRecorder)), None)
        terminated = (recorder.stopped_by if recorder is not None else 0) or signal.SIGTERM  # DDP: SIGINT possible
    except Interrupted as exc:  # SIGINT (gacbench.usage.raise_on_signals): at once, in the middle of the step
        terminated = exc.signum
        stop_other_ranks(trainer)
    else:
        if keeper is not None and model.resume_logged is not None:  # no step was left to run: nothing started
            model.evaluate_resumed_step()
            for logger in trainer.loggers:
                logger.save()
    finally:  # also when the session fails: the earlier rows go back into metrics.csv
        lost = keeper.after_resume(ckpt_step, trainer.log_every_n_steps) if keeper is not None else []
    wall = time.perf_counter() - t0
    model.policy.to(device)
    mode = model.rollout_cfg.mode
    if not lead:  # DDP: rank 0 writes the summary and says how the run ended; an exit status other than 0 here
        return 0  # would have Lightning's launcher end rank 0 (SIGKILL) before it has
    summary = {"method": run_method(cli.config.method, mode), "status": "interrupted" if terminated else "finished",
               "engine": model.engine_cfg.name, "staleness": model.staleness, "model_path": model.model_path,
               "steps": trainer.global_step, "max_steps": trainer.max_steps, "resumed_from": ckpt,
               "eval_acc_initial": initial, "eval_acc_final": None if terminated else model.metric(), "wall_s": wall,
               **model.run_stats}
    if lost:
        summary["metrics_lost_steps"] = lost
    if trainer.world_size > 1:  # DDP: rank 0's summary; its step times and tokens are its own process's
        summary["processes"] = trainer.world_size
    if mode != "sync":
        summary["rollout"] = {"mode": mode, **rollout_record(getattr(model, "source_summary", None) or {})}
    # c_t's end-of-fit statistics: the AlignmentMonitor's, or, where it stays passive, those of the c_t trace of the
    # callback that computes c_t in its place (GAC with reference "grad" declares logs_raw_alignment), read with
    # the monitor's warm-up and tolerance, so that every method's summary leaves out the same steps
    monitor = next((c for c in trainer.callbacks if type(c).__name__ == "AlignmentMonitor"), None)
    provider = next((c for c in trainer.callbacks if c is not monitor and getattr(c, "logs_raw_alignment", False)
                     and hasattr(c, "trace")), None)
    if monitor is not None and monitor.summary:
        summary["alignment"] = monitor.summary
    elif monitor is not None and provider is not None and provider.trace.values:
        from gacbench.functional.stats import alignment_summary

        summary["alignment"] = alignment_summary(provider.trace.values, monitor.trace.warmup, monitor.trace.tol)
    out.mkdir(parents=True, exist_ok=True)
    from gacbench.jsonio import json_safe

    plain = json.loads(json.dumps(summary, default=float))  # tensors and numpy scalars as floats
    text = json.dumps(json_safe(plain), indent=2, allow_nan=False)  # NaN and infinities as null
    (out / "summary.json").write_text(text)
    print(text)
    print(f"wrote {out / 'summary.json'}")
    if lost:
        print(f"gacbench grpo: metrics.csv holds no row for {len(lost)} step(s) before the checkpoint this session "
              f"resumed from (steps {_spans(lost)}): an earlier session ended before writing them; the training "
              "itself is whole (summary.json lists them as metrics_lost_steps)", file=sys.stderr)
    if terminated:
        how = "terminated (SIGTERM)" if terminated == signal.SIGTERM else "interrupted (SIGINT)"
        ckpt_dir = _ckpt_dir(trainer)
        if ckpt_dir is not None and any(ckpt_dir.glob("*.ckpt")):
            how_on = "resume with --ckpt_path last (from the run's last checkpoint)"
        else:
            how_on = ("no checkpoint was written (ModelCheckpoint every_n_train_steps, or none configured): start "
                      "it again with --overwrite")
        print(f"gacbench grpo: {how} after {trainer.global_step} of {trainer.max_steps} steps; {how_on}",
              file=sys.stderr)
        return 128 + terminated
    return 0

