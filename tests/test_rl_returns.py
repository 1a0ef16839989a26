"""scripts/rl_returns.py's scheduling of cells, with bpt-train and bpt-eval-rl replaced by
fakes: retries of a failed training run, the time budget, and resuming past done cells."""

import argparse
import json
from pathlib import Path

import pytest
from conftest import load_script


@pytest.fixture
def rl_returns():
    return load_script("rl_returns")


def make_args(runs: Path, **overrides) -> argparse.Namespace:
    args = dict(runs=str(runs), data="unused", tasks=["walker_walk"], methods=["bc", "at32"], seeds=[0],
                jobs=1, retries=1, time_budget=0.0, steps=10, trajectories_per_step=64, remat_layer="nothing_saveable",
                learning_rate=3e-4, episodes=2, env_seed=1000, hindsight=False)  # fmt: skip
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
        if kind == "eval" and "--hindsight" in argv:
            result = {"mean_by_trial": [1.0, 3.0], "best_mean": 3.0, "hindsight": True}
            (workdir / "eval_rl_hindsight.json").write_text(json.dumps(result))
        elif kind == "eval":
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


def test_report_tables_and_one_legend_for_methods_run_on_some_tasks(rl_returns, tmp_path, capsys):
    """A method run on one task only (at32_me) has its column ("not run" elsewhere) and its
    entry in the figure's legend; out-of-memory cells are reported as such."""

    def cell(task, method, seed, by_trial=None, status="done"):
        folder = tmp_path / "runs" / task / method / f"seed{seed}"
        folder.mkdir(parents=True)
        body = {"task": task, "method": method, "seed": seed, "status": status}
        if by_trial:
            body["eval"] = {"mean_by_trial": by_trial, "best_mean": max(by_trial)}
            rows = [{"step": 10, "loss": 1.0, "eval_loss": 0.5}, {"step": 20, "loss": 0.5, "eval_loss": 0.25}]
            (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        (folder / "cell.json").write_text(json.dumps(body))

    for seed, shift in ((0, 0.0), (1, 10.0)):
        cell("walker_walk", "at32", seed, [100.0 + shift, 120.0 + shift])
        cell("cheetah_run", "at32", seed, [10.0 + shift, 30.0 + shift])
    cell("cheetah_run", "at32_me", 0, [12.0, 28.0])
    cell("walker_walk", "at32_vanilla", 0, status="out of memory")
    args = make_args(tmp_path / "runs", tasks=["walker_walk", "cheetah_run"], out=str(tmp_path / "report"),
                     methods=["at32", "at32_me", "at32_vanilla"])  # fmt: skip
    rl_returns.report(args)
    table = (tmp_path / "report" / "table.md").read_text()
    assert "| walker_walk | 125.0 ± 5.0 (2) | not run | out of memory |" in table
    assert "| cheetah_run | 35.0 ± 5.0 (2) | 28.0 (1) | not run |" in table
    assert (tmp_path / "report" / "rl_returns.png").stat().st_size > 10_000
    labels = rl_returns.plot(
        rl_returns.load_cells(tmp_path / "runs"), args.tasks, args.methods[:2], tmp_path / "f.png"
    )
    assert labels == ["AT(32), BPT", "AT(32), MemoryEfficient"]


def test_hindsight_evaluates_at_twice_and_the_report_reads_it(rl_returns, tmp_path, monkeypatch, capsys):
    """--hindsight: AT cells (several trials) are evaluated again with bpt-eval-rl --hindsight,
    BC (one trial) is not; report --hindsight takes AT's relabeled returns."""
    fake = FakeCommands()
    monkeypatch.setattr(rl_returns, "run_logged", fake)
    rl_returns.run(make_args(tmp_path, hindsight=True))
    assert sorted(fake.calls) == [
        ("eval", "at32"),
        ("eval", "at32"),
        ("eval", "bc"),
        ("train", "at32"),
        ("train", "bc"),
    ]
    at32 = json.loads((tmp_path / "walker_walk/at32/seed0/cell.json").read_text())
    assert at32["eval"]["best_mean"] == 2.0 and at32["eval_hindsight"]["best_mean"] == 3.0
    assert "eval_hindsight" not in json.loads((tmp_path / "walker_walk/bc/seed0/cell.json").read_text())
    capsys.readouterr()
    rl_returns.report(make_args(tmp_path, out=""))
    assert "| walker_walk | 2.0 (1) | 2.0 (1) |" in capsys.readouterr().out
    rl_returns.report(make_args(tmp_path, out="", hindsight=True))
    printed = capsys.readouterr().out
    assert "relabeled in hindsight" in printed and "| walker_walk | 2.0 (1) | 3.0 (1) |" in printed
    # AT's first -> last trial both ways (BC plays one trial: not in it), and the figure's
    # dashed curve of the trials as played
    assert "| AT(32), BPT as played | AT(32), BPT hindsight |" in printed
    assert "| walker_walk | 1.0 -> 2.0 (1) | 1.0 -> 3.0 (1) |" in printed
    rl_returns.report(make_args(tmp_path, out=str(tmp_path / "report"), hindsight=True))
    assert "1.0 -> 3.0" in (tmp_path / "report" / "table.md").read_text()
    cells = rl_returns.load_cells(tmp_path)
    rl_returns.use_hindsight(cells)
    labels = rl_returns.plot(cells, ["walker_walk"], ["bc", "at32"], tmp_path / "h.png")
    assert labels == ["BC-10%", "AT(32), BPT", "AT(32), BPT, as played"]
