"""config_checks: one rule per config leaf, checked before any work, each failure one line naming key, value, range.

Every config file's configs (every argument, every sweep variant) passing validation is tested in test_configs.py.
"""

import math
import pathlib
import re
import tempfile

import pytest

from configs import common
from transformer_jax import cli
from transformer_jax.cli import RULES, check_workdir, validate
from transformer_jax.config import schema
from transformer_jax.errors import ConfigError
from transformer_jax.model import TransformerSpec


@pytest.mark.parametrize("size", sorted(common.SIZES))
def test_every_leaf_has_a_rule_and_every_rule_a_leaf(size):
    """Every leaf of the config has a rule and every rule a leaf (both derive from schema.KEYS)."""
    leaves = dict(cli.leaves(common.base_config(size)))
    assert sorted(set(leaves) - set(RULES)) == [], "add a Key for each new config key to schema.KEYS"
    assert sorted(set(RULES) - set(leaves)) == [], "remove the rules of keys that no longer exist"
    validate(common.base_config(size))


def test_a_leaf_with_no_rule_fails_validation():
    config = common.base_config("tiny")
    config.train.num_stepz = 30  # a config file's misspelling adds a key, since a config is unlocked while built
    with pytest.raises(
        ConfigError, match="train.num_stepz: unknown key, no code reads it; did you mean train.num_steps"
    ):
        validate(config)


def _with(key: str, value):
    """The tiny base config as a plain dict (so that any type can be set) with one leaf replaced."""
    config = common.base_config("tiny").to_dict()
    group, _, leaf = key.rpartition(".")
    (config[group] if group else config)[leaf] = value
    return config


BAD = [
    # (key, value, what the one line says is allowed) per class of bad value
    ("opt.learning_rate", -0.1, "must be positive (a number > 0"),  # trained by gradient ascent and exited 0
    ("opt.learning_rate", 0.0, "must be positive (a number > 0"),  # trained nothing
    ("opt.learning_rate", math.nan, "must be positive"),
    ("opt.learning_rate", math.inf, "must be positive"),
    ("train.num_steps", -1, "must be positive (an integer >= 1, optimizer steps)"),  # exited 0 having done nothing
    ("data.batch_size", 0, "must be positive (an integer >= 1, rows per batch"),  # ZeroDivisionError after setup
    ("ckpt.every_steps", 0, "must be positive (an integer >= 1, steps between checkpoints)"),  # ZeroDivisionError
    ("data.tokens_per_batch", -5, "must be positive"),
    ("eval.batch_size", 0, "must be positive"),
    ("opt.warmup_steps", -1, "must be >= 0 (an integer, steps of linear warmup)"),
    ("train.eval_every", -10, "must be >= 0 (an integer, steps between validation-loss evaluations; 0 = never)"),
    ("model.dropout_rate", 1.0, "must be in [0, 1) (a number, probability"),
    ("opt.b2", 1.5, "must be in [0, 1)"),
    ("train.assumed_mfu", 0.0, "must be in (0, 1]"),
    ("train.seed", -1, "must be in [0, 4294967296) (an integer, seed of"),
    ("train.num_steps", 10.5, "must be positive (an integer >= 1, optimizer steps), got 10.5 (float)"),  # type
    ("train.num_steps", True, "got True (bool)"),
    ("ckpt.async_save", 1, "must be True or False, got 1 (int)"),
    ("data.src_lang", "", "must be a non-empty string"),
    ("train.mesh", "tensor", "unknown value 'tensor'; choose one of ['data', 'fsdp']"),  # choices from sharding.py
    ("attention.impl", "magic", "unknown value 'magic'; choose one of ['auto', 'blockwise'"),  # from ops' registry
    ("data.batching", "stream", "unknown value 'stream'; choose one of ['pack', 'bucket', 'pad']"),
    ("opt.schedule", "linear", "unknown value 'linear'"),
]


@pytest.mark.parametrize("key,value,allowed", BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_a_bad_value_is_one_line_naming_key_value_and_range(key, value, allowed):
    with pytest.raises(ConfigError) as error:
        validate(_with(key, value))
    message = str(error.value)
    assert message.startswith(f"config key {key}: ") and "\n" not in message
    assert allowed in message
    assert repr(value) in message


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"model.d_model": 30}, "model.num_heads: d_model=30 is not divisible by num_heads=4"),
        ({"model.num_kv_heads": 3}, "model.num_kv_heads: num_heads=4 is not a multiple of num_kv_heads=3"),
        (
            {"model.d_model": 33, "model.num_heads": 3},
            "model.d_model: the sinusoidal positional encoding needs an even",
        ),
        ({"model.attention_dropout_rate": 0.1, "attention.impl": "blockwise"}, "attention-weight dropout needs"),
        ({"opt.weight_decay": 0.1}, "opt.weight_decay: Adam has no decoupled weight decay (got 0.1)"),
        ({"model.positional": "learned", "data.max_len": 2000}, "data.max_len: 2000 tokens per side exceed the 1024"),
    ],
)
def test_rules_between_keys(overrides, message):
    config = common.base_config("tiny")
    config.update_from_flattened_dict(overrides)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(config)


def test_the_model_applies_the_same_rules():
    """One source: TransformerSpec calls the checks that validate() calls, for every model whatever its config's
    origin (a checkpoint's saved config, a converted model, code)."""
    config = common.base_config("tiny")
    config.model.norm_epsilon = -1.0
    with pytest.raises(ConfigError, match="config key model.norm_epsilon: must be positive"):
        TransformerSpec.from_config(config)


LIST_VALUES = {
    # key: (a tuple, the same as one comma-joined value; for records, in the key's form of before)
    "data.corpora": (
        (("real", "text", "/d/m30k", 1.0, ""), ("bt", "files", "mono.bt.en+mono.de", 0.5, "<BT>")),
        "real=text:/d/m30k:1,bt=files:mono.bt.en+mono.de:0.5:<BT>",
    ),
    "eval.extra_valid": (
        (("tatoeba", "/d/tatoeba", "test"), ("news", "/d/news", "valid")),
        "tatoeba=/d/tatoeba:test,news=/d/news",
    ),
    "opt.freeze": (("encoder_layers/0/.*", "src_embed"), "encoder_layers/0/.*,src_embed"),
    "opt.lora_targets": (("q", "v", "ffn"), "q,v,ffn"),
    "train.trackers": (("tensorboard", "wandb"), "tensorboard,wandb"),
    "data.directions": (("en-de", "all", "fr-centric"), "en-de,all,fr-centric"),
    "data.direction_lines": ((("en-cs", 3000), ("cs-en", 3000)), "en-cs=3000,cs-en=3000"),
    "model.language_codes": ((("eng_Latn", 256047), ("ces_Latn", 256042)), "eng_Latn=256047,ces_Latn=256042"),
    "data.add_languages": (("cs", "slk_Latn"), "cs,slk_Latn"),
    "train.source_directions": (("en-de", "de-en"), "en-de,de-en"),
}


# Keys valid only in a fine-tuning run (a rule between keys): the source workdir they are checked with.
NEEDS_INIT_FROM = {"data.add_languages": "/runs/source"}


def test_every_list_valued_key_is_tested_here():
    assert set(LIST_VALUES) == set(schema.LISTS)


@pytest.mark.parametrize("key", sorted(LIST_VALUES))
def test_a_list_valued_key_takes_a_tuple_or_one_comma_joined_value(key):
    """The tuple as written; the comma-joined value as ml_collections gives it from --config.KEY=... (a 1-tuple) and
    as a config saved before the key was a tuple holds it (the string): each becomes the tuple, in place, before the
    config is checked, so the config a run saves and reads holds the tuple."""
    records, joined = LIST_VALUES[key]
    group, _, leaf = key.rpartition(".")
    for given in (records, (joined,), joined):
        config = common.base_config("tiny").to_dict()
        config[group][leaf] = given
        config["train"]["init_from"] = NEEDS_INIT_FROM.get(key, "")
        validate(config)
        assert config[group][leaf] == records, given


def test_a_list_valued_key_on_the_command_line(tmp_path):
    """Every command line reads --config.KEY=a,b of a list-valued key as one comma-joined value, even where it is
    no Python literal (ml_collections refuses 'real=text:/d:1,bt=...' for a tuple), or as a Python tuple."""
    from absl import flags
    from ml_collections import config_flags

    from transformer_jax import cli

    file = tmp_path / "c.py"
    file.write_text("from configs import common\n\ndef get_config():\n    return common.base_config('tiny').lock()\n")
    # data.directions goes alone: a multilingual run has no data.corpora (a rule between keys)
    alone = ["data.directions", "data.direction_lines"]
    for keys in ([k for k in LIST_VALUES if k not in alone], alone):
        argv = ["prog", f"--config={file}", *(f"--config.{key}={LIST_VALUES[key][1]}" for key in keys)]
        argv += [f"--config.train.init_from={NEEDS_INIT_FROM[key]}" for key in keys if key in NEEDS_INIT_FROM]
        if "train.trackers" in keys:
            argv[argv.index("--config.train.trackers=tensorboard,wandb")] = (
                "--config.train.trackers=('tensorboard', 'wandb')"
            )
        fv = flags.FlagValues()
        config_flags.DEFINE_config_file("config", None, "config", flag_values=fv, sys_argv=argv)
        cli.parse_flags("prog", argv, fv)
        config = fv.config
        validate(config)
        for key in keys:
            group, _, leaf = key.rpartition(".")
            assert config[group][leaf] == LIST_VALUES[key][0], key


def test_a_missing_key_fails():
    config = common.base_config("tiny")
    del config.ckpt["keep"]
    with pytest.raises(ConfigError, match=r"config lacks keys \['ckpt.keep'\]"):
        validate(config)


def test_workdir_is_made_and_must_be_a_writable_directory(tmp_path, monkeypatch):
    assert check_workdir(tmp_path / "a" / "b").is_dir()
    file = tmp_path / "file"
    file.write_text("not a directory")
    with pytest.raises(ConfigError, match=f"--workdir {file} is a file, not a directory"):
        check_workdir(file)
    with pytest.raises(ConfigError, match="cannot write there"):
        check_workdir(file / "below")  # a workdir below a regular file can never be made (chmod is no test as root)

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    with pytest.raises(ConfigError, match=r"--workdir .*: cannot write there \(Permission denied\)"):
        check_workdir(tmp_path)
    assert not list(pathlib.Path(tmp_path / "a" / "b").iterdir())  # the probe leaves nothing behind


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"model": {"lang_token": "target"}}, "model.lang_token='target' needs data.directions"),
        ({"data": {"directions": ("en-de",), "source": "multi30k"}}, "config key data.source: a multilingual run"),
        ({"data": {"directions": ("en-de",), "source": "text", "target_lang": "de"}}, "config key data.target_lang"),
        ({"data": {"directions": ("en-en",), "source": "text"}}, "data.directions"),
        ({"data": {"directions": ("en-de",), "tokenizer": "marian"}}, "config key data.tokenizer: a multilingual"),
        (
            {"data": {"directions": ("en-de",)}, "eval": {"extra_valid": (("t", "/d", "valid"),)}},
            "config key eval.extra_valid: a multilingual",
        ),
    ],
)
def test_a_multilingual_config_that_cannot_work_is_one_line(changes, message):
    config = common.base_config("tiny").to_dict()
    for group, values in changes.items():
        config[group].update(values)
    with pytest.raises(ConfigError, match=message):
        validate(config)
