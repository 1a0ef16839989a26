"""Which way of ending a run of several jax processes leaves no coordination-service warning.

On jax 0.11.2 GPUs, every process of a jax.distributed run that ends with
jax.distributed.shutdown() logs `WatchTasksAsync failed for task N: UNAVAILABLE ...
Connection refused` as process 0's coordination service stops: each backend keeps watching
the job's tasks until it is destroyed. This starts --processes processes on this host (one a
GPU, or one CPU device each), has them all-reduce one array over every device, ends them each
way below, and prints for each way its exit statuses, its seconds and whether a process said
anything of that kind.

    python scripts/repro_exit_warning.py            # every way
    python scripts/repro_exit_warning.py --ways shutdown,leave

Ways:
  shutdown      jax.distributed.shutdown(), as bpt-train ended before
  clear         every array dropped, jax's caches and backends cleared, then shutdown()
  leave         bpt.parallel.distributed.leave(): a barrier, then every process but 0 ends
                at once, and process 0 (whose end stops the service) a moment after
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

WAYS = ("shutdown", "clear", "leave")


def child(way: str, address: str, count: int, index: int) -> None:
    import jax

    jax.distributed.initialize(coordinator_address=address, num_processes=count, process_id=index)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("d",))
    local = np.full((len(jax.local_devices()),), float(index + 1), np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("d")), local)
    total = float(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))(x))
    print(f"process {index}: sum {total}", flush=True)
    if way == "shutdown":
        jax.distributed.shutdown()
    elif way == "clear":
        import gc

        from jax.extend import backend

        del x
        jax.clear_caches()
        backend.clear_backends()
        gc.collect()
        jax.distributed.shutdown()
    elif way == "leave":
        from bpt.parallel.distributed import leave

        leave()
    else:
        raise ValueError(way)


def run_way(way: str, processes: int, on_gpu: bool, timeout: float) -> dict:
    with socket.socket() as free:
        free.bind(("localhost", 0))
        port = free.getsockname()[1]
    procs = []
    start = time.monotonic()
    for i in range(processes):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if on_gpu:
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        else:
            env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
        argv = [sys.executable, __file__, "--child", way, f"localhost:{port}", str(processes), str(i)]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    codes, texts = [], []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(timeout - (time.monotonic() - start), 1))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        codes.append(proc.returncode)
        texts.append(out)
    from check_gpus import EXIT_COMPLAINTS  # what the check campaign fails a clean exit for

    said = [line for text in texts for line in text.splitlines() if any(c in line for c in EXIT_COMPLAINTS)]
    return dict(way=way, codes=codes, seconds=time.monotonic() - start, complaints=said, outputs=texts)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        way, address, count, index = sys.argv[2:6]
        child(way, address, int(count), int(index))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--cpu", action="store_true", help="CPU devices even where GPUs are")
    p.add_argument("--verbose", action="store_true", help="print every process's output")
    args = p.parse_args()
    import shutil

    on_gpu = not args.cpu and shutil.which("nvidia-smi") is not None
    rows = []
    for way in args.ways.split(","):
        result = run_way(way, args.processes, on_gpu, args.timeout)
        rows.append(result)
        if args.verbose or result["complaints"]:
            for i, text in enumerate(result["outputs"]):
                print(f"--- {way}, process {i}:\n{text.strip()[-3000:]}", flush=True)
    print("| way | exit statuses | seconds | complaints |")
    print("|---|---|---|---|")
    for r in rows:
        first = r["complaints"][0][:100] if r["complaints"] else ""
        print(f"| {r['way']} | {r['codes']} | {r['seconds']:.1f} | {len(r['complaints'])} {first} |")


if __name__ == "__main__":
    main()
