"""FLASH's mixed chunk attention alone: the XLA path against the Pallas kernels, and the
kernels' block settings.

    python scripts/bench_gau.py --out results/gau
    python scripts/bench_gau.py --tokens 65536 --batch 1 --variants '{"pallas": {"state_block_e": 32}}'

One GAU layer's attention at flash_125m's sizes by default (chunks of 256, qk_dim 128, value
width 1536 = 2 x 768), bf16, --batch sequences of --tokens / --batch tokens. For the XLA
path ("blockwise") and each Pallas variant (--variants: a JSON object, name -> the fields
of bpt.ops.kernels.gau.GAUKernelConfig to set):
the forward and the forward + backward (the gradient of sum(out * cotangent) with respect
to the five inputs), the median of --repeats calls after a warm-up, in one process; the
kernels' outputs are checked against the XLA path's first. Prints a markdown table last;
--out writes results.json and table.md.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
from benchlib import rel_err, run_meta, script_parser, seconds_per_call, write_results

from bpt.ops.gau import mixed_chunk_attention

DEFAULT_VARIANTS = '{"pallas": {}, "pallas, quadratic kernel": {"quadratic": true}, "pallas, quadratic kernel, 8 warps": {"quadratic": true, "num_warps": 8}}'


def median_ms(fn, args, repeats: int) -> float:
    return 1e3 * seconds_per_call(fn, *args, repeats=repeats, warmup=1)



def main() -> None:
    parser = script_parser(__doc__, out_help="a folder: results.json and table.md")
    parser.add_argument("--tokens", type=int, default=65536, help="tokens in all (batch x sequence)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--qk_dim", type=int, default=128)
    parser.add_argument("--value_dim", type=int, default=1536)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="JSON: name -> kernel options")
    args = parser.parse_args()

    b, t, g = args.batch, args.tokens // args.batch, args.chunk
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    qk = [jax.random.normal(k, (b, t, args.qk_dim), jnp.bfloat16) for k in keys[:4]]
    v = jax.nn.silu(jax.random.normal(keys[4], (b, t, args.value_dim), jnp.bfloat16))
    cot = jax.random.normal(keys[5], v.shape, jnp.bfloat16)
    inputs = (*qk, v)
    scales = dict(chunk_size=g, quad_scale=1.0 / g, lin_scale=1.0 / t)

    def variants():
        yield "blockwise", dict(impl="blockwise")
        for name, options in json.loads(args.variants).items():
            yield name, dict(impl="pallas", kernel_options=options)

    rows, reference = [], None
    for name, kwargs in variants():
        attend = lambda *a, kw=kwargs: mixed_chunk_attention(*a, **scales, **kw)  # noqa: E731
        fwd = jax.jit(attend)
        fwd_bwd = jax.jit(
            jax.grad(lambda *a: jnp.sum(attend(*a).astype(jnp.float32) * cot), argnums=range(5))
        )
        row = dict(variant=name, **kwargs)
        try:
            out = fwd(*inputs)
            if reference is None:
                reference = (out, fwd_bwd(*inputs))
            else:
                row["out_rel_err"] = rel_err(out, reference[0])
                grads = fwd_bwd(*inputs)
                row["grad_rel_err"] = max(rel_err(x, y) for x, y in zip(grads, reference[1]))
            row["forward_ms"] = median_ms(fwd, inputs, args.repeats)
            row["fwd_bwd_ms"] = median_ms(fwd_bwd, inputs, args.repeats)
            row["ok"] = True
        except Exception as error:  # a setting the compiler refuses (registers, shared memory)
            row.update(ok=False, error=f"{type(error).__name__}: {str(error)[:300]}")
        rows.append(row)
        print(json.dumps(row), flush=True)

    base = rows[0]
    lines = [
        f"Mixed chunk attention, {b} x {t} tokens, chunk {g}, qk_dim {args.qk_dim}, value width "
        f"{args.value_dim}, bf16 ({jax.devices()[0].device_kind}, jax {jax.__version__})",
        "",
        "| variant | forward ms | fwd+bwd ms | forward speed-up | fwd+bwd speed-up | max rel. error |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['variant']} | failed: {r['error'][:80]} | | | | |")
            continue
        err = max(r.get("out_rel_err", 0.0), r.get("grad_rel_err", 0.0))
        lines.append(
            f"| {r['variant']} | {r['forward_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | "
            f"{base['forward_ms'] / r['forward_ms']:.2f}x | {base['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x | "
            f"{err:.1e} |"
        )
    table = "\n".join(lines)
    if args.out:
        write_results(args.out, dict(meta=run_meta(args=vars(args)), rows=rows), table=table)
    print(table)


if __name__ == "__main__":
    main()
