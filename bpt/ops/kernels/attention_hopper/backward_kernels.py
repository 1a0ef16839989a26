"""The Hopper backward: the dK/dV pass (dQ fused at head_dim 64 and 128, _dkdv), the wide
dK/dV pass above 128 (_dkdv_wide), the dQ pass (_dq) and backward(), which picks them."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from bpt.ops.kernels.attention_hopper.pipeline import (
    COMPUTE_WGS,
    DQ_SPLIT,
    GQA_SPLITS,
    LOG2E,
    MAX_FUSED_HEAD_DIM,
    QUERY_ORDER,
    REGISTERS,
    SORT_WINDOW,
    TILE,
    TILE_GROUP,
    WIDE_DQ_BLOCK_K,
    WIDE_DQ_STAGES,
    WIDE_KEYS,
    Array,
    _accumulate,
    _accumulate_t,
    _barriers,
    _check,
    _check_segments,
    _clamp,
    _cols,
    _copy_in,
    _Grid,
    _KeyStream,
    _launch,
    _launched,
    _per_warpgroup,
    _Regs,
    _Ring,
    _rows,
    _same_segment,
    _scores,
    _scores_summed,
    _scores_t,
    _scores_while,
    _smem,
    _sweep_keys,
    check_choice,
    check_dq_split,
    check_query_order,
    check_sort_window,
    check_tile_group,
    default_stages,
    key_spans,
    launch_order,
    query_spans,
)


def _dq(
    q,
    k,
    v,
    d_out,
    lse2,
    delta,
    *,
    causal,
    scale,
    stages,
    tile_group,
    interpret,
    q_seg=None,
    kv_seg=None,
    sort_window=SORT_WINDOW,
    block_k=TILE // COMPUTE_WGS,
):
    """dQ: per 2 x 64 query rows, over the key blocks (block_k keys) they see."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    bq, bk = TILE // COMPUTE_WGS, block_k
    dtype, num_tiles, num_k = q.dtype, sq // TILE, sk // bk
    stages = max(1, min(stages, num_k))
    regs = _Regs(interpret)
    c = scale * LOG2E
    grid = _Grid(num_tiles, h, b, tile_group)
    segments = q_seg is not None
    keys = _KeyStream(grid, num_k, h // hk, bk, stages, causal, segments=segments)
    spans = query_spans(q_seg, kv_seg, bk, causal) if segments else None
    order = launch_order(keys.item_steps(spans), sort_window) if segments else None

    def body(*refs):
        q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, *refs = refs
        qs_ref, ks_ref, spans_ref = (refs.pop(0), refs.pop(0), refs.pop(0)) if segments else (None,) * 3
        item = None if order is None else refs.pop(0)[lax.axis_index("cta")]
        dq_ref, q_smem, do_smem, lse_smem, delta_smem, rows_ready, *scratch = refs
        qseg_smem = scratch.pop(0) if segments else None
        k_smem, v_smem, k_ready, v_ready, k_free, v_free = (ring_scratch := scratch)[:6]
        tile, bi, head, wg, ring, key_segments = keys.open(
            k_ref, v_ref, *ring_scratch, seg_ref=ks_ref, spans_ref=spans_ref, cta=item
        )

        def _compute(wg):
            plgpu.set_max_registers(REGISTERS[0], action="increase")
            row0 = tile * TILE + wg * bq
            rows = pl.ds(row0, bq)
            my_q, my_do = q_smem.at[wg], do_smem.at[wg]
            _copy_in(
                rows_ready.at[wg],
                (q_ref.at[bi, rows, head], my_q),
                (do_ref.at[bi, rows, head], my_do),
                (lse2_ref.at[bi, head, rows], lse_smem.at[wg]),
                (delta_ref.at[bi, head, rows], delta_smem.at[wg]),
                *([(qs_ref.at[bi, rows], qseg_smem.at[wg])] if segments else []),
            )
            lse2, delta = regs.vector(lse_smem.at[wg], 1), regs.vector(delta_smem.at[wg], 1)
            my_segments = regs.vector(qseg_smem.at[wg], 1) if segments else None

            def step(j, dq, masked: bool):
                slot = ring.slot(j)
                plgpu.barrier_wait(k_ready.at[slot])
                segs = key_segments(slot, regs, load=masked) if segments else None
                s = _scores(my_q, k_smem.at[slot], interpret)
                plgpu.barrier_wait(v_ready.at[slot])
                dp = _scores(my_do, v_smem.at[slot], interpret)
                plgpu.barrier_arrive(v_free.at[slot])
                p = jnp.exp2(s * c - _rows(lse2, s.shape))
                if masked and causal:
                    p = jnp.where(regs.visible(s.shape, row0, j * bk), p, 0.0)
                if masked and segments:
                    p = jnp.where(_same_segment(my_segments, segs, p.shape), p, 0.0)
                ds = p * (dp - _rows(delta, dp.shape))
                dq = _accumulate(dq, ds.astype(dtype), k_smem.at[slot], interpret)
                plgpu.barrier_arrive(k_free.at[slot])
                return dq

            dq = _sweep_keys(step, regs.zeros((bq, d)), ring, row0=row0, bq=bq, bk=bk, causal=causal)
            my_q[...] = (dq * scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(my_q, dq_ref.at[bi, rows, head])
            plgpu.wait_smem_to_gmem(0)

        _per_warpgroup(wg, _compute)

        pl.when(wg == COMPUTE_WGS)(ring.produce)

    # dQ += dS K contracts over the block's keys: a block of 32 keys is 64 bytes of bf16, so
    # the keys take 64-byte swizzled tiles, and wgmma takes both its operands in one swizzle.
    swizzle = min(128, bk * jnp.dtype(dtype).itemsize)
    scratch = [
        _smem((COMPUTE_WGS, bq, d), dtype, swizzle=swizzle),
        _smem((COMPUTE_WGS, bq, d), dtype, swizzle=swizzle),
        _smem((COMPUTE_WGS, bq), jnp.float32, swizzled=False),
        _smem((COMPUTE_WGS, bq), jnp.float32, swizzled=False),
        _barriers(COMPUTE_WGS),
        *([_smem((COMPUTE_WGS, bq), jnp.int32, swizzled=False)] if segments else []),
        *keys.scratch(d, dtype, swizzle=swizzle),
    ]
    return _launch(
        body,
        scratch,
        out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        grid=grid,
        interpret=interpret,
        name="bpt_flash_hopper_dq",
    )(q, k, v, d_out, lse2, delta, *((q_seg, kv_seg, spans) if segments else ()), *_launched(order))


@dataclasses.dataclass(frozen=True)
class _QueryStream:
    """The key side's grid (dK/dV): CTAs over (key tiles, key/value heads, batch), each
    streaming, for every query head of its group (group 1 with gqa="expand": the grid's heads
    are then query heads), the query blocks of `bq` rows that see the
    tile (Q, dO, and the base-2 logsumexp and delta of those rows). Causal: the first key
    tiles are the heaviest, and the grid starts with them."""

    grid: _Grid  # tiles: key tiles; heads: key/value heads
    num_q: int  # query blocks per head
    group: int
    bq: int
    stages: int
    causal: bool
    segments: bool = False  # each query block's segment ids come with it
    keys: int = TILE  # key rows a CTA holds
    descending: bool = False  # each head's query blocks from the last down (QUERY_ORDERS)

    def scratch(self, d: int, dtype, swizzle: int = 128) -> list:
        """The ring's shared memory and barriers, as open_scratch() takes them. Pallas rounds
        every buffer up to 1 KiB, so the small ones share: the logsumexp's and delta's slots
        one float32 buffer [2, stages, bq]; with segments, the query blocks' segment ids and
        the CTA's own keys' (key_segments) one int32 buffer [stages + keys / bq, bq] (at head_dim
        256 _dkdv_wide has no 1 KiB to spare)."""
        rows = (self.stages, self.bq, d)
        ring = [
            _smem(rows, dtype, swizzle=swizzle),
            _smem(rows, dtype, swizzle=swizzle),
            _smem((2, self.stages, self.bq), jnp.float32, swizzled=False),
            *[_barriers(self.stages) for _ in range(4)],
            _barriers(self.stages, COMPUTE_WGS),
        ]
        if self.segments:
            seg_rows = self.stages + pl.cdiv(self.keys, self.bq)
            ring += [_smem((seg_rows, self.bq), jnp.int32, swizzled=False), _barriers(self.stages)]
        return ring

    def key_segments(self, seg_smem, wg: int, bk: int):
        """The shared memory of warpgroup wg's bk keys' segment ids in scratch()'s int32
        buffer (its rows after the ring's)."""
        first = wg * bk
        return seg_smem.at[self.stages + first // self.bq, pl.ds(first % self.bq, bk)]

    def open(
        self,
        refs,
        q_smem,
        do_smem,
        lse_smem,
        delta_smem,
        q_ready,
        do_ready,
        lse_ready,
        delta_ready,
        free,
        *seg_scratch,
        seg_ref=None,
        spans_ref=None,
        cta=None,
    ):
        """(tile, batch, kv head, warpgroup, ring, (first, stop, per_head, dense)) of this CTA
        (cta: of the grid's item number `cta`, where the CTAs launch in an order of their own):
        the query blocks first to stop - 1 see the tile, and step j of the ring holds query
        block first + j % per_head of the group's query head j // per_head. With segments
        (seg_scratch: the smem and ready barriers scratch() added; seg_ref: the queries'
        segment ids [b, sq]) the step's query segment ids come too, in the smem
        seg_scratch[0] on the barriers seg_scratch[1]; spans_ref (key_spans) gives first and
        stop (traced; else stop is num_q) and dense, the query blocks [dense[0], dense[1])
        that need no segment mask (None without segments)."""
        q_ref, do_ref, lse2_ref, delta_ref = refs
        tile, kv_head, bi = self.grid.here() if cta is None else self.grid.coords(cta)
        wg = lax.axis_index("wg")
        first = tile * self.keys // self.bq if self.causal else 0  # the first query block that sees the tile
        stop, dense = self.num_q, None
        if spans_ref is not None:
            first, stop = spans_ref[bi, tile, 0], spans_ref[bi, tile, 1]
            dense = (spans_ref[bi, tile, 2], spans_ref[bi, tile, 3])
        per_head = stop - first

        head_rows = functools.partial(self.head_rows, kv_head, first, per_head)

        def rows_of(ref):
            return lambda j: ref.at[bi, head_rows(j)[1], head_rows(j)[0]]

        def stats_of(ref):
            return lambda j: ref.at[(bi, *head_rows(j))]

        buffers = [
            (q_smem, q_ready, rows_of(q_ref)),
            (do_smem, do_ready, rows_of(do_ref)),
            (lse_smem, lse_ready, stats_of(lse2_ref)),
            (delta_smem, delta_ready, stats_of(delta_ref)),
        ]
        if self.segments:
            buffers.append((*seg_scratch, lambda j: seg_ref.at[bi, head_rows(j)[1]]))
        ring = _Ring([(free, buffers)], self.stages, self.group * per_head)
        return tile, bi, kv_head, wg, ring, (first, stop, per_head, dense)

    def item_steps(self, spans: Array) -> Array:
        """Each of the grid's items' query blocks a head, from key_spans' spans ([grid.size])."""
        tile, _, bi = self.grid.items()
        return spans[bi, tile, 1] - spans[bi, tile, 0]

    def open_scratch(self, refs, scratch, seg_ref=None, spans_ref=None, cta=None):
        """open() on scratch()'s refs as they come: (open()'s tuple, the ring's refs (Q, dO,
        logsumexp and delta smem, their ready barriers, the free barriers), the segment ids'
        (the whole int32 buffer, the ring's part of it, its ready barriers), all None without
        segments)."""
        ring, seg = (scratch[:-2], scratch[-2:]) if self.segments else (scratch, ())
        q_smem, do_smem, stats, *barriers = ring
        ring = (q_smem, do_smem, stats.at[0], stats.at[1], *barriers)
        if not seg:
            return self.open(refs, *ring, seg_ref=seg_ref, cta=cta), ring, (None, None, None)
        seg_smem, seg_ready = seg
        ring_seg = seg_smem.at[pl.ds(0, self.stages)]
        opened = self.open(refs, *ring, ring_seg, seg_ready, seg_ref=seg_ref, spans_ref=spans_ref, cta=cta)
        return opened, ring, (seg_smem, ring_seg, seg_ready)

    def block(self, first, per_head, j):
        """The query block of step j (of the head's blocks first to first + per_head - 1)."""
        r = lax.rem(j, per_head)
        return first + (per_head - 1 - r if self.descending else r)

    def steps(self, g, first, per_head, lo, hi) -> tuple:
        """The steps [start, stop) of the walked head g's query blocks [lo, hi)."""
        base = g * per_head
        if self.descending:  # block i is step base + (first + per_head - 1 - i)
            return base + first + per_head - hi, base + first + per_head - lo
        return base - first + lo, base - first + hi

    def head_rows(self, kv_head, first, per_head, j):
        """(query head, query rows) of step j."""
        return kv_head * self.group + j // per_head, pl.ds(self.block(first, per_head, j) * self.bq, self.bq)


def _dkdv(
    q,
    k,
    v,
    d_out,
    lse2,
    delta,
    *,
    causal,
    scale,
    stages,
    tile_group,
    interpret,
    dq_acc=None,
    dq_parts=False,
    q_seg=None,
    kv_seg=None,
    expand=False,
    dq_split=None,
    sort_window=SORT_WINDOW,
    query_order=QUERY_ORDER,
):
    """dK, dV: per 2 x 64 key rows of one key/value head, over the query blocks (64) of every
    query head of its group that see them, in query_order (QUERY_ORDERS). expand (GQA): per
    2 x 64 key rows of one query head's view of them instead, over that head's query blocks:
    dK and dV come out per query head ([b, sk, h, d]), the group's to be summed.

    With dq_acc (a float32 mutable array shaped like q, zeros) the pass also adds dS^T K of
    each query block to its rows of dQ (unscaled), so that no second pass recomputes P: the
    two compute warpgroups put their dS in shared memory (two buffers, so one may run a step
    ahead), and split dQ as dq_split says (DQ_SPLITS; None: DQ_SPLIT by head_dim): at head_dim
    128 each computes half of dQ's columns (one swizzled tile) over the tile's 128 keys; at
    64, where half would be half a swizzled tile, each computes all of dQ's columns over its
    own 64 keys ("keys": no dS crosses between them), or the warpgroup whose turn the step
    is (its parity) computes them over the tile's 128 keys ("steps": one part a step).
    Either leaves its part in shared memory, from where the memory warpgroup sends it to
    dq_acc with TMA's reduce-add (issuing the copy cost a compute warpgroup hundreds of
    cycles a step). dq_parts: the same in the interpreter, which has no reduce-add: each key
    tile (with "keys" each warpgroup's half of it) writes its own partial dQ, a third output
    [parts, *q.shape] whose rows above the diagonal (causal) stay unwritten."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = h // hk
    walked = 1 if expand else group  # query heads a CTA walks
    bq = bk = TILE // COMPUTE_WGS
    dtype, num_tiles, num_q = q.dtype, sk // TILE, sq // bq
    regs = _Regs(interpret)
    c = scale * LOG2E
    grid = _Grid(num_tiles, h if expand else hk, b, tile_group)
    segments = q_seg is not None
    stages = max(1, min(stages, num_q))
    queries = _QueryStream(grid, num_q, walked, bq, stages, causal, segments, descending=query_order == "descending")
    spans = key_spans(q_seg, kv_seg, TILE, causal) if segments else None
    order = launch_order(queries.item_steps(spans), sort_window) if segments else None
    with_dq = dq_acc is not None or dq_parts
    dq_split = DQ_SPLIT.get(d, "columns") if dq_split is None else dq_split  # backward checked it
    split_keys = dq_split == "keys"  # each warpgroup's dQ part: all columns over its own keys
    by_steps = dq_split == "steps"  # one warpgroup a step: all columns over the tile's keys
    half = d // COMPUTE_WGS if dq_split == "columns" else d  # dQ's columns in a part
    scratch = [
        _smem((TILE, d), dtype),  # the tile's keys, warpgroup w's rows at 64 w
        _smem((COMPUTE_WGS, bk, d), dtype),
        _barriers(COMPUTE_WGS),
        *queries.scratch(d, dtype),  # with segments, the keys' segment ids too
    ]
    if with_dq:
        scratch += [
            _smem((2, TILE, bq), dtype),  # dS^T of both warpgroups, by the step's parity
            _smem((COMPUTE_WGS, bq, half), jnp.float32),  # each warpgroup's dQ columns, for TMA
            # both warpgroups' dQ columns are in ("steps": warpgroup w's part, one a warpgroup)
            _barriers(COMPUTE_WGS, 1) if by_steps else _barriers(1, COMPUTE_WGS),
            _barriers(COMPUTE_WGS if by_steps else 1),  # the memory warpgroup has read them
        ]
        if not split_keys:  # the warpgroups read each other's dS and keys
            scratch += [
                _barriers(2, COMPUTE_WGS),  # both warpgroups' dS are in
                _barriers(1, COMPUTE_WGS),  # both warpgroups are done reading the keys
            ]

    def body(*refs):
        (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, *outs), scratch_refs = (
            refs[: -len(scratch)],
            refs[-len(scratch) :],
        )
        qs_ref, ks_ref, spans_ref = (outs.pop(0), outs.pop(0), outs.pop(0)) if segments else (None,) * 3
        item = None if order is None else outs.pop(0)[lax.axis_index("cta")]
        dq_ref = None
        if dq_acc is not None:  # mutable arrays come before the outputs
            dq_ref, *outs = outs
        elif dq_parts:
            *outs, dq_ref = outs
        dk_ref, dv_ref = outs
        k_smem, v_smem, own_ready, *ring_scratch = scratch_refs
        ds_ready = keys_read = None
        if with_dq and not split_keys:
            *ring_scratch, ds_ready, keys_read = ring_scratch
        if with_dq:
            *ring_scratch, ds_smem, dq_smem, dq_full, dq_empty = ring_scratch
        opened, ring_refs, (seg_smem, qseg_smem, qseg_ready) = queries.open_scratch(
            (q_ref, do_ref, lse2_ref, delta_ref), ring_scratch, seg_ref=qs_ref, spans_ref=spans_ref, cta=item
        )
        tile, bi, head, wg, ring, (first, stop, per_head, dense) = opened
        q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, lse_ready, delta_ready, free = ring_refs
        kv_head = lax.div(head, group) if expand else head  # the keys' head (`head`: the grid's)

        def _compute(wg):
            plgpu.set_max_registers(REGISTERS[0], action="increase")
            key0 = tile * TILE + wg * bk
            keys = pl.ds(key0, bk)
            my_k, my_v = k_smem.at[pl.ds(wg * bk, bk)], v_smem.at[wg]
            my_kseg = queries.key_segments(seg_smem, wg, bk) if segments else None
            _copy_in(
                own_ready.at[wg],
                (k_ref.at[bi, keys, kv_head], my_k),
                (v_ref.at[bi, keys, kv_head], my_v),
                *([(ks_ref.at[bi, keys], my_kseg)] if segments else []),
            )
            my_segments = regs.vector(my_kseg, 1) if segments else None  # one a row of S^T
            cols = pl.ds(0 if half == d else wg * half, half)

            def share_ds(j, ds_t):
                parity = lax.rem(j, 2)
                ds_smem.at[parity, pl.ds(wg * bk, bk)][...] = ds_t
                plgpu.commit_smem()
                if not split_keys:
                    plgpu.barrier_arrive(ds_ready.at[parity])

            def add_dq(j):
                """dQ[rows of step j, my columns] += dS^T K over the tile's keys (split_keys:
                over my keys, all columns; by_steps: all columns, at my steps only), handed
                to the memory warpgroup (send_dq)."""
                parity = lax.rem(j, 2)
                if by_steps:
                    pl.when(parity == wg)(functools.partial(add_all_dq, j, parity))
                    return
                if split_keys:
                    with jax.named_scope("dQ"):
                        part = _scores_t(ds_smem.at[parity, pl.ds(wg * bk, bk)], my_k, interpret)
                else:
                    with jax.named_scope("dQ_wait_dS"):
                        plgpu.barrier_wait(ds_ready.at[parity])
                    with jax.named_scope("dQ"):
                        part = _scores_t(ds_smem.at[parity], k_smem.at[:, cols], interpret)  # [queries, half]
                with jax.named_scope("dQ_store"):
                    pl.when(j > 0)(lambda: plgpu.barrier_wait(dq_empty.at[0]))  # step j - 1's is sent
                    dq_smem.at[wg][...] = part
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(dq_full.at[0])

            def add_all_dq(j, parity):
                """(by_steps) dQ[rows of step j, all columns] += dS^T K over the tile's keys."""
                with jax.named_scope("dQ_wait_dS"):
                    plgpu.barrier_wait(ds_ready.at[parity])
                with jax.named_scope("dQ"):
                    part = _scores_t(ds_smem.at[parity], k_smem, interpret)  # [queries, d]
                with jax.named_scope("dQ_store"):
                    pl.when(j > 1)(lambda: plgpu.barrier_wait(dq_empty.at[wg]))  # my last one is sent
                    dq_smem.at[wg][...] = part
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(dq_full.at[wg])

            def step(j, carry, masked: bool):
                dk, dv = carry
                slot = ring.slot(j)

                def stat(ready, smem):  # a per-query statistic of the slot's rows, once it arrives
                    plgpu.barrier_wait(ready.at[slot])
                    return regs.vector(smem.at[slot], 0)

                with jax.named_scope("wait_Q"):
                    plgpu.barrier_wait(q_ready.at[slot])
                with jax.named_scope("S"):  # [keys, queries]; the rows' statistics load meanwhile
                    load_lse = functools.partial(stat, lse_ready, lse_smem)
                    s_t, lse2 = _scores_while(my_k, q_smem.at[slot], interpret, load_lse)
                with jax.named_scope("P"):
                    p_t = jnp.exp2(s_t * c - _cols(lse2, s_t.shape))
                    if masked and causal:
                        q0 = queries.block(first, per_head, j) * bq
                        p_t = jnp.where(regs.visible(s_t.shape, q0, key0, queries_dim=1), p_t, 0.0)
                    if masked and segments:
                        segs = stat(qseg_ready, qseg_smem)
                        p_t = jnp.where(_same_segment(my_segments, segs, p_t.shape), p_t, 0.0)
                    elif segments:  # the ids arrived all the same
                        plgpu.barrier_wait(qseg_ready.at[slot])
                with jax.named_scope("wait_dO"):
                    plgpu.barrier_wait(do_ready.at[slot])
                with jax.named_scope("dV"):
                    dv = _accumulate(dv, p_t.astype(dtype), do_smem.at[slot], interpret)
                with jax.named_scope("dP"):
                    load_delta = functools.partial(stat, delta_ready, delta_smem)
                    dp_t, delta = _scores_while(my_v, do_smem.at[slot], interpret, load_delta)
                with jax.named_scope("dS"):
                    ds_t = (p_t * (dp_t - _cols(delta, dp_t.shape))).astype(dtype)
                if with_dq:
                    with jax.named_scope("share_dS"):
                        share_ds(j, ds_t)
                with jax.named_scope("dK"):
                    dk = _accumulate(dk, ds_t, q_smem.at[slot], interpret)
                plgpu.barrier_arrive(free.at[slot])
                if with_dq:
                    add_dq(j)
                return dk, dv

            def head_loop(g, carry):
                steps = functools.partial(queries.steps, g, first, per_head)  # of blocks [lo, hi)
                masked, unmasked = (functools.partial(step, masked=m) for m in (True, False))
                mine, clear = first, first  # my first visible block, my first off the diagonal
                if causal:
                    mine, clear = key0 // bq, pl.cdiv(key0 + bk - 1, bq)
                    if segments:  # the span may start after my first block, or stop before it
                        mine = _clamp(mine, first, stop)
                        clear = _clamp(clear, mine, stop)
                    if with_dq:  # both warpgroups take every step: dQ needs both halves of dS
                        mine = first
                # masked: [mine, lo), the diagonal's blocks and with segment ids a document's
                # edge before its dense run; [hi, stop), the edge after it
                lo, hi = clear, stop
                if segments:
                    lo = _clamp(jnp.maximum(clear, dense[0]), mine, stop)
                    hi = _clamp(dense[1], lo, stop)
                # the runs of blocks in ascending order, each with its step (None: skipped,
                # [first, mine) that only the partner warpgroup sees)
                runs = [(first, mine, None)] if causal and not with_dq else []
                if causal or segments:
                    runs.append((mine, lo, masked))
                runs.append((lo, hi, unmasked))
                if segments:
                    runs.append((hi, stop, masked))
                for run_lo, run_hi, fn in runs[::-1] if queries.descending else runs:
                    if fn is None:
                        ring.skip(*steps(run_lo, run_hi))
                    else:
                        carry = lax.fori_loop(*steps(run_lo, run_hi), fn, carry)
                return carry

            dk, dv = lax.fori_loop(0, walked, head_loop, (regs.zeros((bk, d)), regs.zeros((bk, d))))
            if with_dq:  # the last step's dQ is sent; unless split by keys the partner still reads my keys
                if not split_keys:
                    plgpu.barrier_arrive(keys_read.at[0])
                    plgpu.barrier_wait(keys_read.at[0])
                if by_steps:  # my last part (every tile has two steps or more: one each at least)
                    plgpu.barrier_wait(dq_empty.at[wg])
                else:
                    plgpu.barrier_wait(dq_empty.at[0])
            my_k[...] = (dk * scale).astype(dtype)
            my_v[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(my_k, dk_ref.at[bi, keys, head])
            plgpu.copy_smem_to_gmem(my_v, dv_ref.at[bi, keys, head])
            plgpu.wait_smem_to_gmem(0)

        _per_warpgroup(wg, _compute)

        def send_dq(j):
            """(memory warpgroup) Both compute warpgroups' dQ columns of step j into dQ
            (by_steps: the part of the warpgroup whose step it was)."""
            q_head, rows = queries.head_rows(head, first, per_head, j)
            if by_steps:
                w = lax.rem(j, 2)
                plgpu.barrier_wait(dq_full.at[w])
                dst = dq_ref.at[tile, bi, rows, q_head] if dq_parts else dq_ref.at[bi, rows, q_head]
                plgpu.copy_smem_to_gmem(dq_smem.at[w], dst, reduction_op=None if dq_parts else "add")
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.barrier_arrive(dq_empty.at[w])
                return
            plgpu.barrier_wait(dq_full.at[0])
            for w in range(COMPUTE_WGS):
                cols = pl.ds(0 if split_keys else w * half, half)
                if dq_parts:
                    part = tile * COMPUTE_WGS + w if split_keys else tile
                    plgpu.copy_smem_to_gmem(dq_smem.at[w], dq_ref.at[part, bi, rows, q_head, cols])
                else:
                    dst = dq_ref.at[bi, rows, q_head, cols]
                    plgpu.copy_smem_to_gmem(dq_smem.at[w], dst, reduction_op="add")
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.barrier_arrive(dq_empty.at[0])

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            ring.produce(released=send_dq if with_dq else None)
            plgpu.wait_smem_to_gmem(0)

    kv_shape = (b, sk, h, d) if expand else k.shape
    out_type = [jax.ShapeDtypeStruct(kv_shape, dtype), jax.ShapeDtypeStruct(kv_shape, dtype)]
    if dq_parts:
        parts = num_tiles * (COMPUTE_WGS if split_keys else 1)
        out_type.append(jax.ShapeDtypeStruct((parts, *q.shape), jnp.float32))
    return _launch(
        body,
        scratch,
        out_type=tuple(out_type),
        grid=grid,
        interpret=interpret,
        name="bpt_flash_hopper_dkdvdq" if with_dq else "bpt_flash_hopper_dkdv",
        mutable=dq_acc is not None,
    )(
        q,
        k,
        v,
        d_out,
        lse2,
        delta,
        *((q_seg, kv_seg, spans) if segments else ()),
        *_launched(order),
        *([dq_acc] if dq_acc is not None else []),
    )


def _dkdv_wide(
    q,
    k,
    v,
    d_out,
    lse2,
    delta,
    *,
    causal,
    scale,
    stages,
    tile_group,
    interpret,
    q_seg=None,
    kv_seg=None,
    expand=False,
    sort_window=SORT_WINDOW,
):
    """dK, dV above head_dim 128, where one warpgroup's 64 keys' dK and dV would not fit in its
    registers (supported()): per WIDE_KEYS key rows of one key/value head (expand: of one
    query head's view of them, as _dkdv), over the query blocks (64) that see them. The two
    compute warpgroups split each block's scores by keys and the accumulators by columns:
    warpgroup w computes S and dP for its half of the keys ([queries, keys / 2]), puts its P
    and dS in shared memory beside its partner's (two buffers, by the step's parity, so that
    one may run a step ahead), and once both are in accumulates dV += P^T dO and dK += dS^T Q
    over all the tile's keys for its half of the head's columns (4 matmuls a block, none
    repeated; dQ is the dQ pass's)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = h // hk
    walked = 1 if expand else group  # query heads a CTA walks
    bq, bk = TILE // COMPUTE_WGS, WIDE_KEYS // COMPUTE_WGS  # bk: the keys of a warpgroup's scores
    half = d // COMPUTE_WGS  # the columns of dK and dV a warpgroup accumulates
    dtype, num_tiles, num_q = q.dtype, sk // WIDE_KEYS, sq // bq
    regs = _Regs(interpret)
    c = scale * LOG2E
    grid = _Grid(num_tiles, h if expand else hk, b, tile_group)
    segments = q_seg is not None
    queries = _QueryStream(
        grid, num_q, walked, bq, max(1, min(stages, num_q)), causal, segments, keys=WIDE_KEYS
    )
    spans = key_spans(q_seg, kv_seg, WIDE_KEYS, causal) if segments else None
    order = launch_order(queries.item_steps(spans), sort_window) if segments else None
    # Every operand in 64-byte swizzled tiles: a warpgroup's half of P is 32 columns, 64
    # bytes, and wgmma takes both its operands in one swizzle.
    swizzle = 64
    scratch = [
        # the tile's keys by column halves (warpgroup w's keys at rows bk w), and its values:
        # at the end each warpgroup's dK and dV columns go out of its half, contiguous for TMA
        _smem((COMPUTE_WGS, WIDE_KEYS, half), dtype, swizzle=swizzle),
        _smem((COMPUTE_WGS, WIDE_KEYS, half), dtype, swizzle=swizzle),
        _barriers(COMPUTE_WGS),
        _smem((2, bq, WIDE_KEYS), dtype, swizzle=swizzle),  # P by the step's parity, warpgroup w's at columns bk w
        _smem((2, bq, WIDE_KEYS), dtype, swizzle=swizzle),  # dS alike
        _barriers(2, COMPUTE_WGS),  # both warpgroups' P and dS of a parity are in
        _barriers(1, COMPUTE_WGS),  # both warpgroups are done with the keys and values
        *queries.scratch(d, dtype, swizzle=swizzle),  # with segments, the keys' segment ids too
    ]

    def body(*refs):
        (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, *outs), scratch_refs = (
            refs[: -len(scratch)],
            refs[-len(scratch) :],
        )
        qs_ref, ks_ref, spans_ref = (outs.pop(0), outs.pop(0), outs.pop(0)) if segments else (None,) * 3
        item = None if order is None else outs.pop(0)[lax.axis_index("cta")]
        dk_ref, dv_ref = outs
        k_smem, v_smem, own_ready, *ring_scratch = scratch_refs
        p_smem, ds_smem, shared, done, *ring_scratch = ring_scratch
        opened, ring_refs, (seg_smem, qseg_smem, qseg_ready) = queries.open_scratch(
            (q_ref, do_ref, lse2_ref, delta_ref), ring_scratch, seg_ref=qs_ref, spans_ref=spans_ref, cta=item
        )
        tile, bi, head, wg, ring, (first, stop, per_head, dense) = opened
        q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, lse_ready, delta_ready, free = ring_refs
        kv_head = lax.div(head, group) if expand else head  # the keys' head (`head`: the grid's)

        def _compute(wg):
            plgpu.set_max_registers(REGISTERS[0], action="increase")
            tile_keys = pl.ds(tile * WIDE_KEYS, WIDE_KEYS)
            key0 = tile * WIDE_KEYS + wg * bk
            mine, keys = pl.ds(wg * bk, bk), pl.ds(key0, bk)
            my_kseg = queries.key_segments(seg_smem, wg, bk) if segments else None
            halves = [pl.ds(i * half, half) for i in range(COMPUTE_WGS)]
            _copy_in(
                own_ready.at[wg],
                *[(k_ref.at[bi, keys, kv_head, cs], k_smem.at[i, mine]) for i, cs in enumerate(halves)],
                *[(v_ref.at[bi, keys, kv_head, cs], v_smem.at[i, mine]) for i, cs in enumerate(halves)],
                *([(ks_ref.at[bi, keys], my_kseg)] if segments else []),
            )
            my_segments = regs.vector(my_kseg, 0) if segments else None  # one a column of S
            cols = halves[wg]

            def scores(rows_ref, keys_smem, during):
                """(rows @ my keys^T, [queries, bk], summed over the column halves; during())."""
                pairs = [(rows_ref.at[:, cs], keys_smem.at[i, mine]) for i, cs in enumerate(halves)]
                return _scores_summed(pairs, interpret, during)

            def step(j, carry, masked: bool):
                dk, dv = carry
                slot, parity = ring.slot(j), lax.rem(j, 2)

                def stat(ready, smem):  # a per-query statistic of the slot's rows, once it arrives
                    plgpu.barrier_wait(ready.at[slot])
                    return regs.vector(smem.at[slot], 1)

                with jax.named_scope("wait_Q"):
                    plgpu.barrier_wait(q_ready.at[slot])
                with jax.named_scope("S"):  # [queries, my keys]; the rows' statistics load meanwhile
                    load_lse = functools.partial(stat, lse_ready, lse_smem)
                    s, lse2 = scores(q_smem.at[slot], k_smem, load_lse)
                with jax.named_scope("P"):
                    p = jnp.exp2(s * c - _rows(lse2, s.shape))
                    if masked and causal:
                        q0 = (first + lax.rem(j, per_head)) * bq
                        p = jnp.where(regs.visible(s.shape, q0, key0), p, 0.0)
                    if masked and segments:
                        segs = stat(qseg_ready, qseg_smem)
                        p = jnp.where(_same_segment(segs, my_segments, p.shape), p, 0.0)
                    elif segments:  # the ids arrived all the same
                        plgpu.barrier_wait(qseg_ready.at[slot])
                with jax.named_scope("wait_dO"):
                    plgpu.barrier_wait(do_ready.at[slot])
                with jax.named_scope("dP"):
                    load_delta = functools.partial(stat, delta_ready, delta_smem)
                    dp, delta = scores(do_smem.at[slot], v_smem, load_delta)
                with jax.named_scope("share_P_dS"):
                    p_smem.at[parity, :, mine][...] = p.astype(dtype)
                    ds_smem.at[parity, :, mine][...] = (p * (dp - _rows(delta, dp.shape))).astype(dtype)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(shared.at[parity])
                    plgpu.barrier_wait(shared.at[parity])
                with jax.named_scope("dV"):
                    dv = _accumulate_t(dv, p_smem.at[parity], do_smem.at[slot, :, cols], interpret)
                with jax.named_scope("dK"):
                    dk = _accumulate_t(dk, ds_smem.at[parity], q_smem.at[slot, :, cols], interpret)
                plgpu.barrier_arrive(free.at[slot])
                return dk, dv

            def head_loop(g, carry):
                base = g * per_head - first  # step of query block i is base + i
                if segments:  # masked: the diagonal's block (if the span holds it), the documents' edges
                    clear = _clamp(tile * WIDE_KEYS // bq + 1, first, stop) if causal else first
                    lo = _clamp(jnp.maximum(clear, dense[0]), first, stop)
                    hi = _clamp(dense[1], lo, stop)
                    masked, unmasked = (functools.partial(step, masked=m) for m in (True, False))
                    carry = lax.fori_loop(base + first, base + lo, masked, carry)
                    carry = lax.fori_loop(base + lo, base + hi, unmasked, carry)
                    return lax.fori_loop(base + hi, base + stop, masked, carry)
                if causal:  # the tile's first query block holds the diagonal; the rest see every key
                    carry = step(base + first, carry, masked=True)
                    start = base + first + 1
                else:
                    start = base + first
                return lax.fori_loop(start, base + stop, functools.partial(step, masked=False), carry)

            zeros = regs.zeros((WIDE_KEYS, half))
            dk, dv = lax.fori_loop(0, walked, head_loop, (zeros, zeros))
            plgpu.barrier_arrive(done.at[0])  # my columns of the tile go where both read keys and values
            plgpu.barrier_wait(done.at[0])
            out_k, out_v = k_smem.at[wg], v_smem.at[wg]
            out_k[...] = (dk * scale).astype(dtype)
            out_v[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_k, dk_ref.at[bi, tile_keys, head, cols])
            plgpu.copy_smem_to_gmem(out_v, dv_ref.at[bi, tile_keys, head, cols])
            plgpu.wait_smem_to_gmem(0)

        _per_warpgroup(wg, _compute)

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            ring.produce()

    kv_shape = (b, sk, h, d) if expand else k.shape
    return _launch(
        body,
        scratch,
        out_type=(jax.ShapeDtypeStruct(kv_shape, dtype), jax.ShapeDtypeStruct(kv_shape, dtype)),
        grid=grid,
        interpret=interpret,
        name="bpt_flash_hopper_dkdv_wide",
    )(q, k, v, d_out, lse2, delta, *((q_seg, kv_seg, spans) if segments else ()), *_launched(order))


def _dq_accumulator(q: Array, d_out: Array) -> Array:
    """The fused backward's float32 dQ buffer, zeros shaped like q, made once this call's d_out
    exists. A bare jnp.zeros is the same constant in every layer: XLA merged the unrolled
    layers' zeros into one fusion that wrote all 24 at once (GPT-1B at 32K: 6 GiB of
    [32768, 16, 128] float32, each held until its layer's kernel ran). Behind an optimization
    barrier with d_out, each layer's buffer is made after its d_out: GPT-1B's step at 32K on
    an H200 compiled to 51.6 GiB instead of 56.0, at the same speed (docs/notes/step_speed.md,
    2026-11-30). Only a scalar zero passes the barrier, broadcast after it: with the whole
    buffer behind it, XLA copied the barrier's output into the kernel's aliased operand, 47
    copies of 128 MiB in the 8K step (2026-12-05)."""
    zero, _ = lax.optimization_barrier((jnp.zeros((), jnp.float32), d_out))
    return jnp.broadcast_to(zero, q.shape)


def check_gqa(gqa: str, setting: str = "gqa") -> None:
    check_choice(gqa, GQA_SPLITS, setting)


def backward(
    q,
    k,
    v,
    d_out,
    lse,
    delta,
    *,
    causal: bool,
    scale: float,
    stages: int | None = None,
    fused_dq: bool | None = None,
    tile_group: int | None = TILE_GROUP,
    q_seg: Array | None = None,
    kv_seg: Array | None = None,
    gqa: str = "expand",
    dq_split: str | None = None,
    sort_window: int = SORT_WINDOW,
    query_order: str = QUERY_ORDER,
    interpret: bool = False,
):
    """(dq, dk, dv) from the forward's logsumexp and delta = rowsum(dO * O) - d_lse, [b, h, s].

    fused_dq: True (or None, the default): one pass that adds dQ into a float32 buffer as it
    computes dK and dV (5 matmuls a block; at head_dim 128 each compute warpgroup takes 64 of
    dQ's columns, one swizzled tile wide, at 64 all of them over its own keys, or over the
    tile's keys at every other step: dq_split, DQ_SPLITS); False: a second pass for dQ that
    recomputes P (7). stages: the query ring's depth (None: default_stages). tile_group,
    q_seg, kv_seg, sort_window: see forward. query_order (QUERY_ORDERS): the order in which
    the dK/dV pass walks a tile's query blocks up to head_dim 128 (above, ascending).

    gqa, with fewer key/value heads than query heads (GQA_SPLITS): "expand" (the default) runs
    the dK/dV pass as if every query head had its own keys and values (a CTA a query head's
    key tile, reading its group's keys) and sums each group's dK and dV in float32 after it;
    "walk" gives each key/value head's tile one CTA that walks the group's query heads: fewer
    and longer CTAs, which at 4K tokens with 32/4 heads are 128 for an H200's 132 SMs (0.78x
    expand's speed there, 0.96x at 64K; docs/notes/attention_kernels.md). expand writes the
    per-head dK and dV (two arrays shaped like q, in its dtype) before the sum."""
    _check(q, k, causal, backward=True)
    wide_dq_stages = WIDE_DQ_STAGES if stages is None else min(stages, WIDE_DQ_STAGES)
    stages = default_stages(q.shape[-1], backward=True) if stages is None else stages
    if fused_dq and q.shape[-1] > MAX_FUSED_HEAD_DIM:
        raise ValueError(
            f"fused_dq=True at head_dim {q.shape[-1]}: the backward fuses dQ up to head_dim "
            f"{MAX_FUSED_HEAD_DIM}; allowed there: None or False"
        )
    fused_dq = True if fused_dq is None else fused_dq
    check_tile_group(tile_group)
    check_gqa(gqa)
    check_dq_split(dq_split, q.shape[-1])
    check_sort_window(sort_window)
    check_query_order(query_order)
    _check_segments(q, k, q_seg, kv_seg)
    group = q.shape[2] // k.shape[2]
    expand = gqa == "expand" and group > 1
    kw = dict(
        causal=causal,
        scale=scale,
        stages=stages,
        tile_group=tile_group,
        interpret=interpret,
        q_seg=q_seg,
        kv_seg=kv_seg,
        sort_window=sort_window,
    )
    lse2 = lse * LOG2E  # both passes compute p = exp2(s * log2(e) / sqrt(d) - lse2)
    b, sk, hk, d = k.shape

    def summed(dk, dv):  # expand's per-query-head dK and dV, summed over each group
        if not expand:
            return dk, dv
        return tuple(x.reshape(b, sk, hk, group, d).sum(3, dtype=jnp.float32).astype(k.dtype) for x in (dk, dv))

    if d > MAX_FUSED_HEAD_DIM:
        dk, dv = summed(*_dkdv_wide(q, k, v, d_out, lse2, delta, expand=expand, **kw))
        kw.update(stages=wide_dq_stages)
        return _dq(q, k, v, d_out, lse2, delta, block_k=WIDE_DQ_BLOCK_K, **kw), dk, dv
    dkdv = functools.partial(_dkdv, q, k, v, d_out, lse2, delta, expand=expand, query_order=query_order, **kw)
    if not fused_dq:
        dk, dv = summed(*dkdv())
        return _dq(q, k, v, d_out, lse2, delta, **kw), dk, dv
    if interpret:
        dk, dv, parts = dkdv(dq_parts=True, dq_split=dq_split)
        per_tile = parts.shape[0] // (k.shape[1] // TILE)  # part p holds keys of tile p // per_tile
        tiles, positions = jnp.arange(parts.shape[0]) // per_tile, jnp.arange(q.shape[1])
        if q_seg is not None:  # it wrote the query blocks of its tile's span
            bq = TILE // COMPUTE_WGS
            span = key_spans(q_seg, kv_seg, TILE, causal)[:, tiles, :2] * bq  # [b, parts, 2] rows
            seen = (positions >= span[..., :1]) & (positions < span[..., 1:])  # [b, parts, sq]
            parts = jnp.where(jnp.swapaxes(seen, 0, 1)[..., None, None], parts, 0.0)
        elif causal:  # it wrote the query rows from 128 t on
            seen = positions[None, :] >= TILE * tiles[:, None]
            parts = jnp.where(seen[:, None, :, None, None], parts, 0.0)
        dq = parts.sum(0)
    else:
        acc = jax.new_ref(_dq_accumulator(q, d_out))
        dk, dv = dkdv(dq_acc=acc, dq_split=dq_split)
        dq = acc[...]
    return (dq * scale).astype(q.dtype), *summed(dk, dv)
