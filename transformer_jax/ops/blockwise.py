"""Attention in pure JAX beyond the reference: blockwise softmax attention, O(N) memory on any backend (Rabe & Staats
2021; FlashAttention-2 recurrence), and kernelised linear attention (`linear_attention`).

Queries are processed in blocks of X (lax.map), keys in blocks of Y (lax.scan) with the online softmax
    m' = max(m, rowmax(s)),  l' = e^(m - m') l + rowsum(e^(s - m')),  acc' = e^(m - m') acc + e^(s - m') V,
so that only an [X, Y] tile of scores exists at a time. A custom VJP saves (out, logsumexp) instead of the
attention matrix and recomputes each tile in the backward pass, P = exp(s - lse),
    dV = P^T dO,  dS = P * (dO V^T - rowsum(dO * O)),  dQ = scale dS K,  dK = scale dS^T Q.

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from transformer_jax.ops.attention import AttentionMask, is_real, pad_tokens, recompute_vjp, register

Array = jax.Array


class _Static(NamedTuple):
    """Hashable, non-differentiable configuration of one call."""

    scale: float
    block_q: int
    block_k: int


def _split_blocks(length: int, block: int) -> tuple[int, int]:
    """(block size, number of blocks) covering `length` with at most `block` per block and little padding."""
    num = -(-length // block)
    size = -(-length // num)
    return size, num


@register("blockwise")
def blockwise_attention(
    q: Array,
    k: Array,
    v: Array,
    mask: AttentionMask,
    *,
    scale: float | None = None,
    block_q: int = 512,
    block_k: int = 512,
) -> Array:
    """softmax(Q K^T * scale + mask) V without the [T, S] matrix; memory O((T + S) H + X Y) per head.

    Supports the whole mask and grouped heads, E != H. Lengths need not be multiples of the blocks (padded
    internally with segment id 0).
    """
    batch, q_len, _, head_dim = q.shape
    kv_len = k.shape[1]
    q, k, v = mask.zero_padding_tokens(q, k, v)
    x, num_i = _split_blocks(q_len, block_q)
    y, num_j = _split_blocks(kv_len, block_k)
    mask = mask.pad(batch, q_len, kv_len, x * num_i, y * num_j)
    q, k, v = pad_tokens(q, x * num_i), pad_tokens(k, y * num_j), pad_tokens(v, y * num_j)
    static = _Static(float(head_dim**-0.5 if scale is None else scale), x, y)
    out_BTNE = _attend(q, k, v, mask, static)
    return out_BTNE[:, :q_len]


def _q_blocks(x_BTNH: Array, num_k: int, block: int) -> Array:
    """[B, T, N, H] -> [I, B, K, G, X, H]: one contiguous tile per query block (a copy, O(T N H))."""
    b, t, n, h = x_BTNH.shape
    return x_BTNH.reshape(b, t // block, block, num_k, n // num_k, h).transpose(1, 0, 3, 4, 2, 5)


def _kv_blocks(x_BSKH: Array, block: int) -> Array:
    """[B, S, K, H] -> [J, B, K, Y, H]."""
    b, s, kh, h = x_BSKH.shape
    return x_BSKH.reshape(b, s // block, block, kh, h).transpose(1, 0, 3, 2, 4)


def _vector_blocks(mask: AttentionMask, static: _Static) -> tuple[tuple, tuple]:
    """((segment ids, positions) of the queries as [I, B, X], (those of the keys) as [J, B, Y]); None if absent."""

    def split(x_BT: Array | None, block: int) -> Array | None:
        return None if x_BT is None else x_BT.reshape(x_BT.shape[0], -1, block).transpose(1, 0, 2)

    q_vecs = (split(mask.q_segment_ids, static.block_q), split(mask.q_positions, static.block_q))
    kv_vecs = (split(mask.kv_segment_ids, static.block_k), split(mask.kv_positions, static.block_k))
    return q_vecs, kv_vecs


def _tile_mask(mask: AttentionMask, q_vecs: tuple, kv_vecs: tuple) -> Array | None:
    """[B, 1, 1, X, Y] mask of one tile from the [B, X] query and [B, Y] key vectors."""
    (q_seg_BX, q_pos_BX), (kv_seg_BY, kv_pos_BY) = q_vecs, kv_vecs
    mask_BXY = mask.tile(q_seg_BX, q_pos_BX, kv_seg_BY, kv_pos_BY)
    return None if mask_BXY is None else mask_BXY[:, None, None]


def _forward(q: Array, k: Array, v: Array, mask: AttentionMask, static: _Static) -> tuple[Array, Array]:
    """Returns out [B, T, N, E] and lse [I, B, K, G, X] (natural log; +inf for rows that see no key)."""
    batch, q_len, num_heads, _ = q.shape
    num_k, value_dim = k.shape[2], v.shape[-1]
    g = num_heads // num_k
    q_IBKGXH = _q_blocks(q, num_k, static.block_q)
    k_JBKYH, v_JBKYE = _kv_blocks(k, static.block_k), _kv_blocks(v, static.block_k)
    q_vecs, kv_vecs = _vector_blocks(mask, static)

    def query_block(xs: tuple) -> tuple[Array, Array]:
        q_BKGXH, q_vec = xs
        shape = (batch, num_k, g, static.block_q)
        init = (
            jnp.full(shape, -jnp.inf, jnp.float32),
            jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, value_dim), jnp.float32),
        )

        def key_block(carry: tuple, ys: tuple) -> tuple[tuple, None]:
            k_BKYH, v_BKYE, kv_vec = ys
            tile_mask = _tile_mask(mask, q_vec, kv_vec)

            def update(carry: tuple) -> tuple:
                m_BKGX, l_BKGX, acc_BKGXE = carry
                s_BKGXY = jnp.einsum("bkgxh,bkyh->bkgxy", q_BKGXH, k_BKYH, preferred_element_type=jnp.float32)
                s_BKGXY = s_BKGXY * static.scale
                if tile_mask is not None:
                    s_BKGXY = jnp.where(tile_mask, s_BKGXY, -jnp.inf)
                m_new = jnp.maximum(m_BKGX, s_BKGXY.max(-1))
                # A row that has seen no key yet keeps m = -inf; shift by 0 instead so that exp gives 0, not NaN.
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                p_BKGXY = jnp.exp(s_BKGXY - m_safe[..., None])
                alpha = jnp.exp(m_BKGX - m_safe)
                l_new = alpha * l_BKGX + p_BKGXY.sum(-1)
                pv_BKGXE = jnp.einsum(
                    "bkgxy,bkye->bkgxe", p_BKGXY.astype(v_BKYE.dtype), v_BKYE, preferred_element_type=jnp.float32
                )
                return m_new, l_new, alpha[..., None] * acc_BKGXE + pv_BKGXE

            if tile_mask is None:
                return update(carry), None
            # Tiles that no query sees (causal future, other segments, outside the window) cost one mask only.
            return lax.cond(jnp.any(tile_mask), update, lambda c: c, carry), None

        (m_BKGX, l_BKGX, acc_BKGXE), _ = lax.scan(key_block, init, (k_JBKYH, v_JBKYE, kv_vecs))
        seen = l_BKGX > 0
        out_BKGXE = acc_BKGXE / jnp.where(seen, l_BKGX, 1.0)[..., None]
        # lse = +inf for a row that sees nothing makes P = exp(s - lse) = 0 there in the backward pass.
        lse_BKGX = jnp.where(seen, m_BKGX + jnp.log(jnp.where(seen, l_BKGX, 1.0)), jnp.inf)
        return out_BKGXE.astype(v.dtype), lse_BKGX

    out_IBKGXE, lse_IBKGX = lax.map(query_block, (q_IBKGXH, q_vecs))
    out_BTNE = out_IBKGXE.transpose(1, 0, 4, 2, 3, 5).reshape(batch, q_len, num_heads, value_dim)
    return out_BTNE, lse_IBKGX


def _backward(res: tuple, do_BTNE: Array, static: _Static) -> tuple[Array, Array, Array]:
    """dQ, dK, dV from the saved (q, k, v, out, lse); one pass over key blocks, dQ accumulated in float32."""
    q, k, v, mask, out_BTNE, lse_IBKGX = res
    num_k = k.shape[2]
    q_IBKGXH = _q_blocks(q, num_k, static.block_q)
    do_IBKGXE = _q_blocks(do_BTNE.astype(v.dtype), num_k, static.block_q)
    # delta = rowsum(dO * O), the softmax Jacobian's correction term (FlashAttention-2, eq. 4).
    delta_BTN = jnp.sum(do_BTNE.astype(jnp.float32) * out_BTNE.astype(jnp.float32), axis=-1)
    delta_IBKGX = _q_blocks(delta_BTN[..., None], num_k, static.block_q)[..., 0]
    k_JBKYH, v_JBKYE = _kv_blocks(k, static.block_k), _kv_blocks(v, static.block_k)
    q_vecs, kv_vecs = _vector_blocks(mask, static)

    def key_block(dq_IBKGXH: Array, xs: tuple) -> tuple[Array, tuple[Array, Array]]:
        k_BKYH, v_BKYE, kv_vec = xs

        def query_block(carry: tuple, ys: tuple) -> tuple[tuple, Array]:
            q_BKGXH, do_BKGXE, lse_BKGX, delta_BKGX, q_vec = ys
            tile_mask = _tile_mask(mask, q_vec, kv_vec)

            def grads(carry: tuple) -> tuple[tuple, Array]:
                # Tiles are computed transposed, [Y, X], so that dV = P^T dO and dK = dS^T Q are plain matmuls.
                dk_BKYH, dv_BKYE = carry
                s_BKGYX = jnp.einsum("bkyh,bkgxh->bkgyx", k_BKYH, q_BKGXH, preferred_element_type=jnp.float32)
                p_BKGYX = jnp.exp(s_BKGYX * static.scale - lse_BKGX[..., None, :])
                if tile_mask is not None:
                    p_BKGYX = jnp.where(jnp.swapaxes(tile_mask, -1, -2), p_BKGYX, 0.0)
                dv_BKYE = dv_BKYE + jnp.einsum(
                    "bkgyx,bkgxe->bkye", p_BKGYX.astype(do_BKGXE.dtype), do_BKGXE, preferred_element_type=jnp.float32
                )
                dp_BKGYX = jnp.einsum("bkye,bkgxe->bkgyx", v_BKYE, do_BKGXE, preferred_element_type=jnp.float32)
                ds_BKGYX = (p_BKGYX * (dp_BKGYX - delta_BKGX[..., None, :])).astype(q_BKGXH.dtype)
                dk_BKYH = dk_BKYH + jnp.einsum(
                    "bkgyx,bkgxh->bkyh", ds_BKGYX, q_BKGXH, preferred_element_type=jnp.float32
                )
                dq_BKGXH = jnp.einsum("bkgyx,bkyh->bkgxh", ds_BKGYX, k_BKYH, preferred_element_type=jnp.float32)
                return (dk_BKYH, dv_BKYE), dq_BKGXH

            if tile_mask is None:
                return grads(carry)
            return lax.cond(jnp.any(tile_mask), grads, lambda c: (c, jnp.zeros(q_BKGXH.shape, jnp.float32)), carry)

        init = (jnp.zeros(k_BKYH.shape, jnp.float32), jnp.zeros(v_BKYE.shape, jnp.float32))
        (dk_BKYH, dv_BKYE), dq_IBKGXH_j = lax.scan(
            query_block, init, (q_IBKGXH, do_IBKGXE, lse_IBKGX, delta_IBKGX, q_vecs)
        )
        return dq_IBKGXH + dq_IBKGXH_j, (dk_BKYH, dv_BKYE)

    dq_IBKGXH, (dk_JBKYH, dv_JBKYE) = lax.scan(
        key_block, jnp.zeros(q_IBKGXH.shape, jnp.float32), (k_JBKYH, v_JBKYE, kv_vecs)
    )
    batch, q_len, num_heads, head_dim = q.shape
    kv_len = k.shape[1]
    dq = (dq_IBKGXH * static.scale).transpose(1, 0, 4, 2, 3, 5).reshape(batch, q_len, num_heads, head_dim)
    dk = (dk_JBKYH * static.scale).transpose(1, 0, 3, 2, 4).reshape(batch, kv_len, num_k, head_dim)
    dv = dv_JBKYE.transpose(1, 0, 3, 2, 4).reshape(batch, kv_len, num_k, v.shape[-1])
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_attend = recompute_vjp(_forward, _backward)


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
    """Kernelised linear attention (Katharopoulos et al., 2020), softmax(q.k) replaced by phi(q).phi(k):

        out_t = phi(q_t)^T sum_s phi(k_s) v_s^T / phi(q_t)^T sum_s phi(k_s),   phi(x) = elu(x) + 1

    The sums run over each query's keys as AttentionMask.key_ranges gives them, a run [first, end) of key indices,
    so each is a difference of two prefix sums: O(S H E) memory instead of the O(T S) scores, for packed rows,
    padding, causal self-attention and a decoding cache alike (their keys are in the (segment id, position) order
    key_ranges needs). Sliding windows are refused; a query that sees no key returns zeros.
    """
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
