"""Pure functions on arrays. Attention layout everywhere: [batch, seq, heads, head_dim]."""

from bpt.ops.attention import IMPLS, attention, select_impl
from bpt.ops.blockwise import attend_query_chunk, blockwise_attention
from bpt.ops.chunked import CrossEntropy, Loss, blockwise_cross_entropy, blockwise_ffn, cross_entropy
from bpt.ops.decode import DECODE_IMPLS, decode_attention
from bpt.ops.reference import reference_attention
from bpt.ops.remat import POLICIES

__all__ = [
    "DECODE_IMPLS",
    "IMPLS",
    "POLICIES",
    "CrossEntropy",
    "Loss",
    "attend_query_chunk",
    "attention",
    "blockwise_attention",
    "blockwise_cross_entropy",
    "blockwise_ffn",
    "cross_entropy",
    "decode_attention",
    "reference_attention",
    "select_impl",
]
