#!/usr/bin/env bash
# Device pass 2 of session 8 ($OUT comes back): the false-alarm sweeps re-run after the comparison radius changed
# from r(N) x sum|terms| to the first-order error bound E (ReLU flips depend on it). Two jobs only: the 500-run CPU
# sweep on the machine's CPU cores (JAX_PLATFORMS=cpu) and the 100-run GPU sweep (new seed 11).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
header() {
  echo "# device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(python3 -c 'import jax,sys; print("jax", jax.__version__, "python", sys.version.split()[0])')"
  echo "# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command: $*"
}
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s); T=${SWEEP_S:-530}
( c="JAX_PLATFORMS=cpu python3 scripts/verify_false_alarms.py --mode cpu --n 500 --jobs ${FA_JOBS:-9} --out $OUT/results"; header "$c" > $OUT/logs/fa_cpu.log
  JAX_PLATFORMS=cpu timeout $T nice -n 5 python3 scripts/verify_false_alarms.py --mode cpu --n 500 --jobs ${FA_JOBS:-9} --out $OUT/results >> $OUT/logs/fa_cpu.log 2>&1; echo "fa_cpu rc=$?" >> $OUT/logs/fa_cpu.log ) &
( c="python3 scripts/verify_false_alarms.py --mode gpu --n 100 --seed 11 --jobs 4 --out $OUT/results"; header "$c" > $OUT/logs/fa_gpu.log
  timeout $T python3 scripts/verify_false_alarms.py --mode gpu --n 100 --seed 11 --jobs 4 --out $OUT/results >> $OUT/logs/fa_gpu.log 2>&1; echo "fa_gpu rc=$?" >> $OUT/logs/fa_gpu.log ) &
wait
echo "all done after $(( $(date +%s) - t0 )) s"
for f in fa_cpu fa_gpu; do echo "== $f"; grep -E "\-> " $OUT/logs/$f.log | sed -E 's/.*-> ([a-zA-Z]+).*/\1/' | sort | uniq -c; grep -E "FALSE|fail" $OUT/logs/$f.log | head -5 | cut -c1-250; tail -3 $OUT/logs/$f.log | cut -c1-250; done
