"""Settings against each other on one device, paired: each variant's training step compiled
once, then timed in alternating rounds in one process, so that the card's drift falls on
every variant alike (a GPU at its power limit moves a run by about a percent from one
round to the next; two runs in two processes, or on two starts of the card, differ by more
than most single settings are worth).

    python scripts/bench_paired.py --config configs/gpt_1b.py --seq_len 8192 --batch 4 \\
        --set train.grad_accum_steps=2 --set train.grad_accum_unroll=true \\
        --variant "defaults:" \\
        --variant "grid-order launch: model.attention_options=hopper_sort_window=0" --rounds 3

A variant is "name: setting; setting; ..." (section.name=value, as --set takes them; none:
the base config); --set applies to all of them first. Each round runs every variant's
step (--steps timed after --warmup, run_steps: the median step, tokens/s, MFU and, on a
GPU, the SM clock) in turn, the order reversed every other round. Prints each round's
rows, then a summary: each variant's mean tokens/s against the first variant's (the mean
of the rounds' ratios, and their range), compiled memory and the last loss (the variants
start from the same parameters and batch: a setting that leaves the function alone leaves
the loss alone). --out writes results.json and table.md.
"""

from __future__ import annotations

import statistics

from benchlib import (
    benchmark_config,
    check_stopped,
    run_meta,
    run_steps,
    script_parser,
    stop_on_sigterm,
    write_results,
)


def parse_variant(text: str) -> tuple[str, list[str]]:
    """'name: a.b=1; c.d=x' -> ('name', ['a.b=1', 'c.d=x'])."""
    name, sep, settings = text.partition(":")
    if not sep or not name.strip():
        raise SystemExit(f"--variant takes 'name: setting; setting' (settings may be none); got {text!r}")
    sets = [s.strip() for s in settings.split(";") if s.strip()]
    for s in sets:
        if "=" not in s:
            raise SystemExit(f"--variant {name.strip()!r}: {s!r} is not a section.name=value setting")
    return name.strip(), sets


def summary(rows: list[dict], names: list[str]) -> list[dict]:
    """Per variant: mean tokens/s and MFU over the rounds, and the ratio to the first
    variant's (the mean of each round's ratio, and the lowest and highest)."""
    by_round: dict[int, dict[str, dict]] = {}
    for r in rows:
        by_round.setdefault(r["round"], {})[r["variant"]] = r
    complete = [v for v in by_round.values() if all(n in v for n in names)]
    out = []
    for name in names:
        mine = [v[name] for v in complete]
        if not mine:
            continue
        ratios = [v[name]["tokens_per_second"] / v[names[0]]["tokens_per_second"] for v in complete]
        out.append(
            dict(
                variant=name,
                rounds=len(mine),
                tokens_per_second=statistics.mean(r["tokens_per_second"] for r in mine),
                mfu=statistics.mean(r["mfu"] for r in mine) if all(r["mfu"] for r in mine) else None,
                ratio=statistics.mean(ratios),
                ratio_low=min(ratios),
                ratio_high=max(ratios),
                compiled_gib=mine[0]["compiled_gib"],
                loss=mine[-1]["losses"][-1],
            )
        )
    return out


def tables(rows: list[dict], names: list[str], meta: dict) -> str:
    clock = any(r.get("sm_clock_mhz") for r in rows)
    lines = [f"{meta['device']}, jax {meta['jax']}: each round runs every variant in turn", ""]
    lines.append("| round | variant | tokens/s | MFU |" + (" SM clock (MHz) |" if clock else "") + " last loss |")
    lines.append("|---" * (5 + clock) + "|")
    for r in rows:
        mfu = f"{r['mfu']:.2%}" if r["mfu"] else "–"
        sm = f" {r['sm_clock_mhz']:.0f} |" if r.get("sm_clock_mhz") else (" – |" if clock else "")
        lines.append(
            f"| {r['round']} | {r['variant']} | {r['tokens_per_second']:,.0f} | {mfu} |{sm} {r['losses'][-1]:.4f} |"
        )
    lines += ["", f"| variant | rounds | tokens/s | MFU | against {names[0]} | by round | compiled GiB | last loss |"]
    lines.append("|---" * 8 + "|")
    for s in summary(rows, names):
        mfu = f"{s['mfu']:.2%}" if s["mfu"] else "–"
        spread = f"{s['ratio_low']:.4f}-{s['ratio_high']:.4f}"
        lines.append(
            f"| {s['variant']} | {s['rounds']} | {s['tokens_per_second']:,.0f} | {mfu} | {s['ratio']:.4f}x | "
            f"{spread} | {s['compiled_gib']:.2f} | {s['loss']:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = script_parser(__doc__, settings=True)
    p.add_argument("--config", default="configs/gpt_1b.py")
    p.add_argument("--seq_len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1, help="sequences a step (train.batch_size)")
    p.add_argument("--variant", action="append", default=[], help="'name: setting; setting' (repeatable, two or more)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="timed steps a round (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    variants = dict(parse_variant(v) for v in args.variant)
    if len(variants) < 2:
        p.error("give two or more --variant (distinct names), e.g. --variant 'defaults:' --variant 'b: model.x=1'")
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--rounds and --steps take 1 or more, --warmup 0 or more")

    from bpt.train.probe import TrainingStep

    stop_on_sigterm()
    meta = run_meta(variants=variants, seq_len=args.seq_len, batch=args.batch, overrides=args.set)
    names, steps = list(variants), {}
    for name, sets in variants.items():
        config = benchmark_config(args.config, seq_len=args.seq_len, batch_size=args.batch, overrides=[*args.set, *sets])
        steps[name] = TrainingStep(config)
        print(f"{name}: compiled, {steps[name].memory().peak / 2**30:.2f} GiB", flush=True)
    rows = []
    try:
        for rnd in range(args.rounds):
            for name in names if rnd % 2 == 0 else names[::-1]:
                check_stopped()
                step = steps[name]
                measured = run_steps(step, steps=args.steps, warmup=args.warmup)
                measured.pop("peak_bytes", None)
                rows.append(dict(round=rnd, variant=name, compiled_gib=step.memory().peak / 2**30, **measured))
                print({k: rows[-1][k] for k in ("round", "variant", "tokens_per_second", "mfu")}, flush=True)
    except KeyboardInterrupt:
        print("stopped; the rounds measured so far follow")
    text = tables(rows, names, meta)
    if args.out:
        write_results(args.out, {**meta, "rows": rows, "summary": summary(rows, names)}, table=text)
    print()
    print(text)


if __name__ == "__main__":
    main()
