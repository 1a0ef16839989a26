"""Position-wise work done chunk by chunk: the blockwise FFN and the blockwise LM loss.

A chunk loop is a lax.scan over the sequence axis (axis 1), so only one chunk's intermediates
(an FFN's [chunk, 4 * d_model] hidden layer, an LM head's [chunk, vocab] logits) are alive at
a time, in the forward and in the backward pass: the FFN's body is under jax.checkpoint, and
the loss computes its gradient in the forward pass, chunk by chunk.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import einops
import jax
import jax.numpy as jnp
import numpy as np

from bpt.ops.remat import remat

Array = jax.Array
PyTree = Any


def resolve_chunk_size(chunk_size: int, length: int, name: str) -> int:
    """Clamps chunk_size to the sequence length and checks that it divides the length."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"{name} must be a positive integer; got {chunk_size!r}")
    chunk_size = min(chunk_size, length)
    if length % chunk_size:
        raise ValueError(
            f"sequence length {length} is not divisible by {name}={chunk_size}; "
            "choose a chunk size that divides the sequence length"
        )
    return chunk_size


def largest_chunk(length: int, unit: int, most: int) -> int:
    """The largest multiple of unit that divides length and is at most most (the whole length
    when it is at most that; unit itself when no larger multiple divides, or when unit does
    not divide length, which resolve_chunk_size then reports)."""
    if length <= most:
        return length
    if length % unit:
        return unit
    return max(unit * k for k in range(1, max(most // unit, 1) + 1) if (length // unit) % k == 0)


def to_chunks(x: Array, chunk_size: int, shards: int = 1) -> Array:
    """[batch, seq, ...] -> [seq // chunk_size, batch, chunk_size, ...].

    shards > 1: the sequence is split over that many devices (sequence parallelism), so
    chunk i is taken from every shard at once: [seq // shards // chunk_size, batch * shards,
    chunk_size, ...]. The chunk axis then stays local to each device and a scan over it needs
    no communication.
    """
    return einops.rearrange(x, "b (s n c) ... -> n (b s) c ...", c=chunk_size, s=shards)


def from_chunks(x: Array, shards: int = 1) -> Array:
    """The inverse of to_chunks: [num_chunks, batch * shards, chunk, ...] -> [batch, seq, ...]."""
    return einops.rearrange(x, "n (b s) c ... -> b (s n c) ...", s=shards)


def scan_chunks(
    fn: Callable[..., PyTree],
    xs: PyTree,
    *,
    chunk_size: int,
    policy: str = "nothing_saveable",
    name: str = "chunk_size",
    weights: PyTree = None,
    shards: int = 1,
) -> PyTree:
    """Runs fn(chunk_index, xs_chunk) for every chunk of the sequence axis; stacks the results.

    Every leaf of xs is [batch, seq, ...] with the same seq. fn's outputs come back stacked
    along a new leading axis of length seq // chunk_size. The body is rematerialized with
    the named checkpoint policy (see bpt.ops.remat).

    weights: arrays every chunk reads (an FFN's matrices, an LM head); fn is then called as
    fn(chunk_index, xs_chunk, weights). The backward pass sums each chunk's gradient of
    them; a scan sums in the dtype of what it closes over, which in bfloat16 would lose
    precision with every chunk. So the scan closes over float32 copies and each chunk casts
    them back to their own dtype: the chunks' matmuls run as before and the sums are float32.

    shards: the sequence is split over that many devices; each step takes one chunk of every
    shard (see to_chunks), chunk_index counts within a shard, and the results come back as
    to_chunks(..., shards) lays them out (from_chunks(ys, shards) restores the sequence).
    """
    leaves = jax.tree.leaves(xs)
    length = leaves[0].shape[1]
    if any(leaf.shape[1] != length for leaf in leaves):
        raise ValueError(f"all inputs must share the sequence length {length}")
    if length % shards:
        raise ValueError(f"sequence length {length} does not split into {shards} shards")
    length //= shards
    chunk_size = resolve_chunk_size(chunk_size, length, name)
    if weights is None:
        body = remat(fn, policy, prevent_cse=False)
    else:
        dtypes = jax.tree.map(lambda w: w.dtype, weights)
        carried = jax.tree.map(lambda w: w.astype(jnp.promote_types(w.dtype, jnp.float32)), weights)
        body = remat(
            lambda i, chunk: fn(i, chunk, jax.tree.map(lambda w, t: w.astype(t), carried, dtypes)),
            policy,
            prevent_cse=False,
        )

    def step(carry, inputs):
        index, chunk = inputs
        return carry, body(index, chunk)

    chunks = jax.tree.map(lambda x: to_chunks(x, chunk_size, shards), xs)
    _, ys = jax.lax.scan(step, None, (jnp.arange(length // chunk_size), chunks))
    return ys


def blockwise_ffn(
    fn: Callable[..., PyTree],
    x: PyTree,
    *,
    chunk_size: int,
    policy: str = "nothing_saveable",
    weights: PyTree = None,
) -> PyTree:
    """Applies a position-wise function chunk by chunk along the sequence axis.

    Args:
      fn: maps a [batch, chunk, ...] pytree to a [batch, chunk, ...] pytree; it must not mix
        positions (an FFN, a layer norm, a residual add).
      x: a [batch, seq, ...] array or pytree of such arrays.
      chunk_size: positions per chunk; must divide seq (a larger value is clamped to seq).
      policy: checkpoint policy of each chunk, a name from bpt.ops.remat.POLICIES.
      weights: optional pytree of the arrays fn reads, called then as fn(chunk, weights);
        their gradients are summed over the chunks in float32 (see scan_chunks).
    Returns:
      fn(x), computed with one chunk's intermediates alive at a time.
    """
    if weights is None:
        body = lambda _, chunk: fn(chunk)  # noqa: E731
    else:
        body = lambda _, chunk, w: fn(chunk, w)  # noqa: E731
    ys = scan_chunks(body, x, chunk_size=chunk_size, policy=policy, weights=weights)
    return jax.tree.map(from_chunks, ys)


class Loss(NamedTuple):
    """A model's training objective as the loop records it; a pytree, so it passes through jit
    and grad aux. A language model's is its cross-entropy (CrossEntropy); the Agentic
    Transformer's a squared error of actions (bpt.models.agentic)."""

    loss: Array  # the mean objective over the counted positions (float32)
    num_tokens: Array  # how many positions were counted (float32)
    accuracy: Array  # the fraction of counted positions predicted right


# The language models' Loss: loss is the mean negative log-likelihood of the counted tokens,
# accuracy the fraction whose argmax prediction is the target.
CrossEntropy = Loss


def _combine_stats(a, b):
    """Merges two (max, sum of exp(x - max), index of the max) triples: the reducer of
    logsumexp_argmax. Associative and commutative, as a reduction's combiner must be; ties
    keep the lower index (jnp.argmax's)."""
    (m1, s1, i1), (m2, s2, i2) = a, b
    m, lo = jnp.maximum(m1, m2), jnp.minimum(m1, m2)
    first = m1 >= m2
    # lo == m covers ties and two -inf sides (-inf - -inf would be nan); a -inf side's count
    # is scaled by exp(-inf) = 0 as soon as the other side has a finite max.
    s = jnp.where(first, s1, s2) + jnp.where(first, s2, s1) * jnp.where(lo == m, 1.0, jnp.exp(lo - m))
    i = jnp.where(m1 > m2, i1, jnp.where(m2 > m1, i2, jnp.minimum(i1, i2)))
    return m, s, i


@jax.custom_jvp
def logsumexp_argmax(logits: Array) -> tuple[Array, Array]:
    """(logsumexp, argmax) of float32 logits over their last axis, in one pass over them.

    jax.nn.logsumexp reads the logits twice (their max, then the sum of exponentials) and
    jnp.argmax once more: over an LM head's [chunk, vocab] logits each pass costs as much
    as the head's matmul writing them. Here one variadic reduction carries the running max,
    the sum of exponentials relative to it (the online softmax's rescaling) and the max's
    index. -inf entries (padding) count for nothing; a row of only -inf gives -inf. The
    logsumexp is differentiable (its derivative is the softmax), the argmax is not.
    """
    x = logits.astype(jnp.float32)
    axis = x.ndim - 1
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    inits = (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.int32(0))
    m, s, i = jax.lax.reduce((x, jnp.ones_like(x), index), inits, _combine_stats, (axis,))
    return m + jnp.log(s), i


@logsumexp_argmax.defjvp
def _logsumexp_argmax_jvp(primals, tangents):
    (logits,), (dlogits,) = primals, tangents
    lse, argmax = logsumexp_argmax(logits)
    softmax = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
    dlse = jnp.sum(softmax * dlogits.astype(jnp.float32), axis=-1)
    return (lse, argmax), (dlse, np.zeros(argmax.shape, jax.dtypes.float0))


def _loss_sums(logits: Array, targets: Array, mask: Array | None) -> tuple[Array, Array]:
    """([nll_sum, count, correct_sum], logsumexp) over a [batch, seq, vocab] block of float32
    logits."""
    lse, argmax = logsumexp_argmax(logits)
    nll = lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    correct = (argmax == targets).astype(jnp.float32)
    weight = jnp.ones_like(nll) if mask is None else mask.astype(jnp.float32)
    return jnp.stack([(nll * weight).sum(), weight.sum(), (correct * weight).sum()]), lse


def _finish(sums: Array) -> CrossEntropy:
    nll, count, correct = sums[0], sums[1], sums[2]
    denom = jnp.maximum(count, 1.0)
    return CrossEntropy(loss=nll / denom, num_tokens=count, accuracy=correct / denom)


def _check_targets(targets: Array, mask: Array | None, shape: tuple[int, ...]) -> None:
    if targets.shape != shape or (mask is not None and mask.shape != shape):
        raise ValueError(
            f"targets (and mask) must be [batch, seq] = {shape}; got {targets.shape}"
            + ("" if mask is None else f" and {mask.shape}")
        )


def cross_entropy(logits: Array, targets: Array, mask: Array | None = None) -> CrossEntropy:
    """Cross-entropy of materialized [batch, seq, vocab] logits against [batch, seq] targets."""
    _check_targets(targets, mask, logits.shape[:2])
    return _finish(_loss_sums(logits.astype(jnp.float32), targets, mask)[0])


def blockwise_cross_entropy(
    hidden: Array,
    weight: Array,
    targets: Array,
    *,
    chunk_size: int,
    mask: Array | None = None,
    norm: Callable[[PyTree, Array], Array] | None = None,
    norm_params: PyTree = None,
    shards: int = 1,
    reduce: Callable[[Array], Array] | None = None,
    vocab_size: int | None = None,
) -> CrossEntropy:
    """LM head matmul and cross-entropy per chunk; [seq, vocab] logits never exist at once.

    Under differentiation the gradient is computed in the forward pass, chunk by chunk:
    the loss is the last thing a model computes, so each chunk's logits give their own
    gradient (softmax - one-hot) at once, and the backward pass only scales what the forward
    kept by the incoming cotangent. No chunk's logits are computed twice: the LM head costs
    the three matmuls of an unchunked loss, not four.

    Args:
      hidden: [batch, seq, d_model] final hidden states.
      weight: [d_model, vocab] output projection (the transposed embedding when tied), any
        float dtype: each chunk's matmuls run in hidden's dtype, and its gradient is summed
        over the chunks in float32.
      targets: [batch, seq] int token ids.
      chunk_size: positions per chunk; must divide seq (a larger value is clamped to seq).
      mask: optional [batch, seq] weights (1 counts a token, 0 ignores it); no gradient
        flows to it.
      norm, norm_params: an optional position-wise function norm(norm_params, h) applied to
        each chunk of hidden before the head (the final LayerNorm), so that its
        intermediates exist one chunk at a time too.
      shards: the sequence is split over that many devices (see to_chunks); chunk_size then
        counts within a shard.
      reduce: applied to the [nll_sum, count, correct_sum] sums before the mean (inside
        shard_map: their lax.psum over the devices, so that each device's chunk loop
        covers its own tokens and the result is the whole batch's).
      vocab_size: the real vocabulary, where weight's columns past it are padding (a
        model's padded_vocab): their logits are masked out. None: every column is a token.
    Returns:
      CrossEntropy(loss, num_tokens, accuracy), equal to
      cross_entropy(norm(norm_params, hidden) @ weight, ...).
    """
    _check_targets(targets, mask, hidden.shape[:2])
    if hidden.shape[1] % shards:
        raise ValueError(f"sequence length {hidden.shape[1]} does not split into {shards} shards")
    chunk_size = resolve_chunk_size(chunk_size, hidden.shape[1] // shards, "chunk_size")
    vocab = weight.shape[-1] if vocab_size is None else vocab_size
    if not 0 < vocab <= weight.shape[-1]:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {weight.shape[-1]}] (the head's columns)")
    chunking = (chunk_size, shards, vocab)
    sums = _chunked_loss_sums(chunking, norm, hidden, weight, norm_params, targets, mask)
    return _finish(sums if reduce is None else reduce(sums))


VOCAB_ALIGNMENT = 128


def _aligned_head(weight: Array, dtype) -> Array:
    """The head in the compute dtype with its vocabulary padded by zero columns to a multiple
    of VOCAB_ALIGNMENT. GPT-2's 50257 makes every row of the logits and of the head start at
    an odd address: the GPU's fast matmuls need aligned rows and the fallback runs the LM
    head 2-3x slower (H100). The padded logits are masked out of the loss."""
    vocab = weight.shape[-1]
    return jnp.pad(weight.astype(dtype), ((0, 0), (0, -vocab % VOCAB_ALIGNMENT)))


def _head_chunk(norm, hidden, weight, norm_params, targets, mask, *, vocab: int, grads: bool):
    """One chunk's loss sums; with grads also the gradients of its nll sum with respect to
    hidden (in hidden's dtype), weight and norm_params (float32). weight comes in the
    compute dtype, padded (_aligned_head, once, outside the chunk loop): columns from
    `vocab` on are padding, and so is the same part of the weight's gradient."""
    if norm is None:
        x, norm_vjp = hidden, None
    elif grads:
        x, norm_vjp = jax.vjp(norm, norm_params, hidden)
    else:
        x = norm(norm_params, hidden)
    logits = jnp.einsum("bsd,dv->bsv", x, weight, preferred_element_type=jnp.float32)
    vocab_ids = jax.lax.broadcasted_iota(targets.dtype, logits.shape, 2)
    if weight.shape[-1] != vocab:
        logits = jnp.where(vocab_ids < vocab, logits, -jnp.inf)
    sums, lse = _loss_sums(logits, targets, mask)
    if not grads:
        return sums
    dlogits = jnp.exp(logits - lse[..., None]) - (vocab_ids == targets[..., None])
    if mask is not None:
        dlogits = dlogits * mask.astype(jnp.float32)[..., None]
    dlogits = dlogits.astype(x.dtype)
    dw = jnp.einsum("bsd,bsv->dv", x, dlogits, preferred_element_type=jnp.float32)
    dx = jnp.einsum("bsv,dv->bsd", dlogits, weight, preferred_element_type=jnp.float32).astype(x.dtype)
    if norm_vjp is None:
        return sums, dx, dw, None
    dnorm, dh = norm_vjp(dx)
    return sums, dh, dw, jax.tree.map(lambda d: d.astype(jnp.float32), dnorm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked_loss_sums(chunking, norm, hidden, weight, norm_params, targets, mask):
    """[nll_sum, count, correct_sum] over the whole sequence, one chunk at a time; chunking is
    (chunk_size, shards, vocabulary size: the head's columns past it are masked out)."""
    w = _aligned_head(weight, hidden.dtype)
    chunking, vocab = chunking[:2], chunking[2]

    def step(_, chunk):
        h, t, m = chunk
        return None, _head_chunk(norm, h, w, norm_params, t, m, vocab=vocab, grads=False)

    chunks = jax.tree.map(lambda x: to_chunks(x, *chunking), (hidden, targets, mask))
    _, sums = jax.lax.scan(step, None, chunks)
    return sums.sum(axis=0)


def _chunked_loss_sums_fwd(chunking, norm, hidden, weight, norm_params, targets, mask):
    w = _aligned_head(weight, hidden.dtype)
    chunking, vocab = chunking[:2], chunking[2]

    def step(carry, chunk):
        dw, dnorm = carry
        h, t, m = chunk
        sums, dh, dw_c, dnorm_c = _head_chunk(norm, h, w, norm_params, t, m, vocab=vocab, grads=True)
        return (dw + dw_c, jax.tree.map(jnp.add, dnorm, dnorm_c)), (sums, dh)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), (w, norm_params))
    chunks = jax.tree.map(lambda x: to_chunks(x, *chunking), (hidden, targets, mask))
    (dw, dnorm), (sums, dh) = jax.lax.scan(step, zeros, chunks)
    dw = dw[:, : weight.shape[-1]]
    dtypes = jax.tree.map(lambda p: jnp.zeros((0,), p.dtype), (weight, norm_params))  # empty: only dtypes
    return sums.sum(axis=0), (from_chunks(dh, chunking[1]), dw, dnorm, dtypes)


def _chunked_loss_sums_bwd(chunking, norm, residuals, cotangent):
    dh, dw, dnorm, (weight_dtype, norm_dtypes) = residuals
    g = cotangent[0]  # only the nll sum has a gradient; the count and the hits have none
    scale = lambda d, like: (g * d.astype(jnp.float32)).astype(like.dtype)  # noqa: E731
    return (
        scale(dh, dh),
        scale(dw, weight_dtype),
        jax.tree.map(scale, dnorm, norm_dtypes),
        None,
        None,
    )


_chunked_loss_sums.defvjp(_chunked_loss_sums_fwd, _chunked_loss_sums_bwd)
