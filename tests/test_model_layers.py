"""The paper's equations for embeddings, positional encoding, norms and the FFN, checked against their formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import common
from transformer_jax.model import Transformer, TransformerSpec
from transformer_jax.model.layers import (
    Embedding,
    FeedForward,
    LayerNorm,
    RMSNorm,
    fused_dot_general,
    matmul_last,
    sinusoidal_encoding,
    tied_logits,
)


def tiny_spec(**overrides) -> TransformerSpec:
    config = common.base_config("tiny")
    config.model.update(overrides)
    return TransformerSpec.from_config(config)


@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
def test_sinusoidal_encoding_matches_formula(layout):
    """interleaved: PE[p, 2i] = sin, PE[p, 2i+1] = cos (paper 3.5); concatenated (Marian): PE[p, i] = sin,
    PE[p, d/2 + i] = cos, both of the angle p / 10000^(2i/d)."""
    d_model, length = 16, 50
    pe = np.asarray(sinusoidal_encoding(jnp.arange(length)[None], d_model, layout)[0])
    expected = np.zeros((length, d_model))
    for pos in range(length):
        for i in range(d_model // 2):
            angle = pos / 10000 ** (2 * i / d_model)
            sin_col, cos_col = (2 * i, 2 * i + 1) if layout == "interleaved" else (i, d_model // 2 + i)
            expected[pos, sin_col] = np.sin(angle)
            expected[pos, cos_col] = np.cos(angle)
    np.testing.assert_allclose(pe, expected, atol=1e-5)


def test_unknown_sinusoid_layout_is_refused():
    with pytest.raises(ValueError, match="model.sinusoid_layout"):
        sinusoidal_encoding(jnp.arange(4)[None], 8, "sideways")


def test_the_model_adds_the_positions_of_its_layout():
    """model.sinusoid_layout reaches the embedding: Embedding * sqrt(d) + PE of that layout."""
    tokens = jnp.asarray([[5, 6, 7, 8]])
    positions = jnp.arange(4)[None]
    for layout in ("interleaved", "concatenated"):
        model = Transformer(tiny_spec(sinusoid_layout=layout), rngs=nnx.Rngs(0))
        model.eval()
        scaled = model.src_embed(tokens)
        expected = scaled + sinusoidal_encoding(positions, model.spec.d_model, layout)
        np.testing.assert_allclose(model._embed(tokens, positions, target=False), expected, atol=1e-6)


@pytest.mark.parametrize("k", [1, 3, 17])
def test_sinusoidal_encoding_offset_is_a_fixed_linear_map(k):
    """For every offset k a matrix M_k, independent of pos, gives PE(pos + k) = M_k PE(pos) (paper 3.5)."""
    d_model = 32
    pe = np.asarray(sinusoidal_encoding(jnp.arange(1100)[None], d_model, "interleaved")[0], np.float64)
    # M_k is built from k alone: the block-diagonal rotation given by the sin/cos addition formulas.
    freqs = 1.0 / 10000 ** (np.arange(0, d_model, 2) / d_model)
    m_k = np.zeros((d_model, d_model))
    for i, w in enumerate(freqs):
        c, s = np.cos(k * w), np.sin(k * w)
        # Row vectors: [sin(a+b), cos(a+b)] = [sin a, cos a] @ [[cos b, -sin b], [sin b, cos b]]
        m_k[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = [[c, -s], [s, c]]
    # The same matrix works at every position (float32 angles near pos 1000 carry ~1e-4 of rounding).
    for start in (0, 300, 1000):
        rows = slice(start, start + 50)
        np.testing.assert_allclose(pe[rows] @ m_k, pe[start + k : start + k + 50], atol=2e-4)
    # And no single matrix maps PE(pos) to PE(pos + k') for k' != k: M_k is specific to the offset.
    assert np.abs(pe[:50] @ m_k - pe[k + 1 : k + 51]).max() > 1e-2


def test_sinusoidal_encoding_restarts_with_positions():
    positions = jnp.array([[0, 1, 2, 0, 1]])
    pe = sinusoidal_encoding(positions, 8, "concatenated")
    np.testing.assert_array_equal(pe[0, 3], pe[0, 0])
    np.testing.assert_array_equal(pe[0, 4], pe[0, 1])


@pytest.mark.parametrize("fused_backward", [True, False])
def test_embedding_is_scaled_by_sqrt_d_model_and_attend_uses_the_same_matrix(fused_backward):
    emb = Embedding(11, 16, jnp.float32, fused_backward=fused_backward, rngs=nnx.Rngs(0))
    table = np.asarray(emb.table_VD[...])
    np.testing.assert_allclose(emb(jnp.array([[3, 7]]))[0], table[[3, 7]] * 4.0, rtol=1e-6)
    x = np.random.default_rng(0).normal(size=(1, 2, 16)).astype(np.float32)
    np.testing.assert_allclose(emb.attend(jnp.asarray(x)), x @ table.T, rtol=1e-5, atol=1e-5)


def test_layer_norm_matches_formula():
    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, size=(2, 5, 8)).astype(np.float32)
    norm = LayerNorm(8, 1e-6)
    gamma, beta = rng.normal(size=8).astype(np.float32), rng.normal(size=8).astype(np.float32)
    norm.scale_D[...] = jnp.asarray(gamma)
    norm.bias_D[...] = jnp.asarray(beta)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)  # biased variance over features, as the paper's LayerNorm
    expected = gamma * (x - mean) / np.sqrt(var + 1e-6) + beta
    np.testing.assert_allclose(norm(jnp.asarray(x)), expected, rtol=1e-5, atol=1e-5)


def test_rms_norm_matches_formula():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 8)).astype(np.float32)
    norm = RMSNorm(8, 1e-6)
    gamma = rng.normal(size=8).astype(np.float32)
    norm.scale_D[...] = jnp.asarray(gamma)
    expected = gamma * x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(norm(jnp.asarray(x)), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("activation", ["relu", "gelu", "swiglu", "swish"])
def test_feed_forward_matches_formula(activation):
    spec = tiny_spec(activation=activation)
    ffn = FeedForward(spec, rngs=nnx.Rngs(0))
    x = np.random.default_rng(2).normal(size=(2, 3, spec.d_model)).astype(np.float32)
    w1, b1 = np.asarray(ffn.w1.kernel[...]), np.asarray(ffn.w1.bias[...])
    w2, b2 = np.asarray(ffn.w2.kernel[...]), np.asarray(ffn.w2.bias[...])
    h = x @ w1 + b1
    if activation == "relu":
        h = np.maximum(0, h)  # max(0, x W1 + b1) W2 + b2
    elif activation == "gelu":
        h = np.asarray(jax.nn.gelu(h))
    elif activation == "swish":
        h = h / (1 + np.exp(-h))  # SiLU(x W1 + b1) W2 + b2, not gated
        assert ffn.w3 is None
    else:
        w3, b3 = np.asarray(ffn.w3.kernel[...]), np.asarray(ffn.w3.bias[...])
        h = h / (1 + np.exp(-h)) * (x @ w3 + b3)
    np.testing.assert_allclose(ffn(jnp.asarray(x)), h @ w2 + b2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d_in, d_out", [(6, 10), (10, 6)])
def test_matmul_last_gradients_equal_autodiff(d_in, d_out):
    """The hand-written backward of matmul_last (both transposition branches) and of tied_logits."""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (3, 5, d_in))
    w = jax.random.normal(kw, (d_in, d_out))
    g = jax.random.normal(kg, (3, 5, d_out))
    ours = jax.vjp(matmul_last, x, w)
    ref = jax.vjp(jnp.matmul, x, w)
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-6)
    for a, b in zip(ours[1](g), ref[1](g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    table = jax.random.normal(kw, (d_out, d_in))
    ours = jax.vjp(tied_logits, x, table)
    ref = jax.vjp(lambda x, t: jnp.einsum("btd,vd->btv", x, t), x, table)
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-6)
    for a, b in zip(ours[1](g), ref[1](g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "x_shape, w_shape, dimension_numbers, options",
    [
        ((3, 5, 6), (6, 10), (((2,), (0,)), ((), ())), {"precision": jax.lax.Precision.HIGHEST}),
        ((3, 5, 6), (6, 10), (((2,), (0,)), ((), ())), {"preferred_element_type": jnp.float32}),
        ((6, 5), (6, 10), (((0,), (0,)), ((), ())), {}),  # contracts x's first axis, not its last
        ((4, 5, 6), (4, 6, 10), (((2,), (1,)), ((0,), (0,))), {}),  # a batch axis
    ],
    ids=["precision", "result_type", "first_axis", "batched"],
)
def test_linear_layer_dot_general_falls_back_to_lax_with_autodiff_gradients(
    x_shape, w_shape, dimension_numbers, options
):
    """Anything but a plain x @ kernel over x's last axis skips matmul_last (whose backward assumes that shape)."""
    kx, kw, kg = jax.random.split(jax.random.key(1), 3)
    x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)
    ours = lambda x, w: fused_dot_general(x, w, dimension_numbers, **options)
    ref = lambda x, w: jax.lax.dot_general(x, w, dimension_numbers, **options)
    assert "custom_vjp" not in str(jax.make_jaxpr(ours)(x, w))  # the fallback, not the hand-written backward
    out, ours_vjp = jax.vjp(ours, x, w)
    ref_out, ref_vjp = jax.vjp(ref, x, w)
    np.testing.assert_allclose(out, ref_out, rtol=1e-6)
    g = jax.random.normal(kg, out.shape)
    for a, b in zip(ours_vjp(g), ref_vjp(g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_linear_layer_dot_general_takes_the_fast_path_for_a_plain_matmul():
    x, w = jnp.ones((3, 5, 6)), jnp.ones((6, 10))
    plain = (((2,), (0,)), ((), ()))
    assert "custom_vjp" in str(jax.make_jaxpr(lambda x, w: fused_dot_general(x, w, plain))(x, w))
