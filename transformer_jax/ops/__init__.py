"""Attention functions: one signature, several implementations, chosen by name; one mask (masks.AttentionMask)."""

# blockwise, dispatch (cudnn, auto), pallas_gpu (impl "pallas": our Triton kernels; it hands calls traced for TPU
# to pallas_tpu's Mosaic kernels) and linear_attention are imported to register themselves.
from transformer_jax.ops import blockwise, dispatch, linear_attention, masks, pallas_gpu, pallas_tpu
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
    "pallas_gpu",
    "pallas_tpu",
    "register",
]
