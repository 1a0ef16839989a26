"""Running on a mesh of devices: the mesh and its sharding rules, context parallelism (softmax
attention's ring and all-gather, FLASH's mixed chunk attention), decoding over a sharded
cache."""

from bpt.parallel.gau import sharded_mixed_chunk_attention
from bpt.parallel.mesh import (
    AXES,
    BATCH_AXES,
    CONTEXT_PARALLEL,
    LOAD_BALANCE,
    PARAM_RULES,
    RULES,
    Parallelism,
    make_mesh,
    param_shardings,
)
from bpt.parallel.ring import (
    LAYOUTS,
    all_gather_attention,
    context_parallel_attention,
    from_layout,
    layout_permutation,
    ring_attention,
    to_layout,
)
from bpt.parallel.tree import ring_decode_attention, sharded_write_cache, tree_decode_attention

__all__ = [
    "AXES",
    "BATCH_AXES",
    "CONTEXT_PARALLEL",
    "LAYOUTS",
    "LOAD_BALANCE",
    "PARAM_RULES",
    "RULES",
    "Parallelism",
    "all_gather_attention",
    "context_parallel_attention",
    "from_layout",
    "layout_permutation",
    "make_mesh",
    "param_shardings",
    "ring_attention",
    "ring_decode_attention",
    "sharded_mixed_chunk_attention",
    "sharded_write_cache",
    "to_layout",
    "tree_decode_attention",
]
