#!/usr/bin/env bash
# Device pass 2 of session 7 (the lead runs it with the device tool; $OUT comes back). Everything in parallel, under
# the verifier of session 7 (replicas summed in random orders, shared-rounding allowance):
#   detection limits on the GPU at 262,144 and 10^6 entries; the CPU detection table at 64..16384 entries (20 trials)
#   on the machine's CPU cores; the 100-run GPU false-alarm sweep; `jaxgrad audit`; the LoRA block verification
#   (f32 / bf16 with our attention, bf16 through cuDNN at seq 78). PAR_S: the time limit of each.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --find-links .whl mrcfile bitsandbytes 2>&1 | tail -1
header() {
  echo "# device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(python3 -c 'import jax,sys; print("jax", jax.__version__, "python", sys.version.split()[0])')"
  echo "# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command: $*"
}
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s); P=${PAR_S:-500}
run() {  # name, env, command...
  local name=$1 envs=$2; shift 2
  ( header "$envs $*" > $OUT/logs/$name.log; env $envs timeout $P "$@" >> $OUT/logs/$name.log 2>&1; echo "$name rc=$?" >> $OUT/logs/$name.log ) &
}
run det_gpu JAX_PLATFORMS=cuda python3 scripts/verify_detection_limits.py --sizes 262144 1000000 --trials 20 --jobs 3 --out $OUT/results
run det_cpu JAX_PLATFORMS=cpu nice -n 5 python3 scripts/verify_detection_limits.py --sizes 64 1024 16384 --trials 20 --jobs 6 --out $OUT/results
run fa_gpu JAX_PLATFORMS=cuda python3 scripts/verify_false_alarms.py --mode gpu --n 100 --jobs 3 --out $OUT/results
run audit X=1 python3 -m jaxgrad.cli audit --json $OUT/logs/audit.json
run lora_verify X=1 python3 scripts/lora_gpu_check.py --parts verify --budget-s $(( P - 20 )) --reserve-perplexity-s 0 --out $OUT/logs
wait
echo "all done after $(( $(date +%s) - t0 )) s"
for f in det_gpu det_cpu fa_gpu audit; do echo "== $f"; tail -4 $OUT/logs/$f.log | cut -c1-250; done
grep -E "entries: scale" $OUT/logs/det_gpu.log | cut -c1-250
grep -E "==>" $OUT/logs/lora_verify.log | cut -c1-300
