#!/usr/bin/env bash
# Device pass 3 of session 10 ($OUT comes back). After the weighted (GLS) scale test (dc346fc):
#  - the detection table on the machine's CPU (dense, conv+ReLU, attention at 64 / 1024 / 16384 entries, f32 / TF32 /
#    f16 / bf16 emulated, 20 trials), which README's table is made from;
#  - the GPU false-alarm sweep (100 runs, the GPU's own TF32 / bf16 rounding, judged at the platform's default);
#  - the pallas block's bf16-nf4 verification on the GPU (pass 2's invocation was mis-quoted);
#  - one attention detection trial timed at 262,144 and 10^6 entries on the GPU (do those cells fit a call?);
#  - hardware spot checks: detection with the H100's own TF32 / bf16 rounding in the kernel under test.
# The 500-run CPU false-alarm sweep of this code runs on the development machine (its log is committed beside).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
header() {
  echo "# device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(python3 -c 'import jax,sys; print("jax", jax.__version__, "python", sys.version.split()[0])')"
  echo "# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command: $*"
}
mkdir -p $OUT/results $OUT/logs $OUT/det $OUT/hw
t0=$(date +%s); T=${PASS_S:-520}
( header "JAX_PLATFORMS=cpu python3 scripts/verify_detection_limits.py --trials 20 --sizes 64 1024 16384 --jobs 10 --out \$OUT/det" > $OUT/logs/det_cpu.log
  JAX_PLATFORMS=cpu timeout $T python3 scripts/verify_detection_limits.py --trials 20 --sizes 64 1024 16384 --jobs 10 --out $OUT/det >> $OUT/logs/det_cpu.log 2>&1
  echo "det rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/det_cpu.log ) &
( header "python3 scripts/verify_false_alarms.py --mode gpu --n 100 --seed 13 --jobs 3 --out \$OUT/results" > $OUT/logs/fa_gpu.log
  timeout $T python3 scripts/verify_false_alarms.py --mode gpu --n 100 --seed 13 --jobs 3 --out $OUT/results >> $OUT/logs/fa_gpu.log 2>&1
  echo "fa_gpu rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/fa_gpu.log ) &
( header "python3 scripts/verify_detection_limits.py --hardware --precisions tf32 bf16 --sizes 1024 16384 --jobs 2 --out \$OUT/hw" > $OUT/logs/det_hw.log
  timeout $T python3 scripts/verify_detection_limits.py --hardware --precisions tf32 bf16 --sizes 1024 16384 --jobs 2 --out $OUT/hw >> $OUT/logs/det_hw.log 2>&1
  echo "det rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/det_hw.log ) &
( header "python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_lora_block_pallas.py -k nf4" > $OUT/logs/gpu_nf4.log
  timeout $T python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_lora_block_pallas.py -k nf4 >> $OUT/logs/gpu_nf4.log 2>&1
  echo "tests rc=$?" >> $OUT/logs/gpu_nf4.log
  for n in 262144 1000000; do JAX_PLATFORMS=cuda timeout 150 python3 scripts/verify_detection_timing.py --op attention --size $n --trials 3; done > $OUT/logs/det_timing.log 2>&1 ) &
wait
echo "all done after $(( $(date +%s) - t0 )) s"
tail -3 $OUT/logs/gpu_nf4.log; cat $OUT/logs/det_timing.log | grep -v Warn | cut -c1-200; grep -E "false alarms in|rc=" $OUT/logs/fa_gpu.log; grep -E "FALSE|undetermined" $OUT/logs/fa_gpu.log | head -5 | cut -c1-200
grep -E "entries:|rc=|false alarms:" $OUT/logs/det_cpu.log $OUT/logs/det_hw.log | cut -c1-170
