"""Forced decoding (evaluation/scoring.py and evaluate.py --score): the training loss's nll, the search's own
log-probabilities, and the command line's inputs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers.decoding import CharTokenizer, one_checkpoint, shared_model
from tests.helpers.model import forward
from transformer_jax import decoding
from transformer_jax.data import batching
from transformer_jax.data.pipeline import eval_batches
from transformer_jax.errors import EvalError, UserError
from transformer_jax.evaluation.command import evaluate
from transformer_jax.evaluation.scoring import packed_batches, score_pairs
from transformer_jax.evaluation.translate import DecodeSettings, translate_nbest
from transformer_jax.training.step import cross_entropy_sums

SOURCES = ["hello world", "a", "", "the cat sat on the mat", "b c d", "x" * 30]
TARGETS = ["hallo welt", "", "leer", "die katze", "b c", "y" * 25]


def test_corpus_nll_equals_the_training_loss_and_rows_do_not_interact():
    model, tok = shared_model(), CharTokenizer()
    scores, stats = score_pairs(model, tok, SOURCES, TARGETS, batch_size=4, max_len=16)
    nll, tokens = 0.0, 0
    batches, _ = eval_batches(SOURCES, tok, 8, 16, targets=TARGETS)
    for b in batches:
        logits = forward(
            model,
            jnp.asarray(b["src_tokens"]),
            jnp.asarray(b["tgt_in"]),
            src_segment_ids=jnp.asarray(b["src_segment_ids"]),
            tgt_segment_ids=jnp.asarray(b["tgt_segment_ids"]),
            src_positions=jnp.asarray(b["src_positions"]),
            tgt_positions=jnp.asarray(b["tgt_positions"]),
        )
        sums = cross_entropy_sums(logits, b["tgt_out"], b["tgt_segment_ids"] > 0, 0.0, fused_backward=False)
        nll, tokens = nll + float(sums["nll_sum"]), tokens + int(sums["tokens"])
    assert stats["tokens"] == tokens == sum(s.tokens for s in scores)
    np.testing.assert_allclose(-stats["log_prob"], nll, rtol=1e-5)
    np.testing.assert_allclose(stats["perplexity"], np.exp(nll / tokens), rtol=1e-5)
    assert stats["truncated_sources"] == 2 and stats["truncated_targets"] == 1
    # Each pair alone (other neighbours, another padded shape) scores the same.
    for i in (0, 3, 5):
        [alone], _ = score_pairs(model, tok, [SOURCES[i]], [TARGETS[i]], batch_size=1, max_len=16)
        assert alone.tokens == scores[i].tokens
        np.testing.assert_allclose(alone.log_prob, scores[i].log_prob, rtol=1e-5)
    assert scores[1].tokens == 1  # an empty target: EOS only


def test_pairs_are_packed_once_each_into_few_equal_batches():
    # 300 pairs of 1-20 tokens a side in rows of 32 slots: each pair in one batch, segments side by side within a
    # row, batches of equal rows (a multiple of 8, at most batch_size), and the slots mostly tokens (one pair a row
    # padded to a bucket filled about half).
    rng = np.random.default_rng(0)
    src = [list(rng.integers(4, 50, rng.integers(1, 20))) for _ in range(300)]
    tgt = [list(rng.integers(4, 50, rng.integers(1, 20))) for _ in range(300)]
    examples = batching.from_ids(src, tgt, 32, eos=CharTokenizer.ids.eos)
    plans = list(packed_batches(examples, 64, 32))
    assert sorted(np.concatenate([p.items for p in plans])) == list(range(300))
    assert len({p.shape for p in plans}) == 1 and plans[0].shape[0] % 8 == 0 and plans[0].shape[0] <= 64
    for p in plans:
        for lens, offsets in ((examples.src_lens, p.src_offsets), (examples.tgt_lens, p.tgt_offsets)):
            ends = offsets + lens[p.items]
            assert ends.max() <= 32
            for r in np.unique(p.rows):  # within a row, the pairs' slots do not overlap
                mine = np.argsort(offsets[p.rows == r])
                assert np.all(offsets[p.rows == r][mine][1:] >= ends[p.rows == r][mine][:-1])
    slots = len(plans) * plans[0].shape[0] * 32
    assert examples.tgt_lens.sum() / slots > 0.8
    assert list(packed_batches(batching.from_ids([], [], 32, eos=CharTokenizer.ids.eos), 64, 32)) == []


def test_the_score_of_a_searched_output_is_the_searchs_log_probability():
    """Teacher-forcing what beam search produced gives the log P the search accumulated (EOS included)."""
    model, tok = shared_model(), CharTokenizer()
    sources = [s for s in SOURCES if s][:4]
    settings = DecodeSettings(
        decoding.Beam(alpha=0.6, beam_size=2), max_extra_len=5, max_len=0, batch_size=4, max_input_len=64
    )
    lists, _ = translate_nbest(model, tok, sources, settings, nbest=2)
    ended = [(s, h) for s, x in zip(sources, lists, strict=True) for h in x if len(h.text) + 1 == h.length]
    assert ended, "some hypotheses must end with EOS"
    scores, _ = score_pairs(model, tok, [s for s, _ in ended], [h.text for _, h in ended], batch_size=4, max_len=64)
    for (_, h), s in zip(ended, scores, strict=True):
        assert s.tokens == h.length
        np.testing.assert_allclose(s.log_prob, h.log_prob, rtol=1e-4, atol=1e-5)


def _evaluate(tmp_path, sources, targets, **flags):
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("".join(x + "\n" for x in sources), encoding="utf-8")
    ref.write_text("".join(x + "\n" for x in targets), encoding="utf-8")
    options = dict(
        workdir=str(tmp_path), source_file=str(src), references_file=str(ref), output_file=str(tmp_path / "o" / "s")
    )
    return evaluate(dict(options, **flags))


def test_score_flag_writes_one_line_per_pair_and_the_corpus_perplexity(tmp_path):
    one_checkpoint(tmp_path)
    report = _evaluate(tmp_path, SOURCES, TARGETS, score=True)
    lines = (tmp_path / "o" / "s").read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(SOURCES)
    fields = [line.split("\t") for line in lines]
    total, tokens = sum(float(f[0]) for f in fields), sum(int(f[2]) for f in fields)
    for f in fields:
        assert float(f[1]) == pytest.approx(float(f[0]) / int(f[2]), abs=1e-5)
    assert report["scoring"]["tokens"] == tokens
    assert report["scoring"]["perplexity"] == pytest.approx(np.exp(-total / tokens), rel=1e-5)


@pytest.mark.parametrize(
    ("targets", "flags", "message"),
    [
        (TARGETS[:4], {}, r"src.txt has 6 lines, .*ref.txt has 4"),
        (TARGETS, {"nbest": 2}, r"--score .* --nbest"),
        (TARGETS, {"beam_size": 8, "alpha": 1.5}, r"--score .*; --beam_size, --alpha would be ignored: drop them"),
        (TARGETS, {"length_penalty": "average", "finished": "set_aside"}, r"--length_penalty, --finished would be"),
    ],
)
def test_bad_score_inputs_are_refused_before_the_model_and_nothing_is_written(tmp_path, targets, flags, message):
    with pytest.raises(UserError, match=message):  # before the model: tmp_path has no checkpoint
        _evaluate(tmp_path, SOURCES, targets, score=True, **flags)
    assert not (tmp_path / "o").exists()


def test_score_needs_references(tmp_path):
    src = tmp_path / "src.txt"
    src.write_text("a\n", encoding="utf-8")
    with pytest.raises(EvalError, match="--score needs --references_file"):
        evaluate(dict(workdir=str(tmp_path), source_file=str(src), score=True))
