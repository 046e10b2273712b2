"""Is the stale-rollout simulator faithful? Runs one GRPO configuration three ways per seed and stores each run
under runs/async/study/seed{S}/{async,fixed,uniform}/ (record.json, metrics.csv):

- ``async``: real asynchronous rollouts (rollout.mode async, one Ray rollout worker, admission wait, s_max);
- ``fixed``: the simulator (rollout.mode sync, the stale FIFO) at s = the async run's mean lag, rounded;
- ``uniform``: the simulator with s_t uniform on the async run's lag range after its first s_max steps
  (rollout.mode uniform, min_staleness..max_staleness = that range).

Every run has the same model (the tiny warm-started Qwen3; ``--size``, ``--warm-steps`` or ``--model`` another),
task (``--task``, default arithmetic), prompts, seeds, learning rate and steps, and an AlignmentMonitor (c_t).
A run already stored is not rerun. Then ``python paper/async/make.py`` builds the table and figure.

    python paper/async/run.py [--steps 100] [--seeds 0,1,2] [--max-staleness 4] [--engine vllm|hf] [--root DIR]
        [--task scratchpad --size small --warm-steps 500 --max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gacbench.llm.async_bench import add_arguments, default_engine, default_model, run_settings, run_spec

ROOT = Path(__file__).resolve().parents[2]


def lag_range(record: dict, s_max: int) -> tuple[int, int]:
    """The async run's per-step lags after its first s_max steps (the pipeline's fill): (min, max)."""
    lags = [round(x) for x in record["lag"][s_max:]] + [round(x) for x in record["lag_max_per_step"][s_max:]]
    return min(lags), max(lags)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.set_defaults(steps=100)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--root", default=str(ROOT / "runs" / "async" / "study"))
    args = parser.parse_args(argv)
    args.engine = args.engine or default_engine()
    args.model = args.model or default_model(args)  # built once, before any run
    root = Path(args.root)
    for seed in [int(s) for s in args.seeds.split(",")]:
        args.seed = seed
        base = root / f"seed{seed}"
        plan = {}
        for way in ("async", "fixed", "uniform"):
            out = base / way
            if (out / "record.json").exists():
                plan[way] = json.loads((out / "record.json").read_text())
                continue
            module = run_settings("async" if way == "async" else "sync", args)
            module["eval_every"] = 10
            if way != "async":
                a = plan["async"]["async"]
                if way == "fixed":
                    module["staleness"] = round(a["lag_mean"])
                else:
                    low, high = lag_range(plan["async"], args.max_staleness)
                    module["rollout"].update(mode="uniform", max_staleness=high, min_staleness=low)
            out.mkdir(parents=True, exist_ok=True)
            print(f"study: seed {seed}, {way}: {json.dumps(module['rollout'])} staleness={module.get('staleness', 0)}",
                  file=sys.stderr, flush=True)
            env = {"OMP_WAIT_POLICY": args.omp_wait_policy} if args.omp_wait_policy else {}
            record = run_spec({"module": module, "steps": args.steps, "log_dir": str(out), "threads": None, "env": env})
            record["settings"] = module
            (out / "record.json").write_text(json.dumps(record, default=float))
            plan[way] = record
    return 0


if __name__ == "__main__":
    sys.exit(main())
