"""One run of a sweep as a submitit job: what the local and SLURM launchers submit (sweep/launch.py).

A job runs the run the way the sequential sweep does (runner.train_and_decode: code version, training, decoding
the splits of the command's --split) with the command line's settings: the same compilation cache, INFO logging,
and a user error as one line `python -m transformer_jax.sweep: error: ...` on stderr (the last line of the job's
log, which --status shows) and exit status 1. A multi-node SLURM job joins jax.distributed first
(sharding.initialize_distributed; the launcher sets TRANSFORMER_JAX_DISTRIBUTED=1 and jax reads the rest from
SLURM's environment).

Preemption and time limits follow submitit's checkpointing protocol. Before a time limit (and on preemption, where
the cluster sends it) submitit sends the job its signal (USR2); its handler calls the job's `checkpoint()` and
requeues the returned submission. Called straight from the signal, that handler would stop training between two
arbitrary bytecodes, so the job catches the signal first, does what SIGTERM does at that moment (the training loop
saves a checkpoint at the next step boundary and returns; a decode in progress is abandoned) and then hands the
signal to submitit's handler: `checkpoint()` returns this same run, which the requeued job resumes from that
checkpoint, exactly (checkpoints hold the data position and RNG). A plain SIGTERM (scancel) saves and ends the
job; the next sweep command resubmits the run.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import signal
from typing import Any

import ml_collections

from transformer_jax import runtime
from transformer_jax.errors import VariantInterrupted, exit_on_user_error
from transformer_jax.sharding import initialize_distributed
from transformer_jax.sweep.runner import PROG, configure_logging, train_and_decode
from transformer_jax.sweep.splits import Split
from transformer_jax.sweep.submitit_module import submitit


def preemption_signal() -> signal.Signals:
    """The signal submitit sends before a time limit (USR2 unless $SUBMITIT_PREEMPT_SIGNAL names another)."""
    return signal.Signals["SIG" + submitit.JobEnvironment.USR_SIG]


class _Preempted(VariantInterrupted):
    """The preemption signal arrived outside training and decoding (nothing to save)."""


@dataclasses.dataclass(frozen=True)
class RunJob(submitit.helpers.Checkpointable):
    """One (variant, seed) run: trains and decodes it in run_dir; returns its label."""

    label: str
    config: ml_collections.ConfigDict
    run_dir: str
    split: Split  # the command's --split: the run is decoded on split.decodes
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
            train_and_decode(self.label, self.config, pathlib.Path(self.run_dir), self.split)
        except VariantInterrupted:
            if not received or not callable(requeue):
                raise  # a plain SIGTERM: the job ends; the next sweep command resubmits the run
            logging.warning("sweep: %s: %s received; its checkpoint is saved, requeueing", self.label, usr.name)
            requeue(*received[0])  # exits (SystemExit) in the first process; the others return here
            raise
        finally:
            signal.signal(usr, requeue)

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """submitit's protocol, called once the training loop has saved its checkpoint: the same run again, which
        resumes from that checkpoint."""
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)
