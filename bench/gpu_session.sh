#!/bin/bash
# The GPU measurement plan as one command of at most about 10 minutes, on any CUDA machine with
# the project installed (`pip install -e .`): each stage under its own time limit, most valuable
# first, each writing its figures as JSON under $RESULTS (default runs/gpu_session), then
# rendered into $RESULTS/README.md (`python -m bench.gpu_stages report`). experiments/gpu/README.md
# is regenerated from the same JSON (copy $RESULTS/*.json to experiments/gpu/results/ and run
# `python -m experiments.gpu.report`).
#
#   bash bench/gpu_session.sh                      # env rollout train tests packing report (~9 min)
#   bash bench/gpu_session.sh env tests report     # any subset, in the order given
#   RESULTS=runs/h100 PYTHON=.venv/bin/python bash bench/gpu_session.sh
#
# Stages (limits in seconds):
#   env      (30)  Python, torch, CUDA, megatron-core, GPU name; flash-attn / TE present or not
#   rollout (220)  64 sequences x 512 new tokens at 2 layers of Qwen3-30B-A3B's shapes: the lean
#                  decoder, megatron-core's dynamic engine eager and with CUDA graphs; each one's
#                  routing and log-probs against the trainer's recompute of the same tokens
#   train   (150)  train steps at the same shapes, 1k/2k/4k-token sequences: tokens/s, MFU,
#                  peak memory, and a torch.profiler table of one step
#   tests   (150)  the GPU tests (`pytest -m gpu`)
#   packing (100)  16 rows of a long tail of lengths (lognormal, mean 1k of at most 4k tokens),
#                  padded vs packed train steps: real tokens/s (train_long_tail.json)
#   report    (-)  $RESULTS/README.md from the JSON files
#
# Run from the repository's root. Exits 1 if a stage failed (the later ones still run), 2 on an
# unknown stage.
set -u -o pipefail
RESULTS=${RESULTS:-runs/gpu_session}
PYTHON=${PYTHON:-python3}
STAGES=${*:-env rollout train tests packing report}
for stage in $STAGES; do
  case $stage in
    env|rollout|train|tests|packing|report) ;;
    *) echo "unknown stage '$stage': expected env, rollout, train, tests, packing or report" >&2
       exit 2 ;;
  esac
done
status=0
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
BENCH=("$PYTHON" -m bench.gpu_stages)

for stage in $STAGES; do
  echo "== $stage $(date +%T)"
  case $stage in
    env)
      timeout 30 "$PYTHON" - > "$RESULTS/env.txt" 2>&1 <<'PY'
import importlib.util, sys, torch, megatron.core as m
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "megatron-core", m.__version__)
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
import datetime; print("date", datetime.date.today().isoformat())
for name in ("flash_attn", "flash_attn_3", "transformer_engine", "flashinfer", "zmq"):
    print(name, "present" if importlib.util.find_spec(name) else "absent")
import megatron.core.inference.engines.dynamic_engine  # noqa: F401  (imports on this stack)
print("dynamic engine imports")
PY
      rc=$?; cat "$RESULTS/env.txt"; [ $rc -eq 0 ] ;;
    rollout)
      timeout 220 "${BENCH[@]}" rollout --out "$RESULTS" 2>&1 | tee "$RESULTS/rollout.log" | tail -25 ;;
    train)
      timeout 150 "${BENCH[@]}" train --out "$RESULTS" 2>&1 | tee "$RESULTS/train.log" | tail -25 ;;
    tests)
      timeout 150 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/moe/model/test_gpu.py \
        tests/moe/inference/test_engine.py tests/megatron_gspo/rollout/test_engine_backend.py \
        > "$RESULTS/tests.log" 2>&1
      rc=$?; tail -15 "$RESULTS/tests.log"; [ $rc -eq 0 ] ;;
    packing)
      timeout 100 "${BENCH[@]}" train --out "$RESULTS" --name train_long_tail --lengths 4096 \
        --micro 1 --top 0 --long-tail 16 2>&1 | tee "$RESULTS/packing.log" | tail -8 ;;
    report)
      "${BENCH[@]}" report --out "$RESULTS" && cat "$RESULTS/README.md" ;;
  esac || { echo "stage $stage failed (exit $?)" >&2; status=1; }
done
exit $status
