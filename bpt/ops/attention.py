"""One entry point for attention: attention(q, k, v, *, impl=..., causal=..., segment_ids=...),
and the registries its implementations live in (bpt.ops.registry): ATTENTION, whose auto
(select_impl) is resolved from one device's shapes, and MERGED, the implementations that
return a piece's output and logsumexp for a merge (context parallelism's hops).

| impl        | memory      | where                    | takes segment_ids |
|-------------|-------------|--------------------------|-------------------|
| reference   | O(seq^2)    | anywhere                 | yes               |
| blockwise   | O(seq)      | anywhere                 | yes               |
| cudnn       | O(seq)      | NVIDIA GPU, bf16/fp16    | no                |
| pallas      | O(seq)      | NVIDIA GPU (Mosaic GPU kernels on H100-class GPUs where they
|             |             | take the inputs, else Triton); elsewhere interpret mode (tests) | yes |
| auto        | on an H100-class GPU, pallas for bf16/fp16 inputs that the Mosaic GPU
|             | kernels take, forward and backward, where they were measured faster than
|             | cuDNN (LEADS: causal at head_dim 128 up to 128K tokens and one 128K
|             | sequence of 16 heads' work, at 64 up to 16K and one 16K sequence of 32
|             | heads', at both up to one 4K sequence's; causal or not at 256 up to 64K
|             | tokens and one 64K sequence of 8 heads'; non-causal at 128 up to one 64K
|             | sequence of 16 heads'); on
|             | a GPU otherwise cudnn where it supports
|             | the inputs, else pallas for bf16/fp16 (segment ids); off the GPU blockwise
|             | (reference when one chunk covers it) |

An implementation named explicitly runs where it takes the inputs and is an error
elsewhere (never replaced by another).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bpt.ops.blockwise import blockwise_attention, blockwise_backward, blockwise_forward
from bpt.ops.kernels import attention_hopper
from bpt.ops.kernels.attention import flash_attention, flash_backward, flash_forward
from bpt.ops.reference import SegmentIds, check_qkv, reference_attention, split_segment_ids
from bpt.ops.registry import Implementation, Registry

Array = jax.Array
# Where bpt's Hopper kernels run attention faster than cuDNN, forward+backward: (most keys a
# sequence, most query-key pairs batch x heads x seq^2, head_dims, masks: "causal" or "any").
# Measured: on an H100 at batch 1, 1.5x at 2K and 1.17x at 4K (the second row; 0.68x
# at batch 8 of 2K then). Since their CTAs launch in runs of one head's tiles
# (attention_hopper.TILE_GROUP), on an H200 at head_dim 128: 1.02-1.06x at GPT-1B's
# micro-batches of 16K tokens (batch 16 of 1K to batch 1 of 16K), 1.01x at 32K and 64K and
# 1.03x at 128K (all of a head's tiles a run), GQA 32/4 and 32/8 1.00x at 4K and 1.00-1.01x
# at 16K (its backward a CTA a query head's keys, gqa="expand"); GPT-1B's whole step
# 1.004-1.009x cuDNN's at 2K-16K, 1.007x at 32K, 0.999x at 64K (the first row; with 4
# key/value heads 0.996x at 8K); 0.99-1.00x non-causal. At head_dim 64, since the backward's
# warpgroups take dQ's steps in turn (attention_hopper.DQ_SPLIT): 1.01-1.03x at 16K with 16
# heads, 1.02x at 8K, 1.06x at 4K, GQA 32/4 1.05x, 1.03x, 1.02x at 4K, 8K, 16K (the third row;
# docs/benchmarks.md, docs/notes/attention_kernels.md). On 2026-12-01, paired in one process
# (docs/notes/step_speed.md): GPT-7B's step at 32K (32 heads of one 32K sequence) 1.008-1.011x
# with them, 0.8 GiB less compiled; GPT-1B's at 128K (the loop, attention_saveable)
# 1.021-1.023x, 0.8 GiB more (their float32 dQ buffer): the first row now reaches one 128K
# sequence of 16 heads' work. Longer, cuDNN stays (not measured; the dQ buffer grows with the
# context the longest runs need memory for).
# At head_dim 256 (attention_hopper.backward_kernels._dkdv_wide, then the dQ pass in blocks of 32 keys), on an
# H200 on 2026-12-01 with 8 heads: causal 1.02x at 4K, 1.07x at 16K, 1.06x at 64K, 1.09x at
# batch 8 of 2K, GQA 16/8 at 16K 1.07x; non-causal 1.09-1.10x at 4K-64K (the last row: causal
# or not, up to one 64K sequence of 8 heads' work; the backward has no float32 dQ buffer there).
# Since its causal forward is pipelined too (2026-12-02): causal 1.05x at 4K, 1.10x at 16K, 1.08x
# at 64K.
# Non-causal at head_dim 128, since the forward pipelines each warpgroup's matmuls and softmax
# there (attention_hopper.default_schedule), on an H200 on 2026-12-02 with 16 heads: 1.04x at
# 4K, 1.02-1.03x at 16K, 1.01x at 64K (the fifth row: up to one 64K sequence of 16 heads').
LEADS = (
    (131072, 16 * 131072**2, (128,), "causal"),
    (4096, 16 * 4096**2, (64, 128), "causal"),
    (16384, 32 * 16384**2, (64,), "causal"),
    (65536, 8 * 65536**2, (256,), "any"),
    (65536, 16 * 65536**2, (128,), "any"),
)
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def cudnn_unsupported_reason(q: Array, k: Array, *, causal: bool, segment_ids: SegmentIds, **chunks) -> str | None:
    """Why cuDNN's fused attention (through jax.nn) cannot take these inputs, or None."""
    if jax.default_backend() != "gpu":
        return f"it needs an NVIDIA GPU and this process runs on {jax.default_backend()!r}"
    if segment_ids is not None:
        return "jax.nn.dot_product_attention takes no segment ids (packed documents)"
    if q.dtype not in _CUDNN_DTYPES:
        return f"it takes bfloat16 or float16 inputs, not {q.dtype}"
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        return f"head_dim must be a multiple of 8 and at most 256, not {q.shape[-1]}"
    if causal and q.shape[1] != k.shape[1]:
        return "causal attention with different query and key lengths is aligned differently"
    return None


def select_impl(
    q: Array, k: Array, *, causal: bool, segment_ids: SegmentIds, q_chunk_size: int, kv_chunk_size: int
) -> str:
    """The implementation impl='auto' runs for these inputs (one device's shapes: the
    thresholds were measured per device) on this platform."""
    pairs = q.shape[0] * q.shape[2] * q.shape[1] * k.shape[1]
    if (
        any(
            k.shape[1] <= keys and pairs <= most and q.shape[-1] in dims and (causal or masks == "any")
            for keys, most, dims, masks in LEADS
        )
        and attention_hopper.is_hopper()
        and attention_hopper.supported(q, k, backward=True) is None
    ):
        return "pallas"
    if cudnn_unsupported_reason(q, k, causal=causal, segment_ids=segment_ids) is None:
        return "cudnn"
    if (
        jax.default_backend() == "gpu"
        and q.dtype in _CUDNN_DTYPES
        and not (causal and q.shape[1] != k.shape[1])
    ):
        return "pallas"  # segment ids, or a head_dim cuDNN does not take (fp32: not measured yet)
    if q.shape[1] <= q_chunk_size and k.shape[1] <= kv_chunk_size:
        return "reference"  # one block: the blockwise loop would compute the same thing
    return "blockwise"


def _reference(q, k, v, *, causal, segment_ids, q_chunk_size, kv_chunk_size):
    return reference_attention(q, k, v, causal=causal, segment_ids=segment_ids)


def _cudnn(q, k, v, *, causal, segment_ids, q_chunk_size, kv_chunk_size):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


def _pallas(fp8: bool):
    def run(q, k, v, *, causal, segment_ids, q_chunk_size, kv_chunk_size):
        return flash_attention(q, k, v, causal=causal, segment_ids=segment_ids, fp8=fp8)

    return run


ATTENTION = Registry(
    "attention",
    [
        Implementation("reference", "materialized scores, O(seq^2) memory; any dtype, segment ids, GQA; anywhere",
                       run=_reference),
        Implementation("blockwise", "online softmax over query and key/value chunks (lax.scan), O(seq) memory; "
                       "any dtype, segment ids, GQA; anywhere", run=blockwise_attention),
        Implementation("cudnn", "cuDNN's fused attention (jax.nn); bf16/fp16, head_dim a multiple of 8 up to "
                       "256, GQA, no segment ids; NVIDIA GPUs", why_not=cudnn_unsupported_reason, run=_cudnn),
        Implementation("pallas", "bpt's FlashAttention-2 kernels (Mosaic GPU on H100-class GPUs where they "
                       "take the inputs, else Triton); segment ids, GQA; GPUs, elsewhere interpret mode",
                       run=_pallas(False)),
        Implementation("pallas_fp8", "the Triton forward with float8_e4m3fn matmuls; chosen by name only",
                       run=_pallas(True), auto=False),
    ],
    select_impl,
)  # fmt: skip
IMPLS = ATTENTION.names


def attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    impl: str = "auto",
    causal: bool = False,
    segment_ids: SegmentIds = None,
    q_chunk_size: int = 512,
    kv_chunk_size: int = 512,
) -> Array:
    """Softmax attention on [batch, seq, heads, head_dim] inputs by the chosen implementation.

    Every implementation computes the same function (see bpt.ops.reference_attention); the
    chunk sizes are used by the blockwise implementation and ignored by the others (the
    Pallas kernel picks its own blocks).
    """
    check_qkv(q, k, v)
    settings = dict(causal=causal, segment_ids=segment_ids, q_chunk_size=q_chunk_size, kv_chunk_size=kv_chunk_size)
    return ATTENTION[ATTENTION.resolve(impl, q, k, **settings)].run(q, k, v, **settings)


# Attention whose partial results merge: each piece (a ring hop's key/value shard) returns
# its output and logsumexp, and takes its share of the merged attention's gradient. Queries
# sit at q_offset + i against keys at j (q_offset=-1: causal without the diagonal).


def _pallas_forward(q, k, v, *, causal, q_offset, segment_ids, q_chunk_size, kv_chunk_size):
    if not q_offset:
        return flash_forward(q, k, v, causal=causal, segment_ids=segment_ids)
    q_up, segments = _queries_up(q, k, segment_ids, q_offset)
    out, lse = flash_forward(q_up, k, v, causal=causal, segment_ids=segments)
    # query i >= 1 was row i - 1; query 0 sees no key (lse +inf: the kernels' "sees nothing")
    return _set_row(jnp.roll(out, 1, axis=1), 0, 0.0), _set_row(jnp.roll(lse, 1, axis=2), 0, jnp.inf, axis=2)


def _pallas_backward(q, k, v, out, lse, d_out, d_lse, *, causal, q_offset, segment_ids, q_chunk_size, kv_chunk_size):
    if not q_offset:
        dq, dk, dv = flash_backward(q, k, v, out, lse, d_out, d_lse, causal=causal, segment_ids=segment_ids)
        return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)

    # As the forward. The last row (query 0, which sees no key here) gets zero probabilities
    # (lse +inf) and no cotangent: it adds nothing to dK/dV.
    def rows(x, value, axis=1):
        return _set_row(jnp.roll(x, -1, axis=axis), -1, value, axis)

    q_up, segments = _queries_up(q, k, segment_ids, q_offset)
    dq, dk, dv = flash_backward(
        q_up, k, v, rows(out, 0.0), rows(lse, jnp.inf, 2), rows(d_out, 0.0), rows(d_lse, 0.0, 2),
        causal=causal, segment_ids=segments,
    )  # fmt: skip
    dq = _set_row(jnp.roll(dq, 1, axis=1), 0, 0.0)
    return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)


def _queries_up(q, k, segment_ids, q_offset: int):
    """Causal attention without the diagonal (q_offset=-1: query i sees keys j < i) as causal
    attention with it, for kernels without an offset: the queries (and their segment ids)
    move one row up, so row r holds query r + 1 and sees keys j <= r; the last row holds
    query 0, which sees no key, and its result is dropped. The keys stay where they are, so
    kernels with only the causal mask (cuDNN's, bpt's Hopper kernels without segment ids) run
    such a hop. The last row's segment id is one above every id, so that it sees no key and
    sorted ids stay sorted (the kernels then skip the blocks between documents). Returns (q,
    segment_ids)."""
    if q_offset != -1:
        raise ValueError(f"the kernels take q_offset 0 or -1; got {q_offset}")
    q_seg, kv_seg = split_segment_ids(segment_ids, q.shape[1], k.shape[1])
    segments = None
    if q_seg is not None:
        above = jnp.maximum(q_seg.max(axis=1), kv_seg.max(axis=1)) + 1
        segments = (_set_row(jnp.roll(q_seg, -1, axis=1), -1, above), kv_seg)
    return jnp.roll(q, -1, axis=1), segments


def _set_row(x, index: int, value, axis: int = 1):
    """x with row `index` along `axis` set to value."""
    return x.at[(slice(None),) * axis + (index,)].set(value)


def select_merged(q: Array, *args, **settings) -> str:
    """auto for merged attention: the kernels on a GPU for 16-bit inputs, else the scan."""
    return "pallas" if jax.default_backend() == "gpu" and jnp.dtype(q.dtype).itemsize == 2 else "blockwise"


MERGED = Registry(
    "merged attention (a piece's output and logsumexp)",
    [
        Implementation("blockwise", "the blockwise scan's forward and backward; any dtype, segment ids, GQA; "
                       "anywhere", forward=blockwise_forward, backward=blockwise_backward),
        Implementation("pallas", "bpt's Triton FlashAttention-2 kernels; segment ids, GQA; GPUs, elsewhere "
                       "interpret mode", forward=_pallas_forward, backward=_pallas_backward),
    ],
    select_merged,
)  # fmt: skip
