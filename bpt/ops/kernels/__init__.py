"""Pallas kernels: FlashAttention-2 forward and backward, lowered through Triton
(attention.py) and, for H100-class GPUs, through Mosaic GPU (attention_hopper.py); decode
attention (decode.py); the GAU's (gau.py); LayerNorm (layer_norm.py). segments.py: the
spans of blocks that packed documents need, which the flash kernels stream in place of the
whole window."""

from bpt.ops.kernels.attention import flash_attention, flash_attention_with_lse

__all__ = ["flash_attention", "flash_attention_with_lse"]
