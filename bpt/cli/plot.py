"""bpt-plot: loss and throughput curves of one or more runs, to a PNG.

    bpt-plot runs/a runs/b --out curves.png
    bpt-plot --by_position runs/a runs/b --out by_position.png

Reads each run's metrics.jsonl; a resumed run's repeated steps count once (the last line).
A run trained with train.eval_by_position gets one more panel: its validation loss in each
range of window positions, step by step.
--by_position draws instead the loss by position in the context window that
`bpt-eval --by_position` wrote to each run's eval.json.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def read_metrics(workdir: str | Path) -> list[dict]:
    path = Path(workdir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: each argument must be a bpt-train workdir")
    by_step = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[record["step"]] = record
    if not by_step:
        raise ValueError(f"{path} holds no logged steps yet")
    return [by_step[s] for s in sorted(by_step)]


def _pyplot():
    """matplotlib.pyplot on the file-only backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_runs(workdirs: list[str | Path], out: str | Path) -> Path:
    plt = _pyplot()
    runs = {Path(w).name or str(w): read_metrics(w) for w in workdirs}
    panels = [("loss", "loss (nats per token)"), ("tokens_per_sec", "tokens / s")]
    if any("mfu" in r for records in runs.values() for r in records):
        panels.append(("mfu", "model FLOPs utilization (fraction of peak)"))
    by_position = any("eval_by_position" in r for records in runs.values() for r in records)
    width = len(panels) + by_position
    fig, axes = plt.subplots(1, width, figsize=(5.5 * width, 4), squeeze=False)
    if by_position:
        _by_position_over_steps(axes[0][-1], runs)
    for ax, (key, label) in zip(axes[0], panels):
        for i, (name, records) in enumerate(runs.items()):
            color = f"C{i}"
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), color=color, label=name if key != "loss" else f"{name} (train)")
            if key == "loss":
                evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
                if evals:
                    ax.plot(*zip(*evals), "o--", color=color, label=f"{name} (eval)")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        if key != "loss":  # throughput from zero: small wobbles should look small
            top = max((r[key] for rs in runs.values() for r in rs if r.get(key)), default=1.0)
            ax.set_ylim(0, 1.15 * top)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out)


def _by_position_over_steps(ax, runs: dict[str, list[dict]]) -> None:
    """Validation loss of each range of window positions against the step: a colour per range
    (light: early positions, dark: late ones), a line style per run."""
    import matplotlib

    styles = ["-", "--", ":", "-."]
    for i, (name, records) in enumerate(runs.items()):
        evals = [r for r in records if "eval_by_position" in r]
        if not evals:
            continue
        ranges = [(b["start"], b["end"]) for b in evals[-1]["eval_by_position"]]
        colors = matplotlib.colormaps["viridis_r"]([0.15 + 0.85 * j / max(len(ranges) - 1, 1) for j in range(len(ranges))])
        for j, (start, end) in enumerate(ranges):
            points = [
                (r["step"], b["loss"])
                for r in evals
                for b in r["eval_by_position"]
                if (b["start"], b["end"]) == (start, end)
            ]
            label = f"{start:,}-{end:,}" + (f" ({name})" if len(runs) > 1 else "")
            ax.plot(*zip(*points), styles[i % len(styles)], color=colors[j], marker="o", ms=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss by window position")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)


def read_by_position(workdir: str | Path) -> list[dict]:
    path = Path(workdir) / "eval.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `bpt-eval --workdir {workdir} --by_position` first")
    rows = json.loads(path.read_text()).get("by_position")
    if not rows:
        raise ValueError(f"{path} has no loss by position: run `bpt-eval --workdir {workdir} --by_position`")
    return rows


def format_by_position(rows: list[dict]) -> str:
    """The loss by position as a small text table."""
    lines = [f"{'positions':>17}  {'loss':>7}  {'perplexity':>10}  {'tokens':>9}"]
    for r in rows:
        span = f"{r['start']:,}-{r['end']:,}"
        lines.append(f"{span:>17}  {r['loss']:7.4f}  {r['perplexity']:10.2f}  {r['tokens']:9,}")
    return "\n".join(lines)


def plot_by_position(workdirs: list[str | Path], out: str | Path) -> Path:
    """Validation loss against position in the window (log scale), one line per run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, workdir in enumerate(workdirs):
        rows = read_by_position(workdir)
        # Each range drawn as a step over its positions, marked at its geometric middle.
        for r in rows:
            ax.hlines(r["loss"], max(r["start"], 1), r["end"], color=f"C{i}", lw=2)
        middles = [math.sqrt(max(r["start"], 1) * r["end"]) for r in rows]
        ax.plot(
            middles, [r["loss"] for r in rows], "o", color=f"C{i}", label=Path(workdir).name or str(workdir)
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in the context window (tokens of context)")
    ax.set_ylabel("validation loss (nats per token)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, out)


def run() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("workdirs", nargs="+", help="bpt-train workdirs")
    parser.add_argument("--out", default="curves.png", help="PNG to write")
    parser.add_argument(
        "--by_position", action="store_true", help="plot the loss by position from each run's eval.json"
    )
    args = parser.parse_args()
    try:
        plot = plot_by_position if args.by_position else plot_runs
        print(plot(args.workdirs, args.out))
    except (FileNotFoundError, ValueError) as error:
        parser.exit(1, f"bpt-plot: error: {error}\n")


if __name__ == "__main__":
    run()
