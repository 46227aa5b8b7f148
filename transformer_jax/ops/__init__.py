"""Attention functions: one signature, several implementations, chosen by name; one mask (masks.AttentionMask)."""

# blockwise, dispatch (cudnn, auto), pallas (gpu.py, which runs tpu.py on TPU) and linear_attention are imported to
# register themselves.
from transformer_jax.ops import blockwise, dispatch, linear_attention, masks, pallas
from transformer_jax.ops.attention import IMPLEMENTATIONS, attention, attention_mask, register
from transformer_jax.ops.masks import AttentionMask

__all__ = [
    "IMPLEMENTATIONS",
    "AttentionMask",
    "attention",
    "attention_mask",
    "blockwise",
    "dispatch",
    "linear_attention",
    "masks",
    "pallas",
    "register",
]
