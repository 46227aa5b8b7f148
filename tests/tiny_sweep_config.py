"""A two-variant sweep over the tiny training config, for tests/test_sweep.py (text_dir from TINY_CORPUS)."""

import os
import pathlib

from tests.helpers.training import tiny_train_config

REFERENCE = "made-up numbers"


def get_config(arg: str | None = None):
    config = tiny_train_config(pathlib.Path(os.environ["TINY_CORPUS"]), num_steps=2, eval_every=2)
    # The sweep decodes every finished run's validation split: greedy, short outputs and one batch keep that to
    # one small compilation per variant (beam search is tested in tests/test_decoding.py).
    config.eval.beam_size = 1
    config.eval.max_extra_len = 4
    config.eval.batch_size = 32
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
