"""The attention of the Gated Attention Unit (FLASH, Hua et al. 2022): relu^2, no softmax.

One head of qk_dim s over values of width e (the unit's expanded width). With scores
z_ij = q_i . k_j * scale + b_(i-j) (b: an optional relative position bias):

    quadratic (FLASH-Quad)  out_i = sum_(j <= i) relu(z_ij)^2 v_j,  scale 1/n
    mixed chunk (FLASH)     the sequence in chunks of G tokens;
                            inside i's chunk:   sum_(j <= i) relu(z_ij)^2 v_j,  scale 1/G
                            earlier chunks:     ql_i . sum_j (kl_j v_j^T) * lin_scale

The mixed form keeps two query/key pairs (quadratic and linear) made from one shared base.
Its linear part is a running sum over chunks, [s, e] per chunk in float32, so memory and
work grow linearly with the sequence; decoding keeps that sum and the current chunk only
(bpt.models.flash).

Segment ids (packed documents, each one contiguous run of ids) keep both parts inside a
document. References that materialize [seq, seq] are beside each fast path, as for softmax
attention in bpt.ops.reference.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from bpt.ops.kernels import gau as kernels
from bpt.ops.registry import Implementation, Registry
from bpt.ops.remat import ATTENTION_OUT, ATTENTION_RESIDUAL, kept_results

Array = jax.Array


def relative_buckets(distance: Array, num_buckets: int = 32, max_distance: int = 128) -> Array:
    """T5's bucket of each causal distance i - j >= 0: one bucket per distance below
    num_buckets / 2, then logarithmically wider buckets up to max_distance (the last bucket
    holds everything beyond)."""
    exact = num_buckets // 2
    distance = jnp.maximum(distance, 0)
    log_ratio = jnp.log(jnp.maximum(distance, 1) / exact) / math.log(max_distance / exact)
    far = exact + (log_ratio * (num_buckets - exact)).astype(jnp.int32)
    return jnp.where(distance < exact, distance, jnp.minimum(far, num_buckets - 1)).astype(jnp.int32)


def relu2(scores: Array) -> Array:
    return jnp.square(jax.nn.relu(scores))


def _scores(q: Array, k: Array, scale: float, bias: Array | None) -> Array:
    s = jnp.einsum("...is,...js->...ij", q, k, preferred_element_type=jnp.float32) * scale
    return s if bias is None else s + bias.astype(jnp.float32)


def _same_segment(q_seg: Array | None, kv_seg: Array | None) -> Array | bool:
    if q_seg is None:
        return True
    return q_seg[..., :, None] == kv_seg[..., None, :]


def relu2_attention_reference(
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float,
    causal: bool = True,
    bias: Array | None = None,
    segment_ids: Array | None = None,
) -> Array:
    """FLASH-Quad, materialized: q, k [batch, seq, s], v [batch, seq, e] -> [batch, seq, e];
    bias [seq, seq] added to the scaled scores (before the relu)."""
    weights = relu2(_scores(q, k, scale, bias))
    t = q.shape[1]
    mask = _same_segment(segment_ids, segment_ids)
    if causal:
        mask = mask & jnp.tril(jnp.ones((t, t), bool))
    weights = jnp.where(mask, weights, 0.0)
    return jnp.einsum("bij,bje->bie", weights, v, preferred_element_type=jnp.float32).astype(v.dtype)


def mixed_chunk_reference(
    quad_q: Array,
    quad_k: Array,
    lin_q: Array,
    lin_k: Array,
    v: Array,
    *,
    chunk_size: int,
    quad_scale: float,
    lin_scale: float,
    bias: Array | None = None,
    segment_ids: Array | None = None,
    linear_norm: str = "sum",
) -> Array:
    """Causal mixed chunk attention, materialized as two [seq, seq] matrices (bias [seq, seq]
    applies to the quadratic part). linear_norm "mean": each query's linear part divided by
    the number of earlier chunks it sees keys of."""
    t = quad_q.shape[1]
    pos = jnp.arange(t)
    chunk = pos // chunk_size
    same = _same_segment(segment_ids, segment_ids)
    inside = (chunk[:, None] == chunk[None, :]) & (pos[:, None] >= pos[None, :]) & same
    earlier = (chunk[:, None] > chunk[None, :]) & same
    quad = jnp.where(inside, relu2(_scores(quad_q, quad_k, quad_scale, bias)), 0.0)
    lin = jnp.where(earlier, _scores(lin_q, lin_k, lin_scale, None), 0.0)
    if check_linear_norm(linear_norm) == "mean":
        b = quad_q.shape[0]
        seen = earlier.reshape(b, t, t // chunk_size, chunk_size).any(-1).sum(-1)  # [b, t]: earlier chunks seen
        lin = lin / jnp.maximum(seen, 1)[..., None]
    return jnp.einsum("bij,bje->bie", quad + lin, v, preferred_element_type=jnp.float32).astype(v.dtype)


def chunk_sums(lin_k: Array, v: Array, mask: Array | None = None) -> Array:
    """sum of lin_k_j v_j^T over each chunk: [batch, chunks, G, s], [batch, chunks, G, e] ->
    [batch, chunks, s, e] float32; mask [batch, chunks, G] leaves tokens out."""
    if mask is not None:
        lin_k = lin_k * mask[..., None].astype(lin_k.dtype)
    return jnp.einsum("bcjs,bcje->bcse", lin_k, v, preferred_element_type=jnp.float32)


def exclusive_chunk_sum(x: Array, *, reverse: bool = False) -> Array:
    """[batch, chunks, ...] float32 -> the sum over the chunks before each one (after it,
    with reverse), in float32: one matmul with a strictly triangular [chunks, chunks] 0/1
    matrix at full float32 precision: one pass over the states, where jnp.cumsum and the
    shift after it made several (7% faster on an H100 at 8 x 8K tokens; the Pallas path
    does better still, bpt.ops.kernels.gau.states)."""
    c = x.shape[1]
    i = jnp.arange(c)
    before = (i[None, :] > i[:, None]) if reverse else (i[None, :] < i[:, None])  # [to, from]
    flat = x.reshape(x.shape[0], c, -1)
    out = jnp.einsum("dc,bcn->bdn", before.astype(x.dtype), flat, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(x.shape)


def _states_entering_chunks(lin_k: Array, v: Array, seg: Array | None) -> Array:
    """[batch, chunks, s, e] float32 from chunked lin_k, v (and seg [batch, chunks, G]): for
    each chunk, sum(lin_k_j v_j^T) over the tokens before it that belong to the document its
    first token belongs to (all tokens before it without segment ids)."""
    if seg is None:
        return exclusive_chunk_sum(chunk_sums(lin_k, v))
    following, carry = _next_documents(seg)
    return _within_documents(carry, chunk_sums(lin_k, v, seg == following[..., None]))


def _next_documents(seg: Array) -> tuple[Array, Array]:
    """[batch, chunks] each: the document the next chunk starts in, and 1.0 where that is the
    document this chunk starts in (one document spans the border: a sum carries on)."""
    first = seg[:, :, 0]
    following = jnp.concatenate([first[:, 1:], first[:, -1:]], axis=1)
    return following, (following == first).astype(jnp.float32)


def _within_documents(carry: Array, added: Array) -> Array:
    """The exclusive running sum over chunks that restarts where carry [batch, chunks] is 0:
    X_(c+1) = carry_c * X_c + added_c, X_0 = 0; added [batch, chunks, ...] (chunk c's part of
    the document chunk c + 1 starts in)."""

    def combine(left, right):
        (a1, x1), (a2, x2) = left, right
        return a1 * a2, a2.reshape(a2.shape + (1,) * (x1.ndim - a2.ndim)) * x1 + x2

    _, inclusive = jax.lax.associative_scan(combine, (carry, added), axis=1)
    return jnp.concatenate([jnp.zeros_like(added[:, :1]), inclusive[:, :-1]], axis=1)


def _reached_by_initial(x: Array, seg: Array | None) -> Array:
    """x [batch, chunks (or 1), s, e] at the chunks whose state takes the initial state, zero
    at the others: with segment ids the chunks that start in the document the sequence
    starts in (the tokens before the sequence continue that document), else every chunk."""
    if seg is None:
        return x
    return jnp.where((seg[:, :, 0] == seg[:, :1, 0])[..., None, None], x, 0.0)


LINEAR_NORMS = ("sum", "mean")


def check_linear_norm(linear_norm: str) -> str:
    if linear_norm not in LINEAR_NORMS:
        raise ValueError(f"unknown linear_norm {linear_norm!r}; allowed: {', '.join(LINEAR_NORMS)}")
    return linear_norm


def chunks_entering(seg: Array | None, batch: int, chunks: int, initial_count: Array | None = None) -> Array:
    """float32 [batch, chunks]: how many earlier chunks the state entering each chunk sums over
    (_states_entering_chunks' chunks: with segment ids those holding tokens of the document
    the chunk starts in), plus initial_count [batch] (the chunks before the sequence, where
    the initial state reaches: _reached_by_initial). The paper's linear part (FLASH, Code 7
    and 8) is the mean over those chunks: the sum divided by this count."""
    if seg is None:
        counts = jnp.broadcast_to(jnp.arange(chunks, dtype=jnp.float32), (batch, chunks))
    else:  # the states' recurrence, counting the chunks that hold the next one's document
        following, carry = _next_documents(seg)
        counts = _within_documents(carry, jnp.any(seg == following[..., None], axis=-1).astype(jnp.float32))
    if initial_count is not None:
        initial = jnp.broadcast_to(jnp.asarray(initial_count, jnp.float32), (batch,))[:, None, None, None]
        counts = counts + _reached_by_initial(initial, seg)[..., 0, 0]
    return counts


def _chunk_masks(seg: Array | None, g: int) -> tuple[Array, Array | None]:
    """The quadratic part's [.., G, G] visibility inside each chunk (causal, same document),
    and [batch, chunks, G]: the queries that see earlier chunks (those in the document their
    chunk starts in; None without segment ids: all)."""
    causal = jnp.tril(jnp.ones((g, g), bool))
    if seg is None:
        return causal, None
    return causal & (seg[..., :, None] == seg[..., None, :]), seg == seg[:, :, :1]


@dataclasses.dataclass(frozen=True)
class _Static:
    """mixed_chunk_attention's static settings (a custom_vjp nondiff argument)."""

    chunk: int
    quad_scale: float
    lin_scale: float
    kernel: kernels.GAUKernelConfig | None  # None: the XLA path


def _kernels_why_not(chunk: int, qk_dim: int, value_dim: int) -> str | None:
    reason = kernels.unsupported_reason(chunk, qk_dim, value_dim)
    return None if reason is None else f"the kernels cannot take these sizes: {reason}"


def _select(chunk: int, qk_dim: int, value_dim: int) -> str:
    """auto: the kernels on a GPU where they take the sizes, else the XLA path."""
    on_gpu = jax.default_backend() == "gpu"
    return "pallas" if on_gpu and _kernels_why_not(chunk, qk_dim, value_dim) is None else "blockwise"


MIXED_CHUNK = Registry(
    "mixed chunk attention",
    [
        Implementation("blockwise", "XLA, chunk by chunk (a scan over the chunks); any sizes and dtype; anywhere"),
        Implementation("pallas", "bpt.ops.kernels.gau: chunk, qk_dim and the value width's blocks powers of two; "
                       "GPUs (Triton), elsewhere interpret mode", why_not=_kernels_why_not),
    ],
    _select,
)  # fmt: skip
IMPLS = MIXED_CHUNK.names


def resolve_impl(impl: str, chunk: int, qk_dim: int, value_dim: int) -> str:
    """The path `impl` stands for: "blockwise" (XLA, chunk by chunk) or "pallas"
    (bpt.ops.kernels.gau). auto takes the kernels on a GPU where they take the sizes;
    pallas elsewhere runs them in interpret mode (tests)."""
    return MIXED_CHUNK.resolve(impl, chunk, qk_dim, value_dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mixed_chunks(static, quad_q, quad_k, lin_q, lin_k, v, bias, seg, initial_state):
    return _mixed_chunks_forward(static, quad_q, quad_k, lin_q, lin_k, v, bias, seg, initial_state)[0]


# The residuals the forward computes (the rest are its inputs): named, so that a remat policy
# can keep them and the backward never re-runs the forward (bpt.ops.remat: attention_saveable).
_COMPUTED = ("r", "x", "y", "st")


def _mixed_chunks_fwd(static, *args):
    out, _, residuals = _mixed_chunks_forward(static, *args)
    computed = [name for name in _COMPUTED if residuals.get(name) is not None]
    names = (ATTENTION_OUT,) + (ATTENTION_RESIDUAL,) * len(computed)
    out, *kept = kept_results((out, *(residuals[name] for name in computed)), names)
    return out, {**residuals, **dict(zip(computed, kept))}


def _flat(x: Array | None) -> Array | None:
    """[batch, chunks, ...] -> [batch * chunks, ...]: the kernels' one axis of chunks."""
    return None if x is None else x.reshape(-1, *x.shape[2:])


def _unchunk(x: Array) -> Array:
    return x.reshape(x.shape[0], -1, x.shape[-1])


def _mixed_chunks_forward(static: _Static, quad_q, quad_k, lin_q, lin_k, v, bias, seg, initial_state):
    """(out, the float32 states entering the chunks or None, residuals). out [batch, chunks,
    G, e] = relu^2 weights @ v + (lin_q * lin_scale) @ state, in the inputs' dtype with
    float32 accumulation. XLA: both parts as one matmul per chunk ([W | lq] @ [v ; state],
    K = G + s); Pallas: the states by one kernel (no segment ids; None is returned for the
    float32 states then), which writes [v ; state] whole for XLA's matmul, or the states
    alone for the quadratic kernel that keeps W in registers."""
    g, quad_scale, lin_scale, kernel = static.chunk, static.quad_scale, static.lin_scale, static.kernel
    dtype = v.dtype
    quadratic_kernel = kernel is not None and kernel.quadratic
    state = st = y = None
    if kernel is not None and seg is None:
        initial = None if initial_state is None else initial_state.astype(jnp.float32)
        written = kernels.states(
            kernel, _unchunk(lin_k), _unchunk(v), with_values=not quadratic_kernel, initial=initial
        )
        if quadratic_kernel:
            st = written
        else:
            y = written
    else:
        state = _states_entering_chunks(lin_k, v, seg)
        if initial_state is not None:
            state = state + _reached_by_initial(initial_state[:, None].astype(jnp.float32), seg)
        st = state.astype(dtype)
    res = dict(
        quad_q=quad_q, quad_k=quad_k, lin_k=lin_k, v=v, bias=bias, seg=seg, initial_state=initial_state
    )
    if quadratic_kernel:
        args = [_flat(x) for x in (quad_q, quad_k, lin_q, v, st)]
        out = kernels.forward(kernel, *args, bias, _flat(seg)).reshape(v.shape)
        return out, state, dict(res, lin_q=lin_q, st=st)
    mask, lin_mask = _chunk_masks(seg, g)
    scores = jnp.einsum("bcis,bcjs->bcij", quad_q, quad_k, preferred_element_type=jnp.float32) * quad_scale
    if bias is not None:
        scores = scores + bias.astype(jnp.float32)
    r = jnp.where(mask, jax.nn.relu(scores), 0.0)  # relu(z) where visible: d(r^2)/dz = 2 r there
    lq = lin_q * lin_scale
    if lin_mask is not None:
        lq = jnp.where(lin_mask[..., None], lq, 0)
    x = jnp.concatenate([jnp.square(r).astype(dtype), lq.astype(dtype)], axis=-1)  # [b, c, G, G + s]
    if y is None:
        y = jnp.concatenate([v, st], axis=-2)  # [b, c, G + s, e]
    out = jnp.einsum("bcik,bcke->bcie", x, y, preferred_element_type=jnp.float32).astype(dtype)
    return out, state, dict(res, v=None, r=r, x=x, y=y)  # v is in y


def _quadratic_grads_xla(static: _Static, res, d_out):
    """(d_quad_q, d_lin_q, d(scaled scores) in the inputs' dtype, x = [W | lq], [v ; states])
    by XLA. The last is returned whole: v alone would be a copy of its first G rows."""
    g, quad_scale, lin_scale = static.chunk, static.quad_scale, static.lin_scale
    quad_q, seg, r, x, y = res["quad_q"], res["seg"], res["r"], res["x"], res["y"]
    dx = jnp.einsum("bcie,bcke->bcik", d_out, y, preferred_element_type=jnp.float32)
    # The quadratic part: out += r^2 v, so d(scores) = 2 r dW (zero where masked: r is 0 there).
    d_scores = (2.0 * r * dx[..., :g]).astype(quad_q.dtype)
    d_quad_q = jnp.einsum("bcij,bcjs->bcis", d_scores, res["quad_k"], preferred_element_type=jnp.float32)
    # The linear part: out += (lin_q * lin_scale) state, masked to the chunk's first document.
    d_lin_q = dx[..., g:] * lin_scale
    if seg is not None:
        d_lin_q = jnp.where(_chunk_masks(seg, g)[1][..., None], d_lin_q, 0.0)
    return d_quad_q * quad_scale, d_lin_q, d_scores, x, y


def _quadratic_grads_pallas(static: _Static, res, d_out):
    quad_q, v = res["quad_q"], res["v"]
    args = [_flat(res[name]) for name in ("quad_q", "quad_k", "lin_q", "v", "st")]
    grads = kernels.backward(static.kernel, *args, _flat(d_out), res["bias"], _flat(res["seg"]))
    d_quad_q, d_lin_q, d_scores, x = (a.reshape(*quad_q.shape[:2], *a.shape[1:]) for a in grads)
    return d_quad_q, d_lin_q, d_scores, x, v


def _mixed_chunks_bwd(static: _Static, res, d_out):
    g, quad_scale, kernel = static.chunk, static.quad_scale, static.kernel
    quad_q, quad_k, lin_k, bias, seg = (res[n] for n in ("quad_q", "quad_k", "lin_k", "bias", "seg"))
    initial_state = res["initial_state"]
    quadratic_kernel = kernel is not None and kernel.quadratic
    dtype = (res["v"] if quadratic_kernel else res["y"]).dtype
    d_out = d_out.astype(dtype)
    grads = (_quadratic_grads_pallas if quadratic_kernel else _quadratic_grads_xla)(static, res, d_out)
    d_quad_q, d_lin_q, d_scores, x, values = grads  # values: v, or [v ; states] (rows past G)
    d_quad_k = (
        jnp.einsum("bcij,bcis->bcjs", d_scores, quad_q, preferred_element_type=jnp.float32) * quad_scale
    )
    d_bias = None if bias is None else d_scores.astype(jnp.float32).sum((0, 1)).astype(bias.dtype)
    if kernel is not None and seg is None:
        # dv as one matmul: d_state = lq^T d_out first, then the later chunks' sums of it by a
        # kernel that also writes [d_out ; sums] whole, and dv = [W^T | lin_k] [d_out ; sums]
        # (K = G + s) in the inputs' dtype with float32 accumulation, where the XLA path below
        # adds a float32 [seq, e] term to a slice of [dv ; d_state]
        d_state = jnp.einsum("bcis,bcie->bcse", x[..., g:], d_out, preferred_element_type=jnp.float32)
        later, joined = kernels.later_sums(kernel, d_state.astype(dtype), _unchunk(d_out))
        left = jnp.concatenate([jnp.swapaxes(x[..., :g], -1, -2), lin_k.astype(dtype)], axis=-1)
        d_v = jnp.einsum("bcjk,bcke->bcje", left, joined, preferred_element_type=jnp.float32)
        # over every row of [v ; states] and the first G kept: cheaper than copying v out of it
        d_lin_k = jnp.einsum("bcje,bcse->bcjs", values, later, preferred_element_type=jnp.float32)[:, :, :g]
    else:
        # [dv ; d_state] = x^T d_out: [b, c, G + s, e] in the inputs' dtype (the widest
        # tensor here; float32 doubled its traffic)
        dy = jnp.einsum("bcik,bcie->bcke", x, d_out, preferred_element_type=jnp.float32).astype(dtype)
        d_state = dy[:, :, g:]  # [b, c, s, e]
        d_lin_k, d_v_lin = _states_vjp(lin_k, values[:, :, :g], seg, d_state.astype(jnp.float32))
        d_v = dy[:, :, :g].astype(jnp.float32) + d_v_lin
    d_init = None
    if initial_state is not None:
        d_init = _reached_by_initial(d_state.astype(jnp.float32), seg).sum(1).astype(initial_state.dtype)
    return (
        d_quad_q.astype(quad_q.dtype),
        d_quad_k.astype(quad_k.dtype),
        d_lin_q.astype(quad_q.dtype),
        d_lin_k.astype(lin_k.dtype),
        d_v.astype(dtype),
        d_bias,
        None,
        d_init,
    )


def _states_vjp(lin_k: Array, v: Array, seg: Array | None, d_state: Array) -> tuple[Array, Array]:
    """The gradients of _states_entering_chunks ([b, c, G, .] float32) from d_state [b, c, s,
    e] float32. Without segment ids each chunk's k v^T sum reaches every later chunk, so its
    gradient is the sum of the later chunks' d_state (a reverse cumsum), and the two matmuls
    back to lin_k and v run in the inputs' dtype."""
    if seg is not None:  # documents restart the state: autodiff through the associative scan
        _, vjp = jax.vjp(lambda k, w: _states_entering_chunks(k, w, seg), lin_k, v)
        return tuple(d.astype(jnp.float32) for d in vjp(d_state))
    d_sums = exclusive_chunk_sum(d_state, reverse=True).astype(v.dtype)  # chunks after c see c's sum
    d_k = jnp.einsum("bcje,bcse->bcjs", v, d_sums, preferred_element_type=jnp.float32)
    d_v = jnp.einsum("bcjs,bcse->bcje", lin_k, d_sums, preferred_element_type=jnp.float32)
    return d_k, d_v


_mixed_chunks.defvjp(_mixed_chunks_fwd, _mixed_chunks_bwd)


def mixed_chunk_attention(
    quad_q: Array,
    quad_k: Array,
    lin_q: Array,
    lin_k: Array,
    v: Array,
    *,
    chunk_size: int,
    quad_scale: float,
    lin_scale: float,
    bias: Array | None = None,
    segment_ids: Array | None = None,
    initial_state: Array | None = None,
    initial_count: Array | int | None = None,
    linear_norm: str = "sum",
    return_states: bool = False,
    impl: str = "blockwise",
    kernel_options: dict | None = None,
) -> Array | tuple[Array, Array]:
    """Causal mixed chunk attention, chunk by chunk: [G, G] scores per chunk and one running
    [s, e] sum, never [seq, seq]. seq must be a multiple of chunk_size; bias [G, G] is the
    quadratic part's relative bias inside a chunk (chunks start at multiples of G, so it is
    the same for all). initial_state [batch, s, e]: the linear sum of the tokens before this
    sequence (decoding a prompt's later part, or the tokens on earlier devices:
    bpt.parallel.gau); with segment ids those tokens belong to the document the sequence
    starts in, so only the chunks that start in it take the sum. return_states: also the
    float32 linear sum entering each chunk, [batch, chunks, s, e] (what decoding keeps).

    linear_norm: "sum" (the running sum times lin_scale) or "mean" (the paper's Code 8: the
    sum divided by the number of earlier chunks it holds, chunks_entering; with lin_scale
    1/chunk_size each chunk's lin_k^T v is averaged). With "mean", initial_count [batch] is
    how many chunks initial_state sums over.

    impl: "blockwise" (XLA), "pallas" (bpt.ops.kernels.gau: Triton on GPUs, interpret mode
    elsewhere; kernel_options: fields of its GAUKernelConfig, the blocks and the Triton
    settings) or "auto" (pallas on a GPU where the kernels take the sizes). With segment ids
    the linear states are XLA's in both.

    Its backward is written out (custom_vjp): every matmul takes the inputs' dtype with
    float32 accumulation, the forward's two parts are one matmul (or one kernel), and the
    linear part's gradient runs back over the chunks as a reverse cumulative sum in float32."""
    b, t, _ = quad_q.shape
    if t % chunk_size:
        raise ValueError(f"the sequence ({t} tokens) must be a multiple of chunk_size={chunk_size}")
    c, g = t // chunk_size, chunk_size
    chunks = lambda x: x.reshape(b, c, g, x.shape[-1])  # noqa: E731
    seg = None if segment_ids is None else segment_ids.reshape(b, c, g)
    lin_q = chunks(lin_q)
    if check_linear_norm(linear_norm) == "mean":
        if initial_state is not None and initial_count is None:
            raise ValueError("linear_norm='mean' with an initial_state needs initial_count: the chunks it sums")
        # The mean as a per-chunk scale of the linear queries: the states stay sums, and the
        # backward (and the kernels) see scaled queries.
        counts = chunks_entering(seg, b, c, None if initial_state is None else initial_count)
        inverse = (1.0 / jnp.maximum(counts, 1.0))[..., None, None]
        lin_q = (lin_q.astype(jnp.float32) * inverse).astype(lin_q.dtype)
    e = v.shape[-1]
    kernel = None
    if resolve_impl(impl, g, quad_q.shape[-1], e) == "pallas" and not return_states:
        kernel = kernels.config_for(
            v.dtype,
            batch=b,
            chunk=g,
            value_dim=e,
            quad_scale=float(quad_scale),
            lin_scale=float(lin_scale),
            **(kernel_options or {}),
        )
    static = _Static(g, float(quad_scale), float(lin_scale), kernel)
    args = (chunks(quad_q), chunks(quad_k), lin_q, chunks(lin_k), chunks(v), bias, seg, initial_state)
    if return_states:  # decoding: the states are an output too (autodiff would go through them)
        out, state, _ = _mixed_chunks_forward(static, *args)
    else:
        out, state = _mixed_chunks(static, *args), None
    out = out.reshape(b, t, v.shape[-1])
    return (out, state) if return_states else out
