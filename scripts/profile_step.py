"""Where a training step's time goes: a profile of real steps, summed by kernel.

    python scripts/profile_step.py --config configs/flash_125m.py --seq_len 8192 --batch 8
    python scripts/profile_step.py --config configs/gpt_125m.py --seq_len 8192 --batch 8 \\
        --set model.remat_layer=dots_saveable --out results/profile_gpt
    python scripts/profile_step.py --config configs/gpt_1b.py --seq_len 8192 --fusions 15

Runs --warmup steps, then --steps steps under jax.profiler, and sums the device's kernel
time by the XLA operation each kernel belongs to (its fusion or custom call) and by kind
(matmul, attention kernel, fusion, copy, collective). With a mesh (--set mesh.sequence=4, ...)
each figure is one device's average, and each device's kernel total is printed too.
Kernels of different streams (a collective beside a matmul) are summed, so the kernel
time can pass the step's; each device's timeline line says how much of its window some kernel
ran (busy), how much none did (idle: the gaps) and how much ran beside another (overlapped),
and with collectives how long they ran and how much of that with no other kernel beside them
(the transfers the step waits for). Over several devices, each collective call's durations
are split into the transfer (its shortest duration: the device that came last) and each
device's wait for a later one, with how often each device was the last. The trace itself
(for Perfetto or TensorBoard) stays under --out. Prints the step time and the --top
operations as a markdown table last; --out also gets profile.json. --fusions N adds what
the N slowest elementwise and norm fusions compute (their opcodes) and the bandwidth they
reach; --matmuls N the N slowest matmuls (cuBLAS's calls, XLA's Triton GEMMs) with the
TFLOP/s each ran at, against --peak_tflops (the GEMM ceiling scripts/bench_gemm.py measures:
its sustained rows, where the card sits at its power limit as the step does).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import math
import os
import re
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
# Kernels launched from CUDA graphs would all be charged to their graph: launch them one by
# one, so that each kernel keeps its own operation's name (this costs some launch overhead).
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="

from benchlib import benchmark_config, run_meta, script_parser  # noqa: E402

KINDS = (  # (kind, a pattern of kernel names), the first match wins
    ("norm kernel", r"layer_norm|rms_norm"),  # bpt's (bpt_layer_norm_fwd, ...), before pallas
    ("matmul", r"gemm|nvjet|cutlass|cublas|sm\d+_xmma|wgmma|dot"),
    ("attention kernel", r"flash|attention|mosaic|pallas|triton"),
    ("collective", r"nccl|all_reduce|all_gather|reduce_scatter|collective|permute"),
    ("copy", r"memcpy|memset|copy|transpose"),
    ("fusion", r"fusion|loop_|input_|reduce"),
)


PARTS = (  # what a language model's step spends its time on (part_of)
    "attention forward",
    "attention backward",
    "dense matmuls",
    "LM head and loss",
    "optimizer and gradient sums",
    "collectives",
    "copies",
    "elementwise and norms",
)


def part_of(op: dict, *, vocab_sizes=(), param_shapes=()) -> str:
    """The part of the step one profiled operation (a row of summarize's ops) belongs to:
    norm kernels (bpt's LayerNorm, a pallas_call like attention's) with the elementwise ops;
    attention kernels (cuDNN's or Pallas') forward or backward; anything with a vocabulary
    dimension (the LM head's matmuls, the loss); whole-parameter updates run once a step
    (param_shapes: 'f32[24,2048,8192]', ...); then by kernel kind."""
    text = f"{op['op']} {op['hlo']} {op['kernel']}".lower()
    if kind_of(op["kernel"]) == "norm kernel":
        return "elementwise and norms"
    if re.search(r"attention|fmha|flash|mosaic|pallas|gau_", text):
        # bpt's backward kernels: bpt_flash_hopper_dkdvdq_..., _dkdv_kernel, _dq_kernel
        return "attention backward" if re.search(r"bwd|backward|dkdv|_dq|_dkv", text) else "attention forward"
    if re.search(r"nccl|all-reduce|all_reduce|all-gather|all_gather|reduce-scatter|collective-permute", text):
        return "collectives"
    if any(re.search(rf"[\[,]{v}[\],]", op["hlo"]) for v in vocab_sizes):
        return "LM head and loss"
    if op["calls"] <= 1 and any(shape in op["hlo"] for shape in param_shapes):
        return "optimizer and gradient sums"
    kind = kind_of(f"{op['kernel']} {op['op']} {op['hlo']}")
    return {"matmul": "dense matmuls", "copy": "copies"}.get(kind, "elementwise and norms")


def by_part(ops: list[dict], **known) -> dict[str, float]:
    """Milliseconds a step per part (PARTS order; parts with no operation left out)."""
    totals = collections.Counter()
    for op in ops:
        totals[part_of(op, **known)] += op["ms"]
    return {part: totals[part] for part in PARTS if part in totals}


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, lowered):
            return kind
    return "other"


def device_events(trace_dir: str) -> list[dict]:
    """The complete ('X') events of the device's processes in the Perfetto trace."""
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(max(paths, key=os.path.getmtime)) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {
        e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    devices = {pid for pid, name in names.items() if "/device:" in name}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in devices and "dur" in e]


HLO_LINE = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|[^\s(]+?)(?:\{[^}]*\})? (\w[\w-]*)\(")


def hlo_shapes(text: str) -> dict[str, str]:
    """{instruction name: 'shape opcode'} of an HLO module's text: what each profiled
    operation computes (a fusion's output shape, a custom call's target)."""
    shapes = {}
    for line in text.splitlines():
        m = HLO_LINE.match(line)
        if m:
            name, shape, opcode = m.groups()
            target = re.search(r'custom_call_target="([^"]+)"', line)
            kind = re.search(r"kind=(k\w+)", line)
            shapes[name] = f"{shape} {target.group(1) if target else (kind.group(1) if kind else opcode)}"
    return shapes


BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2,
         "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
ARRAY = re.compile(r"\b(" + "|".join(BYTES) + r")\[([\d,]*)\]")
COMPUTATION = re.compile(r"^\s*%?([\w.\-]+) \((.*)\) -> (.+) \{\s*$")
NOT_COMPUTED = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast")


def shape_bytes(text: str) -> int:
    """Bytes of every array shape written in `text` (a shape, a tuple, a parameter list)."""
    return sum(BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in ARRAY.findall(text))


def fusion_contents(text: str) -> dict[str, dict]:
    """{fusion instruction: {"ops": {opcode: count}, "bytes": its operands' and result's}} of
    an HLO module's text: what each fusion computes (the opcodes of the computation it
    calls, less NOT_COMPUTED) and an upper bound on the bytes one call moves (an operand
    it only slices counts whole)."""
    bodies, calls, current = {}, {}, None
    for line in text.splitlines():
        if m := COMPUTATION.match(line):
            current = m.group(1)
            signature = m.group(2) + " " + m.group(3)  # the parameters and the result
            bodies[current] = {"ops": collections.Counter(), "bytes": shape_bytes(signature)}
        elif line.strip() == "}":
            current = None
        elif ins := HLO_LINE.match(line):
            opcode = ins.group(3)
            if opcode == "fusion" and (called := re.search(r"calls=%?([\w.\-]+)", line)):
                calls[ins.group(1)] = called.group(1)
            if current is not None and opcode not in NOT_COMPUTED:
                bodies[current]["ops"][opcode] += 1
    return {name: bodies[c] for name, c in calls.items() if c in bodies}


MATMUL_TARGET = re.compile(r"matmul|gemm", re.I)  # cuBLAS's custom calls (__cublas$lt$matmul, __cublas$gemm)
CONTRACTING = re.compile(r'lhs_contracting_dim(?:s=\{([\d,]*)\}|ensions":\[([^\]]*)\])')


def _dims(shape: str) -> list[int]:
    m = ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def matmul_flops(text: str) -> dict[str, float]:
    """{operation: FLOPs a call} of an HLO module's text for its matmuls: a dot, a cuBLAS
    custom call, or a fusion whose computation holds dots (XLA's Triton GEMMs): 2 x the
    output's elements x the contracted length of the left operand."""
    shapes, own, per_body, calls, current = {}, {}, collections.Counter(), {}, None
    for line in text.splitlines():
        if m := COMPUTATION.match(line):
            current = m.group(1)
            for name, shape in re.findall(r"([\w.\-]+): ([^,()]+(?:\[[\d,]*\])?)", m.group(2)):
                shapes[name] = shape
            continue
        if line.strip() == "}":
            current = None
            continue
        ins = HLO_LINE.match(line)
        if not ins:
            continue
        name, shape, opcode = ins.groups()
        shapes[name] = shape
        if opcode == "fusion" and (called := re.search(r"calls=%?([\w.\-]+)", line)):
            calls[name] = called.group(1)
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if opcode != "dot" and not (opcode == "custom-call" and target and MATMUL_TARGET.search(target.group(1))):
            continue
        args = line[ins.end():]
        lhs = ARRAY.match(args.lstrip())  # the operand's shape where the text prints it
        lhs_dims = _dims(lhs.group(0)) if lhs else _dims(shapes.get(re.match(r"\s*%?([\w.\-]+)", args).group(1), ""))
        contracting = CONTRACTING.search(line)
        if not (contracting and lhs_dims):
            continue
        axes = [int(a.strip('" ')) for a in (contracting.group(1) or contracting.group(2) or "").split(",") if a.strip('" ')]
        flops = 2.0 * math.prod(_dims(shape)) * math.prod(lhs_dims[a] for a in axes)
        own[name] = flops
        if current is not None:
            per_body[current] += flops
    own.update({name: per_body[c] for name, c in calls.items() if per_body.get(c)})
    return own


def matmuls_table(ops: list[dict], flops: dict[str, float], top: int, peak_tflops: float | None = None) -> str:
    """The `top` slowest matmul operations: milliseconds a step, runs, GFLOP a run and the
    TFLOP/s they ran at (against peak_tflops, the ceiling the step's GEMMs could reach), and
    a last line over every matmul the profile holds: their time, and what it would be at the
    ceiling."""
    head = "| operation | ms a step | runs | GFLOP a run | TFLOP/s | of the ceiling | computes |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    rows = [op for op in ops if op["op"] in flops and op["ms"] > 0]

    def rate(f, ms):
        return f / (ms * 1e9)

    for op in rows[:top]:
        f = flops[op["op"]] * op.get("runs", op["calls"])
        share = f"{rate(f, op['ms']) / peak_tflops:.0%}" if peak_tflops else ""
        lines.append(
            f"| {op['op'][:40]} | {op['ms']:.2f} | {op.get('runs', op['calls']):g} | {flops[op['op']] / 1e9:.1f} | "
            f"{rate(f, op['ms']):.0f} | {share} | {op['hlo'][:60]} |"
        )
    ms = sum(op["ms"] for op in rows)
    total = sum(flops[op["op"]] * op.get("runs", op["calls"]) for op in rows)
    if ms:
        saved = f"; at {peak_tflops:g} TFLOP/s they would take {total / (peak_tflops * 1e9):.1f} ms" if peak_tflops else ""
        lines.append(f"\nall {len(rows)} matmul operations: {ms:.1f} ms a step at {rate(total, ms):.0f} TFLOP/s{saved}")
    return "\n".join(lines)


def fusions_table(ops: list[dict], fusions: dict[str, dict], top: int, **known) -> str:
    """The `top` slowest operations of the "elementwise and norms" part: milliseconds a step,
    launches, the bandwidth their bytes imply (an upper bound) and what each computes, to
    see which fusions XLA formed (a norm with its residual add, a bias with its GELU)."""
    lines = ["| operation | ms a step | calls | GB/s (bound) | computes |", "|---|---|---|---|---|"]
    rows = [op for op in ops if part_of(op, **known) == "elementwise and norms"][:top]
    for op in rows:
        f = fusions.get(op["op"], {"ops": {}, "bytes": 0})
        gbs = f["bytes"] * op["calls"] / (op["ms"] * 1e6) if op["ms"] else 0.0
        counts = sorted(f["ops"].items(), key=lambda kv: -kv[1])
        what = " ".join(f"{k}x{n}" if n > 1 else k for k, n in counts)
        lines.append(f"| {op['op'][:40]} | {op['ms']:.2f} | {op['calls']:g} | {gbs:.0f} | {what[:90]} |")
    return "\n".join(lines)


def operation(e: dict) -> str:
    """The XLA operation a kernel event belongs to (its fusion or custom call), else the
    kernel's own name."""
    op = e.get("args", {}).get("hlo_op") or e["name"]
    return e["name"] if op.startswith("command_buffer") else op


def is_collective(e: dict) -> bool:
    return kind_of(f"{e['name']} {operation(e)}") == "collective"


MEMSET = re.compile(r"^memset", re.I)


def summarize(events: list[dict], steps: int, shapes: dict[str, str] | None = None) -> dict:
    """Kernel time per step (ms), by operation and by kind; an operation's calls count its
    kernels, its runs those that are not memsets (a cuBLAS call's two kernels are one run)."""
    by_op: dict[str, dict] = collections.defaultdict(lambda: {"ms": 0.0, "calls": 0, "runs": 0, "kernels": set()})
    by_kind: dict[str, float] = collections.Counter()
    for e in events:
        op = operation(e)
        ms = e["dur"] / 1e3 / steps
        entry = by_op[op]
        entry["ms"] += ms
        entry["calls"] += 1
        entry["runs"] += not MEMSET.search(e["name"])  # cuBLAS's calls launch a memset first
        entry["kernels"].add(e["name"])
        by_kind[kind_of(e["name"] + " " + op)] += ms
    ops = sorted(
        (
            {
                "op": op,
                "ms": v["ms"],
                "calls": v["calls"] / steps,
                "runs": v["runs"] / steps,
                "kernel": sorted(v["kernels"])[0],
                "hlo": (shapes or {}).get(op, ""),
            }
            for op, v in by_op.items()
        ),
        key=lambda r: -r["ms"],
    )
    return {"kernel_ms_per_step": sum(by_kind.values()), "by_kind": dict(by_kind), "ops": ops}


def _union(spans) -> list[tuple[float, float]]:
    """The time some span covers, as sorted disjoint intervals."""
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(xs, ys) -> float:
    """The length of the time two lists of sorted disjoint intervals share."""
    shared, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        shared += max(0.0, min(xs[i][1], ys[j][1]) - max(xs[i][0], ys[j][0]))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return shared


def timeline(events: list[dict], steps: int) -> dict[str, float]:
    """One device's profiled window, a step's share of it (ms): span (first kernel's start to
    last kernel's end), busy (the time any kernel runs, streams together), idle (span - busy:
    gaps where the device waits, on the host, a launch or a transfer) and overlapped (kernel
    time beyond busy: kernels of two streams at once, a collective beside a matmul). With
    collectives: the time some collective runs (collective_ms), and how much of it no other
    kernel runs beside (collective_alone_ms: the transfers the step waits for)."""
    timed = [e for e in events if "ts" in e]
    if not timed:
        return {}
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in timed]
    busy = _union(spans)
    span, busy_us = busy[-1][1] - busy[0][0], _length(busy)
    per = lambda us: us / 1e3 / steps  # noqa: E731
    result = {
        "span_ms": per(span),
        "busy_ms": per(busy_us),
        "idle_ms": per(span - busy_us),
        "overlapped_ms": per(sum(b - a for a, b in spans) - busy_us),
    }
    collective = [is_collective(e) for e in timed]
    collectives = _union(x for x, c in zip(spans, collective) if c)
    if collectives:
        others = _union(x for x, c in zip(spans, collective) if not c)
        result["collective_ms"] = per(_length(collectives))
        result["collective_alone_ms"] = per(_length(collectives) - _intersection(collectives, others))
    return result


def collective_waits(events_by_device: list[list[dict]], steps: int) -> dict:
    """How much of the devices' collective time is waiting. A collective's n-th call ends on
    every device once the slowest has joined, so of its durations the shortest is about the
    transfer itself (the device that came last waits for no one) and the rest is each other
    device's wait. Calls are matched by operation and order. Per step (ms): transfer_ms, the
    shortest durations summed; wait_ms, each device's durations beyond the shortest; last,
    how often each device was the one the rest waited for (calls a step)."""
    calls = []  # per device: {operation: [durations in order]}
    for events in events_by_device:
        by_op = collections.defaultdict(list)
        for e in sorted(events, key=lambda e: e.get("ts", 0)):
            if is_collective(e):
                by_op[operation(e)].append(e["dur"])
        calls.append(by_op)
    n = len(calls)
    transfer, wait, last = 0.0, [0.0] * n, [0] * n
    for op in set().union(*calls) if calls else ():
        for durs in zip(*(c.get(op, []) for c in calls)):
            shortest = min(durs)
            transfer += shortest
            last[durs.index(shortest)] += 1
            for d, dur in enumerate(durs):
                wait[d] += dur - shortest
    per = lambda us: us / 1e3 / steps  # noqa: E731
    return {"transfer_ms": per(transfer), "wait_ms": [per(w) for w in wait], "last": [x / steps for x in last]}


def main() -> None:
    p = script_parser(__doc__, out_help="a folder for the trace and the report", settings=True)
    p.add_argument("--config", required=True)
    p.add_argument("--seq_len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument(
        "--fusions", type=int, default=0, help="also list the N slowest elementwise/norm fusions' contents"
    )
    p.add_argument("--matmuls", type=int, default=0, help="also list the N slowest matmuls' TFLOP/s")
    p.add_argument(
        "--peak_tflops",
        type=float,
        default=None,
        help="the GEMM ceiling the --matmuls table compares against (TFLOP/s; scripts/bench_gemm.py measures it)",
    )
    args = p.parse_args()

    import jax

    from bpt.train.probe import TrainingStep

    config = benchmark_config(args.config, seq_len=args.seq_len, batch_size=args.batch, overrides=args.set)
    step = TrainingStep(config)
    compiled = step.compiled()
    state = step.init(jax.random.PRNGKey(0))
    batch = step.batch(jax.random.PRNGKey(1))
    for i in range(args.warmup):
        state, metrics = compiled(state, batch, jax.random.PRNGKey(i))
    jax.block_until_ready(metrics)
    trace_dir = os.path.join(args.out, "trace") if args.out else tempfile.mkdtemp(prefix="bpt_profile_")
    start = time.perf_counter()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for i in range(args.steps):
            state, metrics = compiled(state, batch, jax.random.PRNGKey(100 + i))
        jax.block_until_ready(metrics)
    seconds = (time.perf_counter() - start) / args.steps  # with the profiler's own overhead
    hlo = compiled.as_text()
    events = device_events(trace_dir)
    # On several devices every figure is one device's average; the per-device totals show
    # whether the work is balanced.
    by_device = collections.defaultdict(list)
    for e in events:
        by_device[e["pid"]].append(e)
    by_device = [by_device[pid] for pid in sorted(by_device)]
    summary = summarize(events, args.steps * max(1, len(by_device)), hlo_shapes(hlo))
    summary["devices"] = len(by_device)
    summary["timeline_by_device"] = [timeline(own, args.steps) for own in by_device]
    summary["kernel_ms_per_step_by_device"] = [sum(e["dur"] for e in own) / 1e3 / args.steps for own in by_device]
    if len(by_device) > 1:
        summary["collective_waits"] = collective_waits(by_device, args.steps)
    vocab = step.model.config.vocab_size
    known = dict(
        vocab_sizes={vocab, -(-vocab // 128) * 128},  # the chunked loss pads the head to 128s
        param_shapes={
            f"{x.dtype}[{','.join(map(str, x.shape))}]".replace("float32", "f32").replace("bfloat16", "bf16")
            for x in jax.tree.leaves(step.state_shapes.params)
            if x.ndim
        },
    )
    summary["by_part"] = by_part(summary["ops"], **known)
    result = dict(
        run_meta(config=args.config, seq_len=args.seq_len, batch=args.batch, overrides=args.set),
        remat_layer=step.config.model.remat_layer,
        scan_unroll=step.config.model.scan_unroll,
        step_seconds_profiled=seconds,
        trace_dir=trace_dir,
        **summary,
    )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "profile.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(args.out, "step.hlo.txt"), "w") as f:
            f.write(hlo)
    total = summary["kernel_ms_per_step"]
    print(
        f"\n{args.config} at {args.seq_len} x {args.batch} {' '.join(args.set)} (remat_layer {result['remat_layer']}, scan_unroll {result['scan_unroll']})"
    )
    print(f"step {seconds * 1e3:.1f} ms (profiled), kernels {total:.1f} ms a step")
    for i, t in enumerate(summary["timeline_by_device"]):
        if t:
            print(
                f"device {i}: {t['span_ms']:.1f} ms from first kernel to last, busy {t['busy_ms']:.1f}, "
                f"idle {t['idle_ms']:.1f} ({t['idle_ms'] / t['span_ms']:.1%}), overlapped {t['overlapped_ms']:.1f}"
                + (
                    f"; collectives {t['collective_ms']:.1f}, {t['collective_alone_ms']:.1f} of it with no other kernel"
                    if "collective_ms" in t
                    else ""
                )
            )
    if summary["devices"] > 1:
        by_device = ", ".join(f"{ms:.1f}" for ms in summary["kernel_ms_per_step_by_device"])
        print(
            f"{summary['devices']} devices, each figure one device's average; kernels by device: {by_device} ms"
        )
        w = summary["collective_waits"]
        if w["transfer_ms"] or any(w["wait_ms"]):
            print(
                f"collectives' transfers (each call's shortest duration) {w['transfer_ms']:.1f} ms a step; "
                "waits for a later device by device: "
                + ", ".join(f"{ms:.1f} ms (the last {k:g} times a step)" for ms, k in zip(w["wait_ms"], w["last"]))
            )
    print(
        "parts: "
        + ", ".join(f"{k} {v:.1f} ms ({v / total:.0%})" for k, v in summary["by_part"].items() if total)
    )
    print(
        "kinds: "
        + ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(summary["by_kind"].items(), key=lambda kv: -kv[1]))
    )
    print("\n| operation | ms a step | share | calls | computes | first kernel |")
    print("|---|---|---|---|---|---|")
    for r in summary["ops"][: args.top]:
        share = r["ms"] / total if total else 0.0
        print(
            f"| {r['op'][:40]} | {r['ms']:.2f} | {share:.1%} | {r['calls']:g} | {r['hlo'][:60]} | {r['kernel'][:40]} |"
        )
    if args.fusions:
        print(f"\nThe {args.fusions} slowest elementwise and norm operations:\n")
        print(fusions_table(summary["ops"], fusion_contents(hlo), args.fusions, **known))
    if args.matmuls:
        print(f"\nThe {args.matmuls} slowest matmuls:\n")
        print(matmuls_table(summary["ops"], matmul_flops(hlo), args.matmuls, args.peak_tflops))


if __name__ == "__main__":
    main()
