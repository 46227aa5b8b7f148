"""What every format shares: the checkpoints evaluate.py would use, restored after the cheap checks, the vocabulary,
and an output directory that is refused if it exists (unless --force replaces an earlier export of the same
format), written under a temporary sibling name and renamed into place whole."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformer_jax import runtime
from transformer_jax.errors import EvalError
from transformer_jax.evaluation.restore import CheckpointChoice, restore_model, saved_config, workdir_tokenizer


def check_output(output_dir: Path, force: bool, marker: str, what: str) -> None:
    """EvalError unless `output_dir` may be written: its parent is writable, and it does not exist or is an earlier
    export (it holds `marker`, an export of `what`: never a workdir or anything else given by mistake) and `force`."""
    if output_dir.exists():
        if not force:
            raise EvalError(f"--output {output_dir} exists; choose another directory or pass --force to replace it")
        if not (output_dir / marker).is_file():
            raise EvalError(
                f"--output {output_dir} exists and is not {what} (no {marker}); --force replaces only an earlier "
                "export: choose another directory"
            )
    runtime.check_folder_writable(output_dir.parent, "--output")


def write_into_place(output_dir: Path, fill: Callable[[Path], None]) -> Path:
    """Calls fill(tmp) on a new directory next to `output_dir` and renames it to `output_dir`; an existing one (an
    earlier export, or an empty workdir) is moved aside first and comes back if the new one cannot take its place.
    An interrupted export leaves no half-written directory."""
    parent = output_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", suffix=".tmp", dir=parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would hide the model from a server running as another user
        fill(tmp)
        if not output_dir.exists():
            os.replace(tmp, output_dir)
        else:  # --force
            old = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", suffix=".old", dir=parent))
            os.replace(output_dir, old / output_dir.name)
            try:
                os.replace(tmp, output_dir)
            except BaseException:
                os.replace(old / output_dir.name, output_dir)
                raise
            finally:
                shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output_dir


def restore_checked(
    workdir: str, config: Any, choice: CheckpointChoice, check_exportable: Callable[[Any], None]
) -> tuple:
    """(config, model, steps, tokenizer) of the checkpoints evaluate.py would use, after the cheap checks every
    format makes before reading parameters: the workdir has checkpoints, and `check_exportable(config)` accepts the
    config the model would be built from."""
    check_exportable(saved_config(workdir, config))
    config, model, steps = restore_model(workdir, choice, config=config)
    return config, model, steps, workdir_tokenizer(config, workdir)


def vocabulary(tokenizer: Any, vocab_size: int | None = None) -> list[str]:
    """The tokenizer's pieces in id order: row i of an exported vocabulary is our id i. EvalError unless they are the
    model's `vocab_size` rows (when given)."""
    pieces = tokenizer.target_pieces(range(tokenizer.vocab_size))
    if vocab_size is not None and len(pieces) != vocab_size:
        raise EvalError(
            f"tokenizer {tokenizer.path} has {len(pieces)} pieces but the model has model.vocab_size={vocab_size} "
            "rows; export with the tokenizer the model was trained with"
        )
    return pieces
