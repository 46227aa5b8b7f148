"""TPU attention, compiled on this host for one chip of a TPU topology: compiler estimates, not timings.

    python -m benchmarks.attention --tpu_topology v5e:2x2

One JSON line per (implementation, length, head dim, mask) for forward + backward (jax.vjp) in bfloat16, B = 1,
N = 1024 / H heads: compile time (this host), memory_analysis() temp and argument bytes, and cost_analysis()
flops and bytes accessed. Every figure but compile_s is what the TPU compiler says the program would do; a
Pallas kernel declares its own cost (pl.CostEstimate), so for kernels cost_analysis() repeats the kernel's
declaration. Ours is declared from the causal/window rule at trace time (segment ids are data), so the record
also gives `kernel_flops_computed_tiles`: the matmul flops of the tiles our kernels visit for this very mask
(attention.AttentionMask.loop_bounds), and how many tiles that is out of the whole grid.

Implementations: ours (attention impl=pallas on TPU), jax's pallas.ops.tpu.flash_attention (its default
128-tiles), splash attention (512-tiles) and xla. Masks: causal (T = S), packed (four segments per row of
random lengths, the last eighth padding, not causal: encoder self-attention of packed batches).

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import ops, runtime
from transformer_jax.ops import pallas_tpu
from transformer_jax.ops.attention import AttentionMask
from transformer_jax.plan import accelerators

Array = jax.Array
IMPLS = ("ours", "jax_flash", "splash", "xla")
MASKS = ("causal", "packed")
MODEL_WIDTH = 1024  # N H: heads = MODEL_WIDTH // head_dim


def packed_segments(length: int, seed: int = 0) -> np.ndarray:
    """[1, length] int32: four segments of random lengths, then an eighth of padding (id 0)."""
    rng = np.random.default_rng(seed)
    real = length - length // 8
    cuts = np.sort(rng.choice(np.arange(1, real), 3, replace=False))
    ids = np.searchsorted(cuts, np.arange(length), side="right") + 1
    ids[real:] = 0
    return ids[None].astype(np.int32)


def _jax_flash(causal: bool, seg: Array | None) -> Callable:
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    def run(q: Array, k: Array, v: Array) -> Array:  # jax's layout: [B, N, T, H]
        ids = None if seg is None else fa.SegmentIds(seg, seg)
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
        out = fa.flash_attention(q, k, v, segment_ids=ids, causal=causal, sm_scale=q.shape[-1] ** -0.5)
        return out.transpose(0, 2, 1, 3)

    return run


def _splash(causal: bool, seg: Array | None, heads: int, length: int) -> Callable:
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    rule = sa.CausalMask((length, length)) if causal else sa.FullMask((length, length))
    sizes = sa.BlockSizes(512, 512, 512, 512, 512, 512, 512, 512)
    kernel = sa.make_splash_mha(sa.MultiHeadMask([rule] * heads), block_sizes=sizes, head_shards=1, q_seq_shards=1)

    def run(q: Array, k: Array, v: Array) -> Array:  # splash: one row [N, T, H], scale folded into q
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
        q = q * q.shape[-1] ** -0.5
        if seg is None:
            out = jax.vmap(kernel)(q, k, v)
        else:
            out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=sa.SegmentIds(s, s)))(q, k, v, seg)
        return out.transpose(0, 2, 1, 3)

    return run


def attention_fn(impl: str, mask: str, heads: int, length: int) -> Callable[[Array, Array, Array], Array]:
    causal = mask == "causal"
    seg = None if causal else jnp.asarray(packed_segments(length))
    if impl == "jax_flash":
        return _jax_flash(causal, seg)
    if impl == "splash":
        return _splash(causal, seg, heads, length)
    kw = dict(causal=True) if causal else dict(q_segment_ids=seg, kv_segment_ids=seg)
    return lambda q, k, v: ops.attention(q, k, v, impl="pallas" if impl == "ours" else "xla", **kw)


def computed_tiles(mask: str, heads: int, length: int, head_dim: int) -> dict:
    """Our kernels' tiles for this mask (loop_bounds on the concrete mask) and their matmul flops, fwd + bwd."""
    sizes, q_pad, kv_pad = pallas_tpu.prepared_sizes(length, length, head_dim)
    seg = None if mask == "causal" else packed_segments(length)
    rule = AttentionMask.create(
        1, length, length, q_segment_ids=seg if seg is not None else np.ones((1, length), np.int32),
        kv_segment_ids=seg if seg is not None else np.ones((1, length), np.int32), causal=mask == "causal", xp=np,
    ).pad(1, length, length, q_pad, kv_pad)  # fmt: skip
    tiles = pallas_tpu.planned_tiles(rule, 1, heads, heads, sizes)
    blocks = dict(forward=(sizes.fwd_q, sizes.fwd_k), dkdv=(sizes.bwd_q, sizes.bwd_k), dq=(sizes.bwd_q, sizes.bwd_k))
    flops = sum(pallas_tpu.tile_flops(name, *blocks[name], head_dim, head_dim) * n for name, n in tiles.items())
    grid = heads * (q_pad // sizes.fwd_q) * (kv_pad // sizes.fwd_k)
    return dict(kernel_flops_computed_tiles=flops, forward_tiles_computed=tiles["forward"], forward_tiles_grid=grid)


def measure(topology: str, impl: str, length: int, head_dim: int, mask: str) -> dict:
    heads = MODEL_WIDTH // head_dim
    record = dict(
        topology=topology, impl=impl, seq_len=length, head_dim=head_dim, mask=mask, dtype="bfloat16", batch=1,
        heads=heads, figures="compiler estimates (memory_analysis, cost_analysis), not timings",
    )  # fmt: skip
    device = accelerators.tpu_devices(topology)[0]
    spec = jax.ShapeDtypeStruct(
        (1, length, heads, head_dim), jnp.bfloat16, sharding=jax.sharding.SingleDeviceSharding(device)
    )
    fn = attention_fn(impl, mask, heads, length)

    def fwd_bwd(q: Array, k: Array, v: Array, do: Array) -> tuple:
        out, vjp = jax.vjp(fn, q, k, v)
        return vjp(do)

    start = time.perf_counter()
    try:
        with runtime.compiling_for("tpu"):
            compiled = jax.jit(fwd_bwd).trace(spec, spec, spec, spec).lower().compile()
    except Exception as e:  # an unsupported combination is a result too
        record["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return record
    record["compile_s"] = round(time.perf_counter() - start, 2)
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis() or {}
    record["temp_bytes"] = int(memory.temp_size_in_bytes)
    record["argument_bytes"] = int(memory.argument_size_in_bytes)
    record["flops"] = cost.get("flops")
    record["bytes_accessed"] = cost.get("bytes accessed")
    if impl == "ours":
        record.update(computed_tiles(mask, heads, length, head_dim))
    return record


def report(topology: str, seq_lens: list[int], head_dims: list[int], impls: list[str], masks: list[str]) -> None:
    for length in seq_lens:
        for head_dim in head_dims:
            for mask in masks:
                for impl in impls:
                    print(json.dumps(measure(topology, impl, length, head_dim, mask)), flush=True)
