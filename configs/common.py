"""Shared config groups for the config files: `base_config(size=...)`, then override what differs.

Every key's default, unit, allowed values and whether it must match on resume are written once, in
transformer_jax/config/schema.py (`KEYS`); the groups here are built from it. A config file changes defaults by
assignment (`config.data.batch_size = 32`) and states why in a comment.
"""

from __future__ import annotations

import ml_collections

from transformer_jax.config import schema

SIZES = schema.SIZES  # name -> (d_model, num_heads, d_ff, encoder layers, decoder layers, P_drop)


def parse_arg(arg: str | None, **defaults: str) -> dict[str, str]:
    """Parses 'key=value,key=value' (the config-file argument after ':'); unknown keys fail with the known ones."""
    values = dict(defaults)
    for item in filter(None, (arg or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"config argument {item!r} is not key=value; known keys: {sorted(defaults)}")
        if key not in defaults:
            raise ValueError(f"unknown config argument {key!r}; known keys: {sorted(defaults)}")
        values[key] = value
    return values


def model_config(size: str) -> ml_collections.ConfigDict:
    return schema.group("model", schema.size_row(size))


def data_config() -> ml_collections.ConfigDict:
    return schema.group("data")


def opt_config(d_model: int) -> ml_collections.ConfigDict:
    """The opt group for a model of width d_model (the paper's learning rate depends on it)."""
    return schema.group("opt", schema.Size(d_model, 0, 0, 0, 0, 0.0))


def base_config(size: str) -> ml_collections.ConfigDict:
    """All groups with their defaults for a model size; config files override and then lock."""
    return schema.base_config(size)
