"""The metric writer: WORKDIR/metrics.jsonl (one JSON object per logged step), always, and the experiment trackers
of train.trackers (training/trackers.py: TensorBoard by default, W&B, MLflow). The progress display is
transformer_jax.runtime.progress."""

from __future__ import annotations

import errno
import json
import logging
import os
import pathlib
from typing import Any

import jax
import ml_collections

from transformer_jax.config import checks, schema
from transformer_jax.errors import DiskFullError
from transformer_jax.runtime import files
from transformer_jax.training.trackers import Trackers


class MetricWriter:
    """Writes on process 0 only; every record is written through at once so a crash loses nothing already logged.

    A record is one append of one line: a full disk (or any failed write) truncates the file back to the records
    before it, so metrics.jsonl never ends in a partial line, and is one DiskFullError line naming the file and
    the step. The trackers get each record's numbers after it is written, and a failed write there is the same line.

    A run resumed from the checkpoint of `resume_step` logs the steps after it again, so the records after that step
    (written by the run that was interrupted) are first moved out of metrics.jsonl into metrics.superseded.jsonl:
    each step is logged once (trackers.py says how each tracker continues).

    `config` names the trackers (train.trackers, train.tracker_group) and is their parameters; None: the default
    trackers, with no parameters.
    """

    def __init__(
        self, workdir: str | pathlib.Path, resume_step: int = 0, config: ml_collections.ConfigDict | None = None
    ):
        self.enabled = jax.process_index() == 0
        self.path = pathlib.Path(workdir) / "metrics.jsonl"
        self._jsonl, self._trackers = None, None
        self.latest: dict[str, float] = {}  # the last value of every number written by this start
        self.last_step = resume_step
        if self.enabled:
            if resume_step and self.path.exists():
                drop_records_after(self.path, resume_step)
            self._jsonl = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # closed in close()
            if config is None:
                names, group, params = schema.BY_NAME["train.trackers"].default, "", {}
            else:
                names, group, params = config.train.trackers, config.train.tracker_group, dict(checks.leaves(config))
            self._trackers = Trackers(checks.tracker_packages(names), workdir, group, params, resume_step)

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
        numbers = {k: v for k, v in record.items() if k != "step" and isinstance(v, int | float)}
        self.latest.update(numbers)
        self.last_step = step
        try:
            self._trackers.log(step, numbers)
        except OSError as e:
            raise self._failed(step, e) from None

    def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        """Gives the trackers the run's final scores: the last value of every number written by this start, with
        the numbers of `result` (the training loop's: stopped_early_at) and final_step. Returns `result`."""
        if self.enabled:
            final = {**self.latest, **{k: v for k, v in result.items() if isinstance(v, int | float)}}
            self._trackers.finish(self.last_step, {**final, "final_step": self.last_step})
        return result

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
            self._trackers.close()


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
