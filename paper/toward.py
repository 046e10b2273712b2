"""The table "toward the paper's regime": one row per point (a grid's task at one staleness), read from the
published summaries, beside the paper's Table 3 rows; written as paper/toward.md and paper/toward.json.

    python paper/toward.py                       # the default points below, from the published summaries
    python paper/toward.py --point "LABEL=SUMMARY_JSON:TASK:S" [...] [--out paper/toward]

Each point's columns (gacbench.bench.regime.toward_row): parameters, sync's tokens per response, sync's
q0.9(|c_t|), stale's median c_t over sync's, the sync - stale reward gap with its paired 95% interval, the
recovered shares of gac, gac-calibrated, gspo and gac-step, and stale's largest token ratio.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gacbench.bench.regime import toward_row
from gacbench.bench.tables import toward_markdown
from gacbench.jsonio import json_safe, read_json, write_json

PAPER = Path(__file__).resolve().parent
DEFAULT_POINTS = (
    "tiny, 6 tokens=llm-size/summary.json:tiny:16",
    "small, 6 tokens=llm-size/summary.json:small:16",
    "small, 6 tokens, lr 3e-4=llm-headline-healthy/summary.json:arithmetic:16",
    "small, 6 tokens, lr 3e-4=llm-headline-healthy/summary.json:arithmetic:32",
    "small, long answers=llm-length/summary.json:scratchpad:16",
    "small, long answers=llm-length/summary.json:scratchpad:32",
    "medium, 6 tokens=llm-size/summary.json:medium:16",
)


def parse_point(text: str) -> tuple[str, Path, str, int]:
    try:
        label, rest = text.split("=", 1)
        path, task, s = rest.rsplit(":", 2)
        return label, (PAPER / path if not Path(path).is_absolute() else Path(path)), task, int(s)
    except ValueError:
        sys.exit(f"paper/toward.py: --point {text!r} is not LABEL=SUMMARY_JSON:TASK:S (e.g. "
                 "'small, 6 tokens=llm-size/summary.json:small:16', the path relative to paper/)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--point", action="append", help="LABEL=SUMMARY_JSON:TASK:S (repeatable; default: "
                        "the points of llm-size, llm-headline-healthy and llm-length)")
    parser.add_argument("--out", default=str(PAPER / "toward"), help="writes OUT.md and OUT.json")
    args = parser.parse_args(argv)
    rows = []
    for label, path, task, s in map(parse_point, args.point or DEFAULT_POINTS):
        if not path.is_file():
            sys.exit(f"paper/toward.py: {path} does not exist; publish that grid first (bash paper/make.sh "
                     f"{path.parent.name})")
        try:
            rows.append(toward_row(read_json(path), task, s, label, str(path.relative_to(PAPER)
                                                                                    if path.is_relative_to(PAPER)
                                                                                    else path)))
        except ValueError as exc:
            sys.exit(f"paper/toward.py: {exc}")
    out = Path(args.out)
    write_json(out.with_suffix(".json"), json_safe({"points": rows}))
    out.with_suffix(".md").write_text("\n".join(toward_markdown(rows)) + "\n")
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')} ({len(rows)} points)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
