"""What checkpoints written by earlier versions need to restore today, in one place; nothing else reads old layouts.

Two migrations, each kept because checkpoints of those versions exist (tests/test_state.py, tests/test_configs.py):

- State layout: before the TrainState fields had names, a checkpoint's `state` item stored them under the
  positions 0, 1, 2 (the same order). `state_keys` maps each field to the key it is saved under.
- Config: the reserved ids were fixed constants (pad 0, eos 1, bos 2, unk 3: tokens.SpecialIds.DEFAULT) until the
  `model.pad_id/eos_id/bos_id/unk_id` keys came; a config saved in between has none of them, and one saved before
  that held `model.pad_id` alone (it could only be 0) and had no `model.fused_backward` (those versions ran the
  hand-written backward passes everywhere: 'on'). `upgrade_config` rewrites such a saved config in today's keys;
  checkpoints.load_config applies it.
- Config: keys added later (`ADDED_KEYS`) are missing from the configs saved before them; they get the value that
  does what those versions did.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import ml_collections

from transformer_jax.errors import ConfigError
from transformer_jax.tokens import FIELDS, SpecialIds


def state_keys(saved_keys: Iterable[str], fields: Sequence[str]) -> dict[str, Any]:
    """TrainState field -> the top-level key of the saved `state` tree that holds it: the field's name, or its
    position in a checkpoint of the positional layout."""
    if set(saved_keys) == {str(i) for i in range(len(fields))}:
        return {name: i for i, name in enumerate(fields)}
    return {name: name for name in fields}


# Keys added after checkpoints were written, and the value that does what the versions without them did.
ADDED_KEYS: dict[str, Any] = {
    "model.final_logits_bias": False,  # no bias on the logits
    "model.sinusoid_layout": "interleaved",  # the paper's, the only layout there was
    "eval.max_len": 0,  # no absolute cap on outputs, only eval.max_extra_len
    "model.source_vocab_size": 0,  # the source vocabulary is the target's
    "data.tokenizer": "spm",  # one joint SentencePiece model, the only tokenizer there was
    "data.target_lang": "",  # no >>xx<< token before the source
    "data.corpora": "",  # one training corpus
    "train.trackers": "tensorboard",  # TensorBoard beside metrics.jsonl, as then
    "train.tracker_group": "",
}


def upgrade_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A config saved with a checkpoint, in today's keys (unchanged when it has them already)."""
    added = {
        name: value
        for name, value in ADDED_KEYS.items()
        if name.partition(".")[0] in config and name.partition(".")[2] not in config[name.partition(".")[0]]
    }
    if added:
        values = config.to_dict()
        for name, value in added.items():
            group, _, leaf = name.partition(".")
            values[group][leaf] = value
        config = ml_collections.ConfigDict(values)
    if "model" not in config:
        return config
    missing = [f"{field}_id" for field in FIELDS if f"{field}_id" not in config.model]
    if not missing and "fused_backward" in config.model:
        return config
    upgraded = config.to_dict()
    model = upgraded["model"]
    if "fused_backward" not in model:
        pad_id = model.get("pad_id", SpecialIds.DEFAULT.pad)
        if pad_id != SpecialIds.DEFAULT.pad:
            raise ConfigError(
                f"invalid config key model.pad_id: a config saved without model.fused_backward had padding "
                f"{SpecialIds.DEFAULT.pad} always, got {pad_id}; set it to {SpecialIds.DEFAULT.pad}"
            )
        model["fused_backward"] = "on"
    for key in missing:  # the constants of those versions
        model[key] = getattr(SpecialIds.DEFAULT, key.removesuffix("_id"))
    return ml_collections.ConfigDict(upgraded)
