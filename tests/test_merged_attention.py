"""The forward/backward pairs context parallelism is built from (bpt.ops.blockwise_forward /
blockwise_backward, bpt.ops.kernels.flash_forward / flash_backward): attention over two key
ranges, merged by logsumexp, equals attention over all keys, and each range's backward given
the merged output and logsumexp is that range's share of the whole gradient."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err

from bpt.ops.blockwise import blockwise_backward, blockwise_forward
from bpt.ops.kernels.attention import flash_backward, flash_forward
from bpt.ops.reference import logsumexp_merge, masked_attention

TOL = 1e-5
PAIRS = {
    "blockwise": (
        functools.partial(blockwise_forward, q_chunk_size=8, kv_chunk_size=8),
        functools.partial(blockwise_backward, q_chunk_size=8, kv_chunk_size=8),
    ),
    "pallas": (flash_forward, flash_backward),  # interpret mode off the GPU
}


def no_key_is_minus_inf(lse):
    return jnp.where(lse == jnp.inf, -jnp.inf, lse)


def check_two_key_ranges(key, impl, *, b, s, h, kvh, d, dtype, tol):
    forward, backward = PAIRS[impl]
    kq, kk, kv, kc = jax.random.split(key, 4)
    q = jax.random.normal(kq, (b, s, h, d), jnp.float32)
    k = jax.random.normal(kk, (b, 2 * s, kvh, d), jnp.float32)
    v = jax.random.normal(kv, (b, 2 * s, kvh, d), jnp.float32)
    cot = jax.random.normal(kc, q.shape, jnp.float32)
    # Queries see all of the first key range and, causally, the second (as a ring's hops do).
    visible = jnp.concatenate([jnp.ones((s, s), bool), jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]], 1)
    mask = visible[None, None, None]
    out_r, vjp = jax.vjp(lambda q, k, v: masked_attention(q, k, v, mask), q, k, v)  # float32 truth
    dq_r, dk_r, dv_r = vjp(cot)

    q, k, v, cot = (x.astype(dtype) for x in (q, k, v, cot))
    first, second = slice(0, s), slice(s, 2 * s)
    out_a, lse_a = forward(q, k[:, first], v[:, first], causal=False)
    out_b, lse_b = forward(q, k[:, second], v[:, second], causal=True)
    empty = (jnp.zeros(q.shape, jnp.float32), jnp.full((b, h, s), -jnp.inf))
    out, lse = logsumexp_merge(
        *logsumexp_merge(*empty, out_a, no_key_is_minus_inf(lse_a)), out_b, no_key_is_minus_inf(lse_b)
    )
    assert rel_err(out, out_r) < tol
    out = out.astype(dtype)

    zeros = jnp.zeros(lse.shape, jnp.float32)
    dq_a, dk_a, dv_a = backward(q, k[:, first], v[:, first], out, lse, cot, zeros, causal=False)
    dq_b, dk_b, dv_b = backward(q, k[:, second], v[:, second], out, lse, cot, zeros, causal=True)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    assert rel_err(f32(dq_a) + f32(dq_b), dq_r) < tol
    assert rel_err(jnp.concatenate([dk_a, dk_b], 1), dk_r) < tol
    assert rel_err(jnp.concatenate([dv_a, dv_b], 1), dv_r) < tol
    for g in (dq_a, dk_b, dv_b):
        assert np.isfinite(np.asarray(f32(g))).all()


@pytest.mark.parametrize("impl", list(PAIRS))
def test_two_key_ranges_merge_into_the_whole_attention_and_its_gradient(key, impl):
    check_two_key_ranges(key, impl, b=2, s=32, h=4, kvh=2, d=16, dtype=jnp.float32, tol=TOL)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="bpt's kernels at real sizes need a GPU")
def test_the_gpu_kernels_merge_at_real_sizes(key):
    """bf16, head_dim 128, 2K tokens: on H100-class GPUs the Mosaic GPU (Hopper) kernels."""
    check_two_key_ranges(key, "pallas", b=1, s=2048, h=8, kvh=2, d=128, dtype=jnp.bfloat16, tol=1e-2)


def test_blockwise_forward_without_the_diagonal_is_causal_shifted_by_one(key):
    """q_offset=-1: query i sees keys j < i (striped ring hops from later devices)."""
    kq, kk, kv = jax.random.split(key, 3)
    q, k, v = (jax.random.normal(x, (1, 16, 2, 8), jnp.float32) for x in (kq, kk, kv))
    out, lse = blockwise_forward(q, k, v, causal=True, q_offset=-1, q_chunk_size=4, kv_chunk_size=4)
    strict = (jnp.arange(16)[:, None] > jnp.arange(16)[None, :])[None, None, None]
    assert rel_err(out[:, 1:], masked_attention(q, k, v, strict)[:, 1:]) < TOL
    assert (out[:, 0] == 0).all() and (lse[:, :, 0] == jnp.inf).all()  # the first query sees nothing


@pytest.mark.parametrize(
    "impl,packed", [("blockwise", False), ("pallas", False), ("pallas", True), ("blockwise", "documents"),
                    ("pallas", "documents")],
)  # fmt: skip
def test_a_key_range_without_the_diagonal_merges_with_its_gradient(key, impl, packed):
    """A striped ring's hop from a later device (q_offset=-1: query i sees keys j < i), merged
    with a range all queries see: the merged output and every gradient equal the masked
    attention's, with a logsumexp cotangent too. bpt's kernels take such a hop by moving the
    queries (and their segment ids) one row, so that the Hopper kernels can run it."""
    from bpt.ops.attention import MERGED

    s, d = 32, 16
    kq, kk, kv, kc, kl = jax.random.split(key, 5)
    q = jax.random.normal(kq, (2, s, 4, d), jnp.float32)
    k = jax.random.normal(kk, (2, 2 * s, 2, d), jnp.float32)
    v = jax.random.normal(kv, (2, 2 * s, 2, d), jnp.float32)
    cot, cot_lse = jax.random.normal(kc, q.shape), jax.random.normal(kl, (2, 4, s))
    seg = (jnp.zeros((2, s), jnp.int32),) * 2 if packed else None  # one document: the same mask
    visible = jnp.concatenate([jnp.ones((s, s), bool), jnp.arange(s)[:, None] > jnp.arange(s)[None, :]], 1)
    seg_b = seg
    if packed == "documents":  # two documents: queries from 11 on, keys of the first range from 7 on
        q_seg = jnp.broadcast_to(jnp.arange(s) >= 11, (2, s)).astype(jnp.int32)
        first_seg = jnp.broadcast_to(jnp.arange(s) >= 7, (2, s)).astype(jnp.int32)
        seg, seg_b = (q_seg, first_seg), (q_seg, q_seg)
        visible = visible & (q_seg[0][:, None] == jnp.concatenate([first_seg[0], q_seg[0]])[None, :])

    def truth(q, k, v):
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, 2, axis=2)) / jnp.sqrt(d)
        lse = jax.nn.logsumexp(jnp.where(visible, scores, -jnp.inf), axis=-1)
        return masked_attention(q, k, v, visible[None, None, None]), lse

    (out_r, lse_r), vjp = jax.vjp(truth, q, k, v)
    dq_r, dk_r, dv_r = vjp((cot, cot_lse))

    pair = MERGED[impl]
    settings = dict(q_chunk_size=8, kv_chunk_size=8)
    first, second = slice(0, s), slice(s, 2 * s)
    out_a, lse_a = pair.forward(q, k[:, first], v[:, first], causal=False, q_offset=0, segment_ids=seg, **settings)
    out_b, lse_b = pair.forward(q, k[:, second], v[:, second], causal=True, q_offset=-1, segment_ids=seg_b, **settings)
    assert (lse_b[:, :, 0] == jnp.inf).all()  # the first query sees no key of the second range
    if packed == "documents":  # the moved queries' ids stay sorted: the kernels skip between documents
        from bpt.ops.attention import _queries_up

        _, (moved, _) = _queries_up(q, k[:, second], seg_b, -1)
        assert (jnp.diff(moved, axis=1) >= 0).all() and (moved[:, -1] == 2).all()
    out, lse = logsumexp_merge(out_a, no_key_is_minus_inf(lse_a), out_b, no_key_is_minus_inf(lse_b))
    assert rel_err(out, out_r) < TOL and rel_err(lse, lse_r) < TOL

    grads_a = pair.backward(q, k[:, first], v[:, first], out, lse, cot, cot_lse, causal=False, q_offset=0,
                            segment_ids=seg, **settings)  # fmt: skip
    grads_b = pair.backward(q, k[:, second], v[:, second], out, lse, cot, cot_lse, causal=True, q_offset=-1,
                            segment_ids=seg_b, **settings)  # fmt: skip
    assert rel_err(grads_a[0] + grads_b[0], dq_r) < TOL
    assert rel_err(jnp.concatenate([grads_a[1], grads_b[1]], 1), dk_r) < TOL
    assert rel_err(jnp.concatenate([grads_a[2], grads_b[2]], 1), dv_r) < TOL
