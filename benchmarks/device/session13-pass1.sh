#!/usr/bin/env bash
# Prepared in session 12 for the next session's first device call ($OUT comes back; at most 8 files). #10's last piece:
# the H100 false-alarm sweep with the final replica rule (32 replicas up to 4096 entries, ab8b9a0; session 12's H100
# sweep ran with the < 1000 rule), then the verifier's and the mosaic block's GPU tests.
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session13-pass1.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
timeout 500 python3 scripts/verify_false_alarms.py --mode gpu --n 140 --seed 18 --jobs 4 --budget-s 430 --out $OUT/results \
  > $OUT/logs/fa_gpu.log 2>&1
echo "false alarms rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/fa_gpu.log
( echo "# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command: pytest -m gpu tests/test_verify_*.py"
  timeout $(( 575 - ($(date +%s) - t0) )) python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_verify_*.py
  echo "tests rc=$? after $(( $(date +%s) - t0 )) s" ) > $OUT/logs/gpu_tests.log 2>&1
tail -4 $OUT/logs/fa_gpu.log; grep -E "passed|failed|rc=" $OUT/logs/gpu_tests.log | tail -3
