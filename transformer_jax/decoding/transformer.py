"""The Transformer behind the decode-step interface, and `Searcher`, the search bound to a model's parameters.

Axis letters: see transformer_jax/__init__.py (B sentences, W beams per sentence, R = B W cache rows, K sentences
joining or kept, S source positions, L output slots).

The model's decoding cache splits in two (`_split_cache`): the context, fixed per sentence (the source's segment
ids and the cross-attention keys/values), one row per sentence and closed over by the decode step (the model's
cross-attention reads it with the W queries of a sentence's beams together); and what changes per step (the
per-row write index, the self-attention keys/values and the beam lineage), which the search carries and beam search
reorders (`model.reorder_cache`: only the index and the lineage move, ops/attention.py lineage_attention).

`Searcher` runs a batch either as one jitted call (`_search`) or through the refilling scheduler (refill.py), whose
calls (`ModelCalls`) are the jitted functions below with the model's graph (`Graph`) as a static argument.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax.decoding import refill
from transformer_jax.decoding.sampling import Sampling
from transformer_jax.decoding.search import (
    GNMT,
    BeamResult,
    Decoder,
    DecodeStep,
    GreedyState,
    beam_rows,
    beam_search,
    best_first,
    cache_stages,
    gather_rows,
    greedy_search,
    length_penalty,
    steps_until,
    tile_beams,
)
from transformer_jax.decoding.set_aside import IN_BEAM, SetAsideState, pool_size, set_aside_search, start_state
from transformer_jax.model.transformer import unpacked_segment_ids

Array = jax.Array
PyTree = Any


def _split_cache(full: PyTree) -> tuple[PyTree, PyTree]:
    """The model's decoding cache as (context, cache), both with B rows: what stays fixed per sentence (the source's
    segment ids and the cross-attention keys/values), and what changes per step (everything else: the write index, the
    self-attention keys/values, the beam lineage; beam search tiles it to R rows).

    The context is not tiled over the beams: a step's cross-attention reads each sentence's keys and values once
    for its W beams (model/transformer.py, DecoderLayer), W times less than tiled rows would read (measured in
    docs/benchmarks.md)."""
    fixed = ("src_segment_ids", "cross")
    return {k: full[k] for k in fixed}, {k: x for k, x in full.items() if k not in fixed}


def _context_step(model: nnx.Module, context: PyTree) -> DecodeStep:
    """model.decode as a decode step over the per-step cache, the fixed context closed over.

    The context is the same for every beam of a sentence, so closing over it (instead of carrying it through the
    loop) spares the beam search reordering it every step; it has a row per sentence (`_split_cache`)."""

    def decode_step(tokens_R1: Array, cache: PyTree) -> tuple[Array, PyTree]:
        logits_R1V, new = model.decode(None, tokens_R1, cache={**context, **cache})
        return logits_R1V, {k: new[k] for k in cache}

    return decode_step


def cached_decode_step(
    model: nnx.Module, memory_BSD: Array, src_segment_ids_BS: Array, *, beam_size: int, max_steps: int
) -> Decoder:
    """A Decoder over `model.decode` with a KV cache that grows in stages; for use inside a traced function.

    The cross-attention keys/values are projected once per sentence (`init_cache`), a row per sentence for all its
    beams (`_split_cache`). The returned cache holds what changes per step, with B rows (the search tiles them), and
    room for the first stage's steps.
    """
    del beam_size  # recompute_decode_step's signature: the context has a row per sentence, the search tiles the cache
    full = model.init_cache(memory_BSD, src_segment_ids_BS, cache_stages(max_steps)[0])
    context, cache = _split_cache(full)
    return Decoder(_context_step(model, context), cache, model.grow_cache, model.reorder_cache)


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


def _row_rules(row_inputs: dict[str, Array], sampling: Sampling | None):
    """(target prefixes or None, the token choice or None: argmax) from the rows' own inputs."""
    choose = None if sampling is None else sampling.chooser(row_inputs["keys"])
    return row_inputs.get("prefix"), choose


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "beam_size", "max_steps", "use_cache", "penalty", "settle", "sampling", "pool"),
)
def _search(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    src_BS: Array,
    max_len_B: Array,
    alpha: Array,
    row_inputs: dict[str, Array],
    *,
    beam_size: int,
    max_steps: int,
    use_cache: bool,
    penalty: str,
    settle: int,
    sampling: Sampling | None,
    pool: int,
) -> BeamResult:
    """The whole search in one jitted call, every sentence's rows to the end (the reference of the refilling one);
    pool > 0: the set-aside search keeping that many hypotheses (set_aside.py)."""
    model = nnx.merge(graphdef, state)
    src_segment_ids_BS = unpacked_segment_ids(src_BS)
    memory_BSD = model.encode(src_BS, src_segment_ids_BS)
    make = cached_decode_step if use_cache else recompute_decode_step
    d = make(model, memory_BSD, src_segment_ids_BS, beam_size=beam_size, max_steps=max_steps)
    if beam_size == 1:
        prefix_BP, choose = _row_rules(row_inputs, sampling)
        g = greedy_search(
            d.step, d.cache, max_len_B, max_steps=max_steps, grow=d.grow, prefix_BP=prefix_BP, choose=choose
        )
        return best_first(g.tokens[:, None], g.log_probs[:, None], g.lengths[:, None], alpha, penalty)
    if pool:
        return set_aside_search(
            d.step,
            d.cache,
            max_len_B,
            beam_size=beam_size,
            hypotheses=pool,
            alpha=alpha,
            max_steps=max_steps,
            grow=d.grow,
            penalty=penalty,
            prefix_BP=row_inputs.get("prefix"),
            reorder=d.reorder,
        )
    return beam_search(
        d.step,
        d.cache,
        max_len_B,
        beam_size=beam_size,
        alpha=alpha,
        max_steps=max_steps,
        grow=d.grow,
        settle=settle,
        penalty=penalty,
        prefix_BP=row_inputs.get("prefix"),
        reorder=d.reorder,
    )


# -- the refilling scheduler's calls on the model (refill.Calls) --------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Graph:
    """A model's graph and its parameters' tree structure: the static argument of the jitted calls below.

    jit hashes and compares its static arguments on every call, and a GraphDef is slow to hash, while the
    scheduler makes a few hundred calls per translation. A Graph hashes by identity, and `graph()` gives one per
    (graphdef, treedef), so the calls compile once per model structure. The parameters travel as a list of leaves,
    which jit flattens faster than an nnx.State.
    """

    graphdef: nnx.GraphDef
    treedef: jax.tree_util.PyTreeDef

    def merge(self, params: list[Array]) -> nnx.Module:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, params))


@functools.lru_cache(maxsize=8)
def graph(graphdef: nnx.GraphDef, treedef: jax.tree_util.PyTreeDef) -> Graph:
    """The one Graph of this model structure (see Graph)."""
    return Graph(graphdef, treedef)


@functools.partial(jax.jit, static_argnames=("graph", "beam_size", "slots", "pool"))
def _start(params: list[Array], src_BS: Array, *, graph: Graph, beam_size: int, slots: int, pool: int):
    """Encodes the batch; the fixed context (B rows) and the search's first state, with `slots` slots (pool > 0:
    a set-aside beam search's, set_aside.py)."""
    model = graph.merge(params)
    seg_BS = unpacked_segment_ids(src_BS)
    context, cache = _split_cache(model.init_cache(model.encode(src_BS, seg_BS), seg_BS, slots))
    batch = src_BS.shape[0]
    if beam_size == 1:
        return context, GreedyState.start(cache, batch, slots)
    return context, start_state(cache, batch, beam_size, slots, pool)


@functools.partial(jax.jit, static_argnames=("graph",))
def _encode(params: list[Array], src_BS: Array, *, graph: Graph) -> PyTree:
    """The fixed context of the sentences src_BS (cross-attention keys/values, source segment ids), B rows."""
    model = graph.merge(params)
    seg_BS = unpacked_segment_ids(src_BS)
    return _split_cache(model.init_cache(model.encode(src_BS, seg_BS), seg_BS, 0))[0]


@functools.partial(jax.jit, static_argnames=("beam_size",), donate_argnums=(0, 1))
def _insert(context: PyTree, s, block: PyTree, first: Array, rows_K: Array, *, beam_size: int):
    """The sentences first, first + 1, ... of an encoded block (its context) take the rows rows_K of the running
    batch, one each (a row past the batch's end: that sentence is not taken), back at the start.

    The rows' self-attention slots keep the previous sentence's keys and values: a row's slots after its write
    index are hidden by causality, and the new sentence overwrites each before it can attend to it.
    """
    new = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, first, rows_K.shape[0]), block)
    rows_R = beam_rows(rows_K, beam_size)
    context = jax.tree.map(lambda x, n: x.at[rows_K].set(n, mode="drop"), context, new)
    s = s.restart(rows_K)
    return context, s._replace(cache={**s.cache, "index": s.cache["index"].at[rows_R].set(0, mode="drop")})


@functools.partial(jax.jit, static_argnames=("graph", "slots"))
def _grow(params: list[Array], s, *, graph: Graph, slots: int):
    """The state with its cache and output buffer grown to `slots` (a call of its own, so that `_stage` compiles
    for one input shape per cache size)."""
    return s.with_room(slots)._replace(cache=graph.merge(params).grow_cache(s.cache, slots))


@functools.partial(jax.jit, static_argnames=("graph", "src_len"))
def _widen(params: list[Array], context: PyTree, *, graph: Graph, src_len: int) -> PyTree:
    """The context with its sources padded to src_len positions (for longer sentences to join)."""
    return graph.merge(params).grow_source(context, src_len)


@functools.partial(jax.jit, static_argnames=("graph", "penalty", "settle", "sampling"), donate_argnames=("s",))
def _stage(
    params: list[Array],
    context: PyTree,
    s,
    max_len_B: Array,
    alpha: Array,
    stop_live: Array,
    row_inputs: dict[str, Array],
    *,
    graph: Graph,
    penalty: str,
    settle: int,
    sampling: Sampling | None,
):
    """Steps until at most `stop_live` sentences are live or a live one has filled the cache (`steps_until`)."""
    model = graph.merge(params)
    step, reorder = _context_step(model, context), model.reorder_cache
    prefix_BP, choose = _row_rules(row_inputs, sampling)
    if isinstance(s, GreedyState):
        return steps_until(lambda s: s.advance(step, max_len_B, prefix_BP, choose), s, stop_live)
    if isinstance(s, SetAsideState):
        return steps_until(lambda s: s.advance(step, max_len_B, alpha, penalty, prefix_BP, reorder), s, stop_live)
    return steps_until(lambda s: s.advance(step, max_len_B, alpha, settle, penalty, prefix_BP, reorder), s, stop_live)


@functools.partial(jax.jit, static_argnames=("penalty",))
def _outcome(s, alpha: Array, *, penalty: str) -> refill.Outcome:
    """What the host reads of a state after `_stage` (refill.Outcome); s comes without its cache and with an empty
    token buffer, so that this compiles per batch size only."""
    _, log_probs_BW, lengths_BW = s.beams()
    return refill.Outcome(s.sentence_done(), log_probs_BW / length_penalty(lengths_BW, alpha, penalty))


@jax.jit
def _keep(context: PyTree, s, keep_K: Array):
    """The context and state of the sentences keep_K only."""
    return gather_rows(context, keep_K), s.select(keep_K)


@dataclasses.dataclass(frozen=True)
class ModelCalls:
    """refill.Calls on one model: the jitted functions above with its graph and parameters."""

    graph: Graph
    params: list[Array]

    def start(self, src_BS, *, beam_size: int, slots: int, pool: int):
        return _start(self.params, src_BS, graph=self.graph, beam_size=beam_size, slots=slots, pool=pool)

    def encode(self, src_BS):
        return _encode(self.params, src_BS, graph=self.graph)

    def insert(self, context, s, block, first, rows_K, *, beam_size: int):
        return _insert(context, s, block, first, rows_K, beam_size=beam_size)

    def grow(self, s, *, slots: int):
        return _grow(self.params, s, graph=self.graph, slots=slots)

    def widen(self, context, *, src_len: int):
        return _widen(self.params, context, graph=self.graph, src_len=src_len)

    def stage(self, context, s, max_len_B, alpha, stop_live, row_inputs, *, penalty: str, settle: int, sampling=None):
        return _stage(
            self.params,
            context,
            s,
            max_len_B,
            alpha,
            stop_live,
            row_inputs,
            graph=self.graph,
            penalty=penalty,
            settle=settle,
            sampling=sampling,
        )

    def keep(self, context, s, keep_K):
        return _keep(context, s, keep_K)

    def outcome(self, s, alpha, *, penalty: str):
        # The token buffers ([B, L], [B, W, L], a set-aside search's pool [B, N, L]) empty, built on the host: no
        # program.
        empty = {f: np.zeros(getattr(s, f).shape[:-1] + (0,), np.int32) for f in s._fields if "tokens_" in f}
        return _outcome(s._replace(cache=None, **empty), alpha, penalty=penalty)


class Searcher:
    """Search bound to a model's parameters as they are now: split once, then jitted calls.

    nnx.split walks the whole module graph, so translate() makes one Searcher per call. Runs the model in eval mode
    (dropout off) without changing the caller's model; later changes to the model's parameters are not seen.
    """

    def __init__(self, model: nnx.Module, *, use_cache: bool = True, compact: bool = True):
        graphdef, state = nnx.split(model)
        # Key the compilation on the eval-mode graph, so a model in train mode (validation during training) and the
        # same model in eval mode share one compiled search. The copy shares the arrays; the caller's model is
        # unchanged.
        copy = nnx.merge(graphdef, state)
        copy.eval()
        self.graphdef, self.params = nnx.split(copy)
        self.use_cache = use_cache
        leaves, treedef = jax.tree.flatten(self.params)
        self.calls = ModelCalls(graph(self.graphdef, treedef), leaves) if use_cache and compact else None

    def refills(self, rows: int) -> bool:
        """Whether a batch of `rows` sentences runs through the refilling scheduler (else one jitted `_search`)."""
        return self.calls is not None and rows >= 2 * refill.MIN_ROWS

    def peak_programs(
        self,
        rows: int,
        src_len: int,
        max_steps: int,
        *,
        beam_size: int,
        penalty: str,
        settle: int,
        host: jax.sharding.Sharding,
        compile_one: Callable[[str, jax.stages.Traced], jax.stages.Compiled],
    ) -> dict[str, jax.stages.Compiled]:
        """The jitted calls a batch of `rows` sentences of src_len source positions and max_steps output slots makes
        (`sentences`), compiled for ahead-of-time planning, by name: those at the peak of memory, the cache at its
        largest stage. Nothing runs: the model's parameters may be abstract (jax.ShapeDtypeStruct with shardings);
        `host` is the sharding the host's inputs (sources, limits) take; compile_one(name, traced) compiles one.

        The refilling search: "start" (encode the batch, first cache stage), "grow" (into the last stage from the
        one before: an upper bound of the grows), "stage" (the steps at the last stage, the full batch live); one
        jitted call otherwise: "search". Each call's inputs are the previous one's outputs as compiled. (Greedy
        search with sentences waiting also encodes and inserts them: calls on fewer rows than these.)
        """
        src_BS = jax.ShapeDtypeStruct((rows, src_len), jnp.int32, sharding=host)
        max_len_B = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=host)
        scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=host)
        if not self.refills(rows):
            traced = _search.trace(
                self.graphdef,
                self.params,
                src_BS,
                max_len_B,
                scalar(jnp.float32),
                {},
                beam_size=beam_size,
                max_steps=max_steps,
                use_cache=self.use_cache,
                penalty=penalty,
                settle=settle,
                sampling=None,
                pool=0,
            )
            return {"search": compile_one("search", traced)}

        def outputs(traced: jax.stages.Traced, compiled: jax.stages.Compiled) -> PyTree:
            """What a compiled call returns, as the next call's abstract inputs."""
            put = lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
            return jax.tree.map(put, traced.out_info, compiled.output_shardings)

        graph, params, stages = self.calls.graph, self.calls.params, cache_stages(max_steps)
        traced = _start.trace(params, src_BS, graph=graph, beam_size=beam_size, slots=stages[0], pool=0)
        programs = {"start": compile_one("start", traced)}
        context, s = outputs(traced, programs["start"])
        if len(stages) > 1:
            before = _start.trace(params, src_BS, graph=graph, beam_size=beam_size, slots=stages[-2], pool=0).out_info[
                1
            ]
            s = jax.tree.map(lambda x, like: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=like.sharding), before, s)
            traced = _grow.trace(params, s, graph=graph, slots=stages[-1])
            programs["grow"] = compile_one("grow", traced)
            s = outputs(traced, programs["grow"])
        traced = _stage.trace(
            params,
            context,
            s,
            max_len_B,
            scalar(jnp.float32),
            scalar(jnp.int32),
            {},
            graph=graph,
            penalty=penalty,
            settle=settle,
            sampling=None,
        )
        programs["stage"] = compile_one("stage", traced)
        return programs

    def _one_jit(
        self, src_BS, max_len_B, row_inputs, *, beam_size, alpha, max_steps, penalty, settle, sampling, finished
    ):
        return _search(
            self.graphdef,
            self.params,
            jnp.asarray(src_BS, jnp.int32),
            jnp.asarray(max_len_B, jnp.int32),
            jnp.asarray(alpha, jnp.float32),
            {k: jnp.asarray(x) for k, x in row_inputs.items()},
            beam_size=beam_size,
            max_steps=max_steps,
            use_cache=self.use_cache,
            penalty=penalty,
            settle=settle,
            sampling=sampling,
            pool=pool_size(finished, beam_size, settle),
        )

    def __call__(
        self,
        src_BS: Array,
        max_len_B: Array,
        *,
        beam_size: int,
        alpha: float,
        max_steps: int,
        penalty: str = GNMT,
        settle: int = 1,
        prefix_BP: Array | None = None,
        sampling: Sampling | None = None,
        keys_B2: Array | None = None,
        finished: str = IN_BEAM,
    ) -> BeamResult:
        """One batch: src [B, S] (PAD-padded, EOS-terminated); beam_size 1 runs greedy search. Scores are
        log P / lp with lp by `penalty` and `alpha` (search.length_penalty). settle: a sentence stops once its
        `settle` best beams are settled (search.beam_search; the others are as they stood then); 0 runs every beam
        to its end.
        prefix_BP: target prefixes [B, P], PAD-padded (search.forced_tokens): each output starts with its prefix.
        sampling: draw each token (sampling.Sampling; beam_size 1), row b with its key keys_B2[b] (sample_keys).
        finished: what beam search does with a hypothesis that ends (set_aside.FINISHED_RULES): keeps it among its
        beams (`in_beam`), or sets it aside (`set_aside`: CTranslate2's search, returning `settle` hypotheses, or
        beam_size with settle 0).

        Batches of at least 2 MIN_ROWS sentences run the refilling search (nothing waits, so finished sentences
        only leave); smaller ones, or without compaction, the whole search is one jitted call (`_search`).
        """
        settings = _settings(beam_size, alpha, penalty, settle, sampling, finished)
        row_inputs = _row_inputs(prefix_BP, keys_B2)
        if not self.refills(src_BS.shape[0]):
            return self._one_jit(src_BS, max_len_B, row_inputs, **settings, max_steps=max_steps)
        src_BS = np.asarray(src_BS, np.int32)
        found = refill.refilling_search(
            self.calls,
            list(src_BS),
            np.asarray(max_len_B, np.int32),
            **settings,
            row_inputs_N=row_inputs,
            rows=src_BS.shape[0],
            shape=lambda _: src_BS.shape[1:] + (max_steps,),
        )
        return BeamResult(*(np.stack(x) for x in zip(*(_pad_result(r, max_steps) for r in found), strict=True)))

    def sentences(
        self,
        sources: Sequence[Sequence[int]],
        max_len_N: Sequence[int],
        *,
        beam_size: int,
        alpha: float,
        batch_size: int,
        shape: refill.Shape,
        progress: Callable[[int], Any] | None = None,
        penalty: str = GNMT,
        settle: int = 1,
        prefixes: Sequence[Sequence[int]] | None = None,
        sampling: Sampling | None = None,
        keys_N2: np.ndarray | None = None,
        finished: str = IN_BEAM,
    ) -> list[BeamResult]:
        """Every sentence's beams (best first; tokens [W, L] with L at least its longest beam), decoded `batch_size`
        sentences at a time: sources are id lists (EOS-terminated), max_len_N their output limits, and
        shape(longest source) the padded source length and the most output slots of a batch. progress(n) is
        called as n more sentences are done. penalty, settle: as for __call__; prefixes: each sentence's target
        prefix (ids, no EOS; empty: none), or None; sampling, keys_N2: as __call__'s, per sentence; finished: as
        __call__'s.

        With compaction and at least 2 MIN_ROWS rows, they run through the refilling scheduler (refill.py): greedy
        search in one refilled batch, beam search batch by batch (see below); otherwise in consecutive one-jit
        batches. Shortest sources go first. The batch has batch_size rows, or as many as the sentences rounded up
        to a multiple of MIN_ROWS when fewer (refill.batch_rows).
        """
        settings = _settings(beam_size, alpha, penalty, settle, sampling, finished)
        rows = refill.batch_rows(len(sources), batch_size)
        max_len_N = np.asarray(max_len_N, np.int32)
        if not len(sources):
            return []
        order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
        results: list[BeamResult | None] = [None] * len(sources)
        prefix_NP = None if prefixes is None or not any(prefixes) else refill.prefix_array(prefixes)
        row_inputs_N = _row_inputs(prefix_NP, keys_N2)
        if self.refills(rows):
            # Greedy search refills one running batch. Beam search runs batch by batch (finished sentences only
            # leave): it reorders its whole cache every step, and the wider cache a refilled batch keeps (its
            # longest live sentence sets it) costs more than the finished rows it saves (docs/decoding.md).
            for group in [order] if beam_size == 1 else [order[j : j + rows] for j in range(0, len(order), rows)]:
                found = refill.refilling_search(
                    self.calls,
                    [np.asarray(sources[i], np.int32) for i in group],
                    max_len_N[group],
                    **settings,
                    row_inputs_N={k: x[group] for k, x in row_inputs_N.items()},
                    rows=rows,
                    shape=shape,
                    progress=progress,
                )
                for i, r in zip(group, found, strict=True):
                    results[i] = r
            return results
        for j in range(0, len(order), rows):
            batch = order[j : j + rows]
            src_len, max_steps = shape(max(len(sources[i]) for i in batch))
            src_BS = refill.source_batch([sources[i] for i in batch], rows, src_len)
            max_len_B = np.ones((rows,), np.int32)  # a dummy row stops after one step
            max_len_B[: len(batch)] = max_len_N[batch]
            row_inputs = {k: np.zeros((rows, *x.shape[1:]), x.dtype) for k, x in row_inputs_N.items()}  # 0: PAD
            for k, x in row_inputs_N.items():
                row_inputs[k][: len(batch)] = x[batch]
            found = jax.device_get(self._one_jit(src_BS, max_len_B, row_inputs, **settings, max_steps=max_steps))
            for r, i in enumerate(batch):
                results[i] = BeamResult(*(x[r] for x in found))
            if progress is not None:
                progress(len(batch))
        return results


def _settings(
    beam_size: int, alpha: float, penalty: str, settle: int, sampling: Sampling | None, finished: str
) -> dict:
    if sampling is not None and beam_size != 1:
        raise ValueError(f"sampling draws one token per step: beam_size must be 1, got {beam_size}")
    if not 0 <= settle <= beam_size:
        raise ValueError(f"settle must be in [0, beam_size={beam_size}] (hypotheses settled), got {settle}")
    pool_size(finished, beam_size, settle)  # an unknown rule is refused
    return dict(beam_size=beam_size, alpha=alpha, penalty=penalty, settle=settle, sampling=sampling, finished=finished)


def _row_inputs(prefix: np.ndarray | None, keys: np.ndarray | None) -> dict[str, np.ndarray]:
    """The search's per-sentence inputs that are given (refill.refilling_search's row_inputs_N)."""
    inputs = {} if prefix is None else {"prefix": np.asarray(prefix, np.int32)}
    return inputs if keys is None else {**inputs, "keys": np.asarray(keys, np.uint32)}


def _pad_result(r: BeamResult, slots: int) -> BeamResult:
    """One sentence's beams with tokens padded (PAD) to `slots`."""
    return r._replace(tokens=np.pad(r.tokens, [(0, 0), (0, slots - r.tokens.shape[-1])]))


def searcher(model: nnx.Module, *, use_cache: bool = True, compact: bool = True) -> Searcher:
    """A Searcher for the model (see Searcher)."""
    return Searcher(model, use_cache=use_cache, compact=compact)


def search(
    model: nnx.Module,
    src_BS: Array,
    max_len_B: Array,
    *,
    beam_size: int,
    alpha: float,
    max_steps: int,
    use_cache: bool = True,
    compact: bool = True,
    penalty: str = GNMT,
    settle: int = 1,
    finished: str = IN_BEAM,
) -> BeamResult:
    """Encodes src [B, S] (PAD-padded, EOS-terminated) and searches, jitted; beam_size 1 runs greedy search.

    Compiles per (graph, shapes, beam_size, cache stage, compacted batch size); alpha is traced, so changing it does
    not recompile.
    Runs the model in eval mode (dropout off) without changing the caller's model. For many batches of one model,
    use `searcher`. A sentence stops once its `settle` best hypotheses are settled (beam_search's settle): those
    beams are the full search's; the others are as they stood then (settle=0: every beam is the full search's).
    finished: as for Searcher.__call__.
    """
    return searcher(model, use_cache=use_cache, compact=compact)(
        src_BS,
        max_len_B,
        beam_size=beam_size,
        alpha=alpha,
        max_steps=max_steps,
        penalty=penalty,
        settle=settle,
        finished=finished,
    )
