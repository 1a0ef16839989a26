"""The jit-ed training and evaluation steps: pure functions of (state, batch, rng)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState

from bpt.ops.chunked import Loss
from bpt.train.metrics import keys_seen
from bpt.train.optimizer import skipped_steps


def _loss(apply_fn: Callable, params, batch: dict, rng, deterministic: bool) -> Loss:
    return apply_fn(
        {"params": params},
        batch["tokens"],
        targets=batch["targets"],
        loss_mask=batch.get("loss_mask"),
        segment_ids=batch.get("segment_ids"),
        deterministic=deterministic,
        rngs=None if deterministic else {"dropout": rng},
    )


def make_train_step(
    grad_accum_steps: int, *, batch_sharding=None, unroll: bool = False
) -> Callable[[TrainState, dict, Any], tuple[TrainState, dict]]:
    """A step that splits the batch into grad_accum_steps micro-batches and applies one update.

    Gradients are summed token-weighted, so the update equals the one a single batch of the
    whole size would give: grad(sum of token losses) / number of tokens.

    A step whose loss or gradient is not finite keeps the parameters and the optimizer's
    moments as they were (the step counter still advances, so the data position and the
    checkpoint's step stay in line); metrics["finite"] says what happened and
    metrics["skipped_steps"] counts such steps over the whole run (it lives in the optimizer
    state). Whether the run then stops is the loop's call (train.skip_nonfinite).

    batch_sharding: the NamedSharding of the [batch, seq] inputs on a mesh. Micro-batch m takes
    rows m, m + grad_accum_steps, ...: the split keeps the (sharded) batch axis whole on every
    device instead of moving the accumulation index onto it.

    unroll: the micro-batch loop unrolled (train.grad_accum_unroll), each micro-batch its own
    copy of the model in the program. XLA then sees the whole sum: the first micro-batch's
    gradient starts it (no zero-filled accumulator copied into a loop), the micro-batches'
    rows are static slices, and the last add can fuse with the optimizer's update. The
    program, and its compile time, grow with grad_accum_steps.
    """

    def train_step(state: TrainState, batch: dict, rng) -> tuple[TrainState, dict]:
        micro = jax.tree.map(lambda x: x.reshape(-1, grad_accum_steps, *x.shape[1:]).swapaxes(0, 1), batch)
        if batch_sharding is not None:
            spec = jax.sharding.PartitionSpec(None, *batch_sharding.spec)
            micro = jax.lax.with_sharding_constraint(
                micro, jax.sharding.NamedSharding(batch_sharding.mesh, spec)
            )

        def summed_loss(params, mb, mb_rng):
            out = _loss(state.apply_fn, params, mb, mb_rng, deterministic=False)
            return out.loss * jax.lax.stop_gradient(out.num_tokens), out

        def accumulate(carry, inputs):
            grads, totals = carry
            index, mb = inputs
            (_, out), g = jax.value_and_grad(summed_loss, has_aux=True)(
                state.params, mb, jax.random.fold_in(rng, index)
            )
            sums = jnp.stack([out.loss * out.num_tokens, out.num_tokens, out.accuracy * out.num_tokens])
            return (jax.tree.map(jnp.add, grads, g), totals + sums), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        (grads, totals), _ = jax.lax.scan(
            accumulate,
            (zeros, jnp.zeros(3)),
            (jnp.arange(grad_accum_steps), micro),
            unroll=grad_accum_steps if unroll else 1,
        )
        tokens = jnp.maximum(totals[1], 1.0)
        loss = totals[0] / tokens
        # A non-finite loss poisons the gradient too, so the optimizer (make_optimizer's
        # skip_nonfinite_updates) skips the update and counts it in its state.
        grads = jax.tree.map(lambda g: jnp.where(jnp.isfinite(loss), g / tokens, jnp.nan), grads)
        new_state = state.apply_gradients(grads=grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        metrics = {
            "loss": loss,
            "accuracy": totals[2] / tokens,
            "grad_norm": grad_norm,
            "tokens": totals[1],
            "finite": finite,
            "skipped_steps": skipped_steps(new_state.opt_state),
        }
        if "segment_ids" in batch:  # packed documents: what attention's FLOPs count (Reporter)
            metrics["keys_seen"] = keys_seen(batch["segment_ids"])
        return new_state, metrics

    return train_step


def eval_step(state: TrainState, batch: dict) -> jax.Array:
    """[nll_sum, token_count, correct_sum] of one batch, to be summed over batches."""
    out = _loss(state.apply_fn, state.params, batch, None, deterministic=True)
    return jnp.stack([out.loss * out.num_tokens, out.num_tokens, out.accuracy * out.num_tokens])
