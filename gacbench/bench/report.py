"""Summary tables and figures of a benchmark directory, built from the stored runs alone.

``gacbench report DIR`` regenerates ``summary.json``, ``summary.md`` and the PNG figures without
running anything. The summary covers every cell stored in ``DIR`` (also when ``gacbench bench`` ran a
subset of the grid into it). A cell whose status says done but whose stored files are incomplete
(:func:`gacbench.bench.cell.done_problem`) is listed as ``incomplete``, with the bad file named, and
never counted as finished; the next ``gacbench bench`` into ``DIR`` recomputes it. Definitions:

- a cell's ``final`` is the objective's metric after the last step; ``diverged`` is non-finite
  parameters or metric, or (for loss-like metrics) a final 10x worse than the start;
- a group (task, settings, method, staleness: every cell that differs only in its seed,
  :mod:`gacbench.bench.groups`) averages its seeds; ``final_mean`` counts a diverged run at
  its starting value (a run that blew up is no better than one that never moved), so that means
  and the recovered share stay finite;
- the recovered share of the gap is (stale - m) / (stale - sync) on ``final_mean``, for every
  stabilizer m at each staleness: 1 recovers the synchronous result, 0 is no better than stale; a
  gap smaller than twice its standard error over seeds (sqrt(s_sync²/n_sync + s_stale²/n_stale), s the
  sample standard deviation) is flagged (``gap_within_noise``; null with a single seed): the share is
  then a ratio of noise; where sync, stale and m did not run the same seeds (and the cells are at hand), the
  three means, the gap and its standard error are taken over the seeds all three ran (``paired_seeds``, their
  count), the seeds the share's interval pairs, so that the point estimate and its interval describe one sample;
- confidence intervals (appended section of summary.md; ``share_ci_low``/``share_ci_high``, ``n`` and the
  ``vs_stale_*`` keys of each ``recovered``/``recovered_reward`` entry): over the seeds that sync, stale and
  the method share (``n``, distinct seeds), Fieller's interval of the share (``share_ci_kind``: bounded,
  exclusive or unbounded; :func:`~gacbench.bench.stats.fieller_interval`), and the paired difference method -
  stale, signed so that > 0 is better, with its t-interval, the two-sided paired t-test's p-value
  (scipy.stats.ttest_rel) and the exact sign-flip p (``vs_stale_p_signflip``); ``min_detectable_share``: the
  smallest share these seeds detect at 80% power (:func:`~gacbench.bench.stats.min_detectable_share`);
  intervals are null with fewer than two seeds; the share and its interval are null when sync or stale has no
  cells (``missing`` names them), the comparison when stale has none;
- ``recovered_by_version`` (rollout objectives): the same on the reward indexed by the policy version that
  earned it, each comparison over the same window of versions (:func:`~gacbench.bench.stats.aligned_shares`),
  also carried by each ``recovered_reward`` entry as ``final_by_version``; fig_versions_TASK.png draws the whole run
  by version (:func:`~gacbench.bench.figures.versions_figures`);
- ``vs_stale_p_adj`` (and ``vs_sync_p_adj``, ``cost_p_adj``, ``beyond_p_adj``): that p-value adjusted by Holm's
  step-down method within its family, declared by the suite's ``families`` or the defaults
  (:func:`~gacbench.bench.stats.apply_families`; listed in ``families``): one adjusted p per comparison;
  summary.md's ``*`` and fig_shares.png's filled markers read it;
- a cell's ``reward_drop`` (rollout objectives): how far its training reward, smoothed over
  ``DEGRADE_WINDOW`` steps, ends below its own running maximum, and ``reward_noise``, the standard deviation
  of a DEGRADE_WINDOW-step mean from the step-to-step noise; ``degraded`` when the drop exceeds both
  ``DEGRADE_MARGIN`` and ``DEGRADE_SIGMAS`` x reward_noise (the progressive-degradation indicator of the
  regime map);
- appended to summary.md after the existing sections: the intervals, paper Table 1 (``tables._table1``, at
  :func:`~gacbench.bench.tables.table1_staleness`), paper Table 3 with the calibrated thresholds
  (``tables._table3``) and the regime map (:func:`~gacbench.bench.regime.regime_points`, also ``regime`` in
  summary.json) with its points against s * lr (:func:`~gacbench.bench.regime.law_points`, ``regime_law``);
- ``size`` (a grid whose GRPO tasks span two or more model sizes): per task, paper Table 3's on-policy statistics of
  the sync cells, the parameter count and lr, and the stale / sync median c_t per s
  (:func:`~gacbench.bench.regime.size_points`), beside the paper's rows in summary.md; ``size_trend``: the slope of
  sync's q0.9(|c_t|) against log10 parameters with its interval, and where it points at the paper's sizes
  (:func:`~gacbench.bench.regime.size_trend`; three sizes or more, one task each); fig_size.png plots both;
- ``on_policy`` / ``on_policy_reward`` (a suite task's ``on_policy`` methods, run at s = 0): each such
  stabilizer against sync on the final metric / the training reward, the paired difference method - sync (> 0:
  better) with its t-interval and p-value, and ``vs_sync_p_adj`` (Holm within its family;
  :func:`~gacbench.bench.stats.on_policy_controls`); and ``staleness_cost`` / ``staleness_cost_reward``: for each
  such method at each s > 0, what staleness costs it against its own on-policy run (m at s = 0 minus m at s,
  paired over seeds, > 0: staleness hurts) beside what it costs plain GRPO (sync minus stale at s)
  (:func:`~gacbench.bench.stats.staleness_costs`);
- ``beyond_on_policy`` / ``beyond_on_policy_reward`` / ``beyond_on_policy_by_version`` (a task with on-policy
  controls): for each method at each s > 0, the share of the stale-sync gap it removes beyond its on-policy effect,
  a paired difference-in-differences over seeds against its control (its s = 0 cells, or sync for a method whose
  update at s = 0 is sync's: ``gacbench.methods.on_policy_identity``), with Fieller's interval, the paired test
  and ``beyond_p_adj``, beside the raw share (:func:`~gacbench.bench.beyond.beyond_on_policy`); the methods with
  neither control are listed in ``beyond_on_policy_uncontrolled``; fig_beyond.png plots the headline measure's;
- ``regime_checks`` (a task whose sync and stale cells log ``eval/policy_reward``): does sync's policy reward rise
  from its first eval point to its last, and does stale lose a gap at each s it ran, each in standard errors over seeds
  against 3 (:func:`~gacbench.bench.beyond.regime_checks`);
- the c_t statistics use the steps after the suite's warm-up;
- ``versions``: one entry per distinct environment key of the cells' ``provenance``
  (:mod:`gacbench.bench.versions`), and the groups that mix keys; ``machine_blocks`` where the cells ran on more
  than one CPU kind: the seeds of each kind and whether every seed ran on one kind of one code version (a blocked
  design, :func:`~gacbench.bench.versions.machine_blocks`);
- ``timing`` (from ``timing.json``, written by the last ``gacbench bench`` run that executed cells):
  the wall time, cells per minute, the step share (optimizer-step seconds of the cells run /
  (wall time x workers)), each worker's resident memory after each of its cells, and the start-up from
  the process's start to its first cell; the figures from the process's start to its written report
  (``outside_wall_s``, ``outside_step_share``) are measured after this summary, so they are in timing.json
  (:mod:`gacbench.bench.timing`), and here only when a later ``gacbench report`` reads them.

This module builds the report; each job has its module: :mod:`~gacbench.bench.records` (each stored cell's
record), :mod:`~gacbench.bench.groups` (cells averaged over seeds), :mod:`~gacbench.bench.stats` (intervals,
paired tests, recovered shares), :mod:`~gacbench.bench.beyond` (the shares beyond the on-policy effect and the
regime checks), :mod:`~gacbench.bench.regime` (the regime map), :mod:`~gacbench.bench.tables`
(summary.md), :mod:`~gacbench.bench.figures` (one function per figure) and :mod:`~gacbench.bench.versions` (the
code versions of the cells).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from gacbench.bench.beyond import BEYOND_MEASURES, beyond_on_policy, controlled_tasks, headline_beyond, regime_checks
from gacbench.bench.cell import cell_dir, json_safe, stored_provenance, write_json
from gacbench.bench.figures import figure_legend_entries, figures  # noqa: F401  (re-exported)
from gacbench.bench.groups import group_records, label_by_settings
from gacbench.bench.records import (  # noqa: F401  (re-exported)
    DEGRADE_MARGIN,
    DEGRADE_SIGMAS,
    DEGRADE_WINDOW,
    DIAGNOSTICS,
    cell_record,
    degrade_threshold,
    discover_cells,
    read_metrics,
    read_timing,
    running_max_drop,
    window_noise,
)
from gacbench.bench.regime import law_points, regime_points, size_points, size_trend
from gacbench.bench.stats import (  # noqa: F401  (re-exported)
    BOOT_RESAMPLES,
    BOOT_SEED,
    CI_LEVEL,
    REFERENCE_METHODS,
    ablation_key,
    aligned_shares,
    apply_families,
    headline_shares,
    holm_adjust,
    mean_t_interval,
    on_policy_controls,
    paired_difference,
    recovered_shares,
    share_bootstrap_ci,
    staleness_costs,
)
from gacbench.bench.tables import markdown, table1_staleness  # noqa: F401  (re-exported)
from gacbench.bench.versions import (
    code_versions,
    machine_blocks,
    mixed_version_groups,
    plugin_versions,
    start_points,
    start_points_differ,
    version_key,
)
from gacbench.jsonio import read_json, write_text

_json_safe = json_safe  # NaN and infinities become null: summary.json stays valid JSON for every parser


def build_report(root: str | Path, cells: list[dict] | None = None,
                 families: dict[str, dict] | None = None, families_known: bool = True) -> dict[str, Any]:
    """Write summary.json, summary.md and the figures of ``root``. They cover every cell stored there:
    ``cells`` (the cells of the grid just run, if given) and every other cell found on disk. ``families``: the
    suite's multiplicity families (:func:`~gacbench.bench.stats.apply_families`; the defaults where None),
    recorded in summary.json as ``declared_families`` unless ``families_known`` is False (a report that could
    not tell which families built the grid: the next one says so again)."""
    root = Path(root)
    specs = list(cells or [])
    known = {cell_dir(root, c) for c in specs}
    specs += [c for c in discover_cells(root) if cell_dir(root, c) not in known]
    metrics: dict[Path, dict] = {}  # the main grid's metrics.csv files, parsed once for the records and the figures
    records = sorted((r for r in (cell_record(root, c, metrics) for c in specs) if r is not None),
                     key=lambda r: (r["task"], r["method"], r["staleness"], r["seed"]))
    provs = {(c["task"], c["method"], c["staleness"], c["seed"]): stored_provenance(root, c) for c in specs}
    provs = [provs[(r["task"], r["method"], r["staleness"], r["seed"])] for r in records]
    mixed_starts = start_points_differ(records, provs)
    for r, prov in zip(records, provs):  # the code version, as summary.json's versions list it
        r["environment"] = version_key(r, prov, mixed_starts)
    versions = code_versions(records, provs, mixed_starts)
    # the cells as grouped: a task stored with several settings is one group per setting, each labelled
    cells_g, specs_g = label_by_settings(records, specs)
    cells_g.sort(key=lambda r: (r["task"], r["method"], r["staleness"], r["seed"]))
    groups = group_records(cells_g)
    shares = recovered_shares(groups, cells=cells_g)
    reward_shares = recovered_shares(groups, "reward_last", cells=cells_g)
    regime = regime_points(cells_g, specs_g)
    timing = read_timing(root)
    mixed = mixed_version_groups(cells_g)
    plugins = plugin_versions(provs)
    starts = start_points(records, provs)
    blocks = machine_blocks(records, provs)
    aligned = aligned_shares(groups, cells_g)
    summary = {"cells": [{k: v for k, v in r.items() if k != "_by_version"} for r in records], "groups": groups,
               "recovered": shares, "recovered_reward": reward_shares,
               **({"recovered_by_version": aligned} if aligned else {}),
               "versions": versions, **({"plugins": plugins} if plugins else {}),
               **({"start_points": starts} if starts else {}),
               **({"mixed_version_groups": mixed} if len(versions) > 1 or mixed else {}),
               **({"machine_blocks": blocks} if blocks else {})}
    tests = [("vs_stale", "final", shares), ("vs_stale", "reward_last", reward_shares),
             ("vs_stale", "by_version", aligned)]
    # the on-policy controls and their staleness costs, per measure: (summary key suffix, cell key, md title)
    measures = [("", "final", "final metric")] + ([("_reward", "reward_last", "training reward (last 20% of steps)")]
                                                  if any("reward_last_mean" in g for g in groups) else [])
    on_policy, costs = {}, {}
    if on_policy_controls(groups, cells_g):
        for suffix, key, title in measures:
            on_policy[title] = summary[f"on_policy{suffix}"] = on_policy_controls(groups, cells_g, key)
            tests.append(("vs_sync", key, on_policy[title]))
        for suffix, key, title in measures:
            costs[title] = summary[f"staleness_cost{suffix}"] = staleness_costs(groups, cells_g, key)
            tests.append(("cost", key, costs[title]))
    beyond, uncontrolled = {}, []
    if controlled_tasks(groups):
        from gacbench.methods import on_policy_identity

        for suffix, key, _ in BEYOND_MEASURES:
            rows, missing = beyond_on_policy(groups, cells_g, key, on_policy_identity)
            if rows:
                beyond[key] = summary[f"beyond_on_policy{suffix}"] = rows
                tests.append(("beyond", key, rows))
            if key == "final":  # the measure every cell has: it lists every s
                uncontrolled = missing
        if uncontrolled:
            summary["beyond_on_policy_uncontrolled"] = uncontrolled
    checks = regime_checks(cells_g)
    if checks:
        summary["regime_checks"] = checks
    abl = [g for g in groups if g["ablation"]]
    ablation_rows = None
    if abl:
        summary["ablation_recovered"] = recovered_shares(groups, cells=cells_g, ablation=True)
        summary["ablation_recovered_reward"] = recovered_shares(groups, "reward_last", cells=cells_g, ablation=True)
        ablation_rows = summary["ablation_recovered_reward" if ablation_key(abl) == "reward_last"
                                else "ablation_recovered"]
        tests += [("ablation", "final", summary["ablation_recovered"]),
                  ("ablation", "reward_last", summary["ablation_recovered_reward"])]
    summary["families"] = apply_families(tests, families)
    if families_known:
        summary["declared_families"] = families  # what `gacbench report DIR` without --suite adjusts with again
    by_version = {(r["task"], r["method"], r["staleness"]): r for r in aligned}
    for r in reward_shares:  # the version-aligned reading beside the training reward's
        a = by_version.get((r["task"], r["method"], r["staleness"]))
        if a is not None:
            r["final_by_version"] = {k: a[k] for k in (
                "source", "versions", "lag_removed", "sync", "stale", "value", "gap", "share", "no_gap",
                "share_ci_low", "share_ci_high", "share_ci_kind", "vs_stale_diff", "vs_stale_p", "vs_stale_p_adj",
                "min_detectable_share", "min_detectable_share_family", "n", "share_ci_excluded") if k in a}
    if regime:
        summary["regime"] = regime
        law = law_points(regime)
        if law:
            summary["regime_law"] = law
    sizes = size_points(cells_g, specs_g)
    trend = size_trend(cells_g, sizes) if sizes else None
    if sizes:
        summary["size"] = sizes
        if trend is not None:
            summary["size_trend"] = trend
    if timing is not None:
        summary["timing"] = timing
    write_json(root / "summary.json", _json_safe(summary))
    write_text(root / "summary.md", markdown(cells_g, groups, shares, root, reward_shares, timing, regime,
                                                  ablation_rows, versions, mixed, on_policy, costs,
                                                  sizes, trend, aligned, summary["families"], beyond, uncontrolled,
                                                  checks, blocks, plugins, starts))
    dirs = {(c["task"], c["method"], c["staleness"], c["seed"]): cell_dir(root, c0) for c, c0 in zip(specs_g, specs)}
    figs = (figures(root, cells_g, dirs, groups, regime, ablation_rows, headline_shares(shares, reward_shares, aligned),
                    sizes, trend, headline_beyond(beyond), metrics) if groups else [])
    shares_oh = [r["overhead_share"] for r in records
                 if r.get("overhead_share") is not None and math.isfinite(r["overhead_share"])]
    incomplete = [r["error"] for r in records if r["status"] == "incomplete"]
    return {"figures": figs, "overhead_share_median": statistics.median(shares_oh) if shares_oh else math.nan,
            "summary": summary, "incomplete": incomplete}


def recorded_families(root: Path) -> tuple[dict[str, dict] | None, bool]:
    """``(families, known)``: the multiplicity families that built ``root``'s summary.json (its
    ``declared_families``: the suite's ``families``, or null for the defaults), so that a report rebuilt without
    ``--suite`` adjusts the same families and gives the same verdicts. Where summary.json is missing, unreadable or
    records none (a summary written before they were recorded), the defaults, ``known`` False, and a note on
    standard error: the rebuilt summary then records none either, so the next report says so again. Raises a
    UsageError naming the file when the recorded families are not valid ones."""
    import sys

    from gacbench.bench.validate import check_families
    from gacbench.usage import UsageError

    path = root / "summary.json"
    try:
        summary = read_json(path)
    except (OSError, ValueError):
        summary = None
    if not isinstance(summary, dict) or "declared_families" not in summary:
        why = "records no multiplicity families" if isinstance(summary, dict) else "cannot be read"
        print(f"gacbench report: {path} {why}; adjusting with the default families (pass --suite NAME to use that "
              "suite's families)", file=sys.stderr)
        return None, False
    declared = summary["declared_families"]
    if declared is None:
        return None, True
    try:
        return check_families(str(path), declared), True
    except UsageError as exc:
        raise UsageError(f"{exc}; or pass --suite NAME to use that suite's families") from None


def main(args) -> int:
    import sys

    from gacbench.usage import UsageError

    root = Path(args.dir)
    if not (root / "cells").is_dir():
        raise UsageError(f"{root} holds no benchmark cells (expected the folder {root / 'cells'}); "
                         f"run gacbench bench --out {root} first")
    known = True
    if getattr(args, "suite", None):
        from gacbench.bench.validate import load_suite

        families = load_suite(args.suite).get("families")
    else:
        families, known = recorded_families(root)
    rep = build_report(root, families=families, families_known=known)
    for line in rep["incomplete"]:
        print(f"gacbench report: incomplete cell: {line}", file=sys.stderr)
    print(f"wrote {root / 'summary.json'}, {root / 'summary.md'} and {len(rep['figures'])} figures "
          f"from {len(rep['summary']['cells'])} stored cells"
          + (f" ({len(rep['incomplete'])} incomplete, not counted)" if rep["incomplete"] else ""))
    return 0
