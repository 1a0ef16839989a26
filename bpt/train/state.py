"""The train state (parameters + AdamW state) and where each of its arrays lives on the mesh.

Parameters are created boxed with their logical axis names (nn.with_logical_partitioning);
the names give each array its NamedSharding (bpt.parallel.PARAM_RULES), AdamW's moments take
their parameter's, and the state is created inside jit with those shardings as outputs, so
no device ever holds a whole sharded array. The state itself is stored unboxed.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.training.train_state import TrainState
from ml_collections import ConfigDict

from bpt.config import check_mesh
from bpt.models.lm import CausalLM
from bpt.parallel.mesh import Parallelism, like_params, make_mesh, param_shardings
from bpt.train.optimizer import make_optimizer
from bpt.train.step import eval_step, make_train_step


def make_parallelism(config: ConfigDict, devices=None) -> Parallelism | None:
    """The mesh config.mesh describes over `devices` (default: all, over all hosts); None when
    that is one device (everything then runs as it always has on one)."""
    m = config.mesh
    mesh = make_mesh(data=m.data, fsdp=m.fsdp, tensor=m.tensor, sequence=m.sequence, devices=devices)
    check_mesh(config, dict(mesh.shape))
    if mesh.size == 1:
        return None
    return Parallelism(
        mesh,
        context_parallel=m.context_parallel,
        load_balance=m.load_balance,
        head_groups=m.get("context_head_groups", 0) or "auto",
    )


def _boxed_params(model: CausalLM, rng):
    # One token is enough: parameters depend on the shapes in the config, not on the input's
    # length, and a long dummy sequence would cost a whole forward pass at initialization.
    return model.clone(parallel=None).init(rng, model.example_inputs())["params"]


def state_initializer(config: ConfigDict, model: CausalLM):
    """rng -> initial parameters and optimizer state, to be jit-ed (no host round trip). Every
    state it makes shares one optimizer object, so one compiled step takes them all."""
    tx = make_optimizer(config.train)

    def init(rng) -> TrainState:
        params = nn.meta.unbox(_boxed_params(model, rng))
        state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
        # A strong int32 step (create's is weakly typed), as a restored checkpoint's is: a
        # resumed state then has the fresh one's types, and the step compiled for one runs the other.
        return state.replace(step=jnp.zeros((), jnp.int32))

    return init


def state_shardings(config: ConfigDict, model: CausalLM, parallel: Parallelism, init=None):
    """A TrainState of NamedShardings: parameters by their logical names, AdamW's moments like
    their parameters, the step count replicated."""
    init = init or state_initializer(config, model)
    rng = jax.random.PRNGKey(0)
    params = param_shardings(jax.eval_shape(lambda r: _boxed_params(model, r), rng), parallel.mesh)
    abstract = jax.eval_shape(init, rng)
    return abstract.replace(
        step=parallel.replicated(),
        params=params,
        opt_state=like_params(abstract.opt_state, abstract.params, params, parallel.mesh),
    )


def jit_initializer(config: ConfigDict, model: CausalLM):
    """(init, shardings): init is rng -> the initial TrainState, jit-ed to create it already
    laid out on model's mesh (on one device, committed to it); shardings is that layout (a
    TrainState of NamedShardings), or None on one device."""
    init = state_initializer(config, model)
    if model.parallel is None:
        # Committed to the device, as a restored checkpoint's arrays are (same trace of the step).
        return jax.jit(init, out_shardings=jax.sharding.SingleDeviceSharding(jax.devices()[0])), None
    shardings = state_shardings(config, model, model.parallel, init)
    return jax.jit(init, out_shardings=shardings), shardings


def create_state(config: ConfigDict, model: CausalLM, rng) -> TrainState:
    """Initial parameters and optimizer state, built inside jit (sharded on the model's mesh if any)."""
    return jit_initializer(config, model)[0](rng)


def jit_steps(config: ConfigDict, model: CausalLM, shardings):
    """(train_step, eval_step, batch_sharding), jit-ed with the state's shardings (from
    jit_initializer) and the batch's on the model's mesh (batch_sharding None on one device)."""
    tc, parallel = config.train, model.parallel
    batch = None if parallel is None else parallel.activations()
    train_step = make_train_step(tc.grad_accum_steps, batch_sharding=batch, unroll=tc.grad_accum_unroll)
    if parallel is None:
        return jax.jit(train_step, donate_argnums=0), jax.jit(eval_step), None
    replicated = parallel.replicated()
    return (
        jax.jit(
            train_step,
            in_shardings=(shardings, batch, replicated),
            out_shardings=(shardings, replicated),
            donate_argnums=0,
        ),
        jax.jit(eval_step, in_shardings=(shardings, batch), out_shardings=replicated),
        batch,
    )
