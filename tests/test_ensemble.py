"""Ensembles (decoding/ensemble.py, evaluate.py --ensemble_workdirs): each step averages the members'
log-probabilities, checked against the members' teacher-forced distributions, in search and in forced decoding
(--score); members are checked before use."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers.decoding import BOS, EOS, PAD, CharTokenizer, one_checkpoint, shared_model, tiny_eval_config
from tests.helpers.model import forward, tiny_model
from transformer_jax import decoding
from transformer_jax.decoding.ensemble import Ensemble
from transformer_jax.errors import EvalError
from transformer_jax.evaluation.command import evaluate
from transformer_jax.evaluation.scoring import score_pairs


def _sources(n: int):
    rng = np.random.default_rng(6)
    return [[int(t) for t in rng.integers(4, 50, k - 1)] + [EOS] for k in rng.integers(2, 10, n)]


@pytest.mark.parametrize("sentences", [4, pytest.param(20, marks=pytest.mark.slow)])  # 20: the refilling batch
def test_ensemble_greedy_follows_the_mean_of_the_members_log_probs_and_keeps_each_members_cache(sentences):
    """Members of different depths (3 and 1 decoder layers): every greedy token is the argmax of the mean of the
    members' teacher-forced log-probabilities, and the output's log P is their sum under the renormalised mean."""
    members = [shared_model(), tiny_model(2, num_decoder_layers=1)]
    sources, max_len = _sources(sentences), [3 + i % 6 for i in range(sentences)]
    found = decoding.Searcher(Ensemble(members)).sentences(
        sources, max_len, decoding.Greedy(alpha=0.6), batch_size=16, shape=lambda _: (16, 9)
    )
    for src, r in zip(sources[:6], found[:6], strict=True):
        n = int(r.lengths[0])
        out = [int(t) for t in r.tokens[0, :n]]
        # Padded to fixed lengths (one compilation per member); causality hides the padding after position n - 1.
        src_BS = jnp.asarray([src + [PAD] * (10 - len(src))])
        tgt_BT = jnp.asarray([[BOS, *out[:-1]] + [PAD] * (9 - n)])
        log_probs = [np.asarray(jax.nn.log_softmax(forward(m, src_BS, tgt_BT)[0, :n], -1)) for m in members]
        mean_TV = np.mean(log_probs, 0)
        mean_TV = mean_TV - np.logaddexp.reduce(mean_TV, axis=-1, keepdims=True)
        assert out == [int(t) for t in np.argmax(mean_TV, axis=-1)]
        np.testing.assert_allclose(r.log_probs[0], mean_TV[np.arange(n), out].sum(), rtol=1e-4, atol=1e-5)
    assert all(int(t) != PAD for r in found for t in r.tokens[0, : int(r.lengths[0])])


def _mean_log_probs_by_hand(members, src: list[int], tgt_in: list[int]) -> np.ndarray:
    """[T, V] the renormalised mean of the members' teacher-forced log-probabilities, in float64 numpy.

    Padded to 16 (one compilation per member): padding in the source is masked, and causality hides it in the
    target after position T - 1."""
    src_BS, tgt_BT = jnp.asarray([src + [PAD] * (16 - len(src))]), jnp.asarray([tgt_in + [PAD] * (16 - len(tgt_in))])
    log_probs = [
        np.asarray(jax.nn.log_softmax(forward(m, src_BS, tgt_BT)[0, : len(tgt_in)], -1), np.float64) for m in members
    ]
    mean_TV = np.mean(log_probs, 0)
    return mean_TV - np.logaddexp.reduce(mean_TV, axis=-1, keepdims=True)


def test_ensemble_scores_are_sums_of_the_renormalised_mean_of_the_members_log_probs():
    """Forced decoding with an ensemble (members of 3 and 1 decoder layers) against each pair's teacher-forced
    members combined by hand; the pairs are batched (4 rows of different lengths), the reference one at a time."""
    members, tok = [shared_model(), tiny_model(2, num_decoder_layers=1)], CharTokenizer()
    sources, targets = ["hello world", "a", "the cat", "b c d e"], ["hallo welt", "", "die katze sass", "b"]
    scores, stats = score_pairs(Ensemble(members), tok, sources, targets, batch_size=4, max_len=16)
    for s, t, got in zip(sources, targets, scores, strict=True):
        tgt = tok.encode(t) + [EOS]
        mean_TV = _mean_log_probs_by_hand(members, tok.encode(s) + [EOS], [BOS, *tgt[:-1]])
        assert got.tokens == len(tgt)
        np.testing.assert_allclose(got.log_prob, mean_TV[np.arange(len(tgt)), tgt].sum(), rtol=1e-4, atol=1e-5)
    alone, _ = score_pairs(members[0], tok, sources, targets, batch_size=4, max_len=16)
    assert all(abs(a.log_prob - e.log_prob) > 1e-3 for a, e in zip(alone, scores, strict=True))
    assert stats["tokens"] == sum(s.tokens for s in scores)


@pytest.mark.slow
def test_an_ensemble_of_one_model_twice_decodes_as_the_model():
    model, sources = shared_model(), _sources(4)
    max_len = [6] * 4
    beam, settings = decoding.Beam(alpha=0.6, beam_size=2), dict(batch_size=8, shape=lambda _: (16, 9))
    alone = decoding.Searcher(model).sentences(sources, max_len, beam, **settings)
    twice = decoding.Searcher(Ensemble([model, model])).sentences(sources, max_len, beam, **settings)
    for a, t in zip(alone, twice, strict=True):
        np.testing.assert_array_equal(a.tokens, t.tokens)
        np.testing.assert_allclose(a.scores, t.scores, rtol=1e-5, atol=1e-6)


def test_members_with_another_vocabulary_are_refused():
    with pytest.raises(ValueError, match=r"vocabulary size: \[50, 60\]"):
        Ensemble([tiny_model(0), tiny_model(0, vocab_size=60)])


def _evaluate(tmp_path, **flags):
    """evaluate.py with one_checkpoint in tmp_path and in its members b (the same model), empty (no checkpoint) and
    other (another vocabulary size)."""
    for name in ("", "b"):
        one_checkpoint(tmp_path / name)
    (tmp_path / "empty").mkdir(exist_ok=True)
    other = tiny_eval_config()
    other.model.vocab_size = 60
    one_checkpoint(tmp_path / "other", config=other)
    src = tmp_path / "src.txt"
    src.write_text("hello world\nthe cat\n", encoding="utf-8")
    options = dict(workdir=str(tmp_path), source_file=str(src), output_file=str(tmp_path / "o" / "h"))
    return evaluate(dict(options, **flags))


@pytest.mark.slow
def test_ensemble_flag_decodes_with_every_member(tmp_path):
    _evaluate(tmp_path, ensemble_workdirs=[str(tmp_path / "b")])
    assert len((tmp_path / "o" / "h").read_text(encoding="utf-8").splitlines()) == 2


def test_score_flag_scores_with_the_ensemble(tmp_path):
    """--score with --ensemble_workdirs teacher-forces the ensemble (here one model twice: the model's scores)."""
    (tmp_path / "ref.txt").write_text("hallo welt\ndie katze\n", encoding="utf-8")
    scored = {}
    for name, members in (("alone", None), ("twice", [str(tmp_path / "b")])):
        flags = dict(score=True, references_file=str(tmp_path / "ref.txt"), ensemble_workdirs=members)
        _evaluate(tmp_path, **flags, output_file=str(tmp_path / name))
        scored[name] = [[float(x) for x in line.split("\t")] for line in (tmp_path / name).read_text().splitlines()]
    assert len(scored["twice"]) == 2
    np.testing.assert_allclose(scored["twice"], scored["alone"], rtol=1e-5)


@pytest.mark.parametrize(
    ("member", "message"),
    [
        ("empty", r"--ensemble_workdirs member .*empty has no checkpoint"),
        ("other", r"member .*other has vocabulary size 60, --workdir has vocabulary size 50"),
    ],
)
def test_bad_members_are_refused_in_one_line_and_nothing_is_written(tmp_path, member, message):
    with pytest.raises(EvalError, match=message):
        _evaluate(tmp_path, ensemble_workdirs=[str(tmp_path / member)])
    assert not (tmp_path / "o").exists()
