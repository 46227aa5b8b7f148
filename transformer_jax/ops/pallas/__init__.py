"""Our own FlashAttention-2 kernels in Pallas, behind `impl="pallas"`: gpu.py (custom VJP and padding; Triton on
GPU, interpreted on CPU) over gpu_kernels.py, and tpu.py (layout rules, tile table, shard_map under a mesh) over
tpu_kernels.py (Mosaic). gpu.py registers the implementation and hands calls traced for TPU to tpu.py."""

from transformer_jax.ops.pallas import gpu, tpu

__all__ = ["gpu", "tpu"]
