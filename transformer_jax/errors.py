"""Every error a user can cause (bad config, data, checkpoint, flag or file), under one base class.

Entry points catch `UserError` alone and print its message as one line, without a traceback, exiting non-zero
(`cli.exit_on_user_error`); any other exception is a bug in this code and keeps its traceback. Each message names the
key, file, line, flag or checkpoint step and says what to do; the classes only say which part of the input was
wrong (the ValueError / RuntimeError mixins keep `except ValueError` in callers working).
"""

from __future__ import annotations


class UserError(Exception):
    """Input that cannot work (not a bug in this code); the message says which input and what to do."""


class ConfigError(UserError, ValueError):
    """A config value that cannot work; the message names the key and what to do."""


class DataError(UserError, ValueError):
    """Bad or missing input data: the message names the file, line, split or setting and says what to do."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used, with what to do about it."""


class DiskFullError(UserError, RuntimeError):
    """No space left where a file was being written; nothing partial was left (transformer_jax.runtime)."""


class NonFiniteError(UserError, RuntimeError):
    """Too many non-finite updates in a row (a diverged run: lower the learning rate or check the data)."""


class ScoreError(UserError, ValueError):
    """Inputs that cannot be scored (line counts differ, unreadable file); the message names the files."""


class AveragingError(UserError, ValueError):
    """A checkpoint selection or a set of pytrees that cannot be averaged; the message lists what exists."""


class EvalError(UserError, ValueError):
    """Flags or files of an evaluation (or export) that cannot work together."""


class VisualizeError(UserError, ValueError):
    """Arguments of a picture that cannot be drawn (unknown layer or head, empty sentence, missing file)."""


class VariantInterrupted(UserError):
    """A sweep variant stopped before its last step (SIGTERM); rerunning the same command resumes it."""
