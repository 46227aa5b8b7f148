"""config_keys: every config key written once, with all of its facts; the rules, the keys that must match on
resume, the config groups and the model spec all derive from it (issue #25, point 1)."""

from __future__ import annotations

import dataclasses

import pytest

from configs import common
from transformer_jax import config_checks, config_keys
from transformer_jax.config_keys import KEYS, MATCH, MAY_CHANGE, Key
from transformer_jax.model.spec import TransformerSpec
from transformer_jax.training import checkpoints


def test_every_key_has_each_of_its_facts():
    names = [key.name for key in KEYS]
    assert len(names) == len(set(names)), "a key is written twice"
    for key in KEYS:
        assert key.doc.strip() and key.rule.unit == key.doc, key.name  # the unit the one-line errors quote
        assert key.resume in (MATCH, MAY_CHANGE), key.name
        assert isinstance(key.rule, config_keys.Rule), key.name
        for size in config_keys.SIZES.values():
            if key.name != "size":  # set by base_config, from the size's name
                key.rule.check(key.name, key.default_for(size))  # the default obeys its own rule


def test_a_key_without_a_fact_cannot_be_written():
    with pytest.raises(TypeError):
        Key("train.new_key", 1, config_keys.count(1), "steps")  # no resume decision
    with pytest.raises(ValueError, match="say its unit and meaning"):
        Key("train.new_key", 1, config_keys.count(1), "", MAY_CHANGE)
    with pytest.raises(ValueError, match="MATCH or MAY_CHANGE"):
        Key("train.new_key", 1, config_keys.count(1), "steps", True)


@pytest.mark.parametrize("size", sorted(config_keys.SIZES))
def test_the_groups_rules_resume_keys_and_spec_derive_from_the_keys(size):
    leaves = dict(config_checks.leaves(common.base_config(size)))
    assert sorted(leaves) == sorted(key.name for key in KEYS)  # the config holds exactly the keys
    assert config_checks.RULES == {key.name: key.rule for key in KEYS}
    assert checkpoints.STRUCTURAL_KEYS == tuple(key.name for key in KEYS if key.resume == MATCH)
    fields = {f.name: f.type for f in dataclasses.fields(TransformerSpec)}
    model = {k.name: k for k in KEYS if k.name.startswith(("model.", "attention."))}
    assert list(fields) == [n.removeprefix("model.").replace("attention.", "attention_") for n in model]
    assert list(fields.values()) == [key.rule.kind for key in model.values()]
    assert common.base_config(size).model.d_model == config_keys.SIZES[size].d_model


def test_the_resume_decision_covers_the_model_shape_and_the_global_batch():
    must = set(config_keys.MUST_MATCH)
    assert {"model.d_model", "model.vocab_size", "opt.optimizer", "data.batch_size", "data.max_len"} <= must
    assert not must & {"train.mesh", "train.grad_accum_steps", "train.num_steps", "attention.impl", "model.dtype"}
