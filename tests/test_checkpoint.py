"""Checkpoints: exact resume, interrupted and damaged saves, params-only init, NaN refusal."""

import json
import os
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import copy_config

from bpt.config import model_config
from bpt.data.datasets import CopyTask
from bpt.models.gpt import GPT
from bpt.train import loop
from bpt.train.checkpoint import CheckpointError, Checkpoints, ModelMismatch, load_params
from bpt.train.loop import create_state, evaluate_checkpoint, train


def run_config(steps=12):
    c = copy_config(steps=steps)
    c.train.log_every = 1
    c.train.checkpoint_every = 4
    c.train.async_checkpoints = False
    c.data.prefetch = 0  # interrupt_at signals from inside the batch of a step
    return c


def losses(workdir) -> dict[int, float]:
    """The last logged loss of every step (a resumed run logs its steps again)."""
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def interrupt_at(monkeypatch, stop_step):
    """Presses Ctrl-C while step stop_step runs: the run stops after it."""
    original = CopyTask.train_batch

    def train_batch(self, step, batch_size):
        if step == stop_step - 1:
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, step, batch_size)

    monkeypatch.setattr(CopyTask, "train_batch", train_batch)
    return original


def test_resumed_run_logs_exactly_the_same_losses(tmp_path, monkeypatch):
    train(run_config(), tmp_path / "straight")
    expected = losses(tmp_path / "straight")

    resumed = tmp_path / "resumed"
    original = interrupt_at(monkeypatch, 6)
    train(run_config(), resumed)  # stops after step 6 and saves it
    monkeypatch.setattr(CopyTask, "train_batch", original)
    assert sorted(int(p.name) for p in (resumed / "checkpoints").iterdir()) == [4, 6]

    # As if the process had been killed before the save at step 6: resume from step 4.
    shutil.rmtree(resumed / "checkpoints" / "6")
    train(run_config(), resumed)
    got = losses(resumed)
    assert sorted(got) == list(range(1, 13))
    for step in range(5, 13):
        assert got[step] == expected[step], step  # bitwise


def test_resume_on_packed_jsonl_documents_with_prefetch_is_exact(tmp_path):
    """The datasets path, segment ids and the prefetch thread, killed after the save at step 4."""
    rng = np.random.default_rng(0)
    words = ["thou", "art", "more", "lovely", "and", "temperate", "rough", "winds", "do", "shake"]
    docs = [" ".join(rng.choice(words, size=rng.integers(5, 40))) for _ in range(60)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    c = run_config(steps=8)
    c.data.update(
        name="hf",
        path=str(tmp_path / "docs.jsonl"),
        seq_len=64,
        segment_ids=True,
        val_fraction=0.1,
        prefetch=2,
        cache_dir=str(tmp_path / "cache"),
    )
    train(c, tmp_path / "straight")
    expected = losses(tmp_path / "straight")
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "4", tmp_path / "resumed" / "checkpoints" / "4")
    train(c, tmp_path / "resumed")
    got = losses(tmp_path / "resumed")
    assert sorted(got) == [5, 6, 7, 8]
    assert all(got[s] == expected[s] for s in got), (got, expected)  # bitwise


def test_an_interrupted_save_leaves_the_last_good_checkpoint(tmp_path):
    train(run_config(steps=8), tmp_path)
    ckpt = tmp_path / "checkpoints"
    # What a crash in the middle of writing step 12 leaves: a temporary folder, half written.
    partial = ckpt / "12.orbax-checkpoint-tmp-1700000000"
    shutil.copytree(ckpt / "8", partial)
    shutil.rmtree(partial / "opt_state")
    for f in (partial / "params").rglob("*"):
        if f.is_file():
            f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])

    c = run_config(steps=8)
    model = GPT(model_config(c.model, vocab_size=9, seq_len=c.data.seq_len))
    fresh = create_state(c, model, jax.random.PRNGKey(0))
    with Checkpoints(ckpt, keep=3, async_save=False) as checkpoints:
        assert checkpoints.steps() == [4, 8]
        state, meta = checkpoints.restore_latest(fresh)
    assert int(state.step) == 8 and meta["data_step"] == 8
    assert not partial.exists()  # leftovers of the interrupted save are cleaned up


def trained_run(tmp_path_factory, name="run"):
    """A finished 8-step run with checkpoints at steps 4 and 8 (copied per test: they damage it)."""
    folder = tmp_path_factory.getbasetemp() / "shared_run"
    if not folder.exists():
        train(run_config(steps=8), folder)
    return folder


@pytest.fixture
def run8(tmp_path_factory, tmp_path):
    shutil.copytree(trained_run(tmp_path_factory), tmp_path / "run")
    return tmp_path / "run"


def fresh_state(steps=8):
    c = run_config(steps=steps)
    model = GPT(model_config(c.model, vocab_size=9, seq_len=c.data.seq_len))
    return create_state(c, model, jax.random.PRNGKey(0))


def largest_file(folder):
    return max((f for f in folder.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


def folders(ckpt):
    return sorted(p.name for p in ckpt.iterdir())


def test_a_truncated_checkpoint_is_set_aside_by_training_and_only_reported_by_readers(run8, capsys):
    ckpt = run8 / "checkpoints"
    truncate(largest_file(ckpt / "8" / "params"))

    # A reader (bpt-eval, bpt-sample) falls back to step 4 and moves nothing.
    with Checkpoints(ckpt, read_only=True) as checkpoints:
        state, _ = checkpoints.restore_latest(fresh_state())
    assert int(state.step) == 4 and folders(ckpt) == ["4", "8"]
    assert "checkpoint at step 8 is damaged" in capsys.readouterr().out
    assert evaluate_checkpoint(run8)["step"] == 4 and folders(ckpt) == ["4", "8"]

    # Training skips it, says so in one line, resumes from step 4, and sets it aside when it
    # saves its own first checkpoint (step 8 again).
    last = train(run_config(steps=8), run8)
    out = capsys.readouterr().out
    assert "checkpoint at step 8 is damaged" in out and "8.damaged" in out and "TensorStore" not in out
    assert "resuming from the checkpoint at step 4" in out
    assert last["step"] == 8 and folders(ckpt) == ["4", "8", "8.damaged"]
    steps = [json.loads(line)["step"] for line in (run8 / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps))  # resuming at 4 dropped the old rows of steps 5-8
    # Damaged again at the same step: set aside beside the first, which is kept.
    truncate(largest_file(ckpt / "8" / "params"))
    train(run_config(steps=8), run8)
    assert folders(ckpt) == ["4", "8", "8.damaged", "8.damaged.1"]


def test_a_run_that_fails_before_its_first_checkpoint_leaves_a_damaged_run_as_it_was(run8, monkeypatch):
    """Resuming past a damaged checkpoint and failing before the next save moves nothing:
    every file of the workdir is as it was, byte for byte."""
    truncate(largest_file(run8 / "checkpoints" / "8" / "params"))
    before = {p.relative_to(run8): p.read_bytes() for p in run8.rglob("*") if p.is_file()}
    real = loop.jit_steps

    def jit_steps(*args):
        train_step, eval_fn, sharding = real(*args)

        class FailsAtStep6:
            lower = train_step.lower
            calls = 0

            def __call__(self, *a):
                self.calls += 1
                if self.calls == 2:
                    raise RuntimeError("the device fell off the bus")
                return train_step(*a)

        return FailsAtStep6(), eval_fn, sharding

    monkeypatch.setattr(loop, "jit_steps", jit_steps)
    with pytest.raises(RuntimeError, match="fell off the bus"):
        train(run_config(steps=12), run8)
    after = {p.relative_to(run8): p.read_bytes() for p in run8.rglob("*") if p.is_file()}
    assert after.keys() == before.keys() and after == before


def test_when_no_checkpoint_loads_readers_say_why_and_training_announces_a_restart(run8, capsys):
    ckpt = run8 / "checkpoints"
    for step in ("4", "8"):
        largest_file(ckpt / step / "opt_state").unlink()
    with pytest.raises(FileNotFoundError, match="no checkpoint .* loads .damaged: step 8: .*step 4"):
        evaluate_checkpoint(run8)
    assert folders(ckpt) == ["4", "8"]
    capsys.readouterr()
    train(run_config(steps=2), run8)
    out = capsys.readouterr().out
    assert "starts again from step 0" in out
    steps = [json.loads(line)["step"] for line in (run8 / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # the rows of the lost run are gone, not duplicated


def test_a_read_error_once_is_retried_and_a_lasting_one_stops_without_moving_anything(run8, monkeypatch):
    ckpt = run8 / "checkpoints"
    real = Checkpoints._read
    failures = {"left": 1}

    def flaky(self, step, state, vocab_size=None):
        if failures["left"]:
            failures["left"] -= 1
            raise OSError(5, "Input/output error")
        return real(self, step, state, vocab_size)

    monkeypatch.setattr(Checkpoints, "_read", flaky)
    with Checkpoints(ckpt) as checkpoints:
        state, _ = checkpoints.restore_latest(fresh_state())
    assert int(state.step) == 8 and folders(ckpt) == ["4", "8"]

    failures["left"] = 10**6
    with (
        Checkpoints(ckpt) as checkpoints,
        pytest.raises(CheckpointError, match="Input/output error.*left as it is"),
    ):
        checkpoints.restore_latest(fresh_state())
    assert folders(ckpt) == ["4", "8"]


# A restore that stops on a mismatched array leaves orbax's other pending reads unawaited;
# Python then reports their coroutines, whenever they are collected.
@pytest.mark.filterwarnings("ignore:coroutine '_read_array_index_and_device_put' was never awaited:RuntimeWarning")
def test_a_checkpoint_of_another_model_or_optimizer_stops_the_run_naming_what_differs(run8):
    before = (run8 / "config.json").read_text()
    c = run_config(steps=12)
    c.model.d_model = 64
    with pytest.raises(
        ModelMismatch, match=r"parameters of another shape.*\['embedding'\] \[128, 128\] vs \[128, 64\]"
    ):
        train(c, run8)
    c = run_config(steps=12)
    c.model.tie_embeddings = False
    with pytest.raises(ModelMismatch, match=r"not in the checkpoint: \['lm_head'\]"):
        train(c, run8)
    assert folders(run8 / "checkpoints") == ["4", "8"]
    assert (run8 / "config.json").read_text() == before  # a rejected run writes nothing
    with pytest.raises(ModelMismatch, match="do not fit the configured model"):
        c = run_config(steps=12)
        c.model.d_model = 64
        model = GPT(model_config(c.model, vocab_size=9, seq_len=64))
        load_params(run8, create_state(c, model, jax.random.PRNGKey(0)).params)


def test_params_only_init_into_another_dtype(tmp_path):
    c = run_config(steps=4)
    train(c, tmp_path / "base")
    c.model.param_dtype = "bfloat16"
    model = GPT(model_config(c.model, vocab_size=9, seq_len=c.data.seq_len))
    like = create_state(c, model, jax.random.PRNGKey(7)).params
    params = load_params(tmp_path / "base", like)
    c32 = run_config(steps=4)
    with Checkpoints(tmp_path / "base" / "checkpoints", async_save=False) as saved:
        state32, _ = saved.restore_latest(
            create_state(c32, GPT(model_config(c32.model, vocab_size=9, seq_len=64)), jax.random.PRNGKey(7))
        )
    for p, p32 in zip(jax.tree.leaves(params), jax.tree.leaves(state32.params), strict=True):
        assert p.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(p), np.asarray(p32.astype(jnp.bfloat16)))
    # (A fine-tuning run from params_from, through train(), is tested in test_hf.py.)


def test_no_checkpoint_with_nan_is_written(tmp_path):
    c = run_config(steps=4)
    model = GPT(model_config(c.model, vocab_size=9, seq_len=c.data.seq_len))
    state = create_state(c, model, jax.random.PRNGKey(0))
    state = state.replace(params=jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan), state.params))
    with Checkpoints(tmp_path, async_save=False) as checkpoints:
        with pytest.raises(FloatingPointError, match="NaN or inf"):
            checkpoints.save(state, {})
        assert checkpoints.steps() == []


def test_evaluating_a_checkpoint_reproduces_the_runs_final_eval(tmp_path):
    last = train(run_config(steps=8), tmp_path)
    result = evaluate_checkpoint(tmp_path)
    assert result["step"] == 8
    assert result["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-6)
    with pytest.raises(FileNotFoundError, match="must be a bpt-train run"):
        evaluate_checkpoint(tmp_path / "elsewhere")


def test_params_only_init_resizes_a_learned_position_table(tmp_path):
    # Fine-tuning at a longer context grows the table (extend_positions), at a shorter one
    # keeps its first rows; every other parameter loads as saved.
    c = run_config(steps=4)
    c.model.position_embedding = "learned"
    train(c, tmp_path / "base")
    with Checkpoints(tmp_path / "base" / "checkpoints", async_save=False) as saved:
        model = GPT(model_config(c.model, vocab_size=9, seq_len=64))
        base, _ = saved.restore_latest(create_state(c, model, jax.random.PRNGKey(7)))
    table = np.asarray(base.params["position_embedding"])
    for seq_len in (32, 128):
        model = GPT(model_config(c.model, vocab_size=9, seq_len=seq_len))
        params = load_params(tmp_path / "base", create_state(c, model, jax.random.PRNGKey(7)).params)
        resized = np.asarray(params["position_embedding"])
        assert resized.shape == (seq_len, table.shape[1])
        if seq_len < 64:
            np.testing.assert_array_equal(resized, table[:seq_len])
        else:  # interpolated: the first and last rows are the saved ones
            np.testing.assert_array_equal(resized[[0, -1]], table[[0, -1]])
        np.testing.assert_array_equal(np.asarray(params["embedding"]), np.asarray(base.params["embedding"]))


def test_a_run_saved_before_the_vocabulary_was_padded_still_restores_and_resumes(tmp_path, monkeypatch):
    """A checkpoint whose embedding and head hold the 9 tokens unpadded (model.vocab_multiple
    did not exist: config.json lacks it) evaluates, resumes with the padded model (its
    optimizer moments padded too) to the losses an unpadded run logs, and loads as
    params_from; another vocabulary still stops the run."""
    c = run_config(steps=8)
    c.model.tie_embeddings = False
    c.model.vocab_multiple = 1
    train(c, tmp_path / "straight")
    old = tmp_path / "old"
    original = interrupt_at(monkeypatch, 4)  # the same schedule as the straight run's
    last = train(c, old)
    monkeypatch.setattr(CopyTask, "train_batch", original)
    assert last["step"] == 4
    saved = json.loads((old / "config.json").read_text())
    del saved["model"]["vocab_multiple"]  # as a run from before the setting reads
    (old / "config.json").write_text(json.dumps(saved))

    assert evaluate_checkpoint(old)["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-6)
    resumed = run_config(steps=8)
    resumed.model.tie_embeddings = False  # vocab_multiple: the default, 128
    train(resumed, old)
    for step in range(5, 9):
        assert losses(old)[step] == pytest.approx(losses(tmp_path / "straight")[step], rel=1e-5), step
    with Checkpoints(old / "checkpoints", read_only=True) as checkpoints:
        model = GPT(model_config(resumed.model, vocab_size=9, seq_len=64))
        state, _ = checkpoints.restore_latest(create_state(resumed, model, jax.random.PRNGKey(0)), vocab_size=9)
    assert state.params["embedding"].shape == (128, 128) and state.params["lm_head"].shape == (128, 128)

    like = create_state(resumed, model, jax.random.PRNGKey(0)).params
    params = load_params(tmp_path / "straight", like, vocab_size=9)
    assert params["embedding"].shape == (128, 128) and not np.asarray(params["embedding"][9:]).any()
    with pytest.raises(ModelMismatch, match="past the model's 5 tokens are not zeros: it was trained with another vocabulary"):
        small = run_config(steps=8)
        small.model.vocab_size, small.model.tie_embeddings = 5, False
        five = GPT(model_config(small.model, vocab_size=5, seq_len=64))
        load_params(tmp_path / "straight", create_state(small, five, jax.random.PRNGKey(0)).params, vocab_size=5)


def test_a_flash_run_saved_before_the_papers_recipe_restores_as_it_was_trained(tmp_path):
    """A FLASH run saved before model.linear_norm and model.absolute_embedding existed (its
    config.json lacks them) restores with what it computed then (the sum, no ScaledSin:
    bpt.config.ADDED_SETTINGS), not today's defaults (the mean, ScaledSin), whose parameters
    and function differ."""
    from bpt.config import FLASH_RECIPES, set_family

    c = run_config(steps=4)
    set_family(c, "flash").update(num_layers=2, chunk_size=16, qk_dim=16, **FLASH_RECIPES["bpt"])
    last = train(c, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    for name in ("linear_norm", "absolute_embedding"):
        del saved["model"][name]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    config, _, model, _ = loop.restore_run(tmp_path)
    assert (model.config.linear_norm, model.config.absolute_embedding) == ("sum", "none")
    assert evaluate_checkpoint(tmp_path)["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-6)


def test_checkpoint_every_zero_trains_without_checkpoints(tmp_path):
    c = run_config(steps=3)
    c.train.checkpoint_every = 0
    last = train(c, tmp_path)
    assert last["step"] == 3 and not (tmp_path / "checkpoints").exists()


def folder_bytes(workdir):
    return {str(p.relative_to(workdir)): p.read_bytes() for p in sorted(workdir.rglob("*")) if p.is_file()}


def test_a_resume_that_fails_before_its_first_checkpoint_leaves_the_run_as_it_was(tmp_path):
    """Resuming with a learning rate that blows up stops at a non-finite loss before the next
    checkpoint: config.json still describes the checkpoints, and no file of the folder
    changed (metrics.jsonl included); an infinite learning rate is refused at once."""
    c = run_config(steps=8)
    train(c, tmp_path)
    before = folder_bytes(tmp_path)
    c = run_config(steps=12)
    c.train.learning_rate = 1e30
    c.train.checkpoint_every = 100  # the only save would be at the end, after the blow-up
    with pytest.raises(FloatingPointError, match="non-finite|gave loss"):
        train(c, tmp_path)
    assert folder_bytes(tmp_path) == before
    c.train.learning_rate = float("inf")
    with pytest.raises(ValueError, match="train.learning_rate must be a finite number; got inf"):
        train(c, tmp_path)
    assert folder_bytes(tmp_path) == before


def test_resuming_with_other_settings_says_each_change_and_keeps_their_history(tmp_path, capsys):
    c = run_config(steps=4)
    train(c, tmp_path)
    c = run_config(steps=8)
    c.train.learning_rate = 5e-4
    train(c, tmp_path)
    out = capsys.readouterr().out
    assert "resuming with changed settings: train.steps 4 -> 8, train.learning_rate 0.003 -> 0.0005" in out
    history = [json.loads(line) for line in (tmp_path / "settings_history.jsonl").read_text().splitlines()]
    assert history[0]["step"] == 0 and history[0]["settings"] == "config.json"
    assert history[1]["step"] == 4 and history[1]["changed"] == {
        "train.steps": [4, 8],
        "train.learning_rate": [0.003, 0.0005],
    }
    assert json.loads((tmp_path / "config.json").read_text())["train"]["learning_rate"] == 5e-4


def test_a_run_stopped_between_two_rows_logs_the_uninterrupted_rows_after_resuming(tmp_path, monkeypatch):
    """Rows every 4 steps; Ctrl-C after step 6 writes a row for steps 5-6 (marked stopped)
    and keeps their metrics in the checkpoint; the resumed run logs the row of step 8 over
    steps 5-8, and metrics.jsonl then has the straight run's rows and losses, as does a run
    that saves every 3 steps."""
    c = run_config(steps=12)
    c.train.log_every = 4
    train(c, tmp_path / "straight")
    original = interrupt_at(monkeypatch, 6)
    train(c, tmp_path / "resumed")
    monkeypatch.setattr(CopyTask, "train_batch", original)
    rows = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 6] and rows[1]["stopped"] is True
    train(c, tmp_path / "resumed")
    read = lambda run: [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    c.train.checkpoint_every = 3  # saves between rows change no row either
    train(c, tmp_path / "every3")
    straight, resumed, every3 = read("straight"), read("resumed"), read("every3")
    assert [r["step"] for r in resumed] == [r["step"] for r in straight] == [r["step"] for r in every3] == [4, 8, 12]
    for a, b, d in zip(resumed, straight, every3):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["accuracy"] == pytest.approx(b["accuracy"])
        assert d["loss"] == pytest.approx(b["loss"], rel=1e-6)


def test_asyncio_reports_of_a_failed_reads_tasks_are_dropped_and_others_kept():
    """On a loaded machine asyncio, not Python's unraisable hook, may report a failed read's
    task ("Task exception was never retrieved", through the logging module): dropped as well;
    asyncio's other reports still reach the log."""
    import logging

    from bpt.train.checkpoint import _QuietLeftoverTasks

    def record(message, exc=None):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, (type(exc), exc, None) if exc else None)

    left = "Task exception was never retrieved\nfuture: <Task finished coro=<_read_array_index_and_device_put() done>>"
    quiet = _QuietLeftoverTasks()
    assert not quiet.filter(record(left))
    assert not quiet.filter(record("Task exception was never retrieved", ValueError("TensorStore({...})")))
    assert quiet.filter(record("Task exception was never retrieved", ValueError("something else")))


def test_a_damaged_checkpoint_is_one_line_in_the_commands_output(run8):
    """Orbax's background reads of a damaged checkpoint leave an exception in each of their
    coroutines (hundreds of "Exception ignored in" lines); bpt-eval says one line about it."""
    import subprocess
    import sys

    truncate(largest_file(run8 / "checkpoints" / "8" / "params"))
    done = subprocess.run(
        [sys.executable, "-m", "bpt.cli.eval", "--workdir", str(run8)], capture_output=True, text=True, timeout=600
    )
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 0 and "Exception ignored" not in done.stderr and "Traceback" not in done.stderr
    assert len(lines) == 2 and "checkpoint at step 8 is damaged" in lines[0] and '"step": 4' in lines[1], lines
