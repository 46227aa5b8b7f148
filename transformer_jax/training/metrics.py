"""The metric writer: WORKDIR/metrics.jsonl (one JSON object per logged step), always (the sweep reads it), and the
experiment trackers of train.trackers: TensorBoard by default, Weights & Biases and MLflow. The progress display is
transformer_jax.runtime.Progress.

MetricWriter hands each record it writes to metrics.jsonl to `Trackers.log` and the run's final scores to
`Trackers.finish`, so the training loop knows no tracker. Each tracker gets the resolved config as parameters
(dotted keys: model.d_model, ...), every metric of metrics.jsonl at its step, and the final scores: the last value
of every metric (and stopped_early_at, final_step) as W&B's run summary, MLflow's `final/<metric>` metrics and
TensorBoard's hparams (tensorboard/hparams).

wandb and mlflow are optional packages, imported only here and only when named; train.py and the sweep
(config/checks.py's validate, training=True) have refused a missing one before any work. W&B takes its mode,
project and directory from the environment as it always does (WANDB_MODE, WANDB_PROJECT, WANDB_DIR; without
WANDB_DIR its files go in WORKDIR/wandb, and without WANDB_PROJECT the project is transformer_jax); MLflow its store
from MLFLOW_TRACKING_URI. train.tracker_group is the W&B group and the MLflow experiment (DEFAULT_EXPERIMENT when
empty).

Resume: a restarted run continues its tracker runs. WORKDIR/trackers.json keeps each tracker's run id and the last
step it was given; the step is written there before the record is handed over, so a crash can lose a step in a
tracker but never log one twice. A resumed run trains the steps after its checkpoint again (their first records
move to metrics.superseded.jsonl); W&B refuses a step lower than its last and MLflow would keep both values, so
W&B and MLflow skip every record of a step <= the last step they were given before the restart, and keep the
interrupted run's values for those steps (a resume is exact: the losses are the same, the timings differ).
TensorBoard instead purges its events after the checkpoint's step and gets those steps again, as before trackers.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pathlib
import sys
import time
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import ml_collections

from transformer_jax import runtime
from transformer_jax.config import checks, schema
from transformer_jax.errors import DiskFullError


class MetricWriter:
    """Writes on process 0 only; every record is written through at once so a crash loses nothing already logged.

    A record is one append of one line: a full disk (or any failed write) truncates the file back to the records
    before it, so metrics.jsonl never ends in a partial line, and is one DiskFullError line naming the file and
    the step. The trackers get each record's numbers after it is written, and a failed write there is the same line.

    A run resumed from the checkpoint of `resume_step` logs the steps after it again, so the records after that step
    (written by the run that was interrupted) are first moved out of metrics.jsonl into metrics.superseded.jsonl:
    each step is logged once (the module's docstring says how each tracker continues).

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
            self._trackers = Trackers(names, workdir, group, params, resume_step)

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
        if not runtime.is_disk_full(error):
            return error
        return DiskFullError(
            f"disk full while writing the metrics of step {step} to {self.path.parent} "
            f"({runtime.space_report(self.path)}); {self.path.name} holds the records before it, whole. Free space "
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
        runtime.write_text_atomically(path, "".join(kept))  # a crash leaves the old file or the new one
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


# The experiment trackers.

STATE_FILE = "trackers.json"  # in the workdir: {tracker: {"id": run id, "last_step": step}}
DEFAULT_EXPERIMENT = "transformer_jax"  # MLflow's experiment (and W&B's project) when nothing else names one
MLFLOW_BATCH = 100  # MLflow's limit of parameters per log_batch call


class Tracker(Protocol):
    """One experiment tracker's run, continued across restarts. `run_id` is what trackers.json keeps (None: the
    tracker keeps nothing, like TensorBoard, whose files are in the workdir); `resumed` whether it continued a run
    of an earlier start."""

    run_id: str | None
    resumed: bool

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def finish(self, step: int, scores: dict[str, float]) -> None: ...

    def close(self, failed: bool) -> None: ...


class Trackers:
    """The trackers a run names, as one: what MetricWriter calls. Opened on process 0 only (as metrics.jsonl)."""

    def __init__(
        self,
        names: tuple[str, ...],
        workdir: str | os.PathLike,
        group: str = "",
        params: Mapping[str, Any] | None = None,
        resume_step: int = 0,
    ):
        workdir = pathlib.Path(workdir)
        self.state_path = workdir / STATE_FILE
        self.state: dict[str, dict[str, Any]] = (
            json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        )
        params = dict(params or {})
        self.trackers: dict[str, Tracker] = {}
        self.floor: dict[str, int] = {}  # records of steps <= floor were logged before this start
        for name in names:
            saved = self.state.get(name, {})
            tracker = OPENERS[name](workdir, group, params, resume_step, saved.get("id"))
            self.trackers[name] = tracker
            self.floor[name] = saved.get("last_step", -1) if tracker.resumed else -1
            if tracker.run_id is not None:
                self.state[name] = {"id": tracker.run_id, "last_step": self.floor[name]}
        self._save()
        self.finished = False

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One record of metrics.jsonl, to every tracker that has not had this step before this start."""
        due = [name for name in self.trackers if step > self.floor[name]]
        marked = [name for name in due if name in self.state and self.state[name]["last_step"] < step]
        for name in marked:
            self.state[name]["last_step"] = step
        if marked:
            self._save()  # before the trackers get it: a crash may lose this step there, never log it twice
        for name in due:
            self.trackers[name].log(step, metrics)

    def finish(self, step: int, scores: dict[str, float]) -> None:
        """The run's final scores (its end, or a stop that saved a checkpoint; a restart updates them)."""
        for tracker in self.trackers.values():
            tracker.finish(step, scores)
        self.finished = True

    def close(self) -> None:
        """Ends every tracker run: finished after `finish`, failed otherwise (an exception ended the run)."""
        for tracker in self.trackers.values():
            tracker.close(failed=not self.finished)

    def _save(self) -> None:
        if self.state:
            runtime.write_text_atomically(self.state_path, json.dumps(self.state, indent=1))


class TensorBoard:
    """WORKDIR/tensorboard (tensorboardX). A resumed run purges the events after its checkpoint's step and logs
    those steps again; the final scores and the config are its hparams (tensorboard/hparams)."""

    run_id, resumed = None, False

    def __init__(self, workdir: pathlib.Path, group: str, params: dict[str, Any], resume_step: int, _: str | None):
        self.params = {k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in params.items()}
        purge = {"purge_step": resume_step + 1} if resume_step else {}
        self.writer = _summary_writer_class()(str(workdir / "tensorboard"), **purge)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self, step: int, scores: dict[str, float]) -> None:
        if self.params:
            self.writer.add_hparams(self.params, scores, name="hparams", global_step=step)

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandB:
    """A Weights & Biases run (wandb.init), continued by its id (resume="allow": an id the server has not seen,
    such as that of a run still offline, starts it)."""

    def __init__(self, workdir: pathlib.Path, group: str, params: dict[str, Any], resume_step: int, run_id: str | None):
        import wandb

        where = {} if os.environ.get("WANDB_DIR") else {"dir": str(workdir)}
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_EXPERIMENT,
            group=group or None,
            name=workdir.name,
            id=run_id,
            resume="allow",
            notes=str(workdir.resolve()),
            # W&B's console capture would wrap sys.stdout and sys.stderr of the whole process.
            settings=wandb.Settings(console="off"),
            **where,
        )
        self.run.config.update(params, allow_val_change=True)  # a restart may change keys that may change
        self.run_id, self.resumed = self.run.id, run_id is not None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def finish(self, step: int, scores: dict[str, float]) -> None:
        self.run.summary.update(scores)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MLflow:
    """An MLflow run in the experiment train.tracker_group (DEFAULT_EXPERIMENT when empty) of MLFLOW_TRACKING_URI's
    store, continued by its id; an id the store does not hold (another store) starts a new run."""

    def __init__(self, workdir: pathlib.Path, group: str, params: dict[str, Any], resume_step: int, run_id: str | None):
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        run = None
        if run_id is not None:
            try:
                run = self.client.get_run(run_id)
            except MlflowException:
                logging.warning("MLflow run %s of %s is not in this store; starting a new run", run_id, STATE_FILE)
        self.resumed = run is not None
        if run is None:
            name = group or DEFAULT_EXPERIMENT
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            run = self.client.create_run(experiment_id, run_name=workdir.name, tags={"workdir": str(workdir.resolve())})
        else:
            self.client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        logged = run.data.params
        # MLflow refuses to change a logged parameter: a value a restart changed goes in a tag beside it.
        for key, value in params.items():
            if key in logged and logged[key] != str(value):
                self.client.set_tag(self.run_id, f"resumed_with.{key}", str(value))
        new = [Param(key, str(value)) for key, value in params.items() if key not in logged]
        for start in range(0, len(new), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=new[start : start + MLFLOW_BATCH])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def finish(self, step: int, scores: dict[str, float]) -> None:
        self.log(step, {f"final/{key}": value for key, value in scores.items()})

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


OPENERS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


def _summary_writer_class() -> type:
    """tensorboardX's SummaryWriter, imported without torch.

    tensorboardX imports torch whenever it is installed (requirements-dev.txt installs it), only to accept torch
    tensors, which we never pass, and a starting run would wait for that import. The import runs with torch marked
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
