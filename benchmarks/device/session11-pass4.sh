#!/usr/bin/env bash
# Session 11, pass 4 ($OUT comes back; at most 8 files). #10: the H100 false-alarm sweep (100 runs) with the final
# statistics of this session (c213fad: rho scales only the rounding part behind kinks), then the GPU-marked LoRA
# pallas block tests that passes 1-2 could not finish (bf16 and bf16-NF4 block verification, the NF4 kernels).
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session11-pass4.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
timeout 400 python3 scripts/verify_false_alarms.py --mode gpu --n 100 --seed 16 --jobs 4 --out $OUT/results \
  > $OUT/logs/fa_gpu.log 2>&1
echo "false alarms rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/fa_gpu.log
( echo "# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command: pytest -m gpu -v --durations=0 tests/test_lora_block_pallas.py -k 'bf16' tests/test_nf4_matmul.py"
  timeout $(( 575 - ($(date +%s) - t0) )) python3 -m pytest -m gpu -v --durations=0 -p no:cacheprovider \
    tests/test_nf4_matmul.py "tests/test_lora_block_pallas.py::test_gpu_compiled_pallas_block_vjp_verified" \
    --deselect "tests/test_lora_block_pallas.py::test_gpu_compiled_pallas_block_vjp_verified[f32]" ) > $OUT/logs/gpu_tests.log 2>&1
echo "tests rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/gpu_tests.log
tail -6 $OUT/logs/fa_gpu.log; grep -E "PASS|FAIL|ERROR|passed|failed|rc=|s call" $OUT/logs/gpu_tests.log | tail -30
