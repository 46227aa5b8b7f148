"""AttentionMask is the one source of which keys a query sees: for random segment ids, positions, causal and
window, the dense mask (xla), the tiles the blockwise and Pallas kernels rebuild, the tiles they skip, and the
runs of keys linear attention sums over all describe the same pairs.

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import jitted
from tests.helpers.reference import naive_linear_attention
from transformer_jax import ops
from transformer_jax.ops import blockwise, pallas_gpu
from transformer_jax.ops.attention import AttentionMask


def packed_side(rng: np.random.Generator, batch: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids and positions as data/batching.py packs them: runs 1, 2, ... with positions restarting at each,
    a padded tail, and here also a few padding holes (id 0, position 0)."""
    seg_BT = np.sort(rng.integers(1, 5, (batch, length)), axis=1)
    seg_BT[:, length - rng.integers(0, length // 3 + 1) :] = 0
    seg_BT[rng.random((batch, length)) < 0.1] = 0
    pos_BT = np.zeros_like(seg_BT)
    for b in range(batch):
        for s in np.unique(seg_BT[b][seg_BT[b] > 0]):
            run = seg_BT[b] == s
            pos_BT[b, run] = np.arange(run.sum())
    return seg_BT.astype(np.int32), pos_BT.astype(np.int32)


def random_masking(seed: int) -> tuple[int, int, int, dict]:
    """(B, T, S, kwargs of ops.attention) with every combination of the mask's parts over the seeds."""
    rng = np.random.default_rng(seed)
    batch, q_len = 2, int(rng.integers(5, 40))
    self_attention = seed % 2 == 0
    kv_len = q_len if self_attention else int(rng.integers(5, 40))
    kw: dict = dict(causal=bool(rng.integers(2)), window=[None, None, 1, 3, 6, 12, 20][rng.integers(7)])
    if seed % 3:
        q_seg, q_pos = packed_side(rng, batch, q_len)
        kv_seg, kv_pos = (q_seg, q_pos) if self_attention else packed_side(rng, batch, kv_len)
        kw.update(q_segment_ids=jnp.asarray(q_seg), kv_segment_ids=jnp.asarray(kv_seg))
        if seed % 3 == 2:  # explicit positions; otherwise queries are aligned to the end of the keys
            kw.update(q_positions=jnp.asarray(q_pos), kv_positions=jnp.asarray(kv_pos))
    return batch, q_len, kv_len, kw


def dense(batch: int, q_len: int, kv_len: int, mask: AttentionMask) -> np.ndarray:
    """[B, T, S] bool, with None (nothing masked) spelled out."""
    mask_B1TS = mask.dense()
    return np.ones((batch, q_len, kv_len), bool) if mask_B1TS is None else np.asarray(mask_B1TS[:, 0])


def seeds(keep=lambda seed: True, fast: int = 3) -> list:
    """24 random setups; the first `fast` that `keep` accepts run by default (seeds 0-2: self-attention without
    segments, cross-attention with segments, self-attention with segments and positions), the rest with -m slow."""
    chosen = [s for s in range(24) if keep(s)]
    return [s if i < fast else pytest.param(s, marks=pytest.mark.slow) for i, s in enumerate(chosen)]


SEEDS = seeds()


@pytest.mark.parametrize("seed", SEEDS)
def test_tiles_of_blockwise_and_pallas_assemble_to_the_dense_mask(seed: int) -> None:
    batch, q_len, kv_len, kw = random_masking(seed)
    mask = AttentionMask.create(batch, q_len, kv_len, **kw)
    want_BTS = dense(batch, q_len, kv_len, mask)
    x, num_i = blockwise._split_blocks(q_len, 16)
    y, num_j = blockwise._split_blocks(kv_len, 16)
    padded = mask.pad(batch, q_len, kv_len, x * num_i, y * num_j)
    q_vecs, kv_vecs = blockwise._vector_blocks(padded, blockwise._Static(1.0, x, y))
    cfg = pallas_gpu.KernelConfig(1.0, padded.static(), padded.segments, padded.positions, groups=1)
    got_BTS = np.ones((batch, x * num_i, y * num_j), bool)
    kernel_BTS = np.ones_like(got_BTS)
    for i in range(num_i):
        for j in range(num_j):
            q_vec = tuple(None if v is None else v[i] for v in q_vecs)  # [B, X]
            kv_vec = tuple(None if v is None else v[j] for v in kv_vecs)  # [B, Y]
            tile = blockwise._tile_mask(padded, q_vec, kv_vec)  # [B, 1, 1, X, Y]
            if tile is not None:
                got_BTS[:, i * x : (i + 1) * x, j * y : (j + 1) * y] = np.asarray(tile[:, 0, 0])
            for b in range(batch):
                kernel_tile = cfg.mask.tile(  # as the GPU kernels build it (pallas_gpu._scores)
                    *(None if v is None else v[b] for v in q_vec),  # [X]
                    *(None if v is None else v[b] for v in kv_vec),  # [Y]
                )
                if kernel_tile is not None:
                    kernel_BTS[b, i * x : (i + 1) * x, j * y : (j + 1) * y] = np.asarray(kernel_tile)
    np.testing.assert_array_equal(got_BTS[:, :q_len, :kv_len], want_BTS)
    np.testing.assert_array_equal(kernel_BTS[:, :q_len, :kv_len], want_BTS)
    # Tokens added to fill the last tiles are seen by nobody.
    if x * num_i > q_len or y * num_j > kv_len:
        assert not got_BTS[:, q_len:].any() and not got_BTS[:, :, kv_len:].any()


def check_loop_bounds(batch: int, q_len: int, kv_len: int, kw: dict, x: int, y: int) -> None:
    """Bounds over [X, Y] tiles skip only tiles where nothing is visible and leave unmasked only fully visible ones."""
    mask = AttentionMask.create(batch, q_len, kv_len, **kw)
    t_pad, s_pad = -(-q_len // x) * x, -(-kv_len // y) * y
    bounds_BI4 = np.asarray(mask.pad(batch, q_len, kv_len, t_pad, s_pad).loop_bounds(x, y))
    padded_BTS = np.zeros((batch, t_pad, s_pad), bool)
    padded_BTS[:, :q_len, :kv_len] = dense(batch, q_len, kv_len, mask)
    tiles_BIXJY = padded_BTS.reshape(batch, t_pad // x, x, s_pad // y, y)
    visible_BIJ, full_BIJ = tiles_BIXJY.any((2, 4)), tiles_BIXJY.all((2, 4))
    j_J = np.arange(visible_BIJ.shape[-1])
    for b, i in np.ndindex(bounds_BI4.shape[:2]):
        lo, a, c, hi = bounds_BI4[b, i]
        assert lo <= a <= c <= hi
        assert not visible_BIJ[b, i][(j_J < lo) | (j_J >= hi)].any(), (b, i, bounds_BI4[b, i])
        assert full_BIJ[b, i][(j_J >= a) & (j_J < c)].all(), (b, i, bounds_BI4[b, i])


@pytest.mark.parametrize("seed", SEEDS)
def test_skipped_tiles_are_invisible_and_unmasked_tiles_fully_visible(seed: int) -> None:
    batch, q_len, kv_len, kw = random_masking(seed)
    if not AttentionMask.create(batch, q_len, kv_len, **kw).masks_anything:
        pytest.skip("nothing is masked: every tile is visited without a mask")
    check_loop_bounds(batch, q_len, kv_len, kw, *[(4, 8), (8, 4), (4, 4)][seed % 3])


@pytest.mark.parametrize("causal", [True, False])
def test_tiles_on_the_edges_of_a_window_band_keep_their_mask(causal: bool) -> None:
    """4 x 4 tiles span 7 distances: a causal window of 6 (7 non-causal) has tiles just too wide to be unmasked."""
    check_loop_bounds(1, 32, 32, dict(causal=causal, window=6 if causal else 7), 4, 4)


@pytest.mark.parametrize("seed", SEEDS)
def test_key_ranges_of_linear_attention_are_the_dense_mask(seed: int) -> None:
    batch, q_len, kv_len, kw = random_masking(seed)
    mask = AttentionMask.create(batch, q_len, kv_len, **kw)
    first_BT, end_BT = (np.asarray(x) for x in mask.key_ranges(batch, q_len, kv_len))
    s_S = np.arange(kv_len)
    in_run_BTS = (first_BT[:, :, None] <= s_S) & (s_S < end_BT[:, :, None])
    real_BS = np.ones((batch, kv_len), bool) if not mask.segments else np.asarray(kw["kv_segment_ids"]) > 0
    np.testing.assert_array_equal(in_run_BTS & real_BS[:, None, :], dense(batch, q_len, kv_len, mask))


@pytest.mark.parametrize("seed", seeds(lambda s: random_masking(s)[3]["window"] is None))  # no windows
def test_linear_attention_sums_over_the_dense_mask(seed: int) -> None:
    batch, q_len, kv_len, kw = random_masking(seed)
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, q_len, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((batch, kv_len, 2, 8)), jnp.float32) for _ in range(2))
    got = jitted(ops.attention, q, k, v, impl="linear", **kw)
    np.testing.assert_allclose(got, naive_linear_attention(q, k, v, **kw), rtol=1e-4, atol=1e-5)
