"""Context parallelism: exact attention over a sequence sharded across devices.

Each device of the mesh's `sequence` axis holds one shard of the queries, keys and values.
Two strategies compute the same function:

- ring: the key/value shards travel around the devices with lax.ppermute, one hop at a
  time, while each device attends its queries to the shard it holds (the next shard is sent
  before the current one is used, so the transfer hides behind the compute). The backward
  sends the key/value shards round again with their dK/dV accumulators, which arrive back
  home after the last hop. Memory per device: one visiting shard, whatever the ring size.
- all_gather: every device gathers all key/value shards once (cheap for GQA/MQA models,
  whose keys and values are small), attends to them shard by shard, and the backward returns
  each shard's dK/dV to its owner with one reduce-scatter.

Both can attend the heads in groups, one group after another (head_groups; by default long
shards only): what a device holds beyond its local attention, the visiting shards and the
float32 dK/dV sums, is then one group's.

Both merge the shards' partial results with their logsumexp in float32 (the merge is exact,
so the error does not grow with the ring size), and both are one custom_vjp whose backward is
FlashAttention-2's, given the merged output and logsumexp: each shard's gradient is its share
of the whole attention's, so no forward is recomputed.

Causal load balance. With shards in natural order the last device's queries see every key
and the first device's see only their own: the work is unbalanced. The tokens are therefore
permuted once per batch (layout_permutation) before they are sharded:

- zigzag: the sequence is cut into 2N chunks and device i holds chunks i and 2N-1-i. Every
  hop then costs the same: a device attends to the visiting shard's first half (the shard
  comes from a device before it) or with its second half of queries (from one after it).
- striped: token t goes to device t mod N. A visiting shard from a device before this one is
  causal with its diagonal, one from after it without. Suits packed documents, whose
  attention zigzag would not balance.
- none: contiguous shards (a device skips the hops whose keys all lie after its queries).

Inside a hop the local attention is an implementation of bpt.ops.attention.MERGED (auto:
bpt's flash kernels on GPUs for 16-bit inputs, the blockwise scan elsewhere); one that
returns no logsumexp (cudnn, reference) is an error here, not replaced.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, PartitionSpec

from bpt.ops.attention import MERGED, attention
from bpt.ops.kernels.attention import current_settings, kernel_settings
from bpt.ops.reference import check_qkv, logsumexp_merge, split_segment_ids
from bpt.ops.remat import ATTENTION_LSE, ATTENTION_OUT
from bpt.parallel.mesh import mesh_axes

Array = jax.Array
LAYOUTS = ("zigzag", "striped", "none")
STRATEGIES = ("ring", "all_gather")
# head_groups="auto" splits the heads until one group's float32 dK/dV sums (the ring's
# travelling accumulators; all of the gathered shards' for all_gather) are at most this.
GROUP_BYTES = 1 << 30


# ----------------------------------------------------------------------------- layouts


def layout_permutation(seq_len: int, shards: int, layout: str) -> np.ndarray:
    """perm such that x[:, perm] puts the tokens in the layout's order: shard i of the result
    (its i-th contiguous 1/shards) is what device i holds. perm[j] is the position of token j."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown load balance {layout!r}; allowed: {', '.join(LAYOUTS)}")
    positions = np.arange(seq_len)
    if layout == "none" or shards == 1:
        return positions
    if layout == "zigzag":
        if seq_len % (2 * shards):
            raise ValueError(
                f"zigzag needs a sequence length divisible by 2 x {shards} shards; got {seq_len}"
            )
        chunks = positions.reshape(2 * shards, -1)
        order = [c for i in range(shards) for c in (i, 2 * shards - 1 - i)]
        return chunks[order].reshape(-1)
    if seq_len % shards:
        raise ValueError(f"striped needs a sequence length divisible by {shards} shards; got {seq_len}")
    return positions.reshape(-1, shards).T.reshape(-1)


def to_layout(x: Array, perm: np.ndarray, axis: int = 1) -> Array:
    return x if _is_identity(perm) else jnp.take(x, jnp.asarray(perm), axis=axis)


def from_layout(x: Array, perm: np.ndarray, axis: int = 1) -> Array:
    return x if _is_identity(perm) else jnp.take(x, jnp.asarray(np.argsort(perm)), axis=axis)


def _is_identity(perm: np.ndarray) -> bool:
    return bool((perm == np.arange(len(perm))).all())


# ----------------------------------------------------------------------------- local attention


@dataclasses.dataclass(frozen=True)
class _Settings:
    """Static settings of one context-parallel attention (a custom_vjp nondiff argument)."""

    axis: str
    shards: int
    strategy: str
    layout: str
    causal: bool
    impl: str  # local: blockwise | pallas
    q_chunk_size: int
    kv_chunk_size: int
    head_groups: int = 1  # heads are attended in this many groups, one group after another
    # the kernel settings (bpt.ops.kernels.attention.kernel_settings) open where the attention
    # was called, as sorted (name, value) pairs: the backward, traced later, runs under them too
    kernel: tuple = ()

    @property
    def group_loop(self) -> bool:
        """Whether the head groups run in a lax.fori_loop (_in_head_groups): all_gather's,
        whose loop body holds no ppermute."""
        return self.strategy == "all_gather"


def _local_forward(s: _Settings, kind: str, q, k, v, q_seg, kv_seg):
    """(out, lse) of q over one key/value shard; kind: causal | full | strict (causal without
    the diagonal). lse is -inf where a query sees no key of this shard."""
    with kernel_settings(**dict(s.kernel)):
        out, lse = MERGED[s.impl].forward(q, k, v, **_local_settings(s, kind, q_seg, kv_seg))
    return out, jnp.where(lse == jnp.inf, -jnp.inf, lse)


def _local_backward(s: _Settings, kind: str, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse):
    """(dq, dk, dv), float32: this shard's share of the gradient of the merged attention
    (out, lse are the merged results; lse is +inf where a query sees no key at all)."""
    backward = MERGED[s.impl].backward
    with kernel_settings(**dict(s.kernel)):
        return backward(q, k, v, out, lse, d_out, d_lse, **_local_settings(s, kind, q_seg, kv_seg))


def _local_settings(s: _Settings, kind: str, q_seg, kv_seg) -> dict:
    return dict(
        causal=kind != "full",
        q_offset=-1 if kind == "strict" else 0,
        segment_ids=None if q_seg is None else (q_seg, kv_seg),
        q_chunk_size=s.q_chunk_size,
        kv_chunk_size=s.kv_chunk_size,
    )


# ----------------------------------------------------------------------------- one hop


def _hop_forward(s: _Settings, own: bool, before, q, k, v, q_seg, kv_seg):
    """(out, lse) of the local queries over a key/value shard: the device's own (static), or
    one from another device, whose index is lower than this one's where `before` (traced)."""
    if not s.causal:
        return _local_forward(s, "full", q, k, v, q_seg, kv_seg)
    if own:  # causal in its local order, in every layout
        return _local_forward(s, "causal", q, k, v, q_seg, kv_seg)
    if s.layout == "striped":
        return lax.cond(
            before,
            lambda: _local_forward(s, "causal", q, k, v, q_seg, kv_seg),
            lambda: _local_forward(s, "strict", q, k, v, q_seg, kv_seg),
        )
    if s.layout == "none":
        return lax.cond(
            before, lambda: _local_forward(s, "full", q, k, v, q_seg, kv_seg), lambda: _nothing(q)
        )
    half = q.shape[1] // 2  # zigzag

    def first_half_of_keys():
        return _local_forward(s, "full", q, k[:, :half], v[:, :half], q_seg, _rows(kv_seg, 0, half))

    def second_half_of_queries():
        out, lse = _local_forward(s, "full", q[:, half:], k, v, _rows(q_seg, half, None), kv_seg)
        return _pad_rows(out, half, 1), _pad_rows(lse, half, 2, -jnp.inf)

    return lax.cond(before, first_half_of_keys, second_half_of_queries)


def _hop_backward(s: _Settings, own: bool, before, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse):
    """(dq, dk, dv) float32 of one hop (see _hop_forward)."""
    local = functools.partial(_local_backward, s)
    if not s.causal:
        return local("full", q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse)
    if own:
        return local("causal", q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse)
    if s.layout == "striped":
        return lax.cond(
            before,
            lambda: local("causal", q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse),
            lambda: local("strict", q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse),
        )
    if s.layout == "none":
        zeros = lambda: tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))  # noqa: E731
        return lax.cond(before, lambda: local("full", q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse), zeros)
    half = q.shape[1] // 2

    def first_half_of_keys():
        dq, dk, dv = local(
            "full", q, k[:, :half], v[:, :half], q_seg, _rows(kv_seg, 0, half), out, lse, d_out, d_lse
        )
        return dq, _pad_rows(dk, half, 1, after=True), _pad_rows(dv, half, 1, after=True)

    def second_half_of_queries():
        rows = slice(half, None)
        dq, dk, dv = local(
            "full",
            q[:, rows],
            k,
            v,
            _rows(q_seg, half, None),
            kv_seg,
            out[:, rows],
            lse[..., rows],
            d_out[:, rows],
            d_lse[..., rows],
        )
        return _pad_rows(dq, half, 1), dk, dv

    return lax.cond(before, first_half_of_keys, second_half_of_queries)


def _rows(seg, start, stop):
    return None if seg is None else seg[:, start:stop]


def _pad_rows(x, n: int, axis: int, value=0.0, *, after: bool = False):
    """x with n rows of value added before (or after) it along axis."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n) if after else (n, 0)
    return jnp.pad(x, widths, constant_values=value)


def _nothing(q):
    b, sq, h, _ = q.shape
    return jnp.zeros(q.shape, q.dtype), jnp.full((b, h, sq), -jnp.inf, jnp.float32)


# ----------------------------------------------------------------------------- the custom_vjp


def _source(s: _Settings, index, t):
    """The device whose shard is visiting at hop t (t >= 1), and whether it comes before this one."""
    src = (index - t) % s.shards
    return src, src < index


def _send(s: _Settings, x):
    """x to the next device of the ring."""
    return lax.ppermute(x, s.axis, perm=[(i, (i + 1) % s.shards) for i in range(s.shards)])


def _gather(s: _Settings, x):
    return None if x is None else lax.all_gather(x, s.axis)


def _take(x, src):
    return None if x is None else lax.dynamic_index_in_dim(x, src, 0, keepdims=False)


def _hops(s: _Settings, visit, carry, shard, gathered):
    """carry after visit(t, shard, carry) for hops t = 1 .. shards - 1, in a loop (its buffers
    are reused hop after hop: memory stays one shard whatever the ring size).

    ring: shard arrives from the previous device; the next one is sent on before this hop's
    compute, so the transfer overlaps it (the last hop sends nothing). all_gather: hop t
    reads the gathered shard of device index - t.
    """
    index = lax.axis_index(s.axis)
    if s.strategy == "all_gather":
        body = lambda t, c: visit(t, tuple(_take(x, _source(s, index, t)[0]) for x in gathered), c)  # noqa: E731
        return lax.fori_loop(1, s.shards, body, carry)

    def body(t, state):
        shard, c = state
        following = _send(s, shard)
        return following, visit(t, shard, c)

    shard, carry = lax.fori_loop(1, s.shards - 1, body, (_send(s, shard), carry))
    return visit(s.shards - 1, shard, carry)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(s: _Settings, q, k, v, q_seg, kv_seg):
    return _attend_fwd(s, q, k, v, q_seg, kv_seg)[0]


def _attend_fwd(s: _Settings, q, k, v, q_seg, kv_seg):
    b, sq, h, _ = q.shape
    out, lse = _in_head_groups(
        s.head_groups,
        functools.partial(_forward, s, q_seg=q_seg, kv_seg=kv_seg),
        (q, k, v),
        (2, 2, 2),
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, sq), jnp.float32)),
        (2, 1),
        loop=s.group_loop,
    )
    # Named like the one-device kernels' results, so that a remat policy that keeps attention
    # (bpt.ops.remat: attention_saveable) keeps the merged output and logsumexp: the layer's
    # backward then never runs the ring's forward, hops and transfers, a second time.
    out, lse = checkpoint_name(out, ATTENTION_OUT), checkpoint_name(lse, ATTENTION_LSE)
    return out, (q, k, v, q_seg, kv_seg, out, lse)


def _attend_bwd(s: _Settings, residuals, d_out):
    q, k, v, q_seg, kv_seg, out, lse = residuals
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # rows that see nothing: zero probabilities
    dq, dk, dv = _in_head_groups(
        s.head_groups,
        functools.partial(_backward, s, q_seg=q_seg, kv_seg=kv_seg),
        (q, k, v, out, lse, d_out),
        (2, 2, 2, 2, 1, 2),
        tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)),
        (2, 2, 2),
        loop=s.group_loop,
    )
    return dq, dk, dv, None, None


def _in_head_groups(groups: int, fn, args, arg_axes, results, result_axes, *, loop: bool = False):
    """fn(*args) computed for `groups` slices of the heads, one group after another: each arg
    is sliced along its heads axis (arg_axes) and the groups' results (ShapeDtypeStructs)
    joined along their own (result_axes). One group's temporaries (the visiting shard, its
    dK/dV sums in flight) are all that is live: memory a group is 1/groups.

    The groups are unrolled, each group's inputs passed through an optimization barrier with
    the previous group's results, so that XLA runs them in order. A lax.fori_loop over the
    groups made XLA's GPU compiler crash (a segmentation fault, jax 0.11.2) with two sequence
    shards, where the loop's body holds the ring's transfers directly
    (scripts/repro_ring_segfault.py; docs/notes/multi_gpu.md). loop: a lax.fori_loop over
    the groups instead, for all_gather, whose body holds no ppermute: one group's program
    instead of `groups` copies. XLA's GPU compiler takes that loop with two shards (GPT-1B at
    512K over two H200s: the step compiles and trains, 81 s of compiling where the 512K
    all_gather step over four had not compiled in 403 s unrolled)."""
    if groups == 1:
        return fn(*args)

    def group(g, filled, args):  # group g's results written into filled
        piece = (lax.dynamic_slice_in_dim(x, g * (x.shape[a] // groups), x.shape[a] // groups, axis=a)
                 for x, a in zip(args, arg_axes))  # fmt: skip
        return tuple(
            lax.dynamic_update_slice_in_dim(r, p.astype(r.dtype), g * p.shape[a], a)
            for r, p, a in zip(filled, fn(*piece), result_axes)
        )

    filled = tuple(jnp.zeros(r.shape, r.dtype) for r in results)
    if loop:
        return lax.fori_loop(0, groups, lambda g, filled: group(g, filled, args), filled)
    for g in range(groups):
        if g:  # group g's inputs become available only once group g - 1's results are in
            filled, args = lax.optimization_barrier((filled, args))
        filled = group(g, filled, args)
    return filled


def _forward(s: _Settings, q, k, v, *, q_seg, kv_seg):
    """(out, lse) of the whole sequence's attention for these heads."""
    index = lax.axis_index(s.axis)
    out, lse = _hop_forward(s, True, None, q, k, v, q_seg, kv_seg)
    own = (out.astype(jnp.float32), lse)

    def visit(t, shard, carry):
        before = _source(s, index, t)[1]
        return logsumexp_merge(
            *carry, *_hop_forward(s, False, before, q, shard[0], shard[1], q_seg, shard[2])
        )

    shard = (k, v, kv_seg)
    gathered = tuple(_gather(s, x) for x in shard) if s.strategy == "all_gather" else None
    out, lse = _hops(s, visit, own, shard, gathered)
    return out.astype(q.dtype), lse


def _backward(s: _Settings, q, k, v, out, lse, d_out, *, q_seg, kv_seg):
    """(dq, dk, dv) of the whole sequence's attention for these heads (lse is +inf where a
    query sees no key)."""
    index = lax.axis_index(s.axis)
    d_lse = jnp.zeros(lse.shape, jnp.float32)
    grads = functools.partial(_hop_backward, s, q=q, q_seg=q_seg, out=out, lse=lse, d_out=d_out, d_lse=d_lse)
    dq, dk, dv = grads(True, None, k=k, v=v, kv_seg=kv_seg)
    shard = (k, v, kv_seg)
    if s.strategy == "all_gather":
        gathered = tuple(_gather(s, x) for x in shard)
        zeros = lambda x: jnp.zeros((s.shards, *x.shape), jnp.float32)  # noqa: E731
        dk_all = lax.dynamic_update_index_in_dim(zeros(k), dk, index, 0)
        dv_all = lax.dynamic_update_index_in_dim(zeros(v), dv, index, 0)

        def visit(t, shard, carry):
            dq, dk_all, dv_all = carry
            src, before = _source(s, index, t)
            dq_t, dk_t, dv_t = grads(False, before, k=shard[0], v=shard[1], kv_seg=shard[2])
            put = lambda all_, d: lax.dynamic_update_index_in_dim(all_, d, src, 0)  # noqa: E731
            return dq + dq_t, put(dk_all, dk_t), put(dv_all, dv_t)

        dq, dk_all, dv_all = _hops(s, visit, (dq, dk_all, dv_all), shard, gathered)
        dk = lax.psum_scatter(dk_all, s.axis, scatter_dimension=0)
        dv = lax.psum_scatter(dv_all, s.axis, scatter_dimension=0)
    else:
        # dK/dV accumulators travel with their shard, one hop behind it: after the last hop's
        # send they are home.
        def visit(t, shard, carry):
            dq, dkv = carry
            dq_t, dk_t, dv_t = grads(False, _source(s, index, t)[1], k=shard[0], v=shard[1], kv_seg=shard[2])
            return dq + dq_t, _send(s, (dkv[0] + dk_t, dkv[1] + dv_t))

        dq, (dk, dv) = _hops(s, visit, (dq, _send(s, (dk, dv))), shard, None)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_attend.defvjp(_attend_fwd, _attend_bwd)


# ----------------------------------------------------------------------------- public functions


def head_groups_for(
    batch: int, local_tokens: int, kv_heads: int, head_dim: int, *, shards: int, strategy: str
) -> int:
    """The fewest groups of heads (a divisor of kv_heads) whose float32 dK/dV sums stay within
    GROUP_BYTES per device: the ring's travel with their shard (and are received into a
    second buffer), all_gather's cover every gathered shard. Long shards are thus attended a
    few heads at a time, which bounds what context parallelism holds beyond the local
    attention's own memory; short ones keep all heads in one group (fewer, larger hops)."""
    sums = 2 * 4 * batch * local_tokens * head_dim * (shards if strategy == "all_gather" else 1)
    for groups in range(1, kv_heads + 1):
        if kv_heads % groups == 0 and sums * (kv_heads // groups) <= GROUP_BYTES:
            return groups
    return kv_heads


def context_parallel_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    mesh: Mesh,
    causal: bool = True,
    segment_ids: Array | None = None,
    strategy: str = "ring",
    layout: str = "zigzag",
    impl: str = "auto",
    q_chunk_size: int = 512,
    kv_chunk_size: int = 512,
    axis: str = "sequence",
    batch_axes: tuple[str, ...] = ("data", "fsdp"),
    head_axis: str = "tensor",
    head_groups: int | str = "auto",
) -> Array:
    """Exact attention of inputs already in `layout` order, sequence sharded over mesh[axis].

    q [batch, seq, heads, head_dim], k and v [batch, seq, kv_heads, head_dim] (GQA/MQA),
    segment_ids [batch, seq] or None, all permuted by layout_permutation(seq, shards, layout).
    The batch is sharded over batch_axes and the heads over head_axis where the mesh has them.
    Returns the output in the same (layout) order. Differentiable (a custom_vjp).
    head_groups: attend this many groups of heads one after another (a divisor of each
    device's key/value heads), so that what travels between devices is that much smaller;
    'auto' (head_groups_for) splits long shards only.
    """
    check_qkv(q, k, v)
    for name, value, allowed in (("strategy", strategy, STRATEGIES), ("layout", layout, LAYOUTS)):
        if value not in allowed:
            raise ValueError(f"unknown context-parallel {name} {value!r}; allowed: {', '.join(allowed)}")
    shards = mesh.shape[axis] if axis in mesh.axis_names else 1
    seq = q.shape[1]
    if k.shape[1] != seq:
        raise ValueError(
            f"context-parallel attention needs equal query and key lengths; got {seq} and {k.shape[1]}"
        )
    if seq % (shards * (2 if layout == "zigzag" and causal else 1)):
        raise ValueError(f"sequence length {seq} does not split into {shards} {layout} shards")
    q_seg, kv_seg = split_segment_ids(segment_ids, seq, seq)
    local = seq // shards
    chunk = lambda c: min(c, local // 2 if layout == "zigzag" and causal and shards > 1 else local)  # noqa: E731
    batch = mesh_axes(mesh, batch_axes)
    heads = mesh_axes(mesh, (head_axis,))
    seq_axis = axis if shards > 1 else None
    rows = PartitionSpec(batch, seq_axis, heads, None)
    segs = PartitionSpec(batch, seq_axis)

    local_chunks = (chunk(q_chunk_size), chunk(kv_chunk_size))
    if shards == 1:  # nothing to send: one device's attention (sharded over batch and heads)
        body = functools.partial(_one_shard, impl=impl, causal=causal, chunks=local_chunks)
    else:
        impl = MERGED.resolve(impl, q)  # what each hop runs: its logsumexp merges the hops
        local_kv_heads = k.shape[2] // math.prod(mesh.shape[a] for a in heads or ())
        batch_size = q.shape[0] // math.prod(mesh.shape[a] for a in batch or ())
        groups = _check_head_groups(head_groups, local_kv_heads)
        if groups == "auto":
            groups = head_groups_for(batch_size, local, local_kv_heads, q.shape[3], shards=shards, strategy=strategy)
        kernel = tuple(sorted(current_settings().items()))
        settings = _Settings(axis, shards, strategy, layout, causal, impl, *local_chunks, groups, kernel=kernel)
        body = functools.partial(_attend, settings)
    seg_specs = (None, None) if q_seg is None else (segs, segs)
    return jax.shard_map(
        body, mesh=mesh, in_specs=(rows, rows, rows, *seg_specs), out_specs=rows, check_vma=False
    )(q, k, v, q_seg, kv_seg)


def _one_shard(q, k, v, q_seg, kv_seg, *, impl: str, causal: bool, chunks: tuple[int, int]):
    """One device's attention over its own (unsplit) sequence."""
    seg = None if q_seg is None else (q_seg, kv_seg)
    return attention(
        q, k, v, impl=impl, causal=causal, segment_ids=seg, q_chunk_size=chunks[0], kv_chunk_size=chunks[1]
    )


def _check_head_groups(head_groups, kv_heads: int):
    if head_groups == "auto":
        return head_groups
    if (
        isinstance(head_groups, bool)
        or not isinstance(head_groups, int)
        or head_groups < 1
        or kv_heads % head_groups
    ):
        raise ValueError(
            f"context-parallel head_groups must be 'auto' or a positive divisor of the {kv_heads} "
            f"key/value heads each device holds; got {head_groups!r}"
        )
    return head_groups


def _natural_order(fn, q, k, v, *, mesh, causal, segment_ids, layout, axis, **kwargs):
    shards = mesh.shape[axis] if axis in mesh.axis_names else 1
    if layout == "auto":
        layout = "striped" if segment_ids is not None else "zigzag"
    if not causal:
        layout = "none"
    perm = layout_permutation(q.shape[1], shards, layout)
    seg = None if segment_ids is None else to_layout(segment_ids, perm)
    out = fn(
        to_layout(q, perm),
        to_layout(k, perm),
        to_layout(v, perm),
        mesh=mesh,
        causal=causal,
        segment_ids=seg,
        layout=layout,
        axis=axis,
        **kwargs,
    )
    return from_layout(out, perm)


def ring_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    mesh: Mesh,
    causal: bool = True,
    segment_ids: Array | None = None,
    layout: str = "auto",
    impl: str = "auto",
    q_chunk_size: int = 512,
    kv_chunk_size: int = 512,
    axis: str = "sequence",
    head_groups: int | str = "auto",
) -> Array:
    """Exact attention by ring attention over mesh[axis]; equal to reference_attention.

    Takes and returns global arrays in natural token order ([batch, seq, heads, head_dim];
    k and v may have fewer heads). Inside, the tokens are permuted into `layout` ('auto':
    striped with segment_ids, else zigzag; non-causal attention needs none), sharded over
    `axis` (and the batch over the mesh's data/fsdp axes, the heads over tensor), and the key/
    value shards travel around the ring. impl: the local attention of each hop ('auto': bpt's
    flash kernels on a GPU for bf16/fp16, else the blockwise scan; 'blockwise'; 'pallas').
    """
    return _natural_order(
        context_parallel_attention,
        q,
        k,
        v,
        mesh=mesh,
        causal=causal,
        segment_ids=segment_ids,
        layout=layout,
        axis=axis,
        strategy="ring",
        impl=impl,
        q_chunk_size=q_chunk_size,
        kv_chunk_size=kv_chunk_size,
        head_groups=head_groups,
    )


def all_gather_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    mesh: Mesh,
    causal: bool = True,
    segment_ids: Array | None = None,
    layout: str = "auto",
    impl: str = "auto",
    q_chunk_size: int = 512,
    kv_chunk_size: int = 512,
    axis: str = "sequence",
    head_groups: int | str = "auto",
) -> Array:
    """As ring_attention, with the key/value shards gathered once instead of passed around."""
    return _natural_order(
        context_parallel_attention,
        q,
        k,
        v,
        mesh=mesh,
        causal=causal,
        segment_ids=segment_ids,
        layout=layout,
        axis=axis,
        strategy="all_gather",
        impl=impl,
        q_chunk_size=q_chunk_size,
        kv_chunk_size=kv_chunk_size,
        head_groups=head_groups,
    )
