"""The ``gacbench`` command line. Each subcommand lives in its own module and is imported lazily,
so ``gacbench --help`` stays fast.

Input the user can fix (an option's value, a suite file, an output path, a checkpoint) raises
:class:`UsageError`; :func:`main` prints it as one line, ``gacbench CMD: error: MESSAGE``, and returns 2,
as argparse does for its own errors. Any other exception is a bug and keeps its traceback.

SIGINT or SIGTERM ends a long command (:data:`INTERRUPTIBLE`, through :func:`run_interruptible`) with one line on
stderr, its ``--json`` file (when given) holding ``{"complete": false, ...}`` in place of the record it did not
finish, and exit status 130 (SIGINT) or 143 (SIGTERM), 128 + the signal. ``bench`` and ``grpo`` handle the two
signals themselves (``gacbench bench --help``; :mod:`gacbench.llm.cli`).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from gacbench.usage import (  # noqa: F401  (re-exported)
    Interrupted,
    UsageError,
    check_figure_format,
    check_output_dir,
    check_output_file,
    raise_on_signals,
)

_IMPORTED_AT = time.time()  # the start-up clock of ``bench`` where the process's own start cannot be read

#: the commands :func:`run_interruptible` runs: SIGINT / SIGTERM end them with exit 130 / 143
INTERRUPTIBLE = ("overhead", "rollout-bench", "async-bench", "step-profile", "theory", "demo", "warm-start",
                 "gpu-check", "power")


def _signal_of(exc: BaseException) -> int | None:
    """The signal behind ``exc``: :class:`Interrupted`'s, KeyboardInterrupt's SIGINT, or SIGTERM for Lightning's
    SIGTERMException (its own handler replaces ours while a fit runs); None for anything else."""
    if isinstance(exc, Interrupted):
        return exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    if type(exc).__name__ == "SIGTERMException":
        return signal.SIGTERM
    return None


def run_interruptible(command: str, run, args, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> int:
    """``run(args)``, ended by one of ``signals`` with one line on stderr, ``{"complete": false, "command",
    "signal"}`` written to ``args.json`` (when set; beside ``args.partial_result``, what the command finished,
    where it keeps one), and exit status 128 + the signal (130, 143)."""
    try:
        with raise_on_signals(signals):
            return run(args)
    except (Interrupted, KeyboardInterrupt, SystemExit) as exc:
        signum = _signal_of(exc)
        if signum is None:
            raise
    # a second signal while the marker is written is ignored; the handlers come back after it (the command may run
    # inside a longer process)
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    name = signal.Signals(signum).name
    json_path = getattr(args, "json", None)
    note = ""
    if isinstance(json_path, str):
        from pathlib import Path

        from gacbench.jsonio import write_json

        # what the command finished before the signal, where it keeps a partial result (gpu-check: its rows)
        partial = getattr(args, "partial_result", None)
        write_json(Path(json_path), {**(partial if isinstance(partial, dict) else {}), "complete": False,
                                     "command": command, "signal": name})
        note = f"; {json_path} marked incomplete"
    print(f"gacbench {command}: interrupted ({name}) before it finished{note}", file=sys.stderr)
    for s, h in previous.items():
        signal.signal(s, h)
    return 128 + signum


def _suite_names() -> str:
    """The suites shipped in tasks/suites/ of a checkout, or packed in the wheel (read without importing the
    runner, which imports torch: the same rule as :func:`gacbench.bench.validate.suites_dir`)."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    checkout, packaged = here.parent / "tasks" / "suites", here / "_tasks" / "suites"
    folder = checkout if checkout.is_dir() or not packaged.is_dir() else packaged
    names = sorted(x.stem for x in folder.glob("*.yaml"))
    return ", ".join(names) or f"none found in {folder}"


def _kernel_list(text: str) -> str:
    from gacbench.functional.gac import KERNELS

    kernels = [k.strip() for k in text.split(",")]
    if not all(kernels) or set(kernels) - set(KERNELS) or len(set(kernels)) != len(kernels):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more of {', '.join(KERNELS)}, comma-separated")
    return text


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a positive integer")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gacbench", description="Asynchronous-RL staleness and GAC benchmark suite.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")

    p = sub.add_parser("overhead", help="time a GAC pass against an AdamW step on a Qwen3-shaped parameter list")
    p.add_argument("--params", type=int, default=20_000_000, help="about how many parameters (default 20M)")
    p.add_argument("--shape", choices=["auto", "qwen3-1.7b"], default="auto",
                   help="'auto': the small Qwen3 shape (head_dim 32, 2 to 48 layers, a 512- to 8192-token "
                        "vocabulary) closest to --params; 'qwen3-1.7b': the real 1.7B shape (ignores --params)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--repeats", type=_positive_int, default=7, help="timed runs per figure; the median is reported")
    p.add_argument("--buffer-dtype", choices=["float32", "bfloat16"], default=None,
                   help="dtype of GAC's reference buffer (a bfloat16 one is timed on the eager, fused-adamw and "
                        "triton paths: give --kernels eager,fused-adamw with it on the CPU)")
    p.add_argument("--kernels", default=None, type=_kernel_list,
                   help="GAC kernel paths to time, comma-separated: eager, compiled, fused-adamw (torch.compile; "
                        "the first, untimed round compiles, about a minute on 2 CPU cores), triton (CUDA; on the CPU "
                        "only under TRITON_INTERPRET=1, which times Triton's interpreter) (default: eager, compiled, "
                        "fused-adamw, and triton on CUDA)")
    p.add_argument("--json", default=None, help="also write the record to this JSON file")

    p = sub.add_parser("bench",
                       help="run a benchmark grid (task x method x staleness x seed); resumes where it stopped",
                       description="Run a benchmark grid into --out, cell by cell; cells done there are reused. Each "
                                   "cell is claimed before it runs, so several runners may share one --out: a cell "
                                   "another runner holds is waited for and reused. SIGINT or SIGTERM stops the "
                                   "workers, writes the summary of the cells stored and exits 130 or 143; the same "
                                   "command resumes. A full disk ends the run with one line naming the file.")
    p.add_argument("--suite", default="synthetic-smoke",
                   help=f"a suite in tasks/suites/ ({_suite_names()}) or a YAML path")
    p.add_argument("--methods", default=None,
                   help="comma-separated method specs, e.g. sync,stale,gac,'gac(c_low=0.02)'; the keyword ablation "
                        "adds the suite's threshold-ablation cells (default: the suite's methods and its ablation)")
    p.add_argument("--staleness", default=None,
                   help="comma-separated staleness values, e.g. 0,8,16,32 (default: the suite's). sync runs only at "
                        "0 and the stale methods only above 0: a list without 0 leaves sync out, and the run says so "
                        "in a note naming each method left out")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default: the suite's)")
    p.add_argument("--tasks", default=None, help="comma-separated task names of the suite (default: all)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="override an objective parameter in every cell (repeatable), e.g. --param lr=3e-4; a dotted "
                        "key sets one field of a section, e.g. --param engine.name=hf. Parameters are part of a cell's "
                        "identity: if --out holds finished cells computed with other values, the run is refused "
                        "before anything runs, naming the differing keys (use another --out, or delete those cells); "
                        "failed or unfinished cells are rerun with the new values")
    p.add_argument("--out", required=True,
                   help="output directory; cells already done there with the same settings are reused, not rerun")
    p.add_argument("--workers", type=_positive_int, default=2,
                   help="parallel worker processes, each kept for the whole grid and running cell after cell "
                        "(default 2)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch threads of each worker (default: the machine's cores divided by --workers). A "
                        "cell's numbers depend on it and its provenance records it; set it to run two grids side "
                        "by side, e.g. --workers 1 --threads 1 each on 2 cores")
    p.add_argument("--executor", choices=["local", "ray"], default="local",
                   help="a local process pool, or Ray actors on the cluster at RAY_ADDRESS (else a local instance)")
    p.add_argument("--rerun-other-versions", action="store_true",
                   help="recompute the done cells of the grid stored by another environment (another library source, "
                        "package versions, thread count or device: gacbench.provenance); by default they are counted "
                        "in a note and reused")
    p.add_argument("--verbose", action="store_true",
                   help="also print where the wall time went: seconds and share of wall x workers per part (process "
                        "start, model load, engine start, evals, optimizer steps, idle workers, ...)")

    sub.add_parser("grpo", add_help=False,
                   help="one GRPO run from a LightningCLI config: gacbench grpo --config tasks/llm/tiny.yaml "
                        "[overrides] (gacbench grpo --help for all options)")

    p = sub.add_parser("rollout-bench", help="rollout tokens/s of the vllm and hf engines side by side, and GRPO's "
                       "generation share of step time")
    p.add_argument("--engines", default="hf,vllm", help="comma-separated engines (default hf,vllm)")
    p.add_argument("--model", default=None,
                   help="a local Hugging Face checkpoint directory (default: the tiny warm-started model)")
    p.add_argument("--prompts", type=_positive_int, default=64, help="prompts per generate call (default 64)")
    p.add_argument("--group", type=_positive_int, default=8, help="samples per prompt (default 8)")
    p.add_argument("--max-tokens", type=_positive_int, default=6,
                   help="new tokens per sample (default 6: the arithmetic task's budget)")
    p.add_argument("--repeats", type=_positive_int, default=5,
                   help="timed calls per engine, interleaved; medians reported")
    p.add_argument("--grpo-steps", type=int, default=10,
                   help="steps of a synchronous GRPO run per engine for the time shares (0: skip)")
    p.add_argument("--grpo-prompts", type=_positive_int, default=8, help="prompts per GRPO step (default 8)")
    p.add_argument("--json", default=None, help="also write the record to this JSON file")

    p = sub.add_parser("async-bench", help="the same GRPO configuration run synchronously and with asynchronous Ray "
                       "rollout workers, timed side by side: speedup, lag, drops, final rewards")
    from gacbench.llm.async_bench import add_arguments as add_async_bench_arguments

    add_async_bench_arguments(p)

    p = sub.add_parser("step-profile", help="where one GRPO step's time goes at a model and task shape: weight sync, "
                       "generation, behaviour log-probs, forward, backward, optimizer (medians of repeats)")
    from gacbench.llm.step_profile import add_arguments as add_step_profile_arguments

    add_step_profile_arguments(p)

    p = sub.add_parser("warm-start", help="rebuild a start point (warm-started checkpoint) from scratch and print "
                       "its weights hash and the hash of its configuration, vocabulary and end tokens beside the "
                       "pinned ones",
                       description="Build the warm-started checkpoints of a suite's GRPO tasks (--suite), or of one "
                                   "model and task, in a fresh directory, and print each one's SHA-256 (of its "
                                   "weights, and of its configuration, vocabulary and end tokens) beside the pinned θ₀ "
                                   "(gacbench.llm.pinned). Exit 1 when one differs from its pin.")
    p.add_argument("--suite", default=None, help="a suite name or YAML path: every start point its GRPO tasks use")
    p.add_argument("--size", default="tiny", help="model size (tiny, small, medium) when no --suite")
    p.add_argument("--warm-steps", type=_positive_int, default=400, help="supervised steps (default 400)")
    p.add_argument("--task", default="arithmetic", help="task name (arithmetic, scratchpad) when no --suite")
    p.add_argument("--max-ops", type=_positive_int, default=2)
    p.add_argument("--max-operand", type=_positive_int, default=9)
    p.add_argument("--out", default=None, help="where to build (default: a new temporary directory)")

    p = sub.add_parser("gpu-check", help="the checks of a GPU machine in one command, ending in one table: GAC's "
                       "kernel paths on the device against the CPU, overhead at the 1.7B shape, tiny GRPO (sync, "
                       "gac at s = 8), the tests (--device cpu: the same at small shapes, the core tests)")
    from gacbench.bench.gpu_check import add_arguments as add_gpu_check_arguments

    add_gpu_check_arguments(p)

    p = sub.add_parser("report", help="rebuild summary.json, summary.md and the figures of a bench directory from its "
                       "stored runs")
    p.add_argument("dir", help="a directory written by gacbench bench")
    p.add_argument("--suite", default=None, help="the suite whose multiplicity families (its families: key) adjust "
                   "the p-values; default: the families that built DIR's summary.json (declared_families), else the "
                   "default families (docs/bench.md)")

    p = sub.add_parser("power", help="how many seeds a target recovered share needs to be detectable, from a pilot "
                       "grid's paired seed noise and gap")
    p.add_argument("--runs", required=True, help="the pilot grid's directory (its summary.json)")
    p.add_argument("--target-share", type=float, required=True, help="the smallest share to detect, e.g. 0.5")
    p.add_argument("--power", type=float, default=0.8, help="the probability of detecting it (default 0.8)")
    p.add_argument("--alpha", type=float, default=0.05,
                   help="two-sided level of the paired t-test (default 0.05; divide by the family's size for a "
                   "conservative Holm sizing)")
    p.add_argument("--json", action="store_true", help="print JSON rows for machines")

    from gacbench.bench.time_to_quality import ASSUMES
    from gacbench.bench.time_to_quality import add_arguments as add_time_to_quality_arguments

    p = sub.add_parser("time-to-quality", help="wall-clock time each method and s needs to reach a reward (sync's "
                       "final, 90%% of it), from a grid's reward-per-version curves and a pipeline model of "
                       "asynchronous rollouts (G, T, n); --from-async-bench checks the model against measured runs",
                       description="For each method and s of a GRPO grid and each setting (G, T, n[, c]): the "
                                   "steady step time of the pipeline model, and the wall-clock time to reach "
                                   "fractions of sync's final reward on the seed-mean reward-per-version curve "
                                   "(docs/bench.md, 'Time to quality'). " + ASSUMES)
    add_time_to_quality_arguments(p)

    p = sub.add_parser("methods", help="list the registered methods")

    p = sub.add_parser("stabilizers", help="list the registered stabilizers (built-in and from the "
                       "gacbench.stabilizers entry points)")

    p.add_argument("--json", action="store_true", help="print JSON for machines")

    p = sub.add_parser("theory", help="run every symbolic and numeric check of the bounded-staleness theory")
    p.add_argument("--json", default=None, help="also write {'checks': [...]} to this file")
    p.add_argument("--checks", default=None, help="comma-separated check names (default: all)")
    p.add_argument("--figure", default=None, help="also draw the alignment figure (theory/fig_alignment.png)")

    p = sub.add_parser("demo", help="the embedded default job: sync vs stale vs GAC on a noisy quadratic, with c_t "
                       "statistics")
    p.add_argument("--staleness", type=int, default=16, help="staleness s of the stale runs (default 16)")
    p.add_argument("--steps", type=_positive_int, default=300, help="optimizer steps per run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``gacbench ARGV``; returns the exit status (2 for input the user can fix, printed as one line)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and not argv[0].startswith("-") else None
    try:
        return _run(argv)
    except UsageError as exc:
        message = " ".join(str(exc).split())
        print(f"gacbench{' ' + command if command else ''}: error: {message}", file=sys.stderr)
        return 2


def _run(argv: list[str]) -> int:
    if argv[:1] == ["grpo"]:  # LightningCLI parses its own arguments
        # SIGTERM stays Lightning's (the fit stops at the end of its step): only SIGINT is raised at once, except on
        # a DDP rank other than 0, where it is a flag that the ranks combine at the end of a step (from here on,
        # before the command's imports: raised, it would end this rank alone, and Lightning's launcher rank 0)
        from gacbench.usage import FLAGGED, flag_signal, started_rank

        FLAGGED["signum"] = 0
        raised: tuple[int, ...] = (signal.SIGINT,)
        if started_rank():
            signal.signal(signal.SIGINT, flag_signal)
            raised = ()
        return run_interruptible("grpo", _grpo, argv[1:], signals=raised)
    parser = build_parser()
    args = parser.parse_args(argv)
    for option in ("json", "figure"):  # output files are checked before any work is done
        value = getattr(args, option, None)
        if isinstance(value, str):
            check_output_file(f"--{option}", value)
    if isinstance(getattr(args, "figure", None), str):
        check_figure_format("--figure", args.figure)
    if args.version:
        from gacbench import __version__

        print(__version__)
        return 0
    if args.command in INTERRUPTIBLE:  # the handlers are in place before the command's imports
        return run_interruptible(args.command, _dispatch, args)
    return _dispatch(args)


def _grpo(argv: list[str]) -> int:
    from gacbench.llm.cli import run

    return run(argv)


def process_started() -> dict:
    """When this process started (:func:`gacbench.bench.timing.process_start`): read from /proc, or this module's
    import where /proc cannot be read or reads a start that belongs to a program which exec'd this one."""
    from gacbench.bench.timing import EXEC_SLACK_S, process_start

    return process_start(_IMPORTED_AT, "cli-import", max_before_s=EXEC_SLACK_S)


def _bench(args: argparse.Namespace) -> int:
    """``gacbench bench``, timed from its process's start (:func:`process_started`). With the local executor and
    two or more workers the fork server of the worker pool starts first
    (:func:`gacbench.bench.workers.start_fork_server`), so that its imports run beside this process's own imports
    and its planning of the grid."""
    started = process_started()
    try:
        with raise_on_signals():  # the runner's own handler takes over once it is imported
            if args.executor == "local" and args.workers > 1:
                from gacbench.bench.workers import start_fork_server

                start_fork_server()
            from gacbench.bench.runner import main as run
    except (Interrupted, KeyboardInterrupt) as exc:
        signum = _signal_of(exc)
        print(f"gacbench bench: stopped by {signal.Signals(signum).name} before any cell ran; nothing was run",
              flush=True)
        return 128 + signum
    return run(args, started=started)


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "overhead":
        from gacbench.bench.overhead import main as run

        return run(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "rollout-bench":
        from gacbench.llm.throughput import main as run

        return run(args)
    if args.command == "async-bench":
        from gacbench.llm.async_bench import main as run

        return run(args)
    if args.command == "step-profile":
        from gacbench.llm.step_profile import main as run

        return run(args)
    if args.command == "warm-start":
        from gacbench.bench.warm_start import main as run

        return run(args)
    if args.command == "gpu-check":
        from gacbench.bench.gpu_check import main as run

        return run(args)
    if args.command == "report":
        from gacbench.bench.runner import report_command as run

        return run(args)
    if args.command == "power":
        from gacbench.bench.power import main as run

        return run(args)
    if args.command == "time-to-quality":
        from gacbench.bench.time_to_quality import main as run

        return run(args)
    if args.command == "methods":
        from gacbench.methods import METHODS

        for m in METHODS.values():
            print(f"{m.name:14s} {m.help}")
        return 0
    if args.command == "stabilizers":
        import json

        from gacbench.methods import stabilizers

        stabs = stabilizers()
        if args.json:
            print(json.dumps([{"name": n, "kind": i["kind"], "source": i["source"], "help": i["help"],
                               "on_policy_identity": i["on_policy_identity"]} for n, i in stabs.items()], indent=2))

        else:
            for n, i in stabs.items():
                print(f"{n:16s} {i['kind']:9s} {i['source']:10s} {i['help']}")
        return 0
    if args.command == "theory":
        from gacbench.theory.checks import main as run

        return run(args)
    if args.command == "demo":
        from gacbench.bench.demo import main as run

        return run(args)
    build_parser().print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
