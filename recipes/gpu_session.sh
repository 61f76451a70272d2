#!/usr/bin/env bash
# One device call for what changed in a session: GPU tests of the one-loop graphs and async
# scheduling, c=1 decode with and without --async-scheduling, the PD TTFT/ITL comparison
# (recipes/pd_h200.sh), then a short early-exit sweep with the time left (EXIT_S, 70 s, is kept
# for it). One checkpoint serves all of it.
#   run(command="bash recipes/gpu_session.sh", carry=[".whl"], timeout_s=600)
# Knobs: BUDGET_S (580), SKIP_PD=1, SKIP_EXIT=1.
set -uo pipefail
OUT=${OUT:-/tmp/rlt_out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_session.log") 2>&1
export PYTHONUNBUFFERED=1
START=$SECONDS
BUDGET_S=${BUDGET_S:-580}
left() { echo $((BUDGET_S - (SECONDS - START))); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/rlt_site .whl/*.whl \
  && export PYTHONPATH=/tmp/rlt_site
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
CKPT=/tmp/rlt_pd_ouro-1.4b
RLT="python3 -m rlt_serve.cli"
( $RLT make-random-checkpoint --shape ouro-1.4b "$CKPT" --dtype bfloat16 --max-shard-bytes 1073741824 \
  > "$OUT/ckpt.txt" 2>&1 ) &  # sharded: the early-exit copy rewrites only the update tensors
CK=$!
echo "=== GPU tests (t=$((SECONDS - START))s)"
timeout 110 python3 -m pytest -m gpu -q -x -p no:cacheprovider --tb=short tests/test_gpu.py \
  -k "loop_graphs or async or decode_step_host_syncs" 2>&1 | tail -25
wait $CK; tail -2 "$OUT/ckpt.txt"
for mode in sync async; do
  flag=$([ $mode = async ] && echo --async-scheduling)
  echo "=== bench c=1 $mode (t=$((SECONDS - START))s)"
  timeout 70 $RLT bench --model "$CKPT" --dtype bfloat16 --input-len 512 --output-len 128 --runs 3 --warmup 1 \
    --concurrency 1 --skip-reference --json "$OUT/bench_c1_$mode.json" $flag 2>&1 | tail -22
done
if [ "${SKIP_PD:-0}" != 1 ]; then
  echo "=== PD (t=$((SECONDS - START))s, $(left)s left)"
  SKIP_WHL=1 CKPT=$CKPT DEADLINE_S=$(( $(left) - ${EXIT_S:-70} )) bash recipes/pd_h200.sh 2>&1 | tail -40
fi
if [ "${SKIP_EXIT:-0}" != 1 ]; then
  echo "=== early exit (t=$((SECONDS - START))s)"
  $RLT make-random-checkpoint /tmp/rlt_s01 --from "$CKPT" --update-scale 0.1 | tail -1
  timeout $(( $(left) > 20 ? $(left) - 5 : 15 )) python3 -m rlt_serve.bench_depth --concurrency 1 8 32 128 --exit-model 0.1=/tmp/rlt_s01 --exit-thresholds 1.0 0.5 --input-len 32 --output-len 24 --runs 1 \
    --dtype bfloat16 --device cuda --out "$OUT/exit.md" 2>&1 | tail -14
fi
echo "=== done in $((SECONDS - START))s"
