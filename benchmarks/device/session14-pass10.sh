#!/usr/bin/env bash
# Session 14, pass 10 (#13): the compiled (Triton) pallas block's GPU verifications now that backend="pallas" also
# runs SwiGLU's kernels -- f32, bf16, bf16 with NF4 base weights -- three workers side by side.
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session14-pass10.sh`
set -u; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/logs; t0=$(date +%s)
H="# device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(python3 -c 'import jax,sys; print("jax", jax.__version__, "python", sys.version.split()[0])')"
C="# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command:"
( echo "$H"; echo "$C pytest -m gpu -n 3 tests/test_lora_block_pallas.py"
  timeout 540 python3 -m pytest -m gpu -q -rA -n 3 -p no:cacheprovider tests/test_lora_block_pallas.py 2>&1 | tail -30
  echo "pallas block tests rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" ) > $OUT/logs/gpu_pallas_block_tests.log 2>&1
grep -E "PASSED|FAILED|passed|failed|rc=" $OUT/logs/gpu_pallas_block_tests.log | tail -8
