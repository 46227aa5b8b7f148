"""What the blocked attention implementations share: per-token mask vectors, padding, and per-tile visibility.

The shared semantics of attention.py reduce to four per-token vectors: segment ids and positions of the queries
and of the keys. Blocked implementations never build the [T, S] mask; they rebuild one [X, Y] tile at a time from
these vectors, and skip tiles that no query can see.

Axis legend: B batch, T query length, S key/value length, X query block size, Y key block size,
I query blocks (T / X), J key blocks (S / Y).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class MaskVectors(NamedTuple):
    """Per-token inputs of the mask; a field is None when that part of the mask is off."""

    q_segment_ids: Array | None  # [B, T] int32, <= 0 is padding
    kv_segment_ids: Array | None  # [B, S] int32
    q_positions: Array | None  # [B, T] int32; set only when causal or windowed
    kv_positions: Array | None  # [B, S] int32


def mask_vectors(
    batch: int,
    q_len: int,
    kv_len: int,
    *,
    q_segment_ids: Array | None,
    kv_segment_ids: Array | None,
    causal: bool,
    q_positions: Array | None,
    kv_positions: Array | None,
    window: int | None,
) -> MaskVectors:
    """The mask vectors of attention.py's conventions (missing segment side = all ones, end-aligned positions)."""
    if window is not None and window <= 0:
        raise ValueError(f"attention window must be a positive number of tokens, got {window}")
    q_seg_BT = kv_seg_BS = q_pos_BT = kv_pos_BS = None
    if q_segment_ids is not None or kv_segment_ids is not None:
        q_seg_BT = jnp.ones((batch, q_len), jnp.int32) if q_segment_ids is None else q_segment_ids.astype(jnp.int32)
        kv_seg_BS = jnp.ones((batch, kv_len), jnp.int32) if kv_segment_ids is None else kv_segment_ids.astype(jnp.int32)
    if causal or window is not None:
        # Without positions, query i sits at position i + S - T: queries are aligned to the end of the keys.
        default_q = jnp.arange(q_len, dtype=jnp.int32) + (kv_len - q_len)
        q_pos_BT = jnp.broadcast_to(default_q, (batch, q_len)) if q_positions is None else q_positions
        kv_pos_BS = (
            jnp.broadcast_to(jnp.arange(kv_len, dtype=jnp.int32), (batch, kv_len))
            if kv_positions is None
            else kv_positions
        )
        q_pos_BT, kv_pos_BS = q_pos_BT.astype(jnp.int32), kv_pos_BS.astype(jnp.int32)
    for name, arr, length in (
        ("q_segment_ids", q_seg_BT, q_len),
        ("kv_segment_ids", kv_seg_BS, kv_len),
        ("q_positions", q_pos_BT, q_len),
        ("kv_positions", kv_pos_BS, kv_len),
    ):
        if arr is not None and arr.shape != (batch, length):
            raise ValueError(f"attention: {name} must have shape {(batch, length)}, got {arr.shape}")
    return MaskVectors(q_seg_BT, kv_seg_BS, q_pos_BT, kv_pos_BS)


def zero_padding_tokens(q: Array, k: Array, v: Array, vectors: MaskVectors) -> tuple[Array, Array, Array]:
    """Zeros q/k/v at padding tokens (segment id <= 0): whatever they hold (NaN, 1e30) must not reach real rows.

    A masked score is dropped by `where`, but 0 * NaN in P V or dS K is NaN, so the values themselves go.
    """
    q_seg_BT, kv_seg_BS = vectors.q_segment_ids, vectors.kv_segment_ids
    if q_seg_BT is None:
        return q, k, v
    q = jnp.where((q_seg_BT > 0)[:, :, None, None], q, jnp.zeros((), q.dtype))
    k = jnp.where((kv_seg_BS > 0)[:, :, None, None], k, jnp.zeros((), k.dtype))
    v = jnp.where((kv_seg_BS > 0)[:, :, None, None], v, jnp.zeros((), v.dtype))
    return q, k, v


def pad_tokens(x: Array, length: int, value: int | float = 0) -> Array:
    """Pads axis 1 (tokens) of x to `length` with `value`."""
    pad = length - x.shape[1]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def pad_vectors(vectors: MaskVectors, batch: int, q_len: int, kv_len: int, q_pad: int, kv_pad: int) -> MaskVectors:
    """Pads the mask vectors to q_pad, kv_pad tokens; padded tokens get segment id 0, so no query sees them."""
    q_seg_BT, kv_seg_BS, q_pos_BT, kv_pos_BS = vectors
    if (q_pad != q_len or kv_pad != kv_len) and q_seg_BT is None:
        q_seg_BT = jnp.ones((batch, q_len), jnp.int32)
        kv_seg_BS = jnp.ones((batch, kv_len), jnp.int32)
    q_seg_BT = None if q_seg_BT is None else pad_tokens(q_seg_BT, q_pad)
    kv_seg_BS = None if kv_seg_BS is None else pad_tokens(kv_seg_BS, kv_pad)
    q_pos_BT = None if q_pos_BT is None else pad_tokens(q_pos_BT, q_pad)
    kv_pos_BS = None if kv_pos_BS is None else pad_tokens(kv_pos_BS, kv_pad)
    return MaskVectors(q_seg_BT, kv_seg_BS, q_pos_BT, kv_pos_BS)


def visible(
    q_seg: Array | None,
    kv_seg: Array | None,
    q_pos: Array | None,
    kv_pos: Array | None,
    *,
    causal: bool,
    window: int | None,
) -> Array | None:
    """Boolean tile (True = may attend) from broadcastable query and key vectors, e.g. [X, 1] and [1, Y].

    Written with elementwise ops only, so that it also lowers inside Pallas kernels.
    """
    mask = None

    def conjoin(m: Array) -> None:
        nonlocal mask
        mask = m if mask is None else jnp.logical_and(mask, m)

    if q_seg is not None:
        conjoin(jnp.logical_and(q_seg == kv_seg, q_seg > 0))
    if q_pos is not None:
        delta = q_pos - kv_pos
        if causal:
            conjoin(delta >= 0)
        if window is not None:
            conjoin(delta < window)
            if not causal:
                conjoin(delta > -window)
    return mask


def _block_min_max(x_BT: Array, block: int) -> tuple[Array, Array]:
    x_BIX = x_BT.reshape(x_BT.shape[0], -1, block)
    return x_BIX.min(-1), x_BIX.max(-1)


def tile_visibility(
    vectors: MaskVectors, block_q: int, block_k: int, *, causal: bool, window: int | None
) -> tuple[Array, Array] | None:
    """(any_BIJ, all_BIJ): whether some / every query of block i may see some / every key of block j.

    `any` is conservative (it may say True for a tile where nothing is visible, never the reverse); `all` is exact
    enough to be safe (True only if every pair is visible, so such a tile needs no mask). None when nothing is masked.
    """
    q_seg_BT, kv_seg_BS, q_pos_BT, kv_pos_BS = vectors
    if q_seg_BT is None and q_pos_BT is None:
        return None
    any_BIJ = all_BIJ = None

    def conjoin(a: Array, b: Array) -> None:
        nonlocal any_BIJ, all_BIJ
        any_BIJ = a if any_BIJ is None else jnp.logical_and(any_BIJ, a)
        all_BIJ = b if all_BIJ is None else jnp.logical_and(all_BIJ, b)

    big = jnp.iinfo(jnp.int32).max
    if q_seg_BT is not None:
        # Some pair may match if the ranges of positive ids overlap; all pairs match if one positive id fills both.
        q_lo_BI, _ = _block_min_max(jnp.where(q_seg_BT > 0, q_seg_BT, big), block_q)
        _, q_hi_BI = _block_min_max(jnp.where(q_seg_BT > 0, q_seg_BT, 0), block_q)
        k_lo_BJ, _ = _block_min_max(jnp.where(kv_seg_BS > 0, kv_seg_BS, big), block_k)
        _, k_hi_BJ = _block_min_max(jnp.where(kv_seg_BS > 0, kv_seg_BS, 0), block_k)
        q_min_BI, q_max_BI = _block_min_max(q_seg_BT, block_q)
        k_min_BJ, k_max_BJ = _block_min_max(kv_seg_BS, block_k)
        overlap = jnp.logical_and(
            q_lo_BI[:, :, None] <= k_hi_BJ[:, None, :], k_lo_BJ[:, None, :] <= q_hi_BI[:, :, None]
        )
        one_id = (q_min_BI == q_max_BI)[:, :, None] & (k_min_BJ == k_max_BJ)[:, None, :]
        same = (q_min_BI[:, :, None] == k_min_BJ[:, None, :]) & (q_min_BI[:, :, None] > 0)
        conjoin(overlap, one_id & same)
    if q_pos_BT is not None:
        q_min_BI, q_max_BI = _block_min_max(q_pos_BT, block_q)
        k_min_BJ, k_max_BJ = _block_min_max(kv_pos_BS, block_k)
        # delta = p_q - p_k ranges over [lo, hi] within the tile.
        lo_BIJ = q_min_BI[:, :, None] - k_max_BJ[:, None, :]
        hi_BIJ = q_max_BI[:, :, None] - k_min_BJ[:, None, :]
        if causal:
            conjoin(hi_BIJ >= 0, lo_BIJ >= 0)
        if window is not None:
            conjoin(lo_BIJ < window, hi_BIJ < window)
            if not causal:
                conjoin(hi_BIJ > -window, lo_BIJ > -window)
    return any_BIJ, all_BIJ


def loop_bounds(any_BIJ: Array, all_BIJ: Array) -> Array:
    """Per row of tiles, int32 [B, I, 4] = (lo, a, c, hi): visit tiles [lo, hi); those in [a, c) need no mask.

    Tiles outside [lo, hi) are invisible and skipped; [lo, a) and [c, hi) are visited with the mask.
    """
    num_j = any_BIJ.shape[-1]
    j_J = jnp.arange(num_j, dtype=jnp.int32)
    some = any_BIJ.any(-1)
    lo = jnp.where(some, jnp.argmax(any_BIJ, -1), 0)
    hi = jnp.where(some, num_j - jnp.argmax(any_BIJ[..., ::-1], -1), 0)
    all_BIJ = jnp.logical_and(all_BIJ, any_BIJ)
    some_full = all_BIJ.any(-1)
    a = jnp.where(some_full, jnp.argmax(all_BIJ, -1), hi)
    # The run of unmasked tiles ends at the first tile after `a` that needs a mask.
    broken_BIJ = jnp.logical_and(~all_BIJ, j_J >= a[..., None])
    c = jnp.where(broken_BIJ.any(-1), jnp.argmax(broken_BIJ, -1), num_j)
    c = jnp.where(some_full, jnp.minimum(c, hi), hi)
    return jnp.stack([lo, a, c, hi], axis=-1).astype(jnp.int32)
