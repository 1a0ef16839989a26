"""One entry point for attention: attention(q, k, v, *, impl=..., causal=..., segment_ids=...).

| impl        | memory      | where                    | takes segment_ids |
|-------------|-------------|--------------------------|-------------------|
| reference   | O(seq^2)    | anywhere                 | yes               |
| blockwise   | O(seq)      | anywhere                 | yes               |
| cudnn       | O(seq)      | NVIDIA GPU, bf16/fp16    | no                |
| pallas      | O(seq)      | NVIDIA GPU (Mosaic GPU kernels on H100-class GPUs where they
|             |             | take the inputs, else Triton); elsewhere interpret mode (tests) | yes |
| auto        | on an H100-class GPU, pallas for causal bf16/fp16 inputs that the Mosaic GPU
|             | kernels take, up to 4K tokens and batch x heads x seq^2 no more than one
|             | 4K sequence of 16 heads has (measured faster than cuDNN there; slower at
|             | 8K and up, and at batch 8 of 2K); on a GPU otherwise cudnn where it supports
|             | the inputs, else pallas for bf16/fp16; off the GPU blockwise (reference
|             | when one chunk covers it) |
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bpt.ops.blockwise import blockwise_attention
from bpt.ops.kernels import attention_hopper
from bpt.ops.kernels.attention import flash_attention
from bpt.ops.reference import SegmentIds, check_qkv, reference_attention

Array = jax.Array
# bpt's Hopper kernels against cuDNN (causal, d=128, batch 1, 16 heads, H100), forward+
# backward: 1.5x at 2K, 1.17x at 4K, 1.06x at 8K, 0.98-1.00x from 16K to 64K, and 0.68x at
# batch 8 of 2K, where cuDNN's fixed cost per call is spread over more work
# (docs/notes/attention_kernels.md). A larger SMALL would also take that batched shape.
SHORT = 4096  # tokens
SMALL = 16 * 4096**2  # batch x heads x seq^2 (query-key pairs, counting both triangles)
# pallas_fp8: bpt's Triton forward with its matmuls in float8_e4m3fn (flash_attention's
# fp8=True), chosen by name only: auto never picks it.
IMPLS = ("reference", "blockwise", "cudnn", "pallas", "pallas_fp8", "auto")
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def check_impl(impl: str, setting: str = "impl") -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown attention {setting} {impl!r}; allowed: {', '.join(IMPLS)}")
    return impl


def cudnn_unsupported_reason(q: Array, k: Array, *, causal: bool, segment_ids: SegmentIds) -> str | None:
    """Why cuDNN's fused attention (through jax.nn) cannot take these inputs, or None."""
    if jax.default_backend() != "gpu":
        return f"it needs an NVIDIA GPU and this process runs on {jax.default_backend()!r}"
    if segment_ids is not None:
        return "jax.nn.dot_product_attention takes no segment ids (packed documents)"
    if q.dtype not in _CUDNN_DTYPES:
        return f"it takes bfloat16 or float16 inputs, not {q.dtype}"
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        return f"head_dim must be a multiple of 8 and at most 256, not {q.shape[-1]}"
    if causal and q.shape[1] != k.shape[1]:
        return "causal attention with different query and key lengths is aligned differently"
    return None


def select_impl(
    q: Array, k: Array, *, causal: bool, segment_ids: SegmentIds, q_chunk_size: int, kv_chunk_size: int
) -> str:
    """The implementation impl='auto' runs for these inputs on this platform."""
    if (
        causal
        and k.shape[1] <= SHORT
        and q.shape[0] * q.shape[2] * q.shape[1] * k.shape[1] <= SMALL
        and attention_hopper.is_hopper()
        and attention_hopper.supported(q, k, segment_ids=segment_ids) is None
    ):
        return "pallas"
    if cudnn_unsupported_reason(q, k, causal=causal, segment_ids=segment_ids) is None:
        return "cudnn"
    if (
        jax.default_backend() == "gpu"
        and q.dtype in _CUDNN_DTYPES
        and not (causal and q.shape[1] != k.shape[1])
    ):
        return "pallas"  # segment ids, or a head_dim cuDNN does not take (fp32: not measured yet)
    if q.shape[1] <= q_chunk_size and k.shape[1] <= kv_chunk_size:
        return "reference"  # one block: the blockwise loop would compute the same thing
    return "blockwise"


def attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    impl: str = "auto",
    causal: bool = False,
    segment_ids: SegmentIds = None,
    q_chunk_size: int = 512,
    kv_chunk_size: int = 512,
) -> Array:
    """Softmax attention on [batch, seq, heads, head_dim] inputs by the chosen implementation.

    Every implementation computes the same function (see bpt.ops.reference_attention); the
    chunk sizes are used by the blockwise implementation and ignored by the others (the
    Pallas kernel picks its own blocks).
    """
    check_impl(impl)
    check_qkv(q, k, v)
    if impl == "auto":
        impl = select_impl(
            q,
            k,
            causal=causal,
            segment_ids=segment_ids,
            q_chunk_size=q_chunk_size,
            kv_chunk_size=kv_chunk_size,
        )
    if impl == "reference":
        return reference_attention(q, k, v, causal=causal, segment_ids=segment_ids)
    if impl == "blockwise":
        return blockwise_attention(
            q,
            k,
            v,
            causal=causal,
            segment_ids=segment_ids,
            q_chunk_size=q_chunk_size,
            kv_chunk_size=kv_chunk_size,
        )
    if impl in ("pallas", "pallas_fp8"):
        return flash_attention(q, k, v, causal=causal, segment_ids=segment_ids, fp8=impl == "pallas_fp8")
    reason = cudnn_unsupported_reason(q, k, causal=causal, segment_ids=segment_ids)
    if reason is not None:
        raise ValueError(
            f"impl='cudnn' cannot run here: {reason}; use impl auto, pallas or blockwise"
        )
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
