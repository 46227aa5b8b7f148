"""Greedy and beam search over a generic decode step, and the binding that runs them on the Transformer.

Axis letters: see transformer_jax/__init__.py (here B sentences, W beams per sentence, R = B W rows with row b W + w
beam w of sentence b, L output slots = max_steps).

A decode step is `decode_step(tokens_R1, cache) -> (logits_R1V, cache)`: it reads the next input token of every
row and returns the next-token logits. The cache is any pytree whose non-scalar leaves have the rows on axis 0
(scalar leaves, such as a stub's step counter, are shared by all rows and never tiled or reordered). The
search functions only need this interface, so tests drive them with stubs whose distributions they control.

Search (both functions; the reserved ids are those of transformer_jax/tokens.py): the decoder input starts with BOS;
a hypothesis finishes when it emits EOS or reaches its sentence's maximum length `max_len_B` (then it is kept as it
is, without EOS); after that only PAD follows and its score never changes. Lengths |Y| count the emitted tokens,
EOS included. `jax.lax.while_loop` runs the steps and stops as soon as every hypothesis of every sentence has
finished.

Cache stages: a step reads every slot of the self-attention cache and beam search reorders all of them, so their
cost grows with the cache's size, not with the tokens decoded so far. Outputs average ~13 tokens on Multi30k while
the limit (source + 50) reaches 114, so a search with a `grow` function runs in stages of growing cache size (16,
32, 64, ..., max_steps; `cache_stages`), one while_loop each: a stage ends when its slots are full or every
hypothesis has finished, and the next one starts from a cache grown by zero slots. Each stage is compiled once;
the results equal a single loop over max_steps slots (empty slots are never attended).

Refilling (`Searcher`): a step costs as much for a finished sentence's rows as for a live one's, so translation
runs the cached search in jitted calls of a few steps; between calls the host records the finished sentences, gives
their rows to waiting ones (greedy search), and moves the live ones into a smaller batch once nothing waits
(`_refilling_search`). Each sentence decodes at its own position (`step_B`; the model's cache has a write index per
row). The host looks at the done flags once per call, which costs the same on any device.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax.model.transformer import unpacked_segment_ids
from transformer_jax.tokens import BOS_ID, EOS_ID, PAD_ID

Array = jax.Array
PyTree = Any
DecodeStep = Callable[[Array, PyTree], tuple[Array, PyTree]]
GrowCache = Callable[[PyTree, int], PyTree]
NEG_INF = -jnp.inf
FIRST_STAGE = 16  # slots of the first cache stage: most Multi30k outputs (~13 tokens) finish inside it


class Decoder(NamedTuple):
    """A decode step, its initial cache, and `grow(cache, n)` giving the cache room for n steps (None: it has
    room for max_steps already)."""

    step: DecodeStep
    cache: PyTree
    grow: GrowCache | None = None


def cache_stages(max_steps: int) -> list[int]:
    """Cache sizes of the stages: doubling from FIRST_STAGE, then max_steps once doubling would pass 3/4 of it
    (a last stage of a few slots would cost a compilation and save nothing)."""
    stages = [min(FIRST_STAGE, max_steps)]
    while stages[-1] < max_steps:
        doubled = 2 * stages[-1]
        stages.append(doubled if doubled < 0.75 * max_steps else max_steps)
    return stages


def _run_stages(body: Callable, state: NamedTuple, max_steps: int, grow: GrowCache | None):
    """Runs the search loop over the cache stages (one loop over max_steps slots when grow is None)."""
    if grow is None:
        return _loop(body, state, max_steps)
    for slots in cache_stages(max_steps):
        state = _loop(body, state.with_room(slots)._replace(cache=grow(state.cache, slots)), slots)
    return state


def _loop(body: Callable, state: NamedTuple, slots: int):
    """while_loop(body) until the cache's `slots` are full or every sentence is done."""

    def cond(s: NamedTuple) -> Array:
        # The sentences still running are all at the same step, the most any sentence has taken.
        return (jnp.max(s.step_B) < slots) & ~jnp.all(s.sentence_done())

    return jax.lax.while_loop(cond, body, state)


def length_penalty(length: Array | int, alpha: Array | float) -> Array:
    """lp(Y) = ((5 + |Y|) / 6) ** alpha (Wu et al., 2016); beam scores are log P(Y|X) / lp(Y)."""
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def tile_beams(tree: PyTree, beam_size: int) -> PyTree:
    """Repeats every non-scalar leaf beam_size times along axis 0: [B, ...] -> [R, ...], beams of a row adjacent."""
    return jax.tree.map(lambda x: x if jnp.ndim(x) == 0 else jnp.repeat(x, beam_size, axis=0), tree)


def gather_rows(tree: PyTree, rows_R: Array) -> PyTree:
    """Reorders every non-scalar leaf along axis 0 (the beam reordering of the cache); scalars stay."""
    return jax.tree.map(lambda x: x if jnp.ndim(x) == 0 else jnp.take(x, rows_R, axis=0), tree)


def _next_log_probs(decode_step: DecodeStep, tokens_R: Array, cache: PyTree) -> tuple[Array, PyTree]:
    logits, cache = decode_step(tokens_R[:, None], cache)
    logits_RV = logits.reshape(tokens_R.shape[0], -1).astype(jnp.float32)
    return jax.nn.log_softmax(logits_RV, axis=-1), cache


def first_argmax(x_BV: Array) -> Array:
    """jnp.argmax over the last axis (the first index of the maximum), as two plain reductions.

    XLA:CPU lowers argmax to a variadic (value, index) reduction that ran 4x slower than a max and a min over
    [64, 8000] (1.16 ms against 0.27 ms; a greedy step takes ~10 ms). A row with a NaN has no index equal to its max
    and gets the last index, where argmax would point at the NaN; either way the output is garbage.
    """
    vocab = x_BV.shape[-1]
    index_BV = jnp.where(x_BV == jnp.max(x_BV, axis=-1, keepdims=True), jnp.arange(vocab, dtype=jnp.int32), vocab)
    return jnp.minimum(jnp.min(index_BV, axis=-1), vocab - 1)


def _write(seq: Array, step: Array, tokens: Array) -> Array:
    """seq[..., step] = tokens (seq [..., L], tokens [...], step broadcasting against tokens: each row its own slot;
    a step of L or more writes nothing)."""
    return jnp.where(jnp.arange(seq.shape[-1]) == step[..., None], tokens[..., None], seq)


class GreedyResult(NamedTuple):
    tokens: Array  # [B, L] int32: the output, EOS included when emitted, PAD after
    log_probs: Array  # [B] float32: log P(tokens | source)
    lengths: Array  # [B] int32: emitted tokens, EOS included


class BeamResult(NamedTuple):
    tokens: Array  # [B, W, L] int32, best beam first; EOS included when emitted, PAD after
    scores: Array  # [B, W] float32: log P / lp(length), descending
    log_probs: Array  # [B, W] float32: log P(tokens | source)
    lengths: Array  # [B, W] int32: emitted tokens, EOS included


def _pad_tokens(tokens: Array, slots: int) -> Array:
    """tokens [..., L'] padded with PAD to [..., slots] (L' <= slots): the output buffer grows with the cache."""
    extra = slots - tokens.shape[-1]
    return tokens if extra == 0 else jnp.pad(tokens, [(0, 0)] * (tokens.ndim - 1) + [(0, extra)])


class GreedyState(NamedTuple):
    """The loop state of greedy search: per sentence (B rows), and the decode step's cache."""

    step_B: Array  # int32: tokens emitted so far, EOS included (its length; frozen once done)
    done_B: Array
    last_B: Array
    tokens_BL: Array  # L: the current stage's slots
    log_probs_B: Array
    cache: PyTree

    def sentence_done(self) -> Array:
        return self.done_B

    def with_room(self, slots: int) -> GreedyState:
        return self._replace(tokens_BL=_pad_tokens(self.tokens_BL, slots))

    def beams(self) -> tuple[Array, Array, Array]:
        """(tokens [B, 1, L], log_probs [B, 1], lengths [B, 1]): the result as one beam per sentence."""
        return self.tokens_BL[:, None], self.log_probs_B[:, None], self.step_B[:, None]

    @classmethod
    def start(cls, cache: PyTree, batch: int, slots: int) -> GreedyState:
        return cls(
            step_B=jnp.zeros((batch,), jnp.int32),
            done_B=jnp.zeros((batch,), bool),
            last_B=jnp.full((batch,), BOS_ID, jnp.int32),
            tokens_BL=jnp.full((batch, slots), PAD_ID, jnp.int32),
            log_probs_B=jnp.zeros((batch,), jnp.float32),
            cache=cache,
        )

    def advance(self, decode_step: DecodeStep, max_len_B: Array) -> GreedyState:
        """One step: every unfinished sentence appends its most probable token."""
        logits_B1V, cache = decode_step(self.last_B[:, None], self.cache)
        logits_BV = logits_B1V[:, 0].astype(jnp.float32)
        token_B = jnp.where(self.done_B, PAD_ID, first_argmax(logits_BV))
        # log_softmax at the argmax, x_max - logsumexp(x) = -log sum exp(x - x_max), without the [B, V] log_softmax
        # (a greedy step over 64 sentences spent ~0.5 ms of ~8 ms writing and re-reading it).
        gain_B = -jnp.log(jnp.sum(jnp.exp(logits_BV - jnp.max(logits_BV, axis=-1, keepdims=True)), axis=-1))
        return GreedyState(
            step_B=jnp.where(self.done_B, self.step_B, self.step_B + 1),
            done_B=self.done_B | (token_B == EOS_ID) | (self.step_B + 1 >= max_len_B),
            last_B=token_B,
            tokens_BL=_write(self.tokens_BL, self.step_B, token_B),
            log_probs_B=self.log_probs_B + jnp.where(self.done_B, 0.0, gain_B),
            cache=cache,
        )


class BeamState(NamedTuple):
    """The loop state of beam search: per sentence and beam ([B, W]), and the cache with R = B W rows."""

    step_B: Array  # int32: steps taken by each sentence (frozen once done)
    finished_BW: Array
    last_BW: Array
    tokens_BWL: Array  # L: the current stage's slots
    log_probs_BW: Array
    lengths_BW: Array
    cache: PyTree

    def sentence_done(self) -> Array:
        return jnp.all(self.finished_BW, axis=1)

    def with_room(self, slots: int) -> BeamState:
        return self._replace(tokens_BWL=_pad_tokens(self.tokens_BWL, slots))

    def beams(self) -> tuple[Array, Array, Array]:
        """(tokens [B, W, L], log_probs [B, W], lengths [B, W])."""
        return self.tokens_BWL, self.log_probs_BW, self.lengths_BW

    @classmethod
    def start(cls, cache_R: PyTree, batch: int, width: int, slots: int) -> BeamState:
        return cls(
            step_B=jnp.zeros((batch,), jnp.int32),
            finished_BW=jnp.zeros((batch, width), bool),
            last_BW=jnp.full((batch, width), BOS_ID, jnp.int32),
            tokens_BWL=jnp.full((batch, width, slots), PAD_ID, jnp.int32),
            # All W beams start as the same empty prefix; only the first is live, so candidates are not duplicated.
            log_probs_BW=jnp.tile(jnp.array([0.0] + [NEG_INF] * (width - 1), jnp.float32), (batch, 1)),
            lengths_BW=jnp.zeros((batch, width), jnp.int32),
            cache=cache_R,
        )

    def advance(self, decode_step: DecodeStep, max_len_B: Array, alpha: Array | float, best_only: bool) -> BeamState:
        """One step of beam search (see beam_search)."""
        s = self
        batch, width = s.finished_BW.shape
        log_probs_RV, cache = _next_log_probs(decode_step, s.last_BW.reshape(-1), s.cache)
        vocab = log_probs_RV.shape[-1]
        log_probs_BWV = log_probs_RV.reshape(batch, width, vocab)
        # Candidate log-probabilities: extensions of unfinished beams; a finished beam only continues with PAD.
        is_pad_V = jnp.arange(vocab) == PAD_ID
        fin_BW1 = s.finished_BW[..., None]
        cand_BWV = jnp.where(
            fin_BW1,
            jnp.where(is_pad_V, s.log_probs_BW[..., None], NEG_INF),
            s.log_probs_BW[..., None] + log_probs_BWV,
        )
        cand_len_BW = jnp.where(s.finished_BW, s.lengths_BW, s.step_B[:, None] + 1)
        score_BWV = cand_BWV / length_penalty(cand_len_BW, alpha)[..., None]
        score_BW, flat_BW = jax.lax.top_k(score_BWV.reshape(batch, width * vocab), width)
        beam_BW, token_BW = flat_BW // vocab, (flat_BW % vocab).astype(jnp.int32)

        def pick(x_BW: Array) -> Array:
            return jnp.take_along_axis(x_BW, beam_BW, axis=1)

        log_probs_BW = jnp.take_along_axis(cand_BWV.reshape(batch, -1), flat_BW, axis=1)
        tokens_BWL = jnp.take_along_axis(s.tokens_BWL, beam_BW[..., None], axis=1)
        # A beam finishes on EOS, at its sentence's maximum length, or when nothing finite is left (-inf: dead).
        finished_BW = (
            pick(s.finished_BW) | (token_BW == EOS_ID) | (s.step_B + 1 >= max_len_B)[:, None] | (score_BW == NEG_INF)
        )
        if best_only:
            best_finished_B = jnp.max(jnp.where(finished_BW, score_BW, NEG_INF), axis=1)
            lp_max_B = jnp.maximum(length_penalty(s.step_B + 1, alpha), length_penalty(max_len_B, alpha))
            bound_BW = jnp.where(finished_BW, NEG_INF, log_probs_BW / lp_max_B[:, None])
            settled_B = jnp.max(bound_BW, axis=1) < best_finished_B
            finished_BW = finished_BW | settled_B[:, None]
        rows_R = (jnp.arange(batch)[:, None] * width + beam_BW).reshape(-1)
        return BeamState(
            step_B=jnp.where(s.sentence_done(), s.step_B, s.step_B + 1),
            finished_BW=finished_BW,
            last_BW=token_BW,
            tokens_BWL=_write(tokens_BWL, s.step_B[:, None], token_BW),
            log_probs_BW=log_probs_BW,
            lengths_BW=pick(cand_len_BW),
            cache=gather_rows(cache, rows_R),
        )


def best_first(tokens_BWL: Array, log_probs_BW: Array, lengths_BW: Array, alpha: Array | float) -> BeamResult:
    """The beams of each sentence sorted by score log P / lp(length), best first."""
    scores_BW, order_BW = jax.lax.top_k(log_probs_BW / length_penalty(lengths_BW, alpha), log_probs_BW.shape[1])

    def sort(x: Array) -> Array:
        idx = order_BW.reshape(order_BW.shape + (1,) * (x.ndim - 2))
        return jnp.take_along_axis(x, idx, axis=1)

    return BeamResult(sort(tokens_BWL), scores_BW, sort(log_probs_BW), sort(lengths_BW))


def greedy_search(
    decode_step: DecodeStep,
    cache: PyTree,
    max_len_B: Array,
    *,
    max_steps: int,
    grow: GrowCache | None = None,
) -> GreedyResult:
    """Takes the most probable token at each step. `cache` has B rows; 1 <= max_len_B <= max_steps.

    With `grow` (see Decoder), the cache starts small and grows in stages (module docstring).
    """
    first = max_steps if grow is None else cache_stages(max_steps)[0]
    init = GreedyState.start(cache, max_len_B.shape[0], first)
    s = _run_stages(lambda s: s.advance(decode_step, max_len_B), init, max_steps, grow)
    return GreedyResult(_pad_tokens(s.tokens_BL, max_steps), s.log_probs_B, s.step_B)


def beam_search(
    decode_step: DecodeStep,
    cache: PyTree,
    max_len_B: Array,
    *,
    beam_size: int,
    alpha: Array | float,
    max_steps: int,
    grow: GrowCache | None = None,
    best_only: bool = False,
) -> BeamResult:
    """Beam search with the length penalty lp; `cache` has B rows and is tiled to R = B W rows here, once.

    Each step, every unfinished beam proposes its V extensions (score log P / lp(t+1)) and every finished beam
    proposes itself followed by PAD (its score unchanged); the best W of these W V candidates per sentence
    survive, and the cache rows are reordered to follow them. A sentence is done when all W beams have finished,
    so beam_size=1 is exactly greedy search, and a beam large enough to keep every candidate is exhaustive search.
    With `grow` (see Decoder), the cache starts small and grows in stages (module docstring).

    best_only: a sentence also stops once no unfinished beam can overtake its best finished one. log P only falls
    as tokens are added, so an unfinished beam's final score is at most log P / max(lp(t + 1), lp(max_len)); when
    every such bound is below the best finished score, that hypothesis is the search's answer, as it would be after
    running on. The first beam is then exactly the full search's; the others are returned as they stood (an
    unfinished one without EOS). Translation needs only the first beam, and this saves the steps in which the
    worse beams of a finished sentence wander on to its length limit.
    """
    first = max_steps if grow is None else cache_stages(max_steps)[0]
    batch = max_len_B.shape[0]
    init = BeamState.start(tile_beams(cache, beam_size), batch, beam_size, first)
    s = _run_stages(lambda s: s.advance(decode_step, max_len_B, alpha, best_only), init, max_steps, grow)
    return best_first(_pad_tokens(s.tokens_BWL, max_steps), s.log_probs_BW, s.lengths_BW, alpha)


# -- the Transformer behind the decode-step interface ------------------------------------------------------------


def _split_cache(full: PyTree, beam_size: int) -> tuple[PyTree, PyTree]:
    """The model's decoding cache as (context, cache): what stays fixed per sentence, tiled over the beams once (the
    source's segment ids and the cross-attention keys/values), and what changes per step, with B rows (the write
    index and the self-attention keys/values)."""
    context = tile_beams({"src_segment_ids": full["src_segment_ids"], "cross": full["cross"]}, beam_size)
    return context, {"index": full["index"], "self": full["self"]}


def _context_step(model: nnx.Module, context: PyTree) -> DecodeStep:
    """model.decode as a decode step over the per-step cache, the fixed context closed over.

    The context is the same for every beam of a sentence, so closing over it (instead of carrying it through the
    loop) spares the beam search reordering it every step."""

    def decode_step(tokens_R1: Array, cache: PyTree) -> tuple[Array, PyTree]:
        logits_R1V, new = model.decode(None, tokens_R1, cache={**context, **cache})
        return logits_R1V, {"index": new["index"], "self": new["self"]}

    return decode_step


def cached_decode_step(
    model: nnx.Module, memory_BSD: Array, src_segment_ids_BS: Array, *, beam_size: int, max_steps: int
) -> Decoder:
    """A Decoder over `model.decode` with a KV cache that grows in stages; for use inside a traced function.

    The cross-attention keys/values are projected once per sentence (`init_cache`) and tiled over the beams once
    (`_split_cache`). The returned cache holds what changes per step, with B rows (the search tiles them), and room
    for the first stage's steps.
    """
    full = model.init_cache(memory_BSD, src_segment_ids_BS, cache_stages(max_steps)[0])
    context, cache = _split_cache(full, beam_size)
    return Decoder(_context_step(model, context), cache, model.grow_cache)


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


@functools.partial(jax.jit, static_argnames=("graphdef", "beam_size", "max_steps", "use_cache"))
def _search(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    src_BS: Array,
    max_len_B: Array,
    alpha: Array,
    *,
    beam_size: int,
    max_steps: int,
    use_cache: bool,
) -> BeamResult:
    """The whole search in one jitted call, every sentence's rows to the end (the reference of the refilling one)."""
    model = nnx.merge(graphdef, state)
    src_segment_ids_BS = unpacked_segment_ids(src_BS)
    memory_BSD = model.encode(src_BS, src_segment_ids_BS)
    make = cached_decode_step if use_cache else recompute_decode_step
    d = make(model, memory_BSD, src_segment_ids_BS, beam_size=beam_size, max_steps=max_steps)
    if beam_size == 1:
        g = greedy_search(d.step, d.cache, max_len_B, max_steps=max_steps, grow=d.grow)
        return best_first(g.tokens[:, None], g.log_probs[:, None], g.lengths[:, None], alpha)
    return beam_search(
        d.step, d.cache, max_len_B, beam_size=beam_size, alpha=alpha, max_steps=max_steps, grow=d.grow, best_only=True
    )


# -- refilling: finished sentences leave the running batch and waiting ones take their rows -----------------------

MIN_ROWS = 8  # sentences: a step over fewer costs about the same (reading the weights dominates it)
# A batch of at most this many rows grows its cache to the last stage at once, trading longer cache reads in a few
# small steps for the compilations of the stages between (first greedy test2016 translation: 34 -> 29 s, loaded).
FULL_CACHE_ROWS = 32
# Waiting sentences are encoded with their sources padded to a multiple of this (then padded to the running batch's
# source length, one of translate()'s few): the encoder, ~1/4 of greedy's time, reads fewer padding tokens (test2016
# in blocks of 64: 21.0k instead of 24.6k source slots), for an encoder compilation per length.
ENCODE_MULTIPLE = 8


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


class _Programs(NamedTuple):
    """The jitted calls of the refilling search for one model graph (see `_programs`)."""

    start: Callable  # (params, src_BS, *, beam_size, slots) -> (context, state with `slots` slots)
    encode: Callable  # (params, src_KS, *, beam_size) -> the context of K new sentences
    insert: Callable  # (context, state, block, first, rows_K, *, beam_size) -> (context, state)
    grow: Callable  # (params, state, *, slots) -> state with `slots` slots
    widen: Callable  # (params, context, *, src_len) -> context with sources padded to src_len
    stage: Callable  # (params, context, state, max_len_B, alpha, stop_live) -> state


def _beam_rows(rows_K: Array, beam_size: int) -> Array:
    """The cache rows [K W] of the sentences rows_K: sentence k's beams are rows k W ... k W + W - 1."""
    return (rows_K[:, None] * beam_size + jnp.arange(beam_size)).reshape(-1)


def source_batch(sources: Sequence[Sequence[int]], rows: int, src_len: int) -> np.ndarray:
    """[rows, src_len] int32: the sources (ids then EOS) PAD-padded, then dummy rows of an empty source (EOS only),
    which decode for one step and are dropped."""
    src_BS = np.full((rows, src_len), PAD_ID, np.int32)
    src_BS[:, 0] = EOS_ID
    for r, ids in enumerate(sources):
        src_BS[r, : len(ids)] = ids
    return src_BS


def _restart(s, rows_K: Array, beam_size: int):
    """The state with the sentences in rows_K (out-of-range rows are dropped) back at the start: nothing emitted.

    The rows' self-attention slots keep the previous sentence's keys and values: a row's slots after its write
    index are hidden by causality, and the new sentence overwrites each before it can attend to it.
    """
    slots = s.beams()[0].shape[-1]
    batch = rows_K.shape[0]
    fresh = GreedyState.start(None, batch, slots) if beam_size == 1 else BeamState.start(None, batch, beam_size, slots)
    per_sentence = {f: getattr(s, f).at[rows_K].set(getattr(fresh, f), mode="drop") for f in s._fields if f != "cache"}
    rows_R = _beam_rows(rows_K, beam_size)
    return s._replace(**per_sentence, cache={**s.cache, "index": s.cache["index"].at[rows_R].set(0, mode="drop")})


@functools.lru_cache(maxsize=8)
def _programs(graphdef: nnx.GraphDef, treedef: jax.tree_util.PyTreeDef) -> _Programs:
    """The refilling search's jitted calls with the graph and the parameters' structure closed over; `params` is
    the list of the parameters' leaves (`Searcher`).

    jit hashes and compares its static arguments on every call (~1.7 ms for the small model's GraphDef) and
    flattens its arguments (~0.25 ms for an nnx.State): ~0.3 s each over the ~250 calls of a greedy test2016
    translation. Looked up here once per searcher, the graph is hashed once, and a list of arrays flattens fast.
    """

    def merge(params: list[Array]) -> nnx.Module:
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, params))

    def encode(params: list[Array], src_BS: Array, *, beam_size: int):
        """The fixed context of the sentences src_BS (cross-attention keys/values, source segment ids), R rows."""
        model = merge(params)
        seg_BS = unpacked_segment_ids(src_BS)
        return _split_cache(model.init_cache(model.encode(src_BS, seg_BS), seg_BS, 0), beam_size)[0]

    def start(params: list[Array], src_BS: Array, *, beam_size: int, slots: int):
        """Encodes the batch; the fixed context (R rows) and the search's first state, with `slots` slots."""
        model = merge(params)
        seg_BS = unpacked_segment_ids(src_BS)
        context, cache = _split_cache(model.init_cache(model.encode(src_BS, seg_BS), seg_BS, slots), beam_size)
        batch = src_BS.shape[0]
        if beam_size == 1:
            return context, GreedyState.start(cache, batch, slots)
        return context, BeamState.start(tile_beams(cache, beam_size), batch, beam_size, slots)

    def insert(context: PyTree, s, block: PyTree, first: Array, rows_K: Array, *, beam_size: int):
        """The sentences first, first + 1, ... of an encoded block (its context) take the rows rows_K of the running
        batch, one each (a row past the batch's end: that sentence is not taken)."""
        take = rows_K.shape[0] * beam_size
        new = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, first * beam_size, take), block)
        rows_R = _beam_rows(rows_K, beam_size)
        context = jax.tree.map(lambda x, n: x.at[rows_R].set(n, mode="drop"), context, new)
        return context, _restart(s, rows_K, beam_size)

    def grow(params: list[Array], s, *, slots: int):
        """The state with its cache and output buffer grown to `slots` (a call of its own, so that `stage` compiles
        for one input shape per cache size)."""
        return s.with_room(slots)._replace(cache=merge(params).grow_cache(s.cache, slots))

    def widen(params: list[Array], context: PyTree, *, src_len: int):
        """The context with its sources padded to src_len positions (for longer sentences to join)."""
        return merge(params).grow_source(context, src_len)

    def stage(params: list[Array], context: PyTree, s, max_len_B: Array, alpha: Array, stop_live: Array):
        """Steps until at most `stop_live` sentences are live (traced, so it compiles per batch size and cache size
        only) or a live sentence has filled the cache: then the host has something to do."""
        step = _context_step(merge(params), context)
        if isinstance(s, GreedyState):
            advance = functools.partial(GreedyState.advance, decode_step=step, max_len_B=max_len_B)
        else:
            advance = functools.partial(
                BeamState.advance, decode_step=step, max_len_B=max_len_B, alpha=alpha, best_only=True
            )
        slots = s.beams()[0].shape[-1]

        def go_on(s) -> Array:
            live_B = ~s.sentence_done()
            return (jnp.sum(live_B) > stop_live) & (jnp.max(jnp.where(live_B, s.step_B, 0)) < slots)

        return jax.lax.while_loop(go_on, advance, s)

    return _Programs(
        jax.jit(start, static_argnames=("beam_size", "slots")),
        jax.jit(encode, static_argnames=("beam_size",)),
        jax.jit(insert, static_argnames=("beam_size",), donate_argnums=(0, 1)),
        jax.jit(grow, static_argnames=("slots",)),
        jax.jit(widen, static_argnames=("src_len",)),
        jax.jit(stage, donate_argnums=(2,)),
    )


@functools.partial(jax.jit, static_argnames=("beam_size",))
def _keep(context: PyTree, s, keep_K: Array, *, beam_size: int):
    """The context and state of the sentences keep_K only (per-sentence fields and their beam_size rows each)."""
    rows_R = _beam_rows(keep_K, beam_size)
    per_sentence = {f: jnp.take(getattr(s, f), keep_K, axis=0) for f in s._fields if f != "cache"}
    return gather_rows(context, rows_R), s._replace(**per_sentence, cache=gather_rows(s.cache, rows_R))


Shape = Callable[[int], tuple[int, int]]  # longest source of a batch -> (padded source length, most output slots)


def _sorted_beams(tokens_WL: np.ndarray, scores_W: np.ndarray, log_probs_W: np.ndarray, lengths_W: np.ndarray):
    """One sentence's beams best first, as `best_first` sorts them (ties: the lower beam first)."""
    order = np.argsort(-scores_W, kind="stable")
    return BeamResult(tokens_WL[order], scores_W[order], log_probs_W[order], lengths_W[order])


def _refilling_search(
    programs: _Programs,
    params: list[Array],
    sources: Sequence[np.ndarray],
    max_len_N: np.ndarray,
    alpha: float,
    *,
    beam_size: int,
    rows: int,
    shape: Shape,
    progress: Callable[[int], Any] | None = None,
) -> list[BeamResult]:
    """The cached search of every sentence through one running batch of `rows` sentences; their beams, best first.

    A step costs the same for a finished sentence's rows as for a live one's, and outputs differ in length (Multi30k
    test2016, greedy, batches of 64: 57% of the row-steps went to sentences already finished). So the search runs in
    jitted calls (`stage`) that step until the host has something to do: MIN_ROWS rows are free while sentences
    wait, or (nothing waiting) the live sentences fit in a batch half the size, or a live one has filled the cache.
    Between calls the host records the finished sentences and gives their rows to waiting ones (shortest sources
    first; encoded in blocks of about `rows`, a multiple of MIN_ROWS, the encoder's efficient size; joining
    `refill_size` at a time), or moves the live sentences into the smaller batch (`compacted_size`), or grows the
    cache to its next stage. Each sentence decodes at its own position (the search's step_B, the cache's per-row
    index), so rows that joined at different times share the batch. The stop condition is traced, so the calls
    compile per (rows, source length, cache stage) only; a batch of at most FULL_CACHE_ROWS rows with nothing
    waiting skips to the last stage. Results equal the one-jit `_search`'s: a sentence's rows never interact with
    another's.
    """
    queue = collections.deque(sorted(range(len(sources)), key=lambda i: len(sources[i])))
    results: list[BeamResult | None] = [None] * len(sources)
    src_len, max_steps = 0, 0  # of the running batch: they grow as longer sources join (`take`)

    def take(k: int) -> tuple[list[int], np.ndarray]:
        """The next k waiting sentences as a [k, S] batch (rows past the queue's end: an empty source), S their
        longest source rounded up to ENCODE_MULTIPLE, at most the running batch's src_len (which grows to hold it)."""
        nonlocal src_len, max_steps
        ids = [queue.popleft() for _ in range(min(k, len(queue)))]
        longest = len(sources[ids[-1]])  # sorted: the last is the longest
        longest_src_len, longest_max_steps = shape(longest)
        src_len, max_steps = max(src_len, longest_src_len), max(max_steps, longest_max_steps)
        encoded_len = min(-(-longest // ENCODE_MULTIPLE) * ENCODE_MULTIPLE, src_len)
        return ids, source_batch([sources[i] for i in ids], k, encoded_len)

    def record(s, finished: np.ndarray) -> None:
        tokens, log_probs, lengths = jax.device_get(s.beams())
        scores = log_probs / np.asarray(length_penalty(lengths, alpha))
        for r in finished:
            results[sentence[r]] = _sorted_beams(tokens[r], scores[r], log_probs[r], lengths[r])
        if progress is not None:
            progress(len(finished))

    ids, src_KS = take(rows)
    src_KS = np.pad(src_KS, [(0, 0), (0, src_len - src_KS.shape[1])], constant_values=PAD_ID)
    sentence = np.array(ids + [-1] * (rows - len(ids)))  # the sentence in each row; -1: none (finished or dummy)
    max_len_R = np.ones(rows, np.int32)  # a row without a sentence stops after one step
    max_len_R[: len(ids)] = max_len_N[ids]
    step_R = np.zeros(rows, np.int32)
    block_ids: list[int] = []  # an encoded block of waiting sentences (`block`), of which `joined` have joined
    block, joined = None, 0
    block_rows = rows - rows % MIN_ROWS  # a multiple of MIN_ROWS, so that refill sizes divide what is left of it
    width = cache_stages(max_steps)[0]
    context, s = programs.start(params, src_KS, beam_size=beam_size, slots=width)
    while True:
        waiting = bool(queue) or joined < len(block_ids)
        free = np.flatnonzero(sentence < 0)
        while waiting and len(free) >= MIN_ROWS:  # waiting sentences take the free rows
            if joined == len(block_ids):  # the next block_rows waiting sentences, encoded together
                block_ids, src_KS = take(block_rows)
                block, joined = programs.encode(params, src_KS, beam_size=beam_size), 0
                if src_KS.shape[1] < src_len:
                    block = programs.widen(params, block, src_len=src_len)
                if src_len > context["src_segment_ids"].shape[1]:
                    context = programs.widen(params, context, src_len=src_len)
            # The block's rows left are a multiple of MIN_ROWS (the block is, and so is every refill size).
            k = refill_size(min(len(free), block_rows - joined), rows)
            ids = block_ids[joined : joined + k]
            into = np.full(k, rows, np.int32)  # the block's dummy rows go past the batch's end: dropped
            into[: len(ids)] = free[: len(ids)]
            context, s = programs.insert(context, s, block, np.int32(joined), into, beam_size=beam_size)
            joined += len(ids)
            sentence[into[: len(ids)]] = ids
            max_len_R[into[: len(ids)]] = max_len_N[ids]
            step_R[into[: len(ids)]] = 0
            waiting = bool(queue) or joined < len(block_ids)
            free = np.flatnonzero(sentence < 0)
        live = np.flatnonzero(sentence >= 0)
        if not waiting:
            if not len(live):
                return results
            size = compacted_size(len(live), rows)
            if size < rows:
                keep = np.concatenate([live, free[: size - len(live)]])
                context, s = _keep(context, s, jnp.asarray(keep), beam_size=beam_size)
                sentence, max_len_R, step_R, rows = sentence[keep], max_len_R[keep], step_R[keep], size
                live = np.flatnonzero(sentence >= 0)
        if not waiting and rows * beam_size <= FULL_CACHE_ROWS:
            slots = max_steps
        else:  # room for the furthest live sentence's next token
            slots = next(n for n in cache_stages(max_steps) if n > np.max(step_R[live]))
        if slots > width:
            s, width = programs.grow(params, s, slots=slots), slots
        # Run until the host can act: MIN_ROWS rows free for waiting sentences, or (nothing waiting) the live ones
        # fit in a batch half the size, or a live sentence fills the cache.
        half = -(-rows // 2)
        stop_live = rows - MIN_ROWS if waiting else (half if half >= MIN_ROWS else 0)
        s = programs.stage(params, context, s, max_len_R, alpha, np.int32(stop_live))
        done, step_R = (np.array(x) for x in jax.device_get((s.sentence_done(), s.step_B)))
        finished = np.flatnonzero((sentence >= 0) & done)
        if len(finished):
            record(s, finished)
            sentence[finished] = -1


class Searcher:
    """Search bound to a model's parameters as they are now: split once, then jitted calls.

    nnx.split walks the whole module graph (~0.2 s for the 3+3-layer model on a 2-core CPU), so translate() makes
    one Searcher per call. Runs the model in eval mode (dropout off) without changing the caller's model; later
    changes to the model's parameters are not seen.
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
        self.leaves, treedef = jax.tree.flatten(self.params)  # what the refilling search's calls take
        self.programs = _programs(self.graphdef, treedef) if use_cache and compact else None

    def _one_jit(self, src_BS: Array, max_len_B: Array, *, beam_size: int, alpha: float, max_steps: int):
        return _search(
            self.graphdef,
            self.params,
            jnp.asarray(src_BS, jnp.int32),
            jnp.asarray(max_len_B, jnp.int32),
            jnp.asarray(alpha, jnp.float32),
            beam_size=beam_size,
            max_steps=max_steps,
            use_cache=self.use_cache,
        )

    def __call__(self, src_BS: Array, max_len_B: Array, *, beam_size: int, alpha: float, max_steps: int) -> BeamResult:
        """One batch: src [B, S] (PAD-padded, EOS-terminated); beam_size 1 runs greedy search.

        Batches of at least 2 MIN_ROWS sentences run the refilling search (nothing waits, so finished sentences
        only leave); smaller ones, or without compaction, the whole search is one jitted call (`_search`).
        """
        if self.programs is None or src_BS.shape[0] < 2 * MIN_ROWS:
            return self._one_jit(src_BS, max_len_B, beam_size=beam_size, alpha=alpha, max_steps=max_steps)
        src_BS = np.asarray(src_BS, np.int32)
        found = _refilling_search(
            self.programs,
            self.leaves,
            list(src_BS),
            np.asarray(max_len_B, np.int32),
            alpha,
            beam_size=beam_size,
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
        shape: Shape,
        progress: Callable[[int], Any] | None = None,
    ) -> list[BeamResult]:
        """Every sentence's beams (best first; tokens [W, L] with L at least its longest beam), decoded `batch_size`
        sentences at a time: sources are id lists (EOS-terminated), max_len_N their output limits, and
        shape(longest source) the padded source length and the most output slots of a batch. progress(n) is
        called as n more sentences are done.

        With compaction and at least 2 MIN_ROWS rows, they run through `_refilling_search`: greedy search in one
        refilled batch, beam search batch by batch (see below); otherwise in consecutive one-jit batches. Shortest
        sources go first. The batch has batch_size rows, or as many as the sentences rounded up to a multiple of 8
        when fewer.
        """
        rows = min(batch_size, -(-len(sources) // 8) * 8)
        max_len_N = np.asarray(max_len_N, np.int32)
        if not len(sources):
            return []
        order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
        results: list[BeamResult | None] = [None] * len(sources)
        if self.programs is not None and rows >= 2 * MIN_ROWS:
            # Greedy search refills one running batch. Beam search runs batch by batch (finished sentences only
            # leave): it reorders its whole cache every step, and the wider cache a refilled batch keeps (its
            # longest live sentence sets it) cost more than the finished rows it saved (test2016, batch 64, beam 4:
            # 11.6 s batch by batch, 14.9 s refilled; greedy: 4.3 s batch by batch, 3.8-4.1 s refilled).
            for group in [order] if beam_size == 1 else [order[j : j + rows] for j in range(0, len(order), rows)]:
                found = _refilling_search(
                    self.programs,
                    self.leaves,
                    [np.asarray(sources[i], np.int32) for i in group],
                    max_len_N[group],
                    alpha,
                    beam_size=beam_size,
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
            src_BS = source_batch([sources[i] for i in batch], rows, src_len)
            max_len_B = np.ones((rows,), np.int32)  # a dummy row stops after one step
            max_len_B[: len(batch)] = max_len_N[batch]
            found = jax.device_get(
                self._one_jit(src_BS, max_len_B, beam_size=beam_size, alpha=alpha, max_steps=max_steps)
            )
            for r, i in enumerate(batch):
                results[i] = BeamResult(*(x[r] for x in found))
            if progress is not None:
                progress(len(batch))
        return results


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
) -> BeamResult:
    """Encodes src [B, S] (PAD-padded, EOS-terminated) and searches, jitted; beam_size 1 runs greedy search.

    Compiles per (graph, shapes, beam_size, cache stage, compacted batch size); alpha is traced, so changing it does
    not recompile.
    Runs the model in eval mode (dropout off) without changing the caller's model. For many batches of one model,
    use `searcher`. A sentence stops once its best hypothesis is settled (beam_search's best_only): the first beam
    is the full search's; the others are as they stood then.
    """
    return searcher(model, use_cache=use_cache, compact=compact)(
        src_BS, max_len_B, beam_size=beam_size, alpha=alpha, max_steps=max_steps
    )
