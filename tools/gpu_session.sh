#!/bin/bash
# One GPU lease's measurements, most valuable first, each under its own time limit, so that a
# lease cut short still returns the first ones. Ours alone (no TRL), bf16.
#
#   bash tools/gpu_session.sh                 # through the device tool, from the repo root
#   OUT=runs/gpu_session bash tools/gpu_session.sh   # anywhere else
#
# Wheels for packages the machine lacks (megatron-core for its Python) go in .whl/ (gitignored,
# carried with the device tool's `carry`); they are installed into /tmp/site first.
# Writes under $OUT: env.txt, tests.log, and README.md, a copy of experiments/throughput/README.md
# whose gpu_* markers the tools fill in (`--readme`); copy it back over the original to keep them.
# About 15 minutes on an H100 with the local (non-TE) spec.
set -u
OUT=${OUT:-runs/gpu_session}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
README="$OUT/README.md"
cp experiments/throughput/README.md "$README"

python3 - > "$OUT/env.txt" 2>&1 <<'EOF'
import sys, torch, megatron.core as m
from moe.experts import grouped_mm_runs
print(sys.version.split()[0], torch.__version__, torch.version.cuda, m.__version__,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
print("grouped_mm fp32/bf16:", *(grouped_mm_runs("cuda", d) for d in (torch.float32, torch.bfloat16)))
EOF
cat "$OUT/env.txt"

timeout 240 python3 -m pytest -q -p no:cacheprovider -m "gpu or not slow" tests/moe/test_gpu.py \
  tests/moe/test_experts.py > "$OUT/tests.log" 2>&1
tail -3 "$OUT/tests.log"

BENCH=(python3 -m tools.bench_throughput --skip-trl --peak-tflops 989 --force-length
  --iterations 3 --warmup 1 --set model.dtype=bf16 --set model.preset=small --readme "$README")
timeout 180 "${BENCH[@]}" --prompts 8 --group-size 8 --max-new-tokens 128 \
  --marker gpu_small_grouped 2>&1 | tail -4
timeout 240 python3 -m tools.profile_ours --set model.dtype=bf16 --set model.preset=small \
  --max-new-tokens 32 --warmup 1 --iterations 1 --top 15 --readme "$README" \
  --marker gpu_profile_small 2>&1 | tail -3
timeout 420 python3 -m tools.bench_throughput --sweep --skip-trl --peak-tflops 989 \
  --lengths 32,128 --batches 8x8,16x16 --set model.dtype=bf16 --set model.preset=small \
  --out "$OUT/sweep" --readme "$README" --marker gpu_sweep 2>&1 | tail -3
