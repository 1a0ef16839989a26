"""A GPT (pre-LayerNorm decoder) with the three attention modes of the BPT paper.

    vanilla             materialized attention, then the FFN over the whole sequence
    memory_efficient    blockwise (or fused-kernel) attention, FFN over the whole sequence
    blockwise_parallel  for each query block: attention over all key/value blocks, output
                        projection, residual, FFN, residual; then a blockwise LM loss

All three compute the same function. They differ only in which intermediates exist at once:
a [seq, seq] score matrix (vanilla), a [seq, mlp_dim] FFN hidden layer (vanilla and
memory_efficient), or only one block's worth of either (blockwise_parallel).

Each block's math is written as pure functions of a parameter dict, so the blockwise loops
are plain lax.scan + jax.checkpoint over those functions.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.layout import Layout, with_layout_constraint

from bpt.ops.attention import attention, check_impl, select_impl
from bpt.ops.blockwise import attend_query_chunk, gradient_carrier
from bpt.ops.chunked import CrossEntropy, blockwise_cross_entropy, cross_entropy, from_chunks, scan_chunks
from bpt.ops.decode import decode_attention, quantize_kv, resolve_decode_impl, write_cache
from bpt.ops.remat import POLICIES, check_policy, remat
from bpt.parallel.mesh import Parallelism
from bpt.parallel.ring import context_parallel_attention, from_layout, layout_permutation, to_layout
from bpt.parallel.tree import sharded_write_cache, tree_decode_attention

Array = jax.Array
ATTENTION_MODES = ("vanilla", "memory_efficient", "blockwise_parallel")
CACHE_DTYPES = ("auto", "int8")
POSITION_EMBEDDINGS = ("rotary", "learned")
DTYPES = ("float32", "bfloat16", "float16")
LOSS_IMPLS = ("auto", "chunked", "full")
LAYER_INPUT = "layer_input"  # the checkpoint name of each layer's input (for offloading)


def row_major(x: Array) -> Array:
    """x, kept in row-major layout on each device.

    For the layer inputs under sequence sharding: without it, XLA's GPU layout assignment
    chose a d_model-major layout for the backward pass's use of them and transposed the whole
    stack of saved layer inputs once (a second copy of all of them: 63 GiB per device for
    GPT-1B at 1.3M tokens over two GPUs). Applied after the checkpoint name, the constraint
    is part of what the backward pass recomputes from the saved input, so the stack keeps
    the forward pass's layout.
    """
    return with_layout_constraint(x, Layout(major_to_minor=tuple(range(x.ndim))))


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int | None = None  # None: as many as query heads (GQA/MQA when fewer)
    head_dim: int | None = None  # None: d_model // num_heads
    mlp_ratio: float = 4.0
    max_seq_len: int = 2048  # size of the learned position table
    position_embedding: str = "rotary"
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    dropout: float = 0.0
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    layer_norm_epsilon: float = 1e-5
    attention_mode: str = "blockwise_parallel"
    attention_impl: str = "auto"  # see bpt.ops.attention.IMPLS
    decode_impl: str = "auto"  # attention over the key/value cache: see bpt.ops.decode.DECODE_IMPLS
    # The key/value cache while decoding: "auto" keeps keys and values in the compute dtype;
    # "int8" stores them as int8 with a float32 scale per token and head (bpt.ops.decode.
    # quantize_kv): 0.53x the bytes of bf16, so twice the context fits and each step reads half.
    cache_dtype: str = "auto"
    q_chunk_size: int = 512
    kv_chunk_size: int = 512
    loss_chunk_size: int = 512
    scan_layers: bool = True
    remat_layer: str = "nothing_saveable"
    remat_attention: str = "none"
    remat_ffn: str = "nothing_saveable"
    # Nested rematerialization of the layer stack: with G > 1 layers a group, the backward
    # keeps only every G-th layer's input (L / G of them) and recomputes a group's G inputs
    # when it reaches it: L / G + G saved layer inputs instead of L. Needs scan_layers.
    remat_group: int = 1
    # Keep the saved layer inputs in host memory (pinned_host) instead of on the device: the
    # backward copies each back when it reaches its layer. Needs remat_layer and remat_group=1.
    offload_layer_inputs: bool = False
    # The LM loss: "chunked" computes logits and cross-entropy loss_chunk_size tokens at a time
    # (never [seq, vocab] at once); "full" materializes the logits; "auto": chunked in the
    # blockwise_parallel mode only, as in the paper.
    loss_impl: str = "auto"

    def __post_init__(self):
        def allowed(name, value, options):
            if value not in options:
                raise ValueError(f"unknown model.{name} {value!r}; allowed: {', '.join(options)}")

        allowed("attention_mode", self.attention_mode, ATTENTION_MODES)
        allowed("position_embedding", self.position_embedding, POSITION_EMBEDDINGS)
        allowed("dtype", self.dtype, DTYPES)
        allowed("param_dtype", self.param_dtype, DTYPES)
        allowed("loss_impl", self.loss_impl, LOSS_IMPLS)
        allowed("cache_dtype", self.cache_dtype, CACHE_DTYPES)
        check_impl(self.attention_impl, "model.attention_impl")
        resolve_decode_impl(self.decode_impl, "model.decode_impl")
        for name in ("remat_layer", "remat_attention", "remat_ffn"):
            check_policy(getattr(self, name), f"model.{name}")
        for name in (
            "vocab_size",
            "num_layers",
            "d_model",
            "num_heads",
            "max_seq_len",
            "q_chunk_size",
            "kv_chunk_size",
            "loss_chunk_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"model.{name} must be a positive integer; got {value!r}")
        for name in ("num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"model.{name} must be a positive integer or None; got {value!r}")
        for name in ("mlp_ratio", "rope_theta", "layer_norm_epsilon"):
            if not getattr(self, name) > 0:
                raise ValueError(f"model.{name} must be > 0; got {getattr(self, name)!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1); got {self.dropout!r}")
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"model.num_heads ({self.num_heads}) must be divisible by model.num_kv_heads "
                f"({self.kv_heads})"
            )
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be divisible by model.num_heads "
                f"({self.num_heads}), or set model.head_dim"
            )
        if self.position_embedding == "rotary" and self.dim_per_head % 2:
            raise ValueError(f"rotary positions need an even head_dim; got {self.dim_per_head}")
        if (
            isinstance(self.remat_group, bool)
            or not isinstance(self.remat_group, int)
            or self.remat_group < 1
        ):
            raise ValueError(f"model.remat_group must be a positive integer; got {self.remat_group!r}")
        if self.remat_group > 1:
            if self.num_layers % self.remat_group:
                raise ValueError(
                    f"model.remat_group={self.remat_group} must divide model.num_layers={self.num_layers}"
                )
            if not self.scan_layers:
                raise ValueError("model.remat_group > 1 needs model.scan_layers=True")
        if self.offload_layer_inputs and (self.remat_layer == "none" or self.remat_group > 1):
            raise ValueError(
                "model.offload_layer_inputs needs model.remat_layer other than 'none' and "
                f"model.remat_group=1; got remat_layer={self.remat_layer!r}, remat_group={self.remat_group}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1); got {self.dropout}")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def mlp_dim(self) -> int:
        return int(self.mlp_ratio * self.d_model)

    @property
    def chunked_loss(self) -> bool:
        if self.loss_impl == "auto":
            return self.attention_mode == "blockwise_parallel"
        return self.loss_impl == "chunked"

    @property
    def layer_policy(self):
        """The checkpoint policy of one layer: remat_layer's, and with offload_layer_inputs
        the layer's input (named LAYER_INPUT) moved to host memory as well."""
        policy = POLICIES[self.remat_layer]
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

    def num_params(self, *, embeddings: bool = True) -> int:
        """Parameter count (weights and biases), computed from the shapes alone."""
        d, h, kv, hd, f = self.d_model, self.num_heads, self.kv_heads, self.dim_per_head, self.mlp_dim
        attn = d * h * hd + 2 * d * kv * hd + h * hd * d + h * hd + 2 * kv * hd + d
        per_layer = attn + 2 * d * f + f + d + 4 * d
        total = self.num_layers * per_layer + 2 * d
        if embeddings:
            total += self.vocab_size * d * (1 if self.tie_embeddings else 2)
            if self.position_embedding == "learned":
                total += self.max_seq_len * d
        return total


# ----------------------------------------------------------------------------- pure math


def layer_norm(x: Array, scale: Array, bias: Array, eps: float) -> Array:
    x32 = x.astype(jnp.float32)
    mean = x32.mean(axis=-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


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


def project_qkv(p: dict, h: Array) -> tuple[Array, Array, Array]:
    q = jnp.einsum("bsd,dhk->bshk", h, p["wq"]) + p["bq"]
    k = jnp.einsum("bsd,dhk->bshk", h, p["wk"]) + p["bk"]
    v = jnp.einsum("bsd,dhk->bshk", h, p["wv"]) + p["bv"]
    return q, k, v


def project_out(p: dict, a: Array) -> Array:
    return jnp.einsum("bshk,hkd->bsd", a, p["wo"]) + p["bo"]


def mlp(p: dict, h: Array) -> Array:
    hidden = jax.nn.gelu(jnp.einsum("bsd,df->bsf", h, p["w1"]) + p["b1"], approximate=True)
    return jnp.einsum("bsf,fd->bsd", hidden, p["w2"]) + p["b2"]


def post_attention_weights(p: dict) -> dict:
    """The weights a BPT chunk reads after attention: output projection and FFN."""
    names = ("wo", "bo", "ln2_scale", "ln2_bias", "w1", "b1", "w2", "b2")
    return {name: p[name] for name in names}


def fold_rng(rng: Array | None, *data) -> Array | None:
    if rng is None:
        return None
    for d in data:
        rng = jax.random.fold_in(rng, d)
    return rng


# ----------------------------------------------------------------------------- modules


class Block(nn.Module):
    """One pre-LayerNorm transformer layer; __call__ returns (x, None) for nn.scan."""

    config: GPTConfig
    deterministic: bool = True
    decode: bool = False  # use and update the key/value cache (collection "cache")
    parallel: Parallelism | None = None  # the mesh; None: one device

    def _param(self, name: str, shape: tuple[int, ...], axes: tuple[str, ...], init) -> Array:
        cfg = self.config
        param = self.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.dtype(cfg.param_dtype))
        return param.astype(jnp.dtype(cfg.dtype))

    def _params(self) -> dict:
        cfg = self.config
        d, h, kv, hd, f = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head, cfg.mlp_dim
        normal = nn.initializers.normal(0.02)
        # GPT-2: projections into the residual stream are scaled down with depth.
        residual = nn.initializers.normal(0.02 / math.sqrt(2 * cfg.num_layers))
        zeros, ones = nn.initializers.zeros_init(), nn.initializers.ones_init()
        return {
            "ln1_scale": self._param("ln1_scale", (d,), ("embed",), ones),
            "ln1_bias": self._param("ln1_bias", (d,), ("embed",), zeros),
            "wq": self._param("wq", (d, h, hd), ("embed", "heads", "head_dim"), normal),
            "wk": self._param("wk", (d, kv, hd), ("embed", "kv_heads", "head_dim"), normal),
            "wv": self._param("wv", (d, kv, hd), ("embed", "kv_heads", "head_dim"), normal),
            "bq": self._param("bq", (h, hd), ("heads", "head_dim"), zeros),
            "bk": self._param("bk", (kv, hd), ("kv_heads", "head_dim"), zeros),
            "bv": self._param("bv", (kv, hd), ("kv_heads", "head_dim"), zeros),
            "wo": self._param("wo", (h, hd, d), ("heads", "head_dim", "embed"), residual),
            "bo": self._param("bo", (d,), ("embed",), zeros),
            "ln2_scale": self._param("ln2_scale", (d,), ("embed",), ones),
            "ln2_bias": self._param("ln2_bias", (d,), ("embed",), zeros),
            "w1": self._param("w1", (d, f), ("embed", "mlp"), normal),
            "b1": self._param("b1", (f,), ("mlp",), zeros),
            "w2": self._param("w2", (f, d), ("mlp", "embed"), residual),
            "b2": self._param("b2", (d,), ("embed",), zeros),
        }

    @nn.compact
    def __call__(
        self,
        x: Array,
        segment_ids: Array | None,
        rotary: tuple[Array, Array] | None,
        cache_index: Array | None = None,
        layer: Array | None = None,
    ):
        cfg = self.config
        stacks = None
        if layer is not None:  # decoding a scanned stack: the carry holds every layer's cache
            x, *stacks = x
        par = None if self.decode else self.parallel
        if par is not None:
            x = jax.lax.with_sharding_constraint(x, par.activations())
        if not self.decode:
            x = checkpoint_name(x, LAYER_INPUT)
            if par is not None and par.sequence > 1:
                x = row_major(x)
        p = self._params()
        rng = None if self.deterministic or cfg.dropout == 0.0 else self.make_rng("dropout")
        eps, rate = cfg.layer_norm_epsilon, cfg.dropout

        def ffn_residual(h: Array, rng, p=p) -> Array:
            ffn = remat(lambda h: mlp(p, layer_norm(h, p["ln2_scale"], p["ln2_bias"], eps)), cfg.remat_ffn)
            return h + dropout(ffn(h), rate, rng)

        q, k, v = project_qkv(p, layer_norm(x, p["ln1_scale"], p["ln1_bias"], eps))
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)

        impl = cfg.attention_impl
        if cfg.attention_mode == "vanilla":
            impl = "reference"
        elif impl == "auto":
            impl = select_impl(
                q,
                k,
                causal=True,
                segment_ids=segment_ids,
                q_chunk_size=cfg.q_chunk_size,
                kv_chunk_size=cfg.kv_chunk_size,
            )

        if self.decode:
            a, stacks = self._cached_attention(q, k, v, impl, cache_index, stacks, layer)
            x = ffn_residual(x + project_out(p, a), None)
            return (x if stacks is None else (x, *stacks)), None
        shards = 1 if par is None else par.sequence
        if cfg.attention_mode == "blockwise_parallel" and impl == "blockwise" and shards == 1:
            return self._fused_blockwise(p, x, q, k, v, segment_ids, rng, ffn_residual), None

        if par is not None and (shards > 1 or impl in ("pallas", "cudnn")):
            # Across the sequence shards (ring or all-gather), or a kernel XLA cannot split
            # by itself: attention runs inside shard_map, per device.
            attend = functools.partial(
                context_parallel_attention,
                mesh=par.mesh,
                strategy=par.context_parallel,
                layout=par.load_balance,
            )
        else:
            attend = attention
        attend = remat(
            functools.partial(
                attend,
                impl=impl,
                causal=True,
                segment_ids=segment_ids,
                q_chunk_size=cfg.q_chunk_size,
                kv_chunk_size=cfg.kv_chunk_size,
            ),
            cfg.remat_attention,
        )
        a = attend(q, k, v)
        if cfg.attention_mode != "blockwise_parallel":
            h = x + dropout(project_out(p, a), rate, fold_rng(rng, 0))
            return ffn_residual(h, fold_rng(rng, 1)), None

        # Attention by a fused kernel, or across sequence shards, over the whole (local)
        # sequence; the rest block by block (on every shard at once).
        def post_attention(i, chunk, p):
            x_c, a_c = chunk
            h = x_c + dropout(project_out(p, a_c), rate, fold_rng(rng, 0, i))
            return ffn_residual(h, fold_rng(rng, 1, i), p)

        out = scan_chunks(
            post_attention,
            (x, a),
            chunk_size=cfg.q_chunk_size,
            policy="none",
            name="q_chunk_size",
            weights=post_attention_weights(p),
            shards=shards,
        )
        return from_chunks(out, shards), None

    def _cached_attention(self, q, k, v, impl: str, cache_index: Array | None, stacks, layer):
        """Attention while decoding, and the caches: the cache holds every position's keys
        and values.

        cache_index None: a prefill that starts the cache over; its tokens attend to each
        other through the model's attention implementation. Otherwise cache_index [batch]
        is where each sequence's tokens (one, or a later chunk of a long prompt) go; they
        attend to the cache up to their own positions (bpt.ops.decode_attention, by
        model.decode_impl). stacks: (k, v) of all layers [layers, batch, slots, ...], and
        their scales with cache_dtype int8 (the scanned stack's carry), written and read at
        `layer` in place; None: this layer's own cache variables. With the sequence sharded over a mesh, so is the cache, along
        its slots, and attention over it is Tree Attention (bpt.parallel.tree_decode_attention).
        """
        cfg = self.config
        batch, length = q.shape[:2]
        start = jnp.zeros((batch,), jnp.int32) if cache_index is None else cache_index
        positions = start[:, None] + jnp.arange(length)  # [batch, length]
        par = self.parallel
        if par is not None and par.sequence > 1:
            write = functools.partial(sharded_write_cache, mesh=par.mesh, layer=layer)
            attend = functools.partial(tree_decode_attention, mesh=par.mesh, batch_axes=(), layer=layer)
        else:
            write = functools.partial(write_cache, layer=layer)
            attend = functools.partial(decode_attention, layer=layer)
        new = (k, v)
        if cfg.cache_dtype == "int8":  # values and their scales: (k, v, k_scale, v_scale)
            (k8, k_scale), (v8, v_scale) = quantize_kv(k), quantize_kv(v)
            new = (k8, v8, k_scale, v_scale)
        if stacks is None:  # this layer's own variables
            names = ("k", "v", "k_scale", "v_scale")
            own = [self.variable("cache", n, jnp.zeros, x.shape, x.dtype) for n, x in zip(names, new)]
            for variable, x in zip(own, new):
                variable.value = write(variable.value, x, positions)
            caches = tuple(variable.value for variable in own)
        else:
            caches = stacks = tuple(write(stack, x, positions) for stack, x in zip(stacks, new))
        k_cache, v_cache, *scales = caches
        scales = dict(zip(("k_scale", "v_scale"), scales))
        if cache_index is None:
            a = attention(
                q,
                k,
                v,
                impl=impl,
                causal=True,
                q_chunk_size=cfg.q_chunk_size,
                kv_chunk_size=cfg.kv_chunk_size,
            )
            return a, stacks
        # split_kv (a prompt's later chunk) goes through the cache in the model's key chunks.
        a = attend(
            q, k_cache, v_cache, positions, impl=cfg.decode_impl, chunk_size=cfg.kv_chunk_size, **scales
        )
        return a, stacks

    def _fused_blockwise(self, p, x, q, k, v, segment_ids, rng, ffn_residual):
        """The BPT loop: per query block, attention over all key/value blocks, then the FFN."""
        cfg = self.config
        k, v = gradient_carrier(k), gradient_carrier(v)

        def block(i, chunk, p):
            x_c, q_c, seg_c = chunk
            attend = remat(
                lambda q_c: attend_query_chunk(
                    q_c,
                    k,
                    v,
                    i * q_c.shape[1],
                    causal=True,
                    q_segment_ids=seg_c,
                    kv_segment_ids=segment_ids,
                    kv_chunk_size=cfg.kv_chunk_size,
                )[0],
                cfg.remat_attention,
                prevent_cse=False,
            )
            h = x_c + dropout(project_out(p, attend(q_c)), cfg.dropout, fold_rng(rng, 0, i))
            return ffn_residual(h, fold_rng(rng, 1, i), p)

        out = scan_chunks(
            block,
            (x, q, segment_ids),
            chunk_size=cfg.q_chunk_size,
            policy="none",
            name="q_chunk_size",
            weights=post_attention_weights(p),
        )
        return from_chunks(out)


class GPT(nn.Module):
    """The model. parallel: the mesh it runs on (bpt.parallel.Parallelism); None: one device.

    With a mesh, activations are sharded [batch over data x fsdp, tokens over sequence], and
    with mesh.sequence > 1 the tokens are permuted once into the load-balanced layout at the
    input (positions follow them) and logits are permuted back at the output; attention then
    spans the shards by ring or all-gather attention.
    """

    config: GPTConfig
    parallel: Parallelism | None = None

    def _grouped_layers(self, x: Array, segment_ids, rotary, deterministic: bool) -> Array:
        """The layer stack as a scan over groups of remat_group layers, each group one
        checkpoint around a scan over its layers (each layer its own checkpoint, as without
        groups). The parameters keep the layout of the plain scan, [num_layers, ...].

        Dropout draws its masks per layer from the "dropout" stream folded with the layer's
        index, so they differ from the plain scan's.
        """
        cfg = self.config
        size = cfg.remat_group
        stacked = nn.meta.unbox(self.variables["params"]["layers"])
        grouped = jax.tree.map(lambda a: a.reshape(cfg.num_layers // size, size, *a.shape[1:]), stacked)
        rng = None if deterministic or cfg.dropout == 0.0 else self.make_rng("dropout")
        # A pure function of its parameters:
        block = Block(cfg, deterministic, parallel=self.parallel, parent=None)

        def layer(x, inputs):
            params, index = inputs
            rngs = None if rng is None else {"dropout": jax.random.fold_in(rng, index)}
            return block.apply({"params": params}, x, segment_ids, rotary, rngs=rngs)

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
    ) -> Array | CrossEntropy:
        """tokens [batch, seq] int -> logits [batch, seq, vocab] float32, or, given targets
        [batch, seq], the CrossEntropy of the next-token predictions (loss_mask weights them).

        decode=True reads and updates the key/value cache (collection "cache", see
        bpt.sample): several tokens are a prefill from position 0, one token continues; with
        extend=True several tokens continue too (the later chunks of a long prompt).
        """
        cfg = self.config
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        seq_len = tokens.shape[1]
        cache_index = None
        if decode:  # "index": where each sequence's next token goes
            batch = tokens.shape[0]
            index = self.variable("cache", "index", lambda: jnp.zeros((batch,), jnp.int32))
            cache_index = index.value if seq_len == 1 or extend else None
            start = jnp.zeros((batch,), jnp.int32) if cache_index is None else cache_index
            index.value = start + seq_len
            positions = start[:, None] + jnp.arange(seq_len)
        elif positions is None:
            positions = jnp.arange(seq_len)
        par = None if decode else self.parallel
        shards = 1 if par is None else par.sequence
        perm = None
        if shards > 1:  # the load-balanced layout, once for the whole stack
            perm = layout_permutation(seq_len, shards, par.load_balance)
            tokens, targets, loss_mask, segment_ids = (
                None if x is None else to_layout(x, perm) for x in (tokens, targets, loss_mask, segment_ids)
            )
            positions = to_layout(positions, perm, axis=0)
        normal = nn.initializers.normal(0.02)
        embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(normal, ("vocab", "embed")),
            (cfg.vocab_size, cfg.d_model),
            param_dtype,
        )
        if par is not None:  # gathered over the FSDP axes once, as FSDP gathers every weight
            embedding = jax.lax.with_sharding_constraint(embedding, par.sharding("tensor", None))
        x = jnp.take(embedding, tokens, axis=0).astype(dtype)
        if par is not None:
            x = jax.lax.with_sharding_constraint(x, par.activations())
        rotary = None
        if cfg.position_embedding == "learned":
            if seq_len > cfg.max_seq_len:
                raise ValueError(
                    f"sequence length {seq_len} exceeds model.max_seq_len={cfg.max_seq_len} "
                    "of the learned position table"
                )
            table = self.param(
                "position_embedding",
                nn.with_logical_partitioning(normal, ("positions", "embed")),
                (cfg.max_seq_len, cfg.d_model),
                param_dtype,
            )
            x = x + jnp.take(table, positions, axis=0).astype(dtype)
        else:
            rotary = rotary_tables(positions, cfg.dim_per_head, cfg.rope_theta)
        if not deterministic and cfg.dropout > 0:
            x = dropout(x, cfg.dropout, self.make_rng("dropout"))

        block = Block
        if cfg.remat_layer != "none" and not decode:
            block = nn.remat(Block, policy=cfg.layer_policy, prevent_cse=not cfg.scan_layers)
        if cfg.scan_layers and cfg.remat_group > 1 and not decode and not self.is_initializing():
            x = self._grouped_layers(x, segment_ids, rotary, deterministic)
        elif cfg.scan_layers and decode:
            # The layers' caches are stacks [layers, batch, slots, kv_heads, head_dim] carried
            # through the scan, each layer writing and reading its own part in place: scanned
            # over as inputs and outputs instead, the whole cache would be copied every call.
            shape = (cfg.num_layers, tokens.shape[0], seq_len, cfg.kv_heads, cfg.dim_per_head)
            stacks = [(name, shape, dtype) for name in ("k", "v")]
            if cfg.cache_dtype == "int8":
                stacks = [(name, shape, jnp.int8) for name in ("k", "v")]
                stacks += [(name, shape[:-1], jnp.float32) for name in ("k_scale", "v_scale")]
            stacks = [self.variable("cache", name, jnp.zeros, shape, dt) for name, shape, dt in stacks]
            layers = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, 0),
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
                # Nothing is broadcast out, and the check's extra trace (a partial evaluation)
                # fails on the GPU decode kernel's pallas_call ("broadcasted variable has a
                # data dependency on the scan body", jax 0.11.2).
                check_constancy_invariants=False,
            )(cfg, deterministic, decode, self.parallel, name="layers")
            carry = (x, *(stack.value for stack in stacks))
            (x, *values), _ = layers(carry, segment_ids, rotary, cache_index, jnp.arange(cfg.num_layers))
            for stack, value in zip(stacks, values):
                stack.value = value
        elif cfg.scan_layers:
            layers = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )(cfg, deterministic, decode, self.parallel, name="layers")
            x, _ = layers(x, segment_ids, rotary, cache_index)
        else:
            for i in range(cfg.num_layers):
                x, _ = block(cfg, deterministic, decode, self.parallel, name=f"layer_{i}")(
                    x, segment_ids, rotary, cache_index
                )

        scale = self.param(
            "ln_f_scale",
            nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
            (cfg.d_model,),
            param_dtype,
        )
        bias = self.param(
            "ln_f_bias",
            nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
            (cfg.d_model,),
            param_dtype,
        )
        eps = cfg.layer_norm_epsilon
        if cfg.tie_embeddings:
            head = embedding.T
        else:
            head = self.param(
                "lm_head",
                nn.with_logical_partitioning(normal, ("embed", "vocab")),
                (cfg.d_model, cfg.vocab_size),
                param_dtype,
            )
        if par is not None:
            x = jax.lax.with_sharding_constraint(x, par.activations())
            head = jax.lax.with_sharding_constraint(head, par.sharding(None, "tensor"))
        if targets is not None and cfg.chunked_loss:  # the final norm, chunk by chunk too
            return blockwise_cross_entropy(
                x,
                head,
                targets,
                chunk_size=cfg.loss_chunk_size,
                mask=loss_mask,
                norm=lambda p, h: layer_norm(h, *p, eps),
                norm_params=(scale, bias),
                shards=shards,
            )
        x = layer_norm(x, scale, bias, eps)
        logits = jnp.einsum("bsd,dv->bsv", x, head.astype(dtype), preferred_element_type=jnp.float32)
        if targets is None:
            return logits if perm is None else from_layout(logits, perm)
        return cross_entropy(logits, targets, loss_mask)
