"""The regime map's stale - sync gaps with 95% t-intervals, from the per-seed values a published summary.json holds.

``paper/llm-regime/summary.md`` was written when the report gave the gap a percentile bootstrap interval, which at
three seeds is the range of the three per-seed gaps and covers about 75% of the time; its cells are not stored, so
the report cannot be rebuilt. Its summary.json keeps every cell's record, and this script reads the gaps from them
again with the interval the report now uses (:func:`gacbench.bench.stats.mean_t_interval`), together with the
'stale worse' reading (the interval below 0) and the step-size condition's agreement counts.

    python paper/regime_intervals.py paper/llm-regime/summary.json > paper/llm-regime/t-intervals.md
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from gacbench.bench.groups import per_seed
from gacbench.bench.stats import mean_t_interval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("summary", help="a summary.json with a regime map (regime) and its cells")
    args = parser.parse_args()
    summary = json.load(open(args.summary))
    seeds = per_seed(summary["cells"], "reward_last")
    print(f"# Regime map with 95% t-intervals: `{args.summary}`\n")
    print("Gap: stale − sync training reward over the last 20% of steps, paired over seeds; 95% t-interval of its "
          "mean (mean ± t_{0.975, n−1} sd / √n) beside the percentile bootstrap interval the summary was published "
          f"with. Regenerate with `python paper/regime_intervals.py {args.summary}`.\n")
    print("| model | lr | s | gap | 95% t-interval | published bootstrap interval | stale worse (t-interval < 0) | "
          "lr <= eta_max | eta_eff <= eta_max | seeds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    worse = lr_match = eff_match = judged = 0
    for p in summary["regime"]:
        stale, sync = seeds.get((p["task"], "stale", p["staleness"]), {}), seeds.get((p["task"], "sync", 0), {})
        common = sorted(set(stale) & set(sync))
        d = np.array([stale[k] - sync[k] for k in common])
        low, high = mean_t_interval(d)
        below = bool(high < 0) if len(d) >= 2 else None
        if below is not None and "lr_within_eta_max" in p:
            judged += 1
            worse += below
            lr_match += (not p["lr_within_eta_max"]) == below
            eff_match += p.get("eff_within_eta_max") is not None and (not p["eff_within_eta_max"]) == below
        yes = {True: "yes", False: "no", None: "n/a"}
        print(f"| {p['model']} | {p['lr']:g} | {p['staleness']} | {d.mean():+.3f} | [{low:+.4f}, {high:+.4f}] | "
              f"[{p['gap_ci_low']:+.4f}, {p['gap_ci_high']:+.4f}] | {yes[below]} | "
              f"{yes[p.get('lr_within_eta_max')]} | {yes[p.get('eff_within_eta_max')]} | {len(d)} |")
    print(f"\nStale worse at {worse} of {judged} points. Predicting a stale failure where lr > eta_max(s) matches "
          f"the observation at {lr_match} of {judged} points; where eta_eff > eta_max(s), at {eff_match} of "
          f"{judged}.")


if __name__ == "__main__":
    main()
