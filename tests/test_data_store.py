"""The tokenized training store: the same batches as the in-memory path, restarts that read no text, stale and
damaged stores, and bad input that leaves no store behind."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest

from tests.helpers.training import tiny_train_config, write_corpus
from transformer_jax.data import batching, pipeline, sources, store
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.errors import DataError
from transformer_jax.model.layers import SpecialIds


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pathlib.Path:
    """The training helpers' 400 pairs, plus pairs with a blank side (skipped) and long ones (length-filtered)."""
    directory = write_corpus(tmp_path_factory.mktemp("corpus"))
    extra_en = ["", "the dog", "  ", " ".join(["the big red house"] * 12), "a cat"]
    extra_de = ["der hund", "", "die katze", "das haus", " ".join(["der große rote hund"] * 12)]
    for lang, extra in (("en", extra_en), ("de", extra_de)):
        with open(directory / f"train.{lang}", "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in extra))
    return directory


@pytest.fixture(scope="module")
def tokenizer(corpus, tmp_path_factory) -> tokenizer_lib.Tokenizer:
    config = tiny_train_config(corpus)
    return tokenizer_lib.get_tokenizer(
        config.data, tmp_path_factory.mktemp("run"), vocab_size=320, ids=SpecialIds.of(config)
    )


def _config(corpus: pathlib.Path, **data):
    config = tiny_train_config(corpus)
    config.data.update(data)
    return config.data


def _fresh_tokenizer(tokenizer, directory: pathlib.Path) -> tokenizer_lib.Tokenizer:
    """The same tokenizer in its own directory, so each test has its own store."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(tokenizer.path, directory / "spm.model")
    return tokenizer_lib.Tokenizer(directory / "spm.model", SpecialIds.DEFAULT)


@pytest.mark.parametrize("mode", ["pack", "bucket", "pad"])
def test_the_store_gives_exactly_the_in_memory_batches_and_resumes_exactly(corpus, tokenizer, tmp_path, mode):
    config = _config(corpus, batching=mode, tokens_per_batch=256, batch_window=96)
    tok = _fresh_tokenizer(tokenizer, tmp_path)
    store.build(config, tok, store.store_path(config, tok), num_threads=1, chunk_pairs=37)  # chunks split the data
    examples, _ = store.open_train_store(config, tok, build_if_missing=False)
    in_memory = batching.tokenize_pairs(sources.read_all(sources.open_split(config, "train")), tok)
    for field in store.ARRAYS:
        np.testing.assert_array_equal(getattr(examples, field), getattr(in_memory, field), err_msg=field)
    assert isinstance(examples.src.base, np.memmap) and not examples.src.flags.writeable  # mapped, not loaded
    assert examples.src.dtype == np.uint16
    memory_it, memory_stats = pipeline.make_train_iterator(config, tok, process_index=0, process_count=1)
    store_it, store_stats = pipeline.make_train_iterator(
        config, tok, examples=examples, process_index=0, process_count=1
    )
    assert store_stats == memory_stats and store_stats["dropped_too_long"] == 2  # the two long pairs
    expected = []
    for step in range(300):  # many windows and epochs
        want, got = next(memory_it), next(store_it)
        assert store_it.get_state() == memory_it.get_state()
        for key in want:
            assert got[key].dtype == want[key].dtype == np.int32
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"batch {step}, {key}")
        if step == 150:
            state = json.loads(json.dumps(store_it.get_state()))  # what a checkpoint stores
        if step > 150:
            expected.append(want)
    resumed, _ = pipeline.make_train_iterator(config, tok, examples=examples, process_index=0, process_count=1)
    resumed.set_state(state)
    for want in expected:
        got = next(resumed)
        assert all(np.array_equal(got[k], want[k]) for k in want)


def test_a_restart_reads_no_text_and_tokenizes_nothing(corpus, tokenizer, tmp_path, monkeypatch):
    config = _config(corpus)
    tok = _fresh_tokenizer(tokenizer, tmp_path)
    built, path = store.open_train_store(config, tok, build_if_missing=True)
    assert path == tmp_path / "spm.train.en-de.store"
    manifest = store.read_manifest(path)
    assert manifest["counts"] == {
        "lines": 405,
        "pairs": 402,  # three pairs have a blank side
        "src_tokens": int(built.src_starts[-1]),
        "tgt_tokens": int(built.tgt_starts[-1]),
    }

    def forbidden(*args, **kwargs):
        raise AssertionError("a restart must not read text or tokenize")

    monkeypatch.setattr(sources, "iter_lines", forbidden)
    monkeypatch.setattr(sources, "count_lines", forbidden)
    monkeypatch.setattr(tokenizer_lib.Tokenizer, "encode_source_batch", forbidden)
    reopened, same_path = store.open_train_store(config, tok, build_if_missing=False)
    assert same_path == path and len(reopened) == 402
    assert (path / "manifest.json").read_text() == json.dumps(manifest, indent=1) + "\n"


def test_a_stale_store_is_rebuilt_on_one_host_and_refused_on_several(corpus, tokenizer, tmp_path):
    tok = _fresh_tokenizer(tokenizer, tmp_path / "run")
    with pytest.raises(DataError, match="does not exist.*python -m transformer_jax.data.prepare"):
        store.open_train_store(_config(corpus), tok, build_if_missing=False)
    assert not list((tmp_path / "run").glob("*.store*")), "a refused run builds nothing"
    _, path = store.open_train_store(_config(corpus), tok, build_if_missing=True)
    # Another source: a copy of the corpus with one more line.
    other = pathlib.Path(shutil.copytree(corpus, tmp_path / "other"))
    for lang in ("en", "de"):
        with open(other / f"train.{lang}", "a", encoding="utf-8") as f:
            f.write("the cat\n" if lang == "en" else "die katze\n")
    with pytest.raises(DataError, match=r"built from other input \(differs in input\).*transformer_jax.data.prepare"):
        store.open_train_store(_config(other), tok, build_if_missing=False)
    examples, same_path = store.open_train_store(_config(other), tok, build_if_missing=True)
    assert same_path == path and len(examples) == 403
    # Another tokenizer: a different model file under the same name.
    store.open_train_store(_config(corpus), tok, build_if_missing=True)
    config = tiny_train_config(corpus)
    config.data.tokenizer_sample_sentences = 200
    retrained = tokenizer_lib.get_tokenizer(config.data, tmp_path / "retrained", vocab_size=300, ids=SpecialIds.DEFAULT)
    shutil.copy(retrained.path, tok.path)
    with pytest.raises(DataError, match=r"differs in tokenizer_sha256\)"):
        store.open_train_store(
            _config(corpus), tokenizer_lib.Tokenizer(tok.path, SpecialIds.DEFAULT), build_if_missing=False
        )
    # Another direction is another store; max_len is applied when opened, so it is not part of the store.
    de_en = _config(corpus, src_lang="de", tgt_lang="en", max_len=16)
    assert store.store_path(de_en, tok) == tmp_path / "run" / "spm.train.de-en.store"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["spm.model", "spm.train.en-de.store"]


def test_a_damaged_store_is_a_clear_error_and_verify_checks_every_byte(corpus, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(store, "SAMPLE_BLOCKS", 2)  # small samples, so a byte between them goes unnoticed at start
    monkeypatch.setattr(store, "SAMPLE_BYTES", 256)
    config = _config(corpus)
    tok = _fresh_tokenizer(tokenizer, tmp_path / "run")
    _, path = store.open_train_store(config, tok, build_if_missing=True)
    store.verify(path)
    pristine = {f.name: f.read_bytes() for f in path.iterdir()}

    def damage(name: str, offset: int | None = None, truncate: bool = False) -> None:
        for f, data in pristine.items():
            (path / f).write_bytes(data)
        data = bytearray(pristine[name])
        if truncate:
            data = data[:-2]
        else:
            data[offset] ^= 0x04
        (path / name).write_bytes(bytes(data))

    damage("tgt.npy", truncate=True)
    with pytest.raises(DataError, match=r"tgt\.npy: \d+ bytes where the manifest says \d+.*delete .*store"):
        store.open_train_store(config, tok, build_if_missing=True)
    damage("src.npy", offset=store.HEADER_BYTES + 3)  # inside the first sampled block
    with pytest.raises(DataError, match=r"src\.npy: fails its checksum \(sampled blocks\)"):
        store.open_train_store(config, tok, build_if_missing=True)
    middle = len(pristine["src_starts.npy"]) // 2 // 8 * 8 + 1  # the second byte of an offset between the samples
    damage("src_starts.npy", offset=middle)
    with pytest.raises(DataError, match=r"src_starts\.npy: offsets do not increase"):
        store.open_train_store(config, tok, build_if_missing=True)
    damage("tgt.npy", offset=len(pristine["tgt.npy"]) // 2)  # a token id between the samples
    store.open_train_store(config, tok, build_if_missing=True)  # the cheap check cannot see it...
    with pytest.raises(DataError, match=r"tgt\.npy: fails its checksum \(SHA-256 of all its data\)"):
        store.verify(path)  # ...prepare --verify does


def test_invalid_utf8_deep_in_a_file_names_the_line_and_leaves_no_store(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(sources, "READ_BYTES", 1000)  # the bad line is many blocks in
    lines = [f"the dog {i}" for i in range(3000)]
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "train.de").write_text("".join(f"der hund {i}\n" for i in range(3000)), encoding="utf-8")
    bad = tmp_path / "corpus" / "train.en"
    bad.write_bytes("".join(line + "\n" for line in lines[:2999]).encode() + b"the \xff dog\n")
    tok = _fresh_tokenizer(tokenizer, tmp_path / "run")
    with pytest.raises(DataError, match=f"{bad}, line 3000: invalid UTF-8"):
        store.open_train_store(_config(tmp_path / "corpus"), tok, build_if_missing=True, num_threads=1)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["spm.model"], "no store, no temporary files"


def test_mismatched_line_counts_fail_before_any_tokenizing(tmp_path, tokenizer, monkeypatch):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "train.en").write_text("a\nb\nc\n", encoding="utf-8")
    (tmp_path / "corpus" / "train.de").write_text("a\nb\n", encoding="utf-8")

    def no_work(*args, **kwargs):
        raise AssertionError("nothing may be decoded or tokenized before the line counts are compared")

    monkeypatch.setattr(tokenizer_lib.Tokenizer, "encode_source_batch", no_work)
    monkeypatch.setattr(sources, "iter_lines", no_work)
    tok = _fresh_tokenizer(tokenizer, tmp_path / "run")
    with pytest.raises(DataError, match=r"line counts differ: .*train.en has 3 lines, .*train.de has 2"):
        store.open_train_store(_config(tmp_path / "corpus"), tok, build_if_missing=True)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["spm.model"]


def test_a_tfds_split_streams_into_the_same_store(tokenizer, tmp_path):
    from tests.helpers.tfds import tfds_config  # registers the tiny TFDS builders

    config = tfds_config(tmp_path / "tfds")
    config.max_len, config.batch_size = 32, 8
    tok = _fresh_tokenizer(tokenizer, tmp_path / "run")
    store.build(config, tok, store.store_path(config, tok), num_threads=1, chunk_pairs=3)
    examples, path = store.open_train_store(config, tok, build_if_missing=False)
    in_memory = batching.tokenize_pairs(sources.read_all(sources.open_split(config, "train")), tok)
    for field in store.ARRAYS:
        np.testing.assert_array_equal(getattr(examples, field), getattr(in_memory, field), err_msg=field)
    identity = store.read_manifest(path)["identity"]
    assert (
        identity["input"]["tfds_name"] == "transformer_jax_tiny_translate/de-en" and identity["input"]["records"] == 7
    )


def test_data_store_dir_places_the_store_and_an_unwritable_one_is_one_clear_error(corpus, tokenizer, tmp_path):
    tok = _fresh_tokenizer(tokenizer, tmp_path / "run")
    _, path = store.open_train_store(_config(corpus, store_dir=str(tmp_path / "stores")), tok, build_if_missing=True)
    assert path == tmp_path / "stores" / "spm.train.en-de.store" and (path / "manifest.json").is_file()
    (tmp_path / "a_file").write_text("")
    with pytest.raises(DataError, match=r"data\.store_dir"):
        store.open_train_store(_config(corpus, store_dir=str(tmp_path / "a_file" / "x")), tok, build_if_missing=True)
