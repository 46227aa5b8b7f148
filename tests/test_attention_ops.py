"""Every attention implementation matches the xla reference in values and dQ/dK/dV, under every mask.

Fast by default: tiny shapes with 16-token tiles so that every case spans several tiles, partial tiles and
skipped tiles. pallas runs in interpret mode here (about 2-4 s a case), so it gets a handful of combined cases;
`-m slow` sweeps dtypes x head dims x masks for both blockwise and pallas.

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import jitted
from tests.helpers.attention import (
    TILES,
    Case,
    assert_matches,
    check,
    forward_backward,
    make_inputs,
    reference,
)
from transformer_jax import ops
from transformer_jax.ops.attention import AttentionMask

BLOCKWISE_CASES = [
    Case("plain_hd32"),
    Case("cross_causal_gqa_hd64", q_len=37, kv_len=45, kv_heads=2, head_dim=64, causal=True),
    Case("causal_more_queries_than_keys_hd80", q_len=45, kv_len=20, head_dim=80, causal=True),  # early rows see none
    Case("packed_causal_mqa_hd128", q_len=40, kv_len=40, kv_heads=1, head_dim=128, segments="packed", causal=True),
    Case("window_causal_positions_hd256", q_len=33, kv_len=50, head_dim=256, window=7, causal=True, positions=True),
    Case("window_padding_value_dim", q_len=21, kv_len=50, head_dim=64, value_dim=24, window=9, segments="padding"),
    Case("disjoint_rows", segments="disjoint", causal=True),
]


@pytest.mark.parametrize("case", BLOCKWISE_CASES, ids=lambda c: c.name)
def test_blockwise_matches_reference(case: Case) -> None:
    check("blockwise", case)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_blockwise_low_precision(dtype: jnp.dtype) -> None:
    check("blockwise", Case("packed_cross_gqa", q_len=30, kv_len=47, kv_heads=2, segments="packed", causal=True), dtype)


# --- pallas (interpret mode on CPU): few, combined cases -------------------------------------------------------

PALLAS_CASES = [
    # Cross-attention, end-aligned causal, packed + padded segments, grouped heads, head dim 80 padded to 128.
    (Case("cross_packed_causal_gqa_hd80", q_len=29, kv_len=43, kv_heads=2, head_dim=80, segments="packed",
          causal=True), jnp.float32),
    # Shuffled positions make every tile masked and the loop bounds non-trivial; value dim != head dim.
    (Case("window_positions_value_dim", batch=1, q_len=40, kv_len=36, heads=2, kv_heads=2, head_dim=32,
          value_dim=16, window=6, positions=True), jnp.float32),
    (Case("causal_mqa_bf16", batch=1, q_len=48, kv_len=48, heads=2, kv_heads=1, head_dim=64, causal=True),
     jnp.bfloat16),
    (Case("disjoint_rows_f16", batch=1, q_len=33, kv_len=33, heads=2, kv_heads=2, segments="disjoint",
          causal=True), jnp.float16),
]  # fmt: skip


@pytest.mark.parametrize("case,dtype", PALLAS_CASES, ids=[c.name for c, _ in PALLAS_CASES])
def test_pallas_matches_reference(case: Case, dtype: jnp.dtype) -> None:
    check("pallas", case, dtype)


def test_pallas_lowers_for_triton() -> None:
    """The kernels lower to Triton IR for a GPU (no GPU needed); PTX compilation itself is not checked here."""
    q = jax.ShapeDtypeStruct((2, 300, 4, 80), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 200, 2, 80), jnp.bfloat16)
    seg_q, seg_kv = jax.ShapeDtypeStruct((2, 300), jnp.int32), jax.ShapeDtypeStruct((2, 200), jnp.int32)
    for masked in (False, True):

        def loss(q: jax.Array, k: jax.Array, v: jax.Array, sq: jax.Array, skv: jax.Array, masked: bool = masked):
            kw = dict(causal=True, window=64, q_segment_ids=sq, kv_segment_ids=skv) if masked else {}
            out = ops.attention(q, k, v, impl="pallas", backend="gpu", **kw)
            return out.astype(jnp.float32).sum()

        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, seg_q, seg_kv)
        text = lowered.lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 3  # forward, dK/dV, dQ


# --- properties shared by the implementations -------------------------------------------------------------------

PADDED = Case("padded", q_len=26, kv_len=35, kv_heads=2, segments="packed", causal=True)


@pytest.mark.parametrize("impl", ["blockwise", "pallas"])
def test_padding_never_leaks(impl: str) -> None:
    """NaN in padding tokens (segment id 0) changes nothing: outputs and gradients equal the clean reference."""
    (q, k, v, do), kw = make_inputs(PADDED, jnp.float32)
    want = reference((q, k, v, do), kw)
    q_pad = (kw["q_segment_ids"] <= 0)[:, :, None, None]
    kv_pad = (kw["kv_segment_ids"] <= 0)[:, :, None, None]
    poisoned = (jnp.where(q_pad, jnp.nan, q), jnp.where(kv_pad, jnp.nan, k), jnp.where(kv_pad, jnp.nan, v), do)
    got = jax.jit(lambda a: forward_backward(impl, a, kw, **TILES[impl]))(poisoned)
    assert_matches(got, want, jnp.float32, f"{impl} with NaN padding")


def test_fully_masked_rows_are_zero() -> None:
    """Rows that see no key (causal with T > S, disjoint segments) give exact zeros and zero gradients."""
    case = Case("disjoint", q_len=40, kv_len=24, segments="disjoint", causal=True)
    arrays, kw = make_inputs(case, jnp.float32)
    out, dq, _, _ = jax.jit(lambda a: forward_backward("blockwise", a, kw, **TILES["blockwise"]))(arrays)
    mask = jax.jit(lambda: ops.attention_mask(case.batch, case.q_len, case.kv_len, **kw))()  # [B, 1, T, S]
    blind = ~np.any(np.asarray(mask)[:, 0], axis=-1)  # [B, T]
    assert int(blind.sum()) > 10
    assert np.all(np.asarray(out)[blind] == 0.0) and np.all(np.asarray(dq)[blind] == 0.0)


@pytest.mark.parametrize("impl", ["blockwise", "pallas"])
def test_rows_are_deterministic_functions_of_themselves(impl: str) -> None:
    """Reversing the batch reverses outputs and gradients bit for bit, in a separately compiled program.

    A row's result may depend on nothing but that row: not on which grid program or scan step computes it, nor on
    the other rows' masks and loop bounds (e.g. an index map that reads row 0's bounds), nor on compilation.
    """
    case = Case("det", batch=3, q_len=30, kv_len=41, kv_heads=2, segments="packed", causal=True)
    arrays, kw = make_inputs(case, jnp.float32)
    flipped = tuple(x[::-1] for x in arrays), {k: v[::-1] if isinstance(v, jax.Array) else v for k, v in kw.items()}
    assert not np.array_equal(kw["q_segment_ids"], flipped[1]["q_segment_ids"]), "rows should differ in their masks"
    first = jax.jit(lambda a: forward_backward(impl, a, kw, **TILES[impl]))(arrays)
    second = jax.jit(lambda a: forward_backward(impl, a, flipped[1], **TILES[impl]))(flipped[0])
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[::-1])


@pytest.mark.parametrize("impl", ["blockwise", "pallas"])
def test_composes_with_vmap_remat_grad(impl: str) -> None:
    """vmap over an extra leading axis, jax.checkpoint around the call, grad through both, all under jit."""
    case = Case("compose", batch=1, q_len=20, kv_len=20, heads=2, kv_heads=1, causal=True)
    (q, k, v, _), _ = make_inputs(case, jnp.float32)
    q2, k2, v2 = (jnp.stack([x, 0.5 * x]) for x in (q, k, v))  # [2, B, T, N, H]

    def loss(impl: str, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        extra = TILES.get(impl, {})
        attend = jax.checkpoint(lambda q, k, v: ops.attention(q, k, v, causal=True, impl=impl, **extra))
        return jnp.sum(jnp.sin(jax.vmap(attend)(q, k, v)))

    with jax.default_matmul_precision("highest"):
        want = jax.jit(jax.value_and_grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2)))(q2, k2, v2)
    got = jax.jit(jax.value_and_grad(lambda *a: loss(impl, *a), argnums=(0, 1, 2)))(q2, k2, v2)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


# --- cudnn and auto ----------------------------------------------------------------------------------------------


def test_cudnn_fails_clearly_off_gpu() -> None:
    q = jnp.zeros((1, 8, 2, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        ops.attention(q, q, q, impl="cudnn")


def test_cudnn_refuses_what_it_cannot_compute() -> None:
    q = jnp.zeros((1, 8, 4, 64), jnp.bfloat16)
    kv = jnp.zeros((1, 12, 2, 64), jnp.bfloat16)
    seg = jnp.ones((1, 8), jnp.int32)

    def unsupported(q: jax.Array, kv: jax.Array, v: jax.Array, **kw) -> list[str]:
        mask = AttentionMask.create(q.shape[0], q.shape[1], kv.shape[1], **kw)
        return ops.cudnn_unsupported(q, kv, v, mask, backend="gpu")

    assert unsupported(q, kv, kv) == []
    cases = {
        "segment ids": dict(q_segment_ids=seg),
        "sliding window": dict(window=4),
        "causal masking with query length 8 != key length 12": dict(causal=True),
        "explicit positions": dict(q_positions=seg, kv_positions=jnp.ones((1, 12), jnp.int32)),
    }
    for reason, kw in cases.items():
        (got,) = unsupported(q, kv, kv, **kw)
        assert reason in got
    assert "bfloat16 or all float16" in unsupported(q.astype(jnp.float32), kv, kv)[0]
    assert "value head dim" in unsupported(q, kv, kv[..., :32])[0]


def test_auto_choice() -> None:
    small = jnp.zeros((2, 64, 4, 32), jnp.bfloat16)
    long = jax.ShapeDtypeStruct((1, 8192, 4, 64), jnp.bfloat16)
    seg = jnp.ones((2, 64), jnp.int32)

    def choose(x: jax.Array, backend: str, **kw) -> str:
        return ops.choose_impl(x, x, x, AttentionMask.create(*x.shape[:2], x.shape[1], **kw), backend=backend)

    assert choose(small, "cpu") == "xla"
    assert choose(long, "cpu") == "blockwise"
    assert choose(long, "tpu", causal=True) == "pallas"
    assert choose(small, "tpu") == "xla"  # shorter than one TPU tile
    assert choose(small, "gpu", causal=True) == "cudnn"
    assert choose(small, "gpu", q_segment_ids=seg) == "pallas"
    assert choose(small.astype(jnp.float32), "gpu") == "pallas"
    # auto runs end to end on this machine
    arrays, kw = make_inputs(Case("auto", segments="packed", causal=True), jnp.float32)
    out = jax.jit(lambda a: ops.attention(*a, impl="auto", **kw))(arrays[:3])
    np.testing.assert_allclose(out, jax.jit(lambda a: ops.attention(*a, impl="xla", **kw))(arrays[:3]), atol=1e-5)


def test_unsupported_combinations_fail_clearly() -> None:
    q = jnp.zeros((1, 8, 2, 512), jnp.float32)
    with pytest.raises(ValueError, match="head dims up to 256"):
        ops.attention(q, q, q, impl="pallas")
    small = jnp.zeros((1, 8, 2, 32), jnp.float32)
    with pytest.raises(ValueError, match="one dtype"):
        ops.attention(small, small, small.astype(jnp.bfloat16), impl="pallas")
    with pytest.raises(ValueError, match="on TPU needs q, k, v all float32 or all bfloat16"):
        ops.attention(*(small.astype(jnp.float16),) * 3, impl="pallas", backend="tpu")
    for impl in ("blockwise", "pallas"):
        with pytest.raises(ValueError, match="positive number of tokens"):
            ops.attention(small, small, small, impl=impl, window=0)
        with pytest.raises(ValueError, match="query heads is not a multiple"):
            ops.attention(small, small[:, :, :1].repeat(3, 2), small[:, :, :1].repeat(3, 2), impl=impl)


# --- slow: the exhaustive sweep -------------------------------------------------------------------------------

HEAD_DIMS = (32, 64, 80, 128, 256)
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MASKS = [
    Case("plain"),
    Case("cross_causal", q_len=23, kv_len=50, causal=True),
    Case("causal_t_gt_s", q_len=50, kv_len=23, causal=True),
    Case("packed_causal_gqa", q_len=40, kv_len=40, kv_heads=2, segments="packed", causal=True),
    Case("padding_mqa", q_len=35, kv_len=50, kv_heads=1, segments="padding"),
    Case("window_causal", q_len=50, kv_len=50, window=10, causal=True),
    Case("window_positions", q_len=30, kv_len=45, window=8, positions=True),
    Case("disjoint", segments="disjoint"),
    Case("value_dim", q_len=30, kv_len=30, value_dim=48, causal=True),
]


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["blockwise", "pallas"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_sweep_dtype_head_dim(impl: str, dtype: jnp.dtype, head_dim: int) -> None:
    check(impl, Case(f"hd{head_dim}", q_len=35, kv_len=45, kv_heads=2, head_dim=head_dim, segments="packed",
                     causal=True), dtype)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["blockwise", "pallas"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", MASKS, ids=lambda c: c.name)
def test_sweep_masks(impl: str, dtype: jnp.dtype, case: Case) -> None:
    check(impl, case, dtype)


@pytest.mark.slow
def test_blockwise_long_sequence_memory_is_linear() -> None:
    """Compiled fwd+bwd peak memory grows ~linearly with length (the reference grows quadratically)."""

    def peak(impl: str, length: int) -> int:
        spec = jax.ShapeDtypeStruct((1, length, 2, 64), jnp.float32)
        fn = jax.jit(lambda q, k, v: jax.vjp(lambda *a: ops.attention(*a, impl=impl, causal=True), q, k, v)[1](q))
        stats = fn.lower(spec, spec, spec).compile().memory_analysis()
        return stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes

    assert peak("blockwise", 16384) / peak("blockwise", 2048) <= 9
    assert peak("xla", 4096) / peak("xla", 2048) >= 3


@pytest.mark.parametrize("impl", ["xla", "blockwise", "linear"])
def test_heads_first_keys_give_the_same_attention(impl):
    # The decoding cache's layout: one query per row against heads-first keys, with padding and causality by
    # position, as a decode step sees them; grouped heads (4 query heads on 2 key/value heads).
    kq, kk, kv = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(kq, (3, 1, 4, 8))
    k = jax.random.normal(kk, (3, 6, 2, 8))
    v = jax.random.normal(kv, (3, 6, 2, 8))
    masking = dict(
        q_segment_ids=jnp.ones((3, 1), jnp.int32),
        kv_segment_ids=jnp.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]]),
        causal=True,
        q_positions=jnp.array([[4], [2], [5]]),
        kv_positions=jnp.broadcast_to(jnp.arange(6), (3, 6)),
    )
    expected = jitted(ops.attention, q, k, v, impl=impl, **masking)
    got = jitted(ops.attention, q, *(jnp.swapaxes(x, 1, 2) for x in (k, v)), impl=impl, kv_heads_first=True, **masking)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_beam_lineage_attention_equals_attention_over_the_reordered_cache(impl):
    # A decoding cache of 2 sentences x 3 beams whose rows never move: row r's slot l is read from its sentence's row
    # lineage[r, l]. The reference gathers each row's history into place and attends as a decode step does
    # (heads-first, causal by position); grouped heads (4 query heads on 2 key/value heads).
    width, rows, slots = 3, 6, 7
    kq, kk, kv, kl = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(kq, (rows, 1, 4, 8))
    k = jax.random.normal(kk, (rows, 2, slots, 8))
    v = jax.random.normal(kv, (rows, 2, slots, 8))
    lineage = jax.random.randint(kl, (rows, slots), 0, width)
    masking = dict(
        causal=True,
        q_positions=jnp.array([[3], [3], [3], [6], [6], [6]]),
        kv_positions=jnp.broadcast_to(jnp.arange(slots), (rows, slots)),
    )
    source_RL = (jnp.arange(rows) // width * width)[:, None] + lineage  # the row holding slot l of row r
    in_place = lambda x: x[source_RL, :, jnp.arange(slots)[None, :]].transpose(0, 2, 1, 3)  # [R, K, L, H]
    expected = jitted(ops.attention, q, in_place(k), in_place(v), impl=impl, kv_heads_first=True, **masking)
    got = jitted(ops.attention, q, k, v, impl=impl, kv_heads_first=True, lineage=(lineage, width), **masking)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="beam lineage needs a heads-first cache and a softmax impl"):
        ops.attention(q, k, v, impl="linear", kv_heads_first=True, lineage=(lineage, width), **masking)
    with pytest.raises(ValueError, match="beam lineage takes no options but scale"):
        ops.attention(q, k, v, kv_heads_first=True, lineage=(lineage, width), return_weights=True, **masking)
