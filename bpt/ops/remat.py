"""Rematerialization (gradient checkpointing) policies by the names the BPT paper uses."""

from __future__ import annotations

from collections.abc import Callable

import jax

POLICIES: dict[str, Callable | None] = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
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
