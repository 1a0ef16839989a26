"""LayerNorm alone: XLA's fusions of bpt.models.lm.layer_norm's formula against bpt's Pallas
kernels (bpt/ops/kernels/layer_norm.py), and the kernels' settings.

    python scripts/bench_norm.py --out results/norm
    python scripts/bench_norm.py --rows 32768 --widths 2048 \\
        --variants '{"pallas": {}, "pallas, 4 steps": {"max_steps": 4}}'

For each width (--widths) over --rows rows of bf16 (GPT-1B's 8K step holds 4 x 8192 rows
of 2048), each implementation's forward and forward + backward (the gradients of x, scale
and bias for a fixed cotangent), the device's time a call (calls back to back, the median
of 5 runs of --repeats), and the bytes each must move at least as GB/s: the forward reads x
and writes y, the backward reads x and dy and writes dx. Variants (--variants: a JSON object,
name -> the kernels' options: rows_per_block, max_steps, num_warps, num_stages; by default
one setting changed at a time) are checked against XLA's outputs first. --add times
add_layer_norm instead (GPT's ln2: h = x + residual, then its norm; the forward reads x and
the residual and writes h and y, the backward reads h, dy and h's gradient and writes dx).
Prints a markdown table last; --out writes results.json and table.md.

    python scripts/bench_norm.py --add --out results/add_norm
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
from benchlib import rel_err, run_meta, script_parser, seconds_per_call, write_results

from bpt.models.lm import add_layer_norm, layer_norm
from bpt.ops.kernels import layer_norm as kernel

# The kernels as layer_norm runs them, then one setting changed at a time (untuned so far).
DEFAULT_VARIANTS = json.dumps(
    {
        "pallas": {},
        "pallas, 4 steps": {"max_steps": 4},
        "pallas, 64 steps": {"max_steps": 64},
        "pallas, 8 warps": {"num_warps": 8},
        "pallas, 1 stage": {"num_stages": 1},
        "pallas, 8 rows": {"rows_per_block": 8},
    }
)
FORWARD_OPTIONS = ("rows_per_block", "num_warps")



def implementations(variants: dict, add: bool = False):
    """(name, forward(*inputs), forward_and_backward(*inputs, dy)); inputs are (x, scale,
    bias), or with add (x, residual, scale, bias) for add_layer_norm (h and y; the cotangent
    dy on both)."""

    def xla_forward(*inputs):
        return add_layer_norm(*inputs, 1e-5) if add else layer_norm(*inputs, 1e-5)

    def xla_both(*inputs_and_dy):
        *inputs, dy = inputs_and_dy
        outs, vjp = jax.vjp(xla_forward, *inputs)
        return (*outs, *vjp((dy, dy))) if add else (outs, *vjp(dy))

    yield "xla", jax.jit(xla_forward), jax.jit(xla_both)
    for name, options in variants.items():
        fwd_options = {k: v for k, v in options.items() if k in FORWARD_OPTIONS}

        def forward(x, *rest, fwd_options=fwd_options):
            *residual, scale, bias = rest
            return kernel.forward(x, scale, bias, 1e-5, residual=(residual or [None])[0], **fwd_options)[:-2]

        def both(x, *rest, options=options, fwd_options=fwd_options):
            *residual, scale, bias, dy = rest
            residual = (residual or [None])[0]
            *outs, mean, rstd = kernel.forward(x, scale, bias, 1e-5, residual=residual, **fwd_options)
            if residual is None:
                return (*outs, *kernel.backward(x, dy, mean, rstd, scale, **options))
            dx, dscale, dbias = kernel.backward(outs[0], dy, mean, rstd, scale, dresidual=dy, **options)
            return (*outs, dx, dx, dscale, dbias)

        yield name, jax.jit(forward), jax.jit(both)


def main() -> None:
    parser = script_parser(__doc__, out_help="a folder: results.json and table.md")
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--widths", default="2048,4096", help="comma-separated feature sizes")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="JSON: name -> kernel options")
    parser.add_argument(
        "--add", action="store_true", help="add_layer_norm: a residual add, then the norm (GPT's ln2)"
    )
    args = parser.parse_args()

    variants = json.loads(args.variants)
    results = {"meta": run_meta(rows=args.rows, add=args.add), "rows": []}
    what = "The residual add and LayerNorm" if args.add else "LayerNorm"
    lines = [
        f"{what} over {args.rows} rows, bf16: µs a call (GB/s of the least traffic), calls back to back",
        "",
        "| width | implementation | forward | forward + backward | error against xla |",
        "|---|---|---|---|---|",
    ]
    for d in (int(w) for w in args.widths.split(",")):
        keys = jax.random.split(jax.random.PRNGKey(d), 4)
        x = (1.0 + 2.0 * jax.random.normal(keys[0], (args.rows, d))).astype(jnp.bfloat16)
        scale = (1.0 + 0.1 * jax.random.normal(keys[1], (d,))).astype(jnp.bfloat16)
        bias = (0.1 * jax.random.normal(keys[2], (d,))).astype(jnp.bfloat16)
        dy = jax.random.normal(keys[3], x.shape, jnp.bfloat16)
        residual = jnp.flip(dy, axis=0)
        inputs = (x, residual, scale, bias) if args.add else (x, scale, bias)
        row_bytes = args.rows * d * x.dtype.itemsize
        want = None
        for name, forward, both in implementations(variants, args.add):
            row = {"width": d, "implementation": name}
            try:
                outs = both(*inputs, dy)
                if want is None:
                    want = outs
                row["error"] = max(rel_err(o, w) for o, w in zip(outs, want))
                row["forward_us"] = 1e6 * seconds_per_call(forward, *inputs, repeats=args.repeats, timing="pipelined")
                row["both_us"] = 1e6 * seconds_per_call(both, *inputs, dy, repeats=args.repeats, timing="pipelined")
            except Exception as e:  # a variant that does not compile is a row, not the end of the sweep
                row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            results["rows"].append(row)
            if "failed" in row:
                lines.append(f"| {d} | {name} | {row['failed']} | | |")
                continue
            fwd_gbs = (4 if args.add else 2) * row_bytes / row["forward_us"] / 1e3
            both_gbs = (8 if args.add else 5) * row_bytes / row["both_us"] / 1e3
            lines.append(
                f"| {d} | {name} | {row['forward_us']:,.0f} ({fwd_gbs:,.0f}) | "
                f"{row['both_us']:,.0f} ({both_gbs:,.0f}) | {row['error']:.1e} |"
            )
            print(json.dumps(row), flush=True)
    table = "\n".join(lines)
    if args.out:
        write_results(args.out, results, table=table)
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}\n")
    print(table)


if __name__ == "__main__":
    main()
