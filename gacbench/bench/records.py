"""The record of each stored cell of a benchmark directory: its status, final metric, alignment statistics,
update diagnostics and training-reward degradation indicator (definitions: :mod:`gacbench.bench.report`), and
the cells stored under a directory."""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from gacbench.bench.cell import cell_dir, read_json, stored_state
from gacbench.functional.stats import alignment_summary

DEGRADE_WINDOW, DEGRADE_MARGIN, DEGRADE_SIGMAS = 10, 0.05, 5.0
#: per-step diagnostics of the update, averaged over a cell's steps after the warm-up where the cell logs them:
#: record key -> (logged name, column title in summary.md)
DIAGNOSTICS = {
    "grad_norm": ("grad/norm", "gradient norm"),
    "ratio_max": ("is/ratio_max", "largest token ratio π_θ/π_behav"),
    "clipfrac": ("pg/clipfrac", "clipped-token share"),
    "clipfrac_dual": ("pg/clipfrac_dual", "dual-clipped-token share"),
    "ess_frac": ("is/ess_frac", "ESS fraction of the token weights"),
    "step_cos": ("align/step_cos", "cos of consecutive optimizer steps"),
    "step_norm": ("param/step_norm", "applied parameter step ‖θ_k − θ_{k−1}‖"),
}



def read_metrics(path: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.csv (Lightning CSVLogger) -> {name: [(step, value), ...]}."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    if not path.exists():
        return series
    try:
        with path.open() as f:
            for row in csv.DictReader(f):
                step = int(float(row.get("step") or -1))
                for key, value in row.items():
                    if key != "step" and value not in ("", None):
                        series[key].append((step, float(value)))
    except (csv.Error, ValueError) as exc:
        raise ValueError(f"{path} is corrupt ({exc}); delete its cell directory and rerun the grid to recompute "
                         "it") from None
    return series


def recover_hint(root: Path, cell: dict) -> str:
    """How to recover an incomplete cell."""
    return (f"the cell is not counted; rerun the gacbench bench command of this grid with --out {root} to "
            f"recompute it, or delete {cell_dir(root, cell)}")


#: the result fields of a cell record that a cell without a finished run leaves empty
NOT_READ = {k: None for k in ("metric", "higher_is_better", "final", "diverged", "cos_median", "cos_abs_q90",
                              "cos_abs_le_005")}


def cell_record(root: Path, cell: dict, metrics: dict[Path, dict] | None = None) -> dict[str, Any] | None:
    """The summary's record of a stored cell (None when it has no status yet): ``status`` is ``done``,
    ``failed``, or ``incomplete`` (a status that claims a finished run whose files are not complete).
    ``metrics``: where given, the metrics.csv of a done cell of the main grid (not a threshold-ablation cell) as
    :func:`read_metrics` parsed it is kept there under its path, for the figures to read without parsing it
    again."""
    status, problem = stored_state(root, cell)
    if status is None and problem is None:
        return None
    rec: dict[str, Any] = {k: cell[k] for k in ("task", "method", "staleness", "seed")}
    if cell.get("misplaced"):  # its files belong to another cell (discover_cells)
        return {**rec, "status": "incomplete", "ablation": bool(cell.get("ablation")), "error": cell["misplaced"],
                **NOT_READ}
    # the run's own record says whether it is a threshold-ablation cell (a grid that reuses a cell another grid ran
    # as a plain method must not relabel it), so that gacbench bench and gacbench report group it alike
    ran_as = status.get("cell") if isinstance(status, dict) and isinstance(status.get("cell"), dict) else cell
    rec.update({"status": "incomplete" if problem else status.get("status"), "ablation": bool(ran_as.get("ablation"))})
    if cell.get("objective") == "grpo":  # the engine section's name, or a flat engine name
        engine = (cell.get("params") or {}).get("engine") or "hf"
        rec["engine"] = engine.get("name", "hf") if isinstance(engine, dict) else engine
    if problem is not None or status.get("status") != "done":
        error = f"{problem}: {recover_hint(root, cell)}" if problem else status.get("error")
        rec.update({"error": error, **NOT_READ})
        return rec
    path = cell_dir(root, cell) / "metrics.csv"
    series = read_metrics(path)
    if metrics is not None and not rec["ablation"]:  # the figures draw the main grid's cells
        metrics[path] = series
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
    if series.get("response/tokens_mean"):  # GRPO: generated tokens per response (mean over steps), model size
        rec["response_tokens"] = float(np.mean([v for _, v in series["response/tokens_mean"]]))
        rec["params"] = int(series["model/params"][-1][1]) if series.get("model/params") else None
    if series.get("param/drift"):  # DriftMonitor: the distance the run travelled, ||theta_T - theta_0||
        rec["drift"] = float(series["param/drift"][-1][1])
    if series.get("align/proj_frac"):  # GAC: the share of its steps it shrank, projected or skipped
        rec["gac_changed"] = float(series["align/proj_frac"][-1][1])
    reward = [v for _, v in series.get("reward/mean", [])]
    if reward:  # rollout objectives: the training reward is a second, less noisy, measure than a final eval
        k = max(1, len(reward) // 5)
        rec.update({"reward_first": float(np.mean(reward[:k])), "reward_last": float(np.mean(reward[-k:]))})
        rec["_by_version"] = by_version(series)
        drop, noise = running_max_drop(reward), window_noise(reward)
        rec.update({"reward_drop": drop, "reward_noise": noise,
                    "degraded": None if math.isnan(drop) else bool(drop > degrade_threshold(noise))})
    return rec


#: The policy's own reward on held-out prompts, logged by a rollout objective that evaluates theta_t itself
POLICY_REWARD = "eval/policy_reward"


def by_version(series: dict[str, list[tuple[int, float]]]) -> dict[str, dict[int, float]]:
    """A rollout cell's rewards indexed by the policy version that earned them: ``reward/mean`` at step t was
    sampled from theta_{t - lag}, lag the ``stale/lag`` logged at t (0 where none is logged: a synchronous run), so
    it is filed under version t - lag (the mean where several steps share a version, as the first s steps of a
    stale run all sample theta_0); a step whose batch mixes versions (asynchronous rollouts: a fractional mean
    lag) is filed by its ``reward/lag/K`` rewards, each under version t - K; and, where the cell logs it,
    ``eval/policy_reward`` at step t under version t (theta_t's own reward). {name: {version: value}}."""
    lag = {step: v for step, v in series.get("stale/lag", [])}
    per_lag: dict[int, dict[int, float]] = defaultdict(dict)
    for name, points in series.items():
        if name.startswith("reward/lag/") and name.rsplit("/", 1)[1].isdigit():
            for step, value in points:
                per_lag[step][int(name.rsplit("/", 1)[1])] = value
    acc: dict[int, list[float]] = defaultdict(list)
    for step, value in series.get("reward/mean", []):
        if step in per_lag:
            for k, v in per_lag[step].items():
                acc[step - k].append(v)
            continue
        acc[step - int(round(lag.get(step, 0.0)))].append(value)
    out = {"reward/mean": {v: float(np.mean(xs)) for v, xs in sorted(acc.items())}}
    if series.get(POLICY_REWARD):
        out[POLICY_REWARD] = {step: value for step, value in series[POLICY_REWARD]}
    return out


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


def read_timing(root: Path) -> dict | None:
    """``timing.json`` of a bench directory, or None (not written yet, or unreadable)."""
    path = root / "timing.json"
    try:
        return read_json(path) if path.exists() else None
    except ValueError:
        return None


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
    else the status's copy of it, else its identity read from the directory's path. A directory whose files
    record another cell only (a cell directory copied to another seed or staleness) is listed from its path with
    ``misplaced`` naming the cell they record, so that it is reported as incomplete and never counted."""
    specs = []
    for d in sorted(p for p in (root / "cells").glob("*/*/s*/seed*") if p.is_dir()):
        if not (d / "config.json").exists() and not (d / "status.json").exists():
            continue
        spec, elsewhere = None, None
        for name, pick in (("config.json", lambda x: x), ("status.json", lambda x: x.get("cell"))):
            try:
                candidate = pick(read_json(d / name))
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(candidate, dict) and all(k in candidate for k in ("task", "method", "staleness", "seed")):
                if cell_dir(root, candidate) == d:
                    spec = candidate
                    break
                elsewhere = elsewhere or (name, candidate)
        if spec is None:
            spec = _spec_from_path(root, d)
            if spec is not None and elsewhere is not None:
                name, other = elsewhere
                spec["misplaced"] = (f"{d}: its {name} records the cell {cell_dir(root, other).relative_to(root)} "
                                     f"(a copied directory?): the cell is not counted; delete {d}, then rerun the "
                                     "grid to compute it")
        if spec is not None:
            specs.append(spec)
    return specs
