#!/usr/bin/env bash
# Session 13, pass 5 (run as one inline command of the device tool; recorded here as it ran, at e1d1f89): #10 item 5's
# last piece -- `jaxgrad audit` of conv2d[pallas] under the size-trend fix -- and #13's rank side-output GPU test at
# shapes both kernels take, side by side.
set -u; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --find-links .whl mrcfile 2>&1 | tail -1; mkdir -p $OUT/logs; t0=$(date +%s)
H="# device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(python3 -c 'import jax,sys; print("jax", jax.__version__, "python", sys.version.split()[0])')"
C="# commit e1d1f89 (uncommitted changes: false); command:"
( echo "$H"; echo "$C python3 -m jaxgrad.cli audit --op 'conv2d[pallas'"
  timeout 185 python3 -m jaxgrad.cli audit --op 'conv2d[pallas' 2>&1; echo "audit rc=$? after $(( $(date +%s) - t0 )) s" ) > $OUT/logs/audit_conv2d_pallas.log &
( echo "$H"; echo "$C pytest -m gpu tests/test_lora_linear_mgpu.py::test_gpu_rank_side_outputs_are_the_rounded_rank_products"
  timeout 120 python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_lora_linear_mgpu.py::test_gpu_rank_side_outputs_are_the_rounded_rank_products 2>&1 | tail -40
  echo "rank tests rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" ) > $OUT/logs/rank_tests.log 2>&1 &
wait
