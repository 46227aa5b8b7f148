"""transformer_jax.translate_corpus: a corpus translated in committed chunks, resumed after a stop or a kill to the
same bytes as an uninterrupted run, with its scores beside it; bad lines kept in place; wrong resumes refused.

The model is a tiny untrained one saved as checkpoints with a SentencePiece tokenizer (what a workdir holds): what
is checked is the chunking and resuming, which do not depend on what the model learned.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.training import untrained_workdir, write_corpus
from transformer_jax.errors import EvalError
from transformer_jax.translate_corpus import run
from transformer_jax.translate_corpus.run import job_of, translate_corpus

GREEDY = {"beam_size": 1, "max_extra_len": 4, "batch_size": 8, "average_last": 1}
CHUNK = 4


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A workdir with a tokenizer and one checkpoint of a tiny (untrained) model."""
    root = tmp_path_factory.mktemp("translate_corpus")
    data = write_corpus(root / "data", n_train=100)
    return untrained_workdir(data, root / "workdir")


def write_input(path: Path) -> Path:
    """13 lines (4 chunks of 4): sentences, a blank line, a whitespace line, and one longer than eval_max_len."""
    lines = [f"the {w} dog runs in the park" for w in "red blue big small old young green".split()]
    lines[2:2] = ["", "   "]
    lines += [" ".join(["the big red dog"] * 20), "a cat", "water", "the man"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def reference(workdir, tmp_path_factory) -> tuple[Path, bytes, bytes, dict]:
    """An uninterrupted greedy run: (input, OUT bytes, OUT.scores bytes, report)."""
    root = tmp_path_factory.mktemp("reference")
    source = write_input(root / "in.en")
    out = root / "out.de"
    report = translate_corpus(job_of({"workdir": str(workdir), **GREEDY}, str(source), str(out), CHUNK))
    return source, out.read_bytes(), Path(run.scores_file(str(out))).read_bytes(), report


class Stop(Exception):
    """What the tests raise to stop a run after some chunks are committed (as a Ctrl-C would)."""


def stopped_after(monkeypatch, commits: int) -> None:
    """Chunk commits after the first `commits` raise Stop."""
    write = run.write_chunk
    count = [0]

    def limited(*args, **kwargs):
        if count[0] == commits:
            raise Stop
        count[0] += 1
        write(*args, **kwargs)

    monkeypatch.setattr(run, "write_chunk", limited)


def test_bad_lines_are_kept_in_place_with_nan_scores(reference):
    source, out, scores, report = reference
    sources = source.read_text(encoding="utf-8").splitlines()
    hypotheses = out.decode("utf-8").split("\n")[:-1]
    rows = [line.split("\t") for line in scores.decode().splitlines()]
    assert len(hypotheses) == len(rows) == len(sources) == report["lines"] == 13
    assert report["chunks"] == math.ceil(13 / CHUNK) and report["chunks_resumed"] == 0
    for source_line, hypothesis, (log_prob, score) in zip(sources, hypotheses, rows, strict=True):
        if source_line.strip():
            assert float(log_prob) < 0 and math.isfinite(float(score))  # decoded (an untrained model's text)
        else:
            assert hypothesis == "" and log_prob == score == "nan"
    assert report["counts"] == {"empty": 2, "truncated": 1, "hit_max_len": report["counts"]["hit_max_len"]}


def test_a_stopped_run_resumes_to_the_same_bytes_and_a_damaged_chunk_is_redone(
    workdir, reference, tmp_path, monkeypatch
):
    source, out, scores, _ = reference
    target = tmp_path / "out.de"
    # One stream: the chunks are committed in order, so the first two are chunks 0 and 1.
    job = job_of({"workdir": str(workdir), **GREEDY}, str(source), str(target), CHUNK, streams=1)
    stopped_after(monkeypatch, 2)
    with pytest.raises(Stop):
        translate_corpus(job)
    monkeypatch.undo()
    parts = run.parts_dir(str(target))
    assert sorted(p.name for p in parts.iterdir()) == ["0000000.json", "0000001.json", "state.json"]
    assert not target.exists()
    # A chunk cut short (as a non-atomic write killed half way would leave it) is detected and redone.
    damaged = run.chunk_path(parts, 1)
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    respelled = job_of({"workdir": f"{workdir}/./", **GREEDY}, str(source), str(target), CHUNK)  # the same workdir
    report = translate_corpus(respelled)
    assert report["chunks_resumed"] == 1 and report["chunks_redone"] == [1]
    assert target.read_bytes() == out and Path(run.scores_file(str(target))).read_bytes() == scores
    assert not parts.exists()


def test_a_resume_with_another_input_or_other_options_is_refused(workdir, tmp_path, monkeypatch):
    source = write_input(tmp_path / "in.en")
    target = str(tmp_path / "out.de")
    stopped_after(monkeypatch, 1)
    with pytest.raises(Stop):
        translate_corpus(job_of({"workdir": str(workdir), **GREEDY}, str(source), target, CHUNK))
    monkeypatch.undo()
    other = job_of({"workdir": str(workdir), **GREEDY, "beam_size": 2}, str(source), target, CHUNK)
    with pytest.raises(EvalError, match=r"other settings \(--beam_size 1 -> 2\).*delete \S+out.de.parts"):
        translate_corpus(other)
    with pytest.raises(EvalError, match=r"other settings \(--chunk_lines 4 -> 5\)"):
        translate_corpus(job_of({"workdir": str(workdir), **GREEDY}, str(source), target, CHUNK + 1))
    empty = tmp_path / "empty.en"
    empty.write_bytes(b"")
    with pytest.raises(EvalError, match=r"^--input \S+empty.en is empty: nothing to translate$"):
        translate_corpus(job_of({"workdir": str(workdir), **GREEDY}, str(empty), str(tmp_path / "e.de"), CHUNK))
    latin1 = tmp_path / "latin1.en"
    latin1.write_bytes("a dog\nthe café\n".encode("latin-1"))
    with pytest.raises(EvalError, match=r"latin1.en, line 2: invalid UTF-8"):  # as evaluate.py: one line, no output
        translate_corpus(job_of({"workdir": str(workdir), **GREEDY}, str(latin1), str(tmp_path / "l.de"), CHUNK))
    assert not run.parts_dir(str(tmp_path / "l.de")).exists()
    source.write_text("another corpus\n", encoding="utf-8")
    with pytest.raises(EvalError, match=r"--input \S+in.en differs from the file \S+ was started on"):
        translate_corpus(job_of({"workdir": str(workdir), **GREEDY}, str(source), target, CHUNK))


def test_an_output_that_is_the_input_is_refused_before_anything_is_read(tmp_path):
    source = write_input(tmp_path / "in.en")
    os.link(source, tmp_path / "link.en")
    for output in (source, tmp_path / "link.en", tmp_path / "sub" / ".." / "in.en"):
        with pytest.raises(EvalError, match=r"--output \S+ is the input --input .*choose another output file"):
            job_of({"workdir": str(tmp_path / "w")}, str(source), str(output), CHUNK)
    with pytest.raises(EvalError, match="--chunk_lines must be >= 1"):
        job_of({"workdir": str(tmp_path / "w")}, str(source), str(tmp_path / "o"), 0)
    with pytest.raises(EvalError, match="--streams must be >= 0"):
        job_of({"workdir": str(tmp_path / "w")}, str(source), str(tmp_path / "o"), CHUNK, streams=-1)
    with pytest.raises(EvalError, match="--temperature goes with --sampling"):
        job_of({"workdir": str(tmp_path / "w"), "temperature": 0.5}, str(source), str(tmp_path / "o"), CHUNK)


def test_sampling_resumed_equals_uninterrupted_and_draws_by_line_number(workdir, reference, tmp_path, monkeypatch):
    source, greedy, _, _ = reference
    sampling = {"workdir": str(workdir), **GREEDY, "sampling": True, "seed": 3}
    whole, resumed = tmp_path / "whole.de", tmp_path / "resumed.de"
    translate_corpus(job_of(sampling, str(source), str(whole), CHUNK))
    stopped_after(monkeypatch, 1)
    with pytest.raises(Stop):
        translate_corpus(job_of(sampling, str(source), str(resumed), CHUNK))
    monkeypatch.undo()
    assert translate_corpus(job_of(sampling, str(source), str(resumed), CHUNK))["chunks_resumed"] == 1
    assert whole.read_bytes() == resumed.read_bytes() != greedy
    assert Path(run.scores_file(str(whole))).read_bytes() == Path(run.scores_file(str(resumed))).read_bytes()
    # A line's draw depends on the seed and its number in the input, not on the chunk it falls in.
    one_chunk = tmp_path / "one_chunk.de"
    translate_corpus(job_of(sampling, str(source), str(one_chunk), 16))
    assert one_chunk.read_bytes() == whole.read_bytes()


def test_streams_decode_chunks_at_once_to_the_same_bytes(workdir, reference, tmp_path, monkeypatch):
    source, out, scores, report = reference
    assert report["streams"] == run.CPU_STREAMS == run.streams_per_device(0)  # the default on a CPU
    assert run.streams_per_device(3) == 3
    # The first two chunks must be in translation at the same time: each waits at the barrier for the other (one
    # stream would wait alone and time out).
    both = threading.Barrier(2, timeout=60)
    calls = []
    translate = run.translate_nbest

    def together(*args, **kwargs):
        calls.append(threading.get_ident())
        if len(calls) <= 2:
            both.wait()
        return translate(*args, **kwargs)

    monkeypatch.setattr(run, "translate_nbest", together)
    target = tmp_path / "out.de"
    report = translate_corpus(job_of({"workdir": str(workdir), **GREEDY}, str(source), str(target), CHUNK, 3))
    assert report["streams"] == 3 and len(calls) == report["chunks"] and len(set(calls[:2])) == 2
    assert target.read_bytes() == out and Path(run.scores_file(str(target))).read_bytes() == scores


def run_command(workdir: Path, source: Path, output: Path, devices: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "transformer_jax.translate_corpus", "--workdir", str(workdir)]
    command += ["--input", str(source), "--output", str(output), "--chunk_lines", str(CHUNK)]
    command += [f"--{k}={v}" for k, v in GREEDY.items()]
    xla_flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_killed_command_resumes_on_two_devices_to_an_uninterrupted_runs_bytes(workdir, reference, tmp_path):
    source, out, scores, _ = reference
    big = tmp_path / "in.en"  # 20 chunks: the kill lands long before the last one
    big.write_text(source.read_text(encoding="utf-8") * 5 + "the dog\n" * 15, encoding="utf-8")
    target = tmp_path / "out.de"
    parts = run.parts_dir(str(target))
    first = run_command(workdir, big, target, devices=1)
    deadline = time.time() + 240
    while not run.chunk_path(parts, 0).exists():
        assert first.poll() is None, first.communicate()[1][-3000:]
        assert time.time() < deadline, "no chunk committed in 240 s"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    committed = len(list(parts.glob("0*.json")))
    assert 1 <= committed < 20 and not target.exists()
    second = run_command(workdir, big, target, devices=2)
    stdout, stderr = second.communicate(timeout=300)
    assert second.returncode == 0, stderr[-3000:]
    report = json.loads(stdout)
    assert report["devices"] == 2 and report["chunks_resumed"] == committed and report["lines"] == 80
    # The first 13 lines are the reference input's: the same translations, byte for byte.
    assert target.read_bytes().split(b"\n")[:13] == out.split(b"\n")[:13]
    whole = tmp_path / "whole.de"
    translate_corpus(job_of({"workdir": str(workdir), **GREEDY}, str(big), str(whole), CHUNK))
    assert target.read_bytes() == whole.read_bytes()
    assert Path(run.scores_file(str(target))).read_bytes() == Path(run.scores_file(str(whole))).read_bytes()
    assert scores.split(b"\n")[:13] == Path(run.scores_file(str(target))).read_bytes().split(b"\n")[:13]
