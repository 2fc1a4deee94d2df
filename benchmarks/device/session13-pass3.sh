#!/usr/bin/env bash
# Session 13, pass 3 ($OUT comes back; at most 8 files). #13 timings, each variant in a fresh process: the block with
# the Mosaic GPU kernels' rank-r side outputs beside the session-12 kernels (mosaic-no-rank), jax.grad + cuDNN and
# PEFT in the same run; then the whole small model's training step (lora_model: 4 layers, vocab 32000, batch 4 x
# 2048 tokens) -- ours with the Mosaic GPU kernels, jax.grad + cuDNN, transformers + PEFT -- tokens/s and peak memory.
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session13-pass3.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
L=${LIMIT:-420}
timeout 215 python3 scripts/bench.py lora --sizes full --budget-s 205 --out $OUT/results \
  --variants "=custom_vjp cudnn mosaic,=custom_vjp cudnn mosaic-no-rank,=jax.grad(reference) cudnn,torch" \
  > $OUT/logs/bench_block.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_block.log
timeout $(( L - ($(date +%s) - t0) )) python3 scripts/bench.py lora_model --sizes full --repeats 10 --warmup 2 \
  --budget-s $(( L - 10 - ($(date +%s) - t0) )) --out $OUT/results \
  --variants "=custom_vjp cudnn mosaic,=torch LlamaForCausalLM+PEFT sdpa,=jax.grad(reference) cudnn" \
  > $OUT/logs/bench_model.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_model.log
grep -E "^#   |rc=" $OUT/logs/bench_block.log; grep -E "tokens/s|rc=" $OUT/logs/bench_model.log | grep -v "^lora_model " | tail -8
