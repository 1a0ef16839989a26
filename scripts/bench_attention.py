"""Attention implementations on one GPU: milliseconds and TFLOP/s, forward and forward+backward.

    python scripts/bench_attention.py                       # the issue's table: causal, d=128
    python scripts/bench_attention.py --seqs 1024,4096 --head_dims 64,80,128 --causal both
    python scripts/bench_attention.py --tune triton --seqs 16384   # block sizes of bpt's kernels
    python scripts/bench_attention.py --tune hopper --seqs 16384
    python scripts/bench_attention.py --tune backward --seqs 65536
    python scripts/bench_attention.py --tune hopper --shapes packed --only d64   # at named shapes
    python scripts/bench_attention.py --shapes training --impls bpt-pallas,cudnn   # one table
    python scripts/bench_attention.py --seqs 16384,65536 --impls bpt-pallas,cudnn --repeats 5
    python scripts/bench_attention.py --shapes packed --impls bpt-pallas,bpt-pallas-masked,bpt-triton,cudnn
    python scripts/bench_attention.py --shapes packed --only S64K,d64 --impls bpt-pallas,bpt-triton

FLOPs: 4*B*H*S^2*D for the forward (halved when causal); forward+backward counts 3.5x the
forward. The implementations of a shape are compiled together and timed in turn, --repeats
times (medians reported): a GPU's clock drifts with its power draw, by several percent from
one second to the next on an H100 under these kernels. Prints a markdown table last (also
when stopped early by Ctrl-C or SIGTERM: of what it measured); --out writes every
measurement as JSON and --png draws TFLOP/s against the sequence length.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from benchlib import check_stopped, script_parser, stop_on_sigterm, write_results

from bpt.ops import blockwise_attention, reference_attention
from bpt.ops.kernels import attention_hopper, flash_attention


def jax_pallas(q, k, v, *, causal):
    from jax.experimental.pallas.ops.gpu import attention as ref_kernel

    return ref_kernel.mha(q, k, v, None, sm_scale=1.0 / math.sqrt(q.shape[-1]), causal=causal)


def cudnn(q, k, v, *, causal, segment_ids=None):
    """cuDNN's fused attention through jax.nn; with segment ids (sorted, each document one
    run) its packed layout instead, each document a sequence of its own (cudnn_packed)."""
    if segment_ids is not None:
        return cudnn_packed(q, k, v, causal=causal, segment_ids=segment_ids)
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


def document_offsets(segment_ids) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [b, m + 1], lengths [b, m]) int32 of the documents in sorted segment ids
    [b, s] (concrete), m the most documents a row holds: each document's first position and
    length, the entries a row lacks -1 (the layout of cuDNN's packed sequences in JAX)."""
    ids = np.asarray(segment_ids)
    if ids.ndim != 2 or np.any(np.diff(ids, axis=1) < 0):
        raise ValueError("cuDNN's packed layout needs [batch, seq] segment ids sorted along each row")
    starts = [np.flatnonzero(np.diff(row, prepend=row[0] - 1)) for row in ids]
    m = max(len(st) for st in starts)
    offsets = np.full((ids.shape[0], m + 1), -1, np.int32)
    lengths = np.full((ids.shape[0], m), -1, np.int32)
    for i, st in enumerate(starts):
        offsets[i, : len(st)] = st
        lengths[i, : len(st)] = np.diff(np.append(st, ids.shape[1]))
    return offsets, lengths


def cudnn_packed(q, k, v, *, causal, segment_ids):
    """cuDNN's attention over packed documents (its THD layout: a query sees the keys of its
    own document, causally from the document's start), through JAX's cuDNN module (not
    jax.nn, which takes no documents)."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention
    except ImportError as e:
        raise RuntimeError(f"this jax has no cuDNN packed-layout attention ({e})") from e
    offsets, lengths = (jnp.asarray(a) for a in document_offsets(segment_ids))
    mask = MaskType.PADDING_CAUSAL if causal else MaskType.PADDING
    scale = 1.0 / math.sqrt(q.shape[-1])
    return dot_product_attention(
        q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
        scale=scale, mask_type=mask,
    )  # fmt: skip


def tokamax(implementation):
    """tokamax's attention (an optional comparison; `pip install tokamax`, Python >= 3.12)."""

    def fn(q, k, v, *, causal):
        try:
            import tokamax as tk
        except ImportError as e:
            raise RuntimeError(f"tokamax is not installed ({e})") from e
        return tk.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)

    return fn


IMPLS = {
    # bpt's kernels: those that "auto" picks (the Mosaic GPU ones on H100-class GPUs), and the
    # Triton ones.
    "bpt-pallas": lambda q, k, v, *, causal, **kw: flash_attention(q, k, v, causal=causal, **kw),
    # The Hopper backward in two passes (dK/dV, then dQ recomputing P) instead of one that
    # adds dQ as it goes.
    "bpt-pallas-2pass": lambda q, k, v, *, causal, **kw: flash_attention(
        q, k, v, causal=causal, hopper_fused_dq=False, **kw
    ),
    # bpt's Hopper kernels asked for by name (what "auto" takes where they run).
    "bpt-pallas-hopper": lambda q, k, v, *, causal, **kw: flash_attention(
        q, k, v, causal=causal, forward="hopper", backward="hopper", **kw
    ),
    "bpt-triton": lambda q, k, v, *, causal, **kw: flash_attention(
        q, k, v, causal=causal, forward="triton", backward="triton", **kw
    ),
    # The Triton forward in float8 e4m3 (the quantization of q, k, v in XLA counted in its
    # time); the backward is the 16-bit Triton one.
    "bpt-fp8": lambda q, k, v, *, causal, **kw: flash_attention(
        q, k, v, causal=causal, fp8=True, backward="triton", **kw
    ),
    "cudnn": cudnn,
    "jax-pallas": jax_pallas,
    "blockwise": lambda q, k, v, *, causal: blockwise_attention(
        q, k, v, causal=causal, q_chunk_size=1024, kv_chunk_size=1024
    ),
    "xla": lambda q, k, v, *, causal: reference_attention(q, k, v, causal=causal),
    "tokamax-mosaic": tokamax("mosaic"),
    "tokamax-triton": tokamax("triton"),
}
# The Hopper backward with GQA run as one CTA a query head (keys and values repeated, dK and
# dV summed over the group) instead of one a key/value head walking its group.
IMPLS["bpt-pallas-gqa-expand"] = functools.partial(flash_attention, hopper_gqa="expand")
# The Hopper backward with GQA as one CTA a key/value head's tile, walking its group's query
# heads (bpt-pallas: one a query head's, attention_hopper.backward's gqa="expand").
IMPLS["bpt-pallas-gqa-walk"] = functools.partial(flash_attention, hopper_gqa="walk")
# The fused Hopper backward's split of dQ between its warpgroups (attention_hopper.DQ_SPLITS; at
# head_dim 64 "keys" or "steps"), e.g. bpt-pallas-dq-steps.
for _split in attention_hopper.DQ_SPLITS:
    IMPLS[f"bpt-pallas-dq-{_split}"] = functools.partial(flash_attention, hopper_dq_split=_split)
# The Hopper forward under each of its schedules (attention_hopper.forward), e.g. bpt-pallas-overlap.
for _schedule in attention_hopper.SCHEDULES:
    IMPLS[f"bpt-pallas-{_schedule}"] = functools.partial(flash_attention, hopper_schedule=_schedule)
# The Hopper kernels' CTAs launched in runs of up to N tiles of one (batch, head) (attention_hopper
# _Grid; bpt-pallas: TILE_GROUP, None: all of a head's tiles); bpt-pallas-group1 launches one
# tile of every (batch, head) in turn, the order before tile groups.
for _group in (1, 2, 4, 16, 32, 64, 128, 256, 512, 1024):
    IMPLS[f"bpt-pallas-group{_group}"] = functools.partial(flash_attention, hopper_tile_group=_group)
# The Hopper forward persistent (attention_hopper.forward's persistent: one CTA an SM, each
# taking tiles in turn), its backward as bpt-pallas's.
IMPLS["bpt-pallas-persistent"] = functools.partial(flash_attention, hopper_persistent=True)
# With segment ids, the Hopper kernels' CTAs launched sorted by their spans within windows of
# N waves of SMs (attention_hopper.sorted_launch; sort0: in the grid's order).
for _window in (0, 1, 2, 4, 8):
    IMPLS[f"bpt-pallas-sort{_window}"] = functools.partial(flash_attention, hopper_sort_window=_window)
# The Hopper backward's dK/dV pass walking each tile's query blocks in this order
# (attention_hopper.QUERY_ORDERS), e.g. bpt-pallas-qdescending.
for _order in attention_hopper.QUERY_ORDERS:
    IMPLS[f"bpt-pallas-q{_order}"] = functools.partial(flash_attention, hopper_query_order=_order)


@contextlib.contextmanager
def every_block_masked():
    """While open, the kernels trace with each streamed block masked by segment, as before a
    document's interior blocks ran unmasked: their segment spans with empty dense runs (an
    ablation; the spans, and so the blocks skipped between documents, stay the same)."""
    from bpt.ops import segments
    from bpt.ops.kernels import attention as triton_kernels

    def edges_everywhere(*args, **kwargs):
        spans = segments.segment_spans(*args, **kwargs)
        if kwargs.get("dense"):
            spans = spans.at[..., 2].set(spans[..., 0]).at[..., 3].set(spans[..., 0])
        return spans

    modules = (attention_hopper.pipeline, triton_kernels)  # the modules that call segment_spans
    saved = [m.segment_spans for m in modules]
    for m in modules:
        m.segment_spans = edges_everywhere
    try:
        yield
    finally:
        for m, f in zip(modules, saved):
            m.segment_spans = f


@contextlib.contextmanager
def sorted_at_any_waves():
    """While open, the Hopper kernels trace with their launch sorted (sort_window) however
    many waves the grid holds (attention_hopper.SORT_WAVES lifted)."""
    saved = attention_hopper.pipeline.SORT_WAVES
    attention_hopper.pipeline.SORT_WAVES = 1 << 30
    try:
        yield
    finally:
        attention_hopper.pipeline.SORT_WAVES = saved


# bpt's kernels with every streamed block masked by segment (every_block_masked), e.g.
# bpt-pallas-masked: what masking only the documents' edges is worth.
MASKED = {f"{impl}-masked": impl for impl in ("bpt-pallas", "bpt-triton", "bpt-pallas-overlap")}
IMPLS.update({name: IMPLS[impl] for name, impl in MASKED.items()})
# The sorted launch past SORT_WAVES, e.g. bpt-pallas-sort4-anywaves.
ANY_WAVES = {f"bpt-pallas-sort{w}-anywaves": f"bpt-pallas-sort{w}" for w in (2, 4, 8)}
IMPLS.update({name: IMPLS[impl] for name, impl in ANY_WAVES.items()})
# The implementations traced (at their first call) within a context.
TRACED_WITHIN = {name: every_block_masked for name in MASKED} | {name: sorted_at_any_waves for name in ANY_WAVES}
# The Hopper kernels' shared-memory rings N blocks deep (bpt-pallas: attention_hopper.default_stages,
# 2 but the backward's 4 at head_dim 64).
for _stages in (1, 3, 4, 6, 8):
    IMPLS[f"bpt-pallas-stages{_stages}"] = functools.partial(flash_attention, hopper_stages=_stages)


def time_fn(fn, *args, min_seconds: float = 0.3) -> float:
    """Seconds per call, after two warm-up calls (compilation; libraries that tune on their
    first call), over enough calls to last min_seconds."""
    for _ in range(2):
        check_stopped()
        jax.block_until_ready(fn(*args))
    start, calls = time.perf_counter(), 0
    while True:
        check_stopped()
        out = fn(*args)
        calls += 1
        if calls in (1, 3, 10, 30, 100, 300) or calls % 1000 == 0:
            jax.block_until_ready(out)
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                return elapsed / calls


def packed_segments(batch: int, seq: int, documents: int) -> jax.Array:
    """[batch, seq] int32 segment ids: `documents` documents of random lengths (at least 64
    tokens, a fixed seed) packed back to back in each sequence."""
    key = jax.random.PRNGKey(documents)
    cuts = jax.random.choice(key, seq // 64 - 1, (batch, documents - 1), replace=False)
    cuts = 64 * (jnp.sort(cuts, axis=1) + 1)
    return jnp.sum(jnp.arange(seq)[None, :, None] >= cuts[:, None, :], axis=-1).astype(jnp.int32)


def prepare(
    impl: str,
    *,
    seq: int,
    heads: int,
    head_dim: int,
    causal: bool,
    batch: int,
    dtype,
    kv_heads=None,
    segments: int = 0,
    **kw,
) -> tuple[dict, list, tuple]:
    """(the row's description, [(name, jitted function, its FLOPs)], inputs) of one
    implementation at one shape. kv_heads: the keys' and values' heads (GQA; default: heads).
    segments: that many packed documents a sequence (segment ids; the FLOPs count only each
    document's own square, or triangle causal: the work a kernel that skips the blocks
    between documents still has to do)."""
    kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(seq + head_dim), 4)
    shape, kv_shape = (batch, seq, heads, head_dim), (batch, seq, kv_heads or heads, head_dim)
    q, do = jax.random.normal(kq, shape, dtype), jax.random.normal(kd, shape, dtype)
    k, v = jax.random.normal(kk, kv_shape, dtype), jax.random.normal(kv, kv_shape, dtype)
    if segments > 1:
        kw = kw | dict(segment_ids=packed_segments(batch, seq, segments))
    fn = functools.partial(IMPLS[impl], causal=causal, **kw)

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

    flops = 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
    if segments > 1:  # the documents' own squares: sum over documents of length^2
        pairs = jnp.sum(jax.nn.one_hot(kw["segment_ids"], segments, dtype=jnp.float32).sum(1) ** 2)
        flops = 4 * heads * float(pairs) * head_dim / (2 if causal else 1)
    row = dict(impl=impl, seq=seq, heads=heads, head_dim=head_dim, causal=causal, batch=batch)
    row |= {name: value for name, value in kw.items() if name != "segment_ids"}
    if segments > 1:
        row["segments"] = segments
    if kv_heads and kv_heads != heads:
        row["kv_heads"] = kv_heads
    timed = [
        ("fwd", jax.jit(fn), flops),
        ("fwd_bwd", jax.jit(jax.grad(loss, argnums=(0, 1, 2))), 3.5 * flops),
    ]
    if impl in TRACED_WITHIN:
        timed = [(name, _traced_within(TRACED_WITHIN[impl], f), n) for name, f, n in timed]
    return row, timed, (q, k, v)


def _traced_within(context, jitted):
    def call(*args):
        with context():
            return jitted(*args)

    return call


def measure(impl: str, *, repeats: int = 1, **shape) -> dict:
    """One implementation at one shape (see prepare): milliseconds and TFLOP/s."""
    return measure_together([impl], repeats=repeats, **shape)[0]


def measure_together(impls: list[str], *, repeats: int = 1, **shape) -> list[dict]:
    """Several implementations at one shape, timed in turn `repeats` times (so that a GPU
    whose clock drifts under load treats them alike); each row reports the median time, and
    with repeats > 1 every round's milliseconds (fwd_ms_rounds, fwd_bwd_ms_rounds)."""
    prepared = [prepare(impl, **shape) for impl in impls]
    rounds: list[dict] = [{} for _ in impls]
    for _ in range(repeats):
        for (row, timed, args), times in zip(prepared, rounds):
            for name, f, _ in timed:
                if f"{name}_error" in row:
                    continue
                try:
                    seconds = time_fn(f, *args)
                except Exception as e:  # out of memory, or inputs an implementation does not take
                    first_line = (str(e).splitlines() or [""])[0]
                    row[f"{name}_error"] = f"{type(e).__name__}: {first_line[:160]}"
                    times.pop(name, None)
                    continue
                times.setdefault(name, []).append(seconds)
    rows = []
    for (row, timed, _), times in zip(prepared, rounds):
        for name, _, flops in timed:
            if name not in times:
                continue
            seconds = statistics.median(times[name])
            row[f"{name}_ms"] = seconds * 1e3
            row[f"{name}_tflops"] = flops / seconds / 1e12
            if repeats > 1:
                row[f"{name}_ms_rounds"] = [t * 1e3 for t in times[name]]
        rows.append(row)
    return rows


# Named sets of shapes (--shapes): the long-context and training shapes bpt's kernels are
# compared with cuDNN on, each {label: measure()'s shape arguments}.
SHAPES = {
    "training": {
        "B1 S16K H16": dict(batch=1, seq=16384, heads=16, head_dim=128, causal=True),
        "B1 S64K H16": dict(batch=1, seq=65536, heads=16, head_dim=128, causal=True),
        "B8 S2K H16": dict(batch=8, seq=2048, heads=16, head_dim=128, causal=True),
        "B1 S16K H32/KV8": dict(batch=1, seq=16384, heads=32, kv_heads=8, head_dim=128, causal=True),
        "B1 S16K H32/KV4": dict(batch=1, seq=16384, heads=32, kv_heads=4, head_dim=128, causal=True),
        "B1 S16K H16 d64": dict(batch=1, seq=16384, heads=16, head_dim=64, causal=True),
        "B1 S16K H8 d256": dict(batch=1, seq=16384, heads=8, head_dim=256, causal=True),
        "B1 S16K H16 non-causal": dict(batch=1, seq=16384, heads=16, head_dim=128, causal=False),
    },
    # GPT-1B's attention in micro-batches of 16K tokens (the throughput table's), by context:
    # where impl="auto" chooses between bpt's kernels and cuDNN's (SMALL in bpt/ops/attention.py).
    # Packed documents (segment ids): bpt's Hopper kernels against its Triton ones and cuDNN's
    # packed layout (cudnn_packed: jax.nn's cuDNN call takes no segment ids).
    "packed": {
        "B1 S16K H16 8 docs": dict(batch=1, seq=16384, heads=16, head_dim=128, causal=True, segments=8),
        "B2 S8K H16 4 docs": dict(batch=2, seq=8192, heads=16, head_dim=128, causal=True, segments=4),
        "B1 S64K H16 32 docs": dict(batch=1, seq=65536, heads=16, head_dim=128, causal=True, segments=32),
        "B2 S32K H16 8 docs": dict(batch=2, seq=32768, heads=16, head_dim=128, causal=True, segments=8),
        "B1 S16K H16 d64 8 docs": dict(batch=1, seq=16384, heads=16, head_dim=64, causal=True, segments=8),
        "B1 S16K H8 d256 8 docs": dict(batch=1, seq=16384, heads=8, head_dim=256, causal=True, segments=8),
    },
    "micro_batches": {
        f"B{16 // s} S{s}K H16": dict(batch=16 // s, seq=s * 1024, heads=16, head_dim=128, causal=True)
        for s in (1, 2, 4, 8, 16)
    },
}


def chosen_shapes(parser, name: str, only: str) -> dict:
    """SHAPES[name], or of it the shapes whose label holds one of --only's words."""
    if only and not name:
        parser.error("--only picks shapes of a --shapes set; name the set")
    shapes = SHAPES.get(name, {})
    words = [w.strip() for w in only.split(",") if w.strip()]
    if words:
        shapes = {label: s for label, s in shapes.items() if any(w in label for w in words)}
        if not shapes:
            parser.error(f"--only {only!r} matches no label of --shapes {name}: {', '.join(SHAPES[name])}")
    return shapes


def shapes_table(rows: list[dict], impls: list[str]) -> str:
    """One line a shape (rows carry a "shape" label): each implementation's forward and
    forward+backward TFLOP/s, then the first implementation's forward+backward against
    cuDNN's (or, without cuDNN, the last implementation's) where both ran."""
    base = "cudnn" if "cudnn" in impls else impls[-1]
    compare = impls[0] != base
    head = "| shape | " + " | ".join(f"{impl} fwd | {impl} f+b" for impl in impls)
    head += f" | {impls[0]} / {base} f+b |" if compare else " |"
    lines = [head, "|---" * (1 + 2 * len(impls) + compare) + "|"]
    by_key = {(r["shape"], r["impl"]): r for r in rows}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        cells = []
        for impl in impls:
            r = by_key.get((shape, impl), {})
            cells += [f"{r[n + '_tflops']:.0f}" if n + "_tflops" in r else "–" for n in ("fwd", "fwd_bwd")]
        if compare:
            ours, theirs = by_key.get((shape, impls[0]), {}), by_key.get((shape, base), {})
            ratio = "–"
            if "fwd_bwd_tflops" in ours and "fwd_bwd_tflops" in theirs:
                ratio = f"{ours['fwd_bwd_tflops'] / theirs['fwd_bwd_tflops']:.2f}x"
            cells.append(ratio)
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tune_table(rows: list[dict], setting_keys: list[str]) -> str:
    """One line a measured setting (--tune): the shape (its label, or length, head_dim and
    causality), the settings that differ between the rows, forward and forward+backward
    TFLOP/s (or the error)."""
    keys = [k for k in dict.fromkeys(setting_keys) if len({str(r.get(k)) for r in rows}) > 1]
    lines = ["| shape | " + " | ".join([*keys, "fwd", "f+b"]) + " |", "|---" * (3 + len(keys)) + "|"]
    for r in rows:
        shape = r.get("shape") or f"S{r['seq']} d{r['head_dim']}{'' if r['causal'] else ' non-causal'}"
        cells = [str(r.get(k, "")) for k in keys]
        for name in ("fwd", "fwd_bwd"):
            cells.append(f"{r[name + '_tflops']:.0f}" if name + "_tflops" in r else r.get(name + "_error", "–")[:40])
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def by_line(rows: list[dict]) -> dict:
    """The rows of each (implementation, head_dim, causal), in the order first seen."""
    lines: dict = {}
    for r in rows:
        lines.setdefault((r["impl"], r["head_dim"], r["causal"]), []).append(r)
    return lines


def table(rows: list[dict], seqs: list[int]) -> str:
    head = "| implementation | " + " | ".join(f"{s // 1024}K fwd | {s // 1024}K f+b" for s in seqs) + " |"
    lines = [head, "|---" * (1 + 2 * len(seqs)) + "|"]
    for (impl, d, causal), group in by_line(rows).items():
        by_seq = {r["seq"]: r for r in group}
        cells = []
        for s in seqs:
            r = by_seq.get(s, {})
            for name in ("fwd", "fwd_bwd"):
                cells.append(f"{r[name + '_tflops']:.0f}" if name + "_tflops" in r else "–")
        lines.append(f"| {impl} (d={d}{', causal' if causal else ''}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, name in zip(axes, ("fwd", "fwd_bwd")):
        for (impl, d, causal), group in by_line(rows).items():
            pts = sorted((r["seq"], r[name + "_tflops"]) for r in group if name + "_tflops" in r)
            if pts:
                ax.plot(*zip(*pts), "o-", label=f"{impl} d={d}{' causal' if causal else ''}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.set_title("forward" if name == "fwd" else "forward + backward")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = script_parser(__doc__, png=True)
    parser.add_argument("--seqs", default="4096,16384,65536")
    parser.add_argument("--head_dims", default="128")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv_heads", type=int, default=0, help="key/value heads (GQA); 0: --heads")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--causal", choices=["yes", "no", "both"], default="yes")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--impls", default="bpt-pallas,cudnn,jax-pallas")
    parser.add_argument("--max_xla_seq", type=int, default=16384, help="longer: skip materialized XLA")
    parser.add_argument("--max_blockwise_seq", type=int, default=16384)
    parser.add_argument(
        "--tune",
        choices=["", "triton", "hopper", "backward"],
        default="",
        help="sweep a kernel's block sizes instead",
    )
    parser.add_argument(
        "--shapes",
        choices=["", *SHAPES],
        default="",
        help="measure a named set of shapes (SHAPES) instead of --seqs/--head_dims/--batch/...",
    )
    parser.add_argument(
        "--only",
        default="",
        help="with --shapes: only the shapes whose label holds one of these, comma-separated ('S64K,d64')",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="time the implementations of a shape in turn this many times; report medians",
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1; got {args.repeats}")
    shapes = chosen_shapes(parser, args.shapes, args.only)
    seqs = [int(s) for s in args.seqs.split(",")]
    dims = [int(d) for d in args.head_dims.split(",")]
    causals = {"yes": [True], "no": [False], "both": [True, False]}[args.causal]
    dtype = jnp.dtype(args.dtype)
    what = (
        f"shapes {args.shapes!r}"
        if args.shapes
        else f"batch {args.batch}, {args.heads} heads"
        + (f" ({args.kv_heads} key/value heads)" if args.kv_heads else "")
    )
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {args.dtype}, {what}")
    if args.kv_heads and args.heads % args.kv_heads:
        raise SystemExit(f"--kv_heads {args.kv_heads} must divide --heads {args.heads}")
    common = dict(heads=args.heads, kv_heads=args.kv_heads or None, batch=args.batch, dtype=dtype)
    rows = []
    if args.tune == "triton":
        settings = [
            dict(block_q=bq, block_k=bk, block_q_bwd=min(bq, 64), block_k_bwd=min(bk, 64))
            | dict(num_warps=warps, num_stages=stages, forward="triton")
            for bq, bk, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))
        ]
    elif args.tune == "hopper":
        settings = [
            dict(forward="hopper", backward="hopper", hopper_block_k=bk, hopper_stages=stages)
            for bk, stages in itertools.product((64, 128), (2, 3, 4))
        ]
    elif args.tune == "backward":  # the Triton backward behind the Hopper forward
        settings = [
            dict(block_q_bwd=bq, block_k_bwd=bk, num_warps=warps, num_stages=stages, backward="triton")
            for (bq, bk), warps, stages in itertools.product(
                ((32, 64), (64, 64), (64, 128), (128, 64), (128, 128)), (4, 8), (2, 3)
            )
        ]
    stop_on_sigterm()  # cut short (timeout, a scheduler), it still prints what it measured
    try:
        if args.shapes and args.tune:  # each setting at each shape of the set
            for (label, shape), kw in itertools.product(shapes.items(), settings):
                rows.append(measure("bpt-pallas", repeats=args.repeats, dtype=dtype, **shape, **kw))
                rows[-1]["shape"] = label
                print(json.dumps(rows[-1]), flush=True)
        elif args.shapes:
            impls = args.impls.split(",")
            for label, shape in shapes.items():
                for row in measure_together(impls, repeats=args.repeats, dtype=dtype, **shape):
                    rows.append(row | {"shape": label})
                    print(json.dumps(rows[-1]), flush=True)
        elif args.tune:
            for seq, d, causal in itertools.product(seqs, dims, causals):
                for kw in settings:
                    row = measure("bpt-pallas", seq=seq, head_dim=d, causal=causal, **common, **kw)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        else:
            for d, causal, seq in itertools.product(dims, causals, seqs):
                impls = [
                    impl
                    for impl in args.impls.split(",")
                    if not (impl == "xla" and seq > args.max_xla_seq)
                    and not (impl == "blockwise" and seq > args.max_blockwise_seq)
                ]
                shape = dict(seq=seq, head_dim=d, causal=causal, **common)
                for row in measure_together(impls, repeats=args.repeats, **shape):
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    except KeyboardInterrupt as stop:
        print(f"{stop or 'interrupted'}: the table holds the {len(rows)} measurements made", flush=True)
    if args.out:
        write_results(args.out, rows)
    if args.png and not (args.tune or args.shapes):
        plot(rows, args.png)
    if args.tune:
        print(tune_table(rows, [key for kw in settings for key in kw]))
    elif args.shapes:
        print(shapes_table(rows, args.impls.split(",")))
    else:
        print(table(rows, seqs))


if __name__ == "__main__":
    main()
