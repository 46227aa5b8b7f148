"""Dropout masks from a counter-based hash: one fused elementwise kernel, no random-number tensor in memory.

keep(i) = hash(i, key) >= rate * 2^32, where i is the element's flat index and hash is two rounds of the
"lowbias32" integer mixer (Wellons). jax.random.bernoulli instead runs a separate generator (threefry or XLA's
RngBitGenerator) that writes a uint32 per element and then a compare, a visible share of a CPU train step
(benchmarks/train_step.py measures it); this mask fuses into the multiply that applies it.

Statistical quality is tested (tests/test_dropout.py): keep rate, independence of neighbouring elements and of
different keys, uniformity of the bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: spreads consecutive indices before mixing


def _mix32(x: Array) -> Array:
    """lowbias32: an invertible uint32 -> uint32 mixer with low avalanche bias."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def hash_bits(key: Array, shape: tuple[int, ...]) -> Array:
    """uint32 bits for every element of `shape`, a pure function of (key, flat index)."""
    size = 1
    for n in shape:
        size *= n
    if size >= 2**32:
        raise ValueError(f"hash_bits: {size} elements exceed the 2^32 flat-index counter; split the tensor")
    seed = jax.random.bits(key, (2,), jnp.uint32)
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):  # flat row-major index without materialising a reshape
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
        stride *= shape[axis]
    x = _mix32(index * jnp.uint32(_GOLDEN) + seed[0])
    return _mix32(x ^ seed[1])


def dropout(x: Array, rate: float, key: Array) -> Array:
    """Inverted dropout: zero each element with probability `rate` (to 2^-32), scale survivors by 1/(1-rate)."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
    if rate == 0.0:
        return x
    threshold = jnp.uint32(min(round(rate * 2**32), 2**32 - 1))
    keep = hash_bits(key, x.shape) >= threshold
    return jnp.where(keep, x * jnp.asarray(1.0 / (1.0 - rate), x.dtype), jnp.zeros((), x.dtype))
