"""Linear attention against a naive O(N^2) evaluation of the same formula, causal and not, with masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import ops
from transformer_jax.ops.linear import feature_map, linear_attention


def naive(q, k, v, **masking):
    """A_ij = phi(q_i).phi(k_j) on visible pairs; out = A V / rowsum(A); rows with no visible key are zero."""
    b, t, n, _ = q.shape
    s = k.shape[1]
    groups = n // k.shape[2]
    k, v = jnp.repeat(k, groups, 2), jnp.repeat(v, groups, 2)
    a = jnp.einsum("btnh,bsnh->bnts", feature_map(q), feature_map(k))
    mask = ops.attention_mask(b, t, s, **masking)
    if mask is not None:
        a = a * mask
    den = a.sum(-1, keepdims=True)
    out = jnp.einsum("bnts,bsng->btng", a / jnp.where(den > 0, den, 1.0), v)
    return out


def _qkv(seed, t, s, n=4, kv_heads=4, h=8):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(keys[0], (2, t, n, h)),
        jax.random.normal(keys[1], (2, s, kv_heads, h)),
        jax.random.normal(keys[2], (2, s, kv_heads, h)),
    )


@pytest.mark.parametrize("causal", [False, True])
def test_matches_naive_on_packed_padded_rows(causal):
    q, k, v = _qkv(0, 7, 7)
    seg = jnp.array([[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    masking = dict(q_segment_ids=seg, kv_segment_ids=seg, causal=causal)
    got = linear_attention(q, k, v, **masking)
    np.testing.assert_allclose(got, naive(q, k, v, **masking), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[0, 5:], 0.0)


def test_cross_attention_with_grouped_heads_matches_naive():
    q, k, v = _qkv(1, 5, 9, n=4, kv_heads=2)
    q_seg = jnp.array([[1, 1, 2, 2, 0], [1, 1, 1, 1, 1]])
    kv_seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0, 0], [1] * 9])
    masking = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    np.testing.assert_allclose(linear_attention(q, k, v, **masking), naive(q, k, v, **masking), rtol=1e-5, atol=1e-6)


def test_decoding_with_a_cache_matches_naive():
    q, k, v = _qkv(2, 1, 6)
    positions = jnp.array([[3], [5]])
    masking = dict(causal=True, q_positions=positions, kv_positions=jnp.broadcast_to(jnp.arange(6), (2, 6)))
    np.testing.assert_allclose(linear_attention(q, k, v, **masking), naive(q, k, v, **masking), rtol=1e-5, atol=1e-6)


def test_gradients_are_finite_and_match_naive():
    q, k, v = _qkv(3, 6, 6)
    seg = jnp.array([[1, 1, 1, 0, 0, 0], [1, 1, 2, 2, 2, 2]])
    masking = dict(q_segment_ids=seg, kv_segment_ids=seg, causal=True)
    g_lin = jax.grad(lambda q, k, v: linear_attention(q, k, v, **masking).sum(), argnums=(0, 1, 2))(q, k, v)
    g_ref = jax.grad(lambda q, k, v: naive(q, k, v, **masking).sum(), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_lin, g_ref, strict=True):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_window_is_a_clear_error():
    q, k, v = _qkv(0, 4, 4)
    with pytest.raises(ValueError, match="does not support a sliding window"):
        ops.attention(q, k, v, impl="linear", window=2)


def test_model_trains_with_linear_attention_and_caches_match():
    from flax import nnx

    from tests.model_helpers import random_tokens, tiny_model

    model = tiny_model(impl="linear")
    src, tgt = random_tokens(0, (2, 5)), random_tokens(1, (2, 4))
    memory = model.encode(src)
    full = model.decode(memory, tgt)
    cache = model.init_cache(memory, None, max_len=4)
    steps = []
    for t in range(4):
        logits, cache = model.decode(None, tgt[:, t : t + 1], cache=cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, rtol=1e-5, atol=1e-5)
    grads = nnx.grad(lambda m: m(src, tgt).sum())(model)
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
