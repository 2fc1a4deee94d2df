#!/usr/bin/env bash
# jaxgrad on a GPU, in stages that each fit a 10-minute run; every stage writes its log (with a header: device,
# versions, commit, dirty flag, command line) into one dated folder.
#
#   bash scripts/gpu_check.sh tests lora                   # the tests marked `gpu`, one group per run (each
#   bash scripts/gpu_check.sh tests ops                    #   group fits the budget on an H100): lora, ops,
#   bash scripts/gpu_check.sh tests kan cnn                #   kan, cnn, audit; or test files by path
#   bash scripts/gpu_check.sh tests tests/test_attention_masks.py tests/test_verify_program_precision.py
#   bash scripts/gpu_check.sh tests-isolated tests/test_kan_mosaic.py   # each case in its own process (a device
#                                                          #   fault ends that case only)
#   bash scripts/gpu_check.sh verify                       # the cost of a verdict (block backends xla, mosaic)
#   bash scripts/gpu_check.sh false-alarms                 # the verifier's mixed-precision false-alarm sweep
#   bash scripts/gpu_check.sh audit [--op NAME ...]        # `jaxgrad audit` on the GPU (all cases, or those named)
#   bash scripts/gpu_check.sh bench lora attention         # benchmark suites (python -m jaxgrad.bench SUITE)
#   bash scripts/gpu_check.sh bench kan -- --variants mosaic,xla --budget-s 300   # options after -- go to each suite
#   GPU_CHECK_OUT=/tmp/x bash scripts/gpu_check.sh ...     # the folder (default runs/gpu-check/<UTC date-time>)
#
# The exit status is the last failing stage command's (0 when every one passed), so `gpu_check.sh tests F || ...`
# can react to a failing test.
#
# Environment: GPU_CHECK_BUDGET_S (seconds a stage may take, default 540), FALSE_ALARM_RUNS (default 200),
# FALSE_ALARM_JOBS (worker processes sharing the GPU, default 8: a verdict's time is mostly compilation, on the CPU),
# FALSE_ALARM_SEED (default 0), FALSE_ALARM_PLANTED_SHARE (default 0.5),
# JAXGRAD_COMMIT / JAXGRAD_DIRTY (the commit measured, where the tree is a copy without its .git).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false \
  NCCL_NVLS_ENABLE=0
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
BUDGET=${GPU_CHECK_BUDGET_S:-540}
DIR=${GPU_CHECK_OUT:-runs/gpu-check/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$DIR"
COMMIT=${JAXGRAD_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
DIRTY=${JAXGRAD_DIRTY:-$( [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && echo yes || echo no)}
export JAXGRAD_COMMIT=$COMMIT JAXGRAD_DIRTY=$DIRTY

header() {  # $1: the command line the log is for
  local gpu; gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  echo "# device: ${gpu:-none} x $(nvidia-smi -L 2>/dev/null | grep -c '^GPU');" \
       "$($PY -c 'import jax, sys; print("jax", jax.__version__, "python", sys.version.split()[0])')"
  echo "# commit $COMMIT (uncommitted changes: $DIRTY); date $(date -u +%Y-%m-%dT%H:%M:%SZ); command:" \
       "${PYTEST_ADDOPTS:+PYTEST_ADDOPTS='$PYTEST_ADDOPTS' }$1"
}

STATUS=0
run_logged() {  # $1: log name; the rest: the command, run under the stage's time budget
  local log="$DIR/$1.log" rc; shift
  ( header "$*"; timeout "$BUDGET" "$@"; rc=$?; echo "# exit status $rc after $SECONDS s"; exit $rc ) > "$log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || STATUS=$rc
  tail -n 3 "$log"
}

stage=${1:-}
[ $# -gt 0 ] && shift
case "$stage" in
  tests)
    [ $# -gt 0 ] || { echo "gpu_check.sh tests: name groups (lora ops kan cnn audit) or test files" >&2; exit 2; }
    for group in "$@"; do
      case "$group" in
        lora)  files=(tests/test_lora_*.py tests/test_attention_masks.py) ;;
        ops)   files=(tests/test_op_variants.py tests/test_swiglu.py tests/test_flash_attention.py
                      tests/test_rmsnorm_kernel.py tests/test_nf4_matmul.py tests/test_pallas_backend.py
                      tests/test_verify_*.py tests/test_bench_*.py) ;;
        kan)   files=(tests/test_kan_*.py) ;;
        cnn)   files=(tests/test_cnn_kernels.py tests/test_cnn_kernels_gpu.py) ;;
        audit) files=(tests/test_audit_registry.py) ;;
        *)     files=("$group") ;;
      esac
      name=$(basename "$group" .py)
      run_logged "gpu-tests-$name" "$PY" -m pytest -m gpu -q -rfE -p no:cacheprovider --durations=10 "${files[@]}"
    done ;;
  tests-isolated)  # each `gpu` test of the files in its own process: a device fault ends one case, not the file
    [ $# -gt 0 ] || { echo "gpu_check.sh tests-isolated: name test files" >&2; exit 2; }
    for file in "$@"; do
      log="$DIR/gpu-tests-isolated-$(basename "$file" .py).log"
      { header "each gpu test of $file in its own process: $PY -m pytest -m gpu -q --tb=short NODE"
        for node in $("$PY" -m pytest -m gpu -q --collect-only -p no:cacheprovider "$file" 2>/dev/null | grep '::'); do
          out=$(timeout "$BUDGET" "$PY" -m pytest -m gpu -q --tb=short -p no:cacheprovider "$node" 2>&1)
          rc=$?
          [ $rc -eq 0 ] || echo "$rc" > "$log.failed"
          echo "$node: exit status $rc"
          echo "$out" | grep -E '^E |passed|failed|skipped|Fatal Python error' | head -n 5 | sed 's/^/    /'
        done
        echo "# done after $SECONDS s"; } > "$log" 2>&1
      [ -f "$log.failed" ] && { STATUS=$(cat "$log.failed"); rm -f "$log.failed"; }
      tail -n 3 "$log"
    done ;;
  verify)
    for backend in xla mosaic; do
      run_logged "verify-cost-$backend" "$PY" -m jaxgrad.bench verify_cost --backend "$backend" --repeats 2 \
        --out "$DIR"
    done ;;
  false-alarms)
    run_logged verify-false-alarms-mixed "$PY" -m jaxgrad.bench verify_false_alarms --mode mixed \
      --n "${FALSE_ALARM_RUNS:-200}" --jobs "${FALSE_ALARM_JOBS:-8}" --seed "${FALSE_ALARM_SEED:-0}" \
      --planted-share "${FALSE_ALARM_PLANTED_SHARE:-0.5}" --budget-s "$((BUDGET - 30))" --out "$DIR" ;;
  audit)
    run_logged audit "$PY" -m jaxgrad.cli audit --json "$DIR/audit.json" "$@" ;;
  bench)
    suites=() options=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do suites+=("$1"); shift; done
    [ $# -gt 0 ] && { shift; options=("$@"); }
    for suite in "${suites[@]:-lora}"; do
      run_logged "bench-$suite" "$PY" -m jaxgrad.bench "$suite" --out "$DIR" "${options[@]}"
    done ;;
  *)
    echo "usage: bash scripts/gpu_check.sh tests GROUPS|FILES... | tests-isolated FILES... | verify | false-alarms | audit | bench [SUITES...]" >&2
    exit 2 ;;
esac
echo "wrote $DIR"
exit $STATUS
