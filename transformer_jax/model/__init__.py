"""Flax NNX modules of the Transformer; each equation of the paper has one home here (see README)."""

from __future__ import annotations

import ml_collections
from flax import nnx

from transformer_jax.model.spec import TransformerSpec
from transformer_jax.model.transformer import Transformer, capture_attention_weights, unpacked_segment_ids


def build_model(config: ml_collections.ConfigDict, *, rngs: nnx.Rngs) -> Transformer:
    """The Transformer described by a full config (groups `model` and `attention`), validated."""
    return Transformer(TransformerSpec.from_config(config), rngs=rngs)


__all__ = ["Transformer", "TransformerSpec", "build_model", "capture_attention_weights", "unpacked_segment_ids"]
