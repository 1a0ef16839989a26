"""Do the three attention modes agree, and what does each cost? One GPU, one model size.

For each (attention_mode, attention_impl) pair, in a fresh process so that the device's
peak-memory counter belongs to that pair alone:
  1. the full training step (forward, backward, AdamW) is compiled and timed (median of
     --steps runs after two warm-up steps, bpt.train.probe); peak device memory is read
     after the runs;
  2. the loss and the parameter gradients on one fixed batch are compared with vanilla's
     (same initial parameters: every mode has the same parameter tree).

    python scripts/bench_modes.py --config configs/gpt_125m.py --seq_len 8192 --out results/

Prints a markdown table last and writes results.json and table.md under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PAIRS = [
    ("vanilla", "reference"),
    ("memory_efficient", "blockwise"),
    ("blockwise_parallel", "blockwise"),
    ("memory_efficient", "cudnn"),
    ("blockwise_parallel", "cudnn"),
]


def load_config(args):
    from bpt.config import load_config_file

    c = load_config_file(args.config)
    c.data.seq_len = args.seq_len
    c.train.batch_size = args.batch_size
    c.model.dtype = args.dtype
    c.model.attention_mode, c.model.attention_impl = args.mode, args.impl
    for name in ("q_chunk_size", "kv_chunk_size", "loss_chunk_size"):
        c.model[name] = args.chunk_size
    return c


def run_one(args) -> dict:
    """One (mode, impl) pair; prints a JSON line."""
    import jax
    import numpy as np
    from benchlib import report, run_steps
    from jax.flatten_util import ravel_pytree

    from bpt.train.probe import TrainingStep

    step = TrainingStep(load_config(args), vocab_size=257)
    result = {"mode": args.mode, "impl": args.impl, "remat_layer": step.config.model.remat_layer}
    result["compiled_temp_gib"] = step.memory().temp / 2**30
    measured = run_steps(step, steps=args.steps, warmup=2)
    result["peak_gib"] = (measured["peak_bytes"] or float("nan")) / 2**30
    result["step_ms"] = 1e3 * measured["step_seconds"]
    result["tokens_per_sec"] = measured["tokens_per_second"]

    # The same initial parameters and batch in every mode (every mode has the same parameter tree).
    params = step.init(jax.random.PRNGKey(0)).params
    batch = step.batch(jax.random.PRNGKey(1))
    loss_and_grad = jax.jit(
        jax.value_and_grad(
            lambda p: step.model.apply({"params": p}, batch["tokens"], targets=batch["targets"]).loss
        )
    )
    loss, grads = loss_and_grad(params)
    flat = np.asarray(ravel_pytree(grads)[0], np.float32)
    result["loss"] = float(loss)
    ref_path = Path(args.scratch) / "vanilla_grads.npy"
    if args.mode == "vanilla":
        np.save(ref_path, flat)
        Path(args.scratch, "vanilla_loss.json").write_text(json.dumps(float(loss)))
    elif ref_path.exists():
        ref = np.load(ref_path)
        ref_loss = json.loads(Path(args.scratch, "vanilla_loss.json").read_text())
        result["loss_rel_diff"] = abs(float(loss) - ref_loss) / abs(ref_loss)
        result["grad_rel_err"] = float(np.linalg.norm(flat - ref) / np.linalg.norm(ref))
    report(result)
    return result


def main():
    from benchlib import script_parser, write_results

    parser = script_parser(__doc__, out="results/bench_modes", out_help="a folder: results.json and table.md")
    parser.add_argument("--config", default="configs/gpt_125m.py")
    parser.add_argument("--seq_len", type=int, default=8192)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--chunk_size", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--pairs", default="", help="comma-separated mode:impl pairs (default: all)")
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--impl", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        run_one(args)
        return

    from benchlib import run_in_subprocess, run_meta

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pairs = [tuple(p.split(":")) for p in args.pairs.split(",")] if args.pairs else PAIRS
    results = []
    for mode, impl in pairs:
        cmd = [
            sys.executable,
            __file__,
            "--mode",
            mode,
            "--impl",
            impl,
            "--scratch",
            str(out),
            *(
                f"--{k}={getattr(args, k)}"
                for k in ("config", "seq_len", "batch_size", "chunk_size", "dtype", "steps")
            ),
        ]
        print(f"== {mode} / {impl}", flush=True)
        result = run_in_subprocess(cmd)
        if result.get("ok") is False:  # the process died without a result
            result = {"error": result["error"]}
        results.append({"mode": mode, "impl": impl, **result})
        print(json.dumps(results[-1]), flush=True)
    for name in ("vanilla_grads.npy", "vanilla_loss.json"):
        (out / name).unlink(missing_ok=True)

    meta = run_meta(
        **{k: getattr(args, k) for k in ("config", "seq_len", "batch_size", "chunk_size", "dtype", "steps")}
    )
    rows = [
        "| mode | impl | step (ms) | tokens/s | peak memory (GiB) | compiled temp (GiB) | loss | loss rel. diff vs vanilla | grad rel. err vs vanilla |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['mode']} | {r['impl']} | failed: {r['error']} | | | | | | |")
            continue
        rows.append(
            f"| {r['mode']} | {r['impl']} | {r['step_ms']:.1f} | {r['tokens_per_sec']:.0f} | {r['peak_gib']:.2f} | "
            f"{r['compiled_temp_gib']:.2f} | {r['loss']:.5f} | {r.get('loss_rel_diff', 0):.1e} | {r.get('grad_rel_err', 0):.1e} |"
        )
    table = "\n".join(rows)
    write_results(out, {"meta": meta, "results": results}, table=json.dumps(meta) + "\n\n" + table)
    print(json.dumps(meta))
    print(table)


if __name__ == "__main__":
    main()
