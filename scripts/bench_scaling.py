"""Scale-out on the GPUs of one host: ring attention against local attention, and training
throughput per GPU for data, FSDP and sequence parallelism against one GPU.

    python scripts/bench_scaling.py --out results/scaling                 # both parts
    python scripts/bench_scaling.py --parts ring --tokens 32768,65536
    python scripts/bench_scaling.py --parts train --config configs/gpt_1b.py --tokens 16384,65536

ring: forward+backward of context-parallel attention (bf16, causal, batch 1, 16 heads of
128; the inputs already in the zigzag layout) with T tokens per device over all N devices,
ring and all-gather, against what a device computes without any communication: one
non-causal attention of T queries over N*T/2 keys, which is the same number of score pairs
as a device's share of the causal ring (its own causal block plus N-1 half blocks). The
ratio ring / local is the cost of the communication the ring does not hide plus what
splitting the work costs the kernels; "ring's kernels" times the ring's own kernel calls
(one causal T x T block, N-1 calls of T queries over T/2 keys) without communication, so
ring / ring's kernels is the overlap alone. "ring's transfers" times the ring's sends alone, no
kernels (the K/V shards passed on N-1 times forward and backward, the float32 dK/dV sums N
times, one after another): a ring that hid them all would take its kernels' time, one that
hid none about kernels + transfers.

train: one real training step (median of --steps after a warm-up) of --config at T tokens
per device: one GPU (context T), data parallel and FSDP over all N GPUs (context T, batch
N), sequence parallel over N GPUs (context N*T, batch 1; ring and all-gather). Each runs in
a fresh process. Reported: tokens/s per GPU, MFU (counting attention at the run's context)
and the ratio to one GPU.

Prints markdown tables last; --out writes results.json, table.md and scaling.png.
--from_json a.json,b.json prints (and with --out plots) earlier runs' rows together, such
as one GPU's baseline measured apart from the multi-GPU setups.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

from benchlib import human_tokens, parse_choices, script_parser, seconds_per_call, write_results  # noqa: E402  (after the environment)

PARTS = ("ring", "train")
TRAIN_SETUPS = {  # name -> (mesh settings, context as a multiple of T, batch as a multiple of N)
    "1 GPU": ({"data": 1}, 1, 0),
    "data": ({"data": -1}, 1, 1),
    "fsdp": ({"data": 1, "fsdp": -1}, 1, 1),
    "sequence (ring)": ({"data": 1, "sequence": -1, "context_parallel": "ring"}, -1, 0),
    "sequence (all-gather)": ({"data": 1, "sequence": -1, "context_parallel": "all_gather"}, -1, 0),
}


def ring_transfers(mesh, n: int):
    """fn(k, v) -> what the ring sends in one forward and backward, and nothing else: K/V
    passed on N-1 times in each, the float32 dK/dV sums N times (bpt.parallel.ring)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec

    def send(x):
        return lax.ppermute(x, "sequence", perm=[(i, (i + 1) % n) for i in range(n)])

    def body(k, v):
        kv = (k, v)
        for _ in range(2 * (n - 1)):
            kv = send(kv)
        sums = (k.astype(jnp.float32), v.astype(jnp.float32))
        for _ in range(n):
            sums = send(sums)
        return kv[0] + sums[0].astype(k.dtype), kv[1] + sums[1].astype(v.dtype)

    rows = PartitionSpec(None, "sequence")
    return jax.shard_map(body, mesh=mesh, in_specs=(rows, rows), out_specs=(rows, rows), check_vma=False)


def ring_part(args) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from bpt.ops.kernels.attention import flash_attention
    from bpt.parallel import context_parallel_attention, make_mesh

    n = jax.device_count()
    mesh = make_mesh(sequence=n)
    heads, head_dim = args.heads, 128
    rows = []
    for tokens in args.tokens:
        seq = n * tokens
        key = jax.random.split(jax.random.PRNGKey(0), 4)
        shape = (1, seq, heads, head_dim)
        sharded = NamedSharding(mesh, PartitionSpec(None, "sequence"))
        q, k, v, cot = (jax.device_put(jax.random.normal(kk, shape, jnp.bfloat16), sharded) for kk in key)
        row = {"devices": n, "tokens_per_device": tokens, "context": seq, "heads": heads}
        for strategy in ("ring", "all_gather"):

            def loss(q, k, v, cot, strategy=strategy):
                out = context_parallel_attention(q, k, v, mesh=mesh, strategy=strategy, layout="zigzag")
                return jnp.sum(out.astype(jnp.float32) * cot)

            step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            row[strategy] = seconds_per_call(step, q, k, v, cot)
        # The same score pairs on one device, no communication: T queries over N*T/2 keys.
        device = jax.devices()[0]
        local_q = jax.device_put(
            jax.random.normal(key[0], (1, tokens, heads, head_dim), jnp.bfloat16), device
        )
        local_kv = jax.device_put(
            jax.random.normal(key[1], (1, max(n * tokens // 2, tokens), heads, head_dim), jnp.bfloat16),
            device,
        )

        def local_loss(q, k, v):
            return jnp.sum(flash_attention(q, k, v, causal=n == 1).astype(jnp.float32))

        row["local"] = seconds_per_call(
            jax.jit(jax.grad(local_loss, argnums=(0, 1, 2))), local_q, local_kv, local_kv
        )

        # The ring's own kernel calls on one device, no communication: its causal block, then
        # N-1 visiting halves (T queries over T/2 keys). ring / kernels is the overlap
        # quality alone; kernels / local is what splitting the work into causal and half
        # blocks costs the kernels.
        def kernels_loss(q, k, v):
            total = jnp.sum(flash_attention(q, k, v, causal=True).astype(jnp.float32))
            for _ in range(n - 1):
                half = k[:, : tokens // 2]
                total += jnp.sum(flash_attention(q, half, v[:, : tokens // 2]).astype(jnp.float32))
            return total

        own_kv = local_kv[:, :tokens]
        row["kernels"] = seconds_per_call(
            jax.jit(jax.grad(kernels_loss, argnums=(0, 1, 2))), local_q, own_kv, own_kv
        )
        row["transfers"] = seconds_per_call(jax.jit(ring_transfers(mesh, n)), k, v)
        # A zigzag hop's two shapes on one device (fwd+bwd): T queries over the first half of a
        # shard from before, the last T/2 queries over a whole shard from after (as one call,
        # and as two over its halves). The devices wait for the slower shape.
        def hop_loss(q, k, v, pieces):
            return sum(jnp.sum(flash_attention(q[:, a], k[:, b], v[:, b]).astype(jnp.float32)) for a, b in pieces)

        whole, first, second = slice(None), slice(None, tokens // 2), slice(tokens // 2, None)
        for name, pieces in {
            "hop_q_over_half": [(whole, first)],
            "hop_half_over_k": [(second, whole)],
            "hop_half_over_halves": [(second, first), (second, second)],
        }.items():
            grad = jax.jit(jax.grad(functools.partial(hop_loss, pieces=pieces), argnums=(0, 1, 2)))
            row[name] = seconds_per_call(grad, local_q, own_kv, own_kv)
        row["ring_over_local"] = row["ring"] / row["local"]
        row["ring_over_kernels"] = row["ring"] / row["kernels"]
        row["all_gather_over_local"] = row["all_gather"] / row["local"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def train_one(args) -> None:
    """One setup in this process; reports its measurement."""
    from benchlib import benchmark_config, measure, report

    mesh, context, batch = TRAIN_SETUPS[args.train_one]
    import jax

    n = jax.device_count()
    seq_len = args.one_tokens * (n if context == -1 else context)
    batch_size = n * batch if batch else 1
    overrides = [f"mesh.{k}={v}" for k, v in mesh.items()] + list(args.set)
    config = benchmark_config(args.config, seq_len=seq_len, batch_size=batch_size, overrides=overrides)
    devices = jax.devices()[:1] if args.train_one == "1 GPU" else None
    result = measure(config, steps=args.steps, warmup=1, devices=devices)
    report(
        dict(
            setup=args.train_one,
            tokens_per_device=args.one_tokens,
            seq_len=seq_len,
            batch=batch_size,
            **result,
        )
    )


def train_part(args) -> list[dict]:
    from benchlib import run_in_subprocess

    rows = []
    for tokens in args.tokens:
        for setup in args.setups:
            cmd = [sys.executable, __file__, "--train_one", setup, f"--one_tokens={tokens}"]
            cmd += [f"--config={args.config}", f"--steps={args.steps}", *(f"--set={s}" for s in args.set)]
            result = run_in_subprocess(cmd)
            result.setdefault("setup", setup)
            result.setdefault("tokens_per_device", tokens)
            if result.get("ok"):
                result["tokens_per_second_per_gpu"] = result["tokens_per_second"] / result["devices"]
            print(json.dumps(result), flush=True)
            rows.append(result)
    return rows


def tables(ring_rows: list[dict], train_rows: list[dict]) -> str:
    out = []
    if ring_rows:
        out += [
            f"Ring attention, {ring_rows[0]['devices']} GPUs (fwd+bwd ms; local: the same score pairs on one GPU)",
            "",
            "| tokens / GPU | context | local | ring's kernels | ring's transfers | ring | all-gather "
            "| ring / local | all-gather / local | ring / ring's kernels |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in ring_rows:
            transfers = f"{r['transfers'] * 1e3:.1f}" if "transfers" in r else "–"  # (rows of older runs)
            out.append(
                f"| {human_tokens(r['tokens_per_device'])} | {human_tokens(r['context'])} | {r['local'] * 1e3:.1f} | "
                f"{r['kernels'] * 1e3:.1f} | {transfers} | {r['ring'] * 1e3:.1f} | {r['all_gather'] * 1e3:.1f} | "
                f"{r['ring_over_local']:.3f} | {r['all_gather_over_local']:.3f} | {r['ring_over_kernels']:.3f} |"
            )
        out.append("")
        shaped = [r for r in ring_rows if "hop_half_over_k" in r]
        if shaped:
            out += [
                "A zigzag hop's shapes on one GPU (fwd+bwd ms, T tokens per GPU; TFLOP/s of the score pairs)",
                "",
                "| T | [T q, T/2 k] | [T/2 q, T k] | [T/2 q, T k] as two [T/2, T/2] |",
                "|---|---|---|---|",
            ]
            for r in shaped:
                pairs = r["tokens_per_device"] ** 2 / 2 * r.get("heads", 16)
                flops = 14 * 128 * pairs  # 2 flops a multiply-add, head_dim 128: forward 2 matmuls, backward 5
                cells = [f"{r[n] * 1e3:.1f} ({flops / r[n] / 1e12:.0f})" for n in
                         ("hop_q_over_half", "hop_half_over_k", "hop_half_over_halves")]  # fmt: skip
                out.append(f"| {human_tokens(r['tokens_per_device'])} | " + " | ".join(cells) + " |")
            out.append("")
    if train_rows:
        out += [
            "Training throughput (tokens/s per GPU, MFU; ratio to one GPU at the same tokens per GPU, "
            "and at the same context where one GPU ran it)",
            "",
            "| tokens / GPU | setup | context | GPUs | tokens/s/GPU | MFU | vs 1 GPU | vs 1 GPU, same context "
            "| peak GiB |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        ones = [r for r in train_rows if r["setup"] == "1 GPU" and r.get("ok")]
        by_tokens = {r["tokens_per_device"]: r for r in ones}
        by_context = {r["seq_len"]: r for r in ones}

        def ratio(r, one):
            if one is None or one is r:
                return "–"
            return f"{r['tokens_per_second_per_gpu'] / one['tokens_per_second_per_gpu']:.3f}"

        for r in train_rows:
            if not r.get("ok"):
                out.append(
                    f"| {human_tokens(r['tokens_per_device'])} | {r['setup']} | | | failed: {r.get('error', '')[:80]} "
                    "| | | | |"
                )
                continue
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "–"
            peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "–"
            same_tokens = by_tokens.get(r["tokens_per_device"])
            out.append(
                f"| {human_tokens(r['tokens_per_device'])} | {r['setup']} | {human_tokens(r['seq_len'])} | "
                f"{r['devices']} | {r['tokens_per_second_per_gpu']:,.0f} | {mfu} | "
                f"{'1.000' if same_tokens is r else ratio(r, same_tokens)} | {ratio(r, by_context.get(r['seq_len']))} "
                f"| {peak} |"
            )
    return "\n".join(out)


def plot(ring_rows: list[dict], train_rows: list[dict], path: Path) -> None:
    """A panel for each part that has rows: the ring's time against one device's, and the
    training step's tokens/s per GPU by setup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in train_rows if r.get("ok")]
    panels = [draw for draw, rows in ((_ring_panel, ring_rows), (_train_panel, ok)) if rows]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for draw, ax in zip(panels, axes[0]):
        draw(ax, ring_rows if draw is _ring_panel else ok)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ring_panel(ax, rows: list[dict]) -> None:
    x = [r["tokens_per_device"] for r in rows]
    for name in ("ring", "all_gather"):
        ax.plot(x, [r[f"{name}_over_local"] for r in rows], marker="o", label=name)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(
        xscale="log", xlabel="tokens per GPU", ylabel="time / local time", title="context-parallel attention"
    )
    ax.legend()


def _train_panel(ax, ok: list[dict]) -> None:
    setups = list(dict.fromkeys(r["setup"] for r in ok))
    if len({r["tokens_per_device"] for r in ok}) == 1:  # one length: a bar per setup
        ax.bar(setups, [r["tokens_per_second_per_gpu"] for r in ok])
        ax.tick_params(axis="x", labelrotation=20)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
        title = f"training step, {human_tokens(ok[0]['tokens_per_device'])} tokens per GPU"
        ax.set(ylabel="tokens/s per GPU", title=title)
        return
    for setup in setups:
        rows = [r for r in ok if r["setup"] == setup]
        ax.plot([r["tokens_per_device"] for r in rows], [r["tokens_per_second_per_gpu"] for r in rows], marker="o",
                label=setup)  # fmt: skip
    ax.set(xscale="log", xlabel="tokens per GPU", ylabel="tokens/s per GPU", title="training step")
    ax.legend()


def main() -> None:
    parser = script_parser(__doc__, out_help="a folder: results.json, table.md and scaling.png", settings=True)
    parser.add_argument("--parts", default="ring,train", help=f"comma-separated: {', '.join(PARTS)}")
    parser.add_argument("--tokens", default="16384,65536", help="tokens per GPU, comma-separated")
    parser.add_argument("--heads", type=int, default=16, help="ring part: attention heads (head_dim 128)")
    parser.add_argument("--config", default="configs/gpt_1b.py", help="train part: the model's config file")
    parser.add_argument("--setups", default=",".join(TRAIN_SETUPS), help="train part: comma-separated setups")
    parser.add_argument("--steps", type=int, default=2, help="train part: timed steps after one warm-up")
    parser.add_argument(
        "--from_json",
        default="",
        help="comma-separated results.json files of earlier runs: their rows in one table (nothing runs)",
    )
    parser.add_argument("--train_one", help=argparse.SUPPRESS)
    parser.add_argument("--one_tokens", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train_one:
        train_one(args)
        return
    parts = parse_choices(parser, args.parts, PARTS, "part")
    args.setups = parse_choices(parser, args.setups, TRAIN_SETUPS, "setup")
    args.tokens = [int(t) for t in args.tokens.split(",")]

    from benchlib import run_meta

    if args.from_json:
        runs = [json.loads(Path(path).read_text()) for path in args.from_json.split(",")]
        meta = {"from": args.from_json.split(","), "runs": [run["meta"] for run in runs]}
        ring_rows = [row for run in runs for row in run["ring"]]
        train_rows = [row for run in runs for row in run["train"]]
    else:
        meta = run_meta(parts=parts, settings=args.set)
        print(json.dumps(meta), flush=True)
        ring_rows = ring_part(args) if "ring" in parts else []
        train_rows = train_part(args) if "train" in parts else []
    text = tables(ring_rows, train_rows)
    if args.out:
        write_results(args.out, {"meta": meta, "ring": ring_rows, "train": train_rows}, table=text)
        plot(ring_rows, train_rows, Path(args.out) / "scaling.png")
    print(text)


if __name__ == "__main__":
    main()
