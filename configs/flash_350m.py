"""FLASH matched to GPT-350M by parameter count (twice its layers, d_model alike): mixed chunk
attention in chunks of 256, bf16 compute, fp32 parameters, 8K context."""

from bpt.config import flash_config


def get_config():
    return flash_config("350m")
