#!/usr/bin/env bash
# Session 14, pass 2 (#13): the cuDNN forward merged with the backward's (return_residual: one training-mode call per
# step, GPU test on the xla and mosaic backends), then timings in one run -- the mosaic block with it, the same with
# bf16 dX kernels (mosaic-bf16-dx), jax.grad + cuDNN and PEFT; a profile of the mosaic block (where its time goes
# now); the seq-8192 rows (bench.py lora --sizes long); last, the bf16-dX block's verification on the GPU.
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session14-pass2.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
C="# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command:"
( echo "$C pytest -m gpu tests/test_lora_block_mosaic.py -k one_cudnn_forward"
  timeout 90 python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_lora_block_mosaic.py -k one_cudnn_forward 2>&1 | tail -30
  echo "cudnn tests rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" ) > $OUT/logs/gpu_tests.log 2>&1
timeout 200 python3 scripts/bench.py lora --sizes full --budget-s 190 --out $OUT/results \
  --variants "=custom_vjp cudnn mosaic,=custom_vjp cudnn mosaic-bf16-dx,=jax.grad(reference) cudnn,torch" \
  > $OUT/logs/bench_block.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_block.log
timeout 130 python3 scripts/lora_profile.py --sizes full --variants "custom_vjp cudnn mosaic" --out $OUT/results \
  > $OUT/logs/profile.log 2>&1
echo "profile rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/profile.log
timeout 150 python3 scripts/bench.py lora --sizes long --budget-s 140 --out $OUT/results \
  --variants "=custom_vjp cudnn mosaic,=jax.grad(reference) cudnn,torch" > $OUT/logs/bench_long.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_long.log
L=575
( echo "$C pytest -m gpu tests/test_lora_block_mosaic.py -k dx-bf16"
  timeout $(( L - ($(date +%s) - t0) )) python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_lora_block_mosaic.py -k dx-bf16 2>&1 | tail -30
  echo "verify rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" ) >> $OUT/logs/gpu_tests.log 2>&1
grep -E "passed|failed|rc=" $OUT/logs/gpu_tests.log | tail -4; grep -E "^#   |rc=" $OUT/logs/bench_block.log $OUT/logs/bench_long.log
grep -E "^coarse|^GPU busy|^step wall|^by pass|rc=" $OUT/logs/profile.log
