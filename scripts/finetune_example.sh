#!/usr/bin/env bash
# Fine-tune a Llama on your own data, end to end, with nothing downloaded (docs/lora.md walks through it):
#   1. a tokenizer trained on the Python standard library's source;
#   2. a small Llama pretrained from scratch on that source (`jaxgrad train lora`, mode full), saved as a Hugging
#      Face folder (config.json, model.safetensors, the tokenizer files);
#   3. docstring-completion data made on the machine (prompt: a function's signature, completion: its docstring),
#      some held out by example;
#   4. LoRA and QLoRA (NF4 base) fine-tuning of that model on the docstrings;
#   5. each adapter merged into its base (QLoRA: onto the dequantised NF4 weights) and exported as an HF folder;
#   6. the report: held-out loss before / after, greedy generations before / after (report.json).
#
#   bash scripts/finetune_example.sh                  # SIZE=small: a CPU, about 1.5 minutes
#   SIZE=gpu bash scripts/finetune_example.sh         # one H100: hidden 512, 8 layers, vocab 8192, seq 512
#   OUT=/tmp/ex bash scripts/finetune_example.sh      # the output folder (default runs/finetune-example)
#
# SIZE=small: tokenizer and pretraining on *.py (the 164 top-level modules, 4.6 MB); docstrings of the packages
#   (*/**/*.py, tests excluded: 2715, 10 % held out), new text to the base; vocab 2048; hidden 64, 2 layers, 4 / 2
#   heads, MLP 172, seq 128, batch 8; pretraining 600 steps; LoRA r 8, alpha 16, 300 steps.
# SIZE=gpu: the same data; vocab 8192; hidden 512, 8 layers, 8 / 4 heads, MLP 1408, seq 512, batch 8; pretraining
#   1200 steps (warm-up + cosine, clip 1.0: about 5 passes over the ~1M tokens of *.py); LoRA r 16, alpha 32, 120
#   steps (about 2.5 passes over the docstrings). Pretraining in float32; the fine-tuning runs hold the base in
#   bfloat16 (adapters float32), so they take the fast path: the Mosaic GPU block with cuDNN attention.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3 )}
jaxgrad() { "$PY" -m jaxgrad.cli "$@"; }
SIZE=${SIZE:-small}
OUT=${OUT:-runs/finetune-example}
STDLIB=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')

case $SIZE in
  small) TEXT='*.py'; DOCS='*/**/*.py'; VOCAB=2048; SEQ=128; BATCH=8
         MODEL=(--set model.hidden_size=64 --set model.num_hidden_layers=2 --set model.num_attention_heads=4
                --set model.num_key_value_heads=2 --set model.intermediate_size=172)
         PRETRAIN=(--set train.steps=600 --set train.lr=3e-3 --set train.schedule=cosine)
         FINETUNE=(--set model.r=8 --set model.lora_alpha=16 --set train.steps=300 --set train.lr=3e-3) ;;
  gpu)   TEXT='*.py'; DOCS='*/**/*.py'; VOCAB=8192; SEQ=512; BATCH=8
         MODEL=(--set model.hidden_size=512 --set model.num_hidden_layers=8 --set model.num_attention_heads=8
                --set model.num_key_value_heads=4 --set model.intermediate_size=1408)
         PRETRAIN=(--set train.steps=1200 --set train.lr=1e-3 --set train.schedule=warmup_cosine
                   --set train.warmup_steps=100 --set train.clip_norm=1.0)
         FINETUNE=(--set model.r=16 --set model.lora_alpha=32 --set train.steps=120 --set train.lr=1e-3
                   --set model.dtype=bfloat16) ;;
  *)     echo "SIZE must be small or gpu, got '$SIZE'" >&2; exit 2 ;;
esac
RUN=(--overwrite --no-progress --set model.seq_len=$SEQ --set data.batch_size=$BATCH --set train.log_every=100)
mkdir -p "$OUT"

# 1. the tokenizer: byte-level BPE in Llama 3's layout, one text per source file
jaxgrad tokenizer "$STDLIB" --pattern "$TEXT" --file-format text --vocab-size $VOCAB --out "$OUT/tokenizer" --overwrite

# 2. pretraining from scratch: every source file one document, cut into seq_len chunks; saved as out/model
jaxgrad train lora --out "$OUT/base" "${RUN[@]}" "${MODEL[@]}" "${PRETRAIN[@]}" --set model.mode=full \
  --set model.tokenizer="$OUT/tokenizer" --set data.path="$STDLIB" --set data.pattern="$TEXT" \
  --set data.file_format=text --set data.sample_by=document --set data.overlong=split \
  --set train.checkpoint_every=1000

# 3. docstring completion: prompt = the signature, completion = the docstring; a held-out file by example
"$PY" -m jaxgrad.lora.stdlib_data docstrings "$OUT/data/docstrings.jsonl" --pattern "$DOCS" \
  --held-out 0.1 --eval-out "$OUT/data/docstrings_eval.jsonl"

# 4. LoRA (float32 base) and QLoRA (NF4 base) on the docstrings: loss on the completion tokens, packed rows
for MODE in lora qlora; do
  jaxgrad train lora --out "$OUT/$MODE" "${RUN[@]}" "${FINETUNE[@]}" --set model.mode=$MODE \
    --set model.base="$OUT/base/model" --set data.path="$OUT/data/docstrings.jsonl" \
    --set data.eval_path="$OUT/data/docstrings_eval.jsonl" --set train.checkpoint_every=500
done

# 5. merge and export (the NF4 setting comes from the adapter's run.json)
for MODE in lora qlora; do
  jaxgrad merge --base "$OUT/base/model" --adapter "$OUT/$MODE/adapter" --out "$OUT/merged-$MODE" --overwrite
done

# 6. held-out loss and generations before / after, the merged folders' loss: report.json
"$PY" -m jaxgrad.lora.example_report "$OUT"
