"""Decoding with the key/value cache sharded over devices: Tree Attention, and a ring baseline.

A long cache is split over the mesh's `sequence` axis along its slots; the new tokens'
queries are on every device. Two layouts of positions over the N devices' n slots each:

- contiguous: device i holds positions [i * n, (i + 1) * n) (the global cache array is in
  position order);
- striped: device i holds positions i, i + N, i + 2 N, ... (its local slot j is position
  j * N + i). A prompt read in chunks then fills every device's shard at the same pace, so
  each chunk's attention over the cache is split evenly; with contiguous shards the first
  device does the most (over a whole prefill, 1.75x the even share on 4 devices). bpt's
  models store their sharded caches striped.

Either way a query sees a prefix of each device's slots, so each device's attention is the
one-device kernel with its own last visible slot.

- tree_decode_attention: each device attends its own cache shard (a partial softmax: float32
  output and logsumexp, by bpt.ops.decode's split_kv or pallas path), and one all-reduce
  merges them: the max of the logsumexps (pmax), then the sums of the rescaled weights and
  outputs (psum). The only traffic is [batch, q_len, heads, head_dim + 1] floats per
  device, whatever the context.
- ring_decode_attention: the baseline the tree is measured against. The cache shards travel
  around the ring (lax.ppermute), each device merging every shard into its partial; the
  traffic is the whole cache.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from bpt.ops.decode import (
    Partial,
    attend_cache,
    check_decode_args,
    last_visible_slot,
    resolve_decode_impl,
    write_cache,
)
from bpt.ops.reference import logsumexp_merge
from bpt.parallel.mesh import mesh_axes

Array = jax.Array


CACHE_LAYOUTS = ("contiguous", "striped")


def _check_layout(layout: str) -> None:
    if layout not in CACHE_LAYOUTS:
        raise ValueError(f"unknown cache layout {layout!r}; allowed: {', '.join(CACHE_LAYOUTS)}")


def _local_last(last: Array, index, shards: int, length: int, layout: str) -> Array:
    """Device `index`'s last visible local slot for queries whose last visible position is
    `last` (-1: none): the visible positions are a prefix of the device's slots."""
    local = (last - index) // shards if layout == "striped" else last - index * length
    return jnp.clip(local, -1, length - 1)


def _shard_partial(q, k, v, last, index, shards, layout, **options):
    """Attention over device `index`'s shard of the slots, by attend_cache."""
    return attend_cache(q, k, v, _local_last(last, index, shards, k.shape[-3], layout), **options)


def _shard_impl(impl: str, q: Array, k_cache: Array) -> str:
    """A shard's implementation (auto resolved once, for every shard): each gives the partial
    softmax of its slots (bpt.ops.decode.DECODE's forward), merged across the devices."""
    return resolve_decode_impl(impl, q_shape=q.shape, kv_heads=k_cache.shape[-2])


def _slot_shards(cache: Array, mesh: Mesh, axis: str, slot_axis: int = -3) -> int:
    """How many shards mesh[axis] cuts the cache's slots (slot_axis) into; they must divide."""
    shards = mesh.shape[axis] if axis in mesh.axis_names else 1
    if cache.shape[slot_axis] % shards:
        raise ValueError(
            f"the cache length {cache.shape[slot_axis]} does not split into {shards} shards of mesh.{axis}"
        )
    return shards


def _sharded(fn, q, k_cache, v_cache, q_positions, lengths, mesh, axis, batch_axes, layer=None, scales=()):
    """fn(q, k_shard, v_shard, last, shards, layer, *scale_shards) per device under shard_map:
    the caches (and an int8 cache's scales) split over mesh[axis] along their slots (stacks
    [layers, ...] when layer is given), everything else over batch_axes."""
    check_decode_args(q, k_cache, v_cache, q_positions, lengths, layer)
    shards = _slot_shards(k_cache, mesh, axis)
    last = last_visible_slot(q_positions, q.shape[0], lengths)
    batch = mesh_axes(mesh, batch_axes)
    if batch and q.shape[0] % math.prod(mesh.shape[a] for a in batch):
        names = " x ".join(f"mesh.{a}={mesh.shape[a]}" for a in batch)
        raise ValueError(f"a batch of {q.shape[0]} does not split over {names}")
    seq = axis if shards > 1 else None
    cache = PartitionSpec(batch, seq) if layer is None else PartitionSpec(None, batch, seq)
    rows = PartitionSpec(batch)
    stacked = layer is not None  # (shard_map takes a placeholder layer otherwise)
    layer = jnp.asarray(layer if stacked else 0, jnp.int32)
    body = jax.shard_map(
        lambda q, k, v, last, layer, *scales: fn(q, k, v, last, shards, layer if stacked else None, *scales),
        mesh=mesh,
        in_specs=(rows, cache, cache, rows, PartitionSpec()) + (cache,) * len(scales),
        out_specs=rows,
        check_vma=False,
    )
    return body(q, k_cache, v_cache, last, layer, *scales)


def sharded_write_cache(
    cache: Array,
    new: Array,
    positions: Array,
    *,
    mesh: Mesh,
    axis: str = "sequence",
    layer: Array | int | None = None,
    layout: str = "contiguous",
) -> Array:
    """bpt.ops.decode.write_cache for a cache sharded over mesh[axis] along its slots (new
    tokens and positions on every device): each device writes the tokens that fall in its
    shard (by the layout: 'contiguous' or 'striped'), in place. layer: cache is a stack
    [layers, batch, slots, ...]. Keys, values or an int8 cache's scales alike."""
    _check_layout(layout)
    stacked = layer is not None
    slot_axis = 2 if stacked else 1  # [(layers,) batch, slots, ...]
    shards = _slot_shards(cache, mesh, axis, slot_axis)
    spec = PartitionSpec(*[None] * slot_axis, axis if shards > 1 else None)

    def body(cache, new, positions, layer):
        offset = 0
        if shards > 1:  # write_cache drops what falls outside this device's slots
            index = lax.axis_index(axis)
            if layout == "striped":  # position p: slot p // N of device p mod N
                positions = jnp.where(positions % shards == index, positions // shards, -1)
            else:
                offset = index * cache.shape[slot_axis]
        return write_cache(cache, new, positions, offset, layer if stacked else None)

    layer = jnp.asarray(layer if stacked else 0, jnp.int32)
    replicated = PartitionSpec()
    return jax.shard_map(
        body, mesh=mesh, in_specs=(spec, replicated, replicated, replicated), out_specs=spec, check_vma=False
    )(cache, new, positions, layer)


def tree_decode_attention(
    q: Array,
    k_cache: Array,
    v_cache: Array,
    q_positions: Array,
    *,
    mesh: Mesh,
    lengths: Array | None = None,
    impl: str = "auto",
    chunk_size: int = 512,
    axis: str = "sequence",
    batch_axes: tuple[str, ...] = ("data", "fsdp"),
    layer: Array | int | None = None,
    k_scale: Array | None = None,
    v_scale: Array | None = None,
    layout: str = "contiguous",
    **kernel_options,
) -> Array:
    """decode_attention (same arguments and result) with the caches sharded over mesh[axis]
    along their slots and one all-reduce merge of the devices' partial softmaxes. The batch
    is sharded over batch_axes where the mesh has them. layer, k_scale, v_scale,
    kernel_options: as decode_attention's (a stacked cache is sharded along its slots, axis 2).
    layout: how positions lie over the shards ('contiguous': the cache in position order;
    'striped': as sharded_write_cache(layout='striped') writes them)."""
    _check_layout(layout)
    options = dict(impl=_shard_impl(impl, q, k_cache), chunk_size=chunk_size, **kernel_options)

    def fn(q, k, v, last, shards, layer, *scales):
        index = lax.axis_index(axis) if shards > 1 else 0
        scales = dict(zip(("k_scale", "v_scale"), scales))
        part = _shard_partial(q, k, v, last, index, shards, layout, layer=layer, **scales, **options)
        if shards == 1:
            return part.out.astype(q.dtype)
        top = lax.pmax(part.lse, axis)  # [b, h, q]
        shift = jnp.where(jnp.isfinite(top), top, 0.0)
        weight = jnp.swapaxes(jnp.exp(part.lse - shift), 1, 2)[..., None]  # [b, q, h, 1]
        total, out = lax.psum((weight, part.out * weight), axis)
        return (out / jnp.where(total > 0, total, 1.0)).astype(q.dtype)

    scales = () if k_scale is None else (k_scale, v_scale)
    return _sharded(fn, q, k_cache, v_cache, q_positions, lengths, mesh, axis, batch_axes, layer, scales)


def ring_decode_attention(
    q: Array,
    k_cache: Array,
    v_cache: Array,
    q_positions: Array,
    *,
    mesh: Mesh,
    lengths: Array | None = None,
    impl: str = "auto",
    chunk_size: int = 512,
    axis: str = "sequence",
    batch_axes: tuple[str, ...] = ("data", "fsdp"),
    layout: str = "contiguous",
    **kernel_options,
) -> Array:
    """tree_decode_attention's result by passing the cache shards around the ring instead:
    N - 1 hops of lax.ppermute, each device merging every visiting shard (the baseline)."""
    _check_layout(layout)
    options = dict(impl=_shard_impl(impl, q, k_cache), chunk_size=chunk_size, **kernel_options)

    def fn(q, k, v, last, shards, layer):
        index = lax.axis_index(axis) if shards > 1 else 0
        part = _shard_partial(q, k, v, last, index, shards, layout, **options)
        perm = [(i, (i + 1) % shards) for i in range(shards)]
        for hop in range(1, shards):
            k, v = lax.ppermute((k, v), axis, perm)
            source = (index - hop) % shards
            visit = _shard_partial(q, k, v, last, source, shards, layout, **options)
            part = Partial(*logsumexp_merge(*part, *visit))
        return part.out.astype(q.dtype)

    return _sharded(fn, q, k_cache, v_cache, q_positions, lengths, mesh, axis, batch_axes)
