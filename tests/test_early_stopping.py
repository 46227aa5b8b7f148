"""Early stopping on a scripted sequence of validation scores (the trainer receives validation as a function): the
run stops after train.early_stop_patience validations without improvement, names the best step, and a restart of
the stopped run does not train unless train.num_steps or the patience was raised."""

from __future__ import annotations

import logging
import pathlib
import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO
from tests.helpers.training import scripted, tiny_train_config
from transformer_jax import cli
from transformer_jax.training import checkpoints
from transformer_jax.training.loop import train_and_evaluate
from transformer_jax.training.metrics import read_metrics


def stopping_config(corpus: pathlib.Path, num_steps: int = 20, patience: int = 2, metric: str = "valid_bleu"):
    config = tiny_train_config(
        corpus, num_steps=num_steps, eval_every=2, select_metric=metric, early_stop_patience=patience
    )
    config.ckpt.every_steps = 100  # only the improvements and the stop are saved
    cli.validate(config)
    return config


def train_steps(workdir: pathlib.Path) -> list[int]:
    return sorted(r["step"] for r in read_metrics(workdir / "metrics.jsonl") if "loss" in r and "valid_loss" not in r)


@pytest.fixture(scope="module")
def stopped(corpus, tmp_path_factory) -> pathlib.Path:
    """BLEU 10, 20, 15, 18 at steps 2, 4, 6, 8: best at 4, two validations without improvement, stop at 8."""
    workdir = tmp_path_factory.mktemp("stopped")
    train_and_evaluate(stopping_config(corpus), workdir, bleu=scripted([10, 20, 15, 18, 99, 99]))
    return workdir


def test_early_stopping_fires_after_the_patience_and_keeps_the_best(stopped):
    assert max(train_steps(stopped)) == 8  # of 20
    assert checkpoints.list_steps(stopped) == [2, 4, 8]  # improvements at 2 and 4, the stop at 8
    assert checkpoints.best_steps(stopped)[0] == 4


def test_the_stop_names_the_best_step_and_its_score(corpus, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        train_and_evaluate(stopping_config(corpus), tmp_path / "w", bleu=scripted([10, 20, 15, 18]))
    assert "early stopping at step 8" in caplog.text
    assert "the best step is 4 with valid_bleu=20.0000" in caplog.text


def test_a_restart_of_a_stopped_run_does_not_train(corpus, stopped, tmp_path, caplog):
    workdir = tmp_path / "w"
    shutil.copytree(stopped, workdir)
    calls: list[int] = []
    with caplog.at_level(logging.WARNING):
        train_and_evaluate(stopping_config(corpus), workdir, bleu=scripted([99], calls))
    assert max(train_steps(workdir)) == 8 and not calls and checkpoints.list_steps(workdir) == [2, 4, 8]
    assert "stopped early at step 8" in caplog.text
    assert "raise train.num_steps or train.early_stop_patience" in caplog.text


def test_a_raised_patience_trains_on_from_the_stop(corpus, stopped, tmp_path):
    workdir = tmp_path / "w"
    shutil.copytree(stopped, workdir)
    # Patience 4: two more validations without improvement (16, 17 < 20) stop it at step 12.
    train_and_evaluate(stopping_config(corpus, patience=4), workdir, bleu=scripted([16, 17, 99]))
    assert max(train_steps(workdir)) == 12
    assert checkpoints.list_steps(workdir)[-1] == 12 and checkpoints.best_steps(workdir)[0] == 4


@pytest.mark.slow  # trimmed from the default run: the file keeps a fast representative
def test_a_raised_num_steps_trains_on_with_a_fresh_patience(corpus, stopped, tmp_path):
    workdir = tmp_path / "w"
    shutil.copytree(stopped, workdir)
    train_and_evaluate(stopping_config(corpus, num_steps=24), workdir, bleu=scripted([16, 17, 99]))
    assert max(train_steps(workdir)) == 12


def test_validation_loss_selects_and_stops_without_decoding(corpus, tmp_path):
    """valid_loss (lower is better) needs no translation: no BLEU function at all."""
    config = stopping_config(corpus, num_steps=6, patience=1, metric="valid_loss")
    config.ckpt.keep_best = 1
    train_and_evaluate(config, tmp_path / "w")
    losses = {r["step"]: r["valid_loss"] for r in read_metrics(tmp_path / "w" / "metrics.jsonl") if "valid_loss" in r}
    steps = sorted(losses)
    # Patience 1: the first validation whose loss is not below every earlier one stops the run (or step 6 ends it).
    stop = next((s for i, s in enumerate(steps) if i and losses[s] >= min(losses[t] for t in steps[:i])), 6)
    assert max(train_steps(tmp_path / "w")) == stop and max(steps) == stop
    assert checkpoints.best_steps(tmp_path / "w")[0] == min(steps, key=losses.get)


# In-process: tests/test_selection.py's test_keep_best_and_early_stopping_without_validation_are_refused; train.py's
# one line for a cli.validate refusal before any work: tests/test_cli_errors.py's train.py-3.
@pytest.mark.slow
def test_train_py_refuses_early_stopping_without_validation_in_one_line(corpus, tmp_path):
    command = [
        sys.executable,
        str(REPO / "train.py"),
        "--config",
        str(REPO / "tests" / "tiny_train_config.py"),
        f"--config.data.text_dir={corpus}",
        "--config.train.eval_every=0",
        "--config.train.early_stop_patience=3",
        "--workdir",
        str(tmp_path / "w"),
    ]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "config key train.early_stop_patience=3 needs a validation" in lines[0]
    assert not (tmp_path / "w" / "checkpoints").exists()


@pytest.mark.slow  # trimmed from the default run: the file keeps a fast representative
def test_a_sweep_variant_that_stopped_early_is_finished(corpus, tmp_path, monkeypatch):
    """The sweep treats a variant that early stopping ended as finished: it writes its result (with the step) and
    a rerun skips it, instead of calling it interrupted forever."""
    from transformer_jax.sweep import runner

    monkeypatch.setattr(runner, "bleu_evaluator", scripted([10, 20, 15, 18, 99, 99]))
    config = stopping_config(corpus)
    result = runner.run_variant("v", config, tmp_path / "v")
    assert result["stopped_early_at"] == 8 and result["num_steps"] == 20
    assert runner.run_variant("v", config, tmp_path / "v") == result  # finished: skipped
