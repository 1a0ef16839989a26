"""Decode attention: time and effective bandwidth of one new token over a long K/V cache.

    python scripts/bench_decode.py --out results/decode                    # kernels + ragged
    python scripts/bench_decode.py --parts kernels --contexts 32768,131072,524288 --batches 1,8
    python scripts/bench_decode.py --parts tree --contexts 262144,1048576,2097152   # on N GPUs
    python scripts/bench_decode.py --parts sample --sample_contexts 131072,524288   # GPT-1B

kernels: for each context x batch x heads/KV heads (head_dim 128, bf16, the whole cache
visible), the median of --repeats calls (the best of --rounds interleaved rounds) of bpt's
pallas kernel (its default stream-K tiles, and the "lean" schedule), bpt's split_kv (plain JAX), the XLA reference, cuDNN (jax.nn.dot_product_attention with one query) and JAX's own Pallas
decode kernel (jax.experimental.pallas.ops.gpu.decode_attention.gqa). Effective bandwidth:
the bytes of K and V read (2 x batch x context x kv_heads x head_dim x 2) over the time. The
table's last columns: the share of the memory's bandwidth (the maker's figure for the GPU,
or --hbm_tb_per_s) that bpt's kernel reads at, and that a call 1.1x cuDNN's speed would.

ragged: a batch of 8 sequences of lengths from 1K to 512K in one max-length cache, bpt's
kernel with the stream-K tile table against plain split-KV (each sequence cut into the same
number of splits), split_kv and the reference.

tree: the cache sharded over all devices along its slots: tree decoding (one all-reduce of
the partial softmaxes) against ring decoding (the cache shards passed around), and the local
attention over one shard alone.

sample: bpt.sample's path (what bpt-sample runs) for a model of --sample_config with random
bf16 weights and model.cache_dtype --cache_dtype: a random prompt that fills each of
--sample_contexts but --new_tokens is prefilled in chunks of --prefill_chunk, then
--new_tokens tokens are decoded; prefill seconds, decode tokens/s and ms a token (compile
times apart), and the device's peak memory.

Prints markdown tables last; --out writes results.json, table.md and decode.png.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from benchlib import (  # noqa: E402
    TIMINGS,
    human_tokens,
    parse_choices,
    run_meta,
    script_parser,
    seconds_per_call,
    write_results,
)

PARTS = ("kernels", "ragged", "tree", "sample")
HEADS = {"16/16": (16, 16), "32/8": (32, 8)}
RAGGED_LENGTHS = (1024, 4096, 16384, 32768, 65536, 131072, 262144, 524288)
PEER = "cuDNN"  # the kernels table's ceiling column: what 1.1x its speed would need
# The memory's bandwidth by the maker's sheet, bytes/s (device_kind contains the name; the
# first match counts): the kernels table's ceiling. --hbm_tb_per_s sets another.
HBM_BYTES_PER_S = {"H100 PCIE": 2.0e12, "H100 NVL": 3.9e12, "H200": 4.8e12, "H100": 3.35e12}


def hbm_bytes_per_s(device, override_tb: float = 0.0) -> float | None:
    """The device's memory bandwidth (override_tb, TB/s, wins); None where it is not known."""
    if override_tb:
        return override_tb * 1e12
    kind = device.device_kind.upper()
    return next((bw for name, bw in HBM_BYTES_PER_S.items() if name in kind), None)


def cache_bytes(batch: int, length: int, kv_heads: int, head_dim: int, itemsize: int = 2) -> int:
    return 2 * batch * length * kv_heads * head_dim * itemsize


def inputs(batch, length, heads, kv_heads, head_dim=128, seed=0):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (batch, 1, heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(kk, (batch, length, kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(kv, (batch, length, kv_heads, head_dim), jnp.bfloat16)
    return q, k, v


def implementations(kernel_options: dict, lean_waves=(0,), splits=(0,), variants=()) -> dict:
    """name -> fn(q, k, v, positions, lengths); lean_waves: one "bpt pallas lean" per value
    (programs a SM; 0 the kernel's default), named by it when there are several; splits: one
    "bpt pallas" per programs-per-K/V-head value (0: the kernel's default), "bpt pallas sN"
    for N > 0 when there are several; variants: (label, options) pairs, one "bpt pallas
    <label>" each, the kernel with kernel_options updated by options."""
    from bpt.ops import decode_attention

    def bpt(impl, **options):
        return jax.jit(
            lambda q, k, v, pos, lengths: decode_attention(
                q, k, v, pos, lengths=lengths, impl=impl, **options
            )
        )

    fns = {
        **{
            "bpt pallas" + (f" s{n}" if n and len(splits) > 1 else ""): bpt(
                "pallas", **kernel_options, **({"num_splits": n} if n else {})
            )
            for n in splits
        },
        **{f"bpt pallas {label}": bpt("pallas", **kernel_options, **options) for label, options in variants},
        # Lean Attention's ranges across heads and sequences (its own program count)
        **{
            "bpt pallas lean" + (f" x{w}" if len(lean_waves) > 1 else ""): bpt(
                "pallas", **{**kernel_options, "schedule": "lean", "num_splits": 0, "lean_waves": w or None}
            )
            for w in lean_waves
        },
        "bpt split_kv": bpt("split_kv", chunk_size=4096),
        "XLA": bpt("reference"),
    }
    if jax.default_backend() == "gpu":
        from jax.experimental.pallas.ops.gpu import decode_attention as jax_decode

        fns[PEER] = jax.jit(
            lambda q, k, v, pos, lengths: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
        )
        fns["JAX Pallas"] = jax.jit(
            lambda q, k, v, pos, lengths: jax_decode.gqa(q[:, 0], k, v, kv_seq_len=lengths)
        )
    return fns


def kernels_part(args) -> list[dict]:
    timed = functools.partial(seconds_per_call, repeats=args.repeats, timing=args.timing)
    rows = []
    for length in args.contexts:
        for batch in args.batches:
            for name in args.heads:
                heads, kv_heads = HEADS[name]
                q, k, v = inputs(batch, length, heads, kv_heads)
                pos = jnp.array([length - 1])
                lengths = jnp.full((batch,), length, jnp.int32)
                nbytes = cache_bytes(batch, length, kv_heads, 128)
                row = dict(context=length, batch=batch, heads=name, bytes=nbytes)
                row.update(timing=args.timing, times={}, hbm_tb_per_s=args.hbm_tb_per_s)
                fns = implementations(args.kernel_options, args.lean_waves, args.num_splits, args.variants)
                for round_ in range(args.rounds):  # interleaved, so drift on the machine hits all alike
                    for impl, fn in list(fns.items()):
                        try:
                            warmup = 2 - min(round_, 1)
                            t = timed(fn, q, k, v, pos, lengths, warmup=warmup)
                            row["times"][impl] = min(t, row["times"].get(impl, t))
                        except Exception as e:  # a peer that does not take this shape: noted, not fatal
                            row.setdefault("errors", {})[impl] = f"{type(e).__name__}: {str(e)[:200]}"
                            del fns[impl]
                row["tb_per_s"] = {impl: nbytes / t / 1e12 for impl, t in row["times"].items()}
                print(json.dumps(row), flush=True)
                rows.append(row)
                del q, k, v
    return rows


def ragged_part(args) -> list[dict]:
    from bpt.ops.decode import last_visible_slot
    from bpt.ops.kernels.decode import decode_partial

    timed = functools.partial(seconds_per_call, repeats=args.repeats, timing=args.timing)
    lengths = jnp.array(RAGGED_LENGTHS[: args.ragged_batch], jnp.int32)
    batch, length = int(lengths.shape[0]), int(max(RAGGED_LENGTHS[: args.ragged_batch]))
    rows = []
    for name in args.heads:
        heads, kv_heads = HEADS[name]
        q, k, v = inputs(batch, length, heads, kv_heads)
        pos = jnp.array([length - 1])
        last = last_visible_slot(pos, batch, lengths)
        nbytes = sum(cache_bytes(1, int(n), kv_heads, 128) for n in lengths)
        fns = {
            f"pallas {schedule}": jax.jit(
                lambda q, k, v, last, schedule=schedule: (
                    decode_partial(q, k, v, last, schedule=schedule, **args.kernel_options).out
                )
            )
            for schedule in ("stream_k", "split", "lean")
        }
        row = dict(lengths=[int(n) for n in lengths], heads=name, bytes=nbytes, timing=args.timing, times={})
        for impl, fn in fns.items():
            row["times"][impl] = timed(fn, q, k, v, last)
        for impl, fn in implementations(args.kernel_options).items():
            if impl.startswith("bpt split") or impl == "XLA":
                row["times"][impl] = timed(fn, q, k, v, pos, lengths)
        row["tb_per_s"] = {impl: nbytes / t / 1e12 for impl, t in row["times"].items()}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def tree_part(args) -> list[dict]:
    from jax.sharding import NamedSharding, PartitionSpec

    from bpt.ops.decode import attend_cache, last_visible_slot
    from bpt.parallel import make_mesh, ring_decode_attention, tree_decode_attention

    timed = functools.partial(seconds_per_call, repeats=args.repeats, timing=args.timing)
    n = jax.device_count()
    mesh = make_mesh(sequence=n)
    impl = "pallas" if jax.default_backend() == "gpu" else "split_kv"
    rows = []
    for length in args.contexts:
        for name in args.heads:
            heads, kv_heads = HEADS[name]
            q, k, v = inputs(1, length, heads, kv_heads)
            sharded = NamedSharding(mesh, PartitionSpec(None, "sequence"))
            k, v = jax.device_put(k, sharded), jax.device_put(v, sharded)
            pos = jnp.array([length - 1])
            row = {"devices": n, "context": length, "heads": name, "timing": args.timing, "times": {}}
            for label, fn in (("tree", tree_decode_attention), ("ring", ring_decode_attention)):
                step = jax.jit(
                    lambda q, k, v, pos, fn=fn: fn(q, k, v, pos, mesh=mesh, impl=impl, chunk_size=4096)
                )
                row["times"][label] = timed(step, q, k, v, pos)
            local = length // n
            device = jax.devices()[0]
            lq, lk, lv = (jax.device_put(x, device) for x in inputs(1, local, heads, kv_heads))
            last = last_visible_slot(jnp.array([local - 1]), 1)
            one = jax.jit(lambda q, k, v, last: attend_cache(q, k, v, last, impl=impl, chunk_size=4096).out)
            row["times"]["local shard"] = timed(one, lq, lk, lv, last)
            row["tree_over_local"] = row["times"]["tree"] / row["times"]["local shard"]
            row["ring_over_tree"] = row["times"]["ring"] / row["times"]["tree"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def sample_part(args) -> list[dict]:
    import dataclasses
    import time

    import flax.linen as nn
    import numpy as np

    from bpt.config import load_config_file, model_config
    from bpt.models.gpt import GPT
    from bpt.sample import decode, prefill, prefill_chunks

    c = load_config_file(args.sample_config)
    parallel, replicated = None, None
    if args.sample_sequence > 1:  # the cache sharded along its slots, Tree attention over it
        from bpt.parallel.mesh import Parallelism, make_mesh

        if args.sample_sequence > jax.device_count():
            raise SystemExit(f"--sample_sequence {args.sample_sequence} > {jax.device_count()} devices")
        mesh = make_mesh(data=1, fsdp=1, tensor=1, sequence=args.sample_sequence)
        parallel = Parallelism(mesh)
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    rows = []
    for context in args.sample_contexts:
        cfg = model_config(c.model, vocab_size=50257, seq_len=context)
        model = GPT(
            dataclasses.replace(cfg, dtype="bfloat16", param_dtype="bfloat16", cache_dtype=args.cache_dtype),
            parallel=parallel,
        )
        tokens = jnp.zeros((1, cfg.q_chunk_size), jnp.int32)
        init = jax.jit(
            lambda: nn.meta.unbox(model.clone(parallel=None).init(jax.random.PRNGKey(0), tokens)["params"]),
            out_shardings=replicated,
        )
        params = init()
        prompt_len = context - args.new_tokens
        count, chunk = prefill_chunks(
            prompt_len, args.prefill_chunk, cfg.q_chunk_size, cfg.kv_chunk_size, multiple=cfg.prefill_multiple
        )
        padded = jnp.asarray(
            np.random.default_rng(0).integers(0, cfg.vocab_size, (1, count * chunk)), jnp.int32
        )
        lengths = jnp.array([prompt_len], jnp.int32)
        if replicated is not None:
            padded, lengths = jax.device_put((padded, lengths), replicated)
        row = {"config": args.sample_config, "context": context, "prompt": prompt_len, "new_tokens": args.new_tokens,
               "prefill_chunk": chunk, "decode_impl": cfg.decode_impl, "cache_dtype": args.cache_dtype,
               "devices": args.sample_sequence}  # fmt: skip
        try:
            start = time.perf_counter()
            compiled = prefill.lower(model, params, padded, lengths, max_len=context, chunk=chunk).compile()
            row["prefill_compile_s"] = time.perf_counter() - start
            start = time.perf_counter()
            cache, logits = jax.block_until_ready(compiled(params, padded, lengths))
            row["prefill_s"] = time.perf_counter() - start
            options = dict(num_tokens=args.new_tokens, temperature=0.8, top_k=0, top_p=1.0)
            start = time.perf_counter()
            step = decode.lower(model, params, cache, logits, jax.random.PRNGKey(1), **options).compile()
            row["decode_compile_s"] = time.perf_counter() - start
            start = time.perf_counter()
            new, cache = jax.block_until_ready(step(params, cache, logits, jax.random.PRNGKey(1)))
            row["decode_s"] = time.perf_counter() - start
            row["tokens_per_s"] = args.new_tokens / row["decode_s"]
            row["ms_per_token"] = 1e3 * row["decode_s"] / args.new_tokens
            row["distinct_tokens"] = len(set(np.asarray(new)[0].tolist()))
            keys = max(jax.tree.leaves(cache), key=lambda x: x.size)  # a layer stack of keys or values
            row["cache_devices"] = len(keys.sharding.device_set)
            row["cache_shard_shape"] = list(keys.sharding.shard_shape(keys.shape))
            del cache
        except Exception as e:  # too long for this device: noted, the next context still runs
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        stats = jax.devices()[0].memory_stats() or {}
        row["peak_gib"] = stats.get("peak_bytes_in_use", 0) / 2**30
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


TIMING_WORDS = {"pipelined": "calls back to back", "synced": "each call waited for"}


def _timing(rows) -> str:
    return TIMING_WORDS[rows[0].get("timing", "synced")]


def _time_cells(row, names, unit=1e6):
    return [
        f"{row['times'][n] * unit:,.0f} ({row['tb_per_s'][n]:.2f})" if n in row["times"] else "–"
        for n in names
    ]


def _ceiling_columns(rows) -> dict:
    """The kernels table's columns against the memory's bandwidth (each row's hbm_tb_per_s,
    where known): header -> the cell of a row."""
    if not any(r.get("hbm_tb_per_s") for r in rows):
        return {}

    def share(r, name, factor=1.0):
        bw, tb = r.get("hbm_tb_per_s"), r["tb_per_s"].get(name)
        return f"{factor * tb / bw:.0%}" if bw and tb else "–"

    columns = {"bpt pallas of HBM": lambda r: share(r, "bpt pallas")}
    if any(PEER in r["times"] for r in rows):
        columns[f"1.1x {PEER} needs"] = lambda r: share(r, PEER, 1.1)
    return columns


def tables(kernel_rows, ragged_rows, tree_rows, sample_rows=()) -> str:
    out = []
    if kernel_rows:
        names = list(dict.fromkeys(n for r in kernel_rows for n in r["times"]))
        out += [
            f"Decode attention, one new token, head_dim 128, bf16: µs a call, {_timing(kernel_rows)} "
            "(effective TB/s of K+V)",
            "",
            "| context | batch | heads / KV heads | " + " | ".join(names) + " |",
            "|---|---|---|" + "---|" * len(names),
        ]
        ratios = _ceiling_columns(kernel_rows)
        out[-2:] = [out[-2] + "".join(f" {h} |" for h in ratios), out[-1] + "---|" * len(ratios)]
        for r in kernel_rows:
            cells = _time_cells(r, names) + [fn(r) for fn in ratios.values()]
            out.append(
                f"| {human_tokens(r['context'])} | {r['batch']} | {r['heads']} | " + " | ".join(cells) + " |"
            )
        if ratios:
            bw = next(r["hbm_tb_per_s"] for r in kernel_rows if r.get("hbm_tb_per_s"))
            peer = f"; 1.1x {PEER} needs: the share of it a call 1.1x {PEER}'s speed would read at"
            out += [
                "",
                f"Of HBM: the share of the memory's {bw:.2f} TB/s (the maker's figure) bpt's kernel reads at"
                + (peer if len(ratios) > 1 else "") + ".",
            ]
        out.append("")
    if ragged_rows:
        names = list(dict.fromkeys(n for r in ragged_rows for n in r["times"]))
        lengths = ", ".join(human_tokens(n) for n in ragged_rows[0]["lengths"])
        out += [
            f"Ragged batch (lengths {lengths}): µs a call, {_timing(ragged_rows)} "
            "(effective TB/s of the K+V each sequence holds)",
            "",
            "| heads / KV heads | " + " | ".join(names) + " | stream-K / split |",
            "|---|" + "---|" * (len(names) + 1),
        ]
        for r in ragged_rows:
            gain = r["times"]["pallas split"] / r["times"]["pallas stream_k"]
            out.append(f"| {r['heads']} | " + " | ".join(_time_cells(r, names)) + f" | {gain:.2f}x |")
        out.append("")
    if tree_rows:
        out += [
            f"Decoding over {tree_rows[0]['devices']} devices, batch 1, cache sharded along its slots: µs a "
            f"call, {_timing(tree_rows)}",
            "",
            "| context | heads / KV heads | local shard | tree | ring | tree / local | ring / tree |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in tree_rows:
            t = r["times"]
            out.append(
                f"| {human_tokens(r['context'])} | {r['heads']} | {t['local shard'] * 1e6:,.0f} | "
                f"{t['tree'] * 1e6:,.0f} | {t['ring'] * 1e6:,.0f} | {r['tree_over_local']:.2f} | "
                f"{r['ring_over_tree']:.2f} |"
            )
        out.append("")
    if sample_rows:
        out += [
            f"Sampling through bpt.sample ({sample_rows[0]['config']}, random bf16 weights, batch 1, "
            f"cache_dtype {sample_rows[0]['cache_dtype']}"
            + (
                f", the cache over {sample_rows[0]['devices']} devices"
                if sample_rows[0].get("devices", 1) > 1
                else ""
            )
            + ")",
            "",
            "| context | prompt | prefill s | decode tokens/s | ms / token | peak GiB | compile s |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in sample_rows:
            if "error" in r:
                out.append(f"| {human_tokens(r['context'])} | {r['prompt']:,} | {r['error'][:80]} | | | | |")
                continue
            out.append(
                f"| {human_tokens(r['context'])} | {r['prompt']:,} | {r['prefill_s']:.1f} | "
                f"{r['tokens_per_s']:.1f} | {r['ms_per_token']:.1f} | {r['peak_gib']:.1f} | "
                f"{r['prefill_compile_s'] + r['decode_compile_s']:.0f} |"
            )
    return "\n".join(out).rstrip() + "\n"


def plot(kernel_rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["batch"], r["heads"]) for r in kernel_rows))
    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(4.5 * max(1, len(groups)), 3.8), squeeze=False)
    for ax, (batch, heads) in zip(axes[0], groups):
        rows = [r for r in kernel_rows if (r["batch"], r["heads"]) == (batch, heads)]
        for name in dict.fromkeys(n for r in rows for n in r["tb_per_s"]):
            points = [(r["context"], r["tb_per_s"][name]) for r in rows if name in r["tb_per_s"]]
            ax.plot(*zip(*points), marker="o", label=name)
        bw = next((r["hbm_tb_per_s"] for r in rows if r.get("hbm_tb_per_s")), None)
        if bw:  # the memory's bandwidth by the maker's figure: the ceiling
            ax.axhline(bw, color="gray", linestyle="--", linewidth=1, label=f"HBM {bw:.2f} TB/s")
        ax.set(xscale="log", xlabel="context", ylabel="effective TB/s", title=f"batch {batch}, heads {heads}")
        contexts = sorted({r["context"] for r in rows})  # one tick a context, named as in the table
        ax.set_xticks(contexts, [human_tokens(c) for c in contexts])
        ax.minorticks_off()
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


VARIANT_KEYS = ("block_k", "num_warps", "num_stages", "num_splits", "table_in_kernel")


def parse_variants(parser, text: str) -> list[tuple[str, dict]]:
    """--variants 'num_warps=8;num_stages=3,block_k=32' -> [(label, {option: int})], the label
    its text; a clear error for a key the kernel does not take here or a value not an int."""
    variants = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        options = {}
        for item in part.split(","):
            key, _, value = item.partition("=")
            key = key.strip()
            if key not in VARIANT_KEYS:
                allowed = ", ".join(VARIANT_KEYS)
                parser.error(f"--variants: unknown option {key!r} in {part!r}; allowed: {allowed}")
            try:
                options[key] = int(value)
            except ValueError:
                parser.error(f"--variants: {key} needs an integer; got {value!r} in {part!r}")
        variants.append((part.replace(" ", ""), options))
    return variants


def main() -> None:
    parser = script_parser(__doc__, out_help="a folder: results.json, table.md and decode.png")
    parser.add_argument("--parts", default="kernels,ragged", help=f"comma-separated: {', '.join(PARTS)}")
    parser.add_argument("--contexts", default="8192,32768,131072,524288,1048576")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--heads", default="16/16,32/8", help=f"heads/KV heads: {', '.join(HEADS)}")
    parser.add_argument("--ragged_batch", type=int, default=8, help="ragged part: sequences (up to 8)")
    parser.add_argument(
        "--num_splits",
        default="0",
        help="bpt pallas: programs per KV head (0: auto), comma-separated for a sweep (one column each)",
    )
    parser.add_argument(
        "--block_k", type=int, default=0, help="bpt pallas: key block (0: the kernel's default)"
    )
    parser.add_argument(
        "--lean_waves", default="0", help="bpt pallas lean: programs a SM, comma-separated for a sweep (0: default)"
    )
    parser.add_argument("--num_warps", type=int, default=0, help="bpt pallas: warps a program (0: default)")
    parser.add_argument("--num_stages", type=int, default=0, help="bpt pallas: pipeline stages (0: default)")
    parser.add_argument("--sample_config", default="configs/gpt_1b.py", help="sample: the model's config")
    parser.add_argument("--sample_contexts", default="131072,524288", help="sample: cache lengths")
    parser.add_argument("--new_tokens", type=int, default=64, help="sample: tokens decoded")
    parser.add_argument("--prefill_chunk", type=int, default=4096, help="sample: prompt chunk")
    parser.add_argument("--cache_dtype", default="auto", help="sample: model.cache_dtype (auto | int8)")
    parser.add_argument(
        "--sample_sequence",
        type=int,
        default=1,
        help="sample: shard the cache over this many devices (Tree attention)",
    )
    parser.add_argument("--repeats", type=int, default=20, help="calls timed a run (see --timing)")
    parser.add_argument(
        "--timing",
        default="pipelined",
        choices=TIMINGS,
        help="pipelined: --repeats calls back to back, waited for once (a call's device time; the "
        "median of 5 runs); synced: the median of --repeats calls, each waited for",
    )
    parser.add_argument(
        "--variants",
        default="",
        help="bpt pallas with other kernel options, one column each, timed in the same rounds: "
        "semicolon-separated sets of comma-separated key=value (keys: block_k, num_warps, "
        "num_stages, num_splits, table_in_kernel 0 or 1), e.g. 'num_warps=8;num_stages=3,block_k=32'",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="kernels: interleaved rounds of every impl; the best median counts",
    )
    parser.add_argument(
        "--hbm_tb_per_s",
        type=float,
        default=0.0,
        help="kernels: the memory's bandwidth for the table's ceiling columns (0: the maker's figure "
        "for the GPU where known, else none)",
    )
    args = parser.parse_args()
    bw = hbm_bytes_per_s(jax.devices()[0], args.hbm_tb_per_s)
    args.hbm_tb_per_s = bw and bw / 1e12
    parts = parse_choices(parser, args.parts, PARTS, "part")
    args.heads = parse_choices(parser, args.heads, HEADS, "heads")
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    args.sample_contexts = [int(x) for x in args.sample_contexts.split(",")]
    args.lean_waves = [int(x) for x in args.lean_waves.split(",")]
    args.num_splits = [int(x) for x in args.num_splits.split(",")]
    options = ("block_k", "num_warps", "num_stages")
    args.kernel_options = {k: getattr(args, k) for k in options if getattr(args, k)}
    args.variants = parse_variants(parser, args.variants)
    if not 1 <= args.ragged_batch <= len(RAGGED_LENGTHS):
        parser.error(f"--ragged_batch must be 1 to {len(RAGGED_LENGTHS)}; got {args.ragged_batch}")
    meta = run_meta(parts=parts)
    print(json.dumps(meta), flush=True)
    kernel_rows = kernels_part(args) if "kernels" in parts else []
    ragged_rows = ragged_part(args) if "ragged" in parts else []
    tree_rows = tree_part(args) if "tree" in parts else []
    sample_rows = sample_part(args) if "sample" in parts else []
    text = tables(kernel_rows, ragged_rows, tree_rows, sample_rows)
    if args.out:
        results = {"meta": meta, "kernels": kernel_rows, "ragged": ragged_rows, "tree": tree_rows,
                   "sample": sample_rows}  # fmt: skip
        write_results(args.out, results, table=text)
        if kernel_rows:
            plot(kernel_rows, Path(args.out) / "decode.png")
    print(text)


if __name__ == "__main__":
    main()
