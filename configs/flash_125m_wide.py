"""FLASH matched to GPT-125M by parameter count, wide and shallow: 6 Gated Attention Units of
d_model 1280 (124.3M parameters against the GPT's 123.7M) where configs/flash_125m.py has 24
of 768. The same kind of matmuls in fewer, wider layers leave fewer elementwise passes: on
an H100 at 8K its training step is 2.03x the GPT's (flash_125m: 1.41x), and after 400 steps
on bytes its validation loss is 6.7% above flash_125m's and 19% below the GPT's
(docs/notes/flash.md, "Depth and width at matched parameters"; measured with bpt's earlier
recipe, FLASH_RECIPES["bpt"], before the paper's became the default)."""

from bpt.config import flash_config


def get_config():
    return flash_config("125m", d_model=1280)
