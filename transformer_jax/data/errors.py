"""The one exception the data package raises for bad input, so callers can catch it and show the message."""

from __future__ import annotations


class DataError(ValueError):
    """Bad or missing input data: the message names the file, line, split or setting and says what to do."""
