#!/bin/bash
# One GPU lease's measurements as one device call of at most 9 minutes: each stage under its own
# time limit, most valuable first, each writing its figures as JSON under $OUT, then rendered
# into $OUT/README.md (`python -m bench.gpu_lease report`), the table experiments/gpu/README.md
# is regenerated from (copy $OUT/*.json to experiments/gpu/results/ and run
# `python -m experiments.gpu.report`).
#
#   bash bench/gpu_session.sh                      # env rollout train tests report (~8 min)
#   bash bench/gpu_session.sh env tests report     # any subset, in the order given
#
# Stages (limits in seconds):
#   env      (30)  Python, torch, CUDA, megatron-core, GPU name; flash-attn / TE present or not
#   rollout (220)  64 sequences x 512 new tokens at 2 layers of Qwen3-30B-A3B's shapes: the lean
#                  decoder, megatron-core's dynamic engine eager and with CUDA graphs; each one's
#                  routing and log-probs against the trainer's recompute of the same tokens
#   train   (150)  train steps at the same shapes, 1k/2k/4k-token sequences: tokens/s, MFU,
#                  peak memory, and a torch.profiler table of one step
#   tests   (150)  the GPU tests (`pytest -m gpu`)
#   report    (-)  $OUT/README.md from the JSON files
#
# Wheels for packages the machine lacks (megatron-core for its Python) go in .whl/ (gitignored,
# carried with the device tool's `carry`), installed into /tmp/site once per machine.
# Exits 1 if a stage failed (the later ones still run), 2 on an unknown stage.
set -u -o pipefail
OUT=${OUT:-runs/gpu_session}
STAGES=${*:-env rollout train tests report}
for stage in $STAGES; do
  case $stage in
    env|rollout|train|tests|report) ;;
    *) echo "unknown stage '$stage': expected env, rollout, train, tests or report" >&2
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
LEASE=(python3 -m bench.gpu_lease)

for stage in $STAGES; do
  echo "== $stage $(date +%T)"
  case $stage in
    env)
      timeout 30 python3 - > "$OUT/env.txt" 2>&1 <<'EOF'
import importlib.util, sys, torch, megatron.core as m
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "megatron-core", m.__version__)
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
import datetime; print("date", datetime.date.today().isoformat())
for name in ("flash_attn", "flash_attn_3", "transformer_engine", "flashinfer", "zmq"):
    print(name, "present" if importlib.util.find_spec(name) else "absent")
import megatron.core.inference.engines.dynamic_engine  # noqa: F401  (imports on this stack)
print("dynamic engine imports")
EOF
      rc=$?; cat "$OUT/env.txt"; [ $rc -eq 0 ] ;;
    rollout)
      timeout 220 "${LEASE[@]}" rollout --out "$OUT" 2>&1 | tee "$OUT/rollout.log" | tail -25 ;;
    train)
      timeout 150 "${LEASE[@]}" train --out "$OUT" 2>&1 | tee "$OUT/train.log" | tail -25 ;;
    tests)
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe/test_gpu.py \
        tests/moe/test_engine.py tests/megatron_gspo/rollout/test_engine_backend.py \
        > "$OUT/tests.log" 2>&1
      rc=$?; tail -15 "$OUT/tests.log"; [ $rc -eq 0 ] ;;
    report)
      "${LEASE[@]}" report --out "$OUT" && cat "$OUT/README.md" ;;
  esac || { echo "stage $stage failed (exit $?)" >&2; status=1; }
done
exit $status
