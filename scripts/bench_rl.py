"""The Agentic Transformer's training step at 4 to 32 trajectories a chain, by attention mode.

    python scripts/bench_rl.py --out results/rl                      # walker shapes, batch 64
    python scripts/bench_rl.py --trajectories 4,32 --batch_size 8 --set model.dtype=bfloat16

memory: for each attention mode x trajectories a chain (1000 steps each, 4 tokens a step: 32
trajectories are 128K tokens), configs/rl/at.py's training step (3 layers, width 128, batch
--batch_size) on random chains of the walker's shapes (24 observations, 6 actions), each in
a fresh process: the compiled step's memory, then --steps real steps (their median time and
the device's peak memory), or out of memory. This is the paper's claim in the RL
experiment: only blockwise attention + FFN (BPT) trains AT on 32 trajectories.

Prints a markdown table last; --out writes results.json and table.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

from benchlib import (  # noqa: E402
    LABELS,
    MODES,
    human_tokens,
    parse_choices,
    report,
    run_in_subprocess,
    run_meta,
    script_parser,
    write_results,
)

OBS, ACT, EPISODE = 24, 6, 1000  # walker


def measure_one(args) -> None:
    import jax
    import numpy as np

    from bpt.config import agentic_config, check_config, model_config, override
    from bpt.models import make_model
    from bpt.train.loop import is_out_of_memory
    from bpt.train.state import create_state, jit_steps

    c = agentic_config("walker_walk", args.one_trajectories)
    c.model.attention_mode = args.one_mode
    c.train.batch_size = args.batch_size
    c = override(c, *args.set)
    check_config(c)
    model = make_model(
        model_config(c.model, vocab_size=1, seq_len=c.data.seq_len, obs_dim=OBS, act_dim=ACT, max_timestep=EPISODE)
    )
    steps = args.one_trajectories * EPISODE
    rng = np.random.default_rng(0)
    batch = {
        "tokens": {
            "states": rng.normal(size=(args.batch_size, steps, OBS)).astype(np.float32),
            "actions": rng.uniform(-1, 1, (args.batch_size, steps, ACT)).astype(np.float32),
            "rewards": rng.uniform(0, 1, (args.batch_size, steps)).astype(np.float32),
            "returns_to_go": rng.uniform(0, 1000, (args.batch_size, steps)).astype(np.float32),
            "completion": np.zeros((args.batch_size, steps), np.float32),
            "timestep": np.tile(np.arange(EPISODE, dtype=np.int32), (args.batch_size, args.one_trajectories)),
        },
        "loss_mask": np.ones((args.batch_size, steps), np.float32),
    }
    batch["targets"] = batch["tokens"]["actions"]
    result = {"mode": args.one_mode, "trajectories": args.one_trajectories, "tokens": c.data.seq_len,
              "batch": args.batch_size, "dtype": c.model.dtype}  # fmt: skip
    try:
        state = create_state(c, model, jax.random.PRNGKey(0))
        train_step, _, _ = jit_steps(c, model, jax.tree.map(lambda x: x.sharding, state))
        compiled = train_step.lower(state, batch, jax.random.PRNGKey(1)).compile()
        memory = compiled.memory_analysis()
        result["compiled_gib"] = (memory.temp_size_in_bytes + memory.argument_size_in_bytes) / 2**30
        times = []
        for i in range(args.steps + 1):
            start = time.perf_counter()
            state, metrics = compiled(state, batch, jax.random.PRNGKey(i))
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
        result.update(ok=True, step_s=statistics.median(times[1:]), loss=float(metrics["loss"]))
        result["tokens_per_s"] = args.batch_size * c.data.seq_len / result["step_s"]
    except Exception as error:  # noqa: BLE001
        if not is_out_of_memory(error):
            raise
        result.update(ok=False, error="out of memory")
    stats = jax.devices()[0].memory_stats() or {}
    result["peak_gib"] = stats.get("peak_bytes_in_use", 0) / 2**30
    report(result)


def table(rows: list[dict]) -> str:
    lines = [
        "AT training step by attention mode (3 layers, width 128, walker shapes)",
        "",
        "| trajectories | tokens | batch | mode | compiled GiB | peak GiB | step s | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("ok"):
            cells = [f"{r.get('compiled_gib', 0):.1f}", f"{r['peak_gib']:.1f}", f"{r['step_s']:.2f}", f"{r['tokens_per_s']:,.0f}"]
        else:
            cells = [f"{r['compiled_gib']:.1f}" if "compiled_gib" in r else "–", "–", r.get("error", "failed")[:40], "–"]
        lines.append(
            f"| {r['trajectories']} | {human_tokens(r['tokens'])} | {r['batch']} | {LABELS[r['mode']]} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = script_parser(__doc__, out_help="a folder: results.json and table.md", settings=True)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--trajectories", default="4,8,16,32")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2, help="real steps timed after the first")
    parser.add_argument("--one_mode", help=argparse.SUPPRESS)
    parser.add_argument("--one_trajectories", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_mode:
        return measure_one(args)
    modes = parse_choices(parser, args.modes, MODES, "mode")
    rows = []
    for n in [int(x) for x in args.trajectories.split(",")]:
        for mode in modes:
            argv = [sys.executable, __file__, "--one_mode", mode, "--one_trajectories", str(n),
                    "--batch_size", str(args.batch_size), "--steps", str(args.steps)]  # fmt: skip
            for s in args.set:
                argv += ["--set", s]
            result = run_in_subprocess(argv)
            result.setdefault("mode", mode)
            result.setdefault("trajectories", n)
            result.setdefault("tokens", 4 * n * EPISODE)
            result.setdefault("batch", args.batch_size)
            print(json.dumps(result), flush=True)
            rows.append(result)
    text = table(rows)
    print("\n" + text)
    if args.out:
        write_results(args.out, {"meta": run_meta(), "rows": rows}, table=text)


if __name__ == "__main__":
    main()
