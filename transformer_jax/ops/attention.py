"""The one attention entry point, the XLA reference implementation and linear attention.

Every implementation has the signature `fn(q, k, v, mask, **options)`: q is [B, T, N, H], k is [B, S, K, H],
v is [B, S, K, E], N a multiple of K (grouped-query heads), and `mask` the masks.AttentionMask that `attention`
builds once from its arguments. Which keys a query sees is written only there (ops/masks.py).

Keys and values may also come heads-first, k [B, K, S, H] and v [B, K, S, E] (`kv_heads_first=True`): the layout
of the decoding cache. A decode step is bound by reading the cache, and with sequence-first keys XLA copies every
cached key and value into heads-first order at every step, a second read and a write of the whole cache
(benchmarks/decode.py measures both). Softmax kernels then run the reference below, which reads the heads-first
cache in place; one query per row leaves no query blocks for a tiled kernel to gain on.

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable

import jax
import jax.numpy as jnp

from transformer_jax.ops.masks import AttentionMask, is_real, lineage_mask

Array = jax.Array

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


def feature_map(x: Array) -> Array:
    """phi(x) = elu(x) + 1 > 0, the feature map of Katharopoulos et al."""
    return jax.nn.elu(x) + 1.0


def _run_sums(prefix_BS: Array, first_BT: Array, end_BT: Array) -> Array:
    """sum over s in [first, end) from the prefix sums [B, S + 1, ...] (prefix[s] = sum of rows before s)."""

    def at(index_BT: Array) -> Array:
        index = index_BT.reshape(*index_BT.shape, *([1] * (prefix_BS.ndim - 2)))
        return jnp.take_along_axis(prefix_BS, index, axis=1)

    return at(end_BT) - at(first_BT)


@register("linear", softmax=False)
def linear_attention(q: Array, k: Array, v: Array, mask: AttentionMask) -> Array:
    """Kernelised linear attention (Katharopoulos et al., 2020), softmax(q.k) replaced by phi(q).phi(k):

        out_t = phi(q_t)^T sum_s phi(k_s) v_s^T / phi(q_t)^T sum_s phi(k_s),   phi(x) = elu(x) + 1

    The sums run over each query's keys as AttentionMask.key_ranges gives them, a run [first, end) of key indices,
    so each is a difference of two prefix sums: O(S H E) memory instead of the O(T S) scores, for packed rows,
    padding, causal self-attention and a decoding cache alike (their keys are in the (segment id, position) order
    key_ranges needs). Sliding windows are refused; a query that sees no key returns zeros.
    """
    if mask.window is not None:
        raise ValueError("attention impl 'linear' does not support a sliding window; set attention.window=0")
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    groups = num_heads // num_kv_heads
    q, k, v = mask.zero_padding_tokens(q, k, v)
    phi_q_BTKGH = feature_map(q.astype(jnp.float32)).reshape(batch, q_len, num_kv_heads, groups, head_dim)
    phi_k_BSKH = feature_map(k.astype(jnp.float32))
    if mask.segments:
        phi_k_BSKH = jnp.where(is_real(mask.kv_segment_ids)[:, :, None, None], phi_k_BSKH, 0.0)  # phi(0) = 1
    kv_BSKHE = jnp.einsum("bskh,bske->bskhe", phi_k_BSKH, v.astype(jnp.float32))

    def prefix(x_BS: Array) -> Array:
        return jnp.concatenate([jnp.zeros_like(x_BS[:, :1]), jnp.cumsum(x_BS, axis=1)], axis=1)

    first_BT, end_BT = mask.key_ranges(batch, q_len, kv_len)
    kv_BTKHE = _run_sums(prefix(kv_BSKHE), first_BT, end_BT)
    z_BTKH = _run_sums(prefix(phi_k_BSKH), first_BT, end_BT)
    num_BTKGE = jnp.einsum("btkgh,btkhe->btkge", phi_q_BTKGH, kv_BTKHE)
    den_BTKG = jnp.einsum("btkgh,btkh->btkg", phi_q_BTKGH, z_BTKH)
    # A query that sees no key has a zero denominator: return zeros, with a safe divisor for the gradient.
    seen_BTKG = den_BTKG > 0
    out_BTKGE = jnp.where(seen_BTKG[..., None], num_BTKGE / jnp.where(seen_BTKG, den_BTKG, 1.0)[..., None], 0.0)
    return out_BTKGE.reshape(batch, q_len, num_heads, v.shape[-1]).astype(q.dtype)


def lineage_attention(
    q: Array, k: Array, v: Array, mask: AttentionMask, lineage_RL: Array, width: int, *, scale: float | None = None
) -> Array:
    """Attention over a heads-first decoding cache shared by each sentence's `width` beams: k [R, K, L, H] and
    v [R, K, L, E] hold what each row wrote (rows never move), and query row r reads slot l from its sentence's row
    lineage_RL[r, l] (ops/masks.py, beam lineage), under `mask` (causality, [R, 1, T, L]).
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
    """Runs the implementation named `impl` with the mask of ops/masks.py's rules; options go to it (e.g. scale).

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
