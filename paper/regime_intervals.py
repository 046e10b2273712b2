"""A regime map's stale - sync gaps with 95% t-intervals, from the per-seed values a published summary.json holds.

``paper/llm-regime/summary.md`` gives each gap a percentile bootstrap interval, which at three seeds is the range
of the three per-seed gaps and covers about 75% of the time; its cells are not stored, so the report cannot be
rebuilt from them. Its summary.json keeps every cell's record, and this script reads the gaps from them with the
report's t-interval (:func:`gacbench.bench.stats.mean_t_interval`), together with the 'stale worse' reading (the
interval below 0) and the step-size condition's agreement counts.

    python paper/regime_intervals.py paper/llm-regime/summary.json > paper/llm-regime/t-intervals.md
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from gacbench.bench.groups import per_seed
from gacbench.bench.stats import mean_t_interval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("summary", help="a summary.json with a regime map (regime) and its cells")
    args = parser.parse_args()
    summary = json.load(open(args.summary))
    if not summary.get("regime"):
        sys.exit(f"regime_intervals.py: {args.summary} has no regime map (its grid spans one learning rate per "
                 "objective); give the summary.json of a grid that spans two or more")
    higher = {c["task"]: bool(c.get("higher_is_better", True)) for c in summary["cells"]}
    print(f"# Regime map with 95% t-intervals: `{args.summary}`\n")
    print("Gap: stale − sync, paired over seeds, on the regime map's measure (the training reward of the last 20% "
          "of steps; the final metric, negated where lower is better, where no reward is logged), so that < 0 is "
          "stale worse; 95% t-interval of its mean (mean ± t_{0.975, n−1} sd / √n) beside the interval the summary "
          f"holds. Regenerate with `python paper/regime_intervals.py {args.summary}`.\n")
    print("| model | lr | s | gap | 95% t-interval | summary's interval | stale worse (t-interval < 0) | "
          "lr <= eta_max | eta_eff <= eta_max | seeds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    judged = worse = 0
    matches = {"lr_within_eta_max": [0, 0], "eff_within_eta_max": [0, 0]}
    yes = {True: "yes", False: "no", None: "n/a"}
    for p in summary["regime"]:
        measure = p.get("measure", "reward_last")
        seeds = per_seed(summary["cells"], measure)
        stale, sync = seeds.get((p["task"], "stale", p["staleness"]), {}), seeds.get((p["task"], "sync", 0), {})
        sign = 1.0 if measure == "reward_last" or higher.get(p["task"], True) else -1.0
        common = sorted(set(stale) & set(sync))
        d = sign * np.array([stale[k] - sync[k] for k in common])
        low, high = mean_t_interval(d)
        below = bool(high < 0) if len(d) >= 2 else None
        if below is not None:
            judged += 1
            worse += below
            for key, count in matches.items():
                if p.get(key) is not None:
                    count[0] += (not p[key]) == below
                    count[1] += 1
        print(f"| {p['model']} | {p['lr']:g} | {p['staleness']} | {d.mean():+.3f} | [{low:+.4f}, {high:+.4f}] | "
              f"[{p['gap_ci_low']:+.4f}, {p['gap_ci_high']:+.4f}] | {yes[below]} | "
              f"{yes[p.get('lr_within_eta_max')]} | {yes[p.get('eff_within_eta_max')]} | {len(d)} |")
    print(f"\nStale worse at {worse} of {judged} points.", end="")
    for key, name in (("lr_within_eta_max", "lr"), ("eff_within_eta_max", "eta_eff")):
        hit, n = matches[key]
        if n:
            print(f" Predicting a stale failure where {name} > eta_max(s) matches the observation at {hit} of {n} "
                  "points.", end="")
    print()


if __name__ == "__main__":
    main()
