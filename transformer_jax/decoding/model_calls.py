"""The model calls: the Transformer behind the decode-step interface (state.Decoder), and the jitted calls of a search
on a model: the whole search in one call (`search_batch`), and the refilling scheduler's calls (on a `ModelCalls`).

Axis letters: see transformer_jax/__init__.py (B sentences, W beams per sentence, R = B W cache rows, K sentences
joining or kept, S source positions, L output slots).

The model's decoding cache splits in two (`split_cache`): the context, fixed per sentence and closed over by the
decode step, and what changes per step, which the search carries and beam search reorders (`model.reorder_cache`:
only the index and the lineage move, ops/attention.py lineage_attention).

Every call takes the search spec (specs.py) whole: its `alpha` is traced, its other fields are static, so the
calls compile once per (model structure, kind of search, shapes). The model's graph is a static argument too
(`Graph`), and its parameters travel as a list of leaves.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax.decoding.specs import BeamResult, RowInputs, Search, run_search
from transformer_jax.decoding.state import Decoder, DecodeStep, beam_rows, cache_stages, gather_rows, tile_beams
from transformer_jax.model.layers import SpecialIds
from transformer_jax.model.transformer import unpacked_segment_ids

Array = jax.Array
PyTree = Any


def split_cache(full: PyTree) -> tuple[PyTree, PyTree]:
    """The model's decoding cache as (context, cache), both with B rows: what stays fixed per sentence (the source's
    segment ids and the cross-attention keys/values), and what changes per step (the write index, the self-attention
    keys/values, the beam lineage; beam search tiles it to R rows).

    The context is not tiled over the beams: a step's cross-attention reads each sentence's keys and values once
    for its W beams (model/transformer.py, DecoderLayer), W times less than tiled rows would (docs/benchmarks.md)."""
    fixed = ("src_segment_ids", "cross")
    return {k: full[k] for k in fixed}, {k: x for k, x in full.items() if k not in fixed}


def context_step(model: nnx.Module, context: PyTree) -> DecodeStep:
    """model.decode as a decode step over the per-step cache, the fixed context (a row per sentence) closed over:
    not carried through the loop, beam search need not reorder it every step."""

    def decode_step(tokens_R1: Array, cache: PyTree) -> tuple[Array, PyTree]:
        logits_R1V, new = model.decode(None, tokens_R1, cache={**context, **cache})
        return logits_R1V, {k: new[k] for k in cache}

    return decode_step


def cached_decode_step(
    model: nnx.Module, memory_BSD: Array, src_segment_ids_BS: Array, *, beam_size: int, max_steps: int
) -> Decoder:
    """A Decoder over `model.decode` with a KV cache that grows in stages; for use inside a traced function. The
    cross-attention keys/values are projected once, a row per sentence (`split_cache`); the returned cache holds what
    changes per step, with B rows (the search tiles them), and room for the first stage's steps."""
    del beam_size  # recompute_decode_step's signature: the context has a row per sentence, the search tiles the cache
    full = model.init_cache(memory_BSD, src_segment_ids_BS, cache_stages(max_steps)[0])
    context, cache = split_cache(full)
    return Decoder(context_step(model, context), cache, model.grow_cache, model.reorder_cache)


def recompute_decode_step(
    model: nnx.Module, memory_BSD: Array, src_segment_ids_BS: Array, *, beam_size: int, max_steps: int
) -> Decoder:
    """A Decoder without a KV cache, the reference and benchmark baseline of the cached one: each step runs
    `model.decode` on the whole target prefix again. The cache is the token buffer [B, max_steps] and its write
    index; the causal mask hides the positions after the index."""
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


@functools.partial(jax.jit, static_argnames=("graphdef", "max_steps", "use_cache"))
def search_batch(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    src_BS: Array,
    max_len_B: Array,
    row_inputs: RowInputs,
    search: Search,
    *,
    max_steps: int,
    use_cache: bool,
) -> BeamResult:
    """The whole search in one jitted call, every sentence's rows to the end (the reference of the refilling one)."""
    model = nnx.merge(graphdef, state)
    src_segment_ids_BS = unpacked_segment_ids(src_BS, model.spec.pad_id)
    memory_BSD = model.encode(src_BS, src_segment_ids_BS)
    make = cached_decode_step if use_cache else recompute_decode_step
    d = make(model, memory_BSD, src_segment_ids_BS, beam_size=search.beam_size, max_steps=max_steps)
    return run_search(search, d, max_len_B, max_steps=max_steps, row_inputs=row_inputs)


# -- the refilling scheduler's calls on the model (scheduler.py) --------------------------------------------------


class Outcome(NamedTuple):
    """What the host needs after a stage beyond the state's own arrays, computed on the device (`outcome`): the
    host runs no array operation of its own (each would be a small program per batch size, in every process)."""

    done_B: Any  # bool: the sentence is done (state.sentence_done())
    scores_BW: Any  # float32: its beams' log_probs / length_penalty(lengths)


@dataclasses.dataclass(frozen=True, eq=False)
class Graph:
    """A model's graph and its parameters' tree structure: the static argument of the jitted calls below.

    jit hashes its static arguments on every call, a GraphDef is slow to hash, and the scheduler makes a few hundred
    calls per translation: a Graph hashes by identity, and `graph()` gives one per (graphdef, treedef). The
    parameters travel as a list of leaves, which jit flattens faster than an nnx.State.
    """

    graphdef: nnx.GraphDef
    treedef: jax.tree_util.PyTreeDef

    def merge(self, params: list[Array]) -> nnx.Module:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, params))


@functools.lru_cache(maxsize=8)
def graph(graphdef: nnx.GraphDef, treedef: jax.tree_util.PyTreeDef) -> Graph:
    """The one Graph of this model structure (see Graph)."""
    return Graph(graphdef, treedef)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelCalls:
    """One model as the refilling scheduler's jitted calls below take it: a pytree of its parameters (the leaves) and
    its Graph (static)."""

    graph: Graph = dataclasses.field(metadata=dict(static=True))
    params: list[Array]

    def merge(self) -> nnx.Module:
        return self.graph.merge(self.params)


@functools.partial(jax.jit, static_argnames="slots")
def start(calls: ModelCalls, src_BS: Array, search: Search, *, slots: int):
    """Encodes the batch; the fixed context (B rows) and the search's first state, with `slots` slots."""
    model = calls.merge()
    seg_BS = unpacked_segment_ids(src_BS, model.spec.pad_id)
    context, cache = split_cache(model.init_cache(model.encode(src_BS, seg_BS), seg_BS, slots))
    return context, search.start(cache, src_BS.shape[0], slots)


@jax.jit
def encode(calls: ModelCalls, src_BS: Array) -> PyTree:
    """The fixed context of the sentences src_BS (cross-attention keys/values, source segment ids), B rows."""
    model = calls.merge()
    seg_BS = unpacked_segment_ids(src_BS, model.spec.pad_id)
    return split_cache(model.init_cache(model.encode(src_BS, seg_BS), seg_BS, 0))[0]


@functools.partial(jax.jit, static_argnames=("beam_size", "ids"), donate_argnums=(0, 1))
def insert(context: PyTree, s, block: PyTree, first: Array, rows_K: Array, *, beam_size: int, ids: SpecialIds):
    """The sentences first, first + 1, ... of an encoded block (its context) take the rows rows_K of the running
    batch, one each (a row past the batch's end: that sentence is not taken), back at the start.

    The rows' self-attention slots keep the previous sentence's keys and values: a row's slots after its write
    index are hidden by causality, and the new sentence overwrites each before it can attend to it.
    """
    new = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, first, rows_K.shape[0]), block)
    rows_R = beam_rows(rows_K, beam_size)
    context = jax.tree.map(lambda x, n: x.at[rows_K].set(n, mode="drop"), context, new)
    s = s.restart(rows_K, ids)
    return context, s._replace(cache={**s.cache, "index": s.cache["index"].at[rows_R].set(0, mode="drop")})


@functools.partial(jax.jit, static_argnames=("slots", "ids"))
def grow(calls: ModelCalls, s, *, slots: int, ids: SpecialIds):
    """The state with its cache and output buffer grown to `slots` (a call of its own, so that `stage` compiles
    for one input shape per cache size)."""
    return s.with_room(slots, ids)._replace(cache=calls.merge().grow_cache(s.cache, slots))


@functools.partial(jax.jit, static_argnames="src_len")
def widen(calls: ModelCalls, context: PyTree, *, src_len: int) -> PyTree:
    """The context with its sources padded to src_len positions (for longer sentences to join)."""
    return calls.merge().grow_source(context, src_len)


@functools.partial(jax.jit, donate_argnames="s")
def stage(
    calls: ModelCalls, context: PyTree, s, max_len_B: Array, stop_live: Array, row_inputs: RowInputs, search: Search
):
    """Steps until at most `stop_live` sentences are live or a live one has filled the state's slots: the host acts
    there (stop_live is traced: one compilation)."""
    model = calls.merge()
    step, reorder = context_step(model, context), model.reorder_cache
    slots = s.beams()[0].shape[-1]

    def go_on(s: NamedTuple) -> Array:
        live_B = ~s.sentence_done()
        return (jnp.sum(live_B) > stop_live) & (jnp.max(jnp.where(live_B, s.step_B, 0)) < slots)

    return jax.lax.while_loop(go_on, lambda s: search.advance(s, step, max_len_B, row_inputs, reorder), s)


def read_outcome(s, search: Search) -> Outcome:
    """What the host reads of a state after `stage` (Outcome), computed by `outcome` without the state's cache and
    with its token buffers ([B, L], [B, W, L], a set-aside search's pool [B, N, L]) empty, built on the host: the
    program compiles per batch size only."""
    empty = {f: np.zeros(getattr(s, f).shape[:-1] + (0,), np.int32) for f in s._fields if "tokens_" in f}
    return outcome(s._replace(cache=None, **empty), search)


@jax.jit
def outcome(s, search: Search) -> Outcome:
    return Outcome(s.sentence_done(), search.scores(s))


@jax.jit
def keep(context: PyTree, s, keep_K: Array):
    """The context and state of the sentences keep_K only."""
    return gather_rows(context, keep_K), s.select(keep_K)
