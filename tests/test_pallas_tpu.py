"""Our Pallas TPU (Mosaic) kernels, run on the CPU in TPU interpret mode, match the xla reference in values and
dQ/dK/dV under every mask, skip exactly the tiles that the mask empties, and refuse what they cannot take.

Interpret mode simulates every grid step (DMAs, VMEM, SMEM), about 50-100 ms a step on this CPU, so the default
cases use the smallest tiles the layout rules allow (16 queries x 128 keys) and a few dozen grid steps each;
`-m slow` sweeps head dims 32/64/128 x both dtypes x masks. Tolerances: tests/helpers/attention.py's TOLERANCE.

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from tests.helpers.attention import TPU_CASES as CASES
from tests.helpers.attention import TPU_SMALL as SMALL
from tests.helpers.attention import Case, assert_matches, forward_backward, make_inputs, reference
from transformer_jax import ops, runtime
from transformer_jax.ops import pallas_gpu, pallas_tpu
from transformer_jax.ops.attention import AttentionMask, array_module


@pytest.fixture
def tpu_interpret():
    """Builds programs for TPU (target_backend() == "tpu") and runs their Pallas kernels in TPU interpret mode."""
    with runtime.compiling_for("tpu"), pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        yield


def check(case: Case, dtype: jnp.dtype, sizes: pallas_tpu.TpuBlockSizes = SMALL) -> None:
    arrays, kw = make_inputs(case, dtype)
    got = jax.jit(lambda a: forward_backward("pallas", a, kw, block_sizes=sizes))(arrays)
    assert_matches(got, reference(arrays, kw), dtype, f"pallas tpu {case.name} {jnp.dtype(dtype).name}")


@pytest.mark.parametrize("case,dtype", CASES, ids=[c.name for c, _ in CASES])
def test_matches_reference(tpu_interpret, case: Case, dtype: jnp.dtype) -> None:
    check(case, dtype)


def visible_tiles(mask: AttentionMask, block_q: int, block_k: int) -> np.ndarray:
    """[B, I, J]: whether some query of tile (i, j) sees some key, from the dense mask (the exact answer)."""
    dense_BTS = np.asarray(mask.dense()[:, 0])
    b, t, s = dense_BTS.shape
    return dense_BTS.reshape(b, t // block_q, block_q, s // block_k, block_k).any(axis=(2, 4))


def test_tiles_computed_are_the_tiles_the_mask_leaves(tpu_interpret) -> None:
    """Counted inside the kernels: each resident block computes exactly its visible tiles, no more, no fewer."""
    case = Case("packed_causal", batch=1, q_len=44, kv_len=260, heads=2, kv_heads=1, segments="packed", causal=True)
    (q, k, v, _), kw = make_inputs(case, jnp.float32)
    # Contiguous segments and a causal rule: loop_bounds' [lo, hi) holds no invisible tile, so planned == exact.
    kw["q_segment_ids"] = jnp.asarray([[1] * 15 + [2] * 22 + [0] * 7], jnp.int32)
    kw["kv_segment_ids"] = jnp.asarray([[1] * 120 + [2] * 110 + [0] * 30], jnp.int32)
    mask = AttentionMask.create(1, case.q_len, case.kv_len, **kw)
    counts = jax.jit(lambda q, k, v, m: pallas_tpu.tile_counts(q, k, v, m, block_sizes=SMALL))(q, k, v, mask)
    padded = mask.pad(1, case.q_len, case.kv_len, 48, 384)
    exact_BIJ = visible_tiles(padded, SMALL.fwd_q, SMALL.fwd_k)
    assert 0 < exact_BIJ.sum() < exact_BIJ.size  # some tiles are skipped, some computed
    forward_BNI = np.asarray(counts["forward"][..., 0, 0])
    np.testing.assert_array_equal(forward_BNI, np.broadcast_to(exact_BIJ.sum(-1)[:, None], forward_BNI.shape))
    np.testing.assert_array_equal(counts["dq"][..., 0, 0], counts["forward"][..., 0, 0])  # same tiles as forward
    dkdv_BKJ = np.asarray(counts["dkdv"][..., 0, 0])  # summed over the group's G = 2 query heads
    np.testing.assert_array_equal(dkdv_BKJ, np.broadcast_to(2 * exact_BIJ.sum(1)[:, None], dkdv_BKJ.shape))
    planned = pallas_tpu.planned_tiles(padded, 1, case.heads, case.kv_heads, SMALL)
    assert planned == dict(forward=int(forward_BNI.sum()), dkdv=int(dkdv_BKJ.sum()), dq=int(forward_BNI.sum()))


def test_skipping_a_visible_tile_is_caught(tpu_interpret, monkeypatch: pytest.MonkeyPatch) -> None:
    """The value check has the power to see a skipped tile: with each row's last visible tile dropped from the
    loop bounds, the kernel's output no longer equals the reference."""
    case = Case("window", batch=1, q_len=40, kv_len=290, heads=1, kv_heads=1, window=100, causal=True)
    (q, k, v, _), kw = make_inputs(case, jnp.float32)
    want = ops.attention(q, k, v, impl="xla", **kw)
    out = jax.jit(lambda q, k, v: ops.attention(q, k, v, impl="pallas", block_sizes=SMALL, **kw))(q, k, v)
    np.testing.assert_allclose(out, want, atol=2e-5)
    loop_bounds = AttentionMask.loop_bounds

    def drop_last_tile(self: AttentionMask, *args, **kwargs) -> jax.Array:
        bounds = loop_bounds(self, *args, **kwargs)
        xp = array_module(bounds)  # numpy for the cost estimate's count, jax.numpy for the kernels' bounds
        lo, a, c, hi = xp.moveaxis(bounds, -1, 0)
        hi = xp.maximum(hi - 1, lo)
        return xp.stack([lo, xp.minimum(a, hi), xp.minimum(c, hi), hi], axis=-1)

    monkeypatch.setattr(AttentionMask, "loop_bounds", drop_last_tile)
    broken = jax.jit(lambda q, k, v: ops.attention(q, k, v, impl="pallas", block_sizes=SMALL, **kw))(q, k, v)
    assert np.max(np.abs(np.asarray(broken) - np.asarray(want))) > 1e-2


def test_bad_inputs_are_one_clear_line_at_trace_time() -> None:
    q = jax.ShapeDtypeStruct((1, 128, 2, 300), jnp.bfloat16)
    half = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.float16)
    bf16 = half.update(dtype=jnp.bfloat16)
    with runtime.compiling_for("tpu"):
        with pytest.raises(ValueError, match="head dims up to 256; got q/k 300.*impl='blockwise'"):
            jax.eval_shape(lambda q: ops.attention(q, q, q, impl="pallas"), q)
        with pytest.raises(ValueError, match="all float32 or all bfloat16; got float16.*Cast them"):
            jax.eval_shape(lambda q: ops.attention(q, q, q, impl="pallas"), half)
        with pytest.raises(ValueError, match="fwd_k=64 must be a multiple of 128"):
            sizes = pallas_tpu.TpuBlockSizes(16, 64, 16, 128)
            jax.eval_shape(lambda q: ops.attention(q, q, q, impl="pallas", block_sizes=sizes), bf16)
        with pytest.raises(ValueError, match="block_sizes for backend 'tpu' must be TpuBlockSizes"):
            gpu_sizes = pallas_gpu.BlockSizes(16, 16, 16, 16, 16, 16)
            jax.eval_shape(lambda q: ops.attention(q, q, q, impl="pallas", block_sizes=gpu_sizes), bf16)


def test_tile_table_obeys_the_layout_rules() -> None:
    for head_dim in (32, 64, 128, 256):
        sizes = pallas_tpu.block_sizes_for(head_dim)
        sizes.check()
        assert sizes.fit(37, 1000) == dataclasses.replace(sizes, fwd_q=48, bwd_q=48)


# --- slow: the sweep ------------------------------------------------------------------------------------------

SWEEP_MASKS = [
    Case("plain", batch=2, q_len=37, kv_len=150),
    Case("causal", batch=1, q_len=150, kv_len=150, causal=True),
    Case("packed_causal_mqa", batch=2, q_len=70, kv_len=200, kv_heads=1, segments="packed", causal=True),
    Case("window_positions", batch=1, q_len=40, kv_len=260, window=30, positions=True, causal=True),
    Case("padding_window", batch=2, q_len=21, kv_len=140, window=9, segments="padding"),
    Case("disjoint_rows", batch=1, q_len=33, kv_len=129, segments="disjoint", causal=True),
]


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", (32, 64, 128))
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", SWEEP_MASKS, ids=lambda c: c.name)
def test_sweep(tpu_interpret, case: Case, dtype: jnp.dtype, head_dim: int) -> None:
    check(dataclasses.replace(case, heads=2, kv_heads=min(case.kv_heads, 2), head_dim=head_dim), dtype)
