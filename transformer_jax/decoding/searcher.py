"""`Searcher`: a search spec (specs.py) run over a model's parameters, one batch or a list of sentences.

Axis letters: see transformer_jax/__init__.py (B sentences, N sentences of a list, S source positions, P prefix
positions).

A batch runs either as one jitted call (model_calls.search_batch) or through the refilling scheduler (refill.py),
whose calls are model_calls.ModelCalls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax.decoding import model_calls, refill
from transformer_jax.decoding.specs import Search
from transformer_jax.decoding.state import BeamResult, cache_stages
from transformer_jax.tokens import SpecialIds

Array = jax.Array
PyTree = Any


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
        self.ids = SpecialIds.of(model.spec)  # every search runs with the model's reserved ids (Search.with_ids)
        leaves, treedef = jax.tree.flatten(self.params)
        self.calls = (
            model_calls.ModelCalls(model_calls.graph(self.graphdef, treedef), leaves) if use_cache and compact else None
        )

    def refills(self, rows: int) -> bool:
        """Whether a batch of `rows` sentences runs through the refilling scheduler (else one jitted call)."""
        return self.calls is not None and rows >= 2 * refill.MIN_ROWS

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
                self.graphdef,
                self.params,
                src_BS,
                max_len_B,
                {},
                search,
                max_steps=max_steps,
                use_cache=self.use_cache,
            )
            return {"search": compile_one("search", traced)}

        def outputs(traced: jax.stages.Traced, compiled: jax.stages.Compiled) -> PyTree:
            """What a compiled call returns, as the next call's abstract inputs."""
            put = lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
            return jax.tree.map(put, traced.out_info, compiled.output_shardings)

        graph, params, stages = self.calls.graph, self.calls.params, cache_stages(max_steps)
        traced = model_calls.start.trace(params, src_BS, search, graph=graph, slots=stages[0])
        programs = {"start": compile_one("start", traced)}
        context, s = outputs(traced, programs["start"])
        if len(stages) > 1:
            before = model_calls.start.trace(params, src_BS, search, graph=graph, slots=stages[-2]).out_info[1]
            s = jax.tree.map(lambda x, like: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=like.sharding), before, s)
            traced = model_calls.grow.trace(params, s, graph=graph, slots=stages[-1], ids=self.ids)
            programs["grow"] = compile_one("grow", traced)
            s = outputs(traced, programs["grow"])
        stop_live = jax.ShapeDtypeStruct((), jnp.int32, sharding=host)
        traced = model_calls.stage.trace(params, context, s, max_len_B, stop_live, {}, search, graph=graph)
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
        hypotheses best first, scored log P / lp (search.length_penalty).
        prefix_BP: target prefixes [B, P], PAD-padded (search.forced_tokens): each output starts with its prefix.
        row_inputs: the per-row inputs the search needs (`Search.needs`, e.g. sampling keys: Search.row_inputs).

        Batches of at least 2 MIN_ROWS sentences run the refilling search (nothing waits, so finished sentences
        only leave); smaller ones, or without compaction, the whole search is one jitted call.
        """
        search = search.with_ids(self.ids)
        row_inputs = _row_inputs(search, prefix_BP, row_inputs)
        if not self.refills(src_BS.shape[0]):
            return self._one_jit(src_BS, max_len_B, row_inputs, search, max_steps)
        src_BS = np.asarray(src_BS, np.int32)
        found = refill.refilling_search(
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
        shape: refill.Shape,
        progress: Callable[[int], Any] | None = None,
        prefixes: Sequence[Sequence[int]] | None = None,
        row_inputs_N: dict[str, np.ndarray] | None = None,
    ) -> list[BeamResult]:
        """Every sentence's hypotheses by `search` (best first; tokens [W, L] with L at least its longest), decoded
        `batch_size` sentences at a time: sources are id lists (EOS-terminated), max_len_N their output limits, and
        shape(longest source) the padded source length and the most output slots of a batch. progress(n) is
        called as n more sentences are done. prefixes: each sentence's target prefix (ids, no EOS; empty: none), or
        None; row_inputs_N: as __call__'s row_inputs, per sentence.

        With compaction and at least 2 MIN_ROWS rows, they run through the refilling scheduler (refill.py): in one
        refilled batch, or batch by batch where the search says so (`Search.refills_one_batch`); otherwise in
        consecutive one-jit batches. Shortest sources go first. The batch has batch_size rows, or as many as the
        sentences rounded up to a multiple of MIN_ROWS when fewer (refill.batch_rows).
        """
        search = search.with_ids(self.ids)
        rows = refill.batch_rows(len(sources), batch_size)
        max_len_N = np.asarray(max_len_N, np.int32)
        prefix_NP = None if prefixes is None or not any(prefixes) else refill.prefix_array(prefixes, self.ids)
        row_inputs_N = _row_inputs(search, prefix_NP, row_inputs_N)
        if not len(sources):
            return []
        order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
        results: list[BeamResult | None] = [None] * len(sources)
        if self.refills(rows):
            groups = [order] if search.refills_one_batch else [order[j : j + rows] for j in range(0, len(order), rows)]
            for group in groups:
                found = refill.refilling_search(
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
            src_BS = refill.source_batch([sources[i] for i in batch], rows, src_len, self.ids)
            max_len_B = np.ones((rows,), np.int32)  # a dummy row stops after one step
            max_len_B[: len(batch)] = max_len_N[batch]
            row_inputs = refill.empty_row_inputs(row_inputs_N, rows, self.ids)
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


def searcher(model: nnx.Module, *, use_cache: bool = True, compact: bool = True) -> Searcher:
    """A Searcher for the model (see Searcher)."""
    return Searcher(model, use_cache=use_cache, compact=compact)


def search(
    model: nnx.Module,
    src_BS: Array,
    max_len_B: Array,
    search: Search,
    *,
    max_steps: int,
    use_cache: bool = True,
    compact: bool = True,
) -> BeamResult:
    """Encodes src [B, S] (PAD-padded, EOS-terminated) and runs `search` (specs.py), jitted.

    Compiles per (graph, shapes, kind of search, cache stage, compacted batch size); the spec's alpha is traced, so
    changing it does not recompile. Runs the model in eval mode (dropout off) without changing the caller's model.
    For many batches of one model, use `searcher`.
    """
    return searcher(model, use_cache=use_cache, compact=compact)(src_BS, max_len_B, search, max_steps=max_steps)
