"""Blockwise attention in pure JAX: O(N) memory on any backend (Rabe & Staats 2021; FlashAttention-2 recurrence).

Queries are processed in blocks of X (lax.map), keys in blocks of Y (lax.scan) with the online softmax
    m' = max(m, rowmax(s)),  l' = e^(m - m') l + rowsum(e^(s - m')),  acc' = e^(m - m') acc + e^(s - m') V,
so that only an [X, Y] tile of scores exists at a time. A custom VJP saves (out, logsumexp) instead of the
attention matrix and recomputes each tile in the backward pass, P = exp(s - lse),
    dV = P^T dO,  dS = P * (dO V^T - rowsum(dO * O)),  dQ = scale dS K,  dK = scale dS^T Q.

Axis legend: B batch, T query length, S key/value length, N query heads, K key/value heads, G query heads per
key/value head (N = K G), H query/key head dim, D value head dim, X query block, Y key block,
I query blocks (T / X), J key blocks (S / Y).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from transformer_jax.ops import blocks
from transformer_jax.ops.attention import _check_shapes, register

Array = jax.Array


class _Static(NamedTuple):
    """Hashable, non-differentiable configuration of one call."""

    scale: float
    causal: bool
    window: int | None
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
    *,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    causal: bool = False,
    q_positions: Array | None = None,
    kv_positions: Array | None = None,
    window: int | None = None,
    scale: float | None = None,
    block_q: int = 512,
    block_k: int = 512,
) -> Array:
    """softmax(Q K^T * scale + mask) V without the [T, S] matrix; memory O((T + S) H + X Y) per head.

    Supports everything of the shared semantics: grouped heads, D != H, segment ids, positions, causal, window.
    Lengths need not be multiples of the blocks (padded internally with segment id 0).
    """
    _check_shapes(q, k, v)
    batch, q_len, num_heads, head_dim = q.shape
    kv_len = k.shape[1]
    vectors = blocks.mask_vectors(
        batch,
        q_len,
        kv_len,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        causal=causal,
        q_positions=q_positions,
        kv_positions=kv_positions,
        window=window,
    )
    q, k, v = blocks.zero_padding_tokens(q, k, v, vectors)
    x, num_i = _split_blocks(q_len, block_q)
    y, num_j = _split_blocks(kv_len, block_k)
    vectors = blocks.pad_vectors(vectors, batch, q_len, kv_len, x * num_i, y * num_j)
    q, k, v = blocks.pad_tokens(q, x * num_i), blocks.pad_tokens(k, y * num_j), blocks.pad_tokens(v, y * num_j)
    static = _Static(float(head_dim**-0.5 if scale is None else scale), causal, window, x, y)
    out_BTND = _attend(q, k, v, vectors, static)
    return out_BTND[:, :q_len]


def _q_blocks(x_BTNH: Array, num_k: int, block: int) -> Array:
    """[B, T, N, H] -> [I, B, K, G, X, H]: one contiguous tile per query block (a copy, O(T N H))."""
    b, t, n, h = x_BTNH.shape
    return x_BTNH.reshape(b, t // block, block, num_k, n // num_k, h).transpose(1, 0, 3, 4, 2, 5)


def _kv_blocks(x_BSKH: Array, block: int) -> Array:
    """[B, S, K, H] -> [J, B, K, Y, H]."""
    b, s, kh, h = x_BSKH.shape
    return x_BSKH.reshape(b, s // block, block, kh, h).transpose(1, 0, 3, 2, 4)


def _vector_blocks(x_BT: Array | None, block: int) -> Array | None:
    """[B, T] -> [I, B, X]."""
    return None if x_BT is None else x_BT.reshape(x_BT.shape[0], -1, block).transpose(1, 0, 2)


def _tile_mask(static: _Static, q_vecs: tuple, kv_vecs: tuple) -> Array | None:
    """[B, 1, 1, X, Y] mask of one tile from the [B, X] query and [B, Y] key vectors."""
    q_seg_BX, q_pos_BX = q_vecs
    kv_seg_BY, kv_pos_BY = kv_vecs
    mask_BXY = blocks.visible(
        None if q_seg_BX is None else q_seg_BX[:, :, None],
        None if kv_seg_BY is None else kv_seg_BY[:, None, :],
        None if q_pos_BX is None else q_pos_BX[:, :, None],
        None if kv_pos_BY is None else kv_pos_BY[:, None, :],
        causal=static.causal,
        window=static.window,
    )
    return None if mask_BXY is None else mask_BXY[:, None, None]


def _forward(q: Array, k: Array, v: Array, vectors: blocks.MaskVectors, static: _Static) -> tuple[Array, Array]:
    """Returns out [B, T, N, D] and lse [I, B, K, G, X] (natural log; +inf for rows that see no key)."""
    batch, q_len, num_heads, _ = q.shape
    num_k, d = k.shape[2], v.shape[-1]
    g = num_heads // num_k
    q_IBKGXH = _q_blocks(q, num_k, static.block_q)
    k_JBKYH, v_JBKYD = _kv_blocks(k, static.block_k), _kv_blocks(v, static.block_k)
    q_vecs = (
        _vector_blocks(vectors.q_segment_ids, static.block_q),
        _vector_blocks(vectors.q_positions, static.block_q),
    )
    kv_vecs = (
        _vector_blocks(vectors.kv_segment_ids, static.block_k),
        _vector_blocks(vectors.kv_positions, static.block_k),
    )

    def query_block(xs: tuple) -> tuple[Array, Array]:
        q_BKGXH, q_vec = xs
        shape = (batch, num_k, g, static.block_q)
        init = (
            jnp.full(shape, -jnp.inf, jnp.float32),
            jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, d), jnp.float32),
        )

        def key_block(carry: tuple, ys: tuple) -> tuple[tuple, None]:
            k_BKYH, v_BKYD, kv_vec = ys
            mask = _tile_mask(static, q_vec, kv_vec)

            def update(carry: tuple) -> tuple:
                m_BKGX, l_BKGX, acc_BKGXD = carry
                s_BKGXY = jnp.einsum("bkgxh,bkyh->bkgxy", q_BKGXH, k_BKYH, preferred_element_type=jnp.float32)
                s_BKGXY = s_BKGXY * static.scale
                if mask is not None:
                    s_BKGXY = jnp.where(mask, s_BKGXY, -jnp.inf)
                m_new = jnp.maximum(m_BKGX, s_BKGXY.max(-1))
                # A row that has seen no key yet keeps m = -inf; shift by 0 instead so that exp gives 0, not NaN.
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                p_BKGXY = jnp.exp(s_BKGXY - m_safe[..., None])
                alpha = jnp.exp(m_BKGX - m_safe)
                l_new = alpha * l_BKGX + p_BKGXY.sum(-1)
                pv_BKGXD = jnp.einsum(
                    "bkgxy,bkyd->bkgxd", p_BKGXY.astype(v_BKYD.dtype), v_BKYD, preferred_element_type=jnp.float32
                )
                return m_new, l_new, alpha[..., None] * acc_BKGXD + pv_BKGXD

            if mask is None:
                return update(carry), None
            # Tiles that no query sees (causal future, other segments, outside the window) cost one mask only.
            return lax.cond(jnp.any(mask), update, lambda c: c, carry), None

        (m_BKGX, l_BKGX, acc_BKGXD), _ = lax.scan(key_block, init, (k_JBKYH, v_JBKYD, kv_vecs))
        seen = l_BKGX > 0
        out_BKGXD = acc_BKGXD / jnp.where(seen, l_BKGX, 1.0)[..., None]
        # lse = +inf for a row that sees nothing makes P = exp(s - lse) = 0 there in the backward pass.
        lse_BKGX = jnp.where(seen, m_BKGX + jnp.log(jnp.where(seen, l_BKGX, 1.0)), jnp.inf)
        return out_BKGXD.astype(v.dtype), lse_BKGX

    out_IBKGXD, lse_IBKGX = lax.map(query_block, (q_IBKGXH, q_vecs))
    out_BTND = out_IBKGXD.transpose(1, 0, 4, 2, 3, 5).reshape(batch, q_len, num_heads, d)
    return out_BTND, lse_IBKGX


def _backward(res: tuple, do_BTND: Array, static: _Static) -> tuple[Array, Array, Array]:
    """dQ, dK, dV from the saved (q, k, v, out, lse); one pass over key blocks, dQ accumulated in float32."""
    q, k, v, vectors, out_BTND, lse_IBKGX = res
    num_k = k.shape[2]
    q_IBKGXH = _q_blocks(q, num_k, static.block_q)
    do_IBKGXD = _q_blocks(do_BTND.astype(v.dtype), num_k, static.block_q)
    # delta = rowsum(dO * O), the softmax Jacobian's correction term (FlashAttention-2, eq. 4).
    delta_BTN = jnp.sum(do_BTND.astype(jnp.float32) * out_BTND.astype(jnp.float32), axis=-1)
    delta_IBKGX = _q_blocks(delta_BTN[..., None], num_k, static.block_q)[..., 0]
    k_JBKYH, v_JBKYD = _kv_blocks(k, static.block_k), _kv_blocks(v, static.block_k)
    q_vecs = (
        _vector_blocks(vectors.q_segment_ids, static.block_q),
        _vector_blocks(vectors.q_positions, static.block_q),
    )
    kv_vecs = (
        _vector_blocks(vectors.kv_segment_ids, static.block_k),
        _vector_blocks(vectors.kv_positions, static.block_k),
    )

    def key_block(dq_IBKGXH: Array, xs: tuple) -> tuple[Array, tuple[Array, Array]]:
        k_BKYH, v_BKYD, kv_vec = xs

        def query_block(carry: tuple, ys: tuple) -> tuple[tuple, Array]:
            q_BKGXH, do_BKGXD, lse_BKGX, delta_BKGX, q_vec = ys
            mask = _tile_mask(static, q_vec, kv_vec)

            def grads(carry: tuple) -> tuple[tuple, Array]:
                # Tiles are computed transposed, [Y, X], so that dV = P^T dO and dK = dS^T Q are plain matmuls.
                dk_BKYH, dv_BKYD = carry
                s_BKGYX = jnp.einsum("bkyh,bkgxh->bkgyx", k_BKYH, q_BKGXH, preferred_element_type=jnp.float32)
                p_BKGYX = jnp.exp(s_BKGYX * static.scale - lse_BKGX[..., None, :])
                if mask is not None:
                    p_BKGYX = jnp.where(jnp.swapaxes(mask, -1, -2), p_BKGYX, 0.0)
                dv_BKYD = dv_BKYD + jnp.einsum(
                    "bkgyx,bkgxd->bkyd", p_BKGYX.astype(do_BKGXD.dtype), do_BKGXD, preferred_element_type=jnp.float32
                )
                dp_BKGYX = jnp.einsum("bkyd,bkgxd->bkgyx", v_BKYD, do_BKGXD, preferred_element_type=jnp.float32)
                ds_BKGYX = (p_BKGYX * (dp_BKGYX - delta_BKGX[..., None, :])).astype(q_BKGXH.dtype)
                dk_BKYH = dk_BKYH + jnp.einsum(
                    "bkgyx,bkgxh->bkyh", ds_BKGYX, q_BKGXH, preferred_element_type=jnp.float32
                )
                dq_BKGXH = jnp.einsum("bkgyx,bkyh->bkgxh", ds_BKGYX, k_BKYH, preferred_element_type=jnp.float32)
                return (dk_BKYH, dv_BKYD), dq_BKGXH

            if mask is None:
                return grads(carry)
            return lax.cond(jnp.any(mask), grads, lambda c: (c, jnp.zeros(q_BKGXH.shape, jnp.float32)), carry)

        init = (jnp.zeros(k_BKYH.shape, jnp.float32), jnp.zeros(v_BKYD.shape, jnp.float32))
        (dk_BKYH, dv_BKYD), dq_IBKGXH_j = lax.scan(
            query_block, init, (q_IBKGXH, do_IBKGXD, lse_IBKGX, delta_IBKGX, q_vecs)
        )
        return dq_IBKGXH + dq_IBKGXH_j, (dk_BKYH, dv_BKYD)

    dq_IBKGXH, (dk_JBKYH, dv_JBKYD) = lax.scan(
        key_block, jnp.zeros(q_IBKGXH.shape, jnp.float32), (k_JBKYH, v_JBKYD, kv_vecs)
    )
    batch, q_len, num_heads, head_dim = q.shape
    kv_len = k.shape[1]
    dq = (dq_IBKGXH * static.scale).transpose(1, 0, 4, 2, 3, 5).reshape(batch, q_len, num_heads, head_dim)
    dk = (dk_JBKYH * static.scale).transpose(1, 0, 3, 2, 4).reshape(batch, kv_len, num_k, head_dim)
    dv = dv_JBKYD.transpose(1, 0, 3, 2, 4).reshape(batch, kv_len, num_k, v.shape[-1])
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attend(q: Array, k: Array, v: Array, vectors: blocks.MaskVectors, static: _Static) -> Array:
    return _forward(q, k, v, vectors, static)[0]


def _attend_fwd(q: Array, k: Array, v: Array, vectors: blocks.MaskVectors, static: _Static) -> tuple[Array, tuple]:
    out_BTND, lse_IBKGX = _forward(q, k, v, vectors, static)
    return out_BTND, (q, k, v, vectors, out_BTND, lse_IBKGX)


def _attend_bwd(static: _Static, res: tuple, do_BTND: Array) -> tuple:
    dq, dk, dv = _backward(res, do_BTND, static)
    vectors = res[3]
    # Integer mask vectors have no cotangent.
    return dq, dk, dv, jax.tree.map(lambda _: None, vectors)


_attend.defvjp(_attend_fwd, _attend_bwd)
