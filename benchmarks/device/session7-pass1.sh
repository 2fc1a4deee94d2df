#!/usr/bin/env bash
# Device pass 1 of session 7 (run by the lead with the device tool, from the repository root; $OUT comes back).
# Phase 1 alone (timing): the whole LoRA block benchmark row (every variant, PEFT included, one run).
# Phase 2 together: the GPU-marked tests of the new kernels, the LoRA block verification on the GPU (bf16/f32), and
# the verifier's 500-run CPU false-alarm sweep on the machine's CPU cores.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --find-links .whl mrcfile bitsandbytes 2>&1 | tail -1
header() {  # device, versions, commit, command line
  echo "# device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(python3 -c 'import jax,sys; print("jax", jax.__version__, "python", sys.version.split()[0])')"
  echo "# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command: $*"
}
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
( c="JAX_PLATFORMS=cpu python3 scripts/verify_false_alarms.py --mode cpu --n 500 --jobs ${FA_JOBS:-6} --out $OUT/results"; header "$c" > $OUT/logs/fa_cpu.log
  JAX_PLATFORMS=cpu timeout $(( ${BENCH_S:-200} + ${PAR_S:-300} + 20 )) nice -n 10 python3 scripts/verify_false_alarms.py --mode cpu --n 500 --jobs ${FA_JOBS:-6} --out $OUT/results >> $OUT/logs/fa_cpu.log 2>&1; echo "fa rc=$?" >> $OUT/logs/fa_cpu.log ) &
timeout $(( ${BENCH_S:-200} + 30 )) python3 scripts/bench.py lora --sizes full --warmup 5 --repeats 30 --budget-s ${BENCH_S:-200} --out $OUT/results > $OUT/logs/bench_lora.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s"
grep -E "^#   |^lora |^# (FLOPs|floor)|rror" $OUT/logs/bench_lora.log | cut -c1-300
( c="python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_op_variants.py tests/test_rmsnorm_kernel.py tests/test_nf4_matmul.py"; header "$c" > $OUT/logs/gpu_tests_kernels.log; timeout ${PAR_S:-300} $c >> $OUT/logs/gpu_tests_kernels.log 2>&1; echo "tests rc=$?" >> $OUT/logs/gpu_tests_kernels.log ) &
( timeout $(( ${PAR_S:-300} )) python3 scripts/lora_gpu_check.py --parts verify --budget-s $(( ${PAR_S:-300} - 20 )) --reserve-perplexity-s 0 --out $OUT/logs > $OUT/logs/lora_gpu_check_verify.log 2>&1; echo "check rc=$?" >> $OUT/logs/lora_gpu_check_verify.log ) &
wait
echo "all done after $(( $(date +%s) - t0 )) s"
tail -3 $OUT/logs/gpu_tests_kernels.log
grep -E "==>|PASS|FAIL|UNDETERMINED|verdict|done in|Error" $OUT/logs/lora_gpu_check_verify.log | cut -c1-300 | head -30
tail -4 $OUT/logs/fa_cpu.log; grep -cE "FALSE" $OUT/logs/fa_cpu.log
