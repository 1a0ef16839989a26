"""Materialized softmax attention: the ground truth every fast path is tested against.

Shared pieces live here too: argument checks, grouping query heads for GQA/MQA, and the
causal / segment mask, so that every implementation interprets its inputs identically.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array
SegmentIds = Array | tuple[Array, Array] | None


class Partial(NamedTuple):
    """Attention over part of the keys: out [batch, q_len, heads, head_dim] float32, normalized
    over that part; lse [batch, heads, q_len] float32, -inf for a row that saw no key there.
    Partials over disjoint parts merge exactly (logsumexp_merge): decoding splits the cache so."""

    out: Array
    lse: Array


def check_qkv(q: Array, k: Array, v: Array) -> None:
    """Validates the [batch, seq, heads, head_dim] layout and the GQA head ratio."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            "attention expects q, k, v of shape [batch, seq, heads, head_dim]; got "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {k.shape} and {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k disagree in batch or head_dim: {q.shape} vs {k.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"the number of query heads ({q.shape[2]}) must be a multiple of the number of "
            f"key/value heads ({k.shape[2]})"
        )


def split_segment_ids(segment_ids: SegmentIds, q_len: int, kv_len: int):
    """Returns (q_segment_ids, kv_segment_ids), each [batch, len] int, or (None, None).

    `segment_ids` is one [batch, seq] array for self-attention (q_len == kv_len) or a pair
    (q_segment_ids, kv_segment_ids). Tokens attend only to tokens of the same segment.
    """
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        q_seg, kv_seg = segment_ids
    else:
        if q_len != kv_len:
            raise ValueError(
                "a single segment_ids array needs q and k of the same length; pass a pair "
                f"(q_segment_ids, kv_segment_ids) for lengths {q_len} and {kv_len}"
            )
        q_seg = kv_seg = segment_ids
    if q_seg.ndim != 2 or q_seg.shape[1] != q_len or kv_seg.ndim != 2 or kv_seg.shape[1] != kv_len:
        raise ValueError(
            f"segment_ids must be [batch, seq]; got {q_seg.shape} for queries of length {q_len} "
            f"and {kv_seg.shape} for keys of length {kv_len}"
        )
    return q_seg, kv_seg


def group_heads(q: Array, num_kv_heads: int) -> Array:
    """[b, s, h, d] -> [b, s, h_kv, h // h_kv, d]: query heads grouped by the K/V head they share."""
    b, s, h, d = q.shape
    return q.reshape(b, s, num_kv_heads, h // num_kv_heads, d)


def attention_mask(q_pos, k_pos, q_seg, k_seg, causal: bool):
    """Boolean mask broadcastable to scores [b, h_kv, group, q, k], or None when all is visible.

    q_pos [q] and k_pos [k] are absolute positions (causal: a query sees keys at positions <= its
    own); q_seg [b, q] and k_seg [b, k] are segment ids or None.
    """
    mask = None
    if causal:
        mask = (q_pos[:, None] >= k_pos[None, :])[None]
    if q_seg is not None:
        same = q_seg[:, :, None] == k_seg[:, None, :]
        mask = same if mask is None else mask & same
    return None if mask is None else mask[:, None, None]


def reference_attention(
    q: Array, k: Array, v: Array, *, causal: bool = False, segment_ids: SegmentIds = None
) -> Array:
    """Softmax(q k^T / sqrt(d)) v with the full score matrix materialized.

    Args:
      q: [batch, q_len, heads, head_dim].
      k, v: [batch, kv_len, kv_heads, head_dim]; heads % kv_heads == 0 (GQA/MQA).
      causal: query i sees keys j <= i + (kv_len - q_len) (aligned at the end).
      segment_ids: [batch, seq] int, or a pair (q_segment_ids, kv_segment_ids).
    Returns:
      [batch, q_len, heads, head_dim] in q's dtype. A query with no visible key gives zeros.
    """
    check_qkv(q, k, v)
    q_len, kv_len = q.shape[1], k.shape[1]
    q_seg, kv_seg = split_segment_ids(segment_ids, q_len, kv_len)
    q_pos = jnp.arange(q_len) + (kv_len - q_len)
    mask = attention_mask(q_pos, jnp.arange(kv_len), q_seg, kv_seg, causal)
    return masked_attention(q, k, v, mask)


def masked_attention(q: Array, k: Array, v: Array, mask: Array | None) -> Array:
    """Materialized softmax attention under a boolean mask (see attention_mask).

    Scores and softmax in float32. A query whose keys are all masked gives zeros.
    """
    num_kv_heads, head_dim = k.shape[2], q.shape[3]
    scores = jnp.einsum(
        "bqhgd,bkhd->bhgqk", group_heads(q, num_kv_heads), k, preferred_element_type=jnp.float32
    ) / math.sqrt(head_dim)
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)
    # Softmax is invariant to the shift, so the max needs no gradient; rows with nothing
    # visible have max -inf and are shifted by 0 instead, which makes all their weights 0.
    row_max = jax.lax.stop_gradient(scores.max(axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(scores - row_max)
    denom = weights.sum(axis=-1, keepdims=True)
    weights = weights / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(q.shape).astype(q.dtype)


def logsumexp_merge(out: Array, lse: Array, out_t: Array, lse_t: Array) -> tuple[Array, Array]:
    """Two attentions over disjoint key sets, each normalized over its own keys, merged into
    the attention over both: out [b, s, h, d] (float32; out_t any dtype), lse [b, h, s]
    float32 with -inf for a row that saw no key."""
    new = jnp.logaddexp(lse, lse_t)
    safe = jnp.where(jnp.isfinite(new), new, 0.0)
    weight = lambda stats: jnp.swapaxes(jnp.exp(stats - safe), 1, 2)[..., None]  # noqa: E731
    return out * weight(lse) + out_t.astype(jnp.float32) * weight(lse_t), new
