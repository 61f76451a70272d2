#!/usr/bin/env bash
# Self-speculation and early exit on the H200: speedup vs measured acceptance rate and throughput
# vs mean exit depth, on a random Ouro-1.4B-shape bf16 checkpoint at three update scales
# (recipes/spec_exit.md says what the scale means). About 5 minutes; a global deadline
# (DEADLINE_S, default 345 s) stops it before the device budget runs out, keeping what is done
# (tables are written after every concurrency). The speedups are paired: for each checkpoint the
# plain, fixed-K and adaptive engines are alive at once and timed in interleaved rounds
# (rlt_serve/bench_depth.py). Budget, estimated from the last H200 sweep: ~50 s per checkpoint for
# speculation (plain and adaptive at OUT_LEN=64, fixed K=4 d=2 at SPEC_OUT_LEN=16 since it runs at
# ~930 tok/s at c=128; 6 runs each per concurrency), ~30 s for early exit, the rest tests,
# checkpoints and engine builds. The speculation sweep stops EXIT_RESERVE_S (45) before the deadline.
#
#   run(command="bash recipes/spec_exit_gpu.sh", timeout_s=420)
#
# Needs only torch + safetensors (no msgspec/pyzmq/fastapi: it calls python modules, not the
# rlt-serve CLI, whose parser imports the router). Writes $OUT/spec_exit.md (the tables),
# $OUT/spec_exit.json (every row, with each round's tok/s and paired ratio), $OUT/spec_exit.log.
# GPU tests first (SKIP_TESTS=1 skips them).
# Knobs: SCALES (default "1.0 0.1 0.03"), CONC ("1 8 32 128"), OUT_LEN (64), RUNS (5 rounds, median),
# SPEC_OUT_LEN (16: output tokens of the fixed K:d runs), IN_LEN (32), SPEC ("4:2", K:draft-depth pairs),
# ADAPTIVE ("8"), EXIT_Q ("1.0 0.7 0.5"), EXIT_SCALE (0.1), EXIT_OUT_LEN (24), EXIT_RUNS (3),
# SHAPE (ouro-1.4b), DEVICE (cuda), DTYPE (bfloat16). A CPU dry run of the plumbing:
#   SHAPE=tiny DEVICE=cpu DTYPE=float32 SKIP_TESTS=1 CONC="1 2" OUT_LEN=12 SPEC_OUT_LEN=8 RUNS=2 \
#     EXIT_OUT_LEN=8 EXIT_RUNS=2 OUT=/tmp/x bash recipes/spec_exit_gpu.sh
set -uo pipefail
OUT=${OUT:-/tmp/rlt_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/spec_exit.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
DEADLINE_S=${DEADLINE_S:-345}
EXIT_RESERVE_S=${EXIT_RESERVE_S:-45}
START=$SECONDS
SCALES=${SCALES:-"1.0 0.1 0.03"}
CONC=${CONC:-"1 8 32 128"}
OUT_LEN=${OUT_LEN:-64}
RUNS=${RUNS:-5}
SPEC_OUT_LEN=${SPEC_OUT_LEN:-16}
IN_LEN=${IN_LEN:-32}
SPEC=${SPEC:-"4:2"}
ADAPTIVE=${ADAPTIVE:-"8"}
EXIT_Q=${EXIT_Q:-"1.0 0.7 0.5"}
EXIT_SCALE=${EXIT_SCALE:-0.1}
EXIT_OUT_LEN=${EXIT_OUT_LEN:-24}
EXIT_RUNS=${EXIT_RUNS:-3}
SHAPE=${SHAPE:-ouro-1.4b}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
ROOT=${CKPT_ROOT:-/tmp/rlt_spec_exit_$SHAPE}
left() { echo $((DEADLINE_S - (SECONDS - START))); }

if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
fi

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "=== GPU tests: exit readback (pinned + event), async/delayed exit, speculation on the device"
  timeout 90 python3 -m pytest -q -x -p no:cacheprovider --tb=short -m gpu tests/test_gpu_depth.py 2>&1 | tail -40
fi

# One base checkpoint (sharded so scaled copies can share its shards), then a copy per scale that
# rewrites only the residual-update tensors (seconds each).
echo "=== checkpoints (t=$((SECONDS - START))s)"
mkdir -p "$ROOT"
python3 - "$ROOT" "$SHAPE" "$DTYPE" $SCALES <<'EOF'
import os, sys, time
from rlt_serve.testing import SHAPES, derive_update_scaled, write_random_checkpoint
root, shape_name, dtype, scales = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
base = os.path.join(root, "base")
t0 = time.perf_counter()
if not os.path.exists(os.path.join(base, "model.safetensors.index.json")):
    family, shape = SHAPES[shape_name]
    shard = 1 << 30 if shape_name != "tiny" else 1 << 18
    write_random_checkpoint(base, family, seed=0, dtype=dtype, max_shard_bytes=shard, **shape)
print(f"base {shape_name} {dtype}: {time.perf_counter() - t0:.1f}s")
for s in scales:
    derive_update_scaled(base, os.path.join(root, f"s{s}"), float(s))
print(f"scaled copies {scales}: {time.perf_counter() - t0:.1f}s")
EOF

MODELS=()
for s in $SCALES; do MODELS+=(--model "$s=$ROOT/s$s"); done
COMMON=(--concurrency $CONC --input-len "$IN_LEN" --warmup 1 --dtype "$DTYPE" --device "$DEVICE")
rm -f "$OUT/spec.md" "$OUT/spec.json" "$OUT/exit.md" "$OUT/exit.json"
limit=$(( $(left) - EXIT_RESERVE_S ))
echo "=== speculation sweep, paired (limit ${limit}s, t=$((SECONDS - START))s)"
# shellcheck disable=SC2086
timeout --signal=INT --kill-after=10 "$(( limit > 10 ? limit : 10 ))" python3 -m rlt_serve.bench_depth "${MODELS[@]}" \
  "${COMMON[@]}" --spec $SPEC --adaptive $ADAPTIVE --output-len "$OUT_LEN" --fixed-output-len "$SPEC_OUT_LEN" \
  --runs "$RUNS" --out "$OUT/spec.md" --json "$OUT/spec.json" >/dev/null
echo "=== speculation: rc=$?, t=$((SECONDS - START))s"
echo "=== early-exit sweep (limit $(left)s)"
# shellcheck disable=SC2086
timeout --signal=INT --kill-after=10 "$(( $(left) > 10 ? $(left) : 10 ))" python3 -m rlt_serve.bench_depth \
  "${COMMON[@]}" --exit-model "$EXIT_SCALE=$ROOT/s$EXIT_SCALE" --exit-thresholds $EXIT_Q --output-len "$EXIT_OUT_LEN" \
  --runs "$EXIT_RUNS" --out "$OUT/exit.md" --json "$OUT/exit.json" >/dev/null
echo "=== early exit: rc=$?, t=$((SECONDS - START))s"
cat "$OUT/spec.md" "$OUT/exit.md" > "$OUT/spec_exit.md" 2>/dev/null
python3 - "$OUT" <<'EOF'
import json, os, sys
rows = []
for name in ("spec.json", "exit.json"):
    path = os.path.join(sys.argv[1], name)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            rows += json.load(f)
with open(os.path.join(sys.argv[1], "spec_exit.json"), "w", encoding="utf-8") as f:
    json.dump(rows, f, indent=2)
EOF
cat "$OUT/spec_exit.md"
echo "=== done: $((SECONDS - START))s; tables in $OUT/spec_exit.md, rows in $OUT/spec_exit.json"
