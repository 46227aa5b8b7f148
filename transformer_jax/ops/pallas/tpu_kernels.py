"""Pallas TPU (Mosaic) kernels of FlashAttention-2: forward, dK/dV and dQ, one tile per grid step.

The grid walks (batch, head, resident block, streamed block); the last axis is the reduction, carried in VMEM
scratch from its first step to its last:
    forward (per query block):  m' = max(m, rowmax(s)), l' = e^(m - m') l + rowsum(e^(s - m')),
                                acc' = e^(m - m') acc + e^(s - m') V;  O = acc / l,  lse = m + log l,
    dK/dV (per key block, over the G query heads of its group and all query blocks):
                                P = e^(s - lse), dV += P^T dO, dS = P * (dO V^T - delta), dK += dS^T Q,
    dQ (per query block):       dQ += dS K,
with s = Q K^T * scale and delta = rowsum(dO * O).

Tiles outside a row's [lo, hi) of masks.AttentionMask.loop_bounds (read from SMEM by scalar prefetch) are
skipped: no compute, and the index maps clamp the streamed block into [lo, hi) so that the pipeline does not
fetch it either. Tiles in [a, c) are seen whole and skip the mask.

Operands are heads-first ([B, N, T, H]); per-query vectors are columns [B, T, 1], per-key vectors rows [B, 1, S],
lse and delta [B, N, T, 1] (tpu.py states the layout rules). Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from transformer_jax.ops.masks import AttentionMask

Array = jax.Array

COUNT_LANES = 128  # a tile count is written as one lane-wide row, the smallest block Mosaic stores


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static description of one attention call, shared by the three kernels."""

    scale: float
    mask: AttentionMask  # the rule without its vectors (AttentionMask.static()); the vectors are kernel inputs
    segments: bool  # segment id vectors are inputs
    positions: bool  # position vectors are inputs
    masked: bool  # loop bounds are scalar-prefetched and tiles are skipped
    groups: int  # G, query heads per key/value head
    num_i: int  # query blocks
    num_j: int  # key blocks
    count_tiles: bool  # also output how many tiles each resident block computed (tests, benchmark)


def _dot(a: Array, b: Array, contract_a: int, contract_b: int) -> Array:
    """2-D matmul contracting axis contract_a of a with contract_b of b, accumulating in float32."""
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32)


class _Refs:
    """A kernel's refs by name: scalar-prefetched bounds, then inputs, mask vectors, outputs, scratch."""

    def __init__(self, cfg: KernelConfig, refs: tuple, inputs: tuple[str, ...], outputs: tuple[str, ...], scratch):
        refs = list(refs)
        self.bounds = refs.pop(0) if cfg.masked else None
        names = list(inputs)
        names += ["q_seg", "kv_seg"] if cfg.segments else []
        names += ["q_pos", "kv_pos"] if cfg.positions else []
        names += list(outputs) + (["count"] if cfg.count_tiles else [])
        names += list(scratch) + (["counter"] if cfg.count_tiles else [])
        if len(names) != len(refs):
            raise AssertionError(f"kernel refs {len(refs)} != names {names}")
        self.__dict__.update(zip(names, refs, strict=True))
        self.cfg = cfg

    def vectors(self) -> tuple:
        """(q_seg [X, 1], q_pos [X, 1], kv_seg [1, Y], kv_pos [1, Y]) of this tile; None where off."""
        seg = (self.q_seg[...], self.kv_seg[...]) if self.cfg.segments else (None, None)
        pos = (self.q_pos[...], self.kv_pos[...]) if self.cfg.positions else (None, None)
        return seg[0], pos[0], seg[1], pos[1]

    def tile_mask(self) -> Array:
        return self.cfg.mask.pairs(*self.vectors())


def row_bounds(bounds_ref, row: Array) -> tuple[Array, Array, Array, Array]:
    """(lo, a, c, hi) of one row of tiles in the flattened [rows * 4] loop bounds."""
    return tuple(bounds_ref[row * 4 + k] for k in range(4))


def streamed_block(bounds_ref, row: Array, step: Array) -> Array:
    """The block a grid step reads: `step` clamped into [lo, hi), so a skipped step re-uses a fetched block."""
    lo, _, _, hi = row_bounds(bounds_ref, row)
    return jnp.minimum(jnp.maximum(step, lo), jnp.maximum(hi - 1, lo))


def _visit(r: _Refs, row: Array, step: Array, compute) -> None:
    """Runs compute(tile_masked) if the tile is visible; counts it when counting."""

    def counted(tile_masked: bool) -> None:
        compute(tile_masked)
        if r.cfg.count_tiles:
            r.counter[0] += 1

    if not r.cfg.masked:
        counted(False)
        return
    lo, a, c, hi = row_bounds(r.bounds, row)
    visible = jnp.logical_and(lo <= step, step < hi)
    whole = jnp.logical_and(a <= step, step < c)
    pl.when(jnp.logical_and(visible, whole))(lambda: counted(False))
    pl.when(jnp.logical_and(visible, jnp.logical_not(whole)))(lambda: counted(True))


def _start_count(r: _Refs) -> None:
    if r.cfg.count_tiles:
        r.counter[0] = 0


def _store_count(r: _Refs) -> None:
    if r.cfg.count_tiles:
        r.count[...] = jnp.full(r.count.shape, r.counter[0], jnp.int32)


def forward_kernel(*refs, cfg: KernelConfig) -> None:
    """Query block i [X, H] against key block j [Y, H]; at the last j writes O [X, E] and lse [X, 1]."""
    r = _Refs(cfg, refs, ("q", "k", "v"), ("o", "lse"), ("m", "l", "acc"))
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init() -> None:
        r.m[...] = jnp.full(r.m.shape, -jnp.inf, jnp.float32)
        r.l[...] = jnp.zeros(r.l.shape, jnp.float32)
        r.acc[...] = jnp.zeros(r.acc.shape, jnp.float32)
        _start_count(r)

    def compute(tile_masked: bool) -> None:
        s_XY = _dot(r.q[...], r.k[...], 1, 1) * cfg.scale
        if tile_masked:
            s_XY = jnp.where(r.tile_mask(), s_XY, -jnp.inf)
        m_prev_X1 = r.m[...]
        m_new_X1 = jnp.maximum(m_prev_X1, jnp.max(s_XY, axis=1, keepdims=True))
        # A row that has seen no key keeps m = -inf; shift by 0 there so that e^(s - m) is 0, not NaN. An
        # unmasked tile gives every row a finite score.
        m_safe_X1 = jnp.where(m_new_X1 == -jnp.inf, 0.0, m_new_X1) if tile_masked else m_new_X1
        alpha_X1 = jnp.exp(m_prev_X1 - m_safe_X1)
        p_XY = jnp.exp(s_XY - m_safe_X1)
        v_YE = r.v[...]
        r.l[...] = alpha_X1 * r.l[...] + jnp.sum(p_XY, axis=1, keepdims=True)
        r.acc[...] = alpha_X1 * r.acc[...] + _dot(p_XY.astype(v_YE.dtype), v_YE, 1, 0)
        r.m[...] = m_new_X1

    _visit(r, b * cfg.num_i + i, j, compute)

    @pl.when(j == cfg.num_j - 1)
    def _finish() -> None:
        l_X1 = r.l[...]
        seen_X1 = l_X1 > 0
        l_safe_X1 = jnp.where(seen_X1, l_X1, 1.0)
        r.o[...] = (r.acc[...] / l_safe_X1).astype(r.o.dtype)
        # lse = +inf where a row sees nothing makes the backward's P = e^(s - lse) exactly 0 there.
        r.lse[...] = jnp.where(seen_X1, r.m[...] + jnp.log(l_safe_X1), jnp.inf)
        _store_count(r)


def dkdv_kernel(*refs, cfg: KernelConfig) -> None:
    """Key block j [Y, H] against query block i of query head (h G + g); at the last (g, i) writes dK and dV."""
    r = _Refs(cfg, refs, ("q", "k", "v", "do", "lse", "delta"), ("dk", "dv"), ("dk_acc", "dv_acc"))
    b, j, g, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    first, last = jnp.logical_and(g == 0, i == 0), jnp.logical_and(g == cfg.groups - 1, i == cfg.num_i - 1)

    @pl.when(first)
    def _init() -> None:
        r.dk_acc[...] = jnp.zeros(r.dk_acc.shape, jnp.float32)
        r.dv_acc[...] = jnp.zeros(r.dv_acc.shape, jnp.float32)
        _start_count(r)

    def compute(tile_masked: bool) -> None:
        q_XH, k_YH, v_YE, do_XE = r.q[...], r.k[...], r.v[...], r.do[...]
        s_XY = _dot(q_XH, k_YH, 1, 1) * cfg.scale
        if tile_masked:
            s_XY = jnp.where(r.tile_mask(), s_XY, -jnp.inf)
        p_XY = jnp.exp(s_XY - r.lse[...])
        r.dv_acc[...] += _dot(p_XY.T.astype(do_XE.dtype), do_XE, 1, 0)
        ds_XY = p_XY * (_dot(do_XE, v_YE, 1, 1) - r.delta[...])
        r.dk_acc[...] += _dot(ds_XY.T.astype(q_XH.dtype), q_XH, 1, 0)

    _visit(r, b * cfg.num_j + j, i, compute)

    @pl.when(last)
    def _finish() -> None:
        r.dk[...] = (r.dk_acc[...] * cfg.scale).astype(r.dk.dtype)
        r.dv[...] = r.dv_acc[...].astype(r.dv.dtype)
        _store_count(r)


def dq_kernel(*refs, cfg: KernelConfig) -> None:
    """Query block i [X, H] against key block j; at the last j writes dQ [X, H]."""
    r = _Refs(cfg, refs, ("q", "k", "v", "do", "lse", "delta"), ("dq",), ("dq_acc",))
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init() -> None:
        r.dq_acc[...] = jnp.zeros(r.dq_acc.shape, jnp.float32)
        _start_count(r)

    def compute(tile_masked: bool) -> None:
        q_XH, k_YH, v_YE, do_XE = r.q[...], r.k[...], r.v[...], r.do[...]
        s_XY = _dot(q_XH, k_YH, 1, 1) * cfg.scale
        if tile_masked:
            s_XY = jnp.where(r.tile_mask(), s_XY, -jnp.inf)
        p_XY = jnp.exp(s_XY - r.lse[...])
        ds_XY = p_XY * (_dot(do_XE, v_YE, 1, 1) - r.delta[...])
        r.dq_acc[...] += _dot(ds_XY.astype(k_YH.dtype), k_YH, 1, 0)

    _visit(r, b * cfg.num_i + i, j, compute)

    @pl.when(j == cfg.num_j - 1)
    def _finish() -> None:
        r.dq[...] = (r.dq_acc[...] * cfg.scale).astype(r.dq.dtype)
        _store_count(r)
