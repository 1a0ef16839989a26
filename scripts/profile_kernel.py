"""Where the Hopper attention kernels' time goes, phase by phase, from inside the kernel.

    python scripts/profile_kernel.py                          # the fused backward, B1 S2K H16 d128
    python scripts/profile_kernel.py --seq 2048 --causal no --out /tmp/prof
    python scripts/profile_kernel.py --kernel forward --seq 16384 --segments 8   # packed documents

The kernels of bpt/ops/kernels/attention_hopper/ name their phases (jax.named_scope: the
backward's wait_Q, S, P, wait_dO, dV, dP, dS, share_dS, dK, dQ_wait_dS, dQ, dQ_store; the
forward's wait_Q, wait_K, S, softmax, wait_V, PV, pipelined, store). Under
attention_hopper.profiled() Mosaic GPU records each compute warpgroup's clock at the start and
end of every phase, in shared memory, and writes a Perfetto trace (open it in
ui.perfetto.dev). This script runs the kernel once that way, then sums each phase over the
warpgroups and prints a table: cycles per step, the share of the warpgroups' time, and
what lies between phases (barrier waits outside any phase, loop overhead). The profiler's
buffer lives in shared memory, so keep sweeps short (--seq 2048: at most 32 steps a CTA).
It also times the kernel unprofiled (the device's time a call: 20 calls back to back), and
prints a warpgroup's span (its first phase's start to its last one's end) against the
kernel's time a CTA slot (the call's cycles x SMs / CTAs): what lies outside is a CTA's
launch and teardown. The sum of the CTAs' spans packed onto the SMs gives the call's time
were they all it did (the rest: launches, prologues, SMs idle while the last CTAs finish);
with --segments the forward's segment_spans is timed as well, which its caller computes
before the kernel starts. A profiled call is slower than the kernel: at each CTA's end one thread copies
the whole trace buffer to global memory (about 0.2 us a range on an H200: 49 us a CTA at
--ranges 208), so the traces' gaps between CTAs are mostly that copy.
Registers: run it with MOSAIC_GPU_DUMP_PTXAS=1 and Mosaic GPU prints ptxas's report of each
kernel (registers and spills); MOSAIC_GPU_DUMP_TO=DIR keeps the PTX as well.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from benchlib import seconds_per_call

from bpt.ops.kernels import attention_hopper


def phases(trace_files: list[str]) -> tuple[dict, dict]:
    """({phase: [total cycles, count]}, {"span": cycles, "warpgroups": n}) over every
    warpgroup that recorded a phase of the kernel's (the memory warpgroup records none).
    Durations are in SM clock cycles (the profiler's timestamps are cycles, shown as
    nanoseconds / 1000)."""
    totals: dict = collections.defaultdict(lambda: [0.0, 0])
    spans = []
    for path in trace_files:
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        by_group = collections.defaultdict(list)
        for e in events:
            if e["name"] != "Init":  # Pallas's own scope around every warpgroup's prologue
                by_group[(e["pid"], e["tid"])].append(e)
        for evs in by_group.values():
            open_at: dict = {}
            for e in evs:
                if e["ph"] == "B":
                    open_at[e["name"]] = e["ts"]
                elif e["name"] in open_at:
                    cell = totals[e["name"]]
                    cell[0] += (e["ts"] - open_at.pop(e["name"])) * 1e3
                    cell[1] += 1
            spans.append((evs[-1]["ts"] - evs[0]["ts"]) * 1e3)
    whole = {"span": sum(spans), "warpgroups": len(spans)}
    if not spans:
        return dict(totals), whole | {"median_span": 0.0, "max_span": 0.0}
    return dict(totals), whole | {"median_span": statistics.median(spans), "max_span": max(spans)}


def table(totals: dict, whole: dict) -> str:
    steps = max(n for _, n in totals.values())
    inside = sum(t for t, _ in totals.values())
    lines = ["| phase | cycles a step | share of the warpgroups' time |", "|---|---|---|"]
    for name, (t, n) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| {name} | {t / n:.0f} | {100 * t / whole['span']:.1f}% |")
    outside = whole["span"] - inside
    lines.append(f"| (between phases) | {outside / steps:.0f} | {100 * outside / whole['span']:.1f}% |")
    lines.append(f"| all | {whole['span'] / steps:.0f} | 100% |")
    return "\n".join(lines)


def default_ranges(kernel: str, seq: int, head_dim: int) -> int:
    """Phases a warpgroup may record: the backward's 400 (its CTAs walk at most 32 query
    blocks at --seq 2048); the forward's five a key block (wait_K, S, softmax, wait_V, PV)
    over every key block of the sequence and one to spare, and 16 more (wait_Q, pipelined,
    store, Pallas's Init), so that a tile of a long document fits whatever the segment ids
    (five a block and three more ran out at 4K causal)."""
    if kernel == "backward":
        return 400
    return 6 * (seq // attention_hopper.forward_block_k(head_dim)) + 16


def cta_slot(ms: float, ctas: int) -> dict:
    """The call's time a CTA slot (ms x SMs / CTAs, one CTA an SM at a time) in SM cycles at
    the GPU's top SM clock (nvidia-smi's clocks.max.sm), or {} where either is unknown."""
    sms = getattr(jax.devices()[0], "core_count", None)
    try:
        query = ["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"]
        mhz = float(subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return {}
    if not sms or not ctas:
        return {}
    return dict(ctas=ctas, sms=sms, mhz=mhz, slot_cycles=ms * 1e-3 * mhz * 1e6 * sms / ctas)


def packed_ms(cycles: float, sms: int, mhz: float) -> float:
    """Milliseconds that `cycles` of CTA time take on `sms` SMs at `mhz`, one CTA an SM at a
    time and none idle: the call's time if its CTAs' spans were all it did."""
    return cycles / sms / (mhz * 1e3)


def main() -> tuple[dict, dict]:
    """Runs the profile; returns phases() of the profiled call's traces."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv_heads", type=int, default=None)
    ap.add_argument("--head_dim", type=int, default=128)
    ap.add_argument("--causal", choices=["yes", "no"], default="yes")
    ap.add_argument("--fused_dq", choices=["auto", "yes", "no"], default="auto")
    ap.add_argument("--kernel", choices=["backward", "forward"], default="backward")
    ap.add_argument("--segments", type=int, default=0, help="packed documents a sequence (segment ids)")
    ap.add_argument(
        "--ranges", type=int, default=None, help="phases a warpgroup may record (default: default_ranges)"
    )
    ap.add_argument("--out", default=None, help="where the traces go (default: a temporary directory)")
    args = ap.parse_args()
    if not attention_hopper.is_hopper():
        sys.exit("profile_kernel.py needs a Hopper GPU (the profiler records SM clocks)")

    causal = args.causal == "yes"
    b, s, h, d = args.batch, args.seq, args.heads, args.head_dim
    hk = args.kv_heads or h
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (b, s, h, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, hk, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, hk, d), jnp.bfloat16)
    do = jax.random.normal(keys[3], (b, s, h, d), jnp.bfloat16)
    scale = 1.0 / math.sqrt(d)
    seg = {}
    if args.segments > 1:
        from bench_attention import packed_segments

        ids = packed_segments(b, s, args.segments)
        seg = dict(q_seg=ids, kv_seg=ids)

    def fwd(q, k, v):
        return attention_hopper.forward(q, k, v, causal=causal, scale=scale, **seg)

    out, lse = jax.jit(fwd)(q, k, v)
    delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), do.astype(jnp.float32))
    fused = {"auto": None, "yes": True, "no": False}[args.fused_dq]

    def bwd(q, k, v, do, lse, delta):
        return attention_hopper.backward(
            q, k, v, do, lse, delta, causal=causal, scale=scale, fused_dq=fused, **seg
        )

    timed_spans = bool(seg) and args.kernel == "forward"
    if timed_spans:  # what the forward's caller computes from the ids before the kernel starts
        spans = functools.partial(
            attention_hopper.query_spans, block_k=attention_hopper.forward_block_k(d), causal=causal
        )
        ids = (seg["q_seg"], seg["kv_seg"])
        spans_ms = seconds_per_call(jax.jit(spans), *ids, repeats=20, timing="pipelined") * 1e3
    run, inputs = (bwd, (q, k, v, do, lse, delta)) if args.kernel == "backward" else (fwd, (q, k, v))
    ms = seconds_per_call(jax.jit(run), *inputs, repeats=20, timing="pipelined") * 1e3

    directory = args.out or tempfile.mkdtemp(prefix="bpt-kernel-profile-")
    os.makedirs(directory, exist_ok=True)
    before = set(glob.glob(os.path.join(directory, "*-trace.json")))
    ranges = args.ranges or default_ranges(args.kernel, s, d)
    try:
        with attention_hopper.profiled(directory, ranges):
            profiled = jax.jit(lambda *a: run(*a))  # traced anew, so the kernels see profiled()
            jax.block_until_ready(profiled(*inputs))
            jax.effects_barrier()  # the traces are written by a host callback: its error lands here
    except Exception as e:  # a RuntimeError, or the runtime's error that wraps the callback's
        if "Insufficient space" not in str(e):
            raise
        sys.exit(
            f"a warpgroup recorded more than --ranges {ranges} phases: "
            "raise --ranges, or profile a shorter --seq"
        )
    files = sorted(set(glob.glob(os.path.join(directory, "*-trace.json"))) - before)
    if not files:
        sys.exit(f"no trace was written to {directory}")

    totals, whole = phases(files)
    heads = f"H{h}" + (f"/KV{hk}" if hk != h else "")
    name = f"B{b} S{s} {heads} d{d} {'causal' if causal else 'non-causal'}"
    name += f" {args.segments} docs" if args.segments > 1 else ""
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: the Hopper {args.kernel}, {name}")
    print(f"unprofiled {ms:.3f} ms a call; traces in {directory} ({len(files)} kernel(s))")
    slot = cta_slot(ms, whole["warpgroups"] // attention_hopper.COMPUTE_WGS)
    print(json.dumps(dict(shape=name, kernel=args.kernel, ms=ms, phases=totals, **whole, **slot)))
    print(table(totals, whole))
    if slot:
        print(
            f"a warpgroup's span: {whole['median_span']:.0f} cycles (median), {whole['max_span']:.0f} "
            f"(longest); the call's time a CTA slot: {slot['slot_cycles']:.0f} cycles ({slot['ctas']} "
            f"CTAs on {slot['sms']} SMs at {slot['mhz']:.0f} MHz)"
        )
        busy = packed_ms(whole["span"] / attention_hopper.COMPUTE_WGS, slot["sms"], slot["mhz"])
        print(f"the CTAs' spans packed onto the SMs: {busy:.3f} ms of the call's {ms:.3f} ms")
    if timed_spans:
        print(f"the segment ids' spans (segment_spans, XLA, before the kernel): {spans_ms:.3f} ms")
    return totals, whole


if __name__ == "__main__":
    main()
