"""Configs: every key's default, unit, allowed values and resume rule (schema.py, with rules.py's vocabulary). The
loader of config files and the checks derived from the keys are the command lines' (transformer_jax/cli.py)."""
