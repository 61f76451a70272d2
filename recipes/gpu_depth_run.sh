#!/usr/bin/env bash
# One device call for the depth features: their GPU tests (one-loop graphs vs eager, exit
# readback, speculation on the device), then the speculation / early-exit sweep
# (recipes/spec_exit_gpu.sh). About 7 minutes:
#   run(command="bash recipes/gpu_depth_run.sh", timeout_s=590)
set -uo pipefail
OUT=${OUT:-/tmp/rlt_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
START=$SECONDS
echo "=== GPU tests"
timeout 150 python3 -m pytest -q -x -p no:cacheprovider --tb=short -m gpu tests/test_gpu_depth.py \
  tests/test_gpu.py -k "loop_graphs or cuda_graph_decode or host_syncs or depth or speculation" 2>&1 | tail -30
echo "=== sweep (t=$((SECONDS - START))s)"
SKIP_TESTS=1 DEADLINE_S=$((${BUDGET_S:-560} - (SECONDS - START))) bash recipes/spec_exit_gpu.sh 2>&1 | tail -75
