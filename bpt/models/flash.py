"""FLASH (Hua et al. 2022, "Transformer Quality in Linear Time"): a causal LM whose layers are
Gated Attention Units with mixed chunk attention.

One GAU replaces the attention + FFN pair. From the normalized input h:

    u = silu(h W_u), v = silu(h W_v)           [seq, e * d_model]  (e: the expansion)
    z = silu(h W_z)                            [seq, qk_dim]      a shared low-dimensional base
    queries and keys = z * gamma_i + beta_i    (per-dimension scale and offset, with rotary
                                                positions or a relative position bias)
    out = x + (u * relu^2-attention(v)) W_o

attention="quadratic" (FLASH-Quad) attends over the whole causal prefix with relu^2 scores
scaled by 1/n (n = model.max_seq_len); "mixed_chunk" (FLASH) attends quadratically inside
chunks of G = chunk_size tokens (scale 1/G) and linearly to all earlier chunks (a running
[qk_dim, e * d_model] sum, scale 1/n): linear time and memory in the sequence length
(bpt.ops.gau). Decoding with mixed_chunk keeps per layer that running sum and the current
chunk's keys and values, whatever the context: the cache does not grow.

The embedding, the layer stack (scan, remat, groups, decode stacks), the final norm, the LM
head and the chunked loss are the GPT's (bpt.models.lm.CausalLM).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from bpt.models.lm import (
    LAYER_INPUT,
    CausalLM,
    Layer,
    LMConfig,
    apply_rotary,
    dropout,
    final_layer_norm,
    layer_norm,
    logical_param,
    rotary_tables,
)
from bpt.ops.gau import IMPLS as FLASH_IMPLS
from bpt.ops.gau import (
    LINEAR_NORMS,
    mixed_chunk_attention,
    relative_buckets,
    relu2,
    relu2_attention_reference,
    resolve_impl,
)
from bpt.parallel.gau import sharded_mixed_chunk_attention
from bpt.parallel.mesh import Parallelism

Array = jax.Array
FLASH_ATTENTION = ("mixed_chunk", "quadratic")
NORMS = ("scale_norm", "layer_norm")
FLASH_POSITIONS = ("rotary", "relative_bias", "rotary+relative_bias")
ABSOLUTE_EMBEDDINGS = ("none", "scaled_sin")
QK_INITS = ("ones", "normal")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FLASHConfig(LMConfig):
    """LMConfig's shared fields (position_embedding: rotary | relative_bias, T5's bucketed
    bias on the relu^2 scores, | rotary+relative_bias, both, as the paper's LM recipe; attention_impl: bpt.ops.gau.IMPLS; max_seq_len: n in the 1/n
    scaling, the training context; use_bias: on the u, v, z and output dense layers, as the
    paper's dense(): without them the backward has no column sums over every token of the
    2e + s wide pre-activation, 3% faster at 125M and 8K but 4% higher validation loss after
    400 steps, docs/notes/flash.md) and FLASH's own."""

    chunk_size: int = 256  # G: mixed_chunk's chunk of quadratic attention
    attention: str = "mixed_chunk"
    expansion: float = 2.0  # e: u and v are e * d_model wide
    qk_dim: int = 128  # s: the shared base of queries and keys
    # The per-dimension scales that make queries and keys from the base: "ones" (1 + N(0, 0.02))
    # or "normal" (N(0, 0.02), the paper's pseudo-code: relu^2 of scores near 0 then starts
    # with almost no gradient; 32% worse than "ones" after 400 steps, docs/notes/flash.md).
    qk_init: str = "ones"
    # The defaults below are the FLASH paper's LM recipe (its Tables 9 and 10, Codes 2-8);
    # bpt.config.FLASH_RECIPES["bpt"] holds bpt's earlier choices.
    position_embedding: str = "rotary+relative_bias"
    norm: str = "layer_norm"  # or "scale_norm" (the paper's for masked LMs)
    # The relative bias: T5's buckets (exact below half their number, log-spaced beyond, up to
    # relative_max_distance). 0: twice the chunk (and the distance alike), one weight per
    # distance inside a chunk, Code 4's Toeplitz bias.
    relative_buckets: int = 0
    relative_max_distance: int = 0
    # The linear part over earlier chunks: "mean" (the paper's Code 8: the mean over them of
    # each chunk's lin_k^T v / chunk_size) or "sum" (their running sum times 1/max_seq_len).
    linear_norm: str = "mean"
    # An absolute position signal added to the token embedding: "scaled_sin" (the paper's
    # ScaledSin, Code 2: the sinusoids [sin | cos] of Transformer's table times one learned
    # scalar, from 1 / sqrt(d_model)) or "none".
    absolute_embedding: str = "scaled_sin"

    def __post_init__(self):
        super().__post_init__()
        for name, options in (
            ("attention", FLASH_ATTENTION),
            ("norm", NORMS),
            ("position_embedding", FLASH_POSITIONS),
            ("qk_init", QK_INITS),
            ("attention_impl", FLASH_IMPLS),
            ("linear_norm", LINEAR_NORMS),
            ("absolute_embedding", ABSOLUTE_EMBEDDINGS),
        ):
            self.check_allowed(name, options, "FLASH")
        self.check_positive("chunk_size", "qk_dim")
        for name in ("relative_buckets", "relative_max_distance"):
            if getattr(self, name) < 0:
                raise ValueError(f"model.{name} must be >= 0 (0: twice model.chunk_size); got {getattr(self, name)}")
        self.check_above_zero("expansion")
        if self.rotary and self.qk_dim % 2:
            raise ValueError(f"rotary positions need an even model.qk_dim; got {self.qk_dim}")
        if self.absolute_embedding == "scaled_sin" and self.d_model % 2:
            raise ValueError(f"model.absolute_embedding='scaled_sin' needs an even model.d_model; got {self.d_model}")
        if self.bias_buckets < 2 or self.bias_max_distance <= self.bias_buckets // 2:
            raise ValueError(
                "model.relative_buckets must be >= 2 and model.relative_max_distance above half of it; "
                f"got {self.bias_buckets}, {self.bias_max_distance}"
            )

    @property
    def chunked_loss(self) -> bool:
        return self.loss_impl != "full"

    @property
    def hidden_dim(self) -> int:
        """e * d_model: the width of u and v."""
        return int(self.expansion * self.d_model)

    @property
    def num_qk(self) -> int:
        """Query/key pairs from the shared base: quadratic and linear (mixed_chunk), or one."""
        return 4 if self.attention == "mixed_chunk" else 2

    # The chunking the sampler pads prompts to (bpt.sample reads these of every family).
    @property
    def q_chunk_size(self) -> int:
        return self.chunk_size

    @property
    def kv_chunk_size(self) -> int:
        return self.chunk_size

    @property
    def prefill_multiple(self) -> int:
        """mixed_chunk's decode cache is the sum over whole chunks before the current one: a
        prompt's later chunks must start at chunk borders, as training's chunks do."""
        return self.chunk_size if self.attention == "mixed_chunk" else 1

    @property
    def quad_scale(self) -> float:
        return 1.0 / (self.chunk_size if self.attention == "mixed_chunk" else self.max_seq_len)

    @property
    def rotary(self) -> bool:
        """Whether queries and keys are rotated (RoPE)."""
        return self.position_embedding in ("rotary", "rotary+relative_bias")

    @property
    def bias_buckets(self) -> int:
        """The relative bias's buckets: relative_buckets, or (0) twice the chunk."""
        return self.relative_buckets or 2 * self.chunk_size

    @property
    def bias_max_distance(self) -> int:
        """Distances from here on share the last bucket: relative_max_distance, or (0) bias_buckets."""
        return self.relative_max_distance or self.bias_buckets

    @property
    def relative_bias(self) -> bool:
        """Whether the relu^2 scores get a learned relative position bias."""
        return self.position_embedding in ("relative_bias", "rotary+relative_bias")

    @property
    def lin_scale(self) -> float:
        """The linear part's scale: 1/n over the running sum, or the paper's 1/chunk_size
        over each chunk's lin_k^T v, averaged over the earlier chunks (linear_norm)."""
        return 1.0 / (self.chunk_size if self.linear_norm == "mean" else self.max_seq_len)

    def num_params(self, *, embeddings: bool = True) -> int:
        """Parameter count (weights and biases), computed from the shapes alone; the
        vocabulary's padding rows (padded_vocab) are not counted: nothing reads them."""
        d, e, s = self.d_model, self.hidden_dim, self.qk_dim
        norm = 1 if self.norm == "scale_norm" else 2 * d
        bias = self.bias_buckets if self.relative_bias else 0
        biases = (2 * e + s + d) if self.use_bias else 0
        per_layer = norm + 2 * d * e + d * s + 2 * self.num_qk * s + e * d + biases + bias
        total = self.num_layers * per_layer + norm + (self.absolute_embedding == "scaled_sin")
        if embeddings:
            total += self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return total

    @property
    def summary(self) -> str:
        """What kind of model this is, in a few words (the training log's first line)."""
        return f"FLASH, attention={self.attention}, chunk_size={self.chunk_size}, attention_impl={self.attention_impl}"

    def train_flops_per_token(
        self, seq_len: int, *, causal: bool = True, keys_seen: float | None = None
    ) -> float:
        """Model FLOPs of a forward and backward pass per token (3x the forward's): the
        matmuls of the layers and the LM head, the relu^2 scores and their values (causal:
        half of a chunk on average, or half the sequence for quadratic; causal=False counts
        all of it), and the linear part's k v^T and q S (2 s e multiply-adds each).
        keys_seen: the mean number of keys a query sees (packed documents), in place of half
        the sequence for quadratic attention; mixed_chunk counts its chunks as they are."""
        d, e, s = self.d_model, self.hidden_dim, self.qk_dim
        dense = self.num_layers * (3 * d * e + d * s) + d * self.vocab_size
        window = (self.chunk_size if self.attention == "mixed_chunk" else seq_len) * (1 if causal else 2)
        if keys_seen is not None and self.attention != "mixed_chunk":
            window = 2 * keys_seen
        attention = window * (s + e) + (4 * s * e if self.attention == "mixed_chunk" else 0)
        return 6.0 * dense + 3.0 * self.num_layers * attention


# ----------------------------------------------------------------------------- pure math


def scale_norm(x: Array, scale: Array, eps: float) -> Array:
    """ScaleNorm (Nguyen & Salazar 2019): scale * x / ||x||, one learned scalar."""
    x32 = x.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(jnp.square(x32), axis=-1, keepdims=True))
    return (x32 * (scale.astype(jnp.float32) / jnp.maximum(norm, eps))).astype(x.dtype)


def sinusoids(positions: Array, width: int) -> Array:
    """[..., width] float32: [sin | cos] of positions times Transformer's frequencies
    (1 / 10000^(2i / width), i < width / 2)."""
    frequencies = 1.0 / 10000.0 ** (jnp.arange(0, width, 2, dtype=jnp.float32) / width)
    angles = jnp.asarray(positions, jnp.float32)[..., None] * frequencies
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def near_one(stddev: float):
    """An initializer: 1 + N(0, stddev)."""

    def init(key, shape, dtype=jnp.float32):
        return (1.0 + stddev * jax.random.normal(key, shape)).astype(dtype)

    return init


def bias_table(table: Array, distance: Array, cfg: FLASHConfig) -> Array:
    """The relative position bias for causal distances (any shape)."""
    return table[relative_buckets(distance, cfg.bias_buckets, cfg.bias_max_distance)]


def causal_bias(table: Array, size: int, cfg: FLASHConfig) -> Array:
    """bias_table of the distances i - j between `size` positions, [size, size], zero above
    the diagonal (where causal attention masks the scores). One lookup a distance, then the
    Toeplitz matrix laid out by a tile and reshapes: its gradient sums the matrix's diagonals
    with dense ops, where indexing the table with every (i, j) made it a scatter-add of size^2
    score gradients into a few hundred buckets, a contended atomic on GPUs (XLA's GPU
    scatter-add fell back to compare-and-swap loops in some jaxlib releases). 2 size^2
    elements in flight: for chunks, not whole sequences."""
    per_distance = bias_table(table, jnp.arange(size), cfg)  # u[d], d = 0 .. size - 1
    # a[k] = u[size - 1 - k], then zeros: row i of the result is a[size - 1 - i : 2 size - 1 - i]
    a = jnp.concatenate([per_distance[::-1], jnp.zeros((size,), per_distance.dtype)])
    # a tiled, read in rows of 2 size - 1 from offset size - 1: row i starts size - 1 - i into a
    rows = jnp.tile(a, size)[size - 1 : size - 1 + size * (2 * size - 1)].reshape(size, 2 * size - 1)
    return rows[:, :size]


# ----------------------------------------------------------------------------- the layer


class GAULayer(Layer):
    """One Gated Attention Unit with its residual; __call__ returns (x, None) for nn.scan."""

    config: FLASHConfig

    def _params(self) -> dict:
        cfg = self.config
        d, e, s = cfg.d_model, cfg.hidden_dim, cfg.qk_dim
        normal = nn.initializers.normal(0.02)
        residual = nn.initializers.normal(0.02 / math.sqrt(2 * cfg.num_layers))
        qk_scale_init = normal if cfg.qk_init == "normal" else near_one(0.02)
        zeros, ones = nn.initializers.zeros_init(), nn.initializers.ones_init()
        p = {}
        if cfg.norm == "scale_norm":
            p["norm_scale"] = self._param("norm_scale", (), (), nn.initializers.constant(math.sqrt(d)))
        else:
            p["ln_scale"] = self._param("ln_scale", (d,), ("embed",), ones)
            p["ln_bias"] = self._param("ln_bias", (d,), ("embed",), zeros)
        shapes = {"u": (e, "mlp"), "v": (e, "mlp"), "z": (s, "qk")}
        for name, (width, axis) in shapes.items():  # in this order: the initial values depend on it
            p[f"w_{name}"] = self._param(f"w_{name}", (d, width), ("embed", axis), normal)
            if cfg.use_bias:
                p[f"b_{name}"] = self._param(f"b_{name}", (width,), (axis,), zeros)
        p["qk_scale"] = self._param("qk_scale", (cfg.num_qk, s), (None, "qk"), qk_scale_init)
        p["qk_offset"] = self._param("qk_offset", (cfg.num_qk, s), (None, "qk"), zeros)
        p["w_o"] = self._param("w_o", (e, d), ("mlp", "embed"), residual)
        if cfg.use_bias:
            p["b_o"] = self._param("b_o", (d,), ("embed",), zeros)
        if cfg.relative_bias:
            p["relative_bias"] = self._param("relative_bias", (cfg.bias_buckets,), (None,), zeros)
        return p

    @nn.compact
    def __call__(self, x, segment_ids, positions, cache_index=None, layer=None):
        """x [batch, seq, d_model]; positions [seq] or [batch, seq] (with the decode call's
        valid counts as (positions, valid) while decoding)."""
        cfg = self.config
        stacks = None
        if layer is not None:  # decoding a scanned stack: the carry holds every layer's cache
            x, *stacks = x
        par = None if self.decode else self.parallel
        if par is not None and par.sequence > 1 and cfg.attention != "mixed_chunk":
            raise ValueError(
                f"FLASH with attention={cfg.attention!r} attends over the whole sequence and does not run "
                "with mesh.sequence > 1; use attention='mixed_chunk'"
            )
        if par is not None:
            x = par.constrain(x, "batch", "length", "embed")
        valid = None
        if self.decode:
            positions, valid = positions
        else:
            x = checkpoint_name(x, LAYER_INPUT)
        p = self._params()
        if cfg.norm == "scale_norm":
            h = scale_norm(x, p["norm_scale"], cfg.layer_norm_epsilon)
        else:
            h = layer_norm(x, p["ln_scale"], p["ln_bias"], cfg.layer_norm_epsilon)
        if par is not None and par.shards("mlp") > 1:  # u and v split over the devices
            u, v, z = (jax.nn.silu(self._dense(h, p, n)) for n in ("u", "v", "z"))
        else:  # one matmul, as the paper's dense(x, 2e + s): one GEMM and one bias gradient, not three
            names = ("u", "v", "z")
            uvz = h @ jnp.concatenate([p[f"w_{n}"] for n in names], axis=1)
            if cfg.use_bias:
                uvz = uvz + jnp.concatenate([p[f"b_{n}"] for n in names])
            u, v, z = jnp.split(jax.nn.silu(uvz), [cfg.hidden_dim, 2 * cfg.hidden_dim], axis=-1)
        qk = z[..., None, :] * p["qk_scale"] + p["qk_offset"]  # [batch, seq, num_qk, s]
        if cfg.rotary:
            qk = apply_rotary(qk, *rotary_tables(positions, cfg.qk_dim, cfg.rope_theta))
        qk = [qk[:, :, i] for i in range(cfg.num_qk)]
        table = p.get("relative_bias")
        if self.decode:
            a, stacks = self._cached_attention(qk, v, table, positions, valid, cache_index, stacks, layer)
        else:
            a = self._attention(qk, v, table, segment_ids)
        out = self._dense(u * a, p, "o")
        rng = None if self.deterministic or cfg.dropout == 0.0 else self.make_rng("dropout")
        x = x + dropout(out, cfg.dropout, rng)
        return (x if stacks is None else (x, *stacks)), None

    def _dense(self, x, p, name):
        y = x @ p[f"w_{name}"]
        return y + p[f"b_{name}"] if self.config.use_bias else y

    def _attention(self, qk, v, table, segment_ids):
        cfg = self.config
        t = v.shape[1]
        if cfg.attention == "quadratic":
            pos = jnp.arange(t)
            bias = None if table is None else bias_table(table, pos[:, None] - pos[None, :], cfg)
            quad_q, quad_k = qk
            return relu2_attention_reference(
                quad_q, quad_k, v, scale=cfg.quad_scale, bias=bias, segment_ids=segment_ids
            )
        g = cfg.chunk_size
        pad = -t % g  # padded at the end: causal attention never lets them reach a real token
        if pad:
            widths = ((0, 0), (0, pad), (0, 0))
            qk, v = [jnp.pad(x, widths) for x in qk], jnp.pad(v, widths)
            if segment_ids is not None:
                segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), mode="edge")
        bias = None if table is None else causal_bias(table, g, cfg)
        impl = self._chunk_impl()
        attend = functools.partial(
            mixed_chunk_attention,
            chunk_size=g,
            quad_scale=cfg.quad_scale,
            lin_scale=cfg.lin_scale,
            impl=impl,
            linear_norm=cfg.linear_norm,
        )
        par = self.parallel
        if par is not None and par.sequence > 1:  # chunks on their devices, one running sum across
            return sharded_mixed_chunk_attention(
                *qk,
                v,
                mesh=par.mesh,
                chunk_size=g,
                quad_scale=cfg.quad_scale,
                lin_scale=cfg.lin_scale,
                bias=bias,
                segment_ids=segment_ids,
                impl=impl,
                linear_norm=cfg.linear_norm,
            )[:, :t]
        if impl == "pallas" and par is not None and par.mesh.size > 1:  # a kernel XLA cannot split
            rows = par.logical("batch").spec
            seg_spec = None if segment_ids is None else rows
            # the bias is whole on every device; shard_map sums its gradient over the devices
            per_device = jax.shard_map(
                lambda *a: attend(*a[:5], segment_ids=a[5], bias=a[6]),
                mesh=par.mesh,
                in_specs=(rows,) * 5 + (seg_spec, None if bias is None else par.replicated().spec),
                out_specs=rows,
                check_vma=False,
            )
            return per_device(*qk, v, segment_ids, bias)[:, :t]
        return attend(*qk, v, segment_ids=segment_ids, bias=bias)[:, :t]

    def _chunk_impl(self) -> str:
        """model.attention_impl resolved for these sizes and this layer's mesh: the kernels run
        per device under shard_map, over batch shards only (a tensor-sharded value width
        would need their contractions summed across devices)."""
        cfg = self.config
        impl = resolve_impl(cfg.attention_impl, cfg.chunk_size, cfg.qk_dim, cfg.hidden_dim)
        par = self.parallel
        if impl != "pallas" or par is None or par.mesh.size == 1:
            return impl
        if par.shards("mlp") == 1:
            return impl  # per device, under shard_map over the batch shards
        if cfg.attention_impl == "pallas":
            raise ValueError(
                "model.attention_impl='pallas' for FLASH runs on meshes that shard the batch only "
                "(mesh.tensor=1) on several devices; use model.attention_impl='blockwise' or 'auto'"
            )
        return "blockwise"

    # ------------------------------------------------------------------------ decoding

    def _cached_attention(self, qk, v, table, positions, valid, cache_index, stacks, layer):
        """Attention while decoding, and the cache. mixed_chunk keeps (state [batch, s, e]
        float32: the linear sum over every chunk before the current one; the current chunk's
        quad_k, lin_k [batch, G, s] and v [batch, G, e]); quadratic keeps every position's
        quad_k and v. stacks: those of all layers (the scanned stack's carry), read and
        written at `layer`; None: this layer's own cache variables.

        cache_index None: a prefill from position 0; else the call continues each sequence
        at positions [batch, seq] (one token, or a prompt's later chunk: those start at a
        multiple of chunk_size). valid [batch]: the call's real tokens (the rest padding).
        """
        cfg = self.config
        batch, length = v.shape[:2]
        shapes = cache_shapes(cfg, batch, length)  # with a layer axis first
        names = [name for name, _, _ in shapes]
        if stacks is None:
            own = [self.variable("cache", n, jnp.zeros, shape[1:], dtype) for n, shape, dtype in shapes]
            caches = [variable.value for variable in own]
        else:
            caches = [jax.lax.dynamic_index_in_dim(stack, layer, 0, keepdims=False) for stack in stacks]
        caches = dict(zip(names, caches))
        if cache_index is None:  # a prefill starts the cache over
            caches = {n: jnp.zeros_like(c) for n, c in caches.items()}
        valid = jnp.full((batch,), length, jnp.int32) if valid is None else valid
        if cfg.attention == "quadratic":
            a, caches = _quadratic_decode(cfg, qk, v, table, positions, caches)
        elif length == 1:
            a, caches = _mixed_decode_token(cfg, qk, v, table, positions[:, 0], caches)
        else:
            a, caches = _mixed_decode_chunks(cfg, qk, v, table, valid, positions[:, 0], caches)
        new = [caches[n] for n in names]
        if stacks is None:
            for variable, value in zip(own, new):
                variable.value = value
            return a, None
        stacks = [
            jax.lax.dynamic_update_index_in_dim(s, c.astype(s.dtype), layer, 0) for s, c in zip(stacks, new)
        ]
        return a, stacks


def cache_shapes(cfg: FLASHConfig, batch: int, slots: int) -> list[tuple[str, tuple[int, ...], jnp.dtype]]:
    """(name, shape, dtype) of one layer's decode cache, each with a leading layer axis:
    constant-size with mixed_chunk, `slots` positions with quadratic."""
    s, e, dtype, layers = cfg.qk_dim, cfg.hidden_dim, jnp.dtype(cfg.dtype), cfg.num_layers
    if cfg.attention == "quadratic":
        return [("quad_k", (layers, batch, slots, s), dtype), ("v", (layers, batch, slots, e), dtype)]
    g = cfg.chunk_size
    return [
        ("state", (layers, batch, s, e), jnp.float32),
        ("quad_k", (layers, batch, g, s), dtype),
        ("lin_k", (layers, batch, g, s), dtype),
        ("v", (layers, batch, g, e), dtype),
    ]


def _buffer_scores(cfg, q, keys, table, query_pos, key_pos, scale):
    """relu^2 weights [batch, q_len, slots] of queries at query_pos [batch, q_len] over keys at
    key_pos [batch, slots], zero where a key comes after the query."""
    scores = jnp.einsum("bqs,bks->bqk", q, keys, preferred_element_type=jnp.float32) * scale
    distance = query_pos[:, :, None] - key_pos[:, None, :]
    if table is not None:
        scores = scores + bias_table(table, distance, cfg).astype(jnp.float32)
    return jnp.where(distance >= 0, relu2(scores), 0.0)


def _quadratic_decode(cfg, qk, v, table, positions, caches):
    rows = jnp.arange(v.shape[0])[:, None]
    slots = caches["v"].shape[1]
    at = jnp.where(positions < slots, positions, slots)
    quad_q, quad_k = qk
    caches = {
        "quad_k": caches["quad_k"].at[rows, at].set(quad_k.astype(caches["quad_k"].dtype), mode="drop"),
        "v": caches["v"].at[rows, at].set(v.astype(caches["v"].dtype), mode="drop"),
    }
    key_pos = jnp.broadcast_to(jnp.arange(slots), (v.shape[0], slots))
    w = _buffer_scores(cfg, quad_q, caches["quad_k"], table, positions, key_pos, cfg.quad_scale)
    a = jnp.einsum("bqk,bke->bqe", w, caches["v"], preferred_element_type=jnp.float32)
    return a.astype(v.dtype), caches


def _fold(caches, where):
    """The current chunk's linear sum added to the state, and the chunk cleared, in the rows
    where `where` [batch]."""
    added = jnp.einsum("bgs,bge->bse", caches["lin_k"], caches["v"], preferred_element_type=jnp.float32)
    out = {"state": caches["state"] + jnp.where(where[:, None, None], added, 0.0)}
    for name in ("quad_k", "lin_k", "v"):
        out[name] = jnp.where(where[:, None, None], 0, caches[name]).astype(caches[name].dtype)
    return out


def _mixed_decode_token(cfg, qk, v, table, position, caches):
    """One token a sequence at position [batch]: a new chunk folds the finished one into the
    state first; then the token's keys go to its slot, and it attends to its chunk so far
    (quadratic) and to the state (linear)."""
    g = cfg.chunk_size
    slot = position % g
    caches = _fold(caches, (slot == 0) & (position > 0))
    rows = jnp.arange(v.shape[0])
    quad_q, quad_k, lin_q, lin_k = qk
    for name, new in (("quad_k", quad_k), ("lin_k", lin_k), ("v", v)):
        caches[name] = caches[name].at[rows, slot].set(new[:, 0].astype(caches[name].dtype))
    key_pos = (position - slot)[:, None] + jnp.arange(g)
    w = _buffer_scores(cfg, quad_q, caches["quad_k"], table, position[:, None], key_pos, cfg.quad_scale)
    quad = jnp.einsum("bqk,bke->bqe", w, caches["v"], preferred_element_type=jnp.float32)
    lin = jnp.einsum("bqs,bse->bqe", lin_q.astype(jnp.float32), caches["state"]) * cfg.lin_scale
    if cfg.linear_norm == "mean":  # the state holds the position // G chunks before this one
        lin = lin / jnp.maximum(position // g, 1)[:, None, None].astype(jnp.float32)
    return (quad + lin).astype(v.dtype), caches


def _mixed_decode_chunks(cfg, qk, v, table, valid, start, caches):
    """Several tokens of each sequence, starting at a chunk boundary (a prefill, or a prompt's
    later chunk): the last chunk before them is folded into the state, they attend chunk by
    chunk as in training (bpt.ops.gau.mixed_chunk_attention, from that state), and the
    state then holds every chunk before the one of the last valid token, which becomes
    the current chunk. Rows with no valid token keep their cache as it was. start [batch]:
    the position of each sequence's first token here (the state holds start // G chunks)."""
    g = cfg.chunk_size
    batch, t = v.shape[:2]
    active = valid > 0
    caches = _fold(caches, active)
    pad = -t % g
    widths = ((0, 0), (0, pad), (0, 0))
    qk, v = [jnp.pad(x, widths) for x in qk], jnp.pad(v, widths)
    bias = None if table is None else causal_bias(table, g, cfg)
    real = jnp.arange(t + pad)[None, :] < valid[:, None]
    quad_q, quad_k, lin_q, lin_k = qk
    lin_k = lin_k * real[..., None].astype(lin_k.dtype)  # padding stays out of the state
    a, states = mixed_chunk_attention(
        quad_q,
        quad_k,
        lin_q,
        lin_k,
        v,
        chunk_size=g,
        quad_scale=cfg.quad_scale,
        lin_scale=cfg.lin_scale,
        bias=bias,
        initial_state=caches["state"],
        initial_count=start // g,
        linear_norm=cfg.linear_norm,
        return_states=True,  # the XLA path (a prefill; the kernels serve training)
    )
    a = a[:, :t]
    current = jnp.maximum(valid - 1, 0) // g  # the chunk of the last valid token
    state = jnp.take_along_axis(states, current[:, None, None, None], axis=1)[:, 0]

    def chunk_of(x):  # [batch, t + pad, ...] -> the current chunk [batch, G, ...]
        chunks = x.reshape(batch, (t + pad) // g, g, x.shape[-1])
        return jnp.take_along_axis(chunks, current[:, None, None, None], axis=1)[:, 0]

    new = {"state": state, "quad_k": chunk_of(quad_k), "lin_k": chunk_of(lin_k), "v": chunk_of(v)}
    caches = {
        n: jnp.where(active.reshape(-1, *[1] * (c.ndim - 1)), new[n].astype(c.dtype), c)
        for n, c in caches.items()
    }
    return a, caches


# ----------------------------------------------------------------------------- the model


class FLASH(CausalLM):
    """The FLASH language model; the call contract of every family (bpt.models.lm.CausalLM).
    While decoding, a call's valid counts keep its padding out of the recurrent state."""

    config: FLASHConfig
    parallel: Parallelism | None = None
    # Contiguous sequence shards: each token's work is the same (a chunk and a running sum),
    # and the chunks stay in order on their devices (bpt.parallel.gau).
    sequence_layout = "none"

    def layer_class(self):
        return GAULayer

    def cache_shapes(self, batch: int, slots: int):
        return cache_shapes(self.config, batch, slots)

    def position_inputs(self, x: Array, positions: Array, valid, decode: bool):
        """The layers read the positions (rotary, relative bias; with the decode call's valid
        counts); with absolute_embedding="scaled_sin" the embedding gets ScaledSin as well."""
        cfg = self.config
        if cfg.absolute_embedding == "scaled_sin":
            scale = logical_param(self, "sin_scale", (), (), nn.initializers.constant(cfg.d_model**-0.5))
            x = x + (scale * sinusoids(positions, cfg.d_model)).astype(x.dtype)
        return x, ((positions, valid) if decode else positions)

    def final_norm(self):
        cfg = self.config
        if cfg.norm == "layer_norm":
            return final_layer_norm(self)
        scale = logical_param(self, "norm_f_scale", (), (), nn.initializers.constant(math.sqrt(cfg.d_model)))
        eps = cfg.layer_norm_epsilon
        return (lambda p, h: scale_norm(h, p, eps)), scale
