"""Resuming on another device count or mesh (issue #30, docs/reliability.md), the slow variants: a run checkpointed
on 1 device continues on 4 CPU devices (forced by XLA_FLAGS, in a subprocess) with the losses of the run that never
stopped. The fast representative (4 devices with FSDP) and the refusal of another global batch are in
tests/test_checkpoint_faults.py.

Tolerance: 4 devices sum each step's gradients in another order than 1 device, so losses agree to float32 rounding,
not bit for bit: rtol 1e-5 (measured: 3.2e-7 over steps 5..8 of this tiny run, for data and for fsdp)."""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest

from tests.helpers.training import tiny_train_config, train_py_on_devices, write_corpus
from transformer_jax.training import checkpoints, loop
from transformer_jax.training.metrics import read_metrics

pytestmark = pytest.mark.slow
RTOL = 1e-5
NUM_STEPS, SAVED = 8, 4
OVERRIDES = {"train.num_steps": NUM_STEPS, "train.eval_every": 0, "ckpt.every_steps": SAVED}


def _uninterrupted(corpus: pathlib.Path, workdir: pathlib.Path, dropout_rate: float) -> pathlib.Path:
    """1 device, steps 1..8 without a stop, checkpoints at 4 and 8."""
    config = tiny_train_config(corpus, num_steps=NUM_STEPS, eval_every=0)
    config.ckpt.every_steps, config.model.dropout_rate = SAVED, dropout_rate
    loop.train_and_evaluate(config, workdir)
    assert checkpoints.list_steps(workdir) == [SAVED, NUM_STEPS]
    return workdir


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pathlib.Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _losses(workdir: pathlib.Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(workdir / "metrics.jsonl") if "loss" in r}


def _resumed_on_4_devices(reference: pathlib.Path, corpus: pathlib.Path, tmp_path: pathlib.Path, **overrides):
    """The reference workdir as it was when step 4 had been saved, continued to step 8 on 4 devices; the losses of
    steps 5..8 are compared with the reference's."""
    workdir = tmp_path / "resumed"
    shutil.copytree(reference, workdir)
    shutil.rmtree(workdir / "checkpoints" / str(NUM_STEPS))
    output = train_py_on_devices(4, workdir, corpus, **OVERRIDES, **overrides)
    assert f"resumed from the checkpoint at step {SAVED}" in output
    one, four = _losses(reference), _losses(workdir)
    assert sorted(four) == list(range(1, NUM_STEPS + 1))  # 1..4 from the first run, 5..8 from the resumed one
    after = range(SAVED + 1, NUM_STEPS + 1)
    np.testing.assert_allclose([four[s] for s in after], [one[s] for s in after], rtol=RTOL)
    assert checkpoints.list_steps(workdir) == [SAVED, NUM_STEPS]


@pytest.mark.parametrize("mesh", ["data", "fsdp"])
def test_a_one_device_run_resumes_on_four_devices_with_the_same_losses(corpus, tmp_path, mesh):
    reference = _uninterrupted(corpus, tmp_path / "one", dropout_rate=0.1)
    _resumed_on_4_devices(reference, corpus, tmp_path, **{"train.mesh": mesh})


def test_micro_batches_of_the_same_global_batch_resume_with_the_same_losses_without_dropout(corpus, tmp_path):
    """The global batch of 8 rows as 2 micro-batches of 4 (1 row per device): the same sum over the same tokens.
    Without dropout the losses are the uninterrupted run's; with dropout each micro-batch draws its own masks, so
    they agree only statistically (docs/reliability.md)."""
    reference = _uninterrupted(corpus, tmp_path / "one", dropout_rate=0.0)
    overrides = {"train.mesh": "data", "train.grad_accum_steps": 2, "model.dropout_rate": 0.0}
    _resumed_on_4_devices(reference, corpus, tmp_path, **overrides)
