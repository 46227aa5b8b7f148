"""Attention functions: one signature, several implementations, chosen by name; one mask (attention.AttentionMask).

Here: cuDNN attention (through jax.nn.dot_product_attention) and `auto`, which picks an implementation per call.
The modules imported below register the others: xla (attention.py), blockwise and linear (blockwise.py), and pallas
(pallas_gpu, our Triton kernels, which hands calls traced for TPU to pallas_tpu's Mosaic kernels).

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformer_jax import runtime
from transformer_jax.ops import blockwise, pallas_gpu, pallas_tpu
from transformer_jax.ops.attention import IMPLEMENTATIONS, Array, AttentionMask, attention, attention_mask, register

__all__ = [
    "IMPLEMENTATIONS",
    "AttentionMask",
    "attention",
    "attention_mask",
    "blockwise",
    "choose_impl",
    "cudnn_unsupported",
    "pallas_gpu",
    "pallas_tpu",
    "register",
]

# On CPU, blockwise beats the reference from about 1k tokens per side (benchmarks/attention.py measures where;
# docs/benchmarks.md has the numbers), and past
# CPU_BLOCKWISE_MIN_BYTES of float32 scores the reference's [B, N, T, S] matrices stop fitting anyway.
CPU_BLOCKWISE_MIN_SCORES = 1024 * 1024
CPU_BLOCKWISE_MIN_BYTES = 1 << 30
# On TPU our Pallas kernels are expected to win once each side fills a default 512-tile (a shorter side leaves
# the grid one tile wide, where XLA's fused softmax does the same work); not yet measured on a TPU.
TPU_PALLAS_MIN_LEN = 512


def cudnn_unsupported(q: Array, k: Array, v: Array, mask: AttentionMask, *, backend: str | None = None) -> list[str]:
    """Reasons why impl='cudnn' cannot compute this call exactly as ops/attention.py specifies (empty if it can)."""
    backend = runtime.target_backend() if backend is None else backend
    reasons = []
    if backend != "gpu":
        reasons.append(f"needs a CUDA GPU with cuDNN (this backend is {backend!r})")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (jnp.bfloat16, jnp.float16):
        reasons.append(f"needs q, k, v all bfloat16 or all float16 (got {q.dtype}, {k.dtype}, {v.dtype})")
    if v.shape[-1] != q.shape[-1]:
        reasons.append(f"needs the value head dim to equal the query/key head dim ({v.shape[-1]} != {q.shape[-1]})")
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        reasons.append(f"needs a head dim that is a multiple of 8 and <= 256 (got {q.shape[-1]})")
    if mask.segments:
        reasons.append("does not support segment ids (packing or padding)")
    if mask.explicit_positions:
        reasons.append("does not support explicit positions")
    if mask.window is not None:
        reasons.append("does not support a sliding window")
    if mask.causal and q.shape[1] != k.shape[1]:
        # cuDNN aligns the causal diagonal to the first key; ops/attention.py aligns queries to the end of the keys.
        reasons.append(f"does not support causal masking with query length {q.shape[1]} != key length {k.shape[1]}")
    return reasons


@register("cudnn")
def cudnn_attention(q: Array, k: Array, v: Array, mask: AttentionMask, *, scale: float | None = None) -> Array:
    """cuDNN's fused flash attention; grouped heads and T == S causal, nothing else. Fails loudly otherwise."""
    reasons = cudnn_unsupported(q, k, v, mask)
    if reasons:
        raise ValueError(
            "attention impl 'cudnn' " + "; ".join(reasons) + ". Use impl='pallas' (GPU), 'blockwise' or 'auto'."
        )
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=mask.causal, implementation="cudnn")


def choose_impl(q: Array, k: Array, v: Array, mask: AttentionMask, *, backend: str | None = None) -> str:
    """The implementation `auto` runs: cuDNN, else our Pallas kernels on GPU; on TPU our Pallas kernels for long
    sequences (traced on one device or under a mesh, which their shard_map needs); xla or blockwise by size
    elsewhere."""
    backend = runtime.target_backend() if backend is None else backend
    batch, q_len, num_heads, head_dim = q.shape
    kv_len = k.shape[1]
    if backend == "tpu" and min(q_len, kv_len) >= TPU_PALLAS_MIN_LEN:
        one_device_or_mesh = jax.device_count() == 1 or not jax.sharding.get_abstract_mesh().empty
        if one_device_or_mesh and not pallas_tpu.unsupported(q, k, v):
            return "pallas"
    if backend == "gpu":
        if not cudnn_unsupported(q, k, v, mask, backend=backend):
            return "cudnn"
        pallas_ok = (
            q.dtype == k.dtype == v.dtype
            and q.dtype in pallas_gpu.SUPPORTED_DTYPES
            and max(head_dim, v.shape[-1]) <= pallas_gpu.MAX_HEAD_DIM
        )
        if pallas_ok:
            return "pallas"
    scores = q_len * kv_len
    if scores >= CPU_BLOCKWISE_MIN_SCORES or 4 * batch * num_heads * scores >= CPU_BLOCKWISE_MIN_BYTES:
        return "blockwise"
    return "xla"


@register("auto")
def auto_attention(q: Array, k: Array, v: Array, mask: AttentionMask, **options) -> Array:
    """Runs choose_impl(...)'s implementation; options (e.g. scale) are passed through."""
    return IMPLEMENTATIONS[choose_impl(q, k, v, mask)](q, k, v, mask, **options)
