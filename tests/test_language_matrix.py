"""The language matrix (evaluation/matrix.py, evaluate.py --directions): every direction's scores are sacreBLEU's and
py3langid's on the written files, one mixed search gives what one direction at a time gives, and bad input stops
in one line before anything is written.

The model is a many-to-many run of two steps at a learning rate of 1e-9: as good as random, so its outputs are
varied, non-blank text that the language identifier has something to say about (a trained tiny model mostly emits
blanks). Its languages are en, de, fr (real words, which py3langid knows) and `xq` (a suffix it does not know).
"""

import json
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest
from py3langid.langid import MODEL_FILE, LanguageIdentifier
from sacrebleu.metrics import BLEU, CHRF

from tests.helpers import DATA, REPO
from tests.helpers.training import tiny_train_config
from transformer_jax.data import languages
from transformer_jax.data.languages import Direction
from transformer_jax.errors import EvalError
from transformer_jax.evaluation import command, matrix, run
from transformer_jax.evaluation.translate import LanguageIds, read_lines, translate
from transformer_jax.training.loop import train_and_evaluate

WORDS = {
    "en": "the a man woman dog cat runs sits red blue big small house street park ball water green old young",
    "de": "der die ein mann frau hund katze läuft sitzt rot blau groß klein haus straße park ball wasser grün alt",
    "fr": "le la un homme femme chien chat court assis rouge bleu grand petit maison rue parc balle eau vert vieux",
    "xq": " ".join(f"xq{i}" for i in range(20)),
}
SEARCH = {"beam_size": 1, "max_len": 10}


def write_folder(directory, n=40, blank=5, splits=("train", "test")):
    """A multi-way folder of word-for-word sentences in WORDS' languages, line `blank` blank in every language."""
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 20, rng.integers(3, 8)) for _ in range(n)]
    directory.mkdir(parents=True, exist_ok=True)
    for split in splits:
        for lang, words in WORDS.items():
            words = words.split()
            lines = ["" if i == blank else " ".join(words[j] for j in row) for i, row in enumerate(rows)]
            (directory / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """An English-centric model of en, de, fr, xq (six directions supervised, six zero-shot); its test folder also
    holds Italian, which the model has no token for."""
    root = tmp_path_factory.mktemp("matrix")
    text_dir = write_folder(root / "d")
    (text_dir / "test.it").write_text((text_dir / "test.en").read_text(), encoding="utf-8")
    config = ml_collections.ConfigDict(tiny_train_config(text_dir, num_steps=2, eval_every=0, bleu_every=0).to_dict())
    config.model.vocab_size = 364  # the pieces byte fallback needs, and four languages
    config.model.lang_token = "target"
    config.data.directions = ("en-centric",)
    config.data.tokenizer_type = "bpe"
    config.opt.learning_rate = 1e-9  # as good as random: varied, non-blank outputs
    config.ckpt.every_steps = 2
    config.eval.average_last = 1
    train_and_evaluate(config, root / "run")
    return root / "run"


@pytest.fixture(scope="module")
def written(workdir, tmp_path_factory):
    """evaluate.py --directions all --pivot en's folder and returned report."""
    folder = tmp_path_factory.mktemp("out") / "matrix"
    values = {"workdir": str(workdir), "directions": ["all"], "pivot": "en", "output_dir": str(folder), **SEARCH}
    return folder, command.evaluate(values, progress=False)


def identifier(langs):
    found = LanguageIdentifier.from_model_file(MODEL_FILE)
    found.set_languages(langs)
    return found


def off_target(path, target, known=("de", "en", "fr")):
    said = [line for line in read_lines(path) if line.strip()]
    ident = identifier(list(known))
    return sum(ident.classify(line)[0] != target for line in said) / len(said)


def test_every_direction_scores_as_sacrebleu_and_py3langid_on_its_written_file(written):
    folder, report = written
    langs = ("de", "en", "fr", "xq")
    names = {f"{s}-{t}" for s in langs for t in langs if s != t}
    assert set(report) == names and json.loads((folder / "report.json").read_text()) == report
    zero_shot = {n for n in names if "en" not in n.split("-")}
    meta = json.loads((folder / "meta.json").read_text())
    text_dir = folder.parents[1] / meta["text_dir"]
    for name, r in report.items():
        src, tgt = name.split("-")
        refs = read_lines(text_dir / f"test.{tgt}")
        hyps = read_lines(folder / f"{name}.txt")
        assert len(hyps) == r["lines"] == 40 and hyps[5] == ""  # a blank source gives a blank output
        assert r["bleu"] == BLEU().corpus_score(hyps, [refs]).score
        assert r["chrf"] == CHRF().corpus_score(hyps, [refs]).score
        assert r["supervised"] == (name not in zero_shot)
        if tgt == "xq":  # py3langid does not know it
            assert r["off_target"] is None
        else:
            assert r["off_target"] == off_target(folder / f"{name}.txt", tgt)
            counts, said = meta["identified_languages"][name], sum(bool(h.strip()) for h in hyps)
            assert sum(counts.values()) == said and 1 - counts.get(tgt, 0) / said == pytest.approx(r["off_target"])
        if name in zero_shot:
            via = folder / f"{src}-en-{tgt}.txt"
            refs_scores = BLEU().corpus_score(read_lines(via), [refs]).score
            assert r["pivot"]["bleu"] == refs_scores and (folder / f"{src}-en.txt").is_file()
            assert r["pivot"]["off_target"] == (None if tgt == "xq" else off_target(via, tgt))
        else:
            assert r["pivot"] is None
    assert 0 < sum(r["off_target"] or 0 for r in report.values())  # the identifier had something to say
    assert meta["skipped_languages"] == ["it"] and meta["unidentifiable_languages"] == ["xq"]
    assert meta["identified_among"] == ["de", "en", "fr"] and meta["checkpoint_steps"] == [2]
    assert (folder / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_mixed_search_gives_what_one_direction_at_a_time_gives(workdir, written):
    """Each direction's file is what evaluate.py --split test --source_lang S --target_lang T writes (its own
    language tokens, placed by the model's scheme), and each pivoted one the two legs one after the other."""
    folder, report = written
    mode = run.Matrix(run.Model(str(workdir)), ("all",), decoding=run.Decoding(**SEARCH))
    plan, loaded = matrix.check(mode), matrix.restore(mode)
    settings = run.decoding_settings(mode.decoding, loaded.config)
    placement = languages.Placement.of(loaded.config)

    def one(src, tgt, lines):
        ids = LanguageIds.of(placement, Direction(src, tgt))
        return translate(loaded.model, loaded.tokenizer, lines, settings, language_ids=ids)[0]

    def file(name):  # the lines as written, line ends removed (read_lines also strips trailing blanks)
        return (folder / f"{name}.txt").read_text(encoding="utf-8").split("\n")[:-1]

    for d in plan.directions:
        alone = run.Translate(
            run.Model(str(workdir), target_lang=d.tgt, source_lang=d.src), "test", decoding=mode.decoding
        )
        assert run.translate(alone, run.load(alone)).hypotheses == file(d.name)
        if report[d.name]["pivot"] is not None:
            assert one("en", d.tgt, one(d.src, "en", plan.lines[d.src])) == file(f"{d.src}-en-{d.tgt}")
    assert LanguageIds.of(placement, Direction("de", "fr")) == (None, placement.ids["fr"])  # target: forced


def test_the_directions_a_fine_tuning_runs_sources_trained_are_supervised(workdir, tmp_path):
    """A model fine-tuned from this one on de-fr alone was still trained on the English-centric six: the matrix
    counts train.source_directions (written by the fine-tuning run from its source) as supervised too."""
    from transformer_jax.training import checkpoints, step

    config = checkpoints.load_config(str(workdir))
    english_centric = tuple(config.data.directions)
    config.train.source_directions, config.data.directions = english_centric, ("de-fr",)
    saver = checkpoints.Checkpointer(tmp_path / "ft", config.ckpt)
    saver.save(2, step.create_train_state(config)[1], {"position": 2}, config)
    saver.close()
    plan = matrix.check(run.Matrix(run.Model(str(tmp_path / "ft")), ("all",), decoding=run.Decoding(**SEARCH)))
    assert plan.supervised == {*english_centric, "de-fr"} and len(english_centric) == 6


def test_the_printed_tables_mark_zero_shot_cells():
    report = {
        "de-en": {"bleu": 10.0, "chrf": 40.0, "off_target": 0.25, "supervised": True, "pivot": None},
        "en-de": {"bleu": 20.0, "chrf": 50.0, "off_target": None, "supervised": False, "pivot": None},
    }
    text = matrix.tables(report, ["de", "en"])
    assert "10.0/40.0" in text and "20.0/50.0*" in text and "25.0" in text and " -*" in text


def test_the_identifier_restricted_to_the_models_languages():
    ident = matrix.Identifier(["de", "en", "fr", "xq"])
    assert ident.known == ["de", "en", "fr"] and ident.unknown == ["xq"]
    hyps = ["the man runs in the park", "der Hund läuft über die Straße", "", "un homme court dans la rue"]
    assert ident.off_target(hyps, "en") == 2 / 3  # the blank line is not counted
    assert ident.off_target(hyps, "xq") is None and ident.off_target(["", " "], "en") is None
    assert matrix.Identifier(["en", "xq"]).off_target(hyps, "en") is None  # one known language identifies nothing


@pytest.mark.skipif(not (DATA / "multi30k" / "test.cs").is_file(), reason="needs Multi30k (TRANSFORMER_JAX_DATA)")
def test_restricted_py3langid_identifies_every_multi30k_test_reference():
    langs = ["cs", "de", "en", "fr"]
    ident = matrix.Identifier(langs)
    for lang in langs:
        lines = read_lines(DATA / "multi30k" / f"test.{lang}")
        assert len(lines) == 1000 and ident.off_target(lines, lang) == 0.0  # measured: 1000/1000 of each language


# -- bad input: one line, nothing written ---------------------------------------------------------------------------


def refused(values, match, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(EvalError, match=match) as e:
        command.evaluate({"output_dir": str(out), **values}, progress=False)
    assert "\n" not in str(e.value) and not out.exists()


def test_bad_directions_pivots_and_folders_are_refused_before_anything_is_written(workdir, tmp_path):
    w = {"workdir": str(workdir)}
    refused(
        {**w, "directions": ["en-it"]}, r"en-it: the model has no token for 'it'; it has \['de', 'en', 'fr'", tmp_path
    )
    refused(
        {**w, "directions": ["all"], "pivot": "cs"}, r"--pivot cs: the model has no token .* \['de', 'en'", tmp_path
    )
    refused({**w, "directions": ["all", "en-de"]}, "give all, or SRC-TGT", tmp_path)
    refused({**w, "directions": ["ende"]}, "give all, or SRC-TGT", tmp_path)
    refused({**w, "directions": ["all"], "nbest": 2}, "--nbest cannot go with it", tmp_path)
    refused({**w, "directions": ["all"], "output_file": "o.txt"}, "--output_file cannot go with it", tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / "valid.en").write_text("a\n")
    refused(
        {**w, "directions": ["all"], "text_dir": str(other)},
        rf"{other} has no files of split 'test' .*valid\.en",
        tmp_path,
    )
    (other / "test.en").write_text("a\n")
    (other / "test.it").write_text("a\n")
    refused({**w, "directions": ["all"], "text_dir": str(other)}, r"tokens for \['en'\]: a matrix needs two", tmp_path)
    refused({"directions": ["all"], "pivot": "en"}, "give --workdir", tmp_path)


def test_an_output_folder_holding_other_files_is_refused_and_left_alone(workdir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    values = {"workdir": str(workdir), "directions": ["en-de"], "output_dir": str(out), **SEARCH}
    with pytest.raises(EvalError, match="holds files that are not a matrix's .no meta.json"):
        command.evaluate(values, progress=False)
    assert [f.name for f in out.iterdir()] == ["notes.txt"]
    (out / "notes.txt").unlink()
    command.evaluate(values, progress=False)  # empty: written, and again over its own report
    command.evaluate(values, progress=False)
    assert sorted(f.name for f in out.iterdir()) == ["en-de.txt", "heatmap.png", "meta.json", "report.json"]


def test_directions_on_a_bilingual_model_names_the_direction_it_knows(corpus, tmp_path):
    config = tiny_train_config(corpus, num_steps=1, eval_every=0, bleu_every=0)
    config.ckpt.every_steps = 1
    train_and_evaluate(config, tmp_path / "bi")
    values = {"workdir": str(tmp_path / "bi"), "directions": ["all"]}
    refused(values, r"holds a bilingual model \(en-de\); translate it with --split", tmp_path)


@pytest.mark.slow
def test_evaluate_py_exits_non_zero_with_one_line(workdir, tmp_path):
    args = [sys.executable, "evaluate.py", f"--workdir={workdir}", "--directions=de-cs", f"--output_dir={tmp_path}/o"]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "de-cs: the model has no token for 'cs'" in done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "o").exists()
