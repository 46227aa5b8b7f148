"""python -m transformer_jax.export --format m2m100: a folder M2M100ForConditionalGeneration and AutoTokenizer load
(transformers runs in a process of its own: tests/helpers/m2m100_reference.py). Converted workdirs go back to the
folders they came from; our own multilingual models export with their rows permuted into fairseq's order, their
tokenizer as a tokenizer.json giving our ids, and translate in transformers as evaluate.py does."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.traverse_util import flatten_dict

from tests.helpers.m2m100_reference import ROOT, run
from tests.helpers.marian_reference import SENTENCES
from transformer_jax.config import schema
from transformer_jax.data.tokenizer import train_tokenizer
from transformer_jax.evaluation.restore import CheckpointChoice, restore_model
from transformer_jax.interop import m2m100_export, m2m100_folder, marian_folder
from transformer_jax.model.layers import SpecialIds
from transformer_jax.training import checkpoints
from transformer_jax.training.step import new_train_state, split_train_state

PIECES = 400
LANGS = ("cs", "de", "en", "fr")  # their ids follow the pieces in this order: 400 .. 403
EXPORTABLE = dict(norm_position="pre", sinusoid_layout="fairseq", position_offset=2, norm_epsilon=1e-5)
LAST = CheckpointChoice(average_last=1)


def make_workdir(path: Path, lang_token: str = "source_and_target", langs=LANGS, seed: int = 0, **model) -> Path:
    """A workdir of our own multilingual model (a BPE spm.model trained here, the languages' ids after its pieces,
    a step-0 checkpoint) whose every parameter is random, LayerNorms and biases included."""
    data = path / "data"
    data.mkdir(parents=True)
    for lang in langs:
        (data / f"train.{lang}").write_text("".join(s + "\n" for s in SENTENCES), encoding="utf-8")
    train_tokenizer(SENTENCES, path / "spm.model", vocab_size=PIECES, model_type="bpe", ids=SpecialIds.DEFAULT)
    config = schema.base_config("tiny")
    config.model.update(**{"vocab_size": PIECES + len(langs), "lang_token": lang_token, **EXPORTABLE, **model})
    config.data.update(source="text", text_dir=str(data), tokenizer_type="bpe", src_lang="", tgt_lang="")
    config.data.directions = tuple(f"{a}-{b}" for a in langs for b in langs if a != b)
    config.ckpt.async_save = False
    config.eval.average_last = 1
    _, state = split_train_state(new_train_state(config))
    pure = nnx.to_pure_dict(state)
    rng = np.random.default_rng(seed)

    def randomize(x):
        if x.dtype != jnp.float32:
            return x
        return jnp.asarray(rng.normal(1.0 if x.ndim == 1 else 0.0, 0.3, x.shape), jnp.float32)

    pure["model"] = jax.tree.map(randomize, pure["model"])
    nnx.replace_by_pure_dict(state, pure)
    saver = checkpoints.Checkpointer(path, config.ckpt)
    saver.save(0, state, None, config)
    saver.close()
    return path


def export(workdir: Path, output: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "transformer_jax.export", "--format", "m2m100", "--workdir", str(workdir)]
        + ["--output", str(output), "--average_last", "1", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.fixture(scope="module")
def nllb_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "nllb-tiny"
    run("make", str(path), json.dumps({"family": "nllb"}))
    return path


def params_of(workdir: Path) -> dict:
    _, model, _ = restore_model(str(workdir), LAST)
    return {k: np.asarray(v) for k, v in flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items()}


@pytest.mark.parametrize("family", ["nllb", pytest.param("m2m100", marks=pytest.mark.slow)])
def test_import_export_import_is_bit_identical(family, nllb_dir, tmp_path):
    """A converted folder exported and converted again gives the same workdir: parameters, config (the code table
    in it) and tokenizer files; an NLLB folder's tokenizer.json comes back as transformers wrote it."""
    if family == "nllb":
        source = nllb_dir
    else:
        source = tmp_path / "m2m100-tiny"
        run("make", str(source), json.dumps({"family": "m2m100", "seed": 1}))
    marian_folder.write_workdir(m2m100_folder.read_folder(source), tmp_path / "w1")
    report = m2m100_export.export_workdir(str(tmp_path / "w1"), tmp_path / "out", choice=LAST)
    assert report["format"] == "m2m100" and "epsilon_logit_difference" not in report
    marian_folder.write_workdir(m2m100_folder.read_folder(tmp_path / "out"), tmp_path / "w2")
    for name in ("config.json", "vocab.json", "sentencepiece.bpe.model"):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name
    first, second = params_of(tmp_path / "w1"), params_of(tmp_path / "w2")
    assert first.keys() == second.keys()
    assert all(np.array_equal(first[k], second[k]) for k in first)
    if family == "nllb":
        theirs = json.loads((source / "tokenizer.json").read_text())
        ours = json.loads((tmp_path / "out" / "tokenizer.json").read_text())
        assert ours == theirs
