"""The blockwise FFN and the blockwise cross-entropy against their whole-sequence versions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err

from bpt.ops import blockwise_cross_entropy, blockwise_ffn, cross_entropy

TOL = 1e-5


@pytest.mark.parametrize("masked", [False, True])
def test_blockwise_cross_entropy_equals_full(key, masked):
    kh, kw, kt, km = jax.random.split(key, 4)
    hidden = jax.random.normal(kh, (2, 64, 32))
    weight = jax.random.normal(kw, (32, 97)) * 0.3
    targets = jax.random.randint(kt, (2, 64), 0, 97)
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
