"""The decoding features against CTranslate2 on an exported tiny model: forced-decoding log-probabilities
(score_batch), greedy outputs with a target prefix (target_prefix), and n-best lists (num_hypotheses).

The model is tests/test_export.py's kind: a tiny random model with a small SentencePiece vocabulary whose EOS
embedding resembles one piece's, so that outputs end with EOS as well as at their limit. Skipped when ctranslate2
is not installed.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.model import tiny_model
from tests.helpers.training import write_corpus
from transformer_jax import decoding
from transformer_jax.evaluation.scoring import score_pairs
from transformer_jax.evaluation.translate import DecodeSettings, output_limit, source_ids, translate_nbest
from transformer_jax.model.layers import SpecialIds

ctranslate2 = pytest.importorskip("ctranslate2", reason="ctranslate2 is not installed: the comparisons need it")
from transformer_jax.interop import ctranslate2 as export_lib  # noqa: E402 - needs the engine, checked above

VOCAB = 320  # byte fallback's 256 ids and the corpus' characters
MAX_INPUT_LEN, MAX_EXTRA_LEN = 16, 5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformer_jax.data.tokenizer import train_tokenizer

    directory = write_corpus(tmp_path_factory.mktemp("corpus"))
    lines = [line for split in ("train.en", "train.de") for line in (directory / split).read_text().splitlines()]
    tokenizer = train_tokenizer(
        lines, directory / "spm.model", vocab_size=VOCAB, model_type="unigram", ids=SpecialIds.DEFAULT
    )
    model = tiny_model(0, num_encoder_layers=1, num_decoder_layers=1, vocab_size=VOCAB)
    table = model.src_embed.table_VD
    # Some outputs stop at EOS, others at the limit.
    table[...] = table[...].at[SpecialIds.DEFAULT.eos].set(1.1 * table[...][109])
    path = export_lib.to_ctranslate2(model, tokenizer, tmp_path_factory.mktemp("export") / "ct2", max_positions=64)
    translator = ctranslate2.Translator(str(path), device="cpu", intra_threads=1)
    sources = (directory / "test.en").read_text(encoding="utf-8").splitlines()[:12]
    targets = (directory / "test.de").read_text(encoding="utf-8").splitlines()[:12]
    return model, tokenizer, translator, export_lib.vocabulary(tokenizer), sources, targets


def test_forced_decoding_log_probs_equal_score_batch(setup):
    model, tokenizer, translator, pieces, sources, targets = setup
    ours, _ = score_pairs(model, tokenizer, sources, targets, batch_size=8, max_len=64)
    theirs = translator.score_batch(
        [[pieces[i] for i in tokenizer.encode_source(s)] for s in sources],
        [[pieces[i] for i in tokenizer.encode_target(t)] for t in targets],
    )
    for o, t in zip(ours, theirs, strict=True):
        assert o.tokens == len(t.log_probs)  # the target's tokens and EOS
        np.testing.assert_allclose(o.log_prob, sum(t.log_probs), atol=1e-4, rtol=0)


def _limits(tokenizer, sentences):
    ids = [source_ids(tokenizer, s, MAX_INPUT_LEN)[0] for s in sentences]
    return ids, [output_limit(len(x), MAX_EXTRA_LEN, None) for x in ids]


def test_greedy_with_a_target_prefix_equals_target_prefix(setup):
    model, tokenizer, translator, pieces, sources, targets = setup
    prefixes = [" ".join(t.split()[: i % 3]) for i, t in enumerate(targets)]  # 0, 1 or 2 words of the reference
    settings = DecodeSettings(
        decoding.Greedy(alpha=0.0), max_extra_len=MAX_EXTRA_LEN, max_len=0, batch_size=8, max_input_len=MAX_INPUT_LEN
    )
    ours, _ = translate_nbest(model, tokenizer, sources, settings, nbest=1, prefixes=prefixes)
    ids, limits = _limits(tokenizer, sources)
    results = translator.translate_batch(
        [[pieces[t] for t in x[:-1]] for x in ids],
        target_prefix=[[pieces[t] for t in tokenizer.encode_target(p)] for p in prefixes],
        beam_size=1,
        max_input_length=0,
        max_decoding_length=max(limits),
        min_decoding_length=0,
        return_end_token=True,
    )
    index = {piece: i for i, piece in enumerate(pieces)}
    for o, r, limit, prefix in zip(ours, results, limits, prefixes, strict=True):
        out = [index[p] for p in r.hypotheses[0]][:limit]  # greedy: cut at each sentence's own limit
        theirs = tokenizer.decode_target([t for t in out if t != SpecialIds.DEFAULT.eos])
        assert o[0].text == theirs
        assert o[0].text.startswith(prefix)
    assert any(len(tokenizer.encode_source(p)) for p in prefixes)


def _our_nbest(model, tokenizer, sources, nbest: int, alpha: float, finished: str):
    """Our nbest best of beam 4 with the `average` penalty (CTranslate2's length_penalty formula)."""
    search = decoding.search_for(4, alpha, "average", finished)
    settings = DecodeSettings(search, max_extra_len=MAX_EXTRA_LEN, max_len=0, batch_size=8, max_input_len=MAX_INPUT_LEN)
    lists, _ = translate_nbest(model, tokenizer, sources, settings, nbest=nbest)
    return lists


def _their_nbest(setup, sources, nbest: int, alpha: float) -> list[tuple[list[str], list[float]]]:
    """CTranslate2's num_hypotheses list of beam 4 for each source, one call each with that source's output limit:
    (texts, scores)."""
    _, tokenizer, translator, pieces, _, _ = setup
    index = {piece: i for i, piece in enumerate(pieces)}
    ids, limits = _limits(tokenizer, sources)
    lists = []
    for x, limit in zip(ids, limits, strict=True):
        [r] = translator.translate_batch(
            [[pieces[t] for t in x[:-1]]],
            beam_size=4,
            num_hypotheses=nbest,
            length_penalty=alpha,
            return_scores=True,
            max_input_length=0,
            max_decoding_length=limit,
            min_decoding_length=0,
        )
        lists.append(([tokenizer.decode_target([index[p] for p in h]) for h in r.hypotheses], list(r.scores)))
    return lists


@pytest.mark.parametrize("alpha", [1.0, 0.0])
def test_nbest_with_the_average_penalty_scores_as_num_hypotheses(setup, alpha):
    """CTranslate2's length_penalty is our `average` (score / |Y| ** alpha, |Y| counting EOS; our `gnmt` has no
    equivalent there): a hypothesis in both 4-best lists of beam 4 has the same score. The lists themselves
    differ where the searches do (docs/decoding.md): ours keeps finished hypotheses in the W beams, CTranslate2
    sets them aside and keeps W live ones, so it holds hypotheses ours pruned. Without normalisation (alpha 0)
    both find the same best hypothesis."""
    model, tokenizer, _, _, sources, _ = setup
    sources = sources[:8]
    ours = _our_nbest(model, tokenizer, sources, 4, alpha, "in_beam")
    common = 0
    for o, (theirs, their_scores) in zip(ours, _their_nbest(setup, sources, 4, alpha), strict=True):
        scores = {t: s for t, s in zip(theirs, their_scores, strict=True) if theirs.count(t) == 1}
        for h in o:
            if h.text in scores and [g.text for g in o].count(h.text) == 1:
                common += 1
                assert h.score == pytest.approx(scores[h.text], abs=1e-4), h.text
        if alpha == 0.0:
            assert o[0].text == theirs[0]
    assert common >= len(sources)


@pytest.mark.parametrize(("alpha", "nbest"), [(1.0, 4), (0.0, 2), (0.6, 1)])
def test_set_aside_nbest_lists_equal_num_hypotheses(setup, alpha, nbest):
    """With finished hypotheses set aside (decoding/state.py SetAsideState), ours is CTranslate2's search: the same
    n-best lists, hypothesis for hypothesis and in order, and the same scores, with length normalisation (stopping at W
    ended hypotheses) and without (CTranslate2's early exit)."""
    model, tokenizer, _, _, sources, _ = setup
    ours = _our_nbest(model, tokenizer, sources, nbest, alpha, "set_aside")
    ended = ties = 0
    for o, (theirs, their_scores) in zip(ours, _their_nbest(setup, sources, nbest, alpha), strict=True):
        np.testing.assert_allclose([h.score for h in o], their_scores, atol=1e-4, rtol=0)
        # The scores agree place by place (above), so another hypothesis at a place is one of the same score: a
        # near-tie that the two engines' roundings may break either way. It is rare; a different search is not.
        ties += sum(h.text != text for h, text in zip(o, theirs, strict=True))
        ended += sum(h.ended for h in o)
    assert ties <= max(1, len(sources) * nbest // 50), ties  # rare: almost every hypothesis is the same
    # hypotheses that end with EOS, and (in the longer lists) ones cut at the limit
    assert ended > 0 and (nbest == 1 or ended < len(sources) * nbest)
