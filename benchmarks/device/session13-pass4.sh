#!/usr/bin/env bash
# Prepared in session 13 for the next session ($OUT comes back; at most 8 files). #13, what session 13 could not run:
# the Pallas flash attention's GPU tests (compiled by Triton: forward check and bf16 verification at the block's
# shape and at seq 77 / 3-1 heads / d 80), then timings, each variant in a fresh process: the block with the Mosaic
# GPU kernels' rank-r side outputs beside the session-12 kernels (mosaic-no-rank), jax.grad + cuDNN and PEFT in the
# same run; then the whole small model's training step (lora_model: 4 layers, vocab 32000, batch 4 x 2048 tokens) --
# ours with the Mosaic GPU kernels, jax.grad + cuDNN, transformers + PEFT -- tokens/s and peak memory.
# `export JAXGRAD_COMMIT=$(git rev-parse --short HEAD) JAXGRAD_DIRTY=false; bash benchmarks/device/session13-pass4.sh`
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/results $OUT/logs
t0=$(date +%s)
( echo "# commit ${JAXGRAD_COMMIT} (uncommitted changes: ${JAXGRAD_DIRTY}); command: pytest -m gpu tests/test_flash_attention.py"
  timeout 150 python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_flash_attention.py 2>&1 | tail -60
  echo "flash tests rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" ) > $OUT/logs/gpu_tests.log 2>&1
timeout 215 python3 scripts/bench.py lora --sizes full --budget-s 205 --out $OUT/results \
  --variants "=custom_vjp cudnn mosaic,=custom_vjp cudnn mosaic-no-rank,=jax.grad(reference) cudnn,torch" \
  > $OUT/logs/bench_block.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_block.log
L=575
timeout $(( L - ($(date +%s) - t0) )) python3 scripts/bench.py lora_model --sizes full --repeats 10 --warmup 2 \
  --budget-s $(( L - 10 - ($(date +%s) - t0) )) --out $OUT/results \
  --variants "=custom_vjp cudnn mosaic,=torch LlamaForCausalLM+PEFT sdpa,=jax.grad(reference) cudnn" \
  > $OUT/logs/bench_model.log 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s" >> $OUT/logs/bench_model.log
grep -E "passed|failed|rc=" $OUT/logs/gpu_tests.log | tail -3; grep -E "^#   |rc=" $OUT/logs/bench_block.log
grep -E "tokens/s|rc=" $OUT/logs/bench_model.log | grep -v "^lora_model " | tail -8
