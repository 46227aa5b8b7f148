"""The code a run ran: its version (git commit, uncommitted diff, untracked files) and a snapshot for queued jobs.

A job of the local or SLURM launcher may start hours after the sweep command submitted it, when the checkout has
changed; it imports a copy of the package taken at submission (`snapshot`, one per content, under the sweep
directory) instead. submitit's own helper (submitit.helpers.RsyncSnapshot) needs rsync and copies only files git
tracks, so a module not yet added would be missing from the job; copying the package folder keeps every file.
Every run directory records the version of each attempt (`record`): code_version.json and the diff it names.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
from typing import Any

import transformer_jax

VERSION_FILE = "code_version.json"  # in a run directory: one entry per attempt that ran different code
SNAPSHOT_VERSION = "version.json"  # in a snapshot: the version of the checkout it was copied from
SNAPSHOT_DIFF = "code.diff"


def package_root() -> pathlib.Path:
    """The folder of the transformer_jax package this process imported (a checkout's, or a snapshot's)."""
    return pathlib.Path(transformer_jax.__file__).resolve().parent


def _git(root: pathlib.Path, *args: str, ok: tuple[int, ...] = (0,)) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)
    except OSError:  # no git on this machine
        return None
    return done.stdout if done.returncode in ok else None


def describe() -> tuple[dict[str, Any], str]:
    """The version of the code this process runs and its uncommitted diff (text, possibly empty).

    In a snapshot: the version recorded when it was taken. Otherwise from git: {"commit", "dirty", "untracked"
    (files git does not track, whose content the diff includes), "source"}; commit is None outside a git checkout.
    """
    root = package_root().parent
    if (root / SNAPSHOT_VERSION).exists():
        return json.loads((root / SNAPSHOT_VERSION).read_text()), (root / SNAPSHOT_DIFF).read_text()
    commit = _git(root, "rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None, "untracked": [], "source": str(root)}, ""
    diff = _git(root, "diff", "HEAD", "--binary") or ""
    package = package_root().relative_to(root) if package_root().is_relative_to(root) else package_root()
    untracked = sorted(
        name
        for name in (_git(root, "ls-files", "--others", "--exclude-standard") or "").splitlines()
        if name.startswith(f"{package}/") and "__pycache__" not in name
    )
    for name in untracked:  # `git diff` leaves out files it does not track; a new module is code that ran
        diff += _git(root, "diff", "--no-index", "--binary", "--", "/dev/null", name, ok=(0, 1)) or ""
    version = {"commit": commit.strip(), "dirty": bool(diff), "untracked": untracked, "source": str(root)}
    return version, diff


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def record(run_dir: pathlib.Path) -> dict[str, Any]:
    """Adds this process's code version to run_dir/code_version.json unless the last attempt recorded ran the same
    code; its diff goes in run_dir/code-<hash>.diff. Returns the entry."""
    version, diff = describe()
    entry = {**version, "diff_file": f"code-{_digest(diff)}.diff" if diff else None}
    path = run_dir / VERSION_FILE
    attempts = json.loads(path.read_text()) if path.exists() else []
    if not attempts or attempts[-1] != entry:
        run_dir.mkdir(parents=True, exist_ok=True)
        if diff:
            (run_dir / entry["diff_file"]).write_text(diff)
        path.write_text(json.dumps([*attempts, entry], indent=1) + "\n")
    return entry


def snapshot(directory: pathlib.Path) -> pathlib.Path:
    """A copy of the package in directory/<content hash>/transformer_jax, with the checkout's version beside it;
    returns directory/<content hash>, the folder a job puts first on its import path. Taken once per content."""
    source = package_root()
    files = sorted(p for p in source.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(source)).encode() + b"\0" + path.read_bytes())
    target = directory / digest.hexdigest()[:16]
    if (target / SNAPSHOT_VERSION).exists():
        return target
    version, diff = describe()
    staging = directory / f".{target.name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging / "transformer_jax", ignore=shutil.ignore_patterns("__pycache__"))
    (staging / SNAPSHOT_DIFF).write_text(diff)
    (staging / SNAPSHOT_VERSION).write_text(json.dumps({**version, "snapshot": str(target)}, indent=1) + "\n")
    try:
        os.replace(staging, target)  # whole or not at all: a job never imports a half-copied package
    except OSError:  # another sweep command took the same snapshot meanwhile
        shutil.rmtree(staging, ignore_errors=True)
    return target
