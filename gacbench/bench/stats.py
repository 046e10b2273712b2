"""Statistics over seeds: bootstrap intervals, the paired comparison to stale, and the recovered share of the
stale-sync gap (definitions: :mod:`gacbench.bench.report`)."""

from __future__ import annotations

import math

import numpy as np

from gacbench.bench.groups import per_seed

REFERENCE_METHODS = ("sync", "stale")
BOOT_RESAMPLES, BOOT_SEED, CI_LEVEL = 9999, 0, 0.95
#: The percentile of the resampled statistics: the smallest value whose empirical CDF reaches the level (no
#: interpolation, so that an unbounded resample gives an unbounded end rather than inf - inf)
QUANTILE_METHOD = "inverted_cdf"


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


def holm_adjust(ps: list[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values of one family of tests: with the m finite p-values sorted ascending,
    p_(1) <= ... <= p_(m), the i-th adjusted value is min(1, max over j <= i of (m - j + 1) p_(j)) (the running
    maximum keeps the adjusted values in the order of the raw ones). Rejecting where the adjusted value is below
    alpha controls the family-wise error rate at alpha. None or NaN (no test) stays None and does not count in m."""
    finite = [(p, i) for i, p in enumerate(ps) if p is not None and math.isfinite(p)]
    out: list[float | None] = [None] * len(ps)
    running = 0.0
    for rank, (p, i) in enumerate(sorted(finite)):
        running = max(running, min(1.0, (len(finite) - rank) * p))
        out[i] = running
    return out


def oriented_difference(a: dict[int, float], b: dict[int, float], higher: bool) -> tuple[dict[str, float], int]:
    """:func:`paired_difference` of a - b over the seeds both hold, signed so that > 0 means a is better
    (``higher``: larger values are better), and that seed count."""
    paired = sorted(set(a) & set(b))
    x, y = np.array([a[k] for k in paired]), np.array([b[k] for k in paired])
    return (paired_difference(x, y) if higher else paired_difference(y, x)), len(paired)


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
        d, _ = oriented_difference(meth, stale, higher)  # > 0: the method is better
        row.update({"vs_stale_diff": d["diff"], "vs_stale_ci_low": d["ci_low"], "vs_stale_ci_high": d["ci_high"],
                    "vs_stale_p": d["p"]})
    if not row.get("missing") and not row["no_gap"]:
        low, high = share_bootstrap_ci(*(np.array([g[k] for k in common]) for g in (sync, stale, meth)))
        row.update({"share_ci_low": low, "share_ci_high": high})
    return row


def _unequal_seed_means(seeds: dict[tuple, dict[int, float]], task: str, method: str,
                        s: int) -> tuple[int, float, float, float, float] | None:
    """Where sync, stale at ``s`` and ``method`` at ``s`` did not run the same seeds: the count of the seeds all
    three ran, their three means over those seeds and the standard error of the gap stale - sync from the sample
    (ddof=1) standard deviations (NaN below two seeds). None where the three hold the same seeds, or share none."""
    groups = [seeds.get(k, {}) for k in ((task, "sync", 0), (task, "stale", s), (task, method, s))]
    common = sorted(set.intersection(*(set(g) for g in groups)))
    if not common or all(len(g) == len(common) for g in groups):
        return None
    x = [np.array([g[i] for i in common]) for g in groups]
    n = len(common)
    se = math.sqrt((x[0].var(ddof=1) + x[1].var(ddof=1)) / n) if n >= 2 else math.nan
    return n, float(x[0].mean()), float(x[1].mean()), float(x[2].mean()), se


def recovered_shares(groups: list[dict], key: str = "final", cells: list[dict] | None = None,
                     ablation: bool = False) -> list[dict]:
    """Per stabilizer and staleness, on ``{key}_mean`` (``final``: the metric; ``reward_last``: the
    training reward over the last 20% of steps, for rollout objectives). With ``cells`` (the cell records)
    each row also gets its confidence intervals (module docstring) and ``vs_stale_p_adj``, its p-value against
    stale adjusted by Holm's method over the rows returned (one family; :func:`holm_adjust`); a method whose sync
    or stale group has no cells gets a row with ``missing`` naming them and null share. ``ablation=True``: the
    rows of the threshold ablation's groups instead, against the same sync and stale groups."""
    mean, std = f"{key}_mean", f"{key}_std"
    groups = [g for g in groups if mean in g]
    by = {(g["task"], g["method"], g["staleness"]): g for g in groups}
    seeds = per_seed(cells, key) if cells is not None else None
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
        sync_v, stale_v, value = sync[mean], stale[mean], g[mean]
        # standard error of the gap from the sample (ddof=1) std of each group; unknown with a single seed
        if min(sync["n"], stale["n"]) < 2:
            se = math.nan
        else:
            se = math.sqrt(sum((x[std] or 0.0) ** 2 / (x["n"] - 1) for x in (sync, stale)))
        paired = _unequal_seed_means(seeds, g["task"], g["method"], g["staleness"]) if seeds is not None else None
        if paired:  # the seed sets differ: the share on the seeds its interval pairs
            n_paired, sync_v, stale_v, value, se = paired
        gap = stale_v - sync_v
        sign = -1.0 if (key == "reward_last" or g["higher_is_better"]) else 1.0  # gap > 0 means stale is worse
        share = (stale_v - value) / gap if abs(gap) > 1e-12 and sign * gap > 0 else math.nan
        row = {"task": g["task"], "method": g["method"], "staleness": g["staleness"], "share": share,
               "sync": sync_v, "stale": stale_v, "value": value,
               "no_gap": not (abs(gap) > 1e-12 and sign * gap > 0), "gap": gap, "gap_se": se,
               "gap_within_noise": None if math.isnan(se) else bool(abs(gap) < 2.0 * se),
               **({"paired_seeds": n_paired} if paired else {})}
        rows.append(_with_ci(row, seeds, key, higher) if cells is not None else row)
    if cells is not None:  # the rows are one family of tests against stale
        for row, adj in zip(rows, holm_adjust([r["vs_stale_p"] for r in rows])):
            row["vs_stale_p_adj"] = adj
    return rows


def on_policy_controls(groups: list[dict], cells: list[dict], key: str = "final") -> list[dict]:
    """The on-policy controls: every stabilizer run at s = 0 (a suite task's ``on_policy``) against sync on the same
    task, on ``{key}_mean``. Per row: ``value`` and ``sync`` (the group means), and over the seeds both share
    (``n``) the paired difference method - sync, signed so that > 0 is better (``vs_sync_diff``, its t-interval
    ``vs_sync_ci_low/high``, the paired t-test's ``vs_sync_p``), and ``vs_sync_p_adj``, Holm-adjusted over the rows
    returned (one family). A stabilizer that only acts against staleness leaves the on-policy run where it was: a
    difference here is an effect that does not need staleness."""
    mean = f"{key}_mean"
    by = {(g["task"], g["method"], g["staleness"]): g for g in groups if mean in g}
    seeds = per_seed(cells, key)
    rows = []
    for g in groups:
        if mean not in g or g["staleness"] != 0 or g["method"] in REFERENCE_METHODS or g["ablation"]:
            continue
        sync = by.get((g["task"], "sync", 0))
        higher = key == "reward_last" or bool(g["higher_is_better"])
        d, n = oriented_difference(seeds.get((g["task"], g["method"], 0), {}), seeds.get((g["task"], "sync", 0), {}),
                                   higher)
        rows.append({"task": g["task"], "method": g["method"], "staleness": 0, "value": g[mean],
                     "sync": sync[mean] if sync else math.nan, "n": n, "vs_sync_diff": d["diff"],
                     "vs_sync_ci_low": d["ci_low"], "vs_sync_ci_high": d["ci_high"], "vs_sync_p": d["p"]})
    for row, adj in zip(rows, holm_adjust([r["vs_sync_p"] for r in rows])):
        row["vs_sync_p_adj"] = adj
    return rows


def staleness_costs(groups: list[dict], cells: list[dict], key: str = "final") -> list[dict]:
    """What staleness costs a method that also ran at s = 0 (a task's ``on_policy``), measured against its own
    on-policy run, beside what it costs plain GRPO: per such method m and each s > 0 it ran at, over paired seeds,
    ``cost`` = m at s = 0 minus m at s (signed so that > 0 means staleness hurts; ``cost_ci_low/high``, ``cost_p``,
    ``n``) and ``stale_cost`` = sync minus stale at s (``stale_cost_ci_low/high``, ``stale_n``). A stabilizer that
    removes staleness's harm has cost 0 while stale_cost stays; one that only moves the on-policy run has cost
    equal to stale_cost."""
    mean = f"{key}_mean"
    seeds = per_seed(cells, key)
    have = {(g["task"], g["method"], g["staleness"]) for g in groups if mean in g and not g["ablation"]}
    rows = []
    for g in groups:
        task, m, s = g["task"], g["method"], g["staleness"]
        if mean not in g or g["ablation"] or s == 0 or m in REFERENCE_METHODS or (task, m, 0) not in have:
            continue
        higher = key == "reward_last" or bool(g["higher_is_better"])
        own, n = oriented_difference(seeds.get((task, m, 0), {}), seeds.get((task, m, s), {}), higher)
        ref, n_ref = oriented_difference(seeds.get((task, "sync", 0), {}), seeds.get((task, "stale", s), {}), higher)
        rows.append({"task": task, "method": m, "staleness": s, "n": n, "cost": own["diff"],
                     "cost_ci_low": own["ci_low"], "cost_ci_high": own["ci_high"], "cost_p": own["p"],
                     "stale_n": n_ref, "stale_cost": ref["diff"], "stale_cost_ci_low": ref["ci_low"],
                     "stale_cost_ci_high": ref["ci_high"]})
    return rows


def significant(row: dict, alpha: float = 0.05) -> bool:
    """Whether a recovered-share row's paired test against stale rejects at ``alpha`` after Holm's adjustment over
    its table (``vs_stale_p_adj``)."""
    return row.get("vs_stale_p_adj") is not None and row["vs_stale_p_adj"] < alpha


def headline_shares(shares: list[dict], reward_shares: list[dict]) -> list[dict]:
    """The recovered-share rows on the measure the summary reads for each task: the training reward
    (``reward_shares``) for a task that has it (rollout objectives), else the final metric (``shares``). Copies,
    each with ``measure`` (``reward_last`` or ``final``)."""
    rewarded = {r["task"] for r in reward_shares}
    return ([{**r, "measure": "reward_last"} for r in reward_shares]
            + [{**r, "measure": "final"} for r in shares if r["task"] not in rewarded])


def ablation_key(abl: list[dict]) -> str:
    """The measure the threshold ablation is read on: the training reward where every ablation group has one
    (rollout objectives), else the final metric."""
    return "reward_last" if all("reward_last_mean" in g for g in abl) else "final"


def ablation_share_rows(groups: list[dict], cells: list[dict], given: list[dict] | None) -> list[dict]:
    """The threshold ablation's recovered shares on its measure: ``given`` (build_report computes them once for
    summary.json), else computed here."""
    if given is not None:
        return given
    return recovered_shares(groups, ablation_key([g for g in groups if g["ablation"]]), cells=cells, ablation=True)
