"""A series of ``gacbench overhead`` runs, each in its own process, as one record: every run's record and, for
every ratio and time, the median and range over the runs. One process per run, because a compiled path's first
round and the machine's state belong to a process: the spread over runs is what a reader of one run should
expect. Nothing else should run on the machine meanwhile.

    python paper/overhead_series.py --runs 9 --json paper/profile/overhead-cpu.json -- --params 20000000 --repeats 9

Arguments after ``--`` go to ``gacbench overhead`` (without ``--json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

#: the figures summarised over the runs: ratios to the AdamW step of their own rounds, and the AdamW step itself
SUMMARISED = ("adamw_step_eager_s", "floor_keep_over_adamw", "floor_project_over_adamw")


def summarise(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Median, min and max over ``runs`` of each ratio (``*_over_adamw``), each AdamW step time
    (``adamw_step_*_s``) and each compiled path's first-round extra time (``first_round_extra_*_s``) that every run
    holds as a number."""
    keys = [k for k in runs[0] if k in SUMMARISED or k.endswith("_over_adamw") or k.startswith(("adamw_step_",
                                                                                                 "first_round_extra_"))]
    out = {}
    for key in keys:
        values = [r.get(key) for r in runs]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def series_record(runs: list[dict], command: list[str]) -> dict:
    """The record of a series: the command, the settings every run shares, the summary and every run. Refuses runs
    of different settings or code versions, which are not one series."""
    if not runs:
        raise SystemExit("overhead_series: no runs")
    same = ("params", "device", "shape", "tensors", "buffer_dtype", "repeats", "kernels", "threads", "torch")
    for r in runs[1:]:
        for key in same:
            if r.get(key) != runs[0].get(key):
                raise SystemExit(f"overhead_series: the runs differ in {key} ({runs[0].get(key)!r} and "
                                 f"{r.get(key)!r}): not one series")
        for key in ("code", "source_sha256", "packages"):  # the source hash tells edits of a dirty checkout apart
            if (r.get("provenance") or {}).get(key) != (runs[0].get("provenance") or {}).get(key):
                raise SystemExit(f"overhead_series: the runs differ in their provenance's {key} (another code "
                                 "version or packages): not one series")
    return {"command": " ".join(command), "runs_count": len(runs), **{k: runs[0].get(k) for k in same},
            "summary": summarise(runs), "runs": runs}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=9, help="processes, one run each (default 9)")
    p.add_argument("--json", required=True, help="the series record")
    args = p.parse_args(own)
    if args.runs < 1:
        p.error(f"--runs {args.runs} must be >= 1")
    if "--json" in extra:
        p.error("the series writes each run's --json itself; drop it after --")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            path = Path(tmp) / f"run-{i}.json"
            subprocess.run([sys.executable, "-m", "gacbench.cli", "overhead", *extra, "--json", str(path)],
                           check=True, stdout=subprocess.DEVNULL)
            runs.append(json.loads(path.read_text()))
            print(f"overhead_series: run {i + 1} of {args.runs} done", file=sys.stderr, flush=True)
    record = series_record(runs, ["gacbench", "overhead", *extra])
    Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    for key, v in record["summary"].items():
        print(f"{key:38s} {v['median']:.4g} ({v['min']:.4g}-{v['max']:.4g})")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
