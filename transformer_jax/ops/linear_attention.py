"""Kernelised linear attention (Katharopoulos et al., 2020): softmax(q.k) replaced by phi(q).phi(k).

    out_t = phi(q_t)^T sum_s phi(k_s) v_s^T / phi(q_t)^T sum_s phi(k_s),   phi(x) = elu(x) + 1

The sums run over the keys a query may see. AttentionMask.key_ranges gives those as a run [first, end) of key
indices, so each sum is a difference of two prefix sums: O(S H E) memory instead of the O(T S) score matrix, for
packed rows, padding, causal self-attention and decoding with a cache alike. That needs each row's keys in
(segment id, position) order (AttentionMask.key_ranges says exactly what), which packed batches and the decoding
cache are. Sliding windows are refused (a clear error).

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformer_jax.ops.attention import register
from transformer_jax.ops.masks import AttentionMask, is_real

Array = jax.Array


def feature_map(x: Array) -> Array:
    """phi(x) = elu(x) + 1 > 0, the feature map of Katharopoulos et al."""
    return jax.nn.elu(x) + 1.0


def _run_sums(prefix_BS: Array, first_BT: Array, end_BT: Array) -> Array:
    """sum over s in [first, end) from the prefix sums [B, S + 1, ...] (prefix[s] = sum of rows before s)."""

    def at(index_BT: Array) -> Array:
        index = index_BT.reshape(*index_BT.shape, *([1] * (prefix_BS.ndim - 2)))
        return jnp.take_along_axis(prefix_BS, index, axis=1)

    return at(end_BT) - at(first_BT)


@register("linear", softmax=False)
def linear_attention(q: Array, k: Array, v: Array, mask: AttentionMask) -> Array:
    """Linear attention over the keys of AttentionMask.key_ranges; a query that sees no key returns zeros."""
    if mask.window is not None:
        raise ValueError("attention impl 'linear' does not support a sliding window; set attention.window=0")
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    groups = num_heads // num_kv_heads
    q, k, v = mask.zero_padding_tokens(q, k, v)
    phi_q_BTKGH = feature_map(q.astype(jnp.float32)).reshape(batch, q_len, num_kv_heads, groups, head_dim)
    phi_k_BSKH = feature_map(k.astype(jnp.float32))
    if mask.segments:
        phi_k_BSKH = jnp.where(is_real(mask.kv_segment_ids)[:, :, None, None], phi_k_BSKH, 0.0)  # phi(0) = 1
    kv_BSKHE = jnp.einsum("bskh,bske->bskhe", phi_k_BSKH, v.astype(jnp.float32))

    def prefix(x_BS: Array) -> Array:
        return jnp.concatenate([jnp.zeros_like(x_BS[:, :1]), jnp.cumsum(x_BS, axis=1)], axis=1)

    first_BT, end_BT = mask.key_ranges(batch, q_len, kv_len)
    kv_BTKHE = _run_sums(prefix(kv_BSKHE), first_BT, end_BT)
    z_BTKH = _run_sums(prefix(phi_k_BSKH), first_BT, end_BT)
    num_BTKGE = jnp.einsum("btkgh,btkhe->btkge", phi_q_BTKGH, kv_BTKHE)
    den_BTKG = jnp.einsum("btkgh,btkh->btkg", phi_q_BTKGH, z_BTKH)
    # A query that sees no key has a zero denominator: return zeros, with a safe divisor for the gradient.
    seen_BTKG = den_BTKG > 0
    out_BTKGE = jnp.where(seen_BTKG[..., None], num_BTKGE / jnp.where(seen_BTKG, den_BTKG, 1.0)[..., None], 0.0)
    return out_BTKGE.reshape(batch, q_len, num_heads, v.shape[-1]).astype(q.dtype)
