"""Multilingual training data (data/languages.py, the direction parts of batching.MixedExamples, one store per
language side): directions and their shorthands, the language tokens in assembled batches, the temperature's draws,
exact resume with several directions, and the bad inputs."""

import pathlib

import ml_collections
import numpy as np
import pytest

from tests.helpers.data import MULTIWAY_LANGS as LANGS
from tests.helpers.data import write_multiway
from tests.helpers.fakes import WordTokenizer
from tests.helpers.training import tiny_train_config
from transformer_jax.data import batching, languages, pipeline
from transformer_jax.errors import ConfigError, DataError


class SideTokenizer(WordTokenizer):
    """WordTokenizer with what a store needs of a tokenizer (a file next to which stores live)."""

    name = "spm"
    vocab_size = 1000

    def __init__(self, path: pathlib.Path):
        super().__init__()
        self.path = path

    def fingerprint(self) -> str:
        return "words"


def multilingual_config(text_dir: pathlib.Path, directions=("all",), lang_token="target", temperature=1.0):
    config = ml_collections.ConfigDict(tiny_train_config(text_dir).to_dict())
    config.data.directions = tuple(directions)
    config.data.temperature = temperature
    config.model.lang_token = lang_token
    config.model.vocab_size = 1000
    return languages.expand_config(config)


def test_directions_expand_against_the_folder(tmp_path):
    data = write_multiway(tmp_path / "d")
    assert multilingual_config(data).data.directions == ("cs-de", "cs-en", "de-cs", "de-en", "en-cs", "en-de")
    assert multilingual_config(data, ["en-centric"]).data.directions == ("en-cs", "cs-en", "en-de", "de-en")
    assert multilingual_config(data, ["de-en", "all"]).data.directions[0] == "de-en"  # each direction once
    with pytest.raises(ConfigError, match=r"'en-fr': .* has no language 'fr'; it has \['cs', 'de', 'en'\]"):
        multilingual_config(data, ["en-fr"])


def test_a_multiway_folder_whose_files_disagree_in_line_count_is_one_line(tmp_path):
    data = write_multiway(tmp_path / "d")
    (data / "train.cs").write_text("one\n", encoding="utf-8")
    config = multilingual_config(data)
    with pytest.raises(DataError, match=r"line counts differ: .*train.cs has 1 lines, .*train.de has 60"):
        pipeline.multilingual_examples(config, SideTokenizer(tmp_path / "spm.model"), build_if_missing=True)


def test_language_ids_follow_the_pieces_and_each_scheme_places_them(tmp_path):
    config = multilingual_config(write_multiway(tmp_path / "d"), lang_token="source_and_target")
    placement = languages.Placement.of(config)
    assert placement.ids == {"cs": 997, "de": 998, "en": 999}
    assert placement.id(">>de<<") == placement.id("de") == 998
    en_de = languages.Direction("en", "de")
    assert (placement.source_prefix(en_de), placement.target_prefix(en_de)) == (999, 998)
    config.model.lang_token = "source"
    assert (
        languages.Placement.of(config).source_prefix(en_de),
        languages.Placement.of(config).target_prefix(en_de),
    ) == (
        998,
        None,
    )


@pytest.mark.parametrize("scheme", ["source", "target", "source_and_target"])
def test_every_batch_row_segment_carries_its_language_tokens_once(tmp_path, scheme):
    config = multilingual_config(write_multiway(tmp_path / "d"), lang_token=scheme)
    tokenizer = SideTokenizer(tmp_path / "spm.model")
    examples = pipeline.multilingual_examples(config, tokenizer, build_if_missing=True)
    it, stats = pipeline.make_train_iterator(
        config.data, tokenizer, examples=examples, process_count=1, process_index=0
    )
    assert stats["dropped_empty"] == 6  # the blank line, in every direction
    ids = languages.Placement.of(config).ids
    by_id = {v: k for k, v in ids.items()}
    for _ in range(4):
        batch = next(it)
        for key in ("src_tokens", "tgt_out"):
            seg, tok = batch[key.split("_")[0] + "_segment_ids"], batch[key]
            starts = (seg > 0) & np.concatenate([np.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
            lang_slots = np.isin(tok, list(ids.values())) & (seg > 0)
            placed = scheme in ("source", "source_and_target") if key == "src_tokens" else scheme != "source"
            assert (lang_slots == starts).all() if placed else not lang_slots.any()
            if placed and key == "tgt_out":
                assert (batch["tgt_in"][starts] == tokenizer.ids.bos).all()  # tgt_in = [BOS, LT, ...]
                # the target token names the language of the target words that follow it
                rows, cols = np.nonzero(starts)
                for r, c in zip(rows, cols, strict=True):
                    assert tokenizer.words[int(tok[r, c + 1])].startswith(by_id[int(tok[r, c])])


def test_one_language_side_is_stored_once_for_all_its_directions(tmp_path):
    config = multilingual_config(write_multiway(tmp_path / "d"))
    tokenizer = SideTokenizer(tmp_path / "spm.model")
    a = pipeline.multilingual_examples(config, tokenizer, build_if_missing=True)
    assert sorted(p.name for p in tmp_path.glob("*.store")) == [f"spm.train.{lang}.side.store" for lang in LANGS]
    b = pipeline.multilingual_examples(config, tokenizer, build_if_missing=False)  # reopened, not rebuilt
    assert all(
        np.array_equal(x.src, y.src) and np.array_equal(x.tgt, y.tgt) for x, y in zip(a.parts, b.parts, strict=True)
    )
    assert b.parts[0].src is b.parts[1].src  # cs-de and cs-en read the one cs side
    config.data.store = False
    c = pipeline.multilingual_examples(config, tokenizer, build_if_missing=False)
    assert all(np.array_equal(x.tgt, y.tgt) for x, y in zip(a.parts, c.parts, strict=True))
    with pytest.raises(DataError, match="is missing or stale, and this run may not build it"):
        config.data.store, config.data.store_dir = True, str(tmp_path / "elsewhere")
        pipeline.multilingual_examples(config, tokenizer, build_if_missing=False)


def test_the_temperature_sets_each_directions_share_of_the_draws():
    sizes = [100, 400, 1600]
    for temperature in (1.0, 5.0):
        p = languages.probabilities(sizes, temperature)
        expected = np.asarray(sizes, float) ** (1 / temperature)
        np.testing.assert_allclose(p, expected / expected.sum())
        mix = batching.Mix([np.arange(n) for n in sizes], p, ["a-b", "b-a", "a-c"], seed=0)
        consumed, counts = np.zeros(3, np.int64), np.zeros(3)
        for window in range(200):
            _, after = mix.window(window, 500, consumed)
            counts += after - consumed
            consumed = after
        np.testing.assert_allclose(counts / counts.sum(), p, atol=0.01)
    with pytest.raises(ConfigError, match="data.temperature must be > 0"):
        languages.probabilities(sizes, 0.0)


def test_a_resumed_multilingual_stream_continues_with_the_same_batches(tmp_path):
    config = multilingual_config(write_multiway(tmp_path / "d", n=120), temperature=5.0)
    tokenizer = SideTokenizer(tmp_path / "spm.model")
    examples = pipeline.multilingual_examples(config, tokenizer, build_if_missing=True)

    def iterator():
        return pipeline.make_train_iterator(
            config.data, tokenizer, examples=examples, process_count=1, process_index=0
        )[0]

    straight = iterator()
    expected = [next(straight) for _ in range(12)]
    first = iterator()
    for _ in range(5):
        next(first)
    resumed = iterator()
    resumed.set_state(first.get_state())
    for want in expected[5:]:
        got = next(resumed)
        assert all(np.array_equal(got[k], want[k]) for k in want)
    assert set(first.last_corpus_tokens) == set(config.data.directions)  # tokens_<src>-<tgt> in metrics.jsonl


def test_a_limited_direction_trains_on_its_first_lines_and_counts_them_for_the_temperature(tmp_path):
    config = multilingual_config(write_multiway(tmp_path / "d", n=60), ["en-centric"], temperature=5.0)
    config.data.direction_lines = (("en-cs", 10), ("cs-en", 10))
    tokenizer = SideTokenizer(tmp_path / "spm.model")
    examples = pipeline.multilingual_examples(config, tokenizer, build_if_missing=True)
    sizes = dict(zip(examples.names, (len(p) for p in examples.parts), strict=True))
    assert sizes == {"en-cs": 10, "cs-en": 10, "en-de": 60, "de-en": 60}
    np.testing.assert_allclose(examples.probabilities, languages.probabilities([10, 10, 60, 60], 5.0))
    cs_first = examples.parts[0]  # en-cs: English then Czech line i, for i < 10 only
    assert np.array_equal(cs_first.tgt[: cs_first.tgt_starts[-1]], examples.parts[1].src[: cs_first.tgt_starts[-1]])
    assert (
        languages.language_lines(config.data, "cs", 60) == 10 and languages.language_lines(config.data, "en", 60) == 60
    )
    config.data.direction_lines = (("fr-en", 10),)
    with pytest.raises(ConfigError, match=r"data.direction_lines names \['fr-en'\], which data.directions"):
        languages.expand_config(config)
