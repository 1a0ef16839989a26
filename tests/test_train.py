"""Configs, the optimizer, the train step, the loop and the bpt-train command."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tree_rel_err

from bpt.config import base_config, check_config, load_config_file, model_config, override
from bpt.data.datasets import CopyTask
from bpt.models.gpt import GPT
from bpt.train.loop import create_state, train
from bpt.train.optimizer import decay_mask
from bpt.train.step import make_train_step

REPO = Path(__file__).resolve().parents[1]


def copy_config(steps=40):
    c = base_config("tiny")
    c.data.name = "copy"
    c.data.seq_len = 64
    c.data.copy_symbols = 8
    c.model.q_chunk_size = c.model.kv_chunk_size = c.model.loss_chunk_size = 16
    c.train.steps = steps
    c.train.batch_size = 8
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 5
    c.train.log_every = 5
    c.train.eval_every = 0
    c.train.eval_batches = 2
    return c


def test_tiny_config_trains_on_the_copy_task_and_the_loss_falls(tmp_path):
    c = copy_config(steps=60)
    last = train(c, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(5, 61, 5))
    first, final = records[0]["loss"], records[-1]["loss"]
    assert final < first - 0.5, (first, final)
    assert last["eval_loss"] < first
    assert all(np.isfinite(r["loss"]) for r in records)


def test_a_one_step_run_is_timed_and_eval_batches_zero_skips_evaluation(tmp_path):
    # The step compiles before the loop, so even the first step is timed; a run of one long
    # step (how the longest contexts are measured) still reports its time and throughput.
    c = copy_config(steps=1)
    c.train.eval_batches = 0
    last = train(c, tmp_path)
    assert last["step"] == 1 and last["step_seconds"] > 0
    assert last["tokens_per_sec"] == pytest.approx(8 * 64 / last["step_seconds"])
    assert "eval_loss" not in last


def test_eval_by_position_logs_each_range_at_every_evaluation_and_plots_it(tmp_path):
    from bpt.cli.plot import plot_runs

    c = copy_config(steps=4)
    c.train.update(log_every=2, eval_every=2, eval_by_position=16)
    train(c, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        rows = r["eval_by_position"]
        assert [(b["start"], b["end"]) for b in rows] == [(0, 16), (16, 32), (32, 64)]
        # Every position lies in one range: the ranges' token-weighted mean is the eval loss.
        mean = sum(b["loss"] * b["tokens"] for b in rows) / sum(b["tokens"] for b in rows)
        assert mean == pytest.approx(r["eval_loss"], rel=1e-5)
    assert plot_runs([tmp_path], tmp_path / "curves.png").stat().st_size > 0


def test_the_compile_cache_serves_the_probed_step_and_a_restarted_run(tmp_path, capsys, own_compile_cache):
    """train.compile_cache (every compilation kept here, however short): the step the probe
    compiles (what remat auto measures) is the loop's program, so the run loads it; and a
    second run of the config loads it again. Each says so."""
    from bpt.data.datasets import make_dataset
    from bpt.train import compile_cache
    from bpt.train.probe import TrainingStep

    c = copy_config(steps=1)
    c.train.eval_batches = c.train.checkpoint_every = 0
    c.model.remat_layer = "nothing_saveable"
    c.train.compile_cache = own_compile_cache
    compile_cache.use(c.train.compile_cache)
    TrainingStep(c, vocab_size=make_dataset(c.data, c.seed).vocab_size).compiled()
    assert any((tmp_path / "cache").iterdir())
    for run in ("first", "second"):
        capsys.readouterr()
        hits = compile_cache.hits()
        train(c, tmp_path / run)
        assert compile_cache.hits() > hits, run
        assert "train step loaded from the compile cache" in capsys.readouterr().out, run


def test_the_loop_runs_the_step_remat_auto_compiled_also_after_resuming(tmp_path, capsys, monkeypatch):
    """bpt-train runs the step remat auto compiled for its choice, neither compiled again nor
    loaded from the compile cache (which misses when bpt's Mosaic GPU kernels are lowered
    again), also after resuming from a checkpoint (a restored state has the fresh one's types
    and layout); and it trains as the named policy's own step does, to the last bit."""
    import bpt.train.probe as probe

    monkeypatch.setattr(probe, "memory_budget", lambda memory_gib=0.0: 1 << 40)  # the first policy fits
    c = copy_config(steps=2)
    c.train.log_every, c.train.eval_batches, c.train.checkpoint_every = 1, 0, 2
    c.train.compile_cache = ""  # off: only the reuse can spare the compilation
    c.model.remat_layer = "auto"
    reused = "train step: the one remat auto compiled (not compiled again)"
    capsys.readouterr()
    train(c, tmp_path / "auto")
    out = capsys.readouterr().out
    assert "model.remat_layer=auto: attention_and_dots_saveable" in out
    assert "kernels: attention_impl=" in out  # what auto resolved to (GPT.resolved_impls)
    assert reused in out
    c.train.steps = 3
    train(c, tmp_path / "auto")
    out = capsys.readouterr().out
    assert "resuming from the checkpoint at step 2" in out
    assert reused in out
    c.model.remat_layer = "attention_and_dots_saveable"
    for steps in (2, 3):  # stopped and resumed alike (train.steps sets the schedule's length)
        c.train.steps = steps
        train(c, tmp_path / "named")
    assert reused not in capsys.readouterr().out

    def losses(run):
        return [json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    assert len(losses("auto")) == 3
    assert losses("auto") == losses("named")


def test_compile_cache_setting(tmp_path, monkeypatch):
    from bpt.train.compile_cache import cache_dir

    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert cache_dir("auto") == tmp_path / "jax"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("BPT_CACHE", str(tmp_path / "bpt"))  # where the corpora go too
    assert cache_dir("auto") == tmp_path / "bpt" / "compiled"
    assert cache_dir("") is None
    assert cache_dir("~/c") == Path.home() / "c"
    with pytest.raises(ValueError, match='train.compile_cache must be "auto", "" \\(off\\) or a folder; got 1'):
        cache_dir(1)


def test_gradient_accumulation_matches_one_big_batch():
    c = copy_config()
    model = GPT(model_config(c.model, vocab_size=9, seq_len=64))
    rng = jax.random.PRNGKey(0)
    batch = {k: jnp.asarray(v) for k, v in CopyTask(64, 8, 0).train_batch(0, 8).items()}
    batch["loss_mask"] = batch["loss_mask"].at[:4, 40:].set(0.0)  # unequal token counts per micro-batch
    states, loops = {}, {}
    for accum, unroll in ((1, False), (2, False), (4, False), (2, True)):
        state = create_state(c, model, rng)
        step = jax.jit(make_train_step(accum, unroll=unroll))
        states[accum, unroll], metrics = step(state, batch, rng)
        if accum == 1:
            loss1 = metrics["loss"]
        assert abs(float(metrics["loss"]) - float(loss1)) < 1e-5
        loops[accum, unroll] = step.lower(state, batch, rng).as_text().count("stablehlo.while")
    # train.grad_accum_unroll: the micro-batches straight-line in the program, one loop (the
    # one over them) fewer than the model's own loops and that one
    assert loops[2, True] == loops[2, False] - 1 and loops[2, False] == loops[4, False], loops
    for key in ((2, False), (4, False), (2, True)):
        assert tree_rel_err(states[key].params, states[1, False].params) < 1e-5


def test_weight_decay_only_on_matrices():
    c = copy_config()
    model = GPT(model_config(c.model, vocab_size=9, seq_len=64))
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), jnp.zeros((1, 64), jnp.int32))["params"])
    mask = decay_mask(params)
    assert mask["embedding"] and mask["layers"]["wq"] and mask["layers"]["w1"]
    assert not mask["layers"]["b1"] and not mask["layers"]["ln1_scale"] and not mask["ln_f_bias"]


def test_bf16_optimizer_state_halves_the_moments_and_tracks_float32():
    c = copy_config()
    model = GPT(model_config(c.model, vocab_size=9, seq_len=64))
    batch = {k: jnp.asarray(v) for k, v in CopyTask(64, 8, 0).train_batch(0, 8).items()}
    step = jax.jit(make_train_step(1))
    deltas = {}
    for dtype in ("float32", "bfloat16"):
        c.train.optimizer_state_dtype = dtype
        state = start = create_state(c, model, jax.random.PRNGKey(0))
        moments = [x for x in jax.tree.leaves(state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
        assert {x.dtype for x in moments} == {jnp.dtype(dtype)}
        assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype("float32")}
        for i in range(5):
            state, _ = step(state, batch, jax.random.PRNGKey(i))
        assert {x.dtype for x in jax.tree.leaves(state.opt_state) if x.dtype != jnp.int32} == {
            jnp.dtype(dtype)
        }
        deltas[dtype] = jax.tree.map(jnp.subtract, state.params, start.params)
    # The updates agree to bf16's precision (relative to the update, not to the parameters).
    assert tree_rel_err(deltas["bfloat16"], deltas["float32"]) < 2e-2


def test_override_reads_the_fields_type():
    c = base_config("tiny")
    override(c, "model.remat_group=2")
    override(c, "model.offload_layer_inputs=true")
    override(c, "train.learning_rate=1e-3")
    override(c, "train.optimizer_state_dtype=bfloat16")
    override(c, "model.vocab_size=300")  # a placeholder: its declared type
    assert c.model.remat_group == 2 and c.model.offload_layer_inputs is True
    assert c.train.learning_rate == 1e-3 and c.model.vocab_size == 300
    assert c.train.optimizer_state_dtype == "bfloat16"
    with pytest.raises(ValueError, match="unknown key model.remat_groups; did you mean model.remat_group"):
        override(c, "model.remat_groups=2")
    with pytest.raises(ValueError, match="unknown key model.steps; did you mean train.steps"):
        override(c, "model.steps=2")
    with pytest.raises(ValueError, match="config.model.remat_group=two: invalid literal for int"):
        override(c, "model.remat_group=two")
    with pytest.raises(ValueError, match="config.model.scan_layers=maybe"):
        override(c, "model.scan_layers=maybe")


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("train.optimizer_state_dtype", "float16", "unknown train.optimizer_state_dtype 'float16'; allowed"),
        ("data.seq_len", 100, "data.seq_len=100 is not divisible by model.q_chunk_size=16"),
        ("model.ffn_chunk_size", 48, "is not divisible by model.ffn_chunk_size=48"),
        ("data.name", "owt", "unknown data.name 'owt'"),
        ("train.batch_size", 6, "train.batch_size=6 is not divisible by train.grad_accum_steps=4"),
        ("model.kv_chunk_size", 0, "model.kv_chunk_size must be a positive integer"),
        ("train.steps", 0, "train.steps must be a positive integer"),
        ("train.learning_rate", -1e-3, "train.learning_rate must be > 0.0; got -0.001"),
        ("train.b2", 1.0, "train.b2 must be >= 0.0 and < 1.0; got 1.0"),
        ("train.memory_fraction", 0.0, "train.memory_fraction must be > 0.0 and <= 1.0"),
        ("train.sample_top_p", 0.0, "train.sample_top_p must be > 0.0"),
        ("train.grad_clip", 0.0, "train.grad_clip must be > 0.0"),
        ("model.dropout", 1.0, r"model.dropout must be in \[0, 1\)"),
        ("model.mlp_ratio", -2.0, "model.mlp_ratio must be > 0"),
    ],
)
def test_bad_config_is_a_clear_error(field, value, message):
    c = copy_config()
    c.train.grad_accum_steps = 4
    section, name = field.split(".")
    c[section][name] = value
    with pytest.raises(ValueError, match=message):
        check_config(c)


def test_every_config_file_loads_and_builds_a_model():
    for path in sorted((REPO / "configs").glob("*.py")):
        c = load_config_file(path)
        check_config(c)
        cfg = model_config(c.model, vocab_size=257, seq_len=c.data.seq_len)
        assert cfg.num_params() > 0, path.name
    assert model_config(base_config("3b").model, vocab_size=257, seq_len=8).dim_per_head == 80


def run_cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "bpt.cli.train", *args], cwd=cwd, capture_output=True, text=True
    )


def test_command_line_runs_and_rejects_unknown_keys(tmp_path):
    config = str(REPO / "configs" / "tiny.py")
    bad = run_cli("--config", config, "--config.model.attention_mod=vanilla", cwd=tmp_path)
    assert bad.returncode != 0 and "attention_mod" in bad.stderr
    ok = run_cli(
        "--config",
        config,
        "--workdir",
        str(tmp_path / "run"),
        "--config.data.name=copy",
        "--config.train.steps=4",
        "--config.train.log_every=2",
        "--config.model.attention_mode=memory_efficient",
        cwd=tmp_path,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [2, 4]
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model"]["attention_mode"] == "memory_efficient"


def test_ctrl_c_stops_after_the_step_with_a_log_line_and_a_checkpoint(tmp_path, monkeypatch, capsys):
    original = CopyTask.train_batch

    def press_ctrl_c_during_step_7(self, step, batch_size):
        if step == 6:  # the batch of the 7th step
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, step, batch_size)

    monkeypatch.setattr(CopyTask, "train_batch", press_ctrl_c_during_step_7)
    c = copy_config(steps=20)
    c.data.prefetch = 0  # batches made in step order, so the signal lands inside step 7
    last = train(c, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 7]
    assert last["step"] == 7 and "eval_loss" in last
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["7"]
    out = capsys.readouterr()
    assert "stopped after step 7" in out.out
    assert out.err.replace("\r", "\n").strip().splitlines()[-1].split("|")[-1].strip().startswith("7/20")


def nan_at(monkeypatch, bad_step):
    """Makes the loss of the batch of step index bad_step NaN (through its loss mask)."""
    original = CopyTask.train_batch

    def train_batch(self, step, batch_size):
        batch = original(self, step, batch_size)
        if step == bad_step:
            batch["loss_mask"] = np.full_like(batch["loss_mask"], np.nan)
        return batch

    monkeypatch.setattr(CopyTask, "train_batch", train_batch)


def test_a_nan_step_stops_the_run_naming_it_before_any_save(tmp_path, monkeypatch):
    nan_at(monkeypatch, 7)  # the 8th step
    c = copy_config(steps=20)
    c.train.checkpoint_every = 5
    c.train.async_checkpoints = False
    with pytest.raises(FloatingPointError, match="step 8 gave loss nan and gradient norm nan"):
        train(c, tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["5"]


def test_skip_nonfinite_skips_the_update_and_counts_it(tmp_path, monkeypatch):
    c = copy_config()
    model = GPT(model_config(c.model, vocab_size=9, seq_len=64))
    state = create_state(c, model, jax.random.PRNGKey(0))
    batch = CopyTask(64, 8, 0).train_batch(0, 8)
    batch["loss_mask"][0, -1] = np.inf
    step = jax.jit(make_train_step(1))
    new, metrics = step(state, batch, jax.random.PRNGKey(1))
    assert not bool(metrics["finite"]) and int(new.step) == int(state.step) + 1
    assert int(metrics["skipped_steps"]) == 1
    assert tree_rel_err(new.params, state.params) == 0.0
    assert tree_rel_err(new.opt_state.inner_state, state.opt_state.inner_state) == 0.0
    batch["loss_mask"][0, -1] = 1.0
    new, metrics = step(state, batch, jax.random.PRNGKey(1))
    assert bool(metrics["finite"]) and int(metrics["skipped_steps"]) == 0
    assert tree_rel_err(new.opt_state.inner_state, state.opt_state.inner_state) > 0  # lr is 0 at step 0

    nan_at(monkeypatch, 7)
    c = copy_config(steps=10)
    c.train.skip_nonfinite = True
    c.train.checkpoint_every = 10
    last = train(c, tmp_path)
    assert last["step"] == 10 and last["skipped_steps"] == 1 and np.isfinite(last["loss"])
    c.train.steps = 15  # the count lives in the optimizer state: it survives the resume
    last = train(c, tmp_path)
    assert last["step"] == 15 and last["skipped_steps"] == 1
