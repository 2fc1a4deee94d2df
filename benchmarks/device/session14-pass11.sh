#!/usr/bin/env bash
# Session 14, pass 11 (#13, for the next session): a profile of the default mosaic block on an H100 with its artifacts
# kept (trace and optimised HLO text, gzip), so that the ~100 launches' small ops (layout copies, K-split reductions
# of the skinny GEMMs) can be read offline. One archive comes back.
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session14-pass11.sh`
set -u; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results $OUT/logs; t0=$(date +%s)
H="# device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(python3 -c 'import jax,sys; print("jax", jax.__version__, "python", sys.version.split()[0])')"
C="# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command:"
( echo "$H"; echo "$C lora_profile.py --sizes full --variants 'custom_vjp cudnn mosaic' --artifacts \$OUT/results/artifacts"
  timeout 240 python3 scripts/lora_profile.py --sizes full --variants "custom_vjp cudnn mosaic" --out $OUT/results \
    --artifacts $OUT/results/artifacts 2>&1; echo "profile rc=$? after $(( $(date +%s) - t0 )) s" ) > $OUT/logs/profile.log 2>&1
grep -E "^coarse|^GPU busy|^step wall|rc=" $OUT/logs/profile.log
tar czf $OUT/pass11.tgz -C $OUT results logs && rm -rf $OUT/results $OUT/logs
