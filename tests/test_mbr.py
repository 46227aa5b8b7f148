"""Minimum Bayes risk decoding (evaluation/run.py's mbr_choice, evaluate.py --mbr)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sacrebleu.metrics import CHRF

from tests.helpers.decoding import one_checkpoint
from tests.helpers.fakes import reads
from transformer_jax.errors import EvalError
from transformer_jax.evaluation import run
from transformer_jax.evaluation.command import evaluate
from transformer_jax.evaluation.run import UTILITIES
from transformer_jax.evaluation.translate import parse_nbest_line

# The search's best (first) is the outlier; the consensus is the second.
CANDIDATES = ["dogs bark loudly tonight", "the cat sat on the mat", "the cat sat on a mat", "a cat sat on the mat"]


@pytest.mark.parametrize("name", UTILITIES)
def test_the_consensus_candidate_wins_over_the_first(name):
    assert run.mbr_choice(CANDIDATES, run.utility(name)) == 1


def test_expected_utility_is_the_mean_over_the_other_candidates():
    chrf = CHRF()
    expected = [sum(chrf.sentence_score(h, [r]).score for r in CANDIDATES if r is not h) / 3 for h in CANDIDATES]
    assert run.expected_utilities(CANDIDATES, run.utility("chrf")) == pytest.approx(expected)
    assert run.expected_utilities(["one"], run.utility("chrf")) == [0.0]
    assert run.mbr_choice(["same", "same"], run.utility("bleu")) == 0  # ties: the better-ranked


def _evaluate(tmp_path, **flags):
    src = tmp_path / "src.txt"
    src.write_text("hello world\n\nthe cat\n", encoding="utf-8")
    options = dict(workdir=str(tmp_path), source_file=str(src), output_file=str(tmp_path / "o" / "h"))
    one_checkpoint(tmp_path)
    return evaluate(dict(options, **flags))


def test_mbr_flag_chooses_among_the_nbest_by_expected_utility(tmp_path):
    report = _evaluate(tmp_path, mbr=2, mbr_utility="chrf")
    out = tmp_path / "o" / "h"
    entries = [parse_nbest_line(x) for x in Path(f"{out}.nbest").read_text(encoding="utf-8").splitlines()]
    chosen = out.read_text(encoding="utf-8").splitlines()
    u = run.utility("chrf")
    for i, line in enumerate(chosen):
        candidates = [text for j, text, *_ in entries if j == i]
        assert len(candidates) == 2 and line == candidates[run.mbr_choice(candidates, u)]
    assert report["search"]["mbr_utility"] == "chrf" and report["search"]["nbest"] == 2


@pytest.mark.parametrize(
    ("flags", "message", "loaded"),
    [
        (dict(mbr=1), r"--mbr 1: choose among at least 2", 0),
        # The beam size comes from the checkpoint's config, so this one is found once the checkpoint is read.
        (dict(mbr=3), r"--mbr 3 must be between 1 and the beam size \(2\)", 1),
        (dict(mbr=2, mbr_utility="ter"), r"--mbr_utility 'ter': choose one of bleu, chrf", 0),
        (dict(mbr=2, nbest=2), r"--nbest would be ignored", 0),
        (dict(mbr_utility="bleu"), r"--mbr_utility goes with --mbr", 0),
    ],
)
def test_bad_mbr_flags_are_refused_and_nothing_is_written(tmp_path, monkeypatch, flags, message, loaded):
    read = reads(monkeypatch)
    with pytest.raises(EvalError, match=message):
        _evaluate(tmp_path, **flags)
    assert not (tmp_path / "o").exists() and len(read) == loaded
