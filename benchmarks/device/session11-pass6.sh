#!/usr/bin/env bash
# Session 11, pass 6 ($OUT comes back; at most 8 files). #13: the block after this session's changes (one cuDNN
# forward in the backward; x2 saved and the halves recomputed one at a time), PEFT and jax.grad in the same run,
# each variant in a fresh process; then where the time goes now (scripts/lora_profile.py).
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session11-pass6.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
timeout 300 python3 scripts/bench.py lora --sizes full --budget-s 280 --out $OUT/results \
  --variants "custom_vjp cudnn,jax.grad(reference) cudnn,torch,custom_vjp cudnn nf4,custom_vjp+grouped cudnn" \
  > $OUT/logs/bench.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench.log
timeout $(( 570 - ($(date +%s) - t0) )) python3 scripts/lora_profile.py --sizes full --variants "custom_vjp cudnn" \
  --out $OUT/results > $OUT/logs/profile.log 2>&1
echo "profile rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/profile.log
grep -E "^#   |rc=" $OUT/logs/bench.log; tail -45 $OUT/logs/profile.log
