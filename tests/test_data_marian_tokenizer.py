"""data.tokenizer="marian": a converted Marian model's source.spm, target.spm, vocab.json (and target_vocab.json)
give the ids transformers' MarianTokenizer gives, through the data path, the store's key and >>xx<< tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from configs import common
from tests.helpers import DATA
from transformer_jax.config.schema import base_config
from transformer_jax.data import batching, store
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.model import TransformerSpec
from transformer_jax.model.layers import SpecialIds

transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")

SPECIALS = ("</s>", "<unk>", "<s>")  # SentencePiece's own control pieces, not vocabulary entries of Marian's


def _lines(lang: str, split: str, n: int) -> list[str]:
    path = DATA / "multi30k" / f"{split}.{lang}"
    if not path.exists():
        pytest.skip(f"shared corpora not found at {DATA} (set TRANSFORMER_JAX_DATA)")
    return path.read_text(encoding="utf-8").split("\n")[:n]


def _train_spm(lines: list[str], prefix: Path) -> Path:
    """A small SentencePiece model with SentencePiece's (and Marian's) defaults: unk 0, bos 1, eos 2."""
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=400, minloglevel=2
    )
    return prefix.with_suffix(".model")


def _pieces(model: Path) -> list[str]:
    sp = spm.SentencePieceProcessor(model_file=str(model))
    return [p for p in (sp.id_to_piece(i) for i in range(sp.get_piece_size())) if p not in SPECIALS]


def _vocab(*piece_lists: list[str], extra: tuple[str, ...] = ()) -> dict[str, int]:
    """Marian's layout: </s> 0, <unk> 1, the pieces, <pad> last."""
    vocab = {"</s>": 0, "<unk>": 1}
    for piece in (*extra, *(p for pieces in piece_lists for p in pieces)):
        vocab.setdefault(piece, len(vocab))
    vocab["<pad>"] = len(vocab)
    return vocab


def _ids(vocab: dict[str, int]) -> SpecialIds:
    return SpecialIds(pad=vocab["<pad>"], eos=0, bos=vocab["<pad>"], unk=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    directory = tmp_path_factory.mktemp("spm")
    return (
        _train_spm(_lines("en", "train", 400), directory / "source"),
        _train_spm(_lines("de", "train", 400), directory / "target"),
    )


def _workdir(tmp_path: Path, models: tuple[Path, Path], separate: bool, extra: tuple[str, ...] = ()) -> Path:
    source, target = models
    shutil.copyfile(source, tmp_path / tokenizer_lib.MARIAN_SOURCE_SPM)
    shutil.copyfile(target, tmp_path / tokenizer_lib.MARIAN_TARGET_SPM)
    if separate:
        vocabs = {tokenizer_lib.MARIAN_VOCAB: _vocab(_pieces(source), extra=extra)}
        vocabs[tokenizer_lib.MARIAN_TARGET_VOCAB] = _vocab(_pieces(target))
    else:
        vocabs = {tokenizer_lib.MARIAN_VOCAB: _vocab(_pieces(source), _pieces(target), extra=extra)}
    for name, vocab in vocabs.items():
        (tmp_path / name).write_text(json.dumps(vocab), encoding="utf-8")
    return tmp_path


def _theirs(workdir: Path, separate: bool):
    """transformers' MarianTokenizer on the same files, built offline."""
    target_vocab = workdir / tokenizer_lib.MARIAN_TARGET_VOCAB
    return transformers.MarianTokenizer(
        source_spm=str(workdir / tokenizer_lib.MARIAN_SOURCE_SPM),
        target_spm=str(workdir / tokenizer_lib.MARIAN_TARGET_SPM),
        vocab=str(workdir / tokenizer_lib.MARIAN_VOCAB),
        target_vocab_file=str(target_vocab) if separate else None,
        separate_vocabs=separate,
    )


def _ours(workdir: Path, target_lang: str = "") -> tokenizer_lib.MarianTokenizer:
    vocab = json.loads((workdir / tokenizer_lib.MARIAN_VOCAB).read_text())
    target = workdir / tokenizer_lib.MARIAN_TARGET_VOCAB
    target_vocab = json.loads(target.read_text()) if target.exists() else vocab
    config = common.data_config()
    config.tokenizer, config.target_lang = "marian", target_lang
    return tokenizer_lib.get_tokenizer(
        config, workdir, vocab_size=len(target_vocab), ids=_ids(vocab), source_vocab_size=len(vocab)
    )


@pytest.mark.parametrize("separate", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["shared", "separate"])
def test_the_same_ids_and_text_as_transformers_marian_tokenizer(tmp_path, models, separate):
    workdir = _workdir(tmp_path, models, separate)
    ours, theirs = _ours(workdir), _theirs(workdir, separate)
    # Unseen sentences (valid split), with characters the small models do not hold: pieces missing from the map.
    sources, targets = _lines("en", "valid", 200), _lines("de", "valid", 200)
    sources += ["Ein Mädchen — «ÿ» ☃ über 3½ Brücken.", ""]
    targets += ["A girl — «ÿ» ☃ over 3½ bridges.", ""]
    eos = ours.ids.eos
    assert [x + [eos] for x in ours.encode_source_batch(sources)] == theirs(sources)["input_ids"]
    assert [ours.encode_source(s) + [eos] for s in sources[:5]] == theirs(sources[:5])["input_ids"]
    want = theirs(text_target=targets)["input_ids"]
    assert [x + [eos] for x in ours.encode_target_batch(targets)] == want
    assert any(ours.ids.unk in x for x in want)  # the map's unknown pieces were met
    for ids in want:
        assert ours.decode_target(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert (ours.vocab_size, ours.source_vocab_size) == (
        len(theirs.target_encoder if separate else theirs.encoder),
        len(theirs.encoder),
    )


def test_a_language_token_is_one_id_at_the_start_of_every_source(tmp_path, models):
    workdir = _workdir(tmp_path, models, separate=False, extra=(">>fra<<", ">>deu<<"))
    theirs = _theirs(workdir, separate=False)
    ours = _ours(workdir, target_lang="fra")
    vocab = json.loads((workdir / tokenizer_lib.MARIAN_VOCAB).read_text())
    sentences = _lines("en", "valid", 20)
    encoded = ours.encode_source_batch(sentences)
    assert all(x[0] == vocab[">>fra<<"] and vocab[">>fra<<"] not in x[1:] for x in encoded)
    assert [x + [0] for x in encoded] == theirs([f">>fra<< {s}" for s in sentences])["input_ids"]
    # A code written in the text is read as MarianTokenizer reads it.
    assert _ours(workdir).encode_source(">>deu<< A dog.") == theirs(">>deu<< A dog.")["input_ids"][:-1]
    assert ours.encode_target(sentences[0]) == _ours(workdir).encode_target(sentences[0])  # targets: no token
    with pytest.raises(DataError, match=r"data.target_lang='ita'.* has no token >>ita<<"):
        _ours(workdir, target_lang="ita")


def test_the_store_key_follows_the_tokenizer_files_and_the_language(tmp_path, models):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    shared = _ours(_workdir(tmp_path / "a", models, separate=False, extra=(">>fra<<",)))
    separate = _ours(_workdir(tmp_path / "b", models, separate=True))
    french = _ours(tmp_path / "a", target_lang="fra")
    keys = {t.fingerprint() for t in (shared, separate, french)}
    assert len(keys) == 3 and shared.fingerprint() == _ours(tmp_path / "a").fingerprint()
    config = common.data_config()
    assert store.store_path(config, shared).name.startswith("marian.")


def test_batches_of_a_marian_vocabulary_use_its_ids(tmp_path, models):
    workdir = _workdir(tmp_path, models, separate=True)
    ours = _ours(workdir)
    pairs = list(zip(_lines("en", "valid", 16), _lines("de", "valid", 16), strict=True))
    examples = batching.tokenize_pairs(pairs, ours)
    batch = batching.assemble(examples, batching.one_per_row(np.arange(16), (16, 256, 256)), ours.ids)
    real = batch["tgt_segment_ids"] > 0
    assert np.all(batch["tgt_in"][:, 0] == ours.ids.bos) and np.all(batch["tgt_in"][~real] == ours.ids.pad)
    theirs = _theirs(workdir, separate=True)
    first = batch["src_tokens"][0][batch["src_segment_ids"][0] > 0].tolist()
    assert first == theirs(pairs[0][0])["input_ids"]
    assert batch["tgt_out"][0][real[0]].tolist() == theirs(text_target=pairs[0][1])["input_ids"]


def test_bad_marian_files_are_one_line_naming_the_file(tmp_path, models):
    workdir = _workdir(tmp_path, models, separate=False)
    vocab = json.loads((workdir / tokenizer_lib.MARIAN_VOCAB).read_text())
    config = common.data_config()
    config.tokenizer = "marian"
    with pytest.raises(DataError, match=r"vocab.json has <pad> at id .* but model.pad_id is 3"):
        tokenizer_lib.get_tokenizer(config, workdir, vocab_size=len(vocab), ids=SpecialIds(3, 0, 3, 1))
    with pytest.raises(DataError, match=rf"vocab.json holds {len(vocab)} target pieces but model.vocab_size is 9"):
        tokenizer_lib.get_tokenizer(config, workdir, vocab_size=9, ids=_ids(vocab))
    (workdir / tokenizer_lib.MARIAN_TARGET_SPM).unlink()
    with pytest.raises(DataError, match="needs target.spm in .*--from_marian"):
        tokenizer_lib.get_tokenizer(config, workdir, vocab_size=len(vocab), ids=_ids(vocab))


def test_a_separate_source_vocabulary_has_its_own_encoder_rows():
    config = base_config("tiny")
    config.model.update(vocab_size=50, source_vocab_size=70, share_embeddings=False)
    from flax import nnx

    from transformer_jax.model import Transformer

    model = Transformer(TransformerSpec.from_config(config), rngs=nnx.Rngs(0))
    assert model.src_embed.table_VD.shape[0] == 70 and model.tgt_embed.table_VD.shape[0] == 50
    config.model.share_embeddings = True
    with pytest.raises(ConfigError, match="model.source_vocab_size: 70 source rows .*share_embeddings=False"):
        TransformerSpec.from_config(config)


def test_evaluate_target_lang_overrides_the_configs_for_the_tokenizer(tmp_path, monkeypatch):
    """--target_lang reaches the tokenizer as data.target_lang (the saved config keeps its own)."""
    from tests.helpers.decoding import CharTokenizer, one_checkpoint
    from transformer_jax.evaluation import run
    from transformer_jax.evaluation.command import evaluate
    from transformer_jax.training import checkpoints

    seen = []

    def tokenizer(config, workdir):
        seen.append(config.data.target_lang)
        return CharTokenizer()  # the workdir's has no >>fra<< piece

    monkeypatch.setattr(run, "workdir_tokenizer", tokenizer)
    workdir = one_checkpoint(tmp_path / "w")
    src = tmp_path / "src.txt"
    src.write_text("a b\n", encoding="utf-8")
    options = dict(workdir=str(workdir), source_file=str(src), output_file=str(tmp_path / "hyp.txt"))
    evaluate(dict(options, target_lang="fra"))
    evaluate(options)
    assert seen == ["fra", ""] and checkpoints.load_config(workdir).data.target_lang == ""


def test_a_fine_tuning_run_copies_a_marian_sources_tokenizer_files(tmp_path, models):
    from transformer_jax.training import init_from

    (tmp_path / "source").mkdir()
    source = _workdir(tmp_path / "source", models, separate=True)
    config = base_config("tiny")
    config.data.tokenizer = "marian"
    names = [f.name for f in tokenizer_lib.tokenizer_files(config.data, source)]
    assert names == ["source.spm", "target.spm", "vocab.json", "target_vocab.json"]
    run = tmp_path / "run"
    init_from._copy_tokenizer(source, config, run, config)
    assert all((run / name).read_bytes() == (source / name).read_bytes() for name in names)
    assert _ours(run).fingerprint() == _ours(source).fingerprint()
    (run / "vocab.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ConfigError, match="holds a tokenizer .*vocab.json.* other than the source's"):
        init_from._copy_tokenizer(source, config, run, config)
