"""Attention of new queries over a key/value cache, for autoregressive decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bpt.ops.reference import attention_mask, check_qkv, masked_attention

Array = jax.Array


def decode_attention(q: Array, k_cache: Array, v_cache: Array, q_positions: Array) -> Array:
    """Queries at absolute positions attend to cached keys at positions <= their own.

    Args:
      q: [batch, q_len, heads, head_dim], the newest tokens' queries (q_len is usually 1).
      k_cache, v_cache: [batch, max_len, kv_heads, head_dim]; slot i holds position i. Slots
        past the newest position may hold anything: they are masked.
      q_positions: [q_len] int, the queries' positions.
    Returns:
      [batch, q_len, heads, head_dim] in q's dtype.
    """
    check_qkv(q, k_cache, v_cache)
    mask = attention_mask(q_positions, jnp.arange(k_cache.shape[1]), None, None, causal=True)
    return masked_attention(q, k_cache, v_cache, mask)
