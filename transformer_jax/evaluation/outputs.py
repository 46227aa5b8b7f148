"""Writing evaluation's outputs whole or not at all, for the command lines (evaluate.py, the sweep): a full disk is
one line and leaves any earlier file of that name unchanged. The library (evaluation/run.py) returns data only."""

from __future__ import annotations

import json
import os
from typing import Any

from transformer_jax.errors import DiskFullError
from transformer_jax.runtime import files


def write_lines(path: str | os.PathLike, lines: list[str]) -> None:
    """One line each, each ended by a newline."""
    _write_whole(str(path), "".join(line + "\n" for line in lines))


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """The JSON report, indented (values JSON cannot hold, as their str)."""
    _write_whole(str(path), to_json(obj) + "\n")


def to_json(obj: Any) -> str:
    return json.dumps(obj, indent=1, default=str)


def _write_whole(path: str, text: str) -> None:
    try:
        files.write_text_atomically(path, text)
    except OSError as e:
        if not files.is_disk_full(e):
            raise
        raise DiskFullError(
            f"disk full while writing {path} ({files.space_report(path, len(text.encode()))}); nothing was written "
            "there (an earlier file of that name is unchanged): free space or choose another location"
        ) from None
