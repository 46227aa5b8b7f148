"""evaluate.py (transformer_jax.evaluation.command) and the library under it (transformer_jax.evaluation.run and
.restore): scores-only mode against the sacrebleu command on real data, and the model mode on a workdir of real
checkpoints whose parameters have a known mean (fakes.three_checkpoints): step selection, averaging, the config
check, one output line per input line, the report and where it goes, that bad inputs fail early with clear messages,
and that the library prints nothing (only the command line does).
"""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from absl import flags
from flax import nnx

from tests.helpers import DATA, REPO
from tests.helpers.fakes import base_params, reads, three_checkpoints, tiny_config, write_workdir
from transformer_jax.data.tokenizer import train_tokenizer
from transformer_jax.errors import CheckpointError, EvalError, ScoreError
from transformer_jax.evaluation import restore, run
from transformer_jax.evaluation.command import FLAGS, define, evaluate, parse, values_of
from transformer_jax.evaluation.run import Compare, Model, ScorePairs, ScoresOnly, Translate
from transformer_jax.evaluation.translate import read_lines, score_files
from transformer_jax.model.layers import SpecialIds

PYTHON = sys.executable
SACREBLEU = str(Path(sys.executable).parent / "sacrebleu")
WMT14_TEST_DE = DATA / "wmt14_ende" / "test.de"


def perturb(lines: list[str], seed: int = 0) -> list[str]:
    """A plausible 'system output': drop, duplicate and swap some words, leave some lines empty."""
    rng = random.Random(seed)
    out = []
    for line in lines:
        words = line.split()
        if rng.random() < 0.01:
            out.append("")
            continue
        words = [w for w in words if rng.random() > 0.1]
        if len(words) > 3 and rng.random() < 0.3:
            i = rng.randrange(len(words) - 1)
            words[i], words[i + 1] = words[i + 1], words[i]
        if words and rng.random() < 0.1:
            words.append(words[0])
        out.append(" ".join(words))
    return out


def run_evaluate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, str(REPO / "evaluate.py"), *args], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def test_scores_only_mode_equals_the_sacrebleu_command_on_newstest2014(tmp_path):
    if not WMT14_TEST_DE.exists():
        pytest.skip(f"real data not found: {WMT14_TEST_DE} (the shared data folder is absent on this machine)")
    # 600 of the 3,003 lines: real text, at a fifth of the scoring work of the three processes below.
    lines = read_lines(WMT14_TEST_DE)[:600]
    ref, hyp = tmp_path / "ref.de", tmp_path / "hyp.de"
    ref.write_text("\n".join(lines) + "\n", encoding="utf-8")
    hyp.write_text("\n".join(perturb(lines)) + "\n", encoding="utf-8")
    ours = run_evaluate("--hypotheses_file", str(hyp), "--references_file", str(ref))
    assert ours.returncode == 0, ours.stderr
    lines = ours.stdout.splitlines()
    ours_bleu = float(lines[0].split(" = ")[1].split()[0])
    ours_chrf = float(lines[1].split(" = ")[1].split()[0])
    ours_chrfpp = float(lines[2].split(" = ")[1].split()[0])
    ours_ter = float(lines[3].split(" = ")[1].split()[0])
    ours_tok = float(lines[4].split(" = ")[1].split()[0])
    assert lines[0].startswith("sacreBLEU BLEU = ") and "tok:13a|smooth:exp" in lines[0]
    assert lines[2].startswith("sacreBLEU chrF2++ = ") and "nc:6|nw:2" in lines[2]
    assert lines[3].startswith("sacreBLEU TER = ") and "tok:tercom" in lines[3]
    assert lines[4].startswith("tokenized BLEU (tensor2tensor get_ende_bleu procedure, compound splitting) = ")
    # The sacrebleu command, at two decimals (-w 2) and at its default one decimal.
    for width in ("2", "1"):
        cli = subprocess.run(
            [SACREBLEU, str(ref), "-i", str(hyp), "-m", "bleu", "chrf", "-b", "-w", width],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert cli.returncode == 0, cli.stderr
        cli_bleu, cli_chrf = json.loads(cli.stdout)
        assert cli_bleu == round(ours_bleu, int(width)) and cli_chrf == round(ours_chrf, int(width))
    cli = subprocess.run(
        [SACREBLEU, str(ref), "-i", str(hyp), "-m", "ter", "chrf", "--chrf-word-order", "2", "-w", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    printed = {entry["name"]: entry["score"] for entry in json.loads(cli.stdout)}
    assert (printed["TER"], printed["chrF2++"]) == (ours_ter, ours_chrfpp)
    assert 10 < ours_bleu < 90 and ours_tok != ours_bleu  # a real, different, number


@pytest.mark.slow  # in-process: tests/test_bleu.py's test_read_lines_like_sacrebleu_and_line_count_check; evaluate.py's
# one line for scores-only line counts: tests/test_compare.py's test_line_count_mismatch_is_one_line_naming_the_files
def test_scores_only_mode_line_count_mismatch_names_both_files(tmp_path):
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp.write_text("a\nb\nc\n", encoding="utf-8")
    ref.write_text("a\nb\n", encoding="utf-8")
    out = run_evaluate("--hypotheses_file", str(hyp), "--references_file", str(ref))
    assert out.returncode != 0
    assert f"{hyp} has 3 lines, {ref} has 2" in out.stderr
    assert "Traceback" not in out.stderr


# -- model mode on checkpoints of known parameters ---------------------------------------------------------------


def test_restore_averages_the_last_checkpoints_up_to_the_chosen_step(tmp_path, monkeypatch):
    workdir, read = three_checkpoints(tmp_path), reads(monkeypatch)
    _, model, steps = restore.restore_model(str(workdir), restore.CheckpointChoice("200", average_last=2))
    assert steps == [100, 200] and read == [100, 200]
    got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    expected = jax.tree.map(lambda x: x + np.float32(0.15), base_params(tiny_config()))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got, expected)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(checkpoint="250"), r"no checkpoint for step 250 .*available steps: \[100, 200, 300\]"),
        (dict(average_last=4), r"last 4 checkpoints up to step 300, but only 3 exist: \[100, 200, 300\]"),
        (dict(average_steps=[100, 150]), r"step\(s\) \[150\]; available steps: \[100, 200, 300\]"),
        (dict(config=tiny_config(d_model=64, d_ff=96)), r"model.d_model: 32 -> 64; model.d_ff: 64 -> 96"),
    ],
)
def test_restore_errors_are_clear(tmp_path, monkeypatch, options, message):
    workdir, read = three_checkpoints(tmp_path), reads(monkeypatch)
    config = options.pop("config", None)
    with pytest.raises(EvalError, match=message):
        restore.restore_model(str(workdir), restore.CheckpointChoice(**options), config=config)
    assert read == []  # nothing was read


def test_parameters_that_do_not_fit_the_config_name_the_array(tmp_path, monkeypatch):
    """Checkpoints whose arrays have other shapes than their own saved config builds. The shapes are compared before
    Orbax reads an array: a read that fails leaves the others pending, and at exit the process printed each of them as
    an ignored exception, thousands of lines after the one-line error."""
    workdir = write_workdir(tmp_path, tiny_config(d_ff=96), {100: base_params(tiny_config())})
    state_reads = []
    read = ocp.CheckpointManager.restore

    def counting(self, step, *args, **kwargs):
        state_reads.extend([step] if "state" in kwargs.get("args", {}) else [])
        return read(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", counting)
    message = (
        r"the checkpoint at step 100 in .* does not fit the config: its array model/decoder_layers/0/ffn/w1/bias has "
        r"shape \(64,\), but the config builds \(96,\); use the config it was trained with$"
    )
    with pytest.raises(CheckpointError, match=message):
        restore.restore_model(str(workdir), restore.CheckpointChoice(average_last=1))
    assert state_reads == []


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(EvalError, match="no checkpoint in .*checkpoints"):
        restore.restore_model(str(tmp_path))


def test_references_with_another_line_count_fail_before_the_model_is_restored(tmp_path, monkeypatch):
    src, ref = tmp_path / "src.en", tmp_path / "ref.de"
    src.write_text("a\nb\nc\n", encoding="utf-8")
    ref.write_text("a\nb\n", encoding="utf-8")
    read = reads(monkeypatch)
    options = dict(workdir=str(three_checkpoints(tmp_path / "w")), source_file=str(src), references_file=str(ref))
    with pytest.raises(ScoreError, match=r"src\.en has 3 lines, .*ref\.de has 2"):
        evaluate(options)
    assert read == []


def test_translate_a_file_one_output_per_input_line_and_report(tmp_path, capsys):
    sources = ["hello world", "", "a longer one", "short"]  # all in the 16-token bucket
    src, ref = tmp_path / "src.en", tmp_path / "ref.de"
    src.write_text("\n".join(sources) + "\n", encoding="utf-8")
    ref.write_text("hallo welt\n\neine viel längere zeile\nkurz\n", encoding="utf-8")
    out = tmp_path / "out" / "hyp.de"
    workdir = three_checkpoints(tmp_path / "w")
    options = dict(
        workdir=str(workdir), source_file=str(src), references_file=str(ref), output_file=str(out), alpha=0.0
    )
    report = evaluate(options)
    hypotheses = read_lines(out)
    assert len(hypotheses) == len(sources) and hypotheses[1] == ""
    assert report["checkpoint_steps"] == [200, 300]
    assert report["decoding"] == {
        "beam_size": 2,
        "alpha": 0.0,
        "max_extra_len": 5,
        "max_len": 0,
        "batch_size": 4,
        "max_input_len": 256,
    }
    assert report["stats"]["sentences"] == 4 and report["stats"]["empty"] == 1
    assert set(report["scores"]) == {"bleu", "chrf", "chrfpp", "ter", "tokenized_bleu"}
    saved = json.loads(Path(f"{out}.json").read_text())
    assert saved["checkpoint_steps"] == [200, 300] and saved["scores"]["bleu"]["signature"].startswith("nrefs:1")
    # stdout: the few summary lines a person reads (the report is in its file, not printed).
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("4 lines translated") and printed[1].startswith("sacreBLEU BLEU = ")
    assert (
        printed[-2:] == [f"hypotheses: {out}", f"report: {out}.json"] and len(printed) == 8
    )  # lines, 5 scores, 2 paths

    # stdin, one line at a time: the same outputs (batch of one) in the same order, on stdout; the summary goes to
    # stderr and the report to WORKDIR/eval/stdin.<steps>.json.
    stdin = io.StringIO("\n".join(sources) + "\n")
    old_stdin, sys.stdin = sys.stdin, stdin
    try:
        streamed = evaluate(dict(workdir=str(workdir), source_file="-", alpha=0.0))
    finally:
        sys.stdin = old_stdin
    printed = capsys.readouterr()
    assert printed.out.splitlines() == hypotheses and printed.err.startswith("4 lines translated")
    assert streamed["stats"]["sentences"] == 4 and streamed["stats"]["empty"] == 1
    report_file = workdir / "eval" / "stdin.step300-avg2.json"
    assert json.loads(report_file.read_text()) == json.loads(json.dumps(streamed))
    assert f"report: {report_file}" in printed.err


def test_json_prints_the_report_on_stdout_and_the_summary_on_stderr(tmp_path, capsys):
    src = tmp_path / "src.en"
    src.write_text("hello world\nshort\n", encoding="utf-8")
    out = tmp_path / "hyp.de"
    workdir = three_checkpoints(tmp_path / "w")
    report = evaluate(dict(workdir=str(workdir), source_file=str(src), output_file=str(out), json=True))
    printed = capsys.readouterr()
    assert json.loads(printed.out) == json.loads(json.dumps(report)) == json.loads(Path(f"{out}.json").read_text())
    assert printed.err.splitlines()[0].startswith("2 lines translated") and f"report: {out}.json" in printed.err


def test_json_with_the_translations_of_stdin_on_stdout_is_refused(tmp_path):
    with pytest.raises(EvalError, match="--json prints the report on stdout, where stdin's translations go"):
        parse(dict(workdir=str(tmp_path), source_file="-", json=True))
    parse(dict(workdir=str(tmp_path), source_file="-", json=True, output_file=str(tmp_path / "o")))  # a file: fine


def test_a_default_report_that_is_an_input_is_refused_before_translating(tmp_path, capsys, monkeypatch):
    """stdin's translations on stdout: the report's default is WORKDIR/eval/stdin.<steps>.json, never an input."""
    workdir = three_checkpoints(tmp_path)
    ref = tmp_path / "eval" / "stdin.step300-avg2.json"
    ref.parent.mkdir()
    ref.write_text("hallo\nwelt\n", encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nworld\n"))
    with pytest.raises(EvalError, match=r"--scores_file \S*stdin\.step300-avg2\.json is the input --references_file"):
        evaluate(dict(workdir=str(workdir), source_file="-", references_file=str(ref)))
    assert ref.read_text(encoding="utf-8") == "hallo\nwelt\n" and capsys.readouterr().out == ""


@pytest.mark.slow  # trimmed from the default run: the file keeps a fast representative
def test_scores_only_prints_the_scores_and_with_json_only_the_report_on_stdout(tmp_path):
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp.write_text("a b c d\ne f\n", encoding="utf-8")
    ref.write_text("a b c d\ne f g\n", encoding="utf-8")
    plain = run_evaluate("--hypotheses_file", str(hyp), "--references_file", str(ref))
    assert plain.returncode == 0 and len(plain.stdout.splitlines()) == 5  # the five scores; no report file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hyp.txt", "ref.txt"]
    as_json = run_evaluate("--hypotheses_file", str(hyp), "--references_file", str(ref), "--json")
    assert as_json.returncode == 0 and as_json.stderr.splitlines() == plain.stdout.splitlines()
    report = json.loads(as_json.stdout)
    assert report["hypotheses_file"] == str(hyp) and report["bleu"]["score"] == score_files(hyp, ref)["bleu"]["score"]


def test_the_library_prints_nothing(tmp_path, capfd, monkeypatch):
    """Each mode of evaluation.run returns its data; only the command line prints (stdout and stderr captured at
    the file descriptors, so a print from any layer would show)."""
    src, ref, other = tmp_path / "src.en", tmp_path / "ref.de", tmp_path / "other.de"
    src.write_text("hello world\n\nshort\n", encoding="utf-8")
    ref.write_text("hallo welt\n\nkurz\n", encoding="utf-8")
    other.write_text("hallo\n\nkurz\n", encoding="utf-8")
    capfd.readouterr()
    assert run.scores_only(ScoresOnly(str(ref), str(ref)))["chrf"]["score"] == 100
    assert run.compare(Compare(str(ref), str(other), str(ref)))["comparison"]["bleu"]["p_value"] < 1
    workdir = three_checkpoints(tmp_path / "w")
    capfd.readouterr()
    model = Model(str(workdir))
    translate = Translate(model, source_file=str(src), references_file=str(ref))
    loaded = run.load(translate)
    translation = run.translate(translate, loaded)
    assert len(translation.hypotheses) == 3 and translation.report["scores"] is not None
    stdin = Translate(model, source_file="-")
    streamed = run.stream_result(stdin, loaded, list(run.stream(stdin, loaded, ["hello world", "", "short"])))
    assert streamed.hypotheses == translation.hypotheses
    pairs = ScorePairs(model, source_file=str(src), references_file=str(ref))
    assert len(run.score(pairs, run.load(pairs)).scores) == 3
    assert capfd.readouterr() == ("", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.de", "ref.de", "src.en", "w"]
    assert not (workdir / "eval").exists()


def test_each_flag_with_choices_refuses_any_other_value_a_tuning_flag_needs_its_switch_unset_is_the_default(tmp_path):
    chosen = [flag for flag in FLAGS if flag.choices]
    assert {flag.name for flag in chosen} == {"length_penalty", "finished", "mbr_utility"}
    for flag in chosen:
        with pytest.raises(EvalError, match=f"--{flag.name} 'bogus': choose one of {', '.join(flag.choices)}$"):
            parse(dict(workdir=str(tmp_path), **{flag.name: "bogus"}))
    with pytest.raises(EvalError, match=r"^--top_k, --seed go with --sampling: add --sampling, or drop them$"):
        parse(dict(workdir=str(tmp_path), top_k=5, seed=1))
    # The absl flags come from the same table; --split names any split of the text folder.
    fv = flags.FlagValues()
    define(fv)
    fv(["evaluate.py", "--split=train"])
    assert fv.split == "train"
    fv(["evaluate.py", "--workdir", str(tmp_path), "--length_penalty=average", "--json"])
    mode, outputs = parse(values_of(fv))
    assert mode.decoding.length_penalty == "average" and outputs.json and mode.model.workdir == str(tmp_path)
    mode, _ = parse(dict(workdir=str(tmp_path), mbr=2))
    assert (mode.split, mode.decoding.length_penalty, mode.decoding.finished) == ("test", "gnmt", "in_beam")
    assert (mode.decoding.mbr_utility, mode.decoding.candidates, mode.decoding.seed) == ("bleu", 2, 0)


@pytest.mark.slow
def test_end_to_end_with_real_checkpoints_and_tokenizer(tmp_path):
    """Saves two tiny checkpoints with the training code, trains a tokenizer, runs the command line."""
    checkpoints = pytest.importorskip("transformer_jax.training.checkpoints")
    state_lib = pytest.importorskip("transformer_jax.training.step")
    multi30k = DATA / "multi30k" / "valid.en"
    if not multi30k.exists():
        pytest.skip(f"real data not found: {multi30k}")
    config = tiny_config(vocab_size=500)
    config.lock()
    _, state = state_lib.create_train_state(config)
    saver = checkpoints.Checkpointer(tmp_path, config.ckpt)
    saver.save(10, state, {"position": 0}, config)
    saver.save(20, state, {"position": 1}, config)
    saver.close()
    lines = read_lines(multi30k)[:500]
    train_tokenizer(lines, tmp_path / "spm.model", vocab_size=500, model_type="unigram", ids=SpecialIds.DEFAULT)
    src = tmp_path / "src.en"
    src.write_text("\n".join(lines[:5] + ["", lines[5]]) + "\n", encoding="utf-8")
    out = tmp_path / "hyp.txt"
    args = ["--workdir", str(tmp_path), "--source_file", str(src), "--references_file", str(src)]
    result = run_evaluate(*args, "--output_file", str(out), "--beam_size", "2")
    assert result.returncode == 0, result.stderr
    assert len(read_lines(out)) == 7 and read_lines(out)[5] == ""
    report = json.loads(Path(f"{out}.json").read_text())
    assert report["checkpoint_steps"] == [10, 20] and report["decoding"]["beam_size"] == 2
    missing = run_evaluate(*args, "--checkpoint", "15")
    assert missing.returncode != 0 and "available steps: [10, 20]" in missing.stderr
