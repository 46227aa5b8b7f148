"""Flax NNX modules of the Transformer; each equation of the paper has one home here (see README)."""

from transformer_jax.model.layers import SpecialIds, TransformerSpec
from transformer_jax.model.transformer import (
    Transformer,
    build_model,
    capture_attention_weights,
    model_rngs,
    parameter_count,
    unpacked_segment_ids,
)

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
