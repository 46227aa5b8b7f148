"""The flags that choose and average a workdir's checkpoints, defined once for every command that restores a model.

evaluate.py and `python -m transformer_jax.export` share them (names, defaults, help), so that an export serves
exactly the parameters evaluate.py scored; both hand `selection()` to evaluation.options.Model.
"""

from __future__ import annotations

from typing import Any

from absl import flags
from ml_collections import config_flags

NAMES = ("workdir", "config", "checkpoint", "average_last", "average_steps", "average_best")


def define(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines --config, --workdir, --checkpoint, --average_last, --average_steps and --average_best."""
    fv = {"flag_values": flag_values}
    config_flags.DEFINE_config_file(
        "config", None, "Config file; default: the config saved with the checkpoints.", **fv
    )
    flags.DEFINE_string("workdir", None, "Training directory with checkpoints/ and the tokenizer.", **fv)
    flags.DEFINE_string(
        "checkpoint",
        "latest",
        "latest, best (the best by train.select_metric, kept by ckpt.keep_best), or the step of the last checkpoint "
        "to use.",
        **fv,
    )
    flags.DEFINE_integer(
        "average_last", None, "Average this many checkpoints ending at --checkpoint (config.eval).", **fv
    )
    flags.DEFINE_list(
        "average_steps", None, "Average exactly these checkpoint steps (instead of --average_last).", **fv
    )
    flags.DEFINE_integer(
        "average_best", None, "Average the K best checkpoints by train.select_metric (instead of --average_last).", **fv
    )


def selection(flag_values: flags.FlagValues = flags.FLAGS) -> dict[str, Any]:
    """The parsed values, as evaluation.options.Model's keyword arguments."""
    return {name: flag_values[name].value for name in NAMES}
