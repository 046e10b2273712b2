"""Rebuilds paper/async/summary.md and paper/async/fig_async_vs_sim.png from the stored runs alone:

- runs/async/study*/seed*/{async,fixed,uniform}/record.json (written by paper/async/run.py; one section per
  study folder): per way, the lag, the
  c_t statistics after the warm-up (median, mean, q_0.9(|c_t|), Pr(|c_t| <= 0.05)), the final training reward
  (mean of the last 10 steps) and greedy pass@1, as mean +- standard deviation over seeds; the two-sample
  Kolmogorov-Smirnov distance between each simulator's c_t distribution and the async one (seeds pooled), beside
  the distance between async seeds (what the seed alone moves); the gap between reward curves, likewise;
- runs/async/bench*.json (written by ``gacbench async-bench --json``): the speedups, and their median.

    python paper/async/make.py [--runs runs/async] [--warmup 5]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
WAYS = ("async", "fixed", "uniform")
LABEL = {"async": "real async (Ray worker)", "fixed": "simulator, fixed s = round(mean lag)",
         "uniform": "simulator, uniform s_t on the async lag range"}


def load(study: Path) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {w: [] for w in WAYS}
    for seed_dir in sorted(study.glob("seed*")):
        records = {w: seed_dir / w / "record.json" for w in WAYS}
        if all(p.exists() for p in records.values()):  # only complete seeds: the three ways side by side
            for w, p in records.items():
                rec = json.loads(p.read_text())
                rec["seed"] = int(seed_dir.name[4:])
                runs[w].append(rec)
    return runs


def ct(rec: dict, warmup: int) -> np.ndarray:
    vals = [c for c in rec["cos"][warmup:] if c is not None and np.isfinite(c)]
    return np.asarray(vals, dtype=np.float64)


def stats(rec: dict, warmup: int) -> dict[str, float]:
    c = ct(rec, warmup)
    lag = np.asarray(rec["lag"], dtype=np.float64)
    return {"lag_mean": float(lag.mean()), "lag_min": float(lag[warmup:].min()), "lag_max": float(lag.max()),
            "median": float(np.median(c)), "mean": float(c.mean()), "q90_abs": float(np.quantile(np.abs(c), 0.9)),
            "frac_le_0.05": float(np.mean(np.abs(c) <= 0.05)), "reward_final": float(np.mean(rec["reward"][-10:])),
            "eval_acc": float(rec["eval_acc"])}


def smooth(x, k: int = 5) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return np.convolve(x, np.ones(k) / k, mode="valid")


def ks(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    from scipy.stats import ks_2samp

    r = ks_2samp(a, b)
    return float(r.statistic), float(r.pvalue)


def fmt(xs: list[float], digits: int = 3) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    return f"{statistics.mean(xs):.{digits}f} ± {statistics.stdev(xs):.{digits}f}"


def study_section(where: str, runs: dict[str, list[dict]], warmup: int) -> list[str]:
    """The study stored in the folder ``where`` (as the summary names it, relative to the repository)."""
    n = len(runs["async"])
    if n == 0:
        return [f"No complete seed under {where}/ (run `python paper/async/run.py --root {where}`)."]
    first = runs["async"][0]
    set_ = first.get("settings", {})
    lines = [f"## Is the simulator faithful? {where}/ ({n} seed(s), {first['steps']} steps each)", "",
             f"Settings: rollout {json.dumps(set_.get('rollout', {}))}, lr {set_.get('lr')}, engine "
             f"{set_.get('engine', {}).get('name')}; c_t statistics after a warm-up of {warmup} steps; mean ± sd "
             "over seeds.", "",
             "| way | lag mean | lag range | median c_t | mean c_t | q0.9 abs c_t | Pr(abs c_t ≤ 0.05) | final reward "
             "| pass@1 |",
             "|---|---|---|---|---|---|---|---|---|"]
    table = {w: [stats(r, warmup) for r in runs[w]] for w in WAYS}
    for w in WAYS:
        s = table[w]
        rng = f"{int(min(x['lag_min'] for x in s))}..{int(max(x['lag_max'] for x in s))}"
        lines.append(f"| {LABEL[w]} | {fmt([x['lag_mean'] for x in s], 2)} | {rng} | {fmt([x['median'] for x in s])} | "
                     f"{fmt([x['mean'] for x in s])} | {fmt([x['q90_abs'] for x in s])} | "
                     f"{fmt([x['frac_le_0.05'] for x in s], 2)} | {fmt([x['reward_final'] for x in s])} | "
                     f"{fmt([x['eval_acc'] for x in s])} |")
    pooled = {w: np.concatenate([ct(r, warmup) for r in runs[w]]) for w in WAYS}
    lines += ["", "Distances to the async runs (c_t: two-sample KS distance of the pooled post-warm-up c_t; "
              "reward: mean absolute gap between the 5-step-smoothed reward curves, averaged over seeds), beside "
              "the same distances between two async seeds (the seed's own effect):", "",
              "| pair | KS distance of c_t | KS p-value | reward-curve gap |", "|---|---|---|---|"]
    for w in ("fixed", "uniform"):
        d, p = ks(pooled["async"], pooled[w])
        gap = statistics.mean(float(np.mean(np.abs(smooth(a["reward"]) - smooth(b["reward"]))))
                              for a, b in zip(runs["async"], runs[w]))
        lines.append(f"| async vs {w} | {d:.3f} | {p:.2g} | {gap:.4f} |")
    pairs = list(itertools.combinations(runs["async"], 2))
    if pairs:
        d = statistics.mean(ks(ct(a, warmup), ct(b, warmup))[0] for a, b in pairs)
        gap = statistics.mean(float(np.mean(np.abs(smooth(a["reward"]) - smooth(b["reward"])))) for a, b in pairs)
        lines.append(f"| async seed vs async seed (mean over pairs) | {d:.3f} | | {gap:.4f} |")
    lines += ["", "(c_t is autocorrelated along a run, so the KS p-values overstate the evidence; read the distances "
              "against the seed-vs-seed row.)"]
    return lines


def bench_section(runs_dir: Path) -> list[str]:
    files = sorted(runs_dir.glob("bench*.json"))
    if not files:
        shown = shown_path(runs_dir)
        return [f"No `gacbench async-bench` record under {shown}/ (run `gacbench async-bench --steps 30 "
                f"--max-staleness 4 --json {shown}/bench-1.json`)."]
    recs = [(f, json.loads(f.read_text())) for f in files]
    lines = ["## Wall-clock: `gacbench async-bench`", "",
             "| record | engine | steps | s_max | sync s | async s | speedup | ideal (G + T) / max(G, T) | "
             "generation share | lag mean | lag max | dropped | reward sync / async | load (1 min) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for f, r in recs:
        load = r.get("load_avg_1min")
        ideal, share = r.get("ideal_speedup"), r.get("generate_share")
        lines.append(f"| {f.name} | {r['engine']} | {r['steps']} | {r['max_staleness']} | {r['sync_s']:.2f} | "
                     f"{r['async_s']:.2f} | {r['speedup']:.2f} | {'' if ideal is None else f'{ideal:.2f}'} | "
                     f"{'' if share is None else f'{share:.2f}'} | {r['lag_mean']:.2f} | {r['lag_max']} | "
                     f"{r['dropped']} | "
                     f"{r['sync_reward_final']:.3f} / {r['async_reward_final']:.3f} | "
                     f"{'' if load is None else f'{load:.1f}'} |")
    by_setting: dict[tuple, list[float]] = {}
    for f, r in recs:
        series = f.stem.rstrip("0123456789").rstrip("-_")  # bench-quiet-2 -> bench-quiet
        key = (series, r["engine"], r["steps"], r["max_staleness"], r["settings"]["prompts"])
        by_setting.setdefault(key, []).append(r["speedup"])
    lines.append("")
    for (series, engine, steps, s_max, prompts), xs in by_setting.items():
        lines.append(f"Median speedup of the {series}-* records ({engine}, {prompts} prompts, {steps} steps, s_max "
                     f"{s_max}): **{statistics.median(xs):.2f}** over {len(xs)} run(s) "
                     f"({', '.join(f'{x:.2f}' for x in xs)}).")
    return lines


def figure(name: str, runs: dict[str, list[dict]], warmup: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"async": "black", "fixed": "tab:blue", "uniform": "tab:orange"}
    fig, ax = plt.subplots(1, 4, figsize=(18, 4))
    for w in WAYS:
        if not runs[w]:
            continue
        rew = np.mean([smooth(r["reward"]) for r in runs[w]], axis=0)
        ax[0].plot(np.arange(len(rew)) + 4, rew, color=colors[w], label=LABEL[w])
        cos = np.mean([smooth([np.nan if c is None else c for c in r["cos"]]) for r in runs[w]], axis=0)
        ax[1].plot(np.arange(len(cos)) + 4, cos, color=colors[w])
        ax[2].hist(np.concatenate([ct(r, warmup) for r in runs[w]]), bins=30, histtype="step", density=True,
                   color=colors[w])
        lag = np.mean([r["lag"] for r in runs[w]], axis=0)
        ax[3].plot(lag, color=colors[w])
    ax[0].set(title="training reward (5-step mean, mean over seeds)", xlabel="step")
    ax[1].set(title="c_t (5-step mean, mean over seeds)", xlabel="step")
    ax[2].set(title=f"c_t after step {warmup} (all seeds)", xlabel="c_t")
    ax[3].set(title="lag of the consumed rollouts (mean over seeds)", xlabel="step")
    ax[0].legend(fontsize=8)
    fig.suptitle(name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def shown_path(path: Path) -> Path:
    """``path`` relative to the repository when it lies inside it (as a command typed there names it)."""
    return path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=str(ROOT / "runs" / "async"))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=str(HERE), help="where summary.md and the figures go (default paper/async)")
    args = parser.parse_args(argv)
    runs_dir, out = Path(args.runs), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shown, out_shown = shown_path(runs_dir), shown_path(out)
    command = f"python paper/async/make.py --runs {shown}" + ("" if out.resolve() == HERE else f" --out {out_shown}")
    lines = ["# Asynchronous rollouts: measured tables", "",
             f"Generated by `{command}` from the records there (see {out_shown}/README.md for the reading).", ""]
    lines += bench_section(runs_dir)
    for study in sorted(p for p in runs_dir.glob("study*") if p.is_dir()):
        runs, where = load(study), f"{shown}/{study.name}"
        lines += [""] + study_section(where, runs, args.warmup)
        if runs["async"]:
            figure(where, runs, args.warmup, out / f"fig_{study.name.replace('-', '_')}.png")
            lines += ["", f"Figure: `fig_{study.name.replace('-', '_')}.png`."]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
