#!/bin/bash
# One GPU lease's measurements, in stages that each fit one device call (10 minutes at most),
# most valuable first, each under its own time limit. Ours alone (no TRL), bf16.
#
#   bash tools/gpu_session.sh env tests point sampling  # about 7 minutes: versions, GPU tests,
#                                                # one point, the sampler at Qwen3's vocabulary
#   bash tools/gpu_session.sh profile            # about 4: torch.profiler tables by GPU time
#   bash tools/gpu_session.sh real               # about 4: 2 layers of Qwen3-30B-A3B's shapes
#   bash tools/gpu_session.sh sweep              # at most 8: ours over lengths x batch sizes
#   bash tools/gpu_session.sh                    # all stages (outside the device tool's limit)
#
# Budget: these estimates (23 minutes) plus a machine start (a minute or more) and the 30 s warm
# window per call about fill a 30-minute lease, and the stages' time limits (28 minutes) exceed
# it: the sweep goes last since it keeps the points it finished when stopped (give its call a
# timeout_s inside what is left; the device tool starts no machine under 4 minutes left).
#
# Outputs under $OUT (the device tool's; default runs/gpu_session): env.txt, tests.log, and
# README.md, a copy of experiments/throughput/README.md whose gpu_* markers the tools fill in
# (`--readme`). Copy it back over the original after each call, so that the next call's copy
# keeps what the previous one filled in.
# Wheels for packages the machine lacks (megatron-core for its Python) go in .whl/ (gitignored,
# carried with the device tool's `carry`); they are installed into /tmp/site once per machine
# (delete /tmp/site to reinstall changed ones). Exits 1 if a stage failed (the others still ran).
set -u -o pipefail
OUT=${OUT:-runs/gpu_session}
STAGES=${*:-env tests point sampling profile real sweep}
for stage in $STAGES; do
  case $stage in
    env|tests|point|sampling|profile|real|sweep) ;;
    *) echo "unknown stage '$stage': expected env, tests, point, sampling, profile, real" \
            "or sweep" >&2
       exit 2 ;;
  esac
done
status=0
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  if [ ! -d /tmp/site/megatron ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
  fi
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
README="$OUT/README.md"
cp experiments/throughput/README.md "$README"
SMALL=(--set model.dtype=bf16 --set model.preset=small --readme "$README")

for stage in $STAGES; do
  case $stage in
    env)
      python3 - > "$OUT/env.txt" 2>&1 <<'EOF'
import sys, torch, megatron.core as m
from moe.experts import grouped_mm_runs
print(sys.version.split()[0], torch.__version__, torch.version.cuda, m.__version__,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
print("grouped_mm fp32/bf16:", *(grouped_mm_runs("cuda", d) for d in (torch.float32, torch.bfloat16)))
EOF
      rc=$?; cat "$OUT/env.txt"; [ $rc -eq 0 ] ;;
    tests)
      timeout 240 python3 -m pytest -q -p no:cacheprovider -m "gpu or not slow" \
        tests/moe/test_gpu.py tests/moe/test_experts.py tests/moe/test_dispatch.py \
        > "$OUT/tests.log" 2>&1
      rc=$?; tail -3 "$OUT/tests.log"; [ $rc -eq 0 ] ;;
    point)
      timeout 180 python3 -m tools.bench_throughput --skip-trl --peak-tflops 989 --force-length \
        --iterations 3 --warmup 1 --prompts 8 --group-size 8 --max-new-tokens 128 "${SMALL[@]}" \
        --marker gpu_small_grouped 2>&1 | tail -4 ;;
    sampling)  # one decode step's draws at B=64 x V=151,936: on the GPU vs on the host
      timeout 120 python3 -m tools.bench_sampling --readme "$README" --marker gpu_sampling \
        2>&1 | tail -2 ;;
    profile)
      timeout 240 python3 -m tools.profile_ours --max-new-tokens 32 --warmup 1 --iterations 1 \
        --top 15 "${SMALL[@]}" --marker gpu_profile_small 2>&1 | tail -3 ;;
    sweep)
      timeout 480 python3 -m tools.bench_throughput --sweep --skip-trl --peak-tflops 989 \
        --lengths 32,128 --batches 8x8,16x16 --out "$OUT/sweep" "${SMALL[@]}" \
        --marker gpu_sweep 2>&1 | tail -3 ;;
    real)  # a real model's layer shapes (128 experts of hidden 2048, top-8) at a depth that fits
      timeout 420 python3 -m tools.bench_throughput --skip-trl --peak-tflops 989 --force-length \
        --iterations 3 --warmup 1 --prompts 8 --group-size 8 --max-new-tokens 128 \
        --set model.dtype=bf16 --set model.preset=qwen3-30b-a3b --set model.num_layers=2 \
        --readme "$README" --marker gpu_qwen3_layers 2>&1 | tail -4 ;;
  esac || { echo "stage $stage failed (exit $?)" >&2; status=1; }
done
exit $status
