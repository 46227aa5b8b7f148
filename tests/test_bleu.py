"""Scores: sacreBLEU as the library computes it, the tokenized (compound-split) BLEU, reading files like sacrebleu."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from sacrebleu.metrics import BLEU

from transformer_jax.errors import ScoreError
from transformer_jax.evaluation import translate

SACREBLEU = str(Path(sys.executable).parent / "sacrebleu")


def test_split_compounds_is_get_ende_bleu_regex():
    assert translate.split_compounds("rich-text format") == "rich ##AT##-##AT## text format"
    # perl's s{(\S)-(\S)}{...}g does not overlap matches: in a-b-c only the first hyphen is split.
    assert translate.split_compounds("a-b-c") == "a ##AT##-##AT## b-c"
    assert translate.split_compounds("B 33-Fußgängerampel") == "B 33 ##AT##-##AT## Fußgängerampel"
    assert translate.split_compounds("x - y -z w-") == "x - y -z w-"  # a hyphen next to a space is left alone


def test_tokenized_bleu_tokenizes_then_splits_compounds():
    hyp = ["Das Haus-Boot ist groß."]
    ref = ["Das Haus-Tür ist groß."]
    # By hand: 13a separates the final period; the compound splits into three tokens.
    hand_hyp = ["Das Haus ##AT##-##AT## Boot ist groß ."]
    hand_ref = ["Das Haus ##AT##-##AT## Tür ist groß ."]
    expected = BLEU(tokenize="none").corpus_score(hand_hyp, [hand_ref]).score
    assert translate.tokenize_for_bleu(hyp) == hand_hyp  # what tokenized_bleu and the paired test score
    got = translate.tokenized_bleu(hyp, ref)
    assert got["score"] == pytest.approx(expected, abs=1e-9)
    assert got["name"] == "tokenized BLEU (tensor2tensor get_ende_bleu procedure, compound splitting)"
    # Without the splitting step the compound is one token and the score differs.
    unsplit = BLEU(tokenize="none").corpus_score(["Das Haus-Boot ist groß ."], [["Das Haus-Tür ist groß ."]]).score
    assert abs(got["score"] - unsplit) > 1.0
    assert translate.tokenized_bleu(ref, ref)["score"] == pytest.approx(100.0)


def test_sacrebleu_scores_equal_the_sacrebleu_command_and_carry_signatures(tmp_path):
    """The reference is the sacrebleu command-line tool, run on the same files: its defaults are the published ones."""
    hyps = ["The cat sat on the mat.", "A dog barked loudly at night", "Ein Haus-Boot, bitte!"]
    refs = ["The cat sat on a mat.", "A dog barked at night.", "Ein Hausboot, bitte!"]
    hyp_file, ref_file = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp_file.write_text("\n".join(hyps) + "\n", encoding="utf-8")
    ref_file.write_text("\n".join(refs) + "\n", encoding="utf-8")
    command = [SACREBLEU, str(ref_file), "-i", str(hyp_file), "-m", "bleu", "chrf", "-b", "-w", "4"]
    cli = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    cli_bleu, cli_chrf = json.loads(cli.stdout)
    scores = translate.score_files(hyp_file, ref_file)
    assert round(scores["bleu"]["score"], 4) == cli_bleu and round(scores["chrf"]["score"], 4) == cli_chrf
    assert 10 < cli_bleu < 90 and 10 < cli_chrf < 90  # neither trivial nor perfect
    assert scores["bleu"]["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    assert "nc:6|nw:0" in scores["chrf"]["signature"]
    text = translate.format_scores(scores)
    assert f"BLEU = {scores['bleu']['score']:.2f}" in text and f"chrF2 = {scores['chrf']['score']:.2f}" in text
    assert "tokenized BLEU (tensor2tensor get_ende_bleu procedure, compound splitting) = " in text


def test_ter_and_chrfpp_equal_the_sacrebleu_command_with_their_signatures(tmp_path):
    """TER and chrF++ as `sacrebleu REF -i HYP -m ter chrf --chrf-word-order 2` prints them."""
    hyps = ["The cat sat on the mat.", "A dog barked loudly at night", "Ein Haus-Boot, bitte!", ""]
    refs = ["The cat sat on a mat.", "A dog barked at night.", "Ein Hausboot, bitte!", "Nichts."]
    hyp_file, ref_file = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp_file.write_text("\n".join(hyps) + "\n", encoding="utf-8")
    ref_file.write_text("\n".join(refs) + "\n", encoding="utf-8")
    command = [SACREBLEU, str(ref_file), "-i", str(hyp_file), "-m", "ter", "chrf", "--chrf-word-order", "2", "-w", "4"]
    cli = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    printed = {entry["name"]: entry for entry in json.loads(cli.stdout)}
    scores = translate.score_files(hyp_file, ref_file)
    for key, name in (("ter", "TER"), ("chrfpp", "chrF2++")):
        assert round(scores[key]["score"], 4) == printed[name]["score"], key
        assert scores[key]["signature"] == printed[name]["signature"] and scores[key]["name"] == name
        assert 10 < scores[key]["score"] < 90  # neither trivial nor perfect
    assert scores["chrfpp"]["score"] != scores["chrf"]["score"]  # word bigrams count
    text = translate.format_scores(scores)
    assert f"TER = {scores['ter']['score']:.2f}" in text and f"chrF2++ = {scores['chrfpp']['score']:.2f}" in text


def test_read_lines_like_sacrebleu_and_line_count_check(tmp_path):
    path = tmp_path / "h.txt"
    path.write_bytes("one  \r\ntwo\u2028still two\n\nlast".encode())
    # Split at LF only (U+2028 is not a line break for sacrebleu), trailing whitespace removed, empty line kept.
    assert translate.read_lines(path) == ["one", "two\u2028still two", "", "last"]
    ref = tmp_path / "r.txt"
    ref.write_text("a\nb\n", encoding="utf-8")
    with pytest.raises(ScoreError, match=r"h\.txt has 4 lines, .*r\.txt has 2"):
        translate.score_files(path, ref)
    with pytest.raises(ScoreError, match="cannot read"):
        translate.read_lines(tmp_path / "missing.txt")


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "h.txt"
    path.write_bytes(b"fine\nfine too\n\xc3( broken\n")
    with pytest.raises(ScoreError, match=r"h\.txt, line 3: invalid UTF-8 \(invalid continuation byte, byte 1 "):
        translate.read_lines(path)


def test_nothing_to_score_is_a_clear_error_and_blank_lines_are_scored(tmp_path):
    hyp, ref = tmp_path / "h.txt", tmp_path / "r.txt"
    hyp.write_bytes(b"")
    ref.write_bytes(b"")
    with pytest.raises(ScoreError, match=r"h\.txt and .*r\.txt have no lines: nothing to score"):
        translate.score_files(hyp, ref)
    with pytest.raises(ScoreError, match="no lines: nothing to score"):
        translate.score_all([], [])
    # A blank line is a line: scored as the sacrebleu command scores it (nothing matches), not an error.
    assert translate.score_all([""], [""])["bleu"]["score"] == 0.0
    assert translate.score_all(["a b c d", ""], ["a b c d", "x y"])["bleu"]["score"] < 100.0
