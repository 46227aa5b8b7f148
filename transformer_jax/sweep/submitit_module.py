"""submitit, imported without its logging configuration: import it from here, never directly.

Importing submitit runs `logging.config.dictConfig` (submitit/core/logger.py) unless SUBMITIT_LOG_LEVEL is
NOCONFIG, and dictConfig closes every logging handler the process already has (absl's, a user's log file, pytest's
capture): importing the sweep must change no setting of the process. So the variable is NOCONFIG while submitit is
first imported, and is then put back as it was; submitit's logger has no handler of its own and its records go
to the root logger's, as every other library's. A SUBMITIT_LOG_LEVEL the user set is respected as submitit reads
it. Jobs import submitit in processes of their own, with submitit's usual configuration.
"""

from __future__ import annotations

import os
import sys

_KEY = "SUBMITIT_LOG_LEVEL"

if "submitit" not in sys.modules:
    _given = os.environ.get(_KEY)
    os.environ[_KEY] = "NOCONFIG" if _given is None else _given
    try:
        import submitit
    finally:
        if _given is None:
            del os.environ[_KEY]

import submitit  # noqa: E402
from submitit.core.utils import FailedJobError, JobPaths  # noqa: E402

__all__ = ["FailedJobError", "JobPaths", "submitit"]
