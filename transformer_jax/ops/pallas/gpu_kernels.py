"""Pallas kernels of FlashAttention-2: forward, dK/dV and dQ, tiled over query and key blocks.

Each kernel keeps one block resident and loops over the other axis's blocks with an online recurrence:
    forward (per query block):  m' = max(m, rowmax(s)), l' = 2^(m - m') l + rowsum(2^(s - m')),
                                acc' = 2^(m - m') acc + 2^(s - m') V;  O = acc / l,  lse = m + log2 l,
    dK/dV (per key block):      P = 2^(s - lse), dV += P^T dO, dS = P * (dO V^T - delta), dK += dS^T Q,
    dQ (per query block):       dQ += dS K,
with s = Q K^T * scale * log2(e) (base-2 exponentials save a multiply per score) and delta = rowsum(dO * O).

Loops visit only the tiles [lo, hi) that some query can see and skip the mask on the run [a, c) of tiles that
every query sees fully (bounds from masks.AttentionMask.loop_bounds), so causal, windowed and packed attention do
no wasted work.

Written for the Triton lowering (GPU): tiles are powers of two >= 16, head dims are padded by the caller, loop
bounds are read from small int32 inputs, masks are rebuilt from per-token vectors with elementwise ops only.
The same kernels run on CPU with interpret=True.

Lengths T, S and head dims H, E are padded by the caller. Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from transformer_jax.ops.masks import AttentionMask

Array = jax.Array

LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static description of one attention call, shared by the three kernels."""

    scale: float  # natural-log softmax scale; kernels use scale * log2(e)
    mask: AttentionMask  # the rule without its vectors (AttentionMask.static()); the vectors are kernel inputs
    segments: bool  # segment id vectors are inputs
    positions: bool  # position vectors are inputs
    groups: int  # G, query heads per key/value head


def _dot(a: Array, b: Array, contract_a: int, contract_b: int) -> Array:
    """2-D matmul contracting axis contract_a of a with contract_b of b, accumulating in float32."""
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32)


def _tile_mask(cfg: KernelConfig, q_vecs: tuple, kv_vecs: tuple) -> Array:
    """[X, Y] mask of a tile from [X] query vectors and [Y] key vectors (segment ids, positions)."""
    return cfg.mask.tile(*q_vecs, *kv_vecs)


def _load_vecs(cfg: KernelConfig, seg_ref, pos_ref, index) -> tuple:
    return (
        seg_ref[index] if cfg.segments else None,
        pos_ref[index] if cfg.positions else None,
    )


def _three_loops(bounds_ref, num_tiles: int, body, carry):
    """Runs body(j, carry, masked) over the visible tiles: masked [lo, a), unmasked [a, c), masked [c, hi)."""
    if bounds_ref is None:
        return lax.fori_loop(0, num_tiles, lambda j, c: body(j, c, False), carry)
    lo, a, c, hi = bounds_ref[0], bounds_ref[1], bounds_ref[2], bounds_ref[3]
    carry = lax.fori_loop(lo, a, lambda j, cr: body(j, cr, True), carry)
    carry = lax.fori_loop(a, c, lambda j, cr: body(j, cr, False), carry)
    return lax.fori_loop(c, hi, lambda j, cr: body(j, cr, True), carry)


def _split_refs(cfg: KernelConfig, refs: tuple, masked: bool) -> tuple:
    """(q_seg, kv_seg, q_pos, kv_pos, bounds, rest): optional inputs in the order the callers pass them."""
    refs = list(refs)
    q_seg = kv_seg = q_pos = kv_pos = bounds = None
    if cfg.segments:
        q_seg, kv_seg = refs.pop(0), refs.pop(0)
    if cfg.positions:
        q_pos, kv_pos = refs.pop(0), refs.pop(0)
    if masked:
        bounds = refs.pop(0)
    return q_seg, kv_seg, q_pos, kv_pos, bounds, refs


def forward_kernel(q_ref, k_ref, v_ref, *refs, cfg: KernelConfig, block_k: int, masked: bool) -> None:
    """One query block [X, H] against all key blocks; writes O [X, E] and lse [X] (base 2, +inf if nothing seen)."""
    q_seg_ref, kv_seg_ref, q_pos_ref, kv_pos_ref, bounds_ref, (o_ref, lse_ref) = _split_refs(cfg, refs, masked)
    q_XH = q_ref[...]
    block_q, num_tiles = q_XH.shape[0], k_ref.shape[0] // block_k
    q_vecs = _load_vecs(cfg, q_seg_ref, q_pos_ref, slice(None)) if masked else None
    scale2 = cfg.scale * LOG2E

    def body(j, carry: tuple, tile_masked: bool) -> tuple:
        m_X, l_X, acc_XE = carry
        kv_slice = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        s_XY = _dot(q_XH, k_ref[kv_slice, :], 1, 1) * scale2
        if tile_masked:
            mask_XY = _tile_mask(cfg, q_vecs, _load_vecs(cfg, kv_seg_ref, kv_pos_ref, kv_slice))
            s_XY = jnp.where(mask_XY, s_XY, -jnp.inf)
        m_new = jnp.maximum(m_X, jnp.max(s_XY, axis=1))
        if tile_masked:
            # A row that has seen no key keeps m = -inf; shift by 0 so that 2^(s - m) is 0, not NaN.
            m_new_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        else:
            m_new_safe = m_new  # an unmasked tile gives every row a finite score
        alpha_X = jnp.exp2(m_X - m_new_safe)
        p_XY = jnp.exp2(s_XY - m_new_safe[:, None])
        v_YE = v_ref[kv_slice, :]
        acc_XE = alpha_X[:, None] * acc_XE + _dot(p_XY.astype(v_YE.dtype), v_YE, 1, 0)
        return m_new, alpha_X * l_X + jnp.sum(p_XY, axis=1), acc_XE

    init = (
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
        jnp.zeros((block_q, v_ref.shape[-1]), jnp.float32),
    )
    m_X, l_X, acc_XE = _three_loops(bounds_ref, num_tiles, body, init)
    seen_X = l_X > 0
    l_safe_X = jnp.where(seen_X, l_X, 1.0)
    o_ref[...] = (acc_XE / l_safe_X[:, None]).astype(o_ref.dtype)
    # lse = +inf where a row sees nothing makes the backward's P = 2^(s - lse) exactly 0 there.
    lse_ref[...] = jnp.where(seen_X, m_X + jnp.log2(l_safe_X), jnp.inf)


def dkdv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    *refs,
    cfg: KernelConfig,
    block_q: int,
    masked: bool,
) -> None:
    """One key block [Y, H] against the query blocks of its G query heads; writes dK [Y, H] and dV [Y, E].

    q_ref/do_ref are [T, G, H]/[T, G, E] and lse_ref/delta_ref [G, T]: all query heads that share this key head.
    """
    q_seg_ref, kv_seg_ref, q_pos_ref, kv_pos_ref, bounds_ref, (dk_ref, dv_ref) = _split_refs(cfg, refs, masked)
    k_YH, v_YE = k_ref[...], v_ref[...]
    num_tiles = q_ref.shape[0] // block_q
    kv_vecs = _load_vecs(cfg, kv_seg_ref, kv_pos_ref, slice(None)) if masked else None
    scale2 = cfg.scale * LOG2E

    def head(g, carry: tuple) -> tuple:
        def body(i, carry: tuple, tile_masked: bool) -> tuple:
            dk_YH, dv_YE = carry
            q_slice = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
            q_XH, do_XE = q_ref[q_slice, g, :], do_ref[q_slice, g, :]
            s_XY = _dot(q_XH, k_YH, 1, 1) * scale2
            if tile_masked:
                mask_XY = _tile_mask(cfg, _load_vecs(cfg, q_seg_ref, q_pos_ref, q_slice), kv_vecs)
                s_XY = jnp.where(mask_XY, s_XY, -jnp.inf)
            p_XY = jnp.exp2(s_XY - lse_ref[g, q_slice][:, None])
            dv_YE = dv_YE + _dot(p_XY.astype(do_XE.dtype), do_XE, 0, 0)
            dp_XY = _dot(do_XE, v_YE, 1, 1)
            ds_XY = p_XY * (dp_XY - delta_ref[g, q_slice][:, None])
            dk_YH = dk_YH + _dot(ds_XY.astype(q_XH.dtype), q_XH, 0, 0)
            return dk_YH, dv_YE

        return _three_loops(bounds_ref, num_tiles, body, carry)

    init = (jnp.zeros(k_YH.shape, jnp.float32), jnp.zeros(v_YE.shape, jnp.float32))
    dk_YH, dv_YE = head(0, init) if cfg.groups == 1 else lax.fori_loop(0, cfg.groups, head, init)
    dk_ref[...] = (dk_YH * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_YE.astype(dv_ref.dtype)


def dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    *refs,
    cfg: KernelConfig,
    block_k: int,
    masked: bool,
) -> None:
    """One query block [X, H] against all key blocks; writes dQ [X, H]."""
    q_seg_ref, kv_seg_ref, q_pos_ref, kv_pos_ref, bounds_ref, (dq_ref,) = _split_refs(cfg, refs, masked)
    q_XH, do_XE = q_ref[...], do_ref[...]
    lse_X, delta_X = lse_ref[...], delta_ref[...]
    num_tiles = k_ref.shape[0] // block_k
    q_vecs = _load_vecs(cfg, q_seg_ref, q_pos_ref, slice(None)) if masked else None
    scale2 = cfg.scale * LOG2E

    def body(j, dq_XH: Array, tile_masked: bool) -> Array:
        kv_slice = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        k_YH, v_YE = k_ref[kv_slice, :], v_ref[kv_slice, :]
        s_XY = _dot(q_XH, k_YH, 1, 1) * scale2
        if tile_masked:
            mask_XY = _tile_mask(cfg, q_vecs, _load_vecs(cfg, kv_seg_ref, kv_pos_ref, kv_slice))
            s_XY = jnp.where(mask_XY, s_XY, -jnp.inf)
        p_XY = jnp.exp2(s_XY - lse_X[:, None])
        ds_XY = p_XY * (_dot(do_XE, v_YE, 1, 1) - delta_X[:, None])
        return dq_XH + _dot(ds_XY.astype(k_YH.dtype), k_YH, 1, 0)

    dq_XH = _three_loops(bounds_ref, num_tiles, body, jnp.zeros(q_XH.shape, jnp.float32))
    dq_ref[...] = (dq_XH * cfg.scale).astype(dq_ref.dtype)
