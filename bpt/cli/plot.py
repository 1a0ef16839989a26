"""bpt-plot: loss and throughput curves of one or more runs, to a PNG.

    bpt-plot runs/a runs/b --out curves.png

Reads each run's metrics.jsonl; a resumed run's repeated steps count once (the last line).
"""

from __future__ import annotations

import argparse
import json
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


def plot_runs(workdirs: list[str | Path], out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {Path(w).name or str(w): read_metrics(w) for w in workdirs}
    panels = [("loss", "loss (nats per token)"), ("tokens_per_sec", "tokens / s")]
    if any("mfu" in r for records in runs.values() for r in records):
        panels.append(("mfu", "model FLOPs utilization (fraction of peak)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
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
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def run() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("workdirs", nargs="+", help="bpt-train workdirs")
    parser.add_argument("--out", default="curves.png", help="PNG to write")
    args = parser.parse_args()
    try:
        print(plot_runs(args.workdirs, args.out))
    except (FileNotFoundError, ValueError) as error:
        parser.exit(1, f"bpt-plot: error: {error}\n")


if __name__ == "__main__":
    run()
