"""SentencePiece tokenizer: exact roundtrip on real corpora, reserved ids, reuse, and clear errors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import sentencepiece as spm

from configs import common
from tests.helpers import DATA
from transformer_jax.data import sources
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.errors import DataError
from transformer_jax.model.layers import SpecialIds

TRICKY = [
    "  two leading, two inner  spaces and a trailing one ",
    "tab\there, no-break\u00a0space, thin\u2009space",
    "Ligature \ufb01 and full-width \uff21 stay as typed (no NFKC)",
    "Emoji 😀🇩🇪, CJK 漢字, Devanagari नमस्ते, combining A\u0308 vs \u00c4",
    "",
    " ",
]


def corpus_lines(folder: str, split: str, lang: str, n: int) -> list[str]:
    path = DATA / folder / f"{split}.{lang}"
    if not path.exists():
        pytest.skip(f"shared corpora not found at {DATA} (set TRANSFORMER_JAX_DATA)")
    return path.read_text(encoding="utf-8").split("\n")[:n]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A workdir with a small unigram model trained through get_tokenizer on 1,500 Multi30k pairs."""
    if not (DATA / "multi30k" / "train.en").exists():
        pytest.skip(f"shared corpora not found at {DATA} (set TRANSFORMER_JAX_DATA)")
    config = common.data_config()
    config.text_dir = str(DATA / "multi30k")
    config.tokenizer_sample_sentences = 3000
    workdir = tmp_path_factory.mktemp("workdir")
    tokenizer_lib.get_tokenizer(config, workdir, vocab_size=1000, ids=SpecialIds.DEFAULT)
    return workdir


@pytest.fixture(scope="module")
def tokenizer(workdir) -> tokenizer_lib.Tokenizer:
    return tokenizer_lib.Tokenizer(workdir / "spm.model", SpecialIds.DEFAULT)


def test_reserved_ids_and_size(tokenizer):
    assert tokenizer.ids == SpecialIds.DEFAULT == SpecialIds(pad=0, eos=1, bos=2, unk=3)
    assert tokenizer.vocab_size == 1000
    ids = tokenizer.encode_source("A man rides a bike.")
    assert ids and min(ids) > 3, "ordinary text must not produce pad/eos/bos/unk"


@pytest.mark.parametrize(
    "folder, split",
    [("multi30k", "test"), ("wmt14_ende", "test")],
)
def test_roundtrip_is_exact_on_real_corpora(tokenizer, folder, split):
    for lang in ("en", "de"):
        lines = corpus_lines(folder, split, lang, 300)
        encoded = tokenizer.encode_source_batch(lines)
        assert [tokenizer.decode_target(ids) for ids in encoded] == lines
        assert encoded == [tokenizer.encode_source(line) for line in lines]
        assert tokenizer.ids.unk not in {i for ids in encoded for i in ids}  # byte fallback instead of <unk>


def test_roundtrip_of_characters_never_seen_in_training(tokenizer):
    for text in TRICKY:
        assert tokenizer.decode_target(tokenizer.encode_source(text)) == text


def test_decode_stops_at_eos_and_drops_padding(tokenizer):
    ids = tokenizer.encode_source("Two dogs play.")
    assert (
        tokenizer.decode_target([tokenizer.ids.bos, *ids, tokenizer.ids.eos, *tokenizer.encode_source("junk"), 0, 0])
        == "Two dogs play."
    )
    assert tokenizer.decode_target_batch([[*ids, 1, 0], [1]]) == ["Two dogs play.", ""]


def test_workdir_model_is_reused_not_retrained(workdir, tokenizer, monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("the model in the workdir must be reused")

    monkeypatch.setattr(tokenizer_lib, "train_tokenizer", no_training)
    config = common.data_config()
    reused = tokenizer_lib.get_tokenizer(config, workdir, vocab_size=1000, ids=SpecialIds.DEFAULT)
    assert reused.encode_source("A dog runs.") == tokenizer.encode_source("A dog runs.")
    with pytest.raises(DataError, match="1000 pieces but model.vocab_size is 2000"):
        tokenizer_lib.get_tokenizer(config, workdir, vocab_size=2000, ids=SpecialIds.DEFAULT)


def test_given_model_file(workdir, tmp_path):
    config = common.data_config()
    config.tokenizer_model = str(workdir / "spm.model")
    assert tokenizer_lib.get_tokenizer(config, tmp_path, vocab_size=1200, ids=SpecialIds.DEFAULT).vocab_size == 1000
    assert not (tmp_path / "spm.model").exists()
    with pytest.raises(DataError, match="ids would fall outside"):
        tokenizer_lib.get_tokenizer(config, tmp_path, vocab_size=500, ids=SpecialIds.DEFAULT)


def test_unreadable_or_invalid_model_file(tmp_path):
    config = common.data_config()
    config.tokenizer_model = str(tmp_path / "missing.model")
    with pytest.raises(DataError, match="cannot read tokenizer model .*missing.model"):
        tokenizer_lib.get_tokenizer(config, tmp_path, vocab_size=1000, ids=SpecialIds.DEFAULT)
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a protobuf \xff\x00")
    with pytest.raises(DataError, match="garbage.model is not a SentencePiece model"):
        tokenizer_lib.Tokenizer(garbage, SpecialIds.DEFAULT)


def test_a_model_with_other_reserved_ids_is_refused(tmp_path):
    """SentencePiece's own defaults (unk 0, bos 1, eos 2, no pad) would shift every id the model and search use."""
    lines = corpus_lines("multi30k", "valid", "en", 500)
    prefix = tmp_path / "defaults"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=200, minloglevel=2
    )
    with pytest.raises(
        DataError,
        match=r"reserves \(pad, eos, bos, unk\) = \(-1, 2, 1, 0\); the config's model.pad_id, .* \(0, 1, 2, 3\)",
    ):
        tokenizer_lib.Tokenizer(f"{prefix}.model", SpecialIds.DEFAULT)


def test_a_tokenizer_trained_here_reserves_the_configs_ids_and_a_reused_one_must_match(tmp_path):
    lines = corpus_lines("multi30k", "valid", "en", 500)
    ids = SpecialIds(pad=3, eos=0, bos=2, unk=1)
    trained = tokenizer_lib.train_tokenizer(
        lines, tmp_path / "spm.model", vocab_size=400, model_type="unigram", ids=ids
    )
    assert trained.ids == ids
    encoded = trained.encode_source("A man rides a bike.")
    assert trained.decode_target([ids.bos, *encoded, ids.eos, 7, 7]) == "A man rides a bike."
    config = common.data_config()
    with pytest.raises(DataError, match=r"reserves \(pad, eos, bos, unk\) = \(3, 0, 2, 1\)"):
        tokenizer_lib.get_tokenizer(config, tmp_path, vocab_size=400, ids=SpecialIds.DEFAULT)
    with pytest.raises(DataError, match="model.bos_id .* other than model.pad_id"):
        tokenizer_lib.train_tokenizer(
            lines, tmp_path / "x.model", vocab_size=400, model_type="unigram", ids=SpecialIds(3, 0, 3, 1)
        )


def test_bpe_option_and_bad_type(tmp_path):
    lines = corpus_lines("multi30k", "valid", "en", 1014) + corpus_lines("multi30k", "valid", "de", 1014)
    bpe = tokenizer_lib.train_tokenizer(
        lines, tmp_path / "bpe.model", vocab_size=600, model_type="bpe", ids=SpecialIds.DEFAULT
    )
    assert bpe.vocab_size == 600 and (bpe.ids.pad, bpe.ids.eos) == (0, 1)
    for text in lines[:50] + TRICKY:
        assert bpe.decode_target(bpe.encode_source(text)) == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bpe.model"], "no temporary files left behind"
    with pytest.raises(DataError, match="unknown data.tokenizer_type 'wordpiece'"):
        tokenizer_lib.train_tokenizer(
            lines, tmp_path / "x.model", vocab_size=600, model_type="wordpiece", ids=SpecialIds.DEFAULT
        )


def test_the_sample_is_drawn_by_index_and_read_in_one_pass(tmp_path, monkeypatch):
    """The same pairs as indexing a list of every pair (the sample before streaming), without building that list."""
    monkeypatch.setattr(sources, "READ_BYTES", 64)
    en, de = [f"sentence {i}" for i in range(100)], [f"Satz {i}" for i in range(100)]
    (tmp_path / "train.en").write_text("".join(s + "\n" for s in en), encoding="utf-8")
    (tmp_path / "train.de").write_text("".join(s + "\n" for s in de), encoding="utf-8")
    config = common.data_config()
    config.text_dir = str(tmp_path)
    sample = tokenizer_lib.sample_sentences(sources.open_stream(config, "train"), 40, seed=3)
    indices = sorted(random.Random(3).sample(range(100), 20))
    assert sample == [s for i in indices for s in (en[i], de[i])]


def test_line_breaks_are_every_character_that_splits_a_line():
    splitting = {c for c in map(chr, range(0x110000)) if len(f"a{c}b".splitlines()) > 1}
    assert splitting == set(tokenizer_lib.LINE_BREAKS)


def test_a_decoded_translation_is_one_line_whatever_byte_pieces_it_holds(tokenizer):
    # A sampled output can hold byte-fallback pieces of line breaks: written as they are, they would shift every
    # later line of the output file against its input.
    pieces = ["<0x0A>", "<0x0C>", "<0x0D>", "<0xE2>", "<0x80>", "<0xA8>"]  # \n, \f, \r and U+2028 in UTF-8
    model = spm.SentencePieceProcessor(model_file=str(tokenizer.path))
    ids = [*tokenizer.encode_source("Two"), *(model.piece_to_id(p) for p in pieces)]
    ids += tokenizer.encode_source("dogs")
    assert tokenizer.ids.unk not in ids  # each byte is a piece of its own
    text = tokenizer.decode_target(ids)
    assert text.splitlines() == [text] and text.startswith("Two") and text.endswith("dogs")
