"""FlashAttention-2 as Pallas kernels: forward, and a backward in two passes (dK/dV, then dQ).

Layout [batch, seq, heads, head_dim] like the rest of bpt.ops; the kernels read q, k and v
in place (no transposes). The softmax statistics are kept in base 2 (exp2 of scores
pre-scaled by log2(e)/sqrt(head_dim)); the logsumexp the forward returns is in natural
units, [batch, heads, seq], +inf on rows that see no key (so exp(s - lse) is exactly 0).

- Forward: grid (batch, heads, query blocks). Each program loops over key/value blocks with
  an unscaled float32 accumulator and running max/sum and rescales once at the end. Causal:
  blocks above the diagonal are never visited; blocks below it run without a mask; only the
  blocks the diagonal crosses are masked.
- Backward: D = rowsum(dO * O) in XLA; a dK/dV kernel parallel over key/value blocks that
  loops over the query blocks (and over the query heads of a GQA group, so K/V are never
  repeated and no atomics are needed); then a dQ kernel parallel over query blocks, as the
  forward. Both recompute the probabilities from the logsumexp.
- Segment ids (packed documents): where the keys' ids are sorted, each program visits only
  the span of blocks that hold its documents (bpt.ops.segments.segment_spans, four int32
  scalars a program), skipping the rest, and masks by segment only the blocks at its
  documents' edges: a block of rows of one document runs that document's interior blocks
  without the segment mask. Unsorted ids: every block, each masked.
- Sequence lengths that are not a multiple of the block are padded and the padded keys
  masked (padded tokens take segment ids above every real one, so sorted ids stay sorted);
  head_dim is padded to a power of two (80 -> 128), as the lowering needs.

On GPUs the kernels lower through Triton; elsewhere they run in Pallas interpret mode (slow,
for tests). On H100-class GPUs the Mosaic GPU kernels of attention_hopper/ (wgmma, TMA, warp
specialization) run instead wherever they take the inputs; both families share one contract
(out and logsumexp from the forward; dq, dk, dv from them and delta), so a forward of one
and a backward of the other combine.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from bpt.ops.kernels import attention_hopper
from bpt.ops.reference import check_qkv, split_segment_ids
from bpt.ops.remat import ATTENTION_LSE, ATTENTION_OUT, kept_results
from bpt.ops.segments import segment_spans

Array = jax.Array
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
KERNELS = ("auto", "triton", "hopper")
# The Triton kernels' default blocks (block_q, block_k, block_q_bwd, block_k_bwd) by bytes per
# element. float32 tiles take twice the registers of bf16 ones: at the bf16 sizes the float32
# backward spilled so much that compiling it took minutes on an H100 (at these, seconds).
TRITON_BLOCKS = {2: (128, 64, 64, 64), 4: (64, 32, 32, 32)}
# The fp8 forward (fp8=True): q and k scaled per token and head, v per channel, to e4m3's
# range; the probabilities (<= 1) times 2^8 before their cast, so that small ones stay in
# e4m3's normal range (down to 2^-6) instead of flushing to zero.
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
P_SCALE = 256.0


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Static settings of one kernel call (hashable: it is a custom_vjp nondiff argument)."""

    causal: bool
    scale: float
    seq_q: int  # true (unpadded) lengths
    seq_k: int
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int
    num_warps: int
    num_stages: int
    interpret: bool
    forward: str = "triton"  # which kernels: "triton" (this file) or "hopper" (attention_hopper/)
    backward: str = "triton"
    hopper_block_k: int = 128
    hopper_stages: int | None = None  # None: attention_hopper.default_stages
    hopper_fused_dq: bool | None = None  # attention_hopper.backward's fused_dq (None: fused)
    hopper_schedule: str | None = None  # attention_hopper.forward's schedule (None: by shape)
    hopper_tile_group: int | None = attention_hopper.TILE_GROUP  # the launch order (attention_hopper.pipeline._Grid)
    hopper_gqa: str = "expand"  # attention_hopper.backward's gqa: how the dK/dV pass splits GQA
    hopper_dq_split: str | None = None  # attention_hopper.backward's dq_split (None: by head_dim)
    hopper_persistent: bool | int = False  # attention_hopper.forward's persistent CTAs
    hopper_sort_window: int = attention_hopper.SORT_WINDOW  # the launch order with segment ids
    hopper_query_order: str = attention_hopper.QUERY_ORDER  # attention_hopper.backward's query_order
    pad_d: int = 0  # zeros added to head_dim
    fp8: bool = False  # the forward's matmuls in float8_e4m3fn (quantize_fp8); the backward's not


def _dot(a: Array, b: Array, *, ta: bool = False, tb: bool = False) -> Array:
    """a @ b with optional transposes, accumulated in float32 (float32 inputs: no TF32)."""
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _iota(n: int, offset) -> Array:
    return offset + lax.broadcasted_iota(jnp.int32, (n,), 0)


def _mask(cfg: FlashConfig, q_pos, k_pos, q_seg, k_seg, *, diagonal: bool, tail: bool):
    """The [bq, bk] visibility mask of one block, or None when every pair is visible."""
    mask = None

    def both(a, b):
        return b if a is None else a & b

    if diagonal:
        mask = both(mask, q_pos[:, None] >= k_pos[None, :])
    if tail:
        mask = both(mask, k_pos[None, :] < cfg.seq_k)
    if q_seg is not None:
        mask = both(mask, q_seg[:, None] == k_seg[None, :])
    return mask


def _masked_scores(
    cfg: FlashConfig, q, k, q_pos, k_pos, q_seg, k_seg, *, diagonal: bool, tail: bool, scales=None
):
    """Scores of one [bq, bk] block in base 2 (scaled by log2(e)/sqrt(d)), -inf where masked.

    The backward turns them into probabilities with exp2(s - lse * log2(e)): masked pairs
    give exactly 0, and so do rows with lse = +inf (rows that see no key). scales: the fp8
    forward's factors (per query [bq], with log2(e)/sqrt(d) folded in; per key [bk]).
    """
    s = _dot(q, k, tb=True)
    if scales is None:
        s = s * (cfg.scale * LOG2E)
    else:
        s = s * scales[0][:, None] * scales[1][None, :]
    mask = _mask(cfg, q_pos, k_pos, q_seg, k_seg, diagonal=diagonal, tail=tail)
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def _kv_ranges(cfg: FlashConfig, q_block: int | Array, block_q: int, block_k: int, num_k: int):
    """[(lo, hi, diagonal, tail)]: the key block ranges a query block visits, and how to mask them."""
    q_first = q_block * block_q
    if cfg.causal:
        full = jnp.minimum((q_first + 1) // block_k, num_k)  # entirely at or below the diagonal
        end = jnp.minimum(pl.cdiv(q_first + block_q, block_k), num_k)
        return [(0, full, False, False), (full, end, True, False)]
    # Non-causal: whole blocks of real keys unmasked, then the block the real keys end in
    # (masked); blocks of padding only are never visited.
    whole, real = cfg.seq_k // block_k, pl.cdiv(cfg.seq_k, block_k)
    return [(0, whole, False, False)] + ([(whole, real, False, True)] if real > whole else [])


def _within(ranges, spans_ref):
    """[(lo, hi, ..., segments)]: the ranges (lo, hi, ...) cut to the block's segment span and
    split around its dense run (spans_ref: [first, stop, dense first, dense stop] from
    segment_spans(dense=True); None: the ranges as they are), segments telling whether a
    range's blocks need the segment mask (the span's blocks outside its dense run: a
    document's edges). The ranges follow one another, and so do the cut ones."""
    if spans_ref is None:
        return [(*r, False) for r in ranges]
    first, stop, dense_first, dense_stop = (spans_ref[i] for i in range(4))

    def clamp(x, lo, hi):
        return jnp.minimum(jnp.maximum(x, lo), hi)

    cut = []
    for lo, hi, *how in ranges:
        lo = clamp(lo, first, stop)
        hi = clamp(hi, lo, stop)
        a = clamp(dense_first, lo, hi)
        z = clamp(dense_stop, a, hi)
        cut += [(lo, a, *how, True), (a, z, *how, False), (z, hi, *how, True)]
    return cut


def _q_ranges(cfg: FlashConfig, k_block, block_q: int, block_k: int, num_q: int):
    """[(lo, hi, diagonal)]: the query blocks that see key block k_block, and which need the causal mask."""
    if not cfg.causal:
        return [(0, num_q, False)]
    k_first, k_last = k_block * block_k, k_block * block_k + block_k - 1
    start = k_first // block_q  # the first query block with a query at or after k_first
    full = jnp.minimum(pl.cdiv(k_last, block_q), num_q)  # from here every query sees every key
    return [(start, full, True), (full, num_q, False)]


# --- forward -------------------------------------------------------------------------------


def _fwd_kernel(cfg: FlashConfig, has_seg: bool, q_ref, k_ref, v_ref, *refs):
    refs = list(refs)
    qs_ref, ks_ref, spans_ref = (refs.pop(0), refs.pop(0), refs.pop(0)) if has_seg else (None,) * 3
    q_scale_ref, k_scale_ref, v_scale_ref = (refs.pop(0) for _ in range(3)) if cfg.fp8 else (None,) * 3
    o_ref, lse_ref = refs
    block_q, block_k = cfg.block_q, cfg.block_k
    i = pl.program_id(2)
    num_k = k_ref.shape[0] // block_k
    q = q_ref[...]
    q_pos = _iota(block_q, i * block_q)
    q_seg = qs_ref[...] if has_seg else None
    q_scale = q_scale_ref[...] * (cfg.scale * LOG2E) if cfg.fp8 else None  # once, not a block

    def visit(diagonal, tail, segments):
        def body(j, carry):
            m, row_sum, acc = carry
            span = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
            k, v = k_ref[span, :], v_ref[span, :]
            seg = (q_seg, ks_ref[span]) if segments else (None, None)
            k_pos = _iota(block_k, j * block_k)
            scales = (q_scale, k_scale_ref[span]) if cfg.fp8 else None
            s = _masked_scores(cfg, q, k, q_pos, k_pos, *seg, diagonal=diagonal, tail=tail, scales=scales)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen nothing yet
            p = jnp.exp2(s - shift[:, None])
            alpha = jnp.exp2(m - shift)
            row_sum = row_sum * alpha + jnp.sum(p, axis=1)
            p_in = (p * P_SCALE).astype(FP8) if cfg.fp8 else p.astype(v.dtype)
            acc = acc * alpha[:, None] + _dot(p_in, v)
            return m_new, row_sum, acc

        return body

    carry = (
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
        jnp.zeros(q.shape, jnp.float32),
    )
    for lo, hi, diagonal, tail, segments in _within(_kv_ranges(cfg, i, block_q, block_k, num_k), spans_ref):
        carry = lax.fori_loop(lo, hi, visit(diagonal, tail, segments), carry)
    m, row_sum, acc = carry
    seen = row_sum > 0.0
    safe = jnp.where(seen, row_sum, 1.0)
    if cfg.fp8:  # back from P_SCALE * p and v / (its channel's scale)
        acc = acc * (v_scale_ref[...] * (1.0 / P_SCALE))[None, :]
    o_ref[...] = (acc / safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, (m + jnp.log2(safe)) * LN2, jnp.inf)


def _compiler_params(cfg: FlashConfig):
    if cfg.interpret:
        return None
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _query_grid_specs(block_q: int, seq_k: int, head_dim: int, group: int) -> dict:
    """BlockSpecs on a (batch, head, query block) grid: the query block [bq, d], the whole K/V
    of the head's KV head, a row of per-query statistics [bq], the two segment-id rows, and
    the query block's segment span (segment_spans)."""
    return dict(
        rows=pl.BlockSpec((None, block_q, None, head_dim), lambda b, h, i: (b, i, h, 0)),
        kv=pl.BlockSpec((None, seq_k, None, head_dim), lambda b, h, i: (b, 0, h // group, 0)),
        stats=pl.BlockSpec((None, None, block_q), lambda b, h, i: (b, h, i)),
        q_seg=pl.BlockSpec((None, block_q), lambda b, h, i: (b, i)),
        kv_seg=pl.BlockSpec((None, seq_k), lambda b, h, i: (b, 0)),
        spans=pl.BlockSpec((None, None, 4), lambda b, h, i: (b, i, 0)),
    )


def _forward(cfg: FlashConfig, q, k, v, q_seg, kv_seg):
    if cfg.forward == "hopper":
        return attention_hopper.forward(
            q,
            k,
            v,
            causal=cfg.causal,
            scale=cfg.scale,
            block_k=cfg.hopper_block_k,
            stages=cfg.hopper_stages,
            schedule=cfg.hopper_schedule,
            tile_group=cfg.hopper_tile_group,
            q_seg=q_seg,
            kv_seg=kv_seg,
            persistent=cfg.hopper_persistent,
            sort_window=cfg.hopper_sort_window,
            interpret=cfg.interpret,
        )
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = h // hk
    has_seg = q_seg is not None
    spec = _query_grid_specs(cfg.block_q, sk, d, group)
    seg_specs, seg_args = [], []
    if has_seg:  # the ids, and each query block's span of key blocks
        spans = segment_spans(
            q_seg, kv_seg, rows=cfg.block_q, cols=cfg.block_k, causal=cfg.causal, dense=True
        )
        seg_specs, seg_args = [spec["q_seg"], spec["kv_seg"], spec["spans"]], [q_seg, kv_seg, spans]
    out_dtype, scale_specs, scale_args = q.dtype, [], []
    if cfg.fp8:
        # per token and head for q and k ([b, s, h, 1]), per channel for v ([b, 1, hk, d])
        (q, q_scale), (k, k_scale), (v, v_scale) = (quantize_fp8(x, a) for x, a in ((q, 3), (k, 3), (v, 1)))
        scale_specs = [
            spec["stats"],  # [b, h, s]: a query block's row
            pl.BlockSpec((None, None, sk), lambda b, h, i: (b, h // group, 0)),  # [b, hk, s]
            pl.BlockSpec((None, None, d), lambda b, h, i: (b, h // group, 0)),  # [b, hk, d]
        ]
        scale_args = [jnp.swapaxes(q_scale[..., 0], 1, 2), jnp.swapaxes(k_scale[..., 0], 1, 2), v_scale[:, 0]]
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, cfg, has_seg),
        grid=(b, h, sq // cfg.block_q),
        in_specs=[spec["rows"], spec["kv"], spec["kv"], *seg_specs, *scale_specs],
        out_specs=[spec["rows"], spec["stats"]],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, out_dtype),
            jax.ShapeDtypeStruct((b, h, sq), jnp.float32),
        ],
        compiler_params=_compiler_params(cfg),
        interpret=cfg.interpret,
        name="bpt_flash_fwd_fp8" if cfg.fp8 else "bpt_flash_fwd",
    )(q, k, v, *seg_args, *scale_args)
    return out, lse


def quantize_fp8(x: Array, axis: int) -> tuple[Array, Array]:
    """(x / scale as float8_e4m3fn, scale float32 with axis kept as 1): scale = max |x| over
    axis / 448, e4m3's largest value (1 where that is 0: padding)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return (x.astype(jnp.float32) / scale).astype(FP8), scale


# --- backward ------------------------------------------------------------------------------


def _dkdv_kernel(
    cfg: FlashConfig, has_seg: bool, group: int, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, *refs
):
    if has_seg:
        qs_ref, ks_ref, spans_ref, dk_ref, dv_ref = refs
    else:
        (dk_ref, dv_ref), spans_ref = refs, None
    block_q, block_k = cfg.block_q_bwd, cfg.block_k_bwd
    j = pl.program_id(2)
    # Query blocks of padding only add nothing (their dO is 0): stop at the last real one.
    # Padded keys need no mask here: their dK and dV are dropped, and the forward's
    # logsumexp already left them out of every real key's probabilities.
    num_q = pl.cdiv(cfg.seq_q, block_q)
    k, v = k_ref[...], v_ref[...]
    k_pos = _iota(block_k, j * block_k)
    k_seg = ks_ref[...] if has_seg else None

    def visit(g, diagonal, segments):
        def body(i, carry):
            dk, dv = carry
            span = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
            q, do = q_ref[span, g, :], do_ref[span, g, :]
            lse, delta = lse_ref[g, span], dl_ref[g, span]
            seg = (qs_ref[span], k_seg) if segments else (None, None)
            q_pos = _iota(block_q, i * block_q)
            s = _masked_scores(cfg, q, k, q_pos, k_pos, *seg, diagonal=diagonal, tail=False)
            p = jnp.exp2(s - (lse * LOG2E)[:, None])
            dv = dv + _dot(p.astype(do.dtype), do, ta=True)
            ds = p * (_dot(do, v, tb=True) - delta[:, None])
            dk = dk + _dot(ds.astype(q.dtype), q, ta=True)
            return dk, dv

        return body

    ranges = _within(_q_ranges(cfg, j, block_q, block_k, num_q), spans_ref)

    def head(g, carry):  # the query head g of the group, over its query-block ranges
        for lo, hi, diagonal, segments in ranges:
            carry = lax.fori_loop(lo, hi, visit(g, diagonal, segments), carry)
        return carry

    # A loop over the group's heads, not a Python one: unrolled, GQA 8:1 under a causal
    # mask with segment ids is 48 loops in one kernel, and its GPU test did not finish in 7
    # minutes; with the loop it passes in about one (docs/notes/attention_kernels.md, 2026-12-03).
    carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = head(0, carry) if group == 1 else lax.fori_loop(0, group, head, carry)
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(cfg: FlashConfig, has_seg: bool, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, *refs):
    if has_seg:
        qs_ref, ks_ref, spans_ref, dq_ref = refs
    else:
        (dq_ref,), spans_ref = refs, None
    block_q, block_k = cfg.block_q_bwd, cfg.block_k_bwd
    i = pl.program_id(2)
    num_k = k_ref.shape[0] // block_k
    q, do = q_ref[...], do_ref[...]
    lse2, delta = lse_ref[...] * LOG2E, dl_ref[...]
    q_pos = _iota(block_q, i * block_q)
    q_seg = qs_ref[...] if has_seg else None

    def visit(diagonal, tail, segments):
        def body(j, dq):
            span = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
            k, v = k_ref[span, :], v_ref[span, :]
            seg = (q_seg, ks_ref[span]) if segments else (None, None)
            k_pos = _iota(block_k, j * block_k)
            s = _masked_scores(cfg, q, k, q_pos, k_pos, *seg, diagonal=diagonal, tail=tail)
            p = jnp.exp2(s - lse2[:, None])
            ds = p * (_dot(do, v, tb=True) - delta[:, None])
            return dq + _dot(ds.astype(k.dtype), k)

        return body

    dq = jnp.zeros(q.shape, jnp.float32)
    for lo, hi, diagonal, tail, segments in _within(_kv_ranges(cfg, i, block_q, block_k, num_k), spans_ref):
        dq = lax.fori_loop(lo, hi, visit(diagonal, tail, segments), dq)
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _backward(cfg: FlashConfig, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse):
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = h // hk
    has_seg = q_seg is not None
    bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
    # d(lse)/ds = p, so the logsumexp's cotangent joins D: ds = p * (dp - (D - d_lse)).
    delta = jnp.einsum("bshd,bshd->bhs", d_out.astype(jnp.float32), out.astype(jnp.float32))
    delta = delta - d_lse.astype(jnp.float32)
    if cfg.backward == "hopper":
        return attention_hopper.backward(
            q,
            k,
            v,
            d_out,
            lse,
            delta,
            causal=cfg.causal,
            scale=cfg.scale,
            stages=cfg.hopper_stages,
            fused_dq=cfg.hopper_fused_dq,
            tile_group=cfg.hopper_tile_group,
            q_seg=q_seg,
            kv_seg=kv_seg,
            gqa=cfg.hopper_gqa,
            dq_split=cfg.hopper_dq_split,
            sort_window=cfg.hopper_sort_window,
            query_order=cfg.hopper_query_order,
            interpret=cfg.interpret,
        )
    seg_args = [q_seg, kv_seg] if has_seg else []

    # dK, dV: one program per (batch, kv head, key block); it walks the group's query heads.
    dkdv_specs = [
        pl.BlockSpec((None, sq, group, d), lambda b_, g_, j: (b_, 0, g_, 0)),  # q
        pl.BlockSpec((None, bk, None, d), lambda b_, g_, j: (b_, j, g_, 0)),  # k
        pl.BlockSpec((None, bk, None, d), lambda b_, g_, j: (b_, j, g_, 0)),  # v
        pl.BlockSpec((None, sq, group, d), lambda b_, g_, j: (b_, 0, g_, 0)),  # d_out
        pl.BlockSpec((None, group, sq), lambda b_, g_, j: (b_, g_, 0)),  # lse
        pl.BlockSpec((None, group, sq), lambda b_, g_, j: (b_, g_, 0)),  # delta
    ]
    if has_seg:  # the ids, and each key block's span of query blocks
        dkdv_specs += [
            pl.BlockSpec((None, sq), lambda b_, g_, j: (b_, 0)),
            pl.BlockSpec((None, bk), lambda b_, g_, j: (b_, j)),
            pl.BlockSpec((None, None, 4), lambda b_, g_, j: (b_, j, 0)),
        ]
        key_spans = segment_spans(
            kv_seg, q_seg, rows=bk, cols=bq, causal=cfg.causal, rows_are_keys=True, dense=True
        )
    kv_out_spec = pl.BlockSpec((None, bk, None, d), lambda b_, g_, j: (b_, j, g_, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, cfg, has_seg, group),
        grid=(b, hk, sk // bk),
        in_specs=dkdv_specs,
        out_specs=[kv_out_spec, kv_out_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_compiler_params(cfg),
        interpret=cfg.interpret,
        name="bpt_flash_bwd_dkdv",
    )(q, k, v, d_out, lse, delta, *seg_args, *([key_spans] if has_seg else []))

    # dQ: one program per (batch, head, query block), like the forward.
    spec = _query_grid_specs(bq, sk, d, group)
    dq_specs = [spec["rows"], spec["kv"], spec["kv"], spec["rows"], spec["stats"], spec["stats"]]
    dq_seg = []
    if has_seg:
        dq_specs += [spec["q_seg"], spec["kv_seg"], spec["spans"]]
        spans = segment_spans(q_seg, kv_seg, rows=bq, cols=bk, causal=cfg.causal, dense=True)
        dq_seg = [q_seg, kv_seg, spans]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg, has_seg),
        grid=(b, h, sq // bq),
        in_specs=dq_specs,
        out_specs=spec["rows"],
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(cfg),
        interpret=cfg.interpret,
        name="bpt_flash_bwd_dq",
    )(q, k, v, d_out, lse, delta, *dq_seg)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg: FlashConfig, q, k, v, q_seg, kv_seg):
    return _forward(cfg, q, k, v, q_seg, kv_seg)


def _flash_fwd(cfg, q, k, v, q_seg, kv_seg):
    out, lse = _forward(cfg, q, k, v, q_seg, kv_seg)
    # Named, so that a remat policy can keep them (bpt.ops.remat: attention_saveable).
    out, lse = kept_results((out, lse), (ATTENTION_OUT, ATTENTION_LSE))
    return (out, lse), (q, k, v, q_seg, kv_seg, out, lse)


def _flash_bwd(cfg, residuals, cotangents):
    q, k, v, q_seg, kv_seg, out, lse = residuals
    d_out, d_lse = cotangents
    dq, dk, dv = _backward(cfg, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse)
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def flash_attention_with_lse(
    q: Array,
    k: Array,
    v: Array,
    *,
    causal: bool = False,
    segment_ids=None,
    block_q: int | None = None,
    block_k: int | None = None,
    block_q_bwd: int | None = None,
    block_k_bwd: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    forward: str = "auto",
    backward: str = "auto",
    hopper_block_k: int = 128,
    hopper_stages: int | None = None,
    hopper_fused_dq: bool | None = None,
    hopper_schedule: str | None = None,
    hopper_tile_group: int | None = attention_hopper.TILE_GROUP,
    hopper_gqa: str = "expand",
    hopper_dq_split: str | None = None,
    hopper_persistent: bool | int = False,
    hopper_sort_window: int = attention_hopper.SORT_WINDOW,
    hopper_query_order: str = attention_hopper.QUERY_ORDER,
    interpret: bool | None = None,
    fp8: bool = False,
) -> tuple[Array, Array]:
    """(out [b, s, h, d], logsumexp [b, h, s] float32) of exact attention, by the Pallas kernels.

    segment_ids: [b, s] ints (or a (q_ids, kv_ids) pair): tokens attend within their segment.
    k and v may have fewer heads than q (a divisor of it). forward, backward: "triton",
    "hopper" (the Mosaic GPU kernels of attention_hopper/: wgmma/TMA, H100-class GPUs,
    bf16/fp16, lengths multiples of 128; head_dim a multiple of 64 up to 256, the backward
    128 or 256 at most), or "auto" (hopper where it can run, segment ids too, else triton;
    each of the two on its own).
    hopper_block_k: the Hopper forward's key block (64 or 128); hopper_stages:
    the depth of the Hopper kernels' shared-memory ring (None: attention_hopper.default_stages,
    by head_dim); hopper_fused_dq: the Hopper backward adds dQ inside its dK/dV pass (True or
    None) or runs a second pass for it (False). hopper_schedule: how the Hopper forward orders
    each warpgroup's matmuls and softmax (attention_hopper.SCHEDULES; see
    attention_hopper.forward; None: attention_hopper.default_schedule, by shape).
    hopper_tile_group: the Hopper kernels' launch order, runs of up to this many tiles of one
    (batch, head), None: all of them (attention_hopper.forward). hopper_gqa: with fewer
    key/value heads than query heads, the Hopper backward's split of the work,
    "expand" (a CTA a query head's keys) or "walk" (a CTA a key/value head's keys, walking
    its group; attention_hopper.backward). hopper_dq_split: how the fused Hopper backward
    splits dQ between its warpgroups (attention_hopper.DQ_SPLITS; None: by head_dim, at 64
    "keys" or "steps"). hopper_persistent: the Hopper forward as one CTA an SM, each taking
    tiles in turn (True; an int: that many CTAs; attention_hopper.forward), not a CTA a
    tile (False, the default). hopper_sort_window: with segment ids, the Hopper kernels'
    CTAs launch sorted by their tiles' blocks within windows of this many waves of SMs
    where the grid holds at most attention_hopper.SORT_WAVES waves (sorted_launch; default
    SORT_WINDOW, 4; 0: in the grid's order). hopper_query_order: the order in which the
    Hopper backward's dK/dV pass walks the query blocks up to head_dim 128
    (attention_hopper.QUERY_ORDERS; attention_hopper.backward). interpret: run
    the kernels in an interpreter (default: everywhere but on a GPU). block_q, block_k (forward) and
    block_q_bwd, block_k_bwd (backward): the Triton kernels' blocks; by default
    TRITON_BLOCKS for the input's dtype. fp8: the forward's two matmuls in float8_e4m3fn
    (the Triton forward; q and k scaled per token and head, v per channel, the probabilities
    by 2^8; float32 accumulation and softmax statistics), for GPUs with fp8 tensor cores
    (compute capability 8.9 and up); the output keeps the inputs' dtype, and the backward
    is the 16-bit one, run at the fp8 forward's output and logsumexp.
    """
    # the settings the call gives; those it leaves at their defaults, a kernel_settings context may set
    given = {
        name: value
        for name, value in locals().items()
        if name in _SETTINGS and (type(value), value) != (type(_DEFAULTS[name]), _DEFAULTS[name])
    }
    cfg, (q, k, v, q_seg, kv_seg) = _prepare(q, k, v, causal, segment_ids, given)
    out, lse = _flash(cfg, q, k, v, q_seg, kv_seg)
    return out[:, : cfg.seq_q, :, : k.shape[-1] - cfg.pad_d], lse[:, :, : cfg.seq_q]


_SETTINGS = (
    "block_q",
    "block_k",
    "block_q_bwd",
    "block_k_bwd",
    "num_warps",
    "num_stages",
    "forward",
    "backward",
    "hopper_block_k",
    "hopper_stages",
    "hopper_fused_dq",
    "hopper_schedule",
    "hopper_tile_group",
    "hopper_gqa",
    "hopper_dq_split",
    "hopper_persistent",
    "hopper_sort_window",
    "hopper_query_order",
    "interpret",
    "fp8",
)
_DEFAULTS = {
    name: param.default
    for name, param in inspect.signature(flash_attention_with_lse).parameters.items()
    if name in _SETTINGS
}


# The settings the kernel_settings contexts open now give the calls traced inside them, as
# (name, value) pairs.
_CONTEXT: contextvars.ContextVar[tuple] = contextvars.ContextVar("bpt_flash_settings", default=())


def check_settings(settings: dict, head_dim: int | None = None) -> None:
    """ValueError for a name that is not one of _SETTINGS or a value its kernel does not
    take (head_dim: the inputs', for the settings that depend on it), naming the setting."""
    unknown = sorted(set(settings) - set(_SETTINGS))
    if unknown:
        raise ValueError(f"unknown flash attention setting {unknown[0]!r}; allowed: {', '.join(_SETTINGS)}")
    for name in ("forward", "backward"):
        if name in settings and settings[name] not in KERNELS:
            raise ValueError(f"unknown flash {name} {settings[name]!r}; allowed: {', '.join(KERNELS)}")
    checks = {
        "hopper_schedule": attention_hopper.check_schedule,
        "hopper_tile_group": attention_hopper.check_tile_group,
        "hopper_gqa": attention_hopper.check_gqa,
        "hopper_persistent": attention_hopper.check_persistent,
        "hopper_sort_window": attention_hopper.check_sort_window,
        "hopper_query_order": attention_hopper.check_query_order,
    }
    for name, check in checks.items():
        if name in settings:
            check(settings[name], name)
    if "hopper_dq_split" in settings:
        attention_hopper.check_dq_split(settings["hopper_dq_split"], head_dim, "hopper_dq_split")
    if settings.get("hopper_block_k", 128) not in attention_hopper.BLOCKS:
        raise ValueError(
            f"hopper_block_k={settings['hopper_block_k']!r} is not a block size of the Hopper kernels; "
            f"allowed: {attention_hopper.BLOCKS}"
        )


@contextlib.contextmanager
def kernel_settings(**settings):
    """Defaults for the kernels' settings (flash_attention_with_lse's keyword arguments but
    the inputs') in every call traced inside the context, where the call leaves the setting
    at its default; contexts nest, the inner one's settings first. A differentiated call
    keeps the settings its forward was traced with (its FlashConfig), so the backward takes
    them too. model.attention_options sets them for a GPT's layers."""
    check_settings(settings)
    token = _CONTEXT.set(tuple({**dict(_CONTEXT.get()), **settings}.items()))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


_WORDS = {"None": None, "True": True, "False": False}  # parse_settings' Python constants


def parse_settings(text: str, head_dim: int | None = None) -> dict:
    """The kernels' settings written as text, "name=value,name=value" (a config's string:
    model.attention_options): ints, None, True and False as Python writes them, anything else
    a string. Checked (check_settings; at head_dim, if given)."""
    settings = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not name or not value:
            raise ValueError(f"{item!r} is not name=value (e.g. hopper_sort_window=0,hopper_block_k=64)")
        if value in _WORDS:
            settings[name] = _WORDS[value]
        else:
            settings[name] = int(value) if value.lstrip("-").isdigit() else value
    check_settings(settings, head_dim)
    return settings


def current_settings() -> dict:
    """The settings of the kernel_settings contexts open now (the innermost first)."""
    return dict(_CONTEXT.get())


def _prepare(q, k, v, causal, segment_ids, settings: dict):
    """The kernels' FlashConfig for these inputs, and the inputs padded as the kernels need
    (lengths to whole blocks, head_dim to a power of two; padded tokens get segments of their own).
    settings: the call's own, over those of the kernel_settings contexts open now."""
    settings = {**dict(_CONTEXT.get()), **settings}
    check_settings(settings, q.shape[-1])
    settings = {**_DEFAULTS, **settings}
    block_q, block_k, block_q_bwd, block_k_bwd, num_warps, num_stages, forward, backward = (
        settings[name] for name in _SETTINGS[:8]
    )
    hopper = {name: settings[name] for name in _SETTINGS if name.startswith("hopper_")}  # FlashConfig's fields
    interpret, fp8 = settings["interpret"], bool(settings["fp8"])
    num_warps = 4 if num_warps is None else num_warps
    num_stages = 2 if num_stages is None else num_stages
    check_qkv(q, k, v)
    b, sq, h, d = q.shape
    sk = k.shape[1]
    if causal and sq != sk:
        raise ValueError(f"causal flash attention needs equal query and key lengths; got {sq} and {sk}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    q_seg, kv_seg = split_segment_ids(segment_ids, sq, sk)

    # Blocks are powers of two no longer than the (rounded-up) sequences; sequences are padded
    # to a whole number of the largest block, head_dim to a power of two.
    cap_q, cap_k = max(16, _pow2(sq)), max(16, _pow2(sk))
    defaults = TRITON_BLOCKS[2 if jnp.dtype(q.dtype).itemsize <= 2 else 4]
    block_q, block_k, block_q_bwd, block_k_bwd = (
        default if given is None else given
        for given, default in zip((block_q, block_k, block_q_bwd, block_k_bwd), defaults)
    )
    bq, bk = min(block_q, cap_q), min(block_k, cap_k)
    bq_b, bk_b = min(block_q_bwd, cap_q), min(block_k_bwd, cap_k)
    if causal:  # one padded length for both, so the diagonal stays where it is
        pad_q = pad_k = -sq % max(bq, bk, bq_b, bk_b)
    else:
        pad_q, pad_k = -sq % max(bq, bq_b), -sk % max(bk, bk_b)
    dp = max(16, _pow2(d)) - d
    why_not = {
        part: attention_hopper.supported(q, k, backward=part == "backward")
        for part in ("forward", "backward")
    }
    for part, reason in why_not.items():
        if reason is None and (pad_q or pad_k or dp):
            why_not[part] = "inputs the Triton kernels would pad"
    on_hopper = not interpret and attention_hopper.is_hopper()
    if fp8 and forward == "hopper":
        raise ValueError(
            "flash forward='hopper' cannot take fp8=True; the fp8 forward is the Triton kernel's"
        )
    if forward == "auto":
        forward = "hopper" if on_hopper and why_not["forward"] is None and not fp8 else "triton"
    if backward == "auto":
        backward = "hopper" if on_hopper and why_not["backward"] is None else "triton"
    for setting, value in (("forward", forward), ("backward", backward)):
        if value == "hopper" and why_not[setting] is not None:
            raise ValueError(f"flash {setting}='hopper' cannot take {why_not[setting]}; use 'triton' or 'auto'")
    cfg = FlashConfig(
        pad_d=dp,
        causal=causal,
        scale=1.0 / math.sqrt(d),
        seq_q=sq,
        seq_k=sk,
        block_q=bq,
        block_k=bk,
        block_q_bwd=bq_b,
        block_k_bwd=bk_b,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        forward=forward,
        backward=backward,
        fp8=fp8,
        **hopper,
    )
    if pad_q or pad_k or dp:
        q = jnp.pad(q, ((0, 0), (0, pad_q), (0, 0), (0, dp)))
        k = jnp.pad(k, ((0, 0), (0, pad_k), (0, 0), (0, dp)))
        v = jnp.pad(v, ((0, 0), (0, pad_k), (0, 0), (0, dp)))
    if q_seg is not None:  # int32 for every kernel; padded queries and keys get segments of their own
        q_seg, kv_seg = q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)
        # above every real id, so that sorted ids stay sorted (segment_spans skips blocks then)
        top = jnp.maximum(q_seg.max(axis=1, keepdims=True), kv_seg.max(axis=1, keepdims=True))
        q_seg = jnp.concatenate([q_seg, jnp.broadcast_to(top + 1, (b, pad_q))], axis=1)
        kv_seg = jnp.concatenate([kv_seg, jnp.broadcast_to(top + 2, (b, pad_k))], axis=1)
    return cfg, (q, k, v, q_seg, kv_seg)


def flash_forward(q: Array, k: Array, v: Array, *, causal: bool = False, segment_ids=None, **settings):
    """(out, lse) of the forward kernel, not differentiable: one half of a custom_vjp that merges
    several attentions (ring attention). Arguments as flash_attention_with_lse."""
    cfg, (qp, kp, vp, q_seg, kv_seg) = _prepare(q, k, v, causal, segment_ids, settings)
    out, lse = _forward(cfg, qp, kp, vp, q_seg, kv_seg)
    return out[:, : cfg.seq_q, :, : q.shape[-1]], lse[:, :, : cfg.seq_q]


def flash_backward(
    q: Array,
    k: Array,
    v: Array,
    out: Array,
    lse: Array,
    d_out: Array,
    d_lse: Array,
    *,
    causal: bool = False,
    segment_ids=None,
    **settings,
) -> tuple[Array, Array, Array]:
    """(dq, dk, dv) of the attention flash_forward computes, given the cotangents d_out and d_lse.
    out and lse may be those of a larger attention these keys are part of (ring attention's
    merged result): the gradients are then this key range's share of it."""
    cfg, (qp, kp, vp, q_seg, kv_seg) = _prepare(q, k, v, causal, segment_ids, settings)
    pad_q, d = qp.shape[1] - q.shape[1], q.shape[-1]
    rows = ((0, 0), (0, pad_q), (0, 0), (0, cfg.pad_d))
    stats = ((0, 0), (0, 0), (0, pad_q))
    dq, dk, dv = _backward(
        cfg,
        qp,
        kp,
        vp,
        q_seg,
        kv_seg,
        jnp.pad(out, rows),
        jnp.pad(lse, stats, constant_values=jnp.inf),
        jnp.pad(d_out, rows),
        jnp.pad(d_lse, stats),
    )
    sk = k.shape[1]
    return dq[:, : q.shape[1], :, :d], dk[:, :sk, :, :d], dv[:, :sk, :, :d]


def flash_attention(q: Array, k: Array, v: Array, **kwargs) -> Array:
    """Exact attention by the Pallas kernels; see flash_attention_with_lse for the arguments."""
    return flash_attention_with_lse(q, k, v, **kwargs)[0]
