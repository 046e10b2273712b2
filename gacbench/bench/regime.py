"""The regime map: the stale - sync gap and the alignment statistics per (model, learning rate, staleness)."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np

from gacbench.bench.groups import capped_final, nanmean, per_seed
from gacbench.bench.stats import CI_LEVEL, mean_t_interval, paired_difference


def _model_label(objective: str | None, params: dict) -> str:
    """GRPO's model (``model.size``, else ``model.path``; the default size is tiny), else the objective's name."""
    model = params.get("model")
    if isinstance(model, dict):
        return str(model.get("size") or model.get("path") or "tiny")
    if model is not None:
        return str(model)
    return "tiny" if objective == "grpo" else str(objective)


def regime_points(cells: list[dict], specs: list[dict]) -> list[dict]:
    """The regime map: for every task of an objective whose tasks span two or more learning rates (``params.lr``),
    per staleness s > 0 of ``stale``: the stale - sync gap on the training reward (last 20% of steps; the final
    metric where no reward is logged, negated where lower is better, so that < 0 is always "stale worse"), paired
    over seeds, with its 95% t-interval (:func:`~gacbench.bench.stats.mean_t_interval`); median c_t and
    q0.9(|c_t|) of sync and stale; the share of seeds whose training reward degraded (fell more than
    the degradation threshold below its own running maximum, smoothed over DEGRADE_WINDOW steps:
    :func:`degrade_threshold`); and whether sync training
    is healthy (no sync seed diverged or degraded, and its reward rose from the first to the last 20% of steps
    on average)."""
    params: dict[str, tuple] = {}
    for c in specs:
        params.setdefault(c["task"], (c.get("objective"), c.get("params") or {}))
    lrs: dict[Any, set] = defaultdict(set)
    for obj, p in params.values():
        if isinstance(p.get("lr"), (int, float)) and not isinstance(p.get("lr"), bool):
            lrs[obj].add(float(p["lr"]))
    tasks = sorted(t for t, (obj, p) in params.items() if len(lrs[obj]) >= 2 and isinstance(p.get("lr"), (int, float)))
    done = [c for c in cells if c["status"] == "done" and not c.get("ablation") and c["task"] in tasks]
    if not done:
        return []
    points = []
    for task in tasks:
        tc = [c for c in done if c["task"] == task]
        if not tc:
            continue
        key = "reward_last" if all("reward_last" in c for c in tc) else "final"
        seeds = per_seed(tc, key)
        sync = [c for c in tc if c["method"] == "sync" and c["staleness"] == 0]
        higher = key == "reward_last" or bool(tc[0]["higher_is_better"])
        if key == "reward_last":
            rises = [c["reward_last"] - c["reward_first"] for c in sync]
        else:
            rises = [(1.0 if higher else -1.0) * (capped_final(c) - c["initial"]) for c in sync]
        healthy = (bool(sync) and not any(c["diverged"] for c in sync) and not any(c.get("degraded") for c in sync)
                   and float(np.mean(rises)) > 0)
        sync_seeds = seeds.get((task, "sync", 0), {})
        for s in sorted({c["staleness"] for c in tc if c["method"] == "stale"}):
            stale = [c for c in tc if c["method"] == "stale" and c["staleness"] == s]
            stale_seeds = seeds.get((task, "stale", s), {})
            common = sorted(set(sync_seeds) & set(stale_seeds))
            # oriented so that < 0 is always "stale worse": a final loss (lower is better) is negated
            d = (1.0 if higher else -1.0) * np.array([stale_seeds[k] - sync_seeds[k] for k in common])
            low, high = mean_t_interval(d)
            drops = [c.get("reward_drop") for c in stale if c.get("reward_drop") is not None]
            points.append({
                "task": task, "model": _model_label(*params[task]), "lr": float(params[task][1]["lr"]),
                "staleness": s, "measure": key, "sync": nanmean(list(sync_seeds.values())),
                "stale": nanmean(list(stale_seeds.values())), "gap": float(d.mean()) if d.size else math.nan,
                "gap_ci_low": low, "gap_ci_high": high, "n": len(common),
                "sync_cos_median": nanmean([c["cos_median"] for c in sync]),
                "stale_cos_median": nanmean([c["cos_median"] for c in stale]),
                "sync_cos_abs_q90": nanmean([c["cos_abs_q90"] for c in sync]),
                "stale_cos_abs_q90": nanmean([c["cos_abs_q90"] for c in stale]),
                "stale_degraded_frac": float(np.mean([bool(c.get("degraded")) for c in stale])) if stale else math.nan,
                "stale_reward_drop": nanmean(drops),
                "sync_degraded_frac": float(np.mean([bool(c.get("degraded")) for c in sync])) if sync else math.nan,
                "sync_rise": nanmean(rises), "sync_healthy": healthy,
            })
            etas = [c["assume_eta_max"] for c in stale if c.get("assume_eta_max") is not None]
            if etas:  # the step-size condition of the bounded-staleness bound at the stale run's own L and lag
                lr = points[-1]["lr"]
                points[-1].update({
                    "sync_L": nanmean([c["assume_L"] for c in sync if c.get("assume_L") is not None]),
                    "stale_L": nanmean([c["assume_L"] for c in stale if c.get("assume_L") is not None]),
                    "stale_eta_max": float(np.median(etas)),
                    "lr_within_eta_max": bool(lr <= float(np.median(etas))),
                    "stale_eta_eff": nanmean([c.get("assume_eta_eff", math.nan) for c in stale]),
                    "stale_worse": bool(points[-1]["gap_ci_high"] < 0) if points[-1]["n"] >= 2 else None,
                })
                eff = points[-1]["stale_eta_eff"]
                points[-1]["eff_within_eta_max"] = None if math.isnan(eff) else bool(eff <= points[-1]["stale_eta_max"])
    points.sort(key=lambda p: (p["model"], p["lr"], p["staleness"]))
    return points


def _spearman(pts: list[dict]) -> tuple[float, float]:
    """Spearman's rank correlation of gap against s * lr over ``pts`` (scipy.stats.spearmanr), and its p-value;
    NaN with fewer than three points or a single s * lr value."""
    if len(pts) < 3 or len({p["s_lr"] for p in pts}) < 2:
        return math.nan, math.nan
    import warnings

    from scipy import stats

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a constant gap: NaN, reported as null
        res = stats.spearmanr([p["s_lr"] for p in pts], [p["gap"] for p in pts])
    return float(res.statistic), float(res.pvalue)


def law_points(points: list[dict]) -> list[dict]:
    """The staleness x learning-rate law of the regime map: the per-step surrogate-gradient bias of stale training
    grows like s * lr, so per model the stale - sync gap should be one monotone function of s * lr. One entry per
    model: ``measure`` (the points' measure: ``reward_last`` or ``final``, ``mixed`` where they differ),
    ``points`` (``s_lr``, ``lr``, ``staleness``, ``gap``, its interval, ``n``, ``sync_healthy``) sorted by
    s * lr; Spearman's rank correlation of gap against s * lr over the points with a finite gap
    (``spearman_rho``, ``spearman_p``) and over those of them whose sync run is healthy (``spearman_rho_healthy``,
    ``spearman_p_healthy``: the curve below the healthy-sync limit), each null with fewer than three points or a
    single s * lr value; the learning rates whose sync run is not healthy (``sync_unhealthy_lrs``: the regime
    map's ``sync_healthy``, beyond which the gap compares with a sync run that itself fails) and the largest
    healthy one (``healthy_lr_max``, null when none is). Empty when the map has fewer than two distinct s * lr
    values."""
    if len({p["staleness"] * p["lr"] for p in points}) < 2:
        return []
    out = []
    for model in sorted({p["model"] for p in points}):
        pts = sorted(({"s_lr": p["staleness"] * p["lr"], "lr": p["lr"], "staleness": p["staleness"], "gap": p["gap"],
                       "gap_ci_low": p["gap_ci_low"], "gap_ci_high": p["gap_ci_high"], "n": p["n"],
                       "sync_healthy": p["sync_healthy"]} for p in points if p["model"] == model),
                     key=lambda p: (p["s_lr"], p["lr"]))
        finite = [p for p in pts if p["gap"] is not None and math.isfinite(p["gap"])]
        rho, pval = _spearman(finite)
        rho_h, pval_h = _spearman([p for p in finite if p["sync_healthy"]])
        measures = {p["measure"] for p in points if p["model"] == model}
        healthy = [p["lr"] for p in pts if p["sync_healthy"]]
        out.append({"model": model, "measure": measures.pop() if len(measures) == 1 else "mixed", "points": pts,
                    "spearman_rho": rho, "spearman_p": pval, "spearman_rho_healthy": rho_h,
                    "spearman_p_healthy": pval_h, "healthy_lr_max": max(healthy) if healthy else None,
                    "sync_unhealthy_lrs": sorted({p["lr"] for p in pts if not p["sync_healthy"]})})
    return out


#: The paper's Table 3 (on-policy c_t statistics after step 50), with each model's nominal parameter count as its
#: name gives it: the reference rows of the model-size table (:func:`size_points`) and of fig_size.png
PAPER_TABLE3 = (
    {"model": "Qwen3-1.7B", "params": 1.7e9, "cos_abs_q90": 0.0471, "cos_max_abs": 0.0924, "cos_abs_le_005": 0.91},
    {"model": "Llama-3.2-3B-Instruct", "params": 3.0e9, "cos_abs_q90": 0.0687, "cos_max_abs": 0.1276,
     "cos_abs_le_005": 0.83},
    {"model": "Qwen3-4B", "params": 4.0e9, "cos_abs_q90": 0.0296, "cos_max_abs": 0.0645, "cos_abs_le_005": 0.99},
    {"model": "Qwen3-8B", "params": 8.0e9, "cos_abs_q90": 0.0317, "cos_max_abs": 0.0625, "cos_abs_le_005": 0.98},
)


def size_sync_cells(cells: list[dict], tasks: set[str]) -> list[dict]:
    """The done synchronous cells of ``tasks`` that record the model's parameter count and a finite q0.9(|c_t|):
    the cells the model-size table, its trend and fig_size.png read."""
    return [c for c in cells if c["status"] == "done" and not c.get("ablation") and c["task"] in tasks
            and c["method"] == "sync" and c["staleness"] == 0 and c.get("params")
            and c.get("cos_abs_q90") is not None and math.isfinite(c["cos_abs_q90"])]


def size_points(cells: list[dict], specs: list[dict]) -> list[dict]:
    """The model-size axis: for every task whose synchronous cells record the model's parameter count (GRPO's
    ``model/params``), the on-policy c_t statistics of paper Table 3 (means over the sync cells' seeds: median c_t,
    q0.9(|c_t|), max |c_t|, Pr(|c_t| <= 0.05)), the task's ``lr``, and per staleness s of ``stale`` the stale
    run's median c_t and its ratio to sync's (``stale``: one entry per s). Sorted by parameter count, then lr;
    empty unless the tasks span at least two parameter counts (a grid of one model has no size axis)."""
    lr_of = {c["task"]: (c.get("params") or {}).get("lr") for c in specs}
    done = [c for c in cells if c["status"] == "done" and not c.get("ablation")]
    rows = []
    for task in sorted({c["task"] for c in done}):
        sync = size_sync_cells(done, {task})
        if not sync:
            continue
        row = {"task": task, "params": int(sync[0]["params"]), "lr": lr_of.get(task), "n": len(sync),
               **{f"sync_{k}": nanmean([c.get(k, math.nan) for c in sync])
                  for k in ("cos_median", "cos_abs_q90", "cos_max_abs", "cos_abs_le_005")}, "stale": []}
        for s in sorted({c["staleness"] for c in done if c["task"] == task and c["method"] == "stale"}):
            stale = [c for c in done if c["task"] == task and c["method"] == "stale" and c["staleness"] == s]
            med = nanmean([c["cos_median"] for c in stale])
            ratio = med / row["sync_cos_median"] if row["sync_cos_median"] and math.isfinite(med) else math.nan
            row["stale"].append({"staleness": s, "stale_cos_median": med, "cos_median_ratio": ratio, "n": len(stale)})
        rows.append(row)
    if len({r["params"] for r in rows}) < 2:
        return []
    return sorted(rows, key=lambda r: (r["params"], r["lr"] if isinstance(r["lr"], (int, float)) else math.inf))


def size_trend(cells: list[dict], points: list[dict]) -> dict | None:
    """How the synchronous q0.9(|c_t|) moves with model size: the least-squares slope of the per-seed values
    against log10(parameter count) over the sync cells of the model-size table's tasks (:func:`size_points`),
    with its 95% t-interval and p-value (scipy.stats.linregress; ``slope_per_decade``: the change of q0.9(|c_t|)
    per tenfold parameters), and the line's value at each of the paper's Table 3 models (``at_paper``: where the
    trend points, an extrapolation). None unless every parameter count has one task (one learning rate, so that
    the slope is the size's and not the lr's) and there are at least three of them."""
    by_params: dict[int, list[str]] = defaultdict(list)
    for p in points:
        by_params[p["params"]].append(p["task"])
    if len(by_params) < 3 or any(len(t) > 1 for t in by_params.values()):
        return None
    from scipy import stats

    sync = size_sync_cells(cells, {p["task"] for p in points})
    x = np.log10([float(c["params"]) for c in sync])
    y = np.array([c["cos_abs_q90"] for c in sync])
    fit = stats.linregress(x, y)
    half = float(stats.t.ppf(0.5 + CI_LEVEL / 2, len(x) - 2) * fit.stderr) if len(x) > 2 else math.nan
    return {"measure": "sync cos_abs_q90", "slope_per_decade": float(fit.slope),
            "slope_ci_low": float(fit.slope) - half, "slope_ci_high": float(fit.slope) + half,
            "p": float(fit.pvalue), "intercept": float(fit.intercept),
            "n_cells": len(x), "sizes": sorted(by_params),
            "at_paper": [{"model": r["model"], "params": r["params"],
                          "fit": float(fit.intercept + fit.slope * math.log10(r["params"])),
                          "paper": r["cos_abs_q90"]} for r in PAPER_TABLE3]}


#: the corrections whose recovered share the table "toward the paper's regime" gives (absent ones are shown as -)
TOWARD_METHODS = ("gac", "gac-calibrated", "gspo", "gac-step")


def toward_row(summary: dict, task: str, staleness: int, label: str, source: str = "summary.json") -> dict:
    """One point of the table that places the grids on the way to the paper's regime, read from a grid's
    ``summary.json`` (``summary``, loaded; ``source`` names it in errors): for ``task`` at ``staleness``, the
    model's parameter count and sync's mean response length (generated tokens); sync's q0.9(|c_t|) (paper
    Table 3's statistic); stale's median c_t over sync's; the sync - stale gap in training reward (last 20% of
    steps) over the seeds both ran, with its 95% t-interval and paired t-test p (:func:`paired_difference`, from
    the summary's cells); for each of :data:`TOWARD_METHODS` that the grid holds,
    its recovered share with the 95% interval and the adjusted p of its paired test against stale (None where the
    grid lacks the method); and ``ratio_max``, stale's largest token ratio pi_theta / pi_behav (each run's
    maximum, mean over seeds). Raises ValueError naming ``source`` and the missing group."""
    groups = {(g["task"], g["method"], g["staleness"]): g for g in summary.get("groups", []) if not g.get("ablation")}

    def group(method: str, s: int) -> dict:
        g = groups.get((task, method, s))
        if g is None:
            have = sorted({(t, m, st) for t, m, st in groups if t == task})
            raise ValueError(f"{source}: no group {method} at s = {s} on task {task!r} (its groups there: "
                             f"{', '.join(f'{m} s={st}' for _, m, st in have) or 'none'}); name a task and "
                             "staleness that the grid ran, or finish the grid")
        return g

    sync, stale = group("sync", 0), group("stale", staleness)
    entries = {r["method"]: r for r in summary.get("recovered_reward", [])
               if r["task"] == task and r["staleness"] == staleness}
    seeds = per_seed(summary.get("cells", []), "reward_last")
    a, b = seeds.get((task, "sync", 0), {}), seeds.get((task, "stale", staleness), {})
    shared = sorted(set(a) & set(b))
    gap = paired_difference(np.array([a[k] for k in shared]), np.array([b[k] for k in shared]))
    row: dict[str, Any] = {
        "point": label, "source": source, "task": task, "staleness": staleness,
        "params": sync.get("params"), "response_tokens": sync.get("response_tokens_mean"),
        "n_sync": sync.get("n"), "n_stale": stale.get("n"),
        "sync_cos_abs_q90": sync.get("cos_abs_q90"),
        "cos_median_ratio": (stale["cos_median"] / sync["cos_median"]
                             if sync.get("cos_median") and stale.get("cos_median") is not None else None),
        "gap": gap["diff"], "gap_ci_low": gap["ci_low"], "gap_ci_high": gap["ci_high"], "gap_p": gap["p"],
        "gap_seeds": len(shared),
        "ratio_max": stale.get("ratio_max_mean"),
    }
    for m in TOWARD_METHODS:
        r = entries.get(m)
        row[m] = None if r is None else {k: r.get(k) for k in
                                          ("share", "share_ci_low", "share_ci_high", "share_ci_kind",
                                           "share_ci_excluded", "vs_stale_p_adj", "min_detectable_share", "n",
                                           "no_gap")}
    return row
