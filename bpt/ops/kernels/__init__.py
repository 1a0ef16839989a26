"""Pallas kernels: FlashAttention-2 forward and backward (flash.py, Triton lowering) and a
Hopper forward (flash_hopper.py, Mosaic GPU)."""

from bpt.ops.kernels.flash import flash_attention, flash_attention_with_lse

__all__ = ["flash_attention", "flash_attention_with_lse"]
