"""A two-variant sweep over the tiny training config, for tests/test_sweep.py (text_dir from TINY_CORPUS)."""

import os
import pathlib

from tests.training_helpers import tiny_train_config

REFERENCE = "made-up numbers"


def get_config(arg: str | None = None):
    config = tiny_train_config(pathlib.Path(os.environ["TINY_CORPUS"]), num_steps=2, eval_every=2)
    return config.lock()


def get_sweep(arg: str | None = None) -> list[dict]:
    if arg == "misspelt":
        return [{"name": "bad", "model.d_modle": 8}]
    if arg == "bad_reference":
        return [{"name": "base", "reference": {"valid_ppl": 5.0}}]
    return [
        {"name": "base", "reference": {"valid_perplexity": 5.0, "valid_bleu": 25.0}},
        {"name": "pre_ln", "model.norm_position": "pre", "reference": {"valid_perplexity": 4.5}},
    ]
