"""Where a sweep's runs train (docs/cluster.md): in the sweep's own process one after another (`sequential`), or as
submitit jobs, one per run, on this machine (`local`: at most `parallel` processes at once, the command submitting
the next as one ends and waiting for the last) or on a SLURM cluster (`slurm`: one job array, `--array=0-N%K`; the
command returns once it is queued). Jobs import a snapshot of the package taken at submission (DIR/code/).

DIR/jobs.json keeps each run's last job (launcher, id, submitit folder, host, split), so that a command run again,
or --status, asks for its state and never submits a second job for a run that is pending or running; a run whose
job ended unfinished is submitted again. DIR/sweep.lock makes one command at a time own DIR; submitit's job
scripts, pickles and logs go in DIR/jobs/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import shlex
import signal
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import ml_collections

from transformer_jax import runtime
from transformer_jax.cli import exit_on_user_error
from transformer_jax.errors import ConfigError, VariantInterrupted
from transformer_jax.sharding import initialize_distributed
from transformer_jax.sweep.results import RESULT_FILE, SPLITS, VALID, Split, decoded
from transformer_jax.sweep.runner import PROG, configure_logging, snapshot_code, train_and_decode
from transformer_jax.training import bookkeeping
from transformer_jax.training.checkpoints import list_steps

# Importing submitit runs logging.config.dictConfig unless SUBMITIT_LOG_LEVEL is NOCONFIG, and dictConfig closes
# every logging handler the process already has (absl's, a log file, pytest's capture): importing the sweep must
# change no setting of the process. A SUBMITIT_LOG_LEVEL the user set is respected; jobs, in processes of their own,
# get submitit's usual configuration. Import submitit from here, never directly.
_given = os.environ.get("SUBMITIT_LOG_LEVEL")
os.environ.setdefault("SUBMITIT_LOG_LEVEL", "NOCONFIG")
try:
    import submitit
    from submitit.core.utils import FailedJobError, JobPaths
finally:
    if _given is None:
        del os.environ["SUBMITIT_LOG_LEVEL"]

LAUNCHERS = ("sequential", "local", "slurm")
JOBS_FILE = "jobs.json"
LOCK_NAME = "sweep.lock"
POLL_S = 2.0  # how often the local launcher looks at its jobs
# sacct's states (the first word: "CANCELLED by 123") of a job that has not ended.
SLURM_PENDING = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RESIZING", "SUSPENDED")
SLURM_RUNNING = ("RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING")


@dataclasses.dataclass(frozen=True)
class Launcher:
    """How a sweep runs its runs: the --launcher flag (name) and the flags named as the other fields."""

    name: str = "sequential"
    parallel: int | None = None  # most runs at once; None: 1 for local, every run for slurm
    time_min: float = 24 * 60  # a job's time limit, minutes; submitit's signal comes before it
    gpus_per_node: int = 0  # local: the GPUs each job sees (CUDA_VISIBLE_DEVICES=0..N-1); slurm: per node
    # What each SLURM job asks for (None: the cluster's default).
    slurm_partition: str | None = None
    slurm_nodes: int = 1
    slurm_cpus_per_task: int | None = None
    slurm_mem: str | None = None  # e.g. "64G": memory per node
    slurm_account: str | None = None
    slurm_qos: str | None = None
    slurm_extra: tuple[str, ...] = ()  # "key=value": #SBATCH --key=value; "key": #SBATCH --key


def preemption_signal() -> signal.Signals:
    """The signal submitit sends before a time limit (USR2 unless $SUBMITIT_PREEMPT_SIGNAL names another)."""
    return signal.Signals["SIG" + submitit.JobEnvironment.USR_SIG]


class _Preempted(VariantInterrupted):
    """The preemption signal arrived outside training and decoding (nothing to save)."""


@dataclasses.dataclass(frozen=True)
class RunJob(submitit.helpers.Checkpointable):
    """One (variant, seed) run, what every launcher runs. Called (as a submitit job), it trains and decodes the run
    as the sequential launcher does; a user error is one line `PROG: error: ...` (the last line of its log, which
    --status shows). Returns its label.

    On submitit's preemption signal (USR2, before a time limit) the job first does what SIGTERM does (the training
    loop saves at the next step boundary; a decode is abandoned), then hands the signal to submitit's handler, which
    requeues `checkpoint()`'s submission: called straight from the signal, it would stop training mid-step.
    """

    label: str
    config: ml_collections.ConfigDict
    run_dir: pathlib.Path
    split: Split  # the command's --split: the run is finished once decoded on split.decodes
    compilation_cache: str | None  # the sweep command's --compilation_cache (None: its default)

    def __call__(self) -> str:
        configure_logging()
        runtime.enable_compile_cache(self.compilation_cache)
        with exit_on_user_error(PROG, 1):
            initialize_distributed()
            self._run()
        return self.label

    def _run(self) -> None:
        usr = preemption_signal()
        requeue = signal.getsignal(usr)  # submitit's: calls checkpoint(), requeues, exits
        idle = signal.getsignal(signal.SIGTERM)  # what SIGTERM does outside training and decoding
        received: list[tuple[int, Any]] = []

        def stop(signum: int, frame: Any) -> None:
            received.append((signum, frame))
            current = signal.getsignal(signal.SIGTERM)
            if current is idle or not callable(current):
                raise _Preempted(f"run {self.label} preempted before training or between training and decoding")
            current(signal.SIGTERM, frame)  # the loop's StopRequest (saves, then returns) or the decoder's

        signal.signal(usr, stop)
        try:
            train_and_decode(self.label, self.config, self.run_dir, self.split)
        except VariantInterrupted:
            if not received or not callable(requeue):
                raise  # a plain SIGTERM: the job ends; the next sweep command resubmits the run
            logging.warning("sweep: %s: %s received; its checkpoint is saved, requeueing", self.label, usr.name)
            requeue(*received[0])  # exits (SystemExit) in the first process; the others return here
            raise
        finally:
            signal.signal(usr, requeue)

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """submitit's protocol, called once the loop has saved a checkpoint: the same run, which resumes from it."""
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


@contextlib.contextmanager
def owned(sweep_dir: pathlib.Path) -> Iterator[None]:
    """DIR/sweep.lock for this command; WorkdirLocked (a UserError: one line) while another command owns DIR."""
    path = bookkeeping.acquire(sweep_dir, LOCK_NAME, "sweep command")
    try:
        yield
    finally:
        bookkeeping.release(path)


def load_jobs(sweep_dir: pathlib.Path) -> dict[str, dict[str, Any]]:
    path = sweep_dir / JOBS_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def _save_jobs(sweep_dir: pathlib.Path, jobs: dict[str, dict[str, Any]]) -> None:
    runtime.write_text_atomically(sweep_dir / JOBS_FILE, json.dumps(jobs, indent=1) + "\n")


def _python(launcher: Launcher, snapshot: pathlib.Path) -> str:
    """The job's interpreter command: the snapshot first on the import path, and -P so that the working directory
    (a checkout, perhaps) is not put before it; a multi-node job joins jax.distributed."""
    path = os.pathsep.join(p for p in (str(snapshot), os.environ.get("PYTHONPATH", "")) if p)
    env = [f"PYTHONPATH={path}"]
    if launcher.name == "slurm" and launcher.slurm_nodes > 1:
        env.append("TRANSFORMER_JAX_DISTRIBUTED=1")
    return shlex.join(["env", *env, sys.executable, "-P"])


def executor(launcher: Launcher, folder: pathlib.Path, snapshot: pathlib.Path, count: int) -> submitit.AutoExecutor:
    """submitit's executor for `count` runs with the launcher's settings (the table in docs/cluster.md)."""
    python = _python(launcher, snapshot)
    ex = submitit.AutoExecutor(folder, cluster=launcher.name, **{f"{launcher.name}_python": python})
    common: dict[str, Any] = {"name": f"sweep-{folder.parent.name}", "tasks_per_node": 1}
    if launcher.name == "local":
        # submitit's local executor takes fractional minutes (the tests' short limits); AutoExecutor's generic
        # timeout_min only whole ones.
        ex.update_parameters(**common, local_timeout_min=launcher.time_min, gpus_per_node=launcher.gpus_per_node)
        return ex
    extra = {key: value if sep else True for key, sep, value in (item.partition("=") for item in launcher.slurm_extra)}
    ex.update_parameters(
        **common,
        timeout_min=max(1, round(launcher.time_min)),
        nodes=launcher.slurm_nodes,
        gpus_per_node=launcher.gpus_per_node or None,
        cpus_per_task=launcher.slurm_cpus_per_task,
        slurm_partition=launcher.slurm_partition,
        slurm_mem=launcher.slurm_mem,
        slurm_account=launcher.slurm_account,
        slurm_qos=launcher.slurm_qos,
        slurm_additional_parameters=extra or None,
        slurm_array_parallelism=launcher.parallel or count,
    )
    return ex


def _local_alive(record: dict[str, Any]) -> bool:
    """Whether a local job's controller process (its id) still runs on this host."""
    if record.get("host") != socket.gethostname():
        return True  # cannot be checked from here; assume it runs rather than start a second copy
    try:
        os.kill(int(record["job_id"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def job_state(record: dict[str, Any]) -> str:
    """'pending', 'running' or 'ended' for a recorded job: the process on this host, or SLURM's accounting."""
    if record["launcher"] == "local":
        return "running" if _local_alive(record) else "ended"
    job = submitit.SlurmJob(folder=record["folder"], job_id=record["job_id"])
    state = job.watcher.get_state(job.job_id, mode="force").split()[0]
    if state in SLURM_PENDING or state == "UNKNOWN":  # UNKNOWN: accounting has not seen a new job yet
        return "pending"
    return "running" if state in SLURM_RUNNING else "ended"


def last_log_line(record: dict[str, Any]) -> str:
    """The last non-empty line of a job's stderr log (else its stdout), or '' when there is none."""
    paths = JobPaths(record["folder"], job_id=record["job_id"], task_id=0)
    for path in (paths.stderr, paths.stdout):
        if path.exists():
            lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
            if lines:
                return lines[-1]
    return ""


def run_state(run_dir: pathlib.Path, record: dict[str, Any] | None, split: Split) -> tuple[str, str]:
    """A run's state and what to add: finished (trained and decoded on split.decodes); pending or running (its
    job); failed (its job ended without finishing the run: the last line of its log); not decoded (trained and
    decoded on the validation split, not yet on this split); interrupted (the sequential launcher stopped it); not
    started."""
    if all(decoded(run_dir, s) for s in split.decodes):
        return "finished", ""
    if record is not None:
        state = job_state(record)
        if state != "ended":
            return state, f"{record['launcher']} job {record['job_id']}"
        asked = SPLITS[record.get("split", VALID.name)]  # jobs recorded before --split decoded the validation split
        if not decoded(run_dir, VALID) or set(split.decodes) <= set(asked.decodes):
            return "failed", last_log_line(record) or f"{record['launcher']} job {record['job_id']} left no log"
        # Its job did what an earlier command asked; this command's split is still to decode.
    if decoded(run_dir, VALID):
        return (
            "not decoded",
            f"the {split.description} split is not decoded yet; run the sweep with --split {split.name}",
        )
    reached = max(list_steps(run_dir), default=0) if run_dir.is_dir() else 0
    if reached or (run_dir / RESULT_FILE).exists():
        return "interrupted", f"checkpoint at step {reached}; run the sweep again to resume"
    return "not started", ""


def _record(launcher: Launcher, job: submitit.Job, folder: pathlib.Path, split: Split) -> dict[str, Any]:
    return {
        "launcher": launcher.name,
        "job_id": str(job.job_id),
        "folder": str(folder),
        "host": socket.gethostname(),
        "split": split.name,
        "submitted": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def launch(launcher: Launcher, tasks: Sequence[RunJob], sweep_dir: pathlib.Path) -> dict[str, str]:
    """Submits every task that is neither finished nor pending or running; local: waits until all have ended.

    Returns each task's state afterwards (run_state's first part)."""
    jobs = load_jobs(sweep_dir)
    states = {t.label: run_state(t.run_dir, jobs.get(t.label), t.split)[0] for t in tasks}
    todo = [t for t in tasks if states[t.label] not in ("finished", "pending", "running")]
    folder = sweep_dir / "jobs"
    ex = executor(launcher, folder, snapshot_code(sweep_dir / "code"), len(todo)) if todo else None
    if launcher.name == "local":
        _run_local(launcher, ex, todo, [t for t in tasks if states[t.label] == "running"], sweep_dir, jobs)
    elif todo:
        assert ex is not None
        try:
            with ex.batch():  # one job array, at most `parallel` running at once
                submitted = [ex.submit(t) for t in todo]
        except FailedJobError as e:  # sbatch refused (an unknown partition, an account without access, ...)
            last = ([line for line in str(e).splitlines() if line.strip()] or ["no message"])[-1]
            raise ConfigError(f"sbatch refused the sweep's jobs ({last}); check the --slurm_* flags") from None
        for t, job in zip(todo, submitted, strict=True):
            jobs[t.label] = _record(launcher, job, folder, t.split)
        _save_jobs(sweep_dir, jobs)
    return {t.label: run_state(t.run_dir, load_jobs(sweep_dir).get(t.label), t.split)[0] for t in tasks}


def _run_local(
    launcher: Launcher,
    ex: submitit.AutoExecutor | None,
    todo: list[RunJob],
    running: list[RunJob],
    sweep_dir: pathlib.Path,
    jobs: dict[str, dict[str, Any]],
) -> None:
    """Local jobs, at most `parallel` at once: runs already running (from an earlier command) count and are waited
    for; the next task starts as one ends."""
    limit = launcher.parallel or 1
    queue = list(todo)
    earlier = {t.label: jobs[t.label] for t in running}
    live: dict[str, submitit.Job] = {}
    while queue or live or earlier:
        earlier = {label: r for label, r in earlier.items() if _local_alive(r)}
        live = {label: job for label, job in live.items() if not job.done()}
        while queue and len(live) + len(earlier) < limit:
            t = queue.pop(0)
            assert ex is not None
            live[t.label] = job = ex.submit(t)
            jobs[t.label] = _record(launcher, job, sweep_dir / "jobs", t.split)
            _save_jobs(sweep_dir, jobs)
        if queue or live or earlier:
            time.sleep(POLL_S)
