"""evaluate.py with inputs that must not break it: an output that would overwrite an input, blank lines in a test
split, invalid UTF-8, an unwritable output location, empty files, and bad flag values.

Each mistake fails before the model is restored (in a workdir without checkpoints, where restoring would fail
otherwise), with one EvalError/ScoreError line; a few run the command line to check the one-line, no-traceback exit.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.fakes import three_checkpoints, tiny_config
from transformer_jax.data import sources as sources_lib
from transformer_jax.errors import DataError, EvalError, ScoreError
from transformer_jax.evaluation.command import evaluate
from transformer_jax.evaluation.translate import read_lines, score_all
from transformer_jax.training import checkpoints


def run_evaluate(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "evaluate.py"), *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def assert_one_error_line(result: subprocess.CompletedProcess, words: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("evaluate.py: error: "), result.stderr
    assert words in lines[0], lines[0]


@pytest.fixture
def workdir(tmp_path):
    """tmp_path with checkpoints (fakes.three_checkpoints): where a test needs the model restored."""
    return three_checkpoints(tmp_path)


@pytest.fixture
def files(tmp_path):
    src, ref = tmp_path / "src.en", tmp_path / "ref.de"
    src.write_text("hello world\nshort\n", encoding="utf-8")
    ref.write_text("hallo welt\nkurz\n", encoding="utf-8")
    return src, ref


# -- 7: an output never overwrites an input -------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, target, spelling",
    [
        ("output_file", "src.en", "same"),
        ("output_file", "ref.de", "relative"),
        ("output_file", "ref.de", "dot"),
        ("output_file", "ref.de", "symlink"),
        ("output_file", "src.en", "hardlink"),
        ("scores_file", "ref.de", "dot"),
        ("scores_file", "src.en", "symlink"),
        ("output_json", "ref.de", "same"),  # --output_file X with references X.json: the default scores file
    ],
)
def test_an_output_that_is_an_input_is_refused_before_restoring(tmp_path, files, monkeypatch, flag, target, spelling):
    src, ref = files
    monkeypatch.chdir(tmp_path)
    path = tmp_path / target
    if flag == "output_json":
        path = tmp_path / "hyp.txt.json"
        path.write_text("a\nb\n", encoding="utf-8")
        ref, flag, spelling = path, "output_file", "json"
    before = path.read_bytes()
    spelled = {
        "same": str(path),
        "relative": path.name,
        "dot": f"./sub/../{path.name}",
        "json": str(tmp_path / "hyp.txt"),
    }.get(spelling)
    if spelling == "symlink":
        spelled = str(tmp_path / "link")
        os.symlink(path, spelled)
    elif spelling == "hardlink":
        spelled = str(tmp_path / "hard")
        os.link(path, spelled)
    (tmp_path / "sub").mkdir()
    options = dict(workdir=str(tmp_path), source_file=str(src), references_file=str(ref), **{flag: spelled})
    with pytest.raises(EvalError, match="would destroy the input"):
        evaluate(options)
    assert path.read_bytes() == before


def test_scores_only_refuses_a_scores_file_that_is_an_input_and_output_equal_to_scores(tmp_path, files, capsys):
    src, ref = files
    with pytest.raises(EvalError, match=r"--scores_file .*ref\.de is the input --references_file"):
        evaluate(dict(hypotheses_file=str(src), references_file=str(ref), scores_file=str(ref)))
    assert ref.read_text(encoding="utf-8") == "hallo welt\nkurz\n" and capsys.readouterr().out == ""
    same = dict(workdir=str(tmp_path), source_file=str(src), output_file="o.txt", scores_file="./o.txt")
    with pytest.raises(EvalError, match="are the same file"):
        evaluate(same)


@pytest.mark.slow  # in-process: test_an_output_that_is_an_input_is_refused_before_restoring; evaluate.py's one line:
# test_bad_flag_values_on_the_command_line_are_one_line
def test_command_line_output_over_source_is_one_line(tmp_path, files):
    src, ref = files
    result = run_evaluate(
        "--workdir", str(tmp_path), "--source_file", str(src), "--output_file", "src.en", cwd=tmp_path
    )
    assert_one_error_line(result, "--output_file src.en is the input --source_file")
    assert src.read_text(encoding="utf-8") == "hello world\nshort\n"


def test_an_output_over_a_text_split_file_is_refused_before_translating(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "test.en").write_text("a\n", encoding="utf-8")
    (data / "test.de").write_text("b\n", encoding="utf-8")
    config = tiny_config()
    config.data.update(source="text", text_dir=str(data))
    three_checkpoints(tmp_path, config)
    with pytest.raises(EvalError, match=r"test\.de is the input split file \(de\)"):
        evaluate(dict(workdir=str(tmp_path), output_file=str(data / "test.de")))
    assert (data / "test.de").read_text(encoding="utf-8") == "b\n"


# -- 8: a test split with blank lines keeps every line ----------------------------------------------------------


def test_split_with_blank_lines_gives_one_hypothesis_per_line_and_scores_them_all(tmp_path, capsys):
    en = ["hello world", "", "short", "a longer one", "", "x y", "one more", "two", "three", "four"]
    de = ["hallo welt", "", "kurz", "", "leer", "x y", "noch eins", "zwei", "drei", "vier"]
    data = tmp_path / "data"
    data.mkdir()
    (data / "test.en").write_text("\n".join(en) + "\n", encoding="utf-8")
    (data / "test.de").write_text("\n".join(de) + "\n", encoding="utf-8")
    config = tiny_config()
    config.data.update(source="text", text_dir=str(data))
    three_checkpoints(tmp_path, config)
    out = tmp_path / "hyp.txt"
    report = evaluate(dict(workdir=str(tmp_path), output_file=str(out), alpha=0.0))
    hypotheses = read_lines(out)
    assert len(hypotheses) == len(en)  # before: 7, the pairs with an empty side were dropped
    assert report["lines"] == len(en)
    assert hypotheses[1] == hypotheses[4] == ""
    assert report["blank_lines"] == {"sources": 2, "references": 2}
    assert report["scores"]["bleu"]["score"] == score_all(hypotheses, de)["bleu"]["score"]
    assert "10 lines translated" in capsys.readouterr().out
    assert json.loads(Path(f"{out}.json").read_text())["blank_lines"] == {"sources": 2, "references": 2}
    # Training still skips pairs with an empty side (3 of the 10).
    assert len(sources_lib.load_split(config.data, "test")) == 7


def test_any_split_of_another_text_folder_is_translated_and_a_missing_one_is_one_line(tmp_path):
    """--text_dir replaces data.text_dir and --split names any {split}.{lang} pair there (a TFDS-trained model too:
    the folder is read as text)."""
    config = tiny_config()
    config.data.update(source="tfds")
    three_checkpoints(tmp_path / "run", config)
    data = tmp_path / "data"
    data.mkdir()
    (data / "news.en").write_text("hello world\nshort\n", encoding="utf-8")
    (data / "news.de").write_text("hallo welt\nkurz\n", encoding="utf-8")
    report = evaluate(dict(workdir=str(tmp_path / "run"), split="news", text_dir=str(data)))
    assert report["lines"] == 2 and report["source"] == "news(news)"
    with pytest.raises(DataError, match=r"missing split 'dev': no file .*dev\.en; available splits for en: \['news'\]"):
        evaluate(dict(workdir=str(tmp_path / "run"), split="dev", text_dir=str(data), output_file=str(tmp_path / "o")))
    assert not (tmp_path / "o").exists()


# -- 9: invalid UTF-8 -------------------------------------------------------------------------------------------


def test_invalid_utf8_in_a_source_or_reference_file_names_the_line_before_restoring(tmp_path, files):
    src, ref = files
    bad = tmp_path / "bad.en"
    bad.write_bytes(b"fine\nstill fine\nna\xefve\n")
    with pytest.raises(EvalError, match=r"bad\.en, line 3: invalid UTF-8 .*byte 3 of the line"):
        evaluate(dict(workdir=str(tmp_path), source_file=str(bad)))
    with pytest.raises(ScoreError, match=r"bad\.en, line 3: invalid UTF-8"):
        evaluate(dict(workdir=str(tmp_path), source_file=str(src), references_file=str(bad)))


def test_invalid_utf8_on_stdin_stops_at_its_line_after_writing_the_lines_before(workdir, capsys, monkeypatch):
    # As the interpreter opens stdin in a UTF-8 locale: lenient decoding (surrogateescape) over a binary buffer.
    stdin = io.TextIOWrapper(io.BytesIO(b"\n \n\xff\xfe oops\nnever read\n"), "utf-8", "surrogateescape")
    monkeypatch.setattr(sys, "stdin", stdin)
    with pytest.raises(EvalError, match=r"stdin, line 3: invalid UTF-8 .*byte 1 of the line.*2 lines before"):
        evaluate(dict(workdir=str(workdir), source_file="-", alpha=0.0))
    assert capsys.readouterr().out == "\n\n"  # the two lines before it, written and flushed


def test_a_stream_that_fails_leaves_an_earlier_output_file_as_it_was(workdir, tmp_path, monkeypatch):
    """stdin into --output_file: the lines go to OUTPUT.partial until stdin ends, so a stream that fails (or
    has no lines) never truncates an earlier OUTPUT; the lines translated before a failure stay in OUTPUT.partial."""
    out = tmp_path / "out.txt"
    out.write_text("an earlier translation\n", encoding="utf-8")
    stdin = io.TextIOWrapper(io.BytesIO(b"\n \n\xff\xfe oops\n"), "utf-8", "surrogateescape")
    monkeypatch.setattr(sys, "stdin", stdin)
    with pytest.raises(EvalError, match=r"stdin, line 3: invalid UTF-8"):
        evaluate(dict(workdir=str(tmp_path), source_file="-", output_file=str(out), alpha=0.0))
    assert out.read_text(encoding="utf-8") == "an earlier translation\n"
    assert (tmp_path / "out.txt.partial").read_text(encoding="utf-8") == "\n\n"
    (tmp_path / "out.txt.partial").unlink()
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    with pytest.raises(EvalError, match="stdin had no lines"):
        evaluate(dict(workdir=str(tmp_path), source_file="-", output_file=str(out)))
    assert out.read_text(encoding="utf-8") == "an earlier translation\n"
    assert not (tmp_path / "out.txt.partial").exists()
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    evaluate(dict(workdir=str(tmp_path), source_file="-", output_file=str(out), alpha=0.0))
    assert len(out.read_text(encoding="utf-8").splitlines()) == 1 and not (tmp_path / "out.txt.partial").exists()


# -- 10: an unwritable output location is found before restoring -------------------------------------------------


@pytest.mark.parametrize("flag", ["output_file", "scores_file", "default", "directory"])
def test_an_unwritable_output_location_fails_before_restoring(tmp_path, files, flag):
    src, _ = files
    blocker = tmp_path / "a_file"
    blocker.write_text("x", encoding="utf-8")
    workdir = tmp_path
    kwargs = {"output_file": str(tmp_path / "out.txt")}
    if flag == "default":
        workdir, kwargs = blocker, {}  # WORKDIR/eval cannot be created below a regular file
    elif flag == "directory":
        kwargs = {"output_file": str(tmp_path)}
    else:
        kwargs[flag] = str(blocker / "deeper" / "x.txt")
    with pytest.raises(EvalError, match="is a directory|is not a directory"):
        evaluate(dict(workdir=str(workdir), source_file=str(src), **kwargs))


def test_an_unwritable_scores_file_fails_before_scoring(tmp_path, files, capsys):
    src, ref = files
    blocker = tmp_path / "a_file"
    blocker.write_text("x", encoding="utf-8")
    with pytest.raises(EvalError, match="a_file is not a directory"):
        evaluate(dict(hypotheses_file=str(src), references_file=str(ref), scores_file=str(blocker / "s.json")))
    assert capsys.readouterr().out == ""


# -- 11: empty inputs -------------------------------------------------------------------------------------------


def test_empty_source_file_and_empty_stdin_are_clear_errors(tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty.en"
    empty.write_bytes(b"")
    with pytest.raises(EvalError, match=r"--source_file \S*empty\.en"):
        evaluate(dict(workdir=str(tmp_path), source_file=str(empty)))
    with pytest.raises(ScoreError, match="have no lines: nothing to score"):
        evaluate(dict(workdir=str(tmp_path), source_file=str(empty), references_file=str(empty)))
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    with pytest.raises(EvalError, match="stdin had no lines"):
        evaluate(dict(workdir=str(three_checkpoints(tmp_path)), source_file="-"))


@pytest.mark.slow  # in-process: test_empty_source_file_and_empty_stdin_are_clear_errors; evaluate.py's one line of a
# scores-only mistake: tests/test_cli_errors.py's evaluate.py-7
def test_scoring_two_empty_files_is_one_line(tmp_path):
    hyp, ref = tmp_path / "h.txt", tmp_path / "r.txt"
    hyp.write_bytes(b"")
    ref.write_bytes(b"")
    assert_one_error_line(
        run_evaluate("--hypotheses_file", str(hyp), "--references_file", str(ref)), "have no lines: nothing to score"
    )


# -- 12: bad flag values, checked in one place before anything is read -----------------------------------------

BAD_OPTIONS = [
    (dict(beam_size=0), r"--beam_size: must be positive \(an integer >= 1, beams\), got 0"),
    (dict(batch_size=-4), "--batch_size: must be positive .* got -4"),
    (dict(max_extra_len=0), "--max_extra_len: must be positive"),
    (dict(average_last=0), "--average_last: must be positive"),
    (dict(alpha=-0.5), r"--alpha: must be >= 0 \(a number, length penalty exponent\), got -0.5"),
    (dict(alpha=math.nan), "--alpha: .* got nan"),
    (dict(alpha=math.inf), "--alpha: .* got inf"),
    (dict(checkpoint="abc"), "--checkpoint must be 'latest', 'best' or a step number, got 'abc'"),
    (dict(checkpoint="-5"), "--checkpoint must be 'latest', 'best' or a step number"),
    (dict(average_steps=["100", "x"]), "--average_steps must be step numbers"),
    (dict(average_steps=[]), "--average_steps must be step numbers"),
    (dict(average_steps=["100", "100"]), r"lists step\(s\) \[100\] more than once"),
    (dict(average_steps=["100"], average_last=2), "--average_last or --average_steps, not both"),
    (dict(average_steps=["100"], checkpoint="200"), "--checkpoint would be ignored"),
    (dict(checkpoint="best", average_last=2), "--checkpoint best with --average_last: .* --average_best"),
    (dict(average_best=0), r"--average_best must be >= 1 \(checkpoints averaged\), got 0"),
    (dict(average_best=2, average_last=3), "give one of --average_best, --average_last and --average_steps"),
    (dict(average_best=2, checkpoint="200"), "--average_best takes the best checkpoints; --checkpoint STEP"),
    (dict(split=" "), "--split is empty"),
    (dict(text_dir="d", source_file="s.en"), "--text_dir holds --split's files; --source_file names its own"),
    (dict(split="test", source_file="s.en"), "--split or --source_file, not both"),
    (dict(references_file="r.de"), "--references_file goes with --source_file"),
    (dict(workdir=None), "give --workdir"),
    (dict(hypotheses_file="h"), "--hypotheses_file needs --references_file"),
    (dict(hypotheses_file="h", references_file="r", beam_size=4), "--workdir, --beam_size would be ignored"),
]


@pytest.mark.parametrize("options, message", BAD_OPTIONS, ids=[next(iter(o)) for o, _ in BAD_OPTIONS])
def test_bad_flag_values_fail_before_restoring(tmp_path, monkeypatch, options, message):
    monkeypatch.setattr(checkpoints, "list_steps", lambda workdir: pytest.fail("a checkpoint was looked at"))
    options = {"workdir": str(tmp_path), **options}
    with pytest.raises(EvalError, match=message):
        evaluate(dict(**options))


def test_a_bad_config_eval_value_names_the_config_key(tmp_path, files):
    src, _ = files
    config = tiny_config()
    config.eval.beam_size = 0
    three_checkpoints(tmp_path, config)
    with pytest.raises(EvalError, match=r"config\.eval\.beam_size\b.* got 0"):
        evaluate(dict(workdir=str(tmp_path), source_file=str(src), output_file=str(tmp_path / "o")))


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "args, message",
    [
        (["--beam_size", "0"], "--beam_size: must be positive (an integer >= 1, beams), got 0"),
        # The same options.parse path as the first (test_bad_flag_values_fail_before_restoring covers each value
        # in-process); a subprocess costs ~2 s of imports, so these run with -m slow.
        pytest.param(
            ["--alpha", "nan"], "--alpha: must be >= 0 (a number, length penalty exponent), got nan", marks=SLOW
        ),
        pytest.param(
            ["--checkpoint", "abc"], "--checkpoint must be 'latest', 'best' or a step number, got 'abc'", marks=SLOW
        ),
        pytest.param(["--average_steps", "1,x"], "--average_steps must be step numbers", marks=SLOW),
    ],
)
def test_bad_flag_values_on_the_command_line_are_one_line(tmp_path, args, message):
    assert_one_error_line(run_evaluate("--workdir", str(tmp_path / "none"), *args), message)
    assert not (tmp_path / "none").exists()  # nothing created
