"""The model's hyperparameters as one validated, immutable record (`TransformerSpec`, built from the `model` and
`attention` groups), the vocabulary's reserved ids (`SpecialIds`), and the layers: embeddings, positional
encodings, dropout, normalisation, the position-wise feed-forward network, and multi-head attention (projections,
masks and the decoding cache; the kernel is `ops.attention`).

A new model key is a `Key` in schema.KEYS and a field of TransformerSpec; tests/test_config_keys.py fails until both
exist.

Axis letters: see transformer_jax/__init__.py. The linear layers and the tied logits projection have two backward
passes, autodiff's and a hand-written one for XLA:CPU; model.fused_backward chooses (`fused_backward_enabled`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from transformer_jax import cli, ops, runtime
from transformer_jax.config import schema
from transformer_jax.errors import ConfigError

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """The reserved ids of one vocabulary, read from the `model.*_id` keys (hashable: a static argument of jitted
    functions).

    A SentencePiece model trained here reserves `DEFAULT` (schema.SPECIAL_IDS); a converted Marian model keeps its
    own (eos 0, unk 1, pad = bos = vocab_size - 1: its decoder starts from pad); a fairseq model's decoder starts
    from eos (bos = eos). Batches pad with `pad`, every source and target ends with `eos`, decoding starts from `bos`
    and stops when it emits `eos` (the input bos is not an emission). Since bos may equal pad, whether a target
    position is real comes from the batch's segment ids or lengths, never from `tokens != pad`.
    """

    pad: int  # padding: never a real token, never emitted by the search
    eos: int  # end of sentence: ends every source and target, and stops the search
    bos: int  # the first decoder input (may equal pad, as Marian's decoder_start_token_id does, or eos, as fairseq's)
    unk: int  # unknown piece
    # A multilingual model's language tokens (data/languages.py): the search emits one only where it is forced, as
    # the output's first token, where it adds 0 to the log-probability (transformers' forced BOS); none after it.
    languages: tuple[int, ...] = ()

    DEFAULT: ClassVar[SpecialIds]

    @classmethod
    def of(cls, config: Any) -> SpecialIds:
        """The ids of a full config (its `model` group), of the `model` group itself, or of a TransformerSpec."""
        model = config.model if isinstance(config, ml_collections.ConfigDict) and "model" in config else config
        return cls(**{field: int(getattr(model, f"{field}_id")) for field in schema.SPECIAL_IDS})


SpecialIds.DEFAULT = SpecialIds(**schema.SPECIAL_IDS)

DTYPES = {name: getattr(jnp, name) for name in schema.DTYPES}  # model.dtype -> computation dtype


def fused_backward_enabled(setting: str, backend: str | None = None) -> bool:
    """Whether the hand-written backward passes (linear layers, tied logits projection, loss) replace autodiff's.

    They compute the same gradients as autodiff, arranged so that XLA:CPU makes fewer transposed copies; they
    were measured on CPU only (benchmarks/train_step.py), so 'auto' uses them on the CPU backend and leaves every
    other backend to autodiff. `backend` defaults to runtime.target_backend().
    """
    if setting == "auto":
        return (backend or runtime.target_backend()) == "cpu"
    return setting == "on"


_ATTENTION_FIELDS = ("attention_impl", "attention_window")  # the fields of attention.* keys


@dataclasses.dataclass(frozen=True)
class TransformerSpec:
    """Every value the modules need: one field per model.* key, and attention.* as attention_* (schema.KEYS
    holds each key's default, unit and rule; tests/test_config_keys.py checks that the fields and keys agree).

    Frozen (hashable: a static argument of jitted functions) and without defaults: they live in config/schema.py."""

    vocab_size: int
    source_vocab_size: int  # 0 = vocab_size
    pad_id: int
    eos_id: int
    bos_id: int  # may equal pad_id (Marian's decoder starts from pad) or eos_id (fairseq's starts from eos)
    unk_id: int
    d_model: int
    num_heads: int
    num_kv_heads: int  # 0 = num_heads
    qk_head_dim: int  # 0 = d_model / num_heads
    v_head_dim: int  # 0 = d_model / num_heads
    d_ff: int
    num_encoder_layers: int
    num_decoder_layers: int
    dropout_rate: float
    attention_dropout_rate: float
    ffn_dropout_rate: float
    activation: str
    norm: str
    norm_position: str
    norm_epsilon: float
    positional: str
    sinusoid_layout: str  # interleaved (paper), concatenated (Marian) or fairseq: layers.sinusoidal_encoding
    position_offset: int  # added to every position before the positional encoding (fairseq's start at 2)
    lang_token: str  # where a multilingual model's language tokens go (data/languages.py); vocab_size counts them
    language_codes: tuple  # a converted model's (code, id) pairs (data/languages.py Placement); () = none
    max_len: int
    share_embeddings: bool
    tie_output: bool
    final_logits_bias: bool  # Transformer.final_logits_bias_V added to the logits
    dtype: str
    fused_backward: str
    attention_impl: str
    attention_window: int  # 0 = full attention

    def __post_init__(self) -> None:
        # Each value against its key's rule, then the rules between keys: what validate() applies to a config.
        cli.check_model({config_key(f): getattr(self, f.name) for f in dataclasses.fields(self)})

    @property
    def heads_kv(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def d_qk(self) -> int:
        return self.qk_head_dim or self.d_model // self.num_heads

    @property
    def d_v(self) -> int:
        return self.v_head_dim or self.d_model // self.num_heads

    @property
    def compute_dtype(self) -> jnp.dtype:
        return DTYPES[self.dtype]

    @property
    def window(self) -> int | None:
        return self.attention_window or None

    @property
    def fused_backward_on(self) -> bool:
        """model.fused_backward resolved for the backend this process runs on."""
        return fused_backward_enabled(self.fused_backward)

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict) -> TransformerSpec:
        """Builds the spec from a full config (groups `model` and `attention`)."""
        given = {f"{group}.{leaf}": value for group in ("model", "attention") for leaf, value in config[group].items()}
        keys = {config_key(f): f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - set(keys))
        if unknown:
            raise ConfigError(f"config keys {unknown[0]} ... are not model hyperparameters: {unknown}")
        missing = sorted(set(keys) - set(given))
        if missing:
            raise ConfigError(f"config is missing model keys: {missing}")
        return cls(**{name: given[key] for key, name in keys.items()})


def config_key(field: dataclasses.Field) -> str:
    """The config key of a spec field: d_model -> model.d_model, attention_impl -> attention.impl."""
    name = field.name
    return f"attention.{name.removeprefix('attention_')}" if name in _ATTENTION_FIELDS else f"model.{name}"


# Glorot/Xavier uniform, as tensor2tensor and torch.nn.Transformer initialise their projections.
DENSE_INIT = nnx.initializers.xavier_uniform()


class Dense(nnx.Linear):
    """nnx.Linear, plus a low-rank adapter's x A B s where model/lora.py attached one (None: nnx.Linear's trace)."""

    adapter = None

    def __call__(self, x: Array) -> Array:
        y = super().__call__(x)
        return y if self.adapter is None else y + self.adapter(x)


def dense(in_features: int, out_features: int, spec: TransformerSpec, rngs: nnx.Rngs, *, bias: bool = True):
    """A float32-parameter linear layer that computes in the spec's dtype."""
    return Dense(
        in_features,
        out_features,
        use_bias=bias,
        dtype=spec.compute_dtype,
        param_dtype=jnp.float32,
        kernel_init=DENSE_INIT,
        dot_general=fused_dot_general if spec.fused_backward_on else jax.lax.dot_general,
        rngs=rngs,
    )


def fused_dot_general(x, kernel, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """nnx.Linear's x @ kernel, with the hand-written backward of `matmul_last` when nothing unusual is asked.

    Anything else (other contracting or batch axes, an explicit precision or result type, an output sharding) goes
    to jax.lax.dot_general unchanged, since matmul_last's backward assumes none of it.
    """
    (x_contract, k_contract), batch_dims = dimension_numbers
    plain = tuple(x_contract) == (x.ndim - 1,) and tuple(k_contract) == (0,) and batch_dims == ((), ())
    if not plain or precision is not None or preferred_element_type is not None or kwargs.get("out_sharding"):
        return jax.lax.dot_general(x, kernel, dimension_numbers, precision, preferred_element_type, **kwargs)
    return matmul_last(x, kernel)


@jax.custom_vjp
def matmul_last(x: Array, w: Array) -> Array:
    """x [..., in] @ w [in, out] over x's last axis (any leading axes; in and out are any widths)."""
    return jnp.matmul(x, w)


def _matmul_last_fwd(x, w):
    return matmul_last(x, w), (x, w)


def _matmul_last_bwd(residuals, g):
    """dx = g w^T; dw = x^T g over all leading axes, arranged so that XLA:CPU transposes the narrower of x and g.

    Autodiff's dw made XLA:CPU write a transposed copy of g (fused with the ReLU backward) for each layer, a
    visible part of the CPU train step (docs/benchmarks.md).
    """
    x, w = residuals
    d_in, d_out = w.shape
    rows_x, rows_g = x.reshape(-1, d_in), g.reshape(-1, d_out)  # leading axes flattened into rows
    over_rows = (((0,), (0,)), ((), ()))  # contract the rows of both operands
    d_x = jnp.matmul(g, w.T)
    if d_in <= d_out:
        d_w = jax.lax.dot_general(rows_x, rows_g, over_rows)  # [in, out]
    else:
        d_w = jax.lax.dot_general(rows_g, rows_x, over_rows).T  # [out, in], transposed
    return d_x.astype(x.dtype), d_w.astype(w.dtype)


matmul_last.defvjp(_matmul_last_fwd, _matmul_last_bwd)


# Dropout masks from a counter-based hash: one fused elementwise kernel, no random-number tensor in memory.
#
# keep(i) = hash(i, key) >= rate * 2^32, where i is the element's flat index and hash is two rounds of the
# "lowbias32" integer mixer (Wellons). jax.random.bernoulli instead runs a separate generator (threefry or XLA's
# RngBitGenerator) that writes a uint32 per element and then a compare, a visible share of a CPU train step
# (benchmarks/train_step.py measures it); this mask fuses into the multiply that applies it.
#
# Statistical quality is tested (tests/test_dropout.py): keep rate, independence of neighbouring elements and of
# different keys, uniformity of the bits.

_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: spreads consecutive indices before mixing


def _mix32(x: Array) -> Array:
    """lowbias32: an invertible uint32 -> uint32 mixer with low avalanche bias."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def hash_bits(key: Array, shape: tuple[int, ...]) -> Array:
    """uint32 bits for every element of `shape`, a pure function of (key, flat index)."""
    size = math.prod(shape)
    if size >= 2**32:
        raise ValueError(f"hash_bits: {size} elements exceed the 2^32 flat-index counter; split the tensor")
    seed = jax.random.bits(key, (2,), jnp.uint32)
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):  # flat row-major index without materialising a reshape
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
        stride *= shape[axis]
    x = _mix32(index * jnp.uint32(_GOLDEN) + seed[0])
    return _mix32(x ^ seed[1])


def dropout(x: Array, rate: float, key: Array) -> Array:
    """Inverted dropout: zero each element with probability `rate` (to 2^-32), scale survivors by 1/(1-rate)."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
    if rate == 0.0:
        return x
    threshold = jnp.uint32(min(round(rate * 2**32), 2**32 - 1))
    keep = hash_bits(key, x.shape) >= threshold
    return jnp.where(keep, x * jnp.asarray(1.0 / (1.0 - rate), x.dtype), jnp.zeros((), x.dtype))


class Dropout(nnx.Dropout):
    """nnx.Dropout (train()/eval() switch, forked 'dropout' RNG stream) with the fused hash mask of `dropout`."""

    def __call__(self, inputs: Array) -> Array:
        if self.deterministic or self.rate == 0.0:
            return inputs
        return dropout(inputs, self.rate, self.rngs())


class Embedding(nnx.Module):
    """Token embedding scaled by sqrt(d_model) (paper 3.4); `attend` is the tied pre-softmax projection.

    fused_backward: `attend` uses the hand-written backward of `tied_logits` (resolved model.fused_backward).
    An adapter (model/lora.py) adds its low-rank rows to both.
    """

    adapter = None

    def __init__(self, vocab_size: int, d_model: int, dtype: jnp.dtype, *, fused_backward: bool, rngs: nnx.Rngs):
        # std d_model^-0.5 so that the sqrt(d_model)-scaled embedding has unit variance, as in tensor2tensor.
        init = nnx.initializers.normal(stddev=d_model**-0.5)
        self.table_VD = nnx.Param(init(rngs.params(), (vocab_size, d_model), jnp.float32))
        self.d_model = d_model
        self.dtype = dtype
        self.fused_backward = fused_backward

    def __call__(self, tokens_BT: Array) -> Array:
        """x = E[token] * sqrt(d_model)."""
        rows_BTD = self.table_VD[...][tokens_BT]
        if self.adapter is not None:
            rows_BTD = rows_BTD + self.adapter.rows(tokens_BT)
        return (rows_BTD * jnp.sqrt(float(self.d_model))).astype(self.dtype)

    def attend(self, x_BTD: Array) -> Array:
        """logits = x E^T, in float32."""
        project = tied_logits if self.fused_backward else logits_from_table
        logits_BTV = project(x_BTD.astype(self.dtype), self.table_VD[...].astype(self.dtype))
        return logits_BTV if self.adapter is None else logits_BTV + self.adapter.attend(x_BTD.astype(self.dtype))


def logits_from_table(x_BTD: Array, table_VD: Array) -> Array:
    """logits = x E^T in float32 (differentiated by autodiff)."""
    return jnp.einsum("btd,vd->btv", x_BTD, table_VD, preferred_element_type=jnp.float32)


@jax.custom_vjp
def tied_logits(x_BTD: Array, table_VD: Array) -> Array:
    """logits = x E^T in float32, with a hand-written backward (below)."""
    return logits_from_table(x_BTD, table_VD)


def _tied_logits_fwd(x_BTD, table_VD):
    return tied_logits(x_BTD, table_VD), (x_BTD, table_VD)


def _tied_logits_bwd(residuals, d_logits_BTV):
    """dx = g E and dE = (x^T g)^T. Autodiff's dE = g^T x made XLA:CPU write a transposed [V, B*T] copy of the
    logits gradient (docs/benchmarks.md); x^T is V/D times smaller to transpose.

    Both products return the operands' dtype, as autodiff's do: XLA:CPU has no bfloat16 x bfloat16 = float32 dot
    for every shape ("Unsupported element type for DotThunk"), and the results are rounded to that dtype anyway.
    """
    x_BTD, table_VD = residuals
    g_BTV = d_logits_BTV.astype(x_BTD.dtype)
    d_x_BTD = jnp.einsum("btv,vd->btd", g_BTV, table_VD)
    d_table_DV = jnp.einsum("btd,btv->dv", x_BTD, g_BTV)
    return d_x_BTD.astype(x_BTD.dtype), d_table_DV.T.astype(table_VD.dtype)


tied_logits.defvjp(_tied_logits_fwd, _tied_logits_bwd)


def sinusoidal_encoding(positions_BT: Array, d_model: int, layout: str) -> Array:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)) (paper 3.5).

    layout (model.sinusoid_layout): "interleaved" indexes the columns as the formula does; "concatenated" (Marian's,
    as transformers' MarianSinusoidalPositionalEmbedding computes it) holds the same frequencies as PE(pos, i) = sin,
    PE(pos, d_model/2 + i) = cos; "fairseq" (fairseq's and tensor2tensor's get_timing_signal_1d, transformers'
    M2M100SinusoidalPositionalEmbedding) concatenates sin | cos of other frequencies, exp(-log(10000) i / (d_model/2
    - 1)) for i = 0 .. d_model/2 - 1, so that the last is exactly 1/10000 (it needs d_model >= 4). Computed from
    explicit positions so that packed sequences restart at 0 (the caller adds model.position_offset). Returns float32
    [B, T, D].
    """
    if d_model % 2:
        raise ValueError(f"sinusoidal positional encoding needs an even model.d_model, got {d_model}")
    if layout not in schema.SINUSOID_LAYOUTS:
        raise ValueError(f"unknown model.sinusoid_layout {layout!r}")
    if layout == "fairseq":
        if d_model < 4:
            raise ValueError(f"model.sinusoid_layout=fairseq needs model.d_model >= 4, got {d_model}")
        # As fairseq computes it, in float32: the step of the log-frequencies, then exp of i times it.
        step = math.log(10000.0) / (d_model // 2 - 1)
        inv_freq_Z = jnp.exp(jnp.arange(d_model // 2, dtype=jnp.float32) * -step)
    else:
        two_i = jnp.arange(0, d_model, 2, dtype=jnp.float32)  # 2i for i = 0 .. d_model/2 - 1
        inv_freq_Z = 1.0 / (10000.0 ** (two_i / d_model))
    angles_BTZ = positions_BT.astype(jnp.float32)[..., None] * inv_freq_Z
    if layout != "interleaved":
        return jnp.concatenate([jnp.sin(angles_BTZ), jnp.cos(angles_BTZ)], axis=-1)
    # Interleave so that even features are sines and odd features cosines, exactly as the formula indexes them.
    pe_BTZ2 = jnp.stack([jnp.sin(angles_BTZ), jnp.cos(angles_BTZ)], axis=-1)
    return pe_BTZ2.reshape(*positions_BT.shape, d_model)


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
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (paper 3.3); GELU, Swish (SiLU(x W1 + b1) W2 + b2, Marian's), or SwiGLU
    (Swish(x W1) * (x W3)) W2 as options."""

    def __init__(self, spec: TransformerSpec, *, rngs: nnx.Rngs):
        self.activation = spec.activation
        self.w1 = dense(spec.d_model, spec.d_ff, spec, rngs)
        self.w3 = dense(spec.d_model, spec.d_ff, spec, rngs) if spec.activation == "swiglu" else None
        self.w2 = dense(spec.d_ff, spec.d_model, spec, rngs)
        self.dropout = Dropout(spec.ffn_dropout_rate, rngs=rngs)
        self.capture_intermediates = False  # True: sow the hidden activations (transformer_jax.explain)

    def __call__(self, x_BTD: Array) -> Array:
        h_BTF = self.w1(x_BTD)
        if self.activation == "relu":
            h_BTF = jax.nn.relu(h_BTF)
        elif self.activation == "gelu":
            h_BTF = jax.nn.gelu(h_BTF)
        elif self.activation == "swish":
            h_BTF = jax.nn.silu(h_BTF)
        else:
            h_BTF = jax.nn.silu(h_BTF) * self.w3(x_BTD)
        if self.capture_intermediates:
            self.sow(nnx.Intermediate, "hidden", h_BTF)
        return self.w2(self.dropout(h_BTF))


class MultiHeadAttention(nnx.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, head_i = Attention(Q W^Q_i, K W^K_i, V W^V_i) (3.2.2).

    The module never knows which kernel runs: it calls `ops.attention(..., impl=spec.attention_impl)`.
    For transformer_jax.explain, `capture_weights = True` sows the attention weights [B, N, T, S] (computed by the
    `xla` reference whatever the kernel) and `capture_intermediates = True` sows Q, K, V, the heads' outputs and the
    output, as `nnx.Intermediate`; both are off by default, so training and decoding trace exactly as without them.
    """

    def __init__(self, spec: TransformerSpec, *, rngs: nnx.Rngs):
        self.num_heads, self.num_kv_heads = spec.num_heads, spec.heads_kv
        self.d_qk, self.d_v = spec.d_qk, spec.d_v
        self.q_proj = dense(spec.d_model, self.num_heads * self.d_qk, spec, rngs)
        self.k_proj = dense(spec.d_model, self.num_kv_heads * self.d_qk, spec, rngs)
        self.v_proj = dense(spec.d_model, self.num_kv_heads * self.d_v, spec, rngs)
        self.o_proj = dense(self.num_heads * self.d_v, spec.d_model, spec, rngs)
        self.weights_dropout = Dropout(spec.attention_dropout_rate, rngs=rngs)
        self.dropout_rate = spec.attention_dropout_rate
        self.impl = spec.attention_impl
        self.window = spec.window
        self.capture_weights = False
        self.capture_intermediates = False

    def project_kv(self, x_BSD: Array) -> tuple[Array, Array]:
        """K = X W^K and V = X W^V, split into heads: [B, S, K, H] and [B, S, K, E]."""
        batch, length, _ = x_BSD.shape
        k_BSKH = self.k_proj(x_BSD).reshape(batch, length, self.num_kv_heads, self.d_qk)
        v_BSKE = self.v_proj(x_BSD).reshape(batch, length, self.num_kv_heads, self.d_v)
        return k_BSKH, v_BSKE

    def __call__(
        self,
        x_BTD: Array,
        kv: tuple[Array, Array],
        *,
        q_segment_ids: Array | None,
        kv_segment_ids: Array | None,
        q_positions: Array | None,
        kv_positions: Array | None,
        causal: bool,
        kv_heads_first: bool = False,
        lineage: tuple[Array, int] | None = None,
    ) -> Array:
        """Attends queries from x to precomputed (K, V) heads; returns [B, T, D].

        kv is ([B, S, K, H], [B, S, K, E]) as project_kv returns them, or heads-first ([B, K, S, H], [B, K, S, E])
        with kv_heads_first, the layout of the decoding cache (see ops/attention.py for why). lineage: (lineage_RL,
        W) of a cache shared by each sentence's W beams (ops.attention's lineage).
        """
        batch, length, _ = x_BTD.shape
        q_BTNH = self.q_proj(x_BTD).reshape(batch, length, self.num_heads, self.d_qk)
        k_BSKH, v_BSKE = kv
        masking = dict(
            kv_heads_first=kv_heads_first,
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
            causal=causal,
            q_positions=q_positions,
            kv_positions=kv_positions,
            window=self.window,
            lineage=lineage,
        )
        use_dropout = self.dropout_rate > 0 and not self.weights_dropout.deterministic
        if self.capture_weights or use_dropout:
            out_BTNE, weights_BNTS = ops.attention(
                q_BTNH,
                k_BSKH,
                v_BSKE,
                impl="xla",
                return_weights=True,
                weights_dropout=self.weights_dropout if use_dropout else None,
                **masking,
            )
            if self.capture_weights:
                self.sow(nnx.Intermediate, "attention_weights", weights_BNTS)
        else:
            out_BTNE = ops.attention(q_BTNH, k_BSKH, v_BSKE, impl=self.impl, **masking)
        out_BTD = self.o_proj(out_BTNE.reshape(batch, length, self.num_heads * self.d_v))
        if self.capture_intermediates:
            for name, value in (("q", q_BTNH), ("k", k_BSKH), ("v", v_BSKE), ("heads", out_BTNE), ("output", out_BTD)):
                self.sow(nnx.Intermediate, name, value)
        return out_BTD


# The decoding caches hold keys and values heads-first, k [B, K, L, H] and v [B, K, L, E]: slots on axis 2.
CACHE_SLOT_AXIS = 2


def heads_first(x_BSKH: Array) -> Array:
    """[B, S, K, H] (project_kv's layout) -> [B, K, S, H] (the cache's)."""
    return jnp.swapaxes(x_BSKH, 1, CACHE_SLOT_AXIS)


def init_self_cache(attn: MultiHeadAttention, batch: int, max_len: int, dtype: jnp.dtype) -> dict[str, Array]:
    """An empty decoder self-attention cache holding up to max_len keys and values, heads-first."""
    return {
        "k": jnp.zeros((batch, attn.num_kv_heads, max_len, attn.d_qk), dtype),
        "v": jnp.zeros((batch, attn.num_kv_heads, max_len, attn.d_v), dtype),
    }


def append_to_cache(cache: dict[str, Array], k_BTKH: Array, v_BTKE: Array, index_B: Array) -> dict[str, Array]:
    """Writes row b's new keys/values at its slots [index_B[b], index_B[b] + T) of the cache.

    Each row has its own write index, so rows at different positions (sentences that joined a running batch at
    different steps) share one cache.
    """
    # Per row, the slots without the batch axis: the slot axis is one lower.
    write_row = jax.vmap(functools.partial(jax.lax.dynamic_update_slice_in_dim, axis=CACHE_SLOT_AXIS - 1))

    def write(slots: Array, new_BTKX: Array) -> Array:
        return write_row(slots, heads_first(new_BTKX).astype(slots.dtype), index_B)

    return {"k": write(cache["k"], k_BTKH), "v": write(cache["v"], v_BTKE)}


def append_lineage(lineage_RL: Array, width: int, length: int, index_R: Array) -> Array:
    """The beam lineage (ops/attention.py) after each row writes `length` slots from index_R[r] on: those slots are its
    own (beam r mod W of its sentence)."""
    rows = lineage_RL.shape[0]
    own_RT = jnp.broadcast_to((jnp.arange(rows, dtype=jnp.int32) % width)[:, None], (rows, length))
    return jax.vmap(jax.lax.dynamic_update_slice_in_dim, in_axes=(0, 0, 0, None))(lineage_RL, own_RT, index_R, 0)


def grow_slots(slots: Array, max_len: int) -> Array:
    """Heads-first keys or values [B, K, L, X] with room for max_len slots (>= L): the new slots are zeros (empty or
    padding: never attended)."""
    extra = max_len - slots.shape[CACHE_SLOT_AXIS]
    if extra < 0:
        raise ValueError(f"cannot shrink a cache of {slots.shape[CACHE_SLOT_AXIS]} slots to {max_len}")
    widths = [(0, 0)] * slots.ndim
    widths[CACHE_SLOT_AXIS] = (0, extra)
    return jnp.pad(slots, widths)


def grow_self_cache(cache: dict[str, Array], max_len: int) -> dict[str, Array]:
    """The same cache with room for max_len slots (>= its own): the new slots are empty (zeros, never attended)."""
    return {name: grow_slots(slots, max_len) for name, slots in cache.items()}
