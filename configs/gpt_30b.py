"""GPT 30B: 48 layers, d_model 7168, 56 heads; bf16 compute, fp32 parameters, 8K context."""

from bpt.config import paper_config


def get_config():
    return paper_config("30b")
