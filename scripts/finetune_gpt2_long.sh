#!/usr/bin/env bash
# Long-context fine-tuning of a Hugging Face GPT-2 folder, end to end: import it, fine-tune it
# at 8K context with each way of growing its 1024-position table (interpolate, tile), and
# measure the loss by position in the window before and after (configs/finetune_gpt2_long.py).
#
#   scripts/finetune_gpt2_long.sh path/to/gpt2 [out] [--config.key=value ...]
#
# The overrides go to every command (e.g. --config.data.seq_len=16384 --config.train.steps=400).
# Writes <out>/{gpt2, base_<method>, ft_<method>} runs, <out>/by_position.png and prints the
# loss-by-position table of each run.
set -euo pipefail
hf="$1"
out="${2:-runs/gpt2_long}"
shift $(( $# >= 2 ? 2 : 1 ))
recipe=configs/finetune_gpt2_long.py
seq_len=8192  # the recipe's, unless overridden
for arg in "$@"; do
  case "$arg" in --config.data.seq_len=*) seq_len="${arg#*=}" ;; esac
done

if [ ! -f "$out/gpt2/config.json" ]; then  # as released: its own 1024 positions
  python -m bpt.cli.import_hf "$hf" --workdir "$out/gpt2" --config "$recipe" "$@"
fi
for method in interpolate tile; do
  # Before fine-tuning: the table grown to seq_len, nothing trained.
  if [ ! -f "$out/base_$method/config.json" ]; then
    python -m bpt.cli.import_hf "$hf" --workdir "$out/base_$method" --seq_len "$seq_len" \
      --extend_positions "$method" --config "$recipe:$out/gpt2" "$@"
  fi
  # Fine-tuned (a stopped run resumes from its last checkpoint).
  python -m bpt.cli.train --config "$recipe:$out/gpt2" --workdir "$out/ft_$method" \
    --config.init.extend_positions="$method" "$@"
done
for run in gpt2 base_interpolate base_tile ft_interpolate ft_tile; do
  echo "== $run"
  python -m bpt.cli.eval --workdir "$out/$run" --by_position
done
python -m bpt.cli.plot --by_position "$out/gpt2" "$out"/base_* "$out"/ft_* --out "$out/by_position.png"
