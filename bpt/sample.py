"""Autoregressive sampling with a key/value cache: temperature, top-k and top-p (nucleus).

A prompt of up to prefill_chunk tokens is one prefill through the model's own attention
implementation; a longer one is read in near-equal chunks of about that size, each written into the
cache and attending to it (bpt.ops.decode_attention, chunk by chunk of keys), so no [prompt,
prompt] scores, no FFN over the whole prompt and no [prompt, vocab] logits ever exist. Each
new token is then one decode step that attends to the cache. The whole decode loop is one
jit-ed lax.scan.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def sample_logits(
    logits: jax.Array, rng, *, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> jax.Array:
    """Draws one token per row of logits [batch, vocab]; temperature 0 takes the argmax.

    top_k > 0 keeps the k most likely tokens; top_p < 1 keeps the smallest set of most likely
    tokens whose probability reaches top_p.
    """
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1)
    logits = logits.astype(jnp.float32) / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # The smallest logit still needed to reach top_p (the first token is always kept).
        cutoff_index = jnp.sum(cumulative < top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1)


def init_cache(model, batch_size: int, max_len: int):
    """An empty key/value cache for batch_size sequences of up to max_len tokens."""
    tokens = jnp.zeros((batch_size, max_len), jnp.int32)
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens, decode=True)["cache"])
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _set_index(cache, index: int):
    """Points the cache's write position (the top-level "index") at `index`."""
    return {**cache, "index": jnp.asarray(index, jnp.int32)}


def prefill_length(prompt_len: int, chunk_size: int) -> int:
    """The prompt is padded at the end to a whole number of chunks when it spans several."""
    return prompt_len if prompt_len <= chunk_size else -(-prompt_len // chunk_size) * chunk_size


def prefill_chunks(prompt_len: int, prefill_chunk: int, q_chunk_size: int) -> tuple[int, int]:
    """(count, size): the prompt is read as count chunks of size tokens (the last padded at the
    end): as few as chunks of at most prefill_chunk allow, made as equal as prefill_length
    allows, so the padding stays under one query chunk a chunk."""
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be at least 1; got {prefill_chunk}")
    count = -(-prompt_len // prefill_chunk)
    return count, prefill_length(-(-prompt_len // count), q_chunk_size)


def context_window(max_len: int) -> int:
    """Tokens of context kept when generation runs past the cache (max_len): the last half."""
    return max(1, max_len // 2)


def generate(
    model,
    params,
    prompt: np.ndarray,
    *,
    num_tokens: int,
    max_len: int,
    rng,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 1.0,
    prefill_chunk: int = 4096,
) -> np.ndarray:
    """Extends a 1-D prompt of token ids by num_tokens sampled tokens; returns the new ones.

    prefill_chunk: prompts longer than this are read chunk by chunk (module docstring).
    max_len: the cache length, normally the context the model was trained at. Text longer
    than that is generated with a sliding window: when the cache is full, decoding restarts
    from a prefill of the last context_window(max_len) tokens. A prompt of max_len tokens or
    more is read from its last context_window(max_len) tokens only (callers say so).
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be at least 1; got {num_tokens}")
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2; got {max_len}")
    text = np.asarray(prompt, np.int32).reshape(-1)
    if len(text) == 0:
        raise ValueError("the prompt must hold at least one token")
    if len(text) >= max_len:
        text = text[-context_window(max_len) :]
    new: list[np.ndarray] = []
    made = 0
    while made < num_tokens:
        context = text if not made else np.concatenate([text, *new])[-context_window(max_len) :]
        count = min(num_tokens - made, max_len - len(context))
        new.append(_segment(model, params, context, count, max_len, jax.random.fold_in(rng, made),
                            temperature, top_k, top_p, prefill_chunk))  # fmt: skip
        made += count
    return np.concatenate(new)


def _segment(
    model, params, prompt, num_tokens, max_len, rng, temperature, top_k, top_p, prefill_chunk
) -> np.ndarray:
    """num_tokens tokens after prompt, decoded in one cache of max_len."""
    count, chunk = prefill_chunks(len(prompt), prefill_chunk, model.config.q_chunk_size)
    padded_len = count * chunk
    if padded_len > max_len:
        raise ValueError(
            f"a prompt of {len(prompt)} tokens, padded to {count} chunk(s) of {chunk} (whole chunks of "
            f"model.q_chunk_size={model.config.q_chunk_size}), does not fit a cache of max_len={max_len}"
        )
    padded = np.zeros((1, padded_len), np.int32)
    padded[0, : len(prompt)] = prompt
    tokens = _generate(
        model,
        params,
        jnp.asarray(padded),
        len(prompt),
        num_tokens,
        max_len,
        rng,
        temperature,
        top_k,
        top_p,
        chunk,
    )
    return np.asarray(tokens)[0]


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5, 7, 8, 9, 10))
def _generate(model, params, padded, prompt_len, num_tokens, max_len, rng, temperature, top_k, top_p, chunk):
    cache = init_cache(model, padded.shape[0], max_len)
    last = (prompt_len - 1) % chunk  # the prompt's last token, within the last chunk
    logits, variables = model.apply(
        {"params": params, "cache": cache}, padded[:, :chunk], decode=True, mutable=["cache"]
    )
    cache, last_logits = variables["cache"], logits[:, last]
    if padded.shape[1] > chunk:  # the prompt's later chunks, each attending to the cache

        def extend(carry, tokens):
            logits, variables = model.apply(
                {"params": params, "cache": carry[0]}, tokens, decode=True, extend=True, mutable=["cache"]
            )
            return (variables["cache"], logits[:, last]), None

        rest = padded[:, chunk:].reshape(padded.shape[0], -1, chunk).swapaxes(0, 1)
        (cache, last_logits), _ = jax.lax.scan(extend, (cache, last_logits), rest)
    # Slots past the prompt hold the padding's keys; decode steps overwrite them in order.
    cache = _set_index(cache, prompt_len)

    def step(carry, step_rng):
        cache, last_logits = carry
        token = sample_logits(last_logits, step_rng, temperature=temperature, top_k=top_k, top_p=top_p)
        logits, variables = model.apply(
            {"params": params, "cache": cache}, token[:, None], decode=True, mutable=["cache"]
        )
        return (variables["cache"], logits[:, -1]), token

    rngs = jax.random.split(rng, num_tokens)
    _, tokens = jax.lax.scan(step, (cache, last_logits), rngs)
    return tokens.T
