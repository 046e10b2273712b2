"""Groups of stored cells: the seeds of one (task, settings, method, staleness) averaged, per-seed values, and the
seed-mean reward curves by policy version (:func:`version_curve`).

A group is every cell that differs only in its seed. Cells of one task stored with other settings (another
suite's steps, learning rate or noise in the same directory) are other groups: :func:`label_by_settings` gives
their task the label ``TASK (KEY=VALUE, ...)``, over the settings that differ between them, before they are
grouped, so that every table and figure keeps them apart. A task whose cells all share their settings keeps its
plain name.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import Any

import numpy as np

from gacbench.bench.cell import flat_params
from gacbench.bench.records import DIAGNOSTICS, POLICY_REWARD

#: The keys of a cell's config that are not its settings: those that name a group besides its settings (task,
#: method, staleness, and the ablation flag, which the method's name carries), the seed (a group's cells are its
#: seeds), the environment the run was computed in (summary.json's ``versions``) and the thresholds
#: gac-calibrated read from its own seed's sync cell.
NOT_SETTINGS = ("task", "method", "staleness", "ablation", "seed", "provenance", "calibration")


def cell_settings(spec: dict) -> dict[str, Any] | None:
    """A cell's settings: every key of its config but NOT_SETTINGS, sections flattened (``params.lr``,
    ``params.engine.name``, ``steps``, ``warmup``, ...), an unset (null) key left out. None for a cell known only
    from its directory's path, whose settings are unknown."""
    if spec.get("objective") is None:
        return None
    kept = {k: v for k, v in spec.items() if k not in NOT_SETTINGS and v is not None}
    return flat_params(json.loads(json.dumps(kept, default=str)))  # as stored in config.json


def _cell_key(c: dict) -> tuple:
    return c["task"], c["method"], c["staleness"], c["seed"]


def _show(settings: dict, key: str) -> str:
    if key not in settings:
        return "unset"
    value = settings[key]
    return value if isinstance(value, str) else json.dumps(value)


def settings_labels(specs: list[dict]) -> dict[tuple, tuple[str, dict[str, Any]]]:
    """``{(task, method, staleness, seed): (label, settings)}`` for the cells of every task stored with more than
    one setting: ``label`` is ``TASK (KEY=VALUE, ...)`` over the keys whose values differ between the task's
    settings (``params.`` left out of a key; ``unset`` where one setting lacks the key), ``settings`` those keys'
    values (null where unset). Cells of a task with one setting are absent."""
    variants: dict[str, dict[str, dict]] = defaultdict(dict)
    of_cell: dict[tuple, tuple[str, str]] = {}
    for c in specs:
        settings = cell_settings(c)
        if settings is None:
            continue
        frozen = json.dumps(settings, sort_keys=True)
        variants[c["task"]][frozen] = settings
        of_cell[_cell_key(c)] = (c["task"], frozen)
    labels: dict[str, dict[str, tuple[str, dict]]] = {}
    for task, by_frozen in variants.items():
        if len(by_frozen) < 2:
            continue
        keys = sorted(set().union(*by_frozen.values()))
        differ = [k for k in keys if len({(k in s, json.dumps(s.get(k))) for s in by_frozen.values()}) > 1]
        labels[task] = {
            frozen: (f"{task} (" + ", ".join(f"{k.removeprefix('params.')}={_show(s, k)}" for k in differ) + ")",
                     {k: s.get(k) for k in differ})
            for frozen, s in by_frozen.items()}
    return {ident: labels[task][frozen] for ident, (task, frozen) in of_cell.items() if task in labels}


def label_by_settings(records: list[dict], specs: list[dict]) -> tuple[list[dict], list[dict]]:
    """``records`` and ``specs`` as the groups see them: a cell of a task stored with several settings gets its
    group's label as ``task`` (:func:`settings_labels`); ``records`` (summary.json's cells, which keep the stored
    task) get ``group`` (the label) and ``settings`` (the differing keys) in place. Returns relabelled copies."""
    labels = settings_labels(specs)
    for r in records:
        if _cell_key(r) in labels:
            label, settings = labels[_cell_key(r)]
            r.update({"group": label, "settings": settings})
    relabel = lambda x: {**x, "task": labels[_cell_key(x)][0]} if _cell_key(x) in labels else x  # noqa: E731
    return [relabel(r) for r in records], [relabel(c) for c in specs]


def capped_final(rec: dict) -> float:
    """A done cell's final metric, or its starting value where it diverged (as counted in ``final_mean``)."""
    final = rec["final"]
    if rec["diverged"] or final is None or not math.isfinite(final):
        return rec["initial"]
    return final


def nanmean(xs: list[float]) -> float:
    """The mean of the finite values of ``xs`` (NaN when there is none)."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return float(np.mean(xs)) if xs else math.nan


def _reward_summary(recs: list[dict]) -> dict[str, float | int]:
    """A group's training reward over its seeds with a finite one, as the paired statistics (per_seed) read them:
    the last 20% of steps' mean, population sd and count, and the first 20%'s mean."""
    last = [x for x in (r["reward_last"] for r in recs) if x is not None and math.isfinite(x)]
    return {"reward_last_mean": float(np.mean(last)) if last else math.nan,
            "reward_last_std": float(np.std(last)) if last else math.nan, "reward_last_n": len(last),
            "reward_first_mean": nanmean([r["reward_first"] for r in recs])}


def group_records(cells: list[dict]) -> list[dict]:
    """One record per (task, method, staleness) of the done cells: means over seeds, and ``final_std`` /
    ``reward_last_std``, the population standard deviation over seeds (ddof 0, as summary.md's "mean ± sd" tables
    and fig_robustness.png label it; the gap's standard error is formed from it with n - 1)."""
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
            # over the seeds with a finite reward, as the paired statistics (per_seed) read them
            **(_reward_summary(recs) if all("reward_last" in r for r in recs) else {}),
            "cos_median": nanmean([r["cos_median"] for r in recs]),
            "cos_abs_q90": nanmean([r["cos_abs_q90"] for r in recs]),
            "cos_abs_le_005": nanmean([r["cos_abs_le_005"] for r in recs]),
            **{f"{k}_mean": float(np.mean([r[k] for r in recs])) for k in (*DIAGNOSTICS, "gac_changed", "drift")
               if all(k in r for r in recs)},
            **({"response_tokens_mean": nanmean([r["response_tokens"] for r in recs]), "params": recs[0]["params"]}
               if all("response_tokens" in r for r in recs) else {}),
            "n": len(recs),
            **({"settings": recs[0]["settings"]} if "settings" in recs[0] else {}),
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


def smooth_curve(points: dict[float, float], window: int) -> dict[float, float]:
    """The moving mean of ``window`` consecutive points of {version: value} (sorted by version), each placed at
    its points' mean version; all points in one where there are fewer than ``window``; unchanged for window 1."""
    xs = sorted(points)
    if window <= 1 or not xs:
        return {x: points[x] for x in xs}
    w = min(window, len(xs))
    return {float(np.mean(xs[i:i + w])): float(np.mean([points[x] for x in xs[i:i + w]]))
            for i in range(len(xs) - w + 1)}


def seed_mean(curves: dict[int, dict[float, float]]) -> dict[float, float]:
    """The mean over seeds at the versions every seed has."""
    common = set.intersection(*(set(c) for c in curves.values())) if curves else set()
    return {x: float(np.mean([c[x] for c in curves.values()])) for x in sorted(common)}


#: The training reward's curve by policy version is a moving mean over this many consecutive versions (as the step
#: curves' 10-step mean)
VERSION_SMOOTH = 10
#: A seed-mean curve's band is the range over seeds up to this many seeds, the mean ± one standard error beyond
BAND_RANGE_SEEDS = 3


def version_measure(cells: list[dict]) -> str | None:
    """The reward that curves by policy version of ``cells`` (a task's cells) read: ``eval/policy_reward`` (the
    held-out reward of the policy θ_v itself) where every cell logs it, else ``reward/mean`` (the training reward
    filed under the version that sampled it, :func:`gacbench.bench.records.by_version`) where every cell has it;
    None where a cell has no rewards by version (not a rollout objective) or there are no cells."""
    if not cells or not all(c.get("_by_version", {}).get("reward/mean") for c in cells):
        return None
    return POLICY_REWARD if all(c["_by_version"].get(POLICY_REWARD) for c in cells) else "reward/mean"


def version_curve(cells: list[dict], measure: str, smooth: int = VERSION_SMOOTH) -> dict[str, Any] | None:
    """The seed-mean curve by policy version of ``cells`` (the seeds of one method at one s, each with its
    ``_by_version``): each seed's {version: value} of ``measure`` (its finite values), the training reward
    (``reward/mean``) as a moving mean over ``smooth`` consecutive versions placed at their mean version
    (:func:`smooth_curve`), the policy reward at its eval points as logged; then, at the versions every seed has, the
    mean over seeds and a band: the range over seeds with at most BAND_RANGE_SEEDS seeds (``band``: ``range``), else
    the mean ± its standard error sd / √n, sd over seeds with ddof 1 (``band``: ``se``). Returns {``versions``,
    ``mean``, ``low``, ``high``: lists, one entry per version; ``n``: the seeds; ``band``}, or None where no version
    is common to the seeds (or no seed has a value)."""
    curves = {}
    for c in cells:
        points = {float(v): float(x) for v, x in c["_by_version"].get(measure, {}).items() if math.isfinite(x)}
        if points:
            curves[c["seed"]] = smooth_curve(points, smooth if measure == "reward/mean" else 1)
    versions = list(seed_mean(curves))
    if not versions:
        return None
    values = np.array([[curves[k][v] for v in versions] for k in sorted(curves)])  # (seeds, versions)
    n, mean = values.shape[0], values.mean(axis=0)
    if n <= BAND_RANGE_SEEDS:
        low, high, band = values.min(axis=0), values.max(axis=0), "range"
    else:
        se = values.std(axis=0, ddof=1) / math.sqrt(n)
        low, high, band = mean - se, mean + se, "se"
    return {"versions": versions, "mean": mean.tolist(), "low": low.tolist(), "high": high.tolist(), "n": n,
            "band": band}
