"""The GPT: the three attention modes compute one function; causality; layer scan; memory."""

import dataclasses
import functools
import json
import math
import re
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import kernel_grids, load_script, rel_err, tree_rel_err

from bpt.config import base_config, model_config
from bpt.models.gpt import GPT, Block, GPTConfig
from bpt.models.lm import add_layer_norm, apply_rotary, gelu, layer_norm, rotary_tables
from bpt.train.probe import TrainingStep

TOL = 1e-5
MODES = ("vanilla", "memory_efficient", "blockwise_parallel")
BASE = GPTConfig(
    vocab_size=97,
    num_layers=2,
    d_model=64,
    num_heads=4,
    num_kv_heads=2,
    q_chunk_size=16,
    kv_chunk_size=8,
    loss_chunk_size=16,
    max_seq_len=64,
    attention_impl="blockwise",
)


def init_params(cfg, key, seq_len=64):
    return nn.meta.unbox(GPT(cfg).init(key, jnp.zeros((1, seq_len), jnp.int32))["params"])


def unstack_layers(params, num_layers):
    out = {k: v for k, v in params.items() if k != "layers"}
    for i in range(num_layers):
        out[f"layer_{i}"] = jax.tree.map(lambda a: a[i], params["layers"])
    return out


def forward(cfg, params, tokens, targets, segment_ids=None):
    """Logits, loss and parameter gradients of one configuration."""
    model = GPT(cfg)

    @jax.jit
    def run(params):
        logits = model.apply({"params": params}, tokens, segment_ids=segment_ids)
        loss_fn = lambda p: model.apply({"params": p}, tokens, targets=targets, segment_ids=segment_ids).loss
        loss, grads = jax.value_and_grad(loss_fn)(params)
        return logits, loss, grads

    return run(params)


@pytest.fixture
def batch(key):
    kt, kp = jax.random.split(key)
    tokens = jax.random.randint(kt, (2, 64), 0, BASE.vocab_size)
    return tokens, jnp.roll(tokens, -1, axis=1), init_params(BASE, kp)


@pytest.mark.parametrize("position_embedding", ["rotary", "learned"])
def test_modes_agree(batch, position_embedding):
    tokens, targets, _ = batch
    base = dataclasses.replace(
        BASE, position_embedding=position_embedding, tie_embeddings=position_embedding == "rotary"
    )
    params = init_params(base, jax.random.PRNGKey(0))
    results = {
        m: forward(dataclasses.replace(base, attention_mode=m), params, tokens, targets) for m in MODES
    }
    logits0, loss0, grads0 = results["vanilla"]
    for mode in MODES[1:]:
        logits, loss, grads = results[mode]
        assert rel_err(logits, logits0) < TOL, mode
        assert rel_err(loss, loss0) < TOL, mode
        assert tree_rel_err(grads, grads0) < TOL, mode


def test_modes_agree_with_segment_ids_and_other_impls(batch, key):
    tokens, targets, params = batch
    segs = jnp.cumsum(jax.random.uniform(key, (2, 64)) < 0.05, axis=1).astype(jnp.int32)
    expected = forward(dataclasses.replace(BASE, attention_mode="vanilla"), params, tokens, targets, segs)
    for mode, impl in [
        ("memory_efficient", "blockwise"),
        ("blockwise_parallel", "blockwise"),
        ("blockwise_parallel", "reference"),
        ("memory_efficient", "auto"),
        ("blockwise_parallel", "pallas"),  # the kernel, then the FFN and loss block by block
    ]:
        cfg = dataclasses.replace(BASE, attention_mode=mode, attention_impl=impl)
        logits, loss, grads = forward(cfg, params, tokens, targets, segs)
        assert rel_err(logits, expected[0]) < TOL, (mode, impl)
        assert tree_rel_err(grads, expected[2]) < TOL, (mode, impl)


@pytest.mark.parametrize(
    "mode,tie", [("blockwise_parallel", True), ("blockwise_parallel", False), ("memory_efficient", False)]
)
def test_a_padded_vocabulary_is_the_unpadded_model(key, mode, tie):
    """model.vocab_multiple=128 holds 128 embedding rows (and head columns) for 97 tokens:
    the same initial parameters in the first 97, zeros after; the same logits (97 of them:
    padded ids are never sampled), loss and gradients (zero on the padding), with the chunked
    loss and with full logits."""
    from bpt.models.lm import fit_vocab

    padded = dataclasses.replace(BASE, attention_mode=mode, tie_embeddings=tie)
    plain = dataclasses.replace(padded, vocab_multiple=1)
    assert (padded.padded_vocab, plain.padded_vocab) == (128, 97)
    params = init_params(padded, jax.random.PRNGKey(3))
    plain_params = init_params(plain, jax.random.PRNGKey(3))
    assert tree_rel_err(fit_vocab(params, 97), plain_params) == 0.0
    assert not np.asarray(params["embedding"][97:]).any()
    tokens = jax.random.randint(key, (2, 64), 0, 97)
    targets = jnp.roll(tokens, -1, axis=1)
    logits, loss, grads = forward(padded, params, tokens, targets)
    logits0, loss0, grads0 = forward(plain, plain_params, tokens, targets)
    assert logits.shape == (2, 64, 97) and rel_err(logits, logits0) < TOL
    assert rel_err(loss, loss0) < TOL
    assert tree_rel_err(fit_vocab(grads, 97), grads0) < TOL
    assert not np.asarray(grads["embedding"][97:]).any()
    assert tie or not np.asarray(grads["lm_head"][:, 97:]).any()


def test_vocab_multiple_is_checked():
    with pytest.raises(ValueError, match="model.vocab_multiple must be a positive integer; got 0"):
        dataclasses.replace(BASE, vocab_multiple=0)


def test_gelu_is_gpt2s_tanh_gelu_with_its_gradient(key):
    """bpt's GELU (the sigmoid form of the tanh approximation) against jax.nn.gelu's tanh form:
    values and gradients in float32, over the range where the tanh bends and its tails."""
    x = jax.random.normal(key, (4096,), jnp.float32) * 4
    x = jnp.concatenate([x, jnp.array([0.0, -30.0, 30.0, -1e4, 1e4])])
    want = jax.nn.gelu(x, approximate=True)
    np.testing.assert_allclose(gelu(x), want, rtol=2e-6, atol=2e-6)
    grad = jax.vmap(jax.grad(gelu))(x)
    want_grad = jax.vmap(jax.grad(lambda v: jax.nn.gelu(v, approximate=True)))(x)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-5)
    half = x.astype(jnp.bfloat16)  # computed in float32, rounded once
    assert gelu(half).dtype == jnp.bfloat16
    np.testing.assert_allclose(gelu(half).astype(jnp.float32), gelu(half.astype(jnp.float32)), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_layer_norms_written_out_backward_is_autodiffs(key, impl):
    """layer_norm's own backward (XLA's formula, or bpt's Pallas kernels in interpret mode)
    against autodiff of the same formula: the gradients of x, scale and bias in float32 (x far
    from zero mean, so that the mean's part of the gradient counts), and a bfloat16 x's
    gradient in bfloat16, equal to the float32 one's rounding."""

    def by_autodiff(x, scale, bias):
        x32 = x.astype(jnp.float32)
        mean = x32.mean(axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(jnp.square(x32 - mean).mean(axis=-1, keepdims=True) + 1e-5)
        return (y * scale + bias).astype(x.dtype)

    kx, ks, kb, kg = jax.random.split(key, 4)
    x = 3.0 + 2.0 * jax.random.normal(kx, (2, 48, 64), jnp.float32)  # rows: 6 of the kernel's blocks
    scale = 1.0 + 0.5 * jax.random.normal(ks, (64,), jnp.float32)
    bias = jax.random.normal(kb, (64,), jnp.float32)
    cotangent = jax.random.normal(kg, x.shape, jnp.float32)
    ours = lambda *a: layer_norm(*a, 1e-5, impl)  # noqa: E731

    def grads(f, x):
        loss = lambda *a: (f(*a).astype(jnp.float32) * cotangent).sum()  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(x, scale, bias)

    ran_kernels = "pallas_call" in str(jax.make_jaxpr(lambda x: grads(ours, x))(x))
    assert ran_kernels == (impl == "pallas")
    want = by_autodiff(x, scale, bias)
    np.testing.assert_allclose(ours(x, scale, bias), want, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads(ours, x), grads(by_autodiff, x)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    half = x.astype(jnp.bfloat16)
    dx = grads(ours, half)[0]
    assert dx.dtype == jnp.bfloat16
    want = grads(by_autodiff, half.astype(jnp.float32))[0]
    np.testing.assert_allclose(dx.astype(jnp.float32), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_add_layer_norm_is_the_add_then_the_norm(key, impl):
    """add_layer_norm(x, r) = (x + r, layer_norm(x + r)), with bpt's kernels (interpret mode)
    in one pass each way: values and the gradients of x, r, scale and bias against autodiff
    of the add and layer_norm, for cotangents on both h and y (the residual stream's gradient
    reaches x and r past the norm), in float32 and bfloat16."""
    kx, kr, ks, kb, kh, ky = jax.random.split(key, 6)
    x = 2.0 + jax.random.normal(kx, (2, 48, 64), jnp.float32)
    r = jax.random.normal(kr, x.shape, jnp.float32)
    scale = 1.0 + 0.5 * jax.random.normal(ks, (64,), jnp.float32)
    bias = jax.random.normal(kb, (64,), jnp.float32)
    dh, dy = (jax.random.normal(k, x.shape, jnp.float32) for k in (kh, ky))

    def separately(x, r, scale, bias):
        h = x + r
        return h, layer_norm(h, scale, bias, 1e-5)

    def loss(f, *args):
        h, y = f(*args)
        return (h.astype(jnp.float32) * dh).sum() + (y.astype(jnp.float32) * dy).sum()

    ours = lambda *a: add_layer_norm(*a, 1e-5, impl)  # noqa: E731
    grad = lambda f: jax.grad(functools.partial(loss, f), argnums=(0, 1, 2, 3))  # noqa: E731
    jaxpr = str(jax.make_jaxpr(grad(ours))(x, r, scale, bias))
    assert ("bpt_add_layer_norm_fwd" in jaxpr and "bpt_add_layer_norm_bwd" in jaxpr) == (impl == "pallas")
    for dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)):
        args = (x.astype(dtype), r.astype(dtype), scale, bias)
        for got, want in zip(ours(*args), separately(*args)):
            assert got.dtype == want.dtype == dtype
            np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), rtol=tol, atol=tol)
        grads = [grad(f)(*args) for f in (ours, separately)]
        for got, want in zip(*grads):
            assert got.dtype == want.dtype
            np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), rtol=tol, atol=tol)


def test_add_layer_norm_takes_the_kernels_only_for_a_residual_like_x():
    """add_layer_norm(impl="pallas") runs XLA's add, then layer_norm (its kernels still), where
    the residual's dtype is not x's; the kernels say what they need of a residual or its
    gradient."""
    from bpt.ops.kernels import layer_norm as kernel

    x, scale, bias = jnp.ones((16, 64)), jnp.ones(64), jnp.zeros(64)
    r = jnp.full((16, 64), 0.5, jnp.bfloat16)
    jaxpr = str(jax.make_jaxpr(lambda x: add_layer_norm(x, r, scale, bias, 1e-5, "pallas"))(x))
    assert "bpt_add_layer_norm" not in jaxpr and "bpt_layer_norm_fwd" in jaxpr
    with pytest.raises(ValueError, match=r"residual must have x's shape and dtype \(16, 64\) float32; got"):
        kernel.forward(x, scale, bias, 1e-5, residual=r)
    stats = jnp.zeros(16)
    with pytest.raises(ValueError, match=r"dresidual must have x's shape \(16, 64\); got \(16, 32\)"):
        kernel.backward(x, x, stats, stats, scale, dresidual=jnp.zeros((16, 32)))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the Triton-lowered kernels need an NVIDIA GPU")
@pytest.mark.parametrize("d", [2048, 4096])
def test_layer_norm_kernels_on_gpu(key, d):
    """The LayerNorm kernels lowered through Triton at GPT-1B's and GPT-7B's widths, bf16
    rows of a 4 x 4096 batch, against XLA's formula computed in float32 from the same bf16
    input: y, dx, dscale and dbias, with dx's and y's memory poisoned by NaN first (an
    unwritten row would fail); add_layer_norm's fused kernels (h and y, and the gradients of
    x and the residual) alike."""
    kx, ks, kb, kg, kr = jax.random.split(key, 5)
    x = (1.0 + 2.0 * jax.random.normal(kx, (4, 4096, d))).astype(jnp.bfloat16)
    scale = (1.0 + 0.5 * jax.random.normal(ks, (d,))).astype(jnp.bfloat16)
    bias = jax.random.normal(kb, (d,)).astype(jnp.bfloat16)
    dy = jax.random.normal(kg, x.shape).astype(jnp.bfloat16)
    jnp.full(x.shape, jnp.nan, x.dtype).block_until_ready()  # memory the kernels' outputs may reuse

    r = jax.random.normal(kr, x.shape).astype(jnp.bfloat16)

    def run(impl, x, scale, bias):
        y, vjp = jax.vjp(lambda *a: layer_norm(*a, 1e-5, impl), x, scale, bias)
        return (y, *vjp(dy.astype(y.dtype)))

    def run_add(impl, x, r, scale, bias):
        (h, y), vjp = jax.vjp(lambda *a: add_layer_norm(*a, 1e-5, impl), x, r, scale, bias)
        return (h, y, *vjp((dy.astype(h.dtype), dy.astype(y.dtype))))

    f32 = lambda *a: (t.astype(jnp.float32) for t in a)  # noqa: E731
    for names, tols, f, args in (
        (("y", "dx", "dscale", "dbias"), (2e-2, 5e-2, 2e-2, 2e-2), run, (x, scale, bias)),
        (
            ("h", "y", "dx", "dr", "dscale", "dbias"),
            (1e-2, 2e-2, 5e-2, 5e-2, 2e-2, 2e-2),
            run_add,
            (x, r, scale, bias),
        ),
    ):
        got = jax.jit(functools.partial(f, "pallas"))(*args)
        want = jax.jit(functools.partial(f, "xla"))(*f32(*args))
        for name, g, w, tol in zip(names, got, want, tols):
            g32, w32 = f32(g, w)
            assert bool(jnp.isfinite(g32).all()), name
            np.testing.assert_allclose(g32, w32, rtol=tol, atol=tol * float(jnp.abs(w32).max()), err_msg=name)


def test_layer_norm_kernels_take_what_they_can_and_say_why_not():
    """bpt.ops.kernels.layer_norm.supported: a power-of-two feature size, whole row blocks;
    layer_norm(impl="pallas") runs XLA's formula where the kernels cannot (a decode step's
    one row, GPT-2's 768 features), with the same values."""
    from bpt.ops.kernels import layer_norm as kernel

    assert kernel.supported(jnp.zeros((2, 8192, 2048), jnp.bfloat16)) is None
    assert "power of two" in kernel.supported(jnp.zeros((4, 768)))
    assert "multiple of 4" in kernel.supported(jnp.zeros((1, 2048)))
    assert "float32, bfloat16" in kernel.supported(jnp.zeros((16, 64), jnp.int32))
    assert "power of two" in kernel.supported(jnp.zeros((12, 64)), rows_per_block=3)
    with pytest.raises(ValueError, match=r"cannot take x \(4, 768\) float32: the feature size"):
        kernel.forward(jnp.zeros((4, 768)), jnp.ones(768), jnp.zeros(768), 1e-5)
    assert kernel.backward_steps(32768 // 4) == 16 and kernel.backward_steps(6) == 2
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 768))
    scale, bias = jnp.ones(768), jnp.zeros(768)
    assert "pallas_call" not in str(jax.make_jaxpr(lambda x: layer_norm(x, scale, bias, 1e-5, "pallas"))(x))
    np.testing.assert_allclose(layer_norm(x, scale, bias, 1e-5, "pallas"), layer_norm(x, scale, bias, 1e-5))


@pytest.mark.parametrize("per_sequence", [False, True])
def test_rotary_rotates_each_pair_of_halves(key, per_sequence):
    """apply_rotary against the rotation written out pair by pair, (x_i, x_{i+d/2}) by the
    angle of position p and frequency i: values and gradients in float32, with positions shared
    by the batch ([seq]) and per sequence ([batch, seq]); a bfloat16 input stays bfloat16."""
    batch, seq, heads, d = 2, 24, 3, 16
    kx, kp, kg = jax.random.split(key, 3)
    x = jax.random.normal(kx, (batch, seq, heads, d), jnp.float32)
    positions = jax.random.randint(kp, (batch, seq) if per_sequence else (seq,), 0, 5000)
    cos, sin = rotary_tables(positions, d, 10000.0)

    freq = 10000.0 ** -(np.arange(d // 2) * 2 / d)
    angle = np.broadcast_to(np.asarray(positions, np.float64)[..., None] * freq, (batch, seq, d // 2))
    # float32 angles of positions up to 5000: within 5000 * 2^-23 of float64's
    np.testing.assert_allclose(np.broadcast_to(cos, angle.shape), np.cos(angle), atol=1e-3)
    np.testing.assert_allclose(np.broadcast_to(sin, angle.shape), np.sin(angle), atol=1e-3)

    def written_out(x):
        c, s = (np.broadcast_to(t, angle.shape)[:, :, None] for t in (cos, sin))
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    np.testing.assert_allclose(apply_rotary(x, cos, sin), written_out(x), rtol=1e-5, atol=1e-5)
    cotangent = jax.random.normal(kg, x.shape, jnp.float32)
    grad = jax.grad(lambda x: (apply_rotary(x, cos, sin) * cotangent).sum())(x)
    want = jax.grad(lambda x: (written_out(x) * cotangent).sum())(x)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5)
    assert apply_rotary(x.astype(jnp.bfloat16), cos, sin).dtype == jnp.bfloat16


def test_scanned_and_unscanned_layers_agree(batch):
    tokens, targets, params = batch
    cfg = dataclasses.replace(BASE, attention_mode="blockwise_parallel")
    logits_s, loss_s, grads_s = forward(cfg, params, tokens, targets)
    logits_u, loss_u, grads_u = forward(
        dataclasses.replace(cfg, scan_layers=False), unstack_layers(params, 2), tokens, targets
    )
    assert rel_err(logits_u, logits_s) < TOL and rel_err(loss_u, loss_s) < TOL
    assert tree_rel_err(grads_u, unstack_layers(grads_s, 2)) < TOL


@pytest.mark.parametrize("policy", ["none", "nothing_saveable"])
def test_unrolled_scan_computes_the_same_function(batch, policy):
    """model.scan_unroll: the stack's loop with the whole stack in one iteration (2, and 5,
    more layers than there are) runs the same layers over the same stacked parameters: the
    logits, loss and gradients of one layer an iteration."""
    tokens, targets, params = batch
    cfg = dataclasses.replace(BASE, remat_layer=policy)
    logits, loss, grads = forward(cfg, params, tokens, targets)
    for unroll in (2, 5):
        got_logits, got_loss, got_grads = forward(
            dataclasses.replace(cfg, scan_unroll=unroll), params, tokens, targets
        )
        assert rel_err(got_logits, logits) < TOL and rel_err(got_loss, loss) < TOL, unroll
        assert tree_rel_err(got_grads, grads) < TOL, unroll
    with pytest.raises(ValueError, match="model.remat_group > 1 runs loops of its own"):
        dataclasses.replace(cfg, scan_unroll=2, remat_group=2)


def test_ffn_chunk_size_computes_the_same_function(batch):
    """model.ffn_chunk_size: with attention as one call (here the reference), the part after
    it runs in chunks of its own size (twice and four times q_chunk_size: the whole
    sequence), with equal logits, loss and gradients."""
    tokens, targets, params = batch
    cfg = dataclasses.replace(BASE, attention_impl="reference")
    logits, loss, grads = forward(cfg, params, tokens, targets)
    for chunk in (32, 64):
        got_logits, got_loss, got_grads = forward(dataclasses.replace(cfg, ffn_chunk_size=chunk), params, tokens, targets)
        assert rel_err(got_logits, logits) < TOL and rel_err(got_loss, loss) < TOL, chunk
        assert tree_rel_err(got_grads, grads) < TOL, chunk


def test_bench_norm_times_each_implementation_and_reports_a_bad_variant(tmp_path, monkeypatch, capsys):
    """scripts/bench_norm.py: XLA and each kernel variant a row (the kernels' outputs checked
    against XLA's), GB/s from the least traffic, a variant the kernels refuse a row that
    says why; results.json and table.md under --out."""
    bench = load_script("bench_norm")
    monkeypatch.setattr(bench, "seconds_per_call", lambda *a, **k: 1e-6)  # 1 µs a call
    variants = '{"pallas": {"max_steps": 2}, "odd": {"rows_per_block": 3}}'
    argv = ["bench_norm.py", "--rows", "64", "--widths", "64", "--variants", variants, "--out", str(tmp_path)]
    monkeypatch.setattr("sys.argv", argv)
    bench.main()
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["implementation"] for r in rows] == ["xla", "pallas", "odd"]
    assert rows[1]["error"] < 1e-2 and rows[1]["forward_us"] == pytest.approx(1)
    assert "row block must be a power of two; got 3" in rows[2]["failed"]
    table = (tmp_path / "table.md").read_text()
    # forward: x read, y written (2 x 64 x 64 x 2 bytes) a µs; both: x, y, x, dy, dx (5 x)
    assert "| 64 | pallas | 1 (16) | 1 (41) |" in table
    assert table in capsys.readouterr().out
    # --add: add_layer_norm's kernels against XLA's add and norm; 4 and 8 rows' bytes
    monkeypatch.setattr("sys.argv", argv[:-2] + ["--add", "--out", str(tmp_path / "add")])
    bench.main()
    rows = json.loads((tmp_path / "add" / "results.json").read_text())["rows"]
    assert rows[1]["implementation"] == "pallas" and rows[1]["error"] < 1e-2
    assert "| 64 | pallas | 1 (33) | 1 (66) |" in (tmp_path / "add" / "table.md").read_text()


@pytest.mark.parametrize("mode", ["blockwise_parallel", "vanilla"])
def test_norm_impl_pallas_computes_the_same_function(batch, mode):
    """model.norm_impl="pallas": the layers' LayerNorms by bpt's kernels (interpret mode here;
    the FFN's with the residual add before it), with the logits, loss and gradients of XLA's
    formula; on a mesh of several devices it says where it cannot run per device, and decoding
    there takes XLA's norms (meshes: tests/multidevice)."""
    tokens, targets, params = batch
    cfg = dataclasses.replace(BASE, attention_mode=mode, attention_impl="reference")
    logits, loss, grads = forward(cfg, params, tokens, targets)
    pallas = dataclasses.replace(cfg, norm_impl="pallas")
    step = jax.make_jaxpr(lambda p: GPT(pallas).apply({"params": p}, tokens, targets=targets).loss)(params)
    assert "bpt_layer_norm_fwd" in str(step)  # ln1
    assert "bpt_add_layer_norm_fwd" in str(step)  # ln2, with the residual add before it
    got_logits, got_loss, got_grads = forward(pallas, params, tokens, targets)
    assert rel_err(got_logits, logits) < TOL and rel_err(got_loss, loss) < TOL
    assert tree_rel_err(got_grads, grads) < 1e-4
    fsdp, tensor = (_fake_mesh(2, tensor=t) for t in (1, 2))
    assert Block(pallas, parallel=fsdp)._norm_impl() == "pallas"
    with pytest.raises(ValueError, match=r"runs on a mesh of 2 devices per device, .* tensor parallelism \(mesh.tensor > 1"):
        Block(pallas, parallel=tensor)._norm_impl()
    assert Block(pallas, parallel=fsdp, decode=True)._norm_impl() == "xla"  # a decode step's few rows


def _fake_mesh(devices: int, tensor: int = 1):
    """What Block._norm_impl reads of a Parallelism: the mesh's size, and whether per_device
    runs there (not with tensor parallelism)."""
    return types.SimpleNamespace(mesh=types.SimpleNamespace(size=devices), runs_per_device=devices > 1 and tensor == 1)


def test_norm_impl_auto_takes_the_kernels_on_one_gpu_only(monkeypatch):
    """model.norm_impl="auto" (the default): pallas on one GPU; xla on a CPU or on a mesh of
    several devices (the kernels per device there are not measured yet; pallas by name)."""
    one, two = (_fake_mesh(n) for n in (1, 2))
    assert BASE.norm_impl == "auto"
    assert [Block(BASE, parallel=par)._norm_impl() for par in (None, one, two)] == ["xla"] * 3
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert [Block(BASE, parallel=par)._norm_impl() for par in (None, one, two)] == ["pallas", "pallas", "xla"]
    xla = dataclasses.replace(BASE, norm_impl="xla")
    assert Block(xla, parallel=one)._norm_impl() == "xla"


def test_resolved_impls_say_what_auto_takes(monkeypatch):
    """GPT.resolved_impls (the training log's "kernels:" line): what the layers resolve auto
    to from a step's shapes, here on a pretended Hopper GPU: bpt's kernels for GPT-7B's 32K
    step, cuDNN past LEADS, bpt's again for packed documents (cuDNN takes no segment ids);
    no norm_impl for RMSNorm, which has one implementation."""
    from bpt.ops.kernels import attention_hopper

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(attention_hopper, "is_hopper", lambda: True)
    cfg = dataclasses.replace(BASE, dtype="bfloat16", d_model=4096, num_heads=32, num_kv_heads=None, attention_impl="auto")
    assert GPT(cfg).resolved_impls(1, 32768) == "attention_impl=auto -> pallas, norm_impl=auto -> pallas"
    assert GPT(cfg).resolved_impls(1, 262144) == "attention_impl=auto -> cudnn, norm_impl=auto -> pallas"
    assert GPT(cfg).resolved_impls(1, 262144, packed=True).startswith("attention_impl=auto -> pallas")
    named = dataclasses.replace(cfg, attention_impl="cudnn", norm_impl="xla", rms_norm=True)
    assert GPT(named).resolved_impls(1, 32768) == "attention_impl=cudnn -> cudnn"
    tuned = dataclasses.replace(cfg, attention_impl="pallas", attention_options="hopper_sort_window=0")
    assert GPT(tuned).resolved_impls(1, 8192).startswith("attention_impl=pallas -> pallas (hopper_sort_window=0), ")
    assert "sort_window" not in GPT(dataclasses.replace(named, attention_options="hopper_sort_window=0")).resolved_impls(1, 8192)


@pytest.mark.parametrize("unroll, unrolled_bound, chunk", [(1, 64, 32), (2, 64, 64), (2, 48, 32)])
def test_ffn_chunk_size_auto_takes_the_largest_multiple_of_q_chunk_size_within_its_bound(
    batch, monkeypatch, unroll, unrolled_bound, chunk
):
    """ffn_chunk_size=0 over a sequence of 64 with q_chunk_size 16: where the stack is a loop,
    a bound (FFN_CHUNK) of 48 gives chunks of 32 (48 does not divide 64); where it is unrolled
    (scan_unroll 2 of 2 layers) its own bound (FFN_CHUNK_UNROLLED) holds instead: 64 takes the
    whole sequence, 48 chunks of 32. Each computes the function of any other chunking."""
    import bpt.models.gpt as gpt

    tokens, targets, params = batch
    cfg = dataclasses.replace(BASE, attention_impl="reference", scan_unroll=unroll)
    want = forward(dataclasses.replace(cfg, ffn_chunk_size=16), params, tokens, targets)
    seen = []

    def spy(fn, xs, *, chunk_size, **kw):
        seen.append(chunk_size)
        return scan_chunks(fn, xs, chunk_size=chunk_size, **kw)

    scan_chunks = gpt.scan_chunks
    monkeypatch.setattr(gpt, "scan_chunks", spy)
    monkeypatch.setattr(gpt, "FFN_CHUNK", 48)
    monkeypatch.setattr(gpt, "FFN_CHUNK_UNROLLED", unrolled_bound)
    got = forward(cfg, params, tokens, targets)
    assert set(seen) == {chunk}, seen
    assert rel_err(got[0], want[0]) < TOL and rel_err(got[1], want[1]) < TOL
    assert tree_rel_err(got[2], want[2]) < TOL


@pytest.mark.parametrize(
    "policy",
    [
        "nothing_saveable",
        "dots_saveable",
        "dots_with_no_batch_dims_saveable",
        "everything_saveable",
        "attention_saveable",
        "attention_and_dots_saveable",
        "attention_dots_and_norms_saveable",
        "none",
    ],
)
def test_remat_policies_do_not_change_gradients(batch, policy):
    tokens, targets, params = batch
    expected = forward(BASE, params, tokens, targets)[2]
    cfg = dataclasses.replace(BASE, remat_layer=policy, remat_attention=policy, remat_ffn=policy)
    assert tree_rel_err(forward(cfg, params, tokens, targets)[2], expected) < TOL


@pytest.mark.parametrize(
    "mode, group, policy", [("blockwise_parallel", 2, "nothing_saveable"), ("vanilla", 4, "none")]
)
def test_grouped_remat_computes_the_same_function(key, mode, group, policy):
    cfg = dataclasses.replace(BASE, num_layers=4, attention_mode=mode, remat_layer=policy)
    params = init_params(cfg, key)
    tokens = jax.random.randint(jax.random.fold_in(key, 1), (2, 64), 0, cfg.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)
    expected = forward(cfg, params, tokens, targets)
    grouped = dataclasses.replace(cfg, remat_group=group)
    assert jax.tree.structure(init_params(grouped, key)) == jax.tree.structure(params)  # one layout
    logits, loss, grads = forward(grouped, params, tokens, targets)
    assert rel_err(logits, expected[0]) < TOL and rel_err(loss, expected[1]) < TOL
    assert tree_rel_err(grads, expected[2]) < TOL
    # With dropout the groups draw their own masks: training still differs from evaluation.
    model = GPT(dataclasses.replace(grouped, dropout=0.3))
    train = model.apply(
        {"params": params}, tokens, targets=targets, deterministic=False, rngs={"dropout": key}
    ).loss
    assert np.isfinite(float(train)) and float(train) != float(loss)


@pytest.mark.parametrize("stack", ["loop", "unrolled", "unscanned"])
def test_split_remat_computes_the_same_function(key, stack, capsys):
    """remat_first_layers: the first layers under remat_first, the rest under remat_layer,
    as a loop (two scans), unrolled or unscanned: the same logits, loss and gradients, one
    parameter layout; and the backward keeps the first policy's results in those layers
    alone (between the two policies' residuals, by the layers' share)."""
    cfg = dataclasses.replace(BASE, num_layers=4, remat_layer="attention_saveable")
    if stack == "unrolled":
        cfg = dataclasses.replace(cfg, scan_unroll=4)
    elif stack == "unscanned":
        cfg = dataclasses.replace(cfg, scan_layers=False)
    params = init_params(cfg, key)
    tokens = jax.random.randint(jax.random.fold_in(key, 1), (2, 64), 0, cfg.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)
    expected = forward(cfg, params, tokens, targets)
    split = dataclasses.replace(cfg, remat_first_layers=3)
    assert [split.layer_remat(i) for i in range(4)] == ["attention_and_dots_saveable"] * 3 + ["attention_saveable"]
    assert jax.tree.structure(init_params(split, key)) == jax.tree.structure(params)  # one layout
    logits, loss, grads = forward(split, params, tokens, targets)
    assert rel_err(logits, expected[0]) < TOL and rel_err(loss, expected[1]) < TOL
    assert tree_rel_err(grads, expected[2]) < TOL

    def saved(c) -> int:  # numbers the backward keeps
        lines = saved_residuals(c, params, tokens, targets, capsys).splitlines()
        shapes = [re.match(r"\w+\[([\d,]*)\]", line).group(1) for line in lines if line.strip()]
        return sum(math.prod(int(n) for n in shape.split(",") if n) for shape in shapes)

    dots = saved(dataclasses.replace(cfg, remat_layer="attention_and_dots_saveable"))
    fewer = saved(cfg)
    assert dots > fewer and saved(split) == fewer + 3 * (dots - fewer) // 4, (saved(split), fewer, dots)


@pytest.mark.parametrize("unroll", [1, 4])
def test_cast_params_once_computes_the_same_function(key, unroll):
    """model.cast_params_once: the stacked parameters cast to the compute dtype before the
    stack's scan, not in each layer: in bf16 the same logits, loss and gradients, bit for
    bit (every layer casts them so anyway), one parameter layout, the gradients in the
    parameters' float32."""
    cfg = dataclasses.replace(
        BASE, num_layers=4, dtype="bfloat16", remat_layer="attention_saveable", scan_unroll=unroll
    )
    params = init_params(cfg, key)
    tokens = jax.random.randint(jax.random.fold_in(key, 1), (2, 64), 0, cfg.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)
    expected = forward(cfg, params, tokens, targets)
    once = dataclasses.replace(cfg, cast_params_once=True)
    assert jax.tree.structure(init_params(once, key)) == jax.tree.structure(params)
    logits, loss, grads = forward(once, params, tokens, targets)
    # bit for bit: the same casts, made once
    assert rel_err(logits, expected[0]) == 0 and rel_err(loss, expected[1]) == 0
    assert tree_rel_err(grads, expected[2]) == 0
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


def step_flops(cfg, params, tokens, targets) -> float:
    """XLA's FLOP count of the compiled loss and gradient (value_and_grad: the forward's
    results are needed, so a recomputed forward is not dead code)."""
    model = GPT(cfg)
    loss = lambda p: model.apply({"params": p}, tokens, targets=targets).loss  # noqa: E731
    cost = jax.jit(jax.value_and_grad(loss)).lower(params).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


@pytest.mark.parametrize("mode", ["blockwise_parallel", "memory_efficient"])
def test_attention_saveable_keeps_the_attention_forward_from_running_twice(batch, mode, capsys):
    """Under layer remat the backward recomputes the layer; with attention_saveable the
    attention's output and logsumexp are kept as well (exactly those numbers more), so only
    the projections around it are recomputed."""
    tokens, targets, params = batch
    cfg = dataclasses.replace(BASE, attention_mode=mode)
    kept = dataclasses.replace(cfg, remat_layer="attention_saveable")

    def saved(cfg) -> int:  # numbers the backward keeps, from jax's printout ("f32[2,64] ...")
        lines = saved_residuals(cfg, params, tokens, targets, capsys).splitlines()
        shapes = [re.match(r"\w+\[([\d,]*)\]", line).group(1) for line in lines if line.strip()]
        return sum(math.prod(int(n) for n in shape.split(",") if n) for shape in shapes)

    b, n = tokens.shape
    per_layer = b * n * BASE.d_model + b * BASE.num_heads * n  # the output and the logsumexp
    assert saved(kept) - saved(cfg) == BASE.num_layers * per_layer
    # And the recomputation no longer runs it: fewer FLOPs (XLA's count takes each loop body
    # once, so the saving shows as the blockwise loops' bodies, not their trip counts).
    assert step_flops(kept, params, tokens, targets) < step_flops(cfg, params, tokens, targets)


def test_attention_and_dots_saveable_keeps_attention_inputs_not_their_projections(batch, capsys):
    """attention_and_dots_saveable keeps q, k and v as attention takes them (biases added,
    rotary positions applied) in place of the projections' matmul outputs: the same numbers,
    and the backward recomputes no bias add or rotation."""
    tokens, targets, params = batch
    cfg = dataclasses.replace(BASE, remat_layer="attention_and_dots_saveable", scan_layers=False)
    assert cfg.position_embedding == "rotary" and cfg.use_bias
    lines = saved_residuals(cfg, unstack_layers(params, BASE.num_layers), tokens, targets, capsys).splitlines()
    b, n, hd = *tokens.shape, BASE.d_model // BASE.num_heads
    qkv = {f"f32[{b},{n},{h},{hd}]" for h in (BASE.num_heads, BASE.num_kv_heads)}
    named = [line for line in lines if "named 'attention_inputs'" in line]
    assert len(named) == 3 * BASE.num_layers and {line.split()[0] for line in named} == qkv
    assert not [line for line in lines if line.split()[0] in qkv and "dot_general" in line]


def test_attention_dots_and_norms_saveable_runs_each_norm_kernel_once(batch, capsys):
    """attention_dots_and_norms_saveable also keeps what bpt's LayerNorm kernels computed (the
    norms' outputs and statistics, ln2's residual sum), so the backward runs no norm forward
    again: in interpret mode each kernel is a loop, and the compiled step has fewer of them;
    the gradients are the same."""
    tokens, targets, params = batch
    unstacked = unstack_layers(params, BASE.num_layers)
    cfg = dataclasses.replace(BASE, norm_impl="pallas", scan_layers=False, remat_layer="attention_and_dots_saveable")
    kept = dataclasses.replace(cfg, remat_layer="attention_dots_and_norms_saveable")
    expected = forward(dataclasses.replace(cfg, remat_layer="none"), unstacked, tokens, targets)[2]
    assert tree_rel_err(forward(kept, unstacked, tokens, targets)[2], expected) < TOL

    def loops(c) -> int:
        model = GPT(c)
        loss = lambda p: model.apply({"params": p}, tokens, targets=targets).loss  # noqa: E731
        return jax.jit(jax.grad(loss)).lower(unstacked).compile().as_text().count(" while(")

    assert loops(kept) < loops(cfg)
    named = [line for line in saved_residuals(kept, unstacked, tokens, targets, capsys).splitlines() if "norm_results" in line]
    assert len(named) == 3 * BASE.num_layers  # ln1's output, mean and rstd (ln2's sit in the FFN's chunk loop)


def test_grouped_remat_keeps_fewer_layer_inputs():
    """8 layers: 8 saved layer inputs alone, 8/4 + 4 = 6 with groups of four. Measured as
    the growth of the gradient's temporary memory per token (constant buffers cancel)."""

    def temp(group, seq_len):
        c = base_config("tiny")
        c.model.num_layers, c.model.remat_group = 8, group
        c.data.seq_len = seq_len
        c.model.q_chunk_size = c.model.kv_chunk_size = c.model.loss_chunk_size = 256
        model = GPT(model_config(c.model, vocab_size=256, seq_len=seq_len))
        params = jax.eval_shape(lambda: init_params(model.config, jax.random.PRNGKey(0), seq_len))
        tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
        loss = lambda p, t: model.apply({"params": p}, t, targets=t).loss  # noqa: E731
        return jax.jit(jax.grad(loss)).lower(params, tokens).compile().memory_analysis().temp_size_in_bytes

    per_token = {g: (temp(g, 8192) - temp(g, 4096)) / 4096 for g in (1, 4)}
    layer_input = 128 * 4  # bytes a token of one [seq, d_model] float32 activation
    saved = (per_token[1] - per_token[4]) / layer_input
    assert 1.5 < saved < 3, (saved, per_token)


def saved_residuals(cfg, params, tokens, targets, capsys) -> str:
    """What the backward keeps of the loss's forward pass, as jax prints it."""
    capsys.readouterr()
    model = GPT(cfg)
    loss = lambda p: model.apply({"params": p}, tokens, targets=targets).loss  # noqa: E731
    jax.ad_checkpoint.print_saved_residuals(loss, params)
    return capsys.readouterr().out


@pytest.mark.parametrize("mode", ["blockwise_parallel", "memory_efficient"])
def test_offloaded_layer_inputs_live_in_host_memory_and_change_nothing(batch, mode, capsys):
    tokens, targets, params = batch
    cfg = dataclasses.replace(BASE, attention_mode=mode)
    offloaded = dataclasses.replace(cfg, offload_layer_inputs=True)
    expected = forward(cfg, params, tokens, targets)
    logits, loss, grads = forward(offloaded, params, tokens, targets)
    assert rel_err(logits, expected[0]) < TOL and rel_err(loss, expected[1]) < TOL
    assert tree_rel_err(grads, expected[2]) < TOL
    stack = f"[2,2,64,{BASE.d_model}]"  # [layers, batch, seq, d_model]: the saved layer inputs
    assert f"f32{stack}" in saved_residuals(cfg, params, tokens, targets, capsys)
    kept = saved_residuals(offloaded, params, tokens, targets, capsys)
    assert f"f32<host>{stack}" in kept and f"f32{stack}" not in kept


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="host offload moves data off a GPU")
def test_offloaded_layer_inputs_change_nothing_on_gpu():
    """On a GPU the saved layer inputs really leave the device (on a CPU host memory is the
    device's): the loss and gradients are those of the step that keeps them, with attention
    kept as remat auto's offloaded candidate keeps it, in bf16 on the GPU's kernels."""
    cfg = dataclasses.replace(
        BASE, num_layers=4, d_model=256, num_heads=4, num_kv_heads=4, max_seq_len=1024, dtype="bfloat16",
        q_chunk_size=256, kv_chunk_size=256, loss_chunk_size=256, attention_impl="auto",
        attention_mode="blockwise_parallel", remat_layer="attention_saveable",
    )  # fmt: skip
    key, kt = jax.random.split(jax.random.PRNGKey(11))
    tokens = jax.random.randint(kt, (2, 1024), 0, cfg.vocab_size)
    params = init_params(cfg, key, 1024)
    targets = jnp.roll(tokens, -1, axis=1)
    _, loss, grads = forward(cfg, params, tokens, targets)
    _, off_loss, off_grads = forward(dataclasses.replace(cfg, offload_layer_inputs=True), params, tokens, targets)
    assert rel_err(off_loss, loss) < 1e-6 and tree_rel_err(off_grads, grads) < 1e-6


@pytest.mark.parametrize("mode", MODES)
def test_chunked_and_full_loss_agree(batch, mode, capsys):
    tokens, targets, params = batch
    cfgs = {
        impl: dataclasses.replace(BASE, attention_mode=mode, loss_impl=impl) for impl in ("chunked", "full")
    }
    (_, loss_c, grads_c), (_, loss_f, grads_f) = (forward(c, params, tokens, targets) for c in cfgs.values())
    assert rel_err(loss_c, loss_f) < TOL and tree_rel_err(grads_c, grads_f) < TOL
    # Chunked, the final LayerNorm runs per chunk: the backward keeps none of its outputs or
    # row statistics, which the full loss keeps ([batch, seq, d_model] and [batch, seq, 1]).
    def final_norms(impl: str) -> list[str]:
        out = saved_residuals(cfgs[impl], params, tokens, targets, capsys)
        return [line.split(" from ")[0] for line in out.splitlines() if "_layer_norm_fwd" in line]

    kept = {f"f32[2,64,{BASE.d_model}] output of add", "f32[2,64,1] output of rsqrt"}
    assert kept <= set(final_norms("full"))
    assert final_norms("chunked") == []


@pytest.mark.parametrize("mode", MODES)
def test_future_tokens_never_change_earlier_logits(batch, key, mode):
    tokens, _, params = batch
    model = GPT(dataclasses.replace(BASE, attention_mode=mode))
    cut = 37
    changed = tokens.at[:, cut:].set(jax.random.randint(key, (2, 64 - cut), 0, BASE.vocab_size))
    a = model.apply({"params": params}, tokens)
    b = model.apply({"params": params}, changed)
    np.testing.assert_allclose(a[:, :cut], b[:, :cut], rtol=0, atol=1e-6)
    assert np.abs(np.asarray(a[:, cut:] - b[:, cut:])).max() > 1e-3


def test_dropout_is_active_only_when_training(batch):
    tokens, targets, params = batch
    model = GPT(dataclasses.replace(BASE, dropout=0.2))
    eval_loss = model.apply({"params": params}, tokens, targets=targets).loss
    train = lambda seed: (
        model.apply(
            {"params": params},
            tokens,
            targets=targets,
            deterministic=False,
            rngs={"dropout": jax.random.PRNGKey(seed)},
        ).loss
    )
    assert float(train(0)) == float(train(0))
    assert float(train(0)) != float(train(1)) and float(train(0)) != float(eval_loss)


def test_parameters_carry_logical_axis_names():
    boxed = GPT(BASE).init(jax.random.PRNGKey(0), jnp.zeros((1, 64), jnp.int32))["params"]
    specs = nn.get_partition_spec(boxed)
    assert tuple(specs["embedding"]) == ("vocab", "embed")
    assert tuple(specs["layers"]["wq"]) == ("layers", "embed", "heads", "head_dim")
    assert tuple(specs["layers"]["wk"]) == ("layers", "embed", "kv_heads", "head_dim")
    assert tuple(specs["layers"]["w1"]) == ("layers", "embed", "mlp")
    assert all(
        len(s) for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    )
    params = nn.meta.unbox(boxed)
    held = BASE.num_params() + BASE.vocab_padding_params  # padding rows are held, not counted
    assert sum(x.size for x in jax.tree.leaves(params)) == held


def test_attention_options_reach_the_layers_kernels_forward_and_backward(batch):
    """model.attention_options sets the kernels' settings in every layer (here the Triton
    kernels' blocks, in interpret mode): the train step's forward and backward launches
    take them; the function is the same."""
    tokens, targets, params = batch
    cfg = dataclasses.replace(BASE, attention_impl="pallas")
    tuned = dataclasses.replace(cfg, attention_options="block_q=16, block_k=16,block_q_bwd=16,block_k_bwd=16")

    def step_grids(cfg):
        loss = lambda p: GPT(cfg).apply({"params": p}, tokens, targets=targets).loss  # noqa: E731
        return kernel_grids(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)

    blocks = {name: {grid[-1] for grid in grids} for name, grids in step_grids(tuned).items()}
    assert blocks == {"bpt_flash_fwd": {4}, "bpt_flash_bwd_dkdv": {4}, "bpt_flash_bwd_dq": {4}}
    assert {grid[-1] for grid in step_grids(cfg)["bpt_flash_fwd"]} == {1}  # the defaults: one 64-row block
    expected = forward(cfg, params, tokens, targets)
    logits, loss, grads = forward(tuned, params, tokens, targets)
    assert rel_err(logits, expected[0]) < TOL
    assert tree_rel_err(grads, expected[2]) < TOL


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("attention_mode", "flash", "unknown model.attention_mode 'flash'"),
        ("attention_impl", "pallas2", "unknown model.attention_impl 'pallas2'; allowed: reference, blockwise"),
        ("remat_ffn", "save_all", "unknown model.remat_ffn 'save_all'"),
        ("num_kv_heads", 3, r"num_heads \(4\) must be divisible by model.num_kv_heads \(3\)"),
        ("q_chunk_size", 0, "model.q_chunk_size must be a positive integer"),
        ("ffn_chunk_size", -1, r"model.ffn_chunk_size must be a positive integer or 0 \(auto\)"),
        ("dtype", "float8", "unknown model.dtype"),
        ("remat_group", 3, "model.remat_group=3 must divide model.num_layers=2"),
        ("remat_group", 0, "model.remat_group must be a positive integer"),
        ("scan_unroll", 0, "model.scan_unroll must be a positive integer; got 0"),
        ("remat_first_layers", 2, r"model.remat_first_layers must be an integer from 0 to model.num_layers - 1 \(1\); got 2"),
        ("remat_first_layers", -1, "model.remat_first_layers must be an integer from 0"),
        ("remat_first", "dots", "unknown model.remat_first 'dots'"),
        ("head_dim", 0, "model.head_dim must be a positive integer or None; got 0"),
        ("loss_impl", "blockwise", "unknown model.loss_impl 'blockwise'; allowed: auto, chunked, full"),
        ("offload_layer_inputs", True, "offload_layer_inputs needs model.remat_layer other than 'none'"),
        ("norm_impl", "triton", "unknown model.norm_impl 'triton'; allowed: auto, xla, pallas"),
        ("attention_options", "hopper_block_k=96", "model.attention_options='hopper_block_k=96': hopper_block_k=96 is not a block size"),
        ("attention_options", "stages=2", "unknown flash attention setting 'stages'; allowed: block_q"),
        ("attention_options", "hopper_dq_split=rows", "model.attention_options='hopper_dq_split=rows': .*rows"),
    ],
)
def test_bad_model_settings(field, value, message):
    cfg = dataclasses.replace(BASE, remat_layer="none") if field == "offload_layer_inputs" else BASE
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(cfg, **{field: value})


def test_split_remat_needs_plain_layer_remat():
    with pytest.raises(ValueError, match="model.remat_first_layers=1 needs model.remat_group=1; got remat_group=2"):
        dataclasses.replace(BASE, remat_group=2, remat_first_layers=1)


def test_offload_needs_plain_layer_remat():
    with pytest.raises(
        ValueError, match="and model.remat_group=1; got remat_layer='nothing_saveable', remat_group=2"
    ):
        dataclasses.replace(BASE, remat_group=2, offload_layer_inputs=True)


def train_step_temp_bytes(mode: str, seq_len: int) -> int:
    c = base_config("tiny")
    c.data.seq_len, c.train.batch_size = seq_len, 1
    c.model.attention_mode = mode
    c.model.q_chunk_size = c.model.kv_chunk_size = c.model.loss_chunk_size = 128
    return TrainingStep(c, vocab_size=256).memory().temp


@pytest.mark.parametrize("seq_len", [1024, 4096])
def test_training_step_memory_ordering(seq_len):
    vanilla, efficient, bpt = (train_step_temp_bytes(m, seq_len) for m in MODES)
    assert bpt < efficient < vanilla, (bpt, efficient, vanilla)
