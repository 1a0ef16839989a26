"""Attention of new queries over a key/value cache, for autoregressive decoding.

Decoding reads the whole cache for every new token: it is bound by memory bandwidth, not by
arithmetic. Every implementation here takes the same arguments and returns the same result:

- reference: the scores over every slot materialized, one softmax (XLA).
- split_kv: flash-decoding in plain JAX. The cache is cut into chunks; each chunk gives a
  partial softmax (float32 row max, sum and weighted values, kept as a normalized output and
  its logsumexp), and the partials are merged by logsumexp. Runs anywhere.
- pallas: bpt's decode kernel (bpt.ops.kernels.decode): split-KV over the SMs, the query
  heads of a GQA group sharing one read of their K/V head, the cache read in place, ragged
  batches balanced by stream-K tiles (each program computes its own). On a GPU it lowers
  through Triton; elsewhere it runs in Pallas interpret mode (slow, for tests).
- auto: the pallas kernel on a GPU while the rows a K/V head's program takes (q_len x the
  query heads a K/V head serves) stay few (AUTO_KERNEL_ROWS: new tokens, not a prompt's
  chunk), head_dim is a power of two and the cache's slots are a multiple of 16 (the
  kernel's smallest block); split_kv otherwise. On one H100 the kernel reads the
  cache at 2.4-3.0 TB/s from 128K slots on (1.0-1.1x cuDNN), up to 3.2x split_kv
  (docs/notes/decoding.md).

Partial and attend_cache (one partial softmax by any implementation) serve tree decoding
across devices too (bpt.parallel.tree), which merges one partial per device.

The implementations live in the registry DECODE (bpt.ops.registry): each declares what it
takes and its partial softmax (forward); an implementation named explicitly is never
replaced by another.

Every implementation also reads an int8 cache (quantize_kv: each token's key or value of one
head scaled by its absolute maximum / 127) given its k_scale and v_scale, and a model's whole
cache as one [layers, ...] stack given a layer index.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from bpt.ops.kernels.decode import MIN_BLOCK_K, decode_partial
from bpt.ops.reference import Partial, check_qkv, group_heads, logsumexp_merge, masked_attention
from bpt.ops.registry import Implementation, Registry

Array = jax.Array
AUTO_KERNEL_ROWS = 64  # auto takes the kernel on a GPU while q_len x (heads / kv_heads) is this small


def select_decode(q_shape=None, kv_heads: int = 1, cache_len: int | None = None) -> str:
    """auto for queries of q_shape [batch, q_len, heads, head_dim] over cache_len slots (see
    the module docstring)."""
    if q_shape is None or jax.default_backend() != "gpu":
        return "split_kv"
    _, q_len, heads, head_dim = q_shape
    rows = q_len * heads // kv_heads
    kernel_fits = head_dim >= 16 and not head_dim & (head_dim - 1) and rows <= AUTO_KERNEL_ROWS
    kernel_fits = kernel_fits and (cache_len is None or cache_len % MIN_BLOCK_K == 0)
    return "pallas" if kernel_fits else "split_kv"


def resolve_decode_impl(impl: str, *, q_shape=None, kv_heads: int = 1, cache_len: int | None = None) -> str:
    """impl checked, with auto resolved (DECODE.resolve)."""
    return DECODE.resolve(impl, q_shape, kv_heads=kv_heads, cache_len=cache_len)


def last_visible_slot(q_positions: Array, batch: int, lengths: Array | None = None) -> Array:
    """[batch, q_len] int32: the last cache slot each query sees (its own position, and below
    lengths[b] when a sequence holds fewer tokens); -1 where it sees none."""
    positions = jnp.asarray(q_positions, jnp.int32)
    if positions.ndim == 1:
        positions = jnp.broadcast_to(positions[None], (batch, positions.shape[0]))
    if lengths is not None:
        positions = jnp.minimum(positions, jnp.asarray(lengths, jnp.int32)[:, None] - 1)
    return positions


def one_layer(cache: Array, layer: Array | int | None):
    """The shape of one layer's cache (a stack [layers, batch, slots, ...] when layer is given)."""
    return cache if layer is None else jax.ShapeDtypeStruct(cache.shape[1:], cache.dtype)


def check_decode_args(q, k_cache, v_cache, q_positions, lengths, layer=None) -> None:
    if layer is not None and (k_cache.ndim != 5 or jnp.ndim(layer) != 0):
        raise ValueError(
            f"with a layer index the caches must be stacks [layers, batch, slots, kv_heads, head_dim] "
            f"and the layer a scalar; got {k_cache.shape} and layer of shape {jnp.shape(layer)}"
        )
    check_qkv(q, one_layer(k_cache, layer), one_layer(v_cache, layer))
    batch, q_len = q.shape[:2]
    positions = jnp.shape(q_positions)
    if positions not in ((q_len,), (batch, q_len)):
        raise ValueError(
            f"q_positions must be [q_len] or [batch, q_len] = {(q_len,)} or {(batch, q_len)}; got {positions}"
        )
    if lengths is not None and jnp.shape(lengths) != (batch,):
        raise ValueError(f"lengths must be [batch] = {(batch,)}; got {jnp.shape(lengths)}")


def write_cache(
    cache: Array, new: Array, positions: Array, offset: Array | int = 0, layer: Array | int | None = None
) -> Array:
    """cache [batch, slots, ...] (keys, values or their int8 scales) with new [batch, q_len,
    ...] written at slots positions [batch, q_len] - offset (each sequence where its tokens go);
    writes that fall outside the cache are dropped (another device's shard of it). With
    layer, cache is a stack [layers, batch, slots, ...] and layer's part of it is written,
    in place: the rest of the stack is not copied."""
    length = cache.shape[1 if layer is None else 2]  # [(layers,) batch, slots, ...]
    slots = jnp.asarray(positions, jnp.int32) - offset
    slots = jnp.where((slots >= 0) & (slots < length), slots, length)
    rows = jnp.arange(new.shape[0])[:, None]
    index = (rows, slots) if layer is None else (layer, rows, slots)
    return cache.at[index].set(new.astype(cache.dtype), mode="drop")


def decode_mask(last: Array, slots: Array) -> Array:
    """[batch, 1, 1, q_len, len(slots)]: slot positions at or before each query's last visible
    slot, broadcastable to grouped scores [batch, kv_heads, group, q_len, slots]."""
    return (slots[None, None, :] <= last[:, :, None])[:, None, None]


def partial_attention(q: Array, k: Array, v: Array, mask: Array, k_scale=None, v_scale=None) -> Partial:
    """One partial softmax of q over k/v (grouped-query heads, float32 statistics) under a
    boolean mask broadcastable to [batch, kv_heads, group, q_len, k_len]. k_scale, v_scale
    [batch, k_len, kv_heads]: k and v are int8 (quantize_kv) and these their scales."""
    num_kv_heads = k.shape[2]
    per_key = lambda scale: jnp.moveaxis(scale, 1, -1)[:, :, None, None, :]  # noqa: E731  [b, hk, 1, 1, k]
    scores = jnp.einsum(
        "bqhgd,bkhd->bhgqk",
        group_heads(q, num_kv_heads),
        k.astype(q.dtype),
        preferred_element_type=jnp.float32,
    ) / math.sqrt(q.shape[-1])
    if k_scale is not None:
        scores = scores * per_key(k_scale)
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    shift = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(scores - shift)
    row_sum = weights.sum(axis=-1, keepdims=True)
    if v_scale is not None:
        weights = weights * per_key(v_scale)
    out = jnp.einsum(
        "bhgqk,bkhd->bqhgd", weights.astype(q.dtype), v.astype(q.dtype), preferred_element_type=jnp.float32
    )
    denom = jnp.moveaxis(row_sum, -2, 1)  # [b, q, h_kv, g, 1]
    out = out / jnp.where(denom == 0, 1.0, denom)
    lse = jnp.where(row_sum > 0, shift + jnp.log(jnp.where(row_sum > 0, row_sum, 1.0)), -jnp.inf)
    b, q_len, h, d = q.shape
    return Partial(out.reshape(b, q_len, h, d), lse[..., 0].reshape(b, h, q_len))


def quantize_kv(x: Array) -> tuple[Array, Array]:
    """x [..., head_dim] -> (int8 values, float32 scales [...]): each vector of head_dim
    (one token's key or value of one head) scaled by its own absolute maximum / 127."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    values = jnp.round(x / jnp.where(scale > 0, scale, 1.0)[..., None])
    return jnp.clip(values, -127, 127).astype(jnp.int8), scale


def dequantize_kv(values: Array, scale: Array, dtype) -> Array:
    return (values.astype(jnp.float32) * scale[..., None]).astype(dtype)


def merge_partials(parts: Partial, axis: int = 0) -> Partial:
    """The logsumexp merge of partials stacked along `axis` (of both out and lse)."""
    lse = jax.nn.logsumexp(parts.lse, axis=axis, keepdims=True)
    lse = jnp.where(jnp.isfinite(lse), lse, -jnp.inf)  # all parts empty
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    weights = jnp.exp(parts.lse - safe)  # [..., b, h, q]; 0 for empty parts
    out = jnp.sum(parts.out * jnp.swapaxes(weights, -1, -2)[..., None], axis=axis)
    return Partial(out, jnp.squeeze(lse, axis))


def reference_decode(q, k_cache, v_cache, last: Array, k_scale=None, v_scale=None) -> Array:
    if k_scale is not None:
        k_cache, v_cache = dequantize_kv(k_cache, k_scale, q.dtype), dequantize_kv(v_cache, v_scale, q.dtype)
    return masked_attention(q, k_cache, v_cache, decode_mask(last, jnp.arange(k_cache.shape[1])))


def split_kv_partial(
    q, k_cache, v_cache, last: Array, *, chunk_size: int, k_scale=None, v_scale=None
) -> Partial:
    """Flash-decoding over the cache in chunks of chunk_size slots (a last, shorter chunk where
    the length does not divide). One merged partial. k_scale, v_scale [batch, max_len,
    kv_heads]: an int8 cache's scales (partial_attention)."""
    b, length, hk, d = k_cache.shape
    chunk_size = max(1, min(chunk_size, length))
    whole = length // chunk_size * chunk_size
    caches = (k_cache, v_cache) + (() if k_scale is None else (k_scale, v_scale))
    parts = []
    if whole:
        n = whole // chunk_size
        chunked = [x[:, :whole].reshape(b, n, chunk_size, *x.shape[2:]) for x in caches]
        slots = jnp.arange(whole).reshape(n, chunk_size)
        chunk = lambda s, *kv: partial_attention(q, *kv[:2], decode_mask(last, s), *kv[2:])  # noqa: E731
        if q.shape[1] == 1:  # one query: every chunk at once, then one merge
            parts.append(merge_partials(jax.vmap(chunk, in_axes=(0,) + (1,) * len(caches))(slots, *chunked)))
        else:  # a prompt's chunk of queries: chunk by chunk, so scores stay [q_len, chunk_size],
            # and only as far as the last slot any query sees (not the empty rest of the cache)

            def step(i, acc):
                return Partial(*logsumexp_merge(*acc, *chunk(slots[i], *(x[:, i] for x in chunked))))

            visible = jnp.clip((jnp.max(last) + chunk_size) // chunk_size, 0, n)
            empty = Partial(jnp.zeros(q.shape, jnp.float32), jnp.full((b, q.shape[2], q.shape[1]), -jnp.inf))
            parts.append(jax.lax.fori_loop(0, visible, step, empty))
    if whole < length:
        tail = [x[:, whole:] for x in caches]
        parts.append(partial_attention(q, *tail[:2], decode_mask(last, jnp.arange(whole, length)), *tail[2:]))
    return parts[0] if len(parts) == 1 else Partial(*logsumexp_merge(*parts[0], *parts[1]))


def _one_layer_of(layer, k_cache, v_cache, scales: dict):
    """The caches (and scales) of one layer of stacks; as they are when layer is None."""
    if layer is None:
        return k_cache, v_cache, scales
    return (
        k_cache[layer],
        v_cache[layer],
        {name: None if x is None else x[layer] for name, x in scales.items()},
    )


def attend_cache(
    q: Array,
    k_cache: Array,
    v_cache: Array,
    last: Array,
    *,
    impl: str,
    chunk_size: int = 512,
    layer: Array | int | None = None,
    k_scale: Array | None = None,
    v_scale: Array | None = None,
    **kernel_options,
) -> Partial:
    """The partial softmax of q over the cache by a DECODE implementation (auto resolved),
    row r of sequence b seeing slots <= last[b, r]. layer: the caches are stacks
    [layers, ...] and this layer's is read (the kernel reads it in place). kernel_options go
    to the pallas kernel (bpt.ops.kernels.decode.decode_partial: num_splits, block_k,
    schedule, lean_waves, num_warps, num_stages); the other implementations have no such settings."""
    impl = resolve_decode_impl(impl, q_shape=q.shape, kv_heads=k_cache.shape[-2], cache_len=k_cache.shape[-3])
    options = kernel_options if impl == "pallas" else {}  # (the kernel's settings: nothing else has them)
    partial = DECODE[impl].forward
    return partial(q, k_cache, v_cache, last, chunk_size=chunk_size, layer=layer, k_scale=k_scale, v_scale=v_scale, **options)


def _reference_partial(q, k_cache, v_cache, last, *, chunk_size, layer, **scales) -> Partial:
    k_cache, v_cache, scales = _one_layer_of(layer, k_cache, v_cache, scales)
    mask = decode_mask(last, jnp.arange(k_cache.shape[1]))
    return partial_attention(q, k_cache, v_cache, mask, scales["k_scale"], scales["v_scale"])


def _reference_run(q, k_cache, v_cache, last, *, chunk_size, layer, **scales) -> Array:
    k_cache, v_cache, scales = _one_layer_of(layer, k_cache, v_cache, scales)
    return reference_decode(q, k_cache, v_cache, last, **scales)


def _split_kv_partial(q, k_cache, v_cache, last, *, chunk_size, layer, **scales) -> Partial:
    k_cache, v_cache, scales = _one_layer_of(layer, k_cache, v_cache, scales)
    return split_kv_partial(q, k_cache, v_cache, last, chunk_size=chunk_size, **scales)


def _pallas_partial(q, k_cache, v_cache, last, *, chunk_size, layer, **options) -> Partial:
    return decode_partial(q, k_cache, v_cache, last, layer=layer, **options)


DECODE = Registry(
    "decode attention",
    [
        Implementation("reference", "the scores over every slot materialized, one softmax; GQA, int8 caches; "
                       "anywhere", run=_reference_run, forward=_reference_partial),
        Implementation("split_kv", "flash-decoding in plain JAX over chunks of slots; GQA, int8 caches; anywhere",
                       forward=_split_kv_partial),
        Implementation("pallas", "bpt's split-KV decode kernel; GQA, int8 caches, ragged batches; GPUs (Triton), "
                       "elsewhere interpret mode", forward=_pallas_partial),
    ],
    select_decode,
)  # fmt: skip
DECODE_IMPLS = DECODE.names


def decode_attention(
    q: Array,
    k_cache: Array,
    v_cache: Array,
    q_positions: Array,
    *,
    lengths: Array | None = None,
    impl: str = "auto",
    chunk_size: int = 512,
    layer: Array | int | None = None,
    k_scale: Array | None = None,
    v_scale: Array | None = None,
    **kernel_options,
) -> Array:
    """Queries at absolute positions attend to cached keys at positions <= their own.

    Args:
      q: [batch, q_len, heads, head_dim], the newest tokens' queries (q_len is usually 1).
      k_cache, v_cache: [batch, max_len, kv_heads, head_dim]; slot i holds position i. Slots
        past a query's position may hold anything: they are masked.
      q_positions: [q_len] int (the same for every sequence) or [batch, q_len].
      lengths: optional [batch] int: sequence b holds lengths[b] tokens; slots from there on
        are masked too (a batch of prompts of different lengths decoding together).
      impl: reference | split_kv | pallas | auto (see the module docstring).
      chunk_size: split_kv's chunk of slots.
      layer: optional scalar: k_cache and v_cache are stacks [layers, batch, max_len, ...]
        (a model's whole cache) and layer's part is read; the pallas kernel reads it in
        place, the others take the slice.
      k_scale, v_scale: an int8 cache (quantize_kv): the caches hold int8 values and these
        [(layers,) batch, max_len, kv_heads] float32 their per-token, per-head scales.
      kernel_options: the pallas kernel's settings (decode_partial): num_splits (programs
        per K/V head; default from the device's SM count and the cache's length: default_tiles), block_k, schedule, lean_waves
        (programs a SM of the "lean" schedule), num_warps, num_stages.
    Returns:
      [batch, q_len, heads, head_dim] in q's dtype; zeros for a query that sees no slot.
    """
    check_decode_args(q, k_cache, v_cache, q_positions, lengths, layer)
    impl = resolve_decode_impl(impl, q_shape=q.shape, kv_heads=k_cache.shape[-2], cache_len=k_cache.shape[-3])
    last = last_visible_slot(q_positions, q.shape[0], lengths)
    if (k_scale is None) != (v_scale is None):
        raise ValueError("an int8 cache needs both k_scale and v_scale")
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    if DECODE[impl].run is not None:  # (the reference: its output directly, not a partial)
        return DECODE[impl].run(q, k_cache, v_cache, last, chunk_size=chunk_size, layer=layer, **scales)
    part = attend_cache(
        q, k_cache, v_cache, last, impl=impl, chunk_size=chunk_size, layer=layer, **scales, **kernel_options
    )
    return part.out.astype(q.dtype)
