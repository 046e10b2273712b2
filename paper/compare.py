"""Compare two summaries of the same grid: which recovered shares and stale-sync gaps moved beyond their intervals.

The use: a grid republished on one code version against the same grid stored earlier over several versions
(or on another machine). For every (task, method, staleness) entry of ``recovered_reward`` in both summaries it
prints the share with its 95% interval on each side, the difference, and whether each share lies outside the
other's interval ("beyond both": each outside the other's), then whether the paired test against stale changed
its verdict at 0.05. The verdicts compare like with like: the adjusted p-values where both summaries have them,
else the raw ones on both sides (a summary without adjustment against one with it would otherwise count the
adjustment as a move); the new summary's adjusted p is printed beside them. A row whose stale - sync gap is
within seed noise on either side is marked: its share is not meaningful there. For the gaps (stale - sync per
staleness) it does the same with gap +- 1.96 SE.

    python paper/compare.py OLD/summary.json NEW/summary.json [--markdown out.md]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def _entries(summary: dict) -> dict[tuple, dict]:
    return {(e["task"], e["method"], e["staleness"]): e for e in summary.get("recovered_reward") or []}


def _outside(x: float, lo: float, hi: float) -> bool:
    return not (lo <= x <= hi)


def _outside_share(x: float | None, e: dict) -> bool | None:
    """Whether the share ``x`` lies outside ``e``'s Fieller interval (:func:`_kind`: bounded [low, high];
    exclusive, every share but the band ``share_ci_excluded``; unbounded, every share); None where the share or
    the interval is missing (no gap to divide by, or too few seeds)."""
    kind = _kind(e)
    if x is None or kind is None:
        return None
    if kind == "exclusive":
        a, b = e["share_ci_excluded"]
        return a < x < b
    if kind == "unbounded":
        return False
    return _outside(x, e["share_ci_low"], e["share_ci_high"])


def _kind(e: dict) -> str | None:
    """The entry's interval kind; ``bounded`` for a summary written before the kind was recorded that holds both
    ends."""
    kind = e.get("share_ci_kind")
    if kind is None and e.get("share_ci_low") is not None and e.get("share_ci_high") is not None:
        return "bounded"
    return kind


def _share_ci(e: dict) -> str:
    kind = _kind(e)
    if kind == "exclusive":
        a, b = e["share_ci_excluded"]
        return f"(−∞, {a:+.2f}] ∪ [{b:+.2f}, ∞)"
    if kind == "unbounded":
        return "(−∞, ∞)"
    if kind is None:
        return "—"
    return f"[{e['share_ci_low']:+.2f}, {e['share_ci_high']:+.2f}]"


def _share(x: float | None) -> str:
    return "—" if x is None else f"{x:+.2f}"


def _num(p) -> float | None:
    return None if p is None or (isinstance(p, float) and math.isnan(p)) else float(p)


def share_rows(old: dict, new: dict) -> list[dict]:
    """One row per entry in both summaries' ``recovered_reward``: the shares, their intervals and the moves."""
    a, b = _entries(old), _entries(new)
    rows = []
    for key in sorted(set(a) & set(b), key=lambda k: (k[0], k[2], k[1])):
        x, y = a[key], b[key]
        out_new, out_old = _outside_share(y.get("share"), x), _outside_share(x.get("share"), y)
        adjusted = "vs_stale_p_adj" in x and "vs_stale_p_adj" in y
        key_p = "vs_stale_p_adj" if adjusted else "vs_stale_p"
        px, py = _num(x.get(key_p)), _num(y.get(key_p))
        both = x.get("share") is not None and y.get("share") is not None
        rows.append({"task": key[0], "method": key[1], "staleness": key[2], "old": x.get("share"),
                     "old_ci": _share_ci(x), "new": y.get("share"), "new_ci": _share_ci(y),
                     "diff": y["share"] - x["share"] if both else None, "comparable": out_new is not None
                     and out_old is not None, "beyond_both": bool(out_new and out_old),
                     "beyond_one": bool(out_new or out_old),
                     "old_p": px, "new_p": py, "p_adjusted": adjusted, "new_p_adj": _num(y.get("vs_stale_p_adj")),
                     "within_noise": bool(x.get("gap_within_noise") or y.get("gap_within_noise")),
                     "verdict_changed": px is not None and py is not None and (px < 0.05) != (py < 0.05)})
    return rows


def gap_rows(old: dict, new: dict) -> list[dict]:
    """One row per (task, staleness) gap in both: stale - sync with its +- 1.96 SE interval on each side."""
    def gaps(summary):  # every entry of one (task, s) carries the same gap
        return {(task, s): (e["gap"], e.get("gap_se") or 0.0) for (task, _, s), e in _entries(summary).items()
                if e.get("gap") is not None}  # an entry missing its sync or stale group has no gap

    a, b = gaps(old), gaps(new)
    rows = []
    for key in sorted(set(a) & set(b)):
        (gx, sx), (gy, sy) = a[key], b[key]
        out_new = _outside(gy, gx - 1.96 * sx, gx + 1.96 * sx)
        out_old = _outside(gx, gy - 1.96 * sy, gy + 1.96 * sy)
        rows.append({"task": key[0], "staleness": key[1], "old": gx, "old_se": sx, "new": gy, "new_se": sy,
                     "beyond_both": out_new and out_old})
    return rows


def markdown(old: dict, new: dict, old_name: str, new_name: str) -> str:
    shares, gaps = share_rows(old, new), gap_rows(old, new)
    lines = [f"Old: `{old_name}`; new: `{new_name}`.", "",
             "| task | s | stale - sync, old | new | beyond both |", "|---|---|---|---|---|"]
    for r in gaps:
        lines.append(f"| {r['task']} | {r['staleness']} | {r['old']:+.3f} ± {1.96 * r['old_se']:.3f} | "
                     f"{r['new']:+.3f} ± {1.96 * r['new_se']:.3f} | {'yes' if r['beyond_both'] else ''} |")
    lines += ["", "| task | method | s | share, old [95% CI] | new [95% CI] | new - old | beyond both | "
              "p vs stale, old → new | new p adj. |", "|---|---|---|---|---|---|---|---|---|"]

    def fmt_p(p):
        return "-" if p is None else f"{p:.3f}"

    for r in shares:
        kind = "adj." if r["p_adjusted"] else "raw"
        noise = " (gap within noise)" if r["within_noise"] else ""
        lines.append(f"| {r['task']} | {r['method']} | {r['staleness']}{noise} | {_share(r['old'])} "
                     f"{r['old_ci']} | {_share(r['new'])} {r['new_ci']} | {_share(r['diff'])} | "
                     f"{'yes' if r['beyond_both'] else '' if r['comparable'] else 'no interval'} | "
                     f"{kind} {fmt_p(r['old_p'])} → {fmt_p(r['new_p'])}"
                     f"{' (verdict changed)' if r['verdict_changed'] else ''} | {fmt_p(r['new_p_adj'])} |")
    moved = sum(r["beyond_both"] for r in shares)
    changed = sum(r["verdict_changed"] for r in shares)
    noisy = sum(r["within_noise"] for r in shares)
    blind = sum(not r["comparable"] for r in shares)
    lines += ["", f"{moved} of {len(shares)} shares moved beyond both intervals ({noisy} rows have a gap within "
              f"seed noise on one side or both; {blind} rows lack a share or an interval on one side); "
              f"{sum(r['beyond_both'] for r in gaps)} of {len(gaps)} gaps; "
              f"{changed} paired tests against stale changed their verdict at 0.05."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--markdown", type=Path, help="also write the tables to this file")
    args = parser.parse_args(argv)
    old, new = (json.loads(p.read_text()) for p in (args.old, args.new))
    if not set(_entries(old)) & set(_entries(new)):
        sys.exit(f"paper/compare.py: {args.old} and {args.new} share no (task, method, staleness) entry of "
                 "recovered_reward: they are not summaries of the same grid")
    text = markdown(old, new, str(args.old), str(args.new))
    if args.markdown:
        args.markdown.write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
