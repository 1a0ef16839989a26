"""Helpers the benchmark scripts share: the settings they sweep, configs set up for one
measurement, real training steps timed (run_steps, measure), the search for the longest
length that fits (longest_fitting), measuring subprocesses and how their results come back,
and table formatting. A config's step compiled from shapes (its memory, before anything is
allocated) is bpt.train.probe.TrainingStep, which bpt-train's remat auto-search uses too.

Each measurement that must own the device (a real step, whose peak-memory counter and
out-of-memory errors belong to it alone) runs in a fresh process through run_in_subprocess.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
from ml_collections import ConfigDict

from bpt.config import load_config_file, override
from bpt.models.lm import stack_unrolled
from bpt.train.metrics import peak_flops_per_device, peak_memory_bytes, train_flops_per_token
from bpt.train.probe import TrainingStep, is_out_of_memory

MODES = ("vanilla", "memory_efficient", "blockwise_parallel")  # model.attention_mode's values
# The paper's tables' columns, and MemoryEfficient with BPT's chunked loss between them, so
# that each part of BPT's saving is credited: the loss that never holds [seq, vocab] logits
# and the blockwise FFN (memory_efficient_chunked_loss: attention_mode memory_efficient with
# model.loss_impl=chunked).
TABLE_MODES = ("vanilla", "memory_efficient", "memory_efficient_chunked_loss", "blockwise_parallel")
MODE_SETTINGS = {"memory_efficient_chunked_loss": ("memory_efficient", ("model.loss_impl=chunked",))}
LABELS = {
    "vanilla": "Vanilla",
    "memory_efficient": "MemoryEfficient",
    "memory_efficient_chunked_loss": "MemoryEfficient + chunked loss",
    "blockwise_parallel": "BPT",
}
# Remat presets, as in the paper's appendix: name -> (remat_layer, remat_attention, remat_ffn).
REMATS = {
    "layer": ("nothing_saveable", "none", "nothing_saveable"),  # bpt's default
    "full": ("nothing_saveable", "nothing_saveable", "nothing_saveable"),
    "dots": ("dots_saveable", "none", "nothing_saveable"),
    # bpt's: the backward keeps attention's output and logsumexp (never re-runs its forward),
    # and with them the weight matmuls' outputs; auto takes the fastest that fits.
    "attention": ("attention_saveable", "none", "nothing_saveable"),
    "attention_dots": ("attention_and_dots_saveable", "none", "nothing_saveable"),
    "auto": ("auto", "none", "nothing_saveable"),
    "none": ("none", "none", "none"),
}
RESULT = "RESULT "  # the line prefix a measuring subprocess reports its result with


def benchmark_config(
    path: str,
    *,
    seq_len: int,
    batch_size: int = 1,
    grad_accum_steps: int = 1,
    mode: str = "",
    impl: str = "auto",
    chunk: int = 0,
    remat: str = "",
    dtype: str = "",
    overrides: Sequence[str] = (),
) -> ConfigDict:
    """A config file set up for one measurement. Empty or zero arguments keep the file's
    setting; vanilla attention always runs the reference (materialized) implementation.
    mode: an attention_mode, or a TABLE_MODES name that stands for one with more settings
    (MODE_SETTINGS). overrides ("model.remat_group=4", ...) apply last."""
    c = load_config_file(path)
    c.data.seq_len = seq_len
    c.train.batch_size = batch_size
    c.train.grad_accum_steps = grad_accum_steps
    if dtype:
        c.model.dtype = dtype
    mode, implied = MODE_SETTINGS.get(mode, (mode, ()))
    if mode:
        c.model.attention_mode = mode
    for setting in implied:
        override(c, setting)
    c.model.attention_impl = "reference" if c.model.attention_mode == "vanilla" else impl
    gpt = c.model.family != "flash"  # FLASH has no attention chunks or per-sublayer remat
    if chunk:
        c.model.loss_chunk_size = chunk
        if gpt:
            c.model.q_chunk_size = c.model.kv_chunk_size = chunk
    if remat:
        layer, attention, ffn = REMATS[remat]
        c.model.remat_layer = layer
        if gpt:
            c.model.remat_attention, c.model.remat_ffn = attention, ffn
    for setting in overrides:
        override(c, setting)
    return c


def report(result: dict) -> None:
    """Prints a measuring subprocess's result for run_in_subprocess to read."""
    print(RESULT + json.dumps(result), flush=True)


def console_script(name: str) -> list[str]:
    """The argv of one of bpt's console scripts (bpt-train, bpt-prepare-data, ...) beside this
    Python, or python -m bpt.cli.<module> where it is not installed there."""
    script = Path(sys.executable).parent / name
    module = name.removeprefix("bpt-").replace("-", "_")
    return [str(script)] if script.exists() else [sys.executable, "-m", f"bpt.cli.{module}"]


def run_in_subprocess(argv: Sequence[str], *, env: dict | None = None) -> dict:
    """Runs argv (a process that calls report) and returns its last result. A process that
    died without one (the OOM killer, a crash in the runtime) gives {"ok": False, "error"}.

    By default the process preallocates the device's memory pool (95% of the device unless
    XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise): grown on demand instead, the pool could
    not place a step's temporaries (one buffer of tens of GiB) beside the state at lengths
    whose compiled memory fits; preallocated, real peaks match the compiled ones
    (docs/notes/paper_tables.md). env replaces the whole environment."""
    if env is None:
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="true")
    proc = subprocess.run(list(argv), capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if lines:
        return json.loads(lines[-1][len(RESULT) :])
    tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:] or ["no output"]
    return {"ok": False, "error": " | ".join(tail)[-300:]}


def script_parser(
    doc: str,
    *,
    out: str = "",
    out_help: str = "where the results go (JSON)",
    png: bool = False,
    settings: bool = False,
    memory: bool = False,
) -> argparse.ArgumentParser:
    """The argument parser every script starts from: its docstring as the description, and
    the arguments the scripts share, named and explained once: --out (default `out`),
    --png (a plot), --set (config overrides, repeatable), --memory_gib (a memory budget)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=out, help=out_help)
    if png:
        parser.add_argument("--png", default="", help="a plot of the results (PNG)")
    if settings:
        parser.add_argument("--set", action="append", default=[], help="a config setting, section.name=value (repeatable)")
    if memory:
        parser.add_argument("--memory_gib", type=float, default=0.0, help="memory budget in GiB (0: the device's limit)")
    return parser


def write_results(out, results, *, table: str | None = None) -> None:
    """A script's results where --out says: one JSON file; with a table, a folder that holds
    results.json and table.md (the table the script prints last)."""
    out = Path(out)
    if table is None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(table.rstrip("\n") + "\n")


_STOPPED: dict = {"signal": None}  # the signal that stop_on_sigterm's handler took, once it came


def stop_on_sigterm() -> None:
    """From here on SIGTERM (what `timeout` and batch schedulers send) raises
    KeyboardInterrupt, as Ctrl-C does, so that a script cut short can still write and print
    what it measured. Python takes the signal between bytecodes: a running XLA compilation
    finishes first (give `timeout -k` the time it needs). The handler's raise can land in
    code that swallows it (a callback or finalizer the signal interrupted; one CPU run of
    bench_attention measured two more shapes after its SIGTERM): the signal is remembered
    too, and check_stopped() raises again in the measuring loops."""

    def stop(signum, frame):
        _STOPPED["signal"] = signum
        check_stopped()

    signal.signal(signal.SIGTERM, stop)


def check_stopped() -> None:
    """Raises KeyboardInterrupt if stop_on_sigterm's signal has come (again, where its first
    raise was swallowed)."""
    if _STOPPED["signal"] is not None:
        raise KeyboardInterrupt(f"stopped by signal {_STOPPED['signal']}")


def run_meta(**extra) -> dict:
    """What a benchmark's results are measured on: date, device, JAX version, command."""
    return {
        "date": datetime.date.today().isoformat(),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "command": "python " + " ".join(sys.argv),
        **extra,
    }


def parse_choices(parser, text: str, allowed, what: str) -> list[str]:
    """A comma-separated argument's items, each one of allowed (else parser.error)."""
    items = text.split(",")
    for item in items:
        if item not in allowed:
            parser.error(f"unknown {what} {item!r}; allowed: {', '.join(allowed)}")
    return items


def human_tokens(n: int) -> str:
    """16384 -> "16K"; 0 -> "–"."""
    if not n:
        return "–"
    return f"{n // 1024}K" if n % 1024 == 0 else (f"{n / 1024:.1f}K" if n > 1024 else str(n))


TIMINGS = ("pipelined", "synced")


def seconds_per_call(fn, *args, repeats: int = 10, warmup: int = 2, timing: str = "synced") -> float:
    """The time of one call of fn(*args) after `warmup` (compiling) calls.

    timing "synced": the median wall time of `repeats` calls, each waited for before the next
    starts (what one call costs a caller that needs its result: dispatch, the device's work
    and the wait). "pipelined": `repeats` calls enqueued back to back and waited for once,
    their wall time over `repeats`, the median of 5 such runs: the device's time a call, as
    a loop on the device (a decode step inside a jitted program) sees it, with the host's
    dispatch and the wait hidden behind the calls before it."""
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {', '.join(TIMINGS)}; got {timing!r}")
    for _ in range(warmup):
        check_stopped()
        jax.block_until_ready(fn(*args))
    times = []
    if timing == "synced":
        for _ in range(repeats):
            check_stopped()
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    for _ in range(5):
        check_stopped()
        start = time.perf_counter()
        outs = [fn(*args) for _ in range(repeats)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - start) / repeats)
        del outs
    return statistics.median(times)


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float32: a fast path's output against the reference's."""
    a, b = (jax.numpy.asarray(x, "float32") for x in (a, b))
    return float(jax.numpy.linalg.norm(a - b) / jax.numpy.linalg.norm(b))


def error_summary(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"


POWER_CAP = 0x4  # nvidia-smi's clocks_throttle_reasons: the clock held down by the power limit


class ClockSampler:
    """nvidia-smi's SM clock (MHz), power draw (W) and throttle reasons for every GPU, sampled
    every `every_ms` while it runs (a separate process); nothing where no nvidia-smi runs.
    A GEMM runs at the boost clock for a few calls and about 12% slower once a card sits at
    its power limit, the clock a quarter lower (scripts/bench_gemm.py): what a timing ran at
    is part of its result."""

    def __init__(self, every_ms: int = 50):
        self.proc = None
        if shutil.which("nvidia-smi") and jax.default_backend() == "gpu":
            query = "--query-gpu=index,clocks.sm,power.draw,clocks_throttle_reasons.active"
            cmd = ["nvidia-smi", query, "--format=csv,noheader,nounits", f"--loop-ms={every_ms}"]
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def stop(self) -> dict:
        """{sm_clock_mhz: the samples' median, max_power_w, power_capped: the share of samples
        the power limit held the clock down in, clock_samples}; {} without samples."""
        if self.proc is None:
            return {}
        self.proc.terminate()
        out, _ = self.proc.communicate()
        return summarize_clock_samples(out)


def summarize_clock_samples(text: str) -> dict:
    """ClockSampler.stop's summary of nvidia-smi's lines (index, MHz, W, reasons)."""
    clocks, power, capped = [], [], 0
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            clock, watts, reasons = float(parts[1]), float(parts[2]), int(parts[3], 16)
        except (IndexError, ValueError):
            continue  # a line cut short when the sampler stopped, or [N/A]
        clocks.append(clock)
        power.append(watts)
        capped += bool(reasons & POWER_CAP)
    if not clocks:
        return {}
    return {
        "sm_clock_mhz": statistics.median(clocks),
        "max_power_w": max(power),
        "power_capped": capped / len(clocks),
        "clock_samples": len(clocks),
    }


def run_steps(step: TrainingStep, steps: int = 3, *, warmup: int = 1) -> dict:
    """Runs warmup + steps real steps of step; raises what XLA raises when memory runs out.

    Returns the median step time, tokens/s, model TFLOP/s and MFU (over the mesh's devices,
    where their peak is known), the highest peak memory its devices report, the losses, and
    on GPUs the clock and power the timed steps ran at (ClockSampler).
    """
    compiled = step.compiled()  # before allocating: compilation (autotuning) needs memory too
    state = step.init(jax.random.PRNGKey(step.config.seed))
    batch = step.batch(jax.random.PRNGKey(1))
    times, losses, sampler = [], [], None
    try:
        for i in range(warmup + steps):
            if i == warmup:
                sampler = ClockSampler()
            start = time.perf_counter()
            state, metrics = compiled(state, batch, jax.random.PRNGKey(i))
            losses.append(float(metrics["loss"]))  # waits for the step
            times.append(time.perf_counter() - start)
    finally:  # a step that runs out of memory leaves no sampler behind
        clock = sampler.stop() if sampler else {}
    del state
    seconds = statistics.median(times[warmup:])
    devices = jax.local_devices()[: step.num_devices]
    flops = train_flops_per_token(step.model.config, step.shape[1]) * step.tokens_per_step / seconds
    peak = peak_flops_per_device(devices[0], step.config.train.peak_flops)
    peaks = [p for p in (peak_memory_bytes(d) for d in devices) if p is not None]
    return {
        "step_seconds": seconds,
        "tokens_per_second": step.tokens_per_step / seconds,
        "model_tflops": flops / 1e12,
        "mfu": flops / (peak * step.num_devices) if peak else None,
        "peak_bytes": max(peaks) if peaks else None,
        "losses": losses,
        "devices": step.num_devices,
        **clock,
    }


def measure(config: ConfigDict, *, steps: int = 1, warmup: int = 0, devices=None) -> dict:
    """Real steps of config's training step, as a result that never raises: ok with
    run_steps' numbers, compiled_gib and peak_gib (None where the backend keeps no count); or
    not ok with out_of_memory and the error (compiled_gib if it compiled)."""
    result = {}
    try:
        step = TrainingStep(config, devices=devices)
        result["remat_layer"] = step.config.model.remat_layer  # auto's choice, where asked
        result["unrolled"] = stack_unrolled(step.config.model)  # and model.auto_unroll's
        result["offloaded"] = bool(step.config.model.get("offload_layer_inputs", False))  # and auto_offload's
        if first := step.config.model.get("remat_first_layers", 0):  # auto_split's
            result["split"] = f"{step.config.model.remat_first} in {first} layers"
        result["compiled_gib"] = step.memory().peak / 2**30
        measured = run_steps(step, steps=steps, warmup=warmup)
    except Exception as e:  # reported, not raised: a sweep goes on past an out-of-memory
        return dict(result, ok=False, out_of_memory=is_out_of_memory(e), error=error_summary(e))
    peak = measured.pop("peak_bytes")
    return dict(result, ok=True, peak_gib=peak and peak / 2**30, **measured)


@dataclasses.dataclass
class Search:
    """The longest length that fits, and every length tried on the way ({length: fits})."""

    longest: int  # 0: not even the first length fits
    longest_power_of_two: int
    step: int  # the refinement step: the next length tried below `longest` would be this much less
    tried: dict[int, bool]


# What makes one length search's compile: its setting and the length it compiled.
COMPILE_KEYS = ("config", "mode", "chunk", "remat", "group", "seq_len")


def compile_records(text: str) -> dict[tuple, dict]:
    """The compile records among a length search's JSON lines (bench_max_context's output:
    a length and its verdict each), by COMPILE_KEYS, the first of each kept; other lines
    (tables, logs, summaries) are skipped."""
    found: dict[tuple, dict] = {}
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "seq_len" in record and "fits" in record:
            found.setdefault(tuple(record.get(k) for k in COMPILE_KEYS), record)
    return found


def longest_fitting(
    fits: Callable[[int], bool], *, start: int, stop: int, refine: int = 8, granule: int = 1
) -> Search:
    """The longest length in [start, stop] for which fits(length) holds, for a fits that is
    monotone (true up to some length, false beyond).

    Powers of two times start first (doubling); then the gap between the last length that fit
    and the first that did not is bisected in steps of 1/refine of the former (rounded up to
    a multiple of granule: every length tried is start times a power of two or such a
    multiple). Each length is tried once.
    """
    tried: dict[int, bool] = {}

    def check(length: int) -> bool:
        if length not in tried:
            tried[length] = bool(fits(length))
        return tried[length]

    if start > stop or not check(start):
        return Search(0, 0, 0, tried)
    low = start
    while 2 * low <= stop and check(2 * low):
        low *= 2
    power = low
    step = -(-max(low // refine, 1) // granule) * granule
    # The first length known not to fit, or the first step past stop.
    high = min(2 * low, low + step * ((stop - low) // step + 1))
    while high - low > step:
        middle = low + (high - low) // step // 2 * step
        if check(middle):
            low = middle
        else:
            high = middle
    return Search(low, power, step, tried)
