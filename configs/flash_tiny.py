"""FLASH tiny: 4 Gated Attention Units (twice GPT tiny's layers, about its parameters),
d_model 128, mixed chunk attention in chunks of 64; 60 steps take about a minute on a CPU."""

from bpt.config import base_config


def get_config():
    c = base_config("tiny")
    c.model.family = "flash"
    c.model.num_layers = 4
    c.model.chunk_size = 64
    c.model.qk_dim = 64
    c.model.loss_chunk_size = 64
    c.data.seq_len = 256
    c.train.steps = 60
    c.train.batch_size = 8
    c.train.learning_rate = 1e-3
    c.train.warmup_steps = 10
    c.train.eval_every = 0
    c.train.eval_batches = 2
    c.train.sample_tokens = 100
    return c
