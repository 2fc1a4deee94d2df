#!/usr/bin/env bash
# Session 14, pass 9: the two `jaxgrad audit` runs session 13 could not repeat on the H100 under the final verifier
# (kan_linear and conv2d[xla] predated the size-trend fix of e1d1f89), side by side. Carry .whl (mrcfile). As run at
# 8d9b48c the last line read `tail -4` (GNU tail refuses it with two files: the call returned rc 1 after both audits
# had passed); fixed to `tail -n 4`.
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session14-pass9.sh`
set -u; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --find-links .whl mrcfile 2>&1 | tail -1; mkdir -p $OUT/logs; t0=$(date +%s)
H="# device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(python3 -c 'import jax,sys; print("jax", jax.__version__, "python", sys.version.split()[0])')"
C="# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command:"
( echo "$H"; echo "$C python3 -m jaxgrad.cli audit --op kan_linear"
  timeout 280 python3 -m jaxgrad.cli audit --op kan_linear 2>&1; echo "audit rc=$? after $(( $(date +%s) - t0 )) s" ) > $OUT/logs/audit_kan_linear.log &
( echo "$H"; echo "$C python3 -m jaxgrad.cli audit --op 'conv2d[xla'"
  timeout 280 python3 -m jaxgrad.cli audit --op 'conv2d[xla' 2>&1; echo "audit rc=$? after $(( $(date +%s) - t0 )) s" ) > $OUT/logs/audit_conv2d_xla.log &
wait
tail -n 4 $OUT/logs/audit_kan_linear.log $OUT/logs/audit_conv2d_xla.log
