"""WORKDIR/train.lock: one training run per workdir.

Two runs in one workdir would both write checkpoints and metrics, and one would crash mid-save. The lock file is
created atomically (O_EXCL) and holds the pid, host and start time of its run; it is removed when the run ends. A
lock left by a process that died (SIGKILL, a crash) on this host is detected (no such pid) and taken over; one
from another host cannot be checked from here, so the message says which host and pid to look at.

Multi-host: the hosts of one run share the workdir, so one lock stands for the run: process 0 takes it, and every
process learns the outcome from one all-gather, so that either all start or all stop with the same error.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import socket
import time
from collections.abc import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

from transformer_jax.errors import UserError

LOCK_NAME = "train.lock"


class WorkdirLocked(UserError, RuntimeError):
    """Another run holds the workdir's lock."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _holder(path: pathlib.Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def acquire(workdir: pathlib.Path, name: str = LOCK_NAME, owner: str = "training run") -> pathlib.Path:
    """Creates WORKDIR/<name> (train.lock) for this process, or raises WorkdirLocked naming the holder.

    `name` and `owner` ("training run") let another command own a directory the same way (a sweep's sweep.lock)."""
    path = workdir / name
    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for _ in range(3):  # a stale lock removed by us, or one that vanished meanwhile: try again
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(path)
            if holder is None:  # being written by its holder, or garbage: do not guess
                time.sleep(0.2)
                holder = _holder(path)
            if holder and holder.get("host") == me["host"] and not _alive(int(holder.get("pid", -1))):
                logging.warning("removing the stale lock %s of process %s, which no longer runs", path, holder["pid"])
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                continue
            who = (
                f"process {holder.get('pid')} on host {holder.get('host')} (started {holder.get('started')})"
                if holder
                else "an unreadable lock"
            )
            raise WorkdirLocked(
                f"{workdir} is in use by another {owner}: {path} is held by {who}. Wait for it to finish or "
                f"stop it; if that process is gone, delete {path}"
            ) from None
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(me) + "\n")
        return path
    raise WorkdirLocked(
        f"could not take the lock {path}: it keeps reappearing; another {owner} is starting in {workdir}"
    )


def release(path: pathlib.Path) -> None:
    """Removes the lock if it is still this process's."""
    holder = _holder(path)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def locked(workdir: pathlib.Path) -> Iterator[None]:
    """Holds the workdir's lock inside (process 0 takes it; every process raises the same error if it cannot)."""
    workdir.mkdir(parents=True, exist_ok=True)
    path, error = None, None
    if jax.process_index() == 0:
        try:
            path = acquire(workdir)
        except WorkdirLocked as e:
            error = e
    if jax.process_count() > 1:
        refused = np.asarray(multihost_utils.process_allgather(np.int32(error is not None)))
        if refused.any() and error is None:
            error = WorkdirLocked(f"{workdir} is in use by another training run (see process 0's message)")
    if error is not None:
        if path is not None:
            release(path)
        raise error
    try:
        yield
    finally:
        if path is not None:
            release(path)
