#!/usr/bin/env bash
# Device pass 3 of session 8 ($OUT comes back). Pass 2's CPU sweep was cut at 480 of 500 runs: the whole 500-run CPU
# false-alarm sweep again with more workers, next to the LoRA block's verification on the GPU (f32 / bf16, XLA and
# cuDNN attention, the latter at seq 78), whose bf16 verdict can fail since the radius change.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
header() {
  echo "# device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(python3 -c 'import jax,sys; print("jax", jax.__version__, "python", sys.version.split()[0])')"
  echo "# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command: $*"
}
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s); T=${SWEEP_S:-500}
( c="JAX_PLATFORMS=cpu python3 scripts/verify_false_alarms.py --mode cpu --n 500 --jobs ${FA_JOBS:-13} --out $OUT/results"; header "$c" > $OUT/logs/fa_cpu.log
  JAX_PLATFORMS=cpu timeout $T nice -n 5 python3 scripts/verify_false_alarms.py --mode cpu --n 500 --jobs ${FA_JOBS:-13} --out $OUT/results >> $OUT/logs/fa_cpu.log 2>&1; echo "fa_cpu rc=$?" >> $OUT/logs/fa_cpu.log ) &
( timeout $T python3 scripts/lora_gpu_check.py --parts verify --budget-s $(( T - 20 )) --reserve-perplexity-s 0 --out $OUT/logs > $OUT/logs/lora_gpu_check_verify.log 2>&1; echo "check rc=$?" >> $OUT/logs/lora_gpu_check_verify.log ) &
wait
echo "all done after $(( $(date +%s) - t0 )) s"
grep -E "==>|PASS|FAIL|UNDETERMINED|verdict|done in|rror|rc=" $OUT/logs/lora_gpu_check_verify.log | cut -c1-300 | head -30
grep -E "\-> " $OUT/logs/fa_cpu.log | sed -E 's/.*-> ([a-zA-Z]+).*/\1/' | sort | uniq -c; grep -E "FALSE" $OUT/logs/fa_cpu.log | head -5 | cut -c1-250; tail -3 $OUT/logs/fa_cpu.log | cut -c1-250
