"""Autoregressive sampling with a key/value cache: temperature, top-k and top-p (nucleus).

A prompt of up to prefill_chunk tokens is one prefill through the model's own attention
implementation; a longer one is read in near-equal chunks of about that size, each written into the
cache and attending to it (bpt.ops.decode_attention, chunk by chunk of keys), so no [prompt,
prompt] scores, no FFN over the whole prompt and no [prompt, vocab] logits ever exist. Each
new token is then one decode step that attends to the cache. prefill and decode are each one
jit-ed function (the decode loop a lax.scan), and decode takes the cache over in place.

A batch of prompts of different lengths decodes together (generate_batch): each sequence
writes its tokens at its own positions and attends up to them. A model whose sequence is
sharded over a mesh (model.parallel with mesh.sequence > 1) shards the cache along its slots
over those devices (striped: position p on device p mod N, so that a long prompt's chunks
load every device alike), and each new token attends to it by Tree Attention
(bpt.parallel.tree_decode_attention): one all-reduce of partial softmaxes a layer.
"""

from __future__ import annotations

import functools
import math

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
    """An empty key/value cache for batch_size sequences of up to max_len tokens. With the
    model's sequence sharded over a mesh (model.parallel), so is the cache, along its slots
    (striped: device i's slot j holds position j N + i)."""
    tokens = jnp.zeros((batch_size, max_len), jnp.int32)
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens, decode=True)["cache"])
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    par = getattr(model, "parallel", None)
    if par is None or par.sequence == 1:
        return cache
    # Keys, values (and int8 scales) are [(layers,) batch, slots, ...]: a leading layer axis
    # when the layers are scanned; "index" [batch] stays on every device.
    # (the batch stays whole on every device: only the slots are split)
    slots = par.logical(*(["layers"] if model.config.scan_layers else []), None, "length")

    def shard(path, x):
        return x if path[-1].key == "index" else jax.lax.with_sharding_constraint(x, slots)

    return jax.tree_util.tree_map_with_path(shard, cache)


def set_positions(cache, lengths):
    """The cache with each sequence's write position (its top-level "index") at lengths."""
    index = cache["index"]
    return {**cache, "index": jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), index.shape)}


def prefill_length(prompt_len: int, *chunk_sizes: int) -> int:
    """The prompt's length padded at the end so that the model's attention chunks (query and
    key/value chunk sizes) split it: as it is when it fits in the smallest chunk, else a
    whole number of their least common multiple."""
    if prompt_len <= min(chunk_sizes):
        return prompt_len
    unit = math.lcm(*chunk_sizes)
    return -(-prompt_len // unit) * unit


def prefill_chunks(prompt_len: int, prefill_chunk: int, *chunk_sizes: int, multiple: int = 1) -> tuple[int, int]:
    """(count, size): the prompt is read as count chunks of size tokens (the last padded at the
    end): as few as chunks of at most prefill_chunk allow, made as equal as prefill_length
    (over the model's chunk_sizes) allows, so the padding stays under one unit a chunk.
    multiple: where the prompt takes several chunks, each is a multiple of this (the model's
    prefill_multiple: FLASH's later chunks must start at its chunk borders)."""
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be at least 1; got {prefill_chunk}")
    count = -(-prompt_len // prefill_chunk)
    size = prefill_length(-(-prompt_len // count), *chunk_sizes)
    if count > 1 and size % multiple:
        size = -(-size // multiple) * multiple
        count = -(-prompt_len // size)
    return count, size


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
    _check(num_tokens, max_len)
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
        rng_made = jax.random.fold_in(rng, made)
        new.append(_sample(model, params, [context], count, max_len, rng_made, temperature, top_k, top_p,
                           prefill_chunk)[0])  # fmt: skip
        made += count
    return np.concatenate(new)


def generate_batch(
    model,
    params,
    prompts,
    *,
    num_tokens: int,
    max_len: int,
    rng,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 1.0,
    prefill_chunk: int = 4096,
) -> np.ndarray:
    """Extends each of several 1-D prompts, of any lengths, by num_tokens sampled tokens,
    decoded together; returns [len(prompts), num_tokens].

    Each sequence keeps its tokens at their own positions (slot i holds position i): the
    prompts are right-padded to one length for the prefill, every sequence's cache position
    then stands at its own length, and its new tokens overwrite its padding (which no token
    attends to). The longest prompt and its new tokens must fit max_len (no sliding window).
    """
    _check(num_tokens, max_len)
    texts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    if not texts or min(len(t) for t in texts) == 0:
        raise ValueError("every prompt must hold at least one token")
    longest = max(len(t) for t in texts)
    if longest + num_tokens > max_len:
        raise ValueError(
            f"the longest prompt ({longest} tokens) and num_tokens={num_tokens} do not fit "
            f"max_len={max_len}; generate one prompt at a time past the context (generate)"
        )
    return _sample(model, params, texts, num_tokens, max_len, rng, temperature, top_k, top_p, prefill_chunk)


def _check(num_tokens: int, max_len: int) -> None:
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be at least 1; got {num_tokens}")
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2; got {max_len}")


def _sample(
    model, params, texts, num_tokens, max_len, rng, temperature, top_k, top_p, prefill_chunk
) -> np.ndarray:
    """[len(texts), num_tokens] tokens after the texts, decoded in one cache of max_len."""
    lengths = np.array([len(t) for t in texts], np.int32)
    cfg = model.config
    count, chunk = prefill_chunks(
        int(lengths.max()), prefill_chunk, cfg.q_chunk_size, cfg.kv_chunk_size, multiple=cfg.prefill_multiple
    )
    padded_len = count * chunk
    if padded_len > max_len:
        raise ValueError(
            f"a prompt of {lengths.max()} tokens, padded to {count} chunk(s) of {chunk} (whole chunks of "
            f"model.q_chunk_size={cfg.q_chunk_size} and kv_chunk_size={cfg.kv_chunk_size}), does not fit "
            f"a cache of max_len={max_len}"
        )
    padded = np.zeros((len(texts), padded_len), np.int32)
    for row, text in zip(padded, texts):
        row[: len(text)] = text
    cache, last_logits = prefill(
        model, params, jnp.asarray(padded), jnp.asarray(lengths), max_len=max_len, chunk=chunk
    )
    tokens, _ = decode(
        model,
        params,
        cache,
        last_logits,
        rng,
        num_tokens=num_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )
    return np.asarray(tokens)


@functools.partial(jax.jit, static_argnames=("model", "max_len", "chunk"))
def prefill(model, params, padded, lengths, *, max_len: int, chunk: int):
    """Prompts right-padded to padded [batch, count * chunk] (row b's first lengths[b] tokens
    are its prompt) read into a fresh cache of max_len slots, chunk tokens at a time: the
    first chunk a prefill, each later one written into the cache and attending to it.

    Returns (cache, logits [batch, vocab] after each prompt's last token); each sequence's
    cache position stands at its length, so decoding overwrites its padding first.
    """
    batch = padded.shape[0]
    last = lengths - 1

    def pick(logits, i, current):  # the rows whose last prompt token is in chunk i
        mine = logits[jnp.arange(batch), jnp.clip(last - i * chunk, 0, chunk - 1)]
        return jnp.where((last // chunk == i)[:, None], mine, current)

    cache = init_cache(model, batch, max_len)
    valid = lambda i: jnp.clip(lengths - i * chunk, 0, chunk)  # noqa: E731  real tokens of chunk i
    logits, variables = model.apply(
        {"params": params, "cache": cache}, padded[:, :chunk], decode=True, valid=valid(0), mutable=["cache"]
    )
    carry = (variables["cache"], pick(logits, 0, jnp.zeros((batch, logits.shape[-1]), logits.dtype)))
    count = padded.shape[1] // chunk
    if count > 1:  # the prompts' later chunks, each attending to the cache

        def extend(carry, chunk_tokens):
            i, tokens = chunk_tokens
            logits, variables = model.apply(
                {"params": params, "cache": carry[0]},
                tokens,
                decode=True,
                extend=True,
                valid=valid(i),
                mutable=["cache"],
            )
            return (variables["cache"], pick(logits, i, carry[1])), None

        rest = padded[:, chunk:].reshape(batch, count - 1, chunk).swapaxes(0, 1)
        carry, _ = jax.lax.scan(extend, carry, (jnp.arange(1, count), rest))
    cache, last_logits = carry
    return set_positions(cache, lengths), last_logits


@functools.partial(
    jax.jit,
    static_argnames=("model", "num_tokens", "temperature", "top_k", "top_p"),
    donate_argnames=("cache",),
)
def decode(model, params, cache, last_logits, rng, *, num_tokens: int, temperature=0.8, top_k=0, top_p=1.0):
    """(tokens [batch, num_tokens], cache): each token drawn from the last logits, then run
    through the model against the cache. The cache is donated: updated in place, never
    copied, and returned holding the new tokens too."""

    def step(carry, step_rng):
        cache, last_logits = carry
        token = sample_logits(last_logits, step_rng, temperature=temperature, top_k=top_k, top_p=top_p)
        logits, variables = model.apply(
            {"params": params, "cache": cache}, token[:, None], decode=True, mutable=["cache"]
        )
        return (variables["cache"], logits[:, -1]), token

    (cache, _), tokens = jax.lax.scan(step, (cache, last_logits), jax.random.split(rng, num_tokens))
    return tokens.T, cache
