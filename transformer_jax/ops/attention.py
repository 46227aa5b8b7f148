"""Which keys each query may see (`AttentionMask`, and every form of it the implementations consume), the one attention
entry point, and the XLA reference implementation.

Every implementation has the signature `fn(q, k, v, mask, **options)`: q is [B, T, N, H], k is [B, S, K, H],
v is [B, S, K, E], N a multiple of K (grouped-query heads), and `mask` the AttentionMask that `attention`
builds once from its arguments. Which keys a query sees is written only there (the rules below).

Keys and values may also come heads-first, k [B, K, S, H] and v [B, K, S, E] (`kv_heads_first=True`): the layout
of the decoding cache. A decode step is bound by reading the cache, and with sequence-first keys XLA copies every
cached key and value into heads-first order at every step, a second read and a write of the whole cache
(benchmarks/decode.py measures both). Softmax kernels then run the reference below, which reads the heads-first
cache in place; one query per row leaves no query blocks for a tiled kernel to gain on.

The mask rules, written here once:
- Segment ids: id 0 (or any id <= 0) marks padding. A query sees a key only when both have the same positive
  segment id. Passing only one of q_segment_ids / kv_segment_ids treats the other side as all ones.
- Causal masking compares positions: a query at position p sees keys at positions <= p. Without explicit
  positions, queries are aligned to the end of the keys (query i has position i + S - T), the convention of
  decoding with a cache and of FlashAttention 2.
- window=w keeps keys with 0 <= p_q - p_k < w when causal, |p_q - p_k| < w otherwise (local attention).
- A query row with no visible key returns zeros (never NaN), and its gradients are zero (each implementation
  guarantees this for its own arithmetic).
- Beam lineage (decoding's self-attention cache, whose rows come in groups of W, a sentence's beams, and never
  move): beam q of a sentence reads slot l from its sentence's row lineage[q, l], the row where its ancestor at
  step l wrote; the other W - 1 rows' slot l are hidden from it (`lineage_mask`). Causality still applies.

Forms: `dense()` [B, 1, T, S] (xla); `tile()` of one [X, Y] tile from per-token vectors, with elementwise ops that
also lower inside Pallas kernels; `loop_bounds()`, the tiles to skip or leave unmasked; `key_ranges()`, each query's
visible keys as a run of key indices (linear attention).

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array

_INT_MAX = jnp.iinfo(jnp.int32).max
_INT_MIN = jnp.iinfo(jnp.int32).min


def is_real(segment_ids: Array) -> Array:
    """The padding rule: a token is real when its segment id is positive."""
    return segment_ids > 0


def _conjoin(parts: list[Array]) -> Array | None:
    return functools.reduce(operator.and_, parts) if parts else None


def array_module(x: Array | np.ndarray | None):  # numpy or jax.numpy
    """numpy for numpy vectors, else jax.numpy: a mask of numpy vectors is worked out on the host, without a
    device (trace-time facts, such as the tiles a kernel will compute, while compiling for another machine)."""
    return np if isinstance(x, np.ndarray) else jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """Per-token vectors (a field is None when that part of the mask is off) and the static rule parameters.

    A pytree: the vectors are its leaves, `causal`, `window` and `explicit_positions` its static structure, so it
    passes through jit, vmap and custom_vjp. Build it with `create`, which fills the defaults of the rules.
    """

    q_segment_ids: Array | None  # [B, T] int32, <= 0 is padding
    kv_segment_ids: Array | None  # [B, S] int32
    q_positions: Array | None  # [B, T] int32; set only when causal or windowed
    kv_positions: Array | None  # [B, S] int32
    causal: bool = dataclasses.field(metadata=dict(static=True))
    window: int | None = dataclasses.field(metadata=dict(static=True))
    explicit_positions: bool = dataclasses.field(metadata=dict(static=True))  # given by the caller, not defaulted

    @classmethod
    def create(
        cls,
        batch: int,
        q_len: int,
        kv_len: int,
        *,
        q_segment_ids: Array | None = None,
        kv_segment_ids: Array | None = None,
        causal: bool = False,
        q_positions: Array | None = None,
        kv_positions: Array | None = None,
        window: int | None = None,
        xp=jnp,  # numpy or jax.numpy, see array_module
    ) -> AttentionMask:
        """The mask of the module docstring's rules: a missing segment side is all ones, positions end-aligned."""
        if window is not None and window <= 0:
            raise ValueError(f"attention window must be a positive number of tokens, got {window}")
        q_seg_BT = kv_seg_BS = q_pos_BT = kv_pos_BS = None
        if q_segment_ids is not None or kv_segment_ids is not None:
            q_seg_BT = xp.ones((batch, q_len), np.int32) if q_segment_ids is None else q_segment_ids
            kv_seg_BS = xp.ones((batch, kv_len), np.int32) if kv_segment_ids is None else kv_segment_ids
            q_seg_BT, kv_seg_BS = q_seg_BT.astype(np.int32), kv_seg_BS.astype(np.int32)
        if causal or window is not None:
            default_q = xp.arange(q_len, dtype=np.int32) + (kv_len - q_len)
            q_pos_BT = xp.broadcast_to(default_q, (batch, q_len)) if q_positions is None else q_positions
            default_kv = xp.arange(kv_len, dtype=np.int32)
            kv_pos_BS = xp.broadcast_to(default_kv, (batch, kv_len)) if kv_positions is None else kv_positions
            q_pos_BT, kv_pos_BS = q_pos_BT.astype(np.int32), kv_pos_BS.astype(np.int32)
        for name, arr, length in (
            ("q_segment_ids", q_seg_BT, q_len),
            ("kv_segment_ids", kv_seg_BS, kv_len),
            ("q_positions", q_pos_BT, q_len),
            ("kv_positions", kv_pos_BS, kv_len),
        ):
            if arr is not None and arr.shape != (batch, length):
                raise ValueError(f"attention: {name} must have shape {(batch, length)}, got {arr.shape}")
        explicit = q_positions is not None or kv_positions is not None
        return cls(q_seg_BT, kv_seg_BS, q_pos_BT, kv_pos_BS, causal, window, explicit)

    @property
    def segments(self) -> bool:
        return self.q_segment_ids is not None

    @property
    def positions(self) -> bool:
        return self.q_positions is not None

    @property
    def masks_anything(self) -> bool:
        return self.segments or self.positions

    def static(self) -> AttentionMask:
        """The rule without its vectors: hashable, for kernels that receive the vectors as separate inputs."""
        return dataclasses.replace(self, q_segment_ids=None, kv_segment_ids=None, q_positions=None, kv_positions=None)

    def delta_range(self) -> tuple[int | None, int | None]:
        """(lo, hi): a visible pair has lo <= p_q - p_k <= hi (None = unbounded). The causal and window rules."""
        lo = 0 if self.causal else (None if self.window is None else 1 - self.window)
        hi = None if self.window is None else self.window - 1
        return lo, hi

    # --- pairs ---------------------------------------------------------------------------------------------------

    def tile(
        self, q_seg: Array | None, q_pos: Array | None, kv_seg: Array | None, kv_pos: Array | None
    ) -> Array | None:
        """Boolean [..., X, Y] (True = may attend) from [..., X] query and [..., Y] key vectors; None if unmasked.

        Elementwise ops only, so that it also lowers inside Pallas kernels.
        """
        column = lambda x: None if x is None else x[..., :, None]
        row = lambda x: None if x is None else x[..., None, :]
        return self.pairs(column(q_seg), column(q_pos), row(kv_seg), row(kv_pos))

    def pairs(
        self, q_seg: Array | None, q_pos: Array | None, kv_seg: Array | None, kv_pos: Array | None
    ) -> Array | None:
        """The rules of the module docstring on vectors already shaped to broadcast: [..., X, 1] query columns and
        [..., 1, Y] key rows give [..., X, Y] (Mosaic kernels keep their vectors 2-D); None if unmasked."""
        parts = []
        if q_seg is not None:
            parts.append(jnp.logical_and(q_seg == kv_seg, is_real(q_seg)))
        if q_pos is not None:
            delta_XY = q_pos - kv_pos
            lo, hi = self.delta_range()
            if lo is not None:
                parts.append(delta_XY >= lo)
            if hi is not None:
                parts.append(delta_XY <= hi)
        return _conjoin(parts)

    def dense(self) -> Array | None:
        """Boolean [B, 1, T, S] (True = may attend), or None if nothing is masked."""
        mask_BTS = self.tile(self.q_segment_ids, self.q_positions, self.kv_segment_ids, self.kv_positions)
        return None if mask_BTS is None else mask_BTS[:, None]

    # --- padding for tiled implementations -----------------------------------------------------------------------

    def zero_padding_tokens(self, q: Array, k: Array, v: Array) -> tuple[Array, Array, Array]:
        """Zeros q/k/v at padding tokens: whatever they hold (NaN, 1e30) must not reach real rows.

        A masked score is dropped by `where`, but 0 * NaN in P V or dS K is NaN, so the values themselves go.
        """
        if not self.segments:
            return q, k, v
        q_real, kv_real = is_real(self.q_segment_ids), is_real(self.kv_segment_ids)
        q = jnp.where(q_real[:, :, None, None], q, jnp.zeros((), q.dtype))
        k = jnp.where(kv_real[:, :, None, None], k, jnp.zeros((), k.dtype))
        v = jnp.where(kv_real[:, :, None, None], v, jnp.zeros((), v.dtype))
        return q, k, v

    def pad(self, batch: int, q_len: int, kv_len: int, q_pad: int, kv_pad: int) -> AttentionMask:
        """The mask of q_pad queries and kv_pad keys; the added tokens get segment id 0, so nobody sees them."""
        q_seg_BT, kv_seg_BS = self.q_segment_ids, self.kv_segment_ids
        xp = array_module(q_seg_BT if q_seg_BT is not None else self.q_positions)
        if (q_pad != q_len or kv_pad != kv_len) and q_seg_BT is None:
            q_seg_BT = xp.ones((batch, q_len), np.int32)
            kv_seg_BS = xp.ones((batch, kv_len), np.int32)
        return dataclasses.replace(
            self,
            q_segment_ids=pad_tokens(q_seg_BT, q_pad),
            kv_segment_ids=pad_tokens(kv_seg_BS, kv_pad),
            q_positions=pad_tokens(self.q_positions, q_pad),
            kv_positions=pad_tokens(self.kv_positions, kv_pad),
        )

    # --- tiles ---------------------------------------------------------------------------------------------------

    def tile_visibility(self, block_q: int, block_k: int) -> tuple[Array, Array] | None:
        """(any_BIJ, all_BIJ): whether some / every query of block i may see some / every key of block j.

        The rules of `tile` over the ranges of a tile's vectors. `any` is conservative (it may say True for a tile
        where nothing is visible, never the reverse); `all` is True only if every pair is visible, so such a tile
        needs no mask. None when nothing is masked.
        """
        if not self.masks_anything:
            return None
        xp = array_module(self.q_segment_ids if self.segments else self.q_positions)
        any_parts, all_parts = [], []
        big = _INT_MAX
        if self.segments:
            q_seg_BT, kv_seg_BS = self.q_segment_ids, self.kv_segment_ids
            # Some pair may match if the ranges of positive ids overlap; all pairs match if one positive id fills both.
            q_lo_BI, _ = _block_min_max(xp.where(is_real(q_seg_BT), q_seg_BT, big), block_q)
            _, q_hi_BI = _block_min_max(xp.where(is_real(q_seg_BT), q_seg_BT, 0), block_q)
            k_lo_BJ, _ = _block_min_max(xp.where(is_real(kv_seg_BS), kv_seg_BS, big), block_k)
            _, k_hi_BJ = _block_min_max(xp.where(is_real(kv_seg_BS), kv_seg_BS, 0), block_k)
            q_min_BI, q_max_BI = _block_min_max(q_seg_BT, block_q)
            k_min_BJ, k_max_BJ = _block_min_max(kv_seg_BS, block_k)
            any_parts.append(
                (q_lo_BI[:, :, None] <= k_hi_BJ[:, None, :]) & (k_lo_BJ[:, None, :] <= q_hi_BI[:, :, None])
            )
            one_id = (q_min_BI == q_max_BI)[:, :, None] & (k_min_BJ == k_max_BJ)[:, None, :]
            same = (q_min_BI[:, :, None] == k_min_BJ[:, None, :]) & is_real(q_min_BI)[:, :, None]
            all_parts.append(one_id & same)
        if self.positions:
            q_min_BI, q_max_BI = _block_min_max(self.q_positions, block_q)
            k_min_BJ, k_max_BJ = _block_min_max(self.kv_positions, block_k)
            # p_q - p_k ranges over [d_lo, d_hi] within the tile.
            d_lo_BIJ = q_min_BI[:, :, None] - k_max_BJ[:, None, :]
            d_hi_BIJ = q_max_BI[:, :, None] - k_min_BJ[:, None, :]
            lo, hi = self.delta_range()
            if lo is not None:
                any_parts.append(d_hi_BIJ >= lo)
                all_parts.append(d_lo_BIJ >= lo)
            if hi is not None:
                any_parts.append(d_lo_BIJ <= hi)
                all_parts.append(d_hi_BIJ <= hi)
        return _conjoin(any_parts), _conjoin(all_parts)

    def loop_bounds(self, block_q: int, block_k: int, *, transpose: bool = False) -> Array:
        """Per row of tiles, int32 [B, I, 4] = (lo, a, c, hi): visit tiles [lo, hi); those in [a, c) need no mask.

        Tiles outside [lo, hi) are invisible and skipped; [lo, a) and [c, hi) are visited with the mask. With
        transpose, the rows are key blocks ([B, J, 4], bounds over query blocks). Needs a mask that masks anything.
        """
        any_BIJ, all_BIJ = self.tile_visibility(block_q, block_k)
        xp = array_module(any_BIJ)
        if transpose:
            any_BIJ, all_BIJ = any_BIJ.transpose(0, 2, 1), all_BIJ.transpose(0, 2, 1)
        num_j = any_BIJ.shape[-1]
        j_J = xp.arange(num_j, dtype=np.int32)
        some = any_BIJ.any(-1)
        lo = xp.where(some, xp.argmax(any_BIJ, -1), 0)
        hi = xp.where(some, num_j - xp.argmax(any_BIJ[..., ::-1], -1), 0)
        all_BIJ = xp.logical_and(all_BIJ, any_BIJ)
        some_full = all_BIJ.any(-1)
        a = xp.where(some_full, xp.argmax(all_BIJ, -1), hi)
        # The run of unmasked tiles ends at the first tile after `a` that needs a mask.
        broken_BIJ = xp.logical_and(~all_BIJ, j_J >= a[..., None])
        c = xp.where(broken_BIJ.any(-1), xp.argmax(broken_BIJ, -1), num_j)
        c = xp.where(some_full, xp.minimum(c, hi), hi)
        return xp.stack([lo, a, c, hi], axis=-1).astype(np.int32)

    # --- runs of keys --------------------------------------------------------------------------------------------

    def key_ranges(self, batch: int, q_len: int, kv_len: int) -> tuple[Array, Array]:
        """(first_BT, end_BT): query t sees the real keys among indices [first, end) (first == end: none).

        Exact when each row's real keys are in (segment id, position) order: segments are contiguous runs of
        increasing ids, as data/batching.py packs them, and, when causal or windowed, positions do not decrease
        within a segment (a decoding cache stores key p at index p). Padding keys inside a run are not excluded
        here; use `is_real(kv_segment_ids)`. Memory O(T + S): a binary search per query, no [T, S] matrix.
        """
        if not self.masks_anything:
            return jnp.zeros((batch, q_len), jnp.int32), jnp.full((batch, q_len), kv_len, jnp.int32)
        ones = functools.partial(jnp.ones, dtype=jnp.int32)
        q_seg_BT = ones((batch, q_len)) if self.q_segment_ids is None else self.q_segment_ids
        kv_seg_BS = ones((batch, kv_len)) if self.kv_segment_ids is None else self.kv_segment_ids
        q_pos_BT = jnp.zeros((batch, q_len), jnp.int32) if self.q_positions is None else self.q_positions
        kv_pos_BS = jnp.zeros((batch, kv_len), jnp.int32) if self.kv_positions is None else self.kv_positions
        # A padding key takes the (segment, position) of the last real key before it, so that the order holds.
        s_S = jnp.arange(kv_len, dtype=jnp.int32)
        last_real_BS = lax.cummax(jnp.where(is_real(kv_seg_BS), s_S, 0), axis=1)
        kv_seg_BS = jnp.take_along_axis(kv_seg_BS, last_real_BS, axis=1)
        kv_pos_BS = jnp.take_along_axis(kv_pos_BS, last_real_BS, axis=1)
        # Visible: same segment and q_pos - hi <= kv_pos <= q_pos - lo (delta_range); unbounded sides open up.
        lo, hi = self.delta_range()
        first_pos_BT = jnp.full_like(q_pos_BT, _INT_MIN) if hi is None else q_pos_BT - hi
        last_pos_BT = jnp.full_like(q_pos_BT, _INT_MAX) if lo is None else q_pos_BT - lo
        first_BT = _count_keys_before(kv_seg_BS, kv_pos_BS, q_seg_BT, first_pos_BT, inclusive=False)
        end_BT = _count_keys_before(kv_seg_BS, kv_pos_BS, q_seg_BT, last_pos_BT, inclusive=True)
        end_BT = jnp.where(is_real(q_seg_BT), jnp.maximum(end_BT, first_BT), first_BT)
        return first_BT, end_BT


@functools.partial(jax.jit, static_argnames="inclusive")  # one compiled search, also when called op by op
def _count_keys_before(kv_seg_BS: Array, kv_pos_BS: Array, seg_BT: Array, pos_BT: Array, inclusive: bool) -> Array:
    """Number of keys ordered before (seg, pos) in (segment, position) order (at it too, if inclusive)."""
    batch, kv_len = kv_seg_BS.shape

    def step(_: int, bounds: tuple[Array, Array]) -> tuple[Array, Array]:
        lo_BT, hi_BT = bounds
        mid_BT = (lo_BT + hi_BT) // 2
        at_BT = jnp.minimum(mid_BT, kv_len - 1)
        seg_at = jnp.take_along_axis(kv_seg_BS, at_BT, axis=1)
        pos_at = jnp.take_along_axis(kv_pos_BS, at_BT, axis=1)
        pos_before = pos_at <= pos_BT if inclusive else pos_at < pos_BT
        before = (seg_at < seg_BT) | ((seg_at == seg_BT) & pos_before)
        searching = lo_BT < hi_BT
        return jnp.where(searching & before, mid_BT + 1, lo_BT), jnp.where(searching & ~before, mid_BT, hi_BT)

    bounds = (jnp.zeros_like(seg_BT), jnp.full_like(seg_BT, kv_len))
    count_BT, _ = lax.fori_loop(0, max(1, kv_len).bit_length(), step, bounds)
    return count_BT


def lineage_mask(lineage_RL: Array, width: int) -> Array:
    """Boolean [B, W, W, L]: whether beam q of sentence b (axis 2) may see slot l of beam w's cache row (axis 1),
    lineage_RL[b W + q, l] == w (the beam-lineage rule of the module docstring). R = B W rows."""
    rows, slots = lineage_RL.shape
    lineage_BQL = lineage_RL.reshape(rows // width, 1, width, slots)
    return lineage_BQL == jnp.arange(width, dtype=lineage_RL.dtype)[None, :, None, None]


def _block_min_max(x_BT: Array, block: int) -> tuple[Array, Array]:
    x_BIX = x_BT.reshape(x_BT.shape[0], -1, block)
    return x_BIX.min(-1), x_BIX.max(-1)


def pad_tokens(x: Array | None, length: int, value: int | float = 0) -> Array | None:
    """Pads axis 1 (tokens) of x to `length` with `value` (None stays None)."""
    if x is None or x.shape[1] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, length - x.shape[1])
    return array_module(x).pad(x, widths, constant_values=value)


# -- the registry of implementations, the entry point and the reference ----------------------------------------------

IMPLEMENTATIONS: dict[str, Callable[..., Array]] = {}
SOFTMAX_IMPLEMENTATIONS: set[str] = set()  # those computing softmax(QK^T / sqrt(d_k)) V exactly, differently arranged


def register(name: str, *, softmax: bool = True) -> Callable[[Callable[..., Array]], Callable[..., Array]]:
    """Registers `fn(q, k, v, mask, **options)` under `name` for `attention(..., impl=name)`. softmax=False marks
    another function than softmax attention (linear), which heads-first keys must reach instead of the reference."""

    def wrap(fn: Callable[..., Array]) -> Callable[..., Array]:
        IMPLEMENTATIONS[name] = fn
        if softmax:
            SOFTMAX_IMPLEMENTATIONS.add(name)
        return fn

    return wrap


def recompute_vjp(forward: Callable[..., tuple], backward: Callable[..., tuple]) -> Callable[..., Array]:
    """attend(q, k, v, mask, static) with the FlashAttention custom VJP of the tiled implementations.

    forward(q, k, v, mask, static) -> (out, lse); the VJP saves (q, k, v, mask, out, lse), not the attention
    matrix, and backward(saved, d_out, static) -> (dq, dk, dv) recomputes the tiles. `static` must be hashable.
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
    def attend(q: Array, k: Array, v: Array, mask: AttentionMask, static: Hashable) -> Array:
        return forward(q, k, v, mask, static)[0]

    def attend_fwd(q: Array, k: Array, v: Array, mask: AttentionMask, static: Hashable) -> tuple[Array, tuple]:
        out, lse = forward(q, k, v, mask, static)
        return out, (q, k, v, mask, out, lse)

    def attend_bwd(static: Hashable, saved: tuple, d_out: Array) -> tuple:
        dq, dk, dv = backward(saved, d_out, static)
        return dq, dk, dv, jax.tree.map(lambda _: None, saved[3])  # integer mask vectors have no cotangent

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


def attention_mask(batch: int, q_len: int, kv_len: int, **masking: Array | bool | int | None) -> Array | None:
    """Boolean mask [B, 1, T, S] (True = may attend) of AttentionMask.create's arguments, or None."""
    return AttentionMask.create(batch, q_len, kv_len, **masking).dense()


def _check_shapes(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...]) -> None:
    """Shapes q [B,T,N,H], k [B,S,K,H], v [B,S,K,E] (heads-first keys are checked with their axes swapped back)."""
    if len(q) != 4 or len(k) != 4 or len(v) != 4:
        raise ValueError(f"attention expects q [B,T,N,H], k [B,S,K,H], v [B,S,K,E]; got shapes {q}, {k}, {v}")
    if k[:3] != v[:3] or q[0] != k[0] or q[3] != k[3]:
        raise ValueError(f"attention: incompatible q {q}, k {k}, v {v}")
    if q[2] % k[2]:
        raise ValueError(f"attention: {q[2]} query heads is not a multiple of {k[2]} key/value heads")


@register("xla")
def xla_attention(
    q: Array,
    k: Array,
    v: Array,
    mask: AttentionMask,
    *,
    scale: float | None = None,
    return_weights: bool = False,
    weights_dropout: Callable[[Array], Array] | None = None,
    kv_heads_first: bool = False,
) -> Array | tuple[Array, Array]:
    """Scaled dot-product attention, Attention(Q, K, V) = softmax(QK^T / sqrt(d_k)) V, materialising the scores.

    Scores and softmax are computed in float32 whatever the input dtype. With return_weights, also returns the
    attention weights [B, N, T, S] (rows sum to 1, or to 0 for a query that sees no key). weights_dropout, if
    given, is applied to the weights before they multiply V (attention dropout; needs the materialised weights).
    kv_heads_first: k is [B, K, S, H] and v [B, K, S, E] (the decoding cache's layout, read in place).
    """
    batch, q_len, num_heads, head_dim = q.shape
    kv_axes = "bksh" if kv_heads_first else "bskh"
    num_kv_heads, kv_len = (k.shape[1], k.shape[2]) if kv_heads_first else (k.shape[2], k.shape[1])
    scale = head_dim**-0.5 if scale is None else scale
    groups = num_heads // num_kv_heads
    # Grouped heads: query head n uses key/value head n // G.
    q_BTKGH = q.reshape(batch, q_len, num_kv_heads, groups, head_dim)
    scores_BKGTS = jnp.einsum(f"btkgh,{kv_axes}->bkgts", q_BTKGH, k, preferred_element_type=jnp.float32) * scale
    scores_BNTS = scores_BKGTS.reshape(batch, num_heads, q_len, kv_len)
    mask_B1TS = mask.dense()
    if mask_B1TS is not None:
        scores_BNTS = jnp.where(mask_B1TS, scores_BNTS, -jnp.inf)
        # A row with no visible key would be softmax over all -inf = NaN; give it zeros instead.
        any_visible_B1T1 = jnp.any(mask_B1TS, axis=-1, keepdims=True)
        scores_BNTS = jnp.where(any_visible_B1T1, scores_BNTS, 0.0)
    weights_BNTS = jax.nn.softmax(scores_BNTS, axis=-1)
    if mask_B1TS is not None:
        weights_BNTS = jnp.where(any_visible_B1T1, weights_BNTS, 0.0)
    used_BNTS = weights_BNTS if weights_dropout is None else weights_dropout(weights_BNTS)
    weights_BKGTS = used_BNTS.reshape(batch, num_kv_heads, groups, q_len, kv_len)
    # The product in batched-matmul order (batch axes b, k first, then the query rows), moved to [B, T, N, E] after:
    # asked for "btkge" directly, XLA:CPU computes it as a dot with the value axis before the query axis, which
    # strides through the cache for the decoding step's shapes (docs/benchmarks.md has the measurement).
    out_BKGTE = jnp.einsum(f"bkgts,{kv_axes[:-1]}e->bkgte", weights_BKGTS.astype(v.dtype), v)
    out_BTNE = out_BKGTE.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, num_heads, v.shape[-1])
    if return_weights:
        return out_BTNE, weights_BNTS
    return out_BTNE


def lineage_attention(
    q: Array, k: Array, v: Array, mask: AttentionMask, lineage_RL: Array, width: int, *, scale: float | None = None
) -> Array:
    """Attention over a heads-first decoding cache shared by each sentence's `width` beams: k [R, K, L, H] and
    v [R, K, L, E] hold what each row wrote (rows never move), and query row r reads slot l from its sentence's row
    lineage_RL[r, l] (beam lineage, the mask rules above), under `mask` (causality, [R, 1, T, L]).
    q [R, T, N, H] -> [R, T, N, E].

    Why: beam search would otherwise reorder the whole cache to follow the surviving beams at every step, a copy of
    every cached key and value (read and written) on top of the step's own read of them; here a step reads each once
    and only the lineage, L integers a row, follows the beams. Each row's keys are scored against all W queries of
    its sentence (W times the scores of one query a row, few next to the step's matmuls), then the softmax runs over
    the sentence's W L slots with the other rows' slots masked, so the result is the reordered cache's attention.
    """
    rows, q_len, num_heads, head_dim = q.shape
    _, num_kv_heads, kv_len, _ = k.shape
    batch, groups = rows // width, num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    queries = width * q_len * groups  # Q: a sentence's queries per key/value head, in (beam, position, group) order
    # [R, T, K, G, H] -> [B, K, Q, H], broadcast over the key rows w, so that the dots batch over (b, w, k), the
    # cache's leading axes (XLA reads it in place). The scores come out slots-major ([L, Q] per batch) and are then
    # transposed (they are small): XLA:CPU computes the [Q, L] product, and the weights times V in [L, Q] order,
    # more slowly at these shapes (docs/decoding.md has the measurement).
    q_BKQH = q.reshape(batch, width, q_len, num_kv_heads, groups, head_dim).transpose(0, 3, 1, 2, 4, 5)
    q_B1KQH = q_BKQH.reshape(batch, 1, num_kv_heads, queries, head_dim)
    q_BWKQH = jnp.broadcast_to(q_B1KQH, (batch, width, num_kv_heads, queries, head_dim))
    k_BWKLH = k.reshape(batch, width, num_kv_heads, kv_len, head_dim)
    v_BWKLE = v.reshape(batch, width, num_kv_heads, kv_len, v.shape[-1])
    scores_BWKLQ = jnp.einsum("bwklh,bwkqh->bwklq", k_BWKLH, q_BWKQH, preferred_element_type=jnp.float32)
    scores_BWKLQ = jax.lax.optimization_barrier(scores_BWKLQ)  # XLA would fold the transpose below into the dot
    scores_BWKQL = jnp.swapaxes(scores_BWKLQ, 3, 4) * scale
    # Visible: the row is the query's ancestor's at that slot, and causality ([R, 1, T, L] -> per query).
    lineage_BWQL = lineage_mask(lineage_RL, width)[:, :, :, None, None, :]  # [B, W, Wq, 1, 1, L]
    causal = mask.dense()
    if causal is not None:
        causal_BQL = causal.reshape(batch, 1, width, q_len, 1, kv_len)
        lineage_BWQL = lineage_BWQL & causal_BQL
    visible_BW1QL = jnp.broadcast_to(lineage_BWQL, (batch, width, width, q_len, groups, kv_len)).reshape(
        batch, width, 1, queries, kv_len
    )
    scores_BWKQL = jnp.where(visible_BW1QL, scores_BWKQL, -jnp.inf)
    top_B1KQ1 = jnp.max(scores_BWKQL, axis=(1, 4), keepdims=True)
    top_B1KQ1 = jnp.where(jnp.isfinite(top_B1KQ1), top_B1KQ1, 0.0)  # a query that sees no key: zeros, not NaN
    exp_BWKQL = jnp.exp(scores_BWKQL - top_B1KQ1)
    total_B1KQ1 = jnp.sum(exp_BWKQL, axis=(1, 4), keepdims=True)
    weights_BWKQL = exp_BWKQL / jnp.where(total_B1KQ1 > 0, total_B1KQ1, 1.0)
    out_BKQE = jnp.einsum("bwkql,bwkle->bwkqe", weights_BWKQL.astype(v.dtype), v_BWKLE).sum(axis=1)
    out_BWTKGE = out_BKQE.reshape(batch, num_kv_heads, width, q_len, groups, -1).transpose(0, 2, 3, 1, 4, 5)
    return out_BWTKGE.reshape(rows, q_len, num_heads, v.shape[-1])


def attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    causal: bool = False,
    q_positions: Array | None = None,
    kv_positions: Array | None = None,
    window: int | None = None,
    impl: str = "xla",
    kv_heads_first: bool = False,
    lineage: tuple[Array, int] | None = None,
    **options,
) -> Array:
    """Runs the implementation named `impl` under the mask rules above (AttentionMask); options go to it (e.g. scale).

    kv_heads_first: k and v are [B, K, S, H] / [B, K, S, E] (see the module docstring). Softmax implementations
    then run the reference on them in place; others (linear) get them sequence-first.
    lineage: (lineage_RL, W) for a heads-first decoding cache whose rows come in groups of W beams that share their
    slots (`lineage_attention`); softmax implementations only.
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {sorted(IMPLEMENTATIONS)}")
    if kv_heads_first and impl not in SOFTMAX_IMPLEMENTATIONS:
        k, v, kv_heads_first = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), False
    sequence_first = (lambda shape: (shape[0], shape[2], shape[1], shape[3])) if kv_heads_first else tuple
    _check_shapes(q.shape, sequence_first(k.shape), sequence_first(v.shape))
    mask = AttentionMask.create(
        q.shape[0],
        q.shape[1],
        k.shape[2] if kv_heads_first else k.shape[1],
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        causal=causal,
        q_positions=q_positions,
        kv_positions=kv_positions,
        window=window,
    )
    if lineage is not None:
        if not kv_heads_first or impl not in SOFTMAX_IMPLEMENTATIONS:
            raise ValueError(f"attention: beam lineage needs a heads-first cache and a softmax impl, got {impl!r}")
        if set(options) - {"scale"}:
            raise ValueError(f"attention: beam lineage takes no options but scale, got {sorted(options)}")
        return lineage_attention(q, k, v, mask, *lineage, **options)
    if kv_heads_first:
        return xla_attention(q, k, v, mask, kv_heads_first=True, **options)
    return IMPLEMENTATIONS[impl](q, k, v, mask, **options)
