"""The model's hyperparameters as one validated, immutable record built from the `model` and `attention` groups."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections

from transformer_jax.errors import ConfigError
from transformer_jax.tokens import PAD_ID

ACTIVATIONS = ("relu", "gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
NORM_POSITIONS = ("post", "pre")
POSITIONALS = ("sinusoidal", "learned", "none")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
FUSED_BACKWARD = ("auto", "on", "off")


def fused_backward_enabled(setting: str, backend: str | None = None) -> bool:
    """Whether the hand-written backward passes (linear layers, tied logits projection, loss) replace autodiff's.

    They compute the same gradients as autodiff, arranged so that XLA:CPU makes fewer transposed copies; they
    were measured on CPU only (benchmarks/train_step.py), so 'auto' uses them on the CPU backend and leaves every
    other backend to autodiff. `backend` defaults to jax.default_backend().
    """
    if setting == "auto":
        return (backend or jax.default_backend()) == "cpu"
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
        def fail(key: str, why: str) -> None:
            raise ConfigError(f"invalid config key {key}: {why}")

        for key in ("vocab_size", "d_model", "num_heads", "d_ff", "max_len"):
            if getattr(self, key) <= 0:
                fail(f"model.{key}", f"must be positive, got {getattr(self, key)}")
        for key in ("num_encoder_layers", "num_decoder_layers", "num_kv_heads", "qk_head_dim", "v_head_dim"):
            if getattr(self, key) < 0:
                fail(f"model.{key}", f"must be >= 0, got {getattr(self, key)}")
        if (self.qk_head_dim == 0 or self.v_head_dim == 0) and self.d_model % self.num_heads:
            fail(
                "model.num_heads",
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                "change one, or set model.qk_head_dim and model.v_head_dim explicitly",
            )
        if self.heads_kv and self.num_heads % self.heads_kv:
            fail("model.num_kv_heads", f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.heads_kv}")
        for key in ("dropout_rate", "attention_dropout_rate", "ffn_dropout_rate"):
            rate = getattr(self, key)
            if not 0.0 <= rate < 1.0:
                fail(f"model.{key}", f"must be in [0, 1), got {rate}")
        for key, allowed in (
            ("activation", ACTIVATIONS),
            ("norm", NORMS),
            ("norm_position", NORM_POSITIONS),
            ("positional", POSITIONALS),
            ("dtype", tuple(DTYPES)),
            ("fused_backward", FUSED_BACKWARD),
        ):
            if getattr(self, key) not in allowed:
                fail(f"model.{key}", f"unknown value {getattr(self, key)!r}; choose one of {list(allowed)}")
        if self.norm_epsilon <= 0:
            fail("model.norm_epsilon", f"must be positive, got {self.norm_epsilon}")
        if self.attention_window < 0:
            fail("attention.window", f"must be >= 0 tokens (0 = full attention), got {self.attention_window}")
        from transformer_jax import ops  # late import: ops registers implementations on import

        if self.attention_impl not in ops.IMPLEMENTATIONS:
            fail(
                "attention.impl", f"unknown value {self.attention_impl!r}; choose one of {sorted(ops.IMPLEMENTATIONS)}"
            )
        if self.attention_dropout_rate > 0 and self.attention_impl != "xla":
            fail(
                "model.attention_dropout_rate",
                f"attention-weight dropout needs the materialised weights of attention.impl='xla', "
                f"not {self.attention_impl!r}; set it to 0 or use xla",
            )

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
