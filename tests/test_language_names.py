"""Language names (data/languages.py): a user's `en`, `eng`, `eng_Latn`, `>>en<<` or `__en__` resolve to the model's
code for English, NLLB-200's or M2M-100's, through one name table; a converted model's code table
(model.language_codes) is where Placement takes its ids; our copies of the families' code lists are transformers'."""

from __future__ import annotations

import ml_collections
import pytest

from configs import common
from transformer_jax import cli
from transformer_jax.config import schema
from transformer_jax.data import languages
from transformer_jax.data.languages import ISO639_3, M2M100_CODES, NLLB_CODES, Direction, Placement, resolve
from transformer_jax.errors import ConfigError
from transformer_jax.training import bookkeeping

NLLB = {code: 256001 + i for i, code in enumerate(NLLB_CODES)}  # NLLB-200's layout: after 256,001 pieces
M2M = {f"__{code}__": 128004 + i for i, code in enumerate(M2M100_CODES["m2m100"])}  # M2M-100 418M's: after 128,004


def test_our_code_lists_are_transformers():
    transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")
    from transformers.models.m2m_100 import tokenization_m2m_100
    from transformers.models.nllb import tokenization_nllb

    assert list(NLLB_CODES) == tokenization_nllb.FAIRSEQ_LANGUAGE_CODES
    assert {k: list(v) for k, v in M2M100_CODES.items()} == tokenization_m2m_100.FAIRSEQ_LANGUAGE_CODES
    assert transformers.__version__  # the oracle the lists were read from


def test_english_and_czech_by_every_spelling():
    for name in ("en", "eng", "eng_Latn", ">>en<<", "__en__", ">>eng_Latn<<"):
        assert resolve(name, NLLB) == "eng_Latn" and resolve(name, M2M) == "__en__", name
    for name in ("cs", "ces", "ces_Latn", "__cs__"):
        assert resolve(name, NLLB) == "ces_Latn" and resolve(name, M2M) == "__cs__", name
    assert M2M["__en__"] == 128022  # facebook/m2m100_418M's id of __en__
    # macrolanguages: the individual language NLLB-200 has
    for two, code in (
        ("ar", "arb_Arab"),
        ("fa", "pes_Arab"),
        ("ms", "zsm_Latn"),
        ("no", "nob_Latn"),
        ("lv", "lvs_Latn"),
    ):
        assert resolve(two, NLLB) == code and resolve(code, M2M) == f"__{two}__"
    assert resolve("nb", M2M) == "__no__" and resolve("ns", NLLB) == "nso_Latn" and resolve("ast", M2M) == "__ast__"


def test_ambiguous_and_absent_languages_are_one_line_naming_the_choices():
    with pytest.raises(ConfigError, match=r"^language 'zh' is more than one .*give one of \['zho_Hans', 'zho_Hant'\]$"):
        resolve("zh", NLLB)
    assert resolve("zh", M2M) == resolve("zho_Hant", M2M) == "__zh__"
    for name, codes in (("br", NLLB), ("yue_Hant", M2M), ("xx", NLLB), ("", M2M)):
        with pytest.raises(
            ConfigError, match=rf"^language '{name}': the model has no code for it; it has \[.*\(en, eng"
        ):
            resolve(name, codes)


def test_the_name_table_spells_nllbs_codes_for_every_language_of_both():
    prefixes = {code.split("_")[0] for code in NLLB_CODES}
    assert {two for two, three in ISO639_3.items() if three not in prefixes} == {"br", "fy"}  # not in NLLB-200
    assert all(len(two) == 2 for two in ISO639_3) and len(set(ISO639_3.values())) == len(ISO639_3) - 1  # no, nb
    for code in M2M100_CODES["m2m100"]:
        assert code in ISO639_3 or code in prefixes, code  # 2 letters through the table, 3 as they are (ast, ceb, ilo)
        if code not in ("br", "fy", "zh"):
            assert resolve(f"__{code}__", NLLB).split("_")[0] == ISO639_3.get(code, code)
            assert resolve(resolve(code, NLLB), M2M) == f"__{code}__"


def converted(**model) -> ml_collections.ConfigDict:
    config = common.base_config("tiny")
    config.model.vocab_size = 256206
    config.model.lang_token = "source_and_target"
    config.model.language_codes = tuple(NLLB.items())
    config.model.update(model)
    return config


def test_a_converted_models_placement_is_its_code_table():
    config = converted()
    cli.validate(config)  # lang_token without data.directions: the codes are the languages
    placement = Placement.of(config)
    assert placement.ids == NLLB and placement.has("de") and not placement.has("zh") and not placement.has("br")
    d = Direction("en", "cs")
    assert (placement.source_prefix(d), placement.target_prefix(d)) == (NLLB["eng_Latn"], NLLB["ces_Latn"])
    assert placement.code_of(">>cs<<") == "ces_Latn" and placement.id("fra_Latn") == NLLB["fra_Latn"]
    # Fine-tuning on data.directions uses the codes of its languages, nothing appended.
    config.data.directions, config.data.tokenizer = ("en-cs", "cs-en"), "fairseq"
    cli.validate(config)
    assert Placement.of(config).ids == NLLB
    config.data.directions = ("en-br",)
    with pytest.raises(ConfigError, match=r"^data.directions: language 'br': the model has no code for it"):
        Placement.of(config)
    config.data.directions = ("en-cs",)
    config.data.tokenizer = "marian"  # spm may hold codes: ours, after data.add_languages
    with pytest.raises(ConfigError, match="config key data.tokenizer"):
        cli.validate(config)
    with pytest.raises(ConfigError, match=r"model.language_codes: .* below model.vocab_size=256202; \['zul_Latn'\]"):
        Placement.of(converted(vocab_size=256001 + len(NLLB) - 1))
    with pytest.raises(ConfigError, match="two codes share one id"):
        Placement.of(converted(language_codes=(("eng_Latn", 5), ("ces_Latn", 5))))


def test_a_run_of_our_own_keeps_its_languages_and_takes_the_names_too():
    config = common.base_config("tiny")
    config.data.directions = ("en-de", "de-en")
    config.model.lang_token = "target"
    placement = Placement.of(config)
    assert placement.ids == {"de": config.model.vocab_size - 2, "en": config.model.vocab_size - 1}
    assert placement.id(">>en<<") == placement.id("eng") == placement.id("en")
    with pytest.raises(ConfigError, match=r"language 'fr': the model has no code for it; it has \['de', 'en'\]"):
        placement.id("fr")


def test_the_key_reads_the_command_line_and_saved_configs_without_it():
    rule = schema.RULES["model.language_codes"]
    assert rule.split("model.language_codes", "eng_Latn=256047,ces_Latn=256042") == (
        ("eng_Latn", 256047),
        ("ces_Latn", 256042),
    )
    assert rule.split("model.language_codes", [["__en__", 128022]]) == (("__en__", 128022),)  # as JSON reads it
    saved = common.base_config("tiny").to_dict()
    del saved["model"]["language_codes"]
    assert bookkeeping.upgrade_config(ml_collections.ConfigDict(saved)).model.language_codes == ()
    assert "model.language_codes" in schema.ARCHITECTURE and "model.language_codes" in schema.MUST_MATCH
    assert languages.code("en") == ">>en<<"
