"""Pure functions on arrays. Attention layout everywhere: [batch, seq, heads, head_dim]."""

from bpt.ops.attention import ATTENTION, IMPLS, MERGED, attention, select_impl
from bpt.ops.blockwise import attend_query_chunk, blockwise_attention
from bpt.ops.chunked import CrossEntropy, Loss, blockwise_cross_entropy, blockwise_ffn, cross_entropy
from bpt.ops.decode import DECODE, DECODE_IMPLS, decode_attention
from bpt.ops.gau import MIXED_CHUNK
from bpt.ops.reference import reference_attention
from bpt.ops.registry import Implementation, Registry
from bpt.ops.remat import POLICIES

__all__ = [
    "ATTENTION",
    "DECODE",
    "DECODE_IMPLS",
    "IMPLS",
    "MERGED",
    "MIXED_CHUNK",
    "Implementation",
    "Registry",
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
