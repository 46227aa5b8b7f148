"""The one attention entry point and the XLA reference implementation.

Axis legend: B batch, T query length, S key/value length, N query heads, K key/value heads, H head dim.

Conventions shared by every implementation:
- q is [B, T, N, H]; k is [B, S, K, H]; v is [B, S, K, Hv]; N must be a multiple of K (grouped-query heads).
- Segment ids: id 0 (or any id <= 0) marks padding. A query attends to a key only when both have the same
  positive segment id. Passing only one of q_segment_ids / kv_segment_ids treats the other side as all ones.
- Causal masking compares positions: a query at position p sees keys at positions <= p. Without explicit
  positions, queries are aligned to the end of the keys (query i has position i + S - T), which is the
  convention of decoding with a cache and of FlashAttention 2.
- window=w keeps keys with 0 <= p_q - p_k < w when causal, |p_q - p_k| < w otherwise (local attention).
- A query row with no visible key returns zeros (never NaN), and its gradients are zero.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

Array = jax.Array

IMPLEMENTATIONS: dict[str, Callable[..., Array]] = {}


def register(name: str) -> Callable[[Callable[..., Array]], Callable[..., Array]]:
    """Registers an attention implementation under `name` for `attention(..., impl=name)`."""

    def wrap(fn: Callable[..., Array]) -> Callable[..., Array]:
        IMPLEMENTATIONS[name] = fn
        return fn

    return wrap


def _default_positions(batch: int, length: int, offset: int) -> Array:
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32) + offset, (batch, length))


def attention_mask(
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
) -> Array | None:
    """Boolean mask [B, 1, T, S] (True = may attend) from the shared conventions, or None if nothing is masked."""
    mask = None

    def conjoin(m: Array) -> None:
        nonlocal mask
        mask = m if mask is None else jnp.logical_and(mask, m)

    if q_segment_ids is not None or kv_segment_ids is not None:
        q_seg = jnp.ones((batch, q_len), jnp.int32) if q_segment_ids is None else q_segment_ids
        kv_seg = jnp.ones((batch, kv_len), jnp.int32) if kv_segment_ids is None else kv_segment_ids
        same = q_seg[:, :, None] == kv_seg[:, None, :]
        real = jnp.logical_and(q_seg[:, :, None] > 0, kv_seg[:, None, :] > 0)
        conjoin(jnp.logical_and(same, real))
    if causal or window is not None:
        q_pos = _default_positions(batch, q_len, kv_len - q_len) if q_positions is None else q_positions
        kv_pos = _default_positions(batch, kv_len, 0) if kv_positions is None else kv_positions
        delta = q_pos[:, :, None] - kv_pos[:, None, :]  # [B, T, S]
        if causal:
            conjoin(delta >= 0)
        if window is not None:
            if window <= 0:
                raise ValueError(f"attention window must be a positive number of tokens, got {window}")
            conjoin(delta < window if causal else jnp.abs(delta) < window)
    return None if mask is None else mask[:, None, :, :]


def _check_shapes(q: Array, k: Array, v: Array) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"attention expects q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv]; got shapes {q.shape}, {k.shape}, {v.shape}"
        )
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention: incompatible q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"attention: {q.shape[2]} query heads is not a multiple of {k.shape[2]} key/value heads")


@register("xla")
def xla_attention(
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
    scale: float | None = None,
    return_weights: bool = False,
    weights_dropout: Callable[[Array], Array] | None = None,
) -> Array | tuple[Array, Array]:
    """Scaled dot-product attention, Attention(Q, K, V) = softmax(QK^T / sqrt(d_k)) V, materialising the scores.

    Scores and softmax are computed in float32 whatever the input dtype. With return_weights, also returns the
    attention weights [B, N, T, S] (rows sum to 1, or to 0 for a query that sees no key). weights_dropout, if
    given, is applied to the weights before they multiply V (attention dropout; needs the materialised weights).
    """
    _check_shapes(q, k, v)
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    groups = num_heads // num_kv_heads
    # Grouped heads: query head n uses key/value head n // groups.
    q_BTKGH = q.reshape(batch, q_len, num_kv_heads, groups, head_dim)
    scores_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k, preferred_element_type=jnp.float32) * scale
    scores_BNTS = scores_BKGTS.reshape(batch, num_heads, q_len, kv_len)
    mask = attention_mask(
        batch,
        q_len,
        kv_len,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        causal=causal,
        q_positions=q_positions,
        kv_positions=kv_positions,
        window=window,
    )
    if mask is not None:
        scores_BNTS = jnp.where(mask, scores_BNTS, -jnp.inf)
        # A row with no visible key would be softmax over all -inf = NaN; give it zeros instead.
        any_visible = jnp.any(mask, axis=-1, keepdims=True)
        scores_BNTS = jnp.where(any_visible, scores_BNTS, 0.0)
    weights_BNTS = jax.nn.softmax(scores_BNTS, axis=-1)
    if mask is not None:
        weights_BNTS = jnp.where(any_visible, weights_BNTS, 0.0)
    used_BNTS = weights_BNTS if weights_dropout is None else weights_dropout(weights_BNTS)
    weights_BKGTS = used_BNTS.reshape(batch, num_kv_heads, groups, q_len, kv_len)
    out_BTKGH = jnp.einsum("bkgts,bskh->btkgh", weights_BKGTS.astype(v.dtype), v)
    out_BTNH = out_BTKGH.reshape(batch, q_len, num_heads, v.shape[-1])
    if return_weights:
        return out_BTNH, weights_BNTS
    return out_BTNH


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
    **kwargs,
) -> Array:
    """Dispatches to the implementation named `impl`; see the module docstring for the shared semantics."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {sorted(IMPLEMENTATIONS)}")
    return IMPLEMENTATIONS[impl](
        q,
        k,
        v,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        causal=causal,
        q_positions=q_positions,
        kv_positions=kv_positions,
        window=window,
        **kwargs,
    )
