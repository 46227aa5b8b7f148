"""Weighted corpus mixing (data.corpora): draws against the weights, reshuffling, exact resume, tags as one piece,
per-corpus token counts in metrics.jsonl, and every bad input as one error naming the key or the file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.data import config_for, synthetic_pairs, write_pairs
from tests.helpers.fakes import WordTokenizer
from tests.helpers.training import tiny_train_config, write_corpus
from transformer_jax.cli import RULES
from transformer_jax.data import batching, pipeline, sources, store
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.model.layers import SpecialIds

Z_999 = 3.29  # two-sided 99.9% normal quantile


def three_corpora(tmp_path: Path) -> tuple[tuple, dict[str, float]]:
    """Corpora a (text directory), b (a file pair, few pairs: it runs out often) and c (text), tagged <a> <b> <c>:
    data.corpora's records (name, kind, where, weight, tag)."""
    write_pairs(tmp_path / "a", synthetic_pairs(300, seed=1))
    write_pairs(tmp_path / "c", synthetic_pairs(200, seed=3))
    b = write_pairs(tmp_path / "b", synthetic_pairs(40, seed=2), split="mono")
    weights = {"a": 0.5, "b": 0.3, "c": 0.2}
    spec = (
        ("a", "text", str(tmp_path / "a"), 5, "<a>"),
        ("b", "files", f"{b / 'mono.en'}+{b / 'mono.de'}", 3, "<b>"),
        ("c", "text", str(tmp_path / "c"), 2, "<c>"),
    )
    return spec, weights


def segments_by_tag(batch: dict[str, np.ndarray], tag_ids: dict[int, str]) -> dict[str, int]:
    """Examples of each corpus in a batch: the first source token of every segment is its corpus's tag."""
    first = (batch["src_positions"] == 0) & (batch["src_segment_ids"] > 0)
    counts = dict.fromkeys(tag_ids.values(), 0)
    for token in batch["src_tokens"][first].tolist():
        counts[tag_ids[token]] += 1
    return counts


def test_sources_are_drawn_by_weight_within_binomial_intervals(tmp_path):
    spec, weights = three_corpora(tmp_path)
    config = config_for(tmp_path / "a", corpora=spec, batch_window=128)
    tok = WordTokenizer()
    it, stats = pipeline.make_train_iterator(config, tok, process_index=0, process_count=1, num_threads=1)
    tag_ids = {tok.encode(f"<{name}>")[0]: name for name in weights}
    counts, tokens = dict.fromkeys(weights, 0), dict.fromkeys(weights, 0)
    for _ in range(300):
        batch = next(it)
        for name, n in segments_by_tag(batch, tag_ids).items():
            counts[name] += n
        for name, n in it.last_corpus_tokens.items():
            tokens[name] += n
        assert sum(it.last_corpus_tokens.values()) == it.last_real_tokens
    total = sum(counts.values())
    assert total > 5000
    for name, p in weights.items():
        half = Z_999 * math.sqrt(p * (1 - p) / total)
        assert abs(counts[name] / total - p) < half, (name, counts, total)
    assert all(tokens[name] > 0 for name in weights)
    assert stats["kept_a"] + stats["kept_b"] + stats["kept_c"] == stats["kept"]


def test_each_corpus_is_reshuffled_every_time_it_runs_out():
    """Corpus c's draws, in order, are whole permutations of its kept ids, a new one every epoch, seeded by name."""
    kept = [np.arange(0, 10), np.arange(10, 13)]
    mix = batching.Mix(kept, np.array([0.5, 0.5]), ["x", "y"], seed=4)
    consumed, drawn = np.zeros(2, np.int64), []
    for window in range(20):
        items, consumed = mix.window(window, 16, consumed)
        drawn.append(items)
    small = [i for i in np.concatenate(drawn).tolist() if i >= 10]
    epochs = [small[k : k + 3] for k in range(0, len(small) - 2, 3)]
    assert all(sorted(e) == [10, 11, 12] for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # not the same order every epoch
    one = lambda name: batching.Mix([np.arange(100)], np.ones(1), [name], seed=4).epochs[0].order(0)
    assert np.array_equal(one("x"), one("x")) and not np.array_equal(one("x"), one("z"))


@pytest.mark.parametrize("batching", ["pack", "bucket"])
def test_resume_at_any_step_gives_the_same_next_batches(tmp_path, batching):
    spec, _ = three_corpora(tmp_path)
    config = config_for(tmp_path / "a", corpora=spec, batch_window=64, batching=batching, tokens_per_batch=256)
    tok = WordTokenizer()
    make = lambda: pipeline.make_train_iterator(config, tok, process_index=0, process_count=1, num_threads=1)[0]
    reference = make()
    batches, states = [], []
    for _ in range(40):
        batches.append(next(reference))
        states.append(json.loads(json.dumps(reference.get_state())))
    assert "consumed" in states[0]
    for k in (0, 7, 23):
        resumed = make()
        resumed.set_state(states[k])
        for expected in batches[k + 1 : k + 11]:
            got = next(resumed)
            for key, value in expected.items():
                np.testing.assert_array_equal(got[key], value, err_msg=f"{key} after resuming at {k}")


def test_stores_give_the_in_memory_batches_and_tags_are_one_piece(tmp_path):
    """The tokenizer trained on the mix holds every tag as one user-defined piece; per-corpus stores assemble the
    batches the in-memory path does."""
    spec, _ = three_corpora(tmp_path)
    config = config_for(tmp_path / "a", corpora=spec, store_dir=str(tmp_path / "stores"))
    config.tokenizer_sample_sentences = 600
    tok = tokenizer_lib.get_tokenizer(config, tmp_path / "run", vocab_size=300, ids=SpecialIds.DEFAULT)
    for tag in ("<a>", "<b>", "<c>"):
        ids = tok.encode_source(f"{tag} s1 a2")
        assert tag in tok.source_pieces(ids)
    examples, paths = store.open_train_examples(config, tok, build_if_missing=True, num_threads=1)
    assert [p.name for p in paths] == [f"spm.corpus-{n}.train.en-de.store" for n in "abc"]
    tag_id = tok.source_pieces(range(tok.vocab_size)).index("<b>")
    src, _ = examples.parts[1].pair(0)
    assert tag_id in src.tolist()[:2]
    from_store, _ = pipeline.make_train_iterator(config, tok, examples=examples, process_index=0, process_count=1)
    in_memory, _ = pipeline.make_train_iterator(config, tok, process_index=0, process_count=1, num_threads=1)
    for _ in range(5):
        a, b = next(from_store), next(in_memory)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_a_given_tokenizer_that_splits_a_tag_is_refused(tmp_path):
    spec, _ = three_corpora(tmp_path)
    plain = config_for(tmp_path / "a", tokenizer_sample_sentences=400)
    tok = tokenizer_lib.get_tokenizer(plain, tmp_path / "plain", vocab_size=300, ids=SpecialIds.DEFAULT)
    config = config_for(tmp_path / "a", corpora=spec, tokenizer_model=str(tok.path))
    with pytest.raises(DataError, match=r"data\.corpora: the tag '<a>' of corpus 'a' .*\(data\.tokenizer_model\)"):
        tokenizer_lib.get_tokenizer(config, tmp_path / "run", vocab_size=300, ids=SpecialIds.DEFAULT)


def test_metrics_count_tokens_per_corpus(tmp_path):
    """A tiny training run on two corpora writes tokens_NAME per logging interval, summing to the run's tokens."""
    from transformer_jax.training.loop import train_and_evaluate
    from transformer_jax.training.metrics import read_metrics

    first, second = write_corpus(tmp_path / "one"), write_corpus(tmp_path / "two", n_train=100)
    config = tiny_train_config(first, num_steps=3, eval_every=0)
    config.data.corpora = (("one", "text", str(first), 3, ""), ("two", "text", str(second), 1, "<BT>"))
    train_and_evaluate(config, tmp_path / "run")
    train = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    for record in train:
        assert record["tokens_one"] > record["tokens_two"] > 0
    data = next(r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "data_kept" in r)
    assert data["data_kept_one"] == 400 and data["data_kept_two"] == 100


CORPORA = RULES["data.corpora"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("a=text:/x", r"'a=text:/x' is not NAME=KIND:WHERE:WEIGHT\[:TAG\]"),
        ("a=web:/x:1", r"the kind of corpus 'a': unknown value 'web'; choose one of \['text', 'tfds', 'files'\]"),
        ("a=text:/x:0", r"the weight of corpus 'a': must be positive \(a number > 0\), got 0.0"),
        ("a=text:/x:-1:<t>", r"the weight of corpus 'a': must be positive"),
        ("a=text:/x:1,a=text:/y:1", r"the name 'a' is given twice"),
        ("a=files:/x:1", r"corpus 'a': files needs SRC_FILE\+TGT_FILE"),
        ("a=text:/x:1:<a b>", r"the tag of corpus 'a': must be a string without spaces"),
        ((("a-b", "text", "/x", 1.0),), r"the name of corpus 'a-b': must be a name of letters, digits and _"),
        ((("a", "text", "/x"),), r"corpus \('a', 'text', '/x'\) is not a record"),
        ((("a", "text", "/x", "1"),), r"the weight of corpus 'a': must be positive .*got '1' \(str\)"),
    ],
)
def test_malformed_corpora_are_one_error_naming_the_key(spec, message):
    with pytest.raises(ConfigError, match=r"^config key data\.corpora: .*" + message):
        CORPORA.check("data.corpora", CORPORA.split("data.corpora", spec))


def test_corpora_are_records_and_their_comma_joined_form_of_before_reads_as_them():
    records = (
        ("a", "text", "/d", 1.0, ""),
        ("b", "files", "/s.en+/t.de", 0.5, "<BT>"),
        ("c", "tfds", "wmt14_translate/de-en", 2.0, ""),
        ("g", "text", "gs://bucket/dir", 1.0, "<G>"),  # WHERE may hold ':'
    )
    joined = " a=text:/d:1 , b=files:/s.en+/t.de:0.5:<BT>,c=tfds:wmt14_translate/de-en:2,g=text:gs://bucket/dir:1:<G>"
    assert CORPORA.split("data.corpora", joined) == records  # a config saved before the key was a tuple
    assert CORPORA.split("data.corpora", (joined,)) == records  # --config.data.corpora=... (ml_collections' 1-tuple)
    from_json = [list(records[0][:4]), list(records[1]), list(records[2][:4])]  # lists; a tag may be left out
    assert CORPORA.split("data.corpora", from_json) == records[:3]
    assert CORPORA.split("data.corpora", "") == CORPORA.split("data.corpora", ()) == ()


def test_missing_empty_and_unequal_corpora_name_the_file(tmp_path):
    config = config_for(tmp_path)
    (tmp_path / "empty.en").write_text("")
    (tmp_path / "one.en").write_text("a\nb\n")
    (tmp_path / "one.de").write_text("a\n")
    cases = [
        (("text", str(tmp_path / "nowhere")), r"corpus 'x': the directory .*nowhere does not exist"),
        (("files", f"{tmp_path / 'empty.en'}+{tmp_path / 'one.de'}"), r"corpus 'x': .*empty\.en is empty"),
        (("files", f"{tmp_path / 'one.en'}+{tmp_path / 'gone.de'}"), r"corpus 'x': no file .*gone\.de"),
        (("files", f"{tmp_path / 'one.en'}+{tmp_path / 'one.de'}"), r"one\.en has 2 lines, .*one\.de has 1"),
    ]
    for (kind, where), message in cases:
        config.corpora = (("x", kind, where, 1, ""),)
        with pytest.raises(DataError, match=message):
            sources.open_corpus(config, sources.corpora(config)[0])


def test_a_corpus_without_a_pair_that_fits_is_named(tmp_path):
    write_pairs(tmp_path / "a", synthetic_pairs(50))
    write_pairs(tmp_path / "long", [(" ".join(["w"] * 60), "x y")] * 5)
    corpora = (("a", "text", str(tmp_path / "a"), 1, ""), ("long", "text", str(tmp_path / "long"), 1, ""))
    config = config_for(tmp_path / "a", corpora=corpora)
    with pytest.raises(DataError, match=r"data\.corpora: corpus 'long' has no training pair .* data\.max_len=32"):
        pipeline.make_train_iterator(config, WordTokenizer(), process_index=0, process_count=1, num_threads=1)
