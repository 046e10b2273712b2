"""Statistics over seeds: t and Fieller intervals (and the percentile bootstrap of the share, which older published
tables report), the paired
comparison to stale with its exact sign-flip p, the recovered share of the stale-sync gap and its minimum
detectable share, the multiplicity families, and the reward by policy version (definitions:
:mod:`gacbench.bench.report`)."""

from __future__ import annotations

import functools
import math

import numpy as np

from gacbench.bench.groups import per_seed
from gacbench.bench.records import POLICY_REWARD

REFERENCE_METHODS = ("sync", "stale")
BOOT_RESAMPLES, BOOT_SEED, CI_LEVEL = 9999, 0, 0.95
#: The power and two-sided level at which :func:`min_detectable_share` and :func:`seeds_needed` size an effect
POWER, ALPHA = 0.8, 0.05
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


def mean_t_interval(x: np.ndarray, level: float = CI_LEVEL) -> tuple[float, float]:
    """The t-interval of mean(x) over its seeds, mean +- t_{(1+level)/2, n-1} sd/sqrt(n) (sd with ddof=1): under
    normal seed noise it covers at ``level`` for any n >= 2, where a percentile bootstrap of n seeds covers far less
    (about 50% at n = 2, 75% at n = 3, 85% at n = 5: at n = 2 it is the range of the two values). Non-finite values
    are left out; NaNs with fewer than two finite ones."""
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    if len(x) < 2:
        return math.nan, math.nan
    mean, half = float(x.mean()), _t_half(x, level)
    return mean - half, mean + half


def _t_half(x: np.ndarray, level: float) -> float:
    """The half-width t_{(1+level)/2, n-1} sd/sqrt(n) of the t-interval of mean(x) (n >= 2, sd with ddof=1)."""
    from scipy import stats

    n = len(x)
    return float(stats.t.ppf(0.5 + level / 2.0, n - 1) * x.std(ddof=1) / math.sqrt(n))


def paired_difference(a: np.ndarray, b: np.ndarray, level: float = CI_LEVEL) -> dict[str, float]:
    """mean(a - b) over paired seeds, its t-interval (mean +- t_{(1+level)/2, n-1} sd/sqrt(n)), the two-sided
    paired t-test's p-value (scipy.stats.ttest_rel; NaN when every difference is equal, to within the rounding of
    the subtraction: :func:`differences_equal`) and ``sd``, the differences' sample standard deviation (0 where
    they are equal so: no t-test, so no detectable effect either). NaNs below two seeds."""
    import warnings

    from scipy import stats

    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    n = len(d)
    if n == 0:
        return {"diff": math.nan, "ci_low": math.nan, "ci_high": math.nan, "p": math.nan, "sd": math.nan}
    mean = float(d.mean())
    if n < 2:
        return {"diff": mean, "ci_low": math.nan, "ci_high": math.nan, "p": math.nan, "sd": math.nan}
    half = _t_half(d, level)
    equal = differences_equal(a, b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = math.nan if equal else float(stats.ttest_rel(a, b).pvalue)
    return {"diff": mean, "ci_low": mean - half, "ci_high": mean + half, "p": p, "p_signflip": sign_flip_p(d),
            "sd": 0.0 if equal else float(d.std(ddof=1))}


def differences_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether the paired differences a - b are all equal up to the rounding of the subtraction (a few units in
    the last place of the larger operand): a method that beats another by exactly 0.1 on every seed gives
    differences such as 0.10000000000000003 and 0.09999999999999998, on which a t-test would read rounding noise
    as a spread and return p ~ 1e-32."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    d = a - b
    scale = float(max(np.abs(a).max(initial=0.0), np.abs(b).max(initial=0.0)))
    return float(np.ptp(d)) <= 8.0 * np.finfo(np.float64).eps * scale if len(d) else True


SIGN_FLIP_EXACT_MAX = 16  # pairs up to which sign_flip_p enumerates all 2^n assignments (65,536 at 16)
SIGN_FLIP_RESAMPLES = 99_999  # random assignments above it


def sign_flip_p(d: np.ndarray) -> float:
    """The two-sided sign-flip (paired permutation) p-value of mean(d) = 0: the share of the 2^n sign
    assignments of the paired differences whose |mean| reaches the observed one (scipy.stats.permutation_test,
    permutation_type='samples'). Up to ``SIGN_FLIP_EXACT_MAX`` pairs every assignment is enumerated, so the p is
    exact and cannot go below 2 / 2^n (0.25 at n = 3, 0.0625 at n = 5); above it (2^n assignments would not fit
    in memory: 2^42 for 42 pairs) it is estimated from ``SIGN_FLIP_RESAMPLES`` random assignments drawn with a
    fixed seed, so it is reproducible. It needs no normality. NaN below two pairs, when every difference
    is 0, or when a difference is not finite."""
    from scipy import stats

    d = np.asarray(d, dtype=np.float64)
    if len(d) < 2 or not np.any(d != 0) or not np.isfinite(d).all():
        return math.nan
    exact = len(d) <= SIGN_FLIP_EXACT_MAX
    res = stats.permutation_test((d, np.zeros_like(d)), lambda x, y, axis=-1: np.mean(x - y, axis=axis),
                                 permutation_type="samples", vectorized=True,
                                 n_resamples=math.inf if exact else SIGN_FLIP_RESAMPLES, batch=8192,
                                 alternative="two-sided", rng=np.random.default_rng(0))
    return float(min(1.0, res.pvalue))


def fieller_interval(num: np.ndarray, den: np.ndarray, level: float = CI_LEVEL) -> tuple[float, float, str]:
    """Fieller's interval of the ratio mean(num) / mean(den) over paired seeds (row i of both is one seed): the
    ratios r for which the paired t-test of num - r den does not reject at 1 - ``level``, i.e. the r with
    (a - r b)^2 <= t^2 (v_aa - 2 r v_ab + r^2 v_bb), a and b the means, v the (co)variances of the means (ddof=1,
    over n) and t = t_{(1+level)/2, n-1}. With normal per-seed noise it covers at exactly ``level`` for any n >= 2.
    Returns (low, high, kind): ``bounded`` ([low, high]); ``exclusive`` (the denominator is not distinguishable
    from 0 but the data rule out a band: every r <= low or >= high); ``unbounded`` (every r; low, high = -inf,
    inf). NaNs and ``none`` below two seeds."""
    from scipy import stats

    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    n = len(num)
    if n < 2:
        return math.nan, math.nan, "none"
    t2 = float(stats.t.ppf(0.5 + level / 2.0, n - 1)) ** 2
    a, b = float(num.mean()), float(den.mean())
    cov = np.cov(np.vstack([num, den]), ddof=1) / n
    v_aa, v_ab, v_bb = float(cov[0, 0]), float(cov[0, 1]), float(cov[1, 1])
    qa, qb, qc = b * b - t2 * v_bb, a * b - t2 * v_ab, a * a - t2 * v_aa  # qa r^2 - 2 qb r + qc <= 0
    disc = qb * qb - qa * qc
    scale = max(b * b, t2 * v_bb, 1e-300)
    if qa > 1e-12 * scale:
        root = math.sqrt(max(disc, 0.0))
        return (qb - root) / qa, (qb + root) / qa, "bounded"
    if qa < -1e-12 * scale and disc > 0:
        r1, r2 = sorted(((qb + math.sqrt(disc)) / qa, (qb - math.sqrt(disc)) / qa))
        return r1, r2, "exclusive"
    return -math.inf, math.inf, "unbounded"


def in_fieller(r: float, low: float, high: float, kind: str) -> bool:
    """Whether the ratio ``r`` lies in a :func:`fieller_interval` result."""
    if kind == "bounded":
        return low <= r <= high
    if kind == "exclusive":
        return r <= low or r >= high
    return kind == "unbounded"


def paired_t_power(effect: float, n: int, alpha: float = ALPHA) -> float:
    """The power of the two-sided paired t-test at ``alpha`` on n seeds when the mean paired difference is
    ``effect`` standard deviations of the differences: P(|T| > t_{1-alpha/2, n-1}) with T noncentral t on n - 1
    degrees of freedom, noncentrality effect * sqrt(n). NaN below two seeds."""
    from scipy import stats

    if n < 2:
        return math.nan
    df, nc = n - 1, abs(effect) * math.sqrt(n)
    crit = float(stats.t.ppf(1.0 - alpha / 2.0, df))
    upper = float(stats.nct.sf(crit, df, nc))
    lower = float(stats.nct.cdf(-crit, df, nc))  # below 1e-15 where it matters; scipy returns NaN far out (df = 1)
    return upper + (lower if math.isfinite(lower) else 0.0)


@functools.lru_cache(maxsize=4096)
def detectable_multiplier(n: int, power: float = POWER, alpha: float = ALPHA) -> float:
    """The smallest mean paired difference, in units of the differences' standard deviation, that a two-sided
    paired t-test at ``alpha`` on n seeds detects with probability ``power``: the root of
    :func:`paired_t_power` (effect, n) = power, exact under normal differences (the noncentral t). The usual
    sizing (t_{1-alpha/2, n-1} + t_{power, n-1}) / sqrt(n) approximates it and falls short at few seeds: it gives
    73% power at n = 2, 77% at 3, 79% at 5. NaN below two seeds; 0 when ``power`` <= ``alpha``."""
    from scipy import optimize, stats

    if n < 2:
        return math.nan
    if power <= alpha:
        return 0.0
    guess = float((stats.t.ppf(1.0 - alpha / 2.0, n - 1) + stats.t.ppf(power, n - 1)) / math.sqrt(n))
    high = max(guess, 1e-3)
    while paired_t_power(high, n, alpha) < power:
        high *= 1.5
    return float(optimize.brentq(lambda e: paired_t_power(e, n, alpha) - power, 0.0, high, xtol=1e-12,
                                 rtol=1e-12))


def min_detectable_share(sd_diff: float, gap: float, n: int, power: float = POWER, alpha: float = ALPHA) -> float:
    """The smallest recovered share a paired test against stale on n seeds detects at ``power``:
    :func:`detectable_multiplier` (n) * sd_diff / |gap|, sd_diff the sample (ddof=1) standard deviation of the
    per-seed differences method - stale and gap the stale - sync gap. NaN below two seeds, without a gap, and
    where the differences do not vary (sd_diff 0: the t-test the verdicts read has no p-value then)."""
    if n < 2 or not math.isfinite(sd_diff) or sd_diff <= 0 or not math.isfinite(gap) or gap == 0:
        return math.nan
    return detectable_multiplier(n, power, alpha) * sd_diff / abs(gap)


def seeds_needed(sd_diff: float, gap: float, target: float, power: float = POWER, alpha: float = ALPHA,
                 most: int = 1000) -> int | None:
    """The fewest seeds n >= 2 at which :func:`min_detectable_share` (sd_diff, gap, n) <= ``target``; None when
    more than ``most`` would be needed (or the noise or gap is unknown)."""
    if not (math.isfinite(sd_diff) and math.isfinite(gap)) or sd_diff <= 0 or gap == 0 or target <= 0:
        return None
    if min_detectable_share(sd_diff, gap, most, power, alpha) > target:
        return None
    low, high = 1, most  # the share falls as n grows: the fewest n is found by bisection
    while high - low > 1:
        mid = (low + high) // 2
        if min_detectable_share(sd_diff, gap, mid, power, alpha) <= target:
            high = mid
        else:
            low = mid
    return high


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
    row.update({"n": len(common), "share_ci_low": None, "share_ci_high": None, "share_ci_kind": None,
                "vs_stale_diff": None, "vs_stale_ci_low": None, "vs_stale_ci_high": None, "vs_stale_p": None,
                "vs_stale_p_signflip": None, "vs_stale_n": len(paired), "sd_diff": None,
                "min_detectable_share": None})
    if paired:
        d, _ = oriented_difference(meth, stale, higher)  # > 0: the method is better
        sd = d["sd"]  # the same whichever way round the differences are taken
        row.update({"vs_stale_diff": d["diff"], "vs_stale_ci_low": d["ci_low"], "vs_stale_ci_high": d["ci_high"],
                    "vs_stale_p": d["p"], "vs_stale_p_signflip": d.get("p_signflip"), "sd_diff": sd})
        if not row.get("missing") and not row["no_gap"]:
            row["min_detectable_share"] = min_detectable_share(sd, row["gap"], len(paired))
    if not row.get("missing") and not row["no_gap"]:
        x_sync, x_stale, x_meth = (np.array([g[k] for k in common]) for g in (sync, stale, meth))
        low, high, kind = fieller_interval(x_stale - x_meth, x_stale - x_sync)
        if kind == "exclusive":  # every share outside (low, high): the interval is the whole line but that band
            row["share_ci_excluded"] = [low, high]
            low, high = -math.inf, math.inf
        row.update({"share_ci_low": low, "share_ci_high": high, "share_ci_kind": kind})
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
    stale adjusted by Holm's method over the rows returned (one family; :func:`holm_adjust`; build_report re-adjusts
    it within the suite's families: :func:`apply_families`); a method whose sync
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
        count = f"{key}_n"  # the seeds with a finite value, where a group counts them (the training reward)
        if min(sync.get(count, sync["n"]), stale.get(count, stale["n"])) < 2:
            se = math.nan
        else:
            se = math.sqrt(sum((x[std] or 0.0) ** 2 / (x.get(count, x["n"]) - 1) for x in (sync, stale)))
        paired = _unequal_seed_means(seeds, g["task"], g["method"], g["staleness"]) if seeds is not None else None
        if paired:  # the seed sets differ: the share on the seeds its interval pairs
            n_paired, sync_v, stale_v, value, se = paired
        gap = stale_v - sync_v
        if not math.isfinite(gap):  # a group without a finite value: no gap to read, not "no gap"
            if cells is not None:
                rows.append(_with_ci({
                    "task": g["task"], "method": g["method"], "staleness": g["staleness"], "share": math.nan,
                    "sync": sync_v, "stale": stale_v, "value": value, "no_gap": True, "gap": math.nan,
                    "gap_se": math.nan, "gap_within_noise": None,
                    "missing": [f"finite {name}" for name, x in (("sync", sync_v), ("stale", stale_v))
                                if not math.isfinite(x)]},
                    seeds, key, higher))
            continue
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
    equal to stale_cost. On the training reward (``reward_last``) both also hold the lag of s policy versions (the
    reward at s is θ_{t−s}'s), so there the first has the cost of s versions of its own learning curve."""
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
    """Whether a recovered-share row's paired test against stale rejects at ``alpha`` after Holm's adjustment within
    its family (``vs_stale_p_adj``: :func:`apply_families`, or over the rows of one :func:`recovered_shares` call)."""
    return row.get("vs_stale_p_adj") is not None and row["vs_stale_p_adj"] < alpha


def headline_shares(shares: list[dict], reward_shares: list[dict],
                    aligned: list[dict] | None = None) -> list[dict]:
    """The recovered-share rows on the measure the summary reads for each task: the reward by policy version
    (``aligned``: :func:`aligned_shares`) for a task that has it, else the training reward (``reward_shares``) for
    a task that has it (rollout objectives), else the final metric (``shares``). Copies, each with ``measure``
    (``by_version``, ``reward_last`` or ``final``)."""
    aligned = aligned or []
    versioned = {r["task"] for r in aligned}
    rewarded = {r["task"] for r in reward_shares} | versioned
    return ([{**r, "measure": "by_version"} for r in aligned]
            + [{**r, "measure": "reward_last"} for r in reward_shares if r["task"] not in versioned]
            + [{**r, "measure": "final"} for r in shares if r["task"] not in rewarded])


#: The share of a run's policy versions that the version-aligned measure averages (as ``reward_last``: 20%)
VERSION_WINDOW = 0.2
#: summary.md's name of each version-aligned measure
VERSION_MEASURES = {POLICY_REWARD: "held-out reward of the policy theta_t itself (eval/policy_reward)",
                    "reward/mean": "training reward indexed by the policy version that sampled it"}


def aligned_values(cells: list[dict], task: str, s: int, on_policy: bool = False) -> dict | None:
    """The version-aligned measure of one comparison: sync, stale at ``s`` and every other (non-ablation) method at
    ``s`` on ``task`` (``on_policy``: and every method other than sync and stale at s = 0, the on-policy controls).
    Its measure is ``eval/policy_reward`` where every run of the comparison logs it, else the
    training reward indexed by policy version (:func:`gacbench.bench.records.by_version`); its window is the last
    W versions that every sync and stale run has, W = VERSION_WINDOW of sync's versions (at least one): versions
    hi - W + 1 .. hi (from 0 at least), hi the smallest last version of those reference runs, so that one method's
    short run does not move the window of every comparison. A run that stopped before the window (a non-finite
    loss ends a run early) counts at its first version's value, as ``final_mean`` counts a diverged run at its
    starting value. Returns {measure, versions: [lo, hi], seeds: {(task, method, s'): {seed: mean over the
    window}}}, or None where a run lacks versioned rewards or the comparison lacks sync or stale."""
    runs = [c for c in cells if c["status"] == "done" and c["task"] == task and not c.get("ablation")
            and ((c["method"] == "sync" and c["staleness"] == 0) or (c["staleness"] == s and c["method"] != "sync")
                 or (on_policy and c["staleness"] == 0 and c["method"] not in REFERENCE_METHODS))]
    if not any(c["method"] == "sync" for c in runs) or not any(c["method"] == "stale" for c in runs):
        return None
    if not all(c.get("_by_version", {}).get("reward/mean") for c in runs):
        return None
    measure = POLICY_REWARD if all(POLICY_REWARD in c["_by_version"] for c in runs) else "reward/mean"
    series = [(c, c["_by_version"][measure]) for c in runs]
    hi = min(max(v) for c, v in series if c["method"] in REFERENCE_METHODS)
    n_sync = max(len(c["_by_version"]["reward/mean"]) for c in runs if c["method"] == "sync")
    lo = max(0, hi - max(1, int(n_sync * VERSION_WINDOW)) + 1)
    seeds: dict[tuple, dict[int, float]] = {}
    for c, v in series:
        window = [x for version, x in v.items() if lo <= version <= hi and math.isfinite(x)]
        if not window and v and max(v) < lo:  # stopped before the window: counted at its starting value
            window = [x for _, x in sorted(v.items()) if math.isfinite(x)][:1]
        if window:
            seeds.setdefault((task, c["method"], c["staleness"]), {})[c["seed"]] = float(np.mean(window))
    return {"measure": measure, "versions": [lo, hi], "seeds": seeds}


def aligned_shares(groups: list[dict], cells: list[dict]) -> list[dict]:
    """The recovered shares on the version-aligned measure (:func:`aligned_values`), one row per stabilizer and
    s > 0 of a rollout task: the means of sync, stale and the method over the seeds all three ran, the gap and
    share as in :func:`recovered_shares` (larger is better), the same intervals and tests (``_with_ci``), and
    ``source`` / ``source_name`` (which reward), ``versions`` (the window) and ``lag_removed`` (s: the lag
    between the policy that is trained and the one whose reward the training reward logs)."""
    rows, cache = [], {}
    for g in groups:
        task, m, s = g["task"], g["method"], g["staleness"]
        if m in REFERENCE_METHODS or g["ablation"] or s == 0 or "reward_last_mean" not in g:
            continue
        if (task, s) not in cache:
            cache[(task, s)] = aligned_values(cells, task, s)
        al = cache[(task, s)]
        if al is None:
            continue
        seeds = {k: al["seeds"].get(k, {}) for k in ((task, "sync", 0), (task, "stale", s), (task, m, s))}
        common = sorted(set.intersection(*(set(v) for v in seeds.values())))
        if not common:
            continue
        x_sync, x_stale, x_m = (np.array([v[k] for k in common]) for v in seeds.values())
        n = len(common)
        sync_v, stale_v, value = float(x_sync.mean()), float(x_stale.mean()), float(x_m.mean())
        gap = stale_v - sync_v
        se = math.sqrt((x_sync.var(ddof=1) + x_stale.var(ddof=1)) / n) if n >= 2 else math.nan
        no_gap = not (abs(gap) > 1e-12 and gap < 0)
        row = {"task": task, "method": m, "staleness": s, "share": math.nan if no_gap else (stale_v - value) / gap,
               "sync": sync_v, "stale": stale_v, "value": value, "no_gap": no_gap, "gap": gap, "gap_se": se,
               "gap_within_noise": None if math.isnan(se) else bool(abs(gap) < 2.0 * se),
               "source": al["measure"], "source_name": VERSION_MEASURES[al["measure"]],
               "versions": al["versions"], "lag_removed": s}
        rows.append(_with_ci(row, seeds, "by_version", True))
    for row, adj in zip(rows, holm_adjust([r["vs_stale_p"] for r in rows])):
        row["vs_stale_p_adj"] = adj
    return rows


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


#: The tests a family can hold, each with the keys of its raw and adjusted p in a row: ``vs_stale`` (a method
#: against stale at its s: the recovered-share tables), ``vs_sync`` (a stabilizer at s = 0 against sync: the
#: on-policy controls), ``cost`` (a method at s against its own s = 0 run: the staleness costs), ``beyond`` (a
#: method's gain over stale at s against its on-policy effect: the shares beyond the on-policy effect,
#: :mod:`gacbench.bench.beyond`) and ``ablation`` (a threshold setting against stale: the threshold ablation)
FAMILY_TESTS = {"vs_stale": ("vs_stale_p", "vs_stale_p_adj"), "vs_sync": ("vs_sync_p", "vs_sync_p_adj"),
                "cost": ("cost_p", "cost_p_adj"), "beyond": ("beyond_p", "beyond_p_adj"),
                "ablation": ("vs_stale_p", "vs_stale_p_adj")}
#: What a family can be split by: one family per task, per measure (``final``, ``reward_last``, ``by_version``)
#: and/or per staleness
FAMILY_DIMS = ("task", "measure", "staleness")
#: The families a suite that declares none gets, by question: does each method recover the gap at this s (every
#: method against stale at one s, on one measure); is there an on-policy effect; what does staleness cost each
#: method; does each method recover the gap beyond its on-policy effect at this s; which threshold setting helps
DEFAULT_FAMILIES = {
    "recovers the gap at s": {"test": "vs_stale", "per": ["task", "measure", "staleness"]},
    "on-policy effect": {"test": "vs_sync", "per": ["task", "measure"]},
    "staleness cost": {"test": "cost", "per": ["task", "measure"]},
    "recovers beyond the on-policy effect at s": {"test": "beyond", "per": ["task", "measure", "staleness"]},
    "threshold ablation": {"test": "ablation", "per": ["task", "measure"]},
}


def resolve_families(declared: dict | None) -> dict[str, dict]:
    """The families of a suite: its declared ones (checked by :func:`gacbench.bench.validate.check_families`), and
    for each test they leave out, the default family of that test (:data:`DEFAULT_FAMILIES`)."""
    declared = dict(declared or {})
    tests = {f["test"] for f in declared.values()}
    return {**declared, **{name: f for name, f in DEFAULT_FAMILIES.items() if f["test"] not in tests}}


def apply_families(tables: list[tuple[str, str, list[dict]]], families: dict[str, dict] | None) -> list[dict]:
    """Holm-adjust every test of ``tables`` (each (test, measure, rows): a test of :data:`FAMILY_TESTS`, the measure
    its rows are read on, and the rows) within its family: the family of its test (:func:`resolve_families`),
    split by the family's ``per`` keys. Each row gets ``family`` (the family's name) and its one adjusted p (the
    test's adjusted key), replacing any per-table adjustment. Returns one entry per family instance: its name,
    test, per, the values it is split on (``of``), its size ``m`` (the tests with a p-value) and its comparisons
    (``TASK / METHOD / s=S / MEASURE``)."""
    fams = resolve_families(families)
    by_test = {f["test"]: (name, f) for name, f in fams.items()}
    instances: dict[tuple, list[tuple[dict, str]]] = {}
    for test, measure, rows in tables:
        name, fam = by_test[test]
        for r in rows:
            of = tuple((k, measure if k == "measure" else r[k]) for k in fam["per"])
            instances.setdefault((name, of), []).append((r, measure))
    out = []
    for (name, of), members in instances.items():
        test = fams[name]["test"]
        p_key, adj_key = FAMILY_TESTS[test]
        adjusted = holm_adjust([r.get(p_key) for r, _ in members])
        m = sum(adj is not None for adj in adjusted)
        for (r, _), adj in zip(members, adjusted):
            r[adj_key], r["family"] = adj, name
            if test in ("vs_stale", "beyond") and m and r.get("min_detectable_share") is not None:
                # at Holm's first step, alpha / m: the share that a single real effect among the family's m tests
                # needs to be declared with 80% power (at alpha per test it is declared less often)
                n = r.get("vs_stale_n") if test == "vs_stale" else r.get("n")
                r["min_detectable_share_family"] = min_detectable_share(
                    r.get("sd_diff") or 0.0, r.get("gap", math.nan), n or 0, alpha=ALPHA / m)
        out.append({"name": name, "test": test, "per": list(fams[name]["per"]), "of": dict(of),
                    "m": m,
                    "comparisons": [f"{r['task']} / {r['method']} / s={r['staleness']} / {measure}"
                                    for r, measure in members]})
    return out
