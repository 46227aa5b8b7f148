"""Fetch a config's data and train its tokenizer, once, before a run.

python -m transformer_jax.data.prepare --config configs/wmt14_ende.py:size=base --workdir runs/base

Downloads (or prepares, for TFDS) the train, validation and test splits and writes WORKDIR/spm.model. Use it on a
machine with internet before training on one without, and before every multi-host run (hosts must share one
tokenizer; train.py refuses to train a separate one on each host). Prints one JSON line: sentences per split and
the tokenizer's path and size.
"""

from __future__ import annotations

import json

from absl import flags
from ml_collections import config_flags

from transformer_jax import cli
from transformer_jax.data import sources
from transformer_jax.data.tokenizer import get_tokenizer

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (the one the run will use).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Training directory that will hold spm.model.")


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (transformer_jax.cli.run refuses them)
    config = _CONFIG.value
    splits = {}
    for split in (config.data.train_split, config.data.valid_split, config.data.test_split):
        splits[split] = len(sources.open_split(config.data, split))
    tokenizer = get_tokenizer(config.data, _WORKDIR.value, vocab_size=config.model.vocab_size)
    print(json.dumps({"sentences": splits, "tokenizer": str(tokenizer.path), "pieces": tokenizer.vocab_size}))


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "workdir"])
    cli.run(main, "python -m transformer_jax.data.prepare")
