"""Decoding with the key/value cache sharded over devices: Tree Attention, and a ring baseline.

A long cache is split over the mesh's `sequence` axis along its slots (device i holds slots
[i * n, (i + 1) * n)); the new tokens' queries are on every device.

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
)
from bpt.ops.reference import logsumexp_merge
from bpt.parallel.mesh import mesh_axes

Array = jax.Array


def _shard_partial(q, k, v, last, offset, **options):
    """Attention over one shard of slots (slot i is position offset + i), by attend_cache."""
    return attend_cache(q, k, v, jnp.clip(last - offset, -1, k.shape[1] - 1), **options)


def _shard_impl(impl: str) -> str:
    """A shard's impl: reference runs as split_kv (either way one partial per shard)."""
    impl = resolve_decode_impl(impl)
    return "split_kv" if impl == "reference" else impl


def _sharded(fn, q, k_cache, v_cache, q_positions, lengths, mesh, axis, batch_axes):
    """fn(q, k_shard, v_shard, last, shards) per device under shard_map: the caches split over
    mesh[axis] along their slots, everything else over batch_axes."""
    check_decode_args(q, k_cache, v_cache, q_positions, lengths)
    shards = mesh.shape[axis] if axis in mesh.axis_names else 1
    if k_cache.shape[1] % shards:
        raise ValueError(
            f"the cache length {k_cache.shape[1]} does not split into {shards} shards of mesh.{axis}"
        )
    last = last_visible_slot(q_positions, q.shape[0], lengths)
    batch = mesh_axes(mesh, batch_axes)
    if batch and q.shape[0] % math.prod(mesh.shape[a] for a in batch):
        names = " x ".join(f"mesh.{a}={mesh.shape[a]}" for a in batch)
        raise ValueError(f"a batch of {q.shape[0]} does not split over {names}")
    seq = axis if shards > 1 else None
    cache = PartitionSpec(batch, seq)
    rows = PartitionSpec(batch)
    body = jax.shard_map(
        lambda q, k, v, last: fn(q, k, v, last, shards),
        mesh=mesh,
        in_specs=(rows, cache, cache, rows),
        out_specs=rows,
        check_vma=False,
    )
    return body(q, k_cache, v_cache, last)


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
    num_splits: int | None = None,
    axis: str = "sequence",
    batch_axes: tuple[str, ...] = ("data", "fsdp"),
) -> Array:
    """decode_attention (same arguments and result) with the caches sharded over mesh[axis]
    along their slots and one all-reduce merge of the devices' partial softmaxes. The batch
    is sharded over batch_axes where the mesh has them."""
    options = dict(impl=_shard_impl(impl), chunk_size=chunk_size, num_splits=num_splits)

    def fn(q, k, v, last, shards):
        offset = lax.axis_index(axis) * k.shape[1] if shards > 1 else 0
        part = _shard_partial(q, k, v, last, offset, **options)
        if shards == 1:
            return part.out.astype(q.dtype)
        top = lax.pmax(part.lse, axis)  # [b, h, q]
        shift = jnp.where(jnp.isfinite(top), top, 0.0)
        weight = jnp.swapaxes(jnp.exp(part.lse - shift), 1, 2)[..., None]  # [b, q, h, 1]
        total, out = lax.psum((weight, part.out * weight), axis)
        return (out / jnp.where(total > 0, total, 1.0)).astype(q.dtype)

    return _sharded(fn, q, k_cache, v_cache, q_positions, lengths, mesh, axis, batch_axes)


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
    num_splits: int | None = None,
    axis: str = "sequence",
    batch_axes: tuple[str, ...] = ("data", "fsdp"),
) -> Array:
    """tree_decode_attention's result by passing the cache shards around the ring instead:
    N - 1 hops of lax.ppermute, each device merging every visiting shard (the baseline)."""
    options = dict(impl=_shard_impl(impl), chunk_size=chunk_size, num_splits=num_splits)

    def fn(q, k, v, last, shards):
        local = k.shape[1]
        index = lax.axis_index(axis) if shards > 1 else 0
        part = _shard_partial(q, k, v, last, index * local, **options)
        perm = [(i, (i + 1) % shards) for i in range(shards)]
        for hop in range(1, shards):
            k, v = lax.ppermute((k, v), axis, perm)
            source = (index - hop) % shards
            visit = _shard_partial(q, k, v, last, source * local, **options)
            part = Partial(*logsumexp_merge(*part, *visit))
        return part.out.astype(q.dtype)

    return _sharded(fn, q, k_cache, v_cache, q_positions, lengths, mesh, axis, batch_axes)
