#!/usr/bin/env bash
# Prepared in session 10 for the next session's first device call ($OUT comes back; at most 8 files).
# #13: the block with the bf16 backward products (76338f2) and the grouped projections (group_projections=True),
# PEFT and jax.grad in the same run, each variant in a fresh process. Then the GPU tests that session 10 could not
# re-run (the interpreter fix on the bf16-nf4 pallas block; the NF4 dx kernel on bf16 dY).
# Run alone: `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session11-pass1.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
timeout 330 python3 scripts/bench.py lora --sizes full --budget-s 300 --out $OUT/results \
  --variants "custom_vjp cudnn,jax.grad(reference) cudnn,torch,custom_vjp+grouped cudnn" > $OUT/logs/bench.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench.log
( echo "# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command: pytest -m gpu tests/test_lora_block_pallas.py tests/test_nf4_matmul.py"
  timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_lora_block_pallas.py tests/test_nf4_matmul.py ) > $OUT/logs/gpu_tests.log 2>&1
echo "tests rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/gpu_tests.log
grep -E "^lora|rc=" $OUT/logs/bench.log | cut -c1-160; tail -3 $OUT/logs/gpu_tests.log
