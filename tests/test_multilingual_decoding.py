"""Decoding a multilingual model into a chosen language: the forced target token (0 to log P, one to the length,
left out of --score), no language token after it, batches that mix directions, and evaluate.py's --target_lang,
--source_lang and --text_dir on a multilingual workdir (tests/helpers/fakes.py: random parameters, no training)."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers.fakes import base_params, tiny_config, write_workdir
from transformer_jax import decoding
from transformer_jax.data import languages
from transformer_jax.errors import EvalError
from transformer_jax.evaluation.command import evaluate
from transformer_jax.evaluation.scoring import score_pairs
from transformer_jax.evaluation.translate import DecodeSettings, LanguageIds, translate, translate_nbest
from transformer_jax.model.layers import SpecialIds
from transformer_jax.model.transformer import build_model

PIECES = 50  # fakes.write_workdir's spm.model; the two languages take ids 50 (de) and 51 (en)
TABLE = languages.Placement("target", {"de": PIECES, "en": PIECES + 1})
INTO_DE, INTO_EN = LanguageIds(None, PIECES), LanguageIds(None, PIECES + 1)


class IdTokenizer:
    """Text is ids spelled `wN`: decode then encode gives the same ids back (BOS and UNK included), so that a
    hypothesis can be scored as the very tokens the search emitted."""

    ids = SpecialIds.DEFAULT
    language_table = TABLE

    def encode_source(self, text: str) -> list[int]:
        return [int(word[1:]) for word in text.split()]

    encode_target = encode_source

    def encode_source_batch(self, texts, num_threads: int = 1) -> list[list[int]]:
        return [self.encode_source(t) for t in texts]

    encode_target_batch = encode_source_batch

    def decode_target(self, ids) -> str:
        drop = {self.ids.pad, *TABLE.ids.values()}
        out = []
        for i in map(int, ids):
            if i == self.ids.eos:
                break
            if i not in drop:
                out.append(f"w{i}")
        return " ".join(out)


def model_of(bias: dict[int, float] | None = None):
    """The tiny model with both language ids, its final logits bias raised at `bias`'s ids."""
    config = tiny_config(vocab_size=PIECES + 2, lang_token="target", final_logits_bias=True)
    model = build_model(config, rngs=nnx.Rngs(0))
    model.eval()
    if bias:
        values = np.zeros(config.model.vocab_size, np.float32)
        for token, value in bias.items():
            values[token] = value
        model.final_logits_bias_V[...] = jnp.asarray(values)
    return model


SOURCES = [" ".join(f"w{4 + (7 * i + 3 * j) % 40}" for j in range(3 + i % 5)) for i in range(10)]


def settings(beam_size: int = 1) -> DecodeSettings:
    return DecodeSettings(
        decoding.search_for(beam_size, 0.6), max_extra_len=6, max_len=0, batch_size=4, max_input_len=32
    )


@pytest.mark.parametrize("beam_size", [1, 3])
def test_the_forced_language_token_adds_nothing_and_counts_one_and_score_leaves_it_out(beam_size):
    model, tokenizer = model_of({SpecialIds.DEFAULT.eos: 1.0}), IdTokenizer()  # some outputs end, some do not
    lists, _ = translate_nbest(model, tokenizer, SOURCES, settings(beam_size), nbest=1, language_ids=INTO_DE)
    best = [x[0] for x in lists]
    scores, _ = score_pairs(
        model, tokenizer, SOURCES, [h.text for h in best], batch_size=8, max_len=64, language_ids=INTO_DE
    )
    assert 0 < sum(h.ended for h in best) < len(best)
    for h, s in zip(best, scores, strict=True):
        # the forced token is one of the output's tokens, not one of the scored; an unended output is scored with EOS
        assert s.tokens == h.length - 1 + (not h.ended)
        if h.ended:  # the same tokens: log P with the forced token's 0
            assert s.log_prob == pytest.approx(h.log_prob, abs=1e-4)


def test_no_language_token_follows_the_forced_one():
    """A bias that makes `en` the most probable token everywhere changes nothing into `de`: it is never chosen, so
    the outputs are those of the model without it (the normalisation, and so the log-probabilities, do change)."""
    tokenizer = IdTokenizer()
    plain, plain_stats = translate(model_of(), tokenizer, SOURCES, settings(), language_ids=INTO_DE)
    biased, biased_stats = translate(model_of({PIECES + 1: 50.0}), tokenizer, SOURCES, settings(), language_ids=INTO_DE)
    assert biased == plain and any(plain)
    assert biased_stats["tgt_tokens"] == plain_stats["tgt_tokens"]
    assert biased_stats["hit_max_len"] == plain_stats["hit_max_len"]


@pytest.mark.parametrize("beam_size", [1, 2])
def test_a_batch_of_mixed_target_languages_gives_one_language_at_a_time_outputs(beam_size):
    model, tokenizer = model_of(), IdTokenizer()
    into = [INTO_DE if i % 3 else INTO_EN for i in range(len(SOURCES))]
    mixed, _ = translate(model, tokenizer, SOURCES, settings(beam_size), language_ids=into)
    for lang in (INTO_DE, INTO_EN):
        rows = [i for i, x in enumerate(into) if x == lang]
        alone, _ = translate(model, tokenizer, [SOURCES[i] for i in rows], settings(beam_size), language_ids=lang)
        assert [mixed[i] for i in rows] == alone
    assert mixed != translate(model, tokenizer, SOURCES, settings(beam_size), language_ids=INTO_DE)[0]


def test_one_language_id_per_sentence_or_none():
    with pytest.raises(ValueError, match="3 sentences but 2 language_ids"):
        LanguageIds.per_line([INTO_DE, INTO_EN], 3)


# -- evaluate.py on a multilingual workdir -----------------------------------------------------------------------

EN = ["a small dog runs.", "two men sit on a bench.", "", "a girl in a red coat."]
DE = ["ein kleiner hund rennt.", "zwei manner sitzen.", "", "ein madchen im roten mantel."]


def multilingual_workdir(root: Path, scheme: str = "target", directions=("en-de", "de-en")) -> Path:
    """A workdir of a random model of the directions' languages (ids from 50) whose text folder holds
    {train,test,dev}.{en,de} (and .fr, a copy of .en)."""
    data = root / "data"
    data.mkdir(parents=True)
    for split in ("train", "test", "dev"):
        for lang, lines in (("en", EN), ("de", DE), ("fr", EN)):
            (data / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    count = len({lang for d in directions for lang in d.split("-")})
    config = tiny_config(vocab_size=PIECES + count, lang_token=scheme)
    config.data.update(source="text", text_dir=str(data), directions=tuple(directions), src_lang="", tgt_lang="")
    config.eval.average_last = 1
    return write_workdir(root / "run", config, {10: base_params(config)}, pieces=PIECES)


@pytest.fixture
def workdir(tmp_path):
    return multilingual_workdir(tmp_path)


def test_evaluate_translates_a_split_into_the_chosen_language_and_scores_it(workdir, capsys):
    report = evaluate(dict(workdir=str(workdir), split="test", target_lang="de", beam_size=1))
    out = Path(report["hypotheses_file"])
    assert out.name == "test(test.en-de).step10.beam1.txt"  # the direction in the name: no other overwrites it
    assert report["lines"] == 4 and report["scores"] is not None
    # The same translations as the library's with the direction's tokens (a code names the language too).
    again = evaluate(dict(workdir=str(workdir), split="test", target_lang=">>de<<", beam_size=1, output_file=str(out)))
    assert again["scores"] == report["scores"]
    assert "4 lines translated" in capsys.readouterr().out


def test_the_direction_places_the_model_s_language_tokens(tmp_path):
    from transformer_jax.evaluation import run

    for scheme, expected in (("target", (None, PIECES)), ("source", (PIECES, None)), ("source_and_target", (51, 50))):
        workdir = multilingual_workdir(tmp_path / scheme, scheme)
        model = run.Model(str(workdir), target_lang="de", source_lang="en")
        assert run.load(run.Translate(model, split="test")).language_ids == expected


def test_a_workdir_tokenizer_places_language_ids_as_the_model_does(tmp_path):
    from transformer_jax.evaluation.restore import saved_config, workdir_tokenizer

    for scheme in ("source", "target", "source_and_target"):
        workdir = multilingual_workdir(tmp_path / scheme, scheme)
        config = saved_config(str(workdir), None)
        assert workdir_tokenizer(config, str(workdir)).language_table == languages.Placement.of(config)


def test_score_excludes_the_forced_token(workdir):
    report = evaluate(dict(workdir=str(workdir), split="test", target_lang="de", score=True))
    lines = Path(report["scores_file"]).read_text(encoding="utf-8").splitlines()
    # tokens per line: the reference's characters and EOS, not the language token
    assert [int(line.split("\t")[2]) for line in lines] == [len(t) + 1 for t in DE]


def test_text_dir_and_any_split_name(workdir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "news.en").write_text("a dog.\n", encoding="utf-8")
    (other / "news.de").write_text("ein hund.\n", encoding="utf-8")
    report = evaluate(dict(workdir=str(workdir), split="news", text_dir=str(other), target_lang="de", beam_size=1))
    assert report["lines"] == 1 and report["source"] == "news(news.en-de)"


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            dict(split="test"),
            r"holds a multilingual model \(data.directions en-de, de-en\): give --target_lang, one of de, en",
        ),
        (
            dict(split="test", target_lang="fr"),
            r"--target_lang fr: the model of .* has no token for it; it has de \(>>de<<\), en \(>>en<<\)",
        ),
        (dict(split="test", target_lang="de", source_lang="de"), "--source_lang and --target_lang are both de"),
        (
            dict(source_file="SRC", target_lang="de", source_lang="en"),
            r"carry no language token of their own \(model.lang_token=target\)",
        ),
        (dict(split="nosuch", target_lang="de"), "missing split 'nosuch'"),
        (dict(split="test", text_dir="NOWHERE", target_lang="de"), "--text_dir NOWHERE is not a directory"),
    ],
)
def test_bad_language_flags_are_one_line_and_write_nothing(workdir, flags, message):
    flags = {k: str(workdir.parent / "data" / "test.en") if v == "SRC" else v for k, v in flags.items()}
    with pytest.raises(Exception, match=message) as e:
        evaluate(dict(workdir=str(workdir), **flags))
    assert "\n" not in str(e.value)
    assert not (workdir / "eval").exists()


def test_source_lang_is_refused_for_a_bilingual_model(tmp_path):
    config = tiny_config()
    config.eval.average_last = 1
    write_workdir(tmp_path, config, {10: base_params(config)})
    src = tmp_path / "s.txt"
    src.write_text("a dog.\n", encoding="utf-8")
    with pytest.raises(EvalError, match=r"holds a bilingual model \(en-de\); drop --source_lang"):
        evaluate(dict(workdir=str(tmp_path), source_file=str(src), source_lang="en"))


def test_a_file_needs_its_language_where_sources_carry_their_own_token(tmp_path):
    workdir = multilingual_workdir(tmp_path, "source_and_target", ("en-de", "fr-de", "de-en"))
    src = tmp_path / "s.txt"
    src.write_text("a dog.\n", encoding="utf-8")
    with pytest.raises(EvalError, match="give --source_lang, one of de, en, fr"):
        evaluate(dict(workdir=str(workdir), source_file=str(src), target_lang="de", beam_size=1))
    report = evaluate(dict(workdir=str(workdir), source_file=str(src), target_lang="de", source_lang="en", beam_size=1))
    assert report["source"] == "s.txt.en-de"
    written = json.loads(Path(report["hypotheses_file"] + ".json").read_text())
    assert written["lines"] == 1
    # A split's source file defaults to the only language trained into the target (into English: German); a
    # file's language is never guessed among the model's sources.
    with pytest.raises(EvalError, match="give --source_lang"):
        evaluate(dict(workdir=str(workdir), source_file=str(src), target_lang="en", beam_size=1))
    assert evaluate(dict(workdir=str(workdir), split="test", target_lang="en", beam_size=1))["source"] == (
        "test(test.de-en)"
    )


def test_translate_corpus_translates_into_the_chosen_language_as_evaluate_does(workdir, tmp_path):
    from transformer_jax.translate_corpus.run import job_of, translate_corpus

    src, out = workdir.parent / "data" / "test.en", tmp_path / "corpus.de"
    flags = {"workdir": str(workdir), "target_lang": "de", "beam_size": 1}
    translate_corpus(job_of(flags, str(src), str(out), chunk_lines=2))
    report = evaluate(dict(source_file=str(src), output_file=str(tmp_path / "eval.de"), **flags))
    assert out.read_text(encoding="utf-8") == Path(report["hypotheses_file"]).read_text(encoding="utf-8")
    with pytest.raises(EvalError, match="--target_lang fr: the model"):
        translate_corpus(job_of({**flags, "target_lang": "fr"}, str(src), str(tmp_path / "x"), chunk_lines=2))
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.parts").exists()
