"""Shared by the ahead-of-time compile tests (test_aot_tpu, test_aot_gpu): our attention's forward+backward
compiled for one chip of a topology this host does not have, and the check that its temporaries grow linearly in
the sequence length. Figures from memory_analysis() are the compiler's estimates, not measurements.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformer_jax import runtime
from transformer_jax.ops import attention

BATCH, HEADS = 1, 8

# Temporaries per token and head the compiled fwd+bwd may keep: O(T), no [T, S] buffer. What it keeps on TPU is
# ~2 KiB at 32k-64k (heads-first copies of q, k, v, dO, dQ, dK, dV, and the lse/delta columns [T, 1] that HBM pads
# to 128 lanes); one float32 score row alone would be 4 S bytes (8 KiB at 2k, 128 KiB at 32k).
TEMP_BYTES_PER_TOKEN_AND_HEAD = 4096


def compile_attention(device: jax.Device, length: int, head_dim: int, mask: str) -> jax.stages.Compiled:
    """jit(grad(sum(attention impl=pallas))) for `device`: T = S = length, bf16, causal or packed rows."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    qkv = jax.ShapeDtypeStruct((BATCH, length, HEADS, head_dim), jnp.bfloat16, sharding=sharding)
    seg = jax.ShapeDtypeStruct((BATCH, length), jnp.int32, sharding=sharding)

    def loss(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array) -> jax.Array:
        kw = dict(causal=True) if mask == "causal" else dict(q_segment_ids=seg, kv_segment_ids=seg)
        return jnp.sum(attention(q, k, v, impl="pallas", **kw).astype(jnp.float32))

    with runtime.compiling_for(device.platform):
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(qkv, qkv, qkv, seg).lower().compile()


def assert_linear_in_length(compiled: jax.stages.Compiled, length: int) -> None:
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= TEMP_BYTES_PER_TOKEN_AND_HEAD * BATCH * HEADS * length, temp
