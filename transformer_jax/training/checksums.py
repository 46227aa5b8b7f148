"""Per-array checksums of a checkpoint: written with it, verified when it is restored.

A flipped bit in a checkpoint's data files otherwise restores silently (Orbax checks no content). Each array gets a
64-bit sum over its elements of mix(bits(element) + mix(flat global index + 1)) modulo 2**64, where mix is
splitmix64's finaliser. A sum over elements does not depend on how the array is split into shards, so:

- each process hashes only the shards it holds with replica_id 0 (every element of the global array is in exactly
  one such shard over all processes, whatever the mesh: replicated arrays are hashed once, by the process holding
  replica 0, and sharded ones by every process for its own part), and the processes' partial sums are added with
  one all-gather; process 0 writes them (the JSON item `checksums`, like the other JSON items);
- a checkpoint saved with one layout (FSDP over 8 devices) verifies after a restore onto another (one device for
  evaluation), because the sum is the same.

A changed element changes its term to an unrelated 64-bit value, so the sum misses it with probability 2**-64.
The hashes are computed from the host copies of the arrays just before the (possibly asynchronous) save starts,
while the arrays are still valid (the next train step donates them).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax.traverse_util import flatten_dict
from jax.experimental import multihost_utils

VERSION = 1
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_CHUNK = 1 << 20  # elements hashed at a time (bounds the uint64 temporaries to a few MiB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _shard_sum(values: np.ndarray, index: tuple[slice, ...], shape: tuple[int, ...]) -> int:
    """The sum of the terms of one shard (`index`: its slices of the global array of `shape`)."""
    values = np.ascontiguousarray(values)
    if values.size == 0:
        return 0
    bits = values.view(np.dtype(f"u{values.dtype.itemsize}")) if values.dtype.itemsize in (1, 2, 4, 8) else None
    if bits is None:
        raise TypeError(f"cannot checksum dtype {values.dtype}")
    if values.ndim == 0:
        return int(_mix(bits.astype(np.uint64) + _mix(np.uint64(1))))
    strides = np.cumprod((1,) + shape[:0:-1])[::-1].astype(np.uint64)  # row-major element strides
    starts = [s.start or 0 for s in index] + [0] * (values.ndim - len(index))
    inner = np.zeros(values.shape[1:], np.uint64)
    for axis in range(1, values.ndim):
        offsets = (np.arange(values.shape[axis], dtype=np.uint64) + np.uint64(starts[axis])) * strides[axis]
        inner = inner + offsets.reshape((-1,) + (1,) * (values.ndim - 1 - axis))
    inner = inner.reshape(-1)
    rows = values.shape[0]
    per_chunk = max(1, _CHUNK // max(1, inner.size))
    total = np.uint64(0)
    bits = bits.reshape(rows, -1)
    with np.errstate(over="ignore"):
        for r0 in range(0, rows, per_chunk):
            r1 = min(rows, r0 + per_chunk)
            row_offsets = (np.arange(r0, r1, dtype=np.uint64) + np.uint64(starts[0])) * strides[0]
            flat = row_offsets[:, None] + inner[None, :]
            terms = _mix(bits[r0:r1].astype(np.uint64) + _mix(flat + np.uint64(1)))
            total = total + terms.sum(dtype=np.uint64)
    return int(total)


def _local_sum(x: Any) -> int:
    """This process's part of an array's checksum: its shards with replica_id 0."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if not isinstance(x, jax.Array):
        array = np.asarray(x)
        return _shard_sum(array, tuple(slice(0, n) for n in array.shape), array.shape)
    total = 0
    for shard in x.addressable_shards:
        if shard.replica_id == 0:
            total += _shard_sum(np.asarray(shard.data), shard.index, x.shape)
    return total % (1 << 64)


def _describe(x: Any) -> tuple[list[int], str]:
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return list(np.shape(x)), str(x.dtype)


def checksums(tree: dict) -> dict[str, dict]:
    """{"a/b/c": {"shape", "dtype", "sum"}} for every array of a pure dict; the same on every process.

    With several processes every process must call it (one all-gather of the partial sums).
    """
    flat = {"/".join(str(k) for k in path): x for path, x in flatten_dict(tree).items()}
    names = sorted(flat)
    sums = [_local_sum(flat[name]) for name in names]
    if jax.process_count() > 1 and any(
        isinstance(flat[n], jax.Array) and not flat[n].is_fully_addressable for n in names
    ):
        # uint32 halves: without jax_enable_x64 a uint64 would be truncated on the way.
        halves = np.array([[s >> 32, s & 0xFFFFFFFF] for s in sums], np.uint32).reshape(-1, 2)
        gathered = np.asarray(multihost_utils.process_allgather(halves))  # (processes, arrays, 2)
        sums = [sum((int(h) << 32) | int(lo) for h, lo in gathered[:, i]) % (1 << 64) for i in range(len(names))]
    return {
        name: {"shape": _describe(flat[name])[0], "dtype": _describe(flat[name])[1], "sum": f"{s:016x}"}
        for name, s in zip(names, sums, strict=True)
    }


def mismatches(expected: dict[str, dict], tree: dict) -> list[str]:
    """Names of the arrays of `tree` whose checksum (or shape or dtype) differs from `expected`, with what differs.

    Only arrays present in `tree` are checked (evaluation restores the model parameters alone).
    """
    actual = checksums(tree)
    problems = []
    for name, record in actual.items():
        saved = expected.get(name)
        if saved is None:
            problems.append(f"{name}: no checksum saved for it")
        elif (saved["shape"], saved["dtype"]) != (record["shape"], record["dtype"]):
            problems.append(
                f"{name}: saved {saved['dtype']}{saved['shape']}, restored {record['dtype']}{record['shape']}"
            )
        elif saved["sum"] != record["sum"]:
            problems.append(f"{name}: checksum {record['sum']} != saved {saved['sum']}")
    return problems
