"""Sweep statistics from stored hypotheses: the seed-pooled paired bootstrap, p-value marks, the paper-direction
verdict, and decoding the validation split after training (resuming runs finished before that step existed).

Run directories are written by hand here (hypotheses, scores, metrics), so no test in this file trains a model.
"""

from __future__ import annotations

import csv
import json
import os
import pathlib
import random
import shutil
import signal

import pytest
from sacrebleu.metrics import BLEU, CHRF

from tests.helpers.sweeps import fails, write_decode, write_run
from transformer_jax.errors import ScoreError
from transformer_jax.evaluation import significance
from transformer_jax.evaluation.run import Translation
from transformer_jax.sweep import __main__ as sweep
from transformer_jax.sweep import results, runner
from transformer_jax.sweep.results import RESULT_FILE, TEST, VALID, aggregate_seeds, run_metrics
from transformer_jax.training import loop

CONFIG = str(pathlib.Path(__file__).resolve().parent / "tiny_sweep_config.py")
WORDS = "der die das ein eine Hund Katze Mann Frau läuft springt sitzt über den Zaun im Park auf dem Rasen".split()


pytestmark = pytest.mark.usefixtures("tiny_corpus_env")  # the conftest corpus, where the sweep's config reads it


def noisy(refs: list[str], p: float, seed: int) -> list[str]:
    """The references with each word replaced by a random one with probability p: a system of known quality."""
    rng = random.Random(seed)
    return [" ".join(w if rng.random() > p else rng.choice(WORDS) for w in line.split()) for line in refs]


REFS = noisy([" ".join(random.Random(i).choices(WORDS, k=3 + i % 8)) for i in range(60)], 0.0, 0)


def test_with_one_seed_the_pooled_bootstrap_is_sacrebleus_paired_bootstrap():
    a, b = noisy(REFS, 0.5, 1), noisy(REFS, 0.3, 2)
    pooled, plain = significance.pooled_paired_bootstrap([a], [b], REFS), significance.paired_bootstrap(a, b, REFS)
    for key in ("bleu", "chrf"):
        assert pooled[key] == plain[key]  # scores, bootstrap means and intervals, p-value, signature


def test_pooled_scores_are_the_corpus_scores_of_all_seeds_together():
    base = [noisy(REFS, 0.5, s) for s in (1, 2)]
    system = [noisy(REFS, 0.3, s) for s in (3, 4)]
    result = significance.pooled_paired_bootstrap(base, system, REFS)
    assert result["seeds"] == 2
    assert result["bleu"]["system"]["score"] == pytest.approx(
        BLEU().corpus_score(system[0] + system[1], [REFS * 2]).score
    )
    assert result["chrf"]["baseline"]["score"] == pytest.approx(
        CHRF().corpus_score(base[0] + base[1], [REFS * 2]).score
    )
    with pytest.raises(ScoreError, match="system seed 1 has 59 lines, the references 60"):
        significance.pooled_paired_bootstrap(base, [system[0], system[1][1:]], REFS)
    with pytest.raises(ScoreError, match="seeds to pair: baseline 2, system 1"):
        significance.pooled_paired_bootstrap(base, system[:1], REFS)


def test_a_sentences_seeds_are_resampled_together():
    """Two seeds that wrote the same lines carry no more evidence than one: the p-value stays that of one seed.
    Resampling the 2N (sentence, seed) lines independently would count each sentence twice and lower it."""
    a, b = noisy(REFS, 0.5, 1), noisy(REFS, 0.4, 2)
    one, two = (
        significance.pooled_paired_bootstrap([a], [b], REFS),
        significance.pooled_paired_bootstrap([a, a], [b, b], REFS),
    )
    assert 0.01 < one["bleu"]["p_value"] == two["bleu"]["p_value"]
    assert one["chrf"]["p_value"] == two["chrf"]["p_value"]
    assert significance.paired_bootstrap(a + a, b + b, REFS * 2)["bleu"]["p_value"] < one["bleu"]["p_value"]
    # Every seed's lines count in every resample: the order of the seeds changes nothing.
    a2, b2 = noisy(REFS, 0.5, 3), noisy(REFS, 0.4, 4)
    forward = significance.pooled_paired_bootstrap([a, a2], [b, b2], REFS)
    backward = significance.pooled_paired_bootstrap([a2, a], [b2, b], REFS)
    for key in ("bleu", "chrf"):
        assert forward[key]["system"]["mean"] == pytest.approx(backward[key]["system"]["mean"], abs=1e-4)
        assert forward[key]["p_value"] == backward[key]["p_value"]


@pytest.mark.parametrize(
    "ours,paper,significant,verdict",
    [(1.0, 0.5, True, "yes"), (-1.0, 0.5, True, "no"), (1.0, 0.0, True, "no"), (-1.0, 0.5, False, "not significant")],
)
def test_direction(ours, paper, significant, verdict):
    assert results.direction(ours, paper, significant) == verdict


def _rows(tmp_path: pathlib.Path, systems: dict[str, list[list[str] | None]], refs: list[str]):
    """aggregate_seeds rows and finished run directories of synthetic variants; None: a seed that did not finish."""
    entries, finished = [], []
    for name, seeds in systems.items():
        dirs = []
        for i, hyps in enumerate(seeds):
            if hyps is not None:
                write_run(tmp_path / name / f"seed{i}", hyps, refs, perplexity=10.0 + i)
            dirs.append(tmp_path / name / f"seed{i}")
        runs = [run_metrics(d, VALID) for d in dirs]
        entries.append({"variant": name, "overrides": "(none)", "parameters": 1, "runs": runs})
        finished.append([d if r["finished"] else None for d, r in zip(dirs, runs, strict=True)])
    return aggregate_seeds(entries, 3, VALID), finished


def test_p_values_on_systems_with_known_answers(tmp_path):
    base = [noisy(REFS, 0.5, s) for s in range(3)]
    rows, finished = _rows(
        tmp_path,
        {
            "base": base,
            "same": base,  # identical outputs: no difference at all
            "alike": [noisy(REFS, 0.5, s) for s in (10, 11, 12)],  # other lines of the same quality
            "perfect": [REFS, REFS, None],  # equal to the references; seed 2 missing
        },
        REFS,
    )
    rows = results.add_significance(rows, finished, [REFS] * 4, VALID)
    by_name = {r["variant"]: r for r in rows}
    assert by_name["base"]["bleu_p"] == "" and by_name["base"]["paired_seeds"] == ""
    assert (by_name["same"]["bleu_p"], by_name["same"]["chrf_p"], by_name["same"]["paired_seeds"]) == (1.0, 1.0, 3)
    assert by_name["alike"]["bleu_p"] > 0.05 and by_name["alike"]["chrf_p"] > 0.05
    perfect = by_name["perfect"]
    assert perfect["bleu_p"] < 0.05 and perfect["chrf_p"] < 0.05 and perfect["paired_seeds"] == 2
    assert perfect["n_seeds"] == 2 and perfect["missing_seeds"] == "2"
    assert results.format_p(perfect["bleu_p"]).endswith(" †")
    assert results.format_p(0.5) == "0.500" and results.format_p("") == ""
    # No paper numbers: no verdict.
    assert all(r["paper_direction"] == "" for r in rows)


def test_paper_direction_by_bleu_and_by_perplexity(tmp_path):
    base = [noisy(REFS, 0.5, s) for s in range(3)]
    rows, finished = _rows(
        tmp_path,
        {
            "base": base,
            "better": [REFS] * 3,
            "same": base,
            "ppl_only": base,
            "one_seed": [REFS, None, None],
            "not_run": [None] * 3,
        },
        REFS,
    )
    papers = {
        "base": (5.0, 25.0),
        "better": (5.5, 24.0),
        "same": (4.0, 27.0),
        "ppl_only": (6.0, ""),
        "one_seed": (6.0, ""),
        "not_run": (6.0, 24.0),
    }
    for row in rows:
        row["ref_valid_perplexity"], row["ref_valid_bleu"] = papers[row["variant"]]
    rows[3]["delta_valid_perplexity"] = 2.0  # ppl_only: a significant rise, as the paper's 5.0 -> 6.0
    rows[3]["delta_valid_perplexity_ci95_low"], rows[3]["delta_valid_perplexity_ci95_high"] = 0.5, 3.5
    seeds_disagree = dict(rows[1], variant="seeds_disagree")  # as "better", but the seeds' Δ BLEU interval has 0
    seeds_disagree["delta_valid_bleu_ci95_low"], seeds_disagree["delta_valid_bleu_ci95_high"] = -1.0, 4.0
    rows.insert(2, seeds_disagree)
    finished.insert(2, finished[1])
    rows = results.add_significance(rows, finished, [REFS] * 6 + [None], VALID)
    verdicts = {r["variant"]: (r["paper_direction"], r["paper_direction_by"]) for r in rows}
    assert rows[2]["bleu_p"] < 0.05
    assert verdicts == {
        "base": ("", ""),
        "better": ("no", "bleu"),  # significantly better here, worse in the paper
        "seeds_disagree": ("not significant", "bleu"),  # p < 0.05 over sentences, but not over seeds
        "same": ("not significant", "bleu"),
        "ppl_only": ("yes", "perplexity"),
        "one_seed": ("untested", "perplexity"),  # one seed: no interval
        "not_run": ("", ""),  # nothing finished yet: nothing to judge
    }


def test_a_hypothesis_file_of_the_wrong_length_is_one_clear_error(tmp_path):
    rows, finished = _rows(tmp_path, {"base": [REFS], "v": [REFS]}, REFS)
    (tmp_path / "v" / "seed0" / VALID.hypotheses_file).write_text("one line\n")
    with pytest.raises(ScoreError, match=r"v/seed0/valid.hyp has 1 lines, the validation split 60; delete .*valid_sco"):
        results.add_significance(rows, finished, [REFS, REFS], VALID)


def _tiny_refs(corpus: pathlib.Path) -> list[str]:
    return (corpus / "valid.de").read_text(encoding="utf-8").splitlines()


def test_aggregate_only_recomputes_the_tests_from_stored_hypotheses(corpus, tmp_path, monkeypatch):
    """--aggregate_only neither trains nor decodes; the table gets p-values, marks and the paper verdicts."""
    monkeypatch.setattr(loop, "train_and_evaluate", lambda *a: pytest.fail("trained"))
    monkeypatch.setattr(runner, "translate", lambda *a: pytest.fail("decoded"))
    refs = _tiny_refs(corpus)
    workdir = tmp_path / "sw"
    for i in range(3):
        write_run(workdir / "base" / f"seed{i}", noisy(refs, 0.6, i), refs, perplexity=9.0 + i)
        if i < 2:  # pre_ln's seed 2 never finished
            write_run(workdir / "pre_ln" / f"seed{i}", refs, refs, perplexity=3.0 + i)
    assert sweep.main(["--config", CONFIG, "--workdir", str(workdir), "--seeds", "3", "--aggregate_only"]) == 0
    rows = list(csv.DictReader(open(workdir / "results.csv")))
    assert [r["paired_seeds"] for r in rows] == ["", "2"] and float(rows[1]["bleu_p"]) < 0.05
    assert float(rows[1]["valid_bleu"]) == 100.0 and rows[1]["n_seeds"] == "2"
    # pre_ln has only a paper perplexity (4.5 against 5.0): judged by the perplexity interval (two seeds each).
    assert (rows[1]["paper_direction"], rows[1]["paper_direction_by"]) == ("yes", "perplexity")
    table = (workdir / "results.md").read_text()
    assert "| BLEU p | chrF p | ref_valid_perplexity | ref_valid_bleu | same direction as the paper? |" in table
    assert " † | " in table and "| yes (perplexity) |" in table
    assert "its p-values over the 2 seeds it shares with the base" in table


def test_finished_runs_without_hypotheses_are_decoded_and_not_retrained(corpus, tmp_path, monkeypatch):
    """A run finished before the sweep decoded (no valid.hyp) gets decoded on the next invocation; decoded runs and
    the training are left alone."""
    refs = _tiny_refs(corpus)
    workdir = tmp_path / "sw"
    write_run(workdir / "base", refs, refs, perplexity=5.0)
    old = workdir / "pre_ln"  # an old-style finished run: metrics and result file only
    old.mkdir()
    (old / "metrics.jsonl").write_text(json.dumps({"step": 2, "valid_perplexity": 6.0, "valid_bleu": 1.0}) + "\n")
    (old / RESULT_FILE).write_text(json.dumps({"name": "pre_ln", "num_steps": 2, "wall_s": 1.0}))
    decodes = []

    def fake_translate(mode):
        decodes.append(mode)
        write_run(tmp_path / "decoded", noisy(refs, 0.5, 0), refs, perplexity=6.0)
        hypotheses = (tmp_path / "decoded" / VALID.hypotheses_file).read_text(encoding="utf-8").splitlines()
        return Translation(hypotheses, None, json.loads((tmp_path / "decoded" / VALID.scores_file).read_text()))

    monkeypatch.setattr(loop, "train_and_evaluate", lambda *a: pytest.fail("trained a finished run"))
    monkeypatch.setattr(runner, "translate", fake_translate)
    assert sweep.main(["--config", CONFIG, "--workdir", str(workdir)]) == 0
    [mode] = decodes
    assert (mode.model.workdir, mode.split, mode.model.choice.average_last) == (str(old), "valid", 1)
    # The sweep writes what the library returned: the hypotheses, and the report with their file.
    decoded = tmp_path / "decoded"
    assert (old / VALID.hypotheses_file).read_bytes() == (decoded / VALID.hypotheses_file).read_bytes()
    report = json.loads((old / VALID.scores_file).read_text())
    assert report["scores"] == json.loads((decoded / VALID.scores_file).read_text())["scores"]
    assert report["hypotheses_file"] == str(old / VALID.hypotheses_file)
    rows = list(csv.DictReader(open(workdir / "results.csv")))
    assert rows[1]["valid_bleu"] != "1.0" and float(rows[1]["bleu_p"]) < 0.05  # full-split BLEU, not training's
    assert sweep.main(["--config", CONFIG, "--workdir", str(workdir)]) == 0
    assert len(decodes) == 1  # decoded once


def test_sigterm_while_decoding_stops_the_sweep_and_leaves_the_run_undecoded(corpus, tmp_path, monkeypatch, capsys):
    workdir = tmp_path / "sw"
    for name in ("base", "pre_ln"):
        (workdir / name).mkdir(parents=True)
        (workdir / name / RESULT_FILE).write_text(json.dumps({"name": name, "num_steps": 2, "wall_s": 1.0}))
    monkeypatch.setattr(loop, "train_and_evaluate", lambda *a: pytest.fail("trained a finished run"))
    monkeypatch.setattr(runner, "translate", lambda mode: os.kill(os.getpid(), signal.SIGTERM))
    before = signal.getsignal(signal.SIGTERM)
    assert sweep.main(["--config", CONFIG, "--workdir", str(workdir)]) == 1
    assert "variant base stopped while decoding the validation split; run the same command" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before
    assert not (workdir / "base" / VALID.scores_file).exists()


def test_a_stored_decode_of_an_earlier_step_count_is_not_used(tmp_path):
    refs = REFS
    write_run(tmp_path / "r", refs, refs, perplexity=5.0, steps=2)
    assert run_metrics(tmp_path / "r", VALID)["finished"]
    (tmp_path / "r" / RESULT_FILE).write_text(json.dumps({"name": "r", "num_steps": 4, "wall_s": 1.0}))
    metrics = run_metrics(tmp_path / "r", VALID)
    assert not metrics["finished"] and metrics["valid_bleu"] == ""


def test_hypothesis_errors_in_aggregate_only_are_one_line(corpus, tmp_path, capsys):
    refs = _tiny_refs(corpus)
    write_run(tmp_path / "sw" / "base", refs, refs, perplexity=5.0)
    write_run(tmp_path / "sw" / "pre_ln", refs[1:], refs[1:], perplexity=5.0)
    err = fails(["--config", CONFIG, "--workdir", str(tmp_path / "sw"), "--aggregate_only"], capsys)
    assert "pre_ln/valid.hyp has 23 lines, the validation split 24" in err


def test_aggregate_only_on_the_test_split_tests_test_hypotheses_against_test_references(
    corpus, tmp_path, monkeypatch, capsys
):
    """results_test.* from test.hyp against the test references (a test split of 20 lines here, validation 24):
    the seeds' Δ and the bootstrap on the test split, while results.* are left as they are. On validation pre_ln is
    worse than base; on the test split both wrote the same lines (bootstrap p = 1) and pre_ln's scores are higher."""
    monkeypatch.setattr(loop, "train_and_evaluate", lambda *a: pytest.fail("trained"))
    monkeypatch.setattr(runner, "translate", lambda *a: pytest.fail("decoded"))
    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    for lang in ("en", "de"):
        lines = (data / f"test.{lang}").read_text(encoding="utf-8").splitlines()
        (data / f"test.{lang}").write_text("".join(line + "\n" for line in lines[:20]), encoding="utf-8")
    monkeypatch.setenv("TINY_CORPUS", str(data))
    valid, test = _tiny_refs(data), (data / "test.de").read_text(encoding="utf-8").splitlines()
    workdir = tmp_path / "sw"
    for i in range(2):
        write_run(workdir / "base" / f"seed{i}", valid, valid, perplexity=9.0 + i)
        write_decode(workdir / "base" / f"seed{i}", TEST, test, noisy(test, 0.5, i))  # a made-up report: lower
        write_run(workdir / "pre_ln" / f"seed{i}", noisy(valid, 0.6, i), valid, perplexity=3.0 + i)
        write_decode(workdir / "pre_ln" / f"seed{i}", TEST, test, test)
    args = ["--config", CONFIG, "--workdir", str(workdir), "--seeds", "2", "--aggregate_only"]
    assert sweep.main(args) == 0
    valid_rows = list(csv.DictReader(open(workdir / "results.csv")))
    assert float(valid_rows[1]["delta_valid_bleu"]) < 0 and float(valid_rows[1]["bleu_p"]) < 0.05
    valid_files = {name: (workdir / name).read_bytes() for name in ("results.csv", "results.md", "results.png")}
    assert sweep.main([*args, "--split", "test"]) == 0
    assert {name: (workdir / name).read_bytes() for name in valid_files} == valid_files
    rows = list(csv.DictReader(open(workdir / "results_test.csv")))
    assert rows[1]["test_bleu"] == "100.0" and float(rows[1]["delta_test_bleu_ci95_low"]) > 0  # Welch over seeds
    assert (rows[1]["paired_seeds"], rows[1]["bleu_p"], rows[1]["chrf_p"]) == ("2", "1.0", "1.0")  # same test.hyp
    assert float(rows[1]["delta_valid_perplexity"]) == -6.0  # training's validation perplexity
    assert "delta_valid_bleu" not in rows[1] and not any(c.startswith(("ref_", "paper_")) for c in rows[1])
    table = (workdir / "results_test.md").read_text()
    assert "| Δ test_bleu [95% CI] |" in table and "same direction as the paper" not in table
    # A test hypothesis file of the wrong length names the test split and its report.
    write_decode(workdir / "pre_ln" / "seed1", TEST, test[1:], test[1:])
    err = fails([*args, "--split", "test"], capsys)
    assert "pre_ln/seed1/test.hyp has 19 lines, the test split 20; delete" in err and "test_scores.json" in err
