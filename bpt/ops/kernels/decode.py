"""The decode attention kernel: split-KV with a stream-K tile table, as one Pallas kernel.

One new token (or a few) per sequence attends to a long key/value cache, so the work is
reading the cache and the kernel's job is to keep every SM reading it:

- The cache is cut into tiles of whole key blocks; each program takes one tile of one K/V
  head and writes a partial softmax (float32 output normalized over the tile, and its
  logsumexp). The partials are merged by logsumexp in XLA, per sequence.
- The query heads of a GQA group (and the q_len queries) are the rows of one program, so each
  K/V head is read once for all of them and the cache is never repeated or transposed: the
  kernel reads [block_k, head_dim] slices of [batch, max_len, kv_heads, head_dim] in place.
- Only the slots a sequence can see are read: a tile ends at the sequence's last visible
  slot (its query position, or its length).
- The tile table: "stream_k" (default) gives every program the same number of key blocks
  whatever the sequences' lengths: the blocks each sequence needs are summed and cut into
  equal tiles (a tile never spans two sequences), so a ragged batch keeps every SM busy to the
  end; "split" cuts each sequence into the same number of equal splits (flash-decoding), so
  short sequences leave programs idle while long ones finish; "lean" (Lean Attention's
  stream-K over everything) lays every (sequence, K/V head)'s blocks end to end and cuts
  the whole into one equal range a program, ranges crossing head and sequence borders: a
  program writes one partial for each (sequence, head) piece of its range, so a batch of
  one with few K/V heads still gets one long, equal range a SM (LEAN_WAVES programs a SM)
  instead of many short tiles.
- The stream_k and split schedules read no table: each program computes its tile from its
  index and the queries' slots (table_in_kernel), so no table or rows of slots are made for
  it (a decode step at batch 1 is the queries' padding, the kernel and the merge). The
  table (_tile_table, read by _kernel) stays as an option, and lean reads its own.
- Programs per K/V head come from the GPU's SM count (up to WAVES programs a SM), no more
  than leave each MIN_TILE_BLOCKS of the cache's blocks, and a count whose programs fill
  their last wave (default_tiles), unless num_splits is given.
- A model's whole cache can come as a stack [layers, batch, max_len, kv_heads, head_dim] with
  a layer index (a scalar operand): the layer's slots are read in place, never sliced out.
- An int8 cache comes with its scales (one per slot and K/V head): the kernel reads int8 and
  scales the scores and the values' weights, never a dequantized copy.

On a GPU the kernel lowers through Triton; elsewhere it runs in Pallas interpret mode.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from bpt.ops.reference import Partial

Array = jax.Array
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
SCHEDULES = ("stream_k", "split", "lean")
MIN_ROWS = 16  # the smallest M a Triton dot takes
MIN_BLOCK_K = 16  # the smallest block of cache slots (the default halves toward it to divide the cache)
# Programs a SM (over all K/V heads) at most when num_splits is not given; with block_k 64 and
# num_stages=4 the best of 4, 6 and 8 on one H100 at 128K-1M slots (docs/notes/decoding.md).
WAVES = 8
# The fewest cache blocks a stream_k/split program gets by default (programs per K/V head at
# most batch x the cache's blocks a sequence / this). At batch 1 on an H200, in one run
# against WAVES' count: 32K slots 9% (16/16 heads) and 14% (32/8) faster, 128K with 32/8
# 13% (64 tiles a head of 32 blocks, not 132 of 16); from 128K with 16/16 and 512K with 32/8
# on, and at batch 8 from 32K, the cap does not bind (docs/notes/decoding.md).
MIN_TILE_BLOCKS = 32
# Programs a SM for the "lean" schedule (its ranges are equal and long: one wave; not yet
# tuned on a GPU).
LEAN_WAVES = 1


def num_sms(device=None) -> int:
    """The device's streaming multiprocessors (8 where it does not say, as on a CPU)."""
    device = device or jax.devices()[0]
    return int(getattr(device, "core_count", 0) or 8)


def default_tiles(batch: int, blocks: int, kv_heads: int, sms: int) -> int:
    """Programs per K/V head when num_splits is not given: at most WAVES a SM over the K/V
    heads and one a MIN_TILE_BLOCKS of the batch's cache blocks (blocks: a sequence's); of
    those counts, the one whose programs fill their last wave of `sms` best, the largest of
    equals. (Batch 1 at 128K with 16 K/V heads: 33 a head, four full waves of 132, not 64, 7.8
    waves; the programs of a stream-K tile table all read alike, so a partial last wave is
    time the rest of the GPU waits.)"""
    cap = max(1, min(-(-WAVES * sms // kv_heads), batch * blocks // MIN_TILE_BLOCKS))

    def filled(tiles: int) -> float:  # the share of the waves' slots that hold a program
        programs = tiles * kv_heads
        return programs / (-(-programs // sms) * sms)

    return max(range(1, cap + 1), key=lambda t: (round(filled(t), 3), t))


def _tile_table(visible_blocks: Array, tiles: int, schedule: str, max_blocks: int, full_blocks=None) -> Array:
    """[num_tiles, 4] int32 rows (sequence, first block, end block, full blocks); tiles past the
    work are empty (first == end). visible_blocks [batch]: key blocks each sequence needs;
    full_blocks [batch] (default visible_blocks): the first block_k-aligned blocks that every
    row of the sequence sees whole, read without masks. Rows are in sequence order."""
    batch = visible_blocks.shape[0]
    if schedule == "split":
        splits = max(1, -(-tiles // batch))
        per = -(-max_blocks // splits)
        seq = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), splits)
        first = jnp.tile(jnp.arange(splits, dtype=jnp.int32) * per, batch)
        end = jnp.minimum(first + per, visible_blocks[seq])
    else:
        size = jnp.maximum(1, -(-jnp.sum(visible_blocks) // tiles)).astype(jnp.int32)
        counts = -(-visible_blocks // size)  # tiles per sequence
        ends = jnp.cumsum(counts)
        index = jnp.arange(tiles + batch, dtype=jnp.int32)  # at most tiles + batch are needed
        # The sequence of each tile: how many sequences end at or before it (a compare and a
        # sum, one fusion; batch is small).
        seq = jnp.minimum(jnp.sum(index[:, None] >= ends[None, :], axis=1), batch - 1).astype(jnp.int32)
        first = (index - (ends - counts)[seq]) * size
        end = jnp.minimum(first + size, visible_blocks[seq])
    first = jnp.minimum(first, end)
    full = (visible_blocks if full_blocks is None else full_blocks)[seq]
    return jnp.stack([seq, first, end, full], axis=1).astype(jnp.int32)


def _attend_blocks(block_k, scale, quantized, refs, layer, seq, kv_head, first, end, full, last=None):
    """(out, lse) [rows, head_dim], [rows] of sequence seq's queries of kv_head over its key
    blocks [first, end): blocks before `full` (every row sees them whole) unmasked, the rest
    masked by each row's last visible slot (last [rows]; None: the slots' rows, last_ref[seq])."""
    q_ref, last_ref, k_ref, v_ref, ks_ref, vs_ref = refs
    q = q_ref[seq, kv_head, :, :]  # [rows, head_dim]
    last = last_ref[seq, :] if last is None else last  # [rows]: the last slot each row sees
    visible = jnp.max(last) + 1
    rows = q.shape[0]

    def body(masked, j, carry):
        m, row_sum, acc = carry
        span = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        k = k_ref[layer, seq, span, kv_head, :].astype(q.dtype)
        v = v_ref[layer, seq, span, kv_head, :].astype(q.dtype)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if quantized:
            s = s * ks_ref[layer, seq, span, kv_head][None, :]
        s = s * (scale * LOG2E)
        if masked:  # a block some row sees only in part: slots past a row's last are -inf
            k_pos = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
            v = jnp.where((k_pos < visible)[:, None], v, jnp.zeros_like(v))  # garbage past the end
            s = jnp.where(k_pos[None, :] <= last[:, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp2(s - shift[:, None])
        alpha = jnp.exp2(m - shift)
        row_sum = row_sum * alpha + jnp.sum(p, axis=1)
        if quantized:  # the value scales weight p's columns (after the row sums took p)
            v_scale = vs_ref[layer, seq, span, kv_head]
            if masked:
                v_scale = jnp.where(k_pos < visible, v_scale, 0.0)
            p = p * v_scale[None, :]
        pv = lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        return m_new, row_sum, acc * alpha[:, None] + pv

    carry = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros(q.shape, jnp.float32),
    )
    # The blocks that every row sees whole run without masks (the long, pipelined loop); the
    # rest (at most the sequence's last few blocks) with them.
    split = jnp.clip(full, first, end)
    carry = lax.fori_loop(first, split, functools.partial(body, False), carry)
    m, row_sum, acc = lax.fori_loop(split, end, functools.partial(body, True), carry)
    seen = row_sum > 0.0
    safe = jnp.where(seen, row_sum, 1.0)
    return acc / safe[:, None], jnp.where(seen, (m + jnp.log2(safe)) * LN2, -jnp.inf)


def _cache_refs(quantized: bool, q_ref, last_ref, k_ref, v_ref, refs):
    """(the refs _attend_blocks reads, the output refs)."""
    ks_ref, vs_ref, *outs = refs if quantized else (None, None, *refs)
    return (q_ref, last_ref, k_ref, v_ref, ks_ref, vs_ref), outs


def _kernel(
    block_k: int, scale: float, quantized: bool, table_ref, layer_ref, q_ref, last_ref, k_ref, v_ref, *refs
):
    """One tile (a row of the tile table) of one K/V head (the grid's first axis)."""
    reads, (o_ref, lse_ref) = _cache_refs(quantized, q_ref, last_ref, k_ref, v_ref, refs)
    seq, first, end, full = table_ref[0], table_ref[1], table_ref[2], table_ref[3]
    o_ref[...], lse_ref[...] = _attend_blocks(
        block_k, scale, quantized, reads, layer_ref[0], seq, pl.program_id(0), first, end, full
    )


def _slot_range(last_ref, seq):
    """(the latest, the earliest) of sequence seq's queries' last visible slots (last_ref
    [batch, q_len]; q_len scalar reads)."""
    slots = [last_ref[seq, t] for t in range(last_ref.shape[1])]
    return functools.reduce(jnp.maximum, slots), functools.reduce(jnp.minimum, slots)


def _computed_tile(block_k: int, schedule: str, tiles: int, split_size: int, last_ref, program):
    """(sequence, first block, end block, full blocks) of program `program`, as _tile_table's
    row for it, from the queries' last visible slots (last_ref [batch, q_len]): split,
    `tiles` splits a sequence of `split_size` blocks each; stream_k, the visible blocks' sum
    cut into `tiles` equal tiles, each sequence's tiles in turn."""
    batch = last_ref.shape[0]

    def visible(i):  # the blocks holding slots 0..latest of sequence i
        return (_slot_range(last_ref, i)[0] + block_k) // block_k

    if schedule == "split":
        seq, first, size = program // tiles, (program % tiles) * split_size, split_size
    else:
        total = lax.fori_loop(0, batch, lambda i, acc: acc + visible(i), jnp.int32(0))
        size = jnp.maximum(1, (total + tiles - 1) // tiles)

        def find(i, carry):  # sequence i's tiles start where the earlier ones' end
            start, seq, first = carry
            count = (visible(i) + size - 1) // size
            mine = (program >= start) & (program < start + count)
            return start + count, jnp.where(mine, i, seq), jnp.where(mine, (program - start) * size, first)

        past = jnp.int32(2**30)  # a program past every sequence's tiles: the last one's, empty
        _, seq, first = lax.fori_loop(0, batch, find, (jnp.int32(0), jnp.int32(batch - 1), past))
    latest, earliest = _slot_range(last_ref, seq)
    end = jnp.minimum(first + size, (latest + block_k) // block_k)
    return seq, jnp.minimum(first, end), end, (earliest + 1) // block_k


def _computed_tile_kernel(
    block_k: int, scale: float, quantized: bool, group: int, schedule: str, tiles: int, split_size: int, layer_ref, q_ref,
    last_ref, k_ref, v_ref, *refs,
):  # fmt: skip
    """One tile (the grid's second axis) of one K/V head (the first), with no tile table: the
    tile is computed here (_computed_tile) from the queries' last visible slots (last_ref
    [batch, q_len]); row r (query r // group's head) sees up to its query's slot, the
    padding rows nothing."""
    reads, (o_ref, lse_ref) = _cache_refs(quantized, q_ref, last_ref, k_ref, v_ref, refs)
    seq, first, end, full = _computed_tile(block_k, schedule, tiles, split_size, last_ref, pl.program_id(1))
    query = lax.broadcasted_iota(jnp.int32, (q_ref.shape[2],), 0) // group
    last = jnp.full(query.shape, -1, jnp.int32)
    for t in range(last_ref.shape[1]):
        last = jnp.where(query == t, last_ref[seq, t], last)
    o_ref[...], lse_ref[...] = _attend_blocks(
        block_k, scale, quantized, reads, layer_ref[0], seq, pl.program_id(0), first, end, full, last
    )


def _lean_kernel(
    block_k: int, scale: float, quantized: bool, spans_ref, pieces_ref, layer_ref, q_ref, last_ref, k_ref, v_ref, *refs
):
    """One program of the lean schedule: its pieces (rows lo..hi of the piece table, each
    a (sequence, K/V head, first, end, full) range of blocks), one partial each."""
    reads, (o_ref, lse_ref) = _cache_refs(quantized, q_ref, last_ref, k_ref, v_ref, refs)
    program = pl.program_id(0)
    layer = layer_ref[0]

    def piece(i, carry):
        seq, kv_head = pieces_ref[i, 0], pieces_ref[i, 1]
        first, end, full = pieces_ref[i, 2], pieces_ref[i, 3], pieces_ref[i, 4]
        out, lse = _attend_blocks(block_k, scale, quantized, reads, layer, seq, kv_head, first, end, full)
        o_ref[i, :, :] = out
        lse_ref[i, :] = lse
        return carry

    lax.fori_loop(spans_ref[program, 0], spans_ref[program, 1], piece, 0)


def _lean_table(visible_blocks: Array, full_blocks: Array, kv_heads: int, programs: int) -> tuple[Array, Array]:
    """The lean schedule: (pieces [programs + units, 5] int32 rows (sequence, K/V head, first
    block, end block, full blocks), spans [programs, 2] int32: program p's pieces are rows
    spans[p, 0] .. spans[p, 1]). The units, (sequence, K/V head) pairs in that order, lie end
    to end, visible_blocks[sequence] blocks each; the whole is cut into `programs` equal
    ranges, and every range and unit border starts a piece (empty pieces: first == end)."""
    units = visible_blocks.shape[0] * kv_heads
    lengths = jnp.repeat(visible_blocks.astype(jnp.int32), kv_heads)  # unit u = seq * kv_heads + head
    starts = jnp.cumsum(lengths) - lengths
    total = jnp.sum(lengths)
    size = jnp.maximum(1, -(-total // programs)).astype(jnp.int32)
    cuts = jnp.arange(programs, dtype=jnp.int32) * size
    borders = jnp.sort(jnp.minimum(jnp.concatenate([cuts, starts]), total))
    ends = jnp.concatenate([borders[1:], total[None]])
    # searches of a few hundred entries: a comparison of all pairs, one fusion (the default
    # binary search is a loop of small kernels, 0.39 ms for 128 ids in 16K on an H200)
    search = functools.partial(jnp.searchsorted, method="compare_all")
    unit = jnp.clip(search(starts, borders, side="right") - 1, 0, units - 1).astype(jnp.int32)
    seq = unit // kv_heads
    owner = jnp.minimum(borders // size, programs - 1)  # sorted: each program's pieces are one run
    program = jnp.arange(programs, dtype=jnp.int32)
    spans = jnp.stack([search(owner, program, side="left"), search(owner, program, side="right")], 1)
    first = borders - starts[unit]
    end = jnp.maximum(first, ends - starts[unit])
    pieces = jnp.stack([seq, unit % kv_heads, first, end, full_blocks[seq]], axis=1)
    return pieces.astype(jnp.int32), spans.astype(jnp.int32)


def _merge(ids: Array, out: Array, lse: Array, count: int) -> tuple[Array, Array]:
    """The partials (out [n, ..., head_dim], lse [n, ...]) merged by logsumexp into `count`
    groups, partial i into group ids[i]; empty partials have lse -inf: weight 0.

    Dense XLA, no scatter: with one group, reductions over the partials; with more, each
    group's masked reductions over them (float32 throughout). At batch 1 on an H200 the
    segment sums this replaced were several small kernels a call (docs/notes/decoding.md); a
    merge kernel looping over a sequence's tiles was slower at batch 1, where it has few
    programs."""
    if count == 1:  # a group's value broadcasts over the partials
        group_max = functools.partial(jnp.max, axis=0, keepdims=True)
        group_sum = functools.partial(jnp.sum, axis=0, keepdims=True)
        per_partial = slice(None)
    else:
        member = ids[None, :] == jnp.arange(count, dtype=ids.dtype)[:, None]  # [count, n]
        spread = member.reshape(*member.shape, *(1,) * (lse.ndim - 1))

        def group_max(x):
            return jnp.max(jnp.where(spread, x[None], -jnp.inf), axis=1)

        def group_sum(x):  # masked sums: no GEMM with a one-hot matrix for a few partials
            return jnp.sum(jnp.where(member.reshape(*member.shape, *(1,) * (x.ndim - 1)), x[None], 0.0), axis=1)

        per_partial = ids
    top = group_max(lse)
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    weight = jnp.exp(lse - shift[per_partial])
    total, merged = group_sum(weight), group_sum(out * weight[..., None])
    safe = jnp.where(total > 0, total, 1.0)
    return merged / safe[..., None], jnp.where(total > 0, shift + jnp.log(safe), -jnp.inf)


def decode_partial(
    q: Array,
    k_cache: Array,
    v_cache: Array,
    last: Array,
    *,
    layer: Array | int | None = None,
    k_scale: Array | None = None,
    v_scale: Array | None = None,
    num_splits: int | None = None,
    schedule: str = "stream_k",
    lean_waves: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 4,
    table_in_kernel: bool | None = None,
    interpret: bool | None = None,
) -> Partial:
    """The kernel's attention of q [batch, q_len, heads, head_dim] over the caches [batch,
    max_len, kv_heads, head_dim], row r of sequence b seeing slots <= last[b, r] (see
    bpt.ops.decode.last_visible_slot). layer: the caches are stacks [layers, batch, max_len,
    kv_heads, head_dim] and this layer's part is read, in place. k_scale, v_scale [(layers,)
    batch, max_len, kv_heads]: the caches are int8 (bpt.ops.decode.quantize_kv) with these
    scales; the kernel reads the int8 values and applies the scales to the scores and to the
    weights of the values (half the bytes of a bf16 cache). num_splits: programs per K/V
    head (default: WAVES programs a SM over the K/V heads; "lean": lean_waves a SM in all,
    LEAN_WAVES by default). schedule: SCHEDULES (the module docstring). table_in_kernel:
    the programs compute their tiles themselves (_computed_tile) instead of reading a tile
    table, and take the queries' slots as they are (no rows of slots made for them):
    stream_k and split only (None: with them; False reads the table). They read no table that
    XLA computes in the same program (see the barrier below) and save 1-5% a call at batch 1
    and 128K (docs/notes/decoding.md)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
    scales = () if k_scale is None else (k_scale, v_scale)
    if layer is None:  # one layer: a stack of one (a free reshape)
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
        scales = tuple(x[None] for x in scales)
    b, q_len, h, d = q.shape
    max_len, hk = k_cache.shape[2], k_cache.shape[3]
    if d < 16 or d & (d - 1):
        raise ValueError(
            f"the pallas decode kernel needs a power-of-two head_dim >= 16; got {d} (use impl='split_kv')"
        )
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if block_k is None:
        block_k = min(64 if q.dtype.itemsize <= 2 else 32, max_len)
        while max_len % block_k and block_k > MIN_BLOCK_K:  # a smaller block that divides the cache
            block_k //= 2
    if max_len % block_k:
        raise ValueError(
            f"the cache length {max_len} must be a multiple of block_k={block_k} (impl='split_kv' takes any length)"
        )
    group = h // hk
    rows = max(MIN_ROWS, pl.next_power_of_2(q_len * group))
    # [b, hk, rows, d]: row t * group + j is query t's head j of the K/V head (q is small).
    q_rows = q.reshape(b, q_len, hk, group, d).transpose(0, 2, 1, 3, 4).reshape(b, hk, q_len * group, d)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - q_len * group), (0, 0)))
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    call = functools.partial(pl.pallas_call, compiler_params=params, interpret=interpret)
    kernel_args = (block_k, 1.0 / math.sqrt(d), bool(scales))
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    if table_in_kernel is None:
        table_in_kernel = schedule != "lean"
    elif table_in_kernel and schedule == "lean":
        raise ValueError("table_in_kernel takes the schedules stream_k and split; lean reads its piece tables")
    blocks = max_len // block_k
    slots = last.astype(jnp.int32)
    visible_blocks = (jnp.max(slots, axis=1) + block_k) // block_k  # those holding slots 0..the latest
    if table_in_kernel:
        tiles = num_splits or default_tiles(b, blocks, hk, num_sms())
        if schedule == "split":  # _tile_table's splits a sequence and blocks a split
            splits = max(1, -(-tiles // b))
            n, shape = splits * b, (splits, -(-blocks // splits))
            ids = jnp.repeat(jnp.arange(b, dtype=jnp.int32), splits)
        else:  # at most tiles + b - 1 tiles hold work (each sequence's last one may be short)
            n, shape = tiles + b - 1, (tiles, 0)
            ids = _tile_table(visible_blocks, tiles, schedule, blocks)[:n, 0] if b > 1 else jnp.zeros((n,), jnp.int32)
        operands = (layer, q_rows, slots, k_cache, v_cache, *scales)
        kernel = functools.partial(_computed_tile_kernel, *kernel_args, group, schedule, *shape)
        out, lse = _tile_call(call, kernel, operands, n, hk)
        kept, groups = (q_rows, slots), b
    else:
        last_rows = jnp.repeat(slots, group, axis=1)
        last_rows = jnp.pad(last_rows, ((0, 0), (0, rows - q_len * group)), constant_values=-1)
        full_blocks = (jnp.min(slots, axis=1) + 1) // block_k
        operands = (layer, q_rows, last_rows, k_cache, v_cache, *scales)
        if schedule == "lean":
            programs = num_splits * hk if num_splits else max(1, (lean_waves or LEAN_WAVES) * num_sms())
            pieces, spans = _lean_table(visible_blocks, full_blocks, hk, programs)
            out, lse, ids, tables = _lean_call(call, kernel_args, operands, pieces, spans, hk)
            groups = b * hk
        else:
            tiles = num_splits or default_tiles(b, blocks, hk, num_sms())
            table = _tile_table(visible_blocks, tiles, schedule, blocks, full_blocks)
            out, lse = _tile_call(call, functools.partial(_kernel, *kernel_args), operands, table.shape[0], hk, table)
            ids, tables = table[:, 0], (table,)
            groups = b
        kept = (*tables, q_rows, last_rows)
    # The operands this program computes (the tile or piece tables, the queries' and the slots'
    # rows) stay alive past the kernel. Without this, on an H100 (jax 0.11.2) a jitted call with
    # some tile counts (batch 2 with num_splits 1, 2 or 4) read a damaged table: NaN or wrong
    # outputs, or an illegal address, while the same kernel called alone was exact. The
    # barrier costs nothing (they are a few KiB); tests/test_decode.py holds the cases. On an
    # H200 the same cases once failed with the barrier too, and later did not (the cause is
    # not known; docs/notes/decoding.md): the default computed tiles read no table.
    out, lse, ids, _ = lax.optimization_barrier((out, lse, ids, kept))
    # The rows past q_len x group pad the kernel's dots: the merge reads only the queries' rows.
    out, lse = out[..., : q_len * group, :], lse[..., : q_len * group]
    merged, merged_lse = _merge(ids, out, lse, groups)  # per sequence (lean: per (sequence, K/V head))
    # Back to [b, q_len, h, d] and [b, h, q_len].
    merged = merged.reshape(b, hk, q_len, group, d)
    merged_lse = merged_lse.reshape(b, hk, q_len, group)
    return Partial(
        merged.transpose(0, 2, 1, 3, 4).reshape(b, q_len, h, d),
        merged_lse.transpose(0, 1, 3, 2).reshape(b, h, q_len),
    )


def _tile_call(call, kernel, operands, n: int, hk: int, table: Array | None = None):
    """The stream_k and split schedules, a program a (K/V head, tile): (out [n, hk, rows, d],
    lse [n, hk, rows]). table [n, 4]: each program reads its row (_kernel); None: the kernel
    computes its tile (_computed_tile_kernel)."""
    _, _, rows, d = operands[1].shape
    tables = () if table is None else (table,)
    # Grid (K/V head, tile), the head varying fastest: the programs of one tile's K/V heads
    # launch together and read the same cache rows side by side (1-7% faster on an H100 than
    # a head's tiles together).
    whole = lambda shape: pl.BlockSpec(shape, lambda g, t: (0,) * len(shape))  # noqa: E731
    rows_of_table = [pl.BlockSpec((None, 4), lambda g, t: (t, 0))] * len(tables)
    return call(
        kernel,
        grid=(hk, n),
        in_specs=[*rows_of_table, *(whole(x.shape) for x in operands)],
        out_specs=[
            pl.BlockSpec((None, None, rows, d), lambda g, t: (t, g, 0, 0)),
            pl.BlockSpec((None, None, rows), lambda g, t: (t, g, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((n, hk, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((n, hk, rows), jnp.float32),
        ],
        name="bpt_decode",
    )(*tables, *operands)


def _lean_call(call, kernel_args, operands, pieces, spans, hk):
    """The lean schedule over its piece and span tables (_lean_table): (out [pieces, 1, rows,
    d], lse [pieces, 1, rows], each piece's (sequence, K/V head) as sequence * hk + head, the
    tables the kernel read)."""
    (_, _, rows, d), (programs, _), n = operands[1].shape, spans.shape, pieces.shape[0]
    whole = lambda shape: pl.BlockSpec(shape, lambda p: (0,) * len(shape))  # noqa: E731
    out, lse = call(
        functools.partial(_lean_kernel, *kernel_args),
        grid=(programs,),
        in_specs=[whole(spans.shape), whole(pieces.shape), *(whole(x.shape) for x in operands)],
        out_specs=[whole((n, rows, d)), whole((n, rows))],
        out_shape=[jax.ShapeDtypeStruct((n, rows, d), jnp.float32), jax.ShapeDtypeStruct((n, rows), jnp.float32)],
        name="bpt_decode_lean",
    )(spans, pieces, *operands)
    return out[:, None], lse[:, None], pieces[:, 0] * hk + pieces[:, 1], (pieces, spans)
