#!/usr/bin/env bash
# The issue-6 acceptance run on one H200: GPU tests for graphs/syncs, then `rlt-serve bench` on a
# random Ouro-1.4B-shape bf16 checkpoint at concurrency 1 (with the dense reference) and 64
# (128 prompts, plus a 16K-token prefill batch), graphs on and off. Logs to $OUT/gpu_perf.log.
#   run(command="bash recipes/gpu_perf.sh", carry=[".whl"], timeout_s=600)
# SHAPE=nanbeige4.2-3b|huginn-0125 benches another family; TESTS='' skips pytest; BENCH='c1 c64 eager'
# picks the bench set (c1async, c64async: c1, c64 with --async-scheduling, to compare side by side).
# VARIANTS='"" "RLT_QKV_EPILOGUE=0"' then times c=1 decode under each env variant, paired
# (recipes/decode_variants.py; eval'd, so quote each variant); VARIANT_ARGS='--concurrency 64' passes
# its options (e.g. VARIANTS='"" "KV_CACHE_DTYPE=fp8" "RLT_GEMV_MAX_M=64"' at c=64).
# EXTRA='--kv-cache-dtype fp8' adds bench flags, TAG=_fp8 suffixes the JSON names (two passes in one call);
# TEST_FILES picks the pytest files.
# .whl holds msgspec and pyzmq cp312 wheels (the CLI imports the launcher).
set -uo pipefail
OUT=${OUT:-/tmp/rlt_out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_perf.log") 2>&1
export PYTHONUNBUFFERED=1
SHAPE=${SHAPE:-ouro-1.4b}
CKPT=${CKPT:-/tmp/rlt_${SHAPE}_bf16}
TESTS=${TESTS-"graph or sync or (fp32_greedy and triton)"}
BENCH=${BENCH:-c1 c64 eager}
EXTRA=${EXTRA:-}
TAG=${TAG:-}
TEST_FILES=${TEST_FILES:-tests/test_gpu.py tests/test_gemv_gpu.py}
TEST_LIMIT=${TEST_LIMIT:-420}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
RLT="python3 -m rlt_serve.cli"
[ -d "$CKPT" ] || ( $RLT make-random-checkpoint --shape "$SHAPE" "$CKPT" --dtype bfloat16 > "$OUT/ckpt.txt" 2>&1 ) &
CK=$!
if [ -n "$TESTS" ]; then
  echo "=== pytest -m gpu -k '$TESTS'"; t0=$SECONDS
  timeout "$TEST_LIMIT" python3 -m pytest -m gpu -q -p no:cacheprovider $TEST_FILES -k "$TESTS" 2>&1 | tail -25
  echo "=== pytest: $((SECONDS - t0))s"
fi
wait $CK; cat "$OUT/ckpt.txt" 2>/dev/null
b() {  # b NAME LIMIT ARGS...
  local name=$1 limit=$2; shift 2
  echo "=== bench $name"; local t0=$SECONDS
  timeout "$limit" $RLT bench --model "$CKPT" --dtype bfloat16 --input-len 512 --output-len 128 --runs 3 --warmup 1 \
    --json "$OUT/bench_${SHAPE}_${name}${TAG}.json" $EXTRA "$@"
  echo "=== bench $name: rc=$? $((SECONDS - t0))s"
}
for x in $BENCH; do
  case $x in
    c1) b c1 150 --concurrency 1 ;;
    c64) b c64 200 --concurrency 64 --num-prompts 128 --skip-reference --prefill-tokens 16384 --max-num-batched-tokens 16384 ;;
    eager) b c1_eager 90 --concurrency 1 --skip-reference --runs 1 --enforce-eager ;;
    c1async) b c1_async 150 --concurrency 1 --skip-reference --async-scheduling ;;
    c64async) b c64_async 200 --concurrency 64 --num-prompts 128 --skip-reference --max-num-batched-tokens 16384 --async-scheduling ;;
    c8) b c8 100 --concurrency 8 --skip-reference ;;
    c128) b c128 200 --concurrency 128 --num-prompts 128 --skip-reference ;;
  esac
done
if [ -n "${VARIANTS:-}" ]; then
  echo "=== decode variants: $VARIANTS"
  eval "timeout 400 python3 recipes/decode_variants.py \"\$CKPT\" $VARIANTS ${VARIANT_ARGS:-}" 2>&1 | grep -v -i warn
fi
