#!/usr/bin/env bash
# Device pass 1 of session 8 ($OUT comes back). Phase 1 alone (timing): the custom-VJP block with cuDNN attention,
# XLA norms vs the re-tiled Pallas RMSNorm (bf16 and NF4 bases), one run, a longer budget so the NF4 Pallas variant
# is not cut by the suite's budget. Phase 2 alone: the pallas block's GPU-marked tests, each with its duration.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
header() {
  echo "# device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(python3 -c 'import jax,sys; print("jax", jax.__version__, "python", sys.version.split()[0])')"
  echo "# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command: $*"
}
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
timeout $(( ${BENCH_S:-240} + 30 )) python3 scripts/bench.py lora --sizes full --variants "custom_vjp cudnn" --warmup 5 --repeats 30 --budget-s ${BENCH_S:-240} --out $OUT/results > $OUT/logs/bench_lora_pallas.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s"; grep -E "^#   |rror|imed out" $OUT/logs/bench_lora_pallas.log | cut -c1-250
( header "pytest -m gpu tests/test_lora_block_pallas.py" > $OUT/logs/gpu_tests_block.log
  timeout ${TEST_S:-230} python3 -m pytest -m gpu -v -p no:cacheprovider -rA --durations=0 tests/test_lora_block_pallas.py >> $OUT/logs/gpu_tests_block.log 2>&1
  echo "rc=$?" >> $OUT/logs/gpu_tests_block.log )
echo "all done after $(( $(date +%s) - t0 )) s"
tail -25 $OUT/logs/gpu_tests_block.log | cut -c1-250
