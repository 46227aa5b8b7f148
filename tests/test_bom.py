"""A UTF-8 byte-order mark (Windows editors write one): dropped from every model input, kept with one warning in
files that are only scored, as the sacrebleu command reads them."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.fakes import WordTokenizer
from transformer_jax.data import batching, sources
from transformer_jax.evaluation import run
from transformer_jax.evaluation.translate import read_lines, score_files

BOM = b"\xef\xbb\xbf"
SOURCES = "Ein Mann läuft.\r\nZwei Hunde\n"
LINES = ["Ein Mann läuft.", "Zwei Hunde"]


def test_a_source_file_with_a_bom_reads_and_encodes_as_without(tmp_path):
    plain, marked = tmp_path / "plain.de", tmp_path / "marked.de"
    plain.write_bytes(SOURCES.encode())
    marked.write_bytes(BOM + SOURCES.encode())
    assert run.read_sources(str(marked)) == run.read_sources(str(plain)) == LINES
    tok = WordTokenizer()
    assert tok.encode_source_batch(run.read_sources(str(marked))) == tok.encode_source_batch(LINES)


def test_stdin_drops_a_bom_before_its_first_line_only(monkeypatch):
    data = BOM + b"erste\n" + BOM + b"zweite\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), "utf-8"))
    assert list(run.stdin_lines()) == ["erste", "\ufeffzweite"]  # a mark inside the text is the text's


def test_a_training_corpus_with_a_bom_gives_the_pairs_and_ids_of_one_without(tmp_path):
    for name, prefix in (("plain", b""), ("marked", BOM)):
        directory = tmp_path / name
        directory.mkdir()
        (directory / "train.de").write_bytes(prefix + SOURCES.encode())
        (directory / "train.en").write_bytes(prefix + b"A man runs.\nTwo dogs\n")
    plain, _ = sources.read_text_split(tmp_path / "plain", "train", "de", "en")
    marked, _ = sources.read_text_split(tmp_path / "marked", "train", "de", "en")
    assert marked == plain and plain[0][0] == LINES[0]
    tok = WordTokenizer()
    a, b = batching.tokenize_pairs(plain, tok), batching.tokenize_pairs(marked, tok)
    assert a.src.tolist() == b.src.tolist() and a.tgt.tolist() == b.tgt.tolist()


def test_invalid_utf8_after_a_bom_still_names_its_line_and_byte(tmp_path):
    path = tmp_path / "bad.de"
    path.write_bytes(BOM + b"gut\nschlecht \xff\n")
    with pytest.raises(sources.DataError, match=r"bad\.de, line 2: invalid UTF-8 .* at byte 16\)"):
        list(sources.iter_lines(path))


def _sacrebleu_cli(ref: Path, hyp: Path, metric: str) -> float:
    command = [sys.executable, "-m", "sacrebleu", str(ref), "-i", str(hyp), "-m", metric, "-b", "-w", "4"]
    return float(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


def test_a_reference_with_a_bom_warns_once_and_scores_as_the_sacrebleu_command(tmp_path, caplog):
    hyp, ref = tmp_path / "hyp.de", tmp_path / "ref.de"
    text = "der Mann läuft schnell über die große Straße\nzwei kleine Hunde spielen im grünen Park\n"
    hyp.write_text(text, encoding="utf-8")
    ref.write_bytes(BOM + text.encode())
    with caplog.at_level(logging.WARNING):
        lines = read_lines(ref)
    warnings = [r for r in caplog.records if "byte-order mark" in r.getMessage()]
    assert len(warnings) == 1 and str(ref) in warnings[0].getMessage()
    assert lines[0].startswith("\ufeff")  # what sacrebleu's command reads
    scores = score_files(hyp, ref)
    assert scores["chrf"]["score"] < 100  # the mark costs the first line its match, as in the command
    for key, metric in (("bleu", "bleu"), ("chrf", "chrf")):
        assert round(scores[key]["score"], 4) == pytest.approx(_sacrebleu_cli(ref, hyp, metric), abs=1e-4)
