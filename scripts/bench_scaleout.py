"""The scale-out campaign: how context, throughput and decoding scale from 1 to 8 GPUs.

    python scripts/bench_scaleout.py --out results/scaleout                       # every part
    python scripts/bench_scaleout.py --out results/scaleout --parts decode --gpus 2,4,8
    python scripts/bench_scaleout.py --out results/scaleout --report              # tables only

Each cell (a part on the first N GPUs of this host) runs the part's own script in a fresh
process that sees only those N devices, and leaves its results under --out:

- context: scripts/bench_max_context.py, the longest context whose training step compiles
  within each GPU's memory, for each --configs and --modes, with the sequence sharded over
  the N GPUs (mesh.sequence=N, the ring by default; --context_set adds settings such as
  mesh.context_parallel=all_gather). The search starts from half of N times the one-GPU
  result and bisects in units of 2 N chunks (the zigzag layout's). --verify confirms the
  longest by a real step. --context_together runs the cells of every GPU count at once
  instead (they only compile, so they can share the GPUs: minutes instead of tens of
  minutes), each from N x --context_start and without autotuning.
- throughput: scripts/bench_scaling.py --parts train, tokens/s per GPU of data, FSDP and
  sequence parallelism at each --tokens per GPU, against one GPU at the same tokens per
  GPU (the scaling efficiency).
- decode: scripts/bench_decode.py --parts tree, Tree against ring decoding with the cache
  sharded over the N GPUs, at each --decode_contexts.
- sample: scripts/bench_decode.py --parts sample --sample_sequence N, bpt.sample's prefill and
  decoding of --sample_config (random weights) with its cache sharded over the N GPUs.

A cell whose results exist is not run again, so an interrupted campaign resumes where it
stopped (--rerun_failed retries the cells that failed). The report (report.md, and
context.png, throughput.png and decode.png) is written after every cell and can be
rebuilt alone with --report. It ends with the scale-out targets: context >= 0.9 x N x one
GPU's, data-parallel efficiency >= 0.9 at 4 GPUs, Tree faster than ring at N >= 4.
Without GPUs the cells run on N simulated CPU devices (for tests).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchlib import human_tokens, parse_choices, script_parser

SCRIPTS = Path(__file__).resolve().parent
PARTS = ("context", "throughput", "decode", "sample")
SETUPS = ("data", "fsdp", "sequence (ring)", "sequence (all-gather)")


def _chosen_gpus() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES's GPUs, or None where it is not set."""
    chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if chosen is None:
        return None
    return [name.strip() for name in chosen.split(",") if name.strip() and name.strip() != "-1"]


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA names them, found without starting jax (which
    would claim their memory): CUDA_VISIBLE_DEVICES's list where it is set (so that
    campaigns can share a host, each on its own GPUs), else every GPU nvidia-smi lists."""
    if not shutil.which("nvidia-smi"):
        return []
    chosen = _chosen_gpus()
    if chosen is not None:
        return chosen
    listed = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True)
    count = sum(line.startswith("GPU ") for line in listed.stdout.splitlines()) if listed.returncode == 0 else 0
    return [str(i) for i in range(count)]


def gpu_count() -> int:
    """How many GPUs this process may use (visible_gpus)."""
    return len(visible_gpus())


def gpu_names(n: int) -> list[str]:
    """The CUDA names of the first n GPUs this process may use: CUDA_VISIBLE_DEVICES's, else
    0 .. n - 1 (no nvidia-smi asked)."""
    return (_chosen_gpus() or [str(i) for i in range(n)])[:n]


def device_env(n: int, on_gpu: bool, *, autotune: bool = True) -> dict:
    """The environment of a process that sees the first n devices (autotune=False: XLA picks
    its GPU kernels without trying them on the device, for processes that share it)."""
    env = dict(os.environ)
    if not autotune:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_gpu_autotune_level=0".strip()
    if on_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_names(n))
    else:
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_NUM_CPU_DEVICES"] = str(n)
    return env


def cell_path(out: Path, part: str, n: int) -> Path:
    return out / part / f"{n}gpu"


def done(path: Path) -> bool:
    return (path / "results.json").exists()


def failed(path: Path) -> bool:
    return (path / "failed.json").exists()


def cell_command(args, part: str, n: int, path: Path, one_gpu_context: dict) -> list[str]:
    """The script and arguments of one cell."""
    py = [sys.executable]
    if part == "context":
        command = py + [
            str(SCRIPTS / "bench_max_context.py"),
            f"--configs={args.configs}",
            f"--modes={args.modes}",
        ]
        command += [f"--chunks={args.chunk}", f"--stop={args.context_stop}", f"--out={path / 'results.json'}"]
        command += [f"--refine={args.context_refine}", f"--jobs={args.context_jobs}"]
        command += ["--set=mesh.data=1"] + ([f"--memory_gib={args.memory_gib}"] if args.memory_gib else [])
        granule = args.chunk
        if n > 1:
            granule = 2 * n * args.chunk
            command += [f"--set=mesh.sequence={n}", *(f"--set={s}" for s in args.context_set)]
        known = [v for v in one_gpu_context.values() if v]
        if args.context_together:  # every GPU count at once: no one-GPU result to start from
            start = n * args.context_start
        else:
            start = max(args.context_start, n * min(known) // 2) if n > 1 and known else args.context_start
        start = -(-start // granule) * granule
        command += [f"--start={start}", f"--granule={granule}"]
        if args.verify:
            command += ["--verify", f"--verify_max={args.verify_max}"] if args.verify_max else ["--verify"]
        return command
    if part == "throughput":
        setups = "1 GPU" if n == 1 else ",".join(SETUPS)
        return py + [
            str(SCRIPTS / "bench_scaling.py"),
            "--parts=train",
            f"--config={args.throughput_config}",
            f"--tokens={args.tokens}",
            f"--steps={args.steps}",
            f"--setups={setups}",
            f"--out={path}",
        ]
    if part == "sample":
        return py + [
            str(SCRIPTS / "bench_decode.py"),
            "--parts=sample",
            f"--sample_config={args.sample_config}",
            f"--sample_contexts={args.sample_contexts}",
            f"--new_tokens={args.new_tokens}",
            f"--prefill_chunk={args.prefill_chunk}",
            f"--sample_sequence={n}",
            f"--out={path}",
        ]
    return py + [
        str(SCRIPTS / "bench_decode.py"),
        "--parts=tree",
        f"--contexts={args.decode_contexts}",
        f"--heads={args.decode_heads}",
        f"--repeats={args.decode_repeats}",
        f"--out={path}",
    ]


def run_cell(args, part: str, n: int, on_gpu: bool) -> str:
    """Runs one cell unless its results exist; returns what happened."""
    path = cell_path(args.out, part, n)
    if done(path):
        return "done before"
    if failed(path) and not args.rerun_failed:
        return "failed before (--rerun_failed retries it)"
    path.mkdir(parents=True, exist_ok=True)
    (path / "failed.json").unlink(missing_ok=True)
    together = part == "context" and args.context_together  # the other cells still running
    summaries = {} if together else context_summaries(args.out)
    one_gpu = {setting: r["longest"] for setting, r in summaries.items() if r["gpus"] == 1}
    command = cell_command(args, part, n, path, one_gpu)
    start = time.time()
    with open(path / "log.txt", "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        try:
            proc = subprocess.run(
                command,
                env=device_env(n, on_gpu, autotune=not together),
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=args.cell_timeout or None,
                cwd=SCRIPTS.parent,
            )
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    seconds = time.time() - start
    if code != 0 or not done(path):
        (path / "failed.json").write_text(json.dumps({"exit": code, "seconds": seconds, "command": command}))
        (path / "results.json").unlink(missing_ok=True)
        return f"failed ({code}) after {seconds:.0f} s; see {path / 'log.txt'}"
    return f"ran in {seconds:.0f} s"


# --- the report ---------------------------------------------------------------------------------


def cell_rows(out: Path, part: str, key: str) -> list[dict]:
    """The rows under `key` of the part's cells that have results, each with its "gpus"."""
    rows = []
    for path in sorted((out / part).glob("*gpu")):
        if done(path):
            n = int(path.name.removesuffix("gpu"))
            rows += [dict(r, gpus=n) for r in json.loads((path / "results.json").read_text()).get(key, [])]
    return rows


def context_summaries(out: Path) -> dict:
    """{((config, mode), gpus): the search's summary} of the context cells."""
    rows = cell_rows(out, "context", "records")
    return {((r["config"], r["mode"]), r["gpus"]): r for r in rows if r.get("summary")}


def context_table(out: Path) -> tuple[str, list[str], list[dict]]:
    summaries = context_summaries(out)
    if not summaries:
        return "", [], []
    ns = sorted({n for _, n in summaries})
    lines = ["| config | mode | " + " | ".join(f"{n} GPU{'s' if n > 1 else ''}" for n in ns) + " |"]
    lines.append("|---|---|" + "---|" * len(ns))
    verdicts = []
    for config, mode in sorted({setting for setting, _ in summaries}):
        one = summaries.get(((config, mode), 1), {}).get("longest")
        row = []
        for n in ns:
            longest = summaries.get(((config, mode), n), {}).get("longest")
            text = human_tokens(longest)
            if longest and one and n > 1:
                text += f" ({longest / one:.2f}x, {longest / one / n:.2f} N)"
                verdict = "met" if longest >= 0.9 * n * one else "short of"
                verdicts.append(
                    f"- Context {Path(config).stem} {mode} on {n} GPUs: {longest / one / n:.2f} x N x "
                    f"one GPU's ({verdict} >= 0.9)"
                )
            row.append(text)
        lines.append(f"| {Path(config).stem} | {mode} | " + " | ".join(row) + " |")
    return "\n".join(lines), verdicts, list(summaries.values())


def throughput_table(out: Path) -> tuple[str, list[str], list[dict]]:
    rows = [r for r in cell_rows(out, "throughput", "train") if r.get("ok")]
    if not rows:
        return "", [], []
    one = {r["tokens_per_device"]: r["tokens_per_second_per_gpu"] for r in rows if r["setup"] == "1 GPU"}
    lines = [
        "| tokens / GPU | setup | GPUs | context | tokens/s/GPU | MFU | efficiency |",
        "|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for r in sorted(
        rows, key=lambda r: (r["tokens_per_device"], r["setup"] != "1 GPU", r["setup"], r["gpus"])
    ):
        base = one.get(r["tokens_per_device"])
        r["efficiency"] = r["tokens_per_second_per_gpu"] / base if base else None
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "–"
        eff = f"{r['efficiency']:.3f}" if r["efficiency"] is not None else "–"
        tokens = human_tokens(r["tokens_per_device"])
        lines.append(
            f"| {tokens} | {r['setup']} | {r['gpus']} | {human_tokens(r['seq_len'])} | "
            f"{r['tokens_per_second_per_gpu']:,.0f} | {mfu} | {eff} |"
        )
        if r["setup"] == "data" and r["gpus"] >= 4 and r["efficiency"] is not None:
            verdict = "met" if r["efficiency"] >= 0.9 else "short of"
            verdicts.append(
                f"- Data-parallel efficiency on {r['gpus']} GPUs at {tokens} tokens per GPU: "
                f"{r['efficiency']:.3f} ({verdict} >= 0.9)"
            )
    return "\n".join(lines), verdicts, rows


def decode_table(out: Path) -> tuple[str, list[str], list[dict]]:
    rows = cell_rows(out, "decode", "tree")
    if not rows:
        return "", [], []
    lines = ["| context | heads / KV heads | GPUs | local shard µs | tree µs | ring µs | ring / tree |"]
    lines.append("|---|---|---|---|---|---|---|")
    verdicts = []
    for r in sorted(rows, key=lambda r: (r["context"], r["heads"], r["gpus"])):
        t = r["times"]
        lines.append(
            f"| {human_tokens(r['context'])} | {r['heads']} | {r['gpus']} | {t['local shard'] * 1e6:,.0f} | "
            f"{t['tree'] * 1e6:,.0f} | {t['ring'] * 1e6:,.0f} | {r['ring_over_tree']:.2f} |"
        )
    for n in sorted({r["gpus"] for r in rows if r["gpus"] >= 4}):
        worst = min(r["ring_over_tree"] for r in rows if r["gpus"] == n)
        verdicts.append(
            f"- Tree against ring decoding on {n} GPUs: ring / tree >= {worst:.2f} at every context "
            f"({'met' if worst > 1 else 'short of'} > 1)"
        )
    return "\n".join(lines), verdicts, rows


def sample_table(out: Path) -> str:
    rows = cell_rows(out, "sample", "sample")
    if not rows:
        return ""
    lines = ["| context | GPUs | prefill s | decode tokens/s | ms / token | peak GiB (GPU 0) |"]
    lines.append("|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["context"], r["gpus"])):
        if "error" in r:
            lines.append(f"| {human_tokens(r['context'])} | {r['gpus']} | {r['error'][:80]} | | | |")
            continue
        lines.append(
            f"| {human_tokens(r['context'])} | {r['gpus']} | {r['prefill_s']:.1f} | "
            f"{r['tokens_per_s']:.1f} | {r['ms_per_token']:.1f} | {r['peak_gib']:.1f} |"
        )
    return "\n".join(lines)


def series(rows: list[dict], key, y: str, label) -> list[tuple]:
    """[(label, [(gpus, y)...], style)] a line per value of key(row)."""
    lines = {}
    for r in rows:
        if r.get(y):  # a search that found nothing (0), or no one-GPU baseline (None): no point
            lines.setdefault(key(r), []).append((r["gpus"], r[y]))
    return [(label(k), pts, "o-") for k, pts in sorted(lines.items())]


def plot(path: Path, lines: list[tuple], *, hline: float | None = None, **axes) -> None:
    """One figure of lines against the GPU count: lines [(label, [(gpus, y)...], style)]."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pts, style in lines:
        ax.plot(*zip(*sorted(pts)), style, label=label, **({"color": "gray"} if style == ":" else {}))
    if hline is not None:
        ax.axhline(hline, color="gray", linestyle=":")
    ax.set(xlabel="GPUs", **axes)
    counts = sorted({n for _, pts, _ in lines for n, _ in pts})
    ax.set_xticks(counts, [str(n) for n in counts])  # the GPU counts, also on a log axis
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plots(out: Path, context: list[dict], throughput: list[dict], decode: list[dict]) -> None:
    if context:
        lines = series(context, lambda r: (Path(r["config"]).stem, r["mode"]), "longest", " ".join)
        ns = sorted({r["gpus"] for r in context})
        ideal = [r["longest"] for r in context if r["gpus"] == 1 and r["longest"]]
        lines += [(None, [(n, n * one) for n in ns], ":") for one in ideal]
        title = "longest training context (dotted: N x one GPU's)"
        axes = dict(xscale="log", yscale="log", ylabel="longest context (tokens)", title=title)
        plot(out / "context.png", lines, **axes)
    if throughput:
        scaled = [r for r in throughput if r["setup"] != "1 GPU"]
        key = lambda r: (r["setup"], r["tokens_per_device"])  # noqa: E731
        lines = series(scaled, key, "efficiency", lambda k: f"{k[0]}, {human_tokens(k[1])}/GPU")
        axes = dict(ylabel="tokens/s per GPU / one GPU's", title="scaling efficiency")
        plot(out / "throughput.png", lines, hline=0.9, **axes)
    if decode:
        key = lambda r: (r["context"], r["heads"])  # noqa: E731
        lines = series(decode, key, "ring_over_tree", lambda k: f"{human_tokens(k[0])}, {k[1]}")
        axes = dict(ylabel="ring time / tree time", title="Tree against ring decoding")
        plot(out / "decode.png", lines, hline=1.0, **axes)


def report(out: Path) -> str:
    """report.md (and the plots) from every cell with results; returns the markdown."""
    context, context_verdicts, context_rows = context_table(out)
    throughput, throughput_verdicts, throughput_rows = throughput_table(out)
    decode, decode_verdicts, decode_rows = decode_table(out)
    parts = []
    if context:
        parts += ["Longest training context by compiled memory (ratio to one GPU; per N)", "", context, ""]
    if throughput:
        parts += ["Training tokens/s per GPU (efficiency: against one GPU at the same tokens per GPU)", ""]
        parts += [throughput, ""]
    if decode:
        parts += ["Decoding with the cache sharded over the GPUs, batch 1", "", decode, ""]
    sample = sample_table(out)
    if sample:
        parts += ["Sampling through bpt.sample with the cache sharded over the GPUs (random weights)", ""]
        parts += [sample, ""]
    verdicts = context_verdicts + throughput_verdicts + decode_verdicts
    if verdicts:
        parts += ["Targets:", "", *verdicts, ""]
    failures = sorted(str(p.parent.relative_to(out)) for p in out.glob("*/*gpu/failed.json"))
    if failures:
        parts += ["Failed cells: " + ", ".join(failures), ""]
    text = "\n".join(parts)
    (out / "report.md").write_text(text)
    plots(out, context_rows, throughput_rows, decode_rows)
    return text


def main() -> None:
    parser = script_parser(__doc__, out_help="the campaign's folder (resumed if it exists); required")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated: {', '.join(PARTS)}")
    parser.add_argument("--gpus", default="1,2,4,8", help="GPU counts; those above the host's are skipped")
    parser.add_argument("--cpu_devices", type=int, default=8, help="simulated devices without GPUs")
    parser.add_argument("--configs", default="configs/gpt_1b.py", help="context: model configs")
    parser.add_argument(
        "--modes", default="blockwise_parallel,memory_efficient", help="context: attention modes"
    )
    parser.add_argument("--chunk", type=int, default=1024, help="context: query, key/value and loss chunk")
    parser.add_argument("--context_start", type=int, default=65536)
    parser.add_argument("--context_stop", type=int, default=1 << 24)
    parser.add_argument(
        "--context_refine",
        type=int,
        default=8,
        help="context: bisect in steps of 1/refine (bench_max_context)",
    )
    parser.add_argument(
        "--context_jobs", type=int, default=1, help="context: searches at once (one per config and mode)"
    )
    parser.add_argument(
        "--context_set", action="append", default=[], help="context: extra section.name=value"
    )
    parser.add_argument(
        "--memory_gib", type=float, default=0.0, help="context: budget a device (0: its limit)"
    )
    parser.add_argument(
        "--context_together",
        action="store_true",
        help="context: search on every GPU count at once (compiling shares the GPUs; each search starts "
        "at N x --context_start and compiles without autotuning; not with --verify)",
    )
    parser.add_argument("--verify", action="store_true", help="context: confirm the longest by a real step")
    parser.add_argument("--verify_max", type=int, default=0)
    parser.add_argument("--throughput_config", default="configs/gpt_1b.py")
    parser.add_argument("--tokens", default="16384,65536", help="throughput: tokens per GPU")
    parser.add_argument("--steps", type=int, default=2, help="throughput: timed steps")
    parser.add_argument("--decode_contexts", default="262144,1048576,4194304")
    parser.add_argument("--decode_heads", default="16/16,32/8")
    parser.add_argument("--decode_repeats", type=int, default=10)
    parser.add_argument("--sample_config", default="configs/gpt_1b.py")
    parser.add_argument("--sample_contexts", default="1048576", help="sample: cache lengths")
    parser.add_argument("--new_tokens", type=int, default=64, help="sample: tokens decoded")
    parser.add_argument("--prefill_chunk", type=int, default=4096, help="sample: prompt chunk")
    parser.add_argument("--cell_timeout", type=float, default=0, help="seconds a cell may run (0: no limit)")
    parser.add_argument("--rerun_failed", action="store_true")
    parser.add_argument(
        "--report", action="store_true", help="only rebuild the report from the cells' results"
    )
    args = parser.parse_args()
    if not args.out:
        parser.error("--out (the campaign's folder) is required")
    args.out = Path(args.out)
    parts = parse_choices(parser, args.parts, PARTS, "part")
    if args.context_together and args.verify:
        parser.error(
            "--context_together compiles only; --verify runs real steps, which cannot share the GPUs"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        gpus = gpu_count()
        on_gpu = gpus > 0
        available = gpus or args.cpu_devices
        counts = sorted({int(n) for n in args.gpus.split(",")})
        skipped = [n for n in counts if n > available]
        counts = [n for n in counts if n <= available]
        print(
            f"{'GPUs' if on_gpu else 'CPU devices'}: {available}; cells on {counts}"
            + (f" (skipped {skipped})" if skipped else "")
        )
        cells = [(part, n) for part in parts for n in counts if not (part == "decode" and n == 1)]
        together = [cell for cell in cells if cell[0] == "context"] if args.context_together else []
        if together:
            cells = [cell for cell in cells if cell[0] != "context"]
            print(f"context on {', '.join(str(n) for _, n in together)} devices at once ...", flush=True)
            with concurrent.futures.ThreadPoolExecutor(len(together)) as pool:
                runs = {pool.submit(run_cell, args, part, n, on_gpu): n for part, n in together}
                for run in concurrent.futures.as_completed(runs):
                    print(f"context on {runs[run]}: {run.result()}", flush=True)
            report(args.out)
        for i, (part, n) in enumerate(cells, 1):
            print(f"[{i}/{len(cells)}] {part} on {n} device{'s' if n > 1 else ''} ...", flush=True)
            print(f"[{i}/{len(cells)}] {part} on {n}: {run_cell(args, part, n, on_gpu)}", flush=True)
            report(args.out)
    print(report(args.out))


if __name__ == "__main__":
    main()
