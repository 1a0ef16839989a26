"""FLASH matched to GPT-125M as configs/flash_125m.py, with the FLASH paper's LM recipe
(bpt.config.FLASH_RECIPES["paper"]): LayerNorm, RoPE with the relative position bias, the
ScaledSin absolute embedding, and the linear part as the mean over earlier chunks."""

from bpt.config import flash_config


def get_config():
    return flash_config("125m", recipe="paper")
