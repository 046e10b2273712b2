"""The PNG figures of a benchmark directory, one function per figure (names and contents: docs/bench.md)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from gacbench.bench.groups import BAND_RANGE_SEEDS, VERSION_SMOOTH, version_curve, version_measure
from gacbench.bench.records import POLICY_REWARD, read_metrics
from gacbench.bench.regime import PAPER_TABLE3, law_points, size_sync_cells
from gacbench.bench.stats import REFERENCE_METHODS, ablation_key, ablation_share_rows, significant
from gacbench.jsonio import save_figure

#: At most this many methods besides sync and stale share a panel of a curve figure; a task with more gets one
#: row of panels per method group (:func:`method_panels`)
PANEL_METHODS = 5
#: The forest plot's x range is cut to this interval; an interval end beyond it is drawn as an arrow at the edge
SHARE_AXIS = (-1.5, 2.5)


def figure_legend_entries(fig, axes=None) -> tuple[list, list[str]]:
    """The labelled artists of every panel of ``fig`` (or of ``axes``), one per label in first-seen order: the
    legend drawn on one panel then names the methods that appear only in others (a method run at s = 16 alone)."""
    entries: dict[str, object] = {}
    for ax in fig.axes if axes is None else axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    return list(entries.values()), list(entries)


def _seeds_label(method: str, seeds: set[int] | int, sync_seeds: int | None) -> str:
    """A curve's legend label: the method, with its count of seeds where it is not sync's (a method on 3 seeds drawn
    beside sync and stale on 5 says so)."""
    counts = {seeds} if isinstance(seeds, int) else seeds
    if sync_seeds is None or counts == {sync_seeds} or not counts:
        return method
    return f"{method} ({'/'.join(str(n) for n in sorted(counts))} seeds)"


def _trailing_mean(curve: list[tuple[int, float]], window: int = 10) -> tuple[list[int], np.ndarray]:
    """A curve's ``window``-point moving average, each mean drawn at the last step of its window (the value at
    step t is the mean of the points up to t: nothing after t moves it); a curve shorter than the window is
    averaged over its length."""
    w = max(1, min(window, len(curve)))
    values = np.convolve([v for _, v in curve], np.ones(w) / w, mode="valid")
    return [x for x, _ in curve[w - 1:]], values


def _smooth_mean(curves: list[list[tuple[int, float]]], window: int = 10) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Steps, mean and population std over curves (cut to the shortest) of their ``window``-step moving averages,
    each drawn at the last step of its window (:func:`_trailing_mean`)."""
    curves = [c for c in curves if c]
    if not curves:
        return [], np.array([]), np.array([])
    n = min(len(c) for c in curves)
    w = max(1, min(window, n))
    steps = _trailing_mean(curves[0][:n], w)[0]
    arr = np.array([_trailing_mean(c[:n], w)[1] for c in curves])
    return steps, arr.mean(0), arr.std(0)


class Canvas:
    """What every figure of a directory shares: pyplot (Agg), the done main-grid cells and their tasks, one colour
    per method, the methods that recover per task (``recovering``, set by :func:`figures`), each cell's
    metrics.csv (read once, from ``cell_dirs``: (task, method, staleness, seed) -> its directory, into ``metrics``:
    path -> :func:`read_metrics`' parse, which may hold it already), and the list of the figures written."""

    def __init__(self, root: Path, cells: list[dict], cell_dirs: dict[tuple, Path],
                 metrics: dict[Path, dict] | None = None) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.plt, self.root, self.cells = plt, root, cells
        self.out: list[Path] = []
        self.dirs = cell_dirs
        self.labelled = {c["task"] for c in cells if "group" in c}
        self.main = [c for c in cells if c["status"] == "done" and not c["ablation"]]
        self.tasks = sorted({c["task"] for c in self.main})
        self.colors = {"sync": "black", "stale": "tab:red"}
        self._model_colors: dict[str, tuple] = {}
        # tab20 without its reds (stale's colour): its nine dark shades, then Dark2's eight, then tab20's light
        # shades (hard to see on white): distinct colours for up to 26 other methods, light ones only beyond 17
        tab20 = [c for i, c in enumerate(plt.cm.tab20.colors) if i not in (6, 7)]
        palette = iter(tab20[0::2] + list(plt.cm.Dark2.colors) + tab20[1::2])
        for m in sorted({c["method"] for c in self.main}):
            self.colors.setdefault(m, next(palette, "tab:gray"))
        self._metrics: dict[Path, dict] = {} if metrics is None else metrics  # path -> read_metrics' parse
        #: per task, the methods whose share is positive and significant after Holm's adjustment at some s
        self.recovering: dict[str, set[str]] = {}

    def model_color(self, names) -> dict[str, tuple]:
        """One tab10 colour per name, given in sorted order of the names of each call, the same in every figure of
        the summary (``fig_law`` asks for its models, ``fig_size`` for its tasks: alike where tasks are named by
        model, as in llm-size)."""
        for name in sorted(set(names) - set(self._model_colors)):
            self._model_colors[name] = self.plt.cm.tab10.colors[len(self._model_colors) % 10]
        return self._model_colors

    def save(self, fig, name: str, legend_ax=None, outside: bool = False) -> None:
        """Write ``fig`` to ROOT/name (with one legend of every panel's entries on ``legend_ax``) and close it.
        ``outside``: the figure has legends beside its axes (:meth:`legend_beside`), kept inside the image."""
        if legend_ax is not None:
            handles, labels = figure_legend_entries(fig)
            legend_ax.legend(handles, labels, fontsize=7)
        fig.tight_layout()
        save_figure(fig, self.root / name, dpi=110, **({"bbox_inches": "tight"} if outside else {}))
        self.plt.close(fig)
        self.out.append(self.root / name)

    @staticmethod
    def legend_beside(fig, axes) -> None:
        """One legend of the entries of ``axes`` (a row of panels), to the right of the row's last panel."""
        handles, labels = figure_legend_entries(fig, axes)
        if handles:
            axes[-1].legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                            borderaxespad=0.0, frameon=False)

    def series(self, rec: dict, key: str) -> list[tuple[int, float]]:
        """The logged series ``key`` of the cell ``rec``: [(step, value), ...], missing values (NaN: a c_t of a
        step whose gradient was zero or non-finite) left out."""
        path = self.dirs[(rec["task"], rec["method"], rec["staleness"], rec["seed"])] / "metrics.csv"
        if path not in self._metrics:
            self._metrics[path] = read_metrics(path)
        return [(s, v) for s, v in self._metrics[path].get(key, []) if math.isfinite(v)]

    def stem(self, task: str) -> str:
        """The part of a per-task figure's file name that names ``task``: the task's name, or for a group labelled
        by its settings (``quadratic (lr=0.05, steps=200)``) the label with every character outside letters,
        digits and ``-_+.=`` replaced: ``quadratic_lr=0.05_steps=200``."""
        if task not in self.labelled:
            return task
        return re.sub("_+", "_", "".join(ch if ch.isalnum() or ch in "-_+.=" else "_" for ch in task)).strip("_")


def method_panels(methods: list[str], recovering: set[str]) -> list[tuple[str, list[str]]]:
    """The methods of a curve figure besides sync and stale, in rows of panels (every row also draws sync and
    stale): one row when there are at most PANEL_METHODS; else the GAC readings (names starting with ``gac``), the
    corrections that recover (``recovering``: a positive share whose Holm-adjusted test against stale rejects at
    some s) and the other methods, in that order, each cut into rows of at most PANEL_METHODS. (title, methods)
    per row; the title of a single row is empty."""
    methods = [m for m in dict.fromkeys(methods) if m not in REFERENCE_METHODS]
    if len(methods) <= PANEL_METHODS:
        return [("", methods)]
    gac = [m for m in methods if m.startswith("gac")]
    rec = [m for m in methods if m not in gac and m in recovering]
    rest = [m for m in methods if m not in gac and m not in rec]
    return _chunked([("GAC readings", gac), ("corrections that recover", rec), ("other methods", rest)])


def _chunked(groups: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """Each (title, methods) group cut into panels of at most PANEL_METHODS methods, ``(k/K)`` added to the title
    of a group cut in K; an empty group left out."""
    rows = []
    for title, ms in groups:
        chunks = [ms[i:i + PANEL_METHODS] for i in range(0, len(ms), PANEL_METHODS)]
        rows += [(title + (f" ({k + 1}/{len(chunks)})" if len(chunks) > 1 else ""), chunk)
                 for k, chunk in enumerate(chunks)]
    return rows


def family_panels(methods: list[str]) -> list[tuple[str, list[str]]]:
    """The methods besides sync and stale in panels by family (:func:`gacbench.methods.method_family`: the GAC
    readings, the loss-side corrections, combinations, the other methods such as ``lr-scaled``, in that order), a
    family of more than PANEL_METHODS cut into panels of PANEL_METHODS; (title, methods) per panel. A single panel
    of no methods (titled ``""``) where there are none."""
    from gacbench.methods import FAMILIES, method_family

    methods = [m for m in dict.fromkeys(methods) if m not in REFERENCE_METHODS]
    family = {m: method_family(m) for m in methods}
    return _chunked([(f, [m for m in methods if family[m] == f]) for f in FAMILIES]) or [("", [])]


def on_policy_panel(cells: list[dict]) -> bool:
    """Whether a task's curve figures get an s = 0 column: a method other than sync and stale ran at s = 0 (a
    suite task's ``on_policy``), drawn there beside sync."""
    return any(c["staleness"] == 0 and c["method"] not in REFERENCE_METHODS for c in cells)


def curves_figures(cv: Canvas) -> None:
    """Figures 1 and 4: metric curves across staleness, mean over seeds (``fig_curves_TASK.png``): one column
    per staleness, one row per method group (:func:`method_panels`), sync and stale in every panel."""
    plt = cv.plt
    for task in cv.tasks:
        tc = [c for c in cv.main if c["task"] == task]
        metric = tc[0]["metric"]
        cols = [0] * on_policy_panel(tc) + sorted({c["staleness"] for c in tc if c["staleness"] > 0}) or [0]
        panels = method_panels([c["method"] for c in tc], cv.recovering.get(task, set()))
        seeds_sync = sum(c["method"] == "sync" for c in tc) or None
        fig, axes = plt.subplots(len(panels), len(cols), figsize=(4 * len(cols), 3.2 * len(panels)), squeeze=False,
                                 sharey=True)
        for row, (title, methods) in zip(axes, panels):
            for ax, s in zip(row, cols):
                for m in (*REFERENCE_METHODS, *methods):
                    recs = [c for c in tc if c["method"] == m and (c["staleness"] == s or m == "sync")]
                    curves = [c for c in (cv.series(r, f"eval/{metric}") for r in recs) if c]
                    if not curves:
                        continue
                    n = min(len(c) for c in curves)
                    steps = [curves[0][i][0] for i in range(n)]
                    mean = np.mean([[c[i][1] for i in range(n)] for c in curves], axis=0)
                    label = m if m == "sync" else _seeds_label(m, len(curves), seeds_sync)
                    ax.plot(steps, mean, label=label, color=cv.colors[m], ls="--" if m == "sync" else "-",
                            lw=1.6 if m in REFERENCE_METHODS else 1.1)
                ax.set_title(f"{task}, s={s}" + (f": {title}" if title else ""), fontsize=9)
                ax.set_xlabel("step")
                if not tc[0]["higher_is_better"]:
                    ax.set_yscale("log")
            row[0].set_ylabel(metric)
            cv.legend_beside(fig, row)
        cv.save(fig, f"fig_curves_{cv.stem(task)}.png", outside=True)


#: the most methods :func:`cos_figure` draws in one panel; a task with more draws sync, stale and gac only
COS_FIGURE_METHODS = 5
COS_FIGURE_CORE = ("sync", "stale", "gac")


def cos_figure(cv: Canvas) -> None:
    """Figures 3 and 6: c_t over training, sync vs stale vs stabilizers, at the largest staleness, one seed (the
    smallest, named in the title), the y-range fitted to the curves, the legend beside the panels
    (``fig_cos.png``; ``fig_cos_methods`` has the mean over seeds). A task with more than
    :data:`COS_FIGURE_METHODS` methods draws sync, stale and gac (the paper's three), and its title says that
    ``fig_cos_methods_TASK.png`` has every method."""
    plt = cv.plt
    fig, axes = plt.subplots(1, max(1, len(cv.tasks)), figsize=(4 * max(1, len(cv.tasks)), 3.2), squeeze=False)
    for ax, task in zip(axes[0], cv.tasks):
        tc = [c for c in cv.main if c["task"] == task]
        smax, seed = max(c["staleness"] for c in tc), min(c["seed"] for c in tc)
        rows = [c for c in tc if c["seed"] == seed and (c["staleness"] == smax or c["method"] == "sync")]
        title = f"{task}: c_t (10-step mean), seed {seed}"
        methods = {c["method"] for c in rows}
        if len(methods) > COS_FIGURE_METHODS and len(methods & set(COS_FIGURE_CORE)) >= 2:
            rows = [c for c in rows if c["method"] in COS_FIGURE_CORE]
            title += f"\nevery method: fig_cos_methods_{cv.stem(task)}.png"
        drawn: list[float] = []
        for r in rows:
            cs = cv.series(r, "align/cos")
            if cs:
                steps, v = _trailing_mean(cs)
                ax.plot(steps, v, label=f"{r['method']} (s={r['staleness']})", color=cv.colors[r["method"]], lw=1)
                drawn.extend(float(x) for x in v if np.isfinite(x))
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        if drawn:
            lo, hi = min(min(drawn), 0.0), max(max(drawn), 0.0)
            pad = 0.05 * max(hi - lo, 0.1)
            ax.set_ylim(max(-1.05, lo - pad), min(1.05, hi + pad))
        ax.axhline(0, color="gray", lw=0.5)
    cv.legend_beside(fig, list(axes[0]))
    cv.save(fig, "fig_cos.png", outside=True)


def robustness_figure(cv: Canvas, groups: list[dict]) -> None:
    """Robustness across staleness: per method against s, the training reward of the last 20% of steps where every
    group of the task has it (rollout objectives), else the final metric; mean ± sd over seeds (population sd,
    ddof 0) (``fig_robustness.png``)."""
    plt = cv.plt
    maing = [g for g in groups if not g["ablation"]]
    entries = len({g["method"] for g in maing})  # the legend beside the panels: as tall as the figure, at most
    fig, axes = plt.subplots(1, max(1, len(cv.tasks)), figsize=(4 * max(1, len(cv.tasks)), max(3.2, 0.19 * entries)),
                             squeeze=False)
    for ax, task in zip(axes[0], cv.tasks):
        tg = [g for g in maing if g["task"] == task]
        key = "reward_last" if tg and all("reward_last_mean" in g for g in tg) else "final"
        sync = next((g for g in tg if g["method"] == "sync"), None)
        if sync:
            ax.axhline(sync[f"{key}_mean"], color="black", ls="--", label="sync")
        methods = list(dict.fromkeys(g["method"] for g in tg if g["method"] != "sync"))
        svals = sorted({g["staleness"] for g in tg if g["method"] != "sync"})
        # the methods side by side around each s, over a quarter of the smallest spacing of s, so bars do not overlap
        width = 0.25 * (min(np.diff(svals)) if len(svals) > 1 else 1.0)
        for k, m in enumerate(methods):
            shift = width * (k / (len(methods) - 1) - 0.5) if len(methods) > 1 else 0.0
            pts = sorted((g["staleness"], g[f"{key}_mean"], g[f"{key}_std"]) for g in tg if g["method"] == m)
            counts = {g["n"] for g in tg if g["method"] == m and "n" in g}
            label = _seeds_label(m, counts, sync.get("n") if sync else None)
            ax.errorbar([p[0] + shift for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o",
                        label=label, color=cv.colors[m], capsize=2, lw=1.6 if m == "stale" else 1.0, ms=4)
        if svals:
            ax.set_xticks(svals, [str(x) for x in svals])
        ax.set_title(f"{task}: mean ± sd over seeds (ddof 0)", fontsize=9)
        ax.set_xlabel("staleness s (methods side by side)")
        ax.set_ylabel("training reward (last 20% of steps)" if key == "reward_last" else tg[0]["metric"] if tg else "")
        if key == "final" and tg and not tg[0]["higher_is_better"]:
            ax.set_yscale("log")
    cv.legend_beside(fig, list(axes[0]))
    cv.save(fig, "fig_robustness.png", outside=True)


def staleness_figures(cv: Canvas) -> None:
    """Figure 1 (paper): training reward (the metric where no reward is logged) and c_t across staleness, sync
    and stale, mean over seeds of 10-step moving averages (``fig_staleness_TASK.png``)."""
    plt = cv.plt
    for task in cv.tasks:
        tc = [c for c in cv.main if c["task"] == task and c["method"] in REFERENCE_METHODS]
        svals = sorted({c["staleness"] for c in tc})
        if len(svals) < 2:
            continue
        has_reward = any(cv.series(c, "reward/mean") for c in tc)
        metric = tc[0]["metric"]
        ykey, ylabel = ("reward/mean", "training reward (10-step mean)") if has_reward else (f"eval/{metric}", metric)
        cmap = plt.cm.viridis(np.linspace(0.0, 0.85, max(1, len(svals) - 1)))
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.3))
        for i, sv in enumerate(svals):
            recs = [c for c in tc if c["staleness"] == sv]
            color = "black" if sv == 0 else cmap[min(i - 1, len(cmap) - 1)]
            for ax, key in zip(axes, (ykey, "align/cos")):
                steps, mean, _ = _smooth_mean([cv.series(r, key) for r in recs], 10 if key != ykey or has_reward else 1)
                if steps:
                    ax.plot(steps, mean, color=color, lw=1.2, ls="--" if sv == 0 else "-",
                            label="sync (s=0)" if sv == 0 else f"stale s={sv}")
        axes[0].set_ylabel(ylabel)
        axes[1].set_ylabel("c_t (10-step mean)")
        axes[1].axhline(0, color="gray", lw=0.5)
        if not has_reward and not tc[0]["higher_is_better"]:
            axes[0].set_yscale("log")
        for ax, title in zip(axes, (f"{task}: {ylabel} across staleness", f"{task}: c_t across staleness")):
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step")
        cv.save(fig, f"fig_staleness_{cv.stem(task)}.png", axes[1])


def method_figures(cv: Canvas) -> None:
    """Figure 3 (paper): c_t per method at each staleness, mean over seeds of 10-step moving averages
    (``fig_cos_methods_TASK.png``); Figure 4 (paper): training-reward trajectories per method at each staleness,
    mean ± sd over seeds (population sd, ddof 0; rollout objectives, ``fig_reward_TASK.png``); the distance
    travelled ``param/drift`` per method (``fig_drift_TASK.png``, where cells log it). One column per staleness
    (and one at s = 0 for on-policy methods, :func:`on_policy_panel`), one row per method group
    (:func:`method_panels`), sync and stale in every panel."""
    plt = cv.plt
    for task in cv.tasks:
        tc = [c for c in cv.main if c["task"] == task]
        svals = sorted({c["staleness"] for c in tc if c["staleness"] > 0})
        if not svals:
            continue
        svals = [0] * on_policy_panel(tc) + svals
        sync = [c for c in tc if c["method"] == "sync"]
        logged = {key: any(cv.series(c, key) for c in tc) for key in ("reward/mean", "param/drift")}
        panels = method_panels([c["method"] for c in tc], cv.recovering.get(task, set()))
        for key, name, ylabel in (("align/cos", "fig_cos_methods", "c_t (10-step mean)"),
                                  ("reward/mean", "fig_reward",
                                   "training reward (10-step mean;\nband: ± sd over seeds, ddof 0)"),
                                  ("param/drift", "fig_drift", "drift ‖θ_k − θ_0‖ (10-step mean)")):
            if key in logged and not logged[key]:
                continue
            fig, axes = plt.subplots(len(panels), len(svals), figsize=(4 * len(svals), 3.2 * len(panels)),
                                     squeeze=False, sharey=True)
            for row, (title, methods) in zip(axes, panels):
                for ax, sv in zip(row, svals):
                    steps, mean, _ = _smooth_mean([cv.series(r, key) for r in sync])
                    if steps:
                        ax.plot(steps, mean, color="black", ls="--", lw=1.4, label="sync (s=0)")
                    for m in ("stale", *methods):
                        recs = [r for r in tc if r["method"] == m and r["staleness"] == sv]
                        steps, mean, std = _smooth_mean([cv.series(r, key) for r in recs])
                        if steps:
                            ax.plot(steps, mean, color=cv.colors[m], lw=1.4 if m == "stale" else 1.0,
                                    label=_seeds_label(m, len(recs), len(sync) or None))
                            if key == "reward/mean":
                                ax.fill_between(steps, mean - std, mean + std, color=cv.colors[m], alpha=0.1, lw=0)
                    head = f"{task}, s={sv}" + (" (on-policy)" if sv == 0 else "")
                    ax.set_title(head + (f": {title}" if title else ""), fontsize=9)
                    ax.set_xlabel("step")
                    if key == "align/cos":
                        ax.axhline(0, color="gray", lw=0.5)
                row[0].set_ylabel(ylabel)
                cv.legend_beside(fig, row)
            cv.save(fig, f"{name}_{cv.stem(task)}.png", outside=True)


def versions_figures(cv: Canvas) -> None:
    """Reward by policy version (``fig_versions_TASK.png``, a task with stale runs whose cells have rewards by
    version): a stale run's training reward at step t was earned by θ_{t−s}, so its step curve lags sync's by s
    versions; here every run's reward is placed at the version of the policy that earned it. The measure is
    ``eval/policy_reward`` where every cell of the task logs it (markers at its eval points, lines between), else
    the training reward by version as a VERSION_SMOOTH-version moving mean
    (:func:`~gacbench.bench.groups.version_measure`). Each curve is the mean over seeds at the versions every seed
    has, with a band: the range over seeds with at most BAND_RANGE_SEEDS seeds, ± one standard error beyond
    (:func:`~gacbench.bench.groups.version_curve`). One row of panels per s > 0, and a first row of the
    on-policy controls (methods run at s = 0 besides sync) where there are any; one panel per method family
    (:func:`family_panels`), sync and stale at that s in every panel; one legend of every method, right of the
    panels."""
    plt = cv.plt
    for task in cv.tasks:
        tc = [c for c in cv.main if c["task"] == task]
        controls = any(c["staleness"] == 0 and c["method"] != "sync" for c in tc)
        svals = [0] * controls + sorted({c["staleness"] for c in tc if c["staleness"] > 0})
        measure = version_measure(tc)
        if measure is None or not any(c["method"] == "stale" and c["staleness"] > 0 for c in tc):
            continue
        policy = measure == POLICY_REWARD
        panels = family_panels([c["method"] for c in tc if c["staleness"] > 0])
        curves = {(m, s): version_curve([c for c in tc if c["method"] == m and c["staleness"] == s], measure)
                  for m, s in {(c["method"], c["staleness"]) for c in tc}}
        # a curve over another number of seeds than sync's says so in its label (a method run on fewer seeds is
        # not drawn against sync and stale on the same seeds)
        seeds_sync = (curves.get(("sync", 0)) or {}).get("n")
        fig, axes = plt.subplots(len(svals), len(panels), figsize=(4 * len(panels), 3.2 * len(svals)),
                                 squeeze=False, sharex=True, sharey=True)
        for row, s in zip(axes, svals):
            for ax, (title, methods) in zip(row, panels):
                for m, key in (("sync", ("sync", 0)), ("stale", ("stale", s)), *((m, (m, s)) for m in methods)):
                    curve = curves.get(key)
                    if curve is None:
                        continue
                    ref = m in REFERENCE_METHODS
                    ax.plot(curve["versions"], curve["mean"], color=cv.colors[m], ls="--" if m == "sync" else "-",
                            lw=1.6 if ref else 1.1, marker="o" if policy else None, ms=3.5,
                            label="sync (s=0)" if m == "sync" else _seeds_label(m, curve["n"], seeds_sync))
                    ax.fill_between(curve["versions"], curve["low"], curve["high"], color=cv.colors[m],
                                    alpha=0.12, lw=0)
                ax.set_title(f"{task}, s={s}" + (" (on-policy controls)" if s == 0 else "")
                             + (("\n" if s == 0 else ": ") + title if title else ""), fontsize=9)
                ax.grid(color="0.92", lw=0.5)
            row[0].set_ylabel(("policy reward of θ_v (held out)" if policy
                               else f"training reward by version ({VERSION_SMOOTH}-version mean)")
                              + f"\nmean over seeds; band: ± s.e. (range ≤ {BAND_RANGE_SEEDS} seeds)", fontsize=8)
        for ax in axes[-1]:
            ax.set_xlabel("policy version v (the θ_v that earned the reward)", fontsize=8)
        # every row draws the same methods: one legend of them all, right of the figure (a figure legend, which
        # the layout of the panels leaves out: it may be taller than a row), about 14 entries a column per row
        handles, labels = figure_legend_entries(fig)
        fig.tight_layout()
        fig.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False,
                   ncol=math.ceil(len(labels) / (14 * len(svals))))
        cv.save(fig, f"fig_versions_{cv.stem(task)}.png", outside=True)


def _measure_title(row: dict) -> str:
    """The measure a share row reads, as a panel title names it: by policy version, the held-out reward of the
    policy itself or the training reward filed under the version that sampled it."""
    if row.get("measure") == "by_version":
        return ("held-out reward of the policy θ_v" if row.get("source") == "eval/policy_reward"
                else "training reward by the version that sampled it")
    return "training reward (last 20%)" if row.get("measure") == "reward_last" else "final metric"


def shares_figure(cv: Canvas, rows: list[dict]) -> None:
    """The paper's Figure 4 with intervals: a forest plot of the recovered share of every method at every s with
    its 95% Fieller interval, on the measure the summary reads (``rows``: :func:`headline_shares`), one
    panel per task, sorted by share; a filled marker where the Holm-adjusted test against stale rejects at 0.05,
    an open one elsewhere; lines at 0 (stale) and 1 (sync) (``fig_shares.png``). A share whose stale - sync gap
    is within seed noise (``gap_within_noise``) is a ratio of noise and is left out; the axis label counts the
    entries left out and names their staleness. Written when a share has an interval."""
    plt = cv.plt
    rows = [r for r in rows if not r.get("missing") and not r["no_gap"] and math.isfinite(r["share"])]
    noisy = [r for r in rows if r.get("gap_within_noise")]
    rows = [r for r in rows if not r.get("gap_within_noise")]
    has_ci = lambda r: not any(x is None or math.isnan(x) for x in (r.get("share_ci_low"), r.get("share_ci_high")))  # noqa: E731
    if not any(has_ci(r) for r in rows):
        return
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    counts = [sum(r["task"] == t for r in rows) for t in tasks]
    fig, axes = plt.subplots(len(tasks), 1, figsize=(7.0, sum(0.28 * n + 1.0 for n in counts)), squeeze=False,
                             gridspec_kw={"height_ratios": [n + 3 for n in counts]})
    # one x range for every panel: the shares and finite interval ends, at least [-0.1, 1.1], cut to SHARE_AXIS
    ends = [x for r in rows for x in (r["share"], r.get("share_ci_low"), r.get("share_ci_high"),
                                      *(r.get("share_ci_excluded") or ()))  # an exclusive set's rays end there
            if x is not None and math.isfinite(x)]
    left, right = max(SHARE_AXIS[0], min(-0.1, *ends)), min(SHARE_AXIS[1], max(1.1, *ends))
    pad = 0.04 * (right - left)
    for ax, task in zip(axes[:, 0], tasks):
        tr = sorted((r for r in rows if r["task"] == task), key=lambda r: (r["share"], r["method"], r["staleness"]))
        for y, r in enumerate(tr):
            color = cv.colors.get(r["method"], "tab:gray")
            low, high = r.get("share_ci_low"), r.get("share_ci_high")
            if has_ci(r):
                excluded = r.get("share_ci_excluded")  # an exclusive set: two rays, the band between left out
                pieces = ([(low, excluded[0]), (excluded[1], high)] if excluded else [(low, high)])
                for lo, hi in pieces:
                    a, b = max(lo, left - pad), min(hi, right + pad)
                    if a < b:
                        ax.plot([a, b], [y, y], color=color, lw=1.4)
                    if lo < left - pad:
                        ax.plot([a], [y], marker="<", color=color, ms=5)
                    if hi > right + pad:
                        ax.plot([b], [y], marker=">", color=color, ms=5)
            ax.plot([min(max(r["share"], left - pad), right + pad)], [y], marker="o", ms=6, color=color,
                    mfc=color if significant(r) else "white", mew=1.4)
        ax.axvline(0.0, color="tab:red", ls="--", lw=1)
        ax.axvline(1.0, color="black", ls="--", lw=1)
        ax.set_yticks(range(len(tr)), [f"{r['method']}, s={r['staleness']}" for r in tr], fontsize=7)
        ax.set_ylim(-0.7, len(tr) - 0.3)
        ax.set_xlim(left - 2 * pad, right + 2 * pad)
        measure = _measure_title(tr[0])
        ax.set_title(f"{task}: recovered share of the stale–sync gap,\n{measure}", fontsize=9, pad=12)
        ax.text(0.0, 1.0, " stale", transform=ax.get_xaxis_transform(), color="tab:red", fontsize=7, va="bottom")
        ax.text(1.0, 1.0, " sync", transform=ax.get_xaxis_transform(), color="black", fontsize=7, va="bottom")
        ax.grid(axis="x", color="0.9", lw=0.5)
    label = ("share (95% Fieller interval, two rays where it excludes a band;\nfilled: Holm-adjusted p < 0.05 "
             "against stale; arrow: interval cut)")
    if noisy:
        where = ", ".join(f"{t} s = {s}" for t, s in dict.fromkeys((r["task"], r["staleness"]) for r in noisy))
        label += f"\nleft out: {len(noisy)} shares whose stale–sync gap is within seed noise ({where})"
    axes[-1, 0].set_xlabel(label, fontsize=8)
    cv.save(fig, "fig_shares.png", outside=True)  # the titles and the label are wider than one panel


def beyond_figure(cv: Canvas, rows: list[dict]) -> None:
    """The share of the gap each method removes beyond its on-policy effect, as a forest plot in the style of
    :func:`shares_figure` (``fig_beyond.png``; ``rows``: :func:`~gacbench.bench.beyond.headline_beyond`): one panel
    per task, one line per method and s sorted by that share, its 95% Fieller interval, a filled marker where the
    Holm-adjusted test of the difference-in-differences rejects at 0.05 (open elsewhere), the raw recovered share on
    the same seeds as a grey cross beside it, a method whose control is sync (identity at s = 0) marked in its label;
    lines at 0 (stale) and 1 (sync). Written when a share beyond the on-policy effect is finite."""
    plt = cv.plt
    rows = [r for r in rows if not r["no_gap"] and math.isfinite(r["beyond_on_policy_share"])]
    if not rows:
        return
    finite = lambda x: x is not None and math.isfinite(x)  # noqa: E731
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    counts = [sum(r["task"] == t for r in rows) for t in tasks]
    fig, axes = plt.subplots(len(tasks), 1, figsize=(7.0, sum(0.28 * n + 1.0 for n in counts)), squeeze=False,
                             gridspec_kw={"height_ratios": [n + 3 for n in counts]})
    ends = [x for r in rows for x in (r["beyond_on_policy_share"], r["raw_share"], r["beyond_ci_low"],
                                      r["beyond_ci_high"]) if finite(x)]
    left, right = max(SHARE_AXIS[0], min(-0.1, *ends)), min(SHARE_AXIS[1], max(1.1, *ends))
    pad = 0.04 * (right - left)
    clip = lambda x: min(max(x, left - pad), right + pad)  # noqa: E731
    for ax, task in zip(axes[:, 0], tasks):
        tr = sorted((r for r in rows if r["task"] == task),
                    key=lambda r: (r["beyond_on_policy_share"], r["method"], r["staleness"]))
        for y, r in enumerate(tr):
            color = cv.colors.get(r["method"], "tab:gray")
            low, high = r["beyond_ci_low"], r["beyond_ci_high"]
            if low is not None and high is not None and not (math.isnan(low) or math.isnan(high)):
                a, b = clip(low), clip(high)
                ax.plot([a, b], [y, y], color=color, lw=1.4)
                if low < left - pad:
                    ax.plot([a], [y], marker="<", color=color, ms=5)
                if high > right + pad:
                    ax.plot([b], [y], marker=">", color=color, ms=5)
            if finite(r["raw_share"]):
                ax.plot([clip(r["raw_share"])], [y], marker="x", ms=5, color="0.5", ls="")
            adj = r.get("beyond_p_adj")
            ax.plot([clip(r["beyond_on_policy_share"])], [y], marker="o", ms=6, color=color,
                    mfc=color if adj is not None and adj < 0.05 else "white", mew=1.4)
        ax.axvline(0.0, color="tab:red", ls="--", lw=1)
        ax.axvline(1.0, color="black", ls="--", lw=1)
        ax.set_yticks(range(len(tr)), [f"{r['method']}, s={r['staleness']}"
                                       + (" (control: sync)" if r["control"].startswith("sync") else "")
                                       for r in tr], fontsize=7)
        ax.set_ylim(-0.7, len(tr) - 0.3)
        ax.set_xlim(left - 2 * pad, right + 2 * pad)
        measure = _measure_title(tr[0])
        ax.set_title(f"{task}: share of the stale–sync gap beyond the on-policy effect,\n{measure}", fontsize=9,
                     pad=12)
        ax.text(0.0, 1.0, " stale", transform=ax.get_xaxis_transform(), color="tab:red", fontsize=7, va="bottom")
        ax.text(1.0, 1.0, " sync", transform=ax.get_xaxis_transform(), color="black", fontsize=7, va="bottom")
        ax.grid(axis="x", color="0.9", lw=0.5)
    axes[-1, 0].set_xlabel("share beyond the on-policy effect (95% Fieller interval; arrow: interval cut)\nfilled: "
                           "Holm-adjusted p < 0.05 for the difference-in-differences; grey ×: the raw recovered share",
                           fontsize=8)
    cv.save(fig, "fig_beyond.png", outside=True)  # the title and the two-line label are wider than one panel


def law_figure(cv: Canvas, law: list[dict]) -> None:
    """The staleness x learning-rate law: the regime map's stale - sync gap against s * lr (log axis), mean and
    95% t-interval over seeds, one colour per model (``law``: :func:`~gacbench.bench.regime.law_points`);
    an open marker where the sync run at that lr is not healthy, i.e. beyond the healthy-sync limit
    (``fig_law.png``)."""
    plt = cv.plt
    if not law:
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    colors = cv.model_color(entry["model"] for entry in law)
    # models that share an s * lr are set side by side: each model's points shifted by a few percent on the log axis
    shift = {entry["model"]: 10 ** (0.03 * (i - (len(law) - 1) / 2)) for i, entry in enumerate(law)}
    for entry in law:
        color, pts = colors[entry["model"]], [p for p in entry["points"] if math.isfinite(p["gap"])]
        if not pts:
            continue
        pts = [{**p, "s_lr": p["s_lr"] * shift[entry["model"]]} for p in pts]
        rho = entry.get("spearman_rho_healthy")
        label = entry["model"] + ("" if rho is None or math.isnan(rho) else f" (Spearman ρ = {rho:+.2f} where sync "
                                                                          "is healthy)")
        if entry["sync_unhealthy_lrs"]:
            label += f"; sync unhealthy at lr ≥ {min(entry['sync_unhealthy_lrs']):.3g}"
        ax.plot([p["s_lr"] for p in pts], [p["gap"] for p in pts], color=color, lw=0.8, alpha=0.6)
        for k, p in enumerate(pts):
            low, high = p["gap_ci_low"], p["gap_ci_high"]
            if low is not None and high is not None and math.isfinite(low) and math.isfinite(high):
                ax.plot([p["s_lr"]] * 2, [low, high], color=color, lw=1.2)
            ax.plot([p["s_lr"]], [p["gap"]], marker="o", ls="", ms=6, color=color, mew=1.4,
                    mfc=color if p["sync_healthy"] else "white", label=label if k == 0 else None)
    ax.axhline(0.0, color="gray", lw=0.6)
    ax.set_xscale("log")  # decades labelled; the points' own s · lr values are in summary.md's table
    ax.set_xlabel("s · lr (staleness × learning rate)")
    measures = {entry["measure"] for entry in law}
    ax.set_ylabel("stale − sync, reward (< 0: stale worse)" if measures == {"reward_last"}
                  else "stale − sync, each model's measure (< 0: stale worse; a loss negated)")
    ax.set_title("Gap against s · lr per model (95% t-interval over seeds; open: sync unhealthy at that lr;\n"
                 "models at the same s · lr set a few percent apart)", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), borderaxespad=0.0, frameon=False)
    cv.save(fig, "fig_law.png", outside=True)


def size_figure(cv: Canvas, points: list[dict], trend: dict | None) -> None:
    """The model-size axis (``fig_size.png``; ``points``: :func:`~gacbench.bench.regime.size_points`). Left: sync's
    q0.9(|c_t|) against the parameter count (log axis), each seed a small dot and each task's mean a large one, the
    paper's Table 3 models as stars, and the least-squares trend (:func:`~gacbench.bench.regime.size_trend`) solid
    over the grid's sizes and dashed where it is extended to the paper's. Right: the stale run's median c_t over
    sync's, per s, against the parameter count (1: no stale signature)."""
    plt = cv.plt
    if not points:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    palette = plt.cm.tab10.colors
    tasks = {p["task"] for p in points}
    colors = cv.model_color(tasks)
    for p in points:
        color = colors[p["task"]]
        seeds = [c["cos_abs_q90"] for c in size_sync_cells(cv.main, {p["task"]})]
        left.plot([p["params"]] * len(seeds), seeds, ls="", marker="o", ms=3, color=color, alpha=0.5)
        left.plot([p["params"]], [p["sync_cos_abs_q90"]], ls="", marker="o", ms=8, color=color,
                  label=f"{p['task']} ({p['params'] / 1e6:.1f}M)")
    left.plot([r["params"] for r in PAPER_TABLE3], [r["cos_abs_q90"] for r in PAPER_TABLE3], ls="", marker="*",
              ms=11, color="black", label="paper Table 3 (" + ", ".join(r["model"] for r in PAPER_TABLE3) + ")")
    if trend is not None:
        lo, hi = min(trend["sizes"]), max(trend["sizes"])
        far = max(r["params"] for r in PAPER_TABLE3)

        def line(a: float, b: float) -> tuple[np.ndarray, np.ndarray]:
            x = np.logspace(math.log10(a), math.log10(b), 50)
            return x, trend["intercept"] + trend["slope_per_decade"] * np.log10(x)

        left.plot(*line(lo, hi), color="0.3", lw=1.2,
                  label=f"trend {trend['slope_per_decade']:+.3f} per 10× parameters "
                        f"[{trend['slope_ci_low']:+.3f}, {trend['slope_ci_high']:+.3f}]")
        left.plot(*line(hi, far), color="0.3", lw=1.0, ls="--", label="trend extended (extrapolation)")
    left.set_xscale("log")
    left.set_xlabel("parameters")
    left.set_ylabel("sync q0.9(|c_t|)")
    left.set_title("On-policy c_t spread against model size", fontsize=9)
    left.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.22), ncol=2, frameon=False)
    svals = sorted({e["staleness"] for p in points for e in p["stale"]})
    for j, s in enumerate(svals):
        xs = [(p["params"], e["cos_median_ratio"]) for p in points for e in p["stale"]
              if e["staleness"] == s and math.isfinite(e["cos_median_ratio"])]
        if xs:
            px, ys = zip(*sorted(xs))
            right.plot(px, ys, marker="o", color=palette[(len(tasks) + j) % len(palette)], label=f"s = {s}")
    right.axhline(1.0, color="gray", lw=0.6)
    right.set_xscale("log")
    right.set_xlabel("parameters")
    right.set_ylabel("stale / sync, median c_t")
    right.set_title("Stale signature against model size (1: none)", fontsize=9)
    if svals:
        right.legend(fontsize=7, frameon=False)
    cv.save(fig, "fig_size.png", outside=True)


def regime_figure(cv: Canvas, regime: list[dict]) -> None:
    """The regime map: stale - sync gap and the c_t difference against (learning rate, staleness), per model, one
    colour scale per column shared by every model (``fig_regime.png``)."""
    plt = cv.plt
    if not regime:
        return

    def value(p: dict, key: str) -> float:
        return p["gap"] if key == "gap" else p["stale_cos_median"] - p["sync_cos_median"]

    limits = {}  # per column, the largest |value| of any model: a colour reads the same in every row
    for key in ("gap", "cos_diff"):
        finite = [abs(v) for v in (value(p, key) for p in regime) if v is not None and math.isfinite(v)]
        limits[key] = max(finite) if finite and max(finite) > 0 else 1.0
    models = sorted({p["model"] for p in regime})
    fig, axes = plt.subplots(len(models), 2, figsize=(9, 3.2 * len(models)), squeeze=False)
    for row, model in zip(axes, models):
        pts = [p for p in regime if p["model"] == model]
        lrs, svals = sorted({p["lr"] for p in pts}), sorted({p["staleness"] for p in pts})
        for ax, key, title in ((row[0], "gap", "stale − sync"), (row[1], "cos_diff", "median c_t: stale − sync")):
            grid = np.full((len(svals), len(lrs)), np.nan)
            for p in pts:
                v = value(p, key)
                grid[svals.index(p["staleness"]), lrs.index(p["lr"])] = v
                sig = key == "gap" and p["gap_ci_high"] is not None and not math.isnan(p["gap_ci_high"]) \
                    and (p["gap_ci_high"] < 0 or p["gap_ci_low"] > 0)
                if math.isfinite(v):
                    note = "" if p["sync_healthy"] else " †"
                    ax.text(lrs.index(p["lr"]), svals.index(p["staleness"]), f"{v:.2g}{'*' if sig else ''}{note}",
                            ha="center", va="center", fontsize=7,
                            bbox={"facecolor": "white", "alpha": 0.7, "lw": 0, "pad": 1})
            lim = limits[key]
            im = ax.imshow(grid, origin="lower", aspect="auto", cmap="RdBu" if key == "gap" else "PuOr_r",
                           vmin=-lim, vmax=lim)
            ax.set_xticks(range(len(lrs)), [f"{x:.0e}" for x in lrs])
            ax.set_yticks(range(len(svals)), [str(x) for x in svals])
            ax.set_xlabel("learning rate")
            ax.set_ylabel("staleness s")
            ax.set_title(f"{model}: {title}" + (" (*: 95% CI excludes 0)" if key == "gap" else "")
                         + " (†: sync unhealthy)", fontsize=8)
            fig.colorbar(im, ax=ax)
    cv.save(fig, "fig_regime.png")


def thresholds_figure(cv: Canvas, groups: list[dict], ablation_rows: list[dict] | None = None) -> None:
    """Figure 5: (c_low, c_high) heatmap from the ablation cells (``fig_thresholds.png``)."""
    plt = cv.plt
    abl = [g for g in groups if g["ablation"]]
    if not abl:
        return
    key = ablation_key(abl)
    shares = {(r["task"], r["method"]): r["share"] for r in ablation_share_rows(groups, cv.cells, ablation_rows)}
    by = {(g["task"], g["method"], g["staleness"]): g for g in groups}
    atasks = sorted({g["task"] for g in abl})
    fig, axes = plt.subplots(1, len(atasks), figsize=(4.6 * len(atasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], atasks):
        pts, share_at = {}, {}
        tg = [g for g in abl if g["task"] == task]
        s_abl = tg[0]["staleness"]
        for g in tg:
            m = re.search(r"c_low=([0-9.]+),c_high=([0-9.]+)", g["method"])
            if m:
                pts[(float(m.group(1)), float(m.group(2)))] = g[f"{key}_mean"]
                share_at[(float(m.group(1)), float(m.group(2)))] = shares.get((task, g["method"]), math.nan)
        lows, highs = sorted({k[0] for k in pts}), sorted({k[1] for k in pts})
        grid = np.full((len(lows), len(highs)), np.nan)
        for (lo, hi), v in pts.items():
            grid[lows.index(lo), highs.index(hi)] = v
            sh = share_at[(lo, hi)]
            ax.text(highs.index(hi), lows.index(lo), f"{v:.3g}" + ("" if math.isnan(sh) else f"\nshare {sh:.2f}"),
                    ha="center", va="center", fontsize=7, color="black",
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "alpha": 0.6, "lw": 0})
        higher = key == "reward_last" or tg[0]["higher_is_better"]
        refs = {name: by[(task, name, st)][f"{key}_mean"] for name, st in (("sync", 0), ("stale", s_abl))
                if f"{key}_mean" in by.get((task, name, st), {})}
        # the colour scale spans stale and sync too, so a colour reads as a place in the gap
        span = [v for v in grid.ravel() if math.isfinite(v)] + list(refs.values())
        im = ax.imshow(grid, origin="lower", cmap="viridis" if higher else "viridis_r", aspect="auto",
                       vmin=min(span), vmax=max(span))
        ax.set_xticks(range(len(highs)), [f"{h:g}" for h in highs])
        ax.set_yticks(range(len(lows)), [f"{lo:g}" for lo in lows])
        ax.set_xlabel("c_high")
        ax.set_ylabel("c_low")
        what = "training reward (last 20%)" if key == "reward_last" else f"final {tg[0]['metric']}"
        ref_text = ", ".join(f"{name} {v:.3g}" for name, v in refs.items())
        ax.set_title(f"{task}, s={s_abl}: {what}, bright = better" + (f"\n({ref_text})" if refs else ""),
                     fontsize=8)
        fig.colorbar(im, ax=ax)
        if (0.05, 0.3) in pts:  # the paper's default
            ax.add_patch(plt.Rectangle((highs.index(0.3) - 0.5, lows.index(0.05) - 0.5), 1, 1, fill=False,
                                       ec="white", lw=1.5))
            ax.plot([], [], marker="s", ms=7, mfc="none", mec="0.4", ls="",  # the legend's key: white is not seen
                    label="default (0.05, 0.3), outlined in white")
        used = [c for c in cv.cells if c["task"] == task and c["method"] == "gac-calibrated"
                and c.get("c_low") is not None and c["status"] == "done" and c["staleness"] == tg[0]["staleness"]]
        if used and len(lows) > 1 and len(highs) > 1:  # gac-calibrated's thresholds, on the grid's index axes
            c_low, c_high = float(np.mean([c["c_low"] for c in used])), float(np.mean([c["c_high"] for c in used]))
            label = f"gac-calibrated (c_low, c_high) = ({c_low:.3g}, {c_high:.3g}), mean over {len(used)} seeds"
            if lows[0] <= c_low <= lows[-1] and highs[0] <= c_high <= highs[-1]:
                x, y = np.interp(c_high, highs, range(len(highs))), np.interp(c_low, lows, range(len(lows)))
                ax.plot([x], [y], marker="x", color="red", ms=8, mew=2, ls="", zorder=5, label=label)
            else:  # off the grid: named in the legend, not drawn at the grid's edge
                ax.plot([], [], marker="x", color="red", ls="", label=label + ", outside the grid")
        if ax.get_legend_handles_labels()[0]:  # below the map: no square hidden under it
            ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(0.0, -0.2), borderaxespad=0.0, frameon=False)
    cv.save(fig, "fig_thresholds.png", outside=True)


def figures(root: Path, cells: list[dict], cell_dirs: dict[tuple, Path], groups: list[dict],
            regime: list[dict] | None = None, ablation_rows: list[dict] | None = None,
            share_rows: list[dict] | None = None, sizes: list[dict] | None = None,
            size_trend: dict | None = None, beyond_rows: list[dict] | None = None,
            metrics: dict[Path, dict] | None = None) -> list[Path]:
    """Write every figure of ``root`` that its cells support (``cells`` as grouped, ``cell_dirs`` as in
    :class:`Canvas`; ``share_rows``: the recovered shares on the measure the summary reads,
    :func:`~gacbench.bench.stats.headline_shares`; ``beyond_rows``: the shares beyond the on-policy effect on that
    measure, :func:`~gacbench.bench.beyond.headline_beyond`; ``metrics``: the cells' metrics.csv already parsed,
    as :class:`Canvas` takes them); returns their paths."""
    share_rows = share_rows or []
    cv = Canvas(root, cells, cell_dirs, metrics)
    for r in share_rows:  # the corrections that recover: a positive share, significant after Holm's adjustment
        if not r.get("missing") and not r["no_gap"] and r["share"] > 0 and significant(r):
            cv.recovering.setdefault(r["task"], set()).add(r["method"])
    curves_figures(cv)
    cos_figure(cv)
    robustness_figure(cv, groups)
    staleness_figures(cv)
    method_figures(cv)
    versions_figures(cv)
    regime_figure(cv, regime or [])
    thresholds_figure(cv, groups, ablation_rows)
    shares_figure(cv, share_rows)
    beyond_figure(cv, beyond_rows or [])
    law_figure(cv, law_points(regime or []))
    size_figure(cv, sizes or [], size_trend)
    return cv.out
