"""Kernelised linear attention (Katharopoulos et al., 2020): softmax(q.k) replaced by phi(q).phi(k).

Axis legend: B batch, T query length, S key length, N heads, H key head dim, G value head dim, M segments.

    out_i = phi(q_i)^T sum_j phi(k_j) v_j^T / phi(q_i)^T sum_j phi(k_j),   phi(x) = elu(x) + 1

The sums run over the keys a query may see; they cost O(S H G) memory instead of the O(T S) score matrix.
- Non-causal: per-segment sums (packed rows and padding; segment id <= 0 is padding).
- Causal, T == S (self-attention): prefix sums that restart at each segment; query row i sees key rows <= i.
- Causal, T != S (decoding with a cache): query positions index the prefix sums, so keys must sit at the index
  equal to their position, as the decoding cache stores them.
Sliding windows are not supported (a clear error).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformer_jax.ops.attention import _check_shapes, register

Array = jax.Array


def feature_map(x: Array) -> Array:
    """phi(x) = elu(x) + 1 > 0, the feature map of Katharopoulos et al."""
    return jax.nn.elu(x) + 1.0


def _expand_heads(x_BSKH: Array, num_heads: int) -> Array:
    return jnp.repeat(x_BSKH, num_heads // x_BSKH.shape[2], axis=2)


def _segment_starts(segment_ids_BS: Array) -> Array:
    """Index of the first row of each row's segment (segments are contiguous runs)."""
    length = segment_ids_BS.shape[1]
    idx = jnp.arange(length)
    change = jnp.concatenate(
        [jnp.ones_like(segment_ids_BS[:, :1], bool), segment_ids_BS[:, 1:] != segment_ids_BS[:, :-1]], axis=1
    )
    return jax.lax.cummax(jnp.where(change, idx, 0), axis=1)


@register("linear")
def linear_attention(
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
    max_segments: int | None = None,
) -> Array:
    """Linear attention with the shared masking conventions (see the module docstring for causal alignment)."""
    _check_shapes(q, k, v)
    if window is not None:
        raise ValueError("attention impl 'linear' does not support a sliding window; set attention.window=0")
    batch, q_len, num_heads, _ = q.shape
    kv_len = k.shape[1]
    dtype = q.dtype
    phi_q = feature_map(q.astype(jnp.float32))
    phi_k = _expand_heads(feature_map(k.astype(jnp.float32)), num_heads)
    v_f = _expand_heads(v.astype(jnp.float32), num_heads)
    q_seg = jnp.ones((batch, q_len), jnp.int32) if q_segment_ids is None else q_segment_ids
    kv_seg = jnp.ones((batch, kv_len), jnp.int32) if kv_segment_ids is None else kv_segment_ids
    phi_k = phi_k * (kv_seg > 0)[:, :, None, None]  # padding keys contribute nothing
    if not causal:
        # Sum keys per segment id (one-hot over ids 1..M-1), then give each query its own segment's sums.
        m = max_segments or min(q_len, kv_len) + 1
        onehot_kv = jax.nn.one_hot(kv_seg, m, dtype=jnp.float32).at[..., 0].set(0.0)
        onehot_q = jax.nn.one_hot(q_seg, m, dtype=jnp.float32).at[..., 0].set(0.0)
        kv_BMNHG = jnp.einsum("bsm,bsnh,bsng->bmnhg", onehot_kv, phi_k, v_f)
        z_BMNH = jnp.einsum("bsm,bsnh->bmnh", onehot_kv, phi_k)
        num_BTNG = jnp.einsum("btm,btnh,bmnhg->btng", onehot_q, phi_q, kv_BMNHG)
        den_BTN = jnp.einsum("btm,btnh,bmnh->btn", onehot_q, phi_q, z_BMNH)
    else:
        kv_BSNHG = jnp.cumsum(jnp.einsum("bsnh,bsng->bsnhg", phi_k, v_f), axis=1)
        z_BSNH = jnp.cumsum(phi_k, axis=1)
        if q_len == kv_len:
            # Row i sees rows start(i) .. i of its own segment: a prefix sum minus the one before the segment.
            starts = _segment_starts(kv_seg)

            def before_start(c):
                shifted = jnp.concatenate([jnp.zeros_like(c[:, :1]), c[:, :-1]], axis=1)
                idx = starts.reshape(batch, kv_len, *([1] * (c.ndim - 2)))
                return jnp.take_along_axis(shifted, idx, axis=1)

            kv_BTNHG = kv_BSNHG - before_start(kv_BSNHG)
            z_BTNH = z_BSNH - before_start(z_BSNH)
            same = (q_seg == kv_seg) & (q_seg > 0)
        else:
            # Decoding: the query at position p sees cache slots 0..p.
            pos = jnp.arange(q_len)[None] + kv_len - q_len if q_positions is None else q_positions
            pos = jnp.clip(pos, 0, kv_len - 1)
            kv_BTNHG = jnp.take_along_axis(kv_BSNHG, pos[:, :, None, None, None], axis=1)
            z_BTNH = jnp.take_along_axis(z_BSNH, pos[:, :, None, None], axis=1)
            same = q_seg > 0
        num_BTNG = jnp.einsum("btnh,btnhg->btng", phi_q, kv_BTNHG)
        den_BTN = jnp.einsum("btnh,btnh->btn", phi_q, z_BTNH)
        num_BTNG = num_BTNG * same[:, :, None, None]
        den_BTN = den_BTN * same[:, :, None]
    # A query that sees no key has a zero denominator: return zeros, with a safe divisor for the gradient.
    safe = jnp.where(den_BTN > 0, den_BTN, 1.0)
    out_BTNG = jnp.where((den_BTN > 0)[..., None], num_BTNG / safe[..., None], 0.0)
    return out_BTNG.astype(dtype)
