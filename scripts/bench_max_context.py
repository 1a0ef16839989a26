"""The longest context whose full training step (forward, backward, AdamW) fits one device.

For each model config, attention mode, chunk size and remat preset, the search compiles the
step at batch 1 for growing lengths (doubling from --start, then bisecting the last gap in
eighths) and keeps the longest whose compiled memory (XLA's memory analysis: state, batch,
activations, gradients) fits the device; nothing is allocated while it searches. With
--verify, the best setting of each mode then runs real steps at that length in a fresh
process, stepping down an eighth at a time until one runs: the verdict.

    python scripts/bench_max_context.py --configs configs/gpt_1b.py --verify
    python scripts/bench_max_context.py --configs configs/gpt_350m.py,configs/gpt_1b.py,configs/gpt_3b.py \\
        --chunks 512,1024,2048,4096 --remats layer,full,dots --groups 1,4 --verify --png max_context.png

Remat presets (model.remat_layer / remat_attention / remat_ffn): see REMATS; --groups adds
nested remat of the layer stack (model.remat_group). Prints a markdown
table last; --out writes every compile and run as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

# Before jax starts: no preallocated pool, so that compiling (the GEMM autotuner allocates
# operands of its own) has the whole device; real steps grow the pool up to 95% of it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

MODES = ("vanilla", "memory_efficient", "blockwise_parallel")
LABELS = {"vanilla": "Vanilla", "memory_efficient": "MemoryEfficient", "blockwise_parallel": "BPT"}
# name: (remat_layer, remat_attention, remat_ffn)
REMATS = {
    "layer": ("nothing_saveable", "none", "nothing_saveable"),  # bpt's default
    "full": ("nothing_saveable", "nothing_saveable", "nothing_saveable"),
    "dots": ("dots_saveable", "none", "nothing_saveable"),
    "none": ("none", "none", "none"),
}


def load_config(
    path: str, *, mode: str, impl: str, chunk: int, remat: str, seq_len: int, dtype: str, group: int = 1
):
    from bpt.config import load_config_file

    c = load_config_file(path)
    c.data.seq_len = seq_len
    c.train.batch_size = 1
    c.train.grad_accum_steps = 1
    if dtype:
        c.model.dtype = dtype
    c.model.attention_mode = mode
    c.model.attention_impl = "reference" if mode == "vanilla" else impl
    c.model.q_chunk_size = c.model.kv_chunk_size = c.model.loss_chunk_size = chunk
    c.model.remat_layer, c.model.remat_attention, c.model.remat_ffn = REMATS[remat]
    c.model.remat_group = group
    return c


def setting_args(args, config: str, mode: str, chunk: int, remat: str, group: int) -> list[str]:
    return [
        f"--groups={group}",
        f"--configs={config}",
        f"--modes={mode}",
        f"--chunks={chunk}",
        f"--remats={remat}",
        f"--impl={args.impl}",
        f"--dtype={args.dtype}",
    ]


def search(args, budget: int, config: str, mode: str, chunk: int, remat: str, group: int, log) -> dict:
    """Compiled-memory search over lengths for one setting."""
    from bpt.train.probe import TrainingStep, longest_fitting

    def fits(seq_len: int) -> bool:
        record = dict(config=config, mode=mode, chunk=chunk, remat=remat, group=group, seq_len=seq_len)
        try:
            c = load_config(
                config,
                mode=mode,
                impl=args.impl,
                chunk=chunk,
                remat=remat,
                seq_len=seq_len,
                dtype=args.dtype,
                group=group,
            )
            memory = TrainingStep(c).memory()
            record.update(compiled_gib=memory.peak / 2**30, temp_gib=memory.temp / 2**30)
            record["fits"] = memory.peak <= budget
        except Exception as e:  # an error in compiling counts as not fitting, and is kept
            record.update(fits=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        log(record)
        return record["fits"]

    start = max(args.start, chunk)
    result = longest_fitting(fits, start=start, stop=args.stop, granule=chunk)
    return dict(
        config=config,
        mode=mode,
        chunk=chunk,
        remat=remat,
        group=group,
        longest=result.longest,
        longest_power_of_two=result.longest_power_of_two,
        step=result.step,
    )


def run_one(args) -> None:
    """A real training step at --seq_len in this process; prints a RESULT line."""
    from bpt.train.probe import TrainingStep, is_out_of_memory

    c = load_config(
        args.configs,
        mode=args.modes,
        impl=args.impl,
        chunk=int(args.chunks),
        remat=args.remats,
        seq_len=args.seq_len,
        dtype=args.dtype,
        group=int(args.groups),
    )
    result = {"seq_len": args.seq_len}
    try:
        measured = TrainingStep(c).run(steps=1, warmup=1)
        result.update(
            ok=True, peak_gib=(measured["peak_bytes"] or 0) / 2**30, step_seconds=measured["step_seconds"]
        )
    except Exception as e:
        result.update(ok=False, out_of_memory=is_out_of_memory(e), error=str(e).splitlines()[0][:200])
    print("RESULT " + json.dumps(result), flush=True)


def verify(args, best: dict, log) -> dict:
    """Real steps in fresh processes, from the compiled length down, until one runs."""
    length = best["longest"]
    for _ in range(args.verify_tries):
        if length < best["chunk"]:
            break
        cmd = [
            sys.executable,
            __file__,
            *setting_args(args, best["config"], best["mode"], best["chunk"], best["remat"], best["group"]),
            "--run_one",
            f"--seq_len={length}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if lines:
            result = json.loads(lines[-1][len("RESULT ") :])
        else:  # the process died (the OOM killer, a crash in the runtime)
            tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
            result = {"seq_len": length, "ok": False, "error": tail[0][:200]}
        log(dict(best, verify=result))
        if result["ok"]:
            return result
        length -= best["step"]
    return {"seq_len": 0, "ok": False}


def human(n: int) -> str:
    return "–" if not n else (f"{n // 1024}K" if n % 1024 == 0 else f"{n / 1024:.1f}K")


def table(bests: dict, verdicts: dict, configs: list[str], modes: list[str]) -> str:
    rows = [
        "| model | " + " | ".join(LABELS[m] for m in modes) + " |",
        "|---|" + "---|" * len(modes),
    ]
    for config in configs:
        cells = []
        for mode in modes:
            b = bests.get((config, mode))
            if b is None:
                cells.append("–")
                continue
            group = f", groups of {b['group']}" if b["group"] > 1 else ""
            cell = f"{human(b['longest'])} ({b['chunk']}, {b['remat']}{group})"
            if (config, mode) in verdicts:
                cell += f"; real step: {human(verdicts[config, mode]['seq_len'])}"
            cells.append(cell)
        rows.append(f"| {Path(config).stem} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(bests: dict, verdicts: dict, configs: list[str], modes: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(modes)
    x = np.arange(len(configs))
    for i, mode in enumerate(modes):
        compiled = [bests.get((c, mode), {}).get("longest", 0) / 1024 for c in configs]
        real = [verdicts.get((c, mode), {}).get("seq_len", 0) / 1024 for c in configs]
        bars = ax.bar(x + i * width, compiled, width, label=f"{LABELS[mode]} (compiled)", alpha=0.45)
        ax.bar(
            x + i * width,
            real,
            width * 0.6,
            color=bars.patches[0].get_facecolor()[:3],
            label=f"{LABELS[mode]} (real step)",
        )
    ax.set_yscale("log", base=2)
    ax.set_xticks(x + width * (len(modes) - 1) / 2, [Path(c).stem for c in configs])
    ax.set_ylabel("longest training context (K tokens)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", default="configs/gpt_1b.py")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--impl", default="auto", help="attention_impl of the two non-vanilla modes")
    parser.add_argument("--chunks", default="1024", help="chunk sizes (query, key/value and loss)")
    parser.add_argument("--remats", default="layer", help=f"remat presets: {', '.join(REMATS)}")
    parser.add_argument(
        "--groups", default="1", help="model.remat_group values (nested remat; those dividing the layers)"
    )
    parser.add_argument("--dtype", default="", help="compute dtype (default: the config's)")
    parser.add_argument("--start", type=int, default=4096)
    parser.add_argument("--stop", type=int, default=1 << 22)
    parser.add_argument("--memory_gib", type=float, default=0.0, help="budget (default: the device's limit)")
    parser.add_argument("--verify", action="store_true", help="confirm each mode's best by real steps")
    parser.add_argument("--verify_tries", type=int, default=4)
    parser.add_argument("--out", default="")
    parser.add_argument("--png", default="")
    parser.add_argument("--run_one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seq_len", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for remat in args.remats.split(","):
        if remat not in REMATS:
            parser.error(f"unknown remat preset {remat!r}; allowed: {', '.join(REMATS)}")
    for mode in args.modes.split(","):
        if mode not in MODES:
            parser.error(f"unknown mode {mode!r}; allowed: {', '.join(MODES)}")
    if args.run_one:
        run_one(args)
        return

    import jax

    device = jax.devices()[0]
    budget = int(args.memory_gib * 2**30) or (device.memory_stats() or {}).get("bytes_limit", 0)
    if not budget:
        parser.error(f"{device.device_kind} reports no memory limit; pass --memory_gib")
    configs, modes = args.configs.split(","), args.modes.split(",")
    chunks = [int(c) for c in args.chunks.split(",")]
    remats = args.remats.split(",")
    groups = [int(g) for g in args.groups.split(",")]
    meta = {
        "date": datetime.date.today().isoformat(),
        "device": device.device_kind,
        "jax": jax.__version__,
        "budget_gib": budget / 2**30,
        "command": "python " + " ".join(sys.argv),
    }
    print(json.dumps(meta), flush=True)
    records = []

    def log(record: dict) -> None:
        records.append(record)
        print(json.dumps(record), flush=True)

    bests, verdicts = {}, {}
    for config, mode in itertools.product(configs, modes):
        # Vanilla attention has no chunks; its FFN and loss do not either.
        grid = itertools.product(chunks[:1] if mode == "vanilla" else chunks, remats, groups)
        for chunk, remat, group in grid:
            found = search(args, budget, config, mode, chunk, remat, group, log)
            log(dict(found, summary=True))
            if found["longest"] > bests.get((config, mode), {}).get("longest", 0):
                bests[config, mode] = found
        if args.verify and (config, mode) in bests:
            verdicts[config, mode] = verify(args, bests[config, mode], log)
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    if args.png:
        plot(bests, verdicts, configs, modes, args.png)
    print(
        f"\n{meta['device']}, jax {meta['jax']}, budget {meta['budget_gib']:.1f} GiB, batch 1; "
        "longest context by compiled memory (chunk, remat preset)"
    )
    print(table(bests, verdicts, configs, modes))


if __name__ == "__main__":
    main()
