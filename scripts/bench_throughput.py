"""Training throughput of Vanilla, MemoryEfficient and BPT per context length (the paper's
Table 4), and the loss each mode reaches after the same steps on the same data.

Throughput: for each mode and length, in a fresh process (its peak memory and any
out-of-memory error are its own), the full training step (forward, backward, AdamW) of
--tokens_per_step tokens is compiled, warmed up and timed (median of --steps). A step is
batch = tokens_per_step / length sequences, in micro-batches of at most --micro_batch_tokens
tokens (gradient accumulation), so every length does the same work per token and each
mode's memory is its own at one micro-batch. MFU counts model FLOPs only (bpt.train.metrics),
never what rematerialization recomputes. --chunks runs the modes of --grid_modes at each chunk
size (a size longer than the context is the context) and the tables keep each mode's
fastest, as the paper's appendix grid does. The layer remat is the config's: for the paper's
sizes model.remat_layer=auto, which each run resolves on its device (the tables then name the
policy it took); --set model.remat_layer=nothing_saveable measures one policy throughout.

Loss agreement (--loss_steps N > 0): each mode trains N steps from the same initial
parameters on the same batches (--loss_data, a bpt-prepare-data folder; else the config's
data) and is evaluated on the same held-out batches; the three must agree, as the paper's
"Val Loss" column does.

    python scripts/bench_throughput.py --config configs/gpt_1b.py \\
        --seq_lens 2048,4096,8192,16384,32768,65536 --chunks 1024,4096,16384 \\
        --loss_steps 100 --loss_data data/owt --out results/throughput.json --png throughput.png

--from_json a.json,b.json prints (and --png draws) the tables of earlier runs together.

Prints markdown tables last (tokens/s per GPU, MFU, BPT's ratio to each other mode).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # see bench_max_context.py
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

from benchlib import LABELS, TABLE_MODES, human_tokens, parse_choices, script_parser  # noqa: E402  (after the environment)


def step_config(args, mode: str, seq_len: int, chunk: int):
    from benchlib import benchmark_config

    batch = max(1, args.tokens_per_step // seq_len)
    micro = max(1, min(batch, args.micro_batch_tokens // seq_len))
    while batch % micro:
        micro -= 1
    return benchmark_config(
        args.config,
        seq_len=seq_len,
        batch_size=batch,
        grad_accum_steps=batch // micro,
        mode=mode,
        impl=args.impl,
        chunk=min(chunk, seq_len),
        dtype=args.dtype,
        overrides=args.set,
    )


def throughput_one(args) -> dict:
    """Times one (mode, length) in this process."""
    from benchlib import measure

    c = step_config(args, args.mode, args.seq_len, args.chunk)
    measured = measure(c, steps=args.steps, warmup=2)
    measured.pop("losses", None)
    return dict(
        mode=args.mode,
        seq_len=args.seq_len,
        chunk=args.chunk,
        batch=c.train.batch_size,
        micro_batches=c.train.grad_accum_steps,
        **measured,
    )


def loss_one(args) -> dict:
    """Trains one mode --loss_steps steps; the loss of its last steps and the held-out loss."""
    import jax
    import numpy as np

    from bpt.train.loop import evaluate, setup
    from bpt.train.step import eval_step, make_train_step

    c = step_config(args, args.mode, args.loss_seq_len, args.chunk)
    c.train.batch_size, c.train.grad_accum_steps = args.loss_batch, 1
    c.train.steps = args.loss_steps
    c.train.warmup_steps = max(1, args.loss_steps // 10)
    c.train.learning_rate = args.loss_lr
    c.data.prefetch = 0
    if args.loss_data:
        c.data.name, c.data.path = "prepared", args.loss_data
    dataset, _, state = setup(c)  # the same initial parameters in every mode: same seed and tree
    step_fn = jax.jit(make_train_step(1), donate_argnums=0)
    rng = jax.random.fold_in(jax.random.PRNGKey(c.seed), 1)
    losses = []
    for step in range(args.loss_steps):
        state, metrics = step_fn(
            state, dataset.train_batch(step, c.train.batch_size), jax.random.fold_in(rng, step)
        )
        losses.append(metrics["loss"])
    losses = [float(x) for x in jax.device_get(losses)]
    held_out = evaluate(
        state, dataset.eval_batches(args.loss_eval_batches, c.train.batch_size), jax.jit(eval_step)
    )
    last = max(1, args.loss_steps // 10)
    return dict(
        mode=args.mode,
        ok=True,
        train_loss=float(np.mean(losses[-last:])),
        eval_loss=held_out["eval_loss"],
        losses=losses,
    )


def run_one(args) -> None:
    from benchlib import error_summary, report

    try:
        result = loss_one(args) if args.loss_run else throughput_one(args)
    except Exception as e:  # reported, not raised: the sweep goes on
        result = dict(mode=args.mode, ok=False, error=error_summary(e))
    report(result)


def subprocess_args(args, **extra) -> list[str]:
    keep = ("config", "impl", "dtype", "tokens_per_step", "micro_batch_tokens", "steps")
    keep += ("loss_steps", "loss_seq_len", "loss_batch", "loss_lr", "loss_data", "loss_eval_batches")
    argv = [sys.executable, __file__, *(f"--{k}={getattr(args, k)}" for k in keep)]
    argv += [f"--set={s}" for s in args.set]
    return argv + [f"--{k}" if v is None else f"--{k}={v}" for k, v in extra.items()]


def best_runs(results: list[dict]) -> dict:
    """(mode, length) -> the fastest run over the chunk sizes, else the last failed one."""
    best = {}
    for r in results:
        key, old = (r["mode"], r["seq_len"]), best.get((r["mode"], r["seq_len"]))
        if old is None or (r["ok"] and (not old["ok"] or r["tokens_per_second"] > old["tokens_per_second"])):
            best[key] = r
    return best


def tables(results: list[dict], losses: list[dict], modes: list[str], seq_lens: list[int]) -> str:
    by = best_runs(results)
    chunks_run = {}  # (mode, length) -> the chunk sizes run
    for r in results:
        chunks_run.setdefault((r["mode"], r["seq_len"]), set()).add(r.get("chunk"))
    grid_modes = {mode for (mode, _), chunks in chunks_run.items() if len(chunks) > 1}
    grid = bool(grid_modes)
    # model.remat_layer=auto may choose per length: then each cell names its policy (and,
    # where model.auto_unroll unrolled some lengths' stacks, model.auto_offload offloaded
    # their saved layer inputs or model.auto_split split the stack, which).
    def remat(r: dict) -> str:
        how = (", unrolled" if r.get("unrolled") else "") + (", offloaded" if r.get("offloaded") else "")
        how += f", {r['split']}" if r.get("split") else ""
        return f"{r.get('remat_layer')}{how}"

    remats = {remat(r) for r in results if r["ok"]}

    def cell(mode, n, fmt):
        r = by.get((mode, n))
        if r is None:
            return "–"
        if not r["ok"]:
            return "OOM" if r.get("out_of_memory") else "failed"
        text = fmt(r) + (f", chunks {r['chunk']}" if grid and mode in grid_modes else "")
        return text + (f", {remat(r)}" if len(remats) > 1 else "")

    # BPT's ratio to each other mode run, as bench_max_context prints them
    others = [m for m in modes if m != "blockwise_parallel"] if "blockwise_parallel" in modes else []
    header = "| context | " + " | ".join(LABELS[m] for m in modes) + "".join(f" | BPT / {LABELS[m]}" for m in others)
    lines = [header + " |", "|---|" + "---|" * (len(modes) + len(others))]
    for n in seq_lens:
        cells = [
            cell(
                m,
                n,
                lambda r: f"{r['tokens_per_second']:.0f}" + (f" ({100 * r['mfu']:.0f}%)" if r["mfu"] else ""),
            )
            for m in modes
        ]
        row = f"| {human_tokens(n)} | " + " | ".join(cells)
        bpt = by.get(("blockwise_parallel", n))
        for mode in others:
            other = by.get((mode, n))
            both = bpt and other and bpt["ok"] and other["ok"]
            row += f" | {bpt['tokens_per_second'] / other['tokens_per_second']:.2f}x" if both else " | –"
        lines.append(row + " |")
    text = "tokens/s per GPU (MFU" + (", the fastest chunk size" if grid else "") + ")\n\n" + "\n".join(lines)
    clocked = sorted(
        (r for r in by.values() if r["ok"] and r.get("sm_clock_mhz")), key=lambda r: (modes.index(r["mode"]), r["seq_len"])
    )
    if clocked:  # a GEMM runs about 12% slower than at the boost clock once the power limit holds it
        text += "\n\nSM clock over the timed steps (median; the share of samples the power limit held it): " + ", ".join(
            f"{LABELS[r['mode']]} {human_tokens(r['seq_len'])} {r['sm_clock_mhz']:.0f} MHz ({r['power_capped']:.0%})"
            for r in clocked
        )
    if losses:
        text += "\n\n| mode | train loss (last tenth of the steps) | held-out loss |\n|---|---|---|\n"
        text += "\n".join(
            f"| {LABELS[r['mode']]} | {r['train_loss']:.4f} | {r['eval_loss']:.4f} |"
            if r["ok"]
            else f"| {LABELS[r['mode']]} | failed: {r.get('error', '')} | |"
            for r in losses
        )
    return text


def plot(results: list[dict], modes: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    best = best_runs(results).values()
    for mode in modes:
        points = sorted((r["seq_len"], r["tokens_per_second"]) for r in best if r["mode"] == mode and r["ok"])
        if points:
            ax.plot(*zip(*points), marker="o", label=LABELS[mode])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("training tokens/s per GPU")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summarize(args, modes: list[str]) -> None:
    """--from_json: the tables and plot of earlier runs, merged (later files win a tie)."""
    results, losses = [], []
    for path in args.from_json.split(","):
        saved = json.loads(Path(path).read_text())
        print(json.dumps(saved["meta"]))
        results += saved["throughput"]
        losses += saved["loss"]
    seq_lens = sorted({r["seq_len"] for r in results})
    if args.png:
        plot(results, modes, args.png)
    print(tables(results, losses, modes, seq_lens))


def main() -> None:
    parser = script_parser(__doc__, png=True, settings=True)
    parser.add_argument("--config", default="configs/gpt_1b.py")
    parser.add_argument("--modes", default=",".join(TABLE_MODES))
    parser.add_argument("--seq_lens", default="2048,4096,8192,16384,32768,65536", help='"": loss check only')
    parser.add_argument("--impl", default="auto", help="attention_impl of the two non-vanilla modes")
    parser.add_argument(
        "--chunks",
        default="1024",
        help="query, key/value and loss chunk sizes: each of --grid_modes runs at each, the "
        "tables keep the fastest (the paper's appendix grid); the other modes run at the first",
    )
    parser.add_argument("--grid_modes", default="memory_efficient,blockwise_parallel")
    parser.add_argument("--dtype", default="", help="compute dtype (default: the config's)")
    parser.add_argument("--tokens_per_step", type=int, default=65536)
    parser.add_argument("--micro_batch_tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after two warm-up steps)")
    parser.add_argument(
        "--loss_steps", type=int, default=0, help="training steps per mode for the loss check"
    )
    parser.add_argument("--loss_seq_len", type=int, default=2048)
    parser.add_argument("--loss_batch", type=int, default=8)
    parser.add_argument("--loss_lr", type=float, default=3e-4)
    parser.add_argument("--loss_eval_batches", type=int, default=8)
    parser.add_argument(
        "--loss_data", default="", help="a bpt-prepare-data folder (default: the config's data)"
    )
    parser.add_argument(
        "--from_json",
        default="",
        help="comma-separated --out files of earlier runs: print their tables together (and "
        "--png) without measuring",
    )
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--seq_len", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--loss_run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    modes = parse_choices(parser, args.modes, TABLE_MODES, "mode")
    seq_lens = [int(n) for n in args.seq_lens.split(",") if n]  # none: only the loss check
    chunks = [int(c) for c in args.chunks.split(",")]
    if args.mode:
        run_one(args)
        return
    if args.from_json:
        summarize(args, modes)
        return

    from benchlib import run_in_subprocess, run_meta

    meta = run_meta()
    print(json.dumps(meta), flush=True)
    results, losses = [], []
    out_of_memory = set()  # what ran out at a shorter length (a mode, or a mode and chunk size)
    for n in sorted(seq_lens):
        for mode in modes:
            grid = mode in args.grid_modes.split(",") and mode != "vanilla"
            # A chunk longer than the context is the context: each effective size runs once.
            for chunk in sorted({min(c, n) for c in (chunks if grid else chunks[:1])}):
                key = (mode, chunk) if grid else mode
                if key in out_of_memory:
                    result = dict(ok=False, out_of_memory=True, skipped=True)
                else:
                    result = run_in_subprocess(subprocess_args(args, mode=mode, seq_len=n, chunk=chunk))
                    if result.get("out_of_memory"):
                        out_of_memory.add(key)
                results.append(dict(result, mode=mode, seq_len=n, chunk=chunk))
                print(json.dumps(results[-1]), flush=True)
    if args.loss_steps:
        for mode in modes:
            result = run_in_subprocess(
                subprocess_args(args, mode=mode, seq_len=args.loss_seq_len, chunk=chunks[0], loss_run=None)
            )
            losses.append(dict(result, mode=mode))
            print(json.dumps({k: v for k, v in losses[-1].items() if k != "losses"}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "throughput": results, "loss": losses}, indent=1))
    if args.png:
        plot(results, modes, args.png)
    print(f"\n{meta['device']}, jax {meta['jax']}, {args.tokens_per_step} tokens per step")
    print(tables(results, losses, modes, seq_lens))


if __name__ == "__main__":
    main()
