"""Multi-head attention: projections, masks and the decoding cache. The kernel is `ops.attention`.

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

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
    Set `capture_weights = True` to sow the attention weights [B, N, T, S] as `nnx.Intermediate`
    (computed with the materialising `xla` reference, whatever the configured kernel).
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
    ) -> Array:
        """Attends queries from x to precomputed (K, V) heads; returns [B, T, D]."""
        batch, length, _ = x_BTD.shape
        q_BTNH = self.q_proj(x_BTD).reshape(batch, length, self.num_heads, self.d_qk)
        k_BSKH, v_BSKE = kv
        masking = dict(
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
            causal=causal,
            q_positions=q_positions,
            kv_positions=kv_positions,
            window=self.window,
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
        return self.o_proj(out_BTNE.reshape(batch, length, self.num_heads * self.d_v))


def init_self_cache(attn: MultiHeadAttention, batch: int, max_len: int, dtype: jnp.dtype) -> dict[str, Array]:
    """An empty decoder self-attention cache holding up to max_len keys and values."""
    return {
        "k": jnp.zeros((batch, max_len, attn.num_kv_heads, attn.d_qk), dtype),
        "v": jnp.zeros((batch, max_len, attn.num_kv_heads, attn.d_v), dtype),
    }


def append_to_cache(cache: dict[str, Array], k_BTKH: Array, v_BTKE: Array, index: Array) -> dict[str, Array]:
    """Writes the new keys/values at positions [index, index + T) of the cache."""
    return {
        "k": jax.lax.dynamic_update_slice_in_dim(cache["k"], k_BTKH.astype(cache["k"].dtype), index, axis=1),
        "v": jax.lax.dynamic_update_slice_in_dim(cache["v"], v_BTKE.astype(cache["v"].dtype), index, axis=1),
    }
