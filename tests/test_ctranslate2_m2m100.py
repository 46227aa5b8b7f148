"""CTranslate2 for converted M2M-100 and NLLB-200 workdirs (data.tokenizer=fairseq): our export translates as
evaluate.py does, CTranslate2's own converter (the oracle) gives the same greedy tokens as our export, and
translate_corpus --engine ctranslate2 writes a jax greedy run's outputs.

The folders are random-weight models built offline by transformers in a process of its own, which also runs
CTranslate2's converter on them (tests/helpers/m2m100_reference.py make_ct2): torch never enters this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import REPO, m2m100_reference
from tests.helpers.training import tiny_train_config, untrained_workdir, write_corpus
from transformer_jax.data import languages
from transformer_jax.errors import EvalError
from transformer_jax.evaluation.command import evaluate
from transformer_jax.evaluation.restore import LATEST, CheckpointChoice, restore_model
from transformer_jax.evaluation.run import Decoding, decoding_settings
from transformer_jax.evaluation.translate import LanguageIds, language_tokens, position_limit
from transformer_jax.interop import m2m100_folder, marian_folder
from transformer_jax.training import loop
from transformer_jax.translate_corpus import run
from transformer_jax.translate_corpus.run import job_of, translate_corpus

ctranslate2 = pytest.importorskip("ctranslate2", reason="ctranslate2 is not installed (pip install ctranslate2==4.8.5)")
from transformer_jax.interop import ctranslate2 as export_lib  # noqa: E402 - needs the engine, checked above

SENTENCES = [
    "A man in a blue shirt is standing on a ladder.",
    "Two young children are playing in the sand.",
    "",
    "The dog runs across the green field.",
    "Several people are waiting at the bus stop.",
    "A woman with a red hat is reading a book in the park while her dog sleeps.",
    "Men.",
]
FAMILIES = ["nllb", pytest.param("m2m100", marks=pytest.mark.slow)]
EN_DE = languages.Direction("en", "de")


class Converted:
    """A family's Hugging Face folder (conftest's nllb_dir or m2m_dir), CTranslate2's conversion of it (built with it),
    our workdir of it and our export."""

    def __init__(self, folder: Path, root: Path):
        self.folder, self.oracle = folder, m2m100_reference.ct2_oracle(folder)
        self.workdir, self.export = root / "workdir", root / "ct2"
        marian_folder.write_workdir(m2m100_folder.read_folder(self.folder), self.workdir)
        self.report = export_lib.export_workdir(str(self.workdir), self.export)


@pytest.fixture(scope="module")
def converted(request, tmp_path_factory):
    made: dict[str, Converted] = {}

    def get(family: str) -> Converted:
        if family not in made:  # the session folder asked for when first used: the m2m100 cases are slow
            folder = request.getfixturevalue("nllb_dir" if family == "nllb" else "m2m_dir")
            made[family] = Converted(folder, tmp_path_factory.mktemp(family))
        return made[family]

    return get


def translator(path: Path):
    return ctranslate2.Translator(str(path), device="cpu", intra_threads=1)


def assert_export_translates_as_evaluate(workdir: Path, export: Path, tmp_path: Path) -> None:
    """evaluate.py --source_lang en --target_lang de --beam_size 1 on the workdir, and ctranslate2_translate of the
    export with the direction's language ids (sources `[src_code] X </s>`, target_prefix `[tgt_code]`, the codes
    suppressed), with the tokenizer the export ships: the same lines, the same statistics."""
    (tmp_path / "in.txt").write_text("".join(s + "\n" for s in SENTENCES), encoding="utf-8")
    flags = dict(workdir=str(workdir), beam_size=1, source_file=str(tmp_path / "in.txt"), average_last=1)
    flags.update(source_lang="en", target_lang="de", output_file=str(tmp_path / "ours.txt"))
    report = evaluate(flags)
    ours = (tmp_path / "ours.txt").read_text(encoding="utf-8").splitlines()
    config, model, _ = restore_model(str(workdir), CheckpointChoice(average_last=1))
    tokenizer = export_lib.exported_tokenizer(export)
    ids = LanguageIds.of(tokenizer.language_table, EN_DE)
    assert ids == (tokenizer.language_id("en"), tokenizer.language_id("de"))
    theirs, stats = export_lib.ctranslate2_translate(
        translator(export),
        tokenizer,
        SENTENCES,
        decoding_settings(Decoding(beam_size=1), config),
        position_limit=position_limit(model.spec),
        language_ids=ids,
    )
    assert theirs == ours and len(ours) == len(SENTENCES)
    assert sum(bool(line) for line in ours) >= len(SENTENCES) - 2, ours  # the random model writes something
    for key in ("empty", "truncated", "hit_max_len", "src_tokens", "tgt_tokens"):
        assert stats[key] == report["stats"][key], key


@pytest.mark.slow  # a fast representative: translate_corpus --engine ctranslate2 writes the jax run's lines
@pytest.mark.parametrize("family", ["nllb", "m2m100"])
def test_the_export_translates_as_evaluate_greedy_does(family, converted, tmp_path):
    c = converted(family)
    assert_export_translates_as_evaluate(c.workdir, c.export, tmp_path)


@pytest.mark.slow
def test_a_model_fine_tuned_from_a_converted_one_exports_and_translates_as_evaluate_does(converted, tmp_path):
    """train.init_from the converted NLLB workdir, 2 steps on en-de: its workdir (the tokenizer files copied, the
    code table among the architecture keys) exports as a converted one does."""
    data = write_corpus(tmp_path / "data", n_train=60, n_valid=8)
    config = tiny_train_config(data, eval_every=0, init_from=str(converted("nllb").workdir), num_steps=2)
    config.data.directions, config.ckpt.every_steps = ("en-de",), 2
    loop.train_and_evaluate(config, tmp_path / "run")
    report = export_lib.export_workdir(str(tmp_path / "run"), tmp_path / "ct2", choice=CheckpointChoice(average_last=1))
    assert report["checkpoint_steps"] == [2]
    assert_export_translates_as_evaluate(tmp_path / "run", tmp_path / "ct2", tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_ctranslate2s_own_converter_gives_the_exports_greedy_tokens(family, converted):
    """The oracle (CTranslate2's converter on the Hugging Face folder) and our export, given the same token ids (the
    source `[eng code] X </s>`, target_prefix the deu code, every code suppressed, as ctranslate2_translate does),
    emit the same greedy tokens."""
    c = converted(family)
    tokenizer = export_lib.exported_tokenizer(c.export)
    src, tgt = tokenizer.language_id("en"), tokenizer.language_id("de")
    sources = [[src, *tokenizer.encode_source(s), tokenizer.ids.eos] for s in SENTENCES if s]
    codes = language_tokens(tokenizer)

    def greedy(path: Path, with_eos: bool) -> list[list[int]]:
        pieces = json.loads((path / "shared_vocabulary.json").read_text(encoding="utf-8"))
        index = {piece: i for i, piece in enumerate(pieces)}
        results = translator(path).translate_batch(
            [[pieces[i] for i in (ids if with_eos else ids[:-1])] for ids in sources],
            beam_size=1,
            max_decoding_length=24,
            min_decoding_length=0,
            max_input_length=0,
            target_prefix=[[pieces[tgt]]] * len(sources),
            suppress_sequences=[[pieces[i]] for i in codes],
            return_end_token=True,
        )
        return [[index[p] for p in r.hypotheses[0]] for r in results]

    ours = greedy(c.export, with_eos=False)  # our export adds </s> itself (add_source_eos)
    assert greedy(c.oracle, with_eos=True) == ours  # the oracle's sources carry it, as transformers' tokenizer's
    assert all(x[0] == tgt for x in ours)

    # The random models' greedy outputs vary little: the log-probabilities of every target token say more.
    targets = [[tgt, *tokenizer.encode_target(s)] for s in reversed(SENTENCES) if s]

    def log_probs(path: Path, with_eos: bool) -> np.ndarray:
        pieces = json.loads((path / "shared_vocabulary.json").read_text(encoding="utf-8"))
        results = translator(path).score_batch(
            [[pieces[i] for i in (ids if with_eos else ids[:-1])] for ids in sources],
            [[pieces[i] for i in ids] for ids in targets],
        )
        return np.concatenate([r.log_probs for r in results])

    np.testing.assert_allclose(log_probs(c.oracle, True), log_probs(c.export, False), atol=1e-4, rtol=0)


def test_the_export_ships_the_tokenizer_and_every_id_once(converted):
    c = converted("nllb")
    assert sorted(p.name for p in c.export.iterdir()) == [
        "config.json",
        "model.bin",
        "sentencepiece.bpe.model",
        "shared_vocabulary.json",
        "tokenizer_keys.json",
        "vocab.json",
    ]
    config, _, _ = restore_model(str(c.workdir), LATEST)
    pieces = json.loads((c.export / "shared_vocabulary.json").read_text(encoding="utf-8"))
    assert len(pieces) == len(set(pieces)) == config.model.vocab_size
    vocab = json.loads((c.workdir / "vocab.json").read_text(encoding="utf-8"))
    assert all(pieces[i] == piece for piece, i in vocab.items())
    assert pieces[-2:] == ["<surplus284>", "<surplus285>"]  # NLLB-200's rows past its tokenizer's ids
    engine = json.loads((c.export / "config.json").read_text(encoding="utf-8"))
    assert engine["decoder_start_token"] == engine["eos_token"] == "</s>" and engine["add_source_eos"]
    assert c.report["checkpoint_steps"] == [0]


@pytest.mark.slow
def test_the_command_line_exports_a_converted_workdir(converted, tmp_path):
    """python -m transformer_jax.export --format ctranslate2: the files export_workdir writes, byte for byte."""
    c = converted("m2m100")
    out = tmp_path / "ct2"
    done = subprocess.run(
        [sys.executable, "-m", "transformer_jax.export", "--workdir", str(c.workdir), "--format", "ctranslate2"]
        + ["--output", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["checkpoint_steps"] == [0]
    assert sorted(os.listdir(out)) == sorted(os.listdir(c.export))
    for name in os.listdir(out):
        assert (out / name).read_bytes() == (c.export / name).read_bytes(), name
    keys = json.loads((out / "tokenizer_keys.json").read_text(encoding="utf-8"))
    assert keys["data.tokenizer"] == "fairseq" and len(keys["model.language_codes"]) == 100


def test_a_vocabulary_naming_one_piece_twice_is_refused_in_one_line(converted, tmp_path):
    c = converted("nllb")
    _, model, _ = restore_model(str(c.workdir), LATEST)
    tokenizer = export_lib.exported_tokenizer(c.export)
    tokenizer._pieces[5] = tokenizer._pieces[6]
    with pytest.raises(EvalError, match=r"^tokenizer \S+vocab.json names several ids \[") as e:
        export_lib.to_ctranslate2(model, tokenizer, tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


# -- translate_corpus --engine ctranslate2 ----------------------------------------------------------------------

CORPUS_FLAGS = {"beam_size": 1, "max_extra_len": 4, "batch_size": 4, "source_lang": "en", "target_lang": "de"}
CHUNK = 3


def corpus_run(c: Converted, source: Path, out: Path, engine: str, **flags) -> dict:
    values = {"workdir": str(c.workdir), **CORPUS_FLAGS, **flags}
    return translate_corpus(job_of(values, str(source), str(out), CHUNK, engine=engine))


def scores(out: Path) -> np.ndarray:
    return np.array([line.split("\t") for line in Path(run.scores_file(str(out))).read_text().splitlines()], float)


@pytest.fixture(scope="module")
def jax_corpus(converted, tmp_path_factory):
    """--engine jax's greedy run on the NLLB workdir: (input, OUT)."""
    root = tmp_path_factory.mktemp("corpus")
    source = root / "in.txt"
    source.write_text("".join(s + "\n" for s in SENTENCES * 2), encoding="utf-8")
    corpus_run(converted("nllb"), source, root / "jax.txt", run.JAX)
    return source, root / "jax.txt"


def test_translate_corpus_on_ctranslate2_writes_the_jax_runs_lines_and_scores(converted, jax_corpus, tmp_path):
    source, jax_out = jax_corpus
    report = corpus_run(converted("nllb"), source, tmp_path / "ct2.txt", run.CTRANSLATE2)
    assert (tmp_path / "ct2.txt").read_bytes() == jax_out.read_bytes()
    np.testing.assert_allclose(scores(tmp_path / "ct2.txt"), scores(jax_out), atol=1e-4, rtol=0)  # nan: blank lines
    assert report["engine"] == "ctranslate2" and report["counts"]["empty"] == 2
    assert not run.parts_dir(str(tmp_path / "ct2.txt")).exists()


class Stop(Exception):
    """Raised to stop a run after some chunks are committed (as a Ctrl-C would)."""


def test_a_stopped_ctranslate2_run_resumes_to_the_same_bytes_reusing_its_export(
    converted, jax_corpus, tmp_path, monkeypatch
):
    source, jax_out = jax_corpus
    out = tmp_path / "ct2.txt"
    write = run.write_chunk
    monkeypatch.setattr(run, "write_chunk", lambda *a: write(*a) if a[1] == 0 else (_ for _ in ()).throw(Stop()))
    with pytest.raises(Stop):
        corpus_run(converted("nllb"), source, out, run.CTRANSLATE2)
    monkeypatch.undo()
    parts = run.parts_dir(str(out))
    assert sorted(p.name for p in parts.iterdir()) == ["0000000.json", "ctranslate2", "state.json"]
    with pytest.raises(EvalError, match=r"^\S+ was started with other settings \(--engine 'ctranslate2' -> None\)"):
        corpus_run(converted("nllb"), source, out, run.JAX)
    monkeypatch.setattr(export_lib, "to_ctranslate2", lambda *a, **k: pytest.fail("exported again"))
    report = corpus_run(converted("nllb"), source, out, run.CTRANSLATE2)
    assert report["chunks_resumed"] == 1 and out.read_bytes() == jax_out.read_bytes()
    np.testing.assert_allclose(scores(out), scores(jax_out), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"sampling": True}, "--engine ctranslate2 cannot take --sampling: sampling keys come from --seed"),
        ({"ensemble_workdirs": ["w2"]}, "--engine ctranslate2 cannot take --ensemble_workdirs: it decodes one model"),
        ({"streams": 2}, "--engine ctranslate2 cannot take --streams"),
        ({"engine": "onnx"}, r"--engine 'onnx': choose one of \['jax', 'ctranslate2'\]"),
    ],
)
def test_what_the_engine_cannot_do_is_refused_in_one_line(converted, tmp_path, flags, message):
    flags = {"engine": run.CTRANSLATE2, "streams": 0, **flags}
    values = {"workdir": str(tmp_path / "w"), **CORPUS_FLAGS}
    values.update({k: v for k, v in flags.items() if k not in ("engine", "streams")})
    with pytest.raises(EvalError, match="^" + message) as e:
        job_of(values, str(tmp_path / "in"), str(tmp_path / "out"), CHUNK, flags["streams"], flags["engine"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"beam_size": 4}, r"with --beam_size 4 ranks by its own rules: give --length_penalty average"),
        (dict(beam_size=2, length_penalty="average", finished="set_aside"), "with --beam_size 2: its beam search"),
    ],
)
def test_beam_search_that_ranks_otherwise_than_ours_is_refused_in_one_line(
    converted, jax_corpus, tmp_path, flags, message
):
    """Beam search by other rules than CTranslate2's, or with a forced target language token (CTranslate2 scores it,
    ours adds 0): one line, before anything is written."""
    source, _ = jax_corpus
    with pytest.raises(EvalError, match="^--engine ctranslate2 " + message) as e:
        corpus_run(converted("nllb"), source, tmp_path / "out.txt", run.CTRANSLATE2, **flags)
    assert "\n" not in str(e.value) and not run.parts_dir(str(tmp_path / "out.txt")).exists()


@pytest.mark.slow
def test_a_bilingual_models_beam_search_by_ctranslate2s_rules_writes_the_jax_runs_lines(tmp_path):
    """Without language tokens, beam search with --length_penalty average --finished set_aside is CTranslate2's
    own: both engines write the same OUT."""
    data = write_corpus(tmp_path / "data", n_train=100)
    workdir = untrained_workdir(data, tmp_path / "workdir")
    source = tmp_path / "in.txt"
    source.write_text("the red dog runs\n\nthe man in the green park\na cat\n", encoding="utf-8")
    flags = dict(workdir=str(workdir), beam_size=3, length_penalty="average", finished="set_aside", max_extra_len=4)
    for engine in run.ENGINES:
        translate_corpus(job_of({**flags, "average_last": 1}, str(source), str(tmp_path / engine), 2, engine=engine))
    assert (tmp_path / "ctranslate2").read_bytes() == (tmp_path / "jax").read_bytes()
    np.testing.assert_allclose(scores(tmp_path / "ctranslate2"), scores(tmp_path / "jax"), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_the_decode_benchmark_runs_a_converted_workdir_on_ctranslate2(converted, tmp_path):
    c = converted("nllb")
    (tmp_path / "in.txt").write_text("".join(s + "\n" for s in SENTENCES), encoding="utf-8")
    flags = ["--workdir", str(c.workdir), "--source_file", str(tmp_path / "in.txt"), "--beam_sizes", "1"]
    flags += ["--source_lang", "en", "--target_lang", "de", "--repeats", "1", "--threads", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.decode", *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["identical_outputs"] == report["sentences"] == len(SENTENCES)
    assert report["ours"]["bleu"] is None and report["ctranslate2"]["sentences_per_s"] > 0
