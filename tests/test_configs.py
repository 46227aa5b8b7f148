"""Every config loads with every argument, every sweep override applies, and the model it describes builds."""

import importlib
import json
from pathlib import Path

import ml_collections
import pytest

from tests.helpers import REPO
from tests.helpers.reference import hand_count
from transformer_jax import cli
from transformer_jax.errors import ConfigError
from transformer_jax.model import TransformerSpec, parameter_count
from transformer_jax.model.layers import SpecialIds
from transformer_jax.training import bookkeeping

CONFIG_DIR = REPO / "configs"
CONFIG_ARGS = {
    "wmt14_ende": ["size=base", "size=big", "size=tiny", None],
    "wmt14_enfr": ["size=base", "size=big", "size=tiny", None],
    "multi30k": [None, "direction=de-en", "size=tiny"],
    "finetune": ["init_from=runs/source", "init_from=runs/source,direction=de-en"],
    "quickstart": [None],
    "ablations_table3": ["scale=paper", "scale=mini,steps=400", "scale=tiny,steps=4"],
    "ablations_architecture": ["scale=small,steps=100"],
    "backtranslation": ["data=runs/bt/data", "data=runs/bt/data,steps=50"],
    "distillation": ["data=runs/kd/data"],
    "multilingual": [None, "size=tiny", "directions=en-centric,lang_token=source,temperature=1"],
}


def _config_modules() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem not in ("__init__", "common"))


def test_every_config_file_is_covered():
    assert set(_config_modules()) <= set(CONFIG_ARGS), "add the new config file and its arguments to CONFIG_ARGS"


def _cases() -> list:
    return [pytest.param(name, arg, id=f"{name}:{arg}") for name, args in CONFIG_ARGS.items() for arg in args]


@pytest.mark.parametrize("name,arg", _cases())
def test_config_loads_locked_and_builds_a_model(name, arg):
    module = importlib.import_module(f"configs.{name}")
    config = module.get_config(arg)
    cli.validate(config)  # every leaf has a rule and keeps it
    assert config.is_locked
    with pytest.raises(AttributeError):
        config.model.d_modle = 3  # a misspelt key fails instead of silently adding one
    for override in getattr(module, "get_sweep", lambda a: [])(arg):
        variant = module.get_config(arg)
        # A locked config raises on a key that does not exist, so a misspelt override fails here.
        variant.update_from_flattened_dict({k: v for k, v in override.items() if k not in ("name", "reference")})
        cli.validate(variant)  # every leaf of every variant, and the rules between keys
        TransformerSpec.from_config(variant)  # every variant is a valid model (heads divide, impl exists, ...)
    count = parameter_count(config)  # builds the model abstractly (cached per spec: configs share sizes)
    # Every config's base model is the paper's architecture (variants live in sweeps), so its size is the hand count.
    m = config.model
    assert m.num_encoder_layers == m.num_decoder_layers
    assert count == hand_count(m.vocab_size, m.d_model, m.d_ff, m.num_encoder_layers)


def _saved_before_pad_id_was_removed(pad_id: int) -> ml_collections.ConfigDict:
    """A config as checkpoints.load_config rebuilds it from the JSON saved by earlier versions."""
    from configs import common

    saved = common.base_config("tiny").to_dict()
    del saved["model"]["fused_backward"]  # did not exist yet
    for name in bookkeeping.ADDED_KEYS:  # nor did these
        group, _, leaf = name.partition(".")
        del saved[group][leaf]
    for key in ("eos_id", "bos_id", "unk_id"):  # did not exist yet: the ids were constants
        del saved["model"][key]
    saved["model"]["pad_id"] = pad_id
    return ml_collections.ConfigDict(json.loads(json.dumps(saved)))


def _saved_before_the_special_ids_were_keys() -> ml_collections.ConfigDict:
    from configs import common

    saved = common.base_config("tiny").to_dict()
    for key in ("pad_id", "eos_id", "bos_id", "unk_id"):
        del saved["model"][key]
    return ml_collections.ConfigDict(json.loads(json.dumps(saved)))


def test_configs_saved_with_model_pad_id_still_build_the_same_model():
    from configs import common

    old = bookkeeping.upgrade_config(_saved_before_pad_id_was_removed(0))  # as checkpoints.load_config does
    spec = TransformerSpec.from_config(old)
    assert spec.fused_backward == "on"  # what those versions ran
    new = common.base_config("tiny")
    new.model.fused_backward = "on"
    assert spec == TransformerSpec.from_config(new)
    assert old.eval.max_len == 0  # and the evaluation settings too: no absolute cap on outputs, as then
    with pytest.raises(ConfigError, match="model.pad_id: a config saved without model.fused_backward had padding 0"):
        bookkeeping.upgrade_config(_saved_before_pad_id_was_removed(5))


def test_configs_saved_before_the_marian_keys_build_the_same_model():
    """A checkpoint's config without model.final_logits_bias, model.sinusoid_layout and eval.max_len (every one
    written before them) restores as the model it was trained as: no bias, interleaved positions, no output cap."""
    from configs import common

    saved = common.base_config("tiny").to_dict()
    for name in ("model.final_logits_bias", "model.sinusoid_layout", "eval.max_len"):
        group, _, leaf = name.partition(".")
        del saved[group][leaf]
    old = bookkeeping.upgrade_config(ml_collections.ConfigDict(json.loads(json.dumps(saved))))
    assert TransformerSpec.from_config(old) == TransformerSpec.from_config(common.base_config("tiny"))
    assert old.eval.max_len == 0
    assert bookkeeping.upgrade_config(old).to_dict() == old.to_dict()  # today's keys: unchanged


def test_a_config_saved_by_an_earlier_version_gets_every_key_of_today():
    """tests/data/config_saved_before_the_marian_keys.json is the config.json a training run wrote before the
    special ids, the Marian keys, corpus mixing and trackers existed (its text_dir made relative): upgraded as
    checkpoints.load_config does, it has every key of today's schema, passes today's checks and builds the model it
    was trained as. A key added to the schema without its entry in bookkeeping.ADDED_KEYS fails here."""
    from transformer_jax import cli
    from transformer_jax.config import schema

    saved = json.loads((Path(__file__).parent / "data" / "config_saved_before_the_marian_keys.json").read_text())
    old = bookkeeping.upgrade_config(ml_collections.ConfigDict(saved))
    today = schema.base_config("small")
    keys = {(group, leaf) for group in today for leaf in today[group]}
    assert {(group, leaf) for group in old for leaf in old[group]} == keys
    cli.validate(old)
    spec = TransformerSpec.from_config(old)
    assert (spec.vocab_size, spec.source_vocab_size, spec.sinusoid_layout) == (8000, 0, "interleaved")
    assert not spec.final_logits_bias and SpecialIds.of(old) == SpecialIds.DEFAULT


def _saved_with_comma_joined_lists() -> dict:
    """The config.json (and checkpoint config) of a run before the list-valued keys were tuples: each a string."""
    from configs import common

    saved = json.loads(common.base_config("tiny").to_json())
    saved["data"]["corpora"] = "real=text:/d/m30k:1,bt=files:/d/bt.en+/d/mono.de:0.5:<BT>"
    saved["eval"]["extra_valid"] = "tatoeba=/d/tatoeba:test,news=/d/news"
    saved["opt"]["freeze"] = "encoder_layers,src_embed"
    saved["train"]["trackers"] = "tensorboard,wandb"
    return saved


def test_configs_saved_with_comma_joined_lists_restore_and_resume_as_the_same_run():
    """A checkpoint whose config holds the comma-joined strings of before: checkpoints.load_config reads the tuples
    (bookkeeping.upgrade_config splits them by each key's rule), it passes today's checks, and a restart that gives
    the same values, as tuples or as the same strings on the command line, is the same run (config_differences)."""
    from configs import common
    from transformer_jax.training import checkpoints

    old = bookkeeping.upgrade_config(ml_collections.ConfigDict(_saved_with_comma_joined_lists()))
    assert old.data.corpora == (
        ("real", "text", "/d/m30k", 1.0, ""),
        ("bt", "files", "/d/bt.en+/d/mono.de", 0.5, "<BT>"),
    )
    assert old.eval.extra_valid == (("tatoeba", "/d/tatoeba", "test"), ("news", "/d/news", "valid"))
    assert old.opt.freeze == ("encoder_layers", "src_embed") and old.train.trackers == ("tensorboard", "wandb")
    cli.validate(old)
    assert bookkeeping.upgrade_config(old) is old  # today's values: unchanged
    current = common.base_config("tiny")
    current.data.corpora = (("real", "text", "/d/m30k", 1, ""), ("bt", "files", "/d/bt.en+/d/mono.de", 0.5, "<BT>"))
    current.eval.extra_valid = ("tatoeba=/d/tatoeba:test,news=/d/news",)  # as --config.eval.extra_valid=... gives it
    current.opt.freeze, current.train.trackers = ("encoder_layers", "src_embed"), ("tensorboard,wandb",)
    cli.validate(current)
    saved = json.loads(old.to_json())
    assert checkpoints.config_differences(saved, json.loads(current.to_json())) == []
    current.opt.freeze = ("encoder_layers",)  # a must-match key that changed is still refused
    assert checkpoints.config_differences(saved, json.loads(current.to_json()))[0].startswith("opt.freeze:")


def test_configs_saved_before_the_special_id_keys_keep_the_constants_of_their_version():
    from configs import common

    old = bookkeeping.upgrade_config(_saved_before_the_special_ids_were_keys())
    assert SpecialIds.of(old) == SpecialIds(pad=0, eos=1, bos=2, unk=3)
    assert TransformerSpec.from_config(old) == TransformerSpec.from_config(common.base_config("tiny"))


@pytest.mark.parametrize(
    "ids, error",
    [
        ({"pad_id": 50}, "model.pad_id: 50 is not a row of the vocabulary"),
        ({"eos_id": 0}, "model.eos_id: equals model.pad_id"),
        ({"unk_id": 1}, "model.unk_id: equals model.eos_id"),
        ({"bos_id": 3}, "model.unk_id: equals model.bos_id"),  # bos may equal eos (fairseq), never unk
        ({"pad_id": -1}, "model.pad_id: must be"),
    ],
)
def test_special_ids_are_checked(ids, error):
    from configs import common

    config = common.base_config("tiny")
    config.model.vocab_size = 50
    config.model.update(ids)
    with pytest.raises(ConfigError, match=error):
        TransformerSpec.from_config(config)


def test_marian_ids_are_valid_and_bos_may_equal_pad():
    from configs import common

    config = common.base_config("tiny")
    config.model.update(vocab_size=50, pad_id=49, bos_id=49, eos_id=0, unk_id=1)
    assert SpecialIds.of(TransformerSpec.from_config(config)) == SpecialIds(pad=49, eos=0, bos=49, unk=1)


def test_a_new_config_without_a_model_key_fails():
    from configs import common

    config = common.base_config("tiny")
    del config.model["fused_backward"]
    with pytest.raises(ConfigError, match="missing model keys: \\['model.fused_backward'\\]"):
        TransformerSpec.from_config(config)


def test_bad_config_argument_is_a_clear_error():
    from configs import wmt14_ende

    with pytest.raises(ValueError, match="unknown config argument 'sise'"):
        wmt14_ende.get_config("sise=base")
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        wmt14_ende.get_config("size=huge")


@pytest.mark.parametrize("arg", ["scale=paper,steps=1000", "scale=small,steps=500", "scale=mini,steps=400"])
def test_short_sweeps_keep_the_peak_learning_rate(arg):
    """A sweep with fewer steps shortens warmup; the paper schedule's peak, learning_rate * warmup^-0.5, stays."""
    from configs import ablations_table3
    from transformer_jax.training.step import learning_rate_schedule

    full, short = ablations_table3.get_config(arg.split(",")[0]), ablations_table3.get_config(arg)
    assert short.opt.warmup_steps < full.opt.warmup_steps
    full_peak = learning_rate_schedule(full.opt, full.train.num_steps)(full.opt.warmup_steps - 1)
    short_peak = learning_rate_schedule(short.opt, short.train.num_steps)(short.opt.warmup_steps - 1)
    assert abs(float(short_peak) / float(full_peak) - 1) < 1e-3


@pytest.mark.parametrize("name", ["backtranslation", "distillation"])
def test_an_experiment_config_without_its_data_directory_says_which_argument_to_give(name):
    with pytest.raises(ValueError, match="needs data=DIR"):
        importlib.import_module(f"configs.{name}").get_config(None)


def test_the_back_translator_config_reverses_the_real_pairs_and_its_arms_refuse_that_direction():
    from configs import backtranslation

    config = backtranslation.get_config("data=runs/bt/data,direction=de-en")  # the de-en back-translator's run
    cli.validate(config)
    assert (config.data.src_lang, config.data.tgt_lang) == ("de", "en")
    assert config.data.corpora == (("real", "files", "runs/bt/data/real.de+runs/bt/data/real.en", 1, ""),)
    with pytest.raises(ValueError, match="arms are en-de"):
        backtranslation.get_sweep("data=runs/bt/data,direction=de-en")
