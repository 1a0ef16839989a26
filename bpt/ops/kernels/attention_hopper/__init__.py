"""FlashAttention for Hopper GPUs in Pallas Mosaic GPU (wgmma, TMA, warp specialization).

Every kernel here has the same shape. One CTA holds three warpgroups: two compute warpgroups
each own a block of rows (query rows for the forward and dQ, key rows for dK/dV), and the
third only moves data: it streams the other side's blocks from HBM into a ring of `stages`
shared-memory slots with TMA (`_Ring`), and refills a slot once both compute warpgroups have
released it. Each compute warpgroup runs its own copy of the code, its index a constant
(`_per_warpgroup`). The compute warpgroups run the matmuls on the tensor cores (wgmma, float32
accumulators in registers; P and dS are fed from registers) and keep the softmax in base 2
with the 1/sqrt(d) scale folded into one multiply-add an element.

- forward: S = Q K^T, online softmax, O += P V; rescaled once at the end. Writes O and the
  logsumexp (natural units, [batch, heads, seq] float32), the contract of flash.py. By
  default the two compute warpgroups take turns (ping-pong: one's matmuls run while the
  other computes its softmax); see forward's schedules.
- backward: P recomputed from the logsumexp. dK/dV: per key tile, over the query blocks of
  every query head of its GQA group: dV += P^T dO, dK += dS^T Q with dS = P * (dP - D).
  At head_dim 128 the same pass adds dQ: the two warpgroups share their dS through shared
  memory, each computes dS^T K for half of dQ's columns over the tile's 128 keys and leaves
  it in shared memory, and the memory warpgroup sends both halves into a float32 buffer
  with TMA's reduce-add (5 matmuls a block). At head_dim 64 the two warpgroups take the
  steps in turn, each computing all of dQ's columns over the tile's 128 keys at its steps
  (DQ_SPLITS), one part a step reduce-added alike. At 256 (_dkdv_wide) a CTA holds 64
  keys, each warpgroup computes S and dP for 32 of them and shares P and dS through shared
  memory, and accumulates dK and dV for half of the columns; a second pass, per query block
  over key blocks, recomputes P for dQ += dS K (7 matmuls a block in all). D = rowsum(dO * O)
  (minus the logsumexp's cotangent) comes from XLA.
- causal: a warpgroup visits only the blocks that its rows can see and masks only those the
  diagonal crosses; a warpgroup that needs fewer blocks than its partner still waits for and
  releases the slots it skips, so the ring keeps turning (the fused backward's warpgroups
  take the same blocks, the partner's first one fully masked, since dQ needs both halves).
- segment ids (packed documents): each block's other side brings its segment ids through
  the ring (the keys' in the forward and dQ, the queries' in dK/dV). Where the ids are
  sorted along the sequence (packed documents) a tile streams only the span of blocks that
  hold its documents (segment_spans, computed by XLA before the kernel and read by each
  CTA): the blocks between documents are skipped, so that the work follows the documents'
  own squares, not the window's. A tile of one document masks by segment only the span's
  edge blocks; the blocks wholly inside its document (the span's dense run) run as a
  segment-free tile's do. With unsorted ids every block is streamed, each masked. Up to
  SORT_WAVES waves of tiles the CTAs launch sorted by their spans' lengths (sort_window,
  sorted_launch), so that the SMs end together.

Limits (the caller falls back to the Triton kernels otherwise): bfloat16/float16, head_dim a
multiple of 64 up to 256 for the forward (above 128 in key blocks of 64) and up to 128, or
256, for the backward, lengths a multiple of the blocks (see supported).
Off the GPU the kernels run under Mosaic GPU's interpreter (slow; for tests), where the
matmuls are plain dots and register layouts do not exist; it has no TMA reduce-add, so
there the fused backward writes each key tile's partial dQ and XLA sums them.

The code: pipeline.py (the pieces every kernel uses: the ring, the streams, the launch
order), forward_kernel.py (forward and its schedules), backward_kernels.py (the dK/dV and dQ
passes and backward).
"""

from bpt.ops.kernels.attention_hopper.backward_kernels import backward, check_gqa
from bpt.ops.kernels.attention_hopper.forward_kernel import (
    SCHEDULES,
    check_persistent,
    check_schedule,
    default_schedule,
    forward,
    forward_block_k,
    persistent_ctas,
    persistent_order,
)
from bpt.ops.kernels.attention_hopper.pipeline import (
    BLOCKS,
    COMPUTE_WGS,
    DQ_SPLIT,
    DQ_SPLITS,
    GQA_SPLITS,
    MAX_FUSED_HEAD_DIM,
    MAX_HEAD_DIM_BLOCK_128,
    QUERY_ORDER,
    QUERY_ORDERS,
    SORT_WAVES,
    SORT_WINDOW,
    TILE,
    TILE_GROUP,
    check_dq_split,
    check_query_order,
    check_sort_window,
    check_tile_group,
    default_stages,
    interpret_params,
    is_hopper,
    key_spans,
    launch_order,
    profiled,
    query_spans,
    sorted_launch,
    supported,
)

__all__ = [
    "BLOCKS",
    "COMPUTE_WGS",
    "DQ_SPLIT",
    "DQ_SPLITS",
    "GQA_SPLITS",
    "MAX_FUSED_HEAD_DIM",
    "MAX_HEAD_DIM_BLOCK_128",
    "QUERY_ORDER",
    "QUERY_ORDERS",
    "SCHEDULES",
    "SORT_WAVES",
    "SORT_WINDOW",
    "TILE",
    "TILE_GROUP",
    "backward",
    "check_dq_split",
    "check_gqa",
    "check_persistent",
    "check_query_order",
    "check_schedule",
    "check_sort_window",
    "check_tile_group",
    "default_schedule",
    "default_stages",
    "forward",
    "forward_block_k",
    "interpret_params",
    "is_hopper",
    "key_spans",
    "launch_order",
    "persistent_ctas",
    "persistent_order",
    "profiled",
    "query_spans",
    "sorted_launch",
    "supported",
]
