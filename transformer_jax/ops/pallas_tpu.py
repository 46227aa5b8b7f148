"""FlashAttention-2 on TPU with our own Pallas kernels, lowered with Mosaic: `attention(..., impl="pallas")` traced
for TPU (on a CPU host: in TPU interpret mode, or compiled for a TPU topology, accelerators.tpu_devices).

The grid walks (batch, head, resident block, streamed block), one tile per step; the last axis is the reduction,
carried in VMEM scratch from its first step to its last:
    forward (per query block):  m' = max(m, rowmax(s)), l' = e^(m - m') l + rowsum(e^(s - m')),
                                acc' = e^(m - m') acc + e^(s - m') V;  O = acc / l,  lse = m + log l,
    dK/dV (per key block, over the G query heads of its group and all query blocks):
                                P = e^(s - lse), dV += P^T dO, dS = P * (dO V^T - delta), dK += dS^T Q,
    dQ (per query block):       dQ += dS K,
with s = Q K^T * scale and delta = rowsum(dO * O).

Tiles outside a row's [lo, hi) of attention.AttentionMask.loop_bounds (read from SMEM by scalar prefetch) are
skipped: no compute, and the index maps clamp the streamed block into [lo, hi) so that the pipeline does not
fetch it either. Tiles in [a, c) are seen whole and skip the mask.

Mosaic's layout rules, which every shape below obeys (stated here once):
- A block's last two dims are multiples of (8, 128) (sublanes, lanes) or the whole array dim. So the operands are
  heads-first [B, N, T, H] with blocks [X, H] of one head (a squeezed head axis in the last two would break the
  rule); per-query vectors are columns [B, T, 1] and per-key vectors rows [B, 1, S] (whole dim 1), and lse and
  delta are columns [B, N, T, 1].
- Key tiles Y are lanes of the score tile [X, Y] and of the key-vector rows: multiples of 128. Query tiles X are
  sublanes: multiples of 16 (bfloat16 packs two rows per sublane; 16 also serves float32).
- Scalars that steer the grid (the loop bounds) live in SMEM: scalar prefetch, flattened to 1-D.

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from transformer_jax.ops.attention import AttentionMask, pad_tokens, recompute_vjp

Array = jax.Array

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)  # TPUs have no float16 arithmetic
MAX_HEAD_DIM = 256  # a [512, 256] float32 accumulator pair plus score tiles already fill much of the 16 MiB VMEM
LANES, SUBLANES = 128, 16  # the tile multiples of the layout rules above
COUNT_LANES = 128  # a tile count is written as one lane-wide row, the smallest block Mosaic stores


@dataclasses.dataclass(frozen=True)
class TpuBlockSizes:
    """Query tile X (multiple of 16) and key tile Y (multiple of 128), forward and backward."""

    fwd_q: int
    fwd_k: int
    bwd_q: int
    bwd_k: int

    def check(self) -> None:
        for name, size in dataclasses.asdict(self).items():
            multiple = LANES if name.endswith("_k") else SUBLANES
            if size <= 0 or size % multiple:
                raise ValueError(f"pallas TPU attention: block size {name}={size} must be a multiple of {multiple}")

    def fit(self, q_len: int, kv_len: int) -> TpuBlockSizes:
        """Shrinks tiles to short sequences, so that they are not padded to a whole 512-tile."""
        tq, tk = round_up(q_len, SUBLANES), round_up(kv_len, LANES)
        return TpuBlockSizes(min(self.fwd_q, tq), min(self.fwd_k, tk), min(self.bwd_q, tq), min(self.bwd_k, tk))


# Tile sizes by (padded) head dim, for every TPU generation: 512-wide tiles fill the MXU of each (v4/v5e 128x128,
# v6e 256x256). Untuned on hardware (no TPU was lent); 512 follows splash attention's defaults, and 256 keeps the
# head-dim-256 backward's float32 tiles within VMEM.
TPU_BLOCK_SIZES = {
    64: TpuBlockSizes(512, 512, 512, 512),
    128: TpuBlockSizes(512, 512, 512, 512),
    256: TpuBlockSizes(256, 256, 256, 256),
}


def block_sizes_for(head_dim: int) -> TpuBlockSizes:
    return TPU_BLOCK_SIZES[min(d for d in TPU_BLOCK_SIZES if d >= head_dim)]


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static description of one attention call, shared by the three kernels."""

    scale: float
    mask: AttentionMask  # the rule without its vectors (AttentionMask.static()); the vectors are kernel inputs
    segments: bool  # segment id vectors are inputs
    positions: bool  # position vectors are inputs
    masked: bool  # loop bounds are scalar-prefetched and tiles are skipped
    groups: int  # G, query heads per key/value head
    num_i: int  # query blocks
    num_j: int  # key blocks
    count_tiles: bool  # also output how many tiles each resident block computed (tests, benchmark)


@dataclasses.dataclass(frozen=True)
class _Static:
    cfg_fwd: KernelConfig
    cfg_bwd: KernelConfig  # the dK/dV kernel's: num_i/num_j of the backward tiles
    blocks: TpuBlockSizes
    tiles: tuple[int, int, int]  # tiles the forward, dK/dV and dQ kernels compute, for their cost estimates


def unsupported(q: Array, k: Array, v: Array) -> str | None:
    """Why the kernels cannot take these inputs (one line naming the alternative), or None."""
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        return (
            f"attention impl 'pallas' on TPU needs q, k, v all float32 or all bfloat16; got {q.dtype}, {k.dtype}, "
            f"{v.dtype}. Cast them, or use impl='xla'."
        )
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        return (
            f"attention impl 'pallas' on TPU supports head dims up to {MAX_HEAD_DIM}; got q/k {q.shape[-1]}, "
            f"v {v.shape[-1]}. Use impl='blockwise' or 'xla'."
        )
    return None


def tpu_attention(
    q: Array,
    k: Array,
    v: Array,
    mask: AttentionMask,
    *,
    scale: float | None = None,
    block_sizes: TpuBlockSizes | None = None,
) -> Array:
    """FlashAttention-2 for TPU on q [B, T, N, H], k [B, S, K, H], v [B, S, K, E]; the whole AttentionMask.

    Traced under a mesh of several devices (jax.set_mesh), each device runs the kernels on its rows: Mosaic
    kernels cannot be partitioned by XLA, so they run inside a shard_map that splits the batch over every mesh
    axis, as sharding.batch_sharding splits batches.
    """

    def local(q: Array, k: Array, v: Array, mask: AttentionMask) -> Array:
        prepared, mask_p, static = _prepare(q, k, v, mask, scale, block_sizes, count_tiles=False)
        out_BNTE = _attend(*prepared, mask_p, static)
        return out_BNTE[:, :, : q.shape[1], : v.shape[-1]].transpose(0, 2, 1, 3)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return local(q, k, v, mask)
    if q.shape[0] % mesh.size:
        raise ValueError(
            f"attention impl 'pallas' on TPU splits the batch over the mesh's {mesh.size} devices; "
            f"batch {q.shape[0]} is not a multiple of it"
        )
    rows = P(mesh.axis_names)
    specs = (rows, rows, rows, jax.tree.map(lambda _: rows, mask))
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=rows, check_vma=False)(q, k, v, mask)


def tile_counts(q: Array, k: Array, v: Array, mask: AttentionMask, *, block_sizes: TpuBlockSizes | None = None) -> dict:
    """Tiles each kernel computed, counted inside the kernels: forward [B, N, I], dkdv [B, K, J], dq [B, N, I]."""
    (q_p, k_p, v_p), mask_p, static = _prepare(q, k, v, mask, None, block_sizes, count_tiles=True)
    out, lse, fwd_count = _forward_call(q_p, k_p, v_p, mask_p, static)
    *_, dkdv_count, dq_count = _backward_calls((q_p, k_p, v_p, mask_p, out, lse), jnp.ones_like(out), static)
    return dict(forward=fwd_count, dkdv=dkdv_count, dq=dq_count)


def planned_tiles(mask: AttentionMask, batch: int, num_heads: int, num_kv_heads: int, sizes: TpuBlockSizes) -> dict:
    """Tiles the kernels visit by attention.AttentionMask.loop_bounds, totalled: forward and dQ over query-block rows,
    dK/dV over key-block rows of each group's query heads. `mask` is padded to whole tiles and masks something;
    a mask of one row stands for `batch` equal rows."""
    groups = num_heads // num_kv_heads
    rows = batch // next(x for x in (mask.q_segment_ids, mask.q_positions) if x is not None).shape[0]

    def total(bounds: Array) -> int:
        return rows * int(np.sum(np.asarray(bounds[..., 3] - bounds[..., 0])))

    return dict(
        forward=num_heads * total(mask.loop_bounds(sizes.fwd_q, sizes.fwd_k)),
        dkdv=num_kv_heads * groups * total(mask.loop_bounds(sizes.bwd_q, sizes.bwd_k, transpose=True)),
        dq=num_heads * total(mask.loop_bounds(sizes.bwd_q, sizes.bwd_k)),
    )


def tile_flops(kernel: str, block_q: int, block_k: int, head_dim: int, value_dim: int) -> int:
    """Matmul FLOPs of one tile of a kernel (2 per multiply-add): forward Q K^T and P V; dK/dV Q K^T, P^T dO,
    dO V^T and dS^T Q; dQ Q K^T, dO V^T and dS K."""
    per_pair = dict(forward=head_dim + value_dim, dkdv=2 * (head_dim + value_dim), dq=2 * head_dim + value_dim)
    return 2 * block_q * block_k * per_pair[kernel]


def prepared_sizes(q_len: int, kv_len: int, head_dim: int, block_sizes: TpuBlockSizes | None = None) -> tuple:
    """(tile sizes, padded T, padded S) the kernels use for these lengths: the table's row fitted to them."""
    sizes = block_sizes_for(head_dim) if block_sizes is None else block_sizes
    sizes.check()
    sizes = sizes.fit(q_len, kv_len)
    q_pad = round_up(q_len, math.lcm(sizes.fwd_q, sizes.bwd_q))
    kv_pad = round_up(kv_len, math.lcm(sizes.fwd_k, sizes.bwd_k))
    return sizes, q_pad, kv_pad


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _prepare(q, k, v, mask, scale, block_sizes, *, count_tiles: bool):
    """Pads lengths to whole tiles (padding gets segment 0), moves heads first, and builds the static config.
    Inputs the kernels cannot take raise unsupported(...)'s reason at trace time, never a Mosaic error."""
    if reason := unsupported(q, k, v):
        raise ValueError(reason)
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads, value_dim = k.shape[1], k.shape[2], v.shape[3]
    sizes, q_pad, kv_pad = prepared_sizes(q_len, kv_len, max(head_dim, value_dim), block_sizes)
    q, k, v = mask.zero_padding_tokens(q, k, v)
    mask = mask.pad(batch, q_len, kv_len, q_pad, kv_pad)
    heads_first = functools.partial(jnp.transpose, axes=(0, 2, 1, 3))
    q = heads_first(pad_tokens(q, q_pad))
    k = heads_first(pad_tokens(k, kv_pad))
    v = heads_first(pad_tokens(v, kv_pad))
    common = dict(
        scale=float(head_dim**-0.5 if scale is None else scale),
        mask=mask.static(),
        segments=mask.segments,
        positions=mask.positions,
        masked=mask.masks_anything,
        groups=num_heads // num_kv_heads,
        count_tiles=count_tiles,
    )
    cfg_fwd = KernelConfig(num_i=q_pad // sizes.fwd_q, num_j=kv_pad // sizes.fwd_k, **common)
    cfg_bwd = KernelConfig(num_i=q_pad // sizes.bwd_q, num_j=kv_pad // sizes.bwd_k, **common)
    tiles = _static_tiles(mask, batch, num_heads, num_kv_heads, q_len, kv_len, q_pad, kv_pad, sizes)
    return (q, k, v), mask, _Static(cfg_fwd, cfg_bwd, sizes, tiles)


def _static_tiles(mask, batch, num_heads, num_kv_heads, q_len, kv_len, q_pad, kv_pad, sizes) -> tuple:
    """Tiles for the kernels' cost estimates, known at trace time: those that the causal/window rule and the
    padding leave (default positions; all tiles with explicit ones). Segment ids are data: packed rows compute
    fewer tiles than this bound (planned_tiles counts them on concrete masks)."""
    # numpy vectors: worked out on the host, also while compiling for devices this host cannot run.
    ones = np.ones((1, q_len), np.int32), np.ones((1, kv_len), np.int32)  # vectors from the start: numpy throughout
    rule = AttentionMask.create(
        1, q_len, kv_len, q_segment_ids=ones[0], kv_segment_ids=ones[1], causal=mask.causal, window=mask.window, xp=np
    )
    rule = rule.pad(1, q_len, kv_len, q_pad, kv_pad)
    if not mask.explicit_positions:
        counts = planned_tiles(rule, batch, num_heads, num_kv_heads, sizes)
        return counts["forward"], counts["dkdv"], counts["dq"]
    fwd = batch * num_heads * (q_pad // sizes.fwd_q) * (kv_pad // sizes.fwd_k)
    bwd = batch * num_heads * (q_pad // sizes.bwd_q) * (kv_pad // sizes.bwd_k)
    return fwd, bwd, bwd


def _cost(kernel: str, tiles: int, block_q: int, block_k: int, head_dim: int, value_dim: int, *arrays: Array):
    """The kernel's pl.CostEstimate: its tiles' matmul FLOPs and exponentials, and the bytes of `arrays`."""
    return pl.CostEstimate(
        flops=tile_flops(kernel, block_q, block_k, head_dim, value_dim) * tiles,
        transcendentals=block_q * block_k * tiles,
        bytes_accessed=sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in arrays),
    )


def _mask_specs(mask: AttentionMask, q_block: int, q_index, kv_block: int, kv_index) -> tuple[list, list]:
    """(specs, args) of the per-token vectors, in the order _Refs names them."""
    q_spec = pl.BlockSpec((None, q_block, 1), q_index)
    kv_spec = pl.BlockSpec((None, 1, kv_block), kv_index)
    specs, args = [], []
    if mask.segments:
        specs += [q_spec, kv_spec]
        args += [mask.q_segment_ids[:, :, None], mask.kv_segment_ids[:, None, :]]
    if mask.positions:
        specs += [q_spec, kv_spec]
        args += [mask.q_positions[:, :, None], mask.kv_positions[:, None, :]]
    return specs, args


def _prefetch(mask: AttentionMask, cfg: KernelConfig, block_q: int, block_k: int, transpose: bool) -> list:
    if not cfg.masked:
        return []
    return [mask.loop_bounds(block_q, block_k, transpose=transpose).reshape(-1)]


def _query_grid(mask: AttentionMask, cfg: KernelConfig, rows: tuple[int, int, int], bq: int, bk: int) -> tuple:
    """The forward's and the dQ kernel's grid (b, n, i, j): query block i resident, key block j streamed (j itself,
    or clamped into the row's visible range). (q_blk, kv_blk) index maps, mask (specs, args), count (specs, shapes)."""
    if cfg.masked:
        kv_j = lambda b, i, j, bounds: streamed_block(bounds, b * cfg.num_i + i, j)
    else:
        kv_j = lambda b, i, j, *_: j
    q_blk = lambda b, n, i, j, *s: (b, n, i, 0)
    kv_blk = lambda b, n, i, j, *s: (b, lax.div(n, cfg.groups), kv_j(b, i, j, *s), 0)
    masks = _mask_specs(
        mask, bq, lambda b, n, i, j, *s: (b, i, 0), bk, lambda b, n, i, j, *s: (b, 0, kv_j(b, i, j, *s))
    )
    return q_blk, kv_blk, masks, _count_spec(cfg, rows, lambda b, n, i, j, *s: (b, n, i, 0, 0))


def _operand_specs(q_map, kv_map, bq: int, bk: int, head_dim: int, value_dim: int) -> list:
    """Block specs of q [X, H], k [Y, H], v [Y, E], dO [X, E], lse [X, 1] and delta [X, 1] (the forward: 3)."""
    return [
        pl.BlockSpec((None, None, bq, head_dim), q_map),
        pl.BlockSpec((None, None, bk, head_dim), kv_map),
        pl.BlockSpec((None, None, bk, value_dim), kv_map),
        pl.BlockSpec((None, None, bq, value_dim), q_map),
        pl.BlockSpec((None, None, bq, 1), q_map),
        pl.BlockSpec((None, None, bq, 1), q_map),
    ]


def _count_spec(cfg: KernelConfig, rows: tuple[int, int, int], index) -> tuple[list, list]:
    if not cfg.count_tiles:
        return [], []
    spec = pl.BlockSpec((None, None, None, 1, COUNT_LANES), index)
    return [spec], [jax.ShapeDtypeStruct((*rows, 1, COUNT_LANES), jnp.int32)]


def _call(kernel, cfg: KernelConfig, grid, in_specs, out_specs, out_shape, scratch, semantics, cost, name):
    if cfg.count_tiles:
        scratch = [*scratch, pltpu.SMEM((1,), jnp.int32)]
    return pl.pallas_call(
        functools.partial(kernel, cfg=cfg),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1 if cfg.masked else 0,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
        cost_estimate=cost,
        name=name,
    )


def _forward_call(q: Array, k: Array, v: Array, mask: AttentionMask, static: _Static) -> tuple:
    """out [B, N, T, E], lse [B, N, T, 1] (natural log, +inf where a row sees nothing), and counts if counting."""
    cfg, sizes = static.cfg_fwd, static.blocks
    batch, num_heads, q_len, head_dim = q.shape
    value_dim, bq, bk = v.shape[-1], sizes.fwd_q, sizes.fwd_k
    q_blk, kv_blk, (mask_specs, mask_args), (count_specs, count_shapes) = _query_grid(
        mask, cfg, (batch, num_heads, cfg.num_i), bq, bk
    )
    out_BNTE = jax.ShapeDtypeStruct((batch, num_heads, q_len, value_dim), v.dtype)
    out_shape = [out_BNTE, jax.ShapeDtypeStruct((batch, num_heads, q_len, 1), jnp.float32), *count_shapes]
    call = _call(
        forward_kernel,
        cfg,
        (batch, num_heads, cfg.num_i, cfg.num_j),
        [*_operand_specs(q_blk, kv_blk, bq, bk, head_dim, value_dim)[:3], *mask_specs],
        [pl.BlockSpec((None, None, bq, value_dim), q_blk), pl.BlockSpec((None, None, bq, 1), q_blk), *count_specs],
        out_shape,
        [pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, value_dim), jnp.float32)],
        ("parallel", "parallel", "parallel", "arbitrary"),
        _cost("forward", static.tiles[0], bq, bk, head_dim, value_dim, q, k, v, *mask_args, *out_shape),
        "attention_forward_tpu",
    )
    results = call(*_prefetch(mask, cfg, bq, bk, False), q, k, v, *mask_args)
    return tuple(results) if cfg.count_tiles else (results[0], results[1], None)


def _backward_calls(res: tuple, do: Array, static: _Static) -> tuple:
    """dq, dk, dv (and the dK/dV and dQ kernels' tile counts when counting)."""
    cfg, sizes = static.cfg_bwd, static.blocks
    q, k, v, mask, out, lse = res
    batch, num_heads, q_len, head_dim = q.shape
    num_kv_heads, value_dim, g = k.shape[1], v.shape[-1], cfg.groups
    bq, bk = sizes.bwd_q, sizes.bwd_k
    do = do.astype(v.dtype)
    # delta = rowsum(dO * O) (FlashAttention-2, eq. 4); XLA fuses it into one pass.
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)

    # dK, dV: grid over key blocks of each key/value head; the reduction walks its G query heads' query blocks.
    if cfg.masked:
        q_i = lambda b, j, i, bounds: streamed_block(bounds, b * cfg.num_j + j, i)
    else:
        q_i = lambda b, j, i, *_: i
    mask_specs, mask_args = _mask_specs(
        mask, bq, lambda b, h, j, gi, i, *s: (b, q_i(b, j, i, *s), 0), bk, lambda b, h, j, gi, i, *s: (b, 0, j)
    )
    count_specs, count_shapes = _count_spec(
        cfg, (batch, num_kv_heads, cfg.num_j), lambda b, h, j, gi, i, *s: (b, h, j, 0, 0)
    )
    q_row = lambda b, h, j, gi, i, *s: (b, h * g + gi, q_i(b, j, i, *s), 0)
    kv_row = lambda b, h, j, gi, i, *s: (b, h, j, 0)
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype), *count_shapes]
    operand_specs = _operand_specs(q_row, kv_row, bq, bk, head_dim, value_dim)
    dkdv = _call(
        dkdv_kernel,
        cfg,
        (batch, num_kv_heads, cfg.num_j, g, cfg.num_i),
        [*operand_specs, *mask_specs],
        [*operand_specs[1:3], *count_specs],  # dK and dV: the blocks of k and v
        out_shape,
        [pltpu.VMEM((bk, head_dim), jnp.float32), pltpu.VMEM((bk, value_dim), jnp.float32)],
        ("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
        _cost("dkdv", static.tiles[1], bq, bk, head_dim, value_dim, q, k, v, do, lse, delta, *mask_args, *out_shape),
        "attention_dkdv_tpu",
    )(*_prefetch(mask, cfg, bq, bk, True), q, k, v, do, lse, delta, *mask_args)

    # dQ: grid over query blocks, like the forward pass.
    q_blk, kv_blk, (mask_specs, mask_args), (count_specs, count_shapes) = _query_grid(
        mask, cfg, (batch, num_heads, cfg.num_i), bq, bk
    )
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), *count_shapes]
    dq_out = _call(
        dq_kernel,
        cfg,
        (batch, num_heads, cfg.num_i, cfg.num_j),
        [*_operand_specs(q_blk, kv_blk, bq, bk, head_dim, value_dim), *mask_specs],
        [pl.BlockSpec((None, None, bq, head_dim), q_blk), *count_specs],
        out_shape,
        [pltpu.VMEM((bq, head_dim), jnp.float32)],
        ("parallel", "parallel", "parallel", "arbitrary"),
        _cost("dq", static.tiles[2], bq, bk, head_dim, value_dim, q, k, v, do, lse, delta, *mask_args, *out_shape),
        "attention_dq_tpu",
    )(*_prefetch(mask, cfg, bq, bk, False), q, k, v, do, lse, delta, *mask_args)
    return (dq_out[0], *dkdv, *dq_out[1:])  # dq, dk, dv, then the counts when counting


_attend = recompute_vjp(
    lambda q, k, v, mask, static: _forward_call(q, k, v, mask, static)[:2],  # (out, lse) without the tile counts
    lambda res, do, static: _backward_calls(res, do, static)[:3],
)


# The kernels (the recurrences of the module docstring), one tile per grid step.


def dot(a: Array, b: Array, contract_a: int, contract_b: int) -> Array:
    """2-D matmul contracting axis contract_a of a with contract_b of b, accumulating in float32 (both kernels')."""
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32)


class _Refs:
    """A kernel's refs by name: scalar-prefetched bounds, then inputs, mask vectors, outputs, scratch."""

    def __init__(self, cfg: KernelConfig, refs: tuple, inputs: tuple[str, ...], outputs: tuple[str, ...], scratch):
        refs = list(refs)
        self.bounds = refs.pop(0) if cfg.masked else None
        names = list(inputs)
        names += ["q_seg", "kv_seg"] if cfg.segments else []
        names += ["q_pos", "kv_pos"] if cfg.positions else []
        names += list(outputs) + (["count"] if cfg.count_tiles else [])
        names += list(scratch) + (["counter"] if cfg.count_tiles else [])
        if len(names) != len(refs):
            raise AssertionError(f"kernel refs {len(refs)} != names {names}")
        self.__dict__.update(zip(names, refs, strict=True))
        self.cfg = cfg

    def tile_mask(self) -> Array:
        """[X, Y] from this tile's vectors q_seg, q_pos [X, 1] and kv_seg, kv_pos [1, Y] (None where off)."""
        seg = (self.q_seg[...], self.kv_seg[...]) if self.cfg.segments else (None, None)
        pos = (self.q_pos[...], self.kv_pos[...]) if self.cfg.positions else (None, None)
        return self.cfg.mask.pairs(seg[0], pos[0], seg[1], pos[1])


def row_bounds(bounds_ref, row: Array) -> tuple[Array, Array, Array, Array]:
    """(lo, a, c, hi) of one row of tiles in the flattened [rows * 4] loop bounds."""
    return tuple(bounds_ref[row * 4 + k] for k in range(4))


def streamed_block(bounds_ref, row: Array, step: Array) -> Array:
    """The block a grid step reads: `step` clamped into [lo, hi), so a skipped step re-uses a fetched block."""
    lo, _, _, hi = row_bounds(bounds_ref, row)
    return jnp.minimum(jnp.maximum(step, lo), jnp.maximum(hi - 1, lo))


def _scores(r: _Refs, cfg: KernelConfig, tile_masked: bool) -> Array:
    """s = Q K^T * scale [X, Y] of the tile, -inf where masked."""
    s_XY = dot(r.q[...], r.k[...], 1, 1) * cfg.scale
    return jnp.where(r.tile_mask(), s_XY, -jnp.inf) if tile_masked else s_XY


def _visit(r: _Refs, row: Array, step: Array, compute) -> None:
    """Runs compute(tile_masked) if the tile is visible; counts it when counting."""

    def counted(tile_masked: bool) -> None:
        compute(tile_masked)
        if r.cfg.count_tiles:
            r.counter[0] += 1

    if not r.cfg.masked:
        counted(False)
        return
    lo, a, c, hi = row_bounds(r.bounds, row)
    visible = jnp.logical_and(lo <= step, step < hi)
    whole = jnp.logical_and(a <= step, step < c)
    pl.when(jnp.logical_and(visible, whole))(lambda: counted(False))
    pl.when(jnp.logical_and(visible, jnp.logical_not(whole)))(lambda: counted(True))


def _start_count(r: _Refs) -> None:
    if r.cfg.count_tiles:
        r.counter[0] = 0


def _store_count(r: _Refs) -> None:
    if r.cfg.count_tiles:
        r.count[...] = jnp.full(r.count.shape, r.counter[0], jnp.int32)


def forward_kernel(*refs, cfg: KernelConfig) -> None:
    """Query block i [X, H] against key block j [Y, H]; at the last j writes O [X, E] and lse [X, 1]."""
    r = _Refs(cfg, refs, ("q", "k", "v"), ("o", "lse"), ("m", "l", "acc"))
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init() -> None:
        r.m[...] = jnp.full(r.m.shape, -jnp.inf, jnp.float32)
        r.l[...] = jnp.zeros(r.l.shape, jnp.float32)
        r.acc[...] = jnp.zeros(r.acc.shape, jnp.float32)
        _start_count(r)

    def compute(tile_masked: bool) -> None:
        s_XY = _scores(r, cfg, tile_masked)
        m_prev_X1 = r.m[...]
        m_new_X1 = jnp.maximum(m_prev_X1, jnp.max(s_XY, axis=1, keepdims=True))
        # A row that has seen no key keeps m = -inf; shift by 0 there so that e^(s - m) is 0, not NaN. An
        # unmasked tile gives every row a finite score.
        m_safe_X1 = jnp.where(m_new_X1 == -jnp.inf, 0.0, m_new_X1) if tile_masked else m_new_X1
        alpha_X1 = jnp.exp(m_prev_X1 - m_safe_X1)
        p_XY = jnp.exp(s_XY - m_safe_X1)
        v_YE = r.v[...]
        r.l[...] = alpha_X1 * r.l[...] + jnp.sum(p_XY, axis=1, keepdims=True)
        r.acc[...] = alpha_X1 * r.acc[...] + dot(p_XY.astype(v_YE.dtype), v_YE, 1, 0)
        r.m[...] = m_new_X1

    _visit(r, b * cfg.num_i + i, j, compute)

    @pl.when(j == cfg.num_j - 1)
    def _finish() -> None:
        l_X1 = r.l[...]
        seen_X1 = l_X1 > 0
        l_safe_X1 = jnp.where(seen_X1, l_X1, 1.0)
        r.o[...] = (r.acc[...] / l_safe_X1).astype(r.o.dtype)
        # lse = +inf where a row sees nothing makes the backward's P = e^(s - lse) exactly 0 there.
        r.lse[...] = jnp.where(seen_X1, r.m[...] + jnp.log(l_safe_X1), jnp.inf)
        _store_count(r)


def _probs_and_score_grads(r: _Refs, cfg: KernelConfig, tile_masked: bool) -> tuple[jax.Array, jax.Array]:
    """The backward's recomputation of one tile, shared by both kernels: P = e^(s - lse) [X, Y] from the forward's
    saved lse, and dS = P (dO V^T - delta) [X, Y], the gradient of the (scaled) scores."""
    p_XY = jnp.exp(_scores(r, cfg, tile_masked) - r.lse[...])
    return p_XY, p_XY * (dot(r.do[...], r.v[...], 1, 1) - r.delta[...])


def dkdv_kernel(*refs, cfg: KernelConfig) -> None:
    """Key block j [Y, H] against query block i of query head (h G + g); at the last (g, i) writes dK and dV."""
    r = _Refs(cfg, refs, ("q", "k", "v", "do", "lse", "delta"), ("dk", "dv"), ("dk_acc", "dv_acc"))
    b, j, g, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    first, last = jnp.logical_and(g == 0, i == 0), jnp.logical_and(g == cfg.groups - 1, i == cfg.num_i - 1)

    @pl.when(first)
    def _init() -> None:
        r.dk_acc[...] = jnp.zeros(r.dk_acc.shape, jnp.float32)
        r.dv_acc[...] = jnp.zeros(r.dv_acc.shape, jnp.float32)
        _start_count(r)

    def compute(tile_masked: bool) -> None:
        p_XY, ds_XY = _probs_and_score_grads(r, cfg, tile_masked)
        q_XH, do_XE = r.q[...], r.do[...]
        r.dv_acc[...] += dot(p_XY.T.astype(do_XE.dtype), do_XE, 1, 0)
        r.dk_acc[...] += dot(ds_XY.T.astype(q_XH.dtype), q_XH, 1, 0)

    _visit(r, b * cfg.num_j + j, i, compute)

    @pl.when(last)
    def _finish() -> None:
        r.dk[...] = (r.dk_acc[...] * cfg.scale).astype(r.dk.dtype)
        r.dv[...] = r.dv_acc[...].astype(r.dv.dtype)
        _store_count(r)


def dq_kernel(*refs, cfg: KernelConfig) -> None:
    """Query block i [X, H] against key block j; at the last j writes dQ [X, H]."""
    r = _Refs(cfg, refs, ("q", "k", "v", "do", "lse", "delta"), ("dq",), ("dq_acc",))
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init() -> None:
        r.dq_acc[...] = jnp.zeros(r.dq_acc.shape, jnp.float32)
        _start_count(r)

    def compute(tile_masked: bool) -> None:
        _, ds_XY = _probs_and_score_grads(r, cfg, tile_masked)
        k_YH = r.k[...]
        r.dq_acc[...] += dot(ds_XY.astype(k_YH.dtype), k_YH, 1, 0)

    _visit(r, b * cfg.num_i + i, j, compute)

    @pl.when(j == cfg.num_j - 1)
    def _finish() -> None:
        r.dq[...] = (r.dq_acc[...] * cfg.scale).astype(r.dq.dtype)
        _store_count(r)
