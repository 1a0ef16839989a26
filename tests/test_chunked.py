"""The blockwise FFN and the blockwise cross-entropy against their whole-sequence versions."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_memory_analysis, rel_err

from bpt.ops import blockwise_cross_entropy, blockwise_ffn, cross_entropy
from bpt.ops.chunked import largest_chunk, logsumexp_argmax

TOL = 1e-5


@pytest.mark.parametrize("masked,vocab", [(False, 97), (True, 97), (False, 128)])
def test_blockwise_cross_entropy_equals_full(key, masked, vocab):
    """vocab 97 runs the head padded to 128 columns (masked out of the loss), 128 as it is."""
    kh, kw, kt, km = jax.random.split(key, 4)
    hidden = jax.random.normal(kh, (2, 64, 32))
    weight = jax.random.normal(kw, (32, vocab)) * 0.3
    targets = jax.random.randint(kt, (2, 64), 0, vocab)
    mask = (jax.random.uniform(km, (2, 64)) > 0.3).astype(jnp.float32) if masked else None

    def full(h, w):
        return cross_entropy(jnp.einsum("bsd,dv->bsv", h, w), targets, mask)

    def chunked(h, w):
        return blockwise_cross_entropy(h, w, targets, chunk_size=16, mask=mask)

    a, b = full(hidden, weight), chunked(hidden, weight)
    assert rel_err(b.loss, a.loss) < TOL
    assert float(b.num_tokens) == float(a.num_tokens) == (float(mask.sum()) if masked else 128.0)
    assert abs(float(b.accuracy) - float(a.accuracy)) < 1e-6
    g_full = jax.grad(lambda h, w: full(h, w).loss, (0, 1))(hidden, weight)
    g_chunk = jax.grad(lambda h, w: chunked(h, w).loss, (0, 1))(hidden, weight)
    assert rel_err(g_chunk[0], g_full[0]) < TOL
    assert rel_err(g_chunk[1], g_full[1]) < TOL


def test_logsumexp_argmax_in_one_pass(key):
    """The one-pass reduction equals jax.nn.logsumexp and jnp.argmax: with -inf padding
    columns, with ties (the lower index wins, as jnp.argmax's), and a row of only -inf; and
    so does the logsumexp's gradient."""
    logits = jax.random.normal(key, (3, 40, 300)) * 4.0
    logits = logits.at[..., 250:].set(-jnp.inf)
    logits = logits.at[0, 0, :].set(-jnp.inf)
    logits = logits.at[1, 0, 5].set(20.0).at[1, 0, 200].set(20.0).at[1, 0, 7].set(20.0)
    logits = logits.at[2, 0, :250].set(0.5)
    lse, argmax = jax.jit(logsumexp_argmax)(logits)
    want = jax.nn.logsumexp(logits, axis=-1)
    assert float(lse[0, 0]) == -np.inf
    finite = np.isfinite(np.asarray(want))
    assert finite.sum() == 3 * 40 - 1
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want)[finite], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(argmax)[finite], np.asarray(jnp.argmax(logits, -1))[finite])
    assert int(argmax[1, 0]) == 5 and int(argmax[2, 0]) == 0
    # The logsumexp's gradient is the softmax (zero on the padding), as jax.nn.logsumexp's.
    rows, cot = logits[1:], jax.random.normal(key, (2, 40))
    got = jax.grad(lambda x: jnp.sum(logsumexp_argmax(x)[0] * cot))(rows)
    want = jax.grad(lambda x: jnp.sum(jax.nn.logsumexp(x, axis=-1) * cot))(rows)
    assert rel_err(got, want) < TOL and not np.asarray(got[..., 250:]).any()


def test_blockwise_cross_entropy_with_a_norm_inside_the_chunks(key):
    """The gradient reaches the norm's parameters too, and a loss scaled from outside (the
    cotangent the backward multiplies by) gives scaled gradients."""
    kh, kw, kt, ks = jax.random.split(key, 4)
    hidden = jax.random.normal(kh, (2, 64, 32))
    weight = jax.random.normal(kw, (32, 97)) * 0.3
    targets = jax.random.randint(kt, (2, 64), 0, 97)
    params = (1.0 + 0.1 * jax.random.normal(ks, (32,)), jnp.full((32,), 0.05))

    def norm(p, h):
        h = h - h.mean(-1, keepdims=True)
        return h * jax.lax.rsqrt(jnp.square(h).mean(-1, keepdims=True) + 1e-5) * p[0] + p[1]

    def full(h, w, p):
        return 3.0 * cross_entropy(norm(p, h) @ w, targets).loss

    def chunked(h, w, p):
        return 3.0 * blockwise_cross_entropy(h, w, targets, chunk_size=16, norm=norm, norm_params=p).loss

    assert rel_err(chunked(hidden, weight, params), full(hidden, weight, params)) < TOL
    g_full = jax.grad(full, (0, 1, 2))(hidden, weight, params)
    g_chunk = jax.grad(chunked, (0, 1, 2))(hidden, weight, params)
    for got, want in zip(jax.tree.leaves(g_chunk), jax.tree.leaves(g_full), strict=True):
        assert rel_err(got, want) < TOL


def test_blockwise_cross_entropy_runs_the_head_three_times():
    """Forward and backward together: one logits matmul and two gradient matmuls a chunk,
    as an unchunked loss does; a rematerialized chunk would compute its logits twice."""
    hidden, weight = jnp.ones((1, 64, 8)), jnp.ones((8, 97))
    targets = jnp.zeros((1, 64), jnp.int32)
    grad = jax.grad(lambda h, w: blockwise_cross_entropy(h, w, targets, chunk_size=16).loss, (0, 1))
    jaxpr = jax.make_jaxpr(grad)(hidden, weight)

    def dots(eqns):
        count = 0
        for eqn in eqns:
            count += eqn.primitive.name == "dot_general"
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                count += dots(sub.eqns)
        return count

    assert dots(jaxpr.jaxpr.eqns) == 3


@cpu_memory_analysis
def test_blockwise_cross_entropy_never_builds_full_logits():
    hidden = jax.ShapeDtypeStruct((1, 4096, 64), jnp.float32)
    weight = jax.ShapeDtypeStruct((64, 4096), jnp.float32)
    targets = jax.ShapeDtypeStruct((1, 4096), jnp.int32)

    def temp(fn):
        grad = jax.jit(jax.grad(lambda h, w, t: fn(h, w, t).loss, (0, 1)))
        return grad.lower(hidden, weight, targets).compile().memory_analysis().temp_size_in_bytes

    full = temp(lambda h, w, t: cross_entropy(h @ w, t))
    chunked = temp(lambda h, w, t: blockwise_cross_entropy(h, w, t, chunk_size=256))
    logits_bytes = 4096 * 4096 * 4
    assert full >= logits_bytes
    assert chunked < logits_bytes / 4


def test_blockwise_ffn_equals_full(key):
    kx, k1, k2 = jax.random.split(key, 3)
    x = jax.random.normal(kx, (2, 48, 16))
    w1 = jax.random.normal(k1, (16, 64)) * 0.2
    w2 = jax.random.normal(k2, (64, 16)) * 0.2

    def ffn(x, w1, w2):
        return x + jax.nn.gelu(x @ w1) @ w2

    for policy in ("nothing_saveable", "dots_saveable", "none"):
        out = blockwise_ffn(lambda c: ffn(c, w1, w2), x, chunk_size=16, policy=policy)
        assert rel_err(out, ffn(x, w1, w2)) < TOL
        g = jax.grad(
            lambda x, w1: blockwise_ffn(lambda c: ffn(c, w1, w2), x, chunk_size=16, policy=policy).sum(),
            (0, 1),
        )(x, w1)
        g_ref = jax.grad(lambda x, w1: ffn(x, w1, w2).sum(), (0, 1))(x, w1)
        assert rel_err(g[0], g_ref[0]) < TOL and rel_err(g[1], g_ref[1]) < TOL


def test_blockwise_ffn_takes_pytrees():
    x = {"a": jnp.arange(24.0).reshape(1, 12, 2), "b": jnp.ones((1, 12))}
    out = blockwise_ffn(lambda c: c["a"].sum(-1) + c["b"], x, chunk_size=4)
    np.testing.assert_allclose(out, x["a"].sum(-1) + 1)


def test_bad_arguments():
    x = jnp.zeros((1, 10, 4))
    with pytest.raises(ValueError, match="not divisible by chunk_size=4"):
        blockwise_ffn(lambda c: c, x, chunk_size=4)
    with pytest.raises(ValueError, match="unknown policy 'save_all'"):
        blockwise_ffn(lambda c: c, x, chunk_size=5, policy="save_all")
    with pytest.raises(ValueError, match="targets"):
        blockwise_cross_entropy(x, jnp.zeros((4, 7)), jnp.zeros((1, 9), jnp.int32), chunk_size=5)


def test_bf16_weight_gradients_are_summed_over_chunks_in_float32(key):
    """The backward adds every chunk's weight gradient into one sum. Kept in bfloat16, that
    sum would round at every chunk, and its error would grow with the number of chunks; in
    float32 a bf16 run's error stays that of one bf16 rounding however many chunks there are.
    """
    kx, k1, k2, kt = jax.random.split(key, 4)
    seq, d, f = 4096, 32, 64
    x = jax.random.normal(kx, (1, seq, d)).astype(jnp.bfloat16)
    w1 = (jax.random.normal(k1, (d, f)) * 0.2).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k2, (f, d)) * 0.2).astype(jnp.bfloat16)
    targets = jax.random.randint(kt, (1, seq), 0, f)

    def ffn(c, w):
        return c + jax.nn.gelu(c @ w[0]) @ w[1]

    def chunked(w, chunk):  # 4096 / 16 = 256 chunks
        h = blockwise_ffn(ffn, x, chunk_size=chunk, weights=w)
        return blockwise_cross_entropy(h, w[1].T, targets, chunk_size=chunk).loss

    def exact(w):  # the same bf16 values, every product and sum in float32
        x32, w32 = x.astype(jnp.float32), jax.tree.map(lambda a: a.astype(jnp.float32), w)
        return cross_entropy(ffn(x32, w32) @ w32[1].T, targets).loss

    g_ref = jax.grad(exact)((w1, w2))
    for chunk in (16, seq):
        g = jax.grad(chunked)((w1, w2), chunk)
        assert g[0].dtype == jnp.bfloat16
        for got, want in zip(g, g_ref):
            assert rel_err(got.astype(jnp.float32), want) < 5e-3, chunk  # bf16 sums: 1.6e-2


@pytest.mark.parametrize(
    "length,unit,most,want",
    [
        (8192, 1024, 16384, 8192),  # the whole sequence when it is within the bound
        (65536, 1024, 16384, 16384),
        (24576, 1024, 16384, 12288),  # 16384 does not divide 24576: the largest multiple that does
        (5 * 1024 * 7, 1024, 16384, 7168),
        (3000, 1000, 2000, 1000),  # no larger multiple divides: the unit
        (3000, 512, 2048, 512),  # the unit does not divide: resolve_chunk_size names it
    ],
)
def test_largest_chunk(length, unit, most, want):
    assert largest_chunk(length, unit, most) == want
