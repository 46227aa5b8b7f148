"""Adding languages to a model a run fine-tunes (`data.add_languages`, `train.new_language_init`; issue 64).

A fine-tuning run from `train.init_from` appends one row per added language to every vocabulary-sized parameter
(the embedding tables, an untied output projection's columns, the final logits bias) and one entry to the language
table, model.language_codes, after the source's ids: the one exception to "the architecture keys come from the
source" (training/init_from.py), since model.vocab_size grows by exactly the added languages. The table's code
is spelt as the model's codes are: `slk_Latn` for an NLLB-200 table, `__sk__` for M2M-100's (the workdir's copy of
vocab.json gets it too), the name as given (the folder suffix, `sk`) for our own models, whose implicit table (the
last ids of model.vocab_size, data/languages.py Placement) is written out so that the old ids stay where they were.

Each new row starts as `train.new_language_init`: `mean`, the mean of the source's language rows, or a language
the source has (`ces` for Slovak), that language's row. Under LoRA (opt.lora_rank > 0) the base is frozen, so the
new rows are trainable parameters of their own: model/lora.py's NewRows, a zero-initialised [n, D] delta on the
last n rows of each embedding table that the optimizer trains and `merge` adds into the table; the base of such a
run is its source grown as above (read again at every restart, `load_base`, and checked by the source's checksum).
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from transformer_jax.data import languages
from transformer_jax.data.tokenizer import FAIRSEQ_VOCAB
from transformer_jax.errors import ConfigError
from transformer_jax.model.lora import LoRASpec
from transformer_jax.training import checkpoints

MEAN = "mean"
NLLB_CODE = re.compile(r"[a-z]{3}_[A-Z][a-z]{3}")  # eng_Latn: ISO 639-3 and ISO 15924 script
# Vocabulary-sized parameters (by their path's last names) and the axis of their vocabulary.
VOCAB_AXES = {("src_embed", "table_VD"): 0, ("tgt_embed", "table_VD"): 0, ("output_proj", "kernel"): 1}
BIAS = "final_logits_bias_V"


def count(config: ml_collections.ConfigDict) -> int:
    """How many rows the run appends: len(data.add_languages)."""
    return len(config.data.get("add_languages", ()))


def _spelling(name: str, codes: dict[str, int]) -> str:
    """The code a new language gets in a table of `codes` (one the model lacks): NLLB-200's `xxx_Scrp`, M2M-100's
    `__xx__`, else the name itself (our own models: the folder's suffix)."""
    bare = languages.bare(name)
    if codes and all(NLLB_CODE.fullmatch(c) for c in codes):
        if NLLB_CODE.fullmatch(bare):
            return bare
        try:
            return languages.resolve(bare, languages.NLLB_CODES)
        except ConfigError:
            raise ConfigError(
                f"config key data.add_languages: {name!r} has no NLLB-200 spelling we know; give its code as "
                "ISO 639-3 and script, e.g. slk_Latn"
            ) from None
    if codes and all(c.startswith("__") and c.endswith("__") for c in codes):
        twos = [two for two, three in languages.ISO639_3.items() if three == bare]
        return f"__{twos[0] if len(bare) == 3 and twos else bare}__"
    return bare


def extend(
    config: ml_collections.ConfigDict, source_config: ml_collections.ConfigDict, source: pathlib.Path
) -> ml_collections.ConfigDict:
    """`config` (merged with the source's architecture) with model.vocab_size grown by data.add_languages and their
    codes after the source's in model.language_codes; ConfigError, one line, for a language the source has, an
    init language it lacks, or a source without language tokens."""
    where = f"train.init_from {source}"
    added = list(config.data.add_languages)
    if source_config.model.get("lang_token", "none") == "none" and not source_config.model.get("language_codes"):
        raise ConfigError(
            f"config key data.add_languages: the model of {where} has no language tokens (model.lang_token=none); "
            "languages can be added to a multilingual or converted model only"
        )
    if config.model.source_vocab_size or (LoRASpec.of(config) and not config.model.tie_output):
        raise ConfigError(
            f"config key data.add_languages: the model of {where} has a separate source vocabulary or (under LoRA) an "
            "untied output projection, which new languages cannot be added to; fine-tune it without them"
        )
    old = dict(languages.Placement.of(source_config).ids)
    new: dict[str, int] = {}
    for name in added:
        try:
            have = languages.resolve(name, old)
        except ConfigError:
            have = None
        if have is not None:
            raise ConfigError(
                f"config key data.add_languages: the model of {where} has {name!r} already (code {have!r}, id "
                f"{old[have]}); fine-tune on it without adding it, or add another language"
            )
        code = _spelling(name, old)
        if code in new:
            raise ConfigError(f"config key data.add_languages: {name!r} is given twice ({code}); give each once")
        new[code] = config.model.vocab_size + len(new)
    init = config.train.new_language_init
    if init != MEAN:
        try:
            languages.resolve(init, old)
        except ConfigError as e:
            raise ConfigError(f"config key train.new_language_init: {e} (or use mean)") from None
    table = sorted({**old, **new}.items(), key=lambda code: code[1])
    grown = ml_collections.ConfigDict(config.to_dict())
    grown.model.vocab_size = config.model.vocab_size + len(new)
    grown.model.language_codes = tuple((code, i) for code, i in table)
    return grown.lock() if config.is_locked else grown


def init_ids(config: ml_collections.ConfigDict) -> list[int]:
    """The ids of the rows each new row starts from, averaged (mean) or one (a named language), in a grown config."""
    n = count(config)
    first = config.model.vocab_size - n
    old = {code: i for code, i in config.model.language_codes if i < first}
    init = config.train.new_language_init
    return sorted(old.values()) if init == MEAN else [old[languages.resolve(init, old)]]


def _vocab_axis(path: tuple) -> int | None:
    names = tuple(str(p) for p in path)
    if names and names[-1] == BIAS:
        return 0
    return VOCAB_AXES.get(names[-2:])


def grow(params: Any, config: ml_collections.ConfigDict) -> Any:
    """The source's parameters (a pure dict) with count(config) rows appended to each vocabulary-sized parameter,
    each the mean of the init_ids rows (or that one row)."""
    n, ids = count(config), jnp.asarray(init_ids(config))

    def one(path: tuple, x: jax.Array) -> jax.Array:
        axis = _vocab_axis(tuple(getattr(k, "key", k) for k in path))
        if axis is None:
            return x
        row = jnp.mean(jnp.take(x, ids, axis=axis), axis=axis, keepdims=True)
        return jnp.concatenate([x, jnp.repeat(row, n, axis=axis)], axis=axis)

    return jax.tree_util.tree_map_with_path(one, params)


def source_part(params: Any, config: ml_collections.ConfigDict) -> Any:
    """Grown parameters without their appended rows: the source's, bit for bit (what its checksum covers)."""
    n = count(config)
    if not n:
        return params

    def one(path: tuple, x: jax.Array) -> jax.Array:
        axis = _vocab_axis(tuple(getattr(k, "key", k) for k in path))
        return x if axis is None else jax.lax.slice_in_dim(x, 0, x.shape[axis] - n, axis=axis)

    return jax.tree_util.tree_map_with_path(one, params)


def _shrunk(abstract_state: nnx.State, n: int) -> nnx.State:
    """An abstract train state (or {"model": Param state}) with the source's vocabulary: n fewer rows."""

    def one(path: tuple, x: Any) -> Any:
        names = tuple(getattr(k, "key", getattr(k, "name", k)) for k in path)
        names = tuple(k for k in names if k != "value")
        axis = _vocab_axis(names)
        if axis is None or not hasattr(x, "shape"):
            return x
        shape = list(x.shape)
        shape[axis] -= n
        return jax.ShapeDtypeStruct(tuple(shape), x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree_util.tree_map_with_path(one, abstract_state)


def load_base(config: ml_collections.ConfigDict, record: dict | None, abstract_state: nnx.State, where: str) -> dict:
    """checkpoints.load_base of a LoRA run, grown by the run's added languages (its record covers the source)."""
    n = count(config)
    if not n:
        return checkpoints.load_base(record, abstract_state, where)
    return grow(checkpoints.load_base(record, _shrunk(abstract_state, n), where), config)


def vocab_json(source_vocab: pathlib.Path, config: ml_collections.ConfigDict) -> bytes:
    """A converted model's vocab.json with the added codes at their ids (as m2m100_vocab.write_vocabulary writes)."""
    pieces = json.loads(source_vocab.read_text(encoding="utf-8"))
    first = config.model.vocab_size - count(config)
    pieces.update({code: int(i) for code, i in config.model.language_codes if i >= first})
    return json.dumps(pieces, ensure_ascii=False, indent=0).encode("utf-8")


def is_vocab(path: pathlib.Path) -> bool:
    return path.name == FAIRSEQ_VOCAB
