"""Groups of stored cells: the seeds of one (task, method, staleness) averaged, and per-seed values.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from gacbench.bench.records import DIAGNOSTICS


def capped_final(rec: dict) -> float:
    final = rec["final"]
    if rec["diverged"] or final is None or not math.isfinite(final):
        return rec["initial"]
    return final


def nanmean(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return float(np.mean(xs)) if xs else math.nan


def group_records(cells: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for c in cells:
        if c["status"] == "done":
            groups[(c["task"], c["method"], c["staleness"])].append(c)
    out = []
    for (task, method, s), recs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        finals = [capped_final(r) for r in recs]
        out.append({
            "task": task, "method": method, "staleness": s, "metric": recs[0]["metric"],
            "higher_is_better": recs[0]["higher_is_better"], "ablation": recs[0]["ablation"],
            "final_mean": float(np.mean(finals)), "final_std": float(np.std(finals)) if len(finals) > 1 else 0.0,
            "diverged_frac": float(np.mean([bool(r["diverged"]) for r in recs])),
            **({"reward_last_mean": float(np.mean([r["reward_last"] for r in recs])),
                "reward_last_std": float(np.std([r["reward_last"] for r in recs])),
                "reward_first_mean": float(np.mean([r["reward_first"] for r in recs]))}
               if all("reward_last" in r for r in recs) else {}),
            "cos_median": nanmean([r["cos_median"] for r in recs]),
            "cos_abs_q90": nanmean([r["cos_abs_q90"] for r in recs]),
            "cos_abs_le_005": nanmean([r["cos_abs_le_005"] for r in recs]),
            **{f"{k}_mean": float(np.mean([r[k] for r in recs])) for k in (*DIAGNOSTICS, "gac_changed")
               if all(k in r for r in recs)},
            "n": len(recs),
        })
    return out


def per_seed(cells: list[dict], key: str) -> dict[tuple, dict[int, float]]:
    """{(task, method, staleness): {seed: value}} of the done cells: ``final`` (a diverged run at its starting
    value, as in ``final_mean``) or another per-cell key (``reward_last``). An ablation cell's method names its
    thresholds (``gac(c_low=0.05,c_high=0.3)``), so its key never meets a main grid's."""
    out: dict[tuple, dict[int, float]] = defaultdict(dict)
    for c in cells:
        if c["status"] != "done":
            continue
        value = capped_final(c) if key == "final" else c.get(key)
        if value is not None and math.isfinite(value):
            out[(c["task"], c["method"], c["staleness"])][c["seed"]] = float(value)
    return out
