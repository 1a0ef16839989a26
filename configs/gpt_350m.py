"""GPT 350M: 24 layers, d_model 1024, 16 heads (GPT-2 medium); bf16 compute, fp32 parameters, 8K context."""

from bpt.config import paper_config


def get_config():
    return paper_config("350m")
