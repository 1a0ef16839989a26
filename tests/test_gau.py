"""FLASH: relu^2 attention (bpt.ops.gau) and the FLASH model (bpt.models.flash)."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, rel_err, tree_rel_err

from bpt.config import base_config, model_config
from bpt.models import FLASH, FLASHConfig, GPTConfig, make_model
from bpt.ops.gau import (
    mixed_chunk_attention,
    mixed_chunk_reference,
    relative_buckets,
    relu2_attention_reference,
)
from bpt.sample import generate, generate_batch, init_cache
from bpt.train.metrics import train_flops_per_token


def gau_inputs(key, b=2, t=48, s=8, e=12):
    ks = jax.random.split(key, 5)
    qk = [jax.random.normal(k, (b, t, s)) for k in ks[:4]]
    return qk, jax.random.normal(ks[4], (b, t, e))


def naive_mixed_chunk(qk, v, g, quad_scale, lin_scale, bias, seg):
    """One query and one key at a time, straight from the definition."""
    quad_q, quad_k, lin_q, lin_k = (np.asarray(x, np.float64) for x in qk)
    v, bias, seg = np.asarray(v, np.float64), np.asarray(bias), np.asarray(seg)
    b, t, e = v.shape
    out = np.zeros((b, t, e))
    for r in range(b):
        for i in range(t):
            for j in range(i + 1):
                if seg[r, i] != seg[r, j]:
                    continue
                if i // g == j // g:
                    score = quad_q[r, i] @ quad_k[r, j] * quad_scale + bias[i - j]
                    out[r, i] += max(score, 0.0) ** 2 * v[r, j]
                else:
                    out[r, i] += (lin_q[r, i] @ lin_k[r, j]) * lin_scale * v[r, j]
    return out


def test_mixed_chunk_equals_a_naive_loop_and_the_reference_with_segments_and_bias(key):
    g, t = 16, 48
    qk, v = gau_inputs(key, t=t)
    table = jax.random.normal(jax.random.fold_in(key, 9), (32,))
    dist = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]
    bias_full = table[relative_buckets(dist)]
    bias_chunk = bias_full[:g, :g]  # the same distances inside every chunk
    seg = jnp.array([[0] * 5 + [1] * 30 + [2] * 13, [4] * 48])  # documents across chunk borders
    kwargs = dict(chunk_size=g, quad_scale=1 / g, lin_scale=1 / t)
    fast = mixed_chunk_attention(*qk, v, bias=bias_chunk, segment_ids=seg, **kwargs)
    naive = naive_mixed_chunk(qk, v, g, 1 / g, 1 / t, table[relative_buckets(jnp.arange(t))], seg)
    assert rel_err(fast, naive) < 1e-5
    ref = mixed_chunk_reference(*qk, v, bias=bias_full, segment_ids=seg, **kwargs)
    assert rel_err(fast, ref) < 1e-5
    assert rel_err(mixed_chunk_attention(*qk, v, **kwargs), mixed_chunk_reference(*qk, v, **kwargs)) < 1e-5


@pytest.mark.parametrize("segments,bias", [(True, False), (False, True)])
def test_mixed_chunk_gradients_equal_the_reference(key, segments, bias):
    """The written-out backward against autodiff of the materialized reference: the five
    inputs and the relative bias."""
    g, t = 8, 32
    qk, v = gau_inputs(key, t=t)
    seg = jnp.array([[0] * 20 + [1] * 12, [0] * 32]) if segments else None
    table = jax.random.normal(jax.random.fold_in(key, 2), (32,)) if bias else jnp.zeros((32,))
    dist = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]
    kwargs = dict(chunk_size=g, quad_scale=1 / g, lin_scale=1 / t, segment_ids=seg)
    cot = jax.random.normal(jax.random.fold_in(key, 1), v.shape)

    def grad(fn, bias_of):
        loss = lambda *a: jnp.sum(fn(*a[:5], bias=bias_of(a[5]), **kwargs) * cot)  # noqa: E731
        return jax.grad(loss, argnums=tuple(range(6 if bias else 5)))(*qk, v, table)

    fast = grad(mixed_chunk_attention, lambda tb: tb[relative_buckets(dist[:g, :g])] if bias else None)
    ref = grad(mixed_chunk_reference, lambda tb: tb[relative_buckets(dist)] if bias else None)
    assert tree_rel_err(fast, ref) < 1e-5


def test_mixed_chunk_from_an_initial_state_and_in_bf16(key):
    """A sequence continued from the linear sum of the tokens before it equals the whole
    sequence's later part (values and gradients); in bfloat16 it keeps its dtypes and stays
    near the float32 result."""
    g, t = 8, 32
    qk, v = gau_inputs(key, t=t)
    kwargs = dict(chunk_size=g, quad_scale=1 / g, lin_scale=1 / t)
    cot = jax.random.normal(jax.random.fold_in(key, 1), (2, t - 2 * g, v.shape[-1]))
    whole = lambda *a: jnp.sum(mixed_chunk_attention(*a, **kwargs)[:, 2 * g :] * cot)  # noqa: E731

    def continued(*a):
        state = jnp.einsum("bjs,bje->bse", a[3][:, : 2 * g], a[4][:, : 2 * g])
        later = [x[:, 2 * g :] for x in a]
        return jnp.sum(mixed_chunk_attention(*later, initial_state=state, **kwargs) * cot)

    args = (*qk, v)
    assert rel_err(continued(*args), whole(*args)) < 1e-5
    argnums = tuple(range(5))
    assert tree_rel_err(jax.grad(continued, argnums)(*args), jax.grad(whole, argnums)(*args)) < 1e-5
    half = [x.astype(jnp.bfloat16) for x in args]
    out = mixed_chunk_attention(*half, **kwargs)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out.astype(jnp.float32), mixed_chunk_attention(*args, **kwargs)) < 2e-2
    grads = jax.grad(lambda *a: jnp.sum(mixed_chunk_attention(*a, **kwargs).astype(jnp.float32)), argnums)(
        *half
    )
    assert all(x.dtype == jnp.bfloat16 for x in grads)


def test_relu2_reference_is_causal_and_keeps_to_segments(key):
    qk, v = gau_inputs(key, t=16)
    seg = jnp.array([[0] * 6 + [1] * 10] * 2)
    out = relu2_attention_reference(qk[0], qk[1], v, scale=0.1, segment_ids=seg)
    later = relu2_attention_reference(
        qk[0], qk[1].at[:, 10:].set(3.0), v.at[:, 10:].set(-2.0), scale=0.1, segment_ids=seg
    )
    np.testing.assert_allclose(out[:, :10], later[:, :10], rtol=1e-6)
    other = relu2_attention_reference(
        qk[0], qk[1].at[:, :6].set(5.0), v.at[:, :6].set(7.0), scale=0.1, segment_ids=seg
    )
    np.testing.assert_allclose(out[:, 6:], other[:, 6:], rtol=1e-6)  # document 1 never sees document 0


def small_flash(**kwargs) -> FLASHConfig:
    fields = dict(vocab_size=40, num_layers=2, d_model=32, chunk_size=8, qk_dim=16, max_seq_len=64)
    return FLASHConfig(**{**fields, **kwargs})


def random_params(model, key, seq_len=8):
    """Initial parameters moved away from their init (zero biases and offsets would hide bugs)."""
    params = nn.meta.unbox(model.init(key, jnp.zeros((1, seq_len), jnp.int32))["params"])
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.fold_in(key, 1), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


FORMS = [
    dict(attention="mixed_chunk"),
    dict(attention="mixed_chunk", position_embedding="relative_bias", norm="layer_norm"),
    dict(attention="quadratic"),
    dict(attention="quadratic", position_embedding="relative_bias", scan_layers=False),
]


@pytest.mark.parametrize("form", FORMS, ids=lambda f: "-".join(str(v) for v in f.values()))
def test_later_tokens_never_change_earlier_logits(form, key):
    model = FLASH(small_flash(**form))
    params = random_params(model, key)
    tokens = jax.random.randint(jax.random.fold_in(key, 2), (2, 37), 0, 40)  # not a multiple of 8
    logits = model.apply({"params": params}, tokens)
    changed = model.apply({"params": params}, tokens.at[:, 21:].set(3))
    np.testing.assert_allclose(logits[:, :21], changed[:, :21], rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(logits[:, 21:] - changed[:, 21:]))) > 1e-3


@pytest.mark.parametrize("form", FORMS, ids=lambda f: "-".join(str(v) for v in f.values()))
def test_decoding_with_the_cache_equals_the_full_forward(form, key):
    model = FLASH(small_flash(**form))
    params = random_params(model, key)
    tokens = jax.random.randint(jax.random.fold_in(key, 2), (2, 30), 0, 40)
    full = model.apply({"params": params}, tokens)
    cache = init_cache(model, 2, 64)
    logits, variables = model.apply(
        {"params": params, "cache": cache}, tokens[:, :11], decode=True, mutable=["cache"]
    )
    steps = [logits]
    for i in range(11, 30):  # across chunk borders at 16 and 24
        logits, variables = model.apply(
            {"params": params, "cache": variables["cache"]},
            tokens[:, i : i + 1],
            decode=True,
            mutable=["cache"],
        )
        steps.append(logits)
    assert rel_err(jnp.concatenate(steps, axis=1), full) < 1e-5
    if form["attention"] == "mixed_chunk":  # the cache does not grow with the context
        sizes = {k: v.shape for k, v in variables["cache"].items()}  # [layers, batch, ...]
        assert sizes["state"] == (2, 2, 16, 64) and sizes["v"] == (2, 2, 8, 64), sizes


@pytest.mark.parametrize("attention", ["mixed_chunk", "quadratic"])
def test_ragged_prompts_in_chunks_decode_like_one_at_a_time(attention, key):
    # Greedy tokens must match exactly across paths: scales near 0 (qk_init="normal") keep the
    # relu^2 scores small, so float32 round-off between paths never flips a near-tied argmax.
    model = FLASH(small_flash(attention=attention, qk_init="normal"))
    params = random_params(model, key)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 40, n) for n in (3, 21, 13)]
    greedy = dict(num_tokens=9, max_len=64, rng=jax.random.PRNGKey(0), temperature=0.0, prefill_chunk=8)
    batch = generate_batch(model, params, prompts, **greedy)
    for prompt, tokens in zip(prompts, batch):  # prompts of 21 read in chunks of 8
        np.testing.assert_array_equal(tokens, generate(model, params, prompt, **greedy))
        # ... and as one prefill followed by greedy steps through the full forward:
        text = list(prompt)
        for _ in range(3):
            logits = model.apply({"params": params}, jnp.asarray([text]))
            text.append(int(jnp.argmax(logits[0, -1])))
        np.testing.assert_array_equal(tokens[:3], text[len(prompt) :])


def test_training_memory_grows_linearly_with_the_sequence():
    def temp(attention, seq_len):
        cfg = small_flash(
            attention=attention, d_model=64, chunk_size=64, max_seq_len=seq_len, loss_chunk_size=64
        )
        model = FLASH(cfg)
        params = jax.eval_shape(
            lambda: nn.meta.unbox(model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"])
        )
        tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
        loss = lambda p, t: model.apply({"params": p}, t, targets=t).loss  # noqa: E731
        return jax.jit(jax.grad(loss)).lower(params, tokens).compile().memory_analysis().temp_size_in_bytes

    mixed = {n: temp("mixed_chunk", n) for n in (1024, 2048, 4096)}
    assert 1.6 < mixed[4096] / mixed[2048] < 2.4 and 1.6 < mixed[2048] / mixed[1024] < 2.4, mixed
    quad = {n: temp("quadratic", n) for n in (1024, 2048)}
    assert quad[2048] / quad[1024] > 3.0, quad  # the [seq, seq] relu^2 weights


def test_family_config_and_counts():
    c = base_config("tiny")
    c.model.family = "flash"
    cfg = model_config(c.model, vocab_size=50, seq_len=128)
    assert isinstance(cfg, FLASHConfig) and cfg.max_seq_len == 128
    model = make_model(cfg)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"])
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params()
    biased = FLASHConfig(
        vocab_size=50, num_layers=2, d_model=32, position_embedding="relative_bias", norm="layer_norm"
    )
    params = nn.meta.unbox(FLASH(biased).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"])
    assert sum(x.size for x in jax.tree.leaves(params)) == biased.num_params()
    # FLOPs: FLASH's own count, growing with the chunk, not with the sequence (mixed_chunk)
    assert train_flops_per_token(cfg, 128) == train_flops_per_token(cfg, 4096) == cfg.train_flops_per_token(1)
    quad = FLASHConfig(vocab_size=50, num_layers=2, d_model=32, attention="quadratic")
    assert train_flops_per_token(quad, 4096) > train_flops_per_token(quad, 128)
    assert isinstance(model_config(base_config("tiny").model, vocab_size=50, seq_len=128), GPTConfig)
    c.model.family = "rnn"
    with pytest.raises(ValueError, match="unknown model.family 'rnn'; allowed: gpt, flash"):
        model_config(c.model, vocab_size=50, seq_len=128)
    g = base_config("tiny")
    g.model.expansion = 3.0
    with pytest.raises(ValueError, match=r"model.expansion=3.0 is a setting of model.family='flash'"):
        model_config(g.model, vocab_size=50, seq_len=128)
    with pytest.raises(ValueError, match="unknown model.attention 'linear' for FLASH"):
        small_flash(attention="linear")
    with pytest.raises(ValueError, match="model.qk_dim must be a positive integer"):
        small_flash(qk_dim=0)
    with pytest.raises(ValueError, match="unknown model.qk_init 'zeros' for FLASH; allowed: ones, normal"):
        small_flash(qk_init="zeros")
    # qk_init: the query/key scales start near 1 (the default) or near 0 (the paper's)
    for init, mean in (("ones", 1.0), ("normal", 0.0)):
        cfg = FLASHConfig(vocab_size=50, num_layers=2, d_model=32, qk_init=init)
        params = nn.meta.unbox(FLASH(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"])
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        scales = np.concatenate([np.ravel(x) for path, x in leaves if path[-1].key == "qk_scale"])
        assert abs(scales.mean() - mean) < 0.01 and 0.005 < scales.std() < 0.04


def test_flash_tiny_trains_through_the_loop_and_the_loss_falls(tmp_path):
    from bpt.config import load_config_file
    from bpt.train.loop import evaluate_checkpoint, train

    c = load_config_file(str(REPO / "configs" / "flash_tiny.py"))
    c.data.name, c.data.seq_len, c.data.copy_symbols = "copy", 64, 8
    c.train.update(steps=40, log_every=5, sample_tokens=0, learning_rate=3e-3, warmup_steps=5)
    last = train(c, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"] - 0.3, (records[0]["loss"], records[-1]["loss"])
    assert records[-1]["flops_per_token"] == FLASHConfig(
        vocab_size=9, num_layers=4, d_model=128, chunk_size=64, qk_dim=64, max_seq_len=64
    ).train_flops_per_token(64)
    assert evaluate_checkpoint(tmp_path)["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-5)
