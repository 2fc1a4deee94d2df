#!/usr/bin/env bash
# Session 12, pass 6 ($OUT comes back; 3 files). #10 item 5 under this session's verifier (32 replicas for small
# functions, the slice level): `jaxgrad audit` of swiglu, kan_linear and conv2d on the H100, one process per op family.
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session12-pass6.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --find-links .whl mrcfile 2>&1 | tail -1
header() {
  echo "# device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(python3 -c 'import jax,sys; print("jax", jax.__version__, "python", sys.version.split()[0])')"
  echo "# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command: $*"
}
mkdir -p $OUT/logs
t0=$(date +%s)
for op in swiglu kan_linear conv2d; do
  ( c="python3 -m jaxgrad.cli audit --op $op"; header "$c" > $OUT/logs/audit_$op.log
    timeout 400 $c >> $OUT/logs/audit_$op.log 2>&1; echo "audit rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/audit_$op.log ) &
done
wait
for op in swiglu kan_linear conv2d; do grep -E "^audit:|VERDICT|\[FAIL|rc=" $OUT/logs/audit_$op.log | cut -c1-200; done
