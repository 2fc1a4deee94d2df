#!/usr/bin/env bash
# Session 14, pass 3 (#13). The Mosaic GPU kernels' GPU tests (fwd / dX, bf16 dX -- the block's default now -- and
# TileConfig(wgmma_in_flight=1)); then, in one run each: the block (mosaic with bf16 dX, mosaic-in-flight,
# mosaic-f32-dx, custom_vjp pallas-attn beside custom_vjp cudnn, jax.grad + cuDNN, PEFT); one projection's kernels
# (lora_proj); the attention core alone (cuDNN, cuDNN with kv repeated, our Pallas flash kernels, our XLA VJP); the
# 4-layer model's training step (mosaic, PEFT, jax.grad); last, the in-flight block's verification. Everything under
# $OUT is packed into one archive at the end (the device tool returns at most 8 files).
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session14-pass3.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
H="# device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(python3 -c 'import jax,sys; print("jax", jax.__version__, "python", sys.version.split()[0])')"
C="# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command:"
( echo "$H"; echo "$C pytest -m gpu tests/test_lora_linear_mgpu.py"
  timeout 110 python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_lora_linear_mgpu.py 2>&1 | tail -45
  echo "kernel tests rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" ) > $OUT/logs/gpu_tests.log 2>&1
timeout 150 python3 scripts/bench.py lora --sizes full --budget-s 140 --out $OUT/results \
  --variants "=custom_vjp cudnn mosaic,=custom_vjp cudnn mosaic-in-flight,=jax.grad(reference) cudnn,torch,=custom_vjp cudnn mosaic-f32-dx,=custom_vjp cudnn,=custom_vjp pallas-attn" \
  > $OUT/logs/bench_block.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_block.log
timeout 100 python3 scripts/bench.py lora_proj --sizes full --out $OUT/results > $OUT/logs/bench_proj.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_proj.log
timeout 60 python3 scripts/bench.py attention --sizes full --out $OUT/results > $OUT/logs/bench_attention.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_attention.log
timeout 100 python3 scripts/bench.py lora_model --sizes full --repeats 10 --warmup 2 --budget-s 95 --out $OUT/results \
  --variants "=custom_vjp cudnn mosaic,=torch LlamaForCausalLM+PEFT sdpa,=jax.grad(reference) cudnn" \
  > $OUT/logs/bench_model.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_model.log
L=560
( echo "$H"; echo "$C pytest -m gpu tests/test_lora_block_mosaic.py -k in-flight"
  timeout $(( L - ($(date +%s) - t0) )) python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_lora_block_mosaic.py -k in-flight 2>&1 | tail -20
  echo "verify rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" ) >> $OUT/logs/gpu_tests.log 2>&1
grep -E "passed|failed|rc=" $OUT/logs/gpu_tests.log | tail -5; grep -E "^#   |rc=" $OUT/logs/bench_block.log $OUT/logs/bench_model.log
grep -E "^(lora_proj|attention)|rc=" $OUT/logs/bench_proj.log $OUT/logs/bench_attention.log | cut -c1-200
tar czf $OUT/pass3.tgz -C $OUT results logs && rm -rf $OUT/results $OUT/logs
