#!/usr/bin/env bash
# Prepared in session 11 for the next session's first device call ($OUT comes back; at most 8 files).
# #13: fold_lora_b (each projection's forward as one GEMM [h | sU] [W | B]^T; untimed so far) against the default,
# low_memory and grouped, with jax.grad and PEFT in the same run, each variant in a fresh process. #10: the bf16-NF4
# pallas block's GPU verification after the float64 fix (e714a07), the one GPU test that failed in session 11.
# Run alone: `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session12-pass1.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
timeout 260 python3 scripts/bench.py lora --sizes full --budget-s 250 --out $OUT/results \
  --variants "custom_vjp cudnn,custom_vjp+fold-b cudnn,custom_vjp+low-memory cudnn,custom_vjp+grouped cudnn,jax.grad(reference) cudnn,torch" \
  > $OUT/logs/bench.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench.log
( echo "# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command: pytest -m gpu -rA --durations=5 test_gpu_compiled_pallas_block_vjp_verified[bf16-nf4]"
  timeout $(( 570 - ($(date +%s) - t0) )) python3 -m pytest -m gpu -rA --durations=5 -p no:cacheprovider \
    "tests/test_lora_block_pallas.py::test_gpu_compiled_pallas_block_vjp_verified[bf16-nf4]" ) > $OUT/logs/gpu_tests.log 2>&1
echo "tests rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/gpu_tests.log
grep -E "^#   |rc=" $OUT/logs/bench.log; grep -E "PASS|FAIL|passed|failed|rc=" $OUT/logs/gpu_tests.log | tail -6
