"""The scheduler: `Searcher`, a search spec (specs.py) run over a model's parameters, one batch or a list of
sentences, and the host-side refilling scheduler it runs them through: finished sentences leave the running batch
and waiting ones take their rows.

Axis letters: see transformer_jax/__init__.py (B sentences of a batch, N sentences of a list, R rows of the running
batch, one sentence each, here; K sentences joining or kept; S source positions; P prefix positions).

A batch runs either as one jitted call (model_calls.search_batch) or through the refilling scheduler
(`refilling_search`), whose calls on the model are model_calls' (on a ModelCalls); it reads only the spec's `beam_size`.

A step costs the same for a finished sentence's rows as for a live one's, and outputs differ in length (on
Multi30k test2016, greedy in batches of 64, more than half of the row-steps went to finished sentences). So the
search runs in jitted calls (`model_calls.stage`) that step until the host has something to do: MIN_ROWS rows are free
while sentences wait, or (nothing waiting) the live sentences fit in a batch half the size, or a live one has filled
the cache. Between calls the host gives finished sentences' rows to waiting ones (shortest sources first, joining
`refill_size` at a time), or moves the live sentences into a smaller batch (`compacted_size`), or grows the cache to
its next stage. Each sentence decodes at its own position (the search's step_B, the cache's per-row index), and the
stop condition is traced, so the calls compile per (rows, source length, cache stage) only. Results equal the one-jit
search's: a sentence's rows never interact with another's.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax.decoding import model_calls
from transformer_jax.decoding.specs import BeamResult, Search
from transformer_jax.decoding.state import cache_stages
from transformer_jax.model.layers import SpecialIds

Array = jax.Array
PyTree = Any

Shape = Callable[[int], tuple[int, int]]  # longest source of a batch -> (padded source length, most output slots)

MIN_ROWS = 8  # sentences: a step over fewer costs about the same (reading the weights dominates it)
# A batch of at most this many sentences (whatever its beam size) grows its cache to the last stage at once, trading
# longer cache reads in a few small steps for the compilations of the stages between (measured for beam 4 in
# docs/compilation.md, "Fewer decoding programs").
FULL_CACHE_SENTENCES = 32
# Waiting sentences are encoded with their sources padded to a multiple of this (then padded to the running batch's
# source length, one of translate()'s few), so the encoder reads fewer padding tokens, for an encoder compilation
# per length.
ENCODE_MULTIPLE = 8


class Searcher:
    """Search bound to a model's parameters as they are now: split once, then jitted calls.

    nnx.split walks the whole module graph, so translate() makes one Searcher per call. Runs the model in eval mode
    (dropout off) without changing the caller's model; later changes to the model's parameters are not seen.
    """

    def __init__(
        self, model: nnx.Module, *, use_cache: bool = True, compact: bool = True, languages: Sequence[int] = ()
    ):
        graphdef, state = nnx.split(model)
        # Key the compilation on the eval-mode graph, so a model in train mode (validation during training) and the
        # same model in eval mode share one compiled search. The copy shares the arrays; the caller's model is
        # unchanged.
        copy = nnx.merge(graphdef, state)
        copy.eval()
        self.graphdef, self.params = nnx.split(copy)
        self.use_cache = use_cache
        # Every search runs with the model's reserved ids (Search.with_ids); `languages`: its language tokens, which
        # the search emits only where a target prefix forces them (state.choosable).
        self.ids = dataclasses.replace(SpecialIds.of(model.spec), languages=tuple(sorted(map(int, languages))))
        leaves, treedef = jax.tree.flatten(self.params)
        graph = model_calls.graph(self.graphdef, treedef)
        self.calls = model_calls.ModelCalls(graph, leaves) if use_cache and compact else None

    def refills(self, rows: int) -> bool:
        """Whether a batch of `rows` sentences runs through the refilling scheduler (else one jitted call)."""
        return self.calls is not None and rows >= 2 * MIN_ROWS

    def peak_programs(
        self,
        rows: int,
        src_len: int,
        max_steps: int,
        search: Search,
        *,
        host: jax.sharding.Sharding,
        compile_one: Callable[[str, jax.stages.Traced], jax.stages.Compiled],
    ) -> dict[str, jax.stages.Compiled]:
        """The jitted calls a batch of `rows` sentences of src_len source positions and max_steps output slots makes
        (`sentences`), compiled for ahead-of-time planning, by name: those at the peak of memory, the cache at its
        largest stage. Nothing runs: the model's parameters may be abstract (jax.ShapeDtypeStruct with shardings);
        `host` is the sharding the host's inputs (sources, limits) take; compile_one(name, traced) compiles one.
        The search may not need per-row inputs (`Search.needs`).

        The refilling search: "start" (encode the batch, first cache stage), "grow" (into the last stage from the
        one before: an upper bound of the grows), "stage" (the steps at the last stage, the full batch live); one
        jitted call otherwise: "search". Each call's inputs are the previous one's outputs as compiled. (Greedy
        search with sentences waiting also encodes and inserts them: calls on fewer rows than these.)
        """
        src_BS = jax.ShapeDtypeStruct((rows, src_len), jnp.int32, sharding=host)
        max_len_B = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=host)
        # The spec's leaves (alpha; a sampling seed) as the Python scalars they are at run time: weakly typed.
        leaf = lambda x: jax.ShapeDtypeStruct(
            (), jax.dtypes.canonicalize_dtype(np.result_type(x)), sharding=host, weak_type=True
        )
        search = jax.tree.map(leaf, search.with_ids(self.ids))
        if not self.refills(rows):
            traced = model_calls.search_batch.trace(
                self.graphdef, self.params, src_BS, max_len_B, {}, search, max_steps=max_steps, use_cache=self.use_cache
            )
            return {"search": compile_one("search", traced)}

        def outputs(traced: jax.stages.Traced, compiled: jax.stages.Compiled) -> PyTree:
            """What a compiled call returns, as the next call's abstract inputs."""
            put = lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
            return jax.tree.map(put, traced.out_info, compiled.output_shardings)

        calls, stages = self.calls, cache_stages(max_steps)
        traced = model_calls.start.trace(calls, src_BS, search, slots=stages[0])
        programs = {"start": compile_one("start", traced)}
        context, s = outputs(traced, programs["start"])
        if len(stages) > 1:
            before = model_calls.start.trace(calls, src_BS, search, slots=stages[-2]).out_info[1]
            s = jax.tree.map(lambda x, like: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=like.sharding), before, s)
            traced = model_calls.grow.trace(calls, s, slots=stages[-1], ids=self.ids)
            programs["grow"] = compile_one("grow", traced)
            s = outputs(traced, programs["grow"])
        stop_live = jax.ShapeDtypeStruct((), jnp.int32, sharding=host)
        traced = model_calls.stage.trace(calls, context, s, max_len_B, stop_live, {}, search)
        programs["stage"] = compile_one("stage", traced)
        return programs

    def _one_jit(self, src_BS, max_len_B, row_inputs: dict[str, np.ndarray], search: Search, max_steps: int):
        return model_calls.search_batch(
            self.graphdef,
            self.params,
            jnp.asarray(src_BS, jnp.int32),
            jnp.asarray(max_len_B, jnp.int32),
            {k: jnp.asarray(x) for k, x in row_inputs.items()},
            search,
            max_steps=max_steps,
            use_cache=self.use_cache,
        )

    def __call__(
        self,
        src_BS: Array,
        max_len_B: Array,
        search: Search,
        *,
        max_steps: int,
        prefix_BP: Array | None = None,
        row_inputs: dict[str, Array] | None = None,
    ) -> BeamResult:
        """One batch: src [B, S] (PAD-padded, EOS-terminated), searched by `search` (specs.py); each sentence's
        hypotheses best first, scored log P / lp (state.length_penalty).
        prefix_BP: target prefixes [B, P], PAD-padded (state.forced_tokens): each output starts with its prefix.
        row_inputs: the per-row inputs the search needs (`Search.needs`, e.g. sampling keys: Search.row_inputs).
        Runs through the refilling scheduler where `refills`, else as one jitted call.
        """
        search = search.with_ids(self.ids)
        row_inputs = _row_inputs(search, prefix_BP, row_inputs)
        if not self.refills(src_BS.shape[0]):
            return self._one_jit(src_BS, max_len_B, row_inputs, search, max_steps)
        src_BS = np.asarray(src_BS, np.int32)
        found = refilling_search(
            self.calls,
            list(src_BS),
            np.asarray(max_len_B, np.int32),
            search,
            row_inputs_N=row_inputs,
            rows=src_BS.shape[0],
            shape=lambda _: src_BS.shape[1:] + (max_steps,),
        )
        return BeamResult(
            *(np.stack(x) for x in zip(*(_pad_result(r, max_steps, self.ids.pad) for r in found), strict=True))
        )

    def sentences(
        self,
        sources: Sequence[Sequence[int]],
        max_len_N: Sequence[int],
        search: Search,
        *,
        batch_size: int,
        shape: Shape,
        progress: Callable[[int], Any] | None = None,
        prefixes: Sequence[Sequence[int]] | None = None,
        row_inputs_N: dict[str, np.ndarray] | None = None,
    ) -> list[BeamResult]:
        """Every sentence's hypotheses by `search` (best first; tokens [W, L] with L at least its longest), decoded
        `batch_size` sentences at a time: sources are id lists (EOS-terminated), max_len_N their output limits, and
        shape(longest source) the padded source length and the most output slots of a batch. progress(n) is
        called as n more sentences are done. prefixes: each sentence's target prefix (ids, no EOS; empty: none), or
        None; row_inputs_N: as __call__'s row_inputs, per sentence.

        Shortest sources first, in batches of `batch_rows` rows: through the refilling scheduler where `refills`
        (in one refilled batch, or batch by batch: `Search.refills_one_batch`), else in one-jit batches.
        """
        search = search.with_ids(self.ids)
        rows = batch_rows(len(sources), batch_size)
        max_len_N = np.asarray(max_len_N, np.int32)
        prefix_NP = None if prefixes is None or not any(prefixes) else prefix_array(prefixes, self.ids)
        row_inputs_N = _row_inputs(search, prefix_NP, row_inputs_N)
        if not len(sources):
            return []
        order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
        results: list[BeamResult | None] = [None] * len(sources)
        if self.refills(rows):
            groups = [order] if search.refills_one_batch else [order[j : j + rows] for j in range(0, len(order), rows)]
            for group in groups:
                found = refilling_search(
                    self.calls,
                    [np.asarray(sources[i], np.int32) for i in group],
                    max_len_N[group],
                    search,
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
            src_BS = source_batch([sources[i] for i in batch], rows, src_len, self.ids)
            max_len_B = np.ones((rows,), np.int32)  # a dummy row stops after one step
            max_len_B[: len(batch)] = max_len_N[batch]
            row_inputs = empty_row_inputs(row_inputs_N, rows, self.ids)
            for k, x in row_inputs_N.items():
                row_inputs[k][: len(batch)] = x[batch]
            found = jax.device_get(self._one_jit(src_BS, max_len_B, row_inputs, search, max_steps))
            for r, i in enumerate(batch):
                results[i] = BeamResult(*(x[r] for x in found))
            if progress is not None:
                progress(len(batch))
        return results


def _row_inputs(search: Search, prefix: Array | None, given: dict[str, Array] | None) -> dict[str, np.ndarray]:
    """The search's per-row inputs: the target prefixes (if any) and those it needs (ValueError when missing)."""
    given = dict(given or {})
    missing = [k for k in search.needs if k not in given]
    if missing:
        raise ValueError(f"{type(search).__name__} needs the per-row inputs {missing} (its row_inputs())")
    inputs = {k: np.asarray(given[k]) for k in search.needs}
    return inputs if prefix is None else {"prefix": np.asarray(prefix, np.int32), **inputs}


def _pad_result(r: BeamResult, slots: int, pad: int) -> BeamResult:
    """One sentence's beams with tokens padded (PAD) to `slots`."""
    return r._replace(tokens=np.pad(r.tokens, [(0, 0), (0, slots - r.tokens.shape[-1])], constant_values=pad))


# -- the refilling scheduler: finished sentences leave the running batch, waiting ones take their rows -----------------


def compacted_size(live: int, running: int) -> int:
    """Sentences the next call runs, given `live` unfinished ones among the `running` ones (nothing waits).

    The sizes are the running batch halved (rounded up), not below MIN_ROWS, so that each cache stage compiles for
    a few sizes only: the smallest that holds the live sentences.
    """
    size = running
    while -(-size // 2) >= max(live, MIN_ROWS):
        size = -(-size // 2)
    return size


def refill_size(free: int, rows: int) -> int:
    """Waiting sentences that join a running batch of `rows` sentences with `free` rows free: the largest of MIN_ROWS,
    2 MIN_ROWS, 4 MIN_ROWS, ... (at most `rows`) that fits, so that the encoder compiles for a few sizes only; 0
    while fewer than MIN_ROWS rows are free."""
    size = 0
    while (2 * size or MIN_ROWS) <= min(free, rows):
        size = 2 * size or MIN_ROWS
    return size


def batch_rows(sentences: int, batch_size: int) -> int:
    """Rows of the running batch: batch_size, or the sentences rounded up to a multiple of MIN_ROWS when fewer."""
    return min(batch_size, -(-sentences // MIN_ROWS) * MIN_ROWS)


def source_batch(sources: Sequence[Sequence[int]], rows: int, src_len: int, ids: SpecialIds) -> np.ndarray:
    """[rows, src_len] int32: the sources (ids then EOS) PAD-padded, then dummy rows of an empty source (EOS only),
    which decode for one step and are dropped."""
    src_BS = np.full((rows, src_len), ids.pad, np.int32)
    src_BS[:, 0] = ids.eos
    for r, ids in enumerate(sources):
        src_BS[r, : len(ids)] = ids
    return src_BS


def prefix_array(prefixes: Sequence[Sequence[int]], ids: SpecialIds) -> np.ndarray:
    """[N, P] int32: the target prefixes PAD-padded to P, the longest rounded up to a power of two (so that the
    search compiles for a few widths only)."""
    width = 1
    while width < max(map(len, prefixes)):
        width *= 2
    prefix_NP = np.full((len(prefixes), width), ids.pad, np.int32)  # a row of PAD is no prefix
    for i, ids in enumerate(prefixes):
        prefix_NP[i, : len(ids)] = ids
    return prefix_NP


def empty_row_inputs(row_inputs_N: dict[str, np.ndarray], rows: int, ids: SpecialIds) -> dict[str, np.ndarray]:
    """Per-row inputs of `rows` rows without a sentence, shaped as row_inputs_N's: no prefix (PAD), zero keys."""
    return {k: np.full((rows, *x.shape[1:]), ids.pad if k == "prefix" else 0, x.dtype) for k, x in row_inputs_N.items()}


def sorted_beams(tokens_WL: np.ndarray, scores_W: np.ndarray, log_probs_W: np.ndarray, lengths_W: np.ndarray):
    """One sentence's beams best first, as `best_first` sorts them (ties: the lower beam first)."""
    order = np.argsort(-scores_W, kind="stable")
    return BeamResult(tokens_WL[order], scores_W[order], log_probs_W[order], lengths_W[order])


class _Refill:
    """One refilling search: the running batch (device state and the host's view of its rows) and the waiting
    sentences. `run()` is the loop; each method is one thing the host does between calls."""

    def __init__(
        self,
        calls: model_calls.ModelCalls,
        sources: Sequence[np.ndarray],
        max_len_N: np.ndarray,
        search: Search,
        *,
        row_inputs_N: dict[str, np.ndarray],
        rows: int,
        shape: Shape,
        progress: Callable[[int], Any] | None,
    ):
        self.calls, self.sources, self.max_len_N, self.search = calls, sources, max_len_N, search
        self.shape, self.progress = shape, progress
        self.results: list[BeamResult | None] = [None] * len(sources)
        self.queue = collections.deque(sorted(range(len(sources)), key=lambda i: len(sources[i])))
        # The running batch's padded source length and output slots: they grow as longer sources join (`_take`).
        self.src_len, self.max_steps = 0, 0
        # The encoded block of waiting sentences (its ids and context), of which `joined` have joined. It has
        # block_rows rows, a multiple of MIN_ROWS, so that every refill size divides what is left of it.
        self.block_ids: list[int] = []
        self.block: PyTree = None
        self.joined = 0
        self.block_rows = rows - rows % MIN_ROWS
        ids, src_KS = self._take(rows)
        src_KS = np.pad(src_KS, [(0, 0), (0, self.src_len - src_KS.shape[1])], constant_values=search.reserved.pad)
        # The host's view of each row: its sentence (-1: none, finished or dummy), output limit and steps taken.
        self.sentence_R = np.array(ids + [-1] * (rows - len(ids)))
        self.max_len_R = np.ones(rows, np.int32)  # a row without a sentence stops after one step
        self.max_len_R[: len(ids)] = max_len_N[ids]
        self.step_R = np.zeros(rows, np.int32)
        # The sentences' and the rows' own inputs to the search (a row without a sentence: none, e.g. no prefix).
        self.row_inputs_N = row_inputs_N
        self.row_inputs_R = empty_row_inputs(row_inputs_N, rows, search.reserved)
        for k, x in row_inputs_N.items():
            self.row_inputs_R[k][: len(ids)] = x[ids]
        self.slots = cache_stages(self.max_steps)[0]
        self.context, self.state = model_calls.start(calls, src_KS, search, slots=self.slots)
        self.context_len = self.src_len  # source positions of the running batch's context

    def rows(self) -> int:
        return len(self.sentence_R)

    def waiting(self) -> bool:
        return bool(self.queue) or self.joined < len(self.block_ids)

    def free(self) -> np.ndarray:
        return np.flatnonzero(self.sentence_R < 0)

    def live(self) -> np.ndarray:
        return np.flatnonzero(self.sentence_R >= 0)

    def run(self) -> list[BeamResult]:
        while True:
            self._fill()
            if not self.waiting():
                if not len(self.live()):
                    return self.results
                self._compact()
            self._grow()
            self._stage()

    def _take(self, k: int) -> tuple[list[int], np.ndarray]:
        """The next k waiting sentences as a [k, S] batch (rows past the queue's end: an empty source), S their
        longest source rounded up to ENCODE_MULTIPLE, at most the running batch's src_len (which grows to hold it)."""
        ids = [self.queue.popleft() for _ in range(min(k, len(self.queue)))]
        longest = len(self.sources[ids[-1]])  # sorted: the last is the longest
        longest_src_len, longest_max_steps = self.shape(longest)
        self.src_len, self.max_steps = max(self.src_len, longest_src_len), max(self.max_steps, longest_max_steps)
        encoded_len = min(-(-longest // ENCODE_MULTIPLE) * ENCODE_MULTIPLE, self.src_len)
        return ids, source_batch([self.sources[i] for i in ids], k, encoded_len, self.search.reserved)

    def _next_block(self) -> None:
        """Encodes the next block_rows waiting sentences together; widens block and batch to one source length."""
        self.block_ids, src_KS = self._take(self.block_rows)
        self.block, self.joined = model_calls.encode(self.calls, src_KS), 0
        if src_KS.shape[1] < self.src_len:
            self.block = model_calls.widen(self.calls, self.block, src_len=self.src_len)
        if self.src_len > self.context_len:
            self.context = model_calls.widen(self.calls, self.context, src_len=self.src_len)
            self.context_len = self.src_len

    def _fill(self) -> None:
        """Waiting sentences take the free rows, refill_size at a time, while at least MIN_ROWS rows are free."""
        while self.waiting() and len(free := self.free()) >= MIN_ROWS:
            if self.joined == len(self.block_ids):
                self._next_block()
            # The block's rows left are a multiple of MIN_ROWS (the block is, and so is every refill size).
            k = refill_size(min(len(free), self.block_rows - self.joined), self.rows())
            ids = self.block_ids[self.joined : self.joined + k]
            into = np.full(k, self.rows(), np.int32)  # the block's dummy rows go past the batch's end: dropped
            into[: len(ids)] = free[: len(ids)]
            self.context, self.state = model_calls.insert(
                self.context,
                self.state,
                self.block,
                np.int32(self.joined),
                into,
                beam_size=self.search.beam_size,
                ids=self.search.reserved,
            )
            self.joined += len(ids)
            taken = into[: len(ids)]
            self.sentence_R[taken], self.max_len_R[taken], self.step_R[taken] = ids, self.max_len_N[ids], 0
            for k, x in self.row_inputs_N.items():
                self.row_inputs_R[k][taken] = x[ids]

    def _compact(self) -> None:
        """Nothing waits: the live sentences move into the smallest halved batch that holds them."""
        live, size = self.live(), compacted_size(len(self.live()), self.rows())
        if size < self.rows():
            keep = np.concatenate([live, self.free()[: size - len(live)]])
            self.context, self.state = model_calls.keep(self.context, self.state, keep.astype(np.int32))
            self.sentence_R, self.max_len_R, self.step_R = (
                self.sentence_R[keep],
                self.max_len_R[keep],
                self.step_R[keep],
            )
            self.row_inputs_R = {k: x[keep] for k, x in self.row_inputs_R.items()}

    def _grow(self) -> None:
        """Grows the cache to the stage that has room for the furthest live sentence's next token (a small batch
        with nothing waiting: to the last stage at once)."""
        if not self.waiting() and self.rows() <= FULL_CACHE_SENTENCES:
            slots = self.max_steps
        else:
            slots = next(n for n in cache_stages(self.max_steps) if n > np.max(self.step_R[self.live()]))
        if slots > self.slots:
            self.state = model_calls.grow(self.calls, self.state, slots=slots, ids=self.search.reserved)
            self.slots = slots

    def _stage(self) -> None:
        """Runs until the host can act (MIN_ROWS rows free for waiting sentences, or, nothing waiting, the live ones
        fit in a batch half the size, or a live sentence fills the cache), then records the finished sentences."""
        half = -(-self.rows() // 2)
        stop_live = self.rows() - MIN_ROWS if self.waiting() else (half if half >= MIN_ROWS else 0)
        self.state = model_calls.stage(
            self.calls, self.context, self.state, self.max_len_R, np.int32(stop_live), self.row_inputs_R, self.search
        )
        outcome = model_calls.read_outcome(self.state, self.search)
        done, self.step_R = (np.array(x) for x in jax.device_get((outcome.done_B, self.state.step_B)))
        finished = np.flatnonzero((self.sentence_R >= 0) & done)
        if not len(finished):
            return
        # beams() of the state fetched to the host: numpy's indexing, not a program (GreedyState adds the beam axis).
        tokens, log_probs, lengths = jax.device_get(self.state._replace(cache=None)).beams()
        scores = np.asarray(jax.device_get(outcome.scores_BW))
        for r in finished:
            self.results[self.sentence_R[r]] = sorted_beams(tokens[r], scores[r], log_probs[r], lengths[r])
        self.sentence_R[finished] = -1
        if self.progress is not None:
            self.progress(len(finished))


def refilling_search(
    calls: model_calls.ModelCalls,
    sources: Sequence[np.ndarray],
    max_len_N: np.ndarray,
    search: Search,
    *,
    rows: int,
    shape: Shape,
    row_inputs_N: dict[str, np.ndarray] | None = None,
    progress: Callable[[int], Any] | None = None,
) -> list[BeamResult]:
    """The cached search (specs.py's spec) of every sentence through one running batch of `rows` sentences
    (module docstring); each sentence's hypotheses, best first. shape(longest source) gives a batch's padded source
    length and output slots; progress(n) is called as n more sentences finish; row_inputs_N: each sentence's own
    inputs to the search, rows on axis 0 ("prefix": its target prefix, `prefix_array`; "keys": its sampling key),
    which follow it into whichever row it takes."""
    return _Refill(
        calls, sources, max_len_N, search, row_inputs_N=row_inputs_N or {}, rows=rows, shape=shape, progress=progress
    ).run()
