"""Small shared builders for the model tests."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import common
from transformer_jax.model import Transformer, TransformerSpec


def tiny_spec(**overrides) -> TransformerSpec:
    """The `tiny` size with model-group overrides (vocab 50 so tokens are easy to write by hand)."""
    config = common.base_config("tiny")
    config.model.vocab_size = 50
    attention = {k: overrides.pop(k) for k in ("impl", "window") if k in overrides}
    config.model.update(overrides)
    config.attention.update(attention)
    return TransformerSpec.from_config(config)


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    """A tiny model in eval mode (dropout off)."""
    model = Transformer(tiny_spec(**overrides), rngs=nnx.Rngs(seed))
    model.eval()
    return model


def random_tokens(seed: int, shape: tuple[int, ...], vocab: int = 50) -> jnp.ndarray:
    """Token ids in [4, vocab): never pad (0), eos (1), bos (2) or unk (3)."""
    return jnp.asarray(np.random.default_rng(seed).integers(4, vocab, size=shape), jnp.int32)


@nnx.jit
def _forward(model: Transformer, args: tuple, kwargs: dict) -> jnp.ndarray:
    return model(*args, **kwargs)


def forward(model: Transformer, *args, **kwargs) -> jnp.ndarray:
    """model(*args, **kwargs) compiled: eager op-by-op dispatch is what makes small-model tests slow on CPU."""
    return _forward(model, args, kwargs)
