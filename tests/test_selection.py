"""Best checkpoints by a validation score: saved when a validation improves, kept apart from ckpt.keep's rotation
(Orbax's BestN with LatestN), across restarts; --checkpoint best and --average_best restore them."""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import numpy as np
import pytest

from tests.helpers.training import scripted, tiny_train_config
from transformer_jax import cli
from transformer_jax.errors import ConfigError, EvalError
from transformer_jax.evaluation import restore
from transformer_jax.training import bookkeeping, checkpoints
from transformer_jax.training.loop import train_and_evaluate
from transformer_jax.training.metrics import read_metrics
from transformer_jax.training.step import abstract_train_state


def selecting_config(corpus: pathlib.Path, num_steps: int, **ckpt):
    config = tiny_train_config(corpus, num_steps=num_steps, eval_every=2, select_metric="valid_bleu")
    config.ckpt.update({"every_steps": 6, "keep": 1, "keep_best": 2, **ckpt})
    cli.validate(config)
    return config


@pytest.fixture(scope="module")
def selected(corpus, tmp_path_factory) -> pathlib.Path:
    """12 steps validated every 2 with BLEU 10, 30, 20, 25, 5, 1: improvements at 2 and 4, checkpoints due at 6
    and 12; the last one (ckpt.keep=1) and the two best scored (4, 6) stay."""
    workdir = tmp_path_factory.mktemp("selected")
    train_and_evaluate(selecting_config(corpus, 12), workdir, bleu=scripted([10, 30, 20, 25, 5, 1]))
    return workdir


def test_best_checkpoints_survive_the_rotation_with_their_scores(selected):
    assert checkpoints.list_steps(selected) == [4, 6, 12]
    assert checkpoints.best_scores(selected) == [(4, 30.0), (6, 20.0), (12, 1.0)]
    assert checkpoints.best_steps(selected) == [4, 6, 12]
    # The scores are stored beside each checkpoint (Orbax's metrics item), every validation score of that step.
    saved = json.loads((checkpoints.checkpoint_dir(selected) / "4" / "metrics" / "metrics").read_text())
    assert saved["valid_bleu"] == 30.0 and "valid_loss" in saved
    # Step 8 (25) neither improved on 30 nor was due a checkpoint: it was never saved.
    bleu = {r["step"]: r["valid_bleu"] for r in read_metrics(selected / "metrics.jsonl") if "valid_bleu" in r}
    assert bleu == {2: 10.0, 4: 30.0, 6: 20.0, 8: 25.0, 10: 5.0, 12: 1.0}


def test_best_checkpoints_survive_a_restart_and_the_rotation_after_it(corpus, selected, tmp_path):
    workdir = tmp_path / "w"
    shutil.copytree(selected, workdir)
    # Steps 14 and 16 score 40 and 2: 14 is the new best, 6 falls out of the two best, 4 stays.
    train_and_evaluate(selecting_config(corpus, 16), workdir, bleu=scripted([40, 2]))
    assert checkpoints.list_steps(workdir) == [4, 14, 16]
    assert checkpoints.best_steps(workdir)[:2] == [14, 4]


def test_lower_is_better_for_ter_and_loss(tmp_path):
    record = bookkeeping.SelectionRecord("valid_ter")
    assert record.update(2, 50.0) and record.update(4, 40.0) and not record.update(6, 45.0)
    assert (record.best_step, record.best_score, record.since_best) == (4, 40.0, 1)
    record = bookkeeping.SelectionRecord("valid_bleu")
    assert record.update(2, 10.0) and not record.update(4, 5.0) and record.update(6, 11.0)


def test_a_nan_score_never_outranks_a_real_one(corpus, tmp_path):
    """BLEU 10, 30, NaN, 25, NaN, 1 at steps 2-12, checkpoints due at 6 (NaN) and 12: the one best kept is step 4's
    30; a NaN among the scores Orbax sorts would make its choice of what to delete arbitrary."""
    assert bookkeeping.rank({"valid_bleu": float("nan")}, "valid_bleu") == bookkeeping.worst("valid_bleu")
    assert bookkeeping.rank({}, "valid_loss") == bookkeeping.worst("valid_loss") == float("inf")
    workdir = tmp_path / "w"
    nan = float("nan")
    train_and_evaluate(selecting_config(corpus, 12, keep_best=1), workdir, bleu=scripted([10, 30, nan, 25, nan, 1]))
    assert checkpoints.list_steps(workdir) == [4, 12]
    assert checkpoints.best_steps(workdir)[0] == 4


def test_keep_best_and_early_stopping_without_validation_are_refused(corpus):
    for key, value in (("ckpt.keep_best", 3), ("train.early_stop_patience", 2)):
        config = tiny_train_config(corpus, eval_every=0)
        group, leaf = key.split(".")
        config[group][leaf] = value
        with pytest.raises(ConfigError, match=rf"^config key {key}={value} needs a validation.*train\.eval_every=0"):
            cli.validate(config)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("tatoeba", r"'tatoeba' is not NAME=TEXT_DIR\[:SPLIT\]"),
        ("a=/x,a=/y:dev", "given twice"),
        ("=/x", "the name of validation set '': must be a name of letters"),
        ((("t", ""),), "the text_dir of validation set 't': must be a non-empty string"),
    ],
)
def test_malformed_extra_validation_sets_are_refused(corpus, spec, message):
    config = tiny_train_config(corpus).to_dict()  # a plain dict takes the string form as a config saved before did
    config["eval"]["extra_valid"] = spec
    with pytest.raises(ConfigError, match=rf"^config key eval\.extra_valid: .*{message}"):
        cli.validate(config)


def test_extra_validation_sets_are_records_or_their_comma_joined_form_of_before(corpus):
    config = tiny_train_config(corpus, eval_every=2)
    config.eval.extra_valid = ("t=/d/tatoeba:dev, m=/d/m",)  # --config.eval.extra_valid=t=/d/tatoeba:dev,m=/d/m
    cli.validate(config)
    assert config.eval.extra_valid == (("t", "/d/tatoeba", "dev"), ("m", "/d/m", "valid"))
    config.eval.extra_valid = (("t", "/d/tatoeba", "dev"), ("m", "/d/m"))  # the split may be left out
    cli.validate(config)
    assert config.eval.extra_valid == (("t", "/d/tatoeba", "dev"), ("m", "/d/m", "valid"))


def test_extra_validation_sets_are_reported_beside_the_selecting_one(corpus, tmp_path):
    config = tiny_train_config(corpus, num_steps=2, eval_every=2, bleu_every=2, bleu_sentences=3)
    config.eval.extra_valid = (("other", str(corpus), "test"),)
    from transformer_jax.evaluation.translate import bleu_evaluator

    train_and_evaluate(config, tmp_path / "w", bleu=bleu_evaluator)
    record = {k: v for r in read_metrics(tmp_path / "w" / "metrics.jsonl") if r["step"] == 2 for k, v in r.items()}
    for name in ("loss", "bleu", "chrf", "chrfpp", "ter"):
        assert f"valid_{name}" in record and f"valid_other_{name}" in record, name
    assert record["valid_loss"] != record["valid_other_loss"]  # another set: another loss


def _params(workdir: pathlib.Path, config, step: int) -> list[np.ndarray]:
    _, abstract = abstract_train_state(config)
    return [np.asarray(x) for x in jax.tree.leaves(checkpoints.load_model_params(workdir, step, abstract))]


def test_checkpoint_best_and_average_best_restore_the_best_steps(selected):
    config = checkpoints.load_config(selected)
    _, model, steps = restore.restore_model(str(selected), restore.CheckpointChoice("best"))
    assert steps == [4]
    _, _, steps = restore.restore_model(str(selected), restore.CheckpointChoice(average_best=2))
    assert steps == [4, 6]
    from flax import nnx

    from transformer_jax.evaluation.restore import average_params

    restored = [np.asarray(x) for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))]
    assert all(np.array_equal(a, b) for a, b in zip(restored, _params(selected, config, 4), strict=True))
    _, averaged, _ = restore.restore_model(str(selected), restore.CheckpointChoice(average_best=2))
    _, abstract = abstract_train_state(config)
    expected = average_params(checkpoints.load_model_params(selected, s, abstract) for s in (4, 6))
    got = nnx.to_pure_dict(nnx.state(averaged, nnx.Param))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True))


def test_average_last_takes_the_rotations_checkpoints_never_the_best_kept_apart(selected):
    """Steps 4, 6, 12 with ckpt.keep=1: 4 and 6 are kept for their scores alone, so the last one is 12 and the last
    two do not exist (averaging 6 with 12 would mix a best checkpoint into "the last")."""
    assert restore.restore_model(str(selected), restore.CheckpointChoice(average_last=1))[2] == [12]
    with pytest.raises(EvalError, match=r"the last 2 checkpoints up to step 12, but only 1 exist"):
        restore.restore_model(str(selected), restore.CheckpointChoice(average_last=2))


def test_a_damaged_best_checkpoint_falls_back_to_the_next_best(selected, tmp_path, caplog):
    workdir = tmp_path / "w"
    shutil.copytree(selected, workdir)
    for array in (checkpoints.checkpoint_dir(workdir) / "4" / "state").rglob("*"):
        if array.is_file() and array.parent.name == "d":
            array.write_bytes(b"\0" * array.stat().st_size)  # the arrays' data, zeroed: checksums differ
    _, _, steps = restore.restore_model(str(workdir), restore.CheckpointChoice("best"))
    assert steps == [6]
    assert "step 4" in caplog.text


def test_a_damaged_score_file_is_skipped_by_readers_and_moved_aside_by_a_restart(corpus, selected, tmp_path, caplog):
    workdir = tmp_path / "w"
    shutil.copytree(selected, workdir)
    (checkpoints.checkpoint_dir(workdir) / "4" / "metrics" / "metrics").write_text('{"valid_bl')  # truncated
    assert checkpoints.best_steps(workdir) == [6, 12]  # the reader reports it and ranks the others
    assert "scores of the checkpoint at step 4 cannot be read" in caplog.text
    train_and_evaluate(selecting_config(corpus, 14), workdir, bleu=scripted([0]))
    assert checkpoints.list_steps(workdir) == [6, 12, 14]
    assert [p.name.split(".")[0] for p in checkpoints.checkpoint_dir(workdir).glob("4.damaged-*")] == ["4"]


def test_more_best_checkpoints_than_scored_is_one_line(selected):
    with pytest.raises(
        EvalError, match=r"^--average_best 4: only 3 scored checkpoint\(s\) .*\[4, 6, 12\]; pass --average_best 3"
    ):
        restore.restore_model(str(selected), restore.CheckpointChoice(average_best=4))


def test_checkpoint_best_without_a_best_record_is_one_line(corpus, tmp_path):
    workdir = tmp_path / "plain"
    train_and_evaluate(tiny_train_config(corpus, num_steps=3), workdir)
    with pytest.raises(EvalError, match=r"^--checkpoint best: no checkpoint in .*plain.* has a score of "):
        restore.restore_model(str(workdir), restore.CheckpointChoice("best"))
