#!/usr/bin/env bash
# One H200 run: TTFT and inter-token latency of 1 prefill + 1 decode worker (two processes on
# cuda:0, NIXL over device memory) against one `both` worker, through the real HTTP router, on a
# random Ouro-1.4B-shape bf16 checkpoint. Prints a markdown table (recipes/pd_bench.py) and writes
# $OUT/pd_h200.log, $OUT/pd_bench.json.
#
# Run from the repo root (the device tool's working-tree copy) with the serving wheels carried:
#   run(command="bash recipes/pd_h200.sh", carry=[".whl"], timeout_s=600)
# (a CPU dry run here: DEVICE=cpu SHAPE=tiny DTYPE=float32 INPUT_LEN=24 OUTPUT_LEN=8 PAGES=400 CONC=1,4
#  NPROMPTS=4,8 SKIP_WHL=1 PY=/work/main/.venv/bin/python bash recipes/pd_h200.sh: ~1 minute)
# .whl (cp312 manylinux, ~35 MiB): fastapi, starlette, uvicorn, pydantic(+core), anyio, h11, click,
# prometheus-client, annotated-types/-doc, typing-inspection, typing-extensions, idna, sniffio,
# opentelemetry-api, msgspec, pyzmq, and nixl-cu13 1.5.1 without its unused nixl_ep_cu13 part
# (recipes/slim_wheel.py). The image already has torch, numpy, safetensors, tokenizers, jinja2.
#
# DEADLINE_S (default 480) bounds the whole run. Knobs: CKPT=DIR (reuse a checkpoint), SHAPE
# (default ouro-1.4b), DEVICE (default cuda; `DEVICE=cpu SHAPE=tiny` is the CPU dry run),
# CONC / NPROMPTS / INPUT_LEN / OUTPUT_LEN / PAGES (KV pages per worker), DTYPE, PY, SKIP_WHL=1.
set -uo pipefail
OUT=${OUT:-/tmp/rlt_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/pd_h200.log") 2>&1
export PYTHONUNBUFFERED=1
START=$SECONDS
DEADLINE_S=${DEADLINE_S:-480}
DEVICE=${DEVICE:-cuda}
SHAPE=${SHAPE:-ouro-1.4b}
CKPT=${CKPT:-/tmp/rlt_pd_${SHAPE}}
DTYPE=${DTYPE:-bfloat16}
CONC=${CONC:-1,16}
NPROMPTS=${NPROMPTS:-8,64}
INPUT_LEN=${INPUT_LEN:-1024}
OUTPUT_LEN=${OUTPUT_LEN:-128}
PAGES=${PAGES:-1500}  # per worker: 2 x 1500 pages x 12 MiB (Ouro-1.4B, 96 planes) ~ 35 GiB of the H200
PY=${PY:-python3}

left() { echo $((DEADLINE_S - (SECONDS - START))); }

# -- environment ---------------------------------------------------------------------------
if [ "${SKIP_WHL:-0}" != 1 ] && [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  t0=$SECONDS
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/rlt_site \
    .whl/*.whl || { echo "pip install of .whl failed"; exit 1; }
  export PYTHONPATH=/tmp/rlt_site
  echo "=== wheels installed into /tmp/rlt_site in $((SECONDS - t0))s"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the checkout itself; no install needed
if [ "$DEVICE" = cuda ]; then
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}  # both PD workers share cuda:0
  # UCX's own transport choice (cuda_ipc between the two processes) is what measured 106.8 GiB/s
  # in recipes/pd.md; set UCX_TLS in the environment to force another.
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
else
  export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
fi
$PY - <<'EOF' || exit 1
import importlib, sys
print("python", sys.version.split()[0])
bad = []
for name in ["torch", "numpy", "safetensors", "tokenizers", "jinja2", "msgspec", "zmq", "fastapi", "uvicorn",
             "pydantic", "prometheus_client", "nixl_cu13"]:
    try:
        m = importlib.import_module(name)
        print(f"  {name:<18} {getattr(m, '__version__', 'ok')}  {getattr(m, '__file__', '')}")
    except Exception as e:
        print(f"  {name:<18} MISSING ({type(e).__name__}: {e})")
        bad.append(name)
from workers.transfer.nixl_agent import nixl_unavailable
print("  nixl agent:", nixl_unavailable() or "ok")
import router.launch, router.app  # the server's imports, before a launch can fail on them
sys.exit(1 if bad else 0)
EOF

# -- the checkpoint ------------------------------------------------------------------------
RLT="$PY -m rlt_serve.cli"
if [ ! -f "$CKPT/config.json" ]; then
  t0=$SECONDS
  $RLT make-random-checkpoint --shape "$SHAPE" "$CKPT" --dtype "$DTYPE" || { echo "checkpoint failed"; exit 1; }
  echo "=== checkpoint $CKPT in $((SECONDS - t0))s"
fi

# (pd_bench.py gives the checkpoint a one-word-per-id tokenizer: the router decodes every token)
# -- both vs 1P1D ----------------------------------------------------------------------------
L=$(left)
echo "=== pd_bench: $L s left; concurrency $CONC, prompts $NPROMPTS, input $INPUT_LEN, output $OUTPUT_LEN"
timeout --signal=INT --kill-after=15 "$((L > 30 ? L - 10 : 20))" \
  $PY recipes/pd_bench.py --model "$CKPT" --concurrency "$CONC" --num-prompts "$NPROMPTS" \
    --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --warmup 4 --load-timeout 240 \
    --launch-args "--device $DEVICE --dtype $DTYPE --num-kv-pages $PAGES" \
    --pd-args "--prefill 1 --decode 1 --kv-transport nixl" --json "$OUT/pd_bench.json"
echo "=== pd_bench rc=$?; total $((SECONDS - START))s"
