"""Metric writers: WORKDIR/metrics.jsonl (one JSON object per logged step) and TensorBoard event files
(tensorboardX, no TensorFlow needed), plus a progress display: a bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import json
import logging
import pathlib
import sys
import time

import jax


class MetricWriter:
    """Writes on process 0 only; every record is flushed so a crash loses nothing already logged."""

    def __init__(self, workdir: str | pathlib.Path):
        self.enabled = jax.process_index() == 0
        self.path = pathlib.Path(workdir) / "metrics.jsonl"
        self._jsonl = open(self.path, "a") if self.enabled else None  # noqa: SIM115 - closed in close()
        self._tb = None
        if self.enabled:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(pathlib.Path(workdir) / "tensorboard"))

    def write(self, step: int, metrics: dict[str, float], prefix: str = "") -> None:
        if not self.enabled:
            return
        record = {"step": step, **{f"{prefix}{k}": v for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float):
                self._tb.add_scalar(key, value, step)
        self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()


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


class Progress:
    """A tqdm bar with step, loss, learning rate, tokens/s and ETA on a terminal; log lines when not a TTY."""

    def __init__(self, first_step: int, num_steps: int):
        self.num_steps = num_steps
        self.bar = None
        self.start, self.first_step = time.time(), first_step
        if sys.stderr.isatty() and jax.process_index() == 0:
            from tqdm import tqdm

            self.bar = tqdm(total=num_steps, initial=first_step, unit="step", dynamic_ncols=True)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        shown = {k: metrics[k] for k in ("loss", "learning_rate", "tokens_per_s") if k in metrics}
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=True)
            return
        elapsed = time.time() - self.start
        done = max(step - self.first_step, 1)
        eta = elapsed / done * (self.num_steps - step)
        logging.info(
            "step %d/%d  %s  eta %s",
            step,
            self.num_steps,
            "  ".join(f"{k} {v:.4g}" for k, v in shown.items()),
            time.strftime("%H:%M:%S", time.gmtime(eta)),
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
