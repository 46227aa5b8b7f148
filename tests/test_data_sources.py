"""Sources: local {split}.{lang} text files with every kind of bad input, and TFDS translation builders."""

from __future__ import annotations

from pathlib import Path

import pytest

from configs import common
from tests.helpers.tfds import tfds_config  # registers the tiny TFDS builders
from transformer_jax.data import sources
from transformer_jax.errors import DataError


def write(directory: Path, name: str, content: str | bytes) -> Path:
    path = directory / name
    path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return path


def text_config(directory: Path, src: str = "en", tgt: str = "de"):
    config = common.data_config()
    config.source, config.text_dir, config.src_lang, config.tgt_lang = "text", str(directory), src, tgt
    return config


def test_reads_aligned_pairs_in_either_direction(tmp_path):
    # U+2028 and U+0085 are line breaks to str.splitlines() but not to a corpus file; CRLF endings are tolerated.
    write(tmp_path, "train.en", "A dog.\nTwo\u2028cats\u0085.\r\nA  spaced  line \n")
    write(tmp_path, "train.de", "Ein Hund.\nZwei Katzen.\nEine Zeile\n")
    assert sources.load_split(text_config(tmp_path), "train") == [
        ("A dog.", "Ein Hund."),
        ("Two\u2028cats\u0085.", "Zwei Katzen."),
        ("A  spaced  line ", "Eine Zeile"),
    ]
    assert sources.load_split(text_config(tmp_path, "de", "en"), "train")[0] == ("Ein Hund.", "A dog.")


def test_empty_lines_skip_the_pair_and_are_counted(tmp_path):
    write(tmp_path, "train.en", "one\n\nthree\nfour\n  \nsix")  # no final newline: still six lines
    write(tmp_path, "train.de", "eins\nzwei\n\nvier\nfünf\nsechs\n")
    pairs, skipped = sources.read_text_split(tmp_path, "train", "en", "de")
    assert pairs == [("one", "eins"), ("four", "vier"), ("six", "sechs")]
    assert skipped == 3


def test_mismatched_line_counts_name_both_files_and_counts(tmp_path):
    src = write(tmp_path, "train.en", "a\nb\nc\n")
    tgt = write(tmp_path, "train.de", "a\nb\n")
    with pytest.raises(DataError) as e:
        sources.read_text_split(tmp_path, "train", "en", "de")
    assert str(src) in str(e.value) and str(tgt) in str(e.value)
    assert "3 lines" in str(e.value) and "has 2" in str(e.value)


def test_empty_file(tmp_path):
    write(tmp_path, "train.en", "a\n")
    tgt = write(tmp_path, "train.de", "")
    with pytest.raises(DataError, match=f"{tgt} is empty"):
        sources.read_text_split(tmp_path, "train", "en", "de")


def test_only_empty_pairs_is_an_error(tmp_path):
    write(tmp_path, "train.en", "\n\n")
    write(tmp_path, "train.de", "x\n\n")
    with pytest.raises(DataError, match="no pair with both sides non-empty"):
        sources.read_text_split(tmp_path, "train", "en", "de")


def test_invalid_utf8_names_file_and_line(tmp_path):
    write(tmp_path, "train.en", "fine\nalso fine\nstill fine\n")  # equal counts: a mismatch is found first
    bad = write(tmp_path, "train.de", b"gut\nauch gut\n\xff kaputt\n")
    with pytest.raises(DataError, match=f"{bad}, line 3: invalid UTF-8"):
        sources.read_text_split(tmp_path, "train", "en", "de")


@pytest.mark.parametrize("block", [1, 2, 3, 7, 1 << 20])
def test_streaming_a_file_in_blocks_gives_the_lines_of_reading_it_whole(tmp_path, monkeypatch, block):
    """Block boundaries fall inside CRLF, inside multi-byte characters and inside lines; none may show."""
    monkeypatch.setattr(sources, "READ_BYTES", block)
    text = "a\r\nÄß\u2028x\n\n  \n漢字😀\r\nlast line without LF"
    path = write(tmp_path, "train.en", text)
    lines = [line for chunk in sources.iter_lines(path) for line in chunk]
    assert lines == [line.removesuffix("\r") for line in text.split("\n")]
    assert sources.count_lines(path) == len(lines) == 6
    write(tmp_path, "train.de", text + "\n")  # a final LF ends the last line; it does not add one
    assert [line for chunk in sources.iter_lines(tmp_path / "train.de") for line in chunk] == lines
    assert sources.count_lines(tmp_path / "train.de") == 6
    bad = write(tmp_path, "bad.en", b"ok\nok\n" + "é".encode()[:1] + b"\nok\n")
    with pytest.raises(DataError, match=f"{bad}, line 3: invalid UTF-8"):
        list(sources.iter_lines(bad))


def test_a_streamed_sample_picks_the_same_pairs_as_indexing(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "READ_BYTES", 16)
    en = [f"sentence {i}" if i % 7 else "" for i in range(200)]  # every 7th pair has a blank side
    de = [f"Satz {i}" for i in range(200)]
    write(tmp_path, "train.en", "".join(s + "\n" for s in en))
    write(tmp_path, "train.de", "".join(s + "\n" for s in de))
    stream = sources.open_stream(text_config(tmp_path), "train")
    assert len(stream) == 200
    indices = [0, 1, 2, 63, 64, 65, 140, 199]
    assert stream.pick(indices) == [(en[i], de[i]) for i in indices if en[i]]
    chunks = list(stream.chunks(64))
    assert [lines for lines, _ in chunks] == [64, 64, 64, 8]
    assert [p for _, pairs in chunks for p in pairs] == sources.load_split(text_config(tmp_path), "train")


def test_missing_split_lists_available_splits(tmp_path):
    for split in ("train", "valid"):
        for lang in ("en", "de"):
            write(tmp_path, f"{split}.{lang}", "x\n")
    with pytest.raises(DataError) as e:
        sources.read_text_split(tmp_path, "test", "en", "de")
    assert str(tmp_path / "test.en") in str(e.value) and "['train', 'valid']" in str(e.value)


def test_unknown_language_lists_available_languages(tmp_path):
    write(tmp_path, "train.en", "x\n")
    write(tmp_path, "train.de", "x\n")
    with pytest.raises(DataError, match=r"language 'fr'.*\['de', 'en'\]"):
        sources.read_text_split(tmp_path, "train", "en", "fr")
    with pytest.raises(DataError, match="does not exist"):
        sources.read_text_split(tmp_path / "nope", "train", "en", "de")


def test_unknown_source_name():
    config = common.data_config()
    config.source = "ftp"
    with pytest.raises(DataError, match="unknown data.source 'ftp'"):
        sources.open_split(config, "train")


def test_a_relative_text_dir_is_taken_from_the_working_directory_wherever_the_repository_is(monkeypatch, tmp_path):
    write(tmp_path, "valid.en", "A dog.\n")
    write(tmp_path, "valid.de", "Ein Hund.\n")
    monkeypatch.chdir(tmp_path)
    assert sources.load_split(text_config(Path(".")), "valid") == [("A dog.", "Ein Hund.")]
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the same config, started from another directory
    with pytest.raises(DataError, match="no files for language 'en'"):
        sources.load_split(text_config(Path(".")), "valid")


def test_a_text_source_without_a_directory_says_which_key_to_set():
    config = common.data_config()  # data.source=text, and no text_dir by default: no path of this checkout
    with pytest.raises(DataError, match="data.source=text needs data.text_dir"):
        sources.load_split(config, "valid")


# ----------------------------------------------------------------------------------------------------------------
# TFDS, through array_record random access and without TensorFlow.


def test_tfds_builder_in_both_directions(tmp_path):
    forward = sources.load_split(tfds_config(tmp_path), "train")
    backward = sources.load_split(tfds_config(tmp_path, src="de", tgt="en"), "train")
    assert sorted(forward) == [(f"en sentence {i}", f"de Satz {i} \u00e4\u00df") for i in range(7)]
    assert backward == [(t, s) for s, t in forward]
    assert (tmp_path / "transformer_jax_tiny_translate" / "de-en" / "1.0.0").is_dir()
    pairs = sources.open_split(tfds_config(tmp_path), "validation")  # random access, already prepared
    assert len(pairs) == 3 and pairs[1][0].startswith("en sentence ")
    stream = sources.open_stream(tfds_config(tmp_path), "train")  # what a store is built from, in chunks
    assert [len(chunk) for _, chunk in stream.chunks(3)] == [3, 3, 1]
    assert [p for _, chunk in stream.chunks(3) for p in chunk] == sources.read_all(stream)
    assert stream.identity()["version"] == "1.0.0" and stream.identity()["records"] == 7


def test_tfds_errors_are_clear(tmp_path):
    with pytest.raises(DataError, match="unknown TFDS dataset 'no_such_translate/de-en'"):
        sources.load_split(tfds_config(tmp_path, name="no_such_translate/de-en"), "train")
    with pytest.raises(DataError, match=r"languages \['en', 'fr'\].*en-de"):
        sources.load_split(tfds_config(tmp_path, name="transformer_jax_tiny_translate/fr-en"), "train")
    with pytest.raises(DataError, match=r"no split 'valid'; available splits: \['train', 'validation'\]"):
        sources.load_split(tfds_config(tmp_path), "valid")


def test_tfds_not_prepared_says_how_to_prepare(tmp_path):
    name = "transformer_jax_offline_translate/de-en"
    with pytest.raises(DataError) as e:
        sources.load_split(tfds_config(tmp_path, name=name, download=False), "train")
    assert "not prepared" in str(e.value) and f"tfds.builder('{name}'" in str(e.value)
    assert "data.source=text" in str(e.value)
    with pytest.raises(DataError) as e:
        sources.load_split(tfds_config(tmp_path, name=name), "train")
    assert "cannot download and prepare" in str(e.value) and "www.statmt.org" in str(e.value)
    assert "download_and_prepare()" in str(e.value)


def test_wmt14_builder_resolves_without_tensorflow(tmp_path):
    """The real WMT14 builder is found (TFDS registers it lazily) and reports its language pair before preparing."""
    config = tfds_config(tmp_path, download=False)
    with pytest.raises(DataError, match="wmt14_translate/de-en.*not prepared"):
        sources.open_tfds_split(config, "wmt14_translate/de-en", "train")
    with pytest.raises(DataError, match=r"languages \['en', 'fr'\]"):
        sources.open_tfds_split(config, "wmt14_translate/fr-en", "train")
