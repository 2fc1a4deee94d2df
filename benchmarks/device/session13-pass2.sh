#!/usr/bin/env bash
# Session 13, pass 2 ($OUT comes back; at most 8 files). #10 with the degenerate-norm fix (06df1cc): run 31 of pass
# 1's sweep replayed, a fresh H100 false-alarm sweep (seed 19), `jaxgrad audit` of swiglu / kan_linear / conv2d, and
# the GPU-marked tests of the verifier and of the Mosaic GPU kernels (#13: the rank-r side outputs, the block's bf16
# verification, its 14 launches) -- all correctness checks, run side by side (no timing in this call).
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session13-pass2.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --find-links .whl mrcfile 2>&1 | tail -1
header() {
  echo "# device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(python3 -c 'import jax,sys; print("jax", jax.__version__, "python", sys.version.split()[0])')"
  echo "# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command: $*"
}
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
( c="python3 scripts/verify_false_alarms.py --mode gpu --seed 18 --indices 31 --no-write"; header "$c"
  timeout 120 $c; echo "replay rc=$? after $(( $(date +%s) - t0 )) s" ) > $OUT/logs/replay31.log 2>&1
timeout 440 python3 scripts/verify_false_alarms.py --mode gpu --n 170 --seed 19 --jobs 6 --budget-s 400 --out $OUT/results \
  > $OUT/logs/fa_gpu.log 2>&1 &
for op in swiglu kan_linear conv2d; do
  ( c="python3 -m jaxgrad.cli audit --op $op"; header "$c" > $OUT/logs/audit_$op.log
    timeout 420 $c >> $OUT/logs/audit_$op.log 2>&1; echo "audit rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/audit_$op.log ) &
done
( c="pytest -m gpu tests/test_verify_*.py tests/test_lora_linear_mgpu.py tests/test_lora_block_mosaic.py"; header "$c"
  timeout $(( 560 - ($(date +%s) - t0) )) python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_verify_*.py \
    tests/test_lora_linear_mgpu.py tests/test_lora_block_mosaic.py 2>&1 | tail -60
  echo "tests rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" ) > $OUT/logs/gpu_tests.log 2>&1 &
wait
echo "false alarms after $(( $(date +%s) - t0 )) s" >> $OUT/logs/fa_gpu.log
tail -3 $OUT/logs/replay31.log; tail -4 $OUT/logs/fa_gpu.log
for op in swiglu kan_linear conv2d; do grep -E "^audit:|VERDICT|\[FAIL|rc=" $OUT/logs/audit_$op.log | cut -c1-200; done
grep -E "passed|failed|rc=|^FAILED|^ERROR" $OUT/logs/gpu_tests.log | tail -12
