"""The hash dropout of model/layers.py: right keep rate, unbiased, independent across elements and keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer_jax.model.layers import Dropout, dropout, hash_bits

SHAPE = (16, 64, 1024)  # 1,048,576 elements: a standard error of 3e-4 on the keep rate at rate 0.1


def _keep(key, rate=0.1, shape=SHAPE):
    return np.asarray(dropout(jnp.ones(shape), rate, key) != 0)


@pytest.mark.parametrize("rate", [0.1, 0.3, 0.5])
def test_keep_rate_and_scale(rate):
    out = np.asarray(dropout(jnp.ones(SHAPE), rate, jax.random.key(1)))
    kept = out != 0
    se = np.sqrt(rate * (1 - rate) / kept.size)
    assert abs(kept.mean() - (1 - rate)) < 5 * se
    np.testing.assert_allclose(out[kept], 1 / (1 - rate), rtol=1e-6)  # survivors scaled: E[out] = x


def test_neighbours_and_keys_are_independent():
    """Correlation of keep indicators between neighbours along each axis, and between two keys, is ~0
    (5 standard errors of 1/sqrt(n))."""
    a = _keep(jax.random.key(2)).astype(np.float64)
    b = _keep(jax.random.key(3)).astype(np.float64)
    bound = 5 / np.sqrt(a.size / 2)

    def corr(x, y):
        return np.corrcoef(x.ravel(), y.ravel())[0, 1]

    assert abs(corr(a[:, :, 1:], a[:, :, :-1])) < bound
    assert abs(corr(a[:, 1:], a[:, :-1])) < bound
    assert abs(corr(a[1:], a[:-1])) < bound
    assert abs(corr(a, b)) < bound


def test_bits_are_uniform():
    """Chi-square over 256 bins of the top and the bottom byte (99.99% quantile of chi2(255) is ~350)."""
    bits = np.asarray(hash_bits(jax.random.key(4), SHAPE))
    for byte in (bits >> 24, bits & 0xFF):
        counts = np.bincount(byte.ravel(), minlength=256)
        expected = bits.size / 256
        assert np.sum((counts - expected) ** 2 / expected) < 350


def test_same_key_same_mask_and_bits_are_bit_for_bit_reproducible():
    key = jax.random.key(5)
    np.testing.assert_array_equal(_keep(key, shape=(8, 8)), _keep(key, shape=(8, 8)))
    assert not np.array_equal(_keep(key, shape=(64, 64)), _keep(jax.random.key(6), shape=(64, 64)))


def test_module_draws_a_new_mask_each_call_and_is_identity_in_eval():
    layer = Dropout(0.5, rngs=nnx.Rngs(dropout=0))
    x = jnp.ones((32, 32))
    first, second = np.asarray(layer(x)), np.asarray(layer(x))
    assert not np.array_equal(first, second)
    layer.eval()
    np.testing.assert_array_equal(np.asarray(layer(x)), np.asarray(x))


def test_rate_outside_range_fails():
    with pytest.raises(ValueError, match="dropout rate"):
        dropout(jnp.ones(3), 1.0, jax.random.key(0))
