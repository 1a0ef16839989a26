"""LayerNorm as two Pallas kernels: one pass forward, one pass backward.

XLA runs a LayerNorm of GPT-1B's 8K step as three Triton passes a norm (its forward, the
forward again where remat recomputes it, its backward) at about 1.8 TB/s on an H200, and
its backward writes dy * xhat in float32 to sum it over the rows in a second pass: 17.7 ms of
that step's kernels more than the same model with RMSNorm (docs/notes/step_speed.md,
2026-12-01). These kernels read each row once a pass:

- forward: a program normalizes `block_rows` rows of x [rows, d] in float32, writes y and
  each row's mean and 1/std;
- backward: a program walks `steps` blocks of rows, writes dx from x, dy and the row
  statistics, and keeps the column sums of dy * xhat and dy in registers; the programs'
  partial sums [programs, d] are added in XLA (4 MiB each at GPT-1B's 8K step).

With a residual (a transformer layer's h = x + residual, then the norm of h) the forward
adds it in the same pass and writes h too, and the backward adds the gradient h receives
past the norm (the residual stream's) to dx: the add and that sum, otherwise two more passes
over the rows, cost no pass of their own.

The feature size d must be a power of two (Triton's blocks) and the rows a multiple of the
row block; `supported` says which inputs the kernels take. On a GPU they lower through
Triton; elsewhere they run in Pallas interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

Array = jax.Array
ROW_ELEMENTS = 8192  # elements of x a program holds at once (block_rows x d)
MAX_BLOCK_ROWS = 16
# Row blocks a backward program walks at most: its column sums stay in registers over them,
# and the programs' partial sums [programs, d] go through memory (fewer steps: more programs
# running at once, more partial sums). Untuned: scripts/bench_norm.py sweeps them.
MAX_STEPS = 16
BACKWARD_STAGES = 2  # Triton's pipelining of the backward's loop over row blocks


def block_rows(d: int) -> int:
    """Rows a program normalizes at once: ROW_ELEMENTS // d, from 1 to MAX_BLOCK_ROWS."""
    return min(MAX_BLOCK_ROWS, max(1, ROW_ELEMENTS // d))


def supported(x: Array, rows_per_block: int | None = None) -> str | None:
    """Why the kernels cannot take x [..., d] (None: they can)."""
    d = x.shape[-1]
    if d < 16 or d & (d - 1):
        return f"the feature size must be a power of two >= 16; got {d}"
    rows, br = x.size // d, rows_per_block or block_rows(d)
    if br < 1 or br & (br - 1):
        return f"the row block must be a power of two; got {br}"
    if rows % br:
        return f"the rows ({rows}) must be a multiple of {br} (the row block for d={d})"
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        return f"x must be float32, bfloat16 or float16; got {x.dtype}"
    return None


def _check(x: Array, rows_per_block: int | None) -> None:
    problem = supported(x, rows_per_block)
    if problem:
        raise ValueError(f"the LayerNorm kernels cannot take x {x.shape} {x.dtype}: {problem}")


def _call(interpret: bool | None, num_warps: int, num_stages: int = 1):
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return functools.partial(pl.pallas_call, compiler_params=params, interpret=interpret)


def _forward_kernel(*refs, eps: float, add: bool):
    """One block of rows: y = LayerNorm(x), or with add h = x + residual and y = LayerNorm(h)."""
    if add:
        x_ref, r_ref, scale_ref, bias_ref, h_ref, y_ref, mean_ref, rstd_ref = refs
        h = (x_ref[...].astype(jnp.float32) + r_ref[...].astype(jnp.float32)).astype(h_ref.dtype)
        h_ref[...] = h  # rounded as XLA rounds x + residual, then normalized from there
        x = h.astype(jnp.float32)
    else:
        x_ref, scale_ref, bias_ref, y_ref, mean_ref, rstd_ref = refs
        x = x_ref[...].astype(jnp.float32)
    inv_d = 1.0 / x.shape[1]
    mean = jnp.sum(x, axis=1) * inv_d
    centered = x - mean[:, None]
    rstd = lax.rsqrt(jnp.sum(centered * centered, axis=1) * inv_d + eps)
    scale = scale_ref[...].astype(jnp.float32)
    bias = bias_ref[...].astype(jnp.float32)
    y_ref[...] = (centered * rstd[:, None] * scale[None, :] + bias[None, :]).astype(y_ref.dtype)
    mean_ref[...] = mean
    rstd_ref[...] = rstd


def forward(
    x: Array,
    scale: Array,
    bias: Array,
    eps: float,
    *,
    residual: Array | None = None,
    rows_per_block: int | None = None,
    num_warps: int = 4,
    interpret: bool | None = None,
) -> tuple[Array, ...]:
    """(y, mean, rstd): the LayerNorm of x [..., d] over its last axis in float32, y in x's
    dtype, the rows' mean and 1/std [...] in float32. With residual (x's shape and dtype):
    (h, y, mean, rstd), h = x + residual and y its LayerNorm, in one pass (a transformer
    layer's residual add and the norm after it). rows_per_block: rows a program (default
    block_rows(d))."""
    _check(x, rows_per_block)
    add = residual is not None
    if add and (residual.shape, residual.dtype) != (x.shape, x.dtype):
        got = f"{residual.shape} {residual.dtype}"
        raise ValueError(f"residual must have x's shape and dtype {x.shape} {x.dtype}; got {got}")
    d = x.shape[-1]
    rows, br = x.size // d, rows_per_block or block_rows(d)
    whole = pl.BlockSpec((d,), lambda i: (0,))
    block = pl.BlockSpec((br,), lambda i: (i,))
    rows_spec = pl.BlockSpec((br, d), lambda i: (i, 0))
    matrix = jax.ShapeDtypeStruct((rows, d), x.dtype)
    stats = jax.ShapeDtypeStruct((rows,), jnp.float32)
    inputs = (x, residual) if add else (x,)
    outs = _call(interpret, num_warps)(
        functools.partial(_forward_kernel, eps=eps, add=add),
        grid=(rows // br,),
        in_specs=[rows_spec] * len(inputs) + [whole, whole],
        out_specs=[rows_spec] * len(inputs) + [block, block],
        out_shape=[matrix] * len(inputs) + [stats, stats],
        name="bpt_add_layer_norm_fwd" if add else "bpt_layer_norm_fwd",
    )(*(a.reshape(rows, d) for a in inputs), scale, bias)
    lead = x.shape[:-1]
    return (*(a.reshape(x.shape) for a in outs[:-2]), *(t.reshape(lead) for t in outs[-2:]))


def _backward_kernel(*refs, steps: int, add: bool):
    if add:
        x_ref, dy_ref, dr_ref, mean_ref, rstd_ref, scale_ref, dx_ref, dscale_ref, dbias_ref = refs
    else:
        x_ref, dy_ref, mean_ref, rstd_ref, scale_ref, dx_ref, dscale_ref, dbias_ref = refs
    br, d = x_ref.shape[0] // steps, x_ref.shape[1]
    inv_d = 1.0 / d
    scale = scale_ref[...].astype(jnp.float32)

    def step(j, sums):
        dscale, dbias = sums
        rows = pl.ds(j * br, br)
        x = x_ref[rows, :].astype(jnp.float32)
        dy = dy_ref[rows, :].astype(jnp.float32)
        rstd = rstd_ref[rows]
        xhat = (x - mean_ref[rows][:, None]) * rstd[:, None]
        g = dy * scale[None, :]
        mean_g = jnp.sum(g, axis=1) * inv_d
        mean_gx = jnp.sum(g * xhat, axis=1) * inv_d
        dx = rstd[:, None] * (g - mean_g[:, None] - xhat * mean_gx[:, None])
        if add:  # the gradient that reaches x past the norm (the residual stream's)
            dx = dx + dr_ref[rows, :].astype(jnp.float32)
        dx_ref[rows, :] = dx.astype(dx_ref.dtype)
        return dscale + jnp.sum(dy * xhat, axis=0), dbias + jnp.sum(dy, axis=0)

    zeros = jnp.zeros((d,), jnp.float32)
    dscale, dbias = lax.fori_loop(0, steps, step, (zeros, zeros))
    dscale_ref[...] = dscale
    dbias_ref[...] = dbias


def backward_steps(blocks: int, max_steps: int = MAX_STEPS) -> int:
    """Row blocks a backward program walks: max_steps (a power of two), halved until they
    divide the blocks."""
    steps = max_steps
    while blocks % steps:
        steps //= 2
    return steps


def backward(
    x: Array,
    dy: Array,
    mean: Array,
    rstd: Array,
    scale: Array,
    *,
    dresidual: Array | None = None,
    rows_per_block: int | None = None,
    max_steps: int = MAX_STEPS,
    num_warps: int = 4,
    num_stages: int = BACKWARD_STAGES,
    interpret: bool | None = None,
) -> tuple[Array, Array, Array]:
    """(dx, dscale, dbias) of the LayerNorm whose forward gave mean and rstd [...] for x
    [..., d], dy its output's gradient: dx in x's dtype, the others float32 [d]. dresidual
    (x's shape): a gradient of x from elsewhere, added to dx in the same pass (the residual
    stream's, past an add_layer_norm). A program walks up to max_steps blocks of
    rows_per_block rows (num_stages: Triton's pipelining of that loop's loads)."""
    _check(x, rows_per_block)
    add = dresidual is not None
    if add and dresidual.shape != x.shape:
        raise ValueError(f"dresidual must have x's shape {x.shape}; got {dresidual.shape}")
    if max_steps < 1 or max_steps & (max_steps - 1):
        raise ValueError(f"max_steps must be a power of two; got {max_steps}")
    d = x.shape[-1]
    rows, br = x.size // d, rows_per_block or block_rows(d)
    steps = backward_steps(rows // br, max_steps)
    span = br * steps  # the rows of one program
    programs = rows // span
    rows_spec = pl.BlockSpec((span, d), lambda i: (i, 0))
    stat_spec = pl.BlockSpec((span,), lambda i: (i,))
    sums_spec = pl.BlockSpec((None, d), lambda i: (i, 0))
    matrices = (x, dy, dresidual) if add else (x, dy)
    dx, dscale, dbias = _call(interpret, num_warps, num_stages)(
        functools.partial(_backward_kernel, steps=steps, add=add),
        grid=(programs,),
        in_specs=[rows_spec] * len(matrices) + [stat_spec, stat_spec, pl.BlockSpec((d,), lambda i: (0,))],
        out_specs=[rows_spec, sums_spec, sums_spec],
        out_shape=[
            jax.ShapeDtypeStruct((rows, d), x.dtype),
            jax.ShapeDtypeStruct((programs, d), jnp.float32),
            jax.ShapeDtypeStruct((programs, d), jnp.float32),
        ],
        name="bpt_add_layer_norm_bwd" if add else "bpt_layer_norm_bwd",
    )(*(a.reshape(rows, d) for a in matrices), mean.reshape(rows), rstd.reshape(rows), scale)
    return dx.reshape(x.shape), dscale.sum(axis=0), dbias.sum(axis=0)
