"""Rematerialization (gradient checkpointing) policies by the names the BPT paper uses, and
bpt's own that keep attention's results."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax
from jax.ad_checkpoint import checkpoint_name

Array = jax.Array

# The checkpoint names bpt's attention forwards give the results their backward needs (the
# Pallas kernels' and the blockwise scan's custom_vjp residuals).
ATTENTION_OUT = "attention_out"
ATTENTION_LSE = "attention_lse"
# What else an attention forward computed for its backward, where that is more than the
# output and logsumexp (FLASH's relu^2 weights and the [values ; states] it multiplied).
ATTENTION_RESIDUAL = "attention_residual"
ATTENTION_NAMES = (ATTENTION_OUT, ATTENTION_LSE, ATTENTION_RESIDUAL)
# Attention's inputs as the layer hands them over: the projections with their biases added
# and the rotary positions applied (bpt.models.gpt). Where the projections' outputs are kept
# anyway (attention_and_dots_saveable) keeping these instead costs no memory (the same
# shapes, in place of the three matmul outputs) and spares the backward the recomputed bias
# adds and rotations.
ATTENTION_INPUTS = "attention_inputs"
# What bpt's LayerNorm kernels return and their backward reads (the norm's output and row
# statistics, and with the residual add its sum): kept by attention_dots_and_norms_saveable,
# so that the backward does not run the norms' forward kernels again (bpt.models.lm).
NORM_RESULTS = "norm_results"


def kept_results(values: tuple[Array, ...], names: tuple[str, ...]) -> tuple[Array, ...]:
    """values, each under its checkpoint name (names[i]), all behind one optimization barrier:
    what a kernel's forward hands a remat policy to keep.

    The barrier keeps XLA's GPU compiler from launching the kernel twice. Where a layer scan
    stacks a kernel's results for the backward, XLA's dynamic-slice fusion clones the launch:
    one copy feeds the layer's next op, the other writes straight into the stack. GPT-1B's 32K
    step on bpt's attention kernels ran its forward twice so, 24% of the step's kernel time
    (docs/notes/step_speed.md). The barrier is no operation at run time."""
    return tuple(checkpoint_name(x, name) for x, name in zip(lax.optimization_barrier(tuple(values)), names))


def _attention_saveable(prim, *_, **params) -> bool:
    if prim.name == "name":  # a checkpoint_name
        return params.get("name") in ATTENTION_NAMES
    # cuDNN's fused attention (jax.nn.dot_product_attention) is a primitive whose outputs are
    # its output and softmax statistics (dot_product_attention_fwd_wrapper, and its fp8 twin):
    # keeping them keeps its backward from re-running its forward.
    return prim.name.startswith("dot_product_attention") and "_fwd" in prim.name


def _attention_and(*names: str) -> Callable:
    """_attention_saveable, and the values under these checkpoint names."""

    def policy(prim, *args, **params) -> bool:
        if prim.name == "name" and params.get("name") in names:
            return True
        return _attention_saveable(prim, *args, **params)

    return policy


POLICIES: dict[str, Callable | None] = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    # Attention's output and logsumexp are kept (its kernels' or the blockwise scan's, or
    # cuDNN's output and statistics): the backward recomputes the projections around it but
    # never the attention forward. Per token and layer: the output (d_model in the compute
    # dtype) and 4 bytes a head.
    "attention_saveable": _attention_saveable,
    # That, and the outputs of the weight matmuls (the projections and the FFN's), the
    # query, key and value projections as attention takes them (ATTENTION_INPUTS).
    "attention_and_dots_saveable": jax.checkpoint_policies.save_from_both_policies(
        _attention_and(ATTENTION_INPUTS), jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    ),
    # That, and what bpt's LayerNorm kernels computed (NORM_RESULTS): per token and layer two
    # rows of d_model more (ln1's output; ln2's output and the residual sum before it) and
    # four numbers, where the kernels run.
    "attention_dots_and_norms_saveable": jax.checkpoint_policies.save_from_both_policies(
        _attention_and(ATTENTION_INPUTS, NORM_RESULTS), jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    ),
    # No checkpoint at all: JAX's autodiff keeps what it needs.
    "none": None,
}


def check_policy(name: str, setting: str = "policy") -> str:
    if name not in POLICIES:
        raise ValueError(f"unknown {setting} {name!r}; allowed: {', '.join(POLICIES)}")
    return name


def remat(fn: Callable, policy: str, *, prevent_cse: bool = True) -> Callable:
    """Wraps fn in jax.checkpoint with the named policy ('none' returns fn unchanged).

    prevent_cse may be False inside a scan body, where XLA cannot merge the recomputation
    with the forward pass anyway.
    """
    check_policy(policy)
    if policy == "none":
        return fn
    return jax.checkpoint(fn, policy=POLICIES[policy], prevent_cse=prevent_cse)
