"""One small frozen spec per search: greedy, beam, set-aside beam and sampling.

Axis letters: see transformer_jax/__init__.py (B sentences, W beams per sentence, R = B W cache rows, L output
slots).

A spec owns its settings, its first state (`start`), its step (`advance`), its scores and its result, and what the
scheduler needs to know of it: the rows each sentence takes (`beam_size`), whether its sentences refill one running
batch or run batch by batch (`refills_one_batch`), the per-row inputs it needs (`needs`, built on the host by
`row_inputs`) and how many decodes of a line make its n-best list (`copies`). The Searcher, the refilling scheduler
(refill.py) and the jitted calls (calls.py) take one spec and ask it; none of them knows which search runs. A new
search is a new subclass (tests/test_decoding_protocol.py adds one there).

Specs are jax pytrees: `alpha` (and a sampling seed) are leaves, so a new alpha does not recompile; every other field
is static (hashed into the jitted programs' keys). A spec's `ids` are the model's reserved ids (tokens.SpecialIds):
the Searcher sets them from the model it runs (`with_ids`), so settings never carry a second copy of them.
`search_for` maps evaluate.py's settings to a spec: the one place that chooses the kind of search.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import numpy as np

from transformer_jax.decoding.sampling import Sampling, sample_keys
from transformer_jax.decoding.state import (
    GNMT,
    LENGTH_PENALTIES,
    BeamResult,
    BeamState,
    Decoder,
    DecodeStep,
    GreedyState,
    Reorder,
    SetAsideState,
    best_first,
    cache_stages,
    length_penalty,
    pad_tokens,
    run_stages,
    tile_beams,
)
from transformer_jax.tokens import SpecialIds

Array = jax.Array
PyTree = Any
RowInputs = dict[str, Array]  # per-row inputs, rows on axis 0: "prefix" (target prefixes), "keys" (sampling keys)

IN_BEAM, SET_ASIDE = "in_beam", "set_aside"
FINISHED_RULES = (IN_BEAM, SET_ASIDE)  # what beam search does with a hypothesis that ends (state.SetAsideState)


def search_spec(*values: str) -> Callable[[type], type]:
    """The class decorator of a spec: a frozen keyword-only dataclass registered as a pytree whose leaves are the
    fields `values` (traced by jit), its other fields static (every spec has `alpha` among its values).

    Registered as a custom node, not with jax.tree_util.register_dataclass: jaxlib (0.10.2) compares two
    register_dataclass treedefs by their fields' values without their types, so Beam(settle=2) and
    SetAside(hypotheses=2) flatten to equal treedefs, and jit, whose cache then tells them apart by hash alone, can
    run one's compiled search for the other (tests/test_decoding_protocol.py). A custom node's treedef carries its
    type.
    """

    def register(cls: type) -> type:
        cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
        static = tuple(f.name for f in dataclasses.fields(cls) if f.name not in values)
        keys = [jax.tree_util.GetAttrKey(name) for name in values]

        def flatten(spec: Search) -> tuple[list[Any], tuple[Any, ...]]:
            return [getattr(spec, name) for name in values], tuple(getattr(spec, name) for name in static)

        def flatten_with_keys(spec: Search) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
            leaves, meta = flatten(spec)
            return list(zip(keys, leaves, strict=True)), meta

        def unflatten(meta: tuple[Any, ...], leaves: Any) -> Search:
            # Without __init__: jax rebuilds specs around tracers and placeholders, which no check should see.
            spec = object.__new__(cls)
            for name, value in (*zip(values, leaves, strict=True), *zip(static, meta, strict=True)):
                object.__setattr__(spec, name, value)
            return spec

        jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
        return cls

    return register


@search_spec("alpha")
class Search:
    """What every search shares: hypotheses are ranked by log P / lp(length) (search.length_penalty's `penalty`
    with `alpha`). Its own state and step are greedy search's (one row per sentence, state.GreedyState); a subclass
    overrides `advance` (and `start` for another state) and the class facts below where they differ, and is
    decorated with `search_spec`."""

    alpha: float  # the length penalty's exponent (traced: a new value does not recompile)
    penalty: str = GNMT  # state.LENGTH_PENALTIES
    ids: SpecialIds | None = None  # the model's reserved ids; None until `with_ids` (the Searcher does it)

    beam_size: ClassVar[int] = 1  # cache rows per sentence (W), the most hypotheses one decode gives (a field below)
    refills_one_batch: ClassVar[bool] = True  # sentences refill one running batch (else: batch by batch)
    needs: ClassVar[tuple[str, ...]] = ()  # per-row inputs it cannot run without (besides the optional "prefix")

    def __post_init__(self) -> None:
        if self.penalty not in LENGTH_PENALTIES:
            raise ValueError(f"unknown length penalty {self.penalty!r}; expected one of {', '.join(LENGTH_PENALTIES)}")

    def with_ids(self, ids: SpecialIds) -> Search:
        """This search over a model whose reserved ids are `ids`."""
        return self if self.ids == ids else dataclasses.replace(self, ids=ids)

    @property
    def reserved(self) -> SpecialIds:
        """The reserved ids (ValueError while none are set: a spec runs over a model through `with_ids`)."""
        if self.ids is None:
            raise ValueError(f"{type(self).__name__} has no reserved ids: set them with with_ids(SpecialIds.of(...))")
        return self.ids

    def nbest(self, n: int) -> Search:
        """The search whose decode of a sentence gives its n best hypotheses (ValueError unless 1 <= n <=
        beam_size)."""
        if not 1 <= n <= self.beam_size:
            raise ValueError(f"{n} hypotheses per decode: {type(self).__name__} gives 1 to {self.beam_size}")
        return self._with_nbest(n)

    def _with_nbest(self, n: int) -> Search:
        return self

    def copies(self, n: int) -> int:
        """Decodes of each line that make its n-best list: 1 (its hypotheses are one decode's)."""
        return 1

    def row_inputs(self, lines: np.ndarray, copies: np.ndarray) -> dict[str, np.ndarray]:
        """The per-row inputs of decode copies[n] of input line lines[n] that `needs` names (none here)."""
        return {}

    def start(self, cache_B: PyTree, batch: int, slots: int) -> NamedTuple:
        """The first state of `batch` sentences with `slots` output slots; cache_B has a row per sentence."""
        return GreedyState.start(cache_B, batch, slots, self.reserved)

    def advance(
        self, s: NamedTuple, step: DecodeStep, max_len_B: Array, row_inputs: RowInputs, reorder: Reorder | None
    ) -> NamedTuple:
        """One decode step of every sentence of the state s (reorder: as state.Decoder's)."""
        return s.advance(step, max_len_B, row_inputs.get("prefix"), ids=self.reserved)

    def scores(self, s: NamedTuple) -> Array:
        """[B, W] each hypothesis's score log P / lp(length) as the state holds it (`beams()`)."""
        _, log_probs_BW, lengths_BW = s.beams()
        return log_probs_BW / length_penalty(lengths_BW, self.alpha, self.penalty)

    def result(self, s: NamedTuple, max_steps: int) -> BeamResult:
        """Each sentence's hypotheses best first, their tokens padded to max_steps slots."""
        tokens, log_probs, lengths = s.beams()
        return best_first(
            pad_tokens(tokens, max_steps, self.reserved.pad), log_probs, lengths, self.alpha, self.penalty
        )


@search_spec("alpha")
class Greedy(Search):
    """The most probable token at each step (state.GreedyState): Search's own rules."""


@search_spec("alpha")
class Beam(Search):
    """Beam search keeping finished hypotheses among its W beams (search.beam_search); a sentence stops once its
    `settle` best are settled (0: every beam runs to its end)."""

    beam_size: int = dataclasses.field()  # W beams per sentence (required: the class's 1 is not a default)
    settle: int = 1

    refills_one_batch: ClassVar[bool] = False  # beam search reorders its whole cache every step (docs/decoding.md)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {self.beam_size}")
        if not 0 <= self.settle <= self.beam_size:
            raise ValueError(
                f"settle must be in [0, beam_size={self.beam_size}] (hypotheses settled), got {self.settle}"
            )

    def _with_nbest(self, n: int) -> Beam:
        return dataclasses.replace(self, settle=n)

    def start(self, cache_B: PyTree, batch: int, slots: int) -> BeamState:
        return BeamState.start(tile_beams(cache_B, self.beam_size), batch, self.beam_size, slots, self.reserved)

    def advance(self, s, step, max_len_B, row_inputs, reorder):
        prefix = row_inputs.get("prefix")
        return s.advance(step, max_len_B, self.alpha, self.settle, self.penalty, prefix, reorder, ids=self.reserved)


@search_spec("alpha")
class SetAside(Search):
    """Beam search that sets finished hypotheses aside (state.SetAsideState, CTranslate2's), returning `hypotheses`
    of them (0: beam_size)."""

    beam_size: int = dataclasses.field()  # W live beams per sentence (required)
    hypotheses: int = 1

    refills_one_batch: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beam_size < 2:
            raise ValueError(f"a set-aside beam search needs beam_size >= 2, got {self.beam_size}")
        if not 0 <= self.hypotheses <= self.beam_size:
            raise ValueError(
                f"settle must be in [0, beam_size={self.beam_size}] (hypotheses kept), got {self.hypotheses}"
            )

    def _with_nbest(self, n: int) -> SetAside:
        return dataclasses.replace(self, hypotheses=n)

    def start(self, cache_B: PyTree, batch: int, slots: int) -> SetAsideState:
        pool = self.hypotheses or self.beam_size
        cache_R = tile_beams(cache_B, self.beam_size)
        return SetAsideState.start(cache_R, batch, self.beam_size, pool, slots, self.reserved)

    def advance(self, s, step, max_len_B, row_inputs, reorder):
        return s.advance(
            step, max_len_B, self.alpha, self.penalty, row_inputs.get("prefix"), reorder, ids=self.reserved
        )


@search_spec("alpha", "seed")
class Sampled(Search):
    """Each token drawn from the model's reshaped distribution (sampling.py), row by row with its own key: an n-best
    list is n draws of the line, best score first."""

    sampling: Sampling
    seed: int = 0  # the keys' seed (a leaf: the programs do not depend on it)

    needs: ClassVar[tuple[str, ...]] = ("keys",)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.sampling.check()

    def copies(self, n: int) -> int:
        return n  # each of the n draws is a decode of its own, giving one hypothesis

    def row_inputs(self, lines: np.ndarray, copies: np.ndarray) -> dict[str, np.ndarray]:
        """Draw copies[n] of line lines[n] takes its own key (sampling.sample_keys): a draw depends on the seed,
        its line and its number only."""
        return {"keys": sample_keys(self.seed, lines, copies)}

    def advance(self, s, step, max_len_B, row_inputs, reorder):
        chooser = self.sampling.chooser(row_inputs["keys"])
        return s.advance(step, max_len_B, row_inputs.get("prefix"), chooser, ids=self.reserved)


def search_for(
    beam_size: int,
    alpha: float,
    penalty: str = GNMT,
    finished: str = IN_BEAM,
    sampling: Sampling | None = None,
    seed: int = 0,
) -> Search:
    """The spec of evaluate.py's settings: sampling (beam_size 1), greedy (beam_size 1), or a beam search whose
    finished hypotheses stay in the beam (`in_beam`) or are set aside (`set_aside`). ValueError for settings that
    cannot work."""
    if finished not in FINISHED_RULES:
        raise ValueError(f"unknown rule for finished hypotheses {finished!r}; expected one of {FINISHED_RULES}")
    if sampling is not None:
        if beam_size != 1:
            raise ValueError(f"sampling draws one token per step: beam_size must be 1, got {beam_size}")
        return Sampled(alpha=alpha, penalty=penalty, sampling=sampling, seed=seed)
    if beam_size == 1:
        return Greedy(alpha=alpha, penalty=penalty)
    if finished == SET_ASIDE:
        return SetAside(alpha=alpha, penalty=penalty, beam_size=beam_size)
    return Beam(alpha=alpha, penalty=penalty, beam_size=beam_size)


def run_search(
    search: Search, d: Decoder, max_len_B: Array, *, max_steps: int, row_inputs: RowInputs | None = None
) -> BeamResult:
    """The whole search over the decoder d, in cache stages when it can grow (search.run_stages); d's cache has a
    row per sentence. For use inside a traced function."""
    row_inputs = row_inputs or {}
    first = max_steps if d.grow is None else cache_stages(max_steps)[0]
    init = search.start(d.cache, max_len_B.shape[0], first)

    def body(s: NamedTuple) -> NamedTuple:
        return search.advance(s, d.step, max_len_B, row_inputs, d.reorder)

    return search.result(run_stages(body, init, max_steps, d.grow, search.reserved), max_steps)
