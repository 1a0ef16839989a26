"""Blockwise attention (Liu & Abbeel, 2023): exact softmax attention in memory linear in seq.

The queries are cut into chunks and scanned; each query chunk loops over key/value chunks
with an online softmax (running max m, row sum of exponentials and unnormalized numerator acc), so no
[q_len, kv_len] score matrix ever exists. One query chunk's attention is a custom_vjp whose
backward is FlashAttention-2's: it recomputes each score block from the saved logsumexp
instead of storing probabilities, so forward and backward memory are both linear in seq.

Packed documents (segment ids, the keys' sorted): a query chunk visits only the key/value
chunks that hold its documents. Causal: a query chunk visits key/value chunks only up to
the diagonal. When the chunk's
offset is a Python int (the unrolled loop) the bounds are static and XLA's cost analysis
sees the skipped FLOPs; inside lax.scan the offset is traced and the loop over key/value
chunks has a dynamic trip count, which skips the same work at run time.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import einops
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from bpt.ops.chunked import from_chunks, resolve_chunk_size, to_chunks
from bpt.ops.reference import SegmentIds, attention_mask, check_qkv, group_heads, split_segment_ids
from bpt.ops.remat import ATTENTION_LSE, ATTENTION_OUT
from bpt.ops.segments import segment_spans

Array = jax.Array


class _ChunkSpec(NamedTuple):
    """Static description of one query chunk's attention (hashable: a custom_vjp nondiff arg)."""

    causal: bool
    kv_chunk_size: int
    q_offset: int  # position of query 0 minus position of key 0
    static_q_start: int | None  # the chunk's first query index when known at trace time
    unroll: bool


def _kv_chunk_bounds(spec: _ChunkSpec, q_start, q_chunk_size: int, kv_len: int, q_seg=None, kv_seg=None):
    """[lo, hi) of the key/value chunks a query chunk must visit: up to the diagonal (causal),
    and, with segment ids whose keys' are sorted (packed documents), only the chunks that
    hold its documents (segment_spans; over the batch, the union of its rows')."""
    lo, hi = _causal_chunk_bounds(spec, q_start, q_chunk_size, kv_len)
    if q_seg is None:
        return lo, hi
    chunk = spec.kv_chunk_size
    spans = segment_spans(q_seg, kv_seg, rows=q_seg.shape[1], cols=chunk, causal=False, min_blocks=0)
    lo = jnp.maximum(lo, spans[:, 0, 0].min())
    return lo, jnp.maximum(jnp.minimum(hi, spans[:, 0, 1].max()), lo)


def _causal_chunk_bounds(spec: _ChunkSpec, q_start, q_chunk_size: int, kv_len: int):
    num_kv_chunks = kv_len // spec.kv_chunk_size
    if not spec.causal:
        return 0, num_kv_chunks
    last_key = spec.q_offset + q_start + q_chunk_size - 1  # seen by the chunk's last query
    if isinstance(q_start, int):
        return 0, max(0, min(num_kv_chunks, last_key // spec.kv_chunk_size + 1))
    return 0, jnp.clip(last_key // spec.kv_chunk_size + 1, 0, num_kv_chunks)


def _fori(spec: _ChunkSpec, lo, hi, body, init):
    # fori_loop accepts unroll only for static bounds (it then lowers to a scan).
    static = isinstance(lo, int) and isinstance(hi, int)
    return jax.lax.fori_loop(lo, hi, body, init, unroll=spec.unroll if static else None)


def _score_block(spec, qg, k, kv_seg, q_pos, q_seg, j):
    """Scaled, masked scores of the query chunk against key chunk j: [b, h_kv, g, cq, ck]."""
    ck = spec.kv_chunk_size
    k_j = jax.lax.dynamic_slice_in_dim(k, j * ck, ck, axis=1).astype(qg.dtype)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k_j, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(qg.shape[-1])
    k_seg = None if kv_seg is None else jax.lax.dynamic_slice_in_dim(kv_seg, j * ck, ck, axis=1)
    mask = attention_mask(q_pos, j * ck + jnp.arange(ck), q_seg, k_seg, spec.causal)
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)
    return scores, k_j


def _chunk_forward(spec, q, k, v, q_seg, kv_seg, q_start):
    b, cq, h, d = q.shape
    num_kv_heads = k.shape[2]
    ck = spec.kv_chunk_size
    qg = group_heads(q, num_kv_heads)
    q_pos = spec.q_offset + q_start + jnp.arange(cq)

    def body(j, carry):
        m, row_sum, acc = carry
        scores, _ = _score_block(spec, qg, k, kv_seg, q_pos, q_seg, j)
        v_j = jax.lax.dynamic_slice_in_dim(v, j * ck, ck, axis=1).astype(q.dtype)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        # A row that has seen no visible key yet keeps m = -inf; shifting it by 0 instead
        # gives exp(-inf) = 0 for every weight rather than NaN.
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(scores - shift[..., None])
        correction = jnp.exp(m - shift)
        row_sum = row_sum * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum(
            "bhgqk,bkhd->bhgqd", p.astype(q.dtype), v_j, preferred_element_type=jnp.float32
        )
        return m_new, row_sum, acc

    stats_shape = (b, num_kv_heads, h // num_kv_heads, cq)
    init = (
        jnp.full(stats_shape, -jnp.inf, jnp.float32),
        jnp.zeros(stats_shape, jnp.float32),
        jnp.zeros(stats_shape + (d,), jnp.float32),
    )
    lo, hi = _kv_chunk_bounds(spec, q_start, cq, k.shape[1], q_seg, kv_seg)
    m, row_sum, acc = _fori(spec, lo, hi, body, init)
    seen = row_sum > 0
    out = acc / jnp.where(seen, row_sum, 1.0)[..., None]
    out = jnp.einsum("bhgqd->bqhgd", out).reshape(b, cq, h, d).astype(q.dtype)
    # Rows with no visible key get lse = +inf, so the backward's exp(s - lse) is exactly 0.
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, row_sum, 1.0)), jnp.inf)
    return out, lse.reshape(b, h, cq)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunk_attention(spec, q, k, v, q_seg, kv_seg, q_start):
    start = spec.static_q_start if spec.static_q_start is not None else q_start
    return _chunk_forward(spec, q, k, v, q_seg, kv_seg, start)


def _chunk_attention_fwd(spec, q, k, v, q_seg, kv_seg, q_start):
    out, lse = _chunk_attention(spec, q, k, v, q_seg, kv_seg, q_start)
    # Named, so that a remat policy can keep them (bpt.ops.remat: attention_saveable).
    out, lse = checkpoint_name(out, ATTENTION_OUT), checkpoint_name(lse, ATTENTION_LSE)
    return (out, lse), (q, k, v, q_seg, kv_seg, q_start, out, lse)


def _chunk_attention_bwd(spec, residuals, cotangents):
    q, k, v, q_seg, kv_seg, q_start, out, lse = residuals
    start = spec.static_q_start if spec.static_q_start is not None else q_start
    dq, dk, dv = _chunk_backward(spec, q, k, v, q_seg, kv_seg, start, out, lse, *cotangents)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


def _chunk_backward(spec, q, k, v, q_seg, kv_seg, start, out, lse, d_out, d_lse):
    """FlashAttention-2's backward of one query chunk: (dq, dk, dv) in float32, dk and dv over
    all keys. out and lse may be those of a larger attention this chunk's keys are part of (a
    ring's merged result): the gradient is then this key range's share of that attention's."""
    b, cq, h, d = q.shape
    num_kv_heads = k.shape[2]
    ck = spec.kv_chunk_size
    qg = group_heads(q, num_kv_heads)
    dog = group_heads(d_out.astype(q.dtype), num_kv_heads)
    stats_shape = (b, num_kv_heads, h // num_kv_heads, cq)
    lse = lse.reshape(stats_shape)
    d_lse = d_lse.reshape(stats_shape).astype(jnp.float32)
    # D = rowsum(dO * O): the softmax's Jacobian term, shared by every key chunk.
    delta = jnp.einsum(
        "bqhgd,bqhgd->bhgq", dog.astype(jnp.float32), group_heads(out, num_kv_heads).astype(jnp.float32)
    )
    q_pos = spec.q_offset + start + jnp.arange(cq)

    def body(j, carry):
        dq, dk, dv = carry
        scores, k_j = _score_block(spec, qg, k, kv_seg, q_pos, q_seg, j)
        v_j = jax.lax.dynamic_slice_in_dim(v, j * ck, ck, axis=1).astype(q.dtype)
        p = jnp.exp(scores - lse[..., None])
        dv_j = jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(q.dtype), dog, preferred_element_type=jnp.float32)
        dp = jnp.einsum("bqhgd,bkhd->bhgqk", dog, v_j, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta[..., None] + d_lse[..., None])).astype(q.dtype)
        dq = dq + jnp.einsum("bhgqk,bkhd->bqhgd", ds, k_j, preferred_element_type=jnp.float32)
        dk_j = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qg, preferred_element_type=jnp.float32)
        dk = jax.lax.dynamic_update_slice_in_dim(dk, dk_j, j * ck, axis=1)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, dv_j, j * ck, axis=1)
        return dq, dk, dv

    init = (
        jnp.zeros(qg.shape, jnp.float32),
        jnp.zeros(k.shape, jnp.float32),
        jnp.zeros(v.shape, jnp.float32),
    )
    lo, hi = _kv_chunk_bounds(spec, start, cq, k.shape[1], q_seg, kv_seg)
    dq, dk, dv = _fori(spec, lo, hi, body, init)
    scale = 1.0 / math.sqrt(d)
    return (dq * scale).reshape(q.shape), dk * scale, dv


_chunk_attention.defvjp(_chunk_attention_fwd, _chunk_attention_bwd)


def gradient_carrier(x: Array) -> Array:
    """Upcasts K or V to at least float32 before a scan over query chunks.

    The scan sums each query chunk's dK and dV; doing that in bfloat16 would lose precision
    with every chunk. The per-block matmuls still run in the query's dtype.
    """
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def attend_query_chunk(
    q: Array,
    k: Array,
    v: Array,
    q_start: int | Array,
    *,
    causal: bool = False,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    kv_chunk_size: int = 512,
    q_offset: int = 0,
    unroll: bool = False,
) -> tuple[Array, Array]:
    """Exact attention of one query chunk over all keys, one key/value chunk at a time.

    Args:
      q: [batch, q_chunk, heads, head_dim]; the chunk's queries, computed in q's dtype.
      k, v: [batch, kv_len, kv_heads, head_dim]; all keys and values (any float dtype).
      q_start: index of the chunk's first query in the full query sequence; a Python int
        gives static loop bounds, a traced int a dynamic trip count.
      causal: query at position p sees keys at positions <= p (positions: q_offset + index
        for queries, index for keys).
      q_segment_ids, kv_segment_ids: [batch, q_chunk] and [batch, kv_len] ints, or None.
      kv_chunk_size: keys per inner step; must divide kv_len.
    Returns:
      out [batch, q_chunk, heads, head_dim] in q's dtype and the logsumexp of each query's
      scores, [batch, heads, q_chunk] float32 (+inf where a query sees no key). Both are
      differentiable.
    """
    check_qkv(q, k, v)
    kv_chunk_size = resolve_chunk_size(kv_chunk_size, k.shape[1], "kv_chunk_size")
    static = q_start if isinstance(q_start, int) else None
    spec = _ChunkSpec(causal, kv_chunk_size, q_offset, static, bool(unroll))
    traced_start = None if static is not None else jnp.asarray(q_start, jnp.int32)
    return _chunk_attention(spec, q, k, v, q_segment_ids, kv_segment_ids, traced_start)


def blockwise_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    causal: bool = False,
    segment_ids: SegmentIds = None,
    q_chunk_size: int = 512,
    kv_chunk_size: int = 512,
    unroll: bool = False,
) -> Array:
    """Exact softmax attention computed chunk by chunk; memory linear in sequence length.

    Args:
      q: [batch, q_len, heads, head_dim].
      k, v: [batch, kv_len, kv_heads, head_dim]; heads % kv_heads == 0 (GQA/MQA, no copies).
      causal: query i sees keys j <= i + (kv_len - q_len).
      segment_ids: [batch, seq] ints (tokens attend within their segment), or a pair
        (q_segment_ids, kv_segment_ids).
      q_chunk_size, kv_chunk_size: chunk lengths; each must divide its sequence length
        (values above the length are clamped to it).
      unroll: unroll both loops at trace time. Compiles slower; lets XLA see every block,
        which is what its cost analysis needs to count the causally skipped blocks.
    Returns:
      [batch, q_len, heads, head_dim] in q's dtype, equal to reference_attention's output.
    """
    check_qkv(q, k, v)
    q_len, kv_len = q.shape[1], k.shape[1]
    q_chunk_size = resolve_chunk_size(q_chunk_size, q_len, "q_chunk_size")
    kv_chunk_size = resolve_chunk_size(kv_chunk_size, kv_len, "kv_chunk_size")
    q_seg, kv_seg = split_segment_ids(segment_ids, q_len, kv_len)
    attend = functools.partial(
        attend_query_chunk,
        causal=causal,
        kv_segment_ids=kv_seg,
        kv_chunk_size=kv_chunk_size,
        q_offset=kv_len - q_len,
        unroll=unroll,
    )
    k, v = gradient_carrier(k), gradient_carrier(v)
    if unroll:
        outs = []
        for start in range(0, q_len, q_chunk_size):
            window = slice(start, start + q_chunk_size)
            seg = None if q_seg is None else q_seg[:, window]
            outs.append(attend(q[:, window], k, v, start, q_segment_ids=seg)[0])
        return jnp.concatenate(outs, axis=1)

    def step(carry, chunk):
        start, q_i, seg_i = chunk
        return carry, attend(q_i, k, v, start, q_segment_ids=seg_i)[0]

    starts = jnp.arange(0, q_len, q_chunk_size)
    seg_chunks = None if q_seg is None else to_chunks(q_seg, q_chunk_size)
    _, outs = jax.lax.scan(step, None, (starts, to_chunks(q, q_chunk_size), seg_chunks))
    return from_chunks(outs)


def _chunked_spec_and_segments(q, k, *, causal, q_offset, segment_ids, q_chunk_size, kv_chunk_size):
    check_qkv(q, k, k)
    q_chunk_size = resolve_chunk_size(q_chunk_size, q.shape[1], "q_chunk_size")
    kv_chunk_size = resolve_chunk_size(kv_chunk_size, k.shape[1], "kv_chunk_size")
    q_seg, kv_seg = split_segment_ids(segment_ids, q.shape[1], k.shape[1])
    spec = _ChunkSpec(causal, kv_chunk_size, q_offset, None, False)
    seg_chunks = None if q_seg is None else to_chunks(q_seg, q_chunk_size)
    starts = jnp.arange(0, q.shape[1], q_chunk_size)
    return spec, q_chunk_size, starts, seg_chunks, kv_seg


def blockwise_forward(
    q: Array,
    k: Array,
    v: Array,
    *,
    causal: bool = False,
    q_offset: int = 0,
    segment_ids: SegmentIds = None,
    q_chunk_size: int = 512,
    kv_chunk_size: int = 512,
) -> tuple[Array, Array]:
    """(out, lse) of blockwise attention, not differentiable: one half of a custom_vjp that
    merges several attentions (ring attention). Query i is at position q_offset + i, key j at
    j (causal: i sees j <= q_offset + i; q_offset=-1 leaves out the diagonal).

    Returns out [batch, q_len, heads, head_dim] in q's dtype and lse [batch, heads, q_len]
    float32, +inf where a query sees no key.
    """
    spec, cq, starts, seg_chunks, kv_seg = _chunked_spec_and_segments(
        q,
        k,
        causal=causal,
        q_offset=q_offset,
        segment_ids=segment_ids,
        q_chunk_size=q_chunk_size,
        kv_chunk_size=kv_chunk_size,
    )

    def step(carry, chunk):
        start, q_i, seg_i = chunk
        return carry, _chunk_forward(spec, q_i, k, v, seg_i, kv_seg, start)

    _, (outs, lses) = jax.lax.scan(step, None, (starts, to_chunks(q, cq), seg_chunks))
    return from_chunks(outs), einops.rearrange(lses, "n b h c -> b h (n c)")


def blockwise_backward(
    q: Array,
    k: Array,
    v: Array,
    out: Array,
    lse: Array,
    d_out: Array,
    d_lse: Array,
    *,
    causal: bool = False,
    q_offset: int = 0,
    segment_ids: SegmentIds = None,
    q_chunk_size: int = 512,
    kv_chunk_size: int = 512,
) -> tuple[Array, Array, Array]:
    """(dq, dk, dv), float32, of the attention blockwise_forward computes, given its cotangents
    d_out and d_lse. out and lse may be those of a larger attention these keys are part of
    (ring attention's merged result): the gradients are then this key range's share of it."""
    spec, cq, starts, seg_chunks, kv_seg = _chunked_spec_and_segments(
        q,
        k,
        causal=causal,
        q_offset=q_offset,
        segment_ids=segment_ids,
        q_chunk_size=q_chunk_size,
        kv_chunk_size=kv_chunk_size,
    )
    chunk_lse = lambda x: einops.rearrange(x, "b h (n c) -> n b h c", c=cq)  # noqa: E731

    def step(carry, chunk):
        dk, dv = carry
        start, q_i, seg_i, o_i, l_i, do_i, dl_i = chunk
        dq_i, dk_i, dv_i = _chunk_backward(spec, q_i, k, v, seg_i, kv_seg, start, o_i, l_i, do_i, dl_i)
        return (dk + dk_i, dv + dv_i), dq_i

    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    xs = (
        starts,
        to_chunks(q, cq),
        seg_chunks,
        to_chunks(out, cq),
        chunk_lse(lse),
        to_chunks(d_out, cq),
        chunk_lse(d_lse),
    )
    (dk, dv), dq = jax.lax.scan(step, zeros, xs)
    return from_chunks(dq), dk, dv
