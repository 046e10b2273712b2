"""``gacbench grpo``: one GRPO run from a config file, with LightningCLI conventions.

    gacbench grpo --config tasks/llm/tiny.yaml [--config overlay.yaml] [--model.staleness=16]
                  [--method gac] [--trainer.max_steps=200] [--ckpt_path last]

The config has LightningCLI's three sections: ``trainer`` (any ``lightning.Trainer`` argument, with
callbacks and loggers as ``class_path``/``init_args``), ``model`` (``GRPOModule``'s arguments) and
``seed_everything``. Two keys are gacbench's own: ``method`` (a method of ``gacbench methods``, a
stabilizer name, or a ``+`` combination such as ``gac+m2po``; its callbacks are added to the trainer,
next to an ``AlignmentMonitor`` so that c_t is logged in every run) and ``ckpt_path`` (resume; ``last``
takes the newest checkpoint of the run's checkpoint directory). ``trainer.max_steps`` is linked to
``model.steps``. A logger whose ``version`` is null gets ``METHOD-sSTALENESS-seedSEED`` (runs of one config
with other methods, staleness or seeds do not overwrite each other; set the version yourself when you vary
anything else), and ``--ckpt_path last`` resumes into that directory, keeping the earlier steps' rows of
``metrics.csv`` (the summary's c_t statistics cover the resumed segment only). At the end the run writes ``summary.json`` (initial and final ``eval/acc``, c_t
statistics, time shares) into the logger's directory and prints it.
"""

from __future__ import annotations

import csv
import json
import time
import warnings
from pathlib import Path

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from gacbench.llm.grpo import GRPOModule


class GRPOCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--method", type=str, default="sync",
                            help="sync, stale, gac, gac-skip, m2po, bapo, tis, decoupled-ppo, gac+m2po, ... (`gacbench methods`, "
                                 "`gacbench stabilizers`); 'sync' requires model.staleness=0")
        parser.add_argument("--ckpt_path", type=str | None, default=None,
                            help="resume from this checkpoint; 'last' = the newest one the run's ModelCheckpoint wrote")
        parser.add_argument("--alignment_warmup", type=int, default=5, help="steps the AlignmentMonitor leaves out of its statistics")
        parser.link_arguments("trainer.max_steps", "model.steps")

    def before_instantiate_classes(self) -> None:
        from gacbench.methods import parse_method

        method, _ = parse_method(self.config.method)  # a clear error for an unknown name
        if not method.stale and self.config.model.staleness > 0:
            raise ValueError(f"--method {self.config.method} is synchronous but model.staleness={self.config.model.staleness}; "
                             "use --method stale (or gac, m2po, ...) for a stale run, or --model.staleness=0")
        if self.config.trainer.max_steps is None or self.config.trainer.max_steps < 1:
            raise ValueError("set trainer.max_steps (a GRPO run is measured in optimizer steps)")
        logger = self.config.trainer.get("logger")
        init = logger.get("init_args") if hasattr(logger, "get") else None
        if init is not None and "version" in init and init.get("version") is None:  # one directory per run
            name = "".join(ch if ch.isalnum() or ch in "-_+.=" else "_" for ch in self.config.method)
            init["version"] = f"{name}-s{self.config.model.staleness}-seed{self.config.model.seed}"

    def instantiate_trainer(self, **kwargs):
        from gacbench.callbacks import AlignmentMonitor
        from gacbench.methods import method_callbacks

        configured = list(self.config_init.trainer.get("callbacks") or [])
        extra = [AlignmentMonitor(warmup=self.config.alignment_warmup), *method_callbacks(self.config.method)]
        return super().instantiate_trainer(callbacks=[*configured, *extra], **kwargs)


def _resolve_ckpt(trainer, ckpt_path: str | None) -> str | None:
    if ckpt_path != "last":
        if ckpt_path is not None and not Path(ckpt_path).is_file():
            raise FileNotFoundError(f"--ckpt_path {ckpt_path}: no such checkpoint file")
        return ckpt_path
    callback = trainer.checkpoint_callback
    ckpt_dir = callback.dirpath if callback else None
    if callback and ckpt_dir is None and trainer.loggers:  # ModelCheckpoint's own default, resolved only at fit time
        ckpt_dir = str(Path(trainer.loggers[0].log_dir) / "checkpoints")
    found = sorted(Path(ckpt_dir).glob("*.ckpt"), key=lambda p: p.stat().st_mtime) if ckpt_dir and Path(ckpt_dir).is_dir() else []
    if not found:
        raise FileNotFoundError(f"--ckpt_path last: no checkpoint in {ckpt_dir}; start the run without --ckpt_path")
    return str(found[-1])


def _metrics_path(trainer) -> Path | None:
    return Path(trainer.logger.log_dir) / "metrics.csv" if trainer.logger is not None and trainer.logger.log_dir else None


def _read_metrics(trainer) -> list[dict[str, str]]:
    path = _metrics_path(trainer)
    if path is None or not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def _merge_metrics(trainer, earlier: list[dict[str, str]]) -> None:
    """Lightning's CSVLogger starts metrics.csv afresh in a non-empty directory: after a resume into the same
    directory, put the rows of the steps before the resume point back in front of the new ones."""
    later = _read_metrics(trainer)
    start = min((int(r["step"]) for r in later if r.get("step")), default=None)
    kept = [r for r in earlier if start is None or (r.get("step") and int(r["step"]) < start)]
    keys = list(dict.fromkeys(k for r in kept + later for k in r))
    path = _metrics_path(trainer)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(kept + later)


def run(argv: list[str]) -> int:
    with warnings.catch_warnings():  # `gacbench grpo ...` hands LightningCLI its own part of sys.argv on purpose
        warnings.filterwarnings("ignore", "LightningCLI's args parameter is intended")
        cli = GRPOCLI(GRPOModule, run=False, args=argv, seed_everything_default=0, auto_configure_optimizers=False,
                      save_config_kwargs={"overwrite": True},
                      trainer_defaults={"accelerator": "auto", "devices": 1, "log_every_n_steps": 1,
                                        "num_sanity_val_steps": 0, "enable_progress_bar": False},
                      parser_kwargs={"prog": "gacbench grpo", "description": __doc__.split("\n\n")[0]})
    model, trainer = cli.model, cli.trainer
    ckpt = _resolve_ckpt(trainer, cli.config.ckpt_path)
    device = trainer.strategy.root_device
    model.policy.to(device)  # evaluate where training runs (Lightning moves the module only inside fit)
    initial = model.metric()
    earlier = _read_metrics(trainer) if ckpt else []
    t0 = time.perf_counter()
    trainer.fit(model, ckpt_path=ckpt)
    wall = time.perf_counter() - t0
    if earlier:
        _merge_metrics(trainer, earlier)
    model.policy.to(device)
    summary = {"method": cli.config.method, "engine": model.hparams.engine, "staleness": model.hparams.staleness,
               "model_path": model.model_path, "steps": trainer.global_step, "resumed_from": ckpt,
               "eval_acc_initial": initial, "eval_acc_final": model.metric(), "wall_s": wall, **model.run_stats}
    monitor = next((c for c in trainer.callbacks if type(c).__name__ == "AlignmentMonitor"), None)
    if monitor is not None and getattr(monitor, "summary", None):
        summary["alignment"] = monitor.summary
    out = Path(trainer.log_dir or ".")
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    print(json.dumps(summary, indent=2, default=float))
    print(f"wrote {out / 'summary.json'}")
    return 0

