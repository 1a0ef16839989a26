"""The paper's Table 5 on locally collected ExoRL-format data: returns of BC-10%, Decision
Transformer and the Agentic Transformer (4 and 32 trajectories) in dm_control.

    # 1. (here, with dm_control) relabel the five tasks and copy the episodes without their
    #    physics states (the relabeled rewards are cached beside them): a folder to train from
    python scripts/rl_returns.py pack --src data/exorl --out bench_tmp/exorl --episodes 150

    # 2. (a GPU) train and evaluate every cell not done yet: task x method x seed
    python scripts/rl_returns.py run --data bench_tmp/exorl --runs results/rl_runs --jobs 4

    # 3. the tables, results.json and the curves (PNG) from the runs
    python scripts/rl_returns.py report --runs results/rl_runs --out results/rl_returns

--tasks defaults to the five suite tasks; the sixth, jaco reach (bpt.rl.jaco), is any of
jaco_reach_top_left, _top_right, _bottom_left, _bottom_right (collected with --domain jaco).

A cell is one bpt-train run (configs/rl/*.py with the settings below) followed by
bpt-eval-rl on its last checkpoint; it runs in fresh processes and writes cell.json in its
folder (runs/<task>/<method>/seed<k>) when it is done, so `run` picks up where an earlier
one stopped, and --time_budget starts a cell only if the time left covers what a finished
cell of its method took (so a GPU lent for a fixed time is not spent on cells cut off). A
training run that fails for a reason other than memory is tried again once (--retries).

Methods (METHODS): every one sees the same number of trajectories a step (--trajectories_per_step,
64 by default: the paper's batch of 64 single trajectories), so AT(4) trains on batches of
16 chains and AT(32) on batches of 2; at test time BC and DT play one trial, AT(4) four and
AT(32) sixteen in one context (the paper's Table 6), asked for the best return of the
training data. at32_vanilla is AT(32) with vanilla attention: out of memory in bpt-train's
compile or preflight, before the first step, unless the GPU holds it; at32_me trains AT(32)
with memory-efficient attention (the same function as BPT's, more memory).

Reported per cell: the last trial's return (mean over --episodes environments) and the
best trial's; per task and method the mean +- std of those over the seeds. Returns are raw
dm_control returns (0 to 1000), not normalized. With --hindsight, `run` also evaluates the AT
cells with each finished trial relabeled by its return before the next (bpt-eval-rl
--hindsight: the context then looks like a training chain's), and `report --hindsight`
reports those, with a table of each AT's first and last trial both ways and the trials as
played dashed in the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bpt.rl import exorl

REPO = Path(__file__).resolve().parent.parent
TASKS = exorl.TASKS  # the default: the paper's five suite tasks
# The paper's sixth task, jaco reach (bpt.rl.jaco: 250 steps an episode), in its four corners.
JACO = tuple(f"jaco_{name}" for name in exorl.JACO_TASKS)
# name -> (label, config file argument, trajectories a chain, test-time trials, attention mode)
METHODS = {
    "bc": ("BC-10%", "configs/rl/bc.py:{task}", 1, 1, "blockwise_parallel"),
    "dt": ("DT", "configs/rl/dt.py:{task}", 1, 1, "blockwise_parallel"),
    "at4": ("AT(4)", "configs/rl/at.py:{task},4", 4, 4, "blockwise_parallel"),
    "at32": ("AT(32), BPT", "configs/rl/at.py:{task},32", 32, 16, "blockwise_parallel"),
    "at32_me": ("AT(32), MemoryEfficient", "configs/rl/at.py:{task},32", 32, 16, "memory_efficient"),
    "at32_vanilla": ("AT(32), Vanilla", "configs/rl/at.py:{task},32", 32, 16, "vanilla"),
}
DEFAULT_METHODS = ("bc", "dt", "at4", "at32", "at32_vanilla")


# ---------------------------------------------------------------------------------- pack


def pack(args) -> None:
    """Relabels the tasks' rewards in --src (cached there) and writes the first --episodes
    episodes of each domain to --out without the physics key, with the caches."""
    from bpt.rl.data import cache_path, relabeled

    stats_path = Path(args.out) / "stats.json"
    stats = json.loads(stats_path.read_text()) if stats_path.is_file() else {}  # other domains packed before
    by_domain: dict[str, list[str]] = {}
    for task in args.tasks:
        by_domain.setdefault(exorl.split_task(task)[0], []).append(task)
    for domain, tasks in by_domain.items():
        files = exorl.episode_files(args.src, domain)[: args.episodes]
        names = {p.name for p in files}
        target = exorl.buffer_dir(args.out, domain)
        target.mkdir(parents=True, exist_ok=True)
        for path in files:
            episode = exorl.load_episode(path)
            with open(target / path.name, "wb") as f:
                np.savez_compressed(f, **{k: episode[k] for k in exorl.KEYS if k != "physics"})
        for task in tasks:
            episodes = [(n, t) for n, t in relabeled(args.src, task) if n in names]
            with np.load(cache_path(args.src, task)) as cache:  # (relabeled() just wrote it)
                np.savez(cache_path(args.out, task), **{k: cache[k] for k in cache.files if k in names})
            returns = np.array([t.total for _, t in episodes])
            stats[task] = {
                "episodes": len(episodes),
                "return_mean": float(returns.mean()),
                "return_std": float(returns.std()),
                "return_min": float(returns.min()),
                "return_max": float(returns.max()),
                "return_p90": float(np.percentile(returns, 90)),
            }
            print(f"{task}: {len(episodes)} episodes, returns {returns.mean():.1f} +- {returns.std():.1f} "
                  f"(min {returns.min():.1f}, max {returns.max():.1f})", flush=True)  # fmt: skip
    stats_path.write_text(json.dumps(stats, indent=2))
    print("\nThe data's returns by task\n")
    print("| task | episodes | mean | std | min | 90th pct | max |\n|---|---|---|---|---|---|---|")
    for task, r in stats.items():
        values = [r[k] for k in ("return_mean", "return_std", "return_min", "return_p90", "return_max")]
        print(f"| {task} | {r['episodes']} | " + " | ".join(f"{x:.1f}" for x in values) + " |")


# ---------------------------------------------------------------------------------- run


def cell_dir(runs: Path, task: str, method: str, seed: int) -> Path:
    return runs / task / method / f"seed{seed}"


def train_argv(args, task: str, method: str, seed: int, workdir: Path) -> list[str]:
    _, config, trajectories, _, mode = METHODS[method]
    batch = max(1, args.trajectories_per_step // trajectories)
    steps = args.steps
    settings = {
        "data.path": args.data,
        "seed": seed,
        "train.steps": steps,
        "train.batch_size": batch,
        "train.learning_rate": args.learning_rate,
        "train.warmup_steps": max(1, steps // 10),
        "train.log_every": max(1, steps // 100),
        "train.eval_every": max(1, steps // 10),
        "train.eval_batches": 2,
        "train.checkpoint_every": steps,
        "train.keep_checkpoints": 1,
        "model.dtype": "bfloat16",
        "model.attention_mode": mode,
        "model.remat_layer": args.remat_layer,
    }
    if mode == "vanilla":
        settings["model.attention_impl"] = "reference"
    argv = [
        sys.executable,
        "-m",
        "bpt.cli.train",
        "--config",
        str(REPO / config.format(task=task)),
        "--workdir",
        str(workdir),
    ]
    return argv + [f"--config.{k}={v}" for k, v in settings.items()]


def eval_argv(args, method: str, seed: int, workdir: Path, *, hindsight: bool = False) -> list[str]:
    """bpt-eval-rl for a cell, the protocol named either way (as played: eval_rl.json; hindsight,
    bpt-eval-rl's default: eval_rl_hindsight.json)."""
    trials = METHODS[method][3]
    return [sys.executable, "-m", "bpt.cli.eval_rl", "--workdir", str(workdir), "--episodes", str(args.episodes),
            "--trials", str(trials), "--seed", str(args.env_seed),
            "--hindsight" if hindsight else "--nohindsight"]  # fmt: skip


def run_logged(argv: list[str], log: Path, env: dict) -> tuple[int, float]:
    start = time.perf_counter()
    with open(log, "a") as f:
        f.write("$ " + " ".join(argv) + "\n")
        f.flush()
        code = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
    return code, time.perf_counter() - start


def last_error(log: str) -> str:
    """The last line of a command's log that says what went wrong (bpt's one-sentence errors)."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() and not line.startswith("(")]
    return (errors or lines or [""])[-1][-400:]


def out_of_memory(log: str) -> bool:
    """XLA's out-of-memory error, or bpt-train's preflight verdict ("error: MemoryError: ...")."""
    from bpt.train.probe import is_out_of_memory

    return "MemoryError" in log or is_out_of_memory(log)


def run_cell(args, task: str, method: str, seed: int, env: dict) -> dict:
    workdir = cell_dir(Path(args.runs), task, method, seed)
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "log.txt"
    cell = {"task": task, "method": method, "seed": seed, "steps": args.steps,
            "trajectories_per_step": args.trajectories_per_step, "learning_rate": args.learning_rate}  # fmt: skip
    if METHODS[method][4] == "vanilla":  # judged against the whole device (it fails before allocating)
        env = {**env, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}
    code, cell["train_s"] = run_logged(train_argv(args, task, method, seed, workdir), log, env)
    text = log.read_text()
    for _ in range(args.retries):
        if code == 0 or out_of_memory(text):
            break
        # A run that failed for another reason (a GPU runtime error) gets a fresh process; it
        # resumes from its last checkpoint, if it wrote one.
        with open(log, "a") as f:
            f.write(f"retrying after: {last_error(text)}\n")
        code, seconds = run_logged(train_argv(args, task, method, seed, workdir), log, env)
        cell["train_s"] += seconds
        text = log.read_text()
    if code != 0:
        cell["status"] = "out of memory" if out_of_memory(text) else "failed"
        cell["error"] = last_error(text) or f"exit {code}"
    else:  # (vanilla attention that fits, on a larger GPU, trains and is evaluated like the rest)
        code, cell["eval_s"] = run_logged(eval_argv(args, method, seed, workdir), log, env)
        result = workdir / "eval_rl.json"
        if code == 0 and result.is_file() and args.hindsight and METHODS[method][3] > 1:
            # the same model again, its finished trials relabeled as the training chains are
            again, seconds = run_logged(eval_argv(args, method, seed, workdir, hindsight=True), log, env)
            cell["eval_s"] += seconds
            relabeled = workdir / "eval_rl_hindsight.json"
            if again == 0 and relabeled.is_file():  # (else report --hindsight says it is missing)
                cell["eval_hindsight"] = json.loads(relabeled.read_text())
        if code == 0 and result.is_file():
            cell["status"] = "done"
            cell["eval"] = json.loads(result.read_text())
        else:
            cell["status"] = "failed"
            cell["error"] = "evaluation: " + (last_error(log.read_text()) or f"exit {code}")
    (workdir / "cell.json").write_text(json.dumps(cell, indent=2))
    return cell


def run(args) -> None:
    runs = Path(args.runs)
    cells = [(task, method, seed) for seed in args.seeds for task in args.tasks for method in args.methods]
    todo = []
    for task, method, seed in cells:
        path = cell_dir(runs, task, method, seed) / "cell.json"
        if path.is_file() and json.loads(path.read_text()).get("status") in ("done", "out of memory"):
            continue
        todo.append((task, method, seed))
    # Seed by seed, the long cells (32-trajectory chains) first, so the short ones fill in beside them.
    todo.sort(key=lambda cell: (args.seeds.index(cell[2]), -METHODS[cell[1]][2]))
    print(
        f"{len(cells)} cells, {len(cells) - len(todo)} done, {len(todo)} to run with {args.jobs} at a time",
        flush=True,
    )
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / args.jobs:.3f}")
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(args.runs).resolve() / ".jax_cache"))
    deadline = time.monotonic() + args.time_budget if args.time_budget else None
    lock, finished, skipped = threading.Lock(), [], []
    took = longest_cells(runs)

    failures = [0]  # failed cells in a row: after 3 something is broken, so stop starting more

    def work(item):
        expected = took.get(item[1], 0.0)  # unknown: the cell may start until the deadline
        if (deadline is not None and time.monotonic() + expected > deadline) or failures[0] >= 3:
            skipped.append(item)
            return None
        cell = run_cell(args, *item, env)
        with lock:
            finished.append(cell)
            if cell["status"] == "done":  # this campaign's own conditions (GPU neighbours) from now on
                took[cell["method"]] = cell["train_s"] + cell["eval_s"]
            failures[0] = failures[0] + 1 if cell["status"] == "failed" else 0
            line = f"[{len(finished)}/{len(todo)}] {cell['task']} {cell['method']} seed {cell['seed']}: {cell['status']}"
            if cell["status"] == "done":
                e = cell["eval"]
                line += f", last trial {e['mean_by_trial'][-1]:.1f}, best {e['best_mean']:.1f}"
            line += f" (train {cell['train_s']:.0f} s" + (
                f", eval {cell['eval_s']:.0f} s)" if "eval_s" in cell else ")"
            )
            print(line, flush=True)
        return cell

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(work, todo))
    if skipped:
        why = "3 cells failed in a row" if failures[0] >= 3 else "not enough of the time budget left"
        print(f"{why}: {len(skipped)} cells not started", flush=True)


def longest_cells(runs: Path) -> dict[str, float]:
    """method -> the longest a finished cell of it took (train + eval seconds) in these runs."""
    took: dict[str, float] = {}
    for path in runs.glob("*/*/seed*/cell.json"):
        cell = json.loads(path.read_text())
        if cell.get("status") == "done":
            took[cell["method"]] = max(took.get(cell["method"], 0.0), cell["train_s"] + cell["eval_s"])
    return took


# ---------------------------------------------------------------------------------- report


def load_cells(runs: Path) -> list[dict]:
    cells = []
    for path in sorted(runs.glob("*/*/seed*/cell.json")):
        cell = json.loads(path.read_text())
        metrics = path.parent / "metrics.jsonl"
        cell["curve"] = (
            [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            if metrics.is_file()
            else []
        )
        cells.append(cell)
    return cells


def summarize(cells: list[dict]) -> dict:
    """(task, method) -> {seeds, last/best mean and std over seeds, status}."""
    out: dict = {}
    for cell in cells:
        entry = out.setdefault((cell["task"], cell["method"]), {"last": [], "best": [], "status": set()})
        entry["status"].add(cell["status"])
        if cell["status"] == "done":
            entry["last"].append(cell["eval"]["mean_by_trial"][-1])
            entry["best"].append(cell["eval"]["best_mean"])
    return out


def _cell_text(entry: dict | None, key: str) -> str:
    if entry is None:
        return "not run"
    values = entry[key]
    if not values:
        return "out of memory" if "out of memory" in entry["status"] else "/".join(sorted(entry["status"]))
    if len(values) == 1:
        return f"{values[0]:.1f} (1)"
    return f"{statistics.mean(values):.1f} ± {statistics.pstdev(values):.1f} ({len(values)})"


def tables(cells: list[dict], tasks, methods) -> str:
    summary = summarize(cells)
    labels = [METHODS[m][0] for m in methods]
    lines = []
    for key, title in (("last", "the last trial"), ("best", "the best trial")):
        lines += [
            f"Returns of {title} (raw dm_control returns, mean ± std over seeds of the mean over episodes; (seeds))",
            "",
            "| task | " + " | ".join(labels) + " |",
            "|---|" + "---|" * len(labels),
        ]
        for task in tasks:
            lines.append(
                f"| {task} | " + " | ".join(_cell_text(summary.get((task, m)), key) for m in methods) + " |"
            )
        lines.append("")
    return "\n".join(lines)


def _by_trial(cells: list[dict], task: str, method: str, key: str) -> np.ndarray | None:
    """The mean over seeds of each trial's return under cells' `key` ("eval", "eval_played")."""
    rows = [c[key]["mean_by_trial"] for c in cells
            if c["task"] == task and c["method"] == method and c["status"] == "done" and key in c]  # fmt: skip
    return np.mean(np.array(rows), axis=0) if rows else None


def hindsight_table(cells: list[dict], tasks, methods) -> str:
    """AT's in-context improvement (first trial -> last) as played and relabeled in hindsight,
    the same models (report --hindsight)."""
    at = [m for m in methods if METHODS[m][3] > 1]
    lines = [
        "AT's trials as played and relabeled in hindsight (the same models; mean over seeds, first trial -> last)",
        "",
        "| task | " + " | ".join(f"{METHODS[m][0]} as played | {METHODS[m][0]} hindsight" for m in at) + " |",
        "|---|" + "---|---|" * len(at),
    ]
    for task in tasks:
        row = []
        for method in at:
            seeds = sum(c["task"] == task and c["method"] == method and "eval_played" in c for c in cells)
            for key in ("eval_played", "eval"):
                curve = _by_trial(cells, task, method, key)
                row.append("–" if curve is None else f"{curve[0]:.1f} -> {curve[-1]:.1f} ({seeds})")
        lines.append(f"| {task} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot(cells: list[dict], tasks, methods, path: Path) -> list[str]:
    """Validation loss by step (top) and return by trial (bottom), a column per task; returns
    the legend's labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(tasks), figsize=(max(3.6 * len(tasks), 5.0), 6.4), squeeze=False)
    colors = {m: f"C{i}" for i, m in enumerate(METHODS)}
    for col, task in enumerate(tasks):
        top, bottom = axes[0, col], axes[1, col]
        for method in methods:
            runs = [c for c in cells if c["task"] == task and c["method"] == method and c["curve"]]
            for i, cell in enumerate(runs):
                rows = [r for r in cell["curve"] if "eval_loss" in r]
                if rows:
                    top.plot([r["step"] for r in rows], [r["eval_loss"] for r in rows], color=colors[method],
                             alpha=0.8, label=METHODS[method][0] if i == 0 else None)  # fmt: skip
            mean = _by_trial(cells, task, method, "eval")
            if mean is not None:
                bottom.plot(
                    np.arange(1, len(mean) + 1), mean, "o-", color=colors[method], label=METHODS[method][0]
                )
            played = _by_trial(cells, task, method, "eval_played")  # report --hindsight: the same models
            if played is not None:
                bottom.plot(np.arange(1, len(played) + 1), played, "--", color=colors[method], alpha=0.6,
                            label=f"{METHODS[method][0]}, as played")  # fmt: skip
        top.set_title(task)
        top.set_xlabel("training step")
        top.set_yscale("log")
        bottom.set_xlabel("trial (in one context)")
        if col == 0:
            top.set_ylabel("validation action MSE")
            bottom.set_ylabel("return (mean over seeds)")
        top.grid(alpha=0.3)
        bottom.grid(alpha=0.3)
    # One legend for the figure: a method run on only some tasks (at32_me) is in it too.
    handles = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    ncol = min(len(handles), max(2, 2 * len(tasks)))  # about two labels fit beside a column
    rows = -(-len(handles) // ncol)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=ncol, fontsize=8)
    fig.tight_layout(rect=(0, 0.04 * rows + 0.01, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return list(handles)


def use_hindsight(cells: list[dict]) -> None:
    """AT's returns with its earlier trials relabeled (eval_hindsight) become the cells' "eval",
    the returns as played their "eval_played"; BC and DT play one trial and keep theirs."""
    for cell in cells:
        if cell["status"] == "done" and METHODS[cell["method"]][3] > 1:
            if "eval_hindsight" in cell:
                cell["eval_played"], cell["eval"] = cell["eval"], cell["eval_hindsight"]
            else:
                cell["status"] = "no hindsight evaluation"


def report(args) -> None:
    cells = load_cells(Path(args.runs))
    if not cells:
        raise SystemExit(f"no cells (cell.json) under {args.runs}")
    if args.hindsight:
        use_hindsight(cells)
        print("AT's earlier trials relabeled in hindsight (--hindsight)\n")
    tasks = [t for t in args.tasks if any(c["task"] == t for c in cells)]
    methods = [m for m in args.methods if any(c["method"] == m for c in cells)]
    text = tables(cells, tasks, methods)
    if args.hindsight:
        text += "\n" + hindsight_table(cells, tasks, methods)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.md").write_text(text)
        slim = [{k: v for k, v in c.items() if k != "curve"} for c in cells]
        (out / "results.json").write_text(json.dumps({"cells": slim}, indent=2))
        plot(cells, tasks, methods, out / "rl_returns.png")
        print(f"written to {out}")


# ---------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("stage", choices=("pack", "run", "report"))
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument(
        "--methods", default=",".join(DEFAULT_METHODS), help=f"comma-separated: {', '.join(METHODS)}"
    )
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument(
        "--src", default="data/exorl", help="pack: the collected folder (bpt-collect-exorl --out)"
    )
    parser.add_argument(
        "--episodes",
        type=int,
        default=None,
        help="pack: episodes a domain (default all); run: environments an evaluation",
    )
    parser.add_argument(
        "--out", default="", help="pack: the folder to write; report: tables, results.json, PNG"
    )
    parser.add_argument("--data", default="bench_tmp/exorl", help="run: the packed folder")
    parser.add_argument("--runs", default="results/rl_runs", help="run, report: the cells' folders")
    parser.add_argument("--steps", type=int, default=1000, help="run: training steps a cell")
    parser.add_argument("--trajectories_per_step", type=int, default=64)
    parser.add_argument("--learning_rate", type=float, default=3e-4)
    parser.add_argument(
        "--env_seed", type=int, default=1000, help="run: evaluation environment i is seeded env_seed + i"
    )
    parser.add_argument(
        "--jobs", type=int, default=4, help="run: cells at a time (processes sharing the GPU)"
    )
    parser.add_argument(
        "--remat_layer",
        default="nothing_saveable",
        help="run: model.remat_layer of the cells (a policy of bpt.ops.remat; the function trained is the same)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=1,
        help="run: fresh attempts at a training run that failed (not for memory)",
    )
    parser.add_argument(
        "--hindsight",
        action="store_true",
        help="run: AT cells are also evaluated with their finished trials relabeled (bpt-eval-rl "
        "--hindsight); report: those returns for AT",
    )
    parser.add_argument(
        "--time_budget",
        type=float,
        default=0.0,
        help="run: seconds the started cells should finish within: a cell starts only if the time "
        "left covers what the last finished cell of its method took (before any: the longest in "
        "--runs; 0: no limit)",
    )
    args = parser.parse_args()
    args.tasks = args.tasks.split(",")
    args.methods = args.methods.split(",")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    for task in args.tasks:
        if task not in TASKS + JACO:
            parser.error(f"unknown task {task!r}; allowed: {', '.join(TASKS + JACO)}")
    for method in args.methods:
        if method not in METHODS:
            parser.error(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")
    if args.stage == "pack":
        if not args.out:
            parser.error("pack needs --out")
        args.episodes = args.episodes or 10**9
        return pack(args)
    if args.stage == "run":
        args.episodes = args.episodes or 10
        return run(args)
    return report(args)


if __name__ == "__main__":
    main()
