"""GPT 1B: 24 layers, d_model 2048, 16 heads; bf16 compute, fp32 parameters, 8K context."""

from bpt.config import paper_config


def get_config():
    return paper_config("1b")
