#!/usr/bin/env bash
# Session 11, pass 2 ($OUT comes back; at most 8 files). #10: the H100 false-alarm sweep to 100 runs with the
# gated scale test (stats.py, session 11), then the GPU-marked LoRA kernel tests that timed out in pass 1 (verbose,
# per-test durations, so a slow test shows its name). Run alone:
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session11-pass2.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
timeout 420 python3 scripts/verify_false_alarms.py --mode gpu --n 100 --seed 14 --jobs 4 --out $OUT/results \
  > $OUT/logs/fa_gpu.log 2>&1
echo "false alarms rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/fa_gpu.log
( echo "# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command: pytest -m gpu -v --durations=0 tests/test_lora_block_pallas.py tests/test_nf4_matmul.py"
  timeout $(( 560 - ($(date +%s) - t0) )) python3 -m pytest -m gpu -v --durations=0 -p no:cacheprovider \
    tests/test_lora_block_pallas.py tests/test_nf4_matmul.py ) > $OUT/logs/gpu_tests.log 2>&1
echo "tests rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/gpu_tests.log
tail -16 $OUT/logs/fa_gpu.log; grep -E "PASS|FAIL|ERROR|passed|failed|rc=" $OUT/logs/gpu_tests.log | tail -30
