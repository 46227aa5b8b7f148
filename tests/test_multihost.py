"""A real multi-process launch on one machine: train.py as 2 JAX processes (one CPU device each, gloo collectives)
joined through JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, exactly as the README launches hosts.

It must train on exactly the batches of one process with 2 devices (bucketed shapes vary per batch, so the hosts
must agree on every shape), stop together when only one process gets SIGTERM, write each checkpoint as 2 processes
and resume from it, and write metrics once.
"""

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import REPO
from tests.helpers.training import tiny_train_config, wait_for_checkpoint
from transformer_jax import data
from transformer_jax.model.layers import SpecialIds
from transformer_jax.training import checkpoints, loop
from transformer_jax.training.metrics import read_metrics

CONFIG = REPO / "tests" / "tiny_train_config.py"


def _command(corpus: pathlib.Path, workdir: pathlib.Path, num_steps: int, **extra: object) -> list[str]:
    overrides = {
        "data.text_dir": corpus,
        "data.batching": "bucket",  # shapes vary from batch to batch: the hard case for several hosts
        "data.tokens_per_batch": 256,
        "train.num_steps": num_steps,
        "train.eval_every": 3,
        "ckpt.every_steps": 3,
        "data.tokenizer_model": corpus.parent / "spm.model",
        **extra,
    }
    args = [f"--config.{k}={v}" for k, v in overrides.items()]
    return [sys.executable, str(REPO / "train.py"), "--config", str(CONFIG), "--workdir", str(workdir), *args]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def _start(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[str]:
    """Waits for every process; fails with the output of any that did not exit 0."""
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            proc.kill()
    for i, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"process {i} of {len(procs)} failed:\n{out[-4000:]}"
    return outputs


def _start_two(corpus: pathlib.Path, workdir: pathlib.Path, num_steps: int, **extra: object) -> list[subprocess.Popen]:
    """train.py as process 0 and process 1 of a 2-process JAX run, joined the way the README launches hosts."""
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = []
    for process_id in range(2):
        env = _env(
            JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(process_id),
            XLA_FLAGS=os.environ.get("XLA_FLAGS", ""),
        )
        procs.append(_start(_command(corpus, workdir, num_steps, **extra), env))
    return procs


def _losses(workdir: pathlib.Path) -> tuple[list[int], list[float], dict[int, float]]:
    records = read_metrics(workdir / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    valid = {r["step"]: r["valid_loss"] for r in records if "valid_loss" in r}
    return [r["step"] for r in train], [r["loss"] for r in train], valid


def _shared_tokenizer(corpus: pathlib.Path) -> None:
    """One tokenizer and one tokenized store for every run, built once beforehand as the README says for
    multi-host runs (each would refuse to build its own)."""
    config = tiny_train_config(corpus)
    tokenizer = data.get_tokenizer(
        config.data, corpus.parent, vocab_size=config.model.vocab_size, ids=SpecialIds.of(config)
    )
    data.open_train_store(config.data, tokenizer, build_if_missing=True)


def test_two_processes_launch_train_and_checkpoint_together(corpus, tmp_path):
    """The fast representative of the slow test below: the README's launch of 2 JAX processes (one device each,
    packed batches of one shape, so one compilation) trains to the end, logs each step once and writes one
    checkpoint. Bucketed shapes and validation over hosts are the slow test's; tests/test_data_pipeline.py checks
    that hosts plan the same global batches."""
    _shared_tokenizer(corpus)
    fast = {"data.batching": "pack", "data.batch_size": 8, "train.eval_every": 0}
    _finish(_start_two(corpus, tmp_path, 3, **fast))
    steps, losses, _ = _losses(tmp_path)
    assert steps == [1, 2, 3], "each step is logged once, by process 0 only"
    assert np.isfinite(losses).all()
    assert checkpoints.list_steps(tmp_path) == [3]


@pytest.mark.slow  # ~70-140 s: three launches of train.py and one of evaluate.py
def test_two_processes_train_stop_and_resume_exactly_like_one_process_with_two_devices(corpus, tmp_path):
    _shared_tokenizer(corpus)
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
    _finish([_start(_command(corpus, tmp_path / "one", 32), _env(XLA_FLAGS=flags))])

    # SIGTERM reaches only process 1 (launchers signal hosts at different moments): both must stop at the same
    # step and write that checkpoint together, or process 0 would wait forever in the next step's collectives.
    procs = _start_two(corpus, tmp_path / "two", 1000)
    wait_for_checkpoint(procs, tmp_path / "two", 3, timeout=300)
    procs[1].send_signal(signal.SIGTERM)
    outputs = _finish(procs)
    stops = [re.findall(r"SIGTERM: saved the checkpoint at step (\d+)", out) for out in outputs]
    assert stops[0] == stops[1] and len(stops[0]) == 1, stops
    stop = int(stops[0][0])
    assert stop % loop.STOP_CHECK_EVERY == 0 and stop in checkpoints.list_steps(tmp_path / "two")
    assert stop <= 30, f"stopped at step {stop}, later than the reference run covers; the machine was too slow"

    _finish(_start_two(corpus, tmp_path / "two", stop + 2))  # both processes resume from the stop
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert two[0] == list(range(1, stop + 3)), "each step is logged once, by process 0 only"
    np.testing.assert_allclose(two[1], one[1][: stop + 2], rtol=1e-5)  # train losses
    common = sorted(set(one[2]) & set(two[2]))
    assert len(common) >= 3
    np.testing.assert_allclose([two[2][k] for k in common], [one[2][k] for k in common], rtol=1e-5)  # validation

    # The checkpoints that 2 processes wrote translate in 1 process with 1 device (every test line, once).
    hypotheses = tmp_path / "test.hyp"
    command = [sys.executable, str(REPO / "evaluate.py"), "--workdir", str(tmp_path / "two"), "--split", "test"]
    _finish([_start([*command, "--average_last", "2", "--output_file", str(hypotheses)], _env())])
    assert len(hypotheses.read_text(encoding="utf-8").splitlines()) == len(
        (corpus / "test.en").read_text().splitlines()
    )
