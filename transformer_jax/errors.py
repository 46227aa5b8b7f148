"""Errors that mean the user's input is wrong (not the code): entry points print them without a traceback."""


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and what to do."""
