"""The encoder-decoder Transformer (paper section 3): stacks of attention + FFN sublayers with residual + norm.

Axis letters: see transformer_jax/__init__.py.
Public face: `encode(src) -> memory` and `decode(memory, tgt, cache=None) -> logits`; training, decoding and
evaluation all go through these two.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from transformer_jax.model import layers
from transformer_jax.model.layers import (
    CACHE_SLOT_AXIS,
    Embedding,
    FeedForward,
    LearnedPositions,
    MultiHeadAttention,
    TransformerSpec,
    append_lineage,
    append_to_cache,
    dense,
    grow_self_cache,
    grow_slots,
    heads_first,
    init_self_cache,
    make_norm,
    sinusoidal_encoding,
)
from transformer_jax.ops.attention import SOFTMAX_IMPLEMENTATIONS

Array = jax.Array
Cache = dict[str, Any]


def unpacked_segment_ids(tokens_BT: Array, pad_id: int, *, target: bool = False) -> Array:
    """Segment ids of rows that each hold one sentence: 1 for real tokens, 0 for padding (pad_id). A target row's
    first input is BOS, real even where BOS is the pad id (Marian's decoder starts from pad)."""
    segment_ids_BT = (tokens_BT != pad_id).astype(jnp.int32)
    return segment_ids_BT.at[:, 0].set(1) if target else segment_ids_BT


class Residual(nnx.Module):
    """One sublayer connection: post-LN LayerNorm(x + Dropout(Sublayer(x))) (paper 5.4), or pre-LN
    x + Dropout(Sublayer(LayerNorm(x))). With capture_intermediates, sows the norm's input and output."""

    def __init__(self, spec: TransformerSpec, *, rngs: nnx.Rngs):
        self.norm = make_norm(spec)
        self.dropout = layers.Dropout(spec.dropout_rate, rngs=rngs)
        self.pre = spec.norm_position == "pre"
        self.capture_intermediates = False

    def _normed(self, x: Array) -> Array:
        y = self.norm(x)
        if self.capture_intermediates:
            self.sow(nnx.Intermediate, "norm_input", x)
            self.sow(nnx.Intermediate, "norm_output", y)
        return y

    def __call__(self, x: Array, sublayer: Callable[[Array], Array]) -> Array:
        if self.pre:
            return x + self.dropout(sublayer(self._normed(x)))
        return self._normed(x + self.dropout(sublayer(x)))


class EncoderLayer(nnx.Module):
    """Self-attention then FFN, each wrapped in a residual connection (paper 3.1)."""

    def __init__(self, spec: TransformerSpec, *, rngs: nnx.Rngs):
        self.self_attn = MultiHeadAttention(spec, rngs=rngs)
        self.self_attn_residual = Residual(spec, rngs=rngs)
        self.ffn = FeedForward(spec, rngs=rngs)
        self.ffn_residual = Residual(spec, rngs=rngs)

    def __call__(self, x_BSD: Array, segment_ids_BS: Array, positions_BS: Array) -> Array:
        def self_attention(h: Array) -> Array:
            return self.self_attn(
                h,
                self.self_attn.project_kv(h),
                q_segment_ids=segment_ids_BS,
                kv_segment_ids=segment_ids_BS,
                q_positions=positions_BS,
                kv_positions=positions_BS,
                causal=False,
            )

        x_BSD = self.self_attn_residual(x_BSD, self_attention)
        return self.ffn_residual(x_BSD, self.ffn)


class DecoderLayer(nnx.Module):
    """Masked self-attention, cross-attention over the encoder output, then FFN (paper 3.1)."""

    def __init__(self, spec: TransformerSpec, *, rngs: nnx.Rngs):
        self.self_attn = MultiHeadAttention(spec, rngs=rngs)
        self.self_attn_residual = Residual(spec, rngs=rngs)
        self.cross_attn = MultiHeadAttention(spec, rngs=rngs)
        self.cross_attn_residual = Residual(spec, rngs=rngs)
        self.ffn = FeedForward(spec, rngs=rngs)
        self.ffn_residual = Residual(spec, rngs=rngs)

    def __call__(
        self,
        y_BTD: Array,
        cross_kv: tuple[Array, Array],
        *,
        tgt_segment_ids: Array | None,
        tgt_positions: Array,
        src_segment_ids: Array | None,
        self_cache: dict[str, Array] | None,
        cache_index: Array | None,
        lineage: tuple[Array, int] | None = None,
    ) -> tuple[Array, dict[str, Array] | None]:
        new_cache = None

        def masked_self_attention(h: Array) -> Array:
            nonlocal new_cache
            k, v = self.self_attn.project_kv(h)
            if self_cache is None:
                kv, kv_positions, kv_segment_ids = (k, v), tgt_positions, tgt_segment_ids
            else:
                # Decoding: the new keys join the cache; cache slots beyond the query are masked by causality.
                new_cache = append_to_cache(self_cache, k, v, cache_index)
                kv = (new_cache["k"], new_cache["v"])
                batch, cache_len = new_cache["k"].shape[0], new_cache["k"].shape[CACHE_SLOT_AXIS]
                kv_positions = jnp.broadcast_to(jnp.arange(cache_len, dtype=jnp.int32), (batch, cache_len))
                kv_segment_ids = None
            return self.self_attn(
                h,
                kv,
                q_segment_ids=tgt_segment_ids,
                kv_segment_ids=kv_segment_ids,
                q_positions=tgt_positions,
                kv_positions=kv_positions,
                causal=True,
                kv_heads_first=self_cache is not None,
                lineage=lineage,
            )

        def cross_attention(h: Array) -> Array:
            # Q from the decoder, K and V from the encoder output; no causality, only segments and padding.
            rows, length, width = h.shape[0], h.shape[1], h.shape[0] // cross_kv[0].shape[0]
            # Beam decoding caches one row of keys/values per sentence for its `width` beams' rows (adjacent, see
            # decoding/model_calls.py split_cache): those beams' queries attend together, as one sentence's queries.
            if width > 1:
                h = h.reshape(rows // width, width * length, h.shape[2])
            out = self.cross_attn(
                h,
                cross_kv,
                q_segment_ids=tgt_segment_ids,
                kv_segment_ids=src_segment_ids,
                q_positions=None,
                kv_positions=None,
                causal=False,
                kv_heads_first=self_cache is not None,  # decoding: cached by init_cache, heads-first
            )
            return out.reshape(rows, length, out.shape[2])

        y_BTD = self.self_attn_residual(y_BTD, masked_self_attention)
        y_BTD = self.cross_attn_residual(y_BTD, cross_attention)
        return self.ffn_residual(y_BTD, self.ffn), new_cache


class Transformer(nnx.Module):
    """The encoder-decoder of "Attention Is All You Need" (Vaswani et al., 2017)."""

    def __init__(self, spec: TransformerSpec, *, rngs: nnx.Rngs):
        self.spec = spec

        def embedding(rows: int) -> Embedding:
            return Embedding(rows, spec.d_model, spec.compute_dtype, fused_backward=spec.fused_backward_on, rngs=rngs)

        # A source vocabulary of its own (model.source_vocab_size, Marian's target_vocab.json) has its own rows.
        self.src_embed = embedding(spec.source_vocab_size or spec.vocab_size)
        self.tgt_embed = None if spec.share_embeddings else embedding(spec.vocab_size)
        self.output_proj = None if spec.tie_output else dense(spec.d_model, spec.vocab_size, spec, rngs, bias=False)
        # Marian's final_logits_bias: float32 like every parameter, zeros so that a new model starts as without it.
        self.final_logits_bias_V = (
            nnx.Param(jnp.zeros((spec.vocab_size,), jnp.float32)) if spec.final_logits_bias else None
        )
        if spec.positional == "learned":
            self.src_positions = LearnedPositions(spec.max_len, spec.d_model, rngs=rngs)
            self.tgt_positions = (
                self.src_positions if spec.share_embeddings else LearnedPositions(spec.max_len, spec.d_model, rngs=rngs)
            )
        self.embed_dropout = layers.Dropout(spec.dropout_rate, rngs=rngs)
        self.encoder_layers = nnx.List([EncoderLayer(spec, rngs=rngs) for _ in range(spec.num_encoder_layers)])
        self.decoder_layers = nnx.List([DecoderLayer(spec, rngs=rngs) for _ in range(spec.num_decoder_layers)])
        # Pre-LN stacks end with a norm, since their residual stream is never normalised otherwise.
        pre = spec.norm_position == "pre"
        self.encoder_norm = make_norm(spec) if pre else None
        self.decoder_norm = make_norm(spec) if pre else None
        self.capture_intermediates = False  # True: _embed sows its terms (transformer_jax.explain)

    # -- pieces ------------------------------------------------------------------------------------------------

    def _embed(self, tokens_BT: Array, positions_BT: Array, target: bool) -> Array:
        """Dropout(Embedding(tokens) * sqrt(d_model) + PE(positions + model.position_offset)) (paper 3.4, 3.5, 5.4).

        The offset shifts only what the positional encoding reads (every source and target position, the cached
        decoder's included): attention's masks take the unshifted positions, whose differences it leaves alone."""
        embed = self.tgt_embed if (target and self.tgt_embed is not None) else self.src_embed
        x = embed(tokens_BT)
        scaled = x
        if self.spec.position_offset:  # a Python int: the default model traces exactly as without the key
            positions_BT = positions_BT + self.spec.position_offset
        if self.spec.positional == "sinusoidal":
            pe_BTD = sinusoidal_encoding(positions_BT, self.spec.d_model, self.spec.sinusoid_layout)
            x = x + pe_BTD.astype(x.dtype)
        elif self.spec.positional == "learned":
            table = self.tgt_positions if target else self.src_positions
            x = x + table(positions_BT).astype(x.dtype)
        if self.capture_intermediates:
            side = "tgt" if target else "src"
            self.sow(nnx.Intermediate, f"{side}_scaled_embedding", scaled)
            self.sow(nnx.Intermediate, f"{side}_embedding_plus_positions", x)
        return self.embed_dropout(x)

    def _defaults(
        self, tokens_BT: Array, segment_ids: Array | None, positions: Array | None, target: bool = False
    ) -> tuple[Array, Array]:
        """Unpacked inputs: segment 1 for real tokens, 0 for padding (`unpacked_segment_ids`); positions 0, 1, ..."""
        batch, length = tokens_BT.shape
        self._check_positions(length, "sequence of")
        if segment_ids is None:
            segment_ids = unpacked_segment_ids(tokens_BT, self.spec.pad_id, target=target)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        return segment_ids, positions

    def _check_positions(self, length: int, what: str) -> None:
        """ValueError when a learned table has no row for `length` positions from model.position_offset on (out-of-range
        rows cannot raise inside jit)."""
        spec = self.spec
        if spec.positional == "learned" and length + spec.position_offset > spec.max_len:
            offset = f" from model.position_offset={spec.position_offset}" if spec.position_offset else ""
            raise ValueError(f"{what} {length} tokens{offset} exceeds model.max_len={spec.max_len}")

    def logits(self, y_BTD: Array) -> Array:
        """The pre-softmax linear transformation, sharing the embedding matrix when tied (paper 3.4), in float32;
        + final_logits_bias_V with model.final_logits_bias. Every consumer of logits (loss, search, scoring,
        explain) reads them from `decode`, which calls this."""
        if self.output_proj is not None:
            logits_BTV = self.output_proj(y_BTD).astype(jnp.float32)
        else:
            embed = self.tgt_embed if self.tgt_embed is not None else self.src_embed
            logits_BTV = embed.attend(y_BTD)
        if self.final_logits_bias_V is not None:
            logits_BTV = logits_BTV + self.final_logits_bias_V[...]
        return logits_BTV

    # -- public face ----------------------------------------------------------------------------------------------

    def encode(
        self, src_tokens: Array, src_segment_ids: Array | None = None, src_positions: Array | None = None
    ) -> Array:
        """memory [B, S, D] = Encoder(src_tokens). Segment ids 0 mark padding; default: unpacked_segment_ids."""
        src_segment_ids, src_positions = self._defaults(src_tokens, src_segment_ids, src_positions)
        x_BSD = self._embed(src_tokens, src_positions, target=False)
        for layer in self.encoder_layers:
            x_BSD = layer(x_BSD, src_segment_ids, src_positions)
        return x_BSD if self.encoder_norm is None else self.encoder_norm(x_BSD)

    def decode(
        self,
        memory: Array | None,
        tgt_tokens: Array,
        *,
        src_tokens: Array | None = None,
        src_segment_ids: Array | None = None,
        tgt_segment_ids: Array | None = None,
        tgt_positions: Array | None = None,
        cache: Cache | None = None,
    ) -> Array | tuple[Array, Cache]:
        """logits [B, T, V] (float32) of the next token at each target position, given the encoder memory.

        Without a cache, tgt_tokens is the whole shifted target (BOS y_1 ... y_{T-1}) and the causal mask hides the
        future. Cross-attention must not read the memory of the source's padding, so it needs the source's segment
        ids, or the source tokens to derive them from as `encode` does. With a cache from `init_cache`, tgt_tokens
        are the next T tokens (usually T = 1), memory and the source are not read (the cache holds the projected
        cross-attention keys/values and the source segment ids), and the return value is (logits, updated cache).
        With a context row per W > 1 cache rows (a sentence's beams), the self-attention reads each beam's slots
        through the cache's beam lineage (`reorder_cache`).
        """
        lineage = None
        if cache is None:
            if memory is None:
                raise ValueError("decode needs the encoder memory when no cache is given")
            src_segment_ids = _source_segment_ids(src_tokens, src_segment_ids, self.spec.pad_id, "decode")
            tgt_segment_ids, tgt_positions = self._defaults(tgt_tokens, tgt_segment_ids, tgt_positions, target=True)
            cross_kvs = [layer.cross_attn.project_kv(memory) for layer in self.decoder_layers]
            index = None
        else:
            batch, length = tgt_tokens.shape
            index = cache["index"]  # [B]: each row's next slot
            tgt_positions = index[:, None] + jnp.arange(length, dtype=jnp.int32)
            tgt_segment_ids, src_segment_ids = None, cache["src_segment_ids"]
            cross_kvs = [(c["k"], c["v"]) for c in cache["cross"]]
            # A context row per sentence for W > 1 rows (its beams, see cross_attention): with a beam lineage the
            # beams share their self-attention slots (`reorder_cache`).
            width = batch // src_segment_ids.shape[0]
            if "lineage" in cache and width > 1:
                cache = {**cache, "lineage": append_lineage(cache["lineage"], width, length, index)}
                lineage = (cache["lineage"], width)
        y_BTD = self._embed(tgt_tokens, tgt_positions, target=True)
        new_self = []
        for i, layer in enumerate(self.decoder_layers):
            y_BTD, layer_cache = layer(
                y_BTD,
                cross_kvs[i],
                tgt_segment_ids=tgt_segment_ids,
                tgt_positions=tgt_positions,
                src_segment_ids=src_segment_ids,
                self_cache=None if cache is None else cache["self"][i],
                cache_index=index,
                lineage=lineage,
            )
            new_self.append(layer_cache)
        if self.decoder_norm is not None:
            y_BTD = self.decoder_norm(y_BTD)
        logits_BTV = self.logits(y_BTD)
        if cache is None:
            return logits_BTV
        return logits_BTV, {**cache, "self": new_self, "index": index + tgt_tokens.shape[1]}

    def init_cache(
        self, memory: Array, src_segment_ids: Array | None, max_len: int, *, src_tokens: Array | None = None
    ) -> Cache:
        """A decoding cache for up to max_len target tokens: cross-attention K/V projected once per sentence.

        The source's segment ids (or its tokens, to derive them from) are kept to mask its padding, as in `decode`.
        Keys and values are held heads-first (model/layers.py CACHE_SLOT_AXIS); `grow_cache` adds slots. With a
        softmax attention the cache also holds a beam lineage [B, max_len] (`reorder_cache`).
        """
        self._check_positions(max_len, "decoding")
        src_segment_ids = _source_segment_ids(src_tokens, src_segment_ids, self.spec.pad_id, "init_cache")
        batch = memory.shape[0]
        dtype = self.spec.compute_dtype
        cross = []
        for layer in self.decoder_layers:
            k, v = layer.cross_attn.project_kv(memory)
            cross.append({"k": heads_first(k), "v": heads_first(v)})
        cache = {
            "index": jnp.zeros((batch,), jnp.int32),
            "src_segment_ids": src_segment_ids,
            "cross": cross,
            "self": [init_self_cache(layer.self_attn, batch, max_len, dtype) for layer in self.decoder_layers],
        }
        if self.spec.attention_impl in SOFTMAX_IMPLEMENTATIONS:  # ops.attention's beam lineage is softmax's
            cache["lineage"] = jnp.zeros((batch, max_len), jnp.int32)
        return cache

    @staticmethod
    def reorder_cache(cache: Cache, rows_R: Array) -> Cache:
        """The per-step cache (`index`, `self`, `lineage`) following beam search's survivors: row r continues the
        hypothesis of row rows_R[r], a row of the same sentence (decoding/state.py's Decoder.reorder).

        With a beam lineage (ops/attention.py) the cached keys and values stay where they were written and only the
        lineage and the write index follow the beams; without one, every row moves. Only for a context with a row
        per sentence of several beams: with a context tiled to every row, `decode` reads each row's own slots.
        """
        if "lineage" not in cache:
            return jax.tree.map(lambda x: jnp.take(x, rows_R, axis=0), cache)
        return {**cache, "index": cache["index"][rows_R], "lineage": cache["lineage"][rows_R]}

    def grow_cache(self, cache: Cache, max_len: int) -> Cache:
        """`cache` with room for max_len target tokens (at least its own), the tokens decoded so far kept: a step
        reads only as many slots as the longest output may have reached (decoding/state.py's cache stages)."""
        self._check_positions(max_len, "decoding")
        grown = {**cache, "self": [grow_self_cache(c, max_len) for c in cache["self"]]}
        if "lineage" in cache:
            grown["lineage"] = jnp.pad(cache["lineage"], [(0, 0), (0, max_len - cache["lineage"].shape[1])])
        return grown

    def grow_source(self, cache: Cache, src_len: int) -> Cache:
        """`cache` with room for sources of src_len tokens (at least its own): the new positions are padding
        (segment id 0, never attended), so that sentences with longer sources can join a running batch."""
        extra = src_len - cache["src_segment_ids"].shape[1]
        if extra < 0:
            raise ValueError(f"cannot shrink a cache of {cache['src_segment_ids'].shape[1]} source positions")
        return {
            **cache,
            "src_segment_ids": jnp.pad(cache["src_segment_ids"], [(0, 0), (0, extra)]),
            "cross": [{name: grow_slots(kv, src_len) for name, kv in c.items()} for c in cache["cross"]],
        }

    def __call__(
        self,
        src_tokens: Array,
        tgt_in: Array,
        *,
        src_segment_ids: Array | None = None,
        tgt_segment_ids: Array | None = None,
        src_positions: Array | None = None,
        tgt_positions: Array | None = None,
    ) -> Array:
        """Teacher-forced logits [B, T, V] for a (possibly packed) batch."""
        src_segment_ids, src_positions = self._defaults(src_tokens, src_segment_ids, src_positions)
        memory = self.encode(src_tokens, src_segment_ids, src_positions)
        return self.decode(
            memory,
            tgt_in,
            src_segment_ids=src_segment_ids,
            tgt_segment_ids=tgt_segment_ids,
            tgt_positions=tgt_positions,
        )


def _source_segment_ids(src_tokens: Array | None, src_segment_ids: Array | None, pad_id: int, caller: str) -> Array:
    """The source's segment ids as given, or derived from its tokens; never all ones by default, which would let
    cross-attention read the memory of padding."""
    if src_segment_ids is not None:
        return src_segment_ids
    if src_tokens is None:
        raise ValueError(f"{caller} needs src_segment_ids or src_tokens, to mask the source's padding")
    return unpacked_segment_ids(src_tokens, pad_id)


def capture_intermediates(model: Transformer, enabled: bool = True) -> None:
    """Makes the model sow, as nnx.Intermediate, what transformer_jax.explain shows: the embedding terms,
    every attention's Q, K, V, weights, head outputs and output, every norm's input and output, the FFN's hidden
    activations; collect them by running the model under `nnx.capture(fn, nnx.Intermediate)`. Off (the default),
    nothing is sown and the model traces exactly as before."""
    for _, module in nnx.iter_modules(model):
        if hasattr(module, "capture_intermediates"):
            module.capture_intermediates = enabled
        if isinstance(module, MultiHeadAttention):
            module.capture_weights = enabled


def capture_attention_weights(model: Transformer, enabled: bool = True) -> None:
    """Makes every attention module sow its weights as nnx.Intermediate 'attention_weights', collected by running
    the model under `nnx.capture(fn, nnx.Intermediate)`."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, MultiHeadAttention):
            module.capture_weights = enabled


def build_model(config: ml_collections.ConfigDict, *, rngs: nnx.Rngs) -> Transformer:
    """The Transformer described by a full config (groups `model` and `attention`), validated."""
    return Transformer(TransformerSpec.from_config(config), rngs=rngs)


def model_rngs(seed: int) -> nnx.Rngs:
    """The random streams every model is built with, in training and for evaluation alike.

    Separate streams: parameter init and dropout draw from different keys of the same seed. Dropout masks come from
    a counter hash (model/layers.py: dropout) that draws only two words per call from this key, so the key's impl costs
    nothing; it stays "rbg" because the key is part of every checkpoint and another impl has another shape. The
    streams are part of the model's graph and state, so a model built otherwise (for evaluation) would compile
    other decoding programs than the ones validation BLEU saved during training (docs/compilation.md).
    """
    return nnx.Rngs(params=seed, dropout=jax.random.key(seed + 1, impl="rbg"))


def parameter_count(config: ml_collections.ConfigDict) -> int:
    """The config's model's number of parameters, from shapes only (nothing allocated)."""
    return _parameter_count(TransformerSpec.from_config(config))


@functools.lru_cache(maxsize=64)
def _parameter_count(spec: TransformerSpec) -> int:
    # Kept per spec, which is all that shapes the model: tracing the initialisers of a big model takes about a second,
    # and a sweep counts every variant, many of one spec.
    model = nnx.eval_shape(lambda: Transformer(spec, rngs=model_rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
