#!/usr/bin/env bash
# Session 14, pass 8 (#13), on an H100: the block's final numbers once more (mosaic, jax.grad + cuDNN, PEFT), and the
# same JAX variants with XLA's command buffers (CUDA graphs) also taking custom calls and cuDNN -- the profile showed
# 0.36-0.49 ms per step of GPU idle between the ~100 launches; whether graphs that hold the Mosaic GPU and cuDNN calls
# remove it, measured on both JAX sides alike. One archive comes back.
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session14-pass8.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results/default $OUT/results/graphs $OUT/logs
t0=$(date +%s)
timeout 120 python3 scripts/bench.py lora --sizes full --budget-s 110 --out $OUT/results/default \
  --variants "=custom_vjp cudnn mosaic,=jax.grad(reference) cudnn,torch,=custom_vjp cudnn nf4 mosaic" \
  > $OUT/logs/bench_block.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_block.log
export XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
( echo "# XLA_FLAGS=$XLA_FLAGS"
  timeout 100 python3 scripts/bench.py lora --sizes full --budget-s 90 --out $OUT/results/graphs \
  --variants "=custom_vjp cudnn mosaic,=jax.grad(reference) cudnn" 2>&1
  echo "bench rc=$? after $(( $(date +%s) - t0 )) s" ) > $OUT/logs/bench_block_graphs.log 2>&1
grep -E "^#   |rc=|XLA_FLAGS" $OUT/logs/bench_block.log $OUT/logs/bench_block_graphs.log
tar czf $OUT/pass8.tgz -C $OUT results logs && rm -rf $OUT/results $OUT/logs
