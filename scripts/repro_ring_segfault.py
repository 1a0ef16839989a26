"""The XLA GPU compiler crash of context parallelism over two sequence shards, reduced.

    python scripts/repro_ring_segfault.py                      # every case, one process each
    python scripts/repro_ring_segfault.py --cases toy_group_loop,bpt_ring_groups2
    python scripts/repro_ring_segfault.py --case toy_group_loop   # one case, in this process

Seen on jax 0.11.2 with CUDA 13 (2 and 4 H100s, 2026-11-27): bpt-train with GPT-1B and
mesh.sequence=2 at 256K tokens and more died of a segmentation fault inside XLA's GPU
compiler, with the ring's heads attended in groups (mesh.context_head_groups=0 splits shards
of 128K tokens and more into groups; 2 forced it at any length). Each case below compiles
one program (forward and backward) on a mesh of the first two devices, in a process of its
own, and the table says which compiled and which killed their process. The cases go from a
few lines of lax to bpt's ring attention and a whole GPT-1B training step:

- toy_*: a loop over head groups (lax.fori_loop) whose body sends a block to the other
  device (lax.ppermute) and multiplies; variants with the loop over layers around it, with
  a lax.cond, with a loop over hops inside it, and with the groups unrolled.
- bpt_*: bpt.parallel.ring's context_parallel_attention, forward and backward, with the heads
  in one group or two; the "_loop" case restores the group loop bpt used before the fix
  (lax.fori_loop over the groups), "_unrolled" the one it uses now.
- gpt1b_*: TrainingStep(configs/gpt_1b.py) at --step_tokens over mesh.sequence=2, compiled
  from shapes (nothing is allocated); the words of the name cut the model down
  (STEP_SETTINGS: one layer, no layer remat, no layer loop, the MemoryEfficient mode, full
  logits).

Without two devices the cases run on two simulated CPU devices (they then all compile: the
crash is in the GPU backend).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = (
    "toy_group_loop",
    "toy_group_loop_in_layer_loop",
    "toy_group_loop_with_cond",
    "toy_group_loop_with_hop_loop",
    "toy_groups_unrolled",
    "bpt_ring_groups1",
    "bpt_ring_groups2_loop",
    "bpt_ring_groups2_unrolled",
    "bpt_all_gather_groups2_loop",
    "gpt1b_step_groups2",
    "gpt1b_step_groups2_loop",
    "gpt1b_layers1_loop",
    "gpt1b_layers1_noremat_loop",
    "gpt1b_layers1_noscan_loop",
    "gpt1b_layers1_memory_efficient_loop",
    "gpt1b_layers1_fp32_loss_loop",
)
# The gpt1b cases' settings beyond the step's own: which part of the model the crash needs.
STEP_SETTINGS = {
    "layers1": ["model.num_layers=1"],
    "noremat": ["model.remat_layer=none"],
    "noscan": ["model.scan_layers=False"],
    "memory_efficient": ["model.attention_mode=memory_efficient"],
    "fp32_loss": ["model.loss_impl=full"],
}
# CASE@NAME runs CASE with these XLA flags added (XLA_FLAGS): which GPU pass is involved.
FLAG_SETS = {
    "no_double_buffering": "--xla_gpu_enable_while_loop_double_buffering=false",
    "no_unrolling": "--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_NO_UNROLL",
    "no_pipelined_p2p": "--xla_gpu_enable_pipelined_p2p=false",
    "no_latency_hiding": "--xla_gpu_enable_latency_hiding_scheduler=false",
}


def _mesh():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.asarray(jax.devices()[:2]), ("sequence",))


def _toy(case: str, tokens: int):
    """The ring's group loop in a few lines: heads [2 groups of 8], head_dim 128, bf16."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    heads, dim, groups = 16, 128, 2
    mesh = _mesh()
    swap = [(0, 1), (1, 0)]

    def hop(q, k):  # one hop's work: scores against the other device's keys
        visiting = lax.ppermute(k, "sequence", swap)
        if case == "toy_group_loop_with_cond":
            before = lax.axis_index("sequence") > 0
            return lax.cond(
                before,
                lambda: jnp.einsum("shd,shd->sh", q, visiting),
                lambda: jnp.einsum("shd,shd->sh", q * 2, visiting),
            )
        if case == "toy_group_loop_with_hop_loop":
            visiting = lax.fori_loop(0, 2, lambda t, x: lax.ppermute(x, "sequence", swap), visiting)
        return jnp.einsum("shd,shd->sh", q, visiting)

    def group(g, q, k, out):
        size = heads // groups
        qg = lax.dynamic_slice_in_dim(q, g * size, size, 1)
        kg = lax.dynamic_slice_in_dim(k, g * size, size, 1)
        return lax.dynamic_update_slice_in_dim(out, hop(qg, kg), g * size, 1)

    def groups_of(q, k):
        out = jnp.zeros(q.shape[:2], jnp.bfloat16)
        if case == "toy_groups_unrolled":
            for g in range(groups):
                out = group(g, q, k, out)
            return out
        return lax.fori_loop(0, groups, lambda g, o: group(g, q, k, o), out)

    def local(q, k):
        if case == "toy_group_loop_in_layer_loop":
            return lax.fori_loop(0, 2, lambda i, o: o + groups_of(q, k), jnp.zeros(q.shape[:2], jnp.bfloat16))
        return groups_of(q, k)

    sharded = jax.shard_map(
        local, mesh=mesh, in_specs=(P("sequence"), P("sequence")), out_specs=P("sequence"), check_vma=False
    )
    loss = lambda q, k: sharded(q, k).astype(jnp.float32).sum()  # noqa: E731
    x = jax.ShapeDtypeStruct((tokens, heads, dim), jnp.bfloat16)
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, x)


def _bpt(case: str, tokens: int):
    import jax
    import jax.numpy as jnp

    from bpt.parallel import ring

    if case.endswith("_loop"):
        ring._in_head_groups = _looped_head_groups  # the form before the fix
    mesh = _mesh()
    strategy = "all_gather" if "all_gather" in case else "ring"
    groups = 1 if case.endswith("groups1") else 2

    def loss(q, k, v):
        out = ring.ring_attention if strategy == "ring" else ring.all_gather_attention
        return out(q, k, v, mesh=mesh, head_groups=groups).astype(jnp.float32).sum()

    x = jax.ShapeDtypeStruct((1, tokens, 16, 128), jnp.bfloat16)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x)


def _looped_head_groups(groups, fn, args, arg_axes, results, result_axes):
    """bpt.parallel.ring._in_head_groups as it was: a lax.fori_loop over the groups."""
    import jax.numpy as jnp
    from jax import lax

    if groups == 1:
        return fn(*args)

    def piece(x, axis, g):
        size = x.shape[axis] // groups
        return lax.dynamic_slice_in_dim(x, g * size, size, axis)

    def body(g, filled):
        parts = fn(*(piece(x, axis, g) for x, axis in zip(args, arg_axes)))
        return tuple(
            lax.dynamic_update_slice_in_dim(r, p.astype(r.dtype), g * p.shape[axis], axis)
            for r, p, axis in zip(filled, parts, result_axes)
        )

    return lax.fori_loop(0, groups, body, tuple(jnp.zeros(r.shape, r.dtype) for r in results))


def _gpt1b(case: str, tokens: int):
    from bpt.config import load_config_file, override
    from bpt.parallel import ring
    from bpt.train.probe import TrainingStep

    if case.endswith("_loop"):
        ring._in_head_groups = _looped_head_groups

    c = load_config_file(str(ROOT / "configs" / "gpt_1b.py"))
    settings = [setting for word, more in STEP_SETTINGS.items() if f"_{word}" in case for setting in more]
    override(
        c,
        f"data.seq_len={tokens}",
        "train.batch_size=1",
        "mesh.data=1",
        "mesh.sequence=2",
        "mesh.context_head_groups=2",
        "model.remat_layer=attention_saveable",
        *settings,
    )
    import jax

    return TrainingStep(c, devices=jax.devices()[:2])


def run_case(case: str, tokens: int) -> None:
    start = time.perf_counter()
    if case.startswith("toy_"):
        _toy(case, tokens).compile()
    elif case.startswith("bpt_"):
        _bpt(case, tokens).compile()
    else:
        step = _gpt1b(case, tokens)
        print(f"compiled step: {step.memory().peak / 2**30:.1f} GiB")
    print(f"compiled in {time.perf_counter() - start:.1f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", default="", help="run this one case here")
    p.add_argument("--cases", default=",".join(CASES), help="cases to run, each in its own process")
    p.add_argument("--tokens", type=int, default=16384, help="tokens of the toy and bpt cases' sequence")
    p.add_argument("--step_tokens", type=int, default=262144, help="tokens of the gpt1b cases")
    p.add_argument("--timeout", type=int, default=300, help="seconds a case may take")
    args = p.parse_args()
    if args.case:
        run_case(args.case, args.step_tokens if args.case.startswith("gpt1b") else args.tokens)
        return
    env = dict(os.environ)
    import shutil

    if not shutil.which("nvidia-smi"):
        env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="2")
    rows = []
    for case in args.cases.split(","):
        name, _, flag_set = case.partition("@")
        case_env = dict(env)
        if flag_set:
            case_env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FLAG_SETS[flag_set]}".strip()
        start = time.perf_counter()
        try:
            done = subprocess.run(
                [sys.executable, __file__, "--case", name, "--tokens", str(args.tokens),
                 "--step_tokens", str(args.step_tokens)],
                capture_output=True, text=True, env=case_env, timeout=args.timeout,
            )  # fmt: skip
            code = done.returncode
            text = (done.stdout + done.stderr).strip().splitlines()
        except subprocess.TimeoutExpired:
            code, text = None, [f"still compiling after {args.timeout} s"]
        seconds = time.perf_counter() - start
        if code == 0:
            result = "compiles"
        elif code is None:
            result = "timeout"
        elif code < 0:
            result = f"killed by signal {-code}" + (" (segmentation fault)" if code == -11 else "")
        else:
            result = f"error (exit {code})"
        last = next((line for line in reversed(text) if line.strip()), "")
        rows.append((case, result, f"{seconds:.0f}", last[:110]))
        print(f"{case}: {result} ({seconds:.0f} s) {last[:110]}", flush=True)
    print("\n| case | result | seconds | last line |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
