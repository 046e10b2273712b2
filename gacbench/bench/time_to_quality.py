"""``gacbench time-to-quality``: the wall-clock time each method needs to reach a reward, from a grid's stored
reward-per-version curves and the pipeline model of :mod:`gacbench.bench.pipeline`.

Staleness buys throughput and costs reward per step; the question an engineer asks is which wins on the clock.
For every (task, method, s) of a benchmark directory and every setting (G, T, n[, c]):

- **the curve**: the seed-mean reward of the policy version v. The measure is ``eval/policy_reward`` (the held-out
  reward of θ_v itself) where every done cell of the task logs it, else the training reward filed under the
  version that sampled it (step t of a run at lag s under version t - s: :func:`gacbench.bench.records.by_version`),
  smoothed by a moving mean over ``--smooth`` consecutive versions (placed at their mean version); between two
  points the curve is linear. The mean is over the versions every seed has: where a method's seed stopped early
  (a non-finite loss ends a run), its curve ends at that seed's last version, and the row says so
  (``stopped_seeds``; a note under the table), since "never" there means "not by that version".
- **the clock**: version v exists at the end of optimizer step v - 1 of the simulated schedule of the method's
  s (:func:`gacbench.bench.pipeline.simulate`, from time 0, the pipeline's fill included), linear in between.
- **the targets**: fractions (``--targets``, default 1 and 0.9) of sync's final reward, the last point of
  sync's seed-mean curve on the same measure; it must be positive, and sync's seeds must end at one version.
  The time to a target is the time of the first point where the curve reaches it; ``never`` when it does not
  within the run; ``<=`` when the curve's first point already reaches it (the curve starts there: the grid
  measured nothing earlier, so the time is an upper bound and no speed-up against sync is given). Per seed,
  each seed's own curve against the same target: how many seeds
  reach it, and the range of their times.

``--from-async-bench RESULT.json`` checks the model against a measured ``gacbench async-bench`` record: G and T
from its synchronous run's own split (G = its generation time per step, T = the rest of its step), n its
workers, one job per step, s its ``max_staleness``; the predicted asynchronous time, speed-up and mean lag
beside the measured ones; and the same prediction from the asynchronous run's own parts (G' = the workers'
generation and weight-loading time per job, T' = the trainer's time per step outside its wait for rollouts),
which separates an error of the schedule from a change of G and T when both phases run at once.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from gacbench.bench.pipeline import check_setting, mean_step_s, simulate, steady_step_s
from gacbench.usage import UsageError

MEASURES = {"policy": "eval/policy_reward", "training": "reward/mean"}
MEASURE_NAMES = {"eval/policy_reward": "held-out reward of the policy θ_v itself (eval/policy_reward)",
                 "reward/mean": "training reward filed under the version that sampled it (reward/mean)"}
DEFAULT_TARGETS = (1.0, 0.9)
DEFAULT_SMOOTH = 10

#: the model's assumptions, in the words of the command's help and the docs
ASSUMES = ("The model assumes: generating one step's batch takes G seconds on one rollout worker (G / c per job "
           "when the batch is split in c equal jobs; c = n by default), every optimizer step takes T seconds with "
           "its weight sync, a job starts on the first free worker as soon as the policy version t - s it needs "
           "exists (version v exists when optimizer step v - 1 ends), and the trainer takes step t once step t - 1 "
           "is done and all of step t's jobs are. It leaves out weight-sync stalls beyond T, batches or responses "
           "of unequal length, dropped or regenerated batches, contention for cores between generation and "
           "training, a stabilizer's own compute, evaluations and start-up. The reward per version is read from "
           "the grid's runs, whose stale batches were exactly s versions old; a bounded-staleness system with "
           "the same schedule generates from the newest weights (lag <= s), which the model times the same.")


@dataclass(frozen=True)
class Setting:
    """One hardware setting of the pipeline model: G, T (seconds), n workers, c jobs per step (None: n)."""

    gen_s: float
    train_s: float
    workers: int
    chunks: int | None = None

    @property
    def jobs(self) -> int:
        return self.workers if self.chunks is None else self.chunks

    def label(self) -> str:
        return f"G={self.gen_s:g} s, T={self.train_s:g} s, n={self.workers}, c={self.jobs}"


def parse_setting(text: str, option: str = "--setting") -> Setting:
    """``G,T,n`` or ``G,T,n,c`` -> a checked :class:`Setting` (UsageError naming the option, the value and the
    fix)."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (3, 4):
        raise UsageError(f"{option} {text!r}: give G,T,n or G,T,n,c (seconds of generation per step on one worker, "
                         f"seconds per optimizer step, rollout workers, jobs per step), e.g. {option} 2,1,4")
    try:
        gen, train = float(parts[0]), float(parts[1])
        workers = int(parts[2])
        chunks = int(parts[3]) if len(parts) == 4 else None
    except ValueError:
        raise UsageError(f"{option} {text!r}: G and T must be numbers, n and c integers, e.g. {option} 2,1,4") \
            from None
    return make_setting(gen, train, workers, chunks, option)


def make_setting(gen: float, train: float, workers: int, chunks: int | None, option: str) -> Setting:
    try:
        check_setting(gen, train, workers, chunks)
    except ValueError as exc:
        raise UsageError(f"{option}: {exc}") from None
    return Setting(gen, train, workers, chunks)


# -- curves ---------------------------------------------------------------------------------------------------
def first_crossing(curve: dict[float, float], target: float) -> tuple[float | None, bool]:
    """The first version where the piecewise-linear ``curve`` ({version: value}) reaches ``target`` (higher is
    better), and whether that is the curve's first point (the target may have been reached earlier). (None,
    False) when it never does."""
    xs = sorted(curve)
    if not xs:
        return None, False
    if curve[xs[0]] >= target:
        return xs[0], True
    for x0, x1 in zip(xs, xs[1:]):
        y0, y1 = curve[x0], curve[x1]
        if y1 >= target:
            return x0 + (target - y0) / (y1 - y0) * (x1 - x0), False
    return None, False


def load_curves(root: Path, measure: str = "auto", smooth: int = DEFAULT_SMOOTH) -> dict[str, dict]:
    """The reward-per-version curves of the done cells under ``root``: {task: {"measure": logged name,
    "runs": {(method, s): {seed: {version: value}}}}}. ``measure``: ``auto`` (policy reward where every done cell
    of the task logs it, else training reward), ``policy`` or ``training``; the training reward is smoothed
    (:func:`smooth_curve`, ``smooth`` versions). A task whose cells lack the asked measure is left out."""
    from gacbench.bench.groups import label_by_settings, smooth_curve  # imports Lightning: not at module import
    from gacbench.bench.records import cell_record, discover_cells

    specs = discover_cells(root)
    records = [r for r in (cell_record(root, c) for c in specs) if r is not None]
    records, _ = label_by_settings(records, specs)
    by_task: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r["status"] == "done" and r.get("_by_version", {}).get("reward/mean"):
            by_task[r.get("group", r["task"])].append(r)
    out = {}
    for task, recs in sorted(by_task.items()):
        has_policy = all(MEASURES["policy"] in r["_by_version"] for r in recs)
        if measure == "policy" and not has_policy:
            continue
        name = MEASURES["policy"] if (measure == "policy" or (measure == "auto" and has_policy)) \
            else MEASURES["training"]
        window = smooth if name == MEASURES["training"] else 1
        runs: dict[tuple[str, int], dict[int, dict[float, float]]] = defaultdict(dict)
        for r in recs:
            points = {float(v): float(x) for v, x in r["_by_version"][name].items() if math.isfinite(x)}
            if points:
                runs[(r["method"], r["staleness"])][r["seed"]] = smooth_curve(points, window)
        out[task] = {"measure": name, "runs": dict(runs)}
    return out


# -- the table ------------------------------------------------------------------------------------------------
def _time_at(schedule, version: float | None) -> float | None:
    return None if version is None else schedule.version_time(version)


def time_to_quality(curves: dict[str, dict], settings: list[Setting], fractions=DEFAULT_TARGETS,
                    methods: list[str] | None = None) -> list[dict]:
    """One row per (task, setting, method, s): the steady step time and throughput against sync, the time of the
    curve's last version (``last_version_s``), and per target
    (fraction x sync's final reward) the version and time where the seed-mean curve reaches it (None: never),
    ``at_first_point``, the seeds that reach it and the range of their times, and the speed-up on the clock
    against sync (sync's time / this time; None where either never reaches it or reaches it at its curve's first
    point, where the time is only an upper bound). Tasks without sync are left out."""
    from gacbench.bench.groups import seed_mean  # imports Lightning: not at module import

    rows = []
    for task, data in curves.items():
        runs = data["runs"]
        sync_key = ("sync", 0)
        if sync_key not in runs:
            continue
        sync_curve = seed_mean(runs[sync_key])
        if not sync_curve:
            continue
        ends = {seed: max(c) for seed, c in runs[sync_key].items()}
        if len(set(ends.values())) > 1:  # the seed-mean curve would end, and take its final, at the shortest seed
            listed = ", ".join(f"seed {seed} at {end:g}" for seed, end in sorted(ends.items()))
            raise UsageError(f"time-to-quality: sync's seeds on task {task!r} end at different versions ({listed}): "
                             "a seed that stopped early (a non-finite loss ends a run) would make sync's final reward "
                             "an early version's; recompute that cell (delete its directory, rerun the grid's "
                             "command)")
        final = sync_curve[max(sync_curve)]
        if not final > 0:
            raise UsageError(f"time-to-quality: sync's final reward on task {task!r} is {final:.4g}: the targets are "
                             "fractions of it, which name a quality only for a positive reward (a fraction of a "
                             "negative one lies above it); use a reward that is positive at the end of training")
        keys = sorted((k for k in runs if methods is None or k[0] in methods or k == sync_key),
                      key=lambda k: (k != sync_key, k[1], k[0]))
        for setting in settings:
            sync_rows = {}
            for method, s in keys:
                seeds = runs[(method, s)]
                mean = seed_mean(seeds)
                ends = {seed: max(c) for seed, c in seeds.items()}
                last = max(ends.values())
                sched = simulate(setting.gen_s, setting.train_s, setting.workers, s, math.ceil(last), setting.chunks)
                step = steady_step_s(setting.gen_s, setting.train_s, setting.workers, s, setting.chunks)
                if step is None:
                    step = mean_step_s(setting.gen_s, setting.train_s, setting.workers, s, setting.chunks)
                row = {"task": task, "measure": data["measure"], "method": method, "staleness": s,
                       "setting": {**asdict(setting), "chunks": setting.jobs}, "seeds": len(seeds),
                       "versions": [min(mean), max(mean)] if mean else None, "step_s": step,
                       "last_version_s": sched.version_time(math.ceil(last)), "sync_final_reward": final, "targets": [],
                       # seeds whose curve ends before the others' (a run stopped early): the seed-mean curve ends
                       # at the first of them, so a target it does not reach is "never" only up to that version
                       "stopped_seeds": {str(seed): end for seed, end in sorted(ends.items()) if end < last}}
                for frac in fractions:
                    target = frac * final
                    version, first = first_crossing(mean, target)
                    per_seed = [_time_at(sched, first_crossing(c, target)[0]) for c in seeds.values()]
                    reached = [t for t in per_seed if t is not None]
                    row["targets"].append({
                        "fraction": frac, "reward": target, "version": version, "time_s": _time_at(sched, version),
                        "at_first_point": first, "seeds_reached": len(reached),
                        "seed_time_min": min(reached) if reached else None,
                        "seed_time_max": max(reached) if reached else None})
                if (method, s) == sync_key:
                    sync_rows = row
                row["throughput_vs_sync"] = sync_rows["step_s"] / step if sync_rows and step > 0 else None
                for t, ts in zip(row["targets"], sync_rows.get("targets", [])):
                    known = ts["time_s"] is not None and t["time_s"] not in (None, 0) and (
                        row is sync_rows or not (t["at_first_point"] or ts["at_first_point"]))
                    t["speedup_vs_sync"] = ts["time_s"] / t["time_s"] if known else None
                rows.append(row)
    return rows


def _fmt_time(t: dict) -> str:
    if t["time_s"] is None:
        text = "never"
    else:
        text = f"{'<=' if t['at_first_point'] else ''}{t['time_s']:.1f} s"
    if t.get("speedup_vs_sync") is not None:
        text += f" x{t['speedup_vs_sync']:.2f}"
    spread = (f"{t['seed_time_min']:.0f}-{t['seed_time_max']:.0f} s" if t["seeds_reached"] else "")
    return f"{text} [{t['seeds_reached']}/{t['n']}{' ' + spread if spread else ''}]"


def print_table(rows: list[dict]) -> None:
    """The rows as a plain-text table per task and setting."""
    done = set()
    for r in rows:
        head = (r["task"], json.dumps(r["setting"]))
        if head not in done:
            done.add(head)
            st = r["setting"]
            setting = Setting(st["gen_s"], st["train_s"], st["workers"], st["chunks"])
            targets = ", ".join(f"{t['fraction']:.0%} = {t['reward']:.4g}" for t in r["targets"])
            print(f"\n{r['task']}: {MEASURE_NAMES[r['measure']]}; sync's final {r['sync_final_reward']:.4g}; "
                  f"targets {targets}")
            print(f"setting {setting.label()}")
            cols = "  ".join(f"{'to ' + format(t['fraction'], '.0%'):34s}" for t in r["targets"])
            print(f"{'method':16s} {'s':>3s} {'step s':>8s} {'thru':>6s} {'end s':>9s}  {cols}")
        thru = "" if r["throughput_vs_sync"] is None else f"x{r['throughput_vs_sync']:.2f}"
        cells = "  ".join(f"{_fmt_time({**t, 'n': r['seeds']}):34s}" for t in r["targets"])
        print(f"{r['method'][:16]:16s} {r['staleness']:3d} {r['step_s']:8.3f} {thru:>6s} "
              f"{r['last_version_s']:9.1f}  {cells}")
    noted = set()  # one note per (task, method, s), whatever the settings
    for r in rows:
        key = (r["task"], r["method"], r["staleness"])
        if not r["stopped_seeds"] or key in noted:
            continue
        noted.add(key)
        listed = ", ".join(f"seed {seed} at version {end:g}" for seed, end in r["stopped_seeds"].items())
        print(f"\n{r['task']}: {r['method']} s={r['staleness']}: {listed} stopped before its other seeds (a non-finite "
              f"loss ends a run); its seed-mean curve ends at version {min(r['stopped_seeds'].values()):g}, so 'never' "
              "means not by then")
    print("\ntimes: wall-clock seconds to the first version whose seed-mean reward reaches the target (x: sync's "
          "time / this time; [k/n lo-hi s]: seeds whose own curve reaches it and their times; <=: reached at the "
          "curve's first point). thru: sync's step time / this step time in steady state; end s: the time of the "
          "curve's last version.")


# -- the check against async-bench ------------------------------------------------------------------------------
def async_bench_check(record: dict) -> dict:
    """Predicted against measured for one ``gacbench async-bench`` record (see the module docstring): the
    measured sync_s, async_s, speedup and lag_mean; ``from_sync`` (G, T from the synchronous run's split) and
    ``from_async`` (G', T' from the asynchronous run's own parts), each with its predicted async_s, speedup,
    lag_mean (newest weights at each job's start) and steady speedup. ``from_sync``'s synchronous time is the
    model's, N (G + T); ``from_async`` takes the measured sync_s (its G', T' describe the asynchronous run only),
    so its speed-up is the measured sync_s over the predicted async_s."""
    try:
        steps, s = int(record["steps"]), int(record["max_staleness"])
        workers = int(record["settings"]["workers"])
        gen_sync, train_sync = float(record["sync_generate_s"]), float(record["sync_train_s"])
        sync_s, async_s = float(record["sync_s"]), float(record["async_s"])
        parts = record["runs"]["async"]["async"]
        worker_s = float(parts["worker_gen_s"]) + float(parts["worker_load_s"])
        wait_s = float(parts["trainer_wait_s"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"--from-async-bench: the record lacks {exc} (not a complete gacbench async-bench --json "
                         "record: rerun async-bench with --json)") from None
    if steps < 1:
        raise UsageError("--from-async-bench: the record has no steps")
    times = {"sync_generate_s": gen_sync, "sync_train_s": train_sync, "sync_s": sync_s, "async_s": async_s,
             "the async workers' generation and load time": worker_s}
    bad = [name for name, value in times.items() if not (value > 0 and np.isfinite(value))]
    if bad or not async_s - wait_s > 0:
        what = ", ".join(bad) or "async_s less the trainer's wait"
        raise UsageError(f"--from-async-bench: the record's {what} must be a positive time (not a complete "
                         "gacbench async-bench --json record: rerun async-bench with --json)")
    if record.get("admission", "wait") != "wait" or record.get("dropped"):
        note = "the run dropped batches or used admission drop, which the model leaves out"
    else:
        note = None

    def predict(gen: float, train: float, sync_total: float | None = None) -> dict:
        sched = simulate(gen, train, workers, s, steps, 1)
        sync_step = steady_step_s(gen, train, workers, 0, 1) if sync_total is None else sync_total / steps
        return {"gen_s": gen, "train_s": train, "workers": workers, "chunks": 1, "staleness": s,
                "sync_s": sync_step * steps, "async_s": sched.makespan, "speedup": sync_step * steps / sched.makespan,
                "lag_mean": float(np.mean(sched.lag)),
                "steady_speedup": sync_step / steady_step_s(gen, train, workers, s, 1)}

    return {"steps": steps, "max_staleness": s, "workers": workers,
            "measured": {"sync_s": sync_s, "async_s": async_s, "speedup": sync_s / async_s,
                         "lag_mean": record.get("lag_mean"), "ideal_speedup": record.get("ideal_speedup")},
            "from_sync": predict(gen_sync / steps, train_sync / steps),
            "from_async": predict(worker_s / steps, max(async_s - wait_s, 0.0) / steps, sync_s),
            "settings": record.get("settings"), "load_avg_1min": record.get("load_avg_1min"),
            **({"note": note} if note else {})}


def print_check(path: str, check: dict) -> None:
    m, a, b = check["measured"], check["from_sync"], check["from_async"]
    st = check.get("settings") or {}
    print(f"\n{path}: {check['steps']} steps, max_staleness {check['max_staleness']}, {check['workers']} worker(s), "
          f"one job per step; task {st.get('task')}, {st.get('prompts')} prompts x {st.get('group')}, "
          f"max_tokens {st.get('max_tokens')}")
    print(f"{'':22s} {'measured':>10s} {'model, sync split':>18s} {'model, async parts':>19s}")
    print(f"{'G per step (s)':22s} {'':>10s} {a['gen_s']:18.4f} {b['gen_s']:19.4f}")
    print(f"{'T per step (s)':22s} {'':>10s} {a['train_s']:18.4f} {b['train_s']:19.4f}")
    for key, name in (("sync_s", "sync time (s)"), ("async_s", "async time (s)"), ("speedup", "speed-up"),
                      ("lag_mean", "mean lag")):
        meas = m.get(key)
        print(f"{name:22s} {'' if meas is None else format(meas, '.3f'):>10s} {a[key]:18.3f} {b[key]:19.3f}")
    ideal = m.get("ideal_speedup")
    print(f"{'steady speed-up':22s} {'' if ideal is None else format(ideal, '.3f'):>10s} {a['steady_speedup']:18.3f} "
          f"{b['steady_speedup']:19.3f}")
    print("sync split: G and T per step of the synchronous run; async parts: the workers' generation and weight "
          "loading per job and the trainer's step outside its wait, in the asynchronous run (its sync time is the "
          "measured one). Steady speed-up: sync step / steady async step (measured column: async-bench's "
          "ideal_speedup).")
    if check.get("note"):
        print(f"note: {check['note']}")


# -- the command ------------------------------------------------------------------------------------------------
def _settings(args) -> list[Setting]:
    out = [parse_setting(t) for t in args.setting or []]
    given = [x is not None for x in (args.gen, args.train, args.workers)]
    if any(given) and not all(given):
        raise UsageError("--gen, --train and --workers go together: give all three (or use --setting G,T,n)")
    if all(given):
        out.insert(0, make_setting(args.gen, args.train, args.workers, args.chunks, "--gen/--train/--workers"))
    elif args.chunks is not None:
        raise UsageError("--chunks belongs to --gen/--train/--workers; with --setting give G,T,n,c")
    return out


def _fractions(text: str) -> list[float]:
    try:
        fr = [float(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"--targets {text!r}: give fractions of sync's final reward, comma-separated, e.g. 1,0.9") \
            from None
    if not fr or not all(math.isfinite(f) and f > 0 for f in fr):
        raise UsageError(f"--targets {text!r}: every fraction must be a number > 0, e.g. 1,0.9")
    return fr


def main(args) -> int:
    from gacbench.jsonio import json_safe, read_json

    checks = []
    for path in args.from_async_bench or []:
        try:
            record = read_json(Path(path))
        except FileNotFoundError:
            raise UsageError(f"--from-async-bench {path}: no such file; write one with gacbench async-bench --json "
                             f"{path}") from None
        except OSError as exc:
            raise UsageError(f"--from-async-bench {path}: cannot be read ({exc.strerror or exc}); give an "
                             "async-bench --json record file") from None
        except ValueError as exc:
            raise UsageError(f"--from-async-bench {path}: not valid JSON ({exc})") from None
        if not isinstance(record, dict) or record.get("complete") is False:
            raise UsageError(f"--from-async-bench {path}: not a finished async-bench record (interrupted?); rerun "
                             "gacbench async-bench --json")
        checks.append((path, async_bench_check(record)))
    if args.dir is None and not checks:
        raise UsageError("give a benchmark directory (DIR) and --setting G,T,n, or --from-async-bench RESULT.json")
    rows = []
    if args.dir is not None:
        root = Path(args.dir)
        if not (root / "cells").is_dir():
            raise UsageError(f"{root} holds no benchmark cells (expected the folder {root / 'cells'}); give the "
                             "--out of a gacbench bench run")
        settings = _settings(args)
        if not settings:
            raise UsageError("give at least one setting: --setting G,T,n (repeatable) or --gen G --train T "
                             "--workers n")
        if args.smooth < 1:
            raise UsageError(f"--smooth {args.smooth}: must be >= 1 versions (1: no smoothing)")
        curves = load_curves(root, args.measure, args.smooth)
        if not curves:
            raise UsageError(f"{root}: no done rollout cell with the {args.measure} reward measure; "
                             + ("use --measure training or auto" if args.measure == "policy" else
                                "time-to-quality reads the reward curves of GRPO grids"))
        methods = None
        if args.methods:
            methods = [m.strip() for m in args.methods.split(",") if m.strip()]
            known = sorted({m for d in curves.values() for m, _ in d["runs"]})
            unknown = [m for m in methods if m not in known]
            if unknown:
                raise UsageError(f"--methods: {', '.join(unknown)} not in {root}'s done cells; methods there: "
                                 f"{', '.join(known)}")
        if not any(("sync", 0) in d["runs"] for d in curves.values()):
            raise UsageError(f"{root}: no done sync cell (s = 0): the targets are fractions of sync's final reward; "
                             "run the grid's sync cells first")
        rows = time_to_quality(curves, settings, _fractions(args.targets), methods)
    if args.json:
        out = {"assumptions": ASSUMES, **({"rows": rows} if args.dir is not None else {}),
               **({"async_bench": [{"path": p, **c} for p, c in checks]} if checks else {})}
        print(json.dumps(json_safe(out), indent=2, allow_nan=False))
        return 0
    if rows:
        print_table(rows)
    for path, check in checks:
        print_check(path, check)
    return 0


def add_arguments(p) -> None:
    """The ``time-to-quality`` options (gacbench.cli builds the subparser)."""
    p.add_argument("dir", nargs="?", default=None, help="a directory written by gacbench bench (a GRPO grid)")
    p.add_argument("--setting", action="append", default=[], metavar="G,T,n[,c]",
                   help="one setting of the pipeline model (repeatable): G seconds to generate one step's batch on "
                        "one rollout worker, T seconds per optimizer step with its weight sync, n rollout workers, "
                        "c jobs per step (default n: the batch splits evenly over the workers)")
    p.add_argument("--gen", type=float, default=None, help="G of one more setting (with --train and --workers)")
    p.add_argument("--train", type=float, default=None, help="T of that setting")
    p.add_argument("--workers", type=int, default=None, help="n of that setting")
    p.add_argument("--chunks", type=int, default=None, help="c of that setting (default: n)")
    p.add_argument("--targets", default="1,0.9",
                   help="targets as fractions of sync's final reward, comma-separated (default 1,0.9)")
    p.add_argument("--methods", default=None, help="comma-separated methods to show (default: all; sync always)")
    p.add_argument("--measure", choices=["auto", "policy", "training"], default="auto",
                   help="the reward per version: policy (eval/policy_reward), training (reward/mean by the version "
                        "that sampled it, smoothed), auto (policy where every cell of the task logs it)")
    p.add_argument("--smooth", type=int, default=DEFAULT_SMOOTH,
                   help=f"versions in the moving mean of the training reward (default {DEFAULT_SMOOTH}; 1: none)")
    p.add_argument("--from-async-bench", action="append", default=[], metavar="RESULT.json",
                   help="check the model against a gacbench async-bench --json record (repeatable): G, T from its "
                        "sync run, n its workers, s its max_staleness; predicted against measured speed-up and lag")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
