"""Fine-tuning (train.init_from, issue 46): the run starts from the source's parameters with a fresh optimizer,
takes the architecture from the source, never reads it again once it has a checkpoint of its own, and refuses each
bad source or workdir in one line, leaving them as they were."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from tests.helpers import REPO
from tests.helpers.training import scripted, tiny_train_config
from transformer_jax import cli
from transformer_jax.config import schema
from transformer_jax.errors import CheckpointError, ConfigError
from transformer_jax.evaluation import restore
from transformer_jax.model import parameter_count
from transformer_jax.training import checkpoints, init_from, loop
from transformer_jax.training.step import abstract_train_state

SOURCE_D_FF = 48  # the fine-tuning config says 64 (the tiny size's): the source's value must win


def source_config(corpus: pathlib.Path):
    config = tiny_train_config(corpus, eval_every=0)
    config.model.d_ff = SOURCE_D_FF
    return config


def finetune_config(corpus: pathlib.Path, source: pathlib.Path, **train):
    config = tiny_train_config(corpus, eval_every=0, init_from=str(source), num_steps=3, **train)
    config.model.dropout_rate = 0.05  # regularisation is the fine-tuning run's own (the source had 0.1)
    config.opt.schedule, config.opt.warmup_steps, config.opt.learning_rate = "constant", 2, 1e-2
    config.opt.freeze = ("encoder_layers",)
    return config


@pytest.fixture(scope="module")
def source(corpus, tmp_path_factory) -> pathlib.Path:
    workdir = tmp_path_factory.mktemp("source") / "run"
    loop.train_and_evaluate(source_config(corpus), workdir)
    assert checkpoints.list_steps(workdir) == [3, 6]
    return workdir


def _copy(source: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(source, tmp_path / "source"))


def _snapshot(directory: pathlib.Path) -> dict[str, bytes]:
    return {str(f.relative_to(directory)): f.read_bytes() for f in sorted(directory.rglob("*")) if f.is_file()}


def _params(workdir: pathlib.Path, step: int, config) -> dict:
    return jax.device_get(checkpoints.load_model_params(workdir, step, abstract_train_state(config)[1]))


def _flip_bits(step_dir: pathlib.Path) -> None:
    """Flips a bit in the middle of every array data file of a checkpoint's state."""
    for f in (step_dir / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0x10
            f.write_bytes(bytes(data))


def test_the_run_starts_from_the_sources_parameters_with_a_fresh_optimizer(source, corpus, tmp_path):
    workdir = tmp_path / "ft"
    start = init_from.prepare(finetune_config(corpus, source), workdir)
    assert start.source_step == 6  # init_step=latest
    assert start.config.model.d_ff == SOURCE_D_FF and start.config.model.dropout_rate == 0.05
    assert (workdir / "spm.model").read_bytes() == (source / "spm.model").read_bytes()
    assert start.config.data.tokenizer_model == ""  # the workdir's spm.model, as the source's was its own
    run = loop.setup(start.config, workdir, None, start.params)
    try:
        state = jax.device_get(nnx.to_pure_dict(run.state))
    finally:
        run.close()
    assert run.step == 0
    expected = _params(source, 6, start.config)
    got = jax.device_get(nnx.to_pure_dict(nnx.filter_state(run.state["model"], nnx.Param)))
    jax.tree.map(np.testing.assert_array_equal, got, expected)
    assert int(state["optimizer"]["step"]) == 0
    moments = jax.tree.leaves(state["optimizer"]["opt_state"])
    assert moments and all(not np.any(m) for m in moments)  # Adam's count, mu and nu all start at zero


def test_a_restart_resumes_its_own_checkpoint_without_the_source(source, corpus, tmp_path):
    copy = _copy(source, tmp_path)
    workdir = tmp_path / "ft"
    config = finetune_config(corpus, copy)
    loop.train_and_evaluate(config, workdir)
    assert checkpoints.list_steps(workdir) == [3]
    first = _params(workdir, 3, init_from.prepare(config, workdir).config)
    at_source = _params(copy, 6, init_from.prepare(config, workdir).config)
    # opt.freeze: the encoder is bit-identical to the source's; the rest trained.
    jax.tree.map(np.testing.assert_array_equal, first["encoder_layers"], at_source["encoder_layers"])
    assert not np.array_equal(
        first["decoder_layers"][0]["ffn"]["w1"]["kernel"], at_source["decoder_layers"][0]["ffn"]["w1"]["kernel"]
    )
    shutil.rmtree(copy)  # a restart that read the source again would fail
    config.train.num_steps = 6
    loop.train_and_evaluate(config, workdir)
    assert checkpoints.list_steps(workdir) == [3, 6]
    resumed = init_from.prepare(config, workdir).config
    assert resumed.model.d_ff == SOURCE_D_FF  # the architecture now comes from the run's own checkpoint
    last = _params(workdir, 6, resumed)
    jax.tree.map(np.testing.assert_array_equal, last["encoder_layers"], first["encoder_layers"])
    # evaluate.py and the export take a --config that names the source otherwise (or not at all): how training
    # began does not shape the model.
    given = finetune_config(corpus, pathlib.Path("elsewhere"), init_step="3")
    given.opt.freeze = ()
    given.model.d_ff = SOURCE_D_FF
    _, _, steps = restore.restore_model(str(workdir), restore.CheckpointChoice(average_last=1), config=given)
    assert steps == [6]


def test_a_source_given_a_tokenizer_file_passes_on_a_copy_of_it(source, corpus, tmp_path):
    shared = tmp_path / "shared.model"
    shutil.copyfile(source / "spm.model", shared)
    config = source_config(corpus)
    config.data.tokenizer_model, config.train.num_steps = str(shared), 3
    loop.train_and_evaluate(config, tmp_path / "given")
    start = init_from.prepare(finetune_config(corpus, tmp_path / "given"), tmp_path / "ft")
    assert start.config.data.tokenizer_model == str((tmp_path / "ft" / "spm.model").resolve())
    assert (tmp_path / "ft" / "spm.model").read_bytes() == shared.read_bytes()


def test_a_damaged_newest_source_checkpoint_falls_back_to_the_one_before(source, corpus, tmp_path):
    copy = _copy(source, tmp_path)
    _flip_bits(copy / "checkpoints" / "6")
    before = _snapshot(copy)
    start = init_from.prepare(finetune_config(corpus, copy), tmp_path / "ft")
    assert start.source_step == 3
    assert _snapshot(copy) == before  # the source is only read: nothing moved aside


def test_a_named_step_is_used(source, corpus, tmp_path):
    start = init_from.prepare(finetune_config(corpus, source, init_step="3"), tmp_path / "ft")
    assert start.source_step == 3
    jax.tree.map(np.testing.assert_array_equal, start.params, _params(source, 3, start.config))


def _refused(error, match, config, workdir, overrides=()):
    with pytest.raises(error, match=match) as caught:
        init_from.prepare(config, workdir, overrides)
    assert "\n" not in str(caught.value)


def test_a_missing_or_empty_source_is_refused(corpus, tmp_path):
    missing = tmp_path / "nowhere"
    _refused(ConfigError, rf"train.init_from: {missing} does not exist", finetune_config(corpus, missing), tmp_path)
    (tmp_path / "empty").mkdir()
    _refused(ConfigError, "holds no checkpoint", finetune_config(corpus, tmp_path / "empty"), tmp_path / "ft")
    assert not (tmp_path / "ft").exists()


def test_a_source_with_every_checkpoint_damaged_is_refused_and_left_as_it_was(source, corpus, tmp_path):
    copy = _copy(source, tmp_path)
    for step in (3, 6):
        _flip_bits(copy / "checkpoints" / str(step))
    before = _snapshot(copy)
    _refused(
        CheckpointError,
        r"no checkpoint could be read \(step 6: .*; step 3: ",
        finetune_config(corpus, copy),
        tmp_path / "ft",
    )
    assert _snapshot(copy) == before and not (tmp_path / "ft").exists()


def test_overrides_that_contradict_the_sources_architecture_are_refused_in_one_line(source, corpus, tmp_path):
    config = finetune_config(corpus, source)
    config.model.d_ff, config.model.vocab_size = 64, 400
    _refused(
        ConfigError,
        r"model.vocab_size=400 \(source: 320\), model.d_ff=64 \(source: 48\)",
        config,
        tmp_path / "ft",
        overrides=("model.d_ff", "model.vocab_size", "model.dropout_rate"),
    )
    assert not (tmp_path / "ft").exists()
    # The same values from the config file, not the command line, are replaced by the source's.
    assert init_from.prepare(config, tmp_path / "ft").config.model.vocab_size == 320


def test_a_workdir_holding_another_runs_checkpoints_is_refused(source, corpus, tmp_path):
    other = _copy(source, tmp_path)  # a run trained from random parameters
    before = _snapshot(other)
    _refused(
        ConfigError,
        rf"--workdir {other} holds checkpoints of another run \(started from random parameters\)",
        finetune_config(corpus, source),
        other,
    )
    assert _snapshot(other) == before


def test_a_workdir_holding_another_tokenizer_is_refused(source, corpus, tmp_path):
    workdir = tmp_path / "ft"
    workdir.mkdir()
    (workdir / "spm.model").write_bytes(b"another run's tokenizer")
    _refused(
        ConfigError,
        rf"--workdir {workdir} holds a tokenizer \({workdir / 'spm.model'}\) other than the source's",
        finetune_config(corpus, source),
        workdir,
    )
    assert (workdir / "spm.model").read_bytes() == b"another run's tokenizer"


@pytest.mark.slow  # trimmed from the default run: the file keeps a fast representative
def test_init_step_best_starts_from_the_sources_best_checkpoint(corpus, tmp_path):
    """A source that kept its best checkpoints (ckpt.keep_best) by a scripted validation BLEU of 10, 30, 20 at steps
    2, 4, 6: step 4 is its best, and the fine-tuning run starts from it, not from the latest (6)."""
    config = tiny_train_config(corpus, num_steps=6, eval_every=2, select_metric="valid_bleu")
    config.ckpt.update({"every_steps": 6, "keep": 1, "keep_best": 2})
    selecting = tmp_path / "selecting"
    loop.train_and_evaluate(config, selecting, bleu=scripted([10, 30, 20]))
    assert checkpoints.best_steps(selecting) == [4, 6]
    start = init_from.prepare(finetune_config(corpus, selecting, init_step="best"), tmp_path / "ft")
    assert start.source_step == 4
    expected = _params(selecting, 4, start.config)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(start.params), expected)


@pytest.mark.parametrize(
    "step,match", [("best", "has no best-checkpoint record"), ("5", "has no checkpoint at step 5")]
)
def test_an_init_step_the_source_lacks_is_refused(source, corpus, tmp_path, step, match):
    _refused(
        ConfigError,
        f"config key train.init_step: {source} {match}",
        finetune_config(corpus, source, init_step=step),
        tmp_path / "ft",
    )


def test_init_step_is_checked_with_the_config(corpus):
    config = tiny_train_config(corpus, init_step="newest")
    with pytest.raises(ConfigError, match="train.init_step: must be latest, best or a step number, got 'newest'"):
        cli.validate(config)
    config = tiny_train_config(corpus, init_step="3")
    with pytest.raises(ConfigError, match="train.init_step: '3' names a checkpoint of train.init_from, which is"):
        cli.validate(config)


def test_architecture_and_must_match_on_resume_are_two_rules():
    arch = set(schema.ARCHITECTURE)
    shape = {
        "model.vocab_size",
        "model.d_model",
        "model.num_heads",
        "model.d_ff",
        "model.num_encoder_layers",
        "model.num_decoder_layers",
        "model.activation",
        "model.norm",
        "model.positional",
        "model.max_len",
        "data.tokenizer_type",
    }
    own = {
        "model.dropout_rate",
        "train.label_smoothing",
        "data.batch_size",
        "opt.optimizer",
        "opt.learning_rate",
        "opt.schedule",
        "data.text_dir",
        "model.dtype",
        "attention.impl",
    }
    assert shape <= arch and not own & arch
    must = set(schema.MUST_MATCH)
    assert {"data.batch_size", "opt.optimizer", "opt.freeze"} <= must - arch  # the run's own, kept on resume
    assert "model.norm_epsilon" in arch - must  # the source's, yet a restart may change it


def test_a_checkpoint_written_before_a_key_existed_counts_as_its_default():
    saved = tiny_train_config(pathlib.Path("x")).to_dict()
    del saved["opt"]["freeze"], saved["train"]["init_from"]
    assert checkpoints.config_differences(saved, tiny_train_config(pathlib.Path("x")).to_dict()) == []


def _train_py(corpus, workdir, *flags):
    command = [
        sys.executable,
        str(REPO / "train.py"),
        "--config",
        str(REPO / "tests" / "tiny_train_config.py"),
        "--workdir",
        str(workdir),
        f"--config.data.text_dir={corpus}",
        *flags,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


# In-process: test_a_missing_or_empty_source_is_refused; train.py's one line for a source it refuses:
# test_train_py_refuses_an_override_contradicting_the_source_in_one_line.
@pytest.mark.slow
def test_train_py_refuses_a_missing_source_in_one_line(corpus, tmp_path):
    result = _train_py(corpus, tmp_path / "ft", f"--config.train.init_from={tmp_path / 'nowhere'}")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        f"train.py: error: config key train.init_from: {tmp_path / 'nowhere'} does not exist; give the workdir of a "
        "trained run"
    )


def test_train_py_refuses_an_override_contradicting_the_source_in_one_line(source, corpus, tmp_path):
    """Only the command line knows which keys it was given: those that contradict the source are refused."""
    result = _train_py(corpus, tmp_path / "ft", f"--config.train.init_from={source}", "--config.model.d_ff=64")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: error: train.init_from ") and "model.d_ff=64 (source: 48)" in last, last
    assert list((tmp_path / "ft").iterdir()) == []


def test_dry_run_and_plan_size_the_source_model_without_reading_its_parameters(source, corpus, tmp_path):
    source = _copy(source, tmp_path)
    config = finetune_config(corpus, source)
    assert config.model.d_ff != SOURCE_D_FF
    assert init_from.planned_config(config).model.d_ff == SOURCE_D_FF
    for step_dir in checkpoints.checkpoint_dir(source).iterdir():  # parameters unreadable: only the config is read
        _flip_bits(step_dir)
    result = _train_py(corpus, tmp_path / "ft", f"--config.train.init_from={source}", "--dry_run")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["parameters"] == parameter_count(source_config(corpus)), result.stdout
    assert not (tmp_path / "ft").exists()
    with pytest.raises(ConfigError, match=r"model.d_ff=64 \(source: 48\)"):
        init_from.planned_config(config, ["model.d_ff"])


def test_finetune_config_takes_any_directions_lora_and_a_short_run_without_validation():
    """configs/finetune.py (issue 64): directions of a multi-way folder besides Multi30k's two, lora=RANK, and a
    short run without validation: keep-best and early stopping off, the warmup at most a tenth of the run."""
    from configs import finetune

    bilingual = finetune.get_config("init_from=runs/source,direction=de-en")
    assert (bilingual.data.source, bilingual.data.src_lang, bilingual.data.tgt_lang) == ("multi30k", "de", "en")
    assert (bilingual.opt.warmup_steps, bilingual.ckpt.keep_best, bilingual.train.early_stop_patience) == (200, 3, 4)
    arg = "init_from=runs/source,directions=en-cs+cs-en,lora=4,num_steps=300,eval_every=0,add=cs,init=de"
    config = finetune.get_config(arg)
    cli.validate(config, training=True)  # today's refusal of keep-best without validation does not fire
    assert (config.data.source, config.data.directions, config.opt.lora_rank) == ("text", ("en-cs", "cs-en"), 4)
    assert (config.train.eval_every, config.ckpt.keep_best, config.train.early_stop_patience) == (0, 0, 0)
    assert config.opt.warmup_steps == 30
    assert (config.data.add_languages, config.train.new_language_init) == (("cs",), "de")
    with pytest.raises(ConfigError, match="ckpt.keep_best=3 needs a validation"):  # the override alone stays refused
        cli.check_between({**dict(cli.leaves(bilingual)), "train.eval_every": 0})
