"""bpt-eval: validation loss and perplexity of a run's latest checkpoint.

    bpt-eval --workdir runs/x [--eval_batches 32] [--batch_size 8]

Prints one JSON line and writes it to <workdir>/eval.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "The run's directory (it holds config.json and checkpoints/).", required=True
)
_BATCHES = flags.DEFINE_integer("eval_batches", 0, "Batches to evaluate (0: the run's train.eval_batches).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 0, "Sequences per batch (0: the run's train.batch_size).")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)
    from bpt.train.loop import evaluate_checkpoint

    result = evaluate_checkpoint(_WORKDIR.value, eval_batches=_BATCHES.value, batch_size=_BATCH_SIZE.value)
    line = json.dumps(result)
    (Path(_WORKDIR.value) / "eval.json").write_text(line + "\n")
    print(line)


def run() -> None:
    app.run(main)


if __name__ == "__main__":
    run()
