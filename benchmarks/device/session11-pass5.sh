#!/usr/bin/env bash
# Session 11, pass 5 ($OUT comes back; at most 8 files). #10: the CPU false-alarm sweep (500 runs) with the final
# statistics of this session, on the device machine's 16-core CPU (JAX_PLATFORMS=cpu; the GPU is not used).
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session11-pass5.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
timeout 570 python3 scripts/verify_false_alarms.py --mode cpu --n 500 --jobs 15 --out $OUT/results \
  > $OUT/logs/fa_cpu.log 2>&1
echo "false alarms rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/fa_cpu.log
tail -20 $OUT/logs/fa_cpu.log
