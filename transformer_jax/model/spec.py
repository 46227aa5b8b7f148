"""The model's hyperparameters as one validated, immutable record built from the `model` and `attention` groups, and
the vocabulary's reserved ids (`SpecialIds`).

A new model key is a `Key` in schema.KEYS and a field here; tests/test_config_keys.py fails until both exist.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp
import ml_collections

from transformer_jax import runtime
from transformer_jax.config import checks, schema
from transformer_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """The reserved ids of one vocabulary, read from the `model.*_id` keys (hashable: a static argument of jitted
    functions).

    A SentencePiece model trained here reserves `DEFAULT` (schema.SPECIAL_IDS); a converted Marian model keeps its
    own (eos 0, unk 1, pad = bos = vocab_size - 1: its decoder starts from pad). Batches pad with `pad`, every
    source and target ends with `eos`, decoding starts from `bos` and stops at `eos`. Since bos may equal pad,
    whether a target position is real comes from the batch's segment ids or lengths, never from `tokens != pad`.
    """

    pad: int  # padding: never a real token, never emitted by the search
    eos: int  # end of sentence: ends every source and target, and stops the search
    bos: int  # the first decoder input (may equal pad, as Marian's decoder_start_token_id does)
    unk: int  # unknown piece

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
    bos_id: int  # may equal pad_id (Marian's decoder starts from pad)
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
    sinusoid_layout: str  # interleaved (paper) or concatenated (Marian): layers.sinusoidal_encoding
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
        checks.check_model({config_key(f): getattr(self, f.name) for f in dataclasses.fields(self)})

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
