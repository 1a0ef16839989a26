"""Autoregressive sampling with temperature and top-k.

Each new token re-runs the model over a fixed window of the last seq_len tokens (no KV
cache yet), so it is meant for short samples from small models.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def sample_logits(logits: jax.Array, rng, *, temperature: float, top_k: int) -> jax.Array:
    """Draws one token per row of logits [batch, vocab]; temperature 0 takes the argmax."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1)
    logits = logits / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1)


def generate(
    model,
    params,
    prompt: np.ndarray,
    *,
    num_tokens: int,
    seq_len: int,
    rng,
    temperature: float = 0.8,
    top_k: int = 40,
) -> np.ndarray:
    """Extends a 1-D prompt of token ids by num_tokens sampled tokens; returns the new ones."""
    prompt = np.asarray(prompt, np.int32)[-seq_len:]
    if len(prompt) == 0:
        raise ValueError("the prompt must hold at least one token")
    window = np.zeros((1, seq_len), np.int32)
    window[0, : len(prompt)] = prompt

    @functools.partial(jax.jit, donate_argnums=0)
    def step(window, length, rng):
        # Causal attention: tokens after `length` (padding) never affect position length - 1.
        logits = model.apply({"params": params}, window)[0, length - 1]
        token = sample_logits(logits[None], rng, temperature=temperature, top_k=top_k)[0]
        full = length == seq_len
        window = jnp.where(full, jnp.roll(window, -1, axis=1), window)
        position = jnp.where(full, seq_len - 1, length)
        return window.at[0, position].set(token), jnp.minimum(length + 1, seq_len), token

    window, length, out = jnp.asarray(window), jnp.int32(len(prompt)), []
    for i in range(num_tokens):
        window, length, token = step(window, length, jax.random.fold_in(rng, i))
        out.append(token)
    return np.asarray(jax.device_get(out), np.int32)
