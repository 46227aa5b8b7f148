"""The search specs: one small frozen spec per search (greedy, beam, set-aside beam, sampling), its runs over a
decode step, and the token choice of sampling.

Axis letters: see transformer_jax/__init__.py (B sentences, W beams per sentence, R = B W cache rows, L output
slots, V vocabulary).

A spec owns its settings, its first state (`start`, a state.py loop state), its step (`advance`), its scores and its
result, and what the scheduler asks of it: rows per sentence (`beam_size`), whether its sentences refill one running
batch (`refills_one_batch`), the per-row inputs it needs (`needs`, built on the host by `row_inputs`) and how many
decodes of a line make its n-best list (`copies`). The Searcher, the scheduler and the jitted calls take one spec and
ask it; none of them knows which search runs. A new search is a new subclass (tests/test_decoding_protocol.py).

Specs are jax pytrees: `alpha` (and a sampling seed) are leaves, so a new alpha does not recompile; every other field
is static. A spec's `ids` are the model's reserved ids (model.layers.SpecialIds), set by the Searcher (`with_ids`), so
settings never carry a second copy of them. `search_for` maps evaluate.py's settings to a spec; `run_search` runs a
spec in one loop inside a traced function, and `greedy_search`, `beam_search` and `set_aside_search` over a bare
decode step (tests drive them with stubs).

Sampling (`Sampled`, `Sampling`): each step draws the next token from the model's distribution, reshaped by a
temperature, a top-k cut and a nucleus (top-p) cut (Holtzman et al., 2020); sampled back-translation beats beam
back-translation (Edunov et al., 2018). Every (sentence, sample) has its own key (`sample_keys`: the seed folded with
the sentence's input line and the sample's number), folded with t at step t: one uniform number per row and step,
turned into a token by inverting the distribution's CDF (`inverse_cdf`; jax.random.categorical would draw V Gumbel
numbers per row and step, most of a sampling step's cost on CPU: docs/decoding.md). So a sample depends on its seed,
its line and its number only, not on the batch it ran in or when the scheduler let it join.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.decoding.state import (
    GNMT,
    LENGTH_PENALTIES,
    NEG_INF,
    BeamState,
    Decoder,
    DecodeStep,
    GreedyState,
    GrowCache,
    Reorder,
    SetAsideState,
    cache_stages,
    length_penalty,
    pad_tokens,
    run_stages,
    tile_beams,
    top_k,
)
from transformer_jax.model.layers import SpecialIds

Array = jax.Array
PyTree = Any
Choose = Callable[[Array, Array], Array]  # (logits_BV, step_B) -> token_B
RowInputs = dict[str, Array]  # per-row inputs, rows on axis 0: "prefix" (target prefixes), "keys" (sampling keys)

IN_BEAM, SET_ASIDE = "in_beam", "set_aside"
FINISHED_RULES = (IN_BEAM, SET_ASIDE)  # what beam search does with a hypothesis that ends (state.SetAsideState)


class BeamResult(NamedTuple):
    """What a search gives: each sentence's hypotheses, best first (`best_first`)."""

    tokens: Array  # [B, W, L] int32, best beam first; EOS included when emitted, PAD after
    scores: Array  # [B, W] float32: log P / lp(length), descending
    log_probs: Array  # [B, W] float32: log P(tokens | source)
    lengths: Array  # [B, W] int32: emitted tokens, EOS included


def best_first(
    tokens_BWL: Array, log_probs_BW: Array, lengths_BW: Array, alpha: Array | float, penalty: str = GNMT
) -> BeamResult:
    """The beams of each sentence sorted by score log P / lp(length), best first."""
    lp_BW = length_penalty(lengths_BW, alpha, penalty)
    scores_BW, order_BW = jax.lax.top_k(log_probs_BW / lp_BW, log_probs_BW.shape[1])

    def sort(x: Array) -> Array:
        idx = order_BW.reshape(order_BW.shape + (1,) * (x.ndim - 2))
        return jnp.take_along_axis(x, idx, axis=1)

    return BeamResult(sort(tokens_BWL), scores_BW, sort(log_probs_BW), sort(lengths_BW))


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
    """What every search shares: hypotheses are ranked by log P / lp(length) (state.length_penalty's `penalty`
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


def _check_beams(spec: Search, fewest: int, hypotheses: str) -> None:
    """ValueError unless spec.beam_size >= fewest and 0 <= the field `hypotheses` (those returned) <= beam_size."""
    if spec.beam_size < fewest:
        raise ValueError(f"{type(spec).__name__} search needs beam_size >= {fewest}, got {spec.beam_size}")
    if not 0 <= getattr(spec, hypotheses) <= spec.beam_size:
        raise ValueError(f"{hypotheses} must be in [0, beam_size={spec.beam_size}], got {getattr(spec, hypotheses)}")


@search_spec("alpha")
class Beam(Search):
    """Beam search keeping finished hypotheses among its W beams (state.BeamState); a sentence stops once its
    `settle` best are settled (0: every beam runs to its end)."""

    beam_size: int = dataclasses.field()  # W beams per sentence (required: the class's 1 is not a default)
    settle: int = 1

    refills_one_batch: ClassVar[bool] = False  # beam search reorders its whole cache every step (docs/decoding.md)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_beams(self, 1, "settle")

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
        _check_beams(self, 2, "hypotheses")

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


# -- sampling: the token choice of a Sampled search -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How tokens are drawn (hashable: a static argument of the jitted search, one compilation per setting)."""

    temperature: float  # > 0: logits are divided by it (1: the model's distribution)
    top_k: int  # >= 0: keep the k most probable tokens (0: all)
    top_p: float  # in (0, 1]: keep the smallest set of most probable tokens whose probability reaches p (1: all)

    def check(self) -> None:
        """ValueError naming the setting that cannot work (evaluate.py's flags carry the same names)."""
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top_k must be >= 0 (0: no cut), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top_p must be in (0, 1] (1: no cut), got {self.top_p}")

    def log_probs(self, logits_BV: Array) -> Array:
        """[B, V] log-probabilities of the reshaped distribution the tokens are drawn from (-inf: cut)."""
        logits_BV = logits_BV.astype(jnp.float32) / self.temperature
        if self.top_k:
            kth_B1 = top_k(logits_BV, min(self.top_k, logits_BV.shape[-1]))[0][:, -1:]
            logits_BV = jnp.where(logits_BV < kth_B1, NEG_INF, logits_BV)
        log_probs_BV = jax.nn.log_softmax(logits_BV, axis=-1)
        if self.top_p < 1:
            probs_BV = jnp.exp(log_probs_BV)
            kept_BV = probs_BV >= nucleus_threshold(probs_BV, self.top_p)[:, None]
            log_probs_BV = jax.nn.log_softmax(jnp.where(kept_BV, log_probs_BV, NEG_INF), axis=-1)
        return log_probs_BV

    def weights(self, logits_BV: Array) -> Array:
        """[B, V] the reshaped distribution's probabilities up to a factor per row (0: cut): without a cut,
        exp((x - max x) / temperature), which spares log_probs' normalisation."""
        if self.top_k or self.top_p < 1:
            return jnp.exp(self.log_probs(logits_BV))
        logits_BV = logits_BV.astype(jnp.float32)
        return jnp.exp((logits_BV - jnp.max(logits_BV, axis=-1, keepdims=True)) / self.temperature)

    def chooser(self, keys_B2: Array) -> Choose:
        """The token choice of the search (state.GreedyState.advance's `choose`): row b draws one uniform number
        with its key keys_B2[b] folded with its step, and inverts the CDF of its reshaped distribution there."""

        def choose(logits_BV: Array, step_B: Array) -> Array:
            step_keys = jax.vmap(jax.random.fold_in)(keys_B2, step_B)
            u_B = jax.vmap(lambda key: jax.random.uniform(key, ()))(step_keys)
            return inverse_cdf(self.weights(logits_BV), u_B)

        return choose


FLOAT32_ONE_BITS = 0x3F800000  # 1.0's bits: non-negative float32 values order as their bits do, as int32


def nucleus_threshold(probs_BV: Array, top_p: float) -> Array:
    """[B] the least probability the nucleus keeps: with probabilities s_1 >= s_2 >= ..., s_K for the last K whose
    more probable tokens hold less than top_p (so tokens with probability >= s_K are kept, ties included).

    s_K is the least v with M(v) = sum of the probabilities above v < top_p (M steps down at each s_k), found by
    bisection over float32 bit patterns in [0, 1]: 30 masked sums over [B, V] instead of a sort of every row, which
    was most of a top-p step's cost on CPU (docs/decoding.md).
    """

    def mass_above_below_p(bits_B: Array) -> Array:
        v_B1 = jax.lax.bitcast_convert_type(bits_B, jnp.float32)[:, None]
        return jnp.sum(jnp.where(probs_BV > v_B1, probs_BV, 0.0), axis=-1) < top_p

    def halve(_, lo_hi: tuple[Array, Array]) -> tuple[Array, Array]:
        lo_B, hi_B = lo_hi  # M(lo) >= top_p > M(hi)
        mid_B = lo_B + (hi_B - lo_B) // 2
        below_B = mass_above_below_p(mid_B)
        return jnp.where(below_B, lo_B, mid_B), jnp.where(below_B, mid_B, hi_B)

    batch = probs_BV.shape[0]
    start = (jnp.zeros((batch,), jnp.int32), jnp.full((batch,), FLOAT32_ONE_BITS, jnp.int32))
    _, hi_B = jax.lax.fori_loop(0, FLOAT32_ONE_BITS.bit_length(), halve, start)
    return jax.lax.bitcast_convert_type(hi_B, jnp.float32)


CDF_BLOCK = 128  # tokens per block of inverse_cdf's two-level search


def inverse_cdf(weights_BV: Array, u_B: Array) -> Array:
    """[B] int32: for u uniform in [0, 1), the first index whose cumulative weight exceeds u times the row's total,
    which is a draw from the categorical distribution of probabilities weights / total (weights >= 0, total > 0).

    In two levels, the same rule: the vocabulary in blocks of CDF_BLOCK tokens (the last padded with zero weight),
    first the block where the cumulative block mass exceeds u * total, then the token inside it where the rest of
    that mass is exceeded. A cumulative sum over V in one go costs several times the argmax of greedy search on CPU
    (docs/decoding.md); two short ones cost about as much.
    """
    batch, vocab = weights_BV.shape
    blocks = -(-vocab // CDF_BLOCK)
    weights_BV = jnp.pad(weights_BV, [(0, 0), (0, blocks * CDF_BLOCK - vocab)])
    weights_BKC = weights_BV.reshape(batch, blocks, CDF_BLOCK)
    mass_BK = jnp.sum(weights_BKC, axis=-1)
    cumulative_BK = jnp.cumsum(mass_BK, axis=-1)
    target_B = u_B * cumulative_BK[:, -1]
    block_B = _first_above(cumulative_BK, target_B)
    before_B = jnp.take_along_axis(cumulative_BK - mass_BK, block_B[:, None], axis=1)[:, 0]
    inside_BC = jnp.take_along_axis(weights_BKC, block_B[:, None, None], axis=1)[:, 0]
    # Rounding can put the rest just outside the block's mass; clamped, it still lands on a positive weight.
    rest_B = jnp.maximum(target_B - before_B, 0.0)
    return block_B * CDF_BLOCK + _first_above(jnp.cumsum(inside_BC, axis=-1), rest_B)


def _first_above(cumulative_BN: Array, target_B: Array) -> Array:
    """[B] the first index whose cumulative weight exceeds target (non-decreasing rows of weights >= 0).

    A zero-weight index never qualifies (its cumulative weight equals its predecessor's); nor, should the target
    reach the row's total, does any index past the last positive weight, whose cumulative weight is the total.
    """
    total_B1 = cumulative_BN[:, -1:]
    below_BN = (cumulative_BN <= target_B[:, None]) & (cumulative_BN < total_B1)
    return jnp.sum(below_BN, axis=-1, dtype=jnp.int32)


PLAIN_SAMPLING = Sampling(temperature=1.0, top_k=0, top_p=1.0)  # the model's own distribution: what unset flags mean


def sample_keys(seed: int, lines: np.ndarray, samples: np.ndarray) -> np.ndarray:
    """[N, 2] uint32: the key of sample samples[n] of input line lines[n] (raw keys, as jax.random.PRNGKey's)."""
    base = jax.random.PRNGKey(seed)
    keys = jax.vmap(lambda line, sample: jax.random.fold_in(jax.random.fold_in(base, line), sample))(
        jnp.asarray(lines, jnp.uint32), jnp.asarray(samples, jnp.uint32)
    )
    return np.asarray(keys, np.uint32)


@search_spec("alpha", "seed")
class Sampled(Search):
    """Each token drawn from the model's reshaped distribution (`Sampling`), row by row with its own key: an n-best
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
        """Draw copies[n] of line lines[n] takes its own key (`sample_keys`): a draw depends on the seed,
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
    """The whole search over the decoder d, in cache stages when it can grow (state.run_stages); d's cache has a
    row per sentence. For use inside a traced function."""
    row_inputs = row_inputs or {}
    first = max_steps if d.grow is None else cache_stages(max_steps)[0]
    init = search.start(d.cache, max_len_B.shape[0], first)

    def body(s: NamedTuple) -> NamedTuple:
        return search.advance(s, d.step, max_len_B, row_inputs, d.reorder)

    return search.result(run_stages(body, init, max_steps, d.grow, search.reserved), max_steps)


# -- the searches as functions of a bare decode step (tests' stubs, benchmarks/decode.py) ------------------------------


class GreedyResult(NamedTuple):
    tokens: Array  # [B, L] int32: the output, EOS included when emitted, PAD after
    log_probs: Array  # [B] float32: log P(tokens | source)
    lengths: Array  # [B] int32: emitted tokens, EOS included


def greedy_search(
    decode_step: DecodeStep,
    cache: PyTree,
    max_len_B: Array,
    *,
    max_steps: int,
    grow: GrowCache | None = None,
    prefix_BP: Array | None = None,
    choose: Choose | None = None,
    ids: SpecialIds,
) -> GreedyResult:
    """Takes the most probable token at each step (with `choose`, the token it picks from the logits: a Sampling's
    chooser), as one loop (state.GreedyState). `cache` has B rows; 1 <= max_len_B <= max_steps.

    With `grow` (see state.Decoder), the cache starts small and grows in stages (state.py). With prefix_BP (target
    prefixes, PAD-padded), each sentence first emits its prefix (state.forced_tokens), its log-probabilities counted,
    then continues; the length limit still holds. ids: the model's reserved ids (model.layers.SpecialIds).
    """
    first = max_steps if grow is None else cache_stages(max_steps)[0]
    init = GreedyState.start(cache, max_len_B.shape[0], first, ids)
    s = run_stages(lambda s: s.advance(decode_step, max_len_B, prefix_BP, choose, ids=ids), init, max_steps, grow, ids)
    return GreedyResult(pad_tokens(s.tokens_BL, max_steps, ids.pad), s.log_probs_B, s.step_B)


def beam_search(
    decode_step: DecodeStep,
    cache: PyTree,
    max_len_B: Array,
    *,
    beam_size: int,
    alpha: Array | float,
    max_steps: int,
    grow: GrowCache | None = None,
    settle: int = 0,
    penalty: str = GNMT,
    prefix_BP: Array | None = None,
    reorder: Reorder | None = None,
    ids: SpecialIds,
) -> BeamResult:
    """Beam search (state.BeamState: a `Beam` spec's run) of beam_size beams, as one loop; `cache` has B rows and is
    tiled to R = B W rows here, once. settle: as Beam's (0: every beam runs to its end); grow, prefix_BP and ids as
    greedy_search's; reorder: as state.Decoder's."""
    spec = Beam(alpha=alpha, penalty=penalty, ids=ids, beam_size=beam_size, settle=settle)
    row_inputs = None if prefix_BP is None else {"prefix": prefix_BP}
    return run_search(
        spec, Decoder(decode_step, cache, grow, reorder), max_len_B, max_steps=max_steps, row_inputs=row_inputs
    )


def set_aside_search(
    decode_step: DecodeStep,
    cache: PyTree,
    max_len_B: Array,
    *,
    beam_size: int,
    hypotheses: int,
    alpha: Array | float,
    max_steps: int,
    grow: GrowCache | None = None,
    penalty: str = GNMT,
    prefix_BP: Array | None = None,
    reorder: Reorder | None = None,
    ids: SpecialIds,
) -> BeamResult:
    """Beam search of beam_size live beams that sets finished hypotheses aside (state.SetAsideState: a `SetAside`
    spec's run), as one loop; `cache` has B rows. Returns each sentence's `hypotheses` best (1 <= hypotheses <=
    beam_size), best first. grow, prefix_BP, reorder and ids as beam_search's."""
    spec = SetAside(alpha=alpha, penalty=penalty, ids=ids, beam_size=beam_size, hypotheses=hypotheses)
    row_inputs = None if prefix_BP is None else {"prefix": prefix_BP}
    return run_search(
        spec, Decoder(decode_step, cache, grow, reorder), max_len_B, max_steps=max_steps, row_inputs=row_inputs
    )
