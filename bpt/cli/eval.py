"""bpt-eval: validation loss and perplexity of a run's latest checkpoint.

    bpt-eval --workdir runs/x [--eval_batches 32] [--batch_size 8] [--by_position]

Prints one JSON line and writes it to <workdir>/eval.json. It only reads the run: a
checkpoint that does not load is reported, never moved.

--by_position adds the loss at each range of positions in the context window ([0, 64),
[64, 128), [128, 256), ... doubling up to data.seq_len): a model that uses a long context
predicts late positions better. The ranges are printed as a table (on stderr) and drawn in
<workdir>/loss_by_position.png; `bpt-plot --by_position A B ...` puts several runs on one plot.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

from absl import flags

from bpt.cli import common

SUPERVISED = True  # run in a watched child process (common.supervise): a crash is still one sentence


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
        by_position=flags.DEFINE_bool(
            "by_position", False, "Also the loss by position in the window, in ranges that double in length."
        ),
        first_bucket=flags.DEFINE_integer(
            "first_bucket", 64, "With --by_position: the length of the first range, [0, N).", lower_bound=1
        ),
    )


def main(f: SimpleNamespace, argv: list[str]) -> None:
    common.set_memory_fraction(common.run_memory_fraction(f.workdir.value))  # before jax starts
    from bpt.train.loop import evaluate_checkpoint
    from bpt.train.metrics import strict_json

    workdir = Path(f.workdir.value)
    result = evaluate_checkpoint(
        workdir,
        eval_batches=f.batches.value,
        batch_size=f.batch_size.value,
        first_bucket=f.first_bucket.value if f.by_position.value else 0,
    )
    line = strict_json(result)
    (workdir / "eval.json").write_text(line + "\n")
    if "by_position" in result:
        from bpt.cli.plot import format_by_position, plot_by_position

        print(format_by_position(result["by_position"]), file=sys.stderr)
        plot_by_position([workdir], workdir / "loss_by_position.png")
    print(line)


def run() -> None:
    common.run_command(sys.modules[__name__])


if __name__ == "__main__":
    run()
