"""The config of tests/training_helpers.tiny_train_config as a config file, for train.py in subprocess tests."""

from tests.training_helpers import tiny_train_config


def get_config(arg: str | None = None):
    # text_dir is given on the command line (--config.data.text_dir=...).
    return tiny_train_config(__import__("pathlib").Path("unset")).lock()
