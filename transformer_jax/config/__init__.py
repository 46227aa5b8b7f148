"""Configs: every key's default, unit, allowed values and resume rule (schema.py, with rules.py's vocabulary),
and the loader of config files with the checks derived from the keys (checks.py)."""
