"""Embeddings, positional encodings, normalisation and the position-wise feed-forward network.

Axis legend: B batch, T sequence length, D d_model, F d_ff, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax.model.spec import TransformerSpec

Array = jax.Array

# Glorot/Xavier uniform, as tensor2tensor and torch.nn.Transformer initialise their projections.
DENSE_INIT = nnx.initializers.xavier_uniform()


def dense(in_features: int, out_features: int, spec: TransformerSpec, rngs: nnx.Rngs, *, bias: bool = True):
    """A float32-parameter linear layer that computes in the spec's dtype."""
    return nnx.Linear(
        in_features,
        out_features,
        use_bias=bias,
        dtype=spec.compute_dtype,
        param_dtype=jnp.float32,
        kernel_init=DENSE_INIT,
        rngs=rngs,
    )


class Embedding(nnx.Module):
    """Token embedding scaled by sqrt(d_model) (paper 3.4); `attend` is the tied pre-softmax projection."""

    def __init__(self, vocab_size: int, d_model: int, dtype: jnp.dtype, *, rngs: nnx.Rngs):
        # std d_model^-0.5 so that the sqrt(d_model)-scaled embedding has unit variance, as in tensor2tensor.
        init = nnx.initializers.normal(stddev=d_model**-0.5)
        self.table_VD = nnx.Param(init(rngs.params(), (vocab_size, d_model), jnp.float32))
        self.d_model = d_model
        self.dtype = dtype

    def __call__(self, tokens_BT: Array) -> Array:
        """x = E[token] * sqrt(d_model)."""
        return (self.table_VD[...][tokens_BT] * jnp.sqrt(float(self.d_model))).astype(self.dtype)

    def attend(self, x_BTD: Array) -> Array:
        """logits = x E^T, in float32."""
        table = self.table_VD[...].astype(self.dtype)
        return jnp.einsum("btd,vd->btv", x_BTD.astype(self.dtype), table, preferred_element_type=jnp.float32)


def sinusoidal_encoding(positions_BT: Array, d_model: int) -> Array:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)) (paper 3.5).

    Computed from explicit positions so that packed sequences restart at 0. Returns float32 [B, T, D].
    """
    if d_model % 2:
        raise ValueError(f"sinusoidal positional encoding needs an even model.d_model, got {d_model}")
    two_i = jnp.arange(0, d_model, 2, dtype=jnp.float32)  # 2i for i = 0 .. d_model/2 - 1
    inv_freq = 1.0 / (10000.0 ** (two_i / d_model))
    angles_BTI = positions_BT.astype(jnp.float32)[..., None] * inv_freq
    # Interleave so that even features are sines and odd features cosines, exactly as the formula indexes them.
    pe_BTI2 = jnp.stack([jnp.sin(angles_BTI), jnp.cos(angles_BTI)], axis=-1)
    return pe_BTI2.reshape(*positions_BT.shape, d_model)


class LearnedPositions(nnx.Module):
    """A learned absolute position embedding P[pos] (paper Table 3 row E)."""

    def __init__(self, max_len: int, d_model: int, *, rngs: nnx.Rngs):
        self.table_LD = nnx.Param(nnx.initializers.normal(stddev=d_model**-0.5)(rngs.params(), (max_len, d_model)))
        self.max_len = max_len

    def __call__(self, positions_BT: Array) -> Array:
        # Out-of-range positions cannot raise inside jit; callers check lengths against max_len (see Transformer).
        return self.table_LD[...][positions_BT]


class LayerNorm(nnx.Module):
    """LayerNorm(x) = gamma * (x - mean(x)) / sqrt(var(x) + eps) + beta, statistics over the feature axis."""

    def __init__(self, d_model: int, epsilon: float):
        self.scale_D = nnx.Param(jnp.ones((d_model,), jnp.float32))
        self.bias_D = nnx.Param(jnp.zeros((d_model,), jnp.float32))
        self.epsilon = epsilon

    def __call__(self, x_BTD: Array) -> Array:
        x = x_BTD.astype(jnp.float32)  # statistics in float32 whatever the compute dtype
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.epsilon) * self.scale_D[...] + self.bias_D[...]
        return y.astype(x_BTD.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm(x) = gamma * x / sqrt(mean(x^2) + eps) (Zhang & Sennrich 2019)."""

    def __init__(self, d_model: int, epsilon: float):
        self.scale_D = nnx.Param(jnp.ones((d_model,), jnp.float32))
        self.epsilon = epsilon

    def __call__(self, x_BTD: Array) -> Array:
        x = x_BTD.astype(jnp.float32)
        y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.epsilon) * self.scale_D[...]
        return y.astype(x_BTD.dtype)


def make_norm(spec: TransformerSpec) -> LayerNorm | RMSNorm:
    if spec.norm == "layernorm":
        return LayerNorm(spec.d_model, spec.norm_epsilon)
    return RMSNorm(spec.d_model, spec.norm_epsilon)


class FeedForward(nnx.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (paper 3.3); GELU, or SwiGLU (Swish(x W1) * (x W3)) W2 as options."""

    def __init__(self, spec: TransformerSpec, *, rngs: nnx.Rngs):
        self.activation = spec.activation
        self.w1 = dense(spec.d_model, spec.d_ff, spec, rngs)
        self.w3 = dense(spec.d_model, spec.d_ff, spec, rngs) if spec.activation == "swiglu" else None
        self.w2 = dense(spec.d_ff, spec.d_model, spec, rngs)
        self.dropout = nnx.Dropout(spec.ffn_dropout_rate, rngs=rngs)

    def __call__(self, x_BTD: Array) -> Array:
        h_BTF = self.w1(x_BTD)
        if self.activation == "relu":
            h_BTF = jax.nn.relu(h_BTF)
        elif self.activation == "gelu":
            h_BTF = jax.nn.gelu(h_BTF)
        else:
            h_BTF = jax.nn.silu(h_BTF) * self.w3(x_BTD)
        return self.w2(self.dropout(h_BTF))
