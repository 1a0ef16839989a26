"""GPT 125M: 12 layers, d_model 768, 12 heads (GPT-2 small); bf16 compute, fp32 parameters, 8K context."""

from bpt.config import paper_config


def get_config():
    return paper_config("125m")
