"""python -m transformer_jax.data.prepare: data, tokenizer and tokenized store ready before a run; multi-host runs
refuse to train one tokenizer per host."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from tests.helpers import REPO
from tests.helpers.data import MULTIWAY_LANGS, write_multiway
from tests.helpers.training import tiny_train_config, write_corpus
from transformer_jax.data import store
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.errors import DataError
from transformer_jax.model.layers import SpecialIds


def test_prepare_writes_the_tokenizer_that_training_reuses(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    workdir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "transformer_jax.data.prepare", "--config", "tests/tiny_train_config.py",
         f"--config.data.text_dir={corpus}", "--workdir", str(workdir)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["sentences"] == {"train": 400, "valid": 24, "test": 24}
    assert report["pieces"] == 320 and pathlib.Path(report["tokenizer"]) == workdir / "spm.model"
    config = tiny_train_config(corpus)
    reused = tokenizer_lib.get_tokenizer(
        config.data, workdir, vocab_size=320, ids=SpecialIds.DEFAULT, train_if_missing=False
    )
    assert reused.path == workdir / "spm.model"
    # The tokenized training store too, which a multi-host run may only open.
    assert pathlib.Path(report["store"]) == workdir / "spm.train.en-de.store" and report["store_counts"]["pairs"] == 400
    examples, path = store.open_train_store(config.data, reused, build_if_missing=False)
    assert path == workdir / "spm.train.en-de.store" and len(examples) == 400
    assert store.verify(path)["counts"] == report["store_counts"]


def test_multi_host_run_without_a_tokenizer_says_how_to_make_one(tmp_path):
    config = tiny_train_config(write_corpus(tmp_path / "corpus"))
    with pytest.raises(DataError, match="python -m transformer_jax.data.prepare"):
        tokenizer_lib.get_tokenizer(
            config.data, tmp_path / "run", vocab_size=320, ids=SpecialIds.DEFAULT, train_if_missing=False
        )
    assert not (tmp_path / "run" / "spm.model").exists()


@pytest.mark.slow  # fast representatives: tests/test_multilingual_data.py (stores), test_multilingual_tokenizer.py
def test_prepare_of_a_multilingual_config_trains_its_tokenizer_and_stores_each_language_once(tmp_path):
    folder = write_multiway(tmp_path / "d", n=120)
    out = subprocess.run(
        [sys.executable, "-m", "transformer_jax.data.prepare", "--config", "configs/multilingual.py:size=tiny",
         f"--config.data.text_dir={folder}", "--config.model.vocab_size=283", "--workdir", str(tmp_path / "w"),
         "--verify"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(report["directions"]) == 6 and report["lines"] == {"train": 120, "valid": 120, "test": 120}
    assert (report["pieces"], report["languages"], report["verified"]) == (280, 3, True)
    assert sorted(pathlib.Path(p).name for p in report["stores"]) == [
        f"spm.train.{x}.side.store" for x in MULTIWAY_LANGS
    ]
