"""Device memory between the steps of a bpt-train run: what each step leaves allocated.

    python scripts/step_memory.py --config configs/gpt_1b.py --workdir /tmp/w \\
        --config.data.seq_len=32768 --config.train.steps=4

Runs bpt-train in this process (its usual flags; every step is logged) and prints the step's
compiled memory (arguments, outputs, aliased, temp) after the compile and, after each step,
the allocator's bytes in use, its largest free block and the live arrays. A step that fails to
allocate although its compiled peak fits the device shows here as a largest free block smaller
than the step's temp (fragmentation), or as bytes in use that grow from step to step (a leak).
"""

from __future__ import annotations

import collections
import os
import sys

os.environ["BPT_NO_SUPERVISOR"] = "1"  # in this process: the hooks below must see the loop

GIB = 2**30


def stats_line(tag: str) -> str:
    import jax

    s = jax.local_devices()[0].memory_stats() or {}
    keys = ("bytes_in_use", "peak_bytes_in_use", "largest_free_block_bytes", "bytes_limit", "pool_bytes")
    shown = ", ".join(f"{k}={s[k] / GIB:.2f}G" for k in keys if k in s)
    arrays = jax.live_arrays()
    by_shape = collections.Counter()
    for a in arrays:
        by_shape[(a.shape, str(a.dtype))] += a.nbytes
    total = sum(by_shape.values())
    top = ", ".join(f"{s}{d}:{b / GIB:.2f}G" for (s, d), b in by_shape.most_common(3))
    return f"[memory {tag}] {shown}; {len(arrays)} live arrays {total / GIB:.2f}G (largest: {top})"


def main() -> None:
    from bpt.train import loop
    from bpt.train.probe import StepMemory

    plain_preflight, plain_log = loop.preflight, loop.Reporter.log

    def preflight(config, train_step, state, batch, rng):
        compiled = train_step.lower(state, batch, rng).compile()
        m = StepMemory.of(compiled)
        print(
            f"[memory compiled] arguments={m.arguments / GIB:.2f}G outputs={m.outputs / GIB:.2f}G "
            f"aliased={m.aliased / GIB:.2f}G temp={m.temp / GIB:.2f}G peak={m.peak / GIB:.2f}G",
            flush=True,
        )
        print(stats_line("before step 1"), flush=True)
        return plain_preflight(config, train_step, state, batch, rng)

    def log(self, pending, step, state, **kwargs):
        row = plain_log(self, pending, step, state, **kwargs)
        print(f"\n{stats_line(f'after step {step}')}", flush=True)
        return row

    loop.preflight, loop.Reporter.log = preflight, log
    from bpt.cli import train

    sys.argv = [sys.argv[0], *sys.argv[1:], "--config.train.log_every=1"]
    train.run()


if __name__ == "__main__":
    main()
