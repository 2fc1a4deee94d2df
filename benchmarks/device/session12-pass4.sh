#!/usr/bin/env bash
# Session 12, pass 4 ($OUT comes back; at most 8 files). #13: the Mosaic GPU dX kernel's tests and the mosaic block's
# bf16 verification (jaxgrad.verify against the plain reference), then the block bench in one run: backend=mosaic
# (forward + dX kernels), its low-memory form, the default custom VJP, jax.grad + cuDNN and PEFT, fresh processes.
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session12-pass4.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
( echo "# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command: pytest -m gpu tests/test_lora_linear_mgpu.py tests/test_lora_block_mosaic.py"
  timeout 330 python3 -m pytest -m gpu -q -rA -p no:cacheprovider --durations=5 tests/test_lora_linear_mgpu.py \
    tests/test_lora_block_mosaic.py 2>&1 | tail -80 ) > $OUT/logs/gpu_tests.log 2>&1
echo "tests rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/gpu_tests.log
timeout $(( 578 - ($(date +%s) - t0) )) python3 scripts/bench.py lora --sizes full --budget-s $(( 565 - ($(date +%s) - t0) )) \
  --out $OUT/results --variants "=custom_vjp cudnn mosaic,=custom_vjp cudnn,=jax.grad(reference) cudnn,torch,=custom_vjp+low-memory cudnn mosaic" \
  > $OUT/logs/bench_block.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_block.log
grep -E "passed|failed|Error|rc=" $OUT/logs/gpu_tests.log | tail -8; grep -E "^#   |rc=" $OUT/logs/bench_block.log
