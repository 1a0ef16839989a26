"""GPT 3B: 32 layers, d_model 2560, 32 heads of 80; bf16 compute, fp32 parameters, 8K context."""

from bpt.config import paper_config


def get_config():
    return paper_config("3b")
