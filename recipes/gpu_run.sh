#!/usr/bin/env bash
# One H200 run: environment check, GPU tests, attention microbenchmark, then `rlt-serve bench` on a
# random Ouro-1.4B-shape bf16 checkpoint for each available backend. Everything is teed to
# $OUT/gpu_run.log; bench results also go to $OUT/bench_<backend>_c<N>.json.
#
# Run from the repo root (the device tool's working-tree copy), with the wheels carried:
#   run(command="bash recipes/gpu_run.sh", carry=[".whl"], timeout_s=600)
# .whl holds msgspec and pyzmq (cp312): the rlt-serve CLI imports router.launch, which needs them,
# and the H200 image has neither (KINDS.md). Without .whl the script still runs the benches
# through rlt_serve.cli's parser if those imports work, else it reports what is missing.
#
# A global deadline (DEADLINE_S, default 540 s) keeps the whole run under 9 minutes: each step
# gets at most what is left, and steps past the deadline are skipped and named in the log.
# SKIP_TESTS=1 skips pytest (a bench-only rerun); CKPT=DIR reuses a checkpoint directory.
set -uo pipefail
OUT=${OUT:-/tmp/rlt_out}
mkdir -p "$OUT"
LOG="$OUT/gpu_run.log"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1
DEADLINE_S=${DEADLINE_S:-540}
START=$SECONDS
CKPT=${CKPT:-/tmp/rlt_ouro14_bf16}

step() {  # step NAME MAX_SECONDS CMD...: run CMD with min(MAX, time left), print its wall time
  local name=$1 max=$2; shift 2
  local left=$((DEADLINE_S - (SECONDS - START)))
  if ((left < 15)); then echo "=== SKIPPED (deadline): $name"; return 0; fi
  ((max > left)) && max=$left
  echo "=== $name (limit ${max}s, t=$((SECONDS - START))s)"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=10 "$max" "$@"
  local rc=$?
  echo "=== $name: rc=$rc, $((SECONDS - t0))s"
  return 0
}

# -- environment ---------------------------------------------------------------------------
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the checkout itself; no install needed
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
python3 - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ["torch", "triton", "numpy", "safetensors", "tokenizers", "jinja2", "msgspec", "zmq", "flash_attn",
             "fastapi", "pytest"]:
    try:
        m = importlib.import_module(name)
        print(f"  {name:<12} {getattr(m, '__version__', 'ok')}")
    except Exception as e:
        print(f"  {name:<12} MISSING ({type(e).__name__}: {e})")
import torch
print("cuda", torch.version.cuda, torch.cuda.get_device_name(0))
try:
    from torch.nn.attention.varlen import varlen_attn
    import inspect
    print("torch varlen_attn:", inspect.signature(varlen_attn))
except Exception as e:
    print("torch varlen_attn: MISSING", e)
from rlt_serve.attention.backend import get_attention_backend
b = get_attention_backend("auto", torch.device("cuda"), torch.bfloat16, 16)
print("auto backend:", b.name, "-", b.reason)
try:
    f = get_attention_backend("flash-attn", torch.device("cuda"), torch.bfloat16, 16)
    print("flash-attn kernel:", f.kernel)
except Exception as e:
    print("flash-attn:", e)
EOF
BACKENDS=$(python3 - <<'EOF'
import torch
from rlt_serve.attention.backend import _missing
print(" ".join(b for b in ("triton", "flash-attn", "torch") if _missing(b, torch.device("cuda"), torch.bfloat16) is None))
EOF
)
echo "backends: $BACKENDS"
RLT="python3 -m rlt_serve.cli"

# -- the checkpoint is written on the CPU while the GPU tests run ------------------------------
( t0=$SECONDS; $RLT make-random-checkpoint --shape ouro-1.4b "$CKPT" --dtype bfloat16 > "$OUT/ckpt.txt" 2>&1;
  echo "rc=$? $((SECONDS - t0))s" >> "$OUT/ckpt.txt" ) &
CKPT_PID=$!

if [ "${SKIP_TESTS:-0}" = 1 ]; then echo "=== SKIPPED: pytest (SKIP_TESTS=1)"
else step "pytest -m gpu tests/test_gpu.py" 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py; fi
step "attention microbenchmark" 45 python3 recipes/attn_microbench.py $BACKENDS

echo "=== waiting for the checkpoint"
wait $CKPT_PID
cat "$OUT/ckpt.txt"

bench() {  # bench BACKEND CONCURRENCY NUM_PROMPTS LIMIT [extra args]
  local b=$1 c=$2 n=$3 limit=$4; shift 4
  step "bench $b c=$c" "$limit" $RLT bench --model "$CKPT" --attention-backend "$b" --concurrency "$c" \
    --num-prompts "$n" --input-len 512 --output-len 128 --runs 3 --warmup 1 --dtype bfloat16 \
    --json "$OUT/bench_${b}_c${c}.json" "$@"
}
# In priority order, so that the deadline cuts the least useful ones: auto's choice (triton) at
# both concurrencies, with the dense reference once at c=1; then the other backends. The torch
# backend's per-row SDPA loop takes minutes per c=64 run, so it runs at c=1 only.
bench triton 1 1 100
bench triton 64 128 130 --skip-reference
for b in $BACKENDS; do
  [ "$b" = triton ] && continue
  bench "$b" 1 1 70 --skip-reference
  [ "$b" = torch ] || bench "$b" 64 128 130 --skip-reference
done
echo "=== total $((SECONDS - START))s"
