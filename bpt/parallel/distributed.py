"""Several processes (hosts, or one process per GPU) as one JAX program: jax.distributed.

A run is one of several processes when the coordinator's address, the process count and this
process's index are given, as flags of bpt-train or as the environment variables
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, or when SLURM started it as one
of several tasks (jax.distributed then reads SLURM's variables itself).
"""

from __future__ import annotations

import os

import jax


def initialize(coordinator_address: str = "", num_processes: int = 0, process_id: int = -1) -> bool:
    """Joins the distributed runtime if this process is one of several; True if it did.
    Must run before anything else touches jax's devices."""
    address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
    count = num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0") or 0)
    index = process_id if process_id >= 0 else int(os.environ.get("JAX_PROCESS_ID", "-1") or -1)
    if address or count > 1:
        missing = [
            name
            for name, absent in (
                ("--coordinator_address (JAX_COORDINATOR_ADDRESS)", not address),
                ("--num_processes (JAX_NUM_PROCESSES)", count < 1),
                ("--process_id (JAX_PROCESS_ID)", index < 0),
            )
            if absent
        ]
        if missing:
            raise ValueError(f"a run of several processes needs {', '.join(missing)} as well")
        if not 0 <= index < count:
            raise ValueError(f"--process_id={index} must be in [0, --num_processes={count})")
        jax.distributed.initialize(coordinator_address=address, num_processes=count, process_id=index)
        return True
    if int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_PROCID" in os.environ:
        jax.distributed.initialize()
        return True
    return False


def shutdown() -> None:
    """Leaves the distributed runtime. Every process waits there for the others, so process
    0, which serves the coordination, exits last: without it the others' heartbeats found
    its port closed ("coordination_service ... Connection refused" at the end of a run)."""
    jax.distributed.shutdown()
