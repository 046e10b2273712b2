"""The share of the stale-sync gap a method removes beyond its on-policy effect, and the regime checks of a grid
whose runs measure their policy's own reward (definitions: :mod:`gacbench.bench.report`, docs/bench.md).

A stabilizer that also changes synchronous training (GAC acting on on-policy steps, GSPO's objective, VCPO's
baseline) can close part of the stale-sync gap without correcting staleness at all: its recovered share then
mixes the two. Its on-policy control (the method at s = 0) measures the first, and the paired
difference-in-differences over seeds separates them: per seed i, oriented so that larger is better,

    d_i = (m_s - stale_s) - (m_0 - sync),    g_i = sync - stale_s,

and the share beyond the on-policy effect is mean(d) / mean(g) (Fieller's interval, the paired t-test of
mean(d) = 0). A method whose update at s = 0 is sync's own (``on_policy_identity``, :mod:`gacbench.methods`) needs no
s = 0 cells: its control is sync, its on-policy effect exactly 0, and its share beyond it is its recovered share.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from gacbench.bench.groups import per_seed
from gacbench.bench.records import POLICY_REWARD
from gacbench.bench.stats import (
    REFERENCE_METHODS,
    aligned_values,
    fieller_interval,
    holm_adjust,
    min_detectable_share,
    paired_difference,
)

#: The measures the share beyond the on-policy effect is read on, headline first: (summary.json key suffix, measure,
#: summary.md title)
BEYOND_MEASURES = (("_by_version", "by_version", "reward by policy version"),
                   ("_reward", "reward_last", "training reward (last 20% of steps)"),
                   ("", "final", "final metric"))
#: The control of a method whose update at s = 0 is sync's (``on_policy_identity``)
IDENTITY_CONTROL = "sync (identity at s = 0)"
#: A regime criterion holds where its effect is at least this many of its standard errors over seeds
REGIME_SE = 3.0


def controlled_tasks(groups: list[dict]) -> set[str]:
    """The tasks with an on-policy control: a group of a method other than sync and stale at s = 0 (a suite task's
    ``on_policy``), outside the threshold ablation."""
    return {g["task"] for g in groups if g["staleness"] == 0 and g["method"] not in REFERENCE_METHODS
            and not g["ablation"]}


def _seed_values(groups: list[dict], cells: list[dict], key: str) -> dict[tuple, tuple[dict, str | None]]:
    """Per (task, s) of the rows to compute, ({(task, method, s'): {seed: value}}, source) on ``key``: per_seed for
    ``final`` and ``reward_last`` (source None); for ``by_version`` the version-aligned values over one window per
    (task, s) that also holds the s = 0 controls (:func:`~gacbench.bench.stats.aligned_values` with ``on_policy``),
    source the reward it reads, absent where the comparison has no version-aligned measure."""
    pairs = {(g["task"], g["staleness"]) for g in groups if g["staleness"] > 0}
    if key != "by_version":
        seeds = per_seed(cells, key)
        return {pair: (seeds, None) for pair in pairs}
    out = {}
    for task, s in pairs:
        al = aligned_values(cells, task, s, on_policy=True)
        if al is not None:
            out[(task, s)] = (al["seeds"], al["measure"])
    return out


def beyond_on_policy(groups: list[dict], cells: list[dict], key: str = "final",
                     identity: Callable[[str], bool] | None = None) -> tuple[list[dict], list[dict]]:
    """The share of the gap each method removes beyond its on-policy effect, on ``key`` (``final``, ``reward_last``
    or ``by_version``: :data:`BEYOND_MEASURES`), for the tasks with on-policy controls (:func:`controlled_tasks`).
    One row per method m (not sync, stale or the ablation) and s > 0 whose control is its own group at s = 0
    (``control``: ``"m at s = 0"``) or, without one, sync where ``identity(m)`` (``control``:
    :data:`IDENTITY_CONTROL`); over the seeds sync, stale at s, m at s and the control all ran (``n``), signed so
    that larger is better (``final``: the metric's direction; the rewards: higher):

    - ``gain`` = mean(m_s - stale_s), ``on_policy_effect`` = mean(m_0 - sync) (0 exactly for an identity),
      ``gap`` = mean(sync - stale_s) (> 0: stale is worse; ``no_gap`` where it is not);
    - ``raw_share`` = gain / gap (the recovered share on these seeds) and ``beyond_on_policy_share`` =
      mean(d) / gap, d_i = (m_s - stale_s) - (m_0 - sync) per seed, with Fieller's 95% interval of mean(d) /
      mean(g) (``beyond_ci_low``, ``beyond_ci_high``, ``beyond_ci_kind``, and ``beyond_ci_excluded`` for an
      exclusive one, as the recovered shares'); null without a gap;
    - ``beyond_diff`` = mean(d) with its t-interval (``beyond_diff_ci_low/high``), ``beyond_p`` (the paired t-test
      of mean(d) = 0), ``beyond_p_signflip``, and ``beyond_p_adj`` (Holm over the rows returned; build_report
      re-adjusts it within its family, test ``beyond``);
    - ``sd_diff`` (the sample standard deviation of d) and ``min_detectable_share`` (at that sd and gap).

    ``identity``: method name -> whether its update at s = 0 is sync's (:func:`gacbench.methods.on_policy_identity`;
    None: no method is). Also returns the methods left without a row for want of a control (neither an s = 0
    group nor an identity): one entry per (task, method), with the s they ran at. A ``by_version`` row also names
    its ``source`` (``eval/policy_reward`` or ``reward/mean``)."""
    tasks = controlled_tasks(groups)
    main = [g for g in groups if g["task"] in tasks and not g["ablation"]]
    values = _seed_values(main, cells, key)
    have = {(g["task"], g["method"], g["staleness"]) for g in main}
    rows, uncontrolled = [], {}
    for g in main:
        task, m, s = g["task"], g["method"], g["staleness"]
        if s == 0 or m in REFERENCE_METHODS or (task, s) not in values:
            continue
        if (task, m, 0) in have:
            control, ctrl_key = f"{m} at s = 0", (task, m, 0)
        elif identity is not None and identity(m):
            control, ctrl_key = IDENTITY_CONTROL, (task, "sync", 0)
        else:
            uncontrolled.setdefault((task, m), []).append(s)
            continue
        seeds, source = values[(task, s)]
        runs = [seeds.get(k, {}) for k in ((task, m, s), (task, "stale", s), (task, "sync", 0), ctrl_key)]
        common = sorted(set.intersection(*(set(r) for r in runs)))
        if not common:
            continue
        sign = 1.0 if key != "final" or g["higher_is_better"] else -1.0
        x_m, x_stale, x_sync, x_ctrl = (sign * np.array([r[i] for i in common]) for r in runs)
        rows.append(_beyond_row(task, m, s, key, control, x_m, x_stale, x_sync, x_ctrl))
        if source is not None:
            rows[-1]["source"] = source
    for row, adj in zip(rows, holm_adjust([r["beyond_p"] for r in rows])):
        row["beyond_p_adj"] = adj
    return rows, [{"task": t, "method": m, "staleness": sorted(s)} for (t, m), s in uncontrolled.items()]


def _beyond_row(task: str, method: str, s: int, key: str, control: str, x_m: np.ndarray, x_stale: np.ndarray,
                x_sync: np.ndarray, x_ctrl: np.ndarray) -> dict:
    """One row of :func:`beyond_on_policy` from the oriented per-seed values (one entry per common seed)."""
    n = len(x_m)
    a, b, g = x_m - x_stale, x_ctrl - x_sync, x_sync - x_stale  # gain over stale, on-policy effect, gap
    d = a - b
    gap = float(g.mean())
    no_gap = not gap > 1e-12
    test = paired_difference(a, b)  # mean(a - b) = mean(d), its t-interval, paired t-test and sd (0 when all equal)
    sd = test["sd"]
    row = {"task": task, "method": method, "staleness": s, "measure": key, "control": control, "n": n,
           "gain": float(a.mean()), "on_policy_effect": float(b.mean()), "gap": gap, "no_gap": no_gap,
           "raw_share": math.nan if no_gap else float(a.mean()) / gap,
           "beyond_on_policy_share": math.nan if no_gap else float(d.mean()) / gap,
           "beyond_ci_low": None, "beyond_ci_high": None, "beyond_ci_kind": None,
           "beyond_diff": test["diff"], "beyond_diff_ci_low": test["ci_low"], "beyond_diff_ci_high": test["ci_high"],
           "beyond_p": test["p"], "beyond_p_signflip": test.get("p_signflip"), "sd_diff": sd,
           "min_detectable_share": None if no_gap else min_detectable_share(sd, gap, n)}
    if not no_gap:
        low, high, kind = fieller_interval(d, g)
        if kind == "exclusive":  # every share outside (low, high): the interval is the whole line but that band
            row["beyond_ci_excluded"] = [low, high]
            low, high = -math.inf, math.inf
        row.update({"beyond_ci_low": low, "beyond_ci_high": high, "beyond_ci_kind": kind})
    return row


def headline_beyond(tables: dict[str, list[dict]]) -> list[dict]:
    """The rows of :func:`beyond_on_policy` on the measure the summary reads for each task (``tables``: measure ->
    rows): the reward by policy version where a task has it, else the training reward, else the final metric."""
    out, done = [], set()
    for _, key, _ in BEYOND_MEASURES:
        rows = [r for r in tables.get(key, []) if r["task"] not in done]
        out += rows
        done |= {r["task"] for r in rows}
    return out


def regime_checks(cells: list[dict]) -> list[dict]:
    """The regime criteria of a task whose sync and stale cells all log their policy's own reward
    (``eval/policy_reward``; a task without stale cells gets the first criterion alone), recomputed from its cells,
    each against :data:`REGIME_SE` standard errors over seeds:

    - ``sync``: synchronous training learns: per seed its policy reward at its last eval point minus its first
      (``first_version``, ``last_version``: the versions, where every sync seed shares them), the mean ``rise``, its
      standard error ``rise_se`` (sample sd / sqrt(n)), ``rise_in_se`` and ``learns`` (rise_in_se >= REGIME_SE);
    - ``stale``, per s: stale training loses a gap: per seed sync - stale on the version-aligned policy reward (the
      report's primary measure, :func:`~gacbench.bench.stats.aligned_values`, over ``versions``), paired over the
      seeds both ran (``n``), the mean ``gap``, ``gap_se``, ``gap_in_se`` and ``loses`` (gap_in_se >= REGIME_SE);

    ``met``: every criterion holds. A quantity of fewer than two seeds, or of zero spread, has null standard error,
    ratio and verdict, and so has an s whose sync and stale cells give no version-aligned policy reward (``met`` is
    null where no verdict is false)."""
    done = [c for c in cells if c["status"] == "done" and not c.get("ablation")]
    out = []
    for task in sorted({c["task"] for c in done}):
        sync = [c for c in done if c["task"] == task and c["method"] == "sync" and c["staleness"] == 0]
        stale = [c for c in done if c["task"] == task and c["method"] == "stale" and c["staleness"] > 0]
        if not sync or not all(c.get("_by_version", {}).get(POLICY_REWARD) for c in sync + stale):
            continue
        firsts = {min(c["_by_version"][POLICY_REWARD]) for c in sync}
        lasts = {max(c["_by_version"][POLICY_REWARD]) for c in sync}
        rises = [c["_by_version"][POLICY_REWARD][max(c["_by_version"][POLICY_REWARD])]
                 - c["_by_version"][POLICY_REWARD][min(c["_by_version"][POLICY_REWARD])] for c in sync]
        rise = _in_se(np.array(rises))
        entry = {"task": task, "measure": POLICY_REWARD, "threshold_se": REGIME_SE,
                 "sync": {"first_version": firsts.pop() if len(firsts) == 1 else None,
                          "last_version": lasts.pop() if len(lasts) == 1 else None, "n": len(rises),
                          "rise": rise["mean"], "rise_se": rise["se"], "rise_in_se": rise["in_se"],
                          "learns": rise["holds"]},
                 "stale": []}
        for s in sorted({c["staleness"] for c in stale}):
            # the window of sync and stale alone: another method's cells (with or without the policy reward) must
            # neither move it nor turn the measure into the training reward
            al = aligned_values(sync + [c for c in stale if c["staleness"] == s], task, s)
            if al is None or al["measure"] != POLICY_REWARD:
                entry["stale"].append({"staleness": s, "versions": None, "n": 0, "gap": math.nan, "gap_se": None,
                                       "gap_in_se": None, "loses": None})
                continue
            a, b = al["seeds"].get((task, "sync", 0), {}), al["seeds"].get((task, "stale", s), {})
            common = sorted(set(a) & set(b))
            gap = _in_se(np.array([a[k] - b[k] for k in common]))
            entry["stale"].append({"staleness": s, "versions": al["versions"], "n": len(common), "gap": gap["mean"],
                                   "gap_se": gap["se"], "gap_in_se": gap["in_se"], "loses": gap["holds"]})
        verdicts = [entry["sync"]["learns"]] + [x["loses"] for x in entry["stale"]]
        entry["met"] = False if False in verdicts else (None if None in verdicts else True)
        out.append(entry)
    return out


def _in_se(x: np.ndarray) -> dict:
    """mean(x), its standard error sd(x, ddof=1) / sqrt(n), the mean in standard errors and whether that reaches
    REGIME_SE; the last three None below two values or with zero spread."""
    if len(x) == 0:
        return {"mean": math.nan, "se": None, "in_se": None, "holds": None}
    mean = float(x.mean())
    se = float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) >= 2 else 0.0
    if not se > 0:
        return {"mean": mean, "se": None, "in_se": None, "holds": None}
    return {"mean": mean, "se": se, "in_se": mean / se, "holds": bool(mean / se >= REGIME_SE)}
