"""bpt-eval: validation loss and perplexity of a run's latest checkpoint.

    bpt-eval --workdir runs/x [--eval_batches 32] [--batch_size 8]

Prints one JSON line and writes it to <workdir>/eval.json. It only reads the run: a
checkpoint that does not load is reported, never moved.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

from absl import flags

from bpt.cli import common


def define_flags() -> SimpleNamespace:
    return SimpleNamespace(
        workdir=flags.DEFINE_string(
            "workdir", None, "The run's directory (it holds config.json and checkpoints/).", required=True
        ),
        batches=flags.DEFINE_integer(
            "eval_batches", 0, "Batches to evaluate (0: the run's train.eval_batches).", lower_bound=0
        ),
        batch_size=flags.DEFINE_integer(
            "batch_size", 0, "Sequences per batch (0: the run's train.batch_size).", lower_bound=0
        ),
    )


def main(f: SimpleNamespace, argv: list[str]) -> None:
    common.set_memory_fraction(common.run_memory_fraction(f.workdir.value))  # before jax starts
    from bpt.train.loop import evaluate_checkpoint
    from bpt.train.metrics import strict_json

    result = evaluate_checkpoint(f.workdir.value, eval_batches=f.batches.value, batch_size=f.batch_size.value)
    line = strict_json(result)
    (Path(f.workdir.value) / "eval.json").write_text(line + "\n")
    print(line)


def run() -> None:
    common.run_command(sys.modules[__name__])


if __name__ == "__main__":
    run()
