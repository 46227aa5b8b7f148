"""Flax NNX modules of the Transformer; each equation of the paper has one home here (see README)."""

from __future__ import annotations

import functools

import jax
import ml_collections
from flax import nnx

from transformer_jax.model.spec import SpecialIds, TransformerSpec
from transformer_jax.model.transformer import Transformer, capture_attention_weights, unpacked_segment_ids


def build_model(config: ml_collections.ConfigDict, *, rngs: nnx.Rngs) -> Transformer:
    """The Transformer described by a full config (groups `model` and `attention`), validated."""
    return Transformer(TransformerSpec.from_config(config), rngs=rngs)


def model_rngs(seed: int) -> nnx.Rngs:
    """The random streams every model is built with, in training and for evaluation alike.

    Separate streams: parameter init and dropout draw from different keys of the same seed. Dropout masks come from
    a counter hash (model/layers.py: dropout) that draws only two words per call from this key, so the key's impl costs
    nothing; it stays "rbg" because the key is part of every checkpoint and another impl has another shape. The
    streams are part of the model's graph and state, so a model built otherwise (for evaluation) would compile
    other decoding programs than the ones validation BLEU saved during training (docs/compilation.md).
    """
    return nnx.Rngs(params=seed, dropout=jax.random.key(seed + 1, impl="rbg"))


def parameter_count(config: ml_collections.ConfigDict) -> int:
    """The config's model's number of parameters, from shapes only (nothing allocated)."""
    return _parameter_count(TransformerSpec.from_config(config))


@functools.lru_cache(maxsize=64)
def _parameter_count(spec: TransformerSpec) -> int:
    # Kept per spec, which is all that shapes the model: tracing the initialisers of a big model takes about a second,
    # and a sweep counts every variant, many of one spec.
    model = nnx.eval_shape(lambda: Transformer(spec, rngs=model_rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


__all__ = [
    "SpecialIds",
    "Transformer",
    "TransformerSpec",
    "build_model",
    "capture_attention_weights",
    "model_rngs",
    "parameter_count",
    "unpacked_segment_ids",
]
