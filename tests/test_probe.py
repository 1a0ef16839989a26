"""The training-step probe (bpt.train.probe: a config's step compiled from shapes, remat
auto) and the benchmark protocol over it (scripts/benchlib.py: real steps, the search for the
longest length that fits, the max-context, memory and throughput scripts)."""

import argparse
import ast
import copy
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import load_script

from bpt.config import base_config, flash_config, paper_config
from bpt.train import probe
from bpt.train.probe import AUTO_REMAT, TrainingStep, auto_policies, resolve_remat

benchlib = load_script("benchlib")
longest_fitting = benchlib.longest_fitting

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs/tiny.py"


def run_script(name: str, *flags: str, cwd: Path) -> subprocess.CompletedProcess:
    """scripts/<name> with flags, run in cwd; asserts that it succeeded."""
    cmd = [sys.executable, str(ROOT / "scripts" / name), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


@pytest.mark.parametrize("limit", [4096, 4097, 5000, 8191, 30000, 65536, 100000])
def test_longest_fitting_finds_the_limit_and_tries_each_length_once(limit):
    calls = []

    def fits(n):
        calls.append(n)
        return n <= limit

    found = longest_fitting(fits, start=4096, stop=1 << 20, granule=512)
    power = 4096 * 2 ** ((limit // 4096).bit_length() - 1)
    step = max(power // 8, 512)
    assert found.longest_power_of_two == power and found.step == step
    assert found.longest <= limit < found.longest + step  # the longest multiple of the step
    assert (found.longest - power) % step == 0
    assert len(calls) == len(set(calls)) == len(found.tried)
    assert len(calls) <= (limit // 4096).bit_length() + 1 + 3  # doublings, then three halvings


def test_longest_fitting_at_the_edges():
    assert longest_fitting(lambda n: False, start=1024, stop=8192).longest == 0
    everything = longest_fitting(lambda n: True, start=1024, stop=10000, granule=128)
    assert everything.longest_power_of_two == 8192
    assert everything.longest == 9216  # 8192 + 1024 steps, the last one <= 10000
    assert longest_fitting(lambda n: True, start=1024, stop=1000).longest == 0


def tiny(mode: str, seq_len: int):
    c = base_config("tiny")
    c.data.seq_len, c.train.batch_size = seq_len, 1
    c.model.attention_mode = mode
    c.model.attention_impl = "reference" if mode == "vanilla" else "blockwise"
    c.model.q_chunk_size = c.model.kv_chunk_size = c.model.loss_chunk_size = 128
    return c


def test_compiled_memory_grows_quadratically_for_vanilla_and_slowly_for_bpt():
    peak = {
        (mode, n): TrainingStep(tiny(mode, n), vocab_size=512).memory().peak
        for mode in ("vanilla", "blockwise_parallel")
        for n in (512, 1024, 2048)
    }
    growth = lambda mode, a, b: peak[mode, b] - peak[mode, a]  # noqa: E731
    # Vanilla's [heads, seq, seq] scores: doubling the length more than doubles the growth.
    assert growth("vanilla", 1024, 2048) > 3 * growth("vanilla", 512, 1024)
    # BPT's activations are linear in the length and small.
    assert growth("blockwise_parallel", 1024, 2048) < 2.5 * growth("blockwise_parallel", 512, 1024)
    assert peak["blockwise_parallel", 2048] < peak["vanilla", 2048] / 2


def test_real_steps_train():
    step = TrainingStep(tiny("blockwise_parallel", 256), vocab_size=300)
    memory = step.memory()
    assert memory.peak >= memory.arguments > 0
    result = benchlib.run_steps(step, steps=3, warmup=1)
    assert result["step_seconds"] > 0 and result["tokens_per_second"] > 0
    assert len(result["losses"]) == 4 and result["losses"][-1] < result["losses"][0]


def test_a_sigterm_whose_raise_was_swallowed_still_stops_the_timing():
    """benchlib.stop_on_sigterm: the handler's KeyboardInterrupt can land in code that
    swallows it; the signal is remembered, and seconds_per_call (like bench_attention's
    loops, through check_stopped) raises again before its next call."""
    import os
    import signal

    before = signal.getsignal(signal.SIGTERM)
    try:
        benchlib.stop_on_sigterm()
        benchlib.seconds_per_call(lambda: jnp.ones(2), repeats=1, warmup=1)  # nothing yet
        try:  # the raise lands where it is swallowed
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # Python runs the handler at the next bytecodes
                pass
        except KeyboardInterrupt:
            pass
        with pytest.raises(KeyboardInterrupt, match=f"stopped by signal {int(signal.SIGTERM)}"):
            benchlib.seconds_per_call(lambda: jnp.ones(2), repeats=1, warmup=1)
    finally:
        signal.signal(signal.SIGTERM, before)
        benchlib._STOPPED["signal"] = None


def test_every_script_with_a_main_runs_it_when_run():
    """A script defining main() calls it under `if __name__ == "__main__":` (python
    scripts/X.py must do its work, not import its functions and exit quietly)."""
    silent = []
    for path in sorted((ROOT / "scripts").glob("*.py")):
        tree = ast.parse(path.read_text())
        if not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            continue
        guards = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        if not any("main(" in ast.unparse(g) for g in guards):
            silent.append(path.name)
    assert not silent, f"scripts that never call their main(): {silent}"


def test_max_context_script_end_to_end(tmp_path):
    out = tmp_path / "max_context.json"
    proc = run_script(
        "bench_max_context.py",
        f"--configs={TINY}",
        "--modes=vanilla,blockwise_parallel",
        "--chunks=128",
        "--groups=1,2",
        "--jobs=2",
        "--memory_gib=0.25",
        "--start=512",
        "--stop=4096",
        "--verify",
        "--verify_tries=1",
        f"--out={out}",
        f"--png={tmp_path / 'max_context.png'}",
        cwd=tmp_path,
    )
    table = proc.stdout.strip().splitlines()
    assert table[-3].startswith("| model | Vanilla | BPT |")
    assert "real step:" in table[-1]
    assert out.is_file() and (tmp_path / "max_context.png").is_file()
    script = str(ROOT / "scripts/bench_max_context.py")
    bad = subprocess.run([sys.executable, script, "--remats=sometimes"], capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown remat preset 'sometimes'; allowed: layer" in bad.stderr


def test_memory_efficient_with_the_chunked_loss_is_a_column_of_its_own():
    """The max-context and memory tables credit each part of BPT: MemoryEfficient with the
    chunked loss is a mode of the scripts (attention_mode memory_efficient, loss_impl
    chunked), and the max-context table prints BPT's ratio to every other column."""
    benchlib = load_script("benchlib")
    me = benchlib.benchmark_config(str(TINY), seq_len=256, mode="memory_efficient_chunked_loss", chunk=64)
    assert (me.model.attention_mode, me.model.loss_impl) == ("memory_efficient", "chunked")
    plain = benchlib.benchmark_config(str(TINY), seq_len=256, mode="memory_efficient", chunk=64)
    assert (plain.model.attention_mode, plain.model.loss_impl) == ("memory_efficient", "auto")
    table = load_script("bench_max_context").table
    best = lambda n: dict(longest=n, chunk=1024, remat="layer", group=1)  # noqa: E731
    modes = list(benchlib.TABLE_MODES)
    bests = {("gpt_1b", m): best(n) for m, n in zip(modes, (16384, 122880, 196608, 393216))}
    lines = table(bests, {}, ["gpt_1b"], modes).splitlines()
    assert lines[0] == (
        "| model | Vanilla | MemoryEfficient | MemoryEfficient + chunked loss | BPT | BPT / Vanilla | "
        "BPT / MemoryEfficient | BPT / MemoryEfficient + chunked loss |"
    )
    assert lines[2].endswith("| 24.0x | 3.2x | 2.0x |")
    # and the throughput table likewise
    three = ["memory_efficient", "memory_efficient_chunked_loss", "blockwise_parallel"]
    runs = [
        dict(mode=m, seq_len=2048, ok=True, tokens_per_second=t, mfu=0.4, chunk=1024, remat_layer="auto")
        for m, t in zip(three, (100.0, 110.0, 121.0))
    ]
    lines = load_script("bench_throughput").tables(runs, [], three, [2048]).splitlines()
    assert lines[2].endswith("| BPT / MemoryEfficient | BPT / MemoryEfficient + chunked loss |")
    assert lines[4] == "| 2K | 100 (40%) | 110 (40%) | 121 (40%) | 1.21x | 1.10x |"
    assert not any("SM clock" in line for line in lines)  # no GPU sampled
    runs[2].update(sm_clock_mhz=1650.0, power_capped=0.76)
    lines = load_script("bench_throughput").tables(runs, [], three, [2048]).splitlines()
    assert lines[-1].endswith("power limit held it): BPT 2K 1650 MHz (76%)")


def test_throughput_script_end_to_end(tmp_path):
    """Two modes at one length, then the loss check: the modes train to the same loss."""
    out = tmp_path / "throughput.json"
    proc = run_script(
        "bench_throughput.py",
        f"--config={TINY}",
        "--modes=memory_efficient,blockwise_parallel",
        "--seq_lens=256",
        "--tokens_per_step=512",
        "--micro_batch_tokens=256",
        "--chunks=128,256",
        "--grid_modes=blockwise_parallel",
        "--steps=1",
        "--loss_steps=4",
        "--loss_seq_len=128",
        "--loss_batch=2",
        "--loss_eval_batches=1",
        f"--out={out}",
        f"--png={tmp_path / 'throughput.png'}",
        cwd=tmp_path,
    )
    results = json.loads(out.read_text())
    (me, *bpt) = results["throughput"]  # BPT at both chunk sizes, MemoryEfficient at the first
    assert [(r["mode"], r["chunk"]) for r in results["throughput"]] == [
        ("memory_efficient", 128),
        ("blockwise_parallel", 128),
        ("blockwise_parallel", 256),
    ]
    assert me["ok"] and me["batch"] == 2 and me["micro_batches"] == 2
    assert all(r["ok"] and r["tokens_per_second"] > 0 for r in bpt)
    assert all(r["offloaded"] is False and r["unrolled"] is False for r in results["throughput"])
    fastest = max(bpt, key=lambda r: r["tokens_per_second"])["chunk"]
    assert f", chunks {fastest} |" in proc.stdout
    losses = {r["mode"]: r for r in results["loss"]}
    assert len(losses["blockwise_parallel"]["losses"]) == 4
    assert abs(losses["blockwise_parallel"]["eval_loss"] - losses["memory_efficient"]["eval_loss"]) < 1e-4
    assert "| 256 | " in proc.stdout and "x |" in proc.stdout  # the BPT / MemoryEfficient ratio
    assert (tmp_path / "throughput.png").is_file()
    again = run_script("bench_throughput.py", f"--from_json={out},{out}", cwd=tmp_path)  # no measuring
    assert again.stdout.strip().splitlines()[-1] == proc.stdout.strip().splitlines()[-1]


def test_memory_script_end_to_end(tmp_path):
    """Vanilla's row ends at the first length over the budget; BPT's fits and runs to 2K."""
    out = tmp_path / "memory.json"
    run_script(
        "bench_memory.py",
        f"--config={TINY}",
        "--modes=vanilla,blockwise_parallel",
        "--seq_lens=512,1024,2048",
        "--chunk=128",
        "--memory_gib=0.15",
        "--set=model.vocab_size=512",
        "--real",
        f"--out={out}",
        f"--png={tmp_path / 'memory.png'}",
        cwd=tmp_path,
    )
    results = json.loads(out.read_text())["results"]
    vanilla = [r for r in results if r["mode"] == "vanilla"]
    bpt = [r for r in results if r["mode"] == "blockwise_parallel"]
    assert [r["fits"] for r in bpt] == [True] * 3 and all(r["real"]["ok"] for r in bpt)
    assert [r["fits"] for r in vanilla] == [True, True, False]  # quadratic: over it at 2K, then stops
    assert bpt[-1]["compiled_gib"] < vanilla[-1]["compiled_gib"]
    assert (tmp_path / "memory.png").is_file()


def test_seconds_per_call_times_each_call_or_a_run_of_them():
    """synced waits for every call, pipelined for a run of them; both call fn with its
    arguments and give seconds a call; any other timing is a clear error."""
    benchlib = load_script("benchlib")
    calls = []

    def fn(x):
        calls.append(x)
        return jnp.ones(3) * x

    assert benchlib.seconds_per_call(fn, 2.0, repeats=3, warmup=1, timing="synced") > 0
    assert len(calls) == 1 + 3
    assert benchlib.seconds_per_call(fn, 2.0, repeats=3, warmup=1, timing="pipelined") > 0
    assert len(calls) == 4 + 1 + 5 * 3 and set(calls) == {2.0}
    with pytest.raises(ValueError, match="timing must be one of pipelined, synced"):
        benchlib.seconds_per_call(fn, 2.0, timing="async")


def test_decode_script_end_to_end(tmp_path):
    """Every implementation the CPU has (bpt's kernel at its default, at 2 programs a K/V
    head and with 2 stages, one column each), one shape and a one-sequence ragged batch,
    timed back to back (the default); the table, JSON, PNG."""
    proc = run_script(
        "bench_decode.py",
        "--contexts=256",
        "--batches=1",
        "--heads=32/8",
        "--ragged_batch=1",
        "--repeats=1",
        "--num_splits=0,2",
        "--variants=num_stages=2;table_in_kernel=0",
        "--parts=kernels,ragged,sample",
        f"--sample_config={TINY}",
        "--sample_contexts=256",
        "--new_tokens=4",
        "--prefill_chunk=96",  # the 252-token prompt in 3 chunks
        f"--out={tmp_path}",
        cwd=tmp_path,
    )
    results = json.loads((tmp_path / "results.json").read_text())
    (sample,) = results["sample"]
    assert "error" not in sample and sample["prompt"] == 252 and sample["tokens_per_s"] > 0
    assert "| 256 | 252 |" in proc.stdout
    (row,) = results["kernels"]
    impls = {"bpt pallas", "bpt pallas s2", "bpt pallas num_stages=2", "bpt pallas table_in_kernel=0", "bpt pallas lean"}
    impls |= {"bpt split_kv", "XLA"}
    assert set(row["times"]) == impls and not row.get("errors") and row["timing"] == "pipelined"
    assert "| bpt pallas | bpt pallas s2 | bpt pallas num_stages=2 |" in proc.stdout
    assert "µs a call, calls back to back" in proc.stdout
    assert "of HBM" not in proc.stdout and row["hbm_tb_per_s"] is None  # a CPU's bandwidth: not known
    assert {"pallas stream_k", "pallas split", "pallas lean"} <= set(results["ragged"][0]["times"])
    assert row["bytes"] == 2 * 256 * 8 * 128 * 2
    assert "| 256 | 1 | 32/8 |" in proc.stdout and "stream-K / split" in proc.stdout
    assert (tmp_path / "decode.png").is_file()


def test_the_decode_table_gives_the_bandwidth_share_and_what_a_ratio_would_need():
    """The kernels table's last columns: the share of the memory's bandwidth bpt's kernel reads
    at, and the share a call 1.1x cuDNN's speed would (over 100%: faster than the memory)."""
    script = load_script("bench_decode")
    times = {"bpt pallas": 150e-6, "cuDNN": 154e-6}
    row = dict(context=131072, batch=1, heads="32/8", timing="pipelined", times=times, hbm_tb_per_s=4.8)
    row["tb_per_s"] = {name: 0.6e9 / t / 1e12 for name, t in times.items()}  # 4.0 and 3.9 TB/s
    lines = script.tables([row], [], []).splitlines()
    assert lines[2].endswith("| cuDNN | bpt pallas of HBM | 1.1x cuDNN needs |")
    assert lines[4].endswith("| 83% | 89% |")  # 4.0 / 4.8; 1.1 x 3.9 / 4.8
    assert "the memory's 4.80 TB/s" in lines[6]
    assert script.hbm_bytes_per_s(jax.devices()[0]) is None  # a CPU: no ceiling columns
    assert script.hbm_bytes_per_s(jax.devices()[0], 3.35) == 3.35e12


def test_flash_script_end_to_end(tmp_path):
    """Speed, longest context (a small budget) and quality of FLASH tiny against GPT tiny;
    the quality runs kept in --quality_dir are read back by a second call."""
    configs = [f"--gpt={TINY}", f"--flash={ROOT / 'configs/flash_tiny.py'}"]
    quality = ["--seq_len=128", "--steps=4", "--batch_size=2", "--set=model.loss_chunk_size=64"]
    quality += ["--set=model.vocab_size=512", f"--quality_dir={tmp_path / 'runs'}"]
    run_script(
        "bench_flash.py",
        *configs,
        "--contexts=512",
        "--tokens_per_step=1024",
        "--repeats=1",
        "--max_start=1024",
        "--max_stop=8192",
        "--memory_gib=0.05",
        *quality,
        f"--out={tmp_path}",
        cwd=tmp_path,
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert all(r["ok"] and r["tokens_per_second"] > 0 for r in results["speed"])
    assert [(Path(r["config"]).stem, r["context"]) for r in results["flops"]] == [
        ("tiny", 512),
        ("flash_tiny", 512),
    ]
    longest = {r["family"]: r["longest"] for r in results["max_context"]}
    assert all(1024 <= n < 8192 for n in longest.values()), longest  # the budget bites in between
    assert all(r["ok"] and len(r["loss"]) == 4 for r in results["quality"])
    (equal,) = results["equal_loss"]  # FLASH's time to the GPT's final loss, when it gets there
    gpt_run = next(r for r in results["quality"] if r["family"] == "gpt")
    assert equal["target"] == gpt_run["loss"][-1] and equal["gpt_step_s"] > 0
    assert (equal["flash_steps"] is None) == (equal["speedup"] is None)
    table = (tmp_path / "table.md").read_text()
    assert "| 512 | tiny |" in table and "speed-up at equal loss" in table and "GPT / FLASH" in table
    assert "Time to FLASH's final training loss" in table
    assert (tmp_path / "flash.png").is_file()

    # Only the runs' metrics and settings are needed to read them back (as when the two
    # families were trained on different machines); the checkpoints go.
    for run in (tmp_path / "runs").iterdir():
        shutil.rmtree(run / "checkpoints")
    again = tmp_path / "again"
    proc = run_script("bench_flash.py", *configs, "--parts=quality", *quality, f"--out={again}", cwd=tmp_path)
    assert proc.stdout.count("read back the finished run") == 2
    assert json.loads((again / "results.json").read_text())["quality"] == results["quality"]
    # A family left out of --quality_families is only read back: without its run, no row.
    shutil.rmtree(tmp_path / "runs" / "flash_tiny")
    proc = run_script(
        "bench_flash.py", *configs, "--parts=quality", *quality, "--quality_families=gpt", cwd=tmp_path
    )
    assert "read back the finished run" in proc.stdout and "not in --quality_families" in proc.stdout
    assert not (tmp_path / "runs" / "flash_tiny").exists()
    # Under other settings the kept runs are refused, not mixed in or retrained over.
    cmd = [sys.executable, str(ROOT / "scripts/bench_flash.py"), *configs, "--parts=quality", *quality]
    proc = subprocess.run([*cmd, "--steps=5"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode != 0 and "was trained with" in proc.stderr and "train.steps=4" in proc.stderr


def test_flash_script_ablates_the_papers_recipe_one_change_at_a_time(tmp_path):
    """--parts ablation trains FLASH tiny six ways (bpt's defaults, each change of the paper's
    recipe alone, all of them) and tables each run's losses against bpt's defaults."""
    flash = ROOT / "configs/flash_tiny.py"
    run_script(
        "bench_flash.py", f"--flash={flash}", f"--gpt={TINY}", "--parts=ablation", "--seq_len=128", "--steps=2",
        "--batch_size=2", "--set=model.loss_chunk_size=64", f"--quality_dir={tmp_path / 'runs'}", "--quality_jobs=2",
        f"--out={tmp_path / 'out'}", cwd=tmp_path,
    )  # fmt: skip
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["ablation"]
    names = ["bpt", "norm alone", "position_embedding alone", "absolute_embedding alone", "linear_norm alone", "paper"]
    assert [r["variant"] for r in rows] == names and all(r["ok"] for r in rows), rows
    saved = json.loads((tmp_path / "runs" / "flash_tiny-paper" / "config.json").read_text())["model"]
    assert (saved["norm"], saved["linear_norm"], saved["absolute_embedding"]) == ("layer_norm", "mean", "scaled_sin")
    assert saved["position_embedding"] == "rotary+relative_bias" and saved["relative_buckets"] == 128
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| flash_tiny | bpt |" in table and "| flash_tiny | paper |" in table and "+0.00%" in table


def test_flash_script_counts_each_familys_flops_at_each_context():
    """The flops part: FLASH's model FLOPs a token stay flat with the context, the GPT's grow
    by its attention's (QK^T and PV, forward and backward, over half the causal window); the
    table's last column is their ratio, FLASH's speed-up per step at equal MFU."""
    bench = load_script("bench_flash")
    gpt, flash = str(ROOT / "configs/gpt_125m.py"), str(ROOT / "configs/flash_125m.py")
    args = argparse.Namespace(gpt=[gpt], flash=[flash], contexts=[1024, 8192], set=[])
    rows = bench.flops_part(args, [gpt, flash])
    per = {(Path(r["config"]).stem, r["context"]): r["flops_per_token"] for r in rows}
    assert len(per) == 4 and per["flash_125m", 1024] == per["flash_125m", 8192] > 0
    layers, d_model = 12, 768
    grown = per["gpt_125m", 8192] - per["gpt_125m", 1024]
    assert grown == pytest.approx(layers * 3 * 2 * 2 * d_model * (8192 - 1024) / 2)
    table = bench.tables(args, rows, [], [], [], [])
    ratio = per["gpt_125m", 8192] / per["flash_125m", 8192]
    assert f"| 8K | gpt_125m | {per['gpt_125m', 8192] / 1e9:.3f} | flash_125m |" in table
    assert table.splitlines()[-1].endswith(f"| {ratio:.2f} |") and 1.3 < ratio < 1.5
    wide = str(ROOT / "configs/flash_125m_wide.py")  # one GPT against two FLASH shapes: run once
    args = argparse.Namespace(gpt=[gpt, gpt], flash=[flash, wide], contexts=[8192], set=[])
    assert bench.run_configs(args) == [gpt, flash, wide]
    rows = bench.flops_part(args, bench.run_configs(args))
    table = bench.tables(args, rows, [], [], [], []).splitlines()
    assert table[-2].startswith("| 8K | gpt_125m |") and table[-1].startswith("| 8K | gpt_125m |")
    assert "| flash_125m_wide |" in table[-1]


def test_flash_script_time_to_equal_loss():
    """The paper's speed-up: FLASH's time to reach the GPT's final loss against the GPT's."""
    bench = load_script("bench_flash")
    steps = [10, 20, 30, 40]
    assert bench.steps_to_loss(steps, [3.0, 2.0, 1.0, 0.5], 1.5) == 25.0  # between log points
    assert bench.steps_to_loss(steps, [3.0, 2.0, 1.0, 0.5], 4.0) == 10.0  # already there
    assert bench.steps_to_loss(steps, [3.0, 2.0, 1.0, 0.5], 0.2) is None
    gpt = dict(steps=steps, loss=[4.0, 3.0, 2.5, 2.0], step_seconds=[None, 0.30, 0.20, 0.20])
    flash = dict(steps=steps, loss=[3.5, 2.5, 1.5, 1.0], step_seconds=[0.10, 0.10, 0.12, 0.10])
    t = bench.time_to_quality(gpt, flash)
    assert t["target"] == 2.0 and t["flash_steps"] == 25.0
    assert t["gpt_step_s"] == 0.20 and t["flash_step_s"] == 0.10  # medians
    assert abs(t["speedup"] - (40 * 0.20) / (25.0 * 0.10)) < 1e-12
    assert t["flash_target"] == 1.0 and t["gpt_steps_to_flash"] is None and t["speedup_at_flash_loss"] is None
    flash["loss"] = [3.9, 3.5, 3.0, 2.9]  # FLASH ends above the GPT: the measure from its side
    t = bench.time_to_quality(gpt, flash)
    assert t["speedup"] is None and t["flash_final_steps"] == 40
    assert t["gpt_steps_to_flash"] == pytest.approx(22.0)  # 3.0 at step 20, 2.5 at 30
    assert t["speedup_at_flash_loss"] == pytest.approx(22.0 * 0.20 / (40 * 0.10))
    flash.update(loss=[3.5, 2.5, 1.5, 1.0], step_seconds=[None] * 4)  # no timed window: no speed-up
    t = bench.time_to_quality(gpt, flash)
    assert t["flash_step_s"] is None and t["speedup"] is None and t["speedup_at_flash_loss"] is None


def test_rl_script_end_to_end(tmp_path):
    """The AT training step of one 1000-step trajectory (4,000 tokens) in BPT mode."""
    run_script(
        "bench_rl.py",
        "--trajectories=1",
        "--batch_size=1",
        "--modes=blockwise_parallel",
        "--steps=1",
        *(f"--set=model.{name}=500" for name in ("q_chunk_size", "kv_chunk_size", "loss_chunk_size")),
        f"--out={tmp_path}",
        cwd=tmp_path,
    )
    (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert row["ok"] and row["tokens"] == 4000 and row["step_s"] > 0 and row["compiled_gib"] > 0
    assert "| 1 | 3.9K | 1 | BPT |" in (tmp_path / "table.md").read_text()


def test_remat_auto_takes_the_fastest_policy_that_fits(capsys, monkeypatch):
    """The candidates need less memory in AUTO_REMAT's order; auto takes the first that fits
    the budget, nothing_saveable where none does or the device reports no limit."""
    c = tiny("blockwise_parallel", 512)
    needs = {}
    for policy in AUTO_REMAT:
        c.model.remat_layer = policy
        needs[policy] = TrainingStep(c, vocab_size=256).memory().peak
    first, second, last = (needs[p] for p in AUTO_REMAT)
    assert first > second > last, needs
    c.model.remat_layer = "auto"
    for budget, expected in ((first, AUTO_REMAT[0]), (first - 1, AUTO_REMAT[1]), (last - 1, AUTO_REMAT[2])):
        chosen = resolve_remat(c, budget=budget, need=lambda c: needs[c.model.remat_layer])
        assert chosen.model.remat_layer == expected, budget
    assert c.model.remat_layer == "auto"  # the caller's config is left as it was
    out = capsys.readouterr().out
    assert "model.remat_layer=auto: attention_saveable (step memory:" in out
    # Each candidate is announced before its (at long contexts, minutes-long) compile: the
    # three budgets above try 1, 2 and 3 of them.
    announced = [f"remat auto: compiling the step with {p} to measure its memory ..." for p in AUTO_REMAT]
    assert [out.count(line) for line in announced] == [3, 2, 1]
    # A step made from the config directly resolves it too (here: no memory limit).
    assert TrainingStep(c, vocab_size=256).model.config.remat_layer == "nothing_saveable"
    # With a limit, the step keeps the executable it compiled for the chosen policy.
    monkeypatch.setattr(probe, "memory_budget", lambda: first - 1)
    step = TrainingStep(c, vocab_size=256)
    assert step.config.model.remat_layer == step.model.config.remat_layer == AUTO_REMAT[1]
    assert step._compiled is not None and step.memory().peak == second
    agentic = base_config("tiny")
    agentic.model.family, agentic.model.remat_layer = "agentic", "auto"
    with pytest.raises(ValueError, match="for model.family='agentic' name a policy"):
        resolve_remat(agentic, budget=1 << 30)


def test_remat_auto_tries_no_remat_first_for_an_unrolled_stack():
    """auto puts "none" first where the layer stack runs unrolled (scan_unroll covering
    every layer, or no scan) and the stack's settings allow it; the 125M configs unroll."""
    c = base_config("tiny")
    assert auto_policies(c.model) == AUTO_REMAT
    c.model.scan_unroll = c.model.num_layers
    assert auto_policies(c.model) == ("none", *AUTO_REMAT)
    unscanned = base_config("tiny")
    unscanned.model.scan_layers = False
    assert auto_policies(unscanned.model)[0] == "none"
    grouped = copy.deepcopy(c)
    grouped.model.remat_group = 2
    assert auto_policies(grouped.model) == AUTO_REMAT
    c.model.remat_layer = "auto"
    needs = {"none": 40, "attention_and_dots_saveable": 30, "attention_saveable": 20, "nothing_saveable": 10}
    for budget, expected in ((40, "none"), (39, "attention_and_dots_saveable"), (5, "nothing_saveable")):
        chosen = resolve_remat(
            c, budget=budget, need=lambda c: needs[c.model.remat_layer], say=lambda _: None
        )
        assert chosen.model.remat_layer == expected, budget
    for config, layers in ((paper_config("125m"), 12), (flash_config("125m"), 24)):
        assert (config.model.scan_unroll, config.model.remat_layer) == (layers, "auto")
    assert (flash_config("350m").model.scan_unroll, flash_config("350m").model.remat_layer) == (
        1,
        "nothing_saveable",
    )
    assert paper_config("1b").model.scan_unroll == 1


def test_remat_auto_unrolls_the_stack_where_its_first_policy_fits_unrolled(capsys, monkeypatch):
    """model.auto_unroll: where a policy's loop fits, its step with the stack unrolled is
    compiled too and taken if it fits; where it does not (or the stack's settings run loops
    of their own) the loop stays. GPT-1B's preset asks."""
    c = base_config("tiny")
    c.model.remat_layer, c.model.auto_unroll = "auto", True
    layers = c.model.num_layers
    needs = {
        ("attention_and_dots_saveable", 1): 30,
        ("attention_and_dots_saveable", layers): 35,
        ("attention_saveable", 1): 20,
        ("attention_saveable", layers): 25,
        ("nothing_saveable", 1): 10,
    }
    asked = []

    def need(config):
        asked.append((config.model.remat_layer, config.model.scan_unroll))
        return needs[asked[-1]]

    for budget, expected in ((35, ("attention_and_dots_saveable", layers)), (34, ("attention_and_dots_saveable", 1)),
                             (29, ("attention_saveable", layers)), (24, ("attention_saveable", 1)),
                             (5, ("nothing_saveable", 1))):  # fmt: skip
        asked.clear()
        chosen = resolve_remat(c, budget=budget, need=need)
        assert (chosen.model.remat_layer, chosen.model.scan_unroll) == expected, budget
        # a policy's unrolled step is compiled only after its loop fitted
        assert (("attention_and_dots_saveable", layers) in asked) == (budget >= 30), budget
        assert (("attention_saveable", layers) in asked) == (20 <= budget < 30), budget
    out = capsys.readouterr().out
    assert "model.remat_layer=auto: attention_and_dots_saveable (the layer stack unrolled; step memory: " in out
    assert "attention_and_dots_saveable 0.0 GiB, unrolled 0.0 GiB" in out
    assert c.model.scan_unroll == 1  # the caller's config is left as it was
    for name, value in (("auto_unroll", False), ("remat_group", 2), ("offload_layer_inputs", True)):
        other = copy.deepcopy(c)
        other.model[name] = value
        assert not probe.may_unroll(other.model), name
        asked.clear()
        assert resolve_remat(other, budget=35, need=need, say=lambda _: None).model.scan_unroll == 1
        assert asked == [("attention_and_dots_saveable", 1)]
    assert probe.may_unroll(c.model) and paper_config("1b").model.auto_unroll
    assert paper_config("1b").train.grad_accum_unroll and not paper_config("7b").train.grad_accum_unroll
    assert not paper_config("7b").model.auto_unroll and not paper_config("125m").model.auto_unroll
    assert not flash_config("1b").model.auto_unroll
    # A real step: the unrolled executable auto compiled is the one the step keeps.
    small = tiny("blockwise_parallel", 256)
    small.model.remat_layer, small.model.auto_unroll = "auto", True
    monkeypatch.setattr(probe, "memory_budget", lambda: 1 << 40)
    step = TrainingStep(small, vocab_size=256)
    assert (step.config.model.remat_layer, step.config.model.scan_unroll) == (AUTO_REMAT[0], small.model.num_layers)
    assert step.model.config.scan_unroll == small.model.num_layers and step._compiled is not None


def test_remat_auto_keeps_the_norm_kernels_results_first_on_an_unrolled_stack(capsys):
    """Where the layers' LayerNorms run as bpt's kernels, auto tries AUTO_NORMS first on an
    unrolled stack: in auto_unroll's trial (before the first policy's unrolled step), or
    after "none" where the stack runs unrolled already; not in a loop (unmeasured there), and
    not where the norms are XLA's (auto on a CPU or a mesh, RMSNorm, FLASH: it would be
    attention_and_dots_saveable's step)."""
    c = base_config("tiny")
    c.model.remat_layer, c.model.auto_unroll, c.model.norm_impl = "auto", True, "pallas"
    assert probe.runs_norm_kernels(c)
    layers, dots = c.model.num_layers, "attention_and_dots_saveable"
    assert auto_policies(c.model, norm_kernels=True) == AUTO_REMAT  # a loop
    needs = {(dots, 1): 30, (probe.AUTO_NORMS, layers): 45, (dots, layers): 35, ("attention_saveable", 1): 20,
             ("attention_saveable", layers): 25}  # fmt: skip
    asked = []

    def need(config):
        asked.append((config.model.remat_layer, config.model.scan_unroll))
        return needs[asked[-1]]

    for budget, expected, tried in (
        (45, (probe.AUTO_NORMS, layers), [(dots, 1), (probe.AUTO_NORMS, layers)]),
        (44, (dots, layers), [(dots, 1), (probe.AUTO_NORMS, layers), (dots, layers)]),
        (34, (dots, 1), [(dots, 1), (probe.AUTO_NORMS, layers), (dots, layers)]),
        # a later policy: its own step unrolled, no AUTO_NORMS (it keeps what dots keeps)
        (29, ("attention_saveable", layers), [(dots, 1), ("attention_saveable", 1), ("attention_saveable", layers)]),
    ):
        asked.clear()
        chosen = resolve_remat(c, budget=budget, need=need)
        assert (chosen.model.remat_layer, chosen.model.scan_unroll) == expected, budget
        assert asked == tried, budget
    out = capsys.readouterr().out
    assert f"model.remat_layer=auto: {probe.AUTO_NORMS} (the layer stack unrolled; step memory: " in out
    assert f"{dots} 0.0 GiB, {probe.AUTO_NORMS} unrolled 0.0 GiB, unrolled 0.0 GiB" in out
    unrolled = copy.deepcopy(c)
    unrolled.model.scan_unroll = layers
    assert auto_policies(unrolled.model, norm_kernels=True) == ("none", probe.AUTO_NORMS, *AUTO_REMAT)
    for name, value in (("norm_impl", "xla"), ("norm_impl", "auto"), ("rms_norm", True)):
        other = copy.deepcopy(c)
        other.model[name] = value
        assert not probe.runs_norm_kernels(other), (name, value)  # auto: this host has no GPU
        asked.clear()
        resolve_remat(other, budget=45, need=need, say=lambda _: None)
        assert asked == [(dots, 1), (dots, layers)], (name, value)
    flash = flash_config("tiny")  # FLASH's norms are XLA's
    assert not probe.runs_norm_kernels(flash)


def test_remat_auto_splits_the_stack_between_its_last_two_candidates(capsys, monkeypatch):
    """model.auto_split: where a later candidate fits, auto compiles the step with the one
    before it in the first layers, as many as the budget leaves room for at the two steps'
    difference a layer, and fewer where that step is over (at most three tries); not between
    one policy offloaded and not, nor where not asked (no preset asks yet)."""
    c = base_config("tiny")
    c.model.num_layers, c.model.remat_layer, c.model.auto_split = 8, "auto", True
    dots, kept = "attention_and_dots_saveable", "attention_saveable"
    asked = []

    def need(config):  # 5 a layer kept by dots, 2 more where the stack is split
        m = config.model
        asked.append((m.remat_layer, m.remat_first_layers))
        per_policy = {dots: 80, kept: 40, "nothing_saveable": 10}
        return per_policy[m.remat_layer] + (5 * m.remat_first_layers + 2 if m.remat_first_layers else 0)

    for budget, expected, tried in (
        (80, (dots, 0), [(dots, 0)]),
        (79, (kept, 7), [(dots, 0), (kept, 0), (kept, 7)]),
        (71, (kept, 5), [(dots, 0), (kept, 0), (kept, 6), (kept, 5)]),
        (44, (kept, 0), [(dots, 0), (kept, 0)]),  # no room for one layer
        # 3.75 a layer between these two: 7 layers estimated, 47 measured, 8 over: 4
        (39, ("nothing_saveable", 4), [(dots, 0), (kept, 0), ("nothing_saveable", 0), ("nothing_saveable", 7), ("nothing_saveable", 4)]),
    ):
        asked.clear()
        chosen = resolve_remat(c, budget=budget, need=need)
        assert (chosen.model.remat_layer, chosen.model.remat_first_layers) == expected, budget
        assert asked == tried, budget
        if expected[1]:
            assert chosen.model.remat_first == (dots if expected[0] == kept else kept)
    out = capsys.readouterr().out
    assert f"model.remat_layer=auto: {kept} (the first layers under {dots}: 5 of 8; step memory: " in out
    assert f"{dots} 0.0 GiB, {kept} 0.0 GiB, {dots} in 6 layers 0.0 GiB, {dots} in 5 layers 0.0 GiB;" in out
    assert f"remat auto: compiling the step with {dots} in its first 6 of 8 layers (model.auto_split) ..." in out
    check_gpus = load_script("check_gpus")
    (line,) = [line for line in out.splitlines() if ": 5 of 8;" in line]
    assert check_gpus.compile_facts(line)["remat_layer"] == f"{kept} split"
    for name, value in (("auto_split", False), ("remat_group", 2)):
        other = copy.deepcopy(c)
        other.model[name] = value
        assert not probe.may_split(other.model), name
        asked.clear()
        assert resolve_remat(other, budget=71, need=need, say=lambda _: None).model.remat_first_layers == 0
        assert asked == [(dots, 0), (kept, 0)]
    # attention_saveable, then the same offloaded: one policy, nothing to split
    offload = copy.deepcopy(c)
    offload.model.auto_offload = True
    asked.clear()
    chosen = resolve_remat(offload, budget=39, need=lambda config: 30 if config.model.offload_layer_inputs else need(config), say=lambda _: None)
    assert chosen.model.offload_layer_inputs and not chosen.model.remat_first_layers
    named = copy.deepcopy(c)
    named.model.remat_first_layers = 3
    with pytest.raises(ValueError, match="model.remat_first_layers=3 needs a named model.remat_layer"):
        resolve_remat(named, budget=39, need=need)
    assert paper_config("1b").model.auto_split and not paper_config("7b").model.auto_split
    assert not flash_config("1b").model.auto_split
    assert paper_config("1b").model.cast_params_once and not paper_config("7b").model.cast_params_once
    assert not flash_config("1b").model.cast_params_once
    # A real step: the split auto compiled is the step that runs, within the budget.
    small = tiny("blockwise_parallel", 2048)
    small.model.num_layers = 4
    peaks = {}
    for policy in (dots, kept):
        small.model.remat_layer = policy
        peaks[policy] = TrainingStep(small, vocab_size=256).memory().peak
    small.model.remat_layer, small.model.auto_split = "auto", True
    budget = peaks[kept] + 3 * (peaks[dots] - peaks[kept]) // 4
    monkeypatch.setattr(probe, "memory_budget", lambda: budget)
    step = TrainingStep(small, vocab_size=256)
    assert step.config.model.remat_layer == kept and step.model.config.remat_first_layers >= 1
    assert step._compiled is not None and step.memory().peak <= budget


def test_remat_auto_unrolls_the_split_stack_then_the_later_policy_alone(capsys):
    """model.auto_split with model.auto_unroll: where a later candidate fits, auto compiles
    the split it chose with the stack unrolled, with fewer first layers where that is over
    (at most three tries), then the later policy's unrolled step alone; the first that fits
    is taken, else the looped split stays."""
    c = base_config("tiny")
    c.model.num_layers, c.model.remat_layer = 8, "auto"
    c.model.auto_split = c.model.auto_unroll = True
    dots, kept = "attention_and_dots_saveable", "attention_saveable"
    asked = []

    def need(config):  # unrolled: 2 less, and 1 more a split layer
        m = config.model
        unrolled = m.scan_unroll == m.num_layers
        asked.append((m.remat_layer, m.remat_first_layers, unrolled))
        base = {dots: 80, kept: 40}[m.remat_layer] - (2 if unrolled else 0)
        return base + ((5 + unrolled) * m.remat_first_layers + 2 if m.remat_first_layers else 0)

    for budget, expected, tried in (
        # the loop's split at 7 (77), unrolled 7 (82) over by 3: 6 unrolled (76)
        (79, (kept, 6, True), [(dots, 0, False), (kept, 0, False), (kept, 7, False), (kept, 7, True), (kept, 6, True)]),
        # the loop's split at 1 (47), unrolled 1 (46)
        (47, (kept, 1, True), [(dots, 0, False), (kept, 0, False), (kept, 1, False), (kept, 1, True)]),
        # no room for a split layer: kept unrolled alone
        (44, (kept, 0, True), [(dots, 0, False), (kept, 0, False), (kept, 0, True)]),
    ):
        asked.clear()
        chosen = resolve_remat(c, budget=budget, need=need)
        m = chosen.model
        assert (m.remat_layer, m.remat_first_layers, m.scan_unroll == m.num_layers) == expected, budget
        assert asked == tried, budget
    out = capsys.readouterr().out
    assert (f"model.remat_layer=auto: {kept} (the layer stack unrolled; the first layers under {dots}: 6 of 8; "
            f"step memory: {dots} 0.0 GiB, {kept} 0.0 GiB, {dots} in 7 layers 0.0 GiB, "
            f"{dots} in 7 layers unrolled 0.0 GiB, {dots} in 6 layers unrolled 0.0 GiB;") in out  # fmt: skip
    assert f"compiling the step with {dots} in its first 7 of 8 layers and the layer stack unrolled (model.auto_split)" in out
    check_gpus = load_script("check_gpus")
    (line,) = [line for line in out.splitlines() if ": 6 of 8;" in line]
    assert check_gpus.compile_facts(line)["remat_layer"] == f"{kept} unrolled"

    # no unrolled split fits (3 tries), nor kept unrolled: the looped split stays
    def tight(config):
        m = config.model
        return need(config) + (40 if m.scan_unroll == m.num_layers else 0)

    asked.clear()
    chosen = resolve_remat(c, budget=60, need=tight, say=lambda _: None)
    assert (chosen.model.remat_first_layers, chosen.model.scan_unroll) == (3, 1)
    assert [a for a in asked if a[2]] == [(kept, 3, True), (kept, 0, True)]  # 3 over by 43: none left


def test_remat_auto_offloads_the_saved_layer_inputs_where_that_lets_attention_fit(capsys, monkeypatch):
    """model.auto_offload: where attention_saveable does not fit, auto compiles it again with
    the saved layer inputs offloaded to the host, before nothing_saveable; not where the
    stack's settings cannot offload or offload already. GPT-7B's preset asks."""
    c = base_config("tiny")
    c.model.remat_layer, c.model.auto_offload = "auto", True
    assert probe.auto_candidates(c.model) == (
        ("attention_and_dots_saveable", False),
        ("attention_saveable", False),
        ("attention_saveable", True),
        ("nothing_saveable", False),
    )
    needs = {
        ("attention_and_dots_saveable", False): 40,
        ("attention_saveable", False): 30,
        ("attention_saveable", True): 20,
        ("nothing_saveable", False): 25,
    }
    asked = []

    def need(config):
        asked.append((config.model.remat_layer, config.model.offload_layer_inputs))
        return needs[asked[-1]]

    for budget, expected in ((30, ("attention_saveable", False)), (29, ("attention_saveable", True)),
                             (19, ("nothing_saveable", False))):  # fmt: skip
        asked.clear()
        chosen = resolve_remat(c, budget=budget, need=need)
        assert (chosen.model.remat_layer, chosen.model.offload_layer_inputs) == expected, budget
        assert asked[-1] == expected and len(asked) == list(needs).index(expected) + 1
    out = capsys.readouterr().out
    assert "compiling the step with attention_saveable and the saved layer inputs offloaded to the host" in out
    assert "model.remat_layer=auto: attention_saveable (the saved layer inputs offloaded to the host; " in out
    assert "attention_saveable offloaded 0.0 GiB" in out
    assert not c.model.offload_layer_inputs  # the caller's config is left as it was
    for name, value in (("auto_offload", False), ("remat_group", 2), ("offload_layer_inputs", True)):
        other = copy.deepcopy(c)
        other.model[name] = value
        assert not probe.may_offload(other.model), name
        assert len(probe.auto_candidates(other.model)) == len(AUTO_REMAT), name
    # the user's own offload: every candidate offloads, none twice
    own = copy.deepcopy(c)
    own.model.offload_layer_inputs = True
    assert {offload for _, offload in probe.auto_candidates(own.model)} == {True}
    assert paper_config("7b").model.auto_offload and not paper_config("1b").model.auto_offload
    assert not flash_config("7b").model.auto_offload
    # A real step: the offloaded executable auto compiled is the one the step keeps. (On a
    # CPU host memory is device memory: the memory the steps report is made to differ.)
    small = tiny("blockwise_parallel", 256)
    small.model.remat_layer, small.model.auto_offload = "auto", True
    real = TrainingStep.memory

    def memory(step):
        m = real(step)
        kept = step.config.model.remat_layer != "nothing_saveable" and not step.config.model.offload_layer_inputs
        return dataclasses.replace(m, temp=m.temp + (1 << 30 if kept else 0))

    monkeypatch.setattr(TrainingStep, "memory", memory)
    monkeypatch.setattr(probe, "memory_budget", lambda: 1 << 29)
    step = TrainingStep(small, vocab_size=256)
    assert (step.config.model.remat_layer, step.config.model.offload_layer_inputs) == ("attention_saveable", True)
    assert step.model.config.offload_layer_inputs and step._compiled is not None


def test_profile_splits_collective_time_into_transfers_and_waits():
    """profile_step.collective_waits: the n-th call of each collective is matched across
    devices; its shortest duration is the transfer, the rest each device's wait."""
    profile_step = load_script("profile_step")

    def call(ts, dur, op):
        return {"ts": ts, "dur": dur, "name": "ncclDevKernel_SendRecv", "args": {"hlo_op": op}}

    gemm = {"ts": 0, "dur": 500, "name": "gemm"}
    devices = [
        [gemm, call(10, 30, "ppermute.1"), call(100, 10, "ppermute.2"), call(200, 40, "ppermute.1")],
        [gemm, call(30, 10, "ppermute.1"), call(95, 15, "ppermute.2"), call(230, 10, "ppermute.1")],
    ]
    w = profile_step.collective_waits(devices, steps=2)
    assert w["transfer_ms"] == pytest.approx((10 + 10 + 10) / 2e3)
    assert w["wait_ms"] == pytest.approx([(20 + 0 + 30) / 2e3, (0 + 5 + 0) / 2e3])
    assert w["last"] == [0.5, 1.0]  # device 0 came last once in two steps, device 1 twice
    assert profile_step.collective_waits([[gemm], [gemm]], steps=1)["transfer_ms"] == 0


def test_profile_timeline_finds_the_gaps_and_the_overlap():
    """profile_step.timeline: a device's window, what some kernel ran (streams together),
    the gaps where none did, the kernel time that ran beside another, and how much of the
    collectives' time no other kernel ran beside."""
    profile_step = load_script("profile_step")
    events = [  # microseconds over two steps: a matmul, a collective beside it, a gap, a fusion
        {"ts": 0, "dur": 100},
        {"ts": 60, "dur": 80},  # overlaps the first by 40
        {"ts": 200, "dur": 50},  # after a gap of 60
        {"ts": 210, "dur": 10},  # inside the third
    ]
    for e, name in zip(events, ("gemm", "ncclDevKernel_SendRecv", "loop_fusion", "loop_fusion")):
        e["name"] = name
    t = profile_step.timeline(events, steps=2)
    assert t == {
        "span_ms": 0.125,
        "busy_ms": 0.095,
        "idle_ms": 0.03,
        "overlapped_ms": 0.025,
        "collective_ms": 0.04,  # the collective's 80 us over two steps
        "collective_alone_ms": 0.02,  # its last 40 us ran with nothing beside it
    }
    assert profile_step.timeline([], steps=1) == {}
    assert "collective_ms" not in profile_step.timeline(events[2:], steps=1)


def test_profile_parts_of_a_step():
    """scripts/profile_step.py sums a trace's kernels by operation, then by part of the step."""
    profile_step = load_script("profile_step")
    hlo = """
  %dot_product_attention_fwd.4 = (bf16[1,16,32768,128]{3,1,2,0}, f32[1,16,32768]{2,1,0}) custom-call(%a), custom_call_target="__cudnn$fmhaSoftmax"
  %dot_product_attention_bwd.8 = (bf16[1,16,32768,128]{3,1,2,0}) custom-call(%a), custom_call_target="__cudnn$fmhaSoftmaxBackward"
  %custom-call.1 = (bf16[16384,2048]{1,0}, s8[33554432]{0}) custom-call(%a), custom_call_target="__cublas$lt$matmul"
  %custom-call.9 = (f32[16384,50304]{1,0}, s8[33554432]{0}) custom-call(%a), custom_call_target="__cublas$lt$matmul"
  %loop_add_select_fusion = f32[24,2048,8192]{2,1,0} fusion(%a), kind=kLoop, calls=%f
  %loop_add_fusion.1 = f32[8192,2048]{1,0} fusion(%a), kind=kLoop, calls=%g
  %all-reduce.3 = f32[2048]{0} all-reduce(%a), replica_groups={}
  %copy.21 = bf16[2,1,16384,2048]{3,2,1,0} copy(%a)
"""
    shapes = profile_step.hlo_shapes(hlo)
    assert (
        shapes["custom-call.9"].endswith("__cublas$lt$matmul")
        and shapes["loop_add_fusion.1"] == "f32[8192,2048] kLoop"
    )
    events = [  # two profiled steps: (operation, kernel, microseconds, launches)
        ("dot_product_attention_fwd.4", "cudnn_fmha_fwd", 900, 2),
        ("dot_product_attention_bwd.8", "cudnn_fmha_bwd", 2000, 2),
        ("custom-call.1", "nvjet_sm90_tst", 400, 4),
        ("custom-call.9", "nvjet_sm90_tst", 300, 2),
        ("loop_add_select_fusion", "loop_add_select_fusion", 100, 2),  # once a step: the optimizer
        ("loop_add_fusion.1", "loop_add_fusion_1", 60, 6),  # a layer's gradient, inside the scan
        ("all-reduce.3", "ncclDevKernel_AllReduce", 50, 2),
        ("copy.21", "MemcpyD2D", 40, 2),
        ("mpmd_map.131", "bpt_flash_hopper_dkdvdq_mosaic_gpu_kernel", 200, 2),  # a ring hop's backward
        ("mpmd_map.124", "bpt_flash_hopper_fwd_mosaic_gpu_kernel", 80, 2),
        ("pallas_call.7", "bpt_layer_norm_bwd__1", 30, 2),  # a norm kernel, not attention's
    ]
    trace = [
        {"name": kernel, "dur": us / n, "args": {"hlo_op": op}}
        for op, kernel, us, n in events
        for _ in range(n)
    ]
    summary = profile_step.summarize(trace, 2, shapes)
    gemm = [{"name": k, "dur": 5, "args": {"hlo_op": "custom-call.3"}} for k in ("Memset 3", "nvjet_sm90_tss")]
    assert profile_step.summarize(gemm, 1)["ops"][0] | {"kernel": ""} == {
        "op": "custom-call.3", "ms": 0.01, "calls": 2, "runs": 1, "kernel": "", "hlo": ""
    }
    assert summary["kernel_ms_per_step"] == pytest.approx(sum(us for _, _, us, _ in events) / 2e3)
    assert summary["ops"][0]["op"] == "dot_product_attention_bwd.8" and summary["ops"][0]["calls"] == 1
    parts = profile_step.by_part(
        summary["ops"], vocab_sizes={50257, 50304}, param_shapes={"f32[24,2048,8192]"}
    )
    assert parts == pytest.approx(
        {
            "attention forward": 0.49,
            "attention backward": 1.1,
            "dense matmuls": 0.2,
            "LM head and loss": 0.15,
            "optimizer and gradient sums": 0.05,
            "collectives": 0.025,
            "copies": 0.02,
            "elementwise and norms": 0.045,
        }
    )
    assert list(parts) == [p for p in profile_step.PARTS if p in parts]


def test_profile_lists_what_a_fusion_computes():
    """profile_step's --fusions table: each fusion's opcodes (from the computation it calls)
    and the bytes of its operands and result, turned into a bandwidth by the profiled time."""
    profile_step = load_script("profile_step")
    hlo = """
%fused_add_norm (param_0: bf16[8,1024], param_1: bf16[8,1024], param_2: f32[1024]) -> (bf16[8,1024], f32[8]) {
  %param_0 = bf16[8,1024]{1,0} parameter(0)
  %param_1 = bf16[8,1024]{1,0} parameter(1)
  %add.1 = bf16[8,1024]{1,0} add(%param_0, %param_1)
  %constant.2 = f32[] constant(0)
  %reduce.3 = f32[8]{0} reduce(%add.1, %constant.2), dimensions={1}, to_apply=%sum
  %rsqrt.4 = f32[8]{0} rsqrt(%reduce.3)
  ROOT %tuple.5 = (bf16[8,1024]{1,0}, f32[8]{0}) tuple(%add.1, %rsqrt.4)
}

ENTRY %main (a: bf16[8,1024], b: bf16[8,1024], g: f32[1024]) -> (bf16[8,1024], f32[8]) {
  %a = bf16[8,1024]{1,0} parameter(0)
  %b = bf16[8,1024]{1,0} parameter(1)
  %g = f32[1024]{0} parameter(2)
  ROOT %input_add_reduce_fusion.7 = (bf16[8,1024]{1,0}, f32[8]{0}) fusion(%a, %b, %g), kind=kInput, calls=%fused_add_norm
}
"""
    fusions = profile_step.fusion_contents(hlo)
    assert list(fusions) == ["input_add_reduce_fusion.7"]
    f = fusions["input_add_reduce_fusion.7"]
    assert dict(f["ops"]) == {"add": 1, "reduce": 1, "rsqrt": 1}
    assert f["bytes"] == 3 * 8 * 1024 * 2 + 1024 * 4 + 8 * 4
    ops = [{"op": "input_add_reduce_fusion.7", "ms": 0.001, "calls": 10, "kernel": "k", "hlo": ""}]
    table = profile_step.fusions_table(ops, fusions, 5)
    gbs = f["bytes"] * 10 / 1e3  # bytes a step over 1 us, in GB/s
    assert f"| input_add_reduce_fusion.7 | 0.00 | 10 | {gbs:.0f} | add reduce rsqrt |" in table


def test_profile_rates_each_matmul():
    """profile_step's --matmuls table: the FLOPs of a cuBLAS call (its backend config's
    contracting dimensions), of a dot, and of a fusion holding a dot (a Triton GEMM), turned
    into TFLOP/s by the profiled time and compared with a ceiling."""
    profile_step = load_script("profile_step")
    hlo = """
%triton_gemm (param_0: bf16[64,32], param_1: bf16[32,16]) -> bf16[64,16] {
  %param_0 = bf16[64,32]{1,0} parameter(0)
  %param_1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.3 = bf16[64,16]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[16384,2048], w: bf16[2048,8192], x: bf16[4,128,64]) -> bf16[16384,8192] {
  %a = bf16[16384,2048]{1,0} parameter(0)
  %w = bf16[2048,8192]{1,0} parameter(1)
  %x = bf16[4,128,64]{2,1,0} parameter(2)
  %custom-call.14 = (bf16[16384,8192]{1,0}, s8[33554432]{0}) custom-call(bf16[16384,2048]{1,0} %a, bf16[2048,8192]{1,0} %w), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}
  %dot.7 = bf16[4,128,128]{2,1,0} dot(%x, %x), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={2}
  %gemm_fusion = bf16[64,16]{1,0} fusion(%a, %w), kind=kCustom, calls=%triton_gemm
  ROOT %add.1 = bf16[16384,8192]{1,0} add(%a, %a)
}
"""
    flops = profile_step.matmul_flops(hlo)
    assert flops == {
        "custom-call.14": 2.0 * 16384 * 8192 * 2048,
        "dot.7": 2.0 * 4 * 128 * 128 * 64,
        "dot.3": 2.0 * 64 * 16 * 32,
        "gemm_fusion": 2.0 * 64 * 16 * 32,
    }
    ops = [  # the up-projection twice a step in 0.705 ms each: 780 TFLOP/s (a memset before each)
        {"op": "custom-call.14", "ms": 1.41, "calls": 4, "runs": 2, "kernel": "nvjet", "hlo": "bf16[16384,8192]"},
        {"op": "add.1", "ms": 0.5, "calls": 1, "kernel": "loop_add", "hlo": ""},
        {"op": "gemm_fusion", "ms": 0.001, "calls": 1, "kernel": "triton", "hlo": ""},
    ]
    table = profile_step.matmuls_table(ops, flops, 5, peak_tflops=800)
    assert "| custom-call.14 | 1.41 | 2 | 549.8 | 780 | 97% |" in table
    assert "add.1" not in table and "all 2 matmul operations: 1.4 ms a step at 779 TFLOP/s" in table
    assert "at 800 TFLOP/s they would take 1.4 ms" in table
    assert "of the ceiling" in profile_step.matmuls_table(ops, flops, 1) and "%" not in profile_step.matmuls_table(ops, flops, 1)


SMI = """0, 1980, 135.20, 0x0000000000000000
0, 1440, 698.91, 0x0000000000000004
0, 1455, 701.30, 0x0000000000000004
0, 1470, [N/A], 0x0000000000000004
0, 1500, 690.0"""  # nvidia-smi's lines: index, SM MHz, W, throttle reasons; the last two cut short


def test_clock_samples_are_summarized():
    """benchlib.summarize_clock_samples: the median clock, the highest power and the share of
    samples the power limit held the clock in, over nvidia-smi's whole lines only."""
    assert benchlib.summarize_clock_samples(SMI) == {
        "sm_clock_mhz": 1455.0,
        "max_power_w": 701.3,
        "power_capped": pytest.approx(2 / 3),
        "clock_samples": 3,
    }
    assert benchlib.summarize_clock_samples("") == {}
    assert benchlib.ClockSampler().stop() == {}  # no GPU here: nothing sampled, nothing raised


def test_the_gemm_ceiling_script(tmp_path):
    """scripts/bench_gemm.py: a config's layer shapes, calls back to back, a table with the
    clock and power columns only where nvidia-smi sampled them; bad shapes named."""
    bench_gemm = load_script("bench_gemm")
    shapes = bench_gemm.layer_shapes(str(ROOT / "configs/gpt_1b.py"), 16384)
    assert shapes["FFN up"] == (16384, 2048, 8192) and shapes["FFN weight gradient"] == (2048, 16384, 8192)
    with pytest.raises(SystemExit, match="MxKxN"):
        bench_gemm.parse_shapes("16384x2048")
    rows = [
        dict(shape="up", mkn=[2, 3, 4], calls=20, us=700.0, tflops=790.4),
        dict(shape="up", mkn=[2, 3, 4], calls=3000, us=800.0, tflops=681.2, **benchlib.summarize_clock_samples(SMI)),
    ]
    text = bench_gemm.table(rows, "NVIDIA H200")
    assert "| up | 2x3x4 | 20 | 700 | 790 | – | – | – |" in text
    assert "| up | 2x3x4 | 3000 | 800 | 681 | 1455 | 701 | 67% |" in text
    assert "SM clock" not in bench_gemm.table(rows[:1], "cpu")
    run_script("bench_gemm.py", "--shapes", "8x16x8", "--calls", "1,2", "--pause", "0", "--out", "g", cwd=tmp_path)
    lines = (tmp_path / "g" / "table.md").read_text().splitlines()
    assert [line.split(" | ")[2] for line in lines[4:]] == ["1", "2"]


def test_paired_variants_alternate_and_compare_with_the_first(tmp_path):
    """scripts/bench_paired.py: variants parsed by name, rounds alternating (reversed every
    other round), each variant's mean against the first's by the rounds' ratios."""
    bench_paired = load_script("bench_paired")
    assert bench_paired.parse_variant("b: model.q_chunk_size=32; model.attention_options=a=1,b=2") == (
        "b", ["model.q_chunk_size=32", "model.attention_options=a=1,b=2"]
    )
    assert bench_paired.parse_variant("defaults:") == ("defaults", [])
    for bad in ("no colon", ": model.x=1", "b: model.x"):
        with pytest.raises(SystemExit, match="--variant"):
            bench_paired.parse_variant(bad)
    row = dict(compiled_gib=1.0, mfu=0.5, losses=[2.0])
    rows = [
        dict(row, round=0, variant="a", tokens_per_second=100.0),
        dict(row, round=0, variant="b", tokens_per_second=110.0),
        dict(row, round=1, variant="b", tokens_per_second=99.0, sm_clock_mhz=1600.0),
        dict(row, round=1, variant="a", tokens_per_second=90.0),
        dict(row, round=2, variant="a", tokens_per_second=95.0),  # an unfinished round: left out
    ]
    a, b = bench_paired.summary(rows, ["a", "b"])
    assert (a["rounds"], a["ratio"], b["tokens_per_second"]) == (2, 1.0, 104.5)
    assert (b["ratio"], b["ratio_low"], b["ratio_high"]) == (pytest.approx(1.1), pytest.approx(1.1), pytest.approx(1.1))
    text = bench_paired.tables(rows, ["a", "b"], {"device": "cpu", "jax": "0"})
    assert "| 1 | b | 99 | 50.00% | 1600 | 2.0000 |" in text and "| 0 | a | 100 | 50.00% | – | 2.0000 |" in text
    assert "| b | 2 | 104 | 50.00% | 1.1000x | 1.1000-1.1000 | 1.00 | 2.0000 |" in text
    proc = run_script(
        "bench_paired.py", f"--config={TINY}", "--seq_len=64", "--batch=2", "--variant=a:",
        "--variant=b: model.q_chunk_size=32; model.kv_chunk_size=32", "--rounds=2", "--steps=1", "--warmup=0",
        "--out=p", cwd=tmp_path,
    )  # fmt: skip
    rounds = [line.split(" | ")[:2] for line in proc.stdout.splitlines() if line.startswith("| 0 |") or line.startswith("| 1 |")]
    assert rounds == [["| 0", "a"], ["| 0", "b"], ["| 1", "b"], ["| 1", "a"]]
    results = json.loads((tmp_path / "p" / "results.json").read_text())
    losses = {s["variant"]: s["loss"] for s in results["summary"]}
    assert losses["a"] == pytest.approx(losses["b"], rel=1e-5)  # chunk sizes leave the function alone


def test_only_training_chooses_the_remat(monkeypatch):
    """bpt-eval and bpt-sample (restore_run -> setup) never compile candidate training steps
    for model.remat_layer=auto; bpt-train (setup with training=True) does."""
    from bpt.train import loop

    chosen = []
    monkeypatch.setattr(loop, "choose_remat", lambda c, **kw: (chosen.append(c.model.remat_layer) or c, None))
    c = tiny("blockwise_parallel", 128)
    c.model.remat_layer = "auto"
    c.data.name = "copy"
    loop.setup(c)
    assert chosen == []
    loop.setup(c, training=True)
    assert chosen == ["auto"]


def test_compare_profiles_groups_an_unrolled_steps_copies_by_kind():
    """scripts/compare_profiles.py: the layers' copies of an operation (fusion.3, fusion.4)
    are one kind with their times and calls summed; kinds only one profile has read "none";
    the kinds that differ most come first; --skip leaves out the kinds it matches."""
    compare = load_script("compare_profiles")

    def op(name, ms, calls, hlo):
        return {"op": name, "ms": ms, "calls": calls, "hlo": hlo}

    a = {
        "kernel_ms_per_step": 12.0,
        "by_part": {"elementwise and norms": 9.0},
        "ops": [
            op("fusion.3", 2.0, 1, "bf16[4,2048] kCustom"),
            op("fusion.4", 3.0, 1, "bf16[4,2048] kCustom"),
            op("fusion.9", 4.0, 2, "f32[4,2048] kCustom"),
            op("custom-call.1", 3.0, 1, "__cublas$lt$matmul"),
        ],
    }
    b = {
        "kernel_ms_per_step": 5.5,
        "by_part": {"elementwise and norms": 2.0},
        "ops": [op("fusion.7", 2.0, 1, "bf16[4,2048] kCustom"), op("custom-call.2", 3.5, 1, "__cublas$lt$matmul")],
    }
    text = compare.compare(a, b, top=3, names=("ln", "rms"))
    assert "kernels a step: ln 12.0 ms, rms 5.5 ms (+6.5)" in text
    assert "  elementwise and norms: 9.0 against 2.0 ms (+7.0)" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows[0] == "| fusion | f32[4,2048] kCustom | 4.00 (2) | none | +4.00 |"
    assert rows[1] == "| fusion | bf16[4,2048] kCustom | 5.00 (2) | 2.00 (1) | +3.00 |"
    assert rows[2] == "| custom-call | __cublas$lt$matmul | 3.00 (1) | 3.50 (1) | -0.50 |"
    assert "cublas" not in compare.compare(a, b, top=3, skip="matmul")


def test_compare_profiles_draws_each_profiles_parts(tmp_path, monkeypatch, capsys):
    """--png: one bar a profile, its parts' shares of the kernel time in PART_ORDER (parts it
    does not know after them); any number of profiles, the table for two only."""
    compare = load_script("compare_profiles")
    a = {"kernel_ms_per_step": 10.0, "by_part": {"copies": 1.0, "dense matmuls": 6.0, "attention forward": 3.0}}
    b = {"kernel_ms_per_step": 4.0, "by_part": {"collectives": 1.0, "dense matmuls": 2.0, "a new part": 1.0}, "ops": []}
    assert compare.part_shares(a) == [("dense matmuls", 6.0, 0.6), ("attention forward", 3.0, 0.3), ("copies", 1.0, 0.1)]
    assert [name for name, _, _ in compare.part_shares(b)] == ["dense matmuls", "collectives", "a new part"]
    paths = []
    for name, profile in (("a", a), ("b", b), ("c", b)):
        path = tmp_path / name / "profile.json"
        path.parent.mkdir()
        path.write_text(json.dumps(profile))
        paths.append(str(path))
    png = tmp_path / "parts.png"
    monkeypatch.setattr("sys.argv", ["compare_profiles.py", *paths, "--names", "x,y,z", "--png", str(png)])
    compare.main()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "kernels a step" not in capsys.readouterr().out  # three profiles: no table
    monkeypatch.setattr("sys.argv", ["compare_profiles.py", *paths])
    with pytest.raises(SystemExit):
        compare.main()
    assert "the comparison takes two profiles" in capsys.readouterr().err
