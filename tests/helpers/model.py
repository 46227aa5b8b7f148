"""Small shared builders for the model tests."""

import functools
from typing import Any

import jax
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


@functools.partial(nnx.jit, static_argnames=("method", "static"))
def _call(model: Transformer, method: str, args: tuple, arrays: dict, static: tuple) -> Any:
    return getattr(model, method)(*args, **arrays, **dict(static))


def _holds_arrays(value: Any) -> bool:
    leaves = jax.tree.leaves(value)
    return bool(leaves) and all(isinstance(x, jax.Array | np.ndarray) for x in leaves)


def call(model: Transformer, method: str, *args, **kwargs) -> Any:
    """model.method(*args, **kwargs) compiled as one program (keywords holding arrays, e.g. a cache, traced; the
    others static): run eagerly, each of its operations compiles a program of its own for every new shape, which is
    what makes small-model tests slow on CPU (test_model_transformer.py's eager calls: ~200 programs a test)."""
    arrays = {k: v for k, v in kwargs.items() if _holds_arrays(v)}
    static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in arrays))
    return _call(model, method, args, arrays, static)


def forward(model: Transformer, *args, **kwargs) -> jnp.ndarray:
    """model(*args, **kwargs), compiled (see `call`)."""
    return call(model, "__call__", *args, **kwargs)
