"""Embeddings, positional encodings, normalisation and the position-wise feed-forward network.

Axis legend: B batch, T sequence length, D d_model, F d_ff, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax.model.spec import TransformerSpec
from transformer_jax.ops.dropout import dropout

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
        dot_general=_dense_dot_general,
        rngs=rngs,
    )


def _dense_dot_general(x, kernel, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """nnx.Linear's x @ kernel, with the hand-written backward of `matmul_last` when nothing unusual is asked."""
    (x_contract, k_contract), batch_dims = dimension_numbers
    plain = tuple(x_contract) == (x.ndim - 1,) and tuple(k_contract) == (0,) and batch_dims == ((), ())
    if not plain or precision is not None or preferred_element_type is not None or kwargs.get("out_sharding"):
        return jax.lax.dot_general(x, kernel, dimension_numbers, precision, preferred_element_type, **kwargs)
    return matmul_last(x, kernel)


@jax.custom_vjp
def matmul_last(x_ND: Array, w_DF: Array) -> Array:
    """x @ w over x's last axis (any leading axes)."""
    return jnp.matmul(x_ND, w_DF)


def _matmul_last_fwd(x_ND, w_DF):
    return matmul_last(x_ND, w_DF), (x_ND, w_DF)


def _matmul_last_bwd(residuals, g_NF):
    """dx = g w^T; dw = x^T g over all leading axes, arranged so that XLA:CPU transposes the narrower of x and g.

    Autodiff's dw made XLA:CPU write a transposed copy of g (fused with the ReLU backward) for each layer, ~0.1 s
    of a 1.5 s train step at d_model 256 (benchmarks/train_step.py).
    """
    x_ND, w_DF = residuals
    d_in, d_out = w_DF.shape
    x2, g2 = x_ND.reshape(-1, d_in), g_NF.reshape(-1, d_out)
    d_x = jnp.matmul(g_NF, w_DF.T)
    if d_in <= d_out:
        d_w = jnp.einsum("nd,nf->df", x2, g2)
    else:
        d_w = jnp.einsum("nf,nd->fd", g2, x2).T
    return d_x.astype(x_ND.dtype), d_w.astype(w_DF.dtype)


matmul_last.defvjp(_matmul_last_fwd, _matmul_last_bwd)


class Dropout(nnx.Dropout):
    """nnx.Dropout (train()/eval() switch, forked 'dropout' RNG stream) with the fused hash mask of ops.dropout."""

    def __call__(self, inputs: Array) -> Array:
        if self.deterministic or self.rate == 0.0:
            return inputs
        return dropout(inputs, self.rate, self.rngs())


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
        return tied_logits(x_BTD.astype(self.dtype), self.table_VD[...].astype(self.dtype))


@jax.custom_vjp
def tied_logits(x_BTD: Array, table_VD: Array) -> Array:
    """logits = x E^T in float32, with a hand-written backward (below)."""
    return jnp.einsum("btd,vd->btv", x_BTD, table_VD, preferred_element_type=jnp.float32)


def _tied_logits_fwd(x_BTD, table_VD):
    return tied_logits(x_BTD, table_VD), (x_BTD, table_VD)


def _tied_logits_bwd(residuals, d_logits_BTV):
    """dx = g E and dE = (x^T g)^T. Autodiff's dE = g^T x made XLA:CPU write a transposed [V, B*T] copy of the
    logits gradient (~65 ms of a 1.6 s step at V=8000); x^T is V/D times smaller to transpose."""
    x_BTD, table_VD = residuals
    g_BTV = d_logits_BTV.astype(x_BTD.dtype)
    d_x_BTD = jnp.einsum("btv,vd->btd", g_BTV, table_VD, preferred_element_type=jnp.float32)
    d_table_DV = jnp.einsum("btd,btv->dv", x_BTD, g_BTV, preferred_element_type=jnp.float32)
    return d_x_BTD.astype(x_BTD.dtype), d_table_DV.T.astype(table_VD.dtype)


tied_logits.defvjp(_tied_logits_fwd, _tied_logits_bwd)


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
        self.dropout = Dropout(spec.ffn_dropout_rate, rngs=rngs)

    def __call__(self, x_BTD: Array) -> Array:
        h_BTF = self.w1(x_BTD)
        if self.activation == "relu":
            h_BTF = jax.nn.relu(h_BTF)
        elif self.activation == "gelu":
            h_BTF = jax.nn.gelu(h_BTF)
        else:
            h_BTF = jax.nn.silu(h_BTF) * self.w3(x_BTD)
        return self.w2(self.dropout(h_BTF))
