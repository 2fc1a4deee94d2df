#!/usr/bin/env bash
# Session 11, pass 3 ($OUT comes back; at most 8 files). #10: the H100 false-alarm sweep to 100 runs with the final
# scale test of this session (gated kink jumps; rho past the flips, 83cc957). #13: where the block's peak memory goes
# (compile only; benchmarks/device/session11_mem.py). Run alone:
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session11-pass3.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
timeout 430 python3 scripts/verify_false_alarms.py --mode gpu --n 100 --seed 15 --jobs 4 --out $OUT/results \
  > $OUT/logs/fa_gpu.log 2>&1
echo "false alarms rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/fa_gpu.log
timeout 140 python3 benchmarks/device/session11_mem.py /tmp/xla_mem > $OUT/logs/mem.log 2>&1
echo "mem rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/mem.log
tail -16 $OUT/logs/fa_gpu.log; grep -v "^  " $OUT/logs/mem.log | head -40
