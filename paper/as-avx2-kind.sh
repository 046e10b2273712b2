#!/usr/bin/env bash
# Runs a command as an x86 machine with AVX2 and without AVX-512 computes, on a machine that has AVX-512:
# torch's kernels capped at AVX2 (ATen, MKL and oneDNN, through their environment variables) and vLLM's CPU
# kernels chosen as on an AVX2 machine (paper/avx2-kind/sitecustomize.py). A grid whose seeds are assigned to
# an AVX2 kind resumes on such a machine only when this reproduces the kind's stored cells exactly
# (grids/README.md gives the check). E.g., from a grid's pinned checkout:
#   PYTHONPATH=$PWD $CLONE/paper/as-avx2-kind.sh $CLONE/.venv/bin/python -m gacbench.cli bench --suite ... --out ...
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 COMMAND [ARG ...]  (runs COMMAND as the AVX2 machine kind computes)" >&2; exit 2; }
grep -qw avx2 /proc/cpuinfo 2>/dev/null || { echo "$0: this CPU has no AVX2 (/proc/cpuinfo), so it cannot compute as the AVX2 kind" >&2; exit 2; }
HERE="$(cd "$(dirname "$0")" && pwd)"
export PYTHONPATH="$HERE/avx2-kind${PYTHONPATH:+:$PYTHONPATH}"
export GACBENCH_AVX2_KIND=1 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
exec "$@"
