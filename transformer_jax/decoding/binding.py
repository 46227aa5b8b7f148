"""The Transformer behind the decode-step interface (state.Decoder): the decode step over the model's cache.

Axis letters: see transformer_jax/__init__.py (B sentences, W beams per sentence, R = B W cache rows, S source
positions, L output slots).

The model's decoding cache splits in two (`split_cache`): the context, fixed per sentence (the source's segment
ids and the cross-attention keys/values), one row per sentence and closed over by the decode step (the model's
cross-attention reads it with the W queries of a sentence's beams together); and what changes per step (the
per-row write index, the self-attention keys/values and the beam lineage), which the search carries and beam search
reorders (`model.reorder_cache`: only the index and the lineage move, ops/attention.py lineage_attention).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax.decoding.state import Decoder, DecodeStep, cache_stages, tile_beams

Array = jax.Array
PyTree = Any


def split_cache(full: PyTree) -> tuple[PyTree, PyTree]:
    """The model's decoding cache as (context, cache), both with B rows: what stays fixed per sentence (the source's
    segment ids and the cross-attention keys/values), and what changes per step (everything else: the write index, the
    self-attention keys/values, the beam lineage; beam search tiles it to R rows).

    The context is not tiled over the beams: a step's cross-attention reads each sentence's keys and values once
    for its W beams (model/transformer.py, DecoderLayer), W times less than tiled rows would read (measured in
    docs/benchmarks.md)."""
    fixed = ("src_segment_ids", "cross")
    return {k: full[k] for k in fixed}, {k: x for k, x in full.items() if k not in fixed}


def context_step(model: nnx.Module, context: PyTree) -> DecodeStep:
    """model.decode as a decode step over the per-step cache, the fixed context closed over.

    The context is the same for every beam of a sentence, so closing over it (instead of carrying it through the
    loop) spares the beam search reordering it every step; it has a row per sentence (`split_cache`)."""

    def decode_step(tokens_R1: Array, cache: PyTree) -> tuple[Array, PyTree]:
        logits_R1V, new = model.decode(None, tokens_R1, cache={**context, **cache})
        return logits_R1V, {k: new[k] for k in cache}

    return decode_step


def cached_decode_step(
    model: nnx.Module, memory_BSD: Array, src_segment_ids_BS: Array, *, beam_size: int, max_steps: int
) -> Decoder:
    """A Decoder over `model.decode` with a KV cache that grows in stages; for use inside a traced function.

    The cross-attention keys/values are projected once per sentence (`init_cache`), a row per sentence for all its
    beams (`split_cache`). The returned cache holds what changes per step, with B rows (the search tiles them), and
    room for the first stage's steps.
    """
    del beam_size  # recompute_decode_step's signature: the context has a row per sentence, the search tiles the cache
    full = model.init_cache(memory_BSD, src_segment_ids_BS, cache_stages(max_steps)[0])
    context, cache = split_cache(full)
    return Decoder(context_step(model, context), cache, model.grow_cache, model.reorder_cache)


def recompute_decode_step(
    model: nnx.Module, memory_BSD: Array, src_segment_ids_BS: Array, *, beam_size: int, max_steps: int
) -> Decoder:
    """A Decoder without a KV cache: each step runs `model.decode` on the whole target prefix again.

    The cache is only the token buffer [B, max_steps] and its write index; positions after the index are hidden by
    the causal mask, so the logits at the index are those of the prefix. Used as the reference and the benchmark
    baseline of the cached step.
    """
    memory_RSD, src_seg_RS = tile_beams((memory_BSD, src_segment_ids_BS), beam_size)
    batch = memory_BSD.shape[0]
    cache = {"index": jnp.zeros((), jnp.int32), "tokens": jnp.zeros((batch, max_steps), jnp.int32)}

    def decode_step(tokens_R1: Array, cache: PyTree) -> tuple[Array, PyTree]:
        index = cache["index"]
        tokens_RL = jax.lax.dynamic_update_slice_in_dim(cache["tokens"], tokens_R1, index, axis=1)
        # Every slot is a real target position here (even a generated PAD), so the segment ids are all ones.
        logits_RLV = model.decode(
            memory_RSD, tokens_RL, src_segment_ids=src_seg_RS, tgt_segment_ids=jnp.ones_like(tokens_RL)
        )
        logits_R1V = jax.lax.dynamic_slice_in_dim(logits_RLV, index, 1, axis=1)
        return logits_R1V, {"index": index + 1, "tokens": tokens_RL}

    return Decoder(decode_step, cache)
