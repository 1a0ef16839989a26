"""FlashAttention forward for Hopper GPUs, in Pallas Mosaic GPU (wgmma, TMA, warp specialization).

One CTA holds three warpgroups. Two compute warpgroups each own `block_q` query rows of a
2 * block_q tile; the third only moves data: it streams key/value blocks from HBM into a ring
of `stages` shared-memory slots with TMA, and reuses a slot once both compute warpgroups have
released it. The compute warpgroups run S = Q K^T and O += P V on the tensor cores (wgmma,
float32 accumulators; P is fed from registers) and keep the online softmax in base 2 with the
1/sqrt(d) scale folded into one multiply. Causal: a warpgroup visits only the key blocks at or
below its rows and masks only the blocks the diagonal crosses; the lower warpgroup, which
needs fewer blocks, still releases the slots it skips so the ring keeps turning.

Outputs: O in q's dtype and the logsumexp in natural units, [batch, heads, seq] float32, the
same contract as the Triton kernels in flash.py, whose backward consumes them.

Limits (the caller falls back to the Triton kernels otherwise): bfloat16/float16, head_dim a
multiple of 64 up to 256, no segment ids, the query length a multiple of 2 * block_q and the
key length a multiple of block_k. Off the GPU the kernel runs under Mosaic GPU's interpreter
(slow; for tests).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

Array = jax.Array
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
COMPUTE_WGS = 2  # compute warpgroups per CTA; one more moves data


def supported(q: Array, k: Array, *, block_q: int, block_k: int, segment_ids=None) -> str | None:
    """None when the Hopper kernel can take these inputs, else the reason it cannot."""
    d = q.shape[-1]
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype:
        return f"dtype {q.dtype} (needs bfloat16 or float16)"
    if d % 64 or d > 256:
        return f"head_dim {d} (needs a multiple of 64, at most 256)"
    if segment_ids is not None:
        return "segment ids"
    if q.shape[1] % (COMPUTE_WGS * block_q) or k.shape[1] % block_k:
        return f"lengths {q.shape[1]}, {k.shape[1]} (need multiples of {COMPUTE_WGS * block_q}, {block_k})"
    return None


def is_hopper() -> bool:
    """True on a GPU with wgmma (compute capability 9.x)."""
    if jax.default_backend() != "gpu":
        return False
    return getattr(jax.devices()[0], "compute_capability", "") in ("9.0", "9.0a")


def interpret_params():
    """Parameters for Mosaic GPU's interpreter, which runs these kernels on a CPU."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # internal in jax 0.10/0.11

    return InterpretGPUParams()


def _scores(q_ref, k_ref, interpret: bool) -> Array:
    """q @ k^T, float32, on the tensor cores (both operands in shared memory)."""
    if interpret:  # the interpreter takes no transposed refs
        return lax.dot_general(
            q_ref[...], k_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )

    def mma(s_ref):
        plgpu.wgmma(s_ref, q_ref, k_ref.transpose((1, 0)))
        return s_ref[...]

    return pl.run_scoped(mma, plgpu.ACC((q_ref.shape[0], k_ref.shape[0]), jnp.float32))


def _accumulate(acc: Array, p: Array, v_ref, interpret: bool) -> Array:
    """acc + p @ v on the tensor cores, in place in acc's registers (p from registers)."""
    if interpret:  # the interpreter has no run_state
        return acc + jnp.dot(p, v_ref[...], preferred_element_type=jnp.float32)
    return pl.run_state(lambda ref: plgpu.wgmma(ref, p, v_ref))(plgpu.ACC.init(acc))


def _consumer(cfg: dict, refs, wg):
    q_ref, o_ref, lse_ref, q_smem, k_smem, v_smem, lse_smem, q_ready, k_ready, v_ready, k_free, v_free = refs
    bq, bk, stages, d, dtype = cfg["block_q"], cfg["block_k"], cfg["stages"], cfg["d"], cfg["dtype"]
    causal, all_steps = cfg["causal"], cfg["all_steps"]
    plgpu.set_max_registers(232, action="increase")
    b, head = lax.axis_index("batch"), lax.axis_index("heads")
    row0 = cfg["tile"] * (COMPUTE_WGS * bq) + wg * bq
    my_q, my_lse = q_smem.at[wg], lse_smem.at[wg]
    plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, bq), head], my_q, q_ready.at[wg])
    plgpu.barrier_wait(q_ready.at[wg])

    # Registers laid out as the wgmma accumulator (the interpreter has no layouts).
    wgmma = plgpu.Layout.WGMMA
    layout = (lambda x, _: x) if cfg["interpret"] else plgpu.layout_cast
    m = layout(jnp.full((bq,), -jnp.inf, jnp.float32), wgmma.reduce(1))
    denom = layout(jnp.zeros((bq,), jnp.float32), wgmma.reduce(1))
    acc = layout(jnp.zeros((bq, d), jnp.float32), wgmma)
    if cfg["interpret"]:
        iota = lambda dim: lax.broadcasted_iota(jnp.int32, (bq, bk), dim)  # noqa: E731
    else:
        iota = lambda dim: plgpu.broadcasted_iota(jnp.int32, (bq, bk), dim, layout=wgmma)  # noqa: E731
    c = cfg["scale"] * LOG2E

    def step(j, carry, masked: bool):
        acc, m, denom = carry
        slot = lax.rem(j, stages)
        plgpu.barrier_wait(k_ready.at[slot])
        s = _scores(my_q, k_smem.at[slot], cfg["interpret"]) * c
        plgpu.barrier_arrive(k_free.at[slot])
        if masked:
            s = jnp.where(iota(0) + row0 >= iota(1) + j * bk, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        denom = denom * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        p = p.astype(dtype)
        plgpu.barrier_wait(v_ready.at[slot])
        acc = _accumulate(acc, p, v_smem.at[slot], cfg["interpret"])
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, denom

    carry = (acc, m, denom)
    if causal:
        steps = pl.cdiv(row0 + bq, bk)  # key blocks this warpgroup's rows can see
        clear = row0 // bk  # ... of which the first `clear` need no mask
        carry = lax.fori_loop(0, clear, functools.partial(step, masked=False), carry)
        carry = lax.fori_loop(clear, steps, functools.partial(step, masked=True), carry)

        @pl.loop(steps, all_steps)
        def _release(j):  # blocks loaded for the other warpgroup: wait for each, then free it
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
    else:
        carry = lax.fori_loop(0, all_steps, functools.partial(step, masked=False), carry)
    acc, m, denom = carry

    my_q[...] = (acc * lax.broadcast_in_dim(1.0 / denom, acc.shape, [0])).astype(dtype)
    my_lse[...] = (m + jnp.log2(denom)) * LN2
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(my_q, o_ref.at[b, pl.ds(row0, bq), head])
    plgpu.copy_smem_to_gmem(my_lse, lse_ref.at[b, head, pl.ds(row0, bq)])
    plgpu.wait_smem_to_gmem(0)


def _producer(cfg: dict, refs):
    k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, k_free, v_free = refs
    bk, stages, all_steps = cfg["block_k"], cfg["stages"], cfg["all_steps"]
    plgpu.set_max_registers(40, action="decrease")
    b, kv_head = lax.axis_index("batch"), lax.axis_index("heads") // cfg["group"]

    def load(j, slot):
        rows = (b, pl.ds(j * bk, bk), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

    for j in range(stages):  # fill the ring

        @pl.when(j < all_steps)
        def _fill():
            load(j, j)

    @pl.loop(stages, all_steps)
    def _stream(j):
        slot = lax.rem(j, stages)
        plgpu.barrier_wait(k_free.at[slot])
        plgpu.barrier_wait(v_free.at[slot])
        load(j, slot)

    @pl.loop(jnp.maximum(all_steps - stages, 0), all_steps)
    def _drain(j):  # see the last blocks released, so every barrier phase is observed
        slot = lax.rem(j, stages)
        plgpu.barrier_wait(k_free.at[slot])
        plgpu.barrier_wait(v_free.at[slot])


def forward(
    q: Array,
    k: Array,
    v: Array,
    *,
    causal: bool,
    scale: float,
    block_q: int = 64,
    block_k: int = 128,
    stages: int = 2,
    interpret: bool = False,
) -> tuple[Array, Array]:
    """(out [b, s, h, d], logsumexp [b, h, s] float32); see supported() for what it takes."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    reason = supported(q, k, block_q=block_q, block_k=block_k)
    if reason:
        raise ValueError(f"the Hopper flash kernel cannot take {reason}")
    if causal and sq != sk:
        raise ValueError(f"causal attention needs equal query and key lengths; got {sq} and {sk}")
    tile_rows = COMPUTE_WGS * block_q
    num_tiles, num_k = sq // tile_rows, sk // block_k
    stages = max(1, min(stages, num_k))
    smem = functools.partial(
        plgpu.SMEM, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    )

    def body(q_ref, k_ref, v_ref, o_ref, lse_ref):
        # The heaviest causal tiles (the last rows) start first.
        tile = num_tiles - 1 - lax.axis_index("q_tiles") if causal else lax.axis_index("q_tiles")
        cfg = dict(
            block_q=block_q,
            block_k=block_k,
            stages=stages,
            d=d,
            dtype=q.dtype,
            causal=causal,
            scale=scale,
            group=h // hk,
            tile=tile,
            interpret=interpret,
            all_steps=pl.cdiv((tile + 1) * tile_rows, block_k) if causal else num_k,
        )

        def scoped(q_smem, k_smem, v_smem, lse_smem, q_ready, k_ready, v_ready, k_free, v_free):
            wg = lax.axis_index("wg")

            @pl.when(wg < COMPUTE_WGS)
            def _compute():
                _consumer(
                    cfg,
                    (q_ref, o_ref, lse_ref, q_smem, k_smem, v_smem, lse_smem)
                    + (q_ready, k_ready, v_ready, k_free, v_free),
                    wg,
                )

            @pl.when(wg == COMPUTE_WGS)
            def _memory():
                _producer(cfg, (k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, k_free, v_free))

        pl.run_scoped(
            scoped,
            smem((COMPUTE_WGS, block_q, d), q.dtype),
            smem((stages, block_k, d), q.dtype),
            smem((stages, block_k, d), q.dtype),
            plgpu.SMEM((COMPUTE_WGS, block_q), jnp.float32),
            plgpu.Barrier(num_barriers=COMPUTE_WGS),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
            collective_axes="wg",
        )

    return plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, sq), jnp.float32)),
        grid=(num_tiles, h, b),
        grid_names=("q_tiles", "heads", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params() if interpret else None,
    )(q, k, v)
