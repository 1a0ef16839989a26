"""Tiny: 2 layers, d_model 128; 60 steps take about a minute on a 2-core CPU."""

from bpt.config import base_config


def get_config():
    c = base_config("tiny")
    c.data.seq_len = 256
    c.model.q_chunk_size = c.model.kv_chunk_size = c.model.loss_chunk_size = 64
    c.train.steps = 60
    c.train.batch_size = 8
    c.train.learning_rate = 1e-3
    c.train.warmup_steps = 10
    c.train.eval_every = 0
    c.train.eval_batches = 2
    c.train.sample_tokens = 100
    return c
