"""A small self-made corpus and config for training tests (no shared data needed)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
import time

import jax.numpy as jnp
import ml_collections
import numpy as np

from configs import common
from tests.helpers import REPO

WORDS_EN = "the a man woman dog cat runs sits red blue big small house street park ball water green old young".split()
WORDS_DE = (
    "der die ein mann frau hund katze läuft sitzt rot blau groß klein haus straße park ball wasser grün alt".split()
)


def write_corpus(directory: pathlib.Path, n_train: int = 400, n_valid: int = 24) -> pathlib.Path:
    """A word-for-word 'translation' corpus: learnable, tiny, and with real UTF-8."""
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_valid)):
        en, de = [], []
        for _ in range(n):
            idx = rng.integers(0, len(WORDS_EN), rng.integers(2, 9))
            en.append(" ".join(WORDS_EN[i] for i in idx))
            de.append(" ".join(WORDS_DE[i] for i in idx))
        (directory / f"{split}.en").write_text("\n".join(en) + "\n", encoding="utf-8")
        (directory / f"{split}.de").write_text("\n".join(de) + "\n", encoding="utf-8")
    return directory


def tiny_train_config(data_dir: pathlib.Path, **train) -> ml_collections.ConfigDict:
    config = common.base_config("tiny")
    config.model.vocab_size = 320  # byte fallback reserves 256 ids, plus the corpus' characters
    config.model.max_len = 64
    # One layer each: nothing these end-to-end tests check depends on depth, and XLA:CPU compiles the train step
    # of 1+1 layers in half the time of 2+2 (every train.py launch compiles it anew).
    config.model.num_encoder_layers = config.model.num_decoder_layers = 1
    config.data.source = "text"
    config.data.text_dir = str(data_dir)
    config.data.batching = "pack"
    config.data.batch_size = 8
    config.data.max_len = 32
    config.data.eval_max_len = 32
    config.data.tokenizer_sample_sentences = 800
    config.opt.warmup_steps = 10
    config.opt.learning_rate = 0.5
    config.train.num_steps = 6
    config.train.log_every = 1
    config.train.eval_every = 3
    config.train.peak_flops = 1e11
    config.ckpt.every_steps = 3
    config.ckpt.async_save = False
    config.eval.batch_size = 8
    config.train.update(train)
    return config


def synthetic_batch(seed: int, rows: int = 8, length: int = 10, vocab: int = 50) -> dict[str, jnp.ndarray]:
    """An unpacked batch of the data contract with random tokens and ragged real lengths."""
    rng = np.random.default_rng(seed)
    src_len = rng.integers(3, length + 1, rows)
    tgt_len = rng.integers(3, length + 1, rows)
    pos = np.tile(np.arange(length), (rows, 1))
    src_seg = (pos < src_len[:, None]).astype(np.int32)
    tgt_seg = (pos < tgt_len[:, None]).astype(np.int32)
    tgt = rng.integers(4, vocab, (rows, length)) * tgt_seg
    batch = {
        "src_tokens": rng.integers(4, vocab, (rows, length)) * src_seg,
        "src_segment_ids": src_seg,
        "src_positions": pos * src_seg,
        "tgt_in": np.concatenate([np.full((rows, 1), 2), tgt[:, :-1]], 1) * tgt_seg,
        "tgt_out": tgt,
        "tgt_segment_ids": tgt_seg,
        "tgt_positions": pos * tgt_seg,
    }
    return {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}


def wait_for_checkpoint(procs: list[subprocess.Popen], workdir: pathlib.Path, step: int, timeout: float = 240) -> None:
    """Bounded polling until train.py processes have written the checkpoint of `step` (Orbax renames a finished
    checkpoint into place, so the directory appears whole). A process that exits first fails the test with the
    output of every process, after killing the others (they could wait forever for it)."""
    deadline = time.time() + timeout
    while not (workdir / "checkpoints" / str(step)).is_dir():
        if any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            raise AssertionError(
                f"a process exited before checkpoint {step}:\n" + "\n".join(p.communicate()[0] for p in procs)
            )
        assert time.time() < deadline, f"no checkpoint {step} appeared in {timeout} s"
        # No event marks the rename; between checks, wait on the first process's exit (which ends the wait at once).
        with contextlib.suppress(subprocess.TimeoutExpired):
            procs[0].wait(timeout=0.05)


def train_py_on_devices(devices: int, workdir: pathlib.Path, corpus: pathlib.Path, **overrides: object) -> str:
    """train.py with tests/tiny_train_config.py on `devices` CPU devices (forced by XLA_FLAGS) in a subprocess;
    overrides are --config.KEY=VALUE. Fails with its output unless it exits 0; returns its stderr (the log)."""
    values = {"data.text_dir": corpus, **overrides}
    command = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "tests" / "tiny_train_config.py")]
    command += ["--workdir", str(workdir), *(f"--config.{k}={v}" for k, v in values.items())]
    xla_flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"training on {devices} devices" in result.stderr
    return result.stderr


def one_layer_config(**model) -> ml_collections.ConfigDict:
    """The tiny config with one encoder and one decoder layer: what these tests check does not depend on depth,
    and XLA:CPU compiles a train step of 1+1 layers in half the time of 2+2."""
    config = common.base_config("tiny")
    config.model.vocab_size = 50
    config.model.num_encoder_layers = config.model.num_decoder_layers = 1
    config.model.update(model)
    config.opt.warmup_steps = 1
    config.opt.learning_rate = 1e-2
    config.opt.schedule = "constant"
    return config


def scripted(scores: list[float], calls: list[int] | None = None):
    """A validation function (the trainer receives it as a function) whose BLEU follows `scores`, one a call."""
    sequence = iter(scores)

    def build(config, tokenizer):
        def evaluate(model) -> dict[str, float]:
            if calls is not None:
                calls.append(1)
            return {"bleu": float(next(sequence)), "chrf": 0.0}

        return evaluate

    return build


def untrained_workdir(data: pathlib.Path, workdir: pathlib.Path, steps: tuple[int, ...] = (10,)) -> pathlib.Path:
    """A workdir of tiny_train_config(data): a tokenizer trained on data's train split and, at each of `steps`, a
    checkpoint of the same freshly initialised (untrained) state."""
    from transformer_jax.data.tokenizer import train_tokenizer
    from transformer_jax.model.layers import SpecialIds
    from transformer_jax.training import checkpoints
    from transformer_jax.training import step as state

    config = tiny_train_config(data)
    config.lock()
    lines = data.joinpath("train.en").read_text().splitlines() + data.joinpath("train.de").read_text().splitlines()
    train_tokenizer(
        lines, workdir / "spm.model", vocab_size=config.model.vocab_size, model_type="unigram", ids=SpecialIds.DEFAULT
    )
    _, train_state = state.create_train_state(config)
    saver = checkpoints.Checkpointer(workdir, config.ckpt)
    for step in steps:
        saver.save(step, train_state, {"position": step}, config)
    saver.close()
    return workdir
