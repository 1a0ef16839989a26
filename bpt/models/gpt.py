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

from bpt.models.lm import (
    LAYER_INPUT,
    NORM_IMPLS,
    CausalLM,
    Layer,
    LMConfig,
    add_layer_norm,
    apply_rotary,
    dropout,
    final_layer_norm,
    fold_rng,
    gelu,
    layer_norm,
    logical_param,
    rms_norm,
    rotary_tables,
    stack_unrolled,
)
from bpt.ops.attention import ATTENTION, MERGED, attention
from bpt.ops.blockwise import attend_query_chunk, gradient_carrier
from bpt.ops.chunked import CrossEntropy, from_chunks, largest_chunk, scan_chunks
from bpt.ops.decode import DECODE, decode_attention, quantize_kv, write_cache
from bpt.ops.kernels.attention import kernel_settings, parse_settings
from bpt.ops.remat import ATTENTION_INPUTS, check_policy, remat
from bpt.parallel.mesh import Parallelism
from bpt.parallel.ring import context_parallel_attention
from bpt.parallel.tree import sharded_write_cache, tree_decode_attention

Array = jax.Array
ATTENTION_MODES = ("vanilla", "memory_efficient", "blockwise_parallel")
CACHE_DTYPES = ("auto", "int8")
POSITION_EMBEDDINGS = ("rotary", "learned")
MLP_ACTIVATIONS = ("gelu", "swiglu", "relu")
# ffn_chunk_size=0's bound, in positions, where the layer stack runs as a loop: at 8K and 32K
# GPT-1B's step ran 15% and 8% faster on an H200 than with chunks of q_chunk_size=1024, for 0.2
# and 1.1 GiB more.
FFN_CHUNK = 16384
# Its bound where the stack is unrolled (scan_unroll >= num_layers): the whole sequence up to
# 64K. With a batch of one and two or more chunks, XLA laid out the residual stream's gradient
# between the unrolled layers transposed, and the step paid transposes on either side of every
# layer; in one chunk GPT-1B's step ran 3.8% faster at 32K and 2.0% at 64K on an H200, in 7.5
# and 15 GiB less (docs/notes/step_speed.md, 2026-11-30). Beyond 64K the bound keeps the FFN's
# hidden activations from growing with the context.
FFN_CHUNK_UNROLLED = 65536
__all__ = [
    "GPT",
    "GPTConfig",
    "Block",
    "LAYER_INPUT",
    "CrossEntropy",
    "apply_rotary",
    "dropout",
    "fold_rng",
    "layer_norm",
    "rotary_tables",
]


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig(LMConfig):
    """LMConfig's shared fields (position_embedding: rotary | learned; attention_impl: see
    bpt.ops.attention.IMPLS; use_bias: on q, k, v, the output projection and the FFN, Llama
    has none) and the GPT's own."""

    num_heads: int
    num_kv_heads: int | None = None  # None: as many as query heads (GQA/MQA when fewer)
    head_dim: int | None = None  # None: d_model // num_heads
    mlp_ratio: float = 4.0
    mlp_hidden: int | None = None  # the FFN's hidden width; None: mlp_ratio x d_model
    # The FFN: "gelu" (GPT-2's: tanh-GELU(x W1 + b1) W2 + b2), "relu" (the same with ReLU) or
    # "swiglu" (Llama's: (silu(x W1) * x W3) W2, a third matrix W3 of the same shape as W1).
    mlp_activation: str = "gelu"
    rms_norm: bool = False  # RMSNorm (a scale, no bias) instead of LayerNorm, in every norm
    # The layers' LayerNorms: "xla" (XLA's fusions of bpt.models.lm.layer_norm's formula),
    # "pallas" (bpt's kernels, bpt.ops.kernels.layer_norm: one pass forward, one backward,
    # where they take the shape; XLA's elsewhere) or "auto": pallas on one GPU (GPT-1B's 8K
    # step 2% faster on an H200, docs/notes/step_speed.md), xla on a CPU or a mesh of several
    # devices. On a mesh "pallas" runs them on each device's rows (shard_map; mesh.tensor=1).
    norm_impl: str = "auto"
    attention_mode: str = "blockwise_parallel"
    decode_impl: str = "auto"  # attention over the key/value cache: see bpt.ops.decode.DECODE
    # The key/value cache while decoding: "auto" keeps keys and values in the compute dtype;
    # "int8" stores them as int8 with a float32 scale per token and head (bpt.ops.decode.
    # quantize_kv): 0.53x the bytes of bf16, so twice the context fits and each step reads half.
    cache_dtype: str = "auto"
    q_chunk_size: int = 512
    kv_chunk_size: int = 512
    # Positions per chunk of the layer's part after attention (output projection, residual,
    # norm, FFN) where attention runs as one kernel call or across sequence shards. Each chunk
    # adds its FFN weight gradients into float32 sums once, so larger chunks make fewer passes
    # over them (and larger GEMMs): 0 (auto) takes the largest multiple of q_chunk_size that
    # divides the sequence a device holds, up to FFN_CHUNK (the whole sequence when that is
    # shorter), or up to FFN_CHUNK_UNROLLED where the stack is unrolled (scan_unroll >=
    # num_layers). (The blockwise scan computes the FFN on its own query chunks.)
    ffn_chunk_size: int = 0
    remat_attention: str = "none"
    remat_ffn: str = "nothing_saveable"
    # bpt's attention kernels' settings where the layers run them (attention_impl pallas, or
    # auto's choice of it), "name=value,..." of flash_attention's keyword arguments, e.g.
    # "hopper_sort_window=0" or "hopper_block_k=64,hopper_stages=2"; "" keeps their defaults
    # (bpt.ops.kernels.attention.kernel_settings).
    attention_options: str = ""

    def __post_init__(self):
        super().__post_init__()
        for name, options in (
            ("attention_mode", ATTENTION_MODES),
            ("position_embedding", POSITION_EMBEDDINGS),
            ("cache_dtype", CACHE_DTYPES),
            ("mlp_activation", MLP_ACTIVATIONS),
        ):
            self.check_allowed(name, options)
        self.check_allowed("attention_impl", ATTENTION.names)
        self.check_allowed("norm_impl", ("auto", *NORM_IMPLS))
        self.check_allowed("decode_impl", DECODE.names)
        for name in ("remat_attention", "remat_ffn"):
            check_policy(getattr(self, name), f"model.{name}")
        self.check_positive("num_heads", "q_chunk_size", "kv_chunk_size")
        try:
            parse_settings(self.attention_options, self.dim_per_head)
        except ValueError as error:
            raise ValueError(f"model.attention_options={self.attention_options!r}: {error}") from None
        chunk = self.ffn_chunk_size
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"model.ffn_chunk_size must be a positive integer or 0 (auto); got {chunk!r}")
        self.check_positive("num_kv_heads", "head_dim", "mlp_hidden", optional=True)
        self.check_above_zero("mlp_ratio")
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

    @property
    def kernel_settings(self) -> dict:
        """model.attention_options as the kernels' keyword arguments."""
        return parse_settings(self.attention_options)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def mlp_dim(self) -> int:
        return self.mlp_hidden or int(self.mlp_ratio * self.d_model)

    @property
    def ffn_matrices(self) -> int:
        """Weight matrices of the FFN: W1 and W2, and W3 with swiglu."""
        return 3 if self.mlp_activation == "swiglu" else 2

    @property
    def chunked_loss(self) -> bool:
        if self.loss_impl == "auto":
            return self.attention_mode == "blockwise_parallel"
        return self.loss_impl == "chunked"

    def num_params(self, *, embeddings: bool = True) -> int:
        """Parameter count (weights and biases), computed from the shapes alone; the
        vocabulary's padding rows (padded_vocab) are not counted: nothing reads them."""
        d, h, kv, hd, f = self.d_model, self.num_heads, self.kv_heads, self.dim_per_head, self.mlp_dim
        norm = d if self.rms_norm else 2 * d
        attn = d * h * hd + 2 * d * kv * hd + h * hd * d
        ffn = self.ffn_matrices * d * f
        if self.use_bias:
            attn += h * hd + 2 * kv * hd + d
            ffn += (self.ffn_matrices - 1) * f + d
        total = self.num_layers * (attn + ffn + 2 * norm) + norm
        if embeddings:
            total += self.vocab_size * d * (1 if self.tie_embeddings else 2)
            if self.position_embedding == "learned":
                total += self.max_seq_len * d
        return total

    @property
    def summary(self) -> str:
        """What kind of model this is, in a few words (the training log's first line)."""
        return f"attention_mode={self.attention_mode}, attention_impl={self.attention_impl}"

    def train_flops_per_token(
        self, seq_len: int, *, causal: bool = True, keys_seen: float | None = None
    ) -> float:
        """Model FLOPs of a forward and backward pass per token (3x the forward's): 6 per
        matmul weight (the layers' and the LM head's) and the attention's QK^T and PV over
        seq_len keys (half of them, causal), or over keys_seen keys where given (the mean a
        query sees: packed documents' queries see only their own document's)."""
        d, h, kv, hd, f = self.d_model, self.num_heads, self.kv_heads, self.dim_per_head, self.mlp_dim
        matmul_params = (
            self.num_layers * (2 * d * h * hd + 2 * d * kv * hd + self.ffn_matrices * d * f)
            + d * self.vocab_size
        )
        if keys_seen is None:
            keys_seen = seq_len * (0.5 if causal else 1.0)
        return 6.0 * matmul_params + 12 * self.num_layers * h * hd * keys_seen


# ----------------------------------------------------------------------------- pure math


# A layer's parameters are a dict; the architecture options show in which entries it has:
# no b* without biases, no ln*_bias with RMSNorm, a w3 with swiglu.


def _biased(y: Array, p: dict, bias: str) -> Array:
    return y + p[bias] if bias in p else y


def project_qkv(p: dict, h: Array) -> tuple[Array, Array, Array]:
    q = _biased(jnp.einsum("bsd,dhk->bshk", h, p["wq"]), p, "bq")
    k = _biased(jnp.einsum("bsd,dhk->bshk", h, p["wk"]), p, "bk")
    v = _biased(jnp.einsum("bsd,dhk->bshk", h, p["wv"]), p, "bv")
    return q, k, v


def project_out(p: dict, a: Array) -> Array:
    return _biased(jnp.einsum("bshk,hkd->bsd", a, p["wo"]), p, "bo")


def mlp(p: dict, h: Array, activation: str = "gelu") -> Array:
    up = _biased(jnp.einsum("bsd,df->bsf", h, p["w1"]), p, "b1")
    if "w3" in p:  # swiglu
        hidden = jax.nn.silu(up) * _biased(jnp.einsum("bsd,df->bsf", h, p["w3"]), p, "b3")
    elif activation == "relu":
        hidden = jax.nn.relu(up)
    else:
        hidden = gelu(up)
    return _biased(jnp.einsum("bsf,fd->bsd", hidden, p["w2"]), p, "b2")


def norm(p: dict, name: str, h: Array, eps: float, impl: str = "xla") -> Array:
    """The layer's norm `name` (ln1, ln2): LayerNorm (run as impl says: NORM_IMPLS), or
    RMSNorm when it has no bias."""
    if f"{name}_bias" in p:
        return layer_norm(h, p[f"{name}_scale"], p[f"{name}_bias"], eps, impl)
    return rms_norm(h, p[f"{name}_scale"], eps)


def add_norm(p: dict, name: str, x: Array, residual: Array, eps: float, impl: str = "xla"):
    """(h, y): the residual add h = x + residual and the layer's norm `name` of it, y; for a
    LayerNorm in one pass where impl's kernels run (bpt.models.lm.add_layer_norm)."""
    if f"{name}_bias" in p:
        return add_layer_norm(x, residual, p[f"{name}_scale"], p[f"{name}_bias"], eps, impl)
    h = x + residual
    return h, rms_norm(h, p[f"{name}_scale"], eps)


def post_attention_weights(p: dict) -> dict:
    """The weights a BPT chunk reads after attention: output projection and FFN."""
    names = ("wo", "bo", "ln2_scale", "ln2_bias", "w1", "b1", "w3", "b3", "w2", "b2")
    return {name: p[name] for name in names if name in p}


# ----------------------------------------------------------------------------- modules


class Block(Layer):
    """One pre-LayerNorm transformer layer; __call__ returns (x, None) for nn.scan."""

    config: GPTConfig

    def _params(self) -> dict:
        cfg = self.config
        d, h, kv, hd, f = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head, cfg.mlp_dim
        normal = nn.initializers.normal(0.02)
        # GPT-2: projections into the residual stream are scaled down with depth.
        residual = nn.initializers.normal(0.02 / math.sqrt(2 * cfg.num_layers))
        zeros, ones = nn.initializers.zeros_init(), nn.initializers.ones_init()
        # (name, shape, logical axes, init, present): created in this order, so that a
        # GPT-2-shaped layer keeps the tree it always had.
        table = [
            ("ln1_scale", (d,), ("embed",), ones, True),
            ("ln1_bias", (d,), ("embed",), zeros, not cfg.rms_norm),
            ("wq", (d, h, hd), ("embed", "heads", "head_dim"), normal, True),
            ("wk", (d, kv, hd), ("embed", "kv_heads", "head_dim"), normal, True),
            ("wv", (d, kv, hd), ("embed", "kv_heads", "head_dim"), normal, True),
            ("bq", (h, hd), ("heads", "head_dim"), zeros, cfg.use_bias),
            ("bk", (kv, hd), ("kv_heads", "head_dim"), zeros, cfg.use_bias),
            ("bv", (kv, hd), ("kv_heads", "head_dim"), zeros, cfg.use_bias),
            ("wo", (h, hd, d), ("heads", "head_dim", "embed"), residual, True),
            ("bo", (d,), ("embed",), zeros, cfg.use_bias),
            ("ln2_scale", (d,), ("embed",), ones, True),
            ("ln2_bias", (d,), ("embed",), zeros, not cfg.rms_norm),
            ("w1", (d, f), ("embed", "mlp"), normal, True),
            ("b1", (f,), ("mlp",), zeros, cfg.use_bias),
            ("w3", (d, f), ("embed", "mlp"), normal, cfg.mlp_activation == "swiglu"),
            ("b3", (f,), ("mlp",), zeros, cfg.use_bias and cfg.mlp_activation == "swiglu"),
            ("w2", (f, d), ("mlp", "embed"), residual, True),
            ("b2", (d,), ("embed",), zeros, cfg.use_bias),
        ]
        return {
            name: self._param(name, shape, axes, init)
            for name, shape, axes, init, present in table
            if present
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
            x = par.constrain(x, "batch", "length", "embed")
        if not self.decode:
            x = checkpoint_name(x, LAYER_INPUT)
            if par is not None and par.sequence > 1:
                x = row_major(x)
        p = self._params()
        rng = None if self.deterministic or cfg.dropout == 0.0 else self.make_rng("dropout")
        rate, norm_impl = cfg.dropout, self._norm_impl()
        norm_rows = functools.partial(self._norm_rows, norm_impl=norm_impl)

        def ffn_residual(x: Array, delta: Array, rng, p=p, local: bool = False) -> Array:
            """h = x + delta (attention's output), then h + the FFN of h's norm, the norm and
            the FFN under model.remat_ffn. With the LayerNorm kernels the add joins the norm's
            pass (add_norm); XLA's add stays out of the remat, which then keeps h alone (not
            x and delta: 94 MiB more at GPT-125M's 16K in two layers, the blockwise loop).
            local: x and delta are one device's rows (a per-device chunk loop)."""
            if norm_impl == "pallas" and "ln2_bias" in p:

                def ffn(x, delta):
                    h, y = norm_rows(p, "ln2", x, delta, local=local)
                    return h, mlp(p, y, cfg.mlp_activation)

                h, f = remat(ffn, cfg.remat_ffn)(x, delta)
            else:
                h = x + delta
                ffn = remat(lambda h: mlp(p, norm_rows(p, "ln2", h, local=local), cfg.mlp_activation), cfg.remat_ffn)
                f = ffn(h)
            return h + dropout(f, rate, rng)

        q, k, v = project_qkv(p, norm_rows(p, "ln1", x))
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if not self.decode:  # kept by attention_and_dots_saveable in place of the projections
            q, k, v = (checkpoint_name(t, ATTENTION_INPUTS) for t in (q, k, v))

        impl = self._attention_impl(q, k, segment_ids)
        if self.decode:
            a, stacks = self._cached_attention(q, k, v, impl, cache_index, stacks, layer)
            x = ffn_residual(x, project_out(p, a), None)
            return (x if stacks is None else (x, *stacks)), None
        shards = 1 if par is None else par.sequence
        if cfg.attention_mode == "blockwise_parallel" and impl == "blockwise" and shards == 1:
            return self._fused_blockwise(p, x, q, k, v, segment_ids, rng, ffn_residual), None

        a = self._attend(q, k, v, impl, segment_ids)
        if cfg.attention_mode != "blockwise_parallel":
            delta = dropout(project_out(p, a), rate, fold_rng(rng, 0))
            return ffn_residual(x, delta, fold_rng(rng, 1)), None

        # Attention by a fused kernel, or across sequence shards, over the whole (local)
        # sequence; the rest block by block (on every shard at once).
        def post_attention(i, chunk, p, local=False):
            x_c, a_c = chunk
            delta = dropout(project_out(p, a_c), rate, fold_rng(rng, 0, i))
            return ffn_residual(x_c, delta, fold_rng(rng, 1, i), p, local)

        def chunk_loop(x, a, weights, shards, local=False):
            most = FFN_CHUNK_UNROLLED if stack_unrolled(cfg) else FFN_CHUNK
            chunk = cfg.ffn_chunk_size or largest_chunk(x.shape[1] // shards, cfg.q_chunk_size, most)
            out = scan_chunks(
                functools.partial(post_attention, local=local),
                (x, a),
                chunk_size=chunk,
                policy="none",
                name="ffn_chunk_size" if cfg.ffn_chunk_size else "q_chunk_size",
                weights=weights,
                shards=shards,
            )
            return from_chunks(out, shards)

        weights = post_attention_weights(p)
        out = self._per_device(functools.partial(chunk_loop, shards=1, local=True), x, a, weights=weights, rng=rng)
        return (chunk_loop(x, a, weights, shards) if out is None else out), None

    def _norm_rows(self, p: dict, name: str, *rows: Array, norm_impl: str, local: bool = False):
        """The layer's norm `name` of rows (h), or with the residual add before it (x,
        residual: add_norm's (h, y)), as norm_impl runs it. On a mesh of several devices
        bpt's kernels run on each device's own rows: rows that are the global ones (not
        local: outside a per-device chunk loop) go through shard_map (Parallelism.per_device)."""
        eps, par = self.config.layer_norm_epsilon, self.parallel
        weights = {k: p[k] for k in (f"{name}_scale", f"{name}_bias") if k in p}
        if len(rows) == 1:
            run = lambda h, w: norm(w, name, h, eps, norm_impl)  # noqa: E731
        else:
            run = lambda x, r, w: add_norm(w, name, x, r, eps, norm_impl)  # noqa: E731
        # _norm_impl gives pallas on a mesh only where per_device runs (not while decoding);
        # RMSNorm runs XLA's formula whatever norm_impl says
        if norm_impl == "pallas" and par is not None and par.runs_per_device and not local and f"{name}_bias" in p:
            return par.per_device(run, *rows, weights=weights)
        return run(*rows, weights)

    def _norm_impl(self) -> str:
        """model.norm_impl, resolved (one of NORM_IMPLS) where it can run: bpt's LayerNorm
        kernels are one device's (XLA cannot split a kernel over a mesh), so on a mesh of
        several devices they run on each device's rows under shard_map, which needs
        mesh.tensor=1 (Parallelism.per_device; otherwise an error). Decoding on a mesh takes
        XLA's norms, as layer_norm does where the kernels do not take the shape (a decode
        step's few rows). auto takes them on one GPU only: on a mesh they have not been
        measured yet."""
        impl, par = self.config.norm_impl, self.parallel
        one_device = par is None or par.mesh.size == 1
        if impl == "auto":
            return "pallas" if one_device and jax.default_backend() == "gpu" else "xla"
        if impl == "pallas" and not one_device and self.decode:
            return "xla"
        if impl == "pallas" and not one_device and not par.runs_per_device:
            raise ValueError(
                f"model.norm_impl='pallas' runs on a mesh of {par.mesh.size} devices per device, "
                "which it cannot with tensor parallelism (mesh.tensor > 1; use model.norm_impl='xla' or 'auto')"
            )
        return impl

    def _attention_impl(self, q: Array, k: Array, segment_ids) -> str:
        """The attention implementation this layer runs, resolved here once from the shapes
        one device computes (auto's thresholds were measured per device): the reference for
        vanilla attention; across sequence shards one of bpt.ops.attention.MERGED (each
        shard's logsumexp merges them), else one of ATTENTION. An implementation set by name
        that cannot take the inputs is an error naming model.attention_impl."""
        cfg, par = self.config, self.parallel
        if cfg.attention_mode == "vanilla":
            return "reference"
        if par is not None:
            q, k = (jax.ShapeDtypeStruct(par.local_shape(x.shape), x.dtype) for x in (q, k))
        registry = MERGED if par is not None and par.sequence > 1 and not self.decode else ATTENTION
        try:
            return registry.resolve(
                cfg.attention_impl,
                q,
                k,
                causal=True,
                segment_ids=segment_ids,
                q_chunk_size=cfg.q_chunk_size,
                kv_chunk_size=cfg.kv_chunk_size,
            )
        except ValueError as error:
            raise ValueError(f"model.attention_impl={cfg.attention_impl!r}: {error}") from None

    def _attend(self, q: Array, k: Array, v: Array, impl: str, segment_ids) -> Array:
        """Causal attention of the layer's heads, under model.remat_attention: inside shard_map
        per device across the sequence shards (ring or all-gather) or for a kernel XLA cannot
        split by itself, else as one op XLA partitions."""
        cfg, par = self.config, (None if self.decode else self.parallel)
        shards = 1 if par is None else par.sequence
        if par is not None and (shards > 1 or impl in ("pallas", "pallas_fp8", "cudnn")):
            attend = functools.partial(
                context_parallel_attention,
                mesh=par.mesh,
                strategy=par.context_parallel,
                layout=par.load_balance,
                head_groups=par.head_groups,
            )
        else:
            attend = attention
        attend = functools.partial(
            attend,
            impl=impl,
            causal=True,
            segment_ids=segment_ids,
            q_chunk_size=cfg.q_chunk_size,
            kv_chunk_size=cfg.kv_chunk_size,
        )
        with kernel_settings(**cfg.kernel_settings):
            return remat(attend, cfg.remat_attention)(q, k, v)

    def _cached_attention(self, q, k, v, impl: str, cache_index: Array | None, stacks, layer):
        """Attention while decoding, and the caches: the cache holds every position's keys
        and values.

        cache_index None: a prefill that starts the cache over; its tokens attend to each
        other through the model's attention implementation. Otherwise cache_index [batch]
        is where each sequence's tokens (one, or a later chunk of a long prompt) go; they
        attend to the cache up to their own positions (bpt.ops.decode_attention, by
        model.decode_impl). stacks: (k, v) of all layers [layers, batch, slots, ...], and
        their scales with cache_dtype int8 (the scanned stack's carry), written and read at
        `layer` in place; None: this layer's own cache variables. With the sequence sharded over
        a mesh, so is the cache, along its slots (striped: position p on device p mod N), and
        attention over it is Tree Attention (bpt.parallel.tree_decode_attention).
        """
        cfg = self.config
        batch, length = q.shape[:2]
        start = jnp.zeros((batch,), jnp.int32) if cache_index is None else cache_index
        positions = start[:, None] + jnp.arange(length)  # [batch, length]
        par = self.parallel
        if par is not None and par.sequence > 1:
            # striped: a long prompt's chunks fill every device's shard evenly (bpt.parallel.tree)
            sharded = dict(mesh=par.mesh, layer=layer, layout="striped")
            write = functools.partial(sharded_write_cache, **sharded)
            attend = functools.partial(tree_decode_attention, batch_axes=(), **sharded)
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
            with kernel_settings(**cfg.kernel_settings):
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

        def loop(x, q, k, v, segment_ids, weights, local=False):
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
                delta = dropout(project_out(p, attend(q_c)), cfg.dropout, fold_rng(rng, 0, i))
                return ffn_residual(x_c, delta, fold_rng(rng, 1, i), p, local)

            out = scan_chunks(
                block,
                (x, q, segment_ids),
                chunk_size=cfg.q_chunk_size,
                policy="none",
                name="q_chunk_size",
                weights=weights,
            )
            return from_chunks(out)

        rows, weights = (x, q, k, v, segment_ids), post_attention_weights(p)
        out = self._per_device(functools.partial(loop, local=True), *rows, weights=weights, rng=rng)
        return loop(*rows, weights) if out is None else out

    def _per_device(self, loop, *rows, weights, rng):
        """The chunk loop run by each device over its own chunks (Parallelism.per_device), or
        None where it stays global: on one device, and with dropout (its masks are drawn for
        the global chunk, as on one device)."""
        if self.parallel is None or rng is not None:
            return None
        return self.parallel.per_device(loop, *rows, weights=weights)


class GPT(CausalLM):
    """The model. parallel: the mesh it runs on (bpt.parallel.Parallelism); None: one device.

    With a mesh, activations are sharded [batch over data x fsdp, tokens over sequence], and
    with mesh.sequence > 1 the tokens are permuted once into the load-balanced layout at the
    input (positions follow them) and logits are permuted back at the output; attention then
    spans the shards by ring or all-gather attention.
    """

    config: GPTConfig
    parallel: Parallelism | None = None

    def layer_class(self):
        return Block

    def resolved_impls(self, batch: int, seq_len: int, *, packed: bool = False) -> str:
        """What the layers run for a [batch, seq_len] training step (packed: with segment
        ids), as the training log says it: "attention_impl=auto -> pallas, norm_impl=auto ->
        pallas". Resolved as the layers resolve them when traced (from each device's shapes)."""
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        q = jax.ShapeDtypeStruct((batch, seq_len, cfg.num_heads, cfg.dim_per_head), dtype)
        k = jax.ShapeDtypeStruct((batch, seq_len, cfg.kv_heads, cfg.dim_per_head), dtype)
        segments = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32) if packed else None
        block = Block(cfg, parallel=self.parallel, parent=None)  # not a submodule: only asked
        chosen = {"attention_impl": block._attention_impl(q, k, segments)}
        if not cfg.rms_norm:
            chosen["norm_impl"] = block._norm_impl()
        said = {name: f"{name}={getattr(cfg, name)} -> {impl}" for name, impl in chosen.items()}
        if cfg.attention_options and chosen["attention_impl"] == "pallas":
            said["attention_impl"] += f" ({cfg.attention_options})"
        return ", ".join(said.values())

    def runs_norm_kernels(self) -> bool:
        cfg = self.config
        return not cfg.rms_norm and Block(cfg, parallel=self.parallel, parent=None)._norm_impl() == "pallas"

    def cache_shapes(self, batch: int, slots: int):
        cfg = self.config
        shape = (cfg.num_layers, batch, slots, cfg.kv_heads, cfg.dim_per_head)
        if cfg.cache_dtype == "int8":
            return [(n, shape, jnp.int8) for n in ("k", "v")] + [
                (n, shape[:-1], jnp.float32) for n in ("k_scale", "v_scale")
            ]
        return [(n, shape, jnp.dtype(cfg.dtype)) for n in ("k", "v")]

    def position_inputs(self, x: Array, positions: Array, valid, decode: bool):
        """Learned positions are added to x; rotary tables go to the layers. valid is not
        needed: padding written to the cache is overwritten before any token attends to it."""
        cfg = self.config
        if cfg.position_embedding == "rotary":
            return x, rotary_tables(positions, cfg.dim_per_head, cfg.rope_theta)
        if x.shape[1] > cfg.max_seq_len:
            raise ValueError(
                f"sequence length {x.shape[1]} exceeds model.max_seq_len={cfg.max_seq_len} "
                "of the learned position table"
            )
        table = logical_param(
            self,
            "position_embedding",
            (cfg.max_seq_len, cfg.d_model),
            ("positions", "embed"),
            nn.initializers.normal(0.02),
        )
        return x + jnp.take(table, positions, axis=0).astype(x.dtype), None

    def final_norm(self):
        return final_layer_norm(self, bias=not self.config.rms_norm)
