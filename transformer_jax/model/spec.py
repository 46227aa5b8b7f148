"""The model's hyperparameters as one validated, immutable record built from the `model` and `attention` groups.

Its fields are derived from the keys of those groups (config_keys.KEYS), so a new model key is a new field.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_collections

from transformer_jax import config_checks, config_keys, platform
from transformer_jax.errors import ConfigError

DTYPES = {name: getattr(jnp, name) for name in config_keys.DTYPES}  # model.dtype -> computation dtype


def fused_backward_enabled(setting: str, backend: str | None = None) -> bool:
    """Whether the hand-written backward passes (linear layers, tied logits projection, loss) replace autodiff's.

    They compute the same gradients as autodiff, arranged so that XLA:CPU makes fewer transposed copies; they
    were measured on CPU only (benchmarks/train_step.py), so 'auto' uses them on the CPU backend and leaves every
    other backend to autodiff. `backend` defaults to platform.target_backend().
    """
    if setting == "auto":
        return (backend or platform.target_backend()) == "cpu"
    return setting == "on"


def _field(key: str) -> str:
    """The spec field of a config key: model.d_model -> d_model, attention.impl -> attention_impl."""
    group, _, leaf = key.partition(".")
    return leaf if group == "model" else f"{group}_{leaf}"


# Every model.* and attention.* key, as the spec's fields with the types of their rules (config_keys.KEYS).
SPEC_KEYS = tuple(k.name for k in config_keys.KEYS if k.name.startswith(("model.", "attention.")))
_FIELDS = [(_field(k), config_keys.BY_NAME[k].rule.kind) for k in SPEC_KEYS]


class _SpecMethods:
    """What TransformerSpec computes from its fields, and how it is built from a config."""

    def __post_init__(self) -> None:
        # Each value against its key's rule, then the rules between keys: what validate() applies to a config.
        config_checks.check_model({key: getattr(self, _field(key)) for key in SPEC_KEYS})

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
        unknown = sorted(set(given) - set(SPEC_KEYS))
        if unknown:
            raise ConfigError(f"config keys {unknown[0]} ... are not model hyperparameters: {unknown}")
        missing = sorted(set(SPEC_KEYS) - set(given))
        if missing:
            raise ConfigError(f"config is missing model keys: {missing}")
        return cls(**{_field(key): given[key] for key in SPEC_KEYS})


# Frozen (hashable: a static argument of jitted functions) and without defaults: they live in config_keys.
TransformerSpec = dataclasses.make_dataclass("TransformerSpec", _FIELDS, bases=(_SpecMethods,), frozen=True)
TransformerSpec.__module__ = __name__  # make_dataclass's own `module` argument needs Python 3.12
TransformerSpec.__doc__ = (
    "Every value the modules need: one field per model.* key (attention.* as attention_*), typed by its rule."
)
