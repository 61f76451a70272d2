#!/usr/bin/env bash
# Self-speculation and early exit on the H200: speedup vs measured acceptance rate and throughput
# vs mean exit depth, on a random Ouro-1.4B-shape bf16 checkpoint at three update scales
# (recipes/spec_exit.md says what the scale means). About 4 minutes; a global deadline
# (DEADLINE_S, default 330 s) stops it before the device budget runs out, keeping what is done.
#
#   run(command="bash recipes/spec_exit_gpu.sh", timeout_s=400)
#
# Needs only torch + safetensors (no msgspec/pyzmq/fastapi: it calls python modules, not the
# rlt-serve CLI, whose parser imports the router). Writes $OUT/spec_exit.md (the tables),
# $OUT/spec_exit.json (every row), $OUT/spec_exit.log. GPU tests first (SKIP_TESTS=1 skips them).
# Knobs: SCALES (default "1.0 0.1 0.03"), CONC ("1 8 32 128"), OUT_LEN (24), RUNS (3, median), IN_LEN (32),
# SPEC ("4:2", K:draft-depth pairs), ADAPTIVE ("8"), EXIT_Q ("1.0 0.7 0.5"), EXIT_SCALE (0.1),
# SHAPE (ouro-1.4b), DEVICE (cuda), DTYPE (bfloat16). A CPU dry run of the plumbing:
#   SHAPE=tiny DEVICE=cpu DTYPE=float32 SKIP_TESTS=1 CONC="1 2" OUT=/tmp/x bash recipes/spec_exit_gpu.sh
set -uo pipefail
OUT=${OUT:-/tmp/rlt_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/spec_exit.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
DEADLINE_S=${DEADLINE_S:-330}
START=$SECONDS
SCALES=${SCALES:-"1.0 0.1 0.03"}
CONC=${CONC:-"1 8 32 128"}
OUT_LEN=${OUT_LEN:-24}
RUNS=${RUNS:-3}
IN_LEN=${IN_LEN:-32}
SPEC=${SPEC:-"4:2"}
ADAPTIVE=${ADAPTIVE:-"8"}
EXIT_Q=${EXIT_Q:-"1.0 0.7 0.5"}
EXIT_SCALE=${EXIT_SCALE:-0.1}
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
echo "=== sweep (limit $(left)s, t=$((SECONDS - START))s)"
# shellcheck disable=SC2086
timeout --signal=INT --kill-after=10 "$(left)" python3 -m rlt_serve.bench_depth "${MODELS[@]}" \
  --concurrency $CONC --spec $SPEC --adaptive $ADAPTIVE \
  --exit-model "$EXIT_SCALE=$ROOT/s$EXIT_SCALE" --exit-thresholds $EXIT_Q \
  --input-len "$IN_LEN" --output-len "$OUT_LEN" --runs "$RUNS" --warmup 1 --dtype "$DTYPE" --device "$DEVICE" \
  --out "$OUT/spec_exit.md" --json "$OUT/spec_exit.json"
echo "=== done: rc=$?, $((SECONDS - START))s; tables in $OUT/spec_exit.md"
