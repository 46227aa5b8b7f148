"""What a run logs: WORKDIR/metrics.jsonl (one JSON object per logged step; the sweep reads it) and the experiment
trackers of train.trackers (docs/usage.md: TensorBoard, Weights & Biases, MLflow, each continued on resume); and
what it costs: FLOPs and MFU.

FLOPs: one multiply-add is 2; every matmul at the batch's padded shape (the work the hardware does); softmax,
norms, dropout and elementwise ops (a few percent) are not counted; a training step is 3x the forward pass.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pathlib
import sys
import time
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import ml_collections

from transformer_jax import cli, runtime
from transformer_jax.config import schema
from transformer_jax.errors import DiskFullError

if TYPE_CHECKING:  # annotations only: reading metrics.jsonl (the sweep, visualize) need not import the model
    from transformer_jax.model.layers import TransformerSpec


class MetricWriter:
    """Writes on process 0 only, each record at once as one appended line. A failed write truncates the file back
    to the records before it (never a partial line); a full disk, there or in a tracker, is one DiskFullError line.
    A run resumed at `resume_step` first moves the later records to metrics.superseded.jsonl, so each step is
    logged once. `config` names the trackers and is their parameters; None: the default trackers, no parameters."""

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
                names, group, params = config.train.trackers, config.train.tracker_group, dict(cli.leaves(config))
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
        """Gives the trackers the final scores: the last value of every number written by this start, the numbers
        of `result` (stopped_early_at) and final_step. Returns `result`."""
        if self.enabled:
            final = {**self.latest, **{k: v for k, v in result.items() if isinstance(v, int | float)}}
            self._trackers.finish(self.last_step, {**final, "final_step": self.last_step})
        return result

    def _failed(self, step: int, error: OSError) -> Exception:
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


def drop_records_after(path: pathlib.Path, step: int) -> None:
    """Moves the records of steps after `step` from a metrics.jsonl file to metrics.superseded.jsonl beside it
    (appended, kept for inspection). Lines that are not JSON stay where they are."""
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


class Trackers:
    """The trackers a run names, as one, for MetricWriter on process 0. Each (OPENERS) is one run continued across
    restarts: `run_id` is what trackers.json keeps (None for TensorBoard, whose files are in the workdir),
    `resumed` whether it continued an earlier start's run."""

    def __init__(self, names: tuple[str, ...], workdir: str | os.PathLike, group: str, params: dict, resume_step: int):
        workdir = pathlib.Path(workdir)
        self.state_path = workdir / STATE_FILE
        self.state: dict[str, dict[str, Any]] = (
            json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        )
        self.trackers: dict[str, TensorBoard | WandB | MLflow] = {}
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
    """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports an installed torch only to
    accept its tensors, which we never pass, and a starting run would wait for it. torch is marked unavailable for
    that import only, so later imports of torch get it as usual."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter
    else:
        sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tensorboardX expects
        try:
            from tensorboardX import SummaryWriter
        finally:
            del sys.modules["torch"]
    return SummaryWriter


# The cost of a run.

PEAK_FILE = "matmul_peak.json"  # in the compilation cache's per-host directory: {peak_key(): FLOP/s}


def _projections(spec: TransformerSpec, q_tokens: int, kv_tokens: int) -> float:
    """Query, key/value and output projections of one attention layer."""
    d, n, k, hq, hv = spec.d_model, spec.num_heads, spec.heads_kv, spec.d_qk, spec.d_v
    return 2 * (q_tokens * d * n * hq + kv_tokens * d * k * (hq + hv) + q_tokens * n * hv * d)


def _scores_and_mix(spec: TransformerSpec, q_len: int, kv_len: int) -> float:
    """Attention scores and the weighted sum of the values, for one sequence."""
    return 2 * q_len * kv_len * spec.num_heads * (spec.d_qk + spec.d_v)


def _ffn(spec: TransformerSpec, tokens: int) -> float:
    return 2 * (3 if spec.activation == "swiglu" else 2) * tokens * spec.d_model * spec.d_ff


def _decoder_and_logits(spec: TransformerSpec, rows: int, q_len: int, self_len: int, src_len: int, memory: int) -> int:
    """`rows` rows of q_len queries through the decoder (self-attention over self_len positions, cross-attention
    over src_len, projecting `memory` source tokens: 0 when they are cached) and the logits."""
    tokens = rows * q_len
    return (
        spec.num_decoder_layers
        * (
            _projections(spec, tokens, tokens)
            + rows * _scores_and_mix(spec, q_len, self_len)
            + _projections(spec, tokens, memory)
            + rows * _scores_and_mix(spec, q_len, src_len)
            + _ffn(spec, tokens)
        )
        + 2 * tokens * spec.d_model * spec.vocab_size
    )


def forward_flops(spec: TransformerSpec, batch: int, src_len: int, tgt_len: int) -> float:
    """FLOPs of one forward pass over a [batch, src_len] source and [batch, tgt_len] target."""
    s_tok = batch * src_len
    encoder = spec.num_encoder_layers * (
        _projections(spec, s_tok, s_tok) + batch * _scores_and_mix(spec, src_len, src_len) + _ffn(spec, s_tok)
    )
    return float(encoder + _decoder_and_logits(spec, batch, tgt_len, tgt_len, src_len, s_tok))


def decode_step_flops(spec: TransformerSpec, rows: int, src_len: int, slots: int) -> float:
    """FLOPs of one cached decoding step of `rows` rows (sentences x beams): each row's new token, self-attention
    over `slots` cache slots, cross-attention over src_len cached positions."""
    return float(_decoder_and_logits(spec, rows, 1, slots, src_len, 0))


def train_step_flops(spec: TransformerSpec, batch: int, src_len: int, tgt_len: int) -> float:
    """Forward + backward: 3x the forward FLOPs."""
    return 3.0 * forward_flops(spec, batch, src_len, tgt_len)


def measure_matmul_peak(size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of one device on a float32 size x size matmul: the denominator of MFU when no peak is configured."""
    a = jnp.ones((size, size), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def peak_key() -> str:
    """What a measured peak depends on: the device, the host's CPU type, the cores this process may use (XLA:CPU's
    thread pool), jax's version and XLA_FLAGS."""
    device = jax.devices()[0]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"{device.platform} {device.device_kind} | host {runtime.host_kind()} | {cores} cores | "
        f"jax {jax.__version__} | XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}"
    )


def _read_peaks(file: pathlib.Path) -> dict[str, float]:
    """The peaks a file holds; a missing or damaged file holds none (they are measured again and rewritten)."""
    try:
        peaks = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(peaks, dict):
        return {}
    return {k: float(v) for k, v in peaks.items() if isinstance(v, int | float) and v > 0}


def matmul_peak(directory: pathlib.Path | None) -> float:
    """MFU's denominator when train.peak_flops is not set: measure_matmul_peak() of this kind of machine
    (`peak_key`), kept in directory/PEAK_FILE (the compilation cache's; None or unwritable: measured every time), so
    that a restart neither waits for it nor reports an MFU against a different, noisy measurement."""
    if directory is None:
        return measure_matmul_peak()
    file, key = pathlib.Path(directory) / PEAK_FILE, peak_key()
    peaks = _read_peaks(file)
    if key in peaks:
        return peaks[key]
    peaks[key] = measure_matmul_peak()
    try:
        if not file.parent.is_dir():  # write_text_atomically would make it
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(file.parent))
        runtime.write_text_atomically(file, json.dumps(peaks, indent=1))
        logging.info("measured a matmul peak of %.3g FLOP/s per device for MFU; kept in %s", peaks[key], file)
    except OSError as error:
        logging.info("the matmul peak is not kept (%s cannot be written: %s)", file, error.strerror or error)
    return peaks[key]
