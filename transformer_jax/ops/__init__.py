"""Attention functions: one signature, several implementations, chosen by name."""

# blockwise, dispatch (cudnn, auto), pallas_attention and linear are imported to register their implementations.
from transformer_jax.ops import blockwise, dispatch, linear, pallas_attention
from transformer_jax.ops.attention import IMPLEMENTATIONS, attention, attention_mask, register

__all__ = [
    "IMPLEMENTATIONS",
    "attention",
    "attention_mask",
    "blockwise",
    "dispatch",
    "linear",
    "pallas_attention",
    "register",
]
