"""The chunk store of a corpus translation: OUT.parts/ holds a state file and one file per committed chunk.

    OUT.parts/state.json       what the work is: the input (path, size, SHA-256), the flags given, the chunk size,
                               and once the model is restored its checkpoint steps and resolved decoding settings
    OUT.parts/0000003.json     chunk 3: lines [3 N, 4 N) of the input, translated (hypotheses, scores, counts)

Every file is written whole or not at all (runtime.write_text_atomically), and each chunk carries the
fingerprint of the state it was made under, its first line and its line count: a chunk that does not parse or does
not match (a file truncated by a crash of the filesystem, or one left by other work) is redone, never used. A resume
whose input or options differ from the state's is refused in one line, so a finished OUT is always one run's work.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from transformer_jax import runtime
from transformer_jax.errors import DiskFullError, EvalError
from transformer_jax.evaluation.command import write_lines

FORMAT = 1  # the layout of the files below; a store of another format is refused
STATE = "state.json"
COUNTS = ("empty", "truncated", "hit_max_len")  # per-chunk counts of translate_nbest's statistics


def parts_dir(output: str) -> Path:
    """Where the chunks of `output` are committed until it is assembled."""
    return Path(f"{output}.parts")


def scores_file(output: str) -> str:
    """The scores beside `output`: one line per line, 'log_prob<TAB>score' (nan for a blank source)."""
    return f"{output}.scores"


def input_identity(path: str, data: bytes) -> dict[str, Any]:
    """What names the input's content: its real path, size and SHA-256."""
    return {"path": os.path.realpath(path), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def fingerprint(state: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()[:16]


def check_resume(parts: Path, work: dict[str, Any], flag_of: dict[str, str]) -> None:
    """EvalError when `parts` holds a state whose input or options differ from `work`'s (any key of `work`):
    resuming would mix two runs' translations. `flag_of`: the flag each option came from, for the message."""
    state = read_state(parts)
    if state is None:
        return
    if state.get("format") != FORMAT:
        raise EvalError(f"{parts / STATE} is of another format: delete {parts} to start over")
    if state.get("input") != work["input"]:
        raise EvalError(
            f"--input {work['input']['path']} differs from the file {parts} was started on ({state['input']}): "
            f"translate it to another --output, or delete {parts} to start over"
        )
    for section in ("options", "chunk_lines", "model"):
        if section not in work:
            continue
        was, now = state.get(section), work[section]
        if was == now:
            continue
        if isinstance(now, dict) and isinstance(was, dict):
            keys = sorted(k for k in {*was, *now} if was.get(k) != now.get(k))
            named = ", ".join(f"{flag_of.get(k, k)} {was.get(k)!r} -> {now.get(k)!r}" for k in keys)
        else:
            named = f"{flag_of.get(section, section)} {was!r} -> {now!r}"
        raise EvalError(
            f"{parts} was started with other settings ({named}): resume with the same ones, or delete {parts} to "
            "start over"
        )


def read_state(parts: Path) -> dict[str, Any] | None:
    path = parts / STATE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise EvalError(f"cannot read {path} ({e}): delete {parts} to start over") from None


def write_state(parts: Path, state: dict[str, Any]) -> None:
    runtime.write_text_atomically(parts / STATE, json.dumps(state, sort_keys=True, indent=1) + "\n")


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One chunk's translations: the lines from `first`, each line's hypothesis and scores (None: a blank source,
    not decoded), and the counts of COUNTS."""

    first: int
    hypotheses: list[str]
    log_probs: list[float | None]
    scores: list[float | None]
    counts: dict[str, int]


def chunk_path(parts: Path, index: int) -> Path:
    return parts / f"{index:07d}.json"


def write_chunk(parts: Path, index: int, chunk: Chunk, print_: str) -> None:
    """Commits chunk `index` (made under the state of fingerprint `print_`) whole or not at all; a full disk is
    DiskFullError (the chunks committed before are kept for the resume)."""
    record = {"fingerprint": print_, **dataclasses.asdict(chunk)}
    path = chunk_path(parts, index)
    try:
        runtime.write_text_atomically(path, json.dumps(record, ensure_ascii=False) + "\n")
    except OSError as e:
        if not runtime.is_disk_full(e):
            raise
        raise DiskFullError(
            f"disk full while committing {path} ({runtime.space_report(path)}); the chunks committed before it are "
            "kept: free space and run the same command again to resume"
        ) from None


def read_chunk(parts: Path, index: int, print_: str, first: int, lines: int) -> Chunk | None:
    """Chunk `index` if it is committed, whole and of this work (fingerprint, first line, line count); else None.
    Raises FileNotFoundError when it was never committed, ValueError when it is there but unusable."""
    text = chunk_path(parts, index).read_text(encoding="utf-8")
    record = json.loads(text)  # ValueError for a truncated or damaged file
    if not isinstance(record, dict) or record.pop("fingerprint", None) != print_:
        raise ValueError("made under other settings")
    try:
        chunk = Chunk(**record)
    except TypeError as e:  # other fields: another format's file
        raise ValueError(str(e)) from None
    if chunk.first != first or not len(chunk.hypotheses) == len(chunk.log_probs) == len(chunk.scores) == lines:
        raise ValueError(f"holds other lines than [{first}, {first + lines})")
    return chunk


def assemble(output: str, chunks: list[Chunk]) -> None:
    """Writes OUT (one hypothesis a line) and OUT.scores from the chunks in order, each whole or not at all (a full
    disk: DiskFullError, OUT.parts kept), then removes OUT.parts: the work is done."""
    hypotheses = [h for c in chunks for h in c.hypotheses]
    # None: a blank source line, which was not decoded and has no score.
    rows = [(lp, s) for c in chunks for lp, s in zip(c.log_probs, c.scores, strict=True)]
    write_lines(scores_file(output), [f"{_number(lp)}\t{_number(s)}" for lp, s in rows])
    write_lines(output, hypotheses)
    shutil.rmtree(parts_dir(output))


def _number(x: float | None) -> str:
    return "nan" if x is None else repr(float(x))
