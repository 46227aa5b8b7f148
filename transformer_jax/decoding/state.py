"""The search state: greedy, beam and set-aside beam search as loop states over a generic decode step.

Axis letters: see transformer_jax/__init__.py (here B sentences, W beams per sentence, R = B W rows with row b W + w
beam w of sentence b, L output slots = max_steps).

A decode step is `decode_step(tokens_R1, cache) -> (logits_R1V, cache)`: the next-token logits of every row. The
cache is any pytree whose non-scalar leaves have the rows on axis 0 (scalar leaves, such as a stub's step counter,
are shared by all rows). The states need only this interface (and `Decoder`'s grow and reorder), so tests drive them
with stubs whose distributions they control.

Search (every state; the reserved ids are the model's, a model.layers.SpecialIds `ids`): the decoder input starts with
BOS; PAD is never emitted (its logit is masked, as Marian's bad_words_ids do; log-probabilities keep their
normalisation over the whole vocabulary), nor is a multilingual model's language token except where a target prefix
forces it (`choosable`), adding 0 to the log-probability and one to the length; a hypothesis finishes when it emits
EOS or reaches its sentence's maximum length `max_len_B` (then it is kept as it is, without EOS); after that only
PAD follows and its score never changes.
Lengths |Y| count the emitted tokens, EOS included. `jax.lax.while_loop` runs the steps and stops as soon as every
hypothesis of every sentence has finished.

Cache stages: a step reads every slot of the self-attention cache, so its cost grows with the cache's size, not
with the tokens decoded so far, and outputs are mostly much shorter than their limit. So a search with a `grow`
function runs one while_loop per stage of growing cache size (`cache_stages`), each compiled once, until its slots
are full or every hypothesis has finished; the results equal one loop over max_steps slots (empty slots are never
attended).

The states (GreedyState, BeamState, SetAsideState) are the loop carries that a search spec (specs.py) starts and
advances; the scheduler (scheduler.py) also moves sentences between batches through `restart` and `select`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from transformer_jax.model.layers import SpecialIds

Array = jax.Array
PyTree = Any
DecodeStep = Callable[[Array, PyTree], tuple[Array, PyTree]]
GrowCache = Callable[[PyTree, int], PyTree]
Reorder = Callable[[PyTree, Array], PyTree]  # (cache, rows_R) -> the cache whose row r continues row rows_R[r]
NEG_INF = -jnp.inf
FIRST_STAGE = 16  # slots of the first cache stage: most Multi30k outputs (~13 tokens) finish inside it
# `top_k` reads the vocabulary in blocks of this many logits (fastest of 16-128 on [256, 8000], docs/benchmarks.md).
TOP_K_BLOCK = 64


class Decoder(NamedTuple):
    """A decode step, its initial cache, `grow(cache, n)` giving the cache room for n steps (None: it has room for
    max_steps already), and `reorder(cache, rows_R)`, how beam search makes the cache follow its beams (default
    `gather_rows`: every row moves; the Transformer moves less, model/transformer.py reorder_cache)."""

    step: DecodeStep
    cache: PyTree
    grow: GrowCache | None = None
    reorder: Reorder | None = None


def cache_stages(max_steps: int) -> list[int]:
    """Cache sizes of the stages: doubling from FIRST_STAGE, then max_steps once doubling would pass 3/4 of it
    (a last stage of a few slots would cost a compilation and save nothing)."""
    stages = [min(FIRST_STAGE, max_steps)]
    while stages[-1] < max_steps:
        doubled = 2 * stages[-1]
        stages.append(doubled if doubled < 0.75 * max_steps else max_steps)
    return stages


def run_stages(body: Callable, state: NamedTuple, max_steps: int, grow: GrowCache | None, ids: SpecialIds):
    """Runs the search loop over the cache stages (one loop over max_steps slots when grow is None)."""
    if grow is None:
        return _loop(body, state, max_steps)
    for slots in cache_stages(max_steps):
        state = _loop(body, state.with_room(slots, ids)._replace(cache=grow(state.cache, slots)), slots)
    return state


def _loop(body: Callable, state: NamedTuple, slots: int):
    """while_loop(body) until the cache's `slots` are full or every sentence is done."""

    def cond(s: NamedTuple) -> Array:
        # The sentences still running are all at the same step, the most any sentence has taken.
        return (jnp.max(s.step_B) < slots) & ~jnp.all(s.sentence_done())

    return jax.lax.while_loop(cond, body, state)


GNMT, AVERAGE, NONE = "gnmt", "average", "none"
LENGTH_PENALTIES = (GNMT, AVERAGE, NONE)


def length_penalty(length: Array | int, alpha: Array | float, penalty: str = GNMT) -> Array:
    """The divisor lp(Y) of a hypothesis's score log P(Y|X) / lp(Y), by `penalty`:

    gnmt: ((5 + |Y|) / 6) ** alpha (Wu et al., 2016); average: |Y| ** alpha (alpha 1: the per-token mean, fairseq's
    --lenpen and Marian's --normalize); none: 1 (the plain log-probability). Every lp grows with |Y| for alpha >= 0,
    which beam search's early stop relies on.
    """
    length = jnp.asarray(length, jnp.float32)
    if penalty == GNMT:
        return ((5.0 + length) / 6.0) ** alpha
    if penalty == AVERAGE:
        return jnp.maximum(length, 1.0) ** alpha
    if penalty == NONE:
        return jnp.ones_like(length)
    raise ValueError(f"unknown length penalty {penalty!r}; expected one of {', '.join(LENGTH_PENALTIES)}")


def tile_beams(tree: PyTree, beam_size: int) -> PyTree:
    """Repeats every non-scalar leaf beam_size times along axis 0: [B, ...] -> [R, ...], beams of a row adjacent."""
    return jax.tree.map(lambda x: x if jnp.ndim(x) == 0 else jnp.repeat(x, beam_size, axis=0), tree)


def gather_rows(tree: PyTree, rows_R: Array) -> PyTree:
    """Reorders every non-scalar leaf along axis 0 (the beam reordering of the cache); scalars stay."""
    return jax.tree.map(lambda x: x if jnp.ndim(x) == 0 else jnp.take(x, rows_R, axis=0), tree)


def max_and_logsumexp(logits: Array) -> tuple[Array, Array]:
    """(m, l) of logits [..., V], each [..., 1]: their max and log sum exp(x - m), so that log_softmax(x) =
    (x - m) - l with jax.nn.log_softmax's own operations (equal bits), for a search that needs it at a few entries."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    return top, jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1, keepdims=True))


def top_k(x_RV: Array, k: int) -> tuple[Array, Array]:
    """jax.lax.top_k(x_RV, k) for rows of many entries (a vocabulary), with equal values and indices, ties (the
    lower index first) included, for x without NaN.

    XLA:CPU's TopK sorts the whole row, a beam step's largest cost after the logits matmul; this reads the row
    twice instead (docs/benchmarks.md has the measurement). Here the row is cut into blocks of TOP_K_BLOCK: the k
    blocks of the largest maxima hold the row's k largest entries (any entry outranked by the maxima of k other
    blocks is outranked by k entries), so a top-k over the block maxima and one over those k blocks' entries,
    taken in index order, give lax.top_k's answer."""
    rows, size = x_RV.shape
    blocks = -(-size // TOP_K_BLOCK)
    if blocks < 2 * k:  # too few blocks to save anything
        return jax.lax.top_k(x_RV, k)
    padded = jnp.pad(x_RV, [(0, 0), (0, blocks * TOP_K_BLOCK - size)], constant_values=NEG_INF)
    blocked = padded.reshape(rows, blocks, TOP_K_BLOCK)
    # [R, k]: the k best blocks, in index order, so that among equal entries the lower index comes first
    best = jnp.sort(jax.lax.top_k(jnp.max(blocked, axis=-1), k)[1], axis=-1)
    entries = jnp.take_along_axis(blocked, best[..., None], axis=1).reshape(rows, k * TOP_K_BLOCK)
    values, at = jax.lax.top_k(entries, k)
    return values, jnp.take_along_axis(best, at // TOP_K_BLOCK, axis=1) * TOP_K_BLOCK + at % TOP_K_BLOCK


def first_argmax(x_BV: Array) -> Array:
    """jnp.argmax over the last axis (the first index of the maximum), as two plain reductions.

    XLA:CPU lowers argmax to a variadic (value, index) reduction, which it vectorises worse than a max and a min
    over a batch of logits, a visible part of a greedy step. A row with a NaN has no index equal to its max
    and gets the last index, where argmax would point at the NaN; either way the output is garbage.
    """
    vocab = x_BV.shape[-1]
    index_BV = jnp.where(x_BV == jnp.max(x_BV, axis=-1, keepdims=True), jnp.arange(vocab, dtype=jnp.int32), vocab)
    return jnp.minimum(jnp.min(index_BV, axis=-1), vocab - 1)


def write_step(seq: Array, step: Array, tokens: Array) -> Array:
    """seq[..., step] = tokens (seq [..., L], tokens [...], step broadcasting against tokens: each row its own slot;
    a step of L or more writes nothing)."""
    return jnp.where(jnp.arange(seq.shape[-1]) == step[..., None], tokens[..., None], seq)


def forced_tokens(prefix_BP: Array, step_B: Array, pad: int) -> Array:
    """[B] the token each sentence must emit at its step: prefix_BP[b, step_B[b]], PAD (none) past the prefix.

    A target prefix is PAD-padded to a common width P; the search emits its tokens first, then continues freely.
    """
    width = prefix_BP.shape[1]
    at_B = jnp.take_along_axis(prefix_BP, jnp.minimum(step_B, width - 1)[:, None], axis=1)[:, 0]
    return jnp.where(step_B < width, at_B, pad)


def choosable(logits_RV: Array, prefix_BP: Array | None, step_B: Array, width: int, ids: SpecialIds) -> Array:
    """The logits of the tokens each row may emit (the others -inf): never PAD or a language token (ids.languages);
    inside its target prefix, a sentence's W beams can only emit the prefix's next token (`forced_tokens`), which may
    be a language token; past it, every other token."""
    vocab_V = jnp.arange(logits_RV.shape[-1])
    barred_V = vocab_V == ids.pad
    if ids.languages:
        barred_V = barred_V | is_language(vocab_V, ids)
    if prefix_BP is None:
        return jnp.where(barred_V, NEG_INF, logits_RV)
    forced_B1 = forced_tokens(prefix_BP, step_B, ids.pad)[:, None]
    allowed_RV = jnp.repeat(jnp.where(forced_B1 == ids.pad, ~barred_V, vocab_V == forced_B1), width, axis=0)
    return jnp.where(allowed_RV, logits_RV, NEG_INF)


def is_language(tokens: Array, ids: SpecialIds) -> Array:
    """Whether each token is one of the model's language tokens (ids.languages)."""
    return jnp.isin(tokens, jnp.asarray(ids.languages, jnp.int32))


def pad_tokens(tokens: Array, slots: int, pad: int) -> Array:
    """tokens [..., L'] padded with `pad` to [..., slots] (L' <= slots): the output buffer grows with the cache."""
    extra = slots - tokens.shape[-1]
    return tokens if extra == 0 else jnp.pad(tokens, [(0, 0)] * (tokens.ndim - 1) + [(0, extra)], constant_values=pad)


def beam_candidates(
    s: NamedTuple, decode_step: DecodeStep, per_beam: int, prefix_BP: Array | None, ids: SpecialIds
) -> tuple[Array, Array, PyTree]:
    """One decode step of the beams s.last_BW: each beam's C = min(per_beam, V) best tokens it may emit, as
    (log-probabilities [B, W, C], tokens [R, C], the step's cache).

    A beam's candidates rank as its tokens' logits do (log P + log_softmax, then / lp, are monotone in the logit), so
    the [R, V] work is the logits' max, their log-sum-exp and a top-k per row. The log-probabilities are
    log_softmax's, computed with its operations (equal bits); only candidates of equal score but different logits may
    be taken in another order than a top-k over all W V would take them.
    """
    batch, width = s.last_BW.shape
    logits_R1V, cache = decode_step(s.last_BW.reshape(-1, 1), s.cache)
    logits_RV = logits_R1V.reshape(batch * width, -1).astype(jnp.float32)
    per_beam = min(per_beam, logits_RV.shape[-1])
    max_R1, lse_R1 = max_and_logsumexp(logits_RV)
    top_RC, token_RC = top_k(choosable(logits_RV, prefix_BP, s.step_B, width, ids), per_beam)
    log_probs_RC = (top_RC - max_R1) - lse_R1
    if ids.languages:  # a language token is only ever forced: probability 1, as transformers' forced BOS gives it
        log_probs_RC = jnp.where(is_language(token_RC, ids) & (top_RC > NEG_INF), 0.0, log_probs_RC)
    return log_probs_RC.reshape(batch, width, per_beam), token_RC, cache


def beam_rows(rows_K: Array, width: int) -> Array:
    """The cache rows [K W] of the sentences rows_K: sentence k's beams are rows k W ... k W + W - 1."""
    return (rows_K[:, None] * width + jnp.arange(width)).reshape(-1)


def restarted(s: NamedTuple, rows_K: Array, fresh: NamedTuple) -> NamedTuple:
    """s with the per-sentence arrays of the sentences rows_K (rows past the end: dropped) set to those of `fresh`, a
    state of len(rows_K) sentences just started; the cache is left as it is."""
    per_sentence = jax.tree.map(
        lambda x, f: x.at[rows_K].set(f, mode="drop"), s._replace(cache=None), fresh._replace(cache=None)
    )
    return per_sentence._replace(cache=s.cache)


def selected(s: NamedTuple, keep_K: Array, width: int) -> NamedTuple:
    """s for the sentences keep_K only: their per-sentence arrays and their `width` cache rows each."""
    per_sentence = jax.tree.map(lambda x: jnp.take(x, keep_K, axis=0), s._replace(cache=None))
    return per_sentence._replace(cache=gather_rows(s.cache, beam_rows(keep_K, width)))


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

    def with_room(self, slots: int, ids: SpecialIds) -> GreedyState:
        return self._replace(tokens_BL=pad_tokens(self.tokens_BL, slots, ids.pad))

    def beams(self) -> tuple[Array, Array, Array]:
        """(tokens [B, 1, L], log_probs [B, 1], lengths [B, 1]): the result as one beam per sentence."""
        return self.tokens_BL[:, None], self.log_probs_B[:, None], self.step_B[:, None]

    def restart(self, rows_K: Array, ids: SpecialIds) -> GreedyState:
        """The sentences in rows_K back at the start (nothing emitted); the cache is the caller's to reset."""
        return restarted(self, rows_K, GreedyState.start(None, rows_K.shape[0], self.tokens_BL.shape[-1], ids))

    def select(self, keep_K: Array) -> GreedyState:
        """The state of the sentences keep_K only, in that order (their W cache rows each; W = 1 here)."""
        return selected(self, keep_K, 1)

    @classmethod
    def start(cls, cache: PyTree, batch: int, slots: int, ids: SpecialIds) -> GreedyState:
        return cls(
            step_B=jnp.zeros((batch,), jnp.int32),
            done_B=jnp.zeros((batch,), bool),
            last_B=jnp.full((batch,), ids.bos, jnp.int32),
            tokens_BL=jnp.full((batch, slots), ids.pad, jnp.int32),
            log_probs_B=jnp.zeros((batch,), jnp.float32),
            cache=cache,
        )

    def advance(
        self,
        decode_step: DecodeStep,
        max_len_B: Array,
        prefix_BP: Array | None = None,
        choose: Callable[[Array, Array], Array] | None = None,
        *,
        ids: SpecialIds,
    ) -> GreedyState:
        """One step: every unfinished sentence appends its prefix's next token, else its most probable token other
        than PAD (or, with `choose`, choose(logits_BV, step_B) of the logits without PAD: a sampled one). log P
        counts the model's own probability, normalised over the whole vocabulary."""
        logits_B1V, cache = decode_step(self.last_B[:, None], self.cache)
        logits_BV = logits_B1V[:, 0].astype(jnp.float32)
        # log_softmax at the argmax, x_max - logsumexp(x) = -log sum exp(x - x_max), without writing and re-reading
        # the [B, V] log_softmax; a token other than the argmax (PAD's logit the largest, sampled, forced) adds its
        # logit's distance to the max.
        max_B1, lse_B1 = max_and_logsumexp(logits_BV)
        allowed_BV = choosable(logits_BV, None, self.step_B, 1, ids)
        token_B = first_argmax(allowed_BV) if choose is None else choose(allowed_BV, self.step_B)
        if prefix_BP is not None:
            forced_B = forced_tokens(prefix_BP, self.step_B, ids.pad)
            token_B = jnp.where(forced_B == ids.pad, token_B, forced_B)
        gain_B = jnp.take_along_axis(logits_BV, token_B[:, None], axis=1)[:, 0] - max_B1[:, 0] - lse_B1[:, 0]
        if ids.languages:  # only ever forced (choosable): it adds 0, as transformers' forced BOS does
            gain_B = jnp.where(is_language(token_B, ids), 0.0, gain_B)
        token_B = jnp.where(self.done_B, ids.pad, token_B)
        return GreedyState(
            step_B=jnp.where(self.done_B, self.step_B, self.step_B + 1),
            done_B=self.done_B | (token_B == ids.eos) | (self.step_B + 1 >= max_len_B),
            last_B=token_B,
            tokens_BL=write_step(self.tokens_BL, self.step_B, token_B),
            log_probs_B=self.log_probs_B + jnp.where(self.done_B, 0.0, gain_B),
            cache=cache,
        )


class BeamState(NamedTuple):
    """The loop state of beam search: per sentence and beam ([B, W]), and the cache with R = B W rows.

    Beam search with the length penalty lp (`length_penalty`'s `penalty`): each step, every unfinished beam proposes
    its V extensions (score log P / lp(t+1)) and every finished beam proposes itself followed by PAD (its score
    unchanged); the best W of these W V candidates per sentence survive, and the cache rows are reordered to follow
    them. A sentence is done when all W beams have finished, so W = 1 is exactly greedy search, and a beam large
    enough to keep every candidate is exhaustive search. With target prefixes, each sentence's beams first follow its
    prefix (as greedy search's), then search freely.

    settle: a sentence also stops once its `settle` best hypotheses (exactly the full search's) are settled
    (`settled`; 0: every beam runs to its end); the others are returned as they stood (an unfinished one without EOS,
    scored by its length so far). This saves the steps in which a finished sentence's worse beams wander on.
    """

    step_B: Array  # int32: steps taken by each sentence (frozen once done)
    finished_BW: Array
    last_BW: Array
    tokens_BWL: Array  # L: the current stage's slots
    log_probs_BW: Array
    lengths_BW: Array
    cache: PyTree

    def sentence_done(self) -> Array:
        return jnp.all(self.finished_BW, axis=1)

    def with_room(self, slots: int, ids: SpecialIds) -> BeamState:
        return self._replace(tokens_BWL=pad_tokens(self.tokens_BWL, slots, ids.pad))

    def beams(self) -> tuple[Array, Array, Array]:
        """(tokens [B, W, L], log_probs [B, W], lengths [B, W])."""
        return self.tokens_BWL, self.log_probs_BW, self.lengths_BW

    def restart(self, rows_K: Array, ids: SpecialIds) -> BeamState:
        _, width, slots = self.tokens_BWL.shape
        return restarted(self, rows_K, BeamState.start(None, rows_K.shape[0], width, slots, ids))

    def select(self, keep_K: Array) -> BeamState:
        return selected(self, keep_K, self.finished_BW.shape[1])

    @classmethod
    def start(cls, cache_R: PyTree, batch: int, width: int, slots: int, ids: SpecialIds) -> BeamState:
        return cls(
            step_B=jnp.zeros((batch,), jnp.int32),
            finished_BW=jnp.zeros((batch, width), bool),
            last_BW=jnp.full((batch, width), ids.bos, jnp.int32),
            tokens_BWL=jnp.full((batch, width, slots), ids.pad, jnp.int32),
            # All W beams start as the same empty prefix; only the first is live, so candidates are not duplicated.
            log_probs_BW=jnp.tile(jnp.array([0.0] + [NEG_INF] * (width - 1), jnp.float32), (batch, 1)),
            lengths_BW=jnp.zeros((batch, width), jnp.int32),
            cache=cache_R,
        )

    def advance(
        self,
        decode_step: DecodeStep,
        max_len_B: Array,
        alpha: Array | float,
        settle: int,
        penalty: str = GNMT,
        prefix_BP: Array | None = None,
        reorder: Reorder | None = None,
        *,
        ids: SpecialIds,
    ) -> BeamState:
        """One step of beam search (the class docstring); reorder: as Decoder's."""
        s = self
        batch, width = s.finished_BW.shape
        # A sentence's best W of its W V candidates are among its beams' W best tokens each.
        log_probs_BWC, top_token_RC, cache = beam_candidates(s, decode_step, width, prefix_BP, ids)
        per_beam = log_probs_BWC.shape[-1]
        # Candidate log-probabilities: extensions of unfinished beams; a finished beam only continues with PAD.
        first_C = jnp.arange(per_beam) == 0
        fin_BW1 = s.finished_BW[..., None]
        cand_BWC = jnp.where(
            fin_BW1,
            jnp.where(first_C, s.log_probs_BW[..., None], NEG_INF),
            s.log_probs_BW[..., None] + log_probs_BWC,
        )
        token_BWC = jnp.where(fin_BW1, ids.pad, top_token_RC.reshape(batch, width, per_beam))
        cand_len_BW = jnp.where(s.finished_BW, s.lengths_BW, s.step_B[:, None] + 1)
        score_BWC = cand_BWC / length_penalty(cand_len_BW, alpha, penalty)[..., None]
        score_BW, flat_BW = jax.lax.top_k(score_BWC.reshape(batch, width * per_beam), width)
        beam_BW = flat_BW // per_beam
        token_BW = jnp.take_along_axis(token_BWC.reshape(batch, -1), flat_BW, axis=1).astype(jnp.int32)

        def pick(x_BW: Array) -> Array:
            return jnp.take_along_axis(x_BW, beam_BW, axis=1)

        log_probs_BW = jnp.take_along_axis(cand_BWC.reshape(batch, -1), flat_BW, axis=1)
        tokens_BWL = jnp.take_along_axis(s.tokens_BWL, beam_BW[..., None], axis=1)
        # A beam finishes on EOS, at its sentence's maximum length, or when nothing finite is left (-inf: dead).
        finished_BW = (
            pick(s.finished_BW) | (token_BW == ids.eos) | (s.step_B + 1 >= max_len_B)[:, None] | (score_BW == NEG_INF)
        )
        if settle:
            finished_BW = (
                finished_BW
                | settled(finished_BW, score_BW, log_probs_BW, s.step_B, max_len_B, alpha, penalty, settle)[:, None]
            )
        rows_R = (jnp.arange(batch)[:, None] * width + beam_BW).reshape(-1)  # each beam's parent row
        return BeamState(
            step_B=jnp.where(s.sentence_done(), s.step_B, s.step_B + 1),
            finished_BW=finished_BW,
            last_BW=token_BW,
            tokens_BWL=write_step(tokens_BWL, s.step_B[:, None], token_BW),
            log_probs_BW=log_probs_BW,
            lengths_BW=pick(cand_len_BW),
            cache=(reorder or gather_rows)(cache, rows_R),
        )


def settled(
    finished_BW: Array,
    score_BW: Array,
    log_probs_BW: Array,
    step_B: Array,
    max_len_B: Array,
    alpha: Array | float,
    penalty: str,
    settle: int,
) -> Array:
    """[B] whether each sentence's `settle` best finished hypotheses can no longer change (after a step, the beams
    as BeamState.advance left them: step_B steps were taken before it).

    log P only falls as tokens are added and lp grows with the length, so an unfinished beam's final score is at
    most its bound log P / max(lp(t + 1), lp(max_len)). Once the settle-th best finished score is above every such
    bound, no later candidate can score above any of those settle hypotheses: none of them is displaced from the W
    beams (settle <= W), and nothing that finishes later ranks before them, so they are the full search's first
    settle hypotheses.
    """
    nth_finished_B = jax.lax.top_k(jnp.where(finished_BW, score_BW, NEG_INF), settle)[0][:, -1]
    lp_max_B = jnp.maximum(length_penalty(step_B + 1, alpha, penalty), length_penalty(max_len_B, alpha, penalty))
    bound_BW = jnp.where(finished_BW, NEG_INF, log_probs_BW / lp_max_B[:, None])
    return jnp.max(bound_BW, axis=1) < nth_finished_B


class SetAsideState(NamedTuple):
    """The loop state of beam search that sets finished hypotheses aside (CTranslate2's and fairseq's rule): W live
    beams per sentence ([B, W]), the pool of its N best ended hypotheses ([B, N]), and the cache with R = B W rows
    (K = 2 W candidates per sentence).

    In BeamState a finished hypothesis competes with the live beams' extensions for one of the W places. Here, as in
    CTranslate2 (decoding.cc, BeamSearch, patience 1) and fairseq (SequenceGenerator), W beams stay live at every step
    and a hypothesis that ends moves to a pool (flax's wmt example and tensor2tensor stop on a length-penalty bound):

    - each step ranks the K = 2 W best extensions of a sentence's live beams by log P (no length penalty inside);
    - of the first W, each that ends (EOS, or the sentence's length limit) joins the pool, scored log P / lp(|Y|);
    - the first W extensions that do not end are the next live beams (there are always W: at most W end);
    - a sentence is done at its length limit; with length normalisation, once W hypotheses have ended; without it
      (penalty `none` or alpha 0), once N have ended and the best extension of some step was one of them
      (CTranslate2's early exit: no later hypothesis can beat that one);
    - its result is the pool's N best by score, best first.

    It decides differently from the full search (a hypothesis can be ranked below one the full search would have
    pruned, and the search stops on a count, not a bound), so its lists are CTranslate2's, not the exhaustive-
    compatible ones; in exchange it never waits for a sentence's last live beam to wander to its length limit
    (docs/decoding.md). Only the N best of the pool are kept: a hypothesis's score never changes once it has ended,
    so keeping the N best as they come equals sorting all of them at the end. A candidate of log P -inf (a beam with
    nothing it may emit, or an empty start beam) never joins the pool, where CTranslate2 would list it with its -inf
    score.
    """

    step_B: Array  # int32: steps taken (frozen once done)
    done_B: Array
    top_ended_B: Array  # the best extension of some step ended (CTranslate2's top_beam_finished)
    ended_B: Array  # int32: hypotheses that have ended so far (the pool keeps the N best of them)
    last_BW: Array
    tokens_BWL: Array  # the live beams; L: the current stage's slots
    log_probs_BW: Array
    pool_tokens_BNL: Array  # best first; EOS included when emitted, PAD after
    pool_log_probs_BN: Array  # -inf: an empty place
    pool_lengths_BN: Array
    cache: PyTree

    def sentence_done(self) -> Array:
        return self.done_B

    def with_room(self, slots: int, ids: SpecialIds) -> SetAsideState:
        return self._replace(
            tokens_BWL=pad_tokens(self.tokens_BWL, slots, ids.pad),
            pool_tokens_BNL=pad_tokens(self.pool_tokens_BNL, slots, ids.pad),
        )

    def beams(self) -> tuple[Array, Array, Array]:
        """The pool: (tokens [B, N, L], log_probs [B, N], lengths [B, N])."""
        return self.pool_tokens_BNL, self.pool_log_probs_BN, self.pool_lengths_BN

    def restart(self, rows_K: Array, ids: SpecialIds) -> SetAsideState:
        _, width, slots = self.tokens_BWL.shape
        fresh = SetAsideState.start(None, rows_K.shape[0], width, self.pool_log_probs_BN.shape[1], slots, ids)
        return restarted(self, rows_K, fresh)

    def select(self, keep_K: Array) -> SetAsideState:
        return selected(self, keep_K, self.last_BW.shape[1])

    @classmethod
    def start(cls, cache_R: PyTree, batch: int, width: int, pool: int, slots: int, ids: SpecialIds) -> SetAsideState:
        live = BeamState.start(None, batch, width, slots, ids)  # one live empty beam per sentence, the others -inf
        return cls(
            step_B=live.step_B,
            done_B=jnp.zeros((batch,), bool),
            top_ended_B=jnp.zeros((batch,), bool),
            ended_B=jnp.zeros((batch,), jnp.int32),
            last_BW=live.last_BW,
            tokens_BWL=live.tokens_BWL,
            log_probs_BW=live.log_probs_BW,
            pool_tokens_BNL=jnp.full((batch, pool, slots), ids.pad, jnp.int32),
            pool_log_probs_BN=jnp.full((batch, pool), NEG_INF, jnp.float32),
            pool_lengths_BN=jnp.zeros((batch, pool), jnp.int32),
            cache=cache_R,
        )

    def advance(
        self,
        decode_step: DecodeStep,
        max_len_B: Array,
        alpha: Array | float,
        penalty: str = GNMT,
        prefix_BP: Array | None = None,
        reorder: Reorder | None = None,
        *,
        ids: SpecialIds,
    ) -> SetAsideState:
        """One step (the class docstring); reorder: as Decoder's."""
        s = self
        batch, width = s.last_BW.shape
        pool = s.pool_log_probs_BN.shape[1]
        # A sentence's K best of its W V extensions are among its beams' K best tokens each.
        log_probs_BWC, token_RC, cache = beam_candidates(s, decode_step, 2 * width, prefix_BP, ids)
        per_beam = log_probs_BWC.shape[-1]
        cand_BWC = s.log_probs_BW[..., None] + log_probs_BWC
        log_probs_BK, flat_BK = jax.lax.top_k(cand_BWC.reshape(batch, -1), min(2 * width, width * per_beam))
        token_BK = jnp.take_along_axis(token_RC.reshape(batch, -1), flat_BK, axis=1)
        beam_BK = flat_BK // per_beam
        tokens_BKL = write_step(
            jnp.take_along_axis(s.tokens_BWL, beam_BK[..., None], axis=1), s.step_B[:, None], token_BK
        )
        at_limit_B = s.step_B + 1 >= max_len_B
        ends_BK = ~s.done_B[:, None] & (log_probs_BK > NEG_INF) & ((token_BK == ids.eos) | at_limit_B[:, None])
        # The first W candidates that end join the pool, which keeps the N best by score.
        joins_BW = ends_BK[:, :width]
        length_B = s.step_B + 1
        joining_BW = jnp.where(joins_BW, log_probs_BK[:, :width], NEG_INF)
        scores_BX = jnp.concatenate(
            [
                s.pool_log_probs_BN / length_penalty(s.pool_lengths_BN, alpha, penalty),
                joining_BW / length_penalty(length_B, alpha, penalty)[:, None],
            ],
            axis=1,
        )
        at_BN = jax.lax.top_k(scores_BX, pool)[1]  # ties: the pool's own first

        def pooled(kept: Array, joining: Array) -> Array:
            both = jnp.concatenate([kept, joining], axis=1)
            return jnp.take_along_axis(both, at_BN.reshape(at_BN.shape + (1,) * (both.ndim - 2)), axis=1)

        # The first W candidates that do not end are the next live beams (a stable sort keeps their order).
        next_BW = jnp.argsort(ends_BK, axis=1, stable=True)[:, :width]

        def pick(x_BK: Array) -> Array:
            return jnp.take_along_axis(x_BK, next_BW.reshape(next_BW.shape + (1,) * (x_BK.ndim - 2)), axis=1)

        ended_B = s.ended_B + jnp.sum(joins_BW, axis=1, dtype=jnp.int32)
        top_ended_B = s.top_ended_B | joins_BW[:, 0]
        early = (penalty == NONE) | (jnp.asarray(alpha) == 0)  # no length normalisation: CTranslate2's early exit
        done_B = s.done_B | at_limit_B | jnp.where(early, top_ended_B & (ended_B >= pool), ended_B >= width)
        rows_R = (jnp.arange(batch)[:, None] * width + pick(beam_BK)).reshape(-1)  # each live beam's parent row
        return SetAsideState(
            step_B=jnp.where(s.done_B, s.step_B, length_B),
            done_B=done_B,
            top_ended_B=top_ended_B,
            ended_B=ended_B,
            last_BW=pick(token_BK),
            tokens_BWL=pick(tokens_BKL),
            log_probs_BW=pick(log_probs_BK),
            pool_tokens_BNL=pooled(s.pool_tokens_BNL, tokens_BKL[:, :width]),
            pool_log_probs_BN=pooled(s.pool_log_probs_BN, joining_BW),
            pool_lengths_BN=pooled(s.pool_lengths_BN, jnp.where(joins_BW, length_B[:, None], 0)),
            cache=(reorder or gather_rows)(cache, rows_R),
        )
