"""GPT 13B: 40 layers, d_model 5120, 40 heads; bf16 compute, fp32 parameters, 8K context."""

from bpt.config import paper_config


def get_config():
    return paper_config("13b")
