"""Attention functions: one signature, several implementations, chosen by name."""

from transformer_jax.ops.attention import IMPLEMENTATIONS, attention, attention_mask, register

__all__ = ["IMPLEMENTATIONS", "attention", "attention_mask", "register"]
