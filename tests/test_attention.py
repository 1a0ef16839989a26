"""Blockwise attention against the materialized reference: outputs, gradients, memory, cost."""

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_script, rel_err, tree_rel_err

from bpt.ops import attend_query_chunk, attention, blockwise_attention, reference_attention

TOL = 1e-5  # fp32 relative error, outputs and gradients


def make_qkv(key, batch, q_len, kv_len, heads, kv_heads, head_dim):
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (batch, q_len, heads, head_dim), jnp.float32)
    k = jax.random.normal(kk, (batch, kv_len, kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(kv, (batch, kv_len, kv_heads, head_dim), jnp.float32)
    return q, k, v


def random_segments(key, batch, length, num_segments=3):
    """Sorted segment ids with random boundaries (packed documents)."""
    cuts = jax.random.randint(key, (batch, num_segments - 1), 0, length)
    return (jnp.arange(length)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(jnp.int32)


def outputs_and_grads(fn, q, k, v, cotangent):
    @jax.jit
    def run(q, k, v, cotangent):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(cotangent)

    return run(q, k, v, cotangent)


def assert_matches_reference(key, q, k, v, **kwargs):
    chunks = {n: kwargs.pop(n) for n in ("q_chunk_size", "kv_chunk_size", "unroll") if n in kwargs}
    ref = lambda q, k, v: reference_attention(q, k, v, **kwargs)
    blk = lambda q, k, v: blockwise_attention(q, k, v, **kwargs, **chunks)
    cot = jax.random.normal(key, q.shape, q.dtype)
    out_r, grads_r = outputs_and_grads(ref, q, k, v, cot)
    out_b, grads_b = outputs_and_grads(blk, q, k, v, cot)
    assert rel_err(out_b, out_r) < TOL
    # A gradient that is exactly zero (each query sees at most one key, so softmax cancels dQ
    # and dK) is measured against a tenth of the three gradients' norm: its float32 rounding
    # (1e-7 an element) is no error.
    for name, g_b in zip("qkv", grads_b):
        assert np.isfinite(np.asarray(g_b)).all(), f"d{name} has NaN/inf"
    assert tree_rel_err(grads_b, grads_r, floor=0.1) < TOL


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(4, 4, 64), (4, 2, 80), (4, 1, 128)], ids=["mha-d64", "gqa-d80", "mqa-d128"]
)
def test_matches_reference(key, causal, segments, heads, kv_heads, head_dim):
    kx, ks, kc = jax.random.split(key, 3)
    q, k, v = make_qkv(kx, 2, 64, 64, heads, kv_heads, head_dim)
    seg = random_segments(ks, 2, 64) if segments else None
    assert_matches_reference(kc, q, k, v, causal=causal, segment_ids=seg, q_chunk_size=16, kv_chunk_size=8)


@pytest.mark.parametrize(
    "q_chunk,kv_chunk",
    [(64, 64), (8, 8), (32, 8), (8, 32), (1000, 16)],
    ids=["one-chunk", "8x8", "32x8", "8x32", "clamped"],
)
@pytest.mark.parametrize("unroll", [False, True])
def test_chunkings(key, q_chunk, kv_chunk, unroll):
    kx, kc = jax.random.split(key)
    q, k, v = make_qkv(kx, 1, 64, 64, 2, 2, 16)
    assert_matches_reference(
        kc, q, k, v, causal=True, q_chunk_size=q_chunk, kv_chunk_size=kv_chunk, unroll=unroll
    )


@pytest.mark.parametrize("causal", [False, True])
def test_different_query_and_key_lengths(key, causal):
    # Causal attention is aligned at the end: the last query sees every key. With more
    # queries than keys the first queries see nothing and must give zeros.
    kx, ks, kc = jax.random.split(key, 3)
    for q_len, kv_len in [(32, 64), (64, 32)]:
        q, k, v = make_qkv(kx, 2, q_len, kv_len, 4, 2, 16)
        segs = (random_segments(ks, 2, q_len), random_segments(ks, 2, kv_len))
        assert_matches_reference(
            kc, q, k, v, causal=causal, segment_ids=segs, q_chunk_size=8, kv_chunk_size=16
        )


def test_rows_with_nothing_to_attend_give_zeros(key):
    kx, kc = jax.random.split(key)
    q, k, v = make_qkv(kx, 1, 32, 32, 2, 2, 16)
    # Queries in segment 7 have no key of their segment.
    q_seg = jnp.where(jnp.arange(32) < 10, 7, 1)[None]
    kv_seg = jnp.ones((1, 32), jnp.int32)
    for fn in (
        reference_attention,
        lambda *a, **kw: blockwise_attention(*a, **kw, q_chunk_size=8, kv_chunk_size=8),
    ):
        out = fn(q, k, v, causal=True, segment_ids=(q_seg, kv_seg))
        assert np.isfinite(np.asarray(out)).all()
        np.testing.assert_array_equal(np.asarray(out[:, :10]), 0.0)
        assert np.abs(np.asarray(out[:, 10:])).max() > 0
        grads = jax.grad(
            lambda q, k, v: fn(q, k, v, causal=True, segment_ids=(q_seg, kv_seg)).sum(), (0, 1, 2)
        )(q, k, v)
        assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert_matches_reference(
        kc, q, k, v, causal=True, segment_ids=(q_seg, kv_seg), q_chunk_size=8, kv_chunk_size=8
    )


def test_query_chunk_logsumexp_and_its_gradient(key):
    kx, kw = jax.random.split(key)
    q, k, v = make_qkv(kx, 2, 16, 64, 4, 2, 16)
    w = jax.random.normal(kw, (2, 4, 16))
    start = 24  # the chunk holds queries 24..39 of a causal 64-token sequence

    def direct_lse(q, k):
        kr = jnp.repeat(k, 2, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kr) / 4.0
        mask = (start + jnp.arange(16))[:, None] >= jnp.arange(64)[None, :]
        return jax.nn.logsumexp(jnp.where(mask, s, -jnp.inf), axis=-1)

    def chunk_lse(q, k, start):
        return attend_query_chunk(q, k, v, start, causal=True, kv_chunk_size=8)[1]

    expected = direct_lse(q, k)
    for s in (start, jnp.int32(start)):  # static and traced offsets
        assert rel_err(chunk_lse(q, k, s), expected) < TOL
        g = jax.grad(lambda q, k: (chunk_lse(q, k, s) * w).sum(), (0, 1))(q, k)
        g_ref = jax.grad(lambda q, k: (direct_lse(q, k) * w).sum(), (0, 1))(q, k)
        assert rel_err(g[0], g_ref[0]) < TOL and rel_err(g[1], g_ref[1]) < TOL


def test_entry_point_dispatch(key):
    kx, ks = jax.random.split(key)
    q, k, v = make_qkv(kx, 2, 64, 64, 4, 2, 32)
    seg = random_segments(ks, 2, 64)
    expected = reference_attention(q, k, v, causal=True, segment_ids=seg)
    for impl in ("reference", "blockwise", "auto"):
        out = attention(q, k, v, impl=impl, causal=True, segment_ids=seg, q_chunk_size=16, kv_chunk_size=16)
        assert rel_err(out, expected) < TOL, impl


def test_causal_skipping_shows_in_cost_analysis():
    # XLA's cost analysis counts a while loop's body once, so the loops are unrolled here;
    # with 8 x 8 chunks a causal pass visits 36 of the 64 blocks.
    q = jnp.zeros((1, 1024, 2, 32))

    def flops(causal):
        fn = jax.jit(
            lambda q: blockwise_attention(
                q, q, q, causal=causal, q_chunk_size=128, kv_chunk_size=128, unroll=True
            )
        )
        cost = fn.lower(q).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    ratio = flops(True) / flops(False)
    assert 0.5 <= ratio < 0.6, ratio


@pytest.mark.parametrize("causal", [False, True])
def test_blockwise_visits_only_the_chunks_of_a_query_chunks_documents(key, causal):
    """With segment ids whose keys' are sorted (packed documents) a query chunk's scan visits
    only the key/value chunks that hold its documents: not-a-number in the keys and values of
    a document no query has (whole chunks), which a visited chunk would carry into P V even
    masked (0 x NaN), leaves the output and dK/dV finite and exact; so does NaN in the queries
    and dO of a document no key has."""
    q, k, v, d_out = (jax.random.normal(x, (1, 96, 2, 16)) for x in jax.random.split(key, 4))
    chunks = dict(q_chunk_size=32, kv_chunk_size=32)

    def ids(*runs):  # (segment, length) runs back to back
        return jnp.concatenate([jnp.full((1, n), i, jnp.int32) for i, n in runs], axis=1)

    q_ids, kv_ids = ids((0, 32), (2, 64)), ids((0, 32), (1, 32), (2, 32))  # keys 32-63: no query's
    alien = (kv_ids == 1)[..., None, None]
    out = blockwise_attention(q, jnp.where(alien, jnp.nan, k), jnp.where(alien, jnp.nan, v), causal=causal,
                              segment_ids=(q_ids, kv_ids), **chunks)  # fmt: skip
    truth = reference_attention(q, k, v, causal=causal, segment_ids=(q_ids, kv_ids))
    assert bool(jnp.all(jnp.isfinite(out))) and rel_err(out, truth) < TOL

    q_ids, kv_ids = ids((0, 32), (1, 32), (2, 32)), ids((0, 32), (2, 64))  # queries 32-63: no key's
    alien = (q_ids == 1)[..., None, None]

    def grads(attend, q, d_out):
        return jax.grad(lambda k, v: jnp.sum(attend(q, k, v) * d_out), argnums=(0, 1))(k, v)

    seg = (q_ids, kv_ids)
    blk = lambda q, k, v: blockwise_attention(q, k, v, causal=causal, segment_ids=seg, **chunks)  # noqa: E731
    ref = lambda q, k, v: reference_attention(q, k, v, causal=causal, segment_ids=seg)  # noqa: E731
    got = grads(blk, jnp.where(alien, jnp.nan, q), jnp.where(alien, jnp.nan, d_out))
    want = grads(ref, jnp.where(alien, 0.0, q), jnp.where(alien, 0.0, d_out))
    for g, w in zip(got, want):
        assert bool(jnp.all(jnp.isfinite(g))) and rel_err(g, w) < TOL


def fwd_bwd_temp_bytes(fn, seq_len, heads=4, head_dim=64):
    x = jax.ShapeDtypeStruct((1, seq_len, heads, head_dim), jnp.float32)
    grad = jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2))
    return jax.jit(grad).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes


def test_backward_memory_is_linear_in_sequence_length():
    blk = lambda q, k, v: blockwise_attention(q, k, v, causal=True, q_chunk_size=256, kv_chunk_size=256)
    ref = lambda q, k, v: reference_attention(q, k, v, causal=True)
    blk_growth = fwd_bwd_temp_bytes(blk, 4096) / fwd_bwd_temp_bytes(blk, 1024)
    ref_growth = fwd_bwd_temp_bytes(ref, 4096) / fwd_bwd_temp_bytes(ref, 1024)
    assert blk_growth < 4.5, blk_growth  # about 4x (less: fixed per-chunk buffers)
    assert ref_growth > 12, ref_growth  # about 16x


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(q_chunk_size=24), "not divisible by q_chunk_size=24"),
        (dict(kv_chunk_size=0), "kv_chunk_size must be a positive integer"),
        (dict(q_chunk_size=-8), "q_chunk_size must be a positive integer"),
    ],
)
def test_bad_chunk_sizes(kwargs, message):
    q = jnp.zeros((1, 64, 2, 16))
    with pytest.raises(ValueError, match=message):
        blockwise_attention(q, q, q, **kwargs)


def test_bad_inputs():
    q = jnp.zeros((1, 64, 3, 16))
    kv = jnp.zeros((1, 64, 2, 16))
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        blockwise_attention(q, kv, kv)
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'; allowed: reference, blockwise, cudnn, pallas, pallas_fp8, auto"):
        attention(q, q, q, impl="flash")
    with pytest.raises(ValueError, match=r"\[batch, seq, heads, head_dim\]"):
        reference_attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="segment_ids must be"):
        blockwise_attention(q, q, q, segment_ids=jnp.zeros((1, 32), jnp.int32))


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the error raised without a GPU")
def test_cudnn_without_gpu_is_a_clear_error():
    q = jnp.zeros((1, 64, 2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="attention implementation 'cudnn' cannot run here: it needs an NVIDIA GPU"):
        attention(q, q, q, impl="cudnn")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU")
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_cudnn_matches_reference_in_bf16(key, kv_heads):
    kx, kc = jax.random.split(key)
    q, k, v = (x.astype(jnp.bfloat16) for x in make_qkv(kx, 2, 1024, 1024, 8, kv_heads, 128))
    cot = jax.random.normal(kc, q.shape, jnp.bfloat16)
    fn = lambda impl: outputs_and_grads(
        lambda q, k, v: attention(q, k, v, impl=impl, causal=True), q, k, v, cot
    )
    # The ground truth in fp32 arithmetic on the same bf16 inputs.
    out_r, grads_r = outputs_and_grads(
        lambda q, k, v: reference_attention(q, k, v, causal=True),
        *(x.astype(jnp.float32) for x in (q, k, v)),
        cot.astype(jnp.float32),
    )
    for impl in ("cudnn", "blockwise"):
        out, grads = fn(impl)
        assert rel_err(out, out_r) < 1e-2, impl
        for g, g_r in zip(grads, grads_r):
            assert rel_err(g, g_r) < 1e-2, impl


def test_auto_takes_bpts_hopper_kernels_only_where_they_lead_cudnn(monkeypatch):
    """On an H100-class GPU auto runs bpt's Hopper kernels where bench_attention measured them
    faster than cuDNN (LEADS): causal, head_dim 128 up to one 128K sequence of 16 heads' work
    (GPT-1B's micro-batches, its steps at 32K-128K, GPT-7B's at 32K), head_dim 64 up to one 16K sequence of 32 heads', both up to
    one 4K sequence's; head_dim 256 causal or not up to one 64K sequence of 8 heads'; non-causal
    at head_dim 128 up to one 64K sequence of 16 heads'; cuDNN beyond."""
    from bpt.ops import select_impl
    from bpt.ops.kernels import attention_hopper

    monkeypatch.setattr(attention_hopper, "is_hopper", lambda: True)

    def impl(batch, seq, heads=16, causal=True, dtype=jnp.bfloat16, head_dim=128):
        q = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), dtype)
        return select_impl(q, q, causal=causal, segment_ids=None, q_chunk_size=1024, kv_chunk_size=1024)

    leads = (impl(1, 2048), impl(8, 2048), impl(16, 1024), impl(2, 8192), impl(1, 16384), impl(1, 32768),
             impl(2, 16384), impl(1, 16384, heads=32), impl(1, 32768, heads=32), impl(2, 32768),
             impl(1, 65536), impl(1, 131072), impl(1, 65536, heads=64), impl(1, 4096, heads=32), impl(1, 4096, head_dim=64),
             impl(1, 2048, head_dim=64), impl(1, 16384, head_dim=64), impl(1, 16384, heads=32, head_dim=64),
             impl(4, 8192, head_dim=64), impl(1, 2048, heads=8, head_dim=256), impl(8, 2048, heads=8, head_dim=256),
             impl(1, 65536, heads=8, head_dim=256), impl(1, 16384, heads=16, head_dim=256),
             impl(1, 65536, heads=8, head_dim=256, causal=False), impl(1, 4096, heads=8, head_dim=256, causal=False),
             impl(1, 2048, causal=False), impl(1, 16384, causal=False), impl(1, 65536, causal=False))
    assert set(leads) == {"pallas"}, leads
    for other in (
        impl(1, 262144),
        impl(2, 131072),
        impl(1, 131072, heads=32),
        impl(1, 32768, head_dim=64),
        impl(2, 16384, heads=32, head_dim=64),
        impl(1, 131072, causal=False),
        impl(2, 65536, causal=False),
        impl(1, 131072, heads=8, head_dim=256),
        impl(1, 65536, heads=16, head_dim=256),
        impl(1, 2048, heads=8, head_dim=192),  # the Hopper backward takes no 192
        impl(1, 2048, causal=False, head_dim=64),
    ):
        assert other != "pallas"  # cuDNN on a GPU; here, without one, blockwise
    assert impl(1, 2048, dtype=jnp.float32) != "pallas"


def test_bench_attention_times_implementations_in_turn(monkeypatch):
    """--repeats: the implementations of a shape are timed one after the other, round after
    round, and each reports its median and every round."""
    bench = load_script("bench_attention")
    clock = iter([1.0, 4.0, 2.0, 8.0, 3.0, 6.0, 9.0, 5.0, 5.0, 7.0, 4.0, 6.0])  # ms, in call order
    calls = []

    def fake_time(fn, *args):
        calls.append(fn)
        return next(clock) * 1e-3

    monkeypatch.setattr(bench, "time_fn", fake_time)
    shape = dict(seq=128, heads=2, head_dim=16, causal=True, batch=1, dtype=jnp.float32)
    xla, blockwise = bench.measure_together(["xla", "blockwise"], repeats=3, **shape)
    assert len(calls) == 12 and calls[0] is not calls[2]  # xla fwd, xla f+b, blockwise fwd, ...
    assert xla["fwd_ms_rounds"] == pytest.approx([1.0, 3.0, 5.0]) and xla["fwd_ms"] == pytest.approx(3.0)
    assert xla["fwd_bwd_ms_rounds"] == pytest.approx([4.0, 6.0, 7.0])
    assert xla["fwd_bwd_ms"] == pytest.approx(6.0)
    assert blockwise["fwd_ms_rounds"] == pytest.approx([2.0, 9.0, 4.0])
    assert blockwise["fwd_ms"] == pytest.approx(4.0)
    flops = 4 * 2 * 128 * 128 * 16 / 2
    assert blockwise["fwd_bwd_tflops"] == pytest.approx(3.5 * flops / 6e-3 / 1e12)
    single = bench.measure("xla", **shape)  # the clock is spent: one more call would fail
    assert "fwd_ms_rounds" not in single and "fwd_error" in single


def test_bench_attention_measures_named_shapes_into_one_table(monkeypatch):
    """scripts/bench_attention.py --shapes: each named shape is a valid measurement (one, at a
    shorter length, by XLA on the CPU), and the table puts every implementation of a shape on
    one line with the first one's forward+backward against cuDNN's."""
    bench = load_script("bench_attention")
    monkeypatch.setattr(bench, "time_fn", lambda fn, *args: (jax.block_until_ready(fn(*args)), 1e-3)[1])
    shapes = bench.SHAPES["training"]
    assert len(shapes) == 8 and {s["head_dim"] for s in shapes.values()} == {64, 128, 256}
    assert {s["heads"] // s.get("kv_heads", s["heads"]) for s in shapes.values()} == {1, 4, 8}  # GQA 4:1, 8:1
    gqa = dict(shapes["B1 S16K H32/KV8"], seq=256)
    row = bench.measure("xla", dtype=jnp.float32, **gqa) | {"shape": "GQA"}
    assert row["kv_heads"] == 8 and row["fwd_bwd_tflops"] == pytest.approx(3.5 * row["fwd_tflops"])
    rows = [
        row,
        dict(row, impl="cudnn", fwd_bwd_tflops=row["fwd_bwd_tflops"] / 2),
        {"shape": "failed", "impl": "xla", "fwd_error": "out of memory"},
    ]
    lines = bench.shapes_table(rows, ["xla", "cudnn"]).splitlines()
    assert lines[0] == "| shape | xla fwd | xla f+b | cudnn fwd | cudnn f+b | xla / cudnn f+b |"
    assert lines[2].startswith("| GQA |") and lines[2].endswith("| 2.00x |")
    assert lines[3] == "| failed | – | – | – | – | – |"

    # Packed documents: segment ids of `segments` documents of at least 64 tokens, passed to
    # the implementations that take them; without cuDNN the ratio is against the last one.
    seg = bench.packed_segments(2, 1024, 4)
    lengths = jax.vmap(lambda ids: jnp.bincount(ids, length=4))(seg)
    assert seg.dtype == jnp.int32 and bool(jnp.all(jnp.diff(seg, axis=1) >= 0)) and int(lengths.min()) >= 64
    assert all(shape["segments"] > 1 for shape in bench.SHAPES["packed"].values())
    packed = bench.measure(
        "bpt-triton", seq=128, heads=2, head_dim=16, causal=True, batch=1, dtype=jnp.float32, segments=2
    )
    assert packed["segments"] == 2 and "fwd_bwd_tflops" in packed and "segment_ids" not in packed
    # the FLOPs are the documents' own causal triangles (1 ms a call here), not the whole one
    lengths = jnp.bincount(bench.packed_segments(1, 128, 2)[0], length=2)
    flops = 4 * 2 * float(jnp.sum(lengths.astype(jnp.float32) ** 2)) * 16 / 2
    assert packed["fwd_tflops"] == pytest.approx(flops / 1e-3 / 1e12)
    rows = [
        packed | {"shape": "docs"},
        dict(packed, impl="bpt-pallas-hopper", shape="docs", fwd_bwd_tflops=3.0),
    ]
    head, _, line = bench.shapes_table(rows, ["bpt-pallas-hopper", "bpt-triton"]).splitlines()
    assert head.endswith("| bpt-pallas-hopper / bpt-triton f+b |")
    assert line.endswith(f"| {3.0 / packed['fwd_bwd_tflops']:.2f}x |")

    # --only: the shapes of a set whose label holds one of its words; a word matching none is
    # an error that lists the labels
    parser = argparse.ArgumentParser()
    chosen = bench.chosen_shapes(parser, "packed", "S64K, d256")
    assert list(chosen) == ["B1 S64K H16 32 docs", "B1 S16K H8 d256 8 docs"]
    assert bench.chosen_shapes(parser, "packed", "") == bench.SHAPES["packed"]
    with pytest.raises(SystemExit):
        bench.chosen_shapes(parser, "packed", "S1M")
    with pytest.raises(SystemExit):
        bench.chosen_shapes(parser, "", "S64K")

    # --tune: a line a setting, with only the settings that differ between the rows
    tuned = [
        dict(shape="d64", forward="hopper", hopper_block_k=bk, hopper_stages=2, fwd_tflops=100.0 + bk)
        | ({"fwd_bwd_tflops": 250.0} if bk == 64 else {"fwd_bwd_error": "RuntimeError: out of shared memory"})
        for bk in (64, 128)
    ]
    lines = bench.tune_table(tuned, ["forward", "hopper_block_k", "hopper_stages"]).splitlines()
    assert lines[0] == "| shape | hopper_block_k | fwd | f+b |"
    assert lines[2] == "| d64 | 64 | 164 | 250 |"
    assert lines[3] == "| d64 | 128 | 228 | RuntimeError: out of shared memory |"


def test_bench_attention_runs_cudnn_on_packed_documents_as_its_own_sequences(monkeypatch, key):
    """bench_attention's cuDNN with segment ids: the documents' offsets and lengths in the
    layout JAX's cuDNN module takes (each row's starts, then -1); here the cuDNN call is
    replaced by one that reads them back into a mask, which must give the same attention as
    the segment ids themselves (float32, 1e-5). On a GPU, the real call is tested below."""
    bench = load_script("bench_attention")
    seg = jnp.array([[0] * 5 + [1] * 3 + [2] * 8, [4] * 10 + [7] * 6], jnp.int32)
    offsets, lengths = bench.document_offsets(seg)
    assert offsets.tolist() == [[0, 5, 8, -1], [0, 10, -1, -1]]
    assert lengths.tolist() == [[5, 3, 8], [10, 6, -1]]
    with pytest.raises(ValueError, match="sorted along each row"):
        bench.document_offsets(seg[:, ::-1])

    from jax._src.cudnn import fused_attention_stablehlo as cudnn_module

    def read_back(q, k, v, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale, mask_type):
        pos = jnp.arange(q.shape[1])
        doc = jnp.full(q.shape[:2], -1)
        for m in range(q_seqlen.shape[1]):  # the position's document, -1 outside all of them
            start, length = q_offsets[:, m : m + 1], q_seqlen[:, m : m + 1]
            doc = jnp.where((length >= 0) & (pos >= start) & (pos < start + length), m, doc)
        visible = (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0)
        if mask_type == cudnn_module.MaskType.PADDING_CAUSAL:
            visible &= pos[:, None] >= pos[None, :]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
        p = jax.nn.softmax(jnp.where(visible[:, None], s, -jnp.inf), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    monkeypatch.setattr(cudnn_module, "dot_product_attention", read_back)
    q, k, v = (jax.random.normal(kk, (2, 16, 2, 8)) for kk in jax.random.split(key, 3))
    for causal in (True, False):
        out = bench.cudnn(q, k, v, causal=causal, segment_ids=seg)
        assert rel_err(out, reference_attention(q, k, v, causal=causal, segment_ids=seg)) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN needs an NVIDIA GPU")
@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_packed_documents_equal_attention_by_segment_ids_on_gpu(key, causal):
    """cuDNN's packed layout (what bench_attention compares bpt's kernels with on packed
    documents) computes attention within each document: outputs and gradients against the
    float32 reference with the same segment ids (bf16 inputs, 2e-2)."""
    bench = load_script("bench_attention")
    seg = bench.packed_segments(2, 1024, 5)
    q, k, v = (jax.random.normal(kk, (2, 1024, 4, 128), jnp.bfloat16) for kk in jax.random.split(key, 3))

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2)

    ours = functools.partial(bench.cudnn, causal=causal, segment_ids=seg)
    ref = functools.partial(reference_attention, causal=causal, segment_ids=seg)
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    assert rel_err(ours(q, k, v), ref(up(q), up(k), up(v))) < 2e-2
    grads = jax.grad(functools.partial(loss, ours), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2))(up(q), up(k), up(v))
    assert tree_rel_err(grads, expected) < 2e-2


def test_bench_attention_masks_every_block_in_its_ablation(monkeypatch):
    """bpt-triton-masked (and bpt-pallas-masked): bpt's kernels traced with the segment
    spans' dense runs emptied, so that every streamed block is masked by segment, as before a
    document's interior blocks ran unmasked; the same results, the kernels' own spans after."""
    from bpt.ops import segments
    from bpt.ops.kernels import attention as triton_kernels

    bench = load_script("bench_attention")
    ids = jnp.repeat(jnp.arange(2, dtype=jnp.int32), 64)[None]  # two documents of 64
    def spans_of(**dense):  # as the kernels' module holds it when called
        return triton_kernels.segment_spans(ids, ids, rows=32, cols=32, causal=True, **dense)

    with bench.every_block_masked():
        masked = spans_of(dense=True)
        assert (spans_of() == segments.segment_spans(ids, ids, rows=32, cols=32, causal=True)).all()
    dense = spans_of(dense=True)
    assert (masked[..., :2] == dense[..., :2]).all() and (masked[..., 2] == masked[..., 3]).all()
    assert int((dense[..., 3] - dense[..., 2]).max()) == 2  # the last block of rows: its document's two
    seen, programs = [], []

    def fake_time(fn, *args):
        seen.append(fn(*args))
        programs.append(str(jax.make_jaxpr(fn)(*args)))
        return 1e-3

    monkeypatch.setattr(bench, "time_fn", fake_time)
    shape = dict(seq=128, heads=2, head_dim=16, causal=True, batch=1, dtype=jnp.float32, segments=2)
    rows = bench.measure_together(["bpt-triton", "bpt-triton-masked"], **shape)
    assert [r["impl"] for r in rows] == ["bpt-triton", "bpt-triton-masked"]
    # forward and forward+backward traced with the dense runs emptied (their scatters)
    assert all("scatter" in p for p in programs[2:]) and "scatter" not in programs[0] + programs[1]
    (out, grads, out_masked, grads_masked) = seen
    assert rel_err(out_masked, out) < 1e-6
    assert all(rel_err(a, b) < 1e-6 for a, b in zip(grads_masked, grads))
    assert triton_kernels.segment_spans is segments.segment_spans

def test_every_registry_resolves_auto_once_and_never_replaces_a_named_implementation():
    """The four registries share one form: names with auto last, auto's choice among those
    auto may pick, a named implementation checked against what it takes (an error with its
    reason, naming no config key), and a table of what each takes."""
    from bpt.ops import ATTENTION, DECODE, MERGED, MIXED_CHUNK, Implementation, Registry

    for registry in (ATTENTION, MERGED, DECODE, MIXED_CHUNK):
        assert registry.names[-1] == "auto" and len(registry.table().splitlines()) == len(registry.names) + 1
    q = jnp.zeros((1, 64, 2, 16))
    settings = dict(causal=True, segment_ids=None, q_chunk_size=16, kv_chunk_size=16)
    assert ATTENTION.resolve("auto", q, q, **settings) == ("blockwise" if jax.default_backend() != "gpu" else "pallas")
    assert ATTENTION.resolve("reference", q, q, **settings) == "reference"
    assert MERGED.resolve("auto", q, q, **settings) == "blockwise"  # fp32: the scan, on a GPU too
    with pytest.raises(ValueError, match="mixed chunk attention implementation 'pallas' cannot run here: the kernels"):
        MIXED_CHUNK.resolve("pallas", 24, 128, 256)  # a chunk of 24: not a power of two
    with pytest.raises(ValueError, match="unknown decode attention implementation 'fast'") as error:
        DECODE.resolve("fast", q.shape)
    assert "model." not in str(error.value)
    with pytest.raises(ValueError, match="'auto' names no implementation"):
        ATTENTION["auto"]
    toy = Registry(
        "toy",
        [Implementation("any", "anything"), Implementation("even", "even n", why_not=lambda n: None if n % 2 == 0 else "odd")],
        lambda n: "even" if n % 2 == 0 else "any",
    )
    assert (toy.resolve("auto", 3), toy.resolve("auto", 4), toy.resolve("even", 4)) == ("any", "even", "even")
    with pytest.raises(ValueError, match="toy implementation 'even' cannot run here: odd"):
        toy.resolve("even", 3)


def test_bench_attention_stopped_by_sigterm_still_prints_its_table(tmp_path):
    """Cut short by SIGTERM (what `timeout` sends), scripts/bench_attention.py still writes its
    JSON and prints its table, of the shapes it measured (the others blank)."""
    import signal
    import subprocess
    import sys

    from conftest import REPO

    command = [sys.executable, str(REPO / "scripts" / "bench_attention.py"), "--impls=xla", "--heads=2"]
    command += ["--head_dims=16", "--seqs=128,4096,8192,16384", "--repeats=3", f"--out={tmp_path / 'rows.json'}"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tmp_path)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("{"):  # the first shape is measured: stop it
            proc.send_signal(signal.SIGTERM)
            break
    lines += proc.stdout.readlines()
    assert proc.wait(timeout=300) == 0, "".join(lines)
    stopped = [line for line in lines if "the table holds" in line]
    assert stopped and stopped[0].startswith(f"stopped by signal {int(signal.SIGTERM)}:"), lines
    assert lines[-1].startswith("| xla (d=16, causal) | ") and " – " in lines[-1], lines
    assert lines[-1].split(" | ")[1] != "–"  # 128's forward was measured
    written = json.loads((tmp_path / "rows.json").read_text())
    assert [row["seq"] for row in written][:1] == [128] and len(written) < 4
