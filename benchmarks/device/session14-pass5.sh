#!/usr/bin/env bash
# Session 14, pass 5 (#13): the Mosaic GPU kernels with the rank-r product from XLA (TileConfig.rank_from_xla: a
# plain-GEMM K loop, one wgmma per step) -- their GPU tests, the block beside the default kernels (mosaic, GQA cuDNN
# again), jax.grad + cuDNN and PEFT, a profile of both, and the rank-from-xla block's verification.
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session14-pass5.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
H="# device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(python3 -c 'import jax,sys; print("jax", jax.__version__, "python", sys.version.split()[0])')"
C="# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command:"
( echo "$H"; echo "$C pytest -m gpu tests/test_lora_linear_mgpu.py -k 'rank-from-xla or rank_side'"
  timeout 100 python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_lora_linear_mgpu.py -k "rank-from-xla or rank_side" 2>&1 | tail -25
  echo "kernel tests rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" ) > $OUT/logs/gpu_tests.log 2>&1
timeout 110 python3 scripts/bench.py lora --sizes full --budget-s 100 --out $OUT/results \
  --variants "=custom_vjp cudnn mosaic,=custom_vjp cudnn mosaic-rank-xla,=jax.grad(reference) cudnn,torch" \
  > $OUT/logs/bench_block.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_block.log
( echo "$H"; echo "$C lora_profile.py --sizes full --variants 'custom_vjp cudnn mosaic,custom_vjp cudnn mosaic-rank-xla'"
  timeout 200 python3 scripts/lora_profile.py --sizes full --variants "custom_vjp cudnn mosaic,custom_vjp cudnn mosaic-rank-xla" \
    --out $OUT/results 2>&1; echo "profile rc=$? after $(( $(date +%s) - t0 )) s" ) > $OUT/logs/profile.log 2>&1
L=560
( echo "$H"; echo "$C pytest -m gpu tests/test_lora_block_mosaic.py -k rank-from-xla"
  timeout $(( L - ($(date +%s) - t0) )) python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_lora_block_mosaic.py -k rank-from-xla 2>&1 | tail -20
  echo "verify rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" ) >> $OUT/logs/gpu_tests.log 2>&1
grep -E "passed|failed|rc=" $OUT/logs/gpu_tests.log | tail -5; grep -E "^#   |rc=" $OUT/logs/bench_block.log
grep -E "^==|^coarse|^GPU busy|^step wall|Mosaic GPU gemm|triton gemm lora|rc=" $OUT/logs/profile.log
tar czf $OUT/pass5.tgz -C $OUT results logs && rm -rf $OUT/results $OUT/logs
