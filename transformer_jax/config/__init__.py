"""Configs: every key's default, unit, allowed values and resume rule (schema.py), the checks derived from them
(checks.py), and the one loader of config files that every command line uses (loading.py)."""
