"""Several processes (hosts, or one process per GPU) as one JAX program: jax.distributed.

A run is one of several processes when the coordinator's address, the process count and this
process's index are given, as flags of bpt-train or as the environment variables
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, or when SLURM started it as one
of several tasks (jax.distributed then reads SLURM's variables itself).

Several processes on one host (one a GPU) either each see only their GPU
(CUDA_VISIBLE_DEVICES) or see every GPU and take theirs with local_device_ids (bpt-train
--local_device_ids); without either, each would take every GPU of the host. NCCL joins the
processes' GPUs over NVLink either way (docs/notes/multi_gpu.md).
"""

from __future__ import annotations

import os
import sys
import time

import jax


def initialize(
    coordinator_address: str = "", num_processes: int = 0, process_id: int = -1, local_device_ids: str = ""
) -> bool:
    """Joins the distributed runtime if this process is one of several; True if it did.
    local_device_ids: this process's GPUs of the host, comma-separated ("" : all it sees).
    Must run before anything else touches jax's devices."""
    local = parse_device_ids(local_device_ids)
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
        jax.distributed.initialize(
            coordinator_address=address, num_processes=count, process_id=index, local_device_ids=local
        )
        return True
    if int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_PROCID" in os.environ:
        jax.distributed.initialize(local_device_ids=local)
        return True
    if local is not None:
        raise ValueError("--local_device_ids is for a run of several processes (--num_processes > 1)")
    return False


def parse_device_ids(text: str) -> list[int] | None:
    """'0,1' -> [0, 1]; '' -> None."""
    if not text.strip():
        return None
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise ValueError(f"--local_device_ids must be distinct GPU indices such as 0 or 0,1; got {text!r}")
    return ids


def shutdown() -> None:
    """Leaves the distributed runtime the way jax does. Every process waits there for the
    others, so process 0, which serves the coordination, stops serving last. (On jax 0.11.2
    GPUs each process's backend then logs a "WatchTasksAsync failed ... Connection refused"
    warning as the service stops: a backend watches the job's tasks until it is destroyed.
    leave() ends a finished run without it.)"""
    jax.distributed.shutdown()


def leave(code: int = 0, *, linger_s: float = 1.0, timeout_s: float = 300.0) -> None:
    """Ends this process of a finished several-process run with exit status code, leaving
    no coordination warning behind (see shutdown). All processes meet at the coordination
    service's barrier (an error after timeout_s if one never comes, as jax's own shutdown
    gives up); then every process but 0 ends at once, and process 0, whose end stops the
    service, ends linger_s later, when no other process's backend is left to find it gone.
    Ends the process without Python's exit handlers: call it once everything is written
    (checkpoints waited for, logs closed). scripts/repro_exit_warning.py compares the ways."""
    _barrier("bpt_leave", timeout_s)
    index = jax.process_index()
    sys.stdout.flush()
    sys.stderr.flush()
    if index == 0:
        time.sleep(linger_s)
    os._exit(code)


def _barrier(name: str, timeout_s: float) -> None:
    """Every process of the run waits here for the others, through the coordination service
    (no device collective, so a process that never comes is an error after timeout_s, not a
    hang)."""
    from jax._src import distributed as jax_distributed  # the client jax.distributed made

    client = getattr(getattr(jax_distributed, "global_state", None), "client", None)
    if client is None:  # not several processes, or jax changed: a collective over the devices
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
        return
    client.wait_at_barrier(name, int(timeout_s * 1000))
