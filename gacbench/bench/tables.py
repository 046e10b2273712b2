"""summary.md: the markdown tables of a benchmark directory's summary."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np

from gacbench.bench.beyond import BEYOND_MEASURES
from gacbench.bench.groups import nanmean, per_seed
from gacbench.bench.records import DEGRADE_MARGIN, DEGRADE_SIGMAS, DEGRADE_WINDOW, DIAGNOSTICS
from gacbench.bench.regime import PAPER_TABLE3, law_points
from gacbench.bench.stats import (
    CI_LEVEL,
    ablation_key,
    ablation_share_rows,
    mean_t_interval,
    significant,
)


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.{digits}g}"


def fmt_share(x: float) -> str:
    """A share to two decimals, one that rounds to zero as 0.00 (never -0.00)."""
    return f"{round(x, 2) + 0.0:.2f}"


def fmt_ci(low: float | None, high: float | None, digits: int = 2) -> str:
    if low is None or high is None or (isinstance(low, float) and math.isnan(low)):
        return "—"
    return f"[{fmt(low + 0.0, digits)}, {fmt(high + 0.0, digits)}]"  # + 0.0: no "-0"


def fmt_share_ci(r: dict, digits: int = 2) -> str:
    """A share's Fieller interval (:func:`~gacbench.bench.stats.fieller_interval`): ``[a, b]``; ``(−∞, a] ∪ [b, ∞)``
    where the gap is not distinguishable from 0 but a band is ruled out; ``(−∞, ∞)`` where nothing is; — without
    one."""
    kind = r.get("share_ci_kind")
    if kind == "unbounded":
        return "(−∞, ∞)"
    if kind == "exclusive" and r.get("share_ci_excluded"):
        a, b = r["share_ci_excluded"]
        return f"(−∞, {fmt(a + 0.0, digits)}] ∪ [{fmt(b + 0.0, digits)}, ∞)"
    return fmt_ci(r.get("share_ci_low"), r.get("share_ci_high"), digits)


def mean_sd(mean: float | None, sd: float | None, n: int, digits: int = 4, sd_digits: int = 2) -> str:
    """``mean ± sd`` over seeds (the groups' population sd, ddof 0), or ``mean (n = 1)`` for a single seed (no
    spread to show)."""
    return f"{fmt(mean, digits)} (n = 1)" if n < 2 else f"{fmt(mean, digits)} ± {fmt(sd, sd_digits)}"


def _reward_sd(g: dict) -> str:
    """A group's training reward, mean ± sd over its seeds with a finite reward."""
    return mean_sd(g["reward_last_mean"], g["reward_last_std"], g.get("reward_last_n", g["n"]), 3)


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
             "Min. detectable share: the smallest share a paired test against stale on these seeds detects with 80% "
             "power at α = 0.05, δ_n · sd(method − stale) / |gap|, δ_n the effect in standard deviations at which "
             "the paired t-test on n seeds has exactly 80% power (the noncentral t; docs/bench.md).", "",
             "| task | s | method | sync | stale | method | share | min. detectable share |",
             "|---|---|---|---|---|---|---|---|"]
    for r in shares:
        if r.get("missing"):
            continue
        share = "n/a (stale no worse than sync)" if r["no_gap"] else fmt_share(r['share'])
        if not r["no_gap"] and r["gap_within_noise"]:
            share += " (gap < 2 s.e. of seeds: not meaningful)"
        elif not r["no_gap"] and r["gap_within_noise"] is None:
            share += " (one seed: noise unknown)"
        if r.get("paired_seeds"):
            share += f" (means over the {r['paired_seeds']} seeds all three ran)"
        lines.append(f"| {r['task']} | {r['staleness']} | {r['method']} | {fmt(r['sync'], 4)} | "
                     f"{fmt(r['stale'], 4)} | "
                     f"{fmt(r['value'], 4)} | {share} | {fmt(r.get('min_detectable_share'), 2)} |")
    return lines + [""]


def _on_policy_table(measure: str, rows: list[dict]) -> list[str]:
    """The on-policy controls on one measure: each stabilizer at s = 0 against sync, paired over seeds."""
    if not rows:
        return []
    lines = ["", f"## On-policy controls: stabilizers at s = 0 against sync, {measure}", "",
             "The paired difference method − sync over the seeds both ran (> 0: the method is better), its 95% "
             "t-interval and paired t-test; p_adj: Holm within its family (Multiplicity families, below); * where "
             "p_adj < 0.05. An effect here "
             "does not need staleness.", "",
             "| task | method | sync | method | difference [95% CI] | p | p_adj | seeds |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        star = " *" if r.get("vs_sync_p_adj") is not None and r["vs_sync_p_adj"] < 0.05 else ""
        lines.append(f"| {r['task']} | {r['method']} | {fmt(r['sync'], 4)} | {fmt(r['value'], 4)} | "
                     f"{fmt(r['vs_sync_diff'], 3)} {fmt_ci(r['vs_sync_ci_low'], r['vs_sync_ci_high'], 3)}{star} | "
                     f"{fmt(r['vs_sync_p'], 2)} | {fmt_p(r.get('vs_sync_p_adj'))} | {r['n']} |")
    return lines + [""]


def _cost_table(measure: str, rows: list[dict]) -> list[str]:
    """What staleness costs each on-policy method against its own s = 0 run, beside sync − stale."""
    if not rows:
        return []
    lag = (" On the training reward a run at s logs the reward of θ_{t−s}, so both columns also hold s policy "
           "versions of measurement lag: there a method that removes staleness's harm has the cost of s versions of "
           "its own learning curve (0 only where the reward has stopped rising); the reward by policy version reads "
           "without that lag." if "reward" in measure else "")
    lines = ["", f"## What staleness costs a method against its own on-policy run, {measure}", "",
             "cost: the method at s = 0 minus the method at s, paired over seeds (> 0: staleness hurts), with its "
             "95% t-interval, p and p adj. (Holm within its family); beside it sync − stale at the same s. A method "
             f"that removes staleness's harm has cost 0 while sync − stale stays.{lag}", "",
             "| task | method | s | cost [95% CI] | p | p adj. | seeds | sync − stale [95% CI] | seeds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['task']} | {r['method']} | {r['staleness']} | {fmt(r['cost'], 3)} "
                     f"{fmt_ci(r['cost_ci_low'], r['cost_ci_high'], 3)} | {fmt(r['cost_p'], 2)} | "
                     f"{fmt_p(r.get('cost_p_adj'))} | {r['n']} | "
                     f"{fmt(r['stale_cost'], 3)} {fmt_ci(r['stale_cost_ci_low'], r['stale_cost_ci_high'], 3)} | "
                     f"{r['stale_n']} |")
    return lines + [""]


def _beyond_section(tables: dict[str, list[dict]], uncontrolled: list[dict]) -> list[str]:
    """The share of the gap each method removes beyond its on-policy effect (``tables``: measure -> rows of
    :func:`~gacbench.bench.beyond.beyond_on_policy`, headline measure first), and the methods left without one."""
    if not tables and not uncontrolled:
        return []
    titles = {key: title for _, key, title in BEYOND_MEASURES}
    lines = []
    for key, rows in tables.items():
        sources = sorted({r["source"] for r in rows if r.get("source")})
        lines += ["", f"## Recovered share beyond the on-policy effect, {titles[key]}"
                  + (f" ({', '.join(sources)})" if sources else ""), "",
                  "Per seed, larger is better: d = (method at s − stale at s) − (control − sync), g = sync − stale at "
                  "s; share beyond = mean(d) / mean(g) with its 95% Fieller interval, p the paired t-test of "
                  "mean(d) = 0, p adj. Holm within its family (* where < 0.05). The control is the method at s = 0, "
                  "or sync where the method's update at s = 0 is sync's (its on-policy effect is then 0 and the "
                  "share beyond is its raw share). Raw share: (method − stale) / (sync − stale) on the same seeds; "
                  "on-policy effect: mean(control − sync); gap: mean(g).", "",
                  "| task | s | method | control | share beyond the on-policy effect [95% CI] | p | p adj. | "
                  "raw share | on-policy effect | gap | min. detectable share | seeds |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r["no_gap"]:
                share = "n/a (stale no worse than sync)"
            else:
                ci = fmt_share_ci({"share_ci_kind": r["beyond_ci_kind"], "share_ci_low": r["beyond_ci_low"],
                                   "share_ci_high": r["beyond_ci_high"],
                                   "share_ci_excluded": r.get("beyond_ci_excluded")})
                star = " *" if r.get("beyond_p_adj") is not None and r["beyond_p_adj"] < 0.05 else ""
                share = f"{fmt_share(r['beyond_on_policy_share'])} {ci}{star}"
            lines.append(f"| {r['task']} | {r['staleness']} | {r['method']} | {r['control']} | {share} | "
                         f"{fmt(r['beyond_p'], 2)} | {fmt_p(r.get('beyond_p_adj'))} | {fmt(r['raw_share'], 2)} | "
                         f"{fmt(r['on_policy_effect'], 3)} | {fmt(r['gap'], 3)} | "
                         f"{fmt(r.get('min_detectable_share'), 2)} | {r['n']} |")
    if uncontrolled:
        listed = "; ".join(f"{u['method']} ({u['task']}, s = {', '.join(map(str, u['staleness']))})"
                           for u in uncontrolled)
        lines += ["", f"No share beyond the on-policy effect (no s = 0 cells, and an update at s = 0 that is not "
                      f"sync's): {listed}. Their raw share only, in the recovered-share tables."]
    return lines + [""]


def _regime_checks_section(checks: list[dict]) -> list[str]:
    """The regime criteria recomputed from the cells (:func:`~gacbench.bench.beyond.regime_checks`)."""
    if not checks:
        return []
    yes = {True: "yes", False: "no", None: "—"}
    lines = ["", "## Regime checks: does sync learn, does stale lose a gap?", "",
             "On the policy's own reward (eval/policy_reward), per seed, then the mean over seeds, its standard error "
             "(sd / √n) and the mean in standard errors; a criterion holds at "
             f"{checks[0]['threshold_se']:g} standard errors or more. Sync's rise: its last eval point minus its "
             "first; stale's gap: sync − stale at s on the version-aligned measure, paired over seeds.", "",
             "| task | criterion | mean | s.e. | in s.e. | holds | seeds |", "|---|---|---|---|---|---|---|"]
    for c in checks:
        sync = c["sync"]
        span = (f"θ_{sync['first_version']} → θ_{sync['last_version']}" if sync["first_version"] is not None
                else "first → last eval point")
        lines.append(f"| {c['task']} | sync learns ({span}) | {fmt(sync['rise'], 3)} | {fmt(sync['rise_se'], 2)} | "
                     f"{fmt(sync['rise_in_se'], 2)} | {yes[sync['learns']]} | {sync['n']} |")
        for x in c["stale"]:
            lines.append(f"| {c['task']} | stale loses a gap at s = {x['staleness']} (versions "
                         f"{x['versions'][0]}-{x['versions'][1]}) | {fmt(x['gap'], 3)} | {fmt(x['gap_se'], 2)} | "
                         f"{fmt(x['gap_in_se'], 2)} | {yes[x['loses']]} | {x['n']} |")
    return lines + [""]


def _diagnostics_table(groups: list[dict]) -> list[str]:
    """Per group, the update diagnostics its cells logged (``DIAGNOSTICS``, means over seeds of each cell's mean
    after the warm-up) and GAC's share of changed steps; nothing when no group logged any."""
    keys = [k for k in (*DIAGNOSTICS, "gac_changed", "drift") if any(f"{k}_mean" in g for g in groups)]
    rows = [g for g in groups if any(f"{k}_mean" in g for k in keys)]
    if not rows:
        return []
    named = {"gac_changed": "GAC: steps changed", "drift": "drift ‖θ_T − θ_0‖"}
    titles = [DIAGNOSTICS[k][1] if k in DIAGNOSTICS else named[k] for k in keys]
    lines = ["", "## Update diagnostics, after the warm-up", "",
             "Each cell's mean over its steps after the warm-up, then the mean over seeds; GAC: the share of its "
             "steps it shrank, projected or skipped; drift: the distance from the starting parameters after the "
             "last step. — where the method does not log the value.", "",
             "| task | method | s | " + " | ".join(titles) + " | seeds |", "|---|---|---|" + "---|" * (len(keys) + 1)]
    for g in rows:
        vals = [fmt(g.get(f"{k}_mean"), 3) for k in keys]
        lines.append(f"| {g['task']} | {g['method']} | {g['staleness']} | " + " | ".join(vals) + f" | {g['n']} |")
    return lines


def markdown(cells: list[dict], groups: list[dict], shares: list[dict], root: Path,
             reward_shares: list[dict] | None = None, timing: dict | None = None,
             regime: list[dict] | None = None, ablation_rows: list[dict] | None = None,
             versions: list[dict] | None = None, mixed: list[dict] | None = None,
             on_policy: dict[str, list[dict]] | None = None, costs: dict[str, list[dict]] | None = None,
             sizes: list[dict] | None = None, size_trend: dict | None = None,
             aligned: list[dict] | None = None, families: list[dict] | None = None,
             beyond: dict[str, list[dict]] | None = None, uncontrolled: list[dict] | None = None,
             regime_checks: list[dict] | None = None, machine_blocks: dict | None = None,
             plugins: list[dict] | None = None, starts: list[dict] | None = None) -> str:
    """summary.md. ``ablation_rows``: the threshold ablation's recovered shares on its measure
    (:func:`ablation_key`), if already computed; ``versions`` and ``mixed``: the code versions of the cells and the
    groups that mix them (:mod:`gacbench.bench.versions`), listed at the end, and named at the top when there is
    more than one version. ``on_policy``: the on-policy controls (:func:`~gacbench.bench.stats.on_policy_controls`)
    per measure name; ``costs``: what staleness costs each of them (:func:`~gacbench.bench.stats.staleness_costs`)
    per measure name. ``sizes`` and ``size_trend``: the model-size table (:func:`~gacbench.bench.regime.size_points`)
    and its trend. ``aligned``: the shares on the version-aligned measure
    (:func:`~gacbench.bench.stats.aligned_shares`);
    ``families``: the multiplicity families (:func:`~gacbench.bench.stats.apply_families`), listed at the end.
    ``beyond``: the shares beyond the on-policy effect (:func:`~gacbench.bench.beyond.beyond_on_policy`) per measure,
    headline first, and ``uncontrolled`` the methods without a control; ``regime_checks``: the regime criteria
    (:func:`~gacbench.bench.beyond.regime_checks`), after the findings; ``machine_blocks``: the CPU kinds of a grid
    computed on several (:func:`~gacbench.bench.versions.machine_blocks`), named at the top; ``plugins``: the
    stabilizer plug-ins' code versions (:func:`~gacbench.bench.versions.plugin_versions`), listed with the code
    versions, a group whose seeds mix them named at the top; ``starts``: the initial weights each task's cells
    recorded (:func:`~gacbench.bench.versions.start_points`), listed with the code versions. The findings paragraph
    at the top reads the headline measure (:func:`findings`)."""
    lines = [f"# Benchmark summary: `{root}`", "",
             "Regenerate with `gacbench report " + str(root) + "` (add `--suite` and the name of the suite that made "
             "it where the folder holds no summary.json, as in a new clone). Definitions: see "
             "`gacbench/bench/report.py`.", ""]
    if machine_blocks and machine_blocks["blocked"]:
        lines += [_blocks_note(machine_blocks), ""]
    elif versions and len(versions) > 1:
        lines += [f"**This grid mixes {len(versions)} code versions** (listed under Code versions at the end): "
                  + _mixed_note(mixed or []), ""]
    elif mixed:  # one library environment: the seeds of a group ran different code of a plug-in
        lines += ["**This grid mixes the code of a stabilizer plug-in** (listed under Code versions at the end): "
                  + _mixed_note(mixed), ""]
    if machine_blocks and machine_blocks["mixed_seeds"]:
        lines += [f"**{_mixed_seeds_note(machine_blocks)}**", ""]
    lines += findings(shares, reward_shares or [], aligned or [])
    lines += _regime_checks_section(regime_checks or [])
    tasks = sorted({g["task"] for g in groups})
    main = [g for g in groups if not g["ablation"]]
    for task in tasks:
        tg = [g for g in main if g["task"] == task]
        if not tg:
            continue
        metric, hib = tg[0]["metric"], tg[0]["higher_is_better"]
        lines += _method_table(f"{task}: final {metric} ({'higher' if hib else 'lower'} is better), mean ± sd "
                               "over seeds (population sd, ddof 0) "
                               "[diverged share]", tg,
                               lambda g: mean_sd(g["final_mean"], g["final_std"], g["n"])
                                         + (f" [{g['diverged_frac']:.0%}]" if g["diverged_frac"] else ""))
    if shares:
        lines += _share_table("Recovered share of the stale–sync gap: (stale − method) / (stale − sync)", shares)
    rewarded = [g for g in main if "reward_last_mean" in g]
    for task in sorted({g["task"] for g in rewarded}):
        lines += _method_table(f"{task}: training reward, mean over the last 20% of steps (first 20% in brackets), "
                               "mean ± sd "
                               "over seeds (population sd, ddof 0)", [g for g in rewarded if g["task"] == task],
                               lambda g: f"{_reward_sd(g)} ({fmt(g['reward_first_mean'], 3)})")
    if reward_shares:
        lines += _share_table("Recovered share of the stale–sync gap in training reward (last 20% of steps)",
                              reward_shares)
    lines += _aligned_section(aligned or [])
    for measure, rows in (on_policy or {}).items():
        lines += _on_policy_table(measure, rows)
    for measure, rows in (costs or {}).items():
        lines += _cost_table(measure, rows)
    lines += _beyond_section(beyond or {}, uncontrolled or [])
    lines += ["## Alignment statistics (paper Table 3), after the warm-up", "",
              "| task | method | s | median c_t | q0.9(|c_t|) | Pr(|c_t| ≤ 0.05) | seeds |",
              "|---|---|---|---|---|---|---|"]
    for g in main:
        lines.append(f"| {g['task']} | {g['method']} | {g['staleness']} | {fmt(g['cos_median'])} | "
                     f"{fmt(g['cos_abs_q90'])} | "
                     f"{fmt(g['cos_abs_le_005'], 2)} | {g['n']} |")
    lines += _diagnostics_table(main)
    abl = [g for g in groups if g["ablation"]]
    if abl:
        key = ablation_key(abl)
        rows = {(r["task"], r["method"]): r for r in ablation_share_rows(groups, cells, ablation_rows)}
        what = "training reward" if key == "reward_last" else "final metric"
        lines += ["", "## Threshold ablation (c_low, c_high)", "",
                  f"Recovered share of the stale–sync gap in the {what} (95% Fieller interval) and the paired "
                  "difference to stale at the same s (t-interval, paired t-test p, and p adjusted by Holm's method "
                  "within its family, listed under Multiplicity families below), as in the tables above.",
                  "", "| task | method | s | final (mean) | training reward (last 20%) | share [95% CI] | "
                  "method − stale [95% CI] | p | p adj. | diverged | seeds |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for g in abl:
            r = rows.get((g["task"], g["method"]), {})
            reward = _reward_sd(g) if "reward_last_mean" in g else "—"
            share = "—" if r.get("share") is None or math.isnan(r["share"]) else (
                f"{fmt_share(r['share'])} {fmt_share_ci(r)}")
            diff = "—" if r.get("vs_stale_diff") is None else (
                f"{r['vs_stale_diff']:+.3g} {fmt_ci(r['vs_stale_ci_low'], r['vs_stale_ci_high'], 3)}")
            lines.append(f"| {g['task']} | `{g['method']}` | {g['staleness']} | {fmt(g['final_mean'], 4)} | "
                         f"{reward} | {share} | {diff} | {fmt(r.get('vs_stale_p'), 2)} | "
                         f"{fmt_p(r.get('vs_stale_p_adj'))} | {g['diverged_frac']:.0%} | {g['n']} |")
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
    lines += _law_section(law_points(regime or []))
    lines += _size_section(sizes or [], size_trend)
    lines += _families_section(families or [])
    lines += _versions_section(versions or [], mixed or [], machine_blocks, plugins or [], starts or [])
    return "\n".join(lines) + "\n"


def findings(shares: list[dict], reward_shares: list[dict], aligned: list[dict]) -> list[str]:
    """The findings paragraph: on the headline measure (:func:`~gacbench.bench.stats.headline_shares`), which methods
    beat stale at which s (Holm-adjusted p < 0.05 within the family) with that p, and which do not, with the
    smallest share their seeds could have detected; nothing without tests."""
    from gacbench.bench.stats import headline_shares

    headline = [r for r in headline_shares(shares, reward_shares, aligned) if not r.get("missing")]
    rows = [r for r in headline if _tested(r)]
    untested = [r for r in headline if not _tested(r) and (r.get("vs_stale_n") or 0) >= 1]
    if not rows and not untested:
        return []
    names = {"by_version": "reward by policy version", "reward_last": "training reward (last 20% of steps)",
             "final": "final metric"}
    out = []
    for task in dict.fromkeys(r["task"] for r in rows + untested):
        tr = [r for r in rows if r["task"] == task]
        first = (tr or [r for r in untested if r["task"] == task])[0]
        measure = names[first["measure"]]
        if first["measure"] == "by_version":
            measure = first["source_name"] + " (the last common versions of each comparison)"
        better = [r for r in tr if significant(r) and r["vs_stale_diff"] > 0]
        worse = [r for r in tr if significant(r) and r["vs_stale_diff"] < 0]
        rest = [r for r in tr if not significant(r) and not r["no_gap"]]
        no_gap = [r for r in tr if not significant(r) and r["no_gap"]]
        parts = [f"**{task}**, on the {measure}: "]
        if better:
            parts.append("beat stale: " + "; ".join(
                f"{r['method']} at s = {r['staleness']} ({_share_text(r)}, p adj. {fmt_p(r['vs_stale_p_adj'])})"
                for r in better) + ". ")
        if worse:
            parts.append("worse than stale: " + "; ".join(
                f"{r['method']} at s = {r['staleness']} (p adj. {fmt_p(r['vs_stale_p_adj'])})" for r in worse) + ". ")
        if rest:
            parts.append("not distinguishable from stale: " + "; ".join(
                f"{r['method']} at s = {r['staleness']} ({_share_text(r)}, {_detectable_text(r)})"
                for r in rest) + ". ")
        noisy = [r for r in no_gap if _within_noise(r)]  # stale ahead of sync by less than the seed noise
        clear = [r for r in no_gap if not _within_noise(r)]
        if noisy:
            at = sorted({r["staleness"] for r in noisy})
            parts.append(f"stale is no worse than sync at s = {', '.join(map(str, at))} within the seed noise of "
                         "the seeds each comparison pairs; not distinguishable from stale: " + "; ".join(
                             f"{r['method']} at s = {r['staleness']} (difference to stale {r['vs_stale_diff']:+.3g} "
                             f"{fmt_ci(r.get('vs_stale_ci_low'), r.get('vs_stale_ci_high'), 3)}, "
                             f"{_detectable_text(r)})" for r in noisy) + ". ")
        if clear:
            at = sorted({r["staleness"] for r in clear})
            parts.append(f"stale is no worse than sync at s = {', '.join(map(str, at))}: no gap to recover there ("
                         + ", ".join(dict.fromkeys(r["method"] for r in clear)) + ").")
        blind = [r for r in untested if r["task"] == task]
        if blind:
            parts.append(("" if parts[-1].endswith(" ") else " ") + "No paired test: " + "; ".join(
                f"{r['method']} at s = {r['staleness']} ({_untested_text(r)})" for r in blind) + ".")
        out.append("".join(parts).rstrip())
    return ["## Findings", "",
            "Each method against stale at the same s, paired over seeds (t-test, Holm-adjusted within its family; "
            "significant: p adj. < 0.05). Min. detectable share: the smallest share a paired test on these seeds "
            "and this noise detects with 80% power at α = 0.05, and in brackets at its family's α / m (Holm's first "
            "step: what one real effect among the family's m tests needs to be declared with 80% power; "
            "docs/bench.md). Where the stale − sync gap is within seed noise (under 2 standard errors), or too "
            "uncertain on these seeds for the share's 95% interval to be bounded, a share is a ratio of noise: the "
            "difference to stale is given instead, with the smallest difference these seeds detect.", ""] \
        + [x + "\n" for x in out]


def _tested(r: dict) -> bool:
    """Whether a share row carries a paired test against stale (a finite p: two seeds or more whose differences
    vary)."""
    p = r.get("vs_stale_p")
    return p is not None and math.isfinite(p)


def _untested_text(r: dict) -> str:
    if (r.get("vs_stale_n") or 0) < 2:
        return "one seed"
    d = r.get("vs_stale_diff")
    if d is None or not math.isfinite(d) or d == 0:
        return "identical to stale on every seed"
    return f"the same difference, {d:+.3g}, on every seed"


def fmt_p(p: float | None) -> str:
    """An adjusted p-value as the verdicts read it: two significant digits, three between 0.045 and 0.055, so that
    a p that rounds to 0.05 still shows on which side of α = 0.05 it lies (0.0496, 0.0504)."""
    return fmt(p, 3 if p is not None and math.isfinite(p) and 0.045 <= p < 0.055 else 2)


def _within_noise(r: dict) -> bool:
    """Whether a row's stale - sync gap is within seed noise (under 2 standard errors, or an interval of the share
    that is not bounded): its share is then a ratio of noise."""
    return bool(r.get("gap_within_noise")) or r.get("share_ci_kind") in ("exclusive", "unbounded")


def _share_text(r: dict) -> str:
    """``share X`` (over the seeds sync, stale and the method share, named where the test against stale paired
    more), or, where the gap is within noise, the difference to stale with its t-interval."""
    if r.get("no_gap") or r.get("share") is None or math.isnan(r["share"]):
        return "share n/a: no gap"
    if _within_noise(r):
        why = ("gap within noise" if r.get("gap_within_noise") else
               "gap not resolved by these seeds (the share's 95% interval is not bounded)")
        return (f"{why}: difference to stale {r['vs_stale_diff']:+.3g} "
                f"{fmt_ci(r.get('vs_stale_ci_low'), r.get('vs_stale_ci_high'), 3)}")
    text = fmt_share(r['share'])
    n, paired = r.get("n"), r.get("vs_stale_n")
    return f"share {text}" + (f" over the {n} seeds sync also ran; the test pairs {paired}" if n != paired else "")


def _detectable_text(r: dict) -> str:
    """What the seeds could have seen: the minimum detectable share (and at the family's level), or, where the gap
    is within noise, the smallest difference to stale the paired test detects with 80% power."""
    from gacbench.bench.stats import detectable_multiplier

    if _within_noise(r):
        sd, n = r.get("sd_diff"), r.get("vs_stale_n") or 0
        d = detectable_multiplier(n) * sd if sd and n >= 2 and math.isfinite(sd) else math.nan
        return f"min. detectable difference {fmt(d, 2)}"
    family = r.get("min_detectable_share_family")
    return (f"min. detectable share {fmt(r.get('min_detectable_share'), 2)}"
            + (f" [{fmt(family, 2)} at its family's level]" if family is not None else ""))


def _aligned_section(rows: list[dict]) -> list[str]:
    """The recovered shares on the version-aligned measure beside the training reward's."""
    if not rows:
        return []
    lines = ["## Recovered share by policy version", "",
             "A stale run's training reward at step t is the reward of rollouts of theta_{t−s}: the training "
             "reward's last 20% of steps compares sync's latest policies with stale's policies s versions older. "
             "Here each run's reward is indexed by the version of the policy that earned it (step − stale/lag, or "
             "eval/policy_reward, theta_t's own reward on held-out prompts, where every run logs it), and sync, "
             "stale and the method are compared over the same window of versions: the last W versions that every "
             "sync and stale run at that s has, W = 20% of sync's versions. This removes the lag of s versions from "
             "the comparison. Means over the seeds all three ran; share interval: Fieller's; p adj.: Holm within its "
             "family.", "",
             "| task | s | method | measure | versions | sync | stale | method | share [95% CI] | p adj. | "
             "min. detectable share | seeds |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = "n/a (stale no worse than sync)" if r["no_gap"] else f"{fmt_share(r['share'])} {fmt_share_ci(r)}"
        lines.append(f"| {r['task']} | {r['staleness']} | {r['method']} | {r['source']} | "
                     f"{r['versions'][0]}–{r['versions'][1]} | {fmt(r['sync'], 4)} | {fmt(r['stale'], 4)} | "
                     f"{fmt(r['value'], 4)} | {share} | {fmt_p(r.get('vs_stale_p_adj'))} | "
                     f"{fmt(r.get('min_detectable_share'), 2)} | {r['n']} |")
    return lines + [""]


def _families_section(families: list[dict]) -> list[str]:
    """The multiplicity families: each adjusted p is Holm's within one of them."""
    if not families:
        return []
    lines = ["", "## Multiplicity families", "",
             "Every p adj. in this summary is Holm's adjustment within one family (the suite's families:, or the "
             "defaults: docs/bench.md); each comparison belongs to one family and has one adjusted p.", "",
             "| family | test | of | tests | comparisons |", "|---|---|---|---|---|"]
    for f in families:
        of = ", ".join(f"{k} = {v}" for k, v in f["of"].items()) or "all"
        lines.append(f"| {f['name']} | {f['test']} | {of} | {f['m']} | {len(f['comparisons'])} |")
    return lines


def _mixed_note(mixed: list[dict]) -> str:
    """Which groups average seeds run in different code versions, in one sentence."""
    if not mixed:
        return "no group mixes versions among its seeds, but groups computed in different versions are compared."
    named = ", ".join(f"{g['task']} / {g['method']} / s={g['staleness']}" for g in mixed)
    return f"{len(mixed)} group(s) average seeds run in different versions: {named}."


def _blocks_note(blocks: dict) -> str:
    """A blocked grid's CPU kinds and their seeds, in one paragraph."""
    kinds = "; ".join(f"{kind}: " + ", ".join(f"{t} seeds {', '.join(map(str, s))}" for t, s in v["seeds"].items())
                      + f" ({v['cells']} cells)" for kind, v in blocks["kinds"].items())
    return (f"**The cells ran on {len(blocks['kinds'])} CPU kinds, each seed on one** ({kinds}), in one code version. "
            "Every paired comparison (methods within a seed) is made on one machine; the spread over seeds holds the "
            "machine's effect as it holds the seed's.")


def _versions_section(versions: list[dict], mixed: list[dict], blocks: dict | None = None,
                      plugins: list[dict] | None = None, starts: list[dict] | None = None) -> list[str]:
    """The distinct code versions of the cells: description, environment key, cell count; a blocked grid's
    environments differ only in the CPU kind, which :func:`_blocks_note` names; then the stabilizer plug-ins'
    code versions and the start points (θ₀) the tasks' cells recorded."""
    if not versions:
        return []
    recorded = any(" isa " in v["key"] or " weights " in v["key"] for v in versions)
    lines = ["", "## Code versions", "",
             "The environments the cells ran in (gacbench/provenance.py: the library's source hash, package versions, "
             "threads and device" + (", the instruction set where recorded, and the initial weights of a task whose "
                                     "cells started from more than one" if recorded else "")
             + "; the commit, dirty where the checkout differed from it; unrecorded: stored without provenance).", ""]
    lines += [f"- {v['description']}: `{v['key']}`, {v['cells']} cell{'' if v['cells'] == 1 else 's'}"
              for v in versions]
    if blocks and blocks["blocked"]:
        lines += ["", _blocks_note(blocks)]
    elif len(versions) > 1:
        lines += ["", f"This grid mixes {len(versions)} code versions: " + _mixed_note(mixed)]
    if blocks and blocks["mixed_seeds"]:
        lines += ["", _mixed_seeds_note(blocks)]
    if plugins:
        lines += ["", "Stabilizer plug-ins (their distribution, its version, and a hash of the plug-in's code, which "
                  "an edit in place changes; part of the key of the cells that used them):", ""]
        lines += [f"- {p['name']}: {p['distribution'] or 'no distribution'} {p['version'] or ''}".rstrip()
                  + f", code `{str(p['sha256'])[:12]}`, {p['cells']} cell{'' if p['cells'] == 1 else 's'}"
                  for p in plugins]
        if len(versions) <= 1 and mixed and not (blocks and blocks["blocked"]):
            lines += ["", _mixed_note(mixed)]
    if starts:
        lines += ["", "Start points (θ₀): the SHA-256 of the initial weights each task's cells recorded "
                  "(`initial_weights`; a suite's `theta0:` pins a prefix of it):", ""]
        lines += [f"- {p['task']}: `{p['initial_weights']}`, {p['cells']} cell{'' if p['cells'] == 1 else 's'}"
                  for p in starts]
    return lines


def _mixed_seeds_note(blocks: dict) -> str:
    """The seeds whose cells ran on more than one CPU kind (:func:`~gacbench.bench.versions.machine_blocks`), named
    whatever the code versions: their methods were not compared on one machine. Cells stored without the CPU's
    vendor share one environment key across vendors of one instruction set, which compute differently."""
    return ("Seeds computed on more than one CPU kind (their methods are not compared on one machine): " + ", ".join(
        f"{m['task']} seed {m['seed']} ({' and '.join(m['kinds'])})" for m in blocks["mixed_seeds"]) + ".")


def _share_cell(r: dict) -> str:
    """One entry of the table of shares across s: the share, its interval and ``*`` where the paired t-test
    against stale has a Holm-adjusted p < 0.05 (:func:`significant`); empty for a missing group or no gap."""
    if r.get("missing") or r["no_gap"]:
        return ""
    star = " *" if significant(r) else ""
    return f"{fmt_share(r['share'])} {fmt_share_ci(r)}{star}"


def _ci_section(shares: list[dict], reward_shares: list[dict]) -> list[str]:
    """The appended confidence-interval tables (module docstring: Fieller's interval of the share, paired t on
    the difference to stale)."""
    if not any("n" in r for r in shares + reward_shares):
        return []
    lines = ["", f"## Confidence intervals ({CI_LEVEL:.0%}) over seeds", "",
             "Share: Fieller's interval of the ratio over the seeds that sync, stale and the method share (exact "
             "under normal seed noise; unbounded, (−∞, ∞), or two rays where the gap itself is not distinguishable "
             "from 0). Method − stale: mean paired difference, > 0 = the method is better, with its t-interval, the "
             "two-sided paired t-test's p-value raw and adjusted by Holm's method within its family (p adj.), and "
             "the exact sign-flip p (no normality; at least 2/2^n: 0.25 with 3 seeds). Min. det.: the smallest "
             "share these seeds detect with 80% power at α = 0.05. — = fewer than two seeds (or no gap to "
             "recover). In the tables across s, * marks an adjusted p < 0.05 and an empty entry a missing group "
             "or no gap."]
    for title, rows in (("final metric", shares), ("training reward (last 20% of steps)", reward_shares)):
        rows = [r for r in rows if "n" in r]
        if not rows:
            continue
        for task in dict.fromkeys(r["task"] for r in rows):  # robustness across s (the paper's Figure 4)
            lines += [""] + _method_table(f"{task}: recovered share across s, {title}",
                                          [r for r in rows if r["task"] == task], _share_cell, heading="###")[:-1]
        lines += ["", f"### {title}", "",
                  "| task | s | method | share | share 95% CI | method − stale | 95% CI | p | p adj. | sign-flip p | "
                  "min. det. | seeds |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r.get("missing"):
                share = f"n/a (no {' or '.join(r['missing'])} cells)"
            elif r["no_gap"]:
                share = "n/a (stale no worse than sync)"
            else:
                share = fmt_share(r['share'])
            lines.append(f"| {r['task']} | {r['staleness']} | {r['method']} | {share} | "
                         f"{fmt_share_ci(r)} | {fmt(r['vs_stale_diff'], 3)} | "
                         f"{fmt_ci(r['vs_stale_ci_low'], r['vs_stale_ci_high'], 3)} | {fmt(r['vs_stale_p'], 2)} | "
                         f"{fmt_p(r.get('vs_stale_p_adj'))} | {fmt(r.get('vs_stale_p_signflip'), 2)} | "
                         f"{fmt(r.get('min_detectable_share'), 2)} | {r['n']} |")
    return lines


def _is_gac(method: str) -> bool:
    return method.split("(")[0].split("+")[0].startswith("gac")


def table1_staleness(groups: list[dict]) -> int | None:
    """The staleness of paper Table 1: 16 when the grid has it (the paper's), else the largest s > 0."""
    svals = sorted({g["staleness"] for g in groups if g["staleness"] > 0 and not g["ablation"]})
    return None if not svals else (16 if 16 in svals else svals[-1])


def _table1(groups: list[dict], cells: list[dict]) -> list[str]:
    """Paper Table 1: per task the final metric (and training reward) of sync and every method at one
    staleness, with 95% t-intervals over seeds, and each GAC method's margin over the strongest
    non-GAC stale method."""
    s_star = table1_staleness(groups)
    if s_star is None:
        return []
    finals, rewards = per_seed(cells, "final"), per_seed(cells, "reward_last")
    lines = ["", f"## Table 1: final metric under staleness s = {s_star} (synchronous reference at s = 0)", "",
             f"Mean over seeds [{CI_LEVEL:.0%} t-interval over seeds]. Δ: a GAC method's mean minus the "
             "strongest non-GAC stale method's (stale and every other stabilizer), > 0 = GAC better (on the final "
             "metric, sign-adjusted for lower-is-better metrics). − stale: every method's mean minus stale's at the "
             "same s, > 0 = better than stale (final metric, sign-adjusted)."]
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
                  + "− stale | Δ | seeds |",
                  "|---|---|---|---|" + ("---|---|" if rewarded else "") + "---|---|---|"]
        stale_g = next((g for g in rows if g["method"] == "stale" and g["staleness"] == s_star), None)
        order = lambda g: (g["staleness"] != 0, g["method"] != "stale", _is_gac(g["method"]), g["method"])  # noqa: E731
        for g in sorted(rows, key=order):
            key = (task, g["method"], g["staleness"])
            f = np.array(list(finals.get(key, {}).values()))
            cells_row = (f"| {g['method']} | {g['staleness']} | {fmt(g['final_mean'], 4)} | "
                         f"{fmt_ci(*mean_t_interval(f), 4)} | ")
            if rewarded:
                r = np.array(list(rewards.get(key, {}).values()))
                cells_row += f"{fmt(g['reward_last_mean'], 4)} | {fmt_ci(*mean_t_interval(r), 4)} | "
            delta = "–"
            if best is not None and _is_gac(g["method"]) and g["staleness"] == s_star:
                delta = f"{sign * (g['final_mean'] - best['final_mean']):+.3g} (vs {best['method']})"
            vs_stale = "–"
            if stale_g is not None and g["staleness"] == s_star and g["method"] != "stale":
                vs_stale = f"{sign * (g['final_mean'] - stale_g['final_mean']):+.3g}"
            lines.append(cells_row + f"{vs_stale} | {delta} | {g['n']} |")
    return lines


def _calibrated_from_gradients(method: str) -> bool:
    """Whether ``method`` calibrates from the gradient cosines ``align/cos`` (gac-calibrated), which Table 3's
    statistics are, and not from another trace (gac-step-calibrated: ``align/step_cos``)."""
    from gacbench.methods import reference_trace

    try:
        return reference_trace(method) == "align/cos"
    except (KeyError, ValueError):
        return False


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
        used = [c for c in cells if c["task"] == task and c.get("c_low") is not None and c["status"] == "done"
                and _calibrated_from_gradients(c["method"])]  # not the step reading's thresholds
        used_s = (f"({fmt(float(np.mean([c['c_low'] for c in used])))}, "
                  f"{fmt(float(np.mean([c['c_high'] for c in used])))}) over {len(used)} cells" if used else "—")
        lines.append(f"| {task} | {fmt(nanmean([c['cos_abs_q90'] for c in tc]))} | "
                     f"{fmt(nanmean([c['cos_max_abs'] for c in tc]))} | "
                     f"{fmt(nanmean([c['cos_abs_le_005'] for c in tc]), 2)} | "
                     f"{fmt(nanmean([c['cos_median'] for c in tc]))} | {fmt(float(np.mean(lows)))} "
                     f"[{fmt(min(lows))}, {fmt(max(lows))}] | {fmt(float(np.mean(highs)))} [{fmt(min(highs))}, "
                     f"{fmt(max(highs))}] | {used_s} | {len(tc)} |")
    return lines


def _regime_section(points: list[dict]) -> list[str]:
    if not points:
        return []
    lines = ["", "## Regime map: stale − sync per (model, learning rate, staleness)", "",
             f"Gap: stale − sync on the training reward of the last 20% of steps (the final metric where no reward is "
             f"logged, negated where lower is better), paired over seeds, mean [{CI_LEVEL:.0%} t-interval]; < 0 = "
             f"stale worse. c_t: median and "
             f"q0.9(|c_t|) after the warm-up, means over seeds. Degraded: share of stale seeds whose reward "
             f"(smoothed over {DEGRADE_WINDOW} steps) ends below its own running maximum by more than {DEGRADE_MARGIN} "
             f"and more than {DEGRADE_SIGMAS:g} standard deviations of a {DEGRADE_WINDOW}-step mean (from its "
             "step-to-step noise) (mean drop in brackets). Sync healthy: no sync seed diverged or degraded and its "
             "reward rose.", "",
             "| model | lr | s | sync | stale | gap | 95% CI | median c_t sync → stale | q0.9 |c_t| sync → stale | "
             "stale degraded | sync healthy | seeds |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['model']} | {p['lr']:.3g} | {p['staleness']} | {fmt(p['sync'], 3)} | "
                     f"{fmt(p['stale'], 3)} | "
                     f"{fmt(p['gap'], 2)} | {fmt_ci(p['gap_ci_low'], p['gap_ci_high'], 2)} | "
                     f"{fmt(p['sync_cos_median'], 2)} → {fmt(p['stale_cos_median'], 2)} | "
                     f"{fmt(p['sync_cos_abs_q90'], 2)} → {fmt(p['stale_cos_abs_q90'], 2)} | "
                     f"{fmt(p['stale_degraded_frac'], 2)} ({fmt(p['stale_reward_drop'], 2)}) | "
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
            lines.append(f"| {p['model']} | {p['lr']:.3g} | {p['staleness']} | {fmt(p['sync_L'], 3)} | "
                         f"{fmt(p['stale_L'], 3)} | {p['stale_eta_max']:.3g} | {fmt(p['stale_eta_eff'], 3)} | "
                         f"{yes[p['lr_within_eta_max']]} | {yes[p['eff_within_eta_max']]} | {yes[p['stale_worse']]} |")
        for key, name in (("lr_within_eta_max", "lr"), ("eff_within_eta_max", "eta_eff")):
            judged = [p for p in checked if p["stale_worse"] is not None and p[key] is not None]
            agree = sum((not p[key]) == p["stale_worse"] for p in judged)
            lines.append(f"{'' if key == 'eff_within_eta_max' else chr(10)}Predicting a stale failure where {name} > "
                         f"eta_max(s) matches the observation at {agree} of {len(judged)} points.")
    return lines


def _law_section(law: list[dict]) -> list[str]:
    """The regime map's points against s * lr per model (:func:`~gacbench.bench.regime.law_points`), with Spearman's
    rank correlation of the gap against s * lr over the points where sync is healthy, and over all of them."""
    if not law:
        return []
    lines = ["", "### Staleness × learning rate", "",
             "The per-step surrogate-gradient bias of stale training grows like s · lr, so the gap of one model should "
             "be one monotone function of s · lr: |ρ|, Spearman's rank correlation of gap against s · lr, near 1 says "
             "the points fall on one monotone curve (ρ < 0 on a reward: stale loses more as s · lr grows). It is "
             "given over the points whose sync run is healthy (below the healthy-sync limit, where the gap compares "
             "stale with a sync run that learns), then over every point. Gap as above, mean "
             f"[{CI_LEVEL:.0%} t-interval]; fig_law.png plots them (open markers: sync unhealthy).", ""]

    def corr(rho: float | None, p: float | None, n: int) -> str:
        if rho is None or math.isnan(rho):
            return f"— ({n} points: needs three with a gap, at two s · lr or more)"
        return f"{rho:+.2f} (p = {fmt(p, 2)}, {n} points)"

    for entry in law:
        finite = [p for p in entry["points"] if math.isfinite(p["gap"])]
        healthy = [p for p in finite if p["sync_healthy"]]
        limit = ("" if not entry["sync_unhealthy_lrs"] else
                 f"; sync unhealthy at lr = {', '.join(f'{x:.3g}' for x in entry['sync_unhealthy_lrs'])}"
                 + (f" (healthy up to lr = {entry['healthy_lr_max']:.3g})"
                    if entry.get("healthy_lr_max") is not None else ""))
        lines += [f"**{entry['model']}**: Spearman ρ(gap, s · lr) where sync is healthy = "
                  f"{corr(entry.get('spearman_rho_healthy'), entry.get('spearman_p_healthy'), len(healthy))}; over "
                  f"every point = {corr(entry['spearman_rho'], entry['spearman_p'], len(finite))}{limit}", "",
                  "| s · lr | lr | s | gap | 95% CI | sync healthy | seeds |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {p['s_lr']:.3g} | {p['lr']:.3g} | {p['staleness']} | {fmt(p['gap'], 2)} | "
                  f"{fmt_ci(p['gap_ci_low'], p['gap_ci_high'], 2)} | {'yes' if p['sync_healthy'] else 'no'} | "
                  f"{p['n']} |" for p in entry["points"]]
        lines.append("")
    return lines[:-1]


def _size_section(points: list[dict], trend: dict | None) -> list[str]:
    """Paper Table 3 across model sizes (:func:`~gacbench.bench.regime.size_points`), the paper's rows beside the
    grid's, the stale / sync median c_t per s, and the trend of q0.9(|c_t|) with size
    (:func:`~gacbench.bench.regime.size_trend`)."""
    if not points:
        return []
    svals = sorted({e["staleness"] for p in points for e in p["stale"]})
    lines = ["", "## On-policy alignment across model sizes (paper Table 3 by size)", "",
             "Synchronous cells, means over seeds after the warm-up; the paper's rows (nominal parameter counts, "
             "after step 50) below the grid's. Stale / sync: the stale run's median c_t over sync's at each s; "
             "fig_size.png plots both.", "",
             "| model | parameters | lr | median c_t | q0.9(|c_t|) | max |c_t| | Pr(|c_t| ≤ 0.05) | "
             + "".join(f"stale / sync median c_t, s={s} | " for s in svals) + "seeds |",
             "|" + "---|" * (8 + len(svals))]
    for p in points:
        ratios = {e["staleness"]: e for e in p["stale"]}
        lr = f"{p['lr']:.3g}" if isinstance(p["lr"], (int, float)) else "—"
        lines.append(f"| {p['task']} | {p['params'] / 1e6:.2f}M | {lr} | {fmt(p['sync_cos_median'])} | "
                     f"{fmt(p['sync_cos_abs_q90'])} | {fmt(p['sync_cos_max_abs'])} | "
                     f"{fmt(p['sync_cos_abs_le_005'], 2)} | "
                     + "".join(f"{fmt(ratios[s]['cos_median_ratio'], 2)} | " if s in ratios else "— | " for s in svals)
                     + f"{p['n']} |")
    for r in PAPER_TABLE3:
        lines.append(f"| {r['model']} (paper) | {r['params'] / 1e9:.1f}B | 1e-06 | — | {fmt(r['cos_abs_q90'])} | "
                     f"{fmt(r['cos_max_abs'])} | {fmt(r['cos_abs_le_005'], 2)} | " + "— | " * len(svals) + "— |")
    if trend is not None:
        at = "; ".join(f"{a['model']} {fmt(a['fit'])} (paper {fmt(a['paper'])})" for a in trend["at_paper"])
        lines += ["", f"Trend: q0.9(|c_t|) of sync changes by {trend['slope_per_decade']:+.3f} per tenfold parameters "
                      f"[{CI_LEVEL:.0%} CI {trend['slope_ci_low']:+.3f}, {trend['slope_ci_high']:+.3f}] (least squares "
                      f"on log10 parameters over {trend['n_cells']} sync cells, p = {fmt(trend['p'], 2)}). Extended "
                      f"to the paper's sizes (an extrapolation over more than two decades): {at}."]
    return lines


def _step_share_note(timing: dict | None) -> str:
    from gacbench.bench.timing import stopped_before_report

    if not timing or timing.get("step_share") is None:
        return ""
    outside = ""
    if timing.get("outside_step_share") is not None:
        outside = (f"; {timing['outside_step_share']:.0%} of the {timing['outside_wall_s']:.0f} s from the process's "
                   "start to its written report")
    elif timing.get("startup_s") is not None and stopped_before_report(timing):
        outside = (f"; {timing['startup_s']:.0f} s of start-up before its first cell; it stopped before its report, "
                   "so its share from the process's start was not measured")
    elif timing.get("startup_s") is not None:
        outside = (f"; {timing['startup_s']:.0f} s of start-up before its first cell, and its share from the "
                   "process's start to the written report in timing.json")
    return (f" Last run: step share {timing['step_share']:.0%} ({timing['ran']} cells, {timing['workers']} worker(s), "
            f"{timing['wall_s']:.0f} s wall{outside}).")


def toward_markdown(rows: list[dict]) -> list[str]:
    """The table "toward the paper's regime": one row per point (:func:`gacbench.bench.regime.toward_row`),
    then the paper's Table 3 rows (their q0.9(|c_t|) only). A share is shown with its 95% interval and ``*``
    where the paired test against stale has a Holm-adjusted p < 0.05 within its grid; ``no gap`` where stale
    is not below sync, and ``(n = K)`` where the share pairs fewer seeds (K) than the gap."""
    from gacbench.bench.regime import TOWARD_METHODS

    methods = [m for m in TOWARD_METHODS if any(r.get(m) for r in rows)]

    def share(e: dict | None, gap_seeds: int | None) -> str:
        if e is None:
            return "—"
        fewer = f" (n = {e['n']})" if e.get("n") and gap_seeds and e["n"] < gap_seeds else ""
        return ("no gap" if e["no_gap"] else _share_cell(e)) + fewer

    lines = ["| point | parameters | tokens per response | s | sync q0.9(|c_t|) | stale / sync median c_t | "
             "sync − stale reward [95% CI] (p) | " + "".join(f"{m} share | " for m in methods)
             + "stale's largest token ratio | seeds (sync, stale) |",
             "|" + "---|" * (9 + len(methods))]
    for r in rows:
        params = f"{r['params'] / 1e6:.2f}M" if r.get("params") else "—"
        gap = f"{r['gap']:+.3f} {fmt_ci(r['gap_ci_low'], r['gap_ci_high'])} ({fmt(r['gap_p'], 2)})"
        lines.append(f"| {r['point']} | {params} | {fmt(r['response_tokens'], 3)} | {r['staleness']} | "
                     f"{fmt(r['sync_cos_abs_q90'])} | {fmt(r['cos_median_ratio'], 2)} | {gap} | "
                     + "".join(f"{share(r.get(m), r.get('gap_seeds'))} | " for m in methods)
                     + f"{fmt(r['ratio_max'], 3)} | {r['n_sync']}, {r['n_stale']} |")
    for p in PAPER_TABLE3:
        lines.append(f"| {p['model']} (paper, Table 3) | {p['params'] / 1e9:.1f}B | — | — | "
                     f"{fmt(p['cos_abs_q90'])} | — | — | " + "— | " * len(methods) + "— | — |")
    return lines
