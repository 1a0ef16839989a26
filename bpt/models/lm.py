"""What every model family shares: a causal LM around a stack of identical layers.

CausalLM (the base of GPT and FLASH) is the whole model's call: decode positions, the
load-balanced token layout under sequence sharding, the token embedding, the layer stack
(nn.scan with remat, nested remat groups, two policies split at a layer, offloaded layer
inputs, or unrolled; while decoding, the layers' caches carried through the scan as stacks
[layers, batch, ...] that each layer updates in place), the final norm, the LM head and
the loss (chunked or full). A family subclass has the fields `config` and `parallel` and
brings four things (a family with inputs of its own, AT, embeds them itself and runs the
rest through `stack`):

    layer_class()                              its layer: layer(config, deterministic, decode,
                                               parallel)(x, segment_ids, extra, cache_index,
                                               layer_index) -> (x, None)
    cache_shapes(batch, slots)                 (name, shape, dtype) of its decode stacks
    position_inputs(x, positions, valid, decode)  -> (x, extra): what its layers read of the
                                               positions (and of a decode call's valid counts)
    final_norm()                               -> (norm(params, x), params)

Every family's config is an LMConfig: the shared fields with their checks, and the
properties padded_vocab and layer_policy; a family adds its own fields and checks and the
property chunked_loss.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bpt.ops.chunked import CrossEntropy, blockwise_cross_entropy, cross_entropy
from bpt.ops.kernels import layer_norm as norm_kernel
from bpt.ops.remat import NORM_RESULTS, POLICIES, check_policy, kept_results
from bpt.parallel.mesh import Parallelism
from bpt.parallel.ring import from_layout, layout_permutation, to_layout

Array = jax.Array
LAYER_INPUT = "layer_input"  # the checkpoint name of each layer's input (for offloading)
DTYPES = ("float32", "bfloat16", "float16")
LOSS_IMPLS = ("auto", "chunked", "full")


def check_positive_int(value, name: str, *, optional: bool = False) -> None:
    """Raises ValueError unless value is a positive integer (bools are not), or None where
    optional; name is the setting as the user writes it."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer{' or None' if optional else ''}; got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMConfig:
    """The settings every family shares, with one check each (__post_init__; a family's
    config adds its own fields and checks, and the allowed values of position_embedding and
    attention_impl), and the properties every family derives the same way from them."""

    vocab_size: int
    num_layers: int
    d_model: int
    max_seq_len: int = 2048  # the learned position table's size (GPT); FLASH's n in 1/n scaling
    # The embedding holds vocab_size rounded up to a multiple of this (padded_vocab; nanoGPT's
    # 50,304 for GPT-2), so that mesh.tensor can split it; padded ids are never predicted.
    vocab_multiple: int = 128
    tie_embeddings: bool = True
    position_embedding: str = "rotary"  # the family lists what else it takes
    rope_theta: float = 10000.0
    use_bias: bool = True  # biases on the dense layers (the family says which)
    dropout: float = 0.0
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    layer_norm_epsilon: float = 1e-5
    attention_impl: str = "auto"  # the family lists what it takes (GPT: bpt.ops.attention.IMPLS)
    scan_layers: bool = True
    # Layers per iteration of the scanned stack's loop (lax.scan's unroll; num_layers: the
    # whole stack in one iteration). The parameters stay stacked [layers, ...] either way; a
    # loop of one iteration lets the residuals the backward keeps go without the loop's
    # per-layer copies into stacks (docs/notes/flash.md).
    scan_unroll: int = 1
    # With remat_layer="auto" and a looped stack (scan_unroll 1): also compile the step with
    # the whole stack in one iteration under auto's first choice, and take it where it fits.
    # Unrolled, that step ran 2-5% faster at GPT-1B and 8K-64K on an H200 and needed 5-12%
    # more memory; at 128K and beyond it needs 1.6-2.1x (docs/notes/step_speed.md), so the
    # loop stays where auto keeps less. The model itself does not read it.
    auto_unroll: bool = False
    # Cast the stacked layer parameters to the compute dtype once, before the stack's scan,
    # instead of in every layer's forward and recomputation. Unrolled, XLA materializes each
    # layer's parameter slice at the start of the step and holds it for the backward (GPT-1B:
    # 4.5 GiB of float32 slices, 264 copies, and 48 casts a parameter a step; 2026-12-05
    # profile, docs/notes/step_speed.md); cast first, the slices are half that. The same
    # arithmetic: every layer casts its parameters to the compute dtype anyway (Layer._param).
    # GPT-1B at 8K on an H100, unrolled: +1.7% paired, 2.2 GiB less (GPT-1B's preset sets
    # it: bpt.config.presets.CAST_ONCE_SIZES). The split stack (remat_first_layers) always
    # casts first.
    cast_params_once: bool = False
    # With remat_layer="auto": where attention_saveable does not fit, also compile it with the
    # saved layer inputs offloaded to the host (offload_layer_inputs) before falling back to
    # nothing_saveable. GPT-7B at 32K on an H200: 45.3-45.5% MFU against nothing_saveable's
    # 42.8% (docs/notes/step_speed.md). The model itself does not read it.
    auto_offload: bool = False
    remat_layer: str = "nothing_saveable"
    # The first remat_first_layers layers of the stack run under the policy remat_first, the
    # rest under remat_layer: a step whose memory lies between the two policies' (0: every
    # layer under remat_layer). Needs remat_group=1. Remat auto sets these where
    # model.auto_split asks.
    remat_first: str = "attention_and_dots_saveable"
    remat_first_layers: int = 0
    # With remat_layer="auto": where its first policy does not fit and the next one does, also
    # compile the step with the first policy in as many of the first layers as the memory
    # between the two steps leaves room for, and take it where it fits (GPT-1B at 64K on an
    # H100, where attention_saveable leaves half the card unused: with auto_unroll, 19 of 24
    # layers unrolled, 50.1% MFU against the loop's 47%; docs/notes/step_speed.md). The
    # model itself does not read it.
    auto_split: bool = False
    # Nested rematerialization of the layer stack: with G > 1 layers a group, the backward
    # keeps only every G-th layer's input (L / G of them) and recomputes a group's G inputs
    # when it reaches it: L / G + G saved layer inputs instead of L. Needs scan_layers.
    remat_group: int = 1
    # Keep the saved layer inputs in host memory (pinned_host) instead of on the device: the
    # backward copies each back when it reaches its layer. Needs remat_layer and remat_group=1.
    offload_layer_inputs: bool = False
    # The LM loss: "chunked" computes logits and cross-entropy loss_chunk_size tokens at a time
    # (never [seq, vocab] at once); "full" materializes the logits; "auto": the family's choice
    # (GPT: chunked in the blockwise_parallel mode only, as in the paper; FLASH: chunked).
    loss_impl: str = "auto"
    loss_chunk_size: int = 512

    def __post_init__(self):
        for name, options in (("dtype", DTYPES), ("param_dtype", DTYPES), ("loss_impl", LOSS_IMPLS)):
            self.check_allowed(name, options)
        check_policy(self.remat_layer, "model.remat_layer")
        check_policy(self.remat_first, "model.remat_first")
        self.check_positive("vocab_size", "vocab_multiple", "num_layers", "d_model", "max_seq_len", "loss_chunk_size")
        self.check_above_zero("rope_theta", "layer_norm_epsilon")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1); got {self.dropout!r}")
        self.check_stack()

    def check_allowed(self, name: str, options, family: str = "") -> None:
        """Raises ValueError unless the field's value is one of options (of `family`, where
        another family allows other values)."""
        if getattr(self, name) not in options:
            whose = f" for {family}" if family else ""
            raise ValueError(f"unknown model.{name} {getattr(self, name)!r}{whose}; allowed: {', '.join(options)}")

    def check_above_zero(self, *names: str) -> None:
        for name in names:
            if not getattr(self, name) > 0:
                raise ValueError(f"model.{name} must be > 0; got {getattr(self, name)!r}")

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding (and columns of an untied LM head): vocab_size rounded up to
        a multiple of vocab_multiple, so that tensor parallelism can split the vocabulary
        (GPT-2's 50,257 and the byte tokenizer's 257 are odd) and the head's matmul runs on
        aligned rows. The padded ids are never predicted: their logits are masked out of the
        loss and cut from the logits the model returns."""
        multiple = self.vocab_multiple
        return -(-self.vocab_size // multiple) * multiple

    @property
    def vocab_padding_params(self) -> int:
        """Parameters the padding rows hold (zeros; num_params does not count them)."""
        return (self.padded_vocab - self.vocab_size) * self.d_model * (1 if self.tie_embeddings else 2)

    @property
    def prefill_multiple(self) -> int:
        """A prompt read in several chunks (bpt.sample) has chunks of a multiple of this: 1,
        any length (a family whose decode cache holds every position)."""
        return 1

    @property
    def layer_policy(self):
        """The checkpoint policy of one layer: remat_layer's, and with offload_layer_inputs
        the layer's input (named LAYER_INPUT) moved to host memory as well."""
        return self.policy_of(self.remat_layer)

    def layer_remat(self, index: int) -> str:
        """The policy layer `index` of the stack runs under: remat_first in the first
        remat_first_layers layers, remat_layer in the rest."""
        return self.remat_first if index < self.remat_first_layers else self.remat_layer

    def policy_of(self, name: str):
        """The checkpoint policy `name` (a policy of bpt.ops.remat.POLICIES other than "none"),
        with offload_layer_inputs the layer's input (named LAYER_INPUT) moved to host memory
        as well."""
        policy = POLICIES[name]
        if not self.offload_layer_inputs:
            return policy
        offload = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=[LAYER_INPUT],
            offload_src="device",
            offload_dst="pinned_host",
        )

        def policy_with_offload(prim, *args, **params):
            if prim.name == "name" and params.get("name") == LAYER_INPUT:  # a checkpoint_name
                return offload(prim, *args, **params)
            return policy(prim, *args, **params)

        return policy_with_offload

    def check_positive(self, *names: str, optional: bool = False) -> None:
        """Raises ValueError naming the first of these fields that is not a positive integer
        (or None, where optional)."""
        for name in names:
            check_positive_int(getattr(self, name), f"model.{name}", optional=optional)

    def check_stack(self) -> None:
        """The layer stack's settings (raises ValueError naming the first that cannot work)."""
        self.check_positive("scan_unroll", "remat_group")
        if self.remat_group > 1:
            if self.num_layers % self.remat_group:
                raise ValueError(
                    f"model.remat_group={self.remat_group} must divide model.num_layers={self.num_layers}"
                )
            if not self.scan_layers:
                raise ValueError("model.remat_group > 1 needs model.scan_layers=True")
            if self.scan_unroll > 1:
                raise ValueError(
                    "model.remat_group > 1 runs loops of its own and takes no model.scan_unroll; "
                    f"got scan_unroll={self.scan_unroll}: set it to 1"
                )
        first = self.remat_first_layers
        if not isinstance(first, int) or not 0 <= first < self.num_layers:
            raise ValueError(
                f"model.remat_first_layers must be an integer from 0 to model.num_layers - 1 "
                f"({self.num_layers - 1}); got {first!r}"
            )
        if first and self.remat_group > 1:
            raise ValueError(
                f"model.remat_first_layers={first} needs model.remat_group=1; got remat_group={self.remat_group}"
            )
        if self.offload_layer_inputs and (self.remat_layer == "none" or self.remat_group > 1):
            raise ValueError(
                "model.offload_layer_inputs needs model.remat_layer other than 'none' and "
                f"model.remat_group=1; got remat_layer={self.remat_layer!r}, remat_group={self.remat_group}"
            )


# The parameters whose vocabulary axis is padded (padded_vocab), and that axis.
VOCAB_AXES = {"embedding": 0, "lm_head": 1}


def vocab_axis(path: str) -> int | None:
    """The vocabulary axis of the parameter at a keystr path ("['embedding']", or an optimizer
    moment's "...['lm_head']"), or None for every other parameter."""
    for name, axis in VOCAB_AXES.items():
        if path.endswith(f"['{name}']"):
            return axis
    return None


def resize_vocab(x, rows: int, axis: int):
    """x with its vocabulary axis cut or padded with zeros to `rows` (NumPy or JAX arrays)."""
    if x.shape[axis] >= rows:
        return x[(slice(None),) * axis + (slice(0, rows),)]
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, rows - x.shape[axis])
    return (jnp if isinstance(x, jax.Array) else np).pad(x, widths)


def fit_vocab(params: dict, rows: int) -> dict:
    """A model's parameter dict with its embedding rows (and an untied head's columns) padded
    with zeros or cut to `rows`: a checkpoint of one vocabulary padding into a model of
    another (the rows past the vocabulary are zeros, so either way is exact)."""
    return {
        name: resize_vocab(value, rows, VOCAB_AXES[name]) if name in VOCAB_AXES else value
        for name, value in params.items()
    }


def padded_init(init, vocab: int, axis: int):
    """An initializer that draws the first `vocab` entries of `axis` as init would for that
    size and leaves the padding zeros: a padded model starts from the parameters of the
    unpadded one, and its padded rows stay zero (nothing reads or predicts them)."""

    def initialize(key, shape, dtype=jnp.float32):
        real = list(shape)
        real[axis] = vocab
        return resize_vocab(init(key, tuple(real), dtype), shape[axis], axis)

    return initialize


def stack_unrolled(model) -> bool:
    """Whether the layer stack runs without a loop over layers: not scanned, or scanned with
    the whole stack in one iteration (scan_unroll >= num_layers). model: a family's config,
    or its ConfigDict (one saved before scan_unroll existed reads as a loop)."""
    scanned = getattr(model, "scan_layers", True)
    return not scanned or getattr(model, "scan_unroll", 1) >= model.num_layers


NORM_IMPLS = ("xla", "pallas")  # layer_norm's impl (GPT's model.norm_impl also takes "auto")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def layer_norm(x: Array, scale: Array, bias: Array, eps: float, impl: str = "xla") -> Array:
    """(x - mean) / sqrt(var + eps) * scale + bias over the last axis, in float32.

    Its backward is written out (_layer_norm_bwd) from the row statistics the forward kept
    (mean and 1/std), so the scale's and bias' gradients are sums over the rows of x and the
    incoming gradient as they are. Against autodiff's backward, GPT-1B's step on an H200 ran
    0.3-0.4% faster at 8K and 32K (docs/notes/step_speed.md, 2026-11-30, 22:15 UTC). XLA still
    writes dy * xhat in float32 to sum it over the rows in a second pass (7 + 4 ms of the 8K
    step, profiled 2026-12-01): a column sum cannot share the pass of the row sums.

    impl="pallas": bpt's kernels (bpt.ops.kernels.layer_norm: one pass forward, one backward)
    where they take x (`supported`), XLA's formula elsewhere. The backward keeps the column sums
    in registers, so that pass goes: GPT-1B's 8K step's norms took 14.2 ms against
    36.3 on an H200, and the step ran 2.0% faster, paired (docs/notes/step_speed.md,
    2026-12-01, 03:20 UTC)."""
    return _layer_norm_fwd(x, scale, bias, eps, impl)[0]


def _runs_kernels(x: Array, impl: str) -> bool:
    """Whether layer_norm of x runs bpt's kernels (the forward and the backward decide alike)."""
    return impl == "pallas" and norm_kernel.supported(x) is None


def _layer_norm_fwd(x: Array, scale: Array, bias: Array, eps: float, impl: str = "xla"):
    if _runs_kernels(x, impl):
        y, mean, rstd = kept_results(norm_kernel.forward(x, scale, bias, eps), (NORM_RESULTS,) * 3)
        return y, (x, mean[..., None], rstd[..., None], scale, bias)
    x32 = x.astype(jnp.float32)
    mean = x32.mean(axis=-1, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.square(x32 - mean).mean(axis=-1, keepdims=True) + eps)
    y = (x32 - mean) * rstd * scale.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(x.dtype), (x, mean, rstd, scale, bias)


def _layer_norm_bwd(eps: float, impl: str, residuals, dy: Array):
    x, mean, rstd, scale, bias = residuals
    if _runs_kernels(x, impl):
        dx, dscale, dbias = norm_kernel.backward(x, dy, mean[..., 0], rstd[..., 0], scale)
    else:
        xhat = (x.astype(jnp.float32) - mean) * rstd
        dy32 = dy.astype(jnp.float32)
        g = dy32 * scale.astype(jnp.float32)
        dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
        rows = tuple(range(x.ndim - 1))
        dscale, dbias = (dy32 * xhat).sum(axis=rows), dy32.sum(axis=rows)
    return dx.astype(x.dtype), _like(scale, dscale), _like(bias, dbias)


def _like(param: Array, grad: Array) -> Array:
    """A parameter's gradient summed over rows, in the parameter's shape and dtype."""
    return grad.reshape(param.shape).astype(param.dtype)


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def add_layer_norm(
    x: Array, residual: Array, scale: Array, bias: Array, eps: float, impl: str = "xla"
) -> tuple[Array, Array]:
    """(h, y): h = x + residual and y = layer_norm(h), a transformer layer's residual add and
    the norm after it. impl="pallas" runs both in one kernel pass where the kernels take x
    (and residual has x's shape and dtype), and the backward adds the gradient h receives
    from the residual stream to the norm's dx in its own pass; XLA's add, then layer_norm,
    elsewhere."""
    if _runs_kernels(x, impl) and (residual.shape, residual.dtype) == (x.shape, x.dtype):
        return _fused_add_layer_norm(x, residual, scale, bias, eps)
    h = x + residual
    return h, layer_norm(h, scale, bias, eps, impl)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused_add_layer_norm(x, residual, scale, bias, eps):
    return _fused_add_layer_norm_fwd(x, residual, scale, bias, eps)[0]


def _fused_add_layer_norm_fwd(x, residual, scale, bias, eps):
    results = norm_kernel.forward(x, scale, bias, eps, residual=residual)
    h, y, mean, rstd = kept_results(results, (NORM_RESULTS,) * 4)
    return (h, y), (h, mean, rstd, scale, bias)


def _fused_add_layer_norm_bwd(eps, saved, cotangents):
    h, mean, rstd, scale, bias = saved
    dh, dy = cotangents
    dx, dscale, dbias = norm_kernel.backward(h, dy, mean, rstd, scale, dresidual=dh)
    return dx, dx, _like(scale, dscale), _like(bias, dbias)


_fused_add_layer_norm.defvjp(_fused_add_layer_norm_fwd, _fused_add_layer_norm_bwd)


GELU_SCALE = 2 * math.sqrt(2 / math.pi)


def gelu(x: Array) -> Array:
    """GPT-2's tanh GELU, 0.5·x·(1 + tanh(sqrt(2/pi)·(x + 0.044715·x³))), in float32.

    Written as x·sigmoid(2·sqrt(2/pi)·x·(1 + 0.044715·x²)), the same function
    (0.5·(1 + tanh(z)) = sigmoid(2z)): on a GPU XLA computes tanh as a long rational
    polynomial, which kept the GELU's passes over the FFN's hidden layer compute-bound
    (about 2.3 TB/s on an H200), and the sigmoid form made the whole GPT-1B step 1.4% faster
    (docs/notes/step_speed.md, 2026-11-30). Equal to jax.nn.gelu(approximate=True) to float32
    rounding, gradients too (tests/test_model.py)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.nn.sigmoid(GELU_SCALE * x32 * (1 + 0.044715 * x32 * x32))).astype(x.dtype)


def rms_norm(x: Array, scale: Array, eps: float) -> Array:
    """x / sqrt(mean(x^2) + eps) * scale, in float32 (Llama's RMSNorm)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rotary_tables(positions: Array, head_dim: int, theta: float) -> tuple[Array, Array]:
    """cos and sin tables [..., head_dim // 2] for rotary position embeddings, from positions
    [seq] (every sequence alike) or [batch, seq]."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: Array, cos: Array, sin: Array) -> Array:
    """Rotates pairs (x[..., i], x[..., i + d/2]) of x [batch, seq, heads, d] by position."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[..., None, :], sin[..., None, :]  # over the heads
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def dropout(x: Array, rate: float, rng: Array | None) -> Array:
    if rng is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def fold_rng(rng: Array | None, *data) -> Array | None:
    if rng is None:
        return None
    for d in data:
        rng = jax.random.fold_in(rng, d)
    return rng


def logical_param(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple, init) -> Array:
    """module's parameter `name`, with logical axis names (for the sharding rules), in its
    config's param_dtype."""
    dtype = jnp.dtype(module.config.param_dtype)
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def final_layer_norm(module: nn.Module, *, bias: bool = True):
    """(norm(params, x), params): a final LayerNorm with module's parameters ln_f_scale and
    ln_f_bias (CausalLM.final_norm's contract); bias=False: an RMSNorm with ln_f_scale."""
    cfg = module.config
    eps = cfg.layer_norm_epsilon
    scale = logical_param(module, "ln_f_scale", (cfg.d_model,), ("embed",), nn.initializers.ones_init())
    if not bias:
        return (lambda p, h: rms_norm(h, p, eps)), scale
    params = (
        scale,
        logical_param(module, "ln_f_bias", (cfg.d_model,), ("embed",), nn.initializers.zeros_init()),
    )
    return (lambda p, h: layer_norm(h, *p, eps)), params


class Layer(nn.Module):
    """Base of a family's layer: its fields, and its parameters made with logical axis names
    in param_dtype and used in the compute dtype."""

    config: Any  # the family's config
    deterministic: bool = True
    decode: bool = False  # use and update the cache (collection "cache")
    parallel: Parallelism | None = None  # the mesh; None: one device

    def _param(self, name: str, shape: tuple[int, ...], axes: tuple, init) -> Array:
        value = logical_param(self, name, shape, axes, init).astype(jnp.dtype(self.config.dtype))
        par = self.parallel
        if par is not None and not self.decode:
            # Gathered once here (over fsdp and sequence, where it is split), in the compute
            # dtype: left to XLA, a weight that a chunk loop reads (BPT's blockwise FFN) is
            # gathered in every chunk.
            value = jax.lax.with_sharding_constraint(value, par.gathered(axes, shape))
        return value


class CausalLM(nn.Module):
    """Base of the model families (see the module docstring)."""

    @nn.compact
    def __call__(
        self,
        tokens: Array,
        *,
        targets: Array | None = None,
        loss_mask: Array | None = None,
        segment_ids: Array | None = None,
        positions: Array | None = None,
        deterministic: bool = True,
        decode: bool = False,
        extend: bool = False,
        valid: Array | None = None,
    ) -> Array | CrossEntropy:
        """tokens [batch, seq] int -> logits [batch, seq, vocab] float32, or, given targets
        [batch, seq], the CrossEntropy of the next-token predictions (loss_mask weights them).

        decode=True reads and updates the cache (collection "cache", see bpt.sample): several
        tokens are a prefill from position 0, one token continues; with extend=True several
        tokens continue too (the later chunks of a long prompt). valid [batch]: how many of
        this call's tokens are real, the rest padding (a family whose cache is a recurrent
        state keeps padding out of it; one that keeps every position overwrites it later).
        """
        seq_len = tokens.shape[1]
        cache_index = None
        if decode:
            cache_index, positions = self.decode_positions(tokens, extend)
        elif positions is None:
            positions = jnp.arange(seq_len)
        perm, shards, (tokens, targets, loss_mask, segment_ids, positions) = self.load_balance(
            seq_len, decode, tokens, targets, loss_mask, segment_ids, positions
        )
        x, embedding = self.embed(tokens, decode)
        x = self.stack(x, positions, segment_ids, cache_index, valid=valid, deterministic=deterministic, decode=decode)
        norm, norm_params = self.final_norm()
        return self.output(
            x,
            embedding,
            norm,
            norm_params,
            targets=targets,
            loss_mask=loss_mask,
            perm=perm,
            shards=shards,
            decode=decode,
        )

    language_model = True  # its loss is a log-likelihood of tokens (perplexity means something)
    # The token layout of sequence shards: None takes mesh.load_balance (causal softmax
    # attention's work grows along the sequence); a family whose work per token is even
    # names its own.
    sequence_layout = None

    def example_inputs(self):
        """The smallest inputs the model's call takes (to create its parameters)."""
        return jnp.zeros((1, 1), jnp.int32)

    def resolved_impls(self, batch: int, seq_len: int, *, packed: bool = False) -> str:
        """What the layers' "auto" settings resolve to for a [batch, seq_len] training step, as
        the training log says it ("" for a family that resolves none from shapes)."""
        return ""

    def runs_norm_kernels(self) -> bool:
        """Whether the layers' LayerNorms run as bpt's kernels (bpt.ops.kernels.layer_norm),
        whose results remat's attention_dots_and_norms_saveable keeps; resolved as the layers
        resolve model.norm_impl. A family whose norms are XLA's: never."""
        return False

    # ------------------------------------------------------------------------ the pieces

    def stack(self, x, positions, segment_ids, cache_index, *, valid=None, deterministic: bool, decode: bool):
        """Embedded inputs x [batch, seq, d_model] through what every family's call shares:
        the family's position inputs, the input dropout and the layer stack (before the
        final norm). A family with inputs of its own (AT) embeds them and calls this."""
        x, extra = self.position_inputs(x, positions, valid, decode)
        if not deterministic and self.config.dropout > 0:
            x = dropout(x, self.config.dropout, self.make_rng("dropout"))
        return self.layers(x, segment_ids, extra, cache_index, deterministic=deterministic, decode=decode)

    def decode_positions(self, tokens: Array, extend: bool):
        """(cache_index, positions [batch, seq]) while decoding, and the cache "index" [batch]
        (where each sequence's next token goes) moved past this call's tokens. cache_index
        is None for a prefill (several tokens from position 0). A batch of prompts of
        different lengths sets the index to each length afterwards (bpt.sample.prefill)."""
        batch, seq_len = tokens.shape
        index = self.variable("cache", "index", lambda: jnp.zeros((batch,), jnp.int32))
        cache_index = index.value if seq_len == 1 or extend else None
        start = jnp.zeros((batch,), jnp.int32) if cache_index is None else cache_index
        index.value = start + seq_len
        return cache_index, start[:, None] + jnp.arange(seq_len)

    def load_balance(self, seq_len: int, decode: bool, tokens, targets, loss_mask, segment_ids, positions):
        """With the sequence sharded: the inputs permuted once into the load-balanced layout
        (positions follow them). Returns (perm or None, shards, the permuted inputs)."""
        par = None if decode else self.parallel
        shards = 1 if par is None else par.sequence
        if shards == 1:
            return None, 1, (tokens, targets, loss_mask, segment_ids, positions)
        perm = layout_permutation(seq_len, shards, self.sequence_layout or par.load_balance)
        tokens, targets, loss_mask, segment_ids = (
            None if x is None else to_layout(x, perm) for x in (tokens, targets, loss_mask, segment_ids)
        )
        return perm, shards, (tokens, targets, loss_mask, segment_ids, to_layout(positions, perm, axis=0))

    def embed(self, tokens: Array, decode: bool) -> tuple[Array, Array]:
        """(x [batch, seq, d_model] in the compute dtype, the embedding table)."""
        cfg = self.config
        par = None if decode else self.parallel
        embedding = logical_param(
            self,
            "embedding",
            (cfg.padded_vocab, cfg.d_model),
            ("vocab", "embed"),
            padded_init(nn.initializers.normal(0.02), cfg.vocab_size, 0),
        )
        if par is not None:  # gathered over the FSDP axes once, as FSDP gathers every weight
            embedding = jax.lax.with_sharding_constraint(embedding, par.gathered(("vocab", "embed"), embedding.shape))
        x = jnp.take(embedding, tokens, axis=0).astype(jnp.dtype(cfg.dtype))
        if par is not None:
            x = par.constrain(x, "batch", "length", "embed")
        return x, embedding

    def layers(
        self, x: Array, segment_ids, extra, cache_index, *, deterministic: bool, decode: bool
    ) -> Array:
        """The layer stack, by config: scanned (with remat groups, split between two policies,
        or decode stacks) or unrolled."""
        cfg = self.config
        if cfg.scan_layers and not decode and not self.is_initializing():
            if cfg.remat_group > 1:
                return self._grouped_layers(x, segment_ids, extra, deterministic)
            if cfg.remat_first_layers or cfg.cast_params_once:
                return self._split_layers(x, segment_ids, extra, deterministic)

        def remat_layer(index: int):
            layer, policy = self.layer_class(), cfg.layer_remat(index)
            if policy == "none" or decode:
                return layer
            # prevent_cse where no loop over layers keeps the recomputation apart from the forward
            return nn.remat(layer, policy=cfg.policy_of(policy), prevent_cse=stack_unrolled(cfg))

        layer = remat_layer(cfg.num_layers - 1)  # the scanned stack's (remat_layer's)
        args = (cfg, deterministic, decode, self.parallel)
        scan = functools.partial(
            nn.scan,
            layer,
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            length=cfg.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        if cfg.scan_layers and decode:
            # The layers' caches are stacks [layers, batch, ...] carried through the scan, each
            # layer writing and reading its own part in place: scanned over as inputs and
            # outputs instead, the whole cache would be copied every call.
            stacks = [
                self.variable("cache", name, jnp.zeros, shape, dtype)
                for name, shape, dtype in self.cache_shapes(x.shape[0], x.shape[1])
            ]
            scanned = scan(
                in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, 0),
                # Nothing is broadcast out, and the check's extra trace (a partial evaluation)
                # fails on the GPU decode kernel's pallas_call ("broadcasted variable has a
                # data dependency on the scan body", jax 0.11.2).
                check_constancy_invariants=False,
            )(*args, name="layers")
            carry = (x, *(stack.value for stack in stacks))
            (x, *values), _ = scanned(carry, segment_ids, extra, cache_index, jnp.arange(cfg.num_layers))
            for stack, value in zip(stacks, values):
                stack.value = value
            return x
        if cfg.scan_layers:
            unroll = min(cfg.scan_unroll, cfg.num_layers)
            scanned = scan(in_axes=(nn.broadcast, nn.broadcast, nn.broadcast), unroll=unroll)(
                *args, name="layers"
            )
            return scanned(x, segment_ids, extra, cache_index)[0]
        for i in range(cfg.num_layers):
            x, _ = remat_layer(i)(*args, name=f"layer_{i}")(x, segment_ids, extra, cache_index)
        return x

    def _stacked_layer(self, deterministic: bool):
        """The scanned stack's parameters ([num_layers, ...], unboxed) and one layer as a pure
        function of its parameters, step(x, (params, index)) -> (x, None), for stacks that
        run their own scans (remat groups, split policies). Dropout draws its masks per layer
        from the "dropout" stream folded with the layer's index, so they differ from the
        plain scan's."""
        cfg = self.config
        stacked = nn.meta.unbox(self.variables["params"]["layers"])
        rng = None if deterministic or cfg.dropout == 0.0 else self.make_rng("dropout")
        # A pure function of its parameters:
        block = self.layer_class()(cfg, deterministic, parallel=self.parallel, parent=None)

        def step(x, inputs, segment_ids, extra):
            params, index = inputs
            rngs = None if rng is None else {"dropout": jax.random.fold_in(rng, index)}
            return block.apply({"params": params}, x, segment_ids, extra, rngs=rngs)

        return stacked, step

    def _split_layers(self, x: Array, segment_ids, extra, deterministic: bool) -> Array:
        """The layer stack as two scans: the first remat_first_layers layers under remat_first,
        the rest under remat_layer (each layer its own checkpoint; scan_unroll applies to
        each); one scan where remat_first_layers is 0 (cast_params_once). The parameters keep
        the plain scan's layout, [num_layers, ...]; each scan reads its part of them, cast to
        the compute dtype before the cut (every layer casts its parameters so anyway:
        Layer._param): the parts are copies, half the size so."""
        cfg = self.config
        stacked, step = self._stacked_layer(deterministic)
        dtype = jnp.dtype(cfg.dtype)
        stacked = jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, stacked)
        bounds = sorted({0, cfg.remat_first_layers, cfg.num_layers})
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            layer = functools.partial(step, segment_ids=segment_ids, extra=extra)
            if (policy := cfg.layer_remat(lo)) != "none":
                layer = jax.checkpoint(layer, policy=cfg.policy_of(policy), prevent_cse=stack_unrolled(cfg))
            part = jax.tree.map(lambda a: a[lo:hi], stacked)
            x, _ = jax.lax.scan(layer, x, (part, jnp.arange(lo, hi)), unroll=min(cfg.scan_unroll, hi - lo))
        return x

    def _grouped_layers(self, x: Array, segment_ids, extra, deterministic: bool) -> Array:
        """The layer stack as a scan over groups of remat_group layers, each group one
        checkpoint around a scan over its layers (each layer its own checkpoint, as without
        groups). The parameters keep the layout of the plain scan, [num_layers, ...].

        Dropout draws its masks per layer from the "dropout" stream folded with the layer's
        index, so they differ from the plain scan's.
        """
        cfg = self.config
        size = cfg.remat_group
        stacked, step = self._stacked_layer(deterministic)
        grouped = jax.tree.map(lambda a: a.reshape(cfg.num_layers // size, size, *a.shape[1:]), stacked)
        layer = functools.partial(step, segment_ids=segment_ids, extra=extra)
        if cfg.remat_layer != "none":
            layer = jax.checkpoint(layer, policy=cfg.layer_policy, prevent_cse=False)

        @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)
        def group(x, inputs):
            params, first = inputs
            x, _ = jax.lax.scan(layer, x, (params, first + jnp.arange(size)))
            return x, None

        firsts = jnp.arange(0, cfg.num_layers, size)
        x, _ = jax.lax.scan(group, x, (grouped, firsts))
        return x

    def output(
        self,
        x: Array,
        embedding: Array,
        norm,
        norm_params,
        *,
        targets,
        loss_mask,
        perm,
        shards: int,
        decode: bool,
    ):
        """The final norm (norm(norm_params, x)), the LM head (the embedding, tied, or its own
        "lm_head") and, given targets, the CrossEntropy: chunk by chunk (with the norm) when
        config.chunked_loss, else from full logits. Logits come back in natural token order."""
        cfg = self.config
        par = None if decode else self.parallel
        if cfg.tie_embeddings:
            head = embedding.T
        else:
            head = logical_param(
                self,
                "lm_head",
                (cfg.d_model, cfg.padded_vocab),
                ("embed", "vocab"),
                padded_init(nn.initializers.normal(0.02), cfg.vocab_size, 1),
            )
        if par is not None:
            x = par.constrain(x, "batch", "length", "embed")
            head = jax.lax.with_sharding_constraint(head, par.gathered(("embed", "vocab"), head.shape))
        if targets is not None and cfg.chunked_loss:  # the final norm, chunk by chunk too
            loss = functools.partial(
                blockwise_cross_entropy, chunk_size=cfg.loss_chunk_size, norm=norm, vocab_size=cfg.vocab_size
            )
            if par is not None:  # each device over its own tokens, where it can

                def local(x, targets, mask, weights):
                    sum_over_mesh = functools.partial(jax.lax.psum, axis_name=par.mesh.axis_names)
                    return loss(
                        x, weights[0], targets, mask=mask, norm_params=weights[1], reduce=sum_over_mesh
                    )

                rows = (x, targets, loss_mask)
                out = par.per_device(local, *rows, weights=(head, norm_params), reduced=True)
                if out is not None:
                    return out
            return loss(x, head, targets, mask=loss_mask, norm_params=norm_params, shards=shards)
        x = norm(norm_params, x)
        logits = jnp.einsum(
            "bsd,dv->bsv", x, head.astype(jnp.dtype(cfg.dtype)), preferred_element_type=jnp.float32
        )
        if targets is None:  # the vocabulary's logits: padded ids are never sampled
            logits = logits[..., : cfg.vocab_size]
            return logits if perm is None else from_layout(logits, perm)
        if cfg.padded_vocab != cfg.vocab_size:
            ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
            logits = jnp.where(ids < cfg.vocab_size, logits, -jnp.inf)
        return cross_entropy(logits, targets, loss_mask)
