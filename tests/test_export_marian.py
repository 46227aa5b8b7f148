"""python -m transformer_jax.export --format marian: a folder transformers loads, with our model's logits and our
tokenizer's ids (transformers runs in a process of its own: tests/helpers/marian_reference.py)."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import DATA
from tests.helpers.marian_reference import ROOT, SENTENCES, run
from transformer_jax.config import schema
from transformer_jax.data.tokenizer import train_tokenizer
from transformer_jax.errors import ConfigError, EvalError
from transformer_jax.evaluation.restore import CheckpointChoice, restore_model
from transformer_jax.interop import marian, marian_folder
from transformer_jax.model.layers import SpecialIds
from transformer_jax.training import checkpoints
from transformer_jax.training.step import new_train_state, split_train_state

VOCAB = 300


def make_workdir(path: Path, seed: int = 0, **model) -> Path:
    """A workdir of ours (joint spm.model, a step-0 checkpoint) whose every parameter is random (LayerNorm and
    biases included, so that a mapping mistake in any of them shows in the logits)."""
    path.mkdir(parents=True)
    train_tokenizer(SENTENCES, path / "spm.model", vocab_size=VOCAB, model_type="unigram", ids=SpecialIds.DEFAULT)
    config = schema.base_config("tiny")
    config.model.update(**{"vocab_size": VOCAB, "norm_epsilon": 1e-5, **model})
    config.ckpt.async_save = False
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
        [sys.executable, "-m", "transformer_jax.export", "--format", "marian", "--workdir", str(workdir)]
        + ["--output", str(output), "--average_last", "1", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )


def logit_difference(workdir: Path, exported: Path, tmp_path: Path) -> float:
    config, model, _ = restore_model(str(workdir), CheckpointChoice(average_last=1))
    m = config.model
    rng = np.random.default_rng(1)
    src = rng.integers(4, m.vocab_size, size=(3, 9))
    src[:, -1] = m.eos_id
    src[1, 4], src[1, 5:] = m.eos_id, m.pad_id
    tgt = rng.integers(4, m.vocab_size, size=(3, 7))
    tgt[:, 0] = m.bos_id
    np.savez(tmp_path / "in.npz", src=src, tgt=tgt)
    run("logits", str(exported), str(tmp_path / "in.npz"), str(tmp_path / "out.npz"))
    theirs = np.load(tmp_path / "out.npz")["logits"]
    src_j, tgt_j = jnp.asarray(src, jnp.int32), jnp.asarray(tgt, jnp.int32)
    ours = np.asarray(model.decode(model.encode(src_j), tgt_j, src_tokens=src_j))
    return float(np.abs(ours - theirs).max())


@pytest.mark.parametrize("layout", ["interleaved", pytest.param("concatenated", marks=pytest.mark.slow)])
def test_our_default_model_exports_exactly(tmp_path, layout):
    """The paper's model (relu, interleaved positions, tied shared embeddings) through the model-axis permutation,
    and Marian's own layout without it, with a non-zero final_logits_bias and swish in the second case."""
    extra = {} if layout == "interleaved" else {"activation": "swish", "final_logits_bias": True}
    workdir = make_workdir(tmp_path / "w", sinusoid_layout=layout, **extra)
    done = export(workdir, tmp_path / "out")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "warning" not in done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["format"] == "marian"
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "source.spm",
        "target.spm",
        "tokenizer_config.json",
        "vocab.json",
    ]
    assert logit_difference(workdir, tmp_path / "out", tmp_path) < 1e-4


@pytest.mark.slow  # a fast representative: the logits test; greedy and ids on real text: the trained-model tests
def test_the_exported_tokenizer_gives_our_ids(tmp_path):
    from transformer_jax.data.tokenizer import Tokenizer

    workdir = make_workdir(tmp_path / "w")
    assert export(workdir, tmp_path / "out").returncode == 0
    sentences = SENTENCES[:6] + ["Unseen words: Zürich, naïve, 42!"]
    (tmp_path / "s.json").write_text(json.dumps(sentences))
    run("tokenize", str(tmp_path / "out"), str(tmp_path / "s.json"), str(tmp_path / "ids.json"))
    theirs = json.loads((tmp_path / "ids.json").read_text())
    ours = Tokenizer(workdir / "spm.model", SpecialIds.DEFAULT)
    assert theirs == [ours.encode_source(s) + [1] for s in sentences]  # MarianTokenizer appends </s>


@pytest.mark.slow  # a fast representative: see the module's other tests
def test_another_norm_epsilon_exports_with_one_warning_line_stating_the_difference(tmp_path):
    workdir = make_workdir(tmp_path / "w", norm_epsilon=1e-2)
    done = export(workdir, tmp_path / "out")
    assert done.returncode == 0, done.stderr[-2000:]
    warnings = [line for line in done.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "model.norm_epsilon=0.01" in warnings[0], done.stderr
    stated = float(warnings[0].split("differ by up to ")[1].split()[0])
    measured = logit_difference(workdir, tmp_path / "out", tmp_path)
    assert stated > 1e-4 and measured > 1e-4  # a difference there is, and the warning is not silent about it


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"norm_position": "pre"}, "model.norm_position='pre'"),
        ({"norm": "rmsnorm"}, "model.norm='rmsnorm'"),
        ({"activation": "swiglu"}, "model.activation='swiglu'"),
        ({"num_kv_heads": 1}, "model.num_kv_heads=1"),
        ({"positional": "learned"}, "model.positional='learned'"),
        ({"tie_output": False}, "model.tie_output=False"),
    ],
)
def test_what_marian_cannot_represent_is_refused_naming_the_key(overrides, key):
    config = schema.base_config("tiny")
    config.model.update(**overrides)
    with pytest.raises(ConfigError, match="cannot export to Marian: " + key.replace("(", r"\(")):
        marian.check_exportable(config)


def test_a_refused_export_is_one_line_and_writes_nothing(tmp_path):
    workdir = make_workdir(tmp_path / "w", norm_position="pre", norm="rmsnorm")
    done = export(workdir, tmp_path / "out")
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert "model.norm_position='pre'" in done.stderr and "model.norm='rmsnorm'" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w"]


def test_an_existing_output_is_replaced_only_with_force_and_only_if_it_is_an_export(tmp_path):
    workdir = make_workdir(tmp_path / "w")
    # The library the command line calls: the command's own run is test_our_default_model_exports_exactly's.
    marian_folder.export_workdir(str(workdir), tmp_path / "out", choice=CheckpointChoice(average_last=1))
    with pytest.raises(EvalError, match="exists; choose another directory or pass --force"):
        marian_folder.export_workdir(str(workdir), tmp_path / "out", choice=CheckpointChoice(average_last=1))
    marian_folder.export_workdir(str(workdir), tmp_path / "out", choice=CheckpointChoice(average_last=1), force=True)
    assert (tmp_path / "out" / "model.safetensors").is_file()
    with pytest.raises(EvalError, match="is not a Marian export"):
        marian_folder.export_workdir(str(workdir), workdir, choice=CheckpointChoice(average_last=1), force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "w"]


MULTI30K = DATA / "multi30k"


@pytest.mark.slow
@pytest.mark.skipif(not (MULTI30K / "train.en").is_file(), reason="needs the shared Multi30k copy")
def test_an_exported_trained_model_translates_in_transformers_as_evaluate_does(tmp_path):
    """A tiny model of ours trained 400 steps on Multi30k (a random one repeats one token and tests little),
    exported: MarianMTModel.generate's greedy translations of 100 test2016 sentences, decoded by MarianTokenizer,
    are evaluate.py's greedy translations, line for line."""
    workdir, steps = tmp_path / "w", 400
    trained = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/multi30k.py:size=tiny", "--workdir", str(workdir)]
        + [f"--config.train.num_steps={steps}", "--config.opt.warmup_steps=100", "--config.train.eval_every=0"]
        + [f"--config.ckpt.every_steps={steps}", "--config.data.tokenizer_sample_sentences=8000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=1200,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert export(workdir, tmp_path / "out").returncode == 0
    source = tmp_path / "src.en"
    source.write_text("".join(MULTI30K.joinpath("test.en").read_text(encoding="utf-8").splitlines(True)[:100]))
    ours = tmp_path / "ours.de"
    evaluated = subprocess.run(
        [sys.executable, "evaluate.py", "--workdir", str(workdir), "--average_last", "1", "--beam_size", "1"]
        + ["--max_extra_len", "20", "--source_file", str(source), "--output_file", str(ours)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    run("translate", str(tmp_path / "out"), str(source), str(tmp_path / "theirs.de"), "20", timeout=600)
    mine = ours.read_text(encoding="utf-8").splitlines()
    theirs = (tmp_path / "theirs.de").read_text(encoding="utf-8").splitlines()
    assert len(mine) == len(theirs) == 100 and len(set(mine)) > 20  # outputs that differ from line to line
    assert [i for i in range(100) if mine[i] != theirs[i]] == []
