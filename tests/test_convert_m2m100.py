"""python -m transformer_jax.convert --from_hf on M2M-100 and dense NLLB-200 folders: random-weight
M2M100ForConditionalGeneration models with their tokenizers (built offline by transformers in a process of its own:
tests/helpers/m2m100_reference.py) become workdirs whose model gives transformers' logits and whose greedy
translations, forced into a target language, are generate()'s.

The NLLB folder has a tokenizer.json (ids read from its vocabulary and added tokens) and two embedding rows more
than ids; the M2M-100 folder a vocab.json with its 100 __xx__ codes and 8 madeup words after it.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.traverse_util import flatten_dict

from tests.helpers import DATA
from tests.helpers.m2m100_reference import ROOT, run
from tests.helpers.model import tiny_spec
from transformer_jax.convert import read_hf_folder
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.evaluation import command as evaluation
from transformer_jax.evaluation.restore import restore_model, workdir_tokenizer
from transformer_jax.interop import m2m100, m2m100_folder, marian, marian_folder
from transformer_jax.model.transformer import Transformer
from transformer_jax.training import checkpoints

SENTENCES = [
    "A man in a blue shirt is standing on a ladder.",
    "Two young children are playing in the sand.",
    "The dog runs across the green field.",
    "",
    "Several people are waiting at the bus stop.",
]


def convert(source: Path, workdir: Path) -> dict:
    return marian_folder.write_workdir(m2m100_folder.read_folder(source), workdir)


def compare_logits(source: Path, workdir: Path, tmp_path: Path) -> float:
    """Max |our logits - transformers' logits| on a batch with a padded source row."""
    config, model, _ = restore_model(str(workdir))
    m = config.model
    rng = np.random.default_rng(0)
    src = rng.integers(4, m.vocab_size, size=(3, 9))
    src[:, -1] = m.eos_id
    src[1, 4], src[1, 5:] = m.eos_id, m.pad_id
    tgt = rng.integers(4, m.vocab_size, size=(3, 6))
    tgt[:, 0] = m.bos_id
    np.savez(tmp_path / "in.npz", src=src, tgt=tgt)
    run("logits", str(source), str(tmp_path / "in.npz"), str(tmp_path / "out.npz"))
    theirs = np.load(tmp_path / "out.npz")["logits"]
    src_j, tgt_j = jnp.asarray(src, jnp.int32), jnp.asarray(tgt, jnp.int32)
    ours = np.asarray(model.decode(model.encode(src_j), tgt_j, src_tokens=src_j))
    assert ours.shape == theirs.shape
    return float(np.abs(ours - theirs).max())


@pytest.mark.slow  # a fast representative: the greedy test below
@pytest.mark.parametrize("family", ["nllb", "m2m100"])
def test_converted_logits_equal_transformers(family, nllb_dir, m2m_dir, tmp_path):
    source = nllb_dir if family == "nllb" else m2m_dir
    report = convert(source, tmp_path / "w")
    config, _, _ = restore_model(str(tmp_path / "w"))
    m = config.model
    assert (m.norm_position, m.sinusoid_layout, m.position_offset, m.final_logits_bias) == ("pre", "fairseq", 2, False)
    assert (m.pad_id, m.eos_id, m.bos_id, m.unk_id, m.lang_token) == (1, 2, 2, 3, "source_and_target")
    assert config.data.tokenizer == m2m100_folder.FAIRSEQ_TOKENIZER
    codes = dict(m.language_codes)
    assert len(codes) == (202 if family == "nllb" else 100)
    assert ("eng_Latn" if family == "nllb" else "__en__") in codes
    hf = json.loads((source / "config.json").read_text())
    assert m.vocab_size == hf["vocab_size"] and report["parameters"] > 0
    assert compare_logits(source, tmp_path / "w", tmp_path) < 1e-5


@pytest.mark.parametrize("family", ["nllb", pytest.param("m2m100", marks=pytest.mark.slow)])
def test_greedy_translations_into_a_language_equal_generate(family, nllb_dir, m2m_dir, tmp_path):
    """evaluate.py --source_lang en --target_lang de on the converted workdir writes generate()'s greedy
    translations with forced_bos_token_id (the code of de), language codes masked after it as ours are, each capped
    at the source's tokens + --max_extra_len: the sources, the forced code, the search and the detokenisation."""
    source = nllb_dir if family == "nllb" else m2m_dir
    convert(source, tmp_path / "w")
    (tmp_path / "in.txt").write_text("".join(s + "\n" for s in SENTENCES))
    codes = ("eng_Latn", "deu_Latn") if family == "nllb" else ("en", "de")
    run("translate", str(source), str(tmp_path / "in.txt"), str(tmp_path / "theirs.txt"), "4", *codes)
    ours = tmp_path / "ours.txt"
    settings = dict(beam_size=1, max_extra_len=4, max_len=0)  # max_len 0: generation_config's would cap first
    flags = dict(workdir=str(tmp_path / "w"), source_file=str(tmp_path / "in.txt"), output_file=str(ours), **settings)
    evaluation.evaluate(dict(source_lang="en", target_lang="de", **flags))
    theirs = (tmp_path / "theirs.txt").read_text().splitlines()
    mine = ours.read_text().splitlines()
    assert len(mine) == len(SENTENCES)
    for line, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        if SENTENCES[line]:  # a blank line is not translated by us; transformers translates '' too
            assert a == b, line


def evaluate(workdir: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "evaluate.py", "--workdir", str(workdir), "--beam_size", "1", "--target_lang", "de", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.slow  # tests/test_fairseq_tokenizer.py checks it in-process; this one, evaluate.py's one line
def test_a_converted_model_requires_a_source_language(nllb_dir, tmp_path):
    """transformers assumes English when no src_lang is given; a converted model refuses to guess."""
    convert(nllb_dir, tmp_path / "w")
    (tmp_path / "in.txt").write_text("A man.\n")
    done = evaluate(tmp_path / "w", "--source_file", str(tmp_path / "in.txt"))
    assert done.returncode == 1 and done.stderr.strip().count("\n") == 0, done.stderr[-2000:]
    assert "--source_lang" in done.stderr


@pytest.mark.slow  # tests/test_fairseq_tokenizer.py checks the ids fast; this one, a converted workdir's
def test_the_tokenizer_encodes_as_transformers_with_the_language_codes(nllb_dir, tmp_path):
    """The workdir's tokenizer with our source layout (the source language's code, the pieces, </s>) gives the
    ids of transformers' tokenizer(text) with src_lang."""
    convert(nllb_dir, tmp_path / "w")
    config, _, _ = restore_model(str(tmp_path / "w"))
    tokenizer = workdir_tokenizer(config, str(tmp_path / "w"))
    (tmp_path / "s.json").write_text(json.dumps(SENTENCES))
    run("tokenize", str(nllb_dir), str(tmp_path / "s.json"), str(tmp_path / "ids.json"), "ces_Latn")
    theirs = json.loads((tmp_path / "ids.json").read_text())
    code = tokenizer.language_id("cs")
    assert code == dict(config.model.language_codes)["ces_Latn"]
    assert theirs == [[code, *tokenizer.encode_source(s), config.model.eos_id] for s in SENTENCES]


def test_the_table_names_every_parameter_of_a_pre_ln_model_once():
    """The BART-family table (marian.py) covers a pre-LN model without final_logits_bias: every parameter, each once,
    the final norms under M2M-100's names."""
    spec = tiny_spec(norm_position="pre", final_logits_bias=False, share_embeddings=True, tie_output=True)
    names = [entry.marian for entry in marian.table(spec)]
    assert len(names) == len(set(names))
    assert {"model.encoder.layer_norm.weight", "model.decoder.layer_norm.bias"} <= set(names)
    assert "final_logits_bias" not in names
    model = nnx.eval_shape(lambda: Transformer(spec, rngs=nnx.Rngs(0)))
    ours = set(flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    assert ours == {entry.ours for entry in marian.table(spec)}


def _copy(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "folder"
    shutil.copytree(source, target)
    return target


def _edit_json(path: Path, **changes) -> None:
    value = json.loads(path.read_text())
    value.update(changes)
    path.write_text(json.dumps(value))


def _cli(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "transformer_jax.convert", *flags], cwd=ROOT, capture_output=True, text=True, check=False
    )


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: _edit_json(d / "tokenizer_config.json", legacy_behaviour=True), "legacy_behaviour=true"),
        (lambda d: _edit_json(d / "config.json", vocab_size=100), "vocab_size is 100"),
        (lambda d: _edit_json(d / "config.json", pad_token_id=0), "<pad> id 1 but .*config.json pad_token_id is 0"),
        (lambda d: _edit_json(d / "config.json", scale_embedding=False), "scale_embedding=False"),
        (lambda d: _edit_json(d / "config.json", activation_function="gelu"), "activation_function='gelu'"),
        (lambda d: _edit_json(d / "config.json", decoder_ffn_dim=48), "decoder_ffn_dim=48 differ"),
    ],
)
def test_a_folder_we_cannot_convert_is_one_line_naming_the_file_or_key(nllb_dir, tmp_path, edit, message):
    source = _copy(nllb_dir, tmp_path)
    edit(source)
    with pytest.raises((ConfigError, DataError), match=message):
        convert(source, tmp_path / "w")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]


def test_the_command_line_picks_the_family(nllb_dir, tmp_path):
    done = _cli("--from_hf", str(nllb_dir), "--workdir", str(tmp_path / "w"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["workdir"] == str(tmp_path / "w")
    source = _copy(nllb_dir, tmp_path)
    _edit_json(source / "config.json", model_type="nllb-moe")
    with pytest.raises(ConfigError, match="model_type='nllb-moe': not supported"):
        read_hf_folder(source)


@pytest.mark.slow  # a fast representative: test_the_command_line_picks_the_family
def test_the_command_line_refuses_other_families_and_flags_in_one_line(nllb_dir, tmp_path):
    source = _copy(nllb_dir, tmp_path)
    _edit_json(source / "config.json", model_type="nllb-moe")
    for flags, message in [
        (("--from_hf", str(source)), "model_type='nllb-moe': not supported"),
        (("--from_hf", str(nllb_dir), "--from_marian", str(nllb_dir)), "from_hf"),
        ((), "from_hf"),
    ]:
        done = _cli(*flags, "--workdir", str(tmp_path / "other"))
        assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]
        assert "Traceback" not in done.stderr
        assert not (tmp_path / "other").exists()


def test_a_saved_position_table_must_be_fairseqs():
    """A folder that saved embed_positions (older conversions do) is checked against fairseq's table."""
    table = m2m100.fairseq_positions(10, 8, padding_idx=1)
    assert np.all(table[1] == 0.0) and table.shape == (10, 8)
    np.testing.assert_allclose(table[2, :4], np.sin(2.0 * np.exp(-np.arange(4) * np.log(10000.0) / 3)), rtol=1e-6)


@pytest.mark.slow  # tests/test_fairseq_tokenizer.py checks fast that a converted model's batches carry its codes
def test_fine_tuning_a_converted_model_on_directions_starts_from_its_parameters(nllb_dir, tmp_path):
    """train.py with train.init_from on a converted NLLB workdir and data.directions of the 4-way Multi30k: the run
    takes the architecture, the code table and the tokenizer files from it, starts from its parameters and trains."""
    if not (DATA / "multi30k" / "train.cs").is_file():
        pytest.skip(f"the 4-way Multi30k is not under {DATA} (set TRANSFORMER_JAX_DATA to ../shared/data)")
    convert(nllb_dir, tmp_path / "w")
    done = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/multilingual.py:size=mini,directions=en-cs,lang_token=none"]
        + ["--config.train.init_from", str(tmp_path / "w"), "--config.train.num_steps", "2"]
        + ["--config.train.eval_every", "0", "--config.train.bleu_every", "0", "--workdir", str(tmp_path / "ft")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "TRANSFORMER_JAX_DATA": str(DATA), "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    source, tuned = checkpoints.load_config(tmp_path / "w"), checkpoints.load_config(tmp_path / "ft")
    assert tuned.model.language_codes == source.model.language_codes and tuned.data.tokenizer == "fairseq"
    assert tuned.model.lang_token == "source_and_target"  # the source's: architecture keys come from it
    assert (tmp_path / "ft" / "vocab.json").read_bytes() == (tmp_path / "w" / "vocab.json").read_bytes()
    assert checkpoints.list_steps(tmp_path / "ft") == [2]
