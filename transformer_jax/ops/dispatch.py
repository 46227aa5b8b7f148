"""cuDNN attention (through jax.nn.dot_product_attention) and `auto`, which picks an implementation per call.

Axis legend: B batch, T query length, S key/value length, N query heads, K key/value heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformer_jax.ops import pallas_attention
from transformer_jax.ops.attention import IMPLEMENTATIONS, Array, _check_shapes, register

# On CPU, blockwise beats the reference from about 1k tokens per side (benchmarks/attention.py: at 1k, 1 head,
# 2-4x faster forward and 2-3x fwd+bwd; at 512 tokens x 32 (batch, head) pairs they are even), and past
# CPU_BLOCKWISE_MIN_BYTES of float32 scores the reference's [B, N, T, S] matrices stop fitting anyway.
CPU_BLOCKWISE_MIN_SCORES = 1024 * 1024
CPU_BLOCKWISE_MIN_BYTES = 1 << 30


def cudnn_unsupported(
    q: Array,
    k: Array,
    v: Array,
    *,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    causal: bool = False,
    q_positions: Array | None = None,
    kv_positions: Array | None = None,
    window: int | None = None,
    backend: str | None = None,
) -> list[str]:
    """Reasons why impl='cudnn' cannot compute this call exactly as attention.py specifies (empty if it can)."""
    backend = jax.default_backend() if backend is None else backend
    reasons = []
    if backend != "gpu":
        reasons.append(f"needs a CUDA GPU with cuDNN (this backend is {backend!r})")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (jnp.bfloat16, jnp.float16):
        reasons.append(f"needs q, k, v all bfloat16 or all float16 (got {q.dtype}, {k.dtype}, {v.dtype})")
    if v.shape[-1] != q.shape[-1]:
        reasons.append(f"needs the value head dim to equal the query/key head dim ({v.shape[-1]} != {q.shape[-1]})")
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        reasons.append(f"needs a head dim that is a multiple of 8 and <= 256 (got {q.shape[-1]})")
    if q_segment_ids is not None or kv_segment_ids is not None:
        reasons.append("does not support segment ids (packing or padding)")
    if q_positions is not None or kv_positions is not None:
        reasons.append("does not support explicit positions")
    if window is not None:
        reasons.append("does not support a sliding window")
    if causal and q.shape[1] != k.shape[1]:
        # cuDNN aligns the causal diagonal to the first key; attention.py aligns queries to the end of the keys.
        reasons.append(f"does not support causal masking with query length {q.shape[1]} != key length {k.shape[1]}")
    return reasons


@register("cudnn")
def cudnn_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    causal: bool = False,
    q_positions: Array | None = None,
    kv_positions: Array | None = None,
    window: int | None = None,
    scale: float | None = None,
) -> Array:
    """cuDNN's fused flash attention; grouped heads and T == S causal, nothing else. Fails loudly otherwise."""
    _check_shapes(q, k, v)
    reasons = cudnn_unsupported(
        q,
        k,
        v,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        causal=causal,
        q_positions=q_positions,
        kv_positions=kv_positions,
        window=window,
    )
    if reasons:
        raise ValueError(
            "attention impl 'cudnn' " + "; ".join(reasons) + ". Use impl='pallas' (GPU), 'blockwise' or 'auto'."
        )
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation="cudnn")


def choose_impl(
    q: Array,
    k: Array,
    v: Array,
    *,
    backend: str | None = None,
    **mask_kwargs: Array | bool | int | None,
) -> str:
    """The implementation `auto` runs: cuDNN, else our Pallas kernels on GPU; xla or blockwise by size elsewhere."""
    backend = jax.default_backend() if backend is None else backend
    batch, q_len, num_heads, head_dim = q.shape
    kv_len = k.shape[1]
    if backend == "gpu":
        if not cudnn_unsupported(q, k, v, backend=backend, **mask_kwargs):
            return "cudnn"
        pallas_ok = (
            q.dtype == k.dtype == v.dtype
            and q.dtype in pallas_attention.SUPPORTED_DTYPES
            and max(head_dim, v.shape[-1]) <= pallas_attention.MAX_HEAD_DIM
        )
        if pallas_ok:
            return "pallas"
    scores = q_len * kv_len
    if scores >= CPU_BLOCKWISE_MIN_SCORES or 4 * batch * num_heads * scores >= CPU_BLOCKWISE_MIN_BYTES:
        return "blockwise"
    return "xla"


@register("auto")
def auto_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    causal: bool = False,
    q_positions: Array | None = None,
    kv_positions: Array | None = None,
    window: int | None = None,
    **kwargs,
) -> Array:
    """Runs choose_impl(...)'s implementation; extra kwargs (e.g. scale) are passed through."""
    mask_kwargs = dict(
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        causal=causal,
        q_positions=q_positions,
        kv_positions=kv_positions,
        window=window,
    )
    impl = choose_impl(q, k, v, **mask_kwargs)
    return IMPLEMENTATIONS[impl](q, k, v, **mask_kwargs, **kwargs)
