"""Position-wise work done chunk by chunk: the blockwise FFN and the blockwise LM loss.

A chunk loop is a lax.scan over the sequence axis (axis 1) with the body under jax.checkpoint,
so only one chunk's intermediates (an FFN's [chunk, 4 * d_model] hidden layer, an LM head's
[chunk, vocab] logits) are alive at a time, in the forward and in the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import einops
import jax
import jax.numpy as jnp

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


def to_chunks(x: Array, chunk_size: int) -> Array:
    """[batch, seq, ...] -> [seq // chunk_size, batch, chunk_size, ...]."""
    return einops.rearrange(x, "b (n c) ... -> n b c ...", c=chunk_size)


def from_chunks(x: Array) -> Array:
    """[num_chunks, batch, chunk, ...] -> [batch, num_chunks * chunk, ...]."""
    return einops.rearrange(x, "n b c ... -> b (n c) ...")


def scan_chunks(
    fn: Callable[[Array, PyTree], PyTree],
    xs: PyTree,
    *,
    chunk_size: int,
    policy: str = "nothing_saveable",
    name: str = "chunk_size",
) -> PyTree:
    """Runs fn(chunk_index, xs_chunk) for every chunk of the sequence axis; stacks the results.

    Every leaf of xs is [batch, seq, ...] with the same seq. fn's outputs come back stacked
    along a new leading axis of length seq // chunk_size. The body is rematerialized with
    the named checkpoint policy (see bpt.ops.remat).
    """
    leaves = jax.tree.leaves(xs)
    length = leaves[0].shape[1]
    if any(leaf.shape[1] != length for leaf in leaves):
        raise ValueError(f"all inputs must share the sequence length {length}")
    chunk_size = resolve_chunk_size(chunk_size, length, name)
    body = remat(fn, policy, prevent_cse=False)

    def step(carry, inputs):
        index, chunk = inputs
        return carry, body(index, chunk)

    chunks = jax.tree.map(lambda x: to_chunks(x, chunk_size), xs)
    _, ys = jax.lax.scan(step, None, (jnp.arange(length // chunk_size), chunks))
    return ys


def blockwise_ffn(
    fn: Callable[[PyTree], PyTree], x: PyTree, *, chunk_size: int, policy: str = "nothing_saveable"
) -> PyTree:
    """Applies a position-wise function chunk by chunk along the sequence axis.

    Args:
      fn: maps a [batch, chunk, ...] pytree to a [batch, chunk, ...] pytree; it must not mix
        positions (an FFN, a layer norm, a residual add).
      x: a [batch, seq, ...] array or pytree of such arrays.
      chunk_size: positions per chunk; must divide seq (a larger value is clamped to seq).
      policy: checkpoint policy of each chunk, a name from bpt.ops.remat.POLICIES.
    Returns:
      fn(x), computed with one chunk's intermediates alive at a time.
    """
    ys = scan_chunks(lambda _, chunk: fn(chunk), x, chunk_size=chunk_size, policy=policy)
    return jax.tree.map(from_chunks, ys)


class CrossEntropy(NamedTuple):
    """Token-level language-model loss; a pytree, so it passes through jit and grad aux."""

    loss: Array  # mean negative log-likelihood over the counted tokens (float32)
    num_tokens: Array  # how many tokens were counted (float32)
    accuracy: Array  # fraction of counted tokens whose argmax prediction is the target


def _loss_sums(logits: Array, targets: Array, mask: Array | None) -> Array:
    """[nll_sum, count, correct_sum] over a [batch, seq, vocab] block of float32 logits."""
    nll = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    weight = jnp.ones_like(nll) if mask is None else mask.astype(jnp.float32)
    return jnp.stack([(nll * weight).sum(), weight.sum(), (correct * weight).sum()])


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
    return _finish(_loss_sums(logits.astype(jnp.float32), targets, mask))


def blockwise_cross_entropy(
    hidden: Array,
    weight: Array,
    targets: Array,
    *,
    chunk_size: int,
    mask: Array | None = None,
    policy: str = "nothing_saveable",
    norm: Callable[[Array], Array] | None = None,
) -> CrossEntropy:
    """LM head matmul and cross-entropy per chunk; [seq, vocab] logits never exist at once.

    Args:
      hidden: [batch, seq, d_model] final hidden states.
      weight: [d_model, vocab] output projection (the transposed embedding when tied).
      targets: [batch, seq] int token ids.
      chunk_size: positions per chunk; must divide seq (a larger value is clamped to seq).
      mask: optional [batch, seq] weights (1 counts a token, 0 ignores it).
      norm: an optional position-wise function applied to each chunk of hidden before the
        head (the final LayerNorm): its intermediates then exist one chunk at a time, and the
        backward recomputes them, instead of keeping a few [seq, d_model] float32 arrays.
    Returns:
      CrossEntropy(loss, num_tokens, accuracy), equal to
      cross_entropy(norm(hidden) @ weight, ...).
    """
    _check_targets(targets, mask, hidden.shape[:2])
    weight = weight.astype(hidden.dtype)

    def chunk_sums(_, chunk):
        h, t, m = chunk
        if norm is not None:
            h = norm(h)
        logits = jnp.einsum("bsd,dv->bsv", h, weight, preferred_element_type=jnp.float32)
        return _loss_sums(logits, t, m)

    sums = scan_chunks(chunk_sums, (hidden, targets, mask), chunk_size=chunk_size, policy=policy)
    return _finish(sums.sum(axis=0))
