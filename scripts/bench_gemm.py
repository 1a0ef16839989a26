"""The bf16 GEMM ceiling a training step's matmuls can reach: XLA's dot (cuBLAS on a GPU) at a
model's layer shapes, in a short burst and sustained, with the SM clock and board power.

    python scripts/bench_gemm.py --config configs/gpt_1b.py --tokens 16384 --out results/gemm
    python scripts/bench_gemm.py --shapes 16384x2048x8192 --calls 20,3000

A GEMM timed alone for a few calls runs at the card's boost clock; a training step runs its
GEMMs for seconds, and a card that reaches its power limit lowers its clock. For each shape
(M x K x N: from --config, a layer's projections over --tokens rows: attention's
[tokens, d_model] x [d_model, d_model], the FFN's up and down projections and its weight
gradient [d_model, tokens] x [tokens, mlp_dim]; or --shapes), each count of --calls runs that
many calls back to back and reports the time a call and TFLOP/s; where nvidia-smi runs, its
samples during each timing give the median SM clock, the highest power draw and the share
of samples in which the power limit held the clock down. The first count is the burst
figure a one-GEMM benchmark reports, the last what a long run sustains: the ceiling to hold
a step's GEMMs against (scripts/profile_step.py --matmuls --peak_tflops). Prints a markdown
table last; --out writes results.json and table.md.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from benchlib import ClockSampler, check_stopped, run_meta, script_parser, stop_on_sigterm, write_results


def layer_shapes(config_path: str, tokens: int) -> dict[str, tuple[int, int, int]]:
    """{name: (M, K, N)} of a layer's GEMMs over `tokens` rows, from a config file."""
    from bpt.config.loader import load_config_file
    from bpt.train.probe import step_model_config

    model = step_model_config(load_config_file(config_path))
    d, f = model.d_model, model.mlp_dim
    return {
        "attention projection": (tokens, d, d),
        "FFN up": (tokens, d, f),
        "FFN down": (tokens, f, d),
        "FFN weight gradient": (d, tokens, f),
    }


def parse_shapes(text: str) -> dict[str, tuple[int, int, int]]:
    shapes = {}
    for item in text.split(","):
        dims = item.lower().split("x")
        if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise SystemExit(f"--shapes takes MxKxN items separated by commas (e.g. 16384x2048x8192); got {item!r}")
        shapes[item] = tuple(int(d) for d in dims)
    return shapes


def time_calls(fn, a, b, calls: int) -> tuple[float, dict]:
    """Seconds a call over `calls` calls back to back, and what the sampler saw meanwhile."""
    sampler = ClockSampler()
    try:
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(a, b)
        jax.block_until_ready(out)
        seconds = (time.perf_counter() - start) / calls
    finally:
        seen = sampler.stop()
    return seconds, seen


def table(rows: list[dict], device: str) -> str:
    sampled = any("sm_clock_mhz" in r for r in rows)
    head = "| shape | M x K x N | calls | µs a call | TFLOP/s |"
    head += " SM clock (MHz) | power (W) | power-capped |" if sampled else ""
    lines = [f"{device}, bf16 in and out (float32 accumulation), calls back to back", "", head]
    lines.append("|---" * (5 + 3 * sampled) + "|")
    for r in rows:
        line = f"| {r['shape']} | {'x'.join(map(str, r['mkn']))} | {r['calls']} | {r['us']:,.0f} | {r['tflops']:.0f} |"
        if sampled:  # a burst shorter than nvidia-smi's start has no samples
            if "sm_clock_mhz" in r:
                line += f" {r['sm_clock_mhz']:.0f} | {r['max_power_w']:.0f} | {r['power_capped']:.0%} |"
            else:
                line += " – | – | – |"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("--config", default="configs/gpt_1b.py", help="a GPT config file whose layer shapes to time")
    p.add_argument("--tokens", type=int, default=16384, help="rows a GEMM takes (a micro-batch's tokens)")
    p.add_argument("--shapes", default="", help="MxKxN,... instead of the config's shapes")
    p.add_argument("--calls", default="20,400,3000", help="calls back to back a timing, comma-separated")
    p.add_argument("--pause", type=float, default=5.0, help="seconds of rest before each shape's burst")
    args = p.parse_args()
    try:
        calls = [int(c) for c in args.calls.split(",")]
        assert all(c > 0 for c in calls)
    except (ValueError, AssertionError):
        p.error(f"--calls takes positive integers separated by commas; got {args.calls!r}")
    shapes = parse_shapes(args.shapes) if args.shapes else layer_shapes(args.config, args.tokens)
    stop_on_sigterm()
    meta = run_meta(shapes=shapes, calls=calls)
    rows = []
    try:
        for name, (m, k, n) in shapes.items():
            a = jax.random.normal(jax.random.PRNGKey(0), (m, k), jnp.bfloat16)
            b = jax.random.normal(jax.random.PRNGKey(1), (k, n), jnp.bfloat16)
            fn = jax.jit(jnp.dot)  # bf16 out, float32 accumulation: as the step's einsums
            jax.block_until_ready(fn(a, b))
            time.sleep(args.pause)  # the card cools to where a one-GEMM benchmark starts
            for count in calls:
                check_stopped()
                seconds, seen = time_calls(fn, a, b, count)
                rows.append(
                    dict(shape=name, mkn=[m, k, n], calls=count, us=seconds * 1e6, tflops=2 * m * k * n / seconds / 1e12, **seen)
                )
                print(rows[-1], flush=True)
    except KeyboardInterrupt:
        print("stopped; the rows measured so far follow")
    text = table(rows, meta["device"])
    if args.out:
        write_results(args.out, {**meta, "rows": rows}, table=text)
    print()
    print(text)


if __name__ == "__main__":
    main()
