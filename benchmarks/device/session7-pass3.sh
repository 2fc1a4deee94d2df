#!/usr/bin/env bash
# Device pass 3 of session 7 ($OUT comes back). Phase 1 alone (timing): the custom-VJP block with and without the
# Pallas kernels (bf16 and NF4 bases) in one run. Phase 2 together (PAR_S each): the pallas block's GPU-marked tests
# (compiled kernels judged by the verifier), the GPU false-alarm sweep (seed 7: new runs, not pass 2's), the audit.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
header() {
  echo "# device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(python3 -c 'import jax,sys; print("jax", jax.__version__, "python", sys.version.split()[0])')"
  echo "# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command: $*"
}
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s); P=${PAR_S:-400}
timeout $(( ${BENCH_S:-110} + 30 )) python3 scripts/bench.py lora --sizes full --variants "custom_vjp cudnn" --warmup 5 --repeats 30 --budget-s ${BENCH_S:-110} --out $OUT/results > $OUT/logs/bench_lora_pallas.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s"; grep -E "^#   |rror" $OUT/logs/bench_lora_pallas.log | cut -c1-250
run() {
  local name=$1; shift
  ( header "$*" > $OUT/logs/$name.log; timeout $P "$@" >> $OUT/logs/$name.log 2>&1; echo "$name rc=$?" >> $OUT/logs/$name.log ) &
}
run gpu_tests_block python3 -m pytest -m gpu -q -p no:cacheprovider -rA tests/test_lora_block_pallas.py
run fa_gpu python3 scripts/verify_false_alarms.py --mode gpu --n 100 --seed 7 --jobs 3 --out $OUT/results
run audit python3 -m jaxgrad.cli audit --json $OUT/logs/audit.json
wait
echo "all done after $(( $(date +%s) - t0 )) s"
tail -6 $OUT/logs/gpu_tests_block.log | cut -c1-250
grep -E "\-> " $OUT/logs/fa_gpu.log | sed -E 's/.*-> ([a-zA-Z]+).*/\1/' | sort | uniq -c; grep -E "FALSE" $OUT/logs/fa_gpu.log | head -5; tail -3 $OUT/logs/fa_gpu.log | cut -c1-200
grep -E "check_vjp:|VERDICT|FAIL" $OUT/logs/audit.log | cut -c1-200 | head -30; tail -2 $OUT/logs/audit.log
