"""Beam search that sets finished hypotheses aside (CTranslate2's and fairseq's rule), beside search.py's.

Axis letters: see transformer_jax/__init__.py (here B sentences, W live beams per sentence, R = B W rows, K = 2 W
candidates per sentence, N hypotheses kept per sentence, L output slots).

search.py's beam search keeps a finished hypothesis among its W beams, where it competes with the live beams'
extensions for a place: its first N beams are exactly the full search's, and a sentence waits until its N best
hypotheses are settled (`settled`), with N = W until every beam has ended. Here, as in CTranslate2 (decoding.cc,
BeamSearch, patience 1) and fairseq (SequenceGenerator), W beams stay live at every step and a hypothesis that ends
moves to a pool (flax's wmt example and tensor2tensor also keep such a pool, but stop on a length-penalty bound):

- each step ranks the K = 2 W best extensions of a sentence's live beams by log P (no length penalty inside);
- of the first W, each that ends (EOS, or the sentence's length limit) joins the pool, scored log P / lp(|Y|);
- the first W extensions that do not end are the next live beams (there are always W: at most W end);
- a sentence is done at its length limit; with length normalisation, once W hypotheses have ended; without it
  (penalty `none` or alpha 0), once N have ended and the best extension of some step was one of them (CTranslate2's
  early exit: no later hypothesis can beat that one);
- its result is the pool's N best by score, best first.

It decides differently from the full search (a hypothesis can be ranked below one the full search would have pruned,
and the search stops on a count, not a bound), so its lists are CTranslate2's, not the exhaustive-compatible ones;
in exchange it never waits for a sentence's last live beam to wander to its length limit (docs/decoding.md).
Only the N best of the pool are kept: a hypothesis's score never changes once it has ended, so keeping the N best
as they come equals sorting all of them at the end. A candidate of log P -inf (a beam with nothing it may emit, or
an empty start beam) never joins the pool, where CTranslate2 would list it with its -inf score.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from transformer_jax.decoding.search import (
    GNMT,
    NEG_INF,
    NONE,
    BeamResult,
    BeamState,
    DecodeStep,
    GrowCache,
    Reorder,
    best_first,
    cache_stages,
    choosable,
    gather_rows,
    length_penalty,
    max_and_logsumexp,
    pad_tokens,
    restarted,
    run_stages,
    selected,
    tile_beams,
    top_k,
    write_step,
)
from transformer_jax.tokens import SpecialIds

Array = jax.Array
PyTree = Any


class SetAsideState(NamedTuple):
    """The loop state: W live beams per sentence ([B, W]), the pool of its N best ended hypotheses ([B, N]), and the
    cache with R = B W rows."""

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
        """The sentences in rows_K back at the start (nothing emitted); the cache is the caller's to reset."""
        _, width, slots = self.tokens_BWL.shape
        fresh = SetAsideState.start(None, rows_K.shape[0], width, self.pool_log_probs_BN.shape[1], slots, ids)
        return restarted(self, rows_K, fresh)

    def select(self, keep_K: Array) -> SetAsideState:
        """The state of the sentences keep_K only, in that order (their W cache rows each)."""
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
        """One step (module docstring); reorder: as search.Decoder's."""
        s = self
        batch, width = s.last_BW.shape
        pool = s.pool_log_probs_BN.shape[1]
        logits_R1V, cache = decode_step(s.last_BW.reshape(-1, 1), s.cache)
        logits_RV = logits_R1V.reshape(batch * width, -1).astype(jnp.float32)
        # A sentence's K best of its W V extensions are among its beams' K best tokens each (as in BeamState).
        per_beam = min(2 * width, logits_RV.shape[-1])
        max_R1, lse_R1 = max_and_logsumexp(logits_RV)
        top_RC, token_RC = top_k(choosable(logits_RV, prefix_BP, s.step_B, width, ids.pad), per_beam)
        cand_BWC = s.log_probs_BW[..., None] + ((top_RC - max_R1) - lse_R1).reshape(batch, width, per_beam)
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
    """Beam search of beam_size live beams that sets finished hypotheses aside (module docstring), as one loop;
    `cache` has B rows. Returns each sentence's `hypotheses` best (<= beam_size), best first. grow, prefix_BP and
    reorder and ids as for search.beam_search."""
    first = max_steps if grow is None else cache_stages(max_steps)[0]
    init = SetAsideState.start(tile_beams(cache, beam_size), max_len_B.shape[0], beam_size, hypotheses, first, ids)
    s = run_stages(
        lambda s: s.advance(decode_step, max_len_B, alpha, penalty, prefix_BP, reorder, ids=ids),
        init,
        max_steps,
        grow,
        ids,
    )
    tokens_BNL = pad_tokens(s.pool_tokens_BNL, max_steps, ids.pad)
    return best_first(tokens_BNL, s.pool_log_probs_BN, s.pool_lengths_BN, alpha, penalty)
