"""What every Hopper attention kernel is built from: the constants and checks, the matmuls
(wgmma off the interpreter, dots in it), the register helpers, the shared-memory ring the
memory warpgroup fills (_Ring), the query side's stream of key blocks (_KeyStream), the
launch order (_Grid) and the launch itself (_launch)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from bpt.ops.segments import segment_spans

Array = jax.Array
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
COMPUTE_WGS = 2  # compute warpgroups per CTA; one more moves data
TILE = 128  # the lengths must be multiples of this (two compute warpgroups' 64 rows)
BLOCKS = (64, 128)  # the block sizes the kernels take
# Above this head_dim the forward's key blocks are 64 keys (a ring of two 128-key blocks of
# keys and values beside the query tile is 320 KiB at head_dim 256, over the 227 KiB a CTA has).
MAX_HEAD_DIM_BLOCK_128 = 128
# Above this head_dim one warpgroup's dK and dV would not fit in its registers (2 x 64 x 256
# float32 a warpgroup is 256 a thread at 256): the backward is then _dkdv_wide's, whose two
# warpgroups split each tile's columns, and the dQ pass's (no fused dQ).
MAX_FUSED_HEAD_DIM = 128
WIDE_KEYS = 64  # key rows a CTA of _dkdv_wide holds
# The dQ pass above MAX_FUSED_HEAD_DIM: key blocks and ring depth. At head_dim 256 the tile's
# queries and dO take 64 KiB each, and a block of 64 keys and values 64 KiB: one such block
# fits, so each block's loads waited for the last one's matmuls. Blocks of 32 fit two deep (3
# fit, 4 not): on an H200 at 16K with 8 heads forward+backward ran 440 TFLOP/s causal against
# 408 with one 64-key block (434 three deep; refilling values before keys no faster), 438
# non-causal against 435 (docs/notes/attention_kernels.md, 2026-12-01, 17:48 UTC).
WIDE_DQ_BLOCK_K, WIDE_DQ_STAGES = 32, 2
# The shared-memory rings' depth (stages=None): the forward's 2, the backward's by head_dim.
# At head_dim 64 a ring 4 deep ran the backward 3-5% faster than 2 on an H200 (forward+backward
# at 16K 417-419 against 404 TFLOP/s; 6 no faster, 8 over shared memory); the forward gained
# nothing. At 128 the forward's ring of 3 is 120 bytes over shared memory (it fits without the
# 2 KB Pallas reserves for cross-warp reductions, which these kernels make none of, and then ran
# no faster: 594 against 595 TFLOP/s at 64K causal, 623 against 637 non-causal), and the
# backward's ran slower (GQA 32/8 at 16K 499 against 523, non-causal 529 against 549;
# docs/notes/attention_kernels.md).
FORWARD_STAGES = 2
BACKWARD_STAGES = {64: 4}  # head_dim -> stages; 2 for the others
# The CTAs' launch order (_Grid): runs of up to this many tiles of one (batch, head); None: all
# of them, one (batch, head) after another. On an H200 128 beat 8 by 6% at 16K and 2% at 64K,
# 1 (one tile of every pair in turn) by 25% at batch 8 of 2K; all of a head's tiles beat runs of
# 128 by 3% at 32K and 64K (forward+backward 544-551 against 527-535 TFLOP/s) and 4% at 128K
# (docs/notes/attention_kernels.md); up to 16K (128 tiles) the two are one order.
TILE_GROUP = None
# With segment ids, the kernels' CTAs launch in the order sorted_launch gives: within each
# window of this many waves (the device's SMs' worth of tiles) of the grid's order, the
# tiles with the most blocks to stream first, so that the GPU, starting each CTA on the SM
# that frees first, ends its SMs together (0: the grid's order as it is). On an H200 at
# 16K with 8 documents and batch 2 of 8K with 4 (15.5 waves), windows of 4 waves ran the
# forward 2.6-7.5% and forward+backward 3.5-6% faster than the grid's order (head_dim 64,
# 128 and 256); windows of 2 and 8 gained less or lost (docs/notes/attention_kernels.md,
# 2026-12-04).
SORT_WINDOW = 4
# Past this many waves a grid launches in its own order whatever sort_window says: the SMs'
# uneven ends cost about a tile's time, a smaller share the more waves there are, and at 64K
# with 32 documents and batch 2 of 32K with 8 (62 waves) the sorted launch ran the forward
# 1.6-2.6% slower (its CTAs hold more (head, document)'s keys at once in L2).
SORT_WAVES = 32
# How the dK/dV pass splits GQA's work (backward's gqa): a CTA a query head's key tile (the
# default) or a key/value head's, walking its group's query heads.
GQA_SPLITS = ("expand", "walk")
# How the fused backward splits its dQ between the two compute warpgroups (backward's dq_split):
# "columns", half of dQ's columns each over the tile's 128 keys (head_dim 128, where a half is
# one 128-byte swizzled tile); at head_dim 64, where a half would be half a tile, "keys", all
# columns each over its own 64 keys (two reduce-adds of dQ a step), or "steps", all columns
# over the tile's 128 keys by the warpgroup whose turn the step is (one reduce-add a step).
# On an H200 at head_dim 64, causal, 16 heads, "steps" ran forward+backward at 305 and 428
# TFLOP/s at 4K and 16K against "keys"' 299 and 409 (cuDNN 287, 416; docs/notes/attention_kernels.md).
DQ_SPLITS = ("columns", "keys", "steps")
# The order in which a dK/dV CTA (head_dim <= 128) walks the query blocks that see its keys
# (backward's query_order): "ascending", from its diagonal to the sequence's end, or
# "descending", from the end down to the diagonal. Descending, the causal grid's CTAs that
# start together (a head's tiles, heaviest first) read the same query block at the same step
# (one copy of Q and dO in L2 for all of them) and reduce-add into the same rows of dQ;
# ascending, each starts at its own diagonal. On an H200 (causal, 16 heads) descending ran
# forward+backward at 516 and 545 TFLOP/s at 16K and 64K against ascending's 531 and 547
# (docs/notes/attention_kernels.md, 2026-12-04): ascending stays the default.
QUERY_ORDERS = ("ascending", "descending")
QUERY_ORDER = "ascending"
# At head_dim 128 "steps" (a [64, 128] float32 dQ a warpgroup at its steps) ran 9-10% slower
# than "columns" on an H200 (16K and 64K), so only "columns" is allowed there.
DQ_SPLIT = {64: "steps", 128: "columns"}  # head_dim -> dq_split when None
# Registers per thread: each compute warpgroup's, the memory warpgroup's (2 x 240 + 24 a
# thread's worth fill the register file: 65,536 a CTA).
REGISTERS = (240, 24)
_profile: dict = {}  # profiled()'s settings while it is active


def default_stages(head_dim: int, *, backward: bool) -> int:
    """The ring depth the kernels take when stages is None."""
    return BACKWARD_STAGES.get(head_dim, 2) if backward else FORWARD_STAGES


def check_choice(value, choices: tuple, setting: str) -> None:
    """A clear error for a setting that takes one of a few names."""
    if value not in choices:
        raise ValueError(f"unknown {setting} {value!r}; allowed: {', '.join(choices)}")


def check_query_order(order: str, setting: str = "query_order") -> None:
    check_choice(order, QUERY_ORDERS, setting)


def check_dq_split(split: str | None, head_dim: int | None = None, setting: str = "dq_split") -> None:
    """A clear error for a dq_split the backward does not take (at this head_dim, if given)."""
    if split is None:
        return
    if split not in DQ_SPLITS:
        raise ValueError(f"unknown {setting} {split!r}; allowed: None, {', '.join(DQ_SPLITS)}")
    if head_dim is not None and head_dim in DQ_SPLIT:
        allowed = ("columns",) if head_dim >= TILE else ("keys", "steps")
        if split not in allowed:
            raise ValueError(f"{setting} {split!r} at head_dim {head_dim}; allowed there: None, {', '.join(allowed)}")


def supported(q: Array, k: Array, *, backward: bool = False) -> str | None:
    """None when the Hopper forward (backward=True: also the backward) can take these inputs,
    else the reason it cannot (segment ids they take: each block masked by segment, those
    outside a tile's documents skipped). The backward takes head_dims up to 128 (each compute warpgroup holds
    its keys' dK and dV in float32 registers) and 256, where those would be 2 x 64 x 256 / 128
    = 256 a thread, more than a thread has (REGISTERS), and the warpgroups split the columns
    instead (_dkdv_wide), half a head each: 192's halves would be 96 columns, not whole
    128-byte tiles."""
    d = q.shape[-1]
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype:
        return f"dtype {q.dtype} (needs bfloat16 or float16)"
    if d % 64 or d > 256:
        return f"head_dim {d} (needs a multiple of 64, at most 256)"
    if backward and MAX_FUSED_HEAD_DIM < d < 256:
        return f"head_dim {d} in the backward (at most {MAX_FUSED_HEAD_DIM}, or 256)"
    if q.shape[1] % TILE or k.shape[1] % TILE:
        return f"lengths {q.shape[1]}, {k.shape[1]} (need multiples of {TILE})"
    return None


def is_hopper() -> bool:
    """True on a GPU with wgmma (compute capability 9.x)."""
    if jax.default_backend() != "gpu":
        return False
    return getattr(jax.devices()[0], "compute_capability", "") in ("9.0", "9.0a")


def interpret_params():
    """Parameters for Mosaic GPU's interpreter, which runs these kernels on a CPU."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # internal in jax 0.10/0.11

    return InterpretGPUParams()


# --- pieces every kernel uses ---------------------------------------------------------------


def _scores(a_ref, b_ref, interpret: bool, issued=lambda: None) -> Array:
    """a @ b^T in float32 on the tensor cores (both operands in shared memory); issued() runs
    while the matmul is in flight."""
    return _scores_while(a_ref, b_ref, interpret, issued)[0]


def _scores_while(a_ref, b_ref, interpret: bool, during):
    """(a @ b^T as _scores computes it, during()): during() runs while the matmul is in
    flight (for a barrier to wait on, or registers to load from shared memory)."""
    return _scores_summed([(a_ref, b_ref)], interpret, during)


def _scores_summed(pairs, interpret: bool, during):
    """(the sum of a @ b^T over (a_ref, b_ref) pairs, one contraction split in blocks, in
    float32 on the tensor cores; during()), during() running while the matmuls are in flight."""
    if interpret:  # the interpreter takes no transposed refs
        dims = (((1,), (1,)), ((), ()))
        s = sum(lax.dot_general(a[...], b[...], dims, preferred_element_type=jnp.float32) for a, b in pairs)
        return s, during()

    def mma(acc_ref):
        for a_ref, b_ref in pairs:
            plgpu.wgmma(acc_ref, a_ref, b_ref.transpose((1, 0)))
        meanwhile = during()
        return acc_ref[...], meanwhile

    (a0, b0), *_ = pairs
    return pl.run_scoped(mma, plgpu.ACC((a0.shape[0], b0.shape[0]), jnp.float32))


def _scores_t(a_ref, b_ref, interpret: bool) -> Array:
    """a^T @ b in float32 on the tensor cores (both operands in shared memory)."""
    if interpret:
        return lax.dot_general(
            a_ref[...], b_ref[...], (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )

    def mma(acc_ref):
        plgpu.wgmma(acc_ref, a_ref.transpose((1, 0)), b_ref)
        return acc_ref[...]

    return pl.run_scoped(mma, plgpu.ACC((a_ref.shape[1], b_ref.shape[1]), jnp.float32))


def _accumulate(acc: Array, a: Array, b_ref, interpret: bool) -> Array:
    """acc + a @ b on the tensor cores, in place in acc's registers (a from registers)."""
    if interpret:  # the interpreter has no run_state
        return acc + jnp.dot(a, b_ref[...], preferred_element_type=jnp.float32)
    return pl.run_state(lambda ref: plgpu.wgmma(ref, a, b_ref))(plgpu.ACC.init(acc))


def _accumulate_t(acc: Array, a_ref, b_ref, interpret: bool) -> Array:
    """acc + a^T @ b on the tensor cores, in place in acc's registers (both operands in shared
    memory)."""
    if interpret:
        return acc + lax.dot_general(
            a_ref[...], b_ref[...], (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
    return pl.run_state(lambda ref: plgpu.wgmma(ref, a_ref.transpose((1, 0)), b_ref))(plgpu.ACC.init(acc))


@contextlib.contextmanager
def profiled(directory: str, ranges: int = 512):
    """Kernels traced inside this context record, per warpgroup, the clock at the start and
    end of each of their named phases (jax.named_scope), and write one Perfetto trace JSON a
    call into `directory` (Mosaic GPU's on-device profiler: `ranges` phases a warpgroup at
    most, kept in shared memory, so fewer for long sweeps). scripts/profile_kernel.py reads
    them."""
    global _profile
    before = _profile
    _profile = dict(profile_space=ranges, profile_dir=directory)
    try:
        yield
    finally:
        _profile = before


@dataclasses.dataclass(frozen=True)
class _Regs:
    """Register arrays in the wgmma accumulator's layout (plain arrays in the interpreter)."""

    interpret: bool

    def zeros(self, shape, fill=0.0) -> Array:
        x = jnp.full(shape, fill, jnp.float32)
        if self.interpret:
            return x
        layout = plgpu.Layout.WGMMA if len(shape) == 2 else plgpu.Layout.WGMMA.reduce(1)
        return plgpu.layout_cast(x, layout)

    def vector(self, ref, along: int) -> Array:
        """A float32 vector from shared memory, laid out to broadcast along dimension `along`."""
        if self.interpret:
            return ref[...]
        return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(along))

    def iota(self, shape, dim: int) -> Array:
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)

    def visible(self, shape, q0, k0, *, queries_dim: int = 0) -> Array:
        """The causal mask of a block whose queries start at q0 and keys at k0 (queries along
        `queries_dim`): query position >= key position."""
        return self.iota(shape, queries_dim) + q0 >= self.iota(shape, 1 - queries_dim) + k0


def _same_segment(row_ids: Array, col_ids: Array, shape) -> Array:
    """Where a block's row and column belong to the same segment (both [rows] / [cols] int32)."""
    return _rows(row_ids, shape) == _cols(col_ids, shape)


def _rows(x: Array, shape) -> Array:
    """A per-row vector broadcast over the columns."""
    return lax.broadcast_in_dim(x, shape, [0])


def _cols(x: Array, shape) -> Array:
    """A per-column vector broadcast over the rows."""
    return lax.broadcast_in_dim(x, shape, [1])


class _Ring:
    """`stages` shared-memory slots that the memory warpgroup fills, one step at a time (steps
    start to steps - 1), and the compute warpgroups release.

    groups: [(free barrier, [(smem [stages, ...], ready barrier, src)...])], where src(j) is
    the HBM ref of step j. A slot of a group is refilled once both compute warpgroups have
    arrived on its free barrier; each buffer signals its own ready barrier.
    """

    def __init__(self, groups, stages: int, steps, eager: bool = False, start=0, dense=None, offset=0):
        self.groups, self.stages, self.steps, self.eager = groups, stages, steps, eager
        self.start = start  # the first step (segment spans: a traced scalar; else 0)
        # segment spans: the steps [dense[0], dense[1]) need no segment mask (a document's
        # interior; segment_spans(dense=True)); None without segment ids
        self.dense = dense
        # a persistent CTA's ring runs on over its tiles: step j of this tile is the ring's
        # position j + offset (offset: the steps of its tiles before, less this tile's
        # start); 0 for a CTA of one tile
        self.offset = offset

    @property
    def length(self):
        """The steps this tile streams."""
        return self.steps - self.start

    @property
    def bounded(self) -> bool:
        """Whether its steps come from segment spans (a traced start)."""
        return not isinstance(self.start, int)

    def slot(self, j):
        j = j + self.offset
        return j % self.stages if isinstance(j, int) else lax.rem(j, self.stages)

    def produce(self, released=None):
        """The memory warpgroup's loop. released(j), if given, runs once both compute
        warpgroups have released step j's slot (for work the compute warpgroups hand over
        once a step: the fused backward's dQ)."""
        plgpu.set_max_registers(REGISTERS[1], action="decrease")

        def load(j, slot, reuse: bool):
            # Waiting for every group's slot before the first copy measured faster (H100) than
            # refilling each group as soon as it is free; eager rings (whose consumers hold one
            # group's slot while they wait for the next step's other group) refill each group
            # as soon as it is free.
            if reuse and not self.eager:
                for free, _ in self.groups:
                    plgpu.barrier_wait(free.at[slot])
            for free, buffers in self.groups:
                if reuse and self.eager:
                    plgpu.barrier_wait(free.at[slot])
                for smem, ready, src in buffers:
                    plgpu.copy_gmem_to_smem(src(j), smem.at[slot], ready.at[slot])

        for i in range(self.stages):  # fill the ring
            j = self.start + i
            pl.when(j < self.steps)(functools.partial(load, j, self.slot(j), False))

        @pl.loop(self.start + self.stages, self.steps)
        def _stream(j):
            load(j, self.slot(j), True)  # step j - stages has been released
            if released is not None:
                released(j - self.stages)

        @pl.loop(jnp.maximum(self.steps - self.stages, self.start), self.steps)
        def _drain(j):  # see the last slots released, so every barrier phase is observed
            for free, _ in self.groups:
                plgpu.barrier_wait(free.at[self.slot(j)])
            if released is not None:
                released(j)

    def produce_steps(self):
        """The memory warpgroup's loop over one tile of a persistent CTA, whose ring runs on
        from its tiles before: each step's slot is refilled once the step `stages` before
        it (this tile's or an earlier one's) has been released. No drain: drain() follows
        the CTA's last tile."""

        def wait(free, slot):
            plgpu.barrier_wait(free.at[slot])

        @pl.loop(self.start, self.steps)
        def _stream(j):
            slot, reuse = self.slot(j), j + self.offset >= self.stages
            if not self.eager:  # as produce(): every group's slot free before the first copy
                for free, _ in self.groups:
                    pl.when(reuse)(functools.partial(wait, free, slot))
            for free, buffers in self.groups:
                if self.eager:
                    pl.when(reuse)(functools.partial(wait, free, slot))
                for smem, ready, src in buffers:
                    plgpu.copy_gmem_to_smem(src(j), smem.at[slot], ready.at[slot])

    def drain(self, total):
        """After a persistent CTA's last tile: see the ring's last slots released (its
        steps total - stages .. total - 1), so that every barrier phase is observed."""

        @pl.loop(jnp.maximum(total - self.stages, 0), total)
        def _drain(j):
            for free, _ in self.groups:
                plgpu.barrier_wait(free.at[lax.rem(j, self.stages)])

    def release(self, j):
        """A compute warpgroup passes over step j: it waits for its slot and releases it."""
        for free, buffers in self.groups:
            for _, ready, _ in buffers:
                plgpu.barrier_wait(ready.at[self.slot(j)])
            plgpu.barrier_arrive(free.at[self.slot(j)])

    def skip(self, start, stop, each=lambda: None):
        """A compute warpgroup passes over steps [start, stop), running each() before it
        releases a step."""

        @pl.loop(start, stop)
        def _skip(j):
            each()
            self.release(j)


@dataclasses.dataclass(frozen=True)
class _KeyStream:
    """The query side's grid (forward, dQ): CTAs over (query tiles, heads, batch), each
    streaming key/value blocks of `bk` rows; causal grids start with the heaviest tiles (the
    last rows) and stop streaming at the diagonal."""

    grid: _Grid  # tiles: query tiles; heads: query heads
    num_k: int
    group: int  # query heads per key/value head
    bk: int
    stages: int
    causal: bool
    eager: bool = False  # the ring refills keys and values each as soon as they are free
    segments: bool = False  # each key block's segment ids come with its keys

    def scratch(self, d: int, dtype, swizzle: int = 128) -> list:
        """The ring's shared memory and barriers: open() takes them in this order."""
        ring = [
            _smem((self.stages, self.bk, d), dtype, swizzle=swizzle),
            _smem((self.stages, self.bk, d), dtype, swizzle=swizzle),
            _barriers(self.stages),
            _barriers(self.stages),
            _barriers(self.stages, COMPUTE_WGS),
            _barriers(self.stages, COMPUTE_WGS),
        ]
        if self.segments:
            ring += [_smem((self.stages, self.bk), jnp.int32, swizzled=False), _barriers(self.stages)]
        return ring

    def __post_init__(self):
        assert TILE % self.bk == 0, f"key blocks of {self.bk} do not divide a tile of {TILE} queries"

    def coords(self, cta=None, div=lax.div, rem=lax.rem):
        """(query tile, head, batch) of this CTA (cta None) or of work item `cta` (_Grid.coords')."""
        tile, head, bi = self.grid.here() if cta is None else self.grid.coords(cta, div, rem)
        return (self.grid.tiles - 1 - tile if self.causal else tile), head, bi

    def steps(self, tile):
        """The key blocks query tile `tile` streams without segment spans: under a causal mask
        up to and with the diagonal's (an int, numpy array or traced scalar)."""
        return (tile + 1) * (TILE // self.bk) if self.causal else self.num_k

    def item_steps(self, spans: Array | None = None) -> Array:
        """The key blocks each of the grid's items streams ([grid.size]): from the mask
        (numpy), or from segment spans (traced), as open() takes them."""
        items = np.arange(self.grid.size, dtype=np.int32)
        tile, _, bi = self.coords(items, div=np.floor_divide, rem=np.remainder)
        if spans is not None:
            return spans[bi, tile, 1] - spans[bi, tile, 0]
        return np.broadcast_to(self.steps(tile), items.shape)

    def open(
        self,
        k_ref,
        v_ref,
        k_smem,
        v_smem,
        k_ready,
        v_ready,
        k_free,
        v_free,
        *seg_scratch,
        seg_ref=None,
        spans_ref=None,
        cta=None,
        offset=0,
    ):
        """(tile, batch, head, warpgroup, ring, key segments) of this CTA (cta: of work item
        `cta` of the grid, for a persistent CTA that takes items in turn; its ring's steps
        follow `offset` steps of the items before). With segments
        (seg_scratch: the smem and ready barriers scratch() added; seg_ref: the keys' segment
        ids [b, sk]), key_segments(slot, regs, load) waits for the slot's segment ids and
        (load) loads them, one per column of a [queries, keys] block; else it is None.
        spans_ref (segment_spans(dense=True) of the query tiles over the key blocks): the
        ring streams only the tile's span, and knows its dense run."""
        tile, head, bi = self.coords(cta)
        wg = lax.axis_index("wg")
        bk = self.bk

        def rows(ref):
            return lambda j: ref.at[bi, pl.ds(j * bk, bk), head // self.group]

        start, steps = 0, self.steps(tile)
        dense = None
        if spans_ref is not None:
            start, steps = spans_ref[bi, tile, 0], spans_ref[bi, tile, 1]
            dense = (spans_ref[bi, tile, 2], spans_ref[bi, tile, 3])
        keys = [(k_smem, k_ready, rows(k_ref))]
        key_segments = None
        if self.segments:
            seg_smem, seg_ready = seg_scratch
            keys.append((seg_smem, seg_ready, lambda j: seg_ref.at[bi, pl.ds(j * bk, bk)]))

            def key_segments(slot, regs, load: bool = True):
                plgpu.barrier_wait(seg_ready.at[slot])
                return regs.vector(seg_smem.at[slot], 0) if load else None

        groups = [(k_free, keys), (v_free, [(v_smem, v_ready, rows(v_ref))])]
        # a persistent CTA's tile takes the ring's positions from `offset` on
        position = 0 if cta is None else offset - start
        ring = _Ring(groups, self.stages, steps, self.eager, start=start, dense=dense, offset=position)
        return tile, bi, head, wg, ring, key_segments


def _clamp(x, lo, hi):
    return jnp.minimum(jnp.maximum(x, lo), hi)


def _visible_keys(ring: _Ring, *, row0, bq: int, bk: int, causal: bool):
    """(steps, lo, hi): rows [row0, row0 + bq) see the ring's key blocks from its start to
    `steps` - 1; of those, [lo, hi) need no mask (below the causal diagonal and, with
    segment ids, in the dense run of the tile's document), the others are masked."""
    if causal:
        steps, clear = pl.cdiv(row0 + bq, bk), row0 // bk
        if ring.bounded:  # the ring's span may start after the rows' first blocks, or stop before their last
            steps = _clamp(steps, ring.start, ring.steps)
            clear = _clamp(clear, ring.start, steps)
    else:
        steps = clear = ring.steps
    if ring.dense is None:
        return steps, ring.start, clear
    lo = _clamp(ring.dense[0], ring.start, steps)
    return steps, lo, _clamp(jnp.minimum(clear, ring.dense[1]), lo, steps)


def _sweep_keys(
    step, carry, ring: _Ring, *, row0, bq: int, bk: int, causal: bool, skipped=lambda: None, unmasked=None
):
    """Runs step(j, carry, masked) over the key blocks that rows [row0, row0 + bq) see: those
    below the diagonal (and, with segment ids, in the ring's dense run) unmasked, the others
    masked; passes over the rest of the ring (blocks loaded for the other warpgroup),
    running skipped() at each.

    unmasked(lo, hi, carry) -> (carry, next), if given, runs the unmasked blocks [lo, hi)
    its own way (the forward's pipeline) in place of step: at least block lo, masked;
    step takes the blocks from `next` on."""
    steps, lo, hi = _visible_keys(ring, row0=row0, bq=bq, bk=bk, causal=causal)
    segments = ring.dense is not None
    if segments:  # a document's edge before its interior
        carry = lax.fori_loop(ring.start, lo, functools.partial(step, masked=True), carry)
    if unmasked is None:
        carry = lax.fori_loop(lo, hi, functools.partial(step, masked=False), carry)
        start = hi
    else:
        carry, start = unmasked(lo, hi, carry)
        if ring.bounded:  # rows that see none of the span still took a block
            steps = jnp.maximum(steps, start)
    if causal or segments:
        carry = lax.fori_loop(start, steps, functools.partial(step, masked=True), carry)
        ring.skip(steps, ring.steps, each=skipped)
    return carry


def _per_warpgroup(wg, compute) -> None:
    """Runs compute(w) on compute warpgroup w, with w a Python int: each warpgroup gets its
    own copy of the code, in which its shared-memory offsets and barriers are constants.
    With the index traced, the fused backward computed its wgmma descriptors per step in
    vector registers and moved them to uniform ones; specialized, it spills less (220
    bytes against 296) and ran 0.7% (64K) to 5% (16K) faster (docs/notes/attention_kernels.md)."""
    for w in range(COMPUTE_WGS):
        pl.when(wg == w)(functools.partial(compute, w))


def _copy_in(barrier, *copies) -> None:
    """TMA copies (hbm ref, smem ref) one after another on one barrier, each awaited."""
    for src, dst in copies:
        plgpu.copy_gmem_to_smem(src, dst, barrier)
        plgpu.barrier_wait(barrier)


def _smem(shape, dtype, swizzled: bool = True, swizzle: int = 128):
    """Shared memory; swizzled: tiled in rows of `swizzle` bytes with that swizzle (128: the
    widest, what wgmma and TMA read without bank conflicts; 64 where a warpgroup writes a
    column slice half as wide)."""
    row = swizzle // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((8, row)), plgpu.SwizzleTransform(swizzle)) if swizzled else ()
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def _barriers(n: int, arrivals: int = 1):
    return plgpu.Barrier(num_arrivals=arrivals, num_barriers=n)


@dataclasses.dataclass(frozen=True)
class _Grid:
    """A kernel's CTAs, one per (tile, head, batch), launched along one grid axis in an order
    bpt chooses (the GPU starts CTAs in launch order, so the order decides which run at once).

    Tiles go in groups of g, the greatest common divisor of `group` and the tile count (group
    None: g is the tile count, every (batch, head)'s tiles one run, heaviest first): the
    groups one after another, heaviest first (the streams turn a rank into a tile so that
    rank 0 is the heaviest under a causal mask); within a group every (batch, head) in turn,
    batch outermost (a GQA group's query heads next to each other); within that the group's
    tiles. CTAs that run at once then share their (batch, head)'s other side in L2: a wave
    of 132 CTAs at batch 8 of 2K with 16 heads holds 8 heads' 16 tiles, where (tiles, heads,
    batch) as a Pallas grid (its last axis launched fastest) would hold all 128 (batch,
    head) pairs' same tile, each streaming its own keys and values from HBM. group=1 is
    that grid's order with batch and heads swapped."""

    tiles: int
    heads: int
    batch: int
    group: int | None = TILE_GROUP

    @property
    def size(self) -> int:
        return self.tiles * self.heads * self.batch

    def coords(self, cta, div=lax.div, rem=lax.rem):
        """(tile rank, head, batch) of CTA number `cta` (an int32 scalar or array; a numpy
        array with div=np.floor_divide, rem=np.remainder)."""
        g = self.tiles if self.group is None else math.gcd(self.tiles, self.group)
        per_group = g * self.heads * self.batch
        within = rem(cta, per_group)
        pair = div(within, g)  # batch * heads + head
        rank = div(cta, per_group) * g + rem(within, g)
        return rank, rem(pair, self.heads), div(pair, self.heads)

    def here(self):
        """coords() of the CTA that runs this code."""
        return self.coords(lax.axis_index("cta"))

    def items(self):
        """coords() of every item, in the grid's order (numpy)."""
        return self.coords(np.arange(self.size, dtype=np.int32), div=np.floor_divide, rem=np.remainder)


def device_sms() -> int:
    """The device's SMs (1 where jax does not say, as on CPUs)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 1)


def check_sort_window(window: int, setting: str = "sort_window") -> None:
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"{setting} must be an int >= 0 (waves of tiles a sorted window holds); got {window!r}")


def sorted_launch(steps: Array, window: int) -> Array:
    """The order in which a grid's CTAs are to launch ([n] int32, a permutation of its
    items): steps, each item's blocks to stream ([n], traced), sorted, the most first and
    ties in the grid's order, within each run of `window` items of the grid's order.

    The GPU starts each CTA on the SM that frees first, so it deals the launch order out as
    a list schedule; with packed documents the grid's order (a head's tiles by their place)
    leaves the SMs ending apart (one 1.07-1.10x the mean work, simulated at the bench's
    packed shapes), where the longest first within windows of four waves ends them within
    1% while the CTAs that run at once still hold few (batch, head)'s keys."""
    n = steps.shape[0]
    window = max(1, min(window, n))
    pad = -n % window  # after the last item, with -1 steps: last in the last window
    work = jnp.concatenate([steps.astype(jnp.int32), jnp.full((pad,), -1, jnp.int32)])
    work = work.reshape(-1, window)
    ranked = jnp.argsort(-work, axis=1, stable=True) + window * jnp.arange(work.shape[0])[:, None]
    return ranked.reshape(-1)[:n].astype(jnp.int32)


def launch_order(steps, sort_window: int) -> Array | None:
    """sorted_launch over windows of sort_window waves of the device's SMs, or None (the
    grid's own order) where sort_window is 0, the grid holds more than SORT_WAVES waves, or
    the steps are static (a mask's: the grid already launches the heaviest first)."""
    if not sort_window or not isinstance(steps, jax.Array):
        return None
    sms = device_sms()
    if steps.shape[0] > SORT_WAVES * sms:
        return None
    return sorted_launch(steps, sort_window * sms)


def _launched(order: Array | None) -> tuple:
    """A kernel's inputs of its CTAs' order: the order (launch_order's, or a persistent
    kernel's table), or none where it is None (the grid's own)."""
    return () if order is None else (order,)


def check_tile_group(group: int | None, setting: str = "tile_group") -> None:
    if group is not None and (not isinstance(group, int) or isinstance(group, bool) or group < 1):
        raise ValueError(
            f"{setting} must be a positive int (tiles a CTA group holds) or None (all of a head's); got {group!r}"
        )


def _launch(
    body,
    scratch,
    *,
    out_type,
    grid: _Grid,
    interpret: bool,
    name: str,
    mutable: bool = False,
    ctas: int | None = None,
):
    """Runs body(*hbm_refs, *scratch_refs) on three warpgroups per CTA, over `grid`'s CTAs
    (the streams' open() reads each CTA's tile, head and batch from it), or over `ctas`
    persistent CTAs that take the grid's items in turn.

    mutable: the kernel also takes mutable arrays (jax.new_ref) after its inputs, which it
    updates in place; body sees them between the inputs and the outputs."""

    def entry(*hbm):
        pl.run_scoped(lambda *scratch_refs: body(*hbm, *scratch_refs), *scratch, collective_axes="wg")

    grid = dict(grid=(ctas or grid.size,), grid_names=("cta",))
    common = dict(
        compiler_params=plgpu.CompilerParams(approx_math=True, **_profile),
        interpret=interpret_params() if interpret else None,
    )
    if not mutable:
        return plgpu.kernel(
            entry,
            out_type=out_type,
            num_threads=COMPUTE_WGS + 1,
            thread_name="wg",
            kernel_name=name,
            **grid,
            **common,
        )
    # plgpu.kernel's batching wrapper takes no mutable arrays; pl.kernel aliases each one in
    # and out of the kernel.
    mesh = plgpu.Mesh(num_threads=COMPUTE_WGS + 1, thread_name="wg", kernel_name=name, **grid)
    return pl.kernel(entry, out_type=out_type, mesh=mesh, name=name, **common)


def _check(q: Array, k: Array, causal: bool, backward: bool = False, **blocks) -> None:
    reason = supported(q, k, backward=backward)
    if reason:
        raise ValueError(f"the Hopper flash kernels cannot take {reason}")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"causal attention needs equal query and key lengths; got {q.shape[1]}, {k.shape[1]}"
        )
    for setting, value in blocks.items():
        if value not in BLOCKS:
            raise ValueError(
                f"{setting}={value} is not a block size of the Hopper kernels; allowed: {BLOCKS}"
            )


def _check_segments(q: Array, k: Array, q_seg, kv_seg) -> bool:
    """Whether the kernels get segment ids (both or neither, [b, sq] and [b, sk] int32)."""
    if (q_seg is None) != (kv_seg is None):
        raise ValueError("the Hopper flash kernels take query and key segment ids together, or neither")
    if q_seg is None:
        return False
    want = ((q.shape[0], q.shape[1]), (k.shape[0], k.shape[1]))
    if (q_seg.shape, kv_seg.shape) != want or q_seg.dtype != jnp.int32 or kv_seg.dtype != jnp.int32:
        raise ValueError(
            f"segment ids must be int32 of shapes {want[0]} and {want[1]}; got {q_seg.dtype}{q_seg.shape},"
            f" {kv_seg.dtype}{kv_seg.shape}"
        )
    return True


def query_spans(q_seg: Array, kv_seg: Array, block_k: int, causal: bool) -> Array:
    """The query side's segment_spans (forward, dQ): per tile of TILE queries, its span of
    key blocks of block_k keys and the span's dense run."""
    return segment_spans(q_seg, kv_seg, rows=TILE, cols=block_k, causal=causal, dense=True)


def key_spans(q_seg: Array, kv_seg: Array, keys: int, causal: bool) -> Array:
    """The dK/dV passes' segment_spans: per tile of `keys` keys, its span of query blocks (at
    least two: the fused backward's warpgroups each take a step of dQ, DQ_SPLITS' "steps")
    and the span's dense run."""
    bq = TILE // COMPUTE_WGS
    return segment_spans(
        kv_seg, q_seg, rows=keys, cols=bq, causal=causal, rows_are_keys=True, min_blocks=2, dense=True
    )
