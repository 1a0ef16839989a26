"""The longest context whose full training step (forward, backward, AdamW) fits one device.

For each model config, attention mode, chunk size and remat preset, the search compiles the
step at batch 1 for growing lengths (doubling from --start, then bisecting the last gap in
steps of 1/--refine, an eighth by default, of the longest that fit) and keeps the longest
whose compiled memory (XLA's memory analysis: state, batch, activations, gradients) fits
the device; nothing is allocated while it searches. With
--verify, the best setting of each mode then runs real steps at that length in a fresh
process, stepping down an eighth at a time until one runs: the verdict (--verify_max caps
the length it starts from: at half a million tokens one step of a 1B model takes minutes).
--jobs N runs N searches at once, each in its own process (compiling is host work).

    python scripts/bench_max_context.py --configs configs/gpt_1b.py --verify
    python scripts/bench_max_context.py --configs configs/gpt_350m.py,configs/gpt_1b.py,configs/gpt_3b.py \\
        --chunks 512,1024,2048,4096 --remats layer,full,dots --groups 1,4 --verify --png max_context.png

Remat presets (model.remat_layer / remat_attention / remat_ffn): see REMATS; --groups adds
nested remat of the layer stack (model.remat_group); --set section.name=value (repeatable)
sets any other config field, such as model.offload_layer_inputs=true or
train.optimizer_state_dtype=bfloat16. Prints a markdown table last; --out writes every
compile and run as JSON. Every compile is printed as a JSON line when it ends; --known FILE
takes such lines (of an earlier search that was stopped, say) and does not compile those
lengths again, so a long search can be resumed:

    python scripts/bench_max_context.py ... | tee search.jsonl      # stopped after a few compiles
    python scripts/bench_max_context.py ... --known search.jsonl    # goes on from there
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import multiprocessing
import os
import sys
from pathlib import Path

# Before jax starts: no preallocated pool, so that compiling (the GEMM autotuner allocates
# operands of its own) has the whole device; the processes that run real steps preallocate
# 95% of it (benchlib.run_in_subprocess).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

from benchlib import LABELS, REMATS, TABLE_MODES, human_tokens, parse_choices, script_parser, write_results  # noqa: E402  (after the environment)


def load_config(args, *, config: str, mode: str, chunk: int, remat: str, group: int, seq_len: int):
    from benchlib import benchmark_config

    # The looped layer stack (the 125M configs unroll theirs for speed): each length compiles
    # in a fraction of the unrolled stack's time; --set model.scan_unroll=N overrides it.
    overrides = [f"model.remat_group={group}", "model.scan_unroll=1", *args.set]
    return benchmark_config(
        config,
        seq_len=seq_len,
        mode=mode,
        impl=args.impl,
        chunk=chunk,
        remat=remat,
        dtype=args.dtype,
        overrides=overrides,
    )


def setting_args(args, setting: dict) -> list[str]:
    """The command-line arguments that select one setting (for a subprocess)."""
    return [
        f"--configs={setting['config']}",
        f"--modes={setting['mode']}",
        f"--chunks={setting['chunk']}",
        f"--remats={setting['remat']}",
        f"--groups={setting['group']}",
        f"--impl={args.impl}",
        f"--dtype={args.dtype}",
        *(f"--set={s}" for s in args.set),
    ]


def quiet_compiler() -> None:
    """Runs in each --jobs worker before jax starts: no autotuning. Concurrent autotuners
    each allocate operands on the device and run it out of memory; a compile without them
    picks default algorithms, and its memory analysis differs by the autotuners' scratch
    (checked in docs/notes/paper_tables.md). The verdicts compile with autotuning, as training does."""
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_autotune_level=0".strip()


def search(args, budget: int, setting: dict) -> tuple[dict, list[dict]]:
    """Compiled-memory search over lengths for one setting: (its summary, every compile).
    Lengths args.known holds are not compiled again (their fit is judged against this budget)."""
    from benchlib import COMPILE_KEYS, compile_records, error_summary, longest_fitting

    from bpt.train.probe import TrainingStep

    records = []
    known = compile_records(Path(args.known).read_text()) if args.known and Path(args.known).exists() else {}

    def fits(seq_len: int) -> bool:
        record = dict(setting, seq_len=seq_len)
        earlier = known.get(tuple(record[k] for k in COMPILE_KEYS))
        if earlier is not None:
            record.update({k: v for k, v in earlier.items() if k in ("compiled_gib", "temp_gib", "error")}, known=True)
            record["fits"] = "compiled_gib" in record and record["compiled_gib"] * 2**30 <= budget
            records.append(record)
            print(json.dumps(record), flush=True)
            return record["fits"]
        try:
            c = load_config(args, **setting, seq_len=seq_len)
            memory = TrainingStep(c).memory()
            record.update(compiled_gib=memory.peak / 2**30, temp_gib=memory.temp / 2**30)
            record["fits"] = memory.peak <= budget
        except Exception as e:  # an error in compiling counts as not fitting, and is kept
            record.update(fits=False, error=error_summary(e))
        records.append(record)
        print(json.dumps(record), flush=True)
        return record["fits"]

    start = max(args.start, setting["chunk"])
    result = longest_fitting(
        fits, start=start, stop=args.stop, refine=args.refine, granule=args.granule or setting["chunk"]
    )
    summary = dict(
        setting,
        errors=sum("error" in r for r in records),  # compiles that failed: counted as not fitting
        longest=result.longest,
        longest_power_of_two=result.longest_power_of_two,
        step=result.step,
        summary=True,
    )
    return summary, records


def run_one(args) -> None:
    """One real training step at --seq_len in this process (no warm-up: the step is compiled
    before it runs, and at these lengths a step takes minutes); reports its result."""
    from benchlib import measure, report

    setting = dict(
        config=args.configs,
        mode=args.modes,
        chunk=int(args.chunks),
        remat=args.remats,
        group=int(args.groups),
    )
    config = load_config(args, **setting, seq_len=args.seq_len)
    report(dict(seq_len=args.seq_len, **measure(config, steps=1, warmup=0)))


def verify(args, best: dict, log) -> dict:
    """Real steps in fresh processes, from the compiled length (or --verify_max) down, until
    one runs. The verdict says whether --verify_max capped it."""
    from benchlib import run_in_subprocess

    length = best["longest"]
    capped = bool(args.verify_max) and length > args.verify_max
    if capped:
        length = args.verify_max
    for _ in range(args.verify_tries):
        if length < best["chunk"]:
            break
        result = run_in_subprocess(
            [sys.executable, __file__, *setting_args(args, best), "--run_one", f"--seq_len={length}"]
        )
        result.setdefault("seq_len", length)
        result["capped"] = capped
        log(dict(best, summary=False, verify=result))
        if result["ok"]:
            return result
        length -= best["step"]
    return {"seq_len": 0, "ok": False, "capped": capped}


def table(bests: dict, verdicts: dict, configs: list[str], modes: list[str]) -> str:
    """The longest context of each config and mode, then BPT's ratio to each other mode."""
    others = [m for m in modes if m != "blockwise_parallel"] if "blockwise_parallel" in modes else []
    rows = [
        "| model | " + " | ".join(LABELS[m] for m in modes) + "".join(f" | BPT / {LABELS[m]}" for m in others) + " |",
        "|---|" + "---|" * (len(modes) + len(others)),
    ]
    for config in configs:
        cells = []
        for mode in modes:
            b = bests.get((config, mode))
            if b is None:
                cells.append("–")
                continue
            group = f", groups of {b['group']}" if b["group"] > 1 else ""
            cell = f"{human_tokens(b['longest'])} ({b['chunk']}, {b['remat']}{group})"
            if b.get("errors"):
                cell += f" [{b['errors']} failed compiles]"
            if (config, mode) in verdicts:
                verdict = verdicts[config, mode]
                cap = " (the cap)" if verdict.get("capped") and verdict["ok"] else ""
                cell += f"; real step: {human_tokens(verdict['seq_len'])}{cap}"
            cells.append(cell)
        bpt = bests.get((config, "blockwise_parallel"), {}).get("longest", 0)
        for mode in others:
            other = bests.get((config, mode), {}).get("longest", 0)
            cells.append(f"{bpt / other:.1f}x" if bpt and other else "–")
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
    parser = script_parser(__doc__, png=True, settings=True, memory=True)
    parser.add_argument("--configs", default="configs/gpt_1b.py")
    parser.add_argument("--modes", default=",".join(TABLE_MODES))
    parser.add_argument("--impl", default="auto", help="attention_impl of the two non-vanilla modes")
    parser.add_argument("--chunks", default="1024", help="chunk sizes (query, key/value and loss)")
    parser.add_argument("--remats", default="layer", help=f"remat presets: {', '.join(REMATS)}")
    parser.add_argument(
        "--groups", default="1", help="model.remat_group values (nested remat; those dividing the layers)"
    )
    parser.add_argument("--dtype", default="", help="compute dtype (default: the config's)")
    parser.add_argument("--start", type=int, default=4096)
    parser.add_argument(
        "--granule",
        type=int,
        default=0,
        help="the bisection tries multiples of this (0: the chunk; on a sequence mesh of N devices "
        "2 N chunk, the zigzag layout's unit)",
    )
    parser.add_argument("--stop", type=int, default=1 << 22)
    parser.add_argument(
        "--refine",
        type=int,
        default=8,
        help="after doubling, bisect the last gap in steps of 1/refine of the longest that fit",
    )
    parser.add_argument("--verify", action="store_true", help="confirm each mode's best by real steps")
    parser.add_argument("--verify_tries", type=int, default=4)
    parser.add_argument("--verify_max", type=int, default=0, help="longest real step to try (0: no cap)")
    parser.add_argument("--jobs", type=int, default=1, help="searches at once, one process each")
    parser.add_argument(
        "--known", default="", help="a file of this script's JSON lines: lengths it holds are not compiled again"
    )
    parser.add_argument("--run_one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seq_len", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    remats = parse_choices(parser, args.remats, REMATS, "remat preset")
    modes = parse_choices(parser, args.modes, TABLE_MODES, "mode")
    if args.run_one:
        run_one(args)
        return

    from benchlib import run_meta

    from bpt.train.probe import memory_budget

    budget = memory_budget(args.memory_gib)
    meta = run_meta(budget_gib=budget / 2**30, settings=args.set)
    if not budget:
        parser.error(f"{meta['device']} reports no memory limit; pass --memory_gib")
    configs = args.configs.split(",")
    chunks = [int(c) for c in args.chunks.split(",")]
    groups = [int(g) for g in args.groups.split(",")]
    print(json.dumps(meta), flush=True)
    records = []

    def log(record: dict) -> None:
        records.append(record)
        print(json.dumps(record), flush=True)

    from bpt.config import load_config_file

    num_layers = {config: load_config_file(config).model.num_layers for config in configs}
    settings = [
        dict(config=config, mode=mode, chunk=chunk, remat=remat, group=group)
        for config, mode in itertools.product(configs, modes)
        # Vanilla attention has no chunks; its FFN and loss do not either.
        for chunk in (chunks[:1] if mode == "vanilla" else chunks)
        for remat in remats
        for group in groups
        if num_layers[config] % group == 0
    ]
    bests, verdicts = {}, {}

    def keep(found: dict, compiles: list[dict]) -> None:
        records.extend(compiles)
        log(found)
        key = found["config"], found["mode"]
        if found["longest"] > bests.get(key, {}).get("longest", 0):
            bests[key] = found

    if args.jobs > 1:
        # The workers hold device contexts: they are gone before any real step runs (the
        # with block waits for them).
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(
            args.jobs, mp_context=spawn, initializer=quiet_compiler
        ) as pool:
            for found, compiles in pool.map(
                search, itertools.repeat(args), itertools.repeat(budget), settings
            ):
                keep(found, compiles)
    else:
        for setting in settings:
            keep(*search(args, budget, setting))
    if args.verify:
        for key, best in bests.items():
            verdicts[key] = verify(args, best, log)
    if args.out:
        write_results(args.out, {"meta": meta, "records": records})
    if args.png:
        plot(bests, verdicts, configs, modes, args.png)
    print(
        f"\n{meta['device']}, jax {meta['jax']}, budget {meta['budget_gib']:.1f} GiB, batch 1; "
        "longest context by compiled memory (chunk, remat preset)"
        + (f"; {', '.join(args.set)}" if args.set else "")
    )
    print(table(bests, verdicts, configs, modes))


if __name__ == "__main__":
    main()
