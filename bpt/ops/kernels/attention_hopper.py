"""FlashAttention for Hopper GPUs in Pallas Mosaic GPU (wgmma, TMA, warp specialization).

Every kernel here has the same shape. One CTA holds three warpgroups: two compute warpgroups
each own a block of rows (query rows for the forward and dQ, key rows for dK/dV), and the
third only moves data: it streams the other side's blocks from HBM into a ring of `stages`
shared-memory slots with TMA (`_Ring`), and refills a slot once both compute warpgroups have
released it. Each compute warpgroup runs its own copy of the code, its index a constant
(`_per_warpgroup`). The compute warpgroups run the matmuls on the tensor cores (wgmma, float32
accumulators in registers; P and dS are fed from registers) and keep the softmax in base 2
with the 1/sqrt(d) scale folded into one multiply-add an element.

- forward: S = Q K^T, online softmax, O += P V; rescaled once at the end. Writes O and the
  logsumexp (natural units, [batch, heads, seq] float32), the contract of flash.py. By
  default the two compute warpgroups take turns (ping-pong: one's matmuls run while the
  other computes its softmax); see forward's schedules.
- backward: P recomputed from the logsumexp. dK/dV: per key tile, over the query blocks of
  every query head of its GQA group: dV += P^T dO, dK += dS^T Q with dS = P * (dP - D).
  At head_dim 128 the same pass adds dQ: the two warpgroups share their dS through shared
  memory, each computes dS^T K for half of dQ's columns over the tile's 128 keys and leaves
  it in shared memory, and the memory warpgroup sends both halves into a float32 buffer
  with TMA's reduce-add (5 matmuls a block). At head_dim 64 the two warpgroups take the
  steps in turn, each computing all of dQ's columns over the tile's 128 keys at its steps
  (DQ_SPLITS), one part a step reduce-added alike. At 256 (_dkdv_wide) a CTA holds 64
  keys, each warpgroup computes S and dP for 32 of them and shares P and dS through shared
  memory, and accumulates dK and dV for half of the columns; a second pass, per query block
  over key blocks, recomputes P for dQ += dS K (7 matmuls a block in all). D = rowsum(dO * O)
  (minus the logsumexp's cotangent) comes from XLA.
- causal: a warpgroup visits only the blocks that its rows can see and masks only those the
  diagonal crosses; a warpgroup that needs fewer blocks than its partner still waits for and
  releases the slots it skips, so the ring keeps turning (the fused backward's warpgroups
  take the same blocks, the partner's first one fully masked, since dQ needs both halves).
- segment ids (packed documents): each block's other side brings its segment ids through
  the ring (the keys' in the forward and dQ, the queries' in dK/dV). Where the ids are
  sorted along the sequence (packed documents) a tile streams only the span of blocks that
  hold its documents (segment_spans, computed by XLA before the kernel and read by each
  CTA): the blocks between documents are skipped, so that the work follows the documents'
  own squares, not the window's. A tile of one document masks by segment only the span's
  edge blocks; the blocks wholly inside its document (the span's dense run) run as a
  segment-free tile's do. With unsorted ids every block is streamed, each masked.

Limits (the caller falls back to the Triton kernels otherwise): bfloat16/float16, head_dim a
multiple of 64 up to 256 for the forward (above 128 in key blocks of 64) and up to 128, or
256, for the backward, lengths a multiple of the blocks (see supported).
Off the GPU the kernels run under Mosaic GPU's interpreter (slow; for tests), where the
matmuls are plain dots and register layouts do not exist; it has no TMA reduce-add, so
there the fused backward writes each key tile's partial dQ and XLA sums them.
"""

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
        tile, head, bi = self.grid.here() if cta is None else self.grid.coords(cta)
        tile = self.grid.tiles - 1 - tile if self.causal else tile
        wg = lax.axis_index("wg")
        bk = self.bk

        def rows(ref):
            return lambda j: ref.at[bi, pl.ds(j * bk, bk), head // self.group]

        start, steps = 0, (pl.cdiv((tile + 1) * TILE, bk) if self.causal else self.num_k)
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


# --- forward ---------------------------------------------------------------------------------


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
    ctas = int(getattr(jax.devices()[0], "core_count", 0) or 1) if persistent is True else persistent
    return min(ctas, items)


def persistent_order(grid: _Grid, ctas: int, steps: Array) -> Array:
    """Which of `grid`'s items each of `ctas` persistent CTAs takes, in turn: [ctas, rounds]
    int32 item numbers, -1 past a CTA's last (only in the last round).

    steps: each item's key blocks ([grid.size], numpy for a static mask, else traced: from
    segment spans). The items are sorted by their steps, the longest first (ties in launch
    order, so that CTAs that run at once still share a head's keys), and dealt out in a
    snake: round r to CTAs 0..ctas-1 when r is even, ctas-1..0 when odd. Dealing the launch
    order itself in turn (c, c + ctas, ...) left one CTA 1.57x the mean work at 16K causal
    and 1.48x with 8 documents (132 CTAs, 16 heads), where the GPU, launching a CTA a tile,
    hands the next tile to whichever SM is free; on an H200 the snake took the persistent
    forward there from 359 to 404 TFLOP/s (docs/notes/attention_kernels.md, 2026-12-03)."""
    xp = jnp if isinstance(steps, jax.Array) else np
    rounds = -(-grid.size // ctas)
    ranked = xp.argsort(-steps, stable=True).astype(np.int32)
    dealt = xp.concatenate([ranked, xp.full((rounds * ctas - grid.size,), -1, np.int32)])
    dealt = dealt.reshape(rounds, ctas)
    snake = xp.where((xp.arange(rounds) % 2 == 1)[:, None], dealt[:, ::-1], dealt)
    return snake.T


def item_steps(grid: _Grid, *, causal: bool, num_k: int, bk: int, spans: Array | None = None) -> Array:
    """The key blocks each of `grid`'s items (a query tile of one head and batch) streams:
    from segment spans (traced) where given, else the causal mask's (numpy)."""
    rank, _, bi = grid.coords(np.arange(grid.size, dtype=np.int32), div=np.floor_divide, rem=np.remainder)
    tile = grid.tiles - 1 - rank if causal else rank
    if spans is not None:
        return spans[bi, tile, 1] - spans[bi, tile, 0]
    if not causal:
        return np.full(grid.size, num_k, np.int32)
    return -(-(tile + 1) * TILE // bk)


def check_schedule(schedule: str | None, setting: str = "schedule") -> None:
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"unknown {setting} {schedule!r}; allowed: {', '.join(SCHEDULES)}")


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
    tiles in turn (persistent_order: the longest first, dealt out so that each CTA's add up
    to about the same), its ring of keys and values running on from one tile to the next,
    so that the next tile's first blocks load while the last one ends and no CTA is launched
    for a tile; an int, that many CTAs.
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
    if ctas is not None:
        steps = item_steps(grid, causal=causal, num_k=num_k, bk=bk, spans=spans)
        order = jnp.asarray(persistent_order(grid, ctas, steps))

    def body(*refs):
        q_ref, k_ref, v_ref, *refs = refs
        qs_ref, ks_ref, spans_ref = (refs.pop(0), refs.pop(0), refs.pop(0)) if segments else (None,) * 3
        order_ref = refs.pop(0) if ctas is not None else None
        o_ref, lse_ref, q_smem, lse_smem, q_ready, turn, *scratch = refs
        qseg_smem = scratch.pop(0) if segments else None
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

        def compute(wg, opened):
            """Compute warpgroup wg's rows of one tile (opened: tile_of()'s)."""
            tile, bi, head, _, ring, key_segments = opened
            row0 = tile * TILE + wg * bq
            my_q, my_lse = q_smem.at[wg], lse_smem.at[wg]
            rows = pl.ds(row0, bq)
            with jax.named_scope("wait_Q"):
                _copy_in(
                    q_ready.at[wg],
                    (q_ref.at[bi, rows, head], my_q),
                    *([(qs_ref.at[bi, rows], qseg_smem.at[wg])] if segments else []),
                )
            my_segments = regs.vector(qseg_smem.at[wg], 1) if segments else None

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
                # a persistent CTA's next tile needs only the buffers read (its Q lands in
                # my_q); the writes to HBM are waited for after its last tile
                plgpu.wait_smem_to_gmem(0, wait_read_only=ctas is not None)

        if ctas is None:  # a CTA a tile
            opened = tile_of()

            def _compute(wg):
                plgpu.set_max_registers(REGISTERS[0], action="increase")
                compute(wg, opened)

            _per_warpgroup(wg, _compute)
            pl.when(wg == COMPUTE_WGS)(opened[4].produce)
            return

        # persistent: CTA c takes the items of row c of persistent_order's table in turn, its
        # ring running on from one to the next
        cta = lax.axis_index("cta")
        rounds = order.shape[1]
        items = rounds - 1 + (order_ref[cta, rounds - 1] >= 0).astype(jnp.int32)

        def each_tile(run):
            """run(opened) on each of this CTA's items in turn; the ring's steps in all."""

            def one(i, offset):
                opened = tile_of(order_ref[cta, i], offset)
                run(opened)
                return offset + opened[4].length

            return lax.fori_loop(0, items, one, jnp.int32(0))

        def _persistent_compute(wg):
            plgpu.set_max_registers(REGISTERS[0], action="increase")
            each_tile(functools.partial(compute, wg))
            plgpu.wait_smem_to_gmem(0)  # the last tiles' outputs written

        def _persistent_produce():
            plgpu.set_max_registers(REGISTERS[1], action="decrease")
            total = each_tile(lambda opened: opened[4].produce_steps())
            tile_of(cta)[4].drain(total)  # any tile's ring: the same slots and barriers

        _per_warpgroup(wg, _persistent_compute)
        pl.when(wg == COMPUTE_WGS)(_persistent_produce)

    scratch = [
        _smem((COMPUTE_WGS, bq, d), dtype),
        _smem((COMPUTE_WGS, bq), jnp.float32, swizzled=False),
        _barriers(COMPUTE_WGS),
        _barriers(1, COMPUTE_WGS),  # the warpgroups' meeting point (pingpong)
        *([_smem((COMPUTE_WGS, bq), jnp.int32, swizzled=False)] if segments else []),
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
    )(q, k, v, *((q_seg, kv_seg, spans) if segments else ()), *((order,) if ctas is not None else ()))


# --- backward --------------------------------------------------------------------------------


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

    def body(*refs):
        q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, *refs = refs
        qs_ref, ks_ref, spans_ref = (refs.pop(0), refs.pop(0), refs.pop(0)) if segments else (None,) * 3
        dq_ref, q_smem, do_smem, lse_smem, delta_smem, rows_ready, *scratch = refs
        qseg_smem = scratch.pop(0) if segments else None
        k_smem, v_smem, k_ready, v_ready, k_free, v_free = (ring_scratch := scratch)[:6]
        tile, bi, head, wg, ring, key_segments = keys.open(
            k_ref, v_ref, *ring_scratch, seg_ref=ks_ref, spans_ref=spans_ref
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
    )(q, k, v, d_out, lse2, delta, *((q_seg, kv_seg, spans) if segments else ()))


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
    ):
        """(tile, batch, kv head, warpgroup, ring, (first, stop, per_head, dense)) of this CTA:
        the query blocks first to stop - 1 see the tile, and step j of the ring holds query
        block first + j % per_head of the group's query head j // per_head. With segments
        (seg_scratch: the smem and ready barriers scratch() added; seg_ref: the queries'
        segment ids [b, sq]) the step's query segment ids come too, in the smem
        seg_scratch[0] on the barriers seg_scratch[1]; spans_ref (key_spans) gives first and
        stop (traced; else stop is num_q) and dense, the query blocks [dense[0], dense[1])
        that need no segment mask (None without segments)."""
        q_ref, do_ref, lse2_ref, delta_ref = refs
        tile, kv_head, bi = self.grid.here()
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

    def open_scratch(self, refs, scratch, seg_ref=None, spans_ref=None):
        """open() on scratch()'s refs as they come: (open()'s tuple, the ring's refs (Q, dO,
        logsumexp and delta smem, their ready barriers, the free barriers), the segment ids'
        (the whole int32 buffer, the ring's part of it, its ready barriers), all None without
        segments)."""
        ring, seg = (scratch[:-2], scratch[-2:]) if self.segments else (scratch, ())
        q_smem, do_smem, stats, *barriers = ring
        ring = (q_smem, do_smem, stats.at[0], stats.at[1], *barriers)
        if not seg:
            return self.open(refs, *ring, seg_ref=seg_ref), ring, (None, None, None)
        seg_smem, seg_ready = seg
        ring_seg = seg_smem.at[pl.ds(0, self.stages)]
        opened = self.open(refs, *ring, ring_seg, seg_ready, seg_ref=seg_ref, spans_ref=spans_ref)
        return opened, ring, (seg_smem, ring_seg, seg_ready)

    def head_rows(self, kv_head, first, per_head, j):
        """(query head, query rows) of step j."""
        return kv_head * self.group + j // per_head, pl.ds((first + lax.rem(j, per_head)) * self.bq, self.bq)


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
):
    """dK, dV: per 2 x 64 key rows of one key/value head, over the query blocks (64) of every
    query head of its group that see them. expand (GQA): per 2 x 64 key rows of one query
    head's view of them instead, over that head's query blocks: dK and dV come out per query
    head ([b, sk, h, d]), the group's to be summed.

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
    queries = _QueryStream(grid, num_q, walked, bq, max(1, min(stages, num_q)), causal, segments)
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
            (q_ref, do_ref, lse2_ref, delta_ref), ring_scratch, seg_ref=qs_ref, spans_ref=spans_ref
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
                        q0 = (first + lax.rem(j, per_head)) * bq
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
                base = g * per_head - first  # step of query block i is base + i
                masked, unmasked = (functools.partial(step, masked=m) for m in (True, False))
                mine, clear = first, first  # my first visible block, my first off the diagonal
                if causal:
                    mine, clear = key0 // bq, pl.cdiv(key0 + bk - 1, bq)
                    if segments:  # the span may start after my first block, or stop before it
                        mine = _clamp(mine, first, stop)
                        clear = _clamp(clear, mine, stop)
                    if with_dq:  # both warpgroups take every step: dQ needs both halves of dS
                        mine = first
                    else:
                        ring.skip(base + first, base + mine)  # blocks only the partner warpgroup sees
                # masked: [mine, lo), the diagonal's blocks and with segment ids a document's
                # edge before its dense run; [hi, stop), the edge after it
                lo, hi = clear, stop
                if segments:
                    lo = _clamp(jnp.maximum(clear, dense[0]), mine, stop)
                    hi = _clamp(dense[1], lo, stop)
                if causal or segments:
                    carry = lax.fori_loop(base + mine, base + lo, masked, carry)
                carry = lax.fori_loop(base + lo, base + hi, unmasked, carry)
                if segments:
                    carry = lax.fori_loop(base + hi, base + stop, masked, carry)
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
        *((q_seg, kv_seg, key_spans(q_seg, kv_seg, TILE, causal)) if segments else ()),
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
        dk_ref, dv_ref = outs
        k_smem, v_smem, own_ready, *ring_scratch = scratch_refs
        p_smem, ds_smem, shared, done, *ring_scratch = ring_scratch
        opened, ring_refs, (seg_smem, qseg_smem, qseg_ready) = queries.open_scratch(
            (q_ref, do_ref, lse2_ref, delta_ref), ring_scratch, seg_ref=qs_ref, spans_ref=spans_ref
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
    )(q, k, v, d_out, lse2, delta, *((q_seg, kv_seg, spans) if segments else ()))


def _dq_accumulator(q: Array, d_out: Array) -> Array:
    """The fused backward's float32 dQ buffer, zeros shaped like q, made once this call's d_out
    exists. A bare jnp.zeros is the same constant in every layer: XLA merged the unrolled
    layers' zeros into one fusion that wrote all 24 at once (GPT-1B at 32K: 6 GiB of
    [32768, 16, 128] float32, each held until its layer's kernel ran). Behind an optimization
    barrier with d_out, each layer's buffer is made after its d_out: GPT-1B's step at 32K on
    an H200 compiled to 51.6 GiB instead of 56.0, at the same speed (docs/notes/step_speed.md,
    2026-11-30)."""
    zeros, _ = lax.optimization_barrier((jnp.zeros(q.shape, jnp.float32), d_out))
    return zeros


def check_gqa(gqa: str, setting: str = "gqa") -> None:
    if gqa not in GQA_SPLITS:
        raise ValueError(f"unknown {setting} {gqa!r}; allowed: {', '.join(GQA_SPLITS)}")


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
    interpret: bool = False,
):
    """(dq, dk, dv) from the forward's logsumexp and delta = rowsum(dO * O) - d_lse, [b, h, s].

    fused_dq: True (or None, the default): one pass that adds dQ into a float32 buffer as it
    computes dK and dV (5 matmuls a block; at head_dim 128 each compute warpgroup takes 64 of
    dQ's columns, one swizzled tile wide, at 64 all of them over its own keys, or over the
    tile's keys at every other step: dq_split, DQ_SPLITS); False: a second pass for dQ that
    recomputes P (7). stages: the query ring's depth (None: default_stages). tile_group,
    q_seg, kv_seg: see forward.

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
    if not fused_dq:
        dk, dv = summed(*_dkdv(q, k, v, d_out, lse2, delta, expand=expand, **kw))
        return _dq(q, k, v, d_out, lse2, delta, **kw), dk, dv
    if interpret:
        dk, dv, parts = _dkdv(q, k, v, d_out, lse2, delta, dq_parts=True, expand=expand, dq_split=dq_split, **kw)
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
        dk, dv = _dkdv(q, k, v, d_out, lse2, delta, dq_acc=acc, expand=expand, dq_split=dq_split, **kw)
        dq = acc[...]
    return (dq * scale).astype(q.dtype), *summed(dk, dv)
