#!/usr/bin/env bash
# Session 14, pass 6 (#13): the final kernels' numbers. The Mosaic GPU kernels' GPU tests (the default now reads the
# rank-r product from XLA; odd sizes through padding); the block (mosaic default, NF4 on mosaic, wgmma in flight,
# rank in the K loop) beside jax.grad + cuDNN and PEFT; the seq-8192 rows; the 4-layer model's training step; a
# profile of the default mosaic block. One archive comes back.
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session14-pass6.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
H="# device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(python3 -c 'import jax,sys; print("jax", jax.__version__, "python", sys.version.split()[0])')"
C="# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command:"
( echo "$H"; echo "$C pytest -m gpu tests/test_lora_linear_mgpu.py"
  timeout 120 python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_lora_linear_mgpu.py 2>&1 | tail -45
  echo "kernel tests rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" ) > $OUT/logs/gpu_tests.log 2>&1
timeout 140 python3 scripts/bench.py lora --sizes full --budget-s 130 --out $OUT/results \
  --variants "=custom_vjp cudnn mosaic,=jax.grad(reference) cudnn,torch,=custom_vjp cudnn nf4 mosaic,=custom_vjp cudnn mosaic-in-flight,=custom_vjp cudnn mosaic-rank-in-kernel" \
  > $OUT/logs/bench_block.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_block.log
timeout 70 python3 scripts/bench.py lora --sizes long --budget-s 62 --out $OUT/results \
  --variants "=custom_vjp cudnn mosaic,=jax.grad(reference) cudnn,torch" > $OUT/logs/bench_long.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_long.log
timeout 100 python3 scripts/bench.py lora_model --sizes full --repeats 10 --warmup 2 --budget-s 95 --out $OUT/results \
  --variants "=custom_vjp cudnn mosaic,=torch LlamaForCausalLM+PEFT sdpa,=jax.grad(reference) cudnn" \
  > $OUT/logs/bench_model.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_model.log
L=570
( echo "$H"; echo "$C lora_profile.py --sizes full --variants 'custom_vjp cudnn mosaic'"
  timeout $(( L - ($(date +%s) - t0) )) python3 scripts/lora_profile.py --sizes full --variants "custom_vjp cudnn mosaic" \
    --out $OUT/results 2>&1; echo "profile rc=$? after $(( $(date +%s) - t0 )) s" ) > $OUT/logs/profile.log 2>&1
grep -E "passed|failed|rc=" $OUT/logs/gpu_tests.log | tail -3; grep -E "^#   |^# .*tokens/s|rc=" $OUT/logs/bench_*.log
grep -E "^==|^coarse|^GPU busy|^step wall|rc=" $OUT/logs/profile.log
tar czf $OUT/pass6.tgz -C $OUT results logs && rm -rf $OUT/results $OUT/logs
