"""Peak memory of one training step per attention mode and context length (the paper's
Table 3: GPT-3B on one GPU, batch 1).

For each mode and length the full step (forward, backward, AdamW) is compiled from shapes
and XLA's memory analysis gives what it needs (state, batch, activations, gradients). With
--real, the step then runs once in a fresh process and the device's peak memory counter
gives what it used; an out-of-memory error is the verdict "does not fit". The first length
of a mode that does not fit by compiled memory ends that mode's row.

    python scripts/bench_memory.py --config configs/gpt_3b.py \\
        --seq_lens 8192,16384,32768,65536,131072 --real --png memory.png

Prints a markdown table (GiB) last; --out writes every measurement as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # see bench_max_context.py
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

from benchlib import LABELS, REMATS, TABLE_MODES, human_tokens, parse_choices, script_parser, write_results  # noqa: E402  (after the environment)


def config_for(args, mode: str, seq_len: int):
    from benchlib import benchmark_config

    return benchmark_config(
        args.config,
        seq_len=seq_len,
        mode=mode,
        impl=args.impl,
        chunk=min(args.chunk, seq_len),
        remat=args.remat,
        dtype=args.dtype,
        overrides=args.set,
    )


def real_one(args) -> None:
    """One real step in this process; reports the device's peak memory."""
    from benchlib import measure, report

    report(measure(config_for(args, args.mode, args.seq_len), steps=1, warmup=0))


def table(results: list[dict], modes: list[str], seq_lens: list[int], real: bool) -> str:
    by = {(r["mode"], r["seq_len"]): r for r in results}

    def cell(mode, n):
        r = by.get((mode, n))
        if r is None:
            return "–"
        if "compiled_gib" not in r:
            return "failed to compile"
        text = f"{r['compiled_gib']:.1f}"
        if not r["fits"]:
            return text + " (over)"
        if real:
            run = r.get("real", {})
            if not run.get("ok"):
                text += " / OOM" if run.get("out_of_memory") else " / failed"
            else:  # a backend that keeps no peak count (a CPU) gives None
                text += " / ran" if run["peak_gib"] is None else f" / {run['peak_gib']:.1f}"
        return text

    unit = "compiled / real-step peak GiB" if real else "compiled GiB"
    lines = [
        f"| context ({unit}) | " + " | ".join(LABELS[m] for m in modes) + " |",
        "|---|" + "---|" * len(modes),
    ]
    lines += [f"| {human_tokens(n)} | " + " | ".join(cell(m, n) for m in modes) + " |" for n in seq_lens]
    return "\n".join(lines)


def plot(results: list[dict], modes: list[str], budget_gib: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in modes:
        points = sorted(
            (r["seq_len"], r["compiled_gib"]) for r in results if r["mode"] == mode and "compiled_gib" in r
        )
        if points:
            (line,) = ax.plot(*zip(*points), marker="o", label=f"{LABELS[mode]} (compiled)")
            real = sorted(
                (r["seq_len"], r["real"]["peak_gib"])
                for r in results
                if r["mode"] == mode and r.get("real", {}).get("peak_gib")
            )
            if real:
                ax.plot(
                    *zip(*real),
                    "x",
                    color=line.get_color(),
                    markersize=9,
                    label=f"{LABELS[mode]} (real step)",
                )
    ax.axhline(budget_gib, color="gray", linestyle="--", linewidth=1, label="device memory")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("peak memory of a training step (GiB)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = script_parser(__doc__, png=True, settings=True, memory=True)
    parser.add_argument("--config", default="configs/gpt_3b.py")
    parser.add_argument("--modes", default=",".join(TABLE_MODES))
    parser.add_argument("--seq_lens", default="8192,16384,32768,65536,131072")
    parser.add_argument("--impl", default="auto", help="attention_impl of the two non-vanilla modes")
    parser.add_argument("--chunk", type=int, default=1024, help="query, key/value and loss chunk size")
    parser.add_argument("--dtype", default="", help="compute dtype (default: the config's)")
    parser.add_argument(
        "--remat",
        default="layer",
        help=f"remat preset ({', '.join(REMATS)}); the paper's layer remat by default, so that "
        "the memory is a mode's own and not auto's choice for the device",
    )
    parser.add_argument("--real", action="store_true", help="also run one real step per fitting length")
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--seq_len", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    modes = parse_choices(parser, args.modes, TABLE_MODES, "mode")
    if args.mode:
        real_one(args)
        return

    from benchlib import error_summary, run_in_subprocess, run_meta

    from bpt.train.probe import TrainingStep, memory_budget

    budget = memory_budget(args.memory_gib)
    meta = run_meta(budget_gib=budget / 2**30)
    if not budget:
        parser.error(f"{meta['device']} reports no memory limit; pass --memory_gib")
    print(json.dumps(meta), flush=True)
    seq_lens = sorted(int(n) for n in args.seq_lens.split(","))
    results = []
    for mode in modes:
        for n in seq_lens:
            result = dict(mode=mode, seq_len=n)
            try:
                peak = TrainingStep(config_for(args, mode, n)).memory().peak
                result.update(compiled_gib=peak / 2**30, fits=peak <= budget)
            except Exception as e:
                result.update(fits=False, error=error_summary(e))
            if args.real and result["fits"]:
                cmd = [
                    sys.executable,
                    __file__,
                    f"--config={args.config}",
                    f"--mode={mode}",
                    f"--seq_len={n}",
                ]
                cmd += [f"--impl={args.impl}", f"--chunk={args.chunk}", f"--dtype={args.dtype}", f"--remat={args.remat}"]
                result["real"] = run_in_subprocess(cmd + [f"--set={s}" for s in args.set])
            results.append(result)
            print(json.dumps(result), flush=True)
            if not result["fits"]:
                break  # longer ones need more
    if args.out:
        write_results(args.out, {"meta": meta, "results": results})
    if args.png:
        plot(results, modes, meta["budget_gib"], args.png)
    print(f"\n{meta['device']}, jax {meta['jax']}, budget {meta['budget_gib']:.1f} GiB, batch 1")
    print(table(results, modes, seq_lens, args.real))


if __name__ == "__main__":
    main()
