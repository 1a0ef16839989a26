"""The Pallas FlashAttention-2 kernels against the reference: outputs, logsumexp, all gradients.

On CPU the kernels run in Pallas interpret mode on small shapes; the tests marked gpu run
the Triton-lowered kernels at real sizes (scripts run them on a GPU machine, not CI).
"""

import functools
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import kernel_grids, load_script, rel_err, saved_and_grads
from jax import lax

from bpt.ops import attention, reference_attention, segments
from bpt.ops.kernels import attention_hopper, flash_attention, flash_attention_with_lse
from bpt.ops.kernels.attention import current_settings, kernel_settings, parse_settings
from bpt.ops.remat import remat

ON_GPU = jax.default_backend() == "gpu"


def inputs(key, batch, seq, heads, kv_heads, head_dim, dtype=jnp.float32):
    kq, kk, kv, kd = jax.random.split(key, 4)
    q = jax.random.normal(kq, (batch, seq, heads, head_dim), dtype)
    k = jax.random.normal(kk, (batch, seq, kv_heads, head_dim), dtype)
    v = jax.random.normal(kv, (batch, seq, kv_heads, head_dim), dtype)
    d_out = jax.random.normal(kd, (batch, seq, heads, head_dim), dtype)
    return q, k, v, d_out


def packed_segments(key, batch, seq, num=3):
    """Sorted random segment ids: documents of random lengths packed back to back."""
    cuts = jnp.sort(jax.random.randint(key, (batch, num - 1), 1, seq), axis=1)
    return jnp.sum(jnp.arange(seq)[None, :, None] >= cuts[:, None, :], axis=-1).astype(jnp.int32)


def poison_device_memory(nbytes: int) -> None:
    """Fills the memory the allocator hands out next with NaN: an output element a kernel fails
    to write then shows up as NaN instead of a lucky zero."""
    jax.block_until_ready(jnp.full((nbytes // 4,), jnp.nan, jnp.float32)).delete()


def compare(q, k, v, d_out, *, causal, segment_ids, tol, **blocks):
    if ON_GPU:
        poison_device_memory(64 * q.nbytes)

    def run(fn):
        def loss(q, k, v):
            return jnp.sum(fn(q, k, v).astype(jnp.float32) * d_out.astype(jnp.float32))

        return fn(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    out, grads = run(
        lambda q, k, v: flash_attention(q, k, v, causal=causal, segment_ids=segment_ids, **blocks)
    )
    up = lambda x: x.astype(jnp.float32)  # the reference in float32: the truth for bf16 inputs
    with jax.default_matmul_precision("highest"):  # no TF32 in the truth on GPUs
        ref_out, ref_grads = run(
            lambda q, k, v: reference_attention(up(q), up(k), up(v), causal=causal, segment_ids=segment_ids)
        )
    assert out.dtype == q.dtype and out.shape == q.shape
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
    assert rel_err(out, ref_out) < tol, rel_err(out, ref_out)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.shape == r.shape and rel_err(g, r) < tol, (name, rel_err(g, r))


SMALL = dict(block_q=32, block_k=16, block_q_bwd=16, block_k_bwd=32)


@pytest.mark.parametrize(
    "seq, heads, kv_heads, head_dim, causal, segments",
    [
        (64, 2, 2, 32, False, False),
        (64, 2, 2, 32, True, False),
        (80, 4, 2, 24, True, True),  # padded sequence and head_dim, GQA, packed documents
        (96, 2, 1, 32, False, True),  # MQA
        (72, 2, 1, 32, False, False),  # padded keys, non-causal: the masked tail block
    ],
)
def test_flash_matches_reference_in_interpret_mode(key, seq, heads, kv_heads, head_dim, causal, segments):
    q, k, v, d_out = inputs(key, 2, seq, heads, kv_heads, head_dim)
    seg = packed_segments(jax.random.fold_in(key, 1), 2, seq) if segments else None
    compare(q, k, v, d_out, causal=causal, segment_ids=seg, tol=1e-5, **SMALL)


def test_logsumexp_and_its_gradient_and_rows_that_see_nothing(key):
    q, k, v, _ = inputs(key, 1, 48, 2, 2, 16)
    q_seg = jnp.array([[0] * 24 + [5] * 24])  # segment 5 has no keys: those rows see nothing
    kv_seg = jnp.zeros((1, 48), jnp.int32)
    out, lse = flash_attention_with_lse(q, k, v, segment_ids=(q_seg, kv_seg), **SMALL)
    assert bool(jnp.all(out[:, 24:] == 0)) and bool(jnp.all(jnp.isinf(lse[:, :, 24:])))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
    ref_lse = jax.nn.logsumexp(scores, axis=-1)[:, :, :24]
    assert rel_err(lse[:, :, :24], ref_lse) < 1e-6
    grad = jax.grad(lambda q: jnp.sum(flash_attention_with_lse(q, k, v, **SMALL)[1]))(q)
    ref_grad = jax.grad(lambda q: jnp.sum(jax.nn.logsumexp(jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0, -1)))(q)
    assert rel_err(grad, ref_grad) < 1e-5


def under_remat(attend, q, d_out, capsys) -> dict:
    """policy -> (what the backward keeps, as jax prints it; the gradient wrt q) of
    attend(tanh(q)) under nothing_saveable and attention_saveable."""
    out = {}
    for policy in ("nothing_saveable", "attention_saveable"):
        layer = remat(lambda q: attend(jnp.tanh(q)), policy)
        loss = lambda q, layer=layer: jnp.sum(layer(q).astype(jnp.float32) * d_out)  # noqa: E731
        out[policy] = saved_and_grads(loss, (q,), capsys)
    return out


def test_attention_saveable_keeps_the_kernels_output_and_logsumexp(key, capsys):
    """Under remat with attention_saveable the backward kernels read the saved output and
    logsumexp instead of re-running the forward kernel; the gradient is the same."""
    q, k, v, d_out = inputs(key, 1, 48, 2, 2, 16)
    runs = under_remat(lambda q: flash_attention(q, k, v, causal=True, **SMALL), q, d_out, capsys)
    for policy, (saved, _) in runs.items():
        assert ("named 'attention_out'" in saved and "named 'attention_lse'" in saved) == (
            policy == "attention_saveable"
        ), saved
    assert rel_err(runs["attention_saveable"][1], runs["nothing_saveable"][1]) < 1e-6


def kernel_result_uses(jaxpr, kernel: str) -> list[str]:
    """The primitives that read the named Pallas kernel's results, in every jaxpr nested in
    jaxpr (one list for all its launches)."""
    uses = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call" and str(eqn.params["name"]) == kernel:
            results = set(map(id, eqn.outvars))
            uses += [e.primitive.name for e in jaxpr.eqns if any(id(v) in results for v in e.invars)]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            uses += kernel_result_uses(sub, kernel)
    return uses


def test_kernel_settings_reach_the_forward_and_the_backward_traced_after_the_context(key):
    """A kernel_settings context sets the settings a call leaves at their defaults, and the
    backward (traced by grad after the context closed) keeps what its forward was traced
    with; a call's own argument wins; the result is the same function."""
    q, k, v, d_out = inputs(key, 1, 64, 2, 2, 16)

    def loss(q, **given):
        with kernel_settings(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16):
            return jnp.sum(flash_attention(q, k, v, causal=True, **given) * d_out)

    grids = kernel_grids(jax.make_jaxpr(jax.grad(loss))(q).jaxpr)
    assert grids == {"bpt_flash_fwd": [(1, 2, 4)], "bpt_flash_bwd_dkdv": [(1, 2, 4)], "bpt_flash_bwd_dq": [(1, 2, 4)]}
    own = kernel_grids(jax.make_jaxpr(jax.grad(functools.partial(loss, block_q=32)))(q).jaxpr)
    assert own["bpt_flash_fwd"] == [(1, 2, 2)]
    assert current_settings() == {}  # closed
    plain = jax.grad(lambda q: jnp.sum(flash_attention(q, k, v, causal=True) * d_out))(q)
    assert rel_err(jax.grad(loss)(q), plain) < 1e-5


def test_kernel_settings_as_text_and_their_errors():
    assert parse_settings(" hopper_sort_window=0, hopper_block_k=64,hopper_fused_dq=False,hopper_tile_group=None,"
                          "hopper_query_order=descending") == {  # fmt: skip
        "hopper_sort_window": 0,
        "hopper_block_k": 64,
        "hopper_fused_dq": False,
        "hopper_tile_group": None,
        "hopper_query_order": "descending",
    }
    assert parse_settings("") == {}
    for text, message in [
        ("hopper_sort_window", "is not name=value"),
        ("block_size=64", "unknown flash attention setting 'block_size'; allowed: block_q, block_k"),
        ("hopper_block_k=96", "hopper_block_k=96 is not a block size of the Hopper kernels; allowed: \\(64, 128\\)"),
        ("hopper_query_order=sideways", "hopper_query_order"),
        ("forward=cuda", "unknown flash forward 'cuda'"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_settings(text)
    with pytest.raises(ValueError, match="unknown flash attention setting 'warps'"), kernel_settings(warps=8):
        pass


@pytest.mark.parametrize("policy", ["attention_saveable", "nothing_saveable"])
def test_the_forward_kernels_results_pass_one_barrier(key, policy):
    """Whatever the remat policy, the forward kernel's results go first through an
    optimization barrier (bpt.ops.remat.kept_results) and nowhere else: with it, XLA's GPU
    compiler can no longer clone the launch into a fusion that writes the results into a
    layer scan's stack of saved values, which ran the forward twice in GPT-1B's step
    (test_a_scanned_train_step_launches_each_hopper_kernel_once checks the GPU program)."""
    q, k, v, d_out = inputs(key, 1, 48, 2, 2, 16)
    layer = remat(lambda q: flash_attention(jnp.tanh(q), k, v, causal=True, **SMALL), policy)
    jaxpr = jax.make_jaxpr(jax.grad(lambda q: jnp.sum(layer(q) * d_out)))(q).jaxpr
    uses = kernel_result_uses(jaxpr, "bpt_flash_fwd")
    assert uses and set(uses) == {"optimization_barrier"}, uses


@pytest.mark.gpu
@pytest.mark.skipif(not (ON_GPU and attention_hopper.is_hopper()), reason="the Hopper kernels need an H100-class GPU")
def test_a_scanned_train_step_launches_each_hopper_kernel_once():
    """The compiled train step of a two-layer scanned GPT on bpt's kernels holds two Mosaic GPU
    launches, the forward and the backward: before kept_results's barrier XLA's dynamic-slice
    fusion cloned the forward (three launches; measured on an H200, jax 0.11.2)."""
    from bpt.config import load_config_file, override
    from bpt.train.probe import TrainingStep

    c = load_config_file("configs/tiny.py")
    for setting in (
        "model.attention_impl=pallas",
        "model.remat_layer=attention_and_dots_saveable",
        "model.dtype=bfloat16",
        "model.d_model=256",
        "model.num_heads=2",
        "data.seq_len=1024",
        "train.batch_size=1",
    ):
        override(c, setting)
    program = TrainingStep(c).compiled().as_text()
    assert program.count('custom_call_target="mosaic_gpu_v2"') == 2


@pytest.mark.parametrize("causal, segments", [(True, False), (False, True)])
def test_fp8_forward_runs_its_matmuls_in_e4m3_within_its_error(key, causal, segments):
    """fp8=True: the forward kernel takes float8_e4m3fn q, k, v (scaled per token, per token
    and per channel) and keeps the inputs' dtype out; its error against the float32 truth is
    e4m3's (3 mantissa bits): under 8% of the output's norm, above the 16-bit kernel's; the
    logsumexp and the gradients (the 16-bit backward at the fp8 forward's statistics) stay
    close. Padded length and head_dim, GQA, packed documents."""
    q, k, v, d_out = inputs(key, 1, 80, 4, 2, 24, jnp.bfloat16)
    seg = packed_segments(jax.random.fold_in(key, 1), 1, 80) if segments else None
    settings = dict(causal=causal, segment_ids=seg, **SMALL)
    fp8 = lambda q, k, v: flash_attention_with_lse(q, k, v, fp8=True, **settings)  # noqa: E731
    program = str(jax.make_jaxpr(fp8)(q, k, v))
    assert "bpt_flash_fwd_fp8" in program and "f8_e4m3fn" in program
    (out, lse), (half, _) = fp8(q, k, v), flash_attention_with_lse(q, k, v, **settings)
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    truth, truth_lse = flash_attention_with_lse(up(q), up(k), up(v), **settings)
    assert out.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(up(out))))
    assert rel_err(half, truth) < rel_err(out, truth) < 0.08, (rel_err(half, truth), rel_err(out, truth))
    assert rel_err(lse, truth_lse) < 0.01, rel_err(lse, truth_lse)
    loss = lambda fn: lambda q, k, v: jnp.sum(up(fn(q, k, v)[0]) * up(d_out))  # noqa: E731
    grads = jax.grad(loss(fp8), argnums=(0, 1, 2))(q, k, v)
    exact = jax.grad(loss(lambda *a: flash_attention_with_lse(*a, **settings)), argnums=(0, 1, 2))(
        up(q), up(k), up(v)
    )
    for name, g, r in zip("qkv", grads, exact):
        assert rel_err(g, r) < 0.1, (name, rel_err(g, r))
    with pytest.raises(ValueError, match="forward='hopper' cannot take fp8=True"):
        flash_attention(q, k, v, fp8=True, forward="hopper")
    same = dict(causal=causal, segment_ids=seg)  # model.attention_impl=pallas_fp8: the same kernel
    np.testing.assert_array_equal(
        attention(q, k, v, impl="pallas_fp8", **same), flash_attention(q, k, v, fp8=True, **same)
    )


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the fp8 kernel needs an NVIDIA GPU with fp8 tensor cores")
@pytest.mark.parametrize("head_dim, segments", [(128, False), (64, True)])
def test_fp8_forward_on_gpu(key, head_dim, segments):
    """The Triton-lowered fp8 forward at a real size: e4m3's error, and a finite gradient."""
    q, k, v, d_out = inputs(key, 2, 2048, 8, 2, head_dim, jnp.bfloat16)
    seg = packed_segments(jax.random.fold_in(key, 1), 2, 2048) if segments else None
    out, lse = jax.jit(
        lambda q, k, v: flash_attention_with_lse(q, k, v, causal=True, segment_ids=seg, fp8=True)
    )(q, k, v)
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        truth = reference_attention(up(q), up(k), up(v), causal=True, segment_ids=seg)
    assert out.dtype == jnp.bfloat16 and rel_err(out, truth) < 0.08, rel_err(out, truth)
    grads = jax.grad(
        lambda q: jnp.sum(up(flash_attention(q, k, v, causal=True, segment_ids=seg, fp8=True)) * up(d_out))
    )(q)
    assert bool(jnp.all(jnp.isfinite(up(grads))))


def test_default_blocks(key):
    """No blocks given: the float32 defaults (TRITON_BLOCKS), a padded length, causal."""
    q, k, v, d_out = inputs(key, 1, 100, 2, 1, 16)
    compare(q, k, v, d_out, causal=True, segment_ids=None, tol=1e-5)


def test_entry_point_and_bad_inputs(key):
    q, k, v, _ = inputs(key, 1, 32, 2, 2, 16)
    np.testing.assert_allclose(
        attention(q, k, v, impl="pallas", causal=True),
        reference_attention(q, k, v, causal=True),
        rtol=1e-5,
        atol=1e-5,
    )
    with pytest.raises(
        ValueError, match="query heads \\(2\\) must be a multiple of the number of key/value heads \\(3\\)"
    ):
        flash_attention(q, jnp.zeros((1, 32, 3, 16)), jnp.zeros((1, 32, 3, 16)))
    with pytest.raises(ValueError, match="equal query and key lengths"):
        flash_attention(q, k[:, :16], v[:, :16], causal=True)


@pytest.mark.parametrize(
    "dtype, head_dim, causal, kv_heads, block_k, fused_dq, seq, gqa, dq_split, query_order",
    [
        # GQA 2:1; the forward streams 4 key blocks through 2 slots; the backward adds dQ in
        # its dK/dV pass (the default), each warpgroup all of dQ's columns over its own keys
        # ("keys"); a CTA a key/value head walks the group, each head's query blocks from the
        # last down (query_order "descending"). (Each interpreted case costs
        # a minute or more on two cores: head_dim 128's fused backward runs here with segment
        # ids, in the next test; MQA, float16, 128-key blocks and the non-causal path run in
        # the GPU tests.)
        (jnp.bfloat16, 64, True, 1, 64, None, 256, "walk", "keys", "descending"),
        # GQA's default split, a CTA a query head's keys, and dQ over the tile's keys by the
        # warpgroups in turn ("steps"): one tile, since the interpreter did not finish the
        # dK/dV pass over two tiles of two heads (MHA too) in ten minutes.
        (jnp.bfloat16, 64, True, 1, 64, None, 128, "expand", "steps", "ascending"),
    ],
)
def test_hopper_kernels_in_the_mosaic_gpu_interpreter(
    key, dtype, head_dim, causal, kv_heads, block_k, fused_dq, seq, gqa, dq_split, query_order
):
    """The warp-specialized kernels' data movement, barriers and masks, run by Mosaic GPU's
    interpreter (the matmuls there are plain dots, and the fused backward's dQ is written per
    part and summed by XLA where the GPU reduces it in place; the GPU tests run the
    wgmma path)."""
    q, k, v, d_out = inputs(key, 1, seq, 2, kv_heads, head_dim, dtype)
    hopper = dict(
        forward="hopper",
        backward="hopper",
        hopper_block_k=block_k,
        hopper_fused_dq=fused_dq,
        hopper_gqa=gqa,
        hopper_dq_split=dq_split,
        hopper_query_order=query_order,
    )
    out, lse = flash_attention_with_lse(q, k, v, causal=causal, **hopper)
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    scores = jnp.einsum("bqhd,bkhd->bhqk", up(q), jnp.repeat(up(k), 2 // kv_heads, axis=2)) / math.sqrt(
        head_dim
    )
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -jnp.inf)
    assert rel_err(lse, jax.nn.logsumexp(scores, axis=-1)) < 1e-3
    compare(q, k, v, d_out, causal=causal, segment_ids=None, tol=1e-2, **hopper)


@pytest.mark.parametrize(
    "head_dim, causal, heads, kv_heads, sort_window, query_order",
    [
        # GQA 2:1; the backward adds dQ in its dK/dV pass, walking each span's query blocks
        # from the last down; the CTAs launch sorted by their spans in windows of 2 waves of
        # 2 SMs (sorted_launch: 4 tiles a window)
        (128, True, 2, 1, 2, "descending"),
        (64, False, 1, 1, 0, "ascending"),  # dQ in its own pass (fused_dq=False); the grid's launch order
    ],
)
def test_hopper_kernels_take_segment_ids_in_the_mosaic_gpu_interpreter(
    key, head_dim, causal, heads, kv_heads, sort_window, query_order, monkeypatch
):
    """Packed documents in the Hopper kernels (what "auto" takes for them on an H100-class
    GPU): each key block's segment ids ride the
    ring with its keys (forward, dQ), each query block's with its queries (dK/dV); outputs
    and gradients against float32 attention. GQA here as a CTA a key/value head walking its
    group's query heads (hopper_gqa="walk": the default's CTA a query head would make two
    heads of two tiles, which the interpreter does not finish; see the test before)."""
    monkeypatch.setattr(attention_hopper.pipeline, "device_sms", lambda: 2)
    q, k, v, d_out = inputs(key, 1, 256, heads, kv_heads, head_dim, jnp.bfloat16)
    seg = packed_segments(jax.random.fold_in(key, 1), 1, 256, num=4)
    hopper = dict(
        forward="hopper", backward="hopper", hopper_block_k=64, hopper_fused_dq=head_dim == 128, hopper_gqa="walk",
        hopper_sort_window=sort_window, hopper_query_order=query_order,
    )
    compare(q, k, v, d_out, causal=causal, segment_ids=seg, tol=1e-2, **hopper)


def _visible_blocks(row_seg, col_seg, rows, cols, causal, rows_are_keys):
    """[b, row blocks, column blocks]: where a block pair holds a row and a column of one
    segment (causal: the key at or before the query), element by element."""
    n, m = row_seg.shape[1], col_seg.shape[1]
    same = row_seg[:, :, None] == col_seg[:, None, :]
    if causal:
        i, j = np.arange(n)[:, None], np.arange(m)[None, :]
        same &= (i <= j) if rows_are_keys else (j <= i)
    return same.reshape(-1, n // rows, rows, m // cols, cols).any(axis=(2, 4))


def test_segment_spans_cover_every_block_a_row_block_sees_and_no_more_for_packed_documents():
    """segments.segment_spans, what the flash kernels stream per block with segment ids:
    against every (row, column) pair, the span holds every column block that shares a
    segment with the row block (under the causal mask, either side the keys), at least
    min_blocks; for packed documents (sorted ids, self-attention) nothing more; where the
    columns' ids are not sorted, every block the causal mask leaves (rows in any order with
    sorted columns still narrow it). With dense, the span's blocks that need no segment
    mask: exactly those where every pair is of one segment, for rows of one segment and
    sorted columns; none otherwise."""
    rng = np.random.default_rng(0)
    checked = tight = narrowed = dense = 0
    for trial in range(60):
        n, rows, cols = 256, int(rng.choice([64, 128])), int(rng.choice([32, 64, 128]))
        cuts = np.sort(rng.choice(np.arange(1, n), int(rng.integers(0, 12)), replace=False))
        ids = np.searchsorted(cuts, np.arange(n), side="right").astype(np.int32)
        row_seg = np.stack([ids, rng.permutation(ids) if trial % 3 == 0 else ids])  # row 1 unsorted
        cross = trial % 4 == 1  # the columns' ids shifted and sorted: rows whose segment no column has
        col_seg = np.sort(np.clip(row_seg + rng.integers(-1, 2), 0, None), axis=1) if cross else row_seg
        col_seg = col_seg.astype(np.int32)
        causal, keys_first = bool(trial % 2), trial % 5 == 0
        least = 2 if keys_first else 1
        spans_of = functools.partial(
            segments.segment_spans, jnp.asarray(row_seg), jnp.asarray(col_seg), rows=rows, cols=cols,
            causal=causal, rows_are_keys=keys_first, min_blocks=least,
        )
        spans, with_dense = np.asarray(spans_of()), np.asarray(spans_of(dense=True))
        seen = _visible_blocks(row_seg, col_seg, rows, cols, causal, keys_first)
        same = (row_seg[:, :, None] == col_seg[:, None, :]).reshape(2, n // rows, rows, n // cols, cols)
        same = same.all(axis=(2, 4))  # block pairs that need no segment mask
        assert spans.shape == (2, n // rows, 2) and spans.dtype == np.int32
        assert with_dense.shape == (2, n // rows, 4) and (with_dense[..., :2] == spans).all()
        for b in range(2):
            rows_sorted, cols_sorted = ((np.diff(x[b]) >= 0).all() for x in (row_seg, col_seg))
            for r, (first, stop) in enumerate(spans[b]):
                dense_first, dense_stop = with_dense[b, r, 2:]
                assert first <= dense_first <= dense_stop <= stop
                unmasked = np.nonzero(same[b, r, first:stop])[0] + first
                if cols_sorted and len(np.unique(row_seg[b, r * rows : (r + 1) * rows])) == 1:
                    dense += len(unmasked)
                    assert list(unmasked) == list(range(dense_first, dense_stop))
                else:
                    assert dense_first == dense_stop
                assert 0 <= first and first + least <= stop <= n // cols
                blocks = np.nonzero(seen[b, r])[0]
                if len(blocks):
                    checked += 1
                    assert first <= blocks.min() and blocks.max() < stop
                    if rows_sorted and cols_sorted and not cross:
                        tight += 1
                        assert stop - first == max(least, blocks.max() - blocks.min() + 1)
                if not cols_sorted and not causal:
                    assert (first, stop) == (0, n // cols)
                narrowed += bool(not rows_sorted and cols_sorted and stop - first < n // cols)
    assert checked > 300 and tight > 150 and narrowed > 0 and dense > 100


def test_block_bounds_equal_the_binary_search_for_sorted_columns():
    """segments.block_bounds (a comparison of each row block's least and greatest id with
    each column block's, what segment_spans uses where the block divides the columns)
    against segments.searched_bounds (jnp.searchsorted over the columns): the same four
    bounds for sorted column ids, ids that no column holds and ranges past either end
    included."""
    rng = np.random.default_rng(1)
    for trial in range(40):
        m, cols = 256, int(rng.choice([16, 32, 64, 128]))
        cuts = np.sort(rng.choice(np.arange(1, m), int(rng.integers(0, 20)), replace=False))
        col_seg = np.stack([np.searchsorted(cuts, np.arange(m), side="right")] * 2) * 2  # even ids only
        col_seg[1] = np.sort(rng.integers(0, 9, m))
        low = rng.integers(-2, 2 * len(cuts) + 3, (2, 7))
        high = low + rng.integers(0, 5, (2, 7))
        args = [jnp.asarray(x, jnp.int32) for x in (col_seg, low, high)]
        searched = [np.asarray(x) for x in segments.searched_bounds(*args, cols)]
        blocked = [np.asarray(x) for x in segments.block_bounds(*args, cols)]
        for a, c in zip(searched, blocked, strict=True):
            np.testing.assert_array_equal(a, c, err_msg=f"trial {trial}, cols {cols}")


def test_segment_spans_search_where_the_block_does_not_divide_the_columns():
    """Columns that are not a whole number of blocks: segment_spans falls back to the
    binary search, and still streams every block a row block sees."""
    ids = jnp.asarray(np.repeat(np.arange(5), 50)[None], jnp.int32)  # 250 columns, blocks of 64
    spans = np.asarray(segments.segment_spans(ids, ids, rows=50, cols=64, causal=False))
    assert spans.shape == (1, 5, 2)
    for r, (first, stop) in enumerate(spans[0]):  # row block r is document r: columns 50r..50r+49
        # the first block at most the last whole one (250 // 64 = 3 blocks), so that one is streamed
        assert first == min(50 * r // 64, 2) and stop == -(-(50 * r + 50) // 64)


@pytest.mark.parametrize(
    "kernel, causal, schedule",
    [("triton", True, None), ("triton", False, None), ("hopper", True, "overlap"), ("hopper", False, None)],
)
def test_documents_interior_blocks_run_without_the_segment_mask(key, kernel, causal, schedule):
    """A block of rows of one document runs the blocks wholly inside that document without
    the segment mask (segment_spans(dense=True)), and masks only the document's edges (and
    the diagonal): two documents of 150 and 234 tokens, so that some row blocks lie in one
    document (their spans begin with an edge block, then the interior) and one straddles
    both (every block masked). Outputs and gradients against float32 attention, in the
    forward's ping-pong and overlapped schedules (the pipeline takes the interior)."""
    q, k, v, d_out = inputs(key, 1, 384, 1, 1, 64, jnp.bfloat16)
    ids = jnp.concatenate([jnp.zeros((1, 150), jnp.int32), jnp.ones((1, 234), jnp.int32)], axis=1)
    blocks = dict(block_q=64, block_k=64, block_q_bwd=64, block_k_bwd=64)
    if kernel == "hopper":
        blocks = dict(hopper_block_k=64, hopper_schedule=schedule, hopper_dq_split="steps")
    for rows, cols, keys_first in ((128, 64, False), (64, 64, False), (128, 64, True)):
        spans = segments.segment_spans(
            ids, ids, rows=rows, cols=cols, causal=causal, rows_are_keys=keys_first, dense=True
        )
        dense = spans[0, :, 3] - spans[0, :, 2]
        assert int(dense.max()) >= 2 and int(dense.min()) == 0  # interiors, and a block across the two
        if not keys_first:  # an edge block before an interior
            assert bool(jnp.any(spans[0, :, 2] > spans[0, :, 0]))
    kernels = dict(forward=kernel, backward=kernel, **blocks)
    compare(q, k, v, d_out, causal=causal, segment_ids=ids, tol=1e-2, **kernels)


@pytest.mark.parametrize("kernel, length", [("triton", 384), ("hopper", 384), ("triton", 360)])
def test_packed_documents_never_read_the_blocks_between_them(key, kernel, length):
    """With sorted segment ids the kernels skip the blocks no row of a block's documents sees
    (segment_spans): not-a-number in those blocks, which a masked block would still carry
    into its matmuls (0 x NaN), leaves the results finite and exact. The forward, with the
    keys and values of a document no query has poisoned; dK and dV (the fused Hopper
    backward and the Triton dK/dV pass), with the queries and dO of a document no key has.
    At 360 tokens the Triton kernels pad to 384, the padded tokens' ids above the real ones
    (below them, the ids would no longer be sorted, and every block would be read)."""
    blocks = dict(block_q=64, block_k=64, block_q_bwd=64, block_k_bwd=64, hopper_block_k=64)
    fn = functools.partial(flash_attention_with_lse, forward=kernel, backward=kernel, **blocks)
    q, k, v, d_out = inputs(key, 1, length, 1, 1, 64, jnp.bfloat16)
    last = length - 256  # the third document's length

    def ids(*runs):  # (segment, length) runs back to back
        return jnp.concatenate([jnp.full((1, n), i, jnp.int32) for i, n in runs], axis=1)

    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    nan = jnp.array(jnp.nan, jnp.bfloat16)

    # keys 128-255 are document 1's, which no query is in
    q_ids, kv_ids = ids((0, 128), (2, 128 + last)), ids((0, 128), (1, 128), (2, last))
    alien = (kv_ids == 1)[..., None, None]
    out, _ = fn(q, jnp.where(alien, nan, k), jnp.where(alien, nan, v), segment_ids=(q_ids, kv_ids))
    truth = reference_attention(up(q), up(k), up(v), segment_ids=(q_ids, kv_ids))
    assert bool(jnp.all(jnp.isfinite(up(out)))) and rel_err(out, truth) < 1e-2

    # queries 128-255 are document 1's, which no key is in: they see nothing, and no key tile
    # reads them
    q_ids, kv_ids = ids((0, 128), (1, 128), (2, last)), ids((0, 128), (2, 128 + last))
    alien = (q_ids == 1)[..., None, None]
    poisoned_q, poisoned_do = jnp.where(alien, nan, q), jnp.where(alien, nan, d_out)

    def loss(k, v, q, d_out, attend):
        return jnp.sum(up(attend(q, k, v)) * up(d_out))

    kernel_loss = functools.partial(loss, attend=lambda q, k, v: fn(q, k, v, segment_ids=(q_ids, kv_ids))[0])
    dk, dv = jax.grad(kernel_loss, argnums=(0, 1))(k, v, poisoned_q, poisoned_do)
    truth_loss = functools.partial(
        loss, attend=lambda q, k, v: reference_attention(q, k, v, segment_ids=(q_ids, kv_ids))
    )
    clean_q, clean_do = jnp.where(alien, 0.0, up(q)), jnp.where(alien, 0.0, up(d_out))
    tk, tv = jax.grad(truth_loss, argnums=(0, 1))(up(k), up(v), clean_q, clean_do)
    for g, t in ((dk, tk), (dv, tv)):
        assert bool(jnp.all(jnp.isfinite(up(g)))) and rel_err(g, t) < 1e-2


def test_triton_kernels_with_segment_spans_lower_for_cuda():
    """The Triton kernels read each block's segment span and its dense run (four int32
    scalars) and still lower for CUDA (checked without a GPU): the forward, the dK/dV pass
    and the dQ pass, causal or not."""
    x = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 512), jnp.int32)
    for causal in (True, False):
        attend = functools.partial(
            flash_attention, causal=causal, forward="triton", backward="triton", interpret=False
        )
        grad = jax.grad(lambda q, s: jnp.sum(attend(q, q, q, segment_ids=s).astype(jnp.float32)))
        text = jax.jit(grad).trace(x, ids).lower(lowering_platforms=("cuda",)).as_text()
        calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
        assert len(calls) == 3, calls
        assert all(re.search(r"tensor<1x\d+x4xi32>", c) for c in calls), calls  # [batch, blocks, 4] spans


def test_head_dim_256_runs_the_hopper_kernels(key, monkeypatch):
    """At head_dim 256 the Hopper forward takes key blocks of 64 (two 128-key blocks of keys
    and values beside the query tile overflow shared memory: the CUDA lowering, checked here
    without a GPU, raised) and the backward is _dkdv_wide's (the warpgroups split the columns)
    and the dQ pass's: both lower for CUDA, with segment ids too (their buffers share one
    allocation with the keys' and the row statistics', which the 1 KiB Pallas rounds each
    buffer up to had left no room for), the interpreted kernels agree with float32 attention
    on packed documents, and head_dim 192 (halves of 96 columns) is refused in the backward."""
    x = jax.ShapeDtypeStruct((1, 256, 1, 256), jnp.bfloat16)
    fwd = functools.partial(attention_hopper.forward, causal=True, scale=0.1)  # block_k 128 asked
    text = jax.jit(fwd).trace(x, x, x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
    stats = jax.ShapeDtypeStruct((1, 1, 256), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, 256), jnp.int32)
    bwd = functools.partial(attention_hopper.backward, causal=True, scale=0.1)
    text = jax.jit(bwd).trace(x, x, x, x, stats, stats).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 2
    packed_bwd = lambda q, k, v, do, lse, delta, s: bwd(q, k, v, do, lse, delta, q_seg=s, kv_seg=s)  # noqa: E731
    text = jax.jit(packed_bwd).trace(x, x, x, x, stats, stats, seg).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 2
    assert attention_hopper.supported(x, x, backward=True) is None
    y = jax.ShapeDtypeStruct((1, 256, 1, 192), jnp.bfloat16)
    assert "head_dim 192 in the backward" in attention_hopper.supported(y, y, backward=True)
    # auto takes the Hopper kernels both ways for packed documents at 256
    zeros = jnp.zeros((1, 256), jnp.int32)
    packed = functools.partial(flash_attention, causal=True, segment_ids=zeros, interpret=False)
    monkeypatch.setattr(attention_hopper, "is_hopper", lambda: True)
    grad = jax.grad(lambda q: jnp.sum(packed(q, q, q).astype(jnp.float32)))
    text = jax.jit(grad).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 3  # the forward, _dkdv_wide, the dQ pass
    # one head: with two, the interpreter's CTAs (two tiles each) did not finish with segment ids
    q, k, v, d_out = inputs(key, 1, 256, 1, 1, 256, jnp.bfloat16)
    ids = packed_segments(jax.random.fold_in(key, 1), 1, 256, num=4)
    compare(q, k, v, d_out, causal=True, segment_ids=ids, tol=1e-2, forward="triton", backward="hopper")


def test_hopper_kernels_give_rows_without_keys_what_the_triton_kernels_do(key):
    """Query segments that no key shares (cross attention with segment ids): the Hopper
    forward gives those rows 0 and a logsumexp of +inf, as the Triton kernels do, and the
    gradients stay finite and equal. Batch 2: each CTA finds its batch in the launch
    order's one axis (attention_hopper.pipeline._Grid)."""
    q, k, v, d_out = inputs(key, 2, 128, 1, 1, 64, jnp.bfloat16)
    q_ids = jnp.tile(jnp.repeat(jnp.arange(4, dtype=jnp.int32), 32)[None], (2, 1))  # segment 3: no keys
    kv_ids = jnp.array([[0] * 48 + [1] * 48 + [2] * 32, [0] * 32 + [1] * 64 + [2] * 32], jnp.int32)
    runs = {}
    for kernel in ("hopper", "triton"):
        fn = functools.partial(
            flash_attention_with_lse, segment_ids=(q_ids, kv_ids), forward=kernel, backward=kernel
        )

        def loss(q, k, v, fn=fn):
            return jnp.sum(fn(q, k, v)[0].astype(jnp.float32) * d_out.astype(jnp.float32))

        runs[kernel] = (fn(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
    (out, lse), grads = runs["hopper"]
    (t_out, t_lse), t_grads = runs["triton"]
    assert bool(jnp.all(out[:, 96:] == 0)) and bool(jnp.all(lse[:, :, 96:] == jnp.inf))
    assert rel_err(out, t_out) < 1e-2 and rel_err(lse[..., :96], t_lse[..., :96]) < 1e-3
    for g, t in zip(grads, t_grads):
        assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) and rel_err(g, t) < 1e-2


@pytest.mark.parametrize(
    "tiles, heads, batch, group", [(16, 16, 8, 8), (6, 3, 2, 8), (5, 2, 3, 4), (4, 2, 2, 1), (6, 3, 2, None)]
)
def test_hopper_grid_launches_runs_of_one_heads_tiles_heaviest_first(tiles, heads, batch, group):
    """The Hopper kernels' launch order (attention_hopper.pipeline._Grid): every (tile, head, batch)
    once; the tile ranks (rank 0 the heaviest) never go back by a whole group; each run of g
    CTAs (g: the greatest common divisor of group and the tile count; group None, the
    default: the tile count) holds one (batch, head), batch outermost, so the CTAs that run at
    once share that head's other side. group=1: one tile of every (batch, head) in turn."""
    grid = attention_hopper.pipeline._Grid(tiles, heads, batch, group)
    rank, head, bi = (np.asarray(x) for x in grid.coords(jnp.arange(grid.size, dtype=jnp.int32)))
    every = {(t, h, b) for t in range(tiles) for h in range(heads) for b in range(batch)}
    seen = list(zip(rank.tolist(), head.tolist(), bi.tolist()))
    assert len(set(seen)) == grid.size and set(seen) == every
    g = tiles if group is None else math.gcd(tiles, group)
    assert (np.diff(rank // g) >= 0).all() and (np.diff(rank // g) <= 1).all()
    pair = (bi * heads + head).reshape(-1, g)
    assert (pair == pair[:, :1]).all()  # a run: one (batch, head), its tiles in order
    assert (rank.reshape(-1, g) % g == np.arange(g)).all()
    runs = pair[:, 0].reshape(tiles // g, batch * heads)
    assert (runs == np.arange(batch * heads)).all()  # then every (batch, head) in turn, batch outermost
    if group == 1:
        assert head[:heads].tolist() == list(range(heads)) and (rank[: heads * batch] == 0).all()
    x = jnp.zeros((1, 128, 1, 64))
    with pytest.raises(ValueError, match="hopper_tile_group must be a positive int"):
        flash_attention(x, x, x, hopper_tile_group=0)
    with pytest.raises(ValueError, match="unknown hopper_gqa 'split'; allowed: expand, walk"):
        flash_attention(x, x, x, hopper_gqa="split")
    with pytest.raises(ValueError, match="hopper_persistent must be a bool or a positive int"):
        flash_attention(x, x, x, hopper_persistent=0)
    with pytest.raises(ValueError, match="hopper_sort_window must be an int >= 0"):
        flash_attention(x, x, x, hopper_sort_window=-1)
    with pytest.raises(ValueError, match="unknown hopper_query_order 'up'; allowed: ascending, descending"):
        flash_attention(x, x, x, hopper_query_order="up")


@pytest.mark.parametrize(
    "schedule, causal, head_dim",
    [
        ("overlap", True, 64),
        ("pingpong", True, 64),
        ("overlap_pingpong", True, 64),
        ("overlap", False, 256),
        ("overlap", True, 256),
    ],
)
def test_hopper_forward_schedules_in_the_mosaic_gpu_interpreter(key, schedule, causal, head_dim):
    """The forward's pipelined and ping-pong schedules keep their barriers in step: 64-key
    blocks, so that under the causal mask the first warpgroup passes over a block the second
    one sees (and, ping-pong, still meets it there), and the pipelined schedules take the
    blocks the diagonal crosses after their pipeline; at head_dim 256 what the default
    schedule runs overlapped, causal or not; against float32 attention."""
    q, k, v, _ = inputs(key, 1, 384, 1, 1, head_dim, jnp.bfloat16)
    out, lse = flash_attention_with_lse(
        q, k, v, causal=causal, forward="hopper", hopper_block_k=64, hopper_schedule=schedule
    )
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    scores = jnp.einsum("bqhd,bkhd->bhqk", up(q), up(k)) / head_dim**0.5
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((384, 384), bool)), scores, -jnp.inf)
    assert rel_err(out, reference_attention(up(q), up(k), up(v), causal=causal)) < 1e-2
    assert rel_err(lse, jax.nn.logsumexp(scores, axis=-1)) < 1e-4


@pytest.mark.parametrize(
    "schedule, causal, head_dim, segments, ctas, q_buffers",
    [
        ("pingpong", True, 64, False, 4, 2),  # 6 tiles on 4 CTAs: two take two, of unequal lengths
        ("overlap", False, 64, False, 5, 2),  # the eager ring's refills, carried over tiles
        ("pingpong", True, 64, True, 2, 2),  # segment spans: each tile's ring starts where it may
        ("pingpong", True, 64, True, 2, 1),  # one Q buffer (head_dim 256's shared memory)
    ],
)
def test_persistent_hopper_forward_in_the_mosaic_gpu_interpreter(
    key, monkeypatch, schedule, causal, head_dim, segments, ctas, q_buffers
):
    """attention_hopper.forward(persistent=N): N CTAs take the tiles in turn, each ring of
    keys and values running on from one tile to the next (its slots and barrier phases
    carried over; with segment ids each tile's steps start where its span does), the next
    tile's queries loading into a second buffer during this one's where shared memory has
    room (Q_BUFFERS_ROOM): the same outputs as a CTA a tile, bit for bit, its logsumexps to
    an ulp, and float32 attention's."""
    if q_buffers == 1:
        monkeypatch.setattr(attention_hopper.forward_kernel, "Q_BUFFERS_ROOM", 0)
    q, k, v, _ = inputs(key, 1, 384, 2, 2, head_dim, jnp.bfloat16)
    seg = {}
    if segments:
        ids = packed_segments(jax.random.fold_in(key, 1), 1, 384, num=3)
        seg = dict(q_seg=ids, kv_seg=ids)
    run = functools.partial(
        attention_hopper.forward, q, k, v, causal=causal, scale=head_dim**-0.5, block_k=64,
        schedule=schedule, interpret=True, **seg,
    )
    (out, lse), (each, each_lse) = jax.jit(functools.partial(run, persistent=ctas))(), run()
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(each, np.float32))
    # the logsumexps to an ulp: the interpreter's XLA compiles the tile's code inside the loop
    # over tiles, where it rounded (m + log2(denom)) * ln 2 differently in 8% of the rows once
    np.testing.assert_allclose(np.asarray(lse), np.asarray(each_lse), rtol=1e-6, atol=0)
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    expected = reference_attention(up(q), up(k), up(v), causal=causal, segment_ids=seg.get("q_seg"))
    assert rel_err(out, expected) < 1e-2


def test_persistent_ctas_are_the_sms_or_a_count_and_never_more_than_the_tiles(monkeypatch):
    """attention_hopper.persistent_ctas: True, the device's SMs (at most the tiles); an int,
    that many; False, a CTA a tile; anything else is named in the error."""
    import types

    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(core_count=132)])
    assert attention_hopper.persistent_ctas(False, 512) is None
    assert attention_hopper.persistent_ctas(True, 512) == 132
    assert attention_hopper.persistent_ctas(True, 40) == 40
    assert attention_hopper.persistent_ctas(7, 512) == 7
    for bad in (0, -1, 2.5, "yes"):
        with pytest.raises(ValueError, match="persistent must be a bool or a positive int"):
            attention_hopper.persistent_ctas(bad, 512)


@pytest.mark.parametrize("causal, docs", [(True, 0), (False, 0), (True, 8)])
def test_persistent_order_deals_every_tile_once_and_evens_the_work(key, causal, docs):
    """attention_hopper.persistent_order: each CTA's count, then its items; every item of the
    grid exactly once, and each CTA's work (steps, plus TILE_COST an item) within the
    longest item of every other's. Static masks deal the launch order (each CTA's items in
    it); segment spans the longest first. At 16K with 16 heads on 132 CTAs, causal or with
    8 documents, dealing the launch order in turn (c, c + 132, ...) was further from even."""
    grid, ctas, bk = attention_hopper.pipeline._Grid(128, 16, 1), 132, 128
    spans = None
    if docs:
        ids = packed_segments(key, 1, 128 * 128, num=docs)
        spans = attention_hopper.query_spans(ids, ids, bk, causal)
    keys = attention_hopper.pipeline._KeyStream(grid, num_k=128, group=1, bk=bk, stages=2, causal=causal)
    steps = keys.item_steps(spans)
    table = np.asarray(attention_hopper.persistent_order(grid, ctas, steps))
    steps = np.asarray(steps)
    counts, order = table[:, 0], table[:, 1:]
    assert table.shape[0] == ctas and (counts >= 1).all()
    for c in range(ctas):
        assert (order[c, : counts[c]] >= 0).all() and (order[c, counts[c] :] == -1).all()
    assert sorted(order[order >= 0].tolist()) == list(range(grid.size))
    cost = attention_hopper.forward_kernel.TILE_COST
    per_cta = np.where(order >= 0, steps[order] + cost, 0).sum(axis=1)
    assert per_cta.max() - per_cta.min() <= steps.max() + cost
    if docs:
        assert steps[order[:, 0]].min() >= steps[order[:, 1:]].max()  # the longest first
    else:
        for c in range(ctas):
            assert (np.diff(order[c, : counts[c]]) > 0).all()  # in launch order
    in_turn = np.bincount(np.arange(grid.size) % ctas, weights=steps + cost, minlength=ctas)
    if causal:
        assert per_cta.max() < in_turn.max()
    assert (steps + cost).sum() == per_cta.sum()


@pytest.mark.parametrize("n, window", [(2048, 528), (300, 128), (7, 16)])
def test_sorted_launch_sorts_each_window_longest_first(key, n, window):
    """attention_hopper.sorted_launch: a permutation of the grid's items that keeps each
    window of `window` items of the grid's order, the most steps first within it and ties
    in the grid's order; traced steps, under jit."""
    steps = jax.random.randint(key, (n,), 0, 9)
    order = np.asarray(jax.jit(attention_hopper.sorted_launch, static_argnums=1)(steps, window))
    steps = np.asarray(steps)
    assert sorted(order.tolist()) == list(range(n))
    for w0 in range(0, n, window):
        part = order[w0 : w0 + window]
        assert (part // window == w0 // window).all()  # the window's own items
        work = steps[part]
        assert (np.diff(work) <= 0).all()
        assert all((np.diff(part[work == s]) > 0).all() for s in np.unique(work))


def test_launch_order_sorts_only_traced_steps_of_few_waves(key, monkeypatch):
    """attention_hopper.launch_order: sorted_launch over windows of sort_window waves of the
    device's SMs for traced steps; the grid's own order (None) for a static mask's steps,
    sort_window 0, or a grid of more than SORT_WAVES waves."""
    monkeypatch.setattr(attention_hopper.pipeline, "device_sms", lambda: 4)
    waves = attention_hopper.SORT_WAVES
    few = jax.random.randint(key, (waves * 4,), 0, 9)
    order = attention_hopper.launch_order(few, 2)
    np.testing.assert_array_equal(order, attention_hopper.sorted_launch(few, 8))
    assert attention_hopper.launch_order(few, 0) is None
    assert attention_hopper.launch_order(np.asarray(few), 2) is None
    assert attention_hopper.launch_order(jnp.zeros(waves * 4 + 1, jnp.int32), 2) is None
    traced = jax.jit(lambda s: attention_hopper.launch_order(s, 2))(few)  # under jit, too
    np.testing.assert_array_equal(traced, order)


@pytest.mark.parametrize("descending", [False, True])
def test_query_stream_steps_walk_each_heads_blocks_once(descending):
    """The dK/dV pass's query walk (backward's query_order): the steps of a head's blocks [lo,
    hi) are a run whose steps hold exactly those blocks, and in the order asked (descending:
    the last block first); the head's runs tile its steps and follow the heads in turn."""
    from bpt.ops.kernels.attention_hopper.backward_kernels import _QueryStream

    grid = attention_hopper.pipeline._Grid(4, 2, 1)
    stream = _QueryStream(grid, 8, 2, 64, 2, True, descending=descending)
    first, per_head = 3, 5  # the tile's span: blocks 3..7
    for g in range(2):
        walk = [int(stream.block(first, per_head, j)) for j in range(g * per_head, (g + 1) * per_head)]
        assert walk == sorted(walk, reverse=descending) == sorted(range(first, first + per_head), reverse=descending)
        for lo, hi in ((3, 8), (3, 4), (4, 6), (6, 6), (7, 8)):
            start, stop = stream.steps(g, first, per_head, lo, hi)
            assert stop - start == hi - lo
            assert g * per_head <= start <= stop <= (g + 1) * per_head
            assert sorted(int(stream.block(first, per_head, j)) for j in range(start, stop)) == list(range(lo, hi))
            rows = stream.head_rows(0, first, per_head, start)
            assert int(rows[0]) == g


def test_hopper_forward_default_schedule_by_shape():
    """With no schedule asked the forward overlaps at head_dim 256, and at 128 where no block
    is masked (non-causal, no segment ids); it ping-pongs elsewhere and with segment ids: the
    kernel it lowers to for CUDA is the named schedule's."""
    assert attention_hopper.default_schedule(False, 128) == "overlap"
    assert attention_hopper.default_schedule(False, 256) == "overlap"
    assert attention_hopper.default_schedule(True, 256) == "overlap"
    assert attention_hopper.default_schedule(True, 128) == "pingpong"
    assert attention_hopper.default_schedule(False, 64) == "pingpong"
    assert attention_hopper.default_schedule(False, 128, segments=True) == "pingpong"
    assert attention_hopper.default_schedule(True, 256, segments=True) == "pingpong"

    def lowered(causal, d, schedule):
        x = jax.ShapeDtypeStruct((1, 256, 1, d), jnp.bfloat16)
        fwd = functools.partial(
            attention_hopper.forward, causal=causal, scale=0.1, block_k=64, schedule=schedule
        )
        return jax.jit(fwd).trace(x, x, x).lower(lowering_platforms=("cuda",)).as_text()

    for causal, d in ((False, 256), (True, 256), (False, 128), (True, 128)):
        default = lowered(causal, d, None)
        assert default == lowered(causal, d, attention_hopper.default_schedule(causal, d))
    assert lowered(False, 128, None) != lowered(False, 128, "pingpong")


@pytest.mark.parametrize("schedule", attention_hopper.SCHEDULES)
def test_hopper_forward_schedules_lower_for_cuda(schedule):
    """Each schedule lowers to one Mosaic GPU kernel for CUDA (checked without a GPU: the
    pipelined schedules' wgmma path, two accumulators in flight, is not interpreted)."""
    x = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16)
    for causal in (True, False):
        fwd = functools.partial(attention_hopper.forward, causal=causal, scale=0.1, schedule=schedule)
        text = jax.jit(fwd).trace(x, x, x).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu") == 1
    for causal in (True, False):  # persistent: 6 CTAs over the 8 tiles
        fwd = functools.partial(
            attention_hopper.forward, causal=causal, scale=0.1, schedule=schedule, persistent=6
        )
        text = jax.jit(fwd).trace(x, x, x).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu") == 1
    x = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="unknown hopper_schedule 'fast'; allowed: serial, pingpong"):
        flash_attention(x, x, x, hopper_schedule="fast")


@pytest.mark.parametrize("head_dim, sort_window", [(128, 0), (64, 4)])
def test_hopper_kernels_with_segment_ids_lower_for_cuda(head_dim, sort_window):
    """With segment ids every kernel still lowers to one Mosaic GPU launch for CUDA (checked
    without a GPU: the int32 segment vectors in the wgmma layouts, which the interpreter
    does not have): the forward, and the backward fused (dQ added as it goes) and in two
    passes, its GQA work split either way (gqa: a CTA a query head's keys, or a key/value
    head's walking its group). With sort_window each launch also takes its CTAs' order."""
    q = jax.ShapeDtypeStruct((1, 512, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, head_dim), jnp.bfloat16)
    stats = jax.ShapeDtypeStruct((1, 4, 512), jnp.float32)
    ids = jax.ShapeDtypeStruct((1, 512), jnp.int32)

    def launches(f, *args):
        """The Mosaic GPU launches of f's CUDA lowering, each with the segment ids among its operands."""
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
        assert all(line.count("tensor<1x512xi32>") >= 2 for line in calls), calls
        ordered = [bool(re.search(r"tensor<\d+xi32>", line)) for line in calls]
        assert ordered == [sort_window > 0] * len(calls), calls
        return len(calls)

    for schedule in attention_hopper.SCHEDULES:
        fwd = functools.partial(
            attention_hopper.forward, causal=True, scale=0.1, schedule=schedule, sort_window=sort_window
        )
        assert launches(lambda q, k, v, s: fwd(q, k, v, q_seg=s, kv_seg=s), q, kv, kv, ids) == 1

    def grads(q, k, v, d_out, lse, delta, s, fused_dq, gqa):
        return attention_hopper.backward(
            q, k, v, d_out, lse, delta, causal=False, scale=0.1, q_seg=s, kv_seg=s, fused_dq=fused_dq, gqa=gqa,
            sort_window=sort_window,
        )

    for gqa in attention_hopper.GQA_SPLITS:
        for fused_dq, kernels in ((True, 1), (False, 2)):
            f = functools.partial(grads, fused_dq=fused_dq, gqa=gqa)
            assert launches(f, q, kv, kv, q, stats, stats, ids) == kernels
            dq, dk, dv = jax.eval_shape(f, q, kv, kv, q, stats, stats, ids)
            assert (dq.shape, dk.shape, dv.shape) == (q.shape, kv.shape, kv.shape)
    x, short = jnp.zeros((1, 128, 1, 64), jnp.bfloat16), jnp.zeros((1, 64), jnp.int32)
    with pytest.raises(ValueError, match="segment ids must be int32 of shapes"):
        attention_hopper.forward(x, x, x, causal=True, scale=0.1, q_seg=short, kv_seg=short[:, :0])


def test_hopper_fused_backward_makes_its_dq_buffer_after_its_d_out():
    """The fused backward's float32 dQ buffer (zeros the kernel adds into) is broadcast from a
    scalar zero that comes out of an optimization barrier with the call's d_out, and the
    kernel's mutable buffer is made from it: a bare zeros was one constant that XLA wrote for
    every unrolled layer at once (4.4 GiB more in GPT-1B's 32K step on an H200), and the whole
    buffer behind the barrier was copied once more into the kernel's aliased operand (the GPU
    program itself is not compiled here)."""
    q = jax.ShapeDtypeStruct((1, 512, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16)
    stats = jax.ShapeDtypeStruct((1, 4, 512), jnp.float32)

    def grads(q, k, v, d_out, lse, delta):
        return attention_hopper.backward(q, k, v, d_out, lse, delta, causal=True, scale=0.1)

    jaxpr = jax.make_jaxpr(grads)(q, kv, kv, q, stats, stats).jaxpr
    d_out = jaxpr.invars[3]
    barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
    assert len(barriers) == 1 and d_out in barriers[0].invars
    zero = barriers[0].outvars[0]
    assert zero.aval.shape == () and zero.aval.dtype == jnp.float32
    (broadcast,) = [e for e in jaxpr.eqns if e.primitive.name == "broadcast_in_dim" and zero in e.invars]
    zeros = broadcast.outvars[0]
    assert zeros.aval.shape == q.shape and zeros.aval.dtype == jnp.float32
    refs = [e for e in jaxpr.eqns if e.primitive.name == "new_ref"]
    assert [e.invars for e in refs] == [[zeros]]
    # and it is zeros
    accumulator = attention_hopper.backward_kernels._dq_accumulator
    out = accumulator(jnp.ones((1, 8, 2, 4), jnp.bfloat16), jnp.ones((1, 8, 2, 4)))
    assert out.dtype == jnp.float32 and out.shape == (1, 8, 2, 4) and not out.any()


@pytest.mark.parametrize(
    "causal, head_dim, dq_split", [(True, 128, None), (False, 128, None), (True, 64, "keys"), (False, 64, "steps")]
)
def test_hopper_fused_backward_lowers_to_a_tma_reduce_add(causal, head_dim, dq_split):
    """On the GPU the fused backward adds each block's dQ into one float32 buffer with TMA's
    reduce-add (which the interpreter lacks): its Mosaic GPU lowering, checked here without a
    GPU, aliases that buffer in and out of the kernel and issues the reduction (one kernel
    where the two-pass backward has two and no reduction), also inside shard_map and inside a
    scan of checkpointed layers, where ring attention and the models call it; under each of
    the splits of dQ between the warpgroups (dq_split)."""
    q = jax.ShapeDtypeStruct((1, 512, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, head_dim), jnp.bfloat16)
    stats = jax.ShapeDtypeStruct((1, 4, 512), jnp.float32)

    def lowered(fused_dq):
        def grads(q, k, v, d_out, lse, delta):
            return attention_hopper.backward(
                q, k, v, d_out, lse, delta, causal=causal, scale=0.1, fused_dq=fused_dq, dq_split=dq_split
            )

        return jax.jit(grads).trace(q, kv, kv, q, stats, stats).lower(lowering_platforms=("cuda",)).as_text()

    fused, two_pass = lowered(True), lowered(False)
    assert fused.count("cp.reduce.async.bulk.tensor") == 1 and "output_operand_alias" in fused
    assert "cp.reduce.async.bulk" not in two_pass
    kernels = lambda text: text.count("custom_call @mosaic_gpu")  # noqa: E731
    assert kernels(fused) == 1 and kernels(two_pass) == 2

    # As ring attention runs it: the gradient of flash_attention inside shard_map.
    mesh = jax.make_mesh((1,), ("sp",))
    spec = jax.sharding.PartitionSpec(None, "sp")

    def loss(q, k, v):
        out = flash_attention(
            q, k, v, causal=causal, forward="hopper", backward="hopper", hopper_dq_split=dq_split, interpret=False
        )
        return jnp.sum(out.astype(jnp.float32))

    grads = jax.shard_map(
        jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False
    )
    on_mesh = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.NamedSharding(mesh, spec))  # noqa: E731
    text = (
        jax.jit(grads)
        .trace(on_mesh(q), on_mesh(kv), on_mesh(kv))
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert text.count("cp.reduce.async.bulk.tensor") == 1 and kernels(text) == 2  # forward, backward

    # As a model's layer stack runs it: checkpointed layers under lax.scan (the float32
    # buffer is created and consumed inside the scan's backward body).
    def layers(q):
        def attend(x, _):
            return flash_attention(
                x, x, x, causal=causal, forward="hopper", backward="hopper", hopper_dq_split=dq_split, interpret=False
            ), None

        step = jax.checkpoint(attend)
        return jnp.sum(lax.scan(step, q, None, length=2)[0].astype(jnp.float32))

    text = jax.jit(jax.grad(layers)).trace(q).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("cp.reduce.async.bulk.tensor") == 1
    with pytest.raises(ValueError, match="fused_dq=True at head_dim 256: the backward fuses dQ up to head_dim 128"):
        big = jnp.zeros((1, 128, 1, 256), jnp.bfloat16)
        attention_hopper.backward(
            big,
            big,
            big,
            big,
            jnp.zeros((1, 1, 128)),
            jnp.zeros((1, 1, 128)),
            causal=True,
            scale=0.1,
            fused_dq=True,
        )


def test_hopper_kernels_refuse_what_they_cannot_take(key):
    q, k, v, _ = inputs(key, 1, 256, 2, 2, 64)
    with pytest.raises(ValueError, match="forward='hopper' cannot take dtype float32"):
        flash_attention(q, k, v, forward="hopper")
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    with pytest.raises(ValueError, match="lengths 192, 192 \\(need multiples of 128\\)"):
        flash_attention(q[:, :192], k[:, :192], v[:, :192], forward="hopper")
    with pytest.raises(ValueError, match="unknown flash backward 'mosaic'; allowed: auto, triton, hopper"):
        flash_attention(q, k, v, backward="mosaic")
    with pytest.raises(ValueError, match="hopper_block_k=96 is not a block size of the Hopper kernels"):
        flash_attention(q, k, v, forward="hopper", hopper_block_k=96)
    with pytest.raises(ValueError, match="unknown hopper_dq_split 'rows'; allowed: None, columns, keys, steps"):
        flash_attention(q, k, v, hopper_dq_split="rows")
    with pytest.raises(ValueError, match="hopper_dq_split 'columns' at head_dim 64; allowed there: None, keys, steps"):
        flash_attention(q, k, v, hopper_dq_split="columns")
    with pytest.raises(ValueError, match="dq_split 'steps' at head_dim 128; allowed there: None, columns"):
        x = jnp.zeros((1, 128, 1, 128), jnp.bfloat16)
        attention_hopper.backward(x, x, x, x, jnp.zeros((1, 1, 128)), jnp.zeros((1, 1, 128)), causal=True, scale=0.1, dq_split="steps")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the Triton-lowered kernels need an NVIDIA GPU")
@pytest.mark.parametrize(
    "dtype, head_dim, causal, segments, kv_heads",
    [
        (jnp.bfloat16, 128, True, False, 8),
        (jnp.bfloat16, 80, False, True, 2),
        (jnp.bfloat16, 64, True, True, 1),
        (jnp.float32, 128, False, True, 8),
        (jnp.float32, 80, True, False, 2),
        (jnp.float32, 64, True, True, 1),
    ],
)
def test_flash_on_gpu(key, dtype, head_dim, causal, segments, kv_heads):
    """The Triton kernels (forward and backward)."""
    seq = 1536 if segments else 2048  # one not a power of two
    q, k, v, d_out = inputs(key, 2, seq, 8, kv_heads, head_dim, dtype)
    seg = packed_segments(jax.random.fold_in(key, 1), 2, seq, num=4) if segments else None
    compare(
        q,
        k,
        v,
        d_out,
        causal=causal,
        segment_ids=seg,
        tol=1e-2 if dtype == jnp.bfloat16 else 1e-5,
        forward="triton",
        backward="triton",
    )


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the Mosaic GPU kernel needs an H100-class GPU")
@pytest.mark.parametrize(
    "dtype, head_dim, causal, kv_heads, block_k, fused_dq, schedule, gqa, dq_split",
    [
        # fused_dq None: dQ fused where it can be (head_dim 64 and 128); schedule None: by shape;
        # kv_heads 8 of 8 query heads: MHA, else GQA (gqa: the backward's split of it);
        # dq_split: how the fused backward splits dQ (None: by head_dim)
        (jnp.bfloat16, 128, True, 2, 128, None, "pingpong", "expand", None),
        (jnp.bfloat16, 128, True, 2, 128, None, "pingpong", "walk", None),
        (jnp.float16, 128, False, 8, 128, None, "pingpong", "expand", None),
        (jnp.float16, 64, False, 8, 128, None, "pingpong", "expand", "keys"),
        (jnp.float16, 64, False, 8, 128, None, "pingpong", "expand", "steps"),
        (jnp.bfloat16, 64, True, 1, 64, None, "pingpong", "expand", "keys"),
        (jnp.bfloat16, 64, True, 2, 64, None, "pingpong", "walk", "steps"),
        (jnp.bfloat16, 128, True, 2, 128, False, "serial", "expand", None),
        (jnp.bfloat16, 128, True, 2, 128, None, "overlap", "walk", None),
        (jnp.bfloat16, 128, False, 2, 128, None, None, "expand", None),  # None: by shape, overlap
        (jnp.bfloat16, 64, True, 1, 64, False, "overlap_pingpong", "walk", None),
    ],
)
def test_hopper_kernels_on_gpu(key, dtype, head_dim, causal, kv_heads, block_k, fused_dq, schedule, gqa, dq_split):
    """The wgmma/TMA kernels at real sizes, forward (under each schedule) and backward (dQ
    fused into the dK/dV pass by default, or in its own pass; GQA as a CTA a query head's
    keys, the default, or a key/value head's walking its group; at head_dim 64 dQ split
    between the warpgroups by keys or by steps)."""
    q, k, v, d_out = inputs(key, 2, 2048, 8, kv_heads, head_dim, dtype)
    hopper = dict(
        forward="hopper",
        backward="hopper",
        hopper_block_k=block_k,
        hopper_fused_dq=fused_dq,
        hopper_schedule=schedule,
        hopper_gqa=gqa,
        hopper_dq_split=dq_split,
    )
    compare(q, k, v, d_out, causal=causal, segment_ids=None, tol=1e-2, **hopper)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the Mosaic GPU kernel needs an H100-class GPU")
@pytest.mark.parametrize(
    "head_dim, kv_heads, fused_dq, docs",
    [
        (128, 2, None, 0),  # dQ fused, reduce-added by every CTA of a wave into the same rows
        (64, 8, None, 0),  # dQ by the warpgroups in turn ("steps")
        (128, 2, False, 5),  # dQ's own pass: a warpgroup skips its partner's block last; spans
    ],
)
def test_hopper_backward_walks_queries_descending_on_gpu(key, head_dim, kv_heads, fused_dq, docs):
    """The Hopper backward with each dK/dV tile's query blocks walked from the last down
    (hopper_query_order="descending"), causal: gradients against float32 attention."""
    q, k, v, d_out = inputs(key, 2, 2048, 8, kv_heads, head_dim, jnp.bfloat16)
    seg = packed_segments(jax.random.fold_in(key, 1), 2, 2048, num=docs) if docs else None
    hopper = dict(forward="hopper", backward="hopper", hopper_fused_dq=fused_dq, hopper_query_order="descending")
    compare(q, k, v, d_out, causal=True, segment_ids=seg, tol=1e-2, **hopper)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the Mosaic GPU kernel needs an H100-class GPU")
@pytest.mark.parametrize(
    "causal, segments, sort_window", [(True, False, 0), (False, False, 0), (True, True, 0), (True, True, 4)]
)
def test_head_dim_256_on_gpu(key, causal, segments, sort_window):
    """head_dim 256 as auto runs it: the Hopper forward in key blocks of 64 (wgmma path,
    registers at their fullest) and the Hopper backward (_dkdv_wide and the dQ pass), with
    segment ids too."""
    q, k, v, d_out = inputs(key, 2, 2048, 8, 2, 256, jnp.bfloat16)
    seg = packed_segments(jax.random.fold_in(key, 1), 2, 2048, num=5) if segments else None
    compare(
        q, k, v, d_out, causal=causal, segment_ids=seg, tol=1e-2, forward="auto", backward="auto",
        hopper_sort_window=sort_window,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the Mosaic GPU kernel needs an H100-class GPU")
@pytest.mark.parametrize(
    "head_dim, causal, kv_heads, schedule, docs, sort_window",
    [
        (128, True, 2, "pingpong", 5, 0),
        (128, True, 2, "overlap", 5, 4),
        (128, False, 8, "pingpong", 5, 0),
        (64, True, 1, "pingpong", 5, 4),
        (128, True, 2, "pingpong", 40, 4),  # documents shorter than a tile: most blocks skipped
        (128, False, 2, "overlap", -5, 0),  # the ids shuffled (not sorted): no block skipped
    ],
)
def test_hopper_kernels_take_segment_ids_on_gpu(key, head_dim, causal, kv_heads, schedule, docs, sort_window):
    """Packed documents in the wgmma/TMA kernels at real sizes: forward under two schedules,
    the fused backward and the two-pass one, the CTAs launched in the grid's order or sorted
    by their spans (sort_window); with segment ids in any order (docs < 0) as well, where the
    kernels cannot skip the blocks between documents."""
    q, k, v, d_out = inputs(key, 2, 2048, 8, kv_heads, head_dim, jnp.bfloat16)
    seg = packed_segments(jax.random.fold_in(key, 1), 2, 2048, num=abs(docs))
    if docs < 0:
        seg = jax.random.permutation(jax.random.fold_in(key, 2), seg, axis=1, independent=True)
    hopper = dict(forward="hopper", backward="hopper", hopper_schedule=schedule, hopper_sort_window=sort_window)
    compare(q, k, v, d_out, causal=causal, segment_ids=seg, tol=1e-2, **hopper)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the Mosaic GPU kernel needs an H100-class GPU")
@pytest.mark.parametrize(
    "head_dim, causal, schedule, docs, persistent",
    [
        (128, True, "pingpong", 0, True),  # one CTA an SM over 2 x 8 heads x 16 tiles
        (128, False, "overlap", 0, True),
        (64, True, "pingpong", 8, True),  # segment spans: each tile's steps start at its span's
        (128, True, "pingpong", 0, 3),  # few CTAs: each takes tiles of every length in turn
    ],
)
def test_persistent_hopper_forward_on_gpu(key, head_dim, causal, schedule, docs, persistent):
    """The persistent forward's wgmma/TMA kernel at real sizes: the outputs and logsumexps of
    a CTA a tile (to bf16's rounding: the same per-tile work, in other registers), and
    float32 attention's."""
    q, k, v, _ = inputs(key, 2, 2048, 8, 8, head_dim, jnp.bfloat16)
    seg = packed_segments(jax.random.fold_in(key, 1), 2, 2048, num=docs) if docs else None
    run = functools.partial(
        flash_attention_with_lse, q, k, v, causal=causal, segment_ids=seg, forward="hopper",
        hopper_schedule=schedule,
    )
    (out, lse), (each, each_lse) = jax.jit(functools.partial(run, hopper_persistent=persistent))(), run()
    assert rel_err(out, each) < 1e-3 and rel_err(lse, each_lse) < 1e-5
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    assert rel_err(out, reference_attention(up(q), up(k), up(v), causal=causal, segment_ids=seg)) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="cuDNN's fused attention needs an NVIDIA GPU")
def test_attention_saveable_keeps_cudnns_output_and_statistics(key, capsys):
    """cuDNN's fused attention is a primitive, not bpt's code: attention_saveable keeps its
    outputs (the output and the softmax statistics) by the primitive's name."""
    q, k, v, d_out = inputs(key, 1, 512, 4, 4, 64, jnp.bfloat16)
    runs = under_remat(lambda q: attention(q, k, v, causal=True, impl="cudnn"), q, d_out, capsys)
    (plain, plain_grad), (kept, kept_grad) = runs["nothing_saveable"], runs["attention_saveable"]
    assert "dot_product_attention" not in plain
    more = len(kept.splitlines()) - len(plain.splitlines())
    assert more >= 2 and "dot_product_attention" in kept, kept
    assert rel_err(kept_grad, plain_grad) < 1e-6


def test_profile_kernel_sums_each_phase_over_warpgroups(tmp_path):
    """scripts/profile_kernel.py reads Mosaic GPU's traces (begin/end events a warpgroup,
    timestamps in cycles / 1000): per phase the total cycles and the count, and what lies
    between phases."""
    events = []
    for tid, t0 in ((1, 0.0), (2, 5.0)):  # two warpgroups, two steps each of S (2k cycles) and dV (1k)
        for step in range(2):
            base = t0 + 4.0 * step
            events += [
                dict(name="S", ph="B", ts=base, pid=1, tid=tid),
                dict(name="S", ph="E", ts=base + 2.0, pid=1, tid=tid),
                dict(name="dV", ph="B", ts=base + 2.5, pid=1, tid=tid),
                dict(name="dV", ph="E", ts=base + 3.5, pid=1, tid=tid),
            ]
    events.append(dict(name="Init", ph="B", ts=0.0, pid=1, tid=3))  # Pallas's, in every warpgroup
    events.append(dict(name="Init", ph="E", ts=0.1, pid=1, tid=3))
    path = tmp_path / "1-trace.json"
    path.write_text(json.dumps({"displayTimeUnit": "ns", "traceEvents": events}))
    prof = load_script("profile_kernel")
    totals, whole = prof.phases([str(path)])
    assert totals == {"S": [8000.0, 4], "dV": [4000.0, 4]}
    assert whole == {"span": 2 * 7500.0, "warpgroups": 2, "median_span": 7500.0, "max_span": 7500.0}
    lines = prof.table(totals, whole).splitlines()
    assert lines[2] == "| S | 2000 | 53.3% |" and lines[3] == "| dV | 1000 | 26.7% |"
    assert lines[4] == "| (between phases) | 750 | 20.0% |"  # 3000 cycles over 4 steps


def test_profile_kernel_gives_the_forward_room_for_every_key_block():
    """profile_kernel.default_ranges: the forward's five phases a key block over the whole
    sequence and one to spare, plus 16 (a first run at 16K with 8 documents and 128 ranges
    ran out, and one at 4K causal with five a block and three more)."""
    prof = load_script("profile_kernel")
    assert prof.default_ranges("forward", 16384, 128) == 6 * 128 + 16
    assert prof.default_ranges("forward", 16384, 256) == 6 * 256 + 16  # 64 keys a block above 128
    assert prof.default_ranges("backward", 16384, 128) == 400


def test_profile_kernel_converts_a_call_to_cycles_a_cta_slot(monkeypatch):
    """profile_kernel.cta_slot: the call's milliseconds x SMs / CTAs at the top SM clock that
    nvidia-smi reports; nothing where nvidia-smi is missing."""
    import subprocess
    import types

    prof = load_script("profile_kernel")
    monkeypatch.setattr(prof.jax, "devices", lambda: [types.SimpleNamespace(core_count=132)])
    smi = lambda *a, **k: types.SimpleNamespace(stdout="1980\n")  # noqa: E731
    monkeypatch.setattr(prof.subprocess, "run", smi)
    slot = prof.cta_slot(1.0, 264)  # 1 ms, two CTAs an SM
    assert slot == dict(ctas=264, sms=132, mhz=1980.0, slot_cycles=pytest.approx(990_000.0))
    # 264 CTAs of 990,000 cycles on 132 SMs, two rounds: the call's 1 ms
    assert prof.packed_ms(264 * 990_000.0, 132, 1980.0) == pytest.approx(1.0)

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(prof.subprocess, "run", missing)
    assert prof.cta_slot(1.0, 264) == {}
    monkeypatch.setattr(prof.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=""))
    assert prof.cta_slot(1.0, 264) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the Mosaic GPU kernel needs an H100-class GPU")
def test_profiled_backward_records_every_phase_of_every_step(tmp_path, monkeypatch):
    """attention_hopper.profiled() on the GPU: the fused backward writes a trace in which each
    compute warpgroup records each named phase once per step it takes."""
    argv = ["profile_kernel.py", "--seq", "512", "--heads", "2", "--out", str(tmp_path)]
    monkeypatch.setattr("sys.argv", argv)
    totals, whole = load_script("profile_kernel").main()
    assert list(tmp_path.glob("*-trace.json"))
    # causal, 512 keys in 4 tiles of 128: the tiles take 8, 6, 4 and 2 query blocks of 64
    steps = 2 * 2 * (8 + 6 + 4 + 2)  # heads x compute warpgroups x steps
    assert whole["warpgroups"] == 2 * 4 * 2
    for phase in ("S", "P", "dV", "dP", "dS", "share_dS", "dK", "dQ", "dQ_store"):
        assert totals[phase][1] == steps, (phase, totals[phase])
