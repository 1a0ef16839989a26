"""Decode attention over a key/value cache: split_kv and the Pallas kernel (interpret mode)
against the materialized reference, fp32, on fresh random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err

from bpt.ops import decode_attention, reference_attention
from bpt.ops.decode import last_visible_slot, merge_partials, partial_attention, split_kv_partial
from bpt.ops.kernels.decode import _lean_table, _merge, _tile_table, decode_partial

MAX_LEN = 128
# Jit-ed: the interpreted kernel's loops run far faster compiled than op by op.
decode = jax.jit(decode_attention, static_argnames=("impl", "chunk_size", "num_splits"))
kernel = jax.jit(decode_partial, static_argnames=("num_splits", "schedule", "lean_waves", "block_k"))


def caches(key, batch, heads, kv_heads, q_len, head_dim=16):
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (batch, q_len, heads, head_dim))
    k = jax.random.normal(kk, (batch, MAX_LEN, kv_heads, head_dim))
    v = jax.random.normal(kv, (batch, MAX_LEN, kv_heads, head_dim))
    return q, k, v


def with_garbage(cache, lengths):
    """Large values written in every slot from each sequence's length on: they must be masked."""
    slots = jnp.arange(cache.shape[1])[None, :, None, None]
    return jnp.where(slots >= jnp.asarray(lengths)[:, None, None, None], 1e4, cache)


@pytest.mark.parametrize(
    "heads,kv_heads,q_len", [(4, 4, 1), (4, 2, 3), (4, 1, 1)], ids=["mha-q1", "gqa-q3", "mqa-q1"]
)
def test_split_kv_and_the_kernel_equal_the_reference(key, heads, kv_heads, q_len):
    """Positions at the start, in the middle and at the end of the cache; ragged lengths."""
    q, k, v = caches(key, 3, heads, kv_heads, q_len)
    ends = np.array([q_len, 77, MAX_LEN])  # each sequence's length; its queries are its last tokens
    positions = jnp.asarray(ends[:, None] - q_len + np.arange(q_len)[None])
    k, v = with_garbage(k, ends), with_garbage(v, ends)
    expected = decode(q, k, v, positions, lengths=jnp.asarray(ends), impl="reference")
    for impl, options in [("split_kv", dict(chunk_size=48)), ("pallas", dict(num_splits=3))]:
        out = decode(q, k, v, positions, lengths=jnp.asarray(ends), impl=impl, **options)
        assert rel_err(out, expected) < 1e-5, impl
    # The reference itself is the matching rows of causal attention over each sequence.
    for b, end in enumerate(ends):
        full = jax.jit(reference_attention, static_argnames="causal")(
            q[b : b + 1], k[b : b + 1, :end], v[b : b + 1, :end], causal=True
        )
        assert rel_err(expected[b : b + 1], full[:, -q_len:]) < 1e-5


def test_a_layer_of_a_stacked_cache_is_read_and_written_in_place(key):
    """A model's cache as one stack [layers, batch, slots, ...] and a layer index: every impl
    reads that layer's part, and write_cache writes only there."""
    from bpt.ops.decode import write_cache

    q, k, v = caches(key, 2, 4, 2, 1)
    k_stack = jnp.stack([jnp.full_like(k, 1e3), k, -k])
    v_stack = jnp.stack([jnp.full_like(v, 1e3), v, 2 * v])
    positions = jnp.array([[40], [127]])
    stacked = jax.jit(decode_attention, static_argnames=("impl", "num_splits"))
    for layer, (k_l, v_l) in ((1, (k, v)), (2, (-k, 2 * v))):
        expected = decode(q, k_l, v_l, positions, impl="reference")
        for impl, options in [("reference", {}), ("split_kv", {}), ("pallas", dict(num_splits=3))]:
            out = stacked(q, k_stack, v_stack, positions, impl=impl, layer=jnp.int32(layer), **options)
            assert rel_err(out, expected) < 1e-5, (layer, impl)
    new = jnp.ones((2, 1, 2, 16))
    written = write_cache(k_stack, new, positions, layer=jnp.int32(2))
    np.testing.assert_array_equal(written, k_stack.at[2, 0, 40].set(new[0, 0]).at[2, 1, 127].set(new[1, 0]))
    with pytest.raises(ValueError, match="stacks"):
        decode_attention(q, k, v, positions, layer=1)


def test_an_int8_cache_is_read_alike_by_every_impl(key):
    """quantize_kv'd caches with their scales: split_kv, the kernel and tree decoding (one
    device) equal the reference over the dequantized cache; all are near the bf16-free
    original (int8 keeps about 2 decimal digits)."""
    from bpt.ops.decode import dequantize_kv, quantize_kv
    from bpt.parallel import make_mesh, tree_decode_attention

    q, k, v = caches(key, 2, 4, 2, 1)
    (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
    assert k8.dtype == jnp.int8 and ks.shape == k.shape[:-1]
    assert rel_err(dequantize_kv(k8, ks, jnp.float32), k) < 1e-2
    positions, ends = jnp.array([[40], [127]]), np.array([41, 128])
    k8, v8 = with_garbage(k8, ends).astype(jnp.int8), with_garbage(v8, ends).astype(jnp.int8)
    scales = dict(k_scale=ks, v_scale=vs)
    expected = decode(
        q, dequantize_kv(k8, ks, jnp.float32), dequantize_kv(v8, vs, jnp.float32), positions, impl="reference"
    )
    assert rel_err(expected, decode(q, k, v, positions, impl="reference")) < 2e-2
    tree = jax.jit(tree_decode_attention, static_argnames=("mesh", "impl"))
    mesh = make_mesh(sequence=1, devices=jax.devices()[:1])
    runs = {
        "reference": decode(q, k8, v8, positions, impl="reference", **scales),
        "split_kv": decode(q, k8, v8, positions, impl="split_kv", chunk_size=48, **scales),
        "pallas": decode(q, k8, v8, positions, impl="pallas", num_splits=3, **scales),
        "pallas, stacked": decode(
            q,
            jnp.stack([k8, k8]),
            jnp.stack([v8, v8]),
            positions,
            impl="pallas",
            layer=jnp.int32(1),
            k_scale=jnp.stack([0 * ks, ks]),
            v_scale=jnp.stack([0 * vs, vs]),
        ),
        "tree": tree(q, k8, v8, positions, mesh=mesh, impl="split_kv", **scales),
    }
    for name, out in runs.items():  # (the stack's layer 0 has zero scales: it must not be read)
        assert rel_err(out, expected) < 1e-5, name
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        decode_attention(q, k8, v8, positions, k_scale=ks)


@pytest.mark.parametrize(
    "schedule,splits,waves",
    [("stream_k", 2, None), ("stream_k", 16, None), ("split", 3, None), ("lean", 1, None), ("lean", 5, None),
     ("lean", None, 3)],
)  # fmt: skip
def test_kernel_schedules_on_a_ragged_batch(key, schedule, splits, waves):
    """Shared positions (no lengths) and per-sequence lengths, tiles of 16 slots, more tiles
    than work (empty tiles) and fewer (several blocks a tile); lean by programs a SM (a CPU
    counts 8 SMs: 24 programs)."""
    q, k, v = caches(key, 4, 4, 2, 1)
    lengths = jnp.array([1, 16, 17, 100])
    last = last_visible_slot(jnp.array([120]), 4, lengths)
    expected = decode(q, k, v, jnp.array([120]), lengths=lengths, impl="reference")
    part = kernel(q, k, v, last, num_splits=splits, schedule=schedule, lean_waves=waves, block_k=16)
    assert rel_err(part.out, expected) < 1e-5
    reference = jax.jit(split_kv_partial, static_argnames="chunk_size")(q, k, v, last, chunk_size=32)
    np.testing.assert_allclose(part.lse, reference.lse, rtol=1e-5, atol=1e-5)  # lse near 0: absolute


def test_default_tiles_leave_each_program_enough_blocks(key):
    """Programs per K/V head by default: at most WAVES a SM over the K/V heads, none with
    fewer than MIN_TILE_BLOCKS of the cache's blocks, and of those counts the one that fills
    its last wave of SMs best (batch 1 at 128K on 132 SMs: 33 a head, 2 or 4 full waves,
    not the 64 the block bound allows, 3.9 or 7.8); the kernel at its default count is exact."""
    from bpt.ops.kernels.decode import MIN_TILE_BLOCKS, WAVES, default_tiles

    assert (WAVES, MIN_TILE_BLOCKS) == (8, 32)
    assert default_tiles(1, 2048, 8, 132) == 33  # 128K slots in blocks of 64: 264 programs
    assert default_tiles(1, 2048, 16, 132) == 33  # 528 programs
    assert default_tiles(1, 512, 16, 132) == 16  # 32K: the block bound, under 2 waves
    assert default_tiles(8, 2048, 8, 132) == 132  # batch 8: WAVES' count
    assert default_tiles(1, 8192, 16, 132) == 66  # 512K, 16 K/V heads
    assert default_tiles(1, 16, 8, 132) == 1  # a short cache: one program a head
    q, k, v = caches(key, 2, 4, 2, 1)
    lengths = jnp.array([17, 100])
    last = last_visible_slot(jnp.array([120]), 2, lengths)
    expected = decode(q, k, v, jnp.array([120]), lengths=lengths, impl="reference")
    assert rel_err(kernel(q, k, v, last, block_k=16).out, expected) < 1e-5  # 2 x 8 blocks: one tile


def test_stream_k_tiles_are_equal_and_cover_each_sequence_once():
    visible = jnp.array([0, 3, 40, 5])
    table = np.asarray(_tile_table(visible, tiles=8, schedule="stream_k", max_blocks=64))
    sizes = table[:, 2] - table[:, 1]
    assert sizes.max() == -(-48 // 8)  # the work (48 blocks) cut into 8 equal tiles
    for seq, blocks in enumerate(np.asarray(visible)):
        rows = table[(table[:, 0] == seq) & (sizes > 0)]
        covered = sorted(b for _, first, end, _ in rows for b in range(first, end))
        assert covered == list(range(blocks)), seq
    assert list(table[:, 0]) == sorted(table[:, 0])  # in sequence order
    split = np.asarray(_tile_table(visible, tiles=8, schedule="split", max_blocks=64, full_blocks=visible - 1))
    assert list(split[:, 3]) == list(np.repeat(np.asarray(visible) - 1, 2))  # each tile's sequence's
    assert (split[:, 2] - split[:, 1]).max() == 32  # two splits a sequence: the longest one's half


def test_lean_pieces_cover_every_sequence_and_head_once_in_equal_ranges():
    """The lean schedule's ranges cross head and sequence borders: each program's pieces
    add up to an equal share of all the blocks, and the pieces of each (sequence, K/V head)
    cover its blocks once."""
    visible, kv_heads, programs = np.array([0, 3, 40, 5]), 2, 8
    pieces, spans = (np.asarray(x) for x in _lean_table(jnp.asarray(visible), jnp.asarray(visible - 1), kv_heads, programs))
    total = kv_heads * visible.sum()
    size = -(-total // programs)
    assert spans[0, 0] == 0 and spans[-1, 1] == len(pieces) and (spans[1:, 0] == spans[:-1, 1]).all()
    shares = [int((pieces[lo:hi, 3] - pieces[lo:hi, 2]).sum()) for lo, hi in spans]
    assert shares == [min(size, max(0, total - p * size)) for p in range(programs)]
    assert max(hi - lo for lo, hi in spans) > 1  # some program's range crosses a border
    for seq, blocks in enumerate(visible):
        for head in range(kv_heads):
            mine = pieces[(pieces[:, 0] == seq) & (pieces[:, 1] == head)]
            covered = sorted(b for *_, first, end, _ in mine for b in range(first, end))
            assert covered == list(range(blocks)), (seq, head)
            assert (mine[:, 4] == blocks - 1).all()  # the sequence's blocks that every row sees


def test_the_lean_schedule_reads_a_stacked_int8_cache(key):
    """Lean Attention's ranges with a layer of a stacked int8 cache and GQA at batch 1 (one
    K/V head's blocks split over programs that also take the next head's)."""
    from bpt.ops.decode import dequantize_kv, quantize_kv

    q, k, v = caches(key, 1, 4, 2, 1)
    (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
    last = last_visible_slot(jnp.array([100]), 1)
    expected = decode(
        q, dequantize_kv(k8, ks, jnp.float32), dequantize_kv(v8, vs, jnp.float32), jnp.array([100]), impl="reference"
    )
    lean = jax.jit(decode_partial, static_argnames=("num_splits", "schedule", "block_k"))
    part = lean(
        q, jnp.stack([0 * k8, k8]), jnp.stack([0 * v8, v8]), last, layer=jnp.int32(1),
        k_scale=jnp.stack([0 * ks, ks]), v_scale=jnp.stack([0 * vs, vs]), num_splits=3, schedule="lean", block_k=16,
    )  # fmt: skip
    assert rel_err(part.out, expected) < 1e-5


def test_merging_partials_over_any_split_of_the_keys_is_exact(key):
    q, k, v = caches(key, 2, 4, 2, 2)
    last = last_visible_slot(jnp.array([90, 91]), 2)
    cuts = (0, 5, 64, 91, MAX_LEN)  # the last part sees no key: it must weigh nothing

    @jax.jit
    def whole_and_merged(q, k, v, last):
        mask = lambda slots: (slots[None, None, :] <= last[:, :, None])[:, None, None]  # noqa: E731
        whole = partial_attention(q, k, v, mask(jnp.arange(MAX_LEN)))
        parts = [
            partial_attention(q, k[:, a:b], v[:, a:b], mask(jnp.arange(a, b))) for a, b in zip(cuts, cuts[1:])
        ]
        return whole, merge_partials(jax.tree.map(lambda *x: jnp.stack(x), *parts))

    whole, merged = whole_and_merged(q, k, v, last)
    assert rel_err(merged.out, whole.out) < 1e-5
    np.testing.assert_allclose(merged.lse, whole.lse, rtol=1e-5)


@pytest.mark.parametrize("count", [1, 3])
def test_the_kernels_merge_equals_logsumexp_by_segments(key, count):
    """The kernel's dense merge (reductions for one group, a one-hot product for more)
    against logsumexp written out per group with segment sums; empty partials (lse
    -inf) weigh nothing, also where they come first (two of them meet before any other: a
    GPU's tree of partial sums), and a group, or a row, with none but empty ones gives
    zeros and -inf."""
    n = 7
    ko, kl, ki = jax.random.split(key, 3)
    out = jax.random.normal(ko, (n, 2, 5, 16))
    lse = 3.0 * jax.random.normal(kl, (n, 2, 5))
    lse = lse.at[2].set(-jnp.inf).at[5, 1].set(-jnp.inf)
    ids = jnp.sort(jax.random.randint(ki, (n,), 0, count)) if count > 1 else jnp.zeros((n,), jnp.int32)
    if count > 1:
        ids = ids.at[-1].set(0)  # unsorted is allowed
        lse = jnp.where((ids == count - 1)[:, None, None], -jnp.inf, lse)  # a group of empty partials
    else:
        lse = lse.at[:2].set(-jnp.inf).at[:, 1, 3].set(-jnp.inf)  # empty first; a row of empty ones
    merged, merged_lse = jax.jit(_merge, static_argnums=3)(ids, out, lse, count)
    top = jax.ops.segment_max(lse, ids, num_segments=count)
    weight = jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0)[ids])
    total = jax.ops.segment_sum(weight, ids, num_segments=count)
    expected = jax.ops.segment_sum(out * weight[..., None], ids, num_segments=count) / jnp.where(
        total > 0, total, 1.0
    )[..., None]
    expected_lse = jnp.where(total > 0, jnp.where(jnp.isfinite(top), top, 0.0) + jnp.log(total), -jnp.inf)
    np.testing.assert_allclose(merged, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(jnp.isinf(merged_lse), jnp.isinf(expected_lse))
    np.testing.assert_allclose(merged_lse, expected_lse, rtol=1e-5)
    if count > 1:
        assert not jnp.any(merged[count - 1]) and jnp.all(merged_lse[count - 1] == -jnp.inf)
    else:
        assert not jnp.any(merged[0, 1, 3]) and merged_lse[0, 1, 3] == -jnp.inf


@pytest.mark.parametrize("heads,kv_heads,splits", [(4, 4, 1), (4, 2, 3)], ids=["mha-1", "gqa-3"])
def test_the_kernel_at_batch_1_equals_the_reference(key, heads, kv_heads, splits):
    """One sequence (the merge's one-group path), its tiles of one or several programs."""
    q, k, v = caches(key, 1, heads, kv_heads, 1)
    lengths = jnp.array([100])
    k, v = with_garbage(k, lengths), with_garbage(v, lengths)
    last = last_visible_slot(jnp.array([99]), 1, lengths)
    expected = decode(q, k, v, jnp.array([99]), lengths=lengths, impl="reference")
    assert rel_err(kernel(q, k, v, last, num_splits=splits).out, expected) < 1e-5


@pytest.mark.parametrize("schedule,splits", [("stream_k", 3), ("stream_k", 16), ("split", 5), ("stream_k", None)])
@pytest.mark.parametrize("slots", [[100], [15], [-1], [40, 127, -1], [127, 3, 64]], ids=str)
def test_tiles_computed_in_the_kernel_equal_the_tile_tables(key, schedule, splits, slots):
    """stream_k and split (table_in_kernel, the default with them): each program computes its
    tile from the queries' slots, at batch 1 and over ragged batches (a sequence that sees
    nothing among them), one query a sequence and three (the later ones one and two slots
    on, a GQA group's rows each), with a layer of a stacked int8 cache; the outputs and
    logsumexps equal the tile table's, and the kernel reads no table."""
    from bpt.ops.decode import quantize_kv

    q_len = 1 if len(slots) > 1 or slots[0] != 15 else 3  # three queries at [15]: 15, 16, 17
    q, k, v = caches(key, len(slots), 4, 2, q_len)
    (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
    stacked = dict(layer=jnp.int32(1), k_scale=jnp.stack([0 * ks, ks]), v_scale=jnp.stack([0 * vs, vs]))
    last = jnp.array(slots, jnp.int32)[:, None] + jnp.where(jnp.array(slots)[:, None] < 0, 0, jnp.arange(q_len))
    run = jax.jit(decode_partial, static_argnames=("num_splits", "schedule", "block_k", "table_in_kernel"))
    args = (q, jnp.stack([0 * k8, k8]), jnp.stack([0 * v8, v8]), last)
    options = dict(num_splits=splits, schedule=schedule, block_k=16, **stacked)
    inside, table = run(*args, **options), run(*args, **options, table_in_kernel=False)
    np.testing.assert_allclose(inside.out, table.out, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.isinf(inside.lse), np.isinf(table.lse))
    np.testing.assert_allclose(inside.lse, table.lse, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.all(np.isinf(inside.lse), axis=(1, 2)), np.array(slots) < 0)
    if q_len > 1:  # the queries see different slots: their rows differ
        assert not np.allclose(inside.out[0, 0], inside.out[0, 2])
    jaxpr = jax.make_jaxpr(lambda *a: decode_partial(*a, **options))(*args).jaxpr
    launch = next(eqn for eqn in jaxpr.eqns if eqn.primitive.name == "pallas_call")
    assert len(launch.invars) == 7  # layer, q, the slots, k, v and their scales: no table
    with pytest.raises(ValueError, match="table_in_kernel takes the schedules stream_k and split; lean reads"):
        decode_partial(*args[:3], last, schedule="lean", table_in_kernel=True, block_k=16, **stacked)


@pytest.mark.parametrize("batch,q_len,schedule", [(1, 1, "stream_k"), (3, 2, "stream_k"), (2, 1, "split")])
def test_the_kernel_with_computed_tiles_lowers_for_cuda(batch, q_len, schedule):
    """The kernel that computes its tiles (loops over the batch's slots, q_len scalar reads a
    sequence) lowers through Triton for CUDA (checked without a GPU): one launch whose
    operands hold no tile table, the slots [batch, q_len] int32 as they came."""
    q = jax.ShapeDtypeStruct((batch, q_len, 8, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((batch, 4096, 2, 128), jnp.bfloat16)
    last = jax.ShapeDtypeStruct((batch, q_len), jnp.int32)
    call = jax.jit(lambda *a: decode_partial(*a, schedule=schedule, num_splits=4, interpret=False).out)
    text = call.trace(q, cache, cache, last).lower(lowering_platforms=("cuda",)).as_text()
    (launch,) = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    assert f"tensor<{batch}x{q_len}xi32>" in launch and "x4xi32>" not in launch, launch


def test_a_query_that_sees_nothing_gives_zeros(key):
    q, k, v = caches(key, 2, 2, 2, 1)
    for impl in ("reference", "split_kv", "pallas"):
        out = decode(q, k, v, jnp.array([5]), lengths=jnp.array([0, 3]), impl=impl)
        assert float(jnp.abs(out[0]).max()) == 0.0 and float(jnp.abs(out[1]).max()) > 0, impl


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(impl="fast"), "unknown decode attention implementation 'fast'; allowed: reference, split_kv, pallas, auto"),
        (
            dict(q_positions=jnp.zeros((2, 2), jnp.int32)),
            r"q_positions must be \[q_len\] or \[batch, q_len\]",
        ),
        (dict(lengths=jnp.zeros((3,), jnp.int32)), r"lengths must be \[batch\]"),
    ],
)
def test_bad_arguments_are_clear_errors(key, change, message):
    q, k, v = caches(key, 2, 2, 2, 1)
    args = dict(q_positions=jnp.array([3]), impl="reference") | change
    positions = args.pop("q_positions")
    with pytest.raises(ValueError, match=message):
        decode_attention(q, k, v, positions, **args)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        decode_partial(q[..., :12], k[..., :12], v[..., :12], last_visible_slot(jnp.array([3]), 2))


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_the_kernel_inside_a_jitted_program_equals_the_reference(key, splits):
    """Two sequences of 128 and 80 slots over 1, 2 or 4 tiles, the tile table computed in the
    same program as the kernel: on an H100 these read a damaged table (NaN, wrong values or an
    illegal address) until the kernel's computed operands were kept alive past it."""
    q, k, v = caches(key, 2, 4, 2, 1)
    lengths = jnp.array([MAX_LEN, 80])
    last = last_visible_slot(jnp.array([MAX_LEN - 1]), 2, lengths)
    expected = decode(q, k, v, jnp.array([MAX_LEN - 1]), lengths=lengths, impl="reference")
    assert rel_err(kernel(q, k, v, last, num_splits=splits).out, expected) < 1e-5


def test_a_cache_of_any_multiple_of_16_slots_takes_the_kernel(key, monkeypatch):
    """The kernel's default block halves until it divides the cache (80 slots: blocks of 16);
    a length no block divides is a clear error, and auto then takes split_kv on a GPU."""
    import bpt.ops.decode as decode_module

    q, k, v = caches(key, 2, 4, 2, 1)
    k, v = k[:, :80], v[:, :80]
    last = last_visible_slot(jnp.array([79]), 2, jnp.array([80, 33]))
    expected = decode(q, k, v, jnp.array([79]), lengths=jnp.array([80, 33]), impl="reference")
    assert rel_err(kernel(q, k, v, last, num_splits=2).out, expected) < 1e-5
    with pytest.raises(ValueError, match=r"cache length 72 must be a multiple of block_k=16 \(impl='split_kv'"):
        decode_partial(q, k[:, :72], v[:, :72], last)
    monkeypatch.setattr(decode_module.jax, "default_backend", lambda: "gpu")
    resolve = decode_module.resolve_decode_impl
    assert resolve("auto", q_shape=q.shape, kv_heads=2, cache_len=4000) == "pallas"
    assert resolve("auto", q_shape=q.shape, kv_heads=2, cache_len=4004) == "split_kv"
