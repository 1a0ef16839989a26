"""scripts/rl_returns.py's scheduling of cells, with bpt-train and bpt-eval-rl replaced by
fakes: retries of a failed training run, the time budget, and resuming past done cells."""

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def rl_returns():
    spec = importlib.util.spec_from_file_location("rl_returns", ROOT / "scripts" / "rl_returns.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_args(runs: Path, **overrides) -> argparse.Namespace:
    args = dict(runs=str(runs), data="unused", tasks=["walker_walk"], methods=["bc", "at32"], seeds=[0],
                jobs=1, retries=1, time_budget=0.0, steps=10, trajectories_per_step=64, remat_layer="nothing_saveable",
                learning_rate=3e-4, episodes=2, env_seed=1000)  # fmt: skip
    args.update(overrides)
    return argparse.Namespace(**args)


class FakeCommands:
    """Stands in for run_logged: training runs fail with `failures` (a list of log texts, one
    per failing attempt, shared by all cells) before they succeed; evaluations write a result."""

    def __init__(self, failures=(), seconds=None):
        self.failures = list(failures)
        self.seconds = seconds or {}
        self.calls = []

    def __call__(self, argv, log, env):
        workdir = Path(argv[argv.index("--workdir") + 1])
        method = workdir.parent.name
        kind = "train" if "bpt.cli.train" in argv else "eval"
        self.calls.append((kind, method))
        with open(log, "a") as f:
            f.write("$ " + " ".join(argv) + "\n")
            if kind == "train" and self.failures:
                f.write(self.failures.pop(0))
                return 1, 1.0
        if kind == "eval":
            result = {"mean_by_trial": [1.0, 2.0], "best_mean": 2.0}
            (workdir / "eval_rl.json").write_text(json.dumps(result))
        return 0, self.seconds.get((kind, method), 1.0)


def test_a_failed_training_run_is_retried_once_but_not_out_of_memory(rl_returns, tmp_path, monkeypatch):
    runtime_error = "bpt-train: error: JaxRuntimeError: INTERNAL: capturing stream has unjoined work\n"
    fake = FakeCommands(failures=[runtime_error])
    monkeypatch.setattr(rl_returns, "run_logged", fake)
    cell = rl_returns.run_cell(make_args(tmp_path), "walker_walk", "at32", 0, env={})
    assert cell["status"] == "done" and cell["train_s"] == 2.0
    assert fake.calls == [("train", "at32"), ("train", "at32"), ("eval", "at32")]
    assert (
        "retrying after: bpt-train: error: JaxRuntimeError"
        in (tmp_path / "walker_walk/at32/seed0/log.txt").read_text()
    )

    fake = FakeCommands(failures=[runtime_error, runtime_error])  # fails again: the cell failed
    monkeypatch.setattr(rl_returns, "run_logged", fake)
    cell = rl_returns.run_cell(make_args(tmp_path), "walker_walk", "bc", 0, env={})
    assert cell["status"] == "failed" and "JaxRuntimeError" in cell["error"] and len(fake.calls) == 2

    fake = FakeCommands(failures=["bpt-train: error: RESOURCE_EXHAUSTED: Out of memory\n"])
    monkeypatch.setattr(rl_returns, "run_logged", fake)
    cell = rl_returns.run_cell(make_args(tmp_path), "walker_walk", "at32_vanilla", 0, env={})
    assert cell["status"] == "out of memory" and fake.calls == [("train", "at32_vanilla")]


def test_time_budget_skips_cells_longer_than_the_time_left_and_run_resumes(rl_returns, tmp_path, monkeypatch):
    # An earlier campaign's AT(32) cell took 1000 s; a budget of 500 s has no room for another.
    done = tmp_path / "walker_run/at32/seed0"
    done.mkdir(parents=True)
    (done / "cell.json").write_text(
        json.dumps({"method": "at32", "status": "done", "train_s": 900.0, "eval_s": 100.0})
    )
    assert rl_returns.longest_cells(tmp_path) == {"at32": 1000.0}

    fake = FakeCommands()
    monkeypatch.setattr(rl_returns, "run_logged", fake)
    rl_returns.run(make_args(tmp_path, time_budget=500.0))
    assert [c for c in fake.calls if c[0] == "train"] == [("train", "bc")]
    assert not (tmp_path / "walker_walk/at32/seed0/cell.json").exists()

    # Without a budget the rest runs, and the done bc cell is not run again.
    fake = FakeCommands()
    monkeypatch.setattr(rl_returns, "run_logged", fake)
    rl_returns.run(make_args(tmp_path))
    assert fake.calls == [("train", "at32"), ("eval", "at32")]
    cell = json.loads((tmp_path / "walker_walk/at32/seed0/cell.json").read_text())
    assert cell["status"] == "done" and cell["eval"]["best_mean"] == 2.0
