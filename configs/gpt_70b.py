"""GPT 70B: 80 layers, d_model 8192, 64 heads; bf16 compute, fp32 parameters, 8K context."""

from bpt.config import paper_config


def get_config():
    return paper_config("70b")
