"""The commands as a new user meets them: --help, one-sentence errors, nothing written by a
run that never starts, README commands that run as written, and the run's bookkeeping
(one compile on resume, strict JSON, a finished run, a step too large for the device)."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from test_data import text_config, write_corpus
from test_train import copy_config

import bpt.train.loop as loop
from bpt.train.loop import train
from bpt.train.metrics import MetricsWriter, strict_json

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {
    "train": ["--workdir", "--config", "--coordinator_address"],
    "eval": ["--workdir", "--eval_batches"],
    "sample": ["--workdir", "--num_tokens", "--top_p"],
    "prepare_data": ["--source", "--out", "--overwrite", "--val_fraction"],
    "train_tokenizer": ["--source", "--vocab_size", "--val_fraction"],
    "collect_exorl": ["--domain", "--episodes", "--out", "--num_workers", "--time_limit"],
    "eval_rl": ["--workdir", "--episodes", "--trials", "--target_return"],
}


def command(name, *args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", f"bpt.cli.{name}", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_lists_the_commands_own_flags(name):
    result = command(name, "--help")
    assert result.returncode == 0, result.stderr[-1000:]
    for flag in COMMANDS[name]:
        assert flag in result.stdout.replace("--[no]", "--"), (name, flag)


@pytest.mark.parametrize(
    "args,sentence",
    [
        (["--config.train.stepz=5"], "unknown key train.stepz; did you mean train.steps?"),
        (["--config.model.steps=5"], "unknown key model.steps; did you mean train.steps?"),
        (["--config", "configs/nothere.py"], "config file configs/nothere.py not found"),
        (["--config.train.learning_rate=-0.1"], "train.learning_rate must be > 0.0; got -0.1"),
        (["--config.data.name=owt"], "unknown data.name 'owt'; allowed: shakespeare"),
        (["--local_device_ids=0"], "--local_device_ids is for a run of several processes"),
        (["--config.train.xla_flags=fast"], "train.xla_flags takes a preset (overlap) or XLA flags"),
        (["--local_device_ids=0,x", "--num_processes=2"], "--local_device_ids must be distinct GPU indices"),
    ],
)
def test_a_bad_setting_is_one_sentence_and_writes_nothing(tmp_path, args, sentence):
    result = command("train", "--workdir", str(tmp_path / "run"), *args, cwd=REPO)
    assert result.returncode == 1
    assert sentence in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 2  # the sentence and where the traceback is
    assert not (tmp_path / "run").exists()


def test_a_rejected_run_leaves_an_existing_run_as_it_was(tmp_path):
    c = copy_config(steps=2)
    train(c, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    c.train.learning_rate = -1.0
    with pytest.raises(ValueError, match="train.learning_rate must be > 0.0"):
        train(c, tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def readme_commands(program: str, workdir: str) -> list[list[str]]:
    """The README's lines that run `program` on `workdir`, as argv lists."""
    lines = (REPO / "README.md").read_text().splitlines()
    commands = [shlex.split(line.split("#")[0]) for line in lines if line.startswith(program + " ")]
    return [argv for argv in commands if f"--workdir={workdir}" in argv or workdir in argv]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """A short byte-level run at runs/default, where the README's commands look for it."""
    root = tmp_path_factory.mktemp("readme")
    corpus = write_corpus(root / "corpus", ["Friends, Romans, countrymen, lend me your ears. " * 40])
    c = text_config(corpus, root, seq_len=64)
    c.model.q_chunk_size = c.model.kv_chunk_size = c.model.loss_chunk_size = 16
    c.train.steps, c.train.log_every, c.train.sample_tokens = 2, 2, 0
    train(c, root / "runs" / "default")
    return root


@pytest.mark.parametrize("program", ["bpt-eval", "bpt-sample"])
def test_the_readmes_commands_on_a_run_run_as_written(default_run, program):
    commands = readme_commands(program, "runs/default")
    assert commands, f"the README shows no {program} command on runs/default"
    outputs = []
    for argv in commands:
        module = program.removeprefix("bpt-").replace("-", "_")
        result = command(module, *argv[1:], cwd=default_run)
        assert result.returncode == 0, (argv, result.stderr[-2000:])
        outputs.append(result.stdout)
    if program == "bpt-sample":  # 300 tokens from a 64-token context: several windows
        assert len(outputs[0]) > 3 * 64
        assert "=== sample 2 of 2 ===\nJULIET:" in outputs[1]  # two prompts, one batch


def test_resuming_compiles_the_train_step_once(tmp_path, no_compilation_cache):
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: (
            compiles.append(kw.get("fun_name"))
            if event == "/jax/core/compile/backend_compile_duration"
            else None
        )
    )
    c = copy_config(steps=4)
    c.train.checkpoint_every = 2
    train(c, tmp_path)
    c.train.steps = 8
    compiles.clear()
    last = train(c, tmp_path)
    assert compiles.count("jit(train_step)") == 1, compiles
    assert last["step"] == 8 and last["peak_memory_gib"] > 0  # the process's peak on a CPU


def test_a_finished_run_says_so_and_a_step_too_large_stops_before_writing(tmp_path, monkeypatch, capsys):
    c = copy_config(steps=2)
    first = train(c, tmp_path / "done")
    capsys.readouterr()
    assert train(c, tmp_path / "done") == first
    assert "already at step 2 of train.steps=2; raise train.steps" in capsys.readouterr().out

    monkeypatch.setattr(loop, "memory_budget", lambda: 2**20)  # a 1 MiB device
    with pytest.raises(
        MemoryError, match=r"the train step needs .* GiB per device but the .* has 0.0 GiB.*try "
    ):
        train(c, tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_metrics_are_strict_json(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write({"step": 1, "loss": float("inf"), "grad_norm": float("nan"), "tokens_per_sec": None})
    writer.close()
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    assert json.loads(line, parse_constant=lambda name: pytest.fail(f"non-standard JSON {name}")) == {
        "step": 1,
        "loss": None,
        "grad_norm": None,
        "tokens_per_sec": None,
    }
    assert strict_json({"x": -float("inf")}) == '{"x": null}'


def test_running_out_of_memory_during_a_step_reads_as_the_preflight_message(tmp_path, monkeypatch):
    real = loop.jit_steps

    def jit_steps(*args):
        train_step, eval_fn, sharding = real(*args)

        class OutOfMemoryAtRunTime:
            lower = train_step.lower  # the preflight compiles and passes
            calls = 0

            def __call__(self, *a):
                self.calls += 1
                if self.calls == 2:  # the first step ran
                    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 50.46GiB")
                return train_step(*a)

        return OutOfMemoryAtRunTime(), eval_fn, sharding

    monkeypatch.setattr(loop, "jit_steps", jit_steps)
    with pytest.raises(
        MemoryError,
        match="the train step ran out of memory at step 2 on the .*, though its compiled memory fit; to fit, try .*data.seq_len",
    ):
        train(copy_config(steps=3), tmp_path)


@pytest.mark.filterwarnings("ignore:os.fork")  # jax's warning: this test process imported it; bpt's supervisor does not
def test_a_crash_no_python_error_reports_is_one_sentence_with_the_phase(capsys):
    """A child killed by a signal (a segmentation fault inside XLA's compiler, say): the
    supervising bpt command says what died, in which phase, and what to try."""
    from bpt.cli.common import supervise

    crash = (
        "import os, signal; from bpt.train import phases; "
        "phases.enter('compiling the train step', 'try mesh.context_head_groups=1'); "
        "os.kill(os.getpid(), signal.SIGSEGV)"
    )
    code = supervise([sys.executable, "-c", crash], "bpt-train")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 128 + 11 and len(err) == 1, err
    assert err[0] == (
        "bpt-train: error: the process died of a segmentation fault (SIGSEGV) while compiling the train "
        "step, with no Python error to report; try mesh.context_head_groups=1"
    )
    assert supervise([sys.executable, "-c", "raise SystemExit(3)"], "bpt-train") == 3  # exits pass through


def test_a_signal_to_the_supervisor_reaches_the_child_once(tmp_path):
    """Ctrl-C at a terminal reaches the process group of the command: the child runs in a
    group of its own, so it gets the signal once, from the supervisor (its StopRequest
    would take a second Ctrl-C as 'abort now')."""
    child = tmp_path / "child.py"
    child.write_text(
        "import signal, sys, time, pathlib\n"
        "seen = []\n"
        "signal.signal(signal.SIGINT, lambda *a: seen.append(1))\n"
        f"pathlib.Path({str(tmp_path / 'ready')!r}).write_text('1')\n"
        "while not seen: time.sleep(0.05)\n"
        "time.sleep(0.5)\n"
        "print(len(seen)); sys.exit(0)\n"
    )
    parent = (
        "import sys; from bpt.cli.common import supervise; "
        f"sys.exit(supervise([sys.executable, {str(child)!r}], 'bpt-train'))"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True, start_new_session=True)
    for _ in range(200):
        if (tmp_path / "ready").exists():
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # the whole foreground group, as a terminal does
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.strip() == "1", out


def test_a_run_keeps_its_tokenizer_when_the_original_is_retrained(tmp_path):
    """bpt-train-tokenizer refuses to replace a tokenizer without --overwrite; a run trained
    with it keeps its own copy, so bpt-eval gives the same loss after the original is
    retrained, and resuming with the retrained one is refused."""
    from test_data import PLAYS, write_corpus

    corpus = write_corpus(tmp_path / "corpus", PLAYS)
    tok = tmp_path / "tok"
    assert command("train_tokenizer", "--source", str(corpus), "--vocab_size", "300", "--out", str(tok)).returncode == 0
    run, cache = tmp_path / "run", tmp_path / "cache"
    flags = [f"--config.data.tokenizer={tok}", "--config.data.name=text", f"--config.data.path={corpus}",
             f"--config.data.cache_dir={cache}", "--config.data.seq_len=32", "--config.model.q_chunk_size=16",
             "--config.model.kv_chunk_size=16", "--config.model.loss_chunk_size=16", "--config.train.batch_size=4",
             "--config.train.log_every=2", "--config.train.eval_batches=1", "--config.train.sample_tokens=0"]  # fmt: skip
    trained = command("train", "--config", "configs/tiny.py", "--workdir", str(run), "--config.train.steps=2", *flags, cwd=REPO)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert (run / "tokenizer" / "tokenizer.json").is_file()
    before = json.loads(command("eval", "--workdir", str(run)).stdout)["eval_loss"]

    again = command("train_tokenizer", "--source", str(corpus), "--vocab_size", "350", "--out", str(tok))
    assert again.returncode == 1 and "already exists; choose another --out or pass --overwrite" in again.stderr
    again = command("train_tokenizer", "--source", str(corpus), "--vocab_size", "350", "--out", str(tok), "--overwrite")
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(command("eval", "--workdir", str(run)).stdout)["eval_loss"] == pytest.approx(before, rel=1e-6)
    resumed = command("train", "--config", "configs/tiny.py", "--workdir", str(run), "--config.train.steps=4", *flags, cwd=REPO)
    assert resumed.returncode == 1 and "is not the tokenizer this run was trained with" in resumed.stderr


def test_ctrl_c_outside_the_training_loop_is_one_line(tmp_path):
    """A Ctrl-C while a command compiles (or a second one while it trains) ends it with one
    line and status 130, not a traceback (--debug keeps the traceback)."""
    script = (
        "import sys, types\n"
        "from bpt.cli import common\n"
        "m = types.ModuleType('bpt.cli.train')\n"
        "m.define_flags = lambda: None\n"
        "def main(f, argv):\n"
        "    raise KeyboardInterrupt\n"
        "m.main = main\n"
        "common.run_command(m)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 130 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "bpt-train: interrupted (Ctrl-C); nothing after the last checkpoint was kept"
    debug = subprocess.run([sys.executable, "-c", script, "--debug"], capture_output=True, text=True, timeout=120)
    assert "Traceback" in debug.stderr and "KeyboardInterrupt" in debug.stderr


def test_small_things_a_user_meets(tmp_path):
    """An integer setting takes 1e3; --top_p's help says (0, 1]; a --workdir that holds
    files but no run (a data folder) is refused before anything is written."""
    c = copy_config(steps=2)
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    with pytest.raises(FileExistsError, match="holds prepared data, not a bpt run; give a new or empty folder"):
        train(c, data)
    assert [p.name for p in data.iterdir()] == ["manifest.json"]
    done = command("train", "--workdir", str(tmp_path / "run"), "--config.train.steps=1e0", "--config.data.name=copy",
                   "--config.train.sample_tokens=0", "--config.train.eval_batches=0",
                   "--config.train.xla_flags=overlap", cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["train"]
    assert saved["steps"] == 1 and saved["xla_flags"] == "overlap"
    assert "(0, 1]" in command("sample", "--help").stdout and "[0.0, 1.0]" not in command("sample", "--help").stdout



def test_xla_flags_come_after_the_environments_own(monkeypatch):
    """train.xla_flags: a preset or flags, added after XLA_FLAGS's own (XLA takes the last of
    a repeated flag, so the run's setting wins); "" changes nothing."""
    from bpt.cli import common

    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false")
    common.set_xla_flags("")
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_latency_hiding_scheduler=false"
    common.set_xla_flags("overlap")
    flags = os.environ["XLA_FLAGS"].split()
    assert flags[0].endswith("=false") and flags[1:] == list(common.XLA_PRESETS["overlap"])
    monkeypatch.delenv("XLA_FLAGS")
    common.set_xla_flags(" --xla_gpu_autotune_level=0  --xla_dump_to=/tmp/x ")
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_autotune_level=0 --xla_dump_to=/tmp/x"
