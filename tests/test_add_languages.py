"""Adding languages to a fine-tuned model (data.add_languages, train.new_language_init; issue 64 item 4): one new
embedding row and code per language after the source's ids, the source's rows unchanged, each new row the mean of
the code rows or a named language's row; under LoRA the new rows train as deltas beside the frozen table; bad input
is one line with nothing written."""

from __future__ import annotations

import pathlib

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from tests.helpers.data import write_multiway
from tests.helpers.training import tiny_train_config
from transformer_jax import cli
from transformer_jax.data import languages
from transformer_jax.data.tokenizer import model_tokenizer
from transformer_jax.errors import ConfigError
from transformer_jax.model import build_model, model_rngs
from transformer_jax.model.lora import LoRASpec, add_adapters, merge
from transformer_jax.training import checkpoints, init_from
from transformer_jax.training import step as state

SOURCE_VOCAB = 282  # 280 pieces and the source's two languages, de and en


def source_config(text_dir: pathlib.Path) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict(tiny_train_config(text_dir, eval_every=0).to_dict())
    config.model.vocab_size = SOURCE_VOCAB
    config.model.lang_token = "target"
    config.data.directions = ("en-de", "de-en")
    config.data.tokenizer_type = "bpe"
    return config


def finetune_config(text_dir: pathlib.Path, source: pathlib.Path, **data) -> ml_collections.ConfigDict:
    config = source_config(text_dir)
    config.train.init_from = str(source)
    config.data.directions = ("en-cs", "cs-en", "en-de")
    config.data.add_languages = ("cs",)
    config.data.update(data)
    config.opt.schedule, config.opt.warmup_steps, config.opt.learning_rate = "constant", 1, 3e-3
    return config


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> pathlib.Path:
    return write_multiway(tmp_path_factory.mktemp("multiway") / "d", n=60)


@pytest.fixture(scope="module")
def source(text_dir, tmp_path_factory) -> pathlib.Path:
    """An en<->de workdir: its tokenizer (trained on en and de) and a checkpoint of a freshly initialised model."""
    workdir = tmp_path_factory.mktemp("source") / "run"
    config = source_config(text_dir)
    model_tokenizer(config, workdir)
    _, train_state = state.create_train_state(config)
    saver = checkpoints.Checkpointer(workdir, config.ckpt)
    saver.save(3, train_state, {"position": 3}, config)
    saver.close()
    return workdir


def _table(params: dict) -> np.ndarray:
    return np.asarray(params["src_embed"]["table_VD"])


def _source_params(source: pathlib.Path) -> dict:
    config = checkpoints.load_config(source)
    return jax.device_get(checkpoints.load_model_params(source, 3, state.abstract_train_state(config)[1]))


def test_a_new_language_gets_one_id_after_the_sources_and_the_mean_row(source, text_dir, tmp_path):
    start = init_from.prepare(finetune_config(text_dir, source), tmp_path / "ft")
    config = start.config
    assert config.model.vocab_size == SOURCE_VOCAB + 1
    assert config.train.source_directions == ("en-de", "de-en")  # what the source trained: supervised in a matrix
    assert dict(config.model.language_codes) == {"de": 280, "en": 281, "cs": 282}  # the old ids stay
    placement = languages.Placement.of(config)
    tokenizer = model_tokenizer(config, tmp_path / "ft")
    assert placement.id("cs") == tokenizer.language_table.id("cs") == 282
    assert placement.target_prefix(languages.Direction("en", "cs")) == 282
    old, new = _table(_source_params(source)), _table(start.params)
    assert new.shape == (SOURCE_VOCAB + 1, old.shape[1])
    np.testing.assert_array_equal(new[:SOURCE_VOCAB], old)  # the old rows, bit for bit
    np.testing.assert_allclose(new[282], old[[280, 281]].mean(axis=0), rtol=1e-6)
    assert tokenizer.language_id("cs") == 282
    assert 282 not in tokenizer.encode_source_batch(["cs3 cs12 de4 >>cs<<"])[0]  # text never encodes to the code
    assert tokenizer.decode_target([5, 282, 6]) == tokenizer.decode_target([5, 6])  # decoding drops it


def test_a_named_language_starts_the_new_row_as_its_own(source, text_dir, tmp_path):
    config = finetune_config(text_dir, source)
    config.train.new_language_init = "de"
    start = init_from.prepare(config, tmp_path / "ft")
    np.testing.assert_array_equal(_table(start.params)[282], _table(_source_params(source))[280])


@pytest.mark.parametrize(
    "change,match",
    [
        ({"data.add_languages": ("de",)}, "has 'de' already"),
        ({"train.new_language_init": "fr"}, "train.new_language_init: language 'fr'"),
        ({"data.add_languages": ("cs", "cs")}, "given twice"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(source, text_dir, tmp_path, change, match):
    config = finetune_config(text_dir, source)
    config.update_from_flattened_dict(change)
    with pytest.raises(ConfigError, match=match) as error:
        init_from.prepare(config, tmp_path / "ft")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "ft").exists()


def test_dry_run_and_plan_size_the_grown_model(source, text_dir):
    planned = init_from.planned_config(finetune_config(text_dir, source))
    assert planned.model.vocab_size == SOURCE_VOCAB + 1 and dict(planned.model.language_codes)["cs"] == 282
    assert planned.train.source_directions == ("en-de", "de-en")


def test_a_source_that_was_fine_tuned_passes_on_its_own_sources_directions(source, text_dir, tmp_path):
    """train.source_directions is the chain's: a source fine-tuned from an en-fr run gives en-fr, then its own."""
    config = source_config(text_dir)
    config.train.source_directions = ("en-fr", "en-de")
    _, train_state = state.create_train_state(config)
    saver = checkpoints.Checkpointer(tmp_path / "second", config.ckpt)
    saver.save(3, train_state, {"position": 3}, config)
    saver.close()
    (tmp_path / "second" / "spm.model").write_bytes((source / "spm.model").read_bytes())
    config = finetune_config(text_dir, tmp_path / "second")
    assert init_from.prepare(config, tmp_path / "ft").config.train.source_directions == ("en-fr", "en-de", "de-en")
    config.train.source_directions = ("en-cs",)
    with pytest.raises(ConfigError, match="train.source_directions=.*contradicts the directions the source trained"):
        init_from.prepare(config, tmp_path / "other", overrides={"train.source_directions"})
    assert not (tmp_path / "other").exists()


@pytest.mark.slow
def test_train_py_refuses_a_language_the_source_has_in_one_line(source, text_dir, tmp_path):
    import os
    import subprocess
    import sys

    from tests.helpers import REPO

    done = subprocess.run(
        [sys.executable, "train.py", "--config", f"configs/finetune.py:init_from={source},directions=en-de,add=de"]
        + ["--config.data.text_dir", str(text_dir), "--workdir", str(tmp_path / "ft")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode != 0
    assert "has 'de' already" in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert list((tmp_path / "ft").iterdir()) == []  # train.py makes the folder; nothing is written in it


def test_adding_languages_needs_a_source():
    config = ml_collections.ConfigDict(source_config(pathlib.Path("d")).to_dict())
    config.data.add_languages = ("cs",)
    with pytest.raises(ConfigError, match="data.add_languages=.*train.init_from is empty"):
        cli.check_between(dict(cli.leaves(config)))


def test_under_lora_the_new_rows_are_deltas_that_merge_into_the_table(source, text_dir, tmp_path):
    config = init_from.prepare(finetune_config(text_dir, source), tmp_path / "ft").config
    config.opt.lora_rank, config.opt.lora_targets = 2, ("q", "embed")
    spec = LoRASpec.of(config)
    assert spec.new_rows == 1
    model = build_model(config, rngs=model_rngs(0))
    add_adapters(model, spec, rngs=model_rngs(1))
    assert state.trainable(model) is nnx.LoRAParam
    rows = model.src_embed.adapter
    rows.delta_ND[...] = jax.random.normal(jax.random.key(0), rows.delta_ND.shape)
    rows.inner.b[...] = jax.random.normal(jax.random.key(1), rows.inner.b.shape)
    base = nnx.to_pure_dict(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))
    merged = merge(base, nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam)), spec)
    tokens = np.array([[5, 281, 282]])
    plain = build_model(config, rngs=model_rngs(0))
    params = nnx.state(plain, nnx.Param)
    nnx.replace_by_pure_dict(params, merged)
    nnx.update(plain, params)
    np.testing.assert_allclose(plain.src_embed(tokens), model.src_embed(tokens), rtol=1e-5, atol=1e-6)
    x = np.ones((1, 1, config.model.d_model), np.float32)
    np.testing.assert_allclose(plain.src_embed.attend(x), model.src_embed.attend(x), rtol=1e-5, atol=1e-5)


def _fine_tune(
    text_dir: pathlib.Path, source: pathlib.Path, workdir: pathlib.Path, steps: int = 40, every: int = 40, **opt
) -> ml_collections.ConfigDict:
    """A fine-tuning run adding Czech (constant rate: the same schedule whatever `steps`)."""
    from transformer_jax.training import loop

    config = finetune_config(text_dir, source)
    config.data.directions = ("en-cs", "de-cs")
    config.train.num_steps, config.ckpt.every_steps, config.eval.average_last = steps, every, 1
    config.opt.learning_rate = 1e-2
    config.opt.update(opt)
    loop.train_and_evaluate(config, workdir)
    return checkpoints.load_config(workdir)


def _translations_into_czech(workdir: pathlib.Path) -> list[str]:
    from transformer_jax.evaluation import run
    from transformer_jax.evaluation.restore import CheckpointChoice

    model = run.Model(str(workdir), choice=CheckpointChoice(average_last=1), target_lang="cs", source_lang="en")
    mode = run.Translate(model, split="test", decoding=run.Decoding(beam_size=1, max_len=8))
    loaded = run.load(mode)
    assert 282 in {i for ids in [loaded.language_ids] for i in np.ravel(getattr(ids, "target", ids))}
    return run.translate(mode, loaded).hypotheses


@pytest.mark.slow
def test_after_fine_tuning_the_model_translates_into_the_new_language_and_exports_it(source, text_dir, tmp_path):
    from transformer_jax.interop import ctranslate2 as export_lib

    pytest.importorskip("ctranslate2")
    _fine_tune(text_dir, source, tmp_path / "ft")
    hypotheses = _translations_into_czech(tmp_path / "ft")
    assert hypotheses and all(h.startswith("cs") for h in hypotheses if h), hypotheses[:3]
    assert sum(bool(h) for h in hypotheses) > len(hypotheses) // 2
    export_lib.export_workdir(str(tmp_path / "ft"), tmp_path / "ct2")
    vocabulary = __import__("json").loads((tmp_path / "ct2" / "shared_vocabulary.json").read_text())
    assert vocabulary[282] == ">>cs<<" and len(vocabulary) == SOURCE_VOCAB + 1
    _fine_tune(text_dir, source, tmp_path / "ft", steps=42, every=42)  # resumes its own grown checkpoint
    assert checkpoints.list_steps(tmp_path / "ft")[-1] == 42


@pytest.mark.slow
def test_under_lora_the_base_table_is_unchanged_and_the_new_rows_trained(source, text_dir, tmp_path):
    from transformer_jax.evaluation.restore import restore_model

    lora = {"lora_rank": 2, "lora_targets": ("q", "v")}
    config = _fine_tune(text_dir, source, tmp_path / "lora", **lora)
    adapters = nnx.state(nnx.eval_shape(lambda: state.new_train_state(config).model), nnx.LoRAParam)

    def delta_of(workdir: pathlib.Path) -> np.ndarray:
        trained = checkpoints.load_model_params(workdir, 40, {"model": adapters}, wrt=nnx.LoRAParam)
        return np.asarray(trained["src_embed"]["adapter"]["delta_ND"])

    delta = delta_of(tmp_path / "lora")
    assert delta.shape == (1, config.model.d_model) and np.abs(delta).max() > 0  # the new row learned
    _fine_tune(text_dir, source, tmp_path / "resumed", steps=20, every=20, **lora)
    _fine_tune(text_dir, source, tmp_path / "resumed", steps=40, every=20, **lora)  # reads the grown base again
    np.testing.assert_array_equal(delta_of(tmp_path / "resumed"), delta)
    old = _table(_source_params(source))
    _, model, _ = restore_model(str(tmp_path / "lora"))
    merged = np.asarray(model.src_embed.table_VD[...])
    np.testing.assert_array_equal(merged[:SOURCE_VOCAB], old)  # q and v adapters only: the base table as it was
    np.testing.assert_allclose(merged[282], old[[280, 281]].mean(axis=0) + delta[0], rtol=1e-6)
    assert any(_translations_into_czech(tmp_path / "lora"))


@pytest.mark.slow
def test_evaluate_py_takes_the_new_language_as_target(source, text_dir, tmp_path):
    import subprocess
    import sys

    from tests.helpers import REPO

    _fine_tune(text_dir, source, tmp_path / "ft")
    out = tmp_path / "hyp.cs"
    result = subprocess.run(
        [
            sys.executable,
            "evaluate.py",
            "--workdir",
            str(tmp_path / "ft"),
            "--target_lang",
            "cs",
            "--source_file",
            str(text_dir / "test.en"),
            "--output_file",
            str(out),
            "--beam_size",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert any(line.startswith("cs") for line in out.read_text().splitlines())


def _converted_run_config(
    hf_dir: pathlib.Path, tmp_path: pathlib.Path, lang: str, added: str, steps: int
) -> tuple[ml_collections.ConfigDict, int]:
    """(config, the source's vocab_size) of a run from hf_dir's conversion (tmp_path/w) adding `added` on the en-`lang`
    folder tmp_path/d, checkpointing its last step only."""
    from transformer_jax.interop import m2m100_folder, marian_folder

    marian_folder.write_workdir(m2m100_folder.read_folder(hf_dir), tmp_path / "w")
    vocab = checkpoints.load_config(tmp_path / "w").model.vocab_size
    text_dir = write_multiway(tmp_path / "d", n=40, langs=("en", lang))
    config = tiny_train_config(text_dir, eval_every=0, init_from=str(tmp_path / "w"), num_steps=steps)
    config.data.directions, config.data.add_languages = (f"en-{lang}",), (added,)
    config.ckpt.every_steps, config.eval.average_last = steps, 1
    return config, vocab


@pytest.mark.slow
def test_a_converted_nllb_model_gets_a_code_spelt_as_its_own_and_exports_it(nllb_dir, tmp_path):
    """A converted NLLB-200 workdir fine-tuned with a language NLLB-200 lacks (Western Frisian): the code is spelt
    fry_Latn, vocab.json's copy names it, the model translates into it, and the NLLB and CTranslate2 exports hold it."""
    import json

    from transformer_jax.evaluation.restore import CheckpointChoice
    from transformer_jax.interop import ctranslate2 as ct2_export
    from transformer_jax.interop import m2m100_export
    from transformer_jax.training import loop

    pytest.importorskip("ctranslate2")
    config, vocab = _converted_run_config(nllb_dir, tmp_path, "fy", "fy", steps=20)
    with pytest.raises(ConfigError, match="no NLLB-200 spelling we know; give its code as ISO 639-3 and script"):
        init_from.prepare(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    config.data.add_languages = ("fry_Latn",)
    loop.train_and_evaluate(config, tmp_path / "run")
    tuned = checkpoints.load_config(tmp_path / "run")
    assert tuned.model.vocab_size == vocab + 1 and tuple(tuned.model.language_codes[-1]) == ("fry_Latn", vocab)
    assert json.loads((tmp_path / "run" / "vocab.json").read_text())["fry_Latn"] == vocab
    assert languages.Placement.of(tuned).id("fy") == vocab
    choice = CheckpointChoice(average_last=1)
    report = m2m100_export.export_workdir(str(tmp_path / "run"), tmp_path / "hf", choice=choice)
    assert "fry_Latn" in report["languages"]
    assert "fry_Latn" in json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["extra_special_tokens"]
    ct2_export.export_workdir(str(tmp_path / "run"), tmp_path / "ct2", choice=choice)
    assert json.loads((tmp_path / "ct2" / "shared_vocabulary.json").read_text())[vocab] == "fry_Latn"


@pytest.mark.slow
def test_a_converted_m2m100_model_spells_the_new_code_as_its_own(m2m_dir, tmp_path):
    """M2M-100's codes are __xx__: Basque, which it lacks, named by its ISO 639-3 name, becomes __eu__ after the
    madeup words' ids; M2M100Tokenizer names one of its fixed code lists, so the M2M-100 export refuses in one line."""
    import json

    from transformer_jax.evaluation.restore import CheckpointChoice
    from transformer_jax.interop import m2m100_export
    from transformer_jax.training import loop

    config, vocab = _converted_run_config(m2m_dir, tmp_path, "eu", "eus", steps=2)
    loop.train_and_evaluate(config, tmp_path / "run")
    tuned = checkpoints.load_config(tmp_path / "run")
    assert tuple(tuned.model.language_codes[-1]) == ("__eu__", vocab)
    assert json.loads((tmp_path / "run" / "vocab.json").read_text())["__eu__"] == vocab
    with pytest.raises(ConfigError, match="not one of M2M-100's code lists"):
        m2m100_export.export_workdir(str(tmp_path / "run"), tmp_path / "hf", choice=CheckpointChoice(average_last=1))
