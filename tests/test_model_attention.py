"""Scaled dot-product and multi-head attention (paper 3.2) against their definitions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import jitted
from tests.helpers.model import tiny_spec
from transformer_jax import ops
from transformer_jax.model.layers import MultiHeadAttention


def test_dot_product_variance_is_d_k_and_ops_attention_scales_it_to_one():
    """For q, k with i.i.d. N(0, 1) entries, Var(q.k) = d_k, so q.k / sqrt(d_k) has variance 1 (paper 3.2.1),
    and the scores ops.attention computes (the model's attention) are those: variance 1, not 1/d_k or d_k."""
    d_k, n = 64, 200_000
    key_q, key_k = jax.random.split(jax.random.key(0))
    q = np.asarray(jax.random.normal(key_q, (n, d_k)), np.float64)
    k = np.asarray(jax.random.normal(key_k, (n, d_k)), np.float64)
    dots = (q * k).sum(-1)
    # Standard error of a sample variance: sigma^2 * sqrt(2/(n-1) + excess_kurtosis/n); a product of two
    # independent N(0,1) has excess kurtosis 6, and a sum of d_k of them 6/d_k. Allow 5 standard errors.
    rel_se = np.sqrt(2 / (n - 1) + (6 / d_k) / n)
    assert abs(dots.var() / d_k - 1) < 5 * rel_se
    # The unscaled scores would saturate the softmax; the scaled ones do not (the paper's motivation).
    assert abs(dots.var() - 1) > 50 * rel_se

    # The project's scores: weights = softmax(scores), so log(weights) is the scores less a constant per query, and
    # its variance over the keys is that of the scores. Over 1024 queries of 1024 keys each it is 1 to within ~0.01.
    q_BTNH = jax.random.normal(key_q, (1, 256, 4, d_k))
    k_BSKH = jax.random.normal(key_k, (1, 1024, 4, d_k))
    _, weights_BNTS = ops.attention(q_BTNH, k_BSKH, jnp.zeros((1, 1024, 4, 8)), return_weights=True)
    score_variance = float(np.log(np.asarray(weights_BNTS, np.float64)).var(-1).mean())
    assert abs(score_variance - 1) < 0.05, score_variance


def _qkv(seed=0, b=2, t=5, s=7, n=4, h=8):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(keys[0], (b, t, n, h)),
        jax.random.normal(keys[1], (b, s, n, h)),
        jax.random.normal(keys[2], (b, s, n, h)),
    )


def test_attention_rows_sum_to_one_and_output_is_weights_times_v():
    q, k, v = _qkv()
    out, weights = ops.attention(q, k, v, return_weights=True)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(out, jnp.einsum("bnts,bsnh->btnh", weights, v), rtol=1e-5, atol=1e-6)
    # And the weights are softmax(QK^T / sqrt(d_k)) computed by hand.
    scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    expected = np.exp(scores - scores.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(weights, expected, rtol=1e-5, atol=1e-6)


def test_masked_rows_are_zero_and_padding_does_not_leak():
    q, k, v = _qkv()
    kv_seg = jnp.array([[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    q_seg = jnp.array([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    out = jitted(ops.attention, q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    np.testing.assert_array_equal(out[0, 2:], 0.0)
    poisoned = v.at[0, 3:].set(1e30)
    np.testing.assert_array_equal(
        jitted(ops.attention, q, k, poisoned, q_segment_ids=q_seg, kv_segment_ids=kv_seg), out
    )
    grad = jitted(jax.grad(lambda q: ops.attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg).sum()), q)
    assert np.isfinite(grad).all()


def test_unknown_impl_is_a_clear_error():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="unknown attention impl 'nope'"):
        ops.attention(q, k, v, impl="nope")


def test_multi_head_equals_explicit_loop_over_heads_then_output_projection():
    spec = tiny_spec()
    mha = MultiHeadAttention(spec, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, spec.d_model)).astype(np.float32)
    mem = rng.normal(size=(2, 6, spec.d_model)).astype(np.float32)
    got = mha(
        jnp.asarray(x),
        mha.project_kv(jnp.asarray(mem)),
        q_segment_ids=None,
        kv_segment_ids=None,
        q_positions=None,
        kv_positions=None,
        causal=False,
    )

    def p(linear):
        return np.asarray(linear.kernel[...]), np.asarray(linear.bias[...])

    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = map(p, (mha.q_proj, mha.k_proj, mha.v_proj, mha.o_proj))
    d_k = spec.d_model // spec.num_heads
    heads = []
    for i in range(spec.num_heads):
        cols = slice(i * d_k, (i + 1) * d_k)
        qi, ki, vi = x @ wq[:, cols] + bq[cols], mem @ wk[:, cols] + bk[cols], mem @ wv[:, cols] + bv[cols]
        scores = qi @ ki.transpose(0, 2, 1) / np.sqrt(d_k)
        a = np.exp(scores - scores.max(-1, keepdims=True))
        heads.append((a / a.sum(-1, keepdims=True)) @ vi)
    expected = np.concatenate(heads, -1) @ wo + bo  # Concat(head_1..head_h) W^O
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_grouped_query_heads_share_keys_and_values():
    q, k, v = _qkv(n=4)
    k2, v2 = k[:, :, :2], v[:, :, :2]
    grouped = ops.attention(q, k2, v2)
    expanded = ops.attention(q, jnp.repeat(k2, 2, axis=2), jnp.repeat(v2, 2, axis=2))
    np.testing.assert_allclose(grouped, expanded, rtol=1e-6)


def test_causal_alignment_without_positions_is_to_the_end_of_the_keys():
    q, k, v = _qkv(t=2, s=5)
    _, weights = ops.attention(q, k, v, causal=True, return_weights=True)
    # Query 0 sits at key position 3, query 1 at key position 4.
    np.testing.assert_array_equal(weights[:, :, 0, 4], 0.0)
    assert (weights[:, :, 0, 3] > 0).all() and (weights[:, :, 1, 4] > 0).all()


def test_window_limits_the_distance():
    q, k, v = _qkv(t=6, s=6)
    _, weights = ops.attention(q, k, v, causal=True, window=2, return_weights=True)
    visible = np.asarray(weights[0, 0] > 0)
    expected = np.array([[0 <= i - j < 2 for j in range(6)] for i in range(6)])
    np.testing.assert_array_equal(visible, expected)
