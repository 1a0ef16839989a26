#!/bin/bash
# Speed of this checkout against another (an older commit's tree, e.g. from
# `git archive REV bpt scripts configs pyproject.toml | tar x -C OLD`), on one GPU, in turn:
# bench_attention at 16K (bpt's kernels and cuDNN, two rounds each, alternating) and a GPT-1B
# bpt-train run at 32K (10 steps, the remat auto picks on an H100 at 32K).
#
#   scripts/compare_checkouts.sh OLD [attention|train|both]     results under $OUT (results/compare)
set -u
OLD=${1:?give the other checkout's folder}
WHAT=${2:-both}
OUT=${OUT:-results/compare}
mkdir -p "$OUT"
attention() {  # side root round
  (cd "$2" && PYTHONPATH=$PWD:${PYTHONPATH:-} python scripts/bench_attention.py --seqs 16384 \
      --impls bpt-pallas,cudnn --repeats 3 --out "$OUT/att_$1_$3.json") > "$OUT/att_$1_$3.log" 2>&1
  echo "attention $1 round $3: exit $?"
}
train() {  # side root
  rm -rf "/tmp/compare_$1"
  (cd "$2" && PYTHONPATH=$PWD:${PYTHONPATH:-} BPT_NO_SUPERVISOR=1 timeout -k 5 300 python -m bpt.cli.train \
      --config configs/gpt_1b.py --workdir "/tmp/compare_$1" --config.data.name=copy \
      --config.data.seq_len=32768 --config.train.batch_size=1 --config.train.steps=10 \
      --config.train.log_every=1 --config.train.eval_every=0 --config.train.eval_batches=0 \
      --config.train.sample_tokens=0 --config.train.checkpoint_every=1000 \
      --config.model.remat_layer=attention_and_dots_saveable) > "$OUT/train_$1.log" 2>&1
  echo "train $1: exit $?"
  cp "/tmp/compare_$1/metrics.jsonl" "$OUT/metrics_$1.jsonl" 2>/dev/null
}
OUT=$(cd "$OUT" && pwd)
if [ "$WHAT" != train ]; then
  attention old "$OLD" 1; attention new . 1; attention old "$OLD" 2; attention new . 2
fi
if [ "$WHAT" != attention ]; then
  train new .; train old "$OLD"
fi
OUT="$OUT" python3 - <<'PY'
import glob, json, os, statistics
out = os.environ["OUT"]
print("| run | implementation | 16K fwd TFLOP/s | 16K f+b TFLOP/s |\n|---|---|---|---|")
for path in sorted(glob.glob(f"{out}/att_*.json")):
    for row in json.load(open(path)):
        name = os.path.basename(path)[4:-5]
        print(f"| {name} | {row['impl']} | {row['fwd_tflops']:.1f} | {row['fwd_bwd_tflops']:.1f} |")
print("\n| run | tokens/s (median of steps 3-10) | MFU | losses 1-3 |\n|---|---|---|---|")
for path in sorted(glob.glob(f"{out}/metrics_*.jsonl")):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    later = rows[2:]
    speed = statistics.median(r["tokens_per_sec"] for r in later)
    mfu = statistics.median(r["mfu"] for r in later)
    losses = ", ".join(f"{r['loss']:.4f}" for r in rows[:3])
    print(f"| {os.path.basename(path)[8:-6]} | {speed:,.0f} | {100 * mfu:.1f}% | {losses} |")
PY
