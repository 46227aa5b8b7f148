"""Writing files safely: one writability probe, whole-or-nothing writes, and a full disk told in one line.

Every command checks its output locations with `probe_writable` before any work, and writes its outputs with
`write_text_atomically` (a temporary file beside the target, renamed into place when complete), so that a failure
half way (a full disk) leaves the previous file or none, never a partial one that looks complete. `is_disk_full`
recognises a full disk however it arrives: an OSError from Python, or TensorStore's RESOURCE_EXHAUSTED wrapped
in Orbax's and asyncio's exceptions. `space_report` says how much was needed and how much is free, for the line.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How TensorStore (C++) reports ENOSPC; it reaches Python as a ValueError carrying this text.
_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "os_error_code='28'")
_UMASK = os.umask(0o022)  # read once at import (os.umask can only be read by setting it); restored at once
os.umask(_UMASK)


def is_disk_full(error: BaseException | None) -> bool:
    """Whether `error`, or any exception in its chain (cause, context, an exception group's members), is a full
    disk or an exceeded quota."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return True
        if any(text in str(e) for text in _DISK_FULL_TEXT):
            return True
        pending += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return False


def _existing(path: str | os.PathLike) -> Path:
    """`path`, or its nearest existing ancestor (the folder a missing path would be made in)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes free for this user on the filesystem that holds (or would hold) `path`."""
    return shutil.disk_usage(_existing(path)).free


def human_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def space_report(path: str | os.PathLike, needed: int | None = None) -> str:
    """'needs about X, Y free' (or 'Y free' when the need is unknown) for the filesystem of `path`."""
    free = human_bytes(free_bytes(path))
    return f"needs about {human_bytes(needed)}, {free} free" if needed else f"{free} free"


def probe_writable(folder: str | os.PathLike, create: bool = True) -> Path:
    """Checks that files can be written in `folder` by creating and removing one there; OSError if not.

    create=True makes `folder` (and its parents) first, if missing. create=False leaves nothing behind: the file is
    made in the nearest existing ancestor, where the missing folders would be made. The callers turn the OSError
    into their one-line error naming the flag or key that chose the folder.
    """
    folder = Path(folder)
    if create:
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(folder))
        folder.mkdir(parents=True, exist_ok=True)
        where = folder
    else:
        where = _existing(folder)
        if not where.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{where} is not a directory", str(where))
    with tempfile.TemporaryFile(dir=where):
        pass
    return folder


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """Writes `text` (UTF-8, LF) to `path` whole or not at all: into a temporary file beside it, renamed onto it
    when complete. On any failure the temporary file is removed and the error (OSError) raised; the file at
    `path`, if there was one, is unchanged."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp's 0o600 would differ from a file opened for writing
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
