"""Comparing two systems (evaluate.py --compare_file, transformer_jax.evaluation.significance): the paired bootstrap
test equals the sacrebleu command's --paired-bs on the same files, for BLEU, chrF and the tokenized BLEU; bad flag
combinations and mismatched files are one clear line."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import DATA, REPO
from transformer_jax.errors import EvalError, ScoreError
from transformer_jax.evaluation import significance
from transformer_jax.evaluation.command import evaluate, parse
from transformer_jax.evaluation.translate import read_lines, tokenize_for_bleu, tokenized_bleu

SACREBLEU = str(Path(sys.executable).parent / "sacrebleu")
MULTI30K_TEST_DE = DATA / "multi30k" / "test.de"


def drop_words(lines: list[str], p: float, seed: int) -> list[str]:
    """A 'system output': each word dropped with probability p (some lines end up empty)."""
    rng = random.Random(seed)
    return [" ".join(w for w in line.split() if rng.random() > p) for line in lines]


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def sacrebleu_paired_bs(ref: Path, baseline: Path, system: Path, *options: str) -> dict[str, list[float]]:
    """The command's text table (-w 4), parsed: per metric [score, mean, ci] of baseline and system, and p."""
    command = [SACREBLEU, str(ref), "-i", str(baseline), str(system), "--paired-bs", "-f", "text", "-w", "4"]
    cli = subprocess.run([*command, "--no-color", *options], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    table = cli.stdout.split("Paired bootstrap resampling test")[0]  # rows: the baseline, then the system
    number = r"(-?\d+\.\d+)"
    triples = [[float(x) for x in t] for t in re.findall(rf"{number} \({number} ± {number}\)", table)]
    p_values = [float(x) for x in re.findall(r"\(p = (\d\.\d+)\)", table)]
    n = len(p_values)
    assert len(triples) == 2 * n, cli.stdout
    return {"baseline": triples[:n], "system": triples[n:], "p": p_values}


def rounded(entry: dict[str, float]) -> list[float]:
    return [round(entry[k], 4) for k in ("score", "mean", "ci")]


def test_paired_bootstrap_equals_the_sacrebleu_command(tmp_path):
    if not MULTI30K_TEST_DE.exists():
        pytest.skip(f"{MULTI30K_TEST_DE} is absent: the shared data folder (../shared/data) is not on this machine")
    refs = MULTI30K_TEST_DE.read_text(encoding="utf-8").splitlines()[:300]
    baseline, system = drop_words(refs, 0.25, seed=1), drop_words(refs, 0.26, seed=2)
    files = {name: write(tmp_path / name, lines) for name, lines in (("R", refs), ("B", baseline), ("A", system))}

    ours = significance.paired_bootstrap(baseline, system, refs)
    # The command's first system after -i is the baseline.
    cli = sacrebleu_paired_bs(files["R"], files["B"], files["A"], "-m", "bleu", "chrf")
    for i, key in enumerate(("bleu", "chrf")):
        assert rounded(ours[key]["baseline"]) == cli["baseline"][i], key
        assert rounded(ours[key]["system"]) == cli["system"][i], key
        assert round(ours[key]["p_value"], 4) == cli["p"][i], key
    assert all(0.05 < ours[k]["p_value"] < 0.9 for k in ("bleu", "chrf", "tokenized_bleu"))  # a close pair
    assert ours["bleu"]["signature"].startswith("nrefs:1|bs:1000|seed:12345|case:mixed|eff:no|tok:13a")

    # The tokenized BLEU: the same test with BLEU on the tokenized, compound-split lines and tokenize none.
    tok = {name: write(tmp_path / f"{name}.tok", tokenize_for_bleu(lines)) for name, lines in
           (("R", refs), ("B", baseline), ("A", system))}  # fmt: skip
    cli_tok = sacrebleu_paired_bs(tok["R"], tok["B"], tok["A"], "-m", "bleu", "--tokenize", "none", "--force")
    assert rounded(ours["tokenized_bleu"]["baseline"]) == cli_tok["baseline"][0]
    assert rounded(ours["tokenized_bleu"]["system"]) == cli_tok["system"][0]
    assert round(ours["tokenized_bleu"]["p_value"], 4) == cli_tok["p"][0]
    assert ours["tokenized_bleu"]["system"]["score"] == pytest.approx(tokenized_bleu(system, refs)["score"])
    assert "tok:none" in ours["tokenized_bleu"]["signature"]


REFS = [f"Der {c} Hund-Besitzer sieht {n} Katzen im Garten." for c in ("alte", "junge", "kleine") for n in range(12)]


@pytest.fixture
def three_files(tmp_path):
    return (
        write(tmp_path / "a.txt", drop_words(REFS, 0.3, seed=3)),
        write(tmp_path / "b.txt", drop_words(REFS, 0.1, seed=4)),
        write(tmp_path / "r.txt", REFS),
    )


def test_compare_prints_both_systems_and_writes_the_report(three_files, tmp_path, capsys):
    a, b, r = three_files
    scores_file = tmp_path / "out" / "cmp.json"
    report = evaluate(
        dict(hypotheses_file=str(a), compare_file=str(b), references_file=str(r), scores_file=str(scores_file))
    )
    expected = significance.paired_bootstrap(read_lines(b), read_lines(a), read_lines(r))  # baseline first
    assert report["comparison"] == expected
    assert json.loads(scores_file.read_text()) == json.loads(json.dumps(report))
    out = capsys.readouterr().out
    for key in ("bleu", "chrf", "tokenized_bleu"):
        m = expected[key]
        s, base = m["system"], m["baseline"]
        assert f"{s['score']:.2f} ({s['mean']:.2f} ± {s['ci']:.2f}) vs baseline {b} {base['score']:.2f}" in out
        assert f"p = {m['p_value']:.4f}" in out
    assert "1000 resamples, seed 12345" in out


def test_identical_outputs_are_flagged_and_the_report_is_plain_json():
    hyps = drop_words(REFS, 0.2, seed=5)
    result = significance.paired_bootstrap(hyps, list(hyps), REFS, n_samples=50)
    assert result["identical_outputs"]
    for key in ("bleu", "chrf", "tokenized_bleu"):
        assert result[key]["system"] == result[key]["baseline"]
        assert result[key]["p_value"] == pytest.approx(1 / 51)  # sacreBLEU's floor, not a difference
    assert "the two outputs are identical: no difference" in significance.format_comparison(result, "a", "b")
    assert "significant at 0.05" not in significance.format_comparison(result, "a", "b")
    json.dumps(result)  # no numpy floats
    assert not significance.paired_bootstrap(hyps, drop_words(REFS, 0.2, seed=6), REFS, n_samples=50)[
        "identical_outputs"
    ]
    with pytest.raises(ScoreError, match="line counts differ: baseline 36, system 35, references 36"):
        significance.paired_bootstrap(hyps, hyps[:-1], REFS)
    with pytest.raises(ScoreError, match="references are empty"):
        significance.paired_bootstrap([], [], [])


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(compare_file="b"), "--compare_file needs --hypotheses_file and --references_file"),
        (dict(compare_file="b", hypotheses_file="a"), "--compare_file needs --hypotheses_file and --references_file"),
        (dict(compare_file="b", workdir="w", references_file="r"), "--compare_file needs --hypotheses_file"),
        (dict(compare_file="", hypotheses_file="a", references_file="r"), "--compare_file is empty"),
        (dict(compare_file="a", hypotheses_file="./a", references_file="r"), "--compare_file a is --hypotheses_file"),
        (
            dict(compare_file="b", hypotheses_file="a", references_file="r", scores_file="b"),
            "--scores_file b is the input --compare_file b",
        ),
    ],
)
def test_bad_compare_flags_are_refused_before_reading(options, message):
    with pytest.raises(EvalError, match=message):
        parse(options)


def test_line_count_mismatch_is_one_line_naming_the_files(three_files, tmp_path):
    a, b, r = three_files
    short = write(tmp_path / "short.txt", REFS[:-2])
    cli = subprocess.run(
        [sys.executable, str(REPO / "evaluate.py"), "--hypotheses_file", str(a), "--compare_file", str(short)]
        + ["--references_file", str(r)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert cli.returncode != 0
    lines = cli.stderr.strip().splitlines()
    assert lines == [
        f"evaluate.py: error: line counts differ: --hypotheses_file {a} has 36, --compare_file {short} has 34, "
        f"--references_file {r} has 36; compare two systems' outputs of the same references"
    ]
