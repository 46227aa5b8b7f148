"""Reference computations the tests compare the package against: written from the formulas, not from its code."""

from __future__ import annotations

import jax.numpy as jnp

from tests.helpers import jitted
from transformer_jax import ops
from transformer_jax.ops.blockwise import feature_map


def hand_count(vocab: int, d: int, d_ff: int, n_layers: int) -> int:
    """Parameters derived from the paper's equations, with one shared embedding matrix (3.4)."""
    attention = 4 * (d * d + d)  # W^Q, W^K, W^V, W^O with biases
    ffn = d * d_ff + d_ff + d_ff * d + d  # W1, b1, W2, b2
    layer_norm = 2 * d  # gamma, beta
    encoder_layer = attention + ffn + 2 * layer_norm
    decoder_layer = 2 * attention + ffn + 3 * layer_norm
    return vocab * d + n_layers * (encoder_layer + decoder_layer)


def naive_linear_attention(q, k, v, **masking):
    """A_ij = phi(q_i).phi(k_j) on visible pairs; out = A V / rowsum(A); rows with no visible key are zero."""
    return jitted(_naive_linear_attention, q, k, v, **masking)


def _naive_linear_attention(q, k, v, **masking):
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
