"""Helpers the benchmark scripts share: the settings they sweep, configs set up for one
measurement, measuring subprocesses and how their results come back, and table formatting.

Each measurement that must own the device (a real step, whose peak-memory counter and
out-of-memory errors belong to it alone) runs in a fresh process through run_in_subprocess.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import jax
from ml_collections import ConfigDict

from bpt.config import load_config_file, override

MODES = ("vanilla", "memory_efficient", "blockwise_parallel")
LABELS = {"vanilla": "Vanilla", "memory_efficient": "MemoryEfficient", "blockwise_parallel": "BPT"}
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
    overrides ("model.remat_group=4", ...) apply last."""
    c = load_config_file(path)
    c.data.seq_len = seq_len
    c.train.batch_size = batch_size
    c.train.grad_accum_steps = grad_accum_steps
    if dtype:
        c.model.dtype = dtype
    if mode:
        c.model.attention_mode = mode
    c.model.attention_impl = "reference" if c.model.attention_mode == "vanilla" else impl
    if chunk:
        c.model.q_chunk_size = c.model.kv_chunk_size = c.model.loss_chunk_size = chunk
    if remat:
        c.model.remat_layer, c.model.remat_attention, c.model.remat_ffn = REMATS[remat]
    for setting in overrides:
        override(c, setting)
    return c


def report(result: dict) -> None:
    """Prints a measuring subprocess's result for run_in_subprocess to read."""
    print(RESULT + json.dumps(result), flush=True)


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


def seconds_per_call(fn, *args, repeats: int = 10, warmup: int = 2) -> float:
    """The median wall time of fn(*args) over `repeats` calls after `warmup` (compiling) ones."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)
