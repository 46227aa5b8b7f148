"""A tiny many-to-many run end to end: one model, three languages, six directions, language tokens, validation per
direction; a restart must keep the language token scheme."""

import json
import os
import shutil
import subprocess
import sys

import ml_collections
import pytest

from tests.helpers.data import write_multiway
from tests.helpers.training import tiny_train_config
from transformer_jax.data import languages
from transformer_jax.errors import CheckpointError
from transformer_jax.evaluation.translate import bleu_evaluator
from transformer_jax.training.checkpoints import load_config
from transformer_jax.training.loop import train_and_evaluate

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def many_to_many_config(text_dir, **train) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict(tiny_train_config(text_dir, **train).to_dict())
    config.model.vocab_size = 283  # 280 pieces (byte fallback takes 256) and the three languages
    config.model.lang_token = "target"
    config.data.directions = ("all",)
    config.data.temperature = 5.0
    config.data.tokenizer_type = "bpe"
    return config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(config, workdir) of a 6-step many-to-many run with validation loss and BLEU at its end, shared by the tests
    below: each reads it or copies it."""
    root = tmp_path_factory.mktemp("m2m")
    config = many_to_many_config(
        write_multiway(root / "d", n=60), num_steps=6, eval_every=6, bleu_every=6, bleu_sentences=2
    )
    train_and_evaluate(config, root / "run", bleu=bleu_evaluator)
    return config, root / "run"


def test_a_tiny_many_to_many_run_trains_every_direction_and_validates_each(trained):
    config, workdir = trained
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    names = languages.expand_config(config).data.directions
    assert len(names) == 6 and load_config(workdir).data.directions == names  # saved explicit
    trained_on = {k for r in records for k in r if k.startswith("tokens_") and k[len("tokens_") :] in names}
    assert trained_on == {f"tokens_{n}" for n in names}
    last = {k: v for r in records if r["step"] == 6 for k, v in r.items()}  # the final step's records together
    for name in names:
        assert f"valid_{name}_loss" in last and f"valid_{name}_bleu" in last
    assert last["valid_loss"] == pytest.approx(sum(last[f"valid_{n}_loss"] for n in names) / len(names))


def test_a_restart_with_another_language_token_scheme_is_refused_in_one_line(trained, tmp_path):
    config, workdir = trained
    shutil.copytree(workdir, tmp_path / "run")
    changed = ml_collections.ConfigDict(config.to_dict())
    changed.model.lang_token = "source"
    changed.train.num_steps = 9
    with pytest.raises(CheckpointError, match="model.lang_token: .target. -> .source."):
        train_and_evaluate(changed, tmp_path / "run", bleu=bleu_evaluator)


def test_evaluate_translates_the_trained_model_into_the_language_asked_for(trained):
    from transformer_jax.evaluation import run
    from transformer_jax.evaluation.restore import CheckpointChoice

    _, workdir = trained
    seen = set()
    for src, tgt in (("en", "de"), ("en", "cs")):
        model = run.Model(str(workdir), choice=CheckpointChoice(average_last=1), target_lang=tgt, source_lang=src)
        mode = run.Translate(model, split="test", decoding=run.Decoding(beam_size=1, max_len=8))
        loaded = run.load(mode)
        assert loaded.name == f"test(test.{src}-{tgt})" and loaded.references[0].startswith(tgt)
        seen.add(loaded.language_ids)
        assert len(run.translate(mode, loaded).hypotheses) == len(loaded.sources)
    assert len(seen) == 2  # each direction forces its own target token


@pytest.mark.slow
def test_train_py_refuses_a_direction_the_folder_lacks(tmp_path):
    text_dir = write_multiway(tmp_path / "d", n=20)
    args = [
        sys.executable,
        "train.py",
        "--config",
        "configs/multilingual.py:size=tiny",
        "--workdir",
        str(tmp_path / "w"),
        f"--config.data.text_dir={text_dir}",
        "--config.data.directions=en-fr",
    ]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "has no language 'fr'" in done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "w").exists() or not any((tmp_path / "w").iterdir())
