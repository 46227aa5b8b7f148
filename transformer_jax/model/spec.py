"""The model's hyperparameters as one validated, immutable record built from the `model` and `attention` groups."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_collections

from transformer_jax import config_checks, platform
from transformer_jax.errors import ConfigError
from transformer_jax.tokens import PAD_ID

DTYPES = {name: getattr(jnp, name) for name in config_checks.DTYPES}  # model.dtype -> computation dtype


def fused_backward_enabled(setting: str, backend: str | None = None) -> bool:
    """Whether the hand-written backward passes (linear layers, tied logits projection, loss) replace autodiff's.

    They compute the same gradients as autodiff, arranged so that XLA:CPU makes fewer transposed copies; they
    were measured on CPU only (benchmarks/train_step.py), so 'auto' uses them on the CPU backend and leaves every
    other backend to autodiff. `backend` defaults to platform.target_backend().
    """
    if setting == "auto":
        return (backend or platform.target_backend()) == "cpu"
    return setting == "on"


@dataclasses.dataclass(frozen=True)
class TransformerSpec:
    """Every value the modules need; no defaults here: they live in configs/."""

    vocab_size: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    qk_head_dim: int
    v_head_dim: int
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
    max_len: int
    share_embeddings: bool
    tie_output: bool
    dtype: str
    fused_backward: str
    attention_impl: str
    attention_window: int

    def __post_init__(self) -> None:
        # The rules live in one table (config_checks.RULES) with those between keys; validate() applies the same.
        values = {f"model.{f.name}": getattr(self, f.name) for f in dataclasses.fields(self)}
        values["attention.impl"] = values.pop("model.attention_impl")
        values["attention.window"] = values.pop("model.attention_window")
        config_checks.check_model(values)

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
        fields = {f.name for f in dataclasses.fields(cls)}
        model = dict(config.model.items())
        if "pad_id" in model:
            model = _upgrade_saved_model_group(model)
        values = {k: v for k, v in model.items() if k in fields}
        unknown = sorted(set(model) - fields)
        if unknown:
            raise ConfigError(f"config keys model.{unknown[0]} ... are not model hyperparameters: {unknown}")
        values["attention_impl"] = config.attention.impl
        values["attention_window"] = config.attention.window
        missing = sorted(fields - set(values))
        if missing:
            raise ConfigError(f"config is missing model keys: {['model.' + m for m in missing]}")
        return cls(**values)


def _upgrade_saved_model_group(model: dict) -> dict:
    """The `model` group of a config saved with a checkpoint before model.pad_id was removed, in today's keys.

    model.pad_id could only ever be tokens.PAD_ID (the tokenizer refused any other id), so it is dropped.
    model.fused_backward did not exist yet: those versions ran the hand-written backward passes everywhere ('on').
    """
    model = dict(model)
    pad_id = model.pop("pad_id")
    if pad_id != PAD_ID:
        raise ConfigError(
            f"invalid config key model.pad_id: padding is always token id {PAD_ID} (transformer_jax/tokens.py), "
            f"got {pad_id}; remove the key"
        )
    model.setdefault("fused_backward", "on")
    return model
