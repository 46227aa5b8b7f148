"""FlashAttention-2 with our own Pallas kernels, behind `impl="pallas"`: forward, and a custom VJP whose backward
recomputes the tiles from the saved log-sum-exp (dK/dV kernel over key blocks, dQ kernel over query blocks).

Lowered with Triton on GPU; runs with interpret=True on CPU (slow: for tests). On TPU, `impl="pallas"` runs the
Mosaic kernels of pallas_tpu.py instead: these kernels' layouts (per-token vectors, head-squeezed blocks) do not
meet Mosaic's tiling rules.

Each kernel keeps one block resident and loops over the other axis's blocks with an online recurrence:
    forward (per query block):  m' = max(m, rowmax(s)), l' = 2^(m - m') l + rowsum(2^(s - m')),
                                acc' = 2^(m - m') acc + 2^(s - m') V;  O = acc / l,  lse = m + log2 l,
    dK/dV (per key block):      P = 2^(s - lse), dV += P^T dO, dS = P * (dO V^T - delta), dK += dS^T Q,
    dQ (per query block):       dQ += dS K,
with s = Q K^T * scale * log2(e) (base-2 exponentials save a multiply per score) and delta = rowsum(dO * O).

Loops visit only the tiles [lo, hi) that some query can see and skip the mask on the run [a, c) of tiles that
every query sees fully (bounds from attention.AttentionMask.loop_bounds), so causal, windowed and packed attention do
no wasted work.

Written for the Triton lowering: tiles are powers of two >= 16, head dims and lengths T, S are padded by
pallas_attention, loop bounds are read from small int32 inputs, masks are rebuilt from per-token vectors with
elementwise ops only.

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from transformer_jax import runtime
from transformer_jax.ops.attention import AttentionMask, pad_tokens, recompute_vjp, register
from transformer_jax.ops.pallas_tpu import TpuBlockSizes, dot, round_up, tpu_attention

Array = jax.Array

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 256  # padded; larger tiles do not fit a GPU's shared memory
LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two >= 16) and Triton launch parameters. Untuned on hardware: see benchmarks."""

    fwd_q: int
    fwd_k: int
    dkdv_q: int  # query tile streamed past a resident key block
    dkdv_k: int
    dq_q: int
    dq_k: int  # key tile streamed past a resident query block
    fwd_warps: int = 4
    bwd_warps: int = 4
    fwd_stages: int = 3
    bwd_stages: int = 2

    @classmethod
    def for_head_dim(cls, head_dim: int) -> BlockSizes:
        """Defaults after the Triton fused-attention tutorial: 128x64 forward, 32x128 / 128x32 backward."""
        if head_dim <= 64:
            return cls(128, 64, 32, 128, 128, 32, fwd_warps=4, bwd_warps=4)
        if head_dim <= 128:
            return cls(128, 64, 32, 128, 128, 32, fwd_warps=8, bwd_warps=8)
        # 256: keep the resident block and its float32 accumulators within registers and shared memory.
        return cls(64, 32, 16, 64, 64, 16, fwd_warps=8, bwd_warps=8, fwd_stages=2)

    def fit(self, q_len: int, kv_len: int) -> BlockSizes:
        """Shrinks tiles to the (power-of-two) lengths so that short sequences are not padded to a full tile."""
        tq, tk = max(16, pl.next_power_of_2(q_len)), max(16, pl.next_power_of_2(kv_len))
        return dataclasses.replace(
            self,
            fwd_q=min(self.fwd_q, tq),
            fwd_k=min(self.fwd_k, tk),
            dkdv_q=min(self.dkdv_q, tq),
            dkdv_k=min(self.dkdv_k, tk),
            dq_q=min(self.dq_q, tq),
            dq_k=min(self.dq_k, tk),
        )


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static description of one attention call, shared by the three kernels."""

    scale: float  # natural-log softmax scale; kernels use scale * log2(e)
    mask: AttentionMask  # the rule without its vectors (AttentionMask.static()); the vectors are kernel inputs
    segments: bool  # segment id vectors are inputs
    positions: bool  # position vectors are inputs
    groups: int  # G, query heads per key/value head


@dataclasses.dataclass(frozen=True)
class _Static:
    cfg: KernelConfig
    blocks: BlockSizes
    backend: str  # "gpu" (Triton) or "cpu" (interpret)


@register("pallas")
def pallas_attention(
    q: Array,
    k: Array,
    v: Array,
    mask: AttentionMask,
    *,
    scale: float | None = None,
    block_sizes: BlockSizes | TpuBlockSizes | None = None,
    backend: str | None = None,
) -> Array:
    """FlashAttention-2 in Pallas; the whole mask (segments, positions, causal, window) and grouped heads.

    Head dims are zero-padded to a power of two (>= 16, <= 256) and lengths to whole tiles, inside. `backend`
    overrides runtime.target_backend() ("gpu" lowers with Triton, "cpu" interprets, "tpu" runs pallas_tpu.py's
    Mosaic kernels, which take TpuBlockSizes), e.g. to lower for a GPU here.
    """
    backend = runtime.target_backend() if backend is None else backend
    if backend not in ("gpu", "cpu", "tpu"):
        raise ValueError(f"attention impl 'pallas': unknown backend {backend!r}; expected 'gpu', 'cpu' or 'tpu'")
    if block_sizes is not None and (backend == "tpu") != isinstance(block_sizes, TpuBlockSizes):
        wanted = "TpuBlockSizes" if backend == "tpu" else "BlockSizes"
        raise ValueError(f"attention impl 'pallas': block_sizes for backend {backend!r} must be {wanted}")
    if backend == "tpu":
        return tpu_attention(q, k, v, mask, scale=scale, block_sizes=block_sizes)
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"attention impl 'pallas' needs q, k, v of one dtype among float32, bfloat16, float16; "
            f"got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads, value_dim = k.shape[1], k.shape[2], v.shape[3]
    h_pad, e_pad = pl.next_power_of_2(max(head_dim, 16)), pl.next_power_of_2(max(value_dim, 16))
    if max(h_pad, e_pad) > MAX_HEAD_DIM:
        raise ValueError(
            f"attention impl 'pallas' supports head dims up to {MAX_HEAD_DIM}; got q/k {head_dim}, v {value_dim}. "
            "Use impl='blockwise' or 'xla'."
        )
    q, k, v = mask.zero_padding_tokens(q, k, v)
    sizes = (BlockSizes.for_head_dim(max(h_pad, e_pad)) if block_sizes is None else block_sizes).fit(q_len, kv_len)
    for name, size in dataclasses.asdict(sizes).items():
        if name.endswith(("_q", "_k")) and (size < 16 or size & (size - 1)):
            raise ValueError(f"pallas attention: block size {name}={size} must be a power of two >= 16 (Triton)")
    q_pad = round_up(q_len, max(sizes.fwd_q, sizes.dkdv_q, sizes.dq_q))
    kv_pad = round_up(kv_len, max(sizes.fwd_k, sizes.dkdv_k, sizes.dq_k))
    mask = mask.pad(batch, q_len, kv_len, q_pad, kv_pad)
    q = _pad_last(pad_tokens(q, q_pad), h_pad)
    k = _pad_last(pad_tokens(k, kv_pad), h_pad)
    v = _pad_last(pad_tokens(v, kv_pad), e_pad)
    cfg = KernelConfig(
        scale=float(head_dim**-0.5 if scale is None else scale),
        mask=mask.static(),
        segments=mask.segments,
        positions=mask.positions,
        groups=num_heads // num_kv_heads,
    )
    out_BTNE = _attend(q, k, v, mask, _Static(cfg, sizes, backend))
    return out_BTNE[:, :q_len, :, :value_dim]


def _pad_last(x: Array, size: int) -> Array:
    """Zero-pads the head dim: zero columns change neither Q K^T nor the real columns of P V."""
    if x.shape[-1] == size:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def _call_kwargs(static: _Static, warps: int, stages: int, name: str) -> dict:
    if static.backend == "cpu":
        return dict(interpret=True, name=name)
    from jax.experimental.pallas import triton as plgpu  # the Triton lowering's parameters: GPU targets only

    return dict(compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages), name=name)


def _mask_inputs(
    mask: AttentionMask,
    q_spec: pl.BlockSpec,
    kv_spec: pl.BlockSpec,
    bounds_spec: pl.BlockSpec,
    bounds: tuple[int, int, bool],
) -> tuple[list, list]:
    """Extra (specs, args) in the order _split_refs reads them: per-token vectors, loop bounds.

    bounds = (block_q, block_k, transpose) of AttentionMask.loop_bounds; they are passed only if anything is masked.
    """
    specs, args = [], []
    if mask.segments:
        specs += [q_spec, kv_spec]
        args += [mask.q_segment_ids, mask.kv_segment_ids]
    if mask.positions:
        specs += [q_spec, kv_spec]
        args += [mask.q_positions, mask.kv_positions]
    if mask.masks_anything:
        block_q, block_k, transpose = bounds
        specs.append(bounds_spec)
        args.append(mask.loop_bounds(block_q, block_k, transpose=transpose))
    return specs, args


def _query_grid_inputs(mask: AttentionMask, q: Array, k: Array, v: Array, g: int, bq: int, bk: int) -> tuple:
    """(q/k/v specs, mask specs, mask args) of a kernel gridded over (query block, batch, query head), as the
    forward and dQ kernels are; a kernel may take more inputs between v and the mask inputs."""
    head_dim, kv_len, value_dim = q.shape[-1], k.shape[1], v.shape[-1]
    qkv_specs = [
        pl.BlockSpec((None, bq, None, head_dim), lambda i, b, n: (b, i, n, 0)),
        pl.BlockSpec((None, kv_len, None, head_dim), lambda i, b, n: (b, 0, n // g, 0)),
        pl.BlockSpec((None, kv_len, None, value_dim), lambda i, b, n: (b, 0, n // g, 0)),
    ]
    mask_specs, mask_args = _mask_inputs(
        mask,
        pl.BlockSpec((None, bq), lambda i, b, n: (b, i)),
        pl.BlockSpec((None, kv_len), lambda i, b, n: (b, 0)),
        pl.BlockSpec((None, None, 4), lambda i, b, n: (b, i, 0)),
        (bq, bk, False),
    )
    return qkv_specs, mask_specs, mask_args


def _forward(q: Array, k: Array, v: Array, mask: AttentionMask, static: _Static) -> tuple[Array, Array]:
    """out [B, T, N, E] and lse [B, N, T] (base 2)."""
    cfg, sizes = static.cfg, static.blocks
    batch, q_len, num_heads, _ = q.shape
    value_dim = v.shape[-1]
    bq, bk = sizes.fwd_q, sizes.fwd_k
    qkv_specs, mask_specs, mask_args = _query_grid_inputs(mask, q, k, v, cfg.groups, bq, bk)
    out_BTNE, lse_BNT = pl.pallas_call(
        functools.partial(forward_kernel, cfg=cfg, block_k=bk, masked=mask.masks_anything),
        grid=(q_len // bq, batch, num_heads),
        in_specs=qkv_specs + mask_specs,
        out_specs=[
            pl.BlockSpec((None, bq, None, value_dim), lambda i, b, n: (b, i, n, 0)),
            pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, q_len, num_heads, value_dim), v.dtype),
            jax.ShapeDtypeStruct((batch, num_heads, q_len), jnp.float32),
        ],
        **_call_kwargs(static, sizes.fwd_warps, sizes.fwd_stages, "attention_forward"),
    )(q, k, v, *mask_args)
    return out_BTNE, lse_BNT


def _backward(res: tuple, do_BTNE: Array, static: _Static) -> tuple[Array, Array, Array]:
    cfg, sizes = static.cfg, static.blocks
    q, k, v, mask, out_BTNE, lse_BNT = res
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads, value_dim = k.shape[1], k.shape[2], v.shape[-1]
    g = cfg.groups
    do_BTNE = do_BTNE.astype(v.dtype)
    # delta = rowsum(dO * O) (FlashAttention-2, eq. 4); XLA fuses it into one pass.
    delta_BNT = jnp.sum(do_BTNE.astype(jnp.float32) * out_BTNE.astype(jnp.float32), axis=-1).transpose(0, 2, 1)

    # dK, dV: grid over key blocks and key/value heads; each program reads the G query heads of its group.
    bq, bk = sizes.dkdv_q, sizes.dkdv_k
    mask_specs, mask_args = _mask_inputs(
        mask,
        pl.BlockSpec((None, q_len), lambda j, b, h: (b, 0)),
        pl.BlockSpec((None, bk), lambda j, b, h: (b, j)),
        pl.BlockSpec((None, None, 4), lambda j, b, h: (b, j, 0)),
        (bq, bk, True),
    )
    grouped = (batch, q_len, num_kv_heads, g)
    dk, dv = pl.pallas_call(
        functools.partial(dkdv_kernel, cfg=cfg, block_q=bq, masked=mask.masks_anything),
        grid=(kv_len // bk, batch, num_kv_heads),
        in_specs=[
            pl.BlockSpec((None, q_len, None, g, head_dim), lambda j, b, h: (b, 0, h, 0, 0)),
            pl.BlockSpec((None, bk, None, head_dim), lambda j, b, h: (b, j, h, 0)),
            pl.BlockSpec((None, bk, None, value_dim), lambda j, b, h: (b, j, h, 0)),
            pl.BlockSpec((None, q_len, None, g, value_dim), lambda j, b, h: (b, 0, h, 0, 0)),
            pl.BlockSpec((None, None, g, q_len), lambda j, b, h: (b, h, 0, 0)),
            pl.BlockSpec((None, None, g, q_len), lambda j, b, h: (b, h, 0, 0)),
            *mask_specs,
        ],
        out_specs=[
            pl.BlockSpec((None, bk, None, head_dim), lambda j, b, h: (b, j, h, 0)),
            pl.BlockSpec((None, bk, None, value_dim), lambda j, b, h: (b, j, h, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        **_call_kwargs(static, sizes.bwd_warps, sizes.bwd_stages, "attention_dkdv"),
    )(
        q.reshape(*grouped, head_dim),
        k,
        v,
        do_BTNE.reshape(*grouped, value_dim),
        lse_BNT.reshape(batch, num_kv_heads, g, q_len),
        delta_BNT.reshape(batch, num_kv_heads, g, q_len),
        *mask_args,
    )

    # dQ: grid over query blocks and query heads, like the forward pass.
    bq, bk = sizes.dq_q, sizes.dq_k
    qkv_specs, mask_specs, mask_args = _query_grid_inputs(mask, q, k, v, g, bq, bk)
    row_specs = [
        pl.BlockSpec((None, bq, None, value_dim), lambda i, b, n: (b, i, n, 0)),  # dO
        pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i)),  # lse
        pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i)),  # delta
    ]
    dq = pl.pallas_call(
        functools.partial(dq_kernel, cfg=cfg, block_k=bk, masked=mask.masks_anything),
        grid=(q_len // bq, batch, num_heads),
        in_specs=qkv_specs + row_specs + mask_specs,
        out_specs=pl.BlockSpec((None, bq, None, head_dim), lambda i, b, n: (b, i, n, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        **_call_kwargs(static, sizes.bwd_warps, sizes.bwd_stages, "attention_dq"),
    )(q, k, v, do_BTNE, lse_BNT, delta_BNT, *mask_args)
    return dq, dk, dv


_attend = recompute_vjp(_forward, _backward)


# The kernels (the recurrences of the module docstring); lengths and head dims arrive padded.


def _scores(cfg: KernelConfig, q_XH: Array, k_YH: Array, vecs: tuple | None) -> Array:
    """s = Q K^T * scale * log2(e) [X, Y]; vecs: None for an unmasked tile, else ((segment ids, positions) of the
    queries [X], those of the keys [Y]), and s is -inf where the mask hides a pair."""
    s_XY = dot(q_XH, k_YH, 1, 1) * (cfg.scale * LOG2E)
    return s_XY if vecs is None else jnp.where(cfg.mask.tile(*vecs[0], *vecs[1]), s_XY, -jnp.inf)


def _load_vecs(cfg: KernelConfig, seg_ref, pos_ref, index) -> tuple:
    return (seg_ref[index] if cfg.segments else None, pos_ref[index] if cfg.positions else None)


def _three_loops(bounds_ref, num_tiles: int, body, carry):
    """Runs body(j, carry, masked) over the visible tiles: masked [lo, a), unmasked [a, c), masked [c, hi)."""
    if bounds_ref is None:
        return lax.fori_loop(0, num_tiles, lambda j, c: body(j, c, False), carry)
    lo, a, c, hi = bounds_ref[0], bounds_ref[1], bounds_ref[2], bounds_ref[3]
    carry = lax.fori_loop(lo, a, lambda j, cr: body(j, cr, True), carry)
    carry = lax.fori_loop(a, c, lambda j, cr: body(j, cr, False), carry)
    return lax.fori_loop(c, hi, lambda j, cr: body(j, cr, True), carry)


def _split_refs(cfg: KernelConfig, refs: tuple, masked: bool) -> tuple:
    """(q_seg, kv_seg, q_pos, kv_pos, bounds, rest): optional inputs in the order the callers pass them."""
    refs = list(refs)
    q_seg = kv_seg = q_pos = kv_pos = bounds = None
    if cfg.segments:
        q_seg, kv_seg = refs.pop(0), refs.pop(0)
    if cfg.positions:
        q_pos, kv_pos = refs.pop(0), refs.pop(0)
    if masked:
        bounds = refs.pop(0)
    return q_seg, kv_seg, q_pos, kv_pos, bounds, refs


def forward_kernel(q_ref, k_ref, v_ref, *refs, cfg: KernelConfig, block_k: int, masked: bool) -> None:
    """One query block [X, H] against all key blocks; writes O [X, E] and lse [X] (base 2, +inf if nothing seen)."""
    q_seg_ref, kv_seg_ref, q_pos_ref, kv_pos_ref, bounds_ref, (o_ref, lse_ref) = _split_refs(cfg, refs, masked)
    q_XH = q_ref[...]
    block_q, num_tiles = q_XH.shape[0], k_ref.shape[0] // block_k
    q_vecs = _load_vecs(cfg, q_seg_ref, q_pos_ref, slice(None)) if masked else None

    def body(j, carry: tuple, tile_masked: bool) -> tuple:
        m_X, l_X, acc_XE = carry
        kv_slice = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        vecs = (q_vecs, _load_vecs(cfg, kv_seg_ref, kv_pos_ref, kv_slice)) if tile_masked else None
        s_XY = _scores(cfg, q_XH, k_ref[kv_slice, :], vecs)
        m_new = jnp.maximum(m_X, jnp.max(s_XY, axis=1))
        if tile_masked:
            # A row that has seen no key keeps m = -inf; shift by 0 so that 2^(s - m) is 0, not NaN.
            m_new_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        else:
            m_new_safe = m_new  # an unmasked tile gives every row a finite score
        alpha_X = jnp.exp2(m_X - m_new_safe)
        p_XY = jnp.exp2(s_XY - m_new_safe[:, None])
        v_YE = v_ref[kv_slice, :]
        acc_XE = alpha_X[:, None] * acc_XE + dot(p_XY.astype(v_YE.dtype), v_YE, 1, 0)
        return m_new, alpha_X * l_X + jnp.sum(p_XY, axis=1), acc_XE

    init = (
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
        jnp.zeros((block_q, v_ref.shape[-1]), jnp.float32),
    )
    m_X, l_X, acc_XE = _three_loops(bounds_ref, num_tiles, body, init)
    seen_X = l_X > 0
    l_safe_X = jnp.where(seen_X, l_X, 1.0)
    o_ref[...] = (acc_XE / l_safe_X[:, None]).astype(o_ref.dtype)
    # lse = +inf where a row sees nothing makes the backward's P = 2^(s - lse) exactly 0 there.
    lse_ref[...] = jnp.where(seen_X, m_X + jnp.log2(l_safe_X), jnp.inf)


def dkdv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg: KernelConfig, block_q: int, masked: bool
) -> None:
    """One key block [Y, H] against the query blocks of its G query heads; writes dK [Y, H] and dV [Y, E].

    q_ref/do_ref are [T, G, H]/[T, G, E] and lse_ref/delta_ref [G, T]: all query heads that share this key head.
    """
    q_seg_ref, kv_seg_ref, q_pos_ref, kv_pos_ref, bounds_ref, (dk_ref, dv_ref) = _split_refs(cfg, refs, masked)
    k_YH, v_YE = k_ref[...], v_ref[...]
    num_tiles = q_ref.shape[0] // block_q
    kv_vecs = _load_vecs(cfg, kv_seg_ref, kv_pos_ref, slice(None)) if masked else None

    def head(g, carry: tuple) -> tuple:
        def body(i, carry: tuple, tile_masked: bool) -> tuple:
            dk_YH, dv_YE = carry
            q_slice = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
            q_XH, do_XE = q_ref[q_slice, g, :], do_ref[q_slice, g, :]
            vecs = (_load_vecs(cfg, q_seg_ref, q_pos_ref, q_slice), kv_vecs) if tile_masked else None
            p_XY = jnp.exp2(_scores(cfg, q_XH, k_YH, vecs) - lse_ref[g, q_slice][:, None])
            dv_YE = dv_YE + dot(p_XY.astype(do_XE.dtype), do_XE, 0, 0)
            dp_XY = dot(do_XE, v_YE, 1, 1)
            ds_XY = p_XY * (dp_XY - delta_ref[g, q_slice][:, None])
            dk_YH = dk_YH + dot(ds_XY.astype(q_XH.dtype), q_XH, 0, 0)
            return dk_YH, dv_YE

        return _three_loops(bounds_ref, num_tiles, body, carry)

    init = (jnp.zeros(k_YH.shape, jnp.float32), jnp.zeros(v_YE.shape, jnp.float32))
    dk_YH, dv_YE = head(0, init) if cfg.groups == 1 else lax.fori_loop(0, cfg.groups, head, init)
    dk_ref[...] = (dk_YH * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_YE.astype(dv_ref.dtype)


def dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg: KernelConfig, block_k: int, masked: bool
) -> None:
    """One query block [X, H] against all key blocks; writes dQ [X, H]."""
    q_seg_ref, kv_seg_ref, q_pos_ref, kv_pos_ref, bounds_ref, (dq_ref,) = _split_refs(cfg, refs, masked)
    q_XH, do_XE = q_ref[...], do_ref[...]
    lse_X, delta_X = lse_ref[...], delta_ref[...]
    num_tiles = k_ref.shape[0] // block_k
    q_vecs = _load_vecs(cfg, q_seg_ref, q_pos_ref, slice(None)) if masked else None

    def body(j, dq_XH: Array, tile_masked: bool) -> Array:
        kv_slice = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        k_YH, v_YE = k_ref[kv_slice, :], v_ref[kv_slice, :]
        vecs = (q_vecs, _load_vecs(cfg, kv_seg_ref, kv_pos_ref, kv_slice)) if tile_masked else None
        p_XY = jnp.exp2(_scores(cfg, q_XH, k_YH, vecs) - lse_X[:, None])
        ds_XY = p_XY * (dot(do_XE, v_YE, 1, 1) - delta_X[:, None])
        return dq_XH + dot(ds_XY.astype(k_YH.dtype), k_YH, 1, 0)

    dq_XH = _three_loops(bounds_ref, num_tiles, body, jnp.zeros(q_XH.shape, jnp.float32))
    dq_ref[...] = (dq_XH * cfg.scale).astype(dq_ref.dtype)
