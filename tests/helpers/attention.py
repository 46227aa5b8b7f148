"""Shared by the attention tests (test_attention_ops, test_pallas_tpu, test_aot_tpu): cases, inputs, the
reference, forward+backward through any implementation, and the tolerance of each dtype."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import ops
from transformer_jax.ops import pallas_gpu, pallas_tpu

# Small tiles so that 20-60 tokens make several tiles of each kind (skipped, masked, unmasked, partial).
TILES = {
    "blockwise": dict(block_q=16, block_k=16),
    "pallas": dict(block_sizes=pallas_gpu.BlockSizes(16, 16, 16, 16, 16, 16)),
}

# Normalised max error, max |x - ref| / max |ref|, against the float32 reference on the same (rounded) inputs.
# float32: exact algebra up to summation order, ~1e-6. Low precision: the kernels round P and dS to the input
# dtype before their matmuls (as FlashAttention does), so the error is a few units of the format's epsilon:
# bfloat16 has 8 mantissa bits (eps 7.8e-3), float16 11 (eps 9.8e-4).
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2, jnp.float16: 4e-3}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int = 2
    q_len: int = 37
    kv_len: int = 37
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 32
    value_dim: int | None = None  # None: head_dim
    causal: bool = False
    window: int | None = None
    segments: str | None = None  # None | "packed" (both sides) | "padding" (kv tail) | "disjoint" (rows see nothing)
    positions: bool = False  # explicit, shuffled positions

    def shapes(self) -> tuple:
        d = self.value_dim or self.head_dim
        return (
            (self.batch, self.q_len, self.heads, self.head_dim),
            (self.batch, self.kv_len, self.kv_heads, self.head_dim),
            (self.batch, self.kv_len, self.kv_heads, d),
            (self.batch, self.q_len, self.heads, d),
        )


def mask_kwargs(case: Case, rng: np.random.Generator) -> dict:
    kw: dict = dict(causal=case.causal, window=case.window)
    b, t, s = case.batch, case.q_len, case.kv_len
    if case.segments == "packed":
        # Sorted ids 1..3 (packed sequences) with a padded (id 0) tail of a few tokens.
        q_ids, kv_ids = np.sort(rng.integers(1, 4, (b, t)), 1), np.sort(rng.integers(1, 4, (b, s)), 1)
        q_ids[:, t - 3 :], kv_ids[:, s - 4 :] = 0, 0
        kw.update(q_segment_ids=jnp.asarray(q_ids, jnp.int32), kv_segment_ids=jnp.asarray(kv_ids, jnp.int32))
    elif case.segments == "padding":
        kv_ids = (np.arange(s)[None] < np.array([[s - 5], [s - 17]])[:b]).astype(np.int32)
        kw.update(kv_segment_ids=jnp.asarray(kv_ids))
    elif case.segments == "disjoint":
        # Query rows with id 3 (and padding rows, id 0) match no key: they must give zeros and zero gradients.
        q_ids = np.where(np.arange(t) % 3 == 0, 3, 1)[None].repeat(b, 0)
        q_ids[:, :2] = 0
        kw.update(q_segment_ids=jnp.asarray(q_ids, jnp.int32), kv_segment_ids=jnp.ones((b, s), jnp.int32))
    if case.positions:
        kw.update(
            q_positions=jnp.asarray(np.stack([rng.permutation(t) for _ in range(b)]) + 5, jnp.int32),
            kv_positions=jnp.asarray(np.stack([rng.permutation(s) for _ in range(b)]), jnp.int32),
        )
    return kw


def make_inputs(case: Case, dtype: jnp.dtype, seed: int = 0) -> tuple[tuple, dict]:
    rng = np.random.default_rng(seed)
    arrays = tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype) for shape in case.shapes())
    return arrays, mask_kwargs(case, rng)


def forward_backward(impl: str, arrays: tuple, kw: dict, **impl_kwargs) -> tuple:
    """(out, dq, dk, dv) with cotangent do for attention(q, k, v, impl=impl)."""
    q, k, v, do = arrays

    def f(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return ops.attention(q, k, v, impl=impl, **kw, **impl_kwargs)

    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(do.astype(out.dtype)))


def reference(arrays: tuple, kw: dict) -> tuple:
    """The xla reference in float32 at full matmul precision, on the same (possibly rounded) inputs."""
    with jax.default_matmul_precision("highest"):
        return jax.jit(lambda a: forward_backward("xla", a, kw))(tuple(x.astype(jnp.float32) for x in arrays))


def assert_matches(got: tuple, want: tuple, dtype: jnp.dtype, what: str = "") -> None:
    for label, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        g = np.asarray(g.astype(jnp.float32))
        w = np.asarray(w)
        assert g.shape == w.shape, (label, g.shape, w.shape)
        assert np.all(np.isfinite(g)), f"{what} {label}: non-finite values"
        err = np.max(np.abs(g - w)) / (np.max(np.abs(w)) + 1e-6)
        assert err <= TOLERANCE[dtype], f"{what} {label}: normalised error {err:.2e} > {TOLERANCE[dtype]:.0e}"


def check(impl: str, case: Case, dtype: jnp.dtype = jnp.float32) -> None:
    arrays, kw = make_inputs(case, dtype)
    got = jax.jit(lambda a: forward_backward(impl, a, kw, **TILES.get(impl, {})))(arrays)
    assert_matches(got, reference(arrays, kw), dtype, f"{impl} {case.name} {jnp.dtype(dtype).name}")


# --- blockwise: the whole semantics, cheaply -----------------------------------------------------------------


TPU_SMALL = pallas_tpu.TpuBlockSizes(16, 128, 16, 128)  # the smallest tiles of ops/pallas_tpu.py's layout rules

TPU_CASES = [
    # Packed rows of three segments with padded tails, causal, two query heads per key head; odd lengths that
    # fill neither query nor key tiles; padding queries are fully masked rows.
    (Case("packed_causal_gqa", batch=1, q_len=45, kv_len=157, heads=2, kv_heads=1, head_dim=32, segments="packed",
          causal=True), jnp.float32),
    # Cross-attention S != T with a window (end-aligned positions leave the first key block invisible), query
    # rows that see no key (segment 3, padding), head dim 64, bfloat16.
    (Case("cross_window_disjoint_bf16", batch=1, q_len=40, kv_len=290, heads=2, kv_heads=2, head_dim=64,
          window=100, segments="disjoint", causal=True), jnp.bfloat16),
]  # fmt: skip
