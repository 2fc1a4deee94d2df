#!/usr/bin/env bash
# Session 14, pass 4 (#13): the block with cuDNN's MHA kernels (K, V repeated to the q heads; BlockKernels.
# cudnn_repeat_kv, now the default) beside cuDNN's GQA ones (mosaic-gqa), jax.grad + cuDNN and PEFT; the GPU test that
# the step still holds one cuDNN forward; one projection's kernels with JAX's own Hopper matmul example beside ours
# (what the rank-r work costs our kernel: diagnosis for the next kernel). One archive comes back.
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session14-pass4.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
H="# device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(python3 -c 'import jax,sys; print("jax", jax.__version__, "python", sys.version.split()[0])')"
C="# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command:"
( echo "$H"; echo "$C pytest -m gpu tests/test_lora_block_mosaic.py -k one_cudnn_forward"
  timeout 90 python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_lora_block_mosaic.py -k one_cudnn_forward 2>&1 | tail -20
  echo "cudnn tests rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" ) > $OUT/logs/gpu_tests.log 2>&1
timeout 130 python3 scripts/bench.py lora --sizes full --budget-s 120 --out $OUT/results \
  --variants "=custom_vjp cudnn mosaic,=custom_vjp cudnn mosaic-gqa,=jax.grad(reference) cudnn,torch" \
  > $OUT/logs/bench_block.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_block.log
timeout 240 python3 scripts/bench.py lora_proj --sizes full --out $OUT/results > $OUT/logs/bench_proj.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_proj.log
grep -E "passed|failed|rc=" $OUT/logs/gpu_tests.log | tail -3; grep -E "^#   |rc=" $OUT/logs/bench_block.log
grep -E "^lora_proj_dx|rc=" $OUT/logs/bench_proj.log | cut -c1-150
tar czf $OUT/pass4.tgz -C $OUT results logs && rm -rf $OUT/results $OUT/logs
