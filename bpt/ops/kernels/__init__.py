"""Pallas kernels: FlashAttention-2 forward and backward, lowered through Triton
(attention.py) and, for H100-class GPUs, through Mosaic GPU (attention_hopper/); decode
attention (decode.py); the GAU's (gau.py); LayerNorm (layer_norm.py)."""

from bpt.ops.kernels.attention import flash_attention, flash_attention_with_lse

__all__ = ["flash_attention", "flash_attention_with_lse"]
