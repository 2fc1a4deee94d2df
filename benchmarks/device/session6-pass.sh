#!/usr/bin/env bash
# One device pass of session 6 (run by the lead with the device tool, from the repository root; $OUT comes back).
# Phase 1 alone (timing): the LoRA block benchmark. Phase 2 together: the GPU false-alarm sweep of the verifier,
# `jaxgrad audit`, the GPU-marked tests, and the LoRA GPU check (PEFT load, block verification, perplexity).
# BENCH_S / PAR_S: the phases' time limits in seconds.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --find-links .whl mrcfile bitsandbytes 2>&1 | tail -1
header() {  # device, versions, commit, command line
  echo "# device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(python3 -c 'import jax,sys; print("jax", jax.__version__, "python", sys.version.split()[0])')"
  echo "# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command: $*"
}
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
timeout $(( ${BENCH_S:-170} + 30 )) python3 scripts/bench.py lora --sizes full --warmup 5 --repeats 30 --budget-s ${BENCH_S:-170} --out $OUT/results > $OUT/logs/bench_lora.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s"
grep -E "^#   |^lora |^# (FLOPs|floor)" $OUT/logs/bench_lora.log | cut -c1-300
( timeout ${PAR_S:-330} python3 scripts/verify_false_alarms.py --mode gpu --n 100 --jobs 4 --out $OUT/results > $OUT/logs/fa_gpu.log 2>&1; echo "fa rc=$?" >> $OUT/logs/fa_gpu.log ) &
( c="python3 -m jaxgrad.cli audit --json $OUT/logs/audit.json"; header "$c" > $OUT/logs/audit.log; timeout ${PAR_S:-330} $c >> $OUT/logs/audit.log 2>&1; echo "audit rc=$?" >> $OUT/logs/audit.log ) &
( c="python3 -m pytest -m gpu -q -n 3 -p no:cacheprovider --continue-on-collection-errors"; header "$c" > $OUT/logs/gpu_tests.log; timeout ${PAR_S:-330} $c >> $OUT/logs/gpu_tests.log 2>&1; echo "tests rc=$?" >> $OUT/logs/gpu_tests.log ) &
( timeout $(( ${PAR_S:-330} + 10 )) python3 scripts/lora_gpu_check.py --budget-s $(( ${PAR_S:-330} - 30 )) --out $OUT/logs > $OUT/logs/lora_gpu_check.log 2>&1; echo "check rc=$?" >> $OUT/logs/lora_gpu_check.log ) &
wait
echo "all done after $(( $(date +%s) - t0 )) s"
tail -2 $OUT/logs/fa_gpu.log; grep -E "FALSE|undetermined" $OUT/logs/fa_gpu.log | head -20
tail -4 $OUT/logs/audit.log; tail -4 $OUT/logs/gpu_tests.log
grep -E "==>|PASSED|FAILED|skipped|logits|held-out|done in|Error" $OUT/logs/lora_gpu_check.log | cut -c1-300 | head -30
