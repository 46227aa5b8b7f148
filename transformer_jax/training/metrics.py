"""Metric writers: WORKDIR/metrics.jsonl (one JSON object per logged step) and TensorBoard event files
(tensorboardX, no TensorFlow needed). The progress display is transformer_jax.runtime.progress."""

from __future__ import annotations

import errno
import json
import logging
import os
import pathlib
import sys

import jax

from transformer_jax.errors import DiskFullError
from transformer_jax.runtime import files


class MetricWriter:
    """Writes on process 0 only; every record is written through at once so a crash loses nothing already logged.

    A record is one append of one line: a full disk (or any failed write) truncates the file back to the records
    before it, so metrics.jsonl never ends in a partial line, and is one DiskFullError line naming the file and
    the step. TensorBoard's events are written after the record, and the same way.

    A run resumed from the checkpoint of `resume_step` logs the steps after it again, so the records after that step
    (written by the run that was interrupted) are first moved out of metrics.jsonl into metrics.superseded.jsonl,
    and TensorBoard is told to purge its events after that step: each step is logged once.
    """

    def __init__(self, workdir: str | pathlib.Path, resume_step: int = 0):
        self.enabled = jax.process_index() == 0
        self.path = pathlib.Path(workdir) / "metrics.jsonl"
        self._jsonl, self._tb = None, None
        if self.enabled:
            if resume_step and self.path.exists():
                drop_records_after(self.path, resume_step)
            self._jsonl = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # closed in close()
            SummaryWriter = _summary_writer_class()
            purge = {"purge_step": resume_step + 1} if resume_step else {}
            self._tb = SummaryWriter(str(pathlib.Path(workdir) / "tensorboard"), **purge)

    def write(self, step: int, metrics: dict[str, float], prefix: str = "") -> None:
        if not self.enabled:
            return
        record = {"step": step, **{f"{prefix}{k}": v for k, v in metrics.items()}}
        line = (json.dumps(record) + "\n").encode("utf-8")
        size = os.fstat(self._jsonl).st_size
        try:
            if os.write(self._jsonl, line) != len(line):
                raise OSError(errno.ENOSPC, "short write: " + os.strerror(errno.ENOSPC))
        except OSError as e:
            os.ftruncate(self._jsonl, size)
            raise self._failed(step, e) from None
        try:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        except OSError as e:
            raise self._failed(step, e) from None

    def _failed(self, step: int, error: OSError) -> Exception:
        """A full disk as one line; any other failure to write is re-raised as it is."""
        if not files.is_disk_full(error):
            return error
        return DiskFullError(
            f"disk full while writing the metrics of step {step} to {self.path.parent} "
            f"({files.space_report(self.path)}); {self.path.name} holds the records before it, whole. Free space "
            "there and run the same command again: it resumes from the last checkpoint and logs the steps after it"
        )

    def close(self) -> None:
        if self.enabled:
            os.close(self._jsonl)
            self._tb.close()


def _summary_writer_class() -> type:
    """tensorboardX's SummaryWriter, imported without torch.

    tensorboardX imports torch whenever it is installed (requirements-dev.txt installs it), only to accept torch
    tensors, which we never pass; that import costs a starting run about 1.5 s. The import runs with torch marked
    unavailable, and the mark is removed at once so that code importing torch afterwards gets it as usual. Imported
    here, not at the top, because the writer of a process other than 0 never needs it.
    """
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter
    else:
        sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tensorboardX expects
        try:
            from tensorboardX import SummaryWriter
        finally:
            del sys.modules["torch"]
    return SummaryWriter


def drop_records_after(path: pathlib.Path, step: int) -> int:
    """Moves the records of steps after `step` from a metrics.jsonl file to metrics.superseded.jsonl beside it
    (appended, kept for inspection); returns how many moved. Lines that are not JSON stay where they are."""
    kept, moved = [], []
    for line in path.read_text().splitlines(keepends=True):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        is_later = isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step
        (moved if is_later else kept).append(line if line.endswith("\n") else line + "\n")
    if moved:
        with open(path.with_name("metrics.superseded.jsonl"), "a") as f:
            f.writelines(moved)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)  # atomic: a crash leaves the old file or the new one
        logging.info("moved %d records of steps after %d from %s to metrics.superseded.jsonl", len(moved), step, path)
    return len(moved)


def read_metrics(path: str | pathlib.Path) -> list[dict]:
    """The records of a metrics.jsonl file; a malformed line is an error naming the file and line."""
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{number}: not a JSON object ({e})") from e
    return records
