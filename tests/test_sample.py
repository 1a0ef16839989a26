"""Decoding with the key/value cache computes what the full forward pass computes."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err
from test_model import BASE

from bpt.models.gpt import GPT
from bpt.ops import reference_attention
from bpt.ops.decode import decode_attention
from bpt.sample import generate, generate_batch, init_cache, prefill_length, sample_logits, set_positions


def test_decode_attention_equals_the_matching_rows_of_causal_attention(key):
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (2, 24, 4, 16))
    k = jax.random.normal(kk, (2, 24, 2, 16))
    v = jax.random.normal(kv, (2, 24, 2, 16))
    full = reference_attention(q, k, v, causal=True)
    # A cache of 32 slots, filled up to position 23; slots 24.. hold garbage.
    k_cache = jnp.concatenate([k, 1e3 * jnp.ones((2, 8, 2, 16))], axis=1)
    v_cache = jnp.concatenate([v, 1e3 * jnp.ones((2, 8, 2, 16))], axis=1)
    for pos in (0, 5, 23):
        out = decode_attention(q[:, pos : pos + 1], k_cache, v_cache, jnp.array([pos]))
        assert rel_err(out, full[:, pos : pos + 1]) < 1e-5


@pytest.mark.parametrize(
    "mode,position_embedding,prompt_len",
    [
        ("blockwise_parallel", "rotary", 21),  # the prefill is padded to 32
        ("blockwise_parallel", "learned", 16),
        ("vanilla", "rotary", 9),
        ("memory_efficient", "rotary", 40),
    ],
)
def test_cached_decoding_gives_the_full_forward_logits(key, mode, position_embedding, prompt_len):
    cfg = dataclasses.replace(BASE, attention_mode=mode, position_embedding=position_embedding)
    model = GPT(cfg)
    tokens = jax.random.randint(key, (2, 48), 0, cfg.vocab_size)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), tokens)["params"])
    full = model.apply({"params": params}, tokens)

    padded_len = prefill_length(prompt_len, cfg.q_chunk_size, cfg.kv_chunk_size)
    prompt = jnp.zeros((2, padded_len), jnp.int32).at[:, :prompt_len].set(tokens[:, :prompt_len])
    cache = init_cache(model, 2, 64)
    logits, variables = model.apply(
        {"params": params, "cache": cache}, prompt, decode=True, mutable=["cache"]
    )
    assert rel_err(logits[:, :prompt_len], full[:, :prompt_len]) < 1e-5
    cache = set_positions(variables["cache"], prompt_len)

    @jax.jit
    def step(cache, token):
        logits, variables = model.apply(
            {"params": params, "cache": cache}, token, decode=True, mutable=["cache"]
        )
        return variables["cache"], logits

    for t in range(prompt_len, 48):
        cache, logits = step(cache, tokens[:, t : t + 1])
        assert rel_err(logits[:, 0], full[:, t]) < 1e-5, t


def test_greedy_generation_follows_the_full_forward_pass():
    model = GPT(BASE)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(1), jnp.zeros((1, 64), jnp.int32))["params"])
    prompt = np.array([5, 7, 11, 13, 2, 3, 5, 8, 13, 21, 34, 55, 89, 1, 2, 4, 8, 16, 32], np.int32)
    new = generate(
        model, params, prompt, num_tokens=30, max_len=64, rng=jax.random.PRNGKey(0), temperature=0.0
    )
    seq = np.concatenate([prompt, new])
    logits = model.apply({"params": params}, jnp.asarray(np.pad(seq, (0, 64 - len(seq))))[None])[0]
    expected = np.argmax(np.asarray(logits[len(prompt) - 1 : len(seq) - 1]), axis=-1)
    np.testing.assert_array_equal(new, expected)


def test_top_k_and_top_p_keep_only_the_likely_tokens():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    draws = lambda **kw: {
        int(sample_logits(logits, jax.random.PRNGKey(i), temperature=1.0, **kw)[0]) for i in range(200)
    }
    assert draws(top_k=2) == {0, 1}
    assert draws(top_p=0.75) == {0, 1}  # 0.5 + 0.3 reaches 0.75
    assert draws(top_p=0.9) == {0, 1, 2}
    assert draws() == {0, 1, 2, 3}
    assert int(sample_logits(logits, jax.random.PRNGKey(0), temperature=0.0)[0]) == 0


def test_generation_arguments_are_checked():
    model = GPT(BASE)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(1), jnp.zeros((1, 64), jnp.int32))["params"])
    with pytest.raises(ValueError, match="num_tokens must be at least 1"):
        generate(model, params, np.array([1]), num_tokens=0, max_len=64, rng=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, params, np.array([], np.int32), num_tokens=4, max_len=64, rng=jax.random.PRNGKey(0))


def test_sample_command_continues_a_prompt(tmp_path):
    import subprocess
    import sys

    from test_data import text_config, write_corpus

    from bpt.train.loop import train

    corpus = write_corpus(tmp_path / "corpus", ["Friends, Romans, countrymen, lend me your ears. " * 40])
    c = text_config(corpus, tmp_path, seq_len=64)
    c.model.q_chunk_size = c.model.kv_chunk_size = c.model.loss_chunk_size = 16
    c.train.steps, c.train.log_every, c.train.sample_tokens = 3, 3, 0
    train(c, tmp_path / "run")
    cmd = [sys.executable, "-m", "bpt.cli.sample", "--workdir", str(tmp_path / "run"), "--prompt", "Friends,",
           "--num_tokens", "20", "--temperature", "0"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("Friends,") and len(result.stdout) > len("Friends,")
    # Two prompts of different lengths, one from a file, decode as one batch (an int8 cache).
    (tmp_path / "prompt.txt").write_text("Romans, countrymen, lend")
    result = subprocess.run(
        cmd + ["--prompt_file", str(tmp_path / "prompt.txt"), "--cache_dtype", "int8"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    first, second = result.stdout.split("=== sample 2 of 2 ===\n")
    assert first.startswith("=== sample 1 of 2 ===\nFriends,") and len(first) > 40
    assert second.startswith("Romans, countrymen, lend") and len(second) > len("Romans, countrymen, lend")


def test_generation_past_the_context_slides_a_window():
    model = GPT(BASE)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(1), jnp.zeros((1, 64), jnp.int32))["params"])
    prompt = np.arange(1, 20, dtype=np.int32)
    greedy = dict(max_len=32, rng=jax.random.PRNGKey(0), temperature=0.0)
    new = generate(model, params, prompt, num_tokens=40, **greedy)
    assert len(new) == 40
    # The first window fills the cache (32 - 19 = 13 tokens); then each window continues from
    # the last 16 tokens, exactly as a fresh generation from them would.
    np.testing.assert_array_equal(new[:13], generate(model, params, prompt, num_tokens=13, **greedy))
    text = np.concatenate([prompt, new])
    window = text[len(prompt) + 13 - 16 : len(prompt) + 13]
    np.testing.assert_array_equal(new[13:29], generate(model, params, window, num_tokens=16, **greedy))
    # A prompt longer than the context is read from its last 16 tokens.
    long_prompt = np.arange(1, 50, dtype=np.int32) % 7 + 1
    np.testing.assert_array_equal(
        generate(model, params, long_prompt, num_tokens=5, **greedy),
        generate(model, params, long_prompt[-16:], num_tokens=5, **greedy),
    )


def test_a_long_prompt_read_in_chunks_gives_the_full_forward(key):
    """A 2K prompt: the first chunk a prefill, the later ones extend the cache (attending to it
    chunk of keys by chunk of keys); their logits are the full forward's, and greedy generation
    after them equals the full forward's argmax, token by token."""
    cfg = dataclasses.replace(BASE, q_chunk_size=256, kv_chunk_size=256, loss_chunk_size=256)
    model = GPT(cfg)
    length, chunk = 2048, 512
    tokens = jax.random.randint(key, (1, length + 4), 0, cfg.vocab_size)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), tokens[:, :64])["params"])
    reference = jax.jit(GPT(dataclasses.replace(cfg, attention_mode="vanilla")).apply)  # any length
    full = reference({"params": params}, tokens)

    @jax.jit
    def chunked(params, prompt):
        cache = init_cache(model, 1, length + 256)
        logits, variables = model.apply(
            {"params": params, "cache": cache}, prompt[:, :chunk], decode=True, mutable=["cache"]
        )
        out = [logits]
        for start in range(chunk, length, chunk):
            logits, variables = model.apply(
                {"params": params, "cache": variables["cache"]}, prompt[:, start : start + chunk],
                decode=True, extend=True, mutable=["cache"],
            )  # fmt: skip
            out.append(logits)
        return jnp.concatenate(out, axis=1)

    assert rel_err(chunked(params, tokens[:, :length]), full[:, :length]) < 1e-5
    prompt = np.asarray(tokens[0, :length])
    new = generate(
        model,
        params,
        prompt,
        num_tokens=3,
        max_len=length + 256,
        rng=key,
        temperature=0.0,
        prefill_chunk=chunk,
    )
    text = jnp.asarray(prompt)[None]
    for token in new:
        expected = int(jnp.argmax(reference({"params": params}, text)[0, -1]))
        assert token == expected
        text = jnp.concatenate([text, jnp.array([[token]])], axis=1)


def test_a_batch_of_prompts_of_different_lengths_decodes_as_each_alone():
    """Right-padded prompts of 3, 17 and 40 tokens (the last over three prefill chunks), each
    at its own positions: greedy tokens equal each prompt's own generation."""
    model = GPT(BASE)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(1), jnp.zeros((1, 64), jnp.int32))["params"])
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, BASE.vocab_size, n).astype(np.int32) for n in (3, 17, 40)]
    greedy = dict(num_tokens=12, max_len=64, rng=jax.random.PRNGKey(0), temperature=0.0, prefill_chunk=16)
    batch = generate_batch(model, params, prompts, **greedy)
    assert batch.shape == (3, 12)
    for prompt, tokens in zip(prompts, batch):
        np.testing.assert_array_equal(tokens, generate(model, params, prompt, **greedy))
    with pytest.raises(ValueError, match="do not fit max_len=64"):
        generate_batch(model, params, prompts, **{**greedy, "num_tokens": 30})
    with pytest.raises(ValueError, match="at least one token"):
        generate_batch(model, params, [prompts[0], []], **greedy)


def test_cache_writes_go_to_each_sequence_position_and_drop_outside():
    from bpt.ops.decode import write_cache

    cache = jnp.zeros((2, 8, 1, 2))
    new = jnp.arange(1, 13, dtype=jnp.float32).reshape(2, 3, 1, 2)
    out = write_cache(cache, new, jnp.array([[0, 1, 2], [6, 7, 8]]))
    np.testing.assert_array_equal(out[0, :3], new[0])
    np.testing.assert_array_equal(out[1, 6:], new[1, :2])  # position 8 is past the cache
    assert float(jnp.abs(out).sum()) == float(new[0].sum() + new[1, :2].sum())
    # A shard of slots 4..7: only the positions in it land, at their local slots.
    shard = write_cache(cache[:, :4], new, jnp.array([[3, 4, 5], [6, 7, 8]]), offset=4)
    np.testing.assert_array_equal(shard[0, :2], new[0, 1:])
    np.testing.assert_array_equal(shard[1, 2:], new[1, :2])


def test_an_int8_cache_gives_logits_near_the_full_forward(key):
    """model.cache_dtype=int8: the decode steps read int8 keys and values with per-token,
    per-head scales; their logits stay near the full forward's."""
    cfg = dataclasses.replace(BASE, cache_dtype="int8")
    model = GPT(cfg)
    tokens = jax.random.randint(key, (2, 48), 0, cfg.vocab_size)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), tokens)["params"])
    full = model.apply({"params": params}, tokens)
    cache = init_cache(model, 2, 64)
    assert cache["k"].dtype == jnp.int8 and cache["k_scale"].shape == cache["k"].shape[:-1]
    _, variables = model.apply(
        {"params": params, "cache": cache}, tokens[:, :16], decode=True, mutable=["cache"]
    )
    logits, _ = model.apply(
        {"params": params, "cache": variables["cache"]},
        tokens[:, 16:],
        decode=True,
        extend=True,
        mutable=["cache"],
    )
    assert rel_err(logits, full[:, 16:]) < 2e-2
    with pytest.raises(ValueError, match="model.cache_dtype"):
        dataclasses.replace(BASE, cache_dtype="fp4")
