"""GPT 7B: 32 layers, d_model 4096, 32 heads; bf16 compute, fp32 parameters, 8K context."""

from bpt.config import paper_config


def get_config():
    return paper_config("7b")
