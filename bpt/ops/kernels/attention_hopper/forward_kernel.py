"""The Hopper forward: S = Q K^T, online softmax, O += P V over a ring of key blocks, under
one of four schedules (SCHEDULES), a CTA a query tile or persistent (a CTA an SM taking
tiles in turn)."""

from __future__ import annotations

import functools
import heapq

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from bpt.ops.kernels.attention_hopper.pipeline import (
    COMPUTE_WGS,
    LN2,
    LOG2E,
    MAX_HEAD_DIM_BLOCK_128,
    REGISTERS,
    SORT_WINDOW,
    TILE,
    TILE_GROUP,
    Array,
    _accumulate,
    _barriers,
    _check,
    _check_segments,
    _copy_in,
    _Grid,
    _KeyStream,
    _launch,
    _launched,
    _per_warpgroup,
    _Regs,
    _rows,
    _same_segment,
    _scores,
    _smem,
    _sweep_keys,
    check_choice,
    check_sort_window,
    check_tile_group,
    default_stages,
    device_sms,
    launch_order,
    query_spans,
)

SCHEDULES = ("serial", "pingpong", "overlap", "overlap_pingpong")


def default_schedule(causal: bool, head_dim: int, segments: bool = False) -> str:
    """The forward's schedule where none is asked: "overlap" at head_dim 256, and at 128 where
    no block is masked (non-causal, no segment ids); "pingpong" elsewhere (and with segment
    ids, as measured when every block they streamed was masked). On an H200
    (docs/notes/attention_kernels.md, 2026-12-02) overlap ran the forward faster than
    ping-pong: non-causal 3.6-5.2% at head_dim 128 and 12% at 256, causal 9-14% at 256 and
    0-2% at 128 (forward + backward there within 1.5% either way, so ping-pong stays); at 64
    non-causal 3.7% slower."""
    if segments:
        return "pingpong"
    return "overlap" if head_dim >= 256 or (head_dim >= 128 and not causal) else "pingpong"


def forward_block_k(head_dim: int, block_k: int = 128) -> int:
    """The forward's key block: block_k, at most 64 above head_dim 128 (MAX_HEAD_DIM_BLOCK_128)."""
    return min(block_k, 64) if head_dim > MAX_HEAD_DIM_BLOCK_128 else block_k


def check_persistent(persistent: bool | int, setting: str = "persistent") -> None:
    if not isinstance(persistent, int) or (not isinstance(persistent, bool) and persistent < 1):
        raise ValueError(f"{setting} must be a bool or a positive int (CTAs); got {persistent!r}")


def persistent_ctas(persistent: bool | int, items: int, setting: str = "persistent") -> int | None:
    """The CTAs of a persistent kernel over `items` tiles (None: a CTA a tile): True, the
    device's SMs; an int, that many; never more than the items."""
    check_persistent(persistent, setting)
    if persistent is False:
        return None
    ctas = device_sms() if persistent is True else persistent
    return min(ctas, items)


# Shared memory a persistent forward's two Q buffers and its ring may take (bytes; a CTA has
# 227 KiB, and the rest is the small buffers and barriers): at head_dim 128, 64 KiB and 128.
Q_BUFFERS_ROOM = 200 * 1024
# A tile's own cost, in key blocks' time, where persistent_order deals tiles out: its Q's load
# and its output's store took 2,411 and 1,255 cycles a tile against 3,385 a key block
# (profile_kernel at 16K with 8 documents, one H200, 2026-12-03).
TILE_COST = 1


def persistent_order(grid: _Grid, ctas: int, steps: Array) -> Array:
    """Which of `grid`'s items each of `ctas` persistent CTAs takes, in turn: [ctas, 1 + n]
    int32, column 0 the CTA's count of items, then their numbers (-1 after its last).

    steps: each item's key blocks ([grid.size]).
    - A static mask's (numpy): the launch order dealt as the GPU deals a CTA a tile, each item
      in turn to the CTA with the least work so far (its items' steps, plus TILE_COST each),
      so that the CTAs that run at once still share a head's keys in L2, as a CTA a tile's do.
    - Segment spans' (traced): sorted by their steps, the longest first (ties in launch
      order), and dealt out in a snake, round r to CTAs 0..ctas-1 when r is even and back
      when odd (a list schedule is a loop, slow in XLA).
    Dealing the launch order in turn (c, c + ctas, ...) left one CTA 1.57x the mean work at
    16K causal and 1.48x with 8 documents (132 CTAs, 16 heads); on an H200 the snake took
    the persistent forward there from 359 to 404 TFLOP/s (docs/notes/attention_kernels.md,
    2026-12-03)."""
    if isinstance(steps, jax.Array):
        rounds = -(-grid.size // ctas)
        ranked = jnp.argsort(-steps, stable=True).astype(jnp.int32)
        dealt = jnp.concatenate([ranked, jnp.full((rounds * ctas - grid.size,), -1, jnp.int32)])
        dealt = dealt.reshape(rounds, ctas)
        snake = jnp.where((jnp.arange(rounds) % 2 == 1)[:, None], dealt[:, ::-1], dealt).T
        counts = jnp.full((ctas, 1), rounds, jnp.int32) - (snake[:, -1:] < 0)
        return jnp.concatenate([counts, snake], axis=1)
    free = [(0, c) for c in range(ctas)]  # (work so far, CTA): a heap
    dealt = [[] for _ in range(ctas)]
    for item, n in enumerate(np.asarray(steps).tolist()):
        work, c = heapq.heappop(free)
        dealt[c].append(item)
        heapq.heappush(free, (work + n + TILE_COST, c))
    table = np.full((ctas, 1 + max(map(len, dealt))), -1, np.int32)
    for c, items in enumerate(dealt):
        table[c, 0] = len(items)
        table[c, 1 : 1 + len(items)] = items
    return table


def check_schedule(schedule: str | None, setting: str = "schedule") -> None:
    if schedule is not None:
        check_choice(schedule, SCHEDULES, setting)


def forward(
    q: Array,
    k: Array,
    v: Array,
    *,
    causal: bool,
    scale: float,
    block_k: int = 128,
    stages: int | None = None,
    schedule: str | None = None,
    tile_group: int | None = TILE_GROUP,
    q_seg: Array | None = None,
    kv_seg: Array | None = None,
    persistent: bool | int = False,
    sort_window: int = SORT_WINDOW,
    interpret: bool = False,
) -> tuple[Array, Array]:
    """(out [b, s, h, d], logsumexp [b, h, s] float32); see supported() for what it takes.

    q_seg, kv_seg: segment ids ([b, sq], [b, sk] int32), or None: a query sees only the keys
    of its segment (where the ids are sorted, the blocks outside the tile's documents are
    skipped and those wholly inside its one document run unmasked: segment_spans; else
    every block is streamed and masked). A row that sees no key gets 0 and a logsumexp of
    +inf, as the Triton kernels' do.

    schedule, how a compute warpgroup orders its matmuls and its softmax:
    - "serial": per key block, S = Q K^T, then its softmax, then O += P V, each waited for.
    - "overlap": software-pipelined within the warpgroup: block j's S and block j-1's P V are
      issued together, and block j's softmax runs while P V is still on the tensor cores;
      under a causal mask the blocks the diagonal crosses run after the pipeline, serially.
    - "pingpong" / "overlap_pingpong": either, with the two compute warpgroups taking turns
      (a two-arrival barrier they meet at twice a block, the second warpgroup one meeting
      behind), so that one's matmuls run while the other computes its softmax.
    None (the default): default_schedule(), overlap at head_dim 256 and at 128 where no block
    is masked, else pingpong. On an H100 at d=128, causal (docs/notes/attention_kernels.md),
    pingpong was 5-10% faster than serial. On an H200 (2026-12-02) overlap ran the forward
    3.6-5.2% ahead of pingpong non-causal at 128, 9-14% causal at 256, 0-2% causal at 128
    (forward + backward there within 1.5% either way); overlap_pingpong 3.6-5% behind
    pingpong causal at 128.

    tile_group: the order in which the CTAs launch (_Grid): runs of up to this many tiles of
    one (batch, head) (None, the default: all of them), so that the CTAs that run at once
    read the same keys and values.
    block_k: 64 or 128 keys a block; above head_dim 128 at most 64 (MAX_HEAD_DIM_BLOCK_128).
    persistent: False (the default), a CTA a tile; True, one CTA an SM, each taking its
    tiles in turn (persistent_order: dealt out so that each CTA's add up to about the same),
    its ring of keys and values running on from one tile to the next and the next tile's Q
    loading during this one (up to head_dim 128), so that no CTA is launched for a tile; an
    int, that many CTAs.
    sort_window: with segment ids, a CTA a tile, the CTAs launch sorted by their tiles' key
    blocks within windows of this many waves of the grid's order (sorted_launch; default
    SORT_WINDOW, 4) where the grid holds at most SORT_WAVES waves (launch_order); 0: in the
    grid's order.
    """
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    _check(q, k, causal, hopper_block_k=block_k)
    block_k = forward_block_k(d, block_k)
    stages = default_stages(d, backward=False) if stages is None else stages
    bq, bk, dtype = TILE // COMPUTE_WGS, block_k, q.dtype
    check_schedule(schedule)
    segments = _check_segments(q, k, q_seg, kv_seg)
    if schedule is None:
        schedule = default_schedule(causal, d, segments=segments)
    check_tile_group(tile_group)
    check_sort_window(sort_window)
    overlap, pingpong = schedule.startswith("overlap"), schedule.endswith("pingpong")
    num_tiles, num_k = sq // TILE, sk // bk
    ctas = persistent_ctas(persistent, num_tiles * h * b)
    # overlap waits for block j's keys while it holds block j-1's values: two slots at least,
    # and a ring that refills keys and values each as soon as they are free
    stages = max(2 if overlap else 1, min(stages, num_k))
    regs = _Regs(interpret)
    c = scale * LOG2E
    grid = _Grid(num_tiles, h, b, tile_group)
    keys = _KeyStream(grid, num_k, h // hk, bk, stages, causal, eager=overlap, segments=segments)
    spans = query_spans(q_seg, kv_seg, bk, causal) if segments else None
    # a persistent CTA loads the next tile's queries while it computes this one's, into a
    # second buffer where shared memory has room for it (not at head_dim 256)
    q_bufs = 1
    # the items each persistent CTA takes ([ctas, 1 + n]), or the order a CTA a tile takes
    # them in ([n]; None: the grid's)
    if ctas is not None:
        order = jnp.asarray(persistent_order(grid, ctas, keys.item_steps(spans)))
        size = q.dtype.itemsize
        q_bufs = 2 if 2 * COMPUTE_WGS * bq * d * size + stages * 2 * bk * d * size <= Q_BUFFERS_ROOM else 1
    else:
        order = launch_order(keys.item_steps(spans), sort_window) if segments else None

    def body(*refs):
        q_ref, k_ref, v_ref, *refs = refs
        qs_ref, ks_ref, spans_ref = (refs.pop(0), refs.pop(0), refs.pop(0)) if segments else (None,) * 3
        order_ref = refs.pop(0) if order is not None else None
        o_ref, lse_ref, q_smem, lse_smem, q_ready, turn, *scratch = refs
        qseg_smem = scratch.pop(0) if segments else None
        qseg_ready = scratch.pop(0) if segments and q_bufs == 2 else None
        k_smem, v_smem, k_ready, v_ready, k_free, v_free = (ring_scratch := scratch)[:6]
        wg = lax.axis_index("wg")

        def tile_of(cta=None, offset=0):
            """keys.open() of this CTA's tile (cta None) or of work item `cta`."""
            return keys.open(
                k_ref, v_ref, *ring_scratch, seg_ref=ks_ref, spans_ref=spans_ref, cta=cta, offset=offset
            )

        turn = turn.at[0]

        def meet():
            """Both compute warpgroups reach this point (pingpong; else nothing)."""
            if pingpong:
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(turn)

        def mine(ref, buf, wg):
            """Warpgroup wg's part of a per-row buffer (of buffer buf where there are two)."""
            return ref.at[buf, wg] if q_bufs == 2 else ref.at[wg]

        def ready(barriers, buf, wg):
            """Warpgroup wg's barrier of buffer buf."""
            return barriers.at[buf * COMPUTE_WGS + wg]

        def load_q(wg, tile, bi, head, buf):
            """A persistent CTA's next Q: start the TMA copies of warpgroup wg's rows of Q
            (and their segment ids, on barriers of their own) of a tile into buffer buf;
            wait_q(wg, buf) waits for them."""
            rows = pl.ds(tile * TILE + wg * bq, bq)
            copies = [(q_ref.at[bi, rows, head], q_smem, q_ready)]
            if segments:
                copies.append((qs_ref.at[bi, rows], qseg_smem, qseg_ready))
            for src, dst, barriers in copies:
                plgpu.copy_gmem_to_smem(src, mine(dst, buf, wg), ready(barriers, buf, wg))

        def wait_q(wg, buf):
            plgpu.barrier_wait(ready(q_ready, buf, wg))
            if segments:
                plgpu.barrier_wait(ready(qseg_ready, buf, wg))

        def compute(wg, opened, buf=0, prefetch=None):
            """Compute warpgroup wg's rows of one tile (opened: tile_of()'s), its Q in buffer
            buf. prefetch None: this tile's Q is loaded here; else its copies were started
            (load_q), and prefetch() runs once they are in (a persistent CTA's next Q)."""
            tile, bi, head, _, ring, key_segments = opened
            row0 = tile * TILE + wg * bq
            my_q, my_lse = mine(q_smem, buf, wg), mine(lse_smem, buf, wg)
            rows = pl.ds(row0, bq)
            with jax.named_scope("wait_Q"):
                if prefetch is None:  # one copy after the other on one barrier, each awaited
                    _copy_in(
                        ready(q_ready, buf, wg),
                        (q_ref.at[bi, rows, head], my_q),
                        *([(qs_ref.at[bi, rows], mine(qseg_smem, buf, wg))] if segments else []),
                    )
                else:
                    wait_q(wg, buf)
            if prefetch is not None:
                prefetch()
            my_segments = regs.vector(mine(qseg_smem, buf, wg), 1) if segments else None

            def softmax(j, s, m, denom, masked: bool, segs=None):
                """Block j's probabilities (in the inputs' dtype), the new running max and
                denominator, and the factor that rescales what was summed before. masked:
                the causal mask (causal) and the segment mask (segments; segs: the block's key
                segment ids) apply."""
                if masked and causal:
                    s = jnp.where(regs.visible(s.shape, row0, j * bk), s, -jnp.inf)
                if masked and segments:
                    s = jnp.where(_same_segment(my_segments, segs, s.shape), s, -jnp.inf)
                # The running max is kept in base-2 units (c > 0 commutes with max), so that
                # the scale goes into each exponential's argument: one FFMA an element where
                # scaling the scores first took an FMUL more (the forward 2-6% faster).
                m_new = jnp.maximum(m, s.max(axis=1) * c)
                # with segments a row may have seen no key yet: its max is still -inf
                shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if segments else m_new
                alpha = jnp.exp2(m - shift)
                p = jnp.exp2(s * c - _rows(shift, s.shape))
                return p.astype(dtype), m_new, denom * alpha + p.sum(axis=1), alpha

            def arrived(slot, masked: bool = True):
                """Wait for the slot's keys and segment ids; the ids of a masked block (None
                without segments or mask)."""
                plgpu.barrier_wait(k_ready.at[slot])
                return key_segments(slot, regs, load=masked) if segments else None

            def serial(j, carry, masked: bool):
                acc, m, denom = carry
                slot = ring.slot(j)
                with jax.named_scope("wait_K"):
                    segs = arrived(slot, masked)
                with jax.named_scope("S"):  # and, ping-pong, the partner's turn
                    s = _scores(my_q, k_smem.at[slot], interpret, issued=meet)
                plgpu.barrier_arrive(k_free.at[slot])
                with jax.named_scope("softmax"):
                    p, m, denom, alpha = softmax(j, s, m, denom, masked, segs)
                    acc = acc * _rows(alpha, acc.shape)
                if pingpong:  # my softmax is done; the tensor cores are mine once the partner's is
                    plgpu.barrier_arrive(turn)
                with jax.named_scope("wait_V"):
                    plgpu.barrier_wait(v_ready.at[slot])
                    if pingpong:
                        plgpu.barrier_wait(turn)
                with jax.named_scope("PV"):
                    acc = _accumulate(acc, p, v_smem.at[slot], interpret)
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m, denom

            def pipelined(j, carry):
                """Block j's S with block j-1's P V in flight; the softmax of j overlaps P V.
                Block j needs no mask (the diagonal does not cross it; with segment ids, it is
                in the dense run)."""
                acc, m, denom, p_prev = carry
                slot, prev = ring.slot(j), ring.slot(j - 1)
                segs = arrived(slot, masked=False)
                plgpu.barrier_wait(v_ready.at[prev])
                if interpret:  # the same order of barriers, with plain dots
                    s = _scores(my_q, k_smem.at[slot], interpret, issued=meet)
                    plgpu.barrier_arrive(k_free.at[slot])
                    p, m, denom, alpha = softmax(j, s, m, denom, False, segs)
                    meet()
                    acc = _accumulate(acc, p_prev, v_smem.at[prev], interpret)
                else:

                    def both(s_ref, o_ref):
                        o_ref[...] = acc
                        plgpu.wgmma(s_ref, my_q, k_smem.at[slot].transpose((1, 0)))
                        plgpu.wgmma(o_ref, p_prev, v_smem.at[prev])
                        meet()
                        s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # S done, P V may run on
                        plgpu.barrier_arrive(k_free.at[slot])
                        out = softmax(j, s, m, denom, False, segs)
                        meet()
                        return (o_ref[...], *out)

                    acc, p, m, denom, alpha = pl.run_scoped(
                        both, plgpu.ACC((bq, bk), jnp.float32), plgpu.ACC((bq, d), jnp.float32)
                    )
                plgpu.barrier_arrive(v_free.at[prev])
                return acc * _rows(alpha, acc.shape), m, denom, p

            def meet_twice():  # where a skipped block would have met the partner
                meet()
                meet()

            def overlapped(lo, hi, carry):
                """Block lo's S and softmax (masked: masking a block that needs no mask changes
                nothing), then the pipeline over the unmasked blocks up to hi and its last
                P V; the blocks the diagonal crosses (and, with segment ids, a document's
                edges) are left to the serial step. With the diagonal's blocks in the
                pipeline as well the causal forward ran 9-11% slower at every length
                (docs/notes/attention_kernels.md, 2026-12-02, 13:10 UTC)."""
                acc, m, denom = carry
                first = ring.slot(lo)
                segs = arrived(first)
                s = _scores(my_q, k_smem.at[first], interpret, issued=meet)
                plgpu.barrier_arrive(k_free.at[first])
                p, m, denom, alpha = softmax(lo, s, m, denom, masked=causal or segments, segs=segs)
                if segments:  # the edge blocks before lo are summed in acc already
                    acc = acc * _rows(alpha, acc.shape)
                meet()
                end = jnp.maximum(hi, lo + 1)
                with jax.named_scope("pipelined"):  # the unmasked blocks, S and P V overlapped
                    acc, m, denom, p = lax.fori_loop(lo + 1, end, pipelined, (acc, m, denom, p))
                last = ring.slot(end - 1)
                plgpu.barrier_wait(v_ready.at[last])
                acc = _accumulate(acc, p, v_smem.at[last], interpret)
                plgpu.barrier_arrive(v_free.at[last])
                return (acc, m, denom), end

            sweep = dict(row0=row0, bq=bq, bk=bk, causal=causal, skipped=meet_twice)
            if wg == 1:  # the second warpgroup runs one meeting behind
                meet()
            carry = (regs.zeros((bq, d)), regs.zeros((bq,), -jnp.inf), regs.zeros((bq,)))
            unmasked = overlapped if overlap else None
            acc, m, denom = _sweep_keys(serial, carry, ring, unmasked=unmasked, **sweep)
            if wg == 0:
                meet()
            with jax.named_scope("store"):
                if segments:  # a row that saw no key: 0, and a logsumexp of +inf
                    seen = denom > 0.0
                    denom = jnp.where(seen, denom, 1.0)
                my_q[...] = (acc * _rows(1.0 / denom, acc.shape)).astype(dtype)
                lse = (m + jnp.log2(denom)) * LN2
                my_lse[...] = jnp.where(seen, lse, jnp.inf) if segments else lse
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(my_q, o_ref.at[bi, rows, head])
                plgpu.copy_smem_to_gmem(my_lse, lse_ref.at[bi, head, rows])
                # a CTA a tile waits for its writes; a persistent CTA with one Q buffer for
                # the buffers read (its next Q lands in my_q), and with two, at its next
                # tile, before that tile's next Q lands here (prefetch); the writes to HBM
                # after its last tile
                if q_bufs == 1:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=ctas is not None)

        if ctas is None:  # a CTA a tile: the grid's, or the order's
            opened = tile_of(None if order is None else order_ref[lax.axis_index("cta")])

            def _compute(wg):
                plgpu.set_max_registers(REGISTERS[0], action="increase")
                compute(wg, opened)

            _per_warpgroup(wg, _compute)
            pl.when(wg == COMPUTE_WGS)(opened[4].produce)
            return

        # persistent: CTA c takes the items of row c of persistent_order's table in turn, its
        # ring running on from one to the next
        cta = lax.axis_index("cta")
        items = order_ref[cta, 0]

        def each_tile(run):
            """run(i, opened) on each of this CTA's items in turn; the ring's steps in all."""

            def one(i, offset):
                opened = tile_of(order_ref[cta, 1 + i], offset)
                run(i, opened)
                return offset + opened[4].length

            return lax.fori_loop(0, items, one, jnp.int32(0))

        def each_compute(wg, i, opened):
            if q_bufs == 1:
                return compute(wg, opened)
            buf = lax.rem(i, 2)

            def prefetch():  # tile i + 1's Q into the buffer tile i - 1's output leaves
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

                @pl.when(i + 1 < items)
                def _():
                    tile, head, bi = keys.coords(order_ref[cta, 2 + i])
                    load_q(wg, tile, bi, head, 1 - buf)

            compute(wg, opened, buf, prefetch)

        def _persistent_compute(wg):
            plgpu.set_max_registers(REGISTERS[0], action="increase")
            if q_bufs == 2:
                tile, head, bi = keys.coords(order_ref[cta, 1])
                load_q(wg, tile, bi, head, 0)
            each_tile(functools.partial(each_compute, wg))
            plgpu.wait_smem_to_gmem(0)  # the last tiles' outputs written

        def _persistent_produce():
            plgpu.set_max_registers(REGISTERS[1], action="decrease")
            total = each_tile(lambda i, opened: opened[4].produce_steps())
            tile_of(cta)[4].drain(total)  # any tile's ring: the same slots and barriers

        _per_warpgroup(wg, _persistent_compute)
        pl.when(wg == COMPUTE_WGS)(_persistent_produce)

    bufs = (2,) if q_bufs == 2 else ()
    scratch = [
        _smem((*bufs, COMPUTE_WGS, bq, d), dtype),  # Q, then O
        _smem((*bufs, COMPUTE_WGS, bq), jnp.float32, swizzled=False),
        _barriers(q_bufs * COMPUTE_WGS),
        _barriers(1, COMPUTE_WGS),  # the warpgroups' meeting point (pingpong)
        *([_smem((*bufs, COMPUTE_WGS, bq), jnp.int32, swizzled=False)] if segments else []),
        *([_barriers(q_bufs * COMPUTE_WGS)] if segments and q_bufs == 2 else []),  # load_q's
        *keys.scratch(d, dtype),
    ]
    return _launch(
        body,
        scratch,
        out_type=(jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((b, h, sq), jnp.float32)),
        grid=grid,
        interpret=interpret,
        name="bpt_flash_hopper_fwd",
        ctas=ctas,
    )(q, k, v, *((q_seg, kv_seg, spans) if segments else ()), *_launched(order))
