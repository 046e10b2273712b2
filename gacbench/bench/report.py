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
        "seconds": status.get("seconds"), "step_ms": status.get("step_ms"), "overhead_share": status.get("overhead_share"),
        "step_s": status.get("step_s"), "eval_s": status.get("eval_s"), "rss_mb": status.get("rss_mb"),
    })
    reward = [v for _, v in series.get("reward/mean", [])]
    if reward:  # rollout objectives: the training reward is a second, less noisy, measure than a final eval
        k = max(1, len(reward) // 5)
        rec.update({"reward_first": float(np.mean(reward[:k])), "reward_last": float(np.mean(reward[-k:]))})
    return rec


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
            "n": len(recs),
        })
    return out


def recovered_shares(groups: list[dict], key: str = "final") -> list[dict]:
    """Per stabilizer and staleness, on ``{key}_mean`` (``final``: the metric; ``reward_last``: the
    training reward over the last 20% of steps, for rollout objectives)."""
    mean, std = f"{key}_mean", f"{key}_std"
    groups = [g for g in groups if mean in g]
    by = {(g["task"], g["method"], g["staleness"]): g for g in groups}
    rows = []
    for g in groups:
        if g["method"] in REFERENCE_METHODS or g["ablation"] or g["staleness"] == 0:
            continue
        sync, stale = by.get((g["task"], "sync", 0)), by.get((g["task"], "stale", g["staleness"]))
        if not sync or not stale:
            continue
        gap = stale[mean] - sync[mean]
        sign = -1.0 if (key == "reward_last" or g["higher_is_better"]) else 1.0  # gap > 0 means stale is worse
        share = (stale[mean] - g[mean]) / gap if abs(gap) > 1e-12 and sign * gap > 0 else math.nan
        # standard error of the gap from the sample (ddof=1) std of each group; unknown with a single seed
        if min(sync["n"], stale["n"]) < 2:
            se = math.nan
        else:
            se = math.sqrt(sum((x[std] or 0.0) ** 2 / (x["n"] - 1) for x in (sync, stale)))
        rows.append({"task": g["task"], "method": g["method"], "staleness": g["staleness"], "share": share,
                     "sync": sync[mean], "stale": stale[mean], "value": g[mean],
                     "no_gap": not (abs(gap) > 1e-12 and sign * gap > 0), "gap": gap, "gap_se": se,
                     "gap_within_noise": None if math.isnan(se) else bool(abs(gap) < 2.0 * se)})
    return rows


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.{digits}g}"


def _method_table(title: str, groups: list[dict], cell) -> list[str]:
    """A markdown table, one row per method and one column per staleness, each entry ``cell(group)``."""
    svals = sorted({g["staleness"] for g in groups})
    lines = [f"## {title}", "", "| method | " + " | ".join(f"s={s}" for s in svals) + " |", "|---|" + "---|" * len(svals)]
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
        share = "n/a (stale no worse than sync)" if r["no_gap"] else f"{r['share']:.2f}"
        if not r["no_gap"] and r["gap_within_noise"]:
            share += " (gap < 2 s.e. of seeds: not meaningful)"
        elif not r["no_gap"] and r["gap_within_noise"] is None:
            share += " (one seed: noise unknown)"
        lines.append(f"| {r['task']} | {r['staleness']} | {r['method']} | {_fmt(r['sync'], 4)} | {_fmt(r['stale'], 4)} | "
                     f"{_fmt(r['value'], 4)} | {share} |")
    return lines + [""]


def markdown(cells: list[dict], groups: list[dict], shares: list[dict], root: Path,
             reward_shares: list[dict] | None = None, timing: dict | None = None) -> str:
    lines = [f"# Benchmark summary: `{root}`", "",
             "Regenerate with `gacbench report " + str(root) + "`. Definitions: see `gacbench/bench/report.py`.", ""]
    tasks = sorted({g["task"] for g in groups})
    main = [g for g in groups if not g["ablation"]]
    for task in tasks:
        tg = [g for g in main if g["task"] == task]
        if not tg:
            continue
        metric, hib = tg[0]["metric"], tg[0]["higher_is_better"]
        lines += _method_table(f"{task}: final {metric} ({'higher' if hib else 'lower'} is better), mean ± std over seeds "
                               "[diverged share]", tg,
                               lambda g: f"{_fmt(g['final_mean'], 4)} ± {_fmt(g['final_std'], 2)}"
                                         + (f" [{g['diverged_frac']:.0%}]" if g["diverged_frac"] else ""))
    if shares:
        lines += _share_table("Recovered share of the stale–sync gap: (stale − method) / (stale − sync)", shares)
    rewarded = [g for g in main if "reward_last_mean" in g]
    for task in sorted({g["task"] for g in rewarded}):
        lines += _method_table(f"{task}: training reward, mean over the last 20% of steps (first 20% in brackets), mean ± std "
                               "over seeds", [g for g in rewarded if g["task"] == task],
                               lambda g: f"{_fmt(g['reward_last_mean'], 3)} ± {_fmt(g['reward_last_std'], 2)} "
                                         f"({_fmt(g['reward_first_mean'], 3)})")
    if reward_shares:
        lines += _share_table("Recovered share of the stale–sync gap in training reward (last 20% of steps)", reward_shares)
    lines += ["## Alignment statistics (paper Table 3), after the warm-up", "",
              "| task | method | s | median c_t | q0.9(|c_t|) | Pr(|c_t| ≤ 0.05) | seeds |", "|---|---|---|---|---|---|---|"]
    for g in main:
        lines.append(f"| {g['task']} | {g['method']} | {g['staleness']} | {_fmt(g['cos_median'])} | {_fmt(g['cos_abs_q90'])} | "
                     f"{_fmt(g['cos_abs_le_005'], 2)} | {g['n']} |")
    abl = [g for g in groups if g["ablation"]]
    if abl:
        lines += ["", "## Threshold ablation (c_low, c_high)", "", "| task | method | s | final (mean) | diverged |", "|---|---|---|---|---|"]
        for g in abl:
            lines.append(f"| {g['task']} | `{g['method']}` | {g['staleness']} | {_fmt(g['final_mean'], 4)} | {g['diverged_frac']:.0%} |")
    sections = (("Failed cells", "failed"), ("Incomplete cells (stored files damaged; not counted)", "incomplete"))
    for title, kind in sections:
        listed = [c for c in cells if c["status"] != "done" and (c["status"] == "incomplete") == (kind == "incomplete")]
        if listed:
            lines += ["", f"## {title}", ""] + [f"- {c['task']} / {c['method']} / s={c['staleness']} / "
                                                f"seed {c['seed']}: {c.get('error')}" for c in listed]
    done = [c for c in cells if c["status"] == "done" and c.get("step_ms")]
    if done:
        lines += ["", "## Timing", "",
                  f"Median step {statistics.median(c['step_ms'] for c in done):.2f} ms; median share of step time outside the "
                  f"objective's forward+backward {statistics.median(c['overhead_share'] for c in done):.0%} "
                  f"({len(done)} cells, {sum(c['seconds'] for c in done):.0f} s of cell time)."
                  + _step_share_note(timing)]
    return "\n".join(lines) + "\n"


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


def figures(root: Path, cells: list[dict], cell_specs: list[dict], groups: list[dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: list[Path] = []

    def save(fig, name: str, legend_ax=None) -> None:
        if legend_ax is not None:
            legend_ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(root / name, dpi=110)
        plt.close(fig)
        out.append(root / name)

    specs = {(c["task"], c["method"], c["staleness"], c["seed"]): c for c in cell_specs}
    main = [c for c in cells if c["status"] == "done" and not c["ablation"]]
    tasks = sorted({c["task"] for c in main})
    colors = {"sync": "black", "stale": "tab:red"}
    palette = iter(plt.cm.tab10.colors[2:])
    for m in sorted({c["method"] for c in main}):
        colors.setdefault(m, next(palette, "tab:gray"))

    def series(rec: dict, key: str) -> list[tuple[int, float]]:
        return read_metrics(cell_dir(root, specs[(rec["task"], rec["method"], rec["staleness"], rec["seed"])]) / "metrics.csv").get(key, [])

    # Figures 1 and 4: metric curves across staleness, mean over seeds.
    for task in tasks:
        tc = [c for c in main if c["task"] == task]
        metric = tc[0]["metric"]
        svals = sorted({c["staleness"] for c in tc if c["staleness"] > 0})
        fig, axes = plt.subplots(1, max(1, len(svals)), figsize=(4 * max(1, len(svals)), 3.2), squeeze=False, sharey=True)
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
                ax.plot([x for x, _ in cs][: len(v)], v, label=f"{r['method']} (s={r['staleness']})", color=colors[r["method"]], lw=1)
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
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", label=m, color=colors[m], capsize=2)
        ax.set_title(task)
        ax.set_xlabel("staleness s")
        ax.set_ylabel(tg[0]["metric"] if tg else "")
        if tg and not tg[0]["higher_is_better"]:
            ax.set_yscale("log")
    save(fig, "fig_robustness.png", axes[0][-1])

    # Figure 5: (c_low, c_high) heatmap from the ablation cells.
    abl = [g for g in groups if g["ablation"]]
    if abl:
        import re

        atasks = sorted({g["task"] for g in abl})
        fig, axes = plt.subplots(1, len(atasks), figsize=(4 * len(atasks), 3.4), squeeze=False)
        for ax, task in zip(axes[0], atasks):
            pts = {}
            tg = [g for g in abl if g["task"] == task]
            for g in tg:
                m = re.search(r"c_low=([0-9.]+),c_high=([0-9.]+)", g["method"])
                if m:
                    pts[(float(m.group(1)), float(m.group(2)))] = g["final_mean"]
            lows, highs = sorted({k[0] for k in pts}), sorted({k[1] for k in pts})
            grid = np.full((len(lows), len(highs)), np.nan)
            for (lo, hi), v in pts.items():
                grid[lows.index(lo), highs.index(hi)] = v
            im = ax.imshow(grid, origin="lower", cmap="viridis" if tg[0]["higher_is_better"] else "viridis_r", aspect="auto")
            ax.set_xticks(range(len(highs)), [f"{h:g}" for h in highs])
            ax.set_yticks(range(len(lows)), [f"{lo:g}" for lo in lows])
            ax.set_xlabel("c_high")
            ax.set_ylabel("c_low")
            ax.set_title(f"{task}, s={tg[0]['staleness']}: final {tg[0]['metric']} (bright = better)")
            fig.colorbar(im, ax=ax)
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
    shares = recovered_shares(groups)
    reward_shares = recovered_shares(groups, "reward_last")
    timing = read_timing(root)
    summary = {"cells": records, "groups": groups, "recovered": shares, "recovered_reward": reward_shares}
    if timing is not None:
        summary["timing"] = timing
    write_json(root / "summary.json", _json_safe(summary))
    (root / "summary.md").write_text(markdown(records, groups, shares, root, reward_shares, timing))
    figs = figures(root, records, specs, groups) if groups else []
    shares_oh = [r["overhead_share"] for r in records if r.get("overhead_share") is not None and math.isfinite(r["overhead_share"])]
    incomplete = [r["error"] for r in records if r["status"] == "incomplete"]
    return {"figures": figs, "overhead_share_median": statistics.median(shares_oh) if shares_oh else math.nan,
            "summary": summary, "incomplete": incomplete}


def main(args) -> int:
    import sys

    from gacbench.cli import UsageError

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
