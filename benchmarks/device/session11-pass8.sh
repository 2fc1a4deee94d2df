#!/usr/bin/env bash
# Session 11, pass 8 ($OUT comes back; at most 8 files). #13: the block's default (XLA shares the recompute with the
# forward) against low_memory=True (the attention half recomputed after the MLP backward), PEFT and jax.grad in the
# same run, each in a fresh process. Then #10 item 5's last GPU tests: the compiled pallas block verified in bf16
# and bf16-NF4 (pass 7's suite ran out of time before them), two workers.
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session11-pass8.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
timeout 200 python3 scripts/bench.py lora --sizes full --budget-s 190 --out $OUT/results \
  --variants "custom_vjp cudnn,custom_vjp+low-memory cudnn,jax.grad(reference) cudnn,torch" > $OUT/logs/bench.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench.log
( echo "# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command: pytest -m gpu -n 2 -rA --durations=10 test_gpu_compiled_pallas_block_vjp_verified[bf16|bf16-nf4]"
  timeout $(( 560 - ($(date +%s) - t0) )) python3 -m pytest -m gpu -n 2 -rA --durations=10 -p no:cacheprovider \
    "tests/test_lora_block_pallas.py::test_gpu_compiled_pallas_block_vjp_verified[bf16]" \
    "tests/test_lora_block_pallas.py::test_gpu_compiled_pallas_block_vjp_verified[bf16-nf4]" ) > $OUT/logs/gpu_tests.log 2>&1
echo "tests rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/gpu_tests.log
grep -E "^#   |rc=" $OUT/logs/bench.log; grep -E "PASS|FAIL|ERROR|passed|failed|rc=|s call" $OUT/logs/gpu_tests.log | tail -12
