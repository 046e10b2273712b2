"""Summary tables and figures of a benchmark directory, built from the stored runs alone.

``gacbench report DIR`` regenerates ``summary.json``, ``summary.md`` and the PNG figures without
running anything. The summary covers every cell stored in ``DIR`` (also when ``gacbench bench`` ran a
subset of the grid into it). A cell whose status says done but whose stored files are incomplete
(:func:`gacbench.bench.cell.done_problem`) is listed as ``incomplete``, with the bad file named, and
never counted as finished; the next ``gacbench bench`` into ``DIR`` recomputes it. Definitions:

- a cell's ``final`` is the objective's metric after the last step; ``diverged`` is non-finite
  parameters or metric, or (for loss-like metrics) a final 10x worse than the start;
- a group (task, method, staleness) averages its seeds; ``final_mean`` counts a diverged run at
  its starting value (a run that blew up is no better than one that never moved), so that means
  and the recovered share stay finite;
- the recovered share of the gap is (stale - m) / (stale - sync) on ``final_mean``, for every
  stabilizer m at each staleness: 1 recovers the synchronous result, 0 is no better than stale; a
  gap smaller than twice its standard error over seeds (sqrt(s_sync²/n_sync + s_stale²/n_stale), s the
  sample standard deviation) is flagged (``gap_within_noise``; null with a single seed): the share is
  then a ratio of noise;
- confidence intervals (appended section of summary.md; ``share_ci_low``/``share_ci_high``, ``n`` and the
  ``vs_stale_*`` keys of each ``recovered``/``recovered_reward`` entry): over the seeds that sync, stale and
  the method share (``n``, distinct seeds), a paired percentile bootstrap of the share (``BOOT_RESAMPLES``
  resamples of the seeds with replacement, the same resampled seeds for the three groups, numpy generator
  seeded with ``BOOT_SEED``, the 2.5% and 97.5% empirical quantiles of the resampled shares; a resample whose
  gap is 0 has share +-inf by the sign of its numerator, or is dropped when that is 0 too), and the paired
  difference method - stale, signed so that > 0 is better, with its t-interval and the two-sided paired
  t-test's p-value (scipy.stats.ttest_rel); intervals are null with fewer than two seeds; the share and its
  interval are null when sync or stale has no cells (``missing`` names them), the comparison when stale has
  none;
- a cell's ``reward_drop`` (rollout objectives): how far its training reward, smoothed over
  ``DEGRADE_WINDOW`` steps, ends below its own running maximum, and ``reward_noise``, the standard deviation
  of a DEGRADE_WINDOW-step mean from the step-to-step noise; ``degraded`` when the drop exceeds both
  ``DEGRADE_MARGIN`` and ``DEGRADE_SIGMAS`` x reward_noise (the progressive-degradation indicator of the
  regime map);
- appended to summary.md after the existing sections: the intervals, paper Table 1 (:func:`_table1`, at
  :func:`table1_staleness`), paper Table 3 with the calibrated thresholds (:func:`_table3`) and the regime
  map (:func:`regime_points`, also ``regime`` in summary.json);
- the c_t statistics use the steps after the suite's warm-up;
- ``timing`` (from ``timing.json``, written by the last ``gacbench bench`` run that executed cells):
  the wall time, cells per minute, the step share (optimizer-step seconds of the cells run /
  (wall time x workers)) and each worker's resident memory after each of its cells.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from gacbench.bench.cell import cell_dir, json_safe, read_json, stored_state, write_json
from gacbench.functional.stats import alignment_summary

REFERENCE_METHODS = ("sync", "stale")
BOOT_RESAMPLES, BOOT_SEED, CI_LEVEL = 9999, 0, 0.95
#: The percentile of the resampled statistics: the smallest value whose empirical CDF reaches the level (no
#: interpolation, so that an unbounded resample gives an unbounded end rather than inf - inf)
QUANTILE_METHOD = "inverted_cdf"
DEGRADE_WINDOW, DEGRADE_MARGIN, DEGRADE_SIGMAS = 10, 0.05, 5.0
#: per-step diagnostics of the update, averaged over a cell's steps after the warm-up where the cell logs them:
#: record key -> (logged name, column title in summary.md)
DIAGNOSTICS = {
    "grad_norm": ("grad/norm", "gradient norm"),
    "ratio_max": ("is/ratio_max", "largest token ratio π_θ/π_behav"),
    "clipfrac": ("pg/clipfrac", "clipped-token share"),
    "clipfrac_dual": ("pg/clipfrac_dual", "dual-clipped-token share"),
}


def read_metrics(path: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.csv (Lightning CSVLogger) -> {name: [(step, value), ...]}."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    if not path.exists():
        return series
    with path.open() as f:
        for row in csv.DictReader(f):
            step = int(float(row.get("step") or -1))
            for key, value in row.items():
                if key != "step" and value not in ("", None):
                    series[key].append((step, float(value)))
    return series


def recover_hint(root: Path, cell: dict) -> str:
    """How to recover an incomplete cell."""
    return (f"the cell is not counted; rerun the gacbench bench command of this grid with --out {root} to "
            f"recompute it, or delete {cell_dir(root, cell)}")


def cell_record(root: Path, cell: dict) -> dict[str, Any] | None:
    """The summary's record of a stored cell (None when it has no status yet): ``status`` is ``done``,
    ``failed``, or ``incomplete`` (a status that claims a finished run whose files are not complete)."""
    status, problem = stored_state(root, cell)
    if status is None and problem is None:
        return None
    rec: dict[str, Any] = {k: cell[k] for k in ("task", "method", "staleness", "seed")}
    rec.update({"status": "incomplete" if problem else status.get("status"), "ablation": bool(cell.get("ablation"))})
    if cell.get("objective") == "grpo":  # the engine section's name, or a flat engine name
        engine = (cell.get("params") or {}).get("engine") or "hf"
        rec["engine"] = engine.get("name", "hf") if isinstance(engine, dict) else engine
    if problem is not None or status.get("status") != "done":
        error = f"{problem}: {recover_hint(root, cell)}" if problem else status.get("error")
        rec.update({"error": error, "metric": None, "higher_is_better": None, "final": None,
                    "diverged": None, "cos_median": None, "cos_abs_q90": None, "cos_abs_le_005": None})
        return rec
    series = read_metrics(cell_dir(root, cell) / "metrics.csv")
    cos = [v for _, v in series.get("align/cos", [])]
    s = alignment_summary(cos, warmup=min(cell.get("warmup", 0), max(len(cos) - 1, 0)))
    rec.update({
        "metric": status["metric"], "higher_is_better": status["higher_is_better"], "initial": status["initial"],
        "final": status["final"], "diverged": status["diverged"], "cos_median": s["median"],
        "cos_abs_q90": s["q90_abs"], "cos_abs_le_005": s["frac_le_tol"], "cos_max_abs": s["max_abs"],
        "seconds": status.get("seconds"), "step_ms": status.get("step_ms"),
        "overhead_share": status.get("overhead_share"),
        "step_s": status.get("step_s"), "eval_s": status.get("eval_s"), "rss_mb": status.get("rss_mb"),
    })
    calibration = _stored_calibration(root, cell)
    if calibration is not None:  # a method calibrated from its reference cell: the thresholds it used
        rec.update({"c_low": calibration.get("c_low"), "c_high": calibration.get("c_high")})
    for key, name in (("assume/L", "assume_L"), ("assume/eta_max", "assume_eta_max")):
        if series.get(key):  # AssumptionMonitor (a suite's ``assumptions``): the estimate at the run's end
            rec[name] = float(series[key][-1][1])
    if series.get("assume/eta_eff"):  # the step taken, as an SGD step size: its median over the run
        rec["assume_eta_eff"] = float(np.median([v for _, v in series["assume/eta_eff"]]))
    warmup = cell.get("warmup", 0)
    for name, (logged, _) in DIAGNOSTICS.items():
        values = [v for step, v in series.get(logged, []) if step >= warmup]
        if values:
            rec[name] = float(np.mean(values))
    if series.get("align/proj_frac"):  # GAC: the share of its steps it shrank, projected or skipped
        rec["gac_changed"] = float(series["align/proj_frac"][-1][1])
    reward = [v for _, v in series.get("reward/mean", [])]
    if reward:  # rollout objectives: the training reward is a second, less noisy, measure than a final eval
        k = max(1, len(reward) // 5)
        rec.update({"reward_first": float(np.mean(reward[:k])), "reward_last": float(np.mean(reward[-k:]))})
        drop, noise = running_max_drop(reward), window_noise(reward)
        rec.update({"reward_drop": drop, "reward_noise": noise,
                    "degraded": None if math.isnan(drop) else bool(drop > degrade_threshold(noise))})
    return rec


def _stored_calibration(root: Path, cell: dict) -> dict | None:
    """The ``calibration`` record of a cell's stored config.json (gac-calibrated), else None."""
    cal = cell.get("calibration")
    if cal is None:
        try:
            cal = read_json(cell_dir(root, cell) / "config.json").get("calibration")
        except (OSError, ValueError, AttributeError):
            return None
    return cal if isinstance(cal, dict) else None


def running_max_drop(values: list[float], window: int = DEGRADE_WINDOW) -> float:
    """max_t r_t - r_T of the ``window``-step moving average r of ``values`` (higher is better): how far the
    smoothed curve ends below its own running maximum (0 for a curve that ends at its best). NaN when
    ``values`` is shorter than ``window``."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    if x.size < window or window < 1:
        return math.nan
    smooth = np.convolve(x, np.ones(window) / window, mode="valid")
    return float(smooth.max() - smooth[-1])


def window_noise(values: list[float], window: int = DEGRADE_WINDOW) -> float:
    """The standard deviation of a ``window``-step mean of ``values`` from their step-to-step noise alone:
    std(r_t - r_{t-1}) / sqrt(2) / sqrt(window) (differences cancel a slow trend). NaN below 3 values."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    if x.size < 3 or window < 1:
        return math.nan
    return float(np.std(np.diff(x), ddof=1) / math.sqrt(2.0) / math.sqrt(window))


def degrade_threshold(noise: float) -> float:
    """The drop below the running maximum that counts as degradation: DEGRADE_MARGIN, or DEGRADE_SIGMAS
    standard deviations of the smoothed curve where its noise is larger (the running maximum of a noisy,
    flat curve sits a few standard deviations above its end)."""
    return DEGRADE_MARGIN if math.isnan(noise) else max(DEGRADE_MARGIN, DEGRADE_SIGMAS * noise)


def _capped(rec: dict) -> float:
    final = rec["final"]
    if rec["diverged"] or final is None or not math.isfinite(final):
        return rec["initial"]
    return final


def _nanmean(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return float(np.mean(xs)) if xs else math.nan


def group_records(cells: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for c in cells:
        if c["status"] == "done":
            groups[(c["task"], c["method"], c["staleness"])].append(c)
    out = []
    for (task, method, s), recs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        finals = [_capped(r) for r in recs]
        out.append({
            "task": task, "method": method, "staleness": s, "metric": recs[0]["metric"],
            "higher_is_better": recs[0]["higher_is_better"], "ablation": recs[0]["ablation"],
            "final_mean": float(np.mean(finals)), "final_std": float(np.std(finals)) if len(finals) > 1 else 0.0,
            "diverged_frac": float(np.mean([bool(r["diverged"]) for r in recs])),
            **({"reward_last_mean": float(np.mean([r["reward_last"] for r in recs])),
                "reward_last_std": float(np.std([r["reward_last"] for r in recs])),
                "reward_first_mean": float(np.mean([r["reward_first"] for r in recs]))}
               if all("reward_last" in r for r in recs) else {}),
            "cos_median": _nanmean([r["cos_median"] for r in recs]),
            "cos_abs_q90": _nanmean([r["cos_abs_q90"] for r in recs]),
            "cos_abs_le_005": _nanmean([r["cos_abs_le_005"] for r in recs]),
            **{f"{k}_mean": float(np.mean([r[k] for r in recs])) for k in (*DIAGNOSTICS, "gac_changed")
               if all(k in r for r in recs)},
            "n": len(recs),
        })
    return out


def _per_seed(cells: list[dict], key: str) -> dict[tuple, dict[int, float]]:
    """{(task, method, staleness): {seed: value}} of the done cells: ``final`` (a diverged run at its starting
    value, as in ``final_mean``) or another per-cell key (``reward_last``). An ablation cell's method names its
    thresholds (``gac(c_low=0.05,c_high=0.3)``), so its key never meets a main grid's."""
    out: dict[tuple, dict[int, float]] = defaultdict(dict)
    for c in cells:
        if c["status"] != "done":
            continue
        value = _capped(c) if key == "final" else c.get(key)
        if value is not None and math.isfinite(value):
            out[(c["task"], c["method"], c["staleness"])][c["seed"]] = float(value)
    return out


def bootstrap_indices(n: int, resamples: int = BOOT_RESAMPLES, seed: int = BOOT_SEED) -> np.ndarray:
    """(resamples, n) seed indices drawn with replacement by ``numpy.random.default_rng(seed)``."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def share_bootstrap_ci(sync: np.ndarray, stale: np.ndarray, method: np.ndarray, level: float = CI_LEVEL,
                       resamples: int = BOOT_RESAMPLES, seed: int = BOOT_SEED) -> tuple[float, float]:
    """Paired percentile bootstrap interval of the share (mean(stale) - mean(method)) / (mean(stale) - mean(sync)):
    the three arrays hold the same seeds in the same order, and one resample of seed indices is applied to all
    three. A resample with a zero gap has share +-inf (the numerator's sign), or none when the numerator is 0 too.
    NaNs with fewer than two seeds."""
    n = len(sync)
    if n < 2:
        return math.nan, math.nan
    idx = bootstrap_indices(n, resamples, seed)
    num = stale[idx].mean(1) - method[idx].mean(1)
    gap = stale[idx].mean(1) - sync[idx].mean(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(gap != 0, num / np.where(gap != 0, gap, 1.0), np.sign(num) * np.inf)
    share = share[~((gap == 0) & (num == 0))]
    if share.size == 0:
        return math.nan, math.nan
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(share, [alpha, 1.0 - alpha], method=QUANTILE_METHOD)
    return float(low), float(high)


def mean_bootstrap_ci(x: np.ndarray, level: float = CI_LEVEL, resamples: int = BOOT_RESAMPLES,
                      seed: int = BOOT_SEED) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(x) over its seeds (NaNs with fewer than two)."""
    if len(x) < 2:
        return math.nan, math.nan
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(x[bootstrap_indices(len(x), resamples, seed)].mean(1), [alpha, 1.0 - alpha],
                            method=QUANTILE_METHOD)
    return float(low), float(high)


def figure_legend_entries(fig) -> tuple[list, list[str]]:
    """The labelled artists of every panel of ``fig``, one per label in first-seen order: the legend drawn on one
    panel then names the methods that appear only in others (a method run at s = 16 alone)."""
    entries: dict[str, object] = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    return list(entries.values()), list(entries)


def paired_difference(a: np.ndarray, b: np.ndarray, level: float = CI_LEVEL) -> dict[str, float]:
    """mean(a - b) over paired seeds, its t-interval (mean +- t_{(1+level)/2, n-1} sd/sqrt(n)) and the two-sided
    paired t-test's p-value (scipy.stats.ttest_rel; NaN when every difference is equal). NaNs below two seeds."""
    import warnings

    from scipy import stats

    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    n = len(d)
    if n == 0:
        return {"diff": math.nan, "ci_low": math.nan, "ci_high": math.nan, "p": math.nan}
    mean = float(d.mean())
    if n < 2:
        return {"diff": mean, "ci_low": math.nan, "ci_high": math.nan, "p": math.nan}
    half = float(stats.t.ppf(0.5 + level / 2.0, n - 1) * d.std(ddof=1) / math.sqrt(n))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = float(stats.ttest_rel(a, b).pvalue) if d.std() > 0 else math.nan
    return {"diff": mean, "ci_low": mean - half, "ci_high": mean + half, "p": p}


def _with_ci(row: dict, seeds: dict[tuple, dict[int, float]], key: str, higher: bool) -> dict:
    """``row`` (a recovered-share row) with ``n`` (the distinct seeds sync, stale and the method share),
    ``share_ci_low/high`` and the paired comparison to stale (``vs_stale_*``, over the seeds stale and the method
    share: ``vs_stale_n``)."""
    task, m, s = row["task"], row["method"], row["staleness"]
    sync, stale, meth = seeds.get((task, "sync", 0), {}), seeds.get((task, "stale", s), {}), seeds.get((task, m, s), {})
    common = sorted(set(sync) & set(stale) & set(meth))
    paired = sorted(set(stale) & set(meth))
    row.update({"n": len(common), "share_ci_low": None, "share_ci_high": None, "vs_stale_diff": None,
                "vs_stale_ci_low": None, "vs_stale_ci_high": None, "vs_stale_p": None, "vs_stale_n": len(paired)})
    if paired:
        a, b = np.array([meth[k] for k in paired]), np.array([stale[k] for k in paired])
        d = paired_difference(a, b) if higher else paired_difference(b, a)  # > 0: the method is better
        row.update({"vs_stale_diff": d["diff"], "vs_stale_ci_low": d["ci_low"], "vs_stale_ci_high": d["ci_high"],
                    "vs_stale_p": d["p"]})
    if not row.get("missing") and not row["no_gap"]:
        low, high = share_bootstrap_ci(*(np.array([g[k] for k in common]) for g in (sync, stale, meth)))
        row.update({"share_ci_low": low, "share_ci_high": high})
    return row


def recovered_shares(groups: list[dict], key: str = "final", cells: list[dict] | None = None,
                     ablation: bool = False) -> list[dict]:
    """Per stabilizer and staleness, on ``{key}_mean`` (``final``: the metric; ``reward_last``: the
    training reward over the last 20% of steps, for rollout objectives). With ``cells`` (the cell records)
    each row also gets its confidence intervals (module docstring); a method whose sync or stale group has no
    cells gets a row with ``missing`` naming them and null share. ``ablation=True``: the rows of the threshold
    ablation's groups instead, against the same sync and stale groups."""
    mean, std = f"{key}_mean", f"{key}_std"
    groups = [g for g in groups if mean in g]
    by = {(g["task"], g["method"], g["staleness"]): g for g in groups}
    seeds = _per_seed(cells, key) if cells is not None else None
    rows = []
    for g in groups:
        if g["method"] in REFERENCE_METHODS or bool(g["ablation"]) != ablation or g["staleness"] == 0:
            continue
        sync, stale = by.get((g["task"], "sync", 0)), by.get((g["task"], "stale", g["staleness"]))
        higher = key == "reward_last" or bool(g["higher_is_better"])
        if not sync or not stale:
            if cells is not None:
                rows.append(_with_ci({
                    "task": g["task"], "method": g["method"], "staleness": g["staleness"], "share": math.nan,
                    "sync": sync[mean] if sync else math.nan, "stale": stale[mean] if stale else math.nan,
                    "value": g[mean], "no_gap": True, "gap": math.nan, "gap_se": math.nan, "gap_within_noise": None,
                    "missing": [name for name, x in (("sync", sync), ("stale", stale)) if not x]}, seeds, key, higher))
            continue
        gap = stale[mean] - sync[mean]
        sign = -1.0 if (key == "reward_last" or g["higher_is_better"]) else 1.0  # gap > 0 means stale is worse
        share = (stale[mean] - g[mean]) / gap if abs(gap) > 1e-12 and sign * gap > 0 else math.nan
        # standard error of the gap from the sample (ddof=1) std of each group; unknown with a single seed
        if min(sync["n"], stale["n"]) < 2:
            se = math.nan
        else:
            se = math.sqrt(sum((x[std] or 0.0) ** 2 / (x["n"] - 1) for x in (sync, stale)))
        row = {"task": g["task"], "method": g["method"], "staleness": g["staleness"], "share": share,
               "sync": sync[mean], "stale": stale[mean], "value": g[mean],
               "no_gap": not (abs(gap) > 1e-12 and sign * gap > 0), "gap": gap, "gap_se": se,
               "gap_within_noise": None if math.isnan(se) else bool(abs(gap) < 2.0 * se)}
        rows.append(_with_ci(row, seeds, key, higher) if cells is not None else row)
    return rows


def _diagnostics_table(groups: list[dict]) -> list[str]:
    """Per group, the update diagnostics its cells logged (``DIAGNOSTICS``, means over seeds of each cell's mean
    after the warm-up) and GAC's share of changed steps; nothing when no group logged any."""
    keys = [k for k in (*DIAGNOSTICS, "gac_changed") if any(f"{k}_mean" in g for g in groups)]
    rows = [g for g in groups if any(f"{k}_mean" in g for k in keys)]
    if not rows:
        return []
    titles = [DIAGNOSTICS[k][1] if k in DIAGNOSTICS else "GAC: steps changed" for k in keys]
    lines = ["", "## Update diagnostics, after the warm-up", "",
             "Each cell's mean over its steps after the warm-up, then the mean over seeds; GAC: the share of its "
             "steps it shrank, projected or skipped. — where the method does not log the value.", "",
             "| task | method | s | " + " | ".join(titles) + " | seeds |", "|---|---|---|" + "---|" * (len(keys) + 1)]
    for g in rows:
        vals = [_fmt(g.get(f"{k}_mean"), 3) for k in keys]
        lines.append(f"| {g['task']} | {g['method']} | {g['staleness']} | " + " | ".join(vals) + f" | {g['n']} |")
    return lines


def _ablation_key(abl: list[dict]) -> str:
    """The measure the threshold ablation is read on: the training reward where every ablation group has one
    (rollout objectives), else the final metric."""
    return "reward_last" if all("reward_last_mean" in g for g in abl) else "final"


def _ablation_rows(groups: list[dict], cells: list[dict], given: list[dict] | None) -> list[dict]:
    """The threshold ablation's recovered shares on its measure: ``given`` (build_report computes them once for
    summary.json), else computed here."""
    if given is not None:
        return given
    return recovered_shares(groups, _ablation_key([g for g in groups if g["ablation"]]), cells=cells, ablation=True)


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.{digits}g}"


def _method_table(title: str, groups: list[dict], cell, heading: str = "##") -> list[str]:
    """A markdown table, one row per method and one column per staleness, each entry ``cell(group)`` (``groups``:
    any rows with ``method`` and ``staleness``)."""
    svals = sorted({g["staleness"] for g in groups})
    lines = [f"{heading} {title}", "", "| method | " + " | ".join(f"s={s}" for s in svals) + " |",
             "|---|" + "---|" * len(svals)]
    for m in dict.fromkeys(g["method"] for g in groups):
        row = []
        for s in svals:
            g = next((x for x in groups if x["method"] == m and x["staleness"] == s), None)
            row.append("" if g is None else cell(g))
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    return lines + [""]


def _share_table(title: str, shares: list[dict]) -> list[str]:
    lines = [f"## {title}", "",
             "1 = the synchronous result, 0 = no better than stale, < 0 = worse than stale.", "",
             "| task | s | method | sync | stale | method | share |", "|---|---|---|---|---|---|---|"]
    for r in shares:
        if r.get("missing"):
            continue
        share = "n/a (stale no worse than sync)" if r["no_gap"] else f"{r['share']:.2f}"
        if not r["no_gap"] and r["gap_within_noise"]:
            share += " (gap < 2 s.e. of seeds: not meaningful)"
        elif not r["no_gap"] and r["gap_within_noise"] is None:
            share += " (one seed: noise unknown)"
        lines.append(f"| {r['task']} | {r['staleness']} | {r['method']} | {_fmt(r['sync'], 4)} | "
                     f"{_fmt(r['stale'], 4)} | "
                     f"{_fmt(r['value'], 4)} | {share} |")
    return lines + [""]


def markdown(cells: list[dict], groups: list[dict], shares: list[dict], root: Path,
             reward_shares: list[dict] | None = None, timing: dict | None = None,
             regime: list[dict] | None = None, ablation_rows: list[dict] | None = None) -> str:
    """summary.md. ``ablation_rows``: the threshold ablation's recovered shares on its measure
    (:func:`_ablation_key`), if already computed."""
    lines = [f"# Benchmark summary: `{root}`", "",
             "Regenerate with `gacbench report " + str(root) + "`. Definitions: see `gacbench/bench/report.py`.", ""]
    tasks = sorted({g["task"] for g in groups})
    main = [g for g in groups if not g["ablation"]]
    for task in tasks:
        tg = [g for g in main if g["task"] == task]
        if not tg:
            continue
        metric, hib = tg[0]["metric"], tg[0]["higher_is_better"]
        lines += _method_table(f"{task}: final {metric} ({'higher' if hib else 'lower'} is better), mean ± std "
                               "over seeds "
                               "[diverged share]", tg,
                               lambda g: f"{_fmt(g['final_mean'], 4)} ± {_fmt(g['final_std'], 2)}"
                                         + (f" [{g['diverged_frac']:.0%}]" if g["diverged_frac"] else ""))
    if shares:
        lines += _share_table("Recovered share of the stale–sync gap: (stale − method) / (stale − sync)", shares)
    rewarded = [g for g in main if "reward_last_mean" in g]
    for task in sorted({g["task"] for g in rewarded}):
        lines += _method_table(f"{task}: training reward, mean over the last 20% of steps (first 20% in brackets), "
                               "mean ± std "
                               "over seeds", [g for g in rewarded if g["task"] == task],
                               lambda g: f"{_fmt(g['reward_last_mean'], 3)} ± {_fmt(g['reward_last_std'], 2)} "
                                         f"({_fmt(g['reward_first_mean'], 3)})")
    if reward_shares:
        lines += _share_table("Recovered share of the stale–sync gap in training reward (last 20% of steps)",
                              reward_shares)
    lines += ["## Alignment statistics (paper Table 3), after the warm-up", "",
              "| task | method | s | median c_t | q0.9(|c_t|) | Pr(|c_t| ≤ 0.05) | seeds |",
              "|---|---|---|---|---|---|---|"]
    for g in main:
        lines.append(f"| {g['task']} | {g['method']} | {g['staleness']} | {_fmt(g['cos_median'])} | "
                     f"{_fmt(g['cos_abs_q90'])} | "
                     f"{_fmt(g['cos_abs_le_005'], 2)} | {g['n']} |")
    lines += _diagnostics_table(main)
    abl = [g for g in groups if g["ablation"]]
    if abl:
        key = _ablation_key(abl)
        rows = {(r["task"], r["method"]): r for r in _ablation_rows(groups, cells, ablation_rows)}
        what = "training reward" if key == "reward_last" else "final metric"
        lines += ["", "## Threshold ablation (c_low, c_high)", "",
                  f"Recovered share of the stale–sync gap in the {what} (95% paired bootstrap interval) and the "
                  "paired difference to stale at the same s (t-interval, paired t-test p), as in the tables above.",
                  "", "| task | method | s | final (mean) | training reward (last 20%) | share [95% CI] | "
                  "method − stale [95% CI] | p | diverged | seeds |", "|---|---|---|---|---|---|---|---|---|---|"]
        for g in abl:
            r = rows.get((g["task"], g["method"]), {})
            reward = (f"{_fmt(g['reward_last_mean'], 3)} ± {_fmt(g['reward_last_std'], 2)}"
                      if "reward_last_mean" in g else "—")
            share = "—" if r.get("share") is None or math.isnan(r["share"]) else (
                f"{r['share']:.2f} {_ci(r.get('share_ci_low'), r.get('share_ci_high'))}")
            diff = "—" if r.get("vs_stale_diff") is None else (
                f"{r['vs_stale_diff']:+.3g} {_ci(r['vs_stale_ci_low'], r['vs_stale_ci_high'], 3)}")
            lines.append(f"| {g['task']} | `{g['method']}` | {g['staleness']} | {_fmt(g['final_mean'], 4)} | "
                         f"{reward} | {share} | {diff} | {_fmt(r.get('vs_stale_p'), 2)} | {g['diverged_frac']:.0%} | "
                         f"{g['n']} |")
    sections = (("Failed cells", "failed"), ("Incomplete cells (stored files damaged; not counted)", "incomplete"))
    for title, kind in sections:
        listed = [c for c in cells if c["status"] != "done" and (c["status"] == "incomplete") == (kind == "incomplete")]
        if listed:
            lines += ["", f"## {title}", ""] + [f"- {c['task']} / {c['method']} / s={c['staleness']} / "
                                                f"seed {c['seed']}: {c.get('error')}" for c in listed]
    done = [c for c in cells if c["status"] == "done" and c.get("step_ms")]
    if done:
        lines += ["", "## Timing", "",
                  f"Median step {statistics.median(c['step_ms'] for c in done):.2f} ms; median share of step time "
                  "outside the "
                  f"objective's forward+backward {statistics.median(c['overhead_share'] for c in done):.0%} "
                  f"({len(done)} cells, {sum(c['seconds'] for c in done):.0f} s of cell time)."
                  + _step_share_note(timing)]
    lines += _ci_section(shares, reward_shares or [])
    lines += _table1(groups, cells)
    lines += _table3(cells)
    lines += _regime_section(regime or [])
    return "\n".join(lines) + "\n"


def _ci(low: float | None, high: float | None, digits: int = 2) -> str:
    if low is None or high is None or (isinstance(low, float) and math.isnan(low)):
        return "—"
    return f"[{_fmt(low + 0.0, digits)}, {_fmt(high + 0.0, digits)}]"  # + 0.0: no "-0"


def _share_cell(r: dict) -> str:
    """One entry of the table of shares across s: the share, its interval and ``*`` where the paired t-test
    against stale has p < 0.05; empty for a missing group or no gap."""
    if r.get("missing") or r["no_gap"]:
        return ""
    star = " *" if r["vs_stale_p"] is not None and r["vs_stale_p"] < 0.05 else ""
    return f"{round(r['share'], 2) + 0.0:.2f} {_ci(r['share_ci_low'], r['share_ci_high'])}{star}"


def _ci_section(shares: list[dict], reward_shares: list[dict]) -> list[str]:
    """The appended confidence-interval tables (module docstring: paired bootstrap of the share, paired t on
    the difference to stale)."""
    if not any("n" in r for r in shares + reward_shares):
        return []
    lines = ["", f"## Confidence intervals ({CI_LEVEL:.0%}) over seeds", "",
             "Share: paired percentile bootstrap over the seeds that sync, stale and the method share "
             f"({BOOT_RESAMPLES} resamples, seed {BOOT_SEED}). Method − stale: mean paired difference, > 0 = the "
             "method is better, with its t-interval and the two-sided paired t-test's p-value. — = fewer than two "
             "seeds (or no gap to recover). In the tables across s, * marks p < 0.05 and an empty entry a "
             "missing group or no gap."]
    for title, rows in (("final metric", shares), ("training reward (last 20% of steps)", reward_shares)):
        rows = [r for r in rows if "n" in r]
        if not rows:
            continue
        for task in dict.fromkeys(r["task"] for r in rows):  # robustness across s (the paper's Figure 4)
            lines += [""] + _method_table(f"{task}: recovered share across s, {title}",
                                          [r for r in rows if r["task"] == task], _share_cell, heading="###")[:-1]
        lines += ["", f"### {title}", "",
                  "| task | s | method | share | share 95% CI | method − stale | 95% CI | p | seeds |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r.get("missing"):
                share = f"n/a (no {' or '.join(r['missing'])} cells)"
            elif r["no_gap"]:
                share = "n/a (stale no worse than sync)"
            else:
                share = f"{r['share']:.2f}"
            lines.append(f"| {r['task']} | {r['staleness']} | {r['method']} | {share} | "
                         f"{_ci(r['share_ci_low'], r['share_ci_high'])} | {_fmt(r['vs_stale_diff'], 3)} | "
                         f"{_ci(r['vs_stale_ci_low'], r['vs_stale_ci_high'], 3)} | {_fmt(r['vs_stale_p'], 2)} | "
                         f"{r['n']} |")
    return lines


def _is_gac(method: str) -> bool:
    return method.split("(")[0].split("+")[0].startswith("gac")


def table1_staleness(groups: list[dict]) -> int | None:
    """The staleness of paper Table 1: 16 when the grid has it (the paper's), else the largest s > 0."""
    svals = sorted({g["staleness"] for g in groups if g["staleness"] > 0 and not g["ablation"]})
    return None if not svals else (16 if 16 in svals else svals[-1])


def _table1(groups: list[dict], cells: list[dict]) -> list[str]:
    """Paper Table 1: per task the final metric (and training reward) of sync and every method at one
    staleness, with 95% bootstrap intervals over seeds, and each GAC method's margin over the strongest
    non-GAC stale method."""
    s_star = table1_staleness(groups)
    if s_star is None:
        return []
    finals, rewards = _per_seed(cells, "final"), _per_seed(cells, "reward_last")
    lines = ["", f"## Table 1: final metric under staleness s = {s_star} (synchronous reference at s = 0)", "",
             f"Mean over seeds [{CI_LEVEL:.0%} percentile bootstrap over seeds]. Δ: a GAC method's mean minus the "
             "strongest non-GAC stale method's (stale and the loss-side baselines), > 0 = GAC better (on the final "
             "metric, sign-adjusted for lower-is-better metrics)."]
    for task in sorted({g["task"] for g in groups}):
        rows = [g for g in groups if g["task"] == task and not g["ablation"]
                and ((g["method"] == "sync" and g["staleness"] == 0) or g["staleness"] == s_star)]
        if not any(g["staleness"] == s_star for g in rows):
            continue
        hib = rows[0]["higher_is_better"]
        sign = 1.0 if hib else -1.0
        baselines = [g for g in rows if g["staleness"] == s_star and not _is_gac(g["method"])]
        best = max(baselines, key=lambda g: sign * g["final_mean"]) if baselines else None
        rewarded = all("reward_last_mean" in g for g in rows)
        lines += ["", f"### {task}: final {rows[0]['metric']} ({'higher' if hib else 'lower'} is better)", "",
                  "| method | s | final | 95% CI | " + ("training reward | 95% CI | " if rewarded else "")
                  + "Δ | seeds |",
                  "|---|---|---|---|" + ("---|---|" if rewarded else "") + "---|---|"]
        order = lambda g: (g["staleness"] != 0, g["method"] != "stale", _is_gac(g["method"]), g["method"])  # noqa: E731
        for g in sorted(rows, key=order):
            key = (task, g["method"], g["staleness"])
            f = np.array(list(finals.get(key, {}).values()))
            cells_row = (f"| {g['method']} | {g['staleness']} | {_fmt(g['final_mean'], 4)} | "
                         f"{_ci(*mean_bootstrap_ci(f), 4)} | ")
            if rewarded:
                r = np.array(list(rewards.get(key, {}).values()))
                cells_row += f"{_fmt(g['reward_last_mean'], 4)} | {_ci(*mean_bootstrap_ci(r), 4)} | "
            delta = "–"
            if best is not None and _is_gac(g["method"]) and g["staleness"] == s_star:
                delta = f"{sign * (g['final_mean'] - best['final_mean']):+.3g} (vs {best['method']})"
            lines.append(cells_row + f"{delta} | {g['n']} |")
    return lines


def _table3(cells: list[dict]) -> list[str]:
    """Paper Table 3 (on-policy alignment statistics of the synchronous cells) and the thresholds the
    calibration rule reads from them (gacbench.functional.calibration), beside those gac-calibrated used."""
    from gacbench.functional.calibration import calibration_record

    sync = [c for c in cells if c["status"] == "done" and c["method"] == "sync" and c["staleness"] == 0
            and c.get("cos_abs_q90") is not None and math.isfinite(c["cos_abs_q90"])]
    if not sync:
        return []
    lines = ["", "## Table 3: on-policy (s = 0) alignment statistics and the calibrated thresholds", "",
             "Means over the synchronous cells' seeds, after the warm-up. Calibrated: c_low = q0.9(|c_t|), c_high = "
             "max(c_low + 0.25, max |c_t|) (gacbench/functional/calibration.py), per seed, mean [min, max]; used: the "
             "thresholds the gac-calibrated cells ran with.", "",
             "| task | q0.9(|c_t|) | max |c_t| | Pr(|c_t| ≤ 0.05) | median c_t | calibrated c_low | "
             "calibrated c_high | "
             "used by gac-calibrated (c_low, c_high) | seeds |", "|---|---|---|---|---|---|---|---|---|"]
    for task in sorted({c["task"] for c in sync}):
        tc = [c for c in sync if c["task"] == task]
        recs = [calibration_record({"q90_abs": c["cos_abs_q90"], "max_abs": c["cos_max_abs"]}) for c in tc]
        lows, highs = [r["c_low"] for r in recs], [r["c_high"] for r in recs]
        used = [c for c in cells if c["task"] == task and c.get("c_low") is not None and c["status"] == "done"]
        used_s = (f"({_fmt(float(np.mean([c['c_low'] for c in used])))}, "
                  f"{_fmt(float(np.mean([c['c_high'] for c in used])))}) over {len(used)} cells" if used else "—")
        lines.append(f"| {task} | {_fmt(_nanmean([c['cos_abs_q90'] for c in tc]))} | "
                     f"{_fmt(_nanmean([c['cos_max_abs'] for c in tc]))} | "
                     f"{_fmt(_nanmean([c['cos_abs_le_005'] for c in tc]), 2)} | "
                     f"{_fmt(_nanmean([c['cos_median'] for c in tc]))} | {_fmt(float(np.mean(lows)))} "
                     f"[{_fmt(min(lows))}, {_fmt(max(lows))}] | {_fmt(float(np.mean(highs)))} [{_fmt(min(highs))}, "
                     f"{_fmt(max(highs))}] | {used_s} | {len(tc)} |")
    return lines


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
    metric where no reward is logged), paired over seeds, with its 95% bootstrap interval; median c_t and
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
        seeds = _per_seed(tc, key)
        sync = [c for c in tc if c["method"] == "sync" and c["staleness"] == 0]
        higher = key == "reward_last" or bool(tc[0]["higher_is_better"])
        if key == "reward_last":
            rises = [c["reward_last"] - c["reward_first"] for c in sync]
        else:
            rises = [(1.0 if higher else -1.0) * (_capped(c) - c["initial"]) for c in sync]
        healthy = (bool(sync) and not any(c["diverged"] for c in sync) and not any(c.get("degraded") for c in sync)
                   and float(np.mean(rises)) > 0)
        sync_seeds = seeds.get((task, "sync", 0), {})
        for s in sorted({c["staleness"] for c in tc if c["method"] == "stale"}):
            stale = [c for c in tc if c["method"] == "stale" and c["staleness"] == s]
            stale_seeds = seeds.get((task, "stale", s), {})
            common = sorted(set(sync_seeds) & set(stale_seeds))
            d = np.array([stale_seeds[k] - sync_seeds[k] for k in common])
            low, high = mean_bootstrap_ci(d)
            drops = [c.get("reward_drop") for c in stale if c.get("reward_drop") is not None]
            points.append({
                "task": task, "model": _model_label(*params[task]), "lr": float(params[task][1]["lr"]),
                "staleness": s, "measure": key, "sync": _nanmean(list(sync_seeds.values())),
                "stale": _nanmean(list(stale_seeds.values())), "gap": float(d.mean()) if d.size else math.nan,
                "gap_ci_low": low, "gap_ci_high": high, "n": len(common),
                "sync_cos_median": _nanmean([c["cos_median"] for c in sync]),
                "stale_cos_median": _nanmean([c["cos_median"] for c in stale]),
                "sync_cos_abs_q90": _nanmean([c["cos_abs_q90"] for c in sync]),
                "stale_cos_abs_q90": _nanmean([c["cos_abs_q90"] for c in stale]),
                "stale_degraded_frac": float(np.mean([bool(c.get("degraded")) for c in stale])) if stale else math.nan,
                "stale_reward_drop": _nanmean(drops),
                "sync_degraded_frac": float(np.mean([bool(c.get("degraded")) for c in sync])) if sync else math.nan,
                "sync_rise": _nanmean(rises), "sync_healthy": healthy,
            })
            etas = [c["assume_eta_max"] for c in stale if c.get("assume_eta_max") is not None]
            if etas:  # the step-size condition of the bounded-staleness bound at the stale run's own L and lag
                lr = points[-1]["lr"]
                points[-1].update({
                    "sync_L": _nanmean([c["assume_L"] for c in sync if c.get("assume_L") is not None]),
                    "stale_L": _nanmean([c["assume_L"] for c in stale if c.get("assume_L") is not None]),
                    "stale_eta_max": float(np.median(etas)),
                    "lr_within_eta_max": bool(lr <= float(np.median(etas))),
                    "stale_eta_eff": _nanmean([c.get("assume_eta_eff", math.nan) for c in stale]),
                    "stale_worse": bool(points[-1]["gap_ci_high"] < 0) if points[-1]["n"] >= 2 else None,
                })
                eff = points[-1]["stale_eta_eff"]
                points[-1]["eff_within_eta_max"] = None if math.isnan(eff) else bool(eff <= points[-1]["stale_eta_max"])
    points.sort(key=lambda p: (p["model"], p["lr"], p["staleness"]))
    return points


def _regime_section(points: list[dict]) -> list[str]:
    if not points:
        return []
    lines = ["", "## Regime map: stale − sync per (model, learning rate, staleness)", "",
             f"Gap: stale − sync on the training reward of the last 20% of steps (the final metric where no reward is "
             f"logged), paired over seeds, mean [{CI_LEVEL:.0%} bootstrap]; < 0 = stale worse. c_t: median and "
             f"q0.9(|c_t|) after the warm-up, means over seeds. Degraded: share of stale seeds whose reward "
             f"(smoothed over {DEGRADE_WINDOW} steps) ends below its own running maximum by more than {DEGRADE_MARGIN} "
             f"and more than {DEGRADE_SIGMAS:g} standard deviations of a {DEGRADE_WINDOW}-step mean (from its "
             "step-to-step noise) (mean drop in brackets). Sync healthy: no sync seed diverged or degraded and its "
             "reward rose.", "",
             "| model | lr | s | sync | stale | gap | 95% CI | median c_t sync → stale | q0.9 |c_t| sync → stale | "
             "stale degraded | sync healthy | seeds |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['model']} | {p['lr']:.3g} | {p['staleness']} | {_fmt(p['sync'], 3)} | "
                     f"{_fmt(p['stale'], 3)} | "
                     f"{_fmt(p['gap'], 2)} | {_ci(p['gap_ci_low'], p['gap_ci_high'], 2)} | "
                     f"{_fmt(p['sync_cos_median'], 2)} → {_fmt(p['stale_cos_median'], 2)} | "
                     f"{_fmt(p['sync_cos_abs_q90'], 2)} → {_fmt(p['stale_cos_abs_q90'], 2)} | "
                     f"{_fmt(p['stale_degraded_frac'], 2)} ({_fmt(p['stale_reward_drop'], 2)}) | "
                     f"{'yes' if p['sync_healthy'] else 'no'} | {p['n']} |")
    checked = [p for p in points if "stale_eta_max" in p]
    if checked:
        lines += ["", "### The step-size condition on this workload", "",
                  "AssumptionMonitor's estimates at the end of each run: the secant smoothness L̂ (running maximum), "
                  "and eta_max(s), the largest step with L̂ eta + L̂² eta² s² <= 1 at the stale run's realised lag "
                  "(theory/README.md), an SGD step size. eta_eff: the step actually taken as an SGD step size, "
                  "||theta_t - theta_{t-1}|| / ||g||, median over the run (it is lr for SGD; for Adam it is the "
                  "number comparable with eta_max). The bound predicts a stale failure where the step exceeds "
                  "eta_max(s); observed: the gap's interval lies below 0.", "",
                  "| model | lr | s | L̂ sync | L̂ stale | eta_max(s) | eta_eff | lr <= eta_max | eta_eff <= eta_max | "
                  "stale worse (CI < 0) |", "|---|---|---|---|---|---|---|---|---|---|"]
        yes = {True: "yes", False: "no", None: "n/a"}
        for p in checked:
            lines.append(f"| {p['model']} | {p['lr']:.3g} | {p['staleness']} | {_fmt(p['sync_L'], 3)} | "
                         f"{_fmt(p['stale_L'], 3)} | {p['stale_eta_max']:.3g} | {_fmt(p['stale_eta_eff'], 3)} | "
                         f"{yes[p['lr_within_eta_max']]} | {yes[p['eff_within_eta_max']]} | {yes[p['stale_worse']]} |")
        for key, name in (("lr_within_eta_max", "lr"), ("eff_within_eta_max", "eta_eff")):
            judged = [p for p in checked if p["stale_worse"] is not None and p[key] is not None]
            agree = sum((not p[key]) == p["stale_worse"] for p in judged)
            lines.append(f"{'' if key == 'eff_within_eta_max' else chr(10)}Predicting a stale failure where {name} > "
                         f"eta_max(s) matches the observation at {agree} of {len(judged)} points.")
    return lines


def _step_share_note(timing: dict | None) -> str:
    if not timing or timing.get("step_share") is None:
        return ""
    return (f" Last run: step share {timing['step_share']:.0%} ({timing['ran']} cells, {timing['workers']} worker(s), "
            f"{timing['wall_s']:.0f} s wall).")


def read_timing(root: Path) -> dict | None:
    """``timing.json`` of a bench directory, or None (not written yet, or unreadable)."""
    path = root / "timing.json"
    try:
        return read_json(path) if path.exists() else None
    except ValueError:
        return None


def _smooth_mean(curves: list[list[tuple[int, float]]], window: int = 10) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Steps, mean and std over curves (cut to the shortest) of their ``window``-step moving averages."""
    curves = [c for c in curves if c]
    if not curves:
        return [], np.array([]), np.array([])
    n = min(len(c) for c in curves)
    w = max(1, min(window, n))
    arr = np.array([np.convolve([v for _, v in c[:n]], np.ones(w) / w, mode="valid") for c in curves])
    return [x for x, _ in curves[0][: arr.shape[1]]], arr.mean(0), arr.std(0)


def figures(root: Path, cells: list[dict], cell_specs: list[dict], groups: list[dict],
            regime: list[dict] | None = None, ablation_rows: list[dict] | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: list[Path] = []

    def save(fig, name: str, legend_ax=None) -> None:
        if legend_ax is not None:
            handles, labels = figure_legend_entries(fig)
            legend_ax.legend(handles, labels, fontsize=7)
        fig.tight_layout()
        fig.savefig(root / name, dpi=110)
        plt.close(fig)
        out.append(root / name)

    specs = {(c["task"], c["method"], c["staleness"], c["seed"]): c for c in cell_specs}
    main = [c for c in cells if c["status"] == "done" and not c["ablation"]]
    tasks = sorted({c["task"] for c in main})
    colors = {"sync": "black", "stale": "tab:red"}
    # tab20 without its reds (stale's colour): distinct colours for up to 18 other methods
    palette = iter([c for i, c in enumerate(plt.cm.tab20.colors) if i not in (6, 7)])
    for m in sorted({c["method"] for c in main}):
        colors.setdefault(m, next(palette, "tab:gray"))

    cache: dict[tuple, dict] = {}

    def series(rec: dict, key: str) -> list[tuple[int, float]]:
        ident = (rec["task"], rec["method"], rec["staleness"], rec["seed"])
        if ident not in cache:
            cache[ident] = read_metrics(cell_dir(root, specs[ident]) / "metrics.csv")
        return cache[ident].get(key, [])

    # Figures 1 and 4: metric curves across staleness, mean over seeds.
    for task in tasks:
        tc = [c for c in main if c["task"] == task]
        metric = tc[0]["metric"]
        svals = sorted({c["staleness"] for c in tc if c["staleness"] > 0})
        fig, axes = plt.subplots(1, max(1, len(svals)), figsize=(4 * max(1, len(svals)), 3.2), squeeze=False,
                                 sharey=True)
        for ax, s in zip(axes[0], svals or [0]):
            for m in dict.fromkeys(c["method"] for c in tc):
                recs = [c for c in tc if c["method"] == m and (c["staleness"] == s or m == "sync")]
                curves = [series(r, f"eval/{metric}") for r in recs]
                curves = [c for c in curves if c]
                if not curves:
                    continue
                n = min(len(c) for c in curves)
                steps = [curves[0][i][0] for i in range(n)]
                mean = np.mean([[c[i][1] for i in range(n)] for c in curves], axis=0)
                ax.plot(steps, mean, label=m, color=colors[m], ls="--" if m == "sync" else "-")
            ax.set_title(f"{task}, s={s}")
            ax.set_xlabel("step")
            if not tc[0]["higher_is_better"]:
                ax.set_yscale("log")
        axes[0][0].set_ylabel(metric)
        save(fig, f"fig_curves_{task}.png", axes[0][-1])

    # Figures 3 and 6: c_t over training, sync vs stale vs stabilizers, at the largest staleness, seed = smallest.
    fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(4 * max(1, len(tasks)), 3.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        tc = [c for c in main if c["task"] == task]
        smax, seed = max(c["staleness"] for c in tc), min(c["seed"] for c in tc)
        for r in [c for c in tc if c["seed"] == seed and (c["staleness"] == smax or c["method"] == "sync")]:
            cs = series(r, "align/cos")
            if cs:
                w = min(10, len(cs))  # a run shorter than the window is averaged over its length
                v = np.convolve([x for _, x in cs], np.ones(w) / w, mode="valid")
                ax.plot([x for x, _ in cs][: len(v)], v, label=f"{r['method']} (s={r['staleness']})",
                        color=colors[r["method"]], lw=1)
        ax.set_title(f"{task}: c_t (10-step mean)")
        ax.set_xlabel("step")
        ax.set_ylim(-1.05, 1.05)
        ax.axhline(0, color="gray", lw=0.5)
    save(fig, "fig_cos.png", axes[0][-1])

    # Robustness across staleness: final metric vs s per method.
    maing = [g for g in groups if not g["ablation"]]
    fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(4 * max(1, len(tasks)), 3.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        tg = [g for g in maing if g["task"] == task]
        sync = next((g for g in tg if g["method"] == "sync"), None)
        if sync:
            ax.axhline(sync["final_mean"], color="black", ls="--", label="sync")
        for m in dict.fromkeys(g["method"] for g in tg if g["method"] != "sync"):
            pts = sorted((g["staleness"], g["final_mean"], g["final_std"]) for g in tg if g["method"] == m)
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", label=m,
                        color=colors[m], capsize=2)
        ax.set_title(task)
        ax.set_xlabel("staleness s")
        ax.set_ylabel(tg[0]["metric"] if tg else "")
        if tg and not tg[0]["higher_is_better"]:
            ax.set_yscale("log")
    save(fig, "fig_robustness.png", axes[0][-1])

    # Figure 1 (paper): training reward (the metric where no reward is logged) and c_t across staleness, sync and
    # stale, mean over seeds of 10-step moving averages.
    for task in tasks:
        tc = [c for c in main if c["task"] == task and c["method"] in REFERENCE_METHODS]
        svals = sorted({c["staleness"] for c in tc})
        if len(svals) < 2:
            continue
        has_reward = any(series(c, "reward/mean") for c in tc)
        metric = tc[0]["metric"]
        ykey, ylabel = ("reward/mean", "training reward") if has_reward else (f"eval/{metric}", metric)
        cmap = plt.cm.viridis(np.linspace(0.0, 0.85, max(1, len(svals) - 1)))
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.3))
        for i, sv in enumerate(svals):
            recs = [c for c in tc if c["staleness"] == sv]
            color = "black" if sv == 0 else cmap[min(i - 1, len(cmap) - 1)]
            for ax, key in zip(axes, (ykey, "align/cos")):
                steps, mean, _ = _smooth_mean([series(r, key) for r in recs], 10 if key != ykey or has_reward else 1)
                if steps:
                    ax.plot(steps, mean, color=color, lw=1.2, ls="--" if sv == 0 else "-",
                            label="sync (s=0)" if sv == 0 else f"stale s={sv}")
        axes[0].set_ylabel(ylabel)
        axes[1].set_ylabel("c_t (10-step mean)")
        axes[1].axhline(0, color="gray", lw=0.5)
        if not has_reward and not tc[0]["higher_is_better"]:
            axes[0].set_yscale("log")
        for ax, title in zip(axes, (f"{task}: {ylabel} across staleness", f"{task}: c_t across staleness")):
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step")
        save(fig, f"fig_staleness_{task}.png", axes[1])

    # Figure 3 (paper): c_t per method at each staleness, mean over seeds of 10-step moving averages;
    # Figure 4 (paper): training-reward trajectories per method at each staleness (rollout objectives).
    for task in tasks:
        tc = [c for c in main if c["task"] == task]
        svals = sorted({c["staleness"] for c in tc if c["staleness"] > 0})
        if not svals:
            continue
        sync = [c for c in tc if c["method"] == "sync"]
        has_reward = any(series(c, "reward/mean") for c in tc)
        for key, name, ylabel in (("align/cos", "fig_cos_methods", "c_t (10-step mean)"),
                                  ("reward/mean", "fig_reward", "training reward (10-step mean)")):
            if key == "reward/mean" and not has_reward:
                continue
            fig, axes = plt.subplots(1, len(svals), figsize=(4 * len(svals), 3.2), squeeze=False, sharey=True)
            for ax, sv in zip(axes[0], svals):
                steps, mean, _ = _smooth_mean([series(r, key) for r in sync])
                if steps:
                    ax.plot(steps, mean, color="black", ls="--", lw=1, label="sync (s=0)")
                for m in dict.fromkeys(c["method"] for c in tc if c["method"] != "sync"):
                    recs = [r for r in tc if r["method"] == m and r["staleness"] == sv]
                    steps, mean, std = _smooth_mean([series(r, key) for r in recs])
                    if steps:
                        ax.plot(steps, mean, color=colors[m], lw=1, label=m)
                        if key == "reward/mean":
                            ax.fill_between(steps, mean - std, mean + std, color=colors[m], alpha=0.12, lw=0)
                ax.set_title(f"{task}, s={sv}", fontsize=9)
                ax.set_xlabel("step")
                if key == "align/cos":
                    ax.axhline(0, color="gray", lw=0.5)
            axes[0][0].set_ylabel(ylabel)
            save(fig, f"{name}_{task}.png", axes[0][-1])

    # The regime map: stale - sync gap and the c_t difference against (learning rate, staleness), per model.
    if regime:
        models = sorted({p["model"] for p in regime})
        fig, axes = plt.subplots(len(models), 2, figsize=(9, 3.2 * len(models)), squeeze=False)
        for row, model in zip(axes, models):
            pts = [p for p in regime if p["model"] == model]
            lrs, svals = sorted({p["lr"] for p in pts}), sorted({p["staleness"] for p in pts})
            for ax, key, title in ((row[0], "gap", "stale − sync"), (row[1], "cos_diff", "median c_t: stale − sync")):
                grid = np.full((len(svals), len(lrs)), np.nan)
                for p in pts:
                    v = p["gap"] if key == "gap" else p["stale_cos_median"] - p["sync_cos_median"]
                    grid[svals.index(p["staleness"]), lrs.index(p["lr"])] = v
                    sig = key == "gap" and p["gap_ci_high"] is not None and not math.isnan(p["gap_ci_high"]) \
                        and (p["gap_ci_high"] < 0 or p["gap_ci_low"] > 0)
                    if math.isfinite(v):
                        note = "" if p["sync_healthy"] else " †"
                        ax.text(lrs.index(p["lr"]), svals.index(p["staleness"]), f"{v:.2g}{'*' if sig else ''}{note}",
                                ha="center", va="center", fontsize=7,
                                bbox={"facecolor": "white", "alpha": 0.7, "lw": 0, "pad": 1})
                lim = np.nanmax(np.abs(grid)) if np.isfinite(grid).any() else 1.0
                im = ax.imshow(grid, origin="lower", aspect="auto", cmap="RdBu" if key == "gap" else "PuOr_r",
                               vmin=-lim, vmax=lim)
                ax.set_xticks(range(len(lrs)), [f"{x:.0e}" for x in lrs])
                ax.set_yticks(range(len(svals)), [str(x) for x in svals])
                ax.set_xlabel("learning rate")
                ax.set_ylabel("staleness s")
                ax.set_title(f"{model}: {title}" + (" (*: 95% CI excludes 0)" if key == "gap" else "")
                             + " (†: sync unhealthy)", fontsize=8)
                fig.colorbar(im, ax=ax)
        save(fig, "fig_regime.png")

    # Figure 5: (c_low, c_high) heatmap from the ablation cells.
    abl = [g for g in groups if g["ablation"]]
    if abl:
        import re

        key = _ablation_key(abl)
        shares = {(r["task"], r["method"]): r["share"] for r in _ablation_rows(groups, cells, ablation_rows)}
        by = {(g["task"], g["method"], g["staleness"]): g for g in groups}
        atasks = sorted({g["task"] for g in abl})
        fig, axes = plt.subplots(1, len(atasks), figsize=(4.6 * len(atasks), 3.6), squeeze=False)
        for ax, task in zip(axes[0], atasks):
            pts, share_at = {}, {}
            tg = [g for g in abl if g["task"] == task]
            s_abl = tg[0]["staleness"]
            for g in tg:
                m = re.search(r"c_low=([0-9.]+),c_high=([0-9.]+)", g["method"])
                if m:
                    pts[(float(m.group(1)), float(m.group(2)))] = g[f"{key}_mean"]
                    share_at[(float(m.group(1)), float(m.group(2)))] = shares.get((task, g["method"]), math.nan)
            lows, highs = sorted({k[0] for k in pts}), sorted({k[1] for k in pts})
            grid = np.full((len(lows), len(highs)), np.nan)
            for (lo, hi), v in pts.items():
                grid[lows.index(lo), highs.index(hi)] = v
                sh = share_at[(lo, hi)]
                ax.text(highs.index(hi), lows.index(lo), f"{v:.3g}" + ("" if math.isnan(sh) else f"\nshare {sh:.2f}"),
                        ha="center", va="center", fontsize=7, color="black",
                        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "alpha": 0.6, "lw": 0})
            higher = key == "reward_last" or tg[0]["higher_is_better"]
            refs = {name: by[(task, name, st)][f"{key}_mean"] for name, st in (("sync", 0), ("stale", s_abl))
                    if f"{key}_mean" in by.get((task, name, st), {})}
            # the colour scale spans stale and sync too, so a colour reads as a place in the gap
            span = [v for v in grid.ravel() if math.isfinite(v)] + list(refs.values())
            im = ax.imshow(grid, origin="lower", cmap="viridis" if higher else "viridis_r", aspect="auto",
                           vmin=min(span), vmax=max(span))
            ax.set_xticks(range(len(highs)), [f"{h:g}" for h in highs])
            ax.set_yticks(range(len(lows)), [f"{lo:g}" for lo in lows])
            ax.set_xlabel("c_high")
            ax.set_ylabel("c_low")
            what = "training reward (last 20%)" if key == "reward_last" else f"final {tg[0]['metric']}"
            ref_text = ", ".join(f"{name} {v:.3g}" for name, v in refs.items())
            ax.set_title(f"{task}, s={s_abl}: {what}, bright = better" + (f"\n({ref_text})" if refs else ""),
                         fontsize=8)
            fig.colorbar(im, ax=ax)
            if (0.05, 0.3) in pts:  # the paper's default
                ax.add_patch(plt.Rectangle((highs.index(0.3) - 0.5, lows.index(0.05) - 0.5), 1, 1, fill=False,
                                           ec="white", lw=1.5, label="default (0.05, 0.3)"))
            used = [c for c in cells if c["task"] == task and c.get("c_low") is not None and c["status"] == "done"
                    and c["staleness"] == tg[0]["staleness"]]
            if used and len(lows) > 1 and len(highs) > 1:  # gac-calibrated's thresholds, on the grid's index axes
                x = np.interp(np.mean([c["c_high"] for c in used]), highs, range(len(highs)))
                y = np.interp(np.mean([c["c_low"] for c in used]), lows, range(len(lows)))
                ax.plot([x], [y], marker="x", color="red", ms=8, ls="", label="calibrated (mean over seeds)")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=6, loc="upper left")
        save(fig, "fig_thresholds.png")
    return out


_json_safe = json_safe  # NaN and infinities become null: summary.json stays valid JSON for every parser


def _spec_from_path(root: Path, d: Path) -> dict | None:
    """A cell's identity from its directory ``cells/TASK/METHOD/sS/seedK`` (when neither config.json nor
    the status's copy can be read)."""
    task, method, s, seed = d.relative_to(root / "cells").parts
    try:
        return {"task": task, "method": method, "staleness": int(s[1:]), "seed": int(seed[4:]), "objective": None,
                "params": {}}
    except ValueError:
        return None


def discover_cells(root: Path) -> list[dict]:
    """Every cell stored under ``root/cells`` (a directory with a config.json or a status.json): its config.json,
    else the status's copy of it, else its identity read from the directory's path."""
    specs = []
    for d in sorted(p for p in (root / "cells").glob("*/*/s*/seed*") if p.is_dir()):
        if not (d / "config.json").exists() and not (d / "status.json").exists():
            continue
        spec = None
        for name, pick in (("config.json", lambda x: x), ("status.json", lambda x: x.get("cell"))):
            try:
                candidate = pick(read_json(d / name))
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(candidate, dict) and all(k in candidate for k in ("task", "method", "staleness", "seed")) \
                    and cell_dir(root, candidate) == d:
                spec = candidate
                break
        spec = spec or _spec_from_path(root, d)
        if spec is not None:
            specs.append(spec)
    return specs


def build_report(root: str | Path, cells: list[dict] | None = None) -> dict[str, Any]:
    """Write summary.json, summary.md and the figures of ``root``. They cover every cell stored there:
    ``cells`` (the cells of the grid just run, if given) and every other cell found on disk."""
    root = Path(root)
    specs = list(cells or [])
    known = {cell_dir(root, c) for c in specs}
    specs += [c for c in discover_cells(root) if cell_dir(root, c) not in known]
    records = sorted((r for r in (cell_record(root, c) for c in specs) if r is not None),
                     key=lambda r: (r["task"], r["method"], r["staleness"], r["seed"]))
    groups = group_records(records)
    shares = recovered_shares(groups, cells=records)
    reward_shares = recovered_shares(groups, "reward_last", cells=records)
    regime = regime_points(records, specs)
    timing = read_timing(root)
    summary = {"cells": records, "groups": groups, "recovered": shares, "recovered_reward": reward_shares}
    abl = [g for g in groups if g["ablation"]]
    ablation_rows = None
    if abl:
        summary["ablation_recovered"] = recovered_shares(groups, cells=records, ablation=True)
        summary["ablation_recovered_reward"] = recovered_shares(groups, "reward_last", cells=records, ablation=True)
        ablation_rows = summary["ablation_recovered_reward" if _ablation_key(abl) == "reward_last"
                                else "ablation_recovered"]
    if regime:
        summary["regime"] = regime
    if timing is not None:
        summary["timing"] = timing
    write_json(root / "summary.json", _json_safe(summary))
    (root / "summary.md").write_text(markdown(records, groups, shares, root, reward_shares, timing, regime,
                                                  ablation_rows))
    figs = figures(root, records, specs, groups, regime, ablation_rows) if groups else []
    shares_oh = [r["overhead_share"] for r in records
                 if r.get("overhead_share") is not None and math.isfinite(r["overhead_share"])]
    incomplete = [r["error"] for r in records if r["status"] == "incomplete"]
    return {"figures": figs, "overhead_share_median": statistics.median(shares_oh) if shares_oh else math.nan,
            "summary": summary, "incomplete": incomplete}


def main(args) -> int:
    import sys

    from gacbench.usage import UsageError

    root = Path(args.dir)
    if not (root / "cells").is_dir():
        raise UsageError(f"{root} holds no benchmark cells (expected the folder {root / 'cells'}); "
                         f"run gacbench bench --out {root} first")
    rep = build_report(root)
    for line in rep["incomplete"]:
        print(f"gacbench report: incomplete cell: {line}", file=sys.stderr)
    print(f"wrote {root / 'summary.json'}, {root / 'summary.md'} and {len(rep['figures'])} figures "
          f"from {len(rep['summary']['cells'])} stored cells"
          + (f" ({len(rep['incomplete'])} incomplete, not counted)" if rep["incomplete"] else ""))
    return 0
