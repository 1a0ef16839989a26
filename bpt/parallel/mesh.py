"""The device mesh and the rules that map logical axis names to it.

Mesh axes, outermost first: data, fsdp, sequence, tensor. The innermost axes talk the most
(tensor parallelism every layer, the ring every hop), so they get the neighbouring devices.

- data: the batch is split; parameters are replicated.
- fsdp: the batch is split and every weight is sharded (ZeRO-3): a layer's weights are
  gathered when it runs and its gradients reduce-scattered.
- sequence: the tokens of each sequence are split (context parallelism: ring or all-gather
  attention). The devices of a sequence group need the same weights, so weights are sharded
  over it as over fsdp.
- tensor: attention heads and the FFN's hidden units are split (Megatron style).

Models name what each axis of a parameter or an activation is (batch, length, embed, heads,
kv_heads, head_dim, mlp, vocab, positions, layers, qk: parameters through
nn.with_logical_partitioning, activations through Parallelism.constrain); RULES says where
each lives on the mesh, as a stored parameter and as an activation. No model names a mesh
axis.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp", "sequence", "tensor")
BATCH_AXES = ("data", "fsdp")
CONTEXT_PARALLEL = ("ring", "all_gather")
LOAD_BALANCE = ("zigzag", "striped", "none")
WEIGHT_SHARD_AXES = ("fsdp", "sequence")  # weights split here are gathered where they are used

# Logical axis -> the mesh axes that split it (None: every device holds it whole), as a stored
# parameter and as an activation (and a weight as a layer uses it: the parameter's axes less
# WEIGHT_SHARD_AXES, gathered). A name not listed is never split.
RULES = {
    #  name         parameter              activation
    "batch": (None, BATCH_AXES),
    "length": (None, "sequence"),  # a sequence's tokens (a decode cache's slots): context parallelism
    "embed": (("fsdp", "sequence"), None),  # ZeRO-3 over the batch and the sequence groups
    "vocab": ("tensor", "tensor"),
    "heads": ("tensor", "tensor"),
    "kv_heads": ("tensor", "tensor"),
    "mlp": ("tensor", "tensor"),
    "head_dim": (None, None),
    "qk": (None, None),  # FLASH's shared query/key base: small, replicated
    "positions": (None, None),
    "layers": (None, None),
}
PARAM_RULES = tuple((name, where[0]) for name, where in RULES.items())  # (name, mesh axes) pairs


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, sequence: int = 1, *, devices=None) -> Mesh:
    """A mesh with axes AXES over `devices` (default: all). One size may be -1: the devices left.

    Devices are laid out in jax.devices() order (process by process), so the batch axes, the
    outermost, split across hosts and the sequence and tensor axes stay within one.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": data, "fsdp": fsdp, "sequence": sequence, "tensor": tensor}
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
            raise ValueError(f"mesh.{name} must be a positive integer or -1; got {size!r}")
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"only one mesh size may be -1; got -1 for {', '.join('mesh.' + n for n in free)}")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if len(devices) % fixed:
            raise ValueError(
                f"mesh.{free[0]}=-1 takes the devices left, but {len(devices)} devices do not divide "
                f"by the other sizes' product {fixed}"
            )
        sizes[free[0]] = len(devices) // fixed
    if math.prod(sizes.values()) != len(devices):
        shape = " x ".join(f"{name} {sizes[name]}" for name in AXES)
        raise ValueError(
            f"the mesh {shape} needs {math.prod(sizes.values())} devices and there are {len(devices)}; "
            "set mesh.data, mesh.fsdp, mesh.sequence and mesh.tensor so that their product is the "
            "device count (one of them may be -1)"
        )
    grid = np.asarray(devices, dtype=object).reshape([sizes[name] for name in AXES])
    return Mesh(grid, AXES)


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """How a model runs on a mesh: the mesh, and how attention spans the sequence axis.

    context_parallel: 'ring' | 'all_gather'. load_balance: the token layout of the sequence
    shards, 'zigzag' | 'striped' | 'none'. head_groups: 'auto' | N, how many groups of heads
    attend across the shards one after another (bpt.parallel.ring).
    """

    mesh: Mesh
    context_parallel: str = "ring"
    load_balance: str = "zigzag"
    head_groups: int | str = "auto"

    def __post_init__(self):
        if self.context_parallel not in CONTEXT_PARALLEL:
            raise ValueError(
                f"unknown mesh.context_parallel {self.context_parallel!r}; allowed: {', '.join(CONTEXT_PARALLEL)}"
            )
        if self.load_balance not in LOAD_BALANCE:
            raise ValueError(
                f"unknown mesh.load_balance {self.load_balance!r}; allowed: {', '.join(LOAD_BALANCE)}"
            )

    def size(self, axis: str) -> int:
        return self.mesh.shape.get(axis, 1)

    def shards(self, name: str) -> int:
        """How many devices split an activation's logical axis name (RULES)."""
        return math.prod(self.size(a) for a in _mesh_axes_of(name, self.mesh, 1))

    @property
    def sequence(self) -> int:
        return self.size("sequence")

    @property
    def batch_shards(self) -> int:
        return math.prod(self.size(a) for a in BATCH_AXES)

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The part of a [batch, seq, heads, ...] activation one device holds: the batch over
        data x fsdp, the tokens over sequence, the heads over tensor (each rounded up)."""
        divisors = (self.batch_shards, self.sequence, self.size("tensor"))
        return tuple(-(-n // d) for n, d in zip(shape, divisors)) + tuple(shape[3:])

    def sharding(self, *spec) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    def logical(self, *names: str | None) -> NamedSharding:
        """The sharding of an activation whose leading axes are these logical names (RULES;
        None: not split); the axes after them are not split."""
        return NamedSharding(self.mesh, activation_spec(names, self.mesh))

    def constrain(self, x, *names: str | None):
        """x, constrained to the sharding of an activation whose leading axes are names."""
        return jax.lax.with_sharding_constraint(x, self.logical(*names))

    def activations(self) -> NamedSharding:
        """[batch, length, ...]: batch over data x fsdp, tokens over sequence."""
        return self.logical("batch", "length")

    def replicated(self) -> NamedSharding:
        return self.sharding()

    @property
    def runs_per_device(self) -> bool:
        """Whether per_device runs a function on each device's rows here (several devices, no
        tensor parallelism)."""
        return self.mesh.size > 1 and self.size("tensor") == 1

    def per_device(self, fn, *rows, weights, reduced: bool = False):
        """fn(*rows, weights) run by every device on its own rows (shard_map), or None where
        it cannot be. rows: [batch, seq, ...] arrays (or None) in the activations' sharding;
        weights: a pytree every device holds whole. fn returns rows, or with reduced=True a
        result it has already summed over the mesh (lax.psum over mesh.axis_names).

        For chunk loops that read weights (BPT's FFN, the chunked loss): a loop over the
        global chunks reduces the weights' gradient across the devices in every chunk, a
        loop per device once, when shard_map's backward sums it. Not with tensor
        parallelism (the chunk's matmuls need the tensor axis): None there, and on one device."""
        if not self.runs_per_device:
            return None
        spec = self.activations().spec
        return jax.shard_map(
            fn,
            mesh=self.mesh,
            in_specs=tuple(None if r is None else spec for r in rows) + (PartitionSpec(),),
            out_specs=PartitionSpec() if reduced else spec,
            check_vma=False,
        )(*rows, weights)

    def gathered(self, names: tuple, shape: tuple[int, ...]) -> NamedSharding:
        """A weight with these logical axes as a layer uses it: whole over fsdp and sequence,
        still split over tensor."""
        spec = logical_to_spec(names, shape, self.mesh, "a weight", drop=WEIGHT_SHARD_AXES)
        return NamedSharding(self.mesh, spec)


def mesh_axes(mesh: Mesh, names) -> tuple[str, ...] | None:
    """The axes among names that the mesh has with more than one device (None: none), for a
    PartitionSpec entry."""
    present = tuple(n for n in names if n in mesh.axis_names and mesh.shape[n] > 1)
    return present or None


def _mesh_axes_of(name: str | None, mesh: Mesh, column: int, drop=()) -> tuple[str, ...]:
    """The mesh axes (of more than one device, not in drop) that split logical axis name."""
    axes = RULES.get(name, (None, None))[column] if name is not None else None
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return mesh_axes(mesh, [a for a in axes if a not in drop]) or ()


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def activation_spec(names: tuple[str | None, ...], mesh: Mesh) -> PartitionSpec:
    """The PartitionSpec of an activation whose leading axes have these logical names (RULES'
    activation column)."""
    return PartitionSpec(*(_entry(_mesh_axes_of(name, mesh, 1)) for name in names))


def logical_to_spec(
    names: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh, where: str, *, drop=()
) -> PartitionSpec:
    """The PartitionSpec of a parameter whose axes have these logical names (RULES' parameter
    column); a mesh axis of size 1 (or named in drop) is left out, and an axis that does not
    divide is an error naming where."""
    spec = []
    for name, size in zip(names, shape):
        axes = _mesh_axes_of(name, mesh, 0, drop)
        shards = math.prod(mesh.shape[a] for a in axes)
        if size % shards:
            mesh_text = " x ".join(f"mesh.{a}={mesh.shape[a]}" for a in axes)
            raise ValueError(
                f"{where} has {name} size {size}, which {mesh_text} cannot split evenly; "
                f"choose mesh sizes that divide it{_hint(name)}"
            )
        spec.append(_entry(axes))
    return PartitionSpec(*spec)


def _hint(name: str) -> str:
    return {
        "vocab": " (the embedding holds model.vocab_size rounded up to model.vocab_multiple: make that a multiple of mesh.tensor)",
        "heads": " (model.num_heads)",
        "kv_heads": " (model.num_kv_heads)",
        "embed": " (model.d_model)",
        "mlp": " (model.mlp_hidden, or model.mlp_ratio x model.d_model)",
    }.get(name, "")


def param_shardings(boxed_params, mesh: Mesh):
    """NamedShardings for a parameter tree whose leaves are nn.Partitioned boxes (as model.init
    returns them, or their jax.eval_shape); unboxed leaves are replicated."""

    def one(path, leaf):
        where = "parameter " + jax.tree_util.keystr(path)
        if isinstance(leaf, nn.Partitioned):
            value = leaf.value
            return NamedSharding(mesh, logical_to_spec(leaf.names, value.shape, mesh, where))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree_util.tree_map_with_path(
        one, boxed_params, is_leaf=lambda x: isinstance(x, nn.Partitioned)
    )


def like_params(tree, params, shardings, mesh: Mesh):
    """Shardings for an optimizer state: every subtree shaped like params (AdamW's moments)
    gets the parameters' shardings, everything else (step counts) is replicated."""
    structure = jax.tree.structure(params)

    def one(sub):
        if jax.tree.structure(sub) == structure:
            return shardings
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, tree, is_leaf=lambda x: jax.tree.structure(x) == structure)
