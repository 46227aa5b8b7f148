"""Validation of a multilingual run (data.directions): loss and BLEU per direction on its lines of the multi-way
folder, with the language ids where training puts them, and their unweighted mean as valid_*."""

import pathlib

import jax
import numpy as np
import pytest

from tests.helpers.training import WORDS_DE, WORDS_EN, tiny_train_config
from transformer_jax import data
from transformer_jax.data import languages
from transformer_jax.data.languages import validation_directions
from transformer_jax.data.pipeline import eval_batches
from transformer_jax.data.tokenizer import Tokenizer, train_tokenizer
from transformer_jax.errors import DataError
from transformer_jax.evaluation import translate as translate_lib
from transformer_jax.evaluation.translate import LanguageIds, bleu_evaluator, source_ids
from transformer_jax.model.layers import SpecialIds
from transformer_jax.sharding import batch_sharding, make_mesh
from transformer_jax.training.loop import Validation, evaluate_loss, validation_batches
from transformer_jax.training.metrics import MetricWriter, read_metrics
from transformer_jax.training.step import compile_steps, create_train_state, eval_model

WORDS_FR = (
    "le la un homme femme chien chat court assis rouge bleu grand petit maison rue parc balle eau vert vieux".split()
)
WORDS = {"en": WORDS_EN, "de": WORDS_DE, "fr": WORDS_FR}
DIRECTIONS = ("en-de", "de-fr", "fr-en")
VOCAB = 320  # 317 SentencePiece pieces, then the ids of de, en, fr


def write_multiway(directory: pathlib.Path, n_train: int = 40, n_valid: int = 12) -> pathlib.Path:
    """A 3-way folder: line i of {split}.en, .de and .fr is the same word-for-word sentence."""
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("valid", n_valid)):
        indices = [rng.integers(0, len(WORDS_EN), rng.integers(2, 7)) for _ in range(n)]
        for lang, words in WORDS.items():
            lines = [" ".join(words[i] for i in idx) for idx in indices]
            (directory / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> pathlib.Path:
    return write_multiway(tmp_path_factory.mktemp("multiway"))


@pytest.fixture(scope="module")
def tokenizer(folder, tmp_path_factory):
    """A SentencePiece model of VOCAB - 3 pieces: the language ids follow them (languages.Placement)."""
    sentences = [line for lang in WORDS for line in (folder / f"train.{lang}").read_text().splitlines()]
    path = tmp_path_factory.mktemp("tok") / "spm.model"
    train_tokenizer(sentences, path, vocab_size=VOCAB - 3, model_type="bpe", ids=SpecialIds.DEFAULT)
    table = languages.Placement.of(multilingual_config(folder))
    return Tokenizer(path, SpecialIds.DEFAULT, language_table=table)


def multilingual_config(folder: pathlib.Path, scheme: str = "source_and_target", **train):
    config = tiny_train_config(folder, **train)
    config.model.vocab_size = VOCAB
    config.data.directions = DIRECTIONS
    config.model.lang_token = scheme
    config.eval.beam_size = 1
    config.eval.max_extra_len = 4
    return config


def build_validation(config, tokenizer, workdir: pathlib.Path, bleu=None):
    graphs, state = create_train_state(config)
    mesh = make_mesh()
    _, eval_step, shardings = compile_steps(graphs, state, mesh, "data", label_smoothing=0.1, accum_steps=1)
    state = jax.device_put(state, shardings)
    sharding = batch_sharding(mesh)
    workdir.mkdir(parents=True, exist_ok=True)
    writer = MetricWriter(workdir, config=config)
    return Validation(config, graphs, tokenizer, eval_step, sharding, writer, bleu), state, eval_step, sharding, writer


def test_validation_sets_are_the_directions_lines_of_the_multiway_folder(folder):
    config = multilingual_config(folder)
    sets = validation_directions(config)
    assert [d.name for d, _ in sets] == list(DIRECTIONS)
    lines = {lang: (folder / f"valid.{lang}").read_text().splitlines() for lang in WORDS}
    for d, pairs in sets:
        assert pairs == list(zip(lines[d.src], lines[d.tgt], strict=True))


def test_a_direction_pair_with_an_empty_side_is_left_out(tmp_path):
    folder = write_multiway(tmp_path / "m")
    de = (folder / "valid.de").read_text().splitlines()
    (folder / "valid.de").write_text("\n".join(["", *de[1:]]) + "\n", encoding="utf-8")
    sets = dict(validation_directions(multilingual_config(folder)))
    assert [len(sets[languages.Direction.parse(n)]) for n in DIRECTIONS] == [11, 11, 12]


def test_directions_without_a_text_dir_are_one_line(folder):
    config = multilingual_config(folder)
    config.data.text_dir = ""
    with pytest.raises(DataError, match=r"^data.directions needs data.text_dir: a multi-way folder"):
        validation_directions(config)


def test_a_valid_file_with_another_line_count_names_both_files(tmp_path):
    folder = write_multiway(tmp_path / "m")
    (folder / "valid.fr").write_text("un chien\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"line counts differ: .*valid\.\w\w has \d+ lines, .*valid\.\w\w has"):
        validation_directions(multilingual_config(folder))


@pytest.mark.parametrize("scheme", ["source", "target", "source_and_target", "none"])
def test_each_row_holds_its_language_ids_where_training_batches_do(folder, tokenizer, scheme):
    config = multilingual_config(folder, scheme)
    config.data.eval_max_len = 6  # cuts most sentences: the language id must stay and count
    config.eval.batch_size = 4
    placement = languages.Placement.of(config)
    language_ids = set(placement.ids.values())
    ids = SpecialIds.DEFAULT
    for d, pairs in validation_directions(config):
        src_lt, tgt_lt = placement.source_prefix(d), placement.target_prefix(d)
        for batch in validation_batches(config, tokenizer, pairs, d):
            for r in np.flatnonzero(batch["src_segment_ids"][:, 0] > 0):
                src = batch["src_tokens"][r][batch["src_segment_ids"][r] > 0].tolist()
                real = batch["tgt_segment_ids"][r] > 0
                tgt_in, tgt_out = batch["tgt_in"][r][real].tolist(), batch["tgt_out"][r][real].tolist()
                assert len(src) <= 6 and len(tgt_out) <= 6 and src[-1] == ids.eos and tgt_out[-1] == ids.eos
                assert sum(t in language_ids for t in src) == (src_lt is not None)
                assert sum(t in language_ids for t in tgt_out) == sum(t in language_ids for t in tgt_in)
                assert sum(t in language_ids for t in tgt_out) == (tgt_lt is not None)
                if src_lt is not None:
                    assert src[0] == src_lt
                assert tgt_in[0] == ids.bos and tgt_in[1:] == tgt_out[:-1]
                if tgt_lt is not None:
                    assert tgt_out[0] == tgt_lt
    if scheme == "source_and_target":
        en_de = languages.Direction("en", "de")
        assert (placement.source_prefix(en_de), placement.target_prefix(en_de)) == (VOCAB - 2, VOCAB - 3)


def test_eval_batches_put_the_ids_before_the_encoded_sentences(tokenizer):
    plain, _ = eval_batches(["the dog"], tokenizer, 2, 16, targets=["der hund"])
    tagged, _ = eval_batches(["the dog"], tokenizer, 2, 16, targets=["der hund"], source_prefix=318, target_prefix=317)
    plain, tagged = next(plain), next(tagged)
    n_src, n_tgt = int(plain["src_segment_ids"][0].sum()), int(plain["tgt_segment_ids"][0].sum())
    assert tagged["src_tokens"][0, : n_src + 1].tolist() == [318, *plain["src_tokens"][0, :n_src].tolist()]
    assert tagged["tgt_out"][0, : n_tgt + 1].tolist() == [317, *plain["tgt_out"][0, :n_tgt].tolist()]
    assert tagged["tgt_in"][0, :2].tolist() == [SpecialIds.DEFAULT.bos, 317]
    sources_only, _ = eval_batches(["the dog"], tokenizer, 2, 16, source_prefix=318, target_prefix=317)
    assert set(next(sources_only)) == {k for k in tagged if k.startswith("src_")} | {"example_index"}


def test_scores_per_direction_and_their_unweighted_mean(folder, tokenizer, tmp_path):
    config = multilingual_config(folder, bleu_every=3, bleu_sentences=2)
    validation, state, eval_step, sharding, _ = build_validation(config, tokenizer, tmp_path, bleu_evaluator)
    scores = validation.run_due(config.train.eval_every, state)
    keys = ("loss", "nll", "perplexity", "accuracy")
    every_batch = []
    for d, pairs in validation_directions(config):
        batches = validation_batches(config, tokenizer, pairs, d)
        assert {k: scores[f"valid_{d.name}_{k}"] for k in keys} == evaluate_loss(eval_step, state, batches, sharding)
        every_batch += batches
    for k in keys:
        assert scores[f"valid_{k}"] == pytest.approx(np.mean([scores[f"valid_{d}_{k}"] for d in DIRECTIONS]))
    # Not the loss per token of all directions pooled: their languages tokenize to different lengths.
    pooled = evaluate_loss(eval_step, state, every_batch, sharding)
    assert scores["valid_loss"] != pytest.approx(pooled["loss"], rel=1e-6)
    bleu = ("bleu", "chrf", "chrfpp", "ter", "tokenized_bleu")
    written = {k for r in read_metrics(tmp_path / "metrics.jsonl") for k in r} - {"step"}
    names = {f"valid_{p}{k}" for p in ("", *(f"{d}_" for d in DIRECTIONS)) for k in keys + bleu}
    assert written == set(scores) == names


def test_bleu_per_direction_forces_the_language_ids_and_drops_them_from_the_text(
    folder, tokenizer, tmp_path, monkeypatch
):
    config = multilingual_config(folder, bleu_sentences=3)
    placement = languages.Placement.of(config)
    graphs, state = create_train_state(config)
    model = eval_model(graphs, state)
    searched, texts = [], []
    search, translate = translate_lib.decoding.Searcher.sentences, translate_lib.translate

    def spy_search(self, sources, max_len_N, search_spec, **kwargs):
        results = search(self, sources, max_len_N, search_spec, **kwargs)
        searched.append((sources, kwargs["prefixes"], [r.tokens[0, 0] for r in results]))
        return results

    def spy_translate(*args, **kwargs):
        hypotheses, stats = translate(*args, **kwargs)
        texts.extend(hypotheses)
        return hypotheses, stats

    monkeypatch.setattr(translate_lib.decoding.Searcher, "sentences", spy_search)
    monkeypatch.setattr(translate_lib, "translate", spy_translate)
    scores = bleu_evaluator(config, tokenizer)(model)
    metrics = ("bleu", "chrf", "chrfpp", "ter", "tokenized_bleu")
    assert set(scores) == {f"{p}{m}" for p in ("", *(f"{d}_" for d in DIRECTIONS)) for m in metrics}
    for m in metrics:
        assert scores[m] == pytest.approx(np.mean([scores[f"{d}_{m}"] for d in DIRECTIONS]))
    assert len(searched) == len(DIRECTIONS) and len(texts) == 3 * len(DIRECTIONS)
    for name, (sources, prefixes, first_tokens) in zip(DIRECTIONS, searched, strict=True):
        d = languages.Direction.parse(name)
        assert [s[0] for s in sources] == [placement.ids[d.src]] * 3
        assert prefixes == [[placement.ids[d.tgt]]] * 3
        assert [int(t) for t in first_tokens] == [placement.ids[d.tgt]] * 3
    assert not any(">>" in text for text in texts)


def test_a_hypothesis_of_language_ids_only_is_empty_text(tokenizer):
    """An untrained model may emit any language id; the tokenizer's decode drops them (its pieces end before them)."""
    tokens = np.array([[317, 319, 318, SpecialIds.DEFAULT.eos]])
    result = translate_lib.decoding.BeamResult(tokens, np.zeros(1), np.zeros(1), np.array([4]))
    hypothesis = translate_lib._hypothesis(tokenizer, result, 0)
    assert (hypothesis.text, hypothesis.length, hypothesis.ended) == ("", 4, True)


def test_the_source_language_id_counts_towards_max_input_len(tokenizer):
    plain, _ = source_ids(tokenizer, "the big red dog", 64)
    ids, cut = source_ids(tokenizer, "the big red dog", 4, [319])
    assert cut and ids == [319, *plain[:2], SpecialIds.DEFAULT.eos]
    assert LanguageIds.of(languages.Placement("target", {"de": 317}), languages.Direction("en", "de")) == (None, 317)


def test_a_bilingual_runs_validation_writes_the_keys_it_wrote_before(corpus, tmp_path):
    config = tiny_train_config(corpus, bleu_every=6, bleu_sentences=2)
    config.eval.beam_size, config.eval.max_extra_len = 1, 2
    tokenizer = data.get_tokenizer(config.data, tmp_path, vocab_size=config.model.vocab_size, ids=SpecialIds.of(config))
    validation, state, *_ = build_validation(config, tokenizer, tmp_path / "w", bleu=bleu_evaluator)
    scores = validation.run_due(config.train.num_steps, state)
    records = read_metrics(tmp_path / "w" / "metrics.jsonl")
    loss = {f"valid_{k}" for k in ("loss", "nll", "perplexity", "accuracy")}
    bleu = {f"valid_{k}" for k in ("bleu", "chrf", "chrfpp", "ter", "tokenized_bleu")}
    assert [set(r) - {"step"} for r in records] == [loss, bleu]
    assert set(scores) == loss | bleu


def test_select_metric_valid_bleu_ranks_the_mean_over_directions(folder, tokenizer, tmp_path):
    config = multilingual_config(folder, bleu_sentences=2, select_metric="valid_bleu", early_stop_patience=2)
    validation, state, *_ = build_validation(config, tokenizer, tmp_path, bleu_evaluator)
    scores = validation.run_due(config.train.eval_every, state)  # no bleu_every: the ranked metric decodes
    assert scores["valid_bleu"] == pytest.approx(np.mean([scores[f"valid_{d}_bleu"] for d in DIRECTIONS]))
    assert scores["valid_loss"] == pytest.approx(np.mean([scores[f"valid_{d}_loss"] for d in DIRECTIONS]))
