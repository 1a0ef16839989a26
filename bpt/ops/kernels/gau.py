"""Pallas kernels for FLASH's mixed chunk attention (bpt.ops.gau): the linear part's states,
and the quadratic part.

The states: per sequence, the float32 sum of lk_j v_j^T over the chunks before each chunk
(and, for the backward, the sum of the states' gradients over the chunks after each one),
one program per (sequence, value tile) walking the chunks in order with the sum in
registers: the inputs are read once and the states written once in the inputs' dtype,
inside the operand of the matmul that follows ([v ; state], [d_out ; later sums]), so
that nothing is concatenated after. XLA's chunk sums and cumulative sum wrote and re-read
float32 states several times (the states are as large as the values themselves: s e / G
numbers a token).

The quadratic part (optional, GAUKernelConfig.quadratic):

Per chunk of G tokens, with W = relu(q k^T * quad_scale + bias)^2 masked to the causal
triangle (and to documents), lq the linear queries (scaled, masked to the chunk's first
document) and S the linear state entering the chunk (from the states' kernel, or from
XLA with segment ids or an initial state; in the inputs' dtype):

    forward    out = W v + lq S                                  [G, e]
    backward   dW = dout v^T, d(lq) = dout S^T  (contractions over e), then
               d(scores) = 2 r dW, dq = d(scores) q-scaled k;
               the kernel also writes x = [W | lq] and d(scores) so that XLA finishes with
               dense batched GEMMs: [dv ; dS] = x^T dout, dk = d(scores)^T q.

relu^2 needs no running maximum: W of a query block is computed once, kept in registers,
and reused over the tiles of the wide value dimension e (2 x d_model in FLASH), so no
[G, G] or [G, G + s] tensor goes through memory in the forward, and nothing is
concatenated. One program per (chunk, query block) (one per (chunk, value tile), which
recomputes W for each tile, measured 1.5x slower); causal: a query block reads only the
keys up to its own last one (rounded up to a power of two, as Triton's tiles need). At FLASH-125M's sizes XLA's
batched GEMMs do this part as fast (docs/notes/flash.md), so it is off by default.

On GPUs the kernels lower through Triton; elsewhere they run in Pallas interpret mode (for
tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

Array = jax.Array
MIN_TILE = 16  # the smallest M, N and K of a Triton dot


@dataclasses.dataclass(frozen=True)
class GAUKernelConfig:
    """Static settings of one call (hashable: part of a custom_vjp's static argument)."""

    chunk: int  # G
    quad_scale: float
    lin_scale: float
    block_q: int = 64
    block_e: int = 128
    # The linear states' tile of the value width (programs: sequences x e / state_block_e).
    state_block_e: int = 64
    # The rows of a chunk the states' kernels load and multiply at once: chunks longer than
    # this go in pieces (a whole chunk of 512 bf16 keys and values asked 336 KiB of shared
    # memory, above an H100's 227).
    state_rows: int = 256
    state_warps: int = 8
    # The quadratic part in these kernels too (False: XLA's, around the states from these).
    # Off by default: on an H100 at FLASH-125M's sizes its forward ties XLA's and its
    # backward is slower (docs/notes/flash.md); the states' kernels are what gains.
    quadratic: bool = False
    num_warps: int = 4
    num_stages: int = 2
    interpret: bool = False

    @classmethod
    def for_dtype(cls, dtype, **fields) -> GAUKernelConfig:
        """The defaults for inputs of this dtype, then `fields`: 4-byte tiles take twice the
        shared memory, so float32 gets narrower value tiles, the states' rows 128 at a time
        and no pipelining (an H100's 227 KiB hold one [256, 128] float32 tile of keys and
        little else)."""
        if jnp.dtype(dtype).itemsize >= 4:
            fields = {"block_e": 64, "state_block_e": 32, "state_rows": 128, "num_stages": 1, **fields}
        return cls(**fields)


def config_for(
    dtype, *, batch: int, chunk: int, value_dim: int, quad_scale: float, lin_scale: float, **options
) -> GAUKernelConfig:
    """The settings of one call on `batch` sequences of values `value_dim` wide: the dtype's
    defaults, the states' value tile by the number of sequences (a program per (sequence,
    tile): narrower tiles when few sequences would leave most of the GPU idle; 1 x 64K: 1.31x
    XLA with tiles of 32, 1.26x with 64; 8 x 8K: 64), interpret mode off a GPU, then
    `options` (GAUKernelConfig's fields); blocks are cut to the sizes and must divide them."""
    wide = batch * value_dim // 64 >= 96 and jnp.dtype(dtype).itemsize < 4
    options = {"interpret": jax.default_backend() != "gpu", "state_block_e": 64 if wide else 32, **options}
    cfg = GAUKernelConfig.for_dtype(dtype, chunk=chunk, quad_scale=quad_scale, lin_scale=lin_scale, **options)
    cfg = dataclasses.replace(
        cfg,
        block_q=min(cfg.block_q, chunk),
        block_e=min(cfg.block_e, value_dim),
        state_block_e=min(cfg.state_block_e, value_dim),
        state_rows=min(cfg.state_rows, chunk),
    )
    for name in ("block_e", "state_block_e"):
        if value_dim % getattr(cfg, name):
            raise ValueError(
                f"kernel_options: {name}={getattr(cfg, name)} does not divide the value width {value_dim}"
            )
    small = [n for n in ("block_q", "block_e", "state_block_e", "state_rows") if getattr(cfg, n) < MIN_TILE]
    if small and not cfg.interpret:
        raise ValueError(
            f"kernel_options: {', '.join(f'{n}={getattr(cfg, n)}' for n in small)} below {MIN_TILE}, the "
            "smallest tile Triton's dot takes on a GPU (smaller ones gave wrong bf16 results on an H100)"
        )
    if chunk % cfg.state_rows or cfg.state_rows & (cfg.state_rows - 1):
        raise ValueError(
            f"kernel_options: state_rows={cfg.state_rows} must be a power of two dividing chunk_size={chunk}"
        )
    return cfg


def unsupported_reason(chunk: int, qk_dim: int, value_dim: int, *, block_e: int = 128) -> str | None:
    """Why the kernels cannot take these sizes, or None. Triton's tiles are powers of two."""
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    if not pow2(chunk) or chunk < 16:
        return f"chunk_size={chunk} is not a power of two >= 16"
    if not pow2(qk_dim) or qk_dim < 16:
        return f"qk_dim={qk_dim} is not a power of two >= 16"
    if value_dim % min(block_e, value_dim) or not pow2(min(block_e, value_dim)) or value_dim < 16:
        return f"the value width {value_dim} is not a multiple of a power-of-two tile >= 16"
    return None


def _dot(a: Array, b: Array, *, ta: bool = False, tb: bool = False) -> Array:
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _pieces(start: int, stop: int) -> list[tuple[int, int]]:
    """[(offset, size)] covering [start, stop) with power-of-two sizes (Triton's tiles)."""
    out = []
    while start < stop:
        size = 1 << ((stop - start).bit_length() - 1)
        out.append((start, size))
        start += size
    return out


def _block_scores(cfg: GAUKernelConfig, qb: int, q, k, bias_ref, seg_ref):
    """relu(scores) [bq, keys] of query block qb (static) over the chunk's first `keys` keys,
    zero where masked (causal inside the chunk, other documents); and the linear part's row
    mask (the queries in the document the chunk starts in), or None."""
    bq, keys = q.shape[0], k.shape[0]
    scores = _dot(q, k, tb=True) * cfg.quad_scale
    if bias_ref is not None:
        scores = scores + bias_ref[pl.ds(qb * bq, bq), pl.ds(0, keys)].astype(jnp.float32)
    q_pos = qb * bq + lax.broadcasted_iota(jnp.int32, (bq, keys), 0)
    k_pos = lax.broadcasted_iota(jnp.int32, (bq, keys), 1)
    visible = q_pos >= k_pos
    lin_rows = None
    if seg_ref is not None:
        q_seg = seg_ref[pl.ds(qb * bq, bq)]
        visible = visible & (q_seg[:, None] == seg_ref[pl.ds(0, keys)][None, :])
        lin_rows = q_seg == seg_ref[pl.ds(0, 1)]
    return jnp.where(visible, jnp.maximum(scores, 0.0), 0.0), lin_rows


def _linear_queries(cfg: GAUKernelConfig, lq, lin_rows, dtype):
    lq = lq.astype(jnp.float32) * cfg.lin_scale
    if lin_rows is not None:
        lq = jnp.where(lin_rows[:, None], lq, 0.0)
    return lq.astype(dtype)


def _split(refs, has_bias: bool, has_seg: bool):
    refs = list(refs)
    bias_ref = refs.pop(0) if has_bias else None
    seg_ref = refs.pop(0) if has_seg else None
    return bias_ref, seg_ref, refs


def _for_each_query_block(cfg: GAUKernelConfig, body) -> None:
    """body(qb) for this program's query block, with qb static (so are its key extents)."""
    i = pl.program_id(1)
    for qb in range(cfg.chunk // cfg.block_q):
        pl.when(i == qb)(functools.partial(body, qb))


def _keys_for(cfg: GAUKernelConfig, qb: int) -> int:
    return min(cfg.chunk, _pow2_at_least((qb + 1) * cfg.block_q))


# --- forward -------------------------------------------------------------------------------


def _fwd_kernel(cfg: GAUKernelConfig, has_bias, has_seg, q_ref, k_ref, lq_ref, v_ref, st_ref, *refs):
    bias_ref, seg_ref, (o_ref,) = _split(refs, has_bias, has_seg)
    e, te = v_ref.shape[-1], min(cfg.block_e, v_ref.shape[-1])

    def block(qb):
        keys = _keys_for(cfg, qb)
        r, lin_rows = _block_scores(cfg, qb, q_ref[...], k_ref[pl.ds(0, keys), :], bias_ref, seg_ref)
        w = (r * r).astype(v_ref.dtype)
        lq = _linear_queries(cfg, lq_ref[...], lin_rows, v_ref.dtype)

        def tile(j, carry):
            span = pl.ds(pl.multiple_of(j * te, te), te)
            acc = _dot(w, v_ref[pl.ds(0, keys), span]) + _dot(lq, st_ref[:, span])
            o_ref[:, span] = acc.astype(o_ref.dtype)
            return carry

        lax.fori_loop(0, e // te, tile, 0)

    _for_each_query_block(cfg, block)


def _compiler_params(cfg: GAUKernelConfig, warps: int | None = None):
    if cfg.interpret:
        return None
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=warps or cfg.num_warps, num_stages=cfg.num_stages)


def _specs(cfg: GAUKernelConfig, s: int, e: int, has_bias: bool, has_seg: bool):
    g, bq = cfg.chunk, cfg.block_q
    rows = lambda width: pl.BlockSpec((None, bq, width), lambda n, i: (n, i, 0))  # noqa: E731
    whole = lambda height, width: pl.BlockSpec((None, height, width), lambda n, i: (n, 0, 0))  # noqa: E731
    extra = []
    if has_bias:
        extra.append(pl.BlockSpec((g, g), lambda n, i: (0, 0)))
    if has_seg:
        extra.append(pl.BlockSpec((None, g), lambda n, i: (n, 0)))
    # q rows, k whole, lq rows, v whole, state whole [s, e]
    inputs = [rows(s), whole(g, s), rows(s), whole(g, e), whole(s, e), *extra]
    return inputs, rows


def forward(cfg: GAUKernelConfig, q, k, lq, v, state, bias=None, seg=None) -> Array:
    """q, k, lq [n, G, s]; v [n, G, e]; state [n, s, e] (the inputs' dtype); bias [G, G];
    seg [n, G] -> out [n, G, e] in v's dtype."""
    n, g, s = q.shape
    e = v.shape[-1]
    has_bias, has_seg = bias is not None, seg is not None
    extra = [x for x in (bias, seg) if x is not None]
    in_specs, rows = _specs(cfg, s, e, has_bias, has_seg)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg, has_bias, has_seg),
        grid=(n, g // cfg.block_q),
        in_specs=in_specs,
        out_specs=rows(e),
        out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
        compiler_params=_compiler_params(cfg),
        interpret=cfg.interpret,
        name="bpt_gau_fwd",
    )(q, k, lq, v, state, *extra)


# --- backward ------------------------------------------------------------------------------


def _bwd_kernel(cfg: GAUKernelConfig, has_bias, has_seg, q_ref, k_ref, lq_ref, v_ref, st_ref, *refs):
    bias_ref, seg_ref, (do_ref, dq_ref, dlq_ref, ds_ref, x_ref) = _split(refs, has_bias, has_seg)
    g, s = cfg.chunk, q_ref.shape[-1]
    e, te = v_ref.shape[-1], min(cfg.block_e, v_ref.shape[-1])
    dtype = v_ref.dtype

    def block(qb):
        keys = _keys_for(cfg, qb)
        bq = cfg.block_q

        def tile(j, carry):
            d_w, d_lq = carry
            span = pl.ds(pl.multiple_of(j * te, te), te)
            do = do_ref[:, span]
            d_w = d_w + _dot(do, v_ref[pl.ds(0, keys), span], tb=True)
            d_lq = d_lq + _dot(do, st_ref[:, span], tb=True)
            return d_w, d_lq

        zeros = (jnp.zeros((bq, keys), jnp.float32), jnp.zeros((bq, s), jnp.float32))
        d_w, d_lq = lax.fori_loop(0, e // te, tile, zeros)
        k = k_ref[pl.ds(0, keys), :]
        r, lin_rows = _block_scores(cfg, qb, q_ref[...], k, bias_ref, seg_ref)
        d_scores = 2.0 * r * d_w  # zero where masked (r is)
        dq_ref[...] = (_dot(d_scores.astype(dtype), k) * cfg.quad_scale).astype(dq_ref.dtype)
        d_lq = d_lq * cfg.lin_scale
        if lin_rows is not None:
            d_lq = jnp.where(lin_rows[:, None], d_lq, 0.0)
        dlq_ref[...] = d_lq.astype(dlq_ref.dtype)
        ds_ref[:, pl.ds(0, keys)] = d_scores.astype(ds_ref.dtype)
        x_ref[:, pl.ds(0, keys)] = (r * r).astype(x_ref.dtype)
        for start, size in _pieces(keys, g):  # keys after the block's last query: zeros
            ds_ref[:, pl.ds(start, size)] = jnp.zeros((bq, size), ds_ref.dtype)
            x_ref[:, pl.ds(start, size)] = jnp.zeros((bq, size), x_ref.dtype)
        x_ref[:, pl.ds(g, s)] = _linear_queries(cfg, lq_ref[...], lin_rows, x_ref.dtype)

    _for_each_query_block(cfg, block)


def backward(cfg: GAUKernelConfig, q, k, lq, v, state, d_out, bias=None, seg=None):
    """The kernel's part of the backward: (dq [n, G, s], d_lq [n, G, s], d_scores [n, G, G],
    x [n, G, G + s]); d_scores is d(loss)/d(scaled scores + bias), x = [W | lq as used]."""
    n, g, s = q.shape
    e = v.shape[-1]
    has_bias, has_seg = bias is not None, seg is not None
    in_specs, rows = _specs(cfg, s, e, has_bias, has_seg)
    extra = [x for x in (bias, seg) if x is not None]
    dtype = v.dtype
    return pl.pallas_call(
        functools.partial(_bwd_kernel, cfg, has_bias, has_seg),
        grid=(n, g // cfg.block_q),
        in_specs=[*in_specs, rows(e)],
        out_specs=[rows(s), rows(s), rows(g), rows(g + s)],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(lq.shape, lq.dtype),
            jax.ShapeDtypeStruct((n, g, g), dtype),
            jax.ShapeDtypeStruct((n, g, g + s), dtype),
        ],
        compiler_params=_compiler_params(cfg),
        interpret=cfg.interpret,
        name="bpt_gau_bwd",
    )(q, k, lq, v, state, *extra, d_out)


# --- the linear part's states -------------------------------------------------------------


def _over_pieces(pieces: int, size: int, body, carry):
    """body(first row, carry) over a chunk's pieces of `size` rows: inline for one, else a
    loop (unrolled, Triton gave every piece buffers of its own: 336 KiB of shared memory for
    two pieces of 256 rows)."""
    if pieces == 1:
        return body(0, carry)
    return lax.fori_loop(0, pieces, lambda p, c: body(pl.multiple_of(p * size, size), c), carry)


def _states_kernel(cfg: GAUKernelConfig, with_values: bool, lk_ref, v_ref, *refs):
    g, piece = cfg.chunk, cfg.state_rows
    s, te = lk_ref.shape[-1], v_ref.shape[-1]
    *initial_ref, o_ref = refs
    acc = initial_ref[0][...].astype(jnp.float32) if initial_ref else jnp.zeros((s, te), jnp.float32)
    state_rows = pl.ds(g, s) if with_values else pl.ds(0, s)

    def body(c, acc):
        o_ref[c, state_rows, :] = acc.astype(o_ref.dtype)  # the sum over the chunks before c

        def rows_of_chunk(start, acc):
            rows = pl.ds(pl.multiple_of(c * g + start, piece), piece)
            v = v_ref[rows, :]
            if with_values:  # the chunk's values above its state: [v ; state], as the matmul reads them
                o_ref[c, pl.ds(start, piece), :] = v
            return acc + _dot(lk_ref[rows, :], v, ta=True)

        return _over_pieces(g // piece, piece, rows_of_chunk, acc)

    lax.fori_loop(0, lk_ref.shape[0] // g, body, acc)


def states(
    cfg: GAUKernelConfig, lk: Array, v: Array, *, with_values: bool = False, initial: Array | None = None
) -> Array:
    """The linear state entering each chunk, sum over earlier chunks of lk_j v_j^T: lk [batch,
    seq, s], v [batch, seq, e] -> [batch, chunks, s, e] in v's dtype, summed in float32 in
    registers. One program per (sequence, value tile) walks its chunks in order: lk and v
    are read once and the states written once, with no float32 copy in memory.

    with_values: [batch, chunks, G + s, e], each chunk's values and then its state, the
    operand [v ; state] of the forward's one matmul per chunk, written here instead of
    concatenated after (the concatenation took 12.3 ms of FLASH-125M's 8K step on an H100).
    initial [batch, s, e] float32: the sum the first chunk starts from (the tokens before
    this sequence)."""
    b, t, s = lk.shape
    e, c, te, g = v.shape[-1], t // cfg.chunk, cfg.state_block_e, cfg.chunk
    rows = g + s if with_values else s
    in_specs = [
        pl.BlockSpec((None, t, s), lambda i, j: (i, 0, 0)),
        pl.BlockSpec((None, t, te), lambda i, j: (i, 0, j)),
    ]
    if initial is not None:
        in_specs.append(pl.BlockSpec((None, s, te), lambda i, j: (i, 0, j)))
    return pl.pallas_call(
        functools.partial(_states_kernel, cfg, with_values),
        grid=(b, e // te),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, c, rows, te), lambda i, j: (i, 0, 0, j)),
        out_shape=jax.ShapeDtypeStruct((b, c, rows, e), v.dtype),
        compiler_params=_compiler_params(cfg, cfg.state_warps),
        interpret=cfg.interpret,
        name="bpt_gau_states",
    )(lk, v, *([] if initial is None else [initial]))


def _later_sum_kernel(cfg: GAUKernelConfig, x_ref, values_ref, o_ref, joined_ref):
    chunks, s = x_ref.shape[0], x_ref.shape[1]
    g, piece = cfg.chunk, cfg.state_rows

    def body(i, acc):
        c = chunks - 1 - i
        later = acc.astype(o_ref.dtype)  # the sum over the chunks after c
        o_ref[c] = later

        def copy_rows(start, carry):  # [values ; later], as the matmul after this reads them
            rows = pl.ds(pl.multiple_of(c * g + start, piece), piece)
            joined_ref[c, pl.ds(start, piece), :] = values_ref[rows, :]
            return carry

        _over_pieces(g // piece, piece, copy_rows, None)
        joined_ref[c, pl.ds(g, s), :] = later
        return acc + x_ref[c].astype(jnp.float32)

    lax.fori_loop(0, chunks, body, jnp.zeros(x_ref.shape[1:], jnp.float32))


def later_sums(cfg: GAUKernelConfig, x: Array, values: Array) -> tuple[Array, Array]:
    """x [batch, chunks, s, e] (the states' gradients), values [batch, chunks x G, e] ->
    (for each chunk the sum over the chunks after it, [batch, chunks, s, e]: a chunk's k v^T
    reaches every later chunk; and [batch, chunks, G + s, e], each chunk's values above that
    sum: the operand of the backward's one matmul for dv, written here instead of
    concatenated after), in x's dtype, summed in float32."""
    b, c, s, e = x.shape
    t, te, g = values.shape[1], cfg.state_block_e, cfg.chunk
    spec = pl.BlockSpec((None, c, s, te), lambda i, j: (i, 0, 0, j))
    return pl.pallas_call(
        functools.partial(_later_sum_kernel, cfg),
        grid=(b, e // te),
        in_specs=[spec, pl.BlockSpec((None, t, te), lambda i, j: (i, 0, j))],
        out_specs=[spec, pl.BlockSpec((None, c, g + s, te), lambda i, j: (i, 0, 0, j))],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((b, c, g + s, e), x.dtype)],
        compiler_params=_compiler_params(cfg, cfg.state_warps),
        interpret=cfg.interpret,
        name="bpt_gau_later_sums",
    )(x, values)
