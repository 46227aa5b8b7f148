"""The tokenizer of a multilingual run: vocab_size - L pieces trained on a sample balanced across languages, and
the languages' ids after the pieces (never text, dropped when decoding, shown as >>xx<<)."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import ml_collections
import pytest

from configs import common
from tests.helpers import DATA
from transformer_jax.data import languages, sources
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.model.layers import SpecialIds

LANGS = ("cs", "de", "en", "fr")  # sorted: the order of their ids
DIRECTIONS = ("en-de", "de-en", "en-fr", "en-cs")
VOCAB_SIZE = 404  # 400 pieces + 4 languages
LINES = 200


def write_multiway(directory: Path, lines: int = LINES) -> Path:
    """A 4-way folder of `lines` training lines per language: Multi30k's first lines when the shared corpora are
    here, else synthetic sentences (the tests need no download)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for lang in LANGS:
        source = DATA / "multi30k" / f"train.{lang}"
        if source.exists():
            text = source.read_text(encoding="utf-8").split("\n")[:lines]
        else:
            letters = {"cs": "abcčdeěfhiíkmnorřsštuůvyýž", "de": "abcdeghiklmnorsätuüßz", "fr": "abcdeéèfilmnopqrstuàç"}
            alphabet = letters.get(lang, "abcdefghijklmnopqrstuvwxyz")
            words = ["".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8))) for _ in range(300)]
            text = [
                " ".join(rng.choice(words) for _ in range(rng.randint(4, 12))).capitalize() + "." for _ in range(lines)
            ]
        (directory / f"train.{lang}").write_text("".join(line + "\n" for line in text), encoding="utf-8")
    return directory


def multilingual_config(text_dir: Path) -> ml_collections.ConfigDict:
    config = common.data_config()
    config.text_dir = str(text_dir)
    config.directions = DIRECTIONS
    config.tokenizer_type = "bpe"
    config.tokenizer_sample_sentences = 4 * LINES
    return config


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[ml_collections.ConfigDict, Path]:
    """(config, workdir) of a multilingual run whose tokenizer get_tokenizer trained."""
    root = tmp_path_factory.mktemp("multilingual")
    config = multilingual_config(write_multiway(root / "data"))
    tokenizer_lib.get_tokenizer(config, root / "run", vocab_size=VOCAB_SIZE, ids=SpecialIds.DEFAULT)
    return config, root / "run"


@pytest.fixture(scope="module")
def tok(run) -> tokenizer_lib.Tokenizer:
    config, workdir = run
    return tokenizer_lib.get_tokenizer(config, workdir, vocab_size=VOCAB_SIZE, ids=SpecialIds.DEFAULT)


def test_pieces_are_vocab_size_less_the_languages_whose_ids_follow_them(run, tok):
    config, workdir = run
    assert tok.pieces == VOCAB_SIZE - len(LANGS) == tokenizer_lib.Tokenizer(workdir / "spm.model", tok.ids).vocab_size
    assert tok.vocab_size == tok.source_vocab_size == VOCAB_SIZE
    full = ml_collections.ConfigDict({"data": config.to_dict(), "model": {"vocab_size": VOCAB_SIZE}})
    placement = languages.Placement.of(full)
    for i, lang in enumerate(LANGS):
        assert tok.language_id(lang) == tok.language_id(languages.code(lang)) == placement.id(lang) == tok.pieces + i
    with pytest.raises(ConfigError, match="language 'ja'"):
        tok.language_id("ja")


def test_a_language_id_is_its_code_and_decodes_to_nothing(tok):
    text = "A dog runs on the beach."
    for lang in LANGS:
        lid = tok.language_id(lang)
        assert tok.source_pieces([lid]) == tok.target_pieces([lid]) == [languages.code(lang)]
        assert tok.decode_target([lid]) == ""
        assert tok.decode_target([lid, *tok.encode_target(text), tok.ids.eos]) == text


def test_text_never_encodes_to_a_language_id(tok):
    files = [DATA / "multi30k" / f"test.{lang}" for lang in LANGS]
    lines = [line for f in files if f.exists() for line in f.read_text("utf-8").split("\n")]  # else those below
    lines += [f"{languages.code(lang)} a sentence with its code" for lang in LANGS]
    lines += [">>", "<<", "\t \x00 😀 漢字 \u0308", "  "]
    ids = {i for batch in (tok.encode_source_batch(lines), tok.encode_target_batch(lines)) for x in batch for i in x}
    assert max(ids) < tok.pieces
    assert [tok.decode_target(x) for x in tok.encode_source_batch(lines)] == lines


def test_the_fingerprint_holds_the_languages(run, tok):
    config, workdir = run
    digest = hashlib.sha256((workdir / "spm.model").read_bytes()).hexdigest()
    assert tokenizer_lib.Tokenizer(workdir / "spm.model", tok.ids).fingerprint() == digest  # bilingual: as before
    assert tok.fingerprint().startswith(digest + "+") and tok.fingerprint() != digest
    other = ml_collections.ConfigDict({"data": {"directions": ("en-de", "de-en", "en-fr", "en-ja")}})
    other.model = {"vocab_size": VOCAB_SIZE}
    table = languages.Placement.of(other)
    assert tokenizer_lib.Tokenizer(workdir / "spm.model", tok.ids, language_table=table).fingerprint() not in (
        tok.fingerprint(),
        digest,
    )


def test_a_bilingual_tokenizer_has_no_language_ids(run):
    _, workdir = run
    plain = tokenizer_lib.Tokenizer(workdir / "spm.model", SpecialIds.DEFAULT)
    assert plain.vocab_size == plain.pieces == VOCAB_SIZE - len(LANGS)
    with pytest.raises(ConfigError, match="no language tokens"):
        plain.language_id("en")


def test_the_workdir_model_is_reused_and_must_have_vocab_size_less_the_languages_pieces(run, tok, monkeypatch):
    config, workdir = run
    monkeypatch.setattr(tokenizer_lib, "train_tokenizer", lambda *a, **k: pytest.fail("retrained"))
    again = tokenizer_lib.get_tokenizer(config, workdir, vocab_size=VOCAB_SIZE, ids=SpecialIds.DEFAULT)
    assert again.fingerprint() == tok.fingerprint()
    for wrong in (VOCAB_SIZE + 1, VOCAB_SIZE - 1):
        with pytest.raises(DataError) as e:
            tokenizer_lib.get_tokenizer(config, workdir, vocab_size=wrong, ids=SpecialIds.DEFAULT)
        message = str(e.value)
        assert "\n" not in message and str(workdir / "spm.model") in message
        assert f"has {VOCAB_SIZE - 4} pieces but model.vocab_size is {wrong} - 4 languages = {wrong - 4}" in message
    bilingual = common.data_config()  # the same file as a bilingual run's has 4 pieces too few
    with pytest.raises(DataError, match=f"has {VOCAB_SIZE - 4} pieces but model.vocab_size is {VOCAB_SIZE};"):
        tokenizer_lib.get_tokenizer(bilingual, workdir, vocab_size=VOCAB_SIZE, ids=SpecialIds.DEFAULT)


def test_a_given_model_may_not_reach_the_language_ids(run):
    config, workdir = run
    given = ml_collections.ConfigDict(config.to_dict())
    given.tokenizer_model = str(workdir / "spm.model")
    bigger = tokenizer_lib.get_tokenizer(given, workdir / "x", vocab_size=VOCAB_SIZE + 8, ids=SpecialIds.DEFAULT)
    assert bigger.vocab_size == VOCAB_SIZE + 8 and bigger.language_id("cs") == VOCAB_SIZE + 4  # a gap is allowed
    with pytest.raises(DataError, match="would fall outside the embedding table or take the languages' ids"):
        tokenizer_lib.get_tokenizer(given, workdir / "x", vocab_size=VOCAB_SIZE - 1, ids=SpecialIds.DEFAULT)


def _marked(directory: Path, sizes: dict[str, int], blank_every: int = 0) -> dict[str, Path]:
    """One file per language, line i `lang i` (blank every `blank_every`-th line)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {lang: directory / f"train.{lang}" for lang in sizes}
    for lang, n in sizes.items():
        lines = ["" if blank_every and i % blank_every == 0 else f"{lang} {i}" for i in range(n)]
        files[lang].write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return files


@pytest.mark.parametrize("temperature", [1.0, 5.0])
def test_each_language_gets_the_temperatures_share_of_the_sample(tmp_path, temperature):
    sizes = {"xa": 2000, "xb": 500, "xc": 100}
    files = _marked(tmp_path, sizes)
    sample = tokenizer_lib.language_sample(files, 200, temperature)
    counts = {lang: sum(s.split()[0] == lang for s in sample) for lang in sizes}
    shares = languages.probabilities(list(sizes.values()), temperature)
    assert list(counts.values()) == [round(200 * p) for p in shares]  # T=1: 155/39/8; T=5: 87/66/48 (approx.)
    assert (counts["xc"] < 10) == (temperature == 1.0)  # a temperature lifts the small language
    assert len(set(sample)) == len(sample) and all(int(s.split()[1]) < sizes[s.split()[0]] for s in sample)
    assert sample == tokenizer_lib.language_sample(files, 200, temperature)  # seeded


def test_a_small_language_gives_at_most_its_lines_and_blank_lines_are_left_out(tmp_path):
    files = _marked(tmp_path, {"xa": 1000, "xb": 30}, blank_every=3)
    sample = tokenizer_lib.language_sample(files, 2000, 1.0)
    assert sorted(s for s in sample if s.startswith("xb")) == sorted(f"xb {i}" for i in range(30) if i % 3)
    assert all(s.strip() for s in sample)
    empty = _marked(tmp_path / "empty", {"xa": 0, "xb": 0})
    with pytest.raises(DataError, match="no lines to train the tokenizer on"):
        tokenizer_lib.language_sample(empty, 10, 1.0)


def test_a_language_only_limited_directions_use_is_sampled_from_their_first_lines(tmp_path):
    """data.direction_lines (languages.language_lines): Czech trained on its first 40 lines gives only those, and
    its share is that of 40 lines."""
    files = _marked(tmp_path, {"xa": 400, "xb": 400})
    sample = tokenizer_lib.language_sample(files, 200, 1.0, lambda lang, lines: 40 if lang == "xb" else lines)
    xb = [s for s in sample if s.startswith("xb")]
    assert len(xb) == round(200 * 40 / 440) and all(int(s.split()[1]) < 40 for s in xb)


def test_a_multiway_folder_is_sampled_uniformly_per_language(tmp_path, monkeypatch):
    """Its languages have one line count, so each gets a quarter, whatever the temperature; read in one pass."""
    monkeypatch.setattr(sources, "READ_BYTES", 64)
    files = _marked(tmp_path, {lang: 300 for lang in LANGS})
    config = multilingual_config(tmp_path)
    config.tokenizer_sample_sentences = 100
    config.temperature = 1.0
    sample = tokenizer_lib.training_sample(config)
    assert sorted({s.split()[0] for s in sample}) == list(LANGS)
    assert [sum(s.split()[0] == lang for s in sample) for lang in LANGS] == [25] * 4
    assert sample == tokenizer_lib.language_sample(files, 100, 5.0)
    (tmp_path / "train.fr").write_text("fr 0\n", encoding="utf-8")
    with pytest.raises(DataError, match="line counts differ"):
        tokenizer_lib.training_sample(config)


def test_model_tokenizer_of_a_full_config_agrees_with_its_placement(tmp_path):
    """The run's entry point: the ids batching places (Placement.of the full config) are the tokenizer's."""
    config = common.base_config("tiny")
    config.data = multilingual_config(write_multiway(tmp_path / "data"))
    config.model.vocab_size = VOCAB_SIZE
    config.model.lang_token = "source_and_target"
    tok = tokenizer_lib.model_tokenizer(config, tmp_path / "run")
    assert tok.pieces == VOCAB_SIZE - len(LANGS) and tok.vocab_size == config.model.vocab_size
    placement = languages.Placement.of(config)
    assert {lang: tok.language_id(lang) for lang in LANGS} == placement.ids


def test_the_marian_export_gives_a_source_models_language_token_its_id(run, tok, tmp_path):
    """A `source` model's sources start with the target's id; the exported vocabulary names that id >>xx<<, so
    transformers' MarianTokenizer turns `>>de<<text` into the ids our batches hold (data.target_lang's way)."""
    import json
    import shutil

    from tests.helpers.marian_reference import run as reference
    from transformer_jax.interop import marian_folder

    config, workdir = run
    full = ml_collections.ConfigDict({"data": config.to_dict(), "model": {"vocab_size": VOCAB_SIZE}})
    files = marian_folder.tokenizer_files(full, workdir, tok)
    out = tmp_path / "export"
    out.mkdir()
    for name, content in files.items():
        if isinstance(content, bytes):
            (out / name).write_bytes(content)
        else:
            shutil.copy(content, out / name)
    special = {"unk_token": "<unk>", "eos_token": "</s>", "pad_token": "<pad>"}
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "MarianTokenizer", **special}))
    sentences = ["A dog runs on the beach.", "Two men."]
    # The code written without a space after it: MarianTokenizer removes the code only, and a space left in front
    # of the text would become one more piece, which our ids (the language id, then the text's) do not hold.
    (tmp_path / "s.json").write_text(json.dumps([f">>de<<{s}" for s in sentences]))
    reference("tokenize", str(out), str(tmp_path / "s.json"), str(tmp_path / "ids.json"))
    theirs = json.loads((tmp_path / "ids.json").read_text())
    assert theirs == [[tok.language_id("de"), *tok.encode_source(s), tok.ids.eos] for s in sentences]
