"""Check that a machine reproduces a grid's stored cells: every value logged in the first steps, equal to the digit.

The use: before a machine resumes a grid's seeds, short copies of some of those seeds' stored cells (the suite
file with fewer ``steps``, run from the grid's pinned checkout into a scratch ``--out``) are run on it, and this
compares each with the stored cell of the same task, method, staleness and seed. Every metric that a step logs
is compared as written in ``metrics.csv`` (the text, so a difference in the last digit counts), at the training
steps of the short run (below its ``steps``: its last step logs its end-of-run evaluation where the stored cell
goes on training), except the wall times (``time/...``), which no two runs share. A cell with no stored
counterpart is listed and not compared.

    python paper/same_cells.py SCRATCH GRID [--steps N]   # exit 0: every compared value equal; 1: a difference

(grids/README.md names the checks run this way, and ``paper/as-avx2-kind.sh`` the way another kind of machine is
made to compute as a grid's.)
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from gacbench.jsonio import read_json

#: the metrics left out of the comparison: wall times, which differ between any two runs
SKIPPED_PREFIXES = ("time/",)


def logged_steps(path: Path) -> dict[int, dict[str, str]]:
    """``metrics.csv``'s values by step: every non-empty value a step logged (Lightning writes one step over
    several rows), as text, wall times left out (the text, not the float that
    :func:`gacbench.bench.records.read_metrics` parses: a different last digit is a difference)."""
    by_step: dict[int, dict[str, str]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = row.get("step")
            if not step:
                continue
            values = by_step.setdefault(int(float(step)), {})
            values.update({k: v for k, v in row.items()
                           if k != "step" and v not in ("", None) and not k.startswith(SKIPPED_PREFIXES)})
    return by_step


def compare(scratch: Path, grid: Path, steps: int | None = None) -> list[dict]:
    """One entry per cell of ``scratch`` (``cells/TASK/METHOD/sS/seedK/metrics.csv``): ``cell`` (its path under
    cells/), ``stored`` (whether ``grid`` holds it), ``equal`` and ``differ`` (counts of the values both logged at
    the steps both logged, below ``steps`` where given), ``only_one`` (values logged by one of the two) and
    ``first`` (the first difference: step, metric, scratch value, stored value). The steps compared are those
    below the scratch cell's ``steps`` (its config.json), and below ``steps`` where given."""
    out = []
    for path in sorted((scratch / "cells").glob("*/*/s*/seed*/metrics.csv")):
        rel = path.parent.relative_to(scratch / "cells")
        stored = grid / "cells" / rel / "metrics.csv"
        entry = {"cell": str(rel), "stored": stored.is_file(), "equal": 0, "differ": 0, "only_one": 0, "first": None}
        if entry["stored"]:
            a, b = logged_steps(path), logged_steps(stored)
            limit = read_json(path.parent / "config.json")["steps"]
            limit = limit if steps is None else min(limit, steps)
            for step in sorted(set(a) & set(b)):
                if step >= limit:
                    continue
                for name in sorted(set(a[step]) | set(b[step])):
                    if name not in a[step] or name not in b[step]:
                        entry["only_one"] += 1
                    elif a[step][name] == b[step][name]:
                        entry["equal"] += 1
                    else:
                        entry["differ"] += 1
                        entry["first"] = entry["first"] or (step, name, a[step][name], b[step][name])
        out.append(entry)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scratch", type=Path, help="the --out of the short run on this machine")
    parser.add_argument("grid", type=Path, help="the grid store it should reproduce (e.g. grids/llm-headline-healthy)")
    parser.add_argument("--steps", type=int,
                        help="compare only the first STEPS steps (default: every training step of the scratch cells)")
    args = parser.parse_args(argv)
    for store in (args.scratch, args.grid):
        if not (store / "cells").is_dir():
            parser.error(f"{store} holds no cells/ directory: pass a bench --out directory")
    entries = compare(args.scratch, args.grid, args.steps)
    compared = [e for e in entries if e["stored"]]
    for e in entries:
        if not e["stored"]:
            print(f"{e['cell']}: not stored in {args.grid}, not compared")
            continue
        first = "" if e["first"] is None else " first at step {}: {} {} against {}".format(*e["first"])
        print(f"{e['cell']}: {e['equal']} equal, {e['differ']} differ, {e['only_one']} logged by one only{first}")
    equal = sum(e["equal"] for e in compared)
    bad = sum(e["differ"] + e["only_one"] for e in compared)
    print(f"{len(compared)} cells compared: {equal} values equal, {bad} not")
    return 0 if compared and bad == 0 and equal > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
