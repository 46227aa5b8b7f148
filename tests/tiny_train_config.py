"""The config of tests/helpers/training.tiny_train_config as a config file, for train.py in subprocess tests."""

from tests.helpers.training import tiny_train_config


def get_config(arg: str | None = None):
    # text_dir is given on the command line (--config.data.text_dir=...).
    return tiny_train_config(__import__("pathlib").Path("unset")).lock()
