"""Multi-head attention: projections, masks and the decoding cache. The kernel is `ops.attention`.

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax import ops
from transformer_jax.model.layers import Dropout, dense
from transformer_jax.model.spec import TransformerSpec

Array = jax.Array


class MultiHeadAttention(nnx.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, head_i = Attention(Q W^Q_i, K W^K_i, V W^V_i) (3.2.2).

    The module never knows which kernel runs: it calls `ops.attention(..., impl=spec.attention_impl)`.
    For transformer_jax.explain, `capture_weights = True` sows the attention weights [B, N, T, S] (computed by the
    `xla` reference whatever the kernel) and `capture_intermediates = True` sows Q, K, V, the heads' outputs and the
    output, as `nnx.Intermediate`; both are off by default, so training and decoding trace exactly as without them.
    """

    def __init__(self, spec: TransformerSpec, *, rngs: nnx.Rngs):
        self.num_heads, self.num_kv_heads = spec.num_heads, spec.heads_kv
        self.d_qk, self.d_v = spec.d_qk, spec.d_v
        self.q_proj = dense(spec.d_model, self.num_heads * self.d_qk, spec, rngs)
        self.k_proj = dense(spec.d_model, self.num_kv_heads * self.d_qk, spec, rngs)
        self.v_proj = dense(spec.d_model, self.num_kv_heads * self.d_v, spec, rngs)
        self.o_proj = dense(self.num_heads * self.d_v, spec.d_model, spec, rngs)
        self.weights_dropout = Dropout(spec.attention_dropout_rate, rngs=rngs)
        self.dropout_rate = spec.attention_dropout_rate
        self.impl = spec.attention_impl
        self.window = spec.window
        self.capture_weights = False
        self.capture_intermediates = False

    def project_kv(self, x_BSD: Array) -> tuple[Array, Array]:
        """K = X W^K and V = X W^V, split into heads: [B, S, K, H] and [B, S, K, E]."""
        batch, length, _ = x_BSD.shape
        k_BSKH = self.k_proj(x_BSD).reshape(batch, length, self.num_kv_heads, self.d_qk)
        v_BSKE = self.v_proj(x_BSD).reshape(batch, length, self.num_kv_heads, self.d_v)
        return k_BSKH, v_BSKE

    def __call__(
        self,
        x_BTD: Array,
        kv: tuple[Array, Array],
        *,
        q_segment_ids: Array | None,
        kv_segment_ids: Array | None,
        q_positions: Array | None,
        kv_positions: Array | None,
        causal: bool,
        kv_heads_first: bool = False,
        lineage: tuple[Array, int] | None = None,
    ) -> Array:
        """Attends queries from x to precomputed (K, V) heads; returns [B, T, D].

        kv is ([B, S, K, H], [B, S, K, E]) as project_kv returns them, or heads-first ([B, K, S, H], [B, K, S, E])
        with kv_heads_first, the layout of the decoding cache (see ops/attention.py for why). lineage: (lineage_RL,
        W) of a cache shared by each sentence's W beams (ops.attention's lineage).
        """
        batch, length, _ = x_BTD.shape
        q_BTNH = self.q_proj(x_BTD).reshape(batch, length, self.num_heads, self.d_qk)
        k_BSKH, v_BSKE = kv
        masking = dict(
            kv_heads_first=kv_heads_first,
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
            causal=causal,
            q_positions=q_positions,
            kv_positions=kv_positions,
            window=self.window,
            lineage=lineage,
        )
        use_dropout = self.dropout_rate > 0 and not self.weights_dropout.deterministic
        if self.capture_weights or use_dropout:
            out_BTNE, weights_BNTS = ops.attention(
                q_BTNH,
                k_BSKH,
                v_BSKE,
                impl="xla",
                return_weights=True,
                weights_dropout=self.weights_dropout if use_dropout else None,
                **masking,
            )
            if self.capture_weights:
                self.sow(nnx.Intermediate, "attention_weights", weights_BNTS)
        else:
            out_BTNE = ops.attention(q_BTNH, k_BSKH, v_BSKE, impl=self.impl, **masking)
        out_BTD = self.o_proj(out_BTNE.reshape(batch, length, self.num_heads * self.d_v))
        if self.capture_intermediates:
            for name, value in (("q", q_BTNH), ("k", k_BSKH), ("v", v_BSKE), ("heads", out_BTNE), ("output", out_BTD)):
                self.sow(nnx.Intermediate, name, value)
        return out_BTD


# The decoding caches hold keys and values heads-first, k [B, K, L, H] and v [B, K, L, E]: slots on axis 2.
CACHE_SLOT_AXIS = 2


def heads_first(x_BSKH: Array) -> Array:
    """[B, S, K, H] (project_kv's layout) -> [B, K, S, H] (the cache's)."""
    return jnp.swapaxes(x_BSKH, 1, CACHE_SLOT_AXIS)


def init_self_cache(attn: MultiHeadAttention, batch: int, max_len: int, dtype: jnp.dtype) -> dict[str, Array]:
    """An empty decoder self-attention cache holding up to max_len keys and values, heads-first."""
    return {
        "k": jnp.zeros((batch, attn.num_kv_heads, max_len, attn.d_qk), dtype),
        "v": jnp.zeros((batch, attn.num_kv_heads, max_len, attn.d_v), dtype),
    }


def append_to_cache(cache: dict[str, Array], k_BTKH: Array, v_BTKE: Array, index_B: Array) -> dict[str, Array]:
    """Writes row b's new keys/values at its slots [index_B[b], index_B[b] + T) of the cache.

    Each row has its own write index, so rows at different positions (sentences that joined a running batch at
    different steps) share one cache.
    """
    # Per row, the slots without the batch axis: the slot axis is one lower.
    write_row = jax.vmap(functools.partial(jax.lax.dynamic_update_slice_in_dim, axis=CACHE_SLOT_AXIS - 1))

    def write(slots: Array, new_BTKX: Array) -> Array:
        return write_row(slots, heads_first(new_BTKX).astype(slots.dtype), index_B)

    return {"k": write(cache["k"], k_BTKH), "v": write(cache["v"], v_BTKE)}


def append_lineage(lineage_RL: Array, width: int, length: int, index_R: Array) -> Array:
    """The beam lineage (ops/masks.py) after each row writes `length` slots from index_R[r] on: those slots are its
    own (beam r mod W of its sentence)."""
    rows = lineage_RL.shape[0]
    own_RT = jnp.broadcast_to((jnp.arange(rows, dtype=jnp.int32) % width)[:, None], (rows, length))
    return jax.vmap(jax.lax.dynamic_update_slice_in_dim, in_axes=(0, 0, 0, None))(lineage_RL, own_RT, index_R, 0)


def grow_slots(slots: Array, max_len: int) -> Array:
    """Heads-first keys or values [B, K, L, X] with room for max_len slots (>= L): the new slots are zeros (empty or
    padding: never attended)."""
    extra = max_len - slots.shape[CACHE_SLOT_AXIS]
    if extra < 0:
        raise ValueError(f"cannot shrink a cache of {slots.shape[CACHE_SLOT_AXIS]} slots to {max_len}")
    widths = [(0, 0)] * slots.ndim
    widths[CACHE_SLOT_AXIS] = (0, extra)
    return jnp.pad(slots, widths)


def grow_self_cache(cache: dict[str, Array], max_len: int) -> dict[str, Array]:
    """The same cache with room for max_len slots (>= its own): the new slots are empty (zeros, never attended)."""
    return {name: grow_slots(slots, max_len) for name, slots in cache.items()}
