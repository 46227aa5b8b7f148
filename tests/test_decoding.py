"""Greedy and beam search: stubs with known distributions checked against brute force (tests/helpers/decoding.py),
and the Transformer's cache."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers.decoding import (
    BOS,
    EOS,
    IDS,
    PAD,
    VOCAB,
    brute_force,
    hash_stub,
    hash_table,
    log_softmax,
    next_hash,
    shared_model,
    sources_BS,
)
from tests.helpers.fakes import JointTokenizer
from tests.helpers.model import random_tokens
from transformer_jax import decoding
from transformer_jax.decoding import model_calls, scheduler
from transformer_jax.decoding.specs import greedy_search
from transformer_jax.decoding.state import TOP_K_BLOCK, BeamState, first_argmax, length_penalty
from transformer_jax.decoding.state import top_k as blockwise_top_k
from transformer_jax.evaluation.translate import DecodeSettings, output_cap, output_limit, translate, translate_nbest
from transformer_jax.model import unpacked_segment_ids


@functools.partial(jax.jit, static_argnames=("beam_size", "max_steps", "table_seed"))
def _stub_beam(seeds_B, max_len_B, alpha, *, beam_size, max_steps, table_seed):
    cache = {"h": seeds_B, "calls": jnp.zeros((), jnp.int32)}
    step = hash_stub(hash_table(table_seed))
    return decoding.beam_search(step, cache, max_len_B, beam_size=beam_size, alpha=alpha, max_steps=max_steps, ids=IDS)


@functools.partial(jax.jit, static_argnames=("max_steps", "table_seed"))
def _stub_greedy(seeds_B, max_len_B, *, max_steps, table_seed):
    cache = {"h": seeds_B, "calls": jnp.zeros((), jnp.int32)}
    return greedy_search(hash_stub(hash_table(table_seed)), cache, max_len_B, max_steps=max_steps, ids=IDS)


def _strip(tokens: np.ndarray, length: int) -> tuple[int, ...]:
    assert np.all(tokens[length:] == PAD), f"tokens after the end must be PAD: {tokens}"
    return tuple(int(t) for t in tokens[:length])


def test_exhaustive_beam_equals_brute_force_and_length_penalty_changes_the_winner():
    table_seed, seeds, max_lens = 2, np.array([30, 39, 16]), np.array([3, 4, 4])
    # Beam 32 keeps every candidate (at most 7 finished + 8 * 3 extensions), so the search is exhaustive.
    winners = {}
    for alpha in (0.0, 0.6, 2.0):
        result = _stub_beam(seeds, max_lens, alpha, beam_size=32, max_steps=4, table_seed=table_seed)
        for b, (seed, max_len) in enumerate(zip(seeds, max_lens, strict=True)):
            expected = brute_force(hash_table(table_seed), int(seed), int(max_len), alpha)
            n = len(expected)
            got = [_strip(np.asarray(result.tokens[b, i]), int(result.lengths[b, i])) for i in range(n)]
            np.testing.assert_allclose(result.scores[b, :n], [s for s, _ in expected], rtol=1e-5)
            assert got[0] == expected[0][1]
            assert sorted(got) == sorted(seq for _, seq in expected)  # every sequence exactly once
            assert np.all(np.isneginf(result.scores[b, n:]))  # the rest are dead beams
            np.testing.assert_allclose(
                result.log_probs[b, :n], result.scores[b, :n] * ((5 + result.lengths[b, :n]) / 6) ** alpha, rtol=1e-5
            )
            winners[alpha, b] = expected[0][1]
    # The case is one where the length penalty matters: every sentence's best output changes from alpha 0 to 0.6,
    # and the second sentence's changes again at alpha 2.
    assert all(winners[0.0, b] != winners[0.6, b] for b in range(len(seeds)))
    assert winners[0.6, 1] != winners[2.0, 1]


@functools.partial(jax.jit, static_argnames=("beam_size", "max_steps", "table_seed"))
def _stub_beam_settle_1(seeds_B, max_len_B, alpha, *, beam_size, max_steps, table_seed):
    cache = {"h": seeds_B, "calls": jnp.zeros((), jnp.int32)}
    step = hash_stub(hash_table(table_seed))
    return decoding.beam_search(
        step, cache, max_len_B, beam_size=beam_size, alpha=alpha, max_steps=max_steps, settle=1, ids=IDS
    )


def test_settle_1_stops_early_with_the_full_searchs_best_hypothesis():
    seeds = np.arange(40)
    max_lens = 3 + seeds % 6  # 3..8 tokens
    stopped_early = 0
    for alpha in (0.0, 0.6, 2.0):
        for table_seed in (1, 2):
            kw = dict(beam_size=3, max_steps=8, table_seed=table_seed)
            full = _stub_beam(seeds, max_lens, alpha, **kw)
            best = _stub_beam_settle_1(seeds, max_lens, alpha, **kw)
            np.testing.assert_array_equal(best.tokens[:, 0], full.tokens[:, 0])
            np.testing.assert_allclose(best.scores[:, 0], full.scores[:, 0], rtol=1e-6)
            np.testing.assert_array_equal(best.lengths[:, 0], full.lengths[:, 0])
            stopped_early += int(np.sum(np.asarray(best.lengths[:, 1:]) < np.asarray(full.lengths[:, 1:])))
    assert stopped_early > 0  # some worse beams were left where they stood


def test_small_beam_length_penalty_decides_between_short_and_long():
    # Step 0: P(EOS) = P(a) = 0.5; after "a": P(EOS) = 0.98. "EOS" has the higher probability (0.5 > 0.49), but
    # with alpha = 0.6, log 0.49 / lp(2) = -0.650 beats log 0.5 / lp(1) = -0.693.
    def decode_step(tokens_R1, cache):
        p_eos = jnp.where(cache["t"] == 0, 0.5, 0.98)
        probs = jnp.zeros((VOCAB,)).at[EOS].set(p_eos).at[4].set(1 - p_eos)
        logits = jnp.broadcast_to(jnp.log(probs), (tokens_R1.shape[0], 1, VOCAB))
        return logits, {"t": cache["t"] + 1}

    @jax.jit
    def run(alpha):
        return decoding.beam_search(
            decode_step, {"t": jnp.zeros((), jnp.int32)}, jnp.array([3]), beam_size=2, alpha=alpha, max_steps=3, ids=IDS
        )

    short, long = run(0.0), run(0.6)
    assert _strip(np.asarray(short.tokens[0, 0]), int(short.lengths[0, 0])) == (EOS,)
    assert _strip(np.asarray(long.tokens[0, 0]), int(long.lengths[0, 0])) == (4, EOS)
    np.testing.assert_allclose(short.scores[0, 0], np.log(0.5), rtol=1e-6)
    np.testing.assert_allclose(long.scores[0, 0], np.log(0.49) / (7 / 6) ** 0.6, rtol=1e-6)


def test_finished_hypothesis_is_never_extended():
    # P(EOS) = 0.7 first; afterwards token 4 has probability ~1. Extending the finished "EOS" with 4s would cost
    # ~nothing in log-probability and gain from lp, so a search that extends finished beams returns a longer one.
    def decode_step(tokens_R1, cache):
        logits = jnp.where(
            cache["t"] == 0,
            jnp.log(jnp.array([0.0, 0.7, 0.0, 0.0, 0.3, 0.0])),
            jnp.array([-jnp.inf, -8.0, -jnp.inf, -jnp.inf, 0.0, -9.0]),
        )
        return jnp.broadcast_to(logits, (tokens_R1.shape[0], 1, VOCAB)), {"t": cache["t"] + 1}

    @jax.jit
    def run():
        cache = {"t": jnp.zeros((), jnp.int32)}
        return decoding.beam_search(decode_step, cache, jnp.array([6]), beam_size=2, alpha=1.0, max_steps=6, ids=IDS)

    result = run()
    np.testing.assert_array_equal(result.tokens[0, 0], [EOS, PAD, PAD, PAD, PAD, PAD])
    assert int(result.lengths[0, 0]) == 1
    np.testing.assert_allclose(result.scores[0, 0], np.log(0.7), rtol=1e-6)  # lp(1) = 1: the score never moved
    # The runner-up is 4 x 6 cut at the length limit (no EOS): its score is its log-prob over lp(6).
    np.testing.assert_array_equal(result.tokens[0, 1], [4, 4, 4, 4, 4, 4])
    log_p = np.log(0.3) + 5 * log_softmax(np.array([-np.inf, -8.0, -np.inf, -np.inf, 0.0, -9.0]))[4]
    np.testing.assert_allclose(result.scores[0, 1], log_p / (11 / 6), rtol=1e-5)
    for w in range(2):  # in every beam only PAD follows the first EOS
        tokens = np.asarray(result.tokens[0, w])
        if EOS in tokens:
            assert np.all(tokens[list(tokens).index(EOS) + 1 :] == PAD)


def test_beam_size_one_equals_greedy_on_stub():
    seeds, max_lens = np.arange(16) * 7, np.array([2, 3, 4, 5] * 4)
    greedy = _stub_greedy(seeds, max_lens, max_steps=5, table_seed=11)
    for alpha in (0.0, 0.6):
        beam = _stub_beam(seeds, max_lens, alpha, beam_size=1, max_steps=5, table_seed=11)
        np.testing.assert_array_equal(beam.tokens[:, 0], greedy.tokens)
        np.testing.assert_array_equal(beam.lengths[:, 0], greedy.lengths)
        np.testing.assert_allclose(beam.log_probs[:, 0], greedy.log_probs, rtol=1e-6)
    assert np.all(np.asarray(greedy.lengths) <= max_lens)
    for b in range(len(seeds)):  # greedy output: argmax at each step, checked against the brute-force table walk
        seq = _strip(np.asarray(greedy.tokens[b]), int(greedy.lengths[b]))
        assert seq[-1] == EOS or len(seq) == max_lens[b]
        h, last = int(seeds[b]), BOS
        for token in seq:
            h = next_hash(h, last)
            assert token == int(np.argmax(hash_table(11)[h]))
            last = token


def _all_candidates_step(logits_RV, s, alpha):
    """Beam search's step as the top-W of all W V candidates of each sentence (the reference of BeamState.advance,
    which takes each beam's best tokens first)."""
    batch, width = s.finished_BW.shape
    vocab = logits_RV.shape[-1]
    log_probs_BWV = jax.nn.log_softmax(logits_RV, -1).reshape(batch, width, vocab)
    cand_BWV = jnp.where(
        s.finished_BW[..., None],
        jnp.where(jnp.arange(vocab) == PAD, s.log_probs_BW[..., None], -jnp.inf),
        s.log_probs_BW[..., None] + jnp.where(jnp.arange(vocab) == PAD, -jnp.inf, log_probs_BWV),  # PAD: never
    )
    cand_len_BW = jnp.where(s.finished_BW, s.lengths_BW, s.step_B[:, None] + 1)
    score_BWV = cand_BWV / length_penalty(cand_len_BW, alpha)[..., None]
    score_BW, flat_BW = jax.lax.top_k(score_BWV.reshape(batch, -1), width)
    return score_BW, flat_BW // vocab, flat_BW % vocab, jnp.take_along_axis(cand_BWV.reshape(batch, -1), flat_BW, 1)


# 3: fewer tokens than beams (each beam proposes all it has); the last: enough blocks for state.top_k's own path
@pytest.mark.parametrize("vocab", [3, pytest.param(50, marks=pytest.mark.slow), 8 * TOP_K_BLOCK + 5])
def test_each_beams_best_tokens_give_the_step_of_all_candidates(vocab):
    batch, width, alpha = 6, 4, 0.6
    rng = np.random.default_rng(vocab)
    logits_RV = jnp.asarray(rng.normal(size=(batch * width, vocab)) * 3, jnp.float32)  # distinct: no ties
    s = BeamState.start({}, batch, width, 8, IDS)._replace(
        step_B=jnp.full((batch,), 3, jnp.int32),
        finished_BW=jnp.asarray(rng.random((batch, width)) < 0.3).at[0].set(True).at[1].set(False),
        log_probs_BW=jnp.asarray(-np.sort(rng.random((batch, width)) * 4, 1), jnp.float32),
        lengths_BW=jnp.asarray(rng.integers(1, 4, (batch, width)), jnp.int32),
    )
    step = lambda tokens_R1, cache: (logits_RV[:, None], cache)
    new = s.advance(step, jnp.full((batch,), 8), alpha, settle=0, ids=IDS)
    score_BW, beam_BW, token_BW, log_probs_BW = _all_candidates_step(logits_RV, s, alpha)
    np.testing.assert_array_equal(new.last_BW, token_BW)
    np.testing.assert_array_equal(new.log_probs_BW, log_probs_BW)  # the same bits, not only close
    np.testing.assert_array_equal(new.tokens_BWL[:, :, 3], token_BW)
    np.testing.assert_array_equal(
        new.lengths_BW, jnp.take_along_axis(jnp.where(s.finished_BW, s.lengths_BW, 4), beam_BW, 1)
    )
    assert np.all(np.isfinite(score_BW[:, 0]))


@pytest.mark.parametrize("size", [50 * TOP_K_BLOCK + 1, 8000])  # a last block cut short; Multi30k's vocabulary
@pytest.mark.parametrize("k", [1, 4, 20])
def test_blockwise_top_k_equals_lax_top_k_with_ties_and_minus_infinity(size, k):
    assert -(-size // TOP_K_BLOCK) >= 2 * k  # enough blocks that top_k takes its own path, not lax.top_k
    rng = np.random.default_rng(size + k)
    x = rng.integers(0, 5, (16, size)).astype(np.float32)  # many ties, within and across blocks
    x[1] = -np.inf  # a row with nothing finite: the lowest indices, as lax.top_k takes them
    x[2, : size // 2] = -np.inf
    x[3] = rng.normal(size=size)
    x[4, size - 1] = 9.0  # the largest entry in the last, padded block
    values, index = blockwise_top_k(jnp.asarray(x), k)
    want_values, want_index = jax.lax.top_k(jnp.asarray(x), k)
    np.testing.assert_array_equal(index, want_index)
    np.testing.assert_array_equal(values, want_values)


# -- the Transformer ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef", "beam_size", "max_steps"))
def _cached_steps(graphdef, state, src_BS, tokens_RT, perms_TR, *, beam_size, max_steps):
    """Feeds tokens_RT step by step through cached_decode_step, reordering the cache rows by perms_TR first (with
    the Decoder's reorder: the keys and values stay, the beam lineage follows)."""
    model = nnx.merge(graphdef, state)
    seg = unpacked_segment_ids(src_BS, IDS.pad)
    d = decoding.cached_decode_step(model, model.encode(src_BS, seg), seg, beam_size=beam_size, max_steps=max_steps)
    cache = decoding.tile_beams(d.grow(d.cache, max_steps), beam_size)

    def body(cache, xs):
        tokens_R, perm_R = xs
        logits, cache = d.step(tokens_R[:, None], d.reorder(cache, perm_R))
        return cache, logits[:, 0]

    _, logits_TRV = jax.lax.scan(body, cache, (tokens_RT.T, perms_TR))
    return logits_TRV


@functools.partial(jax.jit, static_argnames=("graphdef", "beam_size"))
def _full_logits(graphdef, state, src_BS, tgt_RT, *, beam_size):
    """model.decode without a cache on whole target prefixes, the encoder output tiled over beams."""
    model = nnx.merge(graphdef, state)
    memory, seg = decoding.tile_beams((model.encode(src_BS), unpacked_segment_ids(src_BS, IDS.pad)), beam_size)
    return model.decode(memory, tgt_RT, src_segment_ids=seg)


def test_cached_decode_step_with_beam_reordering_equals_full_recompute():
    model, src, beam, steps = shared_model(), sources_BS(), 2, 5
    rng = np.random.default_rng(0)
    n = src.shape[0] * beam
    fed = np.array(random_tokens(4, (n, steps)))
    fed[:, 0] = BOS
    # perms[t][r]: the row that row r continues at step t (within its sentence); the identity at t = 0.
    perms = [np.arange(n)] + [
        np.concatenate([b * beam + rng.permutation(beam) for b in range(src.shape[0])]) for _ in range(steps - 1)
    ]
    # Each row's history as the cache sees it: reorder the rows, then append the fed token.
    history = np.zeros((n, 0), np.int32)
    histories = []
    for t in range(steps):
        history = np.concatenate([history[perms[t]], fed[:, t : t + 1]], 1)
        histories.append(history)
    graphdef, state = nnx.split(model)
    logits = _cached_steps(
        graphdef, state, src, jnp.asarray(fed), jnp.asarray(np.stack(perms)), beam_size=beam, max_steps=8
    )
    full = _full_logits(graphdef, state, src, jnp.asarray(histories[-1]), beam_size=beam)
    # Row r at the end descends from row c_t(r) at step t: follow the permutations backwards.
    ancestor = np.arange(n)
    for t in reversed(range(steps)):
        np.testing.assert_allclose(logits[t][ancestor], full[:, t], rtol=1e-5, atol=1e-5)
        ancestor = perms[t][ancestor]


@functools.partial(jax.jit, static_argnames="graphdef")
def _teacher_forced_log_probs(graphdef, state, src, tokens_BWL, lengths_BW):
    """log P(tokens | src) of every beam, from one full decode (no cache)."""
    model = nnx.merge(graphdef, state)
    b, w, length = tokens_BWL.shape
    memory, seg = decoding.tile_beams((model.encode(src), unpacked_segment_ids(src, IDS.pad)), w)
    flat = tokens_BWL.reshape(b * w, length)
    tgt_in = jnp.concatenate([jnp.full((b * w, 1), BOS), flat[:, :-1]], 1)
    log_probs = jax.nn.log_softmax(
        model.decode(memory, tgt_in, src_segment_ids=seg, tgt_segment_ids=jnp.ones_like(tgt_in)), -1
    )
    per_token = jnp.take_along_axis(log_probs, flat[..., None], -1)[..., 0]
    mask = jnp.arange(length) < lengths_BW.reshape(-1, 1)
    return jnp.sum(jnp.where(mask, per_token, 0.0), -1).reshape(b, w)


def test_beam_search_on_model_scores_equal_full_recompute_log_probs():
    # The shapes of translate()'s batches in the test below (4 rows, bucket 16, 16 + 5 steps): one compilation.
    model, src = shared_model(), sources_BS(4, 16)
    max_len = jnp.array([6, 21, 9, 3])
    cached = decoding.Searcher(model)(src, max_len, decoding.Beam(alpha=0.6, beam_size=2), max_steps=21)
    expected = _teacher_forced_log_probs(*nnx.split(model), src, cached.tokens, cached.lengths)
    np.testing.assert_allclose(cached.log_probs, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cached.scores, expected / length_penalty(cached.lengths, 0.6), rtol=1e-5)
    assert np.all(np.asarray(cached.lengths) <= np.asarray(max_len)[:, None])
    assert np.all(np.diff(np.asarray(cached.scores), axis=1) <= 0)  # best first


@functools.partial(jax.jit, static_argnames=("graphdef", "max_steps"))
def _model_beam1(graphdef, state, src_BS, max_len_B, *, max_steps):
    model = nnx.merge(graphdef, state)
    seg = unpacked_segment_ids(src_BS, IDS.pad)
    d = decoding.cached_decode_step(model, model.encode(src_BS, seg), seg, beam_size=1, max_steps=max_steps)
    return decoding.beam_search(
        d.step, d.cache, max_len_B, beam_size=1, alpha=0.6, max_steps=max_steps, grow=d.grow, ids=IDS
    )


def test_beam_size_one_equals_greedy_on_model_and_search_runs_without_dropout():
    model, src, max_len = shared_model(), sources_BS(), jnp.array([8, 5])
    beam = _model_beam1(*nnx.split(model), src, max_len, max_steps=8)
    greedy = decoding.Searcher(model)(src, max_len, decoding.Greedy(alpha=0.6), max_steps=8)
    np.testing.assert_array_equal(beam.tokens, greedy.tokens)
    np.testing.assert_allclose(beam.log_probs, greedy.log_probs, rtol=1e-5)
    # A model in train mode (as during training's validation BLEU) is searched with dropout off, and stays in
    # train mode.
    model.train()
    try:
        searched = decoding.Searcher(model)(src, max_len, decoding.Greedy(alpha=0.6), max_steps=8)
        assert model.embed_dropout.deterministic is False
    finally:
        model.eval()
    np.testing.assert_array_equal(searched.tokens, greedy.tokens)


# -- translate ---------------------------------------------------------------------------------------------------


class CharTokenizer(JointTokenizer):
    """Characters <-> ids 4..49 (vocab 50 of the tiny model), enough to drive translate()."""

    ids = IDS

    def encode(self, text: str) -> list[int]:
        return [4 + ord(c) % 46 for c in text]

    def decode(self, ids) -> str:
        assert EOS not in ids and PAD not in ids
        return "".join(chr(ord("a") + (i - 4) % 26) for i in ids)


def test_output_cap_is_eval_max_len_and_the_position_table_whichever_is_smaller():
    assert output_cap(0, None) is None  # eval.max_len 0: no cap
    assert output_cap(12, None) == 12 and output_cap(12, 8) == 8 and output_cap(0, 8) == 8 and output_cap(6, 8) == 6
    assert output_limit(5, 50, output_cap(12, None)) == 12  # the absolute cap below source + max_extra_len
    assert output_limit(5, 3, output_cap(12, None)) == 8  # the relative one below the cap
    assert output_limit(5, 3, None) == 8


def test_translate_stops_outputs_at_eval_max_len():
    """eval.max_len caps every output (EOS included) whatever its source's length, and shrinks the batch's slots."""
    model, tok = shared_model(), CharTokenizer()
    sentences = ["hello world", "the cat sat on the mat", "a"]
    settings = DecodeSettings(decoding.Greedy(alpha=0.6), max_extra_len=5, max_len=0, batch_size=4, max_input_len=32)
    free, free_stats = translate_nbest(model, tok, sentences, settings, nbest=1)
    capped, stats = translate_nbest(model, tok, sentences, dataclasses.replace(settings, max_len=4), nbest=1)
    assert max(h[0].length for h in free) > 4  # a random model runs to its limit: the cap has work to do
    assert all(h[0].length <= 4 for h in capped)
    assert {output for _, output in stats["shapes"]} == {4}
    for f, c in zip(free, capped, strict=True):  # greedy: the capped output is the free one's first tokens
        assert f[0].text.startswith(c[0].text)


def test_translate_keeps_order_empty_lines_and_is_independent_of_batching(monkeypatch):
    # Batches under 2 MIN_ROWS sentences have little to gain from refilling: they run one-jit batches.
    monkeypatch.setattr(scheduler, "refilling_search", lambda *a, **k: pytest.fail("refilled a small batch"))
    batches = record_calls(monkeypatch, "search_batch", lambda graph, params, src, *a, **k: src.shape)
    model, tok = shared_model(), CharTokenizer()
    sentences = ["hello world", "", "a", "x" * 40, "   ", "the cat sat on the mat", "b c"]
    settings = DecodeSettings(
        decoding.Beam(alpha=0.6, beam_size=2), max_extra_len=5, max_len=0, batch_size=4, max_input_len=16
    )
    outputs, stats = translate(model, tok, sentences, settings)
    assert len(outputs) == len(sentences)
    assert outputs[1] == "" and outputs[4] == ""
    assert stats["empty"] == 2 and stats["truncated"] == 2 and stats["truncated_lines"] == [4, 6]
    assert batches == [(4, 16), (4, 16)]  # one shape: dummy rows fill the last batch
    assert stats["shapes"] == [(16, 21)]
    # Each sentence translated alone (other rows in its batch) gives the same output.
    for i in (0, 3, 5):
        alone, _ = translate(model, tok, [sentences[i]], settings)
        assert alone == [outputs[i]]
    for out, sentence in zip(outputs, sentences, strict=True):
        if sentence.strip():
            assert len(out) <= min(len(sentence) + 1, 16) + 5
    # Fewer sentences than batch_size: one batch of as many rows as needed, rounded up to a multiple of 8.
    batches.clear()
    together, stats = translate(model, tok, sentences, dataclasses.replace(settings, batch_size=64))
    assert together == outputs and batches == [(8, 16)]


def test_cache_stages_double_then_end_at_max_steps():
    assert decoding.cache_stages(114) == [16, 32, 64, 114]
    assert decoding.cache_stages(66) == [16, 32, 66]  # 64 would leave a 2-slot last stage
    assert decoding.cache_stages(16) == [16]
    assert decoding.cache_stages(5) == [5]
    assert decoding.cache_stages(17) == [16, 17]


@functools.partial(jax.jit, static_argnames=("graphdef", "beam_size", "max_steps", "staged"))
def _search_without_eos(graphdef, state, src_BS, max_len_B, *, beam_size, max_steps, staged):
    """Beam search with EOS masked (outputs run to max_len_B, across stages), staged or over one full-size cache."""
    model = nnx.merge(graphdef, state)
    seg = unpacked_segment_ids(src_BS, IDS.pad)
    d = decoding.cached_decode_step(model, model.encode(src_BS, seg), seg, beam_size=beam_size, max_steps=max_steps)

    def step(tokens, cache):
        logits, cache = d.step(tokens, cache)
        return logits.at[..., EOS].set(-jnp.inf), cache

    cache, grow = (d.cache, d.grow) if staged else (d.grow(d.cache, max_steps), None)
    return decoding.beam_search(
        step, cache, max_len_B, beam_size=beam_size, alpha=0.6, max_steps=max_steps, grow=grow, ids=IDS
    )


@pytest.mark.parametrize("beam_size", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_search_in_cache_stages_equals_one_full_size_cache(beam_size):
    # Outputs end inside the first (3 tokens), second (20) and last (40, 48) of the stages 16, 32, 48.
    model, src, max_len = shared_model(), sources_BS(4, 7), jnp.array([48, 3, 20, 40])
    graphdef, state = nnx.split(model)
    staged, full = (
        _search_without_eos(graphdef, state, src, max_len, beam_size=beam_size, max_steps=48, staged=staged)
        for staged in (True, False)
    )
    assert decoding.cache_stages(48) == [16, 32, 48]
    np.testing.assert_array_equal(staged.lengths[:, 0], max_len)
    np.testing.assert_array_equal(staged.tokens, full.tokens)
    np.testing.assert_allclose(staged.scores, full.scores, rtol=1e-5, atol=1e-6)


def test_first_argmax_equals_argmax_including_ties():
    x = np.asarray(random_tokens(8, (6, 40), vocab=5), np.float32)  # many ties: values 0..4 only
    x[0] = -np.inf
    x[1, 7] = np.inf
    np.testing.assert_array_equal(first_argmax(jnp.asarray(x)), np.argmax(x, axis=-1))


def test_compacted_and_refill_sizes():
    assert scheduler.MIN_ROWS == 8
    assert scheduler.compacted_size(64, 64) == 64
    assert scheduler.compacted_size(33, 64) == 64
    assert scheduler.compacted_size(32, 64) == 32
    assert scheduler.compacted_size(3, 64) == 8  # not below the minimum
    assert scheduler.compacted_size(3, 24) == 12  # 24 -> 12; 6 would be below it
    assert scheduler.compacted_size(1, 6) == 6  # a batch under the minimum is never compacted
    # Waiting sentences join 8, 16, 32, ... at a time (the encoder compiles for those sizes only).
    assert [scheduler.refill_size(free, 64) for free in (0, 7, 8, 15, 16, 40, 64)] == [0, 0, 8, 8, 16, 32, 64]
    assert scheduler.refill_size(40, 24) == 16  # never more than the batch's rows


def record_calls(monkeypatch, name: str, what) -> list:
    """The jitted call model_calls.<name> wrapped so that what(*args, **kwargs) of each call is recorded before it runs;
    returns the record."""
    record, original = [], getattr(model_calls, name)

    def recorded(*args, **kwargs):
        record.append(what(*args, **kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(model_calls, name, recorded)
    return record


def mostly_short_limits() -> jnp.ndarray:
    """Output limits of 24 sentences: 20 stop within 3 tokens, 4 may run to 40 (cache stages 16, 40)."""
    return jnp.array([40 if i % 6 == 0 else 1 + i % 3 for i in range(24)])


@pytest.mark.parametrize("beam_size", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_compacting_search_equals_the_whole_batch_search(beam_size, monkeypatch):
    """One batch through the refilling search: nothing waits, so finished sentences only leave the batch."""
    # 20 of 24 sentences stop within 3 tokens; the other 4 may run to 40 (stages 16, 40). After the first call the
    # batch shrinks to 12 sentences (<= FULL_CACHE_SENTENCES), which grow the cache to 40 slots at once.
    model, src = shared_model(), sources_BS(24, 9)
    max_len = mostly_short_limits()
    kept = record_calls(monkeypatch, "keep", lambda context, s, keep_K, **kw: keep_K.shape[0])
    compact, whole = (
        decoding.Searcher(model, compact=c)(src, max_len, decoding.search_for(beam_size, 0.6), max_steps=40)
        for c in (True, False)
    )
    assert kept == [12]
    assert 12 <= scheduler.FULL_CACHE_SENTENCES
    np.testing.assert_array_equal(compact.tokens, whole.tokens)
    np.testing.assert_array_equal(compact.lengths, whole.lengths)
    np.testing.assert_allclose(compact.scores, whole.scores, rtol=1e-5, atol=1e-6)
    assert int(np.max(compact.lengths[:, 0])) > decoding.cache_stages(40)[0]  # someone decoded past the first stage


def test_refilling_search_equals_one_batch_at_a_time(monkeypatch):
    """40 sentences through one running batch of 20: finished sentences' rows are taken by waiting ones (encoded in
    blocks of 16, a multiple of 8, at 8 or 16 positions, then padded to the batch's 16; joining 8 or 16 at a time),
    and the cache grows past its first stage. Every sentence gets what the one-jit search of its own batch gives."""
    rng = np.random.default_rng(5)
    lengths = [*rng.integers(2, 9, 36), *rng.integers(9, 16, 4)]  # the second block's sources fit in 8 positions
    sources = [[int(t) for t in rng.integers(4, 50, n - 1)] + [EOS] for n in lengths]
    max_len = [22 if i % 7 == 0 else 1 + i % 4 for i in range(len(sources))]
    joined = record_calls(monkeypatch, "insert", lambda *a, **k: int(np.sum(np.asarray(a[4]) < 20)))
    widened = record_calls(monkeypatch, "widen", lambda *a, **k: (a[1]["src_segment_ids"].shape, k["src_len"]))

    def shape(longest: int) -> tuple[int, int]:
        return 16, 22

    model = shared_model()
    refilled, batched = (
        decoding.Searcher(model, compact=c).sentences(
            sources, max_len, decoding.Greedy(alpha=0.6), batch_size=20, shape=shape
        )
        for c in (True, False)
    )
    assert sum(joined) == len(sources) - 20 and len(joined) > 2  # the first 20 start; the others join in turns
    assert widened == [((16, 8), 16)]  # the second block, encoded at 8 positions
    for r, b in zip(refilled, batched, strict=True):
        n = int(b.lengths[0])
        assert int(r.lengths[0]) == n
        np.testing.assert_array_equal(r.tokens[0, :n], b.tokens[0, :n])
        np.testing.assert_allclose(r.log_probs, b.log_probs, rtol=1e-5, atol=1e-6)
    assert max(int(r.lengths[0]) for r in refilled) > 16  # someone decoded past the first cache stage


@pytest.mark.slow  # trimmed from the default run: the file keeps a fast representative
def test_a_small_beam_batch_steps_at_the_last_cache_stage_only(monkeypatch):
    """A batch of at most FULL_CACHE_SENTENCES sentences (beam 4: 4 times as many cache rows) grows its cache to the
    last stage before its first step, so its steps compile once per batch size, not per (size, stage)."""
    model, src = shared_model(), sources_BS(24, 9)
    max_len = mostly_short_limits()
    stages = record_calls(monkeypatch, "stage", lambda params, context, s, *a, **k: s.tokens_BWL.shape)
    beam = decoding.Beam(alpha=0.6, beam_size=4)
    compact, whole = (decoding.Searcher(model, compact=c)(src, max_len, beam, max_steps=40) for c in (True, False))
    assert 24 <= scheduler.FULL_CACHE_SENTENCES
    assert len(stages) > 1 and {slots for _, _, slots in stages} == {40}, stages  # compacted, never at 16 slots
    np.testing.assert_array_equal(compact.tokens, whole.tokens)
    np.testing.assert_allclose(compact.scores, whole.scores, rtol=1e-5, atol=1e-6)
    assert int(np.max(compact.lengths[:, 0])) > decoding.cache_stages(40)[0]


@pytest.mark.parametrize("beam_size", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_the_refilling_search_builds_no_programs_of_its_own_on_the_host(beam_size):
    """Between its calls the scheduler only reads what they return (model_calls.Outcome): an array operation on the host
    would be a small program per batch size, compiled in every process (too fast to be worth the disk cache)."""
    rng = np.random.default_rng(7)
    sources = [[int(t) for t in rng.integers(4, 50, n - 1)] + [EOS] for n in rng.integers(2, 12, 40)]
    max_len = [12 if i % 5 == 0 else 1 + i % 3 for i in range(len(sources))]
    model = shared_model()
    built = set()

    def on_compile(event: str, seconds: float, fun_name: str = "?", **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":  # every program built, a cache load included
            built.add(fun_name)

    jax.clear_caches()  # programs an earlier test built would not be built (nor counted) again
    jax.monitoring.register_event_duration_secs_listener(on_compile)
    try:
        decoding.Searcher(model).sentences(
            sources, max_len, decoding.search_for(beam_size, 0.6), batch_size=16, shape=lambda longest: (16, 24)
        )
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)
    names = ("start", "encode", "insert", "grow", "widen", "stage", "keep", "outcome")
    scheduler = {f"jit({name})" for name in names}
    assert "jit(stage)" in built and built <= scheduler, built - scheduler
