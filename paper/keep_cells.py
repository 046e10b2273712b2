"""Stage in git the finished cells of grid stores, so that a grid resumes from the repository on any machine.

A grid of the LLM suites runs for hours, longer than a working session, and a machine is not kept between
sessions. Its store therefore lives in the repository, under ``grids/SUITE`` (``paper/make.sh``'s default
store): each finished cell's ``config.json`` (the cell and the environment it ran in), ``status.json`` and
``metrics.csv``, a few tens of kB per cell. A new clone holds them, so ``gacbench bench --suite SUITE --out
grids/SUITE`` there reuses them and runs only the cells still missing, and ``bash paper/make.sh SUITE``
regenerates the published tables and figures from them exactly.

Only finished cells are staged (``gacbench.bench.cell``'s own test: status done and every file complete); a
cell in flight or failed is left out, so that the next run recomputes it. The store's ``timing.json`` (the last
run that executed cells: its wall time, step share and workers) is staged too where it exists: the summary's
timing section reads it, and a later run that finds every cell done writes none, so without it a summary rebuilt
from a new clone would lose that section. Summaries and figures stay out (``.gitignore``): only a complete grid is
published, by ``paper/make.sh`` into ``paper/SUITE``.

    python paper/keep_cells.py grids/llm-headline [grids/llm-length ...]   # stage, print a count per store
    python paper/keep_cells.py --list grids/llm-headline                    # print the files, stage nothing
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from gacbench.bench.cell import stored_done_cells

#: the files of a finished cell that the summary and a resumed grid read
CELL_FILES = ("config.json", "status.json", "metrics.csv")
#: the store's own files that a rebuilt summary reads (the timing of the last run that executed cells)
STORE_FILES = ("timing.json",)


def finished_cells(store: Path) -> list[Path]:
    """The directories of ``store``'s finished cells (``cells/TASK/METHOD/sS/seedK``), sorted: the runner's own
    test (:func:`gacbench.bench.cell.stored_done_cells`), so a staged cell is one a resumed grid reuses."""
    tasks = sorted(p.name for p in (store / "cells").iterdir() if p.is_dir())
    return [d for task in tasks for d, _ in stored_done_cells(store, task)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stores", nargs="+", type=Path, help="grid store directories (e.g. grids/llm-headline)")
    parser.add_argument("--list", action="store_true", help="print the files that would be staged; stage nothing")
    args = parser.parse_args(argv)
    for store in args.stores:
        if not (store / "cells").is_dir():
            parser.error(f"{store} holds no cells/ directory: pass a grid's --out directory, e.g. grids/llm-headline")
        cells = finished_cells(store)
        files = [str(d / name) for d in cells for name in CELL_FILES]
        files += [str(store / name) for name in STORE_FILES if (store / name).is_file()]
        if args.list:
            print("\n".join(files))
            continue
        for i in range(0, len(files), 500):  # keep each command line short
            subprocess.run(["git", "add", "-f", "--", *files[i:i + 500]], check=True)
        timing = " and its timing.json" if (store / "timing.json").is_file() else ""
        print(f"{store}: {len(cells)} finished cells{timing} staged", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
