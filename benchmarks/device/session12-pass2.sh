#!/usr/bin/env bash
# Session 12, pass 2 ($OUT comes back; at most 8 files). #10: the H100 false-alarm sweep (130 runs, hardware rounding)
# with the slice level and 32 replicas for small functions (4780501); then, if time is left, the GPU-marked verifier
# tests. `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session12-pass2.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
timeout 560 python3 scripts/verify_false_alarms.py --mode gpu --n 130 --seed 17 --jobs 4 --budget-s 470 --out $OUT/results \
  > $OUT/logs/fa_gpu.log 2>&1
echo "false alarms rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/fa_gpu.log
( echo "# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command: pytest -m gpu tests/test_verify_*.py tests/test_lora_ops.py"
  timeout $(( 570 - ($(date +%s) - t0) )) python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_verify_*.py tests/test_lora_ops.py ) \
  > $OUT/logs/gpu_tests.log 2>&1
echo "tests rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/gpu_tests.log
tail -8 $OUT/logs/fa_gpu.log; grep -E "passed|failed|rc=" $OUT/logs/gpu_tests.log | tail -4
