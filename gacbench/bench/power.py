"""``gacbench power``: how many seeds a recovered share needs to be detectable, from a pilot grid's noise.

For every recovered-share entry of the pilot grid's summary (the headline measure:
:func:`~gacbench.bench.stats.headline_shares`), the paired noise of its seeds (sd of method - stale) and its
stale - sync gap give the smallest share that n seeds detect with the given power at level alpha
(:func:`~gacbench.bench.stats.min_detectable_share`); the command prints, per entry, that share at the pilot's n
and the fewest seeds at which it falls to the target (:func:`~gacbench.bench.stats.seeds_needed`). A summary with
shares beyond the on-policy effect (:mod:`gacbench.bench.beyond`) adds one entry per such share on the headline
measure, sized from the noise of its difference-in-differences (``share``: ``beyond``; the others ``recovered``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from gacbench.bench.beyond import BEYOND_MEASURES, headline_beyond
from gacbench.bench.stats import (
    ALPHA,
    POWER,
    detectable_multiplier,
    headline_shares,
    min_detectable_share,
    seeds_needed,
)
from gacbench.jsonio import json_safe
from gacbench.usage import UsageError


def power_rows(summary: dict, target: float, power: float = POWER, alpha: float = ALPHA) -> list[dict]:
    """Per recovered-share entry of ``summary`` (summary.json) on its headline measure, then per share beyond the
    on-policy effect on its headline measure: task, method, s, measure, ``share`` (``recovered`` or ``beyond``),
    the pilot's seeds ``n``, ``sd_diff`` (of method - stale, or of the difference-in-differences), ``gap`` (the
    size of the stale - sync gap the share is a fraction of, > 0: both kinds of entry carry it with the same
    orientation), ``min_detectable_share`` at n (NaN where the differences do not vary: no t-test then),
    ``seeds_needed`` for ``target`` (None where the noise or gap is unknown or 0, or more than 1000 seeds would be
    needed), ``no_gap`` and ``min_detectable_difference`` at n (:func:`detectable_multiplier` (n) x sd_diff, in the
    measure's units). An entry without a gap (stale no worse than sync) has no share to size: its share and seeds
    needed are NaN and None, and its detectable difference says what its seeds could have seen."""
    rows = [(r, "recovered", r.get("vs_stale_n") or 0) for r in headline_shares(
        summary.get("recovered", []), summary.get("recovered_reward", []), summary.get("recovered_by_version"))]
    beyond = headline_beyond({key: summary.get(f"beyond_on_policy{suffix}", []) for suffix, key, _ in BEYOND_MEASURES})
    rows += [(r, "beyond", r.get("n") or 0) for r in beyond]
    out = []
    for r, kind, n in rows:
        sd, gap = r.get("sd_diff"), r.get("gap")
        if r.get("missing") or sd is None or gap is None:
            continue
        no_gap = bool(r.get("no_gap"))
        spread = math.isfinite(sd) and sd > 0 and n >= 2
        out.append({"task": r["task"], "method": r["method"], "staleness": r["staleness"], "measure": r["measure"],
                    "share": kind, "n": n, "sd_diff": sd, "gap": abs(gap), "no_gap": no_gap,
                    "min_detectable_share": math.nan if no_gap else min_detectable_share(sd, gap, n, power, alpha),
                    "seeds_needed": None if no_gap else seeds_needed(sd, gap, target, power, alpha),
                    "min_detectable_difference": detectable_multiplier(n, power, alpha) * sd if spread else math.nan})
    return out


def main(args) -> int:
    root = Path(args.runs)
    path = root / "summary.json"
    if not path.is_file():
        raise UsageError(f"--runs: {path} does not exist; run gacbench report {root} on the pilot grid first")
    for name, value, lo, hi in (("--target-share", args.target_share, 0.0, math.inf), ("--power", args.power, 0.0, 1.0),
                                ("--alpha", args.alpha, 0.0, 1.0)):
        if not lo < value < hi:
            raise UsageError(f"{name}: {value} must lie strictly between {lo:g} and {hi:g}")
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--runs: {path} cannot be read as a summary ({type(exc).__name__}: {exc}); rebuild it with "
                         f"gacbench report {root}") from None
    if not isinstance(summary, dict):
        raise UsageError(f"--runs: {path} holds a JSON {type(summary).__name__}, not a summary; rebuild it with "
                         f"gacbench report {root}")
    rows = power_rows(summary, args.target_share, args.power, args.alpha)
    if not rows:
        raise UsageError(f"--runs: {path} has no recovered share with paired seeds to size from")
    if args.json:
        print(json.dumps(json_safe(rows), indent=2, allow_nan=False))  # strict JSON: NaN written as null
        return 0
    print(f"seeds for a detectable share of {args.target_share:g} (power {args.power:g}, two-sided alpha "
          f"{args.alpha:g}; noise and gap from {path}):")
    sized = [r for r in rows if not r["no_gap"]]
    if sized:
        print(f"{'task':24s} {'method':22s} {'s':>3s}  {'measure':11s} {'share':9s} {'pilot n':>7s} {'sd(diff)':>9s} "
              f"{'|gap|':>8s} {'min. det. at n':>14s} {'seeds needed':>12s}")
    for r in sized:
        flat = not (math.isfinite(r["sd_diff"]) and r["sd_diff"] > 0)  # no spread: no t-test at any n
        needed = "— (sd 0)" if flat else "> 1000" if r["seeds_needed"] is None else str(r["seeds_needed"])
        mds = "—" if math.isnan(r["min_detectable_share"]) else f"{r['min_detectable_share']:.3g}"
        print(f"{r['task'][:24]:24s} {r['method'][:22]:22s} {r['staleness']:3d}  {r['measure']:11s} {r['share']:9s} "
              f"{r['n']:7d} {r['sd_diff']:9.3g} {r['gap']:8.3g} {mds:>14s} {needed:>12s}")
    known = [r["seeds_needed"] for r in sized if r["seeds_needed"] is not None]
    flat = sum(not (math.isfinite(r["sd_diff"]) and r["sd_diff"] > 0) for r in sized)
    many = len(sized) - len(known) - flat
    if known:
        every = "every entry" if len(known) == len(sized) else f"{len(known)} of the {len(sized)} entries"
        print(f"{every} detectable at {args.target_share:g}: {max(known)} seeds"
              + (f" ({many} entries need more than 1000)" if many else "")
              + (f" ({flat} entries have no seed-to-seed spread: no paired test at any n)" if flat else ""))
    gapless = [r for r in rows if r["no_gap"]]
    if gapless:
        print(f"\n{len(gapless)} entries have no stale − sync gap (stale no worse than sync): no share to size; the "
              "smallest difference their seeds detect (power and alpha as above), of method − stale for a "
              "'recovered' entry and of the difference beyond the on-policy effect, (method_s − stale) − "
              "(method_0 − sync), for a 'beyond' entry:")
        print(f"{'task':24s} {'method':22s} {'s':>3s}  {'measure':11s} {'share':9s} {'pilot n':>7s} {'sd(diff)':>9s} "
              f"{'min. det. difference':>20s}")
        for r in gapless:
            mdd = "—" if math.isnan(r["min_detectable_difference"]) else f"{r['min_detectable_difference']:.3g}"
            print(f"{r['task'][:24]:24s} {r['method'][:22]:22s} {r['staleness']:3d}  {r['measure']:11s} "
                  f"{r['share']:9s} {r['n']:7d} {r['sd_diff']:9.3g} {mdd:>20s}")
    return 0
