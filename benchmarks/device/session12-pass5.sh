#!/usr/bin/env bash
# Session 12, pass 5 ($OUT comes back; at most 8 files). #13: the dX kernel's test against the same arithmetic in XLA
# (pass 4 compared it with the block's XLA dX, which keeps dY B in fp32), bench.py lora_proj with the dX rows, and
# the block bench once more (mosaic, default, jax.grad, PEFT); #10: the verifier's GPU-marked tests (cut in pass 2).
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session12-pass5.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
( echo "# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command: pytest -m gpu tests/test_lora_linear_mgpu.py; pytest -m gpu tests/test_verify_*.py tests/test_lora_ops.py"
  timeout 120 python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_lora_linear_mgpu.py > $OUT/logs/t1.txt 2>&1
  echo "mgpu tests rc=$? after $(( $(date +%s) - t0 )) s"; head -c 20000 $OUT/logs/t1.txt | tail -c 8000; rm $OUT/logs/t1.txt
  timeout 150 python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_verify_*.py tests/test_lora_ops.py > $OUT/logs/t2.txt 2>&1
  echo "verify tests rc=$? after $(( $(date +%s) - t0 )) s"; tail -40 $OUT/logs/t2.txt; rm $OUT/logs/t2.txt
) > $OUT/logs/gpu_tests.log 2>&1
timeout 150 python3 scripts/bench.py lora_proj --sizes full --out $OUT/results > $OUT/logs/bench.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench.log
timeout $(( 578 - ($(date +%s) - t0) )) python3 scripts/bench.py lora --sizes full --budget-s $(( 565 - ($(date +%s) - t0) )) \
  --out $OUT/results --variants "=custom_vjp cudnn mosaic,=custom_vjp cudnn,=jax.grad(reference) cudnn,torch" \
  > $OUT/logs/bench_block.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_block.log
grep -E "rc=|passed|failed" $OUT/logs/gpu_tests.log; grep -E "lora_proj|rc=" $OUT/logs/bench.log; grep -E "^#   |rc=" $OUT/logs/bench_block.log
