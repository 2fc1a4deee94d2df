#!/usr/bin/env bash
# Session 14, pass 7 (#13): the mosaic block's GPU verifications with the final kernels -- the default, odd sizes
# (seq 77, hidden 96, 3 / 1 heads, r 4: every operand padded to the tiles), NF4 base weights -- and the one-cuDNN-
# forward check. One archive comes back.
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session14-pass7.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/logs
t0=$(date +%s)
H="# device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(python3 -c 'import jax,sys; print("jax", jax.__version__, "python", sys.version.split()[0])')"
C="# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command:"
( echo "$H"; echo "$C pytest -m gpu -n 2 tests/test_lora_block_mosaic.py -k 'default or odd or nf4 or one_cudnn'"
  timeout 560 python3 -m pytest -m gpu -q -rA -n 2 -p no:cacheprovider tests/test_lora_block_mosaic.py -k "default or odd or nf4 or one_cudnn" 2>&1 | tail -40
  echo "block tests rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" ) > $OUT/logs/gpu_block_tests.log 2>&1
grep -E "PASSED|FAILED|passed|failed|rc=" $OUT/logs/gpu_block_tests.log | tail -12
tar czf $OUT/pass7.tgz -C $OUT logs && rm -rf $OUT/logs
