"""config_keys: every config key written once, with all of its facts, and what follows from them: a config holds
each key with its default, a bad value of any key is refused naming the key, a restart that changes a must-match
key is refused, and the model spec holds the config's model values."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from configs import common
from transformer_jax import cli
from transformer_jax.config import schema
from transformer_jax.config.schema import KEYS, MAY_CHANGE, Key
from transformer_jax.errors import ConfigError
from transformer_jax.model.layers import TransformerSpec, config_key
from transformer_jax.training import checkpoints


def test_every_key_has_each_of_its_facts():
    names = [key.name for key in KEYS]
    assert len(names) == len(set(names)), "a key is written twice"
    for key in KEYS:
        assert key.doc.strip() and key.rule.unit == key.doc, key.name  # the unit the one-line errors quote
        for size in schema.SIZES.values():
            if key.name != "size":  # set by base_config, from the size's name
                key.rule.check(key.name, key.default_for(size))  # the default obeys its own rule


def test_a_key_without_a_fact_cannot_be_written():
    with pytest.raises(TypeError):
        Key("train.new_key", 1, schema.count(1), "steps")  # no resume decision
    with pytest.raises(ValueError, match="say its unit and meaning"):
        Key("train.new_key", 1, schema.count(1), "", MAY_CHANGE)
    with pytest.raises(ValueError, match="MATCH or MAY_CHANGE"):
        Key("train.new_key", 1, schema.count(1), "steps", True)


@pytest.mark.parametrize("size", sorted(schema.SIZES))
def test_a_config_holds_every_key_with_its_default_and_validates(size):
    config = common.base_config(size)
    cli.validate(config)
    row = schema.SIZES[size]
    for key in KEYS:
        if key.name != "size":
            group, _, leaf = key.name.rpartition(".")
            assert config[group][leaf] == key.default_for(row), key.name
    assert config.model.d_model == row.d_model and config.size == size


def bad_value(key: Key):
    """A value the key's rule refuses: the wrong type, or a string outside its choices."""
    rule = key.rule
    if rule.choices is not None:
        return "no-such-choice"
    return "text" if rule.kind in (int, float, bool) else 3


@pytest.mark.parametrize("key", [k for k in KEYS if k.name != "size"], ids=lambda k: k.name)
def test_a_bad_value_of_any_key_is_refused_naming_the_key(key):
    config = common.base_config("tiny").to_dict()  # a plain dict takes a value of any type
    group, _, leaf = key.name.rpartition(".")
    config[group][leaf] = bad_value(key)
    with pytest.raises(ConfigError, match=rf"^config key {key.name}: "):
        cli.validate(config)


def test_a_restart_is_refused_exactly_when_a_must_match_key_changes():
    saved = common.base_config("tiny").to_dict()
    for key in KEYS:
        group, _, leaf = key.name.rpartition(".")
        if not group or isinstance(saved[group][leaf], bool | str):
            continue
        current = common.base_config("tiny").to_dict()
        current[group][leaf] = saved[group][leaf] + (("x",) if isinstance(saved[group][leaf], tuple) else 1)
        named = [line.split(":")[0] for line in checkpoints.config_differences(saved, current)]
        assert named == ([key.name] if key.resume == schema.MATCH else []), key.name
    # What a resume must keep: the model's shape, the optimizer, the global batch; what it may change: the rest.
    must = {k.name for k in KEYS if k.resume == schema.MATCH}
    assert {"model.d_model", "model.vocab_size", "opt.optimizer", "data.batch_size", "data.max_len"} <= must
    assert not must & {"train.mesh", "train.grad_accum_steps", "train.num_steps", "attention.impl", "model.dtype"}


def test_the_spec_has_one_field_per_model_key_typed_by_its_rule():
    hints = typing.get_type_hints(TransformerSpec)
    fields = {config_key(f): hints[f.name] for f in dataclasses.fields(TransformerSpec)}
    model = {k.name: k.rule.kind for k in KEYS if k.name.startswith(("model.", "attention."))}
    assert fields == model, "a model.*/attention.* key and a TransformerSpec field are added together"


def test_a_spec_built_from_a_config_holds_the_configs_values():
    config = common.base_config("tiny")
    config.model.d_model, config.model.num_heads, config.model.num_kv_heads = 48, 6, 2
    config.model.activation, config.attention.impl, config.attention.window = "swiglu", "blockwise", 7
    spec = TransformerSpec.from_config(config)
    for group in ("model", "attention"):
        for leaf, value in config[group].items():
            name = leaf if group == "model" else f"attention_{leaf}"
            assert getattr(spec, name) == value, f"{group}.{leaf}"
    assert (spec.heads_kv, spec.d_qk, spec.window) == (2, 8, 7)


def test_a_spec_is_held_to_the_configs_rules():
    config = common.base_config("tiny")
    config.model.num_kv_heads = 3  # 4 query heads are not a multiple of 3 key/value heads
    with pytest.raises(ConfigError, match="config key model.num_kv_heads"):
        TransformerSpec.from_config(config)
    config = common.base_config("tiny")
    config.attention.no_such_key = 1
    with pytest.raises(ConfigError, match="attention.no_such_key"):
        TransformerSpec.from_config(config)
