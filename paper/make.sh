#!/usr/bin/env bash
# Regenerates the published tables and figures from stored runs. The runs live in runs/ (not in
# git); a run already stored there is reused, so a second call only rebuilds the summary.
#   bash paper/make.sh            # the synthetic-smoke, synthetic and llm-smoke suites
set -euo pipefail
cd "$(dirname "$0")/.."
GACBENCH=${GACBENCH:-gacbench}
for suite in synthetic-smoke synthetic llm-smoke; do
    "$GACBENCH" bench --suite "$suite" --out "runs/$suite"
    mkdir -p "paper/$suite"
    cp "runs/$suite/summary.md" runs/"$suite"/fig_*.png "paper/$suite/"
done
