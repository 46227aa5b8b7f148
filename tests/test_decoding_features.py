"""The decoding features beyond 1-best beam search: length penalties, n-best lists (and, in later modules, scoring).

Each is checked against a brute-force reference on the hashing stub (tests/helpers/decoding.py) and, through the
refilling scheduler, against the one-jit search of the same sentences.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers.decoding import (
    EOS,
    IDS,
    PAD,
    CharTokenizer,
    brute_force,
    hash_stub,
    hash_table,
    log_softmax,
    next_hash,
    one_checkpoint,
    reference_lp,
    set_aside_reference,
    shared_model,
    tiny_eval_config,
)
from tests.helpers.fakes import reads
from transformer_jax import decoding
from transformer_jax.decoding.specs import best_first, greedy_search, set_aside_search
from transformer_jax.decoding.state import BeamState, SetAsideState, length_penalty
from transformer_jax.errors import EvalError
from transformer_jax.evaluation.command import evaluate
from transformer_jax.evaluation.restore import workdir_tokenizer
from transformer_jax.evaluation.translate import EMPTY, DecodeSettings, parse_nbest_line, translate, translate_nbest


@functools.partial(jax.jit, static_argnames=("beam_size", "max_steps", "table_seed", "penalty", "settle"))
def _stub_beam(seeds_B, max_len_B, alpha, *, beam_size, max_steps, table_seed, penalty, settle=0):
    cache = {"h": seeds_B, "calls": jnp.zeros((), jnp.int32)}
    step = hash_stub(hash_table(table_seed))
    return decoding.beam_search(
        step,
        cache,
        max_len_B,
        beam_size=beam_size,
        alpha=alpha,
        max_steps=max_steps,
        penalty=penalty,
        settle=settle,
        ids=IDS,
    )


def _strip(tokens: np.ndarray, length: int) -> tuple[int, ...]:
    assert np.all(tokens[length:] == PAD), f"tokens after the end must be PAD: {tokens}"
    return tuple(int(t) for t in tokens[:length])


@pytest.mark.parametrize(("penalty", "alpha"), [("average", 1.0), ("average", 0.5), ("none", 0.6)])
def test_exhaustive_beam_with_each_length_penalty_equals_brute_force(penalty, alpha):
    table_seed, seeds, max_lens = 2, np.array([30, 39, 16]), np.array([3, 4, 4])
    result = _stub_beam(seeds, max_lens, alpha, beam_size=32, max_steps=4, table_seed=table_seed, penalty=penalty)
    for b, (seed, max_len) in enumerate(zip(seeds, max_lens, strict=True)):
        expected = brute_force(hash_table(table_seed), int(seed), int(max_len), alpha, penalty)
        n = len(expected)
        got = [_strip(np.asarray(result.tokens[b, i]), int(result.lengths[b, i])) for i in range(n)]
        np.testing.assert_allclose(result.scores[b, :n], [s for s, _ in expected], rtol=1e-5)
        assert got[0] == expected[0][1]
        assert sorted(got) == sorted(seq for _, seq in expected)
        lp = [reference_lp(int(n), alpha, penalty) for n in result.lengths[b, : len(expected)]]
        np.testing.assert_allclose(result.log_probs[b, :n], result.scores[b, :n] * np.array(lp), rtol=1e-5)


def test_penalties_rank_differently_and_early_stop_keeps_the_best_under_each():
    """The three penalties pick different winners on this stub, and settle=1's bound holds for each."""
    table_seed, seeds, max_lens = 2, np.arange(12), 3 + np.arange(12) % 5
    winners = {}
    for penalty, alpha in (("gnmt", 0.6), ("average", 1.0), ("none", 0.0)):
        full, early = (
            _stub_beam(
                seeds, max_lens, alpha, beam_size=4, max_steps=8, table_seed=table_seed, penalty=penalty, settle=n
            )
            for n in (0, 1)
        )
        np.testing.assert_array_equal(early.tokens[:, 0], full.tokens[:, 0])
        np.testing.assert_allclose(early.scores[:, 0], full.scores[:, 0], rtol=1e-6)
        winners[penalty] = np.asarray(full.tokens[:, 0])
    assert not np.array_equal(winners["none"], winners["average"])
    assert not np.array_equal(winners["gnmt"], winners["average"])


@functools.partial(jax.jit, static_argnames=("width", "max_steps", "table_seed", "penalty", "settle"))
def _stub_beam_steps(seeds_B, max_len_B, alpha, *, width, max_steps, table_seed, penalty, settle):
    """Beam search's loop on the hashing stub, one cache stage: (the beams best first, each sentence's steps)."""
    cache = decoding.tile_beams({"h": seeds_B, "calls": jnp.zeros((), jnp.int32)}, width)
    step = hash_stub(hash_table(table_seed))
    s = BeamState.start(cache, seeds_B.shape[0], width, max_steps, IDS)
    s = jax.lax.while_loop(
        lambda s: ~jnp.all(s.sentence_done()), lambda s: s.advance(step, max_len_B, alpha, settle, penalty, ids=IDS), s
    )
    return best_first(s.tokens_BWL, s.log_probs_BW, s.lengths_BW, alpha, penalty), s.step_B


@pytest.mark.parametrize(
    ("width", "penalty", "alpha"),
    [
        (4, "gnmt", 0.6),
        pytest.param(4, "average", 1.0, marks=pytest.mark.slow),
        (5, "none", 0.0),
        pytest.param(5, "gnmt", 2.0, marks=pytest.mark.slow),
    ],
)
def test_nbest_early_stop_keeps_the_full_searchs_first_n_in_fewer_steps(width, penalty, alpha):
    """settle=N stops a sentence once its N best finished hypotheses can no longer change: the first N beams equal
    the full search's (tokens, scores, lengths), and the sentences take fewer steps in all."""
    table_seed, seeds = 2, np.arange(48)
    max_lens = 4 + seeds % 5  # 4..8 tokens
    kw = dict(width=width, max_steps=8, table_seed=table_seed, penalty=penalty)
    full, full_steps = _stub_beam_steps(seeds, max_lens, alpha, settle=0, **kw)
    total_steps = []
    for n in range(1, width + 1):
        early, steps = _stub_beam_steps(seeds, max_lens, alpha, settle=n, **kw)
        np.testing.assert_array_equal(early.tokens[:, :n], full.tokens[:, :n], err_msg=f"settle={n}")
        np.testing.assert_allclose(early.scores[:, :n], full.scores[:, :n], rtol=1e-6, err_msg=f"settle={n}")
        np.testing.assert_array_equal(early.lengths[:, :n], full.lengths[:, :n], err_msg=f"settle={n}")
        assert np.all(steps <= full_steps)
        total_steps.append(int(steps.sum()))
    # Settling more hypotheses waits longer; 1 and 2 of them save steps on every setting here (e.g. gnmt 0.6, W 4:
    # 135 and 190 sentence-steps against 240).
    assert total_steps == sorted(total_steps) and max(total_steps[:2]) < full_steps.sum(), total_steps


@functools.partial(jax.jit, static_argnames=("width", "n", "max_steps", "table_seed", "penalty"))
def _stub_set_aside(seeds_B, max_len_B, alpha, *, width, n, max_steps, table_seed, penalty):
    cache = {"h": seeds_B, "calls": jnp.zeros((), jnp.int32)}
    step = hash_stub(hash_table(table_seed))
    return set_aside_search(
        step,
        cache,
        max_len_B,
        beam_size=width,
        hypotheses=n,
        alpha=alpha,
        max_steps=max_steps,
        penalty=penalty,
        ids=IDS,
    )


@pytest.mark.parametrize(
    ("width", "n", "penalty", "alpha"),
    [(4, 4, "average", 1.0), (4, 2, "none", 0.0), (5, 3, "gnmt", 0.6), (4, 1, "average", 0.0), (3, 3, "gnmt", 2.0)],
)
def test_set_aside_search_equals_ctranslate2s_loop_written_out(width, n, penalty, alpha):
    """The set-aside search (decoding/state.py SetAsideState) against CTranslate2's beam search loop written out in
    plain Python for one sentence (tests/helpers/decoding.py): the same n best hypotheses, in order, with their scores,
    for 48 sentences of limits 4..8, with length normalisation (W ended hypotheses stop a sentence) and without
    (the early exit, which also waits for the best extension of a step to end)."""
    seeds = np.arange(48)
    max_lens = 4 + seeds % 5
    result = _stub_set_aside(seeds, max_lens, alpha, width=width, n=n, max_steps=8, table_seed=2, penalty=penalty)
    assert result.tokens.shape[:2] == (len(seeds), n)
    for b, (seed, max_len) in enumerate(zip(seeds, max_lens, strict=True)):
        expected = set_aside_reference(hash_table(2), int(seed), int(max_len), width, n, alpha, penalty)
        got = [_strip(np.asarray(result.tokens[b, i]), int(result.lengths[b, i])) for i in range(len(expected))]
        assert got == [tokens for _, tokens in expected], f"sentence {b}"
        np.testing.assert_allclose(result.scores[b, : len(expected)], [x for x, _ in expected], rtol=1e-5)
        assert np.all(result.scores[b, len(expected) :] == -np.inf)  # places no hypothesis took


def test_set_aside_search_stops_sooner_than_the_full_search_and_differs_from_it():
    """At N = W the in-beam search runs every beam to its end; the set-aside one stops at W ended hypotheses, in
    fewer steps, and its lists are not the full search's (it keeps hypotheses the full search pruned)."""
    seeds = np.arange(48)
    max_lens = 4 + seeds % 5
    kw = dict(max_steps=8, table_seed=2, penalty="average")
    aside = _stub_set_aside(seeds, max_lens, 1.0, width=4, n=4, **kw)
    full, full_steps = _stub_beam_steps(seeds, max_lens, 1.0, width=4, settle=0, **kw)
    assert int(jnp.sum(aside.lengths[:, 0] > 0)) == len(seeds)
    assert not np.array_equal(aside.tokens, full.tokens)
    cache = decoding.tile_beams({"h": seeds, "calls": jnp.zeros((), jnp.int32)}, 4)
    s = SetAsideState.start(cache, len(seeds), 4, 4, 8, IDS)
    step = hash_stub(hash_table(2))
    s = jax.lax.while_loop(
        lambda s: ~jnp.all(s.sentence_done()), lambda s: s.advance(step, max_lens, 1.0, "average", ids=IDS), s
    )
    assert int(s.step_B.sum()) < int(full_steps.sum())


def test_settle_above_the_beam_size_is_refused():
    with pytest.raises(ValueError, match="settle must be in"):
        decoding.Beam(alpha=0.6, beam_size=2, settle=3)
    with pytest.raises(ValueError, match="hypotheses must be in"):
        decoding.SetAside(alpha=0.6, beam_size=2, hypotheses=3)
    with pytest.raises(ValueError, match="1 to 2"):
        decoding.Beam(alpha=0.6, beam_size=2).nbest(3)


def test_an_unknown_rule_for_finished_hypotheses_is_refused():
    with pytest.raises(ValueError, match="unknown rule for finished hypotheses 'aside'"):
        decoding.search_for(2, 0.6, finished="aside")


def test_unknown_length_penalty_is_refused():
    with pytest.raises(ValueError, match="unknown length penalty 'mean'"):
        length_penalty(3, 1.0, "mean")


def _sources(n: int, seed: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(4, 50, k - 1)] + [EOS] for k in rng.integers(2, 12, n)]


def _refilled_and_one_jit(max_len: list[int], search: decoding.Search) -> tuple[list, list]:
    """A search over 20 sources (batch 16) through the refilling scheduler and as one-jit batches."""
    sources, model = _sources(len(max_len)), shared_model()
    return tuple(
        decoding.Searcher(model, compact=c).sentences(sources, max_len, search, batch_size=16, shape=lambda _: (16, 9))
        for c in (True, False)
    )


@pytest.mark.slow
@pytest.mark.parametrize("penalty", ["average", "none"])
def test_nbest_through_the_scheduler_equals_the_full_beam_search(penalty):
    """settle=0 runs every beam to its end, in the refilling batch as in one jit."""
    max_len = [3 + i % 6 for i in range(20)]
    beam = decoding.Beam(alpha=1.0, penalty=penalty, beam_size=3, settle=0)
    refilled, one_jit = _refilled_and_one_jit(max_len, beam)
    for r, o, limit in zip(refilled, one_jit, max_len, strict=True):
        np.testing.assert_array_equal(r.lengths, o.lengths)
        for w in range(3):
            n = int(o.lengths[w])
            np.testing.assert_array_equal(r.tokens[w, :n], o.tokens[w, :n])
            # Every beam finished: with EOS, or at the limit.
            assert o.tokens[w, n - 1] == EOS or n == limit
        np.testing.assert_allclose(r.scores, o.scores, rtol=1e-5, atol=1e-6)
        lp = np.array([reference_lp(int(n), 1.0, penalty) for n in o.lengths])
        np.testing.assert_allclose(o.scores * lp, o.log_probs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("penalty", "alpha", "n"), [("average", 1.0, 3), pytest.param("none", 0.0, 2, marks=pytest.mark.slow)]
)
def test_set_aside_through_the_scheduler_equals_its_one_jit_search(penalty, alpha, n):
    """The set-aside search's state through the refilling batch (compaction, cache stages, the host's outcome)
    gives each sentence the one-jit search's n hypotheses."""
    max_len = [3 + i % 6 for i in range(20)]
    aside = decoding.SetAside(alpha=alpha, penalty=penalty, beam_size=3, hypotheses=n)
    refilled, one_jit = _refilled_and_one_jit(max_len, aside)
    for r, o in zip(refilled, one_jit, strict=True):
        assert r.tokens.shape[0] == o.tokens.shape[0] == n
        np.testing.assert_array_equal(r.lengths, o.lengths)
        for w in range(n):
            np.testing.assert_array_equal(r.tokens[w, : o.lengths[w]], o.tokens[w, : o.lengths[w]])
        np.testing.assert_allclose(r.scores, o.scores, rtol=1e-5, atol=1e-6)


def test_translate_nbest_gives_n_entries_per_line_best_first_and_refuses_n_over_beam():
    model, tok = shared_model(), CharTokenizer()
    sentences = ["hello world", "", "a", "the cat sat", "b c"]
    settings = DecodeSettings(
        decoding.Beam(alpha=0.6, beam_size=3), max_extra_len=5, max_len=0, batch_size=4, max_input_len=16
    )
    lists, stats = translate_nbest(model, tok, sentences, settings, nbest=3)
    best, _ = translate(model, tok, sentences, settings)
    assert [len(x) for x in lists] == [3] * len(sentences)
    assert lists[1] == [EMPTY] * 3
    assert [x[0].text for x in lists] == best and stats["sentences"] == len(sentences)
    for x in lists:
        assert [h.score for h in x] == sorted((h.score for h in x), reverse=True)
        for h in x:
            assert h.log_prob <= 0 and h.score == pytest.approx(h.log_prob / reference_lp(h.length, 0.6, "gnmt"))
    with pytest.raises(EvalError, match="--nbest 4 must be between 1 and the beam size"):
        translate_nbest(model, tok, sentences, settings, nbest=4)


# -- evaluate.py's flags ------------------------------------------------------------------------------------------


def _evaluate(tmp_path, lines, **flags):
    tmp_path.mkdir(exist_ok=True)
    src = tmp_path / "src.txt"
    src.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    options = dict(workdir=str(tmp_path), source_file=str(src), output_file=str(tmp_path / "out" / "hyp.txt"))
    one_checkpoint(tmp_path)
    return evaluate(dict(options, **flags))


def test_nbest_file_has_n_lines_per_input_line_and_the_1best_stays_in_the_output(tmp_path):
    lines = ["hello world", "", "a b", "the cat"]
    report = _evaluate(tmp_path, lines, nbest=2, length_penalty="average", alpha=1.0)
    out = tmp_path / "out" / "hyp.txt"
    entries = [parse_nbest_line(line) for line in Path(f"{out}.nbest").read_text(encoding="utf-8").splitlines()]
    assert [i for i, *_ in entries] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert entries[2][1:] == ("", 0.0, 0.0)  # the blank line: empty hypotheses, not decoded
    hypotheses = out.read_text(encoding="utf-8").splitlines()
    assert hypotheses == [entries[2 * i][1] for i in range(len(lines))]
    for i, text, log_prob, score in entries:
        if lines[i]:
            # average, alpha 1: the per-token mean, so log_prob / score is the hypothesis's length: at least its
            # characters (one token each; reserved ids decode to nothing), at most the limit (source + EOS + 5)
            length = log_prob / score
            assert log_prob < 0 and length == pytest.approx(round(length), abs=1e-3)
            assert len(text) <= round(length) <= len(lines[i]) + 1 + 5
    assert report["search"] == {
        "length_penalty": "average",
        "finished": "in_beam",
        "nbest": 2,
        "nbest_file": f"{out}.nbest",
    }


def test_finished_set_aside_writes_that_searchs_nbest_lists(tmp_path):
    """--finished set_aside reaches the search: the n-best file holds the set-aside search's lists, which differ from
    the in-beam search's here."""
    from flax import nnx

    from transformer_jax.model import build_model

    lines = ["hello world", "", "a b", "the cat"]
    report = _evaluate(tmp_path, lines, nbest=2, finished="set_aside", length_penalty="average", alpha=1.0)
    assert report["search"]["finished"] == "set_aside"
    out = Path(tmp_path / "out" / "hyp.txt.nbest").read_text(encoding="utf-8").splitlines()
    written = [(i, text) for i, text, *_ in map(parse_nbest_line, out)]
    config = tiny_eval_config()
    model = build_model(config, rngs=nnx.Rngs(1))  # one_checkpoint's parameters
    searched = {}
    for finished in decoding.FINISHED_RULES:
        search = decoding.search_for(2, 1.0, "average", finished)
        settings = DecodeSettings(
            search, max_extra_len=5, max_len=0, batch_size=4, max_input_len=config.data.eval_max_len
        )
        lists, _ = translate_nbest(model, workdir_tokenizer(config, str(tmp_path)), lines, settings, nbest=2)
        searched[finished] = [(i, h.text) for i, x in enumerate(lists) for h in x]
    assert written == searched["set_aside"] != searched["in_beam"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (dict(nbest=3), r"--nbest 3 must be between 1 and the beam size \(2\)"),  # the config's beam
        (dict(nbest=3, beam_size=2), r"--nbest 3 must be between 1 and the beam size \(2\)"),
        (dict(nbest=0), r"--nbest 0 must be between 1"),
        (dict(length_penalty="mean"), r"--length_penalty 'mean': choose one of gnmt, average, none"),
        (dict(finished="aside"), r"--finished 'aside': choose one of in_beam, set_aside"),
        (dict(finished="set_aside", sampling=True), r"--finished is beam search's rule; --sampling does not search"),
        (dict(max_len=-1), r"--max_len: must be"),
    ],
)
def test_bad_search_flags_are_refused_in_one_line_and_nothing_is_written(tmp_path, flags, message):
    with pytest.raises(EvalError, match=message):
        _evaluate(tmp_path, ["a b"], **flags)
    assert not (tmp_path / "out").exists()


# -- target prefixes ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("beam_size", "max_steps", "table_seed"))
def _stub_prefixed(seeds_B, max_len_B, prefix_BP, *, beam_size, max_steps, table_seed):
    cache = {"h": seeds_B, "calls": jnp.zeros((), jnp.int32)}
    step = hash_stub(hash_table(table_seed))
    if beam_size == 1:
        g = greedy_search(step, cache, max_len_B, max_steps=max_steps, prefix_BP=prefix_BP, ids=IDS)
        return g.tokens[:, None], g.log_probs[:, None], g.lengths[:, None]
    b = decoding.beam_search(
        step, cache, max_len_B, beam_size=beam_size, alpha=0.6, max_steps=max_steps, prefix_BP=prefix_BP, ids=IDS
    )
    return b.tokens, b.log_probs, b.lengths


PREFIXES = [(4, 5), (), (5,), (5, 5, 4)]  # PAD-padded below; () is no prefix


def _prefix_BP() -> np.ndarray:
    prefix_BP = np.full((len(PREFIXES), 4), PAD, np.int32)
    for b, p in enumerate(PREFIXES):
        prefix_BP[b, : len(p)] = p
    return prefix_BP


def test_prefixed_greedy_and_exhaustive_beam_equal_brute_force_over_the_outputs_that_start_with_the_prefix():
    table_seed, seeds, max_len = 3, np.array([30, 39, 16, 7]), np.array([4, 4, 4, 5])
    table = hash_table(table_seed)
    tokens, log_probs, lengths = _stub_prefixed(
        seeds, max_len, _prefix_BP(), beam_size=32, max_steps=5, table_seed=table_seed
    )
    g_tokens, g_log_probs, g_lengths = _stub_prefixed(
        seeds, max_len, _prefix_BP(), beam_size=1, max_steps=5, table_seed=table_seed
    )
    for b, (seed, prefix) in enumerate(zip(seeds, PREFIXES, strict=True)):
        everything = brute_force(table, int(seed), int(max_len[b]), 0.6)
        expected = [(s, seq) for s, seq in everything if seq[: len(prefix)] == prefix]
        n = len(expected)
        got = [_strip(np.asarray(tokens[b, i]), int(lengths[b, i])) for i in range(n)]
        assert got == [seq for _, seq in expected]  # the same outputs in the same order (no ties on this stub)
        lp = np.array([reference_lp(len(seq), 0.6, "gnmt") for _, seq in expected])
        np.testing.assert_allclose(log_probs[b, :n], np.array([s for s, _ in expected]) * lp, rtol=1e-5)
        # Greedy: the prefix, then the most probable next token at every step.
        seq = _strip(np.asarray(g_tokens[b, 0]), int(g_lengths[b, 0]))
        assert seq[: len(prefix)] == prefix
        by_seq = {s: score * reference_lp(len(s), 0.6, "gnmt") for score, s in everything}
        np.testing.assert_allclose(g_log_probs[b, 0], by_seq[seq], rtol=1e-5)
        for t in range(len(prefix), len(seq)):
            rivals = [s for s in by_seq if s[:t] == seq[:t]]
            best_next = max({s[t] for s in rivals}, key=lambda tok: _next_log_prob(table, int(seed), seq[:t], tok))
            assert seq[t] == best_next


@pytest.mark.parametrize(("penalty", "alpha"), [("average", 1.0), ("none", 0.0)])
def test_prefixed_set_aside_search_equals_ctranslate2s_loop_from_the_prefix(penalty, alpha):
    """With target prefixes, the set-aside search follows each prefix with one live beam, then searches as
    CTranslate2's loop does from the prefix; a limit inside the prefix (sentence 3: 3 of its 3 tokens) cuts it."""
    seeds, max_len = np.array([30, 39, 16, 7]), np.array([6, 5, 6, 3])
    step = hash_stub(hash_table(3))
    cache = {"h": jnp.asarray(seeds), "calls": jnp.zeros((), jnp.int32)}
    result = jax.jit(
        lambda c, m, p: set_aside_search(
            step, c, m, beam_size=3, hypotheses=2, alpha=alpha, max_steps=6, penalty=penalty, prefix_BP=p, ids=IDS
        )
    )(cache, max_len, _prefix_BP())
    for b, (seed, prefix) in enumerate(zip(seeds, PREFIXES, strict=True)):
        expected = set_aside_reference(hash_table(3), int(seed), int(max_len[b]), 3, 2, alpha, penalty, prefix)
        got = [_strip(np.asarray(result.tokens[b, i]), int(result.lengths[b, i])) for i in range(len(expected))]
        assert got == [tokens for _, tokens in expected], f"sentence {b}"
        assert all(g[: len(prefix)] == prefix[: len(g)] for g in got)
        np.testing.assert_allclose(result.scores[b, : len(expected)], [x for x, _ in expected], rtol=1e-5)


def _next_log_prob(table: np.ndarray, seed: int, prefix: tuple[int, ...], token: int) -> float:
    h = seed
    for last in (2, *prefix):  # BOS, then the tokens fed so far
        h = next_hash(h, last)
    return float(log_softmax(table[h].astype(np.float64))[token])


@pytest.mark.slow
@pytest.mark.parametrize("beam_size", [1, 2])
def test_prefixes_through_the_scheduler_equal_the_one_jit_search(beam_size):
    sources, model = _sources(20, seed=3), shared_model()
    rng = np.random.default_rng(4)
    prefixes = [[int(t) for t in rng.integers(4, 50, i % 4)] for i in range(len(sources))]
    max_len = [2 + i % 7 for i in range(len(sources))]
    refilled, one_jit = (
        decoding.Searcher(model, compact=c).sentences(
            sources,
            max_len,
            decoding.search_for(beam_size, 0.6),
            batch_size=16,
            shape=lambda _: (16, 9),
            prefixes=prefixes,
        )
        for c in (True, False)
    )
    for r, o, prefix, limit in zip(refilled, one_jit, prefixes, max_len, strict=True):
        n = int(o.lengths[0])
        assert int(r.lengths[0]) == n
        np.testing.assert_array_equal(r.tokens[0, :n], o.tokens[0, :n])
        np.testing.assert_allclose(r.log_probs[0], o.log_probs[0], rtol=1e-5, atol=1e-6)
        kept = min(len(prefix), limit)
        assert list(o.tokens[0, :kept]) == prefix[:kept]


def test_prefix_file_starts_each_translation_and_a_line_count_mismatch_names_both_counts(tmp_path, monkeypatch):
    lines = ["hello world", "a b", "the cat"]
    (tmp_path / "prefix.txt").write_text("zz\n\nq\n", encoding="utf-8")
    _evaluate(tmp_path, lines, prefix_file=str(tmp_path / "prefix.txt"), beam_size=1)
    hypotheses = (tmp_path / "out" / "hyp.txt").read_text(encoding="utf-8").splitlines()
    assert hypotheses[0].startswith("zz") and hypotheses[2].startswith("q")
    (tmp_path / "short.txt").write_text("zz\n", encoding="utf-8")
    read = reads(monkeypatch)
    with pytest.raises(EvalError, match=r"--prefix_file .*short.txt has 1 lines, .*src.txt has 3"):
        _evaluate(tmp_path / "x", lines, prefix_file=str(tmp_path / "short.txt"))
    assert read == [] and not (tmp_path / "x" / "out").exists()


def test_max_len_flag_caps_the_outputs_over_the_configs(tmp_path):
    """--max_len (an absolute cap, EOS included) overrides config.eval.max_len, which caps when the flag is unset."""
    from transformer_jax.evaluation import run

    config = tiny_eval_config()
    assert run.decoding_settings(run.Decoding(), config).max_len == config.eval.max_len == 0
    assert run.decoding_settings(run.Decoding(max_len=3), config).max_len == 3
    lines = ["hello world", "the cat sat on the mat"]
    _evaluate(tmp_path / "free", lines, beam_size=1)
    _evaluate(tmp_path / "capped", lines, max_len=3, beam_size=1)
    free, capped = (Path(tmp_path, d, "out", "hyp.txt").read_text(encoding="utf-8") for d in ("free", "capped"))
    free, capped = free.split("\n")[:-1], capped.split("\n")[:-1]  # (an empty output is a line too)
    assert max(map(len, free)) > 3  # the cap has work to do (one character a token)
    for f, c in zip(free, capped, strict=True):  # greedy: the capped output is the free one's first tokens
        assert len(c) <= 3 and f.startswith(c)
