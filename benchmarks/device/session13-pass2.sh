#!/usr/bin/env bash
# Prepared in session 12 ($OUT comes back; at most 8 files). #13: the block's rows at seq 8192 (bench.py lora --sizes
# long: batch 1 x 8192 tokens, the full widths) -- mosaic, the default custom VJP, jax.grad + cuDNN, PEFT -- each in
# a fresh process, then the same four at the full size in the same run (the two sizes side by side on one machine).
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session13-pass2.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
V="=custom_vjp cudnn mosaic,=custom_vjp cudnn,=jax.grad(reference) cudnn,torch"
timeout 290 python3 scripts/bench.py lora --sizes long --budget-s 280 --out $OUT/results --variants "$V" \
  > $OUT/logs/bench_long.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_long.log
timeout $(( 578 - ($(date +%s) - t0) )) python3 scripts/bench.py lora --sizes full --budget-s $(( 565 - ($(date +%s) - t0) )) \
  --out $OUT/results --variants "$V" > $OUT/logs/bench_full.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_full.log
grep -E "^#   |rc=" $OUT/logs/bench_long.log $OUT/logs/bench_full.log
