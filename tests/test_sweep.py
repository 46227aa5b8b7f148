"""Sweeps: variants validated up front, run one after another, finished ones skipped, results aggregated."""

import csv
import pathlib

import pytest

from tests.training_helpers import write_corpus
from transformer_jax import sweep

CONFIG = str(pathlib.Path(__file__).resolve().parent / "tiny_sweep_config.py")


@pytest.fixture
def corpus(tmp_path, monkeypatch) -> pathlib.Path:
    path = write_corpus(tmp_path / "corpus")
    monkeypatch.setenv("TINY_CORPUS", str(path))
    return path


def test_dry_run_and_commands_list_every_variant(corpus, tmp_path, capsys):
    assert sweep.main(["--config", CONFIG, "--workdir", str(tmp_path / "sw"), "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert "base: {}" in out and 'pre_ln: {"model.norm_position": "pre"}' in out
    assert sweep.main(["--config", CONFIG, "--workdir", str(tmp_path / "sw"), "--print_commands"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "--config.model.norm_position=pre" in lines[1] and "pre_ln" in lines[1]
    assert not (tmp_path / "sw").exists()  # nothing ran


def test_misspelt_override_fails_before_anything_runs(corpus, tmp_path, capsys):
    assert sweep.main(["--config", CONFIG + ":misspelt", "--workdir", str(tmp_path / "sw")]) == 2
    assert "unknown key 'model.d_modle'" in capsys.readouterr().err
    assert not (tmp_path / "sw").exists()


def test_unknown_only_name_lists_the_variants(corpus, tmp_path, capsys):
    assert sweep.main(["--config", CONFIG, "--workdir", str(tmp_path / "sw"), "--only", "nope"]) == 2
    assert "['base', 'pre_ln']" in capsys.readouterr().err


def test_sweep_runs_skips_finished_variants_and_aggregates(corpus, tmp_path):
    workdir = tmp_path / "sw"
    assert sweep.main(["--config", CONFIG, "--workdir", str(workdir)]) == 0
    for name in ("base", "pre_ln"):
        assert (workdir / name / "config.json").exists()
        assert (workdir / name / sweep.RESULT_FILE).exists()
    rows = list(csv.DictReader(open(workdir / "results.csv")))
    assert [r["variant"] for r in rows] == ["base", "pre_ln"]
    assert rows[1]["overrides"] == "model.norm_position=pre"
    assert int(rows[1]["parameters"]) > int(rows[0]["parameters"])  # pre-LN adds two final norms
    assert all(r["steps"] == "2" and float(r["valid_perplexity"]) > 1 for r in rows)
    assert (workdir / "results.md").read_text().startswith("| variant |")
    assert (workdir / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A second run finds both finished and trains nothing.
    stamp = (workdir / "base" / "metrics.jsonl").stat().st_mtime
    assert sweep.main(["--config", CONFIG, "--workdir", str(workdir)]) == 0
    assert (workdir / "base" / "metrics.jsonl").stat().st_mtime == stamp
