"""AdamW with linear warmup, cosine decay, gradient clipping and decay on matrices only."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from ml_collections import ConfigDict

from bpt.config import check_state_dtype


def learning_rate_schedule(train: ConfigDict) -> optax.Schedule:
    warmup = min(train.warmup_steps, train.steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=train.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(train.steps, warmup + 1),
        end_value=train.learning_rate * train.min_lr_ratio,
    )


def decay_mask(params):
    """Weight decay on weight matrices, not on biases and LayerNorm parameters.

    Layers stacked by nn.scan (under the module name "layers") carry a leading layer axis,
    which does not count towards a parameter's rank.
    """

    def is_matrix(path, x):
        stacked = any(getattr(k, "key", None) == "layers" for k in path)
        return x.ndim - int(stacked) >= 2

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def with_state_dtype(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """inner, with its floating-point state stored in dtype between steps (bf16 halves AdamW's
    two moments). Each update computes in float32: the state is widened, updated, narrowed."""

    def cast(tree, to):
        return jax.tree.map(lambda x: x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def init(params):
        return cast(inner.init(params), dtype)

    def update(updates, state, params=None):
        updates, state = inner.update(updates, cast(state, jnp.float32), params)
        return updates, cast(state, dtype)

    return optax.GradientTransformation(init, update)


def make_optimizer(train: ConfigDict) -> optax.GradientTransformation:
    check_state_dtype(train)
    optimizer = optax.chain(
        optax.clip_by_global_norm(train.grad_clip),
        optax.adamw(
            learning_rate_schedule(train),
            b1=train.b1,
            b2=train.b2,
            eps=train.eps,
            weight_decay=train.weight_decay,
            mask=decay_mask,
        ),
    )
    # An update whose gradient holds NaN or inf is skipped and counted in the state (so the
    # count survives a resume); whether the run stops at one is train.skip_nonfinite's call
    # (bpt.train.loop). The state has this shape either way: a run stopped by a NaN resumes
    # with skip_nonfinite=True from its last checkpoint.
    optimizer = skip_nonfinite_updates(optimizer)
    if train.optimizer_state_dtype == "float32":
        return optimizer
    return with_state_dtype(optimizer, jnp.dtype(train.optimizer_state_dtype))


class SkipState(NamedTuple):
    skipped_steps: jax.Array  # int32: updates skipped so far
    inner_state: Any


def skip_nonfinite_updates(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """inner, except that a gradient holding NaN or inf leaves inner's state as it was, gives
    zero updates, and adds one to the skipped_steps count. (optax.apply_if_finite does the
    same through lax.cond, whose branches must agree in dtype: they do not when parameters
    are bf16 and the updates float32.)"""

    def init(params):
        return SkipState(jnp.zeros([], jnp.int32), inner.init(params))

    def update(updates, state, params=None):
        # The global norm is finite exactly when every entry is (barring overflow); it is the
        # reduction clip_by_global_norm and the step's grad_norm compute too, so XLA does it once.
        finite = jnp.isfinite(optax.tree.norm(updates))
        new_updates, new_inner = inner.update(updates, state.inner_state, params)
        inner_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_inner, state.inner_state)
        new_updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), new_updates)
        return new_updates, SkipState(state.skipped_steps + (~finite).astype(jnp.int32), inner_state)

    return optax.GradientTransformation(init, update)


def skipped_steps(opt_state) -> jax.Array:
    """How many updates make_optimizer's state has skipped for a non-finite gradient."""
    found = [
        s.skipped_steps
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, SkipState))
        if isinstance(s, SkipState)
    ]
    if len(found) != 1:
        raise ValueError("the optimizer state holds no skipped-step count (not made by make_optimizer)")
    return found[0]
