"""FLASH matched to GPT-125M as configs/flash_125m.py, with bpt's choices from before the FLASH
paper's LM recipe became the default (bpt.config.FLASH_RECIPES["bpt"]): ScaleNorm, RoPE alone,
no absolute embedding, the linear part as the running sum over earlier chunks times 1/n."""

from bpt.config import flash_config


def get_config():
    return flash_config("125m", recipe="bpt")
