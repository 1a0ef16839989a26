"""FLASH's mixed chunk attention with the sequence sharded over devices.

The mixed form needs no ring: inside a chunk it is quadratic, and across chunks it is a
running sum of lin_k v^T, [s, e] whatever the length. With contiguous shards whose length is
a multiple of the chunk, every chunk lies on one device, so each device runs the one-device
attention on its tokens (bpt.ops.gau.mixed_chunk_attention, kernels included), and the
only thing that crosses devices is the linear sum of the tokens on the devices before it:
one all-gather of each device's [batch, s, e] float32 total, a few megabytes. The
one-device op starts its running sum from it (its initial_state; the states' kernel reads
it too), so the sum reaches the chunks' states and no [T, e] term is added after.
Autodiff carries the gradient back through the all-gather (a reduce-scatter of the sums'
gradients). The device's total is one more [s, T] x [T, e] matmul over its tokens: the
one-device op keeps its states inside its custom_vjp (and, with the kernels, in bf16), so
it cannot hand the float32 total out.

Packed documents (segment ids, each document one contiguous run of ids): a device's
queries take the earlier devices' sum only for the document its first token belongs to,
and only the tokens of that document, which on an earlier device are the ones at its end,
and only if every device in between holds nothing but that document. The one-device op
gives its initial state to the chunks that start in that document only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from bpt.ops.gau import mixed_chunk_attention
from bpt.parallel.mesh import mesh_axes

Array = jax.Array


def sharded_mixed_chunk_attention(
    quad_q: Array,
    quad_k: Array,
    lin_q: Array,
    lin_k: Array,
    v: Array,
    *,
    mesh: Mesh,
    chunk_size: int,
    quad_scale: float,
    lin_scale: float,
    bias: Array | None = None,
    segment_ids: Array | None = None,
    impl: str = "blockwise",
    linear_norm: str = "sum",
    axis: str = "sequence",
    batch_axes: tuple[str, ...] = ("data", "fsdp"),
    value_axis: str = "tensor",
) -> Array:
    """bpt.ops.gau.mixed_chunk_attention (same arguments and result, global arrays in token
    order) with the tokens split in contiguous shards over mesh[axis], the batch over
    batch_axes and the values' width over value_axis (each output column needs only its own
    value column; not with the Pallas kernels). Each device's share of the sequence must be
    a multiple of chunk_size. linear_norm "mean": the count of earlier chunks crosses the
    devices with the sum (bpt.ops.gau.chunks_entering)."""
    shards = mesh.shape[axis] if axis in mesh.axis_names else 1
    t = quad_q.shape[1]
    if t % (shards * chunk_size):
        raise ValueError(
            f"FLASH over mesh.{axis}={shards} needs a sequence of a multiple of {shards} x chunk_size="
            f"{chunk_size} tokens, so that no chunk straddles two devices; got {t}"
        )
    attend = functools.partial(
        mixed_chunk_attention,
        chunk_size=chunk_size,
        quad_scale=quad_scale,
        lin_scale=lin_scale,
        impl=impl,
        linear_norm=linear_norm,
    )
    rows = PartitionSpec(mesh_axes(mesh, batch_axes), axis if shards > 1 else None)
    columns = mesh_axes(mesh, (value_axis,))
    if columns and impl == "pallas":
        raise ValueError(
            f"FLASH's Pallas kernels do not split the values over mesh.{value_axis}; use impl='blockwise'"
        )
    values = PartitionSpec(*rows, columns)

    def body(quad_q, quad_k, lin_q, lin_k, v, bias, seg):
        if shards == 1:
            return attend(quad_q, quad_k, lin_q, lin_k, v, bias=bias, segment_ids=seg)
        carry, count = _state_from_earlier_devices(lin_k, v, seg, axis, shards, chunk_size)
        return attend(
            quad_q, quad_k, lin_q, lin_k, v, bias=bias, segment_ids=seg, initial_state=carry, initial_count=count
        )

    seg_spec = None if segment_ids is None else rows
    # The bias table is the same on every device; shard_map sums its gradient over them.
    bias_spec = None if bias is None else PartitionSpec()
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(rows,) * 4 + (values, bias_spec, seg_spec),
        out_specs=values,
        check_vma=False,
    )(quad_q, quad_k, lin_q, lin_k, v, bias, segment_ids)


def _state_from_earlier_devices(lin_k, v, seg, axis: str, shards: int, chunk: int) -> tuple[Array, Array]:
    """The float32 [batch, s, e] linear sum this device's first document takes from the
    devices before it (every token of theirs without segment ids), and [batch] the number of
    their chunks that sum holds (for the mean, bpt.ops.gau.chunks_entering)."""
    index = lax.axis_index(axis)
    b, t = lin_k.shape[:2]
    if seg is None:
        total = jnp.einsum("bts,bte->bse", lin_k, v, preferred_element_type=jnp.float32)
        totals = lax.all_gather(total, axis)  # [shards, batch, s, e]
        before = (jnp.arange(shards) < index).astype(jnp.float32)
        return jnp.einsum("d,dbse->bse", before, totals), jnp.full((b,), index * (t // chunk), jnp.float32)
    first, last = seg[:, 0], seg[:, -1]  # [batch]
    tail = jnp.einsum(
        "bts,bte->bse", jnp.where((seg == last[:, None])[..., None], lin_k, 0), v,
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    # The chunks holding tokens of the last document: the device's last ones (documents are contiguous).
    held = jnp.any((seg == last[:, None]).reshape(b, t // chunk, chunk), axis=-1).sum(-1).astype(jnp.float32)
    tails, helds, firsts, lasts = (lax.all_gather(x, axis) for x in (tail, held, first, last))  # [shards, batch, ...]
    # Device d < index passes its tail on when it ends in this device's first document and
    # every device strictly between holds that document alone.
    r = jnp.arange(shards)
    whole = (firsts == lasts) & (firsts == first[None])  # [shards, batch]
    between = (r[:, None] > r[None, :]) & (r[:, None] < index)  # [m, d]: d < m < index
    blocked = jnp.any(between[..., None] & ~whole[:, None, :], axis=0)  # [d, batch]
    passes = ((r < index)[:, None] & (lasts == first[None]) & ~blocked).astype(jnp.float32)  # [shards, batch]
    return jnp.einsum("db,dbse->bse", passes, tails), jnp.einsum("db,db->b", passes, helds)
