"""A sweep's command line failing, and a run directory as the sweep leaves a finished, decoded run."""

from __future__ import annotations

import json
import pathlib

import pytest

from transformer_jax.evaluation.translate import score_all
from transformer_jax.sweep import __main__ as sweep
from transformer_jax.sweep.results import RESULT_FILE, VALID, Split


def fails(argv: list[str], capsys) -> str:
    """sweep.main's one-line error on stderr, after checking the exit status (2) and that no traceback came."""
    with pytest.raises(SystemExit) as exit_info:
        sweep.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"{sweep.PROG}: error: "), err
    return err


def write_run(directory: pathlib.Path, hyps: list[str], refs: list[str], perplexity: float, steps: int = 2) -> None:
    """A finished run decoded on the validation split, as the sweep leaves it."""
    directory.mkdir(parents=True)
    (directory / "metrics.jsonl").write_text(json.dumps({"step": steps, "valid_perplexity": perplexity}) + "\n")
    (directory / RESULT_FILE).write_text(json.dumps({"name": directory.name, "num_steps": steps, "wall_s": 1.0}))
    write_decode(directory, VALID, hyps, refs, steps)


def write_decode(directory: pathlib.Path, split: Split, hyps: list[str], refs: list[str], steps: int = 2) -> None:
    """A run's stored translation of a split (hypotheses and evaluate.py's report on them), as the sweep writes it."""
    (directory / split.hypotheses_file).write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    report = {"checkpoint_steps": [steps], "scores": score_all(hyps, refs)}
    (directory / split.scores_file).write_text(json.dumps(report))
