"""Sampling (decoding/specs.py, evaluate.py --sampling): the drawn distribution is the reshaped model's
(chi-square on a stub), a seed reproduces its samples wherever they run, and bad settings are refused."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers.decoding import EOS, IDS, one_checkpoint, shared_model
from transformer_jax import decoding
from transformer_jax.decoding.specs import greedy_search, inverse_cdf, nucleus_threshold
from transformer_jax.errors import EvalError
from transformer_jax.evaluation.command import evaluate
from transformer_jax.evaluation.translate import DecodeSettings, translate_nbest

# One step over 8 tokens: PAD, BOS and UNK impossible, EOS and four words with these logits.
LOGITS = np.array([-np.inf, 0.3, -np.inf, -np.inf, 1.2, 0.9, -0.5, -1.5], np.float32)
ROWS = 6000


def _expected(temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The reshaped distribution by its definition, in float64."""
    x = LOGITS.astype(np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(len(x), bool)
    keep[order[: top_k or len(x)]] = True
    keep &= np.isfinite(x)
    p = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    p /= p.sum()
    if top_p < 1:
        mass, nucleus = 0.0, np.zeros(len(x), bool)
        for i in order:
            if p[i] > 0 and mass < top_p:
                nucleus[i], mass = True, mass + p[i]
        p = np.where(nucleus, p, 0.0) / p[nucleus].sum()
    return p


def _draw(sampling: decoding.Sampling, seed: int) -> np.ndarray:
    keys = decoding.sample_keys(seed, np.arange(ROWS), np.zeros(ROWS, np.int32))

    def step(tokens_R1, cache):
        return jnp.broadcast_to(jnp.asarray(LOGITS), (tokens_R1.shape[0], 1, len(LOGITS))), cache

    result = jax.jit(
        lambda keys: greedy_search(
            step,
            {"t": jnp.zeros((), jnp.int32)},
            jnp.ones(ROWS, jnp.int32),
            max_steps=1,
            choose=sampling.chooser(keys),
            ids=IDS,
        )
    )(jnp.asarray(keys))
    log_softmax = LOGITS - np.logaddexp.reduce(LOGITS[np.isfinite(LOGITS)])
    tokens = np.asarray(result.tokens[:, 0])
    np.testing.assert_allclose(result.log_probs, log_softmax[tokens], rtol=1e-5)  # the model's own log P
    return tokens


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 3, 1.0), (1.0, 0, 0.8), (2.0, 4, 0.9)]
)
def test_the_drawn_distribution_is_the_reshaped_models(temperature, top_k, top_p):
    expected = _expected(temperature, top_k, top_p)
    counts = np.bincount(_draw(decoding.Sampling(temperature, top_k, top_p), seed=1), minlength=len(LOGITS))
    assert np.all(counts[expected == 0] == 0), "a token outside the kept set was drawn"
    assert _chi_square_pvalue(counts, expected) > 1e-3
    np.testing.assert_allclose(
        np.exp(decoding.Sampling(temperature, top_k, top_p).log_probs(jnp.asarray(LOGITS[None]))[0]),
        expected,
        atol=1e-6,
    )


def _chi_square_pvalue(counts: np.ndarray, expected: np.ndarray) -> float:
    kept = expected > 0
    from scipy import stats  # here: ~1 s to import, which every xdist worker would pay at collection

    return stats.chisquare(counts[kept], ROWS * expected[kept]).pvalue


def test_the_chi_square_check_catches_a_slightly_wrong_sampler():
    """The test above has the power to see a sampler that is a little off: draws at temperature 1.15 (every
    probability within 0.03 of temperature 1's) fail it against temperature 1's distribution, seed after seed."""
    expected = _expected(1.0, 0, 1.0)
    for seed in (1, 2):
        counts = np.bincount(_draw(decoding.Sampling(1.15, 0, 1.0), seed=seed), minlength=len(LOGITS))
        assert _chi_square_pvalue(counts, expected) < 1e-3


def test_the_nucleus_threshold_is_the_sorted_definitions():
    """nucleus_threshold (bisection) against the definition on sorted rows: the least probability among the most
    probable tokens kept until their mass reaches p, over 1000 tokens, ties and a one-token row included."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(16, 1000)) * 3
    logits[1, :500] = logits[1, 500:]  # every probability twice
    logits[2] = -np.inf
    logits[2, 7] = 0.0
    probs = np.exp(logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)).astype(np.float32)
    for top_p in (0.1, 0.5, 0.9, 0.99):
        got = np.asarray(nucleus_threshold(jnp.asarray(probs), top_p))
        for row, threshold in zip(probs, got, strict=True):
            ranked = np.sort(row.astype(np.float64))[::-1]
            before = np.cumsum(ranked) - ranked
            assert threshold == ranked[np.sum(before < top_p) - 1], (top_p, threshold)


def test_inverse_cdf_draws_nothing_of_zero_weight_even_at_the_top_of_the_interval():
    weights_BV = jnp.asarray([[0.0, 2.0, 0.0, 1.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0, 0.0, 0.0]], jnp.float32)
    for u, expected in ((0.0, [1, 0]), (0.6, [1, 0]), (0.67, [3, 0]), (np.nextafter(1.0, 0.0), [3, 0]), (1.0, [3, 0])):
        got = inverse_cdf(weights_BV, jnp.full((2,), u, jnp.float32))
        assert got.tolist() == expected, u


def test_inverse_cdf_over_blocks_follows_the_flat_definition():
    """The two-level search (blocks of CDF_BLOCK tokens, V not a multiple of it, whole blocks of zero weight) picks
    the first index whose cumulative weight exceeds u * total, as numpy's float64 searchsorted does."""
    rng = np.random.default_rng(3)
    weights = np.exp(rng.normal(size=(4, 1000)) * 3)
    weights[1, :300] = weights[1, 520:] = 0.0  # mass in blocks 2..4 only
    weights[2, :999] = 0.0  # the last token, in the padded last block
    weights[3, 1:] = 0.0
    weights_NV = np.repeat(weights, 500, axis=0).astype(np.float32)
    u_N = rng.uniform(size=len(weights_NV)).astype(np.float32)
    got = np.asarray(inverse_cdf(jnp.asarray(weights_NV), jnp.asarray(u_N)))
    cdf = np.cumsum(weights_NV.astype(np.float64), axis=-1)
    expected = [np.searchsorted(c, u * c[-1], side="right") for c, u in zip(cdf, u_N, strict=True)]
    assert np.all(weights_NV[np.arange(len(got)), got] > 0)
    assert np.mean(got == expected) > 0.999  # float32 sums against float64: a boundary case may round either way
    assert set(got[1000:1500]) == {999} and set(got[1500:]) == {0}


def test_a_seed_reproduces_its_samples_and_other_seeds_differ():
    sampling = decoding.Sampling(1.0, 0, 1.0)
    a, b, c = _draw(sampling, 3), _draw(sampling, 3), _draw(sampling, 4)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.slow
def test_samples_through_the_scheduler_equal_the_one_jit_ones_and_depend_on_line_and_number_only():
    """The refilling batch (rows joining at other times, other neighbours) draws what one jit draws."""
    model, rng = shared_model(), np.random.default_rng(2)
    sources = [[int(t) for t in rng.integers(4, 50, k - 1)] + [EOS] for k in rng.integers(2, 10, 20)]
    max_len = [4 + i % 6 for i in range(20)]
    sampled = decoding.Sampled(alpha=0.6, sampling=decoding.Sampling(1.3, 0, 0.95), seed=7)
    keys = sampled.row_inputs(np.arange(20), np.zeros(20, np.int32))
    np.testing.assert_array_equal(keys["keys"], decoding.sample_keys(7, np.arange(20), np.zeros(20, np.int32)))
    refilled, one_jit = (
        decoding.Searcher(model, compact=c).sentences(
            sources, max_len, sampled, batch_size=16, shape=lambda _: (16, 9), row_inputs_N=keys
        )
        for c in (True, False)
    )
    for r, o in zip(refilled, one_jit, strict=True):
        n = int(o.lengths[0])
        assert int(r.lengths[0]) == n
        np.testing.assert_array_equal(r.tokens[0, :n], o.tokens[0, :n])
        np.testing.assert_allclose(r.log_probs, o.log_probs, rtol=1e-5, atol=1e-6)
    greedy = decoding.Searcher(model).sentences(
        sources, max_len, decoding.Greedy(alpha=0.6), batch_size=16, shape=lambda _: (16, 9)
    )
    assert any(not np.array_equal(g.tokens, r.tokens) for g, r in zip(greedy, refilled, strict=True))


def test_translate_draws_num_samples_per_line_reproducibly(tmp_path):
    from tests.helpers.decoding import CharTokenizer

    model, tok = shared_model(), CharTokenizer()
    lines = ["hello world", "", "the cat sat"]
    sampling = decoding.Sampling(1.0, 10, 1.0)

    def settings(seed: int) -> DecodeSettings:
        search = decoding.search_for(1, 0.6, sampling=sampling, seed=seed)
        return DecodeSettings(search, max_extra_len=5, max_len=0, batch_size=4, max_input_len=16)

    a, _ = translate_nbest(model, tok, lines, settings(5), nbest=3)
    b, _ = translate_nbest(model, tok, lines, settings(5), nbest=3)
    c, _ = translate_nbest(model, tok, lines, settings(6), nbest=3)
    assert a == b and a != c
    assert [len(x) for x in a] == [3, 3, 3]
    assert all([h.score for h in x] == sorted((h.score for h in x), reverse=True) for x in a)
    # The first line's samples do not depend on the lines beside it.
    alone, _ = translate_nbest(model, tok, lines[:1], settings(5), nbest=3)
    assert alone[0] == a[0]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (dict(temperature=0.0), r"--temperature must be > 0"),
        (dict(top_p=1.5), r"--top_p must be in \(0, 1\]"),
        (dict(top_p=0.0), r"--top_p must be in \(0, 1\]"),
        (dict(top_k=-1), r"--top_k must be >= 0"),
        (dict(num_samples=0), r"--num_samples must be >= 1"),
        (dict(beam_size=4), r"--sampling draws one token per step; --beam_size 4"),
    ],
)
def test_bad_sampling_flags_are_refused_in_one_line_before_the_model_and_nothing_is_written(tmp_path, flags, message):
    src = tmp_path / "src.txt"
    src.write_text("a b\n", encoding="utf-8")
    options = dict(workdir=str(tmp_path), source_file=str(src), output_file=str(tmp_path / "o" / "h"), sampling=True)
    with pytest.raises(EvalError, match=message):  # before the model: tmp_path has no checkpoint
        evaluate(dict(options, **flags))
    assert not (tmp_path / "o").exists()


def test_sampling_flags_write_the_samples(tmp_path):
    src = tmp_path / "src.txt"
    src.write_text("a b\nhello\n", encoding="utf-8")
    out = tmp_path / "o" / "h"
    options = dict(workdir=str(tmp_path), source_file=str(src), output_file=str(out), sampling=True)
    report = evaluate(dict(options, workdir=str(one_checkpoint(tmp_path / "w")), num_samples=2, seed=3, top_k=5))
    assert len(out.read_text(encoding="utf-8").splitlines()) == 2
    assert len(out.with_name("h.nbest").read_text(encoding="utf-8").splitlines()) == 4
    assert report["search"]["sampling"] == {"temperature": 1.0, "top_k": 5, "top_p": 1.0, "seed": 3, "num_samples": 2}


@pytest.mark.slow  # trimmed from the default run: the file keeps a fast representative
def test_sampling_and_greedy_search_write_default_outputs_of_their_own(tmp_path):
    src = tmp_path / "src.txt"
    src.write_text("a b\nhello\n", encoding="utf-8")
    options = dict(workdir=str(one_checkpoint(tmp_path)), source_file=str(src))
    greedy = evaluate(dict(options, beam_size=1))["hypotheses_file"]
    sampled = evaluate(dict(options, sampling=True, num_samples=1))["hypotheses_file"]
    assert greedy.endswith(".beam1.txt") and sampled.endswith(".sample1-seed0.txt")
    assert sorted(p.name for p in (tmp_path / "eval").glob("*.txt")) == sorted([Path(greedy).name, Path(sampled).name])
