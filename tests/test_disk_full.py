"""A full disk while the metrics, the tokenized store or evaluate.py's outputs are written (issue #30): one line
(a DiskFullError naming the file and the space free), and no partial file that looks complete. The fault is
injected at the write call (ENOSPC after part of the bytes, as a filling disk does); checkpoints are in
tests/test_checkpoint_faults.py; the slow test at the end fills a real tmpfs where one can be mounted."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO
from tests.helpers.training import tiny_train_config, write_corpus
from transformer_jax import runtime
from transformer_jax.data import store
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.errors import DiskFullError
from transformer_jax.model.layers import SpecialIds
from transformer_jax.training import metrics
from transformer_jax.training.metrics import MetricWriter, read_metrics

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_is_recognised_however_it_arrives():
    tensorstore = ValueError("RESOURCE_EXHAUSTED: Failed to write 12947 bytes to file 13: No space left on device")
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = tensorstore
    assert runtime.is_disk_full(ENOSPC) and runtime.is_disk_full(wrapped)
    assert runtime.is_disk_full(ExceptionGroup("writes", [ValueError("x"), OSError(errno.EDQUOT, "quota")]))
    assert not runtime.is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not runtime.is_disk_full(ValueError("RESOURCE_EXHAUSTED: out of memory"))


def test_a_full_disk_while_logging_metrics_leaves_only_whole_records(tmp_path, monkeypatch):
    writer = MetricWriter(tmp_path)
    writer.write(1, {"loss": 2.5})
    real_write = os.write

    def half_then_full(fd, data):  # the first half of the line reaches the file, then the disk is full
        real_write(fd, data[: len(data) // 2])
        raise ENOSPC

    monkeypatch.setattr(metrics.os, "write", half_then_full)
    with pytest.raises(DiskFullError, match=rf"metrics of step 2 to {tmp_path} \(.* free\); metrics.jsonl holds"):
        writer.write(2, {"loss": 2.4})
    monkeypatch.undo()
    writer.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.5}]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("}\n")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pathlib.Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def test_a_full_disk_while_building_the_store_leaves_no_store(corpus, tmp_path, monkeypatch):
    config = tiny_train_config(corpus).data
    tok = tokenizer_lib.get_tokenizer(config, tmp_path, vocab_size=320, ids=SpecialIds.DEFAULT)
    real_append = store._NpyWriter.append
    calls = []

    def full_after_the_first(self, array):
        calls.append(self.path.name)
        if len(calls) > 3:
            raise ENOSPC
        real_append(self, array)

    monkeypatch.setattr(store._NpyWriter, "append", full_after_the_first)
    with pytest.raises(DiskFullError, match=r"building the tokenized training store .*spm.train.en-de.store \(.*free"):
        store.open_train_store(config, tok, build_if_missing=True, num_threads=1)
    assert [p.name for p in tmp_path.iterdir()] == ["spm.model"]  # no store, no .building directory


@pytest.mark.parametrize("which", ["hypotheses", "report"])
def test_a_full_disk_while_writing_an_evaluation_output_keeps_the_earlier_file(tmp_path, monkeypatch, which):
    out = tmp_path / "out.txt"
    out.write_text("an earlier complete file\n")
    real_replace = os.replace

    def full(*args):  # the temporary file is written, the disk fills before it is complete
        raise ENOSPC

    monkeypatch.setattr(runtime.os, "replace", full)
    with pytest.raises(DiskFullError, match=rf"disk full while writing {out} \(needs about .* free\); nothing was"):
        if which == "hypotheses":
            runtime.write_lines(str(out), ["ein hund", "eine katze"])
        else:
            runtime.write_json(str(out), {"scores": 1})
    monkeypatch.setattr(runtime.os, "replace", real_replace)
    assert out.read_text() == "an earlier complete file\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]  # the temporary file is gone


@contextlib.contextmanager
def small_filesystem(path: pathlib.Path, size: str):
    """A tmpfs of `size` mounted at `path` (root only), unmounted afterwards; skips the test where none mounts."""
    path.mkdir(parents=True)
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.slow
def test_train_py_on_a_full_filesystem_is_one_line_and_resumes_once_space_is_freed(corpus, tmp_path):
    """The issue's reproduction on a real filesystem: train.py on a tmpfs with room for two checkpoints of the
    tiny model (~0.7 MB each) but not three, ckpt.keep=2: one error line naming step 9, checkpoints 3 and 6 kept,
    no temporary directory; after the filesystem grows, the same command resumes from step 6."""
    with small_filesystem(tmp_path / "small", "1700k") as small:
        workdir = small / "run"
        overrides = {
            "data.text_dir": corpus,
            "train.num_steps": 12,
            "train.eval_every": 0,
            "ckpt.keep": 2,
            "ckpt.async_save": True,
        }
        command = [
            *(sys.executable, str(REPO / "train.py"), "--config", str(REPO / "tests" / "tiny_train_config.py")),
            *("--workdir", str(workdir), *(f"--config.{k}={v}" for k, v in overrides.items())),
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 1, result.stderr[-3000:]
        assert "Traceback" not in result.stderr and "No space left" not in result.stderr.split("error: ")[0]
        errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and errors[0].startswith("train.py: error: disk full while saving the checkpoint of")
        assert "step 9" in errors[0] and "resumes from step 6" in errors[0], errors
        assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["3", "6"]
        assert all(json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines())
        subprocess.run(["mount", "-o", "remount,size=4m", str(small)], check=True)
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "resumed from the checkpoint at step 6" in result.stderr
        assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [9, 12]
