#!/usr/bin/env bash
# Session 12, pass 3 ($OUT comes back; at most 8 files). #13: the first Mosaic GPU kernel (jaxgrad/ops/
# lora_linear_mgpu.py, one LoRA projection's forward): its GPU tests against the formula's error model, then
# bench.py lora_proj (the kernel, XLA fold-b / unfolded, the base GEMM alone) at the block's four shapes, then the
# block with backend="mosaic" against the default (bench.py lora, fresh processes).
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session12-pass3.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
( echo "# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command: pytest -m gpu tests/test_lora_linear_mgpu.py"
  timeout 200 python3 -m pytest -m gpu -q -rA -x -p no:cacheprovider tests/test_lora_linear_mgpu.py 2>&1 | tail -60 ) \
  > $OUT/logs/gpu_tests.log 2>&1
echo "tests rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/gpu_tests.log
timeout 160 python3 scripts/bench.py lora_proj --sizes full --out $OUT/results > $OUT/logs/bench.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench.log
# the block with the kernel in its forward and recompute (backend="mosaic") against the default, fresh processes
timeout $(( 575 - ($(date +%s) - t0) )) python3 scripts/bench.py lora --sizes full --budget-s $(( 560 - ($(date +%s) - t0) )) \
  --out $OUT/results --variants "custom_vjp cudnn mosaic,custom_vjp cudnn" > $OUT/logs/bench_block.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_block.log
grep -E "passed|failed|Error|rc=" $OUT/logs/gpu_tests.log | tail -8; grep -E "lora_proj |rc=" $OUT/logs/bench.log
grep -E "^#   |rc=" $OUT/logs/bench_block.log
