"""data.tokenizer="fairseq": a converted NLLB-200 or M2M-100 model's tokenizer (interop/m2m100_vocab.py reads the
Hugging Face folder, writes the workdir's sentencepiece.bpe.model and vocab.json) gives the ids of transformers'
NllbTokenizer and M2M100Tokenizer on the Multi30k test files, their codes' ids, their decoding, and the sources
`[src_code] X </s>` the batches build. The oracles are built offline from a small SentencePiece BPE model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import sentencepiece as spm

from tests.helpers import DATA
from transformer_jax import cli
from transformer_jax.data import languages
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.data.languages import Direction
from transformer_jax.data.pipeline import eval_batches
from transformer_jax.errors import DataError, EvalError
from transformer_jax.interop import m2m100_vocab
from transformer_jax.model.layers import SpecialIds

transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")
pytest.importorskip("google.protobuf", reason="without protobuf NllbTokenizer turns every piece into <unk>")

LANGS = ("en", "de", "fr", "cs")
IDS = SpecialIds(pad=1, eos=2, bos=2, unk=3)  # fairseq's dictionary; the decoder starts from </s>
CONFIG = {"model_type": "m2m_100", "bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2}
SURPLUS = 2  # embedding rows past the vocabulary, as NLLB-200's 256,206 rows for 256,204 ids


def _lines(split: str, lang: str) -> list[str]:
    path = DATA / "multi30k" / f"{split}.{lang}"
    if not path.is_file():
        pytest.skip(f"shared corpora not found at {DATA} (set TRANSFORMER_JAX_DATA)")
    return path.read_text(encoding="utf-8").split("\n")[:-1]


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> Path:
    """A BPE model with fairseq's SentencePiece specials (unk 0, bos 1, eos 2, no pad) on Multi30k's four languages."""
    lines = [line for lang in LANGS for line in _lines("train", lang)[:1000]]
    prefix = tmp_path_factory.mktemp("spm") / "fairseq"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(prefix),
        vocab_size=1000,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return prefix.with_suffix(".model")


def _nllb(spm_model: Path, folder: Path, **config) -> tuple[Path, object]:
    """An NLLB-200 folder as save_pretrained writes it (tokenizer.json), with its SentencePiece model, config.json."""
    source = folder / "source"
    source.mkdir(parents=True)
    shutil.copyfile(spm_model, source / m2m100_vocab.FAIRSEQ_SPM)
    codes = list(transformers.models.nllb.tokenization_nllb.FAIRSEQ_LANGUAGE_CODES)
    tokenizer_config = {"tokenizer_class": "NllbTokenizer", "additional_special_tokens": codes, **config}
    (source / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    oracle = transformers.NllbTokenizer.from_pretrained(str(source))
    saved = folder / "nllb"
    oracle.save_pretrained(str(saved))
    shutil.copyfile(spm_model, saved / m2m100_vocab.FAIRSEQ_SPM)
    (saved / "config.json").write_text(json.dumps(CONFIG))
    return saved, oracle


def _m2m100(spm_model: Path, folder: Path) -> tuple[Path, object]:
    """An M2M-100 folder: vocab.json of fairseq's specials and the SentencePiece pieces (ids shifted by one)."""
    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({sp.id_to_piece(i): i + 1 for i in range(3, sp.get_piece_size())})
    folder.mkdir(parents=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    oracle = transformers.M2M100Tokenizer(str(folder / "vocab.json"), str(spm_model))
    saved = folder / "m2m100"
    oracle.save_pretrained(str(saved))
    (saved / "config.json").write_text(json.dumps(CONFIG))
    return saved, oracle


def _ours(folder: Path, workdir: Path) -> tuple[tokenizer_lib.FairseqTokenizer, m2m100_vocab.Vocabulary]:
    vocab = m2m100_vocab.read_vocabulary(folder)
    workdir.mkdir()
    m2m100_vocab.write_vocabulary(vocab, workdir)
    table = languages.Placement("source_and_target", vocab.codes)
    return tokenizer_lib.FairseqTokenizer(workdir, IDS, len(vocab.pieces) + SURPLUS, table), vocab


@pytest.fixture(scope="module", params=["nllb", "m2m100"])
def family(request, spm_model, tmp_path_factory):
    """(name, oracle, our tokenizer, our vocabulary) of one family."""
    tmp = tmp_path_factory.mktemp(request.param)
    folder, oracle = (_nllb if request.param == "nllb" else _m2m100)(spm_model, tmp / "hf")
    return request.param, oracle, *_ours(folder, tmp / "workdir")


def test_the_ids_are_the_oracles_on_every_test_line(family):
    """NllbTokenizer differs on a line ending in a space only: it keeps a trailing `▁`, where SentencePiece (fairseq,
    M2M100Tokenizer and ours) drops it (FairseqTokenizer's docstring)."""
    name, oracle, ours, vocab = family
    assert (
        ours.encode_source("A man in a blue shirt.")
        == oracle("A man in a blue shirt.", add_special_tokens=False)["input_ids"]
    )
    assert IDS.unk not in ours.encode_source("A man in a blue shirt.")  # protobuf: pieces are not all <unk>
    trailing = 0
    for lang in LANGS:
        lines = _lines("test", lang)
        theirs = oracle(lines, add_special_tokens=False)["input_ids"]
        for line, mine, their in zip(lines, ours.encode_source_batch(lines), theirs, strict=True):
            if name == "nllb" and line != line.rstrip(" "):
                trailing += 1
                assert their == [*mine, vocab.pieces["▁"]], line  # one more piece: `▁`
                assert mine == ours.encode_source(line.rstrip(" ")) == oracle(line.rstrip(" "))["input_ids"][1:-1]
            else:
                assert mine == their, line
        assert ours.encode_target_batch(lines) == ours.encode_source_batch(lines)
    assert trailing == (1 if name == "nllb" else 0)  # 3,999 of 4,000 lines agree with NllbTokenizer


def test_the_codes_are_the_oracles_and_text_never_encodes_to_one(family):
    name, oracle, ours, vocab = family
    assert vocab.codes and all(oracle.convert_tokens_to_ids(code) == i for code, i in vocab.codes.items())
    assert set(vocab.codes) <= set(ours.target_pieces(range(ours.vocab_size)))
    for special in ("<s>", "<pad>", "</s>", "<unk>"):
        assert vocab.pieces[special] == oracle.convert_tokens_to_ids(special)
    code = next(iter(vocab.codes))
    assert vocab.codes[code] not in ours.encode_source(f"The code {code} is text </s> <pad>.")
    assert ours.target_pieces([ours.vocab_size - 1]) == [tokenizer_lib.SURPLUS_PIECE.format(ours.vocab_size - 1)]
    assert vocab.legacy_behaviour is False
    codes = languages.NLLB_CODES if name == "nllb" else [f"__{c}__" for c in languages.M2M100_CODES["m2m100"]]
    assert list(vocab.codes) == list(codes)  # in id order


def test_decoding_is_the_oracles(family):
    """decode(ids, skip_special_tokens=True): M2M100Tokenizer's exactly; NllbTokenizer's but for the outer spaces it
    keeps where a line starts with a lone `▁` before an unknown piece (FairseqTokenizer's docstring)."""
    name, oracle, ours, vocab = family
    for lang in LANGS:
        for line_ids in ours.encode_source_batch(_lines("test", lang)):
            theirs = oracle.decode(line_ids, skip_special_tokens=True)
            assert ours.decode_target(line_ids) == (theirs.strip() if name == "nllb" else theirs)
    code = next(iter(vocab.codes))
    sentence = ours.encode_source("Two dogs play in the snow.")
    madeup = [i for piece, i in vocab.pieces.items() if piece.startswith("madeupword")][:1]
    noise = [IDS.eos, vocab.codes[code], *sentence, *madeup, ours.vocab_size - 1, vocab.pieces["<s>"], IDS.pad]
    assert ours.decode_target(noise + [IDS.eos, *sentence]) == "Two dogs play in the snow."  # up to the first eos


def test_the_sources_and_targets_are_the_oracles_with_their_special_tokens(family):
    """NLLB's `[src_code] X </s>` (labels `[tgt_code] Y </s>`) and M2M-100's `__en__ X </s>` are what the
    batches build from our Placement: source_prefix, the ids, eos (target_prefix before the target's ids)."""
    name, oracle, ours, vocab = family
    src, tgt = ("eng_Latn", "ces_Latn") if name == "nllb" else ("en", "cs")
    oracle.src_lang, oracle.tgt_lang = src, tgt
    english, czech = _lines("test", "en")[:8], _lines("test", "cs")[:8]
    theirs = oracle(english, text_target=czech)
    table = ours.language_table
    direction = Direction("en", "cs")  # the folder's suffixes
    batches, _ = eval_batches(
        english,
        ours,
        8,
        64,
        targets=czech,
        source_prefix=table.source_prefix(direction),
        target_prefix=table.target_prefix(direction),
    )
    batch = next(batches)
    for row, (source, labels) in enumerate(zip(theirs["input_ids"], theirs["labels"], strict=True)):
        assert [int(i) for i in batch["src_tokens"][row][: len(source)]] == source
        assert [int(i) for i in batch["tgt_out"][row][: len(labels)]] == labels
    assert table.code_of("en") == (src if name == "nllb" else "__en__")


def test_the_workdir_tokenizer_is_built_from_the_config(family, tmp_path):
    """model_tokenizer of a converted model's config: the files, the fingerprint and the files a fine-tuning copies."""
    from configs import common

    _, _, ours, vocab = family
    config = common.base_config("tiny")
    config.data.tokenizer = "fairseq"
    config.model.vocab_size = ours.vocab_size
    config.model.lang_token = "source_and_target"
    config.model.language_codes = tuple(vocab.codes.items())
    config.model.pad_id, config.model.eos_id, config.model.bos_id, config.model.unk_id = IDS.pad, IDS.eos, 2, IDS.unk
    built = tokenizer_lib.model_tokenizer(config, ours.directory)
    assert isinstance(built, tokenizer_lib.FairseqTokenizer) and built.fingerprint() == ours.fingerprint()
    assert built.language_table.ids == vocab.codes and built.language_id("en") == ours.language_table.id("en")
    assert tokenizer_lib.tokenizer_files(config.data, ours.directory) == list(built.files)
    with pytest.raises(DataError, match="needs sentencepiece.bpe.model, vocab.json in"):
        tokenizer_lib.model_tokenizer(config, tmp_path)
    config.model.language_codes = ()
    with pytest.raises(DataError, match="come together"):
        tokenizer_lib.model_tokenizer(config, ours.directory)


def test_legacy_behaviour_is_reported(spm_model, tmp_path):
    folder, _ = _nllb(spm_model, tmp_path, legacy_behaviour=True)
    assert m2m100_vocab.read_vocabulary(folder).legacy_behaviour is True


def test_a_folder_whose_files_disagree_is_refused_naming_the_file(spm_model, tmp_path):
    folder, _ = _nllb(spm_model, tmp_path / "a")
    tokenizer_json = json.loads((folder / "tokenizer.json").read_text())
    tokenizer_json["added_tokens"][-1]["id"] = 7  # a code on a piece's id
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    with pytest.raises(DataError, match=r"tokenizer.json: id 7 is both .* and 'zul_Latn'"):
        m2m100_vocab.read_vocabulary(folder)
    folder, _ = _m2m100(spm_model, tmp_path / "b")
    (folder / "config.json").write_text(json.dumps({**CONFIG, "pad_token_id": 0}))
    with pytest.raises(DataError, match=r"vocab.json gives <pad> id 1 but .*config.json pad_token_id is 0"):
        m2m100_vocab.read_vocabulary(folder)
    (folder / "vocab.json").unlink()
    with pytest.raises(DataError, match=r"vocab.json is missing"):
        m2m100_vocab.read_vocabulary(folder)
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(DataError, match=r"has neither tokenizer.json \(NLLB-200\) nor vocab.json \(M2M-100\)"):
        m2m100_vocab.read_vocabulary(folder)


@pytest.fixture(scope="module")
def converted(spm_model, tmp_path_factory) -> tuple[Path, Path, dict[str, int]]:
    """(workdir, folder, codes): a workdir as an NLLB-200 import writes it (random parameters, the fairseq tokenizer
    and code table, no data.directions) and a multi-way folder of a few Multi30k test lines, Italian too."""
    from tests.helpers.fakes import base_params, tiny_config, write_workdir

    tmp = tmp_path_factory.mktemp("converted")
    vocab = m2m100_vocab.read_vocabulary(_nllb(spm_model, tmp / "hf")[0])
    config = tiny_config(
        vocab_size=len(vocab.pieces) + SURPLUS,
        lang_token="source_and_target",
        language_codes=tuple(vocab.codes.items()),
        pad_id=IDS.pad,
        eos_id=IDS.eos,
        bos_id=IDS.bos,
        unk_id=IDS.unk,
    )
    config.data.tokenizer = "fairseq"
    config.eval.average_last = 1
    workdir = write_workdir(tmp / "workdir", config, {0: base_params(config)})
    m2m100_vocab.write_vocabulary(vocab, workdir)
    folder = tmp / "data"
    folder.mkdir()
    for lang in ("en", "de", "cs", "zh"):
        lines = _lines("test", "en" if lang == "zh" else lang)[:3]
        (folder / f"test.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return workdir, folder, vocab.codes


def test_a_converted_model_translates_between_languages_named_any_way(converted):
    """Both languages are required (transformers would assume English); each may be named by its suffix, its ISO
    639-3 name or its code, and places the model's codes."""
    from transformer_jax.evaluation import run
    from transformer_jax.evaluation.command import evaluate
    from transformer_jax.evaluation.restore import saved_config
    from transformer_jax.evaluation.translate import LanguageIds

    workdir, folder, codes = converted
    config = saved_config(str(workdir))
    placement = languages.Placement.of(config)
    for src, tgt in (("en", "cs"), ("eng", "ces_Latn"), (">>en<<", "__cs__")):
        direction = run.direction_of(config, run.Model(str(workdir), target_lang=tgt, source_lang=src), given_file=True)
        assert LanguageIds.of(placement, direction) == (codes["eng_Latn"], codes["ces_Latn"])
    source = str(folder / "test.en")
    with pytest.raises(EvalError, match=r"holds a converted model, .*give --source_lang \(converted models require"):
        evaluate(dict(workdir=str(workdir), source_file=source, target_lang="cs"))
    with pytest.raises(EvalError, match=r"--target_lang zh: language 'zh' is more than one .*\['zho_Hans', 'zho_Ha"):
        evaluate(dict(workdir=str(workdir), source_file=source, source_lang="en", target_lang="zh"))
    with pytest.raises(EvalError, match=r"--source_lang and --target_lang are both eng_Latn"):
        evaluate(dict(workdir=str(workdir), source_file=source, source_lang="en", target_lang="eng"))
    report = evaluate(dict(workdir=str(workdir), source_file=source, source_lang="en", target_lang="cs", beam_size=1))
    assert report["lines"] == 3 and report["source"] == "test.en.en-cs"
    report = evaluate(
        dict(workdir=str(workdir), split="test", text_dir=str(folder), source_lang="en", target_lang="de")
    )
    assert report["source"] == "test(test.en-de)"


def test_the_language_matrix_of_a_converted_model_is_all_zero_shot(converted, tmp_path):
    """The folder's suffixes name the files and directions; a suffix the model cannot resolve (zh: two codes) is
    skipped; no direction is supervised."""
    from transformer_jax.evaluation import command

    workdir, folder, _ = converted
    values = {"workdir": str(workdir), "directions": ["all"], "text_dir": str(folder), "output_dir": str(tmp_path)}
    report = command.evaluate({**values, "beam_size": 1, "max_len": 6}, progress=False)
    assert set(report) == {f"{s}-{t}" for s in ("cs", "de", "en") for t in ("cs", "de", "en") if s != t}
    assert not any(r["supervised"] for r in report.values())
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["skipped_languages"] == ["zh"] and meta["model_languages"] == ["cs", "de", "en"]


def test_fine_tuning_a_converted_model_on_directions_places_its_codes(converted, tmp_path):
    """data.directions=en-cs on a converted model: the batches' language ids are the codes of en and cs (nothing is
    appended to the vocabulary), the sides tokenized by the fairseq tokenizer."""
    from transformer_jax.data.pipeline import multilingual_examples
    from transformer_jax.evaluation.restore import saved_config

    workdir, folder, codes = converted
    config = saved_config(str(workdir)).copy_and_resolve_references()
    config.data.update(directions=("en-cs", "cs-en"), text_dir=str(folder), train_split="test", store_dir=str(tmp_path))
    cli.validate(config)
    tokenizer = tokenizer_lib.model_tokenizer(config, workdir)
    examples = multilingual_examples(config, tokenizer, build_if_missing=True, num_threads=1)
    assert examples.names == ["en-cs", "cs-en"]
    assert examples.src_prefix == [codes["eng_Latn"], codes["ces_Latn"]]
    assert examples.tgt_prefix == [codes["ces_Latn"], codes["eng_Latn"]]
    first = examples.parts[0]
    english = _lines("test", "en")[0]
    assert list(first.src[first.src_starts[0] : first.src_starts[1]]) == [*tokenizer.encode_source(english), IDS.eos]
    assert tokenizer.pieces == 1000 - 3  # what text encodes to: the SentencePiece pieces but unk, <s>, </s>
