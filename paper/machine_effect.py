"""The machine effect on a grid: the same cells (task, method, staleness, seed) of one code version computed on two
machine kinds, compared on what the report reads.

For every cell that both stores hold done, it reads the policy reward of the last evaluated policy version
(``eval/policy_reward``, filed by version as the report files it) and the training rewards (``reward/mean``), and
prints:

- per cell: the final policy reward on each kind, B - A, and the first step at which the sampled training rewards
  part (the arithmetic differs from step 0 across kinds; the sampled tokens stay equal until a rounding difference
  flips one);
- B - A over the cells, with its 95% t-interval (cells as the units: the cells of one seed are not independent, so
  the interval is narrower than one over seeds would be), and the mean and largest |B - A|;
- the paired comparison's move: for each method with the baseline (``--baseline``, default stale) at the same
  staleness and seed on both kinds, (method - baseline) on B minus the same on A, with its 95% t-interval: how far
  the machine moves the within-seed differences that the report's shares are made of.

    python paper/machine_effect.py grids/llm-headline-healthy-intel grids/llm-headline-healthy [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from gacbench.bench.cell import cell_dir, stored_done
from gacbench.bench.records import POLICY_REWARD, by_version, discover_cells, read_metrics
from gacbench.bench.stats import paired_difference


def cell_readings(metrics: Path) -> dict:
    """``final``: the policy reward of the last evaluated version, as the report files it
    (:func:`gacbench.bench.records.by_version`; ``version``: that version), ``rewards``: the training reward by
    step."""
    series = read_metrics(metrics)
    policy = by_version(series).get(POLICY_REWARD) or {}
    version = max(policy, default=-1)
    return {"final": policy.get(version, math.nan), "version": version, "rewards": dict(series.get("reward/mean", []))}


def done_cells(store: Path) -> dict[tuple, dict]:
    """``store``'s done cells by (task, method, staleness, seed), each with its readings."""
    return {(c["task"], c["method"], int(c["staleness"]), int(c["seed"])):
            cell_readings(cell_dir(store, c) / "metrics.csv")
            for c in discover_cells(store) if stored_done(store, c) is not None}


def parting_step(a: dict[int, float], b: dict[int, float]) -> int | None:
    """The first step whose training reward differs between ``a`` and ``b``; ``None`` if they agree throughout."""
    return next((s for s in sorted(set(a) & set(b)) if a[s] != b[s]), None)


def compare(a: dict[tuple, dict], b: dict[tuple, dict], baseline: str = "stale") -> dict:
    both = sorted(set(a) & set(b), key=lambda k: (k[0], k[2], k[1], k[3]))
    if not both:
        raise ValueError("the two stores hold no done cell in common (same task, method, staleness and seed)")
    cells = [{"task": k[0], "method": k[1], "staleness": k[2], "seed": k[3], "a": a[k]["final"], "b": b[k]["final"],
              "version": a[k]["version"], "diff": b[k]["final"] - a[k]["final"],
              "parts_at": parting_step(a[k]["rewards"], b[k]["rewards"]), "steps": len(a[k]["rewards"])}
             for k in both]
    if any(a[k]["version"] != b[k]["version"] for k in both):
        raise ValueError("a cell's last evaluated policy version differs between the stores: not the same cells")
    diffs = np.array([c["diff"] for c in cells])
    moves = []
    for task, method, s, seed in both:
        base = (task, baseline, s, seed)
        if method != baseline and base in a and base in b:
            in_a = a[(task, method, s, seed)]["final"] - a[base]["final"]
            in_b = b[(task, method, s, seed)]["final"] - b[base]["final"]
            moves.append({"task": task, "method": method, "staleness": s, "seed": seed, "a": in_a, "b": in_b,
                          "move": in_b - in_a})
    out = {"cells": cells, "diff": paired_difference(np.array([c["b"] for c in cells]),
                                                     np.array([c["a"] for c in cells])),
           "mean_abs_diff": float(np.abs(diffs).mean()), "max_abs_diff": float(np.abs(diffs).max()),
           "parted": sum(c["parts_at"] is not None for c in cells), "baseline": baseline, "moves": moves}
    if moves:
        out["move"] = paired_difference(np.array([m["b"] for m in moves]), np.array([m["a"] for m in moves]))
        out["max_abs_move"] = float(max(abs(m["move"]) for m in moves))
    return out


def _ci(d: dict) -> str:
    return f"{d['diff']:+.4f} [{d['ci_low']:+.4f}, {d['ci_high']:+.4f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="the store of one machine kind (e.g. grids/llm-headline-healthy-intel)")
    parser.add_argument("b", type=Path, help="the store of the other (e.g. grids/llm-headline-healthy)")
    parser.add_argument("--baseline", default="stale", help="the method each paired difference is taken against")
    parser.add_argument("--json", type=Path, help="also write the comparison to this file")
    args = parser.parse_args(argv)
    for store in (args.a, args.b):
        if not (store / "cells").is_dir():
            parser.error(f"{store} holds no cells/ directory: pass a bench --out directory")
    try:
        res = compare(done_cells(args.a), done_cells(args.b), args.baseline)
    except ValueError as exc:
        parser.error(str(exc))
    print("| task | method | s | seed | A | B | B - A | training rewards part at step |")
    print("|---|---|---|---|---|---|---|---|")
    for c in res["cells"]:
        parts = "never" if c["parts_at"] is None else str(c["parts_at"])
        print(f"| {c['task']} | {c['method']} | {c['staleness']} | {c['seed']} | {c['a']:.4f} | {c['b']:.4f} | "
              f"{c['diff']:+.4f} | {parts} (of {c['steps']}) |")
    print(f"\n{len(res['cells'])} cells, policy reward of the last version, B - A: {_ci(res['diff'])}; mean |B - A| "
          f"{res['mean_abs_diff']:.4f}, largest {res['max_abs_diff']:.4f}; training rewards part in "
          f"{res['parted']} of {len(res['cells'])} cells")
    if res["moves"]:
        largest = max(res["moves"], key=lambda m: abs(m["move"]))
        print(f"{len(res['moves'])} paired differences (method - {res['baseline']}, within a seed), B - A: "
              f"{_ci(res['move'])}; largest {largest['move']:+.4f} ({largest['method']} s = {largest['staleness']} "
              f"seed {largest['seed']})")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
