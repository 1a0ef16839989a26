"""Runs tests/multidevice/ on 8 CPU devices, in one subprocess (the device count is fixed when
jax starts, and every other test module runs on one device); and, on a machine with two GPUs
or more, context-parallel attention on the real devices (marked gpu)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import with_xla_flags

HERE = Path(__file__).resolve().parent


def test_multidevice_suite_on_8_cpu_devices():
    env = with_xla_flags(dict(os.environ, JAX_PLATFORMS="cpu"), "--xla_force_host_platform_device_count=8")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(HERE / "multidevice" / "parallel_cases.py"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=HERE.parent,
    )
    summary = proc.stdout.strip().splitlines()[-1:] or ["no output"]
    print(f"multidevice: {summary[0]}")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in summary[0] and "skipped" not in summary[0], summary[0]


def _gpus() -> int:
    import jax

    return jax.device_count() if jax.default_backend() == "gpu" else 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs or more")
@pytest.mark.parametrize(
    "strategy,head_groups", [("ring", 1), ("ring", 2), ("all_gather", 1), ("all_gather", 2)]
)
def test_context_parallel_attention_on_gpus_with_bpts_kernels(strategy, head_groups):
    """Causal attention over a sequence sharded across the GPUs (zigzag), each hop by bpt's
    Pallas kernels (on H100-class GPUs the Mosaic GPU ones, the fused backward included),
    against float32 attention on one device: the output and the three gradients, bf16 GQA,
    all heads at once and in two groups."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from bpt.ops import reference_attention
    from bpt.parallel import context_parallel_attention, make_mesh
    from bpt.parallel.ring import layout_permutation

    n = jax.device_count()
    mesh = make_mesh(sequence=n)
    seq = 4096 * n
    perm = layout_permutation(seq, n, "zigzag")
    inv = np.argsort(perm)
    kq, kk, kv, kc = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(kq, (1, seq, 4, 128), jnp.bfloat16)
    k = jax.random.normal(kk, (1, seq, 2, 128), jnp.bfloat16)
    v = jax.random.normal(kv, (1, seq, 2, 128), jnp.bfloat16)
    cot = jax.random.normal(kc, (1, seq, 4, 128), jnp.float32)
    up = lambda x: x.astype(jnp.float32)  # noqa: E731

    def ref_loss(q, k, v):  # in layout order, like the sharded call
        with jax.default_matmul_precision("highest"):
            out = reference_attention(up(q)[:, inv], up(k)[:, inv], up(v)[:, inv], causal=True)[:, perm]
        return jnp.sum(out * cot), out

    def loss(q, k, v):
        out = context_parallel_attention(
            q, k, v, mesh=mesh, strategy=strategy, layout="zigzag", impl="pallas", head_groups=head_groups
        )
        return jnp.sum(up(out) * cot), out

    ref_grads, ref_out = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    sharded = NamedSharding(mesh, PartitionSpec(None, "sequence"))
    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(
        *(jax.device_put(x, sharded) for x in (q, k, v))
    )
    for got, want in zip((out, *grads), (ref_out, *ref_grads)):
        err = float(jnp.linalg.norm(up(got) - want) / jnp.linalg.norm(want))
        assert err < 1e-2, err


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs or more")
def test_layer_norm_kernels_per_device_on_gpus():
    """model.norm_impl=pallas with fsdp over the GPUs: bpt's LayerNorm kernels (Triton, on each
    device's rows under shard_map) in the compiled step, and its loss and gradients those of
    XLA's norms on the same mesh (float32)."""
    import dataclasses

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from conftest import rel_err, tree_rel_err

    from bpt.models.gpt import GPT, GPTConfig
    from bpt.parallel import Parallelism, make_mesh

    n = jax.device_count()
    cfg = GPTConfig(vocab_size=512, num_layers=2, d_model=256, num_heads=2, q_chunk_size=256, kv_chunk_size=256,
                    loss_chunk_size=256, max_seq_len=1024, attention_impl="blockwise")  # fmt: skip
    par = Parallelism(make_mesh(fsdp=n))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2 * n, 1024), 0, cfg.vocab_size)
    params = nn.meta.unbox(GPT(cfg).init(jax.random.PRNGKey(0), tokens[:1, :8])["params"])

    def step(impl):
        model = GPT(dataclasses.replace(cfg, norm_impl=impl), parallel=par)
        loss = lambda p: model.apply({"params": p}, tokens, targets=jnp.roll(tokens, -1, 1)).loss  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))

    (loss_xla, grads_xla), (loss_pallas, grads_pallas) = step("xla")(params), step("pallas")(params)
    assert "__gpu$xla.gpu.triton" in step("pallas").lower(params).compile().as_text()
    assert rel_err(loss_pallas, loss_xla) < 1e-5
    assert tree_rel_err(grads_pallas, grads_xla) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs or more")
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_flash_attention_over_sequence_shards_on_gpus(packed):
    """FLASH's mixed chunk attention with the tokens in contiguous shards over the GPUs (each
    device's chunks through the Pallas kernels, the earlier devices' linear sum by one
    all-gather), bf16 at flash_125m's sizes, against the float32 one-device op: the output and
    the gradients of all five inputs, with documents that span devices when packed."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from bpt.ops.gau import mixed_chunk_attention
    from bpt.parallel import make_mesh
    from bpt.parallel.gau import sharded_mixed_chunk_attention

    n = jax.device_count()
    mesh = make_mesh(sequence=n)
    g, t, s, e = 256, 1024 * n, 128, 1536
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    qk = [jax.random.normal(k, (1, t, s), jnp.bfloat16) for k in keys[:4]]
    v = jax.random.normal(keys[4], (1, t, e), jnp.bfloat16)
    cot = jax.random.normal(keys[5], (1, t, e), jnp.float32)
    # Packed: a document from the middle of device 0 to the middle of device 1 (and, with
    # more GPUs, one that covers whole devices), then the rest.
    seg = jnp.array([[0] * 512 + [1] * 1024 + [2] * (t - 1536)]) if packed else None
    settings = dict(chunk_size=g, quad_scale=1 / g, lin_scale=1 / t, segment_ids=seg)
    up = lambda x: x.astype(jnp.float32)  # noqa: E731

    def ref_loss(*a):
        with jax.default_matmul_precision("highest"):
            out = mixed_chunk_attention(*map(up, a), impl="blockwise", **settings)
        return jnp.sum(out * cot), out

    def loss(*a):
        out = sharded_mixed_chunk_attention(*a, mesh=mesh, impl="pallas", **settings)
        return jnp.sum(up(out) * cot), out

    ref_grads, ref_out = jax.jit(jax.grad(ref_loss, argnums=tuple(range(5)), has_aux=True))(*qk, v)
    sharded = NamedSharding(mesh, PartitionSpec(None, "sequence"))
    grads, out = jax.jit(jax.grad(loss, argnums=tuple(range(5)), has_aux=True))(
        *(jax.device_put(x, sharded) for x in (*qk, v))
    )
    for got, want in zip((out, *grads), (ref_out, *ref_grads)):
        err = float(jnp.linalg.norm(up(got) - want) / jnp.linalg.norm(want))
        assert err < 1e-2, err


def test_head_groups_split_long_shards_only():
    from bpt.parallel.ring import GROUP_BYTES, head_groups_for

    ring = dict(shards=4, strategy="ring")
    assert head_groups_for(1, 16384, 16, 128, **ring) == 1  # 256 MiB of dK/dV sums
    assert head_groups_for(1, 262144, 16, 128, **ring) == 4  # 4 GiB: four groups of 1 GiB
    assert head_groups_for(1, 692224, 16, 128, **ring) == 16  # 676 MiB a head: one at a time
    assert head_groups_for(1, 65536, 8, 128, shards=4, strategy="all_gather") == 2  # 2 GiB: all 4 shards
    for tokens in (4096, 100_000, 10**6):
        groups = head_groups_for(2, tokens, 12, 64, **ring)
        assert 12 % groups == 0
        fits = 2 * 4 * 2 * tokens * 64 * 12 // groups <= GROUP_BYTES
        assert fits or groups == 12


def test_one_rule_table_places_parameters_and_activations_by_their_logical_names():
    """Models name what an axis is; RULES says where it lives, as a stored parameter, as a
    weight in use (gathered over fsdp and sequence) and as an activation."""
    from jax.sharding import AbstractMesh, PartitionSpec

    from bpt.parallel.mesh import WEIGHT_SHARD_AXES, activation_spec, logical_to_spec

    mesh = AbstractMesh((2, 2, 2, 2), ("data", "fsdp", "sequence", "tensor"))
    assert activation_spec(("batch", "length", "embed"), mesh) == PartitionSpec(("data", "fsdp"), "sequence", None)
    assert activation_spec(("batch", "length", "heads", "head_dim"), mesh)[2] == "tensor"
    assert activation_spec((None, "length"), mesh) == PartitionSpec(None, "sequence")
    stored = logical_to_spec(("embed", "mlp"), (8, 8), mesh, "w")
    assert stored == PartitionSpec(("fsdp", "sequence"), "tensor")
    in_use = logical_to_spec(("vocab", "embed"), (8, 8), mesh, "w", drop=WEIGHT_SHARD_AXES)
    assert in_use == PartitionSpec("tensor", None)
    small = AbstractMesh((4, 1, 1, 1), ("data", "fsdp", "sequence", "tensor"))  # axes of one device drop out
    assert activation_spec(("batch", "length", "embed"), small) == PartitionSpec("data", None, None)
    with pytest.raises(ValueError, match="vocab size 7, which mesh.tensor=2 cannot split evenly"):
        logical_to_spec(("vocab", "embed"), (7, 8), mesh, "the embedding")


def test_the_models_name_no_mesh_axis():
    """Sharding in bpt/models goes through logical names (bpt.parallel.mesh.RULES)."""
    import re

    root = HERE.parent / "bpt"
    for path in [*(root / "models").glob("*.py"), root / "sample.py"]:
        text = path.read_text()
        named = re.findall(r"""["'](data|fsdp|sequence|tensor)["']""", text)
        assert not named and "BATCH_AXES" not in text and "PartitionSpec(" not in text, (path.name, named)
